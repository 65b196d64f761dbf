//! cgroups for each attempt, v1 or v2, found at run time from `/proc/self/mountinfo` and
//! `/proc/self/cgroup`. A host may have both: v1 hierarchies for the controllers and a v2
//! tree with none of them but with `cgroup.kill`. Each attempt gets a cgroup in every
//! usable hierarchy, below the node's own cgroup, and they are always removed at cleanup.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A cgroup operation that failed.
#[derive(Debug, thiserror::Error)]
#[error("{what} {}: {source}", path.display())]
pub struct CgroupError {
    what: &'static str,
    path: PathBuf,
    source: std::io::Error,
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> CgroupError + 'a {
    move |source| CgroupError {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Limits for an attempt's cgroup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CgroupLimits {
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// Swap in bytes on top of the memory.
    pub swap_bytes: u64,
    /// Processes and threads.
    pub processes: u64,
    /// CPU in thousandths of a core.
    pub cpu_millicores: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    V1(&'static str),
    V2,
}

/// The cgroup hierarchies this executor can use.
#[derive(Clone, Debug, Default)]
pub struct Cgroups {
    /// `(controller, base directory)` for each usable v1 hierarchy.
    v1: Vec<(&'static str, PathBuf)>,
    /// The v2 base directory and the controllers enabled below it.
    v2: Option<(PathBuf, Vec<String>)>,
}

/// The v1 controllers an attempt gets a cgroup in. `cpuacct` only counts (CPU time); where
/// it is mounted together with `cpu` the `cpu` cgroup already holds its files.
const V1_CONTROLLERS: [&str; 5] = ["memory", "pids", "cpu", "cpuacct", "freezer"];

impl Cgroups {
    /// Finds the hierarchies and creates `<own cgroup>/cannabis/<name>` in each one that
    /// takes it. `name` keeps two executors on one machine apart.
    pub fn detect(name: &str) -> Self {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let mut found = Self::default();
        for m in parse_mountinfo(&mountinfo) {
            let Some(own_path) = own_path(&own, &m) else {
                continue;
            };
            let rel = own_path
                .strip_prefix(&m.root)
                .unwrap_or(&own_path)
                .trim_start_matches('/')
                .to_string();
            let own_dir = m.mount_point.join(rel);
            let base = own_dir.join("cannabis").join(name);
            if fs::create_dir_all(&base).is_err() {
                continue;
            }
            match m.kind {
                Kind::V1(c) => found.v1.push((c, base)),
                Kind::V2 => {
                    let controllers = enable_v2_controllers(&own_dir, &base);
                    found.v2 = Some((base, controllers));
                }
            }
        }
        // A v2 tree without controllers (a hybrid host) only adds `cgroup.kill`, which the
        // v1 freezer replaces (freeze, kill, thaw). Leaving it out matters: a process moves
        // into a v1 cgroup by itself without the kernel's global lock, but any move into a
        // v2 cgroup takes it, and after an idle moment that waits ~10 ms for the other CPUs.
        if found.has_v1("freezer")
            && found.v2.as_ref().is_some_and(|(_, cs)| cs.is_empty())
            && let Some((base, _)) = found.v2.take()
        {
            remove_base_dir(&base);
        }
        found
    }

    /// Whether any hierarchy can hold an attempt: without one, its processes can be neither
    /// listed nor killed together.
    pub fn is_usable(&self) -> bool {
        !self.v1.is_empty() || self.v2.is_some()
    }

    fn has_v1(&self, controller: &str) -> bool {
        self.v1.iter().any(|(c, _)| *c == controller)
    }

    fn has_v2(&self, controller: &str) -> bool {
        self.v2
            .as_ref()
            .is_some_and(|(_, cs)| cs.iter().any(|c| c == controller))
    }

    /// Whether memory can be limited.
    pub fn memory(&self) -> bool {
        self.has_v1("memory") || self.has_v2("memory")
    }

    /// Whether swap can be limited to a given amount (v1 `memsw` or v2 `memory.swap.max`);
    /// without it swap can only be turned off.
    pub fn swap_limit(&self) -> bool {
        self.has_v2("memory")
            || self
                .v1
                .iter()
                .any(|(c, b)| *c == "memory" && b.join("memory.memsw.limit_in_bytes").exists())
    }

    /// Whether the process count can be limited.
    pub fn pids(&self) -> bool {
        self.has_v1("pids") || self.has_v2("pids")
    }

    /// Whether CPU time can be limited.
    pub fn cpu(&self) -> bool {
        self.has_v1("cpu") || self.has_v2("cpu")
    }

    /// How a whole process tree is killed at once: `cgroup.kill`, the v1 freezer, or
    /// `None` (then only signal by signal).
    pub fn kill_method(&self) -> Option<&'static str> {
        if self
            .v2
            .as_ref()
            .is_some_and(|(b, _)| b.join("cgroup.kill").exists())
        {
            Some("cgroup.kill")
        } else if self.has_v1("freezer") {
            Some("freezer")
        } else {
            None
        }
    }

    /// A short description for people: `v1 memory, pids, cpu, freezer; v2 cgroup.kill`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.v1.is_empty() {
            let names: Vec<&str> = self.v1.iter().map(|(c, _)| *c).collect();
            parts.push(format!("v1 {}", names.join(", ")));
        }
        if let Some((_, cs)) = &self.v2 {
            let mut names = cs.clone();
            if self.kill_method() == Some("cgroup.kill") {
                names.push("cgroup.kill".into());
            }
            parts.push(format!("v2 {}", names.join(", ")));
        }
        if parts.is_empty() {
            "none usable".into()
        } else {
            parts.join("; ")
        }
    }

    fn dirs(&self, name: &str) -> Vec<(Kind, PathBuf)> {
        // With `cgroup.kill` the freezer is not needed to kill a tree at once.
        let skip_freezer = self.kill_method() == Some("cgroup.kill");
        let mut dirs: Vec<(Kind, PathBuf)> = self
            .v1
            .iter()
            .filter(|(c, _)| !(skip_freezer && *c == "freezer"))
            .map(|(c, b)| (Kind::V1(c), b.join(name)))
            .collect();
        if let Some((b, _)) = &self.v2 {
            dirs.push((Kind::V2, b.join(name)));
        }
        dirs
    }

    /// Creates the attempt's cgroups and sets the limits. A limit that cannot be set is an
    /// error: nothing is silently weakened.
    pub fn create(&self, name: &str, limits: &CgroupLimits) -> Result<JobCgroup, CgroupError> {
        let job = JobCgroup {
            dirs: self.dirs(name),
        };
        for (kind, dir) in &job.dirs {
            fs::create_dir_all(dir).map_err(io("creating", dir))?;
            let set = |file: &str, value: String| {
                let path = dir.join(file);
                fs::write(&path, value).map_err(io("writing", &path))
            };
            match kind {
                Kind::V1("memory") => {
                    set("memory.limit_in_bytes", limits.memory_bytes.to_string())?;
                    if dir.join("memory.memsw.limit_in_bytes").exists() {
                        let total = limits.memory_bytes.saturating_add(limits.swap_bytes);
                        set("memory.memsw.limit_in_bytes", total.to_string())?;
                    } else if limits.swap_bytes == 0 {
                        set("memory.swappiness", "0".into())?;
                    }
                }
                Kind::V1("pids") => set("pids.max", limits.processes.to_string())?,
                Kind::V1("cpu") => {
                    set("cpu.cfs_period_us", "100000".into())?;
                    let quota = (limits.cpu_millicores * 100).max(1000);
                    set("cpu.cfs_quota_us", quota.to_string())?;
                }
                Kind::V1(_) => {}
                Kind::V2 => {
                    if self.has_v2("memory") {
                        set("memory.max", limits.memory_bytes.to_string())?;
                        set("memory.swap.max", limits.swap_bytes.to_string())?;
                    }
                    if self.has_v2("pids") {
                        set("pids.max", limits.processes.to_string())?;
                    }
                    if self.has_v2("cpu") {
                        let quota = (limits.cpu_millicores * 100).max(1000);
                        set("cpu.max", format!("{quota} 100000"))?;
                    }
                }
            }
        }
        Ok(job)
    }

    /// Removes this executor's own directories if no attempt cgroup is left in them.
    pub fn remove_base(&self) {
        let mut bases: Vec<&PathBuf> = self.v1.iter().map(|(_, b)| b).collect();
        if let Some((b, _)) = &self.v2 {
            bases.push(b);
        }
        for b in bases {
            remove_base_dir(b);
        }
    }

    /// The attempt's cgroups as they are (after a restart); they may not exist.
    pub fn open(&self, name: &str) -> JobCgroup {
        JobCgroup {
            dirs: self.dirs(name),
        }
    }

    /// Names of the attempt cgroups that exist now, in any hierarchy.
    pub fn existing(&self) -> Vec<String> {
        let mut bases: Vec<&PathBuf> = self.v1.iter().map(|(_, b)| b).collect();
        if let Some((b, _)) = &self.v2 {
            bases.push(b);
        }
        let mut names: Vec<String> = bases
            .into_iter()
            .filter_map(|b| fs::read_dir(b).ok())
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        names.sort();
        names.dedup();
        names
    }
}

/// Removes an executor's base directory and `<own>/cannabis` above it, where empty.
fn remove_base_dir(base: &Path) {
    let _ = fs::remove_dir(base);
    // `<own>/cannabis`, once no executor uses it.
    if let Some(parent) = base.parent() {
        let _ = fs::remove_dir(parent);
    }
}

/// Moves the calling process into the cgroups whose entry files (from
/// [`JobCgroup::entry_files`]) are given, by writing `0` to each. The process must have one
/// thread: a v1 `tasks` file moves only the caller's.
pub(super) fn enter_self(entry_files: &[PathBuf]) -> Result<(), CgroupError> {
    for path in entry_files {
        let named = path
            .file_name()
            .is_some_and(|n| n == "tasks" || n == "cgroup.procs");
        if !named {
            return Err(io("entering", path)(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a cgroup's tasks or cgroup.procs file",
            )));
        }
        fs::write(path, "0").map_err(io("entering", path))?;
    }
    Ok(())
}

/// What an attempt's processes used, as its cgroups counted it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CgroupUsage {
    /// CPU time of every process of the attempt together, in milliseconds.
    pub cpu_ms: Option<u64>,
    /// The most memory the attempt held at once, in bytes (page cache included).
    pub peak_memory_bytes: Option<u64>,
}

/// One attempt's cgroups.
#[derive(Clone, Debug)]
pub struct JobCgroup {
    dirs: Vec<(Kind, PathBuf)>,
}

impl JobCgroup {
    /// The file a single-threaded process writes `0` to in order to move itself into each
    /// of the attempt's cgroups ([`enter_self`]). For v1 it is `tasks`: moving one thread,
    /// the caller itself, is the one move the kernel makes without its global
    /// `cgroup_threadgroup_rwsem`, whose write side waits for an RCU grace period when no
    /// move happened just before (~10 ms). Writing a pid to `cgroup.procs` always takes it.
    pub fn entry_files(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .map(|(kind, dir)| match kind {
                Kind::V1(_) => dir.join("tasks"),
                Kind::V2 => dir.join("cgroup.procs"),
            })
            .collect()
    }

    /// Whether process `pid` is in every one of the attempt's cgroups, from its
    /// `/proc/<pid>/cgroup` (one read, where scanning each `cgroup.procs` takes one per
    /// hierarchy). Each line's path is relative to a hierarchy's root; ours end with it.
    pub fn holds(&self, pid: u32) -> bool {
        fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|text| self.holds_in(&text))
    }

    /// [`JobCgroup::holds`] for the text of a `/proc/<pid>/cgroup` file.
    fn holds_in(&self, text: &str) -> bool {
        self.dirs.iter().all(|(kind, dir)| {
            text.lines().any(|line| {
                let mut parts = line.splitn(3, ':');
                let (Some(_), Some(controllers), Some(path)) =
                    (parts.next(), parts.next(), parts.next())
                else {
                    return false;
                };
                let hierarchy = match kind {
                    Kind::V2 => controllers.is_empty(),
                    Kind::V1(c) => controllers.split(',').any(|x| x == *c),
                };
                let rel = path.trim_start_matches('/');
                hierarchy && !rel.is_empty() && dir.ends_with(rel)
            })
        })
    }

    /// Every process in any of the attempt's cgroups.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .dirs
            .iter()
            .filter_map(|(_, d)| fs::read_to_string(d.join("cgroup.procs")).ok())
            .flat_map(|text| {
                text.lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect::<Vec<u32>>()
            })
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Whether no process is left (a cgroup that no longer exists is empty). Stops at the
    /// first cgroup that holds one.
    pub fn is_empty(&self) -> bool {
        // A v1 `cgroup.procs` keeps listing a process that has exited until its parent
        // reaps it; such a process runs nothing and holds nothing.
        let ended = |pid: &str| {
            fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
                stat.rsplit_once(") ")
                    .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X'))
            })
        };
        self.dirs.iter().all(|(_, dir)| {
            fs::read_to_string(dir.join("cgroup.procs"))
                .map_or(true, |procs| procs.split_whitespace().all(ended))
        })
    }

    /// Waits up to `within` for the tree to end by itself (after the monitor reported the
    /// end); `true` once the cgroups are seen empty. Kills nothing.
    pub fn wait_empty(&self, within: Duration) -> bool {
        self.until_empty(within, Duration::from_millis(2), || {})
    }

    /// Looks until the cgroups are empty or `within` has passed, calling `between` before
    /// each pause. A tree that is ending is usually gone within a millisecond: the pauses
    /// start at 20 µs and double up to `longest`.
    fn until_empty(&self, within: Duration, longest: Duration, mut between: impl FnMut()) -> bool {
        let until = Instant::now() + within;
        let mut pause = Duration::from_micros(20);
        loop {
            if self.is_empty() {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            between();
            std::thread::sleep(pause);
            pause = (pause * 2).min(longest);
        }
    }

    /// Kills the whole tree at once: `cgroup.kill` where the kernel has it, else freeze,
    /// kill each process, thaw. Does not wait; see [`JobCgroup::kill_and_confirm`].
    pub fn kill(&self) {
        for (kind, dir) in &self.dirs {
            if *kind == Kind::V2
                && dir.join("cgroup.kill").exists()
                && fs::write(dir.join("cgroup.kill"), "1").is_ok()
            {
                return;
            }
        }
        let freezer = self
            .dirs
            .iter()
            .find(|(k, d)| *k == Kind::V1("freezer") && d.exists())
            .map(|(_, d)| d.join("freezer.state"));
        if let Some(state) = &freezer {
            let _ = fs::write(state, "FROZEN");
            // Usually frozen within microseconds; a task in the middle of a system call
            // takes longer. Look soon, then less often.
            let until = Instant::now() + Duration::from_secs(1);
            let mut pause = Duration::from_micros(20);
            while Instant::now() < until
                && fs::read_to_string(state).is_ok_and(|s| s.trim() != "FROZEN")
            {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(5));
            }
        }
        for pid in self.pids() {
            if let Ok(pid) = i32::try_from(pid) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
        if let Some(state) = &freezer {
            let _ = fs::write(state, "THAWED");
        }
    }

    /// Kills the tree and waits up to `within` for every process to be gone. `true` only
    /// when the cgroups were seen empty.
    pub fn kill_and_confirm(&self, within: Duration) -> bool {
        self.until_empty(within, Duration::from_millis(10), || self.kill())
    }

    /// Whether the kernel's OOM killer acted in this cgroup.
    pub fn oom_killed(&self) -> bool {
        self.dirs.iter().any(|(kind, dir)| {
            let (file, key) = match kind {
                Kind::V1("memory") => ("memory.oom_control", "oom_kill"),
                Kind::V2 => ("memory.events", "oom_kill"),
                Kind::V1(_) => return false,
            };
            fs::read_to_string(dir.join(file)).is_ok_and(|text| {
                text.lines().any(|l| {
                    l.strip_prefix(key)
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .is_some_and(|n| n > 0)
                })
            })
        })
    }

    /// What the attempt's processes used so far, as the kernel counted it: CPU time from
    /// `cpuacct.usage` (v1) or `cpu.stat` (v2), the memory high-water mark from
    /// `memory.max_usage_in_bytes` (v1) or `memory.peak` (v2, Linux 5.19 and later). A
    /// figure the host cannot count is `None`, never a guess.
    pub fn usage(&self) -> CgroupUsage {
        let read = |dir: &Path, file: &str| fs::read_to_string(dir.join(file)).ok();
        let number = |text: Option<String>| text.and_then(|t| t.trim().parse::<u64>().ok());
        let mut usage = CgroupUsage::default();
        for (kind, dir) in &self.dirs {
            match kind {
                Kind::V1("cpu" | "cpuacct") if usage.cpu_ms.is_none() => {
                    usage.cpu_ms = number(read(dir, "cpuacct.usage")).map(|ns| ns / 1_000_000);
                }
                Kind::V1("memory") => {
                    usage.peak_memory_bytes = number(read(dir, "memory.max_usage_in_bytes"));
                }
                Kind::V2 => {
                    if usage.cpu_ms.is_none() {
                        usage.cpu_ms = read(dir, "cpu.stat").and_then(|t| {
                            t.lines()
                                .find_map(|l| l.strip_prefix("usage_usec "))
                                .and_then(|v| v.trim().parse::<u64>().ok())
                                .map(|us| us / 1_000)
                        });
                    }
                    if usage.peak_memory_bytes.is_none() {
                        usage.peak_memory_bytes = number(read(dir, "memory.peak"));
                    }
                }
                Kind::V1(_) => {}
            }
        }
        usage
    }

    /// Removes the cgroups; they must be empty.
    pub fn remove(&self) -> Result<(), CgroupError> {
        for (_, dir) in &self.dirs {
            match fs::remove_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("removing", dir)(e)),
            }
        }
        Ok(())
    }
}

struct Mount {
    kind: Kind,
    root: String,
    mount_point: PathBuf,
}

fn parse_mountinfo(text: &str) -> Vec<Mount> {
    let mut out: Vec<Mount> = Vec::new();
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let l: Vec<&str> = left.split_whitespace().collect();
        let r: Vec<&str> = right.split_whitespace().collect();
        if l.len() < 5 || r.len() < 3 {
            continue;
        }
        let (root, mount_point) = (l[3].to_string(), PathBuf::from(l[4]));
        match r[0] {
            "cgroup2" => out.push(Mount {
                kind: Kind::V2,
                root,
                mount_point,
            }),
            "cgroup" => {
                for c in V1_CONTROLLERS {
                    let same_mount = out.iter().any(|m| m.mount_point == mount_point);
                    if r[2].split(',').any(|o| o == c)
                        && !out.iter().any(|m| m.kind == Kind::V1(c))
                        && !(c == "cpuacct" && same_mount)
                    {
                        out.push(Mount {
                            kind: Kind::V1(c),
                            root: root.clone(),
                            mount_point: mount_point.clone(),
                        });
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// This process's path in the hierarchy of `m`, from `/proc/self/cgroup`.
fn own_path(text: &str, m: &Mount) -> Option<String> {
    text.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let matches = match m.kind {
            Kind::V2 => controllers.is_empty(),
            Kind::V1(c) => controllers.split(',').any(|x| x == c),
        };
        matches.then(|| path.to_string())
    })
}

/// Enables the memory, pids and cpu controllers from the node's own cgroup down to the
/// children of `base`, where the tree allows it (a non-root cgroup that holds processes
/// cannot hand controllers down), and returns those that are on.
fn enable_v2_controllers(own: &Path, base: &Path) -> Vec<String> {
    let available = fs::read_to_string(own.join("cgroup.controllers")).unwrap_or_default();
    let chain: Vec<&Path> = base
        .ancestors()
        .take_while(|p| p.starts_with(own))
        .collect();
    let mut on = Vec::new();
    for c in ["memory", "pids", "cpu"] {
        if !available.split_whitespace().any(|x| x == c) {
            continue;
        }
        let enabled = chain
            .iter()
            .rev()
            .all(|dir| fs::write(dir.join("cgroup.subtree_control"), format!("+{c}")).is_ok());
        if enabled {
            on.push(c.to_string());
        }
    }
    on
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    const OWN: &str = "\
8:pids:/
6:freezer:/
4:memory:/process_api/9f53
1:cpu,cpuacct:/
0::/user.slice/x.scope
";

    #[test]
    fn hybrid_hosts_give_v1_controllers_and_a_v2_tree() {
        let mounts = parse_mountinfo(MOUNTINFO);
        let kinds: Vec<Kind> = mounts.iter().map(|m| m.kind).collect();
        assert_eq!(
            kinds,
            [
                Kind::V1("cpu"),
                Kind::V1("memory"),
                Kind::V1("freezer"),
                Kind::V1("pids"),
                Kind::V2
            ]
        );
        let memory = &mounts[1];
        assert_eq!(own_path(OWN, memory).as_deref(), Some("/process_api/9f53"));
        assert_eq!(own_path(OWN, &mounts[0]).as_deref(), Some("/"));
        assert_eq!(
            own_path(OWN, &mounts[4]).as_deref(),
            Some("/user.slice/x.scope")
        );
    }

    #[test]
    fn membership_is_read_from_the_process_cgroup_file() {
        let job = JobCgroup {
            dirs: vec![
                (
                    Kind::V1("memory"),
                    PathBuf::from("/sys/fs/cgroup/memory/process_api/9f53/cannabis/ab/run"),
                ),
                (
                    Kind::V1("pids"),
                    PathBuf::from("/sys/fs/cgroup/pids/cannabis/ab/run"),
                ),
            ],
        };
        let inside = "8:pids:/cannabis/ab/run\n4:memory:/process_api/9f53/cannabis/ab/run\n";
        let outside = "8:pids:/cannabis/ab/run\n4:memory:/process_api/9f53\n";
        assert!(job.holds_in(inside));
        assert!(!job.holds_in(outside));
        assert!(!job.holds_in("8:pids:/\n4:memory:/\n"));
    }

    #[test]
    fn a_process_enters_only_through_a_cgroup_file() {
        let dir = tempfile::tempdir().unwrap();
        let other = dir.path().join("notes");
        fs::write(&other, "kept").unwrap();
        let err = enter_self(std::slice::from_ref(&other)).unwrap_err();
        assert!(err.to_string().contains("not a cgroup"), "{err}");
        assert_eq!(fs::read_to_string(&other).unwrap(), "kept");
    }

    #[test]
    fn cpu_time_is_counted_in_cpuacct_whether_or_not_it_shares_the_cpu_mount() {
        let apart = parse_mountinfo(
            "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n\
             33 31 0:30 / /sys/fs/cgroup/cpuacct rw - cgroup cgroup rw,cpuacct\n",
        );
        let kinds: Vec<Kind> = apart.iter().map(|m| m.kind).collect();
        assert_eq!(kinds, [Kind::V1("cpu"), Kind::V1("cpuacct")]);
        // Mounted together, the one `cpu` cgroup holds `cpuacct.usage`: no second cgroup.
        let together = parse_mountinfo(
            "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n",
        );
        let kinds: Vec<Kind> = together.iter().map(|m| m.kind).collect();
        assert_eq!(kinds, [Kind::V1("cpu")]);
    }

    #[test]
    fn usage_is_read_from_the_cgroup_files() {
        let dir = tempfile::tempdir().unwrap();
        let (cpu, memory, v2) = (
            dir.path().join("cpu"),
            dir.path().join("memory"),
            dir.path().join("v2"),
        );
        for d in [&cpu, &memory, &v2] {
            fs::create_dir_all(d).unwrap();
        }
        fs::write(cpu.join("cpuacct.usage"), "2500000000\n").unwrap();
        fs::write(memory.join("memory.max_usage_in_bytes"), "73400320\n").unwrap();
        let v1 = JobCgroup {
            dirs: vec![(Kind::V1("cpu"), cpu), (Kind::V1("memory"), memory)],
        };
        let want = CgroupUsage {
            cpu_ms: Some(2_500),
            peak_memory_bytes: Some(73_400_320),
        };
        assert_eq!(v1.usage(), want);
        fs::write(
            v2.join("cpu.stat"),
            "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n",
        )
        .unwrap();
        fs::write(v2.join("memory.peak"), "73400320\n").unwrap();
        let unified = JobCgroup {
            dirs: vec![(Kind::V2, v2.clone())],
        };
        assert_eq!(unified.usage(), want);
        // A kernel without `memory.peak` gives no figure rather than a wrong one.
        fs::remove_file(v2.join("memory.peak")).unwrap();
        assert_eq!(unified.usage().peak_memory_bytes, None);
    }

    #[test]
    fn a_pure_v2_host_is_found() {
        let mounts = parse_mountinfo(
            "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
        );
        assert_eq!(mounts.len(), 1);
        assert_eq!(mounts[0].kind, Kind::V2);
        assert_eq!(mounts[0].mount_point, PathBuf::from("/sys/fs/cgroup"));
    }
}

//! The host's look at a running sandbox before the command starts: what the kernel says
//! about pid 1, not what the sandbox says about itself.

use std::fs;

use cannabis_protocol::IsolationLayer;

use super::JobCgroup;

/// The isolation layers seen in effect on a running sandbox's pid 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxCheck {
    /// Host pid of the sandbox's pid 1.
    pub pid: u32,
    /// Layers in effect, sorted.
    pub layers: Vec<IsolationLayer>,
}

/// Looks at `/proc/<pid>` of the sandbox's pid 1: namespaces against the host's, its host
/// uid, capabilities, `no_new_privs`, seccomp mode, rlimits, network interfaces, the work
/// directory's mount, and membership of the attempt's cgroups. `reported` is what pid 1
/// said it applied that the host cannot see (Landlock).
pub fn check_running(
    pid: u32,
    cgroup: &JobCgroup,
    cgroup_layers: &[IsolationLayer],
    reported: &str,
) -> Result<SandboxCheck, String> {
    let proc_dir = format!("/proc/{pid}");
    let status =
        fs::read_to_string(format!("{proc_dir}/status")).map_err(|e| format!("{proc_dir}: {e}"))?;
    let field = |name: &str| -> &str {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name).map(str::trim))
            .unwrap_or("")
    };
    let ns_differs = |ns: &str| {
        let theirs = fs::read_link(format!("{proc_dir}/ns/{ns}")).ok();
        let ours = own_namespace(ns);
        theirs.is_some() && ours.is_some() && theirs != ours
    };
    let uid_unprivileged = field("Uid:")
        .split_whitespace()
        .all(|u| u.parse::<u32>().is_ok_and(|u| u != 0));
    let mut layers = Vec::new();
    if ns_differs("user") && uid_unprivileged {
        layers.push(IsolationLayer::UserNamespace);
    }
    let mountinfo = fs::read_to_string(format!("{proc_dir}/mountinfo")).unwrap_or_default();
    if ns_differs("mnt") {
        layers.push(IsolationLayer::MountNamespace);
    }
    let nspid = field("NSpid:");
    if ns_differs("pid")
        && nspid.split_whitespace().count() >= 2
        && nspid.split_whitespace().last() == Some("1")
    {
        layers.push(IsolationLayer::PidNamespace);
    }
    let interfaces: Vec<String> = fs::read_to_string(format!("{proc_dir}/net/dev"))
        .unwrap_or_default()
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next().map(|n| n.trim().to_string()))
        .collect();
    if ns_differs("net") && interfaces.iter().all(|i| i == "lo") {
        layers.push(IsolationLayer::NetworkNamespace);
    }
    if ns_differs("ipc") && ns_differs("uts") {
        layers.push(IsolationLayer::IpcUtsNamespace);
    }
    let no_caps = ["CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"]
        .iter()
        .all(|f| field(f).chars().all(|c| c == '0') && !field(f).is_empty());
    if no_caps && field("NoNewPrivs:") == "1" {
        layers.push(IsolationLayer::NoPrivileges);
    }
    if field("Seccomp:") == "2" && reported.split_whitespace().any(|l| l == "seccomp") {
        layers.push(IsolationLayer::Seccomp);
    }
    if reported.split_whitespace().any(|l| l == "landlock") {
        layers.push(IsolationLayer::Landlock);
    }
    let limits = fs::read_to_string(format!("{proc_dir}/limits")).unwrap_or_default();
    let core_off = limits
        .lines()
        .any(|l| l.starts_with("Max core file size") && l.split_whitespace().nth(4) == Some("0"));
    if core_off && reported.split_whitespace().any(|l| l == "rlimits") {
        layers.push(IsolationLayer::Rlimits);
    }
    let work_is_tmpfs = mountinfo.lines().any(|l| {
        let Some((left, right)) = l.split_once(" - ") else {
            return false;
        };
        left.split_whitespace().nth(4) == Some("/work")
            && right.starts_with("tmpfs ")
            && right.contains("size=")
    });
    if work_is_tmpfs {
        layers.push(IsolationLayer::BoundedWorkdir);
    }
    if cgroup.holds(pid) {
        layers.extend_from_slice(cgroup_layers);
    }
    layers.sort();
    layers.dedup();
    Ok(SandboxCheck { pid, layers })
}

/// This process's namespace link for `ns` (`user`, `mnt`, ...), read once: the host does
/// not change namespaces.
fn own_namespace(ns: &str) -> Option<std::path::PathBuf> {
    use std::sync::OnceLock;
    static OWN: OnceLock<Vec<(&'static str, Option<std::path::PathBuf>)>> = OnceLock::new();
    OWN.get_or_init(|| {
        ["user", "mnt", "pid", "net", "ipc", "uts"]
            .into_iter()
            .map(|ns| (ns, fs::read_link(format!("/proc/self/ns/{ns}")).ok()))
            .collect()
    })
    .iter()
    .find(|(name, _)| *name == ns)
    .and_then(|(_, link)| link.clone())
}

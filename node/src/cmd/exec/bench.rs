//! `cannabis exec bench`: the sandbox's start-up against a plain spawn and bubblewrap, and
//! the synthetic task against a plain f32 matrix product, measured in the same run.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cannabis_protocol::Digest;
use cannabis_runtime::sandbox::{self, CgroupLimits, Cgroups, Rlimits, SandboxSpec};
use serde::Serialize;

use crate::output::{self, out};

/// Medians of one round, milliseconds.
#[derive(Serialize)]
struct Medians {
    plain: f64,
    bwrap: Option<f64>,
    ours: f64,
}

impl Medians {
    fn print(&self, what: &str) -> anyhow::Result<()> {
        out!("{what}:")?;
        out!("  plain spawn              {:>8.2} ms", self.plain)?;
        match self.bwrap {
            Some(b) => out!("  bwrap --unshare-all      {b:>8.2} ms")?,
            None => {
                out!("  bwrap --unshare-all      not available (apt-get install bubblewrap)")?;
            }
        }
        out!(
            "  cannabis sandbox         {:>8.2} ms  (cgroups, namespaces, root, confinement, host check, cleanup)",
            self.ours
        )?;
        if let Some(b) = self.bwrap {
            out!("  sandbox / bwrap          {:>8.2}x", self.ours / b)?;
        }
        out!(
            "  sandbox / plain          {:>8.2}x",
            self.ours / self.plain
        )?;
        Ok(())
    }
}

#[derive(Serialize)]
struct Figures {
    runs: u32,
    back_to_back: Medians,
    after_pause: Medians,
    zygote_start_ms: f64,
    size: u32,
    synthetic_ms: f64,
    sgemm_f32_ms: f64,
    synthetic_vs_sgemm: f64,
}

pub(super) fn run(runs: u32, size: u32, json: bool) -> anyhow::Result<()> {
    anyhow::ensure!(runs >= 1, "--runs must be at least 1");
    let bwrap_args = [
        "--unshare-all",
        "--die-with-parent",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/work",
        "/bin/true",
    ];
    let has_bwrap = Command::new("bwrap")
        .args(bwrap_args)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let sandbox = Sandboxes::new()?;
    // The three take turns, so that all see the same machine: a burst of other work
    // lands on all of them alike. First back to back, then each after a pause (untimed),
    // as sandboxes start on a node that is not starting them all the time.
    let round = |runs: u32, pause: Duration| -> anyhow::Result<Medians> {
        let (mut plain, mut bwrap, mut ours) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..runs {
            std::thread::sleep(pause);
            let t = Instant::now();
            let ok = Command::new("/bin/true").status()?.success();
            anyhow::ensure!(ok, "/bin/true failed");
            plain.push(t.elapsed());
            if has_bwrap {
                std::thread::sleep(pause);
                let t = Instant::now();
                let ok = Command::new("bwrap").args(bwrap_args).status()?.success();
                anyhow::ensure!(ok, "bwrap failed");
                bwrap.push(t.elapsed());
            }
            std::thread::sleep(pause);
            ours.push(sandbox.once().context("sandboxed /bin/true")?);
        }
        Ok(Medians {
            plain: ms(middle(plain)),
            bwrap: has_bwrap.then(|| ms(middle(bwrap))),
            ours: ms(middle(ours)),
        })
    };
    let back_to_back = round(runs, Duration::ZERO)?;
    let after_pause = round((runs / 4).max(1), Duration::from_millis(20))?;
    let zygote = sandbox.zygote_start;

    let seed = Digest::of(b"cannabis exec bench");
    let task = cannabis_protocol::synthetic::SyntheticTask::new(seed, size)?;
    let (a, b) = task.matrices();
    let n = size as usize;
    let synthetic = median(5, || {
        let c = cannabis_protocol::synthetic::multiply(&a, &b, n);
        std::hint::black_box(c);
        Ok(())
    })?;
    let af: Vec<f32> = a.iter().map(|&x| f32::from(x)).collect();
    let bf: Vec<f32> = b.iter().map(|&x| f32::from(x)).collect();
    let sgemm = median(5, || {
        let mut c = vec![0f32; n * n];
        let stride = isize::try_from(n)?;
        // matrixmultiply's safe wrapper is not offered; the slices are n*n and the
        // strides describe row-major n x n matrices.
        sgemm(&af, &bf, &mut c, n, stride);
        std::hint::black_box(c);
        Ok(())
    })?;
    let after_runs = (runs / 4).max(1);
    let f = Figures {
        runs,
        back_to_back,
        after_pause,
        zygote_start_ms: ms(zygote),
        size,
        synthetic_ms: ms(synthetic),
        sgemm_f32_ms: ms(sgemm),
        synthetic_vs_sgemm: ms(synthetic) / ms(sgemm),
    };
    if json {
        return output::json(&f);
    }
    f.back_to_back.print(&format!(
        "spawning /bin/true, median of {runs}, back to back"
    ))?;
    f.after_pause.print(&format!(
        "spawning /bin/true, median of {after_runs}, each after a 20 ms pause"
    ))?;
    out!(
        "(the sandbox zygote, started once per executor, took {:.2} ms to answer first)",
        f.zygote_start_ms
    )?;
    out!("synthetic task, {size}x{size}, one core, median of 5:")?;
    out!("  int8 -> i32 (synthetic)  {:>8.1} ms", f.synthetic_ms)?;
    out!("  f32 sgemm (matrixmultiply) {:>6.1} ms", f.sgemm_f32_ms)?;
    out!("  synthetic / sgemm        {:>8.2}x", f.synthetic_vs_sgemm)?;
    Ok(())
}

/// One size's figures, milliseconds (medians).
#[derive(Serialize)]
struct SyntheticFigures {
    n: u32,
    /// The kernel `multiply` picks on this CPU.
    kernel: &'static str,
    generate_ms: f64,
    /// Each kernel this CPU runs: name and time of the product alone.
    kernels: Vec<(&'static str, f64)>,
    sgemm_f32_ms: f64,
    hash_ms: f64,
    /// The whole task as a worker runs it: generate, multiply (fastest kernel), hash.
    compute_ms: f64,
    /// The same with the portable kernel (the reference, and what v1 workers ran).
    compute_portable_ms: Option<f64>,
    /// Checking a delivered product: generate, range, hash, Freivalds.
    verify_ms: f64,
    compute_over_verify: f64,
    compute_portable_over_verify: Option<f64>,
    fastest_over_sgemm: f64,
    /// One round of the capability challenge at this size: proved and checked.
    challenge_prove_ms: Option<f64>,
    challenge_verify_ms: Option<f64>,
}

/// `cannabis exec bench-synthetic`.
pub(super) fn synthetic(sizes: &[u32], runs: u32, json: bool) -> anyhow::Result<()> {
    use cannabis_protocol::challenge::Challenge;
    use cannabis_protocol::synthetic::{Kernel, SyntheticTask, result_hash};
    anyhow::ensure!(runs >= 1, "--runs must be at least 1");
    let mut all = Vec::new();
    for &size in sizes {
        let seed = Digest::of(b"cannabis exec bench-synthetic");
        let task = SyntheticTask::new(seed, size)?;
        let n = size as usize;
        let generate = median(runs, || {
            std::hint::black_box(task.matrices());
            Ok(())
        })?;
        let (a, b) = task.matrices();
        let mut kernels = Vec::new();
        for k in [Kernel::Vnni, Kernel::Avx2, Kernel::Portable] {
            // The portable kernel is the slow reference: timed up to 2048 only.
            if !k.available() || (k == Kernel::Portable && n > 2048) {
                continue;
            }
            let t = median(runs, || {
                std::hint::black_box(k.multiply(&a, &b, n));
                Ok(())
            })?;
            kernels.push((k.name(), ms(t)));
        }
        let af: Vec<f32> = a.iter().map(|&x| f32::from(x)).collect();
        let bf: Vec<f32> = b.iter().map(|&x| f32::from(x)).collect();
        let sgemm_t = median(runs, || {
            let mut c = vec![0f32; n * n];
            sgemm(&af, &bf, &mut c, n, isize::try_from(n)?);
            std::hint::black_box(c);
            Ok(())
        })?;
        let c = task.compute();
        let claimed = result_hash(&c);
        let hash = median(runs, || {
            std::hint::black_box(result_hash(&c));
            Ok(())
        })?;
        let compute = median(runs, || {
            std::hint::black_box(task.run());
            Ok(())
        })?;
        let portable = kernels
            .iter()
            .find(|(k, _)| *k == Kernel::Portable.name())
            .map(|(_, t)| ms(generate) + t + ms(hash));
        let mut check = 0u64;
        let verify = median(runs, || {
            check += 1;
            let r = Digest::of(&check.to_le_bytes());
            task.verify(&c, &claimed, &r)
                .map_err(|e| anyhow::anyhow!("the honest product failed its check: {e}"))
        })?;
        let (challenge_prove, challenge_verify) =
            if size <= cannabis_protocol::challenge::MAX_CHALLENGE_N {
                let ch = Challenge::new(seed, size, 1)?;
                let answer = ch.prove();
                let prove = median(runs, || {
                    std::hint::black_box(ch.prove());
                    Ok(())
                })?;
                let verify = median(runs, || {
                    ch.verify(&answer, &Digest::of(b"r"))
                        .map_err(|e| anyhow::anyhow!("the honest answer failed its check: {e}"))
                })?;
                (Some(ms(prove)), Some(ms(verify)))
            } else {
                (None, None)
            };
        let fastest = kernels
            .iter()
            .map(|(_, t)| *t)
            .fold(f64::INFINITY, f64::min);
        all.push(SyntheticFigures {
            n: size,
            kernel: Kernel::detect().name(),
            generate_ms: ms(generate),
            kernels,
            sgemm_f32_ms: ms(sgemm_t),
            hash_ms: ms(hash),
            compute_ms: ms(compute),
            compute_portable_ms: portable,
            verify_ms: ms(verify),
            compute_over_verify: ms(compute) / ms(verify),
            compute_portable_over_verify: portable.map(|p| p / ms(verify)),
            fastest_over_sgemm: ms(sgemm_t) / fastest,
            challenge_prove_ms: challenge_prove,
            challenge_verify_ms: challenge_verify,
        });
    }
    if json {
        return output::json(&all);
    }
    for f in &all {
        out!(
            "synthetic task {0}x{0}, one core, median of {runs} (multiply uses {1}):",
            f.n,
            f.kernel
        )?;
        out!("  generate A, B (ChaCha20)     {:>9.2} ms", f.generate_ms)?;
        for (k, t) in &f.kernels {
            out!("  product, {k:<19} {t:>9.2} ms")?;
        }
        out!("  product, f32 sgemm           {:>9.2} ms", f.sgemm_f32_ms)?;
        out!(
            "  f32 / fastest int8           {:>9.2}x",
            f.fastest_over_sgemm
        )?;
        out!("  hash C (SHA-256)             {:>9.2} ms", f.hash_ms)?;
        out!(
            "  compute (generate, product, hash) {:>4.2} ms",
            f.compute_ms
        )?;
        out!(
            "  verify (generate, range, hash, Freivalds) {:.2} ms",
            f.verify_ms
        )?;
        out!(
            "  compute / verify             {:>9.1}x",
            f.compute_over_verify
        )?;
        if let (Some(p), Some(r)) = (f.compute_portable_ms, f.compute_portable_over_verify) {
            out!("  compute, portable kernel     {p:>9.2} ms  ({r:.1}x verify)")?;
        }
        if let (Some(p), Some(v)) = (f.challenge_prove_ms, f.challenge_verify_ms) {
            out!(
                "  challenge round: prove {p:.2} ms, verify {v:.2} ms ({:.1}x)",
                p / v
            )?;
        }
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(runs: u32, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<Duration> {
    let mut times = Vec::with_capacity(runs as usize);
    for _ in 0..runs {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed());
    }
    Ok(middle(times))
}

#[allow(unsafe_code)]
fn sgemm(a: &[f32], b: &[f32], c: &mut [f32], n: usize, stride: isize) {
    assert!(a.len() >= n * n && b.len() >= n * n && c.len() >= n * n);
    // SAFETY: the three slices hold n*n elements each (checked above), the row stride is n
    // and the column stride 1, so every index the routine forms is in bounds; `c` does not
    // alias `a` or `b`.
    unsafe {
        matrixmultiply::sgemm(
            n,
            n,
            n,
            1.0,
            a.as_ptr(),
            stride,
            1,
            b.as_ptr(),
            stride,
            1,
            0.0,
            c.as_mut_ptr(),
            stride,
            1,
        );
    }
}

/// The median of some durations.
fn middle(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times.get(times.len() / 2).copied().unwrap_or_default()
}

/// Sandboxes for `/bin/true`, as the executor makes them, in a scratch directory.
struct Sandboxes {
    scratch: std::path::PathBuf,
    program: std::path::PathBuf,
    cgroups: Cgroups,
    launcher: sandbox::Launcher,
    switch: Option<u32>,
    uid: u32,
    /// How long the zygote took to start and answer (once per executor, as in the node;
    /// not part of a sandbox's start-up).
    zygote_start: Duration,
}

impl Drop for Sandboxes {
    fn drop(&mut self) {
        self.cgroups.remove_base();
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

impl Sandboxes {
    fn new() -> anyhow::Result<Self> {
        let scratch = tempfile::Builder::new()
            .prefix("cannabis-bench-")
            .tempdir()?
            .keep();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&scratch, std::fs::Permissions::from_mode(0o711))?;
        let program =
            cannabis_runtime::exec::pin_program(&std::env::current_exe()?, &scratch.join("bin"))?;
        let cgroups = Cgroups::detect(&format!("bench-{}", std::process::id()));
        let root = nix::unistd::geteuid().is_root();
        let uid = if root {
            cannabis_runtime::exec::DEFAULT_SANDBOX_UID
        } else {
            nix::unistd::geteuid().as_raw()
        };
        let launcher = sandbox::Launcher::new(&program, &scratch.join("template"));
        let first = Instant::now();
        launcher.start()?;
        Ok(Self {
            zygote_start: first.elapsed(),
            scratch,
            program,
            cgroups,
            launcher,
            switch: root.then_some(uid),
            uid,
        })
    }

    /// One sandbox's whole life for `/bin/true`: cgroups with limits, the monitor and pid 1,
    /// the root, confinement, the host's check, the run, the tree confirmed empty, cgroups
    /// removed. The attempt directory is staging: made before and removed after the timing.
    fn once(&self) -> anyhow::Result<Duration> {
        let dir = self.scratch.join("a");
        let took = one_run(
            &self.launcher,
            &self.program,
            &dir,
            &self.cgroups,
            self.switch,
            self.uid,
        )?;
        std::fs::remove_dir_all(&dir)?;
        Ok(took)
    }
}

fn one_run(
    launcher: &sandbox::Launcher,
    program: &Path,
    dir: &Path,
    cgroups: &Cgroups,
    switch: Option<u32>,
    uid: u32,
) -> anyhow::Result<Duration> {
    for sub in ["", "inputs", "bundle", "outputs", "root"] {
        std::fs::create_dir_all(dir.join(sub))?;
        if let Some(u) = switch {
            nix::unistd::chown(
                &dir.join(sub),
                Some(nix::unistd::Uid::from_raw(u)),
                Some(nix::unistd::Gid::from_raw(u)),
            )?;
        }
    }
    std::fs::write(
        dir.join("lease"),
        (super::super::now_ms() + 60_000).to_string(),
    )?;
    if let Some(u) = switch {
        nix::unistd::chown(
            &dir.join("lease"),
            Some(nix::unistd::Uid::from_raw(u)),
            None,
        )?;
    }
    let spec = SandboxSpec {
        attempt_dir: dir.to_path_buf(),
        uid,
        gid: uid,
        work_bytes: 1 << 20,
        argv: vec!["/bin/true".into()],
        env: Vec::new(),
        cwd: "/".into(),
        rlimits: Rlimits {
            file_size: 1 << 20,
            open_files: 64,
            processes: switch.map(|_| 16),
        },
        seccomp: true,
        landlock: true,
        outputs: Vec::new(),
        log_cap: 4096,
        program: program.to_path_buf(),
        devices: Vec::new(),
        loopback: false,
        checkpoint: None,
    };
    // Timed from here (the attempt directory is staging, made before and removed after):
    // as the executor does, the cgroups are made while the zygote hands out the monitor.
    let t = Instant::now();
    let limits = CgroupLimits {
        memory_bytes: 64 << 20,
        swap_bytes: 0,
        processes: 16,
        cpu_millicores: 1000,
    };
    let (starting, cg) = sandbox::launch(launcher, &spec, switch.map(|u| (u, u)), || {
        cgroups.create("run", &limits)
    })?;
    let cg = cg?;
    let mut launch = starting.enter(&cg)?;
    let (pid, reported) = launch.wait_ready(Duration::from_secs(10))?;
    sandbox::check_running(pid, &cg, &[], &reported).map_err(|e| anyhow::anyhow!(e))?;
    launch.go()?;
    launch.wait_exit()?;
    // As the executor does: the monitor has reported; its exit is waited for, and only a
    // tree that does not end by itself is killed.
    anyhow::ensure!(
        cg.wait_empty(Duration::from_secs(2)) || cg.kill_and_confirm(Duration::from_secs(5)),
        "the sandbox did not empty"
    );
    cg.remove()?;
    Ok(t.elapsed())
}

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

#[derive(Serialize)]
struct Figures {
    runs: u32,
    plain_spawn_ms: f64,
    bwrap_unshare_all_ms: Option<f64>,
    sandbox_ms: f64,
    sandbox_vs_bwrap: Option<f64>,
    sandbox_vs_plain: f64,
    size: u32,
    synthetic_ms: f64,
    sgemm_f32_ms: f64,
    synthetic_vs_sgemm: f64,
}

pub(super) fn run(runs: u32, size: u32, json: bool) -> anyhow::Result<()> {
    anyhow::ensure!(runs >= 1, "--runs must be at least 1");
    let plain = median(runs, || {
        let ok = Command::new("/bin/true").status()?.success();
        anyhow::ensure!(ok, "/bin/true failed");
        Ok(())
    })?;
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
    let bwrap = if Command::new("bwrap")
        .args(bwrap_args)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        Some(median(runs, || {
            let ok = Command::new("bwrap").args(bwrap_args).status()?.success();
            anyhow::ensure!(ok, "bwrap failed");
            Ok(())
        })?)
    } else {
        None
    };
    let ours = sandbox_median(runs)?;

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
    let f = Figures {
        runs,
        plain_spawn_ms: ms(plain),
        bwrap_unshare_all_ms: bwrap.map(ms),
        sandbox_ms: ms(ours),
        sandbox_vs_bwrap: bwrap.map(|b| ms(ours) / ms(b)),
        sandbox_vs_plain: ms(ours) / ms(plain),
        size,
        synthetic_ms: ms(synthetic),
        sgemm_f32_ms: ms(sgemm),
        synthetic_vs_sgemm: ms(synthetic) / ms(sgemm),
    };
    if json {
        return output::json(&f);
    }
    out!("median of {runs} spawns of /bin/true:")?;
    out!("  plain spawn              {:>8.2} ms", f.plain_spawn_ms)?;
    match f.bwrap_unshare_all_ms {
        Some(b) => out!("  bwrap --unshare-all      {b:>8.2} ms")?,
        None => out!("  bwrap --unshare-all      not available (apt-get install bubblewrap)")?,
    }
    out!(
        "  cannabis sandbox         {:>8.2} ms  (cgroups, namespaces, root, confinement, host check, cleanup)",
        f.sandbox_ms
    )?;
    if let Some(r) = f.sandbox_vs_bwrap {
        out!("  sandbox / bwrap          {r:>8.2}x")?;
    }
    out!("  sandbox / plain          {:>8.2}x", f.sandbox_vs_plain)?;
    out!("synthetic task, {size}x{size}, one core, median of 5:")?;
    out!("  int8 -> i32 (synthetic)  {:>8.1} ms", f.synthetic_ms)?;
    out!("  f32 sgemm (matrixmultiply) {:>6.1} ms", f.sgemm_f32_ms)?;
    out!("  synthetic / sgemm        {:>8.2}x", f.synthetic_vs_sgemm)?;
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
    times.sort();
    Ok(times[times.len() / 2])
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

/// The sandbox's whole life for `/bin/true`: cgroups with limits, stage 1 and 2, the root,
/// confinement, the host's check, the run, and cleanup confirmed empty.
fn sandbox_median(runs: u32) -> anyhow::Result<Duration> {
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
    let result = median(runs, || {
        let dir = scratch.join("a");
        one_run(&program, &dir, &cgroups, root.then_some(uid), uid)
            .context("sandboxed /bin/true")?;
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

fn one_run(
    program: &Path,
    dir: &Path,
    cgroups: &Cgroups,
    switch: Option<u32>,
    uid: u32,
) -> anyhow::Result<()> {
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
    let cg = cgroups.create(
        "run",
        &CgroupLimits {
            memory_bytes: 64 << 20,
            swap_bytes: 0,
            processes: 16,
            cpu_millicores: 1000,
        },
    )?;
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
    };
    let mut launch = sandbox::launch(&spec, switch.map(|u| (u, u)), &cg)?;
    let (pid, reported) = launch.wait_ready(Duration::from_secs(10))?;
    sandbox::check_running(pid, &cg, &[], &reported).map_err(|e| anyhow::anyhow!(e))?;
    launch.go()?;
    launch.wait_exit()?;
    anyhow::ensure!(
        cg.kill_and_confirm(Duration::from_secs(5)),
        "the sandbox did not empty"
    );
    cg.remove()?;
    Ok(())
}

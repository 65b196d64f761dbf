//! `cannabis testnet demo`, as the README's first command runs it: every step happens on a
//! testnet of real processes, and nothing is left behind, whether it ends or is
//! interrupted.

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

/// Processes whose command line names `dir`: the demo's nodes and their sandboxes.
fn left_in(dir: &Path) -> Vec<String> {
    let needle = dir.to_string_lossy().into_owned();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        if !entry
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        if let Ok(raw) = std::fs::read(entry.path().join("cmdline")) {
            let line = String::from_utf8_lossy(&raw).replace('\0', " ");
            if line.contains(&needle) {
                found.push(line);
            }
        }
    }
    found
}

fn demo(tmp: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cannabis"));
    c.args(["testnet", "demo"]).env("TMPDIR", tmp);
    c
}

#[test]
fn the_demo_runs_every_step_and_leaves_nothing_behind() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: the demo runs requesters' programs in the sandbox, as root");
        return;
    }
    if !Command::new("python3")
        .args(["-c", "import numpy"])
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .status()
        .is_ok_and(|s| s.success())
    {
        eprintln!("skipped: python3 with numpy is not installed (Debian: python3-numpy)");
        return;
    }
    let tmp = super::exec::open_dir();
    let o = demo(tmp.path()).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // Each step's own evidence, as the demo showed it.
    for seen in [
        "== 8/8: every node's ledger agrees",
        "every step happened (8 of 8)",
        "product checked",
        "balanced to the base unit: 200000 locked",
        "is leaf 0 of",
        "pass  accuracy",
        "settled (Accepted)",
        "rank 2 of 3, rendezvous 10.29.0.1: sum 60",
        "placed again at epoch 2",
        "epoch 2",
        "all 5 nodes hold the same chain",
    ] {
        assert!(
            text.contains(seen),
            "the demo never showed {seen:?}:\n{text}"
        );
    }
    assert_eq!(
        text.matches("   ok: step ").count(),
        8,
        "every step says it passed:\n{text}"
    );
    assert!(left_in(tmp.path()).is_empty(), "{:?}", left_in(tmp.path()));
    let files: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().collect();
    assert!(files.is_empty(), "files left behind: {files:?}");
}

#[test]
fn an_interrupted_demo_stops_its_nodes_and_removes_its_files() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: the demo runs requesters' programs in the sandbox, as root");
        return;
    }
    let tmp = super::exec::open_dir();
    let mut child = demo(tmp.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Interrupted once the nodes run and the requester is funded.
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let mut seen = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            panic!("the demo ended before step 3:\n{seen}");
        }
        seen.push_str(&line);
        if line.starts_with("== 3/") {
            break;
        }
    }
    assert!(!left_in(tmp.path()).is_empty(), "no node ran");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{seen}");
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(err.contains("every node of the demo stopped"), "{err}");
    assert!(left_in(tmp.path()).is_empty(), "{:?}", left_in(tmp.path()));
    let files: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().collect();
    assert!(files.is_empty(), "files left behind: {files:?}");
}

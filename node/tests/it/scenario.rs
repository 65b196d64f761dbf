//! The shipped scenarios (`testnet/scenarios/`), run as a researcher runs them:
//! `cannabis testnet scenario FILE`, each on a fresh testnet of real processes; and a
//! scenario that cannot hold, seen to fail with the step that failed.

use std::path::Path;
use std::process::Command;

fn scenario(file: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .args(["testnet", "scenario"])
        .arg(file)
        .output()
        .unwrap()
}

fn shipped(name: &str) {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: jobs run only where the executor is root");
        return;
    }
    let file = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testnet/scenarios")
        .join(name);
    let o = scenario(&file);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{name}:\n{text}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(text.contains("passed"), "{text}");
    assert!(!text.contains("FAIL"), "{text}");
}

#[test]
fn the_happy_path_scenario_passes() {
    shipped("happy-path.toml");
}

#[test]
fn the_worker_killed_scenario_passes() {
    shipped("worker-killed.toml");
}

#[test]
fn the_partition_scenario_passes() {
    shipped("partition-heals.toml");
}

#[test]
fn the_requester_quiet_scenario_passes() {
    shipped("requester-quiet.toml");
}

#[test]
fn the_sequencer_restart_scenario_passes() {
    shipped("sequencer-restart.toml");
}

/// Runs alone (`.config/nextest.toml`): in its one failure, with other tests beside it on
/// two cores, the job failed before it ran, most likely for want of bids within its window
/// (now 5 s instead of 2).
#[test]
fn the_paused_worker_scenario_passes() {
    shipped("paused-worker.toml");
}

#[test]
fn the_slow_links_scenario_passes() {
    shipped("slow-links.toml");
}

#[test]
fn the_fabricating_worker_scenario_passes() {
    shipped("fabricating-worker.toml");
}

#[test]
fn a_scenario_that_cannot_hold_fails_at_its_step() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("wrong.toml");
    std::fs::write(
        &file,
        "name = \"wrong\"\nnodes = 2\n\
         [[step]]\ndo = \"expect-peers\"\nnode = 0\npeers = 1\n\
         [[step]]\ndo = \"expect-peers\"\nnode = 0\npeers = 5\nwithin = \"1s\"\n\
         [[step]]\ndo = \"heal\"\n",
    )
    .unwrap();
    let o = scenario(&file);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(!o.status.success(), "{text}");
    assert!(text.contains("pass   1. node 0 has 1 peers"), "{text}");
    assert!(text.contains("FAIL   2."), "{text}");
    assert!(!text.contains(" 3. "), "ran on after a failure: {text}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("1 of 3 steps passed"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // A step it does not know is refused before anything starts.
    std::fs::write(&file, "name = \"x\"\n[[step]]\ndo = \"explode\"\n").unwrap();
    let o = scenario(&file);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("explode"));
}

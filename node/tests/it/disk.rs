//! A full disk: the store refuses a write, the node goes read-only and says why, nothing
//! it did not save is acknowledged, and it recovers by itself when space returns.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::net::{self, wait_for};

/// A small tmpfs, unmounted when dropped.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(at: &Path, size: &str) -> Option<Self> {
        std::fs::create_dir_all(at).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Self(at.to_path_buf()))
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Writes a file until the disk is full.
fn fill(path: &Path) {
    let mut f = std::fs::File::create(path).unwrap();
    let block = vec![0xa5u8; 64 * 1024];
    while f.write_all(&block).is_ok() {}
    let _ = f.sync_all();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_means_read_only_and_nothing_unsaved_is_acknowledged() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: mounting a small tmpfs needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Some(disk) = SmallDisk::mount(&dir.path().join("disk"), "256m") else {
        eprintln!("skipped: cannot mount a tmpfs here");
        return;
    };
    let data = disk.0.join("node");
    let node = net::start(&data, None).await;
    let mut acknowledged = Vec::new();
    let first = node
        .handle
        .publish_offer(net::offer(600_000))
        .await
        .unwrap();
    acknowledged.push(first.job_id);

    // The disk fills up: offers are published until the store refuses one.
    let filler = disk.0.join("filler");
    fill(&filler);
    let mut refused = None;
    for _ in 0..200 {
        match node.handle.publish_offer(net::offer(600_000)).await {
            Ok(p) => acknowledged.push(p.job_id),
            Err(e) => {
                refused = Some(format!("{e:#}"));
                break;
            }
        }
    }
    let refused = refused.expect("the full disk refused a write");
    assert!(refused.contains("safe mode"), "{refused}");
    let status = node.handle.status().await.unwrap();
    let why = status.safe_mode.expect("status says the node is read-only");
    assert!(!why.is_empty());
    // Read-only: nothing more is taken, with the same reason.
    let again = node.handle.publish_offer(net::offer(600_000)).await;
    assert!(
        again.is_err_and(|e| format!("{e:#}").contains("safe mode")),
        "taken while read-only"
    );

    // Space returns: the node takes writes again by itself (its upkeep, every 10 s).
    std::fs::remove_file(&filler).unwrap();
    wait_for(
        Duration::from_secs(30),
        "the node to leave safe mode",
        || async {
            let s = node.handle.status().await.ok()?;
            s.safe_mode.is_none().then_some(())
        },
    )
    .await;
    let after = node
        .handle
        .publish_offer(net::offer(600_000))
        .await
        .unwrap();
    acknowledged.push(after.job_id);

    // After a restart, every offer that was acknowledged is there.
    node.stop().await;
    let node = net::start(&data, None).await;
    let held: Vec<String> = node
        .handle
        .offers()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.job_id)
        .collect();
    for job in &acknowledged {
        assert!(held.contains(job), "acknowledged offer {job} was lost");
    }
    node.stop().await;
    drop(disk);
}

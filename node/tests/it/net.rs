//! Helpers: in-process nodes on loopback, and bounded waiting.

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use cannabis_api::OfferTemplate;
use cannabis_node::keystore::{self, KeyPaths};
use cannabis_node::{NodeConfig, NodeHandle};
use libp2p::Multiaddr;
use tokio::task::JoinHandle;

/// A node running in this process.
pub(crate) struct TestNode {
    pub(crate) handle: NodeHandle,
    pub(crate) task: JoinHandle<()>,
    pub(crate) addr: Multiaddr,
}

pub(crate) fn config(bootstrap: Option<&Multiaddr>) -> NodeConfig {
    let mut c = NodeConfig {
        listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
        bootstrap: bootstrap.into_iter().cloned().collect(),
        mdns: false,
        ..NodeConfig::default()
    };
    c.gossip.heartbeat_millis = 200;
    c.gossip.ip_colocation_threshold = 10_000.0;
    c.gossip.fee = Some(cannabis_market::testkit::fee_terms());
    c.limits.max_pending_per_ip = 10_000;
    // Like a testnet's: many nodes on one loaded machine handshake slowly.
    c.limits.handshake_timeout_secs = 10;
    // The executor's sandboxes run the `cannabis` binary, not this test harness.
    c.program = Some(env!("CARGO_BIN_EXE_cannabis").into());
    c
}

/// Starts a node with its own keys under `dir`.
pub(crate) async fn start(dir: &Path, bootstrap: Option<&Multiaddr>) -> TestNode {
    start_with(dir, config(bootstrap)).await
}

pub(crate) async fn start_with(dir: &Path, config: NodeConfig) -> TestNode {
    std::fs::create_dir_all(dir).unwrap();
    // The executor's sandbox uids must reach the data directory (tempdirs are 0700), or
    // the node has no executor and its ad offers no capacity for work.
    for d in [Some(dir), dir.parent()].into_iter().flatten() {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o711)).unwrap();
    }
    let paths = KeyPaths::new(dir);
    let keys = if paths.node.exists() {
        keystore::load(&paths).unwrap()
    } else {
        keystore::create(&paths, false, 0).unwrap()
    };
    let (handle, task) = cannabis_node::start(config, keys, dir, None).await.unwrap();
    let h = handle.clone();
    let listen = wait_for(Duration::from_secs(10), "a listen address", || {
        let h = h.clone();
        async move {
            h.status()
                .await
                .ok()
                .and_then(|s| s.listen_addrs.first().cloned())
        }
    })
    .await;
    let mut addr: Multiaddr = listen.parse().unwrap();
    if !matches!(
        addr.iter().last(),
        Some(libp2p::multiaddr::Protocol::P2p(_))
    ) {
        addr.push(libp2p::multiaddr::Protocol::P2p(handle.peer_id()));
    }
    TestNode { handle, task, addr }
}

impl TestNode {
    /// Stops the node and waits until its driver (and store) are gone.
    pub(crate) async fn stop(self) {
        drop(self.handle);
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("node stops")
            .unwrap();
    }
}

/// Polls `check` every 50 ms until it returns `Some`, or panics after `timeout`.
pub(crate) async fn wait_for<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until every node holds `ads` capability ads and has a mesh on every topic.
pub(crate) async fn wait_converged(nodes: &[&TestNode], ads: usize) {
    for (i, n) in nodes.iter().enumerate() {
        let h = n.handle.clone();
        wait_for(
            Duration::from_secs(30),
            &format!("node {i} to see {ads} ads and mesh"),
            || {
                let h = h.clone();
                async move {
                    let s = h.status().await.ok()?;
                    (s.ads >= ads && s.mesh_peers.iter().all(|t| t.peers > 0)).then_some(())
                }
            },
        )
        .await;
    }
}

/// A small valid offer template living `ttl_ms`.
pub(crate) fn offer(ttl_ms: u64) -> OfferTemplate {
    let mut t = cannabis_testnet::bench::bench_offer(0);
    t.ttl_ms = ttl_ms;
    t.deadline_ms = ttl_ms + 60_000;
    t
}

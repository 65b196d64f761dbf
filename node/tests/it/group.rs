//! A group's private channel between real `cannabis` processes: the ranks of a group job
//! reach rank 0's service through the swarm, and a peer outside the roster reaches
//! nothing.

use std::io::{Read as _, Write as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::{AsyncReadExt as _, AsyncWriteExt as _, StreamExt as _};
use libp2p::{Multiaddr, PeerId, StreamProtocol, identity, noise, tcp, yamux};

use super::settle::{cannabis, client, wait_job};
use super::testnet::{Testnet, wait_for_workers};

const JOB: &str = r#"
name = "pair"
deadline = "10m"
bid_window = "5s"

[early]
first_bids = 2

[[task]]
name = "pair"
budget = 600_000
group_size = 2
[task.workload]
adapter = "process"
bundle = "bundle.tar"
entrypoint = ["sh", "wait.sh"]
[task.resources]
cpu = 1
memory = "128MiB"
storage = "8MiB"
[[task.outputs]]
name = "done.txt"
max_size = "1KiB"
"#;

/// The group attempt a worker holds a rank of: its channel's directory, named
/// `<rendezvous id>-<epoch>`.
fn group_dir(worker: &Path) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(worker.join("groups"))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    (dirs.len() == 1).then(|| dirs.remove(0))
}

#[test]
fn a_ranks_connection_reaches_rank_0_through_the_channel_and_a_stranger_reaches_nothing() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: requesters' programs run only where the executor is root");
        return;
    }
    let dir = super::exec::open_dir();
    let net = Testnet::up(&dir.path().join("net"), 3);
    let nodes = net.nodes();
    let requester = &nodes[0];
    let work = dir.path().join("job");
    std::fs::create_dir_all(&work).unwrap();
    // Each rank's run lasts while the test uses the channel.
    super::delivery::tar(
        &work,
        &[(
            "wait.sh",
            "sleep 20\necho done > \"$CANNABIS_WORK/done.txt\"\n",
        )],
    );
    std::fs::write(work.join("job.toml"), JOB).unwrap();
    wait_for_workers(requester, 3);
    let o = cannabis(
        requester,
        &[
            "job",
            "submit",
            work.join("job.toml").to_str().unwrap(),
            "--yes",
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let id = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["job_id"]
        .as_str()
        .unwrap()
        .to_string();
    let running = wait_job(requester, &id, 90, "both ranks to run", |j| {
        j.tasks[0].ranks.len() == 2
            && j.tasks[0].ranks.iter().all(|r| {
                r.progress
                    .as_ref()
                    .is_some_and(|p| p.stage == cannabis_protocol::RunStage::Running)
            })
    });
    let worker_of = |rank: u32| -> PathBuf {
        let address = running.tasks[0]
            .ranks
            .iter()
            .find(|r| r.rank == rank)
            .unwrap()
            .worker
            .to_string();
        nodes
            .iter()
            .find(|d| client(d).status().unwrap().address == address)
            .expect("the rank's worker is a node of the testnet")
            .clone()
    };
    let (zero, one) = (worker_of(0), worker_of(1));
    let (g0, g1) = (
        group_dir(&zero).expect("rank 0's node holds the group"),
        group_dir(&one).expect("rank 1's node holds the group"),
    );
    assert_eq!(g0.file_name(), g1.file_name(), "one group attempt");
    // Only the owner may reach the endpoints.
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        std::fs::metadata(&g1).unwrap().permissions().mode() & 0o777,
        0o700
    );

    // Rank 0's service (PyTorch's store, here an echo that upper-cases), and what it saw.
    let service = UnixListener::bind(g0.join("service-29500.sock")).unwrap();
    service.set_nonblocking(false).unwrap();
    let served = std::thread::spawn(move || {
        let mut seen = Vec::new();
        // The rank's connection; then, for the stranger, nothing must come.
        let (mut s, _) = service.accept().unwrap();
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).unwrap();
        s.write_all(&buf.to_ascii_uppercase()).unwrap();
        seen.push(buf.len());
        drop(s);
        service.set_nonblocking(true).unwrap();
        let until = std::time::Instant::now() + Duration::from_secs(4);
        while std::time::Instant::now() < until {
            if service.accept().is_ok() {
                seen.push(usize::MAX);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        seen
    });

    // Rank 1's workload connects to its endpoint, as torchrun's store client would.
    let mut endpoint = UnixStream::connect(g1.join("to-0-29500.sock")).unwrap();
    endpoint
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let sent = b"store.set(rank1, 40) ".repeat(8_000); // several channel messages
    endpoint.write_all(&sent).unwrap();
    endpoint.shutdown(std::net::Shutdown::Write).unwrap();
    let mut back = Vec::new();
    endpoint.read_to_end(&mut back).unwrap();
    assert_eq!(back.len(), sent.len());
    assert!(
        back == sent.to_ascii_uppercase(),
        "the reply came back changed"
    );

    // A stranger (a fresh key, not in the roster) opens a group stream to rank 0's node
    // naming the group attempt, as rank 1: refused before any service is reached.
    let name = g0.file_name().unwrap().to_str().unwrap().to_string();
    let (rendezvous, epoch) = name.rsplit_once('-').unwrap();
    let rendezvous: cannabis_protocol::Uuid = rendezvous.parse().unwrap();
    let epoch: u64 = epoch.parse().unwrap();
    let status = client(&zero).status().unwrap();
    let target: PeerId = status.peer_id.parse().unwrap();
    let addr: Multiaddr = status
        .listen_addrs
        .iter()
        .find(|a| a.contains("/tcp/"))
        .unwrap()
        .parse()
        .unwrap();
    let got = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(stranger(target, addr, rendezvous, epoch));
    assert_eq!(got, 0, "the stranger's stream carried {got} bytes back");
    assert_eq!(
        served.join().unwrap(),
        vec![sent.len()],
        "what the service saw"
    );
}

/// Opens a group stream as a stranger and sends an opening as rank 1 and a handshake
/// message; the bytes that came back before the stream ended.
async fn stranger(
    target: PeerId,
    addr: Multiaddr,
    rendezvous: cannabis_protocol::Uuid,
    epoch: u64,
) -> usize {
    let mut swarm =
        libp2p::SwarmBuilder::with_existing_identity(identity::Keypair::generate_ed25519())
            .with_tokio()
            .with_tcp(
                tcp::Config::default(),
                noise::Config::new,
                yamux::Config::default,
            )
            .unwrap()
            .with_behaviour(|_| libp2p_stream::Behaviour::new())
            .unwrap()
            .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(30)))
            .build();
    let mut control = swarm.behaviour().new_control();
    swarm
        .dial(addr.with(libp2p::multiaddr::Protocol::P2p(target)))
        .unwrap();
    tokio::spawn(async move {
        loop {
            swarm.select_next_some().await;
        }
    });
    let mut stream = tokio::time::timeout(
        Duration::from_secs(10),
        control.open_stream(target, StreamProtocol::new("/cannabis/group/1")),
    )
    .await
    .expect("opening the stream timed out")
    .expect("the node takes group streams");
    let opening = cannabis_node::group::Opening {
        rendezvous,
        epoch,
        from: 1,
        to: 0,
        port: 29_500,
    }
    .encode();
    let mut frame = (opening.len() as u16).to_be_bytes().to_vec();
    frame.extend_from_slice(&opening);
    // What a first handshake message looks like in size (psk, e, es, ss: 32 + 48 + 16).
    frame.extend_from_slice(&96u16.to_be_bytes());
    frame.extend_from_slice(&[7u8; 96]);
    let _ = stream.write_all(&frame).await;
    let _ = stream.flush().await;
    let mut back = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut back)).await;
    back.len()
}

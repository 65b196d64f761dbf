//! Restarts of a task's ranks, together, within the task's restart budget: what runs as a
//! rank's command inside its sandbox (`cannabis exec rank`) when the task allows restarts,
//! around the requester's own command.
//!
//! A group's collectives cannot go on when one rank dies: the others fail or wait forever
//! on it. So every rank restarts when one does, in rounds. Rank 0's supervisor is the
//! coordinator: the others connect to it on the group's network ([`CONTROL_PORT`] at
//! `MASTER_ADDR`), it starts round 0 everywhere, and when a rank's command ends other than
//! with 0 (or a rank's sandbox goes), it stops every rank's command and starts the next
//! round, or, with the budget spent, tells every rank to give up with the reason, which
//! each prints last on its standard error and exits 1 with (the executor reports that line
//! as the run's reason). When every rank's command ended with 0, every supervisor exits 0.
//!
//! Round `k` gets `MASTER_PORT = 29500 + k` (and torchrun's `PET_MASTER_PORT`, and
//! `TORCHELASTIC_RESTART_COUNT = CANNABIS_RESTART = k`): a fresh rendezvous each round, so
//! no round meets a store left by the one before. What carries a rank from one round to
//! the next is its work directory: a program that writes checkpoints there resumes from
//! its latest. The work directory is a bounded tmpfs: the checkpoints never reach the
//! worker's disk in plaintext, and go with the attempt.
//!
//! The messages are lines of text on one TCP connection per rank, inside the group's
//! network, which only the group's ranks reach: `hello R`, `start K`, `ended K R STATUS`,
//! `stop K`, `stopped K R`, `finish`, `give-up REASON`.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::process::{Child, Command, ExitStatus};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The coordinator's port on rank 0's group address.
pub const CONTROL_PORT: u16 = 29_400;

/// `MASTER_PORT` of round 0; round `k` gets this plus `k`.
pub const FIRST_PORT: u16 = 29_500;

/// How long ranks have to meet the coordinator, and to stop when told.
const MEET: Duration = Duration::from_secs(120);
const STOP: Duration = Duration::from_secs(30);
/// How often a supervisor looks at its command.
const POLL: Duration = Duration::from_millis(50);

/// What one rank's supervisor runs.
#[derive(Clone, Debug)]
pub struct Ranks {
    /// This rank.
    pub rank: u32,
    /// The group's size.
    pub world: u32,
    /// Rank 0's address (`MASTER_ADDR`).
    pub master: String,
    /// The restart budget: rounds after the first.
    pub restarts: u32,
    /// The requester's command.
    pub command: Vec<String>,
}

enum Event {
    /// A line from a rank (the coordinator's, for the others).
    Line(u32, String),
    /// That rank's connection ended.
    Gone(u32),
}

/// How a command ended, in words.
fn status(s: ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (_, Some(sig)) => format!("signal {sig}"),
        _ => "no exit status".into(),
    }
}

/// One round's command.
struct Running {
    child: Child,
    round: u32,
}

impl Running {
    fn start(r: &Ranks, round: u32) -> Result<Self, String> {
        let port = FIRST_PORT
            .checked_add(u16::try_from(round).map_err(|_| "too many rounds")?)
            .ok_or("too many rounds")?;
        let (program, args) = r.command.split_first().ok_or("no command")?;
        let child = Command::new(program)
            .args(args)
            .env("MASTER_PORT", port.to_string())
            .env("PET_MASTER_PORT", port.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", round.to_string())
            .env("CANNABIS_RESTART", round.to_string())
            // Its own process group: stopping it stops everything it started.
            .process_group(0)
            .spawn()
            .map_err(|e| format!("starting {program}: {e}"))?;
        Ok(Self { child, round })
    }

    /// Its status, once it ended.
    fn ended(&mut self) -> Option<String> {
        self.child.try_wait().ok().flatten().map(status)
    }

    fn kill(mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The longest line a supervisor takes; a longer one ends the connection.
const MAX_LINE: u64 = 1024;

/// Reads `stream`'s lines into `events` as rank `rank`'s, then its end (also after a line
/// over [`MAX_LINE`] bytes, or one that is not text).
fn listen(rank: u32, stream: TcpStream, events: mpsc::Sender<Event>) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        loop {
            let mut line = String::new();
            match std::io::Read::take(&mut reader, MAX_LINE).read_line(&mut line) {
                Ok(_) if line.ends_with('\n') => {
                    line.pop();
                    if events.send(Event::Line(rank, line)).is_err() {
                        return;
                    }
                }
                _ => break,
            }
        }
        let _ = events.send(Event::Gone(rank));
    });
}

fn send(stream: &mut TcpStream, line: &str) {
    let _ = writeln!(stream, "{line}");
}

/// Runs `r`'s rank to the end: 0 when every rank's command ended with 0, else 1 (the
/// reason printed on standard error).
pub fn supervise(r: &Ranks) -> i32 {
    let outcome = if r.rank == 0 {
        coordinate(r)
    } else {
        follow(r)
    };
    match outcome {
        Ok(()) => 0,
        Err(why) => {
            eprintln!("cannabis: {why}");
            1
        }
    }
}

/// Rank 0: meets the others, runs rounds, decides.
fn coordinate(r: &Ranks) -> Result<(), String> {
    let (tx, events) = mpsc::channel();
    let mut peers: HashMap<u32, TcpStream> = HashMap::new();
    if r.world > 1 {
        let listener = TcpListener::bind(("0.0.0.0", CONTROL_PORT))
            .map_err(|e| format!("listening for the other ranks: {e}"))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("listening for the other ranks: {e}"))?;
        let until = Instant::now() + MEET;
        while peers.len() + 1 < r.world as usize {
            match listener.accept() {
                Ok((stream, _)) => {
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                    let mut hello = String::new();
                    let _ = BufReader::new(std::io::Read::take(&stream, MAX_LINE))
                        .read_line(&mut hello);
                    let _ = stream.set_read_timeout(None);
                    let rank = hello
                        .trim()
                        .strip_prefix("hello ")
                        .and_then(|n| n.parse::<u32>().ok())
                        .filter(|n| (1..r.world).contains(n) && !peers.contains_key(n));
                    if let (Some(rank), Ok(read)) = (rank, stream.try_clone()) {
                        listen(rank, read, tx.clone());
                        peers.insert(rank, stream);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > until {
                        return Err(format!(
                            "only {} of {} ranks met rank 0 within {} s",
                            peers.len() + 1,
                            r.world,
                            MEET.as_secs()
                        ));
                    }
                    std::thread::sleep(POLL);
                }
                Err(e) => return Err(format!("listening for the other ranks: {e}")),
            }
        }
    }
    let broadcast = |peers: &mut HashMap<u32, TcpStream>, line: &str| {
        for s in peers.values_mut() {
            send(s, line);
        }
    };
    for round in 0..=r.restarts {
        broadcast(&mut peers, &format!("start {round}"));
        let mut own = Some(Running::start(r, round)?);
        let mut ok: HashSet<u32> = HashSet::new();
        let failure = loop {
            if let Some(s) = own.as_mut().and_then(Running::ended) {
                own = None;
                if s == "exit code 0" {
                    ok.insert(0);
                } else {
                    break (0, s, true);
                }
            }
            if ok.len() == r.world as usize {
                broadcast(&mut peers, "finish");
                return Ok(());
            }
            match events.recv_timeout(POLL) {
                Ok(Event::Line(from, line)) => {
                    let mut it = line.splitn(4, ' ');
                    if let (Some("ended"), Some(k), Some(_), Some(s)) =
                        (it.next(), it.next(), it.next(), it.next())
                        && k == round.to_string()
                    {
                        if s == "exit code 0" {
                            ok.insert(from);
                        } else {
                            break (from, s.to_string(), true);
                        }
                    }
                }
                Ok(Event::Gone(from)) => {
                    peers.remove(&from);
                    break (from, "its sandbox is gone".to_string(), false);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {}
            }
        };
        let (rank, why, restartable) = failure;
        // Stop every rank's command of this round before anything else starts.
        if let Some(own) = own.take() {
            own.kill();
        }
        broadcast(&mut peers, &format!("stop {round}"));
        let mut stopped: HashSet<u32> = HashSet::new();
        let until = Instant::now() + STOP;
        while stopped.len() < peers.len() && Instant::now() < until {
            match events.recv_timeout(POLL) {
                Ok(Event::Line(from, line)) if line == format!("stopped {round} {from}") => {
                    stopped.insert(from);
                }
                Ok(Event::Gone(from)) => {
                    peers.remove(&from);
                }
                _ => {}
            }
        }
        let left = r.restarts - round;
        if restartable && left > 0 && stopped.len() == peers.len() {
            eprintln!(
                "cannabis: rank {rank} ended in round {round} with {why}: every rank restarts \
                 ({left} restart{} left)",
                if left == 1 { "" } else { "s" }
            );
            continue;
        }
        let reason = if restartable {
            format!(
                "the restart budget is spent ({} restart{}): rank {rank} ended with {why}",
                r.restarts,
                if r.restarts == 1 { "" } else { "s" }
            )
        } else {
            format!("rank {rank} left the group in round {round}: {why}")
        };
        broadcast(&mut peers, &format!("give-up {reason}"));
        return Err(reason);
    }
    Err("no rounds left".into())
}

/// A rank above 0: meets rank 0, runs the rounds it is told to.
fn follow(r: &Ranks) -> Result<(), String> {
    let until = Instant::now() + MEET;
    let mut stream = loop {
        match TcpStream::connect((r.master.as_str(), CONTROL_PORT)) {
            Ok(s) => break s,
            Err(e) if Instant::now() > until => {
                return Err(format!(
                    "rank 0 was not reachable within {} s: {e}",
                    MEET.as_secs()
                ));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    send(&mut stream, &format!("hello {}", r.rank));
    let (tx, events) = mpsc::channel();
    listen(
        0,
        stream
            .try_clone()
            .map_err(|e| format!("rank 0's connection: {e}"))?,
        tx,
    );
    let mut running: Option<Running> = None;
    loop {
        if let Some(s) = running.as_mut().and_then(Running::ended) {
            let round = running.as_ref().map_or(0, |x| x.round);
            running = None;
            send(&mut stream, &format!("ended {round} {} {s}", r.rank));
        }
        match events.recv_timeout(POLL) {
            Ok(Event::Line(_, line)) => {
                if let Some(k) = line.strip_prefix("start ") {
                    let round = k.parse::<u32>().map_err(|_| "a bad round from rank 0")?;
                    if let Some(old) = running.take() {
                        old.kill();
                    }
                    running = Some(Running::start(r, round)?);
                } else if let Some(k) = line.strip_prefix("stop ") {
                    if let Some(old) = running.take() {
                        old.kill();
                    }
                    send(&mut stream, &format!("stopped {k} {}", r.rank));
                } else if line == "finish" {
                    return Ok(());
                } else if let Some(reason) = line.strip_prefix("give-up ") {
                    return Err(reason.to_string());
                }
            }
            Ok(Event::Gone(_)) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                if let Some(old) = running.take() {
                    old.kill();
                }
                return Err("rank 0 left the group".into());
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Vec<String> {
        vec!["/bin/sh".into(), "-c".into(), script.into()]
    }

    #[test]
    fn a_single_rank_is_restarted_within_its_budget_from_what_it_left() {
        let dir = tempfile::tempdir().unwrap();
        let step = dir.path().join("step");
        // Fails in round 0, succeeds in round 1 having read what round 0 wrote.
        let script = format!(
            "echo \"$CANNABIS_RESTART $MASTER_PORT\" >> {p}; [ \"$CANNABIS_RESTART\" = 1 ]",
            p = step.display()
        );
        let r = Ranks {
            rank: 0,
            world: 1,
            master: "127.0.0.1".into(),
            restarts: 1,
            command: sh(&script),
        };
        assert_eq!(supervise(&r), 0);
        assert_eq!(
            std::fs::read_to_string(&step).unwrap(),
            "0 29500\n1 29501\n"
        );
    }

    #[test]
    fn past_the_budget_a_rank_gives_up() {
        let r = Ranks {
            rank: 0,
            world: 1,
            master: "127.0.0.1".into(),
            restarts: 2,
            command: sh("kill -9 $$"),
        };
        let e = coordinate(&r).unwrap_err();
        assert_eq!(
            e,
            "the restart budget is spent (2 restarts): rank 0 ended with signal 9"
        );
    }
}

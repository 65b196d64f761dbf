//! The host side of a launch: start stage 1 as the sandbox uid, put it into the attempt's
//! cgroups, hand it the spec, and let the command start only when told.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt as _;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use super::{CgroupError, JobCgroup, STAGE1_ARG, SandboxSpec, files};

/// Why a sandbox could not be started.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The monitor process did not start.
    #[error("starting the sandbox monitor {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The monitor could not be put into the attempt's cgroups.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// The sandbox reported a set-up failure.
    #[error("sandbox set-up failed: {0}")]
    Setup(String),
    /// The sandbox did not report in time.
    #[error("the sandbox did not become ready within {0:?}")]
    Timeout(Duration),
    /// Talking to the monitor failed.
    #[error("talking to the sandbox monitor: {0}")]
    Io(#[from] std::io::Error),
}

/// A started sandbox, waiting for `go`. Dropping it never blocks: the monitor process is
/// reaped by a thread of its own when it ends.
#[derive(Debug)]
pub struct Launch {
    child: Option<Child>,
    pid: u32,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Drop for Launch {
    fn drop(&mut self) {
        drop(self.stdin.take());
        if let Some(mut child) = self.child.take() {
            std::thread::spawn(move || {
                let _ = child.wait();
            });
        }
    }
}

/// Starts stage 1 for `spec`, as host `ids` (uid, gid) when given, inside `cgroup`.
pub fn launch(
    spec: &SandboxSpec,
    ids: Option<(u32, u32)>,
    cgroup: &JobCgroup,
) -> Result<Launch, LaunchError> {
    // The attempt directory belongs to the sandbox uid: never follow a link planted there.
    let log = {
        use std::os::unix::fs::OpenOptionsExt as _;
        let path = spec.attempt_dir.join(files::SANDBOX_LOG);
        let _ = std::fs::remove_file(&path);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)?
    };
    let mut cmd = Command::new(&spec.program);
    cmd.arg(STAGE1_ARG)
        .env_clear()
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(log);
    if let Some((uid, gid)) = ids {
        cmd.uid(uid).gid(gid);
    }
    let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
        program: spec.program.display().to_string(),
        source,
    })?;
    // Stage 1 waits for the spec before doing anything, so it is inside the cgroups
    // before it can start a single process.
    if let Err(e) = cgroup.add(child.id()) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e.into());
    }
    let mut stdin = child.stdin.take();
    let stdout = child.stdout.take();
    let (tx, lines) = mpsc::sync_channel(4);
    if let Some(stdout) = stdout {
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    let spec_line = serde_json::to_string(spec).map_err(std::io::Error::other)?;
    if let Some(stdin) = stdin.as_mut() {
        writeln!(stdin, "{spec_line}")?;
        stdin.flush()?;
    }
    Ok(Launch {
        pid: child.id(),
        child: Some(child),
        stdin,
        lines,
    })
}

impl Launch {
    /// Host pid of the monitor (stage 1).
    pub fn monitor_pid(&self) -> u32 {
        self.pid
    }

    /// Waits for the sandbox to be set up. Returns the host pid of its pid 1 and the
    /// layers pid 1 says it applied.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<(u32, String), LaunchError> {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => {
                if let Some(rest) = line.strip_prefix("ready ") {
                    let (pid, layers) = rest.split_once(' ').unwrap_or((rest, ""));
                    let pid = pid
                        .parse()
                        .map_err(|_| LaunchError::Setup(format!("bad ready line {line:?}")))?;
                    Ok((pid, layers.to_string()))
                } else {
                    let why = line.strip_prefix("error ").unwrap_or(&line);
                    Err(LaunchError::Setup(why.to_string()))
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Err(LaunchError::Timeout(timeout)),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(LaunchError::Setup(
                "the monitor exited during set-up (see sandbox.log)".into(),
            )),
        }
    }

    /// Lets the command start.
    pub fn go(&mut self) -> Result<(), LaunchError> {
        if let Some(mut stdin) = self.stdin.take() {
            writeln!(stdin, "go")?;
            stdin.flush()?;
        }
        match self.lines.recv_timeout(Duration::from_secs(10)) {
            Ok(line) if line == "started" => Ok(()),
            Ok(line) => Err(LaunchError::Setup(line)),
            Err(_) => Err(LaunchError::Setup(
                "the monitor did not confirm the start".into(),
            )),
        }
    }

    /// Waits for the monitor (stage 1) to end.
    pub fn wait_exit(mut self) -> std::io::Result<()> {
        match self.child.take() {
            Some(mut child) => child.wait().map(|_| ()),
            None => Ok(()),
        }
    }

    /// Gives up before the start: the monitor sees its input close and ends the sandbox.
    pub fn abort(self) {
        drop(self);
    }
}

//! The host side of a launch: a monitor forked by the zygote as the sandbox uid, put into
//! the attempt's cgroups, handed the spec, and let the command start only when told.

use std::io::{BufRead, BufReader, Read as _, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::{JobCgroup, Launcher, SandboxSpec, files};

/// Why a sandbox could not be started.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The zygote process did not start.
    #[error("starting the sandbox zygote {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// The cause.
        source: std::io::Error,
    },
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

/// A started sandbox, waiting for `go`. Dropping it closes the control socket: a monitor
/// still waiting for `go` then ends the sandbox. The zygote reaps the monitor.
#[derive(Debug)]
pub struct Launch {
    pid: u32,
    control: BufReader<UnixStream>,
}

/// A monitor that is setting up its namespaces and waits to be put into the attempt's
/// cgroups ([`Starting::enter`]) before it starts any process. Dropping it ends the monitor.
#[derive(Debug)]
pub struct Starting {
    pid: u32,
    control: UnixStream,
}

/// Starts a monitor for `spec` through `launcher`, as host `ids` (uid, gid) when given,
/// and runs `meanwhile` (which makes the attempt's cgroups) while the zygote hands the
/// monitor out. The caller then calls [`Starting::enter`].
pub fn launch<T>(
    launcher: &Launcher,
    spec: &SandboxSpec,
    ids: Option<(u32, u32)>,
    meanwhile: impl FnOnce() -> T,
) -> Result<(Starting, T), LaunchError> {
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
    let (ours, theirs) = UnixStream::pair()?;
    let mut meanwhile = Some(meanwhile);
    let mut made = None;
    let pid = launcher.fork_monitor(ids, &OwnedFd::from(theirs), &log, &mut || {
        made = meanwhile.take().map(|f| f());
    })?;
    let made = made.ok_or_else(|| LaunchError::Setup("the zygote was never asked".into()))?;
    let mut control = ours;
    let spec_line = serde_json::to_string(spec).map_err(std::io::Error::other)?;
    writeln!(control, "{spec_line}")?;
    Ok((Starting { pid, control }, made))
}

impl Starting {
    /// Tells the monitor to move itself into `cgroup` and go on: it starts pid 1 only
    /// after that, and reports a failure to move as a set-up error ([`Launch::wait_ready`]).
    /// The host's check of the running sandbox confirms the membership.
    pub fn enter(self, cgroup: &JobCgroup) -> Result<Launch, LaunchError> {
        let Self { pid, mut control } = self;
        let files = serde_json::to_string(&cgroup.entry_files()).map_err(std::io::Error::other)?;
        writeln!(control, "enter {files}")?;
        Ok(Launch {
            pid,
            control: BufReader::new(control),
        })
    }
}

impl Launch {
    /// Host pid of the monitor (stage 1).
    pub fn monitor_pid(&self) -> u32 {
        self.pid
    }

    fn read_line(&mut self, timeout: Option<Duration>) -> Result<Option<String>, LaunchError> {
        self.control.get_ref().set_read_timeout(timeout)?;
        let mut line = String::new();
        match self.control.read_line(&mut line) {
            Ok(0) => Ok(None),
            Ok(_) => Ok(Some(line.trim_end().to_string())),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Err(LaunchError::Timeout(timeout.unwrap_or_default()))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Waits for the sandbox to be set up. Returns the host pid of its pid 1 and the
    /// layers pid 1 says it applied.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<(u32, String), LaunchError> {
        let Some(line) = self.read_line(Some(timeout))? else {
            return Err(LaunchError::Setup(
                "the monitor exited during set-up (see sandbox.log)".into(),
            ));
        };
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

    /// Lets the command start.
    pub fn go(&mut self) -> Result<(), LaunchError> {
        writeln!(self.control.get_mut(), "go")?;
        match self.read_line(Some(Duration::from_secs(10))) {
            Ok(Some(line)) if line == "started" => Ok(()),
            Ok(Some(line)) => Err(LaunchError::Setup(line)),
            Ok(None) | Err(_) => Err(LaunchError::Setup(
                "the monitor did not confirm the start".into(),
            )),
        }
    }

    /// Waits for the monitor (stage 1) to end: it holds the other end of the control
    /// socket until it exits, after writing `exit.json`.
    pub fn wait_exit(mut self) -> std::io::Result<()> {
        self.control.get_ref().set_read_timeout(None)?;
        let mut rest = Vec::new();
        self.control.read_to_end(&mut rest).map(|_| ())
    }

    /// Gives up before the start: the monitor sees its control socket close and ends the
    /// sandbox.
    pub fn abort(self) {
        drop(self);
    }
}

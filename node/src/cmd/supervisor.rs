//! `cannabis supervisor run | status | limits | clear`: the root supervisor and the local
//! commands that talk to it.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use cannabis_node::logging::{self, LogFormat};
use cannabis_node::store::Store;
use cannabis_node::supervisor::{Request, Supervisor, SupervisorClient, SupervisorConfig};
use cannabis_runtime::exec::{Limits, LimitsFile, layer_name};
use nix::sys::signal::{SigSet, Signal};
use tracing::{info, warn};

use crate::cli::{SupervisorCommand, SupervisorRunArgs};
use crate::output::out;

mod bench;

pub(super) fn run(command: SupervisorCommand, log_format: LogFormat) -> anyhow::Result<()> {
    match command {
        SupervisorCommand::Run(args) => serve(&args, log_format),
        SupervisorCommand::Status { socket, format } => {
            let status = SupervisorClient::new(&socket.socket).status()?;
            if format.json {
                out!("{}", serde_json::to_string_pretty(&status)?)?;
                return Ok(());
            }
            out!(
                "supervisor {} at {}",
                status.version,
                socket.socket.display()
            )?;
            out!(
                "runs as: {}",
                if status.as_root {
                    "root (each workload gets a uid of its own)"
                } else {
                    "an unprivileged user (custom code is refused)"
                }
            )?;
            out!("owner's switch: {}", status.control.name())?;
            let layers: Vec<String> = status.layers.iter().map(|l| layer_name(*l)).collect();
            out!("sandbox layers in effect: {}", layers.join(", "))?;
            out!("cgroups: {}", status.cgroups)?;
            out!(
                "ceilings: {}",
                status
                    .ceilings
                    .as_ref()
                    .map_or("the machine".to_string(), |p| p.display().to_string())
            )?;
            print_limits(&status.limits)
        }
        SupervisorCommand::Limits {
            file,
            socket,
            format,
        } => {
            let limits = read_limits(&file)?;
            let set: Limits = SupervisorClient::new(&socket.socket)
                .call(&Request::SetLimits { limits }, &[])
                .context("the supervisor refused the limits")?;
            if format.json {
                out!("{}", serde_json::to_string_pretty(&set)?)?;
                return Ok(());
            }
            out!("the owner's limits are now:")?;
            print_limits(&set)
        }
        SupervisorCommand::Bench { runs, format } => bench::run(runs, format.json),
        SupervisorCommand::Clear { id, socket } => {
            let () = SupervisorClient::new(&socket.socket)
                .call(&Request::Clear { id: id.clone() }, &[])?;
            out!("cleared {id}")?;
            Ok(())
        }
    }
}

fn print_limits(l: &Limits) -> anyhow::Result<()> {
    out!(
        "  cpu {} cores, memory {} MiB, swap {} MiB, processes {}, storage {} MiB",
        l.cpu_millicores as f64 / 1000.0,
        l.memory_bytes >> 20,
        l.swap_bytes >> 20,
        l.processes,
        l.storage_bytes >> 20
    )?;
    let adapters: Vec<&str> = l
        .adapters
        .iter()
        .map(|a| cannabis_runtime::exec::kind_name(*a))
        .collect();
    out!(
        "  gpus [{}], adapters [{}], custom code {}",
        l.gpus.join(", "),
        adapters.join(", "),
        if l.custom_code { "allowed" } else { "refused" }
    )?;
    Ok(())
}

fn read_limits(path: &Path) -> anyhow::Result<LimitsFile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    LimitsFile::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// The node user's uid and primary gid, by name or number.
fn node_user(user: &str) -> anyhow::Result<(u32, u32)> {
    let found = match user.parse::<u32>() {
        Ok(uid) => nix::unistd::User::from_uid(uid.into())?,
        Err(_) => nix::unistd::User::from_name(user)?,
    };
    let u = found.with_context(|| format!("no user {user} on this machine"))?;
    Ok((u.uid.as_raw(), u.gid.as_raw()))
}

fn serve(args: &SupervisorRunArgs, log_format: LogFormat) -> anyhow::Result<()> {
    logging::init(log_format);
    // Signals are taken by one thread: block them before any other thread starts.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGTERM);
    signals.add(Signal::SIGINT);
    signals.thread_block()?;
    if !nix::unistd::geteuid().is_root() {
        warn!(
            "not root: workloads would run as this user, so custom code is refused; run the supervisor as root"
        );
    }
    let (node_uid, node_gid) = node_user(&args.node_user)?;
    let dir = &args.dir;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let owner = match &args.limits {
        Some(path) => read_limits(path)?,
        None => LimitsFile::default(),
    };
    let journal = Arc::new(Store::open(&dir.join("journal.redb"))?);
    let gpus =
        cannabis_runtime::probe::gpus(&cannabis_runtime::gpu::Nvml, &[], args.cdi_map.as_deref())
            .1
            .into_iter()
            .map(|g| g.uuid)
            .collect();
    let machine = cannabis_node::exec::machine_limits(dir, gpus);
    let executor = cannabis_node::exec::open(
        &dir.join("exec"),
        &machine,
        &args.ceilings,
        &owner,
        args.cdi_map.as_deref(),
        journal,
        None,
    )
    .map_err(|e| anyhow::anyhow!("the executor cannot run here: {e}"))?;
    let cfg = SupervisorConfig {
        socket: args.socket.socket.clone(),
        dir: dir.clone(),
        node_uid,
        node_gid,
    };
    let supervisor = Arc::new(Supervisor::new(cfg, executor.clone())?);
    let listener = supervisor.bind()?;
    info!(
        socket = %args.socket.socket.display(),
        node_uid,
        layers = ?executor.layers().iter().map(|l| layer_name(*l)).collect::<Vec<_>>(),
        cgroups = %executor.cgroups(),
        "supervisor ready"
    );
    let socket = args.socket.socket.clone();
    std::thread::Builder::new()
        .name("supervisor-signals".into())
        .spawn(move || {
            if let Ok(signal) = signals.wait() {
                info!(
                    ?signal,
                    "stopping: running sandboxes keep going under their leases"
                );
                executor.shutdown();
                let _ = std::fs::remove_file(&socket);
                std::process::exit(0);
            }
        })?;
    supervisor.serve(&listener)
}

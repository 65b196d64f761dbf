//! The confinement pid 1 applies to itself before it starts the command (which inherits
//! all of it): rlimits, Landlock, capabilities and the seccomp filter.

use std::collections::BTreeMap;

use caps::CapSet;
use landlock::{
    ABI, Access, AccessFs, AccessNet, CompatLevel, Compatible, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus, Scope, path_beneath_rules,
};
use nix::sys::resource::{Resource, getrlimit, setrlimit};
use seccompiler::{
    SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};

use super::Rlimits;
use super::paths::{READ_ONLY, READ_WRITE};

type R<T> = Result<T, String>;

/// Sets the workload's rlimits (never above the current hard limit: this process may lack
/// `CAP_SYS_RESOURCE`).
pub(super) fn rlimits(limits: &Rlimits) -> R<()> {
    let set = |resource: Resource, value: u64| -> R<()> {
        let (_, hard) = getrlimit(resource).map_err(|e| format!("getrlimit {resource:?}: {e}"))?;
        let value = value.min(hard);
        setrlimit(resource, value, value).map_err(|e| format!("setrlimit {resource:?}: {e}"))
    };
    set(Resource::RLIMIT_CORE, 0)?;
    set(Resource::RLIMIT_FSIZE, limits.file_size)?;
    set(Resource::RLIMIT_NOFILE, limits.open_files)?;
    if let Some(n) = limits.processes {
        set(Resource::RLIMIT_NPROC, n)?;
    }
    Ok(())
}

/// Landlock: read and execute beneath the system paths, the inputs and the bundle; write
/// only beneath the work directory; no TCP; no signals or abstract sockets leaving the
/// sandbox. Applied as far as the kernel supports it; `true` only when the kernel enforces
/// all of it (only then is the layer advertised).
pub(super) fn landlock(devices: &[std::path::PathBuf]) -> R<bool> {
    let abi = ABI::V6;
    let err = |e: landlock::RulesetError| format!("landlock: {e}");
    let existing = |paths: &'static [&'static str]| {
        paths
            .iter()
            .copied()
            .filter(|p| std::path::Path::new(p).exists())
            .collect::<Vec<_>>()
    };
    let status = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(abi))
        .map_err(err)?
        .handle_access(AccessNet::BindTcp | AccessNet::ConnectTcp)
        .map_err(err)?
        .scope(Scope::AbstractUnixSocket | Scope::Signal)
        .map_err(err)?
        .create()
        .map_err(err)?
        .add_rules(path_beneath_rules(
            existing(READ_ONLY),
            AccessFs::from_read(abi),
        ))
        .map_err(err)?
        .add_rules(path_beneath_rules(
            existing(READ_WRITE),
            AccessFs::from_all(abi),
        ))
        .map_err(err)?
        .add_rules(path_beneath_rules(
            existing(&["/dev/null", "/dev/zero", "/dev/full"]),
            AccessFs::from_read(abi) | AccessFs::WriteFile,
        ))
        .map_err(err)?
        .add_rules(path_beneath_rules(
            devices.iter().filter(|d| d.exists()),
            AccessFs::from_read(abi) | AccessFs::WriteFile | AccessFs::IoctlDev,
        ))
        .map_err(err)?
        .restrict_self()
        .map_err(err)?;
    Ok(status.ruleset == RulesetStatus::FullyEnforced)
}

/// Drops every capability: bounding set first (so that running a program as uid 0 inside
/// the namespace cannot regain any), then ambient, inheritable, effective and permitted.
pub(super) fn drop_capabilities() -> R<()> {
    for cap in caps::all() {
        caps::drop(None, CapSet::Bounding, cap).map_err(|e| format!("dropping {cap}: {e}"))?;
    }
    for set in [
        CapSet::Ambient,
        CapSet::Inheritable,
        CapSet::Effective,
        CapSet::Permitted,
    ] {
        caps::clear(None, set).map_err(|e| format!("clearing {set:?} capabilities: {e}"))?;
    }
    Ok(())
}

/// System calls the command never gets (`EPERM`): mounts and namespaces, tracing other
/// processes, kernel modules and keyrings, BPF, perf, io_uring (which would bypass this
/// filter), clocks, swap, reboot.
const DENIED: &[i64] = &[
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_fsopen,
    libc::SYS_fsmount,
    libc::SYS_fsconfig,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_userfaultfd,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_fanotify_init,
    libc::SYS_syslog,
    libc::SYS_quotactl,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_sethostname,
    libc::SYS_setdomainname,
    libc::SYS_vhangup,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_iopl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_ioperm,
];

const NAMESPACE_FLAGS: &[i32] = &[
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWNS,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWCGROUP,
];

#[cfg(target_arch = "x86_64")]
const ARCH: Option<seccompiler::TargetArch> = Some(seccompiler::TargetArch::x86_64);
/// `__X32_SYSCALL_BIT`: x32 calls pass an x86-64 architecture check with this bit set.
#[cfg(target_arch = "x86_64")]
const X32_BIT: Option<i64> = Some(0x4000_0000);
#[cfg(not(target_arch = "x86_64"))]
const X32_BIT: Option<i64> = None;
#[cfg(target_arch = "aarch64")]
const ARCH: Option<seccompiler::TargetArch> = Some(seccompiler::TargetArch::aarch64);
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const ARCH: Option<seccompiler::TargetArch> = None;

/// Installs the filter: the calls in [`DENIED`]; `socket` for every family but
/// `AF_UNIX`; `clone` with any namespace flag; and `clone3` (whose flags live in memory a
/// filter cannot read) answered `ENOSYS`, so that the C library falls back to `clone`.
pub(super) fn seccomp() -> R<()> {
    let arch = ARCH.ok_or("no seccomp filter for this architecture")?;
    let err = |e: seccompiler::BackendError| format!("seccomp: {e}");
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for &call in DENIED {
        rules.insert(call, Vec::new());
        // The same calls through the x32 ABI (same architecture token, numbers with bit
        // 30 set), where a kernel has it on.
        if let Some(x32) = X32_BIT {
            rules.insert(call | x32, Vec::new());
        }
    }
    let not_unix = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Ne,
        libc::AF_UNIX as u64,
    )
    .map_err(err)?;
    for nr in [
        Some(libc::SYS_socket),
        X32_BIT.map(|b| libc::SYS_socket | b),
    ]
    .into_iter()
    .flatten()
    {
        let rule = SeccompRule::new(vec![not_unix.clone()]).map_err(err)?;
        rules.insert(nr, vec![rule]);
    }
    let mut clone_rules = Vec::new();
    for &flag in NAMESPACE_FLAGS {
        let flag = flag as u64;
        let cond = SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(flag),
            flag,
        )
        .map_err(err)?;
        clone_rules.push(SeccompRule::new(vec![cond]).map_err(err)?);
    }
    if let Some(x32) = X32_BIT {
        rules.insert(libc::SYS_clone | x32, clone_rules.clone());
    }
    rules.insert(libc::SYS_clone, clone_rules);
    let main = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(err)?;
    let clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(err)?;
    for filter in [main, clone3] {
        let program: seccompiler::BpfProgram = filter
            .try_into()
            .map_err(|e: seccompiler::BackendError| format!("seccomp: {e}"))?;
        seccompiler::apply_filter(&program).map_err(|e| format!("seccomp: {e}"))?;
    }
    Ok(())
}

//! The confinement pid 1 applies to itself before it starts the command (which inherits
//! all of it): rlimits, Landlock, capabilities and the seccomp filter.

use caps::CapSet;
use landlock::{
    ABI, Access, AccessFs, AccessNet, CompatLevel, Compatible, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus, Scope, path_beneath_rules,
};
use nix::sys::resource::{Resource, getrlimit, setrlimit};

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
/// only beneath the work directory; no TCP (unless `loopback`: the sandbox's own loopback
/// is then its network); no signals or abstract sockets leaving the sandbox. Applied as
/// far as the kernel supports it; `true` only when the kernel enforces all of it (only
/// then is the layer advertised).
pub(super) fn landlock(devices: &[std::path::PathBuf], loopback: bool) -> R<bool> {
    let abi = ABI::V6;
    let err = |e: landlock::RulesetError| format!("landlock: {e}");
    // Paths that exist, less links into a directory the rules already name (`/bin` is
    // `usr/bin` on most systems): each rule costs an open and a system call.
    let existing = |paths: &'static [&'static str]| {
        let is_link =
            |p: &str| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink());
        paths
            .iter()
            .copied()
            .filter(|p| std::path::Path::new(p).exists())
            .filter(|p| {
                !is_link(p)
                    || !std::fs::canonicalize(p).is_ok_and(|target| {
                        paths
                            .iter()
                            .any(|q| q != p && !is_link(q) && target.starts_with(q))
                    })
            })
            .collect::<Vec<_>>()
    };
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(abi))
        .map_err(err)?;
    if !loopback {
        ruleset = ruleset
            .handle_access(AccessNet::BindTcp | AccessNet::ConnectTcp)
            .map_err(err)?;
    }
    let status = ruleset
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

/// `AUDIT_ARCH_X86_64`: `EM_X86_64` (62), 64-bit, little-endian.
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: Option<u32> = Some(0xC000_003E);
/// `AUDIT_ARCH_AARCH64`: `EM_AARCH64` (183), 64-bit, little-endian.
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: Option<u32> = Some(0xC000_00B7);
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const AUDIT_ARCH: Option<u32> = None;
/// `__X32_SYSCALL_BIT`: x32 calls pass an x86-64 architecture check with this bit set.
#[cfg(target_arch = "x86_64")]
const X32_BIT: Option<u32> = Some(0x4000_0000);
#[cfg(not(target_arch = "x86_64"))]
const X32_BIT: Option<u32> = None;

/// The compiled filter, built once: in the zygote before it forks anything, so that each
/// sandbox only installs it.
static PROGRAM: std::sync::OnceLock<R<seccompiler::BpfProgram>> = std::sync::OnceLock::new();
/// The same with `AF_INET` and `AF_INET6` sockets allowed (a sandbox on its own loopback).
static LOOPBACK_PROGRAM: std::sync::OnceLock<R<seccompiler::BpfProgram>> =
    std::sync::OnceLock::new();

/// Compiles the filters now (see [`PROGRAM`]).
pub(super) fn prepare_seccomp() {
    let _ = PROGRAM.get_or_init(|| compile(false));
    let _ = LOOPBACK_PROGRAM.get_or_init(|| compile(true));
}

/// Installs the filter: the calls in [`DENIED`] and every x32 call get `EPERM`; so do
/// `socket` for every family but `AF_UNIX` (and, with `loopback`, `AF_INET`, `AF_INET6`
/// and routing netlink) and `clone` with any namespace flag; `clone3` (whose flags live in memory
/// a filter cannot read) gets `ENOSYS`, so that the C library falls back to `clone`. A
/// call from another architecture kills the process.
pub(super) fn seccomp(loopback: bool) -> R<()> {
    let program = if loopback {
        LOOPBACK_PROGRAM.get_or_init(|| compile(true))
    } else {
        PROGRAM.get_or_init(|| compile(false))
    }
    .as_ref()
    .map_err(Clone::clone)?;
    seccompiler::apply_filter(program).map_err(|e| format!("seccomp: {e}"))
}

/// The filter, written out rather than compiled by seccompiler: the kernel runs a new
/// filter once for every call number of every architecture when it installs it, so its
/// cost grows with the filter's length. seccompiler's rule compiler made 317 instructions
/// of this deny-list (a quarter of a millisecond per sandbox to install); this is one
/// comparison per denied call, about 70. seccompiler still installs it.
fn compile(loopback: bool) -> R<seccompiler::BpfProgram> {
    use libc::{
        BPF_ABS, BPF_JEQ, BPF_JGE, BPF_JMP, BPF_JSET, BPF_K, BPF_LD, BPF_RET, BPF_W,
        SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, SECCOMP_RET_KILL_PROCESS,
    };
    let audit_arch = AUDIT_ARCH.ok_or("no seccomp filter for this architecture")?;
    // Offsets in `struct seccomp_data`: the call number, the architecture, and the low
    // half of the first argument (little-endian; `clone` reads only the low 32 bits of its
    // flags).
    const NR: u32 = 0;
    const ARCH_OFFSET: u32 = 4;
    const ARG0_LOW: u32 = 16;
    const ARG2_LOW: u32 = 32;
    let nr = |call: i64| u32::try_from(call).map_err(|_| format!("call number {call}"));
    let namespaces = NAMESPACE_FLAGS
        .iter()
        .fold(0u32, |m, &f| m | u32::try_from(f).unwrap_or(0));
    let af_unix = u32::try_from(libc::AF_UNIX).unwrap_or(u32::MAX);
    let errno = |e: i32| SECCOMP_RET_ERRNO | u32::try_from(e).unwrap_or(0);

    // Instructions whose jumps name labels, resolved below.
    enum Op {
        Load(u32),
        Ret(u32),
        /// `A == k` (or `A >= k`, or `A & k`): to `then` if true, else on.
        Jump(u32, u32, Label),
        /// `A == k`: on if true, else to `otherwise`.
        Unless(u32, Label),
        Mark(Label),
    }
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Label {
        Deny,
        Allow,
        Socket,
        Netlink,
        Clone,
        Clone3,
        Kill,
    }
    let jeq = BPF_JMP | BPF_JEQ | BPF_K;
    let mut ops = vec![
        Op::Load(ARCH_OFFSET),
        Op::Unless(audit_arch, Label::Kill),
        Op::Load(NR),
    ];
    if let Some(x32) = X32_BIT {
        ops.push(Op::Jump(BPF_JMP | BPF_JGE | BPF_K, x32, Label::Deny));
    }
    for &call in DENIED {
        ops.push(Op::Jump(jeq, nr(call)?, Label::Deny));
    }
    ops.push(Op::Jump(jeq, nr(libc::SYS_socket)?, Label::Socket));
    ops.push(Op::Jump(jeq, nr(libc::SYS_clone)?, Label::Clone));
    ops.push(Op::Jump(jeq, nr(libc::SYS_clone3)?, Label::Clone3));
    ops.push(Op::Ret(SECCOMP_RET_ALLOW));
    ops.push(Op::Mark(Label::Socket));
    ops.push(Op::Load(ARG0_LOW));
    ops.push(Op::Jump(jeq, af_unix, Label::Allow));
    if loopback {
        for family in [libc::AF_INET, libc::AF_INET6] {
            let family = u32::try_from(family).unwrap_or(u32::MAX);
            ops.push(Op::Jump(jeq, family, Label::Allow));
        }
        let netlink = u32::try_from(libc::AF_NETLINK).unwrap_or(u32::MAX);
        ops.push(Op::Jump(jeq, netlink, Label::Netlink));
    }
    ops.push(Op::Ret(errno(libc::EPERM)));
    if loopback {
        // Routing netlink only: how a program lists its interfaces and addresses
        // (`getifaddrs`); without capabilities it changes nothing. Not the other netlink
        // families (the kernel's device events among them).
        ops.push(Op::Mark(Label::Netlink));
        ops.push(Op::Load(ARG2_LOW));
        let route = u32::try_from(libc::NETLINK_ROUTE).unwrap_or(u32::MAX);
        ops.push(Op::Jump(jeq, route, Label::Allow));
        ops.push(Op::Ret(errno(libc::EPERM)));
    }
    ops.push(Op::Mark(Label::Clone));
    ops.push(Op::Load(ARG0_LOW));
    ops.push(Op::Jump(
        BPF_JMP | BPF_JSET | BPF_K,
        namespaces,
        Label::Deny,
    ));
    ops.push(Op::Mark(Label::Allow));
    ops.push(Op::Ret(SECCOMP_RET_ALLOW));
    ops.push(Op::Mark(Label::Clone3));
    ops.push(Op::Ret(errno(libc::ENOSYS)));
    ops.push(Op::Mark(Label::Deny));
    ops.push(Op::Ret(errno(libc::EPERM)));
    // A foreign architecture's call numbers mean other calls.
    ops.push(Op::Mark(Label::Kill));
    ops.push(Op::Ret(SECCOMP_RET_KILL_PROCESS));

    // Where each label lands, counting real instructions only.
    let mut at = Vec::new();
    let mut pc = 0usize;
    for op in &ops {
        match op {
            Op::Mark(l) => at.push((*l, pc)),
            _ => pc += 1,
        }
    }
    let target = |l: Label, from: usize| -> R<u8> {
        let to = at
            .iter()
            .find(|(m, _)| *m == l)
            .map(|(_, pc)| *pc)
            .ok_or("seccomp: a jump to nowhere")?;
        u8::try_from(to - from - 1).map_err(|_| "seccomp: a jump too far".to_string())
    };
    let code = |c: u32| u16::try_from(c).unwrap_or(u16::MAX);
    let mut program = Vec::new();
    for op in &ops {
        let pc = program.len();
        let insn = match *op {
            Op::Mark(_) => continue,
            Op::Load(k) => seccompiler::sock_filter {
                code: code(BPF_LD | BPF_W | BPF_ABS),
                jt: 0,
                jf: 0,
                k,
            },
            Op::Ret(k) => seccompiler::sock_filter {
                code: code(BPF_RET | BPF_K),
                jt: 0,
                jf: 0,
                k,
            },
            Op::Jump(c, k, l) => seccompiler::sock_filter {
                code: code(c),
                jt: target(l, pc)?,
                jf: 0,
                k,
            },
            Op::Unless(k, l) => seccompiler::sock_filter {
                code: code(jeq),
                jt: 0,
                jf: target(l, pc)?,
                k,
            },
        };
        program.push(insn);
    }
    Ok(program)
}

//! A group rank's network interface: a TUN device inside the rank's sandbox, the only way
//! out of the sandbox's network namespace besides its own loopback. Every packet the
//! workload sends to another rank's address arrives on the device's descriptor, which the
//! node holds and carries through the group's channel; what the channel brings back is
//! written to the descriptor and arrives in the sandbox. Nothing else is routed: the
//! namespace has no other interface, and the node passes on only packets between the
//! group's own addresses.
//!
//! Made with ioctls rather than a crate: four calls on one descriptor, where the TUN
//! crates bring async runtimes and platform layers of their own. The ioctls are the
//! module's only unsafe code.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::fs::OpenOptionsExt as _;

/// The interface's name in every rank's sandbox (what `GLOO_SOCKET_IFNAME` and
/// `NCCL_SOCKET_IFNAME` name).
pub const INTERFACE: &str = "cnb0";

/// The group's network: `10.29.0.0/16`, rank `r` at `10.29.0.0 + r + 1`. Private, and
/// only ever inside sandboxes' own namespaces, where it meets nothing of the host's.
pub const NETWORK: Ipv4Addr = Ipv4Addr::new(10, 29, 0, 0);

/// The network's prefix length.
pub const PREFIX: u8 = 16;

/// The most ranks a group's network holds.
pub const MAX_RANKS: u32 = (1 << (32 - PREFIX)) - 2;

/// The address of rank `rank` (below [`MAX_RANKS`]).
pub fn rank_address(rank: u32) -> Option<Ipv4Addr> {
    (rank < MAX_RANKS).then(|| Ipv4Addr::from(u32::from(NETWORK) + rank + 1))
}

/// The rank whose address is `addr`, if it is one of the network's.
pub fn rank_of(addr: Ipv4Addr) -> Option<u32> {
    let host = u32::from(addr).checked_sub(u32::from(NETWORK))?;
    (1..=MAX_RANKS).contains(&host).then(|| host - 1)
}

/// Runs `f` on a thread of its own inside the network namespace `ns` (what it creates
/// there stays there); the caller's threads never change namespace. Needs the right to
/// enter it (root, for a sandbox the executor made as root).
pub fn in_namespace<T: Send>(ns: &File, f: impl FnOnce() -> io::Result<T> + Send) -> io::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
                io::Error::other(format!("entering the sandbox's network namespace: {e}"))
            })?;
            f()
        })
        .join()
        .map_err(|_| io::Error::other("a thread in the sandbox's network namespace panicked"))?
    })
}

/// Makes [`INTERFACE`] in the network namespace `ns` with rank `rank`'s address, the
/// given MTU, and no IPv6; up. The descriptor (non-blocking) reads what the sandbox sends
/// and writes what it receives, one IPv4 packet per call, with no header of its own.
pub fn make_interface(ns: &File, rank: u32, mtu: u32) -> io::Result<OwnedFd> {
    let addr = rank_address(rank)
        .ok_or_else(|| io::Error::other(format!("rank {rank}: over {MAX_RANKS} ranks")))?;
    let mtu = libc::c_int::try_from(mtu).map_err(|_| io::Error::other("an MTU over 2^31"))?;
    in_namespace(ns, || {
        let tun = File::options()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open("/dev/net/tun")
            .map_err(|e| io::Error::new(e.kind(), format!("/dev/net/tun: {e}")))?;
        let sock = config_socket()?;
        let netmask = Ipv4Addr::from(u32::MAX << (32 - PREFIX));
        // SAFETY: `ifreq` is plain data (zeroes are a valid value); the name is
        // NUL-terminated within its 16 bytes; each ioctl reads (and SIOCGIFFLAGS writes)
        // only the `ifreq` passed, on descriptors this function owns.
        unsafe {
            let mut req: libc::ifreq = std::mem::zeroed();
            for (d, s) in req.ifr_name.iter_mut().zip(INTERFACE.as_bytes()) {
                *d = *s as libc::c_char;
            }
            req.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short;
            check(
                libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &req),
                "TUNSETIFF",
            )?;
            let s = sock.as_raw_fd();
            req.ifr_ifru.ifru_addr = sockaddr(addr);
            check(libc::ioctl(s, libc::SIOCSIFADDR, &req), "SIOCSIFADDR")?;
            req.ifr_ifru.ifru_netmask = sockaddr(netmask);
            check(libc::ioctl(s, libc::SIOCSIFNETMASK, &req), "SIOCSIFNETMASK")?;
            req.ifr_ifru.ifru_mtu = mtu;
            check(libc::ioctl(s, libc::SIOCSIFMTU, &req), "SIOCSIFMTU")?;
            check(libc::ioctl(s, libc::SIOCGIFFLAGS, &mut req), "SIOCGIFFLAGS")?;
            req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            check(libc::ioctl(s, libc::SIOCSIFFLAGS, &req), "SIOCSIFFLAGS")?;
        }
        // IPv4 only: no link-local IPv6 address for a program to pick and find unrouted.
        // (This thread's /proc/sys/net is the namespace's.) Where IPv6 is off, nothing to do.
        let _ = std::fs::write(
            format!("/proc/sys/net/ipv6/conf/{INTERFACE}/disable_ipv6"),
            "1",
        );
        Ok(OwnedFd::from(tun))
    })
}

/// A socket whose ioctls configure the current network namespace's interfaces.
pub(crate) fn config_socket() -> nix::Result<OwnedFd> {
    nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
}

/// `sockaddr_in` for `addr`, as the `sockaddr` an `ifreq` holds.
fn sockaddr(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: `sockaddr_in` and `sockaddr` have the same size (16 bytes) and both are
    // plain data.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn check(rc: libc::c_int, what: &str) -> io::Result<()> {
    if rc < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(())
}

/// The source and destination of an IPv4 packet, if `packet` holds one.
pub fn ipv4_ends(packet: &[u8]) -> Option<(Ipv4Addr, Ipv4Addr)> {
    if packet.len() < 20 || packet[0] >> 4 != 4 {
        return None;
    }
    let at = |i: usize| Ipv4Addr::new(packet[i], packet[i + 1], packet[i + 2], packet[i + 3]);
    Some((at(12), at(16)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_and_addresses_map_both_ways_within_the_network() {
        assert_eq!(rank_address(0), Some(Ipv4Addr::new(10, 29, 0, 1)));
        assert_eq!(rank_address(255), Some(Ipv4Addr::new(10, 29, 1, 0)));
        assert_eq!(rank_address(MAX_RANKS), None);
        for r in [0, 1, 254, 255, 1000, MAX_RANKS - 1] {
            assert_eq!(rank_of(rank_address(r).unwrap()), Some(r));
        }
        assert_eq!(rank_of(NETWORK), None);
        assert_eq!(rank_of(Ipv4Addr::new(10, 29, 255, 255)), None);
        assert_eq!(rank_of(Ipv4Addr::new(10, 30, 0, 1)), None);
        assert_eq!(rank_of(Ipv4Addr::new(127, 0, 0, 1)), None);
    }

    #[test]
    fn only_an_ipv4_header_has_ends() {
        let mut p = [0u8; 20];
        p[0] = 0x45;
        p[12..16].copy_from_slice(&[10, 29, 0, 2]);
        p[16..20].copy_from_slice(&[10, 29, 0, 1]);
        assert_eq!(
            ipv4_ends(&p),
            Some((Ipv4Addr::new(10, 29, 0, 2), Ipv4Addr::new(10, 29, 0, 1)))
        );
        p[0] = 0x60;
        assert_eq!(ipv4_ends(&p), None, "IPv6");
        assert_eq!(ipv4_ends(&[0x45; 19]), None, "short");
    }
}

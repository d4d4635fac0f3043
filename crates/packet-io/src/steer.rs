//! The XDP steering program and its loader (aya).
//!
//! [`Steering::attach`] loads the program the build compiled, attaches it to an
//! interface — native (driver) mode first, generic (skb) mode if the driver
//! refuses — and detaches it when dropped. Three maps say what to redirect:
//!
//! * `steer` — [`SteerKey`]s matched on a packet's destination: the services'
//!   virtual addresses ([`Steering::add`]);
//! * `backends` — [`SteerKey`]s matched on a packet's *source*: nat backends,
//!   whose replies weir rewrites back to the virtual address
//!   ([`Steering::add_backend`]);
//! * `local_ports` — a port range per (local address, protocol), matched on
//!   the destination: fnat replies to weir's own addresses
//!   ([`Steering::add_local`]); the kernel's connections from those addresses
//!   use ports outside the range and keep working.
//!
//! ICMP and ICMPv6 errors (destination unreachable, packet too big, time
//! exceeded) are steered when the packet they quote is one weir sent: from a
//! virtual address (`steer`, by the quoted source), from a local address
//! inside its range, or to a nat backend (by the quoted destination).
//!
//! The `xsks` map holds one AF_XDP socket per queue.

use std::net::{IpAddr, SocketAddr};
use std::ops::RangeInclusive;
use std::os::fd::AsRawFd;

use aya::Ebpf;
use aya::maps::{HashMap, MapData, PerCpuArray, XskMap};
use aya::programs::{Xdp, XdpFlags, xdp::XdpLinkId};

/// The steering program as the build compiled it (an ELF object with BTF).
static PROGRAM: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/steer.bpf.o"));

/// Name of the XDP function in `bpf/steer.bpf.c`.
const PROGRAM_NAME: &str = "weir_steer";

/// False when the build had no clang (see build.rs): then there is no
/// program to load.
pub const PROGRAM_BUILT: bool = !cfg!(weir_no_bpf);

/// Transport protocols the program steers (IANA numbers, as in the IP header).
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;

/// Errors of [`Steering`]'s operations.
#[derive(Debug, thiserror::Error)]
pub enum SteerError {
    /// This build has no XDP program: clang (with the kernel and libbpf
    /// headers) was missing when it was built.
    #[error(
        "this weir was built without its XDP program (no clang at build time): install Debian's \
         clang, llvm and libbpf-dev and build again"
    )]
    NotBuilt,
    /// The embedded object did not load (a kernel without BPF, or no privilege).
    #[error("loading the XDP program: {0} (needs root or CAP_BPF and CAP_NET_ADMIN)")]
    Load(Box<aya::EbpfError>),
    /// The kernel's verifier or the attach refused the program.
    #[error("XDP program on {interface}: {source}")]
    Program {
        /// The interface named to [`Steering::attach`].
        interface: String,
        /// What aya reported.
        source: Box<aya::programs::ProgramError>,
    },
    /// Neither native nor generic mode attached.
    #[error(
        "cannot attach XDP to {interface}: native mode: {native}; generic mode: {generic} \
         (does the interface exist in this network namespace?)"
    )]
    Attach {
        /// The interface named to [`Steering::attach`].
        interface: String,
        /// Why native (driver) mode failed.
        native: Box<aya::programs::ProgramError>,
        /// Why generic (skb) mode failed.
        generic: Box<aya::programs::ProgramError>,
    },
    /// A map of the program is missing or of the wrong type (a build mismatch).
    #[error("XDP program map {name}: {source}")]
    Map {
        /// The map's name in `bpf/steer.bpf.c`.
        name: &'static str,
        /// What aya reported.
        source: Box<aya::maps::MapError>,
    },
    /// The object has no map or program of that name (a build mismatch).
    #[error("the XDP object has no map or program named {0} (a build mismatch)")]
    Missing(&'static str),
    /// Only TCP and UDP are steered.
    #[error("protocol {0} cannot be steered (only TCP 6 and UDP 17)")]
    Protocol(u8),
    /// A local port range that is empty or includes port 0.
    #[error("local port range {first}-{last} is empty or includes port 0")]
    PortRange {
        /// First port of the range as given.
        first: u16,
        /// Last port of the range as given.
        last: u16,
    },
}

/// How the program is attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMode {
    /// In the driver (`xdpdrv`): before the kernel allocates an skb.
    Native,
    /// Generic (`xdpgeneric`, skb mode): works on any interface, slower.
    Generic,
}

impl std::fmt::Display for AttachMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AttachMode::Native => "native (xdpdrv)",
            AttachMode::Generic => "generic (xdpgeneric)",
        })
    }
}

/// One steered (destination address, protocol, destination port).
///
/// Layout shared with `struct steer_key` in `bpf/steer.bpf.c`: an IPv4 address
/// is stored IPv4-mapped (`::ffff:a.b.c.d`), the port in network byte order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SteerKey {
    addr: [u8; 16],
    proto: u8,
    pad: u8,
    port_be: [u8; 2],
}

// SAFETY: `SteerKey` is `repr(C)`, `Copy`, 20 bytes with no padding (16 + 1 + 1
// + 2, alignment 1), and every bit pattern is a valid value, which is what aya
// requires of a map key it copies to and from the kernel.
unsafe impl aya::Pod for SteerKey {}

impl SteerKey {
    /// The key for `protocol` (6 TCP, 17 UDP) to `addr`.
    pub fn new(addr: SocketAddr, protocol: u8) -> Result<Self, SteerError> {
        if protocol != IPPROTO_TCP && protocol != IPPROTO_UDP {
            return Err(SteerError::Protocol(protocol));
        }
        let ip = match addr.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        Ok(Self {
            addr: ip.octets(),
            proto: protocol,
            pad: 0,
            port_be: addr.port().to_be_bytes(),
        })
    }

    /// A TCP key.
    pub fn tcp(addr: SocketAddr) -> Self {
        Self::new(addr, IPPROTO_TCP).expect("TCP is steerable")
    }

    /// A UDP key.
    pub fn udp(addr: SocketAddr) -> Self {
        Self::new(addr, IPPROTO_UDP).expect("UDP is steerable")
    }
}

/// One local address and protocol whose port range fnat replies use.
///
/// Layout shared with `struct local_key` in `bpf/steer.bpf.c` (address
/// IPv4-mapped as in [`SteerKey`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct LocalKey {
    addr: [u8; 16],
    proto: u8,
    pad: [u8; 3],
}

// SAFETY: `repr(C)`, `Copy`, 20 bytes with no padding (16 + 1 + 3, alignment
// 1); every bit pattern is a valid value.
unsafe impl aya::Pod for LocalKey {}

impl LocalKey {
    fn new(addr: IpAddr, protocol: u8) -> Result<Self, SteerError> {
        let k = SteerKey::new(SocketAddr::new(addr, 0), protocol)?;
        Ok(Self {
            addr: k.addr,
            proto: k.proto,
            pad: [0; 3],
        })
    }
}

/// An inclusive port range in host byte order (`struct port_range`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PortRange {
    first: u16,
    last: u16,
}

// SAFETY: `repr(C)`, `Copy`, two `u16`s (4 bytes, no padding); every bit
// pattern is a valid value.
unsafe impl aya::Pod for PortRange {}

impl PortRange {
    fn new(ports: RangeInclusive<u16>) -> Result<Self, SteerError> {
        let (first, last) = (*ports.start(), *ports.end());
        if first == 0 || first > last {
            return Err(SteerError::PortRange { first, last });
        }
        Ok(Self { first, last })
    }
}

/// The program's packet counters, summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SteerStats {
    /// Not steered: handed to the kernel (`XDP_PASS`).
    pub passed: u64,
    /// Redirected to an AF_XDP socket (any of the three kinds of match).
    pub steered: u64,
    /// Matched but no socket was registered on the receiving queue, so
    /// passed to the kernel.
    pub no_socket: u64,
    /// Matched a nat backend's source ([`Steering::add_backend`]); included
    /// in `steered` or `no_socket`.
    pub backend_matches: u64,
    /// Matched a local address's port range ([`Steering::add_local`]);
    /// included in `steered` or `no_socket`.
    pub local_matches: u64,
    /// ICMP or ICMPv6 errors quoting a packet weir sent (from a virtual or a
    /// local address in its range, or to a nat backend); included in
    /// `steered` or `no_socket`.
    pub icmp_matches: u64,
}

/// The steering program attached to one interface; detached on drop.
#[derive(Debug)]
pub struct Steering {
    ebpf: Ebpf,
    link: Option<XdpLinkId>,
    interface: String,
    mode: AttachMode,
}

impl Steering {
    /// Loads the program and attaches it to `interface` (in the calling thread's
    /// network namespace): native mode if the driver supports it, generic mode
    /// otherwise ([`Steering::mode`] says which).
    pub fn attach(interface: &str) -> Result<Self, SteerError> {
        Self::attach_with(interface, None)
    }

    /// As [`Steering::attach`], but only in `mode` when it is given (no
    /// fallback): for tests of either path and for an operator's choice.
    pub fn attach_with(interface: &str, mode: Option<AttachMode>) -> Result<Self, SteerError> {
        if !PROGRAM_BUILT {
            return Err(SteerError::NotBuilt);
        }
        let mut ebpf = Ebpf::load(PROGRAM).map_err(|e| SteerError::Load(Box::new(e)))?;
        let program_err = |source| SteerError::Program {
            interface: interface.to_owned(),
            source: Box::new(source),
        };
        let prog: &mut Xdp = ebpf
            .program_mut(PROGRAM_NAME)
            .ok_or(SteerError::Missing(PROGRAM_NAME))?
            .try_into()
            .map_err(program_err)?;
        prog.load().map_err(program_err)?;
        let (link, mode) = match mode {
            Some(AttachMode::Native) => (
                prog.attach(interface, XdpFlags::DRV_MODE)
                    .map_err(program_err)?,
                AttachMode::Native,
            ),
            Some(AttachMode::Generic) => (
                prog.attach(interface, XdpFlags::SKB_MODE)
                    .map_err(program_err)?,
                AttachMode::Generic,
            ),
            None => Self::attach_auto(prog, interface)?,
        };
        Ok(Self {
            ebpf,
            link: Some(link),
            interface: interface.to_owned(),
            mode,
        })
    }

    /// Native mode, else generic mode.
    fn attach_auto(prog: &mut Xdp, interface: &str) -> Result<(XdpLinkId, AttachMode), SteerError> {
        Ok(match prog.attach(interface, XdpFlags::DRV_MODE) {
            Ok(link) => (link, AttachMode::Native),
            Err(native) => match prog.attach(interface, XdpFlags::SKB_MODE) {
                Ok(link) => (link, AttachMode::Generic),
                Err(generic) => {
                    return Err(SteerError::Attach {
                        interface: interface.to_owned(),
                        native: Box::new(native),
                        generic: Box::new(generic),
                    });
                }
            },
        })
    }

    /// How the program is attached.
    pub fn mode(&self) -> AttachMode {
        self.mode
    }

    /// The interface it is attached to.
    pub fn interface(&self) -> &str {
        &self.interface
    }

    fn hash_map<K: aya::Pod, V: aya::Pod>(
        &mut self,
        name: &'static str,
    ) -> Result<HashMap<&mut MapData, K, V>, SteerError> {
        let map = self.ebpf.map_mut(name).ok_or(SteerError::Missing(name))?;
        HashMap::try_from(map).map_err(|source| SteerError::Map {
            name,
            source: Box::new(source),
        })
    }

    fn insert<K: aya::Pod, V: aya::Pod>(
        &mut self,
        name: &'static str,
        key: K,
        value: V,
    ) -> Result<(), SteerError> {
        self.hash_map::<K, V>(name)?
            .insert(key, value, 0)
            .map_err(|source| SteerError::Map {
                name,
                source: Box::new(source),
            })
    }

    /// Removes `key` from map `name`; an absent key is not an error.
    fn delete<K: aya::Pod, V: aya::Pod>(
        &mut self,
        name: &'static str,
        key: &K,
    ) -> Result<(), SteerError> {
        match self.hash_map::<K, V>(name)?.remove(key) {
            Ok(()) => Ok(()),
            // ENOENT: already absent.
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(())
            }
            Err(source) => Err(SteerError::Map {
                name,
                source: Box::new(source),
            }),
        }
    }

    fn entries<K: aya::Pod, V: aya::Pod>(
        &mut self,
        name: &'static str,
    ) -> Result<Vec<(K, V)>, SteerError> {
        self.hash_map::<K, V>(name)?
            .iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| SteerError::Map {
                name,
                source: Box::new(source),
            })
    }

    /// Steers packets whose destination matches `key` (a service's virtual
    /// address) to the AF_XDP sockets.
    pub fn add(&mut self, key: SteerKey) -> Result<(), SteerError> {
        self.insert("steer", key, 1u32)
    }

    /// Stops steering `key`; packets matching it go to the kernel again.
    /// Removing a key that is not there is not an error.
    pub fn remove(&mut self, key: &SteerKey) -> Result<(), SteerError> {
        self.delete::<SteerKey, u32>("steer", key)
    }

    /// The keys currently steered by destination ([`Steering::add`]).
    pub fn keys(&mut self) -> Result<Vec<SteerKey>, SteerError> {
        Ok(self
            .entries::<SteerKey, u32>("steer")?
            .into_iter()
            .map(|(k, _)| k)
            .collect())
    }

    /// Steers packets whose *source* matches `key` — a nat backend's address,
    /// protocol and port, e.g. `SteerKey::tcp(backend)` — to the AF_XDP
    /// sockets: its replies, which weir rewrites back to the virtual address.
    /// Add one per (backend, protocol) of every nat service; the same backend
    /// in two services needs one key.
    pub fn add_backend(&mut self, key: SteerKey) -> Result<(), SteerError> {
        self.insert("backends", key, 1u32)
    }

    /// Stops steering replies from `key`; an absent key is not an error.
    pub fn remove_backend(&mut self, key: &SteerKey) -> Result<(), SteerError> {
        self.delete::<SteerKey, u32>("backends", key)
    }

    /// The nat backends whose replies are steered ([`Steering::add_backend`]).
    pub fn backends(&mut self) -> Result<Vec<SteerKey>, SteerError> {
        Ok(self
            .entries::<SteerKey, u32>("backends")?
            .into_iter()
            .map(|(k, _)| k)
            .collect())
    }

    /// Marks `addr` as an address of this host: a reply from a nat backend
    /// to it (the kernel's own connection, e.g. a health check) and an ICMP
    /// error about a packet it sent to a backend are left to the kernel.
    /// Add every address of the interfaces weir attaches to.
    pub fn add_host(&mut self, addr: IpAddr) -> Result<(), SteerError> {
        let mut key = LocalKey::new(addr, IPPROTO_TCP)?;
        key.proto = 0;
        self.insert("host", key, 1u32)
    }

    /// Forgets a host address ([`Steering::add_host`]); absent is not an error.
    pub fn remove_host(&mut self, addr: IpAddr) -> Result<(), SteerError> {
        let mut key = LocalKey::new(addr, IPPROTO_TCP)?;
        key.proto = 0;
        self.delete::<LocalKey, u32>("host", &key)
    }

    /// The host addresses registered ([`Steering::add_host`]).
    pub fn hosts(&mut self) -> Result<Vec<IpAddr>, SteerError> {
        Ok(self
            .entries::<LocalKey, u32>("host")?
            .into_iter()
            .map(|(k, _)| {
                let v6 = std::net::Ipv6Addr::from(k.addr);
                v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
            })
            .collect())
    }

    /// Steers `protocol` packets to the local (fnat source) address `addr`
    /// whose destination port lies in `ports` to the AF_XDP sockets: the
    /// backends' replies to weir's fnat mappings. Packets to `addr` on other
    /// ports — the kernel's own connections, SSH, the admin API — pass to the
    /// kernel, so keep `ports` out of the kernel's ephemeral range
    /// (`net.ipv4.ip_local_reserved_ports`). Replaces the range an earlier
    /// call set for the same address and protocol.
    pub fn add_local(
        &mut self,
        addr: IpAddr,
        protocol: u8,
        ports: RangeInclusive<u16>,
    ) -> Result<(), SteerError> {
        let range = PortRange::new(ports)?;
        let key = LocalKey::new(addr, protocol)?;
        self.insert("local_ports", key, range)
    }

    /// Stops steering to the local address `addr` for `protocol`; an absent
    /// entry is not an error.
    pub fn remove_local(&mut self, addr: IpAddr, protocol: u8) -> Result<(), SteerError> {
        let key = LocalKey::new(addr, protocol)?;
        self.delete::<LocalKey, PortRange>("local_ports", &key)
    }

    /// The local addresses steered ([`Steering::add_local`]): address,
    /// protocol and port range (IPv4 addresses as IPv4, not mapped).
    pub fn locals(&mut self) -> Result<Vec<(IpAddr, u8, RangeInclusive<u16>)>, SteerError> {
        Ok(self
            .entries::<LocalKey, PortRange>("local_ports")?
            .into_iter()
            .map(|(k, r)| {
                let v6 = std::net::Ipv6Addr::from(k.addr);
                let ip = v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4);
                (ip, k.proto, r.first..=r.last)
            })
            .collect())
    }

    /// Removes every key of the three kinds: all traffic goes to the kernel
    /// again.
    pub fn clear(&mut self) -> Result<(), SteerError> {
        for key in self.keys()? {
            self.remove(&key)?;
        }
        for key in self.backends()? {
            self.remove_backend(&key)?;
        }
        for (addr, proto, _) in self.locals()? {
            self.remove_local(addr, proto)?;
        }
        for addr in self.hosts()? {
            self.remove_host(addr)?;
        }
        Ok(())
    }

    /// Registers the AF_XDP socket `socket` for the interface queue `queue`.
    pub fn register_socket(&mut self, queue: u32, socket: &impl AsRawFd) -> Result<(), SteerError> {
        let map_err = |source| SteerError::Map {
            name: "xsks",
            source: Box::new(source),
        };
        let map = self
            .ebpf
            .map_mut("xsks")
            .ok_or(SteerError::Missing("xsks"))?;
        let mut xsks = XskMap::try_from(map).map_err(map_err)?;
        xsks.set(queue, socket.as_raw_fd(), 0).map_err(map_err)
    }

    /// The program's counters, summed over CPUs.
    pub fn stats(&self) -> Result<SteerStats, SteerError> {
        let map_err = |source| SteerError::Map {
            name: "stats",
            source: Box::new(source),
        };
        let map = self.ebpf.map("stats").ok_or(SteerError::Missing("stats"))?;
        let stats: PerCpuArray<&MapData, u64> = PerCpuArray::try_from(map).map_err(map_err)?;
        let sum = |i: u32| -> Result<u64, SteerError> {
            Ok(stats.get(&i, 0).map_err(map_err)?.iter().sum())
        };
        Ok(SteerStats {
            passed: sum(0)?,
            steered: sum(1)?,
            no_socket: sum(2)?,
            backend_matches: sum(3)?,
            local_matches: sum(4)?,
            icmp_matches: sum(5)?,
        })
    }
}

impl Drop for Steering {
    fn drop(&mut self) {
        if let Some(link) = self.link.take()
            && let Some(prog) = self.ebpf.program_mut(PROGRAM_NAME)
            && let Ok(prog) = <&mut Xdp>::try_from(prog)
        {
            // Dropping `ebpf` would detach too (the link is owned by the
            // program); detaching first keeps the order explicit. An error
            // here (interface already gone) leaves nothing attached.
            let _ = prog.detach(link);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_layout_matches_the_c_struct() {
        assert_eq!(std::mem::size_of::<SteerKey>(), 20);
        let k = SteerKey::udp("192.0.2.7:53".parse().unwrap());
        assert_eq!(&k.addr[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        assert_eq!(&k.addr[12..], &[192, 0, 2, 7]);
        assert_eq!((k.proto, k.pad, k.port_be), (17, 0, [0, 53]));
        let k6 = SteerKey::tcp("[2001:db8::1]:443".parse().unwrap());
        assert_eq!(k6.addr[0..2], [0x20, 0x01]);
        assert_eq!((k6.proto, k6.port_be), (6, [1, 0xbb]));
    }

    #[test]
    fn local_key_layout_matches_the_c_struct() {
        assert_eq!(std::mem::size_of::<LocalKey>(), 20);
        assert_eq!(std::mem::size_of::<PortRange>(), 4);
        let k = LocalKey::new("10.0.1.1".parse().unwrap(), 6).unwrap();
        assert_eq!(&k.addr[10..], &[0xff, 0xff, 10, 0, 1, 1]);
        assert_eq!((k.proto, k.pad), (6, [0; 3]));
        assert!(matches!(
            LocalKey::new("10.0.1.1".parse().unwrap(), 1),
            Err(SteerError::Protocol(1))
        ));
    }

    #[test]
    fn local_port_ranges_must_be_non_empty_and_exclude_port_0() {
        assert_eq!(
            PortRange::new(61000..=65535).unwrap(),
            PortRange {
                first: 61000,
                last: 65535
            }
        );
        assert!(PortRange::new(7..=7).is_ok());
        for (a, b) in [(0, 10), (10, 9), (0, 0)] {
            let err = PortRange::new(a..=b).unwrap_err();
            assert!(
                matches!(err, SteerError::PortRange { first, last } if (first, last) == (a, b))
            );
            assert!(err.to_string().contains(&format!("{a}-{b}")));
        }
    }

    #[test]
    fn only_tcp_and_udp_are_steerable() {
        let addr = "192.0.2.7:53".parse().unwrap();
        assert!(matches!(
            SteerKey::new(addr, 1),
            Err(SteerError::Protocol(1))
        ));
        assert!(SteerKey::new(addr, 6).is_ok());
    }

    #[test]
    fn the_embedded_program_is_a_bpf_elf() {
        if !PROGRAM_BUILT {
            eprintln!("skipping: built without the XDP program (no clang at build time)");
            assert!(PROGRAM.is_empty());
            assert!(matches!(Steering::attach("lo"), Err(SteerError::NotBuilt)));
            return;
        }
        assert_eq!(&PROGRAM[..4], b"\x7fELF");
        // e_machine 247 = EM_BPF (little-endian u16 at offset 18).
        assert_eq!(u16::from_le_bytes([PROGRAM[18], PROGRAM[19]]), 247);
    }
}

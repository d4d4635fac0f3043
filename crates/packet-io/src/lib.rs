//! Packet I/O for weir's packet mode: the one place for packet-mode `unsafe`.
//!
//! The parts the data path uses together:
//!
//! * [`steer`] — the XDP program (`bpf/steer.bpf.c`, built by `build.rs` with clang)
//!   and its loader. The program looks up each packet's (destination address,
//!   protocol, destination port) in a BPF hash map that userspace fills with the
//!   services' virtual addresses ([`Steering::add`]), and two more for replies:
//!   nat backends by source ([`Steering::add_backend`]) and fnat local
//!   addresses by destination port range ([`Steering::add_local`]). A hit is
//!   redirected to the AF_XDP socket of the receiving queue, everything else is
//!   `XDP_PASS`, so SSH, the admin API and unrelated traffic on the same
//!   interface reach the kernel.
//! * [`xsk`] — AF_XDP sockets (one per interface queue), each with its own UMEM
//!   and fill/completion/rx/tx rings, driven in batches: receive a batch, hand it
//!   whole to a callback ([`XskSocket::run_batch_all`], a [`Batch`] of frames
//!   and [`Verdict`]s) or frame by frame ([`XskSocket::run_batch`]), which
//!   rewrites in place, then transmit the batch.
//! * [`afpacket`] — the fallback where XDP cannot attach: AF_PACKET sockets
//!   with a TPACKET_V3 receive ring, `sendmmsg` transmission and
//!   `PACKET_FANOUT` across workers, driven with the same [`Batch`] callback.
//! * [`nexthop`] — where a rewritten frame goes: the egress interface, its MAC
//!   and the next hop's MAC from the kernel's routing and neighbour tables
//!   (rtnetlink), behind a cache with explicit lifetimes and invalidation.
//!
//! The packet core that decides what to rewrite is `weir-packet`; nothing here
//! parses beyond what steering needs.
//!
//! Requirements at run time: root (or `CAP_NET_ADMIN`, `CAP_BPF`, `CAP_NET_RAW`),
//! a kernel with `CONFIG_XDP_SOCKETS` (5.4 or later for need-wakeup).

#[allow(unsafe_code)]
pub mod afpacket;
pub mod nexthop;
#[allow(unsafe_code)]
pub mod steer;
#[allow(unsafe_code)]
pub mod xsk;

pub use afpacket::{PacketConfig, PacketError, PacketSocket};
pub use nexthop::{
    CacheConfig, Neighbour, Netlink, NextHopCache, NoRoute, Resolution, ResolveError, Resolver,
    Route,
};
pub use steer::{AttachMode, PROGRAM_BUILT, SteerError, SteerKey, SteerStats, Steering};
pub use xsk::{
    Batch, BatchStats, KernelDrops, Verdict, XskConfig, XskError, XskSocket, poll_readable,
    rx_queue_count,
};

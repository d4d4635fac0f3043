//! # weir-packet — the I/O-free packet core of weir's packet mode
//!
//! Every packet weir forwards in packet mode (IPVS-style `nat`, `fnat` and
//! `dr`, issue 12) goes through this crate between the ring it came from
//! and the ring it leaves by. The crate does no I/O, reads no clock and no
//! RNG, and has no `unsafe`: bytes in, a decision and rewritten bytes out.
//!
//! | module        | job                                                                |
//! |---------------|--------------------------------------------------------------------|
//! | [`parse`](mod@parse)     | zero-copy parse of Ethernet (+1 VLAN tag), IPv4, IPv6, TCP, UDP, ICMP, ICMPv6; typed [`Unhandled`] reasons |
//! | [`checksum`]  | RFC 1071 sums, RFC 1624 incremental updates, full and partial ([`CsumMode`]) |
//! | [`rewrite`](mod@rewrite)   | in-place `dr` / `nat` / `fnat` rewrites, TTL, MACs                  |
//! | [`icmp`]      | ICMP / ICMPv6 errors about a flow: find it, translate both headers  |
//! | [`tcp_state`] | IPVS's TCP state table as a pure function                           |
//! | [`alloc`]     | fnat source ports per (local address, backend)                     |
//!
//! ## A packet's way through
//!
//! 1. [`parse::parse`] the frame. An `Err(Unhandled)` is counted by the
//!    caller (`Unhandled::index`) and the frame passed to the kernel or
//!    dropped — fragments and IP options are never forwarded (see
//!    [`parse`](mod@parse) for the policy and why).
//! 2. For TCP/UDP, look the flow up by [`Packet::tuple`]; for an ICMP
//!    error, [`icmp::parse_error`] and look up [`icmp::Embedded::flow_key`].
//!    Which key matched (client side or backend side) gives the
//!    [`Direction`].
//! 3. For TCP, [`tcp_state::next`] gives the flow's new state (and so its
//!    timeout).
//! 4. [`rewrite::rewrite`] (or [`icmp::rewrite_error`]) rewrites the frame
//!    in place with the flow's [`NatMapping`] and the next hop's MACs, then
//!    the caller transmits it.
//!
//! ## Contracts
//!
//! * **No panics on input.** `parse` accepts any byte slice; a [`Packet`] it
//!   returns keeps every offset within the slice, and the rewrite functions
//!   check the buffer against it before writing. Property tests feed random
//!   bytes.
//! * **Checksums stay exact.** Every rewrite updates the IPv4 header
//!   checksum, the L4 checksum and (for ICMP errors) the ICMP checksum and
//!   the quoted headers' checksums incrementally; property tests recompute
//!   each from scratch after every rewrite and compare bit for bit.
//! * **Rewrites are all-or-nothing.** A rewrite that returns an error has not
//!   changed the frame.
//! * **Partial checksums.** The caller says per packet whether the L4
//!   checksum is finished or `CHECKSUM_PARTIAL` ([`CsumMode`]); see
//!   [`checksum`] for when to use which.
//!
//! ## Example
//!
//! ```
//! use weir_packet::{checksum, parse, rewrite, CsumMode, Direction, Method, NatMapping, NextHop};
//!
//! // A UDP datagram 192.0.2.7:40000 -> VIP 10.0.0.100:53, payload "hi".
//! let mut f = vec![0u8; 14 + 20 + 8 + 2];
//! f[12..14].copy_from_slice(&[0x08, 0x00]);
//! f[14..34].copy_from_slice(&[
//!     0x45, 0, 0, 30, 0, 0, 0x40, 0, 64, 17, 0, 0, 192, 0, 2, 7, 10, 0, 0, 100,
//! ]);
//! let c = checksum::ipv4_header_checksum(&f[14..34]);
//! f[24..26].copy_from_slice(&c.to_be_bytes());
//! f[34..44].copy_from_slice(&[0x9c, 0x40, 0, 53, 0, 10, 0, 0, b'h', b'i']);
//! let c = checksum::l4_checksum(&f[26..30], &f[30..34], 17, &f[34..44], 6);
//! f[40..42].copy_from_slice(&c.to_be_bytes());
//!
//! let pkt = parse(&f).expect("a UDP packet");
//! let mapping = NatMapping {
//!     client: "192.0.2.7:40000".parse().unwrap(),
//!     vip: "10.0.0.100:53".parse().unwrap(),
//!     backend: "10.0.1.2:5353".parse().unwrap(),
//!     local: Some("10.0.1.1:61000".parse().unwrap()),
//! };
//! let hop = NextHop { src_mac: [2, 0, 0, 0, 0, 1], dst_mac: [2, 0, 0, 0, 0, 2] };
//! rewrite(&mut f, &pkt, Method::Fnat, Direction::ToBackend, &mapping, &hop, CsumMode::Full)
//!     .expect("rewritten");
//!
//! let out = parse(&f).expect("still valid");
//! let t = out.tuple().unwrap();
//! assert_eq!(t.src, mapping.local.unwrap());
//! assert_eq!(t.dst, mapping.backend);
//! assert_eq!(out.ttl, 63);
//! // The incrementally updated UDP checksum equals a fresh one.
//! let fresh = checksum::l4_checksum(&f[26..30], &f[30..34], 17, &f[34..44], 6);
//! assert_eq!(f[40..42], fresh.to_be_bytes());
//! ```
#![forbid(unsafe_code)]

use std::net::SocketAddr;

pub mod alloc;
pub mod checksum;
pub mod icmp;
pub mod parse;
pub mod rewrite;
pub mod tcp_state;

#[cfg(test)]
mod testutil;

pub use alloc::{FnatPorts, PortAllocator, PortError};
pub use checksum::CsumMode;
pub use icmp::{Embedded, EmbeddedError, ErrorKind, TooBig};
pub use parse::{IpVersion, Packet, TcpFlags, Transport, Unhandled, parse};
pub use rewrite::{
    Direction, Mac, Method, NatMapping, NextHop, RewriteError, Translation, rewrite,
};
pub use tcp_state::{TcpDir, TcpState};

/// A transport tuple: protocol number, source and destination endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlowTuple {
    /// IP protocol number (6 TCP, 17 UDP).
    pub proto: u8,
    /// Source address and port.
    pub src: SocketAddr,
    /// Destination address and port.
    pub dst: SocketAddr,
}

impl Packet {
    /// The TCP flags, for [`tcp_state::next`]; `None` for other protocols.
    pub fn tcp_flags(&self) -> Option<TcpFlags> {
        match self.transport {
            Transport::Tcp { flags, .. } => Some(flags),
            _ => None,
        }
    }

    /// A TCP segment's sequence number and the sequence number just past
    /// it (`seq + SEG.LEN`, wrapping); `None` for anything else.
    pub fn tcp_seq(&self) -> Option<(u32, u32)> {
        match self.transport {
            Transport::Tcp { seq, seq_len, .. } => Some((seq, seq.wrapping_add(seq_len))),
            _ => None,
        }
    }

    /// The TCP/UDP tuple of the packet; `None` for ICMP.
    pub fn tuple(&self) -> Option<FlowTuple> {
        let (sp, dp) = self.transport.ports()?;
        Some(FlowTuple {
            proto: self.transport.proto(),
            src: SocketAddr::new(self.src, sp),
            dst: SocketAddr::new(self.dst, dp),
        })
    }
}

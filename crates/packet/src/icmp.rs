//! ICMP and ICMPv6 errors about a tracked flow.
//!
//! A router on the path (or a backend) reports a problem with a packet weir
//! forwarded by quoting that packet's headers in an ICMP error. For the
//! error to reach the endpoint that sent the original packet, and to make
//! sense there, the error must be translated like the flow's data packets:
//! the outer header as a packet travelling the same way, the quoted packet
//! as one travelling the *other* way (it is a copy of a packet that went
//! out through weir from the other side). Path-MTU discovery depends on it:
//! "fragmentation needed" / "packet too big" must arrive at the sender with
//! a quote its socket recognises.
//!
//! [`parse_error`] finds the quoted packet and returns its [`Embedded`]
//! tuple; [`Embedded::flow_key`] is the tuple a data packet *arriving on the
//! same side* would carry, so the caller finds the flow with the same lookup
//! (and learns the [`crate::Direction`] from which key matched).
//! [`translate_error`] then applies the flow's [`Translation`] for that
//! direction:
//!
//! * outer source address ← `t.src`, outer destination address ← `t.dst`
//!   (addresses only; the outer header of an ICMP error has no ports);
//! * quoted source ← `t.dst`, quoted destination ← `t.src` (address and
//!   port), with the quoted IPv4 header checksum and the quoted TCP/UDP
//!   checksum updated when the quote includes it;
//! * the ICMP checksum updated for every changed byte of the message, and
//!   for ICMPv6 also for the outer addresses (its pseudo header).
//!
//! For nat this is what IPVS does (`ip_vs_nat_icmp`: an error from the
//! backend side leaves with the VIP as its source); dr errors need no
//! translation (an empty `Translation`). ICMP errors are built by kernels in
//! software, so their checksums are always [`CsumMode::Full`].

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::FlowTuple;
use crate::checksum::{self, CsumMode};
use crate::parse::{IPPROTO_TCP, IPPROTO_UDP, IpVersion, Packet, Transport, be16};
use crate::rewrite::{
    Direction, Method, NatMapping, NextHop, RewriteError, Translation, decrement_ttl, ip_bytes,
    l4_csum_offset, set_macs,
};

/// What the error reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// ICMP destination unreachable (type 3) other than code 4, or ICMPv6
    /// destination unreachable (type 1), with its code (port unreachable is
    /// code 3 in ICMP, code 4 in ICMPv6).
    DestUnreachable {
        /// The code.
        code: u8,
    },
    /// ICMP fragmentation needed (type 3 code 4) or ICMPv6 packet too big
    /// (type 2), with the next hop's MTU.
    PacketTooBig {
        /// Next-hop MTU.
        mtu: u32,
    },
    /// Time exceeded (ICMP 11, ICMPv6 3), with its code.
    TimeExceeded {
        /// The code.
        code: u8,
    },
}

/// The quoted packet of an ICMP error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Embedded {
    /// What the error reports.
    pub kind: ErrorKind,
    /// Offset of the quoted IP header.
    pub l3: usize,
    /// Offset of the quoted transport header.
    pub l4: usize,
    /// The quoted packet's tuple, as quoted (the packet weir sent out).
    pub tuple: FlowTuple,
}

impl Embedded {
    /// The tuple of a data packet arriving on the same side as the error:
    /// the quoted tuple reversed. Look the flow up with it as with a data
    /// packet's [`crate::Packet::tuple`].
    pub fn flow_key(&self) -> FlowTuple {
        FlowTuple {
            proto: self.tuple.proto,
            src: self.tuple.dst,
            dst: self.tuple.src,
        }
    }
}

/// Why an ICMP error is not translated. Each variant is one counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum EmbeddedError {
    /// The quote is shorter than an IP header and 8 bytes of transport.
    #[error("quoted packet truncated")]
    Truncated,
    /// The quoted packet's IP version differs from the outer one, or its
    /// IHL is below 5.
    #[error("quoted IP header malformed or of the other family")]
    BadHeader,
    /// The quoted packet is not TCP or UDP (or has IPv6 extension headers).
    #[error("quoted packet is not TCP or UDP (protocol {0})")]
    NotTcpUdp(u8),
    /// The quoted packet is a non-first fragment (no ports).
    #[error("quoted packet is a non-first fragment")]
    Fragment,
}

/// Finds the quoted packet of an ICMP / ICMPv6 error. Returns `Ok(None)` for
/// ICMP messages that are not errors this module translates (echo, redirect,
/// parameter problem, neighbour discovery, ...). Never panics.
pub fn parse_error(frame: &[u8], pkt: &Packet) -> Result<Option<Embedded>, EmbeddedError> {
    let (kind, v6) = match pkt.transport {
        Transport::Icmp { icmp_type, code } => match (icmp_type, code) {
            (3, 4) => {
                let mtu = be16(frame, pkt.l4 + 6).ok_or(EmbeddedError::Truncated)?;
                (ErrorKind::PacketTooBig { mtu: mtu.into() }, false)
            }
            (3, code) => (ErrorKind::DestUnreachable { code }, false),
            (11, code) => (ErrorKind::TimeExceeded { code }, false),
            _ => return Ok(None),
        },
        Transport::Icmpv6 { icmp_type, code } => match icmp_type {
            1 => (ErrorKind::DestUnreachable { code }, true),
            2 => {
                let hi = be16(frame, pkt.l4 + 4).ok_or(EmbeddedError::Truncated)?;
                let lo = be16(frame, pkt.l4 + 6).ok_or(EmbeddedError::Truncated)?;
                let mtu = (u32::from(hi) << 16) | u32::from(lo);
                (ErrorKind::PacketTooBig { mtu }, true)
            }
            3 => (ErrorKind::TimeExceeded { code }, true),
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    let end = pkt.end.min(frame.len());
    let b = &frame[..end];
    let l3 = pkt.l4 + 8;
    let first = *b.get(l3).ok_or(EmbeddedError::Truncated)?;
    let (l4, proto, src, dst) = if !v6 {
        if first >> 4 != 4 || pkt.version != IpVersion::V4 {
            return Err(EmbeddedError::BadHeader);
        }
        let ihl = usize::from(first & 0x0f) * 4;
        if ihl < 20 {
            return Err(EmbeddedError::BadHeader);
        }
        let h = b.get(l3..l3 + ihl).ok_or(EmbeddedError::Truncated)?;
        if u16::from_be_bytes([h[6], h[7]]) & 0x1fff != 0 {
            return Err(EmbeddedError::Fragment);
        }
        let src = IpAddr::V4(Ipv4Addr::new(h[12], h[13], h[14], h[15]));
        let dst = IpAddr::V4(Ipv4Addr::new(h[16], h[17], h[18], h[19]));
        (l3 + ihl, h[9], src, dst)
    } else {
        if first >> 4 != 6 || pkt.version != IpVersion::V6 {
            return Err(EmbeddedError::BadHeader);
        }
        let h = b.get(l3..l3 + 40).ok_or(EmbeddedError::Truncated)?;
        let mut s = [0u8; 16];
        s.copy_from_slice(&h[8..24]);
        let mut d = [0u8; 16];
        d.copy_from_slice(&h[24..40]);
        let src = IpAddr::V6(Ipv6Addr::from(s));
        let dst = IpAddr::V6(Ipv6Addr::from(d));
        (l3 + 40, h[6], src, dst)
    };
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return Err(EmbeddedError::NotTcpUdp(proto));
    }
    if b.len() < l4 + 8 {
        return Err(EmbeddedError::Truncated);
    }
    let sport = u16::from_be_bytes([b[l4], b[l4 + 1]]);
    let dport = u16::from_be_bytes([b[l4 + 2], b[l4 + 3]]);
    Ok(Some(Embedded {
        kind,
        l3,
        l4,
        tuple: FlowTuple {
            proto,
            src: SocketAddr::new(src, sport),
            dst: SocketAddr::new(dst, dport),
        },
    }))
}

/// Translates an ICMP error about a flow in place (see the module docs):
/// outer addresses from `t`, quoted endpoints from `t` mirrored, with every
/// checksum updated incrementally. `t` is the translation of the flow's
/// data packets travelling the same way as the error.
pub fn translate_error(
    frame: &mut [u8],
    pkt: &Packet,
    emb: &Embedded,
    t: &Translation,
) -> Result<(), RewriteError> {
    let v4 = pkt.version == IpVersion::V4;
    let hdr = if v4 { 20 } else { 40 };
    if frame.len() < pkt.end
        || emb.l4 + 8 > pkt.end
        || emb.l3 < pkt.l4 + 8
        || emb.l4 < emb.l3 + hdr
        || pkt.l4 < pkt.l3 + hdr
    {
        return Err(RewriteError::Truncated);
    }
    for a in [t.src, t.dst].into_iter().flatten() {
        if a.is_ipv4() != v4 {
            return Err(RewriteError::FamilyMismatch);
        }
    }
    let (alen, src_off, dst_off) = if v4 { (4, 12, 16) } else { (16, 8, 24) };
    let icmp_at = pkt.l4 + 2;
    let end = pkt.end;
    let mut icmp = Csum::read(frame, icmp_at);

    // The quoted packet: source ← t.dst, destination ← t.src.
    let proto = emb.tuple.proto;
    let inner_csum_at = emb.l4 + l4_csum_offset(proto);
    let has_inner_l4 = inner_csum_at + 2 <= end && {
        let c = u16::from_be_bytes([frame[inner_csum_at], frame[inner_csum_at + 1]]);
        !(proto == IPPROTO_UDP && v4 && c == 0)
    };
    for (new, addr_off, port_at) in [(t.dst, src_off, emb.l4), (t.src, dst_off, emb.l4 + 2)] {
        let Some(new) = new else { continue };
        let addr_at = emb.l3 + addr_off;
        let ip = ip_bytes(new.ip());
        let old_sum = checksum::addr_sum(&frame[addr_at..addr_at + alen]);
        let new_sum = checksum::addr_sum(&ip[..alen]);
        let old_port = u16::from_be_bytes([frame[port_at], frame[port_at + 1]]);
        if v4 {
            let ipc = Csum::read(frame, emb.l3 + 10);
            let c = checksum::update(ipc.value, old_sum, new_sum, CsumMode::Full);
            icmp.write_word(frame, emb.l3 + 10, c);
        }
        if has_inner_l4 {
            let l4c = Csum::read(frame, inner_csum_at);
            let mut c = checksum::update(l4c.value, old_sum, new_sum, CsumMode::Full);
            c = checksum::update16(c, old_port, new.port(), CsumMode::Full);
            if proto == IPPROTO_UDP && c == 0 {
                c = 0xffff;
            }
            icmp.write_word(frame, inner_csum_at, c);
        }
        icmp.write_bytes(frame, addr_at, &ip[..alen]);
        icmp.write_word(frame, port_at, new.port());
    }

    // The outer header: addresses only.
    let mut ip_csum = if v4 {
        Some(Csum::read(frame, pkt.l3 + 10))
    } else {
        None
    };
    for (new, off) in [(t.src, src_off), (t.dst, dst_off)] {
        let Some(new) = new else { continue };
        let at = pkt.l3 + off;
        let ip = ip_bytes(new.ip());
        let old_sum = checksum::addr_sum(&frame[at..at + alen]);
        let new_sum = checksum::addr_sum(&ip[..alen]);
        if let Some(c) = ip_csum.as_mut() {
            c.value = checksum::update(c.value, old_sum, new_sum, CsumMode::Full);
        } else {
            // ICMPv6's checksum covers the pseudo header.
            icmp.value = checksum::update(icmp.value, old_sum, new_sum, CsumMode::Full);
        }
        frame[at..at + alen].copy_from_slice(&ip[..alen]);
    }
    if let Some(c) = ip_csum {
        c.store(frame);
    }
    icmp.store(frame);
    Ok(())
}

/// Translates an ICMP error travelling `direction` for a flow forwarded with
/// `method` ([`NatMapping::translation`]), decrements the TTL and writes
/// the next hop's MACs. On an error the frame is unchanged.
pub fn rewrite_error(
    frame: &mut [u8],
    pkt: &Packet,
    emb: &Embedded,
    method: Method,
    direction: Direction,
    mapping: &NatMapping,
    next_hop: &NextHop,
) -> Result<(), RewriteError> {
    let t = mapping.translation(method, direction)?;
    if pkt.ttl <= 1 {
        return Err(RewriteError::TtlExpired);
    }
    translate_error(frame, pkt, emb, &t)?;
    decrement_ttl(frame, pkt)?;
    set_macs(frame, next_hop)
}

/// A checksum field being updated: every write inside the region it covers
/// goes through it.
#[derive(Debug, Clone, Copy)]
struct Csum {
    at: usize,
    value: u16,
}

impl Csum {
    fn read(frame: &[u8], at: usize) -> Csum {
        Csum {
            at,
            value: u16::from_be_bytes([frame[at], frame[at + 1]]),
        }
    }

    /// Writes `new` at an even offset of the covered region, folding the
    /// change into this checksum.
    fn write_bytes(&mut self, frame: &mut [u8], at: usize, new: &[u8]) {
        let old = checksum::fold(checksum::sum(&frame[at..at + new.len()], 0));
        let new_sum = checksum::fold(checksum::sum(new, 0));
        self.value = checksum::update(self.value, old, new_sum, CsumMode::Full);
        frame[at..at + new.len()].copy_from_slice(new);
    }

    fn write_word(&mut self, frame: &mut [u8], at: usize, word: u16) {
        self.write_bytes(frame, at, &word.to_be_bytes());
    }

    fn store(self, frame: &mut [u8]) {
        frame[self.at..self.at + 2].copy_from_slice(&self.value.to_be_bytes());
    }
}

/// The most of an ICMP error's IP packet (RFC 1812 4.3.2.3: an IPv4 error
/// should not exceed 576 bytes; RFC 4443 2.4(c): an ICMPv6 error must not
/// exceed the minimum IPv6 MTU).
const ERROR_MAX_V4: usize = 576;
const ERROR_MAX_V6: usize = 1280;

/// What [`too_big`] made of a packet larger than the next hop's MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TooBig {
    /// The frame now holds an ICMP "fragmentation needed" (IPv4, DF set) or
    /// ICMPv6 "packet too big" to the packet's sender, `len` bytes long from
    /// the Ethernet header on; send it back out of the interface the packet
    /// came in on (its MAC addresses are swapped).
    Answer {
        /// The ICMP frame's length: the caller shrinks the frame to it.
        len: usize,
    },
    /// An IPv4 packet without DF: a router would fragment it; weir does not
    /// fragment, so it is dropped (and nothing is sent).
    NoDf,
}

/// Turn `frame` (a TCP/UDP packet `pkt` too big for the next hop's `mtu`,
/// not yet rewritten) into the ICMP error a router sends about it: from
/// `src` (the router's address on the way back) to the packet's source,
/// quoting as much of the packet as the limits allow. The quote is the
/// packet as its sender sent it, so the sender's stack recognises it and
/// lowers its path MTU. The frame shrinks (the answer is at most 576 /
/// 1280 bytes of IP), never grows: everything is built inside it.
pub fn too_big(
    frame: &mut [u8],
    pkt: &Packet,
    mtu: u32,
    src: IpAddr,
) -> Result<TooBig, RewriteError> {
    let (l3, end) = (pkt.l3, pkt.end);
    if frame.len() < end || l3 < 12 {
        return Err(RewriteError::Truncated);
    }
    let orig_len = end - l3;
    let (hdr, max) = match pkt.version {
        IpVersion::V4 => (28, ERROR_MAX_V4),
        IpVersion::V6 => (48, ERROR_MAX_V6),
    };
    // Too big for an `mtu` of at least 68 (IPv4's minimum), so the frame
    // holds the headers: the quote is what fits after them, within both.
    let quote = orig_len.saturating_sub(hdr).min(max - hdr);
    if quote < 8 {
        return Err(RewriteError::Truncated);
    }
    let (s4, s6) = match (pkt.version, src) {
        (IpVersion::V4, IpAddr::V4(a)) => (Some(a), None),
        (IpVersion::V6, IpAddr::V6(a)) => (None, Some(a)),
        _ => return Err(RewriteError::FamilyMismatch),
    };
    if let Some(s) = s4 {
        let df = frame[l3 + 6] & 0x40 != 0;
        if !df {
            return Ok(TooBig::NoDf);
        }
        let IpAddr::V4(dst) = pkt.src else {
            return Err(RewriteError::FamilyMismatch);
        };
        // Overlapping move: the quote starts where the packet did.
        frame.copy_within(l3..l3 + quote, l3 + hdr);
        let total = (hdr + quote) as u16;
        let ip = &mut frame[l3..l3 + 20];
        ip.copy_from_slice(&[
            0x45, 0xc0, 0, 0, 0, 0, 0, 0, 64, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ]);
        ip[2..4].copy_from_slice(&total.to_be_bytes());
        ip[12..16].copy_from_slice(&s.octets());
        ip[16..20].copy_from_slice(&dst.octets());
        let c = checksum::ipv4_header_checksum(ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        let icmp = &mut frame[l3 + 20..l3 + hdr + quote];
        let m = u16::try_from(mtu).unwrap_or(u16::MAX);
        icmp[..8].copy_from_slice(&[3, 4, 0, 0, 0, 0, 0, 0]);
        icmp[6..8].copy_from_slice(&m.to_be_bytes());
        let c = checksum::finish(checksum::sum(icmp, 0));
        icmp[2..4].copy_from_slice(&c.to_be_bytes());
    } else if let Some(s) = s6 {
        let IpAddr::V6(dst) = pkt.src else {
            return Err(RewriteError::FamilyMismatch);
        };
        frame.copy_within(l3..l3 + quote, l3 + hdr);
        let payload = (8 + quote) as u16;
        let ip = &mut frame[l3..l3 + 40];
        ip[..8].copy_from_slice(&[0x60, 0, 0, 0, 0, 0, 58, 64]);
        ip[4..6].copy_from_slice(&payload.to_be_bytes());
        ip[8..24].copy_from_slice(&s.octets());
        ip[24..40].copy_from_slice(&dst.octets());
        let icmp = &mut frame[l3 + 40..l3 + hdr + quote];
        icmp[..8].copy_from_slice(&[2, 0, 0, 0, 0, 0, 0, 0]);
        icmp[4..8].copy_from_slice(&mtu.to_be_bytes());
        let c = checksum::l4_checksum(&s.octets(), &dst.octets(), 58, icmp, 2);
        icmp[2..4].copy_from_slice(&c.to_be_bytes());
    }
    // Back to the neighbour it came from.
    let (dst_mac, src_mac) = (
        <[u8; 6]>::try_from(&frame[6..12]).map_err(|_| RewriteError::Truncated)?,
        <[u8; 6]>::try_from(&frame[0..6]).map_err(|_| RewriteError::Truncated)?,
    );
    set_macs(frame, &NextHop { src_mac, dst_mac })?;
    Ok(TooBig::Answer {
        len: l3 + hdr + quote,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::{IPPROTO_TCP, parse};
    use crate::testutil::{HOP, Spec, icmp_error, ip_packet, l4_segment, mapping4, sa, verify};
    use proptest::prelude::*;

    /// An IP packet of `spec` (no Ethernet), as quoted by an ICMP error.
    fn quoted(spec: &Spec) -> Vec<u8> {
        ip_packet(spec.src, spec.dst, spec.proto, spec.ttl, &l4_segment(spec))
    }

    #[test]
    fn frag_needed_from_the_client_side_reaches_the_backend() {
        let m = NatMapping {
            local: None,
            ..mapping4()
        };
        // The reply weir sent to the client, quoted by a router.
        let reply = quoted(&Spec::new(IPPROTO_TCP, m.vip, m.client));
        let router = sa("198.51.100.1:0");
        let mut f = icmp_error(router, m.vip, 3, 4, 1400, &reply);
        let p = parse(&f).expect("valid");
        let emb = parse_error(&f, &p).expect("well formed").expect("an error");
        assert_eq!(emb.kind, ErrorKind::PacketTooBig { mtu: 1400 });
        let key = emb.flow_key();
        assert_eq!(
            (key.proto, key.src, key.dst),
            (IPPROTO_TCP, m.client, m.vip)
        );
        rewrite_error(
            &mut f,
            &p,
            &emb,
            Method::Nat,
            Direction::ToBackend,
            &m,
            &HOP,
        )
        .expect("translated");
        verify(&f, CsumMode::Full).expect("checksums");
        let q = parse(&f).expect("valid");
        assert_eq!((q.src, q.dst, q.ttl), (router.ip(), m.backend.ip(), 63));
        let e = parse_error(&f, &q).expect("ok").expect("error");
        // The quote is now the reply as the backend sent it.
        assert_eq!((e.tuple.src, e.tuple.dst), (m.backend, m.client));
        assert_eq!(e.kind, ErrorKind::PacketTooBig { mtu: 1400 });
    }

    #[test]
    fn port_unreachable_from_an_fnat_backend_reaches_the_client_v6() {
        let m = NatMapping {
            client: sa("[2001:db8:c::7]:40000"),
            vip: sa("[2001:db8::100]:53"),
            backend: sa("[2001:db8:b::2]:5353"),
            local: Some(sa("[2001:db8:b::1]:61000")),
        };
        let local = m.local.expect("fnat");
        let sent = quoted(&Spec::new(crate::parse::IPPROTO_UDP, local, m.backend));
        let mut f = icmp_error(m.backend, local, 1, 4, 0, &sent);
        let p = parse(&f).expect("valid");
        let emb = parse_error(&f, &p).expect("well formed").expect("an error");
        assert_eq!(emb.kind, ErrorKind::DestUnreachable { code: 4 });
        assert_eq!((emb.flow_key().src, emb.flow_key().dst), (m.backend, local));
        rewrite_error(
            &mut f,
            &p,
            &emb,
            Method::Fnat,
            Direction::ToClient,
            &m,
            &HOP,
        )
        .expect("translated");
        verify(&f, CsumMode::Full).expect("checksums");
        let q = parse(&f).expect("valid");
        assert_eq!((q.src, q.dst), (m.vip.ip(), m.client.ip()));
        let e = parse_error(&f, &q).expect("ok").expect("error");
        assert_eq!((e.tuple.src, e.tuple.dst), (m.client, m.vip));
    }

    #[test]
    fn non_errors_and_bad_quotes() {
        let a = sa("10.0.0.1:0");
        let b = sa("10.0.0.2:0");
        // Echo request: not an error.
        let f = icmp_error(a, b, 8, 0, 0, &[]);
        let p = parse(&f).expect("valid");
        assert_eq!(parse_error(&f, &p), Ok(None));
        // A quote cut inside the ports.
        let inner = quoted(&Spec::new(IPPROTO_TCP, sa("1.1.1.1:1"), sa("2.2.2.2:2")));
        let f = icmp_error(a, b, 3, 3, 0, &inner[..24]);
        let p = parse(&f).expect("valid");
        assert_eq!(parse_error(&f, &p), Err(EmbeddedError::Truncated));
        // A quoted IPv6 packet inside ICMPv4.
        let v6 = quoted(&Spec::new(IPPROTO_TCP, sa("[::1]:1"), sa("[::2]:2")));
        let f = icmp_error(a, b, 11, 0, 0, &v6);
        let p = parse(&f).expect("valid");
        assert_eq!(parse_error(&f, &p), Err(EmbeddedError::BadHeader));
        // A quoted ICMP packet.
        let mut icmp_in = inner.clone();
        icmp_in[9] = 1;
        let f = icmp_error(a, b, 3, 1, 0, &icmp_in);
        let p = parse(&f).expect("valid");
        assert_eq!(parse_error(&f, &p), Err(EmbeddedError::NotTcpUdp(1)));
    }

    #[test]
    fn quoted_ipv4_options_are_skipped_by_ihl() {
        let m = NatMapping {
            local: None,
            ..mapping4()
        };
        // The quoted reply carries 4 bytes of options (NOP NOP NOP EOL).
        let plain = quoted(&Spec::new(crate::parse::IPPROTO_UDP, m.vip, m.client));
        let mut inner = plain[..20].to_vec();
        inner[0] = 0x46;
        inner.extend_from_slice(&[1, 1, 1, 0]);
        inner.extend_from_slice(&plain[20..]);
        let total = inner.len() as u16;
        inner[2..4].copy_from_slice(&total.to_be_bytes());
        inner[10..12].copy_from_slice(&[0, 0]);
        let c = crate::checksum::ipv4_header_checksum(&inner[..24]);
        inner[10..12].copy_from_slice(&c.to_be_bytes());
        let mut f = icmp_error(sa("198.51.100.1:0"), m.vip, 3, 3, 0, &inner);
        let p = parse(&f).expect("valid");
        let emb = parse_error(&f, &p).expect("ok").expect("error");
        assert_eq!(emb.l4 - emb.l3, 24);
        assert_eq!((emb.tuple.src, emb.tuple.dst), (m.vip, m.client));
        rewrite_error(
            &mut f,
            &p,
            &emb,
            Method::Nat,
            Direction::ToBackend,
            &m,
            &HOP,
        )
        .expect("translated");
        verify(&f, CsumMode::Full).expect("checksums, quoted ones included");
        let e = parse_error(&f, &parse(&f).expect("valid"))
            .expect("ok")
            .expect("error");
        assert_eq!((e.tuple.src, e.tuple.dst), (m.backend, m.client));
    }

    fn endpoint(v6: bool) -> impl Strategy<Value = SocketAddr> {
        (any::<u32>(), any::<u128>(), any::<u16>()).prop_map(move |(a4, a6, port)| {
            if v6 {
                SocketAddr::new(IpAddr::V6(Ipv6Addr::from(a6)), port)
            } else {
                SocketAddr::new(IpAddr::V4(Ipv4Addr::from(a4)), port)
            }
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// A packet too big for the next hop becomes, inside its own frame,
        /// the ICMP error a router sends: back to its sender's MAC, from the
        /// given address, at most 576 / 1280 bytes of IP, the sender's packet
        /// quoted as sent (the parser finds its tuple and the MTU), every
        /// checksum from scratch; IPv4 without DF is refused instead.
        #[test]
        fn too_big_answers_verify(v6 in any::<bool>(), udp in any::<bool>(), vlan in any::<bool>(),
                                  df in any::<bool>(), len in 1281usize..3000, mtu in 1280u32..1500,
                                  trailer in 0usize..8, eps in [endpoint(false), endpoint(false), endpoint(false)],
                                  eps6 in [endpoint(true), endpoint(true), endpoint(true)]) {
            let [client, vip, router] = if v6 { eps6 } else { eps };
            let proto = if udp { crate::parse::IPPROTO_UDP } else { IPPROTO_TCP };
            let mut spec = Spec::new(proto, client, vip);
            spec.payload = vec![0x5a; len];
            spec.vlan = vlan.then_some(7);
            spec.trailer = trailer;
            let mut f = crate::testutil::build(&spec);
            let pkt = parse(&f).expect("valid");
            if !v6 && !df {
                f[pkt.l3 + 6] &= !0x40;
                f[pkt.l3 + 10..pkt.l3 + 12].copy_from_slice(&[0, 0]);
                let c = checksum::ipv4_header_checksum(&f[pkt.l3..pkt.l3 + 20]);
                f[pkt.l3 + 10..pkt.l3 + 12].copy_from_slice(&c.to_be_bytes());
                prop_assert_eq!(too_big(&mut f, &pkt, mtu, router.ip()), Ok(TooBig::NoDf));
                return Ok(());
            }
            let orig = f.clone();
            let Ok(TooBig::Answer { len: n }) = too_big(&mut f, &pkt, mtu, router.ip()) else {
                return Err(TestCaseError::fail("no answer"));
            };
            f.truncate(n);
            let max = if v6 { 1280 } else { 576 };
            prop_assert!(n - pkt.l3 <= max, "{} bytes of IP", n - pkt.l3);
            prop_assert_eq!(&f[..6], &orig[6..12]);
            prop_assert_eq!(&f[6..12], &orig[..6]);
            verify(&f, CsumMode::Full).map_err(TestCaseError::fail)?;
            let p = parse(&f).expect("an ICMP packet");
            prop_assert_eq!(p.src, router.ip());
            prop_assert_eq!(p.dst, client.ip());
            prop_assert_eq!(p.vlan, spec.vlan);
            let e = parse_error(&f, &p).expect("well formed").expect("an error");
            prop_assert_eq!(e.kind, ErrorKind::PacketTooBig { mtu });
            prop_assert_eq!(e.tuple.src, client);
            prop_assert_eq!(e.tuple.dst, vip);
            // The quote is the sender's packet, byte for byte, as far as it goes.
            prop_assert_eq!(&f[e.l3..], &orig[pkt.l3..pkt.l3 + (n - e.l3)]);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// ICMP errors of every kind, from either side, nat and fnat, v4 and
        /// v6, TCP and UDP, whole or truncated quotes: the quote becomes the
        /// packet the receiving side sent, the outer header goes to it, and
        /// every checksum matches a from-scratch computation.
        #[test]
        fn translated_errors_verify(v6 in any::<bool>(), udp in any::<bool>(), fnat in any::<bool>(),
                                    from_client in any::<bool>(), kind in 0..3usize,
                                    eps in [endpoint(false), endpoint(false), endpoint(false), endpoint(false), endpoint(false)],
                                    eps6 in [endpoint(true), endpoint(true), endpoint(true), endpoint(true), endpoint(true)],
                                    payload in proptest::collection::vec(any::<u8>(), 0..100),
                                    cut in any::<prop::sample::Index>(), whole in any::<bool>()) {
            let [client, vip, backend, local, router] = if v6 { eps6 } else { eps };
            let m = NatMapping { client, vip, backend, local: Some(local) };
            let method = if fnat { Method::Fnat } else { Method::Nat };
            let lside = if fnat { local } else { client };
            let (dir, q_src, q_dst, to) = if from_client {
                (Direction::ToBackend, vip, client, vip)
            } else {
                (Direction::ToClient, lside, backend, lside)
            };
            let proto = if udp { crate::parse::IPPROTO_UDP } else { IPPROTO_TCP };
            let mut spec = Spec::new(proto, q_src, q_dst);
            spec.payload = payload;
            let inner = quoted(&spec);
            let ihl = if v6 { 40 } else { 20 };
            let n = if whole { inner.len() } else { ihl + 8 + cut.index(inner.len() - ihl - 8 + 1) };
            let (ty, code, word) = match (v6, kind) {
                (false, 0) => (3, 3, 0),
                (false, 1) => (3, 4, 1280),
                (false, _) => (11, 0, 0),
                (true, 0) => (1, 4, 0),
                (true, 1) => (2, 0, 1280),
                (true, _) => (3, 0, 0),
            };
            let mut f = icmp_error(router, to, ty, code, word, &inner[..n]);
            let p = parse(&f).expect("valid");
            let emb = parse_error(&f, &p).expect("well formed").expect("an error");
            let key = emb.flow_key();
            prop_assert_eq!((key.src, key.dst), (q_dst, q_src));
            rewrite_error(&mut f, &p, &emb, method, dir, &m, &HOP).expect("translated");
            if let Err(e) = verify(&f, CsumMode::Full) {
                return Err(TestCaseError::fail(e));
            }
            let q = parse(&f).expect("valid");
            let e = parse_error(&f, &q).expect("ok").expect("error");
            if from_client {
                prop_assert_eq!((e.tuple.src, e.tuple.dst), (backend, lside));
                prop_assert_eq!(q.dst, backend.ip());
                prop_assert_eq!(q.src, if fnat { local.ip() } else { router.ip() });
            } else {
                prop_assert_eq!((e.tuple.src, e.tuple.dst), (client, vip));
                prop_assert_eq!((q.src, q.dst), (vip.ip(), client.ip()));
            }
            if !v6 {
                // The quoted IPv4 header checksum verifies even when cut.
                let h = &f[e.l3..e.l3 + 20];
                prop_assert_eq!(crate::checksum::fold(crate::checksum::sum(h, 0)), 0xffff);
            }
        }
    }
}

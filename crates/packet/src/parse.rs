//! Zero-copy parsing of one Ethernet frame down to its L4 header.
//!
//! [`parse`] reads a frame once and returns a [`Packet`]: the offsets of
//! each layer and the fields a load balancer looks at (addresses, ports,
//! TCP flags, ICMP type). It never copies the frame and never panics: every
//! read is bounds-checked, and a frame it will not handle comes back as an
//! [`Unhandled`] reason the caller counts ([`Unhandled::index`] gives a dense
//! index for a counter array) and then passes to the kernel or drops.
//!
//! ## What is handled
//!
//! Ethernet II with at most one 802.1Q tag; IPv4 without options and not a
//! fragment, with a valid header checksum and total length; IPv6 whose next
//! header is directly TCP, UDP or ICMPv6; TCP, UDP, ICMP, ICMPv6 with their
//! headers complete. The TTL / hop limit must be at least 2, because a
//! forwarded packet leaves with one less.
//!
//! ## What is not, and why (the documented policy)
//!
//! * **IP options** are detected ([`Unhandled::Ipv4Options`]) rather than
//!   forwarded: options such as source routing name other addresses that a
//!   NAT would have to rewrite too, and virtually no legitimate traffic
//!   carries them.
//! * **Fragments** ([`Unhandled::Fragment`], IPv4 MF/offset or an IPv6
//!   fragment header): only the first fragment carries ports, so the flow
//!   of the others cannot be found without reassembly. IPVS defragments
//!   (via conntrack); Katran and Maglev do not. Path-MTU discovery (which
//!   weir's ICMP translation keeps working) makes fragments rare.
//! * **IPv6 extension headers** ([`Unhandled::Ipv6ExtensionHeader`], with
//!   the header's number): hop-by-hop, routing and destination options are
//!   reported, not walked.
//! * Frames whose declared lengths disagree with the bytes present are
//!   malformed and reported as such.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::checksum;

/// EtherType of IPv4.
pub const ETH_P_IPV4: u16 = 0x0800;
/// EtherType of IPv6.
pub const ETH_P_IPV6: u16 = 0x86dd;
/// EtherType of an 802.1Q VLAN tag.
pub const ETH_P_8021Q: u16 = 0x8100;
/// EtherType of an 802.1ad (QinQ) service tag.
pub const ETH_P_8021AD: u16 = 0x88a8;
/// IP protocol number of ICMP.
pub const IPPROTO_ICMP: u8 = 1;
/// IP protocol number of TCP.
pub const IPPROTO_TCP: u8 = 6;
/// IP protocol number of UDP.
pub const IPPROTO_UDP: u8 = 17;
/// IPv6 next header of a fragment header.
pub const IPPROTO_FRAGMENT: u8 = 44;
/// IP protocol number of ICMPv6.
pub const IPPROTO_ICMPV6: u8 = 58;

/// Length of an Ethernet header without tags.
pub const ETH_HLEN: usize = 14;

/// Why a frame is not handled. Each variant is one counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Unhandled {
    /// Shorter than an Ethernet header.
    #[error("frame shorter than an Ethernet header")]
    TruncatedEthernet,
    /// Cut inside the 802.1Q tag.
    #[error("frame cut inside its VLAN tag")]
    TruncatedVlan,
    /// A second VLAN tag (QinQ) or an 802.1ad outer tag.
    #[error("more than one VLAN tag")]
    StackedVlan,
    /// EtherType is neither IPv4 nor IPv6 (ARP, LLDP, ...): the kernel's.
    #[error("not an IP frame (EtherType {0:#06x})")]
    NotIp(u16),
    /// The IP version nibble disagrees with the EtherType.
    #[error("IP version nibble disagrees with the EtherType")]
    BadIpVersion,
    /// Cut inside the IPv4 header.
    #[error("frame cut inside the IPv4 header")]
    TruncatedIpv4,
    /// IHL below 5 (20 bytes).
    #[error("IPv4 header length below 20 bytes")]
    BadIhl,
    /// IPv4 total length below the header or beyond the frame.
    #[error("IPv4 total length inconsistent with the header or the frame")]
    BadIpv4Length,
    /// The IPv4 header checksum does not verify.
    #[error("IPv4 header checksum does not verify")]
    BadIpv4Checksum,
    /// IPv4 options present (IHL > 5): not forwarded (see module docs).
    #[error("IPv4 options present")]
    Ipv4Options,
    /// An IPv4 fragment (MF set or non-zero offset) or an IPv6 fragment
    /// header.
    #[error("IP fragment")]
    Fragment,
    /// Cut inside the IPv6 header.
    #[error("frame cut inside the IPv6 header")]
    TruncatedIpv6,
    /// IPv6 payload length zero (jumbogram) or beyond the frame.
    #[error("IPv6 payload length inconsistent with the frame")]
    BadIpv6Length,
    /// An IPv6 extension header (its number) before the transport header.
    #[error("IPv6 extension header {0}")]
    Ipv6ExtensionHeader(u8),
    /// TTL / hop limit 0 or 1: forwarding would expire it.
    #[error("TTL or hop limit at most 1")]
    TtlExpired,
    /// Another transport protocol (SCTP, GRE, ...), or ICMP in IPv6 /
    /// ICMPv6 in IPv4.
    #[error("unsupported transport protocol {0}")]
    UnsupportedProtocol(u8),
    /// Cut inside the TCP header.
    #[error("packet cut inside the TCP header")]
    TruncatedTcp,
    /// TCP data offset below 5 or beyond the packet.
    #[error("TCP data offset inconsistent with the packet")]
    BadTcpOffset,
    /// Cut inside the UDP header.
    #[error("packet cut inside the UDP header")]
    TruncatedUdp,
    /// UDP length disagrees with the IP length.
    #[error("UDP length disagrees with the IP length")]
    BadUdpLength,
    /// Cut inside the ICMP / ICMPv6 header.
    #[error("packet cut inside the ICMP header")]
    TruncatedIcmp,
    /// An IPv6 UDP datagram with checksum 0, which IPv6 does not allow
    /// (RFC 8200 section 8.1: receivers discard it). Forwarded, a rewrite
    /// would turn it into a wrong non-zero checksum the backend drops.
    #[error("IPv6 UDP checksum 0")]
    ZeroUdp6Checksum,
}

impl Unhandled {
    /// Number of distinct reasons (the length of a counter array).
    pub const COUNT: usize = 22;

    /// A dense index in `0..COUNT`, for counter arrays (variants with data
    /// count as one reason each).
    pub fn index(&self) -> usize {
        match self {
            Unhandled::TruncatedEthernet => 0,
            Unhandled::TruncatedVlan => 1,
            Unhandled::StackedVlan => 2,
            Unhandled::NotIp(_) => 3,
            Unhandled::BadIpVersion => 4,
            Unhandled::TruncatedIpv4 => 5,
            Unhandled::BadIhl => 6,
            Unhandled::BadIpv4Length => 7,
            Unhandled::BadIpv4Checksum => 8,
            Unhandled::Ipv4Options => 9,
            Unhandled::Fragment => 10,
            Unhandled::TruncatedIpv6 => 11,
            Unhandled::BadIpv6Length => 12,
            Unhandled::Ipv6ExtensionHeader(_) => 13,
            Unhandled::TtlExpired => 14,
            Unhandled::UnsupportedProtocol(_) => 15,
            Unhandled::TruncatedTcp => 16,
            Unhandled::BadTcpOffset => 17,
            Unhandled::TruncatedUdp => 18,
            Unhandled::BadUdpLength => 19,
            Unhandled::TruncatedIcmp => 20,
            Unhandled::ZeroUdp6Checksum => 21,
        }
    }

    /// Every reason's [`name`](Self::name), by [`index`](Self::index).
    pub const NAMES: [&'static str; Unhandled::COUNT] = [
        "truncated_ethernet",
        "truncated_vlan",
        "stacked_vlan",
        "not_ip",
        "bad_ip_version",
        "truncated_ipv4",
        "bad_ihl",
        "bad_ipv4_length",
        "bad_ipv4_checksum",
        "ipv4_options",
        "fragment",
        "truncated_ipv6",
        "bad_ipv6_length",
        "ipv6_extension_header",
        "ttl_expired",
        "unsupported_protocol",
        "truncated_tcp",
        "bad_tcp_offset",
        "truncated_udp",
        "bad_udp_length",
        "truncated_icmp",
        "udp6_zero_checksum",
    ];

    /// A stable metric label for the reason.
    pub fn name(&self) -> &'static str {
        Self::NAMES[self.index()]
    }
}

/// IP version of a parsed packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpVersion {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

/// TCP flags byte (the low 8 bits of the flags field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TcpFlags(pub u8);

impl TcpFlags {
    /// FIN.
    pub const FIN: u8 = 0x01;
    /// SYN.
    pub const SYN: u8 = 0x02;
    /// RST.
    pub const RST: u8 = 0x04;
    /// PSH.
    pub const PSH: u8 = 0x08;
    /// ACK.
    pub const ACK: u8 = 0x10;

    /// Whether all bits of `mask` are set.
    pub fn has(self, mask: u8) -> bool {
        self.0 & mask == mask
    }
}

/// The transport header found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// TCP with its ports and flags.
    Tcp {
        /// Source port.
        src_port: u16,
        /// Destination port.
        dst_port: u16,
        /// Flags.
        flags: TcpFlags,
        /// Sequence number.
        seq: u32,
        /// Sequence space the segment takes: its payload bytes, plus one
        /// for a SYN and one for a FIN (RFC 9293 3.4's SEG.LEN).
        seq_len: u32,
    },
    /// UDP with its ports.
    Udp {
        /// Source port.
        src_port: u16,
        /// Destination port.
        dst_port: u16,
    },
    /// ICMP (in IPv4).
    Icmp {
        /// Type.
        icmp_type: u8,
        /// Code.
        code: u8,
    },
    /// ICMPv6 (in IPv6).
    Icmpv6 {
        /// Type.
        icmp_type: u8,
        /// Code.
        code: u8,
    },
}

impl Transport {
    /// The IP protocol number.
    pub fn proto(&self) -> u8 {
        match self {
            Transport::Tcp { .. } => IPPROTO_TCP,
            Transport::Udp { .. } => IPPROTO_UDP,
            Transport::Icmp { .. } => IPPROTO_ICMP,
            Transport::Icmpv6 { .. } => IPPROTO_ICMPV6,
        }
    }

    /// Source and destination ports for TCP and UDP.
    pub fn ports(&self) -> Option<(u16, u16)> {
        match *self {
            Transport::Tcp {
                src_port, dst_port, ..
            }
            | Transport::Udp { src_port, dst_port } => Some((src_port, dst_port)),
            _ => None,
        }
    }
}

/// A parsed frame: offsets into the buffer it came from and the fields a
/// load balancer reads.
///
/// Contract: if [`parse`] returned this for a buffer `b`, then
/// `l3 < l4 <= end <= b.len()`, the IP header lies in `b[l3..l4]`, the
/// whole transport header named by `transport` lies in `b[l4..end]`, and
/// the rewrite functions of this crate do not panic on `b` (or on a buffer
/// with the same bytes up to `end`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Packet {
    /// The VLAN id (low 12 bits of the TCI) when one 802.1Q tag is present.
    pub vlan: Option<u16>,
    /// Offset of the IP header.
    pub l3: usize,
    /// Offset of the transport header.
    pub l4: usize,
    /// End of the IP packet (the frame may carry trailer padding after it).
    pub end: usize,
    /// IP version.
    pub version: IpVersion,
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// TTL / hop limit as received (at least 2).
    pub ttl: u8,
    /// The transport header's fields.
    pub transport: Transport,
}

impl Packet {
    /// Length of the transport segment (header and payload).
    pub fn l4_len(&self) -> usize {
        self.end - self.l4
    }
}

/// Reads a big-endian u16 at `at`, if present.
#[inline]
pub(crate) fn be16(b: &[u8], at: usize) -> Option<u16> {
    let s = b.get(at..at.checked_add(2)?)?;
    Some(u16::from_be_bytes([s[0], s[1]]))
}

/// Parses one Ethernet frame. Never panics; see the module docs for what is
/// handled.
pub fn parse(frame: &[u8]) -> Result<Packet, Unhandled> {
    let mut ethertype = be16(frame, 12).ok_or(Unhandled::TruncatedEthernet)?;
    let mut l3 = ETH_HLEN;
    let mut vlan = None;
    if ethertype == ETH_P_8021AD {
        return Err(Unhandled::StackedVlan);
    }
    if ethertype == ETH_P_8021Q {
        let tci = be16(frame, 14).ok_or(Unhandled::TruncatedVlan)?;
        ethertype = be16(frame, 16).ok_or(Unhandled::TruncatedVlan)?;
        if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
            return Err(Unhandled::StackedVlan);
        }
        vlan = Some(tci & 0x0fff);
        l3 += 4;
    }
    let mut p = match ethertype {
        ETH_P_IPV4 => parse_ipv4(frame, l3)?,
        ETH_P_IPV6 => parse_ipv6(frame, l3)?,
        other => return Err(Unhandled::NotIp(other)),
    };
    p.vlan = vlan;
    Ok(p)
}

/// Parses an IP packet (no link header) starting at `l3`: the same checks
/// as [`parse`] for what follows the Ethernet header.
pub fn parse_ip(buf: &[u8], l3: usize) -> Result<Packet, Unhandled> {
    match buf.get(l3).map(|b| b >> 4) {
        Some(4) => parse_ipv4(buf, l3),
        Some(6) => parse_ipv6(buf, l3),
        Some(_) => Err(Unhandled::BadIpVersion),
        None => Err(Unhandled::TruncatedIpv4),
    }
}

fn parse_ipv4(b: &[u8], l3: usize) -> Result<Packet, Unhandled> {
    let h = b
        .get(l3..l3.saturating_add(20))
        .ok_or(Unhandled::TruncatedIpv4)?;
    if h[0] >> 4 != 4 {
        return Err(Unhandled::BadIpVersion);
    }
    let ihl = usize::from(h[0] & 0x0f) * 4;
    if ihl < 20 {
        return Err(Unhandled::BadIhl);
    }
    let total = usize::from(u16::from_be_bytes([h[2], h[3]]));
    let avail = b.len() - l3;
    if total < ihl || total > avail {
        return Err(Unhandled::BadIpv4Length);
    }
    let header = &b[l3..l3 + ihl];
    if checksum::fold(checksum::sum(header, 0)) != 0xffff {
        return Err(Unhandled::BadIpv4Checksum);
    }
    if ihl > 20 {
        return Err(Unhandled::Ipv4Options);
    }
    let frag = u16::from_be_bytes([h[6], h[7]]);
    if frag & 0x3fff != 0 {
        return Err(Unhandled::Fragment);
    }
    if h[8] <= 1 {
        return Err(Unhandled::TtlExpired);
    }
    let src = Ipv4Addr::new(h[12], h[13], h[14], h[15]);
    let dst = Ipv4Addr::new(h[16], h[17], h[18], h[19]);
    let (proto, ttl) = (h[9], h[8]);
    let l4 = l3 + ihl;
    let end = l3 + total;
    if proto == IPPROTO_ICMPV6 {
        return Err(Unhandled::UnsupportedProtocol(proto));
    }
    let transport = parse_l4(&b[..end], l4, proto)?;
    Ok(Packet {
        vlan: None,
        l3,
        l4,
        end,
        version: IpVersion::V4,
        src: IpAddr::V4(src),
        dst: IpAddr::V4(dst),
        ttl,
        transport,
    })
}

fn parse_ipv6(b: &[u8], l3: usize) -> Result<Packet, Unhandled> {
    let h = b
        .get(l3..l3.saturating_add(40))
        .ok_or(Unhandled::TruncatedIpv6)?;
    if h[0] >> 4 != 6 {
        return Err(Unhandled::BadIpVersion);
    }
    let payload = usize::from(u16::from_be_bytes([h[4], h[5]]));
    let l4 = l3 + 40;
    if payload == 0 || payload > b.len() - l4 {
        return Err(Unhandled::BadIpv6Length);
    }
    let nh = h[6];
    match nh {
        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_ICMPV6 => {}
        IPPROTO_FRAGMENT => return Err(Unhandled::Fragment),
        // Hop-by-hop, routing, destination options, AH, ESP, mobility, HIP,
        // shim6, and the experimental numbers: headers before (or instead
        // of) a transport weir serves.
        0 | 43 | 50 | 51 | 60 | 135 | 139 | 140 | 253 | 254 => {
            return Err(Unhandled::Ipv6ExtensionHeader(nh));
        }
        other => return Err(Unhandled::UnsupportedProtocol(other)),
    }
    if h[7] <= 1 {
        return Err(Unhandled::TtlExpired);
    }
    let mut s = [0u8; 16];
    s.copy_from_slice(&h[8..24]);
    let mut d = [0u8; 16];
    d.copy_from_slice(&h[24..40]);
    let end = l4 + payload;
    let transport = parse_l4(&b[..end], l4, nh)?;
    if nh == IPPROTO_UDP && b[l4 + 6..l4 + 8] == [0, 0] {
        return Err(Unhandled::ZeroUdp6Checksum);
    }
    Ok(Packet {
        vlan: None,
        l3,
        l4,
        end,
        version: IpVersion::V6,
        src: IpAddr::V6(Ipv6Addr::from(s)),
        dst: IpAddr::V6(Ipv6Addr::from(d)),
        ttl: h[7],
        transport,
    })
}

/// Parses the transport header at `l4` of `b` (which ends where the IP
/// packet ends).
fn parse_l4(b: &[u8], l4: usize, proto: u8) -> Result<Transport, Unhandled> {
    let seg = &b[l4..];
    match proto {
        IPPROTO_TCP => {
            if seg.len() < 20 {
                return Err(Unhandled::TruncatedTcp);
            }
            let off = usize::from(seg[12] >> 4) * 4;
            if off < 20 || off > seg.len() {
                return Err(Unhandled::BadTcpOffset);
            }
            let flags = TcpFlags(seg[13]);
            // At most 65,535 payload bytes in an IP packet: no overflow.
            let seq_len = (seg.len() - off) as u32
                + u32::from(flags.has(TcpFlags::SYN))
                + u32::from(flags.has(TcpFlags::FIN));
            Ok(Transport::Tcp {
                src_port: u16::from_be_bytes([seg[0], seg[1]]),
                dst_port: u16::from_be_bytes([seg[2], seg[3]]),
                flags,
                seq: u32::from_be_bytes([seg[4], seg[5], seg[6], seg[7]]),
                seq_len,
            })
        }
        IPPROTO_UDP => {
            if seg.len() < 8 {
                return Err(Unhandled::TruncatedUdp);
            }
            let len = usize::from(u16::from_be_bytes([seg[4], seg[5]]));
            if len != seg.len() {
                return Err(Unhandled::BadUdpLength);
            }
            Ok(Transport::Udp {
                src_port: u16::from_be_bytes([seg[0], seg[1]]),
                dst_port: u16::from_be_bytes([seg[2], seg[3]]),
            })
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            if seg.len() < 8 {
                return Err(Unhandled::TruncatedIcmp);
            }
            let (icmp_type, code) = (seg[0], seg[1]);
            Ok(if proto == IPPROTO_ICMP {
                Transport::Icmp { icmp_type, code }
            } else {
                Transport::Icmpv6 { icmp_type, code }
            })
        }
        other => Err(Unhandled::UnsupportedProtocol(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{Spec, build, ethernet, ip_packet, sa};
    use proptest::prelude::*;

    fn tcp4() -> Spec {
        Spec::new(IPPROTO_TCP, sa("10.0.0.1:40000"), sa("10.0.0.100:80"))
    }

    #[test]
    fn parses_tcp_udp_over_v4_v6_with_and_without_vlan() {
        for (src, dst) in [
            ("10.0.0.1:40000", "10.0.0.100:80"),
            ("[2001:db8::1]:40000", "[2001:db8::100]:80"),
        ] {
            for proto in [IPPROTO_TCP, IPPROTO_UDP] {
                for vlan in [None, Some(42)] {
                    let mut s = Spec::new(proto, sa(src), sa(dst));
                    s.vlan = vlan;
                    s.tcp_flags = TcpFlags::SYN;
                    s.trailer = 6;
                    let f = build(&s);
                    let p = parse(&f).expect("handled");
                    assert_eq!(p.vlan, vlan);
                    assert_eq!(p.l3, if vlan.is_some() { 18 } else { 14 });
                    assert_eq!(p.end, f.len() - 6, "trailer not part of the packet");
                    let t = p.tuple().expect("tcp/udp");
                    assert_eq!((t.proto, t.src, t.dst), (proto, sa(src), sa(dst)));
                    assert_eq!(p.ttl, 64);
                    if proto == IPPROTO_TCP {
                        assert!(
                            matches!(p.transport, Transport::Tcp { flags, .. } if flags.has(TcpFlags::SYN))
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn parses_icmp_and_icmpv6() {
        let m = [8u8, 0, 0, 0, 0, 1, 0, 1];
        let mut m4 = m;
        let c = crate::checksum::finish(crate::checksum::sum(&m4, 0));
        m4[2..4].copy_from_slice(&c.to_be_bytes());
        let f = ethernet(
            &ip_packet(sa("10.0.0.1:0"), sa("10.0.0.2:0"), IPPROTO_ICMP, 9, &m4),
            false,
            None,
            0,
        );
        let p = parse(&f).expect("icmp");
        assert_eq!(
            p.transport,
            Transport::Icmp {
                icmp_type: 8,
                code: 0
            }
        );
        assert_eq!(p.tuple(), None);
        let f = ethernet(
            &ip_packet(
                sa("[::1]:0"),
                sa("[::2]:0"),
                IPPROTO_ICMPV6,
                9,
                &[128, 0, 0, 0, 0, 0, 0, 0],
            ),
            true,
            None,
            0,
        );
        assert_eq!(
            parse(&f).expect("icmpv6").transport,
            Transport::Icmpv6 {
                icmp_type: 128,
                code: 0
            }
        );
    }

    /// Rewrites byte `at` of a valid IPv4 frame, fixing the header checksum.
    fn poke4(f: &mut [u8], at: usize, v: u8) {
        f[at] = v;
        f[24..26].copy_from_slice(&[0, 0]);
        let ihl = usize::from(f[14] & 0xf) * 4;
        let c = crate::checksum::ipv4_header_checksum(&f[14..14 + ihl.min(f.len() - 14)]);
        f[24..26].copy_from_slice(&c.to_be_bytes());
    }

    #[test]
    fn each_reason_is_reported() {
        let good = build(&tcp4());
        assert_eq!(parse(&good[..13]), Err(Unhandled::TruncatedEthernet));
        let mut f = good.clone();
        f[12..14].copy_from_slice(&[0x08, 0x06]);
        assert_eq!(parse(&f), Err(Unhandled::NotIp(0x0806)));
        let mut s = tcp4();
        s.vlan = Some(1);
        let v = build(&s);
        assert_eq!(parse(&v[..16]), Err(Unhandled::TruncatedVlan));
        let mut q = v.clone();
        q[16..18].copy_from_slice(&[0x81, 0x00]);
        assert_eq!(parse(&q), Err(Unhandled::StackedVlan));
        assert_eq!(parse(&good[..30]), Err(Unhandled::TruncatedIpv4));
        let mut f = good.clone();
        poke4(&mut f, 14, 0x65);
        assert_eq!(parse(&f), Err(Unhandled::BadIpVersion));
        let mut f = good.clone();
        poke4(&mut f, 14, 0x44);
        assert_eq!(parse(&f), Err(Unhandled::BadIhl));
        let mut f = good.clone();
        poke4(&mut f, 17, 0xff);
        assert_eq!(parse(&f), Err(Unhandled::BadIpv4Length));
        let mut f = good.clone();
        f[26] ^= 1; // source address, checksum not fixed
        assert_eq!(parse(&f), Err(Unhandled::BadIpv4Checksum));
        let mut f = good.clone();
        poke4(&mut f, 14, 0x46);
        assert_eq!(parse(&f), Err(Unhandled::Ipv4Options));
        for (hi, lo) in [(0x20, 0), (0, 1), (0x40, 8)] {
            let mut f = good.clone();
            poke4(&mut f, 20, hi);
            poke4(&mut f, 21, lo);
            assert_eq!(parse(&f), Err(Unhandled::Fragment), "flags {hi:#x} {lo:#x}");
        }
        for ttl in [0, 1] {
            let mut f = good.clone();
            poke4(&mut f, 22, ttl);
            assert_eq!(parse(&f), Err(Unhandled::TtlExpired));
        }
        let mut f = good.clone();
        poke4(&mut f, 23, 132); // SCTP
        assert_eq!(parse(&f), Err(Unhandled::UnsupportedProtocol(132)));
        let mut f = good.clone();
        f[46] = 0x40; // data offset 4
        assert_eq!(parse(&f), Err(Unhandled::BadTcpOffset));
        f[46] = 0xf0; // 60 bytes, beyond the packet
        assert_eq!(parse(&f), Err(Unhandled::BadTcpOffset));
        let short = ethernet(
            &ip_packet(sa("1.1.1.1:0"), sa("2.2.2.2:0"), IPPROTO_TCP, 9, &[0; 19]),
            false,
            None,
            0,
        );
        assert_eq!(parse(&short), Err(Unhandled::TruncatedTcp));
        let short = ethernet(
            &ip_packet(sa("1.1.1.1:0"), sa("2.2.2.2:0"), IPPROTO_UDP, 9, &[0; 7]),
            false,
            None,
            0,
        );
        assert_eq!(parse(&short), Err(Unhandled::TruncatedUdp));
        let short = ethernet(
            &ip_packet(sa("1.1.1.1:0"), sa("2.2.2.2:0"), IPPROTO_ICMP, 9, &[0; 7]),
            false,
            None,
            0,
        );
        assert_eq!(parse(&short), Err(Unhandled::TruncatedIcmp));
        let mut u = build(&Spec::new(IPPROTO_UDP, sa("1.1.1.1:1"), sa("2.2.2.2:2")));
        u[39] += 1; // UDP length
        assert_eq!(parse(&u), Err(Unhandled::BadUdpLength));
    }

    #[test]
    fn ipv6_reasons() {
        let good = build(&Spec::new(IPPROTO_UDP, sa("[::1]:1"), sa("[::2]:2")));
        assert_eq!(parse(&good[..50]), Err(Unhandled::TruncatedIpv6));
        for (nh, want) in [
            (0, Unhandled::Ipv6ExtensionHeader(0)),
            (43, Unhandled::Ipv6ExtensionHeader(43)),
            (60, Unhandled::Ipv6ExtensionHeader(60)),
            (44, Unhandled::Fragment),
            (1, Unhandled::UnsupportedProtocol(1)),
        ] {
            let mut f = good.clone();
            f[20] = nh;
            assert_eq!(parse(&f), Err(want));
        }
        let mut f = good.clone();
        f[18..20].copy_from_slice(&[0, 0]);
        assert_eq!(parse(&f), Err(Unhandled::BadIpv6Length));
        let mut f = good.clone();
        f[18..20].copy_from_slice(&[0xff, 0]);
        assert_eq!(parse(&f), Err(Unhandled::BadIpv6Length));
        let mut f = good.clone();
        f[21] = 1;
        assert_eq!(parse(&f), Err(Unhandled::TtlExpired));
        let mut f = good.clone();
        f[14] = 0x40;
        assert_eq!(parse(&f), Err(Unhandled::BadIpVersion));
        // UDP checksum 0: not allowed in IPv6 (RFC 8200), "none" in IPv4.
        assert_ne!(good[60..62], [0, 0]);
        let mut f = good;
        f[60..62].copy_from_slice(&[0, 0]);
        assert_eq!(parse(&f), Err(Unhandled::ZeroUdp6Checksum));
        let mut v4 = build(&Spec::new(IPPROTO_UDP, sa("1.1.1.1:1"), sa("2.2.2.2:2")));
        v4[40..42].copy_from_slice(&[0, 0]);
        assert!(parse(&v4).is_ok());
    }

    #[test]
    fn reason_indices_are_dense_and_names_distinct() {
        let all = [
            Unhandled::TruncatedEthernet,
            Unhandled::TruncatedVlan,
            Unhandled::StackedVlan,
            Unhandled::NotIp(0),
            Unhandled::BadIpVersion,
            Unhandled::TruncatedIpv4,
            Unhandled::BadIhl,
            Unhandled::BadIpv4Length,
            Unhandled::BadIpv4Checksum,
            Unhandled::Ipv4Options,
            Unhandled::Fragment,
            Unhandled::TruncatedIpv6,
            Unhandled::BadIpv6Length,
            Unhandled::Ipv6ExtensionHeader(0),
            Unhandled::TtlExpired,
            Unhandled::UnsupportedProtocol(0),
            Unhandled::TruncatedTcp,
            Unhandled::BadTcpOffset,
            Unhandled::TruncatedUdp,
            Unhandled::BadUdpLength,
            Unhandled::TruncatedIcmp,
            Unhandled::ZeroUdp6Checksum,
        ];
        assert_eq!(all.len(), Unhandled::COUNT);
        let idx: std::collections::HashSet<_> = all.iter().map(|u| u.index()).collect();
        let names: std::collections::HashSet<_> = all.iter().map(|u| u.name()).collect();
        assert_eq!(idx.len(), Unhandled::COUNT);
        assert_eq!(names.len(), Unhandled::COUNT);
        assert!(idx.iter().all(|&i| i < Unhandled::COUNT));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// Arbitrary bytes never panic, and an accepted frame's offsets lie
        /// within it.
        #[test]
        fn never_panics_on_random_bytes(f in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(p) = parse(&f) {
                prop_assert!(p.l3 < p.l4 && p.l4 <= p.end && p.end <= f.len());
            }
        }

        /// Random corruption of a valid frame (the likelier way to reach
        /// deep code paths) never panics either.
        #[test]
        fn never_panics_on_corrupted_frames(v6 in any::<bool>(), kind in 0..3u8,
                                            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
                                            cut in any::<prop::sample::Index>()) {
            let (s, d) = if v6 { ("[::1]:1", "[::2]:2") } else { ("1.1.1.1:1", "2.2.2.2:2") };
            let mut f = match kind {
                0 => build(&Spec::new(IPPROTO_TCP, sa(s), sa(d))),
                1 => build(&Spec::new(IPPROTO_UDP, sa(s), sa(d))),
                _ => {
                    // An ICMP error quoting a TCP packet.
                    let inner = build(&Spec::new(IPPROTO_TCP, sa(d), sa(s)));
                    let ty = if v6 { 2 } else { 3 };
                    crate::testutil::icmp_error(sa(d), sa(s), ty, 4, 1280, &inner[14..])
                }
            };
            for (i, b) in flips {
                let i = i.index(f.len());
                f[i] = b;
            }
            let n = cut.index(f.len() + 1);
            if let Ok(p) = parse(&f[..n]) {
                prop_assert!(p.l3 < p.l4 && p.l4 <= p.end && p.end <= n);
                // Whatever parses can be rewritten without a panic.
                let m = crate::NatMapping {
                    client: sa(s),
                    vip: sa(d),
                    backend: sa(d),
                    local: Some(sa(s)),
                };
                let hop = crate::NextHop { src_mac: [1; 6], dst_mac: [2; 6] };
                let mut g = f[..n].to_vec();
                for method in [crate::Method::Dr, crate::Method::Nat, crate::Method::Fnat] {
                    for dir in [crate::Direction::ToBackend, crate::Direction::ToClient] {
                        let _ = crate::rewrite(&mut g, &p, method, dir, &m, &hop, crate::CsumMode::Full);
                        if let Ok(Some(e)) = crate::icmp::parse_error(&g, &p) {
                            let _ = crate::icmp::rewrite_error(&mut g, &p, &e, method, dir, &m, &hop);
                        }
                    }
                }
            }
        }
    }
}

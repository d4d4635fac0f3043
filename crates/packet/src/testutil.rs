//! Frame builders and from-scratch checksum verifiers for the tests.

use std::net::SocketAddr;

use crate::checksum::{self, CsumMode};
use crate::parse::{IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP};
use crate::rewrite::{NatMapping, NextHop, ip_bytes};

pub(crate) const MAC_A: [u8; 6] = [2, 0, 0, 0, 0, 1];
pub(crate) const MAC_B: [u8; 6] = [2, 0, 0, 0, 0, 2];

/// The next hop the rewrite tests write.
pub(crate) const HOP: NextHop = NextHop {
    src_mac: [0xaa; 6],
    dst_mac: [0xbb; 6],
};

/// A socket address written out in a test.
pub(crate) fn sa(s: &str) -> SocketAddr {
    s.parse().expect("test address")
}

/// The IPv4 flow the rewrite and ICMP tests translate: client
/// 192.0.2.7:40000, VIP 10.0.0.100:80, backend 10.0.1.2:8080, and for fnat
/// the local address 10.0.1.1:50001.
pub(crate) fn mapping4() -> NatMapping {
    NatMapping {
        client: sa("192.0.2.7:40000"),
        vip: sa("10.0.0.100:80"),
        backend: sa("10.0.1.2:8080"),
        local: Some(sa("10.0.1.1:50001")),
    }
}

/// What to build.
#[derive(Debug, Clone)]
pub(crate) struct Spec {
    pub proto: u8,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub ttl: u8,
    pub tcp_flags: u8,
    /// TCP header options length (multiple of 4, ≤ 40).
    pub tcp_opts: usize,
    pub payload: Vec<u8>,
    pub vlan: Option<u16>,
    pub mode: CsumMode,
    /// For IPv4 UDP: send without a checksum (0).
    pub udp_no_csum: bool,
    /// Trailer bytes after the IP packet (Ethernet padding).
    pub trailer: usize,
    /// IPv4 TOS / IPv6 traffic class and IPv4 id / IPv6 flow label bits.
    pub tos: u8,
    pub id: u16,
}

impl Spec {
    pub(crate) fn new(proto: u8, src: SocketAddr, dst: SocketAddr) -> Spec {
        Spec {
            proto,
            src,
            dst,
            ttl: 64,
            tcp_flags: 0x10,
            tcp_opts: 0,
            payload: b"hello".to_vec(),
            vlan: None,
            mode: CsumMode::Full,
            udp_no_csum: false,
            trailer: 0,
            tos: 0,
            id: 0x1234,
        }
    }
}

/// The transport segment (header + payload) with its checksum per `mode`.
pub(crate) fn l4_segment(s: &Spec) -> Vec<u8> {
    let mut seg = Vec::new();
    seg.extend_from_slice(&s.src.port().to_be_bytes());
    seg.extend_from_slice(&s.dst.port().to_be_bytes());
    if s.proto == IPPROTO_TCP {
        seg.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]); // seq, ack
        seg.push((((20 + s.tcp_opts) / 4) as u8) << 4);
        seg.push(s.tcp_flags);
        seg.extend_from_slice(&[0xff, 0xff, 0, 0, 0, 0]); // window, csum, urg
        seg.extend(std::iter::repeat_n(1u8, s.tcp_opts)); // NOPs
    } else {
        let len = (8 + s.payload.len()) as u16;
        seg.extend_from_slice(&len.to_be_bytes());
        seg.extend_from_slice(&[0, 0]);
    }
    seg.extend_from_slice(&s.payload);
    let at = crate::rewrite::l4_csum_offset(s.proto);
    let (sa, da) = (ip_bytes(s.src.ip()), ip_bytes(s.dst.ip()));
    let alen = if s.src.is_ipv4() { 4 } else { 16 };
    let c = match s.mode {
        CsumMode::Full => {
            let c = checksum::l4_checksum(&sa[..alen], &da[..alen], s.proto, &seg, at);
            if s.proto == IPPROTO_UDP && c == 0 {
                0xffff
            } else {
                c
            }
        }
        CsumMode::Partial => checksum::fold(checksum::pseudo_header_sum(
            &sa[..alen],
            &da[..alen],
            s.proto,
            seg.len() as u32,
        )),
    };
    let c = if s.udp_no_csum && s.proto == IPPROTO_UDP && s.src.is_ipv4() {
        0
    } else {
        c
    };
    seg[at..at + 2].copy_from_slice(&c.to_be_bytes());
    seg
}

/// An IP packet (no Ethernet) carrying `l4` of `proto`.
pub(crate) fn ip_packet(
    src: SocketAddr,
    dst: SocketAddr,
    proto: u8,
    ttl: u8,
    l4: &[u8],
) -> Vec<u8> {
    let mut p = Vec::new();
    if src.is_ipv4() {
        let total = (20 + l4.len()) as u16;
        p.push(0x45);
        p.push(0);
        p.extend_from_slice(&total.to_be_bytes());
        p.extend_from_slice(&[0x12, 0x34, 0x40, 0]); // id, DF
        p.push(ttl);
        p.push(proto);
        p.extend_from_slice(&[0, 0]);
        p.extend_from_slice(&ip_bytes(src.ip())[..4]);
        p.extend_from_slice(&ip_bytes(dst.ip())[..4]);
        let c = checksum::ipv4_header_checksum(&p);
        p[10..12].copy_from_slice(&c.to_be_bytes());
    } else {
        p.extend_from_slice(&[0x60, 0, 0, 0]);
        p.extend_from_slice(&(l4.len() as u16).to_be_bytes());
        p.push(proto);
        p.push(ttl);
        p.extend_from_slice(&ip_bytes(src.ip()));
        p.extend_from_slice(&ip_bytes(dst.ip()));
    }
    p.extend_from_slice(l4);
    p
}

/// Wraps an IP packet in Ethernet (with an optional VLAN tag).
pub(crate) fn ethernet(ip: &[u8], v6: bool, vlan: Option<u16>, trailer: usize) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&MAC_A);
    f.extend_from_slice(&MAC_B);
    if let Some(v) = vlan {
        f.extend_from_slice(&[0x81, 0x00]);
        f.extend_from_slice(&v.to_be_bytes());
    }
    f.extend_from_slice(if v6 { &[0x86, 0xdd] } else { &[0x08, 0x00] });
    f.extend_from_slice(ip);
    f.extend(std::iter::repeat_n(0u8, trailer));
    f
}

pub(crate) fn build(s: &Spec) -> Vec<u8> {
    let seg = l4_segment(s);
    let mut ip = ip_packet(s.src, s.dst, s.proto, s.ttl, &seg);
    if s.src.is_ipv4() {
        ip[1] = s.tos;
        ip[4..6].copy_from_slice(&s.id.to_be_bytes());
        ip[10..12].copy_from_slice(&[0, 0]);
        let c = checksum::ipv4_header_checksum(&ip[..20]);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
    } else {
        ip[0] = 0x60 | (s.tos >> 4);
        ip[1] = (s.tos << 4) | (s.id >> 12) as u8;
        ip[2..4].copy_from_slice(&(s.id << 4).to_be_bytes());
    }
    ethernet(&ip, s.src.is_ipv6(), s.vlan, s.trailer)
}

/// An ICMP(v6) error from `src` to `dst` quoting `quoted` (an IP packet).
pub(crate) fn icmp_error(
    src: SocketAddr,
    dst: SocketAddr,
    icmp_type: u8,
    code: u8,
    word: u32,
    quoted: &[u8],
) -> Vec<u8> {
    let v6 = src.is_ipv6();
    let mut m = vec![icmp_type, code, 0, 0];
    m.extend_from_slice(&word.to_be_bytes());
    m.extend_from_slice(quoted);
    let c = if v6 {
        checksum::l4_checksum(
            &ip_bytes(src.ip()),
            &ip_bytes(dst.ip()),
            IPPROTO_ICMPV6,
            &m,
            2,
        )
    } else {
        checksum::finish(checksum::sum(&m, 0))
    };
    m[2..4].copy_from_slice(&c.to_be_bytes());
    let proto = if v6 { IPPROTO_ICMPV6 } else { IPPROTO_ICMP };
    ethernet(&ip_packet(src, dst, proto, 64, &m), v6, None, 0)
}

/// Checks every checksum of an Ethernet frame from scratch: the IPv4 header,
/// and the L4 checksum per `mode` (ICMP errors: the ICMP checksum, and the
/// quoted packet's IPv4 header and full L4 checksum when it is quoted whole).
/// Returns a description of the first mismatch.
pub(crate) fn verify(frame: &[u8], mode: CsumMode) -> Result<(), String> {
    let p = crate::parse::parse(frame).map_err(|e| format!("parse: {e}"))?;
    verify_ip(frame, p.l3, p.end, mode)?;
    if let Ok(Some(emb)) = crate::icmp::parse_error(frame, &p) {
        let inner_end = if p.version == crate::IpVersion::V4 {
            emb.l3 + usize::from(u16::from_be_bytes([frame[emb.l3 + 2], frame[emb.l3 + 3]]))
        } else {
            emb.l4 + usize::from(u16::from_be_bytes([frame[emb.l3 + 4], frame[emb.l3 + 5]]))
        };
        if inner_end == p.end {
            verify_ip(frame, emb.l3, p.end, CsumMode::Full).map_err(|e| format!("quoted: {e}"))?;
        }
    }
    Ok(())
}

fn verify_ip(frame: &[u8], l3: usize, end: usize, mode: CsumMode) -> Result<(), String> {
    let v4 = frame[l3] >> 4 == 4;
    let (l4, proto, alen, sa, da) = if v4 {
        let ihl = usize::from(frame[l3] & 0xf) * 4;
        let want = checksum::ipv4_header_checksum(&frame[l3..l3 + ihl]);
        let got = u16::from_be_bytes([frame[l3 + 10], frame[l3 + 11]]);
        if want != got {
            return Err(format!(
                "ipv4 header checksum {got:#06x}, from scratch {want:#06x}"
            ));
        }
        (l3 + ihl, frame[l3 + 9], 4, l3 + 12, l3 + 16)
    } else {
        (l3 + 40, frame[l3 + 6], 16, l3 + 8, l3 + 24)
    };
    let seg = &frame[l4..end];
    let (src, dst) = (&frame[sa..sa + alen], &frame[da..da + alen]);
    let (at, pseudo) = match proto {
        IPPROTO_TCP => (16, true),
        IPPROTO_UDP => (6, true),
        IPPROTO_ICMPV6 => (2, true),
        IPPROTO_ICMP => (2, false),
        _ => return Ok(()),
    };
    let got = u16::from_be_bytes([seg[at], seg[at + 1]]);
    if proto == IPPROTO_UDP && v4 && got == 0 {
        return Ok(()); // no checksum
    }
    let is_l4 = proto == IPPROTO_TCP || proto == IPPROTO_UDP;
    let want = if is_l4 && mode == CsumMode::Partial {
        checksum::fold(checksum::pseudo_header_sum(
            src,
            dst,
            proto,
            seg.len() as u32,
        ))
    } else if pseudo {
        let c = checksum::l4_checksum(src, dst, proto, seg, at);
        if proto == IPPROTO_UDP && c == 0 {
            0xffff
        } else {
            c
        }
    } else {
        let a = checksum::fold(checksum::sum(&seg[..at], 0));
        checksum::finish(checksum::sum(&seg[at + 2..], u32::from(a)))
    };
    if want != got {
        return Err(format!(
            "proto {proto} checksum {got:#06x}, from scratch {want:#06x}"
        ));
    }
    Ok(())
}

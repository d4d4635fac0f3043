//! The packet core (weir-packet) on arbitrary frames: parse, then every
//! rewrite (dr, nat, fnat; both directions; full and partial checksums),
//! the ICMP error path and the "too big" answer on whatever parses. Nothing
//! may panic; a rewrite that is refused leaves the frame unchanged.
//!
//! Each frame is also rewritten once more with its checksums made right
//! first (a fuzzed frame's L4 checksum seldom is): then every checksum of
//! the result must verify from scratch, and the result must carry the
//! translation's endpoints. That is what the packet path promises the
//! endpoints, and what an incremental update gets wrong without a panic.
#![no_main]

use std::net::{IpAddr, SocketAddr};

use libfuzzer_sys::fuzz_target;
use weir_packet::{
    CsumMode, Direction, IpVersion, Method, NatMapping, NextHop, Packet, checksum, icmp, parse,
    rewrite,
};

fn mapping(v4: bool) -> NatMapping {
    let a = |s4: &str, s6: &str| -> SocketAddr { if v4 { s4 } else { s6 }.parse().unwrap() };
    NatMapping {
        client: a("192.0.2.10:40000", "[2001:db8::10]:40000"),
        vip: a("198.51.100.1:80", "[2001:db8:1::1]:80"),
        backend: a("10.0.1.2:8080", "[fd00::2]:8080"),
        local: Some(a("10.0.1.1:50000", "[fd00::1]:50000")),
    }
}

const HOP: NextHop = NextHop {
    src_mac: [2, 0, 0, 0, 0, 1],
    dst_mac: [2, 0, 0, 0, 0, 2],
};

const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMP: u8 = 1;
const ICMPV6: u8 = 58;

/// Where an IP header at `l3` keeps its transport header, protocol and
/// addresses: (l4, proto, src range start, dst range start, address length).
fn ip_layout(f: &[u8], l3: usize) -> (usize, u8, usize, usize, usize) {
    if f[l3] >> 4 == 4 {
        let ihl = usize::from(f[l3] & 0xf) * 4;
        (l3 + ihl, f[l3 + 9], l3 + 12, l3 + 16, 4)
    } else {
        (l3 + 40, f[l3 + 6], l3 + 8, l3 + 24, 16)
    }
}

/// Offset of the checksum field in a transport header of `proto`, and
/// whether the pseudo header is summed.
fn csum_field(proto: u8) -> Option<(usize, bool)> {
    match proto {
        TCP => Some((16, true)),
        UDP => Some((6, true)),
        ICMPV6 => Some((2, true)),
        ICMP => Some((2, false)),
        _ => None,
    }
}

/// The checksum field of the segment `l4..end` under the IP header at
/// `l3`, from scratch, in `mode` (`Partial`: TCP and UDP hold only the
/// folded pseudo-header sum).
fn want_csum(f: &[u8], l3: usize, end: usize, mode: CsumMode) -> Option<(usize, u16)> {
    let (l4, proto, sa, da, alen) = ip_layout(f, l3);
    let (at, pseudo) = csum_field(proto)?;
    if l4 + at + 2 > end {
        return None;
    }
    let seg = &f[l4..end];
    let (src, dst) = (&f[sa..sa + alen], &f[da..da + alen]);
    let l4_proto = proto == TCP || proto == UDP;
    let c = if l4_proto && mode == CsumMode::Partial {
        checksum::fold(checksum::pseudo_header_sum(
            src,
            dst,
            proto,
            seg.len() as u32,
        ))
    } else if pseudo {
        let c = checksum::l4_checksum(src, dst, proto, seg, at);
        if proto == UDP && c == 0 { 0xffff } else { c }
    } else {
        let a = checksum::fold(checksum::sum(&seg[..at], 0));
        checksum::finish(checksum::sum(&seg[at + 2..], u32::from(a)))
    };
    Some((l4 + at, c))
}

fn ipv4_csum_ok(f: &[u8], l3: usize) -> bool {
    let ihl = usize::from(f[l3] & 0xf) * 4;
    checksum::fold(checksum::sum(&f[l3..l3 + ihl], 0)) == 0xffff
}

fn set_ipv4_csum(f: &mut [u8], l3: usize) {
    let ihl = usize::from(f[l3] & 0xf) * 4;
    let c = checksum::ipv4_header_checksum(&f[l3..l3 + ihl]);
    f[l3 + 10..l3 + 12].copy_from_slice(&c.to_be_bytes());
}

/// The end of a quoted packet when the quote holds all of it.
fn whole_quote(f: &[u8], emb: &icmp::Embedded, end: usize) -> bool {
    let inner_end = if f[emb.l3] >> 4 == 4 {
        emb.l3 + usize::from(u16::from_be_bytes([f[emb.l3 + 2], f[emb.l3 + 3]]))
    } else {
        emb.l4 + usize::from(u16::from_be_bytes([f[emb.l3 + 4], f[emb.l3 + 5]]))
    };
    inner_end == end
}

/// Whether the L4 checksum of `pkt` in `f` is "none" (IPv4 UDP, 0): kept
/// so, and not checked.
fn udp4_none(f: &[u8], pkt: &Packet, l3: usize, end: usize) -> bool {
    let (l4, proto, ..) = ip_layout(f, l3);
    pkt.version == IpVersion::V4 && proto == UDP && l4 + 8 <= end && f[l4 + 6..l4 + 8] == [0, 0]
}

/// Makes every checksum of the parsed frame right (quoted ones first, the
/// ICMP one last, as it covers them), keeping an IPv4 UDP "none".
fn fix(f: &mut [u8], pkt: &Packet, emb: Option<&icmp::Embedded>, mode: CsumMode) {
    if let Some(e) = emb {
        if pkt.version == IpVersion::V4 {
            set_ipv4_csum(f, e.l3);
        }
        if whole_quote(f, e, pkt.end)
            && !udp4_none(f, pkt, e.l3, pkt.end)
            && let Some((at, c)) = want_csum(f, e.l3, pkt.end, CsumMode::Full)
        {
            f[at..at + 2].copy_from_slice(&c.to_be_bytes());
        }
    }
    // A partial checksum is never "none": the field holds the (non-zero)
    // pseudo-header sum.
    if (mode == CsumMode::Partial || !udp4_none(f, pkt, pkt.l3, pkt.end))
        && let Some((at, c)) = want_csum(f, pkt.l3, pkt.end, mode)
    {
        f[at..at + 2].copy_from_slice(&c.to_be_bytes());
    }
}

/// Every checksum `fix` sets verifies in `f` (the same layout as `pkt`).
fn verify(
    f: &[u8],
    pkt: &Packet,
    emb: Option<&icmp::Embedded>,
    mode: CsumMode,
) -> Result<(), String> {
    if pkt.version == IpVersion::V4 && !ipv4_csum_ok(f, pkt.l3) {
        return Err("outer IPv4 header checksum".into());
    }
    if let Some(e) = emb {
        if pkt.version == IpVersion::V4 && !ipv4_csum_ok(f, e.l3) {
            return Err("quoted IPv4 header checksum".into());
        }
        if whole_quote(f, e, pkt.end)
            && !udp4_none(f, pkt, e.l3, pkt.end)
            && let Some((at, c)) = want_csum(f, e.l3, pkt.end, CsumMode::Full)
        {
            let got = u16::from_be_bytes([f[at], f[at + 1]]);
            if got != c {
                return Err(format!(
                    "quoted L4 checksum {got:#06x}, from scratch {c:#06x}"
                ));
            }
        }
    }
    if (mode == CsumMode::Partial || !udp4_none(f, pkt, pkt.l3, pkt.end))
        && let Some((at, c)) = want_csum(f, pkt.l3, pkt.end, mode)
    {
        let got = u16::from_be_bytes([f[at], f[at + 1]]);
        if got != c {
            return Err(format!("L4 checksum {got:#06x}, from scratch {c:#06x}"));
        }
    }
    Ok(())
}

/// The address at `at` of `f` (4 or 16 bytes) and the port at `port_at`.
fn endpoint(f: &[u8], at: usize, alen: usize, port_at: usize) -> SocketAddr {
    let ip = if alen == 4 {
        IpAddr::from(<[u8; 4]>::try_from(&f[at..at + 4]).unwrap())
    } else {
        IpAddr::from(<[u8; 16]>::try_from(&f[at..at + 16]).unwrap())
    };
    SocketAddr::new(ip, u16::from_be_bytes([f[port_at], f[port_at + 1]]))
}

fuzz_target!(|data: &[u8]| {
    // The same frame read as an IP packet without a link header.
    if let Ok(p) = weir_packet::parse::parse_ip(data, 0) {
        assert!(p.l3 < p.l4 && p.l4 <= p.end && p.end <= data.len());
    }
    let Ok(pkt) = parse(data) else { return };
    assert!(pkt.l3 < pkt.l4 && pkt.l4 <= pkt.end && pkt.end <= data.len());
    let _ = pkt.tuple();
    let _ = pkt.tcp_flags();
    if let (Some(flags), Some((seq, end))) = (pkt.tcp_flags(), pkt.tcp_seq()) {
        // The sequence tracking the packet path does per TCP segment: a
        // segment takes its payload and at most a SYN and a FIN.
        assert!(end.wrapping_sub(seq) as usize <= pkt.end - pkt.l4 + 2);
        let known = seq ^ 0x5a5a_5a5a;
        let _ = weir_packet::tcp_state::rst_acceptable(seq, known);
        for st in weir_packet::TcpState::ALL {
            let _ = weir_packet::tcp_state::seq_to_note(st, flags, end, known);
        }
    }
    let m = mapping(pkt.version == IpVersion::V4);
    let emb = icmp::parse_error(data, &pkt).ok().flatten();
    for method in [Method::Dr, Method::Nat, Method::Fnat] {
        for dir in [Direction::ToBackend, Direction::ToClient] {
            let t = m.translation(method, dir).ok();
            for mode in [CsumMode::Full, CsumMode::Partial] {
                let mut frame = data.to_vec();
                if rewrite(&mut frame, &pkt, method, dir, &m, &HOP, mode).is_err() {
                    assert_eq!(frame, data, "a refused rewrite changed the frame");
                }
                // Again with the checksums right: they stay right, and the
                // packet carries the translation's endpoints.
                let mut good = data.to_vec();
                fix(&mut good, &pkt, None, mode);
                let before = good.clone();
                if rewrite(&mut good, &pkt, method, dir, &m, &HOP, mode).is_ok() {
                    if let Err(e) = verify(&good, &pkt, None, mode) {
                        panic!("{method:?} {dir:?} {mode:?}: {e}");
                    }
                    let (_, _, sa, da, alen) = ip_layout(&good, pkt.l3);
                    let (src, dst) = (
                        endpoint(&good, sa, alen, pkt.l4),
                        endpoint(&good, da, alen, pkt.l4 + 2),
                    );
                    let t = t.expect("a rewrite has a translation");
                    let was = (
                        endpoint(&before, sa, alen, pkt.l4),
                        endpoint(&before, da, alen, pkt.l4 + 2),
                    );
                    assert_eq!(src, t.src.unwrap_or(was.0));
                    assert_eq!(dst, t.dst.unwrap_or(was.1));
                }
            }
            let Some(emb) = emb else { continue };
            let _ = emb.flow_key();
            let mut frame = data.to_vec();
            if icmp::rewrite_error(&mut frame, &pkt, &emb, method, dir, &m, &HOP).is_err() {
                assert_eq!(frame, data, "a refused ICMP rewrite changed the frame");
            }
            let mut good = data.to_vec();
            fix(&mut good, &pkt, Some(&emb), CsumMode::Full);
            let before = good.clone();
            if icmp::rewrite_error(&mut good, &pkt, &emb, method, dir, &m, &HOP).is_ok() {
                if let Err(e) = verify(&good, &pkt, Some(&emb), CsumMode::Full) {
                    panic!("ICMP {method:?} {dir:?}: {e}");
                }
                // The quote is mirrored: its source is the translation's
                // destination and the other way round.
                let t = t.expect("a rewrite has a translation");
                let (_, _, sa, da, alen) = ip_layout(&good, emb.l3);
                let q = (
                    endpoint(&good, sa, alen, emb.l4),
                    endpoint(&good, da, alen, emb.l4 + 2),
                );
                let was = (
                    endpoint(&before, sa, alen, emb.l4),
                    endpoint(&before, da, alen, emb.l4 + 2),
                );
                assert_eq!(q.0, t.dst.unwrap_or(was.0));
                assert_eq!(q.1, t.src.unwrap_or(was.1));
            }
        }
    }
    // A packet too big for the next hop, answered in its own frame: the
    // answer parses, its checksums verify and it quotes the packet.
    if let Some(tuple) = pkt.tuple() {
        let len = pkt.end - pkt.l3;
        // IPv4's least MTU, IPv6's: the answer then quotes a whole header.
        let floor = if pkt.version == IpVersion::V4 {
            68
        } else {
            1280
        };
        let mtu = u32::from(data[data.len() - 1]) * 8 + floor;
        if (len as u32) > mtu {
            let src = match pkt.version {
                IpVersion::V4 => "203.0.113.1".parse().unwrap(),
                IpVersion::V6 => "2001:db8:ff::1".parse().unwrap(),
            };
            let mut f = data.to_vec();
            if let Ok(weir_packet::TooBig::Answer { len: n }) =
                icmp::too_big(&mut f, &pkt, mtu, src)
            {
                f.truncate(n);
                let p = parse(&f).expect("a too-big answer parses");
                assert_eq!((p.src, p.dst), (src, pkt.src));
                let e = icmp::parse_error(&f, &p)
                    .expect("a well-formed quote")
                    .expect("an ICMP error");
                assert_eq!(e.tuple, tuple);
                if let Err(why) = verify(&f, &p, None, CsumMode::Full) {
                    panic!("too big: {why}");
                }
            }
        }
    }
});

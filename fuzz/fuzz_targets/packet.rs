//! The packet core (weir-packet) on arbitrary frames: parse, then every
//! rewrite (dr, nat, fnat; both directions; full and partial checksums) and
//! the ICMP error path on whatever parses. Nothing may panic; a rewrite
//! that is refused leaves the frame unchanged.
#![no_main]

use std::net::SocketAddr;

use libfuzzer_sys::fuzz_target;
use weir_packet::{
    CsumMode, Direction, IpVersion, Method, NatMapping, NextHop, icmp, parse, rewrite,
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

fuzz_target!(|data: &[u8]| {
    let Ok(pkt) = parse(data) else { return };
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
    for method in [Method::Dr, Method::Nat, Method::Fnat] {
        for dir in [Direction::ToBackend, Direction::ToClient] {
            for mode in [CsumMode::Full, CsumMode::Partial] {
                let mut frame = data.to_vec();
                if rewrite(&mut frame, &pkt, method, dir, &m, &HOP, mode).is_err() {
                    assert_eq!(frame, data, "a refused rewrite changed the frame");
                }
            }
            if let Ok(Some(emb)) = icmp::parse_error(data, &pkt) {
                let _ = emb.flow_key();
                let mut frame = data.to_vec();
                if icmp::rewrite_error(&mut frame, &pkt, &emb, method, dir, &m, &HOP).is_err() {
                    assert_eq!(frame, data, "a refused ICMP rewrite changed the frame");
                }
            }
        }
    }
});

//! PROXY protocol headers (weir writes them; backends parse them): for any
//! pair of addresses, the header is well formed by HAProxy's spec and a
//! strict decoder written from the spec gets the same addresses back.
#![no_main]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use libfuzzer_sys::fuzz_target;
use weir::proxy_protocol::{Transport, V2_SIGNATURE, Version, header};

/// v1's longest line, CRLF included (the spec's 107 bytes).
const V1_MAX: usize = 107;

fuzz_target!(|data: &[u8]| {
    let mut bytes = data.iter().copied();
    let Some(flags) = bytes.next() else { return };
    let mut addr = |v6: bool| -> Option<SocketAddr> {
        let ip = if v6 {
            let mut o = [0u8; 16];
            for b in &mut o {
                *b = bytes.next()?;
            }
            IpAddr::V6(Ipv6Addr::from(o))
        } else {
            let mut o = [0u8; 4];
            for b in &mut o {
                *b = bytes.next()?;
            }
            IpAddr::V4(Ipv4Addr::from(o))
        };
        let port = u16::from_be_bytes([bytes.next()?, bytes.next()?]);
        Some(SocketAddr::new(ip, port))
    };
    let Some(client) = addr(flags & 1 != 0) else {
        return;
    };
    let Some(local) = addr(flags & 2 != 0) else {
        return;
    };
    let version = if flags & 4 != 0 {
        Version::V2
    } else {
        Version::V1
    };
    let transport = if flags & 8 != 0 {
        Transport::Datagram
    } else {
        Transport::Stream
    };
    if version == Version::V1 && transport == Transport::Datagram {
        return; // v1 has no UDP form; the daemon sends v2 for UDP.
    }
    let h = header(version, transport, client, local);
    let (src, dst) = match version {
        Version::V1 => decode_v1(&h),
        Version::V2 => decode_v2(&h, transport),
    };
    let mixed = client.is_ipv4() != local.is_ipv4();
    assert_eq!(src, if mixed { mapped(client) } else { client });
    assert_eq!(dst, if mixed { mapped(local) } else { local });
});

fn mapped(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V4(v4) => SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), a.port()),
        IpAddr::V6(_) => a,
    }
}

/// "PROXY TCP4|TCP6 SRC DST SPORT DPORT\r\n", at most 107 bytes.
fn decode_v1(h: &[u8]) -> (SocketAddr, SocketAddr) {
    assert!(h.len() <= V1_MAX, "v1 header of {} bytes", h.len());
    let line = std::str::from_utf8(h).expect("v1 is ASCII");
    let line = line.strip_suffix("\r\n").expect("v1 ends in CRLF");
    assert!(!line.contains(['\r', '\n']), "one line: {line:?}");
    let f: Vec<&str> = line.split(' ').collect();
    assert_eq!(f.len(), 6, "six fields: {line:?}");
    assert_eq!(f[0], "PROXY");
    let (src, dst): (IpAddr, IpAddr) = (f[2].parse().unwrap(), f[3].parse().unwrap());
    match f[1] {
        "TCP4" => assert!(src.is_ipv4() && dst.is_ipv4()),
        "TCP6" => assert!(src.is_ipv6() && dst.is_ipv6()),
        other => panic!("family {other:?}"),
    }
    // Ports are decimal without leading zeros (the spec's rule).
    for p in &f[4..6] {
        assert!(*p == "0" || !p.starts_with('0'), "port {p:?}");
    }
    (
        SocketAddr::new(src, f[4].parse().unwrap()),
        SocketAddr::new(dst, f[5].parse().unwrap()),
    )
}

fn decode_v2(h: &[u8], transport: Transport) -> (SocketAddr, SocketAddr) {
    assert!(h.len() >= 16);
    assert_eq!(h[..12], V2_SIGNATURE);
    assert_eq!(h[12], 0x21, "version 2, PROXY");
    let proto = match transport {
        Transport::Stream => 1,
        Transport::Datagram => 2,
    };
    assert_eq!(h[13] & 0x0F, proto);
    let len = usize::from(u16::from_be_bytes([h[14], h[15]]));
    assert_eq!(h.len(), 16 + len, "length field");
    let b = &h[16..];
    match h[13] >> 4 {
        1 => {
            assert_eq!(len, 12);
            let ip = |o: usize| IpAddr::V4(Ipv4Addr::new(b[o], b[o + 1], b[o + 2], b[o + 3]));
            let port = |o: usize| u16::from_be_bytes([b[o], b[o + 1]]);
            (
                SocketAddr::new(ip(0), port(8)),
                SocketAddr::new(ip(4), port(10)),
            )
        }
        2 => {
            assert_eq!(len, 36);
            let ip = |o: usize| {
                let mut a = [0u8; 16];
                a.copy_from_slice(&b[o..o + 16]);
                IpAddr::V6(Ipv6Addr::from(a))
            };
            let port = |o: usize| u16::from_be_bytes([b[o], b[o + 1]]);
            (
                SocketAddr::new(ip(0), port(32)),
                SocketAddr::new(ip(16), port(34)),
            )
        }
        fam => panic!("address family {fam}"),
    }
}

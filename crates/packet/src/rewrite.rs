//! In-place rewrites of one parsed packet for `dr`, `nat` and `fnat`.
//!
//! The building blocks are [`translate`] (set the source and/or destination
//! address and port, updating the IPv4 header checksum and the L4 checksum
//! incrementally), [`decrement_ttl`] and [`set_macs`]. [`rewrite`] combines
//! them for a forwarding [`Method`] and a [`Direction`]:
//!
//! | method | to the backend (client → VIP)              | to the client (backend's reply)            |
//! |--------|--------------------------------------------|--------------------------------------------|
//! | `dr`   | L2 only                                    | — (backends answer clients directly)      |
//! | `nat`  | dst VIP:vport → backend:port               | src backend:port → VIP:vport              |
//! | `fnat` | as nat, and src client:cport → local:lport | as nat, and dst local:lport → client:cport |
//!
//! Every method also writes the next hop's MAC addresses (the caller gets
//! them from the kernel's neighbour table) and decrements the TTL / hop
//! limit as a router does, updating the IPv4 header checksum.
//!
//! Rewrites never read or write beyond [`Packet::end`], and never panic on a
//! buffer [`crate::parse::parse`] accepted; a buffer that does not match the
//! `Packet` (shorter, or of the other IP version) is a [`RewriteError`].

use std::net::{IpAddr, SocketAddr};

use crate::checksum::{self, CsumMode};
use crate::parse::{IpVersion, Packet, Transport};

/// A MAC address.
pub type Mac = [u8; 6];

/// The forwarding method of a service (`forward = ...` in the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    /// Direct routing: only the destination MAC changes.
    Dr,
    /// Destination NAT; weir is the backends' gateway.
    Nat,
    /// Full NAT: destination and source translated.
    Fnat,
}

/// Which way a packet of a flow travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From the client (to the VIP), forwarded to the backend.
    ToBackend,
    /// A backend's reply, forwarded to the client.
    ToClient,
}

/// The four endpoints of one flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NatMapping {
    /// The client's address and port.
    pub client: SocketAddr,
    /// The virtual service address and port.
    pub vip: SocketAddr,
    /// The backend's address and port.
    pub backend: SocketAddr,
    /// fnat only: the local address and allocated port the backend sees as
    /// the source.
    pub local: Option<SocketAddr>,
}

/// New endpoints to write into a packet: `None` leaves that side as is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Translation {
    /// New source address and port.
    pub src: Option<SocketAddr>,
    /// New destination address and port.
    pub dst: Option<SocketAddr>,
}

/// The L2 addresses of the next hop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NextHop {
    /// The outgoing interface's MAC.
    pub src_mac: Mac,
    /// The next hop's (backend's, client's or router's) MAC.
    pub dst_mac: Mac,
}

/// Why a rewrite was refused. The packet is unchanged when one is returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum RewriteError {
    /// The buffer is shorter than the parsed packet says.
    #[error("buffer shorter than the parsed packet")]
    Truncated,
    /// A new address is of the other IP family than the packet (NAT64 is not
    /// supported).
    #[error("address family of the translation differs from the packet's")]
    FamilyMismatch,
    /// Address and port translation applies to TCP and UDP only.
    #[error("not a TCP or UDP packet")]
    NotTcpUdp,
    /// fnat needs a local address and port in the mapping.
    #[error("fnat mapping without a local address")]
    MissingLocal,
    /// `dr` has no reply direction: backends answer clients directly.
    #[error("dr has no reply direction")]
    NoReplyPath,
    /// The TTL / hop limit is at most 1.
    #[error("TTL or hop limit at most 1")]
    TtlExpired,
}

impl NatMapping {
    /// The translation [`rewrite`] applies for `method` and `direction`.
    pub fn translation(
        &self,
        method: Method,
        direction: Direction,
    ) -> Result<Translation, RewriteError> {
        match (method, direction) {
            (Method::Dr, Direction::ToBackend) => Ok(Translation::default()),
            (Method::Dr, Direction::ToClient) => Err(RewriteError::NoReplyPath),
            (Method::Nat, Direction::ToBackend) => Ok(Translation {
                src: None,
                dst: Some(self.backend),
            }),
            (Method::Nat, Direction::ToClient) => Ok(Translation {
                src: Some(self.vip),
                dst: None,
            }),
            (Method::Fnat, Direction::ToBackend) => Ok(Translation {
                src: Some(self.local.ok_or(RewriteError::MissingLocal)?),
                dst: Some(self.backend),
            }),
            (Method::Fnat, Direction::ToClient) => Ok(Translation {
                src: Some(self.vip),
                dst: Some(self.client),
            }),
        }
    }
}

/// Rewrites one packet of a flow in place for `method` and `direction`:
/// [`translate`] as the table in the module docs, [`decrement_ttl`], and
/// [`set_macs`]. All checks run before the first byte is written, so on an
/// error the packet is unchanged.
pub fn rewrite(
    frame: &mut [u8],
    pkt: &Packet,
    method: Method,
    direction: Direction,
    mapping: &NatMapping,
    next_hop: &NextHop,
    mode: CsumMode,
) -> Result<(), RewriteError> {
    let t = mapping.translation(method, direction)?;
    check_translation(frame, pkt, &t)?;
    if pkt.ttl <= 1 {
        return Err(RewriteError::TtlExpired);
    }
    translate_checked(frame, pkt, &t, mode);
    decrement_ttl(frame, pkt)?;
    set_macs(frame, next_hop)
}

fn check_translation(frame: &[u8], pkt: &Packet, t: &Translation) -> Result<(), RewriteError> {
    if frame.len() < pkt.end || pkt.end < pkt.l4 || pkt.l4 < pkt.l3 {
        return Err(RewriteError::Truncated);
    }
    if t.src.is_none() && t.dst.is_none() {
        return Ok(());
    }
    if pkt.transport.ports().is_none() {
        return Err(RewriteError::NotTcpUdp);
    }
    let v4 = pkt.version == IpVersion::V4;
    for a in [t.src, t.dst].into_iter().flatten() {
        if a.is_ipv4() != v4 {
            return Err(RewriteError::FamilyMismatch);
        }
    }
    let min = match pkt.transport {
        Transport::Tcp { .. } => 18,
        _ => 8,
    };
    if pkt.end - pkt.l4 < min || pkt.l4 - pkt.l3 < if v4 { 20 } else { 40 } {
        return Err(RewriteError::Truncated);
    }
    Ok(())
}

/// Offset of the L4 checksum field within the transport header.
pub(crate) fn l4_csum_offset(proto: u8) -> usize {
    if proto == crate::parse::IPPROTO_TCP {
        16
    } else {
        6
    }
}

/// Writes new source and/or destination addresses and ports, updating the
/// IPv4 header checksum and the L4 checksum incrementally (`mode`: see
/// [`crate::checksum`]). An IPv4 UDP checksum of 0 ("none") stays 0; an
/// updated UDP checksum that comes out 0 is written as 0xffff (RFC 768).
pub fn translate(
    frame: &mut [u8],
    pkt: &Packet,
    t: &Translation,
    mode: CsumMode,
) -> Result<(), RewriteError> {
    check_translation(frame, pkt, t)?;
    translate_checked(frame, pkt, t, mode);
    Ok(())
}

/// [`translate`] once [`check_translation`] has passed: `rewrite` checks
/// everything before its first write, and checking again here was a
/// tenth of a forwarded packet's instructions.
fn translate_checked(frame: &mut [u8], pkt: &Packet, t: &Translation, mode: CsumMode) {
    if t.src.is_none() && t.dst.is_none() {
        return;
    }
    let proto = pkt.transport.proto();
    let is_udp = proto == crate::parse::IPPROTO_UDP;
    let v4 = pkt.version == IpVersion::V4;
    let (l3, l4) = (pkt.l3, pkt.l4);
    let csum_at = l4 + l4_csum_offset(proto);
    let mut l4_csum = u16::from_be_bytes([frame[csum_at], frame[csum_at + 1]]);
    // IPv4 UDP without a checksum keeps none (only meaningful in Full mode).
    let touch_l4 = !(is_udp && v4 && l4_csum == 0 && mode == CsumMode::Full);
    let (src_at, dst_at, alen) = if v4 {
        (l3 + 12, l3 + 16, 4)
    } else {
        (l3 + 8, l3 + 24, 16)
    };
    let mut ip_csum = if v4 {
        u16::from_be_bytes([frame[l3 + 10], frame[l3 + 11]])
    } else {
        0
    };
    for (new, addr_at, port_at) in [(t.src, src_at, l4), (t.dst, dst_at, l4 + 2)] {
        let Some(new) = new else { continue };
        let new_ip = ip_bytes(new.ip());
        let old_sum = checksum::addr_sum(&frame[addr_at..addr_at + alen]);
        let new_sum = checksum::addr_sum(&new_ip[..alen]);
        if v4 {
            ip_csum = checksum::update(ip_csum, old_sum, new_sum, CsumMode::Full);
        }
        if touch_l4 {
            l4_csum = checksum::update(l4_csum, old_sum, new_sum, mode);
        }
        frame[addr_at..addr_at + alen].copy_from_slice(&new_ip[..alen]);
        let old_port = u16::from_be_bytes([frame[port_at], frame[port_at + 1]]);
        if touch_l4 && mode == CsumMode::Full {
            l4_csum = checksum::update16(l4_csum, old_port, new.port(), mode);
        }
        frame[port_at..port_at + 2].copy_from_slice(&new.port().to_be_bytes());
    }
    if v4 {
        frame[l3 + 10..l3 + 12].copy_from_slice(&ip_csum.to_be_bytes());
    }
    if touch_l4 {
        if is_udp && l4_csum == 0 && mode == CsumMode::Full {
            l4_csum = 0xffff;
        }
        frame[csum_at..csum_at + 2].copy_from_slice(&l4_csum.to_be_bytes());
    }
}

/// The address as 16 bytes (an IPv4 address in the first 4).
pub(crate) fn ip_bytes(ip: IpAddr) -> [u8; 16] {
    let mut out = [0u8; 16];
    match ip {
        IpAddr::V4(a) => out[..4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => out = a.octets(),
    }
    out
}

/// Decrements the TTL (IPv4, updating the header checksum) or the hop limit
/// (IPv6). Refuses, unchanged, a packet whose TTL is at most 1.
pub fn decrement_ttl(frame: &mut [u8], pkt: &Packet) -> Result<(), RewriteError> {
    let v4 = pkt.version == IpVersion::V4;
    let ttl_at = pkt.l3 + if v4 { 8 } else { 7 };
    let hdr_end = pkt.l3 + if v4 { 20 } else { 40 };
    if frame.len() < hdr_end {
        return Err(RewriteError::Truncated);
    }
    let ttl = frame[ttl_at];
    if ttl <= 1 {
        return Err(RewriteError::TtlExpired);
    }
    frame[ttl_at] = ttl - 1;
    if v4 {
        // TTL is the high byte of the TTL/protocol word.
        let proto = frame[ttl_at + 1];
        let old = u16::from_be_bytes([ttl, proto]);
        let new = u16::from_be_bytes([ttl - 1, proto]);
        let c = u16::from_be_bytes([frame[pkt.l3 + 10], frame[pkt.l3 + 11]]);
        let c = checksum::update16(c, old, new, CsumMode::Full);
        frame[pkt.l3 + 10..pkt.l3 + 12].copy_from_slice(&c.to_be_bytes());
    }
    Ok(())
}

/// Writes the destination and source MAC addresses.
pub fn set_macs(frame: &mut [u8], next_hop: &NextHop) -> Result<(), RewriteError> {
    let eth = frame.get_mut(..12).ok_or(RewriteError::Truncated)?;
    eth[..6].copy_from_slice(&next_hop.dst_mac);
    eth[6..12].copy_from_slice(&next_hop.src_mac);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::{IPPROTO_TCP, IPPROTO_UDP, parse};
    use crate::testutil::{HOP, Spec, build, mapping4, sa, verify};
    use proptest::prelude::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn nat_and_fnat_v4_tcp_both_ways() {
        let m = mapping4();
        let cases = [
            (
                Method::Nat,
                Direction::ToBackend,
                m.client,
                m.vip,
                m.client,
                m.backend,
            ),
            (
                Method::Nat,
                Direction::ToClient,
                m.backend,
                m.client,
                m.vip,
                m.client,
            ),
            (
                Method::Fnat,
                Direction::ToBackend,
                m.client,
                m.vip,
                sa("10.0.1.1:50001"),
                m.backend,
            ),
            (
                Method::Fnat,
                Direction::ToClient,
                m.backend,
                sa("10.0.1.1:50001"),
                m.vip,
                m.client,
            ),
            (
                Method::Dr,
                Direction::ToBackend,
                m.client,
                m.vip,
                m.client,
                m.vip,
            ),
        ];
        for (method, dir, src, dst, want_src, want_dst) in cases {
            let mut f = build(&Spec::new(IPPROTO_TCP, src, dst));
            let p = parse(&f).expect("valid");
            rewrite(&mut f, &p, method, dir, &m, &HOP, CsumMode::Full).expect("rewrite");
            verify(&f, CsumMode::Full).expect("checksums");
            let q = parse(&f).expect("still valid");
            let t = q.tuple().expect("tcp");
            assert_eq!((t.src, t.dst), (want_src, want_dst), "{method:?} {dir:?}");
            assert_eq!(q.ttl, 63);
            assert_eq!(&f[..6], &HOP.dst_mac);
            assert_eq!(&f[6..12], &HOP.src_mac);
        }
    }

    #[test]
    fn udp_v4_without_checksum_keeps_none() {
        let m = mapping4();
        let mut s = Spec::new(IPPROTO_UDP, m.client, m.vip);
        s.udp_no_csum = true;
        let mut f = build(&s);
        let p = parse(&f).expect("valid");
        rewrite(
            &mut f,
            &p,
            Method::Fnat,
            Direction::ToBackend,
            &m,
            &HOP,
            CsumMode::Full,
        )
        .expect("rewrite");
        assert_eq!(&f[p.l4 + 6..p.l4 + 8], &[0, 0]);
        verify(&f, CsumMode::Full).expect("ip checksum");
    }

    /// A rewrite whose new checksum computes to 0: UDP sends it as 0xffff
    /// (0 means "no checksum"), TCP as 0.
    #[test]
    fn computed_zero_checksum() {
        let m = mapping4();
        for (proto, want) in [(IPPROTO_UDP, 0xffff), (IPPROTO_TCP, 0)] {
            let mut f = build(&Spec::new(proto, m.client, m.vip));
            let p = parse(&f).expect("valid");
            let at = p.l4 + l4_csum_offset(proto);
            let hc = u16::from_be_bytes([f[at], f[at + 1]]);
            // The port m' with ~HC + ~m + m' = 0xffff, i.e. HC' = 0.
            let port = !checksum::add(!hc, !m.vip.port());
            let t = Translation {
                src: None,
                dst: Some(SocketAddr::new(m.vip.ip(), port)),
            };
            translate(&mut f, &p, &t, CsumMode::Full).expect("translate");
            assert_eq!(
                u16::from_be_bytes([f[at], f[at + 1]]),
                want,
                "proto {proto}"
            );
            verify(&f, CsumMode::Full).expect("checksums");
        }
    }

    #[test]
    fn partial_mode_ignores_ports_but_folds_addresses() {
        let m = mapping4();
        let mut s = Spec::new(IPPROTO_TCP, m.client, m.vip);
        s.mode = CsumMode::Partial;
        let mut f = build(&s);
        let p = parse(&f).expect("valid");
        // A port-only change leaves a partial checksum as it is.
        let before = f.clone();
        let t = Translation {
            src: None,
            dst: Some(SocketAddr::new(m.vip.ip(), 81)),
        };
        translate(&mut f, &p, &t, CsumMode::Partial).expect("translate");
        assert_eq!(&f[p.l4 + 16..p.l4 + 18], &before[p.l4 + 16..p.l4 + 18]);
        // An address change moves it to the new pseudo-header sum.
        rewrite(
            &mut f,
            &p,
            Method::Nat,
            Direction::ToBackend,
            &m,
            &HOP,
            CsumMode::Partial,
        )
        .expect("rewrite");
        assert_ne!(&f[p.l4 + 16..p.l4 + 18], &before[p.l4 + 16..p.l4 + 18]);
        verify(&f, CsumMode::Partial).expect("pseudo-header sum");
    }

    #[test]
    fn refusals_leave_the_frame_unchanged() {
        let m = mapping4();
        let f0 = build(&Spec::new(IPPROTO_TCP, m.client, m.vip));
        let p = parse(&f0).expect("valid");
        let mut f = f0.clone();
        let r = |f: &mut Vec<u8>, method, dir, m: &NatMapping| {
            rewrite(f, &p, method, dir, m, &HOP, CsumMode::Full)
        };
        assert_eq!(
            r(&mut f, Method::Dr, Direction::ToClient, &m),
            Err(RewriteError::NoReplyPath)
        );
        let no_local = NatMapping { local: None, ..m };
        assert_eq!(
            r(&mut f, Method::Fnat, Direction::ToBackend, &no_local),
            Err(RewriteError::MissingLocal)
        );
        let v6 = NatMapping {
            backend: sa("[2001:db8::2]:80"),
            ..m
        };
        assert_eq!(
            r(&mut f, Method::Nat, Direction::ToBackend, &v6),
            Err(RewriteError::FamilyMismatch)
        );
        let mut low = p;
        low.ttl = 1;
        assert_eq!(
            rewrite(
                &mut f,
                &low,
                Method::Nat,
                Direction::ToBackend,
                &m,
                &HOP,
                CsumMode::Full
            ),
            Err(RewriteError::TtlExpired)
        );
        assert_eq!(
            rewrite(
                &mut f[..p.end - 1],
                &p,
                Method::Nat,
                Direction::ToBackend,
                &m,
                &HOP,
                CsumMode::Full
            ),
            Err(RewriteError::Truncated)
        );
        assert_eq!(f, f0);
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

    #[derive(Debug, Clone)]
    struct Case {
        spec: Spec,
        mapping: NatMapping,
        method: Method,
        dir: Direction,
    }

    fn case() -> impl Strategy<Value = Case> {
        (
            any::<bool>(),
            any::<bool>(),
            0..3u8,
            any::<bool>(),
            any::<bool>(),
        )
            .prop_flat_map(|(v6, udp, method, to_client, partial)| {
                let method = [Method::Dr, Method::Nat, Method::Fnat][usize::from(method)];
                let dir = if to_client && method != Method::Dr {
                    Direction::ToClient
                } else {
                    Direction::ToBackend
                };
                (
                    [endpoint(v6), endpoint(v6), endpoint(v6), endpoint(v6)],
                    proptest::collection::vec(any::<u8>(), 0..300),
                    3..=255u8, // stays ≥ 2 after the decrement, so it re-parses
                    any::<u8>(),
                    0..=10usize,
                    any::<bool>(),
                    proptest::option::of(0..4096u16),
                    any::<(u8, u16)>(),
                )
                    .prop_map(
                        move |(
                            [client, vip, backend, local],
                            payload,
                            ttl,
                            flags,
                            opts,
                            no_csum,
                            vlan,
                            (tos, id),
                        )| {
                            let mapping = NatMapping {
                                client,
                                vip,
                                backend,
                                local: Some(local),
                            };
                            let (src, dst) = match (dir, method) {
                                (Direction::ToBackend, _) => (client, vip),
                                (Direction::ToClient, Method::Fnat) => (backend, local),
                                (Direction::ToClient, _) => (backend, client),
                            };
                            let proto = if udp { IPPROTO_UDP } else { IPPROTO_TCP };
                            let mut spec = Spec::new(proto, src, dst);
                            spec.payload = payload;
                            spec.ttl = ttl;
                            spec.tcp_flags = flags;
                            spec.tcp_opts = opts * 4;
                            spec.mode = if partial {
                                CsumMode::Partial
                            } else {
                                CsumMode::Full
                            };
                            spec.udp_no_csum = no_csum && !partial;
                            spec.vlan = vlan;
                            spec.tos = tos;
                            spec.id = id;
                            Case {
                                spec,
                                mapping,
                                method,
                                dir,
                            }
                        },
                    )
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Every method × v4/v6 × tcp/udp × direction × checksum mode: the
        /// incrementally updated checksums equal the ones recomputed from
        /// scratch, and the tuple is the one the method promises.
        #[test]
        fn incremental_checksums_match_recomputed(c in case()) {
            let mut f = build(&c.spec);
            let p = parse(&f).expect("built frames parse");
            rewrite(&mut f, &p, c.method, c.dir, &c.mapping, &HOP, c.spec.mode).expect("rewrite");
            if let Err(e) = verify(&f, c.spec.mode) {
                return Err(TestCaseError::fail(e));
            }
            let q = parse(&f).expect("rewritten frames parse");
            let t = c.mapping.translation(c.method, c.dir).expect("translation");
            let tuple = q.tuple().expect("tcp/udp");
            prop_assert_eq!(tuple.src, t.src.unwrap_or(c.spec.src));
            prop_assert_eq!(tuple.dst, t.dst.unwrap_or(c.spec.dst));
            prop_assert_eq!(q.ttl, c.spec.ttl - 1);
        }

        /// A rewrite followed by the reverse translation restores every byte
        /// but the TTL (and the IPv4 header checksum that covers it) and the
        /// MACs.
        #[test]
        fn reverse_rewrite_restores_the_packet(c in case()) {
            let orig = build(&c.spec);
            let mut f = orig.clone();
            let p = parse(&f).expect("built frames parse");
            rewrite(&mut f, &p, c.method, c.dir, &c.mapping, &HOP, c.spec.mode).expect("rewrite");
            let back = Translation { src: Some(c.spec.src), dst: Some(c.spec.dst) };
            let q = parse(&f).expect("rewritten frames parse");
            translate(&mut f, &q, &back, c.spec.mode).expect("reverse");
            if let Err(e) = verify(&f, c.spec.mode) {
                return Err(TestCaseError::fail(e));
            }
            let ttl_at = p.l3 + if p.version == IpVersion::V4 { 8 } else { 7 };
            prop_assert_eq!(f[ttl_at], orig[ttl_at] - 1);
            f[..12].copy_from_slice(&orig[..12]);
            f[ttl_at] = orig[ttl_at];
            if p.version == IpVersion::V4 {
                f[p.l3 + 10..p.l3 + 12].copy_from_slice(&orig[p.l3 + 10..p.l3 + 12]);
            }
            prop_assert_eq!(f, orig);
        }
    }
}

//! Next hops from the kernel's routing and neighbour tables (rtnetlink).
//!
//! weir transmits rewritten frames itself, so it needs what the kernel's
//! stack would have used: the egress interface and the route's gateway
//! (`RTM_GETROUTE` for the destination, as `ip route get`), the neighbour's
//! MAC for the gateway or, on a directly connected route, the destination
//! itself (`RTM_GETNEIGH`, as `ip neigh get`), and the interface's own MAC
//! (`RTM_GETLINK`). Nothing comes from the configuration.
//!
//! * [`Netlink`] asks the kernel, synchronously, one request at a time, on a
//!   plain `NETLINK_ROUTE` socket (`netlink-sys` without an async runtime;
//!   messages built and parsed by `netlink-packet-route`, both MIT).
//! * [`NextHopCache`] is I/O-free: the caller passes `now`, entries expire
//!   after a fixed time (resolved and unresolved apart), and
//!   [`NextHopCache::invalidate`]/[`NextHopCache::clear`] drop them early.
//! * [`Resolver`] puts the two together: [`Resolver::resolve`] answers from the
//!   cache and asks the kernel only on a miss or an expired entry, so the data
//!   path makes no syscall per packet.
//!
//! An unknown or incomplete neighbour is [`Resolution::Unresolved`]: drop the
//! frame, count it, and try again later. The resolver then asks the kernel to
//! resolve it — an `RTM_NEWNEIGH` with `NTF_USE`, which makes the kernel act as
//! if it had a packet to send there (it creates the entry if needed and sends
//! an ARP request or neighbour solicitation) without sending any datagram — at
//! most once per unresolved-entry lifetime. The same request revalidates a
//! `STALE` entry: the kernel never sees weir's traffic, so it would not
//! confirm the neighbour by itself.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::link::{LinkAttribute, LinkMessage};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteType};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
use weir_packet::{Mac, NextHop};

/// Errors of talking to the kernel. A destination the kernel cannot route is
/// not an error but [`Resolution::NoRoute`].
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The netlink socket could not be opened or bound.
    #[error("opening a netlink route socket: {0}")]
    Open(std::io::Error),
    /// Sending a request or receiving its answer failed.
    #[error("netlink {op}: {source}")]
    Io {
        /// The request (`RTM_GETROUTE`, ...).
        op: &'static str,
        /// What the socket said.
        source: std::io::Error,
    },
    /// The kernel refused a request for a reason other than "no such entry".
    #[error("netlink {op}: the kernel said {source}")]
    Kernel {
        /// The request.
        op: &'static str,
        /// The errno the kernel answered, as an I/O error.
        source: std::io::Error,
    },
    /// An answer did not parse, or did not answer the request.
    #[error("netlink {op}: unexpected answer: {what}")]
    Answer {
        /// The request.
        op: &'static str,
        /// What was wrong with it.
        what: String,
    },
}

/// The route the kernel would use for a destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// The egress interface's index.
    pub ifindex: u32,
    /// The gateway, or `None` on a directly connected route.
    pub gateway: Option<IpAddr>,
}

impl Route {
    /// Whose MAC a frame to `dst` on this route carries: the gateway's, or
    /// `dst`'s own on a directly connected route.
    pub fn neighbour(&self, dst: IpAddr) -> IpAddr {
        self.gateway.unwrap_or(dst)
    }
}

/// What a route lookup found instead of a usable unicast route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRoute {
    /// No route (`ENETUNREACH`, `EHOSTUNREACH`), or an `unreachable` or
    /// `prohibit` route.
    Unreachable,
    /// A `blackhole` route.
    Blackhole,
    /// The destination is one of this host's addresses (or broadcast,
    /// multicast, anycast): not forwarded.
    Local,
    /// The route leaves by an interface without an Ethernet address
    /// (loopback, a tunnel): weir cannot write a frame for it.
    NotEthernet {
        /// The interface.
        ifindex: u32,
    },
}

/// Where a frame to one destination goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// Ready: transmit on `ifindex` with these MACs.
    Resolved {
        /// The egress interface.
        ifindex: u32,
        /// The gateway or the destination itself.
        neighbour: IpAddr,
        /// The interface's MAC (source) and the neighbour's (destination).
        next_hop: NextHop,
    },
    /// The route is known but the neighbour's MAC is not (yet): drop the
    /// frame, count it, and retry after the resolution the resolver started.
    Unresolved {
        /// The egress interface.
        ifindex: u32,
        /// The gateway or the destination itself.
        neighbour: IpAddr,
    },
    /// Not forwardable (see [`NoRoute`]): drop and count.
    NoRoute(NoRoute),
}

/// A neighbour table entry's link-layer address, if usable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Neighbour {
    /// Reachable, or stale/delay/probe (usable while the kernel revalidates),
    /// or permanent.
    Known {
        /// The MAC.
        mac: Mac,
        /// The kernel has not confirmed it recently (`STALE`, `DELAY`,
        /// `PROBE`): worth a revalidation request.
        stale: bool,
    },
    /// No entry, or an incomplete or failed one.
    Unknown,
}

/// A synchronous `NETLINK_ROUTE` client for the three lookups and the
/// resolution request. One request in flight at a time; every answer is
/// waited for (the kernel answers these at once).
#[derive(Debug)]
pub struct Netlink {
    socket: Socket,
    seq: u32,
    buf: Vec<u8>,
}

/// Most datagrams read for one answer (a get answers with one message and an
/// acknowledgement).
const MAX_ANSWER_DATAGRAMS: usize = 16;

impl Netlink {
    /// Opens a route socket in the calling thread's network namespace.
    pub fn open() -> Result<Self, ResolveError> {
        let mut socket = Socket::new(NETLINK_ROUTE).map_err(ResolveError::Open)?;
        socket.bind_auto().map_err(ResolveError::Open)?;
        socket
            .connect(&SocketAddr::new(0, 0))
            .map_err(ResolveError::Open)?;
        Ok(Self {
            socket,
            seq: 0,
            buf: Vec::with_capacity(64 * 1024),
        })
    }

    /// The route the kernel uses for `dst` (`ip route get dst`).
    pub fn route(&mut self, dst: IpAddr) -> Result<Result<Route, NoRoute>, ResolveError> {
        const OP: &str = "RTM_GETROUTE";
        let mut msg = RouteMessage::default();
        msg.header.address_family = family(dst);
        msg.header.destination_prefix_length = if dst.is_ipv4() { 32 } else { 128 };
        msg.attributes
            .push(RouteAttribute::Destination(RouteAddress::from(dst)));
        let answers = match self.request(OP, RouteNetlinkMessage::GetRoute(msg), 0) {
            Ok(a) => a,
            // IPv4 answers a route of those types with the errno of the
            // kernel's `fib_props` table rather than the route.
            Err(ResolveError::Kernel { source, .. }) => match source.raw_os_error() {
                Some(libc::ENETUNREACH | libc::EHOSTUNREACH | libc::EACCES) => {
                    return Ok(Err(NoRoute::Unreachable));
                }
                // The request is well formed by construction: EINVAL is
                // what a blackhole route answers.
                Some(libc::EINVAL) => return Ok(Err(NoRoute::Blackhole)),
                _ => return Err(ResolveError::Kernel { op: OP, source }),
            },
            Err(e) => return Err(e),
        };
        let Some(RouteNetlinkMessage::NewRoute(route)) = answers.into_iter().next() else {
            return Err(answer(OP, "no route message"));
        };
        match route.header.kind {
            RouteType::Unicast => {}
            RouteType::BlackHole => return Ok(Err(NoRoute::Blackhole)),
            RouteType::Unreachable | RouteType::Prohibit | RouteType::Throw => {
                return Ok(Err(NoRoute::Unreachable));
            }
            _ => return Ok(Err(NoRoute::Local)),
        }
        let mut ifindex = None;
        let mut gateway = None;
        for attr in route.attributes {
            match attr {
                RouteAttribute::Oif(i) => ifindex = Some(i),
                RouteAttribute::Gateway(a) => gateway = route_ip(a),
                // An IPv4 route via an IPv6 gateway (RFC 5549).
                RouteAttribute::Via(v) => gateway = via_ip(&v),
                _ => {}
            }
        }
        let ifindex = ifindex.ok_or_else(|| answer(OP, "no output interface"))?;
        Ok(Ok(Route { ifindex, gateway }))
    }

    /// The neighbour table's entry for `addr` on `ifindex` (`ip neigh get`).
    pub fn neighbour(&mut self, ifindex: u32, addr: IpAddr) -> Result<Neighbour, ResolveError> {
        const OP: &str = "RTM_GETNEIGH";
        let mut msg = NeighbourMessage::default();
        msg.header.family = family(addr);
        msg.header.ifindex = ifindex;
        msg.attributes
            .push(NeighbourAttribute::Destination(neighbour_address(addr)));
        let answers = match self.request(OP, RouteNetlinkMessage::GetNeighbour(msg), 0) {
            Ok(a) => a,
            Err(ResolveError::Kernel { source, .. })
                if source.raw_os_error() == Some(libc::ENOENT) =>
            {
                return Ok(Neighbour::Unknown);
            }
            Err(e) => return Err(e),
        };
        let Some(RouteNetlinkMessage::NewNeighbour(n)) = answers.into_iter().next() else {
            return Err(answer(OP, "no neighbour message"));
        };
        let stale = match n.header.state {
            NeighbourState::Reachable | NeighbourState::Permanent | NeighbourState::Noarp => false,
            NeighbourState::Stale | NeighbourState::Delay | NeighbourState::Probe => true,
            _ => return Ok(Neighbour::Unknown),
        };
        let mac = n.attributes.iter().find_map(|a| match a {
            NeighbourAttribute::LinkLayerAddress(l) => <Mac>::try_from(l.as_slice()).ok(),
            _ => None,
        });
        Ok(match mac {
            Some(mac) => Neighbour::Known { mac, stale },
            None => Neighbour::Unknown,
        })
    }

    /// The MAC of interface `ifindex`; `None` if it has no 6-byte address.
    pub fn link_mac(&mut self, ifindex: u32) -> Result<Option<Mac>, ResolveError> {
        const OP: &str = "RTM_GETLINK";
        let mut msg = LinkMessage::default();
        msg.header.index = ifindex;
        let answers = self.request(OP, RouteNetlinkMessage::GetLink(msg), 0)?;
        let Some(RouteNetlinkMessage::NewLink(link)) = answers.into_iter().next() else {
            return Err(answer(OP, "no link message"));
        };
        Ok(link.attributes.iter().find_map(|a| match a {
            LinkAttribute::Address(l) => {
                <Mac>::try_from(l.as_slice()).ok().filter(|m| m != &[0; 6])
            }
            _ => None,
        }))
    }

    /// Asks the kernel to resolve (or revalidate) `addr` on `ifindex` as if
    /// it had a packet to send there: `RTM_NEWNEIGH` with `NTF_USE`, which
    /// creates the entry if needed and sends an ARP request or neighbour
    /// solicitation. Sends no datagram and does not wait for the answer.
    pub fn solicit(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), ResolveError> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = family(addr);
        msg.header.ifindex = ifindex;
        msg.header.flags = NeighbourFlags::Use;
        msg.attributes
            .push(NeighbourAttribute::Destination(neighbour_address(addr)));
        self.request(
            "RTM_NEWNEIGH",
            RouteNetlinkMessage::NewNeighbour(msg),
            NLM_F_CREATE,
        )?;
        Ok(())
    }

    /// Sends `msg` with an acknowledgement requested and returns the
    /// messages that answer it, up to the acknowledgement.
    fn request(
        &mut self,
        op: &'static str,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> Result<Vec<RouteNetlinkMessage>, ResolveError> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        header.sequence_number = seq;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(msg));
        packet.finalize();
        let mut out = vec![0; packet.buffer_len()];
        packet.serialize(&mut out);
        self.socket
            .send(&out, 0)
            .map_err(|source| ResolveError::Io { op, source })?;

        let mut answers = Vec::new();
        for _ in 0..MAX_ANSWER_DATAGRAMS {
            self.buf.clear();
            let n = self
                .socket
                .recv(&mut self.buf, 0)
                .map_err(|source| ResolveError::Io { op, source })?;
            if n > self.buf.len() {
                return Err(answer(op, "truncated datagram"));
            }
            let mut at = 0;
            while at < self.buf.len() {
                let parsed = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&self.buf[at..])
                    .map_err(|e| answer(op, &e.to_string()))?;
                let len = parsed.header.length as usize;
                if len == 0 {
                    return Err(answer(op, "zero-length message"));
                }
                at += len.next_multiple_of(4);
                if parsed.header.sequence_number != seq {
                    continue; // an answer to an earlier, abandoned request
                }
                match parsed.payload {
                    NetlinkPayload::InnerMessage(m) => answers.push(m),
                    NetlinkPayload::Error(e) => {
                        return match e.code {
                            None => Ok(answers),
                            Some(code) => Err(ResolveError::Kernel {
                                op,
                                source: std::io::Error::from_raw_os_error(-code.get()),
                            }),
                        };
                    }
                    NetlinkPayload::Done(_) => return Ok(answers),
                    _ => {}
                }
            }
        }
        Err(answer(op, "no acknowledgement"))
    }
}

fn answer(op: &'static str, what: &str) -> ResolveError {
    ResolveError::Answer {
        op,
        what: what.to_owned(),
    }
}

fn family(ip: IpAddr) -> AddressFamily {
    if ip.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}

fn neighbour_address(ip: IpAddr) -> NeighbourAddress {
    match ip {
        IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
        IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
    }
}

fn route_ip(a: RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(v6)),
        _ => None,
    }
}

fn via_ip(v: &netlink_packet_route::route::RouteVia) -> Option<IpAddr> {
    use netlink_packet_route::route::RouteVia;
    match v {
        RouteVia::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteVia::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

/// How long [`NextHopCache`] keeps answers.
#[derive(Debug, Clone, Copy)]
pub struct CacheConfig {
    /// A resolved destination is asked again after this long (so a changed
    /// route or neighbour MAC is seen within it). Default 1 s.
    pub resolved_ttl: Duration,
    /// An unresolved or unroutable destination is asked again after this
    /// long; meanwhile its frames are dropped without a syscall. Default
    /// 100 ms.
    pub unresolved_ttl: Duration,
    /// Most destinations held; a full cache empties itself before the next
    /// insert (amortised O(1) per insert; the destinations in use are asked
    /// again once). Default 65,536.
    pub capacity: usize,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            resolved_ttl: Duration::from_secs(1),
            unresolved_ttl: Duration::from_millis(100),
            capacity: 65_536,
        }
    }
}

/// Answers per destination until they expire. I/O-free: the caller passes
/// `now`. Keyed with SipHash (std's `RandomState`): destinations are
/// addresses peers choose.
#[derive(Debug)]
pub struct NextHopCache {
    config: CacheConfig,
    entries: HashMap<IpAddr, (Resolution, Instant)>,
}

impl NextHopCache {
    /// An empty cache. A zero `capacity` is taken as 1.
    pub fn new(config: CacheConfig) -> Self {
        Self {
            config: CacheConfig {
                capacity: config.capacity.max(1),
                ..config
            },
            entries: HashMap::new(),
        }
    }

    /// The answer for `dst` if it has not expired at `now`.
    pub fn get(&self, dst: IpAddr, now: Instant) -> Option<Resolution> {
        self.entries
            .get(&dst)
            .filter(|(_, expires)| now < *expires)
            .map(|(r, _)| *r)
    }

    /// Stores `resolution` for `dst` as of `now`; it expires after the
    /// resolved or the unresolved lifetime.
    pub fn insert(&mut self, dst: IpAddr, resolution: Resolution, now: Instant) {
        let ttl = match resolution {
            Resolution::Resolved { .. } => self.config.resolved_ttl,
            _ => self.config.unresolved_ttl,
        };
        if self.entries.len() >= self.config.capacity && !self.entries.contains_key(&dst) {
            self.entries.clear();
        }
        self.entries.insert(dst, (resolution, now + ttl));
    }

    /// Forgets `dst` (its next lookup asks the kernel).
    pub fn invalidate(&mut self, dst: IpAddr) {
        self.entries.remove(&dst);
    }

    /// Forgets every destination whose answer went through `ifindex` (an
    /// interface went down or changed its address).
    pub fn invalidate_interface(&mut self, ifindex: u32) {
        self.entries.retain(|_, (r, _)| match r {
            Resolution::Resolved { ifindex: i, .. } | Resolution::Unresolved { ifindex: i, .. } => {
                *i != ifindex
            }
            Resolution::NoRoute(_) => true,
        });
    }

    /// Forgets everything (a routing change).
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Destinations held (expired ones included until replaced).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True if nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// [`Netlink`] behind a [`NextHopCache`]: what the data path calls.
#[derive(Debug)]
pub struct Resolver {
    netlink: Netlink,
    cache: NextHopCache,
}

impl Resolver {
    /// Opens a route socket in the calling thread's network namespace.
    pub fn new(config: CacheConfig) -> Result<Self, ResolveError> {
        Ok(Self {
            netlink: Netlink::open()?,
            cache: NextHopCache::new(config),
        })
    }

    /// Where a frame to `dst` goes, from the cache if the answer there is
    /// current at `now`, else from the kernel (three requests at most: route,
    /// neighbour, interface). An unresolved neighbour makes the kernel start
    /// resolving it ([`Netlink::solicit`]); a stale one is revalidated the
    /// same way while its MAC is used.
    pub fn resolve(&mut self, dst: IpAddr, now: Instant) -> Result<Resolution, ResolveError> {
        if let Some(r) = self.cache.get(dst, now) {
            return Ok(r);
        }
        let r = self.ask_kernel(dst)?;
        self.cache.insert(dst, r, now);
        Ok(r)
    }

    fn ask_kernel(&mut self, dst: IpAddr) -> Result<Resolution, ResolveError> {
        let route = match self.netlink.route(dst)? {
            Ok(route) => route,
            Err(no) => return Ok(Resolution::NoRoute(no)),
        };
        let ifindex = route.ifindex;
        let Some(src_mac) = self.netlink.link_mac(ifindex)? else {
            return Ok(Resolution::NoRoute(NoRoute::NotEthernet { ifindex }));
        };
        let neighbour = route.neighbour(dst);
        match self.netlink.neighbour(ifindex, neighbour)? {
            Neighbour::Known { mac, stale } => {
                if stale {
                    self.netlink.solicit(ifindex, neighbour)?;
                }
                Ok(Resolution::Resolved {
                    ifindex,
                    neighbour,
                    next_hop: NextHop {
                        src_mac,
                        dst_mac: mac,
                    },
                })
            }
            Neighbour::Unknown => {
                self.netlink.solicit(ifindex, neighbour)?;
                Ok(Resolution::Unresolved { ifindex, neighbour })
            }
        }
    }

    /// The cache, to invalidate entries.
    pub fn cache_mut(&mut self) -> &mut NextHopCache {
        &mut self.cache
    }

    /// The netlink client, for direct lookups.
    pub fn netlink_mut(&mut self) -> &mut Netlink {
        &mut self.netlink
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolved(last: u8) -> Resolution {
        Resolution::Resolved {
            ifindex: 2,
            neighbour: IpAddr::from([192, 0, 2, last]),
            next_hop: NextHop {
                src_mac: [2, 0, 0, 0, 0, 1],
                dst_mac: [2, 0, 0, 0, 0, last],
            },
        }
    }

    #[test]
    fn cache_entries_expire_after_their_lifetime() {
        let config = CacheConfig {
            resolved_ttl: Duration::from_secs(1),
            unresolved_ttl: Duration::from_millis(100),
            capacity: 8,
        };
        let mut cache = NextHopCache::new(config);
        let t0 = Instant::now();
        let (a, b) = (IpAddr::from([192, 0, 2, 7]), IpAddr::from([192, 0, 2, 8]));
        let unresolved = Resolution::Unresolved {
            ifindex: 2,
            neighbour: b,
        };
        cache.insert(a, resolved(7), t0);
        cache.insert(b, unresolved, t0);
        let at = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(cache.get(a, at(99)), Some(resolved(7)));
        assert_eq!(cache.get(b, at(99)), Some(unresolved));
        assert_eq!(cache.get(b, at(100)), None, "unresolved expires first");
        assert_eq!(cache.get(a, at(999)), Some(resolved(7)));
        assert_eq!(cache.get(a, at(1000)), None);
        // A fresh answer replaces an expired one.
        cache.insert(b, resolved(8), at(100));
        assert_eq!(cache.get(b, at(1099)), Some(resolved(8)));
        assert_eq!(cache.get(IpAddr::from([192, 0, 2, 9]), t0), None);
    }

    #[test]
    fn invalidation_forgets_one_destination_an_interface_or_all() {
        let mut cache = NextHopCache::new(CacheConfig::default());
        let t0 = Instant::now();
        let dst = |n: u8| IpAddr::from([198, 51, 100, n]);
        cache.insert(dst(1), resolved(1), t0);
        cache.insert(
            dst(2),
            Resolution::Unresolved {
                ifindex: 3,
                neighbour: dst(2),
            },
            t0,
        );
        cache.insert(dst(3), Resolution::NoRoute(NoRoute::Blackhole), t0);
        cache.insert(dst(4), resolved(4), t0);
        cache.invalidate(dst(4));
        assert_eq!(cache.get(dst(4), t0), None);
        assert_eq!(cache.len(), 3);
        cache.invalidate_interface(3);
        assert_eq!(cache.get(dst(2), t0), None);
        assert_eq!(cache.get(dst(1), t0), Some(resolved(1)));
        assert_eq!(
            cache.get(dst(3), t0),
            Some(Resolution::NoRoute(NoRoute::Blackhole))
        );
        cache.clear();
        assert!(cache.is_empty());
    }

    #[test]
    fn a_full_cache_empties_itself_before_the_next_new_destination() {
        let mut cache = NextHopCache::new(CacheConfig {
            capacity: 4,
            ..CacheConfig::default()
        });
        let t0 = Instant::now();
        for n in 0..4 {
            cache.insert(IpAddr::from([10, 0, 0, n]), resolved(n), t0);
        }
        assert_eq!(cache.len(), 4);
        // Replacing a held destination does not count as new.
        cache.insert(IpAddr::from([10, 0, 0, 0]), resolved(9), t0);
        assert_eq!(cache.len(), 4);
        cache.insert(IpAddr::from([10, 0, 0, 4]), resolved(4), t0);
        assert_eq!(cache.len(), 1);
        assert_eq!(
            cache.get(IpAddr::from([10, 0, 0, 4]), t0),
            Some(resolved(4))
        );
        // Capacity 0 is taken as 1 rather than refusing every insert.
        let mut tiny = NextHopCache::new(CacheConfig {
            capacity: 0,
            ..CacheConfig::default()
        });
        tiny.insert(IpAddr::from([10, 0, 0, 1]), resolved(1), t0);
        assert_eq!(tiny.len(), 1);
    }
}

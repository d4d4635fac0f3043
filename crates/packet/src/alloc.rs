//! fnat source-port allocation, one [`PortAllocator`] per (local address,
//! backend), and [`FnatPorts`] over all local addresses.
//!
//! Under full NAT a flow leaves weir as `local:lport → backend:bport` and the
//! backend's replies come back to `local:lport`, so `lport` names the flow on
//! the backend side: two live flows to the same backend from the same local
//! address must never share it. Ports are per backend (as DPVS's `sa_pool`),
//! so each backend can have the whole range.
//!
//! The allocator hands out ports of its range in a seeded pseudo-random
//! order (an off-path observer cannot predict the next port, and tests
//! replay with the same seed), then reuses released ports oldest first: a
//! port released long ago is the least likely to still have a TIME_WAIT
//! socket on the backend. Every operation is O(1) (amortised, for the FIFO
//! of released ports); memory is one bit per port of the range plus two
//! bytes per released port. It does no I/O and reads no clock or RNG: the
//! seed is the caller's.
//!
//! A pool is shared by every tenant with fnat services on its backend, and
//! each may hold at most its share of it, the range's size over the number
//! of those tenants ([`FnatPorts::retain_backends`]): a tenant's flows
//! (spoofed SYNs at a few hundred a second fill 20,000 ports within a
//! minute) exhaust its own share, not the others'.

use std::collections::hash_map::{DefaultHasher, Entry};
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::net::{IpAddr, SocketAddr};
use std::ops::RangeInclusive;

/// Why a port could not be allocated or released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum PortError {
    /// Every port of the range is live: refuse the new flow and count it.
    #[error("all ports of the fnat range are in use")]
    Exhausted,
    /// Released a port outside the allocator's range.
    #[error("port {0} is outside the allocator's range")]
    OutOfRange(u16),
    /// Released a port that is not live (a double release).
    #[error("port {0} is not allocated")]
    NotAllocated(u16),
    /// The range is empty.
    #[error("empty port range")]
    EmptyRange,
    /// No local address of the backend's address family.
    #[error("no fnat local address of the backend's address family")]
    NoLocalAddress,
    /// The tenant holds its share of the backend's ports on every local
    /// address of its family (others have ports left).
    #[error("the tenant holds its share of the backend's fnat ports")]
    Share,
}

/// Allocates ports of one range for one (local address, backend).
#[derive(Debug, Clone)]
pub struct PortAllocator {
    first: u16,
    size: u32,
    /// Ports never handed out are visited as `first + (start + i * stride)
    /// mod size` for `i` in `0..size`: a permutation, since `stride` is
    /// coprime with `size`.
    start: u32,
    stride: u32,
    fresh: u32,
    /// Released ports, oldest first.
    released: VecDeque<u16>,
    live: Vec<u64>,
    live_count: u32,
}

impl PortAllocator {
    /// An allocator over `range` (e.g. `32768..=60999`); `seed` fixes the
    /// order in which ports are first handed out.
    pub fn new(range: RangeInclusive<u16>, seed: u64) -> Result<PortAllocator, PortError> {
        let (first, last) = (*range.start(), *range.end());
        if first > last {
            return Err(PortError::EmptyRange);
        }
        let size = u32::from(last - first) + 1;
        let mut x = seed;
        let start = (splitmix(&mut x) % u64::from(size)) as u32;
        let mut stride = (splitmix(&mut x) % u64::from(size)) as u32;
        // Bounded: consecutive integers are coprime, so at most `size` steps
        // (in practice a handful) find a stride coprime with `size`.
        for _ in 0..=size {
            if stride != 0 && gcd(stride, size) == 1 {
                break;
            }
            stride = (stride + 1) % size;
        }
        if size == 1 {
            stride = 1;
        }
        Ok(PortAllocator {
            first,
            size,
            start,
            stride,
            fresh: 0,
            released: VecDeque::new(),
            live: vec![0; (size as usize).div_ceil(64)],
            live_count: 0,
        })
    }

    /// A free port, now live. [`PortError::Exhausted`] when every port of
    /// the range is live.
    pub fn allocate(&mut self) -> Result<u16, PortError> {
        let port = if self.fresh < self.size {
            let i = self.fresh;
            self.fresh += 1;
            let off = (u64::from(self.start) + u64::from(i) * u64::from(self.stride))
                % u64::from(self.size);
            self.first + off as u16
        } else {
            self.released.pop_front().ok_or(PortError::Exhausted)?
        };
        let (w, b) = self.slot(port);
        debug_assert!(self.live[w] & b == 0, "allocator handed out a live port");
        self.live[w] |= b;
        self.live_count += 1;
        Ok(port)
    }

    /// Releases a live port; it is handed out again after every port
    /// released before it.
    pub fn release(&mut self, port: u16) -> Result<(), PortError> {
        if port < self.first || u32::from(port - self.first) >= self.size {
            return Err(PortError::OutOfRange(port));
        }
        let (w, b) = self.slot(port);
        if self.live[w] & b == 0 {
            return Err(PortError::NotAllocated(port));
        }
        self.live[w] &= !b;
        self.live_count -= 1;
        self.released.push_back(port);
        Ok(())
    }

    /// Whether `port` is live.
    pub fn is_live(&self, port: u16) -> bool {
        if port < self.first || u32::from(port - self.first) >= self.size {
            return false;
        }
        let (w, b) = self.slot(port);
        self.live[w] & b != 0
    }

    /// Number of live ports.
    pub fn live(&self) -> u32 {
        self.live_count
    }

    /// Number of ports in the range.
    pub fn capacity(&self) -> u32 {
        self.size
    }

    fn slot(&self, port: u16) -> (usize, u64) {
        let i = usize::from(port - self.first);
        (i / 64, 1u64 << (i % 64))
    }
}

/// fnat ports for every (local address, backend): the local addresses of
/// `[packet] local_addresses`, one [`PortAllocator`] per pair, created on
/// first use, and dropped once it has no live port and its backend is no
/// longer served ([`FnatPorts::retain_backends`]). A backend gets a port
/// from the first local address of its family (in rotating order) that
/// has one free.
#[derive(Debug, Clone)]
pub struct FnatPorts {
    locals: Vec<IpAddr>,
    range: RangeInclusive<u16>,
    seed: u64,
    next: usize,
    pools: HashMap<(IpAddr, SocketAddr), PortAllocator>,
    /// Live ports of each (local address, backend, tenant), for the
    /// tenants' shares; an entry goes with its last port.
    held: HashMap<(IpAddr, SocketAddr, u32), u32>,
    /// The backends served, as last told, with the number of tenants
    /// serving each; `None`: every one, by one tenant.
    served: Option<HashMap<SocketAddr, u32>>,
    /// Pools dropped so far: mixed into a new pool's seed, so that a pool
    /// made again for a backend does not hand out the ports its last one
    /// began with (the backend may hold them in TIME_WAIT still).
    dropped: u64,
}

impl FnatPorts {
    /// Ports of `range` on each of `locals`; `seed` fixes every allocator's
    /// order (each pair derives its own from it).
    pub fn new(
        locals: Vec<IpAddr>,
        range: RangeInclusive<u16>,
        seed: u64,
    ) -> Result<FnatPorts, PortError> {
        if range.start() > range.end() {
            return Err(PortError::EmptyRange);
        }
        Ok(FnatPorts {
            locals,
            range,
            seed,
            next: 0,
            pools: HashMap::new(),
            held: HashMap::new(),
            served: None,
            dropped: 0,
        })
    }

    /// A local address and port for a new flow of `tenant` to `backend`.
    /// [`PortError::NoLocalAddress`] when no local address has the backend's
    /// family; [`PortError::Share`] when the tenant holds its share of the
    /// backend's ports on each of them that has ports left;
    /// [`PortError::Exhausted`] when every one of them is out of ports for
    /// this backend.
    pub fn allocate(&mut self, backend: SocketAddr, tenant: u32) -> Result<SocketAddr, PortError> {
        let n = self.locals.len();
        let share = self.share(backend);
        let mut any = false;
        let mut at_share = false;
        for i in 0..n {
            let local = self.locals[(self.next + i) % n];
            if local.is_ipv4() != backend.is_ipv4() {
                continue;
            }
            any = true;
            let pool = match self.pools.entry((local, backend)) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => {
                    let mut h = DefaultHasher::new();
                    (self.seed, local, backend).hash(&mut h);
                    if self.dropped != 0 {
                        self.dropped.hash(&mut h);
                    }
                    e.insert(PortAllocator::new(self.range.clone(), h.finish())?)
                }
            };
            let held = self.held.get(&(local, backend, tenant)).copied();
            if held.unwrap_or(0) >= share {
                at_share |= pool.live() < pool.capacity();
                continue;
            }
            if let Ok(port) = pool.allocate() {
                *self.held.entry((local, backend, tenant)).or_insert(0) += 1;
                self.next = (self.next + i + 1) % n;
                return Ok(SocketAddr::new(local, port));
            }
        }
        Err(if at_share {
            PortError::Share
        } else if any {
            PortError::Exhausted
        } else {
            PortError::NoLocalAddress
        })
    }

    /// The ports of one pool a tenant may hold: the range over the number
    /// of tenants served at `backend` (all of it for one).
    fn share(&self, backend: SocketAddr) -> u32 {
        let tenants = self
            .served
            .as_ref()
            .and_then(|s| s.get(&backend).copied())
            .unwrap_or(1)
            .max(1);
        let size = u32::from(self.range.end() - self.range.start()) + 1;
        (size / tenants).max(1)
    }

    /// Releases the mapping `local` of a flow of `tenant` to `backend`.
    /// The last one of a backend no longer served drops its pool.
    pub fn release(
        &mut self,
        local: SocketAddr,
        backend: SocketAddr,
        tenant: u32,
    ) -> Result<(), PortError> {
        let key = (local.ip(), backend);
        let pool = self
            .pools
            .get_mut(&key)
            .ok_or(PortError::NotAllocated(local.port()))?;
        pool.release(local.port())?;
        if let Entry::Occupied(mut e) = self.held.entry((local.ip(), backend, tenant)) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
        if pool.live() == 0 && !self.serves(backend) {
            self.pools.remove(&key);
            self.dropped += 1;
        }
        Ok(())
    }

    /// The backends served are now `served` (all those that may get new
    /// flows), each with the number of tenants serving it (their shares of
    /// its pools): the pools of the others are dropped once they have no
    /// live port (now, or at their last release). A pool made for another
    /// backend later (a flow placed on a stale view) goes the same way.
    /// A tenant holding more than a smaller share gets no port until it
    /// holds less.
    pub fn retain_backends(&mut self, served: HashMap<SocketAddr, u32>) {
        let before = self.pools.len();
        self.pools
            .retain(|(_, b), p| p.live() > 0 || served.contains_key(b));
        self.dropped += (before - self.pools.len()) as u64;
        self.served = Some(served);
    }

    fn serves(&self, backend: SocketAddr) -> bool {
        self.served
            .as_ref()
            .is_none_or(|s| s.contains_key(&backend))
    }

    /// Number of (local address, backend) pools.
    pub fn pools(&self) -> usize {
        self.pools.len()
    }

    /// Whether `local` is a live mapping towards `backend`.
    pub fn is_live(&self, local: SocketAddr, backend: SocketAddr) -> bool {
        self.pools
            .get(&(local.ip(), backend))
            .is_some_and(|p| p.is_live(local.port()))
    }
}

fn gcd(mut a: u32, mut b: u32) -> u32 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// SplitMix64: expands the caller's seed (not a source of entropy itself).
fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[test]
    fn hands_out_every_port_once_then_exhausts() {
        let mut a = PortAllocator::new(1000..=1099, 7).expect("range");
        let mut seen = HashSet::new();
        for _ in 0..100 {
            let p = a.allocate().expect("a free port");
            assert!((1000..=1099).contains(&p));
            assert!(seen.insert(p), "port {p} handed out twice");
        }
        assert_eq!(a.allocate(), Err(PortError::Exhausted));
        assert_eq!(a.live(), 100);
    }

    #[test]
    fn released_ports_come_back_oldest_first() {
        let mut a = PortAllocator::new(1..=3, 1).expect("range");
        let ps = [
            a.allocate().expect("1"),
            a.allocate().expect("2"),
            a.allocate().expect("3"),
        ];
        a.release(ps[2]).expect("live");
        a.release(ps[0]).expect("live");
        assert_eq!(a.allocate(), Ok(ps[2]));
        assert_eq!(a.allocate(), Ok(ps[0]));
        assert_eq!(a.allocate(), Err(PortError::Exhausted));
    }

    #[test]
    fn bad_releases_are_errors() {
        let mut a = PortAllocator::new(10..=20, 0).expect("range");
        assert_eq!(a.release(9), Err(PortError::OutOfRange(9)));
        assert_eq!(a.release(21), Err(PortError::OutOfRange(21)));
        assert_eq!(a.release(15), Err(PortError::NotAllocated(15)));
        let p = a.allocate().expect("free");
        a.release(p).expect("live");
        assert_eq!(a.release(p), Err(PortError::NotAllocated(p)));
        let (lo, hi) = (5, 4);
        assert!(matches!(
            PortAllocator::new(lo..=hi, 0),
            Err(PortError::EmptyRange)
        ));
    }

    #[test]
    fn full_port_space_and_single_port() {
        let mut a = PortAllocator::new(0..=u16::MAX, 99).expect("range");
        assert_eq!(a.capacity(), 65536);
        let mut seen = vec![false; 65536];
        for _ in 0..65536 {
            let p = a.allocate().expect("free");
            assert!(!seen[usize::from(p)]);
            seen[usize::from(p)] = true;
        }
        assert_eq!(a.allocate(), Err(PortError::Exhausted));
        let mut one = PortAllocator::new(7..=7, 3).expect("range");
        assert_eq!(one.allocate(), Ok(7));
        assert_eq!(one.allocate(), Err(PortError::Exhausted));
    }

    #[test]
    fn seed_changes_the_order_and_replays() {
        let order = |seed| {
            let mut a = PortAllocator::new(1024..=65535, seed).expect("range");
            (0..16)
                .map(|_| a.allocate().expect("free"))
                .collect::<Vec<_>>()
        };
        assert_eq!(order(1), order(1));
        assert_ne!(order(1), order(2));
    }

    #[test]
    fn fnat_ports_spread_over_local_addresses_of_the_family() {
        let l1: IpAddr = "10.0.1.1".parse().expect("ip");
        let l2: IpAddr = "10.0.1.9".parse().expect("ip");
        let l6: IpAddr = "fd00::1".parse().expect("ip");
        let b: SocketAddr = "10.0.1.2:80".parse().expect("addr");
        let b2: SocketAddr = "10.0.1.3:80".parse().expect("addr");
        let b6: SocketAddr = "[fd00::2]:80".parse().expect("addr");
        let mut f = FnatPorts::new(vec![l1, l6, l2], 5000..=5001, 1).expect("pool");
        let mut got = HashSet::new();
        for _ in 0..4 {
            let a = f.allocate(b, 1).expect("free");
            assert!(a.ip() == l1 || a.ip() == l2);
            assert!(f.is_live(a, b));
            assert!(got.insert(a), "{a} handed out twice");
        }
        assert_eq!(f.allocate(b, 1), Err(PortError::Exhausted));
        // Ports are per backend: another backend has the whole range.
        assert!(f.allocate(b2, 1).is_ok());
        assert_eq!(f.allocate(b6, 1).map(|a| a.ip()), Ok(l6));
        let a = *got.iter().next().expect("one");
        f.release(a, b, 1).expect("live");
        assert!(!f.is_live(a, b));
        assert_eq!(f.release(a, b, 1), Err(PortError::NotAllocated(a.port())));
        assert_eq!(f.allocate(b, 1), Ok(a));
        let mut v4only = FnatPorts::new(vec![l1], 1..=10, 0).expect("pool");
        assert_eq!(v4only.allocate(b6, 1), Err(PortError::NoLocalAddress));
    }

    /// A pool of a backend no longer served goes with its last live
    /// port (or at once, if it has none); a served one stays.
    #[test]
    fn pools_of_backends_no_longer_served_are_dropped() {
        let l: IpAddr = "10.0.1.1".parse().expect("ip");
        let b1: SocketAddr = "10.0.1.2:80".parse().expect("addr");
        let b2: SocketAddr = "10.0.1.3:80".parse().expect("addr");
        let b3: SocketAddr = "10.0.1.4:80".parse().expect("addr");
        let mut f = FnatPorts::new(vec![l], 5000..=5009, 1).expect("pool");
        let p1 = f.allocate(b1, 1).expect("free");
        let p2 = f.allocate(b2, 1).expect("free");
        let p3 = f.allocate(b3, 1).expect("free");
        f.release(p3, b3, 1).expect("live");
        assert_eq!(f.pools(), 3, "every backend is served until told");
        f.retain_backends([(b1, 1)].into_iter().collect());
        assert_eq!(f.pools(), 2, "b3's empty pool goes at once");
        f.release(p1, b1, 1).expect("live");
        assert_eq!(f.pools(), 2, "b1 is served: its pool stays");
        f.release(p2, b2, 1).expect("live");
        assert_eq!(f.pools(), 1, "b2's pool went with its last port");
        assert!(!f.is_live(p2, b2));
        // A port taken for b2 on a stale view: its pool goes with it.
        let p = f.allocate(b2, 1).expect("free");
        assert_eq!(f.pools(), 2);
        f.release(p, b2, 1).expect("live");
        assert_eq!(f.pools(), 1);
    }

    /// One tenant's flows to a backend fill only its share of the pool:
    /// a spoofed SYN flood on its service left none for another tenant's
    /// service to the same backend. A share left goes back to it.
    #[test]
    fn a_tenant_fills_only_its_share_of_a_pool() {
        let (l1, l2): (IpAddr, IpAddr) = (
            "10.0.1.1".parse().expect("ip"),
            "10.0.1.9".parse().expect("ip"),
        );
        let b: SocketAddr = "10.0.1.2:80".parse().expect("addr");
        let mut f = FnatPorts::new(vec![l1, l2], 5000..=5009, 1).expect("pool");
        f.retain_backends([(b, 2)].into_iter().collect());
        let mut a = Vec::new();
        for _ in 0..10 {
            a.push(f.allocate(b, 1).expect("within the share"));
        }
        assert_eq!(f.allocate(b, 1), Err(PortError::Share));
        for _ in 0..10 {
            f.allocate(b, 2).expect("the other tenant's share");
        }
        assert_eq!(f.allocate(b, 2), Err(PortError::Exhausted));
        assert_eq!(f.allocate(b, 3), Err(PortError::Exhausted));
        f.release(a[0], b, 1).expect("live");
        assert_eq!(f.allocate(b, 1), Ok(a[0]));
        // Alone at the backend, a tenant has the whole range again.
        f.retain_backends([(b, 1)].into_iter().collect());
        f.release(a[1], b, 1).expect("live");
        f.release(a[2], b, 1).expect("live");
        assert!(f.allocate(b, 2).is_ok());
        assert!(f.allocate(b, 2).is_ok());
        // The counts go with their last port.
        for p in &a {
            let _ = f.release(*p, b, 1);
        }
        assert!(!f.held.keys().any(|&(_, _, t)| t == 1));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc,
        Release(usize),
        ReleaseAny(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::Alloc),
            2 => any::<usize>().prop_map(Op::Release),
            1 => any::<u16>().prop_map(Op::ReleaseAny),
        ]
    }

    proptest! {
        /// Against a HashSet model: a port is never handed out while live,
        /// releases succeed exactly for live ports, and exhaustion happens
        /// exactly when every port is live.
        #[test]
        fn never_hands_out_a_live_port(lo in 0u16..2000, len in 0u16..300, seed in any::<u64>(),
                                       ops in proptest::collection::vec(op(), 1..600)) {
            let hi = lo + len;
            let mut a = PortAllocator::new(lo..=hi, seed).expect("range");
            let mut live: HashSet<u16> = HashSet::new();
            let mut order: Vec<u16> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc => match a.allocate() {
                        Ok(p) => {
                            prop_assert!((lo..=hi).contains(&p));
                            prop_assert!(live.insert(p), "port {} handed out while live", p);
                            order.push(p);
                        }
                        Err(e) => {
                            prop_assert_eq!(e, PortError::Exhausted);
                            prop_assert_eq!(live.len(), usize::from(len) + 1);
                        }
                    },
                    Op::Release(i) if !order.is_empty() => {
                        let p = order.swap_remove(i % order.len());
                        prop_assert!(live.remove(&p));
                        prop_assert_eq!(a.release(p), Ok(()));
                    }
                    Op::Release(_) => {}
                    Op::ReleaseAny(p) => {
                        let r = a.release(p);
                        if live.remove(&p) {
                            prop_assert_eq!(r, Ok(()));
                            order.retain(|&q| q != p);
                        } else {
                            prop_assert!(r.is_err());
                        }
                    }
                }
                prop_assert_eq!(a.live() as usize, live.len());
            }
            for p in lo..=hi {
                prop_assert_eq!(a.is_live(p), live.contains(&p));
            }
        }
    }
}

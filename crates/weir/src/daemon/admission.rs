//! Admission: whether a new connection, session or packet flow may open —
//! the global, tenant (connections, new connections per second) and
//! per-client limits — checked before a task is spawned, and every refusal
//! counted under one reason.

use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use tokio_util::sync::CancellationToken;

use super::{Service, Tenant};
use crate::config::Protocol;

/// Live connections against the limits, and the refusals.
#[derive(Debug)]
pub(crate) struct Admission {
    /// `[daemon] max_connections`; 0 = unlimited. A reload may change it.
    max_connections: AtomicU64,
    /// Live connections + sessions + packet flows.
    pub(crate) active: AtomicU64,
    pub(crate) refused: RefusalCounts,
    /// The soft open-files limit the daemon runs with.
    pub(crate) fd_limit: u64,
    /// Cancelled when the daemon drains or stops: listeners stop accepting.
    pub(crate) stop_accept: CancellationToken,
    /// TCP listeners whose accept loop has not ended: once `stop_accept`
    /// is cancelled, each takes what its accept queue holds and closes; a
    /// drain waits for that before it counts what is left in `active`.
    pub(crate) listeners: AtomicU64,
    /// Lingering closes of a removed service's queued connections (weir's
    /// FIN sent, the client's awaited, at most `tcp::CLOSE_LINGER`): not
    /// in `active` (they are not admitted), but a drain waits for them,
    /// and counts those it ends among the connections it closed.
    pub(crate) closing: AtomicU64,
}

impl Admission {
    pub(super) fn new(max_connections: u64, fd_limit: u64) -> Self {
        Self {
            max_connections: AtomicU64::new(max_connections),
            active: AtomicU64::new(0),
            refused: RefusalCounts::default(),
            fd_limit,
            stop_accept: CancellationToken::new(),
            listeners: AtomicU64::new(0),
            closing: AtomicU64::new(0),
        }
    }

    /// `[daemon] max_connections` now.
    pub(crate) fn max_connections(&self) -> u64 {
        self.max_connections.load(Relaxed)
    }

    /// A reload's new `max_connections`: for the next admissions (live
    /// connections over it stay).
    pub(crate) fn set_max_connections(&self, max: u64) {
        self.max_connections.store(max, Relaxed);
    }

    /// Count a refusal under `why`, and against `tenant` if known.
    pub(crate) fn refuse(&self, tenant: Option<&Tenant>, why: Refusal) {
        self.refused.add(why);
        if let Some(t) = tenant {
            t.refused.fetch_add(1, Relaxed);
        }
    }

    /// Reserve a slot for a new connection under the global and tenant
    /// limits at `now_ns` (the daemon's clock, [`Shared::now_ns`]); on
    /// success the caller must eventually call [`Self::release`].
    pub(crate) fn admit(&self, tenant: &Tenant, now_ns: u64) -> Result<(), Refusal> {
        let max = self.max_connections.load(Relaxed);
        let prev = self.active.fetch_add(1, Relaxed);
        if max != 0 && prev >= max {
            self.active.fetch_sub(1, Relaxed);
            return Err(Refusal::GlobalLimit);
        }
        self.admit_in_tenant(tenant, now_ns)
    }

    /// [`Self::admit`] for a new session refused at the daemon's
    /// `max_connections` whose place there is coming (`udp::open_session`
    /// ended another tenant's session, which gives its slot back when its
    /// task runs): a slot past the daemon's limit, under the tenant's own
    /// limits still. Given back with [`Self::release`].
    pub(crate) fn admit_past_daemon_limit(
        &self,
        tenant: &Tenant,
        now_ns: u64,
    ) -> Result<(), Refusal> {
        self.active.fetch_add(1, Relaxed);
        self.admit_in_tenant(tenant, now_ns)
    }

    /// The tenant's part of [`Self::admit`], the daemon's slot taken
    /// (given back on a refusal).
    fn admit_in_tenant(&self, tenant: &Tenant, now_ns: u64) -> Result<(), Refusal> {
        let (tmax, rate) = {
            let s = tenant.spec.read();
            (s.max_connections, s.max_new_per_s)
        };
        let tprev = tenant.active.fetch_add(1, Relaxed);
        if tmax != 0 && tprev >= tmax {
            tenant.active.fetch_sub(1, Relaxed);
            self.active.fetch_sub(1, Relaxed);
            return Err(Refusal::TenantLimit);
        }
        if rate != 0 && !tenant.new_conns.admit(now_ns, rate) {
            tenant.active.fetch_sub(1, Relaxed);
            self.active.fetch_sub(1, Relaxed);
            return Err(Refusal::TenantRate);
        }
        Ok(())
    }

    /// A slot past the limits: for a new session taking the place of one
    /// just ended whose owner has yet to give its slot back
    /// (`udp::take_a_place`). Given back with [`Self::release`].
    pub(crate) fn admit_over(&self, tenant: &Tenant) {
        tenant.active.fetch_add(1, Relaxed);
        self.active.fetch_add(1, Relaxed);
    }

    /// Give back the slot [`Self::admit_past_daemon_limit`] reserved for a
    /// session that found no place after all, and the `max_new_per_s`
    /// token it took: nothing opened, so nothing is spent. (Kept, it made a
    /// refusal at the daemon's limit cost the tenant's next session.)
    pub(crate) fn release_unopened(&self, tenant: &Tenant) {
        let rate = tenant.spec.read().max_new_per_s;
        if rate != 0 {
            tenant.new_conns.refund(rate);
        }
        self.release(tenant);
    }

    /// Give back the slot [`Self::admit`] reserved.
    pub(crate) fn release(&self, tenant: &Tenant) {
        tenant.active.fetch_sub(1, Relaxed);
        self.active.fetch_sub(1, Relaxed);
    }
}

/// `max_new_per_s` as a token bucket holding one second's worth, kept as
/// GCRA's "theoretical arrival time" in one atomic (lock-free): from idle,
/// `rate` connections pass at once, then one every `1/rate` s, so a span of
/// L seconds admits at most `rate × (1 + L)`. (The fixed per-second window
/// it replaces let `2 × rate` through within a millisecond around each
/// second's boundary.) I/O-free: time is a parameter.
#[derive(Debug, Default)]
pub(crate) struct NewConnLimit {
    /// Nanoseconds (daemon clock) at which the bucket is full again.
    tat: AtomicU64,
}

impl NewConnLimit {
    /// The bucket's cost of one connection at `rate` per second.
    fn step(rate: u64) -> u64 {
        const SECOND: u64 = 1_000_000_000;
        (SECOND / rate.max(1)).max(1)
    }

    /// One new connection at `now_ns` under `rate` per second (> 0).
    pub(crate) fn admit(&self, now_ns: u64, rate: u64) -> bool {
        const SECOND: u64 = 1_000_000_000;
        let step = Self::step(rate);
        let tolerance = SECOND.saturating_sub(step);
        let mut tat = self.tat.load(Relaxed);
        loop {
            let start = tat.max(now_ns);
            if start - now_ns > tolerance {
                return false;
            }
            match self
                .tat
                .compare_exchange_weak(tat, start + step, Relaxed, Relaxed)
            {
                Ok(_) => return true,
                Err(t) => tat = t,
            }
        }
    }

    /// Give back one connection [`Self::admit`] let through at `rate`
    /// that did not open after all: as if it had not been asked for.
    pub(crate) fn refund(&self, rate: u64) {
        let step = Self::step(rate);
        let _ = self
            .tat
            .fetch_update(Relaxed, Relaxed, |t| Some(t.saturating_sub(step)));
    }
}

/// Why a connection or session was refused; each one is counted under
/// exactly one reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    GlobalLimit,
    TenantLimit,
    TenantRate,
    NoBackend,
    BackendLimit,
    ClientLimit,
    /// A client at `tcp_max_connections_per_client`.
    TcpClientLimit,
    TableFull,
    /// Every backend tried failed to connect or timed out.
    BackendUnreachable,
    /// `accept` hit the descriptor limit (the client waits in the backlog).
    FdExhausted,
    /// A client on port 0 (see [`super::Shared::open`]).
    ZeroPort,
}

impl Refusal {
    const ALL: [Self; 11] = [
        Self::GlobalLimit,
        Self::TenantLimit,
        Self::TenantRate,
        Self::NoBackend,
        Self::BackendLimit,
        Self::ClientLimit,
        Self::TcpClientLimit,
        Self::TableFull,
        Self::BackendUnreachable,
        Self::FdExhausted,
        Self::ZeroPort,
    ];

    /// The name in `refused` of the stats and the metrics' `reason` label.
    fn key(self) -> &'static str {
        match self {
            Self::GlobalLimit => "global_limit",
            Self::TenantLimit => "tenant_limit",
            Self::TenantRate => "tenant_rate",
            Self::NoBackend => "no_backend",
            Self::BackendLimit => "backend_limit",
            Self::ClientLimit => "client_limit",
            Self::TcpClientLimit => "tcp_client_limit",
            Self::TableFull => "table_full",
            Self::BackendUnreachable => "backend_unreachable",
            Self::FdExhausted => "fd_exhausted",
            Self::ZeroPort => "zero_port",
        }
    }
}

/// Refusals per reason: one atomic each, so a flood of refused connections
/// takes no lock and allocates nothing (they used to share one
/// `Mutex<BTreeMap<String, u64>>` and allocate a key each). Each counter on
/// its own cache line: different reasons are hit by different floods.
#[derive(Debug, Default)]
pub(crate) struct RefusalCounts([CachePadded<AtomicU64>; Refusal::ALL.len()]);

/// 128 bytes: two 64-byte lines, as the adjacent-line prefetcher pulls
/// pairs (tokio's `CachePadded` reasoning).
#[derive(Debug, Default)]
#[repr(align(128))]
struct CachePadded<T>(T);

impl RefusalCounts {
    pub(crate) fn add(&self, why: Refusal) {
        self.0[why as usize].0.fetch_add(1, Relaxed);
    }

    /// The reasons seen so far (zero counts left out), by name.
    pub(crate) fn snapshot(&self) -> BTreeMap<String, u64> {
        Refusal::ALL
            .iter()
            .filter_map(|&r| {
                let n = self.0[r as usize].0.load(Relaxed);
                (n > 0).then(|| (r.key().to_owned(), n))
            })
            .collect()
    }
}

/// A service's open connections (or sessions) per client, for its
/// per-client cap: an IPv4 client is its address, an IPv6 one the block of
/// `client_prefix6` bits its address is in (a host picks any address in
/// its /64, so counting addresses would let it take as many places as it
/// likes). A client leaves when its count is 0.
#[derive(Debug)]
pub(crate) struct ClientCounts {
    prefix6: u8,
    counts: HashMap<IpAddr, u64>,
}

impl ClientCounts {
    pub(crate) fn new(prefix6: u8) -> Self {
        Self {
            prefix6,
            counts: HashMap::new(),
        }
    }

    /// The client `ip` is counted as.
    fn client(&self, ip: IpAddr) -> IpAddr {
        match ip.to_canonical() {
            IpAddr::V6(a) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix6))
                    .unwrap_or(0);
                IpAddr::V6((u128::from(a) & mask).into())
            }
            v4 => v4,
        }
    }

    /// One more for `ip`'s client unless it holds `max` (0: no room):
    /// the client it was counted as, or `None` at the cap.
    fn take(&mut self, ip: IpAddr, max: u64) -> Option<IpAddr> {
        let client = self.client(ip);
        let n = self.counts.entry(client).or_insert(0);
        if *n >= max {
            if *n == 0 {
                self.counts.remove(&client);
            }
            return None;
        }
        *n += 1;
        Some(client)
    }

    /// One less for `client` (as [`Self::take`] returned it).
    fn give(&mut self, client: IpAddr) {
        if let Some(n) = self.counts.get_mut(&client) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.counts.remove(&client);
            }
        }
    }

    /// An edit changed `client_prefix6`: the counts start again under the
    /// new grouping. Connections open now are not counted against it (as
    /// when a cap is raised from 0); their ends find nothing to give back,
    /// or give back a place of a client they share a key with: the cap
    /// may let a few more in for a while, never fewer.
    pub(crate) fn regroup(&mut self, prefix6: u8) {
        self.prefix6 = prefix6;
        self.counts.clear();
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}

/// One open TCP connection counted against its client's
/// `tcp_max_connections_per_client`; dropping it gives the place back.
#[derive(Debug)]
pub(crate) struct ClientSlot {
    svc: Arc<Service>,
    client: IpAddr,
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        self.svc.tcp_per_client.lock().give(self.client);
    }
}

impl Service {
    /// A place for one more TCP connection from `client` under the
    /// service's `tcp_max_connections_per_client` (`None`: no limit, nothing
    /// counted), or [`Refusal::TcpClientLimit`]. Connections accepted while
    /// the limit was 0 are not counted when it is raised later.
    pub(crate) fn tcp_client_slot(
        self: &Arc<Self>,
        client: IpAddr,
    ) -> Result<Option<ClientSlot>, Refusal> {
        let max = self.params.load().tcp_max_per_client;
        if max == 0 {
            return Ok(None);
        }
        let client = self
            .tcp_per_client
            .lock()
            .take(client, max)
            .ok_or(Refusal::TcpClientLimit)?;
        Ok(Some(ClientSlot {
            svc: self.clone(),
            client,
        }))
    }

    /// One more packet flow from `client` under the cap `max` of its
    /// protocol's per-client map (the proxy's maps: a client's proxied
    /// connections and packet flows count together); false at the cap.
    pub(crate) fn take_client_place(&self, proto: Protocol, client: IpAddr, max: u64) -> bool {
        self.client_counts(proto).lock().take(client, max).is_some()
    }

    fn client_counts(&self, proto: Protocol) -> &Mutex<ClientCounts> {
        match proto {
            Protocol::Tcp => &self.tcp_per_client,
            Protocol::Udp => &self.udp_per_client,
        }
    }

    /// Give back a place [`Self::take_client_place`] took.
    pub(crate) fn give_client_place(&self, proto: Protocol, client: IpAddr) {
        let mut counts = self.client_counts(proto).lock();
        let client = counts.client(client);
        counts.give(client);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An IPv6 client is its /64 by default (a host may take any address
    /// in it), or the prefix the service sets; an IPv4 client, or an
    /// IPv4-mapped one, its address. Before, each IPv6 address was a
    /// client of its own: one host could open as many connections as it
    /// had addresses (2^64) past the cap.
    #[test]
    fn an_ipv6_client_is_its_prefix() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let mut c = ClientCounts::new(64);
        assert_eq!(c.take(ip("2001:db8:1:2::1"), 2), Some(ip("2001:db8:1:2::")));
        assert!(c.take(ip("2001:db8:1:2:ffff::9"), 2).is_some());
        assert_eq!(
            c.take(ip("2001:db8:1:2::3"), 2),
            None,
            "same /64, at the cap"
        );
        assert!(c.take(ip("2001:db8:1:3::1"), 2).is_some(), "another /64");
        assert!(c.take(ip("10.0.0.1"), 1).is_some());
        assert_eq!(
            c.take(ip("::ffff:10.0.0.1"), 1),
            None,
            "mapped: the same IPv4 client"
        );
        assert!(c.take(ip("10.0.0.2"), 1).is_some());
        c.give(ip("2001:db8:1:2::"));
        assert!(
            c.take(ip("2001:db8:1:2::77"), 2).is_some(),
            "a place given back"
        );

        let mut each = ClientCounts::new(128);
        assert!(each.take(ip("2001:db8::1"), 1).is_some());
        assert!(each.take(ip("2001:db8::2"), 1).is_some());
        assert_eq!(each.take(ip("2001:db8::2"), 1), None);
        let mut wide = ClientCounts::new(48);
        assert!(wide.take(ip("2001:db8:1:2::1"), 1).is_some());
        assert_eq!(wide.take(ip("2001:db8:1:ffff::1"), 1), None);

        // A new prefix starts the counts again.
        c.regroup(128);
        assert!(c.is_empty());
        assert!(c.take(ip("2001:db8:1:2::3"), 1).is_some());
        assert!(c.take(ip("2001:db8:1:2::4"), 1).is_some());
    }

    const MS: u64 = 1_000_000;

    /// A refund gives back exactly one connection's worth, and no more
    /// than the bucket holds.
    #[test]
    fn new_conn_limit_refund_gives_back_one() {
        let l = NewConnLimit::default();
        let t0 = 5_000 * MS;
        assert_eq!((0..250).filter(|_| l.admit(t0, 100)).count(), 100);
        l.refund(100);
        assert!(l.admit(t0, 100));
        assert!(!l.admit(t0, 100));
        // Refunds into a full bucket do not overfill it.
        let idle = NewConnLimit::default();
        for _ in 0..5 {
            idle.refund(100);
        }
        assert_eq!((0..250).filter(|_| idle.admit(t0, 100)).count(), 100);
    }

    #[test]
    fn new_conn_limit_passes_a_second_worth_then_one_per_step() {
        let l = NewConnLimit::default();
        let t0 = 5_000 * MS;
        // From idle: exactly `rate` at one instant.
        assert_eq!((0..250).filter(|_| l.admit(t0, 100)).count(), 100);
        // Then one every 10 ms, not before.
        assert!(!l.admit(t0 + 9 * MS, 100));
        assert!(l.admit(t0 + 10 * MS, 100));
        assert!(!l.admit(t0 + 10 * MS, 100));
        assert!(l.admit(t0 + 20 * MS, 100));
        // A full second idle refills it.
        assert_eq!(
            (0..250).filter(|_| l.admit(t0 + 2_000 * MS, 100)).count(),
            100
        );
    }

    #[test]
    fn new_conn_limit_bounds_every_span() {
        // Offered: 10 per ms for 3 s at rate 1,000/s. Every span of L ms
        // admits at most rate x (1 + L/1000), and the total is one burst
        // plus the rate over the time.
        let (l, rate) = (NewConnLimit::default(), 1_000);
        let mut per_ms = Vec::new();
        for ms in 0..3_000u64 {
            per_ms.push((0..10).filter(|_| l.admit(ms * MS, rate)).count() as u64);
        }
        let total: u64 = per_ms.iter().sum();
        assert!((rate + 2_999..=rate + 3_000).contains(&total), "{total}");
        for len in [1usize, 10, 100, 1_000] {
            for w in per_ms.windows(len) {
                let n: u64 = w.iter().sum();
                assert!(n <= rate + rate * len as u64 / 1_000 + 1, "{n} in {len} ms");
            }
        }
    }

    #[test]
    fn new_conn_limit_is_exact_across_threads() {
        let l = std::sync::Arc::new(NewConnLimit::default());
        let admitted: u64 = (0..4)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || (0..10_000).filter(|_| l.admit(MS, 777)).count() as u64)
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .sum();
        assert_eq!(admitted, 777);
    }
}

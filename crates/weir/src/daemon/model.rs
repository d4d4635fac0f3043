//! The model: tenants, services and their backends, what the control path
//! (the admin API, reloads, health checks) changes and the data path reads
//! to place a connection. Its CRUD (add a tenant, add or replace a service
//! and open its sockets, health checks, persistence templates) and the
//! scheduling of a connection onto a backend ([`Service::choose`]) are here.
//! Nothing per connection lives in the model: a connection is its entry in
//! the table ([`super::conns`]).

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use parking_lot::{Mutex, MutexGuard, RwLock};
use tokio_util::sync::CancellationToken;
use weir_flowtable::{
    BackendId, Dir, FlowInit, FlowKey, FlowState, Millis, Proto, ServiceId, TenantConfig, TenantId,
    TimeoutOverrides, Timeouts,
};
use weir_sched::{AffinityMask, BackendInfo, HashSeed, Load, SchedConfig, Scheduler};

use super::admission::ClientCounts;
use super::owners::Close;
use super::stats::{self, Stat};
use super::{
    CONNECT_TIMEOUT, ListenSocket, NewConnLimit, Refusal, Shared, WorkerCmd, check_service,
    open_sockets, probe_free,
};
use crate::config::{self, BackendSpec, Protocol, ServiceSpec, TenantSpec};

/// Tenants and services by name, published as immutable snapshots, and
/// what their changes are serialised and announced with.
#[derive(Debug)]
pub(crate) struct Model {
    /// The current snapshot. Readers (the data path, listings, the expiry
    /// thread) [`Model::load`] it without a lock; writers replace it whole
    /// through [`Model::write`].
    state: ArcSwap<State>,
    /// Serialises writers: each copies the snapshot, changes the copy and
    /// stores it, so no change is lost to a concurrent one.
    writer: Mutex<()>,
    /// Ids of tenants and services (never two live ones alike).
    pub(super) ids: Arc<Ids>,
    /// Objects added through the API since the start or the last reload
    /// ("tenant T", "service T/S", "backend T/S/ADDR"): a reload that would
    /// remove them needs `force`.
    pub(super) runtime_added: Mutex<std::collections::BTreeSet<String>>,
    /// Serialises reloads.
    pub(super) reload_lock: Mutex<()>,
    /// Serialises the edits that read a service's spec and write it back
    /// changed (a backend added, edited or deleted; a service edited or
    /// deleted), so that two of them never both start from the same spec
    /// and one's change vanish under the other's, the tenant edits with
    /// the adds that check the tenant's caps, and tenant creations with
    /// the tenant edits (each checks that no other holds its token). A
    /// reload holds it from its check of the file against the running
    /// state to the end of its apply; it and the API edits take it through
    /// [`Model::lock_edits`].
    pub(super) edits: Mutex<()>,
    /// How many callers of [`Model::lock_edits`] (API edits, reloads)
    /// wait for `edits` now: what tests watch to know one is held up.
    pub(super) edits_waiting: AtomicUsize,
    /// How many callers of [`Model::write`] wait for `writer` now.
    pub(super) writers_waiting: AtomicUsize,
    /// How many tenant adds are in the flow table's `add_tenants` now
    /// (which takes the table's maintenance lock): what tests watch.
    pub(super) table_adds: AtomicUsize,
    /// Moves whenever a service is added, removed or replaced, or a
    /// service's set of backends changes: packet workers rebuild their
    /// snapshot of the packet services when it does.
    pub(super) services_gen: AtomicU64,
    /// Every service that opened listeners, while it lives: a service
    /// address still held by a removed one of ours is waited for, not
    /// mistaken for another process's.
    listen_groups: Mutex<Vec<(Protocol, SocketAddr, Weak<Service>)>>,
    /// Services taken out of the snapshot whose flows are still being
    /// ended (a deletion's or replacement's kill, a tenant's purge): an
    /// entry of theirs that the expiry thread (or a kill) removes
    /// meanwhile is settled on them ([`Shared::ended`] finds them here),
    /// not left holding its admission slot, fnat port and client place.
    pub(super) retiring: Mutex<Vec<Arc<Service>>>,
    /// How many times a writer copied the snapshot ([`StateWrite`]): what
    /// tests count to see that a batch of adds copies it once.
    #[cfg(test)]
    pub(super) copies: AtomicU64,
    /// Held (shared) by an API add of a backend or a service from its
    /// tenant's cap check to its change ([`Self::cap_checked`]): a test
    /// holds it to keep an add between the two.
    #[cfg(test)]
    pub(super) cap_gate: RwLock<()>,
    /// API adds that passed their tenant's cap check (tests).
    #[cfg(test)]
    pub(super) caps_passed: AtomicUsize,
    /// Service adds and edits that passed their tenant's caps, the
    /// start's included (tests; `caps_passed` counts backend adds alone).
    #[cfg(test)]
    pub(super) service_caps_passed: AtomicUsize,
    /// Held (shared) by a reload from its check of the file against the
    /// running state to its apply ([`Self::planned`]): a test holds it to
    /// keep a reload between the two.
    #[cfg(test)]
    pub(super) plan_gate: RwLock<()>,
    /// Reloads that passed their check and go on to apply (tests).
    #[cfg(test)]
    pub(super) plans_made: AtomicUsize,
}

/// How long an add waits for a removed service of ours to let go of its
/// address ([`Shared::wait_for_own_release`]).
const OWN_RELEASE_WAIT: Duration = Duration::from_secs(2);

impl Model {
    pub(super) fn new() -> Self {
        Self {
            state: ArcSwap::from_pointee(State::default()),
            writer: Mutex::new(()),
            ids: Ids::new(),
            runtime_added: Mutex::default(),
            retiring: Mutex::default(),
            reload_lock: Mutex::new(()),
            edits: Mutex::new(()),
            edits_waiting: AtomicUsize::new(0),
            writers_waiting: AtomicUsize::new(0),
            table_adds: AtomicUsize::new(0),
            services_gen: AtomicU64::new(0),
            listen_groups: Mutex::new(Vec::new()),
            #[cfg(test)]
            copies: AtomicU64::new(0),
            #[cfg(test)]
            cap_gate: RwLock::new(()),
            #[cfg(test)]
            caps_passed: AtomicUsize::new(0),
            #[cfg(test)]
            service_caps_passed: AtomicUsize::new(0),
            #[cfg(test)]
            plan_gate: RwLock::new(()),
            #[cfg(test)]
            plans_made: AtomicUsize::new(0),
        }
    }

    /// An API add passed its tenant's cap check: the guard, held until
    /// the add's change is made, is where a test keeps it (`cap_gate`).
    #[cfg(test)]
    pub(super) fn cap_checked(&self) -> parking_lot::RwLockReadGuard<'_, ()> {
        self.caps_passed.fetch_add(1, Relaxed);
        self.cap_gate.read()
    }

    /// A service add or edit passed its tenant's caps: waits while a test
    /// holds `cap_gate`.
    #[cfg(test)]
    pub(super) fn service_caps_checked(&self) {
        self.service_caps_passed.fetch_add(1, Relaxed);
        drop(self.cap_gate.read());
    }

    /// A reload passed its check and goes on to apply: waits while a test
    /// holds `plan_gate`.
    #[cfg(test)]
    pub(super) fn planned(&self) {
        self.plans_made.fetch_add(1, Relaxed);
        drop(self.plan_gate.read());
    }

    /// `edits`, for an API edit or a reload. The admin API calls the
    /// edits from its handlers, on the control runtime's one worker
    /// thread, and a reload holds `edits` for its check and apply
    /// (seconds, with many services):
    /// waiting for it there held up every other admin request, the health
    /// checks and the watchdog's keep-alives until the reload ended. On a
    /// worker of a multi-thread runtime the wait is handed to
    /// [`tokio::task::block_in_place`], which moves the runtime's other
    /// tasks to another thread meanwhile; elsewhere (a blocking thread, a
    /// plain thread) it is a plain wait. Edits and reloads stay serialised
    /// as before: this only changes which thread waits.
    pub(super) fn lock_edits(&self) -> MutexGuard<'_, ()> {
        lock_off_runtime(&self.edits, &self.edits_waiting)
    }

    /// The current snapshot, without a lock. It stays as it is while held
    /// (a change publishes a new one); hold it for one operation, not for
    /// a connection's life.
    pub(crate) fn load(&self) -> arc_swap::Guard<Arc<State>> {
        self.state.load()
    }

    /// Change the model: waits for other writers, then gives the current
    /// snapshot; the first mutable use copies it, and the copy is published
    /// when the guard drops. Readers never wait for it.
    ///
    /// A reload holds the writers' lock for each step of its apply (a
    /// batch of tenants, or of services whose sockets it opens: seconds,
    /// with many), and the admin API writes from its handlers (a tenant's
    /// addition takes no edit lock first): the wait is off the runtime's
    /// worker, as [`Self::lock_edits`]'s.
    pub(crate) fn write(&self) -> StateWrite<'_> {
        self.write_with(lock_off_runtime(&self.writer, &self.writers_waiting))
    }

    /// [`Self::write`] if no other writer holds the model for `timeout`.
    #[cfg(test)]
    pub(crate) fn try_write_for(&self, timeout: Duration) -> Option<StateWrite<'_>> {
        let writer = self.writer.try_lock_for(timeout)?;
        Some(self.write_with(writer))
    }

    fn write_with<'a>(&'a self, writer: MutexGuard<'a, ()>) -> StateWrite<'a> {
        StateWrite {
            current: self.state.load_full(),
            next: None,
            model: self,
            _writer: writer,
        }
    }
}

/// `lock`, which a reload may hold for a while: taken at once when free;
/// otherwise, on a worker of a multi-thread runtime (the control
/// runtime's, for an admin API handler), waited for inside
/// [`tokio::task::block_in_place`], which moves the runtime's other tasks
/// (every other admin request, the health checks, the watchdog's
/// keep-alives) to another thread meanwhile; elsewhere (a blocking thread,
/// a plain thread) a plain wait. Only which thread waits changes.
/// `waiting` counts the callers waiting (what tests watch).
fn lock_off_runtime<'a>(lock: &'a Mutex<()>, waiting: &AtomicUsize) -> MutexGuard<'a, ()> {
    if let Some(g) = lock.try_lock() {
        return g;
    }
    waiting.fetch_add(1, Relaxed);
    let g = wait_off_runtime(|| lock.lock());
    waiting.fetch_sub(1, Relaxed);
    g
}

/// Runs `f`, which may wait a while for a lock another thread holds (or
/// walk a while), as [`lock_off_runtime`] waits: on a worker of a
/// multi-thread runtime inside [`tokio::task::block_in_place`], elsewhere
/// as it is.
fn wait_off_runtime<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        // block_in_place panics on a current-thread runtime, where
        // there is no other thread to move the tasks to anyway.
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// A change of the model in progress ([`Model::write`]): reads see the
/// snapshot (or the change so far), the first write copies it, and the copy
/// is published on drop — then, and only if something was written.
pub(crate) struct StateWrite<'a> {
    current: Arc<State>,
    next: Option<State>,
    model: &'a Model,
    _writer: MutexGuard<'a, ()>,
}

impl std::ops::Deref for StateWrite<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        self.next.as_ref().unwrap_or(&self.current)
    }
}

impl std::ops::DerefMut for StateWrite<'_> {
    fn deref_mut(&mut self) -> &mut State {
        let current = &self.current;
        #[cfg(test)]
        let copies = &self.model.copies;
        self.next.get_or_insert_with(|| {
            #[cfg(test)]
            copies.fetch_add(1, Relaxed);
            State::clone(current)
        })
    }
}

impl Drop for StateWrite<'_> {
    fn drop(&mut self) {
        // Still under the writers' lock (fields drop after this).
        if let Some(next) = self.next.take() {
            // Every edit of every test is checked as it is published.
            #[cfg(test)]
            if !std::thread::panicking() {
                next.services.assert_index_agrees();
            }
            self.model.state.store(Arc::new(next));
        }
    }
}

/// One version of the model. Cloning it copies the maps, not the tenants
/// and services (they are shared between versions).
#[derive(Debug, Default, Clone)]
pub(crate) struct State {
    pub(crate) tenants: BTreeMap<String, Arc<Tenant>>,
    /// By (tenant, name), and by id ([`Services::by_id`]).
    pub(crate) services: Services,
}

/// The services of a [`State`]: a map by (tenant, name) (what it derefs
/// to, read-only), an index of the same services by [`Service::id`], the
/// id a flow-table entry names its service by, and one by listen address.
///
/// Why the id index: settling removed entries (an expiry batch of up to 4,096,
/// a packet flow's kill, a new connection that finds a stale entry for its
/// key, each kill page with packet flows) needs each entry's service, and
/// building an id map of all services per call cost 9.4 ms at 100,000
/// services against 1.2 ms for a batch's own expiry work (expiry ~8x
/// slower), and put that cost on the data path for a stale key. Now each
/// entry is one look-up.
///
/// Why the address index: every add asks whether another service has its
/// address ([`Self::on_address`]) and whether one of ours overlaps it
/// ([`Self::serves_overlapping`]); a scan of all services for each made
/// adding S services O(S^2) (docs/BENCHMARKS.md, "Startup with thousands
/// of services").
///
/// Why a type of its own: the only ways to change it are [`Self::insert`]
/// and [`Self::remove`], which keep every map in step, so no index can
/// go stale whichever module edits the services. Ids are unique for the
/// daemon's life: a replaced service (same tenant and name, new address or
/// protocol) is a new [`Service`] with a new id, so the old id leaves the
/// index with it. A service's protocol and address never change (an edit
/// that changes them replaces the service), so where it is indexed stays
/// right.
#[derive(Debug, Default, Clone)]
pub(crate) struct Services {
    by_name: BTreeMap<(String, String), Arc<Service>>,
    by_id: HashMap<u32, Arc<Service>>,
    /// The services on each (protocol, IP, port) of their actual address:
    /// one, as a rule (port-0 services get a port of their own, see
    /// `open_sockets`), but a list, as the index must not lose a service
    /// whatever the kernel did. (By IP and port rather than `SocketAddr`:
    /// an IPv6 address's scope id does not make a separate port, see
    /// [`overlaps`].)
    by_addr: HashMap<(Protocol, IpAddr, u16), Vec<Arc<Service>>>,
    /// How many services listen on each (protocol, IPv6?, port): whether a
    /// wildcard address overlaps one of them.
    by_port: HashMap<(Protocol, bool, u16), usize>,
}

impl std::ops::Deref for Services {
    type Target = BTreeMap<(String, String), Arc<Service>>;

    fn deref(&self) -> &Self::Target {
        &self.by_name
    }
}

/// Where [`Services`] indexes `s` by address.
fn addr_key(s: &Service) -> (Protocol, IpAddr, u16) {
    (s.spec.read().protocol, s.listen.ip(), s.listen.port())
}

impl Services {
    /// The service with id `id` (one a flow-table entry names), if it is
    /// in this version of the model.
    pub(crate) fn by_id(&self, id: u32) -> Option<&Arc<Service>> {
        self.by_id.get(&id)
    }

    /// The services of `proto` listening on exactly `addr`.
    pub(crate) fn on_address(
        &self,
        proto: Protocol,
        addr: SocketAddr,
    ) -> impl Iterator<Item = &Arc<Service>> {
        self.by_addr
            .get(&(proto, addr.ip(), addr.port()))
            .into_iter()
            .flatten()
            .filter(move |s| s.listen == addr)
    }

    /// The service a connection (`proto`) to `addr` from this host would
    /// reach: one listening on exactly `addr`, or on the wildcard of its
    /// family at its port when `addr`'s IP is one of the host's
    /// (`is_local`, asked only then). IPv4-mapped IPv6 addresses count as
    /// the IPv4 address the kernel connects to.
    pub(crate) fn reached_at(
        &self,
        proto: Protocol,
        addr: SocketAddr,
        is_local: impl FnOnce(IpAddr) -> bool,
    ) -> Option<&Arc<Service>> {
        let ip = addr.ip().to_canonical();
        let at = |ip: IpAddr| {
            self.by_addr
                .get(&(proto, ip, addr.port()))
                .and_then(|l| l.first())
        };
        let any = match ip {
            IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        };
        at(ip).or_else(|| at(any).filter(|_| is_local(ip)))
    }

    /// Whether a service of `proto` listens on an address overlapping
    /// `addr` ([`overlaps`]): the same IP and port, or a wildcard of the
    /// same family on that port.
    pub(crate) fn serves_overlapping(&self, proto: Protocol, addr: SocketAddr) -> bool {
        let (ip, port) = (addr.ip(), addr.port());
        if ip.is_unspecified() {
            return self.by_port.contains_key(&(proto, ip.is_ipv6(), port));
        }
        let any = match ip {
            IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        };
        self.by_addr.contains_key(&(proto, ip, port))
            || self.by_addr.contains_key(&(proto, any, port))
    }

    /// Puts `svc` under `key`; returns the service it replaces there, if
    /// any (which leaves every index).
    pub(crate) fn insert(
        &mut self,
        key: (String, String),
        svc: Arc<Service>,
    ) -> Option<Arc<Service>> {
        let id = svc.id;
        let old = self.by_name.insert(key, svc.clone());
        if let Some(old) = &old {
            self.by_id.remove(&old.id);
            self.unindex_addr(old);
        }
        self.index_addr(&svc);
        let dup = self.by_id.insert(id, svc);
        debug_assert!(dup.is_none(), "service id {id} is in the model twice");
        debug_assert_eq!(self.by_name.len(), self.by_id.len());
        old
    }

    /// Takes the service under `key` out of every map.
    pub(crate) fn remove(&mut self, key: &(String, String)) -> Option<Arc<Service>> {
        let old = self.by_name.remove(key)?;
        self.by_id.remove(&old.id);
        self.unindex_addr(&old);
        debug_assert_eq!(self.by_name.len(), self.by_id.len());
        Some(old)
    }

    fn index_addr(&mut self, svc: &Arc<Service>) {
        let (proto, ip, port) = addr_key(svc);
        self.by_addr
            .entry((proto, ip, port))
            .or_default()
            .push(svc.clone());
        *self.by_port.entry((proto, ip.is_ipv6(), port)).or_default() += 1;
    }

    fn unindex_addr(&mut self, svc: &Service) {
        let (proto, ip, port) = addr_key(svc);
        if let std::collections::hash_map::Entry::Occupied(mut e) =
            self.by_addr.entry((proto, ip, port))
        {
            e.get_mut().retain(|s| s.id != svc.id);
            if e.get().is_empty() {
                e.remove();
            }
        }
        if let std::collections::hash_map::Entry::Occupied(mut e) =
            self.by_port.entry((proto, ip.is_ipv6(), port))
        {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
    }

    /// Panics unless the id index maps exactly the ids of the services by
    /// name, each to that very service, and the address indexes hold
    /// exactly the services by name, each where its protocol and address
    /// put it.
    #[cfg(test)]
    pub(crate) fn assert_index_agrees(&self) {
        let ids: std::collections::BTreeSet<u32> = self.by_name.values().map(|s| s.id).collect();
        assert_eq!(ids.len(), self.by_name.len(), "two services share an id");
        let indexed: std::collections::BTreeSet<u32> = self.by_id.keys().copied().collect();
        assert_eq!(indexed, ids, "the id index has other ids than the services");
        for (key, s) in &self.by_name {
            assert!(
                Arc::ptr_eq(&self.by_id[&s.id], s),
                "id {} is indexed to another service than {key:?}",
                s.id
            );
        }
        let mut by_addr: HashMap<_, Vec<u32>> = HashMap::new();
        let mut by_port: HashMap<_, usize> = HashMap::new();
        for s in self.by_name.values() {
            let (proto, ip, port) = addr_key(s);
            by_addr.entry((proto, ip, port)).or_default().push(s.id);
            *by_port.entry((proto, ip.is_ipv6(), port)).or_default() += 1;
        }
        let mut indexed: HashMap<_, Vec<u32>> = HashMap::new();
        for (k, list) in &self.by_addr {
            for s in list {
                assert!(
                    Arc::ptr_eq(&self.by_id[&s.id], s),
                    "{k:?} indexes a service that is not in the model"
                );
            }
            indexed.insert(*k, list.iter().map(|s| s.id).collect());
        }
        for list in by_addr.values_mut().chain(indexed.values_mut()) {
            list.sort_unstable();
        }
        assert_eq!(indexed, by_addr, "the address index has other services");
        assert_eq!(self.by_port, by_port, "the port counts are off");
    }
}

#[derive(Debug)]
pub(crate) struct Tenant {
    pub(crate) id: u32,
    /// Holds `id` while the tenant lives.
    _lease: IdLease,
    pub(crate) spec: RwLock<TenantSpec>,
    pub(crate) active: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) stat: Stat,
    /// "own" or "shared" (what the flow table granted).
    pub(crate) placement: String,
    /// `max_new_per_s`, as a token bucket.
    pub(super) new_conns: NewConnLimit,
    /// The daemon's clock (ms) before which an early drop does not look
    /// for a flow to take the place of again, having found none
    /// (`Shared::take_place`).
    pub(crate) early_drop_after: AtomicU64,
    /// New packet flows and UDP proxy sessions of the tenant that met a
    /// daemon-wide limit (the daemon's `max_connections`; for a session
    /// also the descriptors running out): how hard its clients (or a flood
    /// against it) press on those limits (`conns::Pressing`).
    pub(crate) at_daemon_limit: AtomicU64,
    pub(crate) deleted: CancellationToken,
    /// The ids of the tenant's backends, by address ([`BackendIds`]).
    pub(crate) backend_ids: BackendIds,
}

impl Tenant {
    /// Whether the early drop is resting for this tenant at `now`, having
    /// last found none of its flows to take (`Shared::take_place`).
    pub(crate) fn early_drop_resting(&self, now: Millis) -> bool {
        self.early_drop_after.load(Relaxed) > now.0
    }
}

/// One backend id per address in a tenant: every backend of the tenant's
/// services at one address has the same id (and lease) while any of them
/// lives. The flow table's reply key names a backend by its id, and its
/// contract ([`weir_flowtable::ReplyKey`]) is that a reply's source maps
/// to one id per tenant: with an id per service's backend, a packet from
/// a backend's address was looked up once per service there, and a
/// tenant's token can create services on any address (85 µs a spoofed
/// reply at 1,000). Lookups by id are all within one service, whose
/// backends have distinct addresses, so they are unaffected.
#[derive(Debug, Default)]
pub(crate) struct BackendIds {
    inner: Mutex<BackendIdsInner>,
}

#[derive(Debug, Default)]
struct BackendIdsInner {
    by_addr: HashMap<SocketAddr, std::sync::Weak<IdLease>>,
    /// The map's size at which the leases gone are swept out: twice what
    /// was left by the last sweep, so the map holds at most about twice
    /// the live ones, for O(1) a backend over time.
    sweep_at: usize,
}

impl BackendIds {
    /// The lease of the tenant's backends at `addr`: the live one, or a
    /// new one from `ids`. `taken` says whether the service the backend is
    /// for already has a backend with an id (one removed from `addr` whose
    /// connections may still be open): then the backend gets a lease of
    /// its own, unshared, so that the service's flows still find their
    /// backend by id (the tenant then has two ids at `addr` until the old
    /// one drains: two lookups for a reply).
    pub(crate) fn lease(
        &self,
        addr: SocketAddr,
        ids: &Arc<Ids>,
        taken: impl Fn(u32) -> bool,
    ) -> Arc<IdLease> {
        let mut g = self.inner.lock();
        if let Some(l) = g.by_addr.get(&addr).and_then(std::sync::Weak::upgrade) {
            if taken(l.id()) {
                return Arc::new(ids.lease());
            }
            return l;
        }
        if g.by_addr.len() >= g.sweep_at {
            g.by_addr.retain(|_, l| l.strong_count() > 0);
            g.sweep_at = (g.by_addr.len() * 2).max(64);
        }
        let l = Arc::new(ids.lease());
        g.by_addr.insert(addr, Arc::downgrade(&l));
        l
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().by_addr.len()
    }
}

#[derive(Debug)]
pub(crate) struct Service {
    pub(crate) id: u32,
    /// Holds `id` while the service lives (retiring services too: their
    /// flows' ends are settled on them by id).
    _lease: IdLease,
    pub(crate) tenant: Arc<Tenant>,
    pub(crate) spec: RwLock<ServiceSpec>,
    /// Parsed settings, replaced as a whole on edit; read without a lock.
    pub(crate) params: ArcSwap<ServiceParams>,
    /// Actual listen address (port 0 resolved).
    pub(crate) listen: SocketAddr,
    /// The `TCP_NOTSENT_LOWAT` its TCP listening sockets were opened with
    /// (accepted sockets inherit it); see `Tuning`.
    pub(crate) listener_lowat: u32,
    /// The backends and their scheduler, replaced as a whole when they or
    /// their weight or health change; read without a lock.
    pub(crate) set: ArcSwap<BackendSet>,
    /// Backends taken out of `set` whose connections may still be open:
    /// entries name their backend by id, and listings, backend filters
    /// (`conns`/`kill backend=ADDR`) and the settling of an ended flow
    /// find it here once it is out of `set` ([`Self::backend`]). Without
    /// it they listed as "-", no backend filter reached them, and their
    /// ends were counted on nothing. See [`Self::retire_backends`] for how
    /// long one stays.
    removed: Mutex<Vec<Arc<Backend>>>,
    /// Held (shared) by each walk of the service's persistence templates
    /// (`template_backends`): a test holds it to keep a walk going.
    #[cfg(test)]
    template_walk_gate: RwLock<()>,
    /// Walks of its persistence templates begun (tests).
    #[cfg(test)]
    template_walks: AtomicUsize,
    pub(crate) stat: Stat,
    /// Cancels listeners and health checks.
    pub(crate) cancel: CancellationToken,
    /// UDP sessions per client (for `udp_max_sessions_per_client`).
    pub(crate) udp_per_client: Mutex<ClientCounts>,
    /// Open TCP connections per client IP (for
    /// `tcp_max_connections_per_client`); an IP leaves when its count is 0.
    pub(super) tcp_per_client: Mutex<ClientCounts>,
    health_cancel: Mutex<CancellationToken>,
}

#[derive(Debug, Clone)]
pub(crate) struct ServiceParams {
    pub(crate) persistence: Duration,
    pub(crate) mask: AffinityMask,
    pub(crate) connect_timeout: Duration,
    pub(crate) expire_nodest_conn: bool,
    /// The service's own `udp_timeout`; `None` = its tenant's `udp` timeout.
    pub(crate) udp_timeout: Option<Duration>,
    pub(crate) udp_responses: Option<u32>,
    pub(crate) udp_max_per_client: u64,
    /// `tcp_max_connections_per_client`; 0 = unlimited.
    pub(crate) tcp_max_per_client: u64,
    /// `client_prefix6`: the per-client caps count an IPv6 client per
    /// this prefix.
    pub(crate) client_prefix6: u8,
    /// The flow table's timeout profile for these timeouts (see
    /// [`Shared::with_profile`]), held while these parameters live (the
    /// data path inserts under them); profile 0 until then.
    pub(crate) profile: weir_flowtable::Profile,
}

/// How a change of services is held to its tenant's `max_services` and
/// `max_backends`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Caps {
    /// Each change on its own (the API, the start).
    EachChange,
    /// A step of a reload: the file's totals were checked as a whole
    /// (`config::validate`), and its steps, applied in file order, may
    /// pass a cap on the way to a state within it (a backend moved from a
    /// service listed later to one listed earlier); the reload holds
    /// `Model::edits` meanwhile, so no API change counts on a step.
    WholeFile,
}

/// Refuses a new service `spec` when its tenant holds its `max_services`
/// already. `held` caches each tenant's count for a batch (counted from
/// the model once, O(its services); the caller adds each service it
/// opens). A service that exists, or a tenant that does not, is left to
/// `open_service`'s own errors.
fn service_quota(
    st: &State,
    spec: &ServiceSpec,
    held: &mut HashMap<String, u64>,
) -> crate::control::ControlResult<()> {
    use crate::control::{ControlError, ErrorKind};
    let Some(t) = st.tenants.get(&spec.tenant) else {
        return Ok(());
    };
    let max = t.spec.read().max_services;
    if max == 0
        || st
            .services
            .contains_key(&(spec.tenant.clone(), spec.name.clone()))
    {
        return Ok(());
    }
    let n = *held.entry(spec.tenant.clone()).or_insert_with(|| {
        st.services
            .range((spec.tenant.clone(), String::new())..)
            .take_while(|((t, _), _)| *t == spec.tenant)
            .count() as u64
    });
    if n >= max {
        return Err(ControlError::new(
            ErrorKind::Conflict,
            format!(
                "tenant {:?} holds {n} services, its max_services ({max}): delete one first, \
                 or raise the tenant's max_services",
                spec.tenant
            ),
        ));
    }
    Ok(())
}

/// Refuses a change that would leave tenant `tenant` holding more backends
/// than its `max_backends`: service `name` would have `after` backends
/// (replacing its current ones if it exists). A change that does not add
/// backends to the service passes, so a lowered cap keeps what is there.
/// `held` caches each tenant's total for a batch (counted from the model
/// once, O(its services); the caller keeps it up to date).
pub(super) fn backend_quota(
    st: &State,
    tenant: &str,
    name: &str,
    after: usize,
    held: &mut HashMap<String, u64>,
) -> crate::control::ControlResult<()> {
    use crate::control::{ControlError, ErrorKind};
    let Some(t) = st.tenants.get(tenant) else {
        return Ok(());
    };
    let max = t.spec.read().max_backends;
    if max == 0 {
        return Ok(());
    }
    let current = st
        .services
        .get(&(tenant.to_owned(), name.to_owned()))
        .map_or(0, |s| s.spec.read().backends.len() as u64);
    let after = after as u64;
    if after <= current {
        return Ok(());
    }
    let n = *held.entry(tenant.to_owned()).or_insert_with(|| {
        st.services
            .range((tenant.to_owned(), String::new())..)
            .take_while(|((t, _), _)| t == tenant)
            .map(|(_, s)| s.spec.read().backends.len() as u64)
            .sum()
    });
    let total = n - current + after;
    if total > max {
        return Err(ControlError::new(
            ErrorKind::Conflict,
            format!(
                "tenant {tenant:?} would hold {total} backends, over its max_backends ({max}): \
                 remove some first, or raise the tenant's max_backends"
            ),
        ));
    }
    Ok(())
}

#[derive(Debug)]
pub(crate) struct BackendSet {
    pub(crate) sched: Scheduler,
    pub(crate) backends: Vec<Arc<Backend>>,
}

#[derive(Debug)]
pub(crate) struct Backend {
    /// Flow-table id: never two live ones alike in one service or across
    /// tenants; the tenant's backends at one address share it
    /// ([`BackendIds`]).
    pub(crate) id: u32,
    /// Holds `id` while the backend lives, and while fnat ports taken for
    /// it are out (the packet path keeps a clone: their release finds the
    /// backend's address by its id).
    pub(crate) lease: Arc<IdLease>,
    pub(crate) addr: SocketAddr,
    pub(crate) spec: RwLock<BackendSpec>,
    pub(crate) weight: AtomicU32,
    /// `spec.max_connections` (0: no limit), set with the spec and read
    /// without its lock: every pick asks each backend the scheduler looks
    /// at whether it is full (`wlc`: every backend), and a read of the
    /// spec's lock writes the lock's word, a cache line the workers would
    /// pass around per backend per connection.
    pub(crate) max_connections: AtomicU64,
    pub(crate) up: AtomicBool,
    pub(crate) checked: AtomicBool,
    pub(crate) last_error: Mutex<Option<String>>,
    /// The passive check (failed connects in a row), and why it last took
    /// the backend out.
    pub(crate) passive: crate::health::Passive,
    pub(crate) passive_error: Mutex<Option<String>>,
    /// Established TCP connections (IPVS ActConn): what the schedulers
    /// weigh and the API lists, with `inactive`.
    pub(crate) active: AtomicU64,
    /// Other TCP connections and UDP sessions (IPVS InActConn).
    pub(crate) inactive: AtomicU64,
    /// Connections counted against `max_connections`. At rest it equals
    /// `active` plus `inactive`, but it is not redundant with them, and
    /// neither can be derived from the other two:
    /// - Taking a place is one atomic step on it ([`Self::take_place`]):
    ///   checking the sum of two counters and then adding let two workers
    ///   both take the last place.
    /// - A place is taken before the connection's entry exists and counts
    ///   until the entry is settled; `active`/`inactive` count the entry
    ///   from its insert. In between (an fnat port taken, an insert that
    ///   may fail) the place is held and the flow is in neither.
    /// - A state move is two steps on `active` and `inactive` (one up, one
    ///   down), so their sum is off by one meanwhile, and either can read
    ///   below 0 for a moment (see [`Self::active()`]); `conns` does not
    ///   move with the state, so the cap never sees a flow twice or not
    ///   at all.
    ///
    /// It is also what keeps a removed backend in its service while its
    /// connections are open (`Service::retire_backends`).
    conns: AtomicU64,
    pub(crate) stat: Stat,
}

/// Ids of tenants, services or backends. They are 32-bit (the flow
/// table's 128-byte entries store them: [`TenantId`], [`ServiceId`],
/// [`BackendId`]), so a counter wraps after 2^32 creations: from then on
/// it skips 0 (none) and every id still leased. It was a bare counter,
/// which gave live ids again once it wrapped.
pub(crate) struct Ids {
    inner: Mutex<IdsInner>,
}

impl std::fmt::Debug for Ids {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = self.inner.lock();
        f.debug_struct("Ids")
            .field("next", &g.next)
            .field("live", &g.live.len())
            .finish()
    }
}

struct IdsInner {
    next: u32,
    live: std::collections::HashSet<u32>,
}

/// An id given by [`Ids::lease`]; free again when dropped.
pub(crate) struct IdLease {
    id: u32,
    ids: Arc<Ids>,
}

impl std::fmt::Debug for IdLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("IdLease").field(&self.id).finish()
    }
}

impl Ids {
    pub(crate) fn new() -> Arc<Ids> {
        Arc::new(Ids {
            inner: Mutex::new(IdsInner {
                next: 1,
                live: Default::default(),
            }),
        })
    }

    /// The next id not in use (never 0).
    pub(crate) fn lease(self: &Arc<Self>) -> IdLease {
        let mut g = self.inner.lock();
        let g = &mut *g;
        // Ends within `live.len() + 2` steps: a leased id is an object of
        // the model, so far fewer than 2^32 - 1 are.
        loop {
            let id = g.next;
            g.next = g.next.checked_add(1).unwrap_or(1);
            if id != 0 && g.live.insert(id) {
                return IdLease {
                    id,
                    ids: Arc::clone(self),
                };
            }
        }
    }

    /// Where the next [`lease`](Self::lease) starts looking.
    #[cfg(test)]
    pub(crate) fn next(&self) -> u32 {
        self.inner.lock().next
    }

    #[cfg(test)]
    pub(crate) fn set_next(&self, next: u32) {
        self.inner.lock().next = next;
    }

    /// Whether `id` is leased now.
    #[cfg(test)]
    pub(crate) fn leased(&self, id: u32) -> bool {
        self.inner.lock().live.contains(&id)
    }
}

impl IdLease {
    pub(crate) fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for IdLease {
    fn drop(&mut self) {
        self.ids.inner.lock().live.remove(&self.id);
    }
}

/// Backend ids (one counter for the process, as they were).
static BACKEND_IDS: std::sync::LazyLock<Arc<Ids>> = std::sync::LazyLock::new(Ids::new);

/// A count that a racing move took below 0 (wrapped) reads as 0.
fn clamp_count(v: u64) -> u64 {
    if v > i64::MAX as u64 { 0 } else { v }
}

impl Backend {
    /// A backend of one of `tenant`'s services: its id is the one of the
    /// tenant's other backends at its address ([`BackendIds`]), unless
    /// `taken` says the service has a backend with that id already.
    pub(crate) fn new(
        spec: BackendSpec,
        rates: &stats::RateEngine,
        tenant: &Tenant,
        taken: impl Fn(u32) -> bool,
    ) -> Arc<Self> {
        let lease = tenant.backend_ids.lease(spec.address, &BACKEND_IDS, taken);
        Self::with_lease(spec, rates, lease)
    }

    /// A backend with an id of its own from `ids`.
    #[cfg(test)]
    pub(crate) fn new_in(
        spec: BackendSpec,
        rates: &stats::RateEngine,
        ids: &Arc<Ids>,
    ) -> Arc<Self> {
        Self::with_lease(spec, rates, Arc::new(ids.lease()))
    }

    fn with_lease(spec: BackendSpec, rates: &stats::RateEngine, lease: Arc<IdLease>) -> Arc<Self> {
        Arc::new(Self {
            id: lease.id(),
            lease,
            addr: spec.address,
            weight: AtomicU32::new(spec.weight),
            max_connections: AtomicU64::new(spec.max_connections),
            spec: RwLock::new(spec),
            up: AtomicBool::new(true),
            checked: AtomicBool::new(false),
            last_error: Mutex::new(None),
            passive: Default::default(),
            passive_error: Mutex::new(None),
            active: AtomicU64::new(0),
            inactive: AtomicU64::new(0),
            conns: AtomicU64::new(0),
            stat: rates.stat(),
        })
    }

    pub(super) fn info(&self) -> BackendInfo {
        BackendInfo {
            addr: self.addr.into(),
            weight: self.weight.load(Relaxed),
            up: self.up.load(Relaxed) && !self.passive.is_down(),
        }
    }

    /// Its established TCP connections (IPVS ActConn), as the scheduler
    /// and the API read them. The counts move in two steps (the table's
    /// state, then the count), so a move racing the entry's removal can
    /// take one below 0 for a moment (the remover settles the new state
    /// before the mover counts it): read as 0 then, not as 2^64 - 1.
    pub(crate) fn active(&self) -> u64 {
        clamp_count(self.active.load(Relaxed))
    }

    /// Its other TCP connections and UDP sessions (IPVS InActConn); as
    /// [`Self::active`].
    pub(crate) fn inactive(&self) -> u64 {
        clamp_count(self.inactive.load(Relaxed))
    }

    /// Its connections and sessions, open or opening (the places taken
    /// under `max_connections`; see the field for why it is a counter of
    /// its own).
    pub(crate) fn conns(&self) -> u64 {
        self.conns.load(Relaxed)
    }

    /// Takes a place under `max_connections` (0: no limit) for a connection
    /// about to open; false when it is full, e.g. when another worker took
    /// the last place after [`Service::choose`] saw it free. Given back by
    /// [`Self::give_place`] when the connection's entry is settled, or when
    /// it does not open after all.
    #[must_use]
    pub(crate) fn take_place(&self) -> bool {
        let max = self.max_connections.load(Relaxed);
        let prev = self.conns.fetch_add(1, Relaxed);
        if max != 0 && prev >= max {
            self.conns.fetch_sub(1, Relaxed);
            return false;
        }
        true
    }

    pub(crate) fn give_place(&self) {
        self.conns.fetch_sub(1, Relaxed);
    }
}

impl Shared {
    /// The passive check: a connect to `b` failed with `why`. A streak of
    /// failures takes the backend out of `svc`'s scheduler for
    /// [`crate::health::PASSIVE_HOLD`], then it is tried again.
    pub(crate) fn connect_failed(&self, svc: &Arc<Service>, b: &Arc<Backend>, why: &str) {
        use crate::health::{PASSIVE_FALL, PASSIVE_HOLD};
        if !b.passive.on_failure() {
            return;
        }
        let n = b.passive.failures().max(PASSIVE_FALL);
        let msg = format!(
            "passive check: {n} connects in a row failed (last: {why}); out for {}s, then tried again",
            PASSIVE_HOLD.as_secs()
        );
        tracing::warn!(backend = %b.addr, "{msg}");
        *b.passive_error.lock() = Some(msg);
        svc.rebuild_sched();
        let (weak_svc, weak_b) = (Arc::downgrade(svc), Arc::downgrade(b));
        let cancel = svc.cancel.clone();
        self.control_rt.spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = tokio::time::sleep(PASSIVE_HOLD) => {
                    if let (Some(svc), Some(b)) = (weak_svc.upgrade(), weak_b.upgrade()) {
                        b.passive.restore();
                        svc.rebuild_sched();
                    }
                }
            }
        });
    }

    /// A new connection of `client` to backend `backend` holds its
    /// persistence template (IPVS's `n_control`: the table never expires
    /// a held template), storing it held if there is none; returns its
    /// key, or `None` if it holds nothing (the table is full, or the
    /// service's persistence changed or the service was deleted
    /// meanwhile). Every `Some` must be
    /// given back with [`Self::release_template`]. The hold names the
    /// template by its cookie as well as its key, so that its release
    /// cannot take a hold of a newer template stored under the key.
    pub(crate) fn hold_template(
        &self,
        svc: &Service,
        params: &ServiceParams,
        proto: Protocol,
        client: SocketAddr,
        backend: u32,
    ) -> Option<HeldTemplate> {
        let tpl = template_key(svc, params, proto, client);
        let table = &self.conns.table;
        let now = Millis(self.now_ms());
        let mut held = None;
        // Two rounds: a template expired or stored by another connection
        // between our hold and our insert is found the second time.
        for _ in 0..2 {
            // Only a template of this service: another's under the same
            // key (see `choose`) is left alone, so this holds nothing.
            match table.hold_for_cookie(&tpl, ServiceId(svc.id)) {
                Some((b, cookie)) => {
                    if b.0 != backend {
                        // Another connection of the group moved it
                        // meanwhile; the latest placement wins, as in IPVS.
                        table.rebind_for(&tpl, ServiceId(svc.id), BackendId(backend), now);
                    }
                    held = Some(cookie);
                    break;
                }
                None => {
                    let init = FlowInit {
                        owner: 0,
                        profile: params.profile.for_init(),
                        service: ServiceId(svc.id),
                        backend: BackendId(backend),
                        state: FlowState::Persist,
                    };
                    match table.insert_held(tpl, init, now) {
                        Ok(h) => {
                            held = Some(h.cookie);
                            break;
                        }
                        Err(weir_flowtable::InsertError::Exists(_)) => continue,
                        Err(_) => {
                            tracing::debug!("persistence template not stored (table full)");
                            return None;
                        }
                    }
                }
            }
        }
        let cookie = held?;
        // Deleted (or replaced) meanwhile: the hold is given back first
        // (a template that stays is not ours to keep held), then the
        // template goes, as the deletion's drop would have taken it.
        if self.cancelled_after_store(svc) {
            table.release_cookie(&tpl, cookie, now);
            self.remove_template_of(svc, &tpl);
            return None;
        }
        // An edit that changes the template's key (mask) or turns
        // persistence off stores the new parameters, then drops the
        // service's templates: if it stored them before this load, give
        // the hold back now (its release would compute another key); if
        // after, its drop takes this template, so the hold cannot outlive
        // the key its release computes.
        let cur = svc.params.load();
        if cur.persistence.is_zero() || cur.mask != params.mask {
            table.release_cookie(&tpl, cookie, now);
            return None;
        }
        Some(HeldTemplate { key: tpl, cookie })
    }

    /// A template of `svc` was just stored: whether `svc` was deleted (or
    /// replaced) meanwhile, so that the caller removes it again
    /// ([`Self::remove_template_of`]). A deletion cancels the service,
    /// then drops its templates ([`Self::drop_templates`]): one stored
    /// after that drop stayed until its persistence timeout, counting
    /// against the tenant's table. Stored, then read the cancel: the fence
    /// pairs with the one after the cancel (`Shared::take_services`, a
    /// replacing put), so that either the drop sees the template or this
    /// sees the cancel (as `open` does for a connection's entry).
    pub(super) fn cancelled_after_store(&self, svc: &Service) -> bool {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        svc.cancel.is_cancelled()
    }

    /// Removes the template `tpl` if it is one of `svc`'s (as
    /// [`Self::drop_templates`] would have); another service's stays.
    pub(super) fn remove_template_of(&self, svc: &Service, tpl: &FlowKey) {
        let table = &self.conns.table;
        if let Some(t) = table.get(tpl)
            && t.state == FlowState::Persist
            && t.service == ServiceId(svc.id)
        {
            table.remove_cookie(tpl, t.cookie);
        }
    }

    /// Services or their backends changed: packet workers take a new
    /// snapshot, and the steering maps follow.
    pub(crate) fn services_changed(&self) {
        self.model
            .services_gen
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        if let Some(rt) = self.packet_rt.get() {
            // Build the workers' new snapshot here, once, so that none of
            // them stalls its receive ring building it (at start-up, before
            // the workers run, the first of them builds it once instead).
            if let Some(path) = self.packet.get() {
                path.vips(self);
            }
            rt.sync(self);
        }
    }

    /// A connection holding template `tpl` ([`Self::hold_template`])
    /// ended; after the last one the template's timeout starts now. Only
    /// the template it held is released: it may have been dropped
    /// meanwhile (a deletion, an edit of its persistence) and another
    /// stored under the same key, another service's or a newer one of
    /// this service's, whose holds are its own connections'. A release
    /// that matched the key and the service took a newer template's hold,
    /// which could then expire under the connection holding it.
    pub(crate) fn release_template(&self, _svc: &Service, tpl: HeldTemplate) {
        self.conns
            .table
            .release_cookie(&tpl.key, tpl.cookie, Millis(self.now_ms()));
    }

    /// [`Self::release_template`] for a holder that kept only the key and
    /// the template's tag (a packet flow, whose entry has room for 29 bits,
    /// not for the cookie: see [`HeldTemplate::tag`]): the template of
    /// `svc` under `key` if its tag is `tag`. A newer template under the
    /// key has its own cookie, so its holds stay its own flows'.
    pub(crate) fn release_template_tagged(&self, svc: &Service, key: FlowKey, tag: u32) {
        let table = &self.conns.table;
        if let Some(t) = table.get(&key)
            && t.state == FlowState::Persist
            && t.service == ServiceId(svc.id)
            && template_tag(t.cookie) == tag
        {
            // By the cookie read: if the template went since, nothing.
            table.release_cookie(&key, t.cookie, Millis(self.now_ms()));
        }
    }

    /// Removes the persistence templates of `svc` (its mask changed,
    /// persistence was turned off, or it was deleted): clients are placed
    /// afresh, and a hold taken under the old parameters ends with its
    /// template (see [`Self::hold_template`]).
    pub(crate) fn drop_templates(&self, svc: &Service) -> u64 {
        let filter = weir_flowtable::DumpFilter {
            tenant: Some(TenantId(svc.tenant.id)),
            service: Some(ServiceId(svc.id)),
            state: Some(FlowState::Persist),
            ..Default::default()
        };
        let table = &self.conns.table;
        let (mut cursor, mut page, mut n) = (None, Vec::new(), 0);
        loop {
            page.clear();
            let more = table.dump_page(&mut cursor, &filter, 4096, &mut page);
            for s in &page {
                n += u64::from(table.remove_cookie(&s.key, s.cookie).is_some());
            }
            if !more {
                return n;
            }
        }
    }

    // -- tenants ----------------------------------------------------------

    /// Adds tenant `spec` ([`Self::add_tenants`] with a batch of one).
    pub(crate) fn add_tenant(&self, spec: TenantSpec) -> crate::control::ControlResult<()> {
        match self.add_tenants(vec![spec]).pop() {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// Adds the tenants of `specs` in order, each as one add after another
    /// would, with one copy of the model and one of the flow table's tenant
    /// directory ([`weir_flowtable::FlowTable::add_tenants`]) for the
    /// batch, published once. Returns each failure with the index of its
    /// spec, in order. Adding tenants one write at a time copied both per
    /// tenant, which made a start or reload with T tenants O(T^2)
    /// (docs/BENCHMARKS.md, "Startup with thousands of services", its
    /// tenants part: 10,000 tenants took 5.8-11.9 s to start).
    ///
    /// A spec fails as a lone add would: invalid, or named as a tenant of
    /// the model or an earlier tenant of the batch (Conflict). A failed
    /// one leaves nothing behind: it never reaches the flow table, or, if
    /// the table refuses it, never reaches the model. (Names conflict
    /// before the table is asked, so a spec the table refused would still
    /// make a later one of its name conflict, which one add after another
    /// would not; but the table refuses only an id it has, and ids are
    /// new, or a size [`check_new_tenant`] refuses first.)
    pub(crate) fn add_tenants(
        &self,
        specs: Vec<TenantSpec>,
    ) -> Vec<(usize, crate::control::ControlError)> {
        use crate::control::{ControlError, ErrorKind};
        let mut errors = Vec::new();
        // Before the writers' lock: these checks need no model.
        let mut checked = Vec::with_capacity(specs.len());
        for (i, spec) in specs.into_iter().enumerate() {
            match check_new_tenant(&spec) {
                Ok(timeouts) => checked.push((i, spec, timeouts)),
                Err(e) => errors.push((i, e)),
            }
        }
        let mut st = self.model.write();
        // The names the batch adds so far: a later spec of one of them
        // conflicts, as it would once the earlier one was in the model.
        let mut in_batch = std::collections::HashSet::new();
        let mut adds = Vec::with_capacity(checked.len());
        let mut configs = Vec::with_capacity(checked.len());
        for (i, spec, timeouts) in checked {
            if st.tenants.contains_key(&spec.name) || !in_batch.insert(spec.name.clone()) {
                errors.push((
                    i,
                    ControlError::new(
                        ErrorKind::Conflict,
                        format!("tenant {:?} exists", spec.name),
                    ),
                ));
                continue;
            }
            let lease = self.model.ids.lease();
            configs.push((
                TenantId(lease.id()),
                TenantConfig {
                    own_buckets: spec.table_entries,
                    max_entries: spec.max_table_entries,
                    timeouts,
                },
            ));
            adds.push((i, lease, spec));
        }
        let placed = if configs.is_empty() {
            Vec::new()
        } else {
            // The table's maintenance lock, which a tenant's removal (a
            // pass over the table's filing lists) or an expiry pass may
            // hold for a while: waited for off the control runtime's
            // worker, as the writers' lock is.
            self.model.table_adds.fetch_add(1, Relaxed);
            let placed = wait_off_runtime(|| self.conns.table.add_tenants(&configs));
            self.model.table_adds.fetch_sub(1, Relaxed);
            placed
        };
        for ((i, lease, spec), placement) in adds.into_iter().zip(placed) {
            let placement = match placement {
                Ok(weir_flowtable::Placement::Own { .. }) => "own".to_owned(),
                Ok(weir_flowtable::Placement::Shared { requested, reason }) => {
                    if requested != 0 {
                        tracing::warn!(tenant = %spec.name, requested, %reason, "tenant shares the global flow table");
                    }
                    "shared".to_owned()
                }
                Err(e) => {
                    errors.push((i, ControlError::new(ErrorKind::Invalid, e.to_string())));
                    continue;
                }
            };
            let t = Arc::new(Tenant {
                id: lease.id(),
                _lease: lease,
                placement,
                spec: RwLock::new(spec),
                active: AtomicU64::new(0),
                refused: AtomicU64::new(0),
                stat: self.accounting.rates.stat(),
                new_conns: NewConnLimit::default(),
                early_drop_after: AtomicU64::new(0),
                at_daemon_limit: AtomicU64::new(0),
                deleted: CancellationToken::new(),
                backend_ids: BackendIds::default(),
            });
            let name = t.spec.read().name.clone();
            st.tenants.insert(name, t);
        }
        // Published here (only if a tenant was added).
        drop(st);
        errors.sort_by_key(|(i, _)| *i);
        errors
    }

    // -- services ---------------------------------------------------------

    /// Why this daemon cannot serve `spec` (a valid spec: [`check_service`]
    /// passed), or `None`. The one place that decides whether a packet
    /// service (`forward` other than proxy) may be added: every path that
    /// adds or replaces a service (start, reload, the API) asks it before
    /// opening anything, so a packet service never gets proxy sockets.
    pub(crate) fn packet_mode_unavailable(&self, spec: &ServiceSpec) -> Option<String> {
        (spec.forward.is_packet() && self.packet.get().is_none()).then(|| {
            format!(
                "forward = \"{}\" needs packet mode, and this daemon runs without it: \
                 add a [packet] section naming its interfaces and restart \
                 (or use forward = \"proxy\")",
                spec.forward
            )
        })
    }

    pub(crate) fn add_service(
        self: &Arc<Self>,
        spec: ServiceSpec,
    ) -> crate::control::ControlResult<()> {
        // (`max_services` is checked in `put_services`.)
        self.put_service(spec, false)
    }

    /// Add `spec`, or with `replace` swap it in for the live service of the
    /// same tenant and name (a new address or protocol). Every check runs
    /// and the new sockets are open before anything changes, so on any
    /// error the running service is untouched; on success the replaced
    /// service stops listening and its connections close.
    pub(crate) fn put_service(
        self: &Arc<Self>,
        spec: ServiceSpec,
        replace: bool,
    ) -> crate::control::ControlResult<()> {
        self.put_service_with(spec, replace, Caps::EachChange)
    }

    /// [`Self::put_service`], its tenant's caps checked as `caps` says.
    pub(crate) fn put_service_with(
        self: &Arc<Self>,
        spec: ServiceSpec,
        replace: bool,
        caps: Caps,
    ) -> crate::control::ControlResult<()> {
        match self.put_services(vec![spec], replace, true, caps).pop() {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// Adds `specs` in order, each as [`Self::add_service`] would, as one
    /// change of the model (see [`Self::put_services`]). Returns each
    /// failure with the index of its spec; with `stop_at_error`, nothing
    /// after the first failure is tried (what came before it is added).
    pub(crate) fn add_services(
        self: &Arc<Self>,
        specs: Vec<ServiceSpec>,
        stop_at_error: bool,
    ) -> Vec<(usize, crate::control::ControlError)> {
        self.put_services(specs, false, stop_at_error, Caps::EachChange)
    }

    /// [`Self::add_services`] for a reload's step ([`Caps::WholeFile`]):
    /// none stops the others.
    pub(crate) fn add_services_of_file(
        self: &Arc<Self>,
        specs: Vec<ServiceSpec>,
    ) -> Vec<(usize, crate::control::ControlError)> {
        self.put_services(specs, false, false, Caps::WholeFile)
    }

    /// [`Self::put_service`] for each of `specs` in order, under one hold
    /// of the writers' lock and one copy of the model, published once at
    /// the end. Adding services one write at a time copied the whole model
    /// per service, which made a start with S services O(S^2)
    /// (docs/BENCHMARKS.md, "Startup with thousands of services").
    ///
    /// Each spec is checked and its sockets opened against the model with
    /// the batch's earlier services in it, so it fails or succeeds as it
    /// would have one at a time, and a failed one changes nothing. Readers
    /// see the whole batch or none of it; other writers wait for it.
    fn put_services(
        self: &Arc<Self>,
        specs: Vec<ServiceSpec>,
        replace: bool,
        stop_at_error: bool,
        caps: Caps,
    ) -> Vec<(usize, crate::control::ControlError)> {
        let mut errors = Vec::new();
        // Before the writers' lock: these checks need no model, and the
        // wait may take seconds, while every admin change needs that lock.
        // One deadline for the batch: what is waited for is sockets that
        // were already closing when it began.
        let deadline = Instant::now() + OWN_RELEASE_WAIT;
        let mut checked = Vec::with_capacity(specs.len());
        for (i, spec) in specs.into_iter().enumerate() {
            let r = self.check_new_service(&spec);
            let failed = r.is_err();
            if !failed {
                self.wait_for_own_release(spec.protocol, spec.listen, deadline);
            }
            checked.push((i, r.map(|params| (spec, params))));
            if failed && stop_at_error {
                break;
            }
        }
        let mut st = self.model.write();
        self.model
            .listen_groups
            .lock()
            .retain(|(_, _, s)| s.strong_count() > 0);
        let mut opened = Vec::new();
        // Services each tenant of the batch holds, counted when a tenant
        // with a `max_services` first adds one, then kept up to date.
        let mut held: HashMap<String, u64> = HashMap::new();
        // Likewise their backends, for a `max_backends`.
        let mut held_backends: HashMap<String, u64> = HashMap::new();
        for (i, r) in checked {
            let r = r.and_then(|(spec, params)| {
                if caps == Caps::EachChange {
                    if !replace {
                        service_quota(&st, &spec, &mut held)?;
                    }
                    backend_quota(
                        &st,
                        &spec.tenant,
                        &spec.name,
                        spec.backends.len(),
                        &mut held_backends,
                    )?;
                    #[cfg(test)]
                    self.model.service_caps_checked();
                }
                self.open_service(&st, spec, params, replace)
            });
            match r {
                Ok(Opened { key, svc, sockets }) => {
                    if let Some(n) = held.get_mut(&key.0) {
                        *n += 1;
                    }
                    if let Some(n) = held_backends.get_mut(&key.0) {
                        *n += svc.spec.read().backends.len() as u64;
                        if let Some(old) = st.services.get(&key) {
                            *n -= old.spec.read().backends.len() as u64;
                        }
                    }
                    let replaced = st.services.insert(key, svc.clone());
                    // Before it leaves the published snapshot.
                    self.model.retiring.lock().extend(replaced.clone());
                    opened.push((svc, sockets, replaced));
                }
                Err(e) => {
                    errors.push((i, e));
                    if stop_at_error {
                        break;
                    }
                }
            }
        }
        // Publish. Every service of the batch has its sockets open (their
        // connections and datagrams wait in the kernel), and the workers
        // get them only now, so no connection exists for a service the
        // model does not have yet: one that ended would not be settled
        // (see `Shared::ended_in`).
        drop(st);
        if opened.is_empty() {
            return errors;
        }
        let mut replaced = Vec::new();
        for (svc, sockets, old) in opened {
            for (tx, sock) in self.workers.iter().zip(sockets) {
                let _ = tx.send(WorkerCmd::Listen {
                    shared: self.clone(),
                    service: svc.clone(),
                    socket: sock,
                });
            }
            self.start_health(&svc);
            let spec = svc.spec.read();
            tracing::info!(tenant = %spec.tenant, service = %spec.name, listen = %svc.listen, "service up");
            replaced.extend(old);
        }
        self.services_changed();
        for old in replaced {
            old.cancel.cancel();
            // See `take_services`.
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            self.kill_service(&old, None, Close::ServiceDeleted);
            // As a deletion does: the kill leaves templates (no owner),
            // and the new service, a new id, neither lists nor drops them.
            self.drop_templates(&old);
            self.retired(std::slice::from_ref(&old));
        }
        errors
    }

    /// Removes the services under `keys` (those that exist) as one change
    /// of the model, then, service by service, stops it (its listeners and
    /// health checks end with its cancel token), tells its connections to
    /// close ([`Close::ServiceDeleted`]) and drops its persistence
    /// templates. Returns, per key, how many connections it told, or `None`
    /// for a key no service had.
    ///
    /// As for one removal, every service leaves the model (and the packet
    /// workers' snapshot, [`Self::services_changed`]) before its sockets
    /// close and its connections are told. Removing them one write at a
    /// time copied the whole model per service: deleting a tenant with k
    /// services, or a reload removing k, was O(k x services)
    /// (docs/BENCHMARKS.md, "Startup with thousands of services").
    pub(crate) fn remove_services(&self, keys: &[(String, String)]) -> Vec<Option<u64>> {
        self.take_services(keys)
            .into_iter()
            .map(|svc| {
                let svc = svc?;
                let told = self.kill_service(&svc, None, Close::ServiceDeleted);
                self.drop_templates(&svc);
                self.retired(std::slice::from_ref(&svc));
                Some(told)
            })
            .collect()
    }

    /// Takes the services `keys` name out of the model in one change (see
    /// [`Self::remove_services`]) and stops them (their listeners and
    /// sockets close), but leaves their flow-table entries alone: for a
    /// caller that removes those another way (a tenant's deletion purges
    /// its whole table at once). Returns each service taken, or `None`.
    pub(crate) fn take_services(&self, keys: &[(String, String)]) -> Vec<Option<Arc<Service>>> {
        let removed: Vec<Option<Arc<Service>>> = {
            let mut st = self.model.write();
            let removed: Vec<_> = keys
                .iter()
                .map(|k| {
                    // Only a key that is there copies the model.
                    st.services.get(k)?;
                    st.services.remove(k)
                })
                .collect();
            // Before they leave the published snapshot; the caller ends
            // their flows, then calls `retired`.
            self.model
                .retiring
                .lock()
                .extend(removed.iter().flatten().cloned());
            removed
        };
        if removed.iter().any(Option::is_some) {
            self.services_changed();
        }
        for svc in removed.iter().flatten() {
            svc.cancel.cancel();
        }
        // The cancels before the caller's walk of the table: pairs with the
        // fence in the packet path's `open` (its insert, then its check of
        // the cancel), so that either the walk sees that flow or `open`
        // sees the cancel and ends it. Without both fences each side could
        // read the other's old value (a store may pass a later load).
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        removed
    }

    /// The flows of `services`, taken out of the model, are all ended:
    /// they leave [`Model::retiring`].
    pub(crate) fn retired(&self, services: &[Arc<Service>]) {
        if services.is_empty() {
            return;
        }
        self.model
            .retiring
            .lock()
            .retain(|r| !services.iter().any(|s| Arc::ptr_eq(r, s)));
    }

    /// What [`Self::put_services`] checks of a spec before the writers'
    /// lock: it is valid, and this daemon can serve it. Returns its
    /// parameters.
    fn check_new_service(
        &self,
        spec: &ServiceSpec,
    ) -> crate::control::ControlResult<ServiceParams> {
        use crate::control::{ControlError, ErrorKind};
        check_service(spec, self.packet_cfg.as_ref())?;
        if let Some(why) = self.packet_mode_unavailable(spec) {
            return Err(ControlError::new(ErrorKind::Unavailable, why));
        }
        service_params(spec)
    }

    /// The service `spec` would be in `st` (under the returned key), with
    /// its sockets open, if every check passes; changes nothing in `st`.
    /// With `replace`, a live service of the same tenant and name must
    /// exist (it is the one replaced), without, none may.
    fn open_service(
        &self,
        st: &State,
        spec: ServiceSpec,
        params: ServiceParams,
        replace: bool,
    ) -> crate::control::ControlResult<Opened> {
        use crate::control::{ControlError, ErrorKind};
        let Some(tenant) = st.tenants.get(&spec.tenant).cloned() else {
            return Err(ControlError::new(
                ErrorKind::NotFound,
                format!("tenant {:?} does not exist; create it first", spec.tenant),
            ));
        };
        let key = (spec.tenant.clone(), spec.name.clone());
        let old_id = st.services.get(&key).map(|s| s.id);
        match (old_id, replace) {
            (Some(_), false) => {
                return Err(ControlError::new(
                    ErrorKind::Conflict,
                    format!("service {}/{} exists", spec.tenant, spec.name),
                ));
            }
            (None, true) => {
                return Err(ControlError::new(
                    ErrorKind::NotFound,
                    format!("service {}/{} does not exist", spec.tenant, spec.name),
                ));
            }
            _ => {}
        }
        if spec.listen.port() != 0
            && st
                .services
                .on_address(spec.protocol, spec.listen)
                .any(|s| Some(s.id) != old_id)
        {
            return Err(ControlError::new(
                ErrorKind::Conflict,
                format!("{} is used by another service", spec.listen),
            ));
        }
        let packet_mode = spec.forward.is_packet();
        // Packet services own no socket: the steering program hands their
        // packets to the packet workers.
        let listener_lowat = self.tuning.get().notsent_lowat;
        let (sockets, listen) = if packet_mode {
            (Vec::new(), spec.listen)
        } else {
            self.claim_listen(st, spec.protocol, spec.listen)
                .and_then(|()| {
                    open_sockets(
                        spec.protocol,
                        spec.listen,
                        self.workers.len(),
                        listener_lowat,
                    )
                })
                .map_err(|e| {
                    ControlError::new(
                        ErrorKind::Unavailable,
                        format!(
                            "cannot listen on {} {}: {e}",
                            config::protocol_name(spec.protocol),
                            spec.listen
                        ),
                    )
                })?
        };
        let backends: Vec<Arc<Backend>> = spec
            .backends
            .iter()
            .cloned()
            .map(|b| Backend::new(b, &self.accounting.rates, &tenant, |_| false))
            .collect();
        let sched = build_sched(&spec, &backends)?;
        let params = Arc::new(self.with_profile(&tenant, params)?);
        let prefix6 = params.client_prefix6;
        let protocol = spec.protocol;
        let lease = self.model.ids.lease();
        let svc = Arc::new(Service {
            id: lease.id(),
            _lease: lease,
            tenant,
            spec: RwLock::new(ServiceSpec { listen, ..spec }),
            params: ArcSwap::new(params),
            listen,
            listener_lowat,
            set: ArcSwap::from_pointee(BackendSet { sched, backends }),
            removed: Mutex::default(),
            #[cfg(test)]
            template_walk_gate: RwLock::new(()),
            #[cfg(test)]
            template_walks: AtomicUsize::new(0),
            stat: self.accounting.rates.stat(),
            cancel: CancellationToken::new(),
            udp_per_client: Mutex::new(ClientCounts::new(prefix6)),
            tcp_per_client: Mutex::new(ClientCounts::new(prefix6)),
            health_cancel: Mutex::new(CancellationToken::new()),
        });
        self.model
            .listen_groups
            .lock()
            .push((protocol, listen, Arc::downgrade(&svc)));
        Ok(Opened { key, svc, sockets })
    }

    /// Makes sure no other process serves `addr` before weir opens its
    /// `SO_REUSEPORT` group there: the kernel would let a second group of the
    /// same user join and take a share of the connections. A service of this
    /// daemon on an overlapping address (a wildcard and a specific one) is
    /// not probed. Does not wait: a just removed service's sockets are
    /// waited for by [`Self::wait_for_own_release`], without the state lock.
    ///
    /// A process that binds between this probe and the group's bind can
    /// still join it; the window is one system call wide.
    fn claim_listen(&self, st: &State, proto: Protocol, addr: SocketAddr) -> std::io::Result<()> {
        if addr.port() == 0 || st.services.serves_overlapping(proto, addr) {
            return Ok(());
        }
        match probe_free(proto, addr) {
            Err(err) if err.kind() == std::io::ErrorKind::AddrInUse => Err(std::io::Error::new(
                err.kind(),
                format!(
                    "{err}: another process serves this address \
                         (weir does not share a service address with other listeners)"
                ),
            )),
            r => r,
        }
    }

    /// Waits (until `deadline`, [`OWN_RELEASE_WAIT`] from the start of an
    /// add) while `addr` is taken and a service of this daemon that was
    /// removed or replaced on an overlapping address still holds its
    /// sockets: its workers close them asynchronously, and deleting a
    /// service and adding one on the same address is a normal edit. Returns
    /// at once when the address is free, served by a live service, or taken
    /// by someone else; [`Self::claim_listen`] then decides. Takes the state
    /// lock only for reads between probes.
    fn wait_for_own_release(&self, proto: Protocol, addr: SocketAddr, deadline: Instant) {
        if addr.port() == 0 {
            return;
        }
        loop {
            let ours_closing = self
                .model
                .listen_groups
                .lock()
                .iter()
                .any(|(p, a, s)| *p == proto && overlaps(*a, addr) && s.strong_count() > 0);
            if !ours_closing
                || self.model.load().services.serves_overlapping(proto, addr)
                || !matches!(probe_free(proto, addr), Err(e) if e.kind() == std::io::ErrorKind::AddrInUse)
                || Instant::now() >= deadline
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `params` with the number of the flow table's timeout profile for
    /// its service's own timeouts (connect, UDP, persistence) in `tenant`.
    pub(crate) fn with_profile(
        &self,
        tenant: &Tenant,
        mut params: ServiceParams,
    ) -> crate::control::ControlResult<ServiceParams> {
        let ms = |d: Duration| Millis(d.as_millis() as u64);
        let mut o = TimeoutOverrides::NONE.with(FlowState::SynRecv, ms(params.connect_timeout));
        if let Some(u) = params.udp_timeout {
            o = o.with(FlowState::Udp, ms(u));
        }
        if !params.persistence.is_zero() {
            o = o.with(FlowState::Persist, ms(params.persistence));
        }
        params.profile = self
            .conns
            .table
            .timeout_profile(TenantId(tenant.id), &o)
            .map_err(|e| {
                use crate::control::{ControlError, ErrorKind};
                match e {
                    weir_flowtable::TenantError::TooManyProfiles(_) => ControlError::new(
                        ErrorKind::Conflict,
                        format!(
                            "tenant {:?} has {} distinct sets of service timeouts \
                             (connect_timeout, udp_timeout, persistence) in use: give this \
                             service the timeouts of another, or delete or edit a service \
                             with timeouts of its own",
                            tenant.spec.read().name,
                            weir_flowtable::MAX_PROFILES - 1,
                        ),
                    ),
                    e => ControlError::new(ErrorKind::Invalid, e.to_string()),
                }
            })?;
        Ok(params)
    }

    /// (Re)start the health checks of `svc`'s current backends.
    pub(crate) fn start_health(self: &Arc<Self>, svc: &Arc<Service>) {
        let token = svc.cancel.child_token();
        let old = std::mem::replace(&mut *svc.health_cancel.lock(), token.clone());
        old.cancel();
        let Some(h) = svc.spec.read().options.health.clone() else {
            for b in svc.set.load().backends.iter() {
                b.checked.store(false, Relaxed);
                b.up.store(true, Relaxed);
            }
            return;
        };
        let (interval, timeout) = (h.interval.get(), h.timeout.get());
        let params = crate::health::Params {
            interval,
            timeout,
            rise: h.rise,
            fall: h.fall,
            probe: match h.protocol {
                Some(Protocol::Udp) => {
                    crate::health::Probe::Udp(h.send.clone().unwrap_or_default().into_bytes())
                }
                _ => crate::health::Probe::Tcp,
            },
        };
        let _guard = self.control_rt.enter();
        for b in svc.set.load().backends.iter() {
            b.checked.store(true, Relaxed);
            let weak_shared = Arc::downgrade(self);
            let weak_svc = Arc::downgrade(svc);
            let backend = Arc::downgrade(b);
            // `port` checks another port of the same host.
            let target = SocketAddr::new(b.addr.ip(), h.port.unwrap_or(b.addr.port()));
            // A check restarted by an edit continues from the backend's
            // state: started "up", it never reported a down backend's
            // recovery (its successes agreed with it), and the backend
            // stayed out for good.
            let up = b.up.load(Relaxed);
            crate::health::spawn(target, params.clone(), up, token.clone(), move |up, err| {
                let (Some(shared), Some(svc), Some(b)) =
                    (weak_shared.upgrade(), weak_svc.upgrade(), backend.upgrade())
                else {
                    return;
                };
                tracing::warn!(backend = %b.addr, up, error = ?err, "health state changed");
                b.up.store(up, Relaxed);
                *b.last_error.lock() = err;
                svc.rebuild_sched();
                if !up && svc.params.load().expire_nodest_conn {
                    shared.kill_service(&svc, Some(&[b.id]), Close::BackendDown);
                }
            });
        }
    }
}

/// A service [`Shared::open_service`] made: listening, not in the model yet.
struct Opened {
    key: (String, String),
    svc: Arc<Service>,
    /// One per worker (none for a packet service), for the workers to take
    /// once the service is published.
    sockets: Vec<ListenSocket>,
}

impl Service {
    /// The backend with id `id`: one of the service's set, or one taken
    /// out of it whose connections may still be open (`removed`).
    pub(crate) fn backend(&self, id: u32) -> Option<Arc<Backend>> {
        if let Some(b) = self.set.load().backends.iter().find(|b| b.id == id) {
            return Some(Arc::clone(b));
        }
        self.removed.lock().iter().find(|b| b.id == id).cloned()
    }

    /// Backends `gone` were just taken out of the set: they stay findable
    /// by id ([`Self::backend`]) while connections counted on them
    /// ([`Backend::conns`]) are open, and so keep their id (the lease
    /// goes with the backend): a new backend given an id that flows still
    /// name would take over their counts, kills and listings. Those taken
    /// out before whose last connection has ended, and which nothing else
    /// holds, are forgotten here, so the list holds the backends with
    /// open connections or still held and those taken out by the last
    /// change of the set, never more.
    ///
    /// Why "nothing else holds": a connection picks its backend from the
    /// set it loaded (`choose`), then takes its place and inserts its
    /// entry (`Shared::open`, the packet path) holding it. If it picked
    /// the backend before its removal and takes the place after a later
    /// change looked, the count was 0 when that change looked: forgetting
    /// the backend then would free its id under the entry about to name
    /// it. Its holder is seen instead.
    ///
    /// Nor while a persistence template of the service names it (its
    /// connections ended, the template within its timeout): a new backend
    /// given the id would get the template's client group, listings and
    /// kills. Templates have no count on the backend, so the service's are
    /// looked up in `table` (one walk of the tenant's entries, only when a
    /// backend would be forgotten). No template can name a backend after
    /// the walk: one is stored by a pick or a connection holding the
    /// backend, and a backend held is not forgotten.
    pub(crate) fn retire_backends(
        &self,
        table: &weir_flowtable::FlowTable,
        gone: Vec<Arc<Backend>>,
    ) {
        let unheld = |b: &Arc<Backend>| b.conns() == 0 && Arc::strong_count(b) == 1;
        // The walk runs without the lock: the data path takes it to find
        // a removed backend by id. And off the control runtime's worker
        // (admin edits call this there): it reads every template of the
        // service, 150 ms at 1M in the test profile.
        let named = if self.removed.lock().iter().any(unheld) {
            wait_off_runtime(|| self.template_backends(table))
        } else {
            Default::default()
        };
        let mut removed = self.removed.lock();
        removed.retain(|b| !unheld(b) || named.contains(&b.id));
        removed.extend(gone);
    }

    /// The backend ids this service's persistence templates name.
    fn template_backends(
        &self,
        table: &weir_flowtable::FlowTable,
    ) -> std::collections::HashSet<u32> {
        #[cfg(test)]
        let _gate = {
            self.template_walks.fetch_add(1, Relaxed);
            self.template_walk_gate.read()
        };
        let filter = weir_flowtable::DumpFilter {
            tenant: Some(TenantId(self.tenant.id)),
            service: Some(ServiceId(self.id)),
            state: Some(FlowState::Persist),
            ..Default::default()
        };
        let (mut cursor, mut page, mut named) =
            (None, Vec::new(), std::collections::HashSet::new());
        loop {
            page.clear();
            let next = table.dump(cursor.as_ref(), &filter, 4096, &mut page);
            named.extend(page.iter().map(|s| s.backend.0));
            match next {
                Some(c) => cursor = Some(c),
                None => return named,
            }
        }
    }

    /// Rebuild the scheduler from the backends' current weight and health.
    /// Concurrent rebuilds and set changes each see the other's result
    /// (`rcu` retries on a race); readers never wait.
    pub(crate) fn rebuild_sched(&self) {
        self.set.rcu(|set| {
            let infos: Vec<BackendInfo> = set.backends.iter().map(|b| b.info()).collect();
            match set.sched.rebuild(&infos) {
                Ok(sched) => Arc::new(BackendSet {
                    sched,
                    backends: set.backends.clone(),
                }),
                Err(e) => {
                    tracing::error!("scheduler rebuild failed: {e}");
                    Arc::clone(set)
                }
            }
        });
    }

    /// Choose a backend for `client`, honouring persistence and backend
    /// limits; `skip` lists backends that already failed for this connection.
    /// `local` is the address the client connected to (the service's
    /// address unless it listens on a wildcard one), the destination that
    /// `lblc`, `lblcr` and `dh` key on.
    pub(crate) fn choose(
        &self,
        shared: &Shared,
        proto: Protocol,
        client: SocketAddr,
        local: IpAddr,
        skip: &[SocketAddr],
        rng: &mut weir_sched::SplitMix64,
    ) -> Result<Arc<Backend>, Refusal> {
        let set = self.set.load_full();
        let params = self.params.load_full();
        // Whether `b` can take a new connection now: up, not taken out by
        // the passive check, weight > 0, under its `max_connections`. The
        // scheduler is told which backends cannot (`Load::overloaded`, as
        // IPVS marks a destination at its threshold `OVERLOAD`) and skips
        // them by its own rule; the backends that already failed this
        // connection (`skip`) are not its business.
        let can_take = |b: &Backend| {
            let max = b.max_connections.load(Relaxed);
            b.up.load(Relaxed)
                && !b.passive.is_down()
                && b.weight.load(Relaxed) > 0
                && (max == 0 || b.conns() < max)
        };
        let usable = |b: &Backend| can_take(b) && !skip.contains(&b.addr);
        let now = shared.now_ms();
        let persist_ms = params.persistence.as_millis() as u64;
        let tpl_key = template_key(self, &params, proto, client);
        // The client group's template, if it is fresh or held by live
        // connections (a held one places whatever its age). Only this
        // service's: the key names the tenant, protocol, client group and
        // address, not the service, so a template of a service that had
        // this address before (deleted, and its drop of its templates not
        // there yet) is found under it too; it is treated as absent, and
        // neither reused nor moved below (`rebind_for`), nor held.
        if persist_ms > 0
            && let Some(tpl) = shared.conns.table.get(&tpl_key)
            && tpl.state == FlowState::Persist
            && tpl.service == ServiceId(self.id)
            && (tpl.held > 0 || tpl.last_active.0 + persist_ms > now)
            && let Some(b) = set.backends.iter().find(|b| b.id == tpl.backend.0)
            && usable(b)
        {
            shared.conns.table.touch(&tpl_key, Millis(now), Dir::In, 0);
            return Ok(b.clone());
        }
        let load = |i: usize| {
            set.backends.get(i).map_or(Load::default(), |b| {
                Load::new(b.active(), b.inactive()).with_overload(!can_take(b))
            })
        };
        // `sh` / `mh` without fallback place a client on one backend only,
        // `dh` a destination, and `ovf` refuses when every backend is full.
        let cfg = set.sched.config();
        let pinned = cfg.pinned();
        // A retry's backend (never a pinned kind's, `ovf`'s included): `fo`
        // keeps its rule (the highest usable weight); the others take the
        // next usable one in list order from `start`.
        let substitute = |start: usize| {
            if cfg.kind == weir_sched::SchedulerKind::Fo {
                return set.backends.iter().filter(|b| usable(b)).fold(
                    None::<&Arc<Backend>>,
                    |best, b| match best {
                        Some(x) if x.weight.load(Relaxed) >= b.weight.load(Relaxed) => best,
                        _ => Some(b),
                    },
                );
            }
            let n = set.backends.len();
            (0..n)
                .map(|k| &set.backends[(start + k) % n])
                .find(|b| usable(b))
        };
        let picked = match skip.last() {
            // A retry after a failed connect: the next usable backend after
            // the one that failed, in list order, without asking the
            // scheduler, so a retry does not move rr's rotation (which would
            // put the failing backend first again for the next client).
            Some(&failed) if !pinned => {
                let at = set.backends.iter().position(|b| b.addr == failed);
                substitute(at.map_or(0, |i| i + 1))
            }
            // The scheduler's pick, which passed over the backends that
            // cannot take the connection by its own rule (rr the next one,
            // wlc the least loaded of the rest, fo and ovf the next
            // weight...): it used to be replaced by the first usable backend
            // in list order, so every displaced connection went there,
            // however loaded. `sh` / `mh` without fallback and `dh` give
            // `None` for a client whose backend cannot take it, which is
            // refused, as docs/sched.md says; so is a pinned retry whose
            // answer is the backend that failed.
            _ => {
                let req = weir_sched::Request::new(client, local, Duration::from_millis(now));
                let pick = |rng: &mut weir_sched::SplitMix64| {
                    set.sched
                        .pick_for(req, &load, rng)
                        .and_then(|i| set.backends.get(i))
                };
                match pick(rng) {
                    Some(b) if usable(b) => Some(b),
                    // It filled or went down in the moment since the
                    // scheduler looked (another worker took its last
                    // place): asked once more, which now sees it so and
                    // passes over it, as the list-order substitution
                    // this replaced would have. A pinned kind's answer
                    // would be the same backend.
                    Some(_) if !pinned => pick(rng).filter(|b| usable(b)),
                    _ => None,
                }
            }
        }
        .cloned();
        let Some(b) = picked else {
            let any_full = set.backends.iter().any(|b| {
                let max = b.max_connections.load(Relaxed);
                max != 0 && b.conns() >= max
            });
            return Err(if any_full {
                Refusal::BackendLimit
            } else {
                Refusal::NoBackend
            });
        };
        if persist_ms > 0
            && !shared.conns.table.rebind_for(
                &tpl_key,
                ServiceId(self.id),
                BackendId(b.id),
                Millis(now),
            )
        {
            // The template (IPVS -p): client group -> backend, FlowState::Persist.
            // An existing one is moved (`rebind`), keeping the holds of
            // the connections it placed before.
            let init = FlowInit {
                owner: 0,
                profile: params.profile.for_init(),
                service: ServiceId(self.id),
                backend: BackendId(b.id),
                state: FlowState::Persist,
            };
            if shared
                .conns
                .table
                .insert(tpl_key, init, Millis(now))
                .is_err()
            {
                // Full, another connection of the group stored one first
                // (it wins, as a rebind would have), or another service's
                // is there (it stays until its service's drop).
                tracing::debug!("persistence template not stored");
            } else if shared.cancelled_after_store(self) {
                // Deleted meanwhile: its drop may have passed this key.
                shared.remove_template_of(self, &tpl_key);
            }
        }
        Ok(b)
    }
}

/// A persistence template a connection holds ([`Shared::hold_template`]):
/// its key, and the cookie of the entry held, so that the release gives
/// back this template's hold and no newer one's under the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeldTemplate {
    pub(crate) key: FlowKey,
    cookie: weir_flowtable::Cookie,
}

impl HeldTemplate {
    /// 29 bits that tell this template from a newer one under its key,
    /// for a holder with no room for the cookie (a packet flow keeps them
    /// in its owner token): see [`template_tag`].
    pub(crate) fn tag(&self) -> u32 {
        template_tag(self.cookie)
    }
}

/// A template's tag: its cookie's node index plus its node's use count
/// times an odd number, modulo 2^29 (a cookie is the index, 28 bits, and
/// the use count above it: see [`weir_flowtable::Cookie`]). A newer
/// template under the same key stored in the same node (a removed node
/// is the next one reused), or with the same use count in another,
/// always has another tag; in another node with another use count, one
/// in about 2^29 has the same.
pub(crate) fn template_tag(cookie: weir_flowtable::Cookie) -> u32 {
    const IDX_BITS: u32 = 28;
    const MUL: u64 = 0x9e37_79b9;
    let idx = cookie.0 & ((1 << IDX_BITS) - 1);
    let uses = cookie.0 >> IDX_BITS;
    (idx.wrapping_add(uses.wrapping_mul(MUL)) & ((1 << 29) - 1)) as u32
}

/// The flow-table key of the persistence template for `client` (IPVS: the
/// client group, port 0).
pub(super) fn template_key(
    svc: &Service,
    params: &ServiceParams,
    proto: Protocol,
    client: SocketAddr,
) -> FlowKey {
    FlowKey {
        client: SocketAddr::new(params.mask.group(client.ip()), 0),
        ..flow_key(svc, proto, client)
    }
}

/// The flow-table key of a connection or session.
pub(crate) fn flow_key(svc: &Service, proto: Protocol, client: SocketAddr) -> FlowKey {
    FlowKey {
        tenant: TenantId(svc.tenant.id),
        proto: match proto {
            Protocol::Tcp => Proto::Tcp,
            Protocol::Udp => Proto::Udp,
        },
        client,
        virt: svc.listen,
    }
}

/// What an add checks of a tenant spec before the model: its name, table
/// sizes, timeouts and fences are valid. Returns its timeouts for the flow
/// table.
fn check_new_tenant(spec: &TenantSpec) -> crate::control::ControlResult<Timeouts> {
    use crate::control::{ControlError, ErrorKind};
    if let Err(e) = config::check_name(&spec.name) {
        return Err(ControlError::new(
            ErrorKind::Invalid,
            format!("tenant name: {e}"),
        ));
    }
    if let Some((key, message)) = config::tenant_table_problems(spec).into_iter().next() {
        return Err(ControlError::new(
            ErrorKind::Invalid,
            format!("{key}: {message}"),
        ));
    }
    let timeouts = resolve_timeouts(spec)?;
    check_fences(spec)?;
    Ok(timeouts)
}

/// A tenant's `allowed_listen` / `allowed_backends` entries all parse, or
/// an Invalid error naming every bad one.
pub(crate) fn check_fences(spec: &TenantSpec) -> crate::control::ControlResult<()> {
    let mut errors = Vec::new();
    for (key, list) in [
        ("allowed_listen", &spec.allowed_listen),
        ("allowed_backends", &spec.allowed_backends),
    ] {
        if let Err(e) = config::parse_fence(key, list) {
            errors.extend(e);
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(crate::control::ControlError::new(
            crate::control::ErrorKind::Invalid,
            errors.join("; "),
        ))
    }
}

/// A tenant's `[tenant.timeouts]` for the flow table, or an Invalid error
/// naming every bad key.
pub(crate) fn resolve_timeouts(spec: &TenantSpec) -> crate::control::ControlResult<Timeouts> {
    spec.timeouts.resolve().map_err(|errors| {
        let list: Vec<String> = errors
            .iter()
            .map(|(key, message)| format!("timeouts.{key}: {message}"))
            .collect();
        crate::control::ControlError::new(crate::control::ErrorKind::Invalid, list.join("; "))
    })
}

pub(crate) fn service_params(spec: &ServiceSpec) -> crate::control::ControlResult<ServiceParams> {
    use crate::control::{ControlError, ErrorKind};
    let bad = |m: String| ControlError::new(ErrorKind::Invalid, m);
    let persistence = spec.persistence.get();
    let mask = match &spec.persistence_netmask {
        Some(m) => {
            let n = config::parse_netmask(m).map_err(bad)?;
            AffinityMask::new(n.v4_prefix, n.v6_prefix)
                .map_err(|e| ControlError::new(ErrorKind::Invalid, e.to_string()))?
        }
        None => AffinityMask::new(32, 128)
            .map_err(|e| ControlError::new(ErrorKind::Invalid, e.to_string()))?,
    };
    let o = &spec.options;
    let connect_timeout = o
        .connect_timeout
        .as_ref()
        .map_or(CONNECT_TIMEOUT, |t| t.get());
    let udp_timeout = o.udp_timeout.as_ref().map(|t| t.get());
    Ok(ServiceParams {
        persistence,
        mask,
        connect_timeout,
        expire_nodest_conn: o.expire_nodest_conn,
        udp_timeout,
        udp_responses: o.udp_responses,
        udp_max_per_client: o.udp_max_sessions_per_client,
        tcp_max_per_client: o.tcp_max_connections_per_client,
        client_prefix6: match o.client_prefix6 {
            None => 64,
            Some(p @ 1..=128) => p as u8,
            Some(p) => return Err(bad(format!("client_prefix6 {p} is not in 1..=128"))),
        },
        profile: weir_flowtable::Profile::NONE,
    })
}

pub(crate) fn build_sched(
    spec: &ServiceSpec,
    backends: &[Arc<Backend>],
) -> crate::control::ControlResult<Scheduler> {
    use crate::control::{ControlError, ErrorKind};
    let kind = spec.scheduler;
    let seed = match &spec.options.hash_seed {
        Some(text) => HashSeed::from_text(text),
        None => HashSeed::from_text(&format!("{}/{}", spec.tenant, spec.name)),
    };
    let o = &spec.options;
    let mut cfg = SchedConfig::new(kind, seed);
    // `weir check` refuses each flag on a scheduler it does not apply to.
    cfg.fallback = o.mh_fallback || o.sh_fallback;
    cfg.hash_port = o.mh_port || o.sh_port;
    if let Some(size) = o.mh_table_size {
        cfg.mh_table_size = weir_sched::MhTableSize::new(size)
            .map_err(|e| ControlError::new(ErrorKind::Invalid, e.to_string()))?;
    }
    let infos: Vec<BackendInfo> = backends.iter().map(|b| b.info()).collect();
    Scheduler::new(cfg, &infos).map_err(|e| ControlError::new(ErrorKind::Invalid, e.to_string()))
}

/// Whether two service addresses of one protocol take the same port (the
/// same address, or one of them a wildcard of the same family).
fn overlaps(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port()
        && a.is_ipv6() == b.is_ipv6()
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::{Config, ServiceOptions};

    fn spec(tenant: &str, name: &str, protocol: Protocol) -> ServiceSpec {
        test_spec(tenant, name, protocol, "127.0.0.1:0".parse().unwrap())
    }

    impl Service {
        /// The backend a new TCP connection from `client` to the service's
        /// own address gets (none tried yet); panics on a refusal.
        pub(crate) fn choose_tcp(
            &self,
            shared: &Shared,
            client: SocketAddr,
            rng: &mut weir_sched::SplitMix64,
        ) -> Arc<Backend> {
            self.choose(shared, Protocol::Tcp, client, self.listen.ip(), &[], rng)
                .unwrap()
        }
    }

    /// A round-robin service with no backends (for the daemon's tests).
    pub(crate) fn test_spec(
        tenant: &str,
        name: &str,
        protocol: Protocol,
        listen: SocketAddr,
    ) -> ServiceSpec {
        ServiceSpec {
            tenant: tenant.into(),
            name: name.into(),
            protocol,
            listen,
            forward: Default::default(),
            scheduler: weir_sched::SchedulerKind::Rr,
            persistence: "0s".parse().unwrap(),
            persistence_netmask: None,
            options: ServiceOptions::default(),
            backends: Vec::new(),
        }
    }

    fn key(tenant: &str, name: &str) -> (String, String) {
        (tenant.to_owned(), name.to_owned())
    }

    /// The id index ([`Services::by_id`]) maps exactly the ids of the
    /// services by name, each to that service, after adds, a replace (same
    /// tenant and name, new protocol: a new service with a new id), a
    /// service's deletion, a tenant's deletion (its services go, another
    /// tenant's stay) and edits through the write guard; a snapshot loaded
    /// before an edit keeps its own index.
    #[test]
    fn service_id_index_follows_every_edit() {
        let mut cfg = Config::default();
        cfg.daemon.workers = 1;
        let d = crate::daemon::Daemon::start(cfg, None).unwrap();
        let shared = d.shared.clone();
        let control = d.control();
        let model = &shared.model;
        // Exactly the services by name, each found by its id.
        let check = |st: &State| {
            st.services.assert_index_agrees();
            for s in st.services.values() {
                assert!(Arc::ptr_eq(st.services.by_id(s.id).unwrap(), s));
            }
        };
        let id_of = |t: &str, n: &str| model.load().services[&key(t, n)].id;
        for t in ["a", "b"] {
            control
                .add_tenant(TenantSpec {
                    name: t.into(),
                    ..Default::default()
                })
                .unwrap();
        }
        for (t, n) in [("default", "s1"), ("a", "s1"), ("a", "s2"), ("b", "s1")] {
            control.add_service(spec(t, n, Protocol::Tcp)).unwrap();
            check(&model.load());
        }
        assert_eq!(model.load().services.len(), 4);
        let (a1, a2, b1, d1) = (
            id_of("a", "s1"),
            id_of("a", "s2"),
            id_of("b", "s1"),
            id_of("default", "s1"),
        );

        // Replace a/s1: the new service has a new id, the old id is gone.
        let before = arc_swap::Guard::into_inner(model.load());
        control
            .edit_service("a", "s1", spec("a", "s1", Protocol::Udp))
            .unwrap();
        let st = model.load();
        check(&st);
        let new_a1 = id_of("a", "s1");
        assert_ne!(new_a1, a1);
        assert!(st.services.by_id(a1).is_none());
        assert_eq!(
            st.services.by_id(new_a1).unwrap().spec.read().protocol,
            Protocol::Udp
        );
        // The snapshot from before still has the old one.
        assert_eq!(before.services.by_id(a1).unwrap().id, a1);
        assert!(before.services.by_id(new_a1).is_none());
        drop(st);

        // An edit that keeps the address keeps the service and its id.
        let mut s2 = spec("a", "s2", Protocol::Tcp);
        s2.listen = model.load().services[&key("a", "s2")].listen;
        s2.scheduler = weir_sched::SchedulerKind::Wrr;
        control.edit_service("a", "s2", s2).unwrap();
        assert_eq!(id_of("a", "s2"), a2);
        check(&model.load());

        // Delete one service.
        control.delete_service("default", "s1").unwrap();
        check(&model.load());
        assert!(model.load().services.by_id(d1).is_none());

        // Delete tenant a with its two services; b's stays.
        control.delete_tenant("a").unwrap();
        let st = model.load();
        check(&st);
        assert!(st.services.by_id(new_a1).is_none());
        assert!(st.services.by_id(a2).is_none());
        assert_eq!(st.services.len(), 1);
        let b = st.services.by_id(b1).unwrap();
        assert_eq!(b.spec.read().name, "s1");
        assert_eq!(b.tenant.spec.read().name, "b");
        drop(st);

        // Edits through the write guard: remove, then put back (the same
        // service, the same id), and insert over a key (the old id goes).
        let b = model.write().services.remove(&key("b", "s1")).unwrap();
        assert!(model.load().services.by_id(b1).is_none());
        check(&model.load());
        assert!(
            model
                .write()
                .services
                .insert(key("b", "s1"), b.clone())
                .is_none()
        );
        check(&model.load());
        assert!(Arc::ptr_eq(model.load().services.by_id(b1).unwrap(), &b));
        control.add_service(spec("b", "s2", Protocol::Tcp)).unwrap();
        // (Taken from its own key first: a service is in the model once.)
        let s2 = model.write().services.remove(&key("b", "s2")).unwrap();
        check(&model.load());
        let old = model.write().services.insert(key("b", "s1"), s2.clone());
        assert!(Arc::ptr_eq(&old.unwrap(), &b));
        let st = model.load();
        check(&st);
        assert!(st.services.by_id(b1).is_none());
        drop(st);
        model.write().services.remove(&key("b", "s1"));
        check(&model.load());
        assert!(model.load().services.is_empty());
        assert!(model.load().services.by_id(s2.id).is_none());
        d.shutdown();
    }

    /// A backend edit racing a health change: once both are done, the
    /// scheduler is built from what the backends say. An edit read every
    /// backend's health, built a scheduler and stored it; a health change
    /// whose rebuild (an `rcu`) landed in between was overwritten by a
    /// scheduler built from the old health, and a backend that went down
    /// stayed scheduled until its next change.
    /// A backend's count that a state move racing the entry's removal
    /// took below 0 for a moment reads as 0: `lc` still sends the next
    /// client to that backend (not to the one with a connection), and the
    /// API lists 0 active, not 18446744073709551615. (The move itself is
    /// two steps, the table's then the count, and is left so: the remover
    /// settles the state it sees.)
    #[test]
    fn a_count_below_zero_for_a_moment_reads_as_zero() {
        let mut s = spec("default", "l", Protocol::Tcp);
        s.scheduler = crate::config::parse_scheduler("lc").unwrap();
        s.backends = vec![backend_at(1), backend_at(2)];
        let d = daemon(vec![s], None);
        let svc = d.shared.model.load().services[&key("default", "l")].clone();
        let set = svc.set.load_full();
        let (b0, b1) = (&set.backends[0], &set.backends[1]);
        // The remover's settle landed first: b0's active at 0 - 1.
        b0.active.fetch_sub(1, Relaxed);
        b1.active.fetch_add(1, Relaxed);
        assert_eq!((b0.active(), b0.inactive(), b1.active()), (0, 0, 1));
        let mut rng = weir_sched::SplitMix64::new(7);
        let client = SocketAddr::from(([10, 0, 0, 1], 1000));
        let picked = svc.choose_tcp(&d.shared, client, &mut rng);
        assert_eq!(picked.addr, b0.addr, "lc read b0's load as 2^64 - 1");
        let listed = d.control().services();
        let active: Vec<u64> = listed[0].backends.iter().map(|b| b.active_conns).collect();
        assert_eq!(active, [0, 1]);
        // The mover's count lands: exact again (0: the connection is gone).
        b0.active.fetch_add(1, Relaxed);
        assert_eq!(b0.active.load(Relaxed), 0);
        d.shutdown();
    }

    #[test]
    fn a_backend_edit_racing_a_health_change_keeps_the_new_health() {
        use crate::control::BackendPatch;
        use std::sync::atomic::Ordering::{Acquire, Release};
        let mut s = spec("default", "t", Protocol::Tcp);
        s.backends = vec![backend_at(1), backend_at(2)];
        let d = daemon(vec![s], None);
        let svc = d.shared.model.load().services[&key("default", "t")].clone();
        let c = d.control();
        let edit = |round: u32| {
            c.edit_backend(
                "default",
                "t",
                "127.0.0.9:2",
                BackendPatch {
                    weight: Some(1 + round % 3),
                    drain: None,
                },
            )
            .unwrap();
        };
        // How long an edit takes here: the health change is made to land
        // at every point of it in turn.
        let mut took: Vec<Duration> = (0..50)
            .map(|r| {
                let t0 = Instant::now();
                edit(r);
                t0.elapsed()
            })
            .collect();
        took.sort();
        let span = took[25].as_nanos() as u64 * 2 + 1;
        // Both sides spin on a round number (a barrier's wake-up would
        // scatter them by more than the edit takes).
        let go = AtomicU32::new(0);
        let done = AtomicU32::new(0);
        let mut stale = 0;
        const ROUNDS: u32 = 4_000;
        std::thread::scope(|sc| {
            sc.spawn(|| {
                for round in 1..=ROUNDS {
                    while go.load(Acquire) != round {
                        std::hint::spin_loop();
                    }
                    let t0 = Instant::now();
                    let at = Duration::from_nanos(u64::from(round) * 97 % span);
                    while t0.elapsed() < at {
                        std::hint::spin_loop();
                    }
                    // What a health check does when the state changes.
                    let b = svc.set.load().backends[0].clone();
                    b.up.store(round % 2 == 0, Relaxed);
                    svc.rebuild_sched();
                    done.store(round, Release);
                }
            });
            for round in 1..=ROUNDS {
                go.store(round, Release);
                edit(round);
                while done.load(Acquire) != round {
                    std::hint::spin_loop();
                }
                if svc.set.load().sched.backends()[0].up != (round % 2 == 0) {
                    stale += 1;
                }
            }
        });
        assert_eq!(stale, 0, "rounds ending with a scheduler of the old health");
        d.shutdown();
    }

    /// A daemon with one worker and these services (and a config file
    /// `path` to reload, if given).
    fn daemon(
        services: Vec<ServiceSpec>,
        path: Option<&std::path::Path>,
    ) -> crate::daemon::DaemonHandle {
        daemon_with(&[], services, path)
    }

    /// `n` UDP services of the default tenant on port 0 (named `s0`...).
    fn udp_services(n: usize) -> Vec<ServiceSpec> {
        tenant_udp_services("default", n)
    }

    /// Starting with S services, and a reload that adds S services, copy
    /// the model a fixed number of times whatever S: one copy for all the
    /// services. Each add used to copy it (every service in it), O(S^2) in
    /// all: 2 s to start 4,000 UDP services. The address index agrees
    /// with the services after each.
    #[test]
    fn adding_many_services_copies_the_model_a_fixed_number_of_times() {
        let start = |n: usize| {
            let d = daemon(udp_services(n), None);
            let st = d.shared.model.load();
            assert_eq!(st.services.len(), n);
            st.services.assert_index_agrees();
            drop(st);
            let copies = d.shared.model.copies.load(Relaxed);
            d.shutdown();
            copies
        };
        assert_eq!(start(300), start(1));

        let reload = |n: usize| {
            let (d, _dir, path) = daemon_with_a_file(Vec::new());
            let mut cfg = d.control().running_config();
            cfg.services = udp_services(n);
            let (report, copies) = reload_counting_copies(&d, &path, &cfg);
            assert_eq!(report.added.len(), n);
            let st = d.shared.model.load();
            assert_eq!(st.services.len(), n);
            st.services.assert_index_agrees();
            drop(st);
            d.shutdown();
            copies
        };
        assert_eq!(reload(300), 1);
        assert_eq!(reload(1), 1);
    }

    /// A reload checks the file against the running state (an object the
    /// API added since the last reload, which the file would remove, needs
    /// `force`) and applies it to the same state: an API add between the
    /// check and the apply waits for the reload. The reload took the edits
    /// lock for its apply alone, so an add went in between the two, and
    /// the apply, checked without it, removed it without `force`.
    #[test]
    fn a_reload_does_not_remove_without_force_what_the_api_added_after_its_check() {
        use crate::daemon::tests::{wait_for_a_waiter, wait_until};
        let (d, _dir) = daemon_reloading_itself();
        let gate = d.shared.model.plan_gate.write();
        let reload = {
            let c = d.control();
            std::thread::spawn(move || c.reload(Default::default()))
        };
        wait_for_a_waiter(&d.shared.model.plans_made, "the reload never checked");
        let add = {
            let c = d.control();
            std::thread::spawn(move || c.add_service(spec("default", "api", Protocol::Udp)))
        };
        wait_until("the add neither ended nor waited", || {
            add.is_finished() || d.shared.model.edits_waiting.load(Relaxed) > 0
        });
        drop(gate);
        let reloaded = reload.join().unwrap();
        add.join().unwrap().unwrap();
        assert!(
            d.shared
                .model
                .load()
                .services
                .contains_key(&key("default", "api")),
            "the reload removed default/api, added through the API after its check, \
             without force ({reloaded:?})"
        );
        d.shutdown();
    }

    /// A reload waiting for an API edit is counted in `edits_waiting`, as
    /// an edit waiting for a reload is: what a test watches to know it is
    /// held up. It took the edits lock around the counter.
    #[test]
    fn a_reload_waiting_for_an_edit_counts_as_waiting() {
        use crate::daemon::tests::wait_for_a_waiter;
        let (d, _dir) = daemon_reloading_itself();
        // As an API edit does.
        let held = d.shared.model.lock_edits();
        let reload = {
            let c = d.control();
            std::thread::spawn(move || c.reload(Default::default()))
        };
        wait_for_a_waiter(
            &d.shared.model.edits_waiting,
            "the reload never waited for the edits",
        );
        assert_eq!(d.shared.model.plans_made.load(Relaxed), 0);
        drop(held);
        assert!(reload.join().unwrap().is_ok());
        assert_eq!(d.shared.model.edits_waiting.load(Relaxed), 0);
        d.shutdown();
    }

    /// A daemon with one worker and no services, started from a file
    /// (in the directory returned with it) that holds its running
    /// configuration: a reload changes nothing.
    fn daemon_reloading_itself() -> (crate::daemon::DaemonHandle, tempfile::TempDir) {
        let (d, dir, path) = daemon_with_a_file(Vec::new());
        let file = toml::to_string(&d.control().running_config()).unwrap();
        std::fs::write(&path, file).unwrap();
        (d, dir)
    }

    /// A daemon with one worker and these services, and the path of the
    /// config file it reloads (not written yet), in the directory returned
    /// with them.
    fn daemon_with_a_file(
        services: Vec<ServiceSpec>,
    ) -> (
        crate::daemon::DaemonHandle,
        tempfile::TempDir,
        std::path::PathBuf,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("weir.toml");
        let d = daemon(services, Some(&path));
        (d, dir, path)
    }

    /// `d` reloads `cfg`, written first to `path` (the file `d` reloads).
    /// The reload's report, and how many times it copied the model.
    fn reload_counting_copies(
        d: &crate::daemon::DaemonHandle,
        path: &std::path::Path,
        cfg: &Config,
    ) -> (crate::control::ReloadReport, u64) {
        std::fs::write(path, toml::to_string(cfg).unwrap()).unwrap();
        let before = d.shared.model.copies.load(Relaxed);
        let report = d.control().reload(Default::default()).unwrap();
        (report, d.shared.model.copies.load(Relaxed) - before)
    }

    /// `n` UDP services of `tenant` on port 0 (named `s0`...).
    fn tenant_udp_services(tenant: &str, n: usize) -> Vec<ServiceSpec> {
        (0..n)
            .map(|i| spec(tenant, &format!("s{i}"), Protocol::Udp))
            .collect()
    }

    /// A daemon with one worker, tenants `tenants` and these services.
    fn daemon_with_tenants(
        tenants: &[&str],
        services: Vec<ServiceSpec>,
    ) -> crate::daemon::DaemonHandle {
        daemon_with(tenants, services, None)
    }

    /// A daemon with one service, default/p: TCP, persistent for 300 s, a
    /// weight-1 backend on 127.0.0.9 at each of `ports`. The daemon and the
    /// service.
    fn daemon_with_a_persistent_service(
        ports: &[u16],
    ) -> (crate::daemon::DaemonHandle, Arc<Service>) {
        daemon_with_a_service(true, ports)
    }

    /// As [`daemon_with_a_persistent_service`], persistent or not.
    fn daemon_with_a_service(
        persistent: bool,
        ports: &[u16],
    ) -> (crate::daemon::DaemonHandle, Arc<Service>) {
        let mut s = spec("default", "p", Protocol::Tcp);
        if persistent {
            s.persistence = "300s".parse().unwrap();
        }
        s.backends = ports.iter().map(|&port| backend_at(port)).collect();
        let d = daemon_with_tenants(&[], vec![s]);
        let svc = d.shared.model.load().services[&key("default", "p")].clone();
        (d, svc)
    }

    /// A weight-1 backend on 127.0.0.9 at `port`.
    fn backend_at(port: u16) -> BackendSpec {
        BackendSpec {
            address: SocketAddr::from(([127, 0, 0, 9], port)),
            weight: 1,
            proxy_protocol: None,
            max_connections: 0,
        }
    }

    /// With the next backend id pointed at `gone`, a backend added at
    /// `port` to `svc` (default/p) does not get it: `gone` is taken.
    fn assert_a_new_backend_skips(
        control: &dyn crate::control::Control,
        svc: &Service,
        gone: u32,
        port: u16,
    ) {
        BACKEND_IDS.set_next(gone);
        control
            .add_backend("default", "p", backend_at(port))
            .unwrap();
        let ids: Vec<u32> = svc.set.load().backends.iter().map(|b| b.id).collect();
        assert!(
            !ids.contains(&gone),
            "a new backend took id {gone}: {ids:?}"
        );
    }

    /// Runs `edit` until backend id `gone` is free, at most 100 times 20 ms
    /// apart (health checks and snapshots of an old set let go of a removed
    /// backend meanwhile); fails with `what` if it stays taken.
    fn assert_freed_by_edits(gone: u32, mut edit: impl FnMut(), what: &str) {
        let mut freed = false;
        for _ in 0..100 {
            edit();
            if !BACKEND_IDS.leased(gone) {
                freed = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(freed, "{what}");
    }

    /// A daemon with one worker, tenants `tenants`, these services and a
    /// config file `path` to reload, if given.
    fn daemon_with(
        tenants: &[&str],
        services: Vec<ServiceSpec>,
        path: Option<&std::path::Path>,
    ) -> crate::daemon::DaemonHandle {
        let mut cfg = Config::default();
        cfg.daemon.workers = 1;
        cfg.tenants = tenants
            .iter()
            .map(|t| TenantSpec {
                name: (*t).into(),
                ..Default::default()
            })
            .collect();
        cfg.services = services;
        crate::daemon::Daemon::start(cfg, path.map(Into::into)).unwrap()
    }

    /// A service edit forgets the API additions of the backends it takes
    /// out, as deleting them does. Each edit to a new backend set used to
    /// leave its backends' entries in `runtime_added` until the next
    /// reload, so a tenant token's edits grew the daemon's memory without
    /// bound (one body of backends per request), in place and when the
    /// edit moves the service.
    #[test]
    fn service_edits_forget_the_backends_they_take_out() {
        let d = daemon(vec![spec("default", "s", Protocol::Tcp)], None);
        let control = d.control();
        let mut s = control.service_spec("default", "s").unwrap();
        let backend = |port: u16| crate::config::BackendSpec {
            address: SocketAddr::from(([127, 0, 0, 2], port)),
            weight: 1,
            proxy_protocol: None,
            max_connections: 0,
        };
        for port in 1000..1050 {
            s.backends = vec![backend(port), backend(port + 1)];
            control.edit_service("default", "s", s.clone()).unwrap();
        }
        let added = || d.shared.model.runtime_added.lock().clone();
        let want = |ports: &[u16]| -> std::collections::BTreeSet<String> {
            ports
                .iter()
                .map(|p| format!("backend default/s/127.0.0.2:{p}"))
                .collect()
        };
        assert_eq!(added(), want(&[1049, 1050]));
        // A move replaces the service: the same.
        s.listen = "127.0.0.3:0".parse().unwrap();
        s.backends = vec![backend(2000)];
        control.edit_service("default", "s", s).unwrap();
        assert_eq!(added(), want(&[2000]));
        d.shutdown();
    }

    /// Deleting a tenant with k services, and a reload removing k services,
    /// copy the model a fixed number of times whatever k: one copy for all
    /// the services (and, for the tenant, one more for the tenant itself).
    /// Each removal used to copy it (every service in it), O(k x S) in
    /// all. The other services stay, and the address index agrees.
    /// Deleting a tenant purges its flow-table entries in one pass, without
    /// paging through its table: it used to kill each service's entries
    /// and drop each one's templates by a dump of the tenant (two per
    /// service), O(services x entries), before purging them all anyway.
    /// Every entry of the tenant goes, the other tenant's stay.
    #[test]
    fn deleting_a_tenant_reads_none_of_its_table() {
        const SERVICES: usize = 40;
        const PER_SERVICE: u32 = 50;
        let mut services = tenant_udp_services("t", SERVICES);
        services.extend(udp_services(1));
        let d = daemon_with_tenants(&["t"], services);
        let st = d.shared.model.load();
        let table = &d.shared.conns.table;
        let mut n = 0u32;
        for svc in st.services.values() {
            for i in 0..PER_SERVICE {
                n += 1;
                let client = SocketAddr::from(([10, 1, (n >> 8) as u8, n as u8], 2000));
                let init = FlowInit {
                    owner: 0,
                    profile: weir_flowtable::ProfileRef::NONE,
                    service: ServiceId(svc.id),
                    backend: BackendId(0),
                    state: if i % 5 == 0 {
                        FlowState::Persist
                    } else {
                        FlowState::Udp
                    },
                };
                table
                    .insert(
                        flow_key(svc, Protocol::Udp, client),
                        init,
                        Millis(d.shared.now_ms()),
                    )
                    .unwrap();
            }
        }
        let t = TenantId(st.tenants["t"].id);
        let default = TenantId(st.tenants["default"].id);
        drop(st);
        let entries = |id| table.tenant_stats(id).map(|s| s.entries);
        assert_eq!(entries(t), Some(SERVICES as u64 * u64::from(PER_SERVICE)));
        assert_eq!(entries(default), Some(u64::from(PER_SERVICE)));
        let before = weir_flowtable::FlowTable::dump_work_on_this_thread();
        d.control().delete_tenant("t").unwrap();
        let work = weir_flowtable::FlowTable::dump_work_on_this_thread();
        assert_eq!(
            (work.0 - before.0, work.1 - before.1),
            (0, 0),
            "(bucket reads, references read) by listings of the tenant"
        );
        assert_eq!(entries(t), None);
        assert_eq!(entries(default), Some(u64::from(PER_SERVICE)));
        d.shutdown();
    }

    #[test]
    fn removing_many_services_copies_the_model_a_fixed_number_of_times() {
        let delete_tenant = |n: usize| {
            let mut services = tenant_udp_services("t", n);
            services.extend(udp_services(3));
            let d = daemon_with_tenants(&["t"], services);
            assert_eq!(d.shared.model.load().services.len(), n + 3);
            let before = d.shared.model.copies.load(Relaxed);
            d.control().delete_tenant("t").unwrap();
            let copies = d.shared.model.copies.load(Relaxed) - before;
            let st = d.shared.model.load();
            assert_eq!(st.services.len(), 3);
            assert!(st.services.keys().all(|(t, _)| t == "default"));
            assert!(!st.tenants.contains_key("t"));
            st.services.assert_index_agrees();
            drop(st);
            d.shutdown();
            copies
        };
        // The services as one change, then the tenant.
        assert_eq!(delete_tenant(300), 2);
        assert_eq!(delete_tenant(1), 2);

        let reload = |n: usize| {
            let (d, _dir, path) = daemon_with_a_file(udp_services(n + 3));
            let mut cfg = d.control().running_config();
            // Keep s0..s2, remove the rest.
            cfg.services
                .retain(|s| ["s0", "s1", "s2"].contains(&s.name.as_str()));
            let kept: Vec<Arc<Service>> = (0..3)
                .map(|i| d.shared.model.load().services[&key("default", &format!("s{i}"))].clone())
                .collect();
            let (report, copies) = reload_counting_copies(&d, &path, &cfg);
            assert_eq!(report.removed.len(), n);
            let st = d.shared.model.load();
            assert_eq!(st.services.len(), 3);
            for k in &kept {
                assert!(Arc::ptr_eq(
                    &st.services[&key("default", &k.spec.read().name)],
                    k
                ));
                assert!(!k.cancel.is_cancelled());
            }
            st.services.assert_index_agrees();
            drop(st);
            d.shutdown();
            copies
        };
        assert_eq!(reload(300), 1);
        assert_eq!(reload(1), 1);
    }

    /// Deleting a tenant (its services removed as one batch) takes every
    /// service of it out of the model and closes its listeners: TCP
    /// connects to them are refused, and their UDP ports can be bound
    /// again. Another tenant's services are the same services, still
    /// listening.
    #[test]
    fn deleting_a_tenant_closes_each_of_its_services_and_only_those() {
        let mut services = tenant_udp_services("a", 300);
        services.extend(tenant_udp_services("b", 3));
        for t in ["a", "b"] {
            services.extend((0..3).map(|i| spec(t, &format!("tcp{i}"), Protocol::Tcp)));
        }
        let d = daemon_with_tenants(&["a", "b"], services);
        let st = arc_swap::Guard::into_inner(d.shared.model.load());
        assert_eq!(st.services.len(), 309);
        let of = |t: &str| -> Vec<Arc<Service>> {
            st.services
                .iter()
                .filter(|((x, _), _)| x == t)
                .map(|(_, s)| s.clone())
                .collect()
        };
        let (a, b) = (of("a"), of("b"));
        assert_eq!((a.len(), b.len()), (303, 6));

        d.control().delete_tenant("a").unwrap();

        let now = d.shared.model.load();
        assert!(!now.tenants.contains_key("a"));
        assert_eq!(now.services.len(), 6);
        now.services.assert_index_agrees();
        for s in &a {
            assert!(s.cancel.is_cancelled());
            assert!(now.services.by_id(s.id).is_none());
            assert!(
                !now.services
                    .serves_overlapping(s.spec.read().protocol, s.listen)
            );
        }
        for s in &b {
            assert!(Arc::ptr_eq(
                &now.services[&key("b", &s.spec.read().name)],
                s
            ));
            assert!(!s.cancel.is_cancelled());
        }
        drop(now);
        // Closed: refused / bindable (the listeners close as their tasks
        // see the cancel, so this waits for them).
        let closed = |s: &Service| match s.spec.read().protocol {
            Protocol::Tcp => std::net::TcpStream::connect(s.listen).is_err(),
            _ => std::net::UdpSocket::bind(s.listen).is_ok(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut open: Vec<_> = a.iter().collect();
        while !open.is_empty() && Instant::now() < deadline {
            open.retain(|s| !closed(s));
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(open.is_empty(), "{} services of a still listen", open.len());
        // Still open.
        for s in &b {
            assert!(!closed(s), "{} of b closed", s.spec.read().name);
        }
        d.shutdown();
    }

    /// UDP services on port 0 each get a port no other socket holds. With
    /// `SO_REUSEADDR` / `SO_REUSEPORT` set, the kernel's port-0 choice for
    /// UDP could be a port one of our other services held (2,000 services
    /// got ~70 shared ports), and the two services then shared one
    /// reuseport group: each was handed the other's datagrams.
    #[test]
    fn port_zero_udp_services_get_ports_of_their_own() {
        let n = 2_000;
        let d = daemon(udp_services(n), None);
        let ports: std::collections::HashSet<u16> = d
            .shared
            .model
            .load()
            .services
            .values()
            .map(|s| s.listen.port())
            .collect();
        assert_eq!(ports.len(), n, "services share ports");
        d.shutdown();
    }

    /// The address index answers what the scans it replaced answered: the
    /// services on exactly an address, and whether one overlaps it (the
    /// same IP and port, or a wildcard of the family on the port), per
    /// protocol, for specific and wildcard addresses of both families,
    /// before and after services go.
    #[test]
    fn the_address_index_answers_as_a_scan_of_the_services() {
        let d = daemon(Vec::new(), None);
        let shared = d.shared.clone();
        let add = |name: &str, proto: Protocol, listen: &str| {
            let listen: SocketAddr = listen.parse().unwrap();
            shared
                .add_service(test_spec("default", name, proto, listen))
                .unwrap();
            shared.model.load().services[&key("default", name)].listen
        };
        let tcp = add("tcp", Protocol::Tcp, "127.0.0.1:0");
        let udp = add("udp", Protocol::Udp, "127.0.0.1:0");
        // Wildcards on the same ports: ours overlap, so no probe refuses.
        add("tcp-any", Protocol::Tcp, &format!("0.0.0.0:{}", tcp.port()));
        add("udp-any", Protocol::Udp, &format!("0.0.0.0:{}", udp.port()));
        let v6 = std::net::TcpListener::bind("[::1]:0").is_ok();
        if v6 {
            add("tcp6", Protocol::Tcp, "[::1]:0");
        }
        let check = || {
            let st = shared.model.load();
            st.services.assert_index_agrees();
            let ports: Vec<u16> = st.services.values().map(|s| s.listen.port()).collect();
            for port in ports.iter().copied().chain([1]) {
                for ip in ["127.0.0.1", "127.0.0.2", "0.0.0.0", "::1", "::"] {
                    let a = SocketAddr::new(ip.parse().unwrap(), port);
                    for proto in [Protocol::Tcp, Protocol::Udp] {
                        let of_proto = || {
                            st.services
                                .values()
                                .filter(move |s| s.spec.read().protocol == proto)
                        };
                        let exact: Vec<u32> =
                            of_proto().filter(|s| s.listen == a).map(|s| s.id).collect();
                        let mut indexed: Vec<u32> =
                            st.services.on_address(proto, a).map(|s| s.id).collect();
                        indexed.sort_unstable();
                        assert_eq!(indexed, exact, "{proto:?} {a}");
                        assert_eq!(
                            st.services.serves_overlapping(proto, a),
                            of_proto().any(|s| overlaps(s.listen, a)),
                            "{proto:?} {a}"
                        );
                    }
                }
            }
        };
        check();
        for name in ["tcp", "udp-any", "tcp6"] {
            d.control().delete_service("default", name).ok();
            check();
        }
        d.shutdown();
    }

    /// A batch of adds ([`Shared::add_services`]) adds each service that
    /// one add would, fails each that one add would fail, with the same
    /// error, and changes nothing for those; it copies the model once;
    /// every added service is listening; with `stop_at_error` it adds
    /// what comes before the first failure and tries nothing after it.
    #[test]
    fn a_batch_of_adds_fails_each_service_as_one_add_would() {
        use crate::control::ErrorKind;
        let d = daemon(Vec::new(), None);
        let shared = d.shared.clone();
        shared
            .add_service(spec("default", "taken", Protocol::Tcp))
            .unwrap();
        let taken = shared.model.load().services[&key("default", "taken")].clone();
        let mut invalid = spec("default", "bad", Protocol::Tcp);
        invalid.name = "no spaces".into();
        let batch = vec![
            spec("default", "ok1", Protocol::Tcp),
            spec("nope", "s", Protocol::Tcp),
            spec("default", "ok1", Protocol::Udp),
            invalid,
            test_spec("default", "clash", Protocol::Tcp, taken.listen),
            spec("default", "ok2", Protocol::Udp),
        ];
        let before = shared.model.copies.load(Relaxed);
        let errors = shared.add_services(batch, false);
        assert_eq!(shared.model.copies.load(Relaxed) - before, 1);
        let got: Vec<(usize, ErrorKind)> = errors.iter().map(|(i, e)| (*i, e.kind)).collect();
        assert_eq!(
            got,
            [
                (1, ErrorKind::NotFound),
                (2, ErrorKind::Conflict),
                (3, ErrorKind::Invalid),
                (4, ErrorKind::Conflict),
            ],
            "{errors:?}"
        );
        assert!(errors[1].1.message.contains("exists"), "{errors:?}");
        assert!(
            errors[3].1.message.contains("is used by another service"),
            "{errors:?}"
        );
        // The same failures one at a time, now that ok1 is in.
        for (i, spec) in [
            (1, spec("nope", "s", Protocol::Tcp)),
            (2, spec("default", "ok1", Protocol::Udp)),
            (
                4,
                test_spec("default", "clash", Protocol::Tcp, taken.listen),
            ),
        ] {
            let alone = shared.add_service(spec).unwrap_err();
            let (_, e) = errors.iter().find(|(j, _)| *j == i).unwrap();
            assert_eq!((alone.kind, &alone.message), (e.kind, &e.message));
        }
        let st = shared.model.load();
        st.services.assert_index_agrees();
        let names: Vec<&str> = st.services.keys().map(|(_, n)| n.as_str()).collect();
        assert_eq!(names, ["ok1", "ok2", "taken"]);
        assert!(Arc::ptr_eq(&st.services[&key("default", "taken")], &taken));
        assert_eq!(
            st.services[&key("default", "ok1")].spec.read().protocol,
            Protocol::Tcp
        );
        for s in st.services.values() {
            let bound = probe_free(s.spec.read().protocol, s.listen);
            assert!(
                matches!(&bound, Err(e) if e.kind() == std::io::ErrorKind::AddrInUse),
                "{} is not listening: {bound:?}",
                s.listen
            );
        }
        drop(st);

        let errors = shared.add_services(
            vec![
                spec("default", "ok3", Protocol::Tcp),
                spec("nope", "s", Protocol::Tcp),
                spec("default", "ok4", Protocol::Tcp),
            ],
            true,
        );
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!((errors[0].0, errors[0].1.kind), (1, ErrorKind::NotFound));
        let st = shared.model.load();
        assert!(st.services.contains_key(&key("default", "ok3")));
        assert!(!st.services.contains_key(&key("default", "ok4")));
        drop(st);
        d.shutdown();
    }

    /// `n` tenants on the shared flow table (named `t0`...).
    fn tenant_specs(n: usize) -> Vec<TenantSpec> {
        (0..n).map(|i| tenant(&format!("t{i}"))).collect()
    }

    fn tenant(name: &str) -> TenantSpec {
        TenantSpec {
            name: name.into(),
            ..Default::default()
        }
    }

    /// Panics unless the flow table has exactly the model's tenants (by
    /// id), each with its table.
    fn assert_table_has_the_model_tenants(shared: &Shared) {
        let mut model: Vec<u32> = shared.model.load().tenants.values().map(|t| t.id).collect();
        model.sort_unstable();
        let mut table: Vec<u32> = shared.conns.table.tenants().iter().map(|t| t.0).collect();
        table.sort_unstable();
        assert_eq!(table, model, "the flow table's tenants are not the model's");
        for id in model {
            assert!(shared.conns.table.tenant_stats(TenantId(id)).is_some());
        }
    }

    /// Starting with T tenants, and a reload that adds T tenants (and
    /// edits a live one), copy the model a fixed number of times whatever
    /// T: one copy for all the tenants. Each add used to copy it, and the
    /// flow table's tenant directory, O(T^2) in all (301 copies against 2
    /// to start 300 tenants or 1). Every tenant is in the model and the
    /// flow table.
    /// A reload that deletes T tenants copies the model a fixed number of
    /// times whatever T (their services in one change, the tenants in
    /// another: it was one or two copies per tenant, and one copy of the
    /// flow table's tenant directory each), and leaves the flow table with
    /// exactly the model's tenants.
    #[test]
    fn a_reload_deleting_many_tenants_copies_the_model_a_fixed_number_of_times() {
        let reload = |n: usize| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("weir.toml");
            let mut cfg = Config::default();
            cfg.daemon.workers = 1;
            cfg.tenants = tenant_specs(n);
            cfg.tenants.push(tenant("stays"));
            cfg.services = (0..n)
                .map(|i| spec(&format!("t{i}"), "s", Protocol::Udp))
                .collect();
            cfg.services.push(spec("stays", "s", Protocol::Udp));
            let d = crate::daemon::Daemon::start(cfg, Some(path.clone())).unwrap();
            let mut cfg = d.control().running_config();
            cfg.tenants.retain(|t| t.name == "stays");
            cfg.services.retain(|s| s.tenant == "stays");
            let (report, copies) = reload_counting_copies(&d, &path, &cfg);
            assert_eq!(report.removed.len(), 2 * n, "{:?}", report.removed);
            let st = d.shared.model.load();
            let mut names: Vec<_> = st.tenants.keys().cloned().collect();
            names.sort();
            assert_eq!(names, ["default", "stays"]);
            assert_eq!(st.services.len(), 1);
            drop(st);
            assert_table_has_the_model_tenants(&d.shared);
            d.shutdown();
            copies
        };
        assert_eq!(reload(300), reload(1));
        assert_eq!(reload(1), 2);
    }

    /// A batch of tenant deletions fails each name as a lone deletion
    /// would (the default tenant, a name that does not exist or came
    /// earlier in the batch) and deletes the others with their services and
    /// flow-table entries; the other tenants keep theirs.
    #[test]
    fn a_batch_of_tenant_deletions_fails_each_as_one_deletion_would() {
        use crate::control::ErrorKind;
        let d = daemon_with_tenants(
            &["a", "b", "c"],
            vec![
                spec("a", "s", Protocol::Udp),
                spec("b", "s", Protocol::Udp),
                spec("c", "s", Protocol::Udp),
            ],
        );
        let st = d.shared.model.load();
        let table = &d.shared.conns.table;
        for svc in st.services.values() {
            for i in 0..10u8 {
                let init = FlowInit {
                    owner: 0,
                    profile: weir_flowtable::ProfileRef::NONE,
                    service: ServiceId(svc.id),
                    backend: BackendId(0),
                    state: FlowState::Udp,
                };
                let client = SocketAddr::from(([10, 2, 0, i], 3000));
                table
                    .insert(
                        flow_key(svc, Protocol::Udp, client),
                        init,
                        Millis(d.shared.now_ms()),
                    )
                    .unwrap();
            }
        }
        let id = |n: &str| TenantId(st.tenants[n].id);
        let (a, b, c) = (id("a"), id("b"), id("c"));
        drop(st);
        let names: Vec<String> = ["a", "default", "a", "nope", "b"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let got = super::super::control_impl::LiveControl(d.shared.clone()).delete_tenants(&names);
        let kinds: Vec<_> = got.iter().map(|r| r.as_ref().map_err(|e| e.kind)).collect();
        assert_eq!(
            kinds,
            [
                Ok(&0),
                Err(ErrorKind::Conflict),
                Err(ErrorKind::NotFound),
                Err(ErrorKind::NotFound),
                Ok(&0)
            ]
        );
        let st = d.shared.model.load();
        let mut left: Vec<_> = st.tenants.keys().cloned().collect();
        left.sort();
        assert_eq!(left, ["c", "default"]);
        assert_eq!(
            st.services.keys().cloned().collect::<Vec<_>>(),
            [key("c", "s")]
        );
        drop(st);
        assert_eq!(table.tenant_stats(a), None);
        assert_eq!(table.tenant_stats(b), None);
        assert_eq!(table.tenant_stats(c).map(|s| s.entries), Some(10));
        assert_table_has_the_model_tenants(&d.shared);
        // Added at runtime, then deleted in a batch: forgotten, with what is
        // in them; another runtime tenant stays remembered.
        let control = d.control();
        for t in ["rt1", "rt2", "rt3"] {
            control.add_tenant(tenant(t)).unwrap();
            control.add_service(spec(t, "s", Protocol::Udp)).unwrap();
        }
        let remembered = || {
            let mut v: Vec<String> = d
                .shared
                .model
                .runtime_added
                .lock()
                .iter()
                .cloned()
                .collect();
            v.sort();
            v
        };
        assert_eq!(remembered().len(), 6);
        let lc = super::super::control_impl::LiveControl(d.shared.clone());
        let got = lc.delete_tenants(&["rt1".to_string(), "rt3".to_string()]);
        assert!(got.iter().all(Result::is_ok));
        assert_eq!(remembered(), ["service rt2/s", "tenant rt2"]);
        // A lone deletion of each fails the same way.
        for (name, kind) in [("default", ErrorKind::Conflict), ("a", ErrorKind::NotFound)] {
            assert_eq!(d.control().delete_tenant(name).unwrap_err().kind, kind);
        }
        d.shutdown();
    }

    #[test]
    fn adding_many_tenants_copies_the_model_a_fixed_number_of_times() {
        let start = |n: usize| {
            let mut cfg = Config::default();
            cfg.daemon.workers = 1;
            cfg.tenants = tenant_specs(n);
            let d = crate::daemon::Daemon::start(cfg, None).unwrap();
            // And the default tenant.
            assert_eq!(d.shared.model.load().tenants.len(), n + 1);
            assert_table_has_the_model_tenants(&d.shared);
            let copies = d.shared.model.copies.load(Relaxed);
            d.shutdown();
            copies
        };
        assert_eq!(start(300), start(1));

        let reload = |n: usize| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("weir.toml");
            let mut cfg = Config::default();
            cfg.daemon.workers = 1;
            cfg.tenants = vec![tenant("a")];
            let d = crate::daemon::Daemon::start(cfg, Some(path.clone())).unwrap();
            let a = d.shared.model.load().tenants["a"].clone();
            let mut cfg = d.control().running_config();
            cfg.tenants[0].max_connections = 7;
            cfg.tenants.extend(tenant_specs(n));
            let (report, copies) = reload_counting_copies(&d, &path, &cfg);
            assert_eq!(report.added.len(), n);
            assert_eq!(report.changed, ["tenant a"]);
            let st = d.shared.model.load();
            assert_eq!(st.tenants.len(), n + 2);
            for t in &cfg.tenants {
                assert_eq!(*st.tenants[&t.name].spec.read(), *t);
            }
            // Edited in place: the same tenant.
            assert!(Arc::ptr_eq(&st.tenants["a"], &a));
            drop(st);
            assert_table_has_the_model_tenants(&d.shared);
            d.shutdown();
            copies
        };
        assert_eq!(reload(300), 1);
        assert_eq!(reload(1), 1);
    }

    /// A service edited through more distinct connect timeouts than a
    /// tenant has timeout profiles keeps working: the profile of the old
    /// timeouts goes back when no service holds it (and no entry names
    /// it). Profiles held by live services are still refused past the
    /// limit, and the refusal names the tenant (it said "tenant 1").
    #[test]
    fn timeout_profiles_no_service_holds_are_given_back() {
        use weir_flowtable::MAX_PROFILES;
        let d = daemon(vec![spec("default", "s", Protocol::Udp)], None);
        let control = d.control();
        let mut s = control.service_spec("default", "s").unwrap();
        for ms in 1..=MAX_PROFILES as u64 + 100 {
            s.options.connect_timeout = Some(format!("{ms}ms").parse().unwrap());
            if let Err(e) = control.edit_service("default", "s", s.clone()) {
                panic!("edit {ms}: {e:?}");
            }
        }
        let tenant = d.shared.model.load().tenants["default"].clone();
        let base = service_params(&s).unwrap();
        let mut held = Vec::new();
        let err = loop {
            let p = ServiceParams {
                connect_timeout: Duration::from_millis(1_000_000 + held.len() as u64),
                ..base.clone()
            };
            match d.shared.with_profile(&tenant, p) {
                Ok(p) => held.push(p),
                Err(e) => break e,
            }
            assert!(
                held.len() < MAX_PROFILES,
                "more profiles held than a tenant has"
            );
        };
        // The service's own, and the one of no overrides, are not counted.
        assert_eq!(held.len(), MAX_PROFILES - 2);
        assert!(err.message.contains("\"default\""), "{}", err.message);
        drop(held);
        d.shutdown();
    }

    /// Tenant and service ids (one counter) are 32-bit, as the flow
    /// table's entries store them: when the counter wraps, it skips 0 and
    /// every id still in use. They wrapped onto live ids.
    #[test]
    fn tenant_and_service_ids_skip_live_ones_when_the_counter_wraps() {
        let d = daemon_with_tenants(&["a"], vec![spec("a", "s", Protocol::Udp)]);
        let shared = d.shared.clone();
        let ids = || -> Vec<u32> {
            let st = shared.model.load();
            let mut v: Vec<u32> = st.tenants.values().map(|t| t.id).collect();
            v.extend(st.services.values().map(|s| s.id));
            v
        };
        let before = ids();
        shared.model.ids.set_next(u32::MAX - 1);
        for i in 0..4 {
            let name = format!("t{i}");
            shared.add_tenant(tenant(&name)).unwrap();
            shared.add_service(spec(&name, "s", Protocol::Udp)).unwrap();
        }
        let mut all = ids();
        assert_eq!(all.len(), before.len() + 8);
        assert!(!all.contains(&0), "id 0: {all:?}");
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), before.len() + 8, "an id given twice: {all:?}");
        d.shutdown();
    }

    /// A backend added back to a service while the one removed from that
    /// address still has connections gets an id of its own: the two share
    /// one service, where flows find their backend by id, so the old one's
    /// flows would be settled on the new one (its counts off, and the old
    /// one never drained out of `removed`).
    #[test]
    fn a_backend_added_back_while_its_removed_one_drains_has_its_own_id() {
        let mut s = spec("default", "s", Protocol::Tcp);
        s.backends = vec![backend_at(2000), backend_at(2001)];
        let d = daemon_with_tenants(&[], vec![s]);
        let control = d.control();
        let svc = d.shared.model.load().services[&key("default", "s")].clone();
        let old = svc.set.load().backends[1].clone();
        // A connection still counted on it.
        assert!(old.take_place());
        control
            .delete_backend("default", "s", &old.addr.to_string())
            .unwrap();
        control
            .add_backend("default", "s", backend_at(old.addr.port()))
            .unwrap();
        let new = svc
            .set
            .load()
            .backends
            .iter()
            .find(|b| b.addr == old.addr)
            .unwrap()
            .clone();
        assert_ne!(new.id, old.id, "the draining backend's id was shared");
        assert!(Arc::ptr_eq(&svc.backend(old.id).unwrap(), &old));
        old.give_place();
        d.shutdown();
    }

    /// A tenant's backends at one address have one id while any lives (a
    /// reply from the address is then one lookup for the tenant); other
    /// addresses have others, and the leases gone are swept out of the map
    /// as it grows, so it stays about twice the live ones.
    #[test]
    fn a_tenants_backends_at_one_address_share_an_id() {
        let ids = Ids::new();
        let t = BackendIds::default();
        let addr = |i: u16| SocketAddr::from(([10, 1, 0, 1], i));
        let a = t.lease(addr(1), &ids, |_| false);
        let b = t.lease(addr(1), &ids, |_| false);
        assert_eq!(a.id(), b.id());
        let c = t.lease(addr(2), &ids, |_| false);
        assert_ne!(a.id(), c.id());
        let other = BackendIds::default().lease(addr(1), &ids, |_| false);
        assert_ne!(a.id(), other.id(), "another tenant's");
        let gone = a.id();
        drop((a, b));
        assert!(!ids.leased(gone), "the id goes with its last backend");
        assert_ne!(t.lease(addr(1), &ids, |_| false).id(), c.id());
        for i in 0..1000 {
            drop(t.lease(addr(100 + i), &ids, |_| false));
        }
        assert!(t.len() <= 128, "{} entries for 1 live backend", t.len());
    }

    /// Backend ids, from their own counter, as tenant and service ids.
    #[test]
    fn backend_ids_skip_live_ones_when_the_counter_wraps() {
        let rates = stats::RateEngine::new(1).unwrap();
        let spec = |i: u8| crate::config::BackendSpec {
            address: SocketAddr::from(([10, 1, 0, i], 8080)),
            weight: 1,
            proxy_protocol: None,
            max_connections: 0,
        };
        let ids = Ids::new();
        let first = Backend::new_in(spec(0), &rates, &ids);
        ids.set_next(u32::MAX - 1);
        let mut live = vec![first];
        for i in 1..4 {
            live.push(Backend::new_in(spec(i), &rates, &ids));
        }
        ids.set_next(live[0].id);
        live.push(Backend::new_in(spec(9), &rates, &ids));
        let mut all: Vec<u32> = live.iter().map(|b| b.id).collect();
        assert!(!all.contains(&0), "id 0: {all:?}");
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), live.len(), "an id given twice: {all:?}");
        // A backend gone, its id is free again.
        let gone = live.pop().unwrap().id;
        ids.set_next(gone);
        assert_eq!(Backend::new_in(spec(10), &rates, &ids).id, gone);
    }

    /// A batch of tenant adds ([`Shared::add_tenants`]) adds each tenant
    /// that one add after another would, and fails each that they would
    /// fail, with the same error: a name of the batch's earlier tenant or
    /// of the model, an invalid name, size or fence (a name whose earlier
    /// spec failed is free). It copies the model once; a failed tenant
    /// gets no id and leaves no flow-table tenant; the added ones are
    /// usable. A batch that adds nothing copies nothing.
    #[test]
    fn a_batch_of_tenant_adds_fails_each_as_one_add_would() {
        use crate::control::ErrorKind;
        let d = daemon_with_tenants(&["taken"], Vec::new());
        let shared = d.shared.clone();
        let batch = vec![
            tenant("ok1"),
            tenant("ok1"),
            tenant("taken"),
            tenant("no spaces"),
            TenantSpec {
                table_entries: 3,
                ..tenant("size")
            },
            TenantSpec {
                allowed_listen: vec!["nonsense".into()],
                ..tenant("fence")
            },
            TenantSpec {
                table_entries: 1024,
                ..tenant("own")
            },
            tenant("size"),
        ];
        let ids = shared.model.ids.next();
        let before = shared.model.copies.load(Relaxed);
        let errors = shared.add_tenants(batch.clone());
        assert_eq!(shared.model.copies.load(Relaxed) - before, 1);
        let got: Vec<(usize, ErrorKind)> = errors.iter().map(|(i, e)| (*i, e.kind)).collect();
        assert_eq!(
            got,
            [
                (1, ErrorKind::Conflict),
                (2, ErrorKind::Conflict),
                (3, ErrorKind::Invalid),
                (4, ErrorKind::Invalid),
                (5, ErrorKind::Invalid),
            ],
            "{errors:?}"
        );
        assert!(errors[0].1.message.contains("exists"), "{errors:?}");
        // Only the three added got ids.
        assert_eq!(shared.model.ids.next() - ids, 3);
        // The same failures one at a time, now that ok1 is in.
        for (i, e) in &errors {
            let alone = shared.add_tenant(batch[*i].clone()).unwrap_err();
            assert_eq!((alone.kind, &alone.message), (e.kind, &e.message));
        }
        let st = shared.model.load();
        let names: Vec<&str> = st.tenants.keys().map(String::as_str).collect();
        assert_eq!(names, ["default", "ok1", "own", "size", "taken"]);
        assert_eq!(st.tenants["own"].placement, "own");
        assert_eq!(st.tenants["ok1"].placement, "shared");
        drop(st);
        assert_table_has_the_model_tenants(&shared);
        shared.add_service(spec("ok1", "s", Protocol::Tcp)).unwrap();
        shared.add_service(spec("own", "s", Protocol::Tcp)).unwrap();

        let before = shared.model.copies.load(Relaxed);
        let errors = shared.add_tenants(vec![tenant("taken"), tenant("bad name")]);
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert_eq!(shared.model.copies.load(Relaxed), before);
        assert_table_has_the_model_tenants(&shared);

        d.shutdown();
    }

    /// A connection that stores its persistence template after its
    /// service's deletion dropped the templates leaves nothing behind:
    /// neither the pick's store (`choose`) nor the hold's
    /// (`hold_template`). The test runs them after the deletion (its
    /// cancel, then `drop_templates`), as for a connection whose pick
    /// raced it. The template used to stay until its persistence timeout,
    /// counting against the tenant's table.
    #[test]
    fn a_template_stored_after_its_service_was_deleted_is_removed() {
        let (d, svc) = daemon_with_a_persistent_service(&[2000]);
        let shared = d.shared.clone();
        let params = svc.params.load_full();
        let client: SocketAddr = "10.9.8.7:4000".parse().unwrap();
        let tpl = template_key(&svc, &params, Protocol::Tcp, client);
        let entries = || {
            let t = TenantId(svc.tenant.id);
            shared.conns.table.tenant_stats(t).map(|s| s.entries)
        };
        d.control().delete_service("default", "p").unwrap();
        assert!(svc.cancel.is_cancelled());
        assert_eq!(entries(), Some(0));

        let mut rng = weir_sched::SplitMix64::new(7);
        let b = svc.choose_tcp(&shared, client, &mut rng);
        assert!(
            shared.conns.table.get(&tpl).is_none(),
            "the pick's template, stored after the deletion's drop, stays"
        );
        assert_eq!(entries(), Some(0));

        let held = shared.hold_template(&svc, &params, Protocol::Tcp, client, b.id);
        assert!(
            shared.conns.table.get(&tpl).is_none(),
            "the hold's template, stored after the deletion's drop, stays"
        );
        assert_eq!(
            held, None,
            "a deleted service's connection holds a template"
        );
        assert_eq!(entries(), Some(0));
        d.shutdown();
    }

    /// A persistence template of another service under this service's key
    /// (same tenant, protocol, client group and address: a service that
    /// had the address before, whose deletion has not dropped it yet) is
    /// not this service's: the pick neither reuses it nor moves it, and a
    /// connection does not hold it. The pick used to look up the
    /// template's backend id among its own backends without comparing the
    /// service: it moved a foreign template to its own backend (which then
    /// placed its clients under the other service's id, out of reach of
    /// its own drops), reused one naming its backend, and held it.
    #[test]
    fn a_template_of_another_service_under_the_same_key_is_left_alone() {
        let (d, svc) = daemon_with_a_persistent_service(&[2000, 2001]);
        let shared = d.shared.clone();
        let table = &shared.conns.table;
        let params = svc.params.load_full();
        let ids: Vec<u32> = svc.set.load().backends.iter().map(|b| b.id).collect();
        let client: SocketAddr = "10.9.8.7:4000".parse().unwrap();
        let tpl = template_key(&svc, &params, Protocol::Tcp, client);
        let mut rng = weir_sched::SplitMix64::new(7);
        // Stored before any pick, at time 0 (a pick would touch it now).
        let store = |backend: u32| {
            table.remove(&tpl);
            let init = FlowInit {
                owner: 0,
                profile: params.profile.for_init(),
                service: ServiceId(svc.id.wrapping_add(1000)),
                backend: BackendId(backend),
                state: FlowState::Persist,
            };
            table.insert(tpl, init, Millis(0)).unwrap();
            table.get(&tpl).unwrap()
        };
        // Each backend named by the foreign template: the pick's and the
        // hold's outcome is as with no template, and it stays as it was.
        for named in [u32::MAX - 7, ids[0], ids[1]] {
            let before = store(named);
            for _ in 0..4 {
                let b = svc.choose_tcp(&shared, client, &mut rng);
                assert_eq!(table.get(&tpl), Some(before), "the pick touched it");
                let held = shared.hold_template(&svc, &params, Protocol::Tcp, client, b.id);
                assert_eq!(held, None, "a connection holds another service's template");
                assert_eq!(table.get(&tpl), Some(before), "the hold touched it");
            }
        }
        d.shutdown();
    }

    /// A connection's release of its persistence template gives back its
    /// own hold only. Its template can go while it is held (the service's
    /// deletion, or an edit of its persistence, drops the templates) and a
    /// template of another service (one that took the address since) can
    /// then sit under the same key. The release, by key alone, lowered
    /// that template's count: a hold of the other service's connection
    /// was lost, so its template could expire under it.
    #[test]
    fn a_release_leaves_another_services_template_under_the_same_key_held() {
        let (d, svc) = daemon_with_a_persistent_service(&[2000]);
        let shared = d.shared.clone();
        let table = &shared.conns.table;
        let params = svc.params.load_full();
        let b = svc.set.load().backends[0].id;
        let client: SocketAddr = "10.9.8.7:4000".parse().unwrap();
        let held = shared
            .hold_template(&svc, &params, Protocol::Tcp, client, b)
            .expect("the connection holds its template");
        let tpl = held.key;
        assert_eq!(table.get(&tpl).map(|t| t.held), Some(1));
        // Its template dropped; another service's, held once, in its place.
        assert_eq!(shared.drop_templates(&svc), 1);
        let other = FlowInit {
            owner: 0,
            profile: params.profile.for_init(),
            service: ServiceId(svc.id.wrapping_add(1000)),
            backend: BackendId(b),
            state: FlowState::Persist,
        };
        table.insert_held(tpl, other, Millis(0)).unwrap();
        shared.release_template(&svc, held);
        let t = table.get(&tpl).unwrap();
        assert_eq!(t.service, other.service);
        assert_eq!(t.held, 1, "the release took the other service's hold");
        // Its own template's release does give back its own hold.
        table.remove(&tpl);
        let held = shared
            .hold_template(&svc, &params, Protocol::Tcp, client, b)
            .unwrap();
        shared.release_template(&svc, held);
        assert_eq!(table.get(&held.key).map(|t| t.held), Some(0));
        d.shutdown();
    }

    /// A connection's release gives back its hold on the template it held,
    /// not on a newer one of the same service stored under the same key
    /// after its own was removed (persistence turned off and on again, an
    /// edit of the mask and back): that one's holds are its own
    /// connections'. The release used to match the key and the service
    /// only, and took the newer template's only hold, so it could expire
    /// under the connection that held it.
    #[test]
    fn a_release_leaves_a_newer_template_of_its_service_held() {
        let mut s = spec("default", "p", Protocol::Tcp);
        s.persistence = "300s".parse().unwrap();
        s.backends.push(backend_at(2000));
        let d = daemon_with_tenants(&[], vec![s]);
        let shared = d.shared.clone();
        let table = &shared.conns.table;
        let svc = shared.model.load().services[&key("default", "p")].clone();
        let params = svc.params.load_full();
        let b = svc.set.load().backends[0].id;
        let client: SocketAddr = "10.9.8.7:4000".parse().unwrap();
        let first = shared
            .hold_template(&svc, &params, Protocol::Tcp, client, b)
            .expect("the first connection holds its template");
        // Its template dropped; the next connection stores it again.
        assert_eq!(shared.drop_templates(&svc), 1);
        let second = shared
            .hold_template(&svc, &params, Protocol::Tcp, client, b)
            .expect("the second connection holds the new template");
        assert_eq!(table.get(&second.key).map(|t| t.held), Some(1));
        shared.release_template(&svc, first);
        assert_eq!(
            table.get(&second.key).map(|t| t.held),
            Some(1),
            "the first connection's release took the second's hold"
        );
        shared.release_template(&svc, second);
        assert_eq!(table.get(&second.key).map(|t| t.held), Some(0));
        d.shutdown();
    }

    /// A removed backend's id stays taken while a persistence template of
    /// its service names it (its connections ended, the template within
    /// its timeout): a new backend given the id would get the template's
    /// client group (the pick finds the template's backend id in the set),
    /// and its listings and kills. The id is free again once the template
    /// is gone. Templates were not counted: the id was freed at the first
    /// edit after the backend's last connection ended.
    #[test]
    fn a_removed_backends_id_stays_taken_while_a_template_names_it() {
        let (d, svc) = daemon_with_a_persistent_service(&[2000, 2001]);
        let shared = d.shared.clone();
        let control = d.control();
        let table = &shared.conns.table;
        let params = svc.params.load_full();
        let client: SocketAddr = "10.9.8.7:4000".parse().unwrap();
        let tpl = template_key(&svc, &params, Protocol::Tcp, client);
        // The client's pick stores its template; its connection is over.
        let mut rng = weir_sched::SplitMix64::new(7);
        let picked = svc.choose_tcp(&shared, client, &mut rng);
        let (gone, addr) = (picked.id, picked.addr);
        drop(picked);
        assert_eq!(table.get(&tpl).map(|t| t.backend), Some(BackendId(gone)));
        control
            .delete_backend("default", "p", &addr.to_string())
            .unwrap();
        // Edits after the removal: each forgets the removed backends that
        // nothing names any more (once health checks and snapshots of the
        // old set let go of it).
        let edit = || {
            let again = backend_at(2003);
            control.add_backend("default", "p", again.clone()).unwrap();
            control
                .delete_backend("default", "p", &again.address.to_string())
                .unwrap();
        };
        for i in 0..50 {
            edit();
            assert!(
                BACKEND_IDS.leased(gone),
                "the id of a removed backend a template names is free after edit {i}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_a_new_backend_skips(&*control, &svc, gone, 2002);
        // The template goes: the id is free again (at the next edit).
        table.remove(&tpl).unwrap();
        assert_freed_by_edits(
            gone,
            edit,
            "the id of a removed backend nothing names stays taken",
        );
        d.shutdown();
    }

    /// An edit of a service's backends after one of them was removed walks
    /// the service's persistence templates for the ids they name
    /// (`retire_backends`): O(templates), 150 ms for 1M templates of one
    /// service in the test profile. The walk runs off the control
    /// runtime's one worker, and other admin requests are answered
    /// meanwhile. It ran on that worker, and every admin request, the
    /// health checks and the watchdog's keep-alives waited for it.
    #[test]
    fn a_backend_edits_template_walk_does_not_hold_up_the_admin_api() {
        use crate::daemon::tests::{admin_api, posted, services_listed, wait_for_a_waiter};
        let (d, svc) = daemon_with_a_persistent_service(&[2000, 2001]);
        let (url, stop) = admin_api(&d, "template-walk-test-token");
        let client = || {
            crate::cli::client::Client::new(url.clone(), Some("template-walk-test-token".into()))
        };
        d.control()
            .delete_backend("default", "p", "127.0.0.9:2001")
            .unwrap();
        // Once nothing holds the removed backend, the next edit walks.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !svc
            .removed
            .lock()
            .iter()
            .all(|b| b.conns() == 0 && Arc::strong_count(b) == 1)
        {
            assert!(Instant::now() < deadline, "the removed backend stays held");
            std::thread::sleep(Duration::from_millis(5));
        }
        let gate = svc.template_walk_gate.write();
        let edit = posted(
            client(),
            "/v1/services/default/p/backends",
            serde_json::json!({ "address": "127.0.0.9:2002" }),
        );
        wait_for_a_waiter(&svc.template_walks, "the edit never walked the templates");
        let answer = services_listed(client());
        assert!(
            matches!(answer, Ok(Ok(serde_json::Value::Array(_)))),
            "GET /v1/services while a backend edit walks the service's templates: {answer:?}"
        );
        drop(gate);
        let added = edit.join().unwrap();
        assert!(added.is_ok(), "the edit after the walk: {added:?}");
        assert!(
            svc.set
                .load()
                .backends
                .iter()
                .any(|b| b.addr.port() == 2002),
            "the edit's backend is not in the set"
        );
        stop.cancel();
        d.shutdown();
    }

    /// A removed backend's id is not given to another backend while flows
    /// still name it, however the flow got there: here a connection whose
    /// pick saw the backend before its removal and inserts its entry after
    /// it (and after another edit of the service). The id is free again
    /// once those flows are gone. It was freed with the backend object:
    /// a new backend could then get it and inherit the old one's flows
    /// (its counts, its kills, its listings).
    #[test]
    fn a_removed_backends_id_stays_taken_while_flows_name_it() {
        let (d, svc) = daemon_with_a_service(false, &[2000, 2001]);
        let shared = d.shared.clone();
        let control = d.control();
        let table = &shared.conns.table;
        // A connection's pick, before the removal.
        let picked = svc.set.load().backends[1].clone();
        let gone = picked.id;
        control
            .delete_backend("default", "p", &picked.addr.to_string())
            .unwrap();
        control
            .add_backend("default", "p", backend_at(2002))
            .unwrap();
        // Its place and entry, after: as `Shared::open` takes them.
        assert!(picked.take_place());
        picked.inactive.fetch_add(1, Relaxed);
        let fkey = flow_key(&svc, Protocol::Tcp, "10.0.0.1:1000".parse().unwrap());
        let init = FlowInit {
            owner: 0,
            profile: weir_flowtable::ProfileRef::NONE,
            service: ServiceId(svc.id),
            backend: BackendId(gone),
            state: FlowState::SynSent,
        };
        table.insert(fkey, init, Millis(shared.now_ms())).unwrap();
        drop(picked);
        assert!(
            BACKEND_IDS.leased(gone),
            "the id of a removed backend a flow names is free"
        );
        assert_a_new_backend_skips(&*control, &svc, gone, 2003);
        // The flow ends: the id is free again (at the service's next edit).
        let snap = table.remove(&fkey).unwrap();
        shared.ended(&[snap], Close::IdleTimeout);
        let edit = || {
            let again = backend_at(2003);
            control
                .delete_backend("default", "p", &again.address.to_string())
                .unwrap();
            control.add_backend("default", "p", again).unwrap();
        };
        assert_freed_by_edits(
            gone,
            edit,
            "the id of a removed backend with no flow left stays taken",
        );
        d.shutdown();
    }
}

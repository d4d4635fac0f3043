//! The connections: the flow table, whose entry *is* the connection
//! (backend, state, timers, byte counters), and the owner slots through
//! which an entry names the task holding its sockets. Opening a connection
//! (insert, backend counts), closing it, settling a removed entry (backend
//! counts, access log) and telling owners to close (kill by filter, a
//! service's or backend's connections) are here.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

use tokio_util::sync::CancellationToken;
use weir_flowtable::{
    BackendId, Cookie, DumpFilter, FlowInit, FlowKey, FlowSnapshot, FlowState, FlowTable, Handle,
    Millis, Proto, ServiceId, TenantId,
};

use super::owners::{self, Close};
use super::{Backend, Refusal, Service, Shared, flow_key, packet};
use crate::config::Protocol;

/// The connection table and the tasks that own its entries.
#[derive(Debug)]
pub(crate) struct Conns {
    /// The flow table: connections, UDP sessions and persistence templates.
    pub(crate) table: FlowTable,
    /// The tasks that own proxied connections, named by their entries.
    pub(crate) owners: Arc<owners::Owners>,
    /// Cancelled when the daemon stops: a connection opened after that
    /// closes at once.
    pub(crate) kill_all: CancellationToken,
}

impl Conns {
    /// `table`, with owner slots for `workers` proxy workers.
    pub(super) fn new(table: FlowTable, workers: usize) -> Self {
        Self {
            table,
            owners: Arc::new(owners::Owners::new(workers)),
            kill_all: CancellationToken::new(),
        }
    }
}

/// Connection states as `weir conns` prints them (IPVS names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum ConnState {
    SynRecv = 0,
    Established = 1,
    FinWait = 2,
    Close = 3,
    Udp = 4,
}

impl ConnState {
    fn flow(self) -> FlowState {
        match self {
            Self::SynRecv => FlowState::SynRecv,
            Self::Established => FlowState::Established,
            Self::FinWait => FlowState::FinWait,
            Self::Close => FlowState::Close,
            Self::Udp => FlowState::Udp,
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::SynRecv,
            1 => Self::Established,
            2 => Self::FinWait,
            4 => Self::Udp,
            _ => Self::Close,
        }
    }
}

/// A live connection or UDP session as its task holds it: where its entry
/// is, and what its bytes count against. Everything that changes (state,
/// timers, counters) is in the entry; this is the task's own, never shared.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) handle: Handle,
    pub(crate) service: Arc<Service>,
    pub(crate) backend: Arc<Backend>,
    pub(crate) client: SocketAddr,
    /// The state this task last gave the entry (it alone changes it), for
    /// the backend's active/inactive counts.
    state: AtomicU8,
    /// The persistence template this connection holds, if any.
    template: Option<super::model::HeldTemplate>,
}

impl Conn {
    /// Move the entry to `s`, keeping the backend's active/inactive counts
    /// in step (nothing if the entry is gone: its remover settled it).
    pub(crate) fn set_state(&self, shared: &Shared, s: ConnState) {
        if !shared
            .conns
            .table
            .set_state_handle(self.handle, s.flow(), Millis(shared.now_ms()))
        {
            return;
        }
        let old = ConnState::from_u8(self.state.swap(s as u8, Relaxed));
        let was_active = old == ConnState::Established;
        let is_active = s == ConnState::Established;
        if was_active != is_active {
            if is_active {
                self.backend.active.fetch_add(1, Relaxed);
                self.backend.inactive.fetch_sub(1, Relaxed);
            } else {
                self.backend.active.fetch_sub(1, Relaxed);
                self.backend.inactive.fetch_add(1, Relaxed);
            }
        }
    }
}

/// Expiry references an early drop ([`Shared::take_place`]) looks at for
/// a flow to end: what a refused SYN costs at most. Under a flood the first ones
/// due are the flood's own; a tenant full of finished handshakes is passed
/// over in a few dozen reads.
pub(crate) const EARLY_DROP_LOOK: usize = 64;

/// How long a tenant's early drop rests after a look that found nothing
/// to take the place of: at most 100 fruitless looks a second per tenant,
/// whatever the flood's rate.
pub(crate) const EARLY_DROP_BACKOFF_MS: u64 = 10;

/// Which tenant a new flow refused at a daemon-wide limit takes a place
/// from (packet mode's `Engine::early_drop`, the UDP proxy's
/// `udp::take_a_place_pressed`): the one whose new flows met such a limit
/// most often lately (`Tenant::at_daemon_limit`), i.e. the one a flood is
/// aimed at. The limits are the daemon's `max_connections`, and for the
/// UDP proxy's sessions also the descriptors running out (a session is a
/// socket). The pressing tenant's flows that never heard back are the
/// flood's, so a flood against one tenant that fills a daemon-wide limit
/// no longer refuses every other tenant's clients, and never ends a
/// bystander's handshakes: a tenant holding many places but meeting the
/// limit rarely (one with many long connections) is not picked, nor one
/// that has not met it lately.
///
/// "Lately" is a score per tenant: the flows that met the limit, halved
/// every [`EARLY_DROP_BACKOFF_MS`]. A count over the last period alone
/// misled it: after a worker stalled for a period (the machine busy
/// elsewhere), the flood's tenant had met the limit zero times in it, and
/// the first other tenant's SYN after the stall, having met it once, got
/// itself picked, found nothing of its own to give and was refused, as
/// was every one of its SYNs for the period (the `synflood-tenants` bench
/// row's refusals of b). A pick that finds nothing to give rests
/// ([`Shared::take_place`]) and is passed over until its rest ends.
///
/// Found again at most every [`EARLY_DROP_BACKOFF_MS`] (or when the pick
/// rests), so a flood at the limit costs a compare per new flow, not a
/// pass over every tenant; "no tenant to take from" stands for 1 ms. One
/// per packet worker and one per proxy worker: no lock.
#[derive(Debug, Default)]
pub(crate) struct Pressing {
    /// The last pick (`None`: none to take from) and until when (daemon
    /// ms) it stands.
    pick: Option<(Option<Arc<super::Tenant>>, u64)>,
    /// Each tenant's id, its `at_daemon_limit` when last looked at, and
    /// its score, by its place in the list looked at then.
    seen: Vec<(u32, u64, u64)>,
    /// Scratch for the next `seen`, kept to allocate nothing per look.
    next: Vec<(u32, u64, u64)>,
    /// When the scores were last halved (daemon ms).
    halved_at: u64,
}

impl Pressing {
    /// A place for a new flow of `own` refused at a daemon-wide limit:
    /// counts its press on the limit, then `take`s one from the tenant
    /// pressing hardest among `tenants`, or from `own` if that one has none
    /// to give; if the pick had nothing to give (it now rests), from the
    /// next pick. Whether one was taken.
    pub(crate) fn take_place<'t, I>(
        &mut self,
        own: &super::Tenant,
        tenants: I,
        now: Millis,
        mut take: impl FnMut(&super::Tenant) -> bool,
    ) -> bool
    where
        I: IntoIterator<Item = &'t Arc<super::Tenant>>,
        I::IntoIter: Clone,
    {
        own.at_daemon_limit.fetch_add(1, Relaxed);
        let tenants = tenants.into_iter();
        for _ in 0..2 {
            let pressing = self.tenant(own.id, tenants.clone(), now);
            let victim = pressing.as_deref().unwrap_or(own);
            if take(victim) || (victim.id != own.id && take(own)) {
                return true;
            }
            if pressing.is_none() || !victim.early_drop_resting(now) {
                break;
            }
        }
        false
    }

    /// The tenant to take from, for a flow of tenant `own` that has just
    /// met the limit (and been counted).
    fn tenant<'t>(
        &mut self,
        own: u32,
        tenants: impl Iterator<Item = &'t Arc<super::Tenant>>,
        now: Millis,
    ) -> Option<Arc<super::Tenant>> {
        if let Some((pick, until)) = &self.pick
            && now.0 < *until
        {
            match pick {
                None => return None,
                Some(t) if !t.deleted.is_cancelled() && !t.early_drop_resting(now) => {
                    return Some(t.clone());
                }
                // Gone, or it had nothing to give: look again.
                Some(_) => {}
            }
        }
        let periods = now.0.saturating_sub(self.halved_at) / EARLY_DROP_BACKOFF_MS;
        let halvings = periods.min(63) as u32;
        self.halved_at = if periods > 63 {
            now.0
        } else {
            self.halved_at + periods * EARLY_DROP_BACKOFF_MS
        };
        let mut best: Option<(u64, &Arc<super::Tenant>)> = None;
        // The last list by id, made the first time a tenant is not where
        // it was (the list changed).
        let mut by_id: Option<std::collections::HashMap<u32, (u64, u64)>> = None;
        self.next.clear();
        for (i, t) in tenants.enumerate() {
            let count = t.at_daemon_limit.load(Relaxed);
            // One new to the list is counted from now (its count so far is
            // no evidence of lately), but for the flow that just met the
            // limit.
            let (seen, score) = match self.seen.get(i) {
                Some(&(id, seen, score)) if id == t.id => (seen, score),
                _ => by_id
                    .get_or_insert_with(|| {
                        self.seen.iter().map(|&(id, n, s)| (id, (n, s))).collect()
                    })
                    .get(&t.id)
                    .copied()
                    .unwrap_or((count.saturating_sub((t.id == own).into()), 0)),
            };
            let score = (score >> halvings) + count.saturating_sub(seen);
            self.next.push((t.id, count, score));
            let may = score > 0 && !t.deleted.is_cancelled() && !t.early_drop_resting(now);
            if may && best.is_none_or(|(s, _)| score > s) {
                best = Some((score, t));
            }
        }
        std::mem::swap(&mut self.seen, &mut self.next);
        let pick = best.map(|(_, t)| t.clone());
        let stands = if pick.is_some() {
            EARLY_DROP_BACKOFF_MS
        } else {
            1
        };
        self.pick = Some((pick.clone(), now.0 + stands));
        pick
    }
}

impl Shared {
    /// One early-drop look (packet mode's `Engine::early_drop`, the UDP
    /// proxy's `udp::take_a_place`): ends one of `tenant`'s entries that
    /// `pick` accepts, among the [`EARLY_DROP_LOOK`] due soonest, so that a
    /// new flow refused at a limit can take its place; tells its owner and
    /// settles it (`Close::EarlyDrop`). `Some(true)`: one ended;
    /// `Some(false)`: none (a look that found nothing rests the tenant's
    /// early drop for [`EARLY_DROP_BACKOFF_MS`]: a tenant full of flows
    /// that got going would otherwise make every refused packet of a flood
    /// cost up to 64 node reads and a filing pass instead of a compare);
    /// `None`: resting, no look made.
    pub(crate) fn take_place(
        &self,
        tenant: &super::Tenant,
        now: Millis,
        seed: u64,
        pick: impl Fn(weir_flowtable::Candidate) -> bool,
    ) -> Option<bool> {
        if tenant.early_drop_resting(now) {
            return None;
        }
        let snap = match self.conns.table.evict_due_first(
            TenantId(tenant.id),
            now,
            EARLY_DROP_LOOK,
            seed,
            pick,
        ) {
            Ok(snap) => snap,
            Err(weir_flowtable::EvictMiss::NotFound) => {
                tenant
                    .early_drop_after
                    .store(now.0 + EARLY_DROP_BACKOFF_MS, Relaxed);
                return Some(false);
            }
            // Another worker's eviction or an expiry pass held a lock:
            // this one is refused, the next looks again.
            Err(weir_flowtable::EvictMiss::Busy) => return Some(false),
        };
        self.ended(std::slice::from_ref(&snap), Close::EarlyDrop);
        Some(true)
    }

    /// Put a new connection or session in the flow table, owned by `owner`
    /// (counted on its backend as active when ESTABLISHED, else inactive).
    /// `virt` is the address the client reached: the service's, or on a
    /// wildcard TCP listener the local one, so that one client port's
    /// connections to two of the host's addresses (two 4-tuples; connect
    /// reuses a source port towards another destination) are two entries,
    /// not one taking the other's over.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn open(
        &self,
        svc: &Arc<Service>,
        backend: &Arc<Backend>,
        proto: Protocol,
        client: SocketAddr,
        virt: SocketAddr,
        state: ConnState,
        owner: &owners::Owner,
    ) -> Result<Conn, Refusal> {
        // Port 0 is no client's (TCP and UDP reserve it), and its key is its
        // client group's persistence template's, `(group, 0)`: its entry
        // would take the template's over (a "stale entry"), and the
        // template's holders would then release the wrong entry. Linux
        // answers a SYN from port 0, so a client with a raw socket gets here.
        if client.port() == 0 {
            return Err(Refusal::ZeroPort);
        }
        let key = FlowKey {
            virt,
            ..flow_key(svc, proto, client)
        };
        let params = svc.params.load_full();
        let init = FlowInit {
            owner: owner.token(),
            profile: params.profile.for_init(),
            service: ServiceId(svc.id),
            backend: BackendId(backend.id),
            state: state.flow(),
        };
        let now = Millis(self.now_ms());
        // The backend's place under its `max_connections`, taken before the
        // entry exists and given back when it is settled (`settle`).
        if !backend.take_place() {
            return Err(Refusal::BackendLimit);
        }
        let inserted = match self.conns.table.insert_handle(key, init, now) {
            Err(weir_flowtable::InsertError::Exists(_)) => {
                // A stale entry for the same 4-tuple (its task is ending):
                // settle it, tell its owner, and take the key over.
                if let Some(old) = self.conns.table.remove(&key) {
                    self.ended(std::slice::from_ref(&old), Close::Replaced);
                }
                self.conns.table.insert_handle(key, init, now)
            }
            r => r,
        };
        let Ok(handle) = inserted else {
            backend.give_place();
            return Err(Refusal::TableFull);
        };
        if state == ConnState::Established {
            backend.active.fetch_add(1, Relaxed);
        } else {
            backend.inactive.fetch_add(1, Relaxed);
        }
        let template = (!params.persistence.is_zero())
            .then(|| self.hold_template(svc, &params, proto, client, backend.id))
            .flatten();
        let conn = Conn {
            handle,
            service: svc.clone(),
            backend: backend.clone(),
            client,
            state: AtomicU8::new(state as u8),
            template,
        };
        // Told to close before it could listen (a kill racing the insert),
        // opened while the daemon was stopping, or for a service deleted
        // (or replaced) meanwhile, whose connections were told before this
        // entry was there (a task accepted before the deletion, or retrying
        // the next backend after a failed connect, has no entry to find):
        // it closes at once. The deletion cancels, then walks the table;
        // this inserted, then reads the cancel: the fence pairs with the
        // one after the cancel (`Shared::take_services`, a replacing put),
        // so that either the walk sees this entry or this sees the cancel.
        let told = owner.bind(handle.cookie.0).err();
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let why = if told.is_some() {
            told
        } else if self.conns.kill_all.is_cancelled() {
            Some(Close::Killed)
        } else if svc.cancel.is_cancelled() {
            Some(Close::ServiceDeleted)
        } else {
            None
        };
        if let Some(why) = why {
            self.conns.owners.kill(owner.token(), handle.cookie.0, why);
        }
        Ok(conn)
    }

    /// Count a new connection or session sent to `backend`: the backend
    /// counts every attempt it gets; the daemon, the tenant and the service
    /// count the client's connection once (`first`: its first attempt, not
    /// a retry on another backend after a failed connect).
    pub(crate) fn count_conn(&self, svc: &Service, backend: &Backend, first: bool) {
        if first {
            self.accounting.stat.conn();
            svc.tenant.stat.conn();
            svc.stat.conn();
        }
        backend.stat.conn();
    }

    /// The task of `conn` is done with it (`reason` for the access log):
    /// remove its entry and settle it, unless the wheel or a tenant's
    /// deletion removed (and settled) it already.
    pub(crate) fn close(&self, conn: &Conn, reason: &str) {
        if let Some(snap) = self.conns.table.remove_handle(conn.handle) {
            self.settle(&snap, &conn.service, Some(&conn.backend), reason);
        }
        if let Some(tpl) = conn.template {
            self.release_template(&conn.service, tpl);
        }
    }

    /// Entries removed by the wheel or a tenant's deletion: settle each
    /// connection and session and tell its owner to close. Returns how many
    /// owners it told.
    pub(crate) fn ended(&self, snaps: &[FlowSnapshot], why: Close) -> u64 {
        self.ended_in(snaps, why, &[])
    }

    /// [`Self::ended`], for entries of the services `gone` too (sorted by
    /// id): services already taken out of the model, such as a deleted
    /// tenant's, whose connections are still told and settled (and whose
    /// packet flows still give back their admission slots and ports).
    pub(crate) fn ended_among(
        &self,
        snaps: &[FlowSnapshot],
        why: Close,
        gone: &[Arc<Service>],
    ) -> u64 {
        debug_assert!(gone.is_sorted_by_key(|s| s.id));
        self.ended_in(snaps, why, gone)
    }

    /// [`Self::ended`], for entries of `gone` too: a service already taken
    /// out of the state whose entries are being ended (its packet flows
    /// still give back their admission slots and ports).
    ///
    /// An entry's service is one look-up in the snapshot's id index
    /// ([`super::model::Services::by_id`]): building a map of all services
    /// per call, as this did, cost 9.4 ms at 100,000 services (against
    /// 1.2 ms for an expiry batch's own work) on every expiry batch, packet
    /// flow kill and stale key a new connection replaces. An entry of a
    /// service no longer in the state (and neither `gone` nor still
    /// retiring, `Model::retiring`) is not settled.
    fn ended_in(&self, snaps: &[FlowSnapshot], why: Close, gone: &[Arc<Service>]) -> u64 {
        // One snapshot for the whole batch, loaded when first needed.
        let mut st: Option<Arc<super::model::State>> = None;
        // Services out of the model whose flows are still being ended
        // (`Model::retiring`), read once when first needed.
        let mut retiring: Option<Vec<Arc<Service>>> = None;
        let mut told = 0;
        for snap in snaps {
            if packet::is_packet_owner(snap.owner) {
                // No task to tell; settled below.
                told += 1;
            } else if snap.owner != 0 && self.conns.owners.kill(snap.owner, snap.cookie.0, why) {
                told += 1;
            }
            if snap.state == FlowState::Persist {
                continue;
            }
            let id = snap.service.0;
            let svc = match gone.binary_search_by_key(&id, |g| g.id) {
                Ok(at) => Some(&gone[at]),
                Err(_) => st
                    .get_or_insert_with(|| arc_swap::Guard::into_inner(self.model.load()))
                    .services
                    .by_id(id),
            };
            let svc = svc.or_else(|| {
                retiring
                    .get_or_insert_with(|| self.model.retiring.lock().clone())
                    .iter()
                    .find(|s| s.id == id)
            });
            if let Some(svc) = svc {
                let backend = svc.backend(snap.backend.0);
                self.settle(snap, svc, backend.as_ref(), why.name());
                if packet::is_packet_owner(snap.owner) {
                    self.settle_packet(snap, svc);
                }
            }
        }
        told
    }

    /// A removed entry's last word: the backend's counts and the access log.
    fn settle(&self, snap: &FlowSnapshot, svc: &Service, b: Option<&Arc<Backend>>, reason: &str) {
        if let Some(b) = b {
            if snap.state == FlowState::Established {
                b.active.fetch_sub(1, Relaxed);
            } else {
                b.inactive.fetch_sub(1, Relaxed);
            }
            b.give_place();
        }
        if self.access_log.load(Relaxed) {
            let now = self.now_ms();
            tracing::info!(
                target: "weir::access",
                tenant = %svc.tenant.spec.read().name,
                service = %svc.spec.read().name,
                proto = match snap.key.proto {
                    Proto::Tcp => "tcp",
                    Proto::Udp => "udp",
                },
                client = %snap.key.client,
                backend = %b.map_or_else(|| "-".to_owned(), |b| b.addr.to_string()),
                bytes_in = snap.bytes_in,
                bytes_out = snap.bytes_out,
                // The entry keeps its start in whole seconds.
                duration_s = now.saturating_sub(snap.created.0) / 1000,
                reason,
                "closed"
            );
        }
    }

    /// Tell the owner of every entry `filter` and `pred` select to close;
    /// returns how many were told. An exact dump of the table (or of one
    /// tenant's), page by page.
    pub(crate) fn kill_where(
        &self,
        why: Close,
        filter: &DumpFilter,
        pred: impl Fn(&FlowSnapshot) -> bool,
    ) -> u64 {
        self.kill_where_in(why, filter, pred, &[])
    }

    fn kill_where_in(
        &self,
        why: Close,
        filter: &DumpFilter,
        pred: impl Fn(&FlowSnapshot) -> bool,
        gone: &[Arc<Service>],
    ) -> u64 {
        let mut n = 0;
        let mut cursor = None;
        let mut page = Vec::new();
        let mut removed = Vec::new();
        loop {
            page.clear();
            removed.clear();
            let more = self
                .conns
                .table
                .dump_page(&mut cursor, filter, 4096, &mut page);
            for snap in &page {
                if snap.owner == 0 || !pred(snap) {
                    continue;
                }
                if packet::is_packet_owner(snap.owner) {
                    // No task to tell: the packet path's flow ends here.
                    removed.extend(self.conns.table.remove_cookie(&snap.key, snap.cookie));
                } else if self.conns.owners.kill(snap.owner, snap.cookie.0, why) {
                    n += 1;
                }
            }
            n += self.ended_in(&removed, why, gone);
            if !more {
                return n;
            }
        }
    }

    /// Ends the connection or packet flow named by `cookie` (its node, one
    /// read: see [`weir_flowtable::Cookie`]): a connection's task is told,
    /// a packet flow's entry is removed and settled here. `false` if no
    /// live connection or flow has that cookie (a persistence template is
    /// not one), or it is not tenant `only`'s.
    pub(crate) fn kill_cookie(&self, cookie: Cookie, only: Option<TenantId>, why: Close) -> bool {
        let table = &self.conns.table;
        let Some(snap) = table.get_cookie(cookie) else {
            return false;
        };
        if snap.owner == 0 || only.is_some_and(|t| t != snap.key.tenant) {
            return false;
        }
        if !packet::is_packet_owner(snap.owner) {
            return self.conns.owners.kill(snap.owner, cookie.0, why);
        }
        match table.remove_handle(FlowTable::handle_of(cookie)) {
            Some(gone) => {
                self.ended(std::slice::from_ref(&gone), why);
                true
            }
            None => false,
        }
    }

    /// [`Self::kill_where`] for one service's entries (all, or those of
    /// the backends `backends` lists).
    pub(crate) fn kill_service(
        &self,
        svc: &Arc<Service>,
        backends: Option<&[u32]>,
        why: Close,
    ) -> u64 {
        let filter = DumpFilter {
            tenant: Some(TenantId(svc.tenant.id)),
            service: Some(ServiceId(svc.id)),
            ..DumpFilter::default()
        };
        self.kill_where_in(
            why,
            &filter,
            |s| backends.is_none_or(|b| b.contains(&s.backend.0)),
            std::slice::from_ref(svc),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// A flow-table entry of `svc` on its first backend from `client`
    /// (no owner), counted on the backend as [`Shared::open`] counts it;
    /// removed at once, as the wheel or a tenant's deletion would.
    fn removed_entry(shared: &Shared, svc: &Service, client: u8, state: ConnState) -> FlowSnapshot {
        let b = svc.set.load().backends[0].clone();
        let key = flow_key(
            svc,
            Protocol::Tcp,
            SocketAddr::from(([10, 0, 0, client], 1000)),
        );
        let init = FlowInit {
            owner: 0,
            profile: weir_flowtable::ProfileRef::NONE,
            service: ServiceId(svc.id),
            backend: BackendId(b.id),
            state: state.flow(),
        };
        shared
            .conns
            .table
            .insert(key, init, Millis(shared.now_ms()))
            .unwrap();
        assert!(b.take_place());
        if state == ConnState::Established {
            b.active.fetch_add(1, Relaxed);
        } else {
            b.inactive.fetch_add(1, Relaxed);
        }
        shared.conns.table.remove(&key).unwrap()
    }

    /// (active, inactive) of `svc`'s first backend.
    fn counts(svc: &Service) -> (u64, u64) {
        let b = svc.set.load().backends[0].clone();
        (b.active.load(Relaxed), b.inactive.load(Relaxed))
    }

    /// [`Shared::ended`] settles each ended entry on its own service's
    /// backend (found through the state's id index), whatever the batch
    /// mixes; an entry of a deleted service, or of the service a replace
    /// swapped out (same name, new id), is settled on none; an entry of the
    /// `gone` service [`Shared::kill_service`] passes is settled on it.
    #[test]
    fn ended_settles_on_the_entrys_own_service_and_on_none_once_deleted() {
        let toml = "[daemon]\nworkers = 1\n\
            [[service]]\nname = \"x\"\nprotocol = \"tcp\"\nlisten = \"127.0.0.1:0\"\n\
            [[service.backend]]\naddress = \"127.0.0.1:9\"\n\
            [[service]]\nname = \"y\"\nprotocol = \"tcp\"\nlisten = \"127.0.0.1:0\"\n\
            [[service.backend]]\naddress = \"127.0.0.1:9\"\n";
        let cfg: Config = toml::from_str(toml).unwrap();
        let d = crate::daemon::Daemon::start(cfg, None).unwrap();
        let shared = d.shared.clone();
        let svc = |name: &str| {
            shared.model.load().services[&("default".to_owned(), name.to_owned())].clone()
        };
        let (x, y) = (svc("x"), svc("y"));

        // One batch, both services: each entry on its own backend.
        let batch = [
            removed_entry(&shared, &x, 1, ConnState::Established),
            removed_entry(&shared, &y, 2, ConnState::SynRecv),
            removed_entry(&shared, &x, 3, ConnState::SynRecv),
        ];
        assert_eq!((counts(&x), counts(&y)), ((1, 1), (0, 1)));
        assert_eq!(shared.ended(&batch, Close::IdleTimeout), 0, "no owners");
        assert_eq!((counts(&x), counts(&y)), ((0, 0), (0, 0)));

        // y deleted: its entries are settled on nothing, x's still are.
        let late = [
            removed_entry(&shared, &y, 4, ConnState::SynRecv),
            removed_entry(&shared, &x, 5, ConnState::SynRecv),
        ];
        d.control().delete_service("default", "y").unwrap();
        shared.ended(&late, Close::IdleTimeout);
        assert_eq!((counts(&x), counts(&y)), ((0, 0), (0, 1)));
        // ... unless it is the `gone` service being ended.
        shared.ended_in(&late[..1], Close::ServiceDeleted, std::slice::from_ref(&y));
        assert_eq!(counts(&y), (0, 0));

        // x replaced (same name, new address: a new service, a new id): the
        // old one's entries are settled on nothing, the new one's on it.
        let old = removed_entry(&shared, &x, 6, ConnState::SynRecv);
        let mut spec = x.spec.read().clone();
        spec.listen = "127.0.0.2:0".parse().unwrap();
        shared.put_service(spec, true).unwrap();
        let x2 = svc("x");
        assert_ne!(x2.id, x.id);
        let new = removed_entry(&shared, &x2, 7, ConnState::Established);
        shared.ended(&[old, new], Close::IdleTimeout);
        assert_eq!((counts(&x), counts(&x2)), ((0, 1), (0, 0)));
        d.shutdown();
    }

    /// A backend's `max_connections` holds however many openers race for
    /// its last place. Each of four threads chooses first (all see the one
    /// place free, as two workers can), then all open: one gets the place,
    /// the others are refused with `BackendLimit` and leave nothing behind
    /// (before, `open` did not look at the limit and all four opened).
    #[test]
    fn openers_racing_for_a_backends_last_place_take_it_once() {
        let toml = "[daemon]\nworkers = 1\n\
            [[service]]\nname = \"x\"\nprotocol = \"tcp\"\nlisten = \"127.0.0.1:0\"\n\
            [[service.backend]]\naddress = \"127.0.0.1:9\"\nmax_connections = 1\n";
        let cfg: Config = toml::from_str(toml).unwrap();
        let d = crate::daemon::Daemon::start(cfg, None).unwrap();
        let shared = d.shared.clone();
        let svc = shared.model.load().services[&("default".to_owned(), "x".to_owned())].clone();
        const N: usize = 4;
        let chosen = std::sync::Barrier::new(N);
        let results: Vec<_> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..N)
                .map(|i| {
                    let (shared, svc, chosen) = (&shared, &svc, &chosen);
                    s.spawn(move || {
                        let client = SocketAddr::from(([10, 0, 0, 1 + i as u8], 1000));
                        let mut rng = weir_sched::SplitMix64::new(i as u64);
                        let b = svc
                            .choose(
                                shared,
                                Protocol::Tcp,
                                client,
                                svc.listen.ip(),
                                &[],
                                &mut rng,
                            )
                            .expect("the place is free when every thread chooses");
                        chosen.wait();
                        let owner = shared.conns.owners.claim().unwrap();
                        let r = shared.open(
                            svc,
                            &b,
                            Protocol::Tcp,
                            client,
                            svc.listen,
                            ConnState::SynRecv,
                            &owner,
                        );
                        (r, owner)
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let opened: Vec<_> = results
            .iter()
            .filter_map(|(r, _)| r.as_ref().ok())
            .collect();
        assert_eq!(opened.len(), 1, "one place, one connection");
        for (r, _) in &results {
            if let Err(why) = r {
                assert_eq!(*why, Refusal::BackendLimit);
            }
        }
        let b = svc.set.load().backends[0].clone();
        assert_eq!((b.conns(), counts(&svc)), (1, (0, 1)));
        let entries = (0..N)
            .filter(|&i| {
                let client = SocketAddr::from(([10, 0, 0, 1 + i as u8], 1000));
                let key = flow_key(&svc, Protocol::Tcp, client);
                shared.conns.table.get(&key).is_some()
            })
            .count();
        assert_eq!(entries, 1, "the refused left no entry");
        shared.close(opened[0], "test");
        assert_eq!((b.conns(), counts(&svc)), (0, (0, 0)));
        // The place is free again.
        assert!(b.take_place());
        b.give_place();
        drop(results);
        d.shutdown();
    }

    /// A backend's `max_connections` edited live applies to the next
    /// connection: `choose` and `take_place` read it from the backend's
    /// copy beside its spec, which the edit sets with the spec.
    #[test]
    fn an_edited_max_connections_applies_to_the_next_connection() {
        let toml = "[daemon]\nworkers = 1\n\
            [[service]]\nname = \"x\"\nprotocol = \"tcp\"\nlisten = \"127.0.0.1:0\"\n\
            [[service.backend]]\naddress = \"127.0.0.1:9\"\nmax_connections = 1\n";
        let cfg: Config = toml::from_str(toml).unwrap();
        let d = crate::daemon::Daemon::start(cfg, None).unwrap();
        let shared = d.shared.clone();
        let svc = shared.model.load().services[&("default".to_owned(), "x".to_owned())].clone();
        let choose = || {
            let client = SocketAddr::from(([10, 0, 0, 1], 1000));
            let mut rng = weir_sched::SplitMix64::new(0);
            svc.choose(
                &shared,
                Protocol::Tcp,
                client,
                svc.listen.ip(),
                &[],
                &mut rng,
            )
        };
        let b = svc.set.load().backends[0].clone();
        assert!(b.take_place());
        assert!(!b.take_place(), "a limit of 1");
        assert_eq!(choose().err(), Some(Refusal::BackendLimit));
        let c = d.control();
        let mut spec = c.running_config().services[0].clone();
        spec.backends[0].max_connections = 2;
        c.edit_service("default", "x", spec).unwrap();
        assert!(Arc::ptr_eq(&b, &svc.set.load().backends[0]), "kept");
        assert!(choose().is_ok(), "a limit of 2 has a place");
        assert!(b.take_place());
        assert!(!b.take_place(), "a limit of 2");
        b.give_place();
        b.give_place();
        d.shutdown();
    }

    /// A client on port 0 is refused (`zero_port`) and the persistence
    /// template, whose key `(group, 0)` its connection would have, stays
    /// as it was, held by the connection that holds it. Linux completes a
    /// handshake from port 0 (a SYN from it gets a SYN-ACK), so a client
    /// with a raw socket reaches here. Before, its entry took the
    /// template's over as a "stale entry", and the template was gone.
    #[test]
    fn a_client_on_port_0_does_not_take_the_template_over() {
        let toml = "[daemon]\nworkers = 1\n\
            [[service]]\nname = \"x\"\nprotocol = \"tcp\"\nlisten = \"127.0.0.1:0\"\n\
            persistence = \"60s\"\n\
            [[service.backend]]\naddress = \"127.0.0.1:9\"\n";
        let cfg: Config = toml::from_str(toml).unwrap();
        let d = crate::daemon::Daemon::start(cfg, None).unwrap();
        let shared = d.shared.clone();
        let svc = shared.model.load().services[&("default".to_owned(), "x".to_owned())].clone();
        let open = |client: SocketAddr| {
            let mut rng = weir_sched::SplitMix64::new(1);
            let b = svc.choose_tcp(&shared, client, &mut rng);
            let owner = shared.conns.owners.claim().unwrap();
            let r = shared.open(
                &svc,
                &b,
                Protocol::Tcp,
                client,
                svc.listen,
                ConnState::SynRecv,
                &owner,
            );
            (r, owner)
        };
        let (first, _o1) = open(SocketAddr::from(([10, 0, 0, 1], 1000)));
        let first = first.unwrap();
        let tpl = first.template.expect("a held template").key;
        let before = shared.conns.table.get(&tpl).unwrap();
        assert_eq!((before.state, before.held), (FlowState::Persist, 1));
        let (zero, _o2) = open(SocketAddr::from(([10, 0, 0, 1], 0)));
        assert_eq!(zero.err(), Some(Refusal::ZeroPort));
        let after = shared.conns.table.get(&tpl).unwrap();
        assert_eq!(
            (after.state, after.held, after.cookie),
            (FlowState::Persist, 1, before.cookie)
        );
        shared.close(&first, "test");
        assert_eq!(shared.conns.table.get(&tpl).map(|t| t.held), Some(0));
        d.shutdown();
    }
}

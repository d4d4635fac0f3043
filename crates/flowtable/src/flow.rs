//! [`FlowTable`]: tenants, the public operations, expiry and dumps.

use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::{
    AtomicBool, AtomicU64, AtomicUsize, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
    Ordering::SeqCst, fence,
};

use crossbeam_epoch::{self as epoch, Guard};
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

use crate::counts::{Counts, TenantCount};
use crate::cursor::Cursor;
use crate::index::{Hash, Index, Put, REPLY_WAY, WAY_IDX};
use crate::node::{Arena, Node, PackedKey, PackedReply, Slab, UNFILED};
use crate::raw::EpochCell;
use crate::table::{
    FreePool, NODE_CACHES, NodeCache, Table, cookie_idx, next_cookie, ref_current, ref_idx,
    thread_slot,
};
use crate::types::*;
use crate::wheel::Wheel;

/// Multiplicative hasher for tenant ids (ids come from the admin, not from
/// the network, so an unkeyed hash is fine here).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = u64::from(v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type IdMap<V> = hashbrown::HashMap<u32, V, BuildHasherDefault<IdHasher>>;

/// Dumps prefetch bucket lines this far ahead, and their nodes half as far.
const PREFETCH_AHEAD: usize = 8;
/// Buckets the maintenance call (`expire`) moves per table per call while a
/// resize runs.
const MAINT_MOVES: usize = 4096;

/// One tenant.
#[derive(Debug)]
struct Tenant {
    id: TenantId,
    table: Arc<Table>,
    placement: Placement,
    salt: u64,
    timeouts: [AtomicU64; 10],
    /// Timeout profiles 1.. (0 is `timeouts` itself); shared with the
    /// [`Profile`] handles, which give theirs back when dropped.
    profiles: Arc<parking_lot::RwLock<Profiles>>,
    removed: AtomicBool,
    /// Entry count, one counter per thread slot ([`crate::counts`]).
    entries: TenantCount,
    refused: AtomicU64,
    wheel: Mutex<Wheel>,
    own_bytes: usize,
    /// Budget reserved for the own table so far (`own_bytes`, then every
    /// growth): what its removal gives back. A shrink keeps it (the table
    /// may grow again), and the table's size when it goes is no measure
    /// of it.
    reserved: AtomicUsize,
}

/// Set in [`Tenant::reserved`] by the tenant's removal, which gave back
/// what it held: nothing more is recorded there after it.
const RESERVED_GONE: usize = 1 << (usize::BITS - 1);

impl Tenant {
    /// This tenant's introspection, given its table's chain statistics.
    fn stats(&self, cs: &crate::table::ChainStats) -> TableStats {
        let slots = cs.buckets * crate::index::WAYS;
        TableStats {
            entries: self.entries(),
            table_entries: cs.entries,
            reply_entries: cs.replies,
            buckets: cs.buckets,
            load_factor: (cs.entries + cs.replies) as f64 / slots as f64,
            chain_histogram: cs.hist.clone(),
            max_chain: cs.max_chain,
            refused_inserts: self.refused.load(Relaxed),
            placement: self.placement,
        }
    }

    #[inline]
    fn timeout(&self, st: FlowState, profile: u16) -> u64 {
        let t = if profile == 0 {
            self.timeouts[st.code() as usize].load(Relaxed)
        } else {
            let p = self.profiles.read();
            match p.resolved.get(usize::from(profile) - 1) {
                Some(r) => r[st.code() as usize],
                // Not a profile of this tenant: its own timeouts.
                None => self.timeouts[st.code() as usize].load(Relaxed),
            }
        };
        t.min(crate::types::MAX_TIMEOUT_MS)
    }

    fn base(&self) -> [u64; 10] {
        self.timeouts.each_ref().map(|a| a.load(Relaxed))
    }
}

/// A tenant's timeout profiles 1.. (profile `n` at index `n - 1`): the
/// overrides, and the timeouts they give over the tenant's (recomputed
/// when those change). A profile is held by its [`Profile`] handles (the
/// services that use it) and named by the entries inserted with it; one
/// neither holds nor names any more is free, and its number is given to
/// new overrides. They were never freed: a tenant that went through
/// [`MAX_PROFILES`] distinct timeouts in its life could set no new one.
///
/// Freeing does not count entries (that would be an atomic on a counter
/// shared by every insert and removal of a service's flows): a profile
/// whose last handle goes only *drains*. When a tenant runs out of
/// numbers, [`FlowTable::timeout_profile`] collects the profiles its live
/// entries name (a walk of its expiry wheel and the filing lists) and
/// frees the draining ones none names. Sound because an entry names a
/// profile only if it was inserted while a handle was held (the type
/// says so: [`FlowInit::profile`] is a [`ProfileRef`], a borrow of a
/// handle): once the last handle went, no insert naming it is under
/// way, so every entry naming it is filed where the walk looks, and an
/// entry inserted after the walk began needed a handle, which revived the
/// profile (`revived` moved: the walk frees nothing revived since it
/// began).
#[derive(Debug, Default)]
struct Profiles {
    overrides: Vec<TimeoutOverrides>,
    resolved: Vec<[u64; 10]>,
    slots: Vec<ProfileSlot>,
    /// Free profile numbers (`slots[n - 1].free`).
    free: Vec<u16>,
    /// When the last walk for the profiles the tenant's entries name
    /// began (the table's clock), and the profiles left draining when it
    /// ended ([`Self::walk_due`], [`Self::walked`]).
    last_walk: Option<(u64, Vec<(u16, u64)>)>,
    /// Walks of the tenant's entries for the profiles they name
    /// ([`FlowTable::profile_walks`]).
    walks: u64,
}

/// How often (in the table's clock) a tenant out of profile numbers may
/// walk its entries again with no profile drained since
/// ([`Profiles::walk_due`]).
const PROFILE_WALK_EVERY_MS: u64 = 1_000;

#[derive(Debug, Default, Clone, Copy)]
struct ProfileSlot {
    /// [`Profile`] handles.
    holds: u32,
    /// Times it was taken up with no handle left (new, or draining).
    revived: u64,
    /// Neither held nor named: its number is for new overrides.
    free: bool,
}

impl Profiles {
    /// Takes a hold on the profile with overrides `o` (made if new, with
    /// the tenant's timeouts `base`), or `None` when every number is
    /// taken (held, or draining: maybe named).
    fn take(&mut self, o: &TimeoutOverrides, base: [u64; 10]) -> Option<u16> {
        let found = self
            .overrides
            .iter()
            .zip(&self.slots)
            .position(|(x, s)| !s.free && x == o);
        let i = match found {
            Some(i) => i,
            None => {
                let i = match self.free.pop() {
                    Some(n) => usize::from(n) - 1,
                    None if self.overrides.len() + 1 < MAX_PROFILES => {
                        self.overrides.push(*o);
                        self.resolved.push([0; 10]);
                        self.slots.push(ProfileSlot::default());
                        self.overrides.len() - 1
                    }
                    None => return None,
                };
                self.overrides[i] = *o;
                self.resolved[i] = o.apply(base);
                self.slots[i].free = false;
                i
            }
        };
        let s = &mut self.slots[i];
        if s.holds == 0 {
            s.revived += 1;
        }
        s.holds += 1;
        Some(i as u16 + 1)
    }

    /// The draining profiles (no handle, maybe named), each with its
    /// `revived`.
    fn draining(&self) -> Vec<(u16, u64)> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.holds == 0 && !s.free)
            .map(|(i, s)| (i as u16 + 1, s.revived))
            .collect()
    }

    /// Whether a tenant out of numbers walks its entries now for the
    /// profiles they name, with `draining` draining at `now` (the table's
    /// clock); if so, the walk is noted as begun. A walk is O(the tenant's
    /// entries) under the maintenance lock (expiry waits), and every
    /// refused request walked, so a caller retrying one held expiry up
    /// again and again. Now a walk comes only if a profile drained (or
    /// was taken up and drained again) since the last one, which it may
    /// free, or a second after it, when entries naming a draining profile
    /// may have gone (expired, or removed).
    fn walk_due(&mut self, draining: &[(u16, u64)], now: u64) -> bool {
        let due = match &self.last_walk {
            None => true,
            Some((at, seen)) => {
                seen.as_slice() != draining || now >= at.saturating_add(PROFILE_WALK_EVERY_MS)
            }
        };
        if due {
            self.last_walk = Some((now, draining.to_vec()));
            self.walks += 1;
        }
        due
    }

    /// A walk ended (its frees done): what drains from now on is new to it.
    fn walked(&mut self) {
        let left = self.draining();
        if let Some((_, seen)) = &mut self.last_walk {
            *seen = left;
        }
    }

    /// Frees the profiles of `draining` that are still draining, were not
    /// revived since, and are not in `named` (a bit per profile number).
    fn free_unnamed(&mut self, draining: &[(u16, u64)], named: &[u64]) {
        for &(n, revived) in draining {
            let s = &mut self.slots[usize::from(n) - 1];
            let bit = (named[usize::from(n) / 64] >> (n % 64)) & 1;
            if s.holds == 0 && !s.free && s.revived == revived && bit == 0 {
                s.free = true;
                self.free.push(n);
            }
        }
    }
}

/// A hold on one of a tenant's timeout profiles
/// ([`FlowTable::timeout_profile`]): entries may be inserted naming its
/// number ([`FlowInit::profile`], from [`for_init`](Self::for_init), which
/// borrows the handle) while it is held (a clone holds it too). Once the last handle is dropped the number stays
/// the profile's while entries inserted with it live, then may be given
/// to other overrides. Profile 0 (no overrides) holds nothing.
pub struct Profile {
    number: u16,
    set: Option<Arc<parking_lot::RwLock<Profiles>>>,
}

impl Profile {
    /// Profile 0: the tenant's timeouts as they are.
    pub const NONE: Profile = Profile {
        number: 0,
        set: None,
    };

    /// Its number.
    pub fn number(&self) -> u16 {
        self.number
    }

    /// What an entry inserted under this profile names
    /// ([`FlowInit::profile`]): it borrows the handle, so the profile is
    /// held until the insert is done.
    pub fn for_init(&self) -> ProfileRef<'_> {
        let set = self.set.as_ref().map_or(0, |s| Arc::as_ptr(s) as usize);
        ProfileRef::held(self.number, set)
    }
}

impl Default for Profile {
    fn default() -> Self {
        Profile::NONE
    }
}

impl Clone for Profile {
    fn clone(&self) -> Self {
        if let Some(set) = &self.set {
            set.write().slots[usize::from(self.number) - 1].holds += 1;
        }
        Profile {
            number: self.number,
            set: self.set.clone(),
        }
    }
}

impl Drop for Profile {
    fn drop(&mut self) {
        if let Some(set) = &self.set {
            let mut p = set.write();
            let s = &mut p.slots[usize::from(self.number) - 1];
            s.holds = s.holds.saturating_sub(1);
        }
    }
}

impl PartialEq for Profile {
    fn eq(&self, other: &Self) -> bool {
        self.number == other.number
            && match (&self.set, &other.set) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            }
    }
}

impl Eq for Profile {}

impl std::fmt::Debug for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Profile").field(&self.number).finish()
    }
}

impl Tenant {
    fn add_entries(&self, d: i64) {
        self.entries.add(d);
        self.table.add_entries(d);
    }

    fn entries(&self) -> u64 {
        self.entries.get()
    }
}

/// The tenant directory, replaced copy-on-write.
#[derive(Clone, Debug, Default)]
struct TenantMap {
    map: IdMap<Arc<Tenant>>,
    /// Tenants with their own table, by id (dump order).
    own: Vec<Arc<Tenant>>,
}

/// State of the maintenance side (expiry and tenant administration).
#[derive(Debug, Default)]
struct Maint {
    /// The due index: `(tick, tenant)` for every tenant whose wheel holds
    /// references or runs a retime pass, `tick` being the one from which
    /// an `expire` call has work in that wheel ([`Wheel::next_visit`]; 0:
    /// at once). `expire` visits only the tenants due, in this order, so a
    /// call costs O(due tenants) and not O(tenants): it visited every
    /// tenant's wheel, 30 ms a call at 100,000 tenants with nothing due.
    due: std::collections::BTreeSet<(u64, u32)>,
    /// Tenant wheels `expire` has visited (introspection).
    visits: u64,
    tables_made: u64,
}

impl Maint {
    /// Puts tenant `id` in the due index under `key` (its wheel `w`,
    /// locked), or takes it out (`None`).
    fn index(&mut self, id: u32, w: &mut Wheel, key: Option<u64>) {
        if w.due_key == key {
            return;
        }
        if let Some(k) = w.due_key {
            self.due.remove(&(k, id));
        }
        if let Some(k) = key {
            self.due.insert((k, id));
        }
        w.due_key = key;
    }

    /// After filing into tenant `t`'s wheel: if stale references outnumber
    /// its entries, the next `expire` call compacts some (a tenant with
    /// long timeouts may have nothing due for a while; its references grow
    /// with every insert meanwhile, which is when this is checked).
    fn filed(&mut self, t: &Tenant, w: &mut Wheel) {
        if wants_compaction(t, w) {
            self.index(t.id.0, w, Some(0));
        }
    }
}

/// Whether stale references (removed entries) outnumber tenant `t`'s live
/// ones in its wheel `w` enough to compact some. (Not while a retime pass
/// runs: it drops them itself.)
fn wants_compaction(t: &Tenant, w: &Wheel) -> bool {
    w.refs() > 4096 && !w.retiming() && w.refs() > 2 * t.entries() as usize + 4096
}

/// Outcome of removing a specific node.
enum Unlink {
    Removed(FlowSnapshot),
    /// Still live but failed the check (e.g. touched since): refile it.
    Kept,
    Gone,
}

/// See [`FlowTable::reader`].
#[derive(Debug)]
pub struct Reader<'a> {
    table: &'a FlowTable,
    guard: Guard,
}

/// Keys a batched lookup hashes and prefetches before probing any.
pub const LOOKUP_BATCH: usize = 32;

/// Wheel references one [`FlowTable::expire`] call examines at most for
/// retime passes (all tenants together): about 25 ms of cache misses at
/// worst, so a 10M-entry tenant is retimed in about 40 calls.
pub const RETIME_REFS: usize = 1 << 18;

impl Reader<'_> {
    /// Like [`FlowTable::lookup`].
    #[inline]
    pub fn lookup(&self, key: &FlowKey) -> Option<(Handle, BackendId)> {
        self.table.lookup_at(&self.guard, key)
    }

    /// Like [`FlowTable::lookup_reply`].
    #[inline]
    pub fn lookup_reply(&self, key: &ReplyKey) -> Option<Found> {
        self.table.lookup_reply_at(&self.guard, key)
    }

    /// Like [`FlowTable::get`].
    #[inline]
    pub fn get(&self, key: &FlowKey) -> Option<FlowSnapshot> {
        self.table.lookup_in(&self.guard, key, |t, n| {
            n.snapshot(self.table.near(), |s, p| t.timeout(s, p))
        })
    }

    /// Like [`FlowTable::touch`].
    #[inline]
    pub fn touch(
        &self,
        key: &FlowKey,
        now: Millis,
        dir: Dir,
        bytes: u64,
    ) -> Option<(Cookie, BackendId)> {
        self.table.lookup_in(&self.guard, key, |_, n| {
            n.touch(now, dir == Dir::Out, bytes)
        })
    }

    /// Like [`FlowTable::touch_handle`], under this reader's pin.
    #[inline]
    pub fn touch_handle(&self, h: Handle, now: Millis, dir: Dir, bytes: u64) -> bool {
        self.table
            .handle_node(h)
            .map(|n| n.touch(now, dir == Dir::Out, bytes))
            .is_some()
    }

    /// Batched lookup: `out[i]` = the handle and backend of `keys[i]`'s
    /// entry, or `None`. Hashes every key and prefetches its bucket line,
    /// then prefetches the candidate nodes, then probes: the cache misses of
    /// a whole batch overlap instead of queueing (the packet path's use).
    /// `out` is cleared first.
    pub fn lookup_batch(&self, keys: &[FlowKey], out: &mut Vec<Option<(Handle, BackendId)>>) {
        out.clear();
        for chunk in keys.chunks(LOOKUP_BATCH) {
            self.lookup_chunk(chunk, out);
        }
    }

    /// Batched lookup of a mix of forward and reply keys (a ring poll's
    /// packets from both sides), hashed and prefetched like
    /// [`lookup_batch`](Self::lookup_batch): `out[i]` is what
    /// [`FlowTable::lookup`] or [`FlowTable::lookup_reply`] finds for
    /// `probes[i]`, with the entry's flow key. `out` is cleared first.
    pub fn lookup_probes(&self, probes: &[Probe], out: &mut Vec<Option<Found>>) {
        out.clear();
        for chunk in probes.chunks(LOOKUP_BATCH) {
            self.probe_chunk(chunk, out);
        }
    }

    fn probe_chunk(&self, probes: &[Probe], out: &mut Vec<Option<Found>>) {
        #[derive(Copy, Clone)]
        enum P {
            None,
            Flow(PackedKey),
            Reply(PackedReply),
        }
        let ft = self.table;
        let map = ft.tenants.load(&self.guard);
        let mut st: [(Option<&Index>, Hash, P); LOOKUP_BATCH] =
            [(None, Hash::new(0), P::None); LOOKUP_BATCH];
        for (p, s) in probes.iter().zip(st.iter_mut()) {
            let tenant = match p {
                Probe::Flow(k) => k.tenant,
                Probe::Reply(r) => r.tenant,
            };
            let Some(t) = map.map.get(&tenant.0) else {
                continue;
            };
            let (h, pk) = match p {
                Probe::Flow(k) => {
                    let pk = PackedKey::new(k);
                    (t.table.hash(&pk, t.salt), P::Flow(pk))
                }
                Probe::Reply(r) => {
                    let pr = PackedReply::new(r);
                    (t.table.hash(&pr.hash_key(), t.salt), P::Reply(pr))
                }
            };
            let ix = t.table.index(&self.guard);
            ix.prefetch(h);
            *s = (Some(ix), h, pk);
        }
        for s in st.iter().take(probes.len()) {
            if let (Some(ix), h, _) = s {
                ix.prefetch_candidates(&ft.slab, *h);
            }
        }
        for s in st.iter().take(probes.len()) {
            let i = match s {
                (Some(ix), h, P::Flow(pk)) => ix.find(&ft.slab, *h, pk),
                (Some(ix), h, P::Reply(pr)) => ix.find(&ft.slab, *h, pr),
                _ => None,
            };
            out.push(i.map(|i| ft.found(i)));
        }
    }

    fn lookup_chunk(&self, keys: &[FlowKey], out: &mut Vec<Option<(Handle, BackendId)>>) {
        let ft = self.table;
        let map = ft.tenants.load(&self.guard);
        let mut st: [(Option<&Index>, Hash, PackedKey); LOOKUP_BATCH] =
            [(None, Hash::new(0), PackedKey::default()); LOOKUP_BATCH];
        for (k, s) in keys.iter().zip(st.iter_mut()) {
            let Some(t) = map.map.get(&k.tenant.0) else {
                continue;
            };
            let pk = PackedKey::new(k);
            let h = t.table.hash(&pk, t.salt);
            let ix = t.table.index(&self.guard);
            ix.prefetch(h);
            *s = (Some(ix), h, pk);
        }
        for s in st.iter().take(keys.len()) {
            if let (Some(ix), h, _) = s {
                ix.prefetch_candidates(&ft.slab, *h);
            }
        }
        for s in st.iter().take(keys.len()) {
            out.push(match s {
                (Some(ix), h, pk) => ix.find(&ft.slab, *h, pk).map(|i| {
                    let n = ft.slab.node(i);
                    (
                        Handle {
                            idx: i,
                            cookie: Cookie(n.cookie()),
                        },
                        n.backend(),
                    )
                }),
                _ => None,
            });
        }
    }
}

/// The connection table. `Send + Sync`; share it with `Arc`.
///
/// See the crate documentation for the design, costs and guarantees.
#[derive(Debug)]
pub struct FlowTable {
    slab: Slab,
    pool: Arc<FreePool>,
    /// Per-thread-slot node caches (never held while a bucket is locked).
    caches: Box<[CachePadded<Mutex<NodeCache>>]>,
    /// The tenants' entry counts ([`crate::counts`]).
    counts: Arc<Counts>,
    shared: Arc<Table>,
    tenants: EpochCell<TenantMap>,
    maint: Mutex<Maint>,
    max_chain: usize,
    memory_budget: usize,
    /// Bytes own tables hold now (bucket lines), for the budget.
    own_bytes: AtomicUsize,
    seed: u64,
    /// The latest `now` an insert or an expiry call passed: what listings
    /// widen entries' 32-bit activity times against (`node::widen`).
    clock: AtomicU64,
    /// Unique per table in this process: tells a thread's dump scratch
    /// ([`DumpScratch`]) which table its remembered hashes belong to.
    id: u64,
    /// Dumps started so far: the next one is numbered `dumps + 1`
    /// ([`Cursor`]'s `dump`).
    dumps: AtomicU64,
    /// Bumped after every change of the tenant directory or of a
    /// tenant's timeouts: a dump page that saw the same count at its
    /// start as when it copied a tenant's timeouts may list that tenant's
    /// entries with the copy, without the directory ([`DumpScratch::timeouts`]).
    tenant_changes: AtomicU64,
    /// Tables introspection has read the buckets of ([`FlowTable::chain_scans`]).
    chain_scans: AtomicU64,
    /// Tenants whose wheel runs a retime pass ([`FlowTable::retiming`]).
    retiming_tenants: AtomicUsize,
    /// Tenants whose own table `maintain` looks at next: written to since
    /// it last did (the table's `queued` flag set on the first write), or
    /// resizing. It looked at every own table on every call: 0.53 ms a
    /// call at 10,000 own tables with nothing to do.
    maint_queue: Mutex<Vec<u32>>,
    /// Own tables `maintain` has looked at (introspection).
    maintained: AtomicU64,
    #[cfg(test)]
    hooks: tests::Hooks,
    /// Ids of removed tenants that operations begun before the removal
    /// may still act on, each with how many removals of it are still to
    /// retire: an add of one waits ([`FlowTable::add_tenants`]). Emptied
    /// by the removals' deferred functions, one epoch grace period after
    /// each.
    retiring: Arc<Mutex<IdMap<u32>>>,
    /// Adds that waited for an earlier tenant of their id to retire (tests).
    #[cfg(test)]
    readds_waited: AtomicUsize,
}

/// Source of [`FlowTable`]'s `id`s (0 is never handed out).
static NEXT_TABLE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl FlowTable {
    /// Notes a caller's `now` (see `clock`).
    #[inline]
    fn saw(&self, now: Millis) {
        if self.clock.load(Relaxed) < now.0 {
            self.clock.fetch_max(now.0, Relaxed);
        }
    }

    /// A time near now, to widen entries' activity times against.
    #[inline]
    pub(crate) fn near(&self) -> u64 {
        self.clock.load(Relaxed)
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Runs deferred frees (this thread's and others' already queued) once no
/// reader can hold them. Each pin-and-flush advances the global epoch at
/// most one step and a bag is freed two steps after it was sealed, hence a
/// few rounds. Bounded: a reader pinned for long only leaves the free to a
/// later collection.
fn reclaim_now() {
    for _ in 0..4 {
        epoch::pin().flush();
    }
}

fn random_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(0x5eed_u64)
}

/// Largest starting size of the shared table, in entries.
const MAX_SHARED: usize = 1 << 28;

impl FlowTable {
    /// A table with no tenants.
    ///
    /// # Panics
    /// If the shared bucket array cannot be allocated (like `Box::new`).
    pub fn new(cfg: TableConfig) -> Self {
        let seed = cfg.seed.unwrap_or_else(random_seed);
        let entries = cfg.shared_buckets.clamp(1, MAX_SHARED);
        let max_chain = cfg.max_chain.clamp(1, 1024);
        let keys = (splitmix(seed), splitmix(seed ^ 0xA5A5_A5A5));
        let cap = match cfg.max_shared_entries {
            0 => MAX_SHARED,
            m => m.min(MAX_SHARED),
        };
        let shared = Table::try_new(0, entries, cap, max_chain, keys)
            .expect("allocating the shared bucket array");
        FlowTable {
            slab: Slab::new(),
            pool: Arc::new(FreePool::default()),
            caches: (0..NODE_CACHES).map(|_| CachePadded::default()).collect(),
            counts: Arc::default(),
            shared: Arc::new(shared),
            tenants: EpochCell::new(TenantMap::default()),
            maint: Mutex::new(Maint::default()),
            retiming_tenants: AtomicUsize::new(0),
            maint_queue: Mutex::new(Vec::new()),
            maintained: AtomicU64::new(0),
            #[cfg(test)]
            hooks: tests::Hooks::default(),
            retiring: Arc::default(),
            #[cfg(test)]
            readds_waited: AtomicUsize::new(0),
            max_chain,
            memory_budget: cfg.memory_budget,
            own_bytes: AtomicUsize::new(0),
            seed,
            clock: AtomicU64::new(0),
            id: NEXT_TABLE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            dumps: AtomicU64::new(0),
            tenant_changes: AtomicU64::new(0),
            chain_scans: AtomicU64::new(0),
        }
    }

    /// The salt that stands for tenant `id` in every hash.
    fn salt(&self, id: u32) -> u64 {
        splitmix(self.seed ^ 0x7E4A_u64 ^ u64::from(id))
    }

    /// The hash in `table` of a way value (for moving it during a resize):
    /// a node's forward key, or with [`REPLY_WAY`] its reply key.
    fn rehash(&self, table: &Table, v: u32) -> u64 {
        let n = self.slab.node(v & WAY_IDX);
        if v & REPLY_WAY != 0 {
            let pk = n.reply_key().hash_key();
            table.hash_raw(&pk, self.salt(pk.tenant))
        } else {
            self.hash_forward(table, &n)
        }
    }

    /// The hash in `table` of node `n`'s forward key.
    #[inline]
    fn hash_forward(&self, table: &Table, n: &Node<'_>) -> u64 {
        let pk = n.key();
        table.hash_raw(&pk, self.salt(pk.tenant))
    }

    /// What a lookup returns about live node `i`.
    #[inline]
    fn found(&self, i: u32) -> Found {
        let n = self.slab.node(i);
        Found {
            handle: Handle {
                idx: i,
                cookie: Cookie(n.cookie()),
            },
            backend: n.backend(),
            key: n.key().unpack(),
        }
    }

    /// Reserves `bytes` more of the own tables' budget for tenant `t`'s
    /// table (given back when `t` goes, or by [`unreserve_for`]). `false`
    /// if over budget, or if `t` is gone: its removal may run at any point
    /// of this (a writer or `maintain` holds `t` from a directory loaded
    /// before it), and gives back what `t.reserved` holds when it does, so
    /// budget taken here after that is given back here.
    ///
    /// [`unreserve_for`]: Self::unreserve_for
    fn reserve_for(&self, t: &Tenant, bytes: usize) -> bool {
        if !self.reserve_own(bytes) {
            return false;
        }
        #[cfg(test)]
        self.hooks.at(tests::Pause::Reserved);
        // One atomic step against the removal's swap of `reserved`: the
        // bytes are recorded before it (and it gives them back) or refused
        // after it (and given back here), never neither.
        let recorded = t
            .reserved
            .fetch_update(Relaxed, Relaxed, |r| {
                (r & RESERVED_GONE == 0).then_some(r + bytes)
            })
            .is_ok();
        if !recorded {
            self.own_bytes.fetch_sub(bytes, Relaxed);
        }
        recorded
    }

    /// Gives back `bytes` that [`reserve_for`](Self::reserve_for) reserved
    /// for `t` and no resize used (one started meanwhile, or the allocation
    /// failed), unless `t`'s removal gave them back already.
    fn unreserve_for(&self, t: &Tenant, bytes: usize) {
        let taken = t
            .reserved
            .fetch_update(Relaxed, Relaxed, |r| {
                (r & RESERVED_GONE == 0).then(|| r - bytes)
            })
            .is_ok();
        if taken {
            self.own_bytes.fetch_sub(bytes, Relaxed);
        }
    }

    /// Reserves `bytes` more of the own tables' budget.
    fn reserve_own(&self, bytes: usize) -> bool {
        self.own_bytes
            .fetch_update(Relaxed, Relaxed, |b| {
                (b + bytes <= self.memory_budget).then_some(b + bytes)
            })
            .is_ok()
    }

    /// Resize work after a write: move a few buckets if a resize runs, else
    /// now and then check whether one should start.
    fn after_write(&self, t: &Tenant, guard: &Guard, check: bool) {
        self.queue_for_maint(t);
        let table = &*t.table;
        if table.resizing(guard) {
            table.help_resize(guard, &self.slab, Table::HELP, &|i| self.rehash(table, i));
        } else if check {
            let own = t.own_bytes != 0;
            // Only an own table's growth is reserved, so only it is given
            // back (the shared table's tenant reserved nothing: giving back
            // there took `reserved` below 0).
            table.maybe_resize(
                guard,
                |more| !own || self.reserve_for(t, more),
                |more| {
                    if own {
                        self.unreserve_for(t, more);
                    }
                },
            );
        }
    }

    /// Puts tenant `t`'s own table on the maintenance queue after a write
    /// (its entry count changed), unless it is there: one load of a flag
    /// that changes at most twice per `maintain` call.
    #[inline]
    fn queue_for_maint(&self, t: &Tenant) {
        // SeqCst against `maintain`'s clearing of the flag and fence: a
        // write that finds the flag still set is seen by the look that
        // clears it. (Missing one would only delay a resize to the next
        // write.)
        if t.own_bytes != 0 && !t.table.queued.load(SeqCst) && !t.table.queued.swap(true, SeqCst) {
            self.maint_queue.lock().push(t.id.0);
        }
    }

    /// Creates a tenant. With `own_buckets == 0` it shares the global table;
    /// otherwise it gets its own table, sized for `own_buckets` entries at
    /// first and growing up to `max_entries` ([`MAX_OWN_BUCKETS`]) entries, unless that would
    /// exceed the memory budget or the allocation fails, in which case it
    /// shares and the returned [`Placement::Shared`] says why.
    ///
    /// Copies the tenant directory (O(tenants)): to add many, use
    /// [`add_tenants`](Self::add_tenants). An id removed before waits for
    /// the operations that began before its removal (see there).
    pub fn add_tenant(&self, id: TenantId, cfg: TenantConfig) -> Result<Placement, TenantError> {
        self.add_tenants(&[(id, cfg)])
            .pop()
            .expect("one result per tenant")
    }

    /// Creates tenants as [`add_tenant`](Self::add_tenant) does, each
    /// exactly as a lone call would (in order: an id already present, or
    /// earlier in the batch, fails with [`TenantError::Exists`]), with one
    /// copy of the tenant directory for the batch: adding T tenants one at
    /// a time is O(T^2), 69 s for 100,000 here. Returns one result per
    /// tenant, in order.
    ///
    /// # Waits
    /// An id removed before is added again once every operation that
    /// began before its removal has ended (an epoch grace period: each
    /// holds its pin for one short call). One of those could still act on
    /// the removed tenant, which an entry's id does not tell from the new
    /// one: a removal by key in the shared table took the new tenant's
    /// entry off the old tenant's count, and an insert being undone put
    /// an entry the new tenant could see and count. So a thread that holds
    /// a [`Reader`] must not add an id it removed: it would wait for
    /// itself.
    pub fn add_tenants(
        &self,
        tenants: &[(TenantId, TenantConfig)],
    ) -> Vec<Result<Placement, TenantError>> {
        let mut m = self.maint.lock();
        // Checked under the maintenance lock, which a removal takes to
        // mark its ids retiring: none can start retiring between the check
        // and the add.
        while self.retiring_among(tenants) {
            parking_lot::MutexGuard::unlocked(&mut m, || self.wait_retired(tenants));
        }
        let guard = epoch::pin();
        let cur = self.tenants.load(&guard);
        let mut next: Option<TenantMap> = None;
        let mut results = Vec::with_capacity(tenants.len());
        for &(id, ref cfg) in tenants {
            let dir = next.as_ref().unwrap_or(cur);
            let r = if dir.map.contains_key(&id.0) {
                Err(TenantError::Exists(id))
            } else {
                self.make_tenant(&mut m, id, cfg).map(|tenant| {
                    let next = next.get_or_insert_with(|| {
                        let mut n = cur.clone();
                        n.map.reserve(tenants.len());
                        n
                    });
                    let placement = tenant.placement;
                    next.map.insert(id.0, Arc::clone(&tenant));
                    if tenant.own_bytes != 0 {
                        next.own.push(tenant); // sorted below
                    }
                    placement
                })
            };
            results.push(r);
        }
        if let Some(mut next) = next {
            // Dump order (by id): the added own tables were appended.
            next.own.sort_by_key(|t| t.id);
            self.tenants.replace(next, &guard);
            self.tenant_changes.fetch_add(1, Release);
        }
        results
    }

    /// Whether an id of `tenants` is retiring (see `retiring`).
    fn retiring_among(&self, tenants: &[(TenantId, TenantConfig)]) -> bool {
        let r = self.retiring.lock();
        !r.is_empty() && tenants.iter().any(|(id, _)| r.contains_key(&id.0))
    }

    /// Until no id of `tenants` is retiring: each round pins and flushes,
    /// which advances the epoch once no thread is pinned from before and
    /// runs the removals' deferred functions. As long as the longest call
    /// that began before the removal.
    fn wait_retired(&self, tenants: &[(TenantId, TenantConfig)]) {
        #[cfg(test)]
        self.readds_waited.fetch_add(1, SeqCst);
        while self.retiring_among(tenants) {
            epoch::pin().flush();
            std::thread::yield_now();
        }
    }

    /// A new tenant (not yet in the directory): its table, own or shared.
    fn make_tenant(
        &self,
        m: &mut Maint,
        id: TenantId,
        cfg: &TenantConfig,
    ) -> Result<Arc<Tenant>, TenantError> {
        let b = cfg.own_buckets;
        if b != 0 && (!b.is_power_of_two() || b > MAX_OWN_BUCKETS) {
            return Err(TenantError::BadSize(b));
        }
        let mut own_bytes = 0;
        let (table, placement) = if b == 0 {
            (
                Arc::clone(&self.shared),
                Placement::Shared {
                    requested: 0,
                    reason: FallbackReason::Requested,
                },
            )
        } else {
            let needed = Table::bytes_for(b);
            let available = self
                .memory_budget
                .saturating_sub(self.own_bytes.load(Relaxed));
            if needed > available || !self.reserve_own(needed) {
                (
                    Arc::clone(&self.shared),
                    Placement::Shared {
                        requested: b,
                        reason: FallbackReason::OverBudget { needed, available },
                    },
                )
            } else {
                m.tables_made += 1;
                let k = splitmix(self.seed ^ splitmix(u64::from(id.0) << 20 ^ m.tables_made));
                let keys = (k, splitmix(k));
                let cap = match cfg.max_entries {
                    0 => MAX_OWN_BUCKETS,
                    m => m.min(MAX_OWN_BUCKETS),
                };
                match Table::try_new(u64::from(id.0) + 1, b, cap, self.max_chain, keys) {
                    Some(t) => {
                        own_bytes = needed;
                        (Arc::new(t), Placement::Own { buckets: b })
                    }
                    None => {
                        self.own_bytes.fetch_sub(needed, Relaxed);
                        (
                            Arc::clone(&self.shared),
                            Placement::Shared {
                                requested: b,
                                reason: FallbackReason::AllocFailed { needed },
                            },
                        )
                    }
                }
            }
        };
        let tenant = Arc::new(Tenant {
            id,
            table,
            placement,
            salt: self.salt(id.0),
            timeouts: cfg.timeouts.to_array().map(AtomicU64::new),
            profiles: Arc::default(),
            removed: AtomicBool::new(false),
            entries: self.counts.take(),
            refused: AtomicU64::new(0),
            wheel: Mutex::new(Wheel::new()),
            own_bytes,
            reserved: AtomicUsize::new(own_bytes),
        });
        Ok(tenant)
    }

    /// Removes a tenant and all its entries (appended to `out`). Cost
    /// O(its entries + wheel slots + entries inserted by anyone since the
    /// last [`expire`](Self::expire)) — never a walk of the shared table —
    /// plus a copy of the tenant directory: to remove many, use
    /// [`remove_tenants`](Self::remove_tenants). Concurrent inserts for the
    /// tenant fail with `NoTenant`.
    pub fn remove_tenant(
        &self,
        id: TenantId,
        out: &mut Vec<FlowSnapshot>,
    ) -> Result<(), TenantError> {
        self.remove_tenants(&[id], out)
            .pop()
            .expect("one result per tenant")
            .map(|_| ())
    }

    /// Removes tenants as [`remove_tenant`](Self::remove_tenant) does, each
    /// exactly as a lone call would (in order: an id not present, or
    /// earlier in the batch, fails with [`TenantError::NoTenant`]), with one
    /// copy of the tenant directory and one pass over the filing lists for
    /// the batch: removing T of many tenants one at a time is O(T x
    /// tenants). Appends each tenant's entries to `out` in turn and returns,
    /// per tenant in order, how many it appended.
    pub fn remove_tenants(
        &self,
        ids: &[TenantId],
        out: &mut Vec<FlowSnapshot>,
    ) -> Vec<Result<usize, TenantError>> {
        let mut m = self.maint.lock();
        let guard = epoch::pin();
        let cur = self.tenants.load(&guard);
        let mut next: Option<TenantMap> = None;
        let mut gone: Vec<Option<Arc<Tenant>>> = Vec::with_capacity(ids.len());
        for &id in ids {
            let dir = next.as_mut();
            let t = match dir {
                Some(n) => n.map.remove(&id.0),
                None => cur.map.get(&id.0).map(|t| {
                    let mut n = cur.clone();
                    n.map.remove(&id.0);
                    next = Some(n);
                    Arc::clone(t)
                }),
            };
            gone.push(t);
        }
        let Some(mut next) = next else {
            return ids
                .iter()
                .map(|&id| Err(TenantError::NoTenant(id)))
                .collect();
        };
        let removed: IdMap<usize> = gone
            .iter()
            .enumerate()
            .filter_map(|(k, t)| Some((t.as_ref()?.id.0, k)))
            .collect();
        next.own.retain(|o| !removed.contains_key(&o.id.0));
        self.tenants.replace(next, &guard);
        self.tenant_changes.fetch_add(1, Release);
        // Operations that loaded the old directory may act on the removed
        // tenants until their pins go: their ids retire one grace period
        // from now (an add of one waits until then, see `add_tenants`).
        {
            let mut r = self.retiring.lock();
            for id in removed.keys() {
                *r.entry(*id).or_default() += 1;
            }
        }
        let retiring = Arc::clone(&self.retiring);
        let retired: Vec<u32> = removed.keys().copied().collect();
        guard.defer(move || {
            let mut r = retiring.lock();
            for id in retired {
                if let Some(n) = r.get_mut(&id) {
                    *n -= 1;
                    if *n == 0 {
                        r.remove(&id);
                    }
                }
            }
        });
        for t in gone.iter().flatten() {
            t.removed.store(true, SeqCst);
        }
        fence(SeqCst);
        // Every insert pushes its node to a filing list, then (after a
        // SeqCst fence) checks `removed` and undoes itself if set: so each
        // insert for these tenants either sees `removed` or is in a list
        // here.
        let mut refs: Vec<Vec<u32>> = vec![Vec::new(); ids.len()];
        for c in self.caches.iter() {
            let mut c = c.lock();
            c.new_nodes.retain(|&r| {
                let i = ref_idx(r);
                match removed.get(&self.slab.node(i).tenant()) {
                    Some(&k) => {
                        refs[k].push(i);
                        false
                    }
                    None => true,
                }
            });
        }
        let mut results = Vec::with_capacity(ids.len());
        for ((t, mut refs), &id) in gone.iter().zip(refs).zip(ids) {
            let Some(t) = t else {
                results.push(Err(TenantError::NoTenant(id)));
                continue;
            };
            {
                let mut w = t.wheel.lock();
                m.index(id.0, &mut w, None);
                if w.retiming() {
                    self.retiming_tenants.fetch_sub(1, Relaxed);
                }
                refs.extend(w.drain_all());
            }
            let before = out.len();
            for idx in refs {
                if let Unlink::Removed(s) = self.unlink_node(t, idx, &guard, |_, _| true) {
                    out.push(s);
                }
            }
            if t.own_bytes != 0 {
                // What was reserved, not what the table holds now: a table
                // that grew and shrank back held less than it reserved
                // (the difference was lost to the budget for good), and
                // overflow lines were never reserved. Marked gone in the
                // same step, so that a reservation racing this one gives
                // its bytes back itself (see `reserve_for`).
                let r = t.reserved.swap(RESERVED_GONE, Relaxed);
                debug_assert!(r & RESERVED_GONE == 0, "a tenant removed twice");
                self.own_bytes.fetch_sub(r, Relaxed);
            }
            results.push(Ok(out.len() - before));
        }
        drop(m);
        drop(guard);
        // The old directory holds the last references to the tenants (and
        // their own tables, megabytes to gigabytes): free them now rather
        // than when this thread's bag of deferred frees happens to fill up.
        drop(gone);
        reclaim_now();
        results
    }

    /// Replaces a tenant's timeouts (and so those of its profiles, except
    /// where they override a state). A longer timeout applies at once. A
    /// shorter one starts a retime pass over the tenant's expiry wheel,
    /// which [`expire`](Self::expire) carries out [`RETIME_REFS`] wheel
    /// references per call at most: every filed entry whose deadline under
    /// the new timeouts comes before its wheel slot is refiled earlier. An
    /// entry then expires at its new deadline or, if that passed before the
    /// pass reached it, by the end of the pass, plus one tick and the
    /// caller's period; never early. The pass walks the slots in deadline
    /// order from the current tick, so refiled entries land behind it and
    /// it ends within `ceil(wheel references / RETIME_REFS) + 1` `expire`
    /// calls. Another shortening during a pass extends it to a full lap
    /// from where it is; entries it moved ahead of its cursor are then
    /// looked at twice, so it ends within `ceil(2 * wheel references /
    /// RETIME_REFS) + 1` calls after the last shortening.
    pub fn set_timeouts(&self, id: TenantId, t: Timeouts) -> Result<(), TenantError> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let ten = map.map.get(&id.0).ok_or(TenantError::NoTenant(id))?;
        let new = t.to_array();
        let mut p = ten.profiles.write();
        let shorter = ten.base().iter().zip(new).any(|(&old, new)| new < old);
        for (a, v) in ten.timeouts.iter().zip(new) {
            a.store(v, Relaxed);
        }
        self.tenant_changes.fetch_add(1, Release);
        let Profiles {
            overrides,
            resolved,
            ..
        } = &mut *p;
        for (o, r) in overrides.iter().zip(resolved.iter_mut()) {
            *r = o.apply(new);
        }
        // `expire` takes the wheel lock before the profiles': drop ours
        // first. The pass reads the timeouts stored above.
        drop(p);
        if shorter {
            let mut m = self.maint.lock();
            let mut w = ten.wheel.lock();
            if !ten.removed.load(SeqCst) && w.start_retime() {
                self.retiming_tenants.fetch_add(1, Relaxed);
                m.index(id.0, &mut w, Some(0));
            }
        }
        Ok(())
    }

    /// Whether any tenant's wheel has a retime pass under way (a timeout
    /// was shortened): each [`expire`](Self::expire) call advances it by at
    /// most [`RETIME_REFS`] references, so a caller with time to spare may
    /// call again.
    pub fn retiming(&self) -> bool {
        self.retiming_tenants.load(Relaxed) > 0
    }

    /// Whether tenant `id`'s wheel has a retime pass under way, and the
    /// wheel references its last step examined (at most [`RETIME_REFS`]).
    #[doc(hidden)]
    pub fn retime_state(&self, id: TenantId) -> Option<(bool, usize)> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let w = map.map.get(&id.0)?.wheel.lock();
        Some((w.retiming(), w.retime_last()))
    }

    /// A hold on the timeout profile with these overrides for tenant `id`,
    /// made if new ([`Profile::NONE`] for no overrides). Entries inserted
    /// while it is held name it in [`FlowInit::profile`] (and
    /// only then: a number no handle holds may be given to other
    /// overrides once no entry names it); a profile's timeouts follow the
    /// tenant's ([`set_timeouts`](Self::set_timeouts)) except where
    /// overridden. A tenant has at most [`MAX_PROFILES`] (0 included)
    /// held or named at once: past that, [`TenantError::TooManyProfiles`].
    ///
    /// When every number is taken, and some only by entries, this walks
    /// the tenant's expiry wheel and the filing lists (O(its entries),
    /// under the maintenance lock, so an `expire` call waits) to free the
    /// profiles no live entry names; only then is the call refused. Calls
    /// refused in a row do not each walk: the next walk comes once a
    /// profile drained (its last handle went) since the last one, or a
    /// second of the table's clock after it.
    pub fn timeout_profile(
        &self,
        id: TenantId,
        o: &TimeoutOverrides,
    ) -> Result<Profile, TenantError> {
        if o.is_empty() {
            return Ok(Profile::NONE);
        }
        let ten = {
            let guard = epoch::pin();
            let map = self.tenants.load(&guard);
            Arc::clone(map.map.get(&id.0).ok_or(TenantError::NoTenant(id))?)
        };
        let held = |number| Profile {
            number,
            set: Some(Arc::clone(&ten.profiles)),
        };
        let draining = {
            let mut p = ten.profiles.write();
            if let Some(n) = p.take(o, ten.base()) {
                return Ok(held(n));
            }
            let draining = p.draining();
            if draining.is_empty() || !p.walk_due(&draining, self.near()) {
                return Err(TenantError::TooManyProfiles(id));
            }
            draining
        };
        // Not under the profiles' lock: `expire` takes the wheel lock
        // before it. `draining` was read first: an entry the walk misses
        // was inserted under a handle taken after, which revived its
        // profile.
        let named = self.named_profiles(&ten);
        let mut p = ten.profiles.write();
        p.free_unnamed(&draining, &named);
        p.walked();
        p.take(o, ten.base())
            .map(held)
            .ok_or(TenantError::TooManyProfiles(id))
    }

    /// The profiles tenant `t`'s live entries name (a bit per number): its
    /// wheel's references and the filing lists' (every live entry is in
    /// one of them once its insert returned; the maintenance lock keeps
    /// `expire` from moving them between the two meanwhile).
    fn named_profiles(&self, t: &Tenant) -> Vec<u64> {
        let mut named = vec![0u64; MAX_PROFILES / 64];
        let mut mark = |idx: u32| {
            let n = self.slab.node(idx);
            if n.is_live() && n.tenant() == t.id.0 {
                let p = usize::from(n.profile());
                named[p / 64] |= 1u64 << (p % 64);
            }
        };
        let _m = self.maint.lock();
        for c in self.caches.iter() {
            for &r in &c.lock().new_nodes {
                mark(ref_idx(r));
            }
        }
        t.wheel.lock().for_each_ref(|_, idx| mark(idx));
        named
    }

    /// How many times [`timeout_profile`](Self::timeout_profile) walked
    /// tenant `id`'s entries for the profiles they name (introspection).
    #[doc(hidden)]
    pub fn profile_walks(&self, id: TenantId) -> Option<u64> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        Some(map.map.get(&id.0)?.profiles.read().walks)
    }

    /// The timeouts entries of profile `profile` of tenant `id` get.
    pub fn profile_timeouts(&self, id: TenantId, profile: u16) -> Option<Timeouts> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let ten = map.map.get(&id.0)?;
        Some(Timeouts::from_array(
            FlowState::ALL.map(|s| ten.timeout(s, profile)),
        ))
    }

    /// A tenant's timeouts.
    pub fn timeouts(&self, id: TenantId) -> Option<Timeouts> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let ten = map.map.get(&id.0)?;
        Some(Timeouts::from_array(
            ten.timeouts.each_ref().map(|a| a.load(Relaxed)),
        ))
    }

    /// Inserts a new entry and returns its cookie. See
    /// [`insert_handle`](Self::insert_handle).
    pub fn insert(&self, key: FlowKey, init: FlowInit, now: Millis) -> Result<Cookie, InsertError> {
        self.insert_handle(key, init, now).map(|h| h.cookie)
    }

    /// Inserts a new entry (locks one bucket) and returns a [`Handle`]
    /// through which the caller reaches it again without hashing. Refused
    /// if the key exists, the tenant does not, the key's bucket chain
    /// already holds `max_chain` entries, or the table holds its cap of
    /// entries (`max_entries` / `max_shared_entries`).
    pub fn insert_handle(
        &self,
        key: FlowKey,
        init: FlowInit,
        now: Millis,
    ) -> Result<Handle, InsertError> {
        self.insert_inner(key, init, None, false, now)
    }

    /// [`insert_handle`](Self::insert_handle) for a packet-mode nat or fnat
    /// flow: the entry is also indexed by its reply key, so that
    /// [`lookup_reply`](Self::lookup_reply) finds it from a backend's reply
    /// ([`ReplyKey`]: tenant, protocol, backend and, for
    /// [`ReplyMode::Nat`], the key's client or, for
    /// [`ReplyMode::FullNat`], the NAT slot, which is stored as the
    /// entry's [`nat`](Self::nat) and fixed for its life). Still one entry
    /// (one node, one cookie, one expiry, listed once by dumps) with two
    /// index entries; every removal (by key, handle or cookie, expiry,
    /// tenant removal) takes both out, and resizes move both.
    ///
    /// All or nothing: lookups by either key find the entry only once both
    /// index entries are in; if the reply key's chain is full
    /// ([`InsertError::ChainFull`]) or another entry has the same reply key
    /// ([`InsertError::ReplyExists`]), nothing is left behind. Locks the
    /// two home buckets one after the other, never both at once.
    pub fn insert_reply(
        &self,
        key: FlowKey,
        init: FlowInit,
        reply: ReplyMode,
        now: Millis,
    ) -> Result<Handle, InsertError> {
        self.insert_inner(key, init, Some(reply), false, now)
    }

    /// Inserts a persistence template already held once (see
    /// [`hold`](Self::hold)): the entry is published with its count at 1,
    /// so no expiry can ever see it unheld before the caller's connection
    /// is counted. The state is [`FlowState::Persist`] whatever
    /// `init.state` says. On [`InsertError::Exists`] another thread stored
    /// the template first: [`hold`](Self::hold) that one instead.
    pub fn insert_held(
        &self,
        key: FlowKey,
        init: FlowInit,
        now: Millis,
    ) -> Result<Handle, InsertError> {
        let init = FlowInit {
            state: FlowState::Persist,
            ..init
        };
        self.insert_inner(key, init, None, true, now)
    }

    /// One more connection holds the persistence template `key` (IPVS's
    /// `n_control`): while any does, expiry never removes the template
    /// (it is refiled a timeout later instead). Returns the template's
    /// backend, or `None` (nothing held) if there is no live entry for
    /// `key` in state [`FlowState::Persist`]. Locks the key's bucket, as
    /// expiry's final check does, so a hold either counts before expiry
    /// looks (which then keeps the template) or finds it gone, never both.
    /// Explicit removals (`remove*`, [`remove_tenant`](Self::remove_tenant))
    /// take a template whatever its count; the removal's snapshot shows
    /// the count ([`FlowSnapshot::held`]).
    pub fn hold(&self, key: &FlowKey) -> Option<BackendId> {
        self.with_locked(key, |n| n.hold_locked().then(|| n.backend()))
    }

    /// Like [`hold`](Self::hold), but only a template stored for
    /// `service`: another service's under the same key (one that had the
    /// same address before) is left alone, as if there were none.
    pub fn hold_for(&self, key: &FlowKey, service: ServiceId) -> Option<BackendId> {
        self.with_locked(key, |n| {
            (n.service() == service && n.hold_locked()).then(|| n.backend())
        })
    }

    /// Like [`hold_for`](Self::hold_for), and the cookie of the template
    /// held, for [`release_cookie`](Self::release_cookie): the template
    /// may be removed and another stored under the same key (of the same
    /// service) before the hold is given back, and that one's holds are
    /// not this one's.
    pub fn hold_for_cookie(
        &self,
        key: &FlowKey,
        service: ServiceId,
    ) -> Option<(BackendId, Cookie)> {
        self.with_locked(key, |n| {
            (n.service() == service && n.hold_locked()).then(|| (n.backend(), Cookie(n.cookie())))
        })
    }

    /// Like [`release`](Self::release), but only the template `cookie`
    /// names (see [`hold_for_cookie`](Self::hold_for_cookie)): a newer
    /// template under the same key keeps its holds.
    pub fn release_cookie(&self, key: &FlowKey, cookie: Cookie, now: Millis) -> Option<u32> {
        self.saw(now);
        self.with_locked(key, |n| {
            if n.cookie() == cookie.0 {
                n.release_locked(now)
            } else {
                None
            }
        })
        .map(|left| u32::try_from(left).unwrap_or(u32::MAX))
    }

    /// One connection holding the persistence template `key` ended: the
    /// count drops by one, and at 0 the template's timeout starts from
    /// `now` (`last_active = max(last_active, now)`). Returns the holds
    /// left, or `None` (nothing changed) if `key` has no live template or
    /// it is not held. Locks the key's bucket.
    pub fn release(&self, key: &FlowKey, now: Millis) -> Option<u32> {
        self.saw(now);
        self.with_locked(key, |n| n.release_locked(now))
            .map(|left| u32::try_from(left).unwrap_or(u32::MAX))
    }

    /// Like [`release`](Self::release), but only a template stored for
    /// `service` (see [`hold_for`](Self::hold_for)): the hold a connection
    /// gives back is on its own service's template, and its template may
    /// have been removed since and another service's stored under the
    /// same key, whose holds are not this connection's to give back.
    pub fn release_for(&self, key: &FlowKey, service: ServiceId, now: Millis) -> Option<u32> {
        self.saw(now);
        self.with_locked(key, |n| {
            if n.service() == service {
                n.release_locked(now)
            } else {
                None
            }
        })
        .map(|left| u32::try_from(left).unwrap_or(u32::MAX))
    }

    /// Points the persistence template `key` at `backend` (a new choice for
    /// its client group: the old backend is gone, down or full), keeping
    /// its holds, and restarts its timeout from `now`. `false` (nothing
    /// changed) if `key` has no live template, or its entry was inserted
    /// with [`insert_reply`](Self::insert_reply) (its reply key names the
    /// backend, so the backend is fixed there). Locks the key's bucket, so
    /// a concurrent [`hold`](Self::hold) sees the old backend or the new
    /// one, never a mix, and no hold or release is lost to the change (a
    /// remove and insert would drop the count).
    pub fn rebind(&self, key: &FlowKey, backend: BackendId, now: Millis) -> bool {
        self.saw(now);
        self.with_locked(key, |n| n.rebind_locked(backend, now).then_some(()))
            .is_some()
    }

    /// Like [`rebind`](Self::rebind), but only a template stored for
    /// `service` (see [`hold_for`](Self::hold_for)).
    pub fn rebind_for(
        &self,
        key: &FlowKey,
        service: ServiceId,
        backend: BackendId,
        now: Millis,
    ) -> bool {
        self.saw(now);
        self.with_locked(key, |n| {
            (n.service() == service && n.rebind_locked(backend, now)).then_some(())
        })
        .is_some()
    }

    /// Runs `f` on `key`'s node under its bucket lock (live or pending:
    /// `f` checks).
    fn with_locked<R>(&self, key: &FlowKey, f: impl FnOnce(Node<'_>) -> Option<R>) -> Option<R> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let t = map.map.get(&key.tenant.0)?;
        let pk = PackedKey::new(key);
        let h = t.table.hash(&pk, t.salt);
        let ix = t.table.index(&guard);
        let (home, l) = ix.lock_home(h);
        let i = home.find_locked(&l, &self.slab, h, &pk)?;
        f(self.slab.node(i))
    }

    fn insert_inner(
        &self,
        key: FlowKey,
        init: FlowInit,
        reply: Option<ReplyMode>,
        held: bool,
        now: Millis,
    ) -> Result<Handle, InsertError> {
        self.saw(now);
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let t = map.map.get(&key.tenant.0).ok_or(InsertError::NoTenant)?;
        if t.removed.load(Relaxed) {
            return Err(InsertError::NoTenant);
        }
        if t.table.at_cap(&guard) {
            t.refused.fetch_add(1, Relaxed);
            return Err(InsertError::ChainFull);
        }
        let pk = PackedKey::new(&key);
        let h = t.table.hash(&pk, t.salt);
        let (idx, cookie) = {
            let mut c = self.node_cache();
            let Some(idx) = c.alloc(&self.slab, &self.pool) else {
                t.refused.fetch_add(1, Relaxed);
                return Err(InsertError::ChainFull);
            };
            // The node is ours until it is published: its last cookie
            // (kept when it was freed) gives the next one.
            (idx, next_cookie(self.slab.node(idx).cookie(), idx))
        };
        let nat = match reply {
            Some(ReplyMode::FullNat(n)) => n.get(),
            _ => 0,
        };
        // Another tenant's profile (or one of a removed tenant that had
        // this id) names nothing here: the tenant's own timeouts.
        let init = FlowInit {
            profile: init.profile.for_set(Arc::as_ptr(&t.profiles) as usize),
            ..init
        };
        // With a reply key the node starts pending (not live) until both
        // its index entries are in.
        self.slab
            .node(idx)
            .init(&pk, &init, cookie, now, nat, reply.is_some());
        if held {
            // Before the node is published.
            self.slab.node(idx).init_held(1);
        }
        let r = {
            let ix = t.table.index(&guard);
            let (home, mut l) = ix.lock_home(h);
            home.put(&mut l, &self.slab, h, Some(&pk), idx, self.max_chain)
        };
        let mut crowded = match r {
            Put::Done(overflow) => overflow,
            Put::Exists(i) => {
                self.slab.node(idx).clear_live();
                self.node_cache().unalloc(idx);
                return Err(InsertError::Exists(Cookie(self.slab.node(i).cookie())));
            }
            Put::Full => {
                self.slab.node(idx).clear_live();
                self.node_cache().unalloc(idx);
                t.refused.fetch_add(1, Relaxed);
                return Err(InsertError::ChainFull);
            }
        };
        if reply.is_some() {
            let n = self.slab.node(idx);
            let rk = n.reply_key();
            let rh = t.table.hash(&rk.hash_key(), t.salt);
            let ix = t.table.index(&guard);
            match ix.publish_reply(&self.slab, rh, &rk, idx, self.max_chain) {
                Put::Done(overflow) => {
                    crowded |= overflow;
                    t.table.add_replies(1);
                }
                r => {
                    // Take the forward entry out again. The node was never
                    // live, so no lookup returned it, but a reader may hold
                    // its index: recycle it after a grace period.
                    let out = ix.unpublish(h, idx);
                    debug_assert!(out, "a pending forward entry vanished");
                    self.node_cache().retire(idx, &guard, &self.pool);
                    return Err(match r {
                        Put::Exists(i) => {
                            InsertError::ReplyExists(Cookie(self.slab.node(i).cookie()))
                        }
                        _ => {
                            t.refused.fetch_add(1, Relaxed);
                            InsertError::ChainFull
                        }
                    });
                }
            }
        }
        t.add_entries(1);
        self.node_cache().push_new(idx, cookie, &self.slab);
        fence(SeqCst);
        if t.removed.load(Relaxed) {
            // Lost the race with remove_tenant, which may not have seen our
            // filing reference: undo.
            self.unlink_node(t, idx, &guard, |n, _| n.cookie() == cookie);
            return Err(InsertError::NoTenant);
        }
        // An entry that had to go to an overflow line says the bucket is
        // crowded: time to check whether the table should grow.
        self.after_write(t, &guard, crowded);
        Ok(Handle {
            idx,
            cookie: Cookie(cookie),
        })
    }

    /// This thread's node cache.
    #[inline]
    fn node_cache(&self) -> parking_lot::MutexGuard<'_, NodeCache> {
        self.caches[thread_slot()].lock()
    }

    #[inline]
    fn lookup_with<R>(&self, key: &FlowKey, f: impl FnOnce(&Tenant, Node<'_>) -> R) -> Option<R> {
        self.lookup_in(&epoch::pin(), key, f)
    }

    #[inline]
    fn lookup_in<R>(
        &self,
        guard: &Guard,
        key: &FlowKey,
        f: impl FnOnce(&Tenant, Node<'_>) -> R,
    ) -> Option<R> {
        let map = self.tenants.load(guard);
        let t = map.map.get(&key.tenant.0)?;
        let pk = PackedKey::new(key);
        let h = t.table.hash(&pk, t.salt);
        let i = t.table.index(guard).find(&self.slab, h, &pk)?;
        Some(f(t, self.slab.node(i)))
    }

    /// The live node a handle names (the caller holds a pin).
    #[inline]
    fn handle_node(&self, h: Handle) -> Option<Node<'_>> {
        let n = self.slab.node_checked(h.idx)?;
        n.is_entry(h.cookie.0).then_some(n)
    }

    /// The handle of the entry named by `cookie` (a cookie names its node:
    /// see [`Cookie`]). Like any handle it may be stale: the reads and
    /// removals that take it check the node's cookie and live bit, so an
    /// entry that ended, or a cookie that never was, finds nothing.
    pub fn handle_of(cookie: Cookie) -> Handle {
        Handle {
            idx: cookie_idx(cookie.0),
            cookie,
        }
    }

    /// The entry named by `cookie`, if it is live: one node read, no
    /// search ([`get_handle`](Self::get_handle) of
    /// [`handle_of`](Self::handle_of)).
    pub fn get_cookie(&self, cookie: Cookie) -> Option<FlowSnapshot> {
        self.get_handle(Self::handle_of(cookie))
    }

    /// Lock-free lookup; writes nothing shared.
    pub fn get(&self, key: &FlowKey) -> Option<FlowSnapshot> {
        self.lookup_with(key, |t, n| n.snapshot(self.near(), |s, p| t.timeout(s, p)))
    }

    /// The handle of `key`'s entry, if present.
    pub fn handle(&self, key: &FlowKey) -> Option<Handle> {
        self.lookup(key).map(|(h, _)| h)
    }

    /// The data path's read: `key`'s entry (as a handle, for later calls
    /// without hashing) and its backend; reads one cache line of the entry
    /// and writes nothing shared.
    #[inline]
    pub fn lookup(&self, key: &FlowKey) -> Option<(Handle, BackendId)> {
        self.lookup_at(&epoch::pin(), key)
    }

    #[inline]
    fn lookup_at(&self, guard: &Guard, key: &FlowKey) -> Option<(Handle, BackendId)> {
        let map = self.tenants.load(guard);
        let t = map.map.get(&key.tenant.0)?;
        let pk = PackedKey::new(key);
        let h = t.table.hash(&pk, t.salt);
        let idx = t.table.index(guard).find(&self.slab, h, &pk)?;
        let n = self.slab.node(idx);
        Some((
            Handle {
                idx,
                cookie: Cookie(n.cookie()),
            },
            n.backend(),
        ))
    }

    /// The data path's read of a backend's reply (packet mode's nat and
    /// fnat): the entry inserted with [`insert_reply`](Self::insert_reply)
    /// whose reply key is `key`, with its handle (touch it with
    /// [`Dir::Out`]), backend and flow key (the client and virtual address
    /// to rewrite the reply back to). Lock-free; reads the bucket line and
    /// the entry's first cache line, as [`lookup`](Self::lookup). Entries
    /// inserted without a reply key, and forward keys that happen to look
    /// alike, are never found this way.
    #[inline]
    pub fn lookup_reply(&self, key: &ReplyKey) -> Option<Found> {
        self.lookup_reply_at(&epoch::pin(), key)
    }

    #[inline]
    fn lookup_reply_at(&self, guard: &Guard, key: &ReplyKey) -> Option<Found> {
        let map = self.tenants.load(guard);
        let t = map.map.get(&key.tenant.0)?;
        let pr = PackedReply::new(key);
        let h = t.table.hash(&pr.hash_key(), t.salt);
        let idx = t.table.index(guard).find(&self.slab, h, &pr)?;
        Some(self.found(idx))
    }

    /// Snapshot of the entry a handle names, if it is still there.
    pub fn get_handle(&self, h: Handle) -> Option<FlowSnapshot> {
        let guard = epoch::pin();
        let n = self.handle_node(h)?;
        let map = self.tenants.load(&guard);
        let t = map.map.get(&n.tenant())?;
        n.snapshot_of(h.cookie.0, self.near(), |s, p| t.timeout(s, p))
    }

    /// [`touch`](Self::touch) that also says where the entry is and who
    /// owns it: the UDP proxy's one lookup per datagram finds its session
    /// through the owner token.
    #[inline]
    pub fn touch_hit(&self, key: &FlowKey, now: Millis, dir: Dir, bytes: u64) -> Option<Hit> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let t = map.map.get(&key.tenant.0)?;
        let pk = PackedKey::new(key);
        let h = t.table.hash(&pk, t.salt);
        let idx = t.table.index(&guard).find(&self.slab, h, &pk)?;
        let n = self.slab.node(idx);
        let (cookie, backend) = n.touch(now, dir == Dir::Out, bytes);
        Some(Hit {
            handle: Handle { idx, cookie },
            backend,
            owner: n.owner(),
        })
    }

    /// Lock-free hot path: +1 packet and +`bytes` in direction `dir`,
    /// `last_active = max(last_active, now)`. Writes only the entry's own
    /// counters. A touch racing with the entry's removal may be lost.
    #[inline]
    pub fn touch(
        &self,
        key: &FlowKey,
        now: Millis,
        dir: Dir,
        bytes: u64,
    ) -> Option<(Cookie, BackendId)> {
        self.lookup_with(key, |_, n| n.touch(now, dir == Dir::Out, bytes))
    }

    /// [`touch`](Self::touch) through a handle: no hashing, no probing.
    /// `false` if the entry is gone.
    #[inline]
    pub fn touch_handle(&self, h: Handle, now: Millis, dir: Dir, bytes: u64) -> bool {
        let _guard = epoch::pin();
        self.handle_node(h)
            .map(|n| n.touch(now, dir == Dir::Out, bytes))
            .is_some()
    }

    /// [`touch_handle`](Self::touch_handle) that counts the packet but
    /// leaves `last_active`: a packet the entry's owner does not take as
    /// its flow's own activity (packet mode: a TCP segment far from its
    /// sender's sequence number, which anyone knowing the four-tuple can
    /// send). `false` if the entry is gone.
    #[inline]
    pub fn count_handle(&self, h: Handle, dir: Dir, bytes: u64) -> bool {
        let _guard = epoch::pin();
        self.handle_node(h)
            .map(|n| n.count(dir == Dir::Out, bytes))
            .is_some()
    }

    /// Packet mode's TCP sequence tracking through a handle: `f` gets the
    /// entry's state and the sequence number noted for direction `dir` (0:
    /// none yet) and returns the one to note instead, if any. Returns what
    /// `f` saw, or `None` if the entry is gone. The table keeps the numbers
    /// (4 bytes each way in the entry's cold part); what to note and what
    /// to check against them is the caller's.
    #[inline]
    pub fn track_seq_handle(
        &self,
        h: Handle,
        dir: Dir,
        f: impl FnOnce(FlowState, u32) -> Option<u32>,
    ) -> Option<(FlowState, u32)> {
        let _guard = epoch::pin();
        Some(self.handle_node(h)?.track_seq(dir == Dir::Out, f))
    }

    /// A read handle that serves many `get`/`touch` calls under one epoch
    /// pin (e.g. one batch of datagrams), saving the pin per call. While it
    /// lives, removed entries' slots are not recycled: keep it for a batch,
    /// not for the life of a worker.
    pub fn reader(&self) -> Reader<'_> {
        Reader {
            table: self,
            guard: epoch::pin(),
        }
    }

    /// Changes the state (and refreshes `last_active`); `false` if absent.
    pub fn set_state(&self, key: &FlowKey, state: FlowState, now: Millis) -> bool {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let Some(t) = map.map.get(&key.tenant.0) else {
            return false;
        };
        let pk = PackedKey::new(key);
        let h = t.table.hash(&pk, t.salt);
        let Some(i) = t.table.index(&guard).find(&self.slab, h, &pk) else {
            return false;
        };
        self.restate(i, state, now)
    }

    /// [`set_state`](Self::set_state) through a handle.
    pub fn set_state_handle(&self, h: Handle, state: FlowState, now: Millis) -> bool {
        let _guard = epoch::pin();
        if self.handle_node(h).is_none() {
            return false;
        }
        self.restate(h.idx, state, now)
    }

    /// Moves the state of the entry a handle names from `s` to `f(s)` in
    /// one compare-and-swap (`f` returns `None` for no change), refreshing
    /// `last_active`; returns `(from, to)` if this call moved it. Two
    /// threads moving the same flow (a packet each way) each see the state
    /// the other left, so counts kept per state by the caller stay exact,
    /// and a move racing the entry's removal either shows in the removal's
    /// snapshot or does not happen.
    pub fn transition_handle(
        &self,
        h: Handle,
        now: Millis,
        f: impl Fn(FlowState) -> Option<FlowState>,
    ) -> Option<(FlowState, FlowState)> {
        let _guard = epoch::pin();
        let n = self.handle_node(h)?;
        let moved = n.transition(f)?;
        n.bump_last_active(now);
        let c = n.cookie();
        self.node_cache().push_refile(h.idx, c, &self.slab);
        Some(moved)
    }

    fn restate(&self, i: u32, state: FlowState, now: Millis) -> bool {
        let n = self.slab.node(i);
        n.set_state(state);
        n.bump_last_active(now);
        // Refile so that a shorter timeout for the new state takes effect.
        let c = n.cookie();
        self.node_cache().push_refile(i, c, &self.slab);
        true
    }

    /// Sets the NAT mapping slot of the entry a handle names (packet mode's
    /// full-NAT source: local address index << 16 | port); `false` if gone,
    /// or if the entry was inserted with [`insert_reply`](Self::insert_reply)
    /// (its reply key may depend on the slot, so the slot is fixed there).
    pub fn set_nat(&self, h: Handle, nat: u32) -> bool {
        let _guard = epoch::pin();
        match self.handle_node(h) {
            Some(n) if !n.has_reply() => {
                n.set_nat(nat);
                true
            }
            _ => false,
        }
    }

    /// The NAT mapping slot of the entry a handle names.
    pub fn nat(&self, h: Handle) -> Option<u32> {
        let _guard = epoch::pin();
        self.handle_node(h).map(|n| n.nat())
    }

    /// Removes an entry, returning its final snapshot.
    pub fn remove(&self, key: &FlowKey) -> Option<FlowSnapshot> {
        self.remove_where(key, |_| true)
    }

    /// Removes the entry for `key` only if it is still the one `cookie`
    /// names (a newer entry for the same key stays), in one locked step.
    pub fn remove_cookie(&self, key: &FlowKey, cookie: Cookie) -> Option<FlowSnapshot> {
        self.remove_where(key, |n| n.cookie() == cookie.0)
    }

    /// Removes the entry a handle names, if it is still there.
    pub fn remove_handle(&self, h: Handle) -> Option<FlowSnapshot> {
        let guard = epoch::pin();
        let n = self.handle_node(h)?;
        let map = self.tenants.load(&guard);
        let t = map.map.get(&n.tenant())?;
        match self.unlink_node(t, h.idx, &guard, |n, _| n.cookie() == h.cookie.0) {
            Unlink::Removed(s) => Some(s),
            _ => None,
        }
    }

    /// Removes one of tenant `id`'s entries that `pick` accepts, from
    /// among those due soonest, and returns its final snapshot: the early
    /// drop a load balancer under a SYN flood needs, where the flows
    /// longest in SYN_RECV are the likeliest never to finish their
    /// handshake.
    ///
    /// The look goes through the tenant's expiry wheel in deadline order
    /// (to the tick), starting within each slot at a place drawn from
    /// `seed`, and reads no more than `budget` references, so its cost is
    /// bounded whatever the tenant holds. Entries inserted since the last
    /// [`expire`](Self::expire) call are filed first if nothing filed is
    /// found (work `expire` would do anyway). A held persistence template
    /// is never taken. [`EvictMiss::NotFound`] if nothing was found within
    /// the budget (or there is no such tenant); [`EvictMiss::Busy`] if the
    /// tenant's wheel was held (another thread's eviction, or `expire`),
    /// nothing filed was found and the maintenance lock was held (an
    /// `expire` call, filing the rest itself), or the entry found moved on
    /// before it could be taken. This never waits for a lock.
    pub fn evict_due_first(
        &self,
        id: TenantId,
        now: Millis,
        budget: usize,
        seed: u64,
        pick: impl Fn(Candidate) -> bool,
    ) -> Result<FlowSnapshot, EvictMiss> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let t = map.map.get(&id.0).ok_or(EvictMiss::NotFound)?;
        let find = |w: &Wheel| {
            w.find_due_first(budget, seed, |slot, i| {
                let n = self.slab.node(i);
                n.is_live() && n.tenant() == id.0 && n.filed_slot() == slot && pick(n.candidate())
            })
        };
        let mut w = t.wheel.try_lock().ok_or(EvictMiss::Busy)?;
        let mut found = find(&w);
        if found.is_none() {
            // The newest entries may not be filed yet: file them (the
            // maintenance lock comes before a wheel's). If an `expire` call
            // holds that lock, it is filing them: Busy, so the caller looks
            // again soon instead of taking "nothing there" for an answer.
            drop(w);
            self.saw(now);
            let mut m = self.maint.try_lock().ok_or(EvictMiss::Busy)?;
            self.drain_new(map, now.0, &mut m);
            drop(m);
            w = t.wheel.try_lock().ok_or(EvictMiss::Busy)?;
            found = find(&w);
        }
        let (slot, pos, idx) = found.ok_or(EvictMiss::NotFound)?;
        // Decided again under the bucket lock (the entry may have moved on
        // since the wheel was read), with the wheel still held, as
        // `expire` does, so that its reference can go with it.
        match self.unlink_node(t, idx, &guard, |n, _| n.held() == 0 && pick(n.candidate())) {
            Unlink::Removed(s) => {
                w.take_at(slot, pos, idx);
                Ok(s)
            }
            _ => Err(EvictMiss::Busy),
        }
    }

    fn remove_where(
        &self,
        key: &FlowKey,
        check: impl Fn(Node<'_>) -> bool,
    ) -> Option<FlowSnapshot> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let t = map.map.get(&key.tenant.0)?;
        #[cfg(test)]
        self.hooks.at(tests::Pause::Removing);
        let pk = PackedKey::new(key);
        let h = t.table.hash(&pk, t.salt);
        let snap = {
            let ix = t.table.index(&guard);
            let (home, mut l) = ix.lock_home(h);
            let i = home.find_locked(&l, &self.slab, h, &pk)?;
            let n = self.slab.node(i);
            // A pending entry (insert_reply still adding its reply key) is
            // not there yet.
            if !n.is_live() || !check(n) || !home.unput(&mut l, h, i) {
                return None;
            }
            if n.has_reply() {
                drop(l);
                self.retire_reply(t, i, &guard);
            } else {
                n.clear_live();
                drop(l);
            }
            let snap = n.snapshot(self.near(), |s, p| t.timeout(s, p));
            self.node_cache().retire(i, &guard, &self.pool);
            snap
        };
        t.add_entries(-1);
        // Shrinking is left to `maintain`.
        self.after_write(t, &guard, false);
        Some(snap)
    }

    /// Removes node `idx` if it is a live entry of `t` and `check` holds
    /// under the bucket lock.
    fn unlink_node(
        &self,
        t: &Tenant,
        idx: u32,
        guard: &Guard,
        check: impl Fn(Node<'_>, &FlowSnapshot) -> bool,
    ) -> Unlink {
        let n = self.slab.node(idx);
        if !n.is_live() || n.tenant() != t.id.0 {
            return Unlink::Gone;
        }
        // The key may change under us if the node is recycled meanwhile;
        // then it is not in the bucket we lock and `unput` finds nothing.
        let pk = n.key();
        let h = t.table.hash(&pk, t.salt);
        let snap = {
            let ix = t.table.index(guard);
            let (home, mut l) = ix.lock_home(h);
            if !n.is_live() || n.tenant() != t.id.0 || !n.matches(&pk) {
                return Unlink::Gone;
            }
            // Taken before the check and handed to it, so that a removal
            // decided on the entry's values (expiry) reports those values:
            // the data path updates an entry without this lock, and a
            // snapshot taken later could show an update that raced with
            // the decision (an expired entry whose deadline lies ahead).
            let snap = n.snapshot(self.near(), |s, p| t.timeout(s, p));
            if !check(n, &snap) {
                return Unlink::Kept;
            }
            if !home.unput(&mut l, h, idx) {
                return Unlink::Gone;
            }
            if n.has_reply() {
                drop(l);
                self.retire_reply(t, idx, guard);
            } else {
                n.clear_live();
            }
            snap
        };
        t.add_entries(-1);
        self.queue_for_maint(t);
        self.node_cache().retire(idx, guard, &self.pool);
        Unlink::Removed(snap)
    }

    /// Second half of removing node `idx`, which has a reply key, after its
    /// forward entry was unpublished (under that lock, which decided the
    /// removal): unpublishes the reply entry and clears the live bit.
    fn retire_reply(&self, t: &Tenant, idx: u32, guard: &Guard) {
        let rk = self.slab.node(idx).reply_key();
        let h = t.table.hash(&rk.hash_key(), t.salt);
        let ok = t.table.index(guard).retire_reply(&self.slab, h, idx);
        debug_assert!(ok, "a live entry's reply index entry was missing");
        t.table.add_replies(-1);
    }

    /// Files every not-yet-filed node in its tenant's wheel (and the
    /// tenant in the due index for the earliest slot filed).
    fn drain_new(&self, map: &TenantMap, now: u64, m: &mut Maint) {
        for c in self.caches.iter() {
            let v = {
                let mut c = c.lock();
                if c.new_nodes.is_empty() {
                    continue;
                }
                c.take_new()
            };
            let mut cur: Option<(&Arc<Tenant>, parking_lot::MutexGuard<'_, Wheel>)> = None;
            for r in v {
                let idx = ref_idx(r);
                let n = self.slab.node(idx);
                if !ref_current(r, n) {
                    continue;
                }
                let tid = n.tenant();
                if cur.as_ref().is_none_or(|(t, _)| t.id.0 != tid) {
                    if let Some((t, w)) = cur.as_mut() {
                        m.filed(t, w);
                    }
                    cur = None;
                    if let Some(t) = map.map.get(&tid) {
                        let mut w = t.wheel.lock();
                        w.start(now);
                        cur = Some((t, w));
                    }
                }
                if let Some((t, w)) = cur.as_mut() {
                    let deadline = n
                        .last_active(now)
                        .saturating_add(t.timeout(n.state(), n.profile()));
                    let slot = w.file(idx, deadline, now);
                    n.set_filed_slot(slot);
                    let due = w.visit_for(slot);
                    if w.due_key.is_none_or(|k| due < k) {
                        m.index(tid, w, Some(due));
                    }
                }
            }
            if let Some((t, w)) = cur.as_mut() {
                m.filed(t, w);
            }
        }
    }

    /// Table maintenance: starts a resize a table's load asks for and moves
    /// up to `MAINT_MOVES` buckets of each running one. `expire` calls it;
    /// inserts and removes also move a few buckets each while a resize runs.
    /// Own tables are looked at only when written to since the last call,
    /// or resizing (the maintenance queue), not all of them every call.
    pub fn maintain(&self) {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let shared = &self.shared;
        if !shared.resizing(&guard) {
            shared.maybe_resize(&guard, |_| true, |_| {});
        }
        shared.help_resize(&guard, &self.slab, MAINT_MOVES, &|i| self.rehash(shared, i));
        let queued = std::mem::take(&mut *self.maint_queue.lock());
        let mut again = Vec::new();
        for id in queued {
            // A tenant removed since (or removed and added again: then its
            // new table, looked at once for nothing).
            let Some(t) = map.map.get(&id) else { continue };
            if t.own_bytes == 0 {
                continue;
            }
            let table = &*t.table;
            table.queued.store(false, SeqCst);
            fence(SeqCst);
            self.maintained.fetch_add(1, Relaxed);
            if !table.resizing(&guard) {
                table.maybe_resize(
                    &guard,
                    |more| self.reserve_for(t, more),
                    |more| self.unreserve_for(t, more),
                );
            }
            // Resizing: looked at again next call, also once the resize
            // ends (in this call or by writers meanwhile), since the load
            // may ask for another (a shrink halves at a time).
            let resizing = table.resizing(&guard);
            table.help_resize(&guard, &self.slab, MAINT_MOVES, &|i| self.rehash(table, i));
            if resizing && !table.queued.swap(true, SeqCst) {
                again.push(id);
            }
        }
        if !again.is_empty() {
            self.maint_queue.lock().extend(again);
        }
    }

    /// Own tables [`maintain`](Self::maintain) has looked at so far: only
    /// those written to since it last did, or resizing.
    #[doc(hidden)]
    pub fn maintained_tables(&self) -> u64 {
        self.maintained.load(Relaxed)
    }

    /// Starts resizing a tenant's table (or the shared one for a tenant that
    /// shares it) to `entries` at the target load, unless one runs already;
    /// inserts, removes and [`maintain`](Self::maintain) move it along.
    #[doc(hidden)]
    pub fn start_resize(&self, id: TenantId, entries: usize) -> bool {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let Some(t) = map.map.get(&id.0) else {
            return false;
        };
        let started = t
            .table
            .start_resize(&guard, crate::table::buckets_for(entries));
        // `maintain` moves it along.
        self.queue_for_maint(t);
        started
    }

    /// Whether the table of tenant `id` is resizing; completed resizes.
    pub fn resize_state(&self, id: TenantId) -> Option<(bool, u64)> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let t = map.map.get(&id.0)?;
        Some((t.table.resizing(&guard), t.table.resizes.load(Relaxed)))
    }

    /// Removes up to `max` entries idle past their state's timeout
    /// (`now >= last_active + timeout`), appending them to `out`; returns
    /// how many. Bounded work: files the entries inserted since the last
    /// call, then visits only the tenants with something due (an index
    /// of each tenant's next due tick; a tenant with nothing due costs
    /// nothing), examining at most `16 * max + 1024` wheel references in
    /// all, then runs [`maintain`](Self::maintain). Call it periodically
    /// (e.g. every second); an entry is removed at most one wheel tick
    /// (1 s) plus the call period after its deadline if the budget keeps
    /// up, never before. When the budget runs out, the next call goes on
    /// with the tenants due longest, the one cut short first. A retime pass (see
    /// [`set_timeouts`](Self::set_timeouts)) adds at most [`RETIME_REFS`]
    /// wheel references per call, over all tenants.
    pub fn expire(&self, now: Millis, max: usize, out: &mut Vec<FlowSnapshot>) -> usize {
        self.saw(now);
        if max == 0 {
            return 0;
        }
        let removed = self.expire_inner(now, max, out);
        self.maintain();
        removed
    }

    fn expire_inner(&self, now: Millis, max: usize, out: &mut Vec<FlowSnapshot>) -> usize {
        let now = now.0;
        let now_t = now / crate::wheel::TICK_MS;
        let mut m = self.maint.lock();
        let m = &mut *m;
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        self.drain_new(map, now, m);
        let mut budget = max.saturating_mul(16).saturating_add(1024);
        let mut retime_budget = RETIME_REFS;
        let mut removed = 0;
        // Tenants visited in this call that have work again at once (a
        // retime pass, compaction): back in the index when the call ends,
        // so that none is visited twice in one call.
        let mut again: Vec<u32> = Vec::new();
        while let Some(&(key, id)) = m.due.first() {
            if key > now_t {
                break;
            }
            m.due.pop_first();
            let Some(t) = map.map.get(&id) else { continue };
            m.visits += 1;
            let mut w = t.wheel.lock();
            if w.due_key == Some(key) {
                w.due_key = None;
            }
            w.start(now);
            // Before the due slots, so that entries the pass finds overdue
            // go in this same call. (Without a pass: a no-op.)
            let was_retiming = w.retiming();
            {
                let slab = &self.slab;
                retime_budget -= w.retime(
                    retime_budget,
                    now,
                    |slot, i| {
                        let n = slab.node(i);
                        (n.is_live() && n.tenant() == id && n.filed_slot() == slot).then(|| {
                            n.last_active(now)
                                .saturating_add(t.timeout(n.state(), n.profile()))
                        })
                    },
                    |i, s| slab.node(i).set_filed_slot(s),
                );
            }
            if was_retiming && !w.retiming() {
                self.retiming_tenants.fetch_sub(1, Relaxed);
            }
            while let Some(slot) = w.due_slot(now) {
                while let Some(idx) = w.pop(slot) {
                    if removed == max || budget == 0 {
                        w.push_back(slot, idx);
                        // Still due, and first in line for the next call.
                        m.index(id, &mut w, Some(key));
                        drop(w);
                        self.due_again(m, map, &again, now_t);
                        return removed;
                    }
                    budget -= 1;
                    let n = self.slab.node(idx);
                    if !n.is_live() || n.tenant() != id || n.filed_slot() != slot {
                        continue; // stale reference
                    }
                    let deadline = |n: Node<'_>| {
                        n.last_active(now)
                            .saturating_add(t.timeout(n.state(), n.profile()))
                    };
                    let mut refile = true;
                    if now >= deadline(n) {
                        // Decided on the snapshot the removal reports: its
                        // deadline has passed, whatever the data path
                        // writes meanwhile.
                        match self.unlink_node(t, idx, &guard, |n, s| {
                            n.filed_slot() == slot && now >= s.expires_at.0 && n.held() == 0
                        }) {
                            Unlink::Removed(s) => {
                                out.push(s);
                                removed += 1;
                                refile = false;
                            }
                            Unlink::Kept => {}
                            Unlink::Gone => refile = false,
                        }
                    }
                    if refile {
                        let mut d = deadline(n);
                        if n.held() > 0 {
                            // A held template: look again a timeout from
                            // now (at least a tick, so never overdue
                            // again in this call). Its last release
                            // restarts the timeout from the release time,
                            // so the real deadline comes no earlier (give
                            // or take the two callers' clocks).
                            let tmo = t.timeout(n.state(), n.profile());
                            d = d.max(now.saturating_add(tmo.max(crate::wheel::TICK_MS)));
                        }
                        let s = w.file(idx, d, now);
                        n.set_filed_slot(s);
                    }
                }
            }
            // Stale references (removed entries) outnumber live ones:
            // compact some slots with what is left of the budget.
            if wants_compaction(t, &w) {
                let slab = &self.slab;
                budget = budget.saturating_sub(w.compact(budget, |slot, i| {
                    let n = slab.node(i);
                    n.is_live() && n.tenant() == id && n.filed_slot() == slot
                }));
            }
            match w.next_visit() {
                Some(k) if k <= now_t || wants_compaction(t, &w) => again.push(id),
                next => m.index(id, &mut w, next),
            }
        }
        self.due_again(m, map, &again, now_t);
        removed
    }

    /// Puts the tenants an `expire` call found with work left at once back
    /// in the due index, due now.
    fn due_again(&self, m: &mut Maint, map: &TenantMap, again: &[u32], now_t: u64) {
        for &id in again {
            if let Some(t) = map.map.get(&id) {
                m.index(id, &mut t.wheel.lock(), Some(now_t));
            }
        }
    }

    /// Tenant wheels [`expire`](Self::expire) has visited so far: only
    /// those with something due (or a retime pass, or compaction to do).
    #[doc(hidden)]
    pub fn wheel_visits(&self) -> u64 {
        self.maint.lock().visits
    }

    /// Holds the maintenance lock (as a tenant's removal or an expiry
    /// pass does) until the guard is dropped: for tests of what waits for
    /// it.
    #[doc(hidden)]
    pub fn hold_maintenance(&self) -> impl Sized + '_ {
        self.maint.lock()
    }

    /// References (live and stale) in a tenant's expiry wheel.
    #[doc(hidden)]
    pub fn wheel_refs(&self, id: TenantId) -> Option<usize> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        Some(map.map.get(&id.0)?.wheel.lock().refs())
    }

    /// References waiting in the to-be-filed lists (shared by all tenants),
    /// live and stale.
    #[doc(hidden)]
    pub fn pending_filing_refs(&self, id: TenantId) -> Option<usize> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        map.map.get(&id.0)?;
        Some(self.caches.iter().map(|c| c.lock().new_nodes.len()).sum())
    }

    /// Tables in dump order from dump order `from` on, restricted to one
    /// tenant's table if asked.
    ///
    /// Why the own tables before `from` are skipped by a binary search
    /// rather than walked past: a page that resumes in the last of 10,000
    /// own tables walked the 9,999 before it, ~3.4 µs per page; a dump in
    /// pages of one entry cost 34 µs per entry instead of ~0.2, O(tenants)
    /// per page where the dump promises O(entries + buckets) in all.
    fn dump_tables<'a>(
        &'a self,
        map: &'a TenantMap,
        tenant: Option<TenantId>,
        from: u64,
    ) -> Option<impl Iterator<Item = &'a Table> + 'a> {
        let (single, own) = match tenant {
            Some(id) => (Some(&*map.map.get(&id.0)?.table), &[][..]),
            None => {
                // `own` is sorted by tenant id, so by dump order.
                let at = map.own.partition_point(|t| t.table.order < from);
                (None, &map.own[at..])
            }
        };
        let shared = (tenant.is_none() && self.shared.order >= from).then_some(&*self.shared);
        Some(
            single
                .into_iter()
                .chain(shared)
                .chain(own.iter().map(|t| &*t.table))
                .filter(move |t| t.order >= from),
        )
    }

    /// Resumable dump: appends up to `limit` entries matching `filter` to
    /// `out` and returns the cursor to continue from, or `None` when done.
    ///
    /// Entries are returned in the order of (table, top 32 bits of the
    /// key's hash, cookie), an order that does not depend on the table's
    /// size: buckets cover consecutive ranges of the hash for every bucket
    /// count, so a resize in the middle of a dump changes nothing. The
    /// cursor is the last (table, hash, cookie) returned; resuming reads the
    /// one bucket that holds that position (at most `max_chain` entries).
    /// Guarantees: total cost O(entries + buckets) over a whole dump
    /// whatever `limit` is; an entry present for the whole dump is returned
    /// exactly once, even across resizes; entries added or removed meanwhile
    /// at most once; it always terminates. Pass the same filter on every page.
    /// Filtered by a tenant: its own table alone if it has one; if it shares
    /// the table and holds a small part of it, its own expiry references
    /// rather than a walk of the shared table (same order, same guarantees;
    /// a page costs O(min(n, limit x total / n)) for n of total entries).
    pub fn dump(
        &self,
        cursor: Option<&Cursor>,
        filter: &DumpFilter,
        limit: usize,
        out: &mut Vec<FlowSnapshot>,
    ) -> Option<Cursor> {
        let mut c = cursor.copied();
        self.dump_page(&mut c, filter, limit, out);
        c
    }

    /// [`dump`](Self::dump) with the cursor kept by the caller and moved
    /// on in place: `cursor` is `None` to start a dump, and is left where
    /// the next page starts, or `None` when the dump is done (the return
    /// value: whether there is more). Same order and guarantees.
    ///
    /// Why a second form: a cursor returned by value is 40 bytes, written
    /// by this function one field at a time and copied by the caller in
    /// 16-byte moves, whose loads cannot be forwarded from the narrower
    /// stores; the caller's copy then waited for them to reach the cache.
    /// With pages of one entry that stall was ~10% of a page's time (perf
    /// samples of `weir-bench ops --op dump --page 1`: the copy after the
    /// call, and the copy of the cursor in). Moved on in place, the next
    /// call reads each field as it was written.
    pub fn dump_page(
        &self,
        cursor: &mut Option<Cursor>,
        filter: &DumpFilter,
        limit: usize,
        out: &mut Vec<FlowSnapshot>,
    ) -> bool {
        if limit == 0 {
            cursor.get_or_insert(Cursor::START);
            return true;
        }
        let mut scratch = self.dump_scratch();
        // Before the directory is loaded: see `DumpScratch::timeouts`.
        let changes = self.tenant_changes.load(Acquire);
        let mut limit = limit;
        if let Some(c) = cursor
            && filter.tenant.is_none()
        {
            let listed = self.resume_quick(&mut scratch, c, filter, limit, out, changes);
            if listed == limit {
                put_scratch(scratch);
                return true;
            }
            limit -= listed;
        }
        // Field by field, not a copy of the whole cursor: see above.
        let (order, after, dump) = match cursor {
            Some(c) => (c.order, (c.bucket, c.cookie), c.dump),
            None => (0, (0, 0), self.dumps.fetch_add(1, Relaxed) + 1),
        };
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let start = || Cursor {
            order,
            bucket: after.0,
            cookie: after.1,
            dump,
        };
        if let Some(t) = filter.tenant.and_then(|id| map.map.get(&id.0))
            && Arc::ptr_eq(&t.table, &self.shared)
            && self.list_by_refs(t, limit)
        {
            *cursor = self.dump_by_refs(map, start(), filter, limit, out, scratch);
            return cursor.is_some();
        }
        let mut d = Dumper::new(self, map, filter, limit, out, dump, &mut scratch);
        // A page that goes on from this thread's last page of the same dump
        // starts there, before any of the walk's set-up.
        match d.resume_here(order, after) {
            Ok((hi, cookie)) => match cursor {
                Some(c) => {
                    c.bucket = hi;
                    c.cookie = cookie;
                }
                None => {
                    *cursor = Some(Cursor {
                        bucket: hi,
                        cookie,
                        ..start()
                    })
                }
            },
            Err(after) => *cursor = self.walk(&mut d, map, filter, start(), after, &guard),
        }
        if let Some(t) = d.cached {
            TimeoutCopies::keep(scratch.timeouts.slot(t.id.0), changes, t);
        }
        put_scratch(scratch);
        cursor.is_some()
    }

    /// The O(1) resume of [`Dumper::resume_here`] before any of the
    /// walk's set-up, and without the epoch pin and the tenant directory
    /// for the entries of tenants whose timeouts the scratch `s` holds a
    /// copy of ([`DumpScratch::timeouts`]): when this thread's last page of
    /// the same dump ended at cursor `c`, lists on through the rest of that
    /// bucket's sorted entries, and moves `c` and the remembered place on.
    /// Returns how many entries it listed (`limit`: the page is full); the
    /// walk goes on from `c` when the remembered entries ran out first.
    /// Another tenant's entry, or one of a timeout profile, is listed with
    /// the directory, pinned then (once per call).
    ///
    /// Why: a page of one entry paid for the pin (~45 instructions with
    /// its release), the directory's lookup of the entry's tenant (~20)
    /// and the walk's set-up on every call: ~270 instructions per call on
    /// top of the ~560 per entry of larger pages (callgrind,
    /// `weir-bench ops --op dump`).
    ///
    /// Why no pin is needed for the rest: the slab's nodes live as long as
    /// the table, and the sorted entries are this thread's own; a node
    /// reused since the bucket was read, or while it is being copied (no
    /// grace period holds it back here), is told by its cookie
    /// ([`Node::snapshot_of`]). The
    /// directory is all a pin guards here, and a copy stands in for it. A
    /// copy was taken from a directory loaded after `tenant_changes` read
    /// its `changes`, and that count is bumped after every change of the
    /// directory or of a tenant's timeouts; so with the count read again
    /// at this page's start and found the same, the copy is what a
    /// directory loaded then would give (or one a change under way, not
    /// yet counted, replaces: the page then comes before that change).
    #[inline(always)]
    fn resume_quick(
        &self,
        s: &mut DumpScratch,
        c: &mut Cursor,
        filter: &DumpFilter,
        limit: usize,
        out: &mut Vec<FlowSnapshot>,
        changes: u64,
    ) -> usize {
        let DumpScratch {
            resume: Some(r),
            timeouts,
            items,
            ..
        } = s
        else {
            return 0;
        };
        if r.dump != c.dump || r.order != c.order || r.at != (c.bucket, c.cookie) {
            return 0;
        }
        let near = self.near();
        let mut guard = None;
        let mut listed = 0;
        // The remembered place moves on in place, entry by entry.
        while let Some(&(h, cookie, i)) = items.get(r.pos) {
            let n = self.slab.node(i);
            r.pos += 1;
            if !n.is_live() {
                continue; // removed since the bucket was sorted
            }
            r.at = (u64::from(h), cookie);
            if !passes(filter, &n) {
                continue;
            }
            let tid = n.tenant();
            let copy = timeouts.slot(tid);
            let snap = match copy {
                Some(k) if k.id == tid && k.changes == changes && n.profile() == 0 => {
                    n.snapshot_of(cookie, near, |st, _| k.base[st.code() as usize])
                }
                _ => {
                    let map = self.tenants.load(guard.get_or_insert_with(epoch::pin));
                    let Some(t) = map.map.get(&tid) else {
                        continue; // its tenant is gone
                    };
                    TimeoutCopies::keep(copy, changes, t);
                    n.snapshot_of(cookie, near, |st, p| t.timeout(st, p))
                }
            };
            // Unpinned, the node may be recycled at any time, even in the
            // middle of the copy: `snapshot_of` finds out.
            let Some(snap) = snap.filter(|s| filter.matches(s)) else {
                // Recycled under us, or moved out of the filter (its state,
                // or a template's backend) since `passes` read the node.
                continue;
            };
            out.push(snap);
            listed += 1;
            if listed == limit {
                if let Some(&(_, _, j)) = items.get(r.pos) {
                    self.slab.prefetch_all(j);
                }
                break;
            }
        }
        c.bucket = r.at.0;
        c.cookie = r.at.1;
        // Unpinned here, if pinned at all: the check inline, not in a call
        // to drop an `Option` (which every page of one paid).
        if let Some(g) = guard {
            drop(g);
        }
        listed
    }

    /// The rest of [`dump`](Self::dump)'s page once the remembered place
    /// (if any) is used up: walks the tables from `start`'s on, the
    /// start's table from position `after`.
    fn walk(
        &self,
        d: &mut Dumper<'_, '_>,
        map: &TenantMap,
        filter: &DumpFilter,
        start: Cursor,
        after: (u64, u64),
        guard: &Guard,
    ) -> Option<Cursor> {
        for table in self.dump_tables(map, filter.tenant, start.order)? {
            let after = if table.order == start.order {
                after
            } else {
                (0, 0)
            };
            let (hi, cookie) = d.table(table, guard, after);
            if cookie != 0 {
                return Some(Cursor {
                    order: table.order,
                    bucket: hi,
                    cookie,
                    dump: start.dump,
                });
            }
        }
        None
    }

    /// [`dump`](Self::dump)'s page of tenant `t`, which shares the table,
    /// from its own references ([`Dumper::refs`]).
    // Out of line: kept off the walk's path, where inlined it made a page
    // of one entry ~30 instructions dearer.
    #[cold]
    #[inline(never)]
    fn dump_by_refs(
        &self,
        map: &TenantMap,
        start: Cursor,
        filter: &DumpFilter,
        limit: usize,
        out: &mut Vec<FlowSnapshot>,
        mut scratch: Box<DumpScratch>,
    ) -> Option<Cursor> {
        let table = &*self.shared;
        if start.order > table.order {
            put_scratch(scratch);
            return None;
        }
        // The caller found it in `map` (found again here: an argument
        // fewer, on a cold path).
        let t = filter
            .tenant
            .and_then(|id| map.map.get(&id.0))
            .expect("the tenant of a page by references");
        let after = if start.order == table.order {
            (start.bucket, start.cookie)
        } else {
            (0, 0)
        };
        let mut d = Dumper::new(self, map, filter, limit, out, start.dump, &mut scratch);
        let (hi, cookie) = d.refs(t, table, after);
        if scratch.items.capacity() > 1 << 16 {
            // A large tenant: do not keep that much per thread for good.
            scratch.items = Vec::new();
        }
        put_scratch(scratch);
        (cookie != 0).then_some(Cursor {
            order: table.order,
            bucket: hi,
            cookie,
            dump: start.dump,
        })
    }

    /// This thread's dump scratch, emptied of what it knew of another
    /// table (node indices mean nothing in another table's slab).
    fn dump_scratch(&self) -> Box<DumpScratch> {
        let mut scratch = DUMP_SCRATCH.take().unwrap_or_default();
        if scratch.table != self.id {
            scratch.table = self.id;
            scratch.known.clear();
            scratch.prefetched = (0, 0);
            scratch.resume = None;
            scratch.timeouts = TimeoutCopies::default();
        }
        scratch
    }

    /// Whether a page of tenant `t`, which shares the table, is listed
    /// from the tenant's own references ([`Dumper::refs`]) rather than by
    /// walking the shared table.
    ///
    /// Why: a walk filtered by tenant reads the whole shared table to fill
    /// a page of a small tenant (0.41 s per page for a tenant of 10
    /// entries beside 8M others): one tenant's listing paid for everyone's
    /// entries, what seed 000 keeps tables per namespace against. Listing
    /// from the references costs O(n) per page for a tenant of `n`
    /// entries, the walk O(limit x total / n) (it reads about total / n
    /// entries per match); the cheaper one is taken, so a page costs at
    /// most about sqrt(limit x total) entry reads and a whole dump stays
    /// O(total) (n^2 / limit pages' worth <= total).
    fn list_by_refs(&self, t: &Tenant, limit: usize) -> bool {
        let n = u128::from(t.entries());
        n * n <= u128::from(self.shared.entries()) * limit.max(64) as u128
    }

    /// Dump work done on this thread so far: (bucket reads of a table
    /// walk, expiry references read to list a tenant that shares the
    /// table). For tests of what a listing costs.
    #[doc(hidden)]
    pub fn dump_work_on_this_thread() -> (u64, u64) {
        DUMP_WORK.get()
    }

    /// The pre-2021 `/proc/net/tcp` resume algorithm, as a contrast for
    /// benchmarks: resume at (bucket, offset within the bucket) of the shared
    /// table. Cheap, but under concurrent change it skips or repeats entries.
    #[doc(hidden)]
    pub fn dump_naive_offset(
        &self,
        resume: (usize, usize),
        limit: usize,
        out: &mut Vec<FlowSnapshot>,
    ) -> Option<(usize, usize)> {
        if limit == 0 {
            return Some(resume);
        }
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let ix = self.shared.index(&guard);
        let mut emitted = 0;
        let mut ids = Vec::new();
        for b in resume.0..ix.len() {
            let skip = if b == resume.0 { resume.1 } else { 0 };
            ids.clear();
            if !ix.read_bucket(b, &mut ids) {
                continue;
            }
            for (pos, &i) in ids.iter().enumerate().skip(skip) {
                let n = self.slab.node(i);
                if !n.is_live() {
                    continue;
                }
                if let Some(t) = map.map.get(&n.tenant()) {
                    out.push(n.snapshot(self.near(), |s, p| t.timeout(s, p)));
                    emitted += 1;
                }
                if emitted >= limit {
                    return Some((b, pos + 1));
                }
            }
        }
        None
    }

    /// Introspection for one tenant. Cheap: reads at most 2^20 bucket
    /// headers (an even sample of bigger tables), never the entries.
    pub fn tenant_stats(&self, id: TenantId) -> Option<TableStats> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let t = map.map.get(&id.0)?;
        self.chain_scans.fetch_add(1, Relaxed);
        Some(t.stats(&t.table.chain_stats(&guard)))
    }

    /// [`tenant_stats`](Self::tenant_stats) as the tenant itself may see
    /// them: for a tenant that shares the table the shared table's buckets
    /// are not read (their chains are every tenant's load, which a tenant
    /// is not shown), so the call is O(1) whatever the shared table holds;
    /// `chain_histogram` is empty and `max_chain` 0 then. A tenant with an
    /// own table gets [`tenant_stats`](Self::tenant_stats).
    ///
    /// Why: a tenant token's `GET /v1/table` read up to 2^20 of the shared
    /// table's bucket headers per request only for the daemon to drop those
    /// figures.
    pub fn tenant_own_stats(&self, id: TenantId) -> Option<TableStats> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let t = map.map.get(&id.0)?;
        let cs = if Arc::ptr_eq(&t.table, &self.shared) {
            t.table.counts_only(&guard)
        } else {
            self.chain_scans.fetch_add(1, Relaxed);
            t.table.chain_stats(&guard)
        };
        Some(t.stats(&cs))
    }

    /// [`tenant_stats`](Self::tenant_stats) of every tenant, by tenant id,
    /// reading each table's buckets once: the shared table's once for all
    /// the tenants that share it.
    ///
    /// Why: asking each tenant in turn read the shared table's (up to
    /// 2^20) bucket headers again for every tenant that shares it; the
    /// daemon's `/v1/table` took 1.4 s at 10,000 tenants and 1M flows,
    /// 19.5 s at 8M (measured), where once is ~1 ms.
    pub fn all_tenant_stats(&self) -> Vec<(TenantId, TableStats)> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let mut shared = None;
        let mut out: Vec<(TenantId, TableStats)> = map
            .map
            .values()
            .map(|t| {
                let own;
                let cs = if Arc::ptr_eq(&t.table, &self.shared) {
                    shared.get_or_insert_with(|| {
                        self.chain_scans.fetch_add(1, Relaxed);
                        self.shared.chain_stats(&guard)
                    })
                } else {
                    self.chain_scans.fetch_add(1, Relaxed);
                    own = t.table.chain_stats(&guard);
                    &own
                };
                (t.id, t.stats(cs))
            })
            .collect();
        out.sort_unstable_by_key(|(id, _)| id.0);
        out
    }

    /// Tables whose buckets introspection has read (one per table per
    /// [`tenant_stats`](Self::tenant_stats) or
    /// [`all_tenant_stats`](Self::all_tenant_stats)), for tests.
    #[doc(hidden)]
    pub fn chain_scans(&self) -> u64 {
        self.chain_scans.load(Relaxed)
    }

    /// Existing tenants, sorted.
    pub fn tenants(&self) -> Vec<TenantId> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let mut v: Vec<TenantId> = map.map.keys().map(|&i| TenantId(i)).collect();
        v.sort_unstable();
        v
    }

    /// Approximate bytes held: node arena, bucket indexes, wheels, free
    /// lists.
    pub fn memory_bytes(&self) -> usize {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let mut b = self.slab.memory_bytes()
            + self.shared.memory_bytes(&guard)
            + 4 * self.pool.free.lock().capacity()
            + self
                .caches
                .iter()
                .map(|c| c.lock().memory_bytes())
                .sum::<usize>()
            + self.counts.memory_bytes();
        for t in map.map.values() {
            b += t.wheel.lock().memory_bytes() + std::mem::size_of::<Tenant>();
        }
        for t in &map.own {
            b += t.table.memory_bytes(&guard);
        }
        b
    }
}

/// One dump call's state.
struct Dumper<'a, 'o> {
    ft: &'a FlowTable,
    map: &'a TenantMap,
    filter: &'a DumpFilter,
    limit: usize,
    out: &'o mut Vec<FlowSnapshot>,
    emitted: usize,
    cached: Option<&'a Arc<Tenant>>,
    /// The dump's number ([`Cursor`]'s `dump`; 0: unknown).
    dump: u64,
    s: &'o mut DumpScratch,
}

impl<'a, 'o> Dumper<'a, 'o> {
    /// A page of at most `limit` entries of dump `dump` into `out`, with
    /// this thread's scratch `s`.
    fn new(
        ft: &'a FlowTable,
        map: &'a TenantMap,
        filter: &'a DumpFilter,
        limit: usize,
        out: &'o mut Vec<FlowSnapshot>,
        dump: u64,
        s: &'o mut DumpScratch,
    ) -> Self {
        Dumper {
            ft,
            map,
            filter,
            limit,
            out,
            emitted: 0,
            cached: None,
            dump,
            s,
        }
    }
}

/// What [`Dumper::range`] returns when the page did not fill: a position
/// no entry has (cookies are never 0). A plain pair, not an `Option`: two
/// `u64`s come back in registers, where an `Option<(u64, u64)>` came back
/// through memory and its 16-byte reload of two 8-byte stores missed store
/// forwarding (perf: ~8% of the samples of a dump with pages of one entry).
const NOT_FULL: (u64, u64) = (0, 0);

/// What [`Dumper::resume_in`] did.
enum Resumed {
    /// The page filled; the position of its last entry.
    Full((u64, u64)),
    /// Listed the rest of the bucket; go on with the next one.
    Done,
    /// Not resumable in O(1): read the bucket afresh.
    No,
}

/// One thread's dump buffers, kept between calls, and the hash positions of
/// the entries of the bucket the thread's last page ended in.
///
/// Why: a page ends inside a bucket, and the next call must find its place
/// there in hash order, which means the hash of every entry of the bucket;
/// with pages of one entry, each of the ~8 entries of a bucket was rehashed
/// ~8 times. Remembering them is safe because they are facts, not a copy of
/// the bucket: an entry's (node, cookie) names it for its whole life (a
/// cookie is unique until its node has been reused 2^28 times) and its key,
/// hence its hash, never changes. The bucket itself is read afresh on every
/// call, so entries added since are seen and rehashed, and removed ones are
/// not listed; the dump's guarantees are those of the bucket read.
#[derive(Default)]
struct DumpScratch {
    /// The [`FlowTable`] `known` belongs to (its `id`; 0 for none).
    table: u64,
    /// (node, cookie, top 32 bits of the hash) of the entries of the
    /// bucket where the thread's last page ended.
    known: Vec<(u32, u64, u32)>,
    /// The same, for the bucket being read.
    fresh: Vec<(u32, u64, u32)>,
    ids: Vec<u32>,
    /// (hash hi, cookie, node) of one bucket, sorted.
    items: Vec<(u32, u64, u32)>,
    /// (index address, bucket) whose lookahead was last prefetched.
    prefetched: (usize, usize),
    /// Where the last page ended inside a bucket, to resume there in O(1).
    resume: Option<Resume>,
    /// Copies of tenants' own timeouts, for the resume without the
    /// tenant directory ([`FlowTable::resume_quick`]).
    timeouts: TimeoutCopies,
}

/// Copies of tenants' own timeouts, one place per tenant id modulo
/// [`TIMEOUT_COPIES`] (made when first used).
///
/// Why several: the entries of tenants that share the table alternate in
/// a bucket, and a single copy, taken over by each tenant in turn, served
/// pages of one entry of 64 such tenants rarely and cost a copy per page
/// (+20% instructions per entry against the pinned resume).
#[derive(Default)]
struct TimeoutCopies(Vec<Option<TenantTimeouts>>);

/// See [`TimeoutCopies`]: tenants beyond this many share places, and
/// those that find their place taken are listed with the directory.
const TIMEOUT_COPIES: usize = 64;

impl TimeoutCopies {
    /// Tenant `id`'s place.
    #[inline(always)]
    fn slot(&mut self, id: u32) -> &mut Option<TenantTimeouts> {
        if self.0.is_empty() {
            self.0.resize(TIMEOUT_COPIES, None);
        }
        &mut self.0[id as usize % TIMEOUT_COPIES]
    }

    /// Puts a copy of tenant `t`'s own timeouts, from a directory loaded
    /// after `tenant_changes` read `changes`, in its place `copy` unless
    /// that holds a copy of as late a count (its own, or another
    /// tenant's: a place is not taken over, or tenants that share it
    /// would copy on every page).
    fn keep(copy: &mut Option<TenantTimeouts>, changes: u64, t: &Tenant) {
        if copy.as_ref().is_some_and(|k| k.changes == changes) {
            return;
        }
        *copy = Some(TenantTimeouts {
            changes,
            id: t.id.0,
            base: t.base().map(|v| v.min(crate::types::MAX_TIMEOUT_MS)),
        });
    }
}

/// Tenant `id`'s own timeouts (profile 0, as [`Tenant::timeout`] gives
/// them), copied when [`FlowTable`]'s `tenant_changes` was `changes`.
#[derive(Clone, Copy)]
struct TenantTimeouts {
    changes: u64,
    id: u32,
    base: [u64; 10],
}

/// Dump number `dump`'s last page ended at `items[pos - 1]` of bucket
/// `bucket` of the index at address `ix` with `len` buckets in the table of
/// dump order `order` (the range's end was `hi`).
///
/// Why: with pages of one entry, every call re-read the bucket, checked
/// each of its ~8 nodes and sorted them to find the next one (~2,800
/// instructions per entry). The next call of the same dump at the same
/// position goes on from `items[pos]` instead. That lists every entry the
/// full path would have to: an entry present since the bucket was read is
/// in `items` (the bucket's entries after the cursor then, sorted by
/// (hash, cookie); those before `pos` are at or before the cursor), and the
/// bucket number and count name the same hash range in any index of that
/// address and size. Entries removed since are skipped (not live, or their
/// node now shows another cookie, see [`Dumper::emit`]); entries added
/// since are not listed, which the dump allows because the read happened
/// during this dump. That is why the dump's number must match: another
/// dump whose page ends on the same entry may have started after the read,
/// and an entry added in between is present for its whole run
/// (`tests/dump_resume.rs`, `a_dump_never_goes_on_from_a_bucket_read_before_it_started`).
/// A dump of unknown number (0: a `c2.` cursor) never goes on from one.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Resume {
    /// The dump that read the bucket ([`Cursor`]'s `dump`, never 0).
    dump: u64,
    /// The table's dump order.
    order: u64,
    ix: usize,
    len: usize,
    bucket: usize,
    hi: u64,
    /// The cursor position the page returned (hash hi, cookie).
    at: (u64, u64),
    pos: usize,
}

impl Resume {
    fn new(
        dump: u64,
        table: &Table,
        ix: &Index,
        bucket: usize,
        hi: u64,
        at: (u64, u64),
        pos: usize,
    ) -> Self {
        Resume {
            dump,
            order: table.order,
            ix: std::ptr::from_ref(ix) as usize,
            len: ix.len(),
            bucket,
            hi,
            at,
            pos,
        }
    }
}

/// Puts this thread's dump scratch back where it was taken from.
#[inline(always)]
fn put_scratch(scratch: Box<DumpScratch>) {
    // Nothing is there (it was taken out): no call to drop an `Option`.
    if let Some(other) = DUMP_SCRATCH.replace(Some(scratch)) {
        drop(other);
    }
}

thread_local! {
    static DUMP_SCRATCH: std::cell::Cell<Option<Box<DumpScratch>>> =
        const { std::cell::Cell::new(None) };
    /// See [`FlowTable::dump_work_on_this_thread`].
    static DUMP_WORK: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

impl<'a> Dumper<'a, '_> {
    /// Dumps `table` from position `after` (hash hi, cookie), exclusive;
    /// returns the last position if the page filled, else [`NOT_FULL`].
    fn table(&mut self, table: &Table, guard: &Guard, after: (u64, u64)) -> (u64, u64) {
        let ix = table.index(guard);
        let lo = after.0.min(u64::from(u32::MAX));
        self.range(table, ix, lo, 1 << 32, after)
    }

    /// Dumps the hash range `[lo, hi)` of `ix`, following moved buckets.
    fn range(
        &mut self,
        table: &Table,
        ix: &Index,
        lo: u64,
        hi: u64,
        after: (u64, u64),
    ) -> (u64, u64) {
        if lo >= hi {
            return NOT_FULL;
        }
        let b0 = ix.bucket_of(lo as u32);
        let b1 = if hi >= 1 << 32 {
            ix.len()
        } else {
            ix.bucket_of(hi as u32) + 1
        };
        for b in b0..b1.min(ix.len()) {
            // Pages that end inside a bucket come back to it: prefetch what
            // lies ahead of a bucket once, not on every call.
            let at = (std::ptr::from_ref(ix) as usize, b);
            if self.s.prefetched != at {
                self.s.prefetched = at;
                if b + PREFETCH_AHEAD < ix.len() {
                    crate::raw::prefetch(ix.bucket(b + PREFETCH_AHEAD));
                }
                if b + PREFETCH_AHEAD / 2 < ix.len() {
                    ix.prefetch_nodes(&self.ft.slab, b + PREFETCH_AHEAD / 2);
                }
            }
            let (blo, bhi) = (ix.bucket_start(b).max(lo), ix.bucket_start(b + 1).min(hi));
            if blo >= bhi {
                continue;
            }
            if b == b0 {
                match self.resume_in(table, ix, b, hi, after) {
                    Resumed::Full(p) => return p,
                    Resumed::Done => continue,
                    Resumed::No => {}
                }
            }
            self.s.resume = None;
            self.s.ids.clear();
            DUMP_WORK.with(|w| w.set((w.get().0 + 1, w.get().1)));
            if !ix.read_bucket(b, &mut self.s.ids) {
                let succ = ix
                    .successor()
                    .expect("a moved bucket's index has a successor");
                let succ: &Index = succ;
                // Safe to recurse: the successor lives as long as `ix`.
                let p = self.range(table, succ, blo, bhi, after);
                if p != NOT_FULL {
                    return p;
                }
                continue;
            }
            let s = &mut *self.s;
            s.items.clear();
            s.fresh.clear();
            // Only the first bucket of a call can be the one the last page
            // ended in.
            let resume = b == b0 && !s.known.is_empty();
            // `known` is in the order the bucket was read in last time: when
            // the bucket has not changed, each entry is the next one there.
            let mut next_known = 0;
            for &i in &s.ids {
                let n = self.ft.slab.node(i);
                if !n.is_live() {
                    continue;
                }
                let c = n.cookie();
                let known = if !resume {
                    None
                } else if s
                    .known
                    .get(next_known)
                    .is_some_and(|k| k.0 == i && k.1 == c)
                {
                    next_known += 1;
                    Some(&s.known[next_known - 1])
                } else {
                    s.known.iter().find(|k| k.0 == i && k.1 == c)
                };
                let h = match known {
                    Some(k) => k.2,
                    None => (self.ft.hash_forward(table, &n) >> 32) as u32,
                };
                s.fresh.push((i, c, h));
                let h = u64::from(h);
                if h < blo || h >= bhi || (h, c) <= after {
                    continue;
                }
                s.items.push((h as u32, c, i));
            }
            s.items.sort_unstable();
            for k in 0..self.s.items.len() {
                let (h, c, i) = self.s.items[k];
                if self.emit(self.ft.slab.node(i), c) {
                    std::mem::swap(&mut self.s.known, &mut self.s.fresh);
                    let at = (u64::from(h), c);
                    self.s.resume = (self.dump != 0)
                        .then(|| Resume::new(self.dump, table, ix, b, hi, at, k + 1));
                    return at;
                }
            }
        }
        NOT_FULL
    }

    /// Lists tenant `t`, which shares `table`, after position `after`
    /// (hash hi, cookie), exclusive, from its expiry references instead of
    /// a walk (see [`FlowTable::list_by_refs`]); returns the last position
    /// if the page filled, else [`NOT_FULL`]. The order is the walk's, so a
    /// dump may take either way on any page.
    ///
    /// Exact for the same reason `remove_tenant` finds every entry: under
    /// the maintenance lock every live entry of a tenant is referenced from
    /// a filing list or its wheel. Filing the lists first (the work the
    /// next `expire` would do) leaves the wheel alone to read: an entry
    /// present since the dump began was filed by this or an earlier page,
    /// and a live entry only ever moves between slots under the wheel's
    /// lock, where it is read. Entries inserted since the filing are not
    /// listed, which the dump allows (added meanwhile).
    fn refs(&mut self, t: &Tenant, table: &Table, after: (u64, u64)) -> (u64, u64) {
        let ft = self.ft;
        {
            let mut m = ft.maint.lock();
            // The directory as of now, under the lock that changes it, not
            // the page's: filing drops references of tenants it does not
            // know, and a tenant added since the page began has some.
            let guard = epoch::pin();
            ft.drain_new(ft.tenants.load(&guard), ft.near(), &mut m);
        }
        let s = &mut *self.s;
        s.resume = None;
        s.items.clear();
        let mut read = 0;
        t.wheel.lock().for_each_ref(|slot, i| {
            read += 1;
            let n = ft.slab.node(i);
            if n.is_live() && n.tenant() == t.id.0 && n.filed_slot() == slot {
                s.items.push((0, n.cookie(), i));
            }
        });
        DUMP_WORK.with(|w| w.set((w.get().0, w.get().1 + read)));
        // Hashed outside the wheel's lock, as a walk hashes what it read: a
        // node reused since shows another cookie and is not emitted.
        for it in &mut s.items {
            it.0 = (ft.hash_forward(table, &ft.slab.node(it.2)) >> 32) as u32;
        }
        s.items.retain(|&(h, c, _)| (u64::from(h), c) > after);
        // A refiled entry may be referenced from two slots.
        s.items.sort_unstable();
        s.items.dedup();
        for k in 0..self.s.items.len() {
            let (h, c, i) = self.s.items[k];
            if self.emit(ft.slab.node(i), c) {
                return (u64::from(h), c);
            }
        }
        NOT_FULL
    }

    /// The O(1) resume straight from the cursor, before any of the walk's
    /// set-up: when this dump's last page on this thread ended at `after`
    /// in `table`, lists on from there through the rest of that bucket's
    /// sorted entries (see [`Resume`]). A page of one entry is then a pin,
    /// a check and a snapshot (-9 ns of ~135 per entry at 10M).
    ///
    /// Why the index need not be the one the bucket was read from: the
    /// order is by (hash, cookie), the same in every index, and the rest
    /// of the sorted list holds every entry of that hash range after
    /// `after` that was present when it was read. So listing it is exact
    /// across a resize too, and where it ends the walk resumes by hash.
    ///
    /// `Ok`: the page filled, at this position. `Err`: go on with the walk
    /// after this position (`after`, or the last entry listed here; the
    /// remembered position then stands at the bucket's end, so the walk
    /// moves straight to the next bucket when the index is the same).
    fn resume_here(&mut self, order: u64, after: (u64, u64)) -> Result<(u64, u64), (u64, u64)> {
        let Some(r) = self.s.resume else {
            return Err(after);
        };
        if r.dump != self.dump || r.order != order || r.at != after {
            return Err(after);
        }
        self.list_from(r)
    }

    /// Lists the remembered bucket's sorted entries from `r.pos` on and
    /// keeps the remembered place up to date. `Ok`: the page filled, at
    /// this position. `Err`: the list ran out, after this position (the
    /// remembered place then stands at its end).
    // Inlined into both callers: as a call of its own it cost a page of
    // one ~15 ns per entry at 10M (`weir-bench ops --op dump`, A/B).
    #[inline(always)]
    fn list_from(&mut self, r: Resume) -> Result<(u64, u64), (u64, u64)> {
        let mut at = r.at;
        for k in r.pos..self.s.items.len() {
            let (h, c, i) = self.s.items[k];
            let n = self.ft.slab.node(i);
            if !n.is_live() {
                continue; // removed since the bucket was sorted
            }
            at = (u64::from(h), c);
            if self.emit(n, c) {
                if let Some(&(_, _, j)) = self.s.items.get(k + 1) {
                    self.ft.slab.node(j).prefetch_all();
                }
                self.s.resume = Some(Resume {
                    at,
                    pos: k + 1,
                    ..r
                });
                return Ok(at);
            }
        }
        self.s.resume = Some(Resume {
            at,
            pos: self.s.items.len(),
            ..r
        });
        Err(at)
    }

    /// The O(1) resume (see [`Resume`]): if the last page ended in bucket
    /// `b` of `ix` at `after`, lists on from where it stopped without
    /// reading the bucket, rehashing or sorting.
    fn resume_in(
        &mut self,
        table: &Table,
        ix: &Index,
        b: usize,
        hi: u64,
        after: (u64, u64),
    ) -> Resumed {
        let Some(r) = self.s.resume else {
            return Resumed::No;
        };
        if r != Resume::new(self.dump, table, ix, b, hi, after, r.pos) {
            return Resumed::No;
        }
        match self.list_from(r) {
            Ok(at) => Resumed::Full(at),
            Err(_) => Resumed::Done,
        }
    }

    /// Emits node `n` if it passes the filter; `true` when the page is full.
    fn emit(&mut self, n: Node<'a>, cookie: u64) -> bool {
        let tid = n.tenant();
        if !passes(self.filter, &n) {
            return false;
        }
        if self.cached.is_none_or(|t| t.id.0 != tid) {
            self.cached = self.map.map.get(&tid);
        }
        let Some(t) = self.cached else { return false };
        let snap = n.snapshot_of(cookie, self.ft.near(), |s, p| t.timeout(s, p));
        // Recycled under us, or moved out of the filter (its state, or a
        // template's backend) since `passes` read the node: the copy is
        // what is listed, so the copy must pass.
        let Some(s) = snap.filter(|s| self.filter.matches(s)) else {
            return false;
        };
        self.out.push(s);
        self.emitted += 1;
        self.emitted == self.limit
    }
}

/// Whether node `n` passes dump filter `f`.
#[inline(always)]
fn passes(f: &DumpFilter, n: &Node<'_>) -> bool {
    !(f.tenant.is_some_and(|t| t.0 != n.tenant())
        || f.service.is_some_and(|v| v != n.service())
        || f.backend.is_some_and(|v| v != n.backend())
        || f.state.is_some_and(|v| v != n.state()))
}

#[allow(dead_code)]
const _UNFILED_FITS: () = assert!(UNFILED as u64 > crate::wheel::SLOTS);

#[cfg(test)]
mod tests {
    use super::*;

    /// Where a test stops an operation to run another in between.
    #[derive(Copy, Clone, PartialEq, Eq, Debug)]
    pub(super) enum Pause {
        /// `reserve_for` has taken budget and not yet recorded it.
        Reserved,
        /// A removal by key has found its tenant and not yet looked for
        /// the key.
        Removing,
    }

    type Hook = Box<dyn Fn(Pause) + Send + Sync>;

    /// A test's hook, run (on the operation's own thread) at every
    /// [`Pause`] point: one interleaving, forced, without sleeps.
    #[derive(Default)]
    pub(super) struct Hooks(Mutex<Option<Arc<Hook>>>);

    impl std::fmt::Debug for Hooks {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Hooks")
        }
    }

    impl Hooks {
        pub(super) fn at(&self, p: Pause) {
            // Cloned out so the hook may run table operations that reach
            // a pause point themselves.
            let h = self.0.lock().clone();
            if let Some(h) = h {
                h(p);
            }
        }

        fn set(&self, h: impl Fn(Pause) + Send + Sync + 'static) {
            *self.0.lock() = Some(Arc::new(Box::new(h)));
        }
    }

    fn key(tenant: u32, i: u32) -> FlowKey {
        FlowKey {
            tenant: TenantId(tenant),
            proto: Proto::Tcp,
            client: std::net::SocketAddr::from(([10, 0, (i >> 8) as u8, i as u8], 40000)),
            virt: "192.0.2.1:80".parse().unwrap(),
        }
    }

    fn init() -> FlowInit<'static> {
        FlowInit {
            service: ServiceId(1),
            backend: BackendId(1),
            state: FlowState::Established,
            owner: 0,
            profile: ProfileRef::NONE,
        }
    }

    fn table() -> Arc<FlowTable> {
        Arc::new(FlowTable::new(TableConfig {
            shared_buckets: 1024,
            memory_budget: 1 << 24,
            seed: Some(31),
            ..TableConfig::default()
        }))
    }

    /// Fills tenant `id`'s own table past its load to grow at, so that the
    /// next `maintain` reserves budget for a resize.
    fn crowd(ft: &FlowTable, id: u32) {
        let buckets = ft.tenant_stats(TenantId(id)).unwrap().buckets;
        for i in 0..(buckets * crate::index::WAYS) as u32 * 15 / 16 {
            // A few may find their chain full; the load is what counts.
            let _ = ft.insert(key(id, i), init(), Millis(0));
        }
    }

    /// A table holding tenant 1 with an own table of 64 buckets, crowded
    /// and maintained until a resize reserved budget for it; `then` runs
    /// (on the reserving thread) the first time one has taken the budget
    /// and not yet recorded it against the tenant.
    fn reserving_then(then: impl Fn(&FlowTable) + Send + Sync + 'static) -> Arc<FlowTable> {
        let ft = table();
        let own = TenantConfig {
            own_buckets: 64,
            ..TenantConfig::default()
        };
        ft.add_tenant(TenantId(1), own).unwrap();
        assert_eq!(ft.own_bytes.load(Relaxed), Table::bytes_for(64));
        let done = Arc::new(AtomicBool::new(false));
        let weak = Arc::downgrade(&ft);
        let d = Arc::clone(&done);
        ft.hooks.set(move |p| {
            if p == Pause::Reserved && !d.swap(true, SeqCst) {
                then(&weak.upgrade().unwrap());
            }
        });
        crowd(&ft, 1);
        ft.maintain();
        assert!(done.load(SeqCst), "no resize reserved budget");
        ft
    }

    /// A tenant removed while a resize's budget is taken but not yet
    /// recorded against it (by an insert that found its bucket crowded, or
    /// by `maintain`, which looked the tenant up before the removal): the
    /// table's own budget comes back to where it started.
    #[test]
    fn a_reservation_racing_the_tenants_removal_gives_the_budget_back() {
        let ft = reserving_then(|ft| {
            ft.remove_tenant(TenantId(1), &mut Vec::new()).unwrap();
        });
        assert!(ft.tenants().is_empty());
        assert_eq!(
            ft.own_bytes.load(Relaxed),
            0,
            "own budget leaked by the removed tenant's resize"
        );
    }

    /// A resize's budget taken while another resize of the table starts
    /// (two writers found the table crowded at once): the one that did not
    /// start gives its budget back at once, not when the tenant goes.
    #[test]
    fn a_reservation_for_a_resize_that_did_not_start_is_given_back() {
        let ft = reserving_then(|ft| {
            // The other writer's resize, which reserves nothing here.
            let g = epoch::pin();
            let t = Arc::clone(&ft.tenants.load(&g).map[&1]);
            let n = t.table.index(&g).len();
            assert!(t.table.start_resize(&g, 2 * n));
        });
        assert_eq!(
            ft.own_bytes.load(Relaxed),
            Table::bytes_for(64),
            "budget kept for a resize that never started"
        );
        ft.remove_tenant(TenantId(1), &mut Vec::new()).unwrap();
        assert_eq!(ft.own_bytes.load(Relaxed), 0);
    }

    /// A removal by key that found its tenant before the tenant was
    /// removed and its id added again (allowed here; the daemon never
    /// reuses an id) leaves the new tenant's entry count exact. It used to
    /// go on with the old tenant: it found the new tenant's entry under the
    /// same key in the shared table, removed it and took it off the old
    /// tenant's count, and the new tenant counted an entry it did not hold
    /// for good.
    #[test]
    fn a_removal_that_began_before_its_tenant_was_added_again_keeps_the_count() {
        let ft = table();
        ft.add_tenant(TenantId(5), TenantConfig::default()).unwrap();
        ft.insert(key(5, 1), init(), Millis(0)).unwrap();
        let again: Arc<Mutex<Option<std::thread::JoinHandle<()>>>> = Arc::default();
        let weak = Arc::downgrade(&ft);
        let a = Arc::clone(&again);
        ft.hooks.set(move |p| {
            if p != Pause::Removing || a.lock().is_some() {
                return;
            }
            let ft = weak.upgrade().unwrap();
            let mut out = Vec::new();
            ft.remove_tenant(TenantId(5), &mut out).unwrap();
            assert_eq!(out.len(), 1);
            // Added again with the same key's entry, on a thread of its
            // own: it may wait for this removal (pinned) to end.
            let b = {
                let ft = Arc::clone(&ft);
                std::thread::spawn(move || {
                    ft.add_tenant(TenantId(5), TenantConfig::default()).unwrap();
                    ft.insert(key(5, 1), init(), Millis(0)).unwrap();
                })
            };
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !b.is_finished() && ft.readds_waited.load(SeqCst) == 0 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the add neither ended nor waited"
                );
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            *a.lock() = Some(b);
        });
        let removed = ft.remove(&key(5, 1));
        let b = again.lock().take().expect("the removal never paused");
        b.join().unwrap();
        let held = usize::from(ft.get(&key(5, 1)).is_some());
        let counted = ft.tenant_stats(TenantId(5)).unwrap().entries;
        assert_eq!(
            counted, held as u64,
            "tenant 5 (added again) counts {counted} entries and holds {held} (the removal \
             that began before: {removed:?})"
        );
    }

    /// Entry `i` of the recycling test: service, backend and owner all
    /// follow from `i`, so a snapshot that mixes two entries shows.
    fn whole(i: u32) -> (FlowKey, ServiceId, BackendId, u32) {
        (key(1, i), ServiceId(100 + i), BackendId(200 + i), 300 + i)
    }

    fn whole_init(i: u32) -> FlowInit<'static> {
        let (_, service, backend, owner) = whole(i);
        FlowInit {
            service,
            backend,
            owner,
            ..init()
        }
    }

    /// A dump page that goes on from the remembered bucket without the
    /// epoch pin (`resume_quick`) snapshots a node whose entry is removed,
    /// and the node reused for a new entry, in the middle of the copy
    /// (forced at that point, after the entry's cookie is read): the entry
    /// is gone, so it is not listed, and in particular not as the old
    /// key and cookie with the new entry's service, backend and owner.
    /// Every entry present for the whole dump is still listed once.
    #[test]
    fn a_node_recycled_in_the_middle_of_an_unpinned_snapshot_is_not_listed() {
        use std::cell::Cell;
        use std::collections::HashMap;
        use std::rc::Rc;
        // One bucket holds them all, so every page after the first goes
        // on from the remembered bucket.
        let ft = Arc::new(FlowTable::new(TableConfig {
            shared_buckets: 8,
            seed: Some(31),
            ..TableConfig::default()
        }));
        ft.add_tenant(TenantId(1), TenantConfig::default()).unwrap();
        let want = Rc::new(Mutex::new(HashMap::new()));
        for i in 0..6 {
            let c = ft.insert(key(1, i), whole_init(i), Millis(0)).unwrap();
            want.lock().insert(c, whole(i));
        }
        let present: Vec<Cookie> = want.lock().keys().copied().collect();
        let filter = DumpFilter::default();
        let mut cur = None;
        let mut seen = Vec::new();
        assert!(ft.dump_page(&mut cur, &filter, 1, &mut seen));
        // The next snapshot this thread takes is the second page's.
        let reused = Rc::new(Cell::new(None));
        let (ft2, want2, reused2) = (Arc::clone(&ft), Rc::clone(&want), Rc::clone(&reused));
        crate::node::MID_SNAPSHOT.set(Some(Box::new(move |idx| {
            let old = Cookie(ft2.slab.node(idx).cookie());
            assert!(ft2.remove_handle(FlowTable::handle_of(old)).is_some());
            // Churn until the node, past its grace period, holds a new
            // entry (this thread's node cache hands it out again once
            // its batch of removed nodes is freed).
            for i in 1000..11_000 {
                let h = ft2
                    .insert_handle(key(1, i), whole_init(i), Millis(0))
                    .unwrap();
                want2.lock().insert(h.cookie, whole(i));
                if h.idx == idx {
                    reused2.set(Some(old));
                    return;
                }
                assert!(ft2.remove_handle(h).is_some());
                reclaim_now();
            }
            panic!("node {idx} was not reused (is the page pinned?)");
        })));
        let mut pages = 1;
        while ft.dump_page(&mut cur, &filter, 1, &mut seen) {
            pages += 1;
            assert!(pages < 100, "the dump does not end");
        }
        let old = reused.get().expect("no snapshot was interrupted");
        let want = want.lock();
        for s in &seen {
            assert_eq!(
                Some(&(s.key, s.service, s.backend, s.owner)),
                want.get(&s.cookie),
                "a listed snapshot is not one entry's whole (cookie {})",
                s.cookie
            );
        }
        for c in present {
            let n = seen.iter().filter(|s| s.cookie == c).count();
            assert_eq!(n, usize::from(c != old), "entry {c} listed {n} times");
        }
    }

    /// A filtered dump lists a copy only if the copy passes the filter:
    /// the filter is read off the node before the copy, and a template
    /// rebound to another backend in between was listed under the old
    /// backend's filter with the new backend (a state filter, with a state
    /// that moved on, the same).
    #[test]
    fn a_filtered_dump_lists_only_copies_that_pass_the_filter() {
        let ft = table();
        ft.add_tenant(TenantId(1), TenantConfig::default()).unwrap();
        let tpl = FlowInit {
            state: FlowState::Persist,
            backend: BackendId(7),
            ..init()
        };
        ft.insert(key(1, 1), tpl, Millis(0)).unwrap();
        let rebound = Arc::new(AtomicUsize::new(0));
        let (ft2, r2) = (Arc::clone(&ft), Arc::clone(&rebound));
        crate::node::MID_SNAPSHOT.set(Some(Box::new(move |_| {
            assert!(ft2.rebind(&key(1, 1), BackendId(8), Millis(0)));
            r2.fetch_add(1, SeqCst);
        })));
        let filter = DumpFilter {
            backend: Some(BackendId(7)),
            ..DumpFilter::default()
        };
        let mut out = Vec::new();
        ft.dump(None, &filter, 10, &mut out);
        assert_eq!(rebound.load(SeqCst), 1, "the copy was not interrupted");
        assert!(out.iter().all(|s| filter.matches(s)), "{out:?}");
        crate::node::MID_SNAPSHOT.set(None);
    }
}

//! weir's flow table and the peers it races, behind one small trait.
//!
//! Every peer stores the same [`Key`] and [`PeerVal`] and hashes with a
//! [`PeerHasher`]: by default [`Fold`], foldhash's `quality` variant with a
//! per-process random seed (the hash family weir keys its own tables with, so
//! only the table design differs); with `--siphash`, [`Sip`], `std`'s
//! `RandomState` (SipHash-1-3), the peers' own default, as a second view.

use std::hash::BuildHasher;

use dashmap::DashMap;
use parking_lot::Mutex;
use weir_flowtable::{
    BackendId, Dir, FlowInit, FlowState, FlowTable, Millis, ServiceId, TableConfig, TenantConfig,
    TenantId,
};

use super::harness::{Key, PeerVal};

/// The hasher every peer (and the hashbrown ceiling) is built with.
pub(crate) trait PeerHasher:
    BuildHasher + Clone + Default + Send + Sync + std::fmt::Debug + 'static
{
    /// Name printed and written to JSON (`hasher`).
    const NAME: &'static str;
}

/// foldhash `quality`, random per-process seed: weir's hash family.
pub(crate) type Fold = foldhash::quality::RandomState;
/// `std`'s SipHash-1-3 `RandomState`, keyed per process.
pub(crate) type Sip = std::collections::hash_map::RandomState;

impl PeerHasher for Fold {
    const NAME: &'static str = "foldhash";
}

impl PeerHasher for Sip {
    const NAME: &'static str = "siphash";
}

/// One thread's handle on a map: concurrent maps hand out `&Map`, the
/// single-threaded ceiling hands out `&mut HashMap`.
pub(crate) trait Ops {
    /// Inserts; true if the key was new.
    fn insert(&mut self, k: Key, v: PeerVal) -> bool;
    /// Looks up and reads one field (the backend), as the data path does.
    fn get(&mut self, k: &Key) -> Option<u32>;
    /// Removes; true if the key was present.
    fn remove(&mut self, k: &Key) -> bool;
}

/// A map many threads use through `&self`.
pub(crate) trait ConcMap: Sync {
    fn c_insert(&self, k: Key, v: PeerVal) -> bool;
    fn c_get(&self, k: &Key) -> Option<u32>;
    fn c_remove(&self, k: &Key) -> bool;
    /// Bytes the map accounts for itself, where it reports it.
    fn c_memory(&self) -> Option<usize> {
        None
    }
}

impl<T: ConcMap> Ops for &T {
    fn insert(&mut self, k: Key, v: PeerVal) -> bool {
        self.c_insert(k, v)
    }
    fn get(&mut self, k: &Key) -> Option<u32> {
        self.c_get(k)
    }
    fn remove(&mut self, k: &Key) -> bool {
        self.c_remove(k)
    }
}

/// weir's flow table with one shared tenant ([`TENANT`](super::TENANT)).
/// Lookups use `lookup` (read-only; the handle and the backend, as the
/// peers return one field) or, with `touch`, the data path's `touch` (also
/// bumps the entry's counters).
#[derive(Debug)]
pub(crate) struct Weir {
    pub(crate) table: FlowTable,
    touch: bool,
}

impl Weir {
    /// A table whose shared index starts sized for `cap` entries.
    pub(crate) fn new(cap: usize, touch: bool) -> Self {
        let cfg = TableConfig {
            shared_buckets: cap.max(1),
            seed: Some(0x7ab1e),
            ..TableConfig::default()
        };
        let table = FlowTable::new(cfg);
        // A fresh table has no tenants, so this cannot fail.
        let _ = table.add_tenant(TenantId(super::TENANT), TenantConfig::default());
        Self { table, touch }
    }
}

/// weir's entry payload for a peer value.
pub(crate) fn flow_init(v: &PeerVal) -> FlowInit<'static> {
    FlowInit {
        owner: 0,
        profile: weir_flowtable::ProfileRef::NONE,
        service: ServiceId(v.service),
        backend: BackendId(v.backend),
        state: FlowState::Established,
    }
}

impl ConcMap for Weir {
    fn c_insert(&self, k: Key, v: PeerVal) -> bool {
        self.table
            .insert(k, flow_init(&v), Millis(v.created_ms))
            .is_ok()
    }
    fn c_get(&self, k: &Key) -> Option<u32> {
        if self.touch {
            self.table
                .touch(k, Millis(2), Dir::In, 64)
                .map(|(_, b)| b.0)
        } else {
            self.table.lookup(k).map(|(_, b)| b.0)
        }
    }
    fn c_remove(&self, k: &Key) -> bool {
        self.table.remove(k).is_some()
    }
    fn c_memory(&self) -> Option<usize> {
        Some(self.table.memory_bytes())
    }
}

/// `DashMap` with its default shard count (4 x cores rounded up to a power of two).
#[derive(Debug)]
pub(crate) struct Dash<S: PeerHasher>(DashMap<Key, PeerVal, S>);

impl<S: PeerHasher> Dash<S> {
    pub(crate) fn new(cap: usize) -> Self {
        Self(DashMap::with_capacity_and_hasher(cap, S::default()))
    }
}

impl<S: PeerHasher> ConcMap for Dash<S> {
    fn c_insert(&self, k: Key, v: PeerVal) -> bool {
        self.0.insert(k, v).is_none()
    }
    fn c_get(&self, k: &Key) -> Option<u32> {
        self.0.get(k).map(|r| r.backend)
    }
    fn c_remove(&self, k: &Key) -> bool {
        self.0.remove(k).is_some()
    }
}

/// `papaya::HashMap`; each operation pins (enters seize) on its own.
#[derive(Debug)]
pub(crate) struct Papaya<S: PeerHasher>(papaya::HashMap<Key, PeerVal, S>);

impl<S: PeerHasher> Papaya<S> {
    pub(crate) fn new(cap: usize) -> Self {
        Self(papaya::HashMap::with_capacity_and_hasher(cap, S::default()))
    }
}

impl<S: PeerHasher> ConcMap for Papaya<S> {
    fn c_insert(&self, k: Key, v: PeerVal) -> bool {
        self.0.pin().insert(k, v).is_none()
    }
    fn c_get(&self, k: &Key) -> Option<u32> {
        self.0.pin().get(k).map(|v| v.backend)
    }
    fn c_remove(&self, k: &Key) -> bool {
        self.0.pin().remove(k).is_some()
    }
}

/// `scc::HashMap` (sync API).
#[derive(Debug)]
pub(crate) struct Scc<S: PeerHasher>(scc::HashMap<Key, PeerVal, S>);

impl<S: PeerHasher> Scc<S> {
    pub(crate) fn new(cap: usize) -> Self {
        Self(scc::HashMap::with_capacity_and_hasher(cap, S::default()))
    }
}

impl<S: PeerHasher> ConcMap for Scc<S> {
    fn c_insert(&self, k: Key, v: PeerVal) -> bool {
        self.0.insert(k, v).is_ok()
    }
    fn c_get(&self, k: &Key) -> Option<u32> {
        self.0.read(k, |_, v| v.backend)
    }
    fn c_remove(&self, k: &Key) -> bool {
        self.0.remove(k).is_some()
    }
}

/// Number of stripes of [`Striped`]: a power of two, well above the core count.
pub(crate) const STRIPES: usize = 64;

/// One stripe on its own cache lines (128 B: adjacent-line prefetch pairs lines).
#[repr(align(128))]
#[derive(Debug, Default)]
struct Stripe(Mutex<hashbrown::HashTable<(Key, PeerVal)>>);

/// `STRIPES` x `parking_lot::Mutex<hashbrown::HashTable>`; the hash computed
/// once per operation, its middle bits pick the stripe.
#[derive(Debug)]
pub(crate) struct Striped<S> {
    hasher: S,
    stripes: Box<[Stripe]>,
}

impl<S: PeerHasher> Striped<S> {
    pub(crate) fn new(cap: usize) -> Self {
        let stripes = (0..STRIPES)
            .map(|_| {
                Stripe(Mutex::new(hashbrown::HashTable::with_capacity(
                    cap / STRIPES + 1,
                )))
            })
            .collect();
        Self {
            hasher: S::default(),
            stripes,
        }
    }

    fn stripe(&self, h: u64) -> &Mutex<hashbrown::HashTable<(Key, PeerVal)>> {
        const { assert!(STRIPES.is_power_of_two()) };
        // Bits 40.. : hashbrown uses the low bits (bucket) and the top 7 (tag)
        // of the same hash, so taking either for the stripe would skew every stripe.
        &self.stripes[(h >> 40) as usize & (STRIPES - 1)].0
    }
}

impl<S: PeerHasher> ConcMap for Striped<S> {
    fn c_insert(&self, k: Key, v: PeerVal) -> bool {
        let h = self.hasher.hash_one(k);
        let mut t = self.stripe(h).lock();
        if t.find(h, |e| e.0 == k).is_some() {
            return false;
        }
        t.insert_unique(h, (k, v), |e| self.hasher.hash_one(e.0));
        true
    }
    fn c_get(&self, k: &Key) -> Option<u32> {
        let h = self.hasher.hash_one(k);
        self.stripe(h)
            .lock()
            .find(h, |e| e.0 == *k)
            .map(|e| e.1.backend)
    }
    fn c_remove(&self, k: &Key) -> bool {
        let h = self.hasher.hash_one(k);
        match self.stripe(h).lock().find_entry(h, |e| e.0 == *k) {
            Ok(e) => {
                e.remove();
                true
            }
            Err(_) => false,
        }
    }
}

/// The ceiling: one thread, no lock, hashbrown with the peers' hasher.
pub(crate) type Ceiling<S> = hashbrown::HashMap<Key, PeerVal, S>;

impl<S: PeerHasher> Ops for &mut Ceiling<S> {
    fn insert(&mut self, k: Key, v: PeerVal) -> bool {
        hashbrown::HashMap::insert(self, k, v).is_none()
    }
    fn get(&mut self, k: &Key) -> Option<u32> {
        hashbrown::HashMap::get(self, k).map(|v| v.backend)
    }
    fn remove(&mut self, k: &Key) -> bool {
        hashbrown::HashMap::remove(self, k).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::super::harness::key;
    use super::*;

    fn exercise(mut m: impl Ops) {
        for i in 0..2000 {
            assert!(m.insert(key(1, i), PeerVal::for_idx(i)));
        }
        assert!(!m.insert(key(1, 5), PeerVal::for_idx(5)));
        assert_eq!(m.get(&key(1, 7)), Some(7));
        assert_eq!(m.get(&key(1, 5000)), None);
        assert!(m.remove(&key(1, 7)));
        assert!(!m.remove(&key(1, 7)));
        assert_eq!(m.get(&key(1, 7)), None);
    }

    #[test]
    fn every_peer_behaves_as_a_map() {
        // Sized for fewer entries than inserted: the table grows online.
        exercise(&Weir::new(256, false));
        exercise(&Weir::new(256, true));
        exercise(&Dash::<Fold>::new(16));
        exercise(&Papaya::<Fold>::new(16));
        exercise(&Scc::<Fold>::new(16));
        exercise(&Striped::<Fold>::new(16));
        exercise(&mut Ceiling::<Fold>::default());
        exercise(&Dash::<Sip>::new(16));
        exercise(&Papaya::<Sip>::new(16));
        exercise(&Scc::<Sip>::new(16));
        exercise(&Striped::<Sip>::new(16));
        exercise(&mut Ceiling::<Sip>::default());
    }
}

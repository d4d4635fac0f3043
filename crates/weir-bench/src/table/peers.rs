//! weir's flow table and the peers it races, behind one small trait.
//!
//! Every peer stores the same [`Key`] and [`PeerVal`] and uses its default
//! hasher: `std`'s `RandomState` (SipHash-1-3, keyed per process) for dashmap,
//! papaya, scc and the striped map; foldhash (hashbrown's default, seeded but
//! not collision-resistant) for the single-threaded hashbrown ceiling.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

use dashmap::DashMap;
use parking_lot::Mutex;
use weir_flowtable::{
    BackendId, Dir, FlowInit, FlowState, FlowTable, Millis, ServiceId, TableConfig, TenantConfig,
    TenantId,
};

use super::harness::{Key, PeerVal};

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
/// Lookups use `get` (read-only, returns a snapshot) or, with `touch`, the
/// data path's `touch` (also bumps the entry's counters).
#[derive(Debug)]
pub(crate) struct Weir {
    pub(crate) table: FlowTable,
    touch: bool,
}

impl Weir {
    /// A table whose shared index starts sized for `next_power_of_two(cap)` entries.
    pub(crate) fn new(cap: usize, touch: bool) -> Self {
        let cfg = TableConfig {
            shared_buckets: cap.max(1).next_power_of_two(),
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
pub(crate) fn flow_init(v: &PeerVal) -> FlowInit {
    FlowInit {
        owner: 0,
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
            self.table.get(k).map(|s| s.backend.0)
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
pub(crate) struct Dash(DashMap<Key, PeerVal>);

impl Dash {
    pub(crate) fn new(cap: usize) -> Self {
        Self(DashMap::with_capacity(cap))
    }
}

impl ConcMap for Dash {
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
pub(crate) struct Papaya(papaya::HashMap<Key, PeerVal>);

impl Papaya {
    pub(crate) fn new(cap: usize) -> Self {
        Self(papaya::HashMap::with_capacity(cap))
    }
}

impl ConcMap for Papaya {
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
pub(crate) struct Scc(scc::HashMap<Key, PeerVal>);

impl Scc {
    pub(crate) fn new(cap: usize) -> Self {
        Self(scc::HashMap::with_capacity(cap))
    }
}

impl ConcMap for Scc {
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

/// `STRIPES` x `parking_lot::Mutex<hashbrown::HashTable>`; SipHash computed
/// once per operation, its middle bits pick the stripe.
#[derive(Debug)]
pub(crate) struct Striped {
    hasher: RandomState,
    stripes: Box<[Stripe]>,
}

impl Striped {
    pub(crate) fn new(cap: usize) -> Self {
        let stripes = (0..STRIPES)
            .map(|_| {
                Stripe(Mutex::new(hashbrown::HashTable::with_capacity(
                    cap / STRIPES + 1,
                )))
            })
            .collect();
        Self {
            hasher: RandomState::new(),
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

impl ConcMap for Striped {
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

/// The ceiling: one thread, no lock, hashbrown with its default hasher.
pub(crate) type Ceiling = hashbrown::HashMap<Key, PeerVal>;

impl Ops for &mut Ceiling {
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
        // weir's table does not grow: size it for the 2,000 entries.
        exercise(&Weir::new(2048, false));
        exercise(&Weir::new(2048, true));
        exercise(&Dash::new(16));
        exercise(&Papaya::new(16));
        exercise(&Scc::new(16));
        exercise(&Striped::new(16));
        exercise(&mut Ceiling::default());
    }
}

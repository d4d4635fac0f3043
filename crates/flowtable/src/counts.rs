//! Tenants' entry counts: one counter per tenant and thread slot, packed
//! so that a tenant costs 64 bytes of counters rather than a cache line
//! per slot.
//!
//! Each tenant's count is split over the [`NODE_CACHES`] thread slots so
//! that threads inserting for the same tenant do not pass one cache line
//! between them. A padded line per tenant and slot did that at 1 KiB per
//! tenant, 63% of an empty tenant's 1,624 bytes (docs/BENCHMARKS.md, "Many
//! tenants"). Here the counters of [`PER_GROUP`] tenants sit side by side,
//! slot by slot (Linux's per-CPU counters' layout): a line holds eight
//! tenants' counters of one slot, so it is written from that slot's
//! threads only, as a padded line was, and a tenant's own counters cost
//! `8 x 8` bytes.
//!
//! A tenant's place is taken from a free list when the tenant is made and
//! given back when its [`TenantCount`] is dropped, that is when nothing can
//! add to it any more (the tenant's last `Arc` went): a place is never
//! shared by two tenants, and a new tenant's counters start at zero.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

use parking_lot::Mutex;

use crate::table::{NODE_CACHES, thread_slot};

/// Tenants per group of counters: a group is `NODE_CACHES x PER_GROUP`
/// counters, 8 KiB.
pub(crate) const PER_GROUP: usize = 128;

/// The counters of [`PER_GROUP`] tenants, slot-major: slot `s`'s counter
/// of the tenant at `off` is `c[s * PER_GROUP + off]`.
#[derive(Debug)]
struct Group {
    c: Box<[AtomicI64]>,
}

impl Group {
    fn new() -> Self {
        Self {
            c: (0..NODE_CACHES * PER_GROUP)
                .map(|_| AtomicI64::new(0))
                .collect(),
        }
    }
}

#[derive(Debug, Default)]
struct Places {
    groups: Vec<Arc<Group>>,
    /// Places given back: (group, offset).
    free: Vec<(u32, u16)>,
    /// Places of the last group not handed out yet start here.
    fill: usize,
}

/// Where a table's tenants keep their counts (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Counts {
    places: Mutex<Places>,
}

impl Counts {
    /// A new tenant's count, at zero.
    pub(crate) fn take(self: &Arc<Self>) -> TenantCount {
        let mut p = self.places.lock();
        let (gi, off) = match p.free.pop() {
            Some(place) => place,
            None => {
                if p.fill == 0 || p.fill == PER_GROUP {
                    p.groups.push(Arc::new(Group::new()));
                    p.fill = 0;
                }
                let place = ((p.groups.len() - 1) as u32, p.fill as u16);
                p.fill += 1;
                place
            }
        };
        let group = Arc::clone(&p.groups[gi as usize]);
        drop(p);
        // A place given back may hold what its last tenant left (a count is
        // only ever exact in its sum); nobody else can reach it now.
        for s in 0..NODE_CACHES {
            group.c[s * PER_GROUP + usize::from(off)].store(0, Relaxed);
        }
        TenantCount {
            counts: Arc::clone(self),
            group,
            gi,
            off,
        }
    }

    /// Bytes of counters held (every group, used or not).
    pub(crate) fn memory_bytes(&self) -> usize {
        let p = self.places.lock();
        p.groups.len() * NODE_CACHES * PER_GROUP * std::mem::size_of::<AtomicI64>()
            + p.free.capacity() * std::mem::size_of::<(u32, u16)>()
    }

    /// Places handed out and not given back (tests).
    #[cfg(test)]
    fn in_use(&self) -> usize {
        let p = self.places.lock();
        p.groups.len().saturating_sub(1) * PER_GROUP + p.fill - p.free.len()
    }
}

/// One tenant's entry count: its place among [`Counts`]' counters, given
/// back when dropped.
#[derive(Debug)]
pub(crate) struct TenantCount {
    counts: Arc<Counts>,
    group: Arc<Group>,
    gi: u32,
    off: u16,
}

impl TenantCount {
    /// Adds `d` on this thread's slot.
    #[inline]
    pub(crate) fn add(&self, d: i64) {
        self.group.c[thread_slot() * PER_GROUP + usize::from(self.off)].fetch_add(d, Relaxed);
    }

    /// The count: the sum over the slots (exact once the adds it should
    /// see have happened; never below zero).
    pub(crate) fn get(&self) -> u64 {
        let n: i64 = (0..NODE_CACHES)
            .map(|s| self.group.c[s * PER_GROUP + usize::from(self.off)].load(Relaxed))
            .sum();
        n.max(0) as u64
    }
}

impl Drop for TenantCount {
    fn drop(&mut self) {
        self.counts.places.lock().free.push((self.gi, self.off));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_separate_and_places_are_reused_only_after_drop() {
        let counts = Arc::new(Counts::default());
        let many: Vec<TenantCount> = (0..3 * PER_GROUP + 5).map(|_| counts.take()).collect();
        assert_eq!(counts.in_use(), 3 * PER_GROUP + 5);
        // Every tenant its own place.
        let mut places: Vec<(u32, u16)> = many.iter().map(|t| (t.gi, t.off)).collect();
        places.sort_unstable();
        places.dedup();
        assert_eq!(places.len(), many.len());
        for (i, t) in many.iter().enumerate() {
            t.add(i as i64 + 1);
        }
        for (i, t) in many.iter().enumerate() {
            assert_eq!(t.get(), i as u64 + 1, "tenant {i}");
        }
        // A dropped tenant's place goes to the next one, at zero.
        let (gi, off) = (many[7].gi, many[7].off);
        let mut many = many;
        many.remove(7);
        assert_eq!(counts.in_use(), 3 * PER_GROUP + 4);
        let again = counts.take();
        assert_eq!((again.gi, again.off), (gi, off));
        assert_eq!(again.get(), 0);
        again.add(-3);
        assert_eq!(again.get(), 0, "never below zero");
        again.add(5);
        assert_eq!(again.get(), 2);
        assert_eq!(many[7].get(), 9, "the neighbour is untouched");
        assert_eq!(counts.memory_bytes() / (NODE_CACHES * PER_GROUP * 8), 4);
    }

    /// Threads adding for the same tenants from different slots: every
    /// count exact once they are done.
    #[test]
    fn concurrent_adds_sum_exactly() {
        let counts = Arc::new(Counts::default());
        let tenants: Arc<Vec<TenantCount>> = Arc::new((0..300).map(|_| counts.take()).collect());
        let threads: Vec<_> = (0..2 * NODE_CACHES)
            .map(|k| {
                let tenants = Arc::clone(&tenants);
                std::thread::spawn(move || {
                    for round in 0..2_000 {
                        for (i, t) in tenants.iter().enumerate() {
                            if (i + k + round) % 3 == 0 {
                                t.add(2);
                                t.add(-1);
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        for (i, t) in tenants.iter().enumerate() {
            let want: u64 = (0..2 * NODE_CACHES)
                .map(|k| (0..2_000).filter(|round| (i + k + round) % 3 == 0).count() as u64)
                .sum();
            assert_eq!(t.get(), want, "tenant {i}");
        }
    }
}

//! Storage: estimators live in fixed-size chunks that never move.
//!
//! A chunk holds [`CHUNK`] estimators. Each worker has its own [`Shard`] per
//! chunk: a 128-byte aligned array of counter cells written only by that
//! worker, so two workers never write the same cache line (nor the adjacent
//! line the spatial prefetcher pairs it with). Estimator-side state (`last`,
//! `avg`) is written only by the thread running ticks; `base` (the `zero()`
//! snapshot) only by `zero()`, serialised by the `BUSY` flag.

// Field loops index several parallel [_; FIELDS] arrays at once; an index reads best.
#![allow(clippy::needless_range_loop)]

use std::fmt;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use crate::ewma;
use crate::sync::{AtomicU32, AtomicU64};

/// Estimators per chunk: the unit of slot placement (4 under shuttle, to keep
/// the explored state small).
pub(crate) const CHUNK: usize = if cfg!(shuttle) { 4 } else { 256 };
/// Counter fields: conns, inpkts, outpkts, inbytes, outbytes.
pub(crate) const FIELDS: usize = 5;

/// `flags` bits. Only `add` sets `IN_USE` (on a free entry), only the ticker
/// sets `STARTED`, clears `ZERO` and resets an entry to 0; handles set `DEAD`;
/// `zero()` sets `BUSY` and `ZERO`.
pub(crate) const IN_USE: u32 = 1;
pub(crate) const STARTED: u32 = 2;
pub(crate) const DEAD: u32 = 4;
pub(crate) const ZERO: u32 = 8;
pub(crate) const BUSY: u32 = 16;
/// Set by the ticker once the first rate after start or zero is computed.
pub(crate) const SEEDED: u32 = 32;

/// One worker's five counters for one estimator.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct Cell {
    pub(crate) c: [AtomicU64; FIELDS],
}

impl Cell {
    const fn new() -> Self {
        Self {
            c: [const { AtomicU64::new(0) }; FIELDS],
        }
    }
}

/// One worker's cells for a whole chunk. 128-byte alignment (as tokio's
/// `CachePadded` on x86_64) keeps other workers' shards off its lines.
#[repr(C, align(128))]
pub(crate) struct Shard {
    pub(crate) cells: [Cell; CHUNK],
}

/// Estimator-side state, touched by the ticker every period.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct EstState {
    pub(crate) last: [AtomicU64; FIELDS],
    pub(crate) avg: [AtomicU64; FIELDS],
}

impl EstState {
    const fn new() -> Self {
        Self {
            last: [const { AtomicU64::new(0) }; FIELDS],
            avg: [const { AtomicU64::new(0) }; FIELDS],
        }
    }
}

pub(crate) struct Chunk {
    /// Global id of entry 0 (ids are `first_id + index`).
    pub(crate) first_id: u32,
    /// Entries with `IN_USE` set, so the ticker skips empty chunks.
    pub(crate) live: AtomicU32,
    pub(crate) shards: Box<[Shard]>,
    pub(crate) flags: [AtomicU32; CHUNK],
    pub(crate) refs: [AtomicU32; CHUNK],
    pub(crate) est: [EstState; CHUNK],
    pub(crate) base: [[AtomicU64; FIELDS]; CHUNK],
}

impl fmt::Debug for Chunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chunk")
            .field("first_id", &self.first_id)
            .field("live", &self.live.load(Relaxed))
            .finish_non_exhaustive()
    }
}

/// What the ticker did with one chunk.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ChunkWork {
    pub(crate) updated: u64,
    pub(crate) started: u64,
    pub(crate) zeroed: u64,
    pub(crate) freed: u64,
}

impl Chunk {
    pub(crate) fn new(first_id: u32, workers: usize) -> Self {
        let shards = (0..workers)
            .map(|_| Shard {
                cells: [const { Cell::new() }; CHUNK],
            })
            .collect();
        Self {
            first_id,
            live: AtomicU32::new(0),
            shards,
            flags: [const { AtomicU32::new(0) }; CHUNK],
            refs: [const { AtomicU32::new(0) }; CHUNK],
            est: [const { EstState::new() }; CHUNK],
            base: [const { [const { AtomicU64::new(0) }; FIELDS] }; CHUNK],
        }
    }

    /// Heap bytes of one chunk with `workers` shards.
    pub(crate) fn bytes(workers: usize) -> usize {
        size_of::<Self>() + workers * size_of::<Shard>()
    }

    /// Current sum over all workers of entry `i`'s counters.
    #[inline]
    pub(crate) fn sum(&self, i: usize) -> [u64; FIELDS] {
        let mut s = [0u64; FIELDS];
        for sh in self.shards.iter() {
            let c = &sh.cells[i].c;
            for f in 0..FIELDS {
                s[f] = s[f].wrapping_add(c[f].load(Relaxed));
            }
        }
        s
    }

    /// Runs one period's estimation over every entry of the chunk.
    /// `freed` receives the global ids of entries whose handles were all
    /// dropped; they are reset here, before anyone can reuse them.
    pub(crate) fn estimate(&self, warm_start: bool, freed: &mut Vec<u32>) -> ChunkWork {
        let mut w = ChunkWork::default();
        // Sum the workers' shards shard by shard: each is one sequential stream.
        let mut sums = [[0u64; FIELDS]; CHUNK];
        for sh in self.shards.iter() {
            for (s, cell) in sums.iter_mut().zip(sh.cells.iter()) {
                for f in 0..FIELDS {
                    s[f] = s[f].wrapping_add(cell.c[f].load(Relaxed));
                }
            }
        }
        for (i, sum) in sums.iter().enumerate() {
            let flags = &self.flags[i];
            let st = flags.load(Acquire);
            if st & IN_USE == 0 {
                continue;
            }
            let e = &self.est[i];
            if st & DEAD != 0 {
                self.reset(i);
                flags.store(0, Release);
                self.live.fetch_sub(1, Relaxed);
                freed.push(self.first_id + i as u32);
                w.freed += 1;
                continue;
            }
            if st & STARTED == 0 {
                // First visit: the baseline. The first rate follows one full period later.
                for f in 0..FIELDS {
                    e.last[f].store(sum[f], Relaxed);
                    e.avg[f].store(0, Relaxed);
                }
                flags.fetch_and(!(ZERO | SEEDED), Relaxed);
                flags.fetch_or(STARTED, Release);
                w.started += 1;
                continue;
            }
            let mut seeded = st & SEEDED != 0;
            if st & ZERO != 0 {
                if st & BUSY != 0 {
                    // zero() is writing `base`: apply it next period.
                    continue;
                }
                flags.fetch_and(!(ZERO | SEEDED), Acquire);
                seeded = false;
                // As ip_vs_zero_estimator: last = totals at zero time, avg = 0.
                for f in 0..FIELDS {
                    e.last[f].store(self.base[i][f].load(Relaxed), Relaxed);
                    e.avg[f].store(0, Relaxed);
                }
                w.zeroed += 1;
            }
            let seed = warm_start && !seeded;
            for f in 0..FIELDS {
                let last = e.last[f].load(Relaxed);
                let rate = ewma::scaled_rate(sum[f].wrapping_sub(last), ewma::SHIFTS[f]);
                e.last[f].store(sum[f], Relaxed);
                let new = if seed {
                    rate
                } else {
                    ewma::step(e.avg[f].load(Relaxed), rate)
                };
                e.avg[f].store(new, Relaxed);
            }
            if !seeded {
                flags.fetch_or(SEEDED, Relaxed);
            }
            w.updated += 1;
        }
        w
    }

    /// Zeroes entry `i` for reuse. Only the ticker calls this, on a `DEAD`
    /// entry (no handle left, so no worker writes it any more).
    fn reset(&self, i: usize) {
        for sh in self.shards.iter() {
            for c in &sh.cells[i].c {
                c.store(0, Relaxed);
            }
        }
        let e = &self.est[i];
        for f in 0..FIELDS {
            e.last[f].store(0, Relaxed);
            e.avg[f].store(0, Relaxed);
            self.base[i][f].store(0, Relaxed);
        }
    }
}

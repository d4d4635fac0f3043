//! The engine: allocation of estimators, handles, and the slot-based ticker.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::time::Duration;

use crate::chunk::{BUSY, CHUNK, Cell, Chunk, DEAD, FIELDS, IN_USE, STARTED, ZERO};
use crate::sync::{Mutex, fence};
use crate::{Config, ConfigError, ewma};

/// The estimation period: every estimator is visited once per 2 s, as in IPVS.
pub const PERIOD: Duration = Duration::from_secs(2);
const PERIOD_NS: u128 = 2_000_000_000;
/// Longest sleep [`TickReport::next_due`] suggests when slots are empty.
const MAX_SLEEP: Duration = Duration::from_millis(100);
/// Failed `try_lock`s on the allocator after which a tick waits for it.
const MAX_LOCK_MISSES: u32 = 8;

/// A set of rate estimators sharing one ticker. Cheap to clone (an `Arc`);
/// `Send + Sync`: add and read from any thread, tick from one.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    workers: usize,
    cfg: Config,
    alloc: Mutex<Alloc>,
    ticker: Mutex<Ticker>,
}

/// Id allocation. Held briefly by `add` and (with `try_lock`) by the ticker.
struct Alloc {
    /// Every chunk ever created, indexed by `id / CHUNK`.
    chunks: Vec<Arc<Chunk>>,
    /// Ids the ticker has reset and returned.
    free: Vec<u32>,
    /// Next never-used id.
    next: u32,
    /// Chunks created since the ticker last placed them in slots.
    pending: Vec<Arc<Chunk>>,
}

struct Ticker {
    /// `slots[s]` holds the chunks estimated at slot `s` of every period.
    slots: Vec<Vec<Arc<Chunk>>>,
    /// Absolute number (`period * slots + slot`) of the next slot to run.
    next: Option<u64>,
    /// Ids reset by the ticker, not yet handed back to `Alloc`.
    freed: Vec<u32>,
    lock_misses: u32,
    /// Estimated cost of scanning one entry, in nanoseconds.
    cost_ns: f64,
    /// Chunks a slot may hold within `slot_budget`.
    cap_chunks: usize,
}

/// What one call to [`Engine::tick`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TickReport {
    /// Slots holding chunks run by this call (empty due slots are passed
    /// over for free and not counted).
    pub slots_run: u32,
    /// Entries scanned (live chunks x entries per chunk): the work measure the
    /// cost per estimator refers to.
    pub scanned: u64,
    /// Estimators whose rates were updated.
    pub processed: u64,
    /// Estimators that took their baseline (first visit after `add`).
    pub started: u64,
    /// Estimators whose pending `zero()` was applied.
    pub zeroed: u64,
    /// Removed estimators freed for reuse.
    pub freed: u64,
    /// New chunks placed into slots.
    pub placed: u32,
    /// Slots already due that this call left for the next (bounded work per call).
    pub behind: u64,
    /// When to call again, on the caller's clock: the next slot holding
    /// chunks, at most 100 ms ahead (call at once if `behind > 0`). Calling
    /// earlier or later is harmless; slots run when due.
    pub next_due: Duration,
}

/// A snapshot of the engine's shape, for metrics and the benchmark.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct EngineStats {
    /// Estimators added and not yet freed.
    pub estimators: usize,
    /// Chunks allocated (each holds 256 estimators).
    pub chunks: usize,
    /// Tick slots per period.
    pub slots: u32,
    /// Current cost estimate per scanned entry (ns).
    pub cost_ns: f64,
    /// Estimators a slot may hold within the budget.
    pub slot_capacity: usize,
    /// Estimator capacity of the fullest slot.
    pub max_slot_load: usize,
    /// Slots holding more than `slot_capacity`.
    pub overloaded_slots: usize,
    /// Heap bytes held by the chunks.
    pub memory_bytes: usize,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("workers", &self.inner.workers)
            .field("cfg", &self.inner.cfg)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// An engine whose estimators have `workers` counter shards each.
    ///
    /// # Errors
    /// [`ConfigError`] when `workers` or a `cfg` field is out of range.
    pub fn new(workers: usize, cfg: Config) -> Result<Self, ConfigError> {
        cfg.validate(workers)?;
        let ticker = Ticker {
            slots: (0..cfg.slots).map(|_| Vec::new()).collect(),
            next: None,
            freed: Vec::new(),
            lock_misses: 0,
            cost_ns: cfg.estimator_cost_ns,
            cap_chunks: cap_chunks(&cfg, cfg.estimator_cost_ns),
        };
        Ok(Self {
            inner: Arc::new(Inner {
                workers,
                cfg,
                alloc: Mutex::new(Alloc {
                    chunks: Vec::new(),
                    free: Vec::new(),
                    next: 0,
                    pending: Vec::new(),
                }),
                ticker: Mutex::new(ticker),
            }),
        })
    }

    /// Number of worker shards per estimator.
    #[must_use]
    pub fn workers(&self) -> usize {
        self.inner.workers
    }

    /// The configuration the engine runs with.
    #[must_use]
    pub fn config(&self) -> &Config {
        &self.inner.cfg
    }

    /// Adds an estimator; O(1) amortised, callable from any thread.
    ///
    /// Its counters start at zero. The ticker takes its baseline at the first
    /// visit of its slot (at most one period plus one tick later) and its
    /// first rate one full period after that. Dropping the last clone of the
    /// handle removes it; the ticker frees it at its next visit.
    ///
    /// # Panics
    /// If more than `u32::MAX` estimators are live at once (about 800 GB).
    #[must_use]
    pub fn add(&self) -> Estimator {
        let (chunk, idx) = {
            let mut a = self.inner.alloc.lock();
            let id = match a.free.pop() {
                Some(id) => id,
                None => {
                    let id = a.next;
                    a.next = id.checked_add(1).expect("estimator ids exhausted");
                    if (id as usize).is_multiple_of(CHUNK) {
                        let c = Arc::new(Chunk::new(id, self.inner.workers));
                        a.chunks.push(Arc::clone(&c));
                        a.pending.push(c);
                    }
                    id
                }
            };
            let chunk = Arc::clone(&a.chunks[id as usize / CHUNK]);
            (chunk, id as usize % CHUNK)
        };
        chunk.refs[idx].store(1, Relaxed);
        chunk.live.fetch_add(1, Relaxed);
        chunk.flags[idx].store(IN_USE, Release);
        Estimator {
            chunk,
            idx: idx as u32,
        }
    }

    /// Removes an estimator: the same as dropping the handle. Other clones
    /// keep it alive until they are dropped too.
    pub fn remove(&self, est: Estimator) {
        drop(est);
    }

    /// The time at which the next slot is due, on the caller's clock; `None`
    /// before the first [`tick`](Self::tick).
    #[must_use]
    pub fn next_due(&self) -> Option<Duration> {
        let t = self.inner.ticker.lock();
        t.next.map(|n| due(n, self.inner.cfg.slots))
    }

    /// Runs the slots due at `now` (a monotonic time on the caller's clock, e.g.
    /// `Instant::elapsed` of a fixed start). The first call starts the
    /// schedule at the slot containing `now`.
    ///
    /// Bounded work: a call runs the first due slot, then further due slots
    /// (when the thread is late) only while their estimated cost keeps the
    /// call within `slot_budget`, and never more than `max_slots_per_tick`;
    /// [`TickReport::behind`] says what is left. Empty slots are passed over
    /// for free. A caller more than a period late resumes one period back:
    /// each estimator gets one (long) interval instead of replayed periods.
    /// Placement spreads chunks evenly, so one slot is within budget unless
    /// every slot is at capacity ([`EngineStats::overloaded_slots`]; raise
    /// `slots` then). Never blocks on `add`/drop except after 8 consecutive
    /// ticks found the allocator busy.
    pub fn tick(&self, now: Duration) -> TickReport {
        let cfg = &self.inner.cfg;
        let slots = cfg.slots;
        let now_ns = now.as_nanos();
        let mut t = self.inner.ticker.lock();
        let mut r = TickReport::default();
        // The slot containing `now`: every slot up to it is due.
        let current = (now_ns * u128::from(slots) / PERIOD_NS) as u64;
        let mut next = t.next.unwrap_or(current);
        // More than a period late (suspended process, stopped thread): run
        // each slot once rather than replaying missed periods back to back.
        let period = u64::from(slots);
        if current >= next + period {
            next = current + 1 - period;
        }
        let budget = cfg.slot_budget.as_nanos() as f64;
        let mut spent = 0.0;
        while next <= current {
            let s = (next % period) as usize;
            if t.slots[s].is_empty() {
                next += 1; // nothing placed there: free to pass
                continue;
            }
            if r.slots_run >= cfg.max_slots_per_tick {
                break;
            }
            // Catching up: stop before a further slot would exceed the budget.
            let cost = t.slot_cost_ns(s);
            if r.slots_run > 0 && spent + cost > budget {
                break;
            }
            spent += cost;
            t.run_slot(s, cfg, &mut r);
            next += 1;
            r.slots_run += 1;
        }
        t.next = Some(next);
        r.behind = (current + 1).saturating_sub(next);
        t.sync_alloc(&self.inner.alloc, &mut r);
        // Sleep hint: the next slot holding chunks, but never more than
        // MAX_SLEEP ahead, so new estimators are placed and freed ids handed
        // back promptly even when few slots are in use.
        let mut wake = next;
        while wake < next + period && t.slots[(wake % period) as usize].is_empty() {
            wake += 1;
        }
        r.next_due = due(wake, slots).min(due(next, slots).max(now) + MAX_SLEEP);
        r
    }

    /// Feeds back how long a tick took (measured by the caller around
    /// [`tick`](Self::tick)) to re-check the cost per estimator. Ticks that
    /// scanned fewer than one chunk are ignored (fixed overhead dominates).
    /// The estimate moves 1/8 of the way to each sample, a sample counting at
    /// most 16 times the current estimate, so one preempted tick cannot
    /// collapse slot capacity.
    pub fn record_tick(&self, elapsed: Duration, report: &TickReport) {
        if report.scanned < CHUNK as u64 {
            return;
        }
        let mut t = self.inner.ticker.lock();
        let sample = elapsed.as_nanos() as f64 / report.scanned as f64;
        let sample = sample.min(t.cost_ns * 16.0);
        t.cost_ns += (sample - t.cost_ns) / 8.0;
        t.cost_ns = t.cost_ns.max(0.01);
        t.cap_chunks = cap_chunks(&self.inner.cfg, t.cost_ns);
    }

    /// Replaces the cost estimate (e.g. after a new [`Calibrator`](crate::Calibrator) run).
    pub fn set_estimator_cost(&self, cost_ns: f64) {
        let mut t = self.inner.ticker.lock();
        t.cost_ns = cost_ns.max(0.01);
        t.cap_chunks = cap_chunks(&self.inner.cfg, t.cost_ns);
    }

    /// A snapshot of the engine's shape. Takes both locks briefly and scans
    /// the slot table: for metrics, not for the data path.
    #[must_use]
    pub fn stats(&self) -> EngineStats {
        let (estimators, chunks) = {
            let a = self.inner.alloc.lock();
            (a.next as usize - a.free.len(), a.chunks.len())
        };
        let t = self.inner.ticker.lock();
        let max = t.slots.iter().map(Vec::len).max().unwrap_or(0);
        EngineStats {
            estimators,
            chunks,
            slots: self.inner.cfg.slots,
            cost_ns: t.cost_ns,
            slot_capacity: t.cap_chunks * CHUNK,
            max_slot_load: max * CHUNK,
            overloaded_slots: t.slots.iter().filter(|s| s.len() > t.cap_chunks).count(),
            memory_bytes: chunks * Chunk::bytes(self.inner.workers),
        }
    }
}

fn due(n: u64, slots: u32) -> Duration {
    let ns = u128::from(n) * PERIOD_NS / u128::from(slots);
    Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
}

fn cap_chunks(cfg: &Config, cost_ns: f64) -> usize {
    let per_chunk = cost_ns.max(0.01) * CHUNK as f64;
    ((cfg.slot_budget.as_nanos() as f64 / per_chunk) as usize).max(1)
}

impl Ticker {
    fn run_slot(&mut self, s: usize, cfg: &Config, r: &mut TickReport) {
        for c in &self.slots[s] {
            if c.live.load(Acquire) == 0 {
                continue;
            }
            r.scanned += CHUNK as u64;
            let w = c.estimate(cfg.warm_start, &mut self.freed);
            r.processed += w.updated;
            r.started += w.started;
            r.zeroed += w.zeroed;
            r.freed += w.freed;
        }
    }

    /// Estimated work of slot `s` in ns (chunks with live entries x cost).
    fn slot_cost_ns(&self, s: usize) -> f64 {
        let live = self.slots[s]
            .iter()
            .filter(|c| c.live.load(Relaxed) != 0)
            .count();
        live as f64 * CHUNK as f64 * self.cost_ns
    }

    fn least_loaded(&self) -> (usize, usize) {
        let mut best = (0, usize::MAX);
        for (i, s) in self.slots.iter().enumerate() {
            if s.len() < best.1 {
                best = (i, s.len());
            }
        }
        best
    }

    /// Hands freed ids back and takes new chunks, without waiting for `add`.
    fn sync_alloc(&mut self, alloc: &Mutex<Alloc>, r: &mut TickReport) {
        let mut a = match alloc.try_lock() {
            Some(a) => a,
            None if self.lock_misses >= MAX_LOCK_MISSES => alloc.lock(),
            None => {
                self.lock_misses += 1;
                return;
            }
        };
        self.lock_misses = 0;
        a.free.append(&mut self.freed);
        let pending = std::mem::take(&mut a.pending);
        drop(a);
        for c in pending {
            let (m, _) = self.least_loaded();
            self.slots[m].push(c);
            r.placed += 1;
        }
    }
}

/// A handle to one estimator: 16 bytes, `Clone + Send + Sync`. The estimator
/// is removed when its last clone is dropped.
pub struct Estimator {
    chunk: Arc<Chunk>,
    idx: u32,
}

impl fmt::Debug for Estimator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Estimator").field("id", &self.id()).finish()
    }
}

impl Clone for Estimator {
    fn clone(&self) -> Self {
        self.chunk.refs[self.idx as usize].fetch_add(1, Relaxed);
        Self {
            chunk: Arc::clone(&self.chunk),
            idx: self.idx,
        }
    }
}

impl Drop for Estimator {
    fn drop(&mut self) {
        let i = self.idx as usize;
        if self.chunk.refs[i].fetch_sub(1, Release) == 1 {
            // Every clone's counter writes happen before the ticker's reset.
            fence(Acquire);
            self.chunk.flags[i].fetch_or(DEAD, Release);
        }
    }
}

/// Totals since `add` or the last `zero()`, as `ipvsadm --stats` shows them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Totals {
    /// Connections scheduled.
    pub conns: u64,
    /// Packets in.
    pub inpkts: u64,
    /// Packets out.
    pub outpkts: u64,
    /// Bytes in.
    pub inbytes: u64,
    /// Bytes out.
    pub outbytes: u64,
}

/// Rates per second, IPVS read-out rounding, as `ipvsadm --rate` shows them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Rates {
    /// Connections per second.
    pub cps: u64,
    /// Packets in per second.
    pub inpps: u64,
    /// Packets out per second.
    pub outpps: u64,
    /// Bytes in per second.
    pub inbps: u64,
    /// Bytes out per second.
    pub outbps: u64,
}

impl Estimator {
    /// Stable id while the estimator lives (reused after it is freed).
    #[must_use]
    pub fn id(&self) -> u32 {
        self.chunk.first_id + self.idx
    }

    /// Worker `w`'s counters for this estimator.
    ///
    /// Contract: at any time at most one thread writes through a given worker
    /// index (the daemon gives each worker thread its own index). Writes are a
    /// relaxed load + store, not a locked read-modify-write; two threads
    /// sharing an index may lose counts (never memory safety).
    ///
    /// # Panics
    /// If `w >= engine.workers()`.
    #[inline]
    #[must_use]
    pub fn worker(&self, w: usize) -> Counters<'_> {
        Counters {
            cell: &self.chunk.shards[w].cells[self.idx as usize],
        }
    }

    /// Totals and rates, from any thread, without locks. Fields are read one
    /// by one: a read racing a tick may mix this period's and the previous
    /// period's rates, and one racing `zero()` may see either baseline.
    #[must_use]
    pub fn read(&self) -> (Totals, Rates) {
        (self.totals(), self.rates())
    }

    /// Totals since `add` or the last `zero()`.
    #[must_use]
    pub fn totals(&self) -> Totals {
        let i = self.idx as usize;
        let s = self.chunk.sum(i);
        let b = &self.chunk.base[i];
        let t: [u64; FIELDS] = std::array::from_fn(|f| s[f].wrapping_sub(b[f].load(Relaxed)));
        Totals {
            conns: t[0],
            inpkts: t[1],
            outpkts: t[2],
            inbytes: t[3],
            outbytes: t[4],
        }
    }

    /// Rates with IPVS read-out rounding; zero until the first full period
    /// and between `zero()` and the next period.
    #[must_use]
    pub fn rates(&self) -> Rates {
        let raw = self.raw_rates();
        Rates {
            cps: ewma::read_count(raw[0]),
            inpps: ewma::read_count(raw[1]),
            outpps: ewma::read_count(raw[2]),
            inbps: ewma::read_bytes(raw[3]),
            outbps: ewma::read_bytes(raw[4]),
        }
    }

    /// The scaled averages as IPVS keeps them (x 2^10 for conns/packets, x 2^5
    /// for bytes), for metrics that want more precision than whole units.
    #[must_use]
    pub fn raw_rates(&self) -> [u64; FIELDS] {
        let i = self.idx as usize;
        let st = self.chunk.flags[i].load(Acquire);
        if st & STARTED == 0 || st & ZERO != 0 {
            return [0; FIELDS];
        }
        let e = &self.chunk.est[i];
        std::array::from_fn(|f| e.avg[f].load(Relaxed))
    }

    /// Zeroes totals and rates, like `ipvsadm -Z`: totals restart from 0 now,
    /// rates read 0 until the next visit, which restarts the average from 0
    /// over the interval since this call (IPVS `ip_vs_zero_estimator`).
    /// Concurrent `zero()` calls on one estimator coalesce into one.
    pub fn zero(&self) {
        let i = self.idx as usize;
        let flags = &self.chunk.flags[i];
        if flags.fetch_or(BUSY, Acquire) & BUSY != 0 {
            return;
        }
        let s = self.chunk.sum(i);
        for (b, v) in self.chunk.base[i].iter().zip(s) {
            b.store(v, Relaxed);
        }
        flags.fetch_or(ZERO, Release);
        flags.fetch_and(!BUSY, Release);
    }
}

/// One worker's view of one estimator's counters (see [`Estimator::worker`]).
#[derive(Debug, Clone, Copy)]
pub struct Counters<'a> {
    cell: &'a Cell,
}

impl Counters<'_> {
    #[inline]
    fn bump(&self, f: usize, n: u64) {
        let a = &self.cell.c[f];
        // Single writer per worker index: no locked RMW needed.
        a.store(a.load(Relaxed).wrapping_add(n), Relaxed);
    }

    /// One connection scheduled.
    #[inline]
    pub fn conn(&self) {
        self.bump(0, 1);
    }

    /// `n` connections scheduled.
    #[inline]
    pub fn conns(&self, n: u64) {
        self.bump(0, n);
    }

    /// `n` packets in.
    #[inline]
    pub fn packets_in(&self, n: u64) {
        self.bump(1, n);
    }

    /// `n` packets out.
    #[inline]
    pub fn packets_out(&self, n: u64) {
        self.bump(2, n);
    }

    /// `n` bytes in.
    #[inline]
    pub fn bytes_in(&self, n: u64) {
        self.bump(3, n);
    }

    /// `n` bytes out.
    #[inline]
    pub fn bytes_out(&self, n: u64) {
        self.bump(4, n);
    }

    /// `pkts` packets carrying `bytes` bytes in.
    #[inline]
    pub fn rx(&self, pkts: u64, bytes: u64) {
        self.bump(1, pkts);
        self.bump(3, bytes);
    }

    /// `pkts` packets carrying `bytes` bytes out.
    #[inline]
    pub fn tx(&self, pkts: u64, bytes: u64) {
        self.bump(2, pkts);
        self.bump(4, bytes);
    }
}

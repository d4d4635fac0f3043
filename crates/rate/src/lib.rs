//! `weir-rate`: IPVS-exact rate estimators for very many objects, I/O-free.
//!
//! weir keeps connection, packet and byte rates for every backend, service,
//! tenant and the whole daemon. This crate is the engine; the daemon supplies
//! the thread and the clock.
//!
//! # What an estimator computes
//!
//! Exactly what IPVS shows in `ipvsadm --rate` for the same counter history:
//! every 2 s ([`PERIOD`]) each of conns, inpkts, outpkts, inbytes, outbytes goes
//! through
//!
//! ```text
//! rate = (total - last) << 9     (conns, packets: x 2^10 / 2 s)
//! rate = (total - last) << 4     (bytes:          x 2^5  / 2 s)
//! last = total
//! avg += ((s64)rate - (s64)avg) >> 2
//! read-out: (avg + 0x1FF) >> 10  (per-second counts),  (avg + 0xF) >> 5  (bytes/s)
//! ```
//!
//! (see [`ewma`]). The one deliberate, opt-in departure is
//! [`Config::warm_start`]: the first rate after `add` or `zero()` seeds the
//! average instead of being averaged with 0, so a constant rate is reported
//! within 1 % at the first estimate rather than after ~32 s. It is off by
//! default (IPVS-exact).
//!
//! # Counters (data path)
//!
//! Each estimator has one cell of five `u64` counters per worker. A worker
//! writes only its own cells, with a relaxed load + store (no locked
//! instruction); workers' cells live in separate 128-byte aligned shards, so
//! no two workers ever write one cache line. The ticker sums the shards.
//! Contract: one writer thread per worker index ([`Estimator::worker`]).
//!
//! # Bounded ticks
//!
//! Estimators live in chunks of 256 that never move in memory. Each chunk is
//! placed in one of [`Config::slots`] tick slots (default 1000, i.e. a slot
//! every 2 ms) and every estimator in it is visited once per period, when its
//! slot comes round. A new chunk goes to the least loaded slot and stays
//! there. The cost of one estimator visit is measured, not assumed: a
//! [`Calibrator`] run at start (timed by the caller), then re-checked from the
//! real tick durations the caller feeds to [`Engine::record_tick`]. It gives
//! a slot's capacity (`slot_budget / cost`, reported with the slots over it in
//! [`EngineStats`]) and bounds catch-up: when the thread is late,
//! [`Engine::tick`] runs further due slots only while the estimated work stays
//! within `slot_budget` (and at most [`Config::max_slots_per_tick`]), so no
//! call does unbounded work. Chunks are never moved between slots: moving
//! would give their estimators one period of the wrong length (the inaccuracy
//! the kernel's rebalancing has), so an overloaded engine is reported and the
//! remedy is more slots, which the daemon chooses at start.
//!
//! # Churn
//!
//! [`Engine::add`] and dropping the last [`Estimator`] clone work from any
//! thread in O(1) amortised (a short mutex for the id free list; a new chunk
//! every 256 ids). The ticker takes that mutex only with `try_lock` (waiting
//! only after 8 consecutive misses), so churn never stalls a tick. An
//! estimator's slot is fixed for its life, so adding or removing others never
//! changes its values. A new estimator takes its baseline at its first visit
//! and gets its first rate one full period later; a removed one is reset and
//! its id reused after its next visit (within one period).
//!
//! # Reading and zeroing
//!
//! [`Estimator::read`] sums the worker cells (totals) and loads the averages
//! (rates) without locks from any thread. [`Estimator::zero`] is `ipvsadm -Z`:
//! it snapshots the totals as a new base and asks the ticker to restart the
//! average; rates read 0 until then.
//!
//! # Memory
//!
//! Per estimator: 40 B per worker (counters), 120 B (last, avg, zero base)
//! and 8 B (flags, handle count): 208 B with 2 workers. A handle is 16 B.
//! Chunks are kept and reused after their estimators are freed.
//!
//! # Checking the concurrency
//!
//! All atomics and mutexes go through the `sync` module, which swaps in
//! shuttle's under `--cfg shuttle` (chunks then hold 4 estimators) so
//! `tests/shuttle.rs` explores schedules of the real code: add/clone/drop
//! racing a baseline visit, `zero()` racing a visit, worker updates racing
//! visits. Run: `RUSTFLAGS="--cfg shuttle" cargo test -p weir-rate --release
//! --test shuttle`.
//!
//! # Driving it (daemon side)
//!
//! ```
//! use std::sync::atomic::{AtomicBool, Ordering};
//! use std::time::Instant;
//! use weir_rate::{Calibrator, Config, Engine};
//!
//! // At start: calibrate (the caller's clock), then size the engine.
//! let mut cal = Calibrator::new(2, 4096);
//! for _ in 0..12 {
//!     let t0 = Instant::now();
//!     let n = cal.run();
//!     cal.record(t0.elapsed(), n);
//! }
//! let cfg = Config { estimator_cost_ns: cal.cost_ns(), ..Config::default() };
//! let engine = Engine::new(2, cfg).expect("valid config");
//!
//! // Data path, worker 0 and worker 1 (each thread its own index):
//! let svc = engine.add();
//! svc.worker(0).conn();
//! svc.worker(1).rx(1, 1500);
//!
//! // The estimator thread; its priority and CPU affinity are the daemon's to set.
//! fn estimator_thread(engine: &Engine, start: Instant, stop: &AtomicBool) {
//!     while !stop.load(Ordering::Relaxed) {
//!         let t0 = Instant::now();
//!         let r = engine.tick(start.elapsed());
//!         engine.record_tick(t0.elapsed(), &r); // re-checks the cost
//!         if let Some(d) = r.next_due.checked_sub(start.elapsed()) {
//!             std::thread::sleep(d);
//!         }
//!     }
//! }
//! estimator_thread(&engine, Instant::now(), &AtomicBool::new(true));
//!
//! // Any thread:
//! let (totals, rates) = svc.read();
//! assert_eq!((totals.conns, totals.inbytes), (1, 1500));
//! assert_eq!(rates.cps, 0); // first rate one period after the baseline
//! ```

mod calibrate;
mod chunk;
mod engine;
pub mod ewma;
mod sync;

use std::time::Duration;

pub use calibrate::{CACHE_FACTOR, Calibrator};
pub use engine::{Counters, Engine, EngineStats, Estimator, PERIOD, Rates, TickReport, Totals};

/// Estimators per chunk, the unit of slot placement.
pub const ESTIMATORS_PER_CHUNK: usize = chunk::CHUNK;

/// Engine configuration. `Default` gives 1000 slots of 2 ms, a 0.5 ms budget
/// per slot, 4 slots per tick call at most and IPVS-exact averaging.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Tick slots per 2 s period (1..=100_000). The daemon should call
    /// [`Engine::tick`] every `2 s / slots`, or sooner (`Engine::next_due`).
    pub slots: u32,
    /// Work budget of one tick call: bounds catch-up and sets a slot's
    /// capacity (`slot_budget / cost`) for overload reporting.
    pub slot_budget: Duration,
    /// Initial cost of one estimator visit in ns (from [`Calibrator::cost_ns`]).
    pub estimator_cost_ns: f64,
    /// Most slots one [`Engine::tick`] call runs (>= 1).
    pub max_slots_per_tick: u32,
    /// Seed the average with the first rate after `add`/`zero()` instead of
    /// averaging it with 0 (not IPVS behaviour; see the crate docs).
    pub warm_start: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            slots: 1000,
            slot_budget: Duration::from_micros(500),
            estimator_cost_ns: 100.0,
            max_slots_per_tick: 4,
            warm_start: false,
        }
    }
}

/// A configuration value out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// `workers` must be 1..=4096.
    #[error("workers must be 1..=4096, got {0}")]
    Workers(usize),
    /// `slots` must be 1..=100_000.
    #[error("slots must be 1..=100000, got {0}")]
    Slots(u32),
    /// `slot_budget` must be non-zero.
    #[error("slot_budget must be non-zero")]
    Budget,
    /// `estimator_cost_ns` must be finite and positive.
    #[error("estimator_cost_ns must be finite and > 0, got {0}")]
    Cost(f64),
    /// `max_slots_per_tick` must be at least 1.
    #[error("max_slots_per_tick must be >= 1")]
    MaxSlots,
}

impl Config {
    fn validate(&self, workers: usize) -> Result<(), ConfigError> {
        if !(1..=4096).contains(&workers) {
            return Err(ConfigError::Workers(workers));
        }
        if !(1..=100_000).contains(&self.slots) {
            return Err(ConfigError::Slots(self.slots));
        }
        if self.slot_budget.is_zero() {
            return Err(ConfigError::Budget);
        }
        if !(self.estimator_cost_ns.is_finite() && self.estimator_cost_ns > 0.0) {
            return Err(ConfigError::Cost(self.estimator_cost_ns));
        }
        if self.max_slots_per_tick == 0 {
            return Err(ConfigError::MaxSlots);
        }
        Ok(())
    }

    /// Fewest slots keeping `estimators` within `slot_budget` per slot at
    /// `cost_ns` per estimator (1..=100_000), rounded up to whole chunks per slot.
    #[must_use]
    pub fn slots_for(estimators: usize, cost_ns: f64, slot_budget: Duration) -> u32 {
        let per_slot = (slot_budget.as_nanos() as f64 / cost_ns.max(0.01)) as usize;
        let chunks_per_slot = (per_slot / chunk::CHUNK).max(1);
        let chunks = estimators.div_ceil(chunk::CHUNK);
        chunks.div_ceil(chunks_per_slot).clamp(1, 100_000) as u32
    }

    /// The interval between slots: `2 s / slots`.
    #[must_use]
    pub fn tick_interval(&self) -> Duration {
        PERIOD / self.slots.max(1)
    }
}

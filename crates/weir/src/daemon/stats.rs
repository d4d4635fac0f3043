//! Counters and IPVS rate estimators for backends, services, tenants and the
//! daemon, on `weir-rate`.
//!
//! Each [`Stat`] owns one [`weir_rate::Estimator`]. The data path writes the
//! estimator's counter cell of the *current worker* (a thread-local index set
//! when a worker thread starts), so workers never share a cache line and
//! never use a locked instruction; control-plane threads (which do not count
//! traffic today) use one extra shard. The estimator thread
//! ([`estimator_main`]) drives [`weir_rate::Engine::tick`] on its own clock,
//! doing bounded work per tick.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use weir_rate::{Calibrator, Config, Engine, Estimator};

use crate::control::{Rates, Totals};

thread_local! {
    static WORKER: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Mark the current thread as worker `i` (its counter shard).
pub(crate) fn set_worker_index(i: usize) {
    WORKER.with(|w| w.set(Some(i)));
}

/// The daemon's estimator engine: `workers` shards for the workers plus one
/// for every other thread.
#[derive(Debug)]
pub(crate) struct RateEngine {
    pub(crate) engine: Engine,
    other: usize,
    /// Last and longest tick duration, in nanoseconds.
    pub(crate) last_tick_ns: AtomicU64,
    pub(crate) max_tick_ns: AtomicU64,
}

impl RateEngine {
    /// Calibrate the per-estimator cost on this machine, then build the engine.
    pub(crate) fn new(workers: usize) -> anyhow::Result<Self> {
        let shards = workers + 1;
        let mut cal = Calibrator::new(shards, 4096);
        for _ in 0..8 {
            let t0 = Instant::now();
            let n = cal.run();
            cal.record(t0.elapsed(), n);
        }
        let cfg = Config {
            estimator_cost_ns: cal.cost_ns(),
            ..Config::default()
        };
        let engine = Engine::new(shards, cfg).map_err(|e| anyhow::anyhow!("rate engine: {e}"))?;
        Ok(Self {
            engine,
            other: workers,
            last_tick_ns: AtomicU64::new(0),
            max_tick_ns: AtomicU64::new(0),
        })
    }

    /// A new statistic.
    pub(crate) fn stat(&self) -> Stat {
        Stat {
            est: self.engine.add(),
            other: self.other,
        }
    }
}

/// Counters plus their estimator.
#[derive(Debug)]
pub(crate) struct Stat {
    est: Estimator,
    other: usize,
}

impl Stat {
    #[inline]
    fn shard(&self) -> usize {
        WORKER.with(|w| w.get()).unwrap_or(self.other)
    }
    /// One connection or session scheduled.
    pub(crate) fn conn(&self) {
        self.est.worker(self.shard()).conn();
    }
    /// One read (TCP) or datagram (UDP) of `bytes` client → backend.
    pub(crate) fn add_in(&self, bytes: u64) {
        self.est.worker(self.shard()).rx(1, bytes);
    }
    /// One read or datagram of `bytes` backend → client.
    pub(crate) fn add_out(&self, bytes: u64) {
        self.est.worker(self.shard()).tx(1, bytes);
    }
    /// Current totals and rates.
    pub(crate) fn read(&self) -> (Totals, Rates) {
        let (t, r) = self.est.read();
        (
            Totals {
                conns: t.conns,
                inpkts: t.inpkts,
                outpkts: t.outpkts,
                inbytes: t.inbytes,
                outbytes: t.outbytes,
            },
            Rates {
                cps: r.cps,
                inpps: r.inpps,
                outpps: r.outpps,
                inbps: r.inbps,
                outbps: r.outbps,
            },
        )
    }
}

/// The estimator thread: tick when due, feed back the tick cost, until `stop`.
pub(crate) fn estimator_main(rates: Arc<RateEngine>, stop: Arc<AtomicBool>) {
    let start = Instant::now();
    while !stop.load(Relaxed) {
        let t0 = Instant::now();
        let r = rates.engine.tick(start.elapsed());
        let took = t0.elapsed();
        rates.engine.record_tick(took, &r);
        let ns = took.as_nanos() as u64;
        rates.last_tick_ns.store(ns, Relaxed);
        rates.max_tick_ns.fetch_max(ns, Relaxed);
        if r.behind > 0 {
            continue;
        }
        // Sleep until due, in short steps so that shutdown is prompt.
        let wait = r
            .next_due
            .checked_sub(start.elapsed())
            .unwrap_or(Duration::ZERO)
            .min(Duration::from_millis(100));
        std::thread::sleep(wait);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_land_in_the_right_shard_and_sum() {
        let r = RateEngine::new(2).unwrap();
        let s = r.stat();
        s.add_in(100); // "other" shard
        std::thread::scope(|sc| {
            for i in 0..2 {
                let s = &s;
                sc.spawn(move || {
                    set_worker_index(i);
                    for _ in 0..1000 {
                        s.add_in(10);
                        s.add_out(1);
                    }
                    s.conn();
                });
            }
        });
        let (t, _) = s.read();
        assert_eq!((t.conns, t.inpkts, t.inbytes), (2, 2001, 20_100));
        assert_eq!((t.outpkts, t.outbytes), (2000, 2000));
    }
}

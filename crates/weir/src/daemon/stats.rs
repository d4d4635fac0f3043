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
//!
//! At start the estimator thread first applies its placement
//! (`[daemon] estimator_cpu`: `sched_setaffinity` to one CPU;
//! `estimator_nice`: `setpriority` on its own thread id, which on Linux
//! changes only that thread), then calibrates the cost per estimator
//! *there* (a [`Calibrator`] run on the CPU and priority the ticks will have)
//! and hands the cost to the engine; every tick then feeds its measured
//! duration back through [`Engine::record_tick`]. Pinning to a CPU the
//! machine does not have fails the daemon's start; a nice value the process
//! may not take (no `CAP_SYS_NICE`) is logged and the inherited one kept.

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

/// The worker index of this thread (0 on threads that are not workers).
pub(crate) fn worker_index() -> usize {
    WORKER.with(|w| w.get()).unwrap_or(0)
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
    /// Build the engine with the default cost per estimator; the estimator
    /// thread replaces it by [`calibrate`](Self::calibrate) when it starts.
    pub(crate) fn new(workers: usize) -> anyhow::Result<Self> {
        let shards = workers + 1;
        let engine = Engine::new(shards, Config::default())
            .map_err(|e| anyhow::anyhow!("rate engine: {e}"))?;
        Ok(Self {
            engine,
            other: workers,
            last_tick_ns: AtomicU64::new(0),
            max_tick_ns: AtomicU64::new(0),
        })
    }

    /// Measure the cost per estimator on the calling thread (8 timed runs
    /// over 4096 estimators with this engine's shard count, best sample) and
    /// give it to the engine; returns it in nanoseconds.
    pub(crate) fn calibrate(&self) -> f64 {
        let mut cal = Calibrator::new(self.engine.workers(), 4096);
        for _ in 0..8 {
            let t0 = Instant::now();
            let n = cal.run();
            cal.record(t0.elapsed(), n);
        }
        let cost = cal.cost_ns();
        self.engine.set_estimator_cost(cost);
        cost
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

/// Where the estimator thread runs (`[daemon] estimator_cpu`, `estimator_nice`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Placement {
    /// Pin to this CPU.
    pub(crate) cpu: Option<usize>,
    /// Set this nice value on the thread.
    pub(crate) nice: Option<i32>,
}

/// What the estimator thread did when it started.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Started {
    /// Its kernel thread id.
    pub(crate) tid: i32,
    /// The calibrated cost per estimator (ns).
    pub(crate) cost_ns: f64,
    /// Whether the nice value was applied (false: not asked, or refused).
    pub(crate) nice_applied: bool,
}

/// Apply `placement` to the calling thread. An affinity failure is an
/// error; a refused nice value is a warning (returns false).
fn apply_placement(p: Placement) -> Result<bool, String> {
    if let Some(cpu) = p.cpu {
        let mut set = nix::sched::CpuSet::new();
        set.set(cpu)
            .map_err(|e| format!("estimator_cpu = {cpu}: {e}"))?;
        // Pid 0 = the calling thread.
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).map_err(|e| {
            format!(
                "estimator_cpu = {cpu}: cannot pin the estimator thread ({e}); \
                 give a CPU this process may run on (see `nproc`, taskset) or remove the key"
            )
        })?;
    }
    let Some(nice) = p.nice else {
        return Ok(false);
    };
    let tid = rustix::thread::gettid();
    match rustix::process::setpriority_process(Some(tid), nice) {
        Ok(()) => Ok(true),
        Err(e) => {
            tracing::warn!(
                estimator_nice = nice,
                "cannot set the estimator thread's nice value ({e}); keeping the inherited one \
                 (a lower nice needs CAP_SYS_NICE or RLIMIT_NICE)"
            );
            Ok(false)
        }
    }
}

/// The estimator thread: apply the placement, calibrate, report on `ready`
/// (an affinity error ends the thread), then tick when due and feed back the
/// tick cost, until `stop`.
pub(crate) fn estimator_main(
    rates: Arc<RateEngine>,
    stop: Arc<AtomicBool>,
    placement: Placement,
    ready: std::sync::mpsc::SyncSender<Result<Started, String>>,
) {
    let nice_applied = match apply_placement(placement) {
        Ok(applied) => applied,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let cost_ns = rates.calibrate();
    let _ = ready.send(Ok(Started {
        tid: rustix::thread::gettid().as_raw_nonzero().get(),
        cost_ns,
        nice_applied,
    }));
    drop(ready);
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

    /// Field of `/proc/self/task/<tid>/status` (e.g. `Cpus_allowed_list`).
    fn task_status(tid: i32, key: &str) -> String {
        let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .unwrap()
            .trim()
            .to_owned()
    }

    /// Nice value of a thread: field 19 of `/proc/self/task/<tid>/stat`.
    fn task_nice(tid: i32) -> i32 {
        let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
        // The command name (field 2) may hold spaces: count after its ')'.
        let rest = &text[text.rfind(')').unwrap() + 2..];
        rest.split(' ').nth(16).unwrap().parse().unwrap()
    }

    #[test]
    fn estimator_thread_pins_renices_and_calibrates_before_ticking() {
        let r = Arc::new(RateEngine::new(1).unwrap());
        let default_cost = r.engine.stats().cost_ns;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let placement = Placement {
            cpu: Some(0),
            nice: Some(7),
        };
        let t = {
            let (r, stop) = (r.clone(), stop.clone());
            std::thread::spawn(move || estimator_main(r, stop, placement, tx))
        };
        let started = rx.recv_timeout(Duration::from_secs(30)).unwrap().unwrap();
        assert!(started.nice_applied, "raising nice needs no privilege");
        assert_eq!(task_status(started.tid, "Cpus_allowed_list"), "0");
        assert_eq!(task_nice(started.tid), 7);
        // Only the estimator thread moved: this one keeps its own nice value.
        let me = rustix::thread::gettid().as_raw_nonzero().get();
        assert_ne!(task_nice(me), 7);
        // The calibrated cost replaced the default (an empty engine's ticks
        // scan nothing, so record_tick leaves it as calibrated).
        assert!(started.cost_ns > 0.0 && started.cost_ns < 1e6);
        assert_ne!(started.cost_ns, default_cost);
        assert_eq!(r.engine.stats().cost_ns, started.cost_ns);
        stop.store(true, Relaxed);
        t.join().unwrap();
    }

    #[test]
    fn pinning_to_a_missing_cpu_is_an_error() {
        let r = Arc::new(RateEngine::new(1).unwrap());
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let placement = Placement {
            cpu: Some(1023),
            nice: None,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let t = std::thread::spawn(move || estimator_main(r, stop, placement, tx));
        let err = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap()
            .unwrap_err();
        assert!(err.contains("estimator_cpu = 1023: cannot pin"), "{err}");
        t.join().unwrap();
    }
}

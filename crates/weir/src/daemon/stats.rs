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
    /// Set when a reload moved the estimator thread: it calibrates again.
    recalibrate: AtomicBool,
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
            recalibrate: AtomicBool::new(false),
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Placement {
    /// Pin to this CPU.
    pub(crate) cpu: Option<usize>,
    /// Set this nice value on the thread.
    pub(crate) nice: Option<i32>,
}

/// What the estimator thread did when it started.
#[derive(Debug, Clone)]
pub(crate) struct Started {
    /// Its kernel thread id.
    pub(crate) tid: i32,
    /// The calibrated cost per estimator (ns).
    pub(crate) cost_ns: f64,
    /// Whether the nice value was applied (false: not asked, or refused).
    pub(crate) nice_applied: bool,
    /// The CPUs and nice value it inherited, before its placement.
    pub(crate) inherited: Inherited,
}

/// The CPUs and nice value the estimator thread inherited from the process:
/// what a placement key removed by a reload puts back.
#[derive(Debug, Clone)]
pub(crate) struct Inherited {
    cpus: nix::sched::CpuSet,
    nice: i32,
}

impl Inherited {
    /// The calling thread's.
    fn of_this_thread() -> Result<Self, String> {
        let cpus = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))
            .map_err(|e| format!("reading the estimator thread's CPUs: {e}"))?;
        let nice = rustix::process::getpriority_process(Some(rustix::thread::gettid()))
            .map_err(|e| format!("reading the estimator thread's nice value: {e}"))?;
        Ok(Self { cpus, nice })
    }

    /// Whether the process may run on `cpu` (an `estimator_cpu` that can
    /// be applied).
    pub(crate) fn allows(&self, cpu: usize) -> bool {
        self.cpus.is_set(cpu).unwrap_or(false)
    }
}

/// Apply `placement` to thread `tid`; an absent key puts back what the
/// thread inherited. An affinity failure is an error; a refused nice value
/// is a warning (returns false). Linux applies both per thread, so another
/// thread may place this one (a reload does).
fn apply_placement(tid: i32, p: Placement, inherited: &Inherited) -> Result<bool, String> {
    let pid = nix::unistd::Pid::from_raw(tid);
    match p.cpu {
        Some(cpu) => {
            let mut set = nix::sched::CpuSet::new();
            set.set(cpu)
                .map_err(|e| format!("estimator_cpu = {cpu}: {e}"))?;
            nix::sched::sched_setaffinity(pid, &set).map_err(|e| {
                format!(
                    "estimator_cpu = {cpu}: cannot pin the estimator thread ({e}); \
                     give a CPU this process may run on (see `nproc`, taskset) or remove the key"
                )
            })?;
        }
        None => nix::sched::sched_setaffinity(pid, &inherited.cpus)
            .map_err(|e| format!("giving the estimator thread its CPUs back: {e}"))?,
    }
    let nice = p.nice.unwrap_or(inherited.nice);
    let Some(t) = rustix::thread::Pid::from_raw(tid) else {
        return Err(format!("no thread {tid}"));
    };
    match rustix::process::setpriority_process(Some(t), nice) {
        Ok(()) => Ok(p.nice.is_some()),
        Err(e) => {
            tracing::warn!(
                estimator_nice = nice,
                "cannot set the estimator thread's nice value ({e}); keeping the one it has \
                 (a lower nice needs CAP_SYS_NICE or RLIMIT_NICE)"
            );
            Ok(false)
        }
    }
}

/// The running estimator thread, for a reload to move it
/// (`estimator_cpu` / `estimator_nice` are live keys).
#[derive(Debug)]
pub(crate) struct EstimatorThread {
    tid: i32,
    inherited: Inherited,
    placement: parking_lot::Mutex<Placement>,
}

impl EstimatorThread {
    pub(crate) fn new(started: &Started, placement: Placement) -> Self {
        Self {
            tid: started.tid,
            inherited: started.inherited.clone(),
            placement: parking_lot::Mutex::new(placement),
        }
    }

    /// Its placement now (the keys as last applied).
    pub(crate) fn placement(&self) -> Placement {
        *self.placement.lock()
    }

    /// Why `p` cannot be applied, if it cannot: a CPU the process may not
    /// run on (the check a reload makes before applying anything).
    pub(crate) fn refuses(&self, p: Placement) -> Option<String> {
        let cpu = p.cpu?;
        (!self.inherited.allows(cpu)).then(|| {
            format!(
                "estimator_cpu = {cpu}: this process may not run on CPU {cpu}; give one it may \
                 (see `nproc`, taskset) or remove the key"
            )
        })
    }

    /// Moves the thread to `p` (a reload) and has it calibrate its cost per
    /// estimator again where it now runs.
    pub(crate) fn place(&self, p: Placement, rates: &RateEngine) -> Result<(), String> {
        let mut cur = self.placement.lock();
        if *cur == p {
            return Ok(());
        }
        apply_placement(self.tid, p, &self.inherited)?;
        *cur = p;
        rates.recalibrate.store(true, Relaxed);
        Ok(())
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
    let tid = rustix::thread::gettid().as_raw_nonzero().get();
    let placed = Inherited::of_this_thread().and_then(|inherited| {
        apply_placement(tid, placement, &inherited).map(|applied| (applied, inherited))
    });
    let (nice_applied, inherited) = match placed {
        Ok(p) => p,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let cost_ns = rates.calibrate();
    let _ = ready.send(Ok(Started {
        tid,
        cost_ns,
        nice_applied,
        inherited,
    }));
    drop(ready);
    let start = Instant::now();
    while !stop.load(Relaxed) {
        if rates.recalibrate.swap(false, Relaxed) {
            // Moved by a reload: measure again where it runs now.
            rates.calibrate();
        }
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

    /// A reload moves the running thread (another thread places it by its
    /// id), refuses a CPU the process may not run on before applying, puts
    /// back what the thread inherited when the keys go, and has the thread
    /// calibrate again where it now runs.
    #[test]
    fn a_placed_thread_moves_and_calibrates_again() {
        let r = Arc::new(RateEngine::new(1).unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let first = Placement {
            cpu: Some(0),
            nice: Some(3),
        };
        let t = {
            let (r, stop) = (r.clone(), stop.clone());
            std::thread::spawn(move || estimator_main(r, stop, first, tx))
        };
        let started = rx.recv_timeout(Duration::from_secs(30)).unwrap().unwrap();
        let tid = started.tid;
        let inherited = (
            task_status(
                rustix::thread::gettid().as_raw_nonzero().get(),
                "Cpus_allowed_list",
            ),
            task_nice(rustix::thread::gettid().as_raw_nonzero().get()),
        );
        let e = EstimatorThread::new(&started, first);
        assert!(
            e.refuses(Placement {
                cpu: Some(1023),
                nice: None
            })
            .is_some()
        );
        assert_eq!(
            e.refuses(Placement {
                cpu: Some(0),
                nice: None
            }),
            None
        );
        // The highest CPU this process may run on.
        let last = (0..1024)
            .rev()
            .find(|&c| started.inherited.allows(c))
            .unwrap();
        let moved = Placement {
            cpu: Some(last),
            nice: Some(6),
        };
        e.place(moved, &r).unwrap();
        assert_eq!(e.placement(), moved);
        assert_eq!(task_status(tid, "Cpus_allowed_list"), last.to_string());
        assert_eq!(task_nice(tid), 6);
        // The thread saw the move: it clears the flag as it calibrates.
        let t0 = Instant::now();
        while r.recalibrate.load(Relaxed) {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "never calibrated again"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        e.place(Placement::default(), &r).unwrap();
        assert_eq!(task_status(tid, "Cpus_allowed_list"), inherited.0);
        if rustix::process::geteuid().is_root() {
            assert_eq!(task_nice(tid), inherited.1);
        }
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

//! Accept steering: which worker's listener a new TCP connection goes to.
//!
//! Every TCP service has one `SO_REUSEPORT` listener per worker. By
//! default (`[daemon] accept_steering = "spread"`) the kernel hashes each
//! SYN to one of them, so with W workers each one wakes for 1/W of the
//! connections however light the load. nginx instead shares one accept
//! queue with `EPOLLEXCLUSIVE` wake-ups (which tokio cannot register), so
//! a busy worker keeps taking connections while the others sleep.
//!
//! `"adaptive"` sends new connections to the fewest workers that keep up:
//! the first `k` listeners of each group, chosen at random among them by a
//! classic BPF program on the group (`SO_ATTACH_REUSEPORT_CBPF`). `k`
//! starts at 1 and a controller on the control runtime moves it every
//! [`TICK`] from what the workers report (the share of the tick each spent
//! unparked, from tokio's park hooks) and how much CPU the host has idle
//! (`/proc/stat`), by the rules of [`Policy`]: one more worker when every
//! active one is saturated and a CPU is free for another, one fewer when
//! the load would fit. A connection stays on the worker that accepted it.
//! Measured against spread (docs/BENCHMARKS.md, "Accept steering") it
//! gave no consistent gain (0.93x the connections/s at 1.07x the CPU per
//! connection at 32 concurrent clients, 1.08x at 0.91x at 4), so it is
//! not the default.
//!
//! The program picks a listener by its index in the group, which is the
//! order the workers' sockets started listening ([`super::open_sockets`]
//! does it in worker order). A group whose sockets were opened while an
//! older group of ours on the address was still closing can be in another
//! order; then a worker other than the one measured may take the packed
//! share until the service is next opened: a wrong guess, never a lost
//! connection.
//!
//! A reload switches the mode live ([`Steering::set_mode`]): to adaptive,
//! `k` starts again at 1 and the controller from a fresh policy; to
//! spread, worker 0's listeners take their groups' programs off. With more
//! than one worker the controller, the workers' park hooks and worker 0's
//! watch of `k` therefore exist in either mode; in spread mode the hooks
//! return after one relaxed load and the controller sleeps until a switch
//! (it does not tick).

use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::config::AcceptSteering;

/// How often the controller samples the workers and may move `k`.
pub(crate) const TICK: Duration = Duration::from_millis(100);

/// A worker counts as saturated when it spent at least this share of a
/// tick unparked (running tasks, or runnable and waiting for a CPU).
const SATURATED: f64 = 0.85;
/// ... and one more worker is worth waking only with at least this many
/// CPUs idle on the host: without one it would take turns on a CPU with
/// the busy worker (or the host's other work) and add only switches.
const SPARE_CPUS: f64 = 0.5;
/// One fewer worker when the active workers' load, spread over one fewer,
/// would keep each at most this busy.
const FITS: f64 = 0.6;
/// Consecutive ticks a rule must hold before `k` moves: growing is quick,
/// shrinking waits a second so a lull does not pack a burst's next wave.
const GROW_TICKS: u32 = 2;
const SHRINK_TICKS: u32 = 10;

/// One worker's clock: how long it has been unparked. Written only by its
/// worker (from tokio's park hooks), read by the controller; a line of its
/// own so workers do not share one.
#[derive(Debug, Default)]
#[repr(align(128))]
struct WorkerClock {
    /// Nanoseconds unparked, up to the current stretch.
    busy_ns: AtomicU64,
    /// When the current unparked stretch began (ns since the origin, + 1);
    /// 0 while parked.
    since: AtomicU64,
    /// Connections this worker's TCP listeners accepted.
    accepted: AtomicU64,
}

/// The workers' clocks, the active count and the mode (see the module
/// docs). One per daemon, shared by the workers' runtimes, the accept
/// loops and the controller.
#[derive(Debug)]
pub(crate) struct Steering {
    /// The mode is adaptive (else spread); a reload may change it.
    adaptive: AtomicBool,
    /// Bumped by every change of mode: the controller starts over.
    mode_changes: AtomicU64,
    origin: Instant,
    clocks: Box<[WorkerClock]>,
    /// `k`: how many workers (the first ones) take new connections.
    active: watch::Sender<usize>,
    /// Programs attached to groups so far (what tests wait for).
    applied: AtomicU64,
}

impl Steering {
    pub(crate) fn new(mode: AcceptSteering, workers: usize) -> Self {
        let workers = workers.max(1);
        let clocks: Box<[WorkerClock]> = (0..workers).map(|_| WorkerClock::default()).collect();
        let start = if mode == AcceptSteering::Adaptive {
            1
        } else {
            workers
        };
        Self {
            adaptive: AtomicBool::new(mode == AcceptSteering::Adaptive),
            mode_changes: AtomicU64::new(0),
            origin: Instant::now(),
            clocks,
            active: watch::Sender::new(start),
            applied: AtomicU64::new(0),
        }
    }

    pub(crate) fn workers(&self) -> usize {
        self.clocks.len()
    }

    /// Whether the controller moves `k` and listeners get a program:
    /// adaptive mode with more than one worker.
    pub(crate) fn steers(&self) -> bool {
        self.adaptive.load(Relaxed) && self.workers() > 1
    }

    /// Whether the controller, the park hooks and worker 0's watch of `k`
    /// exist: more than one worker, in either mode (a reload may switch).
    pub(crate) fn can_steer(&self) -> bool {
        self.workers() > 1
    }

    /// The mode in force.
    pub(crate) fn mode(&self) -> AcceptSteering {
        if self.adaptive.load(Relaxed) {
            AcceptSteering::Adaptive
        } else {
            AcceptSteering::Spread
        }
    }

    /// Switches the mode (a reload): adaptive starts again from one
    /// worker, spread gives every worker its share by the kernel's hash.
    /// Worker 0's accept loops apply it to their groups as they see the
    /// `k` published here.
    pub(crate) fn set_mode(&self, mode: AcceptSteering) {
        if mode == self.mode() {
            return;
        }
        let adaptive = mode == AcceptSteering::Adaptive;
        if adaptive {
            // Stretches begun while spread were not timed: start clean.
            for c in self.clocks.iter() {
                c.since.store(0, Relaxed);
            }
        }
        let k = if adaptive { 1 } else { self.workers() };
        // Under the lock of `k`: the mode, its count of changes and its
        // `k` change together, so a controller's tick, which publishes
        // under the same lock only if the count is the one it computed
        // for, cannot publish over the switch. A loop that sees this `k`
        // sees the mode.
        self.active.send_modify(|active| {
            self.adaptive.store(adaptive, Relaxed);
            self.mode_changes.fetch_add(1, Relaxed);
            *active = k;
        });
    }

    /// How many workers take new connections now.
    pub(crate) fn active(&self) -> usize {
        *self.active.borrow()
    }

    fn now_ns(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }

    /// Worker `i` starts running tasks (tokio's `on_thread_unpark`, and
    /// once when the worker starts).
    pub(crate) fn unparked(&self, i: usize) {
        if !self.steers() {
            return;
        }
        if let Some(c) = self.clocks.get(i) {
            c.since.store(self.now_ns() + 1, Relaxed);
        }
    }

    /// Worker `i` is about to wait for events (`on_thread_park`).
    pub(crate) fn parked(&self, i: usize) {
        if !self.steers() {
            return;
        }
        if let Some(c) = self.clocks.get(i) {
            let since = c.since.swap(0, Relaxed);
            if since != 0 {
                let d = (self.now_ns() + 1).saturating_sub(since);
                // Only this worker writes its clock: no read-modify-write.
                c.busy_ns.store(c.busy_ns.load(Relaxed) + d, Relaxed);
            }
        }
    }

    /// Nanoseconds worker `i` has been unparked by `now` (ns since the
    /// origin), the current stretch included. A racing park may make two
    /// reads a stretch apart disagree by one stretch; the controller
    /// clamps what it derives.
    fn busy_at(&self, i: usize, now: u64) -> u64 {
        let c = &self.clocks[i];
        let since = c.since.load(Relaxed);
        let open = if since == 0 {
            0
        } else {
            (now + 1).saturating_sub(since)
        };
        c.busy_ns.load(Relaxed) + open
    }

    /// A receiver of `k` for an accept loop that applies it to its
    /// listener, if this worker is the one that does (worker 0; the
    /// program is the group's, so one listener of each group is enough).
    pub(crate) fn watcher(&self, worker: usize) -> Option<watch::Receiver<usize>> {
        (self.can_steer() && worker == 0).then(|| self.active.subscribe())
    }

    /// Points `listener`'s reuseport group at its first `k` sockets when
    /// steering, else takes the group's program off (the kernel's hash).
    pub(crate) fn apply(&self, listener: &impl AsFd, k: usize) -> io::Result<()> {
        if self.steers() {
            attach(listener, &program(k, self.workers()))?;
        } else {
            detach(listener)?;
        }
        self.applied.fetch_add(1, Relaxed);
        Ok(())
    }

    /// Worker `i` accepted a TCP connection.
    pub(crate) fn accepted(&self, i: usize) {
        if let Some(c) = self.clocks.get(i) {
            // Only this worker writes its clock: no read-modify-write.
            c.accepted.store(c.accepted.load(Relaxed) + 1, Relaxed);
        }
    }

    /// Publishes `k` as the controller would.
    #[cfg(test)]
    pub(crate) fn set_active(&self, k: usize) {
        self.active.send_replace(k);
    }

    /// Programs attached so far.
    #[cfg(test)]
    pub(crate) fn applied(&self) -> u64 {
        self.applied.load(Relaxed)
    }

    /// Connections each worker accepted so far.
    pub(crate) fn accepted_by_worker(&self) -> Vec<u64> {
        self.clocks
            .iter()
            .map(|c| c.accepted.load(Relaxed))
            .collect()
    }

    /// What `weir stats` and the metrics show.
    pub(crate) fn stats(&self) -> crate::control::WorkerStats {
        crate::control::WorkerStats {
            steering: self.mode().as_str().into(),
            accepting: self.active() as u64,
            accepted: self.accepted_by_worker(),
        }
    }

    /// The controller: samples every [`TICK`] and publishes `k` when the
    /// policy moves it. Runs until the daemon's control runtime stops.
    pub(crate) async fn run(self: std::sync::Arc<Self>) {
        self.run_with(CpuTimes::read).await
    }

    /// [`Self::run`] with the host's CPU times from `read_cpu`.
    async fn run_with(self: std::sync::Arc<Self>, read_cpu: impl Fn() -> Option<CpuTimes>) {
        let n = self.workers();
        let mut policy = Policy::new(n);
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut changes = self.mode_changes.load(Relaxed);
        let mut last: Option<Sample> = None;
        // Every switch of mode publishes its `k`: what spread waits for.
        let mut switched = self.active.subscribe();
        loop {
            if !self.steers() {
                // Spread reads nothing, so it does not tick either (ten
                // wake-ups a second of an idle daemon): it waits for a
                // switch, then starts over with a fresh policy (k = 1, as
                // published) from the next sample. Seen, then checked
                // again: a switch made in between is not missed.
                switched.borrow_and_update();
                while !self.steers() {
                    if switched.changed().await.is_err() {
                        return;
                    }
                }
                changes = self.mode_changes.load(Relaxed);
                policy = Policy::new(n);
                last = None;
                tick.reset_immediately();
            }
            tick.tick().await;
            let c = self.mode_changes.load(Relaxed);
            if c != changes || !self.steers() {
                // Spread reads nothing; a change of mode starts over from
                // the next sample with a fresh policy (k = 1, as published).
                changes = c;
                policy = Policy::new(n);
                last = None;
                continue;
            }
            let now = self.sample(read_cpu());
            let Some(before) = last.replace(now) else {
                continue;
            };
            let (busy, idle) = last.as_ref().expect("just set").since(&before);
            let before = policy.k;
            let k = policy.tick(&busy, idle);
            // Published only when the policy moves it, and only if the mode
            // is still the one this tick computed for: a switch that
            // landed since the check above (it publishes its own `k` under
            // the same lock) wins, and the next tick starts over.
            if k != before
                && self.active.send_if_modified(|active| {
                    if self.mode_changes.load(Relaxed) != changes {
                        return false;
                    }
                    *active = k;
                    true
                })
            {
                tracing::debug!(from = before, to = k, ?busy, idle, "accept steering");
            }
        }
    }

    fn sample(&self, cpu: Option<CpuTimes>) -> Sample {
        let now = self.now_ns();
        Sample {
            at: now,
            busy: (0..self.workers()).map(|i| self.busy_at(i, now)).collect(),
            cpu,
        }
    }
}

/// What the controller reads each tick.
struct Sample {
    at: u64,
    busy: Vec<u64>,
    cpu: Option<CpuTimes>,
}

impl Sample {
    /// Each worker's share of the time since `before` it spent unparked
    /// (0..=1), and the CPUs the host had idle on average (when
    /// `/proc/stat` cannot be read: as many as there are workers, so only
    /// saturation decides).
    fn since(&self, before: &Sample) -> (Vec<f64>, f64) {
        let wall = self.at.saturating_sub(before.at).max(1) as f64;
        let busy = self
            .busy
            .iter()
            .zip(&before.busy)
            .map(|(a, b)| (a.saturating_sub(*b) as f64 / wall).clamp(0.0, 1.0))
            .collect::<Vec<_>>();
        let idle = match (&self.cpu, &before.cpu) {
            (Some(a), Some(b)) => a.idle_cpus_since(b),
            _ => busy.len() as f64,
        };
        (busy, idle)
    }
}

/// The host's CPU time so far, from `/proc/stat`'s first line.
#[derive(Debug, Clone, Copy, PartialEq)]
struct CpuTimes {
    /// idle + iowait, in clock ticks.
    idle: u64,
    /// Every state but the guest ones (already counted in user and nice).
    total: u64,
    /// The `cpuN` lines.
    cpus: usize,
}

impl CpuTimes {
    fn read() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    fn parse(text: &str) -> Option<Self> {
        let mut lines = text.lines();
        let first = lines.next()?;
        let mut fields = first.split_ascii_whitespace();
        if fields.next()? != "cpu" {
            return None;
        }
        let v: Vec<u64> = fields
            .take(8)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        if v.len() < 5 {
            return None;
        }
        let cpus = lines
            .filter(|l| {
                l.strip_prefix("cpu")
                    .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
            })
            .count();
        Some(Self {
            idle: v[3] + v[4],
            total: v.iter().sum(),
            cpus: cpus.max(1),
        })
    }

    /// CPUs idle on average between `before` and `self`.
    fn idle_cpus_since(&self, before: &CpuTimes) -> f64 {
        let total = self.total.saturating_sub(before.total);
        if total == 0 {
            // Under one clock tick (10 ms) in all: no news; call it idle.
            return self.cpus as f64;
        }
        let idle = self.idle.saturating_sub(before.idle).min(total);
        idle as f64 / total as f64 * self.cpus as f64
    }
}

/// The rules that move `k` (see the constants), I/O-free: fed each tick's
/// shares and idle CPUs, it returns the `k` to use.
#[derive(Debug)]
pub(crate) struct Policy {
    n: usize,
    k: usize,
    grow: u32,
    shrink: u32,
}

impl Policy {
    pub(crate) fn new(workers: usize) -> Self {
        Self {
            n: workers.max(1),
            k: 1,
            grow: 0,
            shrink: 0,
        }
    }

    /// One tick: `busy[i]` is the share of it worker `i` spent unparked,
    /// `idle_cpus` the CPUs the host had idle on average.
    pub(crate) fn tick(&mut self, busy: &[f64], idle_cpus: f64) -> usize {
        let active = &busy[..self.k.min(busy.len())];
        let saturated = !active.is_empty() && active.iter().all(|b| *b >= SATURATED);
        let load: f64 = active.iter().sum();
        let can_grow = self.k < self.n && saturated && idle_cpus >= SPARE_CPUS;
        let can_shrink = self.k > 1 && load <= FITS * (self.k - 1) as f64;
        self.grow = if can_grow { self.grow + 1 } else { 0 };
        self.shrink = if can_shrink { self.shrink + 1 } else { 0 };
        if self.grow >= GROW_TICKS {
            self.k += 1;
            self.grow = 0;
        } else if self.shrink >= SHRINK_TICKS {
            self.k -= 1;
            self.shrink = 0;
        }
        self.k
    }
}

/// The classic BPF program that sends a group's new connections to its
/// first `k` of `n` sockets: socket 0 when `k` is 1, one of the first `k`
/// at random otherwise, and when `k` is `n` an index past the group,
/// which makes the kernel fall back to its own hash.
pub(crate) fn program(k: usize, n: usize) -> Vec<libc::sock_filter> {
    let op = |code: u32, k: u32| libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    if k >= n {
        vec![op(libc::BPF_RET | libc::BPF_K, u32::MAX)]
    } else if k <= 1 {
        vec![op(libc::BPF_RET | libc::BPF_K, 0)]
    } else {
        vec![
            // A = a random u32 (the ancillary field SKF_AD_RANDOM)
            op(
                libc::BPF_LD | libc::BPF_W | libc::BPF_ABS,
                (libc::SKF_AD_OFF + libc::SKF_AD_RANDOM) as u32,
            ),
            // A %= k
            op(libc::BPF_ALU | libc::BPF_MOD | libc::BPF_K, k as u32),
            // the socket at index A
            op(libc::BPF_RET | libc::BPF_A, 0),
        ]
    }
}

// nix's own macro for a socket option it has no type for.
use nix::{setsockopt_impl, sockopt_impl};
sockopt_impl!(
    /// `SO_DETACH_REUSEPORT_BPF`: takes a reuseport group's program off.
    DetachReusePortBpf,
    SetOnly,
    libc::SOL_SOCKET,
    libc::SO_DETACH_REUSEPORT_BPF,
    libc::c_int
);

/// Takes the program off the reuseport group of `sock` (none there is
/// fine): the kernel hashes again.
pub(crate) fn detach(sock: &impl AsFd) -> io::Result<()> {
    match nix::sys::socket::setsockopt(sock, DetachReusePortBpf, &0) {
        Err(nix::errno::Errno::ENOENT) => Ok(()),
        r => r.map_err(io::Error::from),
    }
}

/// Attaches `prog` to the reuseport group of `sock` (replacing the one
/// it had). The kernel checks and copies the program.
pub(crate) fn attach(sock: &impl AsFd, prog: &[libc::sock_filter]) -> io::Result<()> {
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        // Read only: the kernel copies the instructions from here.
        filter: prog.as_ptr().cast_mut(),
    };
    nix::sys::socket::setsockopt(sock, nix::sys::socket::sockopt::AttachReusePortCbpf, &fprog)
        .map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ticks(p: &mut Policy, busy: &[f64], idle: f64, n: usize) -> usize {
        let mut k = 0;
        for _ in 0..n {
            k = p.tick(busy, idle);
        }
        k
    }

    #[test]
    fn a_saturated_worker_gets_company_only_with_a_spare_cpu() {
        let mut p = Policy::new(4);
        // Saturated, but the host has no CPU to give another worker.
        assert_eq!(ticks(&mut p, &[0.97, 0.0, 0.0, 0.0], 0.2, 50), 1);
        // A CPU free: after GROW_TICKS, a second worker.
        assert_eq!(p.tick(&[0.97, 0.0, 0.0, 0.0], 1.5), 1);
        assert_eq!(p.tick(&[0.97, 0.0, 0.0, 0.0], 1.5), 2);
        // Both saturated and CPUs free: a third, then a fourth, no more.
        assert_eq!(
            ticks(&mut p, &[0.9, 0.9, 0.1, 0.0], 2.0, GROW_TICKS as usize),
            3
        );
        assert_eq!(
            ticks(&mut p, &[0.9, 0.9, 0.9, 0.0], 2.0, GROW_TICKS as usize),
            4
        );
        assert_eq!(ticks(&mut p, &[1.0; 4], 4.0, 20), 4);
        // One active worker not saturated: no growth.
        let mut p = Policy::new(4);
        ticks(&mut p, &[1.0, 0.0, 0.0, 0.0], 3.0, GROW_TICKS as usize);
        assert_eq!(ticks(&mut p, &[1.0, 0.5, 0.0, 0.0], 3.0, 50), 2);
    }

    #[test]
    fn workers_leave_one_at_a_time_once_the_load_fits_for_a_second() {
        let mut p = Policy::new(3);
        ticks(&mut p, &[1.0, 0.0, 0.0], 2.0, GROW_TICKS as usize);
        ticks(&mut p, &[1.0, 1.0, 0.0], 2.0, GROW_TICKS as usize);
        assert_eq!(p.k, 3);
        // 1.3 over 2 workers is 0.65 each: does not fit at FITS.
        assert_eq!(ticks(&mut p, &[0.5, 0.4, 0.4], 1.0, 100), 3);
        // 1.1 fits two at 0.55: one leaves after SHRINK_TICKS, not before.
        assert_eq!(
            ticks(&mut p, &[0.4, 0.4, 0.3], 1.0, SHRINK_TICKS as usize - 1),
            3
        );
        assert_eq!(p.tick(&[0.4, 0.4, 0.3], 1.0), 2);
        // A tick that does not fit restarts the count.
        ticks(&mut p, &[0.3, 0.2, 0.0], 1.0, SHRINK_TICKS as usize - 1);
        p.tick(&[0.9, 0.9, 0.0], 0.0);
        assert_eq!(
            ticks(&mut p, &[0.3, 0.2, 0.0], 1.0, SHRINK_TICKS as usize - 1),
            2
        );
        assert_eq!(p.tick(&[0.3, 0.2, 0.0], 1.0), 1);
        assert_eq!(ticks(&mut p, &[0.0; 3], 2.0, 100), 1);
    }

    proptest! {
        /// Whatever the samples, k stays in 1..=n, moves by at most one per
        /// tick, grows only when every active worker was saturated with a
        /// CPU idle, and shrinks only when the load fit one fewer.
        #[test]
        fn k_moves_one_step_at_a_time_and_only_by_its_rules(
            n in 1usize..6,
            samples in proptest::collection::vec(
                (proptest::collection::vec(0.0f64..=1.0, 6), 0.0f64..4.0), 1..300),
        ) {
            let mut p = Policy::new(n);
            let mut k = 1;
            for (busy, idle) in samples {
                let busy = &busy[..n];
                let active = &busy[..k];
                let next = p.tick(busy, idle);
                prop_assert!((1..=n).contains(&next));
                prop_assert!(next.abs_diff(k) <= 1);
                if next > k {
                    prop_assert!(active.iter().all(|b| *b >= SATURATED) && idle >= SPARE_CPUS);
                }
                if next < k {
                    prop_assert!(active.iter().sum::<f64>() <= FITS * (k - 1) as f64);
                }
                k = next;
            }
        }
    }

    #[test]
    fn proc_stat_parses_and_idle_cpus_follow_the_idle_ticks() {
        let a = CpuTimes::parse(
            "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\n\
             cpu1 50 0 25 400 25 0 0 0 0 0\nintr 1 2 3\n",
        )
        .unwrap();
        assert_eq!(
            a,
            CpuTimes {
                idle: 850,
                total: 1000,
                cpus: 2
            }
        );
        // 100 more ticks, 25 of them idle: a quarter of 2 CPUs.
        let b = CpuTimes {
            idle: 875,
            total: 1100,
            cpus: 2,
        };
        assert!((b.idle_cpus_since(&a) - 0.5).abs() < 1e-9);
        assert_eq!(CpuTimes::parse("intr 1\n"), None);
        assert_eq!(CpuTimes::parse("cpu 1 2 x\n"), None);
        assert!(CpuTimes::read().is_some(), "this host's /proc/stat");
    }

    #[test]
    fn a_worker_clock_counts_unparked_time_including_the_open_stretch() {
        let s = Steering::new(AcceptSteering::Adaptive, 2);
        assert_eq!(s.busy_at(0, s.now_ns()), 0);
        s.unparked(0);
        std::thread::sleep(Duration::from_millis(20));
        let open = s.busy_at(0, s.now_ns());
        assert!(open >= 20_000_000, "{open}");
        s.parked(0);
        let closed = s.busy_at(0, s.now_ns());
        assert!(closed >= open);
        std::thread::sleep(Duration::from_millis(20));
        // Parked: no more time counted.
        assert_eq!(s.busy_at(0, s.now_ns()), closed);
        assert_eq!(s.busy_at(1, s.now_ns()), 0);
        // Out-of-range workers are ignored, not a panic.
        s.unparked(7);
        s.parked(7);
    }

    /// The controller against its clocks: with every worker unparked for
    /// good (saturated) and the host idle, it adds workers one at a time up
    /// to all of them; once they all park, it takes them away again.
    /// tokio's clock is paused (ticks come as soon as the task waits);
    /// the workers' clocks run on real time, so a share is 1 or 0 here.
    #[tokio::test(start_paused = true)]
    async fn the_controller_publishes_each_move_of_the_policy() {
        let s = std::sync::Arc::new(Steering::new(AcceptSteering::Adaptive, 3));
        let mut rx = s.active.subscribe();
        assert_eq!(*rx.borrow_and_update(), 1);
        for i in 0..3 {
            s.unparked(i);
        }
        let idle = std::sync::atomic::AtomicU64::new(0);
        // Every tick, 100 clock ticks over 2 CPUs, all of them idle.
        let host = move || {
            let t = idle.fetch_add(100, Relaxed) + 100;
            Some(CpuTimes {
                idle: t,
                total: t,
                cpus: 2,
            })
        };
        let task = tokio::spawn(s.clone().run_with(host));
        let mut seen = Vec::new();
        while seen.last() != Some(&3) {
            rx.changed().await.unwrap();
            seen.push(*rx.borrow_and_update());
        }
        assert_eq!(seen, [2, 3]);
        for i in 0..3 {
            s.parked(i);
        }
        while seen.last() != Some(&1) {
            rx.changed().await.unwrap();
            seen.push(*rx.borrow_and_update());
        }
        assert_eq!(seen, [2, 3, 2, 1]);
        task.abort();
    }

    /// In spread mode the controller is not woken while nothing changes
    /// (it reads nothing then): a daemon at rest used to wake its control
    /// thread every tick for it, ten times a second. A switch to adaptive
    /// wakes it, and it steers again from a fresh policy. The controller
    /// is polled here with a waker that counts its wake-ups, while the
    /// paused clock is moved on by a hundred ticks.
    #[tokio::test(start_paused = true)]
    async fn in_spread_mode_the_controller_sleeps_until_a_switch() {
        use std::sync::atomic::AtomicUsize;
        use std::task::{Context, Poll, Wake, Waker};
        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: std::sync::Arc<Self>) {
                self.0.fetch_add(1, Relaxed);
            }
        }
        let s = std::sync::Arc::new(Steering::new(AcceptSteering::Spread, 3));
        for i in 0..3 {
            s.unparked(i);
        }
        let wakes = std::sync::Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let host = || {
            Some(CpuTimes {
                idle: 0,
                total: 0,
                cpus: 2,
            })
        };
        let mut controller = std::pin::pin!(s.clone().run_with(host));
        assert!(controller.as_mut().poll(&mut cx).is_pending());
        tokio::time::advance(TICK * 100).await;
        assert_eq!(wakes.0.load(Relaxed), 0, "woken in spread mode");
        assert!(controller.as_mut().poll(&mut cx).is_pending());
        // A switch to adaptive wakes it; from then on it ticks, and with
        // every worker saturated it grows k from 1.
        s.set_mode(AcceptSteering::Adaptive);
        for i in 0..3 {
            s.unparked(i);
        }
        assert!(wakes.0.load(Relaxed) > 0, "the switch did not wake it");
        let mut rx = s.active.subscribe();
        assert_eq!(*rx.borrow_and_update(), 1);
        for _ in 0..100 {
            if let Poll::Ready(()) = controller.as_mut().poll(&mut cx) {
                panic!("the controller returned");
            }
            if rx.has_changed().unwrap() {
                break;
            }
            tokio::time::advance(TICK).await;
        }
        assert_eq!(*rx.borrow_and_update(), 2, "the controller did not steer");
    }

    /// A switch of mode that lands while the controller works a tick out
    /// (after its check of the mode, before it publishes) wins: the tick
    /// publishes nothing, and spread's `k` (every worker) stays. The tick
    /// used to publish the `k` it computed for the old mode over the
    /// switch's: here 2 of 3 workers under spread, which stayed until the
    /// policy next moved. The switch is made from the test's source of CPU
    /// times, which the controller reads between the two.
    #[tokio::test(start_paused = true)]
    async fn a_mode_switch_during_a_tick_is_not_overwritten() {
        let s = std::sync::Arc::new(Steering::new(AcceptSteering::Adaptive, 3));
        for i in 0..3 {
            s.unparked(i);
        }
        let samples = std::sync::atomic::AtomicU64::new(0);
        let switch = s.clone();
        // The first sample only starts the count; GROW_TICKS saturated
        // ones later the policy grows k to 2: that tick's read switches.
        let host = move || {
            let n = samples.fetch_add(1, Relaxed) + 1;
            if n == 1 + u64::from(GROW_TICKS) {
                switch.set_mode(AcceptSteering::Spread);
            }
            let t = n * 100;
            Some(CpuTimes {
                idle: t,
                total: t,
                cpus: 2,
            })
        };
        let task = tokio::spawn(s.clone().run_with(host));
        // Past the switch and a few ticks more (the clock is paused: the
        // controller's ticks come as the test waits).
        tokio::time::sleep(TICK * (GROW_TICKS + 10)).await;
        assert_eq!(s.mode(), AcceptSteering::Spread, "the switch was made");
        assert_eq!(s.active(), 3, "a tick published over the switch");
        // Back to adaptive: k starts again at 1 and the controller grows it
        // from a fresh policy.
        s.set_mode(AcceptSteering::Adaptive);
        assert_eq!(s.active(), 1);
        // (The switch forgot the stretches begun while spread.)
        for i in 0..3 {
            s.unparked(i);
        }
        let mut rx = s.active.subscribe();
        tokio::time::timeout(TICK * 100, rx.changed())
            .await
            .expect("the controller grew k again")
            .unwrap();
        assert_eq!(*rx.borrow_and_update(), 2);
        task.abort();
    }

    /// A daemon with `workers` workers, `steering`, and one TCP service in
    /// front of an echo backend; returns it and the service's address.
    fn daemon(
        workers: usize,
        steering: AcceptSteering,
    ) -> (crate::daemon::DaemonHandle, std::net::SocketAddr) {
        let baddr = crate::daemon::tests::echo_backend();
        let text = format!(
            "[daemon]\nworkers = {workers}\naccept_steering = \"{}\"\n\
             [[service]]\nname = \"web\"\nprotocol = \"tcp\"\nlisten = \"127.0.0.1:0\"\n\
             scheduler = \"rr\"\n[[service.backend]]\naddress = \"{baddr}\"\n",
            steering.as_str()
        );
        let cfg = crate::config::parse(&text, "test.toml").unwrap();
        assert_eq!(cfg.daemon.accept_steering, steering);
        let d = crate::daemon::Daemon::start(cfg, None).unwrap();
        let addr = d
            .service_addr(crate::daemon::DEFAULT_TENANT, "web")
            .unwrap();
        (d, addr)
    }

    /// `n` connections through the proxy one after another, each a round
    /// trip (so weir accepted it), then closed.
    fn round_trips(addr: std::net::SocketAddr, n: usize) {
        use std::io::{Read, Write};
        for _ in 0..n {
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            c.write_all(b"x").unwrap();
            let mut b = [0u8; 1];
            c.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"x");
        }
    }

    /// Waits (10 s at most) until `s` attached `n` programs in all.
    fn wait_applied(s: &Steering, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.applied() < n {
            assert!(Instant::now() < deadline, "no program attached");
            std::thread::yield_now();
        }
    }

    /// Adaptive, light load: every connection goes to worker 0 (k stays
    /// 1). Published k = 2 of 3: worker 0's listener points the group at
    /// the first two, which then share the connections and the third gets
    /// none. The kernel's hash, before, gave each of 60 connections to any
    /// worker.
    #[test]
    fn a_daemon_packs_light_load_on_one_worker_and_follows_k() {
        let (d, addr) = daemon(3, AcceptSteering::Adaptive);
        let s = d.shared.steering.clone();
        wait_applied(&s, 1);
        round_trips(addr, 60);
        assert_eq!(s.accepted_by_worker(), [60, 0, 0]);
        assert_eq!(s.active(), 1, "light load moved k");
        s.set_active(2);
        wait_applied(&s, 2);
        round_trips(addr, 120);
        let got = s.accepted_by_worker();
        assert_eq!(got.iter().sum::<u64>(), 180, "{got:?}");
        assert!(got[0] > 60 && got[1] > 0 && got[2] == 0, "{got:?}");
    }

    /// A reload switches the mode live: a spread daemon set to adaptive
    /// sends the next connections all to worker 0 (k starts at 1), and set
    /// back to spread takes the program off, so the kernel's hash gives
    /// every worker some again.
    #[test]
    fn the_mode_switches_live() {
        let (d, addr) = daemon(3, AcceptSteering::Spread);
        let s = d.shared.steering.clone();
        let since = |before: &[u64]| -> Vec<u64> {
            s.accepted_by_worker()
                .iter()
                .zip(before)
                .map(|(a, b)| a - b)
                .collect()
        };
        round_trips(addr, 60);
        let spread = s.accepted_by_worker();
        // 60 connections by the hash missing one of three workers: a
        // chance of 3 * (2/3)^60.
        assert!(spread.iter().all(|c| *c > 0), "{spread:?}");
        assert_eq!(s.applied(), 0);

        s.set_mode(AcceptSteering::Adaptive);
        assert_eq!((s.mode(), s.active()), (AcceptSteering::Adaptive, 1));
        wait_applied(&s, 1);
        round_trips(addr, 60);
        assert_eq!(since(&spread), [60, 0, 0]);
        assert_eq!(s.stats().steering, "adaptive");

        let packed = s.accepted_by_worker();
        s.set_mode(AcceptSteering::Spread);
        assert_eq!((s.mode(), s.active()), (AcceptSteering::Spread, 3));
        wait_applied(&s, 2);
        round_trips(addr, 60);
        let got = since(&packed);
        assert!(got.iter().all(|c| *c > 0), "{got:?}");
    }

    /// "spread": no program, the kernel's hash over every worker.
    #[test]
    fn a_spread_daemon_leaves_the_choice_to_the_kernel() {
        let (d, addr) = daemon(2, AcceptSteering::Spread);
        let s = d.shared.steering.clone();
        round_trips(addr, 60);
        let got = s.accepted_by_worker();
        assert_eq!(got.iter().sum::<u64>(), 60);
        // All 60 on one of two workers by the hash: a chance of 2^-59.
        assert!(got.iter().all(|c| *c > 0), "{got:?}");
        assert_eq!(s.applied(), 0);
    }

    /// The programs against the kernel: a real group of listeners on
    /// loopback, connections made to it, and where they queued.
    #[test]
    fn the_program_sends_connections_to_the_first_k_listeners() {
        use crate::config::Protocol;
        use std::net::{SocketAddr, TcpListener, TcpStream};
        let accepted = |listeners: &[TcpListener]| -> Vec<usize> {
            listeners
                .iter()
                .map(|l| std::iter::from_fn(|| l.accept().ok()).count())
                .collect()
        };
        for (k, n) in [(1usize, 3usize), (2, 3), (3, 3)] {
            let (socks, addr) = super::super::open_sockets(
                Protocol::Tcp,
                "127.0.0.1:0".parse::<SocketAddr>().unwrap(),
                n,
                0,
            )
            .unwrap();
            let listeners: Vec<TcpListener> = socks
                .into_iter()
                .map(|s| match s {
                    super::super::ListenSocket::Tcp(l) => l,
                    super::super::ListenSocket::Udp(_) => unreachable!(),
                })
                .collect();
            attach(&listeners[0], &program(k, n)).unwrap();
            // Connected means queued on one listener (the handshake is done
            // by the kernel); hold them so none is reset before the count.
            let conns: Vec<TcpStream> = (0..120)
                .map(|_| TcpStream::connect(addr).unwrap())
                .collect();
            let got = accepted(&listeners);
            assert_eq!(got.iter().sum::<usize>(), conns.len(), "k={k}: {got:?}");
            for (i, c) in got.iter().enumerate() {
                if i < k {
                    // 120 connections over k listeners at random (or by
                    // the kernel's hash): each gets some but for a chance
                    // under 3 * (2/3)^120.
                    assert!(*c > 0, "k={k}: listener {i} got none: {got:?}");
                } else {
                    assert_eq!(*c, 0, "k={k}: listener {i} is past k: {got:?}");
                }
            }
        }
    }
}

//! `rr` and `wrr`: the schedulers with a cursor.
//!
//! IPVS keeps the cursor under a spinlock. Here the whole cursor is one
//! `AtomicU64` and a pick computes the next state from the current one and
//! installs it with a CAS, retrying on contention (lock-free). Each successful
//! pick is exactly one step of the IPVS state machine, so the multiset of picks
//! made by several threads equals that of a single thread making as many.
//!
//! Both need only `Relaxed` ordering: the cursor publishes no other data.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::{BackendInfo, gcd};

/// Cursor value meaning "the list head", i.e. before the first backend.
const HEAD: u32 = u32::MAX;

/// Round robin: the next available backend after the previous pick.
#[derive(Debug)]
pub(crate) struct Rr {
    /// Index of the previous pick, or `HEAD`.
    last: AtomicU64,
}

impl Rr {
    pub(crate) fn new(last_pick: Option<usize>) -> Self {
        let last = last_pick
            .and_then(|i| u32::try_from(i).ok())
            .unwrap_or(HEAD);
        Self {
            last: AtomicU64::new(u64::from(last)),
        }
    }

    pub(crate) fn last_pick(&self) -> Option<usize> {
        match u32::try_from(self.last.load(Relaxed)) {
            Ok(HEAD) | Err(_) => None,
            Ok(i) => Some(i as usize),
        }
    }

    pub(crate) fn pick(&self, backends: &[BackendInfo]) -> Option<usize> {
        let n = backends.len();
        let mut cur = self.last.load(Relaxed);
        loop {
            let start = match usize::try_from(cur) {
                Ok(i) if i < n => i + 1,
                _ => 0,
            };
            // At most one full turn: every backend is looked at once.
            let next = (0..n)
                .map(|k| (start + k) % n)
                .find(|&i| backends[i].available())?;
            match self
                .last
                .compare_exchange_weak(cur, next as u64, Relaxed, Relaxed)
            {
                Ok(_) => return Some(next),
                Err(actual) => cur = actual,
            }
        }
    }
}

/// Weighted round robin with IPVS's stepping: `mw` is the largest weight
/// minus `di - 1` where `di` is the gcd of the weights; passes over the list
/// run with the current weight `cw = mw, mw - di, ...` down to `> 0`, and a
/// pass picks every available backend whose weight is `>= cw`.
///
/// Unlike IPVS, `mw` and `di` are computed over available backends only (a
/// down backend's weight does not create empty passes); proportions are the
/// same.
#[derive(Debug)]
pub(crate) struct Wrr {
    /// `(cl << 32) | cw`: previous pick (or `HEAD`) and current weight.
    state: AtomicU64,
    mw: u32,
    di: u32,
}

fn pack(cl: u32, cw: u32) -> u64 {
    (u64::from(cl) << 32) | u64::from(cw)
}

fn unpack(s: u64) -> (u32, u32) {
    ((s >> 32) as u32, s as u32)
}

impl Wrr {
    /// `old_cw` is the current weight of the scheduler this one replaces;
    /// it is adjusted as IPVS `ip_vs_wrr_dest_changed` does.
    pub(crate) fn new(backends: &[BackendInfo], old_cw: Option<u32>) -> Self {
        let avail = || backends.iter().filter(|b| b.available()).map(|b| b.weight);
        let di = avail().fold(0, gcd).max(1);
        let max = avail().max().unwrap_or(0);
        let mw = if max == 0 { 0 } else { max - (di - 1) };
        let cw = match old_cw {
            Some(cw) if cw != 0 && cw <= mw && di > 1 => (cw / di) * di + 1,
            Some(cw) if cw != 0 && cw <= mw => cw,
            _ => mw,
        };
        Self {
            state: AtomicU64::new(pack(HEAD, cw)),
            mw,
            di,
        }
    }

    pub(crate) fn current_weight(&self) -> u32 {
        unpack(self.state.load(Relaxed)).1
    }

    pub(crate) fn pick(&self, backends: &[BackendInfo]) -> Option<usize> {
        if self.mw == 0 {
            return None;
        }
        let mut cur = self.state.load(Relaxed);
        loop {
            let (idx, next) = self.step(backends, cur);
            match self
                .state
                .compare_exchange_weak(cur, next, Relaxed, Relaxed)
            {
                Ok(_) => return Some(idx),
                Err(actual) => cur = actual,
            }
        }
    }

    /// One IPVS step from state `s`. Requires `mw > 0`, so some available
    /// backend has weight `>= mw >= cw`: the scan ends within two passes.
    fn step(&self, backends: &[BackendInfo], s: u64) -> (usize, u64) {
        let n = backends.len();
        let (cl, cw) = unpack(s);
        let mut cw = if cw == 0 || cw > self.mw { self.mw } else { cw };
        let mut i = if cl == HEAD { 0 } else { cl as usize + 1 };
        loop {
            if i >= n {
                // End of the list: next pass with a lower current weight.
                i = 0;
                cw = if cw > self.di { cw - self.di } else { self.mw };
            }
            let b = &backends[i];
            if b.available() && b.weight >= cw {
                return (i, pack(i as u32, cw));
            }
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::test_util::*;
    use crate::{Load, SchedulerKind, SplitMix64};

    fn sequence(s: &crate::Scheduler, n: usize) -> Vec<usize> {
        let idle: &[Load] = &[];
        let mut rng = SplitMix64::new(0);
        (0..n)
            .map(|i| s.pick(client(i as u32), idle, &mut rng).expect("available"))
            .collect()
    }

    #[test]
    fn rr_cycles_and_skips_unavailable() {
        let mut set = vec![backend(1, 1), backend(2, 0), backend(3, 7), backend(4, 1)];
        set[3].up = false;
        let s = sched(SchedulerKind::Rr, &set);
        // Weights other than 0 do not matter to rr.
        assert_eq!(sequence(&s, 6), [0, 2, 0, 2, 0, 2]);
    }

    #[test]
    fn rr_rebuild_continues_after_previous_pick() {
        let set = [backend(1, 1), backend(2, 1), backend(3, 1)];
        let s = sched(SchedulerKind::Rr, &set);
        assert_eq!(sequence(&s, 2), [0, 1]);
        // Backend 1 moves to the end; the next pick follows it, as IPVS's
        // cursor stays on the same destination.
        let moved = [backend(1, 1), backend(3, 1), backend(4, 1), backend(2, 1)];
        let s = s.rebuild(&moved).expect("valid");
        assert_eq!(sequence(&s, 3), [0, 1, 2]);
    }

    #[test]
    fn wrr_sequence_over_one_cycle_is_exact() {
        let set = [backend(1, 4), backend(2, 3), backend(3, 2)];
        let s = sched(SchedulerKind::Wrr, &set);
        // cw = 4: A; cw = 3: A B; cw = 2: A B C; cw = 1: A B C.
        let one = [0, 0, 1, 0, 1, 2, 0, 1, 2];
        assert_eq!(sequence(&s, 18), [one, one].concat());
    }

    #[test]
    fn wrr_steps_by_gcd() {
        // gcd 2, mw = 6 - 1 = 5: passes cw = 5, 3, 1.
        let set = [backend(1, 6), backend(2, 2), backend(3, 0), backend(4, 4)];
        let s = sched(SchedulerKind::Wrr, &set);
        assert_eq!(sequence(&s, 6), [0, 0, 3, 0, 1, 3]);
        let h = histogram(&s, 6 * 100);
        assert_eq!(h, [300, 100, 0, 200, 0]);
    }

    #[test]
    fn wrr_down_backend_does_not_distort() {
        let mut set = vec![backend(1, 10), backend(2, 1), backend(3, 2)];
        set[0].up = false;
        let s = sched(SchedulerKind::Wrr, &set);
        assert_eq!(sequence(&s, 6), [2, 1, 2, 2, 1, 2]);
    }

    #[test]
    fn wrr_concurrent_picks_keep_exact_proportions() {
        let set = [backend(1, 5), backend(2, 3), backend(3, 1), backend(4, 1)];
        let s = sched(SchedulerKind::Wrr, &set);
        const THREADS: usize = 4;
        const PER_THREAD: usize = 25_000; // 10_000 cycles of length 10 in total
        let counts: Vec<[u32; 4]> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..THREADS)
                .map(|_| {
                    scope.spawn(|| {
                        let mut c = [0u32; 4];
                        let idle: &[Load] = &[];
                        let mut rng = SplitMix64::new(0);
                        for i in 0..PER_THREAD {
                            let b = s.pick(client(i as u32), idle, &mut rng).expect("available");
                            c[b] += 1;
                        }
                        c
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("no panic"))
                .collect()
        });
        let total: Vec<u32> = (0..4).map(|b| counts.iter().map(|c| c[b]).sum()).collect();
        let cycles = (THREADS * PER_THREAD / 10) as u32;
        assert_eq!(total, [5 * cycles, 3 * cycles, cycles, cycles]);
    }

    #[test]
    fn rr_concurrent_picks_are_fair() {
        let set = [backend(1, 1), backend(2, 1), backend(3, 1)];
        let s = sched(SchedulerKind::Rr, &set);
        let counts: Vec<[u32; 3]> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..3)
                .map(|_| {
                    scope.spawn(|| {
                        let mut c = [0u32; 3];
                        let idle: &[Load] = &[];
                        let mut rng = SplitMix64::new(0);
                        for i in 0..30_000u32 {
                            c[s.pick(client(i), idle, &mut rng).expect("available")] += 1;
                        }
                        c
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("no panic"))
                .collect()
        });
        let total: Vec<u32> = (0..3).map(|b| counts.iter().map(|c| c[b]).sum()).collect();
        assert_eq!(total, [30_000, 30_000, 30_000]);
    }

    #[test]
    fn wrr_rebuild_adjusts_current_weight_like_ipvs() {
        let set = [backend(1, 4), backend(2, 3), backend(3, 2)];
        let s = sched(SchedulerKind::Wrr, &set);
        assert_eq!(sequence(&s, 2), [0, 0]); // now in the cw = 3 pass
        // Same set: the pass continues from the list head with cw = 3.
        let s = s.rebuild(&set).expect("valid");
        assert_eq!(sequence(&s, 4), [0, 1, 0, 1]);
        // Weights shrink below cw: restart at the new mw.
        let small = [backend(1, 1), backend(2, 1)];
        let s = s.rebuild(&small).expect("valid");
        assert_eq!(sequence(&s, 4), [0, 1, 0, 1]);
    }
}

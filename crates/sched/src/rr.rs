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

use crate::{BackendInfo, LoadView, can_take, gcd};

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

    /// The next backend after the previous pick that can take a
    /// connection: an overloaded one is passed over as IPVS's `rr` passes
    /// over an `OVERLOAD` destination, so the rotation goes on over the
    /// others.
    pub(crate) fn pick<L: LoadView + ?Sized>(
        &self,
        backends: &[BackendInfo],
        load: &L,
    ) -> Option<usize> {
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
                .find(|&i| can_take(&backends[i], i, load))?;
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

    pub(crate) fn pick<L: LoadView + ?Sized>(
        &self,
        backends: &[BackendInfo],
        load: &L,
    ) -> Option<usize> {
        if self.mw == 0 {
            return None;
        }
        let mut cur = self.state.load(Relaxed);
        loop {
            let (idx, next) = self.step(backends, load, cur)?;
            match self
                .state
                .compare_exchange_weak(cur, next, Relaxed, Relaxed)
            {
                Ok(_) => return Some(idx),
                Err(actual) => cur = actual,
            }
        }
    }

    /// One IPVS step from state `s`: the next available backend that is not
    /// overloaded (IPVS's `wrr` passes over an `OVERLOAD` destination) and
    /// whose weight is `>= cw`. Requires `mw > 0`.
    ///
    /// Without overloaded backends the scan ends within two passes: some
    /// available backend has weight `>= mw >= cw`, so a pass begun at the
    /// list head always picks. A pass begun at the head that picks nothing
    /// means that every backend of weight `>= cw` is overloaded; IPVS then
    /// steps `cw` down pass after pass, up to `mw / di` empty passes. Here
    /// one scan finds the largest weight `m` that can still take one and
    /// `cw` jumps to the value of IPVS's sequence that first gets there
    /// (the passes skipped would have picked nothing, so the sequence of
    /// picks is IPVS's), or the step gives `None` when none can. A backend
    /// that fills between the scan and the next pass can make that pass
    /// empty too (or, with the scan racing the counts, find `m >= cw`):
    /// after two jumps the step gives up with `None`, so a step looks at
    /// each backend at most seven times.
    fn step<L: LoadView + ?Sized>(
        &self,
        backends: &[BackendInfo],
        load: &L,
        s: u64,
    ) -> Option<(usize, u64)> {
        let n = backends.len();
        let (cl, cw) = unpack(s);
        let mut cw = if cw == 0 || cw > self.mw { self.mw } else { cw };
        let mut i = if cl == HEAD { 0 } else { cl as usize + 1 };
        // Whether the current pass began at the list head.
        let mut whole = i == 0;
        let mut jumps = 0;
        loop {
            if i >= n {
                // End of the list: next pass with a lower current weight.
                if whole {
                    // Every backend of weight >= cw is overloaded.
                    let m = (0..n)
                        .filter(|&j| can_take(&backends[j], j, load))
                        .map(|j| backends[j].weight)
                        .max()?;
                    if jumps == 2 {
                        return None;
                    }
                    jumps += 1;
                    // `m` is a multiple of `di` below `cw` (a backend of
                    // weight >= cw that can take one would have been
                    // picked, unless it freed a place since), so this is
                    // `cw - k * di` for the least k that reaches `<= m`,
                    // and it stays above `m - di >= 0`.
                    cw -= cw.saturating_sub(m).div_ceil(self.di) * self.di;
                } else {
                    cw = if cw > self.di { cw - self.di } else { self.mw };
                }
                i = 0;
                whole = true;
            }
            let b = &backends[i];
            if b.available() && b.weight >= cw && !load.load(i).overloaded {
                return Some((i, pack(i as u32, cw)));
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

    /// `n` picks with `loads` (some overloaded).
    fn sequence_with(s: &crate::Scheduler, loads: &[Load], n: usize) -> Vec<Option<usize>> {
        let mut rng = SplitMix64::new(0);
        (0..n)
            .map(|i| s.pick(client(i as u32), loads, &mut rng))
            .collect()
    }

    fn full() -> Load {
        Load::default().with_overload(true)
    }

    #[test]
    fn rr_passes_over_an_overloaded_backend() {
        let set = [backend(1, 1), backend(2, 1), backend(3, 1)];
        let s = sched(SchedulerKind::Rr, &set);
        let loads = [Load::default(), full(), Load::default()];
        let got = sequence_with(&s, &loads, 6);
        assert_eq!(got, [0, 2, 0, 2, 0, 2].map(Some));
        // Free again: the rotation goes on from where it was.
        assert_eq!(sequence(&s, 3), [0, 1, 2]);
        assert_eq!(
            sequence_with(&s, &[full(), full(), full()], 2),
            [None, None]
        );
    }

    #[test]
    fn wrr_keeps_its_passes_over_the_others() {
        // cw = 4: (A full); cw = 3: B; cw = 2: B C; cw = 1: B C.
        let set = [backend(1, 4), backend(2, 3), backend(3, 2)];
        let s = sched(SchedulerKind::Wrr, &set);
        let loads = [full(), Load::default(), Load::default()];
        let one = [1, 1, 2, 1, 2].map(Some);
        assert_eq!(sequence_with(&s, &loads, 10), [one, one].concat());
        // The heaviest two full: C alone, once per pass it is in.
        let loads = [full(), full(), Load::default()];
        assert_eq!(sequence_with(&s, &loads, 3), [Some(2); 3]);
        assert_eq!(
            sequence_with(&s, &[full(), full(), full()], 2),
            [None, None]
        );
        // gcd 2, mw 5, passes cw = 5, 3, 1: with the 6 full, the 4 is in
        // two passes and the 2 in one, the IPVS sequence without the 6.
        let set = [backend(1, 6), backend(2, 2), backend(3, 4)];
        let s = sched(SchedulerKind::Wrr, &set);
        let loads = [full(), Load::default(), Load::default()];
        let h = sequence_with(&s, &loads, 300);
        assert_eq!(&h[..3], [2, 1, 2].map(Some));
        let count = |b| h.iter().filter(|&&x| x == Some(b)).count();
        assert_eq!((count(0), count(1), count(2)), (0, 100, 200));
    }

    /// The largest weight of 65,535 passes when full: the step jumps to
    /// the light backend's pass instead of stepping down 65,534 empty ones.
    #[test]
    fn wrr_jumps_over_empty_passes() {
        let set = [backend(1, crate::MAX_WEIGHT), backend(2, 1)];
        let s = sched(SchedulerKind::Wrr, &set);
        let counted = std::cell::Cell::new(0u32);
        let loads = |i: usize| {
            counted.set(counted.get() + 1);
            if i == 0 { full() } else { Load::default() }
        };
        let mut rng = SplitMix64::new(0);
        for n in 0..3 {
            assert_eq!(s.pick(client(n), &loads, &mut rng), Some(1));
        }
        assert!(counted.get() <= 3 * 7 * 2, "{} loads read", counted.get());
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

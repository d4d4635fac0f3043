//! Randomised schedule exploration of the real engine with shuttle:
//! `RUSTFLAGS="--cfg shuttle" cargo test -p weir-rate --release --test shuttle`.
//! Under `cfg(shuttle)` the crate's atomics and mutexes are shuttle's and a
//! chunk holds 4 estimators, so a few adds already span several chunks.
#![cfg(shuttle)]

use std::collections::HashSet;
use std::time::Duration;

use shuttle::sync::Arc;
use shuttle::sync::atomic::{AtomicU64, Ordering};
use shuttle::thread;
use weir_rate::{Config, ESTIMATORS_PER_CHUNK as CHUNK, Engine, Totals};

const ITERATIONS: usize = 2000;

fn engine(workers: usize) -> Engine {
    Engine::new(
        workers,
        Config {
            slots: 2,
            ..Config::default()
        },
    )
    .unwrap()
}

/// Ticks through `periods` whole periods starting after `from`; returns the
/// next time and the summed reports' (started, freed).
fn run_periods(e: &Engine, from: Duration, periods: u32) -> (Duration, u64, u64) {
    let step = e.config().tick_interval();
    let mut now = from;
    let (mut started, mut freed) = (0, 0);
    for _ in 0..periods * e.config().slots + 1 {
        now += step;
        let r = e.tick(now);
        started += r.started;
        freed += r.freed;
    }
    (now, started, freed)
}

/// Spins (yielding to shuttle) until the ticker has finished `n` ticks.
fn wait_ticks(done: &AtomicU64, n: u64) {
    while done.load(Ordering::Acquire) < n {
        thread::yield_now();
    }
}

fn add_drop_clone(e: &Engine) {
    let keep = e.add();
    let a = e.add();
    let b = a.clone();
    let done = Arc::new(AtomicU64::new(0));
    let e1 = e.clone();
    let d1 = Arc::clone(&done);
    let t = thread::spawn(move || {
        let mut now = Duration::ZERO;
        for _ in 0..4 {
            e1.tick(now);
            d1.fetch_add(1, Ordering::Release);
            now += e1.config().tick_interval();
        }
        now
    });
    let adder = {
        let e = e.clone();
        let done = Arc::clone(&done);
        thread::spawn(move || {
            wait_ticks(&done, 1);
            let x: Vec<_> = (0..CHUNK + 1).map(|_| e.add()).collect();
            x[0].worker(1).conns(2);
            drop(x);
        })
    };
    let dropper = {
        let done = Arc::clone(&done);
        thread::spawn(move || {
            // Race the first visit of `a` (slot 0, the third tick).
            wait_ticks(&done, 2);
            b.worker(0).conn();
            drop(b);
        })
    };
    a.worker(1).conn();
    wait_ticks(&done, 2);
    drop(a);
    keep.worker(0).conns(7);
    let now = t.join().unwrap();
    adder.join().unwrap();
    dropper.join().unwrap();
    // Within two periods every removed estimator is freed exactly once.
    let (_, _, _) = run_periods(e, now, 2);
    let s = e.stats();
    assert_eq!(s.estimators, 1, "{s:?}");
    // Free ids are distinct and come back clean.
    let again: Vec<_> = (0..s.chunks * CHUNK - 1).map(|_| e.add()).collect();
    let ids: HashSet<u32> = again.iter().map(|x| x.id()).chain([keep.id()]).collect();
    assert_eq!(ids.len(), again.len() + 1);
    assert_eq!(e.stats().chunks, s.chunks);
    for x in &again {
        assert_eq!(x.totals(), Totals::default());
    }
    assert_eq!(keep.totals().conns, 7);
}

#[test]
fn add_drop_and_clone_race_the_ticker() {
    shuttle::check_random(|| add_drop_clone(&engine(2)), ITERATIONS);
    shuttle::check_pct(|| add_drop_clone(&engine(2)), ITERATIONS, 3);
}

#[test]
fn zero_races_a_visit_and_is_applied_once() {
    shuttle::check_random(
        || {
            let e = engine(1);
            let x = e.add();
            let (now, started, _) = run_periods(&e, Duration::ZERO, 1);
            assert_eq!(started, 1);
            x.worker(0).conns(1000);
            let (now, _, _) = run_periods(&e, now, 1);
            assert!(x.rates().cps > 0);
            let x2 = x.clone();
            let z = thread::spawn(move || {
                x2.zero();
                x2.worker(0).conns(5);
            });
            let e1 = e.clone();
            let t = thread::spawn(move || {
                let mut now = now;
                for _ in 0..e1.config().slots {
                    now += e1.config().tick_interval();
                    e1.tick(now);
                }
                now
            });
            z.join().unwrap();
            let now = t.join().unwrap();
            let (_, _, _) = run_periods(&e, now, 2);
            assert_eq!(x.totals().conns, 5);
            // Only the 5 connections after zero() reach the average.
            let raw = x.raw_rates();
            assert!(raw[0] < 5 << 9, "{raw:?}");
            assert!(raw[0] > 0, "{raw:?}");
        },
        ITERATIONS,
    );
}

#[test]
fn worker_updates_during_visits_are_all_counted() {
    shuttle::check_random(
        || {
            let e = engine(2);
            let x = e.add();
            let (now, _, _) = run_periods(&e, Duration::ZERO, 1);
            let ws: Vec<_> = (0..2)
                .map(|w| {
                    let x = x.clone();
                    thread::spawn(move || {
                        for _ in 0..3 {
                            x.worker(w).conn();
                        }
                    })
                })
                .collect();
            let e1 = e.clone();
            let t = thread::spawn(move || {
                let mut now = now;
                for _ in 0..2 * e1.config().slots {
                    now += e1.config().tick_interval();
                    e1.tick(now);
                }
                now
            });
            for w in ws {
                w.join().unwrap();
            }
            let mut now = t.join().unwrap();
            assert_eq!(x.totals().conns, 6);
            // No visit saw more than the 6 counts (a torn `last` would show up
            // as a huge wrapped delta).
            for _ in 0..3 {
                assert!(x.raw_rates()[0] <= 6 << 9, "{:?}", x.raw_rates());
                now = run_periods(&e, now, 1).0;
            }
            // Whatever the interleaving, the deltas the ticker saw add up to 6:
            // after enough quiet periods the average decays, and one more
            // count moves it by exactly one period's rate.
            let (now, _, _) = run_periods(&e, now, 40);
            assert_eq!(x.raw_rates()[0], 0);
            x.worker(0).conn();
            // Exactly one period of ticks: exactly one visit.
            let mut now = now;
            for _ in 0..e.config().slots {
                now += e.config().tick_interval();
                e.tick(now);
            }
            assert_eq!(x.raw_rates()[0], (1 << 9) >> 2);
        },
        ITERATIONS,
    );
}

//! Threads: workers update counters, others add/remove and read, while a
//! ticker runs. Every loop is bounded in count; the ticker uses a fake clock.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use weir_rate::{Config, Engine, Totals};

fn cfg() -> Config {
    Config {
        slots: 20,
        ..Config::default()
    }
}

/// Runs a ticker with a fake clock advancing one slot per call until `stop`
/// (at most `max_ticks` calls). Returns how many ticks ran estimators.
fn ticker_counting(
    engine: Engine,
    stop: Arc<AtomicBool>,
    max_ticks: u64,
    ticks: Arc<AtomicU64>,
) -> thread::JoinHandle<u64> {
    thread::spawn(move || {
        let step = engine.config().tick_interval();
        let mut now = Duration::ZERO;
        let mut busy = 0;
        for _ in 0..max_ticks {
            if stop.load(Ordering::Acquire) {
                break;
            }
            let r = engine.tick(now);
            if r.processed + r.started > 0 {
                busy += 1;
            }
            now += step;
            ticks.fetch_add(1, Ordering::Release);
            thread::yield_now();
        }
        busy
    })
}

#[test]
fn counters_updated_from_threads_while_estimating_lose_nothing() {
    let workers = 3;
    let per_worker: u64 = 200_000;
    let engine = Engine::new(workers, cfg()).unwrap();
    let ests: Arc<Vec<_>> = Arc::new((0..64).map(|_| engine.add()).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let ticks = Arc::new(AtomicU64::new(0));
    let t = ticker_counting(
        engine.clone(),
        Arc::clone(&stop),
        10_000_000,
        Arc::clone(&ticks),
    );
    let start = Arc::new(Barrier::new(workers + 1));
    let writers: Vec<_> = (0..workers)
        .map(|w| {
            let ests = Arc::clone(&ests);
            let start = Arc::clone(&start);
            let ticks = Arc::clone(&ticks);
            thread::spawn(move || {
                start.wait();
                for k in 0..per_worker {
                    if k.is_multiple_of(1000) {
                        // Interleave with the ticker: wait (bounded) for one more tick.
                        let seen = ticks.load(Ordering::Acquire);
                        for _ in 0..1_000_000 {
                            if ticks.load(Ordering::Acquire) > seen {
                                break;
                            }
                            thread::yield_now();
                        }
                    }
                    let c = ests[(k % 64) as usize].worker(w);
                    c.conn();
                    c.rx(1, 100 + w as u64);
                    c.tx(2, k % 7);
                }
            })
        })
        .collect();
    // A reader racing everything: totals never go backwards.
    let reader = {
        let ests = Arc::clone(&ests);
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            let mut last = 0;
            for _ in 0..2_000_000 {
                if stop.load(Ordering::Acquire) {
                    break;
                }
                let c: u64 = ests.iter().map(|e| e.totals().conns).sum();
                assert!(c >= last, "{c} < {last}");
                last = c;
            }
        })
    };
    start.wait();
    for w in writers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Release);
    let busy = t.join().unwrap();
    reader.join().unwrap();
    assert!(busy > 0, "the ticker never ran estimators");

    let mut sum = Totals::default();
    for (i, e) in ests.iter().enumerate() {
        let t = e.totals();
        // Each estimator gets per_worker/64 updates from each worker.
        assert_eq!(t.conns, workers as u64 * per_worker / 64, "estimator {i}");
        sum.conns += t.conns;
        sum.inpkts += t.inpkts;
        sum.outpkts += t.outpkts;
        sum.inbytes += t.inbytes;
        sum.outbytes += t.outbytes;
    }
    let n = workers as u64 * per_worker;
    assert_eq!(sum.conns, n);
    assert_eq!(sum.inpkts, n);
    assert_eq!(sum.outpkts, 2 * n);
    let inbytes: u64 = (0..workers as u64).map(|w| (100 + w) * per_worker).sum();
    assert_eq!(sum.inbytes, inbytes);
    let outbytes: u64 = (0..per_worker).map(|k| k % 7).sum::<u64>() * workers as u64;
    assert_eq!(sum.outbytes, outbytes);
}

#[test]
fn add_and_remove_from_threads_while_ticking() {
    let engine = Engine::new(2, cfg()).unwrap();
    let stable: Vec<_> = (0..500).map(|_| engine.add()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let ticks = Arc::new(AtomicU64::new(0));
    let t = ticker_counting(
        engine.clone(),
        Arc::clone(&stop),
        10_000_000,
        Arc::clone(&ticks),
    );
    // The churn must overlap ticking: on a loaded machine the ticker thread
    // may not have run at all before the churners finish (CI saw
    // `next_due()` still None below). Bounded wait for its first tick.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while ticks.load(Ordering::Acquire) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the ticker never ticked"
        );
        thread::yield_now();
    }
    let churners: Vec<_> = (0..2)
        .map(|w| {
            let engine = engine.clone();
            thread::spawn(move || {
                let mut held = Vec::new();
                for k in 0..20_000u32 {
                    let e = engine.add();
                    e.worker(w).conn();
                    held.push(e);
                    if k % 3 != 0 {
                        // Drop an older one (clone first: the drop of the last clone removes).
                        let i = (k as usize * 7) % held.len();
                        let c = held[i].clone();
                        held.swap_remove(i);
                        drop(c);
                    }
                }
                held.len()
            })
        })
        .collect();
    let mut kept = 0;
    for c in churners {
        kept += c.join().unwrap();
    }
    // The churners dropped everything they held on return.
    stop.store(true, Ordering::Release);
    t.join().unwrap();
    assert!(kept > 0);
    // Two more periods of ticks free every removed estimator.
    let step = engine.config().tick_interval();
    let mut now = engine.next_due().unwrap();
    for _ in 0..(2 * engine.config().slots + 2) {
        engine.tick(now);
        now += step;
    }
    // One more tick hands the last freed ids back even if a try_lock missed.
    engine.tick(now);
    let s = engine.stats();
    assert_eq!(s.estimators, stable.len(), "{s:?}");
    // Freed ids are reused: adding as many as were churned needs no new chunk.
    let again: Vec<_> = (0..s.chunks * 256 - 500).map(|_| engine.add()).collect();
    assert_eq!(engine.stats().chunks, s.chunks);
    assert_eq!(engine.stats().estimators, s.chunks * 256);
    drop(again);
    for e in &stable {
        assert_eq!(e.totals(), Totals::default());
    }
}

#[test]
fn zero_from_several_threads_coalesces() {
    let engine = Engine::new(1, cfg()).unwrap();
    let e = engine.add();
    e.worker(0).conns(1000);
    thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..1000 {
                    e.zero();
                }
            });
        }
    });
    assert_eq!(e.totals().conns, 0);
    e.worker(0).conns(5);
    assert_eq!(e.totals().conns, 5);
}

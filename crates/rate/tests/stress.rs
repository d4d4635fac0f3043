//! Everything at once: writers on stable estimators, a churner adding,
//! cloning, zeroing and dropping its own, a reader, and a fake-clock ticker.
//! The short version runs by default; the long one is `#[ignore]`d.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use weir_rate::{Config, Engine, Estimator, Rates, Totals};

const STABLE: usize = 32;

fn stress(ops: u64) {
    let workers = 3; // 0 and 1: stable writers; 2: the churner's own estimators
    let engine = Engine::new(
        workers,
        Config {
            slots: 16,
            ..Config::default()
        },
    )
    .unwrap();
    let stable: Arc<Vec<Estimator>> = Arc::new((0..STABLE).map(|_| engine.add()).collect());
    let stop = Arc::new(AtomicBool::new(false));

    let ticker = {
        let engine = engine.clone();
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            let mut now = Duration::ZERO;
            let mut freed = 0;
            for _ in 0..50_000_000u64 {
                if stop.load(Ordering::Acquire) {
                    break;
                }
                freed += engine.tick(now).freed;
                now += engine.config().tick_interval();
                thread::yield_now();
            }
            (now, freed)
        })
    };
    let writers: Vec<_> = (0..2)
        .map(|w| {
            let stable = Arc::clone(&stable);
            thread::spawn(move || {
                for k in 0..ops {
                    let c = stable[(k as usize * 7 + w) % STABLE].worker(w);
                    c.conn();
                    c.rx(1, 64);
                    if k % 256 == 0 {
                        thread::yield_now();
                    }
                }
            })
        })
        .collect();
    let churner = {
        let engine = engine.clone();
        thread::spawn(move || {
            let mut mine: Vec<Estimator> = Vec::new();
            let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
            for _ in 0..ops / 4 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                match x % 8 {
                    0..=2 => {
                        let e = engine.add();
                        // A new or reused estimator starts clean.
                        assert_eq!(e.read(), (Totals::default(), Rates::default()));
                        mine.push(e);
                    }
                    3 | 4 if !mine.is_empty() => {
                        let i = (x >> 8) as usize % mine.len();
                        mine.swap_remove(i);
                    }
                    5 if !mine.is_empty() => {
                        let i = (x >> 8) as usize % mine.len();
                        let c = mine[i].clone();
                        mine.push(c);
                    }
                    6 if !mine.is_empty() => {
                        let i = (x >> 8) as usize % mine.len();
                        mine[i].zero();
                        assert_eq!(mine[i].totals(), Totals::default());
                        assert_eq!(mine[i].rates(), Rates::default());
                    }
                    _ => {
                        for e in &mine {
                            e.worker(2).conns(x % 5);
                        }
                    }
                }
            }
            mine.len()
        })
    };
    let reader = {
        let stable = Arc::clone(&stable);
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            let mut last = vec![0u64; STABLE];
            for _ in 0..10_000_000u64 {
                if stop.load(Ordering::Acquire) {
                    break;
                }
                for (i, e) in stable.iter().enumerate() {
                    let c = e.totals().conns;
                    assert!(c >= last[i]);
                    last[i] = c;
                }
            }
        })
    };
    for w in writers {
        w.join().unwrap();
    }
    churner.join().unwrap();
    stop.store(true, Ordering::Release);
    let (mut now, _) = ticker.join().unwrap();
    reader.join().unwrap();

    // Stable totals are exact.
    let mut want = vec![0u64; STABLE];
    for w in 0..2 {
        for k in 0..ops {
            want[(k as usize * 7 + w) % STABLE] += 1;
        }
    }
    for (i, e) in stable.iter().enumerate() {
        assert_eq!(e.totals().conns, want[i], "stable {i}");
        assert_eq!(e.totals().inbytes, want[i] * 64, "stable {i}");
    }
    // Two more periods free everything the churner dropped.
    for _ in 0..(2 * engine.config().slots + 2) {
        engine.tick(now);
        now += engine.config().tick_interval();
    }
    engine.tick(now);
    assert_eq!(engine.stats().estimators, STABLE, "{:?}", engine.stats());
}

#[test]
fn stress_short() {
    stress(40_000);
}

#[test]
#[ignore = "long stress: cargo test -p weir-rate -- --ignored"]
fn stress_long() {
    stress(4_000_000);
}

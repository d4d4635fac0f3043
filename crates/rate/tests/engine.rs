//! Deterministic tests of the engine with a fake clock.
//!
//! The reference model below is written from the kernel's `estimation_timer`,
//! independently of the crate's `ewma` module, so a mistake in one does not
//! hide in both.

#![allow(clippy::needless_range_loop)] // parallel [_; 5] arrays indexed by field

use std::time::Duration;

use weir_rate::{Config, Engine, Estimator, Rates, TickReport, Totals};

/// IPVS's per-estimator state and update, transcribed from ip_vs_est.c.
#[derive(Debug, Default, Clone, Copy)]
struct Ipvs {
    last: [u64; 5],
    avg: [u64; 5],
}

impl Ipvs {
    fn baseline(totals: [u64; 5]) -> Self {
        Self {
            last: totals,
            avg: [0; 5],
        }
    }

    fn update(&mut self, totals: [u64; 5]) {
        for f in 0..5 {
            let shift = if f < 3 { 9 } else { 4 };
            let rate = (totals[f] - self.last[f]) << shift;
            self.last[f] = totals[f];
            let avg = self.avg[f] as i64;
            self.avg[f] = (avg + ((rate as i64 - avg) >> 2)) as u64;
        }
    }

    fn rates(&self) -> Rates {
        Rates {
            cps: (self.avg[0] + 0x1FF) >> 10,
            inpps: (self.avg[1] + 0x1FF) >> 10,
            outpps: (self.avg[2] + 0x1FF) >> 10,
            inbps: (self.avg[3] + 0xF) >> 5,
            outbps: (self.avg[4] + 0xF) >> 5,
        }
    }
}

fn arr(t: Totals) -> [u64; 5] {
    [t.conns, t.inpkts, t.outpkts, t.inbytes, t.outbytes]
}

fn cfg(slots: u32) -> Config {
    Config {
        slots,
        ..Config::default()
    }
}

/// Feeds `per_tick` (conns, inpkts, outpkts, inbytes, outbytes) split over the
/// workers: worker w gets share w+1 of (1 + 2 + ... + W), remainder to worker 0.
fn feed(est: &Estimator, workers: usize, per_tick: [u64; 5]) {
    let total_shares: u64 = (1..=workers as u64).sum();
    let mut left = per_tick;
    for w in (0..workers).rev() {
        let share: [u64; 5] = if w == 0 {
            left
        } else {
            std::array::from_fn(|f| per_tick[f] * (w as u64 + 1) / total_shares)
        };
        let c = est.worker(w);
        c.conns(share[0]);
        c.packets_in(share[1]);
        c.packets_out(share[2]);
        c.bytes_in(share[3]);
        c.bytes_out(share[4]);
        for f in 0..5 {
            left[f] -= share[f];
        }
    }
}

fn within(actual: u64, want: u64, pct: f64) -> bool {
    (actual as f64 - want as f64).abs() <= want as f64 * pct / 100.0
}

#[test]
fn constant_rate_converges_within_one_percent_in_ten_seconds_with_warm_start() {
    let workers = 3;
    let engine = Engine::new(
        workers,
        Config {
            warm_start: true,
            ..cfg(1000)
        },
    )
    .unwrap();
    let est = engine.add();
    let step = engine.config().tick_interval(); // 2 ms
    // Per second: 1000 conns, 20k/15k packets, 24 MB / 3 MB.
    let per_tick = [2, 40, 30, 48_000, 6_000];
    let mut now = Duration::ZERO;
    while now <= Duration::from_secs(10) {
        feed(&est, workers, per_tick);
        engine.tick(now);
        now += step;
    }
    let r = est.rates();
    let want = [1000, 20_000, 15_000, 24_000_000, 3_000_000];
    let got = [r.cps, r.inpps, r.outpps, r.inbps, r.outbps];
    for f in 0..5 {
        assert!(
            within(got[f], want[f], 1.0),
            "field {f}: {got:?} vs {want:?}"
        );
    }
}

#[test]
fn ipvs_mode_is_not_warm_after_ten_seconds_but_converges_like_ipvs() {
    // The default (IPVS-exact) average starts from 0: after 10 s it is far
    // from the input, exactly where the kernel's would be.
    let engine = Engine::new(1, cfg(100)).unwrap();
    let est = engine.add();
    let step = engine.config().tick_interval(); // 20 ms
    let mut model: Option<Ipvs> = None;
    let mut now = Duration::ZERO;
    while now <= Duration::from_secs(40) {
        feed(&est, 1, [20, 20, 20, 20_000, 20_000]); // 1000/s, 1 MB/s
        let r = engine.tick(now);
        let t = arr(est.totals());
        if r.started == 1 {
            model = Some(Ipvs::baseline(t));
        } else if r.processed == 1 {
            model.as_mut().unwrap().update(t);
        }
        if let Some(m) = &model {
            assert_eq!(est.rates(), m.rates(), "at {now:?}");
        }
        if now == Duration::from_secs(10) {
            assert!(est.rates().cps < 900, "{:?}", est.rates());
        }
        now += step;
    }
    assert!(within(est.rates().cps, 1000, 1.0), "{:?}", est.rates());
    assert!(
        within(est.rates().inbps, 1_000_000, 1.0),
        "{:?}",
        est.rates()
    );
}

#[test]
fn step_change_follows_the_ipvs_curve_exactly() {
    let workers = 2;
    let engine = Engine::new(workers, cfg(1000)).unwrap();
    let est = engine.add();
    let step = engine.config().tick_interval();
    let mut model: Option<Ipvs> = None;
    let mut visits = 0;
    let mut now = Duration::ZERO;
    let mut checked_raw = 0;
    while now <= Duration::from_secs(60) {
        // 500 conns/s then 5000 conns/s from t = 20 s, then 0 from t = 40 s.
        let per_tick = if now < Duration::from_secs(20) {
            [1, 3, 2, 1500, 700]
        } else if now < Duration::from_secs(40) {
            [10, 33, 21, 15_001, 7_003]
        } else {
            [0; 5]
        };
        feed(&est, workers, per_tick);
        let r = engine.tick(now);
        let t = arr(est.totals());
        if r.started == 1 {
            model = Some(Ipvs::baseline(t));
        } else if r.processed == 1 {
            let m = model.as_mut().unwrap();
            m.update(t);
            visits += 1;
            assert_eq!(est.raw_rates(), m.avg, "raw averages at {now:?}");
            checked_raw += 1;
        }
        match &model {
            Some(m) => assert_eq!(est.rates(), m.rates(), "at {now:?}"),
            None => assert_eq!(est.rates(), Rates::default()),
        }
        now += step;
    }
    assert!(visits >= 28, "visits {visits}");
    assert_eq!(checked_raw, visits);
    // After 20 s of silence the average has decayed to (3/4)^10 ~ 6 % of the peak.
    assert!(est.rates().cps < 5000 / 10, "{:?}", est.rates());
}

#[test]
fn sums_across_workers_are_exact() {
    let workers = 4;
    let engine = Engine::new(workers, cfg(10)).unwrap();
    let est = engine.add();
    let mut want = [0u64; 5];
    for w in 0..workers {
        for k in 0..1000u64 {
            let c = est.worker(w);
            c.conn();
            c.rx(1, k + w as u64);
            c.tx(2, 3 * k);
            want[0] += 1;
            want[1] += 1;
            want[3] += k + w as u64;
            want[2] += 2;
            want[4] += 3 * k;
        }
    }
    assert_eq!(arr(est.totals()), want);
    // Rates see the same sums: after baseline at 0 s and one visit at 2 s.
    engine.tick(Duration::ZERO);
    let before = arr(est.totals());
    let mut model = Ipvs::default();
    // The chunk is placed after the first tick; drive until the first rate.
    let mut now = Duration::ZERO;
    let mut started = false;
    while now < Duration::from_secs(6) {
        now += engine.config().tick_interval();
        let r = engine.tick(now);
        if r.started == 1 {
            model = Ipvs::baseline(before);
            started = true;
            for w in 0..workers {
                est.worker(w).conns(100 * (w as u64 + 1));
            }
        } else if r.processed == 1 {
            model.update(arr(est.totals()));
            break;
        }
    }
    assert!(started);
    assert_eq!(est.rates(), model.rates());
    assert_eq!(est.rates().cps, (((1000u64 << 9) >> 2) + 0x1FF) >> 10);
}

/// One run of `n` estimators fed a per-estimator pattern for 12 s. With
/// `churn`, 10 % of them (ids with i % 10 == 3) are removed at 4 s and 10 %
/// more are added at 4 s and 7 s and removed at 9 s. Returns, for every
/// check point, the (totals, raw averages) of the estimators never churned.
fn churn_run(n: usize, churn: bool) -> Vec<Vec<(Totals, [u64; 5])>> {
    let workers = 2;
    let engine = Engine::new(workers, cfg(50)).unwrap();
    let mut ests: Vec<Option<Estimator>> = (0..n).map(|_| Some(engine.add())).collect();
    let mut extra: Vec<Estimator> = Vec::new();
    let step = engine.config().tick_interval(); // 40 ms
    let mut out = Vec::new();
    let mut now = Duration::ZERO;
    let mut k = 0u64;
    while now <= Duration::from_secs(12) {
        if churn && (now == Duration::from_secs(4) || now == Duration::from_secs(7)) {
            for (i, e) in ests.iter_mut().enumerate() {
                if i % 10 == 3 {
                    *e = None;
                }
            }
            for _ in 0..n / 10 {
                extra.push(engine.add());
            }
        }
        if churn && now == Duration::from_secs(9) {
            extra.clear();
        }
        for (i, e) in ests.iter().enumerate() {
            if let Some(e) = e {
                let i = i as u64;
                let x = (i * 7 + k * 13) % 17;
                feed(e, workers, [x % 3, x, x / 2, x * 100 + i, x * 50]);
            }
        }
        for e in &extra {
            feed(e, workers, [1, 5, 5, 5000, 5000]);
        }
        engine.tick(now);
        if k.is_multiple_of(5) {
            out.push(
                ests.iter()
                    .enumerate()
                    .filter(|(i, _)| i % 10 != 3)
                    .map(|(_, e)| {
                        let e = e.as_ref().unwrap();
                        (e.totals(), e.raw_rates())
                    })
                    .collect(),
            );
        }
        now += step;
        k += 1;
    }
    if churn {
        // Removed estimators were freed for reuse.
        assert!(engine.stats().estimators < n, "{:?}", engine.stats());
    }
    out
}

#[test]
fn churn_of_ten_percent_leaves_the_others_identical() {
    let n = 3000;
    let calm = churn_run(n, false);
    let churned = churn_run(n, true);
    assert_eq!(calm.len(), churned.len());
    // The runs are not trivially equal: rates moved during the run.
    let last = calm.last().unwrap();
    assert!(last.iter().any(|(_, raw)| raw[0] != 0));
    for (p, (a, b)) in calm.iter().zip(&churned).enumerate() {
        assert_eq!(a, b, "check point {p}");
    }
}

fn run_until(engine: &Engine, now: &mut Duration, until: Duration, mut f: impl FnMut(TickReport)) {
    while *now <= until {
        f(engine.tick(*now));
        *now += engine.config().tick_interval();
    }
}

#[test]
fn new_estimator_first_rate_after_one_full_period_and_removal_frees_within_one() {
    let engine = Engine::new(1, cfg(100)).unwrap();
    let keep = engine.add();
    let mut now = Duration::ZERO;
    run_until(&engine, &mut now, Duration::from_secs(3), |_| {});
    let added_at = now;
    let est = engine.add();
    let mut started_at = None;
    let mut first_rate_at = None;
    while now < added_at + Duration::from_secs(8) && first_rate_at.is_none() {
        est.worker(0).conns(10);
        keep.worker(0).conns(1);
        let r = engine.tick(now);
        if r.started > 0 && started_at.is_none() {
            started_at = Some(now);
        }
        if started_at.is_some() && est.rates().cps > 0 {
            first_rate_at = Some(now);
        }
        now += engine.config().tick_interval();
    }
    let started_at = started_at.expect("baseline taken");
    let first = first_rate_at.expect("first rate");
    // Baseline within one period (+ one tick to place the chunk) of add.
    assert!(
        started_at - added_at <= Duration::from_millis(2020),
        "{started_at:?}"
    );
    // The first rate exactly one period after the baseline.
    assert_eq!(first - started_at, Duration::from_secs(2));
    // 10 conns per 20 ms = 500/s, first step of the average from 0.
    assert_eq!(est.rates().cps, (((1000u64 << 9) >> 2) + 0x1FF) >> 10);

    let id = est.id();
    let before = engine.stats().estimators;
    drop(est);
    let dropped_at = now;
    let mut freed_at = None;
    run_until(
        &engine,
        &mut now,
        dropped_at + Duration::from_secs(3),
        |r| {
            if r.freed > 0 && freed_at.is_none() {
                freed_at = Some(dropped_at);
            }
        },
    );
    assert!(freed_at.is_some());
    assert_eq!(engine.stats().estimators, before - 1);
    // The id is reused, with clean counters and rates.
    let again = engine.add();
    assert_eq!(again.id(), id);
    assert_eq!(again.read(), (Totals::default(), Rates::default()));
    // The survivor was not disturbed.
    assert!(keep.rates().cps > 0);
}

#[test]
fn removal_is_noticed_within_one_period() {
    let engine = Engine::new(1, cfg(100)).unwrap();
    let est = engine.add();
    let mut now = Duration::ZERO;
    run_until(&engine, &mut now, Duration::from_secs(5), |_| {});
    drop(est);
    let start = now;
    let mut freed_after = None;
    run_until(&engine, &mut now, start + Duration::from_secs(4), |r| {
        if r.freed == 1 && freed_after.is_none() {
            freed_after = Some(());
        }
    });
    assert!(freed_after.is_some());
    // Exactly one period's worth of ticks is enough: check with a fresh run.
    let engine = Engine::new(1, cfg(100)).unwrap();
    let est = engine.add();
    let mut now = Duration::ZERO;
    run_until(&engine, &mut now, Duration::from_secs(5), |_| {});
    drop(est);
    let mut freed = 0;
    let end = now + engine.config().tick_interval() * 100;
    run_until(&engine, &mut now, end - Duration::from_nanos(1), |r| {
        freed += r.freed
    });
    assert_eq!(freed, 1);
}

#[test]
fn zero_restarts_totals_and_average_like_ipvsadm_z() {
    let engine = Engine::new(2, cfg(100)).unwrap();
    let est = engine.add();
    let mut model: Option<Ipvs> = None;
    let mut now = Duration::ZERO;
    let mut zeroed_at = None;
    let mut applied = false;
    while now <= Duration::from_secs(20) {
        feed(&est, 2, [3, 10, 9, 4000, 3000]);
        if now == Duration::from_secs(9) {
            est.zero();
            zeroed_at = Some(now);
            assert_eq!(est.read(), (Totals::default(), Rates::default()));
            // IPVS: last = totals now (0 after zeroing), avg = 0.
            model = Some(Ipvs::baseline([0; 5]));
        }
        let r = engine.tick(now);
        let t = arr(est.totals());
        if r.started == 1 {
            model = Some(Ipvs::baseline(t));
        } else if r.processed == 1 {
            model.as_mut().unwrap().update(t);
        }
        if r.zeroed == 1 {
            applied = true;
        }
        if zeroed_at.is_some() && !applied {
            assert_eq!(est.rates(), Rates::default());
        } else if let Some(m) = &model {
            assert_eq!(est.rates(), m.rates(), "at {now:?}");
        }
        now += engine.config().tick_interval();
    }
    assert!(applied);
    let t = est.totals();
    // The feed at 9 s came before zero(): 11 s at 50 ticks/s = 550 feeds since.
    assert_eq!(t.conns, 3 * 550);
    assert!(est.rates().cps > 0);
}

#[test]
fn late_ticks_catch_up_in_bounded_steps() {
    let engine = Engine::new(
        1,
        Config {
            max_slots_per_tick: 3,
            ..cfg(100)
        },
    )
    .unwrap();
    // One chunk in every slot.
    let _e: Vec<_> = (0..100 * 256).map(|_| engine.add()).collect();
    engine.tick(Duration::ZERO);
    assert_eq!(engine.stats().max_slot_load, 256);
    // 1 s late: 50 slots due; each call runs at most 3.
    let now = Duration::from_secs(1);
    let mut calls = 0;
    let mut ran = 0;
    loop {
        let r = engine.tick(now);
        assert!(r.slots_run <= 3);
        ran += r.slots_run;
        calls += 1;
        if r.behind == 0 {
            break;
        }
        assert!(r.next_due <= now, "late: call again at once");
        assert!(calls < 100);
    }
    assert_eq!(ran, 50);
    assert!(calls >= 17);
    // Nothing due: a call does nothing.
    assert_eq!(engine.tick(now).slots_run, 0);

    // 100 s late (50 periods): one period of slots, not 50 replayed.
    let now = Duration::from_secs(101);
    let mut ran = 0;
    for _ in 0..1000 {
        let r = engine.tick(now);
        ran += r.slots_run;
        if r.behind == 0 {
            break;
        }
    }
    assert_eq!(ran, 100);
}

#[test]
fn empty_slots_are_free_and_the_sleep_hint_skips_them() {
    let engine = Engine::new(1, cfg(1000)).unwrap(); // a slot every 2 ms
    let e = engine.add();
    let r = engine.tick(Duration::ZERO); // places the one chunk in slot 0
    assert_eq!(r.placed, 1);
    // Empty slots 1..: the hint is capped at 100 ms ahead.
    assert_eq!(r.next_due, Duration::from_millis(102));
    let r = engine.tick(r.next_due);
    assert_eq!(r.slots_run, 0);
    assert_eq!(r.behind, 0);
    // Near the end of the period, the hint is slot 0 of the next period.
    let r = engine.tick(Duration::from_millis(1950));
    assert_eq!(r.next_due, Duration::from_secs(2));
    let r = engine.tick(r.next_due);
    assert_eq!((r.slots_run, r.started), (1, 1));
    drop(e);
}

#[test]
fn budget_bounds_catch_up_by_measured_cost() {
    // Cost 1 us per estimator, budget 300 us: a slot with one chunk (256
    // estimators) costs 256 us, so a late call runs one occupied slot.
    let engine = Engine::new(
        1,
        Config {
            slots: 4,
            slot_budget: Duration::from_micros(300),
            estimator_cost_ns: 1000.0,
            max_slots_per_tick: 100,
            ..Config::default()
        },
    )
    .unwrap();
    let _e: Vec<_> = (0..4 * 256).map(|_| engine.add()).collect();
    engine.tick(Duration::ZERO); // places one chunk per slot
    let s = engine.stats();
    assert_eq!(s.max_slot_load, 256);
    assert_eq!(s.slot_capacity, 256);
    assert_eq!(s.overloaded_slots, 0);
    let r = engine.tick(Duration::from_secs(10));
    assert_eq!(r.slots_run, 1);
    assert!(r.behind > 0);
    // A lower measured cost raises capacity and lets a call run more slots.
    engine.set_estimator_cost(10.0);
    let r = engine.tick(Duration::from_secs(10));
    assert!(r.slots_run > 1, "{r:?}");
    // Measured ticks move the estimate (1/8 per sample).
    engine.record_tick(
        Duration::from_micros(512),
        &TickReport { scanned: 256, ..r },
    );
    let c = engine.stats().cost_ns;
    assert!((c - (10.0 + (160.0 - 10.0) / 8.0)).abs() < 1e-9, "{c}");
}

#[test]
fn placement_spreads_chunks_evenly() {
    let engine = Engine::new(2, cfg(8)).unwrap();
    let e: Vec<_> = (0..20 * 256).map(|_| engine.add()).collect();
    engine.tick(Duration::ZERO);
    let s = engine.stats();
    assert_eq!(s.chunks, 20);
    assert_eq!(s.max_slot_load, 3 * 256);
    assert_eq!(s.estimators, e.len());
    // 208 B per estimator with 2 workers, plus a small per-chunk header.
    let payload = 20 * 256 * (128 + 2 * 40);
    assert!(
        (payload..payload + 20 * 128).contains(&s.memory_bytes),
        "{s:?}"
    );
}

#[test]
fn config_errors_are_reported() {
    assert!(Engine::new(0, Config::default()).is_err());
    assert!(Engine::new(1, cfg(0)).is_err());
    assert!(
        Engine::new(
            1,
            Config {
                estimator_cost_ns: f64::NAN,
                ..Config::default()
            }
        )
        .is_err()
    );
    assert_eq!(
        Config::slots_for(1_000_000, 20.0, Duration::from_micros(500)),
        41
    );
}

#[test]
fn handles_are_small_send_and_sync() {
    fn send_sync<T: Send + Sync + Clone>() {}
    send_sync::<Engine>();
    send_sync::<Estimator>();
    assert_eq!(size_of::<Estimator>(), 16);
}

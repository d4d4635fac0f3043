//! Held persistence templates (IPVS's `n_control`): `hold`, `release` and
//! `insert_held` keep a template from expiring while connections it placed
//! are alive, with a fake clock and under threads racing the expiry.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use weir_flowtable::*;

mod common;

fn key(i: u32) -> FlowKey {
    common::tenant_one_key(i)
}

fn persist(ms: u64) -> Timeouts {
    Timeouts {
        persist: Millis(ms),
        ..Timeouts::default()
    }
}

fn tpl(backend: u32) -> FlowInit<'static> {
    FlowInit {
        backend: BackendId(backend),
        ..common::one_flow(FlowState::Persist)
    }
}

#[test]
fn a_held_template_outlives_its_timeout_and_restarts_it_at_the_last_release() {
    let t = common::tenant_one_table(64, 3);
    t.set_timeouts(TenantId(1), persist(10_000)).unwrap();
    // Absent, or not a template: nothing to hold.
    assert_eq!(t.hold(&key(1)), None);
    t.insert(key(2), common::one_flow(FlowState::Established), Millis(0))
        .unwrap();
    assert_eq!(t.hold(&key(2)), None);
    assert_eq!(t.release(&key(2), Millis(0)), None);
    // One template held twice: stored held once, then held again.
    t.insert_held(key(1), tpl(7), Millis(1_000)).unwrap();
    assert_eq!(
        t.insert_held(key(1), tpl(8), Millis(1_000))
            .map(|h| h.cookie),
        Err(InsertError::Exists(t.get(&key(1)).unwrap().cookie))
    );
    assert_eq!(t.hold(&key(1)), Some(BackendId(7)));
    let s = t.get(&key(1)).unwrap();
    assert_eq!((s.state, s.held, s.bytes_out), (FlowState::Persist, 2, 0));
    // Traffic counted on a template never reaches the count.
    t.touch(&key(1), Millis(1_000), Dir::Out, 1_500);
    assert_eq!(t.get(&key(1)).unwrap().held, 2);
    let mut out = Vec::new();
    let mut now = 1_000;
    let step = |now: u64, out: &mut Vec<FlowSnapshot>| {
        out.clear();
        t.expire(Millis(now), 100, out);
        assert!(out.iter().all(|s| s.key != key(1) || now >= s.expires_at.0));
        out.iter().any(|s| s.key == key(1))
    };
    // Held far past its 10 s.
    while now < 100_000 {
        now += 250;
        assert!(!step(now, &mut out), "held template expired at {now}");
    }
    assert_eq!(t.release(&key(1), Millis(now)), Some(1));
    while now < 150_000 {
        now += 250;
        assert!(!step(now, &mut out), "held template expired at {now}");
    }
    // The last release: the timeout runs from 150 s.
    assert_eq!(t.release(&key(1), Millis(now)), Some(0));
    assert_eq!(t.release(&key(1), Millis(now)), None);
    assert_eq!(t.get(&key(1)).unwrap().expires_at, Millis(160_000));
    let gone = loop {
        now += 250;
        assert!(now <= 161_250, "released template not expired by {now}");
        if step(now, &mut out) {
            break now;
        }
    };
    assert!(gone >= 160_000, "{gone}");
}

#[test]
fn dumps_and_removals_show_the_count() {
    let t = common::tenant_one_table(64, 4);
    t.insert_held(key(1), tpl(1), Millis(0)).unwrap();
    t.insert(key(2), tpl(2), Millis(0)).unwrap();
    assert_eq!(t.hold(&key(1)), Some(BackendId(1)));
    assert_eq!(t.hold(&key(2)), Some(BackendId(2)));
    let mut all = Vec::new();
    assert_eq!(t.dump(None, &DumpFilter::default(), 10, &mut all), None);
    all.sort_by_key(|s| s.backend);
    assert_eq!(all.iter().map(|s| s.held).collect::<Vec<_>>(), [2, 1]);
    // An explicit removal takes a held template and says so.
    assert_eq!(t.remove(&key(2)).map(|s| s.held), Some(1));
    assert_eq!(t.hold(&key(2)), None);
    let mut out = Vec::new();
    t.remove_tenant(TenantId(1), &mut out).unwrap();
    assert_eq!(out.iter().map(|s| s.held).collect::<Vec<_>>(), [2]);
}

/// Threads hold a template (storing it held if absent), check it is there
/// while they hold it, and release it, while another thread expires with
/// a clock far past every deadline: a template is never gone while held,
/// and each hold sees one backend per stored template.
#[test]
fn a_template_is_never_expired_while_held_under_threads() {
    const THREADS: u32 = 4;
    const ROUNDS: u32 = 20_000;
    let t = Arc::new(common::tenant_one_table(64, 5));
    t.set_timeouts(TenantId(1), persist(1)).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    // One clock for all threads, as in the daemon: the expirer moves it a
    // second per round, so every released template is due at once.
    let clock = Arc::new(AtomicU64::new(0));
    let expirer = {
        let (t, stop, clock) = (Arc::clone(&t), Arc::clone(&stop), Arc::clone(&clock));
        std::thread::spawn(move || {
            let (mut out, mut expired) = (Vec::new(), 0u64);
            while !stop.load(Relaxed) {
                let now = clock.fetch_add(1_000, Relaxed) + 1_000;
                out.clear();
                t.expire(Millis(now), 1_000, &mut out);
                for s in &out {
                    assert_eq!(s.held, 0, "a held template expired");
                }
                expired += out.len() as u64;
            }
            expired
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|w| {
            let (t, clock) = (Arc::clone(&t), Arc::clone(&clock));
            std::thread::spawn(move || {
                for r in 0..ROUNDS {
                    let k = key(r % 4);
                    let mut tries = 0;
                    let backend = loop {
                        tries += 1;
                        assert!(tries < 1_000, "hold and insert_held never settled");
                        if let Some(b) = t.hold(&k) {
                            break b;
                        }
                        match t.insert_held(k, tpl(w), Millis(clock.load(Relaxed))) {
                            Ok(_) => break BackendId(w),
                            Err(InsertError::Exists(_)) => continue,
                            Err(e) => panic!("insert_held: {e}"),
                        }
                    };
                    let s = t.get(&k).expect("a held template is gone");
                    assert!(s.held >= 1 && s.backend == backend, "{s:?}");
                    assert!(t.release(&k, Millis(clock.load(Relaxed))).is_some());
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Relaxed);
    // How often a template expired in a gap between holds depends on the
    // scheduler; it is printed, not asserted.
    let expired = expirer.join().unwrap();
    eprintln!("templates expired between holds: {expired}");
    // Everything is released: the rest goes at the next expiry.
    let mut out = Vec::new();
    t.expire(Millis(clock.load(Relaxed) + 10_000), usize::MAX, &mut out);
    assert!(out.iter().all(|s| s.held == 0));
    assert_eq!(t.tenant_stats(TenantId(1)).unwrap().entries, 0);
}

/// `rebind` moves a template to another backend and restarts its timeout,
/// keeping its holds (a remove and insert would lose them); it touches
/// nothing but a live template.
#[test]
fn a_rebound_template_keeps_its_holds() {
    let t = common::tenant_one_table(64, 3);
    t.set_timeouts(TenantId(1), persist(10_000)).unwrap();
    assert!(!t.rebind(&key(1), BackendId(9), Millis(0)));
    t.insert(key(2), common::one_flow(FlowState::Established), Millis(0))
        .unwrap();
    assert!(!t.rebind(&key(2), BackendId(9), Millis(0)));
    assert_eq!(
        t.get(&key(2)).unwrap().backend,
        common::one_flow(FlowState::Established).backend
    );
    t.insert_held(key(1), tpl(7), Millis(1_000)).unwrap();
    assert_eq!(t.hold(&key(1)), Some(BackendId(7)));
    assert!(t.rebind(&key(1), BackendId(8), Millis(5_000)));
    let s = t.get(&key(1)).unwrap();
    assert_eq!(
        (s.backend, s.held, s.last_active),
        (BackendId(8), 2, Millis(5_000))
    );
    assert_eq!(t.hold(&key(1)), Some(BackendId(8)));
    for left in [2, 1, 0] {
        assert_eq!(t.release(&key(1), Millis(6_000)), Some(left));
    }
    assert_eq!(t.get(&key(1)).unwrap().expires_at, Millis(16_000));
}

//! A shortened timeout reaches entries already filed under the longer one
//! within a bounded delay (the retime pass of `FlowTable::set_timeouts`),
//! never early, with bounded work per `expire` call.

use std::collections::HashMap;

use weir_flowtable::*;

mod common;

fn key(i: u32) -> FlowKey {
    common::tenant_one_key(i)
}

fn udp(timeout_ms: u64) -> Timeouts {
    Timeouts {
        udp: Millis(timeout_ms),
        ..Timeouts::default()
    }
}

/// Entries filed at 300 s, the UDP timeout cut to 10 s: the idle ones go
/// within one tick and the pass after their new deadline, none early; the
/// ones touched meanwhile, and those of a profile that overrides the UDP
/// timeout, keep living.
#[test]
fn shortened_timeout_applies_to_filed_entries() {
    const N: u32 = 3000;
    const PERIOD: u64 = 250;
    let t = common::tenant_one_table(1 << 12, 7);
    let keep = TimeoutOverrides::NONE.with(FlowState::Udp, Millis(300_000));
    let profile = t.timeout_profile(TenantId(1), &keep).unwrap();
    for i in 0..N {
        let mut init: FlowInit<'_> = common::one_flow(FlowState::Udp);
        if i % 3 == 2 {
            init.profile = profile.for_init();
        }
        t.insert(key(i), init, Millis(1_000)).unwrap();
    }
    let mut out = Vec::new();
    // Files every entry at its 300 s deadline.
    assert_eq!(t.expire(Millis(1_000), 10_000, &mut out), 0);
    assert_eq!(t.wheel_refs(TenantId(1)), Some(N as usize));
    t.set_timeouts(TenantId(1), udp(10_000)).unwrap();
    assert_eq!(t.retime_state(TenantId(1)), Some((true, 0)));
    let mut gone: HashMap<u32, u64> = HashMap::new();
    let mut now = 1_000;
    while now < 60_000 {
        now += PERIOD;
        // i % 3 == 1: touched every second until 20 s.
        if now % 1_000 == 0 && now <= 20_000 {
            for i in (1..N).step_by(3) {
                t.touch(&key(i), Millis(now), Dir::In, 1);
            }
        }
        out.clear();
        t.expire(Millis(now), 10_000, &mut out);
        for s in &out {
            assert!(now >= s.expires_at.0, "early: {now} < {}", s.expires_at.0);
            let i = (0..N).find(|&i| key(i) == s.key).unwrap();
            assert!(gone.insert(i, now).is_none());
        }
    }
    assert_eq!(t.retime_state(TenantId(1)), Some((false, 0)));
    for i in 0..N {
        let at = gone.get(&i).copied();
        match i % 3 {
            // Deadline 11 s; one expire call holds the whole pass.
            0 => {
                let at = at.unwrap_or_else(|| panic!("entry {i} never expired"));
                assert!(
                    (11_000..=11_000 + 1_000 + PERIOD).contains(&at),
                    "{i}: {at}"
                );
            }
            // Last touched at 20 s: deadline 30 s.
            1 => {
                let at = at.unwrap_or_else(|| panic!("entry {i} never expired"));
                assert!(
                    (30_000..=30_000 + 1_000 + PERIOD).contains(&at),
                    "{i}: {at}"
                );
            }
            // Its profile keeps 300 s.
            _ => assert_eq!(at, None, "entry {i} of the 300 s profile expired"),
        }
    }
}

/// A million entries: a pass takes at most `ceil(refs / RETIME_REFS) + 1`
/// calls, each examining at most `RETIME_REFS` references; a second
/// shortening during a pass extends it (at most twice the references);
/// afterwards every entry expires within a tick of its new deadline and
/// none before it.
#[test]
fn retime_pass_is_bounded_per_call_at_a_million_entries() {
    const N: u32 = 1 << 20;
    let t = common::tenant_one_table(1 << 20, 9);
    let init = common::one_flow(FlowState::Udp);
    for i in 0..N {
        t.insert(key(i), init, Millis(1_000)).unwrap();
    }
    let mut out = Vec::new();
    assert_eq!(t.expire(Millis(1_000), 1, &mut out), 0);
    assert_eq!(t.wheel_refs(TenantId(1)), Some(N as usize));
    // Runs `expire` until the pass ends; returns the calls it took.
    let finish = |bound: usize, out: &mut Vec<FlowSnapshot>| {
        let mut calls = 0;
        loop {
            calls += 1;
            assert!(calls <= bound, "pass not done after {calls} calls");
            assert_eq!(t.expire(Millis(2_000), 1, out), 0);
            let (running, seen) = t.retime_state(TenantId(1)).unwrap();
            assert!(seen <= RETIME_REFS, "{seen} references in one call");
            if !running {
                return calls;
            }
        }
    };
    t.set_timeouts(TenantId(1), udp(10_000)).unwrap();
    let calls = finish((N as usize).div_ceil(RETIME_REFS) + 1, &mut out);
    assert!(calls >= (N as usize).div_ceil(RETIME_REFS), "{calls}");
    // Two steps of a pass for 8 s, then a cut to 5 s extends it.
    t.set_timeouts(TenantId(1), udp(8_000)).unwrap();
    for _ in 0..2 {
        assert_eq!(t.expire(Millis(2_000), 1, &mut out), 0);
        let (running, seen) = t.retime_state(TenantId(1)).unwrap();
        assert!(running && seen == RETIME_REFS, "{seen}");
    }
    t.set_timeouts(TenantId(1), udp(5_000)).unwrap();
    finish((2 * N as usize).div_ceil(RETIME_REFS) + 1, &mut out);
    assert_eq!(t.wheel_refs(TenantId(1)), Some(N as usize));
    // New deadline 6 s: its tick is processed from 7 s on.
    assert_eq!(t.expire(Millis(6_999), usize::MAX, &mut out), 0);
    let n = t.expire(Millis(7_000), usize::MAX, &mut out);
    assert_eq!(n, N as usize);
    assert!(out.iter().all(|s| s.expires_at == Millis(6_000)));
    assert_eq!(t.tenant_stats(TenantId(1)).unwrap().entries, 0);
}

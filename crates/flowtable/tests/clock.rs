//! An entry keeps its activity time in 32 bits of milliseconds (the node's
//! cold part is 40 bytes, not 48). These tests pin down what that must not
//! change: times read back exactly across the 2^32 ms wrap and after long
//! idleness, expiry neither early nor lost, and the timeout cap that keeps
//! every live entry inside the readable range.

mod common;

use weir_flowtable::*;

const DAY: u64 = 86_400_000;

fn udp_timeout(ms: u64) -> Timeouts {
    Timeouts {
        udp: Millis(ms),
        ..Timeouts::default()
    }
}

/// Expires at `now` and returns how many entries went.
fn expire_at(t: &FlowTable, now: u64) -> usize {
    let mut out = Vec::new();
    t.expire(Millis(now), usize::MAX, &mut out)
}

#[test]
fn times_read_back_exactly_across_the_32_bit_wrap() {
    let t = common::tenant_one_table(64, 1);
    t.set_timeouts(TenantId(1), udp_timeout(10_000)).unwrap();
    let wrap = 1u64 << 32;
    let k = common::tenant_one_key(1);
    t.insert(k, common::one_flow(FlowState::Udp), Millis(wrap - 500))
        .unwrap();
    let s = t.get(&k).unwrap();
    assert_eq!(s.last_active, Millis(wrap - 500));
    // A touch past the wrap: the stored low bits are now smaller than
    // before, and the time must still move forward.
    assert!(t.touch(&k, Millis(wrap + 700), Dir::In, 10).is_some());
    let s = t.get(&k).unwrap();
    assert_eq!(s.last_active, Millis(wrap + 700));
    assert_eq!(s.expires_at, Millis(wrap + 10_700));
    // A touch with an older clock (another thread's) never moves it back.
    assert!(t.touch(&k, Millis(wrap - 100), Dir::In, 10).is_some());
    assert_eq!(t.get(&k).unwrap().last_active, Millis(wrap + 700));
    // Expiry: not a millisecond early, and on time.
    assert_eq!(expire_at(&t, wrap + 10_699), 0);
    assert!(t.get(&k).is_some());
    assert_eq!(expire_at(&t, wrap + 12_000), 1);
    assert!(t.get(&k).is_none());
}

#[test]
fn an_entry_idle_for_thirty_days_keeps_its_exact_time() {
    let t = common::tenant_one_table(64, 2);
    t.set_timeouts(TenantId(1), udp_timeout(31 * DAY)).unwrap();
    let k = common::tenant_one_key(2);
    let start = 5 * DAY + 123;
    t.insert(k, common::one_flow(FlowState::Udp), Millis(start))
        .unwrap();
    // The daemon's expiry runs every second; here a day at a time.
    for d in 1..=30 {
        assert_eq!(expire_at(&t, start + d * DAY), 0, "expired on day {d}");
    }
    let s = t.get(&k).unwrap();
    assert_eq!(s.last_active, Millis(start));
    assert_eq!(s.expires_at, Millis(start + 31 * DAY));
    assert_eq!(expire_at(&t, start + 31 * DAY - 1), 0);
    assert_eq!(expire_at(&t, start + 31 * DAY + 2_000), 1);
}

#[test]
fn timeouts_past_the_cap_apply_as_the_cap() {
    let t = common::tenant_one_table(64, 3);
    // 40 days is more than the 32-bit clock could wait out exactly.
    t.set_timeouts(TenantId(1), udp_timeout(40 * DAY)).unwrap();
    let k = common::tenant_one_key(3);
    t.insert(k, common::one_flow(FlowState::Udp), Millis(1_000))
        .unwrap();
    assert_eq!(
        t.get(&k).unwrap().expires_at,
        Millis(1_000 + MAX_TIMEOUT_MS)
    );
    for d in 1..=30 {
        assert_eq!(expire_at(&t, d * DAY), 0, "expired on day {d}");
    }
    assert_eq!(expire_at(&t, 1_000 + MAX_TIMEOUT_MS + 2_000), 1);
}

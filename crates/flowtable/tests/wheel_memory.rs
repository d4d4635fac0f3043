//! The expiry wheel gives back a passed slot's buffer (docs/BENCHMARKS.md,
//! soak). Its own test binary: `tests/recycle.rs` measures the same table
//! memory and must not run beside it.

use weir_flowtable::*;

mod common;

fn key(i: u32) -> FlowKey {
    common::tenant_one_key(i)
}

/// The expiry wheel gives back a slot's buffer once the slot has passed: it
/// is filed into again only a whole turn (1,024 s) later. Slots used to keep
/// buffers of up to 256 references, so a tenant's wheel grew by about 1 KiB
/// a second for a whole turn under steady churn (the soak's 30-minute creep).
#[test]
fn passed_wheel_slots_give_their_buffers_back() {
    const PER_SECOND: u32 = 200;
    let table = common::tenant_one_table(1 << 12, 4);
    let init = common::one_flow(FlowState::Close); // 10 s by default
    let mut out = Vec::new();
    let mut i = 0u32;
    let mut second = |s: u64, out: &mut Vec<FlowSnapshot>| {
        for _ in 0..PER_SECOND {
            table
                .insert(key(i), init, Millis(s * 1000))
                .expect("insert");
            i = i.wrapping_add(1);
        }
        table.expire(Millis(s * 1000 + 500), usize::MAX, out);
    };
    // Past the first timeouts: the live set (10 s of entries) is steady.
    for s in 0..100 {
        second(s, &mut out);
    }
    let steady = table.memory_bytes();
    // Most of one turn of the wheel.
    for s in 100..1_000 {
        second(s, &mut out);
    }
    let end = table.memory_bytes();
    assert!(
        out.len() as u64 >= 980 * u64::from(PER_SECOND),
        "expired {}",
        out.len()
    );
    // Before the fix: +900 slots x 1 KiB.
    assert!(
        end < steady + 64 * 1024,
        "the table grew from {steady} to {end} bytes with a steady live set"
    );
}

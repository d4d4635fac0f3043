//! A resize frees the index it replaced (a grace period later), even on a
//! thread that only inserts.
//!
//! Its own test binary: it reads a process-wide count of index bytes, and
//! other tests' tables would move it.

use weir_flowtable::*;

mod common;

#[test]
fn a_grown_table_keeps_only_its_current_index() {
    // The shared table as small as it gets (one line): its index counts too.
    let t = FlowTable::new(TableConfig {
        shared_buckets: 1,
        memory_budget: 1 << 30,
        seed: Some(9),
        ..TableConfig::default()
    });
    t.add_tenant(
        TenantId(1),
        TenantConfig {
            own_buckets: 1024,
            max_entries: 1 << 20,
            ..TenantConfig::default()
        },
    )
    .unwrap();
    let n: u32 = 200_000;
    for i in 0..n {
        t.insert(
            common::tenant_one_key(i),
            common::one_flow(FlowState::Established),
            Millis(0),
        )
        .unwrap();
    }
    // Let any resize in flight finish.
    for _ in 0..1_000 {
        if !t.resize_state(TenantId(1)).unwrap().0 {
            break;
        }
        t.maintain();
    }
    let (resizing, resizes) = t.resize_state(TenantId(1)).unwrap();
    assert!(!resizing && resizes >= 4, "grew through {resizes} resizes");
    let current = BUCKET_BYTES * t.tenant_stats(TenantId(1)).unwrap().buckets;
    // The replaced indexes go once the grace period ends; lookups (which
    // pin) move the epoch on. Bounded.
    let mut alive = index_bytes_alive();
    for round in 0..10_000u32 {
        if alive <= current + 4096 {
            break;
        }
        assert!(t.get(&common::tenant_one_key(round % n)).is_some());
        alive = index_bytes_alive();
    }
    // Every index the tenant's table outgrew is freed (the shared table's
    // one-line index is the rest).
    assert!(
        alive <= current + 4096,
        "{alive} index bytes alive, the current index is {current} after {resizes} resizes"
    );
}

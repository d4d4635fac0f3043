//! Memory of a removed tenant's own table comes back at once (issue 10,
//! defect 26): 300 add/delete cycles of a 2^20-bucket tenant had raised a
//! daemon's RSS from 77 MB to 663 MB, because the table was freed only when
//! crossbeam-epoch's per-thread bag of deferred frees next filled up.
//!
//! Its own test binary: it reads the process's RSS, which other tests
//! running in parallel threads would disturb.

use weir_flowtable::*;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("resident pages in statm");
    pages * 4096
}

#[test]
fn removed_own_tables_are_freed_promptly() {
    const BUCKETS: usize = 1 << 20;
    const CYCLES: u32 = 100;
    let table = FlowTable::new(TableConfig {
        shared_buckets: 1 << 10,
        memory_budget: 1 << 30,
        seed: Some(7),
        ..TableConfig::default()
    });
    let mut out = Vec::new();
    let cycle = |id: u32, out: &mut Vec<FlowSnapshot>| {
        let placed = table
            .add_tenant(
                TenantId(id),
                TenantConfig {
                    own_buckets: BUCKETS,
                    ..TenantConfig::default()
                },
            )
            .unwrap();
        assert_eq!(placed, Placement::Own { buckets: BUCKETS });
        table.remove_tenant(TenantId(id), out).unwrap();
    };
    // Warm up the allocator with one cycle, then measure.
    cycle(1, &mut out);
    let start = rss_bytes();
    let per_table = (BUCKETS * 4) as u64;
    for id in 2..2 + CYCLES {
        cycle(id, &mut out);
        let grown = rss_bytes().saturating_sub(start);
        // A couple of tables in flight at most, never one per cycle.
        assert!(
            grown <= 3 * per_table,
            "after {} cycles RSS grew by {} MiB (one table is {} MiB)",
            id - 1,
            grown >> 20,
            per_table >> 20
        );
    }
}

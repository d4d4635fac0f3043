//! Removed entries' nodes are reused promptly, so the node arena (whose
//! chunks are never freed) stays at the size the live entries need: under
//! steady churn with a few hundred live entries, `weir-bench soak`'s daemon
//! grew its arena by 1.3 MiB in two minutes, because each removing thread
//! kept up to 4,096 removed nodes in crossbeam-epoch's per-thread bag of
//! deferred functions before any could be reused (docs/BENCHMARKS.md, soak).
//!
//! Its own test binary: the epoch collector is global to the process, and a
//! test elsewhere that holds a pin would hold recycling up.

use std::sync::mpsc::sync_channel;

use weir_flowtable::*;

mod common;

fn key(i: u32) -> FlowKey {
    common::tenant_one_key(i)
}

/// The daemon's pattern: one thread inserts (a worker accepting), another
/// removes (the expiry thread), at most `LIVE` entries at any time.
#[test]
fn churn_with_few_live_entries_keeps_the_arena_small() {
    const LIVE: usize = 100;
    const WARM: u32 = 2_000;
    const CHURN: u32 = 60_000;
    let table = common::tenant_one_table(1 << 10, 3);
    let init = common::one_flow(FlowState::Established);
    let run = |from: u32, to: u32| {
        // The bounded channel keeps at most LIVE entries inserted and not
        // yet removed.
        let (tx, rx) = sync_channel::<(FlowKey, Cookie)>(LIVE - 1);
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut out = Vec::new();
                for (n, (k, c)) in rx.into_iter().enumerate() {
                    assert!(table.remove_cookie(&k, c).is_some());
                    if n % 1000 == 0 {
                        // As the daemon's expiry thread does every second:
                        // files new entries in the wheel (none is due at 0).
                        table.expire(Millis(0), 1, &mut out);
                    }
                }
                assert!(out.is_empty());
            });
            for i in from..to {
                let k = key(i);
                let c = table.insert(k, init, Millis(0)).expect("insert");
                tx.send((k, c)).expect("the remover is running");
            }
            drop(tx);
        });
    };
    run(0, WARM);
    let warm = table.memory_bytes();
    run(WARM, WARM + CHURN);
    let end = table.memory_bytes();
    // The arena's first chunk holds 1,024 nodes (112 KiB): enough for the
    // live entries plus a few batches in their grace period. Before the fix
    // the removing thread's bag held back thousands of nodes and the arena
    // took its next three chunks too (1, 2 and 4 Ki nodes: +710 KiB here).
    assert!(
        end < warm + 64 * 1024,
        "the table grew from {warm} to {end} bytes with at most {LIVE} live entries"
    );
}

//! Cookies name their entry's node (`FlowTable::handle_of`, `get_cookie`).
//!
//! Its own test binary, like recycle.rs: node reuse waits for an epoch
//! grace period, which a test in the same process holding a pin delays.

use weir_flowtable::*;

mod common;

/// A cookie names its node: `get_cookie` / `handle_of` reach the entry in
/// one read, a removed entry's cookie finds nothing even after its node is
/// reused (the reuse gets a new cookie), and a cookie that never was finds
/// nothing (no panic for any value).
#[test]
fn a_cookie_reaches_its_entry_and_only_while_it_lives() {
    let t = common::tenant_one_table(64, 3);
    let k = common::tenant_one_key(1);
    let c = t
        .insert(k, common::one_flow(FlowState::Established), Millis(0))
        .unwrap();
    assert_eq!(t.get_cookie(c), t.get(&k));
    assert!(t.get_cookie(c).is_some());
    assert_eq!(
        t.remove_handle(FlowTable::handle_of(c)).map(|s| s.cookie),
        Some(c)
    );
    assert_eq!(t.get_cookie(c), None);
    // Reinserted until a node is reused (removed nodes come back after an
    // epoch grace period): every cookie is new, and old ones stay dead.
    let mut seen = vec![c];
    for i in 0..2_000 {
        let c = t
            .insert(k, common::one_flow(FlowState::Established), Millis(i))
            .unwrap();
        assert!(!seen.contains(&c), "cookie {c} handed out twice");
        assert!(seen.iter().all(|&old| t.get_cookie(old).is_none()));
        seen.push(c);
        t.remove(&k).unwrap();
    }
    // The loop did reuse nodes (else it showed nothing about reuse): the
    // node is the cookie's low 28 bits (see `Cookie`).
    let nodes: std::collections::HashSet<u64> =
        seen.iter().map(|c| c.0 & ((1 << 28) - 1)).collect();
    assert!(
        nodes.len() < seen.len() / 2,
        "{} nodes for {} entries",
        nodes.len(),
        seen.len()
    );
    for bogus in [0, 1, u64::MAX, 1 << 56, (1 << 28) - 1, 5 << 28 | 3] {
        assert_eq!(t.get_cookie(Cookie(bogus)), None, "{bogus:x}");
        assert_eq!(t.remove_handle(FlowTable::handle_of(Cookie(bogus))), None);
    }
}

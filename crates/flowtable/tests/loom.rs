//! loom model checks of the bucket index protocol (bodies in
//! `src/loom_checks.rs`, which needs crate internals). Only built with
//! `--cfg loom`:
//!
//! `RUSTFLAGS="--cfg loom" cargo test -p weir-flowtable --release --test loom`
#![cfg(loom)]

use weir_flowtable::loom_checks;

#[test]
fn lookup_vs_insert_into_overflow() {
    loom_checks::lookup_vs_insert_into_overflow();
}

#[test]
fn completed_insert_is_found() {
    loom_checks::completed_insert_is_found();
}

#[test]
fn lookup_vs_remove() {
    loom_checks::lookup_vs_remove();
}

#[test]
fn two_writers_and_a_reader() {
    loom_checks::two_writers_and_a_reader();
}

#[test]
fn lookup_and_insert_vs_migration() {
    loom_checks::lookup_and_insert_vs_migration();
}

#[test]
fn insert_reply_vs_lookup_reply() {
    loom_checks::insert_reply_vs_lookup_reply();
}

#[test]
fn insert_reply_vs_lookup_reply_vs_remove() {
    loom_checks::insert_reply_vs_lookup_reply_vs_remove();
}

#[test]
fn refused_reply_insert_is_never_seen() {
    loom_checks::refused_reply_insert_is_never_seen();
}

#[test]
fn hold_release_vs_expiry() {
    loom_checks::hold_release_vs_expiry();
}

#[test]
fn release_and_hold_vs_expiry() {
    loom_checks::release_and_hold_vs_expiry();
}

#[test]
fn stale_handle_vs_node_reuse() {
    loom_checks::stale_handle_vs_node_reuse();
}

#[test]
fn snapshot_vs_node_reuse() {
    loom_checks::snapshot_vs_node_reuse();
}

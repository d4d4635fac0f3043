//! loom model checks of the lock-free chain protocol (bodies in
//! `src/loom_checks.rs`, which needs crate internals). Only built with
//! `--cfg loom`:
//!
//! `RUSTFLAGS="--cfg loom" cargo test -p weir-flowtable --release --test loom`
#![cfg(loom)]

use weir_flowtable::loom_checks;

#[test]
fn lookup_vs_insert_and_remove() {
    loom_checks::lookup_vs_insert_and_remove();
}

#[test]
fn lookup_survives_unlink_of_predecessors() {
    loom_checks::lookup_survives_unlink_of_predecessors();
}

#[test]
fn two_writers_and_a_reader() {
    loom_checks::two_writers_and_a_reader();
}

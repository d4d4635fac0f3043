//! Atomics facade: std atomics normally, loom's under `cfg(loom)` so that the
//! nodes' and the bucket index's lock-free protocols can be model-checked
//! (`loom_checks.rs`).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

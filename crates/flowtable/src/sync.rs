//! Atomics facade: std atomics normally, loom's under `cfg(loom)` so that the
//! lock-free chain protocol in [`crate::chain`] can be model-checked.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

//! Synchronisation primitives: std atomics and parking_lot normally, shuttle's
//! under `--cfg shuttle` so `tests/shuttle.rs` can explore interleavings of
//! the real code (see the crate docs).

#[cfg(not(shuttle))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, fence};

#[cfg(shuttle)]
pub(crate) use shuttle::sync::atomic::{AtomicU32, AtomicU64, fence};

#[cfg(not(shuttle))]
pub(crate) use parking_lot::Mutex;

#[cfg(shuttle)]
pub(crate) use shuttle_mutex::Mutex;

#[cfg(shuttle)]
mod shuttle_mutex {
    /// parking_lot's API over shuttle's mutex (poisoning ignored).
    #[derive(Debug)]
    pub(crate) struct Mutex<T>(shuttle::sync::Mutex<T>);

    impl<T> Mutex<T> {
        pub(crate) const fn new(t: T) -> Self {
            Self(shuttle::sync::Mutex::new(t))
        }

        pub(crate) fn lock(&self) -> shuttle::sync::MutexGuard<'_, T> {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }

        pub(crate) fn try_lock(&self) -> Option<shuttle::sync::MutexGuard<'_, T>> {
            self.0.try_lock().ok()
        }
    }
}

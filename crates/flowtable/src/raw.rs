//! The crate's only `unsafe`: an epoch-protected, atomically replaceable
//! pointer ([`EpochCell`]) that lets every lookup read the tenant directory
//! without a lock and without writing a shared cache line.
//!
//! Contract: the cell always holds a valid, non-null `Box<T>`; `replace`
//! swaps in a new box and defers the old one's destruction until every
//! thread pinned at that moment has unpinned (crossbeam-epoch), so a `&'g T`
//! tied to a live guard `'g` never dangles.
#![allow(unsafe_code)]

use crossbeam_epoch::{Atomic, Guard, Owned};
use std::sync::atomic::Ordering::{AcqRel, Acquire};

/// Epoch-protected pointer to a `T`, replaced wholesale (copy-on-write).
pub(crate) struct EpochCell<T: Send + 'static> {
    ptr: Atomic<T>,
}

impl<T: Send + 'static> std::fmt::Debug for EpochCell<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EpochCell")
    }
}

impl<T: Send + 'static> EpochCell<T> {
    pub(crate) fn new(v: T) -> Self {
        EpochCell {
            ptr: Atomic::new(v),
        }
    }

    /// Current value, valid while both `self` and `guard` are borrowed.
    #[inline]
    pub(crate) fn load<'a>(&'a self, guard: &'a Guard) -> &'a T {
        let p = self.ptr.load(Acquire, guard);
        // SAFETY: `ptr` is initialised non-null in `new` and only ever
        // replaced by `replace` with another non-null `Owned`. A replaced
        // value is destroyed through `defer_destroy`, i.e. only after every
        // guard pinned before the swap (including `guard`) is dropped; the
        // current value is freed only in `Drop`, which needs `&mut self`
        // and so cannot run while this `&'a self` borrow lives.
        unsafe { p.deref() }
    }

    /// Swaps in `v`; the old value is dropped after the grace period.
    /// Callers serialise `replace` (copy-on-write under an admin lock).
    pub(crate) fn replace(&self, v: T, guard: &Guard) {
        let old = self.ptr.swap(Owned::new(v), AcqRel, guard);
        // SAFETY: `old` was the cell's value, is unreachable from the cell
        // now, and is destroyed only after every currently pinned thread
        // unpins, so no `load` reference to it outlives its guard.
        unsafe { guard.defer_destroy(old) };
    }
}

impl<T: Send + 'static> Drop for EpochCell<T> {
    fn drop(&mut self) {
        // SAFETY: `&mut self` proves no reference returned by `load` (each
        // tied to a `&self` borrow) is alive, so nothing else can observe
        // the value; the pointer is non-null and uniquely owned by the cell.
        unsafe {
            let guard = crossbeam_epoch::unprotected();
            let p = self.ptr.load(Acquire, guard);
            drop(p.into_owned());
        }
    }
}

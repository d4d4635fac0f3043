//! The crate's only `unsafe`, in three small pieces:
//!
//! * [`EpochCell`]: an epoch-protected, atomically replaceable pointer that
//!   lets every lookup read the tenant directory without a lock and without
//!   writing a shared cache line. Contract: the cell always holds a valid,
//!   non-null `Box<T>`; `replace` swaps in a new box and defers the old
//!   one's destruction until every thread pinned at that moment has unpinned
//!   (crossbeam-epoch), so a reference tied to a live guard never dangles.
//! * [`HugeArray`]: a fixed-length, zero-initialised array of atomics (node
//!   chunks, bucket lines), 2 MiB aligned and `MADV_HUGEPAGE`-advised when
//!   large, so that random lookups over gigabytes of entries do not pay a
//!   TLB miss each. Contract: only for types whose all-zero bytes are a
//!   valid value ([`Zeroable`]).
//! * [`prefetch`]: a cache hint.
#![allow(unsafe_code)]

#[cfg(not(loom))]
use std::alloc::Layout;
#[cfg(not(loom))]
use std::ptr::NonNull;

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
        // To the global queue now: in this thread's bag the old value
        // waited for 63 more deferred functions, and a thread that only
        // inserts defers nothing else — a table grown to 10M entries kept
        // every index it had outgrown (~17 B per entry of RSS, half again
        // the current index). The callers hold no lock a deferred function
        // of this crate takes (only the node pool's is ever taken).
        guard.flush();
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

/// Hints the CPU to fetch `v`'s cache line (dumps walk ahead of themselves
/// so several node misses overlap). No-op off x86_64.
#[inline(always)]
pub(crate) fn prefetch<T>(v: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` only hints the cache hierarchy: it never faults
    // and has no effect on program semantics, even for an invalid address
    // (here it is a valid reference anyway). The `sse` target feature it is
    // declared with is part of the x86_64 baseline, so it is always present.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>((v as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

/// Types whose all-zero bit pattern is a valid, initialised value.
///
/// # Safety
/// Implement only for such types (here: std atomics and structs of them).
pub(crate) unsafe trait Zeroable {}

// SAFETY: an all-zero AtomicU32 is the value 0.
#[cfg(not(loom))]
unsafe impl Zeroable for std::sync::atomic::AtomicU32 {}
// SAFETY: an all-zero AtomicU64 is the value 0.
#[cfg(not(loom))]
unsafe impl Zeroable for std::sync::atomic::AtomicU64 {}
// SAFETY: `Hot` and `Cold` are `repr(C)` and consist only of std
// `AtomicU32` and `AtomicU64` fields (and arrays of them), each valid as all
// zeros (padding, if any, needs no valid value).
#[cfg(not(loom))]
unsafe impl Zeroable for crate::node::Hot {}
// SAFETY: as for `Hot` above.
#[cfg(not(loom))]
unsafe impl Zeroable for crate::node::Cold {}
// SAFETY: `Bucket` is `repr(C)` and consists only of std `AtomicU32` and
// `AtomicU64` fields (and an array of them), each valid as all zeros (an
// all-zero bucket is an empty, unlocked one).
#[cfg(not(loom))]
unsafe impl Zeroable for crate::index::Bucket {}
// Under loom `HugeArray` is built from `Default` values instead.
// SAFETY: unused for memory under loom (see the loom `HugeArray`).
#[cfg(loom)]
unsafe impl<T: Default> Zeroable for T {}

#[cfg(not(loom))]
const HUGE: usize = 2 << 20;
#[cfg(not(loom))]
const PAGE: usize = 4096;

/// A fixed-length heap array of zero-initialised `T`, huge-page backed when
/// it is at least 2 MiB.
///
/// An array of 2 MiB or more is its own anonymous mapping (2 MiB aligned,
/// `MADV_HUGEPAGE`): the kernel's zero pages make it zeroed without writing
/// it, so memory is taken only as parts of it are first written — a slab
/// chunk or an index half filled costs half its size, not all of it.
/// Smaller arrays come from the allocator and are zeroed by it.
#[cfg(not(loom))]
pub(crate) struct HugeArray<T: Zeroable> {
    ptr: NonNull<T>,
    len: usize,
    /// Bytes asked for (what [`bytes`](Self::bytes) reports).
    size: usize,
    backing: Backing,
}

#[cfg(not(loom))]
enum Backing {
    /// From the global allocator with this layout.
    Heap(Layout),
    /// A mapping of this many bytes at `ptr` (page-rounded `size`).
    Map(usize),
}

#[cfg(not(loom))]
impl<T: Zeroable> HugeArray<T> {
    /// `len` zeroed values, or `None` if the allocation fails.
    pub(crate) fn zeroed(len: usize) -> Option<Self> {
        let size = len.checked_mul(std::mem::size_of::<T>())?;
        if size == 0 {
            return None;
        }
        if size < HUGE || std::mem::align_of::<T>() > PAGE {
            let layout = Layout::from_size_align(size, std::mem::align_of::<T>()).ok()?;
            // SAFETY: `layout` has a non-zero size (checked above); zero
            // bytes are a valid `T` (`Zeroable`), so the array is fully
            // initialised.
            let p = unsafe { std::alloc::alloc_zeroed(layout) };
            let ptr = NonNull::new(p.cast::<T>())?;
            return Some(HugeArray {
                ptr,
                len,
                size,
                backing: Backing::Heap(layout),
            });
        }
        let (ptr, map) = map_zeroed(size)?;
        Some(HugeArray {
            ptr: ptr.cast::<T>(),
            len,
            size,
            backing: Backing::Map(map),
        })
    }

    /// Bytes allocated (address space: untouched pages of a mapped array
    /// take no memory).
    pub(crate) fn bytes(&self) -> usize {
        self.size
    }
}

/// A fresh anonymous mapping of at least `size` bytes, 2 MiB aligned and
/// advised to be backed by huge pages: (start, mapped length).
#[cfg(not(loom))]
fn map_zeroed(size: usize) -> Option<(NonNull<u8>, usize)> {
    let map = size.checked_next_multiple_of(PAGE)?;
    let over = map.checked_add(HUGE)?;
    // SAFETY: a fresh private anonymous mapping: no existing memory is
    // named or changed. Its pages read as zero until written.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            over,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    let base = p as usize;
    let start = base.next_multiple_of(HUGE);
    let (head, tail) = (start - base, over - (start - base) - map);
    // SAFETY: `[base, start)` and `[start + map, base + over)` lie inside
    // the mapping just made and nothing refers to them; unmapping them
    // leaves exactly `[start, start + map)`. `head` and `tail` are page
    // multiples (`base`, `HUGE` and `map` are). Failure would only leave
    // address space mapped, so results are ignored.
    unsafe {
        if head > 0 {
            libc::munmap(p, head);
        }
        if tail > 0 {
            libc::munmap((start + map) as *mut libc::c_void, tail);
        }
    }
    // SAFETY: `[start, start + map)` is the mapping we own; MADV_HUGEPAGE
    // only changes how the kernel backs it. Failure is harmless (e.g. THP
    // disabled), so the result is ignored.
    unsafe {
        libc::madvise(start as *mut libc::c_void, map, libc::MADV_HUGEPAGE);
    }
    Some((NonNull::new(start as *mut u8)?, map))
}

#[cfg(not(loom))]
impl<T: Zeroable> std::ops::Deref for HugeArray<T> {
    type Target = [T];
    #[inline]
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` points to `len` initialised `T`s (see `zeroed`)
        // owned by `self` and freed only in `Drop`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

#[cfg(not(loom))]
impl<T: Zeroable> Drop for HugeArray<T> {
    fn drop(&mut self) {
        // SAFETY: the `len` values are initialised and dropped exactly once
        // here; then the memory is returned the way it was obtained (the
        // allocator with its layout, or the whole mapping from `zeroed`).
        unsafe {
            std::ptr::drop_in_place(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            ));
            match self.backing {
                Backing::Heap(layout) => std::alloc::dealloc(self.ptr.as_ptr().cast(), layout),
                Backing::Map(map) => {
                    libc::munmap(self.ptr.as_ptr().cast(), map);
                }
            }
        }
    }
}

// SAFETY: `HugeArray<T>` owns its `T`s like a `Box<[T]>` does.
#[cfg(not(loom))]
unsafe impl<T: Zeroable + Send> Send for HugeArray<T> {}
// SAFETY: shared access only hands out `&[T]`, like `Box<[T]>`.
#[cfg(not(loom))]
unsafe impl<T: Zeroable + Sync> Sync for HugeArray<T> {}

#[cfg(not(loom))]
impl<T: Zeroable> std::fmt::Debug for HugeArray<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HugeArray(len {})", self.len)
    }
}

/// Under loom: a plain boxed slice of `Default` values.
#[cfg(loom)]
#[derive(Debug)]
pub(crate) struct HugeArray<T>(Box<[T]>);

#[cfg(loom)]
impl<T: Default> HugeArray<T> {
    pub(crate) fn zeroed(len: usize) -> Option<Self> {
        Some(HugeArray((0..len).map(|_| T::default()).collect()))
    }
    pub(crate) fn bytes(&self) -> usize {
        self.0.len() * std::mem::size_of::<T>()
    }
}

#[cfg(loom)]
impl<T> std::ops::Deref for HugeArray<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.0
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

    /// Every size class (allocator-backed, exactly 2 MiB, mapped with a
    /// tail that is not a page multiple) reads as zeros, holds what is
    /// written to every element, and a mapped one is 2 MiB aligned.
    #[test]
    fn huge_arrays_are_zeroed_writable_and_aligned() {
        for len in [
            1,
            1000,
            HUGE / 4 - 1,
            HUGE / 4,
            HUGE / 4 + 1,
            3 * HUGE / 4 + 3,
        ] {
            let a = HugeArray::<AtomicU32>::zeroed(len).expect("allocation");
            assert_eq!(a.len(), len);
            assert_eq!(a.bytes(), len * 4);
            if len * 4 >= HUGE {
                assert_eq!(a.as_ptr() as usize % HUGE, 0, "len {len}");
            }
            assert!(a.iter().all(|x| x.load(Relaxed) == 0), "len {len}");
            for (i, x) in a.iter().enumerate() {
                x.store(i as u32 ^ 0x5555_5555, Relaxed);
            }
            for (i, x) in a.iter().enumerate() {
                assert_eq!(x.load(Relaxed), i as u32 ^ 0x5555_5555);
            }
        }
        assert!(HugeArray::<AtomicU32>::zeroed(0).is_none());
    }

    /// A mapped array takes memory only where it is written: an untouched
    /// 64 MiB array costs (almost) no RSS (it cost all 64 MiB when arrays
    /// were zeroed by writing).
    #[test]
    fn an_untouched_mapped_array_takes_no_memory() {
        fn rss() -> usize {
            let s = std::fs::read_to_string("/proc/self/statm").unwrap();
            s.split_whitespace()
                .nth(1)
                .unwrap()
                .parse::<usize>()
                .unwrap()
                * 4096
        }
        let before = rss();
        let a = HugeArray::<AtomicU32>::zeroed(16 << 20).expect("allocation");
        let after = rss();
        // Other test threads allocate too; 8 MiB of slack out of 64 MiB.
        assert!(after < before + (8 << 20), "{before} -> {after}");
        drop(a);
    }
}

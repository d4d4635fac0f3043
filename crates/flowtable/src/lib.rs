//! weir's connection table: an I/O-free, concurrent, multi-tenant flow table.
//!
//! No clock and no randomness are read inside: every operation that needs
//! time takes `now: Millis`, and the hash seed comes from
//! [`TableConfig::seed`] (`None` draws one at construction).
//!
//! # Layout
//! * **Entries** are fixed 112-byte nodes made only of atomics, kept in a
//!   slab of never-freed chunks and linked by `u32` index (`node.rs`). No
//!   `Box` per entry, no malloc header: at 10 M entries with a 2^24-bucket
//!   table that is 112 B + 6.7 B of bucket head + ~4 B of wheel reference.
//! * **Tables** (`table.rs`): an array of 4-byte bucket heads, a power of two,
//!   plus lock stripes (bucket `b` belongs to stripe `b & (stripes-1)`).
//!   There is one shared table; a tenant may own one (see below).
//! * **Tenants** (`flow.rs`): a copy-on-write directory read through an
//!   epoch-protected pointer (`raw.rs`, the crate's only `unsafe`). Each tenant
//!   has its timeouts, entry counters and its own expiry wheel.
//!
//! # Hashing
//! A keyed hash per table from the seed (foldhash's `quality` variant over
//! the packed key, `hash.rs`; SipHash-1-3 until it was measured at 45% of a
//! lookup miss's instructions), with a per-tenant salt mixed in (so two
//! tenants' identical 4-tuples land in unrelated buckets of the shared
//! table); the full key, tenant included, is compared on lookup.
//! Hash flooding is bounded by a chain cap ([`TableConfig::max_chain`]):
//! an insert into a chain that already holds that many entries is refused
//! with [`InsertError::ChainFull`] and counted per tenant, like conntrack.
//!
//! # Concurrency
//! * `get` and `touch` take no lock and write no shared cache line: they pin
//!   a crossbeam epoch (a thread-local write), load the tenant directory and
//!   follow `Acquire` links. `touch` writes only the entry's own counters.
//! * `insert`, `remove`, `set_state` lock one stripe (parking_lot mutex).
//!   Inserts append at the chain tail, so a chain is ordered by cookie.
//!   Free and retired node indices go through per-thread caches (not
//!   per-stripe ones), so a freed node is reused while its lines are still
//!   cached.
//! * A removed node's index is recycled only after an epoch grace period, so
//!   a reader never sees a node change identity; the chain protocol is in
//!   `chain.rs` and model-checked with loom (`src/loom_checks.rs`, run by `tests/loom.rs`).
//! * Cookies: a global counter hands out blocks of 256 to stripes, so cookies
//!   are unique for the table's life, never 0, and increase along each chain.
//!
//! # Tenants
//! [`FlowTable::add_tenant`] with `own_buckets == 0` shares the global table;
//! otherwise the tenant gets its own table of that size (a power of two
//! `<= 2^24`, fixed), unless it does not fit in [`TableConfig::memory_budget`]
//! or the allocation fails — then it shares and [`Placement::Shared`] says
//! why. [`FlowTable::remove_tenant`] finds the tenant's entries through its
//! own wheel, so it costs O(its entries), not a walk of the shared table.
//!
//! # Expiry
//! An entry expires when `now >= last_active + timeout(tenant, state)`
//! (defaults: IPVS's, see [`Timeouts`]). Each tenant has a timing wheel of
//! 1024 one-second slots (`wheel.rs`). `touch` never reschedules: when a
//! slot comes due each entry in it is re-checked and either removed or
//! refiled (lazy rescheduling). [`FlowTable::expire`] does bounded work per
//! call; entries go at most one tick (1 s) plus the caller's period late,
//! never early.
//!
//! # Dumps
//! [`FlowTable::dump`] pages through tables (shared first, then own tables by
//! tenant id), buckets in order, and each chain in cookie order. The
//! [`Cursor`] is (table, bucket, last cookie returned). Resuming re-walks
//! that one chain skipping cookies `<=` the last one, which costs at most
//! `max_chain` steps, so a whole dump is O(entries + buckets) whatever the
//! page size. An entry present throughout keeps its bucket and its place in
//! the cookie order, so it is returned exactly once; inserted or removed
//! entries at most once. Each call also ignores cookies issued after it
//! started, so every walk is finite even under an endless insert storm.
//!
//! # Not (yet) done
//! Online resize: the layout is ready for it (index links, per-table heads,
//! cookie-ordered chains), see `docs/flowtable.md` for the plan.

#![warn(missing_docs)]

mod cursor;
mod flow;
mod hash;
mod index;
mod node;
mod raw;
mod sync;
mod table;
mod types;
mod wheel;

pub use cursor::Cursor;
pub use flow::{FlowTable, LOOKUP_BATCH, Reader};
pub use types::*;

#[cfg(loom)]
#[doc(hidden)]
pub mod loom_checks;

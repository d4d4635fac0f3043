//! weir's connection table: an I/O-free, concurrent, multi-tenant flow table.
//!
//! No clock and no randomness are read inside: every operation that needs
//! time takes `now: Millis`, and the hash seed comes from
//! [`TableConfig::seed`] (`None` draws one at construction).
//!
//! # Layout
//! * **Entries** are fixed 112-byte nodes made only of atomics, kept in a
//!   slab of never-freed chunks and named by `u32` index (`node.rs`). The
//!   node is the flow: key, service, backend, state, timers, counters each
//!   way, the owner's token and the NAT slot (a reply key costs no node
//!   bytes, only a second index way).
//! * **Indexes** (`index.rs`): arrays of 64-byte bucket lines, each with a
//!   header (lock bit, moved bit, counts), an overflow link, eleven one-byte
//!   tags (in a `u64` and a `u32`) and eleven node indices
//!   ([`BUCKET_WAYS`]). A table (`table.rs`) has one index, two while it
//!   resizes. There is one shared table; a tenant may own one.
//! * **Tenants** (`flow.rs`): a copy-on-write directory read through an
//!   epoch-protected pointer (`raw.rs`, the crate's only `unsafe`). Each tenant
//!   has its timeouts, entry counters and its own expiry wheel.
//!
//! # Hashing
//! A keyed hash per table from the seed (foldhash's `quality` variant over
//! the packed key, `hash.rs`), with a per-tenant salt mixed in; the top 32
//! bits pick the bucket by fastrange (so bucket order is hash order for any
//! size), the low byte is the tag. The full key, tenant included, is
//! compared on lookup. Hash flooding is bounded by a chain cap
//! ([`TableConfig::max_chain`]): an insert into a bucket whose chain holds
//! that many entries is refused with [`InsertError::ChainFull`] and counted
//! per tenant, like conntrack.
//!
//! # Concurrency
//! * Lookups take no lock and write no shared cache line: a SWAR match of
//!   the key's tag against the bucket's eleven tags (two words of the same
//!   line), then the candidates' nodes. A hit costs the bucket line and the
//!   node; a miss the line.
//!   [`Reader::lookup_batch`] hashes and prefetches a batch before probing.
//! * Writers lock one bucket with a bit in its header.
//! * A removed node's index is recycled only after an epoch grace period.
//! * [`Handle`]s (node index + cookie) reach an entry without hashing.
//! * The protocol is model-checked with loom (`src/loom_checks.rs`).
//!
//! # Reply keys (packet mode)
//! A nat or fnat flow inserted with [`FlowTable::insert_reply`] is also
//! indexed by its [`ReplyKey`] (tenant, protocol, backend, and the client or
//! the NAT slot), which [`FlowTable::lookup_reply`] and
//! [`Reader::lookup_probes`] find from a backend's reply: one lookup per
//! packet either way. Still one node: the second index entry is the same
//! node index with a reply bit in its way, which forward lookups skip and
//! reply lookups require. The reply key is computed from the node's own
//! fields, so every removal and every resize takes or moves both entries.
//! The node is pending (not live) until both entries are in, so a refused
//! insert is never seen; removal takes the forward entry out first (which
//! decides it), then the reply entry and the live bit.
//!
//! # Resize
//! Online: a successor index is filled one bucket at a time under each
//! bucket's lock by inserts, removes and [`FlowTable::maintain`]; readers
//! follow moved buckets; nothing stops.
//!
//! # Expiry
//! An entry expires when `now >= last_active + timeout(tenant, state)`
//! (defaults: IPVS's, see [`Timeouts`]). Each tenant has a timing wheel of
//! 1024 one-second slots (`wheel.rs`). `touch` never reschedules: when a
//! slot comes due each entry in it is re-checked and either removed or
//! refiled (lazy rescheduling). [`FlowTable::expire`] does bounded work per
//! call; entries go at most one tick (1 s) plus the caller's period late,
//! never early. A shortened timeout ([`FlowTable::set_timeouts`]) starts a
//! retime pass that moves already-filed entries to earlier slots, at most
//! [`RETIME_REFS`] wheel references per `expire` call.
//!
//! # Dumps
//! [`FlowTable::dump`] pages through tables (shared first, then own tables by
//! tenant id), each in hash order. The [`Cursor`] is (table, hash position,
//! cookie): resuming reads one bucket, and the order does not change when
//! the table resizes, so an entry present for the whole dump is returned
//! exactly once, resizes or not; inserted or removed entries at most once.
//!
//! See `docs/flowtable.md` for the arguments and the measurements.

#![warn(missing_docs)]

mod chunks;
mod counts;
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

pub use chunks::ChunkGeometry;
pub use cursor::Cursor;
pub use flow::{FlowTable, LOOKUP_BATCH, Profile, RETIME_REFS, Reader};
#[doc(hidden)]
pub use index::index_bytes_alive;
pub use types::*;

/// Index entries (ways) per 64-byte bucket line: an entry takes one, a
/// packet-mode entry with a reply key two. Tables are sized for a load of
/// 0.75 of them (`TableStats::load_factor` counts per way).
pub const BUCKET_WAYS: usize = index::WAYS;

/// Index bytes per bucket: its 64-byte line and its 8-byte summary
/// (overflow lines not included).
pub const BUCKET_BYTES: usize = index::BUCKET_BYTES;

#[cfg(loom)]
#[doc(hidden)]
pub mod loom_checks;

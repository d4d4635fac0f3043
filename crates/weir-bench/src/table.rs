//! `weir-bench table`: weir's flow table against dashmap, papaya, scc and a
//! striped `Mutex<HashMap>`, with single-threaded hashbrown as the ceiling.
//!
//! Sections (JSON keys in brackets):
//! - noisy neighbour [`noisy.shared[]`, `noisy.own[]`] — seed 000's experiment, weir only;
//! - churn [`churn[]`] — insert+remove pairs/s with a fixed live set;
//! - lookup [`lookup[]`] — hit and miss lookups/s, weir also batched
//!   (`batched: true`, `Reader::lookup_batch`); the full plan adds weir alone
//!   at 100M entries;
//! - resize [`resize`] — lookup latency percentiles while the table grows
//!   online from `from` to `to` entries, and a paged dump across the growth
//!   checked for duplicates and misses (weir only);
//! - tenants [`tenants[]`] — expire cost with 1 to 100,000 tenants sharing
//!   the table, one UDP entry each: `add_tenants` (and `add_tenant` one at a
//!   time up to 10,000), the first expire call, idle expire calls (nothing
//!   due: flat in tenants, no wheel visited), due expire per entry, bytes
//!   per tenant (weir only; about 1 s, so in every run, with `--quick` at
//!   up to 10,000 tenants);
//! - memory [`memory[]`] — bytes per entry, each implementation built in a
//!   fresh child process (this binary re-run with `WEIR_BENCH_MEMORY_CHILD`)
//!   so one map's freed memory never hides the next one's footprint; the full
//!   plan adds weir alone at 100M entries.
//!
//! Peers and the hashbrown ceiling hash with foldhash `quality` and a random
//! seed, weir's hash family, so only the table design differs; `--siphash`
//! runs the peer sections again with SipHash-1-3 (`hasher` in every row).
//!
//! Every implementation stores the same key ([`harness::Key`]: tenant, proto,
//! client and virtual socket addresses, IPv6-capable) and an equivalent value
//! ([`harness::PeerVal`], weir's entry payload). Every measurement is bounded
//! by an operation count and a time limit. Only one implementation is built
//! at a time and it is dropped before the next is built.

pub(crate) mod harness;
pub(crate) mod peers;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use std::sync::atomic::{AtomicU8, Ordering};

use weir_flowtable::{
    BackendId, Cursor, DumpFilter, FlowInit, FlowKey, FlowState, FlowTable, InsertError,
    LOOKUP_BATCH, Millis, Placement, Proto, ServiceId, TableConfig, TenantConfig, TenantId,
    Timeouts,
};

use crate::Common;
use crate::report::{Table, ratio};
use harness::{Limit, PeerVal, Run, idx_of, key, run, run_equal, si};
use peers::{Ceiling, ConcMap, Dash, Fold, Ops, Papaya, PeerHasher, Scc, Sip, Striped, Weir};

/// Environment variable that turns a `weir-bench table` process into a memory probe.
const MEMORY_CHILD: &str = "WEIR_BENCH_MEMORY_CHILD";
/// Prefix of the probe's one result line on stdout.
const MEMORY_LINE: &str = "weir-bench-memory:";

/// The tenant lookups, churn and memory use (noisy neighbour uses two).
const TENANT: u32 = 1;

/// Implementations raced. `Weir*` variants share one code path with
/// different lookup operations; only the plain ones count as peers for
/// "vs best peer".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Impl {
    /// weir, lookups with `get`.
    Weir,
    /// weir, lookups with the data path's `touch` (writes the entry's counters).
    WeirTouch,
    /// weir, `get` through a `Reader` pinned once per batch of [`READER_BATCH`]
    /// lookups (how a data-path worker handles a batch of packets).
    WeirReader,
    /// weir, `Reader::lookup_batch` over [`READER_BATCH`] keys per pin
    /// (hash and prefetch the batch, then probe).
    WeirBatch,
    Dash,
    Papaya,
    Scc,
    Striped,
    Ceiling,
}

impl Impl {
    const CHURN: [Impl; 6] = [
        Impl::Weir,
        Impl::Dash,
        Impl::Papaya,
        Impl::Scc,
        Impl::Striped,
        Impl::Ceiling,
    ];
    const LOOKUP: [Impl; 9] = [
        Impl::Weir,
        Impl::WeirTouch,
        Impl::WeirReader,
        Impl::WeirBatch,
        Impl::Dash,
        Impl::Papaya,
        Impl::Scc,
        Impl::Striped,
        Impl::Ceiling,
    ];
    const MEMORY: [Impl; 6] = [
        Impl::Weir,
        Impl::Dash,
        Impl::Papaya,
        Impl::Scc,
        Impl::Striped,
        Impl::Ceiling,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Impl::Weir => "weir",
            Impl::WeirTouch => "weir (touch)",
            Impl::WeirReader => "weir (reader, 64/pin)",
            Impl::WeirBatch => "weir (lookup_batch, 64/pin)",
            Impl::Dash => "dashmap",
            Impl::Papaya => "papaya",
            Impl::Scc => "scc",
            Impl::Striped => "striped-mutex",
            Impl::Ceiling => "hashbrown-1t",
        }
    }

    fn from_name(s: &str) -> Option<Self> {
        Self::CHURN
            .into_iter()
            .chain(Self::LOOKUP)
            .find(|i| i.name() == s)
    }

    fn is_peer(self) -> bool {
        matches!(self, Impl::Dash | Impl::Papaya | Impl::Scc | Impl::Striped)
    }

    fn max_threads(self) -> usize {
        if self == Impl::Ceiling { 1 } else { usize::MAX }
    }

    /// The hasher this implementation's rows use: weir always keys its own.
    fn hasher<S: PeerHasher>(self) -> &'static str {
        if self.is_peer() || self == Impl::Ceiling {
            S::NAME
        } else {
            Fold::NAME
        }
    }
}

/// Something the runner can hand per-thread [`Ops`] handles out of.
pub(crate) trait Target {
    type H<'a>: Ops + Send
    where
        Self: 'a;
    /// `n` handles for `n` threads (the ceiling only ever gets `n == 1`).
    fn handles(&mut self, n: usize) -> Vec<Self::H<'_>>;
    /// Bytes the implementation itself accounts for, where it reports it.
    fn memory_bytes(&self) -> Option<usize> {
        None
    }
}

/// A concurrent map shared by reference.
#[derive(Debug)]
pub(crate) struct Conc<M>(pub(crate) M);

impl<M: ConcMap> Target for Conc<M> {
    type H<'a>
        = &'a M
    where
        M: 'a;
    fn handles(&mut self, n: usize) -> Vec<&M> {
        vec![&self.0; n]
    }
    fn memory_bytes(&self) -> Option<usize> {
        self.0.c_memory()
    }
}

impl<S: PeerHasher> Target for Ceiling<S> {
    type H<'a> = &'a mut Ceiling<S>;
    fn handles(&mut self, _n: usize) -> Vec<&mut Ceiling<S>> {
        vec![self]
    }
}

/// One built implementation, so several can be alive at once and measured
/// in interleaved rounds. (A handful exist at a time: variant sizes do not matter.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
enum Built<S: PeerHasher> {
    Weir(Conc<Weir>),
    Dash(Conc<Dash<S>>),
    Papaya(Conc<Papaya<S>>),
    Scc(Conc<Scc<S>>),
    Striped(Conc<Striped<S>>),
    Ceiling(Ceiling<S>),
}

impl<S: PeerHasher> Built<S> {
    /// Implementation `imp`, presized for `cap` entries.
    fn new(imp: Impl, cap: usize) -> Self {
        match imp {
            Impl::Weir => Built::Weir(Conc(Weir::new(cap, false))),
            Impl::WeirTouch => Built::Weir(Conc(Weir::new(cap, true))),
            Impl::WeirReader | Impl::WeirBatch => Built::Weir(Conc(Weir::new(cap, false))),
            Impl::Dash => Built::Dash(Conc(Dash::new(cap))),
            Impl::Papaya => Built::Papaya(Conc(Papaya::new(cap))),
            Impl::Scc => Built::Scc(Conc(Scc::new(cap))),
            Impl::Striped => Built::Striped(Conc(Striped::new(cap))),
            Impl::Ceiling => Built::Ceiling(Ceiling::with_capacity_and_hasher(cap, S::default())),
        }
    }
}

/// Runs `$body` with `$t` bound to the `&mut impl Target` inside a `&mut Built`
/// (monomorphised per implementation: no dynamic dispatch in the loops).
macro_rules! on_built {
    ($b:expr, |$t:ident| $body:expr) => {
        match $b {
            Built::Weir($t) => $body,
            Built::Dash($t) => $body,
            Built::Papaya($t) => $body,
            Built::Scc($t) => $body,
            Built::Striped($t) => $body,
            Built::Ceiling($t) => $body,
        }
    };
}

/// Builds implementation `imp` presized for `cap` entries, peers hashing
/// with `$s`, and runs `$body` with it bound to `$t` (a `&mut impl Target`);
/// drops it afterwards.
macro_rules! with_impl {
    ($s:ty, $imp:expr, $cap:expr, |$t:ident| $body:expr) => {{
        let mut built = Built::<$s>::new($imp, $cap);
        on_built!(&mut built, |$t| $body)
    }};
}

/// The median run by throughput (the upper one of the middle two for an even count).
fn median(mut runs: Vec<Run>) -> Option<Run> {
    runs.sort_by(|a, b| a.per_sec().total_cmp(&b.per_sec()));
    runs.get(runs.len() / 2).copied()
}

/// Sizes and time limits of one run.
#[derive(Debug, Clone)]
struct Plan {
    noisy: Vec<u64>,
    churn_live: u64,
    lookup_sizes: Vec<u64>,
    memory_entries: u64,
    measure: Duration,
    build_limit: Duration,
    /// Rounds per figure; the median is reported. Implementations that fit in
    /// memory together are measured round-robin within each round.
    rounds: usize,
    /// Largest size at which all implementations are built at once.
    interleave_max: u64,
    /// weir alone (get, reader, batched) at this many entries, compared with
    /// its 1M row (peers left out: most would not fit in 24 GiB or take too long).
    lookup_big: Option<u64>,
    /// A weir-only memory row at this many entries.
    memory_big: Option<u64>,
    /// Resize row: (starting size, entries filled to).
    resize: (u64, u64),
    /// Tenants section (weir alone): its tenant counts; empty = skipped.
    tenants: Vec<u32>,
}

impl Plan {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                noisy: vec![0, 1 << 20, 4 << 20],
                churn_live: 1_000_000,
                lookup_sizes: vec![1_000_000],
                memory_entries: 1_000_000,
                measure: Duration::from_millis(100),
                build_limit: Duration::from_secs(12),
                rounds: 3,
                interleave_max: 1_000_000,
                lookup_big: None,
                memory_big: None,
                resize: (1 << 16, 1 << 20),
                tenants: TENANTS_QUICK.to_vec(),
            }
        } else {
            Self {
                noisy: vec![0, 1 << 20, 4 << 20, 16 << 20, 24 << 20],
                churn_live: 1_000_000,
                lookup_sizes: vec![1_000_000, 10_000_000],
                memory_entries: 10_000_000,
                measure: Duration::from_millis(1000),
                build_limit: Duration::from_secs(420),
                rounds: 3,
                interleave_max: 1_000_000,
                lookup_big: Some(BIG),
                memory_big: Some(BIG),
                resize: (1_000_000, 16_000_000),
                tenants: TENANTS_FULL.to_vec(),
            }
        }
    }

    fn limit(&self) -> Limit {
        Limit {
            ops: 1 << 40,
            time: self.measure,
        }
    }
}

/// Stateless index scrambler (splitmix64 finaliser): thread `t`'s `j`-th pick.
fn pick(seed: u64, t: usize, j: u64, n: u64) -> u64 {
    let mut r =
        harness::Rng::new(seed ^ ((t as u64) << 56) ^ j.wrapping_mul(0x2545_f491_4f6c_dd1d));
    r.below(n)
}

/// Inserts keys `range` of `tenant` through one handle; fails if any was not new.
fn fill<T: Target>(t: &mut T, tenant: u32, range: std::ops::Range<u64>) -> Result<()> {
    let mut hs = t.handles(1);
    let h = hs.first_mut().context("no handle")?;
    for i in range {
        if !h.insert(key(tenant, i), PeerVal::for_idx(i)) {
            bail!("insert of key {i} failed or was a duplicate");
        }
    }
    Ok(())
}

/// Lookups/s on a map holding keys `0..n`: hits pick in `0..n`, misses in `n..2n`.
fn lookups<T: Target>(t: &mut T, n: u64, threads: usize, hit: bool, limit: Limit) -> Result<Run> {
    let r = run(t.handles(threads), limit, |h, th, j| {
        let i = pick(0x5eed, th, j, n) + if hit { 0 } else { n };
        u64::from(h.get(&key(TENANT, i)).is_some())
    });
    let expect = if hit { r.ops } else { 0 };
    if r.ok != expect {
        bail!(
            "lookup check failed: {} of {} found (hit={hit})",
            r.ok,
            r.ops
        );
    }
    Ok(r)
}

/// Lookups per epoch pin of [`Impl::WeirReader`] and keys per
/// `lookup_batch` call of [`Impl::WeirBatch`] (two of its chunks).
const READER_BATCH: u64 = 2 * LOOKUP_BATCH as u64;

/// Entries of the full plan's weir-only lookup and memory rows.
const BIG: u64 = 100_000_000;

/// Like [`lookups`] for weir through `FlowTable::reader`: each iteration of
/// the runner is one batch of `READER_BATCH` lookups under one pin.
fn reader_lookups(
    table: &FlowTable,
    n: u64,
    threads: usize,
    hit: bool,
    limit: Limit,
) -> Result<Run> {
    let limit = Limit {
        ops: limit.ops / READER_BATCH,
        ..limit
    };
    let r = run(vec![table; threads], limit, |t, th, j| {
        let rd = t.reader();
        let mut ok = 0;
        for b in 0..READER_BATCH {
            let i = pick(0x5eed, th, j * READER_BATCH + b, n) + if hit { 0 } else { n };
            ok += u64::from(rd.lookup(&key(TENANT, i)).is_some());
        }
        ok
    });
    let r = Run {
        ops: r.ops * READER_BATCH,
        ..r
    };
    let expect = if hit { r.ops } else { 0 };
    if r.ok != expect {
        bail!(
            "reader lookup check failed: {} of {} found (hit={hit})",
            r.ok,
            r.ops
        );
    }
    Ok(r)
}

/// Like [`reader_lookups`] through `Reader::lookup_batch`: each iteration
/// of the runner builds [`READER_BATCH`] keys and looks them up in one call
/// under one pin. Checks every result, as [`lookups`] does.
fn batch_lookups(
    table: &FlowTable,
    n: u64,
    threads: usize,
    hit: bool,
    limit: Limit,
) -> Result<Run> {
    const K: usize = READER_BATCH as usize;
    let limit = Limit {
        ops: limit.ops / READER_BATCH,
        ..limit
    };
    let handles = (0..threads)
        .map(|_| (table, Vec::with_capacity(K)))
        .collect();
    let r = run(handles, limit, |h, th, j| {
        let (t, out) = h;
        let keys: [FlowKey; K] = std::array::from_fn(|b| {
            let i = pick(0x5eed, th, j * READER_BATCH + b as u64, n);
            key(TENANT, i + if hit { 0 } else { n })
        });
        t.reader().lookup_batch(&keys, out);
        out.iter().filter(|o| o.is_some()).count() as u64
    });
    let r = Run {
        ops: r.ops * READER_BATCH,
        ..r
    };
    let expect = if hit { r.ops } else { 0 };
    if r.ok != expect {
        bail!(
            "batched lookup check failed: {} of {} found (hit={hit})",
            r.ok,
            r.ops
        );
    }
    Ok(r)
}

/// Insert+remove pairs/s on `threads` threads with `live` entries kept live.
/// The live set is the window `[base, base + live)`: iteration `j` of thread
/// `th` is position `p = j * threads + th`; it inserts key `base + live + p`
/// and removes key `base + p` (which the same thread inserted earlier, or the
/// prefill did; `live` is a multiple of `threads`). Every thread does the
/// same number of iterations ([`run_equal`]), so afterwards the window is
/// `[base + ops, base + ops + live)` and the next run continues from there.
fn churn<T: Target>(t: &mut T, live: u64, base: u64, threads: usize, limit: Limit) -> Result<Run> {
    let tn = threads as u64;
    if !live.is_multiple_of(tn) {
        bail!("live entries {live} not a multiple of {threads} threads");
    }
    let r = run_equal(t.handles(threads), limit, |h, th, j| {
        let p = j * tn + th as u64;
        let add = base + live + p;
        let ins = h.insert(key(TENANT, add), PeerVal::for_idx(add));
        let rem = h.remove(&key(TENANT, base + p));
        u64::from(ins && rem)
    });
    if r.ok != r.ops {
        bail!("churn check failed: {} of {} pairs succeeded", r.ok, r.ops);
    }
    Ok(r)
}

/// One row of a throughput table.
#[derive(Debug, Clone)]
struct Row {
    imp: &'static str,
    hasher: &'static str,
    peer: bool,
    ceiling: bool,
    /// Looked up through `Reader::lookup_batch`.
    batched: bool,
    entries: u64,
    threads: usize,
    hit: bool,
    ops_per_s: f64,
    cpu_share: f64,
}

/// Best peer for the same (entries, threads, hit) and the ceiling for the same (entries, hit).
fn best_and_ceiling(rows: &[Row], r: &Row) -> (f64, f64) {
    best_and_ceiling_by(rows, r, |o| o.ops_per_s)
}

/// [`best_and_ceiling`] on any per-row figure.
fn best_and_ceiling_by(rows: &[Row], r: &Row, f: impl Fn(&Row) -> f64) -> (f64, f64) {
    let best = rows
        .iter()
        .filter(|o| o.peer && o.entries == r.entries && o.threads == r.threads && o.hit == r.hit)
        .map(&f)
        .fold(0.0, f64::max);
    let ceil = rows
        .iter()
        .filter(|o| o.ceiling && o.entries == r.entries && o.hit == r.hit)
        .map(&f)
        .fold(0.0, f64::max);
    (best, ceil)
}

impl Row {
    fn per_sec_of(&self) -> f64 {
        self.ops_per_s
    }

    /// Throughput per unit of CPU share: what the run would have done had
    /// its threads never waited for a core. Flatters implementations whose
    /// threads sleep on a lock, so it is a cross-check, not the figure.
    fn per_cpu(&self) -> f64 {
        if self.cpu_share > 0.0 {
            self.ops_per_s / self.cpu_share
        } else {
            0.0
        }
    }
}

/// Per-round runs keyed by (impl, threads, hit), in first-seen order.
type Samples = Vec<((Impl, usize, bool), Vec<Run>)>;

/// Median rows from per-round samples keyed by (impl, threads, hit).
fn rows_from<S: PeerHasher>(samples: Samples, entries: u64) -> Vec<Row> {
    samples
        .into_iter()
        .filter_map(|((imp, threads, hit), runs)| {
            let r = median(runs)?;
            Some(Row {
                imp: imp.name(),
                hasher: imp.hasher::<S>(),
                peer: imp.is_peer(),
                ceiling: imp == Impl::Ceiling,
                batched: imp == Impl::WeirBatch,
                entries,
                threads,
                hit,
                ops_per_s: r.per_sec(),
                cpu_share: r.cpu_share(),
            })
        })
        .collect()
}

/// Adds `r` to the samples of `key`, keeping first-seen order.
fn push_sample(samples: &mut Samples, key: (Impl, usize, bool), r: Run) {
    match samples.iter_mut().find(|(k, _)| *k == key) {
        Some((_, v)) => v.push(r),
        None => samples.push((key, vec![r])),
    }
}

/// Churn with every implementation alive at once (1M entries each) and
/// measured round-robin, `plan.rounds` times; medians reported.
fn churn_section<S: PeerHasher>(plan: &Plan) -> Result<Vec<Row>> {
    let live = plan.churn_live;
    let mut built = Vec::new();
    for imp in Impl::CHURN {
        let mut b = Built::<S>::new(imp, live as usize);
        on_built!(&mut b, |t| fill(t, TENANT, 0..live))
            .with_context(|| format!("churn prefill {}", imp.name()))?;
        built.push((imp, b, 0u64));
    }
    let mut samples = Vec::new();
    for _ in 0..plan.rounds {
        for (imp, b, base) in &mut built {
            for threads in [1usize, 2] {
                if threads > imp.max_threads() {
                    continue;
                }
                let r = on_built!(b, |t| churn(t, live, *base, threads, plan.limit()))
                    .with_context(|| format!("churn {}", imp.name()))?;
                *base += r.ops;
                push_sample(&mut samples, (*imp, threads, true), r);
            }
        }
    }
    Ok(rows_from::<S>(samples, live))
}

/// Lookups: at sizes up to `plan.interleave_max` every implementation is
/// alive at once and measured round-robin; above it (10M) one at a time,
/// its rounds back to back, dropped before the next is built.
fn lookup_section<S: PeerHasher>(plan: &Plan) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &n in &plan.lookup_sizes {
        let groups: Vec<Vec<Impl>> = if n <= plan.interleave_max {
            vec![Impl::LOOKUP.to_vec()]
        } else {
            Impl::LOOKUP.iter().map(|&i| vec![i]).collect()
        };
        let mut samples = Vec::new();
        for group in groups {
            let mut built = Vec::new();
            for imp in group {
                let mut b = Built::<S>::new(imp, n as usize);
                on_built!(&mut b, |t| fill(t, TENANT, 0..n))
                    .with_context(|| format!("filling {}", imp.name()))?;
                built.push((imp, b));
            }
            for _ in 0..plan.rounds {
                for (imp, b) in &mut built {
                    for threads in [1usize, 2] {
                        if threads > imp.max_threads() {
                            continue;
                        }
                        for hit in [true, false] {
                            let r = match (&*imp, &mut *b) {
                                (Impl::WeirReader, Built::Weir(w)) => {
                                    reader_lookups(&w.0.table, n, threads, hit, plan.limit())
                                }
                                (Impl::WeirBatch, Built::Weir(w)) => {
                                    batch_lookups(&w.0.table, n, threads, hit, plan.limit())
                                }
                                (_, b) => {
                                    on_built!(b, |t| lookups(t, n, threads, hit, plan.limit()))
                                }
                            }
                            .with_context(|| format!("lookup {}", imp.name()))?;
                            push_sample(&mut samples, (*imp, threads, hit), r);
                        }
                    }
                }
            }
        }
        rows.extend(rows_from::<S>(samples, n));
    }
    Ok(rows)
}

/// weir alone at `plan.lookup_big` entries: see [`lookup_weir_only`].
fn lookup_big_section(plan: &Plan) -> Result<Vec<Row>> {
    match plan.lookup_big {
        Some(n) => lookup_weir_only(plan, n),
        None => Ok(Vec::new()),
    }
}

/// weir alone at `n` entries: one table (filled on two threads), its
/// `get`, reader and batched rows measured round-robin.
fn lookup_weir_only(plan: &Plan, n: u64) -> Result<Vec<Row>> {
    let mut w = Conc(Weir::new(n as usize, false));
    let deadline = Instant::now() + plan.build_limit;
    let (ins, refused) = par_fill(&w.0.table, TENANT, 0..n, 2, deadline)?;
    if (ins, refused) != (n, 0) {
        bail!(
            "{} lookup table: {ins} of {n} inserted ({refused} refused) within {}s",
            si(n as f64),
            plan.build_limit.as_secs()
        );
    }
    let mut samples = Vec::new();
    for _ in 0..plan.rounds {
        for imp in [Impl::Weir, Impl::WeirReader, Impl::WeirBatch] {
            for threads in [1usize, 2] {
                for hit in [true, false] {
                    let r = match imp {
                        Impl::WeirReader => {
                            reader_lookups(&w.0.table, n, threads, hit, plan.limit())
                        }
                        Impl::WeirBatch => batch_lookups(&w.0.table, n, threads, hit, plan.limit()),
                        _ => lookups(&mut w, n, threads, hit, plan.limit()),
                    }
                    .with_context(|| format!("lookup {} at {}", imp.name(), si(n as f64)))?;
                    push_sample(&mut samples, (imp, threads, hit), r);
                }
            }
        }
    }
    Ok(rows_from::<Fold>(samples, n))
}

/// One memory figure.
#[derive(Debug, Clone)]
struct Mem {
    imp: String,
    hasher: String,
    entries: u64,
    rss_bytes_per_entry: f64,
    self_bytes_per_entry: Option<f64>,
}

/// In the child: builds `imp` with `n` entries and prints one result line.
/// `spec` is `impl:entries:hasher`.
fn memory_child(spec: &str) -> Result<Value> {
    let mut parts = spec.split(':');
    let (Some(name), Some(n), Some(hasher), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        bail!("memory child spec is impl:entries:hasher, got {spec:?}");
    };
    let n: u64 = n.parse().context("memory child entries")?;
    let imp = Impl::from_name(name).with_context(|| format!("unknown impl {name}"))?;
    let before = harness::rss_bytes();
    let (after, own) = match hasher {
        h if h == Fold::NAME => with_impl!(Fold, imp, n as usize, |t| {
            fill(t, TENANT, 0..n)?;
            (harness::rss_bytes(), t.memory_bytes())
        }),
        h if h == Sip::NAME => with_impl!(Sip, imp, n as usize, |t| {
            fill(t, TENANT, 0..n)?;
            (harness::rss_bytes(), t.memory_bytes())
        }),
        h => bail!("unknown hasher {h:?}"),
    };
    let v = json!({
        "impl": imp.name(),
        "hasher": hasher,
        "entries": n,
        "rss_delta": after.saturating_sub(before),
        "self_bytes": own,
    });
    println!("{MEMORY_LINE}{v}");
    Ok(v)
}

/// In the parent: runs one child per implementation (with `peers`), one
/// after the other, then weir alone at `plan.memory_big` entries.
fn memory_section<S: PeerHasher>(plan: &Plan, peers: bool) -> Result<Vec<Mem>> {
    let exe = std::env::current_exe().context("locating weir-bench")?;
    let mut out = Vec::new();
    let runs = Impl::MEMORY
        .into_iter()
        .filter(|_| peers)
        .map(|i| (i, plan.memory_entries))
        .chain(plan.memory_big.map(|n| (Impl::Weir, n)));
    for (imp, entries) in runs {
        let o = std::process::Command::new(&exe)
            .arg("table")
            .env(
                MEMORY_CHILD,
                format!("{}:{entries}:{}", imp.name(), S::NAME),
            )
            .output()
            .with_context(|| format!("running memory child for {}", imp.name()))?;
        let stdout = String::from_utf8_lossy(&o.stdout);
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix(MEMORY_LINE))
            .with_context(|| {
                format!(
                    "memory child for {} printed no result (status {}): {}",
                    imp.name(),
                    o.status,
                    String::from_utf8_lossy(&o.stderr)
                )
            })?;
        let v: Value = serde_json::from_str(line).context("parsing memory child line")?;
        let n = v["entries"].as_u64().unwrap_or(0).max(1) as f64;
        out.push(Mem {
            imp: imp.name().to_string(),
            hasher: imp.hasher::<S>().to_string(),
            entries: v["entries"].as_u64().unwrap_or(0),
            rss_bytes_per_entry: v["rss_delta"].as_f64().unwrap_or(0.0) / n,
            self_bytes_per_entry: v["self_bytes"].as_f64().map(|b| b / n),
        });
    }
    Ok(out)
}

fn print_rows(title: &str, rows: &[Row], with_hit: bool, unit: &str) {
    if rows.is_empty() {
        return;
    }
    println!("### {title}\n");
    let mut header = vec!["impl", "entries", "threads"];
    if with_hit {
        header.push("lookup");
    }
    let ops_h = format!("{unit}/s");
    header.extend([
        ops_h.as_str(),
        "vs best peer",
        "vs ceiling (1 thread)",
        "CPU got",
        "at 100% CPU",
        "vs best peer (at 100% CPU)",
    ]);
    let mut t = Table::new(header);
    for r in rows {
        let (best, ceil) = best_and_ceiling(rows, r);
        let mut cells = vec![
            r.imp.to_string(),
            si(r.entries as f64),
            r.threads.to_string(),
        ];
        if with_hit {
            cells.push(if r.hit { "hit" } else { "miss" }.to_string());
        }
        cells.extend([
            si(r.ops_per_s),
            ratio(r.ops_per_s, best),
            ratio(r.ops_per_s, ceil),
            format!("{:.0}%", r.cpu_share * 100.0),
            si(r.per_cpu()),
            ratio(r.per_cpu(), best_and_ceiling_by(rows, r, Row::per_cpu).0),
        ]);
        t.row(cells);
    }
    t.print();
}

/// Noisy-neighbour tenants: a victim in the shared table, a victim with its
/// own table, and the noisy tenant (shared).
const VICTIM_SHARED: u32 = 10;
const VICTIM_OWN: u32 = 11;
const NOISY: u32 = 20;
const VICTIM_CONNS: u64 = 1000;
const NOISY_SHARED_BUCKETS: usize = 1 << 17;
const VICTIM_OWN_BUCKETS: usize = 1 << 10;

/// One noisy-neighbour figure.
#[derive(Debug, Clone)]
struct NoisyRow {
    noisy_entries: u64,
    avg_chain: f64,
    lookups_per_s: f64,
    cpu_share: f64,
}

impl NoisyRow {
    /// Lookups per second of CPU the thread actually got: one thread with no
    /// lock to wait on, so this removes most of the other builds' noise.
    fn per_cpu_s(&self) -> f64 {
        if self.cpu_share > 0.0 {
            self.lookups_per_s / self.cpu_share
        } else {
            0.0
        }
    }
}

/// Inserts `tenant`'s keys `range` on `threads` threads until done or
/// `deadline`; returns (inserted, refused because the chain was full).
pub(crate) fn par_fill(
    table: &FlowTable,
    tenant: u32,
    range: std::ops::Range<u64>,
    threads: usize,
    deadline: Instant,
) -> Result<(u64, u64)> {
    let results: Vec<Result<(u64, u64)>> = std::thread::scope(|s| {
        let joins: Vec<_> = (0..threads as u64)
            .map(|t| {
                let range = range.clone();
                s.spawn(move || -> Result<(u64, u64)> {
                    let (mut ins, mut refused) = (0, 0);
                    let mut i = range.start + t;
                    let mut step = 0u64;
                    while i < range.end {
                        let v = PeerVal::for_idx(i);
                        match table.insert(key(tenant, i), peers::flow_init(&v), Millis(1)) {
                            Ok(_) => ins += 1,
                            Err(InsertError::ChainFull) => refused += 1,
                            Err(e) => bail!("insert {i} of tenant {tenant}: {e}"),
                        }
                        i += threads as u64;
                        step += 1;
                        if step.is_multiple_of(4096) && Instant::now() >= deadline {
                            break;
                        }
                    }
                    Ok((ins, refused))
                })
            })
            .collect();
        joins
            .into_iter()
            .map(|j| {
                j.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("fill thread panicked")))
            })
            .collect()
    });
    let mut total = (0, 0);
    for r in results {
        let (a, b) = r?;
        total.0 += a;
        total.1 += b;
    }
    Ok(total)
}

/// Seed 000's experiment on one table: the noisy tenant grows in the shared
/// 2^17-bucket table while two victims with 1,000 connections each look up
/// their own flows — one sharing that table, one owning 2^10 buckets.
fn noisy_section(plan: &Plan) -> Result<(Vec<NoisyRow>, Vec<NoisyRow>)> {
    let table = FlowTable::new(TableConfig {
        shared_buckets: NOISY_SHARED_BUCKETS,
        // The most the table allows: the point is to show long chains, not refuse them.
        max_chain: 1024,
        seed: Some(0x0015e),
        ..TableConfig::default()
    });
    let add = |id: u32, own: usize| {
        table.add_tenant(
            TenantId(id),
            TenantConfig {
                own_buckets: own,
                ..TenantConfig::default()
            },
        )
    };
    add(VICTIM_SHARED, 0)?;
    let placed = add(VICTIM_OWN, VICTIM_OWN_BUCKETS)?;
    if placed
        != (Placement::Own {
            buckets: VICTIM_OWN_BUCKETS,
        })
    {
        bail!("victim did not get its own table: {placed:?}");
    }
    add(NOISY, 0)?;
    let far = Instant::now() + Duration::from_secs(3600);
    let deadline = Instant::now() + plan.build_limit;
    let (mut shared, mut own) = (Vec::new(), Vec::new());
    let mut have = 0u64;
    let mut refused = 0u64;
    for &target in &plan.noisy {
        if target > have {
            let (ins, rf) = par_fill(&table, NOISY, have..target, 2, deadline)?;
            refused += rf;
            have = table
                .tenant_stats(TenantId(NOISY))
                .map_or(have + ins, |s| s.entries);
        }
        for (victim, rows) in [(VICTIM_SHARED, &mut shared), (VICTIM_OWN, &mut own)] {
            // The victim's connections are new: re-inserted after the noisy
            // tenant grew, so they sit behind its entries (weir appends at the
            // chain tail) as a freshly opened connection would.
            for i in 0..VICTIM_CONNS {
                table.remove(&key(victim, i));
            }
            par_fill(&table, victim, 0..VICTIM_CONNS, 1, far)?;
            let r = run(vec![&table], plan.limit(), |t, th, j| {
                let k = key(victim, pick(0xbad, th, j, VICTIM_CONNS));
                u64::from(t.get(&k).is_some())
            });
            if r.ok != r.ops {
                bail!(
                    "victim {victim} lookups missed: {} of {}",
                    r.ops - r.ok,
                    r.ops
                );
            }
            let st = table
                .tenant_stats(TenantId(victim))
                .context("victim tenant vanished")?;
            rows.push(NoisyRow {
                noisy_entries: have,
                avg_chain: st.load_factor,
                lookups_per_s: r.per_sec(),
                cpu_share: r.cpu_share(),
            });
        }
        if have < target {
            println!(
                "noisy: building stopped at the {}s limit with {have} of {target} noisy entries; later sizes skipped.\n",
                plan.build_limit.as_secs()
            );
            break;
        }
    }
    println!(
        "### Noisy neighbour (seed 000): victim lookups/s, 1 thread, 1,000 victim connections\n"
    );
    println!(
        "Shared table 2^17 buckets, max_chain 1024 (the table's cap; {refused} noisy inserts refused). \
         Own table 2^10 buckets. Both victims measured on the same table at each size; \
         before each measurement the victims' flows are removed and re-inserted, so they \
         sit behind the noisy entries of their chains like newly opened connections.\n"
    );
    let mut t = Table::new([
        "noisy entries",
        "shared: avg chain",
        "shared: lookups/s",
        "vs idle",
        "own: avg chain",
        "own: lookups/s",
        "vs idle",
        "CPU got (shared/own)",
        "vs idle per CPU-s (shared/own)",
    ]);
    let idle = |rows: &[NoisyRow]| rows.first().map_or(0.0, |r| r.lookups_per_s);
    for (s, o) in shared.iter().zip(&own) {
        t.row([
            si(s.noisy_entries as f64),
            format!("{:.1}", s.avg_chain),
            si(s.lookups_per_s),
            ratio(s.lookups_per_s, idle(&shared)),
            format!("{:.2}", o.avg_chain),
            si(o.lookups_per_s),
            ratio(o.lookups_per_s, idle(&own)),
            format!("{:.0}%/{:.0}%", s.cpu_share * 100.0, o.cpu_share * 100.0),
            format!(
                "{}/{}",
                ratio(
                    s.per_cpu_s(),
                    shared.first().map_or(0.0, NoisyRow::per_cpu_s)
                ),
                ratio(o.per_cpu_s(), own.first().map_or(0.0, NoisyRow::per_cpu_s))
            ),
        ]);
    }
    t.print();
    Ok((shared, own))
}

/// The resize row: weir alone, grown online under lookup load.
#[derive(Debug, Clone, Default)]
struct ResizeRow {
    from: u64,
    to: u64,
    /// Keys `0..present` are inserted first and never removed: the lookups
    /// pick among them and the dump must return each exactly once.
    present: u64,
    /// Latency samples (every [`SAMPLE_EVERY`]th lookup) before the fill,
    /// while a resize ran, and during the fill between resizes.
    steady: Latency,
    during: Latency,
    between: Latency,
    /// Lookups of present keys that found nothing (must be 0).
    lookup_misses: u64,
    /// Resizes completed during the fill; resizes the dump spanned.
    resizes: u64,
    dump_resizes: u64,
    fill_secs: f64,
    dump_pages: u64,
    dump_duplicates: u64,
    dump_misses: u64,
}

/// Percentiles of one set of latency samples, in ns.
#[derive(Debug, Clone, Copy, Default)]
struct Latency {
    samples: usize,
    p50: Option<u64>,
    p99: Option<u64>,
}

impl Latency {
    fn of(mut v: Vec<u32>) -> Self {
        v.sort_unstable();
        let at = |p: f64| {
            let i = ((v.len().max(1) - 1) as f64 * p).round() as usize;
            v.get(i).map(|&x| u64::from(x))
        };
        Latency {
            samples: v.len(),
            p50: at(0.5),
            p99: at(0.99),
        }
    }
}

/// Every how many lookups one is timed (two clock reads per sample).
const SAMPLE_EVERY: u64 = 64;
/// Samples kept per phase.
const MAX_SAMPLES: usize = 1 << 20;
/// Fill inserts between two dump pages, and the page size while filling.
const DUMP_EVERY: u64 = 1024;
const DUMP_PAGE: usize = 256;
/// Resize-row phases the lookup thread files its samples under.
const STEADY: u8 = 0;
const FILLING: u8 = 1;
const STOP: u8 = 2;

/// The lookup side of the resize row: looks up present keys until told to
/// stop (or `deadline`), timing every [`SAMPLE_EVERY`]th lookup; returns
/// the samples (steady, while resizing, filling between resizes) and misses.
fn resize_lookups(
    table: &FlowTable,
    present: u64,
    phase: &AtomicU8,
    deadline: Instant,
) -> (Vec<u32>, Vec<u32>, Vec<u32>, u64) {
    let (mut steady, mut during, mut between) = (Vec::new(), Vec::new(), Vec::new());
    let mut misses = 0u64;
    let mut rng = harness::Rng::new(0x10ad);
    for j in 0u64.. {
        let ph = phase.load(Ordering::Relaxed);
        if ph == STOP || (j % 4096 == 0 && Instant::now() >= deadline) {
            break;
        }
        let k = key(TENANT, rng.below(present));
        if j % SAMPLE_EVERY != 0 {
            misses += u64::from(table.get(&k).is_none());
            continue;
        }
        let t0 = Instant::now();
        let found = table.get(&k).is_some();
        let ns = u32::try_from(t0.elapsed().as_nanos()).unwrap_or(u32::MAX);
        misses += u64::from(!found);
        let v = if ph == STEADY {
            &mut steady
        } else if table
            .resize_state(TenantId(TENANT))
            .is_some_and(|(resizing, _)| resizing)
        {
            &mut during
        } else {
            &mut between
        };
        if v.len() < MAX_SAMPLES {
            v.push(ns);
        }
    }
    (steady, during, between, misses)
}

/// A paged dump of the whole table, checked as it goes.
struct DumpCheck {
    cursor: Option<Cursor>,
    finished: bool,
    /// One bit per key index `< seen.len() * 64`.
    seen: Vec<u64>,
    duplicates: u64,
    pages: u64,
    buf: Vec<weir_flowtable::FlowSnapshot>,
}

impl DumpCheck {
    fn new(keys: u64) -> Self {
        DumpCheck {
            cursor: None,
            finished: false,
            seen: vec![0; keys.div_ceil(64) as usize],
            duplicates: 0,
            pages: 0,
            buf: Vec::new(),
        }
    }

    /// Reads one page of up to `limit` entries.
    fn page(&mut self, table: &FlowTable, limit: usize) {
        self.buf.clear();
        let next = table.dump(
            self.cursor.as_ref(),
            &DumpFilter::default(),
            limit,
            &mut self.buf,
        );
        for s in &self.buf {
            let i = idx_of(&s.key) as usize;
            if let Some(w) = self.seen.get_mut(i / 64) {
                let bit = 1u64 << (i % 64);
                self.duplicates += u64::from(*w & bit != 0);
                *w |= bit;
            }
        }
        self.pages += 1;
        match next {
            Some(c) => self.cursor = Some(c),
            None => self.finished = true,
        }
    }

    /// Keys `0..n` the dump never returned.
    fn misses(&self, n: u64) -> u64 {
        (0..n as usize)
            .filter(|&i| {
                self.seen
                    .get(i / 64)
                    .is_none_or(|w| w & (1 << (i % 64)) == 0)
            })
            .count() as u64
    }
}

/// A table started for `from` entries holds `from / 2` present keys that
/// one thread looks up throughout. The other thread first churns (insert +
/// remove, the size stays put) for the steady samples, then fills the table
/// to `to` entries, so it grows online through several resizes, reading a
/// dump page every [`DUMP_EVERY`] inserts and calling `maintain` (as the
/// daemon's expiry tick does) every 64Ki. The dump, begun with the fill and
/// finished after it, must return every present key exactly once.
fn resize_section(plan: &Plan) -> Result<ResizeRow> {
    let (from, to) = plan.resize;
    let tenant = TenantId(TENANT);
    let table = FlowTable::new(TableConfig {
        shared_buckets: from as usize,
        seed: Some(0x2e512e),
        ..TableConfig::default()
    });
    table.add_tenant(tenant, TenantConfig::default())?;
    let present = from / 2;
    let deadline = Instant::now() + plan.build_limit;
    let (ins, refused) = par_fill(&table, TENANT, 0..present, 2, deadline)?;
    if (ins, refused) != (present, 0) {
        bail!("resize: {ins} of {present} present keys inserted ({refused} refused)");
    }
    let resizes_at = |what: &str| -> Result<u64> {
        Ok(table
            .resize_state(tenant)
            .with_context(|| format!("tenant gone {what}"))?
            .1)
    };
    let phase = AtomicU8::new(STEADY);
    let mut row = ResizeRow {
        from,
        to,
        present,
        ..ResizeRow::default()
    };
    let (samples, written) = std::thread::scope(|s| {
        let reader = s.spawn(|| resize_lookups(&table, present, &phase, deadline));
        let written = (|| -> Result<DumpCheck> {
            // Steady state: the same writer load, no growth.
            let before = resizes_at("before steady")?;
            let steady_end = Instant::now() + plan.measure * 3;
            let mut j = 0u64;
            while Instant::now() < steady_end && Instant::now() < deadline {
                for _ in 0..256 {
                    let i = to + j % present;
                    let inserted = table
                        .insert(
                            key(TENANT, i),
                            peers::flow_init(&PeerVal::for_idx(i)),
                            Millis(1),
                        )
                        .is_ok();
                    if !inserted || table.remove(&key(TENANT, i)).is_none() {
                        bail!("resize: steady churn of key {i} failed");
                    }
                    j += 1;
                }
            }
            if resizes_at("after steady")? != before {
                bail!("resize: the table resized during the steady phase");
            }
            phase.store(FILLING, Ordering::Relaxed);
            let mut dump = DumpCheck::new(to);
            let start = Instant::now();
            for i in present..to {
                table
                    .insert(
                        key(TENANT, i),
                        peers::flow_init(&PeerVal::for_idx(i)),
                        Millis(1),
                    )
                    .map_err(|e| anyhow::anyhow!("resize: insert {i}: {e}"))?;
                if i % DUMP_EVERY == 0 && !dump.finished {
                    if dump.pages == 0 {
                        row.dump_resizes = resizes_at("at dump start")?;
                    }
                    dump.page(&table, DUMP_PAGE);
                }
                if i % 65_536 == 0 {
                    table.maintain();
                    if Instant::now() >= deadline {
                        bail!(
                            "resize: fill passed the {}s limit at {i} of {to}",
                            plan.build_limit.as_secs()
                        );
                    }
                }
            }
            // Let a resize still running finish (maintain moves buckets).
            for _ in 0..1_000_000 {
                if !table.resize_state(tenant).is_some_and(|(r, _)| r) || Instant::now() >= deadline
                {
                    break;
                }
                table.maintain();
            }
            row.fill_secs = start.elapsed().as_secs_f64();
            row.resizes = resizes_at("after fill")? - before;
            Ok(dump)
        })();
        phase.store(STOP, Ordering::Relaxed);
        (reader.join(), written)
    });
    let (steady, during, between, misses) =
        samples.map_err(|_| anyhow::anyhow!("resize lookup thread panicked"))?;
    let mut dump = written?;
    // Finish the dump (the table no longer changes; bounded by its size).
    let max_pages = to / 4096 + 2;
    for _ in 0..max_pages {
        if dump.finished {
            break;
        }
        dump.page(&table, 4096);
    }
    if !dump.finished {
        bail!("resize: dump not finished after {max_pages} more pages");
    }
    row.dump_resizes = resizes_at("after dump")? - row.dump_resizes;
    row.steady = Latency::of(steady);
    row.during = Latency::of(during);
    row.between = Latency::of(between);
    row.lookup_misses = misses;
    row.dump_pages = dump.pages;
    row.dump_duplicates = dump.duplicates;
    row.dump_misses = dump.misses(present);
    Ok(row)
}

fn print_resize(r: &ResizeRow) {
    println!(
        "### Resize: {} -> {} entries under lookup load (weir)\n\n\
         One thread looks up {} present keys (every {SAMPLE_EVERY}th timed); the other first \
         churns at constant size (steady), then fills to {} ({} resizes in {:.1}s), reading a \
         {DUMP_PAGE}-entry dump page every {DUMP_EVERY} inserts; the dump spanned {} resizes \
         ({} pages). Lookup misses of present keys: {}.\n",
        si(r.from as f64),
        si(r.to as f64),
        si(r.present as f64),
        si(r.to as f64),
        r.resizes,
        r.fill_secs,
        r.dump_resizes,
        r.dump_pages,
        r.lookup_misses,
    );
    let ns = |x: Option<u64>| x.map_or("-".into(), |v| v.to_string());
    let mut t = Table::new(["phase", "samples", "p50 ns", "p99 ns", "p99 vs steady"]);
    for (name, l) in [
        ("steady", r.steady),
        ("while resizing", r.during),
        ("filling, between resizes", r.between),
    ] {
        t.row([
            name.to_string(),
            l.samples.to_string(),
            ns(l.p50),
            ns(l.p99),
            ratio(l.p99.unwrap_or(0) as f64, r.steady.p99.unwrap_or(0) as f64),
        ]);
    }
    t.print();
    println!(
        "Dump across the resizes: {} duplicates, {} misses of the {} present keys.\n",
        r.dump_duplicates,
        r.dump_misses,
        si(r.present as f64)
    );
}

/// Tenant counts of the tenants section (`--quick`: [`TENANTS_QUICK`]).
const TENANTS_FULL: [u32; 4] = [1, 1_000, 10_000, 100_000];
const TENANTS_QUICK: [u32; 3] = [1, 1_000, 10_000];
/// Largest tenant count at which `add_tenant` one at a time is timed too:
/// O(T^2), about a minute at 100,000.
const ONE_AT_A_TIME_MAX: u32 = 10_000;
/// The one-at-a-time loop gives up after this long (a regression shows as
/// `null` and a note rather than a run that never ends).
const ONE_AT_A_TIME_LIMIT: Duration = Duration::from_secs(20);
/// Each tenant's UDP timeout: its one entry (last active at 1 s) comes due at 61 s.
const TENANTS_UDP_MS: u64 = 60_000;
const TENANTS_INSERT_MS: u64 = 1_000;
/// `max` of every expire call, as the daemon passes it.
const TENANTS_EXPIRE_MAX: usize = 4096;
/// Idle expire calls (nothing due): every `STEP` ms of simulated time from
/// 2 s up to (not including) 60 s.
const TENANTS_IDLE_FROM_MS: u64 = 2_000;
const TENANTS_IDLE_TO_MS: u64 = 60_000;
const TENANTS_IDLE_STEP_MS: u64 = 100;
/// First due expire call; then one per simulated second.
const TENANTS_DUE_FROM_MS: u64 = 61_500;

/// One row of the tenants section: N tenants sharing the table, one UDP
/// entry each.
#[derive(Debug, Clone)]
struct TenantsRow {
    tenants: u32,
    /// `add_tenants` of all N (one batch).
    add_ms: f64,
    /// `add_tenant` N times on a fresh table (`None` above
    /// [`ONE_AT_A_TIME_MAX`] or past [`ONE_AT_A_TIME_LIMIT`]).
    add_one_at_a_time_ms: Option<f64>,
    /// The one-at-a-time loop gave up after this many tenants.
    one_at_a_time_gave_up: Option<u32>,
    /// The first expire call, which files every entry (nothing due).
    first_expire_ms: f64,
    /// Idle expire calls (each followed by `retiming()`), in ns.
    idle: Latency,
    /// Tenant wheels the idle calls visited (`wheel_visits()` delta).
    wheel_visits: u64,
    /// Entries the idle calls removed (must be 0: nothing is due).
    idle_removed: u64,
    /// Due expire calls until all N are expired: total time / N.
    due_ns_per_entry: f64,
    due_calls: u32,
    /// Simulated time of the first due call that removed anything.
    first_removal_ms: Option<u64>,
    expired: u64,
    /// Tenant wheels the due calls visited.
    due_wheel_visits: u64,
    /// (`memory_bytes()` after filing - `memory_bytes()` before any tenant) / N.
    bytes_per_tenant: f64,
    /// Same, with the tenants added but no entry inserted yet.
    bytes_per_tenant_no_entry: f64,
}

fn tenants_cfg() -> TenantConfig {
    TenantConfig {
        timeouts: Timeouts {
            udp: Millis(TENANTS_UDP_MS),
            ..Timeouts::default()
        },
        ..TenantConfig::default()
    }
}

/// A table for `n` tenants sharing it, presized for their `n` entries so
/// that no resize runs during the measured expire calls (`expire` moves
/// a running resize along).
fn tenants_table(n: u32) -> FlowTable {
    FlowTable::new(TableConfig {
        shared_buckets: (n as usize).max(1 << 12),
        seed: Some(7),
        ..TableConfig::default()
    })
}

/// `add_tenant` one at a time for tenants `1..=n` on a fresh table: the
/// time, or the count reached when [`ONE_AT_A_TIME_LIMIT`] ran out.
fn add_one_at_a_time(n: u32) -> Result<std::result::Result<Duration, u32>> {
    let t = tenants_table(n);
    let start = Instant::now();
    for id in 1..=n {
        t.add_tenant(TenantId(id), tenants_cfg())
            .with_context(|| format!("add_tenant {id}"))?;
        if id % 256 == 0 && start.elapsed() > ONE_AT_A_TIME_LIMIT {
            return Ok(Err(id));
        }
    }
    Ok(Ok(start.elapsed()))
}

/// Builds the table of one row: adds `n` tenants in one batch, inserts one
/// UDP entry per tenant at 1 s and files them with a first expire call.
fn tenants_build(n: u32) -> Result<(FlowTable, TenantsRow)> {
    let t = tenants_table(n);
    let bare = t.memory_bytes();
    let batch: Vec<_> = (1..=n).map(|id| (TenantId(id), tenants_cfg())).collect();
    let start = Instant::now();
    let res = t.add_tenants(&batch);
    let add = start.elapsed();
    drop(batch);
    if res.len() != n as usize {
        bail!("add_tenants: {} results for {n} tenants", res.len());
    }
    if let Some((i, e)) = res
        .iter()
        .enumerate()
        .find_map(|(i, r)| r.as_ref().err().map(|e| (i, e)))
    {
        bail!("add_tenants: tenant {}: {e}", i + 1);
    }
    let no_entry = t.memory_bytes();
    let init = FlowInit {
        service: ServiceId(0),
        backend: BackendId(0),
        state: FlowState::Udp,
        owner: 0,
        profile: weir_flowtable::ProfileRef::NONE,
    };
    for id in 1..=n {
        let k = FlowKey {
            proto: Proto::Udp,
            ..key(id, u64::from(id))
        };
        t.insert(k, init, Millis(TENANTS_INSERT_MS))
            .with_context(|| format!("insert tenant {id}'s entry"))?;
    }
    let mut out = Vec::with_capacity(TENANTS_EXPIRE_MAX);
    let start = Instant::now();
    let removed = t.expire(
        Millis(TENANTS_INSERT_MS + 500),
        TENANTS_EXPIRE_MAX,
        &mut out,
    );
    let first = start.elapsed();
    std::hint::black_box(t.retiming());
    if removed != 0 {
        bail!("first expire call at {n} tenants removed {removed} entries, none due");
    }
    // Presized, but make sure: a resize running would be moved along by
    // every idle call.
    let until = Instant::now() + Duration::from_secs(10);
    while t.resize_state(TenantId(1)).is_some_and(|(r, _)| r) && Instant::now() < until {
        t.maintain();
    }
    let filed = t.memory_bytes();
    let per = |b: usize| b.saturating_sub(bare) as f64 / f64::from(n);
    let row = TenantsRow {
        tenants: n,
        add_ms: add.as_secs_f64() * 1e3,
        add_one_at_a_time_ms: None,
        one_at_a_time_gave_up: None,
        first_expire_ms: first.as_secs_f64() * 1e3,
        idle: Latency::default(),
        wheel_visits: 0,
        idle_removed: 0,
        due_ns_per_entry: 0.0,
        due_calls: 0,
        first_removal_ms: None,
        expired: 0,
        due_wheel_visits: 0,
        bytes_per_tenant: per(filed),
        bytes_per_tenant_no_entry: per(no_entry),
    };
    Ok((t, row))
}

/// Expire calls on `t` from [`TENANTS_DUE_FROM_MS`], one per simulated
/// second with `max` [`TENANTS_EXPIRE_MAX`], until all `row.tenants`
/// entries are expired (at most N / max + 10 calls).
fn tenants_due(t: &FlowTable, row: &mut TenantsRow) {
    let n = u64::from(row.tenants);
    let max_calls = row.tenants as usize / TENANTS_EXPIRE_MAX + 10;
    let mut out = Vec::with_capacity(TENANTS_EXPIRE_MAX);
    let visits = t.wheel_visits();
    let mut total = Duration::ZERO;
    let mut now = TENANTS_DUE_FROM_MS;
    while row.expired < n && (row.due_calls as usize) < max_calls {
        out.clear();
        let start = Instant::now();
        let removed = t.expire(Millis(now), TENANTS_EXPIRE_MAX, &mut out) as u64;
        std::hint::black_box(t.retiming());
        total += start.elapsed();
        if removed > 0 && row.first_removal_ms.is_none() {
            row.first_removal_ms = Some(now);
        }
        row.expired += removed;
        row.due_calls += 1;
        now += 1000;
    }
    row.due_ns_per_entry = total.as_nanos() as f64 / n as f64;
    row.due_wheel_visits = t.wheel_visits() - visits;
}

/// The tenants section (weir only): for each tenant count, a table whose
/// tenants each share it with one UDP entry. The idle expire calls are
/// measured with every row's table alive, round-robin per simulated step,
/// so a busy spell of the machine hits all rows alike.
fn tenants_section(sizes: &[u32]) -> Result<Vec<TenantsRow>> {
    let mut built = Vec::with_capacity(sizes.len());
    for &n in sizes {
        let (t, mut row) = tenants_build(n).with_context(|| format!("{n} tenants"))?;
        if n <= ONE_AT_A_TIME_MAX {
            match add_one_at_a_time(n)? {
                Ok(d) => row.add_one_at_a_time_ms = Some(d.as_secs_f64() * 1e3),
                Err(at) => row.one_at_a_time_gave_up = Some(at),
            }
        }
        built.push((t, row));
    }

    let steps = ((TENANTS_IDLE_TO_MS - TENANTS_IDLE_FROM_MS) / TENANTS_IDLE_STEP_MS) as usize;
    let mut samples: Vec<Vec<u32>> = vec![Vec::with_capacity(steps); built.len()];
    let visits: Vec<u64> = built.iter().map(|(t, _)| t.wheel_visits()).collect();
    let mut removed = vec![0u64; built.len()];
    let mut out = Vec::with_capacity(TENANTS_EXPIRE_MAX);
    let k = built.len();
    for (step, now) in (TENANTS_IDLE_FROM_MS..TENANTS_IDLE_TO_MS)
        .step_by(TENANTS_IDLE_STEP_MS as usize)
        .enumerate()
    {
        for j in (0..k).map(|j| (j + step) % k) {
            let t = &built[j].0;
            out.clear();
            let start = Instant::now();
            removed[j] += t.expire(Millis(now), TENANTS_EXPIRE_MAX, &mut out) as u64;
            std::hint::black_box(t.retiming());
            let ns = start.elapsed().as_nanos();
            samples[j].push(u32::try_from(ns).unwrap_or(u32::MAX));
        }
    }
    let mut rows = Vec::with_capacity(k);
    for (((t, mut row), s), (v, r)) in built
        .into_iter()
        .zip(samples)
        .zip(visits.into_iter().zip(removed))
    {
        row.idle = Latency::of(s);
        row.wheel_visits = t.wheel_visits() - v;
        row.idle_removed = r;
        tenants_due(&t, &mut row);
        if row.expired != u64::from(row.tenants) {
            bail!(
                "{} tenants: {} of the entries expired after {} due calls",
                row.tenants,
                row.expired,
                row.due_calls
            );
        }
        drop(t);
        rows.push(row);
    }
    Ok(rows)
}

fn print_tenants(rows: &[TenantsRow]) {
    println!(
        "### Tenants: expire with many tenants (weir)\n\n\
         N tenants share the table, one UDP entry each (inserted at 1 s, tenant UDP timeout \
         {} s: all due at {} s). add: `add_tenants` of all N in one batch, and `add_tenant` \
         one at a time on a fresh table (O(N^2); up to {} tenants). First expire: the call \
         that files every entry. Idle: {} expire calls every {} ms of simulated time from {} s \
         to {} s (nothing due), each followed by `retiming()`; all rows' tables alive and \
         called round-robin. Due: calls from {:.1} s, one per simulated second, max {}, \
         until all N are expired; time / N (calls in brackets, including any that found \
         nothing due yet). bytes/tenant: (`memory_bytes()` after filing - \
         `memory_bytes()` before adding tenants) / N (in brackets: with the tenants added \
         but no entry yet); the shared bucket array is presized for max(N, 4096) entries, \
         so it is part of neither.\n",
        TENANTS_UDP_MS / 1000,
        (TENANTS_INSERT_MS + TENANTS_UDP_MS) / 1000,
        si(f64::from(ONE_AT_A_TIME_MAX)),
        (TENANTS_IDLE_TO_MS - TENANTS_IDLE_FROM_MS) / TENANTS_IDLE_STEP_MS,
        TENANTS_IDLE_STEP_MS,
        TENANTS_IDLE_FROM_MS / 1000,
        TENANTS_IDLE_TO_MS / 1000,
        TENANTS_DUE_FROM_MS as f64 / 1000.0,
        TENANTS_EXPIRE_MAX,
    );
    let base = rows
        .iter()
        .find(|r| r.tenants == 1)
        .and_then(|r| r.idle.p50)
        .unwrap_or(0);
    let ns = |x: Option<u64>| x.map_or("-".into(), |v| v.to_string());
    let mut t = Table::new([
        "tenants",
        "add_tenants ms",
        "add_tenant x N ms",
        "first expire ms",
        "idle expire p50 ns",
        "idle p99 ns",
        "idle p50 vs 1 tenant",
        "wheel visits (idle)",
        "due ns/entry (calls)",
        "bytes/tenant",
    ]);
    for r in rows {
        t.row([
            si(f64::from(r.tenants)),
            format!("{:.3}", r.add_ms),
            match (r.add_one_at_a_time_ms, r.one_at_a_time_gave_up) {
                (Some(ms), _) => format!("{ms:.3}"),
                (None, Some(at)) => format!(
                    "> {} s (at {})",
                    ONE_AT_A_TIME_LIMIT.as_secs(),
                    si(f64::from(at))
                ),
                (None, None) => "skipped".into(),
            },
            format!("{:.3}", r.first_expire_ms),
            ns(r.idle.p50),
            ns(r.idle.p99),
            ratio(r.idle.p50.unwrap_or(0) as f64, base as f64),
            r.wheel_visits.to_string(),
            format!("{:.0} ({})", r.due_ns_per_entry, r.due_calls),
            format!(
                "{:.0} ({:.0})",
                r.bytes_per_tenant, r.bytes_per_tenant_no_entry
            ),
        ]);
    }
    t.print();
}

/// Idle expire p50 at the largest tenant count over its p50 at one
/// tenant: (largest N, ratio, ns at N, ns at 1).
fn tenants_flatness(rows: &[TenantsRow]) -> Option<(u32, f64, u64, u64)> {
    let one = rows.iter().find(|r| r.tenants == 1)?.idle.p50?;
    let big = rows
        .iter()
        .filter(|r| r.tenants > 1)
        .max_by_key(|r| r.tenants)?;
    let at = big.idle.p50?;
    (one > 0).then(|| (big.tenants, at as f64 / one as f64, at, one))
}

/// One goal of the issue: what was asked, what this run measured, and whether it is met
/// (`None` when this run could not measure it).
pub(crate) type Goal = (String, String, Option<bool>);

/// Prints the goals table.
pub(crate) fn print_goals(goals: &[Goal]) {
    println!("### Goals (this run)\n");
    let mut t = Table::new(["goal", "measured", "met"]);
    for (goal, measured, met) in goals {
        let met = match met {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "not measured",
        };
        t.row([goal.as_str(), measured.as_str(), met]);
    }
    t.print();
}

/// Batched vs one-at-a-time (the reader row: same pin per 64 lookups, so
/// only the batching differs): (entries, threads, hit, ratio) per batched row.
fn batch_ratios(lookup: &[Row]) -> Vec<(u64, usize, bool, f64)> {
    lookup
        .iter()
        .filter(|r| r.batched)
        .filter_map(|b| {
            let one = lookup.iter().find(|o| {
                o.imp == Impl::WeirReader.name()
                    && (o.entries, o.threads, o.hit) == (b.entries, b.threads, b.hit)
            })?;
            (one.ops_per_s > 0.0)
                .then(|| (b.entries, b.threads, b.hit, b.ops_per_s / one.ops_per_s))
        })
        .collect()
}

/// weir `get` cost at `BIG` entries over its cost at 1M (1M lookups/s over
/// BIG lookups/s), worst over (threads, hit).
fn big_cost_ratio(lookup: &[Row]) -> Option<f64> {
    let get = |n: u64, r: &Row| r.imp == Impl::Weir.name() && r.entries == n;
    lookup
        .iter()
        .filter(|r| get(BIG, r) && r.ops_per_s > 0.0)
        .filter_map(|b| {
            let small = lookup
                .iter()
                .find(|o| get(1_000_000, o) && (o.threads, o.hit) == (b.threads, b.hit))?;
            Some(small.ops_per_s / b.ops_per_s)
        })
        .reduce(f64::max)
}

fn table_goals(
    plan: &Plan,
    own: &[NoisyRow],
    churn: &[Row],
    lookup: &[Row],
    mem: &[Mem],
    resize: Option<&ResizeRow>,
    tenants: &[TenantsRow],
) -> Vec<Goal> {
    let mut g = Vec::new();
    let planned = plan.noisy.last().copied().unwrap_or(0);
    let idle = own.first().map_or(0.0, |r| r.lookups_per_s);
    let idle_cpu = own.first().map_or(0.0, NoisyRow::per_cpu_s);
    match own.last() {
        Some(last) if idle > 0.0 && idle_cpu > 0.0 && own.len() > 1 => {
            let reached = last.noisy_entries >= planned;
            let at = si(last.noisy_entries as f64);
            let r = last.lookups_per_s / idle;
            let rc = last.per_cpu_s() / idle_cpu;
            let goal = format!(
                "own-table victim >= 0.95x idle at {} noisy entries",
                si(planned as f64)
            );
            g.push((
                goal.clone(),
                format!("{r:.2}x at {at}"),
                reached.then_some(r >= 0.95),
            ));
            g.push((
                format!("{goal} (per CPU-s)"),
                format!("{rc:.2}x at {at}"),
                reached.then_some(rc >= 0.95),
            ));
        }
        _ => g.push(("own-table victim >= 0.95x idle".into(), "-".into(), None)),
    }
    let is_weir = |r: &Row| r.imp == Impl::Weir.name();
    for (label, f) in [
        ("", Row::per_sec_of as fn(&Row) -> f64),
        (" (per CPU-s)", Row::per_cpu),
    ] {
        for r in churn.iter().filter(|r| is_weir(r) && r.threads == 2) {
            let (best, _) = best_and_ceiling_by(churn, r, f);
            let x = if best > 0.0 { f(r) / best } else { 0.0 };
            g.push((
                format!("churn, 2 threads: >= 1.2x best peer{label}"),
                format!("{x:.2}x"),
                Some(x >= 1.2),
            ));
        }
        let (mut worst_peer, mut worst_ceil) = (f64::INFINITY, f64::INFINITY);
        for r in lookup.iter().filter(|r| is_weir(r)) {
            let (best, ceil) = best_and_ceiling_by(lookup, r, f);
            if best > 0.0 {
                worst_peer = worst_peer.min(f(r) / best);
            }
            if ceil > 0.0 && r.threads == 1 {
                worst_ceil = worst_ceil.min(f(r) / ceil);
            }
        }
        if worst_peer.is_finite() {
            g.push((
                format!("lookup (get): >= best peer in every row{label}"),
                format!("worst row {worst_peer:.2}x"),
                Some(worst_peer >= 1.0),
            ));
        }
        if worst_ceil.is_finite() {
            g.push((
                format!("lookup (get), 1 thread: >= 0.7x ceiling in every row{label}"),
                format!("worst row {worst_ceil:.2}x"),
                Some(worst_ceil >= 0.7),
            ));
        }
    }
    for m in mem.iter().filter(|m| m.imp == Impl::Weir.name()) {
        g.push((
            format!("memory at {}: <= 128 B/entry (RSS)", si(m.entries as f64)),
            format!("{:.1} B", m.rss_bytes_per_entry),
            Some(m.rss_bytes_per_entry <= 128.0),
        ));
    }
    let at_10m = batch_ratios(lookup)
        .into_iter()
        .filter(|r| r.0 == 10_000_000)
        .map(|r| r.3)
        .reduce(f64::min);
    g.push((
        "batched lookups at 10M: >= 1.5x one at a time (reader)".into(),
        at_10m.map_or("-".into(), |x| format!("worst row {x:.2}x")),
        at_10m.map(|x| x >= 1.5),
    ));
    let big = big_cost_ratio(lookup);
    g.push((
        format!("lookup (get) at {}: <= 2x the 1M cost", si(BIG as f64)),
        big.map_or("-".into(), |x| format!("worst row {x:.2}x")),
        big.map(|x| x <= 2.0),
    ));
    if let Some(r) = resize {
        let (st, du) = (r.steady.p99.unwrap_or(0), r.during.p99);
        let x = du.filter(|_| st > 0).map(|d| d as f64 / st as f64);
        g.push((
            format!(
                "resize {} -> {}: lookup p99 while resizing <= 2x steady",
                si(r.from as f64),
                si(r.to as f64)
            ),
            x.map_or("-".into(), |x| {
                format!("{x:.2}x ({} ns vs {st} ns)", du.unwrap_or(0))
            }),
            x.map(|x| x <= 2.0),
        ));
        g.push((
            "resize: dump across it returns every present entry exactly once".into(),
            format!(
                "{} duplicates, {} misses over {} resizes",
                r.dump_duplicates, r.dump_misses, r.dump_resizes
            ),
            Some(r.dump_duplicates == 0 && r.dump_misses == 0 && r.dump_resizes > 0),
        ));
    }
    let flat = tenants_flatness(tenants);
    g.push((
        "tenants: idle expire (p50) at the largest N <= 2x at 1 tenant".into(),
        flat.map_or("-".into(), |(n, x, at, one)| {
            format!("{x:.2}x at {} ({at} ns vs {one} ns)", si(f64::from(n)))
        }),
        flat.map(|(_, x, _, _)| x <= 2.0),
    ));
    let visits: u64 = tenants.iter().map(|r| r.wheel_visits).sum();
    let removed: u64 = tenants.iter().map(|r| r.idle_removed).sum();
    g.push((
        "tenants: idle expire calls visit no tenant wheel".into(),
        if tenants.is_empty() {
            "-".into()
        } else {
            format!(
                "{visits} visits over {} calls (largest N {})",
                tenants.iter().map(|r| r.idle.samples).sum::<usize>(),
                si(f64::from(
                    tenants.iter().map(|r| r.tenants).max().unwrap_or(0)
                ))
            )
        },
        (!tenants.is_empty()).then_some(visits == 0 && removed == 0),
    ));
    g
}

/// The `table` suite.
pub(crate) fn table(c: &Common) -> Result<Value> {
    if let Ok(spec) = std::env::var(MEMORY_CHILD) {
        return memory_child(&spec);
    }
    if c.siphash {
        table_with::<Sip>(c)
    } else {
        table_with::<Fold>(c)
    }
}

/// Sections `--only` may name.
const SECTIONS: [&str; 7] = [
    "noisy", "churn", "lookup", "big", "resize", "memory", "tenants",
];

/// The `table` suite with the peers hashing with `S`. The SipHash view
/// (`--siphash`) runs only the sections with peers.
fn table_with<S: PeerHasher>(c: &Common) -> Result<Value> {
    if let Some(o) = c.only.iter().find(|o| !SECTIONS.contains(&o.as_str())) {
        bail!(
            "--only: unknown table section {o:?} (one of {})",
            SECTIONS.join(", ")
        );
    }
    let on = |name: &str| c.only.is_empty() || c.only.iter().any(|o| o == name);
    let mut plan = Plan::new(c.quick);
    let all = !c.siphash;
    if on("big") && !c.only.is_empty() {
        // Asked for by name: the 100M rows even with --quick.
        plan.lookup_big = Some(BIG);
        plan.memory_big = Some(BIG);
    }
    if !all || !on("big") {
        plan.lookup_big = None;
        plan.memory_big = None;
    }
    if !all || !on("noisy") {
        plan.noisy.clear();
    }
    if !all || !on("tenants") {
        plan.tenants.clear();
    }
    println!(
        "Noisy machine: 2 cores shared with other engineers' builds; only ratios within this run mean anything.\n\
         Peers and the hashbrown ceiling hash with {}. \
         Every map is presized for its entry count.\n",
        if all {
            "foldhash quality with a random seed, weir's own hash family: only the table design differs"
        } else {
            "std RandomState (SipHash-1-3), weir with foldhash quality (--siphash view; weir-only sections skipped)"
        }
    );

    let (noisy_shared, noisy_own) = if !plan.noisy.is_empty() {
        noisy_section(&plan)?
    } else {
        (Vec::new(), Vec::new())
    };

    let churn_rows = if on("churn") {
        churn_section::<S>(&plan)?
    } else {
        Vec::new()
    };
    print_rows(
        &format!(
            "Churn: insert+remove pairs/s, {} live entries\n\n\
             Median of {} rounds; all implementations alive at once and measured round-robin. \
             Both threads of a 2-thread run do the same number of pairs.",
            si(plan.churn_live as f64),
            plan.rounds
        ),
        &churn_rows,
        false,
        "pairs",
    );

    let mut lookup_rows = if on("lookup") {
        lookup_section::<S>(&plan)?
    } else if plan.lookup_big.is_some() {
        // The big row's comparison needs weir at 1M.
        lookup_weir_only(&plan, 1_000_000)?
    } else {
        Vec::new()
    };
    lookup_rows.extend(lookup_big_section(&plan)?);
    print_rows(
        &format!(
            "Lookup: uniformly random keys\n\n\
             Median of {} rounds. Up to {} entries all implementations are alive at once and \
             measured round-robin; above, one at a time with its rounds back to back.",
            plan.rounds,
            si(plan.interleave_max as f64)
        ),
        &lookup_rows,
        true,
        "lookups",
    );
    let batched = batch_ratios(&lookup_rows);
    if !batched.is_empty() {
        println!(
            "### Batched lookups: `lookup_batch` ({READER_BATCH} keys per call) vs one at a time \
             through a reader ({READER_BATCH} per pin)\n"
        );
        let mut t = Table::new(["entries", "threads", "lookup", "batched / one at a time"]);
        for (n, th, hit, x) in &batched {
            t.row([
                si(*n as f64),
                th.to_string(),
                if *hit { "hit" } else { "miss" }.to_string(),
                format!("{x:.2}x"),
            ]);
        }
        t.print();
    }
    if let Some(x) = big_cost_ratio(&lookup_rows) {
        println!(
            "weir get at {} entries costs {x:.2}x its 1M cost (worst of threads x hit/miss; \
             peers left out at this size: most would not fit in 24 GiB or take too long to build).\n",
            si(BIG as f64)
        );
    }

    let resize = if all && on("resize") {
        let r = resize_section(&plan).context("resize row")?;
        print_resize(&r);
        Some(r)
    } else {
        None
    };

    let tenants = if plan.tenants.is_empty() {
        Vec::new()
    } else {
        let r = tenants_section(&plan.tenants).context("tenants section")?;
        print_tenants(&r);
        r
    };

    let mem = memory_section::<S>(&plan, on("memory"))?;
    println!(
        "### Memory: bytes per entry\n\n\
         RSS delta of a fresh child process around building the map (glibc malloc: \
         per-allocation headers and size-class rounding included; presized tables count \
         their empty slots). Peers only at {}: at {} entries weir is alone.\n",
        si(plan.memory_entries as f64),
        si(BIG as f64)
    );
    let best_mem = mem
        .iter()
        .filter(|m| Impl::from_name(&m.imp).is_some_and(Impl::is_peer))
        .map(|m| m.rss_bytes_per_entry)
        .fold(f64::INFINITY, f64::min);
    let mut t = Table::new([
        "impl",
        "entries",
        "bytes/entry (RSS)",
        "self-reported bytes/entry",
        "vs best peer",
    ]);
    for m in &mem {
        t.row([
            m.imp.clone(),
            si(m.entries as f64),
            format!("{:.0}", m.rss_bytes_per_entry),
            m.self_bytes_per_entry
                .map_or("-".into(), |b| format!("{b:.0}")),
            ratio(m.rss_bytes_per_entry, best_mem),
        ]);
    }
    t.print();

    print_goals(&table_goals(
        &plan,
        &noisy_own,
        &churn_rows,
        &lookup_rows,
        &mem,
        resize.as_ref(),
        &tenants,
    ));

    let noisy_json = |rows: &[NoisyRow]| -> Vec<Value> {
        rows.iter()
            .map(|r| json!({"noisy_entries": r.noisy_entries, "avg_chain": r.avg_chain, "lookups_per_s": r.lookups_per_s}))
            .collect()
    };
    let rows_json = |rows: &[Row], lookup: bool| -> Vec<Value> {
        rows.iter()
            .map(|r| {
                if lookup {
                    json!({"impl": r.imp, "hasher": r.hasher, "entries": r.entries, "threads": r.threads, "hit": r.hit, "batched": r.batched, "ops_per_s": r.ops_per_s})
                } else {
                    json!({"impl": r.imp, "hasher": r.hasher, "threads": r.threads, "ops_per_s": r.ops_per_s})
                }
            })
            .collect()
    };
    Ok(json!({
        "noisy": {"shared": noisy_json(&noisy_shared), "own": noisy_json(&noisy_own)},
        "churn": rows_json(&churn_rows, false),
        "lookup": rows_json(&lookup_rows, true),
        "memory": mem.iter().map(|m| json!({"impl": m.imp, "hasher": m.hasher, "entries": m.entries, "bytes_per_entry": m.rss_bytes_per_entry})).collect::<Vec<_>>(),
        "resize": resize.map(|r| json!({
            "from": r.from,
            "to": r.to,
            "p99_ns_steady": r.steady.p99,
            "p99_ns_during": r.during.p99,
            "dump_duplicates": r.dump_duplicates,
            "dump_misses": r.dump_misses,
            "p50_ns_steady": r.steady.p50,
            "p50_ns_during": r.during.p50,
            "p99_ns_between_resizes": r.between.p99,
            "resizes": r.resizes,
            "dump_resizes": r.dump_resizes,
            "lookup_misses": r.lookup_misses,
        })),
        "tenants": tenants.iter().map(|r| json!({
            "tenants": r.tenants,
            "add_ms": r.add_ms,
            "add_one_at_a_time_ms": r.add_one_at_a_time_ms,
            "add_one_at_a_time_gave_up_at": r.one_at_a_time_gave_up,
            "first_expire_ms": r.first_expire_ms,
            "idle_expire_ns_p50": r.idle.p50,
            "idle_expire_ns_p99": r.idle.p99,
            "idle_calls": r.idle.samples,
            "wheel_visits": r.wheel_visits,
            "due_expire_ns_per_entry": r.due_ns_per_entry,
            "due_calls": r.due_calls,
            "first_removal_ms": r.first_removal_ms,
            "due_wheel_visits": r.due_wheel_visits,
            "expired": r.expired,
            "bytes_per_tenant": r.bytes_per_tenant,
            "bytes_per_tenant_no_entry": r.bytes_per_tenant_no_entry,
        })).collect::<Vec<_>>(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: Limit = Limit {
        ops: 20_000,
        time: Duration::from_secs(20),
    };

    fn small_checks<T: Target>(t: &mut T, threads: usize) {
        fill(t, TENANT, 0..1000).expect("fill");
        assert!(fill(t, TENANT, 0..1).is_err(), "duplicate insert must fail");
        let hit = lookups(t, 1000, threads, true, SMALL).expect("hits");
        assert_eq!(hit.ops, 20_000);
        lookups(t, 1000, threads, false, SMALL).expect("misses");
        let c = churn(t, 1000, 0, 1, SMALL).expect("churn 1 thread");
        if threads > 1 {
            churn(t, 1000, c.ops, threads, SMALL).expect("churn 2 threads");
        }
    }

    #[test]
    fn measurements_check_themselves_on_every_impl() {
        for imp in Impl::CHURN.into_iter().chain(Impl::LOOKUP) {
            let threads = imp.max_threads().min(2);
            with_impl!(Fold, imp, 1000, |t| small_checks(t, threads));
            with_impl!(Sip, imp, 1000, |t| small_checks(t, threads));
        }
    }

    #[test]
    fn reader_lookups_check_themselves() {
        let mut w = Conc(Weir::new(1000, false));
        fill(&mut w, TENANT, 0..1000).expect("fill");
        let r = reader_lookups(&w.0.table, 1000, 2, true, SMALL).expect("hits");
        assert_eq!(r.ops, 20_000 / READER_BATCH * READER_BATCH);
        reader_lookups(&w.0.table, 1000, 2, false, SMALL).expect("misses");
        // A table missing the keys fails the hit check.
        let empty = Weir::new(1000, false);
        assert!(reader_lookups(&empty.table, 1000, 1, true, SMALL).is_err());
    }

    #[test]
    fn batch_lookups_check_themselves() {
        let mut w = Conc(Weir::new(1000, false));
        fill(&mut w, TENANT, 0..1000).expect("fill");
        let r = batch_lookups(&w.0.table, 1000, 2, true, SMALL).expect("hits");
        assert_eq!(r.ops, 20_000 / READER_BATCH * READER_BATCH);
        batch_lookups(&w.0.table, 1000, 2, false, SMALL).expect("misses");
        let empty = Weir::new(1000, false);
        assert!(batch_lookups(&empty.table, 1000, 1, true, SMALL).is_err());
    }

    #[test]
    fn batch_ratio_pairs_batched_with_reader_rows() {
        let row = |imp: Impl, ops: f64| Row {
            imp: imp.name(),
            hasher: "foldhash",
            peer: false,
            ceiling: false,
            batched: imp == Impl::WeirBatch,
            entries: 10_000_000,
            threads: 1,
            hit: true,
            ops_per_s: ops,
            cpu_share: 1.0,
        };
        let rows = [row(Impl::WeirReader, 2.0), row(Impl::WeirBatch, 5.0)];
        assert_eq!(batch_ratios(&rows), vec![(10_000_000, 1, true, 2.5)]);
        let big = Row {
            entries: BIG,
            ..row(Impl::Weir, 1.0)
        };
        let small = Row {
            entries: 1_000_000,
            ..row(Impl::Weir, 3.0)
        };
        assert_eq!(big_cost_ratio(&[big, small]), Some(3.0));
    }

    #[test]
    fn resize_row_grows_online_and_dumps_exactly() {
        let plan = Plan {
            resize: (1 << 12, 1 << 16),
            measure: Duration::from_millis(20),
            build_limit: Duration::from_secs(60),
            ..Plan::new(true)
        };
        let r = resize_section(&plan).expect("resize row");
        assert!(r.resizes > 0, "no resize while filling 16x: {r:?}");
        assert!(r.dump_resizes > 0, "the dump spanned no resize: {r:?}");
        assert_eq!((r.dump_duplicates, r.dump_misses), (0, 0), "{r:?}");
        assert_eq!(r.lookup_misses, 0);
        assert!(r.steady.samples > 0 && r.steady.p99.is_some());
    }

    #[test]
    fn lookup_big_rows_are_weir_only_and_marked() {
        let plan = Plan {
            lookup_big: Some(4096),
            measure: Duration::from_millis(10),
            rounds: 1,
            ..Plan::new(true)
        };
        let rows = lookup_big_section(&plan).expect("big rows");
        assert_eq!(
            rows.len(),
            3 * 2 * 2,
            "get, reader, batched x threads x hit"
        );
        assert!(
            rows.iter()
                .all(|r| r.entries == 4096 && !r.peer && !r.ceiling)
        );
        assert_eq!(rows.iter().filter(|r| r.batched).count(), 4);
        assert!(
            lookup_big_section(&Plan::new(true))
                .expect("none")
                .is_empty()
        );
    }

    #[test]
    fn only_runs_the_named_sections() {
        let c = |only: &[&str]| Common {
            quick: true,
            json: None,
            siphash: false,
            only: only.iter().map(|s| s.to_string()).collect(),
        };
        assert!(table(&c(&["resize", "bogus"])).is_err());
        let v = table(&c(&["resize"])).expect("resize only");
        assert_eq!(v["resize"]["dump_duplicates"], 0);
        assert_eq!(v["resize"]["dump_misses"], 0);
        assert!(v["resize"]["p99_ns_steady"].as_u64().is_some());
        for other in ["churn", "lookup", "memory", "tenants"] {
            assert_eq!(v[other].as_array().map(Vec::len), Some(0), "{other} ran");
        }
        assert_eq!(v["noisy"]["own"].as_array().map(Vec::len), Some(0));
    }

    #[test]
    fn tenants_rows_expire_everything_and_idle_calls_visit_nothing() {
        let rows = tenants_section(&[1, 300]).expect("tenants rows");
        assert_eq!(rows.len(), 2);
        for r in &rows {
            assert_eq!(r.expired, u64::from(r.tenants), "{r:?}");
            assert_eq!((r.wheel_visits, r.idle_removed), (0, 0), "{r:?}");
            assert!(r.due_wheel_visits >= u64::from(r.tenants), "{r:?}");
            assert!(r.add_one_at_a_time_ms.is_some());
            assert!(r.idle.samples > 0 && r.idle.p50.is_some());
            assert!(r.bytes_per_tenant > r.bytes_per_tenant_no_entry);
        }
        let (n, ..) = tenants_flatness(&rows).expect("ratio");
        assert_eq!(n, 300);
        let goals = table_goals(&Plan::new(true), &[], &[], &[], &[], None, &rows);
        assert!(
            goals
                .iter()
                .any(|g| g.0.contains("visit no tenant wheel") && g.2 == Some(true))
        );
    }

    #[test]
    fn dump_check_counts_duplicates_and_misses() {
        let t = FlowTable::new(TableConfig {
            seed: Some(1),
            ..TableConfig::default()
        });
        t.add_tenant(TenantId(TENANT), TenantConfig::default())
            .expect("tenant");
        par_fill(
            &t,
            TENANT,
            0..100,
            1,
            Instant::now() + Duration::from_secs(30),
        )
        .expect("fill");
        let mut d = DumpCheck::new(200);
        d.page(&t, 1000);
        assert!(d.finished);
        assert_eq!((d.duplicates, d.misses(100), d.misses(101)), (0, 0, 1));
        d.cursor = None;
        d.page(&t, 1000);
        assert_eq!(d.duplicates, 100);
    }

    #[test]
    fn latency_percentiles() {
        let l = Latency::of((1..=100).rev().collect());
        assert_eq!((l.samples, l.p50, l.p99), (100, Some(51), Some(99)));
        assert_eq!(Latency::of(Vec::new()).p99, None);
    }

    #[test]
    fn memory_child_rejects_bad_specs() {
        assert!(memory_child("weir:10").is_err());
        assert!(memory_child("weir:10:md5").is_err());
        assert!(memory_child("nope:10:foldhash").is_err());
        let v = memory_child("dashmap:100:siphash").expect("probe");
        assert_eq!(v["hasher"], "siphash");
    }

    #[test]
    fn churn_window_leaves_live_entries_live() {
        let mut w = Conc(Weir::new(1000, false));
        fill(&mut w, TENANT, 0..1000).expect("fill");
        let r = churn(&mut w, 1000, 0, 1, SMALL).expect("churn");
        // After the run the live window is [ops, ops + 1000).
        let st = w.0.table.tenant_stats(TenantId(TENANT)).expect("tenant");
        assert_eq!(st.entries, 1000);
        assert!(w.0.c_get(&key(TENANT, r.ops)).is_some());
        assert!(w.0.c_get(&key(TENANT, r.ops - 1)).is_none());
    }

    #[test]
    fn par_fill_counts_and_stops() {
        let t = FlowTable::new(TableConfig::default());
        t.add_tenant(TenantId(3), TenantConfig::default())
            .expect("tenant");
        let (ins, refused) =
            par_fill(&t, 3, 0..5000, 2, Instant::now() + Duration::from_secs(30)).expect("fill");
        assert_eq!((ins, refused), (5000, 0));
        assert!(
            par_fill(&t, 3, 0..1, 1, Instant::now()).is_err(),
            "duplicate is an error"
        );
    }
}

//! `weir-bench table`: weir's flow table against dashmap, papaya, scc and a
//! striped `Mutex<HashMap>`, with single-threaded hashbrown as the ceiling.
//!
//! Sections (JSON keys in brackets):
//! - noisy neighbour [`noisy.shared[]`, `noisy.own[]`] — seed 000's experiment, weir only;
//! - churn [`churn[]`] — insert+remove pairs/s with a fixed live set;
//! - lookup [`lookup[]`] — hit and miss lookups/s;
//! - memory [`memory[]`] — bytes per entry, each implementation built in a
//!   fresh child process (this binary re-run with `WEIR_BENCH_MEMORY_CHILD`)
//!   so one map's freed memory never hides the next one's footprint.
//!
//! Every implementation stores the same key ([`harness::Key`]: tenant, proto,
//! client and virtual socket addresses, IPv6-capable) and an equivalent value
//! ([`harness::PeerVal`], weir's entry payload). Every measurement is bounded
//! by an operation count and a time limit. Only one implementation is built
//! at a time and it is dropped before the next is built.

pub(crate) mod harness;
pub(crate) mod peers;

use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::Common;
use crate::report::{Table, ratio};
use harness::{Limit, PeerVal, Run, key, run, si};
use peers::{Ceiling, ConcMap, Dash, Ops, Papaya, Scc, Striped};

/// Environment variable that turns a `weir-bench table` process into a memory probe.
const MEMORY_CHILD: &str = "WEIR_BENCH_MEMORY_CHILD";
/// Prefix of the probe's one result line on stdout.
const MEMORY_LINE: &str = "weir-bench-memory:";

/// The tenant lookups, churn and memory use (noisy neighbour uses two).
const TENANT: u32 = 1;

/// Implementations raced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Impl {
    Dash,
    Papaya,
    Scc,
    Striped,
    Ceiling,
}

impl Impl {
    const ALL: [Impl; 5] = [
        Impl::Dash,
        Impl::Papaya,
        Impl::Scc,
        Impl::Striped,
        Impl::Ceiling,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Impl::Dash => "dashmap",
            Impl::Papaya => "papaya",
            Impl::Scc => "scc",
            Impl::Striped => "striped-mutex",
            Impl::Ceiling => "hashbrown-1t",
        }
    }

    fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|i| i.name() == s)
    }

    fn is_peer(self) -> bool {
        !matches!(self, Impl::Ceiling)
    }

    fn max_threads(self) -> usize {
        if self == Impl::Ceiling { 1 } else { usize::MAX }
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
}

impl Target for Ceiling {
    type H<'a> = &'a mut Ceiling;
    fn handles(&mut self, _n: usize) -> Vec<&mut Ceiling> {
        vec![self]
    }
}

/// Builds implementation `imp` presized for `cap` entries and runs `$body`
/// with it bound to `$t` (a `&mut impl Target`).
macro_rules! with_impl {
    ($imp:expr, $cap:expr, |$t:ident| $body:expr) => {
        match $imp {
            Impl::Dash => {
                let $t = &mut Conc(Dash::new($cap));
                $body
            }
            Impl::Papaya => {
                let $t = &mut Conc(Papaya::new($cap));
                $body
            }
            Impl::Scc => {
                let $t = &mut Conc(Scc::new($cap));
                $body
            }
            Impl::Striped => {
                let $t = &mut Conc(Striped::new($cap));
                $body
            }
            Impl::Ceiling => {
                let $t = &mut Ceiling::with_capacity($cap);
                $body
            }
        }
    };
}

/// Sizes and time limits of one run.
#[derive(Debug, Clone)]
#[allow(dead_code)] // noisy and build_limit are used once weir's table lands
struct Plan {
    noisy: Vec<u64>,
    churn_live: u64,
    lookup_sizes: Vec<u64>,
    memory_entries: u64,
    measure: Duration,
    build_limit: Duration,
}

impl Plan {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                noisy: vec![0, 1 << 20, 4 << 20],
                churn_live: 1_000_000,
                lookup_sizes: vec![1_000_000],
                memory_entries: 1_000_000,
                measure: Duration::from_millis(250),
                build_limit: Duration::from_secs(20),
            }
        } else {
            Self {
                noisy: vec![0, 1 << 20, 4 << 20, 16 << 20, 24 << 20],
                churn_live: 1_000_000,
                lookup_sizes: vec![1_000_000, 10_000_000],
                memory_entries: 10_000_000,
                measure: Duration::from_millis(1500),
                build_limit: Duration::from_secs(300),
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

/// Thread `t`'s `j`-th churn key: each thread owns a disjoint sequence.
fn churn_idx(t: usize, j: u64) -> u64 {
    ((t as u64) << 40) | j
}

/// Insert+remove pairs/s with `live` entries kept live by `threads` threads.
fn churn<T: Target>(t: &mut T, live: u64, threads: usize, limit: Limit) -> Result<Run> {
    let per = live / threads as u64;
    for th in 0..threads {
        let mut hs = t.handles(1);
        let h = hs.first_mut().context("no handle")?;
        for j in 0..per {
            let i = churn_idx(th, j);
            if !h.insert(key(TENANT, i), PeerVal::for_idx(i)) {
                bail!("churn prefill insert {i} failed");
            }
        }
    }
    let r = run(t.handles(threads), limit, |h, th, j| {
        let add = churn_idx(th, per + j);
        let ins = h.insert(key(TENANT, add), PeerVal::for_idx(add));
        let rem = h.remove(&key(TENANT, churn_idx(th, j)));
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
    peer: bool,
    ceiling: bool,
    entries: u64,
    threads: usize,
    hit: bool,
    ops_per_s: f64,
}

/// Best peer for the same (entries, threads, hit) and the ceiling for the same (entries, hit).
fn best_and_ceiling(rows: &[Row], r: &Row) -> (f64, f64) {
    let best = rows
        .iter()
        .filter(|o| o.peer && o.entries == r.entries && o.threads == r.threads && o.hit == r.hit)
        .map(|o| o.ops_per_s)
        .fold(0.0, f64::max);
    let ceil = rows
        .iter()
        .filter(|o| o.ceiling && o.entries == r.entries && o.hit == r.hit)
        .map(|o| o.ops_per_s)
        .fold(0.0, f64::max);
    (best, ceil)
}

fn churn_section(plan: &Plan) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for imp in Impl::ALL {
        for threads in [1usize, 2] {
            if threads > imp.max_threads() {
                continue;
            }
            let live = plan.churn_live;
            let r = with_impl!(imp, live as usize, |t| churn(
                t,
                live,
                threads,
                plan.limit()
            ))
            .with_context(|| format!("churn {}", imp.name()))?;
            rows.push(Row {
                imp: imp.name(),
                peer: imp.is_peer(),
                ceiling: imp == Impl::Ceiling,
                entries: live,
                threads,
                hit: true,
                ops_per_s: r.per_sec(),
            });
        }
    }
    Ok(rows)
}

fn lookup_impl<T: Target>(
    t: &mut T,
    imp: Impl,
    n: u64,
    plan: &Plan,
    rows: &mut Vec<Row>,
) -> Result<()> {
    fill(t, TENANT, 0..n).with_context(|| format!("filling {}", imp.name()))?;
    for threads in [1usize, 2] {
        if threads > imp.max_threads() {
            continue;
        }
        for hit in [true, false] {
            let r = lookups(t, n, threads, hit, plan.limit())
                .with_context(|| format!("lookup {}", imp.name()))?;
            rows.push(Row {
                imp: imp.name(),
                peer: imp.is_peer(),
                ceiling: imp == Impl::Ceiling,
                entries: n,
                threads,
                hit,
                ops_per_s: r.per_sec(),
            });
        }
    }
    Ok(())
}

fn lookup_section(plan: &Plan) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &n in &plan.lookup_sizes {
        for imp in Impl::ALL {
            with_impl!(imp, n as usize, |t| lookup_impl(t, imp, n, plan, &mut rows))?;
        }
    }
    Ok(rows)
}

/// One memory figure.
#[derive(Debug, Clone)]
struct Mem {
    imp: String,
    entries: u64,
    rss_bytes_per_entry: f64,
    self_bytes_per_entry: Option<f64>,
}

/// In the child: builds `imp` with `n` entries and prints one result line.
fn memory_child(spec: &str) -> Result<Value> {
    let (name, n) = spec
        .split_once(':')
        .context("memory child spec is impl:entries")?;
    let n: u64 = n.parse().context("memory child entries")?;
    let imp = Impl::from_name(name).with_context(|| format!("unknown impl {name}"))?;
    let before = harness::rss_bytes();
    let (after, own) = with_impl!(imp, n as usize, |t| {
        fill(t, TENANT, 0..n)?;
        (harness::rss_bytes(), t.memory_bytes())
    });
    let v = json!({
        "impl": imp.name(),
        "entries": n,
        "rss_delta": after.saturating_sub(before),
        "self_bytes": own,
    });
    println!("{MEMORY_LINE}{v}");
    Ok(v)
}

/// In the parent: runs one child per implementation, one after the other.
fn memory_section(plan: &Plan) -> Result<Vec<Mem>> {
    let exe = std::env::current_exe().context("locating weir-bench")?;
    let mut out = Vec::new();
    for imp in Impl::ALL {
        let o = std::process::Command::new(&exe)
            .arg("table")
            .env(
                MEMORY_CHILD,
                format!("{}:{}", imp.name(), plan.memory_entries),
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
            entries: v["entries"].as_u64().unwrap_or(0),
            rss_bytes_per_entry: v["rss_delta"].as_f64().unwrap_or(0.0) / n,
            self_bytes_per_entry: v["self_bytes"].as_f64().map(|b| b / n),
        });
    }
    Ok(out)
}

fn print_rows(title: &str, rows: &[Row], with_hit: bool, unit: &str) {
    println!("### {title}\n");
    let mut header = vec!["impl", "entries", "threads"];
    if with_hit {
        header.push("lookup");
    }
    let ops_h = format!("{unit}/s");
    header.extend([ops_h.as_str(), "vs best peer", "vs ceiling (1 thread)"]);
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
        ]);
        t.row(cells);
    }
    t.print();
}

/// The `table` suite.
pub(crate) fn table(c: &Common) -> Result<Value> {
    if let Ok(spec) = std::env::var(MEMORY_CHILD) {
        return memory_child(&spec);
    }
    let plan = Plan::new(c.quick);
    println!(
        "Noisy machine: 2 cores shared with other engineers' builds; only ratios within this run mean anything.\n\
         Peers hash with std RandomState (SipHash-1-3); the hashbrown ceiling with foldhash (its default). \
         Every map is presized for its entry count.\n"
    );

    let churn_rows = churn_section(&plan)?;
    print_rows(
        &format!(
            "Churn: insert+remove pairs/s, {} live entries",
            si(plan.churn_live as f64)
        ),
        &churn_rows,
        false,
        "pairs",
    );

    let lookup_rows = lookup_section(&plan)?;
    print_rows("Lookup: random keys", &lookup_rows, true, "lookups");

    let mem = memory_section(&plan)?;
    println!(
        "### Memory: bytes per entry at {} entries\n\n\
         RSS delta of a fresh child process around building the map (glibc malloc: \
         per-allocation headers and size-class rounding included; presized tables count \
         their empty slots).\n",
        si(plan.memory_entries as f64)
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

    let rows_json = |rows: &[Row], lookup: bool| -> Vec<Value> {
        rows.iter()
            .map(|r| {
                if lookup {
                    json!({"impl": r.imp, "entries": r.entries, "threads": r.threads, "hit": r.hit, "ops_per_s": r.ops_per_s})
                } else {
                    json!({"impl": r.imp, "threads": r.threads, "ops_per_s": r.ops_per_s})
                }
            })
            .collect()
    };
    Ok(json!({
        "noisy": {"shared": [], "own": []},
        "churn": rows_json(&churn_rows, false),
        "lookup": rows_json(&lookup_rows, true),
        "memory": mem.iter().map(|m| json!({"impl": m.imp, "entries": m.entries, "bytes_per_entry": m.rss_bytes_per_entry})).collect::<Vec<_>>(),
    }))
}

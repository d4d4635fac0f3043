//! `weir-bench ops`: one flow-table operation in a loop, for counting
//! instructions and cache misses per operation with `perf stat` or
//! callgrind (formerly `crates/flowtable/examples/quick.rs`).
//!
//! Wall and CPU time move by 2x on a shared machine; counts repeat to the
//! instruction. The build phase is deterministic for the fixed seed, so run
//! once with `--ops N` and once with `--ops 0` and divide the difference by
//! N (docs/flowtable.md, "How measured"). Not a race: `weir-bench table`
//! compares the table with its peers; this isolates one operation of weir's.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};

use weir_flowtable::{
    BackendId, Dir, DumpFilter, FlowInit, FlowKey, FlowState, FlowTable, Millis, Proto, ReplyDst,
    ReplyKey, ReplyMode, ServiceId, TableConfig, TenantConfig, TenantId,
};

/// `weir-bench ops`.
#[derive(Debug, Clone, Args)]
pub(crate) struct OpsArgs {
    /// Which operation; `all` times every one (CPU-ns per operation).
    #[arg(long, value_enum, default_value = "all")]
    pub(crate) op: Op,
    /// Entries in the table before the loop.
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) entries: u64,
    /// Operations in the loop (insert+remove pairs for churn; per thread
    /// for churn2); 0 builds the table only.
    #[arg(long, default_value_t = 2_000_000)]
    pub(crate) ops: u64,
    /// `--op dump` only: dump at this page size alone (default: 1, 100
    /// and 10 000 in turn), e.g. to profile one page size.
    #[arg(long)]
    pub(crate) page: Option<usize>,
}

/// One operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Op {
    /// `get` of present keys (a full snapshot).
    Get,
    /// `lookup` of present keys (handle and backend: the data path's read).
    Lookup,
    /// `touch` (the data path's lookup, writes counters) of present keys.
    Touch,
    /// `get` of absent keys.
    Miss,
    /// `lookup_reply` of present flows (packet mode's read of a backend's
    /// reply): the table is built with nat reply keys (`insert_reply`), so
    /// the insert and memory figures include them.
    Reply,
    /// insert + remove pairs on one thread.
    Churn,
    /// insert + remove pairs on two threads (wall ns per pair).
    Churn2,
    /// Full dumps at page sizes 1, 100 and 10 000.
    Dump,
    /// Every operation timed in turn, then expiry of the whole table.
    All,
}

const TENANT: TenantId = TenantId(1);

fn key(i: u64) -> FlowKey {
    FlowKey {
        tenant: TENANT,
        proto: Proto::Tcp,
        client: SocketAddr::new(
            Ipv6Addr::new(
                0x2001,
                0xdb8,
                0,
                0,
                0,
                (i >> 32) as u16,
                (i >> 16) as u16,
                i as u16,
            )
            .into(),
            (i % 50_000) as u16 + 1024,
        ),
        virt: SocketAddr::new(Ipv4Addr::new(192, 0, 2, 1).into(), 443),
    }
}

/// The nat reply key of flow `i` (backend 2 answering the client).
fn reply_key(i: u64) -> ReplyKey {
    ReplyKey {
        tenant: TENANT,
        proto: Proto::Tcp,
        backend: INIT.backend,
        dst: ReplyDst::Client(key(i).client),
    }
}

const INIT: FlowInit<'static> = FlowInit {
    owner: 0,
    profile: weir_flowtable::ProfileRef::NONE,
    service: ServiceId(1),
    backend: BackendId(2),
    state: FlowState::Established,
};

/// CPU time of this thread in ns (wall time on a shared machine mostly
/// measures other people's work).
fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[derive(Clone, Copy)]
struct Clock(Instant, u64);

fn now() -> Clock {
    Clock(Instant::now(), cpu_ns())
}

fn per_op(t0: Clock, ops: u64) -> String {
    let ops = ops.max(1) as f64;
    let wall = t0.0.elapsed().as_nanos() as f64 / ops;
    let cpu = cpu_ns().saturating_sub(t0.1) as f64 / ops;
    format!("{cpu:7.1} cpu-ns ({wall:7.1} wall)")
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^ (x >> 33)
}

/// Run `weir-bench ops`.
pub(crate) fn run(a: &OpsArgs) -> Result<()> {
    let n = a.entries.max(1);
    let cfg = TableConfig {
        shared_buckets: usize::try_from(n).context("--entries")?,
        seed: Some(1),
        ..Default::default()
    };
    let t = FlowTable::new(cfg);
    t.add_tenant(TENANT, TenantConfig::default())
        .context("adding the tenant")?;
    let t0 = now();
    for i in 0..n {
        if a.op == Op::Reply {
            t.insert_reply(key(i), INIT, ReplyMode::Nat, Millis(0))
                .map(|_| ())
        } else {
            t.insert(key(i), INIT, Millis(0)).map(|_| ())
        }
        .with_context(|| format!("insert {i} of {n}"))?;
    }
    println!("entries {n}; figures from this run only (CPU time of this thread)");
    println!("insert        {} /op", per_op(t0, n));
    println!(
        "memory        {:7.1} B/entry",
        t.memory_bytes() as f64 / n as f64
    );
    if let Some(st) = t.tenant_stats(TENANT) {
        println!(
            "index         {} buckets, load {:.3} ({:.2} per bucket), longest chain {}",
            st.buckets,
            st.load_factor,
            (st.table_entries + st.reply_entries) as f64 / st.buckets.max(1) as f64,
            st.max_chain
        );
    }
    let ops = a.ops;
    let lookups = |op: Op| -> u64 {
        let mut found = 0u64;
        for j in 0..ops {
            found += u64::from(match op {
                Op::Get => t.get(&key(mix(j) % n)).is_some(),
                Op::Lookup => t.lookup(&key(mix(j) % n)).is_some(),
                Op::Touch => t.touch(&key(mix(j) % n), Millis(1), Dir::In, 10).is_some(),
                Op::Reply => t.lookup_reply(&reply_key(mix(j) % n)).is_some(),
                _ => t.get(&key(n + mix(j) % n)).is_some(),
            });
        }
        found
    };
    let churn = |pairs: u64, offset: u64, stride: u64| -> Result<()> {
        for j in 0..pairs {
            let p = j * stride + offset;
            t.insert(key(n + p), INIT, Millis(2))
                .with_context(|| format!("churn insert {p}"))?;
            t.remove(&key(p))
                .with_context(|| format!("churn remove {p}"))?;
        }
        Ok(())
    };
    match a.op {
        Op::Get | Op::Lookup | Op::Touch | Op::Miss => {
            let t0 = now();
            let found = lookups(a.op);
            println!(
                "{:<13} {} /op ({ops} ops, found {found})",
                format!("{:?}", a.op).to_lowercase(),
                per_op(t0, ops)
            );
        }
        Op::Reply => {
            let t0 = now();
            let found = lookups(a.op);
            println!("reply         {} /op ({found})", per_op(t0, ops));
            anyhow::ensure!(found == ops, "{} reply lookups missed", ops - found);
        }
        Op::Churn => {
            let t0 = now();
            churn(ops, 0, 1)?;
            println!("churn pair    {} /pair", per_op(t0, ops));
        }
        Op::Churn2 => {
            // Two threads, each churning its own half of the keys (with an
            // even --entries a thread removes only keys it inserted).
            let pairs = ops;
            let t0 = Instant::now();
            std::thread::scope(|sc| -> Result<()> {
                let hs: Vec<_> = (0..2u64)
                    .map(|th| sc.spawn(move || churn(pairs, th, 2)))
                    .collect();
                for h in hs {
                    h.join()
                        .map_err(|_| anyhow::anyhow!("churn thread panicked"))??;
                }
                Ok(())
            })?;
            let wall = t0.elapsed().as_nanos() as f64 / (2 * pairs).max(1) as f64;
            println!("churn2 pair   {wall:7.1} wall-ns per pair (2 threads)");
        }
        Op::Dump => dumps(&t, a.page),
        Op::All => {
            for op in [Op::Get, Op::Lookup, Op::Touch, Op::Miss] {
                let t0 = now();
                let found = lookups(op);
                println!(
                    "{:<13} {} /op ({found})",
                    format!("{op:?}"),
                    per_op(t0, ops)
                );
            }
            let t0 = now();
            churn(ops / 2, 0, 1)?;
            println!("churn pair    {} /pair", per_op(t0, ops / 2));
            dumps(&t, a.page);
            let t0 = now();
            let mut out = Vec::new();
            let mut expired = 0;
            // Every entry expires at this time; each call does bounded work.
            loop {
                out.clear();
                let k = t.expire(Millis(10_000_000), 100_000, &mut out);
                expired += k;
                if k == 0 {
                    break;
                }
            }
            println!(
                "expire        {} /entry ({expired})",
                per_op(t0, expired as u64)
            );
        }
    }
    Ok(())
}

/// Full dumps at three page sizes.
fn dumps(t: &FlowTable, only: Option<usize>) {
    let pages = match only {
        Some(p) => vec![p.max(1)],
        None => vec![1, 100, 10_000],
    };
    for page in pages {
        let t0 = now();
        let mut out = Vec::with_capacity(page);
        let mut cur = None;
        let mut total = 0;
        // Ends: the cursor only moves forward over a table nobody changes.
        loop {
            out.clear();
            let more = t.dump_page(&mut cur, &DumpFilter::default(), page, &mut out);
            total += out.len();
            if !more {
                break;
            }
        }
        println!(
            "dump page {page:>5} {} /entry ({total})",
            per_op(t0, total as u64)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every mode runs to the end on a small table (churn errors, e.g. a
    /// key removed twice, would fail it).
    #[test]
    fn every_mode_runs_on_a_small_table() {
        for op in [
            Op::Get,
            Op::Touch,
            Op::Miss,
            Op::Reply,
            Op::Churn,
            Op::Churn2,
            Op::Dump,
            Op::All,
        ] {
            let a = OpsArgs {
                op,
                entries: 1_000,
                ops: 3_000,
                page: None,
            };
            run(&a).unwrap_or_else(|e| panic!("{op:?}: {e:#}"));
        }
    }
}

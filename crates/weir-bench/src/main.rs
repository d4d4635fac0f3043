//! `weir-bench`: races weir against its peers in one run and prints markdown
//! tables with ratios to the best peer and, where one exists, the ceiling.
//!
//! Every suite takes `--quick` (finishes in under 60 s on a 2-core machine)
//! and `--json FILE` (writes the figures under the keys the issues name).
//! `all` runs every suite and writes one JSON object keyed by suite.
//! SIGINT (Ctrl-C) or SIGTERM stops a run the way an error does: no process,
//! namespace or directory it made is left behind (see [`signals`]).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

mod dump;
mod ops;
mod packet;
mod proxy;
mod rate;
mod report;
mod signals;
mod soak;
mod table;

#[derive(Debug, Parser)]
#[command(name = "weir-bench", about = "Race weir against its peers")]
struct Cli {
    #[command(subcommand)]
    suite: Suite,
}

#[derive(Debug, Subcommand)]
enum Suite {
    /// Flow table: noisy neighbour, churn, lookup, memory (vs dashmap, papaya, scc, hashbrown).
    Table(Common),
    /// Flow table dumps: resumable cursor vs naive offset resume, exactness under churn.
    Dump(Common),
    /// Rate estimators: tick duration and CPU at 10k/100k/1M, counter update cost.
    Rate(Common),
    /// Proxy: weir vs HAProxy and nginx stream (CPS, RPS, throughput, memory, slow readers, UDP).
    Proxy(Common),
    /// Packet mode: weir nat/fnat/dr vs kernel forwarding and nftables DNAT
    /// in network namespaces (root, trafgen, nft; not part of `all`).
    Packet(Common),
    /// Every suite in turn; one JSON object keyed by suite.
    All(Common),
    /// Soak: TCP and UDP churn through one daemon with runtime edits and
    /// reloads; fails unless nothing leaked (not part of `all`).
    Soak(soak::SoakArgs),
    /// One flow-table operation in a loop, for `perf stat` / callgrind
    /// counts per operation (not a race; not part of `all`).
    Ops(ops::OpsArgs),
    /// Test hook for tests/stop_signal.rs (hidden): leaves an orphan and
    /// waits on a child, as peers do (see [`signals::stop_test`]).
    #[command(hide = true)]
    StopTest(signals::StopTestArgs),
}

/// Options every suite takes.
#[derive(Debug, Clone, Args)]
pub(crate) struct Common {
    /// Smaller sizes: the suite finishes in under 60 seconds on 2 cores.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Write the figures as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub(crate) json: Option<PathBuf>,
    /// table: the peers and the hashbrown ceiling hash with SipHash-1-3
    /// (their own default) instead of weir's foldhash; weir-only sections skipped.
    #[arg(long)]
    pub(crate) siphash: bool,
    /// table: run only these sections (comma-separated: noisy, churn,
    /// lookup, big, resize, memory, tenants); `big` = weir alone at 100M
    /// entries (lookup and memory rows), even with --quick; `tenants` =
    /// weir's expire with 1 to 100k tenants (10k with --quick). packet: rows udp (a),
    /// tcp (b), synflood (real clients through a spoofed SYN flood),
    /// synflood-tenants (a flood against tenant a at the daemon's
    /// max_connections, real clients of tenant b; a weir built from 7996c88^
    /// as WEIR_SYNFLOOD_TENANTS_BEFORE_BIN is raced too, its rows named
    /// WEIR_SYNFLOOD_TENANTS_BEFORE_LABEL or its path), scale (c, d,
    /// memory and the 10M-flow daemon checks). proxy:
    /// phases memory, slow, load.
    #[arg(long, value_delimiter = ',', value_name = "SECTIONS")]
    pub(crate) only: Vec<String>,
}

type SuiteFn = fn(&Common) -> Result<serde_json::Value>;

fn main() -> Result<()> {
    signals::install()?;
    // Dropped last: stops what the run left live, however it ends.
    let _leftovers = signals::StopLeftovers;
    let out = run(Cli::parse());
    // Not exit(1) for an error that a stop signal caused: 130 or 143.
    signals::exit_if_stopped();
    out
}

fn run(cli: Cli) -> Result<()> {
    let (common, suites): (Common, Vec<(&str, SuiteFn)>) = match cli.suite {
        Suite::Table(c) => (c, vec![("table", table::table)]),
        Suite::Dump(c) => (c, vec![("dump", dump::dump)]),
        Suite::Rate(c) => (c, vec![("rate", rate::rate)]),
        Suite::Proxy(c) => (c, vec![("proxy", proxy::run)]),
        Suite::Packet(c) => (c, vec![("packet", packet::run)]),
        Suite::Soak(a) => return soak::run(&a),
        Suite::Ops(a) => return ops::run(&a),
        Suite::StopTest(a) => return signals::stop_test(&a),
        Suite::All(c) => (
            c,
            vec![
                ("table", table::table),
                ("dump", dump::dump),
                ("rate", rate::rate),
                ("proxy", proxy::run),
            ],
        ),
    };
    report::machine_header(&common);
    let mut out = serde_json::Map::new();
    let mut failed = Vec::new();
    for (name, f) in &suites {
        println!("\n## {name}\n");
        let r = f(&common);
        // A suite stopped by a signal: not the next one, nor its error.
        signals::exit_if_stopped();
        match r {
            Ok(v) => {
                out.insert((*name).to_string(), v);
            }
            Err(e) => {
                println!("{name}: {e:#}");
                failed.push(*name);
            }
        }
    }
    if let Some(path) = &common.json {
        let v = if suites.len() == 1 {
            out.into_iter().next().map(|(_, v)| v).unwrap_or_default()
        } else {
            serde_json::Value::Object(out)
        };
        std::fs::write(path, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if !failed.is_empty() {
        bail!("suites failed: {}", failed.join(", "));
    }
    Ok(())
}

//! `weir-bench proxy`: weir against HAProxy (mode tcp) and nginx stream in
//! one run, with the direct path (no proxy) as the ceiling (issue 5).
//!
//! # What runs
//! The suite starts every server itself, each in its own temporary
//! directory, and stops it through a guard whose `Drop` kills the process
//! tree, so an error anywhere leaves nothing behind:
//! - backends: an nginx HTTP server (one worker, `return 200`), an iperf3
//!   server, and servers written here ([`servers`]): an idle holder, two
//!   slow-reader sources that write as fast as the kernel takes bytes (one
//!   with loopback's segments, one with Ethernet-sized ones), and a UDP echo;
//! - proxies: HAProxy (`nbthread N`), nginx stream (`worker_processes N`)
//!   and weir (`[daemon] workers = N`), each with six routes (HTTP, iperf3,
//!   idle, slow, slow_eth, UDP; HAProxy has no UDP) on fresh loopback ports.
//!
//! # What is measured (JSON keys as the issue names them)
//! - `proxy[]` `{impl, workers, test, value, p99_ms}`: `cps` (wrk with
//!   `Connection: close`, requests/s = new connections/s), `rps` (wrk
//!   keep-alive), `gbps_1` / `gbps_8` (iperf3, 1 and 8 streams),
//!   `udp_dps` (64-byte datagrams echoed per second, bounded window per
//!   client). Workers 1 and 2 (`--quick`: 1). All implementations of one
//!   worker count run side by side and the runs interleave (3 repetitions,
//!   `--quick` 1); a row is the median.
//! - `proxy[]` also has `cpu_per_op` and `cpu_unit`: the proxy's own CPU
//!   time (user + system, summed over its process tree: HAProxy's and
//!   weir's threads, nginx's master and workers; `/proc/PID/stat`) read just
//!   before and just after each load run, divided by the operations the
//!   generator completed: `us/conn` (cps: wrk's `N requests in`, one
//!   connection each), `us/req` (rps), `ms/GB` (gbps_*: iperf3's
//!   `end.sum_received.bytes`), `us/dgram` (udp_dps: datagrams echoed). The
//!   median over the repetitions, like the value; null for the direct path.
//!
//! # Why CPU per operation
//! Client, proxy and backend share two cores, so throughput depends on
//! how the scheduler interleaves three busy processes and swings by +-30%
//! between runs (weir vs HAProxy keep-alive req/s has ranged from 0.6x to
//! 1.7x), while the proxy's CPU time per operation stays within a few
//! percent. The load table prints both, with the cost's ratio to the
//! cheaper peer, so a reader can tell "slower because it costs more CPU"
//! from "slower because of scheduling". The goal lines stay on throughput;
//! one informative line per load goal gives the CPU ratio. Times come in
//! clock ticks (10 ms): a 1-2 s `--quick` run rounds by a few percent.
//! - `memory[]` `{impl, conns, bytes_per_conn}`: idle proxied connections
//!   (5,000; quick 1,000) on a fresh instance with one worker; bytes = growth
//!   of the proxy's RSS (whole process tree) + growth of kernel TCP memory
//!   (`/proc/net/sockstat`), divided by the connections.
//! - `lowat` `{mem_off_bytes, mem_on_bytes, haproxy_bytes, gbps_off,
//!   gbps_on}`: 1,000 (quick 200) clients that never read while the backend
//!   writes, with Ethernet-sized segments on both hops; the `*_bytes` are
//!   **per connection** (process growth + kernel TCP growth once kernel
//!   memory stops growing, divided by the clients), for weir with
//!   bounding off (`notsent_lowat`, `backend_rcvbuf`, `blocked_window` all
//!   0), weir's default (on) and HAProxy's defaults;
//!   `gbps_*` is one iperf3 stream through weir off/on (median of the runs,
//!   interleaved off/on).
//! - `slow_readers[]`: every slow-reader run in detail (clients, `mss`
//!   `"1448"` or `"loopback"`, totals, where the bytes sit): full runs have
//!   1,000 and 200 clients with Ethernet segments and 200 with loopback's;
//!   quick runs 200 of each.
//!
//! # Why slow readers run with two segment sizes
//! Linux sizes a socket's send buffer from its MSS (`tcp_sndbuf_expand`:
//! 2 x max(cwnd, 10) x the segment's rounded-up truesize, up to
//! `tcp_wmem`'s max). On loopback the MSS is 65,483 bytes, so the
//! *backend's* send queue holds up to ~4 MB per connection whatever the
//! proxy does and dominates the total; no real network has 64 KiB segments.
//! With Ethernet segments it still grows with the congestion window, but
//! from a far smaller base. The headline run therefore uses
//! Ethernet's (MTU 1500: 1448 payload bytes with timestamps): the backend's
//! listener sets `TCP_MAXSEG` before `listen` (accepted sockets inherit it
//! and advertise it in the SYN-ACK, so the proxy->backend hop uses it) and
//! each client sets it before `connect` (the proxy->client hop). Every proxy
//! gets the same treatment. The loopback run stays as a second view (at 200
//! clients: 1,000 would sit at the kernel's tcp_mem cap and measure the cap).
//!
//! Figures are never invented: an implementation that cannot run (weir not
//! built yet, a peer not installed) gets a line saying so and no JSON rows.
//! The suite fails only when it measured nothing at all.

use std::collections::HashMap;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::Common;
use crate::report::{Table, ratio};

mod load;
pub(crate) mod peers;
mod servers;
pub(crate) mod sys;

use peers::{Backends, Impl, Proxy, WeirOpts, start_proxy};
use servers::{BenchServers, OpenCount};
use sys::{ETH_MSS_OPTION, ETH_SEGMENT};

/// Segment size on both hops of a slow-reader run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Segments {
    /// Ethernet-sized: the backend's listener and every client set
    /// `TCP_MAXSEG` [`ETH_MSS_OPTION`] (route `slow_eth`).
    Ethernet,
    /// Loopback's own, ~64 KiB (route `slow`).
    Loopback,
}

impl Segments {
    /// `TCP_MAXSEG` each client sets before connecting.
    fn client_mss(self) -> Option<u32> {
        match self {
            Self::Ethernet => Some(ETH_MSS_OPTION),
            Self::Loopback => None,
        }
    }

    /// The route (proxy listen port or backend port) of this segment size.
    fn port(self, r: &peers::Routes) -> u16 {
        match self {
            Self::Ethernet => r.slow_eth,
            Self::Loopback => r.slow,
        }
    }

    /// `slow_readers[].mss` in the JSON.
    fn json(self) -> String {
        match self {
            Self::Ethernet => ETH_SEGMENT.to_string(),
            Self::Loopback => "loopback".into(),
        }
    }

    /// The table's "segments" column.
    fn label(self) -> &'static str {
        match self {
            Self::Ethernet => "1448 B (Ethernet)",
            Self::Loopback => "64 KiB (loopback)",
        }
    }
}

/// Sizes and durations of one run.
#[derive(Debug, Clone)]
struct Plan {
    workers: Vec<usize>,
    wrk_secs: u64,
    iperf_secs: u64,
    udp: Duration,
    idle_conns: usize,
    /// Slow-reader clients of the headline run (Ethernet segments): the
    /// `lowat` JSON and the goal lines.
    slow_conns: usize,
    /// Every slow-reader run, in order: (clients, segment size). Holds
    /// `(slow_conns, Ethernet)`.
    slow_runs: Vec<(usize, Segments)>,
    /// Longest wait for kernel memory to stop growing behind slow readers.
    settle: Duration,
    /// iperf3 single-stream runs per weir setting in the lowat comparison.
    lowat_reps: usize,
    /// Interleaved repetitions of every load test (the row is the median).
    reps: usize,
}

impl Plan {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                workers: vec![1],
                wrk_secs: 2,
                iperf_secs: 1,
                udp: Duration::from_secs(1),
                idle_conns: 1_000,
                slow_conns: 200,
                slow_runs: vec![(200, Segments::Ethernet), (200, Segments::Loopback)],
                settle: Duration::from_secs(4),
                lowat_reps: 1,
                reps: 1,
            }
        } else {
            Self {
                workers: vec![1, 2],
                wrk_secs: 5,
                iperf_secs: 5,
                udp: Duration::from_secs(3),
                idle_conns: 5_000,
                slow_conns: 1_000,
                // 200 clients too: well below the kernel's tcp_mem cap,
                // where the proxies' own bounding shows. No 1,000-client
                // loopback run: it sits at that cap and measures the cap.
                slow_runs: vec![
                    (1_000, Segments::Ethernet),
                    (200, Segments::Ethernet),
                    (200, Segments::Loopback),
                ],
                settle: Duration::from_secs(20),
                lowat_reps: 3,
                reps: 3,
            }
        }
    }
}

/// wrk threads and connections: one client thread leaves the second core to
/// the proxy and the backend (client, proxy and backend share 2 cores).
const WRK_THREADS: usize = 1;
const WRK_CONNS_CPS: usize = 32;
const WRK_CONNS_RPS: usize = 64;
/// UDP generator: clients (threads) and datagrams in flight per client.
const UDP_CLIENTS: usize = 4;
const UDP_WINDOW: u64 = 32;
const UDP_MAX_PER_CLIENT: u64 = 5_000_000;
/// The load tests, in the order they run.
const TESTS: [&str; 5] = ["cps", "rps", "gbps_1", "gbps_8", "udp_dps"];

/// One measured figure.
#[derive(Debug, Clone)]
struct Row {
    imp: Impl,
    workers: usize,
    test: &'static str,
    value: f64,
    p99_ms: Option<f64>,
    /// The proxy's CPU time per operation, in [`cpu_unit`]s; None for the
    /// direct path.
    cpu_per_op: Option<f64>,
}

/// One run of one load test on one implementation.
#[derive(Debug, Clone, Copy)]
struct Sample {
    imp: Impl,
    test: &'static str,
    value: f64,
    p99_ms: Option<f64>,
    cpu_per_op: Option<f64>,
}

/// Slow-reader result for one configuration.
#[derive(Debug, Clone, Copy)]
struct Slow {
    per_conn: f64,
    total: f64,
    /// Kernel memory stopped growing before the settle timeout.
    settled: bool,
    /// Kernel TCP memory reached 95% of the system-wide tcp_mem limit.
    capped: bool,
    queues: Queues,
    /// Per connection: RSS growth + bytes queued in the proxy's own sockets.
    proxy_side: f64,
}

/// Bytes queued along the slow-reader path (the four queues of seed 004).
#[derive(Debug, Clone, Copy, Default)]
struct Queues {
    /// Backend sockets' send queues.
    backend_send: u64,
    /// Proxy's backend-side receive queues.
    proxy_recv: u64,
    /// Proxy's client-side send queues.
    proxy_send: u64,
    /// Clients' receive queues.
    client_recv: u64,
}

impl Queues {
    /// Sums `/proc/net/tcp` queues of established sockets by where they sit,
    /// given the proxy's listen port and the backend's port.
    fn read(proxy_port: u16, backend_port: u16) -> Self {
        let mut q = Self::default();
        for s in sys::tcp_sockets() {
            if s.state != 1 {
                continue;
            }
            if s.local_port == backend_port {
                q.backend_send += s.tx_queue;
            } else if s.remote_port == backend_port {
                q.proxy_recv += s.rx_queue;
            } else if s.local_port == proxy_port {
                q.proxy_send += s.tx_queue;
            } else if s.remote_port == proxy_port {
                q.client_recv += s.rx_queue;
            }
        }
        q
    }
}

/// Phases `--only` may name: idle memory, slow readers, the load rows.
const PHASES: [&str; 3] = ["memory", "slow", "load"];

/// Runs the suite; returns `{proxy: [...], memory: [...], lowat: {...}}`.
pub(crate) fn run(c: &Common) -> Result<Value> {
    if let Some(o) = c.only.iter().find(|o| !PHASES.contains(&o.as_str())) {
        bail!(
            "--only: unknown proxy phase {o:?} (one of {})",
            PHASES.join(", ")
        );
    }
    let on = |name: &str| c.only.is_empty() || c.only.iter().any(|o| o == name);
    let plan = Plan::new(c.quick);
    let nofile = sys::raise_nofile()?;
    println!(
        "Noisy machine: client, proxy and backends share the same cores, and other builds may be \
         running; only ratios within this run mean anything. Open-files limit: {nofile}."
    );
    for tool in ["nginx", "wrk", "iperf3"] {
        if sys::which(tool).is_none() {
            bail!("{tool} not found: run scripts/install-peers.sh");
        }
    }
    let dir = tempfile::Builder::new()
        .prefix("weir-bench-proxy")
        .tempdir()?;
    crate::signals::remove_dir_on_signal(dir.path());
    let bench = BenchServers::start()?;
    let backends = Backends::start(
        bench.idle_port,
        bench.slow_port,
        bench.slow_eth_port,
        bench.udp_port,
    )?;

    // Which implementations can run at all.
    let mut unavailable: Vec<(Impl, String)> = Vec::new();
    if sys::which("haproxy").is_none() {
        unavailable.push((Impl::Haproxy, "haproxy not installed".into()));
    }
    if !std::path::Path::new("/usr/lib/nginx/modules/ngx_stream_module.so").is_file() {
        unavailable.push((Impl::Nginx, "libnginx-mod-stream not installed".into()));
    }
    let weir_opts = match peers::weir_bin() {
        Ok(bin) => WeirOpts {
            bin,
            bounding_off: false,
        },
        Err(e) => {
            unavailable.push((
                Impl::Weir,
                format!("not available (daemon not landed): {e:#}"),
            ));
            WeirOpts::default()
        }
    };
    let mut ctx = Ctx {
        plan,
        dir,
        bench,
        backends,
        weir: weir_opts,
        unavailable,
        rows: Vec::new(),
        memory: Vec::new(),
        proxy_side: HashMap::new(),
        errors: Vec::new(),
    };
    if on("memory") {
        ctx.memory_phase();
    }
    let (lowat, slow_detail) = if on("slow") {
        ctx.lowat_phase()
    } else {
        (serde_json::Map::new(), Vec::new())
    };
    if on("load") {
        ctx.load_phase();
    }
    ctx.report(&lowat);

    if ctx.rows.is_empty() && ctx.memory.is_empty() && lowat.values().all(Value::is_null) {
        bail!("measured nothing: {}", ctx.errors.join("; "));
    }
    let proxy = proxy_json(&ctx.rows);
    let memory: Vec<Value> = ctx
        .memory
        .iter()
        .map(|(imp, conns, b)| json!({"impl": imp.name(), "conns": conns, "bytes_per_conn": b}))
        .collect();
    let unavailable: serde_json::Map<String, Value> = ctx
        .unavailable
        .iter()
        .map(|(i, why)| (i.name().to_string(), Value::from(why.as_str())))
        .collect();
    Ok(json!({
        "proxy": proxy,
        "memory": memory,
        "lowat": lowat,
        "slow_readers": slow_detail,
        "unavailable": unavailable,
    }))
}

/// The `proxy[]` JSON rows: `{impl, workers, test, value, p99_ms,
/// cpu_per_op, cpu_unit}` (`cpu_per_op` null for the direct path).
fn proxy_json(rows: &[Row]) -> Vec<Value> {
    rows.iter()
        .map(|r| {
            json!({"impl": r.imp.name(), "workers": r.workers, "test": r.test,
                   "value": r.value, "p99_ms": r.p99_ms,
                   "cpu_per_op": r.cpu_per_op, "cpu_unit": cpu_unit(r.test)})
        })
        .collect()
}

/// Everything one run holds: servers, plan and results so far.
#[derive(Debug)]
struct Ctx {
    plan: Plan,
    dir: tempfile::TempDir,
    bench: BenchServers,
    backends: Backends,
    weir: WeirOpts,
    unavailable: Vec<(Impl, String)>,
    rows: Vec<Row>,
    /// (impl, conns, bytes per connection)
    memory: Vec<(Impl, usize, f64)>,
    /// Slow readers of the headline run: proxy-side bytes per client by config.
    proxy_side: HashMap<&'static str, f64>,
    errors: Vec<String>,
}

impl Ctx {
    fn available(&self, imp: Impl) -> bool {
        !self.unavailable.iter().any(|(i, _)| *i == imp)
    }

    /// Starts `imp`; on failure records why (weir: the daemon has not
    /// landed or cannot proxy yet) and returns None.
    fn start(&mut self, imp: Impl, workers: usize, bounding_off: bool) -> Option<Proxy> {
        if !self.available(imp) {
            return None;
        }
        let opts = WeirOpts {
            bounding_off,
            ..self.weir.clone()
        };
        let started = start_proxy(imp, workers, &self.backends.routes, &opts)
            .and_then(|mut p| probe(&mut p, &self.bench.idle_open).map(|()| p));
        match started {
            Ok(p) => Some(p),
            Err(e) if bounding_off => {
                // Only this setting failed (e.g. an option was renamed):
                // weir's other rows still run.
                self.error(format!("weir with bounding off: {e:#}"));
                None
            }
            Err(e) => {
                let why = if imp == Impl::Weir {
                    format!("not available (daemon not landed or not proxying): {e:#}")
                } else {
                    format!("failed to start: {e:#}")
                };
                println!("{}: {why}", imp.name());
                self.unavailable.push((imp, why));
                None
            }
        }
    }

    fn error(&mut self, what: String) {
        println!("error: {what}");
        self.errors.push(what);
    }

    /// Idle connections' memory, one worker, fresh instance each.
    fn memory_phase(&mut self) {
        let n = self.plan.idle_conns;
        for imp in [Impl::Haproxy, Impl::Nginx, Impl::Weir] {
            let Some(p) = self.start(imp, 1, false) else {
                continue;
            };
            match idle_memory(&p, &self.bench.idle_open, n) {
                Ok(b) => self.memory.push((imp, n, b)),
                Err(e) => self.error(format!("{} idle memory: {e:#}", imp.name())),
            }
        }
    }

    /// Slow readers (HAProxy default, weir off, weir on) for every
    /// (clients, segment size) of the plan, and weir's single-flow
    /// throughput with bounding off and on.
    fn lowat_phase(&mut self) -> (serde_json::Map<String, Value>, Vec<Value>) {
        let slow_runs = self.plan.slow_runs.clone();
        let hp = self.start(Impl::Haproxy, 1, false);
        let off = self.start(Impl::Weir, 1, true);
        let on = off.as_ref().and_then(|_| self.start(Impl::Weir, 1, false));
        let configs = [
            ("haproxy", "HAProxy defaults", hp.as_ref()),
            (
                "off",
                "weir, bounding off (notsent_lowat, backend_rcvbuf, blocked_window = 0)",
                off.as_ref(),
            ),
            ("on", "weir default (bounding on)", on.as_ref()),
        ];
        let mut mem: HashMap<(usize, Segments, &str), Slow> = HashMap::new();
        for &(n, seg) in &slow_runs {
            for (key, _, p) in configs {
                let Some(p) = p else { continue };
                match self.slow_memory(p, n, seg) {
                    Ok(s) => {
                        mem.insert((n, seg, key), s);
                    }
                    Err(e) => self.error(format!(
                        "{key} slow readers ({n}, {} segments): {e:#}",
                        seg.label()
                    )),
                }
            }
        }
        let mut runs: HashMap<&str, Vec<f64>> = HashMap::new();
        if let (Some(off), Some(on)) = (off.as_ref(), on.as_ref()) {
            for _ in 0..self.plan.lowat_reps {
                for (key, p) in [("off", off), ("on", on)] {
                    match load::iperf3(self.dir.path(), p.routes.iperf, self.plan.iperf_secs, 1) {
                        Ok(g) => runs.entry(key).or_default().push(g.gbps),
                        Err(e) => self.error(format!("weir {key} iperf3: {e:#}")),
                    }
                }
            }
        }
        let gbps: HashMap<&str, f64> = runs
            .into_iter()
            .filter_map(|(k, v)| Some((k, median(v.into_iter())?)))
            .collect();
        let mut detail = Vec::new();
        println!(
            "\n### Slow readers (clients that never read while the backend writes; one worker)\n\n\
             Memory = growth of the proxy's RSS + growth of kernel TCP memory (whole machine, \
             /proc/net/sockstat), so it includes the backend's and the clients' socket buffers. \
             Queued bytes (from /proc/net/tcp) show where the data sits. Linux sizes a send \
             buffer from the segment size (2 x max(cwnd, 10) x its rounded-up truesize, up to \
             tcp_wmem's max), so with loopback's 64 KiB segments the backend's send queue, \
             which no proxy can bound, holds up to ~4 MB per connection and dominates the total; no real network has such \
             segments. The headline runs therefore use Ethernet-sized segments on both hops \
             (the backend's listener and every client set TCP_MAXSEG; same for every proxy); \
             the loopback runs stay as a second view. 'Proxy-side' = (RSS growth + bytes \
             queued in the proxy's own sockets) per client isolates the proxy. \
             Kernel TCP memory is capped system-wide by tcp_mem ({:.0} MB here): a run at \
             that cap measures the cap, not the proxy.\n",
            sys::tcp_mem_max_bytes().unwrap_or(0) as f64 / 1e6
        );
        let mut t = Table::new([
            "config",
            "clients",
            "segments",
            "total MB",
            "per client KB",
            "vs HAProxy",
            "settled",
            "at tcp_mem cap",
            "queued MB: backend send / proxy recv / proxy send / client recv",
            "proxy-side KB per client",
            "proxy-side vs HAProxy",
            "1-stream Gbit/s",
        ]);
        for &(n, seg) in &slow_runs {
            let hp = mem.get(&(n, seg, "haproxy")).map_or(0.0, |s| s.per_conn);
            let hp_side = mem.get(&(n, seg, "haproxy")).map_or(0.0, |s| s.proxy_side);
            for (key, label, _) in configs {
                let Some(s) = mem.get(&(n, seg, key)) else {
                    t.row([
                        label,
                        &n.to_string(),
                        seg.label(),
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                    ]);
                    continue;
                };
                let q = s.queues;
                t.row([
                    label.to_string(),
                    n.to_string(),
                    seg.label().to_string(),
                    format!("{:.1}", s.total / 1e6),
                    format!("{:.1}", s.per_conn / 1e3),
                    ratio(s.per_conn, hp),
                    if s.settled { "yes" } else { "no (timed out)" }.to_string(),
                    if s.capped { "YES" } else { "no" }.to_string(),
                    format!(
                        "{:.0} / {:.0} / {:.0} / {:.0}",
                        q.backend_send as f64 / 1e6,
                        q.proxy_recv as f64 / 1e6,
                        q.proxy_send as f64 / 1e6,
                        q.client_recv as f64 / 1e6
                    ),
                    format!("{:.1}", s.proxy_side / 1e3),
                    ratio(s.proxy_side, hp_side),
                    gbps.get(key).map_or("-".into(), |g| format!("{g:.2}")),
                ]);
                detail.push(json!({
                    "config": key, "clients": n, "mss": seg.json(), "total_bytes": s.total,
                    "per_conn_bytes": s.per_conn, "settled": s.settled,
                    "at_tcp_mem_cap": s.capped, "proxy_side_per_conn_bytes": s.proxy_side,
                    "queued_bytes": {"backend_send": q.backend_send, "proxy_recv": q.proxy_recv,
                                     "proxy_send": q.proxy_send, "client_recv": q.client_recv},
                }));
            }
        }
        t.print();
        // The headline: Ethernet segments at the client count.
        let n = self.plan.slow_conns;
        let head = |k: &'static str| mem.get(&(n, Segments::Ethernet, k));
        let per = |k: &'static str| head(k).map(|s| s.per_conn);
        let proxy_side = ["haproxy", "off", "on"]
            .into_iter()
            .filter_map(|k| Some((k, head(k)?.proxy_side)))
            .collect();
        let mut out = serde_json::Map::new();
        out.insert("mem_off_bytes".into(), json!(per("off")));
        out.insert("mem_on_bytes".into(), json!(per("on")));
        out.insert("haproxy_bytes".into(), json!(per("haproxy")));
        out.insert("gbps_off".into(), json!(gbps.get("off")));
        out.insert("gbps_on".into(), json!(gbps.get("on")));
        self.proxy_side = proxy_side;
        (out, detail)
    }

    /// cps, rps, gbps_1, gbps_8, udp_dps for each worker count.
    ///
    /// All implementations of one worker count run side by side (idle ones
    /// cost nothing) and the runs interleave: every repetition runs each test
    /// on every implementation, in an order rotated per repetition, so a
    /// burst of someone else's build hits them all alike. The row is the
    /// median of the repetitions.
    fn load_phase(&mut self) {
        let workers = self.plan.workers.clone();
        for (i, &w) in workers.iter().enumerate() {
            let mut impls = vec![Impl::Haproxy, Impl::Nginx, Impl::Weir];
            if i == 0 {
                impls.insert(0, Impl::Direct);
            }
            let mut running: Vec<Proxy> = impls
                .into_iter()
                .filter_map(|imp| self.start(imp, w, false))
                .collect();
            let mut samples: Vec<Sample> = Vec::new();
            for rep in 0..self.plan.reps {
                for test in TESTS {
                    let k = running.len().max(1);
                    for j in 0..running.len() {
                        let p = &running[(j + rep) % k];
                        if let Some(s) = self.run_test(p, test) {
                            samples.push(s);
                        }
                    }
                }
            }
            for p in &mut running {
                if let Err(e) = p.check_alive() {
                    self.error(format!(
                        "{} died during the load tests: {e:#}",
                        p.imp.name()
                    ));
                }
                let workers = if p.imp == Impl::Direct { 0 } else { w };
                for test in TESTS {
                    let mine: Vec<_> = samples
                        .iter()
                        .filter(|s| s.imp == p.imp && s.test == test)
                        .collect();
                    let value = median(mine.iter().map(|s| s.value));
                    let p99_ms = median(mine.iter().filter_map(|s| s.p99_ms));
                    let cpu_per_op = median(mine.iter().filter_map(|s| s.cpu_per_op));
                    if let Some(value) = value {
                        self.rows.push(Row {
                            imp: p.imp,
                            workers,
                            test,
                            value,
                            p99_ms,
                            cpu_per_op,
                        });
                    }
                }
            }
        }
    }

    /// One run of `test` on `p`, with the proxy's CPU time read just before
    /// and just after the load generator; None when there was an error
    /// (recorded) or the test does not apply.
    fn run_test(&mut self, p: &Proxy, test: &'static str) -> Option<Sample> {
        let (imp, plan, dir) = (p.imp, &self.plan, self.dir.path());
        let cpu_before = p.cpu_seconds();
        // (value, p99 ms, operations done: requests, bytes or datagrams)
        let r: Result<(f64, Option<f64>, u64)> = match test {
            "cps" | "rps" => {
                let (close, conns) = if test == "cps" {
                    (true, WRK_CONNS_CPS)
                } else {
                    (false, WRK_CONNS_RPS)
                };
                load::wrk(dir, p.routes.http, plan.wrk_secs, WRK_THREADS, conns, close).map(|r| {
                    if r.errors + r.non2xx > 0 {
                        println!(
                            "note: {} {test}: {} socket errors, {} non-2xx",
                            imp.name(),
                            r.errors,
                            r.non2xx
                        );
                    }
                    (r.rps, r.p99_ms, r.requests)
                })
            }
            "gbps_1" | "gbps_8" => {
                let streams = if test == "gbps_1" { 1 } else { 8 };
                load::iperf3(dir, p.routes.iperf, plan.iperf_secs, streams)
                    .map(|g| (g.gbps, None, g.bytes))
            }
            _ => {
                let port = p.routes.udp?;
                load::udp_load(
                    sys::lo(port),
                    plan.udp,
                    UDP_CLIENTS,
                    UDP_WINDOW,
                    UDP_MAX_PER_CLIENT,
                )
                .and_then(|r| {
                    let lost = r.sent - r.received.min(r.sent);
                    println!(
                        "note: {} udp: {} sent, {} echoed ({:.1}% lost)",
                        imp.name(),
                        r.sent,
                        r.received,
                        100.0 * lost as f64 / r.sent.max(1) as f64
                    );
                    if r.received == 0 {
                        bail!("no reply to {} datagrams", r.sent);
                    }
                    Ok((r.dps(), None, r.received))
                })
            }
        };
        let cpu_after = p.cpu_seconds();
        match r {
            Ok((value, p99_ms, ops)) => Some(Sample {
                imp,
                test,
                value,
                p99_ms,
                cpu_per_op: cpu_before
                    .zip(cpu_after)
                    .and_then(|(a, b)| cpu_per_op(test, b - a, ops)),
            }),
            Err(e) => {
                self.error(format!("{} {test}: {e:#}", imp.name()));
                None
            }
        }
    }

    /// Memory held for `n` clients that never read while the backend
    /// writes, both hops cutting `seg`-sized segments.
    fn slow_memory(&self, p: &Proxy, n: usize, seg: Segments) -> Result<Slow> {
        let open = &self.bench.slow_open;
        open.wait("slow backend to be empty", Duration::from_secs(30), |x| {
            x == 0
        })?;
        let k_before = settle_kernel(Duration::from_secs(10), 0.01)?.0;
        let r0 = p.rss() as f64;
        let clients = load::connect_many(
            seg.port(&p.routes),
            n,
            200,
            || open.get(),
            Duration::from_secs(60),
            seg.client_mss(),
        )?;
        open.wait(
            &format!("{n} proxied slow connections"),
            Duration::from_secs(30),
            |x| x >= n,
        )?;
        let (k1, settled) = settle_kernel(self.plan.settle, 0.01)?;
        let r1 = p.rss() as f64;
        let queues = Queues::read(seg.port(&p.routes), seg.port(&self.backends.routes));
        let capped = sys::tcp_mem_max_bytes().is_some_and(|max| k1 as f64 >= 0.95 * max as f64);
        drop(clients);
        open.wait("slow connections to close", Duration::from_secs(30), |x| {
            x == 0
        })?;
        let total = (r1 - r0) + (k1 as f64 - k_before as f64);
        Ok(Slow {
            per_conn: total / n as f64,
            total,
            settled,
            capped,
            queues,
            proxy_side: ((r1 - r0) + (queues.proxy_recv + queues.proxy_send) as f64) / n as f64,
        })
    }

    /// The lowest CPU cost per operation among the peers for `test` at `w`
    /// workers; None when no peer measured it (or measured zero ticks).
    fn best_peer_cpu(&self, test: &str, w: usize) -> Option<f64> {
        self.rows
            .iter()
            .filter(|r| r.imp.is_peer() && r.test == test && r.workers == w)
            .filter_map(|r| r.cpu_per_op)
            .filter(|c| *c > 0.0)
            .min_by(f64::total_cmp)
    }

    fn report(&self, lowat: &serde_json::Map<String, Value>) {
        for (imp, why) in &self.unavailable {
            println!("{}: {why}", imp.name());
        }
        // Load tests.
        let best_peer = |test: &str, w: usize| {
            self.rows
                .iter()
                .filter(|r| r.imp.is_peer() && r.test == test && r.workers == w)
                .map(|r| r.value)
                .fold(0.0, f64::max)
        };
        let direct = |test: &str| {
            self.rows
                .iter()
                .find(|r| r.imp == Impl::Direct && r.test == test)
                .map_or(0.0, |r| r.value)
        };
        println!(
            "\n### Load (client, proxy and backend on the same 2 cores)\n\n\
             Throughput swings with how the scheduler interleaves client, proxy and backend; \
             'proxy CPU per op' (the proxy's own user + system time over the run, per \
             connection, request, GB or datagram) is far steadier: a proxy with lower throughput \
             but no higher CPU cost lost time to scheduling, not to its own code. Lower is better; 'CPU vs \
             best peer' = cost / the cheaper peer's cost. CPU time is counted in clock ticks \
             (10 ms), so short --quick runs carry a few % of rounding.\n"
        );
        let mut t = Table::new([
            "test",
            "workers",
            "impl",
            "value",
            "unit",
            "p99 ms",
            "vs best peer",
            "vs direct",
            "proxy CPU per op",
            "CPU vs best peer",
        ]);
        for test in TESTS {
            for r in self.rows.iter().filter(|r| r.test == test) {
                let w = r.workers;
                t.row([
                    test.to_string(),
                    if r.imp == Impl::Direct {
                        "-".into()
                    } else {
                        w.to_string()
                    },
                    r.imp.name().to_string(),
                    fmt_value(test, r.value),
                    unit(test).to_string(),
                    r.p99_ms.map_or("-".into(), |p| format!("{p:.2}")),
                    if r.imp == Impl::Direct {
                        "-".into()
                    } else {
                        ratio(r.value, best_peer(test, w))
                    },
                    ratio(r.value, direct(test)),
                    r.cpu_per_op.map_or("-".into(), |c| fmt_cpu(test, c)),
                    match (r.cpu_per_op, self.best_peer_cpu(test, w)) {
                        (Some(c), Some(b)) if r.imp != Impl::Direct => ratio(c, b),
                        _ => "-".into(),
                    },
                ]);
            }
            if test == "udp_dps" && self.available(Impl::Haproxy) {
                t.row([
                    test,
                    "-",
                    "haproxy",
                    "n/a (no UDP proxying)",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                ]);
            }
            if !self.available(Impl::Weir) {
                t.row([
                    test,
                    "-",
                    "weir",
                    "not available (daemon not landed)",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                ]);
            }
        }
        t.print();
        // Idle memory (a phase of its own: nothing to print when it did not run).
        let best = self
            .memory
            .iter()
            .filter(|(i, _, _)| i.is_peer())
            .map(|(_, _, b)| *b)
            .fold(f64::INFINITY, f64::min);
        if !self.memory.is_empty() || !self.available(Impl::Weir) {
            println!("\n### Memory per idle proxied connection (one worker)\n");
            let mut m = Table::new(["impl", "conns", "bytes per conn", "vs best peer"]);
            for (imp, conns, b) in &self.memory {
                m.row([
                    imp.name().to_string(),
                    conns.to_string(),
                    format!("{b:.0}"),
                    ratio(*b, best),
                ]);
            }
            if !self.available(Impl::Weir) {
                m.row(["weir", "-", "not available (daemon not landed)", "-"]);
            }
            m.print();
        }
        self.goals(lowat, &best_peer, best);
    }

    /// One line per goal of the issue, from this run's figures.
    fn goals(
        &self,
        lowat: &serde_json::Map<String, Value>,
        best_peer: &dyn Fn(&str, usize) -> f64,
        best_mem: f64,
    ) {
        println!("\n### Goals (this run)\n");
        let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
        for r in self.rows.iter().filter(|r| r.imp == Impl::Weir) {
            let b = best_peer(r.test, r.workers);
            if b > 0.0 {
                println!(
                    "- {} workers={}: weir {:.2}x best peer (goal >= 1.0x): {}",
                    r.test,
                    r.workers,
                    r.value / b,
                    verdict(r.value >= b)
                );
            }
        }
        for r in self.rows.iter().filter(|r| r.imp == Impl::Weir) {
            if let (Some(c), Some(b)) = (r.cpu_per_op, self.best_peer_cpu(r.test, r.workers)) {
                println!(
                    "- {} workers={}: weir CPU per {} {:.2}x best peer's ({} vs {}; lower is \
                     better; informative)",
                    r.test,
                    r.workers,
                    cpu_op_name(r.test),
                    c / b,
                    fmt_cpu(r.test, c),
                    fmt_cpu(r.test, b)
                );
            }
        }
        if let Some((_, _, b)) = self.memory.iter().find(|(i, _, _)| *i == Impl::Weir)
            && best_mem.is_finite()
        {
            println!(
                "- idle memory: weir {:.2}x best peer (goal <= 1.0x): {}",
                b / best_mem,
                verdict(*b <= best_mem)
            );
        }
        let f = |k: &str| lowat.get(k).and_then(Value::as_f64);
        if let (Some(off), Some(on)) = (f("mem_off_bytes"), f("mem_on_bytes"))
            && off > 0.0
        {
            println!(
                "- slow readers, bounding on vs off: {:+.0}% memory (goal <= -50%): {}",
                100.0 * (on / off - 1.0),
                verdict(on <= 0.5 * off)
            );
        }
        if let (Some(on), Some(hp)) = (f("mem_on_bytes"), f("haproxy_bytes"))
            && hp > 0.0
        {
            println!(
                "- slow readers, weir default vs HAProxy per connection: {:.2}x (goal <= 0.25x): {}",
                on / hp,
                verdict(on <= 0.25 * hp)
            );
        }
        let side = |k: &str| self.proxy_side.get(k).copied();
        if let (Some(off), Some(on), Some(hp)) = (side("off"), side("on"), side("haproxy"))
            && off > 0.0
            && hp > 0.0
        {
            println!(
                "- slow readers, proxy side only (RSS + the proxy's own socket queues): \
                 on vs off {:+.0}%, weir default vs HAProxy {:.2}x (informative; same goals)",
                100.0 * (on / off - 1.0),
                on / hp
            );
        }
        if let (Some(off), Some(on)) = (f("gbps_off"), f("gbps_on"))
            && off > 0.0
        {
            println!(
                "- single flow, bounding on vs off: {:+.1}% (goal >= -5%): {}",
                100.0 * (on / off - 1.0),
                verdict(on >= 0.95 * off)
            );
        }
        if !self.available(Impl::Weir) {
            println!("- weir: not available (daemon not landed): no goal can be checked");
        }
    }
}

/// Checks an instance really proxies: one connection through its idle route
/// must reach the idle backend (10 s at most).
fn probe(p: &mut Proxy, idle_open: &OpenCount) -> Result<()> {
    idle_open.wait("idle backend to be empty", Duration::from_secs(10), |x| {
        x == 0
    })?;
    let s = TcpStream::connect_timeout(&sys::lo(p.routes.idle), Duration::from_secs(5))
        .with_context(|| format!("{} idle route", p.imp.name()))?;
    let reached = idle_open.wait("probe to reach the backend", Duration::from_secs(10), |x| {
        x >= 1
    });
    drop(s);
    reached?;
    idle_open.wait("probe to close", Duration::from_secs(10), |x| x == 0)?;
    p.check_alive()
}

/// Memory per idle proxied connection: RSS growth + kernel TCP growth over `n`.
fn idle_memory(p: &Proxy, open: &OpenCount, n: usize) -> Result<f64> {
    open.wait("idle backend to be empty", Duration::from_secs(30), |x| {
        x == 0
    })?;
    let (r0, k0) = (p.rss() as f64, sys::kernel_tcp_bytes()? as f64);
    let conns = load::connect_many(
        p.routes.idle,
        n,
        200,
        || open.get(),
        Duration::from_secs(60),
        None,
    )?;
    open.wait(
        &format!("{n} proxied idle connections"),
        Duration::from_secs(60),
        |x| x >= n,
    )?;
    let (r1, k1) = (p.rss() as f64, sys::kernel_tcp_bytes()? as f64);
    drop(conns);
    open.wait("idle connections to close", Duration::from_secs(30), |x| {
        x == 0
    })?;
    Ok(((r1 - r0) + (k1 - k0)) / n as f64)
}

/// Samples kernel TCP memory every 250 ms until the last second's samples
/// lie within `tol` (relative) of each other, or `timeout` passes. Returns
/// the last sample and whether it settled.
fn settle_kernel(timeout: Duration, tol: f64) -> Result<(u64, bool)> {
    let start = Instant::now();
    let mut last: Vec<u64> = Vec::new();
    loop {
        let k = sys::kernel_tcp_bytes()?;
        last.push(k);
        if last.len() > 5 {
            last.remove(0);
        }
        if last.len() == 5 {
            let (lo, hi) = (
                last.iter().copied().min().unwrap_or(0),
                last.iter().copied().max().unwrap_or(0),
            );
            if (hi - lo) as f64 <= tol * hi as f64 + 64.0 * 4096.0 {
                return Ok((k, true));
            }
        }
        if start.elapsed() > timeout {
            return Ok((k, false));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Median (mean of the middle two for an even count); None when empty.
fn median(v: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = v.collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        f64::midpoint(v[m - 1], v[m])
    })
}

fn unit(test: &str) -> &'static str {
    match test {
        "cps" => "conn/s",
        "rps" => "req/s",
        "gbps_1" | "gbps_8" => "Gbit/s",
        "udp_dps" => "dgram/s",
        _ => "",
    }
}

/// Unit of [`Row::cpu_per_op`] for `test`.
fn cpu_unit(test: &str) -> &'static str {
    match test {
        "cps" => "us/conn",
        "rps" => "us/req",
        "gbps_1" | "gbps_8" => "ms/GB",
        "udp_dps" => "us/dgram",
        _ => "",
    }
}

/// What one operation of `test` is, for the goal lines.
fn cpu_op_name(test: &str) -> &'static str {
    match test {
        "cps" => "connection",
        "rps" => "request",
        "gbps_1" | "gbps_8" => "GB",
        "udp_dps" => "datagram",
        _ => "operation",
    }
}

/// CPU cost per operation in [`cpu_unit`]s: `cpu_s` seconds spent on `ops`
/// requests (cps, rps), bytes (gbps_*) or datagrams (udp_dps). None when
/// nothing was done or the reading went backwards (a process of the tree
/// exited and took its time with it).
fn cpu_per_op(test: &str, cpu_s: f64, ops: u64) -> Option<f64> {
    if ops == 0 || cpu_s.is_nan() || cpu_s < 0.0 {
        return None;
    }
    let ops = ops as f64;
    Some(if test.starts_with("gbps") {
        // milliseconds per 10^9 bytes
        cpu_s * 1e3 / (ops / 1e9)
    } else {
        // microseconds per request or datagram
        cpu_s * 1e6 / ops
    })
}

/// A CPU cost with its unit: "4.5 us/req", "140 ms/GB", "0.85 us/dgram".
fn fmt_cpu(test: &str, c: f64) -> String {
    let unit = cpu_unit(test);
    if c >= 100.0 {
        format!("{c:.0} {unit}")
    } else if c >= 1.0 {
        format!("{c:.1} {unit}")
    } else {
        format!("{c:.2} {unit}")
    }
}

fn fmt_value(test: &str, v: f64) -> String {
    if test.starts_with("gbps") {
        format!("{v:.2}")
    } else {
        format!("{v:.0}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Starts the real backends and `imp`, checks one idle-memory measurement.
    fn idle_through(imp: Impl, n: usize) -> f64 {
        let bench = BenchServers::start().unwrap();
        let be = Backends::start(
            bench.idle_port,
            bench.slow_port,
            bench.slow_eth_port,
            bench.udp_port,
        )
        .unwrap();
        let mut p = start_proxy(imp, 1, &be.routes, &WeirOpts::default()).unwrap();
        probe(&mut p, &bench.idle_open).unwrap();
        idle_memory(&p, &bench.idle_open, n).unwrap()
    }

    #[test]
    fn direct_path_probe_idle_memory_and_queues() {
        let bench = BenchServers::start().unwrap();
        let routes = peers::Routes {
            http: 1,
            iperf: 1,
            idle: bench.idle_port,
            slow: bench.slow_port,
            slow_eth: bench.slow_eth_port,
            udp: Some(bench.udp_port),
        };
        let mut p = start_proxy(Impl::Direct, 1, &routes, &WeirOpts::default()).unwrap();
        probe(&mut p, &bench.idle_open).unwrap();
        let b = idle_memory(&p, &bench.idle_open, 300).unwrap();
        assert!(b.is_finite());
        assert_eq!(bench.idle_open.get(), 0, "every idle connection closed");
        // Two clients that never read, for each segment size: the backend's
        // bytes pile up in its send queue and in the clients' receive queues
        // (seen here as the "proxy recv" side, since there is no proxy in
        // between), and only the run's own route is counted.
        for seg in [Segments::Ethernet, Segments::Loopback] {
            let port = seg.port(&p.routes);
            let c =
                load::connect_many(port, 2, 10, || 0, Duration::from_secs(10), seg.client_mss())
                    .unwrap();
            let other = match seg {
                Segments::Ethernet => Segments::Loopback,
                Segments::Loopback => Segments::Ethernet,
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut q = Queues::default();
            while Instant::now() < deadline {
                q = Queues::read(0, port);
                if q.backend_send > 0 && q.proxy_recv > 0 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            assert!(q.backend_send > 0 && q.proxy_recv > 0, "{seg:?}: {q:?}");
            let o = Queues::read(0, other.port(&p.routes));
            assert_eq!(o.backend_send + o.proxy_recv, 0, "{other:?}: {o:?}");
            drop(c);
            bench
                .slow_open
                .wait("slow closed", Duration::from_secs(10), |n| n == 0)
                .unwrap();
        }
    }

    #[test]
    fn plans_hold_the_headline_slow_run() {
        for quick in [true, false] {
            let p = Plan::new(quick);
            assert!(
                p.slow_runs.contains(&(p.slow_conns, Segments::Ethernet)),
                "{p:?}"
            );
            assert!(p.slow_runs.iter().any(|r| r.1 == Segments::Loopback));
        }
        assert_eq!(Segments::Ethernet.json(), "1448");
        assert_eq!(Segments::Loopback.client_mss(), None);
    }

    #[test]
    fn cpu_cost_per_operation_and_its_format() {
        // 0.45 s of CPU over 100,000 keep-alive requests: 4.5 us each.
        let c = cpu_per_op("rps", 0.45, 100_000).unwrap();
        assert!((c - 4.5).abs() < 1e-9);
        assert_eq!(fmt_cpu("rps", c), "4.5 us/req");
        // 0.7 s over 5 GB: 140 ms per GB.
        let g = cpu_per_op("gbps_8", 0.7, 5_000_000_000).unwrap();
        assert!((g - 140.0).abs() < 1e-9);
        assert_eq!(fmt_cpu("gbps_8", g), "140 ms/GB");
        let u = cpu_per_op("udp_dps", 0.17, 200_000).unwrap();
        assert_eq!(fmt_cpu("udp_dps", u), "0.85 us/dgram");
        assert_eq!(fmt_cpu("cps", 21.04), "21.0 us/conn");
        assert_eq!(cpu_per_op("cps", 1.0, 0), None, "nothing done");
        assert_eq!(cpu_per_op("cps", -0.01, 10), None, "went backwards");
        assert_eq!(cpu_per_op("cps", f64::NAN, 10), None);
        for t in TESTS {
            assert!(
                !cpu_unit(t).is_empty() && cpu_op_name(t) != "operation",
                "{t}"
            );
        }
    }

    #[test]
    fn proxy_json_rows_keep_their_keys_and_add_the_cpu_cost() {
        let row = |imp, cpu_per_op| Row {
            imp,
            workers: 1,
            test: "rps",
            value: 1000.0,
            p99_ms: Some(0.5),
            cpu_per_op,
        };
        let v = proxy_json(&[row(Impl::Weir, Some(4.5)), row(Impl::Direct, None)]);
        assert_eq!(
            v[0],
            json!({"impl": "weir", "workers": 1, "test": "rps", "value": 1000.0,
                   "p99_ms": 0.5, "cpu_per_op": 4.5, "cpu_unit": "us/req"})
        );
        assert_eq!(v[1]["cpu_per_op"], Value::Null);
        assert_eq!(v[1]["impl"], "direct");
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), Some(2.0));
        assert_eq!(median([4.0, 1.0, 2.0, 3.0].into_iter()), Some(2.5));
        assert_eq!(median(std::iter::empty()), None);
    }

    #[test]
    #[ignore = "needs haproxy and nginx installed (scripts/install-peers.sh)"]
    fn idle_memory_through_peers() {
        for imp in [Impl::Haproxy, Impl::Nginx] {
            let b = idle_through(imp, 1_000);
            // Both hold at least a socket's worth of state and far less than a buffer pair.
            assert!(
                b > 100.0 && b < 64_000.0,
                "{}: {b} bytes per idle connection",
                imp.name()
            );
        }
    }
}

//! Row b of `weir-bench packet`: TCP connections per second (wrk with
//! `Connection: close` against nginx on both backends) and bulk TCP (iperf3,
//! 1 and 8 streams), through every implementation of row a on the same
//! topology ([`super::topo`]).
//!
//! Services: `VIP:80` (HTTP, round robin over nginx on both backends) and
//! `VIP_BULK:5201` (iperf3 on b1 only). iperf3 matches the streams of one
//! test to its control connection by a cookie, so all 9 connections of a
//! `-P 8` test must reach the same server; with one client every
//! persistence scheme (weir's `persistence`, kube-proxy's ClientIP affinity)
//! sends them all to one backend anyway, so the bulk service simply has one.
//! A second VIP lets the kernel row route the HTTP VIP over both backends
//! (ECMP, layer-4 hash) and the bulk VIP to b1.
//!
//! Backend setup common to all rows: both VIPs on the backends' loopback
//! (the kernel row and dr deliver to them), `arp_ignore = 1` and
//! `arp_announce = 2` so the backends never answer ARP for them, and a
//! default route via weir's namespace (nat, the kernel row and nft-dnat need
//! replies to come back through it). dr and the direct calibration add an
//! on-link route to the client so replies go straight to it.
//!
//! CPU per operation (per connection; per GB moved) is the forwarding
//! side's, measured as row a does: the machine's irq + softirq time over
//! the run minus its idle rate just before, minus what the `direct`
//! calibration (wrk/iperf3 straight to b1, no forwarder) says the endpoints'
//! own TCP receive processing costs in softirq per operation, plus the weir
//! process's CPU (user + system) on weir rows. Not counted: the user and
//! system time of wrk, nginx and iperf3 (their syscalls, TCP send paths and
//! copies), which no forwarder changes per operation and which the other
//! engineers' builds on the same cores would swamp; and the part of the
//! kernel's forwarding that runs in process context outside softirq (on veth
//! almost none: a veth transmit hands the frame to the peer's NAPI, which
//! runs as softirq). The endpoints' softirq share is subtracted per
//! operation, so a forwarder that makes TCP retransmit or send more, smaller
//! segments is charged for that. Implementations alternate round by round,
//! so load from other processes hits every row alike.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;

use super::topo::{
    BACKENDS, CLIENT, MAC_BACKENDS, MAC_CLIENT, Topo, VIP, WEIR_BACKEND_SIDE, WEIR_CLIENT_SIDE, ip,
    nft_apply, run as sh, sysctl,
};
use super::{Impl, softirq_seconds, start_weir, weir_cli};
use crate::proxy::sys::Server;
use crate::report::{Table, ratio};

/// The bulk (iperf3) service's virtual address.
pub(crate) const VIP_BULK: &str = "10.99.1.101";
pub(crate) const HTTP_PORT: u16 = 80;
const IPERF_PORT: u16 = 5201;
/// wrk's threads and connections: two threads for two cores.
const WRK_THREADS: u32 = 2;
const WRK_CONNS: u32 = 32;

/// What one row measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Test {
    /// wrk, `Connection: close`: one connection per request.
    Cps,
    /// iperf3 with this many streams.
    Iperf(u32),
}

impl Test {
    const ALL: [Test; 3] = [Test::Cps, Test::Iperf(1), Test::Iperf(8)];
}

/// One timed run.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    secs: f64,
    /// Connections (Cps) or bytes received (Iperf).
    ops: u64,
    /// wrk's socket errors and non-2xx answers; iperf3's retransmits.
    errors: u64,
    soft_s: f64,
    idle_soft_s: f64,
    weir_cpu_s: f64,
}

impl Sample {
    fn add(&mut self, o: &Sample) {
        self.secs += o.secs;
        self.ops += o.ops;
        self.errors += o.errors;
        self.soft_s += o.soft_s;
        self.idle_soft_s += o.idle_soft_s;
        self.weir_cpu_s += o.weir_cpu_s;
    }

    /// Endpoint softirq seconds per op, from the direct calibration.
    fn endpoint_per_op(&self) -> f64 {
        if self.ops == 0 {
            return 0.0;
        }
        (self.soft_s - self.idle_soft_s).max(0.0) / self.ops as f64
    }

    /// Forwarding CPU seconds per op: softirq minus the idle rate minus the
    /// endpoints' share, plus weir's own. `None` when nothing was done or
    /// when the softirq share came out below the idle and calibration
    /// baselines: other load (another engineer's packet bench) moved them
    /// more than this row's forwarding did, so there is no figure.
    fn forwarding_per_op(&self, endpoint_per_op: f64) -> Option<f64> {
        if self.ops == 0 {
            return None;
        }
        let soft = self.soft_s - self.idle_soft_s - endpoint_per_op * self.ops as f64;
        if soft < 0.0 {
            return None;
        }
        Some((soft + self.weir_cpu_s) / self.ops as f64)
    }
}

/// Row b: every implementation of row a (and the direct calibration), round
/// by round; prints the two tables and returns `{"cps": [...], "iperf3": [...]}`.
pub(crate) fn tcp_rows(
    topo: &Topo,
    bin: &Path,
    dir: &Path,
    quick: bool,
) -> Result<serde_json::Value> {
    for (tool, arg, pkg) in [
        ("wrk", "-v", "wrk"),
        ("iperf3", "-v", "iperf3"),
        ("nginx", "-v", "nginx"),
    ] {
        if Command::new(tool).arg(arg).output().is_err() {
            bail!("needs {tool} (Debian package {pkg})");
        }
    }
    let (rounds, secs) = if quick { (1, 2u32) } else { (2, 6u32) };
    println!(
        "### TCP: wrk -t{WRK_THREADS} -c{WRK_CONNS} (Connection: close) against nginx on both \
         backends; iperf3 -P 1 and -P 8 to b1; {rounds} round(s) of {secs} s each\n"
    );
    let mut ends =
        Endpoints::start(topo, dir).context("starting nginx and iperf3 on the backends")?;
    let impls = Impl::all();
    let mut sums = vec![[Sample::default(); 3]; impls.len()];
    for round in 0..rounds {
        for (i, &imp) in impls.iter().enumerate() {
            topo.set_queues(imp.workers().max(1))?;
            let setup = TcpSetup::new(topo, bin, dir, imp)
                .with_context(|| format!("{} (round {})", imp.name(), round + 1))?;
            for (t, &test) in Test::ALL.iter().enumerate() {
                let s = one_run(topo, &setup, &mut ends, test, secs)
                    .with_context(|| format!("{} {test:?} (round {})", imp.name(), round + 1))?;
                eprintln!(
                    "  round {} {} {test:?}: {} ops in {:.1} s, {} errors, {:.2} softirq s (idle {:.2}), {:.2} weir s",
                    round + 1,
                    imp.name(),
                    s.ops,
                    s.secs,
                    s.errors,
                    s.soft_s,
                    s.idle_soft_s,
                    s.weir_cpu_s
                );
                sums[i][t].add(&s);
            }
            let counters = setup.counters()?;
            if !counters.is_empty() {
                eprintln!("    weir's packet counters: {counters}");
            }
        }
    }
    drop(ends);
    let mut cps = Vec::new();
    let mut iperf = Vec::new();
    for (t, test) in Test::ALL.iter().enumerate() {
        let col: Vec<Sample> = sums.iter().map(|s| s[t]).collect();
        let rows = table(&impls, &col, *test);
        match test {
            Test::Cps => cps = rows,
            Test::Iperf(_) => iperf.extend(rows),
        }
    }
    Ok(json!({ "cps": cps, "iperf3": iperf }))
}

/// Prints one test's table; its JSON rows.
fn table(impls: &[Impl], col: &[Sample], test: Test) -> Vec<serde_json::Value> {
    let endpoint = col[0].endpoint_per_op();
    // Rate (conn/s or Gbit/s) and forwarding CPU per op for each row.
    let figs: Vec<(f64, Option<f64>)> = col
        .iter()
        .map(|s| {
            let rate = match test {
                Test::Cps => s.ops as f64 / s.secs.max(1e-9),
                Test::Iperf(_) => s.ops as f64 * 8.0 / 1e9 / s.secs.max(1e-9),
            };
            (rate, s.forwarding_per_op(endpoint))
        })
        .collect();
    let nft = impls.iter().position(|&i| i == Impl::NftDnat);
    let (nft_rate, nft_cpu) = nft.map_or((0.0, None), |n| figs[n]);
    let (what, unit, errors, cpu_unit, scale) = match test {
        Test::Cps => ("TCP connections/s", "conn/s", "errors", "CPU-µs/conn", 1e6),
        // Seconds per byte to seconds per GB.
        Test::Iperf(_) => ("iperf3", "Gbit/s", "retransmits", "CPU-s/GB", 1e9),
    };
    match test {
        Test::Cps => println!("#### {what}\n"),
        Test::Iperf(n) => println!("#### {what}, {n} stream(s)\n"),
    }
    let mut t = Table::new([
        "impl",
        "workers",
        unit,
        errors,
        &format!("{cpu_unit} (forwarding)"),
        "vs nft",
        "per CPU vs nft",
    ]);
    let mut out = Vec::new();
    for ((imp, s), (rate, cpu)) in impls.iter().zip(col).zip(&figs) {
        let cal = *imp == Impl::Direct;
        let vs = if cal {
            "-".into()
        } else {
            ratio(*rate, nft_rate)
        };
        let per_cpu = match (nft_cpu, cpu) {
            (Some(n), Some(c)) if !cal => ratio(n, *c),
            _ => "-".into(),
        };
        let rate_s = match test {
            Test::Cps => format!("{rate:.0}"),
            Test::Iperf(_) => format!("{rate:.2}"),
        };
        t.row([
            imp.name(),
            imp.workers().to_string(),
            rate_s,
            s.errors.to_string(),
            match cpu {
                _ if cal => "(calibration)".into(),
                Some(c) => format!("{:.3}", c * scale),
                None => "-".into(),
            },
            vs,
            per_cpu,
        ]);
        let mut row = json!({
            "impl": imp.name(),
            "workers": imp.workers(),
            "value": rate,
            "unit": unit,
            "cpu_per_op": cpu.map(|c| c * scale),
            "cpu_unit": cpu_unit,
            "ratio": (!cal && nft_rate > 0.0).then(|| rate / nft_rate),
            "ratio_per_cpu": match (nft_cpu, cpu) {
                (Some(n), Some(c)) if !cal && *c > 0.0 => Some(n / c),
                _ => None,
            },
            "errors": s.errors,
        });
        if let Test::Iperf(n) = test {
            row["streams"] = json!(n);
        }
        out.push(row);
    }
    t.print();
    let e = match test {
        Test::Cps => format!("{:.3} CPU-µs of softirq per connection", endpoint * 1e6),
        Test::Iperf(_) => format!("{:.3} CPU-s of softirq per GB", endpoint * 1e9),
    };
    println!(
        "endpoints (direct calibration): {e}; \"-\" CPU: softirq below the idle and \
         calibration baselines (other load on the machine), no figure\n"
    );
    out
}

/// Idle baseline, then the test for `secs`, bounded by `timeout`.
fn one_run(
    topo: &Topo,
    setup: &TcpSetup,
    ends: &mut Endpoints,
    test: Test,
    secs: u32,
) -> Result<Sample> {
    // Let the previous run's closing connections and queued frames settle
    // first: measured right after a run, the "idle" softirq read up to 0.7
    // of a core.
    std::thread::sleep(Duration::from_millis(500));
    let b0 = softirq_seconds()?;
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    let idle_rate = (softirq_seconds()? - b0) / t0.elapsed().as_secs_f64();
    let direct = setup.imp == Impl::Direct;
    let (http, bulk) = if direct {
        (BACKENDS[0], BACKENDS[0])
    } else {
        (VIP, VIP_BULK)
    };
    let cl = topo.ns("cl");
    let limit = (secs + 15).to_string();
    let weir0 = setup.weir_cpu();
    let soft0 = softirq_seconds()?;
    let t = Instant::now();
    let (ops, errors) = match test {
        Test::Cps => {
            let out = sh(&[
                "timeout",
                &limit,
                "ip",
                "netns",
                "exec",
                &cl,
                "wrk",
                &format!("-t{WRK_THREADS}"),
                &format!("-c{WRK_CONNS}"),
                &format!("-d{secs}s"),
                "--timeout",
                "2s",
                "-H",
                "Connection: close",
                &format!("http://{http}:{HTTP_PORT}/"),
            ])?;
            parse_wrk(&out).with_context(|| format!("wrk's output:\n{out}"))?
        }
        Test::Iperf(n) => {
            let out = iperf3(&cl, bulk, n, secs, &limit, ends)?;
            parse_iperf3(&out).with_context(|| format!("iperf3's output:\n{out}"))?
        }
    };
    let elapsed = t.elapsed().as_secs_f64();
    let soft = softirq_seconds()? - soft0;
    let weir_cpu = setup.weir_cpu() - weir0;
    if ops == 0 {
        bail!("nothing got through");
    }
    // Wall time including the tool's start (a few ms, alike for every row).
    Ok(Sample {
        secs: elapsed,
        ops,
        errors,
        soft_s: soft,
        idle_soft_s: idle_rate * elapsed,
        weir_cpu_s: weir_cpu,
    })
}

/// iperf3 client; the server may still be finishing the previous test, so a
/// few bounded tries.
fn iperf3(
    cl: &str,
    to: &str,
    streams: u32,
    secs: u32,
    limit: &str,
    ends: &mut Endpoints,
) -> Result<String> {
    let mut last = String::new();
    for _ in 0..10 {
        ends.check()?;
        match sh(&[
            "timeout",
            limit,
            "ip",
            "netns",
            "exec",
            cl,
            "iperf3",
            "-c",
            to,
            "-p",
            &IPERF_PORT.to_string(),
            "-t",
            &secs.to_string(),
            "-P",
            &streams.to_string(),
            "-J",
        ]) {
            Ok(out) => return Ok(out),
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    bail!("iperf3 -c {to} -P {streams}: {last}")
}

/// Requests (= connections with `Connection: close`) and errors (socket
/// errors plus non-2xx answers) from wrk's report.
fn parse_wrk(out: &str) -> Option<(u64, u64)> {
    let requests = out.lines().find_map(|l| {
        l.trim()
            .split_once(" requests in ")
            .and_then(|(n, _)| n.trim().parse::<u64>().ok())
    })?;
    let mut errors = 0;
    for l in out.lines().map(str::trim) {
        if let Some(rest) = l.strip_prefix("Socket errors:") {
            // "connect 0, read 3, write 0, timeout 1"
            for part in rest.split(',') {
                errors += part
                    .split_whitespace()
                    .nth(1)
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        } else if let Some(rest) = l.strip_prefix("Non-2xx or 3xx responses:") {
            errors += rest.trim().parse::<u64>().unwrap_or(0);
        }
    }
    Some((requests, errors))
}

/// Bytes received and retransmits from `iperf3 -J`.
fn parse_iperf3(json: &str) -> Option<(u64, u64)> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let end = v.get("end")?;
    let bytes = end.get("sum_received")?.get("bytes")?.as_u64()?;
    let retr = end
        .get("sum_sent")
        .and_then(|s| s.get("retransmits"))
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0);
    Some((bytes, retr))
}

/// nginx on both backends and `iperf3 -s` on b1; stopped on drop (their
/// process trees killed by [`Server`]'s drop). The addresses and routes it
/// adds stay (`replace`, so a second start, the synflood row's after row b's,
/// finds them in place).
pub(crate) struct Endpoints {
    servers: Vec<Server>,
}

impl Endpoints {
    pub(crate) fn start(topo: &Topo, dir: &Path) -> Result<Self> {
        let mut ends = Endpoints {
            servers: Vec::new(),
        };
        // The client reaches the bulk VIP through weir's namespace too.
        let cl = topo.ns("cl");
        ip(&format!(
            "-n {cl} route replace {VIP_BULK}/32 via {WEIR_CLIENT_SIDE}"
        ))?;
        for (i, b) in ["b1", "b2"].iter().enumerate() {
            let ns = topo.ns(b);
            for vip in [VIP, VIP_BULK] {
                ip(&format!("-n {ns} addr replace {vip}/32 dev lo"))?;
            }
            for k in ["all", "eth0"] {
                sysctl(&ns, &format!("net.ipv4.conf.{k}.arp_ignore"), "1")?;
                sysctl(&ns, &format!("net.ipv4.conf.{k}.arp_announce"), "2")?;
            }
            ip(&format!(
                "-n {ns} route replace default via {WEIR_BACKEND_SIDE}"
            ))?;
            let d = dir.join(format!("nginx-{b}"));
            std::fs::create_dir_all(&d)?;
            std::fs::write(d.join("index.html"), format!("{b}\n"))?;
            let p = d.display();
            let conf = d.join("nginx.conf");
            std::fs::write(
                &conf,
                format!(
                    "daemon off; master_process off; worker_processes 1; pid {p}/nginx.pid;\n\
                     error_log {p}/error.log;\nevents {{ worker_connections 1024; }}\n\
                     http {{ access_log off; client_body_temp_path {p}/body; proxy_temp_path {p}/proxy;\n\
                     fastcgi_temp_path {p}/fcgi; uwsgi_temp_path {p}/uwsgi; scgi_temp_path {p}/scgi;\n\
                     server {{ listen {HTTP_PORT} backlog=4096; root {p}; }} }}\n"
                ),
            )?;
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", &ns, "nginx", "-c"]).arg(&conf);
            ends.servers
                .push(Server::spawn("nginx", cmd, tempfile::tempdir()?)?);
            if i == 0 {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", &ns, "iperf3", "-s", "-p"])
                    .arg(IPERF_PORT.to_string());
                ends.servers
                    .push(Server::spawn("iperf3", cmd, tempfile::tempdir()?)?);
            }
            // Ready when it answers on its own address (bounded).
            let url = format!("http://{}:{HTTP_PORT}/", BACKENDS[i]);
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                ends.check()?;
                let ok = sh(&[
                    "ip",
                    "netns",
                    "exec",
                    &ns,
                    "curl",
                    "-s",
                    "--max-time",
                    "1",
                    &url,
                ])
                .is_ok_and(|body| body.trim() == *b);
                if ok {
                    break;
                }
                if Instant::now() > deadline {
                    bail!("nginx in {b} not answering {url} within 10 s");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(ends)
    }

    /// Fails, with its log, if a server has exited.
    pub(crate) fn check(&mut self) -> Result<()> {
        for s in &mut self.servers {
            s.check_alive()?;
        }
        Ok(())
    }
}

/// One implementation's state for the TCP services, undone on drop.
struct TcpSetup<'a> {
    topo: &'a Topo,
    imp: Impl,
    weir: Option<(Server, std::path::PathBuf)>,
}

impl<'a> TcpSetup<'a> {
    fn new(topo: &'a Topo, bin: &Path, dir: &Path, imp: Impl) -> Result<Self> {
        let mut s = TcpSetup {
            topo,
            imp,
            weir: None,
        };
        let w = topo.ns("lb");
        match imp {
            Impl::Direct => {
                s.direct_return(true)?;
                let cl = topo.ns("cl");
                ip(&format!("-n {cl} route add {}/32 dev eth0", BACKENDS[0]))?;
                ip(&format!(
                    "-n {cl} neigh replace {} lladdr {} dev eth0 nud permanent",
                    BACKENDS[0], MAC_BACKENDS[0]
                ))?;
            }
            Impl::Kernel => {
                sysctl(&w, "net.ipv4.ip_forward", "1")?;
                sysctl(&w, "net.ipv4.fib_multipath_hash_policy", "1")?;
                ip(&format!(
                    "-n {w} route add {VIP}/32 nexthop via {} nexthop via {}",
                    BACKENDS[0], BACKENDS[1]
                ))?;
                ip(&format!(
                    "-n {w} route add {VIP_BULK}/32 via {}",
                    BACKENDS[0]
                ))?;
            }
            Impl::NftDnat => {
                sysctl(&w, "net.ipv4.ip_forward", "1")?;
                nft_apply(&w, &kube_proxy_tcp_ruleset())?;
            }
            Impl::Weir(method, workers) => {
                if method == "dr" {
                    s.direct_return(true)?;
                }
                let cfg = write_conf(dir, Some((method, workers)))?;
                s.weir = Some((start_weir(topo, bin, dir, &cfg)?, cfg));
            }
            Impl::WeirProxy => {
                for v in [VIP, VIP_BULK] {
                    ip(&format!("-n {w} addr add {v}/32 dev lb0"))?;
                }
                let cfg = write_conf(dir, None)?;
                s.weir = Some((start_weir(topo, bin, dir, &cfg)?, cfg));
            }
        }
        Ok(s)
    }

    /// Backends answer the client on the shared segment, not through weir.
    fn direct_return(&self, on: bool) -> Result<()> {
        for b in ["b1", "b2"] {
            let ns = self.topo.ns(b);
            if on {
                ip(&format!("-n {ns} route add 10.98.0.0/24 dev eth0"))?;
                ip(&format!(
                    "-n {ns} neigh replace {CLIENT} lladdr {MAC_CLIENT} dev eth0 nud permanent"
                ))?;
            } else {
                let _ = ip(&format!("-n {ns} route del 10.98.0.0/24 dev eth0"));
            }
        }
        Ok(())
    }

    fn weir_cpu(&self) -> f64 {
        self.weir.as_ref().map_or(0.0, |(w, _)| w.cpu_seconds())
    }

    /// weir's packet counters (packet rows), to say where frames went.
    fn counters(&self) -> Result<String> {
        if let Some((_, cfg)) = &self.weir
            && let Impl::Weir(..) = self.imp
        {
            let out = weir_cli(cfg, &["stats", "--json"])?;
            let v: serde_json::Value = serde_json::from_str(&out).context("weir stats --json")?;
            return Ok(v["global"]["packet"].to_string());
        }
        Ok(String::new())
    }
}

impl Drop for TcpSetup<'_> {
    fn drop(&mut self) {
        self.weir = None;
        let w = self.topo.ns("lb");
        match self.imp {
            Impl::Direct => {
                self.direct_return(false).ok();
                let cl = self.topo.ns("cl");
                let _ = ip(&format!("-n {cl} route del {}/32", BACKENDS[0]));
            }
            Impl::Kernel => {
                let _ = ip(&format!("-n {w} route del {VIP}/32"));
                let _ = ip(&format!("-n {w} route del {VIP_BULK}/32"));
                let _ = sysctl(&w, "net.ipv4.ip_forward", "0");
            }
            Impl::NftDnat => {
                let _ = sh(&["ip", "netns", "exec", &w, "nft", "flush", "ruleset"]);
                let _ = sh(&["ip", "netns", "exec", &w, "conntrack", "-F"]);
                let _ = sysctl(&w, "net.ipv4.ip_forward", "0");
            }
            Impl::Weir("dr", _) => {
                self.direct_return(false).ok();
            }
            Impl::WeirProxy => {
                for v in [VIP, VIP_BULK] {
                    let _ = ip(&format!("-n {w} addr del {v}/32 dev lb0"));
                }
            }
            Impl::Weir(..) => {}
        }
    }
}

/// weir's config: the HTTP service over both backends, the bulk service to b1.
fn write_conf(dir: &Path, packet: Option<(&str, u32)>) -> Result<std::path::PathBuf> {
    let cfg = dir.join("weir-tcp.toml");
    let (mut s, forward) = super::conf_head(dir, packet);
    s.push_str(&format!(
        "\n[[service]]\nname = \"http\"\nprotocol = \"tcp\"\nlisten = \"{VIP}:{HTTP_PORT}\"\n\
         forward = \"{forward}\"\nscheduler = \"rr\"\n"
    ));
    for b in BACKENDS {
        s.push_str(&format!(
            "  [[service.backend]]\n  address = \"{b}:{HTTP_PORT}\"\n"
        ));
    }
    s.push_str(&format!(
        "\n[[service]]\nname = \"bulk\"\nprotocol = \"tcp\"\nlisten = \"{VIP_BULK}:{IPERF_PORT}\"\n\
         forward = \"{forward}\"\n  [[service.backend]]\n  address = \"{}:{IPERF_PORT}\"\n",
        BACKENDS[0]
    ));
    std::fs::write(&cfg, s)?;
    Ok(cfg)
}

/// kube-proxy's nftables mode for the two TCP services: the `service-ips`
/// verdict map, `numgen random mod 2` over the HTTP endpoints, one DNAT
/// endpoint for the bulk service (conntrack).
fn kube_proxy_tcp_ruleset() -> String {
    let mut eps = String::new();
    let mut vmap = Vec::new();
    for (i, b) in BACKENDS.iter().enumerate() {
        eps.push_str(&format!(
            "chain endpoint-http-{i} {{\n meta l4proto tcp dnat to {b}:{HTTP_PORT}\n}}\n"
        ));
        vmap.push(format!("{i} : goto endpoint-http-{i}"));
    }
    eps.push_str(&format!(
        "chain endpoint-bulk-0 {{\n meta l4proto tcp dnat to {}:{IPERF_PORT}\n}}\n",
        BACKENDS[0]
    ));
    format!(
        "table ip kube-proxy {{\n\
         map service-ips {{\n type ipv4_addr . inet_proto . inet_service : verdict\n \
         elements = {{ {VIP} . tcp . {HTTP_PORT} : goto service-http, \
         {VIP_BULK} . tcp . {IPERF_PORT} : goto service-bulk }}\n}}\n\
         chain services {{\n ip daddr . meta l4proto . th dport vmap @service-ips\n}}\n\
         chain nat-prerouting {{\n type nat hook prerouting priority dstnat; policy accept\n jump services\n}}\n\
         chain service-http {{\n numgen random mod {} vmap {{ {} }}\n}}\n\
         chain service-bulk {{\n goto endpoint-bulk-0\n}}\n{eps}}}\n",
        BACKENDS.len(),
        vmap.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_report_gives_requests_and_errors() {
        let out = "Running 2s test @ http://10.99.1.100/\n  2 threads and 32 connections\n\
                   12345 requests in 2.00s, 3.1MB read\n  Socket errors: connect 0, read 3, write 1, timeout 2\n\
                   Non-2xx or 3xx responses: 4\nRequests/sec:   6172.50\n";
        assert_eq!(parse_wrk(out), Some((12345, 10)));
        assert_eq!(parse_wrk("  7 requests in 1.00s, 1KB read\n"), Some((7, 0)));
        assert_eq!(parse_wrk("nothing"), None);
    }

    #[test]
    fn iperf3_json_gives_bytes_and_retransmits() {
        let j =
            r#"{"end":{"sum_sent":{"bytes":900,"retransmits":5},"sum_received":{"bytes":800}}}"#;
        assert_eq!(parse_iperf3(j), Some((800, 5)));
        assert_eq!(parse_iperf3(r#"{"end":{}}"#), None);
        assert_eq!(parse_iperf3("not json"), None);
    }

    #[test]
    fn forwarding_cpu_subtracts_idle_and_endpoints() {
        let cal = Sample {
            ops: 1000,
            soft_s: 1.5,
            idle_soft_s: 0.5,
            ..Sample::default()
        };
        assert!((cal.endpoint_per_op() - 1e-3).abs() < 1e-12);
        let s = Sample {
            ops: 2000,
            soft_s: 5.0,
            idle_soft_s: 1.0,
            weir_cpu_s: 2.0,
            ..Sample::default()
        };
        // (5 - 1 - 2000 * 1e-3 + 2) / 2000.
        let got = s.forwarding_per_op(1e-3).unwrap();
        assert!((got - 2e-3).abs() < 1e-12, "{got}");
        // Softirq below the baselines, or no ops: no figure.
        assert_eq!(s.forwarding_per_op(1.0), None);
        assert_eq!(Sample::default().forwarding_per_op(0.0), None);
    }

    #[test]
    fn ruleset_and_config_name_both_services() {
        let r = kube_proxy_tcp_ruleset();
        assert!(
            r.contains("10.99.1.100 . tcp . 80 : goto service-http"),
            "{r}"
        );
        assert!(
            r.contains("10.99.1.101 . tcp . 5201 : goto service-bulk"),
            "{r}"
        );
        assert!(r.contains("numgen random mod 2 vmap"), "{r}");
        let d = tempfile::tempdir().unwrap();
        let cfg =
            std::fs::read_to_string(write_conf(d.path(), Some(("fnat", 2))).unwrap()).unwrap();
        assert!(cfg.contains("local_addresses = [\"10.99.0.1\"]"), "{cfg}");
        assert!(cfg.contains("listen = \"10.99.1.101:5201\""), "{cfg}");
        assert_eq!(cfg.matches("forward = \"fnat\"").count(), 2, "{cfg}");
    }
}

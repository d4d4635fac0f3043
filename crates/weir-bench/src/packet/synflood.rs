//! Row `synflood` of `weir-bench packet`: real clients connecting through a
//! spoofed SYN flood, weir's packet mode (nat, a tenant capped at
//! [`LIMIT`] flows, with its early drop of embryonic flows) against
//! nftables DNAT with conntrack capped at the same number.
//!
//! The topology and backends are row b's ([`super::topo`], nginx on both
//! backends). The flood: trafgen in the client's namespace sending TCP SYNs
//! to `VIP:80` from random addresses in [`SPOOFED`] and random ports, at a
//! few rates (trafgen's `-b`; the rate actually sent is read from the
//! client's interface counter). The backends answer every SYN that reaches
//! them through weir's namespace (their default route), where [`SPOOFED`] is
//! a blackhole route: no SYN-ACK reaches anyone who would reset it, so every
//! spoofed flow stays embryonic until it times out or is dropped early.
//!
//! The real clients: one curl process making [`Probe::count`] requests
//! (`Connection: close`, so each is a new connection), [`Probe::parallel`]
//! at a time, each with `--connect-timeout 2` (a SYN retransmitted once);
//! a request succeeds when nginx answers 200. Connect latency is curl's
//! `time_connect`, of the requests that succeeded.
//!
//! The peer's cap: `net.netfilter.nf_conntrack_max` is read-only outside
//! the initial namespace on the kernels this was written on (6.18), so the
//! only per-namespace cap is a `ct count over LIMIT` rule on new
//! connections, which drops the SYN at the cap and never ends an entry
//! (conntrack's own early drop of unassured entries acts only when the
//! whole table, `nf_conntrack_max`, is full). The uncapped peer is measured
//! too: that early drop never triggers at these rates, so it shows a
//! conntrack without a cap.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;

use super::tcp::{Endpoints, HTTP_PORT};
use super::topo::{BACKENDS, MAC_CLIENT, MAC_WEIR, Topo, VIP, ip, nft_apply, run as sh, sysctl};
use super::{start_weir, stop_group, weir_cli};
use crate::proxy::sys::Server;
use crate::report::Table;

/// The tenant's `max_connections`, and the peer's `ct count` cap.
const LIMIT: u32 = 1000;
/// Where the spoofed SYNs come from (`10.200.x.y`); blackholed in weir's
/// namespace.
const SPOOFED: &str = "10.200.0.0/16";
/// Environment variable naming a weir binary built without the early drop,
/// measured as one more implementation when set.
pub(crate) const CONTRAST_ENV: &str = "WEIR_SYNFLOOD_CONTRAST_BIN";

/// One forwarder under the flood.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Peer {
    /// weir nat, one worker; the binary's label.
    Weir(std::path::PathBuf, &'static str),
    /// nftables DNAT, new connections capped by `ct count` or not.
    Nft { capped: bool },
}

impl Peer {
    fn name(&self) -> String {
        match self {
            Peer::Weir(_, label) => format!("weir nat{label}"),
            Peer::Nft { capped: true } => format!("nft DNAT, ct count over {LIMIT}"),
            Peer::Nft { capped: false } => "nft DNAT, no cap".into(),
        }
    }
}

/// The real clients' share of one run.
#[derive(Debug, Clone, Copy)]
struct Probe {
    count: u32,
    parallel: u32,
}

/// What one run measured.
#[derive(Debug, Default)]
struct Outcome {
    /// SYN/s sent over the run (0: no flood).
    rate_sent: f64,
    attempts: u64,
    ok: u64,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    /// weir's `early_drops`, its tenant's `refused`, and its packet drops.
    early_drops: Option<u64>,
    refused: Option<u64>,
    dropped: Option<serde_json::Value>,
}

pub(crate) fn run(topo: &Topo, bin: &Path, dir: &Path, quick: bool) -> Result<serde_json::Value> {
    for (tool, pkg) in [("curl", "curl"), ("conntrack", "conntrack")] {
        if Command::new(tool).arg("--version").output().is_err() {
            bail!("needs {tool} (Debian package {pkg})");
        }
    }
    // Requested rates; 0 is the baseline with no flood, `None` trafgen
    // unthrottled (what the machine can send).
    let rates: &[Option<u32>] = if quick {
        &[Some(0), Some(10_000), None]
    } else {
        &[Some(0), Some(10_000), Some(50_000), None]
    };
    let probe = if quick {
        Probe {
            count: 100,
            parallel: 10,
        }
    } else {
        Probe {
            count: 500,
            parallel: 20,
        }
    };
    let mut peers = vec![
        Peer::Weir(bin.to_path_buf(), ""),
        Peer::Nft { capped: true },
        Peer::Nft { capped: false },
    ];
    if let Some(p) = std::env::var_os(CONTRAST_ENV) {
        peers.insert(1, Peer::Weir(p.into(), ", no early drop"));
    }
    println!(
        "### Spoofed SYN flood: {} requests through curl ({} at a time, Connection: close, \
         --connect-timeout 2) during a flood of SYNs from {SPOOFED}; weir's tenant and the \
         nft cap at {LIMIT} flows\n",
        probe.count, probe.parallel
    );
    let mut ends = Endpoints::start(topo, dir).context("starting nginx on the backends")?;
    let lb = topo.ns("lb");
    ip(&format!("-n {lb} route replace blackhole {SPOOFED}"))?;
    topo.set_queues(1)?;
    let mut results = Vec::new();
    for &rate in rates {
        for peer in &peers {
            let setup = FloodSetup::new(topo, dir, peer)
                .with_context(|| format!("setting up {}", peer.name()))?;
            let o = one_run(topo, dir, &setup, &mut ends, rate, probe)
                .with_context(|| format!("{} at {rate:?} SYN/s", peer.name()))?;
            eprintln!(
                "  {} flood {:.0} SYN/s: {}/{} ok, early drops {:?}, refused {:?}, dropped {}",
                peer.name(),
                o.rate_sent,
                o.ok,
                o.attempts,
                o.early_drops,
                o.refused,
                o.dropped.clone().unwrap_or_default()
            );
            results.push((peer.name(), rate, o));
        }
    }
    let _ = ip(&format!("-n {lb} route del blackhole {SPOOFED}"));
    drop(ends);
    let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    let count = |v: Option<u64>| v.map_or("-".into(), |v| v.to_string());
    let mut t = Table::new([
        "impl",
        "flood asked (SYN/s)",
        "flood sent (SYN/s)",
        "success",
        "connect p50 ms",
        "connect p99 ms",
        "weir early drops",
        "weir refused",
    ]);
    let mut out = Vec::new();
    for (name, rate, o) in &results {
        let asked = match rate {
            Some(0) => "none".into(),
            Some(r) => r.to_string(),
            None => "unthrottled".into(),
        };
        let share = o.ok as f64 / o.attempts.max(1) as f64;
        t.row([
            name.clone(),
            asked,
            format!("{:.0}", o.rate_sent),
            format!("{:.1}% ({}/{})", share * 100.0, o.ok, o.attempts),
            ms(o.p50_ms),
            ms(o.p99_ms),
            count(o.early_drops),
            count(o.refused),
        ]);
        out.push(json!({
            "impl": name,
            "rate_asked": rate,
            "rate_sent": o.rate_sent.round(),
            "attempts": o.attempts,
            "ok": o.ok,
            "success": share,
            "connect_p50_ms": o.p50_ms,
            "connect_p99_ms": o.p99_ms,
            "early_drops": o.early_drops,
            "refused": o.refused,
            "dropped": o.dropped,
        }));
    }
    t.print();
    Ok(serde_json::Value::Array(out))
}

/// Starts the flood (unless `rate` is 0), lets it fill the places, runs the
/// probe, stops the flood; weir's counters after.
fn one_run(
    topo: &Topo,
    dir: &Path,
    setup: &FloodSetup,
    ends: &mut Endpoints,
    rate: Option<u32>,
    probe: Probe,
) -> Result<Outcome> {
    ends.check()?;
    let cl = topo.ns("cl");
    let sent0 = topo.sent()?;
    let t = Instant::now();
    let mut flood = Flood(None);
    if rate != Some(0) {
        let conf = dir.join("synflood.cfg");
        std::fs::write(
            &conf,
            trafgen_syn_conf(MAC_WEIR, MAC_CLIENT, VIP, HTTP_PORT)?,
        )?;
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &cl, "trafgen", "--in"])
            .arg(&conf)
            .args(["--out", "eth0", "--cpus", "1"]);
        if let Some(r) = rate {
            cmd.args(["-b", &format!("{r}pps")]);
        }
        let child = std::os::unix::process::CommandExt::process_group(
            cmd.stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null()),
            0,
        )
        .spawn()
        .context("starting trafgen")?;
        flood.0 = Some(child);
        // Long enough for the slowest rate to fill the places many times
        // over (10,000 SYN/s: 1,000 places in 0.1 s).
        std::thread::sleep(Duration::from_secs(1));
        if let Some(Ok(Some(st))) = flood.0.as_mut().map(std::process::Child::try_wait) {
            bail!("trafgen exited early ({st})");
        }
    }
    let result = curl_probe(&cl, probe);
    let elapsed = t.elapsed().as_secs_f64();
    let sent = topo.sent()? - sent0;
    drop(flood);
    let (attempts, ok, mut connect) = result?;
    let mut o = Outcome {
        // The probe's own packets are a few per request: left in.
        rate_sent: if rate == Some(0) {
            0.0
        } else {
            sent as f64 / elapsed
        },
        attempts,
        ok,
        ..Outcome::default()
    };
    connect.sort_by(f64::total_cmp);
    o.p50_ms = percentile(&connect, 0.50).map(|s| s * 1e3);
    o.p99_ms = percentile(&connect, 0.99).map(|s| s * 1e3);
    if let Some((_, cfg)) = &setup.weir {
        let v: serde_json::Value = serde_json::from_str(&weir_cli(cfg, &["stats", "--json"])?)
            .context("weir stats --json")?;
        let before = &setup.stats0;
        let delta = |now: &serde_json::Value, then: &serde_json::Value| {
            now.as_u64()
                .map(|n| n.saturating_sub(then.as_u64().unwrap_or(0)))
        };
        o.early_drops = delta(
            &v["global"]["packet"]["early_drops"],
            &before["global"]["packet"]["early_drops"],
        );
        o.refused = delta(
            &v["tenants"][0]["refused"],
            &before["tenants"][0]["refused"],
        );
        o.dropped = Some(v["global"]["packet"]["dropped"].clone());
    }
    Ok(o)
}

/// The flood's trafgen, stopped with its senders on drop (also when a run
/// fails half way).
struct Flood(Option<std::process::Child>);

impl Drop for Flood {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            stop_group(c);
        }
    }
}

/// Runs the probe in the client's namespace: (attempts, successes, connect
/// seconds of the successes). Bounded: each request by curl's
/// `--max-time`, the whole by `timeout`.
fn curl_probe(cl: &str, probe: Probe) -> Result<(u64, u64, Vec<f64>)> {
    let limit = (u64::from(probe.count / probe.parallel.max(1)) * 3 + 10).to_string();
    let url = format!("http://{VIP}:{HTTP_PORT}/?[1-{}]", probe.count);
    let out = Command::new("timeout")
        .args([&limit, "ip", "netns", "exec", cl, "curl", "-s"])
        .args(["--parallel", "--parallel-max", &probe.parallel.to_string()])
        .args(["--connect-timeout", "2", "--max-time", "3"])
        .args(["-H", "Connection: close", "-o", "/dev/null"])
        .args(["-w", "%{time_connect} %{http_code}\\n"])
        .arg(&url)
        .output()
        .context("running curl")?;
    // curl exits non-zero when a transfer failed: that is what is counted.
    let text = String::from_utf8_lossy(&out.stdout);
    let parsed = parse_curl(&text);
    if parsed.0 == 0 {
        bail!(
            "curl reported no transfer: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(parsed)
}

/// `time_connect http_code` lines: (transfers, 200s, connect seconds of the 200s).
fn parse_curl(text: &str) -> (u64, u64, Vec<f64>) {
    let (mut n, mut ok, mut connect) = (0, 0, Vec::new());
    for l in text.lines() {
        let mut w = l.split_whitespace();
        let (Some(t), Some(code)) = (w.next(), w.next()) else {
            continue;
        };
        let Ok(t) = t.parse::<f64>() else {
            continue;
        };
        n += 1;
        if code == "200" {
            ok += 1;
            connect.push(t);
        }
    }
    (n, ok, connect)
}

/// The value at quantile `q` of sorted `v` (nearest rank).
fn percentile(v: &[f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// A 54-byte TCP SYN from a random address in [`SPOOFED`] and a random port
/// to `daddr:dport`, as raw bytes with trafgen's checksum functions (its
/// protocol header syntax randomises a whole address, not part of one).
fn trafgen_syn_conf(dmac: &str, smac: &str, daddr: &str, dport: u16) -> Result<String> {
    let mac = |m: &str| -> String {
        m.split(':')
            .map(|b| format!("0x{b}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let d: std::net::Ipv4Addr = daddr.parse().context("the VIP")?;
    let [a, b, c, e] = d.octets();
    Ok(format!(
        "{{\n  {}, {}, c16(0x0800),\n  \
         0x45, 0, c16(40), drnd(2), 0x40, 0, 64, 6, csumip(14, 33),\n  \
         10, 200, drnd(2), {a}, {b}, {c}, {e},\n  \
         drnd(2), c16({dport}), drnd(4), c32(0), c16(0x5002), c16(64240),\n  \
         csumtcp(14, 34), c16(0)\n}}\n",
        mac(dmac),
        mac(smac)
    ))
}

/// One [`Peer`] set up in weir's namespace; undone on drop.
struct FloodSetup<'a> {
    topo: &'a Topo,
    nft: bool,
    weir: Option<(Server, std::path::PathBuf)>,
    /// weir's stats when it was up, to count this run's share.
    stats0: serde_json::Value,
}

impl<'a> FloodSetup<'a> {
    fn new(topo: &'a Topo, dir: &Path, peer: &Peer) -> Result<Self> {
        let lb = topo.ns("lb");
        let mut s = FloodSetup {
            topo,
            nft: false,
            weir: None,
            stats0: serde_json::Value::Null,
        };
        match peer {
            Peer::Weir(bin, _) => {
                let cfg = write_conf(dir)?;
                let server = start_weir(topo, bin, dir, &cfg)?;
                s.stats0 = serde_json::from_str(&weir_cli(&cfg, &["stats", "--json"])?)
                    .context("weir stats --json")?;
                s.weir = Some((server, cfg));
            }
            Peer::Nft { capped } => {
                s.nft = true;
                // A run starts with no entry left from the one before (a
                // spoofed SYN's stays for SYN_SENT's 120 s).
                sh(&["ip", "netns", "exec", &lb, "conntrack", "-F"])?;
                sysctl(&lb, "net.ipv4.ip_forward", "1")?;
                nft_apply(&lb, &nft_ruleset(*capped))?;
            }
        }
        Ok(s)
    }
}

impl Drop for FloodSetup<'_> {
    fn drop(&mut self) {
        self.weir = None;
        if self.nft {
            let lb = self.topo.ns("lb");
            let _ = sh(&["ip", "netns", "exec", &lb, "nft", "flush", "ruleset"]);
            let _ = sh(&["ip", "netns", "exec", &lb, "conntrack", "-F"]);
            let _ = sysctl(&lb, "net.ipv4.ip_forward", "0");
        }
    }
}

/// weir: one nat worker, the HTTP service in a tenant capped at [`LIMIT`].
fn write_conf(dir: &Path) -> Result<std::path::PathBuf> {
    let cfg = dir.join("weir-synflood.toml");
    let (mut s, forward) = super::conf_head(dir, Some(("nat", 1)));
    s.push_str(&format!(
        "\n[[tenant]]\nname = \"default\"\nmax_connections = {LIMIT}\n\n\
         [[service]]\nname = \"http\"\nprotocol = \"tcp\"\nlisten = \"{VIP}:{HTTP_PORT}\"\n\
         forward = \"{forward}\"\nscheduler = \"rr\"\n"
    ));
    for b in BACKENDS {
        s.push_str(&format!(
            "  [[service.backend]]\n  address = \"{b}:{HTTP_PORT}\"\n"
        ));
    }
    std::fs::write(&cfg, s)?;
    Ok(cfg)
}

/// kube-proxy's shape for the HTTP service (random endpoint, DNAT), with a
/// filter chain before it that drops a new connection past [`LIMIT`] when
/// `capped`.
fn nft_ruleset(capped: bool) -> String {
    let cap = if capped {
        format!(
            "chain cap {{\n type filter hook prerouting priority dstnat - 10; policy accept\n \
             ct state new ct count over {LIMIT} counter drop\n}}\n"
        )
    } else {
        String::new()
    };
    let mut eps = String::new();
    let mut vmap = Vec::new();
    for (i, b) in BACKENDS.iter().enumerate() {
        eps.push_str(&format!(
            "chain endpoint-{i} {{\n meta l4proto tcp dnat to {b}:{HTTP_PORT}\n}}\n"
        ));
        vmap.push(format!("{i} : goto endpoint-{i}"));
    }
    format!(
        "table ip kube-proxy {{\n{cap}\
         chain nat-prerouting {{\n type nat hook prerouting priority dstnat; policy accept\n \
         ip daddr {VIP} tcp dport {HTTP_PORT} goto service-http\n}}\n\
         chain service-http {{\n numgen random mod {} vmap {{ {} }}\n}}\n{eps}}}\n",
        BACKENDS.len(),
        vmap.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curl_lines_give_attempts_successes_and_connect_times() {
        let text = "0.000120 200\n0.000000 000\n1.003000 200\nb1\ngarbage line\n";
        let (n, ok, c) = parse_curl(text);
        assert_eq!((n, ok), (3, 2));
        assert_eq!(c, vec![0.000120, 1.003]);
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(50.0));
        assert_eq!(percentile(&v, 0.99), Some(99.0));
        assert_eq!(percentile(&[7.0], 0.99), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn syn_frame_is_spoofed_from_the_blackholed_range() {
        let c = trafgen_syn_conf(MAC_WEIR, MAC_CLIENT, VIP, 80).unwrap();
        assert!(c.contains("10, 200, drnd(2), 10, 99, 1, 100"), "{c}");
        assert!(c.contains("c16(80)"), "{c}");
        assert!(c.contains("c16(0x5002)"), "{c}");
        assert!(
            c.starts_with("{\n  0x02, 0x00, 0x00, 0x00, 0x00, 0x01,"),
            "{c}"
        );
    }

    #[test]
    fn the_capped_ruleset_counts_new_connections() {
        assert!(nft_ruleset(true).contains("ct state new ct count over 1000 counter drop"));
        assert!(!nft_ruleset(false).contains("ct count"));
    }
}

//! Rows `synflood` and `synflood-tenants` of `weir-bench packet`: real
//! clients connecting through a spoofed SYN flood.
//!
//! `synflood` ([`Shape::OneTenant`]): weir's packet mode (nat, a tenant
//! capped at [`LIMIT`] flows, with its early drop of embryonic flows)
//! against nftables DNAT with conntrack capped at the same number.
//!
//! `synflood-tenants` ([`Shape::TwoTenants`]): weir alone, two tenants with
//! no limit of their own and the daemon's `max_connections` at [`LIMIT`];
//! the flood is against tenant `a`'s VIP, the real clients are tenant `b`'s.
//! It shows where a place at the daemon's limit comes from: the flooded
//! tenant's flows (7996c88), or, in a weir built before that (given as
//! [`BEFORE_ENV`]), only the refused SYN's own tenant's, which for `b` under
//! a flood against `a` are none.
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
//! The real clients (at `VIP:80`, or [`VIP_B`]`:80` in `synflood-tenants`):
//! one curl process making [`Probe::count`] requests
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

use super::tcp::{Endpoints, HTTP_PORT, VIP_BULK};
use super::topo::{BACKENDS, MAC_CLIENT, MAC_WEIR, Topo, VIP, ip, nft_apply, run as sh, sysctl};
use super::{start_weir, stop_group, weir_cli};
use crate::proxy::sys::Server;
use crate::report::Table;

/// The tenant's `max_connections` (the daemon's in `synflood-tenants`), and
/// the peer's `ct count` cap.
const LIMIT: u32 = 1000;
/// Where the spoofed SYNs come from (`10.200.x.y`); blackholed in weir's
/// namespace.
const SPOOFED: &str = "10.200.0.0/16";
/// Tenant `b`'s VIP in `synflood-tenants`: row b's bulk VIP, which
/// [`Endpoints::start`] already routes from the client through weir.
const VIP_B: &str = VIP_BULK;
/// Environment variable naming a weir binary built without the early drop,
/// measured as one more implementation of `synflood` when set.
pub(crate) const CONTRAST_ENV: &str = "WEIR_SYNFLOOD_CONTRAST_BIN";
/// What [`CONTRAST_ENV`]'s rows are called (default: its path).
pub(crate) const CONTRAST_LABEL_ENV: &str = "WEIR_SYNFLOOD_CONTRAST_LABEL";
/// Environment variable naming a weir binary built from 7996c88^ (a place
/// at the daemon's limit comes only from the SYN's own tenant), measured as
/// one more implementation of `synflood-tenants` when set.
pub(crate) const BEFORE_ENV: &str = "WEIR_SYNFLOOD_TENANTS_BEFORE_BIN";
/// What [`BEFORE_ENV`]'s rows are called (default: its path).
pub(crate) const BEFORE_LABEL_ENV: &str = "WEIR_SYNFLOOD_TENANTS_BEFORE_LABEL";

/// Which of the two rows a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// `synflood`: one tenant, `default`, capped at [`LIMIT`]; flooded and
    /// probed at `VIP`.
    OneTenant,
    /// `synflood-tenants`: tenants `a` (flooded at `VIP`) and `b` (probed at
    /// [`VIP_B`]), no limit of their own, the daemon's `max_connections` at
    /// [`LIMIT`].
    TwoTenants,
}

impl Shape {
    /// The tenants whose `refused` a run reports, in column order.
    fn tenants(self) -> &'static [&'static str] {
        match self {
            Shape::OneTenant => &["default"],
            Shape::TwoTenants => &["a", "b"],
        }
    }

    /// Where the real clients connect.
    fn probe_vip(self) -> &'static str {
        match self {
            Shape::OneTenant => VIP,
            Shape::TwoTenants => VIP_B,
        }
    }

    /// Requested rates; 0 is the baseline with no flood, `None` trafgen
    /// unthrottled (what the machine can send). `synflood-tenants` leaves
    /// unthrottled out: there the one worker, not the place, is what fails
    /// (row synflood's runs), and that is not what it is about.
    fn rates(self, quick: bool) -> &'static [Option<u32>] {
        match (self, quick) {
            (Shape::OneTenant, true) => &[Some(0), Some(10_000), None],
            (Shape::OneTenant, false) => &[Some(0), Some(10_000), Some(50_000), None],
            (Shape::TwoTenants, true) => &[Some(0), Some(10_000)],
            (Shape::TwoTenants, false) => &[Some(0), Some(10_000), Some(50_000)],
        }
    }
}

/// One forwarder under the flood.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Peer {
    /// weir nat, one worker; the binary, and what its rows add to the name.
    Weir(std::path::PathBuf, String),
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

    /// The forwarders a row races: weir (and the contrast build when its
    /// variable is set), and for `synflood` nft capped and not (nft has no
    /// tenants to tell apart). `env` reads the environment
    /// (`std::env::var_os`).
    ///
    /// A contrast build is named by its label variable or else its path,
    /// never by what the variable is meant for: the bench cannot tell what
    /// was built, and a row named "before 7996c88" once showed a 3b804d7.
    fn all(
        shape: Shape,
        bin: &Path,
        env: impl Fn(&str) -> Option<std::ffi::OsString>,
    ) -> Vec<Peer> {
        let mut peers = vec![Peer::Weir(bin.to_path_buf(), String::new())];
        let (bin_env, label_env) = match shape {
            Shape::OneTenant => (CONTRAST_ENV, CONTRAST_LABEL_ENV),
            Shape::TwoTenants => (BEFORE_ENV, BEFORE_LABEL_ENV),
        };
        if let Some(p) = env(bin_env) {
            let label = env(label_env)
                .filter(|l| !l.is_empty())
                .unwrap_or_else(|| p.clone());
            peers.push(Peer::Weir(
                p.into(),
                format!(", {}", label.to_string_lossy()),
            ));
        }
        if shape == Shape::OneTenant {
            peers.push(Peer::Nft { capped: true });
            peers.push(Peer::Nft { capped: false });
        }
        peers
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
    /// weir's `early_drops`, its packet drops, and the `refused` of each of
    /// [`Shape::tenants`] (empty for nft).
    early_drops: Option<u64>,
    refused: Vec<Option<u64>>,
    dropped: Option<serde_json::Value>,
}

pub(crate) fn run(
    topo: &Topo,
    bin: &Path,
    dir: &Path,
    quick: bool,
    shape: Shape,
) -> Result<serde_json::Value> {
    for (tool, pkg) in [("curl", "curl"), ("conntrack", "conntrack")] {
        if Command::new(tool).arg("--version").output().is_err() {
            bail!("needs {tool} (Debian package {pkg})");
        }
    }
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
    let peers = Peer::all(shape, bin, |k| std::env::var_os(k));
    match shape {
        Shape::OneTenant => println!(
            "### Spoofed SYN flood: {} requests through curl ({} at a time, Connection: close, \
             --connect-timeout 2) during a flood of SYNs from {SPOOFED}; weir's tenant and the \
             nft cap at {LIMIT} flows\n",
            probe.count, probe.parallel
        ),
        Shape::TwoTenants => println!(
            "### Spoofed SYN flood against tenant a ({VIP}), real clients of tenant b ({VIP_B}): \
             {} requests through curl ({} at a time, Connection: close, --connect-timeout 2); \
             weir's [daemon] max_connections = {LIMIT}, no tenant limit\n",
            probe.count, probe.parallel
        ),
    }
    let mut ends = Endpoints::start(topo, dir).context("starting nginx on the backends")?;
    let lb = topo.ns("lb");
    ip(&format!("-n {lb} route replace blackhole {SPOOFED}"))?;
    topo.set_queues(1)?;
    let mut results = Vec::new();
    for &rate in shape.rates(quick) {
        for peer in &peers {
            let setup = FloodSetup::new(topo, dir, peer, shape)
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
    let mut t = Table::new(header(shape));
    let mut out = Vec::new();
    for (name, rate, o) in &results {
        t.row(cells(name, *rate, o));
        out.push(row_json(shape, name, *rate, o));
    }
    t.print();
    Ok(serde_json::Value::Array(out))
}

/// The table's columns: one `refused` per tenant of `shape`.
fn header(shape: Shape) -> Vec<String> {
    let mut h: Vec<String> = [
        "impl",
        "flood asked (SYN/s)",
        "flood sent (SYN/s)",
        "success",
        "connect p50 ms",
        "connect p99 ms",
        "weir early drops",
    ]
    .map(String::from)
    .into();
    match shape {
        Shape::OneTenant => h.push("weir refused".into()),
        Shape::TwoTenants => {
            for t in shape.tenants() {
                h.push(format!("weir {t} refused"));
            }
        }
    }
    h
}

/// One run's row, in [`header`]'s columns.
fn cells(name: &str, rate: Option<u32>, o: &Outcome) -> Vec<String> {
    let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    let count = |v: Option<u64>| v.map_or("-".into(), |v| v.to_string());
    let asked = match rate {
        Some(0) => "none".into(),
        Some(r) => r.to_string(),
        None => "unthrottled".into(),
    };
    let mut c = vec![
        name.to_string(),
        asked,
        format!("{:.0}", o.rate_sent),
        format!("{:.1}% ({}/{})", share(o) * 100.0, o.ok, o.attempts),
        ms(o.p50_ms),
        ms(o.p99_ms),
        count(o.early_drops),
    ];
    if o.refused.is_empty() {
        // nft: no tenants; a dash in the (one) refused column.
        c.push("-".into());
    }
    c.extend(o.refused.iter().map(|&r| count(r)));
    c
}

fn share(o: &Outcome) -> f64 {
    o.ok as f64 / o.attempts.max(1) as f64
}

/// One run's JSON: `synflood[]` has `refused` as the tenant's count,
/// `synflood_tenants[]` as `{a, b}`.
fn row_json(shape: Shape, name: &str, rate: Option<u32>, o: &Outcome) -> serde_json::Value {
    let refused = match shape {
        Shape::OneTenant => json!(o.refused.first().copied().flatten()),
        Shape::TwoTenants => shape
            .tenants()
            .iter()
            .zip(&o.refused)
            .map(|(t, r)| ((*t).to_string(), json!(r)))
            .collect::<serde_json::Map<_, _>>()
            .into(),
    };
    json!({
        "impl": name,
        "rate_asked": rate,
        "rate_sent": o.rate_sent.round(),
        "attempts": o.attempts,
        "ok": o.ok,
        "success": share(o),
        "connect_p50_ms": o.p50_ms,
        "connect_p99_ms": o.p99_ms,
        "early_drops": o.early_drops,
        "refused": refused,
        "dropped": o.dropped,
    })
}

/// Starts the flood against `VIP` (unless `rate` is 0), lets it fill the
/// places, runs the probe against the setup's [`Shape::probe_vip`], stops
/// the flood; weir's counters after.
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
    let result = curl_probe(&cl, setup.shape.probe_vip(), probe);
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
        o.refused = setup
            .shape
            .tenants()
            .iter()
            .map(|&t| delta(&tenant(&v, t)["refused"], &tenant(before, t)["refused"]))
            .collect();
        o.dropped = Some(v["global"]["packet"]["dropped"].clone());
    }
    Ok(o)
}

/// Tenant `name`'s entry in `weir stats --json` (null if absent); the
/// entries name their tenant as `tenant`.
fn tenant<'v>(stats: &'v serde_json::Value, name: &str) -> &'v serde_json::Value {
    stats["tenants"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["tenant"] == name))
        .unwrap_or(&serde_json::Value::Null)
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

/// Runs the probe in the client's namespace against `vip`: (attempts, successes, connect
/// seconds of the successes). Bounded: each request by curl's
/// `--max-time`, the whole by `timeout`.
fn curl_probe(cl: &str, vip: &str, probe: Probe) -> Result<(u64, u64, Vec<f64>)> {
    let out = curl_command(cl, vip, probe)
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

/// The probe's curl, under a `timeout` for the whole.
fn curl_command(cl: &str, vip: &str, probe: Probe) -> Command {
    let limit = (u64::from(probe.count / probe.parallel.max(1)) * 3 + 10).to_string();
    let url = format!("http://{vip}:{HTTP_PORT}/?[1-{}]", probe.count);
    let mut c = Command::new("timeout");
    c.args([&limit, "ip", "netns", "exec", cl, "curl", "-s"])
        .args(["--parallel", "--parallel-max", &probe.parallel.to_string()])
        // A new connection for each transfer at once, not a wait to see
        // whether one still being opened can multiplex (curl's default
        // with --parallel): a connect that timed out would fail every
        // transfer waiting on it, counting one lost SYN many times.
        .arg("--parallel-immediate")
        .args(["--connect-timeout", "2", "--max-time", "3"])
        .args(["-H", "Connection: close", "-o", "/dev/null"])
        .args(["-w", "%{time_connect} %{http_code}\\n"])
        .arg(&url);
    c
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
    shape: Shape,
    nft: bool,
    weir: Option<(Server, std::path::PathBuf)>,
    /// weir's stats when it was up, to count this run's share.
    stats0: serde_json::Value,
}

impl<'a> FloodSetup<'a> {
    fn new(topo: &'a Topo, dir: &Path, peer: &Peer, shape: Shape) -> Result<Self> {
        let lb = topo.ns("lb");
        let mut s = FloodSetup {
            topo,
            shape,
            nft: false,
            weir: None,
            stats0: serde_json::Value::Null,
        };
        match peer {
            Peer::Weir(bin, _) => {
                let cfg = dir.join("weir-synflood.toml");
                let (head, forward) = super::conf_head(dir, Some(("nat", 1)));
                std::fs::write(&cfg, weir_conf(head, forward, shape))?;
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

/// weir's config after [`super::conf_head`]'s `head` (one nat worker):
/// [`Shape::OneTenant`], the HTTP service in tenant `default` capped at
/// [`LIMIT`]; [`Shape::TwoTenants`], an HTTP service for each of tenants `a`
/// (`VIP`) and `b` ([`VIP_B`]) over the same backends, neither capped, and
/// the daemon's `max_connections` at [`LIMIT`], so only that limit binds.
fn weir_conf(head: String, forward: &str, shape: Shape) -> String {
    let service = |tenant: &str, vip: &str| {
        let mut s = format!(
            "\n[[service]]\ntenant = \"{tenant}\"\nname = \"http\"\nprotocol = \"tcp\"\n\
             listen = \"{vip}:{HTTP_PORT}\"\nforward = \"{forward}\"\nscheduler = \"rr\"\n"
        );
        for b in BACKENDS {
            s.push_str(&format!(
                "  [[service.backend]]\n  address = \"{b}:{HTTP_PORT}\"\n"
            ));
        }
        s
    };
    match shape {
        Shape::OneTenant => {
            let mut s = head;
            s.push_str(&format!(
                "\n[[tenant]]\nname = \"default\"\nmax_connections = {LIMIT}\n"
            ));
            s.push_str(&service("default", VIP));
            s
        }
        Shape::TwoTenants => {
            // The daemon's limit goes in the head's `[daemon]` table (a
            // TOML table cannot be opened twice).
            let mut s = head.replacen(
                "[daemon]\n",
                &format!("[daemon]\nmax_connections = {LIMIT}\n"),
                1,
            );
            for (t, vip) in [("a", VIP), ("b", VIP_B)] {
                s.push_str(&format!("\n[[tenant]]\nname = \"{t}\"\n"));
                s.push_str(&service(t, vip));
            }
            s
        }
    }
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

    /// Every request is its own connection, opened at once: curl's
    /// `--parallel` otherwise holds a transfer to the same host until a
    /// connection still being opened shows whether it can multiplex, so
    /// under a flood one connect that times out failed every transfer
    /// waiting on it, and few SYNs were sent for many failed requests.
    #[test]
    fn the_probe_opens_each_connection_at_once() {
        let probe = Probe {
            count: 500,
            parallel: 20,
        };
        let c = curl_command("wb1-cl", VIP_B, probe);
        let args: Vec<_> = c.get_args().map(|a| a.to_string_lossy()).collect();
        assert_eq!(args[0], "85", "timeout: 25 rounds of 3 s, and 10 s");
        assert!(args.iter().any(|a| a == "--parallel-immediate"), "{args:?}");
        assert_eq!(args.last().unwrap(), "http://10.99.1.101:80/?[1-500]");
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

    fn conf(shape: Shape) -> toml::Value {
        let (head, forward) = crate::packet::conf_head(Path::new("/d"), Some(("nat", 1)));
        let text = weir_conf(head, forward, shape);
        toml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    #[test]
    fn one_tenant_caps_the_tenant_not_the_daemon() {
        let c = conf(Shape::OneTenant);
        assert!(c["daemon"].get("max_connections").is_none());
        let t = c["tenant"].as_array().unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t[0]["name"].as_str(), Some("default"));
        assert_eq!(t[0]["max_connections"].as_integer(), Some(1000));
        let s = c["service"].as_array().unwrap();
        assert_eq!(s[0]["listen"].as_str(), Some("10.99.1.100:80"));
        assert_eq!(s[0]["backend"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn two_tenants_share_only_the_daemons_limit() {
        let c = conf(Shape::TwoTenants);
        assert_eq!(c["daemon"]["max_connections"].as_integer(), Some(1000));
        // The head's other daemon key is still there.
        assert_eq!(c["daemon"]["workers"].as_integer(), Some(1));
        let t = c["tenant"].as_array().unwrap();
        let names: Vec<_> = t.iter().map(|t| t["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["a", "b"]);
        assert!(
            t.iter().all(|t| t.get("max_connections").is_none()),
            "{t:?}"
        );
        let s = c["service"].as_array().unwrap();
        let at: Vec<_> = s
            .iter()
            .map(|s| (s["tenant"].as_str().unwrap(), s["listen"].as_str().unwrap()))
            .collect();
        assert_eq!(at, [("a", "10.99.1.100:80"), ("b", "10.99.1.101:80")]);
        for s in s {
            assert_eq!(s["forward"].as_str(), Some("nat"));
            assert_eq!(s["backend"].as_array().unwrap().len(), 2);
        }
        // The flood goes to a's VIP, the probe to b's.
        assert_eq!(Shape::TwoTenants.probe_vip(), "10.99.1.101");
        assert!(
            trafgen_syn_conf(MAC_WEIR, MAC_CLIENT, VIP, 80)
                .unwrap()
                .contains("10, 99, 1, 100")
        );
    }

    #[test]
    fn an_extra_weir_is_named_by_its_label_or_path_not_a_commit() {
        let bin = Path::new("/usr/local/bin/weir");
        let names = |shape, vars: &[(&str, &str)]| -> Vec<String> {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            Peer::all(shape, bin, |k| {
                vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.into())
            })
            .iter()
            .filter(|p| matches!(p, Peer::Weir(..)))
            .map(Peer::name)
            .collect()
        };
        assert_eq!(names(Shape::TwoTenants, &[]), ["weir nat"]);
        // Any build can be given: the row says which, not what it should be.
        assert_eq!(
            names(Shape::TwoTenants, &[(BEFORE_ENV, "/tmp/bins/weir-3b804d7")]),
            ["weir nat", "weir nat, /tmp/bins/weir-3b804d7"]
        );
        assert_eq!(
            names(
                Shape::TwoTenants,
                &[(BEFORE_ENV, "/tmp/w"), (BEFORE_LABEL_ENV, "3b804d7")]
            ),
            ["weir nat", "weir nat, 3b804d7"]
        );
        assert_eq!(
            names(Shape::OneTenant, &[(CONTRAST_ENV, "/tmp/bins/nodrop")]),
            ["weir nat", "weir nat, /tmp/bins/nodrop"]
        );
        assert_eq!(
            names(
                Shape::OneTenant,
                &[
                    (CONTRAST_ENV, "/tmp/w"),
                    (CONTRAST_LABEL_ENV, "no early drop")
                ]
            ),
            ["weir nat", "weir nat, no early drop"]
        );
        // Each row reads only its own variable.
        assert_eq!(
            names(Shape::OneTenant, &[(BEFORE_ENV, "/tmp/w")]),
            ["weir nat"]
        );
    }

    #[test]
    fn a_tenants_figures_are_found_by_name() {
        // The shape of `GET /v1/stats`' tenants, in the daemon's order.
        let v = json!({"tenants": [
            {"tenant": "b", "active_conns": 0, "refused": 50},
            {"tenant": "a", "active_conns": 1000, "refused": 3},
        ]});
        assert_eq!(tenant(&v, "a")["refused"], json!(3));
        assert_eq!(tenant(&v, "b")["refused"], json!(50));
        assert!(tenant(&v, "c").is_null());
        assert!(tenant(&json!({}), "a").is_null());
    }

    #[test]
    fn two_tenants_skip_the_unthrottled_rate() {
        assert_eq!(Shape::TwoTenants.rates(true), [Some(0), Some(10_000)]);
        assert_eq!(
            Shape::TwoTenants.rates(false),
            [Some(0), Some(10_000), Some(50_000)]
        );
        assert_eq!(Shape::OneTenant.rates(true).last(), Some(&None));
    }

    #[test]
    fn rows_have_a_refused_column_per_tenant() {
        let o = Outcome {
            rate_sent: 10_012.4,
            attempts: 500,
            ok: 450,
            p50_ms: Some(0.12),
            p99_ms: None,
            early_drops: Some(7),
            refused: vec![Some(3), Some(50)],
            dropped: None,
        };
        let h = header(Shape::TwoTenants);
        let c = cells("weir nat, before 7996c88", Some(10_000), &o);
        assert_eq!(h.len(), c.len());
        assert_eq!(&h[7..], ["weir a refused", "weir b refused"]);
        assert_eq!(
            c[1..],
            [
                "10000",
                "10012",
                "90.0% (450/500)",
                "0.1",
                "-",
                "7",
                "3",
                "50"
            ]
        );
        let j = row_json(Shape::TwoTenants, "weir nat", None, &o);
        assert_eq!(j["refused"], json!({"a": 3, "b": 50}));
        assert_eq!(j["rate_asked"], serde_json::Value::Null);
        assert_eq!(j["success"], json!(0.9));
        // synflood keeps its one number, and a dash for nft's.
        let one = Outcome {
            refused: vec![Some(4)],
            ..Outcome::default()
        };
        assert_eq!(
            row_json(Shape::OneTenant, "weir nat", Some(0), &one)["refused"],
            json!(4)
        );
        let nft = cells("nft DNAT, no cap", Some(0), &Outcome::default());
        assert_eq!(nft.len(), header(Shape::OneTenant).len());
        assert_eq!(nft[1], "none");
        assert_eq!(nft.last().map(String::as_str), Some("-"));
    }

    #[test]
    fn the_capped_ruleset_counts_new_connections() {
        assert!(nft_ruleset(true).contains("ct state new ct count over 1000 counter drop"));
        assert!(!nft_ruleset(false).contains("ct count"));
    }
}

//! `weir-bench packet --only scale`: rows c, d and memory of issue 12 — weir
//! packet mode (nat, 1 worker) holding 10K, 1M and 10M live UDP flows.
//!
//! One daemon per flow count, two tenants with own tables: `a` (VIP
//! [`VIP_A`]) is filled and measured, `b` ([`VIP_B`]) is the neighbour.
//! Per count, in order:
//! 1. B's packets/s over [`B_FLOWS`] flows with A empty (row d, "a");
//! 2. weir's RSS, then A filled: trafgen cycles source port x source address
//!    in lockstep (2^k ports, 5^k addresses: coprime, so one period is
//!    exactly 10^k distinct tuples) until `weir stats table` shows exactly
//!    that many entries in A's table; RSS again (memory row);
//! 3. A's packets/s over the same tuples (row c): every packet hits a live
//!    flow, consecutive packets hit different flows spread over the table;
//! 4. B's packets/s with A holding its flows, idle (row d, "b");
//! 5. at the largest count, while A's traffic flows, `weir conns --json`
//!    (paged through the cursor) lists A's flows: each exactly once;
//!    at the middle and the largest count, A's UDP timeout (2 h) is then
//!    shortened to [`SHORTENED`] with `weir tenant edit`: the table retimes
//!    the flows filed under the old one, and every flow must be gone within
//!    the new timeout plus [`EXPIRY_SLACK`] (each has been idle longer than
//!    the new timeout by then);
//! 6. `weir tenant del a` is timed (O(its flows)).
//!
//! Steps 1, 3 and 4 run in rounds (3; 1 with `--quick`), each sample right
//! after a reference sample of the kernel forwarding straight to a backend,
//! and report medians of packets/s, of packets/s over the reference, and of
//! weir's own CPU per packet (see [`Rounds`]): rows c and d compare samples
//! taken minutes apart on a shared machine.
//!
//! Then, with weir stopped, the same counts through nftables DNAT
//! (kube-proxy's ruleset) with conntrack: packets/s (side view) and kernel
//! memory per entry (`/proc/meminfo` Slab growth plus the hash table).
//! Source addresses are not assigned anywhere: the sinks never reply.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;

use super::topo::{
    BACKENDS, CLIENT, MAC_BACKENDS, MAC_CLIENT, MAC_WEIR, PORT, Topo, VIP, WEIR_CLIENT_SIDE, ip,
    run as sh, sysctl,
};
use super::{
    FRAME, Sample, forwarding_cpu_per_mpkt, kube_proxy_ruleset, softirq_seconds, start_weir,
    stop_group, weir_cli,
};
use crate::proxy::sys::Server;
use crate::report::Table;

/// Tenant A's VIP is row a's; tenant B's is this one (routed to weir too).
const VIP_A: &str = VIP;
const VIP_B: &str = "10.99.1.101";
/// Tenant B's modest flow set.
const B_FLOWS: u32 = 1024;
/// First source address of the filled tuples: 10.100.0.0.
const SADDR_BASE: u32 = 0x0a64_0000;
const FIRST_SPORT: u32 = 10_000;
/// Tenant A's UDP timeout below the largest count.
const FILL_TIMEOUT: &str = "2h";
/// Tenant A's UDP timeout once its flows are held and idle, where expiry is
/// checked (the middle and the largest count).
const SHORTENED: Duration = Duration::from_secs(5);
/// The wheel's tick plus the expiry round's period, the retime pass over
/// every filed flow and the settling of each (10M flows in one daemon),
/// with margin; the measured time is reported.
const EXPIRY_SLACK: Duration = Duration::from_secs(60);

/// A trafgen frame cycling over 10^k tuples: source port over 2^k values and
/// source address over 5^k values, stepped together (coprime periods).
fn tuples_conf(dmac: &str, daddr: &str, k: u32) -> String {
    let (ports, addrs) = (2u32.pow(k), 5u32.pow(k));
    let payload = FRAME - 14 - 20 - 8;
    format!(
        "{{\n  eth(da={dmac}, sa={MAC_CLIENT}),\n  \
         ipv4(saddr=dinc({SADDR_BASE}, {}), daddr={daddr}, ttl=64),\n  \
         udp(sport=dinc({FIRST_SPORT}, {}), dport={PORT}),\n  fill(0x00, {payload})\n}}\n",
        SADDR_BASE + addrs - 1,
        FIRST_SPORT + ports - 1
    )
}

/// Tenant B's traffic: the client's address, [`B_FLOWS`] source ports.
fn b_conf() -> String {
    let payload = FRAME - 14 - 20 - 8;
    format!(
        "{{\n  eth(da={MAC_WEIR}, sa={MAC_CLIENT}),\n  ipv4(saddr={CLIENT}, daddr={VIP_B}, ttl=64),\n  \
         udp(sport=dinc({FIRST_SPORT}, {}), dport={PORT}),\n  fill(0x00, {payload})\n}}\n",
        FIRST_SPORT + B_FLOWS - 1
    )
}

fn direct_conf() -> String {
    let payload = FRAME - 14 - 20 - 8;
    format!(
        "{{\n  eth(da={}, sa={MAC_CLIENT}),\n  ipv4(saddr={CLIENT}, daddr={}, ttl=64),\n  \
         udp(sport=dinc({FIRST_SPORT}, {}), dport={PORT}),\n  fill(0x00, {payload})\n}}\n",
        MAC_BACKENDS[0],
        BACKENDS[0],
        FIRST_SPORT + B_FLOWS - 1
    )
}

/// The daemon: 1 packet worker, tenants `a` and `b` with own tables that may
/// grow to 2^24 entries, one nat service each.
fn scale_conf(dir: &Path, a_udp: &str) -> Result<PathBuf> {
    let cfg = dir.join("weir-scale.toml");
    let mut s = format!(
        "[daemon]\nworkers = 1\nown_tables_budget = {}\nmax_connections = 0\n\n\
         [admin]\nlisten = \"unix:{}/admin.sock\"\ntoken = \"weir-bench-packet-token\"\n\n\
         [packet]\ninterfaces = [\"lb0\"]\nworkers = 1\nio = \"xdp\"\n",
        16u64 << 30,
        dir.display()
    );
    for (t, vip, udp) in [("a", VIP_A, a_udp), ("b", VIP_B, FILL_TIMEOUT)] {
        s.push_str(&format!(
            "\n[[tenant]]\nname = \"{t}\"\ntable_entries = 65536\nmax_table_entries = 16777216\n\
             max_connections = 0\nmax_new_per_s = 0\n  [tenant.timeouts]\n  udp = \"{udp}\"\n\
             \n[[service]]\ntenant = \"{t}\"\nname = \"udp\"\nprotocol = \"udp\"\n\
             listen = \"{vip}:{PORT}\"\nforward = \"nat\"\nscheduler = \"rr\"\n"
        ));
        for b in BACKENDS {
            s.push_str(&format!(
                "  [[service.backend]]\n  address = \"{b}:{PORT}\"\n"
            ));
        }
    }
    std::fs::write(&cfg, s)?;
    Ok(cfg)
}

/// A running trafgen in the client namespace (its own process group).
struct Gen(std::process::Child);

impl Gen {
    fn start(topo: &Topo, conf: &Path) -> Result<Gen> {
        use std::os::unix::process::CommandExt;
        let child = Command::new("ip")
            .args(["netns", "exec", &topo.ns("cl"), "trafgen", "--in"])
            .arg(conf)
            .args(["--out", "eth0", "--cpus", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting trafgen")?;
        Ok(Gen(child))
    }

    fn alive(&mut self) -> Result<()> {
        if let Some(st) = self.0.try_wait()? {
            bail!("trafgen exited early ({st})");
        }
        Ok(())
    }
}

impl Drop for Gen {
    fn drop(&mut self) {
        stop_group(&mut self.0);
    }
}

/// Sends `conf` for `secs` and measures as row a does (see `packet.rs`).
fn timed(topo: &Topo, dir: &Path, conf: &str, secs: f64, weir: Option<&Server>) -> Result<Sample> {
    let b0 = softirq_seconds()?;
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    let idle_rate = (softirq_seconds()? - b0) / t0.elapsed().as_secs_f64();
    let path = dir.join("trafgen-scale.cfg");
    std::fs::write(&path, conf)?;
    let (sent0, del0) = (topo.sent()?, topo.delivered()?);
    let weir0 = weir.map_or(0.0, Server::cpu_seconds);
    let soft0 = softirq_seconds()?;
    let t = Instant::now();
    let mut g = Gen::start(topo, &path)?;
    let deadline = t + Duration::from_secs_f64(secs);
    while Instant::now() < deadline {
        g.alive()?;
        std::thread::sleep(Duration::from_millis(20));
    }
    let elapsed = t.elapsed().as_secs_f64();
    let soft = softirq_seconds()? - soft0;
    drop(g);
    let weir_cpu = weir.map_or(0.0, Server::cpu_seconds) - weir0;
    std::thread::sleep(Duration::from_millis(200));
    Ok(Sample {
        secs: elapsed,
        sent: topo.sent()? - sent0,
        delivered: topo.delivered()? - del0,
        soft_s: soft,
        idle_soft_s: idle_rate * elapsed,
        weir_cpu_s: weir_cpu,
    })
}

fn pps(s: &Sample) -> f64 {
    s.delivered as f64 / s.secs.max(1e-9)
}

/// Forwarding CPU per delivered packet in ns (row a's method).
fn cpu_ns(s: &Sample, gen_per_sent: f64) -> Option<f64> {
    forwarding_cpu_per_mpkt(s, gen_per_sent).map(|v| v * 1e3)
}

/// Rounds of one measurement, each right after a reference sample: the
/// kernel forwarding [`direct_conf`]'s traffic straight to a backend (weir
/// not in the path). The machine is shared: its speed drifts over the
/// minutes between the samples a row compares (before and after a fill of
/// millions of flows), and a bare packets/s ratio then measures the
/// neighbours' builds. Dividing each sample by the reference taken just
/// before it cancels that drift to first order; the median of the rounds
/// drops an outlier.
struct Rounds {
    samples: Vec<Sample>,
    /// The reference's packets/s before each sample.
    refs: Vec<f64>,
}

impl Rounds {
    fn run(
        topo: &Topo,
        dir: &Path,
        conf: &str,
        secs: f64,
        weir: &Server,
        rounds: usize,
    ) -> Result<Rounds> {
        let mut r = Rounds {
            samples: Vec::new(),
            refs: Vec::new(),
        };
        for _ in 0..rounds {
            r.refs
                .push(pps(&timed(topo, dir, &direct_conf(), secs, None)?));
            r.samples.push(timed(topo, dir, conf, secs, Some(weir))?);
        }
        Ok(r)
    }

    /// Median packets/s.
    fn pps(&self) -> f64 {
        median(self.samples.iter().map(pps))
    }

    /// Median of packets/s over the reference's packets/s.
    fn norm(&self) -> f64 {
        median(
            self.samples
                .iter()
                .zip(&self.refs)
                .map(|(s, r)| pps(s) / r.max(1.0)),
        )
    }

    /// Median weir CPU (its process's user + system time) per delivered
    /// packet, in ns: what a packet costs weir, whatever its share of the
    /// cores.
    fn weir_ns(&self) -> Option<f64> {
        let v: Vec<f64> = self
            .samples
            .iter()
            .filter(|s| s.delivered > 0)
            .map(|s| s.weir_cpu_s / s.delivered as f64 * 1e9)
            .collect();
        (!v.is_empty()).then(|| median(v.into_iter()))
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "pps": self.pps().round(),
            "norm": self.norm(),
            "weir_cpu_ns": self.weir_ns(),
            "rounds": self.samples.iter().zip(&self.refs).map(|(s, r)| json!({
                "pps": pps(s).round(), "ref_pps": r.round(),
                "weir_cpu_s": s.weir_cpu_s, "delivered": s.delivered,
            })).collect::<Vec<_>>(),
        })
    }
}

fn median(v: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = v.collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Entries in tenant `t`'s table (`weir stats table --json`).
fn table_entries(cfg: &Path, t: &str) -> Result<Option<u64>> {
    Ok(table_row(cfg, t)?.and_then(|r| r["entries"].as_u64()))
}

/// The `packet` part of `weir stats --json`: frames received, sent, flows
/// created and drops per reason, since the daemon started.
fn packet_stats(cfg: &Path) -> Result<serde_json::Value> {
    let out = weir_cli(cfg, &["stats", "--json"])?;
    let v: serde_json::Value = serde_json::from_str(&out).context("weir stats --json")?;
    packet_of(&v).context("weir stats --json has no global.packet")
}

/// The packet-mode counters in `weir stats --json`: `global.packet`.
fn packet_of(stats: &serde_json::Value) -> Option<serde_json::Value> {
    stats["global"]["packet"]
        .is_object()
        .then(|| stats["global"]["packet"].clone())
}

/// Where a fill's frames went: sent by the generator, received by weir (the
/// rest were lost before weir: the veth or the AF_XDP ring), transmitted,
/// new flows, and weir's drops per reason, all as differences over the
/// fill.
fn fill_frames(
    sent: u64,
    before: &serde_json::Value,
    after: &serde_json::Value,
) -> serde_json::Value {
    let d = |k: &str| {
        let n = |v: &serde_json::Value| v[k].as_u64().unwrap_or(0);
        n(after).saturating_sub(n(before))
    };
    let mut dropped = serde_json::Map::new();
    if let Some(m) = after["dropped"].as_object() {
        for (k, v) in m {
            let was = before["dropped"][k].as_u64().unwrap_or(0);
            let n = v.as_u64().unwrap_or(0).saturating_sub(was);
            if n > 0 {
                dropped.insert(k.clone(), json!(n));
            }
        }
    }
    json!({"sent": sent, "rx": d("rx"), "tx": d("tx"), "new_flows": d("new_flows"),
        "dropped": dropped})
}

/// Tenant `t`'s row of `weir stats table --json`.
fn table_row(cfg: &Path, t: &str) -> Result<Option<serde_json::Value>> {
    let out = weir_cli(cfg, &["stats", "table", "--json"])?;
    let v: serde_json::Value = serde_json::from_str(&out).context("weir stats table --json")?;
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .find(|r| r["tenant"] == t)
        .cloned())
}

/// A flow-table node: a 64-byte hot line (key, reply key, service, backend,
/// state, owner, use count) and a 48-byte cold part (clocks, counters, TCP
/// sequence places), in two arrays (weir-flowtable `node.rs`).
const NODE_BYTES: f64 = 112.0;
/// A bucket line of the index: eleven ways (weir-flowtable's
/// `BUCKET_WAYS`) of a one-byte tag and a `u32` node index, a header and
/// an overflow link. A nat flow takes two ways (its
/// key and its reply key).
const BUCKET_BYTES: f64 = 64.0;

/// Runs `conf` until `count()` reaches `n` (bounded by `limit`); then the
/// count must stay exactly `n` (the tuple set has exactly `n` members).
fn fill(
    topo: &Topo,
    dir: &Path,
    conf: &str,
    n: u64,
    limit: Duration,
    mut count: impl FnMut() -> Result<u64>,
) -> Result<f64> {
    let path = dir.join("trafgen-fill.cfg");
    std::fs::write(&path, conf)?;
    let t = Instant::now();
    let mut g = Gen::start(topo, &path)?;
    let mut last = 0;
    while t.elapsed() < limit {
        g.alive()?;
        last = count()?;
        if last >= n {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(g);
    let secs = t.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(300));
    let got = count()?;
    if got != n {
        bail!("filled {got} entries, expected exactly {n} (last poll {last}, {secs:.0} s)");
    }
    eprintln!("    filled {n} flows in {secs:.1} s");
    Ok(secs)
}

/// Bound on a fill of `n` flows: 10K flows/s at least, plus a minute.
fn fill_limit(n: u64) -> Duration {
    Duration::from_secs(60 + n / 10_000)
}

/// `weir conns --json --tenant a` while `conf` flows: the count and the
/// duplicate cookies (sorted and compared, cookies only in memory).
fn list_all(topo: &Topo, dir: &Path, cfg: &Path, conf: &str) -> Result<(f64, u64, u64)> {
    let path = dir.join("trafgen-list.cfg");
    std::fs::write(&path, conf)?;
    let mut g = Gen::start(topo, &path)?;
    let t = Instant::now();
    let mut child = Command::new(crate::proxy::peers::weir_bin()?)
        .args(["conns", "--json", "--tenant", "a", "--config"])
        .arg(cfg)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("weir conns")?;
    let out = child.stdout.take().context("weir conns stdout")?;
    let mut cookies = Vec::new();
    for line in std::io::BufReader::with_capacity(1 << 20, out).lines() {
        let line = line?;
        let v: serde_json::Value = serde_json::from_str(&line).context("weir conns line")?;
        let c = v["cookie"]
            .as_u64()
            .with_context(|| format!("no cookie in {line}"))?;
        cookies.push(c);
    }
    let st = child.wait()?;
    let secs = t.elapsed().as_secs_f64();
    g.alive()?;
    drop(g);
    if !st.success() {
        let mut e = String::new();
        if let Some(mut s) = child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut s, &mut e);
        }
        bail!("weir conns failed ({st}): {e}");
    }
    let listed = cookies.len() as u64;
    cookies.sort_unstable();
    let before = cookies.len();
    cookies.dedup();
    let dups = (before - cookies.len()) as u64;
    Ok((secs, listed, dups))
}

/// Polls A's table until it is empty; the seconds from the call.
fn wait_empty(cfg: &Path, limit: Duration) -> Result<f64> {
    let t = Instant::now();
    loop {
        let n = table_entries(cfg, "a")?.context("tenant a vanished")?;
        if n == 0 {
            return Ok(t.elapsed().as_secs_f64());
        }
        if t.elapsed() > limit {
            bail!("{n} flows still in tenant a's table after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn meminfo_kib(key: &str) -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")?;
    parse_meminfo(&text, key).with_context(|| format!("no {key} in /proc/meminfo"))
}

fn parse_meminfo(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
}

/// `active_objs * objsize` of slab cache `name` in `/proc/slabinfo`.
fn slab_bytes(name: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/slabinfo").ok()?;
    parse_slabinfo(&text, name)
}

fn parse_slabinfo(text: &str, name: &str) -> Option<u64> {
    let l = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))?;
    let f: Vec<u64> = l
        .split_whitespace()
        .skip(1)
        .take(3)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    Some(f.first()? * f.get(2)?)
}

pub(crate) fn run(
    c: &crate::Common,
    topo: &Topo,
    bin: &Path,
    dir: &Path,
) -> Result<serde_json::Value> {
    let ks: Vec<u32> = if c.quick {
        vec![4, 5, 6]
    } else {
        vec![4, 6, 7]
    };
    let secs = if c.quick { 3.0 } else { 8.0 };
    // Rounds per measured point of rows c and d (see [`Rounds`]).
    let rounds = if c.quick { 1 } else { 3 };
    println!("### Rows c, d, memory: weir nat (1 worker) with 10^{ks:?} live flows\n");
    topo.set_queues(1)?;
    let cl = topo.ns("cl");
    ip(&format!(
        "-n {cl} route replace {VIP_B}/32 via {WEIR_CLIENT_SIDE}"
    ))?;
    // Calibration: the generator's and sink's softirq share per sent frame.
    let cal = timed(topo, dir, &direct_conf(), secs, None)?;
    let gen_per_sent = (cal.soft_s - cal.idle_soft_s).max(0.0) / cal.sent.max(1) as f64;
    eprintln!("  calibration: {:.0} pps", pps(&cal));

    let mut pps_rows = Vec::new();
    let mut mem_rows = Vec::new();
    let mut noisy = Vec::new();
    let mut deletes = Vec::new();
    let mut expiries = Vec::new();
    let mut daemon = json!({});
    let mut failures: Vec<String> = Vec::new();
    let largest = *ks.last().unwrap_or(&4);
    // Expiry is checked at the middle and the largest count.
    let mid = ks.get(1).copied().unwrap_or(largest);
    for &k in &ks {
        let n = 10u64.pow(k);
        eprintln!("  weir, {n} flows");
        let cfg = scale_conf(dir, FILL_TIMEOUT)?;
        let mut weir = start_weir(topo, bin, dir, &cfg)?;
        let b_idle = Rounds::run(topo, dir, &b_conf(), secs, &weir, rounds)?;
        let rss0 = weir.rss();
        let (sent0, stats0) = (topo.sent()?, packet_stats(&cfg)?);
        let fill_s = fill(
            topo,
            dir,
            &tuples_conf(MAC_WEIR, VIP_A, k),
            n,
            fill_limit(n),
            || table_entries(&cfg, "a")?.context("tenant a has no table"),
        )?;
        weir.check_alive()?;
        let frames = fill_frames(topo.sent()? - sent0, &stats0, &packet_stats(&cfg)?);
        eprintln!("    fill frames: {frames}");
        let rss1 = weir.rss();
        let per_flow = rss1.saturating_sub(rss0) as f64 / n as f64;
        // Where the bytes go: the index's head lines as `weir stats table`
        // counts them (overflow lines not included), the nodes by size.
        let buckets = table_row(&cfg, "a")?
            .and_then(|r| r["buckets"].as_u64())
            .unwrap_or(0);
        let a = Rounds::run(
            topo,
            dir,
            &tuples_conf(MAC_WEIR, VIP_A, k),
            secs,
            &weir,
            rounds,
        )?;
        let a_stopped = Instant::now();
        let b_full = Rounds::run(topo, dir, &b_conf(), secs, &weir, rounds)?;
        let held = table_entries(&cfg, "a")?.unwrap_or(0);
        if held != n {
            bail!("tenant a holds {held} flows after the runs, expected {n}");
        }
        eprintln!(
            "    A {:.0} pps ({:.3} of the reference), B idle-A {:.0} pps ({:.3}), B full-A {:.0} pps ({:.3}), {per_flow:.0} B/flow",
            a.pps(),
            a.norm(),
            b_idle.pps(),
            b_idle.norm(),
            b_full.pps(),
            b_full.norm()
        );
        let mut row = a.json();
        row["flows"] = json!(n);
        row["fill_secs"] = json!(fill_s);
        row["fill_frames"] = frames;
        pps_rows.push(row);
        mem_rows.push((n, per_flow, rss0, rss1, buckets));
        noisy.push(
            json!({"a_flows": n, "a_empty": b_idle.json(), "a_full": b_full.json(),
            "b_pps_a_empty": b_idle.pps().round(), "b_pps_a_full": b_full.pps().round(),
            "ratio": b_full.pps() / b_idle.pps().max(1.0),
            "norm_ratio": b_full.norm() / b_idle.norm().max(1e-9),
            "cpu_ratio": match (b_idle.weir_ns(), b_full.weir_ns()) {
                (Some(i), Some(f)) => Some(i / f),
                _ => None,
            }}),
        );
        if k == largest {
            let conf = tuples_conf(MAC_WEIR, VIP_A, k);
            let (list_s, listed, dups) = list_all(topo, dir, &cfg, &conf)?;
            eprintln!("    listed {listed} in {list_s:.1} s, {dups} duplicates");
            if listed != n || dups != 0 {
                failures.push(format!(
                    "weir conns listed {listed} flows ({dups} duplicates), table holds {n}"
                ));
            }
            daemon["flows"] = json!(n);
            daemon["list_secs"] = json!(list_s);
            daemon["listed"] = json!(listed);
            daemon["duplicates"] = json!(dups);
        }
        let mut held_at_delete = n;
        if k == mid || k == largest {
            // Every flow has been idle longer than SHORTENED since A's
            // traffic stopped: once the edit lands, all must go within the
            // new timeout plus the slack (the edit reaches flows filed
            // under the 2 h timeout through the table's retime pass).
            let idle = a_stopped.elapsed();
            let shortened = format!("udp={}s", SHORTENED.as_secs());
            weir_cli(&cfg, &["tenant", "edit", "a", "--timeout", &shortened])?;
            let exp = wait_empty(&cfg, SHORTENED + EXPIRY_SLACK);
            match &exp {
                Ok(_) => held_at_delete = 0,
                Err(e) => failures.push(format!("expiry of {n} flows: {e:#}")),
            }
            let exp_s = exp.as_ref().ok().copied();
            eprintln!(
                "    {n} flows (idle {:.0} s) expired {} after the udp timeout went from {FILL_TIMEOUT} to {SHORTENED:?}",
                idle.as_secs_f64(),
                exp_s.map_or("not all".to_string(), |s| format!("{s:.1} s"))
            );
            expiries.push(json!({"flows": n, "idle_secs": idle.as_secs_f64(),
                "udp_timeout_secs": SHORTENED.as_secs(), "secs": exp_s}));
        }
        let t = Instant::now();
        weir_cli(&cfg, &["tenant", "del", "a"])?;
        let del_s = t.elapsed().as_secs_f64();
        if table_entries(&cfg, "a")?.is_some() {
            bail!("tenant a still listed after its deletion");
        }
        weir.check_alive()?;
        eprintln!("    tenant a ({held_at_delete} flows) deleted in {del_s:.2} s");
        deletes.push(json!({"flows": held_at_delete, "secs": del_s}));
        if k == largest {
            daemon["tenant_delete_secs"] = json!(del_s);
        }
        drop(weir);
    }

    // conntrack, weir stopped: the same counts through nftables DNAT.
    let mut ct = Vec::new();
    for &k in &ks {
        let n = 10u64.pow(k);
        eprintln!("  nftables DNAT + conntrack, {n} flows");
        match conntrack_point(topo, dir, k, n, secs, gen_per_sent) {
            Ok(v) => ct.push(v),
            Err(e) => {
                failures.push(format!("conntrack at {n} flows: {e:#}"));
                ct.push(json!({"flows": n, "error": format!("{e:#}")}));
            }
        }
        cleanup_conntrack(topo);
    }
    let _ = ip(&format!("-n {cl} route del {VIP_B}/32"));

    // Tables.
    let mut t = Table::new([
        "flows",
        "weir pps",
        "weir pps / reference",
        "weir CPU ns/pkt (own process)",
        "nft pps",
        "nft CPU ns/pkt",
        "vs 10K (pps)",
        "vs 10K (normalised)",
        "vs 10K (per weir CPU-s)",
    ]);
    let first = pps_rows.first().cloned().unwrap_or_default();
    let num = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    for (r, c) in pps_rows.iter().zip(&ct) {
        let f = |v: &serde_json::Value| v.as_f64().map_or("-".into(), |x| format!("{x:.0}"));
        let per_cpu = match (r["weir_cpu_ns"].as_f64(), first["weir_cpu_ns"].as_f64()) {
            (Some(x), Some(base)) if x > 0.0 => format!("{:.2}x", base / x),
            _ => "-".into(),
        };
        t.row([
            r["flows"].to_string(),
            f(&r["pps"]),
            format!("{:.3}", num(&r["norm"])),
            f(&r["weir_cpu_ns"]),
            f(&c["pps"]),
            f(&c["cpu_ns"]),
            format!("{:.2}x", num(&r["pps"]) / num(&first["pps"]).max(1.0)),
            format!("{:.2}x", num(&r["norm"]) / num(&first["norm"]).max(1e-9)),
            per_cpu,
        ]);
    }
    t.print();
    let mut memory = Vec::new();
    let mut tm = Table::new([
        "flows",
        "weir B/flow",
        "of it: nodes",
        "index",
        "the rest",
        "conntrack B/entry (slab+hash)",
        "slabinfo nf_conntrack B/entry",
        "weir/conntrack",
    ]);
    for ((n, w, rss0, rss1, buckets), c) in mem_rows.iter().zip(&ct) {
        let ctb = c["bytes_per_flow"].as_f64().unwrap_or(0.0);
        let index = *buckets as f64 * BUCKET_BYTES / *n as f64;
        tm.row([
            n.to_string(),
            format!("{w:.0}"),
            format!("{NODE_BYTES:.0}"),
            format!("{index:.1} ({buckets} lines)"),
            format!("{:.1}", w - NODE_BYTES - index),
            format!("{ctb:.0}"),
            c["slabinfo_bytes_per_flow"]
                .as_f64()
                .map_or("-".into(), |x| format!("{x:.0}")),
            format!("{:.2}", w / ctb.max(1.0)),
        ]);
        memory.push(
            json!({"flows": n, "weir_bytes_per_flow": w, "weir_rss_before": rss0,
            "weir_rss_after": rss1, "index_buckets": buckets,
            "index_bytes_per_flow": index, "conntrack_bytes_per_flow": ctb, "conntrack": c}),
        );
    }
    tm.print();
    let mut tn = Table::new([
        "A's flows (idle)",
        "B pps, A empty",
        "B pps, A full",
        "ratio (pps)",
        "ratio (normalised)",
        "ratio (per weir CPU-s)",
    ]);
    for r in &noisy {
        tn.row([
            r["a_flows"].to_string(),
            r["b_pps_a_empty"].to_string(),
            r["b_pps_a_full"].to_string(),
            format!("{:.3}", num(&r["ratio"])),
            format!("{:.3}", num(&r["norm_ratio"])),
            r["cpu_ratio"]
                .as_f64()
                .map_or("-".into(), |x| format!("{x:.3}")),
        ]);
    }
    tn.print();
    println!(
        "daemon at {}: {daemon}\ntenant deletes: {}\nexpiry: {}\n",
        10u64.pow(largest),
        json!(deletes),
        json!(expiries)
    );
    if !failures.is_empty() {
        bail!("scale checks failed:\n{}", failures.join("\n"));
    }
    Ok(
        json!({"pps": pps_rows, "memory": memory, "noisy": noisy, "daemon_10m": daemon,
        "tenant_deletes": deletes, "expiry": expiries, "nft_pps": ct}),
    )
}

/// One conntrack point: raise the limits, fill `n` entries through the
/// kube-proxy ruleset, read the kernel's memory growth, measure pps.
fn conntrack_point(
    topo: &Topo,
    dir: &Path,
    k: u32,
    n: u64,
    secs: f64,
    gen_per_sent: f64,
) -> Result<serde_json::Value> {
    let w = topo.ns("lb");
    sysctl(&w, "net.ipv4.ip_forward", "1")?;
    super::topo::nft_apply(&w, &kube_proxy_ruleset())?;
    // Buckets = the next power of two >= n (conntrack's own default ratio is
    // 1 entry per bucket at most); 8 bytes a bucket.
    let hash = n.next_power_of_two().max(1 << 16);
    let max = (n * 2).max(1 << 18);
    sh(&[
        "sysctl",
        "-q",
        "-w",
        &format!("net.netfilter.nf_conntrack_max={max}"),
    ])?;
    std::fs::write(
        "/sys/module/nf_conntrack/parameters/hashsize",
        hash.to_string(),
    )
    .context("setting nf_conntrack hashsize")?;
    let _ = sysctl(&w, "net.netfilter.nf_conntrack_max", &max.to_string());
    sysctl(&w, "net.netfilter.nf_conntrack_udp_timeout", "7200")?;
    sysctl(&w, "net.netfilter.nf_conntrack_udp_timeout_stream", "7200")?;
    let count = || -> Result<u64> {
        let out = sh(&[
            "ip",
            "netns",
            "exec",
            &w,
            "cat",
            "/proc/sys/net/netfilter/nf_conntrack_count",
        ])?;
        out.trim().parse().context("nf_conntrack_count")
    };
    if count()? != 0 {
        bail!("conntrack not empty before the fill");
    }
    let slab0 = meminfo_kib("Slab")? * 1024;
    let ct0 = slab_bytes("nf_conntrack");
    fill(
        topo,
        dir,
        &tuples_conf(MAC_WEIR, VIP_A, k),
        n,
        fill_limit(n),
        count,
    )?;
    let slab1 = meminfo_kib("Slab")? * 1024;
    let ct1 = slab_bytes("nf_conntrack");
    let slab_per = slab1.saturating_sub(slab0) as f64 / n as f64;
    let hash_per = (hash * 8) as f64 / n as f64;
    let slabinfo_per = match (ct0, ct1) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / n as f64),
        _ => None,
    };
    let s = timed(topo, dir, &tuples_conf(MAC_WEIR, VIP_A, k), secs, None)?;
    let held = count()?;
    eprintln!(
        "    {:.0} pps; slab {slab_per:.0} B/entry + hash {hash_per:.1} B/entry; {held} entries after",
        pps(&s)
    );
    Ok(
        json!({"flows": n, "pps": pps(&s).round(), "cpu_ns": cpu_ns(&s, gen_per_sent),
        "bytes_per_flow": slab_per + hash_per, "slab_bytes_per_flow": slab_per,
        "hash_bytes_per_flow": hash_per, "hash_buckets": hash,
        "slabinfo_bytes_per_flow": slabinfo_per, "entries_after_run": held}),
    )
}

/// Empties conntrack in weir's namespace and removes the ruleset; limits back.
fn cleanup_conntrack(topo: &Topo) {
    let w = topo.ns("lb");
    let _ = sh(&["ip", "netns", "exec", &w, "nft", "flush", "ruleset"]);
    let _ = sh(&["ip", "netns", "exec", &w, "conntrack", "-F"]);
    let _ = sysctl(&w, "net.ipv4.ip_forward", "0");
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let c = sh(&[
            "ip",
            "netns",
            "exec",
            &w,
            "cat",
            "/proc/sys/net/netfilter/nf_conntrack_count",
        ]);
        if c.map(|s| s.trim() == "0").unwrap_or(true) {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = sh(&[
        "sysctl",
        "-q",
        "-w",
        "net.netfilter.nf_conntrack_max=262144",
    ]);
    let _ = std::fs::write("/sys/module/nf_conntrack/parameters/hashsize", "65536");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuples_cover_exactly_ten_to_the_k() {
        let c = tuples_conf(MAC_WEIR, VIP_A, 6);
        // 2^6 ports x 5^6 addresses, coprime: 10^6 tuples a period.
        assert!(c.contains("sport=dinc(10000, 10063)"), "{c}");
        assert!(
            c.contains(&format!(
                "saddr=dinc({SADDR_BASE}, {})",
                SADDR_BASE + 15_624
            )),
            "{c}"
        );
        assert!(c.contains("fill(0x00, 18)"), "{c}");
    }

    /// The counters are read where `weir stats --json` puts them (the
    /// first recorded run read `packet` at the top and got zeros).
    #[test]
    fn packet_counters_come_from_global_packet() {
        let stats = json!({"global": {"packet": {"rx": 7, "new_flows": 3}}, "services": []});
        assert_eq!(packet_of(&stats), Some(json!({"rx": 7, "new_flows": 3})));
        assert_eq!(packet_of(&json!({"packet": {"rx": 7}})), None);
    }

    #[test]
    fn fill_frames_are_differences_over_the_fill() {
        let before = json!({"rx": 10, "tx": 9, "new_flows": 5,
            "dropped": {"no_flow": 1, "too_big": 2}});
        let after = json!({"rx": 110, "tx": 100, "new_flows": 95,
            "dropped": {"no_flow": 1, "too_big": 4, "ring_full": 3}});
        let f = fill_frames(120, &before, &after);
        assert_eq!(
            f,
            json!({"sent": 120, "rx": 100, "tx": 91, "new_flows": 90,
                "dropped": {"too_big": 2, "ring_full": 3}})
        );
    }

    #[test]
    fn median_of_odd_even_and_no_values() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0].into_iter()), 2.5);
        assert_eq!(median(std::iter::empty()), 0.0);
    }

    #[test]
    fn meminfo_and_slabinfo_parse() {
        let m = "MemTotal:       24000000 kB\nSlab:             123456 kB\nSReclaimable: 1 kB\n";
        assert_eq!(parse_meminfo(m, "Slab"), Some(123_456));
        assert_eq!(parse_meminfo(m, "SUnreclaim"), None);
        let s = "slabinfo - version: 2.1\nnf_conntrack        1000   1050    320   25    2 : tunables 0 0 0\n";
        assert_eq!(parse_slabinfo(s, "nf_conntrack"), Some(1000 * 320));
        assert_eq!(parse_slabinfo(s, "kmalloc-64"), None);
    }
}

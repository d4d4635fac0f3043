//! `weir-bench packet`: weir's packet mode raced against the kernel forwarding
//! the same traffic, in one run, on one topology (see [`topo`]).
//!
//! Implementations, alternated round by round:
//! * `direct` — calibration: the generator sends straight to a backend, no
//!   forwarder; its CPU per sent packet is the generator's and the sink's share;
//! * `kernel` — the ceiling: weir's namespace routes the VIP to a backend
//!   (ip_forward = 1, no NAT, no conntrack);
//! * `nft-dnat` — the baseline: nftables DNAT built as kube-proxy's nftables
//!   mode builds it (service vmap, `numgen random mod 2` to endpoint chains,
//!   conntrack);
//! * `weir-nat`, `weir-fnat`, `weir-dr` with 1 and 2 workers (lb0 gets as many
//!   live queues as workers: AF_XDP gives one worker per rx queue);
//! * `weir-proxy` — weir's proxy mode (the VIP assigned to lb0).
//!
//! CPU per packet is the forwarding side's. On veth the kernel forwards in the
//! softirq of the sending CPU, inside the generator's own time slices, so no
//! process's CPU is the kernel forwarder's. What is measured instead: the
//! machine's irq + softirq time (`/proc/stat`) over the run, minus its rate
//! over an idle second just before, minus what the `direct` calibration says
//! the generator's frames cost in softirq per packet sent (veth, bridge,
//! sink), plus the weir process's own CPU (user + system) on weir rows. The
//! machine's user and system time is not used: the other engineers' builds
//! on the same 2 cores fill it (a first version subtracting an idle baseline
//! from all busy time read 0 for every row under that load).

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;

use crate::Common;
use crate::proxy::peers::weir_bin;
use crate::proxy::sys::Server;
use crate::report::{Table, ratio};

pub(crate) mod scale;
pub(crate) mod synflood;
pub(crate) mod tcp;
pub(crate) mod topo;

use topo::{
    BACKENDS, CLIENT, MAC_BACKENDS, MAC_CLIENT, MAC_WEIR, PORT, Topo, VIP, WEIR_BACKEND_SIDE, ip,
    run as sh, sysctl,
};

/// Distinct UDP flows the generator cycles through (source ports).
const FLOWS: u32 = 1024;
const FIRST_SPORT: u32 = 10_000;
/// Frame length without FCS (64 bytes on the wire).
pub(crate) const FRAME: usize = 60;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Impl {
    Direct,
    Kernel,
    NftDnat,
    Weir(&'static str, u32),
    WeirProxy,
}

impl Impl {
    pub(crate) fn name(self) -> String {
        match self {
            Impl::Direct => "direct (calibration)".into(),
            Impl::Kernel => "kernel forwarding (ceiling)".into(),
            Impl::NftDnat => "nftables DNAT (kube-proxy)".into(),
            Impl::Weir(m, _) => format!("weir {m}"),
            Impl::WeirProxy => "weir proxy".into(),
        }
    }

    pub(crate) fn workers(self) -> u32 {
        match self {
            Impl::Weir(_, w) => w,
            Impl::WeirProxy => 1,
            _ => 0,
        }
    }

    pub(crate) fn all() -> Vec<Impl> {
        let mut v = vec![Impl::Direct, Impl::Kernel, Impl::NftDnat];
        for w in [1, 2] {
            for m in ["nat", "fnat", "dr"] {
                v.push(Impl::Weir(m, w));
            }
        }
        v.push(Impl::WeirProxy);
        v
    }
}

/// What one timed run measured.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Sample {
    pub(crate) secs: f64,
    pub(crate) sent: u64,
    pub(crate) delivered: u64,
    /// Machine irq + softirq seconds over the run, and over the same time idle.
    pub(crate) soft_s: f64,
    pub(crate) idle_soft_s: f64,
    /// The weir process's CPU seconds (weir rows only).
    pub(crate) weir_cpu_s: f64,
}

impl Sample {
    fn add(&mut self, o: &Sample) {
        self.secs += o.secs;
        self.sent += o.sent;
        self.delivered += o.delivered;
        self.soft_s += o.soft_s;
        self.idle_soft_s += o.idle_soft_s;
        self.weir_cpu_s += o.weir_cpu_s;
    }
}

pub(crate) fn run(c: &Common) -> Result<serde_json::Value> {
    if nix::unistd::geteuid().as_raw() != 0 {
        bail!("needs root (network namespaces, XDP, AF_XDP)");
    }
    for (tool, arg, pkg) in [
        ("ip", "-V", "iproute2"),
        ("ethtool", "--version", "ethtool"),
        ("nft", "--version", "nftables"),
        ("trafgen", "-v", "netsniff-ng"),
    ] {
        if Command::new(tool).arg(arg).output().is_err() {
            bail!("needs {tool} (Debian package {pkg})");
        }
    }
    let bin = weir_bin()?;
    let (rounds, secs) = if c.quick { (1, 3.0) } else { (3, 8.0) };
    let topo = Topo::new().context("building the topology")?;
    let dir = tempfile::tempdir()?;
    crate::signals::remove_dir_on_signal(dir.path());
    let want = |row: &str| c.only.is_empty() || c.only.iter().any(|o| o == row);
    let mut out = serde_json::Map::new();
    if want("udp") {
        out.insert(
            "udp".into(),
            udp_rows(&topo, &bin, dir.path(), rounds, secs)?,
        );
    }
    if want("tcp") {
        out.insert(
            "tcp".into(),
            tcp::tcp_rows(&topo, &bin, dir.path(), c.quick)?,
        );
    }
    if want("synflood") {
        out.insert(
            "synflood".into(),
            synflood::run(&topo, &bin, dir.path(), c.quick, synflood::Shape::OneTenant)?,
        );
    }
    if want("synflood-tenants") {
        out.insert(
            "synflood_tenants".into(),
            synflood::run(
                &topo,
                &bin,
                dir.path(),
                c.quick,
                synflood::Shape::TwoTenants,
            )?,
        );
    }
    // Last: row b leaves the backends' VIPs and routes in place, which the
    // scale rows' UDP sink does not mind.
    if want("scale") {
        out.insert("scale".into(), scale::run(c, &topo, &bin, dir.path())?);
    }
    Ok(serde_json::Value::Object(out))
}

/// Row a: 64-byte UDP over [`FLOWS`] flows, every implementation in turn.
fn udp_rows(
    topo: &Topo,
    bin: &Path,
    dir: &Path,
    rounds: usize,
    secs: f64,
) -> Result<serde_json::Value> {
    println!(
        "### 64-byte UDP, {FLOWS} flows, trafgen on 1 CPU, {rounds} round(s) of {secs} s each\n"
    );
    let impls = Impl::all();
    let mut sums = vec![Sample::default(); impls.len()];
    for round in 0..rounds {
        for (i, &imp) in impls.iter().enumerate() {
            let s = one_udp_run(topo, bin, dir, imp, secs)
                .with_context(|| format!("{} (round {})", imp.name(), round + 1))?;
            eprintln!(
                "  round {} {}: {:.0} pps, {:.2} softirq s (idle {:.2}), {:.2} weir s",
                round + 1,
                imp.name(),
                s.delivered as f64 / s.secs,
                s.soft_s,
                s.idle_soft_s,
                s.weir_cpu_s
            );
            sums[i].add(&s);
        }
    }
    let cal = &sums[0];
    let gen_per_sent = if cal.sent > 0 {
        (cal.soft_s - cal.idle_soft_s).max(0.0) / cal.sent as f64
    } else {
        0.0
    };
    let mut rows = Vec::new();
    for (imp, s) in impls.iter().zip(&sums) {
        let pps = s.delivered as f64 / s.secs.max(1e-9);
        let cpu = forwarding_cpu_per_mpkt(s, gen_per_sent);
        let weir_cpu = (s.weir_cpu_s > 0.0 && s.delivered > 0)
            .then(|| s.weir_cpu_s / (s.delivered as f64 / 1e6));
        rows.push((*imp, pps, cpu, weir_cpu, s));
    }
    let cpu_of = |want: Impl| rows.iter().find(|r| r.0 == want).and_then(|r| r.2);
    let (nft, kernel) = (cpu_of(Impl::NftDnat), cpu_of(Impl::Kernel));
    let mut t = Table::new([
        "impl",
        "workers",
        "pps",
        "loss",
        "CPU-s/Mpkt (forwarding)",
        "weir process CPU-s/Mpkt",
        "per CPU-s vs nft",
        "per CPU-s vs kernel",
    ]);
    let mut out = Vec::new();
    for (imp, pps, cpu, weir_cpu, s) in &rows {
        // Counters read a few frames apart can make it slightly negative.
        let loss = if s.sent > 0 {
            (1.0 - s.delivered as f64 / s.sent as f64).max(0.0)
        } else {
            0.0
        };
        let fmt = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.3}"));
        let vs = |base: Option<f64>| match (base, cpu) {
            (Some(b), Some(c)) if *imp != Impl::Direct => ratio(b, *c),
            _ => "-".into(),
        };
        t.row([
            imp.name(),
            imp.workers().to_string(),
            format!("{pps:.0}"),
            format!("{:.1}%", loss * 100.0),
            fmt(*cpu),
            fmt(*weir_cpu),
            vs(nft),
            vs(kernel),
        ]);
        out.push(json!({
            "impl": imp.name(),
            "workers": imp.workers(),
            "pps": pps.round(),
            "cpu_s_per_mpkt": cpu,
            "weir_cpu_s_per_mpkt": weir_cpu,
            "sent": s.sent,
            "delivered": s.delivered,
        }));
    }
    t.print();
    println!(
        "generator + sink (direct calibration): {:.3} CPU-s per million packets sent\n",
        gen_per_sent * 1e6
    );
    Ok(serde_json::Value::Array(out))
}

/// Forwarding CPU seconds per million delivered packets: softirq time minus
/// the idle baseline minus the generator's share of what was sent, plus
/// weir's own CPU. `None` when nothing was delivered.
pub(crate) fn forwarding_cpu_per_mpkt(s: &Sample, gen_per_sent: f64) -> Option<f64> {
    if s.delivered == 0 {
        return None;
    }
    let soft = (s.soft_s - s.idle_soft_s - gen_per_sent * s.sent as f64).max(0.0);
    let cpu = soft + s.weir_cpu_s;
    Some(cpu / (s.delivered as f64 / 1e6))
}

/// Sets `imp` up, measures the idle baseline, runs the generator for `secs`,
/// tears `imp` down (also on error).
fn one_udp_run(topo: &Topo, bin: &Path, dir: &Path, imp: Impl, secs: f64) -> Result<Sample> {
    topo.set_queues(imp.workers().max(1))?;
    let guard = Setup::new(topo, bin, dir, imp)?;
    // Idle baseline over a second: other load on the shared machine.
    let b0 = softirq_seconds()?;
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    let idle_rate = (softirq_seconds()? - b0) / t0.elapsed().as_secs_f64();
    let conf = dir.join("trafgen.cfg");
    let (dmac, daddr) = match imp {
        Impl::Direct => (MAC_BACKENDS[0], BACKENDS[0]),
        _ => (MAC_WEIR, VIP),
    };
    std::fs::write(&conf, trafgen_conf(dmac, MAC_CLIENT, CLIENT, daddr))?;
    let (sent0, del0) = (topo.sent()?, topo.delivered()?);
    let weir0 = guard.weir_cpu();
    let soft0 = softirq_seconds()?;
    let t = Instant::now();
    let mut trafgen = Command::new("ip")
        .args(["netns", "exec", &topo.ns("cl"), "trafgen", "--in"])
        .arg(&conf)
        .args(["--out", "eth0", "--cpus", "1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        // trafgen forks its senders: its own group, so they can be stopped together.
        .process_group(0)
        .spawn()
        .context("starting trafgen")?;
    let deadline = t + Duration::from_secs_f64(secs);
    let mut exited = None;
    while Instant::now() < deadline {
        if let Some(st) = trafgen.try_wait()? {
            exited = Some(st);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let elapsed = t.elapsed().as_secs_f64();
    let soft = softirq_seconds()? - soft0;
    stop_group(&mut trafgen);
    if let Some(st) = exited {
        bail!("trafgen exited early ({st})");
    }
    let weir_cpu = guard.weir_cpu() - weir0;
    // Let queued frames drain before reading the counters.
    std::thread::sleep(Duration::from_millis(200));
    let sent = topo.sent()? - sent0;
    let delivered = topo.delivered()? - del0;
    let counters = guard.check()?;
    if !counters.is_empty() {
        eprintln!("    weir's packet counters: {counters}");
    }
    drop(guard);
    Ok(Sample {
        secs: elapsed,
        sent,
        delivered,
        soft_s: soft,
        idle_soft_s: idle_rate * elapsed,
        weir_cpu_s: weir_cpu,
    })
}

/// Stops a child that leads its own process group and every process of the
/// group: SIGINT (trafgen then stops its senders), up to 3 s, then SIGKILL.
pub(crate) fn stop_group(child: &mut std::process::Child) {
    use nix::sys::signal::{Signal, killpg};
    let Ok(raw) = i32::try_from(child.id()) else {
        return;
    };
    let pgid = nix::unistd::Pid::from_raw(raw);
    let _ = killpg(pgid, Signal::SIGINT);
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // Senders that outlived the parent are still in the group.
    let _ = killpg(pgid, Signal::SIGKILL);
    let _ = child.wait();
}

/// One implementation's state in weir's namespace, undone on drop.
struct Setup<'a> {
    topo: &'a Topo,
    imp: Impl,
    weir: Option<(Server, std::path::PathBuf)>,
}

impl<'a> Setup<'a> {
    fn new(topo: &'a Topo, bin: &Path, dir: &Path, imp: Impl) -> Result<Self> {
        let mut s = Setup {
            topo,
            imp,
            weir: None,
        };
        let w = topo.ns("lb");
        match imp {
            Impl::Direct => {}
            Impl::Kernel => {
                sysctl(&w, "net.ipv4.ip_forward", "1")?;
                ip(&format!("-n {w} route add {VIP}/32 via {}", BACKENDS[0]))?;
            }
            Impl::NftDnat => {
                sysctl(&w, "net.ipv4.ip_forward", "1")?;
                topo::nft_apply(&w, &kube_proxy_ruleset())?;
            }
            Impl::Weir(method, workers) => {
                let cfg = write_weir_conf(dir, Some((method, workers)))?;
                s.weir = Some((start_weir(topo, bin, dir, &cfg)?, cfg));
            }
            Impl::WeirProxy => {
                ip(&format!("-n {w} addr add {VIP}/32 dev lb0"))?;
                let cfg = write_weir_conf(dir, None)?;
                s.weir = Some((start_weir(topo, bin, dir, &cfg)?, cfg));
            }
        }
        Ok(s)
    }

    fn weir_cpu(&self) -> f64 {
        self.weir.as_ref().map_or(0.0, |(w, _)| w.cpu_seconds())
    }

    /// Fails if weir died or (packet mode) created no flow; weir's packet
    /// counters, to say where frames went.
    fn check(&self) -> Result<String> {
        if let Some((_, cfg)) = &self.weir
            && let Impl::Weir(..) = self.imp
        {
            let out = weir_cli(cfg, &["stats", "--json"])?;
            let v: serde_json::Value = serde_json::from_str(&out).context("weir stats --json")?;
            let p = &v["global"]["packet"];
            if p["new_flows"].as_u64().unwrap_or(0) == 0 {
                bail!("weir made no flow: {p}");
            }
            return Ok(p.to_string());
        }
        Ok(String::new())
    }
}

impl Drop for Setup<'_> {
    fn drop(&mut self) {
        self.weir = None;
        let w = self.topo.ns("lb");
        match self.imp {
            Impl::Kernel => {
                let _ = ip(&format!("-n {w} route del {VIP}/32"));
                let _ = sysctl(&w, "net.ipv4.ip_forward", "0");
            }
            Impl::NftDnat => {
                let _ = sh(&["ip", "netns", "exec", &w, "nft", "flush", "ruleset"]);
                let _ = sysctl(&w, "net.ipv4.ip_forward", "0");
            }
            Impl::WeirProxy => {
                let _ = ip(&format!("-n {w} addr del {VIP}/32 dev lb0"));
            }
            _ => {}
        }
    }
}

/// The part of weir's config every packet row shares: `[daemon]`, the
/// admin socket in `dir`, and `[packet]` on lb0 for a packet method
/// (`packet` = (method, workers); `None`: proxy). Returns it and the
/// services' `forward`.
pub(crate) fn conf_head<'a>(dir: &Path, packet: Option<(&'a str, u32)>) -> (String, &'a str) {
    let workers = packet.map_or(1, |p| p.1);
    let mut s = format!(
        "[daemon]\nworkers = {workers}\n\n[admin]\nlisten = \"unix:{}/admin.sock\"\n\
         token = \"weir-bench-packet-token\"\n\n",
        dir.display()
    );
    let forward = if let Some((method, w)) = packet {
        s.push_str(&format!(
            "[packet]\ninterfaces = [\"lb0\"]\nworkers = {w}\nio = \"xdp\"\n"
        ));
        if method == "fnat" {
            s.push_str(&format!("local_addresses = [\"{WEIR_BACKEND_SIDE}\"]\n"));
        }
        method
    } else {
        "proxy"
    };
    (s, forward)
}

fn write_weir_conf(dir: &Path, packet: Option<(&str, u32)>) -> Result<std::path::PathBuf> {
    let cfg = dir.join("weir.toml");
    let (mut s, forward) = conf_head(dir, packet);
    s.push_str(&format!(
        "\n[[service]]\nname = \"udp\"\nprotocol = \"udp\"\nlisten = \"{VIP}:{PORT}\"\n\
         forward = \"{forward}\"\nscheduler = \"rr\"\n"
    ));
    for b in BACKENDS {
        s.push_str(&format!(
            "  [[service.backend]]\n  address = \"{b}:{PORT}\"\n"
        ));
    }
    std::fs::write(&cfg, s)?;
    Ok(cfg)
}

pub(crate) fn start_weir(topo: &Topo, bin: &Path, dir: &Path, cfg: &Path) -> Result<Server> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &topo.ns("lb")])
        .arg(bin)
        .args(["run", "--config"])
        .arg(cfg);
    let _ = std::fs::remove_file(dir.join("admin.sock"));
    let mut server = Server::spawn("weir", cmd, tempfile::tempdir()?)?;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        server.check_alive()?;
        if weir_cli(cfg, &["list", "--json"]).is_ok() {
            return Ok(server);
        }
        if Instant::now() > deadline {
            bail!("weir not up within 15 s; log:\n{}", server.log_tail());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub(crate) fn weir_cli(cfg: &Path, args: &[&str]) -> Result<String> {
    let bin = weir_bin()?;
    let out = Command::new(bin)
        .args(args)
        .arg("--config")
        .arg(cfg)
        .output()?;
    if !out.status.success() {
        bail!(
            "weir {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// nftables as kube-proxy's nftables mode builds a UDP ClusterIP service with
/// two endpoints: a `service-ips` verdict map from the VIP to the service
/// chain, `numgen random mod 2` to endpoint chains, each a DNAT (conntrack).
pub(crate) fn kube_proxy_ruleset() -> String {
    let mut eps = String::new();
    let mut vmap = Vec::new();
    for (i, b) in BACKENDS.iter().enumerate() {
        eps.push_str(&format!(
            "chain endpoint-{i} {{\n meta l4proto udp dnat to {b}:{PORT}\n}}\n"
        ));
        vmap.push(format!("{i} : goto endpoint-{i}"));
    }
    format!(
        "table ip kube-proxy {{\n\
         map service-ips {{\n type ipv4_addr . inet_proto . inet_service : verdict\n \
         elements = {{ {VIP} . udp . {PORT} : goto service-udp }}\n}}\n\
         chain services {{\n ip daddr . meta l4proto . th dport vmap @service-ips\n}}\n\
         chain nat-prerouting {{\n type nat hook prerouting priority dstnat; policy accept\n jump services\n}}\n\
         chain service-udp {{\n numgen random mod {} vmap {{ {} }}\n}}\n{eps}}}\n",
        BACKENDS.len(),
        vmap.join(", ")
    )
}

/// A trafgen configuration: one 60-byte IPv4/UDP frame (64 on the wire)
/// whose source port cycles over [`FLOWS`] values; trafgen fixes the
/// checksums of every frame it changes.
fn trafgen_conf(dmac: &str, smac: &str, saddr: &str, daddr: &str) -> String {
    let payload = FRAME - 14 - 20 - 8;
    format!(
        "{{\n  eth(da={dmac}, sa={smac}),\n  ipv4(saddr={saddr}, daddr={daddr}, ttl=64),\n  \
         udp(sport=dinc({FIRST_SPORT}, {}), dport={PORT}),\n  fill(0x00, {payload})\n}}\n",
        FIRST_SPORT + FLOWS - 1
    )
}

/// irq + softirq seconds of the whole machine since boot (`/proc/stat`).
pub(crate) fn softirq_seconds() -> Result<f64> {
    let text = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let ticks = parse_proc_stat_softirq(&text).context("no cpu line in /proc/stat")?;
    Ok(ticks as f64 / clock_ticks())
}

fn clock_ticks() -> f64 {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK) {
        Ok(Some(t)) if t > 0 => t as f64,
        _ => 100.0,
    }
}

/// irq + softirq ticks of the aggregate `cpu` line.
fn parse_proc_stat_softirq(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    if v.len() < 7 {
        return None;
    }
    Some(v[5] + v[6])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_softirq_sums_irq_and_softirq() {
        let text = "cpu  100 2 30 5000 7 4 9 11 0 0\ncpu0 50 1 15 2500 3 2 4 5 0 0\n";
        assert_eq!(parse_proc_stat_softirq(text), Some(4 + 9));
        assert_eq!(parse_proc_stat_softirq("cpu0 1 2 3 4 5 6 7\n"), None);
        assert_eq!(parse_proc_stat_softirq("cpu  1 2 3\n"), None);
        assert_eq!(parse_proc_stat_softirq("cpu  1 x 3 4 5 6 7\n"), None);
    }

    #[test]
    fn forwarding_cpu_subtracts_baseline_and_generator() {
        let s = Sample {
            secs: 10.0,
            sent: 2_000_000,
            delivered: 1_000_000,
            soft_s: 10.0,
            idle_soft_s: 1.0,
            weir_cpu_s: 0.5,
        };
        // 10 - 1 - 2e6 * 2e-6 + 0.5 = 5.5 s for 1 M delivered.
        let got = forwarding_cpu_per_mpkt(&s, 2e-6).unwrap();
        assert!((got - 5.5).abs() < 1e-9, "{got}");
        // The softirq share is never negative; nothing delivered gives no figure.
        assert_eq!(forwarding_cpu_per_mpkt(&s, 1.0), Some(0.5));
        let none = Sample { delivered: 0, ..s };
        assert_eq!(forwarding_cpu_per_mpkt(&none, 0.0), None);
    }

    #[test]
    fn trafgen_frame_is_64_bytes_on_the_wire_over_the_flows() {
        let c = trafgen_conf(MAC_WEIR, MAC_CLIENT, CLIENT, VIP);
        assert!(c.contains("fill(0x00, 18)"), "{c}");
        assert!(c.contains("dinc(10000, 11023)"), "{c}");
        assert!(c.contains(&format!("daddr={VIP}")), "{c}");
    }

    #[test]
    fn kube_proxy_ruleset_picks_a_random_endpoint() {
        let r = kube_proxy_ruleset();
        assert!(
            r.contains("numgen random mod 2 vmap { 0 : goto endpoint-0, 1 : goto endpoint-1 }")
        );
        assert!(r.contains("dnat to 10.99.0.3:9000"));
        assert!(r.contains("type nat hook prerouting priority dstnat"));
    }
}

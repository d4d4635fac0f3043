//! Packet mode's moving parts: the steering program on each `[packet]`
//! interface, one AF_XDP socket and one worker thread per interface queue,
//! and keeping the steering maps in step with the services.
//!
//! The unsafe and the rings are `weir-packet-io`'s; the per-frame work is
//! [`super::packet::Engine`]'s. This module only wires them.

use std::collections::HashSet;
use std::hash::Hash;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

use anyhow::Context as _;
use parking_lot::Mutex;
use weir_packet_io::{
    PacketConfig as PacketSocketConfig, PacketSocket, SteerKey, Steering, XskConfig, XskSocket,
};

use super::Shared;
use super::packet::{Engine, NextHops};
use crate::config::{PacketConfig, PacketIo};

/// The attached interfaces (their steering programs, detached on drop).
pub(crate) struct PacketRuntime {
    steering: Mutex<Vec<Steering>>,
    /// What the maps hold now, for diffs, and what the kernel refused.
    steered: Mutex<SteerSync>,
    /// The host addresses the steering programs hold (see [`Self::sync_hosts`]).
    hosts: Mutex<Vec<std::net::IpAddr>>,
    /// fnat over AF_PACKET: the nftables table that keeps the kernel from
    /// answering replies to the fnat ports (deleted on drop).
    fnat_guard: Mutex<Option<FnatGuard>>,
    /// fnat's ports taken out of the kernel's ephemeral ports (given back
    /// on drop).
    reserved: Mutex<Option<PortReservation>>,
}

/// An nftables table (`inet weir_fnat_<pid>`) dropping, on input, TCP and
/// UDP to the fnat local addresses' port range. AF_PACKET only copies
/// frames: without it the kernel, which has no socket on those ports,
/// answers each backend reply with a RST or a port unreachable (AF_XDP
/// takes the frames away from the kernel instead).
#[derive(Debug)]
struct FnatGuard {
    table: String,
}

impl FnatGuard {
    fn install(cfg: &PacketConfig) -> anyhow::Result<Self> {
        let table = format!("weir_fnat_{}", std::process::id());
        let (mut v4, mut v6) = (Vec::new(), Vec::new());
        for a in &cfg.local_addresses {
            match a {
                std::net::IpAddr::V4(a) => v4.push(a.to_string()),
                std::net::IpAddr::V6(a) => v6.push(a.to_string()),
            }
        }
        let ports = format!("{}-{}", cfg.fnat_ports.lo, cfg.fnat_ports.hi);
        let mut rules = format!(
            "table inet {table} {{\n chain input {{\n  type filter hook input priority -300; policy accept;\n"
        );
        for (fam, addrs) in [("ip", &v4), ("ip6", &v6)] {
            if !addrs.is_empty() {
                rules += &format!(
                    "  {fam} daddr {{ {} }} meta l4proto {{ tcp, udp }} th dport {ports} drop\n",
                    addrs.join(", ")
                );
            }
        }
        rules += " }\n}\n";
        nft(&rules).context(
            "packet mode: fnat over AF_PACKET needs an nftables rule so the kernel does not \
             answer backend replies to the fnat ports (install nftables, or use io = \"xdp\")",
        )?;
        tracing::info!(%table, %ports, "fnat over AF_PACKET: nftables drops the fnat ports on input");
        Ok(Self { table })
    }
}

impl Drop for FnatGuard {
    fn drop(&mut self) {
        if let Err(e) = nft(&format!("delete table inet {}\n", self.table)) {
            tracing::warn!(table = %self.table, "removing the fnat nftables table: {e:#}");
        }
    }
}

/// Runs `nft -f -` with `rules`.
fn nft(rules: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut child = std::process::Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running nft")?;
    child
        .stdin
        .take()
        .context("nft's stdin")?
        .write_all(rules.as_bytes())
        .context("writing to nft")?;
    let out = child.wait_with_output().context("waiting for nft")?;
    if !out.status.success() {
        anyhow::bail!(
            "nft failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// How often the host's addresses are read again: an address added later
/// is the kernel's (its backends' answers pass to the kernel) within this.
/// Steering changes the kernel refused are tried again on the same beat.
const HOSTS_EVERY: Duration = Duration::from_secs(1);

impl std::fmt::Debug for PacketRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacketRuntime").finish_non_exhaustive()
    }
}

/// `net.ipv4.ip_local_reserved_ports` (see [`reserve_ports`]).
const RESERVED_PORTS: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";

/// What [`start`] changes outside the process, and a failure to make,
/// as parameters: tests pass a file of their own.
struct StartWith<'a> {
    /// `net.ipv4.ip_local_reserved_ports`.
    reserved_ports: &'a std::path::Path,
    /// Tests: fail once the workers are running, as a late error does.
    #[cfg(test)]
    fail_after_spawn: bool,
}

/// Start packet mode: attach to every interface, bind a socket per queue,
/// spawn a worker per socket. Every failure says what is missing, and
/// leaves nothing behind (see [`start_with`]).
pub(crate) fn start(
    shared: &Arc<Shared>,
    cfg: &PacketConfig,
    first_worker: usize,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<(Arc<PacketRuntime>, Vec<std::thread::JoinHandle<()>>)> {
    let with = StartWith {
        reserved_ports: std::path::Path::new(RESERVED_PORTS),
        #[cfg(test)]
        fail_after_spawn: false,
    };
    start_with(shared, cfg, first_worker, stop, &with)
}

/// [`start`]. On a failure, the threads started before it are stopped
/// (through `stop`, which the daemon's start, failing with it, sets
/// anyway) and joined, and the fnat ports are given back to the kernel:
/// the threads used to be left running on their own, and the ports
/// reserved until the next reboot.
fn start_with(
    shared: &Arc<Shared>,
    cfg: &PacketConfig,
    first_worker: usize,
    stop: Arc<AtomicBool>,
    with: &StartWith<'_>,
) -> anyhow::Result<(Arc<PacketRuntime>, Vec<std::thread::JoinHandle<()>>)> {
    let Some(path) = shared.packet.get().cloned() else {
        anyhow::bail!("packet mode: the packet path was not set up");
    };
    // Given back when dropped: on an error below, or by
    // `PacketRuntime::release` when the daemon stops.
    let reserved = if cfg.local_addresses.is_empty() {
        None
    } else {
        reserve_ports(with.reserved_ports, cfg.fnat_ports.lo..=cfg.fnat_ports.hi)?
    };
    let mut threads = Vec::new();
    match attach(shared, cfg, first_worker, &stop, &path, &mut threads, with) {
        Ok(rt) => {
            *rt.reserved.lock() = reserved;
            Ok((rt, threads))
        }
        Err(e) => {
            stop.store(true, Relaxed);
            for t in threads {
                let _ = t.join();
            }
            drop(reserved);
            Err(e)
        }
    }
}

/// [`start_with`]'s attaching and spawning; every thread it starts is in
/// `threads`, whether it fails or not.
fn attach(
    shared: &Arc<Shared>,
    cfg: &PacketConfig,
    first_worker: usize,
    stop: &Arc<AtomicBool>,
    path: &Arc<super::packet::PacketPath>,
    threads: &mut Vec<std::thread::JoinHandle<()>>,
    #[cfg_attr(not(test), allow(unused_variables))] with: &StartWith<'_>,
) -> anyhow::Result<Arc<PacketRuntime>> {
    let mut steering = Vec::new();
    let mut ios = Vec::new();
    let hosts = host_addrs();
    // Workers: AF_XDP queue q of every interface that has one goes to the
    // same worker, so a frame that arrives on one interface and leaves by
    // another (client and backend sides apart) is copied between two
    // sockets of one thread. An AF_PACKET socket is a worker of its own.
    let mut xdp_workers: Vec<Vec<(u32, XskSocket)>> = Vec::new();
    let mut packet_workers: Vec<(u32, String, PacketSocket)> = Vec::new();
    for (n, iface) in cfg.interfaces.iter().enumerate() {
        let ifindex = ifindex(iface)?;
        let attached = match cfg.io {
            PacketIo::Afpacket => None,
            PacketIo::Xdp => Some(attach_xdp(iface, cfg.xdp_ring_size)?),
            PacketIo::Auto => match attach_xdp(iface, cfg.xdp_ring_size) {
                Ok(x) => Some(x),
                Err(e) => {
                    tracing::warn!(interface = %iface, "AF_XDP unavailable ({e:#}); using AF_PACKET");
                    None
                }
            },
        };
        match attached {
            Some((mut st, socks)) => {
                for sock in socks {
                    st.register_socket(sock.queue(), &sock).with_context(|| {
                        format!("packet mode: registering {iface:?} queue {}", sock.queue())
                    })?;
                    let q = sock.queue() as usize;
                    if xdp_workers.len() <= q {
                        xdp_workers.resize_with(q + 1, Vec::new);
                    }
                    xdp_workers[q].push((ifindex, sock));
                }
                // The host's own addresses: backends' answers to the kernel's
                // connections (health checks) stay the kernel's. Kept in
                // step afterwards by `sync_hosts`.
                for &addr in &hosts {
                    st.add_host(addr)
                        .with_context(|| format!("packet mode: registering host address {addr}"))?;
                }
                // fnat: replies to weir's local addresses, on its port range only.
                for &local in &cfg.local_addresses {
                    for proto in [6, 17] {
                        st.add_local(local, proto, cfg.fnat_ports.lo..=cfg.fnat_ports.hi)
                            .with_context(|| {
                                format!("packet mode: steering fnat replies to {local}")
                            })?;
                    }
                }
                tracing::info!(interface = %iface, mode = ?st.mode(), "packet mode attached (AF_XDP)");
                steering.push(st);
                ios.push("xdp");
            }
            None => {
                let workers = afpacket_workers(cfg, shared);
                let pcfg = PacketSocketConfig {
                    // One fanout group per interface (ids are per namespace).
                    fanout: Some(0x5700 + n as u16),
                    ..PacketSocketConfig::default()
                };
                for q in 0..workers {
                    let sock = PacketSocket::bind(iface, pcfg).with_context(|| {
                        format!("packet mode: AF_PACKET socket on {iface:?} (needs root)")
                    })?;
                    packet_workers.push((ifindex, format!("weir-pkt-{iface}-{q}"), sock));
                }
                tracing::info!(interface = %iface, workers, "packet mode attached (AF_PACKET)");
                ios.push("afpacket");
            }
        }
    }
    // Where backends' replies may arrive (empty: anywhere).
    let reply_ifindexes = cfg
        .backend_interfaces
        .iter()
        .map(|name| ifindex(name))
        .collect::<anyhow::Result<Vec<u32>>>()?;
    let mut worker = first_worker;
    let mut spawn = |name: String, egress: Vec<u32>, socks: Socks| -> anyhow::Result<()> {
        let engine = Engine::new(
            shared.clone(),
            path.clone(),
            next_hops()?,
            egress,
            rand::random(),
            &name,
        )
        .with_reply_interfaces(reply_ifindexes.clone());
        let stop = stop.clone();
        let idx = worker;
        worker += 1;
        let beat = shared.liveness.register(name.clone());
        threads.push(
            std::thread::Builder::new()
                .name(name)
                .spawn(move || worker_main(engine, socks, idx, stop, beat))
                .context("spawning a packet worker")?,
        );
        Ok(())
    };
    for (q, socks) in xdp_workers.into_iter().enumerate() {
        if socks.is_empty() {
            continue;
        }
        let egress = socks.iter().map(|(ix, _)| *ix).collect();
        spawn(format!("weir-pkt-q{q}"), egress, Socks::Xdp(socks))?;
    }
    for (ix, name, sock) in packet_workers {
        spawn(name, vec![ix], Socks::Packet(ix, Box::new(sock)))?;
    }
    #[cfg(test)]
    if with.fail_after_spawn {
        anyhow::bail!("packet mode: failing after the workers started (test)");
    }
    ios.dedup();
    let _ = path.io.set(ios.join("+"));
    let xdp = !steering.is_empty();
    let fnat_guard = if ios.contains(&"afpacket") && !cfg.local_addresses.is_empty() {
        Some(FnatGuard::install(cfg)?)
    } else {
        None
    };
    let rt = Arc::new(PacketRuntime {
        steering: Mutex::new(steering),
        steered: Mutex::new(SteerSync::default()),
        hosts: Mutex::new(hosts),
        fnat_guard: Mutex::new(fnat_guard),
        reserved: Mutex::new(None),
    });
    if xdp {
        let rt = rt.clone();
        let stop = stop.clone();
        threads.push(
            std::thread::Builder::new()
                .name("weir-pkt-hosts".into())
                .spawn(move || {
                    let mut last = std::time::Instant::now();
                    while !stop.load(Relaxed) {
                        // Short naps so shutdown never waits a whole period.
                        std::thread::sleep(Duration::from_millis(100));
                        if last.elapsed() >= HOSTS_EVERY {
                            last = std::time::Instant::now();
                            rt.sync_hosts(&host_addrs());
                            rt.retry_steering();
                        }
                    }
                })
                .context("spawning the host address watcher")?,
        );
    }
    Ok(rt)
}

/// The steering program on `iface` and an AF_XDP socket on each of its
/// queues, with rings of `ring_size` entries (`[packet] xdp_ring_size`) and
/// twice as many UMEM frames.
fn attach_xdp(iface: &str, ring_size: u32) -> anyhow::Result<(Steering, Vec<XskSocket>)> {
    if !weir_packet_io::PROGRAM_BUILT {
        anyhow::bail!(
            "this weir was built without its XDP program (clang was missing at build time; \
             install clang and rebuild)"
        );
    }
    let st = Steering::attach(iface)
        .with_context(|| format!("packet mode: attaching to interface {iface:?} (needs root)"))?;
    let xsk = XskConfig {
        frames: 2 * ring_size,
        ring_size,
        ..XskConfig::default()
    };
    let socks = XskSocket::bind_all(iface, xsk)
        .with_context(|| format!("packet mode: AF_XDP sockets on {iface:?}"))?;
    Ok((st, socks))
}

/// AF_PACKET workers per interface: `[packet] workers`, else `[daemon]
/// workers`' count.
fn afpacket_workers(cfg: &PacketConfig, shared: &Shared) -> usize {
    if cfg.workers > 0 {
        cfg.workers
    } else {
        shared.workers.len().max(1)
    }
}

/// A packet worker's sockets: AF_XDP on one queue of one or more
/// interfaces (by ifindex), or one AF_PACKET socket.
enum Socks {
    Xdp(Vec<(u32, XskSocket)>),
    Packet(u32, Box<PacketSocket>),
}

/// Takes fnat's port range out of the kernel's ephemeral ports in this
/// network namespace (`net.ipv4.ip_local_reserved_ports`, which covers
/// IPv6 too, at `path`), so the kernel's own connections from a local
/// address never pick a port weir maps: its replies would be steered to
/// weir. `None` when every port of the range was reserved already.
fn reserve_ports(
    path: &std::path::Path,
    range: std::ops::RangeInclusive<u16>,
) -> anyhow::Result<Option<PortReservation>> {
    let ours = format!("{}-{}", range.start(), range.end());
    let cur = std::fs::read_to_string(path).unwrap_or_default();
    let mut ports = parse_ports(&cur)
        .with_context(|| format!("packet mode: reading {}: {:?}", path.display(), cur.trim()))?;
    let added: Vec<u16> = range.filter(|&p| !ports[usize::from(p)]).collect();
    if added.is_empty() {
        return Ok(None);
    }
    for &p in &added {
        ports[usize::from(p)] = true;
    }
    write_ports(path, &ports).with_context(|| {
        format!(
            "packet mode: reserving fnat ports {ours} in {} (needs root)",
            path.display()
        )
    })?;
    tracing::info!(ports = %ours, "fnat ports reserved from the kernel's ephemeral ports");
    Ok(Some(PortReservation {
        path: path.to_owned(),
        added,
    }))
}

/// The ports [`reserve_ports`] added to `net.ipv4.ip_local_reserved_ports`
/// (not those reserved before), given back when dropped: taken out of the
/// sysctl's value as it is then, so that what else changed it meanwhile
/// stays. It used to stay changed for good, after a stop and after a
/// failed start alike.
#[derive(Debug)]
pub(crate) struct PortReservation {
    path: std::path::PathBuf,
    added: Vec<u16>,
}

impl Drop for PortReservation {
    fn drop(&mut self) {
        let cur = std::fs::read_to_string(&self.path).unwrap_or_default();
        let r = parse_ports(&cur).and_then(|mut ports| {
            for &p in &self.added {
                ports[usize::from(p)] = false;
            }
            write_ports(&self.path, &ports)
        });
        match r {
            Ok(()) => tracing::info!(
                path = %self.path.display(),
                "fnat ports given back to the kernel's ephemeral ports"
            ),
            Err(e) => tracing::warn!(
                path = %self.path.display(),
                "giving the fnat ports back to the kernel: {e:#}"
            ),
        }
    }
}

/// A port list as the sysctl shows it ("1000-2000,8080"; empty for none)
/// as one flag per port.
fn parse_ports(list: &str) -> anyhow::Result<Vec<bool>> {
    let mut ports = vec![false; 1 << 16];
    for part in list
        .trim()
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let lo: u16 = lo
            .trim()
            .parse()
            .with_context(|| format!("not a port: {part:?}"))?;
        let hi: u16 = hi
            .trim()
            .parse()
            .with_context(|| format!("not a port: {part:?}"))?;
        if lo > hi {
            anyhow::bail!("not a port range: {part:?}");
        }
        ports[usize::from(lo)..=usize::from(hi)].fill(true);
    }
    Ok(ports)
}

/// Writes `ports` (one flag per port) as the sysctl takes them: ranges,
/// comma-separated, ending with a newline (the kernel clears the list on a
/// lone newline, and ignores an empty write).
fn write_ports(path: &std::path::Path, ports: &[bool]) -> anyhow::Result<()> {
    let mut out = Vec::new();
    let mut p = 0;
    while p < ports.len() {
        if !ports[p] {
            p += 1;
            continue;
        }
        let lo = p;
        while p < ports.len() && ports[p] {
            p += 1;
        }
        out.push(if p - 1 == lo {
            lo.to_string()
        } else {
            format!("{lo}-{}", p - 1)
        });
    }
    std::fs::write(path, format!("{}\n", out.join(",")))?;
    Ok(())
}

/// Counter shards packet workers may need: per interface, one per receive
/// queue (AF_XDP) or `[packet] workers` (AF_PACKET), whichever is more.
pub(crate) fn queue_count(cfg: &PacketConfig, daemon_workers: usize) -> anyhow::Result<usize> {
    let mut n = 0;
    let afpacket = if cfg.workers > 0 {
        cfg.workers
    } else {
        daemon_workers.max(1)
    };
    for iface in &cfg.interfaces {
        let queues = weir_packet_io::rx_queue_count(iface)
            .with_context(|| format!("packet mode: interface {iface:?}"))?
            as usize;
        n += queues.max(afpacket);
    }
    Ok(n)
}

/// Every address of every interface in this network namespace.
fn host_addrs() -> Vec<std::net::IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    let mut out: Vec<std::net::IpAddr> = addrs
        .filter_map(|a| {
            let a = a.address?;
            a.as_sockaddr_in()
                .map(|s| std::net::IpAddr::V4(s.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|s| std::net::IpAddr::V6(s.ip())))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Every interface with an address: its index, MTU (sysfs) and first IPv4
/// and first non-link-local IPv6 address.
fn links() -> Vec<super::packet::Link> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    let mut out: Vec<(String, super::packet::Link)> = Vec::new();
    for a in addrs {
        let at = match out.iter().position(|(n, _)| *n == a.interface_name) {
            Some(i) => i,
            None => {
                let name = a.interface_name.clone();
                let Some(ifindex) = read_sys(&name, "ifindex") else {
                    continue;
                };
                let mtu = read_sys(&name, "mtu").unwrap_or(u32::MAX);
                out.push((
                    name,
                    super::packet::Link {
                        ifindex,
                        mtu,
                        v4: None,
                        v6: None,
                    },
                ));
                out.len() - 1
            }
        };
        let link = &mut out[at].1;
        if let Some(s) = a.address.as_ref().and_then(|s| s.as_sockaddr_in()) {
            link.v4.get_or_insert(s.ip());
        } else if let Some(s) = a.address.as_ref().and_then(|s| s.as_sockaddr_in6())
            && !s.ip().is_unicast_link_local()
        {
            link.v6.get_or_insert(s.ip());
        }
    }
    out.into_iter().map(|(_, l)| l).collect()
}

fn read_sys(iface: &str, what: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/sys/class/net/{iface}/{what}"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Next hops from the kernel's routing and neighbour tables (netlink),
/// cached per destination for a second (100 ms while unresolved).
struct KernelHops(weir_packet_io::Resolver);

impl NextHops for KernelHops {
    fn links(&mut self) -> Vec<super::packet::Link> {
        links()
    }

    fn next_hop(&mut self, dst: std::net::IpAddr) -> Option<(u32, weir_packet::NextHop)> {
        match self.0.resolve(dst, std::time::Instant::now()) {
            Ok(weir_packet_io::Resolution::Resolved {
                ifindex, next_hop, ..
            }) => Some((ifindex, next_hop)),
            Ok(_) => None,
            Err(e) => {
                tracing::debug!(%dst, "next hop: {e}");
                None
            }
        }
    }
}

fn next_hops() -> anyhow::Result<Box<dyn NextHops>> {
    let r = weir_packet_io::Resolver::new(weir_packet_io::CacheConfig::default())
        .context("packet mode: opening a netlink route socket")?;
    Ok(Box::new(KernelHops(r)))
}

fn ifindex(iface: &str) -> anyhow::Result<u32> {
    let path = format!("/sys/class/net/{iface}/ifindex");
    std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .with_context(|| format!("packet mode: no interface {iface:?} in this network namespace"))
}

fn worker_main(
    mut engine: Engine,
    mut socks: Socks,
    idx: usize,
    stop: Arc<AtomicBool>,
    beat: Arc<super::liveness::Beat>,
) {
    // However the thread ends, the systemd watchdog learns it.
    let _alive = super::liveness::guard(&beat);
    super::stats::set_worker_index(idx);
    run_worker(&mut engine, &mut socks, &stop, &beat);
}

/// How often a worker reads its sockets' kernel drop counts.
const KERNEL_DROPS_EVERY: Duration = Duration::from_secs(1);

impl Socks {
    /// The sums of the sockets' kernel drop counts.
    fn kernel_drops(&mut self) -> Result<weir_packet_io::KernelDrops, String> {
        let mut sum = weir_packet_io::KernelDrops::default();
        match self {
            Socks::Packet(_, s) => sum += s.kernel_drops().map_err(|e| e.to_string())?,
            Socks::Xdp(v) => {
                for (_, s) in v.iter() {
                    sum += s.kernel_drops().map_err(|e| e.to_string())?;
                }
            }
        }
        Ok(sum)
    }
}

/// When a worker last read its sockets' kernel drop counts.
struct DropReader {
    last: std::time::Instant,
    warned: bool,
}

impl DropReader {
    /// Publishes the sockets' kernel drop counts in the worker's counters
    /// at most every [`KERNEL_DROPS_EVERY`] (always when `force`). A failed
    /// read is logged once and never stops the data path.
    fn publish(&mut self, engine: &Engine, socks: &mut Socks, force: bool) {
        let now = std::time::Instant::now();
        if !force && now.duration_since(self.last) < KERNEL_DROPS_EVERY {
            return;
        }
        self.last = now;
        match socks.kernel_drops() {
            Ok(d) => engine.counters().set_kernel_drops(d),
            Err(e) if !self.warned => {
                self.warned = true;
                tracing::warn!("packet worker: cannot read its sockets' kernel drop counts: {e}");
            }
            Err(_) => {}
        }
    }
}

fn run_worker(
    engine: &mut Engine,
    socks: &mut Socks,
    stop: &AtomicBool,
    beat: &super::liveness::Beat,
) {
    let mut drops = DropReader {
        last: std::time::Instant::now(),
        warned: false,
    };
    let fds: Vec<_> = match socks {
        Socks::Xdp(v) if v.len() > 1 => v.iter().map(|(_, s)| s.as_raw_fd()).collect(),
        _ => Vec::new(),
    };
    let mut ready = Vec::new();
    keep_turning(stop, ERROR_PAUSE, || {
        // The worker's sign of life for the systemd watchdog: one relaxed
        // add per turn (a turn waits at most 100 ms for frames).
        beat.beat();
        engine.refresh();
        let r = turn(engine, socks, &fds, &mut ready);
        drops.publish(engine, socks, false);
        r
    });
    // The last figures.
    drops.publish(engine, socks, true);
}

/// How long a packet worker waits after a failed turn before the next one.
const ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Calls `turn` until `stop` is set. A failed (or panicking) turn is logged (one line a
/// second for all workers, with a count of the others) and followed by a
/// pause of `pause` (cut short by `stop`), never by the end of the worker:
/// it used to end the worker's thread, and with it its queues on every
/// interface, for good — e.g. on the `ENETDOWN` a kick of the tx ring gets
/// while one of its interfaces is down for a moment, after which the
/// steering program kept sending that queue's frames to a socket nobody
/// read, while the daemon (and the systemd watchdog) carried on. Returns
/// how many turns failed.
fn keep_turning(
    stop: &AtomicBool,
    pause: Duration,
    mut turn: impl FnMut() -> Result<(), String>,
) -> u64 {
    let mut failed = 0;
    while !stop.load(Relaxed) {
        // A panic (a bug meeting some frame) is a failed turn too: it used
        // to end the thread the same way, so a frame that met the bug
        // could take one queue after another away. The batch's frames go
        // back to the UMEM (weir-packet-io frees what a panicked callback
        // left); the worker's state is memory-safe, at worst a count off.
        let r = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut turn)) {
            Ok(r) => r,
            Err(panic) => Err(format!(
                "panicked: {}",
                panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".into())
            )),
        };
        if let Err(e) = r {
            failed += 1;
            static GATE: super::ratelog::RateLimited = super::ratelog::RateLimited::new(1000);
            super::ratelog::warn(
                &GATE,
                format_args!(
                    "packet worker {}: {e}; trying again in {} ms",
                    super::stats::worker_index(),
                    pause.as_millis()
                ),
            );
            let until = std::time::Instant::now() + pause;
            while !stop.load(Relaxed) {
                let left = until.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    break;
                }
                std::thread::sleep(left.min(Duration::from_millis(10)));
            }
        }
    }
    failed
}

/// One turn of a worker: wait up to 100 ms for frames, process and send a
/// batch (of each ready socket, when the worker has several).
fn turn(
    engine: &mut Engine,
    socks: &mut Socks,
    fds: &[std::os::fd::RawFd],
    ready: &mut Vec<bool>,
) -> Result<(), String> {
    let timeout = Duration::from_millis(100);
    let mut no_egress = |_: u32, _: &[u8]| false;
    match socks {
        // What the I/O could not send was counted sent by the engine:
        // `unsent` takes it back and counts it dropped (`tx_full`).
        Socks::Packet(ix, s) => {
            let ix = *ix;
            let st = s
                .run_batch_all(timeout, |b| engine.process_batch(b, ix, &mut no_egress))
                .map_err(|e| e.to_string())?;
            engine.unsent(st.tx_full);
        }
        Socks::Xdp(v) if v.len() == 1 => {
            let (ix, s) = &mut v[0];
            let ix = *ix;
            let st = s
                .run_batch_all(timeout, |b| engine.process_batch(b, ix, &mut no_egress))
                .map_err(|e| e.to_string())?;
            engine.unsent(st.tx_full);
        }
        Socks::Xdp(v) => {
            weir_packet_io::poll_readable(fds, timeout, ready).map_err(|e| e.to_string())?;
            for k in 0..v.len() {
                if !ready.get(k).copied().unwrap_or(false) {
                    continue;
                }
                let (before, rest) = v.split_at_mut(k);
                let Some(((ix, cur), after)) = rest.split_first_mut() else {
                    break;
                };
                let mut egress = |to: u32, frame: &[u8]| {
                    before
                        .iter_mut()
                        .chain(after.iter_mut())
                        .find(|(i, _)| *i == to)
                        .is_some_and(|(_, s)| s.queue_copy(frame))
                };
                let st = cur
                    .run_batch_all(Duration::ZERO, |b| {
                        engine.process_batch(b, *ix, &mut egress)
                    })
                    .map_err(|e| e.to_string())?;
                engine.unsent(st.tx_full);
            }
            // Send what was copied to the other interfaces.
            for (_, s) in v.iter_mut() {
                let st = s.flush().map_err(|e| e.to_string())?;
                engine.unsent(st.tx_full);
            }
        }
    }
    Ok(())
}

impl PacketRuntime {
    /// Undo what was set up outside the process (the fnat nftables table,
    /// the reserved fnat ports): the daemon is stopping.
    pub(crate) fn release(&self) {
        drop(self.fnat_guard.lock().take());
        drop(self.reserved.lock().take());
    }

    /// Make the steering programs' host addresses `now`'s: an address
    /// added to the host after start becomes the kernel's (a backend's
    /// answer to it passes to the kernel, not to weir), a removed one stops
    /// being. A map that cannot be updated is logged and retried next time.
    pub(crate) fn sync_hosts(&self, now: &[std::net::IpAddr]) {
        let mut have = self.hosts.lock();
        if *have == now {
            return;
        }
        let (gone, new) = (missing(&have, now), missing(now, &have));
        let mut ok = true;
        for st in self.steering.lock().iter_mut() {
            let r = (|| {
                for a in &gone {
                    st.remove_host(**a)?;
                }
                for a in &new {
                    st.add_host(**a)?;
                }
                Ok::<_, weir_packet_io::SteerError>(())
            })();
            if let Err(e) = r {
                ok = false;
                tracing::error!(interface = %st.interface(), "steering host addresses: {e}");
            }
        }
        if ok {
            tracing::info!(addresses = now.len(), "packet mode: host addresses changed");
            *have = now.to_vec();
        }
    }

    /// Make the steering maps hold exactly what the packet services need:
    /// their VIPs, and the nat backends (whose replies come back to weir).
    pub(crate) fn sync(&self, shared: &Shared) {
        let want = wanted_keys(shared);
        let mut steered = self.steered.lock();
        let mut steering = self.steering.lock();
        steered.sync(&mut steering[..], want, false);
    }

    /// Tries again the steering changes the kernel refused, if any (every
    /// [`HOSTS_EVERY`]): they used to wait for the next change of the
    /// services, which may never come, and a VIP refused once went
    /// unanswered meanwhile.
    pub(crate) fn retry_steering(&self) {
        let mut steered = self.steered.lock();
        if steered.pending.is_none() {
            return;
        }
        let mut steering = self.steering.lock();
        steered.retry(&mut steering[..]);
    }
}

/// What the steering maps hold as far as weir knows, and what the last
/// sync wanted while the kernel refused some of it.
#[derive(Debug, Default)]
struct SteerSync {
    /// What the maps hold now, for diffs.
    have: Steered,
    /// The last sync's wanted keys, while some change towards them was
    /// refused: [`Self::retry`] tries again.
    pending: Option<Steered>,
}

impl SteerSync {
    /// Brings the maps to `want` ([`apply_steered`]); what the kernel
    /// refused stays pending for [`Self::retry`].
    fn sync<M: SteerMaps>(&mut self, maps: &mut [M], want: Steered, retrying: bool) {
        let now = apply_steered(maps, &self.have, want.clone(), retrying);
        // `apply_steered` returns `want` as it was unless a change was
        // refused (a refused add is left out, a refused removal kept).
        self.pending = (now != want).then_some(want);
        self.have = now;
    }

    /// Tries again, with no change of the services, what the last sync
    /// could not do (a full map may have room now, an error may have
    /// passed). Returns whether some is still refused.
    fn retry<M: SteerMaps>(&mut self, maps: &mut [M]) -> bool {
        if let Some(want) = self.pending.take() {
            self.sync(maps, want, true);
            if self.pending.is_none() {
                tracing::info!("steering: the changes refused before are made now");
            }
        }
        self.pending.is_some()
    }
}

/// The map changes a steering sync makes on one interface's program.
trait SteerMaps {
    fn interface(&self) -> &str;
    fn add(&mut self, k: SteerKey) -> Result<(), String>;
    fn remove(&mut self, k: &SteerKey) -> Result<(), String>;
    fn add_backend(&mut self, k: SteerKey) -> Result<(), String>;
    fn remove_backend(&mut self, k: &SteerKey) -> Result<(), String>;
}

impl SteerMaps for Steering {
    fn interface(&self) -> &str {
        Steering::interface(self)
    }
    fn add(&mut self, k: SteerKey) -> Result<(), String> {
        Steering::add(self, k).map_err(|e| e.to_string())
    }
    fn remove(&mut self, k: &SteerKey) -> Result<(), String> {
        Steering::remove(self, k).map_err(|e| e.to_string())
    }
    fn add_backend(&mut self, k: SteerKey) -> Result<(), String> {
        Steering::add_backend(self, k).map_err(|e| e.to_string())
    }
    fn remove_backend(&mut self, k: &SteerKey) -> Result<(), String> {
        Steering::remove_backend(self, k).map_err(|e| e.to_string())
    }
}

/// Brings every interface's maps from `have` to `want`; returns what they
/// hold now, for the next sync to diff against. Each key is its own change:
/// one the kernel refuses (a full map) is logged and stops none of the
/// others, and is left out of (a refused add) or kept in (a refused
/// removal) the result, so the next sync or retry tries it again.
///
/// `retrying`: a retry of refused changes, whose failures were logged as
/// errors already (logged at debug level).
fn apply_steered<M: SteerMaps>(
    maps: &mut [M],
    have: &Steered,
    mut want: Steered,
    retrying: bool,
) -> Steered {
    // Diffed once, whatever the number of interfaces.
    let gone_vips = missing(&have.vips, &want.vips);
    let gone_backends = missing(&have.backends, &want.backends);
    let new_vips = missing(&want.vips, &have.vips);
    let new_backends = missing(&want.backends, &have.backends);
    let mut failed_adds: HashSet<(bool, SteerKey)> = HashSet::new();
    let mut failed_removals: Vec<(bool, SteerKey)> = Vec::new();
    for st in maps.iter_mut() {
        let mut errors = Vec::new();
        for (backend, k) in gone_vips
            .iter()
            .map(|k| (false, **k))
            .chain(gone_backends.iter().map(|k| (true, **k)))
        {
            let r = if backend {
                st.remove_backend(&k)
            } else {
                st.remove(&k)
            };
            if let Err(e) = r {
                errors.push(e);
                failed_removals.push((backend, k));
            }
        }
        for (backend, k) in new_vips
            .iter()
            .map(|k| (false, **k))
            .chain(new_backends.iter().map(|k| (true, **k)))
        {
            let r = if backend {
                st.add_backend(k)
            } else {
                st.add(k)
            };
            if let Err(e) = r {
                errors.push(e);
                failed_adds.insert((backend, k));
            }
        }
        match errors.first() {
            Some(first) if retrying => tracing::debug!(
                interface = %st.interface(),
                failed = errors.len(),
                "steering: {first} (still refused; tried again in a second)"
            ),
            Some(first) => tracing::error!(
                interface = %st.interface(),
                failed = errors.len(),
                "steering: {first} (tried again every second until it is made)"
            ),
            None => {}
        }
    }
    if failed_adds.is_empty() && failed_removals.is_empty() {
        return want;
    }
    want.vips.retain(|k| !failed_adds.contains(&(false, *k)));
    want.backends.retain(|k| !failed_adds.contains(&(true, *k)));
    for (backend, k) in dedup_in_order(failed_removals) {
        if backend {
            want.backends.push(k);
        } else {
            want.vips.push(k);
        }
    }
    want
}

/// The items of `from` that are not in `other`, in `from`'s order.
///
/// Through a hash set: `other.contains` per item made a steering sync,
/// run on the admin request of every service change, O(VIPs²) — 1.4 s +
/// 6.5 s per edit at 65,536 VIPs (the steering map's cap), 32 + 153 ms at
/// 10,000.
fn missing<'a, T: Eq + Hash>(from: &'a [T], other: &[T]) -> Vec<&'a T> {
    let other: HashSet<&T> = other.iter().collect();
    from.iter().filter(|x| !other.contains(x)).collect()
}

/// `items` without repeats, each where it first was; through a hash set
/// for the same reason as [`missing`].
fn dedup_in_order<T: Copy + Eq + Hash>(mut items: Vec<T>) -> Vec<T> {
    let mut seen = HashSet::with_capacity(items.len());
    items.retain(|x| seen.insert(*x));
    items
}

/// What the steering maps should hold, each key once.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Steered {
    vips: Vec<SteerKey>,
    backends: Vec<SteerKey>,
}

fn wanted_keys(shared: &Shared) -> Steered {
    let st = shared.model.load();
    let mut want = Steered::default();
    let key = |p: crate::config::Protocol, a| match p {
        crate::config::Protocol::Tcp => SteerKey::tcp(a),
        crate::config::Protocol::Udp => SteerKey::udp(a),
    };
    for svc in st.services.values() {
        let spec = svc.spec.read();
        let Some(method) = super::packet::method(spec.forward) else {
            continue;
        };
        want.vips.push(key(spec.protocol, svc.listen));
        if method == weir_packet::Method::Nat {
            let backends = svc.set.load();
            want.backends
                .extend(backends.backends.iter().map(|b| key(spec.protocol, b.addr)));
        }
    }
    want.vips = dedup_in_order(want.vips);
    want.backends = dedup_in_order(want.backends);
    want
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;

    /// fnat's ports are reserved in the sysctl (here a file of the test's)
    /// and given back when the reservation drops: only the ports weir
    /// added, from the value as it is then, so ports reserved before weir
    /// and changes made meanwhile stay.
    #[test]
    fn reserved_ports_are_given_back_and_only_ours() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ip_local_reserved_ports");
        let read = || std::fs::read_to_string(&path).unwrap().trim().to_owned();
        let set = |v: &str| std::fs::write(&path, format!("{v}\n")).unwrap();
        // Empty before: empty after (the kernel clears on a lone newline).
        set("");
        let r = reserve_ports(&path, 20000..=20010).unwrap().unwrap();
        assert_eq!(read(), "20000-20010");
        drop(r);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "\n");
        // Others' ports around and inside the range stay; so does a port
        // someone reserved while weir ran.
        set("8080,20005-20020");
        let r = reserve_ports(&path, 20000..=20010).unwrap().unwrap();
        assert_eq!(read(), "8080,20000-20020");
        set("8080,9000,20000-20020");
        drop(r);
        assert_eq!(read(), "8080,9000,20005-20020");
        // Every port reserved already: nothing to change, nothing to undo.
        set("1-65535");
        assert!(reserve_ports(&path, 20000..=20010).unwrap().is_none());
        assert_eq!(read(), "1-65535");
        // A value that is not a port list is an error, and left alone.
        set("bogus");
        assert!(reserve_ports(&path, 20000..=20010).is_err());
        assert_eq!(read(), "bogus");
    }

    /// A packet-mode start that fails gives the fnat ports back, and
    /// stops and joins the workers it had started: they used to run on,
    /// detached, and the ports stayed reserved.
    #[test]
    fn a_failed_start_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ip_local_reserved_ports");
        std::fs::write(&path, "8080\n").unwrap();
        let start = |iface: &str, fail_after_spawn: bool| {
            let toml = "[daemon]\nworkers = 1\n[packet]\ninterfaces = [\"lo\"]\n\
                        io = \"afpacket\"\nworkers = 2\nlocal_addresses = [\"10.0.1.1\"]\n\
                        fnat_ports = \"20000-20010\"\n";
            let cfg: crate::config::Config = toml::from_str(toml).unwrap();
            let d = super::super::Daemon::start_inner(cfg.clone(), None, false).unwrap();
            // The config names a real interface (the start checks that);
            // the attach is asked for `iface`.
            let mut pcfg = cfg.packet.clone().unwrap();
            pcfg.interfaces = vec![iface.to_owned()];
            let with = StartWith {
                reserved_ports: &path,
                fail_after_spawn,
            };
            let stop = Arc::new(AtomicBool::new(false));
            let r = start_with(&d.shared, &pcfg, 0, stop, &with);
            let threads: Vec<String> = std::fs::read_dir("/proc/self/task")
                .unwrap()
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|c| c.starts_with(&format!("weir-pkt-{iface}")))
                .collect();
            let reserved = std::fs::read_to_string(&path).unwrap();
            drop(d);
            (r.map(|_| ()), threads, reserved)
        };
        // Before any worker: an interface that is not there.
        let (r, threads, before) = start("weirnosuch0", false);
        let e = format!("{:#}", r.unwrap_err());
        assert!(e.contains("weirnosuch0"), "{e}");
        assert!(threads.is_empty(), "{threads:?}");
        // After the workers: AF_PACKET on lo (needs root).
        let (r, threads, after) = start("lo", true);
        let e = format!("{:#}", r.unwrap_err());
        if e.contains("AF_PACKET socket") {
            eprintln!("skipped the workers' part (needs root): {e}");
            assert_eq!(before.trim(), "8080");
            return;
        }
        assert!(e.contains("failing after the workers started"), "{e}");
        assert_eq!(
            (before.trim(), after.trim(), threads),
            ("8080", "8080", Vec::<String>::new()),
            "the reserved ports after each failed start, and workers left running"
        );
    }

    /// A failed turn (an interface down for a moment makes the tx kick
    /// fail with ENETDOWN) does not end the worker: it pauses and turns
    /// again until stopped. The first error used to end the worker's
    /// thread for good, leaving its queues unserved.
    #[test]
    fn a_worker_keeps_turning_after_a_failed_turn() {
        let stop = AtomicBool::new(false);
        let mut calls = 0;
        let failed = keep_turning(&stop, Duration::from_millis(1), || {
            calls += 1;
            if calls == 5 {
                stop.store(true, Relaxed);
            }
            if calls <= 2 {
                Err("sendto: Network is down (os error 100)".into())
            } else {
                Ok(())
            }
        });
        assert_eq!((calls, failed), (5, 2));
        // A stop during the pause ends it at once (bounded: the pause
        // checks `stop`).
        let stop = AtomicBool::new(false);
        let t0 = std::time::Instant::now();
        let failed = keep_turning(&stop, Duration::from_secs(3600), || {
            stop.store(true, Relaxed);
            Err("down".into())
        });
        assert_eq!(failed, 1);
        assert!(t0.elapsed() < Duration::from_secs(60));
    }

    /// A turn that panics (a bug meeting some frame) is a failed turn: the
    /// worker goes on. The panic used to end the worker's thread, its
    /// queues unserved for good while the daemon carried on.
    #[test]
    fn a_worker_keeps_turning_after_a_panicking_turn() {
        let stop = AtomicBool::new(false);
        let mut calls = 0;
        let failed = keep_turning(&stop, Duration::from_millis(1), || {
            calls += 1;
            if calls == 1 {
                panic!("a bug meeting a frame");
            }
            if calls == 3 {
                stop.store(true, Relaxed);
            }
            Ok(())
        });
        assert_eq!((calls, failed), (3, 1));
    }

    /// Steering maps of a fixed capacity, as the kernel's are: an add past
    /// it fails.
    #[derive(Default)]
    struct FakeMaps {
        cap: usize,
        vips: Vec<SteerKey>,
        backends: Vec<SteerKey>,
    }

    impl SteerMaps for FakeMaps {
        fn interface(&self) -> &str {
            "fake0"
        }
        fn add(&mut self, k: SteerKey) -> Result<(), String> {
            if self.vips.len() >= self.cap {
                return Err("steer: map full".into());
            }
            self.vips.push(k);
            Ok(())
        }
        fn remove(&mut self, k: &SteerKey) -> Result<(), String> {
            self.vips.retain(|x| x != k);
            Ok(())
        }
        fn add_backend(&mut self, k: SteerKey) -> Result<(), String> {
            if self.backends.len() >= self.cap {
                return Err("backends: map full".into());
            }
            self.backends.push(k);
            Ok(())
        }
        fn remove_backend(&mut self, k: &SteerKey) -> Result<(), String> {
            self.backends.retain(|x| x != k);
            Ok(())
        }
    }

    /// A key the kernel refused (its map full) is not taken for steered:
    /// the next sync adds it once there is room, and one refused key does
    /// not stop the other changes. A sync used to record every wanted key
    /// as steered whatever failed, and to skip the interface's remaining
    /// changes at the first failure: a VIP refused once was never steered
    /// (its service answered nothing) and a nat service's backends were
    /// not steered either.
    #[test]
    fn a_refused_steering_key_is_retried_and_stops_nothing_else() {
        let mut maps = [FakeMaps {
            cap: 2,
            ..FakeMaps::default()
        }];
        let want = |vips: &[usize], backends: &[usize]| Steered {
            vips: vips.iter().map(|&i| key(i)).collect(),
            backends: backends.iter().map(|&i| key(100 + i)).collect(),
        };
        let have = apply_steered(
            &mut maps,
            &Steered::default(),
            want(&[1, 2, 3], &[1]),
            false,
        );
        assert_eq!(maps[0].vips, [key(1), key(2)]);
        assert_eq!(
            maps[0].backends,
            [key(101)],
            "the backend after a refused VIP"
        );
        assert_eq!(have.vips, [key(1), key(2)]);
        // VIP 1 goes: room for VIP 3, which this sync must add.
        let have = apply_steered(&mut maps, &have, want(&[2, 3], &[1]), false);
        assert_eq!(maps[0].vips, [key(2), key(3)], "VIP 3 never steered");
        assert_eq!(have.vips, [key(2), key(3)]);
    }

    /// A key the kernel refused is tried again with no change of the
    /// services (the runtime retries every second): once the map takes it,
    /// it is steered. It used to wait for the next change of the services,
    /// which may never come, while its service answered nothing.
    #[test]
    fn a_refused_steering_key_is_retried_without_a_change_of_the_services() {
        let mut maps = [FakeMaps {
            cap: 2,
            ..FakeMaps::default()
        }];
        let vips = |v: &[usize]| Steered {
            vips: v.iter().map(|&i| key(i)).collect(),
            backends: Vec::new(),
        };
        let mut st = SteerSync::default();
        st.sync(&mut maps, vips(&[1, 2, 3]), false);
        assert_eq!(maps[0].vips, [key(1), key(2)]);
        // Still full: a retry makes no change, and VIP 3 stays pending.
        assert!(st.retry(&mut maps));
        assert_eq!(maps[0].vips, [key(1), key(2)]);
        // The map takes it now: the next retry steers VIP 3.
        maps[0].cap = 3;
        assert!(!st.retry(&mut maps), "VIP 3 still pending");
        assert_eq!(
            maps[0].vips,
            [key(1), key(2), key(3)],
            "VIP 3 never steered"
        );
        assert_eq!(st.have, vips(&[1, 2, 3]));
        // Nothing pending: a retry touches nothing.
        maps[0].cap = 0;
        assert!(!st.retry(&mut maps));
        assert_eq!(maps[0].vips.len(), 3);
    }

    /// Distinct TCP keys, one per `i`.
    fn key(i: usize) -> SteerKey {
        SteerKey::tcp(SocketAddr::from((
            [10, (i >> 16) as u8, (i >> 8) as u8, i as u8],
            80,
        )))
    }

    /// The steering diff of two large, overlapping key lists with repeats
    /// is the set difference, in the first list's order, repeats kept (as
    /// the quadratic filter it replaced gave, which took seconds at the
    /// steering map's cap of 65,536 VIPs). The expected lists are built
    /// from the indexes, not by another diff.
    #[test]
    fn missing_is_the_difference_in_order_for_large_lists() {
        // 20,000 entries over 15,000 keys (5,000 repeated), scrambled.
        let have: Vec<usize> = (0..20_000).map(|j| (j * 7919) % 15_000).collect();
        // 20,000 entries over keys 10,000..25,000.
        let want: Vec<usize> = (0..20_000).map(|j| 10_000 + (j * 7919) % 15_000).collect();
        let (have_k, want_k): (Vec<_>, Vec<_>) = (
            have.iter().map(|&i| key(i)).collect(),
            want.iter().map(|&i| key(i)).collect(),
        );
        let gone: Vec<SteerKey> = missing(&have_k, &want_k).into_iter().copied().collect();
        let expect: Vec<SteerKey> = have
            .iter()
            .filter(|&&i| i < 10_000)
            .map(|&i| key(i))
            .collect();
        assert_eq!(gone.len(), expect.len());
        assert!(gone == expect, "removed keys, in order");
        let new: Vec<SteerKey> = missing(&want_k, &have_k).into_iter().copied().collect();
        let expect: Vec<SteerKey> = want
            .iter()
            .filter(|&&i| i >= 15_000)
            .map(|&i| key(i))
            .collect();
        assert_eq!(new.len(), expect.len());
        assert!(new == expect, "added keys, in order");
        assert!(missing(&have_k, &have_k).is_empty());
        assert_eq!(missing(&have_k, &[]).len(), have_k.len());
    }

    /// Deduplicating a large key list keeps each key's first place.
    #[test]
    fn dedup_keeps_the_first_of_each_in_order_for_large_lists() {
        // 7919 is prime to 12,000: the first 12,000 entries are each key
        // once, the other 8,000 repeat the first 8,000.
        let keys: Vec<SteerKey> = (0..20_000).map(|j| key((j * 7919) % 12_000)).collect();
        let once = dedup_in_order(keys.clone());
        assert_eq!(once.len(), 12_000);
        assert!(once[..] == keys[..12_000], "first places, in order");
    }

    /// The keys a daemon's packet services want: each VIP once in service
    /// order, and each nat backend once (a backend of two services too),
    /// by protocol; dr backends' replies are not weir's.
    #[test]
    fn wanted_keys_lists_each_key_once_in_service_order() {
        let svc = |name: &str, proto: &str, listen: &str, fwd: &str, backends: &[&str]| {
            let mut s = format!(
                "[[service]]\nname = \"{name}\"\nprotocol = \"{proto}\"\nlisten = \"{listen}\"\n\
                 forward = \"{fwd}\"\nscheduler = \"rr\"\n"
            );
            for b in backends {
                s += &format!("[[service.backend]]\naddress = \"{b}\"\n");
            }
            s
        };
        let (b1, b2, b3) = ("10.0.1.2:8080", "10.0.1.3:8080", "10.0.1.4:8080");
        let toml = [
            "[daemon]\nworkers = 1\n[packet]\ninterfaces = [\"lo\"]\n\
             local_addresses = [\"10.0.1.1\"]\n[[tenant]]\nname = \"default\"\n"
                .to_owned(),
            svc("a", "tcp", "10.0.0.1:80", "nat", &[b1, b2]),
            svc("b", "tcp", "10.0.0.2:80", "nat", &[b2, b3, b1]),
            svc("c", "udp", "10.0.0.1:80", "nat", &[b1]),
            svc("d", "tcp", "10.0.0.3:80", "dr", &["10.0.1.9:80"]),
        ]
        .concat();
        let cfg: crate::config::Config = toml::from_str(&toml).unwrap();
        let d = super::super::Daemon::start_inner(cfg, None, false).unwrap();
        let want = wanted_keys(&d.shared);
        let (tcp, udp) = (
            |a: &str| SteerKey::tcp(a.parse().unwrap()),
            |a: &str| SteerKey::udp(a.parse().unwrap()),
        );
        assert_eq!(
            want.vips,
            [
                tcp("10.0.0.1:80"),
                tcp("10.0.0.2:80"),
                udp("10.0.0.1:80"),
                tcp("10.0.0.3:80")
            ]
        );
        assert_eq!(want.backends, [tcp(b1), tcp(b2), tcp(b3), udp(b1)]);
    }

    /// A frame the engine rewrote for sending that the socket could not
    /// send (AF_PACKET: the device refused it or its queue was full;
    /// AF_XDP: the tx ring was full) is no frame sent: `tx` must not count
    /// it, and it must be counted dropped. The I/O's `tx_full` was thrown
    /// away, so `tx` counted it and no reason did: rx = tx + dropped no
    /// longer held, and the loss showed nowhere. Here: a frame received on
    /// a veth whose MTU is lowered before the worker's turn sends it
    /// (`EMSGSIZE`). Needs root and `ip netns`; skips otherwise.
    #[test]
    fn a_frame_the_socket_cannot_send_is_not_counted_as_sent() {
        use std::process::Command;
        let ip = |args: &[&str]| {
            Command::new("ip")
                .args(args)
                .status()
                .is_ok_and(|s| s.success())
        };
        let ns = format!("weir-txlost-{}", std::process::id());
        if !ip(&["netns", "add", &ns]) {
            eprintln!("skipped: cannot create a network namespace (root and iproute2 needed)");
            return;
        }
        struct Del(String);
        impl std::ops::Drop for Del {
            fn drop(&mut self) {
                let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
            }
        }
        let _del = Del(ns.clone());
        let nsx = |args: &[&str]| {
            let mut a = vec!["netns", "exec", &ns, "ip"];
            a.extend_from_slice(args);
            assert!(ip(&a), "ip {args:?}");
        };
        // No IPv6 on the links made here: their neighbour discovery and
        // MLD frames would reach wa's socket besides the test's datagram
        // (the turns below stop at the first frame received), at times
        // before it.
        assert!(
            ip(&[
                "netns",
                "exec",
                &ns,
                "sysctl",
                "-qw",
                "net.ipv6.conf.default.disable_ipv6=1",
                "net.ipv6.conf.all.disable_ipv6=1",
            ]),
            "sysctl disable_ipv6"
        );
        nsx(&["link", "add", "wa", "type", "veth", "peer", "name", "wb"]);
        nsx(&["link", "set", "wa", "address", "02:00:00:00:00:0a", "up"]);
        nsx(&["link", "set", "wb", "up"]);
        nsx(&["addr", "add", "198.51.100.1/24", "dev", "wb"]);
        nsx(&[
            "neigh",
            "add",
            "198.51.100.100",
            "lladdr",
            "02:00:00:00:00:0a",
            "dev",
            "wb",
        ]);
        let vip = "198.51.100.100:53";
        let toml = format!(
            "[daemon]\nworkers = 1\n[packet]\ninterfaces = [\"lo\"]\n\
             [[service]]\nname = \"dns\"\nprotocol = \"udp\"\nlisten = \"{vip}\"\n\
             forward = \"nat\"\n[[service.backend]]\naddress = \"198.51.100.50:53\"\n"
        );
        let cfg: crate::config::Config = toml::from_str(&toml).unwrap();
        let d = super::super::Daemon::start_inner(cfg, None, false).unwrap();
        let (shared, path) = (d.shared.clone(), d.shared.packet.get().unwrap().clone());
        std::thread::scope(|s| {
            s.spawn(|| {
                let file = std::fs::File::open(format!("/var/run/netns/{ns}")).unwrap();
                nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
                let ifindex = nix::net::if_::if_nametoindex("wa").unwrap();
                let sock = PacketSocket::bind("wa", PacketSocketConfig::default()).unwrap();
                struct Hop(u32);
                impl NextHops for Hop {
                    fn next_hop(
                        &mut self,
                        _: std::net::IpAddr,
                    ) -> Option<(u32, weir_packet::NextHop)> {
                        let mac = [2, 0, 0, 0, 0, 0x0b];
                        Some((
                            self.0,
                            weir_packet::NextHop {
                                src_mac: mac,
                                dst_mac: mac,
                            },
                        ))
                    }
                }
                let mut engine =
                    Engine::new(shared, path, Box::new(Hop(ifindex)), vec![ifindex], 7, "t");
                let client = std::net::UdpSocket::bind("198.51.100.1:0").unwrap();
                client.send_to(&[7; 1400], vip).unwrap();
                // The frame is in the ring: then the MTU drops under it.
                let fds = [sock.as_raw_fd()];
                let mut ready = Vec::new();
                for _ in 0..50 {
                    weir_packet_io::poll_readable(&fds, Duration::from_millis(100), &mut ready)
                        .unwrap();
                    if ready[0] {
                        break;
                    }
                }
                assert!(ready[0], "the datagram never reached wa");
                nsx(&["link", "set", "wa", "mtu", "1280"]);
                let mut socks = Socks::Packet(ifindex, Box::new(sock));
                for _ in 0..50 {
                    turn(&mut engine, &mut socks, &[], &mut Vec::new()).unwrap();
                    if engine.counters().rx.load(Relaxed) > 0 {
                        break;
                    }
                }
            })
            .join()
            .unwrap()
        });
        let counters = d.shared.packet.get().unwrap().sums().counts;
        assert_eq!(counters.rx, 1);
        assert_eq!(counters.new_flows, 1, "the engine forwarded it");
        assert_eq!(counters.tx, 0, "sent");
        assert_eq!(
            counters.dropped.get("tx_full"),
            Some(&1),
            "{:?}",
            counters.dropped
        );
    }
}

//! Processes, ports and memory readings: everything the suite asks of the OS.
//!
//! Every server the suite starts is held by a [`Server`] guard whose `Drop`
//! stops the whole process tree (SIGTERM, then SIGKILL after a grace
//! period), so an error or a panic anywhere in the suite leaves nothing
//! running. Memory is read the way the issue defines it: process RSS summed
//! over the server's process tree (`/proc/PID/status` `VmRSS`) plus kernel
//! TCP buffer memory from `/proc/net/sockstat` (`TCP: ... mem N`, in pages).
//! CPU time is read the same way: user + system time (`/proc/PID/stat`
//! fields 14 and 15, which cover every thread of the process) summed over
//! the process tree, so nginx's master and workers count together. A
//! process that exits between two readings takes its time with it; the
//! proxies' processes live for the whole run, so differences are exact to
//! a clock tick.

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::resource::{Resource, getrlimit, setrlimit};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Raises the soft open-files limit to the hard limit; returns the new soft limit.
pub(crate) fn raise_nofile() -> Result<u64> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).context("getrlimit")?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).context("setrlimit")?;
    }
    Ok(hard.max(soft))
}

/// Whether `prog` is found on `PATH`.
pub(crate) fn which(prog: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}

/// Next candidate port; starts at a pid-dependent offset so two runs rarely collide.
static NEXT_PORT: AtomicU16 = AtomicU16::new(0);

/// A loopback port free for both TCP and UDP right now.
///
/// Ports come from 20000..32000, below the kernel's ephemeral range
/// (32768..60999 here), so the many outgoing connections of a load run never
/// take a port a server is about to bind.
pub(crate) fn free_port() -> Result<u16> {
    const LO: u16 = 20_000;
    const SPAN: u16 = 12_000;
    let _ = NEXT_PORT.compare_exchange(
        0,
        (std::process::id() % u32::from(SPAN)) as u16,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..SPAN {
        let off = NEXT_PORT.fetch_add(1, Ordering::Relaxed) % SPAN;
        let port = LO + off;
        let tcp = TcpListener::bind((Ipv4Addr::LOCALHOST, port));
        let udp = UdpSocket::bind((Ipv4Addr::LOCALHOST, port));
        if tcp.is_ok() && udp.is_ok() {
            return Ok(port);
        }
    }
    bail!("no free loopback port in {LO}..{}", LO + SPAN)
}

/// `TCP_MAXSEG` that makes a loopback connection cut Ethernet-sized
/// segments: 1460 is what a host on an MTU-1500 link advertises (1500 - 20
/// IP - 20 TCP), and with timestamps (on by default) each segment then
/// carries 1448 payload bytes, the figure the suite prints. Setting 1448
/// itself would give 1436-byte segments.
pub(crate) const ETH_MSS_OPTION: u32 = 1460;

/// Payload bytes per Ethernet segment with TCP timestamps (see [`ETH_MSS_OPTION`]).
pub(crate) const ETH_SEGMENT: u32 = 1448;

/// `127.0.0.1:port`.
pub(crate) fn lo(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

fn signal_pid(pid: u32, sig: Signal) {
    if let Ok(p) = i32::try_from(pid)
        && p > 0
    {
        let _ = kill(Pid::from_raw(p), sig);
    }
}

/// A running server (peer proxy, backend or weir) and its private directory.
///
/// Dropping it stops the process tree: SIGTERM to the root, up to 3 s for it
/// to exit, then SIGKILL to every process of the tree seen before or after.
#[derive(Debug)]
pub(crate) struct Server {
    name: String,
    child: Option<Child>,
    log: PathBuf,
    /// Kept for the server's life; removed on drop after the process stops
    /// (kept when `WEIR_BENCH_KEEP` is set, for debugging).
    dir: Option<tempfile::TempDir>,
}

impl Server {
    /// Starts `cmd` with stdout/stderr appended to `DIR/NAME.log`.
    pub(crate) fn spawn(name: &str, mut cmd: Command, dir: tempfile::TempDir) -> Result<Self> {
        let log = dir.path().join(format!("{name}.log"));
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name}: {cmd:?}"))?;
        crate::signals::remove_dir_on_signal(dir.path());
        Ok(Self {
            name: name.to_string(),
            child: Some(child),
            log,
            dir: Some(dir),
        })
    }

    /// Root process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The last lines of the server's log, for error messages.
    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(8)..].join("\n")
    }

    /// Fails if the process has exited.
    pub(crate) fn check_alive(&mut self) -> Result<()> {
        if let Some(child) = self.child.as_mut()
            && let Ok(Some(status)) = child.try_wait()
        {
            bail!("{} exited ({status}); log:\n{}", self.name, self.log_tail());
        }
        Ok(())
    }

    /// Summed RSS of the server's process tree, in bytes.
    pub(crate) fn rss(&self) -> u64 {
        tree(self.pid()).into_iter().map(rss_bytes).sum()
    }

    /// CPU time (user + system) the server's process tree has used so far,
    /// in seconds; see [`tree_cpu_seconds`].
    pub(crate) fn cpu_seconds(&self) -> f64 {
        tree_cpu_seconds(self.pid())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // Collected before the root can exit and be reaped, so no pid here
        // can have been reused for someone else's process yet; each kill
        // below re-checks the start time anyway.
        let procs: Vec<(u32, u64)> = tree(child.id())
            .into_iter()
            .filter_map(|p| Some((p, start_time(p)?)))
            .collect();
        signal_pid(child.id(), Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // Workers a master left behind are still ours to stop.
        for (p, start) in procs {
            if p != child.id() && start_time(p) == Some(start) {
                signal_pid(p, Signal::SIGKILL);
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        // The directory goes (or is kept) below, no longer the signal's.
        if let Some(dir) = &self.dir {
            crate::signals::forget_dir(dir.path());
        }
        if std::env::var_os("WEIR_BENCH_KEEP").is_some()
            && let Some(dir) = self.dir.take()
        {
            eprintln!("{}: kept {}", self.name, dir.keep().display());
        }
    }
}

/// `pid` and all its descendants (from `/proc/PID/task/TID/children`).
pub(crate) fn tree(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() && out.len() < 4096 {
        let p = out[i];
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in tasks.flatten() {
                let children =
                    std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
                out.extend(
                    children
                        .split_whitespace()
                        .filter_map(|c| c.parse::<u32>().ok()),
                );
            }
        }
        i += 1;
    }
    out
}

/// Start time (clock ticks since boot, `/proc/PID/stat` field 22) of a live,
/// non-zombie process; None once it is gone.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command, which may contain spaces, in parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut f = rest.split_whitespace();
    let state = f.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    f.nth(18)?.parse().ok()
}

/// CPU time (user + system, all threads) used so far by `pid` and all its
/// live descendants, in seconds. A process that is gone counts 0.
pub(crate) fn tree_cpu_seconds(pid: u32) -> f64 {
    let ticks: u64 = tree(pid).into_iter().filter_map(cpu_ticks).sum();
    ticks as f64 / clock_ticks_per_second()
}

/// utime + stime of one process (`/proc/PID/stat` fields 14 and 15), in
/// clock ticks; None once it is gone.
fn cpu_ticks(pid: u32) -> Option<u64> {
    parse_stat_cpu_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// utime + stime (fields 14 and 15, clock ticks) of a `/proc/PID/stat` line.
pub(crate) fn parse_stat_cpu_ticks(stat: &str) -> Option<u64> {
    // Fields after the command, which may contain spaces and parentheses:
    // field 3 (state) is the first after the last ')'.
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let mut f = rest.split_whitespace();
    let utime: u64 = f.nth(11)?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    Some(utime + stime)
}

/// `sysconf(_SC_CLK_TCK)`: the unit of `/proc/PID/stat` times (100 on Linux).
fn clock_ticks_per_second() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|t| *t > 0)
        .map_or(100.0, |t| t as f64)
}

/// `VmRSS` of one process in bytes (0 if it is gone).
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Kernel TCP buffer memory in bytes: `/proc/net/sockstat` `TCP: ... mem N` × page size.
pub(crate) fn kernel_tcp_bytes() -> Result<u64> {
    let text =
        std::fs::read_to_string("/proc/net/sockstat").context("reading /proc/net/sockstat")?;
    let pages =
        parse_sockstat_tcp_pages(&text).context("no `TCP: ... mem N` in /proc/net/sockstat")?;
    Ok(pages * page_size())
}

fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|p| u64::try_from(p).ok())
        .unwrap_or(4096)
}

/// The `mem` field (pages) of the `TCP:` line of `/proc/net/sockstat`.
pub(crate) fn parse_sockstat_tcp_pages(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("TCP:"))?;
    let mut it = line.split_whitespace();
    while let Some(k) = it.next() {
        if k == "mem" {
            return it.next()?.parse().ok();
        }
    }
    None
}

/// The system-wide hard limit on TCP buffer memory (`tcp_mem`'s third value), in bytes.
pub(crate) fn tcp_mem_max_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_mem").ok()?;
    let pages: u64 = text.split_whitespace().nth(2)?.parse().ok()?;
    Some(pages * page_size())
}

/// One IPv4 TCP socket from `/proc/net/tcp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TcpSocket {
    pub(crate) local_port: u16,
    pub(crate) remote_port: u16,
    /// Kernel state number (1 = ESTABLISHED, 10 = LISTEN).
    pub(crate) state: u8,
    /// Bytes in the send queue (sent and not acknowledged, plus unsent).
    pub(crate) tx_queue: u64,
    /// Bytes received and not yet read.
    pub(crate) rx_queue: u64,
}

/// Every IPv4 TCP socket of the machine.
pub(crate) fn tcp_sockets() -> Vec<TcpSocket> {
    parse_proc_net_tcp(&std::fs::read_to_string("/proc/net/tcp").unwrap_or_default())
}

/// Parses `/proc/net/tcp` (header line first; hex fields).
pub(crate) fn parse_proc_net_tcp(text: &str) -> Vec<TcpSocket> {
    let port = |addr: &str| u16::from_str_radix(addr.rsplit(':').next()?, 16).ok();
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let local = port(f.nth(1)?)?;
            let remote = port(f.next()?)?;
            let state = u8::from_str_radix(f.next()?, 16).ok()?;
            let (tx, rx) = f.next()?.split_once(':')?;
            Some(TcpSocket {
                local_port: local,
                remote_port: remote,
                state,
                tx_queue: u64::from_str_radix(tx, 16).ok()?,
                rx_queue: u64::from_str_radix(rx, 16).ok()?,
            })
        })
        .collect()
}

/// Runs `cmd` to completion with a deadline; stdout and stderr go to files in
/// `dir`. Returns (success, stdout, stderr). The child is killed at the deadline.
pub(crate) fn run_bounded(
    mut cmd: Command,
    dir: &Path,
    tag: &str,
    timeout: Duration,
) -> Result<(bool, String, String)> {
    let out_p = dir.join(format!("{tag}.out"));
    let err_p = dir.join(format!("{tag}.err"));
    cmd.stdin(Stdio::null())
        .stdout(File::create(&out_p)?)
        .stderr(File::create(&err_p)?);
    let mut child = cmd.spawn().with_context(|| format!("starting {cmd:?}"))?;
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = std::fs::read_to_string(&out_p).unwrap_or_default();
    let err = std::fs::read_to_string(&err_p).unwrap_or_default();
    match status {
        None => bail!("{tag}: killed after {timeout:?}; stderr: {}", err.trim()),
        Some(s) => Ok((s.success(), out, err)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockstat_mem_is_parsed() {
        let text =
            "sockets: used 14\nTCP: inuse 1 orphan 0 tw 0 alloc 1 mem 130\nUDP: inuse 0 mem 7\n";
        assert_eq!(parse_sockstat_tcp_pages(text), Some(130));
        assert_eq!(parse_sockstat_tcp_pages("UDP: inuse 0 mem 7\n"), None);
    }

    #[test]
    fn proc_net_tcp_queues_are_parsed() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n\
   1: 0100007F:1F91 0100007F:9C40 01 00010000:00000200 00:00000000 00000000     0        0 2 1\n";
        let v = parse_proc_net_tcp(text);
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].state, 0x0A);
        assert_eq!(
            v[1],
            TcpSocket {
                local_port: 0x1F91,
                remote_port: 0x9C40,
                state: 1,
                tx_queue: 0x10000,
                rx_queue: 0x200
            }
        );
    }

    #[test]
    fn stat_cpu_ticks_are_parsed() {
        // A command with a space and a ')' in it; utime 1234, stime 56.
        let stat = "4242 (we ir) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 1234 56 7 8 20 0 \
                    3 0 98765 1000000 200 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0";
        assert_eq!(parse_stat_cpu_ticks(stat), Some(1290));
        assert_eq!(parse_stat_cpu_ticks("4242 (x) S 1 2"), None);
        assert_eq!(parse_stat_cpu_ticks(""), None);
    }

    #[test]
    fn tree_cpu_counts_a_busy_child() {
        // A shell whose child process spins (bounded: 5M iterations, and the
        // guard kills it when the test ends): the tree's CPU time must grow
        // while the waiting root uses almost none itself.
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "sh -c 'i=0; while [ $i -lt 5000000 ]; do i=$((i+1)); done' & wait",
        ]);
        let s = Server::spawn("sh", cmd, dir).unwrap();
        let before = s.cpu_seconds();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut after = before;
        while after - before < 0.05 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            after = s.cpu_seconds();
        }
        assert!(after - before >= 0.05, "{before} -> {after}");
        let root = s.pid();
        assert!(
            cpu_ticks(root).unwrap() as f64 / clock_ticks_per_second() < after - before,
            "the child's time is counted, not just the root's"
        );
        assert_eq!(tree_cpu_seconds(u32::MAX), 0.0, "no such process");
        assert!((1.0..=10_000.0).contains(&clock_ticks_per_second()));
    }

    #[test]
    fn start_time_of_live_and_gone_processes() {
        let me = std::process::id();
        let t = start_time(me).unwrap();
        assert_eq!(start_time(me), Some(t), "stable");
        let mut c = Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        assert_eq!(start_time(pid), None, "reaped child");
    }

    #[test]
    fn free_ports_are_distinct_and_bindable() {
        let a = free_port().unwrap();
        let b = free_port().unwrap();
        assert_ne!(a, b);
        assert!((20_000..32_000).contains(&a));
        TcpListener::bind(lo(a)).unwrap();
    }

    #[test]
    fn server_guard_kills_the_tree() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "sleep 30 & sleep 30; wait"]);
        let s = Server::spawn("sh", cmd, dir).unwrap();
        let root = s.pid();
        // The shell forks its children asynchronously: wait (bounded) until both exist.
        let deadline = Instant::now() + Duration::from_secs(5);
        while tree(root).len() < 3 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let pids = tree(root);
        assert_eq!(pids.len(), 3, "sh and two sleeps: {pids:?}");
        drop(s);
        // SIGKILL takes effect asynchronously: poll (bounded) until each is
        // gone or a zombie awaiting a reaper that is not us.
        let dead = |p: u32| {
            let state = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            state.is_empty() || state.contains(") Z") || state.contains(") X")
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !pids.iter().all(|&p| dead(p)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        for p in pids {
            assert!(dead(p), "{p} still alive");
        }
    }
}

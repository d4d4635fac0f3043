//! `weir-bench` stopped by SIGTERM or SIGINT half way through a run leaves
//! nothing behind: no network namespace and no process it started, and it
//! exits with 128 + the signal's number (143, 130), as a shell expects of a
//! program stopped that way.
//!
//! The run is `packet --quick --only udp`, stopped once its topology is up
//! and trafgen is sending (the first row, `direct`, runs no weir, so no
//! weir binary has to be built for it). Needs root and the packet suite's
//! tools; skipped with a message otherwise.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// `pid` and all its descendants (from `/proc/PID/task/TID/children`).
fn tree(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() && out.len() < 4096 {
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", out[i])) {
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

/// The command name and start time of a live, non-zombie process.
fn comm_and_start(pid: u32) -> Option<(String, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let comm = stat.get(stat.find('(')? + 1..stat.rfind(')')?)?.to_string();
    let mut f = stat.get(stat.rfind(')')? + 2..)?.split_whitespace();
    if matches!(f.next()?, "Z" | "X") {
        return None;
    }
    Some((comm, f.nth(18)?.parse().ok()?))
}

/// The namespaces whose names start with `prefix`.
fn namespaces(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// Whatever the bench left behind, removed when the test ends however it
/// ends, so a failure here does not also break the next run.
struct Leftovers {
    bench: Child,
    ns_prefix: String,
    /// (pid, start time) of the bench's descendants seen while it ran.
    procs: Vec<(u32, u64)>,
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        let _ = self.bench.kill();
        let _ = self.bench.wait();
        for &(p, start) in &self.procs {
            if comm_and_start(p).is_some_and(|(_, s)| s == start) {
                let _ = kill(Pid::from_raw(p as i32), Signal::SIGKILL);
            }
        }
        for ns in namespaces(&self.ns_prefix) {
            let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        }
    }
}

#[test]
fn sigterm_mid_run_removes_namespaces_and_children() {
    stopped_mid_run(Signal::SIGTERM, 143);
}

#[test]
fn sigint_mid_run_removes_namespaces_and_children() {
    stopped_mid_run(Signal::SIGINT, 130);
}

/// Starts the run, sends it `sig` once trafgen is sending, and checks that
/// it exits with `code` leaving no namespace and no process behind.
fn stopped_mid_run(sig: Signal, code: i32) {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root (network namespaces)");
        return;
    }
    for (tool, arg) in [
        ("ip", "-V"),
        ("ethtool", "--version"),
        ("nft", "--version"),
        ("trafgen", "-v"),
    ] {
        if Command::new(tool).arg(arg).output().is_err() {
            eprintln!("skipped: needs {tool}");
            return;
        }
    }
    let log_dir = tempfile::tempdir().unwrap();
    let log = log_dir.path().join("bench.log");
    let out = File::create(&log).unwrap();
    let bench = Command::new(env!("CARGO_BIN_EXE_weir-bench"))
        .args(["packet", "--quick", "--only", "udp"])
        // The `direct` row runs none; the suite only checks the file is named.
        .env("WEIR_BIN", "/bin/false")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap();
    let pid = bench.id();
    // Topo's namespace names: "wb" + the bench's pid mod 100000 + "-" + role.
    let mut left = Leftovers {
        bench,
        ns_prefix: format!("wb{}-", pid % 100_000),
        procs: Vec::new(),
    };
    let tail = |log: &Path| std::fs::read_to_string(log).unwrap_or_default();

    // Up: the client namespace exists and trafgen runs in it.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(st) = left.bench.try_wait().unwrap() {
            panic!(
                "weir-bench exited ({st}) before trafgen ran:\n{}",
                tail(&log)
            );
        }
        let cl = Path::new("/run/netns").join(format!("{}cl", left.ns_prefix));
        let procs: Vec<(u32, String, u64)> = tree(pid)
            .into_iter()
            .filter(|&p| p != pid)
            .filter_map(|p| comm_and_start(p).map(|(c, s)| (p, c, s)))
            .collect();
        if cl.exists() && procs.iter().any(|(_, c, _)| c == "trafgen") {
            left.procs = procs.into_iter().map(|(p, _, s)| (p, s)).collect();
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no trafgen in 20 s:\n{}",
            tail(&log)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        namespaces(&left.ns_prefix).len(),
        5,
        "the topology's namespaces"
    );

    kill(Pid::from_raw(pid as i32), sig).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = left.bench.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "weir-bench still running 10 s after {sig}:\n{}",
            tail(&log)
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        status.code(),
        Some(code),
        "exit status after {sig} ({status}):\n{}",
        tail(&log)
    );
    assert_eq!(
        namespaces(&left.ns_prefix),
        Vec::<String>::new(),
        "namespaces left behind"
    );
    let alive: Vec<_> = left
        .procs
        .iter()
        .filter(|&&(p, s)| comm_and_start(p).is_some_and(|(_, now)| now == s))
        .map(|&(p, _)| (p, comm_and_start(p).map(|(c, _)| c)))
        .collect();
    assert!(alive.is_empty(), "processes left behind: {alive:?}");
}

//! The `weir` binary as operators use it: `check`, `run` without a file,
//! fd exhaustion under a low RLIMIT_NOFILE, SIGHUP reload and SIGTERM drain.

mod daemon_util;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use daemon_util::process::*;
use daemon_util::*;

const T: Duration = Duration::from_secs(15);

/// A file in `dir` (a test's own temporary directory, removed when the
/// test ends, even on failure).
fn tmp_file(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// What a test leaves in its directory besides its config files: a
/// generated admin token would show up here (HOME and XDG_RUNTIME_DIR of
/// the spawned daemon point at it).
fn leftovers(dir: &tempfile::TempDir) -> Vec<String> {
    std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".toml"))
        .collect()
}

#[test]
fn check_lists_every_error_with_file_line_and_key() {
    let text = r#"
[daemon]
buffer_size = 10
drain_timeout = "soon"

[[tenant]]
name = "acme"
table_entries = 1000

[[service]]
tenant = "nobody"
name = "web"
protocol = "tcp"
listen = "127.0.0.1:8080"
scheduler = "fastest"

  [[service.backend]]
  address = "127.0.0.1:9001"
  weight = 70000
  proxy_protocol = "v3"
"#;
    let dir = tempfile::tempdir().unwrap();
    let p = tmp_file(&dir, "bad.toml", text);
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&p)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let file = p.display().to_string();
    for (line, key) in [
        (3, "daemon.buffer_size"),
        (4, "daemon.drain_timeout"),
        (8, "tenant[0].table_entries"),
        (11, "service[0].tenant"),
        (15, "service[0].scheduler"),
        (19, "service[0].backend[0].weight"),
        (20, "service[0].backend[0].proxy_protocol"),
    ] {
        let want = format!("{file}:{line}: {key}: ");
        assert!(err.contains(&want), "missing {want:?} in:\n{err}");
    }
    assert!(err.contains("7 error(s)"), "{err}");
}

#[test]
fn check_reports_shape_errors_with_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = tmp_file(&dir, "shape.toml", "[daemon]\nworkers = 2\nbogus = 1\n");
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&p)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("{}:3: daemon.bogus: ", p.display())),
        "{err}"
    );
}

#[test]
fn check_accepts_the_example_config() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/weir.toml");
    let out = Command::new(BIN)
        .args(["check", "--config", example])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn run_without_config_points_at_demo_and_example() {
    let out = Command::new(BIN).arg("run").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("weir demo") && err.contains("examples/weir.toml"),
        "{err}"
    );
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name: state is field 3; utime 14, stime 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

fn run_config(vip: SocketAddr, backend: SocketAddr, extra: &str) -> String {
    format!(
        "[daemon]\nworkers = 1\ndrain_timeout = \"20s\"\n[admin]\nlisten = \"{}\"\ntoken = \"daemon-cli-test-token\"\n{extra}\n[[service]]\nname = \"e\"\nprotocol = \"tcp\"\nlisten = \"{vip}\"\nscheduler = \"rr\"\n  [[service.backend]]\n  address = \"{backend}\"\n",
        free_addr()
    )
}

#[test]
fn fd_exhaustion_backs_off_and_recovers() {
    let e = Echo::start();
    let vip = free_addr();
    let dir = tempfile::tempdir().unwrap();
    let p = tmp_file(&dir, "fd.toml", &run_config(vip, e.addr, ""));
    let mut child = spawn_run(&p, Some(48));
    wait_up(&mut child, vip, T);
    // Far more connections than descriptors: accepts hit EMFILE.
    let mut clients = Vec::new();
    for _ in 0..40 {
        if let Ok(mut s) = TcpStream::connect(vip) {
            let _ = s.write_all(b"x");
            clients.push(s);
        }
    }
    let pid = child.0.id();
    // Let the exhaustion set in, then measure CPU over one second: a
    // spinning accept loop would burn about one core.
    assert!(wait_until(T, || !echo_once_quick(vip)));
    let before = cpu_ticks(pid);
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(1)); // a measurement window, not synchronisation
    let ticks = cpu_ticks(pid) - before;
    let hz = 100.0; // USER_HZ on Linux
    let cpu = ticks as f64 / hz / t0.elapsed().as_secs_f64();
    assert!(cpu < 0.5, "accept loop spins under EMFILE: {cpu:.2} CPU");
    drop(clients);
    assert!(
        wait_until(T, || echo_once(vip, b"back")),
        "did not recover after fds were freed"
    );
    let _ = child.0.kill();
    let mut err = String::new();
    let _ = child.0.stderr.take().unwrap().read_to_string(&mut err);
    assert!(err.contains("backing off"), "no back-off logged:\n{err}");
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
}

/// Echo with a short timeout (used to detect that the daemon is saturated).
fn echo_once_quick(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut b = [0u8; 1];
    s.write_all(b"q").is_ok() && s.read_exact(&mut b).is_ok()
}

#[test]
fn sighup_reloads_and_sigterm_drains() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let e = Echo::start();
    let vip = free_addr();
    let dir = tempfile::tempdir().unwrap();
    let p = tmp_file(&dir, "hup.toml", &run_config(vip, e.addr, ""));
    // Access log on: one line per closed connection.
    let text = run_config(vip, e.addr, "").replace("[admin]", "access_log = true\n[admin]");
    std::fs::write(&p, &text).unwrap();
    let mut child = spawn_run(&p, None);
    wait_up(&mut child, vip, T);
    let pid = Pid::from_raw(child.0.id() as i32);
    // Reload with a second service.
    let vip2 = free_addr();
    let mut text = text.clone();
    text.push_str(&format!(
        "[[service]]\nname = \"f\"\nprotocol = \"tcp\"\nlisten = \"{vip2}\"\n  [[service.backend]]\n  address = \"{}\"\n",
        e.addr
    ));
    std::fs::write(&p, text).unwrap();
    kill(pid, Signal::SIGHUP).unwrap();
    if !wait_until(T, || echo_once(vip2, b"new")) {
        // Say why: the daemon logs a reload it refused (e.g. a listen
        // address another test took after `free_addr` released it).
        let _ = child.0.kill();
        let mut err = String::new();
        let _ = child.0.stderr.take().unwrap().read_to_string(&mut err);
        panic!("reload did not add the service on {vip2}; daemon stderr:\n{err}");
    }
    // Drain: an established connection keeps working, new ones are refused,
    // and the process exits once it closes.
    let (held, b) = sigterm_with_a_held_connection(&child, vip, T);
    assert_eq!(&b, b"ok");
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "exited before the connection closed"
    );
    drop(held);
    assert!(
        wait_until(T, || child.0.try_wait().unwrap().is_some()),
        "did not exit after draining"
    );
    assert!(child.0.wait().unwrap().success());
    let mut err = String::new();
    let _ = child.0.stderr.take().unwrap().read_to_string(&mut err);
    let line = err
        .lines()
        .find(|l| l.contains("weir::access") && l.contains("reason=\"closed\""))
        .unwrap_or_else(|| panic!("no access log line in:\n{err}"));
    assert!(
        line.contains("bytes_in=") && line.contains("backend=") && line.contains("duration_s="),
        "{line}"
    );
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Measurement for docs/daemon.md: resident memory of the daemon per
/// established idle connection (user space: task, two buffers, registry and
/// flow-table entry). `cargo test --release -p weir --test daemon_cli rss -- --ignored --nocapture`
#[test]
#[ignore = "measurement, prints figures"]
fn rss_per_idle_connection() {
    let e = Echo::start();
    let vip = free_addr();
    let dir = tempfile::tempdir().unwrap();
    let p = tmp_file(&dir, "rss.toml", &run_config(vip, e.addr, ""));
    let child = spawn_run(&p, None);
    assert!(wait_until(T, || echo_once(vip, b"up")));
    let pid = child.0.id();
    let base_accepted = e.accepted.load(std::sync::atomic::Ordering::Relaxed);
    let before = rss_kib(pid);
    // Phase 1: connected, no byte sent yet (wait until weir has connected
    // every one to the backend).
    let n = 1000u64;
    // In batches of 100: the test backend's accept backlog is 128.
    let mut conns: Vec<TcpStream> = Vec::new();
    while (conns.len() as u64) < n {
        for _ in 0..100 {
            conns.push(TcpStream::connect(vip).unwrap());
        }
        let want = base_accepted + conns.len() as u64;
        let ok = wait_until(T, || {
            e.accepted.load(std::sync::atomic::Ordering::Relaxed) >= want
        });
        assert!(
            ok,
            "backend accepted {} of {}",
            e.accepted.load(std::sync::atomic::Ordering::Relaxed) - base_accepted,
            conns.len()
        );
    }
    let idle = rss_kib(pid);
    // Phase 2: the same connections after one small echo each.
    for s in conns.iter_mut() {
        s.set_read_timeout(Some(T)).unwrap();
        s.write_all(b"hi").unwrap();
        let mut b = [0u8; 2];
        s.read_exact(&mut b).unwrap();
    }
    let used = rss_kib(pid);
    let per = |rss: u64| rss.saturating_sub(before) as f64 / n as f64;
    eprintln!("baseline RSS {before} KiB");
    eprintln!(
        "{n} connections, no data yet: RSS {idle} KiB, {:.1} KiB per connection",
        per(idle)
    );
    eprintln!(
        "{n} connections after one echo: RSS {used} KiB, {:.1} KiB per connection",
        per(used)
    );
}

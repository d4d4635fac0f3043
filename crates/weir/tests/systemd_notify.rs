//! `weir run` under a stand-in for systemd: the test binds the
//! `NOTIFY_SOCKET` datagram socket itself and reads what the daemon sends
//! (READY, RELOADING/READY around reloads, STOPPING, WATCHDOG), in order.

mod daemon_util;

use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use daemon_util::process::*;
use daemon_util::*;

const T: Duration = Duration::from_secs(15);
const TOKEN: &str = "systemd-notify-test-token";

fn write_config(path: &Path, admin: SocketAddr, vip: SocketAddr, backends: &[SocketAddr]) {
    let mut text = format!(
        "[daemon]\nworkers = 1\n[admin]\nlisten = \"{admin}\"\ntoken = \"{TOKEN}\"\n\
         [[service]]\nname = \"e\"\nprotocol = \"tcp\"\nlisten = \"{vip}\"\nscheduler = \"rr\"\n"
    );
    for b in backends {
        text.push_str(&format!("  [[service.backend]]\n  address = \"{b}\"\n"));
    }
    std::fs::write(path, text).unwrap();
}

/// `weir run --config cfg` as systemd would start it: `notify` is its
/// `NOTIFY_SOCKET`, `WATCHDOG_USEC` is `watchdog_usec` (`WATCHDOG_PID`
/// unset), `env` is added, and it logs into `dir`/weir.log.
fn run_notified(
    dir: &Path,
    cfg: &Path,
    notify: &Notify,
    watchdog_usec: u64,
    env: &[(&str, &str)],
) -> Proc {
    let log = std::fs::File::create(dir.join("weir.log")).unwrap();
    Proc(
        Command::new(BIN)
            .args(["run", "--config"])
            .arg(cfg)
            .env("NOTIFY_SOCKET", &notify.path)
            .env("WATCHDOG_USEC", watchdog_usec.to_string())
            .env_remove("WATCHDOG_PID")
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .env("HOME", dir)
            .env("XDG_RUNTIME_DIR", dir)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    )
}

/// The notification socket, as systemd's would be: one datagram per
/// sd_notify() call, newline-separated assignments.
struct Notify {
    sock: UnixDatagram,
    path: PathBuf,
}

impl Notify {
    fn bind(dir: &Path) -> Self {
        let path = dir.join("notify.sock");
        let sock = UnixDatagram::bind(&path).unwrap();
        Self { sock, path }
    }

    /// The next datagram within `timeout`, as its lines.
    fn recv(&self, timeout: Duration) -> Option<Vec<String>> {
        self.sock.set_read_timeout(Some(timeout)).unwrap();
        let mut buf = [0u8; 4096];
        let n = self.sock.recv(&mut buf).ok()?;
        let text = std::str::from_utf8(&buf[..n]).unwrap();
        Some(text.lines().map(str::to_owned).collect())
    }

    /// The next datagram that is not a watchdog keep-alive, within `T`;
    /// keep-alives seen on the way are counted into `watchdogs`.
    fn next_state(&self, watchdogs: &mut Vec<Instant>) -> Vec<String> {
        let deadline = Instant::now() + T;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no notification within {T:?}");
            let msg = self
                .recv(left)
                .unwrap_or_else(|| panic!("no notification within {T:?}"));
            if msg == ["WATCHDOG=1"] {
                watchdogs.push(Instant::now());
                continue;
            }
            return msg;
        }
    }
}

/// The set-up of a test with one echo backend: a temporary directory
/// with a notify socket in it, the backend (kept while the test runs),
/// the admin API's and the service's addresses, and a config in the
/// directory naming them.
fn one_echo() -> (
    tempfile::TempDir,
    Notify,
    Echo,
    SocketAddr,
    SocketAddr,
    PathBuf,
) {
    let dir = tempfile::tempdir().unwrap();
    let notify = Notify::bind(dir.path());
    let e = Echo::start();
    let (admin, vip) = (free_addr(), free_addr());
    let cfg = dir.path().join("weir.toml");
    write_config(&cfg, admin, vip, &[e.addr]);
    (dir, notify, e, admin, vip, cfg)
}

fn has(msg: &[String], line: &str) -> bool {
    msg.iter().any(|l| l == line)
}

/// `MONOTONIC_USEC=` of a RELOADING message.
fn monotonic_usec(msg: &[String]) -> u64 {
    msg.iter()
        .find_map(|l| l.strip_prefix("MONOTONIC_USEC="))
        .unwrap_or_else(|| panic!("RELOADING=1 without MONOTONIC_USEC: {msg:?}"))
        .parse()
        .unwrap()
}

/// `weir reload` through the admin API; its exit status.
fn api_reload(admin: SocketAddr) -> bool {
    Command::new(BIN)
        .args(["reload", "--admin", &admin.to_string(), "--token", TOKEN])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

/// The order systemd relies on: READY only once the service and the admin
/// API accept; RELOADING (with MONOTONIC_USEC) then READY around a SIGHUP
/// reload and an API reload, nothing for a reload that fails before
/// applying; STOPPING at SIGTERM; WATCHDOG=1 every half of WATCHDOG_USEC
/// (WATCHDOG_PID unset) throughout.
#[test]
fn notifications_arrive_in_order() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;

    let dir = tempfile::tempdir().unwrap();
    let notify = Notify::bind(dir.path());
    let (e1, e2) = (Echo::start(), Echo::start());
    let (admin, vip) = (free_addr(), free_addr());
    let cfg = dir.path().join("weir.toml");
    write_config(&cfg, admin, vip, &[e1.addr]);
    let watchdog_usec = 400_000u64;
    let started = Instant::now();
    let mut child = run_notified(dir.path(), &cfg, &notify, watchdog_usec, &[]);
    let pid = Pid::from_raw(child.0.id() as i32);
    let mut watchdogs = Vec::new();
    let show_log = || std::fs::read_to_string(dir.path().join("weir.log")).unwrap_or_default();

    // READY=1, and at that moment the service and the admin API accept
    // (no retry: a READY sent before binding fails here), and SIGHUP is
    // handled: it is sent at once, as `systemctl reload` may (SIGHUP's
    // default action would end the process).
    let ready = notify.next_state(&mut watchdogs);
    assert!(has(&ready, "READY=1"), "{ready:?}\n{}", show_log());
    write_config(&cfg, admin, vip, &[e1.addr, e2.addr]);
    kill(pid, Signal::SIGHUP).unwrap();
    assert!(
        echo_once(vip, b"ready"),
        "READY=1 before the service accepts"
    );
    assert!(
        TcpStream::connect(admin).is_ok(),
        "READY=1 before the admin API accepts"
    );

    // That SIGHUP reload (a second backend): RELOADING=1 + MONOTONIC_USEC,
    // READY=1.
    let reloading = notify.next_state(&mut watchdogs);
    assert!(has(&reloading, "RELOADING=1"), "{reloading:?}");
    let usec1 = monotonic_usec(&reloading);
    let t1 = Instant::now();
    let done = notify.next_state(&mut watchdogs);
    assert!(has(&done, "READY=1"), "{done:?}");
    assert!(
        !has(&done, "RELOADING=1"),
        "READY=1 must come in its own message: {done:?}"
    );
    // The reload was applied when READY came: both backends serve.
    let mut served = std::collections::BTreeSet::new();
    for _ in 0..8 {
        served.insert(served_by(vip, &[&e1, &e2]).expect("no backend served"));
    }
    assert_eq!(
        served.len(),
        2,
        "the SIGHUP reload was not applied at READY=1"
    );

    // A reload that fails before applying says nothing to systemd; the
    // next good one (through the API this time) does.
    std::fs::write(&cfg, "[[service]]\nname = 1\n").unwrap();
    assert!(!api_reload(admin), "a broken config reloaded");
    write_config(&cfg, admin, vip, &[e2.addr]);
    assert!(api_reload(admin), "API reload failed\n{}", show_log());
    let reloading = notify.next_state(&mut watchdogs);
    assert!(has(&reloading, "RELOADING=1"), "{reloading:?}");
    let usec2 = monotonic_usec(&reloading);
    let t2 = Instant::now();
    let done = notify.next_state(&mut watchdogs);
    assert!(has(&done, "READY=1"), "{done:?}");
    // MONOTONIC_USEC follows CLOCK_MONOTONIC: it grew by about the time
    // that passed here between the two messages.
    let waited = t2.duration_since(t1).as_micros() as u64;
    assert!(usec2 > usec1, "{usec1} then {usec2}");
    assert!(
        usec2 - usec1 <= waited + 2_000_000,
        "MONOTONIC_USEC moved {} us in {waited} us",
        usec2 - usec1
    );

    // Keep-alives every WATCHDOG_USEC / 2: enough of them by now (the
    // start alone feeds one), none much later than the interval.
    let min_elapsed = Duration::from_micros(watchdog_usec * 2);
    assert!(
        wait_until(T, || {
            while let Some(m) = notify.recv(Duration::from_millis(50)) {
                assert_eq!(m, ["WATCHDOG=1"], "unexpected message");
                watchdogs.push(Instant::now());
            }
            started.elapsed() > min_elapsed && watchdogs.len() >= 3
        }),
        "too few WATCHDOG=1: {}",
        watchdogs.len()
    );
    let expected = started.elapsed().as_micros() as u64 / (watchdog_usec / 2);
    assert!(
        watchdogs.len() as u64 + 2 >= expected / 2,
        "{} keep-alives in {:?} (interval {} us)",
        watchdogs.len(),
        started.elapsed(),
        watchdog_usec / 2
    );

    // SIGTERM: STOPPING=1 when the drain starts, then a clean exit.
    kill(pid, Signal::SIGTERM).unwrap();
    let stopping = notify.next_state(&mut watchdogs);
    assert!(has(&stopping, "STOPPING=1"), "{stopping:?}");
    assert!(
        wait_until(T, || child.0.try_wait().unwrap().is_some()),
        "weir did not stop"
    );
    assert!(child.0.wait().unwrap().success(), "{}", show_log());
}

/// The watchdog end to end: `weir run` with `NOTIFY_SOCKET` and
/// `WATCHDOG_USEC` feeds it (`WATCHDOG=1`) while its workers run; once a
/// proxy worker's thread has ended (the debug builds' test hook,
/// `WEIR_TEST_HOOKS=1` and SIGUSR2, ends worker 0's as a dead worker's
/// ends), it says why (`STATUS=unhealthy: ...`) and feeds it no more, so
/// that systemd restarts it.
#[test]
fn a_dead_worker_stops_the_watchdog_and_says_why() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;

    if cfg!(not(debug_assertions)) {
        // The hook that ends a worker exists only in debug builds.
        eprintln!("skipped: a release build has no test hook to end a worker");
        return;
    }
    let (dir, notify, _e, _admin, _vip, cfg) = one_echo();
    // A keep-alive every 100 ms.
    let watchdog_usec = 200_000u64;
    let mut child = run_notified(
        dir.path(),
        &cfg,
        &notify,
        watchdog_usec,
        &[("WEIR_TEST_HOOKS", "1")],
    );
    let pid = Pid::from_raw(child.0.id() as i32);
    let show_log = || std::fs::read_to_string(dir.path().join("weir.log")).unwrap_or_default();
    let mut watchdogs = Vec::new();
    let ready = notify.next_state(&mut watchdogs);
    assert!(has(&ready, "READY=1"), "{ready:?}\n{}", show_log());
    // Fed while every worker runs.
    let deadline = Instant::now() + T;
    while watchdogs.len() < 3 {
        let left = deadline.saturating_duration_since(Instant::now());
        match notify.recv(left) {
            Some(m) if m == ["WATCHDOG=1"] => watchdogs.push(Instant::now()),
            Some(m) => panic!("unexpected message before the worker ended: {m:?}"),
            None => panic!(
                "{} WATCHDOG=1 within {T:?}\n{}",
                watchdogs.len(),
                show_log()
            ),
        }
    }
    // Worker 0's thread ends.
    kill(pid, Signal::SIGUSR2).unwrap();
    let status = notify.next_state(&mut watchdogs);
    let unhealthy = status
        .iter()
        .find_map(|l| l.strip_prefix("STATUS=unhealthy: "))
        .unwrap_or_else(|| panic!("not STATUS=unhealthy: {status:?}\n{}", show_log()));
    assert!(
        unhealthy.contains("weir-worker-0") && unhealthy.contains("ended"),
        "{unhealthy}"
    );
    // No keep-alive after it: none in ten intervals (systemd would restart
    // weir after two).
    let quiet = Duration::from_micros(watchdog_usec / 2 * 10);
    let until = Instant::now() + quiet;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        if let Some(m) = notify.recv(left) {
            panic!("{m:?} after STATUS=unhealthy");
        }
    }
    // The daemon itself is still up: acting on the watchdog is systemd's.
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "weir exited\n{}",
        show_log()
    );
}

/// `NOTIFY_SOCKET=@name` names a socket in the abstract namespace (no file).
#[test]
fn an_abstract_notify_socket_gets_ready() {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::SocketAddr as UnixAddr;

    let dir = tempfile::tempdir().unwrap();
    let name = format!("weir-test-notify-{}", std::process::id());
    let sock = UnixDatagram::bind_addr(&UnixAddr::from_abstract_name(&name).unwrap()).unwrap();
    let notify = Notify {
        sock,
        path: PathBuf::from(format!("@{name}")),
    };
    let e = Echo::start();
    let (admin, vip) = (free_addr(), free_addr());
    let cfg = dir.path().join("weir.toml");
    write_config(&cfg, admin, vip, &[e.addr]);
    let _child = Proc(
        Command::new(BIN)
            .args(["run", "--config"])
            .arg(&cfg)
            .env("NOTIFY_SOCKET", &notify.path)
            .env_remove("WATCHDOG_USEC")
            .env("HOME", dir.path())
            .env("XDG_RUNTIME_DIR", dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let ready = notify.next_state(&mut Vec::new());
    assert!(has(&ready, "READY=1"), "{ready:?}");
    assert!(
        echo_once(vip, b"ready"),
        "READY=1 before the service accepts"
    );
}

/// Without NOTIFY_SOCKET nothing is sent and nothing fails: weir runs and
/// stops as before (the socket exists but is not named to the daemon).
#[test]
fn without_notify_socket_nothing_is_sent() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;

    let (dir, notify, _e, admin, vip, cfg) = one_echo();
    let mut child = Proc(
        Command::new(BIN)
            .args(["run", "--config"])
            .arg(&cfg)
            .env_remove("NOTIFY_SOCKET")
            .env("WATCHDOG_USEC", "100000")
            .env("HOME", dir.path())
            .env("XDG_RUNTIME_DIR", dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    assert!(wait_until(T, || echo_once(vip, b"up")), "did not start");
    assert!(api_reload(admin));
    kill(Pid::from_raw(child.0.id() as i32), Signal::SIGTERM).unwrap();
    assert!(wait_until(T, || child.0.try_wait().unwrap().is_some()));
    assert!(child.0.wait().unwrap().success());
    assert_eq!(
        notify.recv(Duration::from_millis(1)),
        None,
        "a notification without NOTIFY_SOCKET"
    );
}

/// Which of `backends` answered one connection to `vip` (each echo backend
/// counts its accepts).
fn served_by(vip: SocketAddr, backends: &[&Echo]) -> Option<usize> {
    use std::sync::atomic::Ordering::Relaxed;
    let before: Vec<u64> = backends.iter().map(|b| b.accepted.load(Relaxed)).collect();
    if !echo_once(vip, b"x") {
        return None;
    }
    let mut which = None;
    wait_until(T, || {
        which = backends
            .iter()
            .zip(&before)
            .position(|(b, n)| b.accepted.load(Relaxed) > *n);
        which.is_some()
    });
    which
}

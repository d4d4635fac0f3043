//! The `weir run` process under signals and a low descriptor limit.

mod daemon_util;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use daemon_util::process::*;
use daemon_util::*;

const T: Duration = Duration::from_secs(15);

/// A config with one TCP service `vip` → `backend`, written into `dir`.
fn write_config(
    dir: &tempfile::TempDir,
    vip: SocketAddr,
    backend: SocketAddr,
    daemon: &str,
) -> PathBuf {
    let text = format!(
        "[daemon]\nworkers = 1\n{daemon}\n[admin]\nlisten = \"{}\"\ntoken = \"daemon-process-test-token\"\n\
         [[service]]\nname = \"e\"\nprotocol = \"tcp\"\nlisten = \"{vip}\"\nscheduler = \"rr\"\n  \
         [[service.backend]]\n  address = \"{backend}\"\n",
        free_addr()
    );
    let p = dir.path().join("weir.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// The admin address [`write_config`] put into the file at `p`.
fn admin_addr(p: &Path) -> SocketAddr {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("listen = \"")?
                .strip_suffix('"')?
                .parse::<SocketAddr>()
                .ok()
        })
        .unwrap()
}

/// A SIGTERM sent as soon as a service answers, before `weir run` has put
/// its signal handlers in, waits for them: the daemon drains and exits 0.
/// Before, the signal met its default action in that window and ended the
/// process at once, without a drain (on a loaded machine,
/// `a_second_signal_ends_a_drain_at_once` sometimes met it: its held
/// connection read EOF). `WEIR_TEST_SIGNALS_LATE_MS` (debug builds) holds
/// the handlers back to make the window wide.
#[test]
fn a_sigterm_right_after_the_start_waits_for_the_handlers() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let e = Echo::start();
    let vip = free_addr();
    let dir = tempfile::tempdir().unwrap();
    let p = write_config(&dir, vip, e.addr, "");
    let mut child = Proc(
        std::process::Command::new(BIN)
            .args(["run", "--config"])
            .arg(&p)
            .env("RUST_LOG", "info")
            .env("HOME", dir.path())
            .env("XDG_RUNTIME_DIR", dir.path())
            .env("WEIR_TEST_SIGNALS_LATE_MS", "2000")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_up(&mut child, vip, T);
    kill(Pid::from_raw(child.0.id() as i32), Signal::SIGTERM).unwrap();
    let code = exit_code_within(&mut child.0, T);
    let mut err = String::new();
    let _ = child.0.stderr.take().unwrap().read_to_string(&mut err);
    assert_eq!(code, Some(0), "ended by the signal, not drained:\n{err}");
    assert!(err.contains("SIGTERM: draining"), "{err}");
}

/// docs/daemon.md: SIGINT closes everything now, also while a SIGTERM drain
/// waits for live connections (it used to be ignored until the drain
/// timeout); so does a second SIGTERM.
#[test]
fn a_second_signal_ends_a_drain_at_once() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    for second in [Signal::SIGINT, Signal::SIGTERM] {
        let e = Echo::start();
        let vip = free_addr();
        let dir = tempfile::tempdir().unwrap();
        let p = write_config(&dir, vip, e.addr, "drain_timeout = \"300s\"");
        let mut child = spawn_run(&p, None);
        wait_up(&mut child, vip, T);
        let pid = Pid::from_raw(child.0.id() as i32);
        // Draining: no new connections, the held one still served.
        let (mut held, _) = sigterm_with_a_held_connection(&child, vip, T);
        assert!(
            child.0.try_wait().unwrap().is_none(),
            "exited before the drain"
        );
        let t0 = Instant::now();
        kill(pid, second).unwrap();
        assert!(
            wait_until(T, || child.0.try_wait().unwrap().is_some()),
            "{second}: the drain went on"
        );
        assert!(t0.elapsed() < T, "{second}");
        assert!(child.0.wait().unwrap().success());
        // The held connection was closed by the daemon.
        let mut rest = Vec::new();
        held.set_read_timeout(Some(T)).unwrap();
        let _ = held.read_to_end(&mut rest);
        let mut err = String::new();
        let _ = child.0.stderr.take().unwrap().read_to_string(&mut err);
        assert!(
            err.contains("while draining: stopping now"),
            "{second}:\n{err}"
        );
    }
}

/// Open descriptors of process `pid` numbered below `limit` (one the test
/// harness leaves open, such as cargo's jobserver pipe, may sit above).
fn fds_below(pid: u32, limit: u64) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| {
        d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
            .filter(|&fd| fd < limit)
            .count() as u64
    })
}

/// `weir run` under `ulimit -n NOFILE` with one TCP service in front of an
/// echo backend, once the service echoes.
struct LowFds {
    vip: SocketAddr,
    admin: SocketAddr,
    pid: u32,
    _child: Proc,
    _echo: Echo,
    _dir: tempfile::TempDir,
}

fn run_with_nofile(nofile: u64) -> LowFds {
    let e = Echo::start();
    let vip = free_addr();
    let dir = tempfile::tempdir().unwrap();
    let p = write_config(&dir, vip, e.addr, "");
    let admin = admin_addr(&p);
    let mut child = spawn_run(&p, Some(nofile as u32));
    let pid = child.0.id();
    wait_up(&mut child, vip, T);
    wait_listening(&mut child, admin, T);
    LowFds {
        vip,
        admin,
        pid,
        _child: child,
        _echo: e,
        _dir: dir,
    }
}

/// A client accepted when only one descriptor was left waits for its
/// backend connect (which failed with EMFILE) to be retried instead of
/// being reset, and is served once descriptors are free again.
#[test]
fn a_backend_connect_out_of_descriptors_waits_instead_of_resetting() {
    const NOFILE: u64 = 64;
    let run = run_with_nofile(NOFILE);
    let (vip, admin, pid) = (run.vip, run.admin, run.pid);
    let fds_of = |pid| fds_below(pid, NOFILE);
    // Fill descriptors with held connections (two each: client and
    // backend side) until one or two are left.
    let mut helds = Vec::new();
    while NOFILE - fds_of(pid) >= 3 {
        helds.push(held(vip));
        assert!(helds.len() < NOFILE as usize, "descriptors do not fill");
    }
    // Exactly one left: an idle admin connection takes the spare one.
    let mut _admin = None;
    if NOFILE - fds_of(pid) == 2 {
        let before = fds_of(pid);
        _admin = Some(TcpStream::connect(admin).unwrap());
        assert!(wait_until(T, || fds_of(pid) > before));
    }
    assert_eq!(NOFILE - fds_of(pid), 1, "{} held", helds.len());
    // The next client's accept takes the last descriptor; its backend
    // connect fails with EMFILE.
    let mut x = TcpStream::connect(vip).unwrap();
    x.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    x.write_all(b"xy").unwrap();
    let mut b = [0u8; 2];
    let early = x.read_exact(&mut b);
    let kind = early.as_ref().map_err(|e| e.kind()).err();
    assert!(
        matches!(
            kind,
            Some(std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
        ),
        "the client was not left waiting: {early:?}"
    );
    // Free descriptors: the retry connects and the bytes come back.
    helds.truncate(helds.len() - 2);
    x.set_read_timeout(Some(T)).unwrap();
    x.read_exact(&mut b)
        .expect("served once descriptors were free");
    assert_eq!(&b, b"xy");
    drop(run);
}

/// Which of `backends` served one round trip from `127.0.0.<host>`.
fn served_by(host: u8, vip: SocketAddr, backends: &[Echo]) -> Option<usize> {
    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::atomic::Ordering::Relaxed;
    let before: Vec<u64> = backends.iter().map(|b| b.accepted.load(Relaxed)).collect();
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
    let src = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, host)), 0);
    s.bind(&src.into()).ok()?;
    s.connect_timeout(&vip.into(), T).ok()?;
    let mut s: TcpStream = s.into();
    s.set_read_timeout(Some(T)).ok()?;
    let mut b = [0u8; 1];
    s.write_all(b"m").ok()?;
    s.read_exact(&mut b).ok()?;
    backends
        .iter()
        .zip(before)
        .position(|(b, n)| b.accepted.load(Relaxed) > n)
}

/// sh and mh map a client to the same backend in every process started
/// from the same config: their hash key comes from the config (default:
/// the service's name), not from a random per-process seed.
#[test]
fn sh_and_mh_map_clients_alike_across_restarts() {
    let backends: Vec<Echo> = (0..4).map(|_| Echo::start()).collect();
    let dir = tempfile::tempdir().unwrap();
    let mut text = format!(
        "[daemon]\nworkers = 1\n[admin]\nlisten = \"{}\"\ntoken = \"daemon-process-test-token\"\n",
        free_addr()
    );
    let vips: Vec<SocketAddr> = (0..2).map(|_| free_addr()).collect();
    for (kind, vip) in ["sh", "mh"].iter().zip(&vips) {
        text.push_str(&format!(
            "[[service]]\nname = \"{kind}\"\nprotocol = \"tcp\"\nlisten = \"{vip}\"\nscheduler = \"{kind}\"\n"
        ));
        for b in &backends {
            text.push_str(&format!(
                "  [[service.backend]]\n  address = \"{}\"\n",
                b.addr
            ));
        }
    }
    let p = dir.path().join("weir.toml");
    std::fs::write(&p, text).unwrap();
    let mut maps = Vec::new();
    for _run in 0..2 {
        let mut child = spawn_run(&p, None);
        for vip in &vips {
            wait_up(&mut child, *vip, T);
        }
        let map: Vec<Option<usize>> = vips
            .iter()
            .flat_map(|vip| (10..60u8).map(|h| served_by(h, *vip, &backends)))
            .collect();
        assert!(map.iter().all(Option::is_some), "{map:?}");
        maps.push(map);
        let _ = child.0.kill();
        let _ = child.0.wait();
    }
    // Spread (not all on one backend), and identical across the restart.
    let used: std::collections::BTreeSet<_> = maps[0].iter().collect();
    assert!(used.len() > 2, "{:?}", maps[0]);
    assert_eq!(maps[0], maps[1]);
}

/// One admin request on `admin` with the test token; the status line, or
/// the error that ended it.
fn admin_get(admin: SocketAddr, path: &str, timeout: Duration) -> Result<String, String> {
    let mut s = TcpStream::connect(admin).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(timeout)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer daemon-process-test-token\r\n\
         Connection: close\r\n\r\n"
    )
    .map_err(|e| format!("write: {e}"))?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).map_err(|e| format!("read: {e}"))?;
    Ok(String::from_utf8_lossy(&head).into_owned())
}

/// Issue 10 #23: when the data path has taken every descriptor, the admin
/// API still answers (it keeps spare descriptors for its own accepts).
/// Before, its accept failed with EMFILE like everyone else's and the
/// operator could not reach the daemon while the flood lasted.
#[test]
fn the_admin_api_answers_when_descriptors_are_exhausted() {
    const NOFILE: u64 = 64;
    let run = run_with_nofile(NOFILE);
    let (vip, admin, pid) = (run.vip, run.admin, run.pid);
    assert!(
        admin_get(admin, "/v1/services", T).is_ok_and(|h| h.ends_with("200")),
        "admin API not up"
    );
    let fds_of = |pid| fds_below(pid, NOFILE);
    // Held proxied connections (two descriptors each) until fewer than two
    // are left, then clients that wait in the backlog or for a backend
    // connect: the data path keeps retrying for every free descriptor.
    let mut helds = Vec::new();
    while NOFILE - fds_of(pid) >= 2 {
        helds.push(held(vip));
        assert!(helds.len() < NOFILE as usize, "descriptors do not fill");
    }
    let waiting: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(vip).unwrap()).collect();
    assert!(
        wait_until(T, || fds_of(pid) >= NOFILE),
        "the data path did not take every descriptor ({} of {NOFILE})",
        fds_of(pid)
    );
    for i in 0..3 {
        let got = admin_get(admin, "/v1/services", Duration::from_secs(5));
        assert!(
            got.as_ref().is_ok_and(|h| h.ends_with("200")),
            "admin request {i} at descriptor exhaustion: {got:?}"
        );
    }
    drop(waiting);
    drop(helds);
    drop(run);
}

/// `POST /v1/reload` to the daemon whose admin API is `admin`: (status,
/// body).
fn admin_reload(admin: SocketAddr) -> (u16, String) {
    let mut s = TcpStream::connect(admin).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    write!(
        s,
        "POST /v1/reload HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer daemon-process-test-token\r\n\
         Content-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    let status = r[9..12].parse().unwrap();
    let body = r.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}

/// Thread `tid` of process `pid`: (its `Cpus_allowed_list`, its nice value).
fn thread_placement(pid: u32, tid: u32) -> (String, i32) {
    let base = format!("/proc/{pid}/task/{tid}");
    let status = std::fs::read_to_string(format!("{base}/status")).unwrap();
    let cpus = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_owned();
    let stat = std::fs::read_to_string(format!("{base}/stat")).unwrap();
    // The command name (field 2) may hold spaces: count after its ')'.
    let nice = stat[stat.rfind(')').unwrap() + 2..]
        .split(' ')
        .nth(16)
        .unwrap()
        .parse()
        .unwrap();
    (cpus, nice)
}

/// `[daemon] estimator_cpu` / `estimator_nice` apply on reload: the
/// estimator thread moves to the new CPU and nice value, goes back to what
/// it inherited when the keys are removed, and a CPU the process may not
/// run on refuses the whole reload. (They needed a restart: a reload that
/// changed them was refused.)
#[test]
fn a_reload_moves_the_estimator_thread() {
    let e = Echo::start();
    let vip = free_addr();
    let dir = tempfile::tempdir().unwrap();
    let p = write_config(&dir, vip, e.addr, "estimator_cpu = 0\nestimator_nice = 5");
    let admin = admin_addr(&p);
    let mut child = spawn_run(&p, None);
    wait_up(&mut child, vip, T);
    wait_listening(&mut child, admin, T);
    let pid = child.0.id();
    let tid: u32 = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .map(|t| t.unwrap().file_name().to_string_lossy().parse().unwrap())
        .find(|tid| {
            std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
                .is_ok_and(|c| c.trim() == "weir-estimator")
        })
        .expect("an estimator thread");
    // What the thread inherited: the main thread's.
    let inherited = thread_placement(pid, pid);
    assert_eq!(thread_placement(pid, tid), ("0".to_owned(), 5));
    let rewrite = |daemon: &str| {
        let text = std::fs::read_to_string(&p).unwrap();
        let rest = text.split_once("\n[admin]").unwrap().1;
        std::fs::write(
            &p,
            format!("[daemon]\nworkers = 1\n{daemon}\n[admin]{rest}"),
        )
        .unwrap();
    };

    rewrite("estimator_cpu = 1\nestimator_nice = 9");
    let (status, body) = admin_reload(admin);
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("daemon estimator_cpu") && body.contains("daemon estimator_nice"),
        "{body}"
    );
    assert_eq!(thread_placement(pid, tid), ("1".to_owned(), 9));

    // A CPU this process may not run on: refused, nothing applied.
    rewrite("estimator_cpu = 1023\nestimator_nice = 3");
    let (status, body) = admin_reload(admin);
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("nothing was applied") && body.contains("estimator_cpu = 1023"),
        "{body}"
    );
    assert_eq!(thread_placement(pid, tid), ("1".to_owned(), 9));

    // Keys removed: back to what it inherited (lowering nice back needs
    // CAP_SYS_NICE, which the tests have as root).
    rewrite("");
    let (status, body) = admin_reload(admin);
    assert_eq!(status, 200, "{body}");
    if rustix::process::geteuid().is_root() {
        assert_eq!(thread_placement(pid, tid), inherited);
    } else {
        assert_eq!(thread_placement(pid, tid).0, inherited.0);
    }
    // Still serving.
    assert!(echo_once(vip, b"after"));
    let _ = child.0.kill();
    let _ = child.0.wait();
}

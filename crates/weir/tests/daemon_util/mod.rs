//! Helpers shared by the daemon integration tests: echo backends, config
//! builders and bounded polling.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

pub mod admin;
pub mod process;

use weir::config::{BackendSpec, Config, Protocol, ServiceOptions, ServiceSpec, TenantSpec};

/// Poll `cond` every 20 ms until it holds or `timeout` passes.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A local TCP port that refuses every connect for as long as this value
/// lives: the socket is bound but never listens, so the kernel answers SYNs
/// with a reset and no other socket (another test's echo server, say) can be
/// given the port meanwhile. (A listener bound and dropped frees its port,
/// and a test running alongside may take it and accept.)
pub struct RefusingPort {
    pub addr: SocketAddr,
    _sock: socket2::Socket,
}

impl RefusingPort {
    pub fn new() -> Self {
        use socket2::{Domain, Socket, Type};
        let sock = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        sock.bind(&any.into()).unwrap();
        let addr = sock.local_addr().unwrap().as_socket().unwrap();
        Self { addr, _sock: sock }
    }
}

/// A TCP echo backend; stops accepting when dropped (listener closed).
pub struct Echo {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    pub accepted: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Echo {
    pub fn start() -> Self {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicU64::new(0));
        let (s2, a2) = (stop.clone(), accepted.clone());
        let thread = std::thread::spawn(move || {
            while !s2.load(Relaxed) {
                match l.accept() {
                    Ok((mut s, _)) => {
                        a2.fetch_add(1, Relaxed);
                        s.set_nonblocking(false).unwrap();
                        std::thread::spawn(move || {
                            let mut buf = vec![0u8; 64 * 1024];
                            loop {
                                match s.read(&mut buf) {
                                    Ok(0) | Err(_) => {
                                        let _ = s.shutdown(std::net::Shutdown::Write);
                                        return;
                                    }
                                    Ok(n) => {
                                        if s.write_all(&buf[..n]).is_err() {
                                            return;
                                        }
                                    }
                                }
                            }
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Self {
            addr,
            stop,
            accepted,
            thread: Some(thread),
        }
    }

    /// Close the listener (established connections stay up).
    pub fn kill(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A UDP echo backend.
pub fn udp_echo() -> SocketAddr {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = s.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 65536];
        while let Ok((n, peer)) = s.recv_from(&mut buf) {
            let _ = s.send_to(&buf[..n], peer);
        }
    });
    addr
}

pub fn backend(addr: SocketAddr, weight: u32) -> BackendSpec {
    BackendSpec {
        address: addr,
        weight,
        proxy_protocol: None,
        max_connections: 0,
    }
}

pub fn service(
    name: &str,
    proto: Protocol,
    sched: &str,
    backends: Vec<BackendSpec>,
) -> ServiceSpec {
    ServiceSpec {
        tenant: "default".into(),
        name: name.into(),
        protocol: proto,
        listen: "127.0.0.1:0".parse().unwrap(),
        forward: Default::default(),
        scheduler: weir::config::parse_scheduler(sched).unwrap(),
        persistence: "0s".parse().unwrap(),
        persistence_netmask: None,
        options: ServiceOptions::default(),
        backends,
    }
}

/// The `default` tenant with these limits (0 = unlimited), shared table,
/// IPVS timeouts.
pub fn default_tenant(max_connections: u64, max_new_per_s: u64) -> TenantSpec {
    TenantSpec {
        name: "default".into(),
        max_connections,
        max_new_per_s,
        ..Default::default()
    }
}

pub fn config(services: Vec<ServiceSpec>) -> Config {
    let mut c = Config::default();
    c.daemon.workers = 2;
    c.services = services;
    c
}

/// Connect, send `msg`, read it back; returns whether the echo matched.
pub fn echo_once(addr: SocketAddr, msg: &[u8]) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = vec![0u8; msg.len()];
    s.write_all(msg).is_ok() && s.read_exact(&mut buf).is_ok() && buf == msg
}

/// An open connection that has echoed once (so it is ESTABLISHED in weir).
pub fn held(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"hi").unwrap();
    let mut b = [0u8; 2];
    s.read_exact(&mut b).unwrap();
    s
}

/// Whether an open connection still echoes (it was not cut).
pub fn still_echoes(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 4];
    s.write_all(b"ping").is_ok() && s.read_exact(&mut b).is_ok() && &b == b"ping"
}

/// Which address of a `/proc/self/net/udp` row to match.
#[derive(Clone, Copy)]
pub enum UdpEnd {
    Local,
    Remote,
}

/// The rows of `/proc/self/net/udp` whose local or remote address is
/// `addr` (IPv4), split into their whitespace-separated fields; the error
/// if the file cannot be read (EMFILE while a test holds every fd).
pub fn proc_net_udp_rows(end: UdpEnd, addr: SocketAddr) -> std::io::Result<Vec<Vec<String>>> {
    let SocketAddr::V4(a) = addr else {
        panic!("IPv4 only")
    };
    let want = format!(
        "{:08X}:{:04X}",
        u32::from_le_bytes(a.ip().octets()),
        a.port()
    );
    let column = match end {
        UdpEnd::Local => 1,
        UdpEnd::Remote => 2,
    };
    Ok(std::fs::read_to_string("/proc/self/net/udp")?
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        .filter(|f| f.get(column) == Some(&want))
        .collect())
}

/// Every descriptor of the process taken but `spare`: the limit lowered
/// to `spare` above the highest open one and each hole below it filled,
/// then `spare` of the fillers closed, so that the process has exactly
/// `spare` descriptors left and its next sockets after them fail with
/// `EMFILE`. (The limit once sat just above the highest open descriptor:
/// with no holes below it, as in a process that inherited no high
/// descriptor, one filler was all there was to close, and one spare.) [`Self::release`] (or
/// dropping it) gives the descriptors back and restores the limit. One
/// test at a time may hold it (the limit is the process's).
pub struct FdsTaken {
    fillers: Vec<std::fs::File>,
    limits: Option<(u64, u64)>,
}

impl FdsTaken {
    pub fn all_but(spare: usize) -> Self {
        use nix::sys::resource::{Resource, getrlimit, setrlimit};
        let highest = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
            .max()
            .unwrap_or(0);
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        setrlimit(Resource::RLIMIT_NOFILE, highest + 1 + spare as u64, hard).unwrap();
        let mut fillers = Vec::new();
        while let Ok(f) = std::fs::File::open("/dev/null") {
            fillers.push(f);
            assert!(fillers.len() < 100_000, "bounded");
        }
        assert!(fillers.len() >= spare, "{} fillers", fillers.len());
        for _ in 0..spare {
            drop(fillers.pop());
        }
        // At least `spare` left: as many opens succeed. (One more may: a
        // descriptor that an earlier test's daemon, still stopping, or
        // a test's own thread closed meanwhile.)
        let probe: Vec<_> = (0..spare)
            .map_while(|_| std::fs::File::open("/dev/null").ok())
            .collect();
        assert_eq!(probe.len(), spare, "descriptors left");
        Self {
            fillers,
            limits: Some((soft, hard)),
        }
    }

    pub fn release(mut self) {
        self.give_back();
    }

    fn give_back(&mut self) {
        self.fillers.clear();
        if let Some((soft, hard)) = self.limits.take() {
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, soft, hard)
                .unwrap();
        }
    }
}

impl Drop for FdsTaken {
    fn drop(&mut self) {
        self.give_back();
    }
}

/// A daemon ([`config`]: two workers) with one service `name` of the
/// default tenant ([`service`]), scheduled by `sched`, in front of
/// `backends` (weight 1 each).
pub fn start_service(
    name: &str,
    proto: Protocol,
    sched: &str,
    backends: &[SocketAddr],
) -> weir::daemon::DaemonHandle {
    let backends = backends.iter().map(|&b| backend(b, 1)).collect();
    weir::daemon::Daemon::start(config(vec![service(name, proto, sched, backends)]), None).unwrap()
}

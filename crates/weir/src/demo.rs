//! `weir demo`: a self-contained tour. Built-in TCP and UDP echo backends on
//! loopback, a TCP and a UDP virtual service in front of them, a little
//! traffic, and a live view read through the same `Control` the admin API
//! serves. Everything shown is measured, nothing is made up.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use weir::config::{AdminConfig, BackendSpec, Config, Protocol, ServiceOptions, ServiceSpec};
use weir::control::{ConnFilter, Control};
use weir::daemon::Daemon;

pub(crate) fn run(duration: Option<Duration>) -> ExitCode {
    match run_inner(duration) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weir demo: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn spawn_tcp_echo(stop: Arc<AtomicBool>) -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    l.set_nonblocking(true)?;
    let addr = l.local_addr()?;
    std::thread::spawn(move || {
        while !stop.load(Relaxed) {
            match l.accept() {
                Ok((mut s, _)) => {
                    let _ = s.set_nonblocking(false);
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16 * 1024];
                        loop {
                            match s.read(&mut buf) {
                                Ok(0) | Err(_) => return,
                                Ok(n) => {
                                    if s.write_all(&buf[..n]).is_err() {
                                        return;
                                    }
                                }
                            }
                        }
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    });
    Ok(addr)
}

fn spawn_udp_echo(stop: Arc<AtomicBool>) -> anyhow::Result<SocketAddr> {
    let s = UdpSocket::bind("127.0.0.1:0")?;
    s.set_read_timeout(Some(Duration::from_millis(200)))?;
    let addr = s.local_addr()?;
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while !stop.load(Relaxed) {
            if let Ok((n, peer)) = s.recv_from(&mut buf) {
                let _ = s.send_to(&buf[..n], peer);
            }
        }
    });
    Ok(addr)
}

/// A per-run random token (std's RandomState is randomly keyed per process).
fn demo_token() -> String {
    use std::hash::{BuildHasher, Hasher};
    let s = std::collections::hash_map::RandomState::new();
    let mut a = s.build_hasher();
    a.write_u64(1);
    let mut b = s.build_hasher();
    b.write_u64(2);
    format!("demo-{:016x}{:016x}", a.finish(), b.finish())
}

fn backend(addr: SocketAddr, weight: u32) -> BackendSpec {
    BackendSpec {
        address: addr,
        weight,
        proxy_protocol: None,
        max_connections: 0,
    }
}

fn run_inner(duration: Option<Duration>) -> anyhow::Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    let tcp_b = [spawn_tcp_echo(stop.clone())?, spawn_tcp_echo(stop.clone())?];
    let udp_b = [spawn_udp_echo(stop.clone())?, spawn_udp_echo(stop.clone())?];
    let admin_listen = format!("127.0.0.1:{}", free_port()?);
    let mut cfg = Config {
        admin: AdminConfig {
            listen: admin_listen.clone(),
            token: Some(demo_token()),
            ..AdminConfig::default()
        },
        ..Config::default()
    };
    cfg.daemon.workers = 2;
    cfg.services.push(ServiceSpec {
        tenant: "default".into(),
        name: "demo-tcp".into(),
        protocol: Protocol::Tcp,
        listen: "127.0.0.1:0".parse()?,
        forward: Default::default(),
        scheduler: weir_sched::SchedulerKind::Wrr,
        persistence: crate::config::Dur::fixed("0s", 0),
        persistence_netmask: None,
        options: ServiceOptions::default(),
        backends: vec![backend(tcp_b[0], 1), backend(tcp_b[1], 2)],
    });
    cfg.services.push(ServiceSpec {
        tenant: "default".into(),
        name: "demo-udp".into(),
        protocol: Protocol::Udp,
        listen: "127.0.0.1:0".parse()?,
        forward: Default::default(),
        scheduler: weir_sched::SchedulerKind::Rr,
        persistence: crate::config::Dur::fixed("0s", 0),
        persistence_netmask: None,
        options: ServiceOptions {
            udp_timeout: Some(crate::config::Dur::fixed("30s", 30_000)),
            ..ServiceOptions::default()
        },
        backends: vec![backend(udp_b[0], 1), backend(udp_b[1], 1)],
    });
    let handle = Daemon::start(cfg.clone(), None)?;
    let admin_stop = CancellationToken::new();
    crate::start_admin(&handle, &cfg.admin, admin_stop.clone())?;
    let tcp_vip = handle
        .service_addr("default", "demo-tcp")
        .ok_or_else(|| anyhow::anyhow!("demo-tcp did not start"))?;
    let udp_vip = handle
        .service_addr("default", "demo-udp")
        .ok_or_else(|| anyhow::anyhow!("demo-udp did not start"))?;
    println!(
        "weir demo: TCP echo backends {} {}, UDP echo backends {} {}",
        tcp_b[0], tcp_b[1], udp_b[0], udp_b[1]
    );
    println!("  virtual services: tcp {tcp_vip} (wrr, weights 1:2), udp {udp_vip} (rr)");
    let token = cfg.admin.token.clone().unwrap_or_default();
    println!("  admin API: http://{admin_listen}  token {token}");
    println!("  try: WEIR_ADMIN=http://{admin_listen} WEIR_TOKEN={token} weir list");
    println!("  dashboard: http://{admin_listen}/ui/?token={token}");
    println!(
        "  try: nc {} {}   |   Ctrl-C to stop",
        tcp_vip.ip(),
        tcp_vip.port()
    );

    let traffic_errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let driver = {
        let stop = stop.clone();
        let errs = traffic_errors.clone();
        std::thread::spawn(move || drive(tcp_vip, udp_vip, &stop, &errs))
    };

    let ctrl_c = Arc::new(AtomicBool::new(false));
    {
        let flag = ctrl_c.clone();
        handle.runtime().spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                flag.store(true, Relaxed);
            }
        });
    }
    let control = handle.control();
    let start = Instant::now();
    let mut next_print = start + Duration::from_secs(1);
    loop {
        if ctrl_c.load(Relaxed) || duration.is_some_and(|d| start.elapsed() >= d) {
            break;
        }
        if Instant::now() >= next_print {
            show(&*control, start.elapsed());
            next_print += Duration::from_secs(3);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    show(&*control, start.elapsed());
    stop.store(true, Relaxed);
    let _ = driver.join();
    admin_stop.cancel();
    drop(control);
    handle.shutdown();
    let errs = traffic_errors.load(Relaxed);
    if errs > 0 {
        println!("weir demo: {errs} traffic round trip(s) failed");
    }
    println!("weir demo: stopped");
    Ok(())
}

/// Long-lived TCP connections that echo every 300 ms, a short connection
/// every 300 ms, and UDP pings from three client sockets.
fn drive(tcp: SocketAddr, udp: SocketAddr, stop: &AtomicBool, errs: &std::sync::atomic::AtomicU64) {
    let mut long: Vec<TcpStream> = (0..3)
        .filter_map(|_| TcpStream::connect(tcp).ok())
        .collect();
    for s in &long {
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    }
    let udp_clients: Vec<UdpSocket> = (0..3)
        .filter_map(|_| UdpSocket::bind("127.0.0.1:0").ok())
        .collect();
    for u in &udp_clients {
        let _ = u.set_read_timeout(Some(Duration::from_secs(2)));
    }
    let payload = vec![b'w'; 4096];
    let mut buf = vec![0u8; 4096];
    while !stop.load(Relaxed) {
        let mut ok = true;
        for s in long.iter_mut() {
            ok &= s.write_all(&payload).is_ok() && s.read_exact(&mut buf).is_ok();
        }
        match TcpStream::connect(tcp) {
            Ok(mut s) => {
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                ok &= s.write_all(&payload[..512]).is_ok() && s.read_exact(&mut buf[..512]).is_ok();
            }
            Err(_) => ok = false,
        }
        for u in &udp_clients {
            ok &= u.send_to(b"ping", udp).is_ok() && u.recv_from(&mut buf).is_ok();
        }
        if !ok {
            errs.fetch_add(1, Relaxed);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn show(control: &dyn Control, elapsed: Duration) {
    println!();
    println!(
        "--- weir demo, t = {:.0}s (live from the daemon's Control; rates are 2 s EWMAs) ---",
        elapsed.as_secs_f64()
    );
    println!(
        "{:<4} {:<22} {:<5} {:>6} {:>8} {:>10} {:>10} {:>6} {:>9} {:>9}",
        "prot",
        "virtual / backend",
        "sched",
        "weight",
        "act/inact",
        "inbytes",
        "outbytes",
        "cps",
        "inbps",
        "outbps"
    );
    for s in control.services() {
        println!(
            "{:<4} {:<22} {:<5} {:>6} {:>8} {:>10} {:>10} {:>6} {:>9} {:>9}",
            s.protocol.to_uppercase(),
            s.listen,
            s.scheduler,
            "",
            s.stats.conns,
            s.stats.inbytes,
            s.stats.outbytes,
            s.rates.cps,
            s.rates.inbps,
            s.rates.outbps
        );
        for b in &s.backends {
            println!(
                "  -> {:<19} {:<5} {:>6} {:>8} {:>10} {:>10} {:>6} {:>9} {:>9}",
                b.address,
                b.health,
                b.weight,
                format!("{}/{}", b.active_conns, b.inactive_conns),
                b.stats.inbytes,
                b.stats.outbytes,
                b.rates.cps,
                b.rates.inbps,
                b.rates.outbps
            );
        }
    }
    let g = control.global_stats();
    println!(
        "total: {} conns scheduled, {} live, open fds {}/{}",
        g.stats.conns, g.active_conns, g.open_fds, g.fd_limit
    );
    match control.connections(&ConnFilter::default(), None, 8) {
        Ok(page) => {
            println!("connections (first {}):", page.connections.len());
            for c in page.connections {
                println!(
                    "  {:<4} {:<21} -> {:<21} -> {:<21} {:<12} exp {:>4}s in {:>8} out {:>8} cookie {}",
                    c.proto,
                    c.client,
                    c.virtual_,
                    c.backend,
                    c.state,
                    c.expires_s,
                    c.bytes_in,
                    c.bytes_out,
                    c.cookie
                );
            }
        }
        Err(e) => println!("connections: {e}"),
    }
}

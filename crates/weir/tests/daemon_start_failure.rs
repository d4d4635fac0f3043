//! A start that fails part-way stops what it started. Its own test binary:
//! it counts the process's threads, which other tests' daemons would add
//! to.

mod daemon_util;

use std::net::{SocketAddr, TcpListener};

use daemon_util::*;
use weir::config::Protocol;
use weir::daemon::Daemon;

/// Threads of this process whose name starts with `prefix`.
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with(prefix))
        .count()
}

/// The second service's address is taken, so the start fails after the
/// first service was added and handed to a worker: the start's error must
/// leave no worker thread running and the first service's port free. It
/// left both (the workers' listen tasks hold the daemon's state, which
/// holds the workers' channels), so a library caller that retried the
/// start found its own first port taken.
#[test]
fn a_failed_start_stops_its_workers_and_closes_what_it_opened() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let free = TcpListener::bind("127.0.0.1:0").unwrap();
    let first: SocketAddr = free.local_addr().unwrap();
    drop(free);
    let backend_addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let mut a = service("a", Protocol::Tcp, "rr", vec![backend(backend_addr, 1)]);
    a.listen = first;
    let mut b = service("b", Protocol::Tcp, "rr", vec![backend(backend_addr, 1)]);
    b.listen = taken.local_addr().unwrap();
    let cfg = config(vec![a, b]);
    assert_eq!(threads_named("weir-"), 0, "a daemon of another test runs");

    let err = Daemon::start(cfg.clone(), None).expect_err("the second address is taken");
    let msg = format!("{err:#}");
    assert!(msg.contains(&b_addr(&cfg)), "{msg}");
    assert_eq!(
        threads_named("weir-"),
        0,
        "threads of the failed start still run"
    );
    TcpListener::bind(first).expect("the first service's port is free again");

    // And the same config starts once the address is free.
    drop(taken);
    let d = Daemon::start(cfg, None).expect("starts");
    assert!(threads_named("weir-worker") > 0);
    d.shutdown();
    assert_eq!(threads_named("weir-"), 0);
}

fn b_addr(cfg: &weir::config::Config) -> String {
    cfg.services[1].listen.to_string()
}

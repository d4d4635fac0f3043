//! Quick single-process timing of the table's operations, for development.
//! Not a benchmark of record (weir-bench `table` races the peers); prints
//! ns/op measured in this run only. The machine is shared and noisy.
//!
//! `cargo run --release -p weir-flowtable --example quick -- [entries] [stripes]`
//!
//! `QUICK_ONLY=get|touch|miss|churn` with `QUICK_OPS=N` runs only N of one
//! operation after the build (for `perf stat` / callgrind counts: run with
//! N and with 0, subtract); `QUICK_ONLY=churn2` churns on two threads;
//! `QUICK_ONLY=dump` builds and dumps only.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Instant;

use weir_flowtable::*;

fn key(i: u64) -> FlowKey {
    FlowKey {
        tenant: TenantId(1),
        proto: Proto::Tcp,
        client: SocketAddr::new(
            Ipv6Addr::new(
                0x2001,
                0xdb8,
                0,
                0,
                0,
                (i >> 32) as u16,
                (i >> 16) as u16,
                i as u16,
            )
            .into(),
            (i % 50_000) as u16 + 1024,
        ),
        virt: SocketAddr::new(Ipv4Addr::new(192, 0, 2, 1).into(), 443),
    }
}

/// CPU time of this thread in ns (the machine is oversubscribed, so wall
/// time mostly measures other people's builds).
fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[derive(Clone, Copy)]
struct Clock(Instant, u64);

fn now() -> Clock {
    Clock(Instant::now(), cpu_ns())
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^ (x >> 33)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u64 = args
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    let stripes: Option<usize> = args.next().and_then(|s| s.parse().ok());
    let cfg = TableConfig {
        shared_buckets: (n as usize).next_power_of_two(),
        seed: Some(1),
        ..Default::default()
    };
    let _ = stripes; // lock stripes are gone: a lock bit per bucket
    let t = FlowTable::new(cfg);
    t.add_tenant(TenantId(1), TenantConfig::default()).unwrap();
    let init = FlowInit {
        owner: 0,
        service: ServiceId(1),
        backend: BackendId(2),
        state: FlowState::Established,
    };
    let t0 = now();
    for i in 0..n {
        t.insert(key(i), init, Millis(0)).unwrap();
    }
    let ns = |t0: Clock, ops: u64| {
        let wall = t0.0.elapsed().as_nanos() as f64 / ops as f64;
        let cpu = (cpu_ns() - t0.1) as f64 / ops as f64;
        format!("{cpu:7.1} cpu-ns ({wall:7.1} wall)")
    };
    println!(
        "entries {n}; noisy shared machine, figures from this run only (CPU time of this thread)"
    );
    println!("insert        {} /op", ns(t0, n));
    println!(
        "memory        {:7.1} B/entry",
        t.memory_bytes() as f64 / n as f64
    );
    let only = std::env::var("QUICK_ONLY").unwrap_or_default();
    let ops: u64 = std::env::var("QUICK_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000_000);
    let ops = if only == "dump" { 0 } else { ops };
    // Single-operation modes for instruction / cache-miss counting: run once
    // with QUICK_OPS=0 and once with QUICK_OPS=N under `perf stat` and divide
    // the difference by N (the build phase is deterministic for a seed).
    match only.as_str() {
        "get" | "touch" | "miss" => {
            let mut found = 0u64;
            for j in 0..ops {
                found += u64::from(match only.as_str() {
                    "get" => t.get(&key(mix(j) % n)).is_some(),
                    "touch" => t.touch(&key(mix(j) % n), Millis(1), Dir::In, 10).is_some(),
                    _ => t.get(&key(n + mix(j) % n)).is_some(),
                });
            }
            println!("{only} x {ops}: found {found}");
            return;
        }
        _ => {}
    }
    if only == "churn2" {
        // Two threads, each churning its own window of keys (pairs = ops
        // per thread); prints wall time per pair over both threads.
        let t0 = Instant::now();
        std::thread::scope(|sc| {
            for th in 0..2u64 {
                let t = &t;
                sc.spawn(move || {
                    for j in 0..ops {
                        let p = j * 2 + th;
                        t.insert(key(n + p), init, Millis(2)).unwrap();
                        t.remove(&key(p)).unwrap();
                    }
                });
            }
        });
        let wall = t0.elapsed().as_nanos() as f64 / (2 * ops) as f64;
        println!("churn2 pair   {wall:7.1} wall-ns per pair (2 threads)");
        return;
    }
    if only == "churn" {
        let t0 = now();
        for j in 0..ops {
            t.insert(key(n + j), init, Millis(2)).unwrap();
            t.remove(&key(j)).unwrap();
        }
        println!("churn pair    {} /pair", ns(t0, ops));
        return;
    }
    let t0 = now();
    let mut hits = 0;
    for j in 0..ops {
        hits += u64::from(t.get(&key(mix(j) % n)).is_some());
    }
    println!("get hit       {} /op ({hits})", ns(t0, ops));
    let t0 = now();
    for j in 0..ops {
        hits += u64::from(t.touch(&key(mix(j) % n), Millis(1), Dir::In, 10).is_some());
    }
    println!("touch hit     {} /op ({hits})", ns(t0, ops));
    let t0 = now();
    let mut miss = 0;
    for j in 0..ops {
        miss += u64::from(t.get(&key(n + mix(j) % n)).is_none());
    }
    println!("get miss      {} /op ({miss})", ns(t0, ops));
    let t0 = now();
    for j in 0..ops / 2 {
        let add = n + j;
        t.insert(key(add), init, Millis(2)).unwrap();
        t.remove(&key(j)).unwrap();
    }
    println!("churn pair    {} /pair", ns(t0, ops / 2));
    for page in [1usize, 100, 10_000] {
        let t0 = now();
        let mut out = Vec::with_capacity(page);
        let mut cur = None;
        let mut total = 0;
        loop {
            out.clear();
            let next = t.dump(cur.as_ref(), &DumpFilter::default(), page, &mut out);
            total += out.len();
            match next {
                Some(c) => cur = Some(c),
                None => break,
            }
        }
        println!(
            "dump page {page:>5} {} /entry ({total})",
            ns(t0, total as u64)
        );
    }
    if ops == 0 {
        return;
    }
    let t0 = now();
    let mut out = Vec::new();
    let mut expired = 0;
    loop {
        out.clear();
        let k = t.expire(Millis(10_000_000), 100_000, &mut out);
        expired += k;
        if k == 0 {
            break;
        }
    }
    println!(
        "expire        {} /entry ({expired})",
        ns(t0, expired as u64)
    );
}

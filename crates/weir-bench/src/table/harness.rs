//! Shared pieces of the table and dump suites: the key every implementation
//! stores, the peers' value, a count- and time-bounded thread runner, a cheap
//! seeded PRNG and process RSS.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use weir_flowtable::{FlowKey, Proto, TenantId};

/// The key every implementation stores: weir's own flow key (tenant,
/// protocol, client and virtual socket addresses; IPv6-capable).
pub(crate) type Key = FlowKey;

/// Key number `idx` of `tenant`. Injective in `(tenant, idx)` for `idx < 2^48`;
/// [`idx_of`] inverts it. One key in four has IPv6 addresses so hashing and
/// comparison cover both families.
pub(crate) fn key(tenant: u32, idx: u64) -> Key {
    let port = (idx & 0xffff) as u16;
    let (client, virt) = if idx % 4 == 3 {
        let ip = Ipv6Addr::from((0x2001_0db8_u128 << 96) | u128::from(idx));
        let virt = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 1);
        (
            SocketAddr::new(IpAddr::V6(ip), port),
            SocketAddr::new(IpAddr::V6(virt), 443),
        )
    } else {
        let ip = Ipv4Addr::from(((idx >> 16) & 0xffff_ffff) as u32);
        let virt = Ipv4Addr::new(192, 0, 2, 1);
        (
            SocketAddr::new(IpAddr::V4(ip), port),
            SocketAddr::new(IpAddr::V4(virt), 443),
        )
    };
    FlowKey {
        tenant: TenantId(tenant),
        proto: Proto::Tcp,
        client,
        virt,
    }
}

/// The `idx` that [`key`] built `k` from.
pub(crate) fn idx_of(k: &Key) -> u64 {
    let port = u64::from(k.client.port());
    match k.client.ip() {
        IpAddr::V4(ip) => (u64::from(u32::from(ip)) << 16) | port,
        IpAddr::V6(ip) => (u128::from(ip) & u128::from(u64::MAX)) as u64,
    }
}

/// What the peers store: the same information as weir's entry payload
/// (service, backend, state, created/last-seen times, four counters, cookie).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PeerVal {
    pub(crate) created_ms: u64,
    pub(crate) last_seen_ms: u64,
    pub(crate) counters: [u64; 4],
    pub(crate) cookie: u64,
    pub(crate) service: u32,
    pub(crate) backend: u32,
    pub(crate) state: u8,
}

impl PeerVal {
    pub(crate) fn for_idx(idx: u64) -> Self {
        Self {
            created_ms: 1,
            last_seen_ms: 1,
            counters: [0; 4],
            cookie: idx,
            service: 1,
            backend: (idx & 0xff) as u32,
            state: 1,
        }
    }
}

/// splitmix64: a cheap seeded generator so every run replays the same indices.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..n` for benchmarking (multiply-shift, no modulo bias worth noting).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

/// Bounds for one measurement: it stops at whichever comes first.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limit {
    pub(crate) ops: u64,
    pub(crate) time: Duration,
}

/// Result of one measurement.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Run {
    /// Operations done by all threads.
    pub(crate) ops: u64,
    /// Sum of what the bodies returned (e.g. hits), to check the run did what it claims.
    pub(crate) ok: u64,
    /// Wall time from the common start to the last thread's end.
    pub(crate) secs: f64,
    /// CPU time the threads got (`/proc/thread-self/schedstat`), 0 if unreadable.
    pub(crate) cpu_secs: f64,
    /// Threads used.
    pub(crate) threads: usize,
}

impl Run {
    pub(crate) fn per_sec(&self) -> f64 {
        if self.secs > 0.0 {
            self.ops as f64 / self.secs
        } else {
            0.0
        }
    }

    /// Share of `threads` cores the threads actually ran on (others' builds
    /// compete for the same 2 cores): 1.0 = never preempted.
    pub(crate) fn cpu_share(&self) -> f64 {
        let denom = self.secs * self.threads as f64;
        if denom > 0.0 {
            self.cpu_secs / denom
        } else {
            0.0
        }
    }
}

/// CPU time this thread has run, in seconds (first field of
/// `/proc/thread-self/schedstat`, nanoseconds), or 0 if unreadable.
pub(crate) fn thread_cpu_secs() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0.0, |ns| ns as f64 / 1e9)
}

const BATCH: u64 = 512;

/// Runs `body(handle, thread, iteration)` on one OS thread per handle, all
/// released together, each bounded by `limit.ops / threads` iterations and by
/// `limit.time` (checked every 512 iterations).
pub(crate) fn run<O: Send>(
    handles: Vec<O>,
    limit: Limit,
    body: impl Fn(&mut O, usize, u64) -> u64 + Sync,
) -> Run {
    run_inner(handles, limit, false, body)
}

/// Like [`run`], but every thread does the same number of iterations: a
/// thread that reaches the time limit publishes its count and all threads
/// then run up to the largest published count (still at most
/// `limit.ops / threads`). Wall time includes that catch-up. Used where the
/// iterations walk a shared sequence that must end in a consistent state.
pub(crate) fn run_equal<O: Send>(
    handles: Vec<O>,
    limit: Limit,
    body: impl Fn(&mut O, usize, u64) -> u64 + Sync,
) -> Run {
    run_inner(handles, limit, true, body)
}

fn run_inner<O: Send>(
    handles: Vec<O>,
    limit: Limit,
    equal: bool,
    body: impl Fn(&mut O, usize, u64) -> u64 + Sync,
) -> Run {
    let threads = handles.len().max(1);
    let per_thread = limit.ops / threads as u64;
    let barrier = Barrier::new(threads + 1);
    let target = AtomicU64::new(0);
    let published = AtomicUsize::new(0);
    let (start, results) = std::thread::scope(|s| {
        let joins: Vec<_> = handles
            .into_iter()
            .enumerate()
            .map(|(t, mut h)| {
                let (barrier, body, target, published) = (&barrier, &body, &target, &published);
                s.spawn(move || {
                    barrier.wait();
                    let cpu0 = thread_cpu_secs();
                    let deadline = Instant::now() + limit.time;
                    let (mut j, mut ok) = (0u64, 0u64);
                    let mut batch_to = |j: &mut u64, ok: &mut u64, end: u64| {
                        while *j < end {
                            *ok += body(&mut h, t, *j);
                            *j += 1;
                        }
                    };
                    while j < per_thread {
                        let end = (j + BATCH).min(per_thread);
                        batch_to(&mut j, &mut ok, end);
                        if Instant::now() >= deadline {
                            break;
                        }
                    }
                    if equal {
                        target.fetch_max(j, Ordering::AcqRel);
                        published.fetch_add(1, Ordering::AcqRel);
                        loop {
                            let goal = target.load(Ordering::Acquire);
                            if j < goal {
                                let end = (j + BATCH).min(goal);
                                batch_to(&mut j, &mut ok, end);
                            } else if published.load(Ordering::Acquire) == threads {
                                // Every thread has published, so `goal` is final.
                                break;
                            } else {
                                std::thread::yield_now();
                            }
                        }
                    }
                    (j, ok, thread_cpu_secs() - cpu0)
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let results: Vec<(u64, u64, f64)> = joins
            .into_iter()
            .map(|j| j.join().unwrap_or((0, 0, 0.0)))
            .collect();
        (start, results)
    });
    let secs = start.elapsed().as_secs_f64();
    Run {
        ops: results.iter().map(|r| r.0).sum(),
        ok: results.iter().map(|r| r.1).sum(),
        secs,
        cpu_secs: results.iter().map(|r| r.2).sum(),
        threads,
    }
}

/// Resident set size of this process in bytes (VmRSS), or 0 if unreadable.
pub(crate) fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Formats a rate as e.g. `12.3M`.
pub(crate) fn si(x: f64) -> String {
    if x < 1e3 && x.fract() == 0.0 {
        format!("{x:.0}")
    } else if x >= 1e9 {
        format!("{:.2}G", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn keys_are_distinct() {
        let set: HashSet<Key> = (0..100_000u64).map(|i| key(1, i)).collect();
        assert!((0..100_000u64).all(|i| idx_of(&key(1, i)) == i));
        assert_eq!(idx_of(&key(3, (1 << 40) + 7)), (1 << 40) + 7);
        assert_eq!(set.len(), 100_000);
        assert_ne!(key(1, 5), key(2, 5));
        let big: HashSet<Key> = (0..1000u64).map(|i| key(1, (1 << 40) + i)).collect();
        assert!(big.is_disjoint(&set));
    }

    #[test]
    fn run_is_bounded_by_count() {
        let r = run(
            vec![(), ()],
            Limit {
                ops: 10_000,
                time: Duration::from_secs(30),
            },
            |_, _, _| 1,
        );
        assert_eq!(r.ops, 10_000);
        assert_eq!(r.ok, 10_000);
    }

    #[test]
    fn run_equal_gives_every_thread_the_same_count() {
        // Thread 1 is ~50x slower per iteration; both must still end equal.
        let done = [AtomicU64::new(0), AtomicU64::new(0)];
        let r = run_equal(
            vec![(), ()],
            Limit {
                ops: u64::MAX,
                time: Duration::from_millis(30),
            },
            |_, t, j| {
                let spins = if t == 1 { 50 } else { 1 };
                for k in 0..spins {
                    std::hint::black_box(j + k);
                }
                done[t].store(j + 1, Ordering::Relaxed);
                1
            },
        );
        let (a, b) = (
            done[0].load(Ordering::Relaxed),
            done[1].load(Ordering::Relaxed),
        );
        assert_eq!(a, b);
        assert_eq!(r.ops, a + b);
        assert_eq!(r.ok, r.ops);
        assert!(r.ops > 0);
    }

    #[test]
    fn run_is_bounded_by_time() {
        let r = run(
            vec![()],
            Limit {
                ops: u64::MAX,
                time: Duration::from_millis(20),
            },
            |_, _, j| {
                std::hint::black_box(j);
                1
            },
        );
        assert!(r.ops > 0 && r.ops < u64::MAX);
        assert!(r.secs < 5.0);
    }

    #[test]
    fn rng_below_stays_in_range() {
        let mut r = Rng::new(7);
        assert!((0..10_000).all(|_| r.below(13) < 13));
    }
}

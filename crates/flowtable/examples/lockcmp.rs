//! Write-side locking schemes for a chained hash table, compared on one
//! simplified table (u64 keys, index-linked nodes, no reclamation), so that
//! only the locking differs:
//!
//! * `striped/S` — S mutexes, bucket `b` uses `b % S` (what weir ships;
//!   the kernel's ehash uses ~32 spinlocks per CPU);
//! * `bitlock` — a spin bit in each bucket head (IPVS per-net work, VPP);
//! * `percpu/N` — seed 001: every bucket split into N chains, one per
//!   writer thread, each with its own bit lock; a lookup probes N chains and
//!   a duplicate check must lock and walk all N.
//!
//! Prints a markdown table with ratios to the best scheme of the same run.
//! The machine is shared and noisy: figures are from this run only.
//!
//! `cargo run --release -p weir-flowtable --example lockcmp -- [live] [pairs_per_thread]`

use std::hint::spin_loop;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};
use std::time::Instant;

use parking_lot::Mutex;

const NIL: u32 = u32::MAX >> 1;
const LOCK: u32 = 1 << 31;

struct Node {
    key: AtomicU64,
    next: AtomicU32,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Scheme {
    Striped(usize),
    BitLock,
    PerCpu(usize),
}

struct Table {
    scheme: Scheme,
    heads: Vec<AtomicU32>,
    nodes: Vec<Node>,
    stripes: Vec<Mutex<()>>,
    mask: u64,
    chains: usize,
}

fn hash(k: u64) -> u64 {
    let mut x = k ^ 0x9E37_79B9_7F4A_7C15;
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Table {
    fn new(scheme: Scheme, buckets: usize, nodes: usize) -> Table {
        let chains = match scheme {
            Scheme::PerCpu(n) => n,
            _ => 1,
        };
        let stripes = match scheme {
            Scheme::Striped(s) => s,
            _ => 0,
        };
        Table {
            scheme,
            heads: (0..buckets * chains).map(|_| AtomicU32::new(NIL)).collect(),
            nodes: (0..nodes)
                .map(|_| Node {
                    key: AtomicU64::new(0),
                    next: AtomicU32::new(NIL),
                })
                .collect(),
            stripes: (0..stripes).map(|_| Mutex::new(())).collect(),
            mask: buckets as u64 - 1,
            chains,
        }
    }

    fn bit_lock(&self, h: usize) {
        let head = &self.heads[h];
        loop {
            let v = head.load(Relaxed);
            if v & LOCK == 0
                && head
                    .compare_exchange_weak(v, v | LOCK, Acquire, Relaxed)
                    .is_ok()
            {
                return;
            }
            spin_loop();
        }
    }

    fn bit_unlock(&self, h: usize) {
        self.heads[h].fetch_and(!LOCK, Release);
    }

    fn find_in(&self, h: usize, key: u64) -> Option<u32> {
        let mut i = self.heads[h].load(Acquire) & !LOCK;
        while i != NIL {
            let n = &self.nodes[i as usize];
            if n.key.load(Relaxed) == key {
                return Some(i);
            }
            i = n.next.load(Acquire);
        }
        None
    }

    fn get(&self, key: u64) -> bool {
        let b = (hash(key) & self.mask) as usize;
        (0..self.chains).any(|c| self.find_in(b * self.chains + c, key).is_some())
    }

    /// Under the chain's lock: append `idx` unless `key` is present.
    fn link(&self, h: usize, key: u64, idx: u32) -> bool {
        if self.find_in(h, key).is_some() {
            return false;
        }
        self.nodes[idx as usize].key.store(key, Relaxed);
        self.nodes[idx as usize].next.store(NIL, Relaxed);
        let head = &self.heads[h];
        let v = head.load(Relaxed);
        if v & !LOCK == NIL {
            head.store((v & LOCK) | idx, Release);
            return true;
        }
        let mut link = &self.nodes[(v & !LOCK) as usize].next;
        loop {
            let i = link.load(Relaxed);
            if i == NIL {
                link.store(idx, Release);
                return true;
            }
            link = &self.nodes[i as usize].next;
        }
    }

    fn unlink(&self, h: usize, key: u64) -> Option<u32> {
        let head = &self.heads[h];
        let v = head.load(Relaxed);
        let mut prev: Option<&AtomicU32> = None;
        let mut i = v & !LOCK;
        while i != NIL {
            let n = &self.nodes[i as usize];
            let next = n.next.load(Relaxed);
            if n.key.load(Relaxed) == key {
                match prev {
                    None => head.store((head.load(Relaxed) & LOCK) | next, Release),
                    Some(l) => l.store(next, Release),
                }
                return Some(i);
            }
            prev = Some(&n.next);
            i = next;
        }
        None
    }

    fn insert(&self, key: u64, idx: u32, cpu: usize) -> bool {
        let b = (hash(key) & self.mask) as usize;
        match self.scheme {
            Scheme::Striped(s) => {
                let _g = self.stripes[b % s].lock();
                self.link(b, key, idx)
            }
            Scheme::BitLock => {
                self.bit_lock(b);
                let r = self.link(b, key, idx);
                self.bit_unlock(b);
                r
            }
            Scheme::PerCpu(n) => {
                // Duplicate check over all N chains needs all N locks.
                for c in 0..n {
                    self.bit_lock(b * n + c);
                }
                let dup = (0..n).any(|c| c != cpu && self.find_in(b * n + c, key).is_some());
                let r = !dup && self.link(b * n + cpu, key, idx);
                for c in 0..n {
                    self.bit_unlock(b * n + c);
                }
                r
            }
        }
    }

    /// Removes `key`, which the caller inserted on chain `cpu` (the node
    /// remembers it, like sk_hashcpu).
    fn remove(&self, key: u64, cpu: usize) -> Option<u32> {
        let b = (hash(key) & self.mask) as usize;
        match self.scheme {
            Scheme::Striped(s) => {
                let _g = self.stripes[b % s].lock();
                self.unlink(b, key)
            }
            Scheme::BitLock => {
                self.bit_lock(b);
                let r = self.unlink(b, key);
                self.bit_unlock(b);
                r
            }
            Scheme::PerCpu(n) => {
                let h = b * n + cpu;
                self.bit_lock(h);
                let r = self.unlink(h, key);
                self.bit_unlock(h);
                r
            }
        }
    }
}

fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// (wall pairs/s, pairs per CPU-second summed over threads)
fn churn(t: &Table, live: u64, threads: usize, pairs: u64) -> (f64, f64) {
    let per = live / threads as u64;
    // Thread `w` owns keys w*2^40.. and node range w*(per+pairs)..
    for w in 0..threads {
        for j in 0..per {
            let idx = (w as u64 * (per + pairs) + j) as u32;
            assert!(t.insert(((w as u64) << 40) | j, idx, w));
        }
    }
    let t0 = Instant::now();
    let cpu: u64 = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|w| {
                s.spawn(move || {
                    let c0 = cpu_ns();
                    let base = w as u64 * (per + pairs);
                    let mut free: Vec<u32> = Vec::new();
                    for j in 0..pairs {
                        let k_new = ((w as u64) << 40) | (per + j);
                        let idx = free.pop().unwrap_or((base + per + j) as u32);
                        assert!(t.insert(k_new, idx, w));
                        let k_old = ((w as u64) << 40) | j;
                        free.push(t.remove(k_old, w).expect("present"));
                    }
                    cpu_ns() - c0
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    let total = (pairs * threads as u64) as f64;
    (
        total / t0.elapsed().as_secs_f64(),
        total / (cpu as f64 / 1e9),
    )
}

fn lookups(t: &Table, live: u64, threads: usize, miss: bool) -> f64 {
    let n = 1_000_000u64;
    let per = live / threads as u64;
    let c0 = cpu_ns();
    let mut found = 0;
    for j in 0..n {
        let r = hash(j) % per;
        let k = if miss { (7u64 << 40) | r } else { r };
        found += u64::from(t.get(k));
    }
    assert!(miss || found == n);
    n as f64 / ((cpu_ns() - c0) as f64 / 1e9)
}

/// Median of a run's repetitions.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let live: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1 << 20);
    let pairs: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(500_000);
    let reps: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(5);
    let buckets = (live as usize).next_power_of_two();
    let schemes = [
        Scheme::Striped(1),
        Scheme::Striped(256),
        Scheme::Striped(4096),
        Scheme::BitLock,
        Scheme::PerCpu(2),
    ];
    println!(
        "live {live}, {buckets} buckets, {pairs} insert+remove pairs per thread, median of {reps} \
         repetitions interleaved across schemes."
    );
    println!("Noisy shared 2-core machine: only ratios within this run mean anything.\n");
    // samples[scheme][metric] = values; metrics: churn1 cpu, churn2 wall, churn2 cpu, hit, miss
    let mut samples = vec![vec![Vec::new(); 5]; schemes.len()];
    for _ in 0..reps {
        for (si, &s) in schemes.iter().enumerate() {
            let t = Table::new(s, buckets, (live + pairs + 16) as usize);
            samples[si][0].push(churn(&t, live, 1, pairs).1);
            let t = Table::new(s, buckets, (live + 2 * pairs + 16) as usize);
            let (w, c) = churn(&t, live, 2, pairs);
            samples[si][1].push(w);
            samples[si][2].push(c);
            let t = Table::new(s, buckets, (live + 16) as usize);
            for j in 0..live {
                assert!(t.insert(j, j as u32, 0));
            }
            samples[si][3].push(lookups(&t, live, 1, false));
            samples[si][4].push(lookups(&t, live, 1, true));
        }
    }
    let med: Vec<Vec<f64>> = samples
        .into_iter()
        .map(|m| m.into_iter().map(median).collect())
        .collect();
    let best: Vec<f64> = (0..5)
        .map(|k| med.iter().map(|m| m[k]).fold(0.0, f64::max))
        .collect();
    println!(
        "| scheme | churn 1 thread (pairs/CPU-s) | churn 2 threads (pairs/s wall) | churn 2 threads (pairs/CPU-s) | hit lookups/CPU-s | miss lookups/CPU-s |"
    );
    println!("|---|---|---|---|---|---|");
    for (s, m) in schemes.iter().zip(&med) {
        let name = match s {
            Scheme::Striped(n) => format!("striped/{n}"),
            Scheme::BitLock => "bitlock".into(),
            Scheme::PerCpu(n) => format!("percpu/{n}"),
        };
        let cells: Vec<String> = m
            .iter()
            .zip(&best)
            .map(|(v, b)| format!("{:.2}M ({:.2}x)", v / 1e6, v / b))
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
}

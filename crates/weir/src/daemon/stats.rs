//! Counters and IPVS-style rate estimation for backends, services, tenants
//! and the daemon.
//!
//! The data path adds to [`Counters`] (relaxed atomics); a dedicated thread
//! calls [`Stat::tick`] every [`TICK`] on every live statistic, which turns
//! the counter deltas into an exponentially weighted moving average with the
//! IPVS weights (rates: 1/4 per 2 s tick, as `ip_vs_est.c`).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use parking_lot::Mutex;

use crate::control::{Rates, Totals};

/// Estimator period (IPVS: 2 s).
pub(crate) const TICK: Duration = Duration::from_secs(2);

/// Cumulative counters updated on the data path.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    conns: AtomicU64,
    inpkts: AtomicU64,
    outpkts: AtomicU64,
    inbytes: AtomicU64,
    outbytes: AtomicU64,
}

impl Counters {
    pub(crate) fn conn(&self) {
        self.conns.fetch_add(1, Relaxed);
    }
    pub(crate) fn add_in(&self, bytes: u64) {
        self.inpkts.fetch_add(1, Relaxed);
        self.inbytes.fetch_add(bytes, Relaxed);
    }
    pub(crate) fn add_out(&self, bytes: u64) {
        self.outpkts.fetch_add(1, Relaxed);
        self.outbytes.fetch_add(bytes, Relaxed);
    }
    pub(crate) fn totals(&self) -> Totals {
        Totals {
            conns: self.conns.load(Relaxed),
            inpkts: self.inpkts.load(Relaxed),
            outpkts: self.outpkts.load(Relaxed),
            inbytes: self.inbytes.load(Relaxed),
            outbytes: self.outbytes.load(Relaxed),
        }
    }
}

/// Counters plus their estimator.
#[derive(Debug, Default)]
pub(crate) struct Stat {
    pub(crate) counters: Counters,
    est: Mutex<Est>,
}

#[derive(Debug, Default)]
struct Est {
    last: Totals,
    /// Rates scaled by 2^10 to keep precision across ticks (as IPVS does).
    avg: [u64; 5],
    primed: bool,
}

impl Stat {
    /// Current totals and rates.
    pub(crate) fn read(&self) -> (Totals, Rates) {
        let t = self.counters.totals();
        let e = self.est.lock();
        let r = |i: usize| (e.avg[i] + (1 << 9)) >> 10;
        (
            t,
            Rates {
                cps: r(0),
                inpps: r(1),
                outpps: r(2),
                inbps: r(3),
                outbps: r(4),
            },
        )
    }

    /// One estimator step over `elapsed` (normally [`TICK`]).
    pub(crate) fn tick(&self, elapsed: Duration) {
        let t = self.counters.totals();
        let mut e = self.est.lock();
        let ms = elapsed.as_millis().max(1) as u64;
        let cur = [t.conns, t.inpkts, t.outpkts, t.inbytes, t.outbytes];
        let last = [
            e.last.conns,
            e.last.inpkts,
            e.last.outpkts,
            e.last.inbytes,
            e.last.outbytes,
        ];
        for i in 0..5 {
            let delta = cur[i].saturating_sub(last[i]);
            // per-second rate << 10
            let rate = delta.saturating_mul(1000 << 10) / ms;
            if e.primed {
                let avg = e.avg[i] as i128;
                e.avg[i] = (avg + ((rate as i128 - avg) >> 2)).max(0) as u64;
            } else {
                e.avg[i] = rate;
            }
        }
        e.primed = true;
        e.last = t;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_converge_to_steady_input() {
        let s = Stat::default();
        for _ in 0..40 {
            for _ in 0..200 {
                s.counters.add_in(100);
            }
            s.tick(Duration::from_secs(2));
        }
        let (t, r) = s.read();
        assert_eq!(t.inpkts, 8000);
        assert_eq!(r.inpps, 100);
        assert_eq!(r.inbps, 10_000);
        assert_eq!(r.outpps, 0);
    }
}

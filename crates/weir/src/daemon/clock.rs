//! The daemon's clock: time since the daemon started, in milliseconds (the
//! flow table's timestamps) and nanoseconds (admission's rate limits).
//!
//! It is `CLOCK_MONOTONIC`, the clock `std::time::Instant` reads on Linux,
//! read with one call and turned into a count with integer arithmetic.
//! `Instant::elapsed` took about 85 instructions a read (callgrind), 36 of
//! them in its subtraction of two timespecs (a borrow, a checked result),
//! then a conversion through `u128`; this takes 28. A proxied connection
//! reads the clock 7 times (docs/BENCHMARKS.md, "The connect timer and the
//! clock").

use nix::time::{ClockId, clock_gettime};

/// `CLOCK_MONOTONIC` since the clock was made.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    /// `CLOCK_MONOTONIC` when made, in nanoseconds.
    epoch_ns: u64,
}

/// `CLOCK_MONOTONIC` in nanoseconds (584 years of uptime fit in a `u64`).
fn monotonic_ns() -> u64 {
    // Every Linux has CLOCK_MONOTONIC and the timespec is ours, so the
    // call cannot fail (std's `Instant::now` unwraps it the same way).
    let t = clock_gettime(ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC is always readable");
    // A monotonic clock is never negative.
    (t.tv_sec() as u64) * 1_000_000_000 + t.tv_nsec() as u64
}

impl Clock {
    pub(crate) fn start() -> Self {
        Clock {
            epoch_ns: monotonic_ns(),
        }
    }

    pub(crate) fn now_ns(self) -> u64 {
        monotonic_ns().saturating_sub(self.epoch_ns)
    }

    pub(crate) fn now_ms(self) -> u64 {
        self.now_ns() / 1_000_000
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// The clock is `Instant`'s: each reading falls between the elapsed
    /// times that `Instant` reads taken around the clock's start and
    /// around the reading allow, and readings never go back.
    #[test]
    fn reads_what_instant_reads() {
        let before_start = Instant::now();
        let c = Clock::start();
        let after_start = Instant::now();
        let mut last = 0;
        // Bounded: long enough to cross a few microseconds of readings.
        for _ in 0..10_000 {
            let lo = Instant::now().duration_since(after_start).as_nanos() as u64;
            let ns = c.now_ns();
            let ms = c.now_ms();
            // Both readings before the upper bound: a preemption between
            // them cannot put one past it.
            let hi = Instant::now().duration_since(before_start).as_nanos() as u64;
            assert!(lo <= ns && ns <= hi, "{lo} <= {ns} <= {hi}");
            assert!(ns >= last, "went back: {last} then {ns}");
            last = ns;
            assert!(
                ms >= lo / 1_000_000 && ms <= hi / 1_000_000,
                "{lo} ns <= {ms} ms <= {hi} ns"
            );
        }
    }
}

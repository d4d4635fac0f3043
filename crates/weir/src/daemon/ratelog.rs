//! Rate-limited logging for events a peer can trigger once per packet or
//! connection (a flood at fd exhaustion must not become a log flood): at
//! most one line per period and kind, and that line says how many were
//! left out since the previous one.
//!
//! [`RateLimited`] is the pure gate (the caller passes the time in, so it
//! is tested without sleeping); [`warn`] applies it with the process clock.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// One line per `period_ms` passes; the others are counted.
#[derive(Debug)]
pub(crate) struct RateLimited {
    period_ms: u64,
    /// The earliest time (ms) the next line may pass.
    next_ms: AtomicU64,
    /// Events left out since the last line that passed.
    suppressed: AtomicU64,
}

impl RateLimited {
    pub(crate) const fn new(period_ms: u64) -> Self {
        Self {
            period_ms,
            next_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// An event at `now_ms`: `Some(n)` = log it and say `n` earlier events
    /// were left out; `None` = leave it out (it is counted).
    pub(crate) fn check(&self, now_ms: u64) -> Option<u64> {
        let next = self.next_ms.load(Relaxed);
        if now_ms >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now_ms.saturating_add(self.period_ms),
                    Relaxed,
                    Relaxed,
                )
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Relaxed));
        }
        self.suppressed.fetch_add(1, Relaxed);
        None
    }
}

/// Milliseconds on a process-wide monotonic clock.
fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// Logs `msg` at WARN through `gate` (one line per period; the line that
/// passes carries `suppressed`, the number left out before it).
pub(crate) fn warn(gate: &RateLimited, msg: std::fmt::Arguments<'_>) {
    if let Some(suppressed) = gate.check(now_ms()) {
        tracing::warn!(suppressed, "{msg}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_period_and_the_next_line_counts_the_rest() {
        let g = RateLimited::new(1000);
        assert_eq!(g.check(5), Some(0), "the first event passes");
        for t in 6..305 {
            assert_eq!(g.check(t), None, "t = {t}");
        }
        assert_eq!(g.check(1004), None, "still inside the period");
        assert_eq!(g.check(1005), Some(300), "299 + 1 were left out");
        assert_eq!(g.check(1006), None);
        // A long quiet spell: the next event passes at once.
        assert_eq!(g.check(50_000), Some(1));
        assert_eq!(g.check(50_000), None);
    }

    #[test]
    fn a_clock_near_the_end_of_time_does_not_wrap() {
        let g = RateLimited::new(1000);
        assert_eq!(g.check(u64::MAX - 10), Some(0));
        assert_eq!(g.check(u64::MAX - 5), None);
    }
}

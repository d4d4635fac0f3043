//! Whether the data-path threads are alive and turning: what `weir run`
//! feeds the systemd watchdog on ([`crate::systemd::spawn_watchdog`]).
//!
//! Each proxy worker and packet worker has a [`Beat`]: a counter it bumps
//! as it turns (a proxy worker from a task on its runtime every
//! `HEARTBEAT`, a packet worker once per turn, at most every 100 ms) and a
//! flag its thread's guard sets when the thread ends, by a return or a
//! panic. A [`LivenessCheck`] reads them: a thread that ended, or whose
//! counter has not moved for [`STALL`], is not alive.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How long a data-path thread's counter may stand still before the
/// thread counts as wedged: ten of a proxy worker's heartbeats, fifty of a
/// packet worker's turns.
pub const STALL: Duration = Duration::from_secs(5);

/// One data-path thread's signs of life.
#[derive(Debug)]
pub(crate) struct Beat {
    /// The thread's name, for the log.
    name: String,
    beats: AtomicU64,
    ended: AtomicBool,
}

impl Beat {
    /// The thread turned once more.
    pub(crate) fn beat(&self) {
        self.beats.fetch_add(1, Relaxed);
    }
}

/// A guard for a thread to hold for its whole life: its drop (a return,
/// or a panic unwinding) marks the thread of `beat` ended.
pub(crate) fn guard(beat: &Arc<Beat>) -> EndGuard {
    EndGuard(beat.clone())
}

/// See [`guard`].
#[derive(Debug)]
pub(crate) struct EndGuard(Arc<Beat>);

impl Drop for EndGuard {
    fn drop(&mut self) {
        self.0.ended.store(true, Relaxed);
    }
}

/// Every data-path thread's [`Beat`], and whether the daemon is stopping
/// (its threads end then, as they should).
#[derive(Debug, Default)]
pub(crate) struct Liveness {
    beats: Mutex<Vec<Arc<Beat>>>,
    stopping: AtomicBool,
}

impl Liveness {
    /// A new thread to watch, named `name`.
    pub(crate) fn register(&self, name: String) -> Arc<Beat> {
        let b = Arc::new(Beat {
            name,
            beats: AtomicU64::new(0),
            ended: AtomicBool::new(false),
        });
        self.beats.lock().push(b.clone());
        b
    }

    /// The daemon is stopping its threads: none of them counts as dead
    /// from now on.
    pub(crate) fn stopping(&self) {
        self.stopping.store(true, Relaxed);
    }
}

/// Reads a [`Liveness`] over time (it keeps when each counter last moved).
#[derive(Debug)]
pub struct LivenessCheck {
    live: Arc<Liveness>,
    /// Per thread (in registration order): its counter when last read and
    /// when it was last seen to move.
    seen: Vec<(u64, Instant)>,
    stall: Duration,
}

impl LivenessCheck {
    pub(crate) fn new(live: Arc<Liveness>, stall: Duration) -> Self {
        Self {
            live,
            seen: Vec::new(),
            stall,
        }
    }

    /// `Ok` while every data-path thread runs and its counter moved within
    /// the stall time before `now` (or the daemon is stopping); else why
    /// not, naming the first thread that is not alive.
    pub fn check(&mut self, now: Instant) -> Result<(), String> {
        if self.live.stopping.load(Relaxed) {
            return Ok(());
        }
        let beats = self.live.beats.lock().clone();
        for (i, b) in beats.iter().enumerate() {
            let n = b.beats.load(Relaxed);
            if self.seen.len() <= i {
                // First seen now: it has the whole stall time from here.
                self.seen.push((n, now));
            }
            let (last, since) = &mut self.seen[i];
            if b.ended.load(Relaxed) {
                return Err(format!("data-path thread {} has ended", b.name));
            }
            if n != *last {
                *last = n;
                *since = now;
            } else if now.saturating_duration_since(*since) >= self.stall {
                return Err(format!(
                    "data-path thread {} has not turned for {}",
                    b.name,
                    humantime::format_duration(Duration::from_secs(
                        now.saturating_duration_since(*since).as_secs()
                    ))
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decision: alive while every counter moves; not alive once one
    /// thread ended (whatever its counter), or once one counter stood still
    /// for the stall time; alive whatever they do once the daemon stops.
    #[test]
    fn a_thread_that_ended_or_stands_still_is_not_alive() {
        let live = Arc::new(Liveness::default());
        let a = live.register("weir-worker-0".into());
        let b = live.register("weir-worker-1".into());
        let mut check = LivenessCheck::new(live.clone(), Duration::from_secs(5));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(check.check(at(0)), Ok(()));
        // Both turn: alive however long it goes.
        for s in 1..=20 {
            a.beat();
            b.beat();
            assert_eq!(check.check(at(s)), Ok(()), "at {s} s");
        }
        // b stands still: alive within the stall time, not from then on.
        a.beat();
        assert_eq!(check.check(at(24)), Ok(()));
        a.beat();
        let e = check.check(at(25)).unwrap_err();
        assert!(
            e.contains("weir-worker-1") && e.contains("not turned"),
            "{e}"
        );
        // It turns again: alive.
        b.beat();
        a.beat();
        assert_eq!(check.check(at(26)), Ok(()));
        // a's thread ends (its guard drops), even right after a beat.
        let end = guard(&a);
        a.beat();
        b.beat();
        drop(end);
        let e = check.check(at(27)).unwrap_err();
        assert!(e.contains("weir-worker-0") && e.contains("ended"), "{e}");
        // The daemon stops its threads: that is no reason to stop feeding.
        live.stopping();
        assert_eq!(check.check(at(100)), Ok(()), "stopping");
    }

    /// A thread that has not been seen turning since the check began counts
    /// from the check's first look, not from the daemon's start.
    #[test]
    fn the_stall_time_counts_from_the_first_look() {
        let live = Arc::new(Liveness::default());
        let _a = live.register("weir-worker-0".into());
        let mut check = LivenessCheck::new(live, Duration::from_secs(5));
        let t0 = Instant::now() + Duration::from_secs(3600);
        assert_eq!(check.check(t0), Ok(()));
        assert_eq!(check.check(t0 + Duration::from_secs(4)), Ok(()));
        assert!(check.check(t0 + Duration::from_secs(5)).is_err());
    }
}

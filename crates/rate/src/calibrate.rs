//! Start-up calibration of the cost per estimator, timed by the caller.

use std::time::Duration;

use crate::chunk::{CHUNK, Chunk, IN_USE, STARTED};

/// Measures what one estimator visit costs on this machine, without reading
/// a clock: the caller times each [`run`](Self::run) and passes the elapsed
/// time to [`record`](Self::record).
///
/// ```
/// use std::time::Instant;
/// let mut cal = weir_rate::Calibrator::new(2, 4096);
/// for _ in 0..12 {
///     let t0 = Instant::now();
///     let n = cal.run();
///     cal.record(t0.elapsed(), n);
/// }
/// let cfg = weir_rate::Config { estimator_cost_ns: cal.cost_ns(), ..Default::default() };
/// # let _ = cfg;
/// ```
///
/// The sample set is small and becomes cache-warm, while a real tick walks
/// memory last touched 2 s ago; [`cost_ns`](Self::cost_ns) therefore
/// multiplies the best sample by a cache factor (4, as the kernel does), and
/// [`Engine::record_tick`](crate::Engine::record_tick) refines it from real ticks.
#[derive(Debug)]
pub struct Calibrator {
    chunks: Vec<Chunk>,
    best_ns: Option<f64>,
    freed: Vec<u32>,
}

/// Factor between a warm calibration sample and a cold tick.
pub const CACHE_FACTOR: f64 = 4.0;

impl Calibrator {
    /// A calibration set of about `estimators` live estimators with
    /// `workers` shards each (at least one chunk).
    #[must_use]
    pub fn new(workers: usize, estimators: usize) -> Self {
        let n = estimators.div_ceil(CHUNK).max(1);
        let chunks = (0..n)
            .map(|k| {
                let c = Chunk::new((k * CHUNK) as u32, workers.max(1));
                for f in &c.flags {
                    f.store(IN_USE | STARTED, std::sync::atomic::Ordering::Relaxed);
                }
                c.live
                    .store(CHUNK as u32, std::sync::atomic::Ordering::Relaxed);
                c
            })
            .collect();
        Self {
            chunks,
            best_ns: None,
            freed: Vec::new(),
        }
    }

    /// Runs one period's estimation over the set; returns the number of
    /// estimators visited (to pass to [`record`](Self::record)).
    pub fn run(&mut self) -> usize {
        // The arithmetic does not depend on the counter values: no need to
        // change them between runs.
        for c in &self.chunks {
            let _ = c.estimate(false, &mut self.freed);
        }
        self.chunks.len() * CHUNK
    }

    /// Records how long a [`run`](Self::run) of `visited` estimators took.
    pub fn record(&mut self, elapsed: Duration, visited: usize) {
        if visited == 0 {
            return;
        }
        let per = elapsed.as_nanos() as f64 / visited as f64;
        self.best_ns = Some(self.best_ns.map_or(per, |b| b.min(per)));
    }

    /// Estimated cost of one cold estimator visit (ns): the best sample times
    /// [`CACHE_FACTOR`]; 100 ns before any sample.
    #[must_use]
    pub fn cost_ns(&self) -> f64 {
        self.best_ns.map_or(100.0, |b| (b * CACHE_FACTOR).max(0.01))
    }
}

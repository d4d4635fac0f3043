//! Accounting: the byte and connection counts of the daemon, each tenant,
//! service and backend, as per-worker shards of the rate estimators
//! ([`stats`]). A read is counted once in the connection's entry and once
//! here; nothing else keeps a count.

use std::sync::Arc;

use weir_flowtable::{Dir, Millis};

use super::stats::{self, Stat};
use super::{Conn, Shared};

/// The daemon's own counters and the estimator engine every tenant,
/// service and backend takes its counters from.
#[derive(Debug)]
pub(crate) struct Accounting {
    /// The daemon's totals.
    pub(crate) stat: Stat,
    pub(crate) rates: Arc<stats::RateEngine>,
    /// The thread that ticks `rates`, once started (a reload moves it).
    pub(crate) estimator: std::sync::OnceLock<stats::EstimatorThread>,
}

impl Accounting {
    pub(super) fn new(rates: Arc<stats::RateEngine>) -> Self {
        Self {
            stat: rates.stat(),
            rates,
            estimator: std::sync::OnceLock::new(),
        }
    }
}

impl Shared {
    /// Count `n` bytes of `conn` going `dir` (in: client → backend) in its
    /// entry and the estimators; `touch` = false when the caller's lookup
    /// counted them in the entry already.
    pub(crate) fn count(&self, conn: &Conn, dir: Dir, n: usize, touch: bool) {
        let n = n as u64;
        if touch {
            self.conns
                .table
                .touch_handle(conn.handle, Millis(self.now_ms()), dir, n);
        }
        let stats = [
            &self.accounting.stat,
            &conn.service.tenant.stat,
            &conn.service.stat,
            &conn.backend.stat,
        ];
        for s in stats {
            match dir {
                Dir::In => s.add_in(n),
                Dir::Out => s.add_out(n),
            }
        }
    }
}

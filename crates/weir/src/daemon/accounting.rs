//! Accounting: the byte and connection counts of the daemon, each tenant,
//! service and backend, as per-worker shards of the rate estimators
//! ([`stats`]). A read is counted once in the connection's entry and once
//! here; nothing else keeps a count.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

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
    /// Datagrams the UDP proxy dropped, per reason.
    pub(crate) udp_dropped: UdpDrops,
    /// UDP proxy sessions that carried a single datagram, ended to make
    /// room for a new one at a connection limit or out of descriptors
    /// (`udp::take_a_place`).
    pub(crate) udp_early_drops: std::sync::atomic::AtomicU64,
}

/// Why the UDP proxy dropped a datagram (a client's, or a backend's reply);
/// each one is counted under exactly one reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UdpDrop {
    /// Its session's socket could not take it at once (the send buffer
    /// towards the backend was full).
    BackendBusy,
    /// The send failed (e.g. an ICMP port unreachable from the backend
    /// reported on the session's socket).
    SendFailed,
    /// A backend's reply could not be sent to its client from the
    /// listening socket (any error but a full send buffer, which is
    /// waited for).
    ReplyFailed,
}

impl UdpDrop {
    const ALL: [Self; 3] = [Self::BackendBusy, Self::SendFailed, Self::ReplyFailed];

    /// The name in the stats' `udp_dropped` and the metrics' `reason` label.
    fn key(self) -> &'static str {
        match self {
            Self::BackendBusy => "backend_busy",
            Self::SendFailed => "send_failed",
            Self::ReplyFailed => "reply_failed",
        }
    }
}

/// The UDP proxy's drops per reason: one atomic each, no lock, nothing
/// allocated per drop.
#[derive(Debug, Default)]
pub(crate) struct UdpDrops([AtomicU64; UdpDrop::ALL.len()]);

impl UdpDrops {
    pub(crate) fn add(&self, why: UdpDrop) {
        self.0[why as usize].fetch_add(1, Relaxed);
    }

    /// The reasons seen so far (zero counts left out), by name.
    pub(crate) fn snapshot(&self) -> BTreeMap<String, u64> {
        UdpDrop::ALL
            .iter()
            .filter_map(|&r| {
                let n = self.0[r as usize].load(Relaxed);
                (n > 0).then(|| (r.key().to_owned(), n))
            })
            .collect()
    }
}

impl Accounting {
    pub(super) fn new(rates: Arc<stats::RateEngine>) -> Self {
        Self {
            stat: rates.stat(),
            rates,
            estimator: std::sync::OnceLock::new(),
            udp_dropped: UdpDrops::default(),
            udp_early_drops: std::sync::atomic::AtomicU64::new(0),
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

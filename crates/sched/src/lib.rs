//! # weir-sched — I/O-free schedulers and persistence helpers
//!
//! This crate chooses the backend ("real server") for a new connection of a
//! virtual service, with the semantics of the Linux IPVS schedulers of the same
//! names (`net/netfilter/ipvs/ip_vs_*.c`):
//!
//! | kind  | choice                                                                  |
//! |-------|-------------------------------------------------------------------------|
//! | `rr`  | next available backend after the previous pick                          |
//! | `wrr` | IPVS gcd / max-weight stepping: passes with falling current weight `cw` |
//! | `lc`  | least `active * 256 + inactive`                                         |
//! | `wlc` | least `(active * 256 + inactive) / weight` (the default, as ipvsadm)    |
//! | `sed` | least `(active + 1) / weight`                                           |
//! | `nq`  | first idle backend (no active connection), else `sed`                   |
//! | `sh`  | source hash into 256 buckets, each backend owning `weight` buckets      |
//! | `mh`  | Maglev: prime lookup table (default 4093), weight-scaled turns          |
//! | `p2c` | two weight-proportional random candidates, the less loaded one wins     |
//! | `lblc`| per destination address: the backend it used last, unless overloaded  |
//! | `lblcr`| per destination address: the least loaded of a set grown under load   |
//! | `dh`  | destination hash into 256 buckets dealt round-robin to the backends    |
//! | `fo`  | the available backend with the highest weight                          |
//! | `ovf` | the highest weight whose active connections do not exceed its weight   |
//!
//! ## Contracts
//!
//! * **I/O-free.** No clock, no sockets, no global randomness. `p2c` draws from
//!   a [`RandomSource`] the caller passes to [`Scheduler::pick`]; `sh` and `mh`
//!   hash with SipHash-1-3 keyed by the [`HashSeed`] in [`SchedConfig`] (clients
//!   choose their addresses, so the hash is keyed; load balancers that must agree
//!   on `mh` placement share the seed).
//! * **Immutable backend set.** A [`Scheduler`] is built from a `&[BackendInfo]`
//!   (address, weight, health). Any change of the set, of a weight or of health
//!   means building a new one with [`Scheduler::rebuild`], which carries over what
//!   IPVS carries over (rr position, wrr current weight, mh last non-zero
//!   weights). The daemon publishes the new scheduler (e.g. `ArcSwap` or an
//!   `RwLock<Arc<_>>`); picks on the old one stay valid while it lives.
//! * **Concurrent picks.** [`Scheduler::pick`] takes `&self`; the only mutable
//!   state (rr / wrr cursor) is one atomic word updated with a CAS loop, so a
//!   pick is one atomic transition of the IPVS state machine and every worker
//!   thread may share one scheduler. `Scheduler` is `Send + Sync`.
//! * **Loads live in the daemon.** Active / inactive connection counts are read
//!   through [`LoadView`] (a slice of [`Load`] or a closure over the daemon's
//!   atomics), only for backends that can be picked.
//! * **Overload.** A [`Load`] also says whether the backend can take a new
//!   connection now ([`Load::overloaded`]: the daemon's backend at its
//!   connection limit, as IPVS's `OVERLOAD` flag marks a destination at its
//!   upper threshold). Every scheduler skips an overloaded backend inside its
//!   own rule, as IPVS's do: `rr` goes on to the next, `wrr` keeps its
//!   passes over the others, `lc` / `wlc` / `sed` / `nq` / `fo` / `ovf`
//!   choose among the others, `p2c` prefers the other candidate, `lblc` /
//!   `lblcr` move the destination. Only `sh` / `mh` without fallback and
//!   `dh`, whose client or destination belongs to one backend, return
//!   `None` for it. So no scheduler returns an overloaded backend, and
//!   only those three (and `ovf`, by its own rule, and `sh` / `mh` with
//!   fallback when their probe misses, as IPVS's can) return `None` while
//!   another backend can take the connection.
//! * **Availability.** A backend is *available* when it is `up` and has weight
//!   `> 0`. Only available backends are ever returned. Weight 0 quiesces a
//!   backend: no new connections, while existing ones continue in the daemon.
//!   `sh` and `mh` build their tables from weights regardless of health, so a
//!   backend going down or up does not move other clients; a client whose slot
//!   belongs to an unavailable backend gets `None`, or with
//!   [`SchedConfig::fallback`] the next available slot (as IPVS
//!   `sh-fallback` / `mh-fallback`).
//! * **Destination and time.** `lblc`, `lblcr` and `dh` key on the
//!   connection's destination address and `lblc` / `lblcr` keep a table whose
//!   entries expire: [`Scheduler::pick_for`] takes both in a [`Request`], the
//!   time as a [`Duration`] since an epoch of the caller's choosing (no clock
//!   is read). [`Scheduler::pick`] is `pick_for` with an unspecified
//!   destination at time zero.
//! * **Index results.** `pick` returns an index into the slice the scheduler
//!   was built from, or `None` when no backend can take the connection.
//!
//! ## Example
//!
//! ```
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use weir_sched::*;
//!
//! let backends = [
//!     BackendInfo::new("10.0.0.1:80".parse::<std::net::SocketAddr>().unwrap(), 3),
//!     BackendInfo::new("10.0.0.2:80".parse::<std::net::SocketAddr>().unwrap(), 1),
//! ];
//! let kind: SchedulerKind = "wlc".parse()?;
//! let sched = Scheduler::new(SchedConfig::new(kind, HashSeed::new(1, 2)), &backends)?;
//!
//! // The daemon's counters, read through a closure.
//! let active = [AtomicU64::new(4), AtomicU64::new(1)];
//! let load = |i: usize| Load::new(active[i].load(Ordering::Relaxed), 0);
//! let client = ClientAddr("192.0.2.7:40000".parse().unwrap());
//! let mut rng = SplitMix64::new(7); // one per worker, seeded by the daemon
//! // 4 * 256 / 3 ≈ 341 > 1 * 256 / 1 = 256: backend 1 is less loaded per weight.
//! assert_eq!(sched.pick(client, &load, &mut rng), Some(1));
//!
//! // Quiesce backend 1: rebuild; picks avoid it from then on.
//! let mut changed = backends;
//! changed[1].weight = 0;
//! let sched = sched.rebuild(&changed)?;
//! assert_eq!(sched.pick(client, &load, &mut rng), Some(0));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Persistence (`ipvsadm -p / -M`) is stored by the daemon as affinity
//! templates in its flow table; this crate provides the client grouping
//! ([`AffinityMask`]) and the template validity rule ([`template_usable`]).
//! `docs/sched.md` explains how the daemon combines them.

mod hash;
mod least;
mod locality;
mod persist;
mod rr;

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use persist::{AffinityMask, MaskError, template_usable};

/// Largest accepted weight (ipvsadm's limit). Keeps every overhead product
/// and table build small and exact.
pub const MAX_WEIGHT: u32 = 65_535;

/// Address of a backend (real server). Also its identity for `mh` placement
/// and for carrying state across [`Scheduler::rebuild`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendAddr(pub SocketAddr);

/// Address of the client of a new connection (the source for `sh` / `mh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClientAddr(pub SocketAddr);

/// Destination address of a new connection, as IPVS's `lblc`, `lblcr` and
/// `dh` see it (the packet's destination IP). For a proxy this is the local
/// address the client connected to: the service's address, or for a service
/// listening on a wildcard address, whichever local address was dialled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DestAddr(pub IpAddr);

/// Everything about one new connection that a scheduler may look at besides
/// the backends' loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Source of the connection (`sh`, `mh`).
    pub client: ClientAddr,
    /// Destination of the connection (`lblc`, `lblcr`, `dh`).
    pub dest: DestAddr,
    /// Current time since an epoch the caller keeps fixed for the life of
    /// the scheduler and its rebuilds (`lblc`, `lblcr` entry expiry).
    pub now: Duration,
}

impl Request {
    /// A request from `client` to `dest` at `now`.
    pub fn new(client: impl Into<ClientAddr>, dest: IpAddr, now: Duration) -> Self {
        Self {
            client: client.into(),
            dest: DestAddr(dest),
            now,
        }
    }
}

impl From<SocketAddr> for BackendAddr {
    fn from(a: SocketAddr) -> Self {
        Self(a)
    }
}

impl From<SocketAddr> for ClientAddr {
    fn from(a: SocketAddr) -> Self {
        Self(a)
    }
}

/// What a scheduler knows about one backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendInfo {
    /// Backend address (identity).
    pub addr: BackendAddr,
    /// Weight, `0..=MAX_WEIGHT`. 0 quiesces the backend.
    pub weight: u32,
    /// Health: a backend that is not up is never picked.
    pub up: bool,
}

impl BackendInfo {
    /// An up backend with the given weight.
    pub fn new(addr: impl Into<BackendAddr>, weight: u32) -> Self {
        Self {
            addr: addr.into(),
            weight,
            up: true,
        }
    }

    /// Whether new connections may be sent to it: up and weight > 0.
    pub fn available(&self) -> bool {
        self.up && self.weight > 0
    }
}

/// Connection counts of one backend, as IPVS keeps them, and whether it
/// can take a new connection now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Established connections.
    pub active: u64,
    /// Connections in other states (SYN_RECV, FIN_WAIT, TIME_WAIT...; UDP).
    pub inactive: u64,
    /// The backend cannot take a new connection now (the daemon's reasons:
    /// at its connection limit, or taken out by a check since the
    /// scheduler was built), as IPVS's `IP_VS_DEST_F_OVERLOAD` (a
    /// destination at its upper threshold). Every scheduler skips it the
    /// way IPVS's does: the ones that choose among backends choose among
    /// the others, and `sh` / `mh` without fallback and `dh`, whose
    /// client or destination belongs to it, return `None`.
    pub overloaded: bool,
}

impl Load {
    /// A load with the given counts, not overloaded.
    pub fn new(active: u64, inactive: u64) -> Self {
        Self {
            active,
            inactive,
            overloaded: false,
        }
    }

    /// The same counts, overloaded or not.
    pub fn with_overload(self, overloaded: bool) -> Self {
        Self { overloaded, ..self }
    }

    /// IPVS `ip_vs_dest_conn_overhead`: `active * 256 + inactive`
    /// (saturating), used by `lc`, `wlc` and `p2c`.
    pub fn conn_overhead(&self) -> u64 {
        self.active
            .saturating_mul(256)
            .saturating_add(self.inactive)
    }
}

/// Read access to the daemon's per-backend connection counts.
///
/// `idx` is an index into the slice the scheduler was built from. Counts may
/// change concurrently; schedulers only need a recent value.
pub trait LoadView {
    /// Current load of backend `idx`.
    fn load(&self, idx: usize) -> Load;
}

/// A slice indexed like the backends; a missing entry reads as idle.
impl LoadView for [Load] {
    fn load(&self, idx: usize) -> Load {
        self.get(idx).copied().unwrap_or_default()
    }
}

/// Any `Fn(usize) -> Load`, e.g. a closure reading the daemon's atomics.
impl<F: Fn(usize) -> Load> LoadView for F {
    fn load(&self, idx: usize) -> Load {
        self(idx)
    }
}

/// Source of randomness for `p2c`, passed in by the caller (typically one
/// seeded generator per worker thread).
pub trait RandomSource {
    /// 64 uniformly distributed random bits.
    fn next_u64(&mut self) -> u64;
}

impl<R: RandomSource + ?Sized> RandomSource for &mut R {
    fn next_u64(&mut self) -> u64 {
        (**self).next_u64()
    }
}

/// SplitMix64: a tiny, fast, seedable generator (not cryptographic), enough
/// to break ties in `p2c`. Tests seed it with a constant and replay exactly.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
}

impl RandomSource for SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// SipHash key for `sh` / `mh`. Random per deployment in production; fixed in
/// tests. Load balancers that must map clients identically share it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HashSeed {
    /// First key word.
    pub k0: u64,
    /// Second key word.
    pub k1: u64,
}

impl HashSeed {
    /// A seed from two key words.
    pub fn new(k0: u64, k1: u64) -> Self {
        Self { k0, k1 }
    }

    /// A seed derived from `text` (e.g. a configured secret, or a service's
    /// name): the same text gives the same seed in every process, on every
    /// build, so balancers configured alike map clients alike. SipHash-1-3
    /// under two fixed keys (a specified function, unlike `std`'s
    /// `DefaultHasher`).
    pub fn from_text(text: &str) -> Self {
        use std::hash::Hasher;
        let word = |k0, k1| {
            let mut h = siphasher::sip::SipHasher13::new_with_keys(k0, k1);
            h.write(text.as_bytes());
            h.finish()
        };
        Self {
            k0: word(0x7765_6972_2d73_6565, 1),
            k1: word(0x7765_6972_2d73_6565, 2),
        }
    }
}

/// The scheduling algorithm of a virtual service.
///
/// Parses from and displays as ipvsadm's names; serde uses the same names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedulerKind {
    /// Round robin.
    Rr,
    /// Weighted round robin.
    Wrr,
    /// Least connections.
    Lc,
    /// Weighted least connections (default).
    #[default]
    Wlc,
    /// Shortest expected delay.
    Sed,
    /// Never queue.
    Nq,
    /// Source hashing.
    Sh,
    /// Maglev hashing.
    Mh,
    /// Power of two choices.
    P2c,
    /// Locality-based least connections.
    Lblc,
    /// Locality-based least connections with replication.
    Lblcr,
    /// Destination hashing.
    Dh,
    /// Weighted fail-over.
    Fo,
    /// Overflow connections.
    Ovf,
}

impl SchedulerKind {
    /// Every kind, in the order of the documentation.
    pub const ALL: [SchedulerKind; 14] = [
        Self::Rr,
        Self::Wrr,
        Self::Lc,
        Self::Wlc,
        Self::Sed,
        Self::Nq,
        Self::Sh,
        Self::Mh,
        Self::P2c,
        Self::Lblc,
        Self::Lblcr,
        Self::Dh,
        Self::Fo,
        Self::Ovf,
    ];

    /// The ipvsadm-style name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Rr => "rr",
            Self::Wrr => "wrr",
            Self::Lc => "lc",
            Self::Wlc => "wlc",
            Self::Sed => "sed",
            Self::Nq => "nq",
            Self::Sh => "sh",
            Self::Mh => "mh",
            Self::P2c => "p2c",
            Self::Lblc => "lblc",
            Self::Lblcr => "lblcr",
            Self::Dh => "dh",
            Self::Fo => "fo",
            Self::Ovf => "ovf",
        }
    }
}

impl fmt::Display for SchedulerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown scheduler name; the message lists the valid ones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown scheduler {name:?}; valid schedulers: rr, wrr, lc, wlc, sed, nq, sh, mh, p2c, lblc, lblcr, dh, fo, ovf"
)]
pub struct ParseKindError {
    /// The name that was given.
    pub name: String,
}

impl FromStr for SchedulerKind {
    type Err = ParseKindError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| ParseKindError { name: s.to_owned() })
    }
}

/// Size of the `mh` lookup table: one of IPVS's primes. Serialises as the
/// plain number; deserialising rejects other numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct MhTableSize(u32);

impl MhTableSize {
    /// The sizes IPVS offers (`CONFIG_IP_VS_MH_TAB_INDEX` 8..=17).
    pub const PRIMES: [u32; 10] = [
        251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071,
    ];
    /// IPVS's default, 4093.
    pub const DEFAULT: Self = Self(4093);

    /// Accepts one of [`Self::PRIMES`].
    pub fn new(size: u32) -> Result<Self, MhTableSizeError> {
        if Self::PRIMES.contains(&size) {
            Ok(Self(size))
        } else {
            Err(MhTableSizeError { size })
        }
    }

    /// The table size.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl TryFrom<u32> for MhTableSize {
    type Error = MhTableSizeError;

    fn try_from(size: u32) -> Result<Self, Self::Error> {
        Self::new(size)
    }
}

impl From<MhTableSize> for u32 {
    fn from(size: MhTableSize) -> u32 {
        size.0
    }
}

impl Default for MhTableSize {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// A table size that is not one of IPVS's primes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "mh table size {size} is not allowed; valid sizes: 251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071"
)]
pub struct MhTableSizeError {
    /// The size that was given.
    pub size: u32,
}

impl FromStr for MhTableSize {
    type Err = MhTableSizeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let size = s
            .trim()
            .parse::<u32>()
            .map_err(|_| MhTableSizeError { size: 0 })?;
        Self::new(size)
    }
}

/// Everything that shapes a scheduler except its backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedConfig {
    /// The algorithm.
    pub kind: SchedulerKind,
    /// Key of the `sh` / `mh` hashes (unused by the others).
    pub hash_seed: HashSeed,
    /// `sh` / `mh`: when the client's slot belongs to an unavailable backend,
    /// look further instead of returning `None` (IPVS `sh-fallback`,
    /// `mh-fallback`).
    pub fallback: bool,
    /// `sh` / `mh`: hash the client port too (IPVS `sh-port`, `mh-port`).
    pub hash_port: bool,
    /// `mh` lookup table size.
    pub mh_table_size: MhTableSize,
    /// `lblc` / `lblcr`: an entry unused this long is forgotten, and an
    /// `lblcr` set unchanged this long sheds its most loaded member (IPVS
    /// sysctls `lblc_expiration` / `lblcr_expiration`, default 24 h).
    pub locality_expiration: Duration,
}

impl SchedConfig {
    /// `kind` with the given seed, no fallback, no port hashing, default table.
    pub fn new(kind: SchedulerKind, hash_seed: HashSeed) -> Self {
        Self {
            kind,
            hash_seed,
            fallback: false,
            hash_port: false,
            mh_table_size: MhTableSize::DEFAULT,
            locality_expiration: DEFAULT_LOCALITY_EXPIRATION,
        }
    }

    /// Whether the scheduler's answer is final: when it returns `None`, or a
    /// backend the caller cannot use (it already failed this connection),
    /// the connection is refused rather than sent to some other backend.
    /// True for `sh` / `mh` without fallback (a client belongs to one
    /// backend, and gets `None` when that one is unavailable or
    /// overloaded), `dh` (a destination belongs to one backend) and `ovf`
    /// (`None` means every backend is full, as in IPVS). The others return
    /// `None` only when no backend can take the connection (`sh` / `mh`
    /// with fallback: or their probe misses every one that can).
    pub fn pinned(&self) -> bool {
        match self.kind {
            SchedulerKind::Sh | SchedulerKind::Mh => !self.fallback,
            SchedulerKind::Dh | SchedulerKind::Ovf => true,
            _ => false,
        }
    }
}

/// IPVS's default `lblc_expiration` / `lblcr_expiration`: one day.
pub const DEFAULT_LOCALITY_EXPIRATION: Duration = Duration::from_secs(24 * 60 * 60);

/// Why a scheduler could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// A weight above [`MAX_WEIGHT`].
    #[error("backend {index}: weight {weight} exceeds the maximum {MAX_WEIGHT}")]
    WeightTooLarge {
        /// Index of the backend.
        index: usize,
        /// Its weight.
        weight: u32,
    },
    /// More backends than the scheduler can hold (`mh`: the table size).
    #[error("{count} backends exceed the maximum of {max} for this scheduler")]
    TooManyBackends {
        /// Backends given.
        count: usize,
        /// Largest accepted count.
        max: usize,
    },
}

/// A built scheduler for one virtual service. See the crate docs.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedConfig,
    backends: Box<[BackendInfo]>,
    /// Latest non-zero weight of each backend (IPVS `last_weight`), which
    /// `mh` builds its table from so that quiescing does not move clients.
    last_weights: Box<[u32]>,
    algo: Algo,
}

#[derive(Debug)]
enum Algo {
    Rr(rr::Rr),
    Wrr(rr::Wrr),
    Lc,
    Wlc,
    Sed,
    Nq,
    Sh(hash::Sh),
    Mh(hash::Mh),
    P2c(least::P2c),
    Lblc(Arc<locality::Locality>),
    Lblcr(Arc<locality::Locality>),
    Dh(hash::Dh),
    Fo,
    Ovf,
}

/// Backends are indexed with `u32` inside tables.
const MAX_BACKENDS: usize = (u32::MAX - 1) as usize;

impl Scheduler {
    /// Builds a scheduler with no history.
    pub fn new(config: SchedConfig, backends: &[BackendInfo]) -> Result<Self, BuildError> {
        let last_weights = backends.iter().map(|b| b.weight).collect();
        Self::build(config, backends, last_weights, None)
    }

    /// Builds a scheduler for a changed backend set, same config, carrying over
    /// the rr position, the wrr current weight and the last non-zero weight of
    /// each backend (matched by address) as IPVS does on a destination change.
    pub fn rebuild(&self, backends: &[BackendInfo]) -> Result<Self, BuildError> {
        let old: HashMap<BackendAddr, usize> = self
            .backends
            .iter()
            .enumerate()
            .map(|(i, b)| (b.addr, i))
            .collect();
        let last_weights = backends
            .iter()
            .map(|b| match (b.weight, old.get(&b.addr)) {
                (0, Some(&i)) => self.last_weights[i],
                (w, _) => w,
            })
            .collect();
        Self::build(self.config, backends, last_weights, Some(self))
    }

    fn build(
        config: SchedConfig,
        backends: &[BackendInfo],
        last_weights: Box<[u32]>,
        prev: Option<&Scheduler>,
    ) -> Result<Self, BuildError> {
        if backends.len() > MAX_BACKENDS {
            return Err(BuildError::TooManyBackends {
                count: backends.len(),
                max: MAX_BACKENDS,
            });
        }
        if let Some((index, b)) = backends
            .iter()
            .enumerate()
            .find(|(_, b)| b.weight > MAX_WEIGHT)
        {
            return Err(BuildError::WeightTooLarge {
                index,
                weight: b.weight,
            });
        }
        let algo = match config.kind {
            SchedulerKind::Rr => {
                let cursor = prev.and_then(|old| match &old.algo {
                    Algo::Rr(r) => r.last_pick().and_then(|i| map_index(old, i, backends)),
                    _ => None,
                });
                Algo::Rr(rr::Rr::new(cursor))
            }
            SchedulerKind::Wrr => {
                let old_cw = prev.and_then(|old| match &old.algo {
                    Algo::Wrr(w) => Some(w.current_weight()),
                    _ => None,
                });
                Algo::Wrr(rr::Wrr::new(backends, old_cw))
            }
            SchedulerKind::Lc => Algo::Lc,
            SchedulerKind::Wlc => Algo::Wlc,
            SchedulerKind::Sed => Algo::Sed,
            SchedulerKind::Nq => Algo::Nq,
            SchedulerKind::Sh => Algo::Sh(hash::Sh::new(backends)),
            SchedulerKind::Mh => Algo::Mh(hash::Mh::new(&config, backends, &last_weights)?),
            SchedulerKind::P2c => Algo::P2c(least::P2c::new(backends)),
            // The destination table outlives rebuilds: its entries name
            // backends by address, checked against the new set at each pick.
            SchedulerKind::Lblc => Algo::Lblc(match prev.map(|old| &old.algo) {
                Some(Algo::Lblc(t)) => t.clone(),
                _ => Arc::default(),
            }),
            SchedulerKind::Lblcr => Algo::Lblcr(match prev.map(|old| &old.algo) {
                Some(Algo::Lblcr(t)) => t.clone(),
                _ => Arc::default(),
            }),
            SchedulerKind::Dh => Algo::Dh(hash::Dh::new(backends)),
            SchedulerKind::Fo => Algo::Fo,
            SchedulerKind::Ovf => Algo::Ovf,
        };
        Ok(Self {
            config,
            backends: backends.into(),
            last_weights,
            algo,
        })
    }

    /// Chooses a backend for a new connection from `client`: [`Self::pick_for`]
    /// with an unspecified destination address (of the client's family) at
    /// time zero. Fine for every kind but `lblc`, `lblcr` and `dh`, which
    /// then see one destination and no passing time.
    pub fn pick<L, R>(&self, client: ClientAddr, load: &L, rng: &mut R) -> Option<usize>
    where
        L: LoadView + ?Sized,
        R: RandomSource + ?Sized,
    {
        let dest = match client.0 {
            SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        self.pick_for(Request::new(client, dest, Duration::ZERO), load, rng)
    }

    /// Chooses a backend for the new connection `req`.
    ///
    /// Returns an index into the backends this scheduler was built from, or
    /// `None` when no backend may take it. Every kind reads
    /// [`Load::overloaded`] of the backends it considers; the counts are
    /// read only by `lc`, `wlc`, `sed`, `nq`, `p2c`, `lblc`, `lblcr` and
    /// `ovf`; `rng` only by `p2c`;
    /// `req.dest` only by `lblc`, `lblcr` and `dh`; `req.now` only by `lblc`
    /// and `lblcr`, which also update their table (under a short lock).
    /// Never panics.
    pub fn pick_for<L, R>(&self, req: Request, load: &L, rng: &mut R) -> Option<usize>
    where
        L: LoadView + ?Sized,
        R: RandomSource + ?Sized,
    {
        let b = &self.backends;
        let client = req.client;
        match &self.algo {
            Algo::Rr(s) => s.pick(b, load),
            Algo::Wrr(s) => s.pick(b, load),
            Algo::Lc => least::lc(b, load),
            Algo::Wlc => least::wlc(b, load),
            Algo::Sed => least::sed(b, load),
            Algo::Nq => least::nq(b, load),
            Algo::Sh(s) => s.pick(b, load, client, &self.config),
            Algo::Mh(s) => s.pick(b, load, client, &self.config),
            Algo::P2c(s) => s.pick(b, load, rng),
            Algo::Lblc(t) => t.pick_lblc(b, load, req, self.config.locality_expiration),
            Algo::Lblcr(t) => t.pick_lblcr(b, load, req, self.config.locality_expiration),
            Algo::Dh(s) => s.pick(b, load, req.dest, &self.config),
            Algo::Fo => least::fo(b, load),
            Algo::Ovf => least::ovf(b, load),
        }
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &SchedConfig {
        &self.config
    }

    /// The backends it was built from, in index order.
    pub fn backends(&self) -> &[BackendInfo] {
        &self.backends
    }
}

/// Whether backend `i` may get a new connection now: available and not
/// overloaded (its load is read only when it is available).
fn can_take<L: LoadView + ?Sized>(b: &BackendInfo, i: usize, load: &L) -> bool {
    b.available() && !load.load(i).overloaded
}

/// Index in `new` of the backend at `old_idx` in `old`, by address.
fn map_index(old: &Scheduler, old_idx: usize, new: &[BackendInfo]) -> Option<usize> {
    let addr = old.backends.get(old_idx)?.addr;
    new.iter().position(|b| b.addr == addr)
}

/// Greatest common divisor (Euclid).
fn gcd(mut a: u32, mut b: u32) -> u32 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
pub(crate) mod test_util {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    pub(crate) fn backend(i: u8, weight: u32) -> BackendInfo {
        BackendInfo::new(
            SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, i)), 80),
            weight,
        )
    }

    pub(crate) fn client(n: u32) -> ClientAddr {
        let ip = Ipv4Addr::from(0xC0A8_0000u32.wrapping_add(n.wrapping_mul(7919)));
        ClientAddr(SocketAddr::new(IpAddr::V4(ip), 40000))
    }

    pub(crate) fn sched(kind: SchedulerKind, backends: &[BackendInfo]) -> Scheduler {
        Scheduler::new(SchedConfig::new(kind, HashSeed::new(1, 2)), backends)
            .expect("valid test backends")
    }

    /// `n` picks with an idle load view; counts per backend (None counted last).
    pub(crate) fn histogram(s: &Scheduler, n: u32) -> Vec<u32> {
        let mut counts = vec![0u32; s.backends().len() + 1];
        let idle: &[Load] = &[];
        let mut rng = SplitMix64::new(42);
        for i in 0..n {
            let slot = s
                .pick(client(i), idle, &mut rng)
                .unwrap_or(s.backends().len());
            counts[slot] += 1;
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::test_util::*;
    use super::*;

    #[test]
    fn kind_names_round_trip() {
        for k in SchedulerKind::ALL {
            assert_eq!(k.to_string().parse::<SchedulerKind>(), Ok(k));
            let json = serde_json::to_string(&k).expect("serialise");
            assert_eq!(json, format!("\"{k}\""));
            assert_eq!(
                serde_json::from_str::<SchedulerKind>(&json).expect("deserialise"),
                k
            );
        }
        assert_eq!(SchedulerKind::default(), SchedulerKind::Wlc);
        assert_eq!("WLC".parse::<SchedulerKind>(), Ok(SchedulerKind::Wlc));
    }

    #[test]
    fn unknown_kind_lists_valid_names() {
        let err = "fastest"
            .parse::<SchedulerKind>()
            .expect_err("not a scheduler");
        let msg = err.to_string();
        assert!(msg.contains("\"fastest\""), "{msg}");
        for k in SchedulerKind::ALL {
            assert!(msg.contains(k.as_str()), "{msg} misses {k}");
        }
    }

    #[test]
    fn mh_table_size_accepts_only_ipvs_primes() {
        assert_eq!(MhTableSize::default().get(), 4093);
        assert_eq!(
            "65521".parse::<MhTableSize>().map(MhTableSize::get),
            Ok(65521)
        );
        assert!(MhTableSize::new(4096).is_err());
        assert_eq!(
            serde_json::to_string(&MhTableSize::DEFAULT).expect("serialise"),
            "4093"
        );
        assert_eq!(
            serde_json::from_str::<MhTableSize>("251")
                .map(MhTableSize::get)
                .ok(),
            Some(251)
        );
        assert!(serde_json::from_str::<MhTableSize>("250").is_err());
        let msg = "x"
            .parse::<MhTableSize>()
            .expect_err("not a number")
            .to_string();
        assert!(msg.contains("4093"), "{msg}");
    }

    #[test]
    fn build_rejects_bad_input() {
        let err = Scheduler::new(
            SchedConfig::new(SchedulerKind::Wlc, HashSeed::default()),
            &[backend(1, 1), backend(2, MAX_WEIGHT + 1)],
        )
        .expect_err("weight too large");
        assert_eq!(
            err,
            BuildError::WeightTooLarge {
                index: 1,
                weight: MAX_WEIGHT + 1
            }
        );
        let mut cfg = SchedConfig::new(SchedulerKind::Mh, HashSeed::default());
        cfg.mh_table_size = MhTableSize::new(251).expect("prime");
        let many: Vec<_> = (0..252u32)
            .map(|i| BackendInfo::new(SocketAddr::from(([10, 1, (i >> 8) as u8, i as u8], 80)), 1))
            .collect();
        assert_eq!(
            Scheduler::new(cfg, &many).expect_err("too many"),
            BuildError::TooManyBackends {
                count: 252,
                max: 251
            }
        );
    }

    /// Weight 0 and down backends are never picked, by any scheduler, and an
    /// empty or fully unavailable set yields `None`.
    #[test]
    fn unavailable_never_picked_by_any_scheduler() {
        let mut down = backend(3, 5);
        down.up = false;
        let set = [backend(1, 0), backend(2, 2), down, backend(4, 1)];
        for kind in SchedulerKind::ALL {
            let mut s =
                Scheduler::new(SchedConfig::new(kind, HashSeed::new(9, 9)), &set).expect("valid");
            if matches!(kind, SchedulerKind::Sh | SchedulerKind::Mh) {
                s = Scheduler::new(
                    SchedConfig {
                        fallback: true,
                        ..*s.config()
                    },
                    &set,
                )
                .expect("valid");
            }
            let h = histogram(&s, 2000);
            assert_eq!(h[0], 0, "{kind}: weight 0 picked");
            assert_eq!(h[2], 0, "{kind}: down backend picked");
            if kind == SchedulerKind::Dh {
                // `dh` keys on the destination, which `histogram` keeps
                // fixed, and has no fallback: destinations whose bucket
                // holds an unavailable backend get None (IPVS), the others
                // any available backend.
                let mut seen = [0u32; 5];
                for n in 0..2000u32 {
                    let dest = IpAddr::V4(Ipv4Addr::from(0xC633_6400 + n));
                    let req = Request::new(test_util::client(n), dest, Duration::ZERO);
                    let i = s.pick_for(req, &[] as &[Load], &mut SplitMix64::new(0));
                    seen[i.unwrap_or(4)] += 1;
                }
                assert_eq!((seen[0], seen[2]), (0, 0), "{kind}: {seen:?}");
                assert!(seen[1] > 0 && seen[3] > 0 && seen[4] > 0, "{seen:?}");
            } else {
                assert_eq!(h[4], 0, "{kind}: returned None with available backends");
                // With an idle load view the load-based ones (and `fo`, `ovf`,
                // and `lblc`/`lblcr` for one destination) always take one
                // backend; the others use both.
                let one_backend = matches!(
                    kind,
                    SchedulerKind::Lc
                        | SchedulerKind::Wlc
                        | SchedulerKind::Sed
                        | SchedulerKind::Nq
                        | SchedulerKind::Lblc
                        | SchedulerKind::Lblcr
                        | SchedulerKind::Fo
                        | SchedulerKind::Ovf
                );
                assert_eq!(h[1] + h[3], 2000, "{kind}: {h:?}");
                assert!(one_backend || h[3] > 0, "{kind}: {h:?}");
            }

            let none = [backend(1, 0), down];
            let s = Scheduler::new(*s.config(), &none).expect("valid");
            assert_eq!(
                histogram(&s, 50)[2],
                50,
                "{kind}: picked an unavailable backend"
            );
            let s = Scheduler::new(*s.config(), &[]).expect("valid");
            assert_eq!(histogram(&s, 5)[0], 5, "{kind}: picked from an empty set");
        }
    }

    /// An overloaded backend (IPVS `OVERLOAD`) is never returned; the
    /// schedulers that choose among backends choose among the others, and
    /// only `sh` / `mh` without fallback and `dh` refuse a client or
    /// destination that belongs to it.
    #[test]
    fn overloaded_never_picked_by_any_scheduler() {
        let set = [backend(1, 1), backend(2, 2), backend(3, 1)];
        let idle = [Load::new(0, 0); 3];
        let mut full = idle;
        full[1] = full[1].with_overload(true);
        for kind in SchedulerKind::ALL {
            for fallback in [false, true] {
                let cfg = SchedConfig {
                    fallback,
                    ..SchedConfig::new(kind, HashSeed::new(9, 9))
                };
                if fallback && !matches!(kind, SchedulerKind::Sh | SchedulerKind::Mh) {
                    continue;
                }
                let s = Scheduler::new(cfg, &set).expect("valid");
                let t = Scheduler::new(cfg, &set).expect("valid");
                let mut rng = SplitMix64::new(5);
                let (mut seen, mut refused) = ([0u32; 3], 0u32);
                for n in 0..600u32 {
                    // Vary the destination too (`dh`, `lblc`, `lblcr`).
                    let dest = IpAddr::V4(Ipv4Addr::from(0xC633_6400 + n % 64));
                    let req = Request::new(client(n), dest, Duration::ZERO);
                    let free = t.pick_for(req, &idle[..], &mut rng);
                    match s.pick_for(req, &full[..], &mut rng) {
                        Some(i) => {
                            assert_ne!(i, 1, "{kind} (fallback {fallback}) picked it");
                            seen[i] += 1;
                        }
                        None => {
                            // Only where the request belongs to it.
                            assert!(cfg.pinned(), "{kind}: None with two backends free");
                            assert_eq!(free, Some(1), "{kind}: None for {n}");
                            refused += 1;
                        }
                    }
                }
                assert_eq!(seen[1], 0);
                if cfg.pinned() && kind != SchedulerKind::Ovf {
                    assert!(refused > 0, "{kind}: nobody belonged to backend 1");
                } else {
                    assert_eq!(refused, 0, "{kind}");
                }
                // Every backend overloaded: nobody gets one.
                let all = [Load::default().with_overload(true); 3];
                let req = Request::new(client(1), IpAddr::V4(Ipv4Addr::LOCALHOST), Duration::ZERO);
                assert_eq!(s.pick_for(req, &all[..], &mut rng), None, "{kind}");
            }
        }
    }

    /// `wlc` with the least loaded backend overloaded takes the least
    /// loaded of the rest, not the first in list order.
    #[test]
    fn wlc_takes_the_least_loaded_of_the_rest() {
        let set = [backend(1, 1), backend(2, 1), backend(3, 1)];
        let s = sched(SchedulerKind::Wlc, &set);
        let loads = [
            Load::new(5, 0),
            Load::new(1, 0).with_overload(true),
            Load::new(3, 0),
        ];
        assert_eq!(
            s.pick(client(0), &loads[..], &mut SplitMix64::new(0)),
            Some(2)
        );
        // The same for the other least-load rules.
        for kind in [SchedulerKind::Lc, SchedulerKind::Sed, SchedulerKind::Nq] {
            let s = sched(kind, &set);
            assert_eq!(
                s.pick(client(0), &loads[..], &mut SplitMix64::new(0)),
                Some(2),
                "{kind}"
            );
        }
    }

    /// `fo` and `ovf` pass over an overloaded backend of the highest weight
    /// to the next weight, as IPVS's loops skip an `OVERLOAD` destination.
    #[test]
    fn fo_and_ovf_pass_over_an_overloaded_top_weight() {
        let set = [backend(1, 1), backend(2, 5), backend(3, 3)];
        let loads = [
            Load::default(),
            Load::default().with_overload(true),
            Load::default(),
        ];
        for kind in [SchedulerKind::Fo, SchedulerKind::Ovf] {
            let s = sched(kind, &set);
            assert_eq!(
                s.pick(client(0), &loads[..], &mut SplitMix64::new(0)),
                Some(2),
                "{kind}"
            );
        }
    }

    #[test]
    fn seed_from_text_is_stable_and_distinct() {
        let a = HashSeed::from_text("default/web");
        assert_eq!(a, HashSeed::from_text("default/web"));
        assert_ne!(a, HashSeed::from_text("default/web2"));
        assert_ne!(a.k0, a.k1);
    }

    #[test]
    fn scheduler_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Scheduler>();
    }

    #[test]
    fn splitmix_replays_from_seed() {
        let a: Vec<u64> = {
            let mut r = SplitMix64::new(7);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let mut r = SplitMix64::new(7);
        assert!(a.iter().all(|&x| x == r.next_u64()));
        assert_ne!(a[0], a[1]);
    }
}

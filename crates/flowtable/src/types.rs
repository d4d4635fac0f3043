//! Public value types: keys, ids, states, snapshots, configuration and errors.

use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::str::FromStr;

/// A tenant (think network namespace). Tenants are created with
/// [`FlowTable::add_tenant`](crate::FlowTable::add_tenant).
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct TenantId(pub u32);

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Transport protocol of a flow.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub enum Proto {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Proto::Tcp => "TCP",
            Proto::Udp => "UDP",
        })
    }
}

/// The full lookup key: tenant, protocol, client address and virtual
/// (service) address.
///
/// IPv6 `flowinfo` and `scope_id` are **not** part of the table's key: the
/// table stores 16-byte addresses and ports only, and snapshots return them
/// as 0. Two keys that differ only there are the same flow for the table.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct FlowKey {
    /// Owning tenant (compared on every lookup, also in the shared table).
    pub tenant: TenantId,
    /// Transport protocol.
    pub proto: Proto,
    /// Client address and port.
    pub client: SocketAddr,
    /// Virtual (service) address and port.
    pub virt: SocketAddr,
}

/// The second key of a packet-mode flow: what a reply from its backend
/// carries, once the caller has mapped the reply's source address and port
/// to the backend (and tenant) from its service snapshot. The table never
/// stores it: it is computed from the entry's own fields (tenant, protocol,
/// backend, and client or NAT slot), so it cannot get out of step with the
/// entry. See [`FlowTable::insert_reply`](crate::FlowTable::insert_reply).
///
/// The caller must map a reply's source to exactly one [`BackendId`]: two
/// backends with the same address and port in one tenant (two services
/// sharing a real server) need the same id, or their replies cannot be told
/// apart (in nat mode they are the same packets).
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct ReplyKey {
    /// The flow's tenant.
    pub tenant: TenantId,
    /// Transport protocol.
    pub proto: Proto,
    /// The backend the reply comes from.
    pub backend: BackendId,
    /// The reply's destination.
    pub dst: ReplyDst,
}

/// Where a reply of a packet-mode flow is addressed.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub enum ReplyDst {
    /// nat: the client's address and port (the flow key's `client`).
    Client(SocketAddr),
    /// fnat: weir's local address and port, as the entry's NAT slot names
    /// them (local address index << 16 | local port).
    Nat(NonZeroU32),
}

/// How a packet-mode flow's replies come back, for
/// [`FlowTable::insert_reply`](crate::FlowTable::insert_reply).
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub enum ReplyMode {
    /// nat: replies are addressed to the client
    /// ([`ReplyDst::Client`] = the key's `client`).
    Nat,
    /// fnat: replies are addressed to weir's local address and port, which
    /// this NAT slot names (stored as the entry's NAT slot, fixed for its
    /// life; [`ReplyDst::Nat`]).
    FullNat(NonZeroU32),
}

/// One key of a mixed batched lookup
/// ([`Reader::lookup_probes`](crate::Reader::lookup_probes)).
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub enum Probe {
    /// A packet from the client side: the flow key.
    Flow(FlowKey),
    /// A packet from a backend: the reply key.
    Reply(ReplyKey),
}

/// What a lookup by reply key (or a mixed batch) found: enough to rewrite
/// a reply without another read of the entry.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct Found {
    /// The entry, for later calls without hashing.
    pub handle: Handle,
    /// Its backend.
    pub backend: BackendId,
    /// Its flow key: the client and the virtual address a reply is
    /// rewritten back to.
    pub key: FlowKey,
}

/// Connection state, named like `ipvsadm -Lnc`.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub enum FlowState {
    /// TCP SYN seen from the client.
    SynSent,
    /// TCP SYN-ACK seen.
    SynRecv,
    /// TCP established.
    Established,
    /// TCP FIN seen.
    FinWait,
    /// TCP CLOSE_WAIT.
    CloseWait,
    /// TCP LAST_ACK.
    LastAck,
    /// TCP TIME_WAIT.
    TimeWait,
    /// TCP closed (RST or final ACK).
    Close,
    /// Any UDP flow.
    Udp,
    /// A persistence template (shown as `NONE` like IPVS).
    Persist,
}

impl FlowState {
    /// All states, in their internal code order.
    pub const ALL: [FlowState; 10] = [
        FlowState::SynSent,
        FlowState::SynRecv,
        FlowState::Established,
        FlowState::FinWait,
        FlowState::CloseWait,
        FlowState::LastAck,
        FlowState::TimeWait,
        FlowState::Close,
        FlowState::Udp,
        FlowState::Persist,
    ];

    pub(crate) fn code(self) -> u32 {
        self as u32
    }

    pub(crate) fn from_code(code: u32) -> FlowState {
        // Codes are written only by this crate from `code()`; an impossible
        // value maps to Close (the shortest-lived state) rather than panicking.
        Self::ALL
            .get(code as usize)
            .copied()
            .unwrap_or(FlowState::Close)
    }

    /// The name `ipvsadm -Lnc` prints.
    pub fn as_str(self) -> &'static str {
        match self {
            FlowState::SynSent => "SYN_SENT",
            FlowState::SynRecv => "SYN_RECV",
            FlowState::Established => "ESTABLISHED",
            FlowState::FinWait => "FIN_WAIT",
            FlowState::CloseWait => "CLOSE_WAIT",
            FlowState::LastAck => "LAST_ACK",
            FlowState::TimeWait => "TIME_WAIT",
            FlowState::Close => "CLOSE",
            FlowState::Udp => "UDP",
            FlowState::Persist => "NONE",
        }
    }
}

impl fmt::Display for FlowState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error from parsing a [`FlowState`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown flow state {0:?} (expected e.g. ESTABLISHED, SYN_RECV, UDP, NONE)")]
pub struct ParseStateError(pub String);

impl FromStr for FlowState {
    type Err = ParseStateError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        for st in Self::ALL {
            if t.eq_ignore_ascii_case(st.as_str()) {
                return Ok(st);
            }
        }
        // Also accept the Rust-ish spellings and "persist".
        let alt = t.replace(['_', '-'], "");
        for st in Self::ALL {
            if alt.eq_ignore_ascii_case(&format!("{st:?}")) {
                return Ok(st);
            }
        }
        Err(ParseStateError(s.chars().take(64).collect()))
    }
}

/// Monotonic milliseconds since the daemon's epoch. Time is always passed in.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct Millis(pub u64);

impl Millis {
    /// `secs` seconds.
    pub const fn from_secs(secs: u64) -> Millis {
        Millis(secs.saturating_mul(1000))
    }
}

/// Per-entry id, never 0, below 2^56: the entry's node index (low 28 bits)
/// and that node's use count (above), so a cookie names its node
/// ([`FlowTable::handle_of`](crate::FlowTable::handle_of)) and is unique
/// until one node is reused 2^28 - 1 times.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct Cookie(pub u64);

impl fmt::Display for Cookie {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// Error from parsing a [`Cookie`] or a [`Cursor`](crate::Cursor).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {what}: {detail}")]
pub struct ParseError {
    pub(crate) what: &'static str,
    pub(crate) detail: &'static str,
}

impl FromStr for Cookie {
    type Err = ParseError;
    /// Parses the hexadecimal form printed by `Display`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |detail| ParseError {
            what: "cookie",
            detail,
        };
        if s.is_empty() || s.len() > 16 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(err("expected 1 to 16 hex digits"));
        }
        match u64::from_str_radix(s, 16) {
            Ok(0) => Err(err("cookie 0 is never issued")),
            Ok(v) => Ok(Cookie(v)),
            Err(_) => Err(err("expected 1 to 16 hex digits")),
        }
    }
}

/// Virtual service id (assigned by the daemon).
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct ServiceId(pub u32);

/// Backend (real server) id (assigned by the daemon).
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct BackendId(pub u32);

/// What a new entry starts with. `'p` is the borrow of the timeout
/// [`Profile`](crate::Profile) it names ([`ProfileRef`]): the profile is
/// held for as long as the init exists, so through the insert.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct FlowInit<'p> {
    /// Service the flow belongs to.
    pub service: ServiceId,
    /// Backend chosen by the scheduler.
    pub backend: BackendId,
    /// Initial state.
    pub state: FlowState,
    /// Opaque token naming the flow's owner (e.g. the proxy task that holds
    /// its sockets), returned in every [`FlowSnapshot`] so that expiry, kills
    /// and tenant removal can tell the owner to close. 0 = none.
    pub owner: u32,
    /// Timeout profile: per-state overrides of the tenant's timeouts, e.g.
    /// one service's own UDP timeout ([`ProfileRef::NONE`]: the tenant's
    /// timeouts as they are).
    pub profile: ProfileRef<'p>,
}

/// The timeout profile a new entry names ([`FlowInit::profile`]): a
/// borrow of a [`Profile`](crate::Profile) from
/// [`FlowTable::timeout_profile`](crate::FlowTable::timeout_profile)
/// ([`Profile::for_init`](crate::Profile::for_init)), or
/// [`NONE`](Self::NONE). An entry may name a profile only if it is
/// inserted while the profile is held: a number no handle holds may be
/// given to other overrides once no entry names it, and the walk that
/// frees numbers relies on it (see
/// [`timeout_profile`](crate::FlowTable::timeout_profile)). That was the
/// caller's word, with a bare number; now a number comes only with a
/// borrow of its handle, so an init naming a profile cannot outlive the
/// handle. At run time it is the number and which tenant's profiles it is
/// a number of (no count, no atomics): an insert for another tenant, or
/// for a tenant added again under the id of the one it was taken from,
/// names no profile (profile 0) instead of whatever that tenant gave the
/// same number to.
///
/// An insert under a profile whose handle is gone does not compile:
///
/// ```compile_fail,E0505
/// # use weir_flowtable::*;
/// # fn f(t: &FlowTable, key: FlowKey, init: FlowInit<'static>, o: &TimeoutOverrides) {
/// let p = t.timeout_profile(TenantId(1), o).unwrap();
/// let init = FlowInit { profile: p.for_init(), ..init };
/// drop(p);
/// t.insert(key, init, Millis(0));
/// # }
/// ```
///
/// nor does a number made up without one:
///
/// ```compile_fail,E0451
/// # use weir_flowtable::*;
/// let r = ProfileRef { number: 3, held: std::marker::PhantomData };
/// ```
///
/// while holding the handle through the insert does:
///
/// ```
/// # use weir_flowtable::*;
/// # fn f(t: &FlowTable, key: FlowKey, init: FlowInit<'static>, o: &TimeoutOverrides) {
/// let p = t.timeout_profile(TenantId(1), o).unwrap();
/// let init = FlowInit { profile: p.for_init(), ..init };
/// t.insert(key, init, Millis(0));
/// drop(p);
/// # }
/// ```
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct ProfileRef<'p> {
    number: u16,
    /// The address of the tenant's profiles it is a number of (0 with
    /// number 0): while the handle is borrowed they are alive, so no other
    /// tenant's are at that address.
    set: usize,
    held: std::marker::PhantomData<&'p ()>,
}

impl ProfileRef<'static> {
    /// Profile 0: the tenant's timeouts as they are (nothing to hold).
    pub const NONE: Self = ProfileRef {
        number: 0,
        set: 0,
        held: std::marker::PhantomData,
    };
}

impl ProfileRef<'_> {
    /// Of a profile held for `'p` (only [`Profile::for_init`](crate::Profile::for_init)),
    /// a number of the tenant's profiles at address `set`.
    pub(crate) fn held(number: u16, set: usize) -> Self {
        ProfileRef {
            number,
            set,
            held: std::marker::PhantomData,
        }
    }

    /// What it names among the tenant's profiles at address `set`: itself
    /// if they are the ones it was taken from, else no profile (0).
    pub(crate) fn for_set(self, set: usize) -> Self {
        if self.set == set {
            self
        } else {
            ProfileRef {
                number: 0,
                set: 0,
                held: std::marker::PhantomData,
            }
        }
    }

    /// The profile's number.
    pub fn number(self) -> u16 {
        self.number
    }
}

/// Names one entry without hashing: its node and its cookie. Returned by
/// [`FlowTable::insert_handle`](crate::FlowTable::insert_handle); every
/// operation through a handle first checks that the node still holds the
/// entry with that cookie, so a stale handle (entry removed, node reused)
/// finds nothing instead of another flow.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct Handle {
    pub(crate) idx: u32,
    /// The entry's cookie.
    pub cookie: Cookie,
}

/// What [`FlowTable::touch_hit`](crate::FlowTable::touch_hit) found.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct Hit {
    /// The entry, for later calls without hashing.
    pub handle: Handle,
    /// Its backend.
    pub backend: BackendId,
    /// Its owner token ([`FlowInit::owner`]).
    pub owner: u32,
}

/// A consistent-enough copy of one entry. The state and the lock-free
/// counters are read with relaxed loads, so a snapshot taken while a `touch`
/// runs may show its bytes but not yet its packet (each counter is exact on
/// its own). `created` has a resolution of one second.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct FlowSnapshot {
    /// The key.
    pub key: FlowKey,
    /// The entry's cookie.
    pub cookie: Cookie,
    /// Service.
    pub service: ServiceId,
    /// Backend.
    pub backend: BackendId,
    /// Current state.
    pub state: FlowState,
    /// Insert time.
    pub created: Millis,
    /// Last `touch`/`set_state`/insert time.
    pub last_active: Millis,
    /// `last_active + timeout(tenant, state)` at the time of the snapshot.
    pub expires_at: Millis,
    /// Bytes client -> backend.
    pub bytes_in: u64,
    /// Bytes backend -> client.
    pub bytes_out: u64,
    /// Packets (or reads) client -> backend.
    pub packets_in: u64,
    /// Packets (or reads) backend -> client.
    pub packets_out: u64,
    /// The owner token given at insert ([`FlowInit::owner`]).
    pub owner: u32,
    /// Packet mode's NAT mapping slot (0 = none): the fnat local address
    /// index << 16 | local port.
    pub nat: u32,
    /// Whether the entry is also indexed by its reply key (nat: `nat` is 0
    /// and replies go to the client; fnat: replies go to `nat`).
    pub reply: bool,
    /// A persistence template's hold count: the connections it placed that
    /// are still alive ([`FlowTable::hold`](crate::FlowTable::hold)); 0 for
    /// every other entry. (`bytes_out` is always 0 on a template.)
    pub held: u32,
}

/// What [`FlowTable::evict_due_first`](crate::FlowTable::evict_due_first)'s
/// pick sees of an entry: enough to tell a flow that never got going (an
/// embryonic TCP flow, a UDP flow with no reply or a single datagram)
/// from one that did.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct Candidate {
    /// Its state.
    pub state: FlowState,
    /// Its owner's token ([`FlowInit::owner`]).
    pub owner: u32,
    /// Whether it is also indexed by a reply key (packet mode's nat and
    /// fnat: weir sees its replies).
    pub reply: bool,
    /// Packets client -> backend so far.
    pub packets_in: u64,
    /// Packets backend -> client so far.
    pub packets_out: u64,
}

/// Why [`FlowTable::evict_due_first`](crate::FlowTable::evict_due_first)
/// took nothing.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum EvictMiss {
    /// Nothing the pick accepts within the budget, or no such tenant:
    /// looking again at once is unlikely to find one.
    NotFound,
    /// The tenant's wheel was held (another thread's eviction, an `expire`
    /// call), nothing filed was found while an `expire` call held the
    /// maintenance lock (it files the newest entries), or the entry found
    /// moved on first: another look may find one.
    Busy,
}

/// Direction of traffic for [`FlowTable::touch`](crate::FlowTable::touch).
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub enum Dir {
    /// Client -> backend.
    In,
    /// Backend -> client.
    Out,
}

/// The longest idle timeout the table applies (31 days): a longer one is
/// treated as this. An entry's activity time is kept in 32 bits of
/// milliseconds and read back exactly up to ~37 days of idleness (as
/// conntrack keeps its timeouts in 32-bit jiffies), so every live entry
/// expires well inside that range.
pub const MAX_TIMEOUT_MS: u64 = 31 * 86_400_000;

/// Per-state idle timeouts, in milliseconds (each capped at
/// [`MAX_TIMEOUT_MS`] when applied). `Default` is IPVS's defaults.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct Timeouts {
    /// SYN_SENT (IPVS default 120 s).
    pub syn_sent: Millis,
    /// SYN_RECV (60 s).
    pub syn_recv: Millis,
    /// ESTABLISHED (900 s).
    pub established: Millis,
    /// FIN_WAIT (120 s).
    pub fin_wait: Millis,
    /// CLOSE_WAIT (60 s).
    pub close_wait: Millis,
    /// LAST_ACK (30 s).
    pub last_ack: Millis,
    /// TIME_WAIT (120 s).
    pub time_wait: Millis,
    /// CLOSE (10 s).
    pub close: Millis,
    /// UDP (300 s).
    pub udp: Millis,
    /// Persistence templates (300 s).
    pub persist: Millis,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            syn_sent: Millis::from_secs(120),
            syn_recv: Millis::from_secs(60),
            established: Millis::from_secs(900),
            fin_wait: Millis::from_secs(120),
            close_wait: Millis::from_secs(60),
            last_ack: Millis::from_secs(30),
            time_wait: Millis::from_secs(120),
            close: Millis::from_secs(10),
            udp: Millis::from_secs(300),
            persist: Millis::from_secs(300),
        }
    }
}

impl Timeouts {
    /// The timeout for `state`.
    pub fn get(&self, state: FlowState) -> Millis {
        match state {
            FlowState::SynSent => self.syn_sent,
            FlowState::SynRecv => self.syn_recv,
            FlowState::Established => self.established,
            FlowState::FinWait => self.fin_wait,
            FlowState::CloseWait => self.close_wait,
            FlowState::LastAck => self.last_ack,
            FlowState::TimeWait => self.time_wait,
            FlowState::Close => self.close,
            FlowState::Udp => self.udp,
            FlowState::Persist => self.persist,
        }
    }

    pub(crate) fn to_array(self) -> [u64; 10] {
        FlowState::ALL.map(|s| self.get(s).0)
    }

    pub(crate) fn from_array(a: [u64; 10]) -> Timeouts {
        Timeouts {
            syn_sent: Millis(a[0]),
            syn_recv: Millis(a[1]),
            established: Millis(a[2]),
            fin_wait: Millis(a[3]),
            close_wait: Millis(a[4]),
            last_ack: Millis(a[5]),
            time_wait: Millis(a[6]),
            close: Millis(a[7]),
            udp: Millis(a[8]),
            persist: Millis(a[9]),
        }
    }
}

/// Per-state overrides of a tenant's [`Timeouts`] (`None` = the tenant's).
/// A service with its own connect, UDP or persistence timeout gets one, as
/// a profile its entries name (IPVS keeps a timeout per connection; a
/// profile costs entries no memory).
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Default)]
pub struct TimeoutOverrides([Option<Millis>; 10]);

impl TimeoutOverrides {
    /// No overrides.
    pub const NONE: TimeoutOverrides = TimeoutOverrides([None; 10]);

    /// These overrides, with `state`'s timeout set to `t`.
    #[must_use]
    pub fn with(mut self, state: FlowState, t: Millis) -> TimeoutOverrides {
        self.0[state.code() as usize] = Some(t);
        self
    }

    /// The override for `state`, if any.
    pub fn get(&self, state: FlowState) -> Option<Millis> {
        self.0[state.code() as usize]
    }

    /// True if nothing is overridden.
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(Option::is_none)
    }

    pub(crate) fn apply(&self, base: [u64; 10]) -> [u64; 10] {
        let mut out = base;
        for (o, v) in out.iter_mut().zip(self.0) {
            if let Some(m) = v {
                *o = m.0;
            }
        }
        out
    }
}

/// Most timeout profiles a tenant can have (profile 0, the tenant's own
/// timeouts, included).
pub const MAX_PROFILES: usize = 4096;

/// Table-wide configuration.
#[derive(Clone, Debug)]
pub struct TableConfig {
    /// Entries the shared table is sized for at first (`1..=2^28`, clamped;
    /// at a load of 0.75: 8.25 entries per 11-way bucket line). It grows
    /// (and shrinks back to this) online as its load asks.
    pub shared_buckets: usize,
    /// Entries the shared table may grow to and hold (its cap: inserts past
    /// it are refused with [`InsertError::ChainFull`]); 0 = no cap below
    /// the table's 2^28. A cap below `shared_buckets` keeps the table at its
    /// starting size and caps it there.
    pub max_shared_entries: usize,
    /// Longest chain an insert may extend; past it inserts are refused with
    /// [`InsertError::ChainFull`] and counted (hash-flood defence, like
    /// conntrack). Clamped to `1..=1024`.
    pub max_chain: usize,
    /// Bytes that all tenants' own tables (their bucket arrays)
    /// may use together; a tenant whose own table would not fit shares the
    /// global table and [`Placement::Shared`] says why.
    pub memory_budget: usize,
    /// Hash seed; `None` draws a random one (use `Some` in tests).
    pub seed: Option<u64>,
}

impl Default for TableConfig {
    fn default() -> Self {
        TableConfig {
            shared_buckets: 1 << 17,
            max_shared_entries: 0,
            max_chain: 64,
            memory_budget: 256 << 20,
            seed: None,
        }
    }
}

/// Per-tenant configuration.
#[derive(Clone, Debug, Default)]
pub struct TenantConfig {
    /// 0 = share the global table (the default); else the bucket count of
    /// the number of entries the tenant's own table is sized for at first, a
    /// power of two `<= 2^24`; it grows online up to [`MAX_OWN_BUCKETS`]
    /// entries (while the memory budget allows) and shrinks back to this.
    pub own_buckets: usize,
    /// Entries the own table may grow to and hold (inserts past it are
    /// refused with [`InsertError::ChainFull`]); 0 = [`MAX_OWN_BUCKETS`]. A
    /// cap below `own_buckets` keeps the table at its starting size and
    /// caps it there.
    pub max_entries: usize,
    /// Idle timeouts for this tenant's entries.
    pub timeouts: Timeouts,
}

/// Largest own-table starting size and growth cap, in entries (like
/// `tcp_child_ehash_entries`).
pub const MAX_OWN_BUCKETS: usize = 1 << 24;

/// Why a tenant that asked for its own table shares the global one.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum FallbackReason {
    /// The tenant asked to share (own_buckets = 0).
    Requested,
    /// The own table would push own tables past `TableConfig::memory_budget`.
    OverBudget {
        /// Bytes the own table needs.
        needed: usize,
        /// Bytes of the budget still free.
        available: usize,
    },
    /// The allocator refused the bucket array.
    AllocFailed {
        /// Bytes the own table needs.
        needed: usize,
    },
}

impl fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FallbackReason::Requested => f.write_str("shared by request"),
            FallbackReason::OverBudget { needed, available } => write!(
                f,
                "own table needs {needed} B but only {available} B of the memory budget are free"
            ),
            FallbackReason::AllocFailed { needed } => {
                write!(f, "allocating {needed} B for the own table failed")
            }
        }
    }
}

/// Where a tenant's entries live.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum Placement {
    /// The tenant owns a table of `buckets` buckets.
    Own {
        /// Bucket count.
        buckets: usize,
    },
    /// The tenant shares the global table.
    Shared {
        /// Buckets asked for (0 = asked to share).
        requested: usize,
        /// Why it shares.
        reason: FallbackReason,
    },
}

/// Errors of tenant administration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantError {
    /// `add_tenant` for an id that exists.
    #[error("tenant {0} already exists")]
    Exists(TenantId),
    /// The tenant does not exist.
    #[error("no tenant {0}")]
    NoTenant(TenantId),
    /// `own_buckets` is not 0 or a power of two `<= 2^24`.
    #[error("own_buckets must be 0 or a power of two <= 2^24, got {0}")]
    BadSize(usize),
    /// The tenant has [`MAX_PROFILES`] distinct timeout profiles in use
    /// (held, or named by live entries).
    #[error("tenant {0} has {MAX_PROFILES} distinct timeout profiles in use")]
    TooManyProfiles(TenantId),
}

/// Errors of [`FlowTable::insert`](crate::FlowTable::insert).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InsertError {
    /// The key is present; its cookie. (Also while that entry's own insert
    /// is still adding its reply key, which may yet refuse it.)
    #[error("flow exists (cookie {0})")]
    Exists(Cookie),
    /// [`FlowTable::insert_reply`](crate::FlowTable::insert_reply): another
    /// entry has the same reply key (same tenant, protocol, backend and
    /// client or NAT slot); its cookie. Nothing was inserted.
    #[error("another flow has the same reply key (cookie {0})")]
    ReplyExists(Cookie),
    /// The key's chain (or its reply key's) is at `max_chain` (possible
    /// hash flood), the key's table holds its cap of entries
    /// ([`TenantConfig::max_entries`], [`TableConfig::max_shared_entries`]),
    /// or the `FlowTable` already holds its maximum of 2^28 - 1 (~268 M)
    /// entries.
    /// Counted in [`TableStats::refused_inserts`].
    #[error("hash chain full: insert refused")]
    ChainFull,
    /// The key's tenant does not exist (or is being removed).
    #[error("no such tenant")]
    NoTenant,
}

/// Selects entries for [`FlowTable::dump`](crate::FlowTable::dump); `Default` selects all.
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct DumpFilter {
    /// Only this tenant (walks only its own table if it has one).
    pub tenant: Option<TenantId>,
    /// Only this service.
    pub service: Option<ServiceId>,
    /// Only this backend.
    pub backend: Option<BackendId>,
    /// Only this state.
    pub state: Option<FlowState>,
}

impl DumpFilter {
    /// Whether a snapshot passes the filter.
    pub fn matches(&self, s: &FlowSnapshot) -> bool {
        self.tenant.is_none_or(|t| t == s.key.tenant)
            && self.service.is_none_or(|v| v == s.service)
            && self.backend.is_none_or(|v| v == s.backend)
            && self.state.is_none_or(|v| v == s.state)
    }
}

/// Introspection for one tenant; cheap (at most 2^20 bucket headers read).
#[derive(Clone, Debug, PartialEq)]
pub struct TableStats {
    /// The tenant's entries.
    pub entries: u64,
    /// Entries of the table the tenant lives in (= `entries` for an own table).
    pub table_entries: u64,
    /// Reply index entries of that table (entries inserted with a reply
    /// key): they take index ways, count towards chains and the load, but
    /// are not entries of their own.
    pub reply_entries: u64,
    /// Buckets (64-byte lines of [`BUCKET_WAYS`](crate::BUCKET_WAYS) = 11
    /// ways) of that table's newest index.
    pub buckets: usize,
    /// Index entries per way:
    /// `(table_entries + reply_entries) / (buckets x BUCKET_WAYS)`.
    pub load_factor: f64,
    /// `chain_histogram[n]` = buckets of that table holding `n` entries in
    /// their chain (head line and overflow lines; trailing zero classes
    /// trimmed). Tables of more than 2^20 buckets are sampled evenly and
    /// scaled up.
    pub chain_histogram: Vec<u64>,
    /// Longest current chain of that table.
    pub max_chain: usize,
    /// Inserts of this tenant refused because the chain was full.
    pub refused_inserts: u64,
    /// Own or shared table.
    pub placement: Placement,
}

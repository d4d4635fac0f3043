//! The seam between the daemon and its operators.
//!
//! [`Control`] is everything the admin API (and through it the CLI) can ask
//! of a running daemon. The daemon implements it over its live state; the
//! admin API only translates HTTP to these calls and these types to JSON.
//! The report types are the API's JSON bodies, so their field names are the
//! API's contract (`weir list --json`, `weir conns --json`, ...).

use serde::{Deserialize, Serialize};

use crate::config::{BackendSpec, Config, ServiceSpec, TenantSpec};

/// Why a control request failed; maps onto an HTTP status in the admin API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlError {
    /// What kind of failure.
    pub kind: ErrorKind,
    /// What went wrong and what to do, for a human.
    pub message: String,
}

/// Classification of a [`ControlError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The tenant, service, backend or connection does not exist (404).
    NotFound,
    /// It exists already, or conflicts with something that does (409).
    Conflict,
    /// The request is well-formed but its values are wrong (400/422).
    Invalid,
    /// The daemon cannot do it now, e.g. a listen address is in use (503).
    Unavailable,
    /// The caller may not do it: the check it gave with the write (a
    /// tenant token's fence, [`Check`]) refused it (403).
    Forbidden,
    /// The caller's token no longer names the tenant it was checked for
    /// (changed, or the tenant deleted and maybe created again): the
    /// check it gave with a kill or a listing refused it (401).
    Unauthorized,
}

impl ControlError {
    /// Shorthand constructor.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for ControlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ControlError {}

/// Result of a control request.
pub type ControlResult<T> = Result<T, ControlError>;

/// A caller's own check of a write (the admin API's fence of a tenant
/// token: where a service may listen and its backends point), which the
/// daemon runs with its edits held (the lock every change of tenants,
/// services and backends takes, and a reload holds from its check of the
/// file to the end of its apply), just before it makes the change: what
/// the check reads of the tenants and services cannot change between the
/// check and the change. Its error refuses the write and is returned as
/// it is. It must not call the [`Control`] writes (they take the same
/// lock); its reads it may. (The kills and the connection listing run
/// theirs without the lock, once they have found the tenant they act on:
/// [`Control::connections_checked`].)
pub type Check<'a> = &'a mut (dyn FnMut() -> ControlResult<()> + 'a);

/// A write made only if the caller's [`Check`] passes, with the daemon's
/// edits held ([`Control::write_checked`]): the additions and the service
/// edit that the admin API fences for a tenant token, and a tenant's
/// creation, whose token it checks is no other role's.
#[derive(Debug)]
pub enum CheckedWrite<'a> {
    /// [`Control::add_tenant`].
    AddTenant(TenantSpec),
    /// [`Control::add_service`].
    AddService(ServiceSpec),
    /// [`Control::edit_service`] of service `name` of `tenant`.
    EditService {
        tenant: &'a str,
        name: &'a str,
        spec: ServiceSpec,
    },
    /// [`Control::add_backend`] to service `service` of `tenant`.
    AddBackend {
        tenant: &'a str,
        service: &'a str,
        spec: BackendSpec,
    },
    /// [`Control::delete_service`].
    DeleteService { tenant: &'a str, name: &'a str },
    /// [`Control::edit_backend`] of backend `address` of `service`.
    EditBackend {
        tenant: &'a str,
        service: &'a str,
        address: &'a str,
        patch: BackendPatch,
    },
    /// [`Control::delete_backend`].
    DeleteBackend {
        tenant: &'a str,
        service: &'a str,
        address: &'a str,
    },
}

/// What a partial update of a tenant makes of its current settings (`None`:
/// no such tenant): the new settings, or why not ([`Control::update_tenant`]).
pub type TenantEdit<'a> = &'a mut (dyn FnMut(Option<TenantSpec>) -> ControlResult<TenantSpec> + 'a);

/// Names the admin API's role ("the full-access token", "the read-only
/// token") that holds a token, if one does (see [`Control::reserve_tokens`]).
pub type TokenRoles = std::sync::Arc<dyn Fn(&str) -> Option<&'static str> + Send + Sync>;

/// IPVS-style cumulative counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Totals {
    /// Connections (TCP) or sessions (UDP) scheduled.
    pub conns: u64,
    /// Packets (TCP: reads) client → backend.
    pub inpkts: u64,
    /// Packets backend → client.
    pub outpkts: u64,
    /// Bytes client → backend.
    pub inbytes: u64,
    /// Bytes backend → client.
    pub outbytes: u64,
}

/// IPVS-style rates (2 s EWMA, as `ipvsadm -L --rate`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rates {
    /// Connections per second.
    pub cps: u64,
    /// Packets per second in.
    pub inpps: u64,
    /// Packets per second out.
    pub outpps: u64,
    /// Bytes per second in.
    pub inbps: u64,
    /// Bytes per second out.
    pub outbps: u64,
}

/// A tenant as the API lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantStatus {
    /// Its configuration (token omitted).
    #[serde(flatten)]
    pub spec: TenantSpec,
    /// Live connections + sessions.
    pub active_conns: u64,
    /// Connections/sessions refused by this tenant's limits.
    pub refused: u64,
    /// "own" or "shared" (shared also when an own table fell back).
    pub table: String,
    /// The tenant's own totals and rates, which count every connection
    /// of its services, deleted ones too, and start at 0 with the tenant
    /// (`GET /v1/stats` and `/metrics` show them; not part of
    /// `GET /v1/tenants`). `None` from a [`Control`] that keeps none: the
    /// sums of its services stand in.
    #[serde(skip)]
    pub figures: Option<(Totals, Rates)>,
}

/// A backend as the API lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackendStatus {
    /// "IP:PORT".
    pub address: String,
    /// Current weight (0 = quiesced/drained).
    pub weight: u32,
    /// Established TCP connections (IPVS ActConn).
    pub active_conns: u64,
    /// TCP connections in other states and UDP sessions (IPVS InActConn).
    pub inactive_conns: u64,
    /// Health: "up", "down" or "unchecked".
    pub health: String,
    /// Cumulative counters.
    pub stats: Totals,
    /// Current rates.
    pub rates: Rates,
}

/// A service as the API lists it (`weir list --json` prints these).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceStatus {
    /// Owning tenant.
    pub tenant: String,
    /// Name within the tenant.
    pub name: String,
    /// "tcp" or "udp".
    pub protocol: String,
    /// Virtual address.
    pub listen: String,
    /// How traffic reaches the backends ("proxy", "nat", "fnat", "dr").
    #[serde(default)]
    pub forward: crate::config::Forward,
    /// Scheduler name.
    pub scheduler: String,
    /// Persistence timeout ("0s" = off).
    pub persistence: String,
    /// Persistence client grouping as configured ("255.255.255.0" or an
    /// IPv6 prefix length); `None` = per client address.
    #[serde(default)]
    pub persistence_netmask: Option<String>,
    /// Scheduler flags as ipvsadm names them ("sh-fallback", "sh-port",
    /// "mh-fallback", "mh-port").
    #[serde(default)]
    pub sched_flags: Vec<String>,
    /// Backends in configuration order.
    pub backends: Vec<BackendStatus>,
    /// Cumulative counters.
    pub stats: Totals,
    /// Current rates.
    pub rates: Rates,
}

/// Filters for listing or killing connections; `None` matches everything.
/// An unknown key is an error: a filter that dropped a misspelt one would
/// match (and a kill would close) more than it says.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnFilter {
    /// Tenant name.
    pub tenant: Option<String>,
    /// Service name (within `tenant`, or in any tenant).
    pub service: Option<String>,
    /// Backend "IP:PORT".
    pub backend: Option<String>,
    /// State as `weir conns` prints it, e.g. "ESTABLISHED".
    pub state: Option<String>,
}

/// One connection (`weir conns --json` prints one per line).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnInfo {
    /// Tenant name.
    pub tenant: String,
    /// Service name.
    pub service: String,
    /// "TCP" or "UDP".
    pub proto: String,
    /// Client "IP:PORT".
    pub client: String,
    /// Virtual "IP:PORT".
    #[serde(rename = "virtual")]
    pub virtual_: String,
    /// Backend "IP:PORT".
    pub backend: String,
    /// e.g. "ESTABLISHED", "UDP".
    pub state: String,
    /// Seconds until it expires if idle.
    pub expires_s: u64,
    /// Unique id; `DELETE /v1/connections/{cookie}` kills it.
    pub cookie: u64,
    /// Bytes client → backend.
    pub bytes_in: u64,
    /// Bytes backend → client.
    pub bytes_out: u64,
    /// Packets (proxy: reads) client → backend.
    #[serde(default)]
    pub packets_in: u64,
    /// Packets (proxy: reads) backend → client.
    #[serde(default)]
    pub packets_out: u64,
    /// Packet mode's fnat: weir's local "IP:PORT" the backend sees as the
    /// client (the second tuple is local → backend).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<String>,
}

/// A page of a connection listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnPage {
    /// Up to `limit` connections.
    pub connections: Vec<ConnInfo>,
    /// Pass back as `cursor` for the next page; `None` when the dump is complete.
    pub next: Option<String>,
}

/// Flow-table figures of one tenant (`GET /v1/table`, `weir stats table`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableReport {
    /// Tenant name.
    pub tenant: String,
    /// "own" or "shared".
    pub placement: String,
    /// Entries (connections, sessions, persistence templates).
    pub entries: u64,
    /// Buckets of the table the tenant lives in.
    pub buckets: u64,
    /// Index entries per way of that table: (entries + reply entries) /
    /// (buckets x 11 ways); for a tenant token on a shared table, the
    /// tenant's own entries per way.
    pub load_factor: f64,
    /// Longest chain.
    pub max_chain: u64,
    /// `histogram[i]` = buckets whose chain has length i (last bin: ≥ i).
    pub chain_histogram: Vec<u64>,
    /// Inserts refused by the chain cap (hash-flood defence).
    pub refused_inserts: u64,
}

/// Daemon-wide counters and rates.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GlobalStats {
    /// Cumulative counters.
    pub stats: Totals,
    /// Current rates.
    pub rates: Rates,
    /// Live connections + sessions.
    pub active_conns: u64,
    /// Refused by limits, per reason ("tenant_limit", "global_limit", "no_backend", ...).
    pub refused: std::collections::BTreeMap<String, u64>,
    /// Datagrams the UDP proxy dropped, per reason ("backend_busy": the
    /// session's socket towards its backend could not take a client's at
    /// once; "send_failed"; "reply_failed": a backend's reply could not be
    /// sent to its client); left out while there were none.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub udp_dropped: std::collections::BTreeMap<String, u64>,
    /// UDP proxy sessions that had carried a single datagram from their
    /// client, ended, those due soonest first, to make room for a new
    /// session at its tenant's or the daemon's connection limit, or out of
    /// descriptors: what a spoofed datagram flood costs the sessions it
    /// crowds.
    #[serde(default)]
    pub udp_early_drops: u64,
    /// Open file descriptors and the limit.
    pub open_fds: u64,
    /// RLIMIT_NOFILE soft limit.
    pub fd_limit: u64,
    /// Duration of the last rate-estimator tick in seconds (0 until the
    /// first tick); exported as `weir_estimator_tick_duration_seconds`.
    #[serde(default)]
    pub estimator_tick_seconds: f64,
    /// Longest estimator tick seen so far in seconds.
    #[serde(default)]
    pub estimator_tick_max_seconds: f64,
    /// Packet mode's frame counters, when it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packet: Option<PacketStats>,
    /// The proxy workers and accept steering.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<WorkerStats>,
}

/// The proxy workers: which take new TCP connections (`[daemon]
/// accept_steering`) and how many each accepted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStats {
    /// "adaptive" or "spread".
    pub steering: String,
    /// Workers taking new TCP connections now (the first ones).
    pub accepting: u64,
    /// TCP connections each worker accepted, by worker index.
    pub accepted: Vec<u64>,
}

/// Packet mode's frame counters, summed over its workers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PacketStats {
    /// The packet I/O in use: "xdp" (AF_XDP) or "afpacket".
    pub io: String,
    /// The counters (their keys sit beside `io` in the JSON).
    #[serde(flatten)]
    pub counts: PacketCounters,
    /// The same figures per packet worker (one per AF_XDP queue, or per
    /// AF_PACKET socket): which queue receives, which one drops.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<PacketWorkerStats>,
}

/// One packet worker's frame counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PacketWorkerStats {
    /// The worker's name, as its thread's: `weir-pkt-q0` serves receive
    /// queue 0 of every AF_XDP interface, `weir-pkt-eth0-1` the second
    /// AF_PACKET socket on `eth0`.
    pub worker: String,
    /// The counters (their keys sit beside `worker` in the JSON).
    #[serde(flatten)]
    pub counts: PacketCounters,
}

/// Packet mode's counters: one worker's ([`PacketWorkerStats`]) or all
/// of theirs summed ([`PacketStats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PacketCounters {
    /// Frames received.
    pub rx: u64,
    /// Frames rewritten and transmitted.
    pub tx: u64,
    /// Flows created.
    pub new_flows: u64,
    /// ICMP errors about flows, translated and forwarded.
    #[serde(default)]
    pub icmp_errors: u64,
    /// TCP RSTs too far from their sender's sequence number to end a flow
    /// (forwarded, the flow's state left as it was: blind resets).
    #[serde(default)]
    pub rst_ignored: u64,
    /// TCP FINs too far from their sender's sequence number to move a
    /// flow towards its end (forwarded, the state left as it was).
    #[serde(default)]
    pub fin_ignored: u64,
    /// Other TCP segments too far from their sender's sequence number to
    /// keep a flow alive (forwarded; the flow's idle timer and state left
    /// as they were: blind ACKs and data).
    #[serde(default)]
    pub seq_ignored: u64,
    /// Flows that never got going (TCP in SYN_RECV, its handshake not
    /// finished; a single packet from the client so far; or, through nat
    /// or fnat, no reply yet) ended, those
    /// due soonest first, to make room for a new flow at a connection
    /// limit or in a full table: what a SYN or spoofed UDP flood costs the
    /// flows it crowds.
    #[serde(default)]
    pub early_drops: u64,
    /// Frames dropped, per reason ("fragment", "no_flow", "no_next_hop", ...).
    pub dropped: std::collections::BTreeMap<String, u64>,
}

impl PacketCounters {
    /// Adds `o`'s figures to these.
    pub fn add(&mut self, o: &PacketCounters) {
        self.rx += o.rx;
        self.tx += o.tx;
        self.new_flows += o.new_flows;
        self.icmp_errors += o.icmp_errors;
        self.rst_ignored += o.rst_ignored;
        self.fin_ignored += o.fin_ignored;
        self.seq_ignored += o.seq_ignored;
        self.early_drops += o.early_drops;
        for (reason, n) in &o.dropped {
            *self.dropped.entry(reason.clone()).or_default() += n;
        }
    }
}

/// Health of every checked backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthEntry {
    /// Tenant name.
    pub tenant: String,
    /// Service name.
    pub service: String,
    /// Backend "IP:PORT".
    pub backend: String,
    /// "up", "down" or "unchecked".
    pub state: String,
    /// Last check's error, if it failed.
    pub last_error: Option<String>,
}

/// Changes to a backend (`PUT .../backends/{address}`); `None` keeps the value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendPatch {
    /// New weight; 0 quiesces.
    pub weight: Option<u32>,
    /// Drain: weight 0 and, if true, also close its existing connections.
    pub drain: Option<bool>,
}

/// How to reload (`POST /v1/reload?dry_run=true&force=true`, `weir reload
/// --dry-run --force`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadOptions {
    /// Validate and report what would change; apply nothing.
    #[serde(default)]
    pub dry_run: bool,
    /// Also remove tenants, services and backends that were added through
    /// the API since the last reload and are not in the file (refused
    /// otherwise, so a reload does not silently undo runtime changes).
    #[serde(default)]
    pub force: bool,
}

/// What a reload changed, or with `dry_run` would change. Each entry names
/// one object: `tenant NAME`, `service TENANT/NAME` or `backend
/// TENANT/NAME/IP:PORT` (a backend added to or removed from a service that
/// stays; a changed service lists its new and removed backends this way).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadReport {
    /// False for a dry run.
    pub applied: bool,
    /// Objects in the file that were not running.
    pub added: Vec<String>,
    /// Running objects whose settings the file changes.
    pub changed: Vec<String>,
    /// Running objects the file does not have.
    pub removed: Vec<String>,
}

/// What the daemon can be asked to do. Every method is quick and
/// non-blocking (safe to call from an async handler) and never panics on
/// any input; except [`reload`](Self::reload), and the edits of services
/// and backends and a tenant's addition, edit and deletion, which wait for a
/// reload being applied to end, or for its step in progress (the daemon
/// waits off the async runtime's worker, with
/// `tokio::task::block_in_place`, so an async caller's other tasks run on
/// meanwhile).
pub trait Control: Send + Sync + 'static {
    /// Tenants in name order.
    fn tenants(&self) -> Vec<TenantStatus>;
    /// Create a tenant (own table sized from `table_entries`).
    fn add_tenant(&self, spec: TenantSpec) -> ControlResult<()>;
    /// Replace a live tenant's settings: limits, token and timeouts apply at
    /// once (limits to the next admission, timeouts to the flow table now
    /// and to connections at their next state change). `spec.name` must be
    /// `tenant`; a different `table_entries` is refused as
    /// [`ErrorKind::Invalid`] (the table is sized at creation: delete and
    /// re-create the tenant).
    fn edit_tenant(&self, tenant: &str, spec: TenantSpec) -> ControlResult<()>;
    /// [`edit_tenant`](Self::edit_tenant) with the settings `edit` makes of
    /// the current ones, which the daemon reads and runs `edit` on with its
    /// edits held: a merge cannot start from settings that another edit,
    /// or a reload, replaces before the merge is written (the other's
    /// change would be lost). The default, for a control with no edits of
    /// its own to wait for, reads and edits without a lock.
    fn update_tenant(&self, tenant: &str, edit: TenantEdit<'_>) -> ControlResult<()> {
        let spec = edit(self.tenant_spec(tenant))?;
        self.edit_tenant(tenant, spec)
    }
    /// Delete a tenant: closes its connections and purges only its entries;
    /// its services go too. Returns how many connections were closed.
    fn delete_tenant(&self, tenant: &str) -> ControlResult<u64>;

    /// Services in (tenant, name) order with their backends.
    fn services(&self) -> Vec<ServiceStatus>;
    /// Add a service (starts listening on every worker).
    fn add_service(&self, spec: ServiceSpec) -> ControlResult<()>;
    /// Replace a service's settings and backend set without dropping
    /// established connections.
    fn edit_service(&self, tenant: &str, name: &str, spec: ServiceSpec) -> ControlResult<()>;
    /// Delete a service: stop listening and close its connections.
    fn delete_service(&self, tenant: &str, name: &str) -> ControlResult<()>;
    /// Add a backend to a service.
    fn add_backend(&self, tenant: &str, service: &str, spec: BackendSpec) -> ControlResult<()>;
    /// `write` if `check` passes, run with the daemon's edits held
    /// ([`Check`]): a tenant token's fence reads the tenant's settings and
    /// weir's own addresses, and a new tenant's token is checked against
    /// every tenant's, which another write changes. The default, for a
    /// control with no edits of its own, runs the check, then the write,
    /// without a lock.
    fn write_checked(&self, write: CheckedWrite<'_>, check: Check<'_>) -> ControlResult<()> {
        check()?;
        match write {
            CheckedWrite::AddTenant(spec) => self.add_tenant(spec),
            CheckedWrite::AddService(spec) => self.add_service(spec),
            CheckedWrite::EditService { tenant, name, spec } => {
                self.edit_service(tenant, name, spec)
            }
            CheckedWrite::AddBackend {
                tenant,
                service,
                spec,
            } => self.add_backend(tenant, service, spec),
            CheckedWrite::DeleteService { tenant, name } => self.delete_service(tenant, name),
            CheckedWrite::EditBackend {
                tenant,
                service,
                address,
                patch,
            } => self.edit_backend(tenant, service, address, patch),
            CheckedWrite::DeleteBackend {
                tenant,
                service,
                address,
            } => self.delete_backend(tenant, service, address),
        }
    }
    /// Edit weight or drain a backend.
    fn edit_backend(
        &self,
        tenant: &str,
        service: &str,
        address: &str,
        patch: BackendPatch,
    ) -> ControlResult<()>;
    /// Remove a backend; its established connections finish unless the
    /// service has `expire_nodest_conn`.
    fn delete_backend(&self, tenant: &str, service: &str, address: &str) -> ControlResult<()>;

    /// One page of the connection table, exact across pages (resumable cursor).
    fn connections(
        &self,
        filter: &ConnFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> ControlResult<ConnPage>;
    /// Kill one connection (or packet flow) by cookie; with `tenant`, only
    /// if it is that tenant's (a tenant-scoped caller), else NotFound.
    fn kill(&self, cookie: u64, tenant: Option<&str>) -> ControlResult<()>;
    /// Kill every connection matching the filter; returns how many.
    fn kill_matching(&self, filter: &ConnFilter) -> ControlResult<u64>;
    /// [`connections`](Self::connections) if `check` passes, run once the
    /// daemon has found the tenant the filter names (the instance it then
    /// lists), before it lists: a check that the caller's token still
    /// names that tenant binds the listing to the tenant the token names
    /// then, not to one deleted and created again under the same name
    /// after the token was checked (such a listing sees the new one's
    /// connections). No lock is held: the act reaches the tenant found
    /// before the check, or, if it is gone by then, nothing. The default,
    /// for a control with no tenants of its own to find, runs the check,
    /// then the listing.
    fn connections_checked(
        &self,
        filter: &ConnFilter,
        cursor: Option<&str>,
        limit: usize,
        check: Check<'_>,
    ) -> ControlResult<ConnPage> {
        check()?;
        self.connections(filter, cursor, limit)
    }
    /// [`kill`](Self::kill) if `check` passes, run once `tenant` is found,
    /// as [`connections_checked`](Self::connections_checked) runs it.
    fn kill_checked(
        &self,
        cookie: u64,
        tenant: Option<&str>,
        check: Check<'_>,
    ) -> ControlResult<()> {
        check()?;
        self.kill(cookie, tenant)
    }
    /// [`kill_matching`](Self::kill_matching) if `check` passes, run once
    /// the filter's tenant is found, as
    /// [`connections_checked`](Self::connections_checked) runs it.
    fn kill_matching_checked(&self, filter: &ConnFilter, check: Check<'_>) -> ControlResult<u64> {
        check()?;
        self.kill_matching(filter)
    }

    /// Daemon-wide counters, rates, limits.
    fn global_stats(&self) -> GlobalStats;
    /// Flow-table figures per tenant.
    fn table(&self) -> Vec<TableReport>;
    /// [`table`](Self::table) of one tenant (what its token may see), none
    /// for an unknown name. The daemon reads that tenant's table alone:
    /// `table` reads every table, so a tenant's request cost what every
    /// tenant's tables hold.
    fn table_of(&self, tenant: &str) -> Vec<TableReport> {
        let mut v = self.table();
        v.retain(|r| r.tenant == tenant);
        v
    }
    /// Health-check state of every backend.
    fn health(&self) -> Vec<HealthEntry>;
    /// [`tenants`](Self::tenants) as a tenant's token sees it: its own
    /// status alone (none for an unknown name), read alone.
    fn tenant_status(&self, tenant: &str) -> Vec<TenantStatus> {
        let mut v = self.tenants();
        v.retain(|t| t.spec.name == tenant);
        v
    }
    /// [`services`](Self::services) of one tenant (what its token may
    /// see), in the same order, without computing every other tenant's
    /// (the daemon reads a range of its services by (tenant, name)).
    fn services_of(&self, tenant: &str) -> Vec<ServiceStatus> {
        let mut v = self.services();
        v.retain(|s| s.tenant == tenant);
        v
    }
    /// [`health`](Self::health) of one tenant's backends, as
    /// [`services_of`](Self::services_of).
    fn health_of(&self, tenant: &str) -> Vec<HealthEntry> {
        let mut v = self.health();
        v.retain(|e| e.tenant == tenant);
        v
    }
    /// The running state in config-file form (`weir save`).
    fn running_config(&self) -> Config;
    /// The admin API's own tokens, given once as it starts, so that a
    /// reload (`POST /v1/reload` or SIGHUP) refuses a tenant token one of
    /// them already is: the API refuses such a token (409) and `weir run`
    /// at start, but only the API knows a `token_file`'s contents.
    fn reserve_tokens(&self, _roles: TokenRoles) {}
    /// Calls `f(tenant, token)` for every tenant with a non-empty admin
    /// token. The admin API runs it for every request that presents a
    /// token other than the full and read-only ones, before it knows who is
    /// asking, so it must cost O(tenants) and copy nothing; reading the
    /// tokens out of [`running_config`](Self::running_config) copied every
    /// service, tens of ms per request at 100,000 services, for any bogus
    /// token.
    fn for_each_tenant_token(&self, f: &mut dyn FnMut(&str, &str));
    /// One tenant's settings as `running_config` would give them (the
    /// implicit default tenant's too), or `None`. For requests about one
    /// tenant: a look-up, not a copy of the whole configuration.
    fn tenant_spec(&self, tenant: &str) -> Option<TenantSpec>;
    /// One service as `running_config` would give it (live weights), or
    /// `None`; a look-up, as [`tenant_spec`](Self::tenant_spec).
    fn service_spec(&self, tenant: &str, service: &str) -> Option<ServiceSpec>;
    /// Which of the daemon's own services a `protocol` connection from
    /// this host to `addr` would reach ("tenant/name"), if any: a tenant
    /// token may not point a backend there (a loop through weir, or another
    /// tenant's service reached from inside). The default (a control with
    /// no listeners of its own) answers `None`.
    fn own_service_at(
        &self,
        _protocol: crate::config::Protocol,
        _addr: std::net::SocketAddr,
    ) -> Option<String> {
        None
    }
    /// Re-read the file the daemon was started with: validate all of it
    /// (including what cannot change live), then apply all of it; on any
    /// error apply nothing and return every error. An empty file is refused,
    /// and so is removing objects added through the API since the last
    /// reload unless `opts.force`. Blocking (reads and parses the file):
    /// call it off the async executor.
    fn reload(&self, opts: ReloadOptions) -> Result<ReloadReport, Vec<String>>;
}

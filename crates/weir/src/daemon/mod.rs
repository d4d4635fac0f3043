//! The live daemon: workers, listeners, the proxy data path and the control
//! state the admin API reads and changes.
//!
//! # Shape
//!
//! * **Workers.** `daemon.workers` OS threads (default: the CPUs available),
//!   each running its own current-thread tokio runtime. Every TCP and UDP
//!   service has one `SO_REUSEPORT` socket *per worker*, so the kernel spreads
//!   accepts (and UDP clients) across workers and no accept queue is shared.
//!   Sockets are created on the control side (so "address in use" is reported
//!   synchronously to the caller of `add_service`) and handed to each worker
//!   through its command channel.
//! * **Live state.** Tenants and services sit in one `RwLock`'d map consulted
//!   only on control operations; each service holds its backend set and its
//!   scheduler behind an `RwLock<Arc<..>>` that a new connection clones once,
//!   so edits apply to the next connection and never disturb established ones.
//! * **Flow table.** Every TCP connection, UDP session and persistence
//!   template is an entry of `weir-flowtable` (per-tenant own tables,
//!   bounded expiry, exact resumable dumps for listings).
//! * **One record per connection.** A connection's entry *is* the
//!   connection: backend, state, timers and byte counters live there and
//!   nowhere else. Its task holds only its sockets and a [`Conn`] (the
//!   entry's handle and the service and backend its bytes count against).
//!   The entry names its task by an owner token ([`owners`]): the table's
//!   wheel times the connection out and tells the owner, and kills by cookie
//!   or filter, backend removal (`expire_nodest_conn`) and tenant deletion
//!   find owners through the table. Whoever removes an entry settles it
//!   (backend counts, access log) — exactly once, as only one removal of an
//!   entry succeeds.
//! * **Bounded buffering.** Each direction of a TCP connection owns one
//!   `buffer_size` buffer and reads again only after the previous bytes were
//!   fully written; both sockets get `TCP_NOTSENT_LOWAT`, and the backend
//!   socket a modest `SO_RCVBUF`, so a client that stops reading stalls the
//!   chain back to the backend instead of piling bytes in weir.
//!
//! See docs/daemon.md for the options, the measurements and what is left.

mod control_impl;
pub(crate) mod owners;
mod packet;
mod packet_run;
mod ratelog;
mod stats;
mod tcp;
mod udp;

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use parking_lot::{Mutex, RwLock};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use weir_flowtable::{
    BackendId, Dir, DumpFilter, FlowInit, FlowKey, FlowSnapshot, FlowState, FlowTable, Handle,
    Millis, Proto, ServiceId, TableConfig, TenantConfig, TenantId, TimeoutOverrides, Timeouts,
};
use weir_sched::{AffinityMask, BackendInfo, HashSeed, Load, SchedConfig, Scheduler};

use crate::config::{
    self, BackendSpec, Config, DEFAULT_TENANT, DaemonConfig, Protocol, ServiceSpec, TenantSpec,
};
use crate::control::Control;
use owners::Close;
use stats::Stat;

/// IPVS default idle timeout of an established TCP connection.
pub const TCP_ESTABLISHED_TIMEOUT: Duration = Duration::from_secs(900);
/// IPVS default timeout of a half-closed TCP connection (FIN_WAIT).
pub const TCP_FIN_TIMEOUT: Duration = Duration::from_secs(120);
/// Default UDP session idle timeout (IPVS: 300 s).
pub const UDP_TIMEOUT: Duration = Duration::from_secs(300);
/// Default backend connect timeout.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Every problem of a service spec as one `Invalid` control error;
/// `packet` is the `[packet]` section a packet service is checked against.
pub(crate) fn check_service(
    spec: &ServiceSpec,
    packet: Option<&config::PacketConfig>,
) -> crate::control::ControlResult<()> {
    let mut problems = config::service_problems(spec);
    problems.extend(config::packet_service_problems(spec, packet));
    if problems.is_empty() {
        return Ok(());
    }
    let msg: Vec<String> = problems
        .iter()
        .map(|p| format!("{}: {}", p.path, p.message))
        .collect();
    Err(crate::control::ControlError::new(
        crate::control::ErrorKind::Invalid,
        msg.join("; "),
    ))
}

/// Starts daemons.
#[derive(Debug)]
pub struct Daemon;

impl Daemon {
    /// Validate `config`, raise the open-files limit, start the workers, the
    /// estimator thread and the health checks, and open every service's
    /// listeners. `config_path` is what [`Control::reload`] re-reads.
    ///
    /// Services listening on port 0 get a free port; [`DaemonHandle::service_addr`]
    /// tells which.
    pub fn start(config: Config, config_path: Option<PathBuf>) -> anyhow::Result<DaemonHandle> {
        Self::start_inner(config, config_path, true)
    }

    /// [`Self::start`]; `attach` = false leaves packet mode's interfaces
    /// alone (no steering, no sockets, no packet workers) while its services
    /// and shared state exist, so unit tests drive [`packet::Engine`]
    /// with frames of their own.
    fn start_inner(
        config: Config,
        config_path: Option<PathBuf>,
        attach: bool,
    ) -> anyhow::Result<DaemonHandle> {
        let problems = config::validate(&config);
        if !problems.is_empty() {
            let list: Vec<String> = problems
                .iter()
                .map(|p| format!("{}: {}", p.path, p.message))
                .collect();
            anyhow::bail!("invalid configuration:\n  {}", list.join("\n  "));
        }
        let (fd_soft, fd_hard) = raise_nofile();
        let workers = if config.daemon.workers == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            config.daemon.workers
        };
        tracing::info!(
            workers,
            fd_limit = fd_soft,
            fd_hard,
            approx_max_connections = fd_soft.saturating_sub(64) / 2,
            "starting weir"
        );
        let control_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("weir-control")
            .enable_all()
            .build()
            .context("building the control runtime")?;

        let mut worker_txs = Vec::with_capacity(workers);
        let mut threads = Vec::with_capacity(workers + 1);
        let stop_workers = CancellationToken::new();
        for i in 0..workers {
            let (tx, rx) = mpsc::unbounded_channel();
            worker_txs.push(tx);
            let stop = stop_workers.clone();
            let t = std::thread::Builder::new()
                .name(format!("weir-worker-{i}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            tracing::error!(worker = i, "cannot build worker runtime: {e}");
                            return;
                        }
                    };
                    stats::set_worker_index(i);
                    rt.block_on(worker_main(rx, stop));
                })
                .context("spawning a worker thread")?;
            threads.push(t);
        }
        // Packet workers: one per queue of each `[packet]` interface, each
        // with its own counter shard after the proxy workers'.
        let packet_workers = match &config.packet {
            Some(p) if attach => packet_run::queue_count(p, workers)?,
            _ => 0,
        };
        let rates = Arc::new(stats::RateEngine::new(workers + packet_workers)?);
        let shared = Arc::new(Shared {
            config_path,
            daemon_cfg: config.daemon.clone(),
            admin_cfg: config.admin.clone(),
            packet_cfg: config.packet.clone(),
            state: RwLock::new(State::default()),
            owners: Arc::new(owners::Owners::new(workers)),
            table: FlowTable::new(TableConfig {
                shared_buckets: config.daemon.shared_table_entries,
                max_shared_entries: config.daemon.max_shared_table_entries,
                memory_budget: config.daemon.own_tables_budget,
                ..TableConfig::default()
            }),
            next_id: AtomicU32::new(1),
            workers: worker_txs,
            stat: rates.stat(),
            rates,
            active: AtomicU64::new(0),
            refused: RefusalCounts::default(),
            listen_groups: Mutex::new(Vec::new()),
            stop_accept: CancellationToken::new(),
            kill_all: CancellationToken::new(),
            control_rt: control_rt.handle().clone(),
            fd_limit: fd_soft,
            epoch: Instant::now(),
            drain_timeout: config.daemon.drain_timeout.get(),
            runtime_added: Mutex::default(),
            reload_lock: Mutex::new(()),
            services_gen: AtomicU64::new(0),
            packet: std::sync::OnceLock::new(),
            packet_rt: std::sync::OnceLock::new(),
        });
        // The implicit default tenant always exists.
        let mut tenants = config.tenants.clone();
        if !tenants.iter().any(|t| t.name == DEFAULT_TENANT) {
            tenants.insert(0, default_tenant_spec());
        }
        if let Some(p) = &config.packet {
            let path = packet::PacketPath::new(
                p.local_addresses.clone(),
                p.fnat_ports.lo..=p.fnat_ports.hi,
                rand::random(),
            )?;
            let _ = shared.packet.set(Arc::new(path));
        }
        for t in tenants {
            shared.add_tenant(t).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        for s in config.services.clone() {
            shared
                .add_service(s)
                .map_err(|e| anyhow::anyhow!("{}", e.message))?;
        }
        let est_stop = Arc::new(AtomicBool::new(false));
        if let Some(p) = config.packet.as_ref().filter(|_| attach) {
            let (rt, pkt_threads) = packet_run::start(&shared, p, workers, est_stop.clone())?;
            threads.extend(pkt_threads);
            rt.sync(&shared);
            let _ = shared.packet_rt.set(rt);
        }
        // Flow-table expiry: bounded work per step, once a second.
        {
            let weak = Arc::downgrade(&shared);
            let stop = est_stop.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("weir-expiry".into())
                    .spawn(move || expiry_main(weak, stop))
                    .context("spawning the expiry thread")?,
            );
        }
        // Estimator thread: placed (CPU, nice) and calibrated before start
        // returns, so a bad `estimator_cpu` fails the start.
        {
            let rates = shared.rates.clone();
            let stop = est_stop.clone();
            let placement = stats::Placement {
                cpu: config.daemon.estimator_cpu,
                nice: config.daemon.estimator_nice,
            };
            let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
            threads.push(
                std::thread::Builder::new()
                    .name("weir-estimator".into())
                    .spawn(move || stats::estimator_main(rates, stop, placement, ready_tx))
                    .context("spawning the estimator thread")?,
            );
            let started = ready_rx
                .recv()
                .map_err(|_| anyhow::anyhow!("the estimator thread ended before starting"))
                .and_then(|r| r.map_err(|e| anyhow::anyhow!("{e}")));
            match started {
                Ok(s) => tracing::info!(
                    tid = s.tid,
                    cpu = ?placement.cpu,
                    nice = ?placement.nice.filter(|_| s.nice_applied),
                    cost_ns = s.cost_ns,
                    "rate estimator calibrated"
                ),
                Err(e) => {
                    // Stop what was started, then report.
                    drop(DaemonHandle {
                        shared,
                        control_rt: Some(control_rt),
                        threads,
                        stop_workers,
                        est_stop,
                    });
                    return Err(e);
                }
            }
        }
        Ok(DaemonHandle {
            shared,
            control_rt: Some(control_rt),
            threads,
            stop_workers,
            est_stop,
        })
    }
}

/// A running daemon. Dropping it stops it fast (like [`DaemonHandle::shutdown`]).
#[derive(Debug)]
pub struct DaemonHandle {
    shared: Arc<Shared>,
    control_rt: Option<tokio::runtime::Runtime>,
    threads: Vec<std::thread::JoinHandle<()>>,
    stop_workers: CancellationToken,
    est_stop: Arc<AtomicBool>,
}

impl DaemonHandle {
    /// The control interface the admin API serves.
    pub fn control(&self) -> Arc<dyn Control> {
        Arc::new(control_impl::LiveControl(self.shared.clone()))
    }

    /// The address a service actually listens on (port 0 resolved).
    pub fn service_addr(&self, tenant: &str, name: &str) -> Option<SocketAddr> {
        self.shared
            .state
            .read()
            .services
            .get(&(tenant.to_owned(), name.to_owned()))
            .map(|s| s.listen)
    }

    /// A handle of the control-plane runtime (for the admin API, signals).
    pub fn runtime(&self) -> tokio::runtime::Handle {
        self.shared.control_rt.clone()
    }

    /// Live connections + sessions.
    pub fn active_connections(&self) -> u64 {
        self.shared.active.load(Relaxed)
    }

    /// Stop accepting; let connections finish for up to `timeout`; then close
    /// the rest and stop. Returns how many were closed forcibly.
    pub fn drain(self, timeout: Duration) -> u64 {
        self.drain_until(timeout, &AtomicBool::new(false))
    }

    /// [`Self::drain`], ended early (within 50 ms) once `abort` is set, e.g.
    /// by a second signal.
    pub fn drain_until(mut self, timeout: Duration, abort: &AtomicBool) -> u64 {
        self.shared.stop_accept.cancel();
        // No deadline if `timeout` overflows the clock (validation bounds
        // it to a day; a caller may pass anything).
        let deadline = Instant::now().checked_add(timeout);
        while self.shared.active.load(Relaxed) > 0
            && deadline.is_none_or(|d| Instant::now() < d)
            && !abort.load(Relaxed)
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        let left = self.shared.active.load(Relaxed);
        self.stop();
        left
    }

    /// The drain timeout from `[daemon]`.
    pub fn drain_timeout(&self) -> Duration {
        self.shared.drain_timeout
    }

    /// Close everything now and stop.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.stop_accept.cancel();
        self.shared.kill_all.cancel();
        self.shared.owners.kill_all(Close::Killed);
        // Health checks and admin tasks run on the control runtime.
        for svc in self.shared.state.read().services.values() {
            svc.cancel.cancel();
        }
        self.stop_workers.cancel();
        self.est_stop.store(true, Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Some(rt) = self.shared.packet_rt.get() {
            rt.release();
        }
        if let Some(rt) = self.control_rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

impl Drop for DaemonHandle {
    fn drop(&mut self) {
        if self.control_rt.is_some() {
            self.stop();
        }
    }
}

fn default_tenant_spec() -> TenantSpec {
    TenantSpec {
        name: DEFAULT_TENANT.into(),
        table_entries: 0,
        max_table_entries: 0,
        max_connections: 0,
        max_new_per_s: 0,
        token: None,
        timeouts: Default::default(),
        allowed_listen: Vec::new(),
        allowed_backends: Vec::new(),
    }
}

/// Raise the soft RLIMIT_NOFILE to the hard limit; returns (soft, hard).
fn raise_nofile() -> (u64, u64) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) => {
            if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
                (hard, hard)
            } else {
                (soft, hard)
            }
        }
        Err(_) => (0, 0),
    }
}

pub(crate) fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

/// Expire idle flow-table entries (bounded work per call), settle them and
/// tell their owners to close.
fn expiry_main(shared: Weak<Shared>, stop: Arc<AtomicBool>) {
    let mut out = Vec::new();
    loop {
        for _ in 0..10 {
            if stop.load(Relaxed) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let now = Millis(shared.now_ms());
        // At most 64 Ki entries per second; the rest waits for the next round.
        for _ in 0..16 {
            out.clear();
            let n = shared.table.expire(now, 4096, &mut out);
            shared.ended(&out, Close::IdleTimeout);
            if n < 4096 {
                break;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Live state
// ---------------------------------------------------------------------------

#[derive(Debug)]
pub(crate) struct Shared {
    config_path: Option<PathBuf>,
    pub(crate) daemon_cfg: DaemonConfig,
    admin_cfg: crate::config::AdminConfig,
    /// `[packet]` as the daemon started with it (a reload cannot change it).
    pub(crate) packet_cfg: Option<config::PacketConfig>,
    pub(crate) state: RwLock<State>,
    /// The tasks that own proxied connections, named by their entries.
    pub(crate) owners: Arc<owners::Owners>,
    /// The flow table: connections, UDP sessions and persistence templates.
    pub(crate) table: FlowTable,
    next_id: AtomicU32,
    workers: Vec<mpsc::UnboundedSender<WorkerCmd>>,
    pub(crate) stat: Stat,
    pub(crate) rates: Arc<stats::RateEngine>,
    pub(crate) active: AtomicU64,
    pub(crate) refused: RefusalCounts,
    /// Every service that opened listeners, while it lives: a service
    /// address still held by a removed one of ours is waited for, not
    /// mistaken for another process's.
    listen_groups: Mutex<Vec<(Protocol, SocketAddr, Weak<Service>)>>,
    pub(crate) stop_accept: CancellationToken,
    pub(crate) kill_all: CancellationToken,
    control_rt: tokio::runtime::Handle,
    pub(crate) fd_limit: u64,
    epoch: Instant,
    drain_timeout: Duration,
    /// Objects added through the API since the start or the last reload
    /// ("tenant T", "service T/S", "backend T/S/ADDR"): a reload that would
    /// remove them needs `force`.
    pub(crate) runtime_added: Mutex<std::collections::BTreeSet<String>>,
    /// Serialises reloads.
    pub(crate) reload_lock: Mutex<()>,
    /// Moves whenever a service is added, removed or replaced, or a
    /// service's set of backends changes: packet workers rebuild their
    /// snapshot of the packet services when it does.
    pub(crate) services_gen: AtomicU64,
    /// Packet mode's shared part, when `[packet]` is configured.
    pub(crate) packet: std::sync::OnceLock<Arc<packet::PacketPath>>,
    /// Packet mode's attached interfaces.
    packet_rt: std::sync::OnceLock<Arc<packet_run::PacketRuntime>>,
}

#[derive(Debug, Default)]
pub(crate) struct State {
    pub(crate) tenants: BTreeMap<String, Arc<Tenant>>,
    pub(crate) services: BTreeMap<(String, String), Arc<Service>>,
}

#[derive(Debug)]
pub(crate) struct Tenant {
    pub(crate) id: u32,
    pub(crate) spec: RwLock<TenantSpec>,
    pub(crate) active: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) stat: Stat,
    /// "own" or "shared" (what the flow table granted).
    pub(crate) placement: String,
    /// `max_new_per_s`, as a token bucket.
    new_conns: NewConnLimit,
    pub(crate) deleted: CancellationToken,
}

#[derive(Debug)]
pub(crate) struct Service {
    pub(crate) id: u32,
    pub(crate) tenant: Arc<Tenant>,
    pub(crate) spec: RwLock<ServiceSpec>,
    /// Parsed settings, replaced as a whole on edit.
    pub(crate) params: RwLock<Arc<ServiceParams>>,
    /// Actual listen address (port 0 resolved).
    pub(crate) listen: SocketAddr,
    pub(crate) set: RwLock<Arc<BackendSet>>,
    pub(crate) stat: Stat,
    /// Cancels listeners and health checks.
    pub(crate) cancel: CancellationToken,
    /// UDP sessions per client IP (for `udp_max_sessions_per_client`).
    pub(crate) udp_per_client: Mutex<HashMap<IpAddr, u64>>,
    /// Open TCP connections per client IP (for
    /// `tcp_max_connections_per_client`); an IP leaves when its count is 0.
    tcp_per_client: Mutex<HashMap<IpAddr, u64>>,
    /// Persistence templates with live connections: template key →
    /// (backend id, connections). Such a template does not expire (IPVS
    /// keeps a template while it controls connections); when its last
    /// connection ends, its timeout starts over.
    templates: Mutex<HashMap<FlowKey, (u32, u64)>>,
    health_cancel: Mutex<CancellationToken>,
}

#[derive(Debug, Clone)]
pub(crate) struct ServiceParams {
    pub(crate) persistence: Duration,
    pub(crate) mask: AffinityMask,
    pub(crate) connect_timeout: Duration,
    pub(crate) expire_nodest_conn: bool,
    /// The service's own `udp_timeout`; `None` = its tenant's `udp` timeout.
    pub(crate) udp_timeout: Option<Duration>,
    pub(crate) udp_responses: Option<u32>,
    pub(crate) udp_max_per_client: u64,
    /// `tcp_max_connections_per_client`; 0 = unlimited.
    pub(crate) tcp_max_per_client: u64,
    /// The flow table's timeout profile for these timeouts (see
    /// [`Shared::with_profile`]); 0 until then.
    pub(crate) profile: u16,
}

#[derive(Debug)]
pub(crate) struct BackendSet {
    pub(crate) sched: Scheduler,
    pub(crate) backends: Vec<Arc<Backend>>,
}

#[derive(Debug)]
pub(crate) struct Backend {
    /// Flow-table id (unique for the daemon's life).
    pub(crate) id: u32,
    pub(crate) addr: SocketAddr,
    pub(crate) spec: RwLock<BackendSpec>,
    pub(crate) weight: AtomicU32,
    pub(crate) up: AtomicBool,
    pub(crate) checked: AtomicBool,
    pub(crate) last_error: Mutex<Option<String>>,
    /// The passive check (failed connects in a row), and why it last took
    /// the backend out.
    pub(crate) passive: crate::health::Passive,
    pub(crate) passive_error: Mutex<Option<String>>,
    pub(crate) active: AtomicU64,
    pub(crate) inactive: AtomicU64,
    pub(crate) stat: Stat,
}

impl Backend {
    pub(crate) fn new(spec: BackendSpec, rates: &stats::RateEngine) -> Arc<Self> {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        Arc::new(Self {
            id: NEXT.fetch_add(1, Relaxed),
            addr: spec.address,
            weight: AtomicU32::new(spec.weight),
            spec: RwLock::new(spec),
            up: AtomicBool::new(true),
            checked: AtomicBool::new(false),
            last_error: Mutex::new(None),
            passive: Default::default(),
            passive_error: Mutex::new(None),
            active: AtomicU64::new(0),
            inactive: AtomicU64::new(0),
            stat: rates.stat(),
        })
    }

    fn info(&self) -> BackendInfo {
        BackendInfo {
            addr: self.addr.into(),
            weight: self.weight.load(Relaxed),
            up: self.up.load(Relaxed) && !self.passive.is_down(),
        }
    }

    pub(crate) fn conns(&self) -> u64 {
        self.active.load(Relaxed) + self.inactive.load(Relaxed)
    }
}

/// Connection states as `weir conns` prints them (IPVS names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum ConnState {
    SynRecv = 0,
    Established = 1,
    FinWait = 2,
    Close = 3,
    Udp = 4,
}

impl ConnState {
    fn flow(self) -> FlowState {
        match self {
            Self::SynRecv => FlowState::SynRecv,
            Self::Established => FlowState::Established,
            Self::FinWait => FlowState::FinWait,
            Self::Close => FlowState::Close,
            Self::Udp => FlowState::Udp,
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::SynRecv,
            1 => Self::Established,
            2 => Self::FinWait,
            4 => Self::Udp,
            _ => Self::Close,
        }
    }
}

/// A live connection or UDP session as its task holds it: where its entry
/// is, and what its bytes count against. Everything that changes (state,
/// timers, counters) is in the entry; this is the task's own, never shared.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) handle: Handle,
    pub(crate) service: Arc<Service>,
    pub(crate) backend: Arc<Backend>,
    pub(crate) client: SocketAddr,
    /// The state this task last gave the entry (it alone changes it), for
    /// the backend's active/inactive counts.
    state: AtomicU8,
    /// The persistence template this connection holds, if any.
    template: Option<FlowKey>,
}

impl Conn {
    /// Move the entry to `s`, keeping the backend's active/inactive counts
    /// in step (nothing if the entry is gone: its remover settled it).
    pub(crate) fn set_state(&self, shared: &Shared, s: ConnState) {
        if !shared
            .table
            .set_state_handle(self.handle, s.flow(), Millis(shared.now_ms()))
        {
            return;
        }
        let old = ConnState::from_u8(self.state.swap(s as u8, Relaxed));
        let was_active = old == ConnState::Established;
        let is_active = s == ConnState::Established;
        if was_active != is_active {
            if is_active {
                self.backend.active.fetch_add(1, Relaxed);
                self.backend.inactive.fetch_sub(1, Relaxed);
            } else {
                self.backend.active.fetch_sub(1, Relaxed);
                self.backend.inactive.fetch_add(1, Relaxed);
            }
        }
    }
}

/// `max_new_per_s` as a token bucket holding one second's worth, kept as
/// GCRA's "theoretical arrival time" in one atomic (lock-free): from idle,
/// `rate` connections pass at once, then one every `1/rate` s, so a span of
/// L seconds admits at most `rate × (1 + L)`. (The fixed per-second window
/// it replaces let `2 × rate` through within a millisecond around each
/// second's boundary.) I/O-free: time is a parameter.
#[derive(Debug, Default)]
pub(crate) struct NewConnLimit {
    /// Nanoseconds (daemon clock) at which the bucket is full again.
    tat: AtomicU64,
}

impl NewConnLimit {
    /// One new connection at `now_ns` under `rate` per second (> 0).
    pub(crate) fn admit(&self, now_ns: u64, rate: u64) -> bool {
        const SECOND: u64 = 1_000_000_000;
        let step = (SECOND / rate.max(1)).max(1);
        let tolerance = SECOND.saturating_sub(step);
        let mut tat = self.tat.load(Relaxed);
        loop {
            let start = tat.max(now_ns);
            if start - now_ns > tolerance {
                return false;
            }
            match self
                .tat
                .compare_exchange_weak(tat, start + step, Relaxed, Relaxed)
            {
                Ok(_) => return true,
                Err(t) => tat = t,
            }
        }
    }
}

/// Why a connection or session was refused; each one is counted under
/// exactly one reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    GlobalLimit,
    TenantLimit,
    TenantRate,
    NoBackend,
    BackendLimit,
    ClientLimit,
    /// A client at `tcp_max_connections_per_client`.
    TcpClientLimit,
    TableFull,
    /// Every backend tried failed to connect or timed out.
    BackendUnreachable,
    /// `accept` hit the descriptor limit (the client waits in the backlog).
    FdExhausted,
}

impl Refusal {
    const ALL: [Self; 10] = [
        Self::GlobalLimit,
        Self::TenantLimit,
        Self::TenantRate,
        Self::NoBackend,
        Self::BackendLimit,
        Self::ClientLimit,
        Self::TcpClientLimit,
        Self::TableFull,
        Self::BackendUnreachable,
        Self::FdExhausted,
    ];

    /// The name in `refused` of the stats and the metrics' `reason` label.
    fn key(self) -> &'static str {
        match self {
            Self::GlobalLimit => "global_limit",
            Self::TenantLimit => "tenant_limit",
            Self::TenantRate => "tenant_rate",
            Self::NoBackend => "no_backend",
            Self::BackendLimit => "backend_limit",
            Self::ClientLimit => "client_limit",
            Self::TcpClientLimit => "tcp_client_limit",
            Self::TableFull => "table_full",
            Self::BackendUnreachable => "backend_unreachable",
            Self::FdExhausted => "fd_exhausted",
        }
    }
}

/// Refusals per reason: one atomic each, so a flood of refused connections
/// takes no lock and allocates nothing (they used to share one
/// `Mutex<BTreeMap<String, u64>>` and allocate a key each). Each counter on
/// its own cache line: different reasons are hit by different floods.
#[derive(Debug, Default)]
pub(crate) struct RefusalCounts([CachePadded<AtomicU64>; Refusal::ALL.len()]);

/// 128 bytes: two 64-byte lines, as the adjacent-line prefetcher pulls
/// pairs (tokio's `CachePadded` reasoning).
#[derive(Debug, Default)]
#[repr(align(128))]
struct CachePadded<T>(T);

impl RefusalCounts {
    pub(crate) fn add(&self, why: Refusal) {
        self.0[why as usize].0.fetch_add(1, Relaxed);
    }

    /// The reasons seen so far (zero counts left out), by name.
    pub(crate) fn snapshot(&self) -> BTreeMap<String, u64> {
        Refusal::ALL
            .iter()
            .filter_map(|&r| {
                let n = self.0[r as usize].0.load(Relaxed);
                (n > 0).then(|| (r.key().to_owned(), n))
            })
            .collect()
    }
}

impl Shared {
    pub(crate) fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    pub(crate) fn refuse(&self, tenant: Option<&Tenant>, why: Refusal) {
        self.refused.add(why);
        if let Some(t) = tenant {
            t.refused.fetch_add(1, Relaxed);
        }
    }

    /// The passive check: a connect to `b` failed with `why`. A streak of
    /// failures takes the backend out of `svc`'s scheduler for
    /// [`crate::health::PASSIVE_HOLD`], then it is tried again.
    pub(crate) fn connect_failed(&self, svc: &Arc<Service>, b: &Arc<Backend>, why: &str) {
        use crate::health::{PASSIVE_FALL, PASSIVE_HOLD};
        if !b.passive.on_failure() {
            return;
        }
        let n = b.passive.failures().max(PASSIVE_FALL);
        let msg = format!(
            "passive check: {n} connects in a row failed (last: {why}); out for {}s, then tried again",
            PASSIVE_HOLD.as_secs()
        );
        tracing::warn!(backend = %b.addr, "{msg}");
        *b.passive_error.lock() = Some(msg);
        svc.rebuild_sched();
        let (weak_svc, weak_b) = (Arc::downgrade(svc), Arc::downgrade(b));
        let cancel = svc.cancel.clone();
        self.control_rt.spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = tokio::time::sleep(PASSIVE_HOLD) => {
                    if let (Some(svc), Some(b)) = (weak_svc.upgrade(), weak_b.upgrade()) {
                        b.passive.restore();
                        svc.rebuild_sched();
                    }
                }
            }
        });
    }

    /// Reserve a slot for a new connection under the global and tenant
    /// limits; on success the caller must eventually call [`Self::release`].
    pub(crate) fn admit(&self, tenant: &Tenant) -> Result<(), Refusal> {
        let max = self.daemon_cfg.max_connections;
        let prev = self.active.fetch_add(1, Relaxed);
        if max != 0 && prev >= max {
            self.active.fetch_sub(1, Relaxed);
            return Err(Refusal::GlobalLimit);
        }
        let (tmax, rate) = {
            let s = tenant.spec.read();
            (s.max_connections, s.max_new_per_s)
        };
        let tprev = tenant.active.fetch_add(1, Relaxed);
        if tmax != 0 && tprev >= tmax {
            tenant.active.fetch_sub(1, Relaxed);
            self.active.fetch_sub(1, Relaxed);
            return Err(Refusal::TenantLimit);
        }
        if rate != 0
            && !tenant
                .new_conns
                .admit(self.epoch.elapsed().as_nanos() as u64, rate)
        {
            tenant.active.fetch_sub(1, Relaxed);
            self.active.fetch_sub(1, Relaxed);
            return Err(Refusal::TenantRate);
        }
        Ok(())
    }

    pub(crate) fn release(&self, tenant: &Tenant) {
        tenant.active.fetch_sub(1, Relaxed);
        self.active.fetch_sub(1, Relaxed);
    }

    /// Put a new connection or session in the flow table, owned by `owner`
    /// (counted on its backend as active when ESTABLISHED, else inactive).
    pub(crate) fn open(
        &self,
        svc: &Arc<Service>,
        backend: &Arc<Backend>,
        proto: Protocol,
        client: SocketAddr,
        state: ConnState,
        owner: &owners::Owner,
    ) -> Result<Conn, Refusal> {
        let key = flow_key(svc, proto, client);
        let params = svc.params.read().clone();
        let init = FlowInit {
            owner: owner.token(),
            profile: params.profile,
            service: ServiceId(svc.id),
            backend: BackendId(backend.id),
            state: state.flow(),
        };
        let now = Millis(self.now_ms());
        let handle = match self.table.insert_handle(key, init, now) {
            Ok(h) => h,
            Err(weir_flowtable::InsertError::Exists(_)) => {
                // A stale entry for the same 4-tuple (its task is ending):
                // settle it, tell its owner, and take the key over.
                if let Some(old) = self.table.remove(&key) {
                    self.ended(std::slice::from_ref(&old), Close::Replaced);
                }
                self.table
                    .insert_handle(key, init, now)
                    .map_err(|_| Refusal::TableFull)?
            }
            Err(_) => return Err(Refusal::TableFull),
        };
        if state == ConnState::Established {
            backend.active.fetch_add(1, Relaxed);
        } else {
            backend.inactive.fetch_add(1, Relaxed);
        }
        let template = (!params.persistence.is_zero())
            .then(|| self.hold_template(svc, &params, proto, client, backend.id));
        let conn = Conn {
            handle,
            service: svc.clone(),
            backend: backend.clone(),
            client,
            state: AtomicU8::new(state as u8),
            template,
        };
        // Told to close before it could listen (a kill racing the insert),
        // or opened while the daemon was stopping: it closes at once.
        let told = owner.bind(handle.cookie.0).err();
        if told.is_some() || self.kill_all.is_cancelled() {
            self.owners.kill(
                owner.token(),
                handle.cookie.0,
                told.unwrap_or(Close::Killed),
            );
        }
        self.stat.conn();
        svc.tenant.stat.conn();
        svc.stat.conn();
        backend.stat.conn();
        Ok(conn)
    }

    /// The task of `conn` is done with it (`reason` for the access log):
    /// remove its entry and settle it, unless the wheel or a tenant's
    /// deletion removed (and settled) it already.
    pub(crate) fn close(&self, conn: &Conn, reason: &str) {
        if let Some(snap) = self.table.remove_handle(conn.handle) {
            self.settle(&snap, &conn.service, Some(&conn.backend), reason);
        }
        if let Some(tpl) = conn.template {
            self.release_template(&conn.service, tpl);
        }
    }

    /// Entries removed by the wheel or a tenant's deletion: settle each
    /// connection and session and tell its owner to close. Returns how many
    /// owners it told.
    pub(crate) fn ended(&self, snaps: &[FlowSnapshot], why: Close) -> u64 {
        self.ended_in(snaps, why, None)
    }

    /// [`Self::ended`], for entries of `gone` too: a service already taken
    /// out of the state whose entries are being ended (its packet flows
    /// still give back their admission slots and ports).
    fn ended_in(&self, snaps: &[FlowSnapshot], why: Close, gone: Option<&Arc<Service>>) -> u64 {
        let mut services: Option<HashMap<u32, Arc<Service>>> = None;
        let mut told = 0;
        for snap in snaps {
            if packet::is_packet_owner(snap.owner) {
                // No task to tell; settled below.
                told += 1;
            } else if snap.owner != 0 && self.owners.kill(snap.owner, snap.cookie.0, why) {
                told += 1;
            }
            if snap.state == FlowState::Persist {
                continue;
            }
            let services = services.get_or_insert_with(|| {
                let st = self.state.read();
                st.services
                    .values()
                    .chain(gone)
                    .map(|s| (s.id, s.clone()))
                    .collect()
            });
            if let Some(svc) = services.get(&snap.service.0) {
                let backend = svc.backend(snap.backend.0);
                self.settle(snap, svc, backend.as_ref(), why.name());
                if packet::is_packet_owner(snap.owner) {
                    self.settle_packet(snap, svc);
                }
            }
        }
        told
    }

    /// A removed entry's last word: the backend's counts and the access log.
    fn settle(&self, snap: &FlowSnapshot, svc: &Service, b: Option<&Arc<Backend>>, reason: &str) {
        if let Some(b) = b {
            if snap.state == FlowState::Established {
                b.active.fetch_sub(1, Relaxed);
            } else {
                b.inactive.fetch_sub(1, Relaxed);
            }
        }
        if self.daemon_cfg.access_log {
            let now = self.now_ms();
            tracing::info!(
                target: "weir::access",
                tenant = %svc.tenant.spec.read().name,
                service = %svc.spec.read().name,
                proto = match snap.key.proto {
                    Proto::Tcp => "tcp",
                    Proto::Udp => "udp",
                },
                client = %snap.key.client,
                backend = %b.map_or_else(|| "-".to_owned(), |b| b.addr.to_string()),
                bytes_in = snap.bytes_in,
                bytes_out = snap.bytes_out,
                // The entry keeps its start in whole seconds.
                duration_s = now.saturating_sub(snap.created.0) / 1000,
                reason,
                "closed"
            );
        }
    }

    /// A new connection of `client` to backend `backend` holds its
    /// persistence template (which then does not expire); returns its key.
    pub(crate) fn hold_template(
        &self,
        svc: &Service,
        params: &ServiceParams,
        proto: Protocol,
        client: SocketAddr,
        backend: u32,
    ) -> FlowKey {
        let tpl = template_key(svc, params, proto, client);
        let mut live = svc.templates.lock();
        let slot = live.entry(tpl).or_insert((backend, 0));
        *slot = (backend, slot.1 + 1);
        tpl
    }

    /// Services or their backends changed: packet workers take a new
    /// snapshot, and the steering maps follow.
    pub(crate) fn services_changed(&self) {
        self.services_gen
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        if let Some(rt) = self.packet_rt.get() {
            rt.sync(self);
        }
    }

    /// One connection of template `tpl` ended; after the last one the
    /// template's timeout starts now (it is stored again if the table
    /// expired it meanwhile).
    pub(crate) fn release_template(&self, svc: &Service, tpl: FlowKey) {
        let mut live = svc.templates.lock();
        let Some(slot) = live.get_mut(&tpl) else {
            return;
        };
        slot.1 -= 1;
        if slot.1 > 0 {
            return;
        }
        let backend = slot.0;
        live.remove(&tpl);
        drop(live);
        let now = Millis(self.now_ms());
        if self.table.get(&tpl).is_some() {
            self.table.touch(&tpl, now, Dir::In, 0);
        } else {
            let init = FlowInit {
                owner: 0,
                profile: svc.params.read().profile,
                service: ServiceId(svc.id),
                backend: BackendId(backend),
                state: FlowState::Persist,
            };
            let _ = self.table.insert(tpl, init, now);
        }
    }

    /// Count `n` bytes of `conn` going `dir` (in: client → backend) in its
    /// entry and the estimators; `touch` = false when the caller's lookup
    /// counted them in the entry already.
    pub(crate) fn count(&self, conn: &Conn, dir: Dir, n: usize, touch: bool) {
        let n = n as u64;
        if touch {
            self.table
                .touch_handle(conn.handle, Millis(self.now_ms()), dir, n);
        }
        let stats = [
            &self.stat,
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

    /// Tell the owner of every entry `filter` and `pred` select to close;
    /// returns how many were told. An exact dump of the table (or of one
    /// tenant's), page by page.
    pub(crate) fn kill_where(
        &self,
        why: Close,
        filter: &DumpFilter,
        pred: impl Fn(&FlowSnapshot) -> bool,
    ) -> u64 {
        self.kill_where_in(why, filter, pred, None)
    }

    fn kill_where_in(
        &self,
        why: Close,
        filter: &DumpFilter,
        pred: impl Fn(&FlowSnapshot) -> bool,
        gone: Option<&Arc<Service>>,
    ) -> u64 {
        let mut n = 0;
        let mut cursor = None;
        let mut page = Vec::new();
        let mut removed = Vec::new();
        loop {
            page.clear();
            removed.clear();
            let next = self.table.dump(cursor.as_ref(), filter, 4096, &mut page);
            for snap in &page {
                if snap.owner == 0 || !pred(snap) {
                    continue;
                }
                if packet::is_packet_owner(snap.owner) {
                    // No task to tell: the packet path's flow ends here.
                    removed.extend(self.table.remove_cookie(&snap.key, snap.cookie));
                } else if self.owners.kill(snap.owner, snap.cookie.0, why) {
                    n += 1;
                }
            }
            n += self.ended_in(&removed, why, gone);
            match next {
                Some(c) => cursor = Some(c),
                None => return n,
            }
        }
    }

    /// [`Self::kill_where`] for one service's entries (all, or those of
    /// the backends `backends` lists).
    pub(crate) fn kill_service(
        &self,
        svc: &Arc<Service>,
        backends: Option<&[u32]>,
        why: Close,
    ) -> u64 {
        let filter = DumpFilter {
            tenant: Some(TenantId(svc.tenant.id)),
            service: Some(ServiceId(svc.id)),
            ..DumpFilter::default()
        };
        self.kill_where_in(
            why,
            &filter,
            |s| backends.is_none_or(|b| b.contains(&s.backend.0)),
            Some(svc),
        )
    }

    // -- tenants ----------------------------------------------------------

    pub(crate) fn add_tenant(&self, spec: TenantSpec) -> crate::control::ControlResult<()> {
        use crate::control::{ControlError, ErrorKind};
        if let Err(e) = config::check_name(&spec.name) {
            return Err(ControlError::new(
                ErrorKind::Invalid,
                format!("tenant name: {e}"),
            ));
        }
        if let Some((key, message)) = config::tenant_table_problems(&spec).into_iter().next() {
            return Err(ControlError::new(
                ErrorKind::Invalid,
                format!("{key}: {message}"),
            ));
        }
        let timeouts = resolve_timeouts(&spec)?;
        check_fences(&spec)?;
        let mut st = self.state.write();
        if st.tenants.contains_key(&spec.name) {
            return Err(ControlError::new(
                ErrorKind::Conflict,
                format!("tenant {:?} exists", spec.name),
            ));
        }
        let id = self.next_id.fetch_add(1, Relaxed);
        let placement = self
            .table
            .add_tenant(
                TenantId(id),
                TenantConfig {
                    own_buckets: spec.table_entries,
                    max_entries: spec.max_table_entries,
                    timeouts,
                },
            )
            .map_err(|e| ControlError::new(ErrorKind::Invalid, e.to_string()))?;
        let placement = match placement {
            weir_flowtable::Placement::Own { .. } => "own".to_owned(),
            weir_flowtable::Placement::Shared { requested, reason } => {
                if requested != 0 {
                    tracing::warn!(tenant = %spec.name, requested, %reason, "tenant shares the global flow table");
                }
                "shared".to_owned()
            }
        };
        let t = Arc::new(Tenant {
            id,
            placement,
            spec: RwLock::new(spec.clone()),
            active: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            stat: self.rates.stat(),
            new_conns: NewConnLimit::default(),
            deleted: CancellationToken::new(),
        });
        st.tenants.insert(spec.name, t);
        Ok(())
    }

    // -- services ---------------------------------------------------------

    /// Why this daemon cannot serve `spec` (a valid spec: [`check_service`]
    /// passed), or `None`. The one place that decides whether a packet
    /// service (`forward` other than proxy) may be added: every path that
    /// adds or replaces a service (start, reload, the API) asks it before
    /// opening anything, so a packet service never gets proxy sockets.
    pub(crate) fn packet_mode_unavailable(&self, spec: &ServiceSpec) -> Option<String> {
        (spec.forward.is_packet() && self.packet.get().is_none()).then(|| {
            format!(
                "forward = \"{}\" needs packet mode, and this daemon runs without it: \
                 add a [packet] section naming its interfaces and restart \
                 (or use forward = \"proxy\")",
                spec.forward
            )
        })
    }

    pub(crate) fn add_service(
        self: &Arc<Self>,
        spec: ServiceSpec,
    ) -> crate::control::ControlResult<()> {
        self.put_service(spec, false)
    }

    /// Add `spec`, or with `replace` swap it in for the live service of the
    /// same tenant and name (a new address or protocol). Every check runs
    /// and the new sockets are open before anything changes, so on any
    /// error the running service is untouched; on success the replaced
    /// service stops listening and its connections close.
    pub(crate) fn put_service(
        self: &Arc<Self>,
        spec: ServiceSpec,
        replace: bool,
    ) -> crate::control::ControlResult<()> {
        use crate::control::{ControlError, ErrorKind};
        check_service(&spec, self.packet_cfg.as_ref())?;
        if let Some(why) = self.packet_mode_unavailable(&spec) {
            return Err(ControlError::new(ErrorKind::Unavailable, why));
        }
        let params = Arc::new(service_params(&spec)?);
        // Before the state lock: the wait may take seconds, and every admin
        // request and new connection's service lookup needs that lock.
        self.wait_for_own_release(spec.protocol, spec.listen);
        let mut st = self.state.write();
        let Some(tenant) = st.tenants.get(&spec.tenant).cloned() else {
            return Err(ControlError::new(
                ErrorKind::NotFound,
                format!("tenant {:?} does not exist; create it first", spec.tenant),
            ));
        };
        let key = (spec.tenant.clone(), spec.name.clone());
        let old_id = st.services.get(&key).map(|s| s.id);
        match (old_id, replace) {
            (Some(_), false) => {
                return Err(ControlError::new(
                    ErrorKind::Conflict,
                    format!("service {}/{} exists", spec.tenant, spec.name),
                ));
            }
            (None, true) => {
                return Err(ControlError::new(
                    ErrorKind::NotFound,
                    format!("service {}/{} does not exist", spec.tenant, spec.name),
                ));
            }
            _ => {}
        }
        if spec.listen.port() != 0
            && st.services.values().any(|s| {
                Some(s.id) != old_id
                    && s.listen == spec.listen
                    && s.spec.read().protocol == spec.protocol
            })
        {
            return Err(ControlError::new(
                ErrorKind::Conflict,
                format!("{} is used by another service", spec.listen),
            ));
        }
        let packet_mode = spec.forward.is_packet();
        // Packet services own no socket: the steering program hands their
        // packets to the packet workers.
        let sockets = if packet_mode {
            (Vec::new(), spec.listen)
        } else {
            self.claim_listen(&st, spec.protocol, spec.listen)
                .and_then(|()| {
                    open_sockets(
                        spec.protocol,
                        spec.listen,
                        self.workers.len(),
                        self.daemon_cfg.notsent_lowat,
                    )
                })
                .map_err(|e| {
                    ControlError::new(
                        ErrorKind::Unavailable,
                        format!(
                            "cannot listen on {} {}: {e}",
                            config::protocol_name(spec.protocol),
                            spec.listen
                        ),
                    )
                })?
        };
        let listen = sockets.1;
        let backends: Vec<Arc<Backend>> = spec
            .backends
            .iter()
            .cloned()
            .map(|b| Backend::new(b, &self.rates))
            .collect();
        let sched = build_sched(&spec, &backends)?;
        let params = Arc::new(self.with_profile(&tenant, (*params).clone())?);
        let svc = Arc::new(Service {
            id: self.next_id.fetch_add(1, Relaxed),
            tenant,
            spec: RwLock::new(ServiceSpec {
                listen,
                ..spec.clone()
            }),
            params: RwLock::new(params),
            listen,
            set: RwLock::new(Arc::new(BackendSet { sched, backends })),
            stat: self.rates.stat(),
            cancel: CancellationToken::new(),
            udp_per_client: Mutex::new(HashMap::new()),
            tcp_per_client: Mutex::new(HashMap::new()),
            templates: Mutex::new(HashMap::new()),
            health_cancel: Mutex::new(CancellationToken::new()),
        });
        {
            let mut groups = self.listen_groups.lock();
            groups.retain(|(_, _, s)| s.strong_count() > 0);
            groups.push((spec.protocol, listen, Arc::downgrade(&svc)));
        }
        for (tx, sock) in self.workers.iter().zip(sockets.0) {
            let _ = tx.send(WorkerCmd::Listen {
                shared: self.clone(),
                service: svc.clone(),
                socket: sock,
            });
        }
        self.start_health(&svc);
        tracing::info!(tenant = %spec.tenant, service = %spec.name, %listen, "service up");
        let replaced = st.services.insert(key, svc);
        drop(st);
        self.services_changed();
        if let Some(old) = replaced {
            old.cancel.cancel();
            self.kill_service(&old, None, Close::ServiceDeleted);
        }
        Ok(())
    }

    /// Makes sure no other process serves `addr` before weir opens its
    /// `SO_REUSEPORT` group there: the kernel would let a second group of the
    /// same user join and take a share of the connections. A service of this
    /// daemon on an overlapping address (a wildcard and a specific one) is
    /// not probed. Does not wait: a just removed service's sockets are
    /// waited for by [`Self::wait_for_own_release`], without the state lock.
    ///
    /// A process that binds between this probe and the group's bind can
    /// still join it; the window is one system call wide.
    fn claim_listen(&self, st: &State, proto: Protocol, addr: SocketAddr) -> std::io::Result<()> {
        if addr.port() == 0 || serves_overlapping(st, proto, addr) {
            return Ok(());
        }
        match probe_free(proto, addr) {
            Err(err) if err.kind() == std::io::ErrorKind::AddrInUse => Err(std::io::Error::new(
                err.kind(),
                format!(
                    "{err}: another process serves this address \
                         (weir does not share a service address with other listeners)"
                ),
            )),
            r => r,
        }
    }

    /// Waits (up to 2 s) while `addr` is taken and a service of this daemon
    /// that was removed or replaced on an overlapping address still holds
    /// its sockets: its workers close them asynchronously, and deleting a
    /// service and adding one on the same address is a normal edit. Returns
    /// at once when the address is free, served by a live service, or taken
    /// by someone else; [`Self::claim_listen`] then decides. Takes the state
    /// lock only for reads between probes.
    fn wait_for_own_release(&self, proto: Protocol, addr: SocketAddr) {
        if addr.port() == 0 {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let ours_closing = self
                .listen_groups
                .lock()
                .iter()
                .any(|(p, a, s)| *p == proto && overlaps(*a, addr) && s.strong_count() > 0);
            if !ours_closing
                || serves_overlapping(&self.state.read(), proto, addr)
                || !matches!(probe_free(proto, addr), Err(e) if e.kind() == std::io::ErrorKind::AddrInUse)
                || Instant::now() >= deadline
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `params` with the number of the flow table's timeout profile for
    /// its service's own timeouts (connect, UDP, persistence) in `tenant`.
    pub(crate) fn with_profile(
        &self,
        tenant: &Tenant,
        mut params: ServiceParams,
    ) -> crate::control::ControlResult<ServiceParams> {
        let ms = |d: Duration| Millis(d.as_millis() as u64);
        let mut o = TimeoutOverrides::NONE.with(FlowState::SynRecv, ms(params.connect_timeout));
        if let Some(u) = params.udp_timeout {
            o = o.with(FlowState::Udp, ms(u));
        }
        if !params.persistence.is_zero() {
            o = o.with(FlowState::Persist, ms(params.persistence));
        }
        params.profile = self
            .table
            .timeout_profile(TenantId(tenant.id), &o)
            .map_err(|e| {
                crate::control::ControlError::new(crate::control::ErrorKind::Invalid, e.to_string())
            })?;
        Ok(params)
    }

    /// (Re)start the health checks of `svc`'s current backends.
    pub(crate) fn start_health(self: &Arc<Self>, svc: &Arc<Service>) {
        let token = svc.cancel.child_token();
        let old = std::mem::replace(&mut *svc.health_cancel.lock(), token.clone());
        old.cancel();
        let Some(h) = svc.spec.read().options.health.clone() else {
            for b in svc.set.read().backends.iter() {
                b.checked.store(false, Relaxed);
                b.up.store(true, Relaxed);
            }
            return;
        };
        let (interval, timeout) = (h.interval.get(), h.timeout.get());
        let params = crate::health::Params {
            interval,
            timeout,
            rise: h.rise,
            fall: h.fall,
            probe: match h.protocol {
                Some(Protocol::Udp) => {
                    crate::health::Probe::Udp(h.send.clone().unwrap_or_default().into_bytes())
                }
                _ => crate::health::Probe::Tcp,
            },
        };
        let _guard = self.control_rt.enter();
        for b in svc.set.read().backends.iter() {
            b.checked.store(true, Relaxed);
            let weak_shared = Arc::downgrade(self);
            let weak_svc = Arc::downgrade(svc);
            let backend = Arc::downgrade(b);
            // `port` checks another port of the same host.
            let target = SocketAddr::new(b.addr.ip(), h.port.unwrap_or(b.addr.port()));
            crate::health::spawn(target, params.clone(), token.clone(), move |up, err| {
                let (Some(shared), Some(svc), Some(b)) =
                    (weak_shared.upgrade(), weak_svc.upgrade(), backend.upgrade())
                else {
                    return;
                };
                tracing::warn!(backend = %b.addr, up, error = ?err, "health state changed");
                b.up.store(up, Relaxed);
                *b.last_error.lock() = err;
                svc.rebuild_sched();
                if !up && svc.params.read().expire_nodest_conn {
                    shared.kill_service(&svc, Some(&[b.id]), Close::BackendDown);
                }
            });
        }
    }
}

/// One open TCP connection counted against its client's
/// `tcp_max_connections_per_client`; dropping it gives the place back.
#[derive(Debug)]
pub(crate) struct ClientSlot {
    svc: Arc<Service>,
    ip: IpAddr,
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut counts = self.svc.tcp_per_client.lock();
        if let Some(n) = counts.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.ip);
            }
        }
    }
}

impl Service {
    /// The backend with id `id`, if it is still in the service's set.
    pub(crate) fn backend(&self, id: u32) -> Option<Arc<Backend>> {
        self.set
            .read()
            .backends
            .iter()
            .find(|b| b.id == id)
            .cloned()
    }

    /// A place for one more TCP connection from `client` under the
    /// service's `tcp_max_connections_per_client` (`None`: no limit, nothing
    /// counted), or [`Refusal::TcpClientLimit`]. Connections accepted while
    /// the limit was 0 are not counted when it is raised later.
    pub(crate) fn tcp_client_slot(
        self: &Arc<Self>,
        client: IpAddr,
    ) -> Result<Option<ClientSlot>, Refusal> {
        let max = self.params.read().tcp_max_per_client;
        if max == 0 {
            return Ok(None);
        }
        let ip = client.to_canonical();
        let mut counts = self.tcp_per_client.lock();
        let n = counts.entry(ip).or_insert(0);
        if *n >= max {
            return Err(Refusal::TcpClientLimit);
        }
        *n += 1;
        Ok(Some(ClientSlot {
            svc: self.clone(),
            ip,
        }))
    }

    /// One more packet flow from `client` under the cap `max` of its
    /// protocol's per-client map (the proxy's maps: a client's proxied
    /// connections and packet flows count together); false at the cap.
    pub(crate) fn take_client_place(&self, proto: Protocol, client: IpAddr, max: u64) -> bool {
        let ip = client.to_canonical();
        let mut counts = match proto {
            Protocol::Tcp => self.tcp_per_client.lock(),
            Protocol::Udp => self.udp_per_client.lock(),
        };
        let n = counts.entry(ip).or_insert(0);
        if *n >= max {
            if *n == 0 {
                counts.remove(&ip);
            }
            return false;
        }
        *n += 1;
        true
    }

    /// Give back a place [`Self::take_client_place`] took.
    pub(crate) fn give_client_place(&self, proto: Protocol, client: IpAddr) {
        let ip = client.to_canonical();
        let mut counts = match proto {
            Protocol::Tcp => self.tcp_per_client.lock(),
            Protocol::Udp => self.udp_per_client.lock(),
        };
        if let Some(n) = counts.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&ip);
            }
        }
    }

    /// Rebuild the scheduler from the backends' current weight and health.
    pub(crate) fn rebuild_sched(&self) {
        let mut set = self.set.write();
        let infos: Vec<BackendInfo> = set.backends.iter().map(|b| b.info()).collect();
        match set.sched.rebuild(&infos) {
            Ok(sched) => {
                *set = Arc::new(BackendSet {
                    sched,
                    backends: set.backends.clone(),
                })
            }
            Err(e) => tracing::error!("scheduler rebuild failed: {e}"),
        }
    }

    /// Choose a backend for `client`, honouring persistence and backend
    /// limits; `skip` lists backends that already failed for this connection.
    /// `local` is the address the client connected to (the service's
    /// address unless it listens on a wildcard one), the destination that
    /// `lblc`, `lblcr` and `dh` key on.
    pub(crate) fn choose(
        &self,
        shared: &Shared,
        proto: Protocol,
        client: SocketAddr,
        local: IpAddr,
        skip: &[SocketAddr],
        rng: &mut weir_sched::SplitMix64,
    ) -> Result<Arc<Backend>, Refusal> {
        let set = self.set.read().clone();
        let params = self.params.read().clone();
        let usable = |b: &Backend| {
            let max = b.spec.read().max_connections;
            b.up.load(Relaxed)
                && !b.passive.is_down()
                && b.weight.load(Relaxed) > 0
                && !skip.contains(&b.addr)
                && (max == 0 || b.conns() < max)
        };
        let now = shared.now_ms();
        let persist_ms = params.persistence.as_millis() as u64;
        let tpl_key = template_key(self, &params, proto, client);
        // A template with live connections holds whatever its age.
        let held = (persist_ms > 0)
            .then(|| self.templates.lock().get(&tpl_key).map(|&(id, _)| id))
            .flatten();
        if let Some(id) = held
            && let Some(b) = set.backends.iter().find(|b| b.id == id)
            && usable(b)
        {
            return Ok(b.clone());
        }
        if persist_ms > 0
            && let Some(tpl) = shared.table.get(&tpl_key)
            && tpl.state == FlowState::Persist
            && tpl.last_active.0 + persist_ms > now
            && let Some(b) = set.backends.iter().find(|b| b.id == tpl.backend.0)
            && usable(b)
        {
            shared.table.touch(&tpl_key, Millis(now), Dir::In, 0);
            return Ok(b.clone());
        }
        let load = |i: usize| {
            set.backends.get(i).map_or(Load::default(), |b| {
                Load::new(b.active.load(Relaxed), b.inactive.load(Relaxed))
            })
        };
        // `sh` / `mh` without fallback place a client on one backend only,
        // `dh` a destination, and `ovf` refuses when every backend is full:
        // when the choice cannot take it (down, weight 0, at its limit, or it
        // already failed this connection) the client is refused, as
        // docs/sched.md says, instead of piling every displaced client onto
        // the first usable backend.
        let cfg = set.sched.config();
        let pinned = cfg.pinned();
        // Another backend when the scheduler's cannot serve: `fo` keeps its
        // rule (the highest usable weight); the others take the next usable
        // one in list order from `start`.
        let substitute = |start: usize| {
            if cfg.kind == weir_sched::SchedulerKind::Fo {
                return set.backends.iter().filter(|b| usable(b)).fold(
                    None::<&Arc<Backend>>,
                    |best, b| match best {
                        Some(x) if x.weight.load(Relaxed) >= b.weight.load(Relaxed) => best,
                        _ => Some(b),
                    },
                );
            }
            let n = set.backends.len();
            (0..n)
                .map(|k| &set.backends[(start + k) % n])
                .find(|b| usable(b))
        };
        let picked = match skip.last() {
            // A retry after a failed connect: the next usable backend after
            // the one that failed, in list order, without asking the
            // scheduler, so a retry does not move rr's rotation (which would
            // put the failing backend first again for the next client).
            Some(&failed) if !pinned => {
                let at = set.backends.iter().position(|b| b.addr == failed);
                substitute(at.map_or(0, |i| i + 1))
            }
            _ => {
                let req = weir_sched::Request::new(client, local, Duration::from_millis(now));
                match set
                    .sched
                    .pick_for(req, &load, rng)
                    .and_then(|i| set.backends.get(i))
                {
                    Some(b) if usable(b) => Some(b),
                    _ if pinned => None,
                    _ => substitute(0),
                }
            }
        }
        .cloned();
        let Some(b) = picked else {
            let any_full = set.backends.iter().any(|b| {
                let max = b.spec.read().max_connections;
                max != 0 && b.conns() >= max
            });
            return Err(if any_full {
                Refusal::BackendLimit
            } else {
                Refusal::NoBackend
            });
        };
        if persist_ms > 0 {
            // The template (IPVS -p): client group -> backend, FlowState::Persist.
            shared.table.remove(&tpl_key);
            let init = FlowInit {
                owner: 0,
                profile: params.profile,
                service: ServiceId(self.id),
                backend: BackendId(b.id),
                state: FlowState::Persist,
            };
            if shared.table.insert(tpl_key, init, Millis(now)).is_err() {
                tracing::debug!("persistence template not stored (table full)");
            }
        }
        Ok(b)
    }
}

/// The flow-table key of the persistence template for `client` (IPVS: the
/// client group, port 0).
fn template_key(
    svc: &Service,
    params: &ServiceParams,
    proto: Protocol,
    client: SocketAddr,
) -> FlowKey {
    FlowKey {
        client: SocketAddr::new(params.mask.group(client.ip()), 0),
        ..flow_key(svc, proto, client)
    }
}

/// The flow-table key of a connection or session.
pub(crate) fn flow_key(svc: &Service, proto: Protocol, client: SocketAddr) -> FlowKey {
    FlowKey {
        tenant: TenantId(svc.tenant.id),
        proto: match proto {
            Protocol::Tcp => Proto::Tcp,
            Protocol::Udp => Proto::Udp,
        },
        client,
        virt: svc.listen,
    }
}

/// A tenant's `allowed_listen` / `allowed_backends` entries all parse, or
/// an Invalid error naming every bad one.
pub(crate) fn check_fences(spec: &TenantSpec) -> crate::control::ControlResult<()> {
    let mut errors = Vec::new();
    for (key, list) in [
        ("allowed_listen", &spec.allowed_listen),
        ("allowed_backends", &spec.allowed_backends),
    ] {
        if let Err(e) = config::parse_fence(key, list) {
            errors.extend(e);
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(crate::control::ControlError::new(
            crate::control::ErrorKind::Invalid,
            errors.join("; "),
        ))
    }
}

/// A tenant's `[tenant.timeouts]` for the flow table, or an Invalid error
/// naming every bad key.
pub(crate) fn resolve_timeouts(spec: &TenantSpec) -> crate::control::ControlResult<Timeouts> {
    spec.timeouts.resolve().map_err(|errors| {
        let list: Vec<String> = errors
            .iter()
            .map(|(key, message)| format!("timeouts.{key}: {message}"))
            .collect();
        crate::control::ControlError::new(crate::control::ErrorKind::Invalid, list.join("; "))
    })
}

pub(crate) fn service_params(spec: &ServiceSpec) -> crate::control::ControlResult<ServiceParams> {
    use crate::control::{ControlError, ErrorKind};
    let bad = |m: String| ControlError::new(ErrorKind::Invalid, m);
    let persistence = spec.persistence.get();
    let mask = match &spec.persistence_netmask {
        Some(m) => {
            let n = config::parse_netmask(m).map_err(bad)?;
            AffinityMask::new(n.v4_prefix, n.v6_prefix)
                .map_err(|e| ControlError::new(ErrorKind::Invalid, e.to_string()))?
        }
        None => AffinityMask::new(32, 128)
            .map_err(|e| ControlError::new(ErrorKind::Invalid, e.to_string()))?,
    };
    let o = &spec.options;
    let connect_timeout = o
        .connect_timeout
        .as_ref()
        .map_or(CONNECT_TIMEOUT, |t| t.get());
    let udp_timeout = o.udp_timeout.as_ref().map(|t| t.get());
    Ok(ServiceParams {
        persistence,
        mask,
        connect_timeout,
        expire_nodest_conn: o.expire_nodest_conn,
        udp_timeout,
        udp_responses: o.udp_responses,
        udp_max_per_client: o.udp_max_sessions_per_client,
        tcp_max_per_client: o.tcp_max_connections_per_client,
        profile: 0,
    })
}

pub(crate) fn build_sched(
    spec: &ServiceSpec,
    backends: &[Arc<Backend>],
) -> crate::control::ControlResult<Scheduler> {
    use crate::control::{ControlError, ErrorKind};
    let kind = spec.scheduler;
    let seed = match &spec.options.hash_seed {
        Some(text) => HashSeed::from_text(text),
        None => HashSeed::from_text(&format!("{}/{}", spec.tenant, spec.name)),
    };
    let o = &spec.options;
    let mut cfg = SchedConfig::new(kind, seed);
    // `weir check` refuses each flag on a scheduler it does not apply to.
    cfg.fallback = o.mh_fallback || o.sh_fallback;
    cfg.hash_port = o.mh_port || o.sh_port;
    if let Some(size) = o.mh_table_size {
        cfg.mh_table_size = weir_sched::MhTableSize::new(size)
            .map_err(|e| ControlError::new(ErrorKind::Invalid, e.to_string()))?;
    }
    let infos: Vec<BackendInfo> = backends.iter().map(|b| b.info()).collect();
    Scheduler::new(cfg, &infos).map_err(|e| ControlError::new(ErrorKind::Invalid, e.to_string()))
}

// ---------------------------------------------------------------------------
// Sockets and workers
// ---------------------------------------------------------------------------

#[derive(Debug)]
pub(crate) enum ListenSocket {
    Tcp(std::net::TcpListener),
    Udp(std::net::UdpSocket),
}

/// Whether two service addresses of one protocol take the same port (the
/// same address, or one of them a wildcard of the same family).
fn overlaps(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port()
        && a.is_ipv6() == b.is_ipv6()
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

/// Whether a live service of `proto` listens on an address overlapping `addr`.
fn serves_overlapping(st: &State, proto: Protocol, addr: SocketAddr) -> bool {
    st.services
        .values()
        .any(|s| overlaps(s.listen, addr) && s.spec.read().protocol == proto)
}

/// Binds `addr` once without `SO_REUSEPORT` (and, for UDP, without
/// `SO_REUSEADDR`), and lets go: `AddrInUse` means some socket serves it.
/// A TCP probe keeps `SO_REUSEADDR`, so connections of an earlier run left
/// in TIME_WAIT do not count, while any listener does.
pub(crate) fn probe_free(proto: Protocol, addr: SocketAddr) -> std::io::Result<()> {
    use socket2::{Domain, Socket, Type};
    let domain = Domain::for_address(addr);
    let s = match proto {
        Protocol::Tcp => {
            let s = Socket::new(domain, Type::STREAM, Some(socket2::Protocol::TCP))?;
            s.set_reuse_address(true)?;
            s
        }
        Protocol::Udp => Socket::new(domain, Type::DGRAM, Some(socket2::Protocol::UDP))?,
    };
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
    }
    s.bind(&addr.into())
}

/// One `SO_REUSEPORT` socket per worker on `addr`; port 0 is resolved by
/// the first socket and reused by the others.
/// `n` sockets bound to `addr` with `SO_REUSEPORT` (one per worker); TCP
/// ones get the options accepted sockets inherit (`notsent_lowat` as in
/// `[daemon]`).
pub(crate) fn open_sockets(
    proto: Protocol,
    addr: SocketAddr,
    n: usize,
    notsent_lowat: u32,
) -> std::io::Result<(Vec<ListenSocket>, SocketAddr)> {
    use socket2::{Domain, Socket, Type};
    let mut out = Vec::with_capacity(n);
    let mut bound = addr;
    for _ in 0..n.max(1) {
        let domain = Domain::for_address(bound);
        let s = match proto {
            Protocol::Tcp => Socket::new(domain, Type::STREAM, Some(socket2::Protocol::TCP))?,
            Protocol::Udp => Socket::new(domain, Type::DGRAM, Some(socket2::Protocol::UDP))?,
        };
        s.set_reuse_address(true)?;
        s.set_reuse_port(true)?;
        s.set_nonblocking(true)?;
        if bound.is_ipv6() {
            s.set_only_v6(true)?;
        }
        s.bind(&bound.into())?;
        if bound.port() == 0 {
            bound = s
                .local_addr()?
                .as_socket()
                .ok_or_else(|| std::io::Error::other("no local address"))?;
        }
        match proto {
            Protocol::Tcp => {
                tcp::tune_listener(&s, notsent_lowat)?;
                s.listen(4096)?;
                out.push(ListenSocket::Tcp(s.into()));
            }
            Protocol::Udp => out.push(ListenSocket::Udp(s.into())),
        }
    }
    Ok((out, bound))
}

/// See `worker_main`.
const HEARTBEAT: Duration = Duration::from_millis(500);

#[derive(Debug)]
enum WorkerCmd {
    Listen {
        shared: Arc<Shared>,
        service: Arc<Service>,
        socket: ListenSocket,
    },
}

async fn worker_main(mut rx: mpsc::UnboundedReceiver<WorkerCmd>, stop: CancellationToken) {
    // Keeps a timer due within half a second. Tokio wakes its driver (a
    // write to an eventfd, and an epoll_wait that returns at once) whenever
    // a new timer is due before every timer it parked with; without this,
    // each new connection's connect timeout was such a timer whenever no
    // other connect was pending: one extra syscall and wake-up per
    // connection, for two wake-ups a second here.
    tokio::spawn(async {
        let mut beat = tokio::time::interval(HEARTBEAT);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            beat.tick().await;
        }
    });
    loop {
        let cmd = tokio::select! {
            _ = stop.cancelled() => return,
            c = rx.recv() => match c { Some(c) => c, None => return },
        };
        match cmd {
            WorkerCmd::Listen {
                shared,
                service,
                socket,
            } => match socket {
                ListenSocket::Tcp(l) => match tokio::net::TcpListener::from_std(l) {
                    Ok(l) => {
                        tokio::spawn(tcp::accept_loop(shared, service, l));
                    }
                    Err(e) => tracing::error!("cannot register listener: {e}"),
                },
                ListenSocket::Udp(s) => match tokio::net::UdpSocket::from_std(s) {
                    Ok(s) => {
                        tokio::spawn(udp::recv_loop(shared, service, Arc::new(s)));
                    }
                    Err(e) => tracing::error!("cannot register UDP socket: {e}"),
                },
            },
        }
    }
}

/// Seed for a worker-local p2c generator.
pub(crate) fn rng_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn new_conn_limit_passes_a_second_worth_then_one_per_step() {
        let l = NewConnLimit::default();
        let t0 = 5_000 * MS;
        // From idle: exactly `rate` at one instant.
        assert_eq!((0..250).filter(|_| l.admit(t0, 100)).count(), 100);
        // Then one every 10 ms, not before.
        assert!(!l.admit(t0 + 9 * MS, 100));
        assert!(l.admit(t0 + 10 * MS, 100));
        assert!(!l.admit(t0 + 10 * MS, 100));
        assert!(l.admit(t0 + 20 * MS, 100));
        // A full second idle refills it.
        assert_eq!(
            (0..250).filter(|_| l.admit(t0 + 2_000 * MS, 100)).count(),
            100
        );
    }

    #[test]
    fn new_conn_limit_bounds_every_span() {
        // Offered: 10 per ms for 3 s at rate 1,000/s. Every span of L ms
        // admits at most rate x (1 + L/1000), and the total is one burst
        // plus the rate over the time.
        let (l, rate) = (NewConnLimit::default(), 1_000);
        let mut per_ms = Vec::new();
        for ms in 0..3_000u64 {
            per_ms.push((0..10).filter(|_| l.admit(ms * MS, rate)).count() as u64);
        }
        let total: u64 = per_ms.iter().sum();
        assert!((rate + 2_999..=rate + 3_000).contains(&total), "{total}");
        for len in [1usize, 10, 100, 1_000] {
            for w in per_ms.windows(len) {
                let n: u64 = w.iter().sum();
                assert!(n <= rate + rate * len as u64 / 1_000 + 1, "{n} in {len} ms");
            }
        }
    }

    #[test]
    fn new_conn_limit_is_exact_across_threads() {
        let l = std::sync::Arc::new(NewConnLimit::default());
        let admitted: u64 = (0..4)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || (0..10_000).filter(|_| l.admit(MS, 777)).count() as u64)
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .sum();
        assert_eq!(admitted, 777);
    }

    /// Adding a service on the address of one this daemon just removed waits
    /// (up to 2 s) for the old sockets to close; meanwhile the state lock,
    /// which every admin request needs, stays free. It used to be held for
    /// the whole wait.
    #[test]
    fn add_service_waits_for_a_removed_address_without_the_state_lock() {
        use crate::config::{Config, ServiceOptions, ServiceSpec};
        use crate::control::ErrorKind;
        let mut cfg = Config::default();
        cfg.daemon.workers = 1;
        let d = Daemon::start(cfg, None).unwrap();
        let spec = |name: &str, listen: SocketAddr| ServiceSpec {
            tenant: "default".into(),
            name: name.into(),
            protocol: Protocol::Tcp,
            listen,
            forward: Default::default(),
            scheduler: weir_sched::SchedulerKind::Rr,
            persistence: "0s".parse().unwrap(),
            persistence_netmask: None,
            options: ServiceOptions::default(),
            backends: Vec::new(),
        };
        let shared = d.shared.clone();
        shared
            .add_service(spec("old", "127.0.0.1:0".parse().unwrap()))
            .unwrap();
        let key = ("default".to_string(), "old".to_string());
        let addr = shared.state.read().services[&key].listen;
        // Remove it, but keep it alive the way a worker still closing its
        // listener does; and take its address meanwhile, standing in for
        // that listener.
        let old = shared.state.write().services.remove(&key).unwrap();
        old.cancel.cancel();
        let deadline = Instant::now() + Duration::from_secs(10);
        let holder = loop {
            if let Ok(l) = std::net::TcpListener::bind(addr) {
                break l;
            }
            assert!(Instant::now() < deadline, "the old listener never closed");
            std::thread::sleep(Duration::from_millis(10));
        };
        let adder = {
            let shared = shared.clone();
            std::thread::spawn(move || shared.add_service(spec("new", addr)))
        };
        // Bounded by the adder's own 2 s limit (and this deadline).
        let deadline = Instant::now() + Duration::from_secs(10);
        while !adder.is_finished() {
            assert!(
                shared
                    .state
                    .try_write_for(Duration::from_millis(500))
                    .is_some(),
                "the state lock was held while add_service waited"
            );
            assert!(Instant::now() < deadline, "add_service did not return");
        }
        let err = adder.join().unwrap().unwrap_err();
        assert_eq!(err.kind, ErrorKind::Unavailable, "{err:?}");
        // Once the address is free, the same add goes through.
        drop(holder);
        drop(old);
        shared.add_service(spec("new", addr)).unwrap();
        d.shutdown();
    }
}

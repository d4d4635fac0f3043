//! The live daemon: workers, listeners, the proxy data path and the control
//! state the admin API reads and changes.
//!
//! # Shape
//!
//! * **Workers.** `daemon.workers` OS threads (default: the CPUs available),
//!   each running its own current-thread tokio runtime. Every TCP and UDP
//!   service has one `SO_REUSEPORT` socket *per worker*, so no accept queue
//!   is shared: the kernel spreads UDP clients by its hash, and new TCP
//!   connections go to the workers [`steering`] picks (by default the
//!   fewest that keep up).
//!   Sockets are created on the control side (so "address in use" is reported
//!   synchronously to the caller of `add_service`) and handed to each worker
//!   through its command channel.
//! * **Live state, in parts with one job each.** [`Shared`] ties them
//!   together: [`model`] (tenants, services, backends and their schedulers),
//!   [`admission`] (limits and refusals), [`accounting`] (counters and rate
//!   estimators) and [`conns`] (the flow table and the owners of its
//!   entries). Tenants and services are an immutable snapshot (arc-swap)
//!   that readers load without a lock and writers copy, change and publish
//!   under one writers' lock (batches of adds and removals make one copy);
//!   each service holds its backend set and its scheduler behind an
//!   `RwLock<Arc<..>>` that a new connection clones once, so edits apply to
//!   the next connection and never disturb established ones.
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

mod accounting;
mod admission;
mod clock;
mod conns;
mod control_impl;
#[cfg(test)]
mod control_model;
mod liveness;
mod model;
pub(crate) mod owners;
mod packet;
mod packet_run;
mod ratelog;
mod stats;
mod steering;
mod tcp;
mod udp;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use weir_flowtable::{FlowSnapshot, FlowTable, Millis, TableConfig};

use crate::config::{
    self, Config, DEFAULT_TENANT, DaemonConfig, Protocol, ServiceSpec, TenantSpec,
};
use crate::control::Control;
use accounting::Accounting;
use admission::{Admission, ClientSlot, NewConnLimit, Refusal};
use conns::{Conn, ConnState, Conns};
use model::{
    Backend, BackendSet, Model, Service, Tenant, build_sched, check_fences, flow_key,
    resolve_timeouts, service_params, template_key,
};
use owners::Close;

pub use liveness::{LivenessCheck, STALL};

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
        mut config: Config,
        config_path: Option<PathBuf>,
        attach: bool,
    ) -> anyhow::Result<DaemonHandle> {
        // A config built in code: its backends' addresses as a file's are
        // read (`BackendSpec::address`).
        for s in &mut config.services {
            s.canonicalise_backends();
        }
        let problems = config::validate(&config);
        if !problems.is_empty() {
            let list: Vec<String> = problems
                .iter()
                .map(|p| format!("{}: {}", p.path, p.message))
                .collect();
            anyhow::bail!("invalid configuration:\n  {}", list.join("\n  "));
        }
        let (fd_soft, fd_hard) = raise_nofile();
        // Opens the handle `open_fds` keeps, before any exhaustion.
        open_fds();
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

        let steering = Arc::new(steering::Steering::new(
            config.daemon.accept_steering,
            workers,
        ));
        let mut worker_txs = Vec::with_capacity(workers);
        let mut threads = Vec::with_capacity(workers + 1);
        let stop_workers = CancellationToken::new();
        let liveness = Arc::new(liveness::Liveness::default());
        // Each worker says whether its runtime was built (its epoll and
        // event descriptors): start returns once all were, or fails.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        for i in 0..workers {
            let (tx, rx) = mpsc::unbounded_channel();
            worker_txs.push(tx);
            let stop = stop_workers.clone();
            let steer = steering.clone();
            let name = format!("weir-worker-{i}");
            let beat = liveness.register(name.clone());
            let ready = ready_tx.clone();
            let t = std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    // However the thread ends (a return, a panic), the
                    // watchdog learns it.
                    let _alive = liveness::guard(&beat);
                    let mut rt = tokio::runtime::Builder::new_current_thread();
                    rt.enable_all();
                    if steer.can_steer() {
                        // The share of time each worker runs: what accept
                        // steering decides by (`steering`). Two clock reads
                        // per wait for events when adaptive (one relaxed
                        // load when spread), none per connection.
                        let (a, b) = (steer.clone(), steer.clone());
                        rt.on_thread_unpark(move || a.unparked(i))
                            .on_thread_park(move || b.parked(i));
                        steer.unparked(i);
                    }
                    let rt = match rt.build() {
                        Ok(rt) => rt,
                        Err(e) => {
                            let _ = ready.send(Err(format!("worker {i}: {e}")));
                            return;
                        }
                    };
                    let _ = ready.send(Ok(()));
                    drop(ready);
                    stats::set_worker_index(i);
                    rt.block_on(worker_main(rx, stop, beat));
                })
                .context("spawning a worker thread")?;
            threads.push(t);
        }
        drop(ready_tx);
        // Before anything else takes descriptors: a worker whose runtime
        // could not be built would never accept, while start said it ran
        // (found as a flaky test: at descriptor exhaustion right after
        // start, a late worker thread found none).
        let mut failed = None;
        for _ in 0..workers {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    failed.get_or_insert(e);
                }
                Err(_) => {
                    failed.get_or_insert_with(|| "a worker thread ended first".to_owned());
                    break;
                }
            }
        }
        if let Some(e) = failed {
            stop_workers.cancel();
            drop(worker_txs);
            for t in threads {
                let _ = t.join();
            }
            anyhow::bail!("building the workers' runtimes: {e}");
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
            model: Model::new(),
            admission: Admission::new(config.daemon.max_connections, fd_soft),
            accounting: Accounting::new(rates),
            conns: Conns::new(
                FlowTable::new(TableConfig {
                    shared_buckets: config.daemon.shared_table_entries,
                    max_shared_entries: config.daemon.max_shared_table_entries,
                    memory_budget: config.daemon.own_tables_budget,
                    ..TableConfig::default()
                }),
                workers,
            ),
            workers: worker_txs,
            steering: steering.clone(),
            control_rt: control_rt.handle().clone(),
            clock: clock::Clock::start(),
            access_log: AtomicBool::new(config.daemon.access_log),
            drain_timeout: parking_lot::Mutex::new(config.daemon.drain_timeout.clone()),
            tuning: Tuning::new(&config.daemon),
            reserved_tokens: ReservedTokens::default(),
            packet: std::sync::OnceLock::new(),
            packet_rt: std::sync::OnceLock::new(),
            liveness,
        });
        // From here on a handle owns what runs: on any error below,
        // dropping it stops the workers (closing the listeners of the
        // services added so far), the threads and the control runtime. An
        // early return used to leave them running: the workers' listen
        // tasks hold the state, which holds the workers' channels, so
        // nothing ever stopped them (for a library caller; the binary
        // exits on a failed start).
        if steering.can_steer() {
            control_rt.spawn(steering.clone().run());
        }
        let mut handle = DaemonHandle {
            shared: Arc::clone(&shared),
            control_rt: Some(control_rt),
            threads,
            stop_workers,
            est_stop: Arc::new(AtomicBool::new(false)),
        };
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
        // All in one change of the model and of the flow table's tenant
        // directory (one copy of each, not one per tenant); the first
        // tenant that cannot be added fails the start.
        if let Some((_, e)) = shared.add_tenants(tenants).into_iter().next() {
            anyhow::bail!("{e}");
        }
        // All in one change of the model (one copy of it, not one per
        // service); the first service that cannot be added fails the start.
        if let Some((_, e)) = shared
            .add_services(config.services.clone(), true)
            .into_iter()
            .next()
        {
            anyhow::bail!("{}", e.message);
        }
        let est_stop = handle.est_stop.clone();
        if let Some(p) = config.packet.as_ref().filter(|_| attach) {
            let (rt, pkt_threads) = packet_run::start(&shared, p, workers, est_stop.clone())?;
            handle.threads.extend(pkt_threads);
            rt.sync(&shared);
            let _ = shared.packet_rt.set(rt);
        }
        // Flow-table expiry: bounded work per step, once a second.
        {
            let weak = Arc::downgrade(&shared);
            let stop = est_stop.clone();
            handle.threads.push(
                std::thread::Builder::new()
                    .name("weir-expiry".into())
                    .spawn(move || expiry_main(weak, stop))
                    .context("spawning the expiry thread")?,
            );
        }
        // Estimator thread: placed (CPU, nice) and calibrated before start
        // returns, so a bad `estimator_cpu` fails the start.
        {
            let rates = shared.accounting.rates.clone();
            let stop = est_stop.clone();
            let placement = stats::Placement {
                cpu: config.daemon.estimator_cpu,
                nice: config.daemon.estimator_nice,
            };
            let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
            handle.threads.push(
                std::thread::Builder::new()
                    .name("weir-estimator".into())
                    .spawn(move || stats::estimator_main(rates, stop, placement, ready_tx))
                    .context("spawning the estimator thread")?,
            );
            let started = ready_rx
                .recv()
                .map_err(|_| anyhow::anyhow!("the estimator thread ended before starting"))
                .and_then(|r| r.map_err(|e| anyhow::anyhow!("{e}")));
            // On an error the handle stops what was started.
            let s = started?;
            let _ = shared
                .accounting
                .estimator
                .set(stats::EstimatorThread::new(&s, placement));
            tracing::info!(
                tid = s.tid,
                cpu = ?placement.cpu,
                nice = ?placement.nice.filter(|_| s.nice_applied),
                cost_ns = s.cost_ns,
                "rate estimator calibrated"
            );
        }
        Ok(handle)
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

    /// How many API edits wait for the edits lock now (tests elsewhere in
    /// the crate watch it to know an edit is held up).
    #[cfg(test)]
    pub(crate) fn edits_waiting(&self) -> usize {
        self.shared.model.edits_waiting.load(Relaxed)
    }

    /// The address a service actually listens on (port 0 resolved).
    pub fn service_addr(&self, tenant: &str, name: &str) -> Option<SocketAddr> {
        self.shared
            .model
            .load()
            .services
            .get(&(tenant.to_owned(), name.to_owned()))
            .map(|s| s.listen)
    }

    /// What the systemd watchdog is fed on: whether every proxy and packet
    /// worker thread runs and turns (see [`LivenessCheck::check`]).
    pub fn liveness_check(&self) -> LivenessCheck {
        LivenessCheck::new(self.shared.liveness.clone(), STALL)
    }

    /// A handle of the control-plane runtime (for the admin API, signals).
    pub fn runtime(&self) -> tokio::runtime::Handle {
        self.shared.control_rt.clone()
    }

    /// Debug builds only, for the tests of the `weir run` binary: with
    /// `WEIR_TEST_HOOKS=1` in the environment, each SIGUSR2 ends proxy
    /// worker 0's thread as a dead worker's ends (what the systemd
    /// watchdog test needs). Without it, and in release builds, nothing.
    #[cfg(debug_assertions)]
    #[doc(hidden)]
    pub fn install_test_hooks(&self) {
        use tokio::signal::unix::{SignalKind, signal};
        if std::env::var_os("WEIR_TEST_HOOKS").is_none_or(|v| v != "1") {
            return;
        }
        let Some(worker) = self.shared.workers.first().cloned() else {
            return;
        };
        let rt = self.runtime();
        // Registered here, before the caller says it is ready.
        let usr2 = {
            let _in = rt.enter();
            signal(SignalKind::user_defined2())
        };
        let mut usr2 = match usr2 {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("WEIR_TEST_HOOKS: SIGUSR2: {e}");
                return;
            }
        };
        tracing::warn!("WEIR_TEST_HOOKS=1: SIGUSR2 ends worker 0's thread");
        rt.spawn(async move {
            while usr2.recv().await.is_some() {
                let _ = worker.send(WorkerCmd::Exit);
            }
        });
    }

    /// Live connections + sessions.
    pub fn active_connections(&self) -> u64 {
        self.shared.admission.active.load(Relaxed)
    }

    /// Stop accepting (a listener first takes the connections the kernel
    /// had already completed, its accept queue, and serves them: closing it
    /// would reset them); let connections, and the lingering closes of a
    /// deleted service's queued ones, finish for up to `timeout`; then
    /// close the rest and stop. Returns how many were closed forcibly.
    pub fn drain(self, timeout: Duration) -> u64 {
        self.drain_until(timeout, &AtomicBool::new(false))
    }

    /// [`Self::drain`], ended early (within 50 ms) once `abort` is set, e.g.
    /// by a second signal.
    pub fn drain_until(mut self, timeout: Duration, abort: &AtomicBool) -> u64 {
        self.shared.admission.stop_accept.cancel();
        // No deadline if `timeout` overflows the clock (validation bounds
        // it to a day; a caller may pass anything).
        let deadline = Instant::now().checked_add(timeout);
        let admission = &self.shared.admission;
        // The listeners first (Acquire: what one admitted or began closing
        // before it closed is in `active` or `closing`), then the
        // connections and a removed service's lingering closes.
        let left = || {
            admission.active.load(Relaxed)
                + admission.closing.load(std::sync::atomic::Ordering::Acquire)
        };
        while (admission
            .listeners
            .load(std::sync::atomic::Ordering::Acquire)
            > 0
            || left() > 0)
            && deadline.is_none_or(|d| Instant::now() < d)
            && !abort.load(Relaxed)
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        let left = left();
        self.stop();
        left
    }

    /// The drain timeout from `[daemon]`.
    pub fn drain_timeout(&self) -> Duration {
        self.shared.drain_timeout.lock().get()
    }

    /// Close everything now and stop.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        // The threads end now, and that is no reason to stop feeding the
        // watchdog.
        self.shared.liveness.stopping();
        self.shared.admission.stop_accept.cancel();
        self.shared.conns.kill_all.cancel();
        self.shared.conns.owners.kill_all(Close::Killed);
        // Health checks and admin tasks run on the control runtime.
        for svc in self.shared.model.load().services.values() {
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
        max_services: 0,
        max_backends: 0,
        min_health_interval: None,
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

/// The process's open descriptors, counted through one handle on
/// /proc/self/fd kept open for it (the first call opens it; the daemon's
/// start makes that call). Opening the directory at every call would take
/// the lowest free descriptor: at fd exhaustion, the very one an ended UDP
/// session just gave back for the next datagram. 0 if /proc cannot be read.
pub(crate) fn open_fds() -> u64 {
    use nix::dir::Dir;
    use nix::fcntl::OFlag;
    use nix::sys::stat::Mode;
    static DIR: parking_lot::Mutex<Option<Dir>> = parking_lot::Mutex::new(None);
    let mut dir = DIR.lock();
    if dir.is_none() {
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
        *dir = Dir::open("/proc/self/fd", flags, Mode::empty()).ok();
    }
    let Some(dir) = dir.as_mut() else {
        return 0;
    };
    // The iterator rewinds the directory when dropped: each call reads the
    // table afresh.
    dir.iter()
        .filter_map(Result::ok)
        .filter(|e| !matches!(e.file_name().to_bytes(), b"." | b".."))
        .count() as u64
}

/// Expire idle flow-table entries (bounded work per call), settle them and
/// tell their owners to close: one round a second.
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
        let table = &shared.conns.table;
        let clock = || Millis(shared.now_ms());
        expire_round(table, clock, EXPIRY_ROUND_BUDGET, &mut out, |gone| {
            shared.ended(gone, Close::IdleTimeout);
        });
    }
}

/// The time one expiry round may work (a quarter of one core at most,
/// on its own thread): the table's calls are bounded, and the round calls
/// again while entries come out or a shortened timeout is being applied
/// (a retime pass), so millions of flows whose timeout passed together go
/// within seconds, not at a fixed count per second (it was 64 Ki per
/// second: 10M flows took 2.5 minutes past their deadline).
const EXPIRY_ROUND_BUDGET: Duration = Duration::from_millis(250);

/// Entries per expiry call.
const EXPIRY_BATCH: usize = 4096;

/// One expiry round: calls the table's bounded `expire` (at `clock()`)
/// until nothing is due and no retime pass runs, or `budget` is spent (the
/// rest waits for the next round), handing each batch to `ended`. Returns
/// how many entries it removed.
fn expire_round(
    table: &FlowTable,
    clock: impl Fn() -> Millis,
    budget: Duration,
    out: &mut Vec<FlowSnapshot>,
    mut ended: impl FnMut(&[FlowSnapshot]),
) -> u64 {
    let start = Instant::now();
    let mut removed = 0;
    loop {
        out.clear();
        let n = table.expire(clock(), EXPIRY_BATCH, out);
        ended(out);
        removed += n as u64;
        if (n == 0 && !table.retiming()) || start.elapsed() >= budget {
            return removed;
        }
    }
}

// ---------------------------------------------------------------------------
// Live state
// ---------------------------------------------------------------------------

/// The daemon's live state, in parts with one job each. `Shared` only ties
/// them together: the configuration the daemon started with, the workers'
/// command channels, the control runtime, the clock and packet mode. An
/// operation that needs several parts (opening a connection: the model's
/// service, the table, the counters) is a method of `Shared`, kept in the
/// module of the part whose job it mostly is.
#[derive(Debug)]
pub(crate) struct Shared {
    config_path: Option<PathBuf>,
    pub(crate) daemon_cfg: DaemonConfig,
    admin_cfg: crate::config::AdminConfig,
    /// `[packet]` as the daemon started with it (a reload cannot change it).
    pub(crate) packet_cfg: Option<config::PacketConfig>,
    /// Tenants, services and backends ([`model`]).
    pub(crate) model: Model,
    /// Who may open a connection: limits, refusals ([`admission`]).
    pub(crate) admission: Admission,
    /// Counters and rate estimators ([`accounting`]).
    pub(crate) accounting: Accounting,
    /// The connection table and the tasks owning its entries ([`conns`]).
    pub(crate) conns: Conns,
    workers: Vec<mpsc::UnboundedSender<WorkerCmd>>,
    /// Which workers take new TCP connections ([`steering`]).
    pub(crate) steering: Arc<steering::Steering>,
    control_rt: tokio::runtime::Handle,
    clock: clock::Clock,
    /// `[daemon] access_log`, `drain_timeout` (and admission's
    /// `max_connections`): the `[daemon]` keys a reload changes live
    /// ([`Shared::daemon_now`]).
    pub(crate) access_log: AtomicBool,
    drain_timeout: parking_lot::Mutex<config::Dur<config::DrainTimeout>>,
    /// The proxy's buffer and socket options, read per new connection:
    /// a reload changes them for connections opened after it.
    pub(crate) tuning: Tuning,
    /// The admin API's tokens, which no tenant token may be
    /// ([`crate::control::Control::reserve_tokens`]).
    pub(crate) reserved_tokens: ReservedTokens,
    /// Packet mode's shared part, when `[packet]` is configured.
    pub(crate) packet: std::sync::OnceLock<Arc<packet::PacketPath>>,
    /// Packet mode's attached interfaces.
    packet_rt: std::sync::OnceLock<Arc<packet_run::PacketRuntime>>,
    /// The proxy and packet workers' signs of life ([`liveness`]).
    pub(crate) liveness: Arc<liveness::Liveness>,
}

impl Shared {
    /// The daemon's clock in milliseconds (the flow table's timestamps).
    pub(crate) fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// `[daemon]` as it applies now: as the daemon started with it, with
    /// the keys a reload changes live ([`LIVE_DAEMON_KEYS`]) as they are.
    pub(crate) fn daemon_now(&self) -> DaemonConfig {
        let t = self.tuning.get();
        DaemonConfig {
            max_connections: self.admission.max_connections(),
            access_log: self.access_log.load(Relaxed),
            drain_timeout: self.drain_timeout.lock().clone(),
            buffer_size: t.buffer_size as usize,
            notsent_lowat: t.notsent_lowat,
            blocked_window: t.blocked_window,
            backend_rcvbuf: t.backend_rcvbuf,
            accept_steering: self.steering.mode(),
            estimator_cpu: self.estimator_placement().cpu,
            estimator_nice: self.estimator_placement().nice,
            ..self.daemon_cfg.clone()
        }
    }

    /// The estimator thread's placement now (as started before it runs).
    fn estimator_placement(&self) -> stats::Placement {
        self.accounting.estimator.get().map_or(
            stats::Placement {
                cpu: self.daemon_cfg.estimator_cpu,
                nice: self.daemon_cfg.estimator_nice,
            },
            stats::EstimatorThread::placement,
        )
    }

    /// Why a reload's `[daemon]` values of [`LIVE_DAEMON_KEYS`] cannot be
    /// applied, if they cannot (checked before anything is applied).
    pub(crate) fn refuses_live_daemon(&self, d: &DaemonConfig) -> Option<String> {
        self.accounting.estimator.get()?.refuses(stats::Placement {
            cpu: d.estimator_cpu,
            nice: d.estimator_nice,
        })
    }

    /// Applies a reload's values of [`LIVE_DAEMON_KEYS`]; an error names
    /// what could not be applied (the rest is).
    pub(crate) fn set_live_daemon(&self, d: &DaemonConfig) -> Result<(), String> {
        self.admission.set_max_connections(d.max_connections);
        self.access_log.store(d.access_log, Relaxed);
        *self.drain_timeout.lock() = d.drain_timeout.clone();
        self.tuning.set(d);
        self.steering.set_mode(d.accept_steering);
        match self.accounting.estimator.get() {
            Some(e) => e.place(
                stats::Placement {
                    cpu: d.estimator_cpu,
                    nice: d.estimator_nice,
                },
                &self.accounting.rates,
            ),
            None => Ok(()),
        }
    }

    /// The daemon's clock in nanoseconds (what admission's rate limits use).
    pub(crate) fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }
}

// ---------------------------------------------------------------------------
// Sockets and workers
// ---------------------------------------------------------------------------

#[derive(Debug)]
pub(crate) enum ListenSocket {
    Tcp(std::net::TcpListener),
    Udp(std::net::UdpSocket),
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

/// `n` sockets bound to `addr` with `SO_REUSEPORT` (one per worker), and
/// the address they are bound to (port 0: a port of their own, the same
/// for all); TCP ones get the options accepted sockets inherit
/// (`notsent_lowat` as in `[daemon]`).
pub(crate) fn open_sockets(
    proto: Protocol,
    addr: SocketAddr,
    n: usize,
    notsent_lowat: u32,
) -> std::io::Result<(Vec<ListenSocket>, SocketAddr)> {
    if proto == Protocol::Udp && addr.port() == 0 {
        // For UDP the kernel's choice of a port for port 0 may be a port
        // that other sockets with SO_REUSEADDR / SO_REUSEPORT hold: it
        // counts them as willing to share (3,000 such binds here got 2,861
        // ports). Another of our port-0 UDP services is such a socket, and
        // joining its group would hand each service the other's
        // datagrams. A socket without those options is given a port no
        // one holds: learn one that way, then bind the group to it. If
        // something takes it in between, try another.
        let mut tries = 0;
        loop {
            let port = std::net::UdpSocket::bind(addr)?.local_addr()?.port();
            match open_socket_group(proto, SocketAddr::new(addr.ip(), port), n, notsent_lowat) {
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 8 => tries += 1,
                r => return r,
            }
        }
    }
    open_socket_group(proto, addr, n, notsent_lowat)
}

/// [`open_sockets`]' group of `n` sockets on `addr` (port 0: the port the
/// first one is given).
fn open_socket_group(
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
            Protocol::Udp => {
                // On a wildcard address each datagram must carry the address
                // it was sent to (the session answers from it): asked for
                // here, before the socket is handed to a worker, since a
                // datagram queued before the worker's receive loop set it
                // came without one, and its answer left from the kernel's
                // choice of source (a flaky test found it). The loop asks
                // again, and warns if the system refuses.
                if bound.ip().is_unspecified() {
                    let _ = udp::want_pktinfo(&s, bound.is_ipv6());
                }
                out.push(ListenSocket::Udp(s.into()));
            }
        }
    }
    Ok((out, bound))
}

/// The `[daemon]` keys a reload applies live; any other differing
/// `[daemon]` key refuses the reload (they take effect at start).
pub(crate) const LIVE_DAEMON_KEYS: [&str; 10] = [
    "max_connections",
    "access_log",
    "drain_timeout",
    "buffer_size",
    "notsent_lowat",
    "blocked_window",
    "backend_rcvbuf",
    "accept_steering",
    "estimator_cpu",
    "estimator_nice",
];

/// [`Shared::reserved_tokens`]: set once, by the admin API as it starts.
#[derive(Default)]
pub(crate) struct ReservedTokens(pub(crate) std::sync::OnceLock<crate::control::TokenRoles>);

impl std::fmt::Debug for ReservedTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the tokens themselves.
        let set = self.0.get().is_some();
        f.debug_struct("ReservedTokens").field("set", &set).finish()
    }
}

/// `[daemon]`'s buffer and socket options for proxied TCP connections,
/// read once per new connection ([`Tuning::get`]: four relaxed loads), so
/// that a reload applies to the connections opened after it; connections
/// already open keep what they started with. Listening sockets keep the
/// `notsent_lowat` they were opened with (`Service::listener_lowat`): a
/// connection accepted after a change gets the new value set on it.
#[derive(Debug)]
pub(crate) struct Tuning {
    buffer_size: AtomicU32,
    notsent_lowat: AtomicU32,
    blocked_window: AtomicU32,
    backend_rcvbuf: AtomicU32,
}

/// [`Tuning`]'s values as one connection uses them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TcpTuning {
    /// Each direction's copy buffer, in bytes (at most 16 MiB).
    pub(crate) buffer_size: u32,
    /// `TCP_NOTSENT_LOWAT` for both sockets; 0 = not set.
    pub(crate) notsent_lowat: u32,
    /// The receive window a blocked direction's source is clamped to; 0 =
    /// no clamp.
    pub(crate) blocked_window: u32,
    /// A backend socket's starting `SO_RCVBUF`; 0 = the kernel's autotuning.
    pub(crate) backend_rcvbuf: u32,
}

/// `buffer_size` as stored: config validation keeps it within 16 MiB.
fn buffer_size(d: &DaemonConfig) -> u32 {
    u32::try_from(d.buffer_size).unwrap_or(u32::MAX)
}

impl Tuning {
    fn new(d: &DaemonConfig) -> Self {
        Self {
            buffer_size: AtomicU32::new(buffer_size(d)),
            notsent_lowat: AtomicU32::new(d.notsent_lowat),
            blocked_window: AtomicU32::new(d.blocked_window),
            backend_rcvbuf: AtomicU32::new(d.backend_rcvbuf),
        }
    }

    fn set(&self, d: &DaemonConfig) {
        self.buffer_size.store(buffer_size(d), Relaxed);
        self.notsent_lowat.store(d.notsent_lowat, Relaxed);
        self.blocked_window.store(d.blocked_window, Relaxed);
        self.backend_rcvbuf.store(d.backend_rcvbuf, Relaxed);
    }

    /// The values for one new connection. Four words, so that a connection
    /// task holding them stays small (an idle connection's memory).
    pub(crate) fn get(&self) -> TcpTuning {
        TcpTuning {
            buffer_size: self.buffer_size.load(Relaxed),
            notsent_lowat: self.notsent_lowat.load(Relaxed),
            blocked_window: self.blocked_window.load(Relaxed),
            backend_rcvbuf: self.backend_rcvbuf.load(Relaxed),
        }
    }
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
    /// Tests (and debug builds' [`DaemonHandle::install_test_hooks`]):
    /// the worker's thread ends, as a dead worker's does.
    #[cfg(any(test, debug_assertions))]
    Exit,
    /// Tests: the worker's thread blocks for this long, as a wedged
    /// worker's does.
    #[cfg(test)]
    Wedge(Duration),
}

async fn worker_main(
    mut rx: mpsc::UnboundedReceiver<WorkerCmd>,
    stop: CancellationToken,
    beat: Arc<liveness::Beat>,
) {
    // Keeps a timer due within half a second. Tokio wakes its driver (a
    // write to an eventfd, and an epoll_wait that returns at once) whenever
    // a new timer is due before every timer it parked with; without this,
    // each new connection's connect timeout was such a timer whenever no
    // other connect was pending: one extra syscall and wake-up per
    // connection, for two wake-ups a second here. Each tick is also the
    // worker's sign of life for the systemd watchdog ([`liveness`]): a
    // worker whose thread is wedged (a task that never yields) stops it.
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(HEARTBEAT);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            beat.beat();
        }
    });
    loop {
        let cmd = tokio::select! {
            _ = stop.cancelled() => return,
            c = rx.recv() => match c { Some(c) => c, None => return },
        };
        match cmd {
            #[cfg(any(test, debug_assertions))]
            WorkerCmd::Exit => return,
            #[cfg(test)]
            WorkerCmd::Wedge(d) => std::thread::sleep(d),
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

/// Whether `ip` is one of this host's addresses, as bind sees it: a socket
/// binds to it (without `IP_FREEBIND`) only if it is. One socket, opened
/// and closed; for admin requests, not the data path.
pub(crate) fn host_has_ip(ip: std::net::IpAddr) -> bool {
    ip.is_loopback() || std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A TCP echo server on 127.0.0.1 for the tests' services: each
    /// connection gets back what it sends, then the end of the stream.
    pub(crate) fn echo_backend() -> SocketAddr {
        let backend = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = backend.local_addr().unwrap();
        std::thread::spawn(move || {
            for c in backend.incoming() {
                let Ok(mut c) = c else { return };
                std::thread::spawn(move || {
                    let mut r = c.try_clone().unwrap();
                    let _ = std::io::copy(&mut r, &mut c);
                    let _ = c.shutdown(std::net::Shutdown::Write);
                });
            }
        });
        addr
    }

    /// The daemon's admin API on 127.0.0.1, answering to `token`: its URL,
    /// and the token that stops it.
    pub(crate) fn admin_api(d: &DaemonHandle, token: &str) -> (String, CancellationToken) {
        let admin = crate::config::AdminConfig {
            listen: "127.0.0.1:0".into(),
            token: Some(token.into()),
            ..crate::config::AdminConfig::default()
        };
        let rt = d.runtime();
        let bound = rt
            .block_on(crate::admin::bind(&admin, d.control()))
            .unwrap();
        let url = format!("http://{}", bound.local_addr().unwrap());
        let stop = CancellationToken::new();
        rt.spawn(bound.run(stop.clone()));
        (url, stop)
    }

    /// Until `waiting` (a lock's count of waiters) counts one, for at most
    /// 10 s; past that the test fails saying `what`.
    pub(crate) fn wait_for_a_waiter(waiting: &std::sync::atomic::AtomicUsize, what: &str) {
        wait_until(what, || waiting.load(Relaxed) > 0);
    }

    /// Until `done`, for at most 10 s; past that the test fails saying
    /// `what`.
    pub(crate) fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// `POST path` with `body`, sent by `client` on a thread of its own.
    pub(crate) fn posted(
        client: crate::cli::client::Client,
        path: &'static str,
        body: serde_json::Value,
    ) -> std::thread::JoinHandle<Result<serde_json::Value, crate::cli::client::CliError>> {
        std::thread::spawn(move || client.send("POST", path, Some(&body)))
    }

    /// `GET /v1/services` sent by `client` on a thread of its own, and its
    /// answer if one comes within 5 s.
    pub(crate) fn services_listed(
        client: crate::cli::client::Client,
    ) -> Result<
        Result<serde_json::Value, crate::cli::client::CliError>,
        std::sync::mpsc::RecvTimeoutError,
    > {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(client.send("GET", "/v1/services", None));
        });
        rx.recv_timeout(Duration::from_secs(5))
    }

    /// One expiry round takes every entry that is due, not a fixed count
    /// per second (it was 64 Ki: 10M flows that went idle together took
    /// 2.5 minutes past their deadline), and applies a shortened timeout to
    /// entries filed under the old one within the same round (the table's
    /// retime pass advances a bounded step per call; the round calls again).
    #[test]
    fn an_expiry_round_takes_everything_due_and_finishes_a_retime() {
        use weir_flowtable::{
            BackendId, FlowInit, FlowKey, FlowState, Proto, ServiceId, TenantConfig, TenantId,
            Timeouts,
        };
        const N: u32 = 300_000;
        let table = FlowTable::new(TableConfig::default());
        let tenant = TenantId(1);
        let placed = table.add_tenant(
            tenant,
            TenantConfig {
                own_buckets: (N as usize).next_power_of_two(),
                ..TenantConfig::default()
            },
        );
        assert!(placed.is_ok(), "{placed:?}");
        let udp = |secs: u64| Timeouts {
            udp: Millis(secs * 1_000),
            ..Timeouts::default()
        };
        table.set_timeouts(tenant, udp(7_200)).unwrap();
        for i in 0..N {
            let key = FlowKey {
                tenant,
                proto: Proto::Udp,
                client: SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 5_000)),
                virt: SocketAddr::from(([10, 0, 0, 1], 53)),
            };
            let init = FlowInit {
                owner: 0,
                profile: weir_flowtable::ProfileRef::NONE,
                service: ServiceId(1),
                backend: BackendId(1),
                state: FlowState::Udp,
            };
            table.insert(key, init, Millis(0)).unwrap();
        }
        let entries = || table.tenant_stats(tenant).unwrap().entries;
        assert_eq!(entries(), N as u64);
        let mut out = Vec::new();
        let mut seen = 0u64;
        let budget = Duration::from_secs(60);
        // Nothing due at 10 s under the 2 h timeout.
        let at = |ms| move || Millis(ms);
        assert_eq!(
            expire_round(&table, at(10_000), budget, &mut out, |_| {}),
            0
        );
        // Shortened to 5 s: every entry is past it at 10 s; one round
        // retimes them all (over RETIME_REFS) and takes them all (over
        // 64 Ki), handing each over once.
        table.set_timeouts(tenant, udp(5)).unwrap();
        assert!(table.retiming());
        let n = expire_round(&table, at(10_000), budget, &mut out, |gone| {
            seen += gone.len() as u64;
        });
        assert_eq!((n, seen, entries()), (N as u64, N as u64, 0));
        assert!(!table.retiming());
    }

    /// The model is a snapshot: a writer's change is invisible until its
    /// guard drops, readers load without waiting for it, a snapshot once
    /// loaded never changes, a write that changes nothing publishes nothing,
    /// and concurrent writers lose none of each other's changes.
    #[test]
    fn model_writes_publish_whole_snapshots_and_readers_never_wait() {
        let mut cfg = Config::default();
        cfg.daemon.workers = 1;
        let d = Daemon::start(cfg, None).unwrap();
        let model = &d.shared.model;
        let before = arc_swap::Guard::into_inner(model.load());
        let default = before.tenants[DEFAULT_TENANT].clone();
        {
            let w = model.write();
            assert!(w.tenants.contains_key(DEFAULT_TENANT));
        }
        assert!(
            Arc::ptr_eq(&before, &model.load()),
            "a read-only write published"
        );
        let mut w = model.write();
        w.tenants.remove(DEFAULT_TENANT);
        assert!(!w.tenants.contains_key(DEFAULT_TENANT));
        assert!(model.load().tenants.contains_key(DEFAULT_TENANT));
        drop(w);
        assert!(!model.load().tenants.contains_key(DEFAULT_TENANT));
        assert!(before.tenants.contains_key(DEFAULT_TENANT));
        std::thread::scope(|s| {
            for i in 0..4 {
                let default = default.clone();
                s.spawn(move || {
                    for j in 0..50 {
                        model
                            .write()
                            .tenants
                            .insert(format!("t{i}-{j}"), default.clone());
                    }
                });
            }
        });
        assert_eq!(model.load().tenants.len(), 200);
        d.shutdown();
    }

    /// An API edit that has to wait for the edit lock (a reload holds it
    /// for its whole apply) waits off the control runtime: meanwhile
    /// another admin request is answered. The edit's handler used to wait
    /// on the lock on the control runtime's one worker thread, and every
    /// admin request, health check and watchdog keep-alive with it.
    #[test]
    fn an_edit_waiting_for_a_reload_does_not_hold_up_the_admin_api() {
        use crate::cli::client::{CliError, Client};
        let mut cfg = Config::default();
        cfg.daemon.workers = 1;
        let d = Daemon::start(cfg, None).unwrap();
        let (url, stop) = admin_api(&d, "edit-lock-test-token");
        let client = || Client::new(url.clone(), Some("edit-lock-test-token".into()));
        // As a long reload does.
        let held = d.shared.model.edits.lock();
        // A deletion takes the lock before it looks for the service.
        let edit = {
            let c = client();
            std::thread::spawn(move || c.send("DELETE", "/v1/services/default/nope", None))
        };
        wait_for_a_waiter(
            &d.shared.model.edits_waiting,
            "the edit never waited for the lock",
        );
        let answer = services_listed(client());
        assert!(
            matches!(answer, Ok(Ok(serde_json::Value::Array(_)))),
            "GET /v1/services while an edit waits for the edit lock: {answer:?}"
        );
        assert_eq!(d.shared.model.edits_waiting.load(Relaxed), 1);
        drop(held);
        // The edit goes on once the lock is free.
        match edit.join().unwrap() {
            Err(CliError::Api { status: 404, .. }) => {}
            other => panic!("the edit after the lock: {other:?}"),
        }
        stop.cancel();
        d.shutdown();
    }

    /// A tenant edit is one of the edits: it waits for an add in flight,
    /// so that once it returns, every add still to come is checked against
    /// its limits. A lowered `max_backends` keeps the backends there (only
    /// new adds are refused), but an add that had passed its check against
    /// the old limit when the edit ran, without the edit lock, went in
    /// after the edit returned: the tenant grew past its new limit after
    /// the operator set it.
    #[test]
    fn a_tenant_edit_waits_for_an_add_checked_against_its_old_limits() {
        a_lowered_limit_holds_once_the_edit_returned(LimitRace {
            toml: "[daemon]\nworkers = 1\n[[tenant]]\nname = \"acme\"\nmax_backends = 3\n\
                   [[service]]\ntenant = \"acme\"\nname = \"s\"\nprotocol = \"tcp\"\n\
                   listen = \"127.0.0.1:0\"\n[[service.backend]]\naddress = \"127.0.0.9:1\"\n\
                   [[service.backend]]\naddress = \"127.0.0.9:2\"\n",
            limit: "max_backends",
            lowered: 2,
            lower: |t, n| t.max_backends = n,
            passed: |m| &m.caps_passed,
            held: |c| c.service_spec("acme", "s").unwrap().backends.len() as u64,
            add: |c: &dyn Control| {
                let spec: crate::config::BackendSpec =
                    serde_json::from_value(serde_json::json!({ "address": "127.0.0.9:3" }))
                        .unwrap();
                c.add_backend("acme", "s", spec)
            },
        });
    }

    /// As for a backend add: a tenant edit lowering `max_services` waits
    /// for a service add that passed its check against the old limit, so
    /// no service goes in past the new limit after the edit returned (the
    /// services there when it returns stay, as for `max_backends`).
    #[test]
    fn a_tenant_edit_waits_for_a_service_add_checked_against_its_old_limit() {
        a_lowered_limit_holds_once_the_edit_returned(LimitRace {
            toml: "[daemon]\nworkers = 1\n[[tenant]]\nname = \"acme\"\nmax_services = 2\n\
                   [[service]]\ntenant = \"acme\"\nname = \"s\"\nprotocol = \"tcp\"\n\
                   listen = \"127.0.0.1:0\"\n",
            limit: "max_services",
            lowered: 1,
            lower: |t, n| t.max_services = n,
            passed: |m| &m.service_caps_passed,
            held: |c| c.services_of("acme").len() as u64,
            add: |c: &dyn Control| {
                let spec = crate::config::service_from_json(serde_json::json!({
                    "tenant": "acme", "name": "t", "protocol": "tcp", "listen": "127.0.0.1:0"
                }))
                .unwrap();
                c.add_service(spec)
            },
        });
    }

    /// A tenant edit lowering one of tenant acme's limits, raced with an
    /// add that counts against it.
    struct LimitRace<A> {
        /// The daemon's configuration: acme under the limit.
        toml: &'static str,
        /// The limit's key in a tenant's settings.
        limit: &'static str,
        /// What the edit lowers it to: what acme holds before the add.
        lowered: u64,
        /// Sets the limit in acme's settings.
        lower: fn(&mut crate::config::TenantSpec, u64),
        /// Counts the adds that passed their check against the limit
        /// (where `cap_gate` keeps them), the start's included.
        passed: fn(&model::Model) -> &std::sync::atomic::AtomicUsize,
        /// What acme holds of what the limit counts.
        held: fn(&dyn Control) -> u64,
        /// The add, run on a thread of its own.
        add: A,
    }

    /// Keeps `race.add` between its check against acme's limit and its
    /// change, lowers the limit with a tenant edit until the edit ends or
    /// waits for the edits lock, then lets the add go: acme must hold no
    /// more than the new limit, or than it held when the edit returned.
    fn a_lowered_limit_holds_once_the_edit_returned<A>(race: LimitRace<A>)
    where
        A: FnOnce(&dyn Control) -> crate::control::ControlResult<()> + Send + 'static,
    {
        let LimitRace {
            toml,
            limit,
            lowered,
            lower,
            passed,
            held,
            add,
        } = race;
        let cfg: Config = toml::from_str(toml).unwrap();
        let d = Daemon::start(cfg, None).unwrap();
        let started = passed(&d.shared.model).load(Relaxed);
        let gate = d.shared.model.cap_gate.write();
        let add = {
            let c = d.control();
            std::thread::spawn(move || add(&*c))
        };
        wait_until("the add never passed its check", || {
            passed(&d.shared.model).load(Relaxed) != started
        });
        let edit = {
            let c = d.control();
            let mut spec = c.tenant_spec("acme").unwrap();
            lower(&mut spec, lowered);
            std::thread::spawn(move || c.edit_tenant("acme", spec).map(|()| held(&*c)))
        };
        wait_until("the edit neither ended nor waited", || {
            edit.is_finished() || d.shared.model.edits_waiting.load(Relaxed) > 0
        });
        drop(gate);
        add.join().unwrap().unwrap();
        let kept = edit.join().unwrap().unwrap();
        let now = held(&*d.control());
        let what = limit.trim_start_matches("max_");
        assert!(
            now <= kept.max(lowered),
            "acme holds {now} {what} over its {limit} ({lowered}), set when it held {kept}"
        );
        d.shutdown();
    }

    /// A proxy worker whose thread ended, or that stopped turning, makes
    /// the liveness check (what the systemd watchdog is fed on) say so,
    /// naming it; a daemon that stops its workers does not.
    #[test]
    fn a_dead_or_wedged_worker_fails_the_liveness_check() {
        let mut cfg = Config::default();
        cfg.daemon.workers = 2;
        let d = Daemon::start(cfg, None).unwrap();
        // Four of a worker's heartbeats: a loaded test machine can delay
        // one, not four.
        let mut check = LivenessCheck::new(d.shared.liveness.clone(), Duration::from_secs(2));
        // Until the first sign of trouble, bounded.
        let first_error = |check: &mut LivenessCheck| {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Err(e) = check.check(Instant::now()) {
                    return e;
                }
                assert!(Instant::now() < deadline, "the check never failed");
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        // Both turn: three seconds of checks (past the stall time) all pass.
        let until = Instant::now() + Duration::from_secs(3);
        while Instant::now() < until {
            assert_eq!(check.check(Instant::now()), Ok(()));
            std::thread::sleep(Duration::from_millis(50));
        }
        // Worker 0 blocks its thread for 5 s.
        d.shared.workers[0]
            .send(WorkerCmd::Wedge(Duration::from_secs(5)))
            .unwrap();
        let e = first_error(&mut check);
        assert!(
            e.contains("weir-worker-0") && e.contains("not turned"),
            "{e}"
        );
        // Worker 1's thread ends.
        let mut check = LivenessCheck::new(d.shared.liveness.clone(), Duration::from_secs(60));
        d.shared.workers[1].send(WorkerCmd::Exit).unwrap();
        let e = first_error(&mut check);
        assert!(e.contains("weir-worker-1") && e.contains("ended"), "{e}");
        let live = d.shared.liveness.clone();
        d.shutdown();
        let mut check = LivenessCheck::new(live, Duration::from_secs(60));
        assert_eq!(check.check(Instant::now()), Ok(()), "after a shutdown");
    }

    /// A tenant's addition that has to wait for the model's writers' lock
    /// (a reload step holds it, e.g. the batch of services whose sockets it
    /// opens) waits off the control runtime: meanwhile another admin
    /// request is answered. `add_tenant` took no edit lock, so 5e5b326
    /// left it waiting for the writers' lock on the control runtime's one
    /// worker thread, and every admin request, health check and watchdog
    /// keep-alive with it.
    #[test]
    fn a_tenant_add_waiting_for_a_reload_step_does_not_hold_up_the_admin_api() {
        let d = one_worker_daemon();
        // As a reload step does.
        let held = d.shared.model.write();
        a_waiting_tenant_add_leaves_the_admin_api_free(
            &d,
            held,
            &d.shared.model.writers_waiting,
            "the writers' lock",
        );
        d.shutdown();
    }

    /// Adding a tenant takes the flow table's maintenance lock, which a
    /// tenant's removal (a pass over the table's filing lists) or an
    /// expiry pass holds meanwhile: the add waits for it off the control
    /// runtime's one worker, and other admin requests are served. It used
    /// to wait on that worker, and every admin request, the health checks
    /// and the watchdog's keep-alives with it.
    #[test]
    fn a_tenant_add_waiting_for_the_tables_maintenance_does_not_hold_up_the_admin_api() {
        let d = one_worker_daemon();
        let held = d.shared.conns.table.hold_maintenance();
        a_waiting_tenant_add_leaves_the_admin_api_free(
            &d,
            held,
            // Counts the adds in the table's add_tenants.
            &d.shared.model.table_adds,
            "the table's maintenance",
        );
        d.shutdown();
    }

    /// A daemon with one worker and the default configuration.
    fn one_worker_daemon() -> DaemonHandle {
        let mut cfg = Config::default();
        cfg.daemon.workers = 1;
        Daemon::start(cfg, None).unwrap()
    }

    /// Sends `POST /v1/tenants` while `held` holds what the add waits for
    /// (`what`); once `waiting` counts the add, `GET /v1/services` must be
    /// answered within 5 s. Then lets `held` go: the add must succeed.
    fn a_waiting_tenant_add_leaves_the_admin_api_free<G>(
        d: &DaemonHandle,
        held: G,
        waiting: &std::sync::atomic::AtomicUsize,
        what: &str,
    ) {
        use crate::cli::client::Client;
        let (url, stop) = admin_api(d, "held-add-test-token");
        let client = || Client::new(url.clone(), Some("held-add-test-token".into()));
        let add = posted(
            client(),
            "/v1/tenants",
            serde_json::json!({ "name": "late" }),
        );
        wait_for_a_waiter(waiting, &format!("the add never waited for {what}"));
        let answer = services_listed(client());
        assert!(
            matches!(answer, Ok(Ok(serde_json::Value::Array(_)))),
            "GET /v1/services while a tenant's add waits for {what}: {answer:?}"
        );
        assert_eq!(waiting.load(Relaxed), 1);
        drop(held);
        // The add goes on once the lock is free.
        let added = add.join().unwrap();
        assert!(added.is_ok(), "the add after the lock: {added:?}");
        assert!(d.shared.model.load().tenants.contains_key("late"));
        stop.cancel();
    }

    /// Adding a service on the address of one this daemon just removed waits
    /// (up to 2 s) for the old sockets to close; meanwhile the state lock,
    /// which every admin request needs, stays free. It used to be held for
    /// the whole wait.
    #[test]
    fn add_service_waits_for_a_removed_address_without_the_state_lock() {
        use crate::config::Config;
        use crate::control::ErrorKind;
        let mut cfg = Config::default();
        cfg.daemon.workers = 1;
        let d = Daemon::start(cfg, None).unwrap();
        let spec = |name: &str, listen: SocketAddr| {
            super::model::tests::test_spec("default", name, Protocol::Tcp, listen)
        };
        let shared = d.shared.clone();
        shared
            .add_service(spec("old", "127.0.0.1:0".parse().unwrap()))
            .unwrap();
        let key = ("default".to_string(), "old".to_string());
        let addr = shared.model.load().services[&key].listen;
        // Remove it, but keep it alive the way a worker still closing its
        // listener does; and take its address meanwhile, standing in for
        // that listener.
        let old = shared.model.write().services.remove(&key).unwrap();
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
                    .model
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

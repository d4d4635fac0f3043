//! A small in-memory [`Control`] for the admin API and CLI tests: enough
//! behaviour (not-found, conflicts, cursor pages, kills) to exercise every
//! route without a daemon.
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;
use weir::config::{AdminConfig, BackendSpec, Config, Protocol, ServiceSpec, TenantSpec};
use weir::control::*;

#[derive(Debug, Default)]
pub struct FakeState {
    pub config: Config,
    pub conns: BTreeMap<u64, ConnInfo>,
    pub stats: BTreeMap<(String, String), (Totals, Rates)>,
    pub fail_reload: Option<Vec<String>>,
    /// What a successful reload reports (`applied` follows `dry_run`).
    pub reload_report: ReloadReport,
    pub reloads: u64,
    /// `health()` panics (a bug in a Control, for the panic-catching tests).
    pub panic_in_health: bool,
    /// Calls of `running_config` (a copy of everything: authentication
    /// must not need one).
    pub running_config_calls: u64,
    /// Calls of `table` (every tenant's tables: a tenant token's request
    /// must read its own alone, `table_of`).
    pub table_calls: u64,
    /// When set, `connections`, `kill_matching` and `global_stats` (which
    /// `/metrics` renders) wait until it opens: a walk of a big table, or
    /// a render of many services, that takes its time.
    pub gate: Option<Arc<Gate>>,
    /// Calls of `global_stats` (one per `/metrics` render).
    pub global_stats_calls: u64,
}

impl FakeState {
    /// Service `tenant`/`service` of the config, or the daemon's "not
    /// found".
    fn service_mut(&mut self, tenant: &str, service: &str) -> ControlResult<&mut ServiceSpec> {
        self.config
            .services
            .iter_mut()
            .find(|s| s.tenant == tenant && s.name == service)
            .ok_or_else(|| nf(format!("no service {tenant}/{service}")))
    }
}

/// A gate that slow calls wait at (see [`FakeState::gate`]).
#[derive(Debug, Default)]
pub struct Gate {
    open: Mutex<bool>,
    opened: std::sync::Condvar,
    /// Calls waiting at it now.
    pub waiting: std::sync::atomic::AtomicUsize,
}

impl Gate {
    pub fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    fn pass(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        self.waiting.fetch_add(1, SeqCst);
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
        self.waiting.fetch_sub(1, SeqCst);
    }
}

#[derive(Debug, Default)]
pub struct Fake {
    pub st: Mutex<FakeState>,
}

fn nf(m: impl Into<String>) -> ControlError {
    ControlError::new(ErrorKind::NotFound, m)
}
fn conflict(m: impl Into<String>) -> ControlError {
    ControlError::new(ErrorKind::Conflict, m)
}

impl Fake {
    /// Waits at the gate, if one is set (not holding the state's lock).
    fn pass_gate(&self) {
        let gate = self.st.lock().unwrap().gate.clone();
        if let Some(g) = gate {
            g.pass();
        }
    }

    /// Two tenants ("default" shared, "acme" own table with a token), two
    /// services, three connections.
    pub fn sample() -> Self {
        let f = Fake::default();
        {
            let mut st = f.st.lock().unwrap();
            st.config.tenants = vec![
                TenantSpec {
                    name: "default".into(),
                    ..Default::default()
                },
                TenantSpec {
                    name: "acme".into(),
                    table_entries: 1024,
                    max_table_entries: 8192,
                    max_connections: 100,
                    max_new_per_s: 10,
                    max_services: 10,
                    max_backends: 100,
                    min_health_interval: Some("500ms".parse().unwrap()),
                    token: Some("acme-token".into()),
                    timeouts: Default::default(),
                    allowed_listen: vec!["10.0.0.0/8".into(), "[::]:80".into()],
                    allowed_backends: vec!["10.0.0.0/8".into()],
                },
                TenantSpec {
                    name: "globex".into(),
                    token: Some("globex-token".into()),
                    ..Default::default()
                },
            ];
            st.config.services = vec![
                service(
                    "acme",
                    "web",
                    "10.0.0.1:80",
                    &["10.1.0.1:8080", "10.1.0.2:8080"],
                ),
                service("globex", "dns", "10.0.0.2:53", &["10.2.0.1:53"]),
            ];
            st.config.services[1].protocol = Protocol::Udp;
            st.stats.insert(
                ("acme".into(), "web".into()),
                (
                    Totals {
                        conns: 1_234,
                        inpkts: 99_999_999,
                        outpkts: 100_000_000,
                        inbytes: 5_000_000_000,
                        outbytes: 123_456_789_012_345,
                    },
                    Rates {
                        cps: 12,
                        inpps: 340,
                        outpps: 330,
                        inbps: 123_456_789,
                        outbps: 2_000_000_000,
                    },
                ),
            );
            for i in 0..3u64 {
                let (tenant, svc, virt, be) = if i < 2 {
                    ("acme", "web", "10.0.0.1:80", "10.1.0.1:8080")
                } else {
                    ("globex", "dns", "10.0.0.2:53", "10.2.0.1:53")
                };
                st.conns.insert(
                    100 + i,
                    ConnInfo {
                        tenant: tenant.into(),
                        service: svc.into(),
                        proto: if i < 2 { "TCP" } else { "UDP" }.into(),
                        client: format!("192.0.2.{}:5000{i}", i + 1),
                        virtual_: virt.into(),
                        backend: be.into(),
                        state: if i < 2 { "ESTABLISHED" } else { "UDP" }.into(),
                        expires_s: 900 - i * 61,
                        cookie: 100 + i,
                        bytes_in: 1000 * i,
                        bytes_out: 2000 * i,
                        packets_in: 0,
                        packets_out: 0,
                        local: None,
                    },
                );
            }
        }
        f
    }

    /// Add `n` synthetic connections to acme/web (cookies from 10_000).
    pub fn add_conns(&self, n: u64) {
        let mut st = self.st.lock().unwrap();
        for i in 0..n {
            let cookie = 10_000 + i;
            st.conns.insert(
                cookie,
                ConnInfo {
                    tenant: "acme".into(),
                    service: "web".into(),
                    proto: "TCP".into(),
                    client: format!("198.51.100.{}:{}", i % 250 + 1, 1024 + i % 60000),
                    virtual_: "10.0.0.1:80".into(),
                    backend: "10.1.0.2:8080".into(),
                    state: "ESTABLISHED".into(),
                    expires_s: 900,
                    cookie,
                    bytes_in: i,
                    bytes_out: i,
                    packets_in: 0,
                    packets_out: 0,
                    local: None,
                },
            );
        }
    }

    fn matches(f: &ConnFilter, c: &ConnInfo) -> bool {
        f.tenant.as_ref().is_none_or(|t| *t == c.tenant)
            && f.service.as_ref().is_none_or(|s| *s == c.service)
            && f.backend.as_ref().is_none_or(|b| *b == c.backend)
            && f.state
                .as_ref()
                .is_none_or(|s| s.eq_ignore_ascii_case(&c.state))
    }
}

pub fn service(tenant: &str, name: &str, listen: &str, backends: &[&str]) -> ServiceSpec {
    ServiceSpec {
        tenant: tenant.into(),
        name: name.into(),
        protocol: Protocol::Tcp,
        listen: listen.parse().unwrap(),
        forward: Default::default(),
        scheduler: weir_sched::SchedulerKind::Wlc,
        persistence: if tenant == "acme" { "300s" } else { "0s" }
            .parse()
            .unwrap(),
        persistence_netmask: (tenant == "acme").then(|| "255.255.255.0".into()),
        options: Default::default(),
        backends: backends
            .iter()
            .map(|a| BackendSpec {
                address: a.parse().unwrap(),
                weight: 1,
                proxy_protocol: None,
                max_connections: 0,
            })
            .collect(),
    }
}

impl Control for Fake {
    fn tenants(&self) -> Vec<TenantStatus> {
        let st = self.st.lock().unwrap();
        let mut v: Vec<TenantStatus> = st
            .config
            .tenants
            .iter()
            .map(|t| TenantStatus {
                spec: TenantSpec {
                    token: None,
                    ..t.clone()
                },
                active_conns: st.conns.values().filter(|c| c.tenant == t.name).count() as u64,
                refused: if t.name == "acme" { 7 } else { 0 },
                table: if t.table_entries > 0 { "own" } else { "shared" }.into(),
                figures: None,
            })
            .collect();
        v.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
        v
    }

    fn add_tenant(&self, spec: TenantSpec) -> ControlResult<()> {
        let mut st = self.st.lock().unwrap();
        if st.config.tenants.iter().any(|t| t.name == spec.name) {
            return Err(conflict(format!("tenant {} exists", spec.name)));
        }
        if spec.table_entries != 0 && !spec.table_entries.is_power_of_two() {
            return Err(ControlError::new(
                ErrorKind::Invalid,
                "table_entries must be a power of two",
            ));
        }
        st.config.tenants.push(spec);
        Ok(())
    }

    fn edit_tenant(&self, tenant: &str, spec: TenantSpec) -> ControlResult<()> {
        let mut st = self.st.lock().unwrap();
        let Some(cur) = st.config.tenants.iter_mut().find(|t| t.name == tenant) else {
            return Err(nf(format!("no tenant {tenant}")));
        };
        if spec.table_entries != cur.table_entries {
            return Err(ControlError::new(
                ErrorKind::Invalid,
                "table_entries cannot change on a live tenant; delete and re-create it",
            ));
        }
        *cur = spec;
        Ok(())
    }

    fn delete_tenant(&self, tenant: &str) -> ControlResult<u64> {
        let mut st = self.st.lock().unwrap();
        let before = st.config.tenants.len();
        st.config.tenants.retain(|t| t.name != tenant);
        if st.config.tenants.len() == before {
            return Err(nf(format!("no tenant {tenant}")));
        }
        st.config.services.retain(|s| s.tenant != tenant);
        let n = st.conns.values().filter(|c| c.tenant == tenant).count() as u64;
        st.conns.retain(|_, c| c.tenant != tenant);
        Ok(n)
    }

    fn services(&self) -> Vec<ServiceStatus> {
        self.pass_gate();
        let st = self.st.lock().unwrap();
        let mut v: Vec<ServiceStatus> = st
            .config
            .services
            .iter()
            .map(|s| {
                let (stats, rates) = st
                    .stats
                    .get(&(s.tenant.clone(), s.name.clone()))
                    .copied()
                    .unwrap_or_default();
                let n = s.backends.len().max(1) as u64;
                ServiceStatus {
                    tenant: s.tenant.clone(),
                    name: s.name.clone(),
                    protocol: match s.protocol {
                        Protocol::Tcp => "tcp",
                        Protocol::Udp => "udp",
                    }
                    .into(),
                    listen: s.listen.to_string(),
                    forward: s.forward,
                    scheduler: s.scheduler.to_string(),
                    persistence: s.persistence.to_string(),
                    persistence_netmask: s.persistence_netmask.clone(),
                    sched_flags: weir::config::sched_flags(s),
                    backends: s
                        .backends
                        .iter()
                        .enumerate()
                        .map(|(i, b)| BackendStatus {
                            address: b.address.to_string(),
                            weight: b.weight,
                            active_conns: st
                                .conns
                                .values()
                                .filter(|c| c.backend == b.address.to_string())
                                .count() as u64,
                            inactive_conns: i as u64,
                            health: if i == 1 { "down" } else { "up" }.into(),
                            stats: Totals {
                                conns: stats.conns / n,
                                inpkts: stats.inpkts / n,
                                outpkts: stats.outpkts / n,
                                inbytes: stats.inbytes / n,
                                outbytes: stats.outbytes / n,
                            },
                            rates: Rates {
                                cps: rates.cps / n,
                                inpps: rates.inpps / n,
                                outpps: rates.outpps / n,
                                inbps: rates.inbps / n,
                                outbps: rates.outbps / n,
                            },
                        })
                        .collect(),
                    stats,
                    rates,
                }
            })
            .collect();
        v.sort_by(|a, b| (&a.tenant, &a.name).cmp(&(&b.tenant, &b.name)));
        v
    }

    fn add_service(&self, spec: ServiceSpec) -> ControlResult<()> {
        let mut st = self.st.lock().unwrap();
        if !st.config.tenants.iter().any(|t| t.name == spec.tenant) {
            return Err(nf(format!("no tenant {}", spec.tenant)));
        }
        if st
            .config
            .services
            .iter()
            .any(|s| s.tenant == spec.tenant && s.name == spec.name)
        {
            return Err(conflict(format!(
                "service {}/{} exists",
                spec.tenant, spec.name
            )));
        }
        st.config.services.push(spec);
        Ok(())
    }

    fn edit_service(&self, tenant: &str, name: &str, spec: ServiceSpec) -> ControlResult<()> {
        let mut st = self.st.lock().unwrap();
        let s = st
            .config
            .services
            .iter_mut()
            .find(|s| s.tenant == tenant && s.name == name)
            .ok_or_else(|| nf(format!("no service {tenant}/{name}")))?;
        *s = spec;
        Ok(())
    }

    fn delete_service(&self, tenant: &str, name: &str) -> ControlResult<()> {
        let mut st = self.st.lock().unwrap();
        let before = st.config.services.len();
        st.config
            .services
            .retain(|s| !(s.tenant == tenant && s.name == name));
        if st.config.services.len() == before {
            return Err(nf(format!("no service {tenant}/{name}")));
        }
        Ok(())
    }

    fn add_backend(&self, tenant: &str, service: &str, spec: BackendSpec) -> ControlResult<()> {
        let mut st = self.st.lock().unwrap();
        let s = st.service_mut(tenant, service)?;
        if s.backends.iter().any(|b| b.address == spec.address) {
            return Err(conflict(format!("backend {} exists", spec.address)));
        }
        s.backends.push(spec);
        Ok(())
    }

    fn edit_backend(
        &self,
        tenant: &str,
        service: &str,
        address: &str,
        patch: BackendPatch,
    ) -> ControlResult<()> {
        let mut st = self.st.lock().unwrap();
        let s = st.service_mut(tenant, service)?;
        let b = s
            .backends
            .iter_mut()
            .find(|b| b.address.to_string() == address)
            .ok_or_else(|| nf(format!("no backend {address}")))?;
        if let Some(w) = patch.weight {
            b.weight = w;
        }
        if patch.drain.is_some() {
            b.weight = 0;
        }
        Ok(())
    }

    fn delete_backend(&self, tenant: &str, service: &str, address: &str) -> ControlResult<()> {
        let mut st = self.st.lock().unwrap();
        let s = st.service_mut(tenant, service)?;
        let before = s.backends.len();
        s.backends.retain(|b| b.address.to_string() != address);
        if s.backends.len() == before {
            return Err(nf(format!("no backend {address}")));
        }
        Ok(())
    }

    fn connections(
        &self,
        filter: &ConnFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> ControlResult<ConnPage> {
        self.pass_gate();
        let st = self.st.lock().unwrap();
        let after = match cursor {
            None => 0,
            Some(c) => c
                .parse::<u64>()
                .map_err(|_| ControlError::new(ErrorKind::Invalid, format!("bad cursor {c:?}")))?,
        };
        let mut out = Vec::new();
        let mut next = None;
        for (cookie, c) in st.conns.range(after.saturating_add(1)..) {
            if !Self::matches(filter, c) {
                continue;
            }
            if out.len() == limit {
                next = Some(out.last().map_or(0, |c: &ConnInfo| c.cookie).to_string());
                break;
            }
            let _ = cookie;
            out.push(c.clone());
        }
        Ok(ConnPage {
            connections: out,
            next,
        })
    }

    fn kill(&self, cookie: u64, tenant: Option<&str>) -> ControlResult<()> {
        let mut st = self.st.lock().unwrap();
        if st
            .conns
            .get(&cookie)
            .is_none_or(|c| tenant.is_some_and(|t| t != c.tenant))
        {
            return Err(nf(format!("no connection {cookie}")));
        }
        st.conns.remove(&cookie);
        Ok(())
    }

    fn kill_matching(&self, filter: &ConnFilter) -> ControlResult<u64> {
        self.pass_gate();
        let mut st = self.st.lock().unwrap();
        let before = st.conns.len();
        st.conns.retain(|_, c| !Self::matches(filter, c));
        Ok((before - st.conns.len()) as u64)
    }

    fn global_stats(&self) -> GlobalStats {
        self.pass_gate();
        let mut st = self.st.lock().unwrap();
        st.global_stats_calls += 1;
        let mut refused = BTreeMap::new();
        refused.insert("tenant_limit".to_string(), 7);
        GlobalStats {
            stats: Totals {
                conns: 1_234,
                inpkts: 10,
                outpkts: 20,
                inbytes: 30,
                outbytes: 40,
            },
            rates: Rates {
                cps: 1,
                inpps: 2,
                outpps: 3,
                inbps: 4,
                outbps: 5,
            },
            active_conns: st.conns.len() as u64,
            refused,
            udp_dropped: BTreeMap::new(),
            udp_early_drops: 0,
            open_fds: 42,
            fd_limit: 1024,
            estimator_tick_seconds: 0.0005,
            estimator_tick_max_seconds: 0.002,
            packet: None,
            workers: Some(weir::control::WorkerStats {
                steering: "adaptive".into(),
                accepting: 1,
                accepted: vec![40, 2],
            }),
        }
    }

    fn table(&self) -> Vec<TableReport> {
        self.st.lock().unwrap().table_calls += 1;
        table_rows(self, None)
    }

    fn table_of(&self, tenant: &str) -> Vec<TableReport> {
        table_rows(self, Some(tenant))
    }

    fn health(&self) -> Vec<HealthEntry> {
        // Read the flag and let go of the lock first: a panic under it would
        // poison the state for every later call.
        let panic = self.st.lock().unwrap().panic_in_health;
        assert!(!panic, "fake control: health() panics as asked");
        self.services()
            .into_iter()
            .flat_map(|s| {
                s.backends.into_iter().map(move |b| HealthEntry {
                    tenant: s.tenant.clone(),
                    service: s.name.clone(),
                    backend: b.address.clone(),
                    state: b.health.clone(),
                    last_error: (b.health == "down").then(|| "connection refused".into()),
                })
            })
            .collect()
    }

    fn running_config(&self) -> Config {
        let mut st = self.st.lock().unwrap();
        st.running_config_calls += 1;
        st.config.clone()
    }

    fn tenant_spec(&self, tenant: &str) -> Option<TenantSpec> {
        let st = self.st.lock().unwrap();
        st.config.tenants.iter().find(|t| t.name == tenant).cloned()
    }

    fn service_spec(&self, tenant: &str, service: &str) -> Option<ServiceSpec> {
        let st = self.st.lock().unwrap();
        st.config
            .services
            .iter()
            .find(|s| s.tenant == tenant && s.name == service)
            .cloned()
    }

    fn for_each_tenant_token(&self, f: &mut dyn FnMut(&str, &str)) {
        let st = self.st.lock().unwrap();
        for t in &st.config.tenants {
            if let Some(tok) = &t.token {
                f(&t.name, tok);
            }
        }
    }

    fn reload(&self, opts: ReloadOptions) -> Result<ReloadReport, Vec<String>> {
        let mut st = self.st.lock().unwrap();
        st.reloads += 1;
        match &st.fail_reload {
            Some(e) => Err(e.clone()),
            None => Ok(ReloadReport {
                applied: !opts.dry_run,
                ..st.reload_report.clone()
            }),
        }
    }
}

/// The admin API in front of a [`Fake::sample`] on its own runtime, over
/// real sockets; stopped when dropped.
pub struct Served {
    pub fake: Arc<Fake>,
    /// The last TCP listener bound.
    pub addr: SocketAddr,
    stop: CancellationToken,
    _rt: tokio::runtime::Runtime,
}

impl Served {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// An admin listener on `listen` (`127.0.0.1:0`, `unix:PATH`) taking `token`.
pub fn admin_config(listen: &str, token: &str) -> AdminConfig {
    AdminConfig {
        listen: listen.into(),
        token: Some(token.into()),
        ..AdminConfig::default()
    }
}

/// Serve one [`Fake::sample`] on every listener in `cfgs`, at least one of
/// them TCP.
pub fn serve(cfgs: &[AdminConfig]) -> Served {
    serve_on(cfgs, 2)
}

/// [`serve`] on a runtime of `workers` worker threads (the daemon's
/// control runtime has one).
pub fn serve_on(cfgs: &[AdminConfig], workers: usize) -> Served {
    let fake = Arc::new(Fake::sample());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime");
    let stop = CancellationToken::new();
    let mut addr = None;
    for cfg in cfgs {
        let control: Arc<dyn Control> = fake.clone();
        let bound = rt.block_on(weir::admin::bind(cfg, control)).expect("bind");
        addr = bound.local_addr().or(addr);
        rt.spawn(bound.run(stop.clone()));
    }
    Served {
        fake,
        addr: addr.expect("a TCP listener"),
        stop,
        _rt: rt,
    }
}

/// The `weir` binary with no WEIR_* from the caller and HOME (and
/// XDG_RUNTIME_DIR) in `home`, so no real token file is read.
pub fn weir_command(home: &std::path::Path) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_weir"));
    c.env_remove("WEIR_ADMIN")
        .env_remove("WEIR_TOKEN")
        .env("HOME", home)
        .env("XDG_RUNTIME_DIR", home);
    c
}

/// The keys of every connection the API lists (`GET /v1/connections`,
/// `weir conns --json`).
pub const CONN_KEYS: [&str; 10] = [
    "tenant",
    "proto",
    "client",
    "virtual",
    "backend",
    "state",
    "expires_s",
    "cookie",
    "bytes_in",
    "bytes_out",
];

/// The fake's `GET /v1/table` rows: every tenant's, or `only` one's.
fn table_rows(f: &Fake, only: Option<&str>) -> Vec<TableReport> {
    f.tenants()
        .into_iter()
        .filter(|t| only.is_none_or(|n| t.spec.name == n))
        .map(|t| TableReport {
            tenant: t.spec.name.clone(),
            placement: t.table.clone(),
            entries: t.active_conns,
            buckets: if t.spec.table_entries > 0 {
                t.spec.table_entries as u64
            } else {
                131_072
            },
            load_factor: 0.25,
            max_chain: 3,
            chain_histogram: vec![900, 100, 20, 4],
            refused_inserts: 0,
        })
        .collect()
}

//! [`Control`] over the live daemon state.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use super::{Backend, BackendSet, Service, Shared, service_params};
use crate::config::{self, BackendSpec, Config, ServiceSpec, TenantSpec};
use crate::control::*;

/// The daemon's [`Control`] implementation.
#[derive(Debug)]
pub(crate) struct LiveControl(pub(crate) Arc<Shared>);

fn not_found(m: String) -> ControlError {
    ControlError::new(ErrorKind::NotFound, m)
}

impl LiveControl {
    fn service(&self, tenant: &str, name: &str) -> ControlResult<Arc<Service>> {
        self.0
            .state
            .read()
            .services
            .get(&(tenant.to_owned(), name.to_owned()))
            .cloned()
            .ok_or_else(|| not_found(format!("service {tenant}/{name} does not exist")))
    }

    fn matches(&self, f: &ConnFilter, e: &super::ConnEntry) -> bool {
        f.tenant
            .as_ref()
            .is_none_or(|t| *t == e.tenant.spec.read().name)
            && f.service
                .as_ref()
                .is_none_or(|s| *s == e.service.spec.read().name)
            && f.backend
                .as_ref()
                .is_none_or(|b| *b == e.backend.addr.to_string())
            && f.state
                .as_ref()
                .is_none_or(|st| st.eq_ignore_ascii_case(e.state().name()))
    }

    fn status(&self, s: &Service) -> ServiceStatus {
        let spec = s.spec.read().clone();
        let set = s.set.read().clone();
        let (stats, rates) = s.stat.read();
        ServiceStatus {
            tenant: spec.tenant.clone(),
            name: spec.name.clone(),
            protocol: config::protocol_name(spec.protocol).into(),
            listen: s.listen.to_string(),
            scheduler: spec.scheduler.clone(),
            persistence: spec.persistence.clone(),
            backends: set
                .backends
                .iter()
                .map(|b| {
                    let (stats, rates) = b.stat.read();
                    BackendStatus {
                        address: b.addr.to_string(),
                        weight: b.weight.load(Relaxed),
                        active_conns: b.active.load(Relaxed),
                        inactive_conns: b.inactive.load(Relaxed),
                        health: health_name(b).into(),
                        stats,
                        rates,
                    }
                })
                .collect(),
            stats,
            rates,
        }
    }

    /// Replace a service's backend set (keeping live backends by address).
    fn set_backends(&self, svc: &Arc<Service>, specs: &[BackendSpec]) -> ControlResult<()> {
        let old = svc.set.read().clone();
        let mut backends = Vec::with_capacity(specs.len());
        for spec in specs {
            match old.backends.iter().find(|b| b.addr == spec.address) {
                Some(b) => {
                    b.weight.store(spec.weight, Relaxed);
                    *b.spec.write() = spec.clone();
                    backends.push(b.clone());
                }
                None => backends.push(Backend::new(spec.clone())),
            }
        }
        let infos: Vec<_> = backends.iter().map(|b| b.info()).collect();
        let sched = old
            .sched
            .rebuild(&infos)
            .map_err(|e| ControlError::new(ErrorKind::Invalid, e.to_string()))?;
        let removed: Vec<_> = old
            .backends
            .iter()
            .filter(|b| !specs.iter().any(|s| s.address == b.addr))
            .map(|b| b.addr)
            .collect();
        *svc.set.write() = Arc::new(BackendSet { sched, backends });
        svc.spec.write().backends = specs.to_vec();
        if !removed.is_empty() && svc.params.read().expire_nodest_conn {
            let id = svc.id;
            self.0.kill_where("backend_removed", |e| {
                e.service.id == id && removed.contains(&e.backend.addr)
            });
        }
        Ok(())
    }

    fn remove_service(&self, key: &(String, String)) -> Option<Arc<Service>> {
        let svc = self.0.state.write().services.remove(key)?;
        svc.cancel.cancel();
        let id = svc.id;
        self.0.kill_where("service_deleted", |e| e.service.id == id);
        Some(svc)
    }
}

fn health_name(b: &Backend) -> &'static str {
    if !b.checked.load(Relaxed) {
        "unchecked"
    } else if b.up.load(Relaxed) {
        "up"
    } else {
        "down"
    }
}

impl Control for LiveControl {
    fn tenants(&self) -> Vec<TenantStatus> {
        self.0
            .state
            .read()
            .tenants
            .values()
            .map(|t| {
                let mut spec = t.spec.read().clone();
                spec.token = None;
                TenantStatus {
                    table: if spec.table_entries == 0 {
                        "shared"
                    } else {
                        "own"
                    }
                    .into(),
                    spec,
                    active_conns: t.active.load(Relaxed),
                    refused: t.refused.load(Relaxed),
                }
            })
            .collect()
    }

    fn add_tenant(&self, spec: TenantSpec) -> ControlResult<()> {
        self.0.add_tenant(spec)
    }

    fn delete_tenant(&self, tenant: &str) -> ControlResult<u64> {
        let keys: Vec<_> = {
            let st = self.0.state.read();
            if !st.tenants.contains_key(tenant) {
                return Err(not_found(format!("tenant {tenant:?} does not exist")));
            }
            st.services
                .keys()
                .filter(|(t, _)| t == tenant)
                .cloned()
                .collect()
        };
        for k in &keys {
            self.remove_service(k);
        }
        let Some(t) = self.0.state.write().tenants.remove(tenant) else {
            return Err(not_found(format!("tenant {tenant:?} does not exist")));
        };
        t.deleted.cancel();
        let id = t.id;
        // Services were removed above; catch any connection still registered.
        let closed = self
            .0
            .registry
            .lock()
            .values()
            .filter(|e| e.tenant.id == id)
            .inspect(|e| e.kill("tenant_deleted"))
            .count() as u64;
        Ok(closed.max(t.active.load(Relaxed)))
    }

    fn services(&self) -> Vec<ServiceStatus> {
        let svcs: Vec<_> = self.0.state.read().services.values().cloned().collect();
        svcs.iter().map(|s| self.status(s)).collect()
    }

    fn add_service(&self, spec: ServiceSpec) -> ControlResult<()> {
        self.0.add_service(spec)
    }

    fn edit_service(&self, tenant: &str, name: &str, spec: ServiceSpec) -> ControlResult<()> {
        let svc = self.service(tenant, name)?;
        if spec.tenant != tenant || spec.name != name {
            return Err(ControlError::new(
                ErrorKind::Invalid,
                "tenant and name cannot change; delete and add instead",
            ));
        }
        let problems = config::service_problems(&spec);
        if !problems.is_empty() {
            let msg: Vec<String> = problems
                .iter()
                .map(|p| format!("{}: {}", p.path, p.message))
                .collect();
            return Err(ControlError::new(ErrorKind::Invalid, msg.join("; ")));
        }
        let cur = svc.spec.read().clone();
        // Port 0 in an edit means "keep the port the service got".
        let rebind = cur.protocol != spec.protocol
            || (cur.listen != spec.listen
                && !(spec.listen.port() == 0 && cur.listen.ip() == spec.listen.ip()));
        if rebind
            || cur.scheduler != spec.scheduler
            || cur.options.mh_fallback != spec.options.mh_fallback
        {
            // A new address or algorithm: replace the service (its
            // connections close).
            self.remove_service(&(tenant.to_owned(), name.to_owned()));
            return self.0.add_service(spec);
        }
        let params = service_params(&spec)?;
        *svc.params.write() = Arc::new(params);
        let backends = spec.backends.clone();
        {
            let mut s = svc.spec.write();
            *s = ServiceSpec {
                listen: cur.listen,
                ..spec
            };
        }
        self.set_backends(&svc, &backends)?;
        self.0.start_health(&svc);
        Ok(())
    }

    fn delete_service(&self, tenant: &str, name: &str) -> ControlResult<()> {
        self.remove_service(&(tenant.to_owned(), name.to_owned()))
            .map(|_| ())
            .ok_or_else(|| not_found(format!("service {tenant}/{name} does not exist")))
    }

    fn add_backend(&self, tenant: &str, service: &str, spec: BackendSpec) -> ControlResult<()> {
        let svc = self.service(tenant, service)?;
        let mut specs = svc.spec.read().backends.clone();
        if specs.iter().any(|b| b.address == spec.address) {
            return Err(ControlError::new(
                ErrorKind::Conflict,
                format!("backend {} exists", spec.address),
            ));
        }
        specs.push(spec);
        let mut full = svc.spec.read().clone();
        full.backends = specs.clone();
        let problems = config::service_problems(&full);
        if !problems.is_empty() {
            let msg: Vec<String> = problems
                .iter()
                .map(|p| format!("{}: {}", p.path, p.message))
                .collect();
            return Err(ControlError::new(ErrorKind::Invalid, msg.join("; ")));
        }
        self.set_backends(&svc, &specs)?;
        self.0.start_health(&svc);
        Ok(())
    }

    fn edit_backend(
        &self,
        tenant: &str,
        service: &str,
        address: &str,
        patch: BackendPatch,
    ) -> ControlResult<()> {
        let svc = self.service(tenant, service)?;
        let mut specs = svc.spec.read().backends.clone();
        let Some(b) = specs.iter_mut().find(|b| b.address.to_string() == address) else {
            return Err(not_found(format!("backend {address} does not exist")));
        };
        if let Some(w) = patch.weight {
            if w > weir_sched::MAX_WEIGHT {
                return Err(ControlError::new(ErrorKind::Invalid, "weight above 65535"));
            }
            b.weight = w;
        }
        let drain = patch.drain == Some(true);
        if patch.drain.is_some() {
            b.weight = 0;
        }
        let addr = b.address;
        self.set_backends(&svc, &specs)?;
        if drain {
            let id = svc.id;
            self.0
                .kill_where("drained", |e| e.service.id == id && e.backend.addr == addr);
        }
        Ok(())
    }

    fn delete_backend(&self, tenant: &str, service: &str, address: &str) -> ControlResult<()> {
        let svc = self.service(tenant, service)?;
        let mut specs = svc.spec.read().backends.clone();
        let before = specs.len();
        specs.retain(|b| b.address.to_string() != address);
        if specs.len() == before {
            return Err(not_found(format!("backend {address} does not exist")));
        }
        self.set_backends(&svc, &specs)?;
        self.0.start_health(&svc);
        Ok(())
    }

    fn connections(
        &self,
        filter: &ConnFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> ControlResult<ConnPage> {
        let after = match cursor {
            None => 0,
            Some(c) => c.parse::<u64>().map_err(|_| {
                ControlError::new(
                    ErrorKind::Invalid,
                    format!("bad cursor {c:?}; pass back `next`"),
                )
            })?,
        };
        let limit = limit.clamp(1, 100_000);
        let now = self.0.now_ms();
        let entries: Vec<_> = {
            let reg = self.0.registry.lock();
            reg.range(after.saturating_add(1)..)
                .map(|(_, e)| e.clone())
                .filter(|e| self.matches(filter, e))
                .take(limit + 1)
                .collect()
        };
        let more = entries.len() > limit;
        let connections: Vec<ConnInfo> = entries
            .iter()
            .take(limit)
            .map(|e| ConnInfo {
                tenant: e.tenant.spec.read().name.clone(),
                service: e.service.spec.read().name.clone(),
                proto: config::protocol_name(e.proto).to_uppercase(),
                client: e.client.to_string(),
                virtual_: e.service.listen.to_string(),
                backend: e.backend.addr.to_string(),
                state: e.state().name().into(),
                expires_s: (e.last_active.load(Relaxed) + e.timeout_ms.load(Relaxed))
                    .saturating_sub(now)
                    / 1000,
                cookie: e.cookie,
                bytes_in: e.bytes_in.load(Relaxed),
                bytes_out: e.bytes_out.load(Relaxed),
            })
            .collect();
        let next = if more {
            connections.last().map(|c| c.cookie.to_string())
        } else {
            None
        };
        Ok(ConnPage { connections, next })
    }

    fn kill(&self, cookie: u64) -> ControlResult<()> {
        match self.0.registry.lock().get(&cookie) {
            Some(e) => {
                e.kill("killed");
                Ok(())
            }
            None => Err(not_found(format!("no connection with cookie {cookie}"))),
        }
    }

    fn kill_matching(&self, filter: &ConnFilter) -> ControlResult<u64> {
        Ok(self.0.kill_where("killed", |e| self.matches(filter, e)))
    }

    fn global_stats(&self) -> GlobalStats {
        let (stats, rates) = self.0.stat.read();
        GlobalStats {
            stats,
            rates,
            active_conns: self.0.active.load(Relaxed),
            refused: self.0.refused.lock().clone(),
            open_fds: super::open_fds(),
            fd_limit: self.0.fd_limit,
            ..Default::default()
        }
    }

    fn table(&self) -> Vec<TableReport> {
        let reg = self.0.registry.lock();
        let st = self.0.state.read();
        let buckets = self.0.daemon_cfg.shared_table_buckets as u64;
        st.tenants
            .values()
            .map(|t| {
                let spec = t.spec.read();
                let entries = reg.values().filter(|e| e.tenant.id == t.id).count() as u64;
                let (placement, b) = if spec.table_entries == 0 {
                    ("shared", buckets)
                } else {
                    ("own", spec.table_entries as u64)
                };
                TableReport {
                    tenant: spec.name.clone(),
                    placement: placement.into(),
                    entries,
                    buckets: b,
                    load_factor: entries as f64 / b.max(1) as f64,
                    max_chain: 0,
                    chain_histogram: Vec::new(),
                    refused_inserts: 0,
                }
            })
            .collect()
    }

    fn health(&self) -> Vec<HealthEntry> {
        let svcs: Vec<_> = self.0.state.read().services.values().cloned().collect();
        let mut out = Vec::new();
        for s in svcs {
            let spec = s.spec.read().clone();
            for b in s.set.read().backends.iter() {
                out.push(HealthEntry {
                    tenant: spec.tenant.clone(),
                    service: spec.name.clone(),
                    backend: b.addr.to_string(),
                    state: health_name(b).into(),
                    last_error: b.last_error.lock().clone(),
                });
            }
        }
        out
    }

    fn running_config(&self) -> Config {
        let st = self.0.state.read();
        Config {
            daemon: self.0.daemon_cfg.clone(),
            admin: self.0.admin_cfg.clone(),
            tenants: st
                .tenants
                .values()
                .map(|t| t.spec.read().clone())
                .filter(|t| {
                    // The implicit default tenant is only written out when
                    // it carries settings.
                    t.name != config::DEFAULT_TENANT
                        || t.max_connections != 0
                        || t.max_new_per_s != 0
                        || t.table_entries != 0
                })
                .collect(),
            services: st
                .services
                .values()
                .map(|s| {
                    let mut spec = s.spec.read().clone();
                    let set = s.set.read();
                    for b in spec.backends.iter_mut() {
                        if let Some(live) = set.backends.iter().find(|x| x.addr == b.address) {
                            b.weight = live.weight.load(Relaxed);
                        }
                    }
                    spec
                })
                .collect(),
        }
    }

    fn reload(&self) -> Result<(), Vec<String>> {
        let Some(path) = self.0.config_path.clone() else {
            return Err(vec![
                "the daemon was started without a config file; nothing to reload".into(),
            ]);
        };
        let new = config::load(&path)
            .map_err(|errs| errs.iter().map(ToString::to_string).collect::<Vec<_>>())?;
        let mut errors = Vec::new();
        // Tenants: add new, update limits of existing, delete missing (after services).
        let live: Vec<String> = self.0.state.read().tenants.keys().cloned().collect();
        for t in &new.tenants {
            let existing = self.0.state.read().tenants.get(&t.name).cloned();
            match existing {
                Some(cur) => *cur.spec.write() = t.clone(),
                None => {
                    if let Err(e) = self.0.add_tenant(t.clone()) {
                        errors.push(e.message);
                    }
                }
            }
        }
        // Services.
        let live_svcs: Vec<(String, String)> =
            self.0.state.read().services.keys().cloned().collect();
        for key in &live_svcs {
            if !new
                .services
                .iter()
                .any(|s| s.tenant == key.0 && s.name == key.1)
            {
                self.remove_service(key);
            }
        }
        for s in &new.services {
            let exists = self
                .0
                .state
                .read()
                .services
                .contains_key(&(s.tenant.clone(), s.name.clone()));
            let r = if exists {
                let cur = self
                    .service(&s.tenant, &s.name)
                    .map(|c| c.spec.read().clone());
                match cur {
                    Ok(c) if c == *s => Ok(()),
                    _ => self.edit_service(&s.tenant.clone(), &s.name.clone(), s.clone()),
                }
            } else {
                self.0.add_service(s.clone())
            };
            if let Err(e) = r {
                errors.push(format!("service {}/{}: {}", s.tenant, s.name, e.message));
            }
        }
        for name in live {
            if name != config::DEFAULT_TENANT && !new.tenants.iter().any(|t| t.name == name) {
                let _ = self.delete_tenant(&name);
            }
        }
        if errors.is_empty() {
            tracing::info!(path = %path.display(), "configuration reloaded");
            Ok(())
        } else {
            Err(errors)
        }
    }
}

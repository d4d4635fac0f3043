//! [`Control`] over the live daemon state.

use std::collections::HashMap;
use std::sync::Arc;

use std::sync::atomic::Ordering::Relaxed;
use weir_flowtable::{DumpFilter, FlowState, TenantId};

use super::{Backend, BackendSet, Service, Shared, check_service, service_params};
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
                None => backends.push(Backend::new(spec.clone(), &self.0.rates)),
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
                    table: t.placement.clone(),
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

    fn edit_tenant(&self, tenant: &str, spec: TenantSpec) -> ControlResult<()> {
        let invalid = |m: String| ControlError::new(ErrorKind::Invalid, m);
        let Some(t) = self.0.state.read().tenants.get(tenant).cloned() else {
            return Err(not_found(format!("tenant {tenant:?} does not exist")));
        };
        if spec.name != tenant {
            return Err(invalid(format!(
                "a tenant cannot be renamed ({tenant:?} to {:?}); create the new one and move its services",
                spec.name
            )));
        }
        let cur_entries = t.spec.read().table_entries;
        if spec.table_entries != cur_entries {
            return Err(invalid(format!(
                "table_entries cannot change on a live tenant: its flow table was sized at creation \
                 ({cur_entries}); delete the tenant and create it again with table_entries = {}",
                spec.table_entries
            )));
        }
        let timeouts = super::resolve_timeouts(&spec)?;
        *t.timeouts.write() = timeouts;
        *t.spec.write() = spec;
        self.0.tune_tenant_timeouts(&t);
        tracing::info!(tenant, "tenant updated");
        Ok(())
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
        // Purge the tenant from the flow table (O(its entries)); close the
        // connections and sessions those entries belong to.
        let mut purged = Vec::new();
        let _ = self.0.table.remove_tenant(TenantId(t.id), &mut purged);
        let mut closed = 0u64;
        for snap in purged.iter().filter(|s| s.state != FlowState::Persist) {
            closed += 1;
            if let Some(e) = self.0.registry.get(snap.cookie.0) {
                e.kill("tenant_deleted");
            }
        }
        Ok(closed)
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
        check_service(&spec)?;
        let cur = svc.spec.read().clone();
        // Port 0 in an edit means "keep the port the service got".
        let rebind = cur.protocol != spec.protocol
            || (cur.listen != spec.listen
                && !(spec.listen.port() == 0 && cur.listen.ip() == spec.listen.ip()));
        if rebind {
            // A new address or protocol: replace the service (its
            // connections close).
            self.remove_service(&(tenant.to_owned(), name.to_owned()));
            return self.0.add_service(spec);
        }
        let params = service_params(&spec)?;
        if cur.scheduler != spec.scheduler
            || cur.options.mh_fallback != spec.options.mh_fallback
            || cur.options.hash_seed != spec.options.hash_seed
        {
            // A new algorithm: a fresh scheduler over the same live backends
            // (no history to carry over); connections are untouched.
            let old = svc.set.read().clone();
            let sched = super::build_sched(&spec, &old.backends)?;
            *svc.set.write() = Arc::new(BackendSet {
                sched,
                backends: old.backends.clone(),
            });
        }
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
        self.0.tune_tenant_timeouts(&svc.tenant);
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
        check_service(&full)?;
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
        let invalid = |m: String| ControlError::new(ErrorKind::Invalid, m);
        let cursor = match cursor {
            None => None,
            Some(c) => Some(
                c.parse::<weir_flowtable::Cursor>()
                    .map_err(|_| invalid(format!("bad cursor {c:?}; pass back `next` as given")))?,
            ),
        };
        let (tenants, services) = {
            let st = self.0.state.read();
            let tenants: HashMap<u32, String> = st
                .tenants
                .values()
                .map(|t| (t.id, t.spec.read().name.clone()))
                .collect();
            let services: HashMap<u32, Arc<Service>> =
                st.services.values().map(|s| (s.id, s.clone())).collect();
            (tenants, services)
        };
        let mut df = DumpFilter::default();
        if let Some(t) = &filter.tenant {
            let Some((&id, _)) = tenants.iter().find(|(_, n)| *n == t) else {
                return Err(not_found(format!("tenant {t:?} does not exist")));
            };
            df.tenant = Some(TenantId(id));
        }
        if let Some(st) = &filter.state {
            let state = st
                .to_ascii_uppercase()
                .parse::<FlowState>()
                .map_err(|_| invalid(format!("unknown state {st:?}; e.g. ESTABLISHED, UDP")))?;
            df.state = Some(state);
        }
        let limit = limit.clamp(1, 100_000);
        let now = self.0.now_ms();
        let mut snaps = Vec::with_capacity(limit.min(4096));
        let next = self.0.table.dump(cursor.as_ref(), &df, limit, &mut snaps);
        let connections = snaps
            .iter()
            .filter_map(|snap| {
                let svc = services.get(&snap.service.0)?;
                let spec = svc.spec.read();
                let backend = svc
                    .set
                    .read()
                    .backends
                    .iter()
                    .find(|b| b.id == snap.backend.0)
                    .map(|b| b.addr.to_string())
                    .unwrap_or_else(|| "-".into());
                if filter.service.as_ref().is_some_and(|s| *s != spec.name)
                    || filter.backend.as_ref().is_some_and(|b| *b != backend)
                {
                    return None;
                }
                // Entries carry their own service timeout (UDP, templates),
                // which may be shorter than the table's per-tenant one.
                let expires = match self.0.registry.get(snap.cookie.0) {
                    Some(e) => e.last_active.load(Relaxed) + e.timeout_ms.load(Relaxed),
                    None if snap.state == FlowState::Persist => {
                        snap.last_active.0 + svc.params.read().persistence.as_millis() as u64
                    }
                    None => snap.expires_at.0,
                };
                Some(ConnInfo {
                    tenant: tenants.get(&snap.key.tenant.0).cloned().unwrap_or_default(),
                    service: spec.name.clone(),
                    proto: config::protocol_name(spec.protocol).to_uppercase(),
                    client: snap.key.client.to_string(),
                    virtual_: snap.key.virt.to_string(),
                    backend,
                    state: snap.state.to_string(),
                    expires_s: expires.saturating_sub(now) / 1000,
                    cookie: snap.cookie.0,
                    bytes_in: snap.bytes_in,
                    bytes_out: snap.bytes_out,
                })
            })
            .collect();
        Ok(ConnPage {
            connections,
            next: next.map(|c| c.to_string()),
        })
    }

    fn kill(&self, cookie: u64) -> ControlResult<()> {
        match self.0.registry.get(cookie) {
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
            refused: self.0.refused.snapshot(),
            open_fds: super::open_fds(),
            fd_limit: self.0.fd_limit,
            estimator_tick_seconds: self.0.rates.last_tick_ns.load(Relaxed) as f64 / 1e9,
            estimator_tick_max_seconds: self.0.rates.max_tick_ns.load(Relaxed) as f64 / 1e9,
        }
    }

    fn table(&self) -> Vec<TableReport> {
        let tenants: Vec<_> = self.0.state.read().tenants.values().cloned().collect();
        tenants
            .iter()
            .filter_map(|t| {
                let st = self.0.table.tenant_stats(TenantId(t.id))?;
                Some(TableReport {
                    tenant: t.spec.read().name.clone(),
                    placement: match st.placement {
                        weir_flowtable::Placement::Own { .. } => "own".into(),
                        weir_flowtable::Placement::Shared { .. } => "shared".into(),
                    },
                    entries: st.entries,
                    buckets: st.buckets as u64,
                    load_factor: st.load_factor,
                    max_chain: st.max_chain as u64,
                    chain_histogram: st.chain_histogram,
                    refused_inserts: st.refused_inserts,
                })
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
                    // it carries settings (limits, token, timeouts...).
                    t.name != config::DEFAULT_TENANT
                        || *t
                            != TenantSpec {
                                name: config::DEFAULT_TENANT.into(),
                                ..TenantSpec::default()
                            }
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
        // Pre-flight: every address a new (or moved) service needs must be
        // free, else nothing is applied.
        let mut errors = Vec::new();
        for s in &new.services {
            let cur = self.service(&s.tenant, &s.name).ok();
            let moves = cur.as_ref().is_none_or(|c| {
                let c = c.spec.read();
                c.protocol != s.protocol || (c.listen != s.listen && s.listen.port() != 0)
            });
            let taken_by_us = self
                .0
                .state
                .read()
                .services
                .values()
                .any(|o| o.listen == s.listen && o.spec.read().protocol == s.protocol);
            if moves
                && s.listen.port() != 0
                && !taken_by_us
                && let Err(e) = super::probe_free(s.protocol, s.listen)
            {
                errors.push(format!(
                    "service {}/{}: cannot listen on {} {}: {e}",
                    s.tenant,
                    s.name,
                    config::protocol_name(s.protocol),
                    s.listen
                ));
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        // Tenants: add new, edit existing (limits, token, timeouts; a new
        // table size is reported), delete missing (after services).
        let live: Vec<String> = self.0.state.read().tenants.keys().cloned().collect();
        for t in &new.tenants {
            let existing = self.0.state.read().tenants.get(&t.name).cloned();
            let r = match existing {
                Some(cur) if *cur.spec.read() == *t => Ok(()),
                Some(_) => self.edit_tenant(&t.name, t.clone()),
                None => self.0.add_tenant(t.clone()),
            };
            if let Err(e) = r {
                errors.push(format!("tenant {}: {}", t.name, e.message));
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

//! [`Control`] over the live daemon state.

use std::sync::Arc;

use std::sync::atomic::Ordering::Relaxed;
use weir_flowtable::{DumpFilter, FlowSnapshot, FlowState, ServiceId, TenantId};

use super::model::Caps;
use super::owners::Close;
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
            .model
            .load()
            .services
            .get(&(tenant.to_owned(), name.to_owned()))
            .cloned()
            .ok_or_else(|| not_found(format!("service {tenant}/{name} does not exist")))
    }

    /// `f` as a dump filter (tenant, state) and a test of the rest
    /// (service, backend) on each entry.
    fn conn_filter(&self, f: &ConnFilter) -> ControlResult<(DumpFilter, ConnMatch)> {
        let invalid = |m: String| ControlError::new(ErrorKind::Invalid, m);
        let st = self.0.model.load();
        let mut df = DumpFilter::default();
        if let Some(t) = &f.tenant {
            let Some(ten) = st.tenants.get(t) else {
                return Err(not_found(format!("tenant {t:?} does not exist")));
            };
            df.tenant = Some(TenantId(ten.id));
        }
        // An address, compared as one: "[::ffff:10.0.0.1]:80" names the
        // backend 10.0.0.1:80, and what is not IP:PORT matches no backend,
        // so it is refused rather than answered with nothing.
        let backend = match &f.backend {
            None => None,
            Some(b) => Some(
                b.trim()
                    .parse::<std::net::SocketAddr>()
                    .map(canonical)
                    .map_err(|_| {
                        invalid(format!(
                            "backend {b:?} is not IP:PORT, e.g. 10.0.1.3:80 or [2001:db8::3]:80"
                        ))
                    })?,
            ),
        };
        if let Some(s) = &f.state {
            let state = s
                .to_ascii_uppercase()
                .parse::<FlowState>()
                .map_err(|_| invalid(format!("unknown state {s:?}; e.g. ESTABLISHED, UDP")))?;
            df.state = Some(state);
        }
        // A service of a named tenant is one service: filter the dump by its
        // id, so pages come back full rather than thinned out after it.
        if let (Some(t), Some(s)) = (&f.tenant, &f.service)
            && let Some(svc) = st.services.get(&(t.clone(), s.clone()))
        {
            df.service = Some(ServiceId(svc.id));
        }
        Ok((
            df,
            ConnMatch {
                state: arc_swap::Guard::into_inner(st),
                service: f.service.clone(),
                backend,
            },
        ))
    }

    fn status(&self, s: &Service) -> ServiceStatus {
        let spec = s.spec.read().clone();
        let set = s.set.load_full();
        let (stats, rates) = s.stat.read();
        ServiceStatus {
            tenant: spec.tenant.clone(),
            name: spec.name.clone(),
            protocol: config::protocol_name(spec.protocol).into(),
            listen: s.listen.to_string(),
            forward: spec.forward,
            scheduler: spec.scheduler.to_string(),
            persistence: spec.persistence.to_string(),
            persistence_netmask: spec.persistence_netmask.clone(),
            sched_flags: config::sched_flags(&spec),
            backends: set
                .backends
                .iter()
                .map(|b| {
                    let (stats, rates) = b.stat.read();
                    BackendStatus {
                        address: b.addr.to_string(),
                        weight: b.weight.load(Relaxed),
                        active_conns: b.active(),
                        inactive_conns: b.inactive(),
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
        let old = svc.set.load_full();
        let mut backends = Vec::with_capacity(specs.len());
        for spec in specs {
            match old.backends.iter().find(|b| b.addr == spec.address) {
                Some(b) => {
                    b.weight.store(spec.weight, Relaxed);
                    b.max_connections.store(spec.max_connections, Relaxed);
                    *b.spec.write() = spec.clone();
                    backends.push(b.clone());
                }
                // (Not one of the set: the id is taken in the service only
                // by a removed backend that may still have connections.)
                None => backends.push(Backend::new(
                    spec.clone(),
                    &self.0.accounting.rates,
                    &svc.tenant,
                    |id| svc.backend(id).is_some(),
                )),
            }
        }
        let gone: Vec<Arc<Backend>> = old
            .backends
            .iter()
            .filter(|b| !specs.iter().any(|s| s.address == b.addr))
            .cloned()
            .collect();
        let removed: Vec<u32> = gone.iter().map(|b| b.id).collect();
        // An `rcu`, as a health change's rebuild is: with a plain store, a
        // rebuild landing between reading the backends' health here and
        // the store was overwritten by a scheduler of the old health, and
        // a backend gone down stayed scheduled until its next change.
        // (Other edits of the set wait on `Model::edits`.)
        let mut failed = None;
        svc.set.rcu(|cur| {
            let infos: Vec<_> = backends.iter().map(|b| b.info()).collect();
            match cur.sched.rebuild(&infos) {
                Ok(sched) => {
                    failed = None;
                    Arc::new(BackendSet {
                        sched,
                        backends: backends.clone(),
                    })
                }
                Err(e) => {
                    failed = Some(e);
                    Arc::clone(cur)
                }
            }
        });
        if let Some(e) = failed {
            return Err(ControlError::new(ErrorKind::Invalid, e.to_string()));
        }
        svc.spec.write().backends = specs.to_vec();
        // Their connections stay listed, filtered and settled under their
        // address (see `Service::backend`).
        svc.retire_backends(&self.0.conns.table, gone);
        self.0.services_changed();
        if !removed.is_empty() && svc.params.load().expire_nodest_conn {
            self.0
                .kill_service(svc, Some(&removed), Close::BackendRemoved);
        }
        Ok(())
    }

    /// Check everything a reload to `new` needs (values, what cannot change
    /// live, free addresses) and list what it would add, change and remove;
    /// changes nothing.
    fn plan(&self, new: &Config) -> Result<ReloadReport, Vec<String>> {
        let mut errors = Vec::new();
        let mut report = ReloadReport::default();
        if new.packet != self.0.packet_cfg {
            errors.push(
                "[packet] differs from the running daemon's: the packet data path attaches to \
                 its interfaces and addresses at start, so a reload cannot change it; restart \
                 weir to apply it (or put the running [packet] back to reload the rest)"
                    .into(),
            );
        }
        // [admin] and most of [daemon] apply at start: a reload that
        // changes them would leave the change unapplied without a word (it
        // used to). The live keys of [daemon] are applied and reported.
        // Durations compare by value ("30s" is "30000ms").
        let running = self.0.daemon_now();
        let mut daemon = new.daemon.clone();
        if daemon.drain_timeout.get() == running.drain_timeout.get() {
            daemon.drain_timeout = running.drain_timeout.clone();
        }
        let (live, fixed): (Vec<_>, Vec<_>) = section_changes(&running, &daemon)
            .into_iter()
            .partition(|(k, _, _)| super::LIVE_DAEMON_KEYS.contains(&k.as_str()));
        report
            .changed
            .extend(live.into_iter().map(|(k, _, _)| format!("daemon {k}")));
        if let Some(e) = self.0.refuses_live_daemon(&daemon) {
            errors.push(format!("[daemon] {e}"));
        }
        let fixed: Vec<String> = fixed
            .into_iter()
            .map(|(k, x, y)| format!("{k} {x} -> {y}"))
            .collect();
        // Key names only for [admin]: it holds tokens.
        let admin: Vec<String> = section_changes(&self.0.admin_cfg, &new.admin)
            .into_iter()
            .map(|(k, _, _)| k)
            .collect();
        for (section, changed) in [("daemon", fixed), ("admin", admin)] {
            if !changed.is_empty() {
                errors.push(format!(
                    "[{section}] differs from the running daemon's ({}): it applies at start, \
                     so a reload cannot change it; restart weir to apply it (or put the \
                     running values back to reload the rest)",
                    changed.join(", ")
                ));
            }
        }
        // One token, one role: the API and `weir run` refuse a tenant token
        // that is the full-access or read-only token; so does a reload.
        if let Some(roles) = self.0.reserved_tokens.0.get() {
            for t in &new.tenants {
                if let Some(role) = t.token.as_deref().and_then(|tok| roles(tok.trim())) {
                    errors.push(format!(
                        "tenant {}: its token is the same as {role}: a token may hold one \
                         role only; give each its own",
                        t.name
                    ));
                }
            }
        }
        // The snapshot itself, not a copy of its maps (O(services)).
        let st = arc_swap::Guard::into_inner(self.0.model.load());
        let (tenants, services) = (&st.tenants, &st.services);
        for t in &new.tenants {
            if let Err(e) = super::resolve_timeouts(t).and_then(|_| super::check_fences(t)) {
                errors.push(format!("tenant {}: {}", t.name, e.message));
            }
            match tenants.get(&t.name) {
                None => {
                    if let Err(e) = config::check_name(&t.name) {
                        errors.push(format!("tenant {}: name: {e}", t.name));
                    }
                    report.added.push(tenant_id(&t.name));
                }
                Some(cur) => {
                    let cur = cur.spec.read().clone();
                    if cur.table_entries != t.table_entries {
                        errors.push(format!(
                            "tenant {}: table_entries cannot change on a live tenant: its flow \
                             table was sized at creation ({}); delete the tenant and create it \
                             again with table_entries = {}",
                            t.name, cur.table_entries, t.table_entries
                        ));
                    }
                    if cur.max_table_entries != t.max_table_entries {
                        errors.push(format!(
                            "tenant {}: {}",
                            t.name,
                            cap_fixed(cur.max_table_entries, t.max_table_entries)
                        ));
                    }
                    if cur != *t {
                        report.changed.push(tenant_id(&t.name));
                    }
                }
            }
        }
        let tenants_in_file = tenant_names(new);
        for name in tenants.keys() {
            if name != config::DEFAULT_TENANT && !tenants_in_file.contains(name.as_str()) {
                report.removed.push(tenant_id(name));
            }
        }
        for s in &new.services {
            let id = format!("{}/{}", s.tenant, s.name);
            if let Err(e) =
                check_service(s, new.packet.as_ref()).and_then(|()| service_params(s).map(|_| ()))
            {
                errors.push(format!("service {id}: {}", e.message));
            } else if let Some(why) = self.0.packet_mode_unavailable(s) {
                errors.push(format!("service {id}: {why}"));
            }
            if let Some(c) = services.get(&(s.tenant.clone(), s.name.clone()))
                && let Err(e) = forward_fixed(&c.spec.read(), s)
            {
                errors.push(format!("service {id}: {}", e.message));
            }
            if !tenants.contains_key(&s.tenant) && !tenants_in_file.contains(s.tenant.as_str()) {
                errors.push(format!(
                    "service {id}: tenant {:?} does not exist; add a [[tenant]] for it",
                    s.tenant
                ));
            }
            let cur = services.get(&(s.tenant.clone(), s.name.clone()));
            let moves = cur.is_none_or(|c| {
                let c = c.spec.read();
                c.protocol != s.protocol || (c.listen != s.listen && s.listen.port() != 0)
            });
            let taken_by_us = services.on_address(s.protocol, s.listen).next().is_some();
            if moves
                && s.listen.port() != 0
                && !taken_by_us
                && let Err(e) = super::probe_free(s.protocol, s.listen)
            {
                errors.push(format!(
                    "service {id}: cannot listen on {} {}: {e}",
                    config::protocol_name(s.protocol),
                    s.listen
                ));
            }
            match cur {
                None => report.added.push(format!("service {id}")),
                Some(c) => {
                    let c = c.spec.read().clone();
                    if c != same_port(&c, s) {
                        report.changed.push(format!("service {id}"));
                        for b in &s.backends {
                            if !c.backends.iter().any(|x| x.address == b.address) {
                                report.added.push(format!("backend {id}/{}", b.address));
                            }
                        }
                        for b in &c.backends {
                            if !s.backends.iter().any(|x| x.address == b.address) {
                                report.removed.push(format!("backend {id}/{}", b.address));
                            }
                        }
                    }
                }
            }
        }
        let in_file = service_names(new);
        for (t, n) in services.keys() {
            if !in_file.contains(&(t.as_str(), n.as_str())) {
                report.removed.push(format!("service {t}/{n}"));
            }
        }
        errors.extend(order_problems(services, new, &in_file));
        if errors.is_empty() {
            Ok(report)
        } else {
            Err(errors)
        }
    }

    /// Apply a config that [`Self::plan`] accepted; returns what still
    /// failed (e.g. an address taken between the check and now). Called
    /// with the edits held since the plan ([`Control::reload`]): no API
    /// edit between the steps, which are checked against the tenants'
    /// caps as a whole (see `Caps::WholeFile`), and each compares a service
    /// with the file before changing it.
    fn apply(&self, new: &Config) -> Vec<String> {
        // plan() refused any other [daemon] change.
        let daemon_error = self.0.set_live_daemon(&new.daemon).err();
        // Tenants: add new, edit existing, delete missing (after services).
        let live: Vec<String> = self.0.model.load().tenants.keys().cloned().collect();
        // The new ones are added as one batch (one copy of the model and of
        // the flow table's tenant directory, not one per tenant); edits
        // change a live tenant in place. Neither touches another tenant,
        // so only the errors need putting back in file order.
        let mut tenant_errors: Vec<(usize, String)> = Vec::new();
        let mut to_add = Vec::new();
        let mut add_at = Vec::new();
        for (i, t) in new.tenants.iter().enumerate() {
            let existing = self.0.model.load().tenants.get(&t.name).cloned();
            let r = match existing {
                Some(cur) if *cur.spec.read() == *t => Ok(()),
                Some(_) => self.edit_tenant_locked(&t.name, t.clone()),
                None => {
                    to_add.push(t.clone());
                    add_at.push(i);
                    Ok(())
                }
            };
            if let Err(e) = r {
                tenant_errors.push((i, e.message));
            }
        }
        if !to_add.is_empty() {
            for (j, e) in self.0.add_tenants(to_add) {
                tenant_errors.push((add_at[j], e.message));
            }
        }
        tenant_errors.sort_by_key(|(i, _)| *i);
        let mut errors: Vec<String> = daemon_error
            .map(|e| format!("[daemon] {e}"))
            .into_iter()
            .collect();
        errors.extend(
            tenant_errors
                .into_iter()
                .map(|(i, m)| format!("tenant {}: {m}", new.tenants[i].name)),
        );
        let live_svcs: Vec<(String, String)> =
            self.0.model.load().services.keys().cloned().collect();
        let in_file = service_names(new);
        // Removed as one change of the model (one copy of it, not one per
        // service), before any edit or add: as one at a time did.
        let gone: Vec<(String, String)> = live_svcs
            .into_iter()
            .filter(|(t, n)| !in_file.contains(&(t.as_str(), n.as_str())))
            .collect();
        self.0.remove_services(&gone);
        // New services are added in batches (one copy of the model for a
        // batch, not one per service), each batch before the next edit:
        // in file order, as one at a time, since an edit can free an
        // address that a later service takes, or take one first.
        let mut adds = Vec::new();
        for s in &new.services {
            let Ok(c) = self.service(&s.tenant, &s.name) else {
                adds.push(s.clone());
                continue;
            };
            let c = c.spec.read().clone();
            if c == same_port(&c, s) {
                continue;
            }
            self.add_batch(&mut adds, &mut errors);
            if let Err(e) = self.edit_service_locked(&s.tenant, &s.name, s.clone(), Caps::WholeFile)
            {
                errors.push(format!("service {}/{}: {}", s.tenant, s.name, e.message));
            }
        }
        self.add_batch(&mut adds, &mut errors);
        let in_file = tenant_names(new);
        let gone: Vec<String> = live
            .into_iter()
            .filter(|name| name != config::DEFAULT_TENANT && !in_file.contains(name.as_str()))
            .collect();
        // As one batch: one pass for them all, not one per tenant.
        let _ = self.delete_tenants(&gone);
        errors
    }

    /// [`Control::edit_tenant`], `Model::edits` held by the caller (it,
    /// or a reload's apply).
    fn edit_tenant_locked(&self, tenant: &str, spec: TenantSpec) -> ControlResult<()> {
        let invalid = |m: String| ControlError::new(ErrorKind::Invalid, m);
        let Some(t) = self.0.model.load().tenants.get(tenant).cloned() else {
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
        let cur_cap = t.spec.read().max_table_entries;
        if spec.max_table_entries != cur_cap {
            return Err(invalid(cap_fixed(cur_cap, spec.max_table_entries)));
        }
        let timeouts = super::resolve_timeouts(&spec)?;
        super::check_fences(&spec)?;
        *t.spec.write() = spec;
        // Services' own timeouts are profiles over these: they follow.
        let _ = self.0.conns.table.set_timeouts(TenantId(t.id), timeouts);
        tracing::info!(tenant, "tenant updated");
        Ok(())
    }
    /// [`Control::delete_service`], the edits held.
    fn delete_service_locked(&self, tenant: &str, name: &str) -> ControlResult<()> {
        self.remove_service(&(tenant.to_owned(), name.to_owned()))
            .ok_or_else(|| not_found(format!("service {tenant}/{name} does not exist")))?;
        self.forget_runtime(
            &format!("service {tenant}/{name}"),
            &format!("{tenant}/{name}/"),
        );
        Ok(())
    }

    /// [`Control::edit_backend`], the edits held.
    fn edit_backend_locked(
        &self,
        tenant: &str,
        service: &str,
        address: &str,
        patch: BackendPatch,
    ) -> ControlResult<()> {
        let svc = self.service(tenant, service)?;
        let mut specs = svc.spec.read().backends.clone();
        let named = named_by(address);
        let Some(b) = specs.iter_mut().find(|b| named(b.address)) else {
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
            let ids: Vec<u32> = svc
                .set
                .load()
                .backends
                .iter()
                .filter(|b| b.addr == addr)
                .map(|b| b.id)
                .collect();
            self.0.kill_service(&svc, Some(&ids), Close::Drained);
        }
        Ok(())
    }

    /// [`Control::delete_backend`], the edits held.
    fn delete_backend_locked(
        &self,
        tenant: &str,
        service: &str,
        address: &str,
    ) -> ControlResult<()> {
        let svc = self.service(tenant, service)?;
        let mut specs = svc.spec.read().backends.clone();
        let named = named_by(address);
        let Some(stored) = specs.iter().map(|b| b.address).find(|a| named(*a)) else {
            return Err(not_found(format!("backend {address} does not exist")));
        };
        specs.retain(|b| b.address != stored);
        self.set_backends(&svc, &specs)?;
        self.0.start_health(&svc);
        // As the add named it: the address as it was given then.
        let id = format!("backend {tenant}/{service}/{stored}");
        self.0.model.runtime_added.lock().remove(&id);
        Ok(())
    }

    /// [`Control::add_backend`], `Model::edits` held by the caller.
    fn add_backend_locked(
        &self,
        tenant: &str,
        service: &str,
        spec: BackendSpec,
    ) -> ControlResult<()> {
        let svc = self.service(tenant, service)?;
        let mut specs = svc.spec.read().backends.clone();
        // `[::ffff:10.0.0.1]:80` is `10.0.0.1:80` (as a file's check says).
        if specs
            .iter()
            .any(|b| canonical(b.address) == canonical(spec.address))
        {
            return Err(ControlError::new(
                ErrorKind::Conflict,
                format!("backend {} exists", spec.address),
            ));
        }
        let id = format!("backend {tenant}/{service}/{}", spec.address);
        specs.push(spec);
        super::model::backend_quota(
            &self.0.model.load(),
            tenant,
            service,
            specs.len(),
            &mut Default::default(),
        )?;
        #[cfg(test)]
        let _gate = self.0.model.cap_checked();
        let mut full = svc.spec.read().clone();
        full.backends = specs.clone();
        check_service(&full, self.0.packet_cfg.as_ref())?;
        self.set_backends(&svc, &specs)?;
        self.0.start_health(&svc);
        self.added_at_runtime(id);
        Ok(())
    }

    /// [`Control::edit_service`], `Model::edits` held by the caller; the
    /// tenant's `max_backends` checked as `caps` says.
    fn edit_service_locked(
        &self,
        tenant: &str,
        name: &str,
        spec: ServiceSpec,
        caps: Caps,
    ) -> ControlResult<()> {
        let svc = self.service(tenant, name)?;
        if spec.tenant != tenant || spec.name != name {
            return Err(ControlError::new(
                ErrorKind::Invalid,
                "tenant and name cannot change; delete and add instead",
            ));
        }
        let cur = svc.spec.read().clone();
        // First: a new method makes the rest of the spec moot.
        forward_fixed(&cur, &spec)?;
        check_service(&spec, self.0.packet_cfg.as_ref())?;
        let new_backends: Vec<String> = spec
            .backends
            .iter()
            .filter(|b| !cur.backends.iter().any(|c| c.address == b.address))
            .map(|b| format!("backend {tenant}/{name}/{}", b.address))
            .collect();
        // Forgotten as a deletion of them forgets them: else each edit to
        // a new backend set left its backends' entries behind, and a
        // tenant token's edits grew `runtime_added` without bound.
        let removed_backends: Vec<String> = cur
            .backends
            .iter()
            .filter(|c| !spec.backends.iter().any(|b| b.address == c.address))
            .map(|c| format!("backend {tenant}/{name}/{}", c.address))
            .collect();
        // Port 0 in an edit means "keep the port the service got".
        let rebind = cur.protocol != spec.protocol
            || (cur.listen != spec.listen
                && !(spec.listen.port() == 0 && cur.listen.ip() == spec.listen.ip()));
        if rebind {
            // A new address or protocol: replace the service (its
            // connections close), but only once the new address is ours.
            self.0.put_service_with(spec, true, caps)?;
            self.forget_backends(&removed_backends);
            new_backends
                .into_iter()
                .for_each(|id| self.added_at_runtime(id));
            return Ok(());
        }
        if caps == Caps::EachChange {
            super::model::backend_quota(
                &self.0.model.load(),
                tenant,
                name,
                spec.backends.len(),
                &mut Default::default(),
            )?;
        }
        let params = self.0.with_profile(&svc.tenant, service_params(&spec)?)?;
        let sched_key = |s: &ServiceSpec| {
            let o = &s.options;
            (
                s.scheduler,
                (o.mh_fallback, o.sh_fallback, o.sh_port, o.mh_port),
                o.mh_table_size,
                o.hash_seed.clone(),
            )
        };
        if sched_key(&cur) != sched_key(&spec) {
            // A new algorithm: a fresh scheduler over the same live backends
            // (no history to carry over); connections are untouched.
            let old = svc.set.load_full();
            let sched = super::build_sched(&spec, &old.backends)?;
            svc.set.store(Arc::new(BackendSet {
                sched,
                backends: old.backends.clone(),
            }));
        }
        let (mask, persists) = (params.mask, !params.persistence.is_zero());
        let prefix6 = params.client_prefix6;
        let old = svc.params.swap(Arc::new(params));
        if old.client_prefix6 != prefix6 {
            svc.tcp_per_client.lock().regroup(prefix6);
            svc.udp_per_client.lock().regroup(prefix6);
        }
        if old.mask != mask || (!old.persistence.is_zero() && !persists) {
            // The client groups changed, or persistence is off: the old
            // templates place no one any more.
            self.0.drop_templates(&svc);
        }
        let backends = spec.backends.clone();
        {
            let mut s = svc.spec.write();
            *s = ServiceSpec {
                listen: cur.listen,
                ..spec
            };
        }
        self.set_backends(&svc, &backends)?;
        self.0.services_changed();
        self.0.start_health(&svc);
        self.forget_backends(&removed_backends);
        new_backends
            .into_iter()
            .for_each(|id| self.added_at_runtime(id));
        Ok(())
    }

    /// Adds the services of `specs` (emptying it) as one batch, each
    /// failure an error of `errors` as [`Self::apply`] words them.
    fn add_batch(&self, specs: &mut Vec<ServiceSpec>, errors: &mut Vec<String>) {
        if specs.is_empty() {
            return;
        }
        let names: Vec<String> = specs
            .iter()
            .map(|s| format!("{}/{}", s.tenant, s.name))
            .collect();
        for (i, e) in self.0.add_services_of_file(std::mem::take(specs)) {
            errors.push(format!("service {}: {}", names[i], e.message));
        }
    }

    /// Forget the backends `ids` ("backend T/S/ADDR"): removed through the
    /// API, so no reload removes them.
    fn forget_backends(&self, ids: &[String]) {
        if ids.is_empty() {
            return;
        }
        let mut added = self.0.model.runtime_added.lock();
        for id in ids {
            added.remove(id);
        }
    }

    /// Remember that `id` was added through the API (see [`ReloadOptions::force`]).
    fn added_at_runtime(&self, id: String) {
        self.0.model.runtime_added.lock().insert(id);
    }

    /// Forget `id` and every object whose name starts with `scope`
    /// ("TENANT/" or "TENANT/SERVICE/"): deleted through the API, so no
    /// reload removes them.
    /// Deletes the tenants `names` with their services, each as a lone
    /// [`Control::delete_tenant`] would (the default tenant, a tenant that
    /// does not exist or was named earlier in the batch fail), in one pass:
    /// their services leave the model in one change and stop listening,
    /// then the tenants in another, and the flow table purges them in one
    /// batch ([`weir_flowtable::FlowTable::remove_tenants`]: one copy of
    /// its directory; one at a time was O(T x tenants) for a reload
    /// deleting T). The purged entries' connections and sessions are told
    /// and settled on the services just taken out. Killing service by
    /// service, as this did, paged through the tenant's table once per
    /// service (and once more for its templates), O(services x entries)
    /// before the purge removed them all anyway. Returns, per name, how
    /// many connections and flows were told to close.
    pub(super) fn delete_tenants(&self, names: &[String]) -> Vec<ControlResult<u64>> {
        let mut results: Vec<Option<ControlResult<u64>>> = names.iter().map(|_| None).collect();
        let mut valid: Vec<usize> = Vec::new();
        let keys: Vec<(String, String)> = {
            let st = self.0.model.load();
            let mut seen = std::collections::HashSet::new();
            for (i, name) in names.iter().enumerate() {
                if name == config::DEFAULT_TENANT {
                    // Every config without [[tenant]] sections, and every
                    // service without `tenant =`, needs it: a reload would
                    // fail afterwards.
                    results[i] = Some(Err(ControlError::new(
                        ErrorKind::Conflict,
                        format!(
                            "the {:?} tenant cannot be deleted: services without a tenant \
                             belong to it and every reload needs it; delete its services instead",
                            config::DEFAULT_TENANT
                        ),
                    )));
                } else if !st.tenants.contains_key(name) || !seen.insert(name.as_str()) {
                    results[i] = Some(Err(not_found(format!("tenant {name:?} does not exist"))));
                } else {
                    valid.push(i);
                }
            }
            // Ranges of the map, not a walk of every tenant's services.
            valid
                .iter()
                .flat_map(|&i| {
                    let name = &names[i];
                    st.services
                        .range((name.clone(), String::new())..)
                        .map(|(k, _)| k)
                        .take_while(move |(t, _)| t == name)
                        .cloned()
                })
                .collect()
        };
        let mut gone: Vec<_> = self.0.take_services(&keys).into_iter().flatten().collect();
        gone.sort_by_key(|s| s.id);
        let removed: Vec<(usize, Arc<super::model::Tenant>)> = {
            let mut st = self.0.model.write();
            valid
                .iter()
                .filter_map(|&i| Some((i, st.tenants.remove(&names[i])?)))
                .collect()
        };
        for &i in &valid {
            // Unless removed below (else someone deleted it meanwhile).
            results[i] = Some(Err(not_found(format!(
                "tenant {:?} does not exist",
                names[i]
            ))));
        }
        let ids: Vec<TenantId> = removed.iter().map(|(_, t)| TenantId(t.id)).collect();
        for (_, t) in &removed {
            t.deleted.cancel();
        }
        let mut purged = Vec::new();
        let counts = self.0.conns.table.remove_tenants(&ids, &mut purged);
        let mut at = 0;
        for ((i, _), n) in removed.iter().zip(counts) {
            let n = n.unwrap_or(0);
            let closed = self
                .0
                .ended_among(&purged[at..at + n], Close::TenantDeleted, &gone);
            at += n;
            results[*i] = Some(Ok(closed));
        }
        self.0.retired(&gone);
        let deleted: std::collections::HashSet<&str> =
            removed.iter().map(|(i, _)| names[*i].as_str()).collect();
        self.forget_tenants(&deleted);
        results
            .into_iter()
            .map(|r| r.expect("every name has a result"))
            .collect()
    }

    /// [`Self::forget_runtime`] for tenants `names` and everything in them.
    fn forget_tenants(&self, names: &std::collections::HashSet<&str>) {
        if names.is_empty() {
            return;
        }
        // "tenant NAME", or "KIND NAME/...": one pass for the batch.
        self.0.model.runtime_added.lock().retain(|x| {
            let Some((kind, rest)) = x.split_once(' ') else {
                return true;
            };
            let the_tenant = kind == "tenant" && names.contains(rest);
            let in_it = rest.split_once('/').is_some_and(|(t, _)| names.contains(t));
            !the_tenant && !in_it
        });
    }

    fn forget_runtime(&self, id: &str, scope: &str) {
        self.0
            .model
            .runtime_added
            .lock()
            .retain(|x| x != id && !x.split_once(' ').is_some_and(|(_, n)| n.starts_with(scope)));
    }

    /// Removes a service and tells its connections to close; returns how
    /// many it told ([`Shared::remove_services`] with a batch of one).
    fn remove_service(&self, key: &(String, String)) -> Option<u64> {
        self.0
            .remove_services(std::slice::from_ref(key))
            .pop()
            .flatten()
    }
}

/// Why [`LiveControl::apply`] would fail part-way for want of an address
/// that one of our own services still holds. It applies the file's
/// services in file order, after removing those the file does not have:
/// a service added or moved to an address that another service of the
/// file leaves only later in the file (or not at all: port 0 keeps its
/// port) would be refused there, after the changes before it applied.
/// `probe_free` passes such an address (it is ours), so the plan has to
/// follow the order itself.
fn order_problems(
    services: &super::model::Services,
    new: &Config,
    in_file: &std::collections::HashSet<(&str, &str)>,
) -> Vec<String> {
    use std::collections::HashMap;
    let mut errors = Vec::new();
    // Who holds each address as the steps go: the services the file keeps.
    let mut held: HashMap<(config::Protocol, std::net::SocketAddr), (String, String)> = services
        .iter()
        .filter(|((t, n), _)| in_file.contains(&(t.as_str(), n.as_str())))
        .map(|(k, s)| ((s.spec.read().protocol, s.listen), k.clone()))
        .collect();
    for s in &new.services {
        let key = (s.tenant.clone(), s.name.clone());
        let cur = services.get(&key).map(|c| {
            let c = c.spec.read();
            (c.protocol, c.listen)
        });
        let takes = match cur {
            None => true,
            Some((proto, listen)) => {
                proto != s.protocol
                    || (listen != s.listen
                        && !(s.listen.port() == 0 && listen.ip() == s.listen.ip()))
            }
        };
        if !takes {
            continue;
        }
        if s.listen.port() != 0
            && let Some((t, n)) = held.get(&(s.protocol, s.listen))
            && (*t != s.tenant || *n != s.name)
        {
            errors.push(format!(
                "service {}/{}: {} {} is service {t}/{n}'s until the reload moves that one, \
                 which it does later (in file order) or not at all: list service {t}/{n} \
                 first, or move one of them through a free address in two reloads",
                s.tenant,
                s.name,
                config::protocol_name(s.protocol),
                s.listen
            ));
        }
        if let Some(old) = cur {
            held.remove(&old);
        }
        if s.listen.port() != 0 {
            held.insert((s.protocol, s.listen), key);
        }
    }
    errors
}

/// A tenant's `GET /v1/table` row from its flow-table figures.
fn table_report(tenant: String, st: weir_flowtable::TableStats) -> TableReport {
    TableReport {
        tenant,
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
    }
}

/// The name of every tenant of `c`: a reload asks whether each live tenant,
/// and each service's tenant, is in the file, and searching the file's list
/// for each was O(T^2) name comparisons for T tenants.
fn tenant_names(c: &Config) -> std::collections::HashSet<&str> {
    c.tenants.iter().map(|t| t.name.as_str()).collect()
}

/// The (tenant, name) of every service of `c`: a reload asks whether each
/// live service is in the file, and searching the file's list for each
/// (O(S^2) name comparisons) was the largest cost of reloading 8,000
/// unchanged services.
fn service_names(c: &Config) -> std::collections::HashSet<(&str, &str)> {
    c.services
        .iter()
        .map(|s| (s.tenant.as_str(), s.name.as_str()))
        .collect()
}

/// The part of a [`ConnFilter`] a dump filter cannot say (names are
/// matched through the services of the moment).
///
/// Each entry's service is one look-up in the model snapshot's id index:
/// a map of every service built per call (per page listed, per kill) cost
/// ~10 ms at 100,000 services whatever the page size.
struct ConnMatch {
    state: Arc<super::model::State>,
    service: Option<String>,
    /// In [`canonical`] form.
    backend: Option<std::net::SocketAddr>,
}

impl ConnMatch {
    /// The entry's service and backend address, if it passes.
    fn check(&self, snap: &FlowSnapshot) -> Option<(&Arc<Service>, Option<String>)> {
        let svc = self.state.services.by_id(snap.service.0)?;
        let backend = svc.backend(snap.backend.0);
        let ok = self
            .service
            .as_ref()
            .is_none_or(|s| *s == svc.spec.read().name)
            && self
                .backend
                .is_none_or(|want| backend.as_ref().is_some_and(|b| canonical(b.addr) == want));
        ok.then(|| (svc, backend.map(|b| b.addr.to_string())))
    }
}

/// `a` with an IPv4-mapped IPv6 address as the IPv4 one (the same
/// endpoint on a dual-stack host), for comparing addresses.
fn canonical(a: std::net::SocketAddr) -> std::net::SocketAddr {
    std::net::SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// Whether a backend's address is the one `address` names: compared as
/// one address ([`canonical`]), so that an edit or a delete finds a
/// backend under either spelling of an IPv4-mapped address, as an add
/// under the other spelling is refused as existing. What is not IP:PORT
/// names no backend.
fn named_by(address: &str) -> impl Fn(std::net::SocketAddr) -> bool {
    let want = address.parse().ok().map(canonical);
    move |a| Some(canonical(a)) == want
}

/// A tenant's status (its token left out), with its own counters.
fn tenant_status(t: &super::Tenant) -> TenantStatus {
    let mut spec = t.spec.read().clone();
    spec.token = None;
    TenantStatus {
        table: t.placement.clone(),
        spec,
        active_conns: t.active.load(Relaxed),
        refused: t.refused.load(Relaxed),
        figures: Some(t.stat.read()),
    }
}

/// One tenant's services, in (tenant, name) order: a range of the model's
/// map, not a walk of every tenant's.
fn tenant_services<'a>(
    st: &'a super::model::State,
    tenant: &'a str,
) -> impl Iterator<Item = &'a Arc<Service>> + 'a {
    st.services
        .range((tenant.to_owned(), String::new())..)
        .take_while(move |((t, _), _)| t == tenant)
        .map(|(_, s)| s)
}

/// The health of the backends of `svcs`, service by service.
fn health_entries<'a>(svcs: impl Iterator<Item = &'a Arc<Service>>) -> Vec<HealthEntry> {
    let mut out = Vec::new();
    for s in svcs {
        let spec = s.spec.read().clone();
        for b in s.set.load().backends.iter() {
            out.push(HealthEntry {
                tenant: spec.tenant.clone(),
                service: spec.name.clone(),
                backend: b.addr.to_string(),
                state: health_name(b).into(),
                last_error: if b.passive.is_down() {
                    b.passive_error.lock().clone()
                } else {
                    b.last_error.lock().clone()
                },
            });
        }
    }
    out
}

/// A service's spec with its backends' live weights (set through the API
/// since the spec was written).
fn live_spec(s: &Service) -> ServiceSpec {
    let mut spec = s.spec.read().clone();
    let set = s.set.load();
    for b in spec.backends.iter_mut() {
        if let Some(live) = set.backends.iter().find(|x| x.addr == b.address) {
            b.weight = live.weight.load(Relaxed);
        }
    }
    spec
}

/// The keys whose values differ between two versions of a config section,
/// with both values, in key order. A key present in one only counts as a
/// difference.
fn section_changes<T: serde::Serialize>(
    running: &T,
    new: &T,
) -> Vec<(String, serde_json::Value, serde_json::Value)> {
    let as_map = |v: &T| match serde_json::to_value(v) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    let (a, b) = (as_map(running), as_map(new));
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let none = serde_json::Value::Null;
    keys.into_iter()
        .filter_map(|k| {
            let (x, y) = (a.get(k).unwrap_or(&none), b.get(k).unwrap_or(&none));
            (x != y).then(|| (k.clone(), x.clone(), y.clone()))
        })
        .collect()
}

/// Why a tenant's `max_table_entries` cannot change live: the flow table
/// fixes a table's cap when it creates the table (`TenantConfig::max_entries`)
/// and has no call to move it.
/// `forward` cannot change on a live service: a proxy service's flows are
/// sockets and a packet service's are rewritten packets, and neither can
/// carry on as the other.
fn forward_fixed(cur: &ServiceSpec, new: &ServiceSpec) -> ControlResult<()> {
    if cur.forward == new.forward {
        return Ok(());
    }
    Err(ControlError::new(
        ErrorKind::Invalid,
        format!(
            "forward cannot change on a live service ({} -> {}): its connections are {} and \
             cannot move to the other data path; delete the service and add it again with \
             forward = \"{}\"",
            cur.forward,
            new.forward,
            if cur.forward.is_packet() {
                "forwarded packets"
            } else {
                "proxied sockets"
            },
            new.forward
        ),
    ))
}

fn cap_fixed(cur: usize, new: usize) -> String {
    format!(
        "max_table_entries cannot change on a live tenant: its flow table's cap was fixed at \
         creation ({cur}); delete the tenant and create it again with max_table_entries = {new}"
    )
}

fn tenant_id(name: &str) -> String {
    format!("tenant {name}")
}

/// `new` with the running port when it asks for port 0 on the same address
/// (port 0 means "any free port", which the service already has).
fn same_port(cur: &ServiceSpec, new: &ServiceSpec) -> ServiceSpec {
    let mut s = new.clone();
    if s.protocol == cur.protocol && s.listen.port() == 0 && s.listen.ip() == cur.listen.ip() {
        s.listen = cur.listen;
    }
    s
}

fn health_name(b: &Backend) -> &'static str {
    if b.passive.is_down() {
        "down"
    } else if !b.checked.load(Relaxed) {
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
            .model
            .load()
            .tenants
            .values()
            .map(|t| tenant_status(t))
            .collect()
    }

    fn tenant_status(&self, tenant: &str) -> Vec<TenantStatus> {
        self.0
            .model
            .load()
            .tenants
            .get(tenant)
            .map(|t| tenant_status(t))
            .into_iter()
            .collect()
    }

    fn add_tenant(&self, spec: TenantSpec) -> ControlResult<()> {
        self.write_checked(CheckedWrite::AddTenant(spec), &mut || Ok(()))
    }

    fn edit_tenant(&self, tenant: &str, spec: TenantSpec) -> ControlResult<()> {
        // With the edits: an add checks the tenant's `max_services` or
        // `max_backends` under them, then makes its change, and an edit
        // between the two returned while an add checked against the old
        // limits was still to go in. Now the edit waits for it, and every
        // add after the edit is checked against the new limits (a lowered
        // limit keeps what the tenant holds: only new adds are refused).
        let _one = self.0.model.lock_edits();
        self.edit_tenant_locked(tenant, spec)
    }

    fn update_tenant(&self, tenant: &str, edit: TenantEdit<'_>) -> ControlResult<()> {
        // With the edits from the read to the write: a reload's apply (on
        // a thread of its own, the edits held) or another edit replacing
        // the settings between the two was undone by settings merged from
        // the ones it replaced.
        let _one = self.0.model.lock_edits();
        let spec = edit(self.tenant_spec(tenant))?;
        self.edit_tenant_locked(tenant, spec)
    }

    fn delete_tenant(&self, tenant: &str) -> ControlResult<u64> {
        // With the edits, as an add is: `delete_tenants` takes the
        // tenant's services, then the tenant, and a service added between
        // the two would stay under a tenant that is gone.
        let _one = self.0.model.lock_edits();
        self.delete_tenants(&[tenant.to_owned()])
            .pop()
            .expect("one result per tenant")
    }

    fn services(&self) -> Vec<ServiceStatus> {
        let svcs: Vec<_> = self.0.model.load().services.values().cloned().collect();
        svcs.iter().map(|s| self.status(s)).collect()
    }

    // A spec built in code (not deserialized, which reads backend
    // addresses so) gets its backends' IPv4-mapped addresses read as IPv4
    // here: one spelling, so edits and reloads that match backends by
    // address find them whichever way a caller wrote them.
    fn add_service(&self, mut spec: ServiceSpec) -> ControlResult<()> {
        spec.canonicalise_backends();
        self.write_checked(CheckedWrite::AddService(spec), &mut || Ok(()))
    }

    fn edit_service(&self, tenant: &str, name: &str, mut spec: ServiceSpec) -> ControlResult<()> {
        spec.canonicalise_backends();
        let write = CheckedWrite::EditService { tenant, name, spec };
        self.write_checked(write, &mut || Ok(()))
    }

    fn delete_service(&self, tenant: &str, name: &str) -> ControlResult<()> {
        self.write_checked(CheckedWrite::DeleteService { tenant, name }, &mut || Ok(()))
    }

    fn add_backend(&self, tenant: &str, service: &str, spec: BackendSpec) -> ControlResult<()> {
        let write = CheckedWrite::AddBackend {
            tenant,
            service,
            spec: spec.canonical(),
        };
        self.write_checked(write, &mut || Ok(()))
    }

    fn write_checked(&self, write: CheckedWrite<'_>, check: Check<'_>) -> ControlResult<()> {
        // With the edits, and the caller's check run under them: a fence
        // reads the tenant's settings (which a tenant edit changes) and
        // weir's own addresses (which a service add or edit changes), a new
        // tenant's token is checked against every tenant's (which another
        // creation or a tenant edit changes), `max_backends` and
        // `max_services` count what the tenant holds, and a tenant token
        // must still name the tenant it writes to (a tenant edit or a
        // deletion and re-creation changes that); each would change
        // between the check and the write without them.
        let _one = self.0.model.lock_edits();
        check()?;
        match write {
            CheckedWrite::AddTenant(spec) => {
                let id = tenant_id(&spec.name);
                self.0.add_tenant(spec)?;
                self.added_at_runtime(id);
                Ok(())
            }
            CheckedWrite::AddService(spec) => {
                let id = format!("service {}/{}", spec.tenant, spec.name);
                self.0.add_service(spec)?;
                self.added_at_runtime(id);
                Ok(())
            }
            CheckedWrite::EditService { tenant, name, spec } => {
                self.edit_service_locked(tenant, name, spec, Caps::EachChange)
            }
            CheckedWrite::AddBackend {
                tenant,
                service,
                spec,
            } => self.add_backend_locked(tenant, service, spec),
            CheckedWrite::DeleteService { tenant, name } => {
                self.delete_service_locked(tenant, name)
            }
            CheckedWrite::EditBackend {
                tenant,
                service,
                address,
                patch,
            } => self.edit_backend_locked(tenant, service, address, patch),
            CheckedWrite::DeleteBackend {
                tenant,
                service,
                address,
            } => self.delete_backend_locked(tenant, service, address),
        }
    }

    fn edit_backend(
        &self,
        tenant: &str,
        service: &str,
        address: &str,
        patch: BackendPatch,
    ) -> ControlResult<()> {
        let write = CheckedWrite::EditBackend {
            tenant,
            service,
            address,
            patch,
        };
        self.write_checked(write, &mut || Ok(()))
    }

    fn delete_backend(&self, tenant: &str, service: &str, address: &str) -> ControlResult<()> {
        let write = CheckedWrite::DeleteBackend {
            tenant,
            service,
            address,
        };
        self.write_checked(write, &mut || Ok(()))
    }

    fn connections(
        &self,
        filter: &ConnFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> ControlResult<ConnPage> {
        self.connections_checked(filter, cursor, limit, &mut || Ok(()))
    }

    fn connections_checked(
        &self,
        filter: &ConnFilter,
        cursor: Option<&str>,
        limit: usize,
        check: Check<'_>,
    ) -> ControlResult<ConnPage> {
        let invalid = |m: String| ControlError::new(ErrorKind::Invalid, m);
        let cursor = match cursor {
            None => None,
            Some(c) => Some(
                c.parse::<weir_flowtable::Cursor>()
                    .map_err(|_| invalid(format!("bad cursor {c:?}; pass back `next` as given")))?,
            ),
        };
        // The check after the tenant is found by name (its id in `df`):
        // a tenant created again under that name since has another id, so
        // the listing reaches the one the check saw or, if it was deleted
        // meanwhile, nothing.
        let (df, m) = self.conn_filter(filter)?;
        check()?;
        let limit = limit.clamp(1, 100_000);
        let now = self.0.now_ms();
        let mut snaps = Vec::with_capacity(limit.min(4096));
        let next = self
            .0
            .conns
            .table
            .dump(cursor.as_ref(), &df, limit, &mut snaps);
        let connections = snaps
            .iter()
            .filter_map(|snap| {
                let (svc, backend) = m.check(snap)?;
                let spec = svc.spec.read();
                let expires = snap.expires_at.0;
                Some(ConnInfo {
                    // A service's entries are its tenant's (the key
                    // carries the service's tenant).
                    tenant: spec.tenant.clone(),
                    service: spec.name.clone(),
                    proto: config::protocol_name(spec.protocol).to_uppercase(),
                    client: snap.key.client.to_string(),
                    virtual_: snap.key.virt.to_string(),
                    backend: backend.unwrap_or_else(|| "-".into()),
                    state: snap.state.to_string(),
                    expires_s: expires.saturating_sub(now) / 1000,
                    cookie: snap.cookie.0,
                    bytes_in: snap.bytes_in,
                    bytes_out: snap.bytes_out,
                    packets_in: snap.packets_in,
                    packets_out: snap.packets_out,
                    local: self.0.packet_local(snap),
                })
            })
            .collect();
        Ok(ConnPage {
            connections,
            next: next.map(|c| c.to_string()),
        })
    }

    fn kill(&self, cookie: u64, tenant: Option<&str>) -> ControlResult<()> {
        self.kill_checked(cookie, tenant, &mut || Ok(()))
    }

    fn kill_checked(
        &self,
        cookie: u64,
        tenant: Option<&str>,
        check: Check<'_>,
    ) -> ControlResult<()> {
        let only = match tenant {
            Some(t) => match self.0.model.load().tenants.get(t) {
                Some(t) => Some(weir_flowtable::TenantId(t.id)),
                None => return Err(not_found(format!("tenant {t:?} does not exist"))),
            },
            None => None,
        };
        // After the tenant's id is read, as a listing's check.
        check()?;
        if self
            .0
            .kill_cookie(weir_flowtable::Cookie(cookie), only, Close::Killed)
        {
            Ok(())
        } else {
            Err(not_found(format!("no connection with cookie {cookie}")))
        }
    }

    fn kill_matching(&self, filter: &ConnFilter) -> ControlResult<u64> {
        self.kill_matching_checked(filter, &mut || Ok(()))
    }

    fn kill_matching_checked(&self, filter: &ConnFilter, check: Check<'_>) -> ControlResult<u64> {
        // After the tenant's id is read, as a listing's check.
        let (df, m) = self.conn_filter(filter)?;
        check()?;
        Ok(self
            .0
            .kill_where(Close::Killed, &df, |s| m.check(s).is_some()))
    }

    fn global_stats(&self) -> GlobalStats {
        let (stats, rates) = self.0.accounting.stat.read();
        GlobalStats {
            stats,
            rates,
            active_conns: self.0.admission.active.load(Relaxed),
            refused: self.0.admission.refused.snapshot(),
            udp_dropped: self.0.accounting.udp_dropped.snapshot(),
            udp_early_drops: self.0.accounting.udp_early_drops.load(Relaxed),
            open_fds: super::open_fds(),
            fd_limit: self.0.admission.fd_limit,
            estimator_tick_seconds: self.0.accounting.rates.last_tick_ns.load(Relaxed) as f64 / 1e9,
            estimator_tick_max_seconds: self.0.accounting.rates.max_tick_ns.load(Relaxed) as f64
                / 1e9,
            workers: Some(self.0.steering.stats()),
            packet: self.0.packet.get().map(|p| p.sums()),
        }
    }

    fn table(&self) -> Vec<TableReport> {
        let tenants: Vec<_> = self.0.model.load().tenants.values().cloned().collect();
        // One read of each table's buckets for all tenants (the shared
        // table's once, not once per tenant that shares it).
        let mut stats: std::collections::HashMap<u32, _> = self
            .0
            .conns
            .table
            .all_tenant_stats()
            .into_iter()
            .map(|(id, st)| (id.0, st))
            .collect();
        tenants
            .iter()
            .filter_map(|t| {
                Some(table_report(
                    t.spec.read().name.clone(),
                    stats.remove(&t.id)?,
                ))
            })
            .collect()
    }

    fn table_of(&self, tenant: &str) -> Vec<TableReport> {
        let Some(t) = self.0.model.load().tenants.get(tenant).cloned() else {
            return Vec::new();
        };
        // What the tenant may see: a tenant sharing the table does not get
        // (nor pay for) the shared table's chain figures.
        let st = self.0.conns.table.tenant_own_stats(TenantId(t.id));
        st.map(|st| table_report(tenant.to_string(), st))
            .into_iter()
            .collect()
    }

    fn services_of(&self, tenant: &str) -> Vec<ServiceStatus> {
        let st = self.0.model.load();
        tenant_services(&st, tenant)
            .map(|s| self.status(s))
            .collect()
    }

    fn health(&self) -> Vec<HealthEntry> {
        let st = self.0.model.load();
        health_entries(st.services.values())
    }

    fn health_of(&self, tenant: &str) -> Vec<HealthEntry> {
        let st = self.0.model.load();
        health_entries(tenant_services(&st, tenant))
    }

    fn for_each_tenant_token(&self, f: &mut dyn FnMut(&str, &str)) {
        for t in self.0.model.load().tenants.values() {
            let spec = t.spec.read();
            // Trimmed, as every other token is (the files' tokens, the
            // roles check): one set with spaces around it through the API
            // could never be presented (an HTTP header's value is trimmed).
            if let Some(tok) = spec
                .token
                .as_deref()
                .map(str::trim)
                .filter(|t| !t.is_empty())
            {
                f(&spec.name, tok);
            }
        }
    }

    fn reserve_tokens(&self, roles: crate::control::TokenRoles) {
        let _ = self.0.reserved_tokens.0.set(roles);
    }

    fn running_config(&self) -> Config {
        let st = self.0.model.load();
        Config {
            daemon: self.0.daemon_now(),
            admin: self.0.admin_cfg.clone(),
            packet: self.0.packet_cfg.clone(),
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
            services: st.services.values().map(|s| live_spec(s)).collect(),
        }
    }

    fn tenant_spec(&self, tenant: &str) -> Option<TenantSpec> {
        Some(self.0.model.load().tenants.get(tenant)?.spec.read().clone())
    }

    fn service_spec(&self, tenant: &str, service: &str) -> Option<ServiceSpec> {
        let st = self.0.model.load();
        let s = st.services.get(&(tenant.to_owned(), service.to_owned()))?;
        Some(live_spec(s))
    }

    fn own_service_at(
        &self,
        protocol: config::Protocol,
        addr: std::net::SocketAddr,
    ) -> Option<String> {
        let st = self.0.model.load();
        let s = st
            .services
            .reached_at(protocol, addr, crate::daemon::host_has_ip)?;
        let spec = s.spec.read();
        Some(format!("{}/{}", spec.tenant, spec.name))
    }

    fn reload(&self, opts: ReloadOptions) -> Result<ReloadReport, Vec<String>> {
        let Some(path) = self.0.config_path.clone() else {
            return Err(vec![
                "the daemon was started without a config file; nothing to reload".into(),
            ]);
        };
        // Reloads one at a time; parsing happens before any state lock.
        let _one = self.0.model.reload_lock.lock();
        let text = std::fs::read_to_string(&path)
            .map_err(|e| vec![format!("cannot read {}: {e}", path.display())])?;
        if text.trim().is_empty() {
            return Err(vec![format!(
                "{} is empty: a reload would remove every tenant and service (a truncated \
                 write?); write the configuration and reload again",
                path.display()
            )]);
        }
        let new = config::parse(&text, &path.display().to_string())
            .map_err(|errs| errs.iter().map(ToString::to_string).collect::<Vec<_>>())?;
        // The edits from the plan to the end, as an API edit holds them
        // from its check to its change: the plan lists what the file would
        // remove that the API added (which needs `force`), and the apply
        // removes whatever the file lacks. Taken for the apply alone, an
        // API add between the two went unlisted and was removed without
        // `force` (one between the apply and the clearing of
        // `runtime_added` lost its mark, and the next reload did the
        // same). Through `lock_edits`, as an API edit: a reload waiting
        // for one is counted in `edits_waiting`, and waits off the runtime
        // if it ever runs on one.
        let _edits = self.0.model.lock_edits();
        let mut report = self.plan(&new)?;
        let runtime: Vec<String> = {
            let added = self.0.model.runtime_added.lock();
            let removed: std::collections::HashSet<&str> =
                report.removed.iter().map(String::as_str).collect();
            // A backend of a service the file removes goes with it, and
            // the report names the service alone (a removed tenant's
            // services it names): checking only what it names let such a
            // backend go without force.
            let of_removed_service = |id: &str| {
                id.strip_prefix("backend ")
                    .and_then(|rest| rest.rsplit_once('/'))
                    .is_some_and(|(svc, _)| removed.contains(format!("service {svc}").as_str()))
            };
            added
                .iter()
                .filter(|id| removed.contains(id.as_str()) || of_removed_service(id))
                .cloned()
                .collect()
        };
        if !runtime.is_empty() && !opts.force {
            let mut errors = vec![format!(
                "the file does not have {} object(s) added through the API since the last \
                 reload; add them to the file, or reload with --force (API: force=true) to \
                 remove them",
                runtime.len()
            )];
            errors.extend(runtime.into_iter().map(|r| format!("would remove {r}")));
            return Err(errors);
        }
        #[cfg(test)]
        self.0.model.planned();
        if opts.dry_run {
            return Ok(report);
        }
        // SIGHUP and POST /v1/reload both come here: systemd sees the
        // reload start and end (READY=1 also after a partial failure: the
        // daemon serves on, with the errors in the log and the answer).
        crate::systemd::reloading();
        let errors = self.apply(&new);
        crate::systemd::ready(if errors.is_empty() {
            "serving; last reload applied"
        } else {
            "serving; last reload had errors (see the log)"
        });
        self.0.model.runtime_added.lock().clear();
        if errors.is_empty() {
            tracing::info!(
                path = %path.display(),
                added = report.added.len(),
                changed = report.changed.len(),
                removed = report.removed.len(),
                "configuration reloaded"
            );
            for (what, list) in [
                ("added", &report.added),
                ("changed", &report.changed),
                ("removed", &report.removed),
            ] {
                for item in list {
                    tracing::info!("reload: {what} {item}");
                }
            }
            report.applied = true;
            Ok(report)
        } else {
            Err(errors)
        }
    }
}

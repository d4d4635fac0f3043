//! A model-based property test of the control plane: sequences of tenant,
//! service and backend additions, edits and deletions, and reloads from a
//! generated file, applied to a real daemon (one worker, services on
//! 127.0.0.1 port 0, no traffic) through [`Control`] and to a small
//! reference model, compared after every step.
//!
//! After each step: the call's result (ok, or the kind of its error) is the
//! model's; the tenants and the services with their protocol, scheduler and
//! backends (address as stored, weight, in order) are the model's; a
//! backend the model keeps across the step keeps its id in the daemon (the
//! id its flows carry); the running configuration and each tenant's own
//! listing say the same as the listing; a reload (or its dry run) reports
//! what the model says it adds, changes and removes; and no error is of a
//! kind no request of these may get (`Unavailable`, `Forbidden`,
//! `Unauthorized`).
//!
//! Identity is what past defects got wrong: an address written two ways
//! (`[::ffff:127.0.0.9]:9001` and `127.0.0.9:9001`), a tenant or service
//! deleted and created again, what a reload counts as added through the API.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::Path;

use proptest::prelude::*;

use crate::config::{BackendSpec, Config, Protocol, ServiceOptions, ServiceSpec, TenantSpec};
use crate::control::{BackendPatch, Control, ControlError, ErrorKind, ReloadOptions};
use crate::daemon::DaemonHandle;

/// Tenants the steps name; `default` always exists and cannot be deleted.
const TENANTS: [&str; 3] = ["default", "t1", "t2"];
/// Service names (in each tenant).
const SERVICES: [&str; 2] = ["a", "b"];
/// Backend ports, on 127.0.0.9 (nothing listens: no health checks, no
/// traffic).
const PORTS: [u16; 3] = [9001, 9002, 9003];
/// Schedulers a service gets.
const SCHEDULERS: [&str; 5] = ["rr", "wrr", "wlc", "sh", "mh"];
/// Weights: 70,000 is above the maximum, 65,535, and is refused.
const WEIGHTS: [u32; 5] = [0, 1, 5, 65535, 70_000];
/// A capped tenant's `max_services` and `max_backends` (the others have
/// none; `default` is never capped).
const MAX_SERVICES: usize = 1;
const MAX_BACKENDS: usize = 3;

/// Tenant `name`'s settings, capped or not.
fn tenant_spec(name: &str, capped: bool) -> TenantSpec {
    let (max_services, max_backends) = if capped {
        (MAX_SERVICES as u64, MAX_BACKENDS as u64)
    } else {
        (0, 0)
    };
    TenantSpec {
        name: name.into(),
        max_services,
        max_backends,
        ..Default::default()
    }
}

/// Backend `i` in its plain spelling, or as an IPv4-mapped IPv6 address.
fn backend_addr(i: usize, mapped: bool) -> SocketAddr {
    let v4 = std::net::Ipv4Addr::new(127, 0, 0, 9);
    let ip = if mapped {
        std::net::IpAddr::V6(v4.to_ipv6_mapped())
    } else {
        std::net::IpAddr::V4(v4)
    };
    SocketAddr::new(ip, PORTS[i])
}

/// The address compared as one endpoint (the mapped spelling as IPv4).
fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// One backend of a service spec the steps write: its index in [`PORTS`],
/// the index of its weight, and whether it is written mapped.
type BackendPick = (usize, usize, bool);

/// Where a service listens: TCP or UDP, on 127.0.0.1 or 127.0.0.2 (port
/// 0). A service edited to another place is replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Place {
    udp: bool,
    ip2: bool,
}

/// A service as a step writes it.
#[derive(Debug, Clone)]
struct ServicePick {
    tenant: usize,
    name: usize,
    at: Place,
    scheduler: usize,
    backends: Vec<BackendPick>,
}

#[derive(Debug, Clone)]
enum Op {
    /// Add tenant `.0`, capped if `.1`.
    AddTenant(usize, bool),
    /// Replace tenant `.0`'s settings: capped if `.1`.
    EditTenant(usize, bool),
    DeleteTenant(usize),
    AddService(ServicePick),
    EditService(ServicePick),
    DeleteService {
        tenant: usize,
        name: usize,
    },
    AddBackend {
        tenant: usize,
        name: usize,
        backend: BackendPick,
    },
    EditBackend {
        tenant: usize,
        name: usize,
        backend: usize,
        mapped: bool,
        weight: Option<usize>,
        drain: Option<bool>,
    },
    DeleteBackend {
        tenant: usize,
        name: usize,
        backend: usize,
        mapped: bool,
    },
    /// A reload of a file with the `default` tenant, the other tenants
    /// that are `Some` (capped if true), and these services (the first of
    /// a tenant and name kept; a service of a tenant not in the file, or
    /// over a cap, makes the file invalid).
    Reload {
        force: bool,
        dry_run: bool,
        tenants: [Option<bool>; 2],
        services: Vec<ServicePick>,
    },
    /// A reload, without force, of what `weir save` prints (the running
    /// configuration): it changes nothing, and needs no force; unless a
    /// tenant holds more than caps lowered since allow (a lowered cap
    /// keeps what is there, and a file over a cap is refused).
    SaveReload,
}

/// A tenant: `default`, which always exists, as often as the others.
fn tenant() -> impl Strategy<Value = usize> + Clone {
    prop_oneof![2 => Just(0), 1 => Just(1), 1 => Just(2)]
}

/// A weight, the one refused now and then.
fn weight() -> impl Strategy<Value = usize> + Clone {
    prop_oneof![6 => 0..WEIGHTS.len() - 1, 1 => Just(WEIGHTS.len() - 1)]
}

fn backend_pick() -> impl Strategy<Value = BackendPick> {
    (0..PORTS.len(), weight(), any::<bool>())
}

fn service_pick() -> impl Strategy<Value = ServicePick> {
    (
        tenant(),
        0..SERVICES.len(),
        (
            any::<bool>(),
            prop_oneof![3 => Just(false), 1 => Just(true)],
        ),
        0..SCHEDULERS.len(),
        proptest::collection::vec(backend_pick(), 0..3),
    )
        .prop_map(
            |(tenant, name, (udp, ip2), scheduler, backends)| ServicePick {
                tenant,
                name,
                at: Place { udp, ip2 },
                scheduler,
                backends,
            },
        )
}

fn op() -> impl Strategy<Value = Op> {
    let t = tenant();
    let s = 0..SERVICES.len();
    let b = 0..PORTS.len();
    prop_oneof![
        2 => (t.clone(), any::<bool>()).prop_map(|(t, capped)| Op::AddTenant(t, capped)),
        1 => (t.clone(), any::<bool>()).prop_map(|(t, capped)| Op::EditTenant(t, capped)),
        1 => t.clone().prop_map(Op::DeleteTenant),
        3 => service_pick().prop_map(Op::AddService),
        2 => service_pick().prop_map(Op::EditService),
        1 => (t.clone(), s.clone()).prop_map(|(tenant, name)| Op::DeleteService { tenant, name }),
        4 => (t.clone(), s.clone(), backend_pick())
            .prop_map(|(tenant, name, backend)| Op::AddBackend { tenant, name, backend }),
        3 => (
            t.clone(),
            s.clone(),
            b.clone(),
            any::<bool>(),
            proptest::option::of(weight()),
            proptest::option::of(any::<bool>()),
        )
            .prop_map(|(tenant, name, backend, mapped, weight, drain)| Op::EditBackend {
                tenant,
                name,
                backend,
                mapped,
                weight,
                drain,
            }),
        3 => (t, s, b, any::<bool>()).prop_map(|(tenant, name, backend, mapped)| {
            Op::DeleteBackend { tenant, name, backend, mapped }
        }),
        1 => (
            (any::<bool>(), any::<bool>()),
            any::<[Option<bool>; 2]>(),
            proptest::collection::vec(service_pick(), 0..4),
        )
            .prop_map(|((force, dry_run), tenants, services)| Op::Reload { force, dry_run, tenants, services }),
        1 => Just(Op::SaveReload),
    ]
}

/// A backend of the model: the address as it was written when the service
/// got it, its weight, and a number the model gives each backend it
/// creates (kept while the model keeps the backend).
#[derive(Debug, Clone)]
struct MBackend {
    addr: SocketAddr,
    weight: u32,
    uid: u64,
}

#[derive(Debug, Clone)]
struct MService {
    at: Place,
    scheduler: &'static str,
    backends: Vec<MBackend>,
}

/// What the daemon should hold, and what it should remember as added
/// through the API since the last reload ("tenant T", "service T/S",
/// "backend T/S/ADDR"), which a reload without force may not remove.
#[derive(Debug, Clone)]
struct Model {
    /// Each tenant, and whether it is capped.
    tenants: BTreeMap<String, bool>,
    services: BTreeMap<(String, String), MService>,
    runtime: BTreeSet<String>,
    next_uid: u64,
}

type Outcome = Result<(), ErrorKind>;

impl Model {
    fn new() -> Self {
        Self {
            tenants: BTreeMap::from([("default".to_owned(), false)]),
            services: BTreeMap::new(),
            runtime: BTreeSet::new(),
            next_uid: 0,
        }
    }

    fn uid(&mut self) -> u64 {
        self.next_uid += 1;
        self.next_uid
    }

    /// `picks` as the model's backends of a service that had `old` (none
    /// for a new or replaced service): a backend the old set has under the
    /// same address (compared as one, when the spellings are one backend
    /// to edits) keeps its uid and spelling.
    fn backends_of(&mut self, picks: &[(SocketAddr, u32)], old: &[MBackend]) -> Vec<MBackend> {
        picks
            .iter()
            .map(|&(addr, weight)| {
                match old.iter().find(|o| canonical(o.addr) == canonical(addr)) {
                    Some(o) => MBackend {
                        addr: o.addr,
                        weight,
                        uid: o.uid,
                    },
                    None => MBackend {
                        addr: canonical(addr),
                        weight,
                        uid: self.uid(),
                    },
                }
            })
            .collect()
    }

    /// Whether service `key` may have `after` backends (a new service if
    /// `new`) under its tenant's caps: a change that adds no backends to
    /// the service passes, so a lowered cap keeps what is there.
    fn within_caps(&self, key: &(String, String), after: usize, new: bool) -> bool {
        if self.tenants.get(&key.0) != Some(&true) {
            return true;
        }
        let held = || {
            self.services
                .range((key.0.clone(), String::new())..)
                .take_while(|((t, _), _)| *t == key.0)
        };
        if new && held().count() >= MAX_SERVICES {
            return false;
        }
        let current = self.services.get(key).map_or(0, |s| s.backends.len());
        let total: usize = held().map(|(_, s)| s.backends.len()).sum();
        after <= current || total - current + after <= MAX_BACKENDS
    }

    /// Forget what was added through the API under `id` and every object
    /// named under `scope` ("T/" or "T/S/").
    fn forget(&mut self, id: &str, scope: &str) {
        self.runtime
            .retain(|x| x != id && !x.split_once(' ').is_some_and(|(_, n)| n.starts_with(scope)));
    }
}

/// What a step asks: each backend in the spelling the step picked, which
/// may be the other one of an IPv4-mapped address than the service's
/// (the daemon reads both as the IPv4 address, so the backend is kept).
fn backend_specs(picks: &[BackendPick]) -> Vec<(SocketAddr, u32)> {
    picks
        .iter()
        .map(|&(i, w, mapped)| (backend_addr(i, mapped), WEIGHTS[w]))
        .collect()
}

fn listen_ip(at: Place) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(127, 0, 0, if at.ip2 { 2 } else { 1 })
}

fn key_of(p: &ServicePick) -> (String, String) {
    (TENANTS[p.tenant].to_owned(), SERVICES[p.name].to_owned())
}

fn service_spec(
    key: &(String, String),
    at: Place,
    scheduler: &str,
    backends: &[(SocketAddr, u32)],
) -> ServiceSpec {
    ServiceSpec {
        tenant: key.0.clone(),
        name: key.1.clone(),
        protocol: if at.udp { Protocol::Udp } else { Protocol::Tcp },
        listen: SocketAddr::new(listen_ip(at).into(), 0),
        forward: Default::default(),
        scheduler: crate::config::parse_scheduler(scheduler).unwrap(),
        persistence: "0s".parse().unwrap(),
        persistence_netmask: None,
        options: ServiceOptions::default(),
        backends: backends
            .iter()
            .map(|&(address, weight)| BackendSpec {
                address,
                weight,
                proxy_protocol: None,
                max_connections: 0,
            })
            .collect(),
    }
}

/// Why a spec's backends are refused (`Invalid`): one listed twice (in
/// either spelling), or a weight above 65,535.
fn backends_invalid(backends: &[(SocketAddr, u32)]) -> bool {
    let mut seen = BTreeSet::new();
    backends
        .iter()
        .any(|&(a, w)| w > weir_sched::MAX_WEIGHT || !seen.insert(canonical(a)))
}

fn kind(r: Result<impl Sized, ControlError>) -> Outcome {
    r.map(|_| ()).map_err(|e| e.kind)
}

/// Applies `op` to the daemon (`c`, reloading from `path`) and to `model`;
/// the daemon's outcome and the model's, or what else the daemon got wrong
/// (a reload's report).
fn step(
    c: &dyn Control,
    path: &Path,
    base: &Config,
    model: &mut Model,
    op: &Op,
) -> Result<(Outcome, Outcome), String> {
    use ErrorKind::*;
    match op {
        Op::AddTenant(t, capped) => {
            let name = TENANTS[*t];
            let capped = *capped && name != "default";
            let got = kind(c.add_tenant(tenant_spec(name, capped)));
            let want = if model.tenants.contains_key(name) {
                Err(Conflict)
            } else {
                model.tenants.insert(name.into(), capped);
                model.runtime.insert(format!("tenant {name}"));
                Ok(())
            };
            Ok((got, want))
        }
        Op::EditTenant(t, capped) => {
            let name = TENANTS[*t];
            let capped = *capped && name != "default";
            let got = kind(c.edit_tenant(name, tenant_spec(name, capped)));
            let want = match model.tenants.get_mut(name) {
                None => Err(NotFound),
                Some(c) => {
                    *c = capped;
                    Ok(())
                }
            };
            Ok((got, want))
        }
        Op::DeleteTenant(t) => {
            let name = TENANTS[*t];
            let got = kind(c.delete_tenant(name));
            let want = if name == "default" {
                Err(Conflict)
            } else if model.tenants.remove(name).is_none() {
                Err(NotFound)
            } else {
                model.services.retain(|(t, _), _| t != name);
                model.forget(&format!("tenant {name}"), &format!("{name}/"));
                Ok(())
            };
            Ok((got, want))
        }
        Op::AddService(p) => {
            let key = key_of(p);
            // A new service: every backend written as the step says.
            let backends: Vec<_> = p
                .backends
                .iter()
                .map(|&(i, w, mapped)| (backend_addr(i, mapped), WEIGHTS[w]))
                .collect();
            let sched = SCHEDULERS[p.scheduler];
            let got = kind(c.add_service(service_spec(&key, p.at, sched, &backends)));
            let want = if backends_invalid(&backends) {
                Err(Invalid)
            } else if !model.tenants.contains_key(&key.0) {
                Err(NotFound)
            } else if model.services.contains_key(&key)
                || !model.within_caps(&key, backends.len(), true)
            {
                Err(Conflict)
            } else {
                let backends = model.backends_of(&backends, &[]);
                model.runtime.insert(format!("service {}/{}", key.0, key.1));
                model.services.insert(
                    key,
                    MService {
                        at: p.at,
                        scheduler: sched,
                        backends,
                    },
                );
                Ok(())
            };
            Ok((got, want))
        }
        Op::EditService(p) => {
            let key = key_of(p);
            let backends = backend_specs(&p.backends);
            let sched = SCHEDULERS[p.scheduler];
            let got =
                kind(c.edit_service(&key.0, &key.1, service_spec(&key, p.at, sched, &backends)));
            let want = match model.services.get(&key).cloned() {
                None => Err(NotFound),
                Some(_) if backends_invalid(&backends) => Err(Invalid),
                Some(_) if !model.within_caps(&key, backends.len(), false) => Err(Conflict),
                Some(cur) => {
                    // A new place replaces the service: new backends.
                    let old = if cur.at == p.at {
                        &cur.backends[..]
                    } else {
                        &[]
                    };
                    let new = model.backends_of(&backends, old);
                    let id = |a: SocketAddr| format!("backend {}/{}/{a}", key.0, key.1);
                    for b in &cur.backends {
                        if !new.iter().any(|n| n.addr == b.addr) {
                            model.runtime.remove(&id(b.addr));
                        }
                    }
                    for n in &new {
                        if !cur.backends.iter().any(|b| b.addr == n.addr) {
                            model.runtime.insert(id(n.addr));
                        }
                    }
                    model.services.insert(
                        key,
                        MService {
                            at: p.at,
                            scheduler: sched,
                            backends: new,
                        },
                    );
                    Ok(())
                }
            };
            Ok((got, want))
        }
        Op::DeleteService { tenant, name } => {
            let (t, s) = (TENANTS[*tenant], SERVICES[*name]);
            let got = kind(c.delete_service(t, s));
            let want = if model.services.remove(&(t.into(), s.into())).is_some() {
                model.forget(&format!("service {t}/{s}"), &format!("{t}/{s}/"));
                Ok(())
            } else {
                Err(NotFound)
            };
            Ok((got, want))
        }
        Op::AddBackend {
            tenant,
            name,
            backend: (i, w, mapped),
        } => {
            let (t, s) = (TENANTS[*tenant], SERVICES[*name]);
            let (addr, weight) = (backend_addr(*i, *mapped), WEIGHTS[*w]);
            let got = kind(c.add_backend(
                t,
                s,
                BackendSpec {
                    address: addr,
                    weight,
                    proxy_protocol: None,
                    max_connections: 0,
                },
            ));
            let key = (t.to_owned(), s.to_owned());
            let want = match model.services.get(&key) {
                None => Err(NotFound),
                Some(svc)
                    if svc
                        .backends
                        .iter()
                        .any(|b| canonical(b.addr) == canonical(addr))
                        || !model.within_caps(&key, svc.backends.len() + 1, false) =>
                {
                    Err(Conflict)
                }
                Some(_) if weight > weir_sched::MAX_WEIGHT => Err(Invalid),
                Some(_) => {
                    let uid = model.uid();
                    let svc = model.services.get_mut(&key).unwrap();
                    // Listed, and marked as added through the API, in
                    // its IPv4 spelling whichever one the step wrote.
                    let addr = canonical(addr);
                    svc.backends.push(MBackend { addr, weight, uid });
                    model.runtime.insert(format!("backend {t}/{s}/{addr}"));
                    Ok(())
                }
            };
            Ok((got, want))
        }
        Op::EditBackend {
            tenant,
            name,
            backend,
            mapped,
            weight,
            drain,
        } => {
            let (t, s) = (TENANTS[*tenant], SERVICES[*name]);
            let addr = backend_addr(*backend, *mapped);
            let weight = weight.map(|w| WEIGHTS[w]);
            let patch = BackendPatch {
                weight,
                drain: *drain,
            };
            let got = kind(c.edit_backend(t, s, &addr.to_string(), patch));
            let key = (t.to_owned(), s.to_owned());
            let want = match model.services.get_mut(&key) {
                None => Err(NotFound),
                Some(svc) => match svc
                    .backends
                    .iter_mut()
                    .find(|b| canonical(b.addr) == canonical(addr))
                {
                    None => Err(NotFound),
                    Some(_) if weight.is_some_and(|w| w > weir_sched::MAX_WEIGHT) => Err(Invalid),
                    Some(b) => {
                        // A drain, either way, is weight 0.
                        if drain.is_some() {
                            b.weight = 0;
                        } else if let Some(w) = weight {
                            b.weight = w;
                        }
                        Ok(())
                    }
                },
            };
            Ok((got, want))
        }
        Op::DeleteBackend {
            tenant,
            name,
            backend,
            mapped,
        } => {
            let (t, s) = (TENANTS[*tenant], SERVICES[*name]);
            let addr = backend_addr(*backend, *mapped);
            let got = kind(c.delete_backend(t, s, &addr.to_string()));
            let key = (t.to_owned(), s.to_owned());
            let want = match model.services.get_mut(&key) {
                None => Err(NotFound),
                Some(svc) => match svc
                    .backends
                    .iter()
                    .position(|b| canonical(b.addr) == canonical(addr))
                {
                    None => Err(NotFound),
                    Some(at) => {
                        let gone = svc.backends.remove(at);
                        model
                            .runtime
                            .remove(&format!("backend {t}/{s}/{}", gone.addr));
                        Ok(())
                    }
                },
            };
            Ok((got, want))
        }
        Op::SaveReload => {
            let saved = toml::to_string(&c.running_config()).unwrap();
            std::fs::write(path, &saved).unwrap();
            let reloaded = c.reload(ReloadOptions::default());
            if let Ok(r) = &reloaded
                && !(r.added.is_empty() && r.changed.is_empty() && r.removed.is_empty())
            {
                return Err(format!(
                    "reloading what weir save printed changed {r:?}\n{saved}"
                ));
            }
            let over = model.tenants.iter().filter(|t| *t.1).any(|(t, _)| {
                let of_t = || model.services.iter().filter(|((o, _), _)| o == t);
                of_t().count() > MAX_SERVICES
                    || of_t().map(|(_, s)| s.backends.len()).sum::<usize>() > MAX_BACKENDS
            });
            let want = if over {
                Err(Invalid)
            } else {
                model.runtime.clear();
                Ok(())
            };
            Ok((reloaded.map(|_| ()).map_err(|_| Invalid), want))
        }
        Op::Reload {
            force,
            dry_run,
            tenants,
            services,
        } => {
            let file_tenants: Vec<(&str, bool)> = std::iter::once(("default", false))
                .chain(
                    TENANTS[1..]
                        .iter()
                        .zip(tenants)
                        .filter_map(|(n, t)| Some((*n, (*t)?))),
                )
                .collect();
            let in_file: Vec<&str> = file_tenants.iter().map(|t| t.0).collect();
            let mut seen = BTreeSet::new();
            let picks: Vec<&ServicePick> =
                services.iter().filter(|p| seen.insert(key_of(p))).collect();
            // Each service's backends once (a file listing one twice is
            // refused by the parse), weights within the maximum.
            let file_services: Vec<FileService> = picks
                .iter()
                .map(|p| {
                    let key = key_of(p);
                    let mut ports = BTreeSet::new();
                    let picks: Vec<BackendPick> = p
                        .backends
                        .iter()
                        .filter(|b| ports.insert(b.0))
                        .map(|&(i, w, m)| (i, w.min(3), m))
                        .collect();
                    let backends = backend_specs(&picks);
                    (key, p.at, SCHEDULERS[p.scheduler], backends)
                })
                .collect();
            let mut cfg = base.clone();
            cfg.tenants = file_tenants[1..]
                .iter()
                .map(|&(n, capped)| tenant_spec(n, capped))
                .collect();
            cfg.services = file_services
                .iter()
                .map(|(key, at, sched, backends)| service_spec(key, *at, sched, backends))
                .collect();
            std::fs::write(path, toml::to_string(&cfg).unwrap()).unwrap();
            let reloaded = c.reload(ReloadOptions {
                dry_run: *dry_run,
                force: *force,
            });
            // Each service's tenant in the file, each capped tenant within
            // its caps there.
            let valid = file_services
                .iter()
                .all(|(k, ..)| in_file.contains(&k.0.as_str()))
                && file_tenants.iter().filter(|t| t.1).all(|&(t, _)| {
                    let of_t = || file_services.iter().filter(|(k, ..)| k.0 == t);
                    of_t().count() <= MAX_SERVICES
                        && of_t().map(|f| f.3.len()).sum::<usize>() <= MAX_BACKENDS
                });
            // What it removes: tenants, services (those of removed tenants
            // too), and backends (those of removed services too).
            // (Compared as one address: the file
            // may respell a backend it keeps.)
            let mut removed = BTreeSet::new();
            for t in model.tenants.keys() {
                if !in_file.contains(&t.as_str()) {
                    removed.insert(format!("tenant {t}"));
                }
            }
            for ((t, s), svc) in &model.services {
                let file = file_services.iter().find(|(k, ..)| k.0 == *t && k.1 == *s);
                if file.is_none() {
                    removed.insert(format!("service {t}/{s}"));
                }
                for b in &svc.backends {
                    let kept = file.is_some_and(|f| {
                        f.3.iter().any(|(a, _)| canonical(*a) == canonical(b.addr))
                    });
                    if !kept {
                        removed.insert(format!("backend {t}/{s}/{}", b.addr));
                    }
                }
            }
            let want = if !valid || (!*force && removed.iter().any(|r| model.runtime.contains(r))) {
                Err(Invalid)
            } else {
                Ok(())
            };
            if let (Ok(report), Ok(())) = (&reloaded, want) {
                let expected = report_of(model, &file_tenants, &file_services);
                let got = [&report.added, &report.changed, &report.removed]
                    .map(|l| l.iter().cloned().collect::<BTreeSet<_>>());
                if got != expected {
                    return Err(format!(
                        "it reported (added, changed, removed) {got:?}, the model {expected:?}"
                    ));
                }
            }
            let got = reloaded.map(|_| ()).map_err(|_| Invalid);
            let want = if want.is_err() {
                want
            } else if *dry_run {
                // Checked and reported, nothing applied.
                Ok(())
            } else {
                model.tenants = file_tenants
                    .iter()
                    .map(|&(t, capped)| (t.to_owned(), capped))
                    .collect();
                let old = std::mem::take(&mut model.services);
                for (key, at, sched, backends) in file_services {
                    let kept = old
                        .get(&key)
                        .filter(|o| o.at == at)
                        .map(|o| o.backends.clone());
                    let backends = model.backends_of(&backends, kept.as_deref().unwrap_or(&[]));
                    model.services.insert(
                        key,
                        MService {
                            at,
                            scheduler: sched,
                            backends,
                        },
                    );
                }
                model.runtime.clear();
                Ok(())
            };
            Ok((got, want))
        }
    }
}

/// What a reload to a file of `tenants` and `services` reports on `model`
/// (added, changed, removed): each tenant and service the file adds,
/// changes or removes; and each backend that a service the file changes
/// gains or loses (a removed service's backends are not listed).
fn report_of(
    model: &Model,
    tenants: &[(&str, bool)],
    services: &[FileService],
) -> [BTreeSet<String>; 3] {
    let [mut added, mut changed, mut removed] = [(); 3].map(|()| BTreeSet::new());
    for &(t, capped) in tenants {
        match model.tenants.get(t) {
            None => added.insert(format!("tenant {t}")),
            Some(&c) if c != capped => changed.insert(format!("tenant {t}")),
            Some(_) => false,
        };
    }
    for t in model.tenants.keys() {
        if !tenants.iter().any(|f| f.0 == *t) {
            removed.insert(format!("tenant {t}"));
        }
    }
    for (key, at, sched, backends) in services {
        let (t, s) = key;
        let Some(cur) = model.services.get(key) else {
            added.insert(format!("service {t}/{s}"));
            continue;
        };
        let same = cur.at == *at
            && cur.scheduler == *sched
            && cur
                .backends
                .iter()
                .map(|b| (b.addr, b.weight))
                .eq(backends.iter().map(|&(a, w)| (canonical(a), w)));
        if same {
            continue;
        }
        changed.insert(format!("service {t}/{s}"));
        // The daemon reads a file's backend addresses in their IPv4
        // spelling, and names them so.
        for (a, _) in backends {
            let a = canonical(*a);
            if !cur.backends.iter().any(|b| b.addr == a) {
                added.insert(format!("backend {t}/{s}/{a}"));
            }
        }
        for b in &cur.backends {
            if !backends.iter().any(|(a, _)| canonical(*a) == b.addr) {
                removed.insert(format!("backend {t}/{s}/{}", b.addr));
            }
        }
    }
    for (t, s) in model.services.keys() {
        if !services.iter().any(|f| f.0.0 == *t && f.0.1 == *s) {
            removed.insert(format!("service {t}/{s}"));
        }
    }
    [added, changed, removed]
}

/// A service of a reload's file: its tenant and name, its place, its
/// scheduler and its backends.
type FileService = (
    (String, String),
    Place,
    &'static str,
    Vec<(SocketAddr, u32)>,
);

/// A service as listed: tenant, name, protocol and listen IP ("tcp
/// 127.0.0.1"), scheduler, and its backends' addresses and weights in
/// order.
type Listed = (String, String, String, String, Vec<(String, u32)>);

/// What the daemon holds, as the model's terms: its tenants (and whether
/// each is capped), its services, and each backend's id by (tenant,
/// service, address). Its other views of the same state must agree with
/// the listing: the running configuration, a tenant's own listings.
struct View {
    tenants: Vec<(String, bool)>,
    services: Vec<Listed>,
    ids: HashMap<(String, String, String), u32>,
}

fn view(d: &DaemonHandle, c: &dyn Control) -> Result<View, String> {
    let tenants: Vec<(String, bool)> = c
        .tenants()
        .into_iter()
        .map(|t| {
            (
                t.spec.name,
                t.spec.max_services > 0 || t.spec.max_backends > 0,
            )
        })
        .collect();
    let statuses = c.services();
    let services: Vec<Listed> = statuses
        .iter()
        .map(|s| {
            let b = s
                .backends
                .iter()
                .map(|b| (b.address.clone(), b.weight))
                .collect();
            let ip = s.listen.parse::<SocketAddr>().map(|a| a.ip().to_string());
            (
                s.tenant.clone(),
                s.name.clone(),
                format!("{} {}", s.protocol, ip.unwrap_or_else(|e| e.to_string())),
                s.scheduler.clone(),
                b,
            )
        })
        .collect();
    let saved: Vec<Listed> = c
        .running_config()
        .services
        .into_iter()
        .map(|s| {
            let b = s
                .backends
                .iter()
                .map(|b| (b.address.to_string(), b.weight))
                .collect();
            let place = format!(
                "{} {}",
                crate::config::protocol_name(s.protocol),
                s.listen.ip()
            );
            (s.tenant, s.name, place, s.scheduler.to_string(), b)
        })
        .collect();
    if saved != services {
        return Err(format!("the running configuration has {saved:?}"));
    }
    for (t, _) in &tenants {
        let own: Vec<_> = statuses
            .iter()
            .filter(|s| s.tenant == *t)
            .cloned()
            .collect();
        if c.services_of(t) != own {
            return Err(format!("tenant {t}'s own listing differs"));
        }
    }
    let mut ids = HashMap::new();
    for ((t, n), svc) in d.shared.model.load().services.iter() {
        for b in &svc.set.load().backends {
            ids.insert((t.clone(), n.clone(), b.addr.to_string()), b.id);
        }
    }
    Ok(View {
        tenants,
        services,
        ids,
    })
}

/// The model's tenants and services as [`View`] lists them.
fn expected(model: &Model) -> (Vec<(String, bool)>, Vec<Listed>) {
    let tenants = model.tenants.iter().map(|(t, c)| (t.clone(), *c)).collect();
    let services = model
        .services
        .iter()
        .map(|((t, n), s)| {
            let proto = if s.at.udp { "udp" } else { "tcp" };
            let b = s
                .backends
                .iter()
                .map(|b| (b.addr.to_string(), b.weight))
                .collect();
            (
                t.clone(),
                n.clone(),
                format!("{proto} {}", listen_ip(s.at)),
                s.scheduler.to_owned(),
                b,
            )
        })
        .collect();
    (tenants, services)
}

/// The first step of every run: a reload to a file with both other
/// tenants and a service of each protocol in `default` and one in `t1`,
/// so that the steps after it find something to edit, and some of what
/// they find came from the file (a reload without force may remove it).
fn first_reload() -> Op {
    let service = |tenant, name, udp, scheduler, backends: &[usize]| ServicePick {
        tenant,
        name,
        at: Place { udp, ip2: false },
        scheduler,
        backends: backends.iter().map(|&i| (i, 1, false)).collect(),
    };
    Op::Reload {
        force: false,
        dry_run: false,
        tenants: [Some(false), Some(false)],
        services: vec![
            service(0, 0, false, 0, &[0, 1]),
            service(0, 1, true, 2, &[2]),
            service(1, 0, false, 4, &[0]),
        ],
    }
}

/// Runs [`first_reload`] then `ops` on a fresh daemon; the first
/// difference from the model, as a message naming the step (the first
/// reload is step 0).
fn run(ops: &[Op]) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weir.toml");
    let mut cfg = Config::default();
    cfg.daemon.workers = 1;
    std::fs::write(&path, toml::to_string(&cfg).unwrap()).unwrap();
    let d = crate::daemon::Daemon::start(cfg, Some(path.clone())).unwrap();
    let c = d.control();
    let base = c.running_config();
    let mut model = Model::new();
    // The daemon's id of each backend the model created (by its uid).
    let mut ids: HashMap<u64, u32> = HashMap::new();
    let result = (|| {
        let first = [first_reload()];
        for (i, op) in first.iter().chain(ops).enumerate() {
            let at = || format!("step {i} {op:?}");
            let (got, want) =
                step(&*c, &path, &base, &mut model, op).map_err(|e| format!("{}: {e}", at()))?;
            if let Err(k) = got
                && matches!(
                    k,
                    ErrorKind::Unavailable | ErrorKind::Forbidden | ErrorKind::Unauthorized
                )
            {
                return Err(format!("{}: the daemon answered {k:?}", at()));
            }
            if got != want {
                return Err(format!(
                    "{}: the daemon answered {got:?}, the model {want:?}",
                    at()
                ));
            }
            let v = view(&d, &*c).map_err(|e| format!("{}: {e}", at()))?;
            let (tenants, services) = expected(&model);
            if v.tenants != tenants {
                return Err(format!(
                    "{}: tenants {:?}, the model's {tenants:?}",
                    at(),
                    v.tenants
                ));
            }
            if v.services != services {
                return Err(format!(
                    "{}: services {:?}, the model's {services:?}",
                    at(),
                    v.services
                ));
            }
            for ((t, n), s) in &model.services {
                for b in &s.backends {
                    let id = v.ids[&(t.clone(), n.clone(), b.addr.to_string())];
                    if let Some(&was) = ids.get(&b.uid)
                        && was != id
                    {
                        return Err(format!(
                            "{}: backend {t}/{n}/{} was id {was}, is {id}",
                            at(),
                            b.addr
                        ));
                    }
                    ids.insert(b.uid, id);
                }
            }
        }
        Ok(())
    })();
    d.shutdown();
    result
}

proptest! {
    // 48 sequences of up to 24 steps after the first reload: about 5 s
    // under the workspace's test profile (one daemon per sequence).
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn the_control_plane_follows_its_model(ops in proptest::collection::vec(op(), 1..25)) {
        if let Err(e) = run(&ops) {
            prop_assert!(false, "{}", e);
        }
    }
}

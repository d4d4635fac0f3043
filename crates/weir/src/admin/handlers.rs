//! Route handlers: parse, check scope, call [`Control`], answer JSON.

use std::collections::BTreeMap;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{FromRequest, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, extract::FromRequestParts};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::AppState;
use super::auth::Access;
use super::error::ApiError;
use crate::config::{BackendSpec, Config, ServiceSpec, TenantSpec};
use crate::control::{
    BackendPatch, CheckedWrite, ConnFilter, ConnPage, ControlError, ControlResult, ErrorKind,
    HealthEntry, Rates, ReloadOptions, ServiceStatus, TableReport, TenantStatus, Totals,
};

type ApiResult<T> = Result<T, ApiError>;

/// Default page size of `GET /v1/connections`.
pub(crate) const DEFAULT_PAGE: usize = 1000;
/// Largest page size of `GET /v1/connections`.
pub(crate) const MAX_PAGE: usize = 10_000;

/// A server-side failure no client input can cause (500).
fn internal(message: String) -> ApiError {
    tracing::error!("{message}");
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
}

/// A JSON body that answers 400 (not 415/422) with a message when malformed.
///
/// A tenant token is checked again once the body is in: the token was
/// checked on the request's head, and a body can take as long as its
/// sender likes to arrive (a byte a minute keeps an admin connection
/// open). Without the second check, a request begun before the operator
/// changed the tenant's token, or deleted the tenant, went through with
/// the old token whenever its holder sent the rest. (The full-access and
/// read-only tokens do not change while the daemon runs.)
pub(crate) struct JsonBody<T>(pub(crate) T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, st: &AppState) -> Result<Self, Self::Rejection> {
        let tenant_token = match req.extensions().get::<Access>() {
            Some(Access::Tenant(t)) => Some((
                t.clone(),
                super::presented_token(req.headers()).map(str::to_owned),
            )),
            _ => None,
        };
        let bytes = Bytes::from_request(req, st).await.map_err(|e| {
            let kind = if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                "too_large"
            } else {
                "invalid"
            };
            ApiError::new(e.status(), kind, e.body_text())
        })?;
        if let Some((tenant, token)) = tenant_token
            && !still_names(st, token.as_deref(), &tenant)
        {
            return Err(ApiError::unauthorized(format!(
                "the token of tenant {tenant:?} was changed or the tenant deleted while this \
                 request's body was arriving: nothing was done; use the tenant's current token"
            )));
        }
        let bad =
            |e: &dyn std::fmt::Display| ApiError::bad_request(format!("invalid JSON body: {e}"));
        let mut de = serde_json::Deserializer::from_slice(&bytes);
        let body = serde_path_to_error::deserialize(&mut de).map_err(|e| bad(&e))?;
        de.end().map_err(|e| bad(&e))?;
        Ok(JsonBody(body))
    }
}

/// Whether `token` (a request's, as presented) names `tenant` now.
fn still_names(st: &AppState, token: Option<&str>, tenant: &str) -> bool {
    let now = token.and_then(|t| st.tokens.identify(t, st.control.as_ref()));
    now.as_ref().and_then(Access::tenant) == Some(tenant)
}

/// The [`Check`](crate::control::Check) of a kill or a connection listing
/// made with `access`, its token presented in `headers`: a tenant token
/// must still name its tenant. The daemon runs it once it has found the
/// tenant it acts on by name (`Control::connections_checked`), so the act
/// reaches the tenant the token names then. The request's token was
/// checked when its head arrived; a kill or a listing then waits for a
/// permit to walk the table and a blocking thread, and a tenant deleted
/// and created again for someone else meanwhile was the one whose
/// connections it killed or listed, with the old tenant's token. (The
/// full-access and read-only tokens do not change while the daemon runs.)
fn token_check(
    st: &AppState,
    access: &Access,
    headers: &HeaderMap,
) -> impl FnMut() -> ControlResult<()> + Send + 'static {
    let st = st.clone();
    let tenant = access.tenant().map(str::to_owned);
    let token = super::presented_token(headers).map(str::to_owned);
    move || match &tenant {
        Some(t) if !still_names(&st, token.as_deref(), t) => Err(ControlError::new(
            ErrorKind::Unauthorized,
            format!(
                "the token of tenant {t:?} was changed or the tenant deleted since this \
                 request's token was checked: nothing was done; use the tenant's current token"
            ),
        )),
        _ => Ok(()),
    }
}

/// `check` after [`token_check`]: the check of a tenant token's write,
/// run under the daemon's edits ([`Check`](crate::control::Check)), with
/// the token still naming its tenant then. A write waits for the edits
/// after its token was checked (its head, then its body: `JsonBody`),
/// and a tenant edit that changes the token, or the tenant deleted and
/// created again for someone else, may hold them meanwhile; the write
/// then went to the tenant of that name with the old token.
fn still_the_tenant<'a>(
    st: &AppState,
    access: &Access,
    headers: &HeaderMap,
    mut check: impl FnMut() -> ControlResult<()> + 'a,
) -> impl FnMut() -> ControlResult<()> + 'a {
    let mut token = token_check(st, access, headers);
    move || {
        token()?;
        check()
    }
}

/// Path parameters that answer 400 with a message when they cannot be decoded.
pub(crate) struct PathParams<T>(T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for PathParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(t)| PathParams(t))
            .map_err(|e: PathRejection| ApiError::bad_request(e.body_text()))
    }
}

fn check_tenant(access: &Access, tenant: &str) -> ApiResult<()> {
    if access.may_touch(tenant) {
        Ok(())
    } else {
        Err(ApiError::forbidden(format!(
            "this token is scoped to tenant {:?} and may not touch tenant {tenant:?}",
            access.tenant().unwrap_or_default()
        )))
    }
}

fn require_global(access: &Access, what: &str) -> ApiResult<()> {
    match access {
        Access::Tenant(t) => Err(ApiError::forbidden(format!(
            "{what} is daemon-wide; this token is scoped to tenant {t:?}: use the full-access token"
        ))),
        _ => Ok(()),
    }
}

/// A tenant token is fenced by its tenant's `allowed_listen` and
/// `allowed_backends` (backends are also the health-check targets): a
/// service listens, and its backends point, only inside them, and a
/// wildcard listen (0.0.0.0, ::) needs an entry naming it even when
/// `allowed_listen` is empty. A health check's `port` (another port of
/// each backend's host) is a target too, fenced as the backends are.
/// Whatever the lists say, a backend may not reach weir itself: one of
/// its services (`protocol` is the service's; its own address included),
/// which would make each connection open another through weir until the
/// limits or descriptors ran out, or reach another tenant's service from
/// inside, nor the admin API, which would put it on the tenant's address;
/// nor may a health check's target (`health`: its protocol and port), which
/// the checker connects to from weir every interval.
/// Other tokens are not fenced.
///
/// The write's [`Check`](crate::control::Check): the daemon runs it with
/// its edits held, so neither the tenant's lists (a tenant edit narrowing
/// them) nor weir's services (two requests, each pointing a backend where
/// the other adds a service) change between it and the write.
fn check_fence(
    st: &AppState,
    access: &Access,
    tenant: &str,
    protocol: crate::config::Protocol,
    listen: Option<std::net::SocketAddr>,
    backends: &[std::net::SocketAddr],
    health: Option<(crate::config::Protocol, Option<u16>)>,
) -> ControlResult<()> {
    if access.tenant().is_none() {
        return Ok(());
    }
    // The part of weir `t` reaches over `proto`, if any, and why it may
    // not be a target.
    let weir_at = |t: std::net::SocketAddr, proto: crate::config::Protocol| {
        const LOOP: &str = " (each connection would open another through it)";
        let own = proto == protocol
            && listen.is_some_and(|l| {
                l.port() == t.port()
                    && (l.ip().to_canonical() == t.ip().to_canonical()
                        || (l.ip().is_unspecified()
                            && l.is_ipv6() == t.ip().to_canonical().is_ipv6()
                            && crate::daemon::host_has_ip(t.ip().to_canonical())))
            });
        if own {
            Some((
                format!("weir's own service {tenant}'s service being written"),
                LOOP,
            ))
        } else if let Some(svc) = st.control.own_service_at(proto, t) {
            Some((format!("weir's own service {svc}"), LOOP))
        } else {
            (proto == crate::config::Protocol::Tcp && st.is_admin_address(t))
                .then(|| ("weir's admin API".to_owned(), ""))
        }
    };
    for b in backends {
        if let Some((what, why)) = weir_at(*b, protocol) {
            return Err(forbidden(format!(
                "backend {b} is {what}: a tenant token cannot point a backend at weir{why}; ask the operator"
            )));
        }
        // The checker connects from weir to its target every interval: to
        // the admin API, or through a service of weir's, unless fenced as
        // the backend is.
        if let Some((proto, port)) = health {
            let target = std::net::SocketAddr::new(b.ip(), port.unwrap_or(b.port()));
            if let Some((what, _)) = weir_at(target, proto) {
                let udp = if proto == crate::config::Protocol::Udp {
                    " over UDP"
                } else {
                    ""
                };
                return Err(forbidden(format!(
                    "the health check of backend {b} connects to {target}{udp}, which is {what}: a tenant token cannot point a health check at weir; ask the operator"
                )));
            }
        }
    }
    let spec = st.control.tenant_spec(tenant).unwrap_or_default();
    // The daemon accepts no tenant whose lists do not parse: refused
    // (and logged) rather than let through, if one ever did not.
    let parse = |key: &str, list: &[String]| {
        crate::config::parse_fence(key, list).map_err(|e| {
            let m = format!("tenant {tenant:?}'s {key} cannot be read: {}", e.join("; "));
            tracing::error!("{m}");
            forbidden(format!("{m}: ask the operator"))
        })
    };
    let listen_fence = parse("allowed_listen", &spec.allowed_listen)?;
    let backend_fence = parse("allowed_backends", &spec.allowed_backends)?;
    let shown = |l: &[String]| {
        if l.is_empty() {
            "none".to_owned()
        } else {
            l.join(", ")
        }
    };
    if let Some(l) = listen
        && !crate::config::fence_allows(&listen_fence, l, true)
    {
        return Err(forbidden(format!(
            "listen {l} is outside tenant {tenant:?}'s allowed_listen ({}); a wildcard address needs an entry naming it: ask the operator",
            shown(&spec.allowed_listen)
        )));
    }
    for b in backends {
        if !crate::config::fence_allows(&backend_fence, *b, false) {
            return Err(forbidden(format!(
                "backend {b} is outside tenant {tenant:?}'s allowed_backends ({}): ask the operator",
                shown(&spec.allowed_backends)
            )));
        }
        if let Some((_, Some(port))) = health {
            let target = std::net::SocketAddr::new(b.ip(), port);
            if !crate::config::fence_allows(&backend_fence, target, false) {
                return Err(forbidden(format!(
                    "health check port {port} makes {target} a target, outside tenant {tenant:?}'s allowed_backends ({}): ask the operator",
                    shown(&spec.allowed_backends)
                )));
            }
        }
    }
    #[cfg(test)]
    st.fence_gate.pass();
    Ok(())
}

/// A tenant token's write refused by its fence or its health floor (403).
fn forbidden(message: String) -> ControlError {
    ControlError::new(ErrorKind::Forbidden, message)
}

/// What a health check connects to: its protocol (TCP unless it says
/// UDP), and the port of each backend's host it names (`None`: the
/// backend's own).
fn health_target(h: &crate::config::HealthSpec) -> (crate::config::Protocol, Option<u16>) {
    (h.protocol.unwrap_or(crate::config::Protocol::Tcp), h.port)
}

/// A tenant token may not make a service's health checks run more often
/// than its tenant's `min_health_interval`: checks/s = services x backends
/// / interval, all on the admin/health runtime every tenant shares. The
/// effective interval counts: a check that omits `interval` gets the
/// default. An edit that does not shorten the service's current interval
/// (one the operator set below the floor, or set before the floor was
/// raised) passes: a floor does not touch the services already there.
/// `interval_given`: whether the request named the interval (for the
/// message). Other tokens are not held to it. Part of the write's
/// [`Check`](crate::control::Check), as [`check_fence`] is: a tenant edit
/// raising the floor does not let in a check made against the old one.
fn check_health_floor(
    st: &AppState,
    access: &Access,
    tenant: &str,
    editing: Option<&str>,
    health: Option<&crate::config::HealthSpec>,
    interval_given: bool,
) -> ControlResult<()> {
    let Some(h) = health else {
        return Ok(());
    };
    if access.tenant().is_none() {
        return Ok(());
    }
    let spec = st.control.tenant_spec(tenant).unwrap_or_default();
    let floor = spec.health_interval_floor();
    let interval = h.interval.get();
    if interval >= floor {
        return Ok(());
    }
    let current = editing
        .and_then(|name| st.control.service_spec(tenant, name))
        .and_then(|s| s.options.health)
        .map(|c| c.interval.get());
    if current.is_some_and(|c| c <= interval) {
        return Ok(());
    }
    let requested = if interval_given {
        format!("health interval {}", h.interval)
    } else {
        format!(
            "health interval {} (the default, as the request gives none)",
            h.interval
        )
    };
    let floor_shown = match &spec.min_health_interval {
        Some(d) => d.to_string(),
        None => format!("{}, the default", humantime::format_duration(floor)),
    };
    Err(forbidden(format!(
        "{requested} is below tenant {tenant:?}'s min_health_interval ({floor_shown}): give an interval of at least {}, or ask the operator",
        humantime::format_duration(floor)
    )))
}

/// Whether a service body names its health check's `interval`.
fn names_health_interval(obj: &serde_json::Map<String, serde_json::Value>) -> bool {
    obj.get("health")
        .and_then(|h| h.get("interval"))
        .is_some_and(|v| !v.is_null())
}

/// Names appear in URL paths: keep them to a safe alphabet.
fn check_name(what: &str, name: &str) -> ApiResult<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && name != "."
        && name != "..";
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "{what} name {name:?} is invalid: use 1-64 characters from A-Z a-z 0-9 - _ ."
        )))
    }
}

fn created(what: String) -> Response {
    (
        StatusCode::CREATED,
        Json(serde_json::json!({ "created": what })),
    )
        .into_response()
}

fn ok_json(v: serde_json::Value) -> Response {
    Json(v).into_response()
}

// ---- tenants ----------------------------------------------------------------

pub(crate) async fn list_tenants(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
) -> ApiResult<Json<Vec<TenantStatus>>> {
    let mut ts = visible_tenants(&st, &access);
    for t in &mut ts {
        t.spec.token = None;
    }
    Ok(Json(ts))
}

pub(crate) async fn add_tenant(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    JsonBody(spec): JsonBody<TenantSpec>,
) -> ApiResult<Response> {
    require_global(&access, "creating a tenant")?;
    check_name("tenant", &spec.name)?;
    let (name, token) = (spec.name.clone(), spec.token.clone());
    // Run by the daemon with its edits held, as a tenant edit's merge is:
    // checked before, another creation or an edit could give the token
    // away between the check and the add, and one token hold two roles.
    let mut check = || {
        check_token_unique(&st, &name, token.as_deref())?;
        #[cfg(test)]
        st.token_gate.pass();
        Ok(())
    };
    st.control
        .write_checked(CheckedWrite::AddTenant(spec), &mut check)?;
    Ok(created(name))
}

/// `PUT /v1/tenants/{tenant}`: the body's keys replace the tenant's current
/// settings, omitted keys keep them (`"token": null` removes the token;
/// `timeouts` is replaced as a whole). Full-access token only.
pub(crate) async fn edit_tenant(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    PathParams(tenant): PathParams<String>,
    JsonBody(body): JsonBody<serde_json::Value>,
) -> ApiResult<Response> {
    require_global(&access, "changing a tenant")?;
    let serde_json::Value::Object(body) = body else {
        return Err(ApiError::bad_request(
            "the body must be a JSON object with the tenant's settings to change (see TenantSpec in GET /v1/openapi.json)",
        ));
    };
    if let Some(name) = body.get("name")
        && name.as_str() != Some(tenant.as_str())
    {
        return Err(ApiError::bad_request(format!(
            "body name {name} differs from the path's {tenant:?}: a tenant cannot be renamed"
        )));
    }
    // Merged into the settings as they are when the change is made (the
    // daemon runs this with its edits held): merged from settings read
    // before, a reload's or another edit's change in between was undone.
    let mut merge = |current: Option<TenantSpec>| -> ControlResult<TenantSpec> {
        let current = current
            .or_else(|| {
                // The implicit default tenant is only in running_config
                // when it carries settings.
                (tenant == crate::config::DEFAULT_TENANT).then(|| TenantSpec {
                    name: tenant.clone(),
                    ..TenantSpec::default()
                })
            })
            .ok_or_else(|| {
                ControlError::new(ErrorKind::NotFound, format!("no tenant {tenant:?}"))
            })?;
        let mut merged = match serde_json::to_value(&current) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => {
                return Err(ControlError::new(
                    ErrorKind::Unavailable,
                    "encoding the current tenant failed",
                ));
            }
        };
        merged.extend(body.clone());
        let spec: TenantSpec = crate::config::from_json(serde_json::Value::Object(merged))
            .map_err(|e| ControlError::new(ErrorKind::Invalid, format!("invalid tenant: {e}")))?;
        check_token_unique(&st, &tenant, spec.token.as_deref())?;
        #[cfg(test)]
        st.merge_gate.pass();
        Ok(spec)
    };
    st.control.update_tenant(&tenant, &mut merge)?;
    Ok(ok_json(serde_json::json!({ "updated": tenant })))
}

/// One token, one role: a tenant token equal to the full-access, the
/// read-only or another tenant's token would make the role depend on the
/// order of checks. 409, naming the clash but never the token.
fn check_token_unique(st: &AppState, tenant: &str, token: Option<&str>) -> ControlResult<()> {
    let Some(token) = token.map(str::trim).filter(|t| !t.is_empty()) else {
        return Ok(());
    };
    let clash = if let Some(role) = st.tokens.role_of(token) {
        Some(role.to_owned())
    } else {
        let mut clash = None;
        st.control.for_each_tenant_token(&mut |name, tok| {
            if name != tenant && clash.is_none() && tok.trim() == token {
                clash = Some(format!("tenant {name:?}'s token"));
            }
        });
        clash
    };
    match clash {
        Some(what) => Err(ControlError::new(
            ErrorKind::Conflict,
            format!(
                "this token is already {what}: a token may hold one role only; choose another (e.g. `openssl rand -hex 32`)"
            ),
        )),
        None => Ok(()),
    }
}

pub(crate) async fn delete_tenant(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    PathParams(tenant): PathParams<String>,
) -> ApiResult<Response> {
    require_global(&access, "deleting a tenant")?;
    let closed = st.control.delete_tenant(&tenant)?;
    Ok(ok_json(
        serde_json::json!({ "deleted": tenant, "closed_connections": closed }),
    ))
}

// ---- services ---------------------------------------------------------------

/// The tenants `access` may see: a tenant token's own, read alone.
fn visible_tenants(st: &AppState, access: &Access) -> Vec<TenantStatus> {
    match access.tenant() {
        Some(t) => st.control.tenant_status(t),
        None => st.control.tenants(),
    }
}

/// The services `access` may see: a tenant token's tenant's alone, computed
/// alone (not every tenant's, then filtered). Off the control runtime's
/// thread ([`AppState::off_runtime`]): a status of every service reads
/// every backend's figures and rates (5,000 services: 7-43 ms).
async fn visible_services(st: &AppState, access: &Access) -> ApiResult<Vec<ServiceStatus>> {
    let control = st.control.clone();
    let tenant = access.tenant().map(str::to_owned);
    st.off_runtime("the service listing", move || match tenant {
        Some(t) => control.services_of(&t),
        None => control.services(),
    })
    .await
    .map_err(internal)
}

pub(crate) async fn list_services(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
) -> ApiResult<Json<Vec<ServiceStatus>>> {
    Ok(Json(visible_services(&st, &access).await?))
}

pub(crate) async fn add_service(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<serde_json::Value>,
) -> ApiResult<Response> {
    let serde_json::Value::Object(mut obj) = body else {
        return Err(ApiError::bad_request(
            "the body must be a JSON object describing the service (see GET /v1/openapi.json)",
        ));
    };
    // A tenant token's services belong to its tenant unless the body says otherwise.
    if let Some(own) = access.tenant()
        && !obj.contains_key("tenant")
    {
        obj.insert("tenant".into(), serde_json::Value::String(own.to_owned()));
    }
    let interval_given = names_health_interval(&obj);
    let spec: ServiceSpec = crate::config::service_from_json(serde_json::Value::Object(obj))
        .map_err(|e| ApiError::bad_request(format!("invalid service: {e}")))?;
    check_tenant(&access, &spec.tenant)?;
    check_name("service", &spec.name)?;
    let mut check = still_the_tenant(
        &st,
        &access,
        &headers,
        service_check(&st, &access, &spec, None, interval_given),
    );
    let id = format!("{}/{}", spec.tenant, spec.name);
    st.control
        .write_checked(CheckedWrite::AddService(spec), &mut check)?;
    Ok(created(id))
}

/// The [`Check`](crate::control::Check) of `access`'s write of `spec`,
/// an add (`editing`: `None`) or the edit of service `editing` of its
/// tenant: [`check_fence`] on its listen address, its backends and its
/// health check's target, then [`check_health_floor`]. What it reads of
/// `spec` is copied now: the spec itself goes to the write.
fn service_check<'a>(
    st: &'a AppState,
    access: &'a Access,
    spec: &ServiceSpec,
    editing: Option<&'a str>,
    interval_given: bool,
) -> impl FnMut() -> ControlResult<()> + 'a {
    let backends: Vec<_> = spec.backends.iter().map(|b| b.address).collect();
    let (tenant, protocol, listen) = (spec.tenant.clone(), spec.protocol, spec.listen);
    let health = spec.options.health.clone();
    move || {
        let target = health.as_ref().map(health_target);
        check_fence(
            st,
            access,
            &tenant,
            protocol,
            Some(listen),
            &backends,
            target,
        )?;
        let h = health.as_ref();
        check_health_floor(st, access, &tenant, editing, h, interval_given)
    }
}

pub(crate) async fn get_service(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    PathParams((tenant, service)): PathParams<(String, String)>,
) -> ApiResult<Json<ServiceSpec>> {
    check_tenant(&access, &tenant)?;
    st.control
        .service_spec(&tenant, &service)
        .map(Json)
        .ok_or_else(|| ApiError::not_found(format!("no service {tenant}/{service}")))
}

pub(crate) async fn edit_service(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    PathParams((tenant, service)): PathParams<(String, String)>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<serde_json::Value>,
) -> ApiResult<Response> {
    check_tenant(&access, &tenant)?;
    let serde_json::Value::Object(mut obj) = body else {
        return Err(ApiError::bad_request(
            "the body must be a JSON object describing the service (as in POST /v1/services)",
        ));
    };
    // The path names the service; the body may repeat it but not change it.
    for (key, want) in [("tenant", &tenant), ("name", &service)] {
        match obj.get(key) {
            None => {
                obj.insert(key.into(), serde_json::Value::String(want.clone()));
            }
            Some(serde_json::Value::String(v)) if v == want => {}
            Some(v) => {
                return Err(ApiError::bad_request(format!(
                    "body {key} {v} differs from the path's {want:?}: a service cannot be renamed or moved; delete and add it instead"
                )));
            }
        }
    }
    let interval_given = names_health_interval(&obj);
    let spec: ServiceSpec = crate::config::service_from_json(serde_json::Value::Object(obj))
        .map_err(|e| ApiError::bad_request(format!("invalid service: {e}")))?;
    // `spec.tenant` is the path's (set or checked above).
    let mut check = still_the_tenant(
        &st,
        &access,
        &headers,
        service_check(&st, &access, &spec, Some(&service), interval_given),
    );
    let write = CheckedWrite::EditService {
        tenant: &tenant,
        name: &service,
        spec,
    };
    st.control.write_checked(write, &mut check)?;
    Ok(ok_json(
        serde_json::json!({ "updated": format!("{tenant}/{service}") }),
    ))
}

pub(crate) async fn delete_service(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    PathParams((tenant, service)): PathParams<(String, String)>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    check_tenant(&access, &tenant)?;
    let write = CheckedWrite::DeleteService {
        tenant: &tenant,
        name: &service,
    };
    let mut check = token_check(&st, &access, &headers);
    st.control.write_checked(write, &mut check)?;
    Ok(ok_json(
        serde_json::json!({ "deleted": format!("{tenant}/{service}") }),
    ))
}

// ---- backends ---------------------------------------------------------------

pub(crate) async fn add_backend(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    PathParams((tenant, service)): PathParams<(String, String)>,
    headers: HeaderMap,
    JsonBody(spec): JsonBody<BackendSpec>,
) -> ApiResult<Response> {
    check_tenant(&access, &tenant)?;
    let address = spec.address;
    let fence = || {
        if access.tenant().is_none() {
            return Ok(());
        }
        // The service's protocol, and what its health check connects to
        // (a port it names targets that port of the new backend's host
        // too), as they are when the backend goes in. (Its own address is
        // in the model: `check_fence` finds it there.)
        let Some(s) = st.control.service_spec(&tenant, &service) else {
            return Err(ControlError::new(
                ErrorKind::NotFound,
                format!("no service {tenant}/{service}"),
            ));
        };
        let health = s.options.health.as_ref().map(health_target);
        check_fence(&st, &access, &tenant, s.protocol, None, &[address], health)
    };
    let mut check = still_the_tenant(&st, &access, &headers, fence);
    let addr = address.to_string();
    let write = CheckedWrite::AddBackend {
        tenant: &tenant,
        service: &service,
        spec,
    };
    st.control.write_checked(write, &mut check)?;
    Ok(created(format!("{tenant}/{service}/{addr}")))
}

pub(crate) async fn edit_backend(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    PathParams((tenant, service, address)): PathParams<(String, String, String)>,
    headers: HeaderMap,
    JsonBody(patch): JsonBody<BackendPatch>,
) -> ApiResult<Response> {
    check_tenant(&access, &tenant)?;
    let address = normalize_addr(&address)?;
    let write = CheckedWrite::EditBackend {
        tenant: &tenant,
        service: &service,
        address: &address,
        patch,
    };
    let mut check = token_check(&st, &access, &headers);
    st.control.write_checked(write, &mut check)?;
    Ok(ok_json(
        serde_json::json!({ "updated": format!("{tenant}/{service}/{address}") }),
    ))
}

pub(crate) async fn delete_backend(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    PathParams((tenant, service, address)): PathParams<(String, String, String)>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    check_tenant(&access, &tenant)?;
    let address = normalize_addr(&address)?;
    let write = CheckedWrite::DeleteBackend {
        tenant: &tenant,
        service: &service,
        address: &address,
    };
    let mut check = token_check(&st, &access, &headers);
    st.control.write_checked(write, &mut check)?;
    Ok(ok_json(
        serde_json::json!({ "deleted": format!("{tenant}/{service}/{address}") }),
    ))
}

/// `IP:PORT` in canonical form, so "[::1]:80" and "[0::1]:80" name one backend.
fn normalize_addr(a: &str) -> ApiResult<String> {
    a.parse::<std::net::SocketAddr>()
        .map(|s| s.to_string())
        .map_err(|_| {
            ApiError::bad_request(format!(
                "backend address {a:?} is not IP:PORT (IPv6: [addr]:port, percent-encoded in the URL)"
            ))
        })
}

// ---- connections --------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ConnQuery {
    tenant: Option<String>,
    service: Option<String>,
    backend: Option<String>,
    state: Option<String>,
    cursor: Option<String>,
    limit: Option<String>,
}

pub(crate) async fn list_connections(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    headers: HeaderMap,
    q: Result<Query<ConnQuery>, QueryRejection>,
) -> ApiResult<Json<ConnPage>> {
    let Query(q) = q.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let limit = match q.limit.as_deref() {
        None | Some("") => DEFAULT_PAGE,
        Some(s) => s
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_PAGE).contains(n))
            .ok_or_else(|| {
                ApiError::bad_request(format!("limit={s:?}: must be an integer 1..={MAX_PAGE}"))
            })?,
    };
    let filter = resolve_filter(
        &st,
        &access,
        ConnFilter {
            tenant: q.tenant.filter(|s| !s.is_empty()),
            service: q.service.filter(|s| !s.is_empty()),
            backend: q.backend.filter(|s| !s.is_empty()),
            state: q.state.filter(|s| !s.is_empty()),
        },
    )
    .await?;
    let cursor = q.cursor.filter(|c| !c.is_empty());
    #[cfg(test)]
    st.act_gate.pass();
    // A page walks the table until `limit` entries match: with a filter few
    // entries match, all of it (1M entries: 160 ms).
    let control = st.control.clone();
    let mut check = token_check(&st, &access, &headers);
    let page = st
        .off_runtime("the connection listing", move || {
            control.connections_checked(&filter, cursor.as_deref(), limit, &mut check)
        })
        .await
        .map_err(internal)??;
    Ok(Json(page))
}

/// A tenant token's filter is pinned to its tenant.
fn scoped_filter(access: &Access, mut f: ConnFilter) -> ApiResult<ConnFilter> {
    if let Some(own) = access.tenant() {
        match &f.tenant {
            Some(t) => check_tenant(access, t)?,
            None => f.tenant = Some(own.to_owned()),
        }
    }
    Ok(f)
}

/// The filter a listing or kill acts on: `service` may be `TENANT/NAME`; a
/// bare name without `tenant` must name a service of one tenant only (of
/// those this token sees), else the request is refused listing them, so a
/// kill never reaches into tenants the caller did not mean.
async fn resolve_filter(
    st: &AppState,
    access: &Access,
    mut f: ConnFilter,
) -> ApiResult<ConnFilter> {
    if let Some(svc) = f.service.clone()
        && let Some((t, n)) = svc.split_once('/')
    {
        if t.is_empty() || n.is_empty() || n.contains('/') {
            return Err(ApiError::bad_request(format!(
                "service {svc:?} is not NAME or TENANT/NAME, e.g. web or acme/web"
            )));
        }
        if let Some(ft) = &f.tenant
            && ft != t
        {
            return Err(ApiError::bad_request(format!(
                "service {svc:?} names tenant {t:?} but the filter's tenant is {ft:?}"
            )));
        }
        f.tenant = Some(t.to_owned());
        f.service = Some(n.to_owned());
    }
    let mut f = scoped_filter(access, f)?;
    if let (Some(svc), None) = (&f.service, &f.tenant) {
        let control = st.control.clone();
        let mut tenants: Vec<String> = st
            .off_runtime("the service lookup", move || control.services())
            .await
            .map_err(internal)?
            .into_iter()
            .filter(|s| s.name == *svc && access.may_touch(&s.tenant))
            .map(|s| s.tenant)
            .collect();
        tenants.sort();
        tenants.dedup();
        if tenants.len() > 1 {
            return Err(ApiError::bad_request(format!(
                "service name {svc:?} is in {} tenants ({}): give TENANT/NAME, e.g. {}/{svc}",
                tenants.len(),
                tenants.join(", "),
                tenants[0]
            )));
        }
        f.tenant = tenants.pop();
    }
    Ok(f)
}

/// `POST /v1/connections/kill`: a [`ConnFilter`] plus `"all": true` to
/// allow an empty filter.
pub(crate) async fn kill_matching(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    headers: HeaderMap,
    JsonBody(req): JsonBody<serde_json::Value>,
) -> ApiResult<Response> {
    // Parsed by hand: serde's flatten does not combine with
    // deny_unknown_fields. `all` is taken out, and the rest must be a
    // filter and nothing else (`ConnFilter` refuses unknown keys).
    let serde_json::Value::Object(mut obj) = req else {
        return Err(ApiError::bad_request(
            "the body must be a JSON object: {\"tenant\", \"service\", \"backend\", \"state\", \"all\"}",
        ));
    };
    let all = match obj.remove("all") {
        None | Some(serde_json::Value::Null) => false,
        Some(serde_json::Value::Bool(b)) => b,
        Some(v) => {
            return Err(ApiError::bad_request(format!(
                "all: expected a boolean, got {v}"
            )));
        }
    };
    let filter: ConnFilter = crate::config::from_json(serde_json::Value::Object(obj))
        .map_err(|e| ApiError::bad_request(format!("invalid filter: {e}")))?;
    if filter == ConnFilter::default() && !all {
        return Err(ApiError::bad_request(
            "refusing to kill every connection: give a filter, or \"all\": true",
        ));
    }
    let filter = resolve_filter(&st, &access, filter).await?;
    #[cfg(test)]
    st.act_gate.pass();
    // A walk of the whole table (1M entries: 60-120 ms).
    let control = st.control.clone();
    let mut check = token_check(&st, &access, &headers);
    let n = st
        .off_runtime("the kill", move || {
            control.kill_matching_checked(&filter, &mut check)
        })
        .await
        .map_err(internal)??;
    Ok(ok_json(serde_json::json!({ "killed": n })))
}

pub(crate) async fn kill_one(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    headers: HeaderMap,
    PathParams(cookie): PathParams<String>,
) -> ApiResult<Response> {
    let cookie: u64 = cookie.parse().map_err(|_| {
        ApiError::bad_request(format!(
            "cookie {cookie:?} is not an unsigned integer: take it from weir conns"
        ))
    })?;
    // A tenant may only kill its own connections: the daemon checks the
    // entry's tenant (the cookie names the entry: one read, no listing).
    let mut check = token_check(&st, &access, &headers);
    if let Err(e) = st.control.kill_checked(cookie, access.tenant(), &mut check) {
        return Err(match access.tenant() {
            Some(own) if e.kind == crate::control::ErrorKind::NotFound => ApiError::not_found(
                format!("no connection with cookie {cookie} in tenant {own:?}"),
            ),
            _ => e.into(),
        });
    }
    Ok(ok_json(serde_json::json!({ "killed": 1 })))
}

// ---- stats ------------------------------------------------------------------

/// Totals and rates of one backend (`GET /v1/stats`).
#[derive(Debug, Serialize)]
struct BackendFigures {
    address: String,
    active_conns: u64,
    inactive_conns: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    stats: Option<Totals>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rates: Option<Rates>,
}

#[derive(Debug, Serialize)]
struct ServiceFigures {
    tenant: String,
    name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    stats: Option<Totals>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rates: Option<Rates>,
    backends: Vec<BackendFigures>,
}

#[derive(Debug, Serialize)]
struct TenantFigures {
    tenant: String,
    active_conns: u64,
    refused: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    stats: Option<Totals>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rates: Option<Rates>,
}

/// Sum of two totals (saturating: counters are not trusted to be small).
pub(crate) fn add_totals(a: Totals, b: &Totals) -> Totals {
    Totals {
        conns: a.conns.saturating_add(b.conns),
        inpkts: a.inpkts.saturating_add(b.inpkts),
        outpkts: a.outpkts.saturating_add(b.outpkts),
        inbytes: a.inbytes.saturating_add(b.inbytes),
        outbytes: a.outbytes.saturating_add(b.outbytes),
    }
}

/// Sum of two rates.
pub(crate) fn add_rates(a: Rates, b: &Rates) -> Rates {
    Rates {
        cps: a.cps.saturating_add(b.cps),
        inpps: a.inpps.saturating_add(b.inpps),
        outpps: a.outpps.saturating_add(b.outpps),
        inbps: a.inbps.saturating_add(b.inbps),
        outbps: a.outbps.saturating_add(b.outbps),
    }
}

/// A tenant's totals and rates: its own (which its deleted services still
/// count in), else, from a [`crate::control::Control`] that keeps none,
/// the sums of its services in `sums` ([`tenant_sums`]).
pub(crate) fn tenant_figures(
    t: &TenantStatus,
    sums: &BTreeMap<String, (Totals, Rates)>,
) -> (Totals, Rates) {
    t.figures
        .or_else(|| sums.get(&t.spec.name).copied())
        .unwrap_or_default()
}

/// Per-tenant sums of service totals and rates.
pub(crate) fn tenant_sums(services: &[ServiceStatus]) -> BTreeMap<String, (Totals, Rates)> {
    let mut m: BTreeMap<String, (Totals, Rates)> = BTreeMap::new();
    for s in services {
        let e = m.entry(s.tenant.clone()).or_default();
        e.0 = add_totals(e.0, &s.stats);
        e.1 = add_rates(e.1, &s.rates);
    }
    m
}

async fn figures(
    st: &AppState,
    access: &Access,
    want_stats: bool,
    want_rates: bool,
) -> ApiResult<Response> {
    let services = visible_services(st, access).await?;
    let tenants = visible_tenants(st, access);
    let sums = tenant_sums(&services);
    let pick_t = |t: Totals| want_stats.then_some(t);
    let pick_r = |r: Rates| want_rates.then_some(r);
    let tenants: Vec<TenantFigures> = tenants
        .iter()
        .map(|t| {
            let (tot, rat) = tenant_figures(t, &sums);
            TenantFigures {
                tenant: t.spec.name.clone(),
                active_conns: t.active_conns,
                refused: t.refused,
                stats: pick_t(tot),
                rates: pick_r(rat),
            }
        })
        .collect();
    let services: Vec<ServiceFigures> = services
        .into_iter()
        .map(|s| ServiceFigures {
            tenant: s.tenant,
            name: s.name,
            stats: pick_t(s.stats),
            rates: pick_r(s.rates),
            backends: s
                .backends
                .into_iter()
                .map(|b| BackendFigures {
                    address: b.address,
                    active_conns: b.active_conns,
                    inactive_conns: b.inactive_conns,
                    stats: pick_t(b.stats),
                    rates: pick_r(b.rates),
                })
                .collect(),
        })
        .collect();
    let mut body = serde_json::json!({ "tenants": tenants, "services": services });
    if access.tenant().is_none() {
        let g = st.control.global_stats();
        let global = if want_stats {
            serde_json::to_value(&g)
        } else {
            serde_json::to_value(g.rates)
        }
        .map_err(|e| internal(format!("cannot encode global stats: {e}")))?;
        body["global"] = global;
    }
    Ok(ok_json(body))
}

pub(crate) async fn stats(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
) -> ApiResult<Response> {
    figures(&st, &access, true, true).await
}

pub(crate) async fn rates(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
) -> ApiResult<Response> {
    figures(&st, &access, false, true).await
}

pub(crate) async fn table(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
) -> ApiResult<Json<Vec<TableReport>>> {
    let mut t = match access.tenant() {
        Some(name) => st.control.table_of(name),
        None => st.control.table(),
    };
    t.retain(|r| access.may_touch(&r.tenant));
    if access.tenant().is_some() {
        for r in &mut t {
            own_figures_only(r);
        }
    }
    Ok(Json(t))
}

/// A tenant token sees only its own load: in a shared table the chain
/// length, histogram and load factor count every tenant's flows, so they
/// are replaced by what the tenant's own entries alone give (load factor)
/// or left out (max_chain 0, empty histogram). The bucket count is the
/// configured size, not load, and stays.
fn own_figures_only(r: &mut TableReport) {
    if r.placement == "own" {
        return;
    }
    // Index entries per way, as the table's own figure is.
    r.load_factor = if r.buckets == 0 {
        0.0
    } else {
        r.entries as f64 / (r.buckets as f64 * weir_flowtable::BUCKET_WAYS as f64)
    };
    r.max_chain = 0;
    r.chain_histogram.clear();
}

pub(crate) async fn health(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
) -> ApiResult<Json<Vec<HealthEntry>>> {
    Ok(Json(match access.tenant() {
        Some(t) => st.control.health_of(t),
        None => st.control.health(),
    }))
}

/// `GET /v1/whoami`: the role of the token presented, so a client (the
/// dashboard) can offer only what the token may do.
#[derive(Debug, Serialize)]
pub(crate) struct Whoami {
    /// "full", "readonly" or "tenant".
    role: &'static str,
    /// The tenant a tenant token is bound to, else null.
    tenant: Option<String>,
    /// Whether this token may change anything (anything but GET).
    can_write: bool,
}

pub(crate) async fn whoami(Extension(access): Extension<Access>) -> Json<Whoami> {
    let role = match access {
        Access::Full => "full",
        Access::ReadOnly => "readonly",
        Access::Tenant(_) => "tenant",
    };
    Json(Whoami {
        role,
        can_write: access != Access::ReadOnly,
        tenant: access.tenant().map(str::to_owned),
    })
}

// ---- config, reload, docs, metrics -----------------------------------------

pub(crate) async fn config(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
) -> ApiResult<Json<Config>> {
    require_global(&access, "the running config")?;
    let mut cfg = st.control.running_config();
    if access == Access::ReadOnly {
        redact(&mut cfg);
    }
    Ok(Json(cfg))
}

/// Remove every secret from a config (what the read-only token sees).
pub(crate) fn redact(cfg: &mut Config) {
    cfg.admin.token = None;
    cfg.admin.readonly_token = None;
    for t in &mut cfg.tenants {
        t.token = None;
    }
}

/// `POST /v1/reload?dry_run=BOOL&force=BOOL`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReloadQuery {
    dry_run: Option<String>,
    force: Option<String>,
}

fn query_bool(key: &str, v: Option<&str>) -> ApiResult<bool> {
    match v {
        None | Some("" | "false" | "0") => Ok(false),
        Some("true" | "1") => Ok(true),
        Some(other) => Err(ApiError::bad_request(format!(
            "{key}={other:?}: expected true or false"
        ))),
    }
}

pub(crate) async fn reload(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
    q: Result<Query<ReloadQuery>, QueryRejection>,
) -> ApiResult<Response> {
    require_global(&access, "reload")?;
    let Query(q) = q.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let opts = ReloadOptions {
        dry_run: query_bool("dry_run", q.dry_run.as_deref())?,
        force: query_bool("force", q.force.as_deref())?,
    };
    // Reading and checking the file takes a while for a big one: off the
    // executor, so other admin requests are answered meanwhile.
    let control = st.control.clone();
    let result = tokio::task::spawn_blocking(move || control.reload(opts))
        .await
        .map_err(|e| internal(format!("the reload task failed: {e}")))?;
    match result {
        Ok(report) => {
            let mut body = serde_json::to_value(&report)
                .map_err(|e| internal(format!("cannot encode the reload report: {e}")))?;
            body["reloaded"] = serde_json::Value::Bool(report.applied);
            body["dry_run"] = serde_json::Value::Bool(opts.dry_run);
            Ok(ok_json(body))
        }
        Err(errors) => {
            let mut e = ApiError::bad_request(format!(
                "reload refused with {} error(s); nothing was applied, the running config is unchanged: fix the file and reload again",
                errors.len()
            ));
            e.errors = errors;
            Err(e)
        }
    }
}

pub(crate) async fn openapi() -> Json<serde_json::Value> {
    Json(super::openapi::document())
}

pub(crate) async fn metrics(
    State(st): State<AppState>,
    Extension(access): Extension<Access>,
) -> ApiResult<Response> {
    require_global(&access, "/metrics")?;
    // Off the runtime's worker; when anyone may ask, at most one render a
    // second (see `metrics::Cache`).
    let render = async {
        let control = st.control.clone();
        match st
            .off_runtime("the metrics render", move || {
                super::metrics::render(control.as_ref())
            })
            .await?
        {
            Ok(text) => Ok(axum::body::Bytes::from(text)),
            Err(e) => Err(format!("cannot encode metrics: {e}")),
        }
    };
    let text = if st.metrics_public {
        st.metrics
            .get(super::metrics::PUBLIC_RENDER_TTL, render)
            .await
    } else {
        render.await
    }
    .map_err(internal)?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering::Relaxed;

    use axum::Extension;
    use axum::extract::State;
    use axum::http::StatusCode;

    use super::{
        AppState, ConnQuery, JsonBody, PathParams, add_backend, add_service, add_tenant,
        delete_backend, delete_service, edit_backend, edit_service, edit_tenant, kill_matching,
        kill_one, list_connections,
    };
    use crate::admin::auth::Access;
    use crate::config::{BackendSpec, Config, TenantSpec};
    use crate::daemon::Daemon;
    use crate::daemon::tests::wait_until;

    /// Runs a handler to its end on this thread.
    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    /// A tenant edit that narrows `allowed_backends` waits for a tenant
    /// token's backend add that passed its fence check against the old
    /// list: once the edit returns, every backend added after it is inside
    /// the new list (a narrowed fence keeps the backends there, as a
    /// lowered limit does; only new ones are refused). Checked outside the
    /// edits lock, the add went in after the edit returned, outside the
    /// fence the operator had just set.
    #[test]
    fn a_narrowed_fence_holds_for_every_add_after_the_edit_returned() {
        let toml = "[daemon]\nworkers = 1\n[[tenant]]\nname = \"acme\"\ntoken = \"acme-tok\"\n\
                    allowed_backends = [\"127.0.0.0/8\"]\n[[service]]\ntenant = \"acme\"\n\
                    name = \"s\"\nprotocol = \"tcp\"\nlisten = \"127.0.0.1:0\"\n\
                    [[service.backend]]\naddress = \"127.0.0.9:1\"\n";
        let cfg: Config = toml::from_str(toml).unwrap();
        let d = Daemon::start(cfg, None).unwrap();
        let st = AppState::for_tests(d.control());
        let backends = {
            let c = d.control();
            move || -> Vec<std::net::SocketAddr> {
                let s = c.service_spec("acme", "s").unwrap();
                s.backends.iter().map(|b| b.address).collect()
            }
        };
        let gate = st.fence_gate.hold.write();
        let add = {
            let st = st.clone();
            let spec: BackendSpec =
                serde_json::from_value(serde_json::json!({ "address": "127.0.1.9:3" })).unwrap();
            std::thread::spawn(move || {
                let to = PathParams(("acme".to_owned(), "s".to_owned()));
                run(add_backend(
                    State(st),
                    Extension(Access::Tenant("acme".into())),
                    to,
                    bearer("acme-tok"),
                    JsonBody(spec),
                ))
                .map(|r| r.status())
                .map_err(|e| e.message)
            })
        };
        wait_until("the add never passed its fence check", || {
            st.fence_gate.passed.load(Relaxed) > 0
        });
        let edit = {
            let st = st.clone();
            let backends = backends.clone();
            let body = serde_json::json!({ "allowed_backends": ["127.0.0.9/32"] });
            std::thread::spawn(move || {
                put_tenant(st, "acme", body)
                    .map(|_| backends())
                    .map_err(|e| e.message)
            })
        };
        wait_until("the edit neither ended nor waited", || {
            edit.is_finished() || d.edits_waiting() > 0
        });
        drop(gate);
        let added = add.join().unwrap();
        let kept = edit.join().unwrap().unwrap();
        let fence = crate::config::parse_fence("allowed_backends", &["127.0.0.9/32".into()]);
        let fence = fence.unwrap();
        for b in backends() {
            assert!(
                crate::config::fence_allows(&fence, b, false) || kept.contains(&b),
                "backend {b} went in outside acme's allowed_backends (127.0.0.9/32) after \
                 the edit that set them returned (acme then held {kept:?})"
            );
        }
        // Checked against the fence as it was before the edit: passed.
        assert_eq!(added, Ok(StatusCode::CREATED));
        d.shutdown();
    }

    /// A PUT of a tenant merges its body into the tenant's settings as
    /// they are: another change of the tenant (a reload's apply, which
    /// writes the file's settings whole, or another PUT) between its read
    /// and its write was lost under settings merged from before it.
    #[test]
    fn a_tenant_put_merges_into_the_settings_it_replaces() {
        let toml = "[daemon]\nworkers = 1\n[[tenant]]\nname = \"acme\"\nmax_services = 10\n\
                    max_backends = 10\n";
        let cfg: Config = toml::from_str(toml).unwrap();
        let d = Daemon::start(cfg, None).unwrap();
        let c = d.control();
        let st = AppState::for_tests(d.control());
        let gate = st.merge_gate.hold.write();
        let put = {
            let st = st.clone();
            let body = serde_json::json!({ "max_services": 5 });
            std::thread::spawn(move || {
                put_tenant(st, "acme", body)
                    .map(|r| r.status())
                    .map_err(|e| e.message)
            })
        };
        wait_until("the PUT never merged", || {
            st.merge_gate.passed.load(Relaxed) > 0
        });
        // Whole settings, as a reload's apply writes the file's.
        let mut file = c.tenant_spec("acme").unwrap();
        file.max_backends = 7;
        let whole = {
            let c = c.clone();
            std::thread::spawn(move || c.edit_tenant("acme", file))
        };
        wait_until("the other edit neither ended nor waited", || {
            whole.is_finished() || d.edits_waiting() > 0
        });
        drop(gate);
        assert_eq!(put.join().unwrap(), Ok(StatusCode::OK));
        whole.join().unwrap().unwrap();
        // In either order the whole write's max_backends stays: the PUT
        // then it (max_services 10), or it then the PUT (5).
        let t = c.tenant_spec("acme").unwrap();
        assert_eq!(
            t.max_backends, 7,
            "the PUT wrote settings merged from before the other edit, undoing it \
             (max_services {})",
            t.max_services
        );
        d.shutdown();
    }

    /// Two tenants created at once with one token: the second waits for
    /// the first, whose token its check then finds (409). Checked outside
    /// the edits lock, both checks passed before either tenant was added,
    /// and one token held two tenants' roles.
    #[test]
    fn two_tenants_created_at_once_cannot_share_a_token() {
        one_token_for_two_tenants("the second creation", |st| created_with_the_token(st, "c"));
    }

    /// As two creations: a PUT giving an existing tenant the token of one
    /// being created waits for the creation, then finds its token (409).
    /// The creation checked outside the edits lock, so the PUT's check
    /// (under them) passed while the creation's change was still to come.
    #[test]
    fn a_tenant_put_cannot_take_the_token_of_a_tenant_being_created() {
        one_token_for_two_tenants("the PUT", |st| {
            let body = serde_json::json!({ "token": "one-token" });
            put_tenant(st, "b", body)
                .map(|r| r.status())
                .map_err(|e| e.status)
        });
    }

    /// `PUT /v1/tenants/{tenant}` with `body` (full access), to its end.
    fn put_tenant(
        st: AppState,
        tenant: &str,
        body: serde_json::Value,
    ) -> Result<axum::response::Response, crate::admin::error::ApiError> {
        let to = PathParams(tenant.to_owned());
        run(edit_tenant(
            State(st),
            Extension(Access::Full),
            to,
            JsonBody(body),
        ))
    }

    /// The status of `POST /v1/tenants` creating tenant `name` with token
    /// "one-token" (full access).
    fn created_with_the_token(st: AppState, name: &str) -> Result<StatusCode, StatusCode> {
        let spec = serde_json::json!({ "name": name, "token": "one-token" });
        let spec: TenantSpec = serde_json::from_value(spec).unwrap();
        run(add_tenant(
            State(st),
            Extension(Access::Full),
            JsonBody(spec),
        ))
        .map(|r| r.status())
        .map_err(|e| e.status)
    }

    /// Keeps the creation of tenant "a" with token "one-token" between its
    /// token check and its change, runs `second` (`what`: another write
    /// giving "one-token" to tenant "b", which exists without a token)
    /// until it ends or waits for the edits lock, then lets the creation
    /// go: the creation must win and `second` be refused (409), so that
    /// one tenant alone holds the token. (A second creation names "c".)
    fn one_token_for_two_tenants(
        what: &str,
        second: impl FnOnce(AppState) -> Result<StatusCode, StatusCode> + Send + 'static,
    ) {
        let toml = "[daemon]\nworkers = 1\n[[tenant]]\nname = \"b\"\n";
        let cfg: Config = toml::from_str(toml).unwrap();
        let d = Daemon::start(cfg, None).unwrap();
        let st = AppState::for_tests(d.control());
        let gate = st.token_gate.hold.write();
        let first = {
            let st = st.clone();
            std::thread::spawn(move || created_with_the_token(st, "a"))
        };
        wait_until("the creation never passed its token check", || {
            st.token_gate.passed.load(Relaxed) > 0
        });
        let second = {
            let st = st.clone();
            std::thread::spawn(move || second(st))
        };
        // Ended, waiting for the edits lock, or (a creation) at the gate
        // after its own check.
        wait_until(&format!("{what} neither ended nor waited"), || {
            second.is_finished() || d.edits_waiting() > 0 || st.token_gate.passed.load(Relaxed) > 1
        });
        drop(gate);
        let answers = (first.join().unwrap(), second.join().unwrap());
        let mut holders = Vec::new();
        d.control().for_each_tenant_token(&mut |name, token| {
            if token == "one-token" {
                holders.push(name.to_owned());
            }
        });
        assert_eq!(
            holders,
            ["a"],
            "one token holds the roles of tenants {holders:?} (the creation, {what}: {answers:?})"
        );
        assert_eq!(
            answers,
            (Ok(StatusCode::CREATED), Err(StatusCode::CONFLICT))
        );
        d.shutdown();
    }
    /// A daemon with tenant acme, token "acme-old", and the handlers'
    /// state over it.
    fn acme_old() -> (crate::daemon::DaemonHandle, AppState) {
        let toml = "[daemon]\nworkers = 1\n[[tenant]]\nname = \"acme\"\ntoken = \"acme-old\"\n";
        let cfg: Config = toml::from_str(toml).unwrap();
        let d = Daemon::start(cfg, None).unwrap();
        let st = AppState::for_tests(d.control());
        (d, st)
    }

    /// The headers of a request made with acme's old token.
    fn old_token() -> axum::http::HeaderMap {
        bearer("acme-old")
    }

    /// The headers of a request made with `token`.
    fn bearer(token: &str) -> axum::http::HeaderMap {
        let mut h = axum::http::HeaderMap::new();
        h.insert(
            axum::http::header::AUTHORIZATION,
            format!("Bearer {token}").parse().unwrap(),
        );
        h
    }

    /// What the operator does while a request made with acme's old token
    /// is between its checks and its act: deletes acme and creates it
    /// again for someone else (token "acme-new"), with a service on an
    /// echo backend. Returns a client of that service, echoed once (so its
    /// connection is in the table), and the cookie of its connection.
    fn acme_again(d: &crate::daemon::DaemonHandle) -> (std::net::TcpStream, u64) {
        use std::io::{Read, Write};
        let c = d.control();
        c.delete_tenant("acme").unwrap();
        let spec = serde_json::json!({ "name": "acme", "token": "acme-new" });
        c.add_tenant(serde_json::from_value(spec).unwrap()).unwrap();
        let echo = crate::daemon::tests::echo_backend();
        let svc = serde_json::json!({
            "tenant": "acme", "name": "s", "protocol": "tcp", "listen": "127.0.0.1:0",
            "backend": [{ "address": echo.to_string() }],
        });
        c.add_service(crate::config::service_from_json(svc).unwrap())
            .unwrap();
        let listen: std::net::SocketAddr = c.services_of("acme")[0].listen.parse().unwrap();
        let mut client = std::net::TcpStream::connect(listen).unwrap();
        client
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        client.write_all(b"hi").unwrap();
        let mut back = [0u8; 2];
        client.read_exact(&mut back).unwrap();
        let filter = crate::control::ConnFilter {
            tenant: Some("acme".into()),
            ..Default::default()
        };
        let page = c.connections(&filter, None, 10).unwrap();
        assert_eq!(page.connections.len(), 1, "{page:?}");
        (client, page.connections[0].cookie)
    }

    /// `act` (`what`, a request made with acme's old token) on a thread
    /// of its own, held at `act_gate` once past its checks while
    /// `acme_again` deletes acme and creates it again. What `act`
    /// answered, and what `acme_again` returned.
    fn past_its_checks_while_acme_is_created_again<T: Send + 'static>(
        d: &crate::daemon::DaemonHandle,
        st: &AppState,
        what: &str,
        act: impl FnOnce(AppState) -> T + Send + 'static,
    ) -> (T, (std::net::TcpStream, u64)) {
        let gate = st.act_gate.hold.write();
        let acting = {
            let st = st.clone();
            std::thread::spawn(move || act(st))
        };
        wait_until(&format!("{what} never passed its checks"), || {
            st.act_gate.passed.load(Relaxed) > 0
        });
        let again = acme_again(d);
        drop(gate);
        (acting.join().unwrap(), again)
    }

    /// A kill made with acme's old token was refused and `client` (of acme
    /// created again) still echoes; then `d` shuts down.
    fn assert_the_old_token_killed_nothing(
        d: crate::daemon::DaemonHandle,
        mut client: std::net::TcpStream,
        answer: Result<StatusCode, StatusCode>,
    ) {
        assert!(
            still_echoes(&mut client),
            "acme's old token killed the connection of acme created again (answer {answer:?})"
        );
        assert_eq!(answer, Err(StatusCode::UNAUTHORIZED));
        d.shutdown();
    }

    /// Whether `client`'s connection still carries bytes both ways.
    fn still_echoes(client: &mut std::net::TcpStream) -> bool {
        use std::io::{Read, Write};
        let mut back = [0u8; 5];
        client.write_all(b"again").is_ok() && client.read_exact(&mut back).is_ok()
    }

    /// A kill by filter made with a tenant token waits between its token's
    /// checks and the kill (for a permit to walk the table, then its
    /// blocking thread) while the operator deletes the tenant and creates
    /// it again for someone else: the kill named the tenant by name and
    /// closed the new tenant's connections with the old token. Now the
    /// kill is refused and they stay.
    #[test]
    fn a_kill_by_filter_begun_with_a_tenant_token_spares_the_tenant_created_again() {
        let (d, st) = acme_old();
        let (answer, (client, _)) =
            past_its_checks_while_acme_is_created_again(&d, &st, "the kill", |st| {
                let filter = serde_json::json!({ "tenant": "acme" });
                run(kill_matching(
                    State(st),
                    Extension(Access::Tenant("acme".into())),
                    old_token(),
                    JsonBody(filter),
                ))
                .map(|r| r.status())
                .map_err(|e| e.status)
            });
        assert_the_old_token_killed_nothing(d, client, answer);
    }

    /// As a kill by filter: a kill by cookie whose token was checked
    /// before the tenant was deleted and created again closed the new
    /// tenant's connection.
    #[test]
    fn a_kill_by_cookie_begun_with_a_tenant_token_spares_the_tenant_created_again() {
        let (d, st) = acme_old();
        let (client, cookie) = acme_again(&d);
        // The token was checked (`Access`) before acme was created again.
        let answer = run(kill_one(
            State(st),
            Extension(Access::Tenant("acme".into())),
            old_token(),
            PathParams(cookie.to_string()),
        ))
        .map(|r| r.status())
        .map_err(|e| e.status);
        assert_the_old_token_killed_nothing(d, client, answer);
    }

    /// As a kill by filter: a connection listing made with a tenant token
    /// and kept between its checks and its walk listed the connections of
    /// the tenant created again for someone else.
    #[test]
    fn a_listing_begun_with_a_tenant_token_does_not_show_the_tenant_created_again() {
        let (d, st) = acme_old();
        let (listed, _client) =
            past_its_checks_while_acme_is_created_again(&d, &st, "the listing", |st| {
                let q = ConnQuery {
                    tenant: None,
                    service: None,
                    backend: None,
                    state: None,
                    cursor: None,
                    limit: None,
                };
                run(list_connections(
                    State(st),
                    Extension(Access::Tenant("acme".into())),
                    old_token(),
                    Ok(axum::extract::Query(q)),
                ))
                .map(|page| page.0.connections.len())
                .map_err(|e| e.status)
            });
        assert_eq!(
            listed,
            Err(StatusCode::UNAUTHORIZED),
            "acme's old token listed the connections of acme created again"
        );
        d.shutdown();
    }

    /// As a kill: a write made with a tenant token whose checks passed
    /// before the tenant was deleted and created again for someone else
    /// (it waited for the daemon's edits, which the operator's re-creation
    /// held) went to the new tenant of that name. Each of the six service
    /// and backend writes is refused now, and the new tenant's service is
    /// as the operator made it.
    #[test]
    fn a_write_begun_with_a_tenant_token_leaves_the_tenant_created_again_alone() {
        let (d, st) = acme_old();
        let _client = acme_again(&d);
        let c = d.control();
        let as_made = c.service_spec("acme", "s").unwrap();
        let backend = as_made.backends[0].address.to_string();
        let access = || Extension(Access::Tenant("acme".into()));
        let path = || PathParams(("acme".to_owned(), "s".to_owned()));
        let backend_path = || PathParams(("acme".to_owned(), "s".to_owned(), backend.clone()));
        let service = |name: &str| {
            JsonBody(serde_json::json!({
                "name": name, "protocol": "tcp", "listen": "127.0.0.1:0",
                "backend": [{ "address": "127.0.0.1:9" }],
            }))
        };
        let status = |r: super::ApiResult<axum::response::Response>| r.map(|r| r.status());
        let answers = [
            (
                "add service",
                status(run(add_service(
                    State(st.clone()),
                    access(),
                    old_token(),
                    service("t"),
                ))),
            ),
            (
                "edit service",
                status(run(edit_service(
                    State(st.clone()),
                    access(),
                    path(),
                    old_token(),
                    service("s"),
                ))),
            ),
            (
                "add backend",
                status(run(add_backend(
                    State(st.clone()),
                    access(),
                    path(),
                    old_token(),
                    JsonBody(
                        serde_json::from_value(serde_json::json!({ "address": "127.0.0.1:9" }))
                            .unwrap(),
                    ),
                ))),
            ),
            (
                "edit backend",
                status(run(edit_backend(
                    State(st.clone()),
                    access(),
                    backend_path(),
                    old_token(),
                    JsonBody(serde_json::from_value(serde_json::json!({ "weight": 0 })).unwrap()),
                ))),
            ),
            (
                "delete backend",
                status(run(delete_backend(
                    State(st.clone()),
                    access(),
                    backend_path(),
                    old_token(),
                ))),
            ),
            (
                "delete service",
                status(run(delete_service(
                    State(st.clone()),
                    access(),
                    path(),
                    old_token(),
                ))),
            ),
        ];
        for (what, answer) in answers {
            assert_eq!(
                answer.map_err(|e| e.status),
                Err(StatusCode::UNAUTHORIZED),
                "{what} with acme's old token"
            );
        }
        assert_eq!(
            c.service_spec("acme", "s"),
            Some(as_made),
            "acme's old token changed the service of acme created again"
        );
        assert_eq!(c.services_of("acme").len(), 1, "a service was added");
        d.shutdown();
    }
}

//! The configuration file (TOML) and the running state's shape.
//!
//! The same types describe the file `weir run --config FILE` reads, the
//! bodies of the admin API (`POST /v1/services` takes a [`ServiceSpec`]) and
//! what `weir save` prints, so "run → change at runtime → save → restart"
//! reproduces the same services, backends and tenants.
//!
//! Validation (every error at once, with file, line and key) lives in
//! [`validate`](self) functions below the types; parsing alone only checks
//! the shape.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Process-wide settings.
    #[serde(default)]
    pub daemon: DaemonConfig,
    /// The admin API.
    #[serde(default)]
    pub admin: AdminConfig,
    /// `[[tenant]]` tables.
    #[serde(default, rename = "tenant", skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantSpec>,
    /// `[[service]]` tables.
    #[serde(default, rename = "service", skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<ServiceSpec>,
}

/// `[daemon]`: process-wide settings. Every field has a default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DaemonConfig {
    /// Worker threads; 0 = the CPUs available.
    pub workers: usize,
    /// Buckets of the shared flow table (power of two).
    pub shared_table_buckets: usize,
    /// Memory budget in bytes for tenants' own tables; a tenant whose table
    /// would exceed it falls back to the shared table.
    pub own_tables_budget: usize,
    /// Global cap on proxied connections + UDP sessions; 0 = unlimited.
    pub max_connections: u64,
    /// Per-direction copy buffer in bytes (seed 004: bounded buffering).
    pub buffer_size: usize,
    /// `TCP_NOTSENT_LOWAT` on both sockets in bytes; 0 = leave the kernel default.
    pub notsent_lowat: u32,
    /// SIGTERM drain timeout, e.g. "30s".
    pub drain_timeout: String,
    /// One log line per closed connection.
    pub access_log: bool,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        Self {
            workers: 0,
            shared_table_buckets: 1 << 17,
            own_tables_budget: 1 << 30,
            max_connections: 0,
            buffer_size: 16 * 1024,
            notsent_lowat: 16 * 1024,
            drain_timeout: "30s".into(),
            access_log: false,
        }
    }
}

/// `[admin]`: where the admin API listens and who may use it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// `IP:PORT`, or `unix:/path/to/socket`.
    pub listen: String,
    /// Bearer token with full access.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// File holding the full-access token (alternative to `token`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// Bearer token that may only read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub readonly_token: Option<String>,
    /// Serve `/metrics` without a token.
    pub metrics_public: bool,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9900".into(),
            token: None,
            token_file: None,
            readonly_token: None,
            metrics_public: false,
        }
    }
}

/// `[[tenant]]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// Unique name; services refer to it.
    pub name: String,
    /// 0: share the global flow table; else a power of two ≤ 2^24 (own table).
    #[serde(default)]
    pub table_entries: usize,
    /// Cap on this tenant's connections + sessions; 0 = unlimited.
    #[serde(default)]
    pub max_connections: u64,
    /// Cap on new connections + sessions per second; 0 = unlimited.
    #[serde(default)]
    pub max_new_per_s: u64,
    /// Tenant-scoped admin token: sees and changes only this tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// Transport of a virtual service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// Full TCP proxy.
    Tcp,
    /// UDP with a session table.
    Udp,
}

/// `[[service]]`: a virtual service and its backends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceSpec {
    /// Tenant that owns the service.
    #[serde(default = "default_tenant")]
    pub tenant: String,
    /// Unique within the tenant.
    pub name: String,
    /// "tcp" or "udp".
    pub protocol: Protocol,
    /// Virtual address.
    pub listen: SocketAddr,
    /// rr wrr lc wlc sed nq sh mh p2c.
    #[serde(default = "default_scheduler")]
    pub scheduler: String,
    /// Client affinity timeout, e.g. "300s"; "0s" = off.
    #[serde(default = "default_persistence")]
    pub persistence: String,
    /// Group clients for persistence: IPv4 netmask ("255.255.255.0") or IPv6 prefix length ("64").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistence_netmask: Option<String>,
    /// Further options; every field has a default.
    #[serde(default, flatten)]
    pub options: ServiceOptions,
    /// `[[service.backend]]`.
    #[serde(default, rename = "backend")]
    pub backends: Vec<BackendSpec>,
}

/// Optional per-service settings (flattened into `[[service]]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServiceOptions {
    /// Backend connect timeout, e.g. "2s" (then the next backend is tried).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connect_timeout: Option<String>,
    /// Close existing connections to a backend that goes down (IPVS `expire_nodest_conn`).
    pub expire_nodest_conn: bool,
    /// `mh` only: fall back to another backend when the chosen one is unavailable.
    pub mh_fallback: bool,
    /// UDP: end a session after this many responses (nginx `proxy_responses`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp_responses: Option<u32>,
    /// UDP: idle timeout, e.g. "300s".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp_timeout: Option<String>,
    /// UDP: cap on sessions per client address; 0 = unlimited.
    #[serde(skip_serializing_if = "is_zero")]
    pub udp_max_sessions_per_client: u64,
    /// Active health checks; none = backends are always up.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthSpec>,
}

/// `[service.health]`: active TCP connect checks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthSpec {
    /// e.g. "2s".
    pub interval: String,
    /// e.g. "1s".
    pub timeout: String,
    /// Consecutive successes to mark a backend up.
    pub rise: u32,
    /// Consecutive failures to mark a backend down.
    pub fall: u32,
}

impl Default for HealthSpec {
    fn default() -> Self {
        Self {
            interval: "2s".into(),
            timeout: "1s".into(),
            rise: 2,
            fall: 3,
        }
    }
}

/// `[[service.backend]]`: a real server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendSpec {
    /// Real server address.
    pub address: SocketAddr,
    /// 0 quiesces: no new connections, existing ones continue.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Send a PROXY protocol header: "v1" or "v2".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_protocol: Option<String>,
    /// Cap on connections to this backend; 0 = unlimited.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_connections: u64,
}

fn default_tenant() -> String {
    "default".into()
}
fn default_scheduler() -> String {
    "wlc".into()
}
fn default_persistence() -> String {
    "0s".into()
}
fn default_weight() -> u32 {
    1
}
fn is_zero(v: &u64) -> bool {
    *v == 0
}

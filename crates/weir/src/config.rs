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

use std::net::{IpAddr, SocketAddr};
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
    /// `[packet]`: packet mode's interfaces and addresses; absent = no
    /// packet mode (every service must then be `forward = "proxy"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packet: Option<PacketConfig>,
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
    /// Entries the shared flow table is sized for at first (power of two
    /// ≤ 2^26); it grows online up to `max_shared_table_entries` and shrinks
    /// back to this. The file may still say `shared_table_buckets` (this
    /// key's old name, which was always a count of entries); `weir save`
    /// writes `shared_table_entries`.
    #[serde(alias = "shared_table_buckets")]
    pub shared_table_entries: usize,
    /// Entries the shared flow table may grow to and hold (inserts past it
    /// are refused as `table_full`); 0 = the table's maximum, 2^28; else a
    /// power of two ≥ `shared_table_entries`.
    pub max_shared_table_entries: usize,
    /// Memory budget in bytes for tenants' own tables; a tenant whose table
    /// would exceed it falls back to the shared table.
    pub own_tables_budget: usize,
    /// Global cap on proxied connections + UDP sessions; 0 = unlimited.
    pub max_connections: u64,
    /// Per-direction copy buffer in bytes (seed 004: bounded buffering).
    pub buffer_size: usize,
    /// `TCP_NOTSENT_LOWAT` on both sockets in bytes; 0 = leave the kernel default.
    pub notsent_lowat: u32,
    /// `TCP_WINDOW_CLAMP` in bytes on the socket weir reads from while the
    /// other side is not taking bytes (seed 004 on the receive side); 0 =
    /// never clamp.
    pub blocked_window: u32,
    /// `SO_RCVBUF` in bytes a backend socket starts with, until its client
    /// has proved to read fast (then 4 MiB, capped by the kernel); 0 = the
    /// kernel's autotuning from the start.
    pub backend_rcvbuf: u32,
    /// SIGTERM drain timeout, e.g. "30s".
    pub drain_timeout: Dur<DrainTimeout>,
    /// One log line per closed connection.
    pub access_log: bool,
    /// Pin the rate-estimator thread to this CPU (0-based); absent = no pinning.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimator_cpu: Option<usize>,
    /// Nice value of the rate-estimator thread (-20..=19); absent = inherit.
    /// Lowering it below the process's needs `CAP_SYS_NICE`; without it the
    /// daemon logs a warning and keeps the inherited value.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimator_nice: Option<i32>,
    /// Which workers take new TCP connections: "spread" (the default)
    /// leaves it to the kernel's hash over all of them, "adaptive" packs
    /// them on the fewest workers that keep up.
    pub accept_steering: AcceptSteering,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        Self {
            workers: 0,
            shared_table_entries: 1 << 17,
            max_shared_table_entries: 0,
            own_tables_budget: 1 << 30,
            max_connections: 0,
            buffer_size: 32 * 1024,
            notsent_lowat: 16 * 1024,
            blocked_window: 64 * 1024,
            backend_rcvbuf: 64 * 1024,
            drain_timeout: Dur::fixed("30s", 30_000),
            access_log: false,
            estimator_cpu: None,
            estimator_nice: None,
            accept_steering: AcceptSteering::Spread,
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
    /// PEM certificate chain: serve the admin API over TLS (with `tls_key`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// Allow plain HTTP on a non-loopback `listen` (tokens cross the network
    /// in clear).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub insecure_plaintext: bool,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9900".into(),
            token: None,
            token_file: None,
            readonly_token: None,
            metrics_public: false,
            tls_cert: None,
            tls_key: None,
            insecure_plaintext: false,
        }
    }
}

/// `[packet]`: where packet mode attaches and the addresses it owns. Read
/// at start only: a reload that changes it is refused (the data path
/// attaches to the interfaces when the daemon starts).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PacketConfig {
    /// Interfaces weir attaches to (names in weir's network namespace);
    /// traffic weir does not serve passes to the kernel. Required, non-empty.
    pub interfaces: Vec<String>,
    /// The interfaces of `interfaces` that backends' replies (and ICMP
    /// errors about packets sent to backends) may arrive on: a frame from a
    /// nat or fnat backend's address and port that arrives on another one is
    /// dropped (`reply_interface`), so a spoofer on the client side cannot
    /// inject into a flow. Empty (the default): any of `interfaces`, for one
    /// interface that carries both sides.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backend_interfaces: Vec<String>,
    /// How packets reach weir.
    #[serde(default)]
    pub io: PacketIo,
    /// `fnat` source addresses (assigned to the backend-side interface);
    /// `fnat` backends need one of their own family.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub local_addresses: Vec<IpAddr>,
    /// The ports weir takes for `fnat` on each local address.
    #[serde(default)]
    pub fnat_ports: PortRange,
    /// Packet workers; 0 = as many as `[daemon] workers`.
    #[serde(default, skip_serializing_if = "is_zero_usize")]
    pub workers: usize,
    /// Entries in each AF_XDP ring of each interface queue (fill,
    /// completion, receive, transmit); the queue's UMEM holds twice as many
    /// 4 KiB frames. A power of two, 64 to 32768. A bigger ring absorbs a
    /// longer burst (or a longer stall of its worker) before the kernel
    /// drops frames (`kernel_rx_ring_full`), at 8 KiB of memory per entry.
    /// AF_PACKET does not use it.
    #[serde(
        default = "default_xdp_ring_size",
        skip_serializing_if = "is_default_xdp_ring_size"
    )]
    pub xdp_ring_size: u32,
}

/// `[packet] xdp_ring_size` when not given.
pub const DEFAULT_XDP_RING_SIZE: u32 = 2048;

fn default_xdp_ring_size() -> u32 {
    DEFAULT_XDP_RING_SIZE
}

fn is_default_xdp_ring_size(v: &u32) -> bool {
    *v == DEFAULT_XDP_RING_SIZE
}

/// `[packet] io`: the packet I/O backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PacketIo {
    /// AF_XDP where the program attaches, else AF_PACKET.
    #[default]
    Auto,
    /// AF_XDP only; start fails where XDP cannot attach.
    Xdp,
    /// AF_PACKET (TPACKET_V3 rings, fanout) only.
    Afpacket,
}

impl PacketIo {
    /// Every value, in the order the docs list them.
    pub const ALL: [PacketIo; 3] = [PacketIo::Auto, PacketIo::Xdp, PacketIo::Afpacket];

    /// The text in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            PacketIo::Auto => "auto",
            PacketIo::Xdp => "xdp",
            PacketIo::Afpacket => "afpacket",
        }
    }
}

/// `[daemon] accept_steering`: which workers' listeners take new TCP
/// connections (docs/daemon.md, "Accept steering").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AcceptSteering {
    /// The fewest workers that keep up, more as they saturate while CPUs
    /// are idle.
    Adaptive,
    /// All workers, by the kernel's hash of each connection.
    #[default]
    Spread,
}

impl AcceptSteering {
    /// Every value, in the order the docs list them.
    pub const ALL: [AcceptSteering; 2] = [AcceptSteering::Spread, AcceptSteering::Adaptive];

    /// The text in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            AcceptSteering::Adaptive => "adaptive",
            AcceptSteering::Spread => "spread",
        }
    }
}

/// An inclusive port range, "A-B" in the file (1 <= A <= B <= 65535).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PortRange {
    /// First port.
    pub lo: u16,
    /// Last port (inclusive).
    pub hi: u16,
}

impl PortRange {
    /// Whether `port` is in the range.
    pub fn contains(self, port: u16) -> bool {
        (self.lo..=self.hi).contains(&port)
    }

    /// How many ports (at least 1).
    pub fn count(self) -> u32 {
        u32::from(self.hi) - u32::from(self.lo) + 1
    }
}

impl Default for PortRange {
    /// 40000-59999, inside Linux's default ephemeral range (32768-60999):
    /// the range must be reserved from the kernel's own source ports
    /// (`net.ipv4.ip_local_reserved_ports`) so the two never collide.
    fn default() -> Self {
        Self {
            lo: 40_000,
            hi: 59_999,
        }
    }
}

impl std::str::FromStr for PortRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad =
            |why: &str| format!("{s:?} is not a port range ({why}); write e.g. \"40000-59999\"");
        let (lo, hi) = s
            .trim()
            .split_once('-')
            .ok_or_else(|| bad("expected FIRST-LAST"))?;
        let port = |t: &str| {
            t.trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| bad("ports are 1-65535"))
        };
        let (lo, hi) = (port(lo)?, port(hi)?);
        if lo > hi {
            return Err(bad("it runs backwards"));
        }
        Ok(Self { lo, hi })
    }
}

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.lo, self.hi)
    }
}

impl Serialize for PortRange {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PortRange {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// `forward`: how a service's traffic reaches its backends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Forward {
    /// weir terminates the connection and opens its own to the backend
    /// (the sockets data path).
    #[default]
    Proxy,
    /// Packet mode, IPVS masquerading: the destination is rewritten to the
    /// backend; replies come back through weir (the backends' gateway).
    Nat,
    /// Packet mode, full NAT: the source is rewritten too, to one of
    /// `[packet] local_addresses`, so replies come back with no routing change.
    Fnat,
    /// Packet mode, direct routing: only the destination MAC changes; the
    /// backends hold the VIP and answer clients directly.
    Dr,
}

impl Forward {
    /// Every value, in the order the docs list them.
    pub const ALL: [Forward; 4] = [Forward::Proxy, Forward::Nat, Forward::Fnat, Forward::Dr];

    /// Whether the packet data path serves it (anything but `proxy`).
    pub fn is_packet(self) -> bool {
        self != Forward::Proxy
    }

    /// `proxy` (the default, which `weir save` leaves out).
    pub fn is_proxy(&self) -> bool {
        *self == Forward::Proxy
    }

    /// The text in the file and the JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Forward::Proxy => "proxy",
            Forward::Nat => "nat",
            Forward::Fnat => "fnat",
            Forward::Dr => "dr",
        }
    }

    /// ipvsadm's name of the method (`Masq`, `Route`), `FullNat` as DPVS
    /// prints it, `Proxy` for weir's own.
    pub fn ipvsadm_name(self) -> &'static str {
        match self {
            Forward::Proxy => "Proxy",
            Forward::Nat => "Masq",
            Forward::Fnat => "FullNat",
            Forward::Dr => "Route",
        }
    }
}

impl std::str::FromStr for Forward {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Forward::ALL
            .into_iter()
            .find(|f| f.as_str() == s)
            .ok_or_else(|| format!("unknown forward {s:?}; use one of proxy nat fnat dr"))
    }
}

impl std::fmt::Display for Forward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `[[tenant]]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// Unique name; services refer to it.
    pub name: String,
    /// 0: share the global flow table; else a power of two ≤ 2^24: the
    /// entries the tenant's own table is sized for at first (it grows
    /// online up to `max_table_entries` and shrinks back to this).
    #[serde(default)]
    pub table_entries: usize,
    /// Own table only: entries it may grow to and hold (inserts past it are
    /// refused as `table_full`); 0 = the table's maximum, 2^24; else a
    /// power of two ≥ `table_entries`. Fixed at creation, like
    /// `table_entries`.
    #[serde(default, skip_serializing_if = "is_zero_usize")]
    pub max_table_entries: usize,
    /// Cap on this tenant's connections + sessions; 0 = unlimited.
    #[serde(default)]
    pub max_connections: u64,
    /// Cap on new connections + sessions per second; 0 = unlimited.
    #[serde(default)]
    pub max_new_per_s: u64,
    /// Cap on this tenant's services (each holds a socket per worker of
    /// the daemon's descriptors, shared by every tenant); 0 = unlimited.
    /// Adding one past it is refused, whoever adds it (API, reload, start).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub max_services: u64,
    /// Cap on the backends of all this tenant's services together (each is
    /// health-checked and has its estimator, on the threads every tenant
    /// shares); 0 = unlimited. A change past it is refused, whoever makes
    /// it (API, reload, start).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub max_backends: u64,
    /// Shortest `[service.health] interval` this tenant's token may give
    /// one of the tenant's services (checks/s = services x backends /
    /// interval, run on the admin/health runtime every tenant shares);
    /// absent = [`DEFAULT_MIN_HEALTH_INTERVAL`]. A check that omits its
    /// interval counts with the default it gets. The full-access token and
    /// the config file are not held to it (the operator is trusted); a
    /// changed floor leaves the services already there as they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_health_interval: Option<Dur<HealthInterval>>,
    /// Tenant-scoped admin token: sees and changes only this tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// `[tenant.timeouts]`: per-state idle timeouts of this tenant's flows.
    #[serde(default, skip_serializing_if = "TimeoutsSpec::is_empty")]
    pub timeouts: TimeoutsSpec,
    /// Where this tenant's token may put services ([`AddrRange`] strings,
    /// e.g. "10.0.0.0/24:8000-8100"); empty = any specific address. A
    /// wildcard listen (0.0.0.0, ::) is refused to the tenant token unless
    /// an entry names the wildcard itself ("0.0.0.0:80", "[::]:80").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_listen: Vec<String>,
    /// Which backend addresses (and so health-check targets) this tenant's
    /// token may use; empty = any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_backends: Vec<String>,
}

/// `[[tenant]] min_health_interval` when absent.
pub const DEFAULT_MIN_HEALTH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

impl TenantSpec {
    /// The shortest health-check interval this tenant's token may set:
    /// `min_health_interval`, or [`DEFAULT_MIN_HEALTH_INTERVAL`].
    pub fn health_interval_floor(&self) -> std::time::Duration {
        self.min_health_interval
            .as_ref()
            .map_or(DEFAULT_MIN_HEALTH_INTERVAL, Dur::get)
    }
}

/// A fence entry of `allowed_listen` / `allowed_backends`: `CIDR[:PORTS]`,
/// IPv6 in brackets when a port follows ("[2001:db8::/32]:443"); PORTS is
/// `N` or `LO-HI`, absent = every port. A bare address is a /32 (/128).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddrRange {
    /// Network address (host bits zero).
    pub net: std::net::IpAddr,
    /// Prefix length.
    pub prefix: u8,
    /// Lowest port allowed.
    pub port_lo: u16,
    /// Highest port allowed.
    pub port_hi: u16,
}

impl AddrRange {
    /// Whether `a` is inside: same family, address in the network, port in
    /// range. A wildcard address (0.0.0.0, ::) is inside only an entry that
    /// names the wildcard itself (full-length prefix): "0.0.0.0/0" allows
    /// every specific IPv4 address, not a bind that captures them all.
    /// An IPv4-mapped IPv6 address (`[::ffff:10.0.0.5]:80`) is the IPv4
    /// address it maps to: a socket connects to that, so an IPv6 entry
    /// ("::/0") must not let it past the IPv4 entries.
    /// Port 0 (a listen the kernel gives a port of its choosing, any
    /// ephemeral one) is inside only an entry of every port, one naming
    /// no port: "10.0.0.0/8:0-1023" does not hold the port it gets.
    pub fn contains(&self, a: SocketAddr) -> bool {
        let a = SocketAddr::new(a.ip().to_canonical(), a.port());
        let in_net = match (self.net, a.ip()) {
            (std::net::IpAddr::V4(n), std::net::IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(ip) & mask == u32::from(n)
            }
            (std::net::IpAddr::V6(n), std::net::IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(ip) & mask == u128::from(n)
            }
            _ => false,
        };
        let full = if a.is_ipv4() { 32 } else { 128 };
        let wildcard_ok = !a.ip().is_unspecified() || self.prefix == full;
        let port_ok = if a.port() == 0 {
            (self.port_lo, self.port_hi) == (0, u16::MAX)
        } else {
            (self.port_lo..=self.port_hi).contains(&a.port())
        };
        in_net && wildcard_ok && port_ok
    }
}

impl std::str::FromStr for AddrRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            format!(
                "{s:?} is not CIDR[:PORTS] ({why}); write e.g. \"10.0.0.0/24:8000-8100\", \
                 \"10.0.0.5:80\", \"[2001:db8::/64]:443\""
            )
        };
        let t = s.trim();
        let (cidr, ports) = if let Some(rest) = t.strip_prefix('[') {
            let (cidr, after) = rest.split_once(']').ok_or_else(|| bad("no closing ]"))?;
            match after {
                "" => (cidr, None),
                _ => (
                    cidr,
                    Some(
                        after
                            .strip_prefix(':')
                            .ok_or_else(|| bad("expected :PORTS after ]"))?,
                    ),
                ),
            }
        } else if t.matches(':').count() > 1 {
            (t, None) // IPv6 without brackets: no port part.
        } else {
            match t.split_once(':') {
                Some((c, p)) => (c, Some(p)),
                None => (t, None),
            }
        };
        let (ip, prefix) = match cidr.split_once('/') {
            Some((ip, p)) => (ip, Some(p)),
            None => (cidr, None),
        };
        let ip: std::net::IpAddr = ip.parse().map_err(|_| bad("bad IP address"))?;
        let full: u8 = if ip.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => full,
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= full)
                .ok_or_else(|| bad("bad prefix length"))?,
        };
        let (port_lo, port_hi) = match ports {
            None => (0, u16::MAX),
            Some(p) => {
                let (lo, hi) = p.split_once('-').unwrap_or((p, p));
                let lo: u16 = lo.parse().map_err(|_| bad("bad port"))?;
                let hi: u16 = hi.parse().map_err(|_| bad("bad port"))?;
                if lo > hi {
                    return Err(bad("port range runs backwards"));
                }
                (lo, hi)
            }
        };
        let net = match ip {
            std::net::IpAddr::V4(v) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
                std::net::IpAddr::V4((u32::from(v) & mask).into())
            }
            std::net::IpAddr::V6(v) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
                std::net::IpAddr::V6((u128::from(v) & mask).into())
            }
        };
        Ok(AddrRange {
            net,
            prefix,
            port_lo,
            port_hi,
        })
    }
}

/// Parse a fence list; every bad entry as "KEY[i]: message".
pub fn parse_fence(key: &str, list: &[String]) -> Result<Vec<AddrRange>, Vec<String>> {
    let mut out = Vec::with_capacity(list.len());
    let mut errors = Vec::new();
    for (i, e) in list.iter().enumerate() {
        match e.parse() {
            Ok(r) => out.push(r),
            Err(m) => errors.push(format!("{key}[{i}]: {m}")),
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

/// Whether `addr` passes a fence: an empty fence allows every specific
/// address but no wildcard when `wildcard_needs_entry`.
pub fn fence_allows(fence: &[AddrRange], addr: SocketAddr, wildcard_needs_entry: bool) -> bool {
    let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
    if fence.is_empty() {
        return !(wildcard_needs_entry && addr.ip().is_unspecified());
    }
    fence.iter().any(|r| r.contains(addr))
}

/// `[tenant.timeouts]`: per-state idle timeouts (durations such as "900s");
/// an absent key keeps the IPVS default ([`weir_flowtable::Timeouts`]).
///
/// `established` and `fin_wait` are what weir's TCP proxy enforces on its
/// connections; `syn_recv` bounds a connection whose backend connect is
/// pending in the table; `udp` is the idle timeout of UDP sessions of
/// services that set no `udp_timeout`; `persist` is the flow table's
/// template lifetime (raised to the tenant's longest service
/// `persistence`, which each template also checks itself). The other TCP
/// states are handed to the flow table as they are.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutsSpec {
    /// ESTABLISHED (IPVS: 900 s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub established: Option<Dur<StateTimeout>>,
    /// SYN_SENT (120 s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub syn_sent: Option<Dur<StateTimeout>>,
    /// SYN_RECV (60 s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub syn_recv: Option<Dur<StateTimeout>>,
    /// FIN_WAIT (120 s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fin_wait: Option<Dur<StateTimeout>>,
    /// CLOSE_WAIT (60 s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub close_wait: Option<Dur<StateTimeout>>,
    /// LAST_ACK (30 s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_ack: Option<Dur<StateTimeout>>,
    /// TIME_WAIT (120 s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_wait: Option<Dur<StateTimeout>>,
    /// CLOSE (10 s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub close: Option<Dur<StateTimeout>>,
    /// UDP sessions (300 s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp: Option<Dur<StateTimeout>>,
    /// Persistence templates (300 s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub persist: Option<Dur<StateTimeout>>,
}

/// Shortest per-state timeout accepted (the expiry runs once a second).
pub const MIN_STATE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);
/// Longest per-state timeout accepted (30 days).
pub const MAX_STATE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30 * 86_400);

impl TimeoutsSpec {
    /// No key set (everything at the IPVS defaults).
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// (key, value) of every field, in file order.
    pub fn fields(&self) -> [(&'static str, &Option<Dur<StateTimeout>>); 10] {
        [
            ("established", &self.established),
            ("syn_sent", &self.syn_sent),
            ("syn_recv", &self.syn_recv),
            ("fin_wait", &self.fin_wait),
            ("close_wait", &self.close_wait),
            ("last_ack", &self.last_ack),
            ("time_wait", &self.time_wait),
            ("close", &self.close),
            ("udp", &self.udp),
            ("persist", &self.persist),
        ]
    }

    /// The flow table's timeouts: set keys as given, the rest IPVS
    /// defaults. Every value was checked when it was parsed, so this cannot
    /// fail today; the error list (key, what to do) stays for callers.
    pub fn resolve(&self) -> Result<weir_flowtable::Timeouts, Vec<(&'static str, String)>> {
        use weir_flowtable::Millis;
        let mut t = weir_flowtable::Timeouts::default();
        for (key, value) in self.fields() {
            let Some(d) = value else { continue };
            let d = d.get();
            let ms = Millis(d.as_millis() as u64);
            match key {
                "established" => t.established = ms,
                "syn_sent" => t.syn_sent = ms,
                "syn_recv" => t.syn_recv = ms,
                "fin_wait" => t.fin_wait = ms,
                "close_wait" => t.close_wait = ms,
                "last_ack" => t.last_ack = ms,
                "time_wait" => t.time_wait = ms,
                "close" => t.close = ms,
                "udp" => t.udp = ms,
                _ => t.persist = ms,
            }
        }
        Ok(t)
    }
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
    /// How traffic reaches the backends: "proxy" (the default; left out by
    /// `weir save`), or packet mode's "nat", "fnat", "dr" (needs `[packet]`).
    #[serde(default, skip_serializing_if = "Forward::is_proxy")]
    pub forward: Forward,
    /// rr wrr lc wlc sed nq sh mh p2c lblc lblcr dh fo ovf (the names are
    /// the text in the file and the JSON).
    #[serde(default = "default_scheduler", deserialize_with = "de_scheduler")]
    pub scheduler: weir_sched::SchedulerKind,
    /// Client affinity timeout, e.g. "300s"; "0s" = off.
    #[serde(default = "default_persistence")]
    pub persistence: Dur<Persistence>,
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
    pub connect_timeout: Option<Dur<ConnectTimeout>>,
    /// Close existing connections to a backend that goes down (IPVS `expire_nodest_conn`).
    pub expire_nodest_conn: bool,
    /// `mh` only: fall back to another backend when the chosen one is unavailable.
    pub mh_fallback: bool,
    /// `sh` only: when the client's backend is unavailable, take the next
    /// available one along its buckets (ipvsadm `sh-fallback`); without it
    /// the client is refused.
    #[serde(skip_serializing_if = "is_false")]
    pub sh_fallback: bool,
    /// `sh` only: hash the client's port with its address (ipvsadm `sh-port`).
    #[serde(skip_serializing_if = "is_false")]
    pub sh_port: bool,
    /// `mh` only: hash the client's port with its address (ipvsadm `mh-port`).
    #[serde(skip_serializing_if = "is_false")]
    pub mh_port: bool,
    /// `mh` only: lookup table size, one of IPVS's primes (default 4093).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mh_table_size: Option<u32>,
    /// TCP: cap on concurrent connections per client address; 0 = unlimited.
    #[serde(skip_serializing_if = "is_zero")]
    pub tcp_max_connections_per_client: u64,
    /// The per-client caps (`tcp_max_connections_per_client`,
    /// `udp_max_sessions_per_client`) count an IPv6 client per this
    /// prefix: default 64, the block a host or a LAN gets, in which a
    /// host may take any address; 128 counts each address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_prefix6: Option<u32>,
    /// `sh` / `mh`: text the client hash is keyed with. Default: the
    /// service's `tenant/name`, so every instance started from the same
    /// config maps every client to the same backend, across restarts.
    /// Balancers that must agree share it; a secret one keeps clients from
    /// predicting their placement.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hash_seed: Option<String>,
    /// UDP: end a session after this many responses (nginx `proxy_responses`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp_responses: Option<u32>,
    /// UDP: idle timeout, e.g. "300s".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp_timeout: Option<Dur<UdpTimeout>>,
    /// UDP: cap on sessions per client address; 0 = unlimited.
    #[serde(skip_serializing_if = "is_zero")]
    pub udp_max_sessions_per_client: u64,
    /// Active health checks; none = backends are always up.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthSpec>,
    /// Packet services, TCP: a non-SYN packet with no flow creates one (as
    /// IPVS's `sloppy_tcp`, e.g. after a failover to this balancer) instead
    /// of being dropped and counted.
    #[serde(skip_serializing_if = "is_false")]
    pub sloppy_tcp: bool,
}

/// `[service.health]`: active checks, a TCP connect (the default) or a UDP
/// datagram that must be answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthSpec {
    /// e.g. "2s".
    pub interval: Dur<HealthInterval>,
    /// e.g. "1s".
    pub timeout: Dur<HealthTimeout>,
    /// Consecutive successes to mark a backend up.
    pub rise: u32,
    /// Consecutive failures to mark a backend down.
    pub fall: u32,
    /// "tcp" (connect; the default) or "udp" (send `send`, expect any reply
    /// within `timeout`). A UDP service needs "udp" or a TCP `port`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocol: Option<Protocol>,
    /// Check this port of each backend instead of the backend's own port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// UDP checks: the payload to send.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub send: Option<String>,
}

impl Default for HealthSpec {
    fn default() -> Self {
        Self {
            interval: Dur::fixed("2s", 2_000),
            timeout: Dur::fixed("1s", 1_000),
            rise: 2,
            fall: 3,
            protocol: None,
            port: None,
            send: None,
        }
    }
}

/// `[[service.backend]]`: a real server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendSpec {
    /// Real server address. An IPv4-mapped IPv6 address
    /// (`[::ffff:10.0.0.5]:80`) is read as the IPv4 one it maps to
    /// (`10.0.0.5:80`): a socket connects to that one endpoint either way,
    /// so the backend has one address, one id and one spelling in every
    /// listing, edit and reload, whichever way a file or request wrote it.
    #[serde(deserialize_with = "de_backend_address")]
    pub address: SocketAddr,
    /// 0 quiesces: no new connections, existing ones continue.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Send a PROXY protocol header: "v1" or "v2".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_protocol: Option<crate::proxy_protocol::Version>,
    /// Cap on connections to this backend; 0 = unlimited.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_connections: u64,
}

/// The scheduler flags a service sets, named and ordered as ipvsadm prints
/// them (`sh-fallback,sh-port`, `mh-fallback,mh-port`).
pub fn sched_flags(s: &ServiceSpec) -> Vec<String> {
    let o = &s.options;
    [
        ("sh-fallback", o.sh_fallback),
        ("sh-port", o.sh_port),
        ("mh-fallback", o.mh_fallback),
        ("mh-port", o.mh_port),
    ]
    .into_iter()
    .filter(|&(_, set)| set)
    .map(|(name, _)| name.to_owned())
    .collect()
}

fn default_tenant() -> String {
    "default".into()
}
fn default_scheduler() -> weir_sched::SchedulerKind {
    weir_sched::SchedulerKind::Wlc
}

/// `scheduler` from exactly one of [`SCHEDULERS`] (as before the field was
/// typed: no case folding), with the key in the message, since a JSON body
/// has no lines to point at.
/// A backend's address, an IPv4-mapped one as its IPv4 address (see
/// [`BackendSpec::address`]). Before, the spelling was kept: a reload or a
/// service edit that wrote `10.0.0.5:80` for a backend added as
/// `[::ffff:10.0.0.5]:80` matched addresses exactly, so it removed the
/// backend and added a new one (a new id, counters from zero), and packet
/// mode let a mapped backend past its family check behind an IPv6 VIP,
/// where it would have sent IPv6 packets to `::ffff:10.0.0.5`.
fn de_backend_address<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    SocketAddr::deserialize(d).map(canonical_addr)
}

/// `a` with an IPv4-mapped IPv6 address as the IPv4 one it maps to.
pub fn canonical_addr(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

impl BackendSpec {
    /// This spec with its address read as a file's or a request's is
    /// ([`BackendSpec::address`]): for a spec built in code, which reaches
    /// the daemon through the `Control` trait without being deserialized.
    #[must_use]
    pub fn canonical(mut self) -> Self {
        self.address = canonical_addr(self.address);
        self
    }
}

impl ServiceSpec {
    /// Every backend's address as [`BackendSpec::canonical`] reads it.
    pub fn canonicalise_backends(&mut self) {
        for b in &mut self.backends {
            b.address = canonical_addr(b.address);
        }
    }
}

fn de_scheduler<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<weir_sched::SchedulerKind, D::Error> {
    let text = String::deserialize(d)?;
    parse_scheduler(&text).map_err(serde::de::Error::custom)
}

/// A scheduler name, exactly as `ipvsadm -s` spells it (or `p2c`).
pub fn parse_scheduler(text: &str) -> Result<weir_sched::SchedulerKind, String> {
    weir_sched::SchedulerKind::ALL
        .into_iter()
        .find(|k| k.as_str() == text)
        .ok_or_else(|| {
            format!(
                "unknown scheduler {text:?}; use one of {}",
                SCHEDULERS.join(" ")
            )
        })
}
fn default_persistence() -> Dur<Persistence> {
    Dur::fixed("0s", 0)
}
fn default_weight() -> u32 {
    1
}
fn is_zero(v: &u64) -> bool {
    *v == 0
}
fn is_zero_usize(v: &usize) -> bool {
    *v == 0
}
fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}
fn is_false(v: &bool) -> bool {
    !*v
}

// ---------------------------------------------------------------------------
// Loading and validation
// ---------------------------------------------------------------------------

/// Scheduler names the daemon knows (`ipvsadm -s` plus `p2c`).
pub const SCHEDULERS: &[&str] = &[
    "rr", "wrr", "lc", "wlc", "sed", "nq", "sh", "mh", "p2c", "lblc", "lblcr", "dh", "fo", "ovf",
];

/// CPUs an affinity mask can name (glibc's `CPU_SETSIZE`).
pub const MAX_CPUS: usize = 1024;

/// The implicit tenant services belong to when they name none.
pub const DEFAULT_TENANT: &str = "default";

/// One problem in a configuration: where it is and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// File name as given (or "<config>" for in-memory text).
    pub file: String,
    /// 1-based line of the offending key or table, when known.
    pub line: Option<usize>,
    /// Dotted key path, e.g. `service[1].backend[0].weight`.
    pub key: String,
    /// What is wrong and what to do about it.
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{}: {}: {}", self.file, line, self.key, self.message),
            None => write!(f, "{}: {}: {}", self.file, self.key, self.message),
        }
    }
}

/// Read, parse and validate a configuration file; every error at once.
pub fn load(path: &std::path::Path) -> Result<Config, Vec<ConfigError>> {
    let file = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => parse(&text, &file),
        Err(e) => Err(vec![ConfigError {
            file,
            line: None,
            key: "-".into(),
            message: format!(
                "cannot read the file: {e}; pass an existing file (see examples/weir.toml)"
            ),
        }]),
    }
}

/// Parse and validate configuration text; `file` names it in errors.
pub fn parse(text: &str, file: &str) -> Result<Config, Vec<ConfigError>> {
    // Shape pre-pass over the syntax tree: unknown keys, wrong value types
    // and missing required keys, all at once (serde stops at the first).
    let mut typed = Vec::new();
    let mut patched = None;
    if let Ok(doc) = toml_edit::Document::parse(text.to_owned()) {
        let shape = shape_problems(doc.as_table());
        let lines = Lines::new(text);
        let to_error = |(path, offset, message, _): ShapeProblem| ConfigError {
            file: file.into(),
            line: offset.map(|o| lines.line_of(o)),
            key: path,
            message,
        };
        if shape.iter().any(|p| p.3.is_none()) {
            return Err(shape.into_iter().map(to_error).collect());
        }
        // Only typed values that do not parse: put a valid stand-in in
        // their place (last first, so earlier spans stay right) and go on,
        // so the semantic problems of the rest come out too.
        if !shape.is_empty() {
            let mut t = text.to_owned();
            let mut patches: Vec<_> = shape.iter().filter_map(|p| p.3.clone()).collect();
            patches.sort_by_key(|(span, _)| std::cmp::Reverse(span.start));
            for (span, stand_in) in patches {
                t.replace_range(span, &stand_in);
            }
            patched = Some(t);
            typed = shape.into_iter().map(to_error).collect();
        }
    }
    let config: Config = match toml::from_str(patched.as_deref().unwrap_or(text)) {
        Ok(c) => c,
        Err(e) => {
            let line = e.span().map(|s| Lines::new(text).line_of(s.start));
            let key = shape_error_key(text, e.span());
            return Err(vec![ConfigError {
                file: file.into(),
                line,
                key,
                message: format!(
                    "{}; see examples/weir.toml for the shape",
                    e.message().trim_end()
                ),
            }]);
        }
    };
    // Problems of a stand-in value, or that depend on a scheduler that did
    // not parse, are not the user's: the typed error says it all.
    let problems: Vec<Problem> = validate(&config)
        .into_iter()
        .filter(|p| {
            let at = p.path.to_string();
            !typed.iter().any(|t| {
                let (table, key) = t.key.rsplit_once('.').unwrap_or(("", &t.key));
                at == t.key || dependents(key).iter().any(|d| at == format!("{table}.{d}"))
            })
        })
        .collect();
    if problems.is_empty() && typed.is_empty() {
        return Ok(config);
    }
    let doc = toml_edit::Document::parse(text.to_owned()).ok();
    let lines = Lines::new(text);
    Err(typed
        .into_iter()
        .chain(problems.into_iter().map(|p| {
            let path = match &doc {
                Some(d) => as_written(d.as_table(), p.path),
                None => p.path,
            };
            ConfigError {
                file: file.into(),
                line: doc
                    .as_ref()
                    .and_then(|d| span_of(d.as_table(), &path))
                    .map(|off| lines.line_of(off)),
                key: path.to_string(),
                message: p.message,
            }
        }))
        .collect())
}

/// Keys a file may still spell by an old name (serde aliases): (table,
/// key, old name).
const OLD_NAMES: &[(&str, &str, &str)] =
    &[("daemon", "shared_table_entries", "shared_table_buckets")];

/// `path`, or the same key by its old name where the file uses that name:
/// a problem of the value is reported at the key the file has, and on its
/// line. Under the new name it named a key the file does not have, and so
/// no line.
fn as_written(root: &toml_edit::Table, path: KeyPath) -> KeyPath {
    let [PathSeg::Key(table), PathSeg::Key(key)] = path.0.as_slice() else {
        return path;
    };
    let Some(t) = root.get(table).and_then(|i| i.as_table_like()) else {
        return path;
    };
    match OLD_NAMES.iter().find(|(tb, k, _)| tb == table && k == key) {
        Some((_, _, old)) if !t.contains_key(key) && t.contains_key(old) => {
            KeyPath(vec![k(table), k(old)])
        }
        _ => path,
    }
}

/// A semantic problem found by [`validate`], located by key path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Where in the document.
    pub path: KeyPath,
    /// What is wrong and what to do.
    pub message: String,
}

/// A key path into the document: table keys and array-of-tables indexes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyPath(pub Vec<PathSeg>);

/// One step of a [`KeyPath`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathSeg {
    /// A table key.
    Key(String),
    /// An index into an array of tables.
    Index(usize),
}

impl KeyPath {
    fn at(parts: &[PathSeg]) -> Self {
        Self(parts.to_vec())
    }
}

impl std::fmt::Display for KeyPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut first = true;
        for seg in &self.0 {
            match seg {
                PathSeg::Key(k) => {
                    if !first {
                        f.write_str(".")?;
                    }
                    f.write_str(k)?;
                }
                PathSeg::Index(i) => write!(f, "[{i}]")?,
            }
            first = false;
        }
        Ok(())
    }
}

fn k(s: &str) -> PathSeg {
    PathSeg::Key(s.into())
}

/// Parse a duration such as "2s", "300ms", "5m".
///
/// Any length humantime accepts (up to ~584 billion years) comes back;
/// callers that keep or add the result to a clock use
/// [`parse_duration_in`] with that key's bounds instead.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(s.trim())
        .map_err(|e| format!("{s:?} is not a duration ({e}); write e.g. \"2s\", \"500ms\", \"5m\""))
}

/// Inclusive bounds of one kind of duration and an example for the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DurationBounds {
    /// Shortest value accepted.
    pub min: std::time::Duration,
    /// Longest value accepted.
    pub max: std::time::Duration,
    /// A sensible value, shown in the error.
    pub example: &'static str,
}

const fn bounds(min_ms: u64, max_s: u64, example: &'static str) -> DurationBounds {
    DurationBounds {
        min: std::time::Duration::from_millis(min_ms),
        max: std::time::Duration::from_secs(max_s),
        example,
    }
}

const HOUR: u64 = 3_600;
const DAY: u64 = 86_400;

/// `[daemon] drain_timeout`: 0 (close at once) ..= 1 day.
pub const DRAIN_TIMEOUT_BOUNDS: DurationBounds = bounds(0, DAY, "30s");
/// `persistence`: 0 (off) ..= 30 days (the longest flow-table timeout).
pub const PERSISTENCE_BOUNDS: DurationBounds = bounds(0, 30 * DAY, "300s");
/// `connect_timeout`: 1 ms ..= 1 hour.
pub const CONNECT_TIMEOUT_BOUNDS: DurationBounds = bounds(1, HOUR, "2s");
/// `udp_timeout`: 1 ms ..= 30 days.
pub const UDP_TIMEOUT_BOUNDS: DurationBounds = bounds(1, 30 * DAY, "300s");
/// `[service.health] interval`: 1 ms ..= 1 hour.
pub const HEALTH_INTERVAL_BOUNDS: DurationBounds = bounds(1, HOUR, "2s");
/// `[service.health] timeout`: 1 ms ..= 1 hour (and at most the interval).
pub const HEALTH_TIMEOUT_BOUNDS: DurationBounds = bounds(1, HOUR, "1s");

/// Parse a duration and check it lies within `b`; the error says the range.
pub fn parse_duration_in(s: &str, b: DurationBounds) -> Result<std::time::Duration, String> {
    let d = parse_duration(s)?;
    if (b.min..=b.max).contains(&d) {
        return Ok(d);
    }
    Err(format!(
        "{s:?} is outside {}..={}; use e.g. {:?}",
        humantime::format_duration(b.min),
        humantime::format_duration(b.max),
        b.example
    ))
}

/// Which duration key a [`Dur`] is: its bounds.
pub trait DurationKind {
    /// What the key accepts.
    const BOUNDS: DurationBounds;
}

macro_rules! duration_kinds {
    ($($(#[$doc:meta])* $name:ident = $bounds:expr;)*) => {$(
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name {}
        impl DurationKind for $name {
            const BOUNDS: DurationBounds = $bounds;
        }
    )*};
}

duration_kinds! {
    /// `[daemon] drain_timeout`.
    DrainTimeout = DRAIN_TIMEOUT_BOUNDS;
    /// `persistence`.
    Persistence = PERSISTENCE_BOUNDS;
    /// `connect_timeout`.
    ConnectTimeout = CONNECT_TIMEOUT_BOUNDS;
    /// `udp_timeout`.
    UdpTimeout = UDP_TIMEOUT_BOUNDS;
    /// `[service.health] interval`.
    HealthInterval = HEALTH_INTERVAL_BOUNDS;
    /// `[service.health] timeout`.
    HealthTimeout = HEALTH_TIMEOUT_BOUNDS;
    /// `[tenant.timeouts]` keys.
    StateTimeout = STATE_TIMEOUT_BOUNDS;
}

/// `[tenant.timeouts]` keys: 1 s (the expiry runs once a second) ..= 30 days.
pub const STATE_TIMEOUT_BOUNDS: DurationBounds = DurationBounds {
    min: MIN_STATE_TIMEOUT,
    max: MAX_STATE_TIMEOUT,
    example: "900s",
};

/// A duration key's value, checked against its kind's bounds when parsed
/// (from the file, a JSON body or [`str::parse`]), so nothing downstream
/// parses text again. It keeps the text it was written as, which is what
/// it serialises to: `weir save` and the admin API give back "300s" as
/// "300s", not "5m".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dur<K> {
    value: std::time::Duration,
    text: String,
    kind: std::marker::PhantomData<fn() -> K>,
}

impl<K: DurationKind> Dur<K> {
    /// The duration.
    pub fn get(&self) -> std::time::Duration {
        self.value
    }

    /// The text it was written as.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// A value written in code, known to be in bounds; `text` must say
    /// `ms` milliseconds (checked in debug builds).
    pub fn fixed(text: &str, ms: u64) -> Self {
        let value = std::time::Duration::from_millis(ms);
        debug_assert_eq!(parse_duration_in(text, K::BOUNDS), Ok(value));
        Self {
            value,
            text: text.to_owned(),
            kind: std::marker::PhantomData,
        }
    }
}

impl<K: DurationKind> std::str::FromStr for Dur<K> {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Ok(Self {
            value: parse_duration_in(text, K::BOUNDS)?,
            text: text.to_owned(),
            kind: std::marker::PhantomData,
        })
    }
}

impl<K: DurationKind> std::fmt::Display for Dur<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl<K> Serialize for Dur<K> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de, K: DurationKind> Deserialize<'de> for Dur<K> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// `serde_json::from_value` for the admin API's bodies, whose error starts
/// with the key path of the value it refused ("backend[0].proxy_protocol:
/// ..."), as the config file's errors do.
pub fn from_json<T: serde::de::DeserializeOwned>(
    v: serde_json::Value,
) -> Result<T, serde_path_to_error::Error<serde_json::Error>> {
    serde_path_to_error::deserialize(v)
}

/// A [`ServiceSpec`] from a JSON body, errors led by the key path. serde
/// loses the path inside the flattened [`ServiceOptions`], so their typed
/// values (durations) are checked first, by key.
pub fn service_from_json(v: serde_json::Value) -> Result<ServiceSpec, String> {
    let typed: [(&[&str], DurationBounds); 4] = [
        (&["connect_timeout"], CONNECT_TIMEOUT_BOUNDS),
        (&["udp_timeout"], UDP_TIMEOUT_BOUNDS),
        (&["health", "interval"], HEALTH_INTERVAL_BOUNDS),
        (&["health", "timeout"], HEALTH_TIMEOUT_BOUNDS),
    ];
    for (path, b) in typed {
        let at = path.iter().try_fold(&v, |at, key| at.get(key));
        if let Some(text) = at.and_then(|t| t.as_str())
            && let Err(e) = parse_duration_in(text, b)
        {
            return Err(format!("{}: {e}", path.join(".")));
        }
    }
    from_json(v).map_err(|e| e.to_string())
}

/// A persistence netmask: IPv4 dotted mask or IPv6 prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Netmask {
    /// Prefix length for IPv4 clients.
    pub v4_prefix: u8,
    /// Prefix length for IPv6 clients.
    pub v6_prefix: u8,
}

/// Parse `persistence_netmask`: "255.255.255.0" (IPv4) or "64" (IPv6 prefix length).
pub fn parse_netmask(s: &str) -> Result<Netmask, String> {
    let s = s.trim();
    if let Ok(ip) = s.parse::<std::net::Ipv4Addr>() {
        let bits = u32::from(ip);
        let prefix = bits.leading_ones();
        if bits.checked_shl(prefix).unwrap_or(0) != 0 {
            return Err(format!(
                "{s:?} is not a contiguous netmask; write e.g. \"255.255.255.0\""
            ));
        }
        // prefix <= 32 always fits in u8.
        return Ok(Netmask {
            v4_prefix: prefix as u8,
            v6_prefix: 128,
        });
    }
    match s.parse::<u8>() {
        Ok(p) if p <= 128 => Ok(Netmask {
            v4_prefix: 32,
            v6_prefix: p,
        }),
        _ => Err(format!(
            "{s:?} is neither an IPv4 netmask (\"255.255.255.0\") nor an IPv6 prefix length (0..=128)"
        )),
    }
}

/// Check a tenant name: non-empty, `[A-Za-z0-9._-]`, at most 64 bytes.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 64 {
        return Err("must be 1 to 64 characters long".into());
    }
    if name == "." || name == ".." {
        // A path segment the admin API's URLs cannot name.
        return Err(format!(
            "{name:?} is not a name (it names a directory in a URL path)"
        ));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Err(format!(
            "{name:?} has characters other than letters, digits, '.', '_' and '-'"
        ));
    }
    Ok(())
}

/// One token, one role: the full-access, read-only and tenant tokens must
/// all differ, or which role a request gets would depend on check order.
/// Each repeat is reported at its second key, naming the first (never the
/// token itself).
fn duplicate_tokens<'a>(c: &'a Config) -> Vec<(Vec<PathSeg>, String)> {
    let mut seen: std::collections::HashMap<&'a str, String> = std::collections::HashMap::new();
    let mut out = Vec::new();
    let mut note = |token: Option<&'a String>, path: Vec<PathSeg>, role: String| {
        let Some(t) = token.map(|t| t.trim()).filter(|t| !t.is_empty()) else {
            return;
        };
        match seen.get(t) {
            Some(first) => out.push((
                path,
                format!("is the same token as {first}: a token may hold one role only; give each its own"),
            )),
            None => {
                seen.insert(t, role);
            }
        }
    };
    note(
        c.admin.token.as_ref(),
        vec![k("admin"), k("token")],
        "admin.token".into(),
    );
    note(
        c.admin.readonly_token.as_ref(),
        vec![k("admin"), k("readonly_token")],
        "admin.readonly_token".into(),
    );
    for (i, t) in c.tenants.iter().enumerate() {
        note(
            t.token.as_ref(),
            vec![k("tenant"), PathSeg::Index(i), k("token")],
            format!("tenant {:?}'s token", t.name),
        );
    }
    out
}

/// How `[admin]` may be reached: `tls_cert` and `tls_key` come together and
/// only on a TCP `listen`; plain HTTP on an address other than loopback
/// (which carries tokens in clear) needs `insecure_plaintext = true`. Reads
/// no file: [`crate::admin::tls::load_server_config`] checks the files.
fn check_admin_transport(a: &AdminConfig) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(_), Some(_)) => true,
        (None, None) => false,
        (Some(_), None) => {
            out.push(("tls_key", "tls_cert is set but tls_key is not: give the certificate's private key (PEM), or remove tls_cert".into()));
            true
        }
        (None, Some(_)) => {
            out.push(("tls_cert", "tls_key is set but tls_cert is not: give the certificate chain (PEM), or remove tls_key".into()));
            true
        }
    };
    if a.listen.starts_with("unix:") {
        if tls {
            out.push(("tls_cert", format!("listen = {:?} is a unix socket, which TLS does not apply to (file permissions guard it): remove tls_cert and tls_key, or listen on IP:PORT", a.listen)));
        }
        return out;
    }
    if let Ok(addr) = a.listen.parse::<SocketAddr>()
        && !tls
        && !a.insecure_plaintext
        && !addr.ip().to_canonical().is_loopback()
    {
        out.push(("listen", format!(
            "{addr} is not a loopback address and the admin API would speak plain HTTP, sending tokens in clear: \
             set tls_cert and tls_key (see docs/admin.md), listen on 127.0.0.1, or set insecure_plaintext = true if the network is trusted"
        )));
    }
    out
}

/// Largest starting size of a tenant's own flow table, and of its cap, in
/// entries (the flow table's `MAX_OWN_BUCKETS`).
pub const MAX_TABLE_ENTRIES: usize = weir_flowtable::MAX_OWN_BUCKETS;
/// Largest starting size of the shared flow table, in entries (what its
/// bucket array costs at start: ~11 B per entry, so 2^26 is ~0.7 GiB).
pub const MAX_SHARED_TABLE_ENTRIES: usize = 1 << 26;
/// Largest cap of the shared flow table, in entries (the table's maximum).
pub const MAX_SHARED_TABLE_CAP: usize = 1 << 28;

/// Problems of `[daemon] shared_table_entries` / `max_shared_table_entries`,
/// as (key, message). Powers of two, as `table_entries`: sizes double and
/// halve as the table resizes, so a power of two is a size it passes.
pub fn shared_table_problems(d: &DaemonConfig) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let start = d.shared_table_entries;
    if !start.is_power_of_two() || start > MAX_SHARED_TABLE_ENTRIES {
        out.push((
            "shared_table_entries",
            format!("{start} is not a power of two in 1..=2^26; use e.g. 131072"),
        ));
    }
    let cap = d.max_shared_table_entries;
    if cap != 0 && (!cap.is_power_of_two() || cap > MAX_SHARED_TABLE_CAP) {
        out.push((
            "max_shared_table_entries",
            format!(
                "{cap} must be 0 (the table's maximum, 2^28) or a power of two up to 2^28 (268435456)"
            ),
        ));
    } else if cap != 0 && cap < start {
        out.push((
            "max_shared_table_entries",
            format!(
                "{cap} is below shared_table_entries ({start}): the cap must be at least the starting size; raise it or set 0 for no cap below 2^28"
            ),
        ));
    }
    out
}

/// Problems of a tenant's `table_entries` / `max_table_entries`, as (key,
/// message): the config file's validation and the admin API's checks share
/// them.
pub fn tenant_table_problems(t: &TenantSpec) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let (start, cap) = (t.table_entries, t.max_table_entries);
    if start != 0 && (!start.is_power_of_two() || start > MAX_TABLE_ENTRIES) {
        out.push((
            "table_entries",
            format!("{start} must be 0 (shared table) or a power of two up to 16777216"),
        ));
    }
    if cap == 0 {
        return out;
    }
    if start == 0 {
        out.push((
            "max_table_entries",
            format!(
                "{cap} caps an own table, but table_entries = 0 shares the global one (capped by [daemon] max_shared_table_entries); set table_entries too, or remove max_table_entries"
            ),
        ));
    } else if !cap.is_power_of_two() || cap > MAX_TABLE_ENTRIES {
        out.push((
            "max_table_entries",
            format!(
                "{cap} must be 0 (the table's maximum, 16777216) or a power of two up to 16777216"
            ),
        ));
    } else if cap < start {
        out.push((
            "max_table_entries",
            format!(
                "{cap} is below table_entries ({start}): the cap must be at least the starting size; raise it or set 0 for the table's maximum"
            ),
        ));
    }
    out
}

/// Every semantic problem of a parsed configuration (empty = valid).
pub fn validate(c: &Config) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut err = |path: &[PathSeg], message: String| {
        out.push(Problem {
            path: KeyPath::at(path),
            message,
        })
    };
    let d = &c.daemon;
    let dk = k("daemon");
    for (key, message) in shared_table_problems(d) {
        err(&[dk.clone(), k(key)], message);
    }
    if !(1024..=16 << 20).contains(&d.buffer_size) {
        err(
            &[dk.clone(), k("buffer_size")],
            format!(
                "{} is outside 1024..=16777216 bytes; use e.g. 32768",
                d.buffer_size
            ),
        );
    }
    if d.notsent_lowat > 1 << 30 {
        err(
            &[dk.clone(), k("notsent_lowat")],
            "is above 1 GiB; use e.g. 16384, or 0 for the kernel default".into(),
        );
    }
    if d.blocked_window != 0 && !(2048..=1 << 30).contains(&d.blocked_window) {
        err(
            &[dk.clone(), k("blocked_window")],
            format!(
                "{} is outside 2048..=1073741824 bytes; use e.g. 65536, or 0 to never clamp",
                d.blocked_window
            ),
        );
    }
    if d.backend_rcvbuf != 0 && !(4096..=1 << 30).contains(&d.backend_rcvbuf) {
        err(
            &[dk.clone(), k("backend_rcvbuf")],
            format!(
                "{} is outside 4096..=1073741824 bytes; use e.g. 65536, or 0 for the kernel's autotuning",
                d.backend_rcvbuf
            ),
        );
    }
    if d.workers > 1024 {
        err(
            &[dk.clone(), k("workers")],
            "more than 1024 workers; use 0 for one per CPU".into(),
        );
    }
    if let Some(cpu) = d.estimator_cpu
        && cpu >= MAX_CPUS
    {
        err(
            &[dk.clone(), k("estimator_cpu")],
            format!(
                "CPU {cpu} is out of range (0..{MAX_CPUS}); give a CPU number of this machine, e.g. 0, or remove the key for no pinning"
            ),
        );
    }
    if let Some(nice) = d.estimator_nice
        && !(-20..=19).contains(&nice)
    {
        err(
            &[dk, k("estimator_nice")],
            format!(
                "nice {nice} is outside -20..=19; use e.g. -5 (more CPU) or 5 (less), or remove the key to inherit"
            ),
        );
    }
    let a = &c.admin;
    if !a.listen.starts_with("unix:") && a.listen.parse::<SocketAddr>().is_err() {
        err(
            &[k("admin"), k("listen")],
            format!(
                "{:?} is neither IP:PORT nor unix:/path; use e.g. \"127.0.0.1:9900\"",
                a.listen
            ),
        );
    }
    if a.token.is_some() && a.token_file.is_some() {
        err(
            &[k("admin"), k("token_file")],
            "set either token or token_file, not both".into(),
        );
    }
    for e in check_admin_transport(a) {
        err(&[k("admin"), k(e.0)], e.1);
    }

    let mut tenant_names = std::collections::HashSet::new();
    for (i, t) in c.tenants.iter().enumerate() {
        let base = [k("tenant"), PathSeg::Index(i)];
        if let Err(e) = check_name(&t.name) {
            err(&[base[0].clone(), base[1].clone(), k("name")], e);
        }
        if !tenant_names.insert(t.name.as_str()) {
            err(
                &[base[0].clone(), base[1].clone(), k("name")],
                format!("tenant {:?} is defined twice; rename or merge one", t.name),
            );
        }
        if let Err(errors) = t.timeouts.resolve() {
            for (key, message) in errors {
                err(
                    &[base[0].clone(), base[1].clone(), k("timeouts"), k(key)],
                    message,
                );
            }
        }
        for (key, list) in [
            ("allowed_listen", &t.allowed_listen),
            ("allowed_backends", &t.allowed_backends),
        ] {
            for (j, e) in list.iter().enumerate() {
                if let Err(m) = e.parse::<AddrRange>() {
                    err(
                        &[base[0].clone(), base[1].clone(), k(key), PathSeg::Index(j)],
                        m,
                    );
                }
            }
        }
        for (key, message) in tenant_table_problems(t) {
            err(&[base[0].clone(), base[1].clone(), k(key)], message);
        }
        if t.max_services > 0 {
            let n = c.services.iter().filter(|s| s.tenant == t.name).count() as u64;
            if n > t.max_services {
                err(
                    &[base[0].clone(), base[1].clone(), k("max_services")],
                    format!(
                        "tenant {:?} has {n} services in this file, over its max_services ({}): \
                         raise it or remove services",
                        t.name, t.max_services
                    ),
                );
            }
        }
        if t.max_backends > 0 {
            let n: u64 = c
                .services
                .iter()
                .filter(|s| s.tenant == t.name)
                .map(|s| s.backends.len() as u64)
                .sum();
            if n > t.max_backends {
                err(
                    &[base[0].clone(), base[1].clone(), k("max_backends")],
                    format!(
                        "tenant {:?} has {n} backends in this file, over its max_backends ({}): \
                         raise it or remove backends",
                        t.name, t.max_backends
                    ),
                );
            }
        }
    }

    for (path, message) in duplicate_tokens(c) {
        err(&path, message);
    }
    if let Some(p) = &c.packet {
        for e in packet_problems(p) {
            let mut path = vec![k("packet")];
            path.extend(e.path.0);
            err(&path, e.message);
        }
    }

    let mut service_names = std::collections::HashSet::new();
    let mut listens = std::collections::HashMap::new();
    for (i, s) in c.services.iter().enumerate() {
        let base = vec![k("service"), PathSeg::Index(i)];
        let p = |key: &str| {
            let mut v = base.clone();
            v.push(k(key));
            v
        };
        for e in service_problems(s)
            .into_iter()
            .chain(packet_service_problems(s, c.packet.as_ref()))
        {
            let mut path = base.clone();
            path.extend(e.path.0);
            err(&path, e.message);
        }
        if s.tenant != DEFAULT_TENANT && !tenant_names.contains(s.tenant.as_str()) {
            err(
                &p("tenant"),
                format!(
                    "tenant {:?} is not defined; add a [[tenant]] with name = {:?} or omit the key for \"default\"",
                    s.tenant, s.tenant
                ),
            );
        }
        if !service_names.insert((s.tenant.as_str(), s.name.as_str())) {
            err(
                &p("name"),
                format!(
                    "service {:?} is defined twice in tenant {:?}",
                    s.name, s.tenant
                ),
            );
        }
        if let Some(prev) = listens.insert((s.protocol, s.listen), i)
            && s.listen.port() != 0
        {
            {
                err(
                    &p("listen"),
                    format!(
                        "{} {} is already used by service[{prev}]; give each service its own address",
                        protocol_name(s.protocol),
                        s.listen
                    ),
                );
            }
        }
    }
    out
}

/// Why `listen` may not carry its IPv6 scope id, if so.
/// The kernel reads a scope id only for an address that needs one
/// (link-local, multicast) and ignores it elsewhere, so `[::1%1]:80` binds
/// `[::1]:80`: weir would take it for another address than a service's
/// `[::1]:80`, and its `SO_REUSEPORT` sockets would join that service's
/// group and take a share of its connections.
fn listen_scope_problem(listen: SocketAddr) -> Option<String> {
    let SocketAddr::V6(v6) = listen else {
        return None;
    };
    let ip = v6.ip();
    let needs_scope = ip.is_multicast() || (ip.segments()[0] & 0xffc0) == 0xfe80;
    (v6.scope_id() != 0 && !needs_scope).then(|| {
        format!(
            "{listen}: a scope id (%{}) applies only to link-local and multicast addresses \
             (the kernel ignores it on [{ip}]); write [{ip}]:{}",
            v6.scope_id(),
            v6.port()
        )
    })
}

/// Problems of one service on its own (paths relative to the service).
pub fn service_problems(s: &ServiceSpec) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut err = |path: Vec<PathSeg>, message: String| {
        out.push(Problem {
            path: KeyPath(path),
            message,
        })
    };
    if let Err(e) = check_name(&s.name) {
        err(vec![k("name")], e);
    }
    if let Err(e) = check_name(&s.tenant) {
        err(vec![k("tenant")], e);
    }
    if let Some(e) = listen_scope_problem(s.listen) {
        err(vec![k("listen")], e);
    }
    if let Some(m) = &s.persistence_netmask
        && let Err(e) = parse_netmask(m)
    {
        err(vec![k("persistence_netmask")], e);
    }
    let o = &s.options;
    if s.protocol == Protocol::Tcp {
        if o.udp_responses.is_some() {
            err(
                vec![k("udp_responses")],
                "only applies to protocol = \"udp\"; remove it".into(),
            );
        }
        if o.udp_timeout.is_some() {
            err(
                vec![k("udp_timeout")],
                "only applies to protocol = \"udp\"; remove it".into(),
            );
        }
        if o.udp_max_sessions_per_client != 0 {
            err(
                vec![k("udp_max_sessions_per_client")],
                "only applies to protocol = \"udp\"; remove it".into(),
            );
        }
    }
    if o.udp_responses == Some(0) {
        err(
            vec![k("udp_responses")],
            "0 responses would end every session at once; use >= 1 or remove the key".into(),
        );
    }
    for (key, set, only) in [
        ("mh_fallback", o.mh_fallback, "mh"),
        ("mh_port", o.mh_port, "mh"),
        ("mh_table_size", o.mh_table_size.is_some(), "mh"),
        ("sh_fallback", o.sh_fallback, "sh"),
        ("sh_port", o.sh_port, "sh"),
    ] {
        if set && s.scheduler.as_str() != only {
            err(
                vec![k(key)],
                format!("only applies to scheduler = \"{only}\"; remove it"),
            );
        }
    }
    if let Some(size) = o.mh_table_size
        && let Err(e) = weir_sched::MhTableSize::new(size)
    {
        err(vec![k("mh_table_size")], e.to_string());
    }
    if let Some(p) = o.client_prefix6
        && !(1..=128).contains(&p)
    {
        err(
            vec![k("client_prefix6")],
            format!(
                "{p} is not an IPv6 prefix length: use 1..=128 (default 64; 128 counts each address)"
            ),
        );
    }
    if s.protocol == Protocol::Udp && o.tcp_max_connections_per_client != 0 {
        err(
            vec![k("tcp_max_connections_per_client")],
            "only applies to protocol = \"tcp\"; for UDP use udp_max_sessions_per_client".into(),
        );
    }
    if let Some(h) = &o.health {
        let hp = |key: &str| vec![k("health"), k(key)];
        let (iv, to) = (h.interval.get(), h.timeout.get());
        if to > iv {
            err(
                hp("timeout"),
                format!("timeout {to:?} exceeds interval {iv:?}; make it at most the interval"),
            );
        }
        if h.rise == 0 {
            err(hp("rise"), "must be at least 1".into());
        }
        if h.fall == 0 {
            err(hp("fall"), "must be at least 1".into());
        }
        if h.port == Some(0) {
            err(hp("port"), "must be 1-65535".into());
        }
        match h.protocol.unwrap_or(Protocol::Tcp) {
            Protocol::Tcp => {
                if h.send.is_some() {
                    err(
                        hp("send"),
                        "only applies to protocol = \"udp\" checks; remove it".into(),
                    );
                }
                if s.protocol == Protocol::Udp && h.port.is_none() {
                    err(
                        vec![k("health")],
                        "a TCP connect check on a UDP service marks UDP-only backends down; \
                         set protocol = \"udp\" and send = \"...\" for a UDP check (any \
                         reply within the timeout passes), or port = N to check a TCP port \
                         of each backend"
                            .into(),
                    );
                }
            }
            Protocol::Udp => {
                if h.send.as_deref().is_none_or(str::is_empty) {
                    err(
                        hp("send"),
                        "a UDP check needs a payload to send, e.g. send = \"ping\"".into(),
                    );
                }
            }
        }
    }
    forward_problems(s, &mut err);
    let mut seen = std::collections::HashSet::new();
    for (j, b) in s.backends.iter().enumerate() {
        let bp = |key: &str| vec![k("backend"), PathSeg::Index(j), k(key)];
        // `[::ffff:10.0.0.1]:80` is `10.0.0.1:80`: one backend, written two
        // ways.
        if !seen.insert(SocketAddr::new(
            b.address.ip().to_canonical(),
            b.address.port(),
        )) {
            err(
                bp("address"),
                format!("backend {} is listed twice; remove one", b.address),
            );
        }
        // `[::ffff:0.0.0.0]` is 0.0.0.0 too, and Linux connects a socket
        // to either on the host itself.
        if b.address.port() == 0 || b.address.ip().to_canonical().is_unspecified() {
            err(
                bp("address"),
                format!(
                    "{} is not a reachable address; give a real IP and port",
                    b.address
                ),
            );
        }
        if b.weight > 65535 {
            err(
                bp("weight"),
                format!("{} is above 65535 (the IPVS maximum)", b.weight),
            );
        }
        if let Some(pp) = b.proxy_protocol
            && !s.forward.is_packet()
        {
            use crate::proxy_protocol::Version;
            if s.protocol == Protocol::Udp && pp == Version::V1 {
                err(
                    bp("proxy_protocol"),
                    "PROXY v1 is TCP-only; remove it for UDP services".into(),
                );
            } else if s.protocol == Protocol::Udp {
                err(
                    bp("proxy_protocol"),
                    "PROXY protocol to UDP backends is not supported; remove it".into(),
                );
            }
        }
    }
    out
}

/// Problems of `[packet]` on its own (paths relative to it), including
/// interfaces that do not exist in this process's network namespace: `weir
/// check` on another host (or in another namespace) reports them too.
pub fn packet_problems(p: &PacketConfig) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut err = |path: Vec<PathSeg>, message: String| {
        out.push(Problem {
            path: KeyPath(path),
            message,
        })
    };
    if p.interfaces.is_empty() {
        err(
            vec![k("interfaces")],
            "is empty; name the interfaces weir attaches to, e.g. [\"eth0\"], or remove \
             [packet] if no service uses packet mode"
                .into(),
        );
    }
    let mut seen = std::collections::HashSet::new();
    for (i, name) in p.interfaces.iter().enumerate() {
        let at = vec![k("interfaces"), PathSeg::Index(i)];
        if !seen.insert(name.as_str()) {
            err(
                at,
                format!("interface {name:?} is listed twice; remove one"),
            );
        } else if let Err(e) = interface_exists(name) {
            err(at, e);
        }
    }
    let mut seen = std::collections::HashSet::new();
    for (i, name) in p.backend_interfaces.iter().enumerate() {
        let at = vec![k("backend_interfaces"), PathSeg::Index(i)];
        if !seen.insert(name.as_str()) {
            err(
                at,
                format!("interface {name:?} is listed twice; remove one"),
            );
        } else if !p.interfaces.contains(name) {
            err(
                at,
                format!(
                    "{name:?} is not one of interfaces; backends' replies can only arrive \
                     where weir attaches: add it to interfaces or remove it here"
                ),
            );
        }
    }
    let mut seen = std::collections::HashSet::new();
    for (i, a) in p.local_addresses.iter().enumerate() {
        let at = vec![k("local_addresses"), PathSeg::Index(i)];
        if !seen.insert(*a) {
            err(at, format!("{a} is listed twice; remove one"));
        } else if a.is_unspecified() || a.is_multicast() || *a == IpAddr::from([255, 255, 255, 255])
        {
            err(
                at,
                format!(
                    "{a} cannot be a source address; give an address assigned to the \
                     backend-side interface"
                ),
            );
        }
    }
    if p.workers > 1024 {
        err(
            vec![k("workers")],
            "more than 1024 packet workers; use 0 for as many as [daemon] workers".into(),
        );
    }
    if !p.xdp_ring_size.is_power_of_two() || !(64..=32768).contains(&p.xdp_ring_size) {
        err(
            vec![k("xdp_ring_size")],
            format!(
                "{} is not a power of two from 64 to 32768 (default {DEFAULT_XDP_RING_SIZE})",
                p.xdp_ring_size
            ),
        );
    }
    out
}

/// Whether interface `name` exists in this process's network namespace;
/// else what is wrong, in words for `weir check`.
pub fn interface_exists(name: &str) -> Result<(), String> {
    // The kernel's dev_valid_name(): 1..=15 bytes, not "." or "..", no
    // '/', ':' or white space.
    if name.is_empty()
        || name.len() > 15
        || name == "."
        || name == ".."
        || name
            .bytes()
            .any(|b| b == b'/' || b == b':' || b == 0 || b.is_ascii_whitespace())
    {
        return Err(format!(
            "{name:?} is not an interface name (1-15 bytes, no '/', ':' or spaces); \
             give a name `ip link` lists, e.g. \"eth0\""
        ));
    }
    match nix::net::if_::if_nametoindex(name) {
        Ok(_) => Ok(()),
        Err(nix::errno::Errno::ENODEV) => Err(format!(
            "interface {name:?} does not exist in this network namespace (interface names \
             are per network namespace; `ip link` lists this one's); create it, fix the \
             name, or run weir in the namespace that has it (ip netns exec NS weir ...)"
        )),
        Err(e) => Err(format!(
            "cannot look interface {name:?} up: {e}; check that it exists (`ip link`)"
        )),
    }
}

/// Problems of a packet service (`forward` other than proxy) that depend on
/// `[packet]` (paths relative to the service); none for a proxy service.
/// The daemon runs this on every service it adds, with its own `[packet]`.
pub fn packet_service_problems(s: &ServiceSpec, packet: Option<&PacketConfig>) -> Vec<Problem> {
    let mut out = Vec::new();
    if !s.forward.is_packet() {
        return out;
    }
    let mut err = |path: Vec<PathSeg>, message: String| {
        out.push(Problem {
            path: KeyPath(path),
            message,
        })
    };
    let f = s.forward;
    let Some(p) = packet else {
        err(
            vec![k("forward")],
            format!(
                "forward = \"{f}\" needs packet mode: add a [packet] section naming the \
                 interfaces weir attaches to (interfaces = [\"eth0\"]), or remove forward for \
                 the proxy"
            ),
        );
        return out;
    };
    if f == Forward::Fnat {
        if p.local_addresses.is_empty() {
            err(
                vec![k("forward")],
                "fnat rewrites the source to one of [packet] local_addresses, and there are \
                 none; add the backend-side addresses, e.g. local_addresses = [\"10.0.1.1\"], \
                 or use forward = \"nat\""
                    .into(),
            );
        } else {
            for (j, b) in s.backends.iter().enumerate() {
                if !p
                    .local_addresses
                    .iter()
                    .any(|a| a.is_ipv4() == b.address.is_ipv4())
                {
                    let fam = if b.address.is_ipv4() { "IPv4" } else { "IPv6" };
                    err(
                        vec![k("backend"), PathSeg::Index(j), k("address")],
                        format!(
                            "fnat to an {fam} backend needs an {fam} address in [packet] \
                             local_addresses (there is none); add one"
                        ),
                    );
                }
            }
        }
    }
    if p.local_addresses.contains(&s.listen.ip()) && p.fnat_ports.contains(s.listen.port()) {
        err(
            vec![k("listen")],
            format!(
                "{} is a [packet] local address and its port is in fnat_ports ({}), which \
                 fnat takes for its own flows; use another port or address",
                s.listen, p.fnat_ports
            ),
        );
    }
    out
}

/// The per-service rules of packet mode that need no `[packet]` (part of
/// [`service_problems`]).
fn forward_problems(s: &ServiceSpec, err: &mut dyn FnMut(Vec<PathSeg>, String)) {
    let f = s.forward;
    let o = &s.options;
    if !f.is_packet() {
        if o.sloppy_tcp {
            err(
                vec![k("sloppy_tcp")],
                "only applies to packet services (forward = \"nat\", \"fnat\" or \"dr\"): \
                 the proxy accepts connections, so it never sees a packet without one; remove it"
                    .into(),
            );
        }
        return;
    }
    if s.listen.port() == 0 || s.listen.ip().is_unspecified() {
        err(
            vec![k("listen")],
            format!(
                "{} is not a virtual address: a packet service matches packets by their \
                 destination, so it needs a specific IP and a port (e.g. \"10.0.0.100:80\"); \
                 only the proxy can bind a wildcard or take a free port",
                s.listen
            ),
        );
    }
    if o.sloppy_tcp && s.protocol == Protocol::Udp {
        err(
            vec![k("sloppy_tcp")],
            "only applies to protocol = \"tcp\"; remove it".into(),
        );
    }
    // Options of the proxy's own sockets, which packet mode does not have:
    // it never connects to a backend (the client's SYN goes through, so
    // the client's own timeout applies), never owns a backend socket to
    // close after N answers (and replies still in flight need the flow's
    // mapping), and never writes into the byte stream (a PROXY header
    // would need the sequence numbers rewritten on every packet).
    // The others (persistence, tenant, backend and per-client limits,
    // health, expire_nodest_conn, udp_timeout, scheduler options) mean the
    // same for a flow as for a connection.
    let proxy_only = [
        (
            "connect_timeout",
            o.connect_timeout.is_some(),
            "packet mode forwards the client's own SYN and opens no connection",
        ),
        (
            "udp_responses",
            o.udp_responses.is_some() && s.protocol == Protocol::Udp,
            "packet mode keeps a UDP flow until its idle timeout (udp_timeout)",
        ),
    ];
    for (key, set, why) in proxy_only {
        if set {
            err(
                vec![k(key)],
                format!("is a proxy option: {why}; remove it, or use forward = \"proxy\""),
            );
        }
    }
    for (j, b) in s.backends.iter().enumerate() {
        let at = |key: &str| vec![k("backend"), PathSeg::Index(j), k(key)];
        if b.proxy_protocol.is_some() {
            err(
                at("proxy_protocol"),
                format!(
                    "forward = \"{f}\" forwards packets and cannot insert a PROXY header \
                     into the byte stream; {}",
                    if f == Forward::Fnat {
                        "fnat hides the client's address, so use forward = \"nat\" or \"dr\" \
                         (the backend sees the client's own address) or \"proxy\" (with the \
                         header), or remove it"
                    } else {
                        "the backend sees the client's own address anyway; remove it"
                    }
                ),
            );
        }
        if b.address.is_ipv4() != s.listen.is_ipv4() {
            err(
                at("address"),
                format!(
                    "{} is not of the VIP's family ({}): packet mode rewrites addresses in \
                     place and does not translate between IPv4 and IPv6; give a backend of \
                     the VIP's family, or use forward = \"proxy\"",
                    b.address, s.listen
                ),
            );
        } else if f == Forward::Dr && b.address.port() != s.listen.port() && s.listen.port() != 0 {
            err(
                at("address"),
                format!(
                    "dr only rewrites the MAC address, so the backend must listen on the \
                     VIP's port {} (IPVS's rule), not {}; use port {}, or forward = \"nat\" \
                     to map ports",
                    s.listen.port(),
                    b.address.port(),
                    s.listen.port()
                ),
            );
        }
    }
}

/// "tcp" / "udp".
pub fn protocol_name(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
    }
}

/// Where the lines of a text start, found in one pass, so that each error's
/// line is a binary search instead of a scan from the top (which made
/// reporting n errors in a file of n lines quadratic).
struct Lines(Vec<usize>);

impl Lines {
    fn new(text: &str) -> Self {
        Self(
            text.bytes()
                .enumerate()
                .filter(|&(_, b)| b == b'\n')
                .map(|(i, _)| i)
                .collect(),
        )
    }

    /// 1-based line of byte `offset` (past the end: the last line).
    fn line_of(&self, offset: usize) -> usize {
        self.0.partition_point(|&nl| nl < offset) + 1
    }
}

/// Best-effort key path of an error the parser reports at `span`, e.g.
/// `service[1].backend[0].weight`: the `[table]` or `[[array]]` header above
/// it, with array indexes counted on the way down in one pass, then the key
/// on the error's line (not the value: an integer too large for TOML used to
/// come out as `daemon.99999999999999999999`).
fn shape_error_key(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    let Some(span) = span else {
        return "-".into();
    };
    let end = span.start.min(text.len());
    let before = text.get(..end).unwrap_or("");
    // Elements seen so far of each array of tables, by indexed parent path
    // ("service[3].backend"), so a new parent starts its children at 0.
    let mut counts: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut header: Option<String> = None;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    for line in before[..line_start].lines() {
        let l = line.trim();
        let (name, is_array) = if let Some(r) = l.strip_prefix("[[") {
            (r.split("]]").next().unwrap_or(""), true)
        } else if let Some(r) = l.strip_prefix('[') {
            (r.split(']').next().unwrap_or(""), false)
        } else {
            continue;
        };
        let segs: Vec<&str> = name.split('.').map(str::trim).collect();
        let mut path = String::new();
        for (n, seg) in segs.iter().enumerate() {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(seg);
            let last = n + 1 == segs.len();
            if last && is_array {
                let c = counts.entry(path.clone()).or_insert(0);
                *c += 1;
                path = format!("{path}[{}]", *c - 1);
            } else if let Some(c) = counts.get(&path) {
                path = format!("{path}[{}]", c.saturating_sub(1));
            }
        }
        header = Some(path);
    }
    // The key left of the last `=` before the error on its line (inline
    // tables: after the last `,`, `{` or `[`); else the key the span starts with.
    let on_line = &before[line_start..];
    let key = on_line
        .rfind('=')
        .map(|eq| on_line[..eq].rsplit([',', '{', '[']).next().unwrap_or(""))
        .or_else(|| {
            text.get(span.clone())
                .map(|s| s.split('=').next().unwrap_or(""))
        })
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty() && !s.contains('\n') && s.len() < 64);
    match (header, key) {
        (Some(h), Some(k)) => format!("{h}.{k}"),
        (Some(h), None) => h,
        (None, Some(k)) => k,
        (None, None) => "-".into(),
    }
}

/// Byte offset of the item at `path`, or of its closest existing ancestor.
fn span_of(root: &toml_edit::Table, path: &KeyPath) -> Option<usize> {
    let mut best = None;
    let mut item: Option<&toml_edit::Item> = None;
    let mut table_like: Option<&dyn toml_edit::TableLike> = Some(root);
    let mut segs = path.0.iter().peekable();
    while let Some(seg) = segs.next() {
        match seg {
            PathSeg::Key(key) => {
                let t = table_like?;
                let (kk, it) = t.get_key_value(key)?;
                best = kk
                    .span()
                    .map(|s| s.start)
                    .or(it.span().map(|s| s.start))
                    .or(best);
                item = Some(it);
                table_like = it.as_table_like();
            }
            PathSeg::Index(i) => {
                let it = item?;
                if let Some(aot) = it.as_array_of_tables() {
                    let t = aot.get(*i)?;
                    best = t.span().map(|s| s.start).or(best);
                    table_like = Some(t);
                } else if let Some(arr) = it.as_array() {
                    let v = arr.get(*i)?;
                    best = v.span().map(|s| s.start).or(best);
                    table_like = v.as_inline_table().map(|t| t as &dyn toml_edit::TableLike);
                } else {
                    return best;
                }
            }
        }
        if segs.peek().is_none() {
            break;
        }
    }
    best
}

/// Expected kind of a value in the shape pre-pass.
#[derive(Clone, Copy)]
enum Kind {
    /// A non-negative integer (`u64`/`usize` fields).
    Int,
    /// A non-negative integer that fits a `u32` field.
    U32,
    /// An integer that fits an `i32` field, e.g. a nice value.
    SignedInt,
    Str,
    Bool,
    /// A string that parses as `IP:PORT`.
    Addr,
    /// "tcp" or "udp".
    Proto,
    Table,
    Tables,
    /// An array of strings.
    Strs,
    /// A scheduler name ([`parse_scheduler`]).
    Sched,
    /// A PROXY protocol version, "v1" or "v2".
    ProxyVersion,
    /// A duration within these bounds ([`Dur`]).
    Dur(DurationBounds),
    /// A [`Forward`] name.
    Forward,
    /// A [`PacketIo`] name.
    PacketIo,
    /// An [`AcceptSteering`] name.
    Steering,
    /// A [`PortRange`], "A-B".
    Ports,
    /// An array of IP addresses.
    Ips,
}

const DAEMON_KEYS: &[(&str, Kind)] = &[
    ("workers", Kind::Int),
    ("shared_table_entries", Kind::Int),
    ("shared_table_buckets", Kind::Int),
    ("max_shared_table_entries", Kind::Int),
    ("own_tables_budget", Kind::Int),
    ("max_connections", Kind::Int),
    ("buffer_size", Kind::Int),
    ("notsent_lowat", Kind::U32),
    ("blocked_window", Kind::U32),
    ("backend_rcvbuf", Kind::U32),
    ("drain_timeout", Kind::Dur(DRAIN_TIMEOUT_BOUNDS)),
    ("access_log", Kind::Bool),
    ("estimator_cpu", Kind::Int),
    ("estimator_nice", Kind::SignedInt),
    ("accept_steering", Kind::Steering),
];
const ADMIN_KEYS: &[(&str, Kind)] = &[
    ("listen", Kind::Str),
    ("token", Kind::Str),
    ("token_file", Kind::Str),
    ("readonly_token", Kind::Str),
    ("metrics_public", Kind::Bool),
    ("tls_cert", Kind::Str),
    ("tls_key", Kind::Str),
    ("insecure_plaintext", Kind::Bool),
];
const TENANT_KEYS: &[(&str, Kind)] = &[
    ("name", Kind::Str),
    ("table_entries", Kind::Int),
    ("max_table_entries", Kind::Int),
    ("max_connections", Kind::Int),
    ("max_new_per_s", Kind::Int),
    ("max_services", Kind::Int),
    ("max_backends", Kind::Int),
    ("min_health_interval", Kind::Dur(HEALTH_INTERVAL_BOUNDS)),
    ("token", Kind::Str),
    ("timeouts", Kind::Table),
    ("allowed_listen", Kind::Strs),
    ("allowed_backends", Kind::Strs),
];
const TIMEOUT_KEYS: &[(&str, Kind)] = &[
    ("established", Kind::Dur(STATE_TIMEOUT_BOUNDS)),
    ("syn_sent", Kind::Dur(STATE_TIMEOUT_BOUNDS)),
    ("syn_recv", Kind::Dur(STATE_TIMEOUT_BOUNDS)),
    ("fin_wait", Kind::Dur(STATE_TIMEOUT_BOUNDS)),
    ("close_wait", Kind::Dur(STATE_TIMEOUT_BOUNDS)),
    ("last_ack", Kind::Dur(STATE_TIMEOUT_BOUNDS)),
    ("time_wait", Kind::Dur(STATE_TIMEOUT_BOUNDS)),
    ("close", Kind::Dur(STATE_TIMEOUT_BOUNDS)),
    ("udp", Kind::Dur(STATE_TIMEOUT_BOUNDS)),
    ("persist", Kind::Dur(STATE_TIMEOUT_BOUNDS)),
];
const SERVICE_KEYS: &[(&str, Kind)] = &[
    ("tenant", Kind::Str),
    ("name", Kind::Str),
    ("protocol", Kind::Proto),
    ("listen", Kind::Addr),
    ("forward", Kind::Forward),
    ("scheduler", Kind::Sched),
    ("persistence", Kind::Dur(PERSISTENCE_BOUNDS)),
    ("persistence_netmask", Kind::Str),
    ("connect_timeout", Kind::Dur(CONNECT_TIMEOUT_BOUNDS)),
    ("expire_nodest_conn", Kind::Bool),
    ("mh_fallback", Kind::Bool),
    ("sh_fallback", Kind::Bool),
    ("sh_port", Kind::Bool),
    ("mh_port", Kind::Bool),
    ("mh_table_size", Kind::U32),
    ("tcp_max_connections_per_client", Kind::Int),
    ("client_prefix6", Kind::U32),
    ("hash_seed", Kind::Str),
    ("udp_responses", Kind::U32),
    ("udp_timeout", Kind::Dur(UDP_TIMEOUT_BOUNDS)),
    ("udp_max_sessions_per_client", Kind::Int),
    ("health", Kind::Table),
    ("sloppy_tcp", Kind::Bool),
    ("backend", Kind::Tables),
];
const PACKET_KEYS: &[(&str, Kind)] = &[
    ("interfaces", Kind::Strs),
    ("backend_interfaces", Kind::Strs),
    ("io", Kind::PacketIo),
    ("local_addresses", Kind::Ips),
    ("fnat_ports", Kind::Ports),
    ("workers", Kind::Int),
    ("xdp_ring_size", Kind::U32),
];
const HEALTH_KEYS: &[(&str, Kind)] = &[
    ("interval", Kind::Dur(HEALTH_INTERVAL_BOUNDS)),
    ("timeout", Kind::Dur(HEALTH_TIMEOUT_BOUNDS)),
    ("rise", Kind::U32),
    ("fall", Kind::U32),
    ("protocol", Kind::Proto),
    ("port", Kind::Int),
    ("send", Kind::Str),
];
const BACKEND_KEYS: &[(&str, Kind)] = &[
    ("address", Kind::Addr),
    ("weight", Kind::U32),
    ("proxy_protocol", Kind::ProxyVersion),
    ("max_connections", Kind::Int),
];

/// (key path, byte offset, message, patch). A problem with a patch is a
/// typed value that does not parse (a string where the type wants one of a
/// few): the patch (its value's span and a valid stand-in) lets parsing go
/// on to report the semantic problems of the rest of the file as well.
type ShapeProblem = (
    String,
    Option<usize>,
    String,
    Option<(std::ops::Range<usize>, String)>,
);

/// Keys next to `key` whose problems only mean something with its real
/// value: not reported when `key` itself does not parse (a stand-in took
/// its place).
fn dependents(key: &str) -> &'static [&'static str] {
    match key {
        "scheduler" => &[
            "mh_fallback",
            "mh_port",
            "mh_table_size",
            "sh_fallback",
            "sh_port",
        ],
        "interval" => &["timeout"],
        "forward" => &["sloppy_tcp"],
        _ => &[],
    }
}

fn shape_problems(root: &toml_edit::Table) -> Vec<ShapeProblem> {
    let mut out = Vec::new();
    let root_keys = [
        ("daemon", Kind::Table),
        ("admin", Kind::Table),
        ("packet", Kind::Table),
        ("tenant", Kind::Tables),
        ("service", Kind::Tables),
    ];
    check_table(root, "", &root_keys, &[], &mut out);
    let sub = |key: &str| root.get(key);
    if let Some(t) = sub("daemon").and_then(|i| i.as_table_like()) {
        check_table(t, "daemon", DAEMON_KEYS, &[], &mut out);
        if t.contains_key("shared_table_entries")
            && let Some((key, _)) = t.get_key_value("shared_table_buckets")
        {
            out.push((
                "daemon.shared_table_buckets".into(),
                key.span().map(|s| s.start),
                "is the old name of shared_table_entries, which is set too; remove shared_table_buckets".into(),
                None,
            ));
        }
    }
    if let Some(t) = sub("admin").and_then(|i| i.as_table_like()) {
        check_table(t, "admin", ADMIN_KEYS, &[], &mut out);
    }
    if let Some(t) = sub("packet").and_then(|i| i.as_table_like()) {
        check_table(t, "packet", PACKET_KEYS, &["interfaces"], &mut out);
    }
    for (i, t) in tables(sub("tenant")).into_iter().enumerate() {
        check_table(t, &format!("tenant[{i}]"), TENANT_KEYS, &["name"], &mut out);
        if let Some(to) = t.get("timeouts").and_then(|i| i.as_table_like()) {
            check_table(
                to,
                &format!("tenant[{i}].timeouts"),
                TIMEOUT_KEYS,
                &[],
                &mut out,
            );
        }
    }
    for (i, t) in tables(sub("service")).into_iter().enumerate() {
        let base = format!("service[{i}]");
        check_table(
            t,
            &base,
            SERVICE_KEYS,
            &["name", "protocol", "listen"],
            &mut out,
        );
        if let Some(h) = t.get("health").and_then(|i| i.as_table_like()) {
            check_table(h, &format!("{base}.health"), HEALTH_KEYS, &[], &mut out);
        }
        for (j, b) in tables(t.get("backend")).into_iter().enumerate() {
            check_table(
                b,
                &format!("{base}.backend[{j}]"),
                BACKEND_KEYS,
                &["address"],
                &mut out,
            );
        }
    }
    out
}

fn tables(item: Option<&toml_edit::Item>) -> Vec<&dyn toml_edit::TableLike> {
    match item {
        Some(toml_edit::Item::ArrayOfTables(a)) => {
            a.iter().map(|t| t as &dyn toml_edit::TableLike).collect()
        }
        Some(toml_edit::Item::Value(toml_edit::Value::Array(a))) => a
            .iter()
            .filter_map(|v| v.as_inline_table())
            .map(|t| t as &dyn toml_edit::TableLike)
            .collect(),
        _ => Vec::new(),
    }
}

fn check_table(
    t: &dyn toml_edit::TableLike,
    base: &str,
    known: &[(&str, Kind)],
    required: &[&str],
    out: &mut Vec<ShapeProblem>,
) {
    let path = |k: &str| {
        if base.is_empty() {
            k.to_owned()
        } else {
            format!("{base}.{k}")
        }
    };
    let table_offset = t
        .iter()
        .next()
        .and_then(|(k, _)| t.get_key_value(k))
        .and_then(|(k, _)| k.span())
        .map(|s| s.start);
    for (key, item) in t.iter() {
        let offset = t
            .get_key_value(key)
            .and_then(|(k, i)| k.span().or_else(|| i.span()))
            .map(|s| s.start);
        let Some((_, kind)) = known.iter().find(|(k, _)| *k == key) else {
            let names: Vec<&str> = known.iter().map(|(k, _)| *k).collect();
            out.push((
                path(key),
                offset,
                format!("unknown key; known keys here: {}", names.join(", ")),
                None,
            ));
            continue;
        };
        let v = item.as_value();
        // Typed strings: the right type but a value the type refuses.
        let typed = match (kind, v.and_then(|v| v.as_str())) {
            (Kind::Sched, Some(text)) => Some((parse_scheduler(text).err(), "\"wlc\"".to_owned())),
            (Kind::ProxyVersion, Some(text)) => Some((
                crate::proxy_protocol::Version::from_config(text).err(),
                "\"v2\"".to_owned(),
            )),
            (Kind::Dur(b), Some(text)) => {
                let hint = if *b == STATE_TIMEOUT_BOUNDS {
                    ", or remove the key for the IPVS default"
                } else {
                    ""
                };
                let problem = parse_duration_in(text, *b).err().map(|e| {
                    if e.contains(" is outside ") {
                        format!("{e}{hint}")
                    } else {
                        e
                    }
                });
                Some((problem, format!("{:?}", b.example)))
            }
            (Kind::Forward, Some(text)) => {
                Some((text.parse::<Forward>().err(), "\"proxy\"".to_owned()))
            }
            (Kind::PacketIo, Some(text)) => Some((
                PacketIo::ALL
                    .into_iter()
                    .all(|io| io.as_str() != text)
                    .then(|| format!("unknown io {text:?}; use one of auto xdp afpacket")),
                "\"auto\"".to_owned(),
            )),
            (Kind::Steering, Some(text)) => Some((
                AcceptSteering::ALL
                    .into_iter()
                    .all(|m| m.as_str() != text)
                    .then(|| {
                        format!("unknown accept_steering {text:?}; use one of spread adaptive")
                    }),
                "\"spread\"".to_owned(),
            )),
            (Kind::Ports, Some(text)) => Some((
                text.parse::<PortRange>().err(),
                "\"40000-59999\"".to_owned(),
            )),
            _ => None,
        };
        if let Some((problem, stand_in)) = typed {
            if let Some(message) = problem {
                let span = v.and_then(|v| v.span());
                out.push((path(key), offset, message, span.map(|s| (s, stand_in))));
            }
            continue;
        }
        let ok = match kind {
            Kind::Int => v.is_some_and(|v| v.as_integer().is_some_and(|i| i >= 0)),
            Kind::U32 => {
                v.is_some_and(|v| v.as_integer().is_some_and(|i| u32::try_from(i).is_ok()))
            }
            Kind::SignedInt => {
                v.is_some_and(|v| v.as_integer().is_some_and(|i| i32::try_from(i).is_ok()))
            }
            Kind::Str => v.is_some_and(|v| v.is_str()),
            Kind::Bool => v.is_some_and(|v| v.is_bool()),
            Kind::Addr => v
                .and_then(|v| v.as_str())
                .is_some_and(|s| s.parse::<SocketAddr>().is_ok()),
            Kind::Proto => v
                .and_then(|v| v.as_str())
                .is_some_and(|s| s == "tcp" || s == "udp"),
            Kind::Table => item.is_table_like(),
            // `backend = []` (an empty list, as a config with no backends
            // serialises) is an array of no tables.
            Kind::Tables => {
                !tables(Some(item)).is_empty()
                    || item.is_array_of_tables()
                    || item.as_array().is_some_and(|a| a.is_empty())
            }
            Kind::Strs => v
                .and_then(|v| v.as_array())
                .is_some_and(|a| a.iter().all(|x| x.is_str())),
            Kind::Ips => v.and_then(|v| v.as_array()).is_some_and(|a| {
                a.iter()
                    .all(|x| x.as_str().is_some_and(|s| s.parse::<IpAddr>().is_ok()))
            }),
            Kind::Sched
            | Kind::ProxyVersion
            | Kind::Dur(_)
            | Kind::Forward
            | Kind::PacketIo
            | Kind::Steering
            | Kind::Ports => v.is_some_and(|v| v.is_str()),
        };
        if !ok {
            let want = match kind {
                Kind::Int => "a non-negative integer, e.g. 4",
                Kind::U32 => "an integer in 0..=4294967295, e.g. 4",
                Kind::SignedInt => "an integer in -2147483648..=2147483647, e.g. -5",
                Kind::Str => "a string in quotes",
                Kind::Bool => "true or false",
                Kind::Addr => "\"IP:PORT\", e.g. \"127.0.0.1:8080\" or \"[::1]:8080\"",
                Kind::Proto => "\"tcp\" or \"udp\"",
                Kind::Table => "a table, e.g. [section]",
                Kind::Tables => "an array of tables, e.g. [[section]]",
                Kind::Strs => "an array of strings, e.g. [\"10.0.0.0/24:80\"]",
                Kind::Sched => "a scheduler name in quotes, e.g. \"wlc\"",
                Kind::ProxyVersion => "\"v1\" or \"v2\"",
                Kind::Dur(_) => "a duration in quotes, e.g. \"2s\"",
                Kind::Forward => "\"proxy\", \"nat\", \"fnat\" or \"dr\"",
                Kind::PacketIo => "\"auto\", \"xdp\" or \"afpacket\"",
                Kind::Steering => "\"spread\" or \"adaptive\"",
                Kind::Ports => "a port range in quotes, e.g. \"40000-59999\"",
                Kind::Ips => "an array of IP addresses, e.g. [\"10.0.1.1\", \"2001:db8::1\"]",
            };
            out.push((path(key), offset, format!("expected {want}"), None));
        }
    }
    for r in required {
        if !t.contains_key(r) {
            out.push((
                path(r),
                table_offset,
                "required key is missing; see examples/weir.toml".into(),
                None,
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The errors `text` gives as file `f.toml`, each as `weir check`
    /// prints it (`f.toml:LINE: KEY: MESSAGE`).
    fn error_lines(text: &str) -> Vec<String> {
        parse(text, "f.toml")
            .expect_err(text)
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    /// "." and ".." are not names: the admin API's URLs cannot name them
    /// (a tenant or service called ".." was reachable by no request).
    #[test]
    fn dot_and_dot_dot_are_not_names() {
        for bad in [".", ".."] {
            assert!(check_name(bad).is_err(), "{bad}");
            let text = format!("[[tenant]]\nname = \"{bad}\"\n");
            let errs = parse(&text, "f.toml").expect_err(bad);
            assert!(
                errs.iter()
                    .any(|e| e.to_string().contains("tenant[0].name")),
                "{errs:?}"
            );
        }
        for good in ["a.b", "...", ".a", "a-b_c.0"] {
            assert_eq!(check_name(good), Ok(()), "{good}");
        }
    }

    /// Found by `cargo fuzz run config` (CI, session 14): toml_edit 0.23's
    /// parser panicked ("all items have spans") on this text, so `weir
    /// check`, `weir run` and a reload of such a file panicked instead of
    /// reporting a syntax error. Fixed by toml_edit 0.25; kept as a seed in
    /// `fuzz/seeds/config/` too.
    #[test]
    fn malformed_inline_table_then_dotted_key_is_an_error_not_a_panic() {
        let text = "listen={=k[]e=\"\nlisten.";
        let errors = parse(text, "t.toml").expect_err("not a valid config");
        assert!(!errors.is_empty());
        assert!(errors.iter().all(|e| e.file == "t.toml"), "{errors:?}");
    }

    /// Every field of the config structs must be known to the shape
    /// pre-pass: serialise a config with every option set and parse it back.
    #[test]
    fn shape_prepass_knows_every_field() {
        let svc = ServiceSpec {
            tenant: "t".into(),
            name: "s".into(),
            protocol: Protocol::Udp,
            listen: "127.0.0.1:53".parse().unwrap(),
            forward: Forward::Proxy,
            scheduler: weir_sched::SchedulerKind::Mh,
            persistence: "10s".parse().unwrap(),
            persistence_netmask: Some("255.255.255.0".into()),
            options: ServiceOptions {
                connect_timeout: Some("1s".parse().unwrap()),
                expire_nodest_conn: true,
                mh_fallback: true,
                mh_port: true,
                mh_table_size: Some(251),
                hash_seed: None,
                udp_responses: Some(1),
                udp_timeout: Some("5s".parse().unwrap()),
                udp_max_sessions_per_client: 3,
                health: Some(HealthSpec {
                    protocol: Some(Protocol::Udp),
                    port: Some(1054),
                    send: Some("ping".into()),
                    ..HealthSpec::default()
                }),
                ..ServiceOptions::default()
            },
            backends: vec![BackendSpec {
                address: "127.0.0.1:1053".parse().unwrap(),
                weight: 2,
                proxy_protocol: None,
                max_connections: 9,
            }],
        };
        // The TCP- and sh-only options, on a second service.
        let sh_svc = ServiceSpec {
            name: "s2".into(),
            protocol: Protocol::Tcp,
            listen: "127.0.0.1:80".parse().unwrap(),
            scheduler: weir_sched::SchedulerKind::Sh,
            persistence_netmask: None,
            options: ServiceOptions {
                sh_fallback: true,
                sh_port: true,
                tcp_max_connections_per_client: 4,
                client_prefix6: Some(56),
                ..ServiceOptions::default()
            },
            ..svc.clone()
        };
        // The packet-only keys, on a third service.
        let nat_svc = ServiceSpec {
            name: "s3".into(),
            protocol: Protocol::Tcp,
            listen: "10.0.0.100:80".parse().unwrap(),
            forward: Forward::Fnat,
            scheduler: weir_sched::SchedulerKind::Wlc,
            persistence_netmask: None,
            options: ServiceOptions {
                sloppy_tcp: true,
                ..ServiceOptions::default()
            },
            backends: vec![BackendSpec {
                address: "10.0.1.2:8080".parse().unwrap(),
                weight: 1,
                proxy_protocol: None,
                max_connections: 0,
            }],
            ..svc.clone()
        };
        let cfg = Config {
            packet: Some(PacketConfig {
                // `lo` exists in every network namespace.
                interfaces: vec!["lo".into()],
                backend_interfaces: vec!["lo".into()],
                io: PacketIo::Afpacket,
                local_addresses: vec!["10.0.1.1".parse().unwrap(), "2001:db8::1".parse().unwrap()],
                fnat_ports: "1024-2047".parse().unwrap(),
                workers: 2,
                xdp_ring_size: 4096,
            }),
            daemon: DaemonConfig {
                max_shared_table_entries: 1 << 20,
                estimator_cpu: Some(0),
                estimator_nice: Some(-3),
                ..DaemonConfig::default()
            },
            admin: AdminConfig {
                token: Some("x".into()),
                readonly_token: Some("y".into()),
                ..AdminConfig::default()
            },
            tenants: vec![TenantSpec {
                name: "t".into(),
                table_entries: 1024,
                max_table_entries: 8192,
                max_connections: 1,
                max_new_per_s: 1,
                max_services: 0,
                max_backends: 0,
                min_health_interval: Some("250ms".parse().unwrap()),
                token: Some("z".into()),
                timeouts: TimeoutsSpec {
                    established: Some("1h".parse().unwrap()),
                    syn_sent: Some("1s".parse().unwrap()),
                    syn_recv: Some("2s".parse().unwrap()),
                    fin_wait: Some("3s".parse().unwrap()),
                    close_wait: Some("4s".parse().unwrap()),
                    last_ack: Some("5s".parse().unwrap()),
                    time_wait: Some("6s".parse().unwrap()),
                    close: Some("7s".parse().unwrap()),
                    udp: Some("8s".parse().unwrap()),
                    persist: Some("9s".parse().unwrap()),
                },
                allowed_listen: vec!["10.0.0.0/24:8000-8100".into(), "[::]:443".into()],
                allowed_backends: vec!["10.1.0.0/16".into()],
            }],
            services: vec![svc, sh_svc, nat_svc],
        };
        let text = toml::to_string(&cfg).unwrap();
        let parsed = parse(&text, "x.toml").unwrap_or_else(|e| panic!("{e:?}\n{text}"));
        assert_eq!(parsed, cfg);
    }

    /// `accept_steering` takes its two names; anything else is an error
    /// at its line, with both names in it; absent, the kernel's spread.
    #[test]
    fn accept_steering_is_one_of_its_names() {
        assert_eq!(
            parse("", "f.toml").unwrap().daemon.accept_steering,
            AcceptSteering::Spread
        );
        for m in AcceptSteering::ALL {
            let text = format!("[daemon]\naccept_steering = \"{}\"\n", m.as_str());
            assert_eq!(parse(&text, "f.toml").unwrap().daemon.accept_steering, m);
        }
        for bad in ["\"packed\"", "1", "true"] {
            let text = format!("[daemon]\nworkers = 2\naccept_steering = {bad}\n");
            let got = error_lines(&text);
            assert!(
                got.len() == 1
                    && got[0].starts_with("f.toml:3: daemon.accept_steering: ")
                    && got[0].contains("spread")
                    && got[0].contains("adaptive"),
                "{bad}: {got:?}"
            );
        }
    }

    #[test]
    fn shape_errors_are_all_reported() {
        let text = "[daemon]\nworkers = \"two\"\nbogus = 1\n[[service]]\nname = \"a\"\nlisten = \"nowhere\"\n";
        let got = error_lines(text);
        assert!(
            got.iter()
                .any(|e| e.starts_with("f.toml:2: daemon.workers: expected")),
            "{got:?}"
        );
        assert!(
            got.iter()
                .any(|e| e.starts_with("f.toml:3: daemon.bogus: unknown key")),
            "{got:?}"
        );
        assert!(
            got.iter()
                .any(|e| e.starts_with("f.toml:6: service[0].listen: expected")),
            "{got:?}"
        );
        assert!(
            got.iter()
                .any(|e| e.contains("service[0].protocol: required")),
            "{got:?}"
        );
        assert_eq!(got.len(), 4, "{got:?}");
    }

    #[test]
    fn estimator_settings_are_validated_with_line_and_key() {
        let text = "[daemon]\nworkers = 1\nestimator_cpu = 5000\nestimator_nice = -21\n";
        let got = error_lines(text);
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(
            got[0].starts_with("f.toml:3: daemon.estimator_cpu: CPU 5000 is out of range"),
            "{got:?}"
        );
        assert!(
            got[1].starts_with("f.toml:4: daemon.estimator_nice: nice -21 is outside -20..=19"),
            "{got:?}"
        );
        let got = parse("[daemon]\nestimator_nice = \"high\"\n", "f.toml").unwrap_err();
        assert!(
            got[0]
                .to_string()
                .starts_with("f.toml:2: daemon.estimator_nice: expected an integer"),
            "{got:?}"
        );
        let ok = parse(
            "[daemon]\nestimator_cpu = 0\nestimator_nice = 19\n",
            "f.toml",
        )
        .unwrap();
        assert_eq!(
            (ok.daemon.estimator_cpu, ok.daemon.estimator_nice),
            (Some(0), Some(19))
        );
    }

    #[test]
    fn tenant_timeouts_resolve_and_report_bad_keys_with_line() {
        let text = "[[tenant]]\nname = \"a\"\n[tenant.timeouts]\nestablished = \"1h\"\nudp = \"30s\"\n\n[[tenant]]\nname = \"b\"\n[tenant.timeouts]\nfin_wait = \"soon\"\nclose = \"0s\"\n";
        let got = error_lines(text);
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(
            got[0]
                .starts_with("f.toml:10: tenant[1].timeouts.fin_wait: \"soon\" is not a duration"),
            "{got:?}"
        );
        assert!(
            got[1].starts_with(
                "f.toml:11: tenant[1].timeouts.close: \"0s\" is outside 1s..=30days; use e.g. \"900s\", or remove the key for the IPVS default"
            ),
            "{got:?}"
        );
        let got = parse(
            "[[tenant]]\nname = \"a\"\n[tenant.timeouts]\nestablishd = \"1s\"\n",
            "f.toml",
        )
        .unwrap_err();
        assert!(
            got[0]
                .to_string()
                .starts_with("f.toml:4: tenant[0].timeouts.establishd: unknown key"),
            "{got:?}"
        );
        let ok = parse(&text[..text.find("\n\n").unwrap()], "f.toml").unwrap();
        let t = ok.tenants[0].timeouts.resolve().unwrap();
        let d = weir_flowtable::Timeouts::default();
        assert_eq!(t.established.0, 3_600_000);
        assert_eq!(t.udp.0, 30_000);
        assert_eq!(
            (t.fin_wait, t.persist, t.syn_recv),
            (d.fin_wait, d.persist, d.syn_recv)
        );
        // Written back only when set, under [tenant.timeouts].
        let back = toml::to_string(&ok).unwrap();
        assert!(
            back.contains("[tenant.timeouts]\nestablished = \"1h\"\nudp = \"30s\"\n"),
            "{back}"
        );
        let plain = parse("[[tenant]]\nname = \"a\"\n", "f.toml").unwrap();
        assert!(!toml::to_string(&plain).unwrap().contains("timeouts"));
    }

    #[test]
    fn table_sizes_are_validated_with_line_and_key() {
        let text = "[daemon]\nshared_table_entries = 1024\nmax_shared_table_entries = 512\n\
                    [[tenant]]\nname = \"a\"\ntable_entries = 1024\nmax_table_entries = 3000\n\
                    [[tenant]]\nname = \"b\"\ntable_entries = 4096\nmax_table_entries = 2048\n\
                    [[tenant]]\nname = \"c\"\nmax_table_entries = 2048\n\
                    [[tenant]]\nname = \"d\"\ntable_entries = 1024\nmax_table_entries = 33554432\n";
        let got = error_lines(text);
        let want = [
            "f.toml:3: daemon.max_shared_table_entries: 512 is below shared_table_entries (1024)",
            "f.toml:7: tenant[0].max_table_entries: 3000 must be 0",
            "f.toml:11: tenant[1].max_table_entries: 2048 is below table_entries (4096)",
            "f.toml:14: tenant[2].max_table_entries: 2048 caps an own table, but table_entries = 0",
            "f.toml:18: tenant[3].max_table_entries: 33554432 must be 0",
        ];
        assert_eq!(got.len(), want.len(), "{got:?}");
        for (g, w) in got.iter().zip(want) {
            assert!(g.starts_with(w), "{g:?} does not start with {w:?}");
        }
        let got = error_lines("[daemon]\nmax_shared_table_entries = 3\n");
        assert!(
            got.len() == 1
                && got[0].starts_with("f.toml:2: daemon.max_shared_table_entries: 3 must be 0"),
            "{got:?}"
        );

        // The old key is still the shared table's starting size; both at
        // once is an error at the old one. `weir save` writes the new name.
        let old = parse("[daemon]\nshared_table_buckets = 4096\n", "f.toml").unwrap();
        assert_eq!(old.daemon.shared_table_entries, 4096);
        let back = toml::to_string(&old).unwrap();
        assert!(
            back.contains("shared_table_entries = 4096\n")
                && !back.contains("shared_table_buckets"),
            "{back}"
        );
        let got = error_lines("[daemon]\nshared_table_entries = 1\nshared_table_buckets = 2\n");
        assert!(
            got.len() == 1
                && got[0].starts_with("f.toml:3: daemon.shared_table_buckets: is the old name"),
            "{got:?}"
        );
        // A bad value under the old name is reported where the file has
        // it: under that name, with its line (it was named
        // daemon.shared_table_entries, a key the file does not have, and
        // so had no line).
        let got = error_lines("[daemon]\nworkers = 1\nshared_table_buckets = 1000\n");
        assert!(
            got.len() == 1
                && got[0].starts_with(
                    "f.toml:3: daemon.shared_table_buckets: 1000 is not a power of two"
                ),
            "{got:?}"
        );

        // Good values round-trip; a cap of 0 is not written for a tenant.
        let ok = parse(
            "[daemon]\nshared_table_entries = 1024\nmax_shared_table_entries = 1048576\n\
             [[tenant]]\nname = \"a\"\ntable_entries = 1024\nmax_table_entries = 8192\n\
             [[tenant]]\nname = \"b\"\ntable_entries = 1024\n",
            "f.toml",
        )
        .unwrap();
        assert_eq!(
            (
                ok.tenants[0].max_table_entries,
                ok.tenants[1].max_table_entries
            ),
            (8192, 0)
        );
        let back = toml::to_string(&ok).unwrap();
        assert_eq!(back.matches("max_table_entries").count(), 1, "{back}");
        assert_eq!(parse(&back, "back.toml").unwrap(), ok);
    }

    /// Schedulers and PROXY versions are types from the parse on: a value
    /// they refuse is reported at its line and key together with the rest
    /// of the file's problems (but none that only the stand-in caused), the
    /// admin API's JSON errors name the key, and the text written back is
    /// the text read.
    #[test]
    fn typed_values_report_with_the_rest_and_round_trip() {
        let text = "[[service]]\nname = \"a\"\nprotocol = \"udp\"\nlisten = \"127.0.0.1:1\"\n\
                    scheduler = \"Fastest\"\nmh_port = true\n\
                    [[service.backend]]\naddress = \"10.0.0.1:80\"\nweight = 70000\nproxy_protocol = \"v3\"\n";
        let got = error_lines(text);
        let want = [
            "f.toml:5: service[0].scheduler: unknown scheduler \"Fastest\"; use one of rr wrr",
            "f.toml:10: service[0].backend[0].proxy_protocol: \"v3\" is not a PROXY protocol version",
            "f.toml:9: service[0].backend[0].weight: 70000 is above 65535",
        ];
        assert_eq!(got.len(), want.len(), "{got:?}");
        for w in want {
            assert!(got.iter().any(|g| g.starts_with(w)), "{w:?} not in {got:?}");
        }
        // A scheduler that is not a string is a shape error like any other.
        let got = parse(&text.replace("\"Fastest\"", "3"), "f.toml").unwrap_err();
        assert!(
            got.iter().any(|e| e.to_string().starts_with(
                "f.toml:5: service[0].scheduler: expected a scheduler name in quotes"
            )),
            "{got:?}"
        );

        // The admin API's JSON errors start with the key path.
        let json = |body: &str| {
            let v: serde_json::Value = serde_json::from_str(body).unwrap();
            service_from_json(v).unwrap_err()
        };
        let e = json(r#"{"name":"a","protocol":"tcp","listen":"127.0.0.1:1","scheduler":"WLC"}"#);
        assert!(
            e.starts_with("scheduler: unknown scheduler \"WLC\"; use one of"),
            "{e}"
        );
        let e = json(
            r#"{"name":"a","protocol":"tcp","listen":"127.0.0.1:1","backend":[{"address":"10.0.0.1:80","proxy_protocol":"1"}]}"#,
        );
        assert!(
            e.starts_with("backend[0].proxy_protocol: \"1\" is not a PROXY protocol version"),
            "{e}"
        );
        let e = json(
            r#"{"name":"a","protocol":"tcp","listen":"127.0.0.1:1","health":{"interval":"soon"}}"#,
        );
        assert!(
            e.starts_with("health.interval: \"soon\" is not a duration"),
            "{e}"
        );

        let ok = text
            .replace("\"Fastest\"", "\"mh\"")
            .replace("udp", "tcp")
            .replace("70000", "7")
            .replace("\"v3\"", "\"v2\"");
        let c = parse(&ok, "f.toml").unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(c.services[0].scheduler, weir_sched::SchedulerKind::Mh);
        assert_eq!(
            c.services[0].backends[0].proxy_protocol,
            Some(crate::proxy_protocol::Version::V2)
        );
        let back = toml::to_string(&c).unwrap();
        assert!(
            back.contains("scheduler = \"mh\"\n") && back.contains("proxy_protocol = \"v2\"\n"),
            "{back}"
        );
        let j = serde_json::to_value(&c.services[0]).unwrap();
        assert_eq!(
            (
                j["scheduler"].as_str(),
                j["backend"][0]["proxy_protocol"].as_str()
            ),
            (Some("mh"), Some("v2"))
        );
    }

    #[test]
    fn fence_entries_parse_and_match() {
        let r = |s: &str| s.parse::<AddrRange>().unwrap_or_else(|e| panic!("{e}"));
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let net = r("10.0.0.77/24:8000-8100");
        assert!(net.contains(a("10.0.0.1:8000")) && net.contains(a("10.0.0.255:8100")));
        assert!(!net.contains(a("10.0.1.1:8000")) && !net.contains(a("10.0.0.1:8101")));
        assert!(!net.contains(a("[::1]:8000")), "family");
        let host = r("10.0.0.5");
        assert!(host.contains(a("10.0.0.5:1")) && !host.contains(a("10.0.0.6:1")));
        let any4 = r("0.0.0.0/0");
        assert!(any4.contains(a("192.0.2.1:80")));
        assert!(
            !any4.contains(a("0.0.0.0:80")),
            "a wildcard needs its own entry"
        );
        assert!(r("0.0.0.0:80").contains(a("0.0.0.0:80")));
        assert!(r("[::]:443").contains(a("[::]:443")));
        let v6 = r("[2001:db8::/32]:443");
        assert!(v6.contains(a("[2001:db8:1::9]:443")) && !v6.contains(a("[2001:db9::]:443")));
        assert!(r("2001:db8::/32").contains(a("[2001:db8::1]:1")));
        for bad in [
            "10.0.0.0/33",
            "10.0.0.0:70000",
            "10.0.0.0:90-80",
            "x",
            "[::1",
            "[::1]80",
            "",
        ] {
            assert!(bad.parse::<AddrRange>().is_err(), "{bad:?}");
        }
        assert!(fence_allows(&[], a("10.0.0.1:1"), true));
        assert!(!fence_allows(&[], a("0.0.0.0:1"), true));
        assert!(fence_allows(&[], a("0.0.0.0:1"), false));
        // An IPv4-mapped address is its IPv4 address.
        let any6 = r("::/0");
        assert!(
            !any6.contains(a("[::ffff:127.0.0.1]:22")),
            "v4-mapped is IPv4"
        );
        assert!(host.contains(a("[::ffff:10.0.0.5]:1")));
        assert!(
            !fence_allows(&[], a("[::ffff:0.0.0.0]:1"), true),
            "mapped wildcard"
        );
    }

    /// Port 0 asks the kernel for a port, which can be any: it is inside
    /// an entry of every port (one naming no port) and no other, even one
    /// whose range starts at 0. "10.0.0.0/8:0-1023" let a tenant token
    /// listen on 10.0.0.7:0, bound to an ephemeral port above 1023.
    #[test]
    fn port_0_is_inside_only_an_entry_of_every_port() {
        let r = |s: &str| s.parse::<AddrRange>().unwrap_or_else(|e| panic!("{e}"));
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(!r("10.0.0.0/8:0-1023").contains(a("10.0.0.7:0")));
        assert!(!r("10.0.0.7:0").contains(a("10.0.0.7:0")));
        assert!(r("10.0.0.0/8:0-1023").contains(a("10.0.0.7:1023")));
        assert!(r("10.0.0.0/8").contains(a("10.0.0.7:0")));
        assert!(r("10.0.0.0/8:0-65535").contains(a("10.0.0.7:0")));
        assert!(r("[::]:0-65535").contains(a("[::]:0")));
        assert!(!r("[::]:0-1023").contains(a("[::]:0")));
        assert!(fence_allows(&[], a("10.0.0.7:0"), true), "no fence");
        assert!(!fence_allows(
            &[r("10.0.0.0/8:0-1023")],
            a("10.0.0.7:0"),
            true
        ));
    }

    /// One backend written two ways, `10.0.1.2:80` and its IPv4-mapped
    /// `[::ffff:10.0.1.2]:80`, is listed twice: two backends (two ids, two
    /// weights, two places under `max_connections`) for one host and port.
    /// Before, both were taken.
    #[test]
    fn a_backend_and_its_v4_mapped_form_are_listed_twice() {
        let text = svc_text("127.0.0.1:81", "", &["10.0.1.2:80", "[::ffff:10.0.1.2]:80"]);
        let errs = parse(&text, "f.toml").unwrap_err();
        assert!(
            errs.iter()
                .any(|e| e.key == "service[0].backend[1].address"
                    && e.message.contains("listed twice")),
            "{errs:?}"
        );
        assert_eq!(errs.len(), 1, "{errs:?}");
        // Other backends of either family are not.
        let text = svc_text("127.0.0.1:81", "", &["10.0.1.2:80", "[::ffff:10.0.1.3]:80"]);
        parse(&text, "f.toml").unwrap();
    }

    /// An IPv4-mapped backend address is read as its IPv4 address, in a
    /// file as in a request's JSON, and written back that way: one
    /// backend, one spelling. So packet mode's family check sees it for
    /// what it is: behind an IPv6 VIP it is refused, where before it
    /// passed, and the packet path would have sent IPv6 packets to
    /// `::ffff:10.0.1.2`.
    #[test]
    fn a_v4_mapped_backend_address_is_read_as_ipv4() {
        let c = parse(
            &svc_text("127.0.0.1:81", "", &["[::ffff:10.0.1.2]:80"]),
            "f.toml",
        )
        .unwrap();
        let want: SocketAddr = "10.0.1.2:80".parse().unwrap();
        assert_eq!(c.services[0].backends[0].address, want);
        assert!(toml::to_string(&c).unwrap().contains("\"10.0.1.2:80\""));
        let b: BackendSpec =
            serde_json::from_str(r#"{"address": "[::ffff:10.0.1.2]:80"}"#).unwrap();
        assert_eq!(b.address, want);
        // An IPv6 backend stays one.
        let b: BackendSpec = serde_json::from_str(r#"{"address": "[2001:db8::6]:80"}"#).unwrap();
        assert!(b.address.is_ipv6());
        let errs = parse(
            &packet_file(
                "[packet]\ninterfaces = [\"lo\"]\n",
                &svc_text(
                    "[2001:db8::5]:80",
                    "forward = \"nat\"",
                    &["[::ffff:10.0.1.2]:80"],
                ),
            ),
            "p.toml",
        )
        .unwrap_err();
        assert!(
            errs.iter().any(|e| e.key == "service[0].backend[0].address"
                && e.message.contains("not of the VIP's family")),
            "{errs:?}"
        );
    }

    /// Found by the config fuzz target: a service with no backends is
    /// written back (`weir save`, `GET /v1/config`) as `backend = []`,
    /// which the shape check refused, so the saved file could not be loaded.
    #[test]
    fn a_service_without_backends_round_trips() {
        let text = "[[service]]\nname = \"web\"\nprotocol = \"tcp\"\nlisten = \"127.0.0.1:8081\"\n";
        let c = parse(text, "f.toml").unwrap();
        let written = toml::to_string(&c).unwrap();
        assert!(written.contains("backend = []"), "{written}");
        let again = parse(&written, "w.toml").unwrap_or_else(|e| panic!("{e:?}\n{written}"));
        assert_eq!(again, c);
        // A non-empty plain array is still not a list of backends.
        let bad = format!("{text}backend = [1]\n");
        assert!(parse(&bad, "f.toml").is_err());
    }

    /// Issue 10 #20: an integer too large for its field is reported under
    /// its key path and line, not under its value.
    #[test]
    fn oversized_integers_name_the_key() {
        // Too large for TOML itself: the parser fails, the key comes from the line.
        let got = parse(
            "[daemon]\naccess_log = true\nworkers = 99999999999999999999\n",
            "f.toml",
        )
        .unwrap_err();
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(
            (got[0].line, got[0].key.as_str()),
            (Some(3), "daemon.workers"),
            "{got:?}"
        );
        // Inside the second backend of the second service.
        let text = "[[service]]\nname = \"a\"\nprotocol = \"tcp\"\nlisten = \"127.0.0.1:1\"\n\
                    [[service]]\nname = \"b\"\nprotocol = \"tcp\"\nlisten = \"127.0.0.1:2\"\n\
                    [[service.backend]]\naddress = \"127.0.0.1:3\"\n\
                    [[service.backend]]\naddress = \"127.0.0.1:4\"\nweight = 99999999999999999999\n";
        let got = parse(text, "f.toml").unwrap_err();
        assert_eq!(
            (got[0].line, got[0].key.as_str()),
            (Some(13), "service[1].backend[1].weight"),
            "{got:?}"
        );
        // Fits TOML's i64 but not the u32 field: caught by the shape pass.
        let text = text.replace("99999999999999999999", "4294967296");
        let got = error_lines(&text);
        assert_eq!(
            got,
            [
                "f.toml:13: service[1].backend[1].weight: expected an integer in 0..=4294967295, e.g. 4"
            ],
        );
        let got = parse("[daemon]\nestimator_nice = 2147483648\n", "f.toml").unwrap_err();
        assert!(
            got[0]
                .to_string()
                .starts_with("f.toml:2: daemon.estimator_nice: expected an integer in"),
            "{got:?}"
        );
        let got = parse("[daemon]\nnotsent_lowat = 4294967296\n", "f.toml").unwrap_err();
        assert!(
            got[0].to_string().starts_with(
                "f.toml:2: daemon.notsent_lowat: expected an integer in 0..=4294967295"
            ),
            "{got:?}"
        );
    }

    /// ipvsadm's scheduler flags and the TCP per-client cap: accepted where
    /// they apply, each misuse refused with its key and what to do.
    #[test]
    fn scheduler_flags_are_checked() {
        let svc = |proto: &str, sched: &str, extra: &str| {
            format!(
                "[[service]]\nname = \"a\"\nprotocol = \"{proto}\"\nlisten = \"127.0.0.1:1\"\n\
                 scheduler = \"{sched}\"\n{extra}"
            )
        };
        for ok in [
            svc("tcp", "sh", "sh_fallback = true\nsh_port = true\n"),
            svc(
                "tcp",
                "mh",
                "mh_fallback = true\nmh_port = true\nmh_table_size = 65521\n",
            ),
            svc("tcp", "lblcr", "tcp_max_connections_per_client = 10\n"),
            svc("udp", "ovf", ""),
        ] {
            let c = parse(&ok, "f.toml").unwrap_or_else(|e| panic!("{ok}: {e:?}"));
            // `weir save` writes what it read: the keys survive a round trip.
            let back = toml::to_string(&c).expect("serialise");
            assert_eq!(parse(&back, "f.toml").expect("reparse"), c, "{back}");
        }
        let cases = [
            (
                svc("tcp", "mh", "sh_port = true\n"),
                "service[0].sh_port",
                "scheduler = \"sh\"",
            ),
            (
                svc("tcp", "sh", "mh_port = true\n"),
                "service[0].mh_port",
                "scheduler = \"mh\"",
            ),
            (
                svc("tcp", "wlc", "sh_fallback = true\n"),
                "service[0].sh_fallback",
                "\"sh\"",
            ),
            (
                svc("tcp", "sh", "mh_table_size = 4093\n"),
                "service[0].mh_table_size",
                "\"mh\"",
            ),
            (
                svc("tcp", "mh", "mh_table_size = 65537\n"),
                "service[0].mh_table_size",
                "4093, 8191",
            ),
            (
                svc("tcp", "mh", "mh_table_size = -1\n"),
                "service[0].mh_table_size",
                "expected",
            ),
            (
                svc("udp", "rr", "tcp_max_connections_per_client = 1\n"),
                "service[0].tcp_max_connections_per_client",
                "udp_max_sessions_per_client",
            ),
            (
                svc("tcp", "rr", "client_prefix6 = 0\n"),
                "service[0].client_prefix6",
                "1..=128",
            ),
            (
                svc("udp", "rr", "client_prefix6 = 129\n"),
                "service[0].client_prefix6",
                "1..=128",
            ),
            (
                svc("tcp", "lblx", ""),
                "service[0].scheduler",
                "lblc lblcr dh fo ovf",
            ),
        ];
        for (text, key, hint) in cases {
            let got = error_lines(&text);
            assert!(
                got.len() == 1 && got[0].contains(key) && got[0].contains(hint),
                "{text}: {got:?}"
            );
        }
    }

    /// Issue 10 #5: every duration key has bounds; a duration that would
    /// overflow a clock (`drain_timeout = "500000000000y"` panicked on
    /// SIGTERM) is refused with the range, and the edges are accepted.
    #[test]
    fn durations_are_bounded() {
        let huge = "500000000000y";
        let svc = |extra: &str| {
            format!(
                "[[service]]\nname = \"a\"\nprotocol = \"udp\"\nlisten = \"127.0.0.1:1\"\n{extra}"
            )
        };
        let cases = [
            (
                format!("[daemon]\ndrain_timeout = \"{huge}\"\n"),
                "daemon.drain_timeout",
                "0s..=1day",
            ),
            (
                svc(&format!("persistence = \"{huge}\"\n")),
                "service[0].persistence",
                "0s..=30days",
            ),
            (
                svc("persistence = \"31days\"\n"),
                "service[0].persistence",
                "0s..=30days",
            ),
            (
                svc(&format!("connect_timeout = \"{huge}\"\n")),
                "service[0].connect_timeout",
                "1ms..=1h",
            ),
            (
                svc("connect_timeout = \"0s\"\n"),
                "service[0].connect_timeout",
                "1ms..=1h",
            ),
            (
                svc(&format!("udp_timeout = \"{huge}\"\n")),
                "service[0].udp_timeout",
                "1ms..=30days",
            ),
            (
                svc("udp_timeout = \"0s\"\n"),
                "service[0].udp_timeout",
                "1ms..=30days",
            ),
            (
                svc(&format!("[service.health]\ninterval = \"{huge}\"\n")),
                "service[0].health.interval",
                "1ms..=1h",
            ),
            (
                svc("[service.health]\ninterval = \"0s\"\n"),
                "service[0].health.interval",
                "1ms..=1h",
            ),
            (
                svc("[service.health]\ninterval = \"2h\"\ntimeout = \"2h\"\n"),
                "service[0].health.interval",
                "1ms..=1h",
            ),
        ];
        for (text, key, range) in &cases {
            let got = parse(text, "f.toml").unwrap_err();
            let hit = got
                .iter()
                .find(|e| e.key == *key)
                .unwrap_or_else(|| panic!("{key}: {got:?}"));
            assert!(
                hit.line.is_some()
                    && hit
                        .message
                        .contains(&format!("is outside {range}; use e.g.")),
                "{key}: {hit}"
            );
        }
        let ok = "[daemon]\ndrain_timeout = \"1day\"\n[[service]]\nname = \"a\"\nprotocol = \"udp\"\n\
                  listen = \"127.0.0.1:1\"\npersistence = \"30days\"\nconnect_timeout = \"1h\"\n\
                  udp_timeout = \"30days\"\n[service.health]\ninterval = \"1h\"\ntimeout = \"1h\"\n\
                  protocol = \"udp\"\nsend = \"ping\"\n";
        parse(ok, "f.toml").unwrap_or_else(|e| panic!("{e:?}"));
        parse("[daemon]\ndrain_timeout = \"0s\"\n", "f.toml").unwrap();
        // The API path (a JSON body) parses the same types, same bounds.
        let mut spec =
            serde_json::to_value(parse(ok, "f.toml").unwrap().services.remove(0)).unwrap();
        spec["persistence"] = huge.into();
        let e = serde_json::from_value::<ServiceSpec>(spec)
            .unwrap_err()
            .to_string();
        assert!(e.contains("is outside 0s..=30days; use e.g."), "{e}");
        assert!(huge.parse::<Dur<Persistence>>().is_err());
    }

    /// `[[tenant]] min_health_interval`: a duration with the health
    /// interval's bounds, named by its key path when it does not parse or
    /// is out of bounds; absent, the tenant's floor is 1s.
    #[test]
    fn min_health_interval_is_a_bounded_duration() {
        let tenant = |extra: &str| format!("[[tenant]]\nname = \"acme\"\n{extra}");
        let c = parse(&tenant(""), "f.toml").unwrap();
        assert_eq!(c.tenants[0].min_health_interval, None);
        assert_eq!(
            c.tenants[0].health_interval_floor(),
            std::time::Duration::from_secs(1)
        );
        let c = parse(&tenant("min_health_interval = \"250ms\"\n"), "f.toml").unwrap();
        assert_eq!(
            c.tenants[0].health_interval_floor(),
            std::time::Duration::from_millis(250)
        );
        // It serialises as written.
        assert!(
            toml::to_string(&c)
                .unwrap()
                .contains("min_health_interval = \"250ms\""),
        );
        // The edges of the health interval's bounds are accepted.
        for edge in ["1ms", "1h"] {
            parse(
                &tenant(&format!("min_health_interval = \"{edge}\"\n")),
                "f.toml",
            )
            .unwrap_or_else(|e| panic!("{edge}: {e:?}"));
        }
        for (value, hint) in [
            ("\"soon\"", "is not a duration"),
            ("\"0s\"", "is outside 1ms..=1h; use e.g."),
            ("\"2h\"", "is outside 1ms..=1h; use e.g."),
            ("5", "expected"),
        ] {
            let got = parse(
                &tenant(&format!("min_health_interval = {value}\n")),
                "f.toml",
            )
            .unwrap_err();
            assert!(
                got.len() == 1
                    && got[0].key == "tenant[0].min_health_interval"
                    && got[0].line == Some(3)
                    && got[0].message.contains(hint),
                "{value}: {got:?}"
            );
        }
        // The admin API's tenant body parses the same type, same bounds.
        let e = from_json::<TenantSpec>(
            serde_json::json!({ "name": "acme", "min_health_interval": "0s" }),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("min_health_interval: ") && e.contains("is outside 1ms..=1h"),
            "{e}"
        );
    }

    /// Issue 10 #11: reporting every error of a large file took time
    /// quadratic in its size (each error's line was counted from the top).
    /// Compare n and 4n services in the same run: linear work takes ~4x,
    /// quadratic ~16x; the bound leaves room for a noisy machine.
    #[test]
    fn validation_time_is_linear_in_the_file() {
        fn file(services: usize, bad: bool) -> String {
            let mut s = String::with_capacity(services * 160);
            for i in 0..services {
                // Every other service has an unknown scheduler, and a shape
                // error (unknown key) too when `bad`.
                let sched = if i % 2 == 0 { "wlc" } else { "nope" };
                let extra = if bad && i % 2 == 1 { "bogus = 1\n" } else { "" };
                s.push_str(&format!(
                    "[[service]]\nname = \"s{i}\"\nprotocol = \"tcp\"\nlisten = \"127.0.{}.{}:80\"\n\
                     scheduler = \"{sched}\"\n{extra}[[service.backend]]\naddress = \"10.0.0.1:80\"\n",
                    i / 250,
                    i % 250 + 1
                ));
            }
            s
        }
        let time = |n: usize, bad: bool| {
            let text = file(n, bad);
            // Best of three against scheduling noise on a shared machine.
            (0..3)
                .map(|_| {
                    let t = std::time::Instant::now();
                    let errs = parse(&text, "big.toml").unwrap_err();
                    // A bad service's unknown scheduler (a typed value)
                    // is reported with its unknown key.
                    assert_eq!(errs.len(), if bad { n } else { n / 2 });
                    // The last error is two lines above the end, and says so.
                    assert_eq!(errs.last().unwrap().line, Some(text.lines().count() - 2));
                    t.elapsed()
                })
                .min()
                .unwrap()
        };
        for bad in [false, true] {
            // Up to three attempts: other tests run in parallel on a shared
            // 2-core machine and can stretch one measurement; a quadratic
            // validator (~16x) fails every attempt.
            let mut seen = Vec::new();
            let linear = (0..3).any(|_| {
                let (small, large) = (time(2_000, bad), time(8_000, bad));
                let ratio = large.as_secs_f64() / small.as_secs_f64().max(1e-6);
                seen.push(format!("{ratio:.1}x ({small:?} -> {large:?})"));
                ratio < 8.0
            });
            assert!(
                linear,
                "4x the services took {} the time (shape errors: {bad})",
                seen.join(", ")
            );
        }
    }

    /// A file with `[packet]` and a service of each kind.
    fn packet_file(packet: &str, services: &str) -> String {
        format!("{packet}\n{services}")
    }

    fn svc_text(listen: &str, extra: &str, backends: &[&str]) -> String {
        // Named after the address, so every service in a test is unique.
        let name: String = listen
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let mut t = format!(
            "[[service]]\nname = \"s{name}\"\nprotocol = \"tcp\"\nlisten = \"{listen}\"\n{extra}\n"
        );
        for b in backends {
            t.push_str(&format!("[[service.backend]]\naddress = \"{b}\"\n"));
        }
        t
    }

    #[test]
    fn packet_config_as_the_issue_writes_it_parses_and_round_trips() {
        // Issue 12's example, with `lo` for its interfaces (they must exist).
        let text = r#"
[packet]
interfaces = ["lo"]
io = "auto"
local_addresses = ["10.0.1.1"]

[[service]]
tenant = "default"
name = "web"
protocol = "tcp"
listen = "10.0.0.100:80"
forward = "nat"
scheduler = "wlc"
  [[service.backend]]
  address = "10.0.1.2:80"
"#;
        let c = parse(text, "p.toml").unwrap_or_else(|e| panic!("{e:?}"));
        let p = c.packet.as_ref().expect("[packet]");
        assert_eq!(p.interfaces, ["lo"]);
        assert_eq!(p.io, PacketIo::Auto);
        assert_eq!(p.local_addresses, ["10.0.1.1".parse::<IpAddr>().unwrap()]);
        assert_eq!(
            p.fnat_ports,
            PortRange {
                lo: 40_000,
                hi: 59_999
            }
        );
        assert_eq!(p.workers, 0);
        assert_eq!(c.services[0].forward, Forward::Nat);
        assert!(c.services[0].forward.is_packet());
        assert!(!c.services[0].options.sloppy_tcp);
        let back = toml::to_string(&c).unwrap();
        assert_eq!(parse(&back, "back.toml").unwrap(), c, "{back}");
        // A proxy service does not get `forward` written out.
        let proxy = parse(&svc_text("127.0.0.1:80", "forward = \"proxy\"", &[]), "x").unwrap();
        assert_eq!(proxy.services[0].forward, Forward::Proxy);
        assert!(!toml::to_string(&proxy).unwrap().contains("forward"));
        assert!(proxy.packet.is_none());
    }

    #[test]
    fn forward_and_port_range_text_both_ways() {
        for f in Forward::ALL {
            assert_eq!(f.as_str().parse::<Forward>(), Ok(f));
            assert_eq!(f.is_packet(), f != Forward::Proxy);
        }
        assert!(
            "masq"
                .parse::<Forward>()
                .unwrap_err()
                .contains("proxy nat fnat dr")
        );
        let r: PortRange = " 1-65535 ".parse().unwrap();
        assert_eq!((r.lo, r.hi, r.count()), (1, 65535, 65535));
        assert_eq!(r.to_string(), "1-65535");
        assert_eq!("7-7".parse::<PortRange>().unwrap().count(), 1);
        for bad in ["", "5", "0-10", "10-5", "1-65536", "a-b", "1-2-3"] {
            let e = bad.parse::<PortRange>().unwrap_err();
            assert!(e.contains("40000-59999"), "{bad:?}: {e}");
        }
    }

    /// `xdp_ring_size`: 2048 when absent (and then not written by `save`),
    /// any power of two from 64 to 32768, nothing else.
    #[test]
    fn xdp_ring_size_defaults_bounds_and_round_trip() {
        let file =
            |extra: &str| packet_file(&format!("[packet]\ninterfaces = [\"lo\"]\n{extra}"), "");
        let cfg = parse(&file(""), "p.toml").unwrap();
        let p = cfg.packet.as_ref().unwrap();
        assert_eq!(p.xdp_ring_size, DEFAULT_XDP_RING_SIZE);
        assert!(!toml::to_string(&cfg).unwrap().contains("xdp_ring_size"));
        for ok in [64, 4096, 32768] {
            let cfg = parse(&file(&format!("xdp_ring_size = {ok}\n")), "p.toml").unwrap();
            assert_eq!(cfg.packet.as_ref().unwrap().xdp_ring_size, ok);
            let again: Config = toml::from_str(&toml::to_string(&cfg).unwrap()).unwrap();
            assert_eq!(again.packet, cfg.packet, "{ok} survives a save");
        }
        for bad in [0, 32, 100, 65536] {
            let errs = parse(&file(&format!("xdp_ring_size = {bad}\n")), "p.toml").unwrap_err();
            assert!(
                errs.iter()
                    .any(|e| e.key == "packet.xdp_ring_size" && e.line.is_some()),
                "{bad}: {errs:?}"
            );
        }
    }

    /// Every packet-mode rule at once, each at its key, with what to do.
    #[test]
    fn packet_rules_are_all_reported_with_their_keys() {
        let text = packet_file(
            "[packet]\ninterfaces = [\"lo\", \"weir-no-such0\", \"lo\", \"bad/name\"]\n\
             backend_interfaces = [\"lo\", \"eth9\", \"lo\"]\n\
             local_addresses = [\"10.0.1.1\", \"0.0.0.0\", \"10.0.1.1\"]\nworkers = 2000\n\
             xdp_ring_size = 3000\n",
            &[
                // 0: dr to another port.
                svc_text("10.0.0.1:80", "forward = \"dr\"", &["10.0.1.2:8080"]),
                // 1: a VIP with port 0.
                svc_text("10.0.0.2:0", "forward = \"nat\"", &["10.0.1.2:80"]),
                // 2: a wildcard VIP.
                svc_text("0.0.0.0:80", "forward = \"nat\"", &["10.0.1.2:80"]),
                // 3: proxy options on a packet service.
                svc_text(
                    "10.0.0.3:80",
                    "forward = \"nat\"\nconnect_timeout = \"1s\"",
                    &["10.0.1.2:80"],
                ),
                // 4: sloppy_tcp on the proxy.
                svc_text("127.0.0.1:81", "sloppy_tcp = true", &["10.0.1.2:80"]),
                // 5: fnat to IPv6 with only IPv4 local addresses.
                svc_text(
                    "[2001:db8::5]:80",
                    "forward = \"fnat\"",
                    &["[2001:db8::6]:80"],
                ),
                // 6: nat across families.
                svc_text("10.0.0.7:80", "forward = \"nat\"", &["[2001:db8::6]:80"]),
                // 7: a VIP on a local address inside fnat_ports.
                svc_text("10.0.1.1:45000", "forward = \"nat\"", &["10.0.1.2:80"]),
            ]
            .concat(),
        );
        let mut text = text;
        // 8: a PROXY header on a packet service.
        text.push_str(
            "[[service]]\nname = \"pp\"\nprotocol = \"tcp\"\nlisten = \"10.0.0.9:80\"\n\
             forward = \"dr\"\n[[service.backend]]\naddress = \"10.0.1.9:80\"\nproxy_protocol = \"v2\"\n",
        );
        let errs = parse(&text, "p.toml").unwrap_err();
        let has = |key: &str, words: &str| {
            assert!(
                errs.iter()
                    .any(|e| e.key == key && e.message.contains(words) && e.line.is_some()),
                "no {key}: ...{words}... in\n{}",
                errs.iter().map(|e| format!("{e}\n")).collect::<String>()
            )
        };
        has("packet.interfaces[1]", "per network namespace");
        has("packet.interfaces[2]", "listed twice");
        has("packet.interfaces[3]", "not an interface name");
        has("packet.backend_interfaces[1]", "not one of interfaces");
        has("packet.backend_interfaces[2]", "listed twice");
        has("packet.local_addresses[1]", "cannot be a source address");
        has("packet.local_addresses[2]", "listed twice");
        has("packet.workers", "1024");
        has(
            "packet.xdp_ring_size",
            "not a power of two from 64 to 32768",
        );
        has("service[0].backend[0].address", "VIP's port 80");
        has("service[1].listen", "not a virtual address");
        has("service[2].listen", "not a virtual address");
        has("service[3].connect_timeout", "proxy option");
        has("service[4].sloppy_tcp", "only applies to packet services");
        has(
            "service[5].backend[0].address",
            "IPv6 address in [packet] local_addresses",
        );
        has(
            "service[6].backend[0].address",
            "does not translate between IPv4 and IPv6",
        );
        has("service[7].listen", "fnat_ports");
        has("service[8].backend[0].proxy_protocol", "PROXY header");
        assert_eq!(errs.len(), 18, "{errs:#?}");
        // The existing interface is fine.
        assert!(!errs.iter().any(|e| e.key == "packet.interfaces[0]"));
    }

    #[test]
    fn packet_services_need_a_packet_section_and_fnat_its_addresses() {
        let nat = svc_text("10.0.0.1:80", "forward = \"nat\"", &["10.0.1.2:80"]);
        let errs = parse(&nat, "p.toml").unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].key, "service[0].forward");
        assert!(
            errs[0].message.contains("add a [packet] section"),
            "{}",
            errs[0]
        );
        assert_eq!(errs[0].line, Some(5));

        let fnat = svc_text("10.0.0.1:80", "forward = \"fnat\"", &["10.0.1.2:80"]);
        let errs = parse(&packet_file("[packet]\ninterfaces = [\"lo\"]", &fnat), "p").unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].key, "service[0].forward");
        assert!(errs[0].message.contains("local_addresses"), "{}", errs[0]);
        // An IPv6 local address with no IPv6 service is fine.
        let ok = packet_file(
            "[packet]\ninterfaces = [\"lo\"]\nlocal_addresses = [\"10.0.1.1\", \"2001:db8::1\"]",
            &fnat,
        );
        parse(&ok, "p").unwrap_or_else(|e| panic!("{e:?}"));

        let errs = parse("[packet]\ninterfaces = []\n", "p").unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].key, "packet.interfaces");
        assert!(errs[0].message.contains("is empty"), "{}", errs[0]);
        let errs = parse("[packet]\nio = \"xdp\"\n", "p").unwrap_err();
        assert_eq!(errs[0].key, "packet.interfaces");
        assert!(errs[0].message.contains("required"), "{}", errs[0]);
    }

    /// Typed values that do not parse are reported with the rest, and a
    /// bad `forward` does not also complain about its `sloppy_tcp`.
    #[test]
    fn packet_typed_values_report_with_the_rest() {
        let text = "[packet]\ninterfaces = [\"lo\"]\nio = \"dpdk\"\nfnat_ports = \"5-1\"\n\
                    local_addresses = [\"nowhere\"]\nbogus = 1\n";
        let errs = parse(text, "p").unwrap_err();
        let keys: Vec<&str> = errs.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "packet.io",
                "packet.fnat_ports",
                "packet.local_addresses",
                "packet.bogus"
            ],
            "{errs:?}"
        );
        let text = "[packet]\ninterfaces = [\"lo\"]\nio = \"dpdk\"\nfnat_ports = \"5-1\"\n\
                    [[service]]\nname = \"a\"\nprotocol = \"tcp\"\nlisten = \"10.0.0.1:80\"\n\
                    forward = \"masq\"\nsloppy_tcp = true\n\
                    tcp_max_connections_per_client = 0\nmh_port = true\n";
        let errs = parse(text, "p").unwrap_err();
        let keys: Vec<(&str, Option<usize>)> =
            errs.iter().map(|e| (e.key.as_str(), e.line)).collect();
        assert_eq!(
            keys,
            [
                ("packet.io", Some(3)),
                ("packet.fnat_ports", Some(4)),
                ("service[0].forward", Some(9)),
                ("service[0].mh_port", Some(12)),
            ],
            "{errs:?}"
        );
        assert!(errs[0].message.contains("auto xdp afpacket"), "{}", errs[0]);
        assert!(errs[1].message.contains("runs backwards"), "{}", errs[1]);
        assert!(errs[2].message.contains("proxy nat fnat dr"), "{}", errs[2]);
    }
}

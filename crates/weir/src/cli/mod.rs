//! The operator CLI: `weir list`, `weir conns`, `weir tenant|service|backend
//! add|edit|del`, `weir kill`, `weir save`, `weir reload`, `weir stats`,
//! `weir top`, `weir health`. Every command is one or a few admin-API calls
//! (see [`client`]) followed by a pure renderer (see [`render`]).
//!
//! Output is human-readable by default and JSON with `--json` on every read
//! command ([`Command::takes_json`]). The admin options (`--admin`,
//! `--token`, `--config`) and `--json` are global: they may come before or
//! after the command's name. Exit codes: 0 success; 1 the daemon refused (the message says
//! why); 2 the CLI could not do it (daemon unreachable, bad arguments, no
//! token), with a hint on what to do.
//!
//! `weir conns` pages through the daemon's resumable cursor
//! ([`PAGE`] entries per request) and writes each page before fetching the
//! next, so a million connections never sit in memory at once.

pub mod client;
pub mod render;

use std::io::Write;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::{Value, json};

use crate::config::{Config, Dur, Forward, HealthInterval, Protocol, ServiceSpec};
use crate::control::{
    ConnPage, GlobalStats, HealthEntry, ReloadReport, ServiceStatus, TableReport, TenantStatus,
};

use self::client::{AdminArgs, CliError, CliResult, Client, seg};
use self::render::ListMode;

/// Connections fetched per request by `weir conns`.
pub const PAGE: usize = 1000;

/// The client commands (flattened into the `weir` binary's subcommands).
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// List services and backends, like ipvsadm -Ln.
    List(ListArgs),
    /// List connections, like ipvsadm -Lnc.
    Conns(ConnsArgs),
    /// Create, list or delete tenants.
    Tenant {
        /// What to do.
        #[command(subcommand)]
        cmd: TenantCmd,
        /// Where the admin API is.
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Add, edit or delete virtual services.
    Service {
        /// What to do.
        #[command(subcommand)]
        cmd: ServiceCmd,
        /// Where the admin API is.
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Add, edit, drain or delete backends.
    Backend {
        /// What to do.
        #[command(subcommand)]
        cmd: BackendCmd,
        /// Where the admin API is.
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Kill one connection by cookie, or every connection matching filters.
    Kill(KillArgs),
    /// Print the running state as a config file (like ipvsadm -S).
    Save(SaveArgs),
    /// Make the daemon re-read its config file and print what changed
    /// (applies nothing on any error).
    Reload(ReloadArgs),
    /// Daemon-wide counters and rates, or `weir stats table` for flow tables.
    Stats(StatsArgs),
    /// Health-check state of every backend.
    Health(ReadArgs),
    /// Live view of services, backends and tenants, refreshed like top.
    Top(TopArgs),
}

impl Command {
    /// Whether `--json` changes what the command prints (the read
    /// commands). The binary refuses `--json` for the others rather than
    /// ignore it; a new command must say here which it is.
    pub fn takes_json(&self) -> bool {
        match self {
            Command::List(_)
            | Command::Conns(_)
            | Command::Save(_)
            | Command::Reload(_)
            | Command::Stats(_)
            | Command::Health(_) => true,
            Command::Tenant { cmd, .. } => matches!(cmd, TenantCmd::List { .. }),
            Command::Service { .. }
            | Command::Backend { .. }
            | Command::Kill(_)
            | Command::Top(_) => false,
        }
    }
}

/// Arguments of commands that only need the admin API.
#[derive(Debug, Clone, Args)]
pub struct PlainArgs {
    /// Where the admin API is.
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// `weir reload`.
#[derive(Debug, Clone, Args)]
pub struct ReloadArgs {
    /// Check the file and print what a reload would add, change and
    /// remove; apply nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Also remove tenants, services and backends added through the API
    /// (since the last reload) that the file does not have.
    #[arg(long)]
    pub force: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// How long to wait for the daemon's answer, e.g. "5m": a reload of a
    /// large file can take longer than the default. Past it the command
    /// exits 3: the reload may still be applying.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_timeout)]
    pub timeout: std::time::Duration,
    /// Where the admin API is.
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// `--timeout`: a duration above zero.
fn parse_timeout(s: &str) -> Result<std::time::Duration, String> {
    match crate::config::parse_duration(s)? {
        d if d.is_zero() => Err("must be more than 0, e.g. \"5m\"".into()),
        d => Ok(d),
    }
}

/// Arguments of simple read commands.
#[derive(Debug, Clone, Args)]
pub struct ReadArgs {
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Where the admin API is.
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// `weir list`.
#[derive(Debug, Clone, Args)]
pub struct ListArgs {
    /// Show counters: Conns InPkts OutPkts InBytes OutBytes.
    #[arg(long, conflicts_with = "rate")]
    pub stats: bool,
    /// Show rates: CPS InPPS OutPPS InBPS OutBPS.
    #[arg(long)]
    pub rate: bool,
    /// Print exact numbers instead of K/M/G suffixes.
    #[arg(long)]
    pub exact: bool,
    /// Only this tenant's services.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Where the admin API is.
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// Connection filters shared by `weir conns` and `weir kill`.
#[derive(Debug, Clone, Default, Args)]
pub struct FilterArgs {
    /// Tenant name.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Service name.
    #[arg(long)]
    pub service: Option<String>,
    /// Backend IP:PORT.
    #[arg(long)]
    pub backend: Option<String>,
    /// State, e.g. ESTABLISHED.
    #[arg(long)]
    pub state: Option<String>,
}

impl FilterArgs {
    fn is_empty(&self) -> bool {
        self.tenant.is_none()
            && self.service.is_none()
            && self.backend.is_none()
            && self.state.is_none()
    }
    fn query(&self) -> Vec<(&'static str, &str)> {
        let mut q = Vec::new();
        for (k, v) in [
            ("tenant", &self.tenant),
            ("service", &self.service),
            ("backend", &self.backend),
            ("state", &self.state),
        ] {
            if let Some(v) = v {
                q.push((k, v.as_str()));
            }
        }
        q
    }
}

/// `weir conns`.
#[derive(Debug, Clone, Args)]
pub struct ConnsArgs {
    /// Filters.
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Stream NDJSON, one connection per line.
    #[arg(long)]
    pub json: bool,
    /// Stop after this many connections.
    #[arg(long)]
    pub max: Option<u64>,
    /// Where the admin API is.
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// `weir tenant ...`.
#[derive(Debug, Clone, Subcommand)]
pub enum TenantCmd {
    /// List tenants.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Create a tenant.
    Add {
        /// Name.
        name: String,
        /// Own flow table with this many entries (power of two ≤ 2^24); 0 shares the global table.
        #[arg(long, default_value_t = 0)]
        table_entries: usize,
        /// Own table only: the entries it may grow to (power of two ≥
        /// --table-entries, ≤ 2^24); 0 = the table's maximum. Fixed at
        /// creation, as the size is.
        #[arg(long, default_value_t = 0)]
        max_table_entries: usize,
        /// Cap on connections + sessions; 0 = unlimited.
        #[arg(long, default_value_t = 0)]
        max_connections: u64,
        /// Cap on new connections + sessions per second; 0 = unlimited.
        #[arg(long, default_value_t = 0)]
        max_new_per_s: u64,
        /// Cap on this tenant's services; 0 = unlimited.
        #[arg(long, default_value_t = 0)]
        max_services: u64,
        /// Cap on the backends of all this tenant's services; 0 = unlimited.
        #[arg(long, default_value_t = 0)]
        max_backends: u64,
        /// Shortest health-check interval the tenant's token may set, e.g.
        /// 5s (1ms..=1h); the daemon's default is 1s.
        #[arg(long, value_name = "DURATION")]
        min_health_interval: Option<Dur<HealthInterval>>,
        /// Tenant-scoped admin token.
        #[arg(long)]
        tenant_token: Option<String>,
    },
    /// Change a live tenant's limits, token or timeouts; options not given
    /// keep their value. The table size is fixed at creation.
    Edit {
        /// Name.
        name: String,
        /// Cap on connections + sessions; 0 = unlimited.
        #[arg(long)]
        max_connections: Option<u64>,
        /// Cap on new connections + sessions per second; 0 = unlimited.
        #[arg(long)]
        max_new_per_s: Option<u64>,
        /// Cap on this tenant's services; 0 = unlimited (services it holds
        /// beyond a lowered cap stay).
        #[arg(long)]
        max_services: Option<u64>,
        /// Cap on the backends of all this tenant's services; 0 = unlimited
        /// (backends it holds beyond a lowered cap stay).
        #[arg(long)]
        max_backends: Option<u64>,
        /// Shortest health-check interval the tenant's token may set, e.g.
        /// 5s (1ms..=1h); services already there keep theirs.
        #[arg(long, value_name = "DURATION")]
        min_health_interval: Option<Dur<HealthInterval>>,
        /// New tenant-scoped admin token.
        #[arg(long, conflicts_with = "no_tenant_token")]
        tenant_token: Option<String>,
        /// Remove the tenant-scoped admin token.
        #[arg(long)]
        no_tenant_token: bool,
        /// A per-state timeout, KEY=DURATION (e.g. established=1h, udp=60s);
        /// repeatable; `KEY=default` goes back to the IPVS default.
        #[arg(long = "timeout", value_name = "KEY=DURATION")]
        timeouts: Vec<String>,
        /// Refused by the daemon unless equal to the current size (the
        /// table is sized at creation: delete and re-create the tenant).
        #[arg(long)]
        table_entries: Option<usize>,
    },
    /// Delete a tenant, its services and its connections.
    Del {
        /// Name.
        name: String,
    },
}

/// `weir service ...`; SERVICE is `[TENANT/]NAME` (tenant "default" if omitted).
#[derive(Debug, Clone, Subcommand)]
pub enum ServiceCmd {
    /// Add a virtual service.
    Add {
        /// [TENANT/]NAME.
        service: String,
        /// tcp or udp.
        #[arg(long, default_value = "tcp")]
        protocol: String,
        /// Virtual address IP:PORT.
        #[arg(long)]
        listen: String,
        /// rr wrr lc wlc sed nq sh mh lblc lblcr dh fo ovf p2c.
        #[arg(long, default_value = "wlc")]
        scheduler: String,
        /// Persistence timeout, e.g. 300s; 0s = off.
        #[arg(long, default_value = "0s")]
        persistence: String,
        /// Scheduler flags, comma-separated, as ipvsadm -b and weir list
        /// name them: sh-fallback, sh-port (sh); mh-fallback, mh-port (mh).
        #[arg(long, value_name = "FLAG,...", value_delimiter = ',')]
        sched_flags: Vec<SchedFlag>,
        /// Backend address, optionally with @WEIGHT (10.0.0.2:80@3); repeat for several.
        #[arg(long = "backend", value_name = "IP:PORT[@WEIGHT]")]
        backends: Vec<String>,
        /// proxy (weir's own sockets), or packet mode's nat, fnat, dr (needs
        /// [packet] in the daemon's config).
        #[arg(long, default_value = "proxy")]
        forward: Forward,
        /// Packet services, TCP: a non-SYN packet with no flow creates one
        /// instead of being dropped.
        #[arg(long)]
        sloppy_tcp: bool,
    },
    /// Change a service's scheduler, its flags, persistence, address or protocol.
    Edit {
        /// [TENANT/]NAME.
        service: String,
        /// tcp or udp.
        #[arg(long)]
        protocol: Option<String>,
        /// Virtual address IP:PORT.
        #[arg(long)]
        listen: Option<String>,
        /// Scheduler.
        #[arg(long)]
        scheduler: Option<String>,
        /// Persistence timeout.
        #[arg(long)]
        persistence: Option<String>,
        /// The scheduler flags, replacing the service's: sh-fallback,
        /// sh-port (sh); mh-fallback, mh-port (mh); none clears them.
        #[arg(long, value_name = "FLAG,...", value_delimiter = ',')]
        sched_flags: Option<Vec<SchedFlag>>,
        /// Packet services, TCP: true = a non-SYN packet with no flow creates one.
        #[arg(long, value_name = "BOOL")]
        sloppy_tcp: Option<bool>,
    },
    /// Delete a service: stop listening and close its connections.
    Del {
        /// [TENANT/]NAME.
        service: String,
    },
}

/// A scheduler flag, named as ipvsadm's `-b` and `weir list` name it
/// (`--sched-flags sh-fallback,sh-port`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SchedFlag {
    /// `sh`: a client whose backend is unavailable takes the next available
    /// one along its buckets (without it the client is refused).
    ShFallback,
    /// `sh`: hash the client's port with its address.
    ShPort,
    /// `mh`: fall back to another backend when the chosen one is unavailable.
    MhFallback,
    /// `mh`: hash the client's port with its address.
    MhPort,
    /// No flag: `service edit --sched-flags none` clears them.
    None,
}

impl SchedFlag {
    /// The service option each flag sets, as the file and the API name it.
    const KEYS: [(SchedFlag, &'static str); 4] = [
        (SchedFlag::ShFallback, "sh_fallback"),
        (SchedFlag::ShPort, "sh_port"),
        (SchedFlag::MhFallback, "mh_fallback"),
        (SchedFlag::MhPort, "mh_port"),
    ];

    /// `flags`, checked: `none` stands alone.
    fn checked(flags: &[SchedFlag]) -> CliResult<&[SchedFlag]> {
        if flags.contains(&SchedFlag::None) && flags.len() > 1 {
            return Err(CliError::Local(
                "--sched-flags none clears the flags; give it alone".into(),
            ));
        }
        Ok(flags)
    }

    /// Sets exactly `flags` in `o` (ipvsadm -E -b replaces them too).
    fn set(flags: &[SchedFlag], o: &mut crate::config::ServiceOptions) {
        o.sh_fallback = flags.contains(&SchedFlag::ShFallback);
        o.sh_port = flags.contains(&SchedFlag::ShPort);
        o.mh_fallback = flags.contains(&SchedFlag::MhFallback);
        o.mh_port = flags.contains(&SchedFlag::MhPort);
    }
}

/// `weir backend ...`.
#[derive(Debug, Clone, Subcommand)]
pub enum BackendCmd {
    /// Add a backend to a service.
    Add {
        /// [TENANT/]SERVICE.
        service: String,
        /// IP:PORT.
        address: String,
        /// Weight; 0 quiesces.
        #[arg(long, default_value_t = 1)]
        weight: u32,
        /// Send a PROXY protocol header: v1 or v2.
        #[arg(long)]
        proxy_protocol: Option<String>,
        /// Cap on connections to this backend; 0 = unlimited.
        #[arg(long, default_value_t = 0)]
        max_connections: u64,
    },
    /// Change a backend's weight.
    Edit {
        /// [TENANT/]SERVICE.
        service: String,
        /// IP:PORT.
        address: String,
        /// New weight; 0 quiesces.
        #[arg(long)]
        weight: u32,
    },
    /// Drain a backend: weight 0 (no new connections); --close also closes its connections.
    Drain {
        /// [TENANT/]SERVICE.
        service: String,
        /// IP:PORT.
        address: String,
        /// Also close its existing connections.
        #[arg(long)]
        close: bool,
    },
    /// Remove a backend (its established connections finish unless expire_nodest_conn).
    Del {
        /// [TENANT/]SERVICE.
        service: String,
        /// IP:PORT.
        address: String,
    },
}

/// `weir kill`.
#[derive(Debug, Clone, Args)]
pub struct KillArgs {
    /// Kill the connection with this cookie (from weir conns).
    #[arg(long, conflicts_with_all = ["tenant", "service", "backend", "state", "all"])]
    pub cookie: Option<u64>,
    /// Filters.
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Kill every connection (required when no filter is given).
    #[arg(long)]
    pub all: bool,
    /// Where the admin API is.
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// `weir save`.
#[derive(Debug, Clone, Args)]
pub struct SaveArgs {
    /// Print JSON instead of TOML.
    #[arg(long)]
    pub json: bool,
    /// Where the admin API is.
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// `weir stats`.
#[derive(Debug, Clone, Args)]
pub struct StatsArgs {
    /// `table` for per-tenant flow-table figures; default: daemon-wide.
    #[arg(value_parser = ["table", "global"], default_value = "global")]
    pub what: String,
    /// Print exact numbers instead of K/M/G suffixes.
    #[arg(long)]
    pub exact: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Where the admin API is.
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// Longest `weir top --interval` in seconds (an hour).
pub const MAX_TOP_INTERVAL_S: f64 = 3_600.0;

/// `weir top`.
#[derive(Debug, Clone, Args)]
pub struct TopArgs {
    /// Seconds between refreshes (0.1 to 3600).
    #[arg(long, default_value_t = 2.0)]
    pub interval: f64,
    /// Stop after N frames (default: until interrupted).
    #[arg(long)]
    pub iterations: Option<u64>,
    /// Do not clear the screen between frames.
    #[arg(long)]
    pub no_clear: bool,
    /// Where the admin API is.
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// Run a client command, printing to stdout/stderr.
pub fn run(cmd: Command) -> ExitCode {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut err = std::io::stderr();
    run_with(cmd, &mut out, &mut err)
}

/// Run a client command with explicit output streams (tests).
pub fn run_with(cmd: Command, out: &mut dyn Write, err: &mut dyn Write) -> ExitCode {
    match execute(cmd, out) {
        Ok(()) => {
            let _ = out.flush();
            ExitCode::SUCCESS
        }
        Err(e) => {
            let _ = out.flush();
            let _ = writeln!(err, "{e}");
            match e {
                CliError::Api { .. } => ExitCode::from(1),
                CliError::Local(_) => ExitCode::from(2),
                CliError::NoAnswer(_) => ExitCode::from(3),
            }
        }
    }
}

fn w(out: &mut dyn Write, s: &str) -> CliResult<()> {
    out.write_all(s.as_bytes())
        .map_err(|e| CliError::Local(format!("writing output: {e}")))
}

fn wjson(out: &mut dyn Write, v: &Value) -> CliResult<()> {
    let s = serde_json::to_string_pretty(v)
        .map_err(|e| CliError::Local(format!("encoding JSON: {e}")))?;
    w(out, &s)?;
    w(out, "\n")
}

/// `[TENANT/]NAME` → (tenant, name).
pub fn split_service(s: &str) -> CliResult<(String, String)> {
    let (t, n) = s.split_once('/').unwrap_or(("default", s));
    if t.is_empty() || n.is_empty() || n.contains('/') {
        return Err(CliError::Local(format!(
            "{s:?} is not [TENANT/]NAME, e.g. acme/web or web"
        )));
    }
    Ok((t.to_owned(), n.to_owned()))
}

fn query_string(pairs: &[(&str, &str)]) -> String {
    let parts: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{k}={}", seg(v)))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

fn execute(cmd: Command, out: &mut dyn Write) -> CliResult<()> {
    match cmd {
        Command::List(a) => list(a, out),
        Command::Conns(a) => conns(a, out),
        Command::Tenant { cmd, admin } => tenant(cmd, &Client::from_args(&admin)?, out),
        Command::Service { cmd, admin } => service(cmd, &Client::from_args(&admin)?, out),
        Command::Backend { cmd, admin } => backend(cmd, &Client::from_args(&admin)?, out),
        Command::Kill(a) => kill(a, out),
        Command::Save(a) => save(a, out),
        Command::Reload(a) => reload(a, out),
        Command::Stats(a) => stats(a, out),
        Command::Health(a) => {
            let c = Client::from_args(&a.admin)?;
            let h: Vec<HealthEntry> = c.get("/v1/health")?;
            if a.json {
                wjson(out, &serde_json::to_value(&h).unwrap_or_default())
            } else {
                w(out, &render::render_health(&h))
            }
        }
        Command::Top(a) => top(a, out),
    }
}

fn list(a: ListArgs, out: &mut dyn Write) -> CliResult<()> {
    let c = Client::from_args(&a.admin)?;
    let mut services: Vec<ServiceStatus> = c.get("/v1/services")?;
    if let Some(t) = &a.tenant {
        services.retain(|s| &s.tenant == t);
    }
    let mode = if a.stats {
        ListMode::Stats
    } else if a.rate {
        ListMode::Rate
    } else {
        ListMode::Plain
    };
    if a.json {
        wjson(out, &render::list_json(&services, mode))
    } else {
        w(out, &render::render_list(&services, mode, a.exact))
    }
}

fn conns(a: ConnsArgs, out: &mut dyn Write) -> CliResult<()> {
    let c = Client::from_args(&a.admin)?;
    let limit = PAGE.to_string();
    let mut cursor: Option<String> = None;
    // Every cursor given so far: one a page's worth of entries apart, so
    // a million connections keep a thousand.
    let mut given = std::collections::HashSet::new();
    let mut shown: u64 = 0;
    let max = a.max.unwrap_or(u64::MAX);
    if !a.json {
        w(out, &render::conns_header())?;
    }
    loop {
        let mut q = a.filter.query();
        q.push(("limit", &limit));
        if let Some(cur) = &cursor {
            q.push(("cursor", cur));
        }
        let page: ConnPage = c.get(&format!("/v1/connections{}", query_string(&q)))?;
        let mut buf = String::new();
        for conn in &page.connections {
            if shown >= max {
                break;
            }
            shown += 1;
            if a.json {
                match serde_json::to_string(conn) {
                    Ok(s) => {
                        buf.push_str(&s);
                        buf.push('\n');
                    }
                    Err(e) => return Err(CliError::Local(format!("encoding JSON: {e}"))),
                }
            } else {
                buf.push_str(&render::conn_line(conn));
            }
        }
        w(out, &buf)?;
        match page.next {
            // A cursor given before would fetch (and print) the same pages
            // forever: one that does not move, or cursors that go round
            // (A, B, A, ...), which the daemon's never do (each is past
            // the last).
            Some(n) if shown < max && given.contains(&n) => {
                return Err(CliError::Local(format!(
                    "the daemon gave cursor {n:?} again: stopping, as the listing would \
                     never end; is the daemon the same weir version?"
                )));
            }
            Some(n) if shown < max => {
                given.insert(n.clone());
                cursor = Some(n);
            }
            _ => break,
        }
    }
    Ok(())
}

fn tenant(cmd: TenantCmd, c: &Client, out: &mut dyn Write) -> CliResult<()> {
    match cmd {
        TenantCmd::List { json } => {
            let t: Vec<TenantStatus> = c.get("/v1/tenants")?;
            if json {
                wjson(out, &serde_json::to_value(&t).unwrap_or_default())
            } else {
                w(out, &render::render_tenants(&t))
            }
        }
        TenantCmd::Add {
            name,
            table_entries,
            max_table_entries,
            max_connections,
            max_new_per_s,
            max_services,
            max_backends,
            min_health_interval,
            tenant_token,
        } => {
            let mut body = json!({
                "name": name, "table_entries": table_entries,
                "max_connections": max_connections, "max_new_per_s": max_new_per_s,
                "max_services": max_services, "max_backends": max_backends,
            });
            // Only when given: 0, the default, is the table's maximum.
            if max_table_entries != 0 {
                body["max_table_entries"] = json!(max_table_entries);
            }
            if let Some(d) = min_health_interval {
                body["min_health_interval"] = json!(d);
            }
            if let Some(t) = tenant_token {
                body["token"] = json!(t);
            }
            c.send("POST", "/v1/tenants", Some(&body))?;
            w(out, &format!("tenant {name} added\n"))
        }
        TenantCmd::Edit {
            name,
            max_connections,
            max_new_per_s,
            max_services,
            max_backends,
            min_health_interval,
            tenant_token,
            no_tenant_token,
            timeouts,
            table_entries,
        } => {
            let mut body = serde_json::Map::new();
            if let Some(v) = max_connections {
                body.insert("max_connections".into(), json!(v));
            }
            if let Some(v) = max_new_per_s {
                body.insert("max_new_per_s".into(), json!(v));
            }
            if let Some(v) = max_services {
                body.insert("max_services".into(), json!(v));
            }
            if let Some(v) = max_backends {
                body.insert("max_backends".into(), json!(v));
            }
            if let Some(d) = min_health_interval {
                body.insert("min_health_interval".into(), json!(d));
            }
            if let Some(t) = tenant_token {
                body.insert("token".into(), json!(t));
            }
            if no_tenant_token {
                body.insert("token".into(), Value::Null);
            }
            if let Some(v) = table_entries {
                body.insert("table_entries".into(), json!(v));
            }
            if !timeouts.is_empty() {
                // The daemon replaces `timeouts` as a whole: start from the
                // tenant's current ones.
                let list: Vec<TenantStatus> = c.get("/v1/tenants")?;
                let cur = list
                    .into_iter()
                    .find(|t| t.spec.name == name)
                    .ok_or_else(|| CliError::Local(format!("tenant {name} does not exist")))?;
                let mut t = match serde_json::to_value(&cur.spec.timeouts) {
                    Ok(Value::Object(m)) => m,
                    _ => serde_json::Map::new(),
                };
                for kv in &timeouts {
                    let (key, value) = kv.split_once('=').ok_or_else(|| {
                        CliError::Local(format!(
                            "--timeout {kv:?}: write KEY=DURATION, e.g. established=1h"
                        ))
                    })?;
                    let known = crate::config::TimeoutsSpec::default()
                        .fields()
                        .iter()
                        .any(|(k, _)| *k == key);
                    if !known {
                        return Err(CliError::Local(format!(
                            "--timeout {kv:?}: unknown state {key:?}; one of established, syn_sent, syn_recv, fin_wait, close_wait, last_ack, time_wait, close, udp, persist"
                        )));
                    }
                    if value == "default" {
                        t.remove(key);
                    } else {
                        t.insert(key.into(), json!(value));
                    }
                }
                body.insert("timeouts".into(), Value::Object(t));
            }
            if body.is_empty() {
                return Err(CliError::Local(format!(
                    "tenant {name}: nothing to change; give e.g. --max-connections, --max-new-per-s, --tenant-token or --timeout KEY=DURATION"
                )));
            }
            c.send(
                "PUT",
                &format!("/v1/tenants/{}", seg(&name)),
                Some(&Value::Object(body)),
            )?;
            w(out, &format!("tenant {name} updated\n"))
        }
        TenantCmd::Del { name } => {
            let path = format!("/v1/tenants/{}", seg(&name));
            let v = c.send("DELETE", &path, None)?;
            let closed = answered_count(&v, "closed_connections", &format!("DELETE {path}"))?;
            w(
                out,
                &format!("tenant {name} deleted ({closed} connections closed)\n"),
            )
        }
    }
}

fn parse_backend(s: &str) -> CliResult<Value> {
    let (addr, weight) = match s.rsplit_once('@') {
        Some((a, wt)) => (
            a,
            wt.parse::<u32>().map_err(|_| {
                CliError::Local(format!("backend {s:?}: weight {wt:?} is not a number"))
            })?,
        ),
        None => (s, 1),
    };
    let addr: std::net::SocketAddr = addr
        .parse()
        .map_err(|_| CliError::Local(format!("backend {addr:?} is not IP:PORT")))?;
    Ok(json!({ "address": addr, "weight": weight }))
}

fn service(cmd: ServiceCmd, c: &Client, out: &mut dyn Write) -> CliResult<()> {
    match cmd {
        ServiceCmd::Add {
            service,
            protocol,
            listen,
            scheduler,
            persistence,
            sched_flags,
            backends,
            forward,
            sloppy_tcp,
        } => {
            let (tenant, name) = split_service(&service)?;
            let sched_flags = SchedFlag::checked(&sched_flags)?;
            let backends = backends
                .iter()
                .map(|b| parse_backend(b))
                .collect::<CliResult<Vec<_>>>()?;
            let mut body = json!({
                "tenant": tenant, "name": name, "protocol": protocol, "listen": listen,
                "scheduler": scheduler, "persistence": persistence, "backend": backends,
            });
            // Only what differs from the defaults, so a daemon that predates
            // packet mode still takes a proxy service.
            if forward.is_packet() {
                body["forward"] = json!(forward);
            }
            if sloppy_tcp {
                body["sloppy_tcp"] = json!(true);
            }
            for (flag, key) in SchedFlag::KEYS {
                if sched_flags.contains(&flag) {
                    body[key] = json!(true);
                }
            }
            c.send("POST", "/v1/services", Some(&body))?;
            w(out, &format!("service {tenant}/{name} added\n"))
        }
        ServiceCmd::Edit {
            service,
            protocol,
            listen,
            scheduler,
            persistence,
            sched_flags,
            sloppy_tcp,
        } => {
            let (tenant, name) = split_service(&service)?;
            let sched_flags = sched_flags.as_deref().map(SchedFlag::checked).transpose()?;
            let path = format!("/v1/services/{}/{}", seg(&tenant), seg(&name));
            let mut spec: ServiceSpec = c.get(&path)?;
            if let Some(p) = protocol {
                spec.protocol = match p.to_ascii_lowercase().as_str() {
                    "tcp" => Protocol::Tcp,
                    "udp" => Protocol::Udp,
                    _ => return Err(CliError::Local(format!("protocol {p:?}: use tcp or udp"))),
                };
            }
            if let Some(l) = listen {
                spec.listen = l
                    .parse()
                    .map_err(|_| CliError::Local(format!("listen {l:?} is not IP:PORT")))?;
            }
            if let Some(s) = scheduler {
                spec.scheduler = crate::config::parse_scheduler(&s)
                    .map_err(|e| CliError::Local(format!("--scheduler: {e}")))?;
            }
            if let Some(p) = persistence {
                spec.persistence = p
                    .parse()
                    .map_err(|e| CliError::Local(format!("--persistence: {e}")))?;
            }
            if let Some(flags) = sched_flags {
                SchedFlag::set(flags, &mut spec.options);
            }
            if let Some(on) = sloppy_tcp {
                spec.options.sloppy_tcp = on;
            }
            let body = serde_json::to_value(&spec)
                .map_err(|e| CliError::Local(format!("encoding the service: {e}")))?;
            c.send("PUT", &path, Some(&body))?;
            w(out, &format!("service {tenant}/{name} updated\n"))
        }
        ServiceCmd::Del { service } => {
            let (tenant, name) = split_service(&service)?;
            c.send(
                "DELETE",
                &format!("/v1/services/{}/{}", seg(&tenant), seg(&name)),
                None,
            )?;
            w(out, &format!("service {tenant}/{name} deleted\n"))
        }
    }
}

fn backend(cmd: BackendCmd, c: &Client, out: &mut dyn Write) -> CliResult<()> {
    let base = |svc: &str| -> CliResult<(String, String)> {
        let (t, n) = split_service(svc)?;
        Ok((
            format!("/v1/services/{}/{}/backends", seg(&t), seg(&n)),
            format!("{t}/{n}"),
        ))
    };
    match cmd {
        BackendCmd::Add {
            service,
            address,
            weight,
            proxy_protocol,
            max_connections,
        } => {
            let (path, id) = base(&service)?;
            let mut body =
                json!({ "address": address, "weight": weight, "max_connections": max_connections });
            if let Some(p) = proxy_protocol {
                body["proxy_protocol"] = json!(p);
            }
            c.send("POST", &path, Some(&body))?;
            w(out, &format!("backend {address} added to {id}\n"))
        }
        BackendCmd::Edit {
            service,
            address,
            weight,
        } => {
            let (path, id) = base(&service)?;
            c.send(
                "PUT",
                &format!("{path}/{}", seg(&address)),
                Some(&json!({ "weight": weight })),
            )?;
            w(
                out,
                &format!("backend {address} of {id}: weight {weight}\n"),
            )
        }
        BackendCmd::Drain {
            service,
            address,
            close,
        } => {
            let (path, id) = base(&service)?;
            let body = if close {
                json!({ "weight": 0, "drain": true })
            } else {
                json!({ "weight": 0 })
            };
            c.send("PUT", &format!("{path}/{}", seg(&address)), Some(&body))?;
            let how = if close {
                "drained, connections closed"
            } else {
                "drained (weight 0; existing connections continue)"
            };
            w(out, &format!("backend {address} of {id} {how}\n"))
        }
        BackendCmd::Del { service, address } => {
            let (path, id) = base(&service)?;
            c.send("DELETE", &format!("{path}/{}", seg(&address)), None)?;
            w(out, &format!("backend {address} removed from {id}\n"))
        }
    }
}

fn kill(a: KillArgs, out: &mut dyn Write) -> CliResult<()> {
    let c = Client::from_args(&a.admin)?;
    if let Some(cookie) = a.cookie {
        c.send("DELETE", &format!("/v1/connections/{cookie}"), None)?;
        return w(out, &format!("killed connection {cookie}\n"));
    }
    if a.filter.is_empty() && !a.all {
        return Err(CliError::Local(
            "refusing to kill every connection: give --cookie, a filter (--tenant, --service, --backend, --state), or --all".into(),
        ));
    }
    let mut body = json!({ "all": a.all });
    for (k, v) in a.filter.query() {
        body[k] = json!(v);
    }
    let v = c.send("POST", "/v1/connections/kill", Some(&body))?;
    let n = answered_count(&v, "killed", "POST /v1/connections/kill")?;
    w(out, &format!("killed {n} connections\n"))
}

/// The count `key` of a successful answer to `request`. An answer without
/// it is not weir's (another server, or another version): printed as 0,
/// it read as "nothing was done" whatever had been.
fn answered_count(v: &Value, key: &str, request: &str) -> CliResult<u64> {
    v.get(key).and_then(Value::as_u64).ok_or_else(|| {
        CliError::Local(format!(
            "the answer to {request} has no {key:?} count (is the daemon the same weir \
             version?): the request may have been carried out; see `weir conns` and `weir list`"
        ))
    })
}

fn reload(a: ReloadArgs, out: &mut dyn Write) -> CliResult<()> {
    let c = Client::from_args(&a.admin)?.with_timeout(a.timeout);
    let mut q = Vec::new();
    if a.dry_run {
        q.push(("dry_run", "true"));
    }
    if a.force {
        q.push(("force", "true"));
    }
    let v = c
        .send("POST", &format!("/v1/reload{}", query_string(&q)), None)
        .map_err(|e| match e {
            // The daemon had the request: it may be applying it still. It
            // used to read as any failure (exit 2, "no answer within
            // 60s"), and a reload retried on that stacked up behind the
            // first.
            CliError::NoAnswer(m) if !a.dry_run => CliError::NoAnswer(format!(
                "{m}; the reload may still be applying: see the daemon's \
                 log (e.g. journalctl -u weir) and `weir list` for what it changed before \
                 reloading again; --timeout waits longer"
            )),
            CliError::NoAnswer(m) => CliError::NoAnswer(format!(
                "{m}; the dry run changes nothing; --timeout waits longer"
            )),
            e => e,
        })?;
    if a.json {
        return wjson(out, &v);
    }
    let report: ReloadReport = serde_json::from_value(v).map_err(|e| {
        CliError::Local(format!(
            "unexpected answer to POST /v1/reload (is the daemon the same weir version?): {e}"
        ))
    })?;
    w(out, &render::render_reload(&report, a.dry_run))
}

/// The running config as `weir save` prints it.
pub fn config_to_toml(cfg: &Config) -> CliResult<String> {
    toml::to_string(cfg).map_err(|e| CliError::Local(format!("encoding the config as TOML: {e}")))
}

fn save(a: SaveArgs, out: &mut dyn Write) -> CliResult<()> {
    let c = Client::from_args(&a.admin)?;
    let text = c.call("GET", "/v1/config", None)?;
    let cfg: Config = serde_json::from_str(&text).map_err(|e| {
        CliError::Local(format!(
            "unexpected answer to GET /v1/config (is the daemon the same weir version?): {e}"
        ))
    })?;
    if a.json {
        wjson(out, &serde_json::to_value(&cfg).unwrap_or_default())
    } else {
        w(out, "# weir save: the running state, in config-file form\n")?;
        w(out, &config_to_toml(&cfg)?)
    }
}

fn stats(a: StatsArgs, out: &mut dyn Write) -> CliResult<()> {
    let c = Client::from_args(&a.admin)?;
    if a.what == "table" {
        let t: Vec<TableReport> = c.get("/v1/table")?;
        return if a.json {
            wjson(out, &serde_json::to_value(&t).unwrap_or_default())
        } else {
            w(out, &render::render_table(&t))
        };
    }
    let v: Value = c.get("/v1/stats")?;
    if a.json {
        return wjson(out, &v);
    }
    match v.get("global") {
        Some(g) => {
            let g: GlobalStats = serde_json::from_value(g.clone())
                .map_err(|e| CliError::Local(format!("unexpected /v1/stats answer: {e}")))?;
            w(out, &render::render_global(&g, a.exact))
        }
        None => Err(CliError::Local(
            "daemon-wide stats need a full or read-only token; use `weir list --stats` for your tenant".into(),
        )),
    }
}

fn clock_label() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!(
        "{:02}:{:02}:{:02} UTC",
        (secs / 3600) % 24,
        (secs / 60) % 60,
        secs % 60
    )
}

fn top(a: TopArgs, out: &mut dyn Write) -> CliResult<()> {
    // Checked before `from_secs_f64`, which panics on values it cannot hold.
    if !(a.interval.is_finite() && (0.1..=MAX_TOP_INTERVAL_S).contains(&a.interval)) {
        return Err(CliError::Local(format!(
            "--interval {} is outside 0.1..={MAX_TOP_INTERVAL_S} seconds; use e.g. 2",
            a.interval
        )));
    }
    let interval = std::time::Duration::from_secs_f64(a.interval);
    let c = Client::from_args(&a.admin)?;
    let mut frame: u64 = 0;
    loop {
        let services: Vec<ServiceStatus> = c.get("/v1/services")?;
        let tenants: Vec<TenantStatus> = c.get("/v1/tenants")?;
        let tables: Vec<TableReport> = c.get("/v1/table")?;
        let stats: Value = c.get("/v1/stats")?;
        let g: GlobalStats = stats
            .get("global")
            .and_then(|g| serde_json::from_value(g.clone()).ok())
            .unwrap_or_default();
        let mut s = String::new();
        if !a.no_clear {
            s.push_str("\x1b[H\x1b[2J");
        }
        s.push_str(&render::render_top(
            &clock_label(),
            &g,
            &services,
            &tenants,
            &tables,
        ));
        w(out, &s)?;
        let _ = out.flush();
        frame += 1;
        if a.iterations.is_some_and(|n| frame >= n) {
            return Ok(());
        }
        std::thread::sleep(interval);
    }
}

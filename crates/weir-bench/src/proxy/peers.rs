//! The servers the suite races and the backends behind them: configuration
//! files and start-up for HAProxy (mode tcp), nginx stream, weir, the nginx
//! HTTP backend and the iperf3 server.
//!
//! Every proxy instance carries the same six routes (HTTP, iperf3, idle,
//! slow reader with loopback segments, slow reader with Ethernet segments,
//! UDP echo), each on its own loopback port, so one instance serves every
//! test. Proxies are configured alike for both slow routes: the segment
//! size comes from the backend's listener and the clients, never from a
//! proxy setting. Settings are the packages' defaults except where a
//! default would make a test impossible (connection limits for 5,000 idle
//! connections, temp paths inside the instance's own directory); each such
//! departure is written next to it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::sys::{self, Server, free_port};

/// One implementation in the race.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Impl {
    /// No proxy: clients talk to the backends (the ceiling).
    Direct,
    /// weir.
    Weir,
    /// HAProxy, mode tcp.
    Haproxy,
    /// nginx stream module.
    Nginx,
}

impl Impl {
    /// Name used in tables and JSON.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Weir => "weir",
            Self::Haproxy => "haproxy",
            Self::Nginx => "nginx",
        }
    }

    /// HAProxy and nginx: the peers weir is compared with.
    pub(crate) fn is_peer(self) -> bool {
        matches!(self, Self::Haproxy | Self::Nginx)
    }
}

/// The six routes' ports (backend ports, or a proxy's listen ports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Routes {
    pub(crate) http: u16,
    pub(crate) iperf: u16,
    pub(crate) idle: u16,
    pub(crate) slow: u16,
    /// Slow reader whose backend cuts Ethernet-sized segments.
    pub(crate) slow_eth: u16,
    /// None where the implementation does not proxy UDP (HAProxy).
    pub(crate) udp: Option<u16>,
}

impl Routes {
    fn fresh(udp: bool) -> Result<Self> {
        Ok(Self {
            http: free_port()?,
            iperf: free_port()?,
            idle: free_port()?,
            slow: free_port()?,
            slow_eth: free_port()?,
            udp: if udp { Some(free_port()?) } else { None },
        })
    }

    fn tcp(&self) -> [u16; 5] {
        [self.http, self.iperf, self.idle, self.slow, self.slow_eth]
    }
}

/// weir-specific settings of an instance.
#[derive(Debug, Clone, Default)]
pub(crate) struct WeirOpts {
    /// The `weir` binary.
    pub(crate) bin: PathBuf,
    /// Turn weir's bounded buffering off: `notsent_lowat`,
    /// `backend_rcvbuf` and `blocked_window` all 0 (the kernel's defaults
    /// and autotuning); false leaves weir's defaults (bounding on).
    pub(crate) bounding_off: bool,
}

/// A running proxy (or the direct path) and the ports clients use.
#[derive(Debug)]
pub(crate) struct Proxy {
    pub(crate) imp: Impl,
    pub(crate) routes: Routes,
    server: Option<Server>,
}

impl Proxy {
    /// Summed RSS of the proxy's processes; 0 for the direct path.
    pub(crate) fn rss(&self) -> u64 {
        self.server.as_ref().map_or(0, Server::rss)
    }

    /// CPU time (user + system) the proxy's processes have used so far, in
    /// seconds; None for the direct path (there is no proxy to charge).
    pub(crate) fn cpu_seconds(&self) -> Option<f64> {
        self.server.as_ref().map(Server::cpu_seconds)
    }

    /// Fails if the proxy process has died.
    pub(crate) fn check_alive(&mut self) -> Result<()> {
        match self.server.as_mut() {
            Some(s) => s.check_alive(),
            None => Ok(()),
        }
    }
}

/// The backends every proxy forwards to.
#[derive(Debug)]
pub(crate) struct Backends {
    pub(crate) routes: Routes,
    _nginx: Server,
    _iperf: Server,
}

impl Backends {
    /// Starts the nginx HTTP backend (one worker) and an iperf3 server; the
    /// idle, both slow and UDP ports are the bench's own servers.
    pub(crate) fn start(idle: u16, slow: u16, slow_eth: u16, udp: u16) -> Result<Self> {
        let http = free_port()?;
        let iperf = free_port()?;
        let dir = tempfile::Builder::new()
            .prefix("weir-bench-nginx-http")
            .tempdir()?;
        let p = dir.path().to_path_buf();
        let conf = format!(
            "worker_processes 1;\n{user}daemon off;\nmaster_process on;\npid {p}/nginx.pid;\n\
             error_log {p}/error.log warn;\nevents {{ worker_connections 16384; }}\n\
             http {{\n  access_log off;\n  keepalive_requests 1000000;\n\
             client_body_temp_path {p}/body;\n  proxy_temp_path {p}/proxy;\n\
             server {{\n    listen 127.0.0.1:{http} backlog=4096;\n\
             location / {{ return 200 \"ok\\n\"; }}\n  }}\n}}\n",
            user = user_line(),
            p = p.display(),
        );
        let mut nginx = start_nginx("nginx-http", dir, &conf)?;
        let dir = tempfile::Builder::new()
            .prefix("weir-bench-iperf3")
            .tempdir()?;
        let mut cmd = Command::new("iperf3");
        cmd.args(["-s", "-B", "127.0.0.1", "-p", &iperf.to_string()]);
        let mut iperf3 = Server::spawn("iperf3-server", cmd, dir)?;
        wait_listening(&mut nginx, &[http])?;
        wait_listening(&mut iperf3, &[iperf])?;
        Ok(Self {
            routes: Routes {
                http,
                iperf,
                idle,
                slow,
                slow_eth,
                udp: Some(udp),
            },
            _nginx: nginx,
            _iperf: iperf3,
        })
    }
}

/// Starts `imp` with `workers` threads/processes in front of `be`.
pub(crate) fn start_proxy(
    imp: Impl,
    workers: usize,
    be: &Routes,
    weir: &WeirOpts,
) -> Result<Proxy> {
    if imp == Impl::Direct {
        return Ok(Proxy {
            imp,
            routes: *be,
            server: None,
        });
    }
    let routes = Routes::fresh(imp != Impl::Haproxy)?;
    let pairs = [
        ("http", routes.http, be.http),
        ("iperf", routes.iperf, be.iperf),
        ("idle", routes.idle, be.idle),
        ("slow", routes.slow, be.slow),
        ("slow_eth", routes.slow_eth, be.slow_eth),
    ];
    let mut server = match imp {
        Impl::Direct => unreachable!("handled above"),
        Impl::Haproxy => {
            let dir = tempfile::Builder::new()
                .prefix("weir-bench-haproxy")
                .tempdir()?;
            let conf = haproxy_conf(workers, &pairs);
            let path = dir.path().join("haproxy.cfg");
            std::fs::write(&path, conf)?;
            let mut cmd = Command::new("haproxy");
            cmd.arg("-f").arg(&path).arg("-db");
            Server::spawn("haproxy", cmd, dir)?
        }
        Impl::Nginx => {
            let dir = tempfile::Builder::new()
                .prefix("weir-bench-nginx-stream")
                .tempdir()?;
            let conf = nginx_stream_conf(workers, dir.path(), &pairs, routes.udp.zip(be.udp));
            start_nginx("nginx-stream", dir, &conf)?
        }
        Impl::Weir => {
            let dir = tempfile::Builder::new()
                .prefix("weir-bench-weir")
                .tempdir()?;
            let admin = free_port()?;
            let conf = weir_conf(
                workers,
                admin,
                weir.bounding_off,
                &pairs,
                routes.udp.zip(be.udp),
            );
            let path = dir.path().join("weir.toml");
            std::fs::write(&path, conf)?;
            let mut cmd = Command::new(&weir.bin);
            cmd.arg("run").arg("--config").arg(&path);
            // Whatever weir keeps per user (tokens, sockets) stays in the instance's directory.
            cmd.env("HOME", dir.path())
                .env("XDG_RUNTIME_DIR", dir.path());
            Server::spawn("weir", cmd, dir)?
        }
    };
    wait_listening(&mut server, &routes.tcp())?;
    Ok(Proxy {
        imp,
        routes,
        server: Some(server),
    })
}

/// `user root;` when running as root (nginx would otherwise drop its workers
/// to `nobody`, which cannot write the instance's temp directory).
fn user_line() -> &'static str {
    if nix::unistd::geteuid().is_root() {
        "user root;\n"
    } else {
        ""
    }
}

fn start_nginx(name: &str, dir: tempfile::TempDir, conf: &str) -> Result<Server> {
    let path = dir.path().join("nginx.conf");
    std::fs::write(&path, conf)?;
    let mut cmd = Command::new("nginx");
    cmd.arg("-p")
        .arg(dir.path())
        .arg("-c")
        .arg(&path)
        .arg("-e")
        .arg(dir.path().join("error.log"));
    Server::spawn(name, cmd, dir)
}

fn haproxy_conf(workers: usize, pairs: &[(&str, u16, u16)]) -> String {
    // maxconn: HAProxy would derive it from the 20,000-fd limit anyway; set so
    // that 2 fds per proxied connection fit under that limit with room spare.
    let mut s = format!(
        "global\n  nbthread {workers}\n  maxconn 9000\n\n\
         defaults\n  mode tcp\n  timeout connect 5s\n  timeout client 120s\n  timeout server 120s\n\n"
    );
    for (name, listen, backend) in pairs {
        let _ = write!(
            s,
            "listen {name}\n  bind 127.0.0.1:{listen}\n  server s1 127.0.0.1:{backend}\n\n"
        );
    }
    s
}

fn nginx_stream_conf(
    workers: usize,
    dir: &Path,
    pairs: &[(&str, u16, u16)],
    udp: Option<(u16, u16)>,
) -> String {
    let p = dir.display();
    // worker_connections: nginx's default (512) cannot hold 5,000 proxied
    // connections (two each); backlog=4096 matches HAProxy's (maxconn-derived,
    // capped by somaxconn) so neither drops SYNs under wrk's connection storm.
    let mut s = format!(
        "load_module /usr/lib/nginx/modules/ngx_stream_module.so;\n\
         worker_processes {workers};\n{user}daemon off;\nmaster_process on;\n\
         pid {p}/nginx.pid;\nerror_log {p}/error.log warn;\n\
         events {{ worker_connections 19000; }}\nstream {{\n",
        user = user_line()
    );
    for (_, listen, backend) in pairs {
        let _ = writeln!(
            s,
            "  server {{ listen 127.0.0.1:{listen} backlog=4096; proxy_pass 127.0.0.1:{backend}; }}"
        );
    }
    if let Some((listen, backend)) = udp {
        let _ = writeln!(
            s,
            "  server {{ listen 127.0.0.1:{listen} udp; proxy_pass 127.0.0.1:{backend}; proxy_timeout 10s; }}"
        );
    }
    s.push_str("}\n");
    s
}

fn weir_conf(
    workers: usize,
    admin: u16,
    bounding_off: bool,
    pairs: &[(&str, u16, u16)],
    udp: Option<(u16, u16)>,
) -> String {
    let mut s = format!("[daemon]\nworkers = {workers}\n");
    if bounding_off {
        s.push_str("notsent_lowat = 0\nbackend_rcvbuf = 0\nblocked_window = 0\n");
    }
    let _ = write!(
        s,
        "\n[admin]\nlisten = \"127.0.0.1:{admin}\"\ntoken = \"weir-bench\"\n\n\
         [[tenant]]\nname = \"default\"\ntable_entries = 0\nmax_connections = 0\n"
    );
    let tcp = pairs.iter().map(|(n, l, b)| (*n, "tcp", *l, *b));
    let udp = udp.map(|(l, b)| ("udp", "udp", l, b));
    for (name, proto, listen, backend) in tcp.chain(udp) {
        let _ = write!(
            s,
            "\n[[service]]\ntenant = \"default\"\nname = \"{name}\"\nprotocol = \"{proto}\"\n\
             listen = \"127.0.0.1:{listen}\"\nscheduler = \"wlc\"\npersistence = \"0s\"\n\
             \x20 [[service.backend]]\n  address = \"127.0.0.1:{backend}\"\n  weight = 1\n"
        );
    }
    s
}

/// Waits (10 s at most) until every port in `ports` has a TCP listener,
/// read from /proc/net/tcp{,6} so that probing does not disturb the server.
fn wait_listening(server: &mut Server, ports: &[u16]) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        server.check_alive()?;
        let l = listening_ports();
        if ports.iter().all(|p| l.contains(p)) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "not listening on all of {ports:?} after 10 s; log:\n{}",
                server.log_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Local ports in state LISTEN, IPv4 and IPv6 (the row format is the same).
fn listening_ports() -> Vec<u16> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .flat_map(|f| sys::parse_proc_net_tcp(&std::fs::read_to_string(f).unwrap_or_default()))
        .filter(|s| s.state == 0x0A)
        .map(|s| s.local_port)
        .collect()
}

/// Where the `weir` binary is: `$WEIR_BIN`, else next to this executable.
pub(crate) fn weir_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("WEIR_BIN") {
        return Ok(PathBuf::from(p));
    }
    let me = std::env::current_exe().context("current_exe")?;
    let p = me.with_file_name("weir");
    if p.is_file() {
        Ok(p)
    } else {
        bail!(
            "no weir binary at {} (build it with `cargo build --release -p weir` or set WEIR_BIN)",
            p.display()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_name_every_route() {
        let pairs = [("http", 21000, 22000), ("idle", 21001, 22001)];
        let h = haproxy_conf(2, &pairs);
        assert!(h.contains("nbthread 2") && h.contains("bind 127.0.0.1:21001"));
        assert!(h.contains("server s1 127.0.0.1:22000"));
        let n = nginx_stream_conf(1, Path::new("/tmp/x"), &pairs, Some((21002, 22002)));
        assert!(n.contains("worker_processes 1;"));
        assert!(n.contains("listen 127.0.0.1:21002 udp; proxy_pass 127.0.0.1:22002;"));
        let w = weir_conf(2, 9000, true, &pairs, Some((21002, 22002)));
        let v: toml::Value = toml::from_str(&w).unwrap();
        assert_eq!(v["daemon"]["workers"].as_integer(), Some(2));
        for k in ["notsent_lowat", "backend_rcvbuf", "blocked_window"] {
            assert_eq!(v["daemon"][k].as_integer(), Some(0), "{k}");
        }
        let services = v["service"].as_array().unwrap();
        assert_eq!(services.len(), 3);
        assert_eq!(services[2]["protocol"].as_str(), Some("udp"));
        assert_eq!(
            services[0]["backend"][0]["address"].as_str(),
            Some("127.0.0.1:22000")
        );
    }
}

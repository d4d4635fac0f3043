//! Packet mode end to end: the weir binary forwarding real clients' traffic
//! to real servers in network namespaces this test builds and removes.
//!
//! ```text
//!   client ns            switch ns (bridge br0)            weir ns
//!   10.98.0.10 ── veth ──┤                      ├── veth ── lb0: 10.98.0.1, 10.99.0.1
//!   (route to the VIP    │                      │           (fnat local 10.99.0.1)
//!    via 10.98.0.1)      ├── veth ── b1 ns: 10.99.0.2 (nginx)
//!                        └── veth ── b2 ns: 10.99.0.3 (nginx)
//! ```
//!
//! IPv6 alongside: client fd98::10, weir fd98::1 and fd99::1, backends
//! fd99::2 and fd99::3, VIP fd99:1::100.
//!
//! One L2 segment, two subnets: weir is "one-armed" (IPVS's usual NAT
//! deployment on a flat network), the VIP 10.99.1.100 is routed to it, and
//! for nat the backends' default route points at it so their replies come
//! back through it. Neighbours are static (`ip neigh ... permanent`) so a
//! test never waits on ARP.
//!
//! The path-MTU tests add a router namespace on br0 (10.99.0.4, fd99::4)
//! and a backend b3 behind it (10.97.0.2, fd97::2) on a link whose router
//! end has MTU 1280 (`Topology::add_router_hop`).
//!
//! Needs root, iproute2, ethtool, nginx and curl, and a weir built with its
//! XDP program; without them each test prints why and returns. wrk, iperf3,
//! redis-server and redis-tools drive the other clients; a test (or its
//! part) that needs a missing one says so and skips it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// One address family's plan of the topology.
struct Fam {
    vip: &'static str,
    client: &'static str,
    weir_client_side: &'static str,
    weir_backend_side: &'static str,
    backends: [&'static str; 2],
    /// Prefix length of the subnets, and of one host.
    plen: u8,
    host: u8,
}

const V4: Fam = Fam {
    vip: "10.99.1.100",
    client: "10.98.0.10",
    weir_client_side: "10.98.0.1",
    weir_backend_side: "10.99.0.1",
    backends: ["10.99.0.2", "10.99.0.3"],
    plen: 24,
    host: 32,
};

const V6: Fam = Fam {
    vip: "fd99:1::100",
    client: "fd98::10",
    weir_client_side: "fd98::1",
    weir_backend_side: "fd99::1",
    backends: ["fd99::2", "fd99::3"],
    plen: 64,
    host: 128,
};

const MAC_CLIENT: &str = "02:00:00:00:00:0a";
const MAC_WEIR: &str = "02:00:00:00:00:01";
/// weir's second interface (lb1) when it is two-armed.
const MAC_WEIR2: &str = "02:00:00:00:00:11";
const MAC_BACKENDS: [&str; 2] = ["02:00:00:00:00:02", "02:00:00:00:00:03"];

/// The router hop (`add_router_hop`): the router on the backends' bridge,
/// its end of the small-MTU link, and the backend behind it (IPv4, IPv6).
const ROUTER: (&str, &str) = ("10.99.0.4/24", "fd99::4/64");
const ROUTER2: (&str, &str) = ("10.97.0.1/24", "fd97::1/64");
const B3: (&str, &str) = ("10.97.0.2/24", "fd97::2/64");
const MAC_ROUTER: &str = "02:00:00:00:00:04";
const MAC_ROUTER2: &str = "02:00:00:00:00:14";
const MAC_B3: &str = "02:00:00:00:00:05";

impl Fam {
    /// "IP:PORT" in URL and config form.
    fn ep(&self, ip: &str, port: u16) -> String {
        if ip.contains(':') {
            format!("[{ip}]:{port}")
        } else {
            format!("{ip}:{port}")
        }
    }
}

fn missing_prerequisite() -> Option<String> {
    if rustix::process::geteuid().as_raw() != 0 {
        return Some("needs root (network namespaces, XDP, AF_XDP)".into());
    }
    for (tool, arg, pkg) in [
        ("ip", "-V", "iproute2"),
        ("ethtool", "--version", "ethtool"),
        ("nginx", "-v", "nginx"),
        ("curl", "--version", "curl"),
    ] {
        if Command::new(tool).arg(arg).output().is_err() {
            return Some(format!("needs {tool} (Debian package {pkg})"));
        }
    }
    if !weir_packet_io::PROGRAM_BUILT {
        return Some("built without the XDP program (no clang at build time)".into());
    }
    None
}

fn run(args: &[&str]) -> Result<String, String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// `ip` with whitespace-separated arguments.
fn ip(args: &str) -> Result<String, String> {
    let mut v = vec!["ip"];
    v.extend(args.split_whitespace());
    run(&v)
}

/// The namespaces and links; everything removed on drop, also on failure.
struct Topology {
    tag: String,
    dir: tempfile::TempDir,
    children: Vec<Child>,
    /// `[packet] interfaces` for weir.
    interfaces: &'static str,
}

impl Topology {
    fn ns(&self, name: &str) -> String {
        format!("{}{}", name, self.tag)
    }

    /// `two_armed`: weir's lb0 on the clients' bridge and lb1 on a second
    /// bridge with the backends (the issue's `interfaces = ["lb0", "lb1"]`).
    fn build(method: &str, two_armed: bool) -> Result<Self, String> {
        let tag = format!("-{}-{}", std::process::id() % 100_000, method);
        let topo = Topology {
            tag,
            dir: tempfile::tempdir().map_err(|e| e.to_string())?,
            children: Vec::new(),
            interfaces: if two_armed {
                "\"lb0\", \"lb1\""
            } else {
                "\"lb0\""
            },
        };
        let (sw, c, w) = (topo.ns("sw"), topo.ns("cl"), topo.ns("lb"));
        let bs = [topo.ns("b1"), topo.ns("b2")];
        for ns in [&sw, &c, &w].into_iter().chain(&bs) {
            ip(&format!("netns add {ns}"))?;
            ip(&format!("-n {ns} link set lo up"))?;
        }
        for br in ["br0", "br1"] {
            ip(&format!("-n {sw} link add {br} type bridge"))?;
            ip(&format!("-n {sw} link set {br} up"))?;
        }
        // The backends' bridge, and weir's device and MAC on it.
        let (bbr, wdev, wmac) = if two_armed {
            ("br1", "lb1", MAC_WEIR2)
        } else {
            ("br0", "lb0", MAC_WEIR)
        };
        // (namespace, device, MAC, bridge, addresses of both families)
        let mut ends = vec![(c.clone(), "eth0", MAC_CLIENT, "br0", vec![])];
        ends.push((w.clone(), "lb0", MAC_WEIR, "br0", vec![]));
        for (i, b) in bs.iter().enumerate() {
            ends.push((b.clone(), "eth0", MAC_BACKENDS[i], bbr, vec![]));
        }
        if two_armed {
            ends.push((w.clone(), "lb1", MAC_WEIR2, "br1", vec![]));
        }
        let wb = if two_armed { 4 } else { 1 };
        for f in [&V4, &V6] {
            ends[0].4.push(format!("{}/{}", f.client, f.plen));
            ends[1].4.push(format!("{}/{}", f.weir_client_side, f.plen));
            ends[wb]
                .4
                .push(format!("{}/{}", f.weir_backend_side, f.plen));
            for i in 0..2 {
                ends[2 + i].4.push(format!("{}/{}", f.backends[i], f.plen));
            }
        }
        for (i, (ns, dev, mac, br, addrs)) in ends.iter().enumerate() {
            let q = if dev.starts_with("lb") { 2 } else { 1 };
            ip(&format!(
                "link add p{i} netns {sw} type veth peer name {dev} netns {ns} address {mac} \
                 numrxqueues {q} numtxqueues {q}"
            ))?;
            ip(&format!("-n {sw} link set p{i} master {br} up"))?;
            for a in addrs {
                ip(&format!("-n {ns} addr add {a} dev {dev} nodad"))?;
            }
            ip(&format!("-n {ns} link set {dev} up"))?;
            // Full checksums on what the test's kernels send (a veth
            // otherwise leaves them partial, to be finished by an offload
            // that an AF_XDP frame never reaches).
            run(&["ip", "netns", "exec", ns, "ethtool", "-K", dev, "tx", "off"])?;
        }
        for f in [&V4, &V6] {
            // The client reaches the VIP through weir.
            ip(&format!(
                "-n {c} route add {}/{} via {}",
                f.vip, f.host, f.weir_client_side
            ))?;
            // Static neighbours: weir knows everyone; everyone knows weir.
            ip(&format!(
                "-n {w} neigh replace {} lladdr {MAC_CLIENT} dev lb0 nud permanent",
                f.client
            ))?;
            ip(&format!(
                "-n {c} neigh replace {} lladdr {MAC_WEIR} dev eth0 nud permanent",
                f.weir_client_side
            ))?;
            for i in 0..2 {
                ip(&format!(
                    "-n {w} neigh replace {} lladdr {} dev {wdev} nud permanent",
                    f.backends[i], MAC_BACKENDS[i]
                ))?;
                ip(&format!(
                    "-n {} neigh replace {} lladdr {wmac} dev eth0 nud permanent",
                    bs[i], f.weir_backend_side
                ))?;
            }
        }
        Ok(topo)
    }

    /// nginx in each backend namespace answering its own name, on every
    /// address of both families.
    fn start_backends(&mut self) -> Result<(), String> {
        for (i, addr) in V4.backends.iter().enumerate() {
            let name = format!("b{}", i + 1);
            let d = self.dir.path().join(&name);
            std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
            let conf = d.join("nginx.conf");
            let p = d.display();
            std::fs::write(
                &conf,
                format!(
                    "daemon off; master_process off; worker_processes 1; pid {p}/nginx.pid;\n\
                     error_log {p}/error.log;\nevents {{ worker_connections 256; }}\n\
                     http {{ access_log off; client_body_temp_path {p}/body; proxy_temp_path {p}/proxy;\n\
                     fastcgi_temp_path {p}/fcgi; uwsgi_temp_path {p}/uwsgi; scgi_temp_path {p}/scgi;\n\
                     server {{ listen 80; listen [::]:80 ipv6only=on; \
                     location / {{ return 200 \"{name}\\n\"; }} }} }}\n"
                ),
            )
            .map_err(|e| e.to_string())?;
            let conf = conf.to_str().ok_or("a temporary path not in UTF-8")?;
            self.spawn(&name, &["nginx", "-c", conf])?;
            let url = format!("http://{addr}/");
            wait_for(&format!("nginx in {name}"), || {
                self.exec(&name, &["curl", "-s", "--max-time", "1", &url])
                    .is_ok_and(|b| b.trim() == name)
            })?;
        }
        Ok(())
    }

    /// `build`, then `start_backends` and `route_backends_via_weir`: the
    /// topology of a nat test, its backends answering.
    fn with_nat_backends(method: &str, two_armed: bool) -> Result<Self, String> {
        let mut topo = Self::build(method, two_armed)?;
        topo.start_backends()?;
        topo.route_backends_via_weir()?;
        Ok(topo)
    }

    /// nat: the backends answer through weir.
    fn route_backends_via_weir(&self) -> Result<(), String> {
        for i in 1..=2 {
            let ns = self.ns(&format!("b{i}"));
            ip(&format!(
                "-n {ns} route add default via {}",
                V4.weir_backend_side
            ))?;
            ip(&format!(
                "-6 -n {ns} route add default via {}",
                V6.weir_backend_side
            ))?;
        }
        Ok(())
    }

    /// dr: each backend holds the VIP on its loopback and reaches the client
    /// on the shared segment; weir only rewrites the destination MAC.
    fn backends_hold_the_vip(&self) -> Result<(), String> {
        for i in 1..=2 {
            let ns = self.ns(&format!("b{i}"));
            for f in [&V4, &V6] {
                ip(&format!("-n {ns} addr add {}/{} dev lo", f.vip, f.host))?;
                let net = if f.plen == 24 {
                    "10.98.0.0/24"
                } else {
                    "fd98::/64"
                };
                ip(&format!("-n {ns} route add {net} dev eth0"))?;
                ip(&format!(
                    "-n {ns} neigh replace {} lladdr {MAC_CLIENT} dev eth0 nud permanent",
                    f.client
                ))?;
            }
        }
        Ok(())
    }

    /// weir in its namespace with `service` (a `[[service]]` table).
    fn start_weir(&mut self, service: &str, packet_extra: &str) -> Result<PathBuf, String> {
        let cfg = self.write_config(service, packet_extra)?;
        let log =
            std::fs::File::create(self.dir.path().join("weir.log")).map_err(|e| e.to_string())?;
        let child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.ns("lb"),
                env!("CARGO_BIN_EXE_weir"),
                "run",
                "--config",
            ])
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("weir: {e}"))?;
        self.children.push(child);
        let started = wait_for("weir's admin API", || {
            weir(&cfg, &["list", "--json"]).is_ok()
        });
        if let Err(e) = started {
            return Err(format!("{e}\nweir's log:\n{}", self.weir_log()));
        }
        Ok(cfg)
    }

    /// weir's config file (`start_weir` runs it; a reload re-reads it).
    fn write_config(&self, service: &str, packet_extra: &str) -> Result<PathBuf, String> {
        let dir = self.dir.path();
        let cfg = dir.join("weir.toml");
        std::fs::write(
            &cfg,
            format!(
                "[daemon]\nworkers = 1\n\n[admin]\nlisten = \"unix:{}/admin.sock\"\ntoken = \"packet-mode-test-token\"\n\n\
                 [packet]\ninterfaces = [{}]\n{packet_extra}\n\n{service}\n",
                dir.display(),
                self.interfaces
            ),
        )
        .map_err(|e| e.to_string())?;
        Ok(cfg)
    }

    fn weir_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("weir.log")).unwrap_or_default()
    }

    /// A router namespace ("rt") on the backends' bridge and a third backend
    /// ("b3") behind it, on a link whose router end has MTU 1280 while b3's
    /// end keeps 1500: b3 announces an MSS for 1500, so a full-size segment
    /// towards it reaches the router, which must answer the sender with
    /// ICMP "fragmentation needed" / ICMPv6 "packet too big". weir routes
    /// 10.97.0.0/24 and fd97::/64 via the router; the router's default
    /// route is weir (the nat backends' replies, and ICMP to the client).
    fn add_router_hop(&self) -> Result<(), String> {
        let (sw, w, rt, b3) = (self.ns("sw"), self.ns("lb"), self.ns("rt"), self.ns("b3"));
        for ns in [&rt, &b3] {
            ip(&format!("netns add {ns}"))?;
            ip(&format!("-n {ns} link set lo up"))?;
        }
        ip(&format!(
            "link add p9 netns {sw} type veth peer name eth0 netns {rt} address {MAC_ROUTER}"
        ))?;
        ip(&format!("-n {sw} link set p9 master br0 up"))?;
        ip(&format!(
            "link add eth1 netns {rt} address {MAC_ROUTER2} type veth peer name eth0 netns {b3} \
             address {MAC_B3}"
        ))?;
        ip(&format!("-n {rt} link set eth1 mtu 1280"))?;
        for (ns, dev, addrs) in [
            (&rt, "eth0", [ROUTER.0, ROUTER.1]),
            (&rt, "eth1", [ROUTER2.0, ROUTER2.1]),
            (&b3, "eth0", [B3.0, B3.1]),
        ] {
            for a in addrs {
                ip(&format!("-n {ns} addr add {a} dev {dev} nodad"))?;
            }
            ip(&format!("-n {ns} link set {dev} up"))?;
            run(&["ip", "netns", "exec", ns, "ethtool", "-K", dev, "tx", "off"])?;
        }
        for key in ["net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"] {
            self.exec("rt", &["sysctl", "-qw", &format!("{key}=1")])?;
        }
        let host = |cidr: &'static str| cidr.split('/').next().unwrap_or(cidr);
        for (fam, r, r2, net) in [
            (&V4, ROUTER.0, ROUTER2.0, "10.97.0.0/24"),
            (&V6, ROUTER.1, ROUTER2.1, "fd97::/64"),
        ] {
            let (r, r2) = (host(r), host(r2));
            ip(&format!("-n {w} route add {net} via {r}"))?;
            ip(&format!(
                "-n {w} neigh replace {r} lladdr {MAC_ROUTER} dev lb0 nud permanent"
            ))?;
            ip(&format!(
                "-n {rt} route add default via {}",
                fam.weir_backend_side
            ))?;
            ip(&format!(
                "-n {rt} neigh replace {} lladdr {MAC_WEIR} dev eth0 nud permanent",
                fam.weir_backend_side
            ))?;
            let b = if fam.plen == 24 {
                host(B3.0)
            } else {
                host(B3.1)
            };
            ip(&format!(
                "-n {rt} neigh replace {b} lladdr {MAC_B3} dev eth1 nud permanent"
            ))?;
            ip(&format!("-n {b3} route add default via {r2}"))?;
            ip(&format!(
                "-n {b3} neigh replace {r2} lladdr {MAC_ROUTER2} dev eth0 nud permanent"
            ))?;
        }
        Ok(())
    }

    /// `args` run in the namespace `name` (short name: "cl", "b1", ...).
    fn exec(&self, name: &str, args: &[&str]) -> Result<String, String> {
        let ns = self.ns(name);
        run(&[&["ip", "netns", "exec", ns.as_str()], args].concat())
    }

    /// `args` started in the namespace `name`, killed when the topology goes.
    fn spawn(&mut self, name: &str, args: &[&str]) -> Result<(), String> {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns(name)])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("{}: {e}", args.join(" ")))?;
        self.children.push(child);
        Ok(())
    }

    /// Waits until something in namespace `name` listens on `proto` ("t" or
    /// "u") port `port` (ss, iproute2).
    fn wait_listening(&self, name: &str, proto: &str, port: u16) -> Result<(), String> {
        let filter = format!("sport = :{port}");
        let flags = format!("-Hln{proto}");
        wait_for(
            &format!("a listener on {proto} port {port} in {name}"),
            || {
                self.exec(name, &["ss", &flags, &filter])
                    .is_ok_and(|o| !o.trim().is_empty())
            },
        )
    }

    /// An iperf3 server in namespace `name` on port 5201 of `bind`, or of
    /// every address. dr needs it bound to the VIP: a UDP server on the
    /// wildcard address answers from the interface's address (iperf3 picks
    /// no source), which the client does not take as the VIP's answer.
    fn start_iperf3(&mut self, name: &str, bind: Option<&str>) -> Result<(), String> {
        let mut args = vec!["iperf3", "-s", "-p", "5201"];
        if let Some(b) = bind {
            args.extend(["-B", b]);
        }
        self.spawn(name, &args)?;
        self.wait_listening(name, "t", 5201)
    }

    /// redis-server in each of the namespaces `names`, on every address,
    /// port 6379, nothing written to disk.
    fn start_redis(&mut self, names: &[&str]) -> Result<(), String> {
        let dir = self.dir.path().display().to_string();
        for name in names {
            self.spawn(
                name,
                &[
                    "redis-server",
                    "--port",
                    "6379",
                    "--bind",
                    "0.0.0.0",
                    "::",
                    "--protected-mode",
                    "no",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--daemonize",
                    "no",
                    "--dir",
                    &dir,
                ],
            )?;
            self.wait_listening(name, "t", 6379)?;
        }
        Ok(())
    }

    fn curl(&self, url: &str) -> Result<String, String> {
        self.exec("cl", &["curl", "-g", "-s", "--max-time", "3", url])
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Deleting a namespace destroys its veth ends (and their peers).
        for n in ["cl", "lb", "b1", "b2", "sw", "rt", "b3"] {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(n)])
                .output();
        }
    }
}

/// Polls `ok` every 50 ms for up to 10 s.
fn wait_for(what: &str, mut ok: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("{what}: not ready within 10 s"))
}

/// The weir CLI against the daemon of `cfg`.
fn weir(cfg: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .arg("--config")
        .arg(cfg)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// The weir CLI's `--json` output for `args`, parsed.
fn weir_json(cfg: &Path, args: &[&str]) -> Result<serde_json::Value, String> {
    serde_json::from_str(&weir(cfg, args)?).map_err(|e| e.to_string())
}

fn web_service(f: &Fam, forward: &str) -> String {
    let mut s = format!(
        "[[service]]\nname = \"web\"\nprotocol = \"tcp\"\nlisten = \"{}\"\nforward = \"{forward}\"\nscheduler = \"rr\"\n",
        f.ep(f.vip, 80)
    );
    for b in f.backends {
        s.push_str(&format!(
            "  [[service.backend]]\n  address = \"{}\"\n",
            f.ep(b, 80)
        ));
    }
    s
}

/// `web_service` with `extra` (lines of TOML) in its `[[service]]` table.
fn web_service_with(f: &Fam, forward: &str, extra: &str) -> String {
    web_service(f, forward).replacen(
        "scheduler = \"rr\"\n",
        &format!("scheduler = \"rr\"\n{extra}"),
        1,
    )
}

/// Ten requests through the VIP: every one answered, by both backends in
/// turn (rr); the flows are in weir's table and went through its packet
/// path.
fn requests_reach_both_backends(topo: &Topology, f: &Fam, cfg: &Path) -> Result<(), String> {
    let mut seen = Vec::new();
    for i in 0..10 {
        let body = topo
            .curl(&format!("http://{}/", f.ep(f.vip, 80)))
            .map_err(|e| format!("request {i}: {e}\nweir's log:\n{}", topo.weir_log()))?;
        seen.push(body.trim().to_owned());
    }
    for name in ["b1", "b2"] {
        let n = seen.iter().filter(|s| *s == name).count();
        if n != 5 {
            return Err(format!("rr: {name} answered {n} of 10: {seen:?}"));
        }
    }
    let conns = weir(cfg, &["conns", "--json"])?;
    let flows = conns.lines().filter(|l| l.contains(f.client)).count();
    if flows != 10 {
        return Err(format!(
            "weir conns lists {flows} flows from the client, want 10:\n{conns}"
        ));
    }
    // The frames went through weir's packet path: ten new flows, and (on
    // AF_XDP, which gets only what the steering program picks) every frame
    // it received was forwarded. An AF_PACKET ring sees the interface's
    // other traffic too (neighbour discovery...), counted and left alone.
    let stats = weir_json(cfg, &["stats", "--json"])?;
    let p = &stats["global"]["packet"];
    let all_forwarded = p["io"] != "xdp" || p["tx"] == p["rx"];
    if p["new_flows"] != 10 || p["tx"].as_u64() < Some(30) || !all_forwarded {
        return Err(format!("packet counters: {p} in {stats}"));
    }
    Ok(())
}

fn check(r: Result<(), String>) {
    if let Err(e) = r {
        panic!("{e}");
    }
}

/// One end-to-end run: topology, nginx, the method's own setup, weir, ten
/// requests; then every other client through the same weir (wrk, iperf3
/// TCP and UDP, redis-benchmark; each skipped with a message when its tool
/// is missing).
fn forwards(tag: &str, f: &Fam, forward: &str, packet_extra: &str) {
    forwards_on(tag, f, forward, packet_extra, false, true)
}

/// The clients a run can use besides curl, and the Debian package of each
/// tool they need.
const CLIENT_TOOLS: [(&str, &str); 4] = [
    ("wrk", "wrk"),
    ("iperf3", "iperf3"),
    ("redis-server", "redis-server"),
    ("redis-benchmark", "redis-tools"),
];

fn forwards_on(
    tag: &str,
    f: &Fam,
    forward: &str,
    packet_extra: &str,
    two_armed: bool,
    all_clients: bool,
) {
    if skip() {
        return;
    }
    let mut clients = Vec::new();
    if all_clients {
        for (tool, pkg) in CLIENT_TOOLS {
            if have(tool) {
                clients.push(tool);
            } else {
                eprintln!("skipped its {tool} part: needs {tool} (Debian package {pkg})");
            }
        }
    }
    let (iperf, redis) = (
        clients.contains(&"iperf3"),
        clients.contains(&"redis-server") && clients.contains(&"redis-benchmark"),
    );
    check((|| {
        let mut topo = Topology::build(tag, two_armed)?;
        topo.start_backends()?;
        match forward {
            "nat" => topo.route_backends_via_weir()?,
            "dr" => topo.backends_hold_the_vip()?,
            // fnat: no change on the backends; they answer weir's local address.
            _ => {}
        }
        let mut services = web_service(f, forward);
        if iperf {
            topo.start_iperf3("b1", (forward == "dr").then_some(f.vip))?;
            services.push_str(&iperf_services(f, forward, f.backends[0]));
        }
        if redis {
            topo.start_redis(&["b1", "b2"])?;
            // Like web (rr over both backends), on port 6379.
            services.push_str(
                &web_service(f, forward)
                    .replace("\"web\"", "\"redis\"")
                    .replace(":80\"", ":6379\""),
            );
        }
        let cfg = topo.start_weir(&services, packet_extra)?;
        requests_reach_both_backends(&topo, f, &cfg)?;
        if clients.contains(&"wrk") {
            wrk_through(&topo, f)?;
        }
        if iperf {
            iperf3_tcp_and_udp(&topo, f, &cfg)?;
        }
        if redis {
            redis_benchmark(&topo, f)?;
        }
        if !clients.is_empty() {
            // After all of them: on AF_XDP every frame weir got was forwarded.
            let stats = weir_json(&cfg, &["stats", "--json"])?;
            let p = &stats["global"]["packet"];
            if p["io"] == "xdp" && p["rx"] != p["tx"] {
                return Err(format!("packet counters after every client: {p}"));
            }
            // The per-worker breakdown names every worker and adds up to
            // the sums.
            let workers = p["workers"].as_array().cloned().unwrap_or_default();
            let per = |k: &str| workers.iter().filter_map(|w| w[k].as_u64()).sum::<u64>();
            let named = workers.iter().all(|w| {
                w["worker"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("weir-pkt-"))
            });
            if workers.is_empty()
                || !named
                || Some(per("rx")) != p["rx"].as_u64()
                || Some(per("tx")) != p["tx"].as_u64()
            {
                return Err(format!("per-worker packet counters: {p}"));
            }
        }
        if packet_extra.contains("afpacket") {
            let stats = weir(&cfg, &["stats"])?;
            if !stats.contains("packet mode (afpacket)") {
                return Err(format!("weir stats does not say AF_PACKET:\n{stats}"));
            }
        }
        Ok(())
    })());
}

#[test]
fn nat_v4() {
    forwards("nat4", &V4, "nat", "");
}

#[test]
fn nat_v6() {
    forwards("nat6", &V6, "nat", "");
}

#[test]
fn fnat_v4() {
    forwards(
        "fnat4",
        &V4,
        "fnat",
        &format!("local_addresses = [\"{}\"]", V4.weir_backend_side),
    );
}

#[test]
fn fnat_v6() {
    forwards(
        "fnat6",
        &V6,
        "fnat",
        &format!("local_addresses = [\"{}\"]", V6.weir_backend_side),
    );
}

#[test]
fn dr_v4() {
    forwards("dr4", &V4, "dr", "");
}

#[test]
fn dr_v6() {
    forwards("dr6", &V6, "dr", "");
}

/// The AF_PACKET path (`io = "afpacket"`, where XDP cannot attach): frames
/// read from a TPACKET_V3 ring and sent with sendmmsg.
#[test]
fn nat_v4_over_af_packet() {
    forwards_on("afp", &V4, "nat", "io = \"afpacket\"", false, false);
}

/// fnat over AF_PACKET: the kernel sees the backends' replies to the fnat
/// ports too; weir's nftables table keeps it from answering them with a RST.
#[test]
fn fnat_v4_over_af_packet() {
    forwards(
        "afpf",
        &V4,
        "fnat",
        &format!(
            "io = \"afpacket\"\nlocal_addresses = [\"{}\"]",
            V4.weir_backend_side
        ),
    );
}

/// An address added to weir's host after start is the kernel's: a nat
/// backend's answer to it (here curl from that address; in production a
/// health check) passes to the kernel instead of being taken by weir,
/// within the second in which weir reads the host's addresses again.
#[test]
fn an_address_added_after_start_stays_the_kernels() {
    if skip() {
        return;
    }
    check((|| {
        let mut topo = Topology::with_nat_backends("hosts", false)?;
        let cfg = topo.start_weir(&web_service(&V4, "nat"), "")?;
        requests_reach_both_backends(&topo, &V4, &cfg)?;
        let lb = topo.ns("lb");
        ip(&format!("-n {lb} addr add 10.99.0.50/24 dev lb0 nodad"))?;
        let url = format!("http://{}/", V4.backends[0]);
        wait_for("an answer to the new address", || {
            topo.exec(
                "lb",
                &[
                    "curl",
                    "-s",
                    "--max-time",
                    "1",
                    "--interface",
                    "10.99.0.50",
                    &url,
                ],
            )
            .is_ok_and(|b| b.trim() == "b1")
        })
        .map_err(|e| format!("{e}\nweir's log:\n{}", topo.weir_log()))
    })());
}

/// weir as a router: its backend-side interface (lb1) has MTU 1280, the
/// client's 1500. The backends' route back is clamped to 1280 too but
/// still advertises a 1500-byte MSS, so the client sends full-size
/// segments: weir must answer them with "fragmentation needed" / "packet
/// too big" for the client to lower its path MTU, or the upload stalls.
#[test]
fn uploads_complete_when_the_backend_link_has_a_smaller_mtu() {
    if skip() {
        return;
    }
    for f in [&V4, &V6] {
        let tag = if f.plen == 24 { "mtu4" } else { "mtu6" };
        check((|| {
            let mut topo = Topology::build(tag, true)?;
            topo.start_backends()?;
            let advmss = if f.plen == 24 { 1460 } else { 1440 };
            for i in 1..=2 {
                let ns = topo.ns(&format!("b{i}"));
                let six = if f.plen == 24 { "" } else { "-6 " };
                ip(&format!(
                    "{six}-n {ns} route add default via {} mtu lock 1280 advmss {advmss}",
                    f.weir_backend_side
                ))?;
            }
            ip(&format!("-n {} link set lb1 mtu 1280", topo.ns("lb")))?;
            let cfg = topo.start_weir(&web_service(f, "nat"), "")?;
            let body = topo.dir.path().join("upload");
            std::fs::write(&body, vec![b'x'; 300_000]).map_err(|e| e.to_string())?;
            let out = topo
                .exec(
                    "cl",
                    &[
                        "curl",
                        "-g",
                        "-s",
                        "--max-time",
                        "10",
                        "--data-binary",
                        &format!("@{}", body.display()),
                        &format!("http://{}/", f.ep(f.vip, 80)),
                    ],
                )
                .map_err(|e| format!("upload through a 1280 link: {e}"))?;
            if !out.starts_with('b') {
                return Err(format!("upload answered {out:?}"));
            }
            let stats = weir_json(&cfg, &["stats", "--json"])?;
            let p = &stats["global"]["packet"];
            if p["dropped"]["too_big"].as_u64().unwrap_or(0) == 0 {
                return Err(format!("no too_big answer counted: {p}"));
            }
            // The whole body went through weir to the backend.
            let list = weir_json(&cfg, &["list", "--stats", "--json"])?;
            let bytes_in = list[0]["inbytes"].as_u64().unwrap_or(0);
            if bytes_in < 300_000 {
                return Err(format!(
                    "only {bytes_in} bytes reached the backends: {list}"
                ));
            }
            Ok(())
        })());
    }
}

/// Two-armed: clients on lb0, backends on lb1 (two bridges, weir the only
/// path between them). Every frame is received on one interface and sent
/// from the other: the worker copies it between its two AF_XDP sockets.
#[test]
fn nat_v4_two_armed() {
    forwards_on("nat2", &V4, "nat", "", true, false);
}

#[test]
fn fnat_v6_two_armed() {
    forwards_on(
        "fnat2",
        &V6,
        "fnat",
        &format!("local_addresses = [\"{}\"]", V6.weir_backend_side),
        true,
        false,
    );
}

/// With `backend_interfaces = ["lb1"]`, a backend's "reply" forged on the
/// client side (lb0) is dropped and counted as `reply_interface`, while the
/// backends' real replies on lb1 still reach the clients. Without the key
/// the same frame is taken as the backend's and looked up (`no_flow` here;
/// sent to the client from the VIP if it names a live flow).
#[test]
fn a_reply_forged_on_the_client_side_is_dropped() {
    if skip() {
        return;
    }
    check((|| {
        let mut topo = Topology::with_nat_backends("spoof", true)?;
        let cfg = topo.start_weir(&web_service(&V4, "nat"), "backend_interfaces = [\"lb1\"]")?;
        requests_reach_both_backends(&topo, &V4, &cfg)?;
        // The spoofer, on the clients' segment, sends to an address routed
        // through weir, from backend b1's address and port.
        let cl = topo.ns("cl");
        let to = "10.98.0.99";
        ip(&format!(
            "-n {cl} route add {to}/32 via {}",
            V4.weir_client_side
        ))?;
        let dropped = |why: &str| -> Result<u64, String> {
            let stats = weir_json(&cfg, &["stats", "--json"])?;
            Ok(stats["global"]["packet"]["dropped"][why]
                .as_u64()
                .unwrap_or(0))
        };
        let (rx, no_flow) = (dropped("reply_interface")?, dropped("no_flow")?);
        send_forged_tcp(
            &cl,
            0x12, // SYN | ACK
            &[(
                format!("{}:80", V4.backends[0]).parse().unwrap(),
                format!("{to}:40000").parse().unwrap(),
            )],
        )?;
        wait_for("the forged reply to be counted", || {
            dropped("reply_interface").is_ok_and(|n| n > rx)
        })?;
        if dropped("reply_interface")? != rx + 1 || dropped("no_flow")? != no_flow {
            return Err(format!(
                "reply_interface {} (was {rx}), no_flow {} (was {no_flow})",
                dropped("reply_interface")?,
                dropped("no_flow")?
            ));
        }
        // Real replies still come back on lb1.
        requests_again(&topo)
    })());
}

/// Ten more requests through the v4 VIP, each answered.
fn requests_again(topo: &Topology) -> Result<(), String> {
    for i in 0..10 {
        topo.curl(&format!("http://{}/", V4.ep(V4.vip, 80)))
            .map_err(|e| format!("request {i} after the forged reply: {e}"))?;
    }
    Ok(())
}

/// A TCP segment with `flags` from each `(src, dst)` of `segs`, whatever
/// `src` is, sent from network namespace `ns` through a raw socket (the
/// kernel routes it by `dst` and does not check the source).
fn send_forged_tcp(
    ns: &str,
    flags: u8,
    segs: &[(std::net::SocketAddrV4, std::net::SocketAddrV4)],
) -> Result<(), String> {
    let pkts: Vec<_> = segs
        .iter()
        .map(|&(src, dst)| (forged_tcp(flags, src, dst), dst))
        .collect();
    in_netns(ns, move || {
        let s = raw_v4()?;
        for (pkt, dst) in &pkts {
            s.send_to(pkt, &std::net::SocketAddr::V4(*dst).into())
                .map_err(|e| format!("sending a forged segment: {e}"))?;
        }
        Ok(())
    })
    .join()
    .map_err(|_| "the sending thread panicked".to_owned())?
}

/// Runs `f` on a thread of its own in network namespace `ns`.
fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> std::thread::JoinHandle<Result<T, String>> {
    let ns = ns.to_owned();
    std::thread::spawn(move || {
        // setns(2) moves only this thread into the namespace.
        let file =
            std::fs::File::open(format!("/var/run/netns/{ns}")).map_err(|e| e.to_string())?;
        nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| e.to_string())?;
        f()
    })
}

/// A raw IPv4 socket whose caller writes the IP header (IPPROTO_RAW: the
/// kernel fills in its checksum).
fn raw_v4() -> Result<socket2::Socket, String> {
    socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::RAW,
        Some(socket2::Protocol::from(libc::IPPROTO_RAW)),
    )
    .map_err(|e| format!("raw socket: {e}"))
}

/// An IPv4 packet holding a TCP segment with `flags` from `src` to `dst`.
fn forged_tcp(flags: u8, src: std::net::SocketAddrV4, dst: std::net::SocketAddrV4) -> Vec<u8> {
    let mut tcp = vec![0u8; 20];
    tcp[0..2].copy_from_slice(&src.port().to_be_bytes());
    tcp[2..4].copy_from_slice(&dst.port().to_be_bytes());
    tcp[4..8].copy_from_slice(&7u32.to_be_bytes());
    tcp[8..12].copy_from_slice(&9u32.to_be_bytes());
    tcp[12] = 5 << 4;
    tcp[13] = flags;
    tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
    // The checksum over the pseudo-header and the segment (RFC 793).
    let mut sum: u32 = 0;
    let mut add = |b: &[u8]| {
        for w in b.chunks(2) {
            sum += u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]));
        }
    };
    add(&src.ip().octets());
    add(&dst.ip().octets());
    add(&[0, 6, 0, 20]);
    add(&tcp);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    tcp[16..18].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    let mut pkt = vec![0x45, 0, 0, 40, 0, 0, 0x40, 0, 64, 6, 0, 0];
    pkt.extend_from_slice(&src.ip().octets());
    pkt.extend_from_slice(&dst.ip().octets());
    pkt.extend_from_slice(&tcp);
    pkt
}

/// A spoofed SYN flood at a tenant's `max_connections` leaves room for
/// real clients. ~5,000 SYN/s from unanswerable addresses keep the
/// tenant's 40 places full of flows that never finish their handshake;
/// a real client's connection still gets through, its SYN taking an
/// embryonic flow's place (`Engine::early_drop`), and the ended flows are
/// counted as `early_drops`. Without the early drop, a place freed when a
/// flood flow timed out (SYN_RECV's 2 s, once a second) went to the next
/// flood SYN a few milliseconds later, and the client's SYNs were refused.
#[test]
fn a_spoofed_syn_flood_leaves_room_for_real_clients() {
    if skip() {
        return;
    }
    check((|| {
        let mut topo = Topology::with_nat_backends("synf", false)?;
        let service = format!(
            "[[tenant]]\nname = \"default\"\nmax_connections = 40\n\n{}",
            web_service(&V4, "nat")
        );
        let cfg = topo.start_weir(&service, "")?;
        requests_reach_both_backends(&topo, &V4, &cfg)?;
        let stats = || weir_json(&cfg, &["stats", "--json"]);
        let stop = Arc::new(AtomicBool::new(false));
        let flood = {
            let stop = Arc::clone(&stop);
            let vip: std::net::SocketAddrV4 = format!("{}:80", V4.vip).parse().unwrap();
            in_netns(&topo.ns("cl"), move || {
                let s = raw_v4()?;
                let started = Instant::now();
                let mut sent = 0u32;
                // 100 SYNs every 20 ms, each from an address and port of
                // its own, until told to stop (15 s at most).
                while !stop.load(SeqCst) && started.elapsed() < Duration::from_secs(15) {
                    for _ in 0..100 {
                        let [_, a, b, c] = sent.to_be_bytes();
                        let src = std::net::Ipv4Addr::new(10, 96 + (a & 1), b, c);
                        let src = std::net::SocketAddrV4::new(src, 20000 + (sent % 1000) as u16);
                        s.send_to(
                            &forged_tcp(0x02, src, vip),
                            &std::net::SocketAddr::V4(vip).into(),
                        )
                        .map_err(|e| format!("sending a spoofed SYN: {e}"))?;
                        sent += 1;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Ok(sent)
            })
        };
        let result = (|| {
            wait_for("the flood to fill the tenant's places", || {
                stats().is_ok_and(|s| s["tenants"][0]["active_conns"].as_u64() == Some(40))
            })?;
            // A real client, with time for two SYN retransmissions.
            let url = format!("http://{}/", V4.ep(V4.vip, 80));
            topo.exec("cl", &["curl", "-g", "-s", "--max-time", "5", &url])
                .map_err(|e| format!("a real client during the flood: {e}"))?;
            let drops = stats()?["global"]["packet"]["early_drops"]
                .as_u64()
                .unwrap_or(0);
            if drops == 0 {
                return Err("no early drop counted".to_owned());
            }
            Ok(())
        })();
        stop.store(true, SeqCst);
        let sent = flood
            .join()
            .map_err(|_| "the flood's thread panicked".to_owned())??;
        result.map_err(|e| {
            format!(
                "{e} ({sent} spoofed SYNs sent)\n{}",
                stats().unwrap_or_default()
            )
        })
    })());
}

fn skip() -> bool {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipped: {why}");
        return true;
    }
    false
}

/// Which backend answered each of `n` requests to the v4 VIP.
fn answers(topo: &Topology, n: usize) -> Result<Vec<String>, String> {
    (0..n)
        .map(|i| {
            topo.curl(&format!("http://{}/", V4.ep(V4.vip, 80)))
                .map(|b| b.trim().to_owned())
                .map_err(|e| format!("request {i}: {e}\nweir's log:\n{}", topo.weir_log()))
        })
        .collect()
}

/// Persistence (IPVS -p) in packet mode: every flow of a client goes to
/// the backend its first one got, through the same template as the proxy's.
#[test]
fn persistence_keeps_a_client_on_one_backend() {
    if skip() {
        return;
    }
    check((|| {
        let mut topo = Topology::with_nat_backends("persist", false)?;
        let svc = web_service_with(&V4, "nat", "persistence = \"60s\"\n");
        let _cfg = topo.start_weir(&svc, "")?;
        let seen = answers(&topo, 6)?;
        if seen.iter().any(|b| *b != seen[0]) {
            return Err(format!("persistence: one client spread over {seen:?}"));
        }
        Ok(())
    })());
}

/// A backend that stops answering health checks leaves the scheduler; with
/// `expire_nodest_conn` its flows end; new flows all go to the other one.
#[test]
fn a_failed_backend_leaves_and_its_flows_end() {
    if skip() {
        return;
    }
    check((|| {
        let mut topo = Topology::with_nat_backends("health", false)?;
        let svc = web_service_with(
            &V4,
            "nat",
            "expire_nodest_conn = true\n\
             health = { interval = \"200ms\", timeout = \"200ms\", rise = 1, fall = 1 }\n",
        );
        let cfg = topo.start_weir(&svc, "")?;
        let both = answers(&topo, 4)?;
        if !both.contains(&"b2".to_owned()) {
            return Err(format!("b2 never answered before its failure: {both:?}"));
        }
        // Stop b2's nginx (children: b1's nginx, b2's nginx, weir).
        let _ = topo.children[1].kill();
        let _ = topo.children[1].wait();
        wait_for("weir to mark b2 down", || {
            weir(&cfg, &["health"]).is_ok_and(|h| {
                h.lines()
                    .any(|l| l.contains(V4.backends[1]) && l.contains("down"))
            })
        })?;
        // b2's flows were ended (expire_nodest_conn).
        let conns = weir(&cfg, &["conns", "--json"])?;
        if conns.lines().any(|l| l.contains(V4.backends[1])) {
            return Err(format!("flows to the failed backend remain:\n{conns}"));
        }
        let after = answers(&topo, 4)?;
        if after.iter().any(|b| b != "b1") {
            return Err(format!("requests after b2 failed: {after:?}"));
        }
        Ok(())
    })());
}

/// `weir kill` ends packet flows (there is no task: the entry goes, with
/// its admission slot), and tenants are fenced: another tenant's service
/// and flows are neither listed nor killed, and deleting a tenant ends its
/// flows while the other's keep forwarding.
#[test]
fn kill_and_tenant_isolation() {
    if skip() {
        return;
    }
    check((|| {
        let mut topo = Topology::with_nat_backends("tenants", false)?;
        let vip2 = "10.99.1.101";
        ip(&format!(
            "-n {} route add {vip2}/32 via {}",
            topo.ns("cl"),
            V4.weir_client_side
        ))?;
        let a = web_service(&V4, "nat").replace("name = \"web\"", "tenant = \"a\"\nname = \"web\"");
        let b = web_service(&V4, "nat")
            .replace("name = \"web\"", "tenant = \"b\"\nname = \"web\"")
            .replace(V4.vip, vip2);
        let tenants =
            "[[tenant]]\nname = \"a\"\ntable_entries = 1024\n\n[[tenant]]\nname = \"b\"\n";
        let cfg = topo.start_weir(&format!("{a}\n{b}"), tenants)?;
        for vip in [V4.vip, vip2] {
            for _ in 0..3 {
                topo.curl(&format!("http://{vip}/"))?;
            }
        }
        let count = |args: &[&str]| -> Result<usize, String> {
            Ok(weir(&cfg, args)?
                .lines()
                .filter(|l| l.contains(V4.client))
                .count())
        };
        if (
            count(&["conns", "--json", "--tenant", "a"])?,
            count(&["conns", "--json", "--tenant", "b"])?,
        ) != (3, 3)
        {
            return Err(format!("per-tenant listings:\n{}", weir(&cfg, &["conns"])?));
        }
        weir(&cfg, &["kill", "--tenant", "a"])?;
        if (
            count(&["conns", "--json", "--tenant", "a"])?,
            count(&["conns", "--json", "--tenant", "b"])?,
        ) != (0, 3)
        {
            return Err(format!(
                "after killing tenant a's flows:\n{}",
                weir(&cfg, &["conns"])?
            ));
        }
        // a's service still forwards new flows; b's too.
        topo.curl(&format!("http://{}/", V4.vip))?;
        weir(&cfg, &["tenant", "del", "b"])?;
        if count(&["conns", "--json"])? != 1 {
            return Err(format!(
                "after deleting tenant b:\n{}",
                weir(&cfg, &["conns"])?
            ));
        }
        if topo.curl(&format!("http://{vip2}/")).is_ok() {
            return Err("tenant b's VIP still answers after its deletion".into());
        }
        topo.curl(&format!("http://{}/", V4.vip))?;
        Ok(())
    })());
}

/// Whether `tool` runs here (these tests skip without it, saying so).
fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok()
        || Command::new(tool).arg("-v").output().is_ok()
}

/// Bulk TCP and UDP through nat with iperf3 (its control connection is TCP,
/// its UDP test datagrams take the UDP service on the same VIP:port), and
/// many short HTTP connections with wrk (`Connection: close`).
#[test]
fn iperf3_and_wrk_through_nat() {
    if skip() {
        return;
    }
    for tool in ["iperf3", "wrk"] {
        if !have(tool) {
            eprintln!("skipped: needs {tool} (Debian package {tool})");
            return;
        }
    }
    check((|| {
        let mut topo = Topology::with_nat_backends("bulk", false)?;
        let b1 = V4.backends[0];
        topo.start_iperf3("b1", Some(b1))?;
        let services = web_service(&V4, "nat") + &iperf_services(&V4, "nat", b1);
        let cfg = topo.start_weir(&services, "")?;
        let tcp = iperf3_client(&topo, &V4, &["-t", "2"])?;
        let got = tcp["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
        if got < 1_000_000 {
            return Err(format!("iperf3 TCP moved {got} bytes"));
        }
        let udp = iperf3_client(&topo, &V4, &["-t", "2", "-u", "-b", "20M"])?;
        let sum = &udp["end"]["sum"];
        let (packets, lost) = (
            sum["packets"].as_u64().unwrap_or(0),
            sum["lost_packets"].as_u64().unwrap_or(u64::MAX),
        );
        if packets < 1000 || lost * 100 > packets {
            return Err(format!("iperf3 UDP: {packets} packets, {lost} lost"));
        }
        let url = format!("http://{}/", V4.vip);
        let out = topo.exec(
            "cl",
            &["wrk", "-t1", "-c8", "-d2s", "-H", "Connection: close", &url],
        )?;
        let requests = wrk_requests(&out);
        if requests < 100 || out.contains("Non-2xx") || out.contains("Socket errors") {
            return Err(format!("wrk through nat:\n{out}"));
        }
        let v = weir_json(&cfg, &["stats", "--json"])?;
        // Every frame weir received was forwarded, and connections made
        // flows. Flows may be fewer than wrk's connections: a client port
        // reused while its old flow is in TIME_WAIT takes that flow again,
        // as in IPVS, and `connect` draws from half the ephemeral range
        // (the even ports) first, so past ~14,000 connections (a quiet
        // machine does ~30,000 in the 2 s) ports repeat.
        let range = topo.exec("cl", &["cat", "/proc/sys/net/ipv4/ip_local_port_range"])?;
        let ports = match range
            .split_whitespace()
            .map(str::parse::<u64>)
            .collect::<Result<Vec<_>, _>>()
            .as_deref()
        {
            Ok([lo, hi]) if hi >= lo => hi - lo + 1,
            _ => return Err(format!("ip_local_port_range: {range:?}")),
        };
        let want = requests.min(ports / 2) / 2;
        let p = &v["global"]["packet"];
        if p["rx"] != p["tx"] || p["new_flows"].as_u64() < Some(want) {
            return Err(format!(
                "packet counters after iperf3 and {requests} wrk requests (want >= {want} \
                 new flows; {ports} ephemeral ports): {p}"
            ));
        }
        Ok(())
    })());
}

/// iperf3's TCP and UDP services on the VIP's port 5201, to `backend`.
fn iperf_services(f: &Fam, forward: &str, backend: &str) -> String {
    let mut s = String::new();
    for proto in ["tcp", "udp"] {
        s.push_str(&format!(
            "\n[[service]]\nname = \"iperf-{proto}\"\nprotocol = \"{proto}\"\nlisten = \"{}\"\n\
             forward = \"{forward}\"\n  [[service.backend]]\n  address = \"{}\"\n",
            f.ep(f.vip, 5201),
            f.ep(backend, 5201)
        ));
    }
    s
}

/// wrk for 1 s with `Connection: close` (a new flow per request): some
/// requests made, all answered 2xx, no socket error.
fn wrk_through(topo: &Topology, f: &Fam) -> Result<u64, String> {
    let url = format!("http://{}/", f.ep(f.vip, 80));
    let out = topo.exec(
        "cl",
        &[
            "timeout",
            "20",
            "wrk",
            "-t1",
            "-c8",
            "-d1s",
            "-H",
            "Connection: close",
            &url,
        ],
    )?;
    let requests = wrk_requests(&out);
    if requests == 0 || out.contains("Non-2xx") || out.contains("Socket errors") {
        return Err(format!(
            "wrk through {url}:\n{out}\nweir's log:\n{}",
            topo.weir_log()
        ));
    }
    Ok(requests)
}

/// The requests wrk's report (`out`) says it made; 0 if it says none.
fn wrk_requests(out: &str) -> u64 {
    out.lines()
        .find_map(|l| {
            l.trim()
                .split_once(" requests in ")
                .map(|(n, _)| n.trim().parse::<u64>())
        })
        .and_then(Result::ok)
        .unwrap_or(0)
}

/// The iperf3 client in the client namespace against the VIP's port 5201
/// (`--json`, bounded by `timeout`).
fn iperf3_client(topo: &Topology, f: &Fam, extra: &[&str]) -> Result<serde_json::Value, String> {
    let mut args = vec![
        "timeout",
        "30",
        "iperf3",
        "-c",
        f.vip,
        "-p",
        "5201",
        "--connect-timeout",
        "3000",
        "-J",
    ];
    args.extend_from_slice(extra);
    let out = topo
        .exec("cl", &args)
        .map_err(|e| format!("iperf3 {extra:?}: {e}\nweir's log:\n{}", topo.weir_log()))?;
    serde_json::from_str(&out).map_err(|e| format!("iperf3 {extra:?}: {e}: {out}"))
}

/// Datagrams dropped so far by queues that overflow when the machine is
/// too busy to drain them: the ones weir's packet sockets report (the
/// kernel's ring was full, or had no free frame), the UDP receive buffers
/// of the backend `b1` (iperf3's server not scheduled in time), and this
/// host's input backlogs (`/proc/net/softnet_stat`, all CPUs).
fn overflow_drops(topo: &Topology, cfg: &Path) -> Result<u64, String> {
    let stats = weir_json(cfg, &["stats", "--json"])?;
    let kernel: u64 = stats["global"]["packet"]["dropped"]
        .as_object()
        .map(|d| {
            d.iter()
                .filter(|(k, _)| k.starts_with("kernel_"))
                .filter_map(|(_, v)| v.as_u64())
                .sum()
        })
        .unwrap_or(0);
    // `Udp: ... RcvbufErrors ...` over a line of values (snmp), and
    // `Udp6RcvbufErrors N` (snmp6).
    let field = |text: &str, head: &str, name: &str| -> u64 {
        let mut lines = text.lines().filter(|l| l.starts_with(head));
        let (Some(names), Some(values)) = (lines.next(), lines.next()) else {
            return 0;
        };
        let i = names.split_whitespace().position(|n| n == name);
        i.and_then(|i| values.split_whitespace().nth(i)?.parse().ok())
            .unwrap_or(0)
    };
    let snmp = topo.exec("b1", &["cat", "/proc/net/snmp"])?;
    let snmp6 = topo
        .exec("b1", &["cat", "/proc/net/snmp6"])
        .unwrap_or_default();
    let rcvbuf = field(&snmp, "Udp:", "RcvbufErrors")
        + snmp6
            .lines()
            .find_map(|l| l.strip_prefix("Udp6RcvbufErrors"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
    let backlog: u64 = std::fs::read_to_string("/proc/net/softnet_stat")
        .map_err(|e| e.to_string())?
        .lines()
        .filter_map(|l| u64::from_str_radix(l.split_whitespace().nth(1)?, 16).ok())
        .sum();
    Ok(kernel + rcvbuf + backlog)
}

/// iperf3 TCP for 1 s, then UDP for 1 s at 20 Mbit/s, with the server's own
/// counts: the TCP bytes the server received, the UDP datagrams it
/// received and lost.
fn iperf3_tcp_and_udp(topo: &Topology, f: &Fam, cfg: &Path) -> Result<(), String> {
    let tcp = iperf3_client(topo, f, &["-t", "1"])?;
    let got = tcp["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
    if got < 1_000_000 {
        return Err(format!(
            "iperf3 TCP through {}: the server received {got} bytes",
            f.vip
        ));
    }
    let overflowed = overflow_drops(topo, cfg)?;
    let udp = iperf3_client(topo, f, &["-u", "-b", "20M", "-t", "1"])?;
    // `sum_received` is the server's count (iperf3 exchanges results at the
    // end), by the datagrams' sequence numbers: the highest seen and the
    // gaps below it (`lost_packets`). Datagrams still in flight when the
    // end-of-test message arrives are in neither, so the server's count is
    // compared with itself, not with the sender's; that weir dropped none
    // of what it got is the caller's rx = tx check.
    let end = &udp["end"];
    let (seen, lost) = (
        end["sum_received"]["packets"].as_u64().unwrap_or(0),
        end["sum_received"]["lost_packets"]
            .as_u64()
            .unwrap_or(u64::MAX),
    );
    // 20 Mbit/s of ~1,450-byte datagrams for 1 s is ~1,700 (fewer when a
    // loaded machine slows the sender); a veth path this slow loses none
    // unless something drops them (1% slack for a loaded machine's queues).
    if seen < 100 {
        return Err(format!(
            "iperf3 UDP through {}: the server saw {seen} datagrams: {end}",
            f.vip
        ));
    }
    if lost.saturating_mul(100) <= seen {
        return Ok(());
    }
    // More lost than that (seen with the 2 CPUs shared by other test
    // suites: 38 of 1,725 on AF_PACKET): only as many as queues that
    // overflowed meanwhile dropped, which weir's packet sockets publish
    // within a second.
    let unexplained = lost - seen / 100;
    let mut drops = 0;
    let explained = wait_for("the overflow counts", || {
        drops = overflow_drops(topo, cfg)
            .unwrap_or(0)
            .saturating_sub(overflowed);
        drops >= unexplained
    });
    explained.map_err(|_| {
        format!(
            "iperf3 UDP through {}: the server saw {seen} datagrams, {lost} lost, \
             {drops} dropped by full queues meanwhile: {end}",
            f.vip
        )
    })
}

/// redis-benchmark SET and GET against redis-server on both backends
/// through the VIP's port 6379: both complete and report requests/s.
fn redis_benchmark(topo: &Topology, f: &Fam) -> Result<(), String> {
    let out = topo
        .exec(
            "cl",
            &[
                "timeout",
                "30",
                "redis-benchmark",
                "-h",
                f.vip,
                "-p",
                "6379",
                "-n",
                "2000",
                "-t",
                "set,get",
                "-q",
            ],
        )
        .map_err(|e| format!("redis-benchmark: {e}\nweir's log:\n{}", topo.weir_log()))?;
    for test in ["SET", "GET"] {
        // "SET: 24390.24 requests per second, p50=..." after "\r" progress.
        let rps = out
            .split(['\r', '\n'])
            .find_map(|l| {
                l.trim()
                    .strip_prefix(&format!("{test}: "))?
                    .split_once(" requests per second")
                    .map(|(n, _)| n.trim().parse::<f64>())
            })
            .and_then(Result::ok)
            .unwrap_or(0.0);
        if rps <= 0.0 {
            return Err(format!("redis-benchmark {test} through {}:\n{out}", f.vip));
        }
    }
    Ok(())
}

/// wrr with weights 3:1. IPVS's wrr (crates/sched, `wrr_sequence_over_one_cycle_is_exact`)
/// repeats one sequence of 3 + 1 = 4 picks (b1 b1 b1 b2), so any 40
/// consecutive new flows hold exactly 10 whole cycles, whatever the
/// cursor's phase: 30 and 10, no tolerance needed. Each curl is a new flow
/// and nothing else asks the scheduler (no health checks, no persistence).
#[test]
fn wrr_splits_new_flows_by_weight() {
    if skip() {
        return;
    }
    check((|| {
        let mut topo = Topology::with_nat_backends("wrr", false)?;
        let mut svc = web_service(&V4, "nat").replace("\"rr\"", "\"wrr\"");
        for (b, w) in [(V4.backends[0], 3), (V4.backends[1], 1)] {
            let line = format!("address = \"{b}:80\"\n");
            svc = svc.replace(&line, &format!("{line}  weight = {w}\n"));
        }
        let cfg = topo.start_weir(&svc, "")?;
        let seen = answers(&topo, 40)?;
        let n = |name: &str| seen.iter().filter(|s| *s == name).count();
        if (n("b1"), n("b2")) != (30, 10) {
            return Err(format!(
                "wrr 3:1 over 40 new flows: b1 {}, b2 {}: {seen:?}\n{}",
                n("b1"),
                n("b2"),
                weir(&cfg, &["list"])?
            ));
        }
        Ok(())
    })());
}

/// Path MTU through a router hop: an 8 MB upload from the client to b3
/// (behind a router whose link towards b3 has MTU 1280) through weir. The
/// client's full-size segments (DF set) are refused by the router; its
/// ICMP error quotes the packet weir rewrote, reaches weir and must be
/// translated back to the client's view (the VIP), or the upload stalls.
fn path_mtu_through(tag: &str, f: &Fam, forward: &str, packet_extra: &str) {
    if skip() {
        return;
    }
    if !have("iperf3") {
        eprintln!("skipped: needs iperf3 (Debian package iperf3)");
        return;
    }
    let redis = have("redis-server") && have("redis-cli");
    if !redis {
        eprintln!(
            "skipped its redis part: needs redis-server and redis-cli (redis-server, redis-tools)"
        );
    }
    check((|| {
        let mut topo = Topology::build(tag, false)?;
        topo.add_router_hop()?;
        topo.start_iperf3("b3", None)?;
        let b3 = if f.plen == 24 { B3.0 } else { B3.1 };
        let b3 = b3.split('/').next().unwrap_or(b3);
        let mut services = iperf_services(f, forward, b3);
        if redis {
            topo.start_redis(&["b3"])?;
            services.push_str(&format!(
                "\n[[service]]\nname = \"redis\"\nprotocol = \"tcp\"\nlisten = \"{}\"\n\
                 forward = \"{forward}\"\n  [[service.backend]]\n  address = \"{}\"\n",
                f.ep(f.vip, 6379),
                f.ep(b3, 6379)
            ));
        }
        let cfg = topo.start_weir(&services, packet_extra)?;
        let context = |topo: &Topology| {
            format!(
                "the client's route: {}\nweir's stats: {}\nweir's log:\n{}",
                topo.exec("cl", &["ip", "route", "get", f.vip])
                    .unwrap_or_else(|e| e)
                    .trim(),
                weir(&cfg, &["stats", "--json"]).unwrap_or_else(|e| e),
                topo.weir_log()
            )
        };
        // First (while the client still assumes MTU 1500): an 8 MiB value
        // stored in redis on b3, whose own count of the bytes it got is
        // the proof that the whole upload arrived.
        if redis {
            let size = 8 << 20;
            let value = topo.dir.path().join("value");
            std::fs::write(&value, vec![b'x'; size]).map_err(|e| e.to_string())?;
            let stdin = std::fs::File::open(&value).map_err(|e| e.to_string())?;
            let out = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &topo.ns("cl"),
                    "timeout",
                    "20",
                    "redis-cli",
                ])
                .args(["-h", f.vip, "-p", "6379", "-x", "set", "big"])
                .stdin(stdin)
                .output()
                .map_err(|e| format!("redis-cli: {e}"))?;
            let len = topo.exec(
                "cl",
                &[
                    "timeout",
                    "5",
                    "redis-cli",
                    "-h",
                    f.vip,
                    "-p",
                    "6379",
                    "strlen",
                    "big",
                ],
            );
            if !out.status.success() || len.as_deref().map(str::trim) != Ok(&size.to_string()) {
                return Err(format!(
                    "8 MiB upload to redis through the router hop: {} {}, strlen {len:?}\n{}",
                    out.status,
                    String::from_utf8_lossy(&out.stdout).trim(),
                    context(&topo)
                ));
            }
        }
        // The client learnt the path's MTU for the VIP (from the
        // translated ICMP error: nothing else tells it).
        let route = topo.exec("cl", &["ip", "route", "get", f.vip])?;
        if redis && !route.contains("mtu 1280") {
            return Err(format!(
                "the client's route to the VIP has no learnt MTU\n{}",
                context(&topo)
            ));
        }
        // iperf3 uploading 8 MiB completes (bounded: `timeout` 30 s). Its
        // server's byte count is not the proof: it stops counting at the
        // client's end-of-test message, which can overtake data still
        // queued, so the sender's count is what is checked here.
        let started = Instant::now();
        let up = iperf3_client(&topo, f, &["-n", "8M"])?;
        let sent = up["end"]["sum_sent"]["bytes"].as_u64().unwrap_or(0);
        // (-n rounds up to whole 128 KiB writes: at least 8 MiB.)
        if sent < 8 << 20 {
            return Err(format!(
                "iperf3 upload through the router hop: sent {sent} bytes in {:?}\n{}",
                started.elapsed(),
                context(&topo)
            ));
        }
        if !topo
            .exec("cl", &["ip", "route", "get", f.vip])?
            .contains("mtu 1280")
        {
            return Err(format!(
                "the client's route to the VIP has no learnt MTU\n{}",
                context(&topo)
            ));
        }
        let stats = weir_json(&cfg, &["stats", "--json"])?;
        let p = &stats["global"]["packet"];
        if p["icmp_errors"].as_u64().unwrap_or(0) == 0 {
            return Err(format!("no translated ICMP error counted: {p}"));
        }
        eprintln!(
            "8 MB upload through the MTU-1280 hop in {:?}",
            started.elapsed()
        );
        Ok(())
    })());
}

#[test]
fn path_mtu_nat_v4() {
    path_mtu_through("pmtu4", &V4, "nat", "");
}

#[test]
fn path_mtu_nat_v6() {
    path_mtu_through("pmtu6", &V6, "nat", "");
}

#[test]
fn path_mtu_fnat_v4() {
    path_mtu_through(
        "pmtuf4",
        &V4,
        "fnat",
        &format!("local_addresses = [\"{}\"]", V4.weir_backend_side),
    );
}

#[test]
fn path_mtu_fnat_v6() {
    path_mtu_through(
        "pmtuf6",
        &V6,
        "fnat",
        &format!("local_addresses = [\"{}\"]", V6.weir_backend_side),
    );
}

/// A TCP flow through nat keeps going while the service is edited at
/// runtime (a backend added, the scheduler changed) and the config is
/// reloaded with a changed weight and scheduler: iperf3 finishes with every
/// byte it sent received, and no frame of it was dropped as `no_flow`.
/// Meanwhile `weir stats table` shows the tenant's table holding exactly
/// the live flows `weir conns` lists.
#[test]
fn runtime_edits_and_reload_keep_a_live_flow() {
    if skip() {
        return;
    }
    if !have("iperf3") {
        eprintln!("skipped: needs iperf3 (Debian package iperf3)");
        return;
    }
    check((|| {
        let mut topo = Topology::with_nat_backends("edits", false)?;
        topo.start_iperf3("b1", None)?;
        let services = format!(
            "{}{}",
            web_service(&V4, "nat"),
            iperf_services(&V4, "nat", V4.backends[0])
        );
        let cfg = topo.start_weir(&services, "")?;
        // 4 s paced at 50 Mbit/s: long enough for the edits below.
        let out_path = topo.dir.path().join("iperf3.json");
        let out = std::fs::File::create(&out_path).map_err(|e| e.to_string())?;
        let child = Command::new("ip")
            .args(["netns", "exec", &topo.ns("cl"), "timeout", "30", "iperf3"])
            .args(["-c", V4.vip, "-p", "5201", "-t", "4", "-b", "50M", "-J"])
            .stdout(out)
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("iperf3 -c: {e}"))?;
        topo.children.push(child);
        let client = topo.children.len() - 1;
        let flows = || -> Result<usize, String> {
            Ok(weir(&cfg, &["conns", "--json"])?
                .lines()
                .filter(|l| l.contains(":5201"))
                .count())
        };
        // iperf3's control and data connections.
        wait_for("iperf3's two flows", || flows().is_ok_and(|n| n == 2))?;
        let mut last = String::new();
        wait_for("weir stats table to show the live flows", || {
            let before = flows();
            let table = weir(&cfg, &["stats", "table", "--json"]).unwrap_or_default();
            let after = flows();
            let entries = serde_json::from_str::<serde_json::Value>(&table)
                .ok()
                .and_then(|t| {
                    t.as_array()?.iter().find(|r| r["tenant"] == "default")?["entries"].as_u64()
                });
            last = table;
            matches!((before, after, entries), (Ok(b), Ok(a), Some(e)) if b == a && e == b as u64)
        })
        .map_err(|e| format!("{e}: {last}"))?;
        let b2 = format!("{}:5201", V4.backends[1]);
        weir(&cfg, &["backend", "add", "iperf-tcp", &b2])?;
        weir(
            &cfg,
            &["service", "edit", "iperf-tcp", "--scheduler", "wlc"],
        )?;
        // The file now: both backends, b1 weighted 2, scheduler lc.
        let edited = services.replacen(
            &format!("  address = \"{}:5201\"\n", V4.backends[0]),
            &format!("  address = \"{}:5201\"\n  weight = 2\n  [[service.backend]]\n  address = \"{b2}\"\n", V4.backends[0]),
            1,
        );
        let edited = edited.replacen(
            "name = \"iperf-tcp\"\n",
            "name = \"iperf-tcp\"\nscheduler = \"lc\"\n",
            1,
        );
        topo.write_config(&edited, "")?;
        let reloaded = weir(&cfg, &["reload"])?;
        if !reloaded.contains("iperf-tcp") {
            return Err(format!("the reload did not change iperf-tcp:\n{reloaded}"));
        }
        let listed = weir(&cfg, &["list"])?;
        if !listed.contains(" lc ") || !listed.contains(&b2) {
            return Err(format!("after the reload:\n{listed}"));
        }
        // The edits happened while the flow was live.
        if topo.children[client]
            .try_wait()
            .map_err(|e| e.to_string())?
            .is_some()
        {
            return Err("iperf3 ended before the edits were done".into());
        }
        let mut status = None;
        let deadline = Instant::now() + Duration::from_secs(20);
        while status.is_none() && Instant::now() < deadline {
            status = topo.children[client]
                .try_wait()
                .map_err(|e| e.to_string())?;
            std::thread::sleep(Duration::from_millis(50));
        }
        let json = std::fs::read_to_string(&out_path).map_err(|e| e.to_string())?;
        if !status.is_some_and(|s| s.success()) {
            return Err(format!(
                "iperf3 ({status:?}):\n{json}\nweir's log:\n{}",
                topo.weir_log()
            ));
        }
        let v: serde_json::Value =
            serde_json::from_str(&json).map_err(|e| format!("{e}: {json}"))?;
        let (sent, received) = (
            v["end"]["sum_sent"]["bytes"].as_u64().unwrap_or(0),
            v["end"]["sum_received"]["bytes"]
                .as_u64()
                .unwrap_or(u64::MAX),
        );
        if sent < 10_000_000 || sent != received {
            return Err(format!(
                "iperf3 across the edits: sent {sent}, received {received}"
            ));
        }
        let stats = weir_json(&cfg, &["stats", "--json"])?;
        let p = &stats["global"]["packet"];
        if p["dropped"]["no_flow"].as_u64().unwrap_or(0) != 0 || p["rx"] != p["tx"] {
            return Err(format!("frames of the live flow were not forwarded: {p}"));
        }
        Ok(())
    })());
}

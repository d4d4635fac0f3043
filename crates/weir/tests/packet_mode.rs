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
//! One L2 segment, two subnets: weir is "one-armed" (IPVS's usual NAT
//! deployment on a flat network), the VIP 10.99.1.100 is routed to it, and
//! for nat the backends' default route points at it so their replies come
//! back through it. Neighbours are static (`ip neigh ... permanent`) so a
//! test never waits on ARP.
//!
//! Needs root, iproute2, ethtool, nginx and curl, and a weir built with its
//! XDP program; without them each test prints why and returns.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const VIP: &str = "10.99.1.100";
const CLIENT: &str = "10.98.0.10";
const WEIR_CLIENT_SIDE: &str = "10.98.0.1";
const WEIR_BACKEND_SIDE: &str = "10.99.0.1";
const BACKENDS: [&str; 2] = ["10.99.0.2", "10.99.0.3"];

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

/// The namespaces and links; everything removed on drop, also on failure.
struct Topology {
    tag: String,
    dir: tempfile::TempDir,
    children: Vec<Child>,
}

impl Topology {
    fn ns(&self, name: &str) -> String {
        format!("{}{}", name, self.tag)
    }

    fn new(method: &str) -> Result<Self, String> {
        let tag = format!("-{}-{}", std::process::id() % 100_000, method);
        let topo = Topology {
            tag,
            dir: tempfile::tempdir().map_err(|e| e.to_string())?,
            children: Vec::new(),
        };
        let (sw, c, w) = (topo.ns("sw"), topo.ns("cl"), topo.ns("lb"));
        let bs: Vec<String> = (1..=BACKENDS.len())
            .map(|i| topo.ns(&format!("b{i}")))
            .collect();
        for ns in [&sw, &c, &w].into_iter().chain(&bs) {
            run(&["ip", "netns", "add", ns])?;
            run(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        }
        run(&["ip", "-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        run(&["ip", "-n", &sw, "link", "set", "br0", "up"])?;
        // (namespace, device, MAC, addresses)
        let mut ends = vec![
            (
                c.clone(),
                "eth0",
                "02:00:00:00:00:0a",
                vec![format!("{CLIENT}/24")],
            ),
            (
                w.clone(),
                "lb0",
                "02:00:00:00:00:01",
                vec![
                    format!("{WEIR_CLIENT_SIDE}/24"),
                    format!("{WEIR_BACKEND_SIDE}/24"),
                ],
            ),
        ];
        for (i, b) in bs.iter().enumerate() {
            ends.push((
                b.clone(),
                "eth0",
                ["02:00:00:00:00:02", "02:00:00:00:00:03"][i],
                vec![format!("{}/24", BACKENDS[i])],
            ));
        }
        for (i, (ns, dev, mac, addrs)) in ends.iter().enumerate() {
            let port = format!("p{i}");
            let queues = if *dev == "lb0" { "2" } else { "1" };
            run(&[
                "ip",
                "link",
                "add",
                &port,
                "netns",
                &sw,
                "type",
                "veth",
                "peer",
                "name",
                dev,
                "netns",
                ns,
                "address",
                mac,
                "numrxqueues",
                queues,
                "numtxqueues",
                queues,
            ])?;
            run(&["ip", "-n", &sw, "link", "set", &port, "master", "br0", "up"])?;
            for a in addrs {
                run(&["ip", "-n", ns, "addr", "add", a, "dev", dev])?;
            }
            run(&["ip", "-n", ns, "link", "set", dev, "up"])?;
            // Full checksums on what the test's kernels send (a veth
            // otherwise leaves them partial, to be finished by an offload
            // that an AF_XDP frame never reaches).
            run(&["ip", "netns", "exec", ns, "ethtool", "-K", dev, "tx", "off"])?;
        }
        // The client reaches the VIP through weir.
        run(&[
            "ip",
            "-n",
            &c,
            "route",
            "add",
            &format!("{VIP}/32"),
            "via",
            WEIR_CLIENT_SIDE,
        ])?;
        // Static neighbours: weir knows everyone; everyone knows weir.
        for (ns, _, mac, addrs) in &ends {
            let ip = addrs[0].split('/').next().unwrap();
            if *ns != w {
                run(&[
                    "ip",
                    "-n",
                    &w,
                    "neigh",
                    "replace",
                    ip,
                    "lladdr",
                    mac,
                    "dev",
                    "lb0",
                    "nud",
                    "permanent",
                ])?;
                let (gw, dev) = (
                    if *ns == c {
                        WEIR_CLIENT_SIDE
                    } else {
                        WEIR_BACKEND_SIDE
                    },
                    "eth0",
                );
                run(&[
                    "ip",
                    "-n",
                    ns,
                    "neigh",
                    "replace",
                    gw,
                    "lladdr",
                    "02:00:00:00:00:01",
                    "dev",
                    dev,
                    "nud",
                    "permanent",
                ])?;
            }
        }
        Ok(topo)
    }

    /// nginx in each backend namespace answering its own name.
    fn start_backends(&mut self) -> Result<(), String> {
        for (i, ip) in BACKENDS.iter().enumerate() {
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
                     server {{ listen 80; location / {{ return 200 \"{name}\\n\"; }} }} }}\n"
                ),
            )
            .map_err(|e| e.to_string())?;
            let child = Command::new("ip")
                .args(["netns", "exec", &self.ns(&name), "nginx", "-c"])
                .arg(&conf)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("nginx: {e}"))?;
            self.children.push(child);
            let url = format!("http://{ip}/");
            wait_for(&format!("nginx in {name}"), || {
                run(&[
                    "ip",
                    "netns",
                    "exec",
                    &self.ns(&name),
                    "curl",
                    "-s",
                    "--max-time",
                    "1",
                    &url,
                ])
                .is_ok_and(|b| b.trim() == name)
            })?;
        }
        Ok(())
    }

    /// nat: the backends answer through weir.
    fn route_backends_via_weir(&self) -> Result<(), String> {
        for i in 1..=BACKENDS.len() {
            run(&[
                "ip",
                "-n",
                &self.ns(&format!("b{i}")),
                "route",
                "add",
                "default",
                "via",
                WEIR_BACKEND_SIDE,
            ])?;
        }
        Ok(())
    }

    /// weir in its namespace with `service` (a `[[service]]` table).
    fn start_weir(&mut self, service: &str, packet_extra: &str) -> Result<PathBuf, String> {
        let dir = self.dir.path();
        let cfg = dir.join("weir.toml");
        std::fs::write(
            &cfg,
            format!(
                "[daemon]\nworkers = 1\n\n[admin]\nlisten = \"unix:{}/admin.sock\"\ntoken = \"packet-mode-test-token\"\n\n\
                 [packet]\ninterfaces = [\"lb0\"]\n{packet_extra}\n\n{service}\n",
                dir.display()
            ),
        )
        .map_err(|e| e.to_string())?;
        let log = std::fs::File::create(dir.join("weir.log")).map_err(|e| e.to_string())?;
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

    fn weir_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("weir.log")).unwrap_or_default()
    }

    fn curl(&self, url: &str) -> Result<String, String> {
        run(&[
            "ip",
            "netns",
            "exec",
            &self.ns("cl"),
            "curl",
            "-s",
            "--max-time",
            "3",
            url,
        ])
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Deleting a namespace destroys its veth ends (and their peers).
        for n in ["cl", "lb", "b1", "b2", "sw"] {
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

fn web_service(forward: &str) -> String {
    let mut s = format!(
        "[[service]]\nname = \"web\"\nprotocol = \"tcp\"\nlisten = \"{VIP}:80\"\nforward = \"{forward}\"\nscheduler = \"rr\"\n"
    );
    for b in BACKENDS {
        s.push_str(&format!("  [[service.backend]]\n  address = \"{b}:80\"\n"));
    }
    s
}

/// Ten requests through the VIP: every one answered, by both backends in
/// turn (rr), and the flows are in weir's table with the right backend.
fn requests_reach_both_backends(topo: &Topology, cfg: &Path) -> Result<(), String> {
    let mut seen = Vec::new();
    for i in 0..10 {
        let body = topo
            .curl(&format!("http://{VIP}/"))
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
    let flows = conns.lines().filter(|l| l.contains(CLIENT)).count();
    if flows != 10 {
        return Err(format!(
            "weir conns lists {flows} flows from the client, want 10:\n{conns}"
        ));
    }
    // The frames went through weir's packet path: ten new flows, and every
    // frame it received was forwarded (nothing dropped on the way).
    let stats: serde_json::Value =
        serde_json::from_str(&weir(cfg, &["stats", "--json"])?).map_err(|e| e.to_string())?;
    let p = &stats["global"]["packet"];
    // AF_XDP gets only what the steering program picks; an AF_PACKET ring
    // sees the interface's other traffic too (neighbour discovery...),
    // which weir counts and leaves to the kernel.
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

#[test]
fn nat_forwards_http_to_nginx_and_back() {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipped: {why}");
        return;
    }
    check((|| {
        let mut topo = Topology::new("nat")?;
        topo.start_backends()?;
        topo.route_backends_via_weir()?;
        let cfg = topo.start_weir(&web_service("nat"), "")?;
        requests_reach_both_backends(&topo, &cfg)
    })());
}

#[test]
fn fnat_forwards_without_backend_routes() {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipped: {why}");
        return;
    }
    check((|| {
        let mut topo = Topology::new("fnat")?;
        topo.start_backends()?;
        // No route change on the backends: they answer weir's local address.
        let cfg = topo.start_weir(
            &web_service("fnat"),
            &format!("local_addresses = [\"{WEIR_BACKEND_SIDE}\"]"),
        )?;
        requests_reach_both_backends(&topo, &cfg)
    })());
}

#[test]
fn dr_backends_answer_clients_directly() {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipped: {why}");
        return;
    }
    check((|| {
        let mut topo = Topology::new("dr")?;
        topo.start_backends()?;
        // Each backend holds the VIP on its loopback and reaches the client
        // on the shared segment; weir only rewrites the destination MAC.
        for i in 1..=BACKENDS.len() {
            let ns = topo.ns(&format!("b{i}"));
            run(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{VIP}/32"),
                "dev",
                "lo",
            ])?;
            run(&[
                "ip",
                "-n",
                &ns,
                "route",
                "add",
                "10.98.0.0/24",
                "dev",
                "eth0",
            ])?;
            run(&[
                "ip",
                "-n",
                &ns,
                "neigh",
                "replace",
                CLIENT,
                "lladdr",
                "02:00:00:00:00:0a",
                "dev",
                "eth0",
                "nud",
                "permanent",
            ])?;
        }
        let cfg = topo.start_weir(&web_service("dr"), "")?;
        requests_reach_both_backends(&topo, &cfg)
    })());
}

/// The AF_PACKET path (`io = "afpacket"`, where XDP cannot attach): the same
/// nat service, frames read from a TPACKET_V3 ring and sent with sendmmsg.
#[test]
fn nat_over_af_packet() {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipped: {why}");
        return;
    }
    check((|| {
        let mut topo = Topology::new("afp")?;
        topo.start_backends()?;
        topo.route_backends_via_weir()?;
        let cfg = topo.start_weir(&web_service("nat"), "io = \"afpacket\"")?;
        requests_reach_both_backends(&topo, &cfg)?;
        let stats = weir(&cfg, &["stats"])?;
        if !stats.contains("packet mode (afpacket)") {
            return Err(format!("weir stats does not say AF_PACKET:\n{stats}"));
        }
        Ok(())
    })());
}

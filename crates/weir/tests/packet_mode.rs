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
//! Needs root, iproute2, ethtool, nginx and curl, and a weir built with its
//! XDP program; without them each test prints why and returns.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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
            let child = Command::new("ip")
                .args(["netns", "exec", &self.ns(&name), "nginx", "-c"])
                .arg(&conf)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("nginx: {e}"))?;
            self.children.push(child);
            let ns = self.ns(&name);
            let url = format!("http://{addr}/");
            wait_for(&format!("nginx in {name}"), || {
                run(&[
                    "ip",
                    "netns",
                    "exec",
                    &ns,
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
            "-g",
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
    let stats: serde_json::Value =
        serde_json::from_str(&weir(cfg, &["stats", "--json"])?).map_err(|e| e.to_string())?;
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
/// requests.
fn forwards(tag: &str, f: &Fam, forward: &str, packet_extra: &str) {
    forwards_on(tag, f, forward, packet_extra, false)
}

fn forwards_on(tag: &str, f: &Fam, forward: &str, packet_extra: &str, two_armed: bool) {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipped: {why}");
        return;
    }
    check((|| {
        let mut topo = Topology::build(tag, two_armed)?;
        topo.start_backends()?;
        match forward {
            "nat" => topo.route_backends_via_weir()?,
            "dr" => topo.backends_hold_the_vip()?,
            // fnat: no change on the backends; they answer weir's local address.
            _ => {}
        }
        let cfg = topo.start_weir(&web_service(f, forward), packet_extra)?;
        requests_reach_both_backends(&topo, f, &cfg)?;
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
    forwards("afp", &V4, "nat", "io = \"afpacket\"");
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
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipped: {why}");
        return;
    }
    check((|| {
        let mut topo = Topology::build("hosts", false)?;
        topo.start_backends()?;
        topo.route_backends_via_weir()?;
        let cfg = topo.start_weir(&web_service(&V4, "nat"), "")?;
        requests_reach_both_backends(&topo, &V4, &cfg)?;
        let lb = topo.ns("lb");
        ip(&format!("-n {lb} addr add 10.99.0.50/24 dev lb0 nodad"))?;
        let url = format!("http://{}/", V4.backends[0]);
        wait_for("an answer to the new address", || {
            run(&[
                "ip",
                "netns",
                "exec",
                &lb,
                "curl",
                "-s",
                "--max-time",
                "1",
                "--interface",
                "10.99.0.50",
                &url,
            ])
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
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipped: {why}");
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
            let out = run(&[
                "ip",
                "netns",
                "exec",
                &topo.ns("cl"),
                "curl",
                "-g",
                "-s",
                "--max-time",
                "10",
                "--data-binary",
                &format!("@{}", body.display()),
                &format!("http://{}/", f.ep(f.vip, 80)),
            ])
            .map_err(|e| format!("upload through a 1280 link: {e}"))?;
            if !out.starts_with('b') {
                return Err(format!("upload answered {out:?}"));
            }
            let stats: serde_json::Value = serde_json::from_str(&weir(&cfg, &["stats", "--json"])?)
                .map_err(|e| e.to_string())?;
            let p = &stats["global"]["packet"];
            if p["dropped"]["too_big"].as_u64().unwrap_or(0) == 0 {
                return Err(format!("no too_big answer counted: {p}"));
            }
            // The whole body went through weir to the backend.
            let list: serde_json::Value =
                serde_json::from_str(&weir(&cfg, &["list", "--stats", "--json"])?)
                    .map_err(|e| e.to_string())?;
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
    forwards_on("nat2", &V4, "nat", "", true);
}

#[test]
fn fnat_v6_two_armed() {
    forwards_on(
        "fnat2",
        &V6,
        "fnat",
        &format!("local_addresses = [\"{}\"]", V6.weir_backend_side),
        true,
    );
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
        let mut topo = Topology::build("persist", false)?;
        topo.start_backends()?;
        topo.route_backends_via_weir()?;
        let svc = web_service(&V4, "nat").replace(
            "scheduler = \"rr\"\n",
            "scheduler = \"rr\"\npersistence = \"60s\"\n",
        );
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
        let mut topo = Topology::build("health", false)?;
        topo.start_backends()?;
        topo.route_backends_via_weir()?;
        let svc = web_service(&V4, "nat").replace(
            "scheduler = \"rr\"\n",
            "scheduler = \"rr\"\nexpire_nodest_conn = true\n\
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
        let mut topo = Topology::build("tenants", false)?;
        topo.start_backends()?;
        topo.route_backends_via_weir()?;
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
        let mut topo = Topology::build("bulk", false)?;
        topo.start_backends()?;
        topo.route_backends_via_weir()?;
        let b1 = V4.backends[0];
        let iperf = Command::new("ip")
            .args([
                "netns",
                "exec",
                &topo.ns("b1"),
                "iperf3",
                "-s",
                "-B",
                b1,
                "-p",
                "5201",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("iperf3 -s: {e}"))?;
        topo.children.push(iperf);
        let mut services = web_service(&V4, "nat");
        for proto in ["tcp", "udp"] {
            services.push_str(&format!(
                "\n[[service]]\nname = \"iperf-{proto}\"\nprotocol = \"{proto}\"\nlisten = \"{}:5201\"\n\
                 forward = \"nat\"\n  [[service.backend]]\n  address = \"{b1}:5201\"\n",
                V4.vip
            ));
        }
        let cfg = topo.start_weir(&services, "")?;
        let cl = topo.ns("cl");
        let iperf3 = |extra: &[&str]| -> Result<serde_json::Value, String> {
            let mut args = vec![
                "netns", "exec", &cl, "iperf3", "-c", V4.vip, "-p", "5201", "-t", "2", "-J",
            ];
            args.extend_from_slice(extra);
            let mut last = String::new();
            // The server may still be starting: a few tries, bounded.
            for _ in 0..20 {
                match run(&[&["ip"], args.as_slice()].concat()) {
                    Ok(out) => return serde_json::from_str(&out).map_err(|e| e.to_string()),
                    Err(e) => last = e,
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            Err(format!(
                "iperf3 {extra:?}: {last}\nweir's log:\n{}",
                topo.weir_log()
            ))
        };
        let tcp = iperf3(&[])?;
        let got = tcp["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
        if got < 1_000_000 {
            return Err(format!("iperf3 TCP moved {got} bytes"));
        }
        let udp = iperf3(&["-u", "-b", "20M"])?;
        let sum = &udp["end"]["sum"];
        let (packets, lost) = (
            sum["packets"].as_u64().unwrap_or(0),
            sum["lost_packets"].as_u64().unwrap_or(u64::MAX),
        );
        if packets < 1000 || lost * 100 > packets {
            return Err(format!("iperf3 UDP: {packets} packets, {lost} lost"));
        }
        let out = run(&[
            "ip",
            "netns",
            "exec",
            &cl,
            "wrk",
            "-t1",
            "-c8",
            "-d2s",
            "-H",
            "Connection: close",
            &format!("http://{}/", V4.vip),
        ])?;
        let requests = out
            .lines()
            .find_map(|l| {
                l.trim()
                    .split_once(" requests in ")
                    .map(|(n, _)| n.trim().parse::<u64>())
            })
            .and_then(Result::ok)
            .unwrap_or(0);
        if requests < 100 || out.contains("Non-2xx") || out.contains("Socket errors") {
            return Err(format!("wrk through nat:\n{out}"));
        }
        let stats = weir(&cfg, &["stats", "--json"])?;
        let v: serde_json::Value = serde_json::from_str(&stats).map_err(|e| e.to_string())?;
        // Every frame weir received was forwarded. (Flows may be fewer than
        // wrk's connections: a client port reused while its old flow is in
        // TIME_WAIT takes that flow again, as in IPVS.)
        let p = &v["global"]["packet"];
        if p["rx"] != p["tx"] || p["new_flows"].as_u64() < Some(requests / 2) {
            return Err(format!("packet counters after iperf3 and wrk: {p}"));
        }
        Ok(())
    })());
}

//! The web dashboard (`/ui/`) in a real browser: headless Chromium driven
//! through chromedriver's WebDriver protocol, against a daemon with the
//! demo's services plus a second tenant.
//!
//! Needs Debian's `chromium` and `chromium-driver` packages (`.ci/run`
//! installs them). Without them the test says so and passes as skipped,
//! except under CI (`CI` set), where it fails. `WEIR_CHROMIUM` and
//! `WEIR_CHROMEDRIVER` override the binaries' paths;
//! `WEIR_DASHBOARD_SCREENSHOTS=DIR` writes the screenshots the README shows.

mod daemon_util;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use weir::config::Config;
use weir::daemon::{Daemon, DaemonHandle};

use daemon_util::{Echo, udp_echo};

const FULL: &str = "dashboard-full-token";
const RO: &str = "dashboard-readonly-token";
const ACME: &str = "dashboard-acme-token";
const BIN: &str = env!("CARGO_BIN_EXE_weir");
/// Bound of every wait on the browser or the daemon.
const T: Duration = Duration::from_secs(30);

// ---- the browser --------------------------------------------------------------

fn find_binary(env: &str, candidates: &[&str]) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for c in candidates {
        for dir in std::env::split_paths(&path).chain([PathBuf::from("/usr/bin")]) {
            let p = dir.join(c);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

/// chromedriver on a free port, killed on drop.
struct Driver {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request to chromedriver (`Connection: close`): status and
/// JSON body. A few lines of std instead of a client crate.
fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("chromedriver at {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let payload = body.map(Value::to_string).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        payload.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(payload.as_bytes()).unwrap();
    // chromedriver keeps the connection open despite `Connection: close`:
    // read the head, then as much body as it announces.
    let mut raw = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let (split, head) = loop {
        if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break (i, String::from_utf8_lossy(&raw[..i]).to_ascii_lowercase());
        }
        let n = s
            .read(&mut chunk)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        assert!(
            n > 0,
            "{method} {path}: connection closed before the answer's head"
        );
        raw.extend_from_slice(&chunk[..n]);
    };
    let length = head.lines().find_map(|l| {
        l.strip_prefix("content-length:")
            .and_then(|v| v.trim().parse::<usize>().ok())
    });
    let chunked = head.contains("transfer-encoding: chunked");
    for _ in 0..1_000_000 {
        let body = &raw[split + 4..];
        let done = match length {
            Some(n) => body.len() >= n,
            None => chunked && body.ends_with(b"0\r\n\r\n"),
        };
        if done {
            break;
        }
        let n = s
            .read(&mut chunk)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&chunk[..n]);
    }
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("{method} {path}: bad status line in {head:?}"));
    let mut rest = raw[split + 4..].to_vec();
    if chunked {
        rest = dechunk(&rest);
    }
    let v = serde_json::from_slice(&rest).unwrap_or(Value::Null);
    (status, v)
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..100_000 {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            break;
        };
        let size = std::str::from_utf8(&b[..eol])
            .ok()
            .and_then(|l| usize::from_str_radix(l.split(';').next()?.trim(), 16).ok())
            .unwrap_or(0);
        if size == 0 || b.len() < eol + 2 + size {
            break;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[(eol + 4 + size).min(b.len())..];
    }
    out
}

/// A WebDriver session (one headless Chromium), deleted on drop.
struct Browser {
    driver: Driver,
    session: String,
}

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

impl Browser {
    /// Start chromedriver and a session, or `None` if the packages are missing.
    fn start() -> Option<Browser> {
        let chromium = find_binary("WEIR_CHROMIUM", &["chromium", "chromium-browser"]);
        let driver = find_binary("WEIR_CHROMEDRIVER", &["chromedriver"]);
        let (Some(chromium), Some(driver)) = (chromium, driver) else {
            let msg = "the dashboard test needs headless Chromium and chromedriver: \
                       apt-get install -y chromium chromium-driver \
                       (or set WEIR_CHROMIUM and WEIR_CHROMEDRIVER)";
            assert!(std::env::var_os("CI").is_none(), "{msg}");
            eprintln!("SKIPPED: {msg}");
            return None;
        };
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(&driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", driver.display()));
        let driver = Driver {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        };
        let up = daemon_util::wait_until(T, || {
            TcpStream::connect(driver.addr).is_ok()
                && http(driver.addr, "GET", "/status", None).1["value"]["ready"] == true
        });
        assert!(up, "chromedriver did not become ready within {T:?}");
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium.to_string_lossy(),
                // --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1300,1250"]
            }
        } } });
        let (status, v) = http(driver.addr, "POST", "/session", Some(&caps));
        assert_eq!(status, 200, "creating a Chromium session failed: {v}");
        let session = v["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session id in {v}"))
            .to_owned();
        Some(Browser { driver, session })
    }

    fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let full = format!("/session/{}{path}", self.session);
        let (status, v) = http(self.driver.addr, method, &full, body.as_ref());
        assert_eq!(status, 200, "WebDriver {method} {path}: {v}");
        v["value"].clone()
    }

    fn go(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({ "url": url })));
    }

    /// Run `script` (a function body; `arguments` holds `args`) in the page.
    fn js(&self, script: &str, args: Value) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            Some(json!({ "script": script, "args": args })),
        )
    }

    /// Poll `script` until it returns true; panics with `what` after [`T`].
    fn wait_js(&self, what: &str, script: &str, args: Value) {
        self.wait_js_for(T, what, script, args);
    }

    fn wait_js_for(&self, limit: Duration, what: &str, script: &str, args: Value) {
        let ok = daemon_util::wait_until(limit, || self.js(script, args.clone()) == true);
        assert!(ok, "timed out after {limit:?} waiting until {what}");
    }

    fn find(&self, css: &str) -> String {
        let v = self.cmd(
            "POST",
            "/element",
            Some(json!({ "using": "css selector", "value": css })),
        );
        v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element id for {css}: {v}"))
            .to_owned()
    }

    fn click(&self, css: &str) {
        let id = self.find(css);
        self.cmd("POST", &format!("/element/{id}/click"), Some(json!({})));
    }

    fn clear_and_type(&self, css: &str, text: &str) {
        let id = self.find(css);
        self.cmd("POST", &format!("/element/{id}/clear"), Some(json!({})));
        self.cmd(
            "POST",
            &format!("/element/{id}/value"),
            Some(json!({ "text": text })),
        );
    }

    /// Accept the `confirm()` the page opened (waiting for it, bounded).
    fn accept_dialog(&self) {
        let path = format!("/session/{}/alert/accept", self.session);
        let ok = daemon_util::wait_until(T, || {
            http(self.driver.addr, "POST", &path, Some(&json!({}))).0 == 200
        });
        assert!(ok, "no confirmation dialog appeared within {T:?}");
    }

    /// The page as PNG; written to `$WEIR_DASHBOARD_SCREENSHOTS/name` when set.
    fn screenshot(&self, name: &str) {
        let b64 = self.cmd("GET", "/screenshot", None);
        let png = base64_decode(b64.as_str().unwrap_or_default());
        assert!(
            png.starts_with(b"\x89PNG\r\n\x1a\n"),
            "screenshot is no PNG"
        );
        if let Some(dir) = std::env::var_os("WEIR_DASHBOARD_SCREENSHOTS") {
            let p = Path::new(&dir).join(name);
            std::fs::write(&p, png).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let path = format!("/session/{}", self.session);
        if TcpStream::connect(self.driver.addr).is_ok() {
            let _ = http(self.driver.addr, "DELETE", &path, None);
        }
    }
}

fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let (mut out, mut acc, mut bits) = (Vec::new(), 0u32, 0);
    for v in s.bytes().filter_map(val) {
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

// ---- the daemon and its traffic -------------------------------------------------

/// A daemon with `weir demo`'s services (TCP wrr 1:2, UDP rr over echo
/// backends) in tenant `default`, and tenant `acme` (own table, tenant
/// token) with one TCP service.
struct Lab {
    daemon: Option<DaemonHandle>,
    url: String,
    stop_admin: tokio_util::sync::CancellationToken,
    stop_traffic: Arc<AtomicBool>,
    traffic: Option<std::thread::JoinHandle<()>>,
    _backends: Vec<Echo>,
}

impl Lab {
    fn start() -> Lab {
        let tcp = [Echo::start(), Echo::start(), Echo::start()];
        let udp = [udp_echo(), udp_echo()];
        let text = format!(
            r#"
[daemon]
workers = 2
[admin]
listen = "127.0.0.1:0"
token = "{FULL}"
readonly_token = "{RO}"
[[tenant]]
name = "acme"
table_entries = 1024
token = "{ACME}"
[[service]]
name = "demo-tcp"
protocol = "tcp"
listen = "127.0.0.1:0"
scheduler = "wrr"
  [[service.backend]]
  address = "{}"
  weight = 1
  [[service.backend]]
  address = "{}"
  weight = 2
[[service]]
name = "demo-udp"
protocol = "udp"
listen = "127.0.0.1:0"
scheduler = "rr"
udp_timeout = "30s"
  [[service.backend]]
  address = "{}"
  [[service.backend]]
  address = "{}"
[[service]]
tenant = "acme"
name = "shop"
protocol = "tcp"
listen = "127.0.0.1:0"
scheduler = "rr"
  [[service.backend]]
  address = "{}"
"#,
            tcp[0].addr, tcp[1].addr, udp[0], udp[1], tcp[2].addr
        );
        let cfg: Config = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let daemon = Daemon::start(cfg.clone(), None).expect("daemon starts");
        let rt = daemon.runtime();
        let bound = rt
            .block_on(weir::admin::bind(&cfg.admin, daemon.control()))
            .expect("admin binds");
        let url = format!("http://{}", bound.local_addr().unwrap());
        let stop_admin = tokio_util::sync::CancellationToken::new();
        rt.spawn(bound.run(stop_admin.clone()));
        let vip = |t: &str, s: &str| daemon.service_addr(t, s).expect("service listens");
        let (tcp_vip, udp_vip) = (vip("default", "demo-tcp"), vip("default", "demo-udp"));
        let stop_traffic = Arc::new(AtomicBool::new(false));
        let stop = stop_traffic.clone();
        let traffic = std::thread::spawn(move || drive(tcp_vip, udp_vip, &stop));
        Lab {
            daemon: Some(daemon),
            url,
            stop_admin,
            stop_traffic,
            traffic: Some(traffic),
            _backends: tcp.into(),
        }
    }

    fn vip(&self, tenant: &str, service: &str) -> SocketAddr {
        self.daemon
            .as_ref()
            .and_then(|d| d.service_addr(tenant, service))
            .expect("service listens")
    }

    /// `weir conns --json` with these filters: one JSON object per line.
    fn weir_conns(&self, filters: &[&str]) -> Vec<Value> {
        let out = Command::new(BIN)
            .args(["conns", "--json", "--admin", &self.url, "--token", FULL])
            .args(filters)
            .output()
            .expect("weir conns runs");
        assert!(
            out.status.success(),
            "weir conns failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }

    /// The cookie of the connection whose client address is `client`.
    fn cookie_of(&self, client: SocketAddr) -> u64 {
        let mut found = None;
        let ok = daemon_util::wait_until(T, || {
            found = self
                .weir_conns(&[])
                .into_iter()
                .find(|c| c["client"] == client.to_string())
                .and_then(|c| c["cookie"].as_u64());
            found.is_some()
        });
        assert!(ok, "weir conns never listed the client {client}");
        found.unwrap_or_default()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.stop_traffic.store(true, Relaxed);
        if let Some(t) = self.traffic.take() {
            let _ = t.join();
        }
        self.stop_admin.cancel();
        if let Some(d) = self.daemon.take() {
            d.shutdown();
        }
    }
}

/// The demo's traffic: three long connections echoing 4 KiB every 300 ms,
/// a short connection every 300 ms, UDP pings from three sockets.
fn drive(tcp: SocketAddr, udp: SocketAddr, stop: &AtomicBool) {
    let mut long: Vec<TcpStream> = (0..3)
        .filter_map(|_| TcpStream::connect(tcp).ok())
        .collect();
    for s in &long {
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    }
    let udp_clients: Vec<UdpSocket> = (0..3)
        .filter_map(|_| UdpSocket::bind("127.0.0.1:0").ok())
        .collect();
    for u in &udp_clients {
        let _ = u.set_read_timeout(Some(Duration::from_secs(2)));
    }
    let payload = vec![b'w'; 4096];
    let mut buf = vec![0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(600);
    while !stop.load(Relaxed) && Instant::now() < deadline {
        for s in long.iter_mut() {
            let _ = s.write_all(&payload).and_then(|_| s.read_exact(&mut buf));
        }
        if let Ok(mut s) = TcpStream::connect(tcp) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = s
                .write_all(&payload[..512])
                .and_then(|_| s.read_exact(&mut buf[..512]));
        }
        for u in &udp_clients {
            let _ = u.send_to(b"ping", udp).and_then(|_| u.recv_from(&mut buf));
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

// ---- the test -------------------------------------------------------------------

const SERVICES_SHOWN: &str = "return [...document.querySelectorAll('[data-service]')]\
    .map(e => e.dataset.service).sort();";
const CONN_ROWS: &str = "return [...document.querySelectorAll('#conns tbody tr')]\
    .map(r => ({ cookie: Number(r.dataset.cookie), cells: [...r.cells].map(c => c.textContent), \
                 kill: !!r.querySelector('button.kill') }));";

#[test]
fn dashboard_in_headless_chromium() {
    let Some(b) = Browser::start() else { return };
    let lab = Lab::start();
    // Connections of our own, to kill and to page through.
    let victim = daemon_util::held(lab.vip("default", "demo-tcp"));
    let acme: Vec<TcpStream> = (0..3)
        .map(|_| daemon_util::held(lab.vip("acme", "shop")))
        .collect();
    let victim_cookie = lab.cookie_of(victim.local_addr().unwrap());

    // 1. The full-access token in the URL: the page lists the services and
    //    takes the token out of the address bar into the tab's storage.
    b.go(&format!("{}/ui/?token={FULL}", lab.url));
    b.wait_js(
        "the page lists three services",
        "return document.querySelectorAll('[data-service]').length === 3;",
        json!([]),
    );
    assert_eq!(
        b.js(SERVICES_SHOWN, json!([])),
        json!(["acme/shop", "default/demo-tcp", "default/demo-udp"])
    );
    assert_eq!(
        b.js("return location.href;", json!([])),
        json!(format!("{}/ui/", lab.url)),
        "the token stays in the address bar"
    );
    assert_eq!(
        b.js("return sessionStorage.getItem('weir-token');", json!([])),
        json!(FULL)
    );
    assert_eq!(
        b.js(
            "return document.getElementById('who').textContent;",
            json!([])
        ),
        json!("full access")
    );
    let tenants = b.js(
        "return [...document.querySelectorAll('#tenants tbody tr')].map(r => r.dataset.tenant).sort();",
        json!([]),
    );
    assert_eq!(tenants, json!(["acme", "default"]));
    // Backend rows: health and weight as configured (wrr 1:2), and the
    // long-lived connections counted active.
    let rows = b.js(
        "return [...document.querySelectorAll('[data-service=\"default/demo-tcp\"] tbody tr')]\
            .map(r => [...r.cells].map(c => c.textContent));",
        json!([]),
    );
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(
        (&rows[0][1], &rows[0][2]),
        (&json!("unchecked"), &json!("1"))
    );
    assert_eq!(
        (&rows[1][1], &rows[1][2]),
        (&json!("unchecked"), &json!("2"))
    );
    b.wait_js(
        "demo-tcp's backends count the three long connections and ours as active",
        "return [...document.querySelectorAll('[data-service=\"default/demo-tcp\"] tbody tr')]\
            .reduce((n, r) => n + Number(r.cells[3].textContent), 0) >= 4;",
        json!([]),
    );

    // 2. The plots move: over 5 s the page records new samples of the
    //    backends' rates, traffic shows in them, and the drawn lines change.
    let plot_state = "const card = document.querySelector('[data-service=\"default/demo-tcp\"]');\
        const svg = card.querySelector('[data-plot^=\"bytes/s\"] svg');\
        const h = Object.entries(window.weirDashboard.history)\
            .filter(([k]) => k.startsWith('default/demo-tcp|')).map(([, v]) => v);\
        return { samples: Number(svg.dataset.samples),\
                 points: [...svg.querySelectorAll('polyline')].map(p => p.getAttribute('points')),\
                 times: h.map(v => v.map(s => s.t)),\
                 inbps: h.map(v => v.map(s => s.inbps)) };";
    let before = b.js(plot_state, json!([]));
    let t0 = Instant::now();
    let n0 = before["samples"].as_u64().unwrap();
    // Five more samples per line (a poll a second): at least 5 s.
    b.wait_js(
        "the bytes/s plot has 5 more samples",
        "const card = document.querySelector('[data-service=\"default/demo-tcp\"]');\
         return Number(card.querySelector('[data-plot^=\"bytes/s\"] svg').dataset.samples) >= arguments[0];",
        json!([n0 + 5 * 4]),
    );
    let after = b.js(plot_state, json!([]));
    assert!(t0.elapsed() >= Duration::from_secs(4), "{:?}", t0.elapsed());
    assert_ne!(before["points"], after["points"], "the plot did not change");
    for times in after["times"].as_array().unwrap() {
        let t: Vec<f64> = times
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert!(
            t.windows(2).all(|w| w[0] < w[1]),
            "samples out of order: {t:?}"
        );
    }
    let busy = after["inbps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v.as_array().unwrap().iter().any(|x| x.as_u64() > Some(0)))
        .count();
    assert_eq!(busy, 2, "both demo-tcp backends carry traffic: {after}");
    if std::env::var_os("WEIR_DASHBOARD_SCREENSHOTS").is_some() {
        // For the README: a minute of history reads better than a few seconds.
        b.wait_js_for(
            Duration::from_secs(120),
            "a minute of samples is plotted",
            "return /over the last [6-9][0-9] s/.test(document.getElementById('window').textContent);",
            json!([]),
        );
    }
    b.screenshot("dashboard.png");

    // 3. Filters and the cursor: acme's three connections two to a page.
    b.clear_and_type("#filters [name=tenant]", "acme");
    b.clear_and_type("#filters [name=limit]", "2");
    b.click("#filters button[type=submit]");
    let mut paged: Vec<u64> = Vec::new();
    for page in 1..=10 {
        b.wait_js(
            &format!("page {page} of acme's connections shows"),
            "return document.getElementById('page').textContent.startsWith('page ' + arguments[0] + ',') \
                && document.getElementById('conns').dataset.query.includes('tenant=acme&limit=2');",
            json!([page]),
        );
        let rows = b.js(CONN_ROWS, json!([]));
        assert!(
            rows.as_array().unwrap().len() <= 2,
            "limit 2 ignored: {rows}"
        );
        for row in rows.as_array().unwrap() {
            assert_eq!(row["cells"][0], "acme", "the tenant filter leaked: {row}");
            paged.push(row["cookie"].as_u64().unwrap());
        }
        if b.js(
            "return document.getElementById('next').disabled;",
            json!([]),
        ) == true
        {
            break;
        }
        assert!(page < 10, "more than 10 pages of 2 for 3 connections");
        b.click("#next");
    }
    paged.sort();
    let mut listed: Vec<u64> = lab
        .weir_conns(&["--tenant", "acme"])
        .iter()
        .map(|c| c["cookie"].as_u64().unwrap())
        .collect();
    listed.sort();
    assert_eq!(paged, listed, "paging in the page differs from weir conns");
    assert_eq!(paged.len(), acme.len());

    // 4. The kill button kills: the connection leaves `weir conns`.
    b.clear_and_type("#filters [name=tenant]", "default");
    b.clear_and_type("#filters [name=service]", "demo-tcp");
    b.clear_and_type("#filters [name=state]", "ESTABLISHED");
    b.clear_and_type("#filters [name=limit]", "100");
    b.click("#filters button[type=submit]");
    let row = format!("#conns tr[data-cookie=\"{victim_cookie}\"]");
    b.wait_js(
        "the victim's row shows",
        "return !!document.querySelector(arguments[0]) && document.getElementById('conns').dataset.query \
            === '/v1/connections?tenant=default&service=demo-tcp&state=ESTABLISHED&limit=100';",
        json!([row]),
    );
    for r in b.js(CONN_ROWS, json!([])).as_array().unwrap() {
        assert_eq!(r["cells"][1], "demo-tcp", "{r}");
        assert_eq!(r["cells"][6], "ESTABLISHED", "{r}");
        assert_eq!(r["kill"], true, "the full-access token sees kill buttons");
    }
    b.click(&format!("{row} button.kill"));
    b.accept_dialog();
    let gone = daemon_util::wait_until(T, || {
        !lab.weir_conns(&["--service", "demo-tcp"])
            .iter()
            .any(|c| c["cookie"] == victim_cookie)
    });
    assert!(
        gone,
        "connection {victim_cookie} still in weir conns after kill"
    );
    b.wait_js(
        "the killed row leaves the list",
        "return !document.querySelector(arguments[0]);",
        json!([row]),
    );
    let mut victim = victim;
    victim.set_read_timeout(Some(T)).unwrap();
    let mut byte = [0u8; 1];
    assert!(
        matches!(victim.read(&mut byte), Ok(0) | Err(_)),
        "the killed client connection is still open"
    );

    // 5. The read-only token, given through the form: no write buttons.
    b.click("#logout");
    b.wait_js(
        "the token form shows",
        "return !document.getElementById('login').hidden \
            && sessionStorage.getItem('weir-token') === null;",
        json!([]),
    );
    b.clear_and_type("#token", RO);
    b.click("#login button[type=submit]");
    b.wait_js(
        "the read-only view lists connections",
        "return document.getElementById('who').textContent === 'read-only' \
            && document.querySelectorAll('#conns tbody tr').length > 0;",
        json!([]),
    );
    assert_eq!(
        b.js(
            "return document.querySelectorAll('button.kill').length;",
            json!([])
        ),
        json!(0),
        "a read-only token sees kill buttons"
    );

    // 6. A tenant token sees only its tenant (and may kill its connections).
    b.click("#logout");
    b.go(&format!("{}/ui/?token={ACME}", lab.url));
    b.wait_js(
        "the tenant view lists its service and connections",
        "return document.getElementById('who').textContent === 'tenant acme' \
            && document.querySelectorAll('[data-service]').length > 0 \
            && document.querySelectorAll('#conns tbody tr').length > 0;",
        json!([]),
    );
    assert_eq!(b.js(SERVICES_SHOWN, json!([])), json!(["acme/shop"]));
    let tenants = b.js(
        "return [...document.querySelectorAll('#tenants tbody tr')].map(r => r.dataset.tenant);",
        json!([]),
    );
    assert_eq!(tenants, json!(["acme"]));
    let rows = b.js(CONN_ROWS, json!([]));
    assert_eq!(rows.as_array().unwrap().len(), acme.len(), "{rows}");
    for r in rows.as_array().unwrap() {
        assert_eq!(r["cells"][0], "acme", "{r}");
        assert_eq!(r["kill"], true, "{r}");
    }
    b.screenshot("dashboard-tenant.png");
    drop(acme);
}

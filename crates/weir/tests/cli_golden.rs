//! CLI tests: golden files for the pure renderers (`weir list`, `--stats`,
//! `--rate`, `weir conns`, `weir stats table`, ...), then every command
//! end to end against the admin API served over TCP from an in-memory
//! Control. Regenerate goldens with `UPDATE_GOLDEN=1 cargo test -p weir --test cli_golden`
//! and review the diff.

mod admin_fake;
mod cli_util;

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use serde_json::Value;

use admin_fake::{Fake, Served};
use cli_util::Cli;
use weir::cli::render::{self, ListMode};
use weir::control::Control;

fn golden(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with UPDATE_GOLDEN=1)", path.display()));
    assert!(
        actual == expected,
        "{name} differs from its golden file\n--- expected\n{expected}\n--- actual\n{actual}"
    );
}

#[test]
fn golden_list() {
    let s = Fake::sample().services();
    golden("list.txt", &render::render_list(&s, ListMode::Plain, false));
    golden(
        "list_stats.txt",
        &render::render_list(&s, ListMode::Stats, false),
    );
    golden(
        "list_stats_exact.txt",
        &render::render_list(&s, ListMode::Stats, true),
    );
    golden(
        "list_rate.txt",
        &render::render_list(&s, ListMode::Rate, false),
    );
    golden(
        "list_rate.json",
        &format!(
            "{}\n",
            serde_json::to_string_pretty(&render::list_json(&s, ListMode::Rate)).unwrap()
        ),
    );
}

#[test]
fn golden_conns_table_tenants_health_top() {
    let f = Fake::sample();
    let page = f.connections(&Default::default(), None, 100).expect("page");
    golden("conns.txt", &render::render_conns(&page.connections));
    golden("stats_table.txt", &render::render_table(&f.table()));
    golden("tenants.txt", &render::render_tenants(&f.tenants()));
    golden("health.txt", &render::render_health(&f.health()));
    golden(
        "stats_global.txt",
        &render::render_global(&f.global_stats(), false),
    );
    golden(
        "top.txt",
        &render::render_top(
            "12:34:56 UTC",
            &f.global_stats(),
            &f.services(),
            &f.tenants(),
            &f.table(),
        ),
    );
}

/// Packet mode's counters in `weir stats`: the sums, then one line per
/// worker (which queue receives, which one drops).
#[test]
fn golden_stats_global_with_packet_workers() {
    use weir::control::{PacketCounters, PacketStats, PacketWorkerStats};
    let mut g = Fake::sample().global_stats();
    // (The UDP proxy's early drops, shown above packet mode's figures.)
    g.udp_early_drops = 6;
    let worker = |name: &str, rx, tx, flows, dropped: &[(&str, u64)]| PacketWorkerStats {
        worker: name.into(),
        counts: PacketCounters {
            rx,
            tx,
            new_flows: flows,
            dropped: dropped.iter().map(|&(r, n)| (r.to_owned(), n)).collect(),
            ..PacketCounters::default()
        },
    };
    g.packet = Some(PacketStats {
        io: "xdp".into(),
        counts: PacketCounters {
            rx: 1500,
            tx: 1480,
            new_flows: 12,
            icmp_errors: 4,
            rst_ignored: 3,
            fin_ignored: 0,
            seq_ignored: 2,
            early_drops: 9,
            dropped: [
                ("kernel_rx_ring_full".to_owned(), 15),
                ("no_flow".to_owned(), 5),
            ]
            .into_iter()
            .collect(),
        },
        workers: vec![
            worker("weir-pkt-q0", 1000, 995, 8, &[("no_flow", 5)]),
            worker("weir-pkt-q1", 500, 485, 4, &[("kernel_rx_ring_full", 15)]),
        ],
    });
    golden("stats_global_packet.txt", &render::render_global(&g, false));
    // The API's JSON carries the breakdown; without workers it has no key.
    let v = serde_json::to_value(g.packet.as_ref().unwrap()).unwrap();
    assert_eq!(v["workers"][1]["worker"], "weir-pkt-q1");
    assert_eq!(v["workers"][1]["dropped"]["kernel_rx_ring_full"], 15);
    // The counters sit beside `io` and `worker`, as before they were
    // one struct shared by both.
    assert_eq!(v["rx"], 1500);
    assert_eq!(v["icmp_errors"], 4);
    assert_eq!(v["workers"][0]["new_flows"], 8);
    assert!(v.get("counts").is_none(), "{v}");
    let mut bare = g.packet.clone().unwrap();
    bare.workers.clear();
    let v = serde_json::to_value(&bare).unwrap();
    assert!(v.get("workers").is_none(), "{v}");
    let back: PacketStats = serde_json::from_value(v).unwrap();
    assert_eq!(back, bare, "an older daemon's stats still parse");
}

/// `weir list` prints scheduler flags and the persistence mask as
/// `ipvsadm -Ln` does; `--json` carries them as fields.
#[test]
fn list_shows_sched_flags_and_mask_like_ipvsadm() {
    let mut s = Fake::sample().services();
    s.truncate(1);
    s[0].scheduler = "sh".into();
    s[0].sched_flags = vec!["sh-fallback".into(), "sh-port".into()];
    let text = render::render_list(&s, ListMode::Plain, false);
    assert_eq!(
        text.lines().nth(2),
        Some(
            "TCP  10.0.0.1:80 sh (sh-fallback,sh-port) persistent 300 mask 255.255.255.0 [acme/web]"
        )
    );
    let v = render::list_json(&s, ListMode::Plain);
    assert_eq!(
        v[0]["sched_flags"],
        serde_json::json!(["sh-fallback", "sh-port"])
    );
    assert_eq!(v[0]["persistence_netmask"], "255.255.255.0");
    // Without persistence there is no mask; a host mask is not shown.
    s[0].persistence = "0s".parse().unwrap();
    let text = render::render_list(&s, ListMode::Plain, false);
    assert!(
        text.contains("sh (sh-fallback,sh-port) [acme/web]"),
        "{text}"
    );
    s[0].persistence = "300s".parse().unwrap();
    s[0].persistence_netmask = Some("255.255.255.255".into());
    s[0].sched_flags.clear();
    let text = render::render_list(&s, ListMode::Plain, false);
    assert!(text.contains("sh persistent 300 [acme/web]"), "{text}");
}

/// A packet service says how it forwards in `weir list` (the proxy, the
/// default, says nothing) and in `--json` (every service).
#[test]
fn list_shows_the_forward_method_of_packet_services() {
    let mut s = Fake::sample().services();
    s.truncate(2);
    s[0].forward = weir::config::Forward::Fnat;
    let text = render::render_list(&s, ListMode::Plain, false);
    assert!(
        text.contains("persistent 300 mask 255.255.255.0 forward fnat [acme/web]"),
        "{text}"
    );
    let proxy_line = format!("{} [{}/{}]", s[1].scheduler, s[1].tenant, s[1].name);
    assert!(
        text.lines().any(|l| l.ends_with(&proxy_line)),
        "{proxy_line} in\n{text}"
    );
    let v = render::list_json(&s, ListMode::Plain);
    assert_eq!(
        (&v[0]["forward"], &v[1]["forward"]),
        (&serde_json::json!("fnat"), &serde_json::json!("proxy"))
    );
}

#[test]
fn list_json_has_the_documented_keys() {
    let s = Fake::sample().services();
    let plain = render::list_json(&s, ListMode::Plain);
    let svc = plain[0].as_object().unwrap();
    let keys: Vec<&str> = svc.keys().map(String::as_str).collect();
    let mut want = vec![
        "tenant",
        "name",
        "protocol",
        "listen",
        "forward",
        "scheduler",
        "sched_flags",
        "persistence",
        "persistence_netmask",
        "backends",
    ];
    want.sort();
    let mut got = keys.clone();
    got.sort();
    assert_eq!(got, want);
    let mut bkeys: Vec<&str> = plain[0]["backends"][0]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    bkeys.sort();
    assert_eq!(
        bkeys,
        ["active_conns", "address", "inactive_conns", "weight"]
    );
    let rate = render::list_json(&s, ListMode::Rate);
    for k in ["cps", "inpps", "outpps", "inbps", "outbps"] {
        assert!(rate[0].get(k).is_some(), "service {k}");
        assert!(rate[0]["backends"][0].get(k).is_some(), "backend {k}");
    }
    assert_eq!(rate[0]["outbps"], 2_000_000_000u64);
}

// ---- end to end ---------------------------------------------------------

const TOKEN: &str = "cli-test-token";

struct Server {
    fake: Arc<Fake>,
    url: String,
    _served: Served,
}

fn server() -> Server {
    let served = admin_fake::serve(&[weir::config::AdminConfig {
        readonly_token: Some("ro".into()),
        ..admin_fake::admin_config("127.0.0.1:0", TOKEN)
    }]);
    Server {
        fake: served.fake.clone(),
        url: served.url(),
        _served: served,
    }
}

impl Server {
    /// Run `weir ARGS --admin URL --token TOKEN`; returns (exit, stdout, stderr).
    fn weir(&self, args: &[&str]) -> (ExitCode, String, String) {
        self.weir_as(TOKEN, args)
    }

    fn weir_as(&self, token: &str, args: &[&str]) -> (ExitCode, String, String) {
        cli_util::run(&self.url, token, args)
    }
}

fn ok(r: (ExitCode, String, String)) -> String {
    assert_eq!(r.0, ExitCode::SUCCESS, "stderr: {}", r.2);
    r.1
}

#[test]
fn e2e_list_matches_the_renderer() {
    let s = server();
    let out = ok(s.weir(&["list"]));
    assert_eq!(
        out,
        render::render_list(&s.fake.services(), ListMode::Plain, false)
    );
    let out = ok(s.weir(&["list", "--stats", "--exact"]));
    assert!(out.contains("123456789012345"), "{out}");
    let out = ok(s.weir(&["list", "--rate", "--json"]));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["cps"], 12);
    let out = ok(s.weir(&["list", "--json", "--tenant", "globex"]));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 1);
    // A tenant token lists only its tenant.
    let out = ok(s.weir_as("acme-token", &["list", "--json"]));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 1);
    assert_eq!(v[0]["tenant"], "acme");
}

#[test]
fn e2e_conns_streams_every_page() {
    let s = server();
    s.fake.add_conns(2_500);
    let out = ok(s.weir(&["conns", "--json", "--tenant", "acme"]));
    let mut cookies = std::collections::BTreeSet::new();
    for line in out.lines() {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        for key in admin_fake::CONN_KEYS {
            assert!(v.get(key).is_some(), "{key} missing: {line}");
        }
        assert_eq!(v["tenant"], "acme");
        assert!(
            cookies.insert(v["cookie"].as_u64().unwrap()),
            "duplicate {line}"
        );
    }
    assert_eq!(
        cookies.len(),
        2_502,
        "3 pages of up to 1000, each entry once"
    );
    let out = ok(s.weir(&["conns"]));
    assert_eq!(out.lines().count(), 1 + 2_503);
    assert!(out.starts_with("pro expire state"), "{out}");
    let out = ok(s.weir(&["conns", "--state", "UDP"]));
    assert_eq!(out.lines().count(), 2);
    assert!(out.contains("globex"));
    let out = ok(s.weir(&["conns", "--json", "--max", "5"]));
    assert_eq!(out.lines().count(), 5);
}

/// `weir service add --forward --sloppy-tcp` sends both; `--forward`
/// takes only the four methods; `service edit --sloppy-tcp BOOL` changes it.
#[test]
fn e2e_service_add_forward_and_sloppy_tcp() {
    let s = server();
    ok(s.weir(&[
        "service",
        "add",
        "pkt",
        "--listen",
        "10.9.0.1:80",
        "--forward",
        "nat",
        "--sloppy-tcp",
        "--backend",
        "10.9.1.1:80",
    ]));
    ok(s.weir(&["service", "add", "plain", "--listen", "10.9.0.2:80"]));
    let find = |name: &str| {
        s.fake
            .running_config()
            .services
            .into_iter()
            .find(|x| x.name == name)
            .unwrap()
    };
    let pkt = find("pkt");
    assert_eq!(pkt.forward, weir::config::Forward::Nat);
    assert!(pkt.options.sloppy_tcp);
    let plain = find("plain");
    assert_eq!(plain.forward, weir::config::Forward::Proxy);
    assert!(!plain.options.sloppy_tcp);
    // `weir save` writes both (and nothing for the proxy service).
    let saved = ok(s.weir(&["save"]));
    let back: weir::config::Config =
        toml::from_str(&saved).unwrap_or_else(|e| panic!("{e}\n{saved}"));
    let svc = |name: &str| back.services.iter().find(|x| x.name == name).unwrap();
    assert_eq!(*svc("pkt"), pkt, "{saved}");
    assert_eq!(*svc("plain"), plain, "{saved}");
    assert_eq!(saved.matches("forward = ").count(), 1, "{saved}");
    assert_eq!(saved.matches("sloppy_tcp = true").count(), 1, "{saved}");
    ok(s.weir(&["service", "edit", "pkt", "--sloppy-tcp", "false"]));
    assert!(!find("pkt").options.sloppy_tcp);
    let out = ok(s.weir(&["list"]));
    assert!(
        out.contains("TCP  10.9.0.1:80 wlc forward nat [default/pkt]"),
        "{out}"
    );
    let v: serde_json::Value = serde_json::from_str(&ok(s.weir(&["list", "--json"]))).unwrap();
    let fwd: Vec<_> = v
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["name"] == "pkt")
        .map(|x| x["forward"].clone())
        .collect();
    assert_eq!(fwd, [serde_json::json!("nat")]);
    let argv = [
        "weir",
        "service",
        "add",
        "x",
        "--listen",
        "10.9.0.3:80",
        "--forward",
        "masq",
    ];
    let e = match Cli::try_parse_from(argv) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("--forward masq was taken"),
    };
    assert!(e.contains("proxy nat fnat dr"), "{e}");
}

/// `weir service add/edit --sched-flags` sets the scheduler flags as
/// ipvsadm's `-b` does and `weir list` names them (issue 13 left the CLI
/// without them: an `sh` service made with it refused every client of a
/// backend that went down, with no way to turn `sh-fallback` on from the
/// CLI). An edit replaces the flags; `none` clears them.
#[test]
fn e2e_service_sched_flags() {
    let s = server();
    ok(s.weir(&[
        "service",
        "add",
        "hashed",
        "--listen",
        "10.9.0.4:80",
        "--scheduler",
        "sh",
        "--sched-flags",
        "sh-fallback,sh-port",
        "--backend",
        "10.9.1.1:80",
    ]));
    let flags = || {
        let svc = s
            .fake
            .running_config()
            .services
            .into_iter()
            .find(|x| x.name == "hashed")
            .unwrap();
        let o = svc.options;
        (
            svc.scheduler.as_str().to_owned(),
            [o.sh_fallback, o.sh_port, o.mh_fallback, o.mh_port],
        )
    };
    assert_eq!(flags(), ("sh".into(), [true, true, false, false]));
    let out = ok(s.weir(&["list"]));
    assert!(
        out.contains("TCP  10.9.0.4:80 sh (sh-fallback,sh-port) [default/hashed]"),
        "{out}"
    );
    ok(s.weir(&[
        "service",
        "edit",
        "hashed",
        "--scheduler",
        "mh",
        "--sched-flags",
        "mh-port",
    ]));
    assert_eq!(flags(), ("mh".into(), [false, false, false, true]));
    ok(s.weir(&["service", "edit", "hashed", "--sched-flags", "none"]));
    assert_eq!(flags(), ("mh".into(), [false; 4]));
    // Flags other than the four are a usage error naming them; `none`
    // stands alone.
    let argv = [
        "weir",
        "service",
        "add",
        "x",
        "--listen",
        "10.9.0.5:80",
        "--sched-flags",
        "sh-fallbak",
    ];
    let e = match Cli::try_parse_from(argv) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("--sched-flags sh-fallbak was taken"),
    };
    assert!(e.contains("sh-fallback") && e.contains("mh-port"), "{e}");
    let r = s.weir(&["service", "edit", "hashed", "--sched-flags", "none,mh-port"]);
    assert_eq!(r.0, ExitCode::from(2), "{}", r.2);
    assert!(r.2.contains("none"), "{}", r.2);
    assert_eq!(flags(), ("mh".into(), [false; 4]), "nothing sent");
}

/// `weir tenant add --max-table-entries` caps the tenant's own table, as
/// the file's and the API's `max_table_entries` do. The cap is fixed when
/// the table is made (`tenant edit` refuses to change it), and the CLI had
/// no way to give one: a tenant made with it could only grow to the
/// table's maximum.
#[test]
fn e2e_tenant_add_caps_its_own_table() {
    let s = server();
    ok(s.weir(&[
        "tenant",
        "add",
        "capped",
        "--table-entries",
        "1024",
        "--max-table-entries",
        "8192",
    ]));
    ok(s.weir(&["tenant", "add", "uncapped", "--table-entries", "1024"]));
    let t = |name: &str| {
        s.fake
            .running_config()
            .tenants
            .into_iter()
            .find(|t| t.name == name)
            .unwrap()
    };
    assert_eq!(
        (t("capped").table_entries, t("capped").max_table_entries),
        (1024, 8192)
    );
    assert_eq!(t("uncapped").max_table_entries, 0, "0: the table's maximum");
}

#[test]
fn e2e_tenant_service_backend_changes() {
    let s = server();
    ok(s.weir(&[
        "tenant",
        "add",
        "initech",
        "--table-entries",
        "2048",
        "--max-connections",
        "9",
        "--min-health-interval",
        "2s",
    ]));
    let out = ok(s.weir(&["tenant", "list"]));
    assert!(out.contains("initech"), "{out}");
    let r = s.weir(&["tenant", "add", "initech"]);
    assert_eq!(r.0, ExitCode::from(1));
    assert!(r.2.contains("409"), "{}", r.2);
    let r = s.weir(&["tenant", "edit", "initech"]);
    assert_eq!(r.0, ExitCode::from(2));
    assert!(r.2.contains("nothing to change"), "{}", r.2);
    let out = ok(s.weir(&[
        "tenant",
        "edit",
        "initech",
        "--max-connections",
        "20",
        "--tenant-token",
        "ini-token",
        "--timeout",
        "established=1h",
        "--timeout",
        "udp=60s",
        "--min-health-interval",
        "5s",
    ]));
    assert_eq!(out, "tenant initech updated\n");
    ok(s.weir(&["tenant", "edit", "initech", "--timeout", "udp=default"]));
    let t = s
        .fake
        .running_config()
        .tenants
        .into_iter()
        .find(|t| t.name == "initech")
        .unwrap();
    assert_eq!((t.max_connections, t.table_entries), (20, 2048));
    assert_eq!(t.token.as_deref(), Some("ini-token"));
    assert_eq!(
        t.timeouts.established.map(|d| d.to_string()).as_deref(),
        Some("1h")
    );
    assert_eq!(t.timeouts.udp, None, "KEY=default drops the key");
    assert_eq!(
        t.min_health_interval.map(|d| d.to_string()).as_deref(),
        Some("5s")
    );
    // Parsed as the key is, with the health interval's bounds: a bad
    // value is a usage error naming the option.
    for (bad, why) in [
        ("0s", "is outside 1ms..=1h"),
        ("2h", "is outside 1ms..=1h"),
        ("soon", "is not a duration"),
    ] {
        let argv = [
            "weir",
            "tenant",
            "edit",
            "initech",
            "--min-health-interval",
            bad,
        ];
        let e = match <cli_util::Cli as clap::Parser>::try_parse_from(argv) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{bad} was accepted"),
        };
        assert!(
            e.contains("--min-health-interval") && e.contains(why),
            "{bad}: {e}"
        );
    }
    let r = s.weir(&["tenant", "edit", "initech", "--table-entries", "4096"]);
    assert_eq!(r.0, ExitCode::from(1));
    assert!(r.2.contains("table_entries cannot change"), "{}", r.2);
    let r = s.weir(&["tenant", "edit", "initech", "--timeout", "bogus=1s"]);
    assert_eq!(r.0, ExitCode::from(2));
    assert!(r.2.contains("unknown state"), "{}", r.2);

    ok(s.weir(&[
        "service",
        "add",
        "initech/tps",
        "--listen",
        "10.9.0.1:80",
        "--scheduler",
        "rr",
        "--backend",
        "10.9.1.1:80@3",
        "--backend",
        "10.9.1.2:80",
    ]));
    let cfg = s.fake.running_config();
    let svc = cfg.services.iter().find(|x| x.name == "tps").unwrap();
    assert_eq!(svc.tenant, "initech");
    assert_eq!(svc.backends.len(), 2);
    assert_eq!(svc.backends[0].weight, 3);
    ok(s.weir(&[
        "service",
        "edit",
        "initech/tps",
        "--scheduler",
        "mh",
        "--persistence",
        "60s",
    ]));
    let cfg = s.fake.running_config();
    let svc = cfg.services.iter().find(|x| x.name == "tps").unwrap();
    assert_eq!(svc.scheduler.as_str(), "mh");
    assert_eq!(svc.persistence.as_str(), "60s");
    assert_eq!(svc.backends.len(), 2, "edit keeps backends");

    ok(s.weir(&[
        "backend",
        "add",
        "initech/tps",
        "[2001:db8::5]:80",
        "--weight",
        "2",
    ]));
    ok(s.weir(&[
        "backend",
        "edit",
        "initech/tps",
        "[2001:db8::5]:80",
        "--weight",
        "7",
    ]));
    let w = |addr: &str| {
        s.fake
            .running_config()
            .services
            .iter()
            .find(|x| x.name == "tps")
            .unwrap()
            .backends
            .iter()
            .find(|b| b.address.to_string() == addr)
            .map(|b| b.weight)
    };
    assert_eq!(w("[2001:db8::5]:80"), Some(7));
    ok(s.weir(&["backend", "drain", "initech/tps", "[2001:db8::5]:80"]));
    assert_eq!(w("[2001:db8::5]:80"), Some(0));
    ok(s.weir(&["backend", "del", "initech/tps", "[2001:db8::5]:80"]));
    assert_eq!(w("[2001:db8::5]:80"), None);
    let r = s.weir(&["backend", "del", "initech/tps", "[2001:db8::5]:80"]);
    assert_eq!(r.0, ExitCode::from(1));
    assert!(r.2.contains("404"), "{}", r.2);
    ok(s.weir(&["service", "del", "initech/tps"]));
    assert!(
        !s.fake
            .running_config()
            .services
            .iter()
            .any(|x| x.name == "tps")
    );
    let out = ok(s.weir(&["tenant", "del", "initech"]));
    assert!(out.contains("deleted"), "{out}");
    let r = s.weir(&["service", "add", "a/b/c", "--listen", "1.1.1.1:1"]);
    assert_eq!(r.0, ExitCode::from(2));
}

#[test]
fn e2e_kill_save_reload_stats_health_top() {
    let s = server();
    let r = s.weir(&["kill"]);
    assert_eq!(r.0, ExitCode::from(2), "no filter and no --all");
    ok(s.weir(&["kill", "--cookie", "100"]));
    assert!(!s.fake.st.lock().unwrap().conns.contains_key(&100));
    let out = ok(s.weir(&["kill", "--tenant", "globex"]));
    assert_eq!(out, "killed 1 connections\n");
    let out = ok(s.weir(&["kill", "--all"]));
    assert_eq!(out, "killed 1 connections\n");

    let toml_text = ok(s.weir(&["save"]));
    let parsed: weir::config::Config =
        toml::from_str(&toml_text).unwrap_or_else(|e| panic!("{e}\n{toml_text}"));
    assert_eq!(
        parsed,
        s.fake.running_config(),
        "save prints the running config"
    );

    ok(s.weir(&["reload"]));
    s.fake.st.lock().unwrap().fail_reload = Some(vec!["weir.toml:3: service.listen: bad".into()]);
    let r = s.weir(&["reload"]);
    assert_eq!(r.0, ExitCode::from(1));
    assert!(r.2.contains("weir.toml:3: service.listen: bad"), "{}", r.2);

    let out = ok(s.weir(&["stats"]));
    assert_eq!(out, render::render_global(&s.fake.global_stats(), false));
    let out = ok(s.weir(&["stats", "table"]));
    assert_eq!(out, render::render_table(&s.fake.table()));
    let out = ok(s.weir(&["stats", "table", "--json"]));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["tenant"], "acme");
    let out = ok(s.weir(&["health", "--json"]));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 3);
    let out = ok(s.weir(&["top", "--iterations", "2", "--interval", "0.1"]));
    assert_eq!(out.matches("weir top - ").count(), 2);
    assert_eq!(out.matches("\x1b[H\x1b[2J").count(), 2);
    assert!(out.contains("CPS"));
}

/// Issue 10 #5: `--interval 1e300` panicked in `Duration::from_secs_f64`
/// after the first frame; out-of-range intervals are refused before any
/// request, and 2 frames at the top of the range still work.
#[test]
fn top_interval_is_bounded() {
    let s = server();
    for bad in ["1e300", "3601", "0.05", "NaN", "inf"] {
        let r = s.weir(&["top", "--iterations", "2", "--interval", bad]);
        assert_eq!(r.0, ExitCode::from(2), "--interval {bad}: {r:?}");
        assert!(
            r.2.contains("--interval") && r.2.contains("outside 0.1..=3600 seconds"),
            "--interval {bad}: {}",
            r.2
        );
        assert!(r.1.is_empty(), "no frame for --interval {bad}: {}", r.1);
    }
    let out = ok(s.weir(&["top", "--iterations", "1", "--interval", "3600"]));
    assert_eq!(out.matches("weir top - ").count(), 1);
}

#[test]
fn e2e_errors_say_what_to_do() {
    let s = server();
    let r = s.weir_as("wrong", &["list"]);
    assert_eq!(r.0, ExitCode::from(1));
    assert!(r.2.contains("401") && r.2.contains("--token"), "{}", r.2);
    let r = s.weir_as("ro", &["backend", "del", "acme/web", "10.1.0.1:8080"]);
    assert_eq!(r.0, ExitCode::from(1));
    assert!(r.2.contains("403") && r.2.contains("read-only"), "{}", r.2);

    // Nothing listening there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let cli = Cli::try_parse_from([
        "weir",
        "list",
        "--admin",
        &format!("127.0.0.1:{port}"),
        "--token",
        "x",
    ])
    .unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = weir::cli::run_with(cli.cmd, &mut out, &mut err);
    let err = String::from_utf8(err).unwrap();
    assert_eq!(code, ExitCode::from(2));
    assert!(
        err.contains("cannot reach") && err.contains("WEIR_ADMIN"),
        "{err}"
    );
}

#[test]
fn e2e_config_file_gives_address_and_token() {
    let s = server();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    std::fs::create_dir_all(&dir).unwrap();
    let tok = dir.join("tok");
    std::fs::write(&tok, format!("{TOKEN}\n")).unwrap();
    let cfg = dir.join("weir.toml");
    std::fs::write(
        &cfg,
        format!(
            "[admin]\nlisten = \"{}\"\ntoken_file = \"{}\"\n\n[[service]]\nname = \"x\"\nprotocol = \"tcp\"\nlisten = \"1.2.3.4:5\"\n",
            s.url.trim_start_matches("http://"),
            tok.display()
        ),
    )
    .unwrap();
    let cli =
        Cli::try_parse_from(["weir", "list", "--json", "--config", cfg.to_str().unwrap()]).unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = weir::cli::run_with(cli.cmd, &mut out, &mut err);
    assert_eq!(code, ExitCode::SUCCESS, "{}", String::from_utf8_lossy(&err));
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A raw HTTP server on loopback answering up to `max` requests, each with
/// status 200 and `body(request line)`; returns its URL and a count of the
/// requests it answered. It stops answering (closes its listener) after
/// `max`, so a client that keeps asking fails instead of looping forever.
fn raw_server(
    max: usize,
    body: impl Fn(&str) -> String + Send + 'static,
) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{BufRead, BufReader, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = seen.clone();
    std::thread::spawn(move || {
        for _ in 0..max {
            let Ok((s, _)) = l.accept() else { return };
            let mut r = BufReader::new(s);
            let mut first = String::new();
            if r.read_line(&mut first).is_err() {
                continue;
            }
            // The rest of the head, then the body (read, so that closing
            // the connection does not reset it under the answer).
            let mut len = 0usize;
            loop {
                let mut line = String::new();
                match r.read_line(&mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) if line == "\r\n" => break,
                    Ok(_) => {
                        let l = line.to_ascii_lowercase();
                        if let Some(v) = l.strip_prefix("content-length:") {
                            len = v.trim().parse().unwrap_or(0);
                        }
                    }
                }
            }
            let mut body_in = vec![0u8; len];
            if std::io::Read::read_exact(&mut r, &mut body_in).is_err() {
                continue;
            }
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let b = body(&first);
            let mut s = r.into_inner();
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n{b}",
                b.len()
            );
        }
    });
    (url, seen)
}

/// A daemon (a wrong or buggy one) whose `next` cursor does not move:
/// `weir conns` stops at once with an error instead of asking for the
/// same page forever (it did; each round printed the page again).
#[test]
fn conns_stops_when_the_cursor_does_not_move() {
    let conn = serde_json::to_value(
        Fake::sample()
            .connections(&Default::default(), None, 1)
            .unwrap()
            .connections[0]
            .clone(),
    )
    .unwrap();
    for connections in [vec![], vec![conn]] {
        let page = serde_json::json!({ "connections": connections, "next": "c1" }).to_string();
        let (url, seen) = raw_server(50, move |_| page.clone());
        let (code, _, err) = cli_util::run(&url, TOKEN, &["conns", "--json"]);
        let seen = seen.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(code, ExitCode::from(2), "{err}");
        assert!(err.contains("cursor"), "{err}");
        assert_eq!(seen, 2, "pages asked for: {seen}");
    }
}

/// Something other than weir answering 2xx with a body that is not JSON
/// (a proxy's page, another service on the port): the write commands say
/// so and exit 2. They took it for an empty answer: `weir kill` printed
/// "killed 0 connections" and exited 0.
#[test]
fn a_write_answered_with_something_else_than_json_fails() {
    for args in [
        &["kill", "--all"][..],
        &["tenant", "del", "acme"][..],
        &["reload", "--json"][..],
    ] {
        let (url, _) = raw_server(1, |_| "<html>maintenance</html>".into());
        let (code, out, err) = cli_util::run(&url, TOKEN, args);
        assert_eq!(code, ExitCode::from(2), "{args:?}: {out}{err}");
        assert!(err.contains("unexpected answer"), "{args:?}: {err}");
        assert_eq!(out, "", "{args:?}");
    }
}

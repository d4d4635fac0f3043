//! Measurement for docs/BENCHMARKS.md ("Startup with thousands of
//! services"): how long `Daemon::start` takes to have N UDP services
//! listening, and a reload that adds N services to a daemon that has none;
//! and how long deleting a tenant with N services, and a reload removing
//! N services, take; and how long start and a reload take with N tenants.
//! Prints figures, asserts only that every service (or tenant) is up (or
//! gone).
//!
//! `cargo test --release -p weir --test daemon_startup_scale -- --ignored --nocapture`
//! (`WEIR_SCALE_N=1000,4000` picks the counts; `WEIR_SCALE_PORT=20000`
//! listens on ports from 20000 up instead of port 0;
//! `WEIR_SCALE_TENANTS=1000,10000` picks the tenant counts).

mod daemon_util;

use std::time::Instant;

use daemon_util::*;
use weir::config::{Protocol, ServiceSpec, TenantSpec};
use weir::daemon::Daemon;

fn counts() -> Vec<usize> {
    counts_of("WEIR_SCALE_N", "1000,4000")
}

/// The counts in variable `var` (comma-separated), or in `default`.
fn counts_of(var: &str, default: &str) -> Vec<usize> {
    std::env::var(var)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|n| {
            n.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{var}: counts, comma-separated"))
        })
        .collect()
}

/// `n` UDP services without backends, on port 0 or on consecutive ports
/// from `WEIR_SCALE_PORT`.
fn services(n: usize) -> Vec<ServiceSpec> {
    let base: Option<u16> = std::env::var("WEIR_SCALE_PORT")
        .ok()
        .map(|p| p.parse().expect("WEIR_SCALE_PORT: a port"));
    (0..n)
        .map(|i| {
            let mut s = service(&format!("s{i}"), Protocol::Udp, "rr", Vec::new());
            if let Some(b) = base {
                s.listen.set_port(b + i as u16);
            }
            s
        })
        .collect()
}

#[test]
#[ignore = "measurement, prints figures"]
fn startup_and_reload_with_many_services() {
    for n in counts() {
        let t = Instant::now();
        let d = Daemon::start(config(services(n)), None).unwrap();
        let start = t.elapsed();
        assert!(d.service_addr("default", &format!("s{}", n - 1)).is_some());
        d.shutdown();

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("weir.toml");
        std::fs::write(&path, "").unwrap();
        let d = Daemon::start(config(Vec::new()), Some(path.clone())).unwrap();
        let mut cfg = d.control().running_config();
        cfg.services = services(n);
        std::fs::write(&path, toml::to_string(&cfg).unwrap()).unwrap();
        let t = Instant::now();
        let report = d.control().reload(Default::default());
        let reload = t.elapsed();
        let report = report.unwrap();
        assert_eq!(report.added.len(), n);
        assert!(d.service_addr("default", &format!("s{}", n - 1)).is_some());
        // Once more, the file unchanged: nothing to do.
        let t = Instant::now();
        let report = d.control().reload(Default::default()).unwrap();
        let again = t.elapsed();
        assert!(report.added.is_empty() && report.changed.is_empty());
        d.shutdown();
        println!(
            "{n} UDP services: start {:.3} s, reload adding them {:.3} s, \
             reload unchanged {:.3} s",
            start.as_secs_f64(),
            reload.as_secs_f64(),
            again.as_secs_f64()
        );
    }
}

#[test]
#[ignore = "measurement, prints figures"]
fn delete_tenant_and_reload_removing_many_services() {
    for n in counts() {
        let mut cfg = config(
            services(n)
                .into_iter()
                .map(|mut s| {
                    s.tenant = "t".into();
                    s
                })
                .collect(),
        );
        cfg.tenants.push(TenantSpec {
            name: "t".into(),
            ..Default::default()
        });
        let d = Daemon::start(cfg, None).unwrap();
        assert!(d.service_addr("t", &format!("s{}", n - 1)).is_some());
        let t = Instant::now();
        d.control().delete_tenant("t").unwrap();
        let delete = t.elapsed();
        assert!(d.service_addr("t", "s0").is_none());
        d.shutdown();

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("weir.toml");
        let d = Daemon::start(config(services(n)), Some(path.clone())).unwrap();
        let mut cfg = d.control().running_config();
        cfg.services.clear();
        std::fs::write(&path, toml::to_string(&cfg).unwrap()).unwrap();
        let t = Instant::now();
        let report = d.control().reload(Default::default());
        let reload = t.elapsed();
        assert_eq!(report.unwrap().removed.len(), n);
        assert!(d.service_addr("default", "s0").is_none());
        d.shutdown();
        println!(
            "{n} UDP services: delete their tenant {:.3} s, reload removing them {:.3} s",
            delete.as_secs_f64(),
            reload.as_secs_f64()
        );
    }
}

/// `n` tenants on the shared flow table (named `t0`...).
fn tenants(n: usize) -> Vec<TenantSpec> {
    (0..n)
        .map(|i| TenantSpec {
            name: format!("t{i}"),
            ..Default::default()
        })
        .collect()
}

#[test]
#[ignore = "measurement, prints figures"]
fn startup_and_reload_with_many_tenants() {
    for n in counts_of("WEIR_SCALE_TENANTS", "1000,10000") {
        let mut cfg = config(Vec::new());
        cfg.tenants = tenants(n);
        let t = Instant::now();
        let d = Daemon::start(cfg, None).unwrap();
        let start = t.elapsed();
        assert_eq!(d.control().tenants().len(), n + 1);
        d.shutdown();

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("weir.toml");
        let d = Daemon::start(config(Vec::new()), Some(path.clone())).unwrap();
        let mut cfg = d.control().running_config();
        cfg.tenants.extend(tenants(n));
        std::fs::write(&path, toml::to_string(&cfg).unwrap()).unwrap();
        let t = Instant::now();
        let report = d.control().reload(Default::default());
        let reload = t.elapsed();
        assert_eq!(report.unwrap().added.len(), n);
        assert_eq!(d.control().tenants().len(), n + 1);
        // Once more, the file unchanged: nothing to do.
        let t = Instant::now();
        let report = d.control().reload(Default::default()).unwrap();
        let again = t.elapsed();
        assert!(report.added.is_empty() && report.changed.is_empty());
        // And a reload deleting them all.
        let mut cfg = d.control().running_config();
        cfg.tenants.retain(|t| t.name == "default");
        std::fs::write(&path, toml::to_string(&cfg).unwrap()).unwrap();
        let t = Instant::now();
        let report = d.control().reload(Default::default()).unwrap();
        let delete = t.elapsed();
        assert_eq!(report.removed.len(), n);
        assert_eq!(d.control().tenants().len(), 1);
        d.shutdown();
        println!(
            "{n} tenants: start {:.3} s, reload adding them {:.3} s, \
             reload unchanged {:.3} s, reload deleting them {:.3} s",
            start.as_secs_f64(),
            reload.as_secs_f64(),
            again.as_secs_f64(),
            delete.as_secs_f64()
        );
    }
}

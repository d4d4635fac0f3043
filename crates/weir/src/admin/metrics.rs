//! Prometheus `/metrics` (OpenMetrics text) built from one snapshot of the
//! [`Control`] reports per scrape.
//!
//! A fresh registry per scrape keeps the exporter stateless: services,
//! backends and tenants that were deleted disappear from the next scrape,
//! and nothing here has to follow runtime changes. The cost is O(services +
//! backends + tenants) per scrape, which is what any exporter pays.
//!
//! Names follow Prometheus conventions: counters end in `_total`, byte
//! counters in `_bytes_total`, durations in `_seconds`; the EWMA rates the
//! daemon already computes (IPVS-style, 2 s) are gauges `*_per_second`.
//! Labels: `tenant`, `service`, `backend` (IP:PORT), `placement`, `reason`,
//! `worker` (a packet worker's thread name).
//!
//! | metric | type | labels |
//! | --- | --- | --- |
//! | `weir_{backend,service,tenant}_connections_total` | counter | scope |
//! | `weir_{backend,service,tenant}_{in,out}_packets_total` | counter | scope |
//! | `weir_{backend,service,tenant}_{in,out}_bytes_total` | counter | scope |
//! | `weir_{backend,service,tenant}_connections_per_second` | gauge | scope |
//! | `weir_{backend,service,tenant}_{in,out}_packets_per_second` | gauge | scope |
//! | `weir_{backend,service,tenant}_{in,out}_bytes_per_second` | gauge | scope |
//! | `weir_backend_{active,inactive}_connections`, `weir_backend_weight` | gauge | backend |
//! | `weir_backend_up` (1 = up or unchecked, 0 = down) | gauge | backend |
//! | `weir_tenant_active_connections`, `weir_tenant_refused_connections_total` | gauge, counter | tenant |
//! | `weir_connections_total`, `weir_{in,out}_{packets,bytes}_total` | counter | — |
//! | `weir_active_connections` | gauge | — |
//! | `weir_refused_connections_total` | counter | reason |
//! | `weir_udp_dropped_datagrams_total` | counter | reason |
//! | `weir_udp_early_drops_total` | counter | — |
//! | `weir_table_{entries,buckets,max_chain_length}`, `weir_table_load_factor` | gauge | tenant, placement |
//! | `weir_table_refused_inserts_total` | counter | tenant, placement |
//! | `weir_packet_{received,transmitted}_frames_total`, `weir_packet_flows_total` | counter | — |
//! | `weir_packet_dropped_frames_total` | counter | reason |
//! | `weir_packet_worker_{received,transmitted}_frames_total` | counter | worker |
//! | `weir_packet_worker_dropped_frames_total` | counter | worker, reason |
//! | `weir_estimator_tick_duration_seconds`, `weir_estimator_tick_max_duration_seconds` | gauge | — |
//! | `weir_workers_accepting` (proxy workers taking new TCP connections) | gauge | — |
//! | `weir_worker_accepted_connections_total` | counter | worker |
//! | `process_open_fds`, `process_max_fds` | gauge | — |

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use super::handlers::{tenant_figures, tenant_sums};
use crate::control::{Control, GlobalStats, Rates, Totals};

type Labels = Vec<(String, String)>;
type CounterFam = Family<Labels, Counter<u64>>;
type GaugeFam = Family<Labels, Gauge<i64>>;
type FloatFam = Family<Labels, Gauge<f64, AtomicU64>>;

/// The metrics of one scope (backend, service, tenant or global).
struct Traffic {
    conns: CounterFam,
    inpkts: CounterFam,
    outpkts: CounterFam,
    inbytes: CounterFam,
    outbytes: CounterFam,
    cps: GaugeFam,
    inpps: GaugeFam,
    outpps: GaugeFam,
    inbps: GaugeFam,
    outbps: GaugeFam,
}

impl Traffic {
    fn register(reg: &mut Registry, prefix: &str, what: &str) -> Self {
        let t = Self {
            conns: CounterFam::default(),
            inpkts: CounterFam::default(),
            outpkts: CounterFam::default(),
            inbytes: CounterFam::default(),
            outbytes: CounterFam::default(),
            cps: GaugeFam::default(),
            inpps: GaugeFam::default(),
            outpps: GaugeFam::default(),
            inbps: GaugeFam::default(),
            outbps: GaugeFam::default(),
        };
        let p = prefix;
        reg.register(
            format!("{p}connections"),
            format!("Connections (TCP) and sessions (UDP) scheduled, {what}"),
            t.conns.clone(),
        );
        reg.register(
            format!("{p}in_packets"),
            format!("Packets from clients to backends, {what}"),
            t.inpkts.clone(),
        );
        reg.register(
            format!("{p}out_packets"),
            format!("Packets from backends to clients, {what}"),
            t.outpkts.clone(),
        );
        reg.register_with_unit(
            format!("{p}in"),
            format!("Bytes from clients to backends, {what}"),
            Unit::Bytes,
            t.inbytes.clone(),
        );
        reg.register_with_unit(
            format!("{p}out"),
            format!("Bytes from backends to clients, {what}"),
            Unit::Bytes,
            t.outbytes.clone(),
        );
        reg.register(
            format!("{p}connections_per_second"),
            format!("New connections per second (2 s EWMA), {what}"),
            t.cps.clone(),
        );
        reg.register(
            format!("{p}in_packets_per_second"),
            format!("Packets per second from clients (2 s EWMA), {what}"),
            t.inpps.clone(),
        );
        reg.register(
            format!("{p}out_packets_per_second"),
            format!("Packets per second from backends (2 s EWMA), {what}"),
            t.outpps.clone(),
        );
        reg.register(
            format!("{p}in_bytes_per_second"),
            format!("Bytes per second from clients (2 s EWMA), {what}"),
            t.inbps.clone(),
        );
        reg.register(
            format!("{p}out_bytes_per_second"),
            format!("Bytes per second from backends (2 s EWMA), {what}"),
            t.outbps.clone(),
        );
        t
    }

    fn set(&self, l: &Labels, s: &Totals, r: &Rates) {
        self.conns.get_or_create(l).inc_by(s.conns);
        self.inpkts.get_or_create(l).inc_by(s.inpkts);
        self.outpkts.get_or_create(l).inc_by(s.outpkts);
        self.inbytes.get_or_create(l).inc_by(s.inbytes);
        self.outbytes.get_or_create(l).inc_by(s.outbytes);
        self.cps.get_or_create(l).set(sat(r.cps));
        self.inpps.get_or_create(l).set(sat(r.inpps));
        self.outpps.get_or_create(l).set(sat(r.outpps));
        self.inbps.get_or_create(l).set(sat(r.inbps));
        self.outbps.get_or_create(l).set(sat(r.outbps));
    }
}

fn sat(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn gauge(reg: &mut Registry, name: &str, help: &str) -> GaugeFam {
    let f = GaugeFam::default();
    reg.register(name, help, f.clone());
    f
}

fn counter(reg: &mut Registry, name: &str, help: &str) -> CounterFam {
    let f = CounterFam::default();
    reg.register(name, help, f.clone());
    f
}

/// Packet mode per worker (one per AF_XDP queue or AF_PACKET socket): the
/// daemon-wide figures broken down, so a dashboard shows which queue drops.
fn packet_worker_metrics(reg: &mut Registry, workers: &[crate::control::PacketWorkerStats]) {
    if workers.is_empty() {
        return;
    }
    let rx = counter(
        reg,
        "weir_packet_worker_received_frames",
        "Packet mode: frames received, per worker",
    );
    let tx = counter(
        reg,
        "weir_packet_worker_transmitted_frames",
        "Packet mode: frames rewritten and transmitted, per worker",
    );
    let dropped = counter(
        reg,
        "weir_packet_worker_dropped_frames",
        "Packet mode: frames dropped, per worker and reason",
    );
    for w in workers {
        let l = labels(&[("worker", &w.worker)]);
        rx.get_or_create(&l).inc_by(w.counts.rx);
        tx.get_or_create(&l).inc_by(w.counts.tx);
        for (reason, n) in &w.counts.dropped {
            dropped
                .get_or_create(&labels(&[("worker", &w.worker), ("reason", reason)]))
                .inc_by(*n);
        }
    }
}

/// Daemon-wide metrics: unlabelled (except `reason`), so registered one by one.
fn global_metrics(reg: &mut Registry, g: &GlobalStats) {
    let counter = |reg: &mut Registry, name: &str, help: &str, unit: Option<Unit>, v: u64| {
        let c: Counter<u64> = Counter::default();
        c.inc_by(v);
        match unit {
            Some(u) => reg.register_with_unit(name, help, u, c),
            None => reg.register(name, help, c),
        }
    };
    let gauge = |reg: &mut Registry, name: &str, help: &str, v: u64| {
        let x: Gauge<i64> = Gauge::default();
        x.set(sat(v));
        reg.register(name, help, x);
    };
    let seconds = |reg: &mut Registry, name: &str, help: &str, v: f64| {
        let x: Gauge<f64, AtomicU64> = Gauge::default();
        x.set(v);
        reg.register_with_unit(name, help, Unit::Seconds, x);
    };
    let what = "daemon-wide";
    counter(
        reg,
        "weir_connections",
        &format!("Connections (TCP) and sessions (UDP) scheduled, {what}"),
        None,
        g.stats.conns,
    );
    counter(
        reg,
        "weir_in_packets",
        &format!("Packets from clients to backends, {what}"),
        None,
        g.stats.inpkts,
    );
    counter(
        reg,
        "weir_out_packets",
        &format!("Packets from backends to clients, {what}"),
        None,
        g.stats.outpkts,
    );
    counter(
        reg,
        "weir_in",
        &format!("Bytes from clients to backends, {what}"),
        Some(Unit::Bytes),
        g.stats.inbytes,
    );
    counter(
        reg,
        "weir_out",
        &format!("Bytes from backends to clients, {what}"),
        Some(Unit::Bytes),
        g.stats.outbytes,
    );
    gauge(
        reg,
        "weir_connections_per_second",
        &format!("New connections per second (2 s EWMA), {what}"),
        g.rates.cps,
    );
    gauge(
        reg,
        "weir_in_packets_per_second",
        &format!("Packets per second from clients (2 s EWMA), {what}"),
        g.rates.inpps,
    );
    gauge(
        reg,
        "weir_out_packets_per_second",
        &format!("Packets per second from backends (2 s EWMA), {what}"),
        g.rates.outpps,
    );
    gauge(
        reg,
        "weir_in_bytes_per_second",
        &format!("Bytes per second from clients (2 s EWMA), {what}"),
        g.rates.inbps,
    );
    gauge(
        reg,
        "weir_out_bytes_per_second",
        &format!("Bytes per second from backends (2 s EWMA), {what}"),
        g.rates.outbps,
    );
    gauge(
        reg,
        "weir_active_connections",
        "Live connections and sessions, all tenants",
        g.active_conns,
    );
    let refused = CounterFam::default();
    for (reason, n) in &g.refused {
        refused
            .get_or_create(&labels(&[("reason", reason)]))
            .inc_by(*n);
    }
    reg.register(
        "weir_refused_connections",
        "Connections and sessions refused, by reason",
        refused,
    );
    let udp_dropped = CounterFam::default();
    for (reason, n) in &g.udp_dropped {
        udp_dropped
            .get_or_create(&labels(&[("reason", reason)]))
            .inc_by(*n);
    }
    reg.register(
        "weir_udp_dropped_datagrams",
        "UDP proxy: datagrams dropped (a client's or a backend's reply), by reason",
        udp_dropped,
    );
    counter(
        reg,
        "weir_udp_early_drops",
        "UDP proxy: sessions that carried a single datagram, ended to make room for a new one at a connection limit or out of descriptors (spoofed flood defence)",
        None,
        g.udp_early_drops,
    );
    if let Some(p) = &g.packet {
        counter(
            reg,
            "weir_packet_received_frames",
            "Packet mode: frames received from the rings",
            None,
            p.counts.rx,
        );
        counter(
            reg,
            "weir_packet_transmitted_frames",
            "Packet mode: frames rewritten and transmitted",
            None,
            p.counts.tx,
        );
        counter(
            reg,
            "weir_packet_flows",
            "Packet mode: flows created",
            None,
            p.counts.new_flows,
        );
        counter(
            reg,
            "weir_packet_icmp_errors",
            "Packet mode: ICMP errors about flows (need-to-fragment, unreachable, ...), translated and forwarded",
            None,
            p.counts.icmp_errors,
        );
        counter(
            reg,
            "weir_packet_rst_ignored",
            "Packet mode: TCP RSTs too far from their sender's sequence number to end a flow (forwarded; blind resets)",
            None,
            p.counts.rst_ignored,
        );
        counter(
            reg,
            "weir_packet_fin_ignored",
            "Packet mode: TCP FINs too far from their sender's sequence number to move a flow towards its end (forwarded; blind FINs)",
            None,
            p.counts.fin_ignored,
        );
        counter(
            reg,
            "weir_packet_seq_ignored",
            "Packet mode: other TCP segments too far from their sender's sequence number to keep a flow alive (forwarded; blind ACKs and data)",
            None,
            p.counts.seq_ignored,
        );
        counter(
            reg,
            "weir_packet_early_drops",
            "Packet mode: flows that never got going (TCP in SYN_RECV; a single packet from the client; no reply) ended, those due soonest first, to make room for a new flow at a connection limit or a full table (SYN and spoofed UDP flood defence)",
            None,
            p.counts.early_drops,
        );
        let dropped = CounterFam::default();
        for (reason, n) in &p.counts.dropped {
            dropped
                .get_or_create(&labels(&[("reason", reason)]))
                .inc_by(*n);
        }
        reg.register(
            "weir_packet_dropped_frames",
            "Packet mode: frames dropped, by reason",
            dropped,
        );
        packet_worker_metrics(reg, &p.workers);
    }
    seconds(
        reg,
        "weir_estimator_tick_duration",
        "Duration of the last rate-estimator tick",
        g.estimator_tick_seconds,
    );
    seconds(
        reg,
        "weir_estimator_tick_max_duration",
        "Longest rate-estimator tick since start",
        g.estimator_tick_max_seconds,
    );
    if let Some(w) = &g.workers {
        gauge(
            reg,
            "weir_workers_accepting",
            "Proxy workers taking new TCP connections now (accept steering)",
            w.accepting,
        );
        let accepted = CounterFam::default();
        for (i, n) in w.accepted.iter().enumerate() {
            accepted
                .get_or_create(&labels(&[("worker", &i.to_string())]))
                .inc_by(*n);
        }
        reg.register(
            "weir_worker_accepted_connections",
            "TCP connections each proxy worker accepted",
            accepted,
        );
    }
    gauge(
        reg,
        "process_open_fds",
        "Number of open file descriptors",
        g.open_fds,
    );
    gauge(
        reg,
        "process_max_fds",
        "Maximum number of open file descriptors (RLIMIT_NOFILE soft limit)",
        g.fd_limit,
    );
}

/// How long a render of `/metrics` is served again when anyone may ask
/// for it (`[admin] metrics_public`): Prometheus scrapes every 15 s or so,
/// and a client asking in a loop gets one render a second.
pub(crate) const PUBLIC_RENDER_TTL: std::time::Duration = std::time::Duration::from_secs(1);

/// The last render of `/metrics` and when it was made, for
/// [`PUBLIC_RENDER_TTL`]. The lock is held across a render, so requests
/// meanwhile wait for that one rather than each making its own.
#[derive(Debug, Default)]
pub(crate) struct Cache {
    last: tokio::sync::Mutex<Option<(tokio::time::Instant, axum::body::Bytes)>>,
}

impl Cache {
    /// The last render if made within `ttl`, else `render`'s, kept. A
    /// render is O(services + backends + tenants) (5,000 services:
    /// 100-350 ms); the caller's runs on the blocking pool
    /// ([`AppState::off_runtime`](super::AppState::off_runtime)), off the
    /// worker that serves every other admin request and the health checks.
    pub(crate) async fn get(
        &self,
        ttl: std::time::Duration,
        render: impl std::future::Future<Output = Result<axum::body::Bytes, String>>,
    ) -> Result<axum::body::Bytes, String> {
        let mut last = self.last.lock().await;
        if let Some((at, text)) = &*last
            && at.elapsed() < ttl
        {
            return Ok(text.clone());
        }
        let text = render.await?;
        *last = Some((tokio::time::Instant::now(), text.clone()));
        Ok(text)
    }
}

/// Render every metric from one snapshot of `control`.
pub fn render(control: &dyn Control) -> Result<String, std::fmt::Error> {
    let services = control.services();
    let tenants = control.tenants();
    let table = control.table();
    let global = control.global_stats();

    let mut reg = Registry::default();
    let backend = Traffic::register(&mut reg, "weir_backend_", "per backend");
    let b_active = gauge(
        &mut reg,
        "weir_backend_active_connections",
        "Established TCP connections to this backend (IPVS ActConn)",
    );
    let b_inactive = gauge(
        &mut reg,
        "weir_backend_inactive_connections",
        "TCP connections to this backend in other states, and its UDP sessions (IPVS InActConn)",
    );
    let b_weight = gauge(
        &mut reg,
        "weir_backend_weight",
        "Current weight (0 = quiesced or drained)",
    );
    let b_up = gauge(
        &mut reg,
        "weir_backend_up",
        "1 if the backend is up or not health-checked, 0 if down",
    );
    let service = Traffic::register(&mut reg, "weir_service_", "per virtual service");
    let tenant = Traffic::register(&mut reg, "weir_tenant_", "per tenant");
    let t_active = gauge(
        &mut reg,
        "weir_tenant_active_connections",
        "Live connections and sessions of this tenant",
    );
    let t_refused = counter(
        &mut reg,
        "weir_tenant_refused_connections",
        "Connections and sessions refused by this tenant's limits",
    );
    let tb_entries = gauge(
        &mut reg,
        "weir_table_entries",
        "Flow-table entries of this tenant (connections, sessions, persistence templates)",
    );
    let tb_buckets = gauge(
        &mut reg,
        "weir_table_buckets",
        "Buckets of the flow table this tenant lives in",
    );
    let tb_chain = gauge(
        &mut reg,
        "weir_table_max_chain_length",
        "Longest chain of the flow table this tenant lives in",
    );
    let tb_load = FloatFam::default();
    reg.register(
        "weir_table_load_factor",
        "Index entries per way (11 a bucket) of the flow table this tenant lives in",
        tb_load.clone(),
    );
    let tb_refused = counter(
        &mut reg,
        "weir_table_refused_inserts",
        "Inserts refused by the chain-length cap (hash-flood defence)",
    );
    for s in &services {
        let sl = labels(&[("tenant", &s.tenant), ("service", &s.name)]);
        service.set(&sl, &s.stats, &s.rates);
        for b in &s.backends {
            let bl = labels(&[
                ("tenant", &s.tenant),
                ("service", &s.name),
                ("backend", &b.address),
            ]);
            backend.set(&bl, &b.stats, &b.rates);
            b_active.get_or_create(&bl).set(sat(b.active_conns));
            b_inactive.get_or_create(&bl).set(sat(b.inactive_conns));
            b_weight.get_or_create(&bl).set(i64::from(b.weight));
            b_up.get_or_create(&bl).set(i64::from(b.health != "down"));
        }
    }
    let sums = tenant_sums(&services);
    for t in &tenants {
        let tl = labels(&[("tenant", &t.spec.name)]);
        let (tot, rat) = tenant_figures(t, &sums);
        tenant.set(&tl, &tot, &rat);
        t_active.get_or_create(&tl).set(sat(t.active_conns));
        t_refused.get_or_create(&tl).inc_by(t.refused);
    }
    global_metrics(&mut reg, &global);
    for r in &table {
        let l = labels(&[("tenant", &r.tenant), ("placement", &r.placement)]);
        tb_entries.get_or_create(&l).set(sat(r.entries));
        tb_buckets.get_or_create(&l).set(sat(r.buckets));
        tb_chain.get_or_create(&l).set(sat(r.max_chain));
        tb_load.get_or_create(&l).set(r.load_factor);
        tb_refused.get_or_create(&l).inc_by(r.refused_inserts);
    }
    let mut out = String::new();
    encode(&mut out, &reg)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{PacketCounters, PacketStats, PacketWorkerStats};

    /// Packet mode's figures per worker reach `/metrics` under a `worker`
    /// label, beside the daemon-wide sums.
    #[test]
    fn packet_workers_are_labelled_by_name() {
        let w = |name: &str, rx, dropped: &[(&str, u64)]| PacketWorkerStats {
            worker: name.into(),
            counts: PacketCounters {
                rx,
                tx: rx - 1,
                dropped: dropped.iter().map(|&(r, n)| (r.to_owned(), n)).collect(),
                ..PacketCounters::default()
            },
        };
        let g = GlobalStats {
            packet: Some(PacketStats {
                io: "xdp".into(),
                counts: PacketCounters {
                    rx: 30,
                    tx: 28,
                    dropped: [("kernel_rx_ring_full".to_owned(), 9)]
                        .into_iter()
                        .collect(),
                    ..PacketCounters::default()
                },
                workers: vec![
                    w("weir-pkt-q0", 10, &[]),
                    w("weir-pkt-q1", 20, &[("kernel_rx_ring_full", 9)]),
                ],
            }),
            ..GlobalStats::default()
        };
        let mut reg = Registry::default();
        global_metrics(&mut reg, &g);
        let mut text = String::new();
        encode(&mut text, &reg).unwrap();
        for needle in [
            "weir_packet_received_frames_total 30",
            r#"weir_packet_dropped_frames_total{reason="kernel_rx_ring_full"} 9"#,
            r#"weir_packet_worker_received_frames_total{worker="weir-pkt-q0"} 10"#,
            r#"weir_packet_worker_received_frames_total{worker="weir-pkt-q1"} 20"#,
            r#"weir_packet_worker_transmitted_frames_total{worker="weir-pkt-q1"} 19"#,
            r#"weir_packet_worker_dropped_frames_total{worker="weir-pkt-q1",reason="kernel_rx_ring_full"} 9"#,
        ] {
            assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
        }
        assert!(
            !text.contains(r#"weir_packet_worker_dropped_frames_total{worker="weir-pkt-q0""#),
            "a worker with no drops has no drop series:\n{text}"
        );
    }

    /// The UDP proxy's dropped datagrams reach `/metrics` by reason.
    #[test]
    fn udp_drops_are_labelled_by_reason() {
        let g = GlobalStats {
            udp_dropped: [("backend_busy".to_owned(), 3)].into_iter().collect(),
            ..GlobalStats::default()
        };
        let mut reg = Registry::default();
        global_metrics(&mut reg, &g);
        let mut text = String::new();
        encode(&mut text, &reg).unwrap();
        let needle = r#"weir_udp_dropped_datagrams_total{reason="backend_busy"} 3"#;
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
}

//! Pure renderers: report types in, text out. No I/O, no clock, so the
//! golden tests in `tests/cli_golden.rs` pin every column.
//!
//! Layouts follow ipvsadm where there is an ipvsadm equivalent: `-Ln`,
//! `-Ln --stats`, `-Ln --rate` (numbers with K/M/G/T suffixes unless
//! `--exact`, exactly like ipvsadm's `print_largenum`) and `-Lnc`.

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::control::{
    ConnInfo, GlobalStats, HealthEntry, Rates, ReloadReport, ServiceStatus, TableReport,
    TenantStatus, Totals,
};

/// What `weir list` shows per service and backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListMode {
    /// Scheduler, flags, weight, active and inactive connections.
    Plain,
    /// Cumulative counters (`--stats`).
    Stats,
    /// Rates (`--rate`).
    Rate,
}

/// A number as ipvsadm prints it: 9 columns wide; with `exact` all digits,
/// else above 10^8 scaled down with a K, M, G or T suffix.
pub fn largenum(n: u64, exact: bool) -> String {
    if exact {
        let s = n.to_string();
        let w = if s.len() <= 8 { 9 } else { s.len() + 1 };
        return format!("{s:>w$}");
    }
    if n < 100_000_000 {
        format!("{n:>9}")
    } else if n < 1_000_000_000 {
        format!("{:>8}K", n / 1_000)
    } else if n < 100_000_000_000 {
        format!("{:>8}M", n / 1_000_000)
    } else if n < 100_000_000_000_000 {
        format!("{:>8}G", n / 1_000_000_000)
    } else {
        format!("{:>8}T", n / 1_000_000_000_000)
    }
}

fn proto(p: &str) -> String {
    p.to_ascii_uppercase()
}

/// Service flags as ipvsadm prints them after the scheduler:
/// ` (sh-fallback,sh-port) persistent 300 mask 255.255.255.0`. The mask is
/// shown only with persistence and when it groups more than one address.
/// A packet service then says how it forwards (` forward nat`), which
/// ipvsadm shows per real server (Masq, Route); the proxy, weir's default,
/// says nothing.
fn flags(s: &ServiceStatus) -> String {
    let mut out = String::new();
    if !s.sched_flags.is_empty() {
        let _ = write!(out, " ({})", s.sched_flags.join(","));
    }
    let secs = s.persistence.trim_end_matches('s');
    let persistent = match secs.parse::<u64>() {
        Ok(0) => false,
        Ok(n) => {
            let _ = write!(out, " persistent {n}");
            true
        }
        // Not plain seconds ("5m"): show it as configured.
        Err(_) if s.persistence.is_empty() => false,
        Err(_) => {
            let _ = write!(out, " persistent {}", s.persistence);
            true
        }
    };
    if persistent
        && let Some(mask) = &s.persistence_netmask
        && !matches!(mask.trim(), "255.255.255.255" | "128")
    {
        let _ = write!(out, " mask {mask}");
    }
    if s.forward.is_packet() {
        let _ = write!(out, " forward {}", s.forward);
    }
    out
}

fn totals_cols(t: &Totals, exact: bool) -> String {
    [t.conns, t.inpkts, t.outpkts, t.inbytes, t.outbytes]
        .iter()
        .map(|n| largenum(*n, exact))
        .collect()
}

fn rates_cols(r: &Rates, exact: bool) -> String {
    [r.cps, r.inpps, r.outpps, r.inbps, r.outbps]
        .iter()
        .map(|n| largenum(*n, exact))
        .collect()
}

/// `weir list` (ipvsadm -Ln, with `--stats` / `--rate` / `--exact`).
pub fn render_list(services: &[ServiceStatus], mode: ListMode, exact: bool) -> String {
    let mut o = String::new();
    match mode {
        ListMode::Plain => {
            o.push_str("Prot LocalAddress:Port Scheduler Flags\n");
            o.push_str("  -> RemoteAddress:Port           Weight ActiveConn InActConn Health\n");
        }
        ListMode::Stats => {
            let _ = writeln!(
                o,
                "{:<33} {:>8} {:>8} {:>8} {:>8} {:>8}",
                "Prot LocalAddress:Port", "Conns", "InPkts", "OutPkts", "InBytes", "OutBytes"
            );
            o.push_str("  -> RemoteAddress:Port\n");
        }
        ListMode::Rate => {
            let _ = writeln!(
                o,
                "{:<33} {:>8} {:>8} {:>8} {:>8} {:>8}",
                "Prot LocalAddress:Port", "CPS", "InPPS", "OutPPS", "InBPS", "OutBPS"
            );
            o.push_str("  -> RemoteAddress:Port\n");
        }
    }
    for s in services {
        let id = format!("[{}/{}]", s.tenant, s.name);
        let head = format!("{}  {}", proto(&s.protocol), s.listen);
        match mode {
            ListMode::Plain => {
                let _ = writeln!(o, "{head} {}{} {id}", s.scheduler, flags(s));
            }
            ListMode::Stats => {
                let _ = writeln!(o, "{head:<33}{}  {id}", totals_cols(&s.stats, exact));
            }
            ListMode::Rate => {
                let _ = writeln!(o, "{head:<33}{}  {id}", rates_cols(&s.rates, exact));
            }
        }
        for b in &s.backends {
            match mode {
                ListMode::Plain => {
                    let _ = writeln!(
                        o,
                        "  -> {:<28} {:<6} {:<10} {:<9} {}",
                        b.address, b.weight, b.active_conns, b.inactive_conns, b.health
                    );
                }
                ListMode::Stats => {
                    let _ = writeln!(o, "  -> {:<28}{}", b.address, totals_cols(&b.stats, exact));
                }
                ListMode::Rate => {
                    let _ = writeln!(o, "  -> {:<28}{}", b.address, rates_cols(&b.rates, exact));
                }
            }
        }
    }
    o
}

fn totals_json(t: &Totals) -> [(&'static str, u64); 5] {
    [
        ("conns", t.conns),
        ("inpkts", t.inpkts),
        ("outpkts", t.outpkts),
        ("inbytes", t.inbytes),
        ("outbytes", t.outbytes),
    ]
}

fn rates_json(r: &Rates) -> [(&'static str, u64); 5] {
    [
        ("cps", r.cps),
        ("inpps", r.inpps),
        ("outpps", r.outpps),
        ("inbps", r.inbps),
        ("outbps", r.outbps),
    ]
}

fn extend(v: &mut Value, kv: &[(&'static str, u64)]) {
    if let Value::Object(m) = v {
        for (k, n) in kv {
            m.insert((*k).into(), json!(n));
        }
    }
}

/// `weir list --json`: `[{tenant, name, protocol, listen, forward, scheduler,
/// sched_flags, persistence, persistence_netmask,
/// backends: [{address, weight, active_conns, inactive_conns}]}]`, plus
/// cps/inpps/outpps/inbps/outbps under `--rate` and conns/inpkts/outpkts/
/// inbytes/outbytes under `--stats`, on services and backends.
pub fn list_json(services: &[ServiceStatus], mode: ListMode) -> Value {
    let add = |v: &mut Value, t: &Totals, r: &Rates| match mode {
        ListMode::Plain => {}
        ListMode::Stats => extend(v, &totals_json(t)),
        ListMode::Rate => extend(v, &rates_json(r)),
    };
    Value::Array(
        services
            .iter()
            .map(|s| {
                let backends: Vec<Value> = s
                    .backends
                    .iter()
                    .map(|b| {
                        let mut v = json!({
                            "address": b.address,
                            "weight": b.weight,
                            "active_conns": b.active_conns,
                            "inactive_conns": b.inactive_conns,
                        });
                        add(&mut v, &b.stats, &b.rates);
                        v
                    })
                    .collect();
                let mut v = json!({
                    "tenant": s.tenant,
                    "name": s.name,
                    "protocol": s.protocol,
                    "listen": s.listen,
                    "forward": s.forward,
                    "scheduler": s.scheduler,
                    "sched_flags": s.sched_flags,
                    "persistence": s.persistence,
                    "persistence_netmask": s.persistence_netmask,
                    "backends": backends,
                });
                add(&mut v, &s.stats, &s.rates);
                v
            })
            .collect(),
    )
}

/// Header of `weir conns` (ipvsadm -Lnc, plus tenant, bytes and cookie).
pub fn conns_header() -> String {
    format!(
        "{:<3} {:<6} {:<11} {:<21} {:<21} {:<21} {:<12} {:>10} {:>10} {}\n",
        "pro",
        "expire",
        "state",
        "source",
        "virtual",
        "destination",
        "tenant",
        "bytes_in",
        "bytes_out",
        "cookie"
    )
}

/// One line of `weir conns`.
pub fn conn_line(c: &ConnInfo) -> String {
    let expire = format!("{:02}:{:02}", c.expires_s / 60, c.expires_s % 60);
    format!(
        "{:<3} {:<6} {:<11} {:<21} {:<21} {:<21} {:<12} {:>10} {:>10} {}\n",
        c.proto,
        expire,
        c.state,
        c.client,
        c.virtual_,
        c.backend,
        c.tenant,
        c.bytes_in,
        c.bytes_out,
        c.cookie
    )
}

/// `weir conns` for a whole list (the CLI streams page by page instead).
pub fn render_conns(conns: &[ConnInfo]) -> String {
    let mut o = conns_header();
    for c in conns {
        o.push_str(&conn_line(c));
    }
    o
}

/// `weir stats table`.
pub fn render_table(reports: &[TableReport]) -> String {
    let mut o = format!(
        "{:<16} {:<9} {:>10} {:>10} {:>6} {:>8} {:>8}  {}\n",
        "Tenant",
        "Placement",
        "Entries",
        "Buckets",
        "Load",
        "MaxChain",
        "Refused",
        "Chains (length:buckets)"
    );
    for r in reports {
        let last = r.chain_histogram.len().saturating_sub(1);
        let hist: Vec<String> = r
            .chain_histogram
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(i, n)| {
                if i == last && i > 0 {
                    format!("{i}+:{n}")
                } else {
                    format!("{i}:{n}")
                }
            })
            .collect();
        let _ = writeln!(
            o,
            "{:<16} {:<9} {:>10} {:>10} {:>6.2} {:>8} {:>8}  {}",
            r.tenant,
            r.placement,
            r.entries,
            r.buckets,
            r.load_factor,
            r.max_chain,
            r.refused_inserts,
            hist.join(" ")
        );
    }
    o
}

/// `weir tenant list`.
pub fn render_tenants(tenants: &[TenantStatus]) -> String {
    let mut o = format!(
        "{:<16} {:<6} {:>10} {:>10} {:>10} {:>10} {:>10}\n",
        "Tenant", "Table", "TableSize", "MaxConns", "MaxNew/s", "Active", "Refused"
    );
    for t in tenants {
        let _ = writeln!(
            o,
            "{:<16} {:<6} {:>10} {:>10} {:>10} {:>10} {:>10}",
            t.spec.name,
            t.table,
            t.spec.table_entries,
            t.spec.max_connections,
            t.spec.max_new_per_s,
            t.active_conns,
            t.refused
        );
    }
    o
}

/// `weir health`.
pub fn render_health(entries: &[HealthEntry]) -> String {
    let mut o = format!(
        "{:<16} {:<16} {:<28} {:<9} {}\n",
        "Tenant", "Service", "Backend", "State", "LastError"
    );
    for e in entries {
        let _ = writeln!(
            o,
            "{:<16} {:<16} {:<28} {:<9} {}",
            e.tenant,
            e.service,
            e.backend,
            e.state,
            e.last_error.as_deref().unwrap_or("-")
        );
    }
    o
}

/// `weir stats` (daemon-wide).
pub fn render_global(g: &GlobalStats, exact: bool) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<14}{:>9}{:>9}{:>9}{:>9}{:>9}",
        "", "Conns", "InPkts", "OutPkts", "InBytes", "OutBytes"
    );
    let _ = writeln!(o, "{:<14}{}", "total", totals_cols(&g.stats, exact));
    let _ = writeln!(
        o,
        "{:<14}{:>9}{:>9}{:>9}{:>9}{:>9}",
        "", "CPS", "InPPS", "OutPPS", "InBPS", "OutBPS"
    );
    let _ = writeln!(o, "{:<14}{}", "rate", rates_cols(&g.rates, exact));
    let _ = writeln!(o, "active connections: {}", g.active_conns);
    let _ = writeln!(o, "open fds: {} of {}", g.open_fds, g.fd_limit);
    if let Some(w) = &g.workers {
        let accepted: Vec<String> = w.accepted.iter().map(|n| n.to_string()).collect();
        let _ = writeln!(
            o,
            "workers: {}, {} taking new connections ({}); accepted {}",
            w.accepted.len(),
            w.accepting,
            w.steering,
            accepted.join(" / ")
        );
    }
    let _ = writeln!(
        o,
        "estimator tick: {:.3} ms (max {:.3} ms)",
        g.estimator_tick_seconds * 1e3,
        g.estimator_tick_max_seconds * 1e3
    );
    if g.refused.is_empty() {
        o.push_str("refused: none\n");
    } else {
        for (reason, n) in &g.refused {
            let _ = writeln!(o, "refused {reason}: {n}");
        }
    }
    for (reason, n) in &g.udp_dropped {
        let _ = writeln!(o, "udp dropped {reason}: {n}");
    }
    if g.udp_early_drops > 0 {
        let _ = writeln!(
            o,
            "udp early_drops: {} (single-datagram sessions ended, oldest first, to make room for new ones at a limit)",
            g.udp_early_drops
        );
    }
    if let Some(p) = &g.packet {
        let _ = writeln!(
            o,
            "packet mode ({}): {} frames in, {} out, {} new flows",
            p.io, p.counts.rx, p.counts.tx, p.counts.new_flows
        );
        for (reason, n) in &p.counts.dropped {
            let _ = writeln!(o, "packet dropped {reason}: {n}");
        }
        // A counter at zero is not printed.
        let notes = [
            (
                "icmp_errors",
                p.counts.icmp_errors,
                "ICMP errors about flows, translated and forwarded",
            ),
            (
                "rst_ignored",
                p.counts.rst_ignored,
                "RSTs too far from their sender's sequence number: forwarded, the flow kept",
            ),
            (
                "fin_ignored",
                p.counts.fin_ignored,
                "FINs too far from their sender's sequence number: forwarded, the flow kept",
            ),
            (
                "seq_ignored",
                p.counts.seq_ignored,
                "other segments too far from their sender's sequence number: forwarded, the flow's timer not restarted",
            ),
            (
                "early_drops",
                p.counts.early_drops,
                "flows that never got going ended, oldest first, to make room for new ones at a limit",
            ),
        ];
        for (name, n, why) in notes {
            if n > 0 {
                let _ = writeln!(o, "packet {name}: {n} ({why})");
            }
        }
        for w in &p.workers {
            let _ = write!(
                o,
                "packet worker {}: {} frames in, {} out, {} new flows",
                w.worker, w.counts.rx, w.counts.tx, w.counts.new_flows
            );
            for (i, (reason, n)) in w.counts.dropped.iter().enumerate() {
                let sep = if i == 0 { "; dropped" } else { "," };
                let _ = write!(o, "{sep} {reason} {n}");
            }
            o.push('\n');
        }
    }
    o
}

/// One frame of `weir top`; `clock` is the time label (passed in: pure).
pub fn render_top(
    clock: &str,
    g: &GlobalStats,
    services: &[ServiceStatus],
    tenants: &[TenantStatus],
    tables: &[TableReport],
) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "weir top - {clock}  active {}  cps {}  in {}B/s  out {}B/s  fds {}/{}",
        g.active_conns,
        g.rates.cps,
        largenum(g.rates.inbps, false).trim(),
        largenum(g.rates.outbps, false).trim(),
        g.open_fds,
        g.fd_limit
    );
    o.push('\n');
    o.push_str(&render_list(services, ListMode::Rate, false));
    o.push('\n');
    let _ = writeln!(
        o,
        "{:<16} {:>10} {:>10} {:<9} {:>10} {:>10} {:>6} {:>8}",
        "Tenant", "Active", "Refused", "Table", "Entries", "Buckets", "Load", "MaxChain"
    );
    for t in tenants {
        let tb = tables.iter().find(|r| r.tenant == t.spec.name);
        let _ = writeln!(
            o,
            "{:<16} {:>10} {:>10} {:<9} {:>10} {:>10} {:>6.2} {:>8}",
            t.spec.name,
            t.active_conns,
            t.refused,
            tb.map_or(t.table.as_str(), |r| r.placement.as_str()),
            tb.map_or(0, |r| r.entries),
            tb.map_or(0, |r| r.buckets),
            tb.map_or(0.0, |r| r.load_factor),
            tb.map_or(0, |r| r.max_chain),
        );
    }
    o
}

/// `weir reload`: one summary line, then `+`, `~`, `-` lines per object.
pub fn render_reload(r: &ReloadReport, dry_run: bool) -> String {
    let mut out = if dry_run {
        String::from("dry run, nothing applied: a reload would make")
    } else {
        String::from("reloaded:")
    };
    out.push_str(&format!(
        " {} added, {} changed, {} removed\n",
        r.added.len(),
        r.changed.len(),
        r.removed.len()
    ));
    for (sign, list) in [("+", &r.added), ("~", &r.changed), ("-", &r.removed)] {
        for item in list {
            out.push_str(&format!("  {sign} {item}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn largenum_matches_ipvsadm() {
        assert_eq!(largenum(0, false), "        0");
        assert_eq!(largenum(99_999_999, false), " 99999999");
        assert_eq!(largenum(100_000_000, false), "  100000K");
        assert_eq!(largenum(1_234_567_890, false), "    1234M");
        assert_eq!(largenum(123_456_789_012, false), "     123G");
        assert_eq!(largenum(u64::MAX, false), "18446744T");
        assert_eq!(largenum(1_234_567_890, true), " 1234567890");
        assert_eq!(largenum(7, true), "        7");
    }
}

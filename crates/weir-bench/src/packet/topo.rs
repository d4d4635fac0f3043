//! The benchmark's network: namespaces joined by veth through a bridge, built
//! and removed by the bench (removed on drop, also on error, and on SIGINT or
//! SIGTERM by [`crate::signals`]).
//!
//! ```text
//!   client ns (trafgen)      switch ns (br0)            weir ns
//!   10.98.0.10 ── eth0/p0 ──┤               ├── p1/lb0: 10.98.0.1, 10.99.0.1
//!                           ├── p2/eth0: b1 ns 10.99.0.2 (sink)
//!                           └── p3/eth0: b2 ns 10.99.0.3 (sink)
//! ```
//!
//! The same one-armed layout as `crates/weir/tests/packet_mode.rs`; every
//! implementation runs on it. lb0 and its bridge end are created with
//! [`MAX_QUEUES`] queues and [`Topo::set_queues`] sets how many are live, so
//! AF_XDP has one worker per rx queue. Neighbours are static. The backends
//! count and drop the benchmark's UDP at their interface's ingress (nft, netdev
//! hook), so every implementation pays the same sink.

use std::process::Command;

use anyhow::{Context, Result, bail};

pub(crate) const VIP: &str = "10.99.1.100";
pub(crate) const PORT: u16 = 9000;
pub(crate) const CLIENT: &str = "10.98.0.10";
pub(crate) const WEIR_CLIENT_SIDE: &str = "10.98.0.1";
pub(crate) const WEIR_BACKEND_SIDE: &str = "10.99.0.1";
pub(crate) const BACKENDS: [&str; 2] = ["10.99.0.2", "10.99.0.3"];
pub(crate) const MAC_CLIENT: &str = "02:00:00:00:00:0a";
pub(crate) const MAC_WEIR: &str = "02:00:00:00:00:01";
pub(crate) const MAC_BACKENDS: [&str; 2] = ["02:00:00:00:00:02", "02:00:00:00:00:03"];
/// Queues lb0 (and its bridge end) are created with.
pub(crate) const MAX_QUEUES: u32 = 2;

/// Runs a command; its stdout, or an error naming it and its stderr.
pub(crate) fn run(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ip` with whitespace-separated arguments.
pub(crate) fn ip(args: &str) -> Result<String> {
    let mut v = vec!["ip"];
    v.extend(args.split_whitespace());
    run(&v)
}

/// The namespaces; deleted on drop (which destroys their veths).
pub(crate) struct Topo {
    tag: String,
}

impl Topo {
    /// A namespace's full name.
    pub(crate) fn ns(&self, name: &str) -> String {
        format!("wb{}-{name}", self.tag)
    }

    pub(crate) fn new() -> Result<Self> {
        let topo = Topo {
            tag: format!("{}", std::process::id() % 100_000),
        };
        topo.build()?;
        Ok(topo)
    }

    fn build(&self) -> Result<()> {
        let (sw, c, w) = (self.ns("sw"), self.ns("cl"), self.ns("lb"));
        let bs = [self.ns("b1"), self.ns("b2")];
        for ns in [&sw, &c, &w].into_iter().chain(&bs) {
            crate::signals::create_netns(ns, || ip(&format!("netns add {ns}")))?;
            ip(&format!("-n {ns} link set lo up"))?;
        }
        ip(&format!("-n {sw} link add br0 type bridge"))?;
        ip(&format!("-n {sw} link set br0 up"))?;
        let mut ends = vec![
            (c.clone(), "eth0", MAC_CLIENT, vec![format!("{CLIENT}/24")]),
            (
                w.clone(),
                "lb0",
                MAC_WEIR,
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
                MAC_BACKENDS[i],
                vec![format!("{}/24", BACKENDS[i])],
            ));
        }
        for (i, (ns, dev, mac, addrs)) in ends.iter().enumerate() {
            let q = if *dev == "lb0" { MAX_QUEUES } else { 1 };
            ip(&format!(
                "link add p{i} numrxqueues {q} numtxqueues {q} netns {sw} type veth \
                 peer name {dev} netns {ns} address {mac} numrxqueues {q} numtxqueues {q}"
            ))?;
            ip(&format!("-n {sw} link set p{i} master br0 up"))?;
            for a in addrs {
                ip(&format!("-n {ns} addr add {a} dev {dev}"))?;
            }
            ip(&format!("-n {ns} link set {dev} up"))?;
            // Full checksums: a veth otherwise leaves them partial for an
            // offload an AF_XDP frame never reaches.
            run(&["ip", "netns", "exec", ns, "ethtool", "-K", dev, "tx", "off"])?;
        }
        // The VIP is routed to weir; weir's namespace knows everyone.
        ip(&format!("-n {c} route add {VIP}/32 via {WEIR_CLIENT_SIDE}"))?;
        ip(&format!(
            "-n {w} neigh replace {CLIENT} lladdr {MAC_CLIENT} dev lb0 nud permanent"
        ))?;
        // A forwarder sending back out of lb0 must not also send redirects.
        for k in ["all", "default", "lb0"] {
            sysctl(&w, &format!("net.ipv4.conf.{k}.send_redirects"), "0")?;
        }
        for i in 0..2 {
            ip(&format!(
                "-n {w} neigh replace {} lladdr {} dev lb0 nud permanent",
                BACKENDS[i], MAC_BACKENDS[i]
            ))?;
            ip(&format!(
                "-n {} neigh replace {WEIR_BACKEND_SIDE} lladdr {MAC_WEIR} dev eth0 nud permanent",
                bs[i]
            ))?;
            // The sink: count and drop the bench's UDP before the stack.
            let rules = format!(
                "table netdev sink {{\n chain in {{\n  type filter hook ingress device eth0 priority 0\n  \
                 udp dport {PORT} counter drop\n }}\n}}\n"
            );
            nft_apply(&bs[i], &rules)?;
        }
        Ok(())
    }

    /// Makes `n` of lb0's queues (and its bridge end's) live.
    pub(crate) fn set_queues(&self, n: u32) -> Result<()> {
        let n = n.to_string();
        for (ns, dev) in [(self.ns("lb"), "lb0"), (self.ns("sw"), "p1")] {
            run(&[
                "ip", "netns", "exec", &ns, "ethtool", "-L", dev, "rx", &n, "tx", &n,
            ])
            .or_else(|e| {
                // ethtool refuses a no-op change on some versions.
                let cur = run(&["ip", "netns", "exec", &ns, "ethtool", "-l", dev])?;
                if cur.matches(&format!("RX:\t\t{n}")).count() == 2 {
                    Ok(String::new())
                } else {
                    Err(e)
                }
            })?;
        }
        Ok(())
    }

    /// Packets the two backends' sinks have counted so far.
    pub(crate) fn delivered(&self) -> Result<u64> {
        let mut sum = 0;
        for b in ["b1", "b2"] {
            let out = run(&[
                "ip",
                "netns",
                "exec",
                &self.ns(b),
                "nft",
                "list",
                "table",
                "netdev",
                "sink",
            ])?;
            sum += parse_nft_counter_packets(&out)
                .with_context(|| format!("no counter in {b}'s sink: {out}"))?;
        }
        Ok(sum)
    }

    /// Packets the client's interface has sent so far.
    pub(crate) fn sent(&self) -> Result<u64> {
        let out = ip(&format!("-n {} -s -j link show eth0", self.ns("cl")))?;
        parse_link_tx_packets(&out).with_context(|| format!("no tx counter in {out}"))
    }
}

impl Drop for Topo {
    fn drop(&mut self) {
        for n in ["cl", "lb", "b1", "b2", "sw"] {
            let ns = self.ns(n);
            let _ = Command::new("ip").args(["netns", "del", &ns]).output();
            crate::signals::netns_deleted(&ns);
        }
    }
}

/// Loads an nftables ruleset (a file's text) in namespace `ns`.
pub(crate) fn nft_apply(ns: &str, rules: &str) -> Result<()> {
    let mut f = tempfile::NamedTempFile::new()?;
    std::io::Write::write_all(&mut f, rules.as_bytes())?;
    let path = f.path().to_string_lossy().into_owned();
    run(&["ip", "netns", "exec", ns, "nft", "-f", &path]).map(drop)
}

/// `sysctl -w key=value` in namespace `ns`.
pub(crate) fn sysctl(ns: &str, key: &str, value: &str) -> Result<()> {
    run(&[
        "ip",
        "netns",
        "exec",
        ns,
        "sysctl",
        "-q",
        "-w",
        &format!("{key}={value}"),
    ])
    .map(drop)
}

/// The packets of the first `counter packets N bytes M` in `nft list` output.
pub(crate) fn parse_nft_counter_packets(text: &str) -> Option<u64> {
    let mut words = text.split_whitespace();
    while let Some(w) = words.next() {
        if w == "counter" && words.next() == Some("packets") {
            return words.next()?.parse().ok();
        }
    }
    None
}

/// `stats64.tx.packets` of the first link in `ip -s -j link show` output.
pub(crate) fn parse_link_tx_packets(json: &str) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    v.get(0)?
        .get("stats64")?
        .get("tx")?
        .get("packets")?
        .as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nft_counter_is_parsed() {
        let text = "table netdev sink {\n\tchain in {\n\t\ttype filter hook ingress device \"eth0\" priority filter; policy accept;\n\t\tudp dport 9000 counter packets 1234 bytes 79000 drop\n\t}\n}\n";
        assert_eq!(parse_nft_counter_packets(text), Some(1234));
        assert_eq!(parse_nft_counter_packets("counter bytes 3"), None);
        assert_eq!(parse_nft_counter_packets("counter packets x"), None);
    }

    #[test]
    fn link_tx_packets_are_parsed() {
        let j =
            r#"[{"ifname":"eth0","stats64":{"rx":{"packets":5},"tx":{"packets":77,"bytes":1}}}]"#;
        assert_eq!(parse_link_tx_packets(j), Some(77));
        assert_eq!(parse_link_tx_packets("[]"), None);
        assert_eq!(parse_link_tx_packets("not json"), None);
    }
}

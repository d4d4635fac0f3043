//! Load generators and their parsers: wrk (HTTP, new connections or
//! keep-alive), iperf3 (bulk TCP), a bounded UDP request/reply generator,
//! and a client that holds N TCP connections open.
//!
//! Every generator is bounded in time (and the UDP one in count too); the
//! external tools run under [`run_bounded`] with a deadline a little past
//! their own `-d`/`-t`.

use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use socket2::{Domain, Protocol, Socket, Type};

use super::sys::{lo, run_bounded};

/// What one wrk run measured.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WrkResult {
    /// Completed requests per second.
    pub(crate) rps: f64,
    /// Completed requests in the whole run (`N requests in Xs`).
    pub(crate) requests: u64,
    /// 99th percentile latency in milliseconds.
    pub(crate) p99_ms: Option<f64>,
    /// Socket errors (connect + read + write + timeout).
    pub(crate) errors: u64,
    /// Responses that were not 2xx/3xx.
    pub(crate) non2xx: u64,
}

/// Runs wrk against `http://127.0.0.1:port/` for `secs`; `close` adds
/// `Connection: close` so every request is a new connection.
pub(crate) fn wrk(
    dir: &Path,
    port: u16,
    secs: u64,
    threads: usize,
    conns: usize,
    close: bool,
) -> Result<WrkResult> {
    let mut cmd = Command::new("wrk");
    cmd.arg(format!("-t{threads}"))
        .arg(format!("-c{conns}"))
        .arg(format!("-d{secs}s"))
        .arg("--latency")
        .arg("--timeout")
        .arg("5s");
    if close {
        cmd.args(["-H", "Connection: close"]);
    }
    cmd.arg(format!("http://127.0.0.1:{port}/"));
    let (ok, out, err) = run_bounded(cmd, dir, "wrk", Duration::from_secs(secs + 15))?;
    if !ok {
        bail!("wrk failed: {}", err.trim());
    }
    let r = parse_wrk(&out).with_context(|| format!("parsing wrk output:\n{out}"))?;
    if r.rps <= 0.0 {
        bail!("wrk completed no request:\n{out}");
    }
    Ok(r)
}

/// Parses wrk's text report (`--latency`).
pub(crate) fn parse_wrk(out: &str) -> Result<WrkResult> {
    let mut rps = None;
    let mut requests = None;
    let mut p99_ms = None;
    let mut errors = 0;
    let mut non2xx = 0;
    for line in out.lines().map(str::trim) {
        if let Some(v) = line.strip_prefix("Requests/sec:") {
            rps = Some(v.trim().parse::<f64>().context("Requests/sec")?);
        } else if let Some((n, _)) = line.split_once(" requests in ") {
            requests = Some(n.trim().parse::<u64>().context("N requests in")?);
        } else if let Some(v) = line.strip_prefix("99%") {
            p99_ms = Some(parse_duration_ms(v.trim()).context("99% latency")?);
        } else if let Some(v) = line.strip_prefix("Socket errors:") {
            errors = v
                .split(',')
                .filter_map(|kv| kv.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum();
        } else if let Some(v) = line.strip_prefix("Non-2xx or 3xx responses:") {
            non2xx = v.trim().parse().context("Non-2xx")?;
        }
    }
    Ok(WrkResult {
        rps: rps.context("no Requests/sec line")?,
        requests: requests.context("no `N requests in` line")?,
        p99_ms,
        errors,
        non2xx,
    })
}

/// wrk's durations: `812.00us`, `1.23ms`, `2.01s`, `1.50m`.
fn parse_duration_ms(v: &str) -> Option<f64> {
    let split = v.find(|c: char| c.is_ascii_alphabetic())?;
    let (num, unit) = v.split_at(split);
    let n: f64 = num.parse().ok()?;
    let scale = match unit {
        "us" => 1e-3,
        "ms" => 1.0,
        "s" => 1e3,
        "m" => 60e3,
        "h" => 3600e3,
        _ => return None,
    };
    Some(n * scale)
}

/// What one iperf3 run measured (`end.sum_received`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct IperfResult {
    /// Received throughput in Gbit/s.
    pub(crate) gbps: f64,
    /// Bytes received in the whole run.
    pub(crate) bytes: u64,
}

/// iperf3 client through `port`: what the receiver got.
pub(crate) fn iperf3(dir: &Path, port: u16, secs: u64, streams: usize) -> Result<IperfResult> {
    let mut cmd = Command::new("iperf3");
    cmd.args(["-c", "127.0.0.1", "-J"])
        .arg("-p")
        .arg(port.to_string())
        .arg("-t")
        .arg(secs.to_string())
        .arg("-P")
        .arg(streams.to_string());
    let (_, out, err) = run_bounded(cmd, dir, "iperf3", Duration::from_secs(secs + 20))?;
    parse_iperf3(&out).with_context(|| format!("iperf3 -P {streams}: {}", err.trim()))
}

/// `end.sum_received.{bits_per_second, bytes}` of iperf3's JSON report.
pub(crate) fn parse_iperf3(out: &str) -> Result<IperfResult> {
    let v: serde_json::Value = serde_json::from_str(out).context("iperf3 JSON")?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        bail!("iperf3: {e}");
    }
    let bps = v
        .pointer("/end/sum_received/bits_per_second")
        .and_then(serde_json::Value::as_f64)
        .context("no end.sum_received.bits_per_second")?;
    // An integer in iperf3's output; cJSON may print a large one as a float.
    let bytes = v
        .pointer("/end/sum_received/bytes")
        .and_then(|b| {
            b.as_u64().or_else(|| {
                let f = b.as_f64()?;
                (f.is_finite() && f >= 0.0).then_some(f as u64)
            })
        })
        .context("no end.sum_received.bytes")?;
    Ok(IperfResult {
        gbps: bps / 1e9,
        bytes,
    })
}

/// What the UDP generator measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct UdpResult {
    /// Datagrams sent.
    pub(crate) sent: u64,
    /// Replies received within the run.
    pub(crate) received: u64,
    /// Wall time of the run.
    pub(crate) elapsed: Duration,
}

impl UdpResult {
    /// Replies received per second.
    pub(crate) fn dps(&self) -> f64 {
        self.received as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Bounded UDP request/reply load: `clients` sockets (one thread each), each
/// keeping up to `window` 64-byte datagrams in flight; a reply frees a slot,
/// and 20 ms of silence counts the outstanding ones as lost. Stops after
/// `dur` or `max_per_client` datagrams per client, whichever comes first.
pub(crate) fn udp_load(
    target: SocketAddr,
    dur: Duration,
    clients: usize,
    window: u64,
    max_per_client: u64,
) -> Result<UdpResult> {
    let start = Instant::now();
    let deadline = start + dur;
    let handles: Vec<_> = (0..clients)
        .map(|_| -> Result<_> {
            let s = UdpSocket::bind(lo(0))?;
            s.connect(target)?;
            s.set_read_timeout(Some(Duration::from_millis(20)))?;
            Ok(std::thread::spawn(move || {
                udp_client(&s, deadline, window, max_per_client)
            }))
        })
        .collect::<Result<_>>()?;
    let mut r = UdpResult {
        sent: 0,
        received: 0,
        elapsed: Duration::ZERO,
    };
    for h in handles {
        let (s, rcv) = h
            .join()
            .map_err(|_| anyhow::anyhow!("UDP client panicked"))?;
        r.sent += s;
        r.received += rcv;
    }
    r.elapsed = start.elapsed();
    Ok(r)
}

fn udp_client(s: &UdpSocket, deadline: Instant, window: u64, max: u64) -> (u64, u64) {
    let payload = [0x42u8; 64];
    let mut buf = [0u8; 2048];
    let (mut sent, mut received, mut inflight) = (0u64, 0u64, 0u64);
    while Instant::now() < deadline {
        while inflight < window && sent < max {
            if s.send(&payload).is_err() {
                break;
            }
            sent += 1;
            inflight += 1;
        }
        match s.recv(&mut buf) {
            Ok(_) => {
                received += 1;
                inflight = inflight.saturating_sub(1);
            }
            // Timeout (lost datagrams) or ICMP unreachable: free the window.
            Err(_) => {
                if sent >= max && inflight == 0 {
                    break;
                }
                inflight = 0;
            }
        }
    }
    (sent, received)
}

/// Opens `n` TCP connections to `port` and returns them (the caller decides
/// whether they stay idle or just never read). `reached()` says how many
/// have arrived at the backend: opening stays at most `ahead` connections in
/// front of it, so no accept queue on the way overflows (with SYN cookies an
/// overflowed connection looks open to the client but never reaches the
/// backend). `mss`: `TCP_MAXSEG` set on each socket before it connects, so
/// the client advertises it and the peer sends segments no larger. Fails
/// after `timeout` overall.
pub(crate) fn connect_many(
    port: u16,
    n: usize,
    ahead: usize,
    reached: impl Fn() -> usize,
    timeout: Duration,
    mss: Option<u32>,
) -> Result<Vec<TcpStream>> {
    let deadline = Instant::now() + timeout;
    let base = reached();
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        while i >= ahead && reached().saturating_sub(base) < i - ahead {
            if Instant::now() > deadline {
                bail!(
                    "only {} of {i} connections reached the backend in {timeout:?}",
                    reached().saturating_sub(base)
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if Instant::now() > deadline {
            bail!("opened only {i} of {n} connections in {timeout:?}");
        }
        let s =
            connect(port, mss).with_context(|| format!("connection {i} of {n} to port {port}"))?;
        v.push(s);
    }
    Ok(v)
}

/// One loopback connection (5 s connect timeout), with `TCP_MAXSEG` set
/// before connecting when `mss` is given.
fn connect(port: u16, mss: Option<u32>) -> Result<TcpStream> {
    let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).context("socket")?;
    if let Some(mss) = mss {
        s.set_tcp_mss(mss)
            .with_context(|| format!("TCP_MAXSEG {mss}"))?;
    }
    s.connect_timeout(&lo(port).into(), Duration::from_secs(5))?;
    Ok(s.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    const WRK: &str = "Running 2s test @ http://127.0.0.1:8080/
  1 threads and 10 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   321.55us  100.12us   5.01ms   90.00%
    Req/Sec    30.12k     1.01k   31.00k    80.00%
  Latency Distribution
     50%  300.00us
     75%  350.00us
     90%  400.00us
     99%    1.23ms
  60240 requests in 2.00s, 9.02MB read
  Socket errors: connect 0, read 3, write 1, timeout 0
  Non-2xx or 3xx responses: 5
Requests/sec:  30118.32
Transfer/sec:      4.51MB
";

    #[test]
    fn wrk_report_is_parsed() {
        let r = parse_wrk(WRK).unwrap();
        assert!((r.rps - 30118.32).abs() < 1e-6);
        assert_eq!(r.requests, 60240);
        assert!((r.p99_ms.unwrap() - 1.23).abs() < 1e-9);
        assert_eq!(r.errors, 4);
        assert_eq!(r.non2xx, 5);
        assert!(parse_wrk("garbage").is_err());
        let no_total: String = WRK
            .lines()
            .filter(|l| !l.contains("requests in"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(parse_wrk(&no_total).is_err(), "the total is required");
    }

    #[test]
    fn wrk_durations() {
        assert_eq!(parse_duration_ms("812.00us"), Some(0.812));
        assert_eq!(parse_duration_ms("2.00s"), Some(2000.0));
        assert_eq!(parse_duration_ms("1.50m"), Some(90_000.0));
        assert_eq!(parse_duration_ms("12"), None);
    }

    #[test]
    fn iperf3_json_is_parsed() {
        let ok = r#"{"end":{"sum_received":{"bits_per_second":2.5e10,"bytes":3125000000}}}"#;
        let r = parse_iperf3(ok).unwrap();
        assert!((r.gbps - 25.0).abs() < 1e-9);
        assert_eq!(r.bytes, 3_125_000_000);
        let float = r#"{"end":{"sum_received":{"bits_per_second":1e9,"bytes":1.25e8}}}"#;
        assert_eq!(parse_iperf3(float).unwrap().bytes, 125_000_000);
        let no_bytes = r#"{"end":{"sum_received":{"bits_per_second":2.5e10}}}"#;
        assert!(parse_iperf3(no_bytes).is_err());
        let err = r#"{"error":"unable to connect to server"}"#;
        assert!(
            parse_iperf3(err)
                .unwrap_err()
                .to_string()
                .contains("unable")
        );
    }

    #[test]
    fn connect_many_sets_the_segment_size_the_peer_uses() {
        use std::net::TcpListener;

        use crate::proxy::sys::{ETH_MSS_OPTION, ETH_SEGMENT};

        let l = TcpListener::bind(lo(0)).unwrap();
        let port = l.local_addr().unwrap().port();
        // The accepted side's segment size is what the client advertised
        // (1448 with TCP timestamps, 1460 without); without the option it
        // is loopback's, far larger.
        let seg = |c: &TcpStream| socket2::SockRef::from(c).tcp_mss().unwrap();
        let eth = connect_many(
            port,
            3,
            10,
            || 0,
            Duration::from_secs(10),
            Some(ETH_MSS_OPTION),
        )
        .unwrap();
        assert_eq!(eth.len(), 3);
        for c in &eth {
            let (a, _) = l.accept().unwrap();
            assert_eq!(a.peer_addr().unwrap(), c.local_addr().unwrap());
            assert!(
                (ETH_SEGMENT..=ETH_MSS_OPTION).contains(&seg(&a)),
                "{}",
                seg(&a)
            );
            assert!(
                (ETH_SEGMENT..=ETH_MSS_OPTION).contains(&seg(c)),
                "{}",
                seg(c)
            );
        }
        let plain = connect_many(port, 1, 10, || 0, Duration::from_secs(10), None).unwrap();
        let (a, _) = l.accept().unwrap();
        assert!(seg(&a) > 4 * ETH_MSS_OPTION, "{}", seg(&a));
        drop(plain);
    }

    #[test]
    fn udp_load_against_a_local_echo_is_bounded_and_counts() {
        let echo = UdpSocket::bind(lo(0)).unwrap();
        let addr = echo.local_addr().unwrap();
        echo.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let t = std::thread::spawn(move || {
            let mut b = [0u8; 2048];
            let mut idle = 0;
            while idle < 20 {
                match echo.recv_from(&mut b) {
                    Ok((n, from)) => {
                        idle = 0;
                        let _ = echo.send_to(&b[..n], from);
                    }
                    Err(_) => idle += 1,
                }
            }
        });
        let r = udp_load(addr, Duration::from_secs(5), 2, 8, 500).unwrap();
        assert_eq!(r.sent, 1000, "bounded by count");
        assert!(r.received > 0 && r.received <= r.sent);
        assert!(r.elapsed < Duration::from_secs(5));
        t.join().unwrap();
    }
}

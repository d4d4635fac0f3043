//! Active health checks: a TCP connect (or a UDP datagram that must be
//! answered, [`Probe`]) per backend every `interval`, with
//! `rise` consecutive successes to mark it up and `fall` consecutive failures
//! to mark it down (HAProxy's and keepalived's model).
//!
//! [`Hysteresis`] is the pure state machine; [`spawn`] runs it against a real
//! backend on the caller's tokio runtime and reports every transition through
//! a callback. A backend starts up (it takes `fall` failures to take it out),
//! so a daemon that starts in front of healthy backends serves at once.
//!
//! [`Passive`] is the passive check every backend gets, checked or not
//! (HAProxy's `observe layer4`, Envoy's outlier detection): the proxy
//! reports each backend connect, and [`PASSIVE_FALL`] failures in a row take
//! the backend out for [`PASSIVE_HOLD`]; then it is tried again, and one
//! more failure takes it out again while a success puts it fully back.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// What one check does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// Connect over TCP.
    Tcp,
    /// Send this datagram; any reply within the timeout passes.
    Udp(Vec<u8>),
}

/// Check parameters, already parsed from `[service.health]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    /// Time between checks.
    pub interval: Duration,
    /// A connect that takes longer fails.
    pub timeout: Duration,
    /// Consecutive successes to go up (≥ 1).
    pub rise: u32,
    /// Consecutive failures to go down (≥ 1).
    pub fall: u32,
    /// What a check does.
    pub probe: Probe,
}

/// Up/down with rise/fall hysteresis.
#[derive(Debug, Clone)]
pub struct Hysteresis {
    up: bool,
    streak: u32,
    rise: u32,
    fall: u32,
}

impl Hysteresis {
    /// Starts up. `rise` and `fall` below 1 are treated as 1.
    pub fn new(rise: u32, fall: u32) -> Self {
        Self::starting(true, rise, fall)
    }

    /// Starts in state `up` (a restarted check continues from the state
    /// its backend is in). `rise` and `fall` below 1 are treated as 1.
    pub fn starting(up: bool, rise: u32, fall: u32) -> Self {
        Self {
            up,
            streak: 0,
            rise: rise.max(1),
            fall: fall.max(1),
        }
    }

    /// Whether the backend is up now.
    pub fn is_up(&self) -> bool {
        self.up
    }

    /// Feeds one check result; returns the new state if it changed.
    pub fn record(&mut self, ok: bool) -> Option<bool> {
        if ok == self.up {
            // A result that agrees with the state resets the opposite streak.
            self.streak = 0;
            return None;
        }
        self.streak += 1;
        let needed = if self.up { self.fall } else { self.rise };
        if self.streak >= needed {
            self.up = !self.up;
            self.streak = 0;
            Some(self.up)
        } else {
            None
        }
    }
}

/// Connect failures in a row that take a backend out (passive check).
pub const PASSIVE_FALL: u32 = 3;

/// How long a backend taken out by the passive check stays out.
pub const PASSIVE_HOLD: Duration = Duration::from_secs(10);

/// The passive check's state for one backend: failed connects in a row and
/// whether it is out. The caller brings it back after [`PASSIVE_HOLD`]
/// with [`Passive::restore`].
#[derive(Debug, Default)]
pub struct Passive {
    fails: AtomicU32,
    down: AtomicBool,
}

impl Passive {
    /// Whether the passive check has the backend out now.
    pub fn is_down(&self) -> bool {
        self.down.load(Relaxed)
    }

    /// Failed connects in a row.
    pub fn failures(&self) -> u32 {
        self.fails.load(Relaxed)
    }

    /// A connect failed; `true` when this failure takes the backend out
    /// (exactly one caller sees `true` per time out).
    pub fn on_failure(&self) -> bool {
        let n = self
            .fails
            .fetch_update(Relaxed, Relaxed, |f| Some(f.saturating_add(1)))
            .unwrap_or(u32::MAX)
            .saturating_add(1);
        n >= PASSIVE_FALL
            && self
                .down
                .compare_exchange(false, true, Relaxed, Relaxed)
                .is_ok()
    }

    /// A connect succeeded: the failure streak ends.
    pub fn on_success(&self) {
        // Read first: the common case writes nothing to a shared line.
        if self.fails.load(Relaxed) != 0 {
            self.fails.store(0, Relaxed);
        }
        self.down.store(false, Relaxed);
    }

    /// The hold is over: the backend is tried again. The streak is kept, so
    /// one more failure takes it out again at once.
    pub fn restore(&self) {
        self.down.store(false, Relaxed);
    }
}

/// One TCP connect check.
pub async fn check_tcp(addr: SocketAddr, timeout: Duration) -> Result<(), String> {
    match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
        Ok(Ok(_stream)) => Ok(()),
        Ok(Err(e)) => Err(format!("connect {addr}: {e}")),
        Err(_) => Err(format!("connect {addr}: timed out after {timeout:?}")),
    }
}

/// One UDP check: send `payload` from a connected socket and wait for any
/// reply (an ICMP port unreachable fails it at once).
pub async fn check_udp(addr: SocketAddr, payload: &[u8], timeout: Duration) -> Result<(), String> {
    let bind: SocketAddr = if addr.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let exchange = async {
        let sock = tokio::net::UdpSocket::bind(bind).await?;
        sock.connect(addr).await?;
        sock.send(payload).await?;
        let mut buf = [0u8; 512];
        sock.recv(&mut buf).await.map(drop)
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("udp {addr}: {e}")),
        Err(_) => Err(format!("udp {addr}: no reply within {timeout:?}")),
    }
}

/// Checks `addr` every `params.interval` until `cancel` fires, calling
/// `on_change(up, last_error)` on every transition (and never otherwise).
/// `up` is the backend's state now: a new backend starts up, and a check
/// restarted (its service edited) continues from where the last one left
/// the backend, so a down one needs `rise` successes to come back.
pub fn spawn<F>(
    addr: SocketAddr,
    params: Params,
    up: bool,
    cancel: CancellationToken,
    mut on_change: F,
) -> tokio::task::JoinHandle<()>
where
    F: FnMut(bool, Option<String>) + Send + 'static,
{
    tokio::spawn(async move {
        let mut state = Hysteresis::starting(up, params.rise, params.fall);
        let mut tick = tokio::time::interval(params.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let result = tokio::select! {
                _ = cancel.cancelled() => return,
                r = async {
                    match &params.probe {
                        Probe::Tcp => check_tcp(addr, params.timeout).await,
                        Probe::Udp(payload) => check_udp(addr, payload, params.timeout).await,
                    }
                } => r,
            };
            let ok = result.is_ok();
            if let Some(up) = state.record(ok) {
                on_change(up, result.err());
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn falls_after_fall_failures_and_rises_after_rise_successes() {
        let mut h = Hysteresis::new(2, 3);
        assert!(h.is_up());
        assert_eq!(h.record(false), None);
        assert_eq!(h.record(false), None);
        assert_eq!(h.record(false), Some(false));
        assert!(!h.is_up());
        assert_eq!(h.record(true), None);
        assert_eq!(h.record(true), Some(true));
    }

    #[test]
    fn an_agreeing_result_resets_the_streak() {
        let mut h = Hysteresis::new(2, 2);
        assert_eq!(h.record(false), None);
        assert_eq!(h.record(true), None); // flap: streak reset
        assert_eq!(h.record(false), None);
        assert!(h.is_up());
        assert_eq!(h.record(false), Some(false));
    }

    #[test]
    fn a_check_started_down_needs_rise_successes() {
        let mut h = Hysteresis::starting(false, 2, 1);
        assert!(!h.is_up());
        assert_eq!(h.record(false), None);
        assert_eq!(h.record(true), None);
        assert_eq!(h.record(true), Some(true));
    }

    #[test]
    fn zero_thresholds_act_as_one() {
        let mut h = Hysteresis::new(0, 0);
        assert_eq!(h.record(false), Some(false));
        assert_eq!(h.record(true), Some(true));
    }

    #[tokio::test]
    async fn udp_check_passes_on_a_reply_and_fails_on_silence_or_refusal() {
        let echo = tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = echo.local_addr().expect("addr");
        let server = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            // Answer once, then stay silent.
            let (n, peer) = echo.recv_from(&mut buf).await.expect("recv");
            assert_eq!(&buf[..n], b"ping");
            echo.send_to(b"pong", peer).await.expect("send");
            let _ = echo.recv_from(&mut buf).await;
            echo
        });
        let t = Duration::from_millis(300);
        assert_eq!(check_udp(addr, b"ping", t).await, Ok(()));
        let silent = check_udp(addr, b"ping", t).await.expect_err("no reply");
        assert!(silent.contains("no reply"), "{silent}");
        drop(server.await.expect("server"));
        // Nothing bound: the ICMP unreachable fails the check.
        let refused = check_udp(addr, b"ping", Duration::from_secs(5))
            .await
            .expect_err("refused");
        assert!(refused.contains(&addr.to_string()), "{refused}");
    }

    #[test]
    fn passive_takes_out_after_a_streak_and_one_failure_after_the_hold() {
        let p = Passive::default();
        for _ in 1..PASSIVE_FALL {
            assert!(!p.on_failure());
        }
        // A success ends the streak.
        p.on_success();
        for _ in 1..PASSIVE_FALL {
            assert!(!p.on_failure());
        }
        assert!(!p.is_down());
        assert!(p.on_failure(), "the streak's last failure takes it out");
        assert!(p.is_down());
        assert!(!p.on_failure(), "already out: reported once");
        p.restore();
        assert!(!p.is_down());
        assert!(p.on_failure(), "after the hold one failure is enough");
        p.restore();
        p.on_success();
        assert_eq!(p.failures(), 0);
        assert!(!p.is_down());
        assert!(!p.on_failure());
    }

    #[tokio::test]
    async fn reports_down_when_the_backend_goes_away_and_up_when_it_returns() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let accept = tokio::spawn(async move {
            // Accept and drop until aborted, so connects succeed.
            while listener.accept().await.is_ok() {}
        });
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let params = Params {
            interval: Duration::from_millis(20),
            timeout: Duration::from_millis(500),
            rise: 2,
            fall: 2,
            probe: Probe::Tcp,
        };
        let task = spawn(addr, params, true, cancel.clone(), move |up, err| {
            let _ = tx.send((up, err));
        });
        accept.abort();
        let _ = accept.await;
        let deadline = Duration::from_secs(10);
        let (up, err) = tokio::time::timeout(deadline, rx.recv())
            .await
            .expect("a down transition within 10 s")
            .expect("channel open");
        assert!(!up);
        assert!(err.is_some_and(|e| e.contains(&addr.to_string())));
        // Bring it back on the same port.
        let listener = tokio::net::TcpListener::bind(addr).await.expect("rebind");
        let accept = tokio::spawn(async move { while listener.accept().await.is_ok() {} });
        let (up, err) = tokio::time::timeout(deadline, rx.recv())
            .await
            .expect("an up transition within 10 s")
            .expect("channel open");
        assert!(up);
        assert!(err.is_none());
        cancel.cancel();
        task.await.expect("checker ends when cancelled");
        accept.abort();
    }
}

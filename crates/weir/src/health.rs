//! Active health checks: a TCP connect per backend every `interval`, with
//! `rise` consecutive successes to mark it up and `fall` consecutive failures
//! to mark it down (HAProxy's and keepalived's model).
//!
//! [`Hysteresis`] is the pure state machine; [`spawn`] runs it against a real
//! backend on the caller's tokio runtime and reports every transition through
//! a callback. A backend starts up (it takes `fall` failures to take it out),
//! so a daemon that starts in front of healthy backends serves at once.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Check parameters, already parsed from `[service.health]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// Time between checks.
    pub interval: Duration,
    /// A connect that takes longer fails.
    pub timeout: Duration,
    /// Consecutive successes to go up (≥ 1).
    pub rise: u32,
    /// Consecutive failures to go down (≥ 1).
    pub fall: u32,
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
        Self {
            up: true,
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

/// One TCP connect check.
pub async fn check_tcp(addr: SocketAddr, timeout: Duration) -> Result<(), String> {
    match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
        Ok(Ok(_stream)) => Ok(()),
        Ok(Err(e)) => Err(format!("connect {addr}: {e}")),
        Err(_) => Err(format!("connect {addr}: timed out after {timeout:?}")),
    }
}

/// Checks `addr` every `params.interval` until `cancel` fires, calling
/// `on_change(up, last_error)` on every transition (and never otherwise).
pub fn spawn<F>(
    addr: SocketAddr,
    params: Params,
    cancel: CancellationToken,
    mut on_change: F,
) -> tokio::task::JoinHandle<()>
where
    F: FnMut(bool, Option<String>) + Send + 'static,
{
    tokio::spawn(async move {
        let mut state = Hysteresis::new(params.rise, params.fall);
        let mut tick = tokio::time::interval(params.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let result = tokio::select! {
                _ = cancel.cancelled() => return,
                r = check_tcp(addr, params.timeout) => r,
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
    fn zero_thresholds_act_as_one() {
        let mut h = Hysteresis::new(0, 0);
        assert_eq!(h.record(false), Some(false));
        assert_eq!(h.record(true), Some(true));
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
        };
        let task = spawn(addr, params, cancel.clone(), move |up, err| {
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

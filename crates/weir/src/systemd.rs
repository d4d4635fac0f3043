//! systemd service notifications (`Type=notify`, sd_notify(3)).
//!
//! `weir run` tells the service manager when it is ready (every listener
//! and the admin API bound), when a reload starts and ends, when a drain
//! starts, and keeps the watchdog fed when `WatchdogSec=` is set. The
//! messages go to the datagram socket named by `NOTIFY_SOCKET`; without it
//! every function here does nothing.
//!
//! Notifications are off until [`enable`] is called, which only the `weir
//! run` binary does: daemons started in-process (tests, `weir demo`) never
//! write to a `NOTIFY_SOCKET` they happen to inherit.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

use sd_notify::NotifyState;
use tokio_util::sync::CancellationToken;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Send notifications from now on (if `NOTIFY_SOCKET` is set).
pub fn enable() {
    ENABLED.store(true, Relaxed);
}

/// `READY=1`: startup or a reload finished. `status` shows in
/// `systemctl status`.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// `RELOADING=1` with `MONOTONIC_USEC=` (systemd >= 253 matches the two to
/// tell a reload it asked for from one that started on its own). Must be
/// followed by [`ready`] when the reload ends, whether it succeeded or not.
pub fn reloading() {
    if !active() {
        return;
    }
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send(&[
            NotifyState::Reloading,
            now,
            NotifyState::Status("reloading"),
        ]),
        // Older systemd versions do not need the timestamp.
        Err(_) => send(&[NotifyState::Reloading, NotifyState::Status("reloading")]),
    }
}

/// `STOPPING=1`: a drain (or an immediate stop) started.
pub fn stopping(status: &str) {
    send(&[NotifyState::Stopping, NotifyState::Status(status)]);
}

/// How often to send `WATCHDOG=1`: half of `WATCHDOG_USEC` when the
/// service manager asked this process (`WATCHDOG_PID` unset or ours) for
/// keep-alives, at least every millisecond; `None` otherwise.
pub fn watchdog_interval() -> Option<Duration> {
    if !active() {
        return None;
    }
    let d = sd_notify::watchdog_enabled()?;
    if d.is_zero() {
        tracing::warn!("WATCHDOG_USEC=0: watchdog not fed");
        return None;
    }
    Some((d / 2).max(Duration::from_millis(1)))
}

/// Feed the watchdog from `rt` until `stop` is cancelled, if
/// [`watchdog_interval`] says to, while `alive` says the data path works.
/// The task runs on the control runtime, so a wedged control plane (admin
/// API, signals, health checks) stops the keep-alives; and `alive` (`weir
/// run` gives it [`crate::daemon::LivenessCheck::check`]) stops them once
/// a proxy or packet worker thread has ended or stopped turning: the
/// keep-alives used to go on whatever the workers did, so a daemon whose
/// data path was dead (a worker thread gone, its share of the clients
/// refused) was never restarted. Either way systemd restarts the daemon.
pub fn spawn_watchdog(
    rt: &tokio::runtime::Handle,
    stop: CancellationToken,
    alive: impl FnMut(std::time::Instant) -> Result<(), String> + Send + 'static,
) {
    let Some(every) = watchdog_interval() else {
        return;
    };
    tracing::info!(interval = ?every, "feeding the systemd watchdog");
    rt.spawn(watchdog_loop(every, stop, alive, || {
        send(&[NotifyState::Watchdog])
    }));
}

/// [`spawn_watchdog`]'s task: every `every`, `feed` while `alive` says so.
/// The first time it does not, the reason is logged (once) and `feed` is
/// never called again: a thread that ended does not come back, and the
/// daemon is to be restarted.
async fn watchdog_loop(
    every: Duration,
    stop: CancellationToken,
    mut alive: impl FnMut(std::time::Instant) -> Result<(), String>,
    mut feed: impl FnMut(),
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        match alive(std::time::Instant::now()) {
            Ok(()) => feed(),
            Err(why) => {
                tracing::error!(
                    "{why}: no longer feeding the systemd watchdog (systemd restarts weir)"
                );
                send(&[NotifyState::Status(&format!("unhealthy: {why}"))]);
                return;
            }
        }
    }
}

fn active() -> bool {
    ENABLED.load(Relaxed) && std::env::var_os("NOTIFY_SOCKET").is_some()
}

fn send(states: &[NotifyState<'_>]) {
    if !active() {
        return;
    }
    if let Err(e) = notify(states) {
        // Not fatal: the daemon serves as before; systemd may time the
        // start or reload out and say so itself.
        tracing::warn!("cannot notify systemd (NOTIFY_SOCKET): {e}");
    }
}

/// sd_notify(3): `sd_notify::notify`, plus the abstract-namespace socket
/// (`NOTIFY_SOCKET=@name`, used by some service managers and containers)
/// that the crate does not handle.
fn notify(states: &[NotifyState<'_>]) -> std::io::Result<()> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};

    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(());
    };
    let Some(name) = path.as_bytes().strip_prefix(b"@") else {
        return sd_notify::notify(states);
    };
    let msg: String = states.iter().map(|s| format!("{s}\n")).collect();
    let sock = UnixDatagram::unbound()?;
    sock.connect_addr(&SocketAddr::from_abstract_name(name)?)?;
    let n = sock.send(msg.as_bytes())?;
    if n != msg.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::WriteZero,
            "notification cut short",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keep-alives go out while the data path is alive and stop for good
    /// the first time it is not: the task ends without asking again.
    #[test]
    fn the_watchdog_stops_being_fed_once_the_data_path_is_not_alive() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let stop = CancellationToken::new();
        let mut asked = 0;
        let mut fed = 0;
        let s = stop.clone();
        // Ends by itself after the 4th look: the verdict stands. (A 5th
        // look stops it, so that a loop that goes on ends too.)
        rt.block_on(watchdog_loop(
            Duration::from_millis(1),
            stop,
            |_| {
                asked += 1;
                match asked {
                    1..=3 => Ok(()),
                    4 => Err("data-path thread weir-worker-1 has ended".into()),
                    _ => {
                        s.cancel();
                        Ok(())
                    }
                }
            },
            || fed += 1,
        ));
        assert_eq!((asked, fed), (4, 3));
    }

    /// A stop ends the loop, fed or not.
    #[test]
    fn a_stop_ends_the_watchdog_task() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let stop = CancellationToken::new();
        let mut fed = 0;
        let s = stop.clone();
        rt.block_on(watchdog_loop(
            Duration::from_millis(1),
            stop,
            |_| Ok(()),
            || {
                fed += 1;
                if fed == 5 {
                    s.cancel();
                }
            },
        ));
        assert_eq!(fed, 5);
    }
}

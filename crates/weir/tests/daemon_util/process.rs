//! The `weir` binary as a child process of a test.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub const BIN: &str = env!("CARGO_BIN_EXE_weir");

/// A child process, killed and reaped when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An address on 127.0.0.1 that was free (TCP and UDP) a moment ago, for a
/// child daemon to bind. The port is taken below the kernel's ephemeral
/// range (`net.ipv4.ip_local_port_range`, 32768 and up by default), where
/// no `bind(0)` or `connect()` of a test running alongside is ever given a
/// port: a port from `bind(0)`, released, can be handed to one of those
/// before the daemon binds it. Ports are stepped through from a
/// per-process start, so two calls in one test binary never return the
/// same port.
pub fn free_addr() -> SocketAddr {
    use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id().wrapping_mul(2_654_435_761) % SPAN;
    for _ in 0..SPAN {
        let port = LOW + (start + NEXT.fetch_add(1, Relaxed)) % SPAN;
        let addr = SocketAddr::from(([127, 0, 0, 1], port as u16));
        if TcpListener::bind(addr).is_ok() && std::net::UdpSocket::bind(addr).is_ok() {
            return addr;
        }
    }
    panic!("no free port in {LOW}..{}", LOW + SPAN);
}

/// Waits (bounded) until `vip` echoes through the daemon `child`; if it
/// does not, kills it and panics with what it wrote on stderr, so a daemon
/// that failed to start says why.
pub fn wait_up(child: &mut Proc, vip: SocketAddr, timeout: Duration) {
    if super::wait_until(timeout, || super::echo_once(vip, b"up")) {
        return;
    }
    give_up(child, vip, timeout);
}

/// Waits (bounded) until something accepts connections on `addr` (the
/// daemon's admin API, which starts after its services: a test that waited
/// for a service only could find it not listening yet on a loaded
/// machine); else as [`wait_up`].
pub fn wait_listening(child: &mut Proc, addr: SocketAddr, timeout: Duration) {
    if super::wait_until(timeout, || TcpStream::connect(addr).is_ok()) {
        return;
    }
    give_up(child, addr, timeout);
}

/// Kills `child` and panics with what it wrote on stderr.
fn give_up(child: &mut Proc, vip: SocketAddr, timeout: Duration) -> ! {
    let _ = child.0.kill();
    let _ = child.0.wait();
    let mut err = String::new();
    if let Some(mut e) = child.0.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    panic!("the daemon did not serve {vip} within {timeout:?}; its stderr:\n{err}");
}

/// `weir run --config CONFIG` with HOME and XDG_RUNTIME_DIR set to the
/// config's directory, so nothing can land in the real home directory;
/// under `ulimit -n NOFILE` when given. Stderr is piped, stdout discarded.
pub fn spawn_run(config: &Path, nofile: Option<u32>) -> Proc {
    let home = config.parent().unwrap();
    let mut cmd = match nofile {
        // `ulimit -n` lowers soft and hard, so weir cannot raise it back.
        Some(n) => {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg(format!("ulimit -n {n} && exec \"$0\" run --config \"$1\""))
                .arg(BIN)
                .arg(config);
            c
        }
        None => {
            let mut c = Command::new(BIN);
            c.args(["run", "--config"]).arg(config);
            c
        }
    };
    Proc(
        cmd.env("RUST_LOG", "info")
            .env("HOME", home)
            .env("XDG_RUNTIME_DIR", home)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

/// Wait (polling, at most `timeout`) for `child` to exit; one that keeps
/// running is killed. Its exit code; `None` if it was killed (or ended by
/// a signal).
pub fn exit_code_within(child: &mut Child, timeout: Duration) -> Option<i32> {
    let mut code = None;
    let exited = super::wait_until(timeout, || match child.try_wait() {
        Ok(Some(s)) => {
            code = s.code();
            true
        }
        _ => false,
    });
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
    }
    code
}

/// SIGTERM to the daemon `child` while `vip` has an established connection:
/// new connections are refused within `timeout` and the held connection is
/// still served. The held connection, and the two bytes it echoed for
/// "ok".
pub fn sigterm_with_a_held_connection(
    child: &Proc,
    vip: SocketAddr,
    timeout: Duration,
) -> (TcpStream, [u8; 2]) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let mut held = super::held(vip);
    kill(Pid::from_raw(child.0.id() as i32), Signal::SIGTERM).unwrap();
    assert!(
        super::wait_until(timeout, || TcpStream::connect(vip).is_err()),
        "still accepting after SIGTERM"
    );
    held.write_all(b"ok").unwrap();
    let mut b = [0u8; 2];
    held.read_exact(&mut b).unwrap();
    (held, b)
}

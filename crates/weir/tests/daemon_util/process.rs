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

/// An address on 127.0.0.1 that was free a moment ago.
pub fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
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

//! Backends written in the bench: an idle-connection holder, a slow-reader
//! source that writes as fast as the kernel takes bytes (twice: once with
//! loopback's own segment size, once with Ethernet-sized segments), and a
//! UDP echo.
//!
//! The Ethernet slow source sets `TCP_MAXSEG` ([`ETH_MSS_OPTION`]) on its
//! listener before `listen`: accepted sockets inherit it and advertise it in
//! the SYN-ACK, so the proxy's connection to it, and the backend's own send
//! buffer (which Linux sizes from the segment size), behave as over an
//! MTU-1500 link.
//!
//! They run on a small tokio runtime owned by [`BenchServers`]; dropping it
//! shuts the runtime down and closes every socket. Each TCP server counts
//! the connections it currently holds so the suite can wait (bounded) until
//! the proxy has really opened N backend connections, and until they are
//! all gone again before the next measurement.

use std::net::UdpSocket;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket};

use super::sys::{ETH_MSS_OPTION, free_port, lo};

/// Connections a bench TCP server currently holds.
#[derive(Debug, Default)]
pub(crate) struct OpenCount(AtomicUsize);

impl OpenCount {
    /// Current count.
    pub(crate) fn get(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }

    /// Polls until `pred(count)` holds; fails after `timeout`.
    pub(crate) fn wait(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(usize) -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while !pred(self.get()) {
            if Instant::now() > deadline {
                bail!(
                    "timed out after {timeout:?} waiting for {what} (open: {})",
                    self.get()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }
}

/// Decrements the count when a connection's task ends, however it ends.
struct Held(Arc<OpenCount>);

impl Held {
    fn new(c: &Arc<OpenCount>) -> Self {
        c.0.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(c))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The bench's own backends.
#[derive(Debug)]
pub(crate) struct BenchServers {
    /// Holds connections open and idle until the peer closes.
    pub(crate) idle_port: u16,
    /// Writes to every connection as fast as possible, never reads.
    pub(crate) slow_port: u16,
    /// The same with Ethernet-sized segments (listener `TCP_MAXSEG`
    /// [`ETH_MSS_OPTION`]); its connections count in `slow_open` too.
    pub(crate) slow_eth_port: u16,
    /// UDP echo.
    pub(crate) udp_port: u16,
    pub(crate) idle_open: Arc<OpenCount>,
    pub(crate) slow_open: Arc<OpenCount>,
    rt: Option<tokio::runtime::Runtime>,
    udp_stop: Arc<AtomicBool>,
    udp_thread: Option<JoinHandle<()>>,
}

impl BenchServers {
    /// Binds all four on fresh loopback ports and starts serving.
    pub(crate) fn start() -> Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("bench-backend")
            .enable_all()
            .build()
            .context("building the backend runtime")?;
        let idle_port = free_port()?;
        let slow_port = free_port()?;
        let slow_eth_port = free_port()?;
        let udp_port = free_port()?;
        let idle_open = Arc::new(OpenCount::default());
        let slow_open = Arc::new(OpenCount::default());
        let idle = rt.block_on(async { listen(idle_port, None) })?;
        let slow = rt.block_on(async { listen(slow_port, None) })?;
        let slow_eth = rt.block_on(async { listen(slow_eth_port, Some(ETH_MSS_OPTION)) })?;
        rt.spawn(serve_idle(idle, Arc::clone(&idle_open)));
        rt.spawn(serve_slow(slow, Arc::clone(&slow_open)));
        rt.spawn(serve_slow(slow_eth, Arc::clone(&slow_open)));
        let udp = UdpSocket::bind(lo(udp_port))?;
        udp.set_read_timeout(Some(Duration::from_millis(100)))?;
        let udp_stop = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&udp_stop);
        let udp_thread = std::thread::Builder::new()
            .name("bench-udp-echo".into())
            .spawn(move || udp_echo(&udp, &stop))?;
        Ok(Self {
            idle_port,
            slow_port,
            slow_eth_port,
            udp_port,
            idle_open,
            slow_open,
            rt: Some(rt),
            udp_stop,
            udp_thread: Some(udp_thread),
        })
    }
}

impl Drop for BenchServers {
    fn drop(&mut self) {
        self.udp_stop.store(true, Ordering::Release);
        if let Some(t) = self.udp_thread.take() {
            let _ = t.join();
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

/// A listener with a deep accept queue: with the default (128) a burst of
/// proxied connects overflows it, and with SYN cookies the overflowed
/// connections look established to the proxy but never reach us.
/// `mss`: `TCP_MAXSEG` set before `listen`, inherited by accepted sockets.
fn listen(port: u16, mss: Option<u32>) -> Result<TcpListener> {
    let s = TcpSocket::new_v4()?;
    s.set_reuseaddr(true)?;
    if let Some(mss) = mss {
        socket2::SockRef::from(&s)
            .set_tcp_mss(mss)
            .with_context(|| format!("TCP_MAXSEG {mss} on the listener of port {port}"))?;
    }
    s.bind(lo(port))?;
    Ok(s.listen(4096)?)
}

async fn serve_idle(l: TcpListener, open: Arc<OpenCount>) {
    loop {
        let Ok((mut s, _)) = l.accept().await else {
            continue;
        };
        let held = Held::new(&open);
        tokio::spawn(async move {
            let _held = held;
            let mut b = [0u8; 64];
            // Until the peer closes (or sends something, which nobody does).
            while let Ok(n) = s.read(&mut b).await {
                if n == 0 {
                    break;
                }
            }
        });
    }
}

async fn serve_slow(l: TcpListener, open: Arc<OpenCount>) {
    static CHUNK: [u8; 64 * 1024] = [0x5a; 64 * 1024];
    loop {
        let Ok((mut s, _)) = l.accept().await else {
            continue;
        };
        let held = Held::new(&open);
        tokio::spawn(async move {
            let _held = held;
            // Ends when the proxy resets or closes the connection.
            while s.write_all(&CHUNK).await.is_ok() {}
        });
    }
}

fn udp_echo(sock: &UdpSocket, stop: &AtomicBool) {
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::Acquire) {
        if let Ok((n, from)) = sock.recv_from(&mut buf) {
            let _ = sock.send_to(&buf[..n], from);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpStream;

    use super::*;
    use crate::proxy::sys::ETH_SEGMENT;

    /// Payload bytes per segment the kernel uses on `s` (`TCP_MAXSEG` of a
    /// connected socket).
    fn segment(s: &TcpStream) -> u32 {
        socket2::SockRef::from(s).tcp_mss().unwrap()
    }

    #[test]
    fn backends_count_echo_and_stream() {
        let s = BenchServers::start().unwrap();
        // Idle: counted while held, uncounted after close.
        let c = TcpStream::connect(lo(s.idle_port)).unwrap();
        s.idle_open
            .wait("idle open", Duration::from_secs(5), |n| n == 1)
            .unwrap();
        drop(c);
        s.idle_open
            .wait("idle closed", Duration::from_secs(5), |n| n == 0)
            .unwrap();
        // Slow: sends data nobody asked for.
        let mut c = TcpStream::connect(lo(s.slow_port)).unwrap();
        let mut b = [0u8; 1024];
        c.read_exact(&mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0x5a));
        s.slow_open
            .wait("slow open", Duration::from_secs(5), |n| n == 1)
            .unwrap();
        drop(c);
        s.slow_open
            .wait("slow closed", Duration::from_secs(5), |n| n == 0)
            .unwrap();
        // Slow with Ethernet segments: the listener's MSS reaches a client
        // that set nothing itself (the SYN-ACK carried it), while the plain
        // slow port keeps loopback's large segments.
        let plain = TcpStream::connect(lo(s.slow_port)).unwrap();
        let mut c = TcpStream::connect(lo(s.slow_eth_port)).unwrap();
        c.read_exact(&mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0x5a));
        // 1448 with TCP timestamps, 1460 if the host has them off.
        let eth = segment(&c);
        assert!(
            (ETH_SEGMENT..=ETH_MSS_OPTION).contains(&eth),
            "Ethernet slow port: {eth}-byte segments"
        );
        assert!(segment(&plain) > 4 * ETH_MSS_OPTION, "{}", segment(&plain));
        s.slow_open
            .wait("both slow open", Duration::from_secs(5), |n| n == 2)
            .unwrap();
        drop((c, plain));
        s.slow_open
            .wait("slow closed", Duration::from_secs(5), |n| n == 0)
            .unwrap();
        // UDP echo.
        let u = UdpSocket::bind(lo(0)).unwrap();
        u.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        u.connect(lo(s.udp_port)).unwrap();
        u.send(b"ping").unwrap();
        let n = u.recv(&mut b).unwrap();
        assert_eq!(&b[..n], b"ping");
        // The idle server ignores what it is sent and stays open.
        let mut t = TcpStream::connect(lo(s.idle_port)).unwrap();
        t.write_all(b"x").unwrap();
        s.idle_open
            .wait("idle open after write", Duration::from_secs(5), |n| n == 1)
            .unwrap();
    }
}

//! The TCP proxy: accept loop (with EMFILE back-off), backend choice with
//! connect-timeout retry, and the bidirectional copy with half-close, RST
//! propagation, idle timeouts per state and bounded buffering.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use socket2::SockRef;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use super::{ConnEntry, ConnState, Service, Shared};
use crate::config::Protocol;

pub(crate) async fn accept_loop(shared: Arc<Shared>, svc: Arc<Service>, listener: TcpListener) {
    let mut backoff = Duration::from_millis(10);
    let mut rng = weir_sched::SplitMix64::new(super::rng_seed());
    loop {
        let accepted = tokio::select! {
            _ = svc.cancel.cancelled() => return,
            _ = shared.stop_accept.cancelled() => return,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                backoff = Duration::from_millis(10);
                let seed = weir_sched::RandomSource::next_u64(&mut rng);
                tokio::spawn(handle(shared.clone(), svc.clone(), stream, peer, seed));
            }
            Err(e) if is_fd_exhaustion(&e) => {
                // Out of descriptors: the pending connection stays in the
                // backlog; back off instead of spinning on accept.
                *shared
                    .refused
                    .lock()
                    .entry("fd_exhausted".into())
                    .or_default() += 1;
                tracing::warn!(
                    backoff_ms = backoff.as_millis() as u64,
                    "accept: {e}; backing off"
                );
                tokio::select! {
                    _ = svc.cancel.cancelled() => return,
                    _ = shared.stop_accept.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            Err(e) => tracing::debug!("accept: {e}"),
        }
    }
}

fn is_fd_exhaustion(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOBUFS) | Some(libc::ENOMEM)
    )
}

fn reset(s: &TcpStream) {
    let _ = SockRef::from(s).set_linger(Some(Duration::ZERO));
}

async fn handle(
    shared: Arc<Shared>,
    svc: Arc<Service>,
    client: TcpStream,
    peer: SocketAddr,
    seed: u64,
) {
    let tenant = svc.tenant.clone();
    if let Err(why) = shared.admit(&tenant) {
        shared.refuse(Some(&tenant), why);
        reset(&client);
        return;
    }
    let params = svc.params.read().clone();
    let mut rng = weir_sched::SplitMix64::new(seed);
    let mut tried: Vec<SocketAddr> = Vec::new();
    let max_tries = svc.set.read().backends.len().max(1);
    let mut connected = None;
    let mut last_entry: Option<Arc<ConnEntry>> = None;
    while tried.len() < max_tries {
        let backend = match svc.choose(&shared, Protocol::Tcp, peer, &tried, &mut rng) {
            Ok(b) => b,
            Err(why) => {
                if tried.is_empty() {
                    shared.refuse(Some(&tenant), why);
                }
                break;
            }
        };
        tried.push(backend.addr);
        let entry = match shared.register(
            &svc,
            &backend,
            Protocol::Tcp,
            peer,
            ConnState::SynRecv,
            params.connect_timeout,
        ) {
            Ok(e) => e,
            Err(why) => {
                shared.refuse(Some(&tenant), why);
                break;
            }
        };
        let attempt = tokio::select! {
            _ = entry.cancel.cancelled() => None,
            r = tokio::time::timeout(params.connect_timeout, connect(&shared, backend.addr)) => Some(r),
        };
        match attempt {
            Some(Ok(Ok(s))) => {
                connected = Some((s, entry));
                break;
            }
            Some(Ok(Err(e))) => {
                tracing::debug!(backend = %backend.addr, "connect failed: {e}");
                shared.unregister(&entry, "connect_failed");
            }
            Some(Err(_)) => {
                tracing::debug!(backend = %backend.addr, "connect timed out");
                shared.unregister(&entry, "connect_timeout");
            }
            None => {
                last_entry = Some(entry);
                break;
            }
        }
    }
    if let Some(e) = last_entry {
        shared.unregister(&e, "killed");
    }
    let Some((backend_stream, entry)) = connected else {
        if !tried.is_empty() {
            *shared
                .refused
                .lock()
                .entry("backend_unreachable".into())
                .or_default() += 1;
        }
        shared.release(&tenant);
        reset(&client);
        return;
    };
    entry.set_state(&shared, ConnState::Established);
    entry.timeout_ms.store(
        entry.tenant.timeouts.read().established.0,
        std::sync::atomic::Ordering::Relaxed,
    );
    let reason = proxy(&shared, &entry, client, backend_stream).await;
    entry.set_state(&shared, ConnState::Close);
    shared.unregister(&entry, reason);
    shared.release(&tenant);
}

async fn connect(shared: &Shared, addr: SocketAddr) -> io::Result<TcpStream> {
    let sock = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // A modest receive buffer bounds what piles up from the backend when
    // the client stops reading (seed 004 applied to the receive side).
    let rcv = (shared.daemon_cfg.buffer_size * 4).max(16 * 1024);
    let _ = sock.set_recv_buffer_size(rcv as u32);
    sock.connect(addr).await
}

fn tune(shared: &Shared, s: &TcpStream) {
    let _ = s.set_nodelay(true);
    let lowat = shared.daemon_cfg.notsent_lowat;
    if lowat != 0 {
        let _ = SockRef::from(s).set_tcp_notsent_lowat(lowat);
    }
}

/// How one direction ended.
enum End {
    /// Read EOF; the FIN was passed on.
    Eof,
    /// A read or write failed (reset, broken pipe...).
    Error,
}

async fn pump(
    from: &mut tokio::net::tcp::ReadHalf<'_>,
    to: &mut tokio::net::tcp::WriteHalf<'_>,
    buf_size: usize,
    shared: &Shared,
    entry: &ConnEntry,
    inbound: bool,
) -> End {
    // A direction holds a buffer only while bytes flow: it takes one from
    // the worker's pool when the socket turns readable and hands it back as
    // soon as a read would block, so idle connections hold none (HAProxy's
    // model) and a busy one never holds more than one per direction.
    let mut buf: Option<Vec<u8>> = None;
    loop {
        let b = match buf.as_mut() {
            Some(b) => b,
            None => {
                if from.as_ref().readable().await.is_err() {
                    return End::Error;
                }
                buf.insert(pool::take(buf_size))
            }
        };
        let n = match from.try_read(b) {
            Ok(0) => {
                pool::give(buf.take());
                let _ = to.shutdown().await;
                return End::Eof;
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                pool::give(buf.take());
                continue;
            }
            Err(_) => {
                pool::give(buf.take());
                return End::Error;
            }
        };
        if inbound {
            shared.count_in(entry, n);
        } else {
            shared.count_out(entry, n);
        }
        // Read again only after everything was written: at most one buffer
        // per direction lives in user space.
        if to.write_all(&b[..n]).await.is_err() {
            pool::give(buf.take());
            return End::Error;
        }
    }
}

/// Per-worker pool of copy buffers. Each worker thread runs one
/// current-thread runtime, so a thread-local free list needs no lock; it
/// keeps at most `MAX_POOLED` buffers so a burst's memory goes back to the
/// allocator afterwards.
mod pool {
    use std::cell::RefCell;

    const MAX_POOLED: usize = 64;

    thread_local! {
        static FREE: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
    }

    /// A buffer of exactly `size` bytes.
    pub(super) fn take(size: usize) -> Vec<u8> {
        FREE.with_borrow_mut(|free| match free.pop() {
            Some(b) if b.len() == size => b,
            _ => vec![0u8; size],
        })
    }

    /// Returns a buffer to this worker's pool (or frees it).
    pub(super) fn give(buf: Option<Vec<u8>>) {
        if let Some(b) = buf {
            FREE.with_borrow_mut(|free| {
                if free.len() < MAX_POOLED {
                    free.push(b);
                }
            });
        }
    }
}

async fn proxy(
    shared: &Shared,
    entry: &Arc<ConnEntry>,
    mut client: TcpStream,
    mut backend: TcpStream,
) -> &'static str {
    use std::sync::atomic::Ordering::Relaxed;
    tune(shared, &client);
    tune(shared, &backend);
    // PROXY protocol header before any client byte.
    let pp = entry.backend.spec.read().proxy_protocol.clone();
    if let Some(v) = pp.and_then(|v| v.parse::<crate::proxy_protocol::Version>().ok()) {
        let local = client.local_addr().unwrap_or(entry.service.listen);
        let hdr = crate::proxy_protocol::header(
            v,
            crate::proxy_protocol::Transport::Stream,
            entry.client,
            local,
        );
        if backend.write_all(&hdr).await.is_err() {
            reset(&client);
            return "backend_error";
        }
    }
    let buf = shared.daemon_cfg.buffer_size;
    let reason = {
        let (mut cr, mut cw) = client.split();
        let (mut br, mut bw) = backend.split();
        let c2b = pump(&mut cr, &mut bw, buf, shared, entry, true);
        let b2c = pump(&mut br, &mut cw, buf, shared, entry, false);
        tokio::pin!(c2b, b2c);
        let (mut c2b_done, mut b2c_done) = (false, false);
        loop {
            let idle_ms = entry.timeout_ms.load(Relaxed);
            let last = entry.last_active.load(Relaxed);
            let now = shared.now_ms();
            let left = (last + idle_ms).saturating_sub(now);
            tokio::select! {
                r = &mut c2b, if !c2b_done => {
                    c2b_done = true;
                    match r {
                        End::Error => break "client_reset",
                        End::Eof if b2c_done => break "closed",
                        End::Eof => half_closed(shared, entry),
                    }
                }
                r = &mut b2c, if !b2c_done => {
                    b2c_done = true;
                    match r {
                        End::Error => break "backend_reset",
                        End::Eof if c2b_done => break "closed",
                        End::Eof => half_closed(shared, entry),
                    }
                }
                _ = entry.cancel.cancelled() => break *entry.cancel_reason.lock(),
                _ = tokio::time::sleep(Duration::from_millis(left)) => {
                    let last = entry.last_active.load(Relaxed);
                    if shared.now_ms() >= last + entry.timeout_ms.load(Relaxed) {
                        break "idle_timeout";
                    }
                }
            }
        }
    };
    if reason != "closed" {
        // Propagate the abort as a RST on both sides.
        reset(&client);
        reset(&backend);
    }
    reason
}

fn half_closed(shared: &Shared, entry: &ConnEntry) {
    entry.set_state(shared, ConnState::FinWait);
    entry.timeout_ms.store(
        entry.tenant.timeouts.read().fin_wait.0,
        std::sync::atomic::Ordering::Relaxed,
    );
}

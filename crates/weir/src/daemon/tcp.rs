//! The TCP proxy: accept loop (with EMFILE back-off), backend choice with
//! connect-timeout retry, and the bidirectional copy with half-close, RST
//! propagation, idle timeouts per state and bounded buffering.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use socket2::SockRef;
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{TcpListener, TcpStream};

use weir_flowtable::{Dir, Millis};

use super::owners::Owner;
use super::{Conn, ConnState, Refusal, Service, Shared, TcpTuning};
use crate::config::Protocol;

/// The next `k` accept steering publishes, for a listener that applies
/// it; never, for one that does not.
async fn steer_changed(rx: &mut Option<tokio::sync::watch::Receiver<usize>>) -> Option<usize> {
    if let Some(rx) = rx
        && rx.changed().await.is_ok()
    {
        return Some(*rx.borrow_and_update());
    }
    std::future::pending().await
}

/// Points `listener`'s group at the first `k` workers. A failure leaves the
/// group as it was (every connection still lands on some worker's
/// listener): logged, not fatal.
fn steer_group(shared: &Shared, svc: &Service, listener: &TcpListener, k: usize) {
    if let Err(e) = shared.steering.apply(listener, k) {
        static GATE: super::ratelog::RateLimited = super::ratelog::RateLimited::new(1000);
        super::ratelog::warn(
            &GATE,
            format_args!("accept steering on {}: {e}", svc.listen),
        );
    }
}

/// The accept loop of one worker's listener of `svc`. The listener counts
/// as open (what a drain waits for, [`super::admission::Admission::listeners`])
/// from this call, not from the task's first turn, until the loop ends.
pub(crate) fn accept_loop(
    shared: Arc<Shared>,
    svc: Arc<Service>,
    listener: TcpListener,
) -> impl std::future::Future<Output = ()> + Send {
    let open = Counted::new(&shared, |a| &a.listeners);
    async move {
        accept_until_stopped(&shared, &svc, listener).await;
        drop(open);
    }
}

/// One of something counted in an [`super::admission::Admission`] gauge
/// while it lives: an open TCP listener (`listeners`), a lingering close
/// of a removed service's queued connection (`closing`).
struct Counted(Arc<Shared>, fn(&super::admission::Admission) -> &AtomicU64);

impl Counted {
    fn new(shared: &Arc<Shared>, gauge: fn(&super::admission::Admission) -> &AtomicU64) -> Self {
        gauge(&shared.admission).fetch_add(1, Relaxed);
        Self(shared.clone(), gauge)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        // Release: a drain that reads the gauge at 0 (Acquire) sees what
        // the counted one did (a listener's admitted connections in
        // `active`).
        (self.1)(&self.0.admission).fetch_sub(1, std::sync::atomic::Ordering::Release);
    }
}

async fn accept_until_stopped(shared: &Arc<Shared>, svc: &Arc<Service>, listener: TcpListener) {
    let mut backoff = Duration::from_millis(10);
    // Turns spent waiting for a UDP session ended early to close.
    let mut freeing_turns = 0u32;
    let mut rng = weir_sched::SplitMix64::new(super::rng_seed());
    // One listener of each group (worker 0's) points the group at the
    // workers accept steering chose, now and whenever that changes.
    let worker = super::stats::worker_index();
    let mut steer = shared.steering.watcher(worker);
    if let Some(rx) = &mut steer {
        let k = *rx.borrow_and_update();
        // Spread at start: no program to take off.
        if shared.steering.steers() {
            steer_group(shared, svc, &listener, k);
        }
    }
    loop {
        let accepted = tokio::select! {
            _ = svc.cancel.cancelled() => {
                close_queued(shared, svc, &listener);
                return;
            }
            _ = shared.admission.stop_accept.cancelled() => {
                take_queued(shared, svc, &listener, worker, &mut rng);
                return;
            }
            Some(k) = steer_changed(&mut steer) => {
                steer_group(shared, svc, &listener, k);
                continue;
            }
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                backoff = Duration::from_millis(10);
                freeing_turns = 0;
                serve_accepted(shared, svc, stream, peer, worker, &mut rng);
            }
            Err(e) if is_fd_exhaustion(&e) => {
                // Out of descriptors: the pending connection stays in the
                // backlog; back off instead of spinning on accept.
                shared.admission.refused.add(Refusal::FdExhausted);
                // Unless a spoofed datagram flood's UDP sessions hold them
                // (a socket each for `udp_timeout`): one of those ends
                // (`udp::free_a_descriptor`), its socket closes when its
                // task runs, and accept is tried again after a turn.
                // A session ended on another worker closes when that
                // worker runs it, and ends none here meanwhile; but every
                // `FREEING_TURNS`th turn without a descriptor ends one
                // regardless: that worker may be stuck, and this loop
                // would spin on it.
                freeing_turns += 1;
                let freeing = if freeing_turns.is_multiple_of(super::udp::FREEING_TURNS) {
                    super::udp::end_a_session_now(shared, &svc.tenant, &mut rng)
                } else {
                    super::udp::free_a_descriptor(shared, &svc.tenant, &mut rng)
                };
                if freeing {
                    tokio::task::yield_now().await;
                    continue;
                }
                // Every listener of every worker gets here while fds are
                // short: one line a second with a count.
                static GATE: super::ratelog::RateLimited = super::ratelog::RateLimited::new(1000);
                super::ratelog::warn(
                    &GATE,
                    format_args!("accept: {e}; backing off {} ms", backoff.as_millis()),
                );
                tokio::select! {
                    _ = svc.cancel.cancelled() => {
                        close_queued(shared, svc, &listener);
                        return;
                    }
                    _ = shared.admission.stop_accept.cancelled() => {
                        take_queued(shared, svc, &listener, worker, &mut rng);
                        return;
                    }
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            Err(e) => tracing::debug!("accept: {e}"),
        }
    }
}

/// Admits a connection `worker` accepted and spawns its task; a refused one
/// is reset.
fn serve_accepted(
    shared: &Arc<Shared>,
    svc: &Arc<Service>,
    stream: TcpStream,
    peer: SocketAddr,
    worker: usize,
    rng: &mut weir_sched::SplitMix64,
) {
    shared.steering.accepted(worker);
    // Admission before spawning: a refused connection (a flood over a
    // limit) costs no task.
    let slot = match svc.tcp_client_slot(peer.ip()) {
        Ok(slot) => slot,
        Err(why) => {
            shared.admission.refuse(Some(&svc.tenant), why);
            reset(&stream);
            return;
        }
    };
    if let Err(why) = shared.admission.admit(&svc.tenant, shared.now_ns()) {
        shared.admission.refuse(Some(&svc.tenant), why);
        reset(&stream);
        return;
    }
    let seed = weir_sched::RandomSource::next_u64(rng);
    // The future is made here and moved into the task as is: one awaited
    // inside a wrapping `async` block is stored twice in the task
    // (docs/BENCHMARKS.md, idle memory). Boxed, so the task holds a
    // pointer: tokio moves a task's future whole (into its cell, and each
    // stage change rewrites it), ~1.4 KB six times per connection unboxed;
    // boxed, one plain `malloc` instead, 3% fewer user-space instructions
    // per connection (callgrind) and the same idle memory.
    tokio::spawn(Box::pin(handle(
        shared.clone(),
        svc.clone(),
        stream,
        peer,
        seed,
        slot,
    )));
}

/// The most connections a draining listener takes from its accept queue:
/// the backlog it listens with (`open_socket_group`), and as many again
/// that may complete while it takes them. A flood that keeps the queue
/// full cannot hold the listener open.
const QUEUED_MAX: usize = 2 * 4096;

/// The daemon drains: takes the connections the kernel had already
/// completed on `listener` (its accept queue) and serves them as any
/// other, until an accept would wait (at most [`QUEUED_MAX`]). The
/// listener closes when the loop returns, and closing it resets every
/// connection still queued: they used to be reset that way, clients the
/// kernel had already told they were connected. A stop (everything is
/// being closed) takes none.
fn take_queued(
    shared: &Arc<Shared>,
    svc: &Arc<Service>,
    listener: &TcpListener,
    worker: usize,
    rng: &mut weir_sched::SplitMix64,
) -> usize {
    let taken = accept_queued(shared, svc, listener, |stream, peer| {
        serve_accepted(shared, svc, stream, peer, worker, rng);
    });
    if taken > 0 {
        tracing::debug!(
            taken,
            "draining {}: took the queued connections",
            svc.listen
        );
    }
    taken
}

/// `svc` was deleted, or replaced (a reload or an edit moved it): its
/// connections close, and so do the ones the kernel had already completed
/// on `listener`, but each with a clean end (weir's FIN, see
/// [`close_gracefully`]) rather than the reset closing the listener with
/// them queued sent (they used to get that). A stop takes none. Each
/// close is counted in [`super::admission::Admission::closing`] from here
/// (before the listener's count goes) until it ends, so that a drain waits
/// for it.
fn close_queued(shared: &Arc<Shared>, svc: &Arc<Service>, listener: &TcpListener) -> usize {
    let closed = accept_queued(shared, svc, listener, |stream, _| {
        let closing = Counted::new(shared, |a| &a.closing);
        tokio::spawn(close_gracefully(shared.clone(), stream, closing));
    });
    if closed > 0 {
        tracing::debug!(
            closed,
            "{} removed: closed its queued connections",
            svc.listen
        );
    }
    closed
}

/// How long a queued connection of a removed service has, after weir's
/// FIN, to send its own before weir closes it anyway.
const CLOSE_LINGER: Duration = Duration::from_secs(2);

/// Ends `stream` cleanly: a FIN, then what the client sent is read and
/// dropped until its FIN (closing a socket with data unread resets it),
/// for at most [`CLOSE_LINGER`] or until the daemon stops. `closing`
/// counts it until the socket is closed.
async fn close_gracefully(shared: Arc<Shared>, mut stream: TcpStream, closing: Counted) {
    use tokio::io::AsyncReadExt;
    if stream.shutdown().await.is_err() {
        return;
    }
    let mut buf = [0u8; 512];
    let drained = async {
        while let Ok(n) = stream.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    tokio::select! {
        _ = drained => {}
        _ = tokio::time::sleep(CLOSE_LINGER) => {}
        _ = shared.conns.kill_all.cancelled() => {}
    }
    drop(stream);
    drop(closing);
}

/// Accepts what `listener`'s accept queue holds (at most [`QUEUED_MAX`])
/// and hands each connection to `each`; returns how many. A stop
/// (everything is being closed) takes none.
fn accept_queued(
    shared: &Arc<Shared>,
    svc: &Arc<Service>,
    listener: &TcpListener,
    mut each: impl FnMut(TcpStream, SocketAddr),
) -> usize {
    if shared.conns.kill_all.is_cancelled() {
        return 0;
    }
    let mut taken = 0;
    for _ in 0..QUEUED_MAX {
        // Straight to the kernel: tokio's `accept` would wait for a
        // readiness event it may not have had yet.
        let (sock, addr) = match SockRef::from(listener).accept() {
            Ok(a) => a,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            // The client gave up while queued, or a signal: the next one.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionAborted | io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(e) => {
                // Out of descriptors, say: what is left is reset as the
                // listener closes.
                tracing::warn!("closing {}: accept: {e}", svc.listen);
                break;
            }
        };
        let Some(peer) = addr.as_socket() else {
            continue;
        };
        let std: std::net::TcpStream = sock.into();
        let stream = match std
            .set_nonblocking(true)
            .and_then(|()| TcpStream::from_std(std))
        {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("closing {}: {e}", svc.listen);
                continue;
            }
        };
        each(stream, peer);
        taken += 1;
    }
    taken
}

/// Pauses between backend connects that failed for want of descriptors:
/// 10 ms doubling to 640 ms, about 1.3 s in all, then give up (the client is
/// reset as for an unreachable backend). I/O-free.
#[derive(Debug, Default)]
struct FdBackoff {
    tries: u32,
}

impl FdBackoff {
    const MAX_TRIES: u32 = 7;

    /// The next pause, or `None` once the tries are used up.
    fn next(&mut self) -> Option<Duration> {
        if self.tries >= Self::MAX_TRIES {
            return None;
        }
        let pause = Duration::from_millis(10 << self.tries);
        self.tries += 1;
        Some(pause)
    }
}

pub(super) fn is_fd_exhaustion(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOBUFS) | Some(libc::ENOMEM)
    )
}

fn reset(s: &TcpStream) {
    let _ = SockRef::from(s).set_linger(Some(Duration::ZERO));
}

/// Serves one accepted connection that [`Shared::admit`] has admitted
/// (released here); the task of that connection. The client's place
/// (`slot`) is held until the connection ends.
async fn handle(
    shared: Arc<Shared>,
    svc: Arc<Service>,
    client: TcpStream,
    peer: SocketAddr,
    seed: u64,
    slot: Option<super::ClientSlot>,
) {
    let tenant = svc.tenant.clone();
    match shared.conns.owners.claim() {
        Some(owner) => serve(&shared, &svc, &owner, client, peer, seed).await,
        None => {
            shared.admission.refuse(Some(&tenant), Refusal::TableFull);
            reset(&client);
        }
    }
    // The client's place first: once the connection is no longer counted
    // in `active_conns`, the client's next connection finds its place.
    drop(slot);
    shared.admission.release(&tenant);
}

/// Connects `client` to a backend (retrying others) and proxies; the
/// connection's entry names `owner`.
async fn serve(
    shared: &Shared,
    svc: &Arc<Service>,
    owner: &Owner,
    client: TcpStream,
    peer: SocketAddr,
    seed: u64,
) {
    // The connect phase is a future of its own, so that none of its state
    // (the attempt's timer, the tried list, the service's parameters) stays
    // in this task while the connection sits idle in `proxy`: the task is
    // most of an idle connection's memory (docs/BENCHMARKS.md).
    // Read once: the connection keeps these whatever a reload sets later.
    let tuning = shared.tuning.get();
    if tuning.notsent_lowat != svc.listener_lowat {
        // Changed by a reload since the listener was opened: the accepted
        // socket inherited the old value.
        let _ = SockRef::from(&client).set_tcp_notsent_lowat(tuning.notsent_lowat);
    }
    // Whether the backend socket starts small, as it is connected; the
    // rest of `tuning` is not kept here past the connect (this task's size
    // is an idle connection's memory).
    let small_rcvbuf = tuning.backend_rcvbuf != 0;
    let Some((backend_stream, conn)) =
        connect_any(shared, svc, owner, &client, peer, seed, tuning).await
    else {
        reset(&client);
        return;
    };
    conn.set_state(shared, ConnState::Established);
    let reason = proxy(shared, &conn, owner, client, backend_stream, small_rcvbuf).await;
    // No CLOSE state in the table: the entry goes right away, and `close`
    // settles the backend's counts from its last state.
    shared.close(&conn, reason);
}

/// Opens the connection's entry and connects to a backend, trying the
/// next one when a connect fails; `None` when none could be reached (the
/// refusal is counted here, the client is the caller's to reset).
async fn connect_any(
    shared: &Shared,
    svc: &Arc<Service>,
    owner: &Owner,
    client: &TcpStream,
    peer: SocketAddr,
    seed: u64,
    tuning: TcpTuning,
) -> Option<(TcpStream, Conn)> {
    let tenant = &svc.tenant;
    // Set once the connection was counted as refused, so it is counted
    // under one reason only.
    let mut refused = false;
    let params = svc.params.load_full();
    let mut rng = weir_sched::SplitMix64::new(seed);
    // The backends that failed this connection; a backend goes in only
    // once its attempt failed, so a connection that gets through on the
    // first try allocates nothing here.
    let mut tried: Vec<SocketAddr> = Vec::new();
    let max_tries = svc.set.load().backends.len().max(1);
    let mut connected = None;
    let mut killed = false;
    let mut fd_backoff = FdBackoff::default();
    // Places lost to another worker between `choose` and `open`.
    let mut raced = 0u8;
    // Whether the client's connection was counted (once, at its first
    // attempt; each backend counts the attempt it gets).
    let mut counted = false;
    // The destination the client dialled (lblc / lblcr / dh key on it):
    // the service's address, or on a wildcard listener the local one.
    let local = match svc.listen.ip() {
        ip if ip.is_unspecified() => client.local_addr().map_or(ip, |a| a.ip()),
        ip => ip,
    };
    while tried.len() < max_tries {
        let backend = match svc.choose(shared, Protocol::Tcp, peer, local, &tried, &mut rng) {
            Ok(b) => b,
            Err(why) => {
                if tried.is_empty() {
                    shared.admission.refuse(Some(tenant), why);
                    refused = true;
                }
                break;
            }
        };
        let conn = match shared.open(
            svc,
            &backend,
            Protocol::Tcp,
            peer,
            SocketAddr::new(local, svc.listen.port()),
            ConnState::SynRecv,
            owner,
        ) {
            Ok(c) => c,
            // Another worker took the backend's last place since `choose`
            // looked: choose again (it sees the backend full now).
            Err(Refusal::BackendLimit) if raced < 2 => {
                raced += 1;
                continue;
            }
            Err(why) => {
                shared.admission.refuse(Some(tenant), why);
                refused = true;
                break;
            }
        };
        shared.count_conn(svc, &backend, !counted);
        counted = true;
        // The connect's own deadline: a failed attempt moves on to the next
        // backend. (The entry's SYN_RECV timeout, the same length, is the
        // wheel's backstop. It cannot be the deadline itself: the wheel
        // ticks once a second and the expiry thread runs once a second, so
        // it ends an entry up to about 2 s late, where `connect_timeout`
        // goes down to 1 ms; and what it removes, its owner hears as an
        // idle timeout, which ends the connection instead of trying the
        // next backend. This timer costs ~900 user instructions of ~19,000
        // per connection, under 1% of the CPU: docs/BENCHMARKS.md, "The
        // connect timer and the clock".) A connect that found weir out of
        // descriptors is not the backend's fault, and the client should
        // wait rather than be reset: the same backend is tried again after
        // a pause, a bounded number of times, with the entry kept
        // meanwhile, so the connection stays listed and a kill or its
        // service's deletion still reaches it.
        let attempt = loop {
            let attempt = tokio::select! {
                why = owner.closed() => Err(why),
                r = tokio::time::timeout(params.connect_timeout, connect(backend.addr, &tuning)) => Ok(r),
            };
            let Ok(Ok(Err(e))) = &attempt else {
                break attempt;
            };
            if !is_fd_exhaustion(e) {
                break attempt;
            }
            let Some(pause) = fd_backoff.next() else {
                break attempt;
            };
            tracing::debug!(backend = %backend.addr, "connect: {e}; retrying");
            // A spoofed datagram flood's UDP session ended to free a
            // descriptor (as at accept): tried again after a turn, its
            // socket closed by then, instead of after the pause.
            let mut rng = weir_sched::SplitMix64::new(seed ^ u64::from(fd_backoff.tries));
            if super::udp::free_a_descriptor(shared, tenant, &mut rng) {
                tokio::task::yield_now().await;
            } else {
                tokio::select! {
                    why = owner.closed() => break Err(why),
                    _ = tokio::time::sleep(pause) => {}
                }
            }
            // The wait is not idleness: the wheel's SYN_RECV backstop
            // starts again (at most `FdBackoff::MAX_TRIES` times).
            shared.conns.table.set_state_handle(
                conn.handle,
                weir_flowtable::FlowState::SynRecv,
                Millis(shared.now_ms()),
            );
        };
        let reason = match attempt {
            Ok(Ok(Ok(s))) => {
                backend.passive.on_success();
                connected = Some((s, conn));
                break;
            }
            Ok(Ok(Err(e))) if is_fd_exhaustion(&e) => {
                // Still out of descriptors after every pause: the client
                // is reset, and the backend was not at fault.
                tracing::debug!(backend = %backend.addr, "connect: {e}; giving up");
                shared.close(&conn, "fd_exhausted");
                owner.unbind();
                tried.push(backend.addr);
                break;
            }
            Ok(Ok(Err(e))) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) => {
                // No local port left towards this backend (the port range
                // spent on connections and TIME_WAIT to its address): weir's
                // side, not the backend's, so the passive check does not
                // take it out; the next backend, another destination, may
                // have ports.
                static GATE: super::ratelog::RateLimited = super::ratelog::RateLimited::new(1000);
                super::ratelog::warn(
                    &GATE,
                    format_args!(
                        "connect to backend {}: no local port free ({e}): widen \
                         net.ipv4.ip_local_port_range, or give the backend more addresses",
                        backend.addr
                    ),
                );
                "no_local_port"
            }
            Ok(Ok(Err(e))) => {
                tracing::debug!(backend = %backend.addr, "connect failed: {e}");
                shared.connect_failed(svc, &backend, &e.to_string());
                "connect_failed"
            }
            Ok(Err(_)) => {
                tracing::debug!(backend = %backend.addr, "connect timed out");
                let why = format!("timed out after {:?}", params.connect_timeout);
                shared.connect_failed(svc, &backend, &why);
                "connect_timeout"
            }
            Err(why) => {
                // Killed while connecting: closed on purpose, not a refusal.
                shared.close(&conn, why.name());
                killed = true;
                break;
            }
        };
        tried.push(backend.addr);
        shared.close(&conn, reason);
        owner.unbind();
    }
    if connected.is_none() && !tried.is_empty() && !refused && !killed {
        shared.admission.refused.add(Refusal::BackendUnreachable);
    }
    connected
}

async fn connect(addr: SocketAddr, tuning: &TcpTuning) -> io::Result<TcpStream> {
    use socket2::{Domain, Socket, Type};
    // Non-blocking and close-on-exec from the start: no fcntl.
    let sock = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking().cloexec(),
        Some(socket2::Protocol::TCP),
    )?;
    // `TCP_NODELAY` and `TCP_NOTSENT_LOWAT` come later, when a write can
    // need them ([`LateOpts`]); the client side inherits both from the
    // listener.
    // Start small (see `ClampPolicy`): until its client proves to read
    // fast, a backend gets little window, so the bytes of a slow reader
    // wait in the backend's own send queue rather than in weir's.
    let rcv = tuning.backend_rcvbuf;
    if rcv != 0 {
        let _ = sock.set_recv_buffer_size(rcv as usize);
    }
    match sock.connect(&addr.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    let stream = TcpStream::from_std(std::net::TcpStream::from(sock))?;
    // Connected once writable. A failed connect also reports an error or
    // a hang-up; only then is SO_ERROR read for the reason, so a
    // successful connect costs no getsockopt (tokio's own connect always
    // reads it).
    let ready = stream.ready(Interest::WRITABLE | Interest::ERROR).await?;
    if ready.is_error() || ready.is_write_closed() {
        return Err(stream
            .take_error()?
            .unwrap_or_else(|| io::ErrorKind::ConnectionRefused.into()));
    }
    Ok(stream)
}

/// Options every proxied TCP socket gets, set on the listening socket so
/// that accepted sockets inherit them (Linux copies `TCP_NODELAY` and
/// `TCP_NOTSENT_LOWAT` to the child; a test below checks it).
pub(crate) fn tune_listener(s: &socket2::Socket, notsent_lowat: u32) -> io::Result<()> {
    s.set_tcp_nodelay(true)?;
    if notsent_lowat != 0 {
        s.set_tcp_notsent_lowat(notsent_lowat)?;
    }
    Ok(())
}

/// The backend socket's `TCP_NODELAY` and `TCP_NOTSENT_LOWAT`, set before
/// the first write either could change instead of before connect. Neither
/// changes what the first write of a short request sends, so a connection
/// whose client sends its request in one go (most of them) makes neither
/// call: 2 of the 19.4 system calls a proxied connection cost
/// (docs/BENCHMARKS.md, "Syscalls per connection").
///
/// * `TCP_NODELAY`: Linux's Nagle holds a short segment back only while an
///   earlier short segment is unacknowledged, so a socket's first write
///   leaves at once either way; the option is set before any write that
///   follows one that sent bytes.
/// * `TCP_NOTSENT_LOWAT`: a socket never holds more bytes unsent than were
///   written to it, so the limit cannot stop a write before the bytes
///   written reach it; the option is set before the write that would take
///   them past it.
///
/// I/O-free; [`LateOpts::apply`] makes the calls.
#[derive(Debug)]
struct LateOpts {
    /// Bytes the socket has taken (saturating: only compared with `lowat`).
    sent: u32,
    /// `TCP_NODELAY` is set.
    nodelay: bool,
    /// The `TCP_NOTSENT_LOWAT` still to set; 0 once set, or when there is
    /// none (`notsent_lowat = 0`: the kernel's default).
    lowat: u32,
}

/// What [`LateOpts::before_write`] says to set.
#[derive(Debug, Default, PartialEq, Eq)]
struct SetOpts {
    nodelay: bool,
    lowat: Option<u32>,
}

impl LateOpts {
    /// A fresh socket's, with `notsent_lowat` as the connection read it
    /// when it started (a reload later does not change it).
    fn new(notsent_lowat: u32) -> Self {
        Self {
            sent: 0,
            nodelay: false,
            lowat: notsent_lowat,
        }
    }

    /// What to set before a write of `len` bytes; counted as set.
    fn before_write(&mut self, len: usize) -> SetOpts {
        let mut set = SetOpts::default();
        if !self.nodelay && self.sent > 0 {
            self.nodelay = true;
            set.nodelay = true;
        }
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        if self.lowat != 0 && self.sent.saturating_add(len) > self.lowat {
            set.lowat = Some(self.lowat);
            self.lowat = 0;
        }
        set
    }

    /// The socket took `n` bytes.
    fn sent(&mut self, n: usize) {
        self.sent = self
            .sent
            .saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
    }

    /// Sets on `s` what a write of `len` bytes needs first. A failure is
    /// ignored, as it was before connect: the bytes still flow.
    fn apply(&mut self, s: &TcpStream, len: usize) {
        let set = self.before_write(len);
        if set.nodelay {
            let _ = SockRef::from(s).set_tcp_nodelay(true);
        }
        if let Some(lowat) = set.lowat {
            let _ = SockRef::from(s).set_tcp_notsent_lowat(lowat);
        }
    }
}

/// How one direction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Read EOF; the FIN was passed on.
    Eof,
    /// A read or write failed (reset, broken pipe...).
    Error,
}

/// What one direction shares with the other and needs from the daemon.
struct Pipe<'a> {
    shared: &'a Shared,
    conn: &'a Conn,
    buf_size: u32,
    /// `[daemon] blocked_window` as the connection started.
    blocked_window: u32,
    /// The backend socket started with a small fixed `SO_RCVBUF`
    /// (`[daemon] backend_rcvbuf` was set when it connected).
    small_rcvbuf: bool,
    /// Client to backend (bytes counted "in").
    inbound: bool,
    /// The options the socket written to gets as bytes go to it: the
    /// backend socket's (client to backend); none for the client socket,
    /// which inherited them from its listener.
    late: Option<LateOpts>,
    /// Set when this direction has passed its EOF on.
    my_eof: &'a AtomicBool,
    /// The other direction's `my_eof`.
    peer_eof: &'a AtomicBool,
}

/// Waits in a row (writes that found the other side full) before the
/// source's receive window is clamped. One is enough: the clamp must come
/// before the kernel has advertised more window to a sender whose reader
/// turned out slow (it never takes back window it has advertised); a fast
/// flow that merely met a busy moment keeps at least four segments of
/// window and gets the rest back after [`UNCLAMP_AFTER`] free writes.
const CLAMP_AFTER: u32 = 1;

/// Writes in a row that went through without waiting before the clamp is
/// lifted again, or before a small starting receive buffer is opened up.
const UNCLAMP_AFTER: u32 = 64;

/// The receive buffer (bytes asked; the kernel caps it at
/// `net.core.rmem_max`) a backend socket gets once its reader has proved
/// fast. Setting `SO_RCVBUF` turned the kernel's autotuning off for the
/// socket for good, so this fixed size stands in for it.
const OPEN_RCVBUF: usize = 4 << 20;

/// How a direction bounds what piles up in the receive queue of the socket
/// it reads from while the other side is slow (seed 004 on the receive
/// side). A backend socket starts with a small fixed receive buffer
/// (`backend_rcvbuf`); after [`UNCLAMP_AFTER`] writes in a row that did
/// not wait it is opened to [`OPEN_RCVBUF`]. An open (or autotuned) socket
/// whose writes start waiting gets its window clamped at once, lifted after
/// [`UNCLAMP_AFTER`] free writes. I/O-free; the pump applies the actions.
#[derive(Debug, Default)]
struct ClampPolicy {
    /// The receive buffer is still the small starting one.
    small: bool,
    waited: u32,
    free: u32,
    /// The clamp in force before ours, while ours is applied.
    saved: Option<u32>,
}

#[derive(Debug, PartialEq, Eq)]
enum ClampAction {
    None,
    /// Clamp the receive window (and call `clamped`).
    Clamp,
    /// Put this clamp back.
    Restore(u32),
    /// Give the socket [`OPEN_RCVBUF`].
    Open,
}

impl ClampPolicy {
    /// `small`: the socket starts with a small fixed receive buffer.
    fn new(small: bool) -> Self {
        Self {
            small,
            ..Self::default()
        }
    }

    /// A write found the other side full (once per buffer written).
    fn on_wait(&mut self) -> ClampAction {
        self.free = 0;
        self.waited = self.waited.saturating_add(1);
        if self.waited >= CLAMP_AFTER && self.saved.is_none() && !self.small {
            return ClampAction::Clamp;
        }
        ClampAction::None
    }

    /// A buffer was written without waiting.
    fn on_free_write(&mut self) -> ClampAction {
        self.waited = 0;
        if !self.small && self.saved.is_none() {
            return ClampAction::None;
        }
        self.free += 1;
        if self.free < UNCLAMP_AFTER {
            return ClampAction::None;
        }
        self.free = 0;
        if self.small {
            self.small = false;
            return ClampAction::Open;
        }
        match self.saved.take() {
            Some(old) => ClampAction::Restore(old),
            None => ClampAction::None,
        }
    }

    /// The clamp was applied; `old` is what to restore.
    fn clamped(&mut self, old: u32) {
        self.saved = Some(old);
    }
}

// nix's own macro for a socket option it has no type for (its expansion
// calls the other two by name).
use nix::{getsockopt_impl, setsockopt_impl, sockopt_impl};
sockopt_impl!(
    /// `TCP_WINDOW_CLAMP`: the largest receive window the socket advertises.
    /// Unlike shrinking `SO_RCVBUF`, it never drops bytes the peer already
    /// has a window for, and it leaves the kernel's autotuning on.
    WindowClamp,
    Both,
    libc::IPPROTO_TCP,
    libc::TCP_WINDOW_CLAMP,
    u32
);

/// Clamps `s`'s receive window to `bytes`, but to no less than four
/// segments (below one segment the sender's silly-window avoidance would
/// stall the flow; loopback's segments are 64 KiB). Returns the clamp to
/// restore later.
fn clamp_window(s: &TcpStream, bytes: u32) -> Option<u32> {
    use nix::sys::socket::{getsockopt, setsockopt, sockopt::TcpMaxSeg};
    let old = getsockopt(s, WindowClamp).ok()?;
    let mss = getsockopt(s, TcpMaxSeg).unwrap_or(1460);
    let clamp = bytes.max(mss.saturating_mul(4));
    if clamp >= old {
        return None;
    }
    setsockopt(s, WindowClamp, &clamp).ok()?;
    Some(old)
}

/// Whether `s`'s readiness, as tokio last saw it, says its peer sent a FIN
/// (and no error or hang-up came with it). Never waits: the readiness is
/// read, not awaited.
fn fin_seen(s: &TcpStream) -> bool {
    use std::task::{Context, Poll, Waker};
    let all = Interest::READABLE | Interest::WRITABLE | Interest::ERROR;
    let ready = std::pin::pin!(s.ready(all));
    match ready.poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Ok(r)) => r.is_read_closed() && !r.is_write_closed() && !r.is_error(),
        _ => false,
    }
}

async fn pump(
    from: &mut tokio::net::tcp::ReadHalf<'_>,
    to: &mut tokio::net::tcp::WriteHalf<'_>,
    p: &mut Pipe<'_>,
) -> End {
    // A direction holds a buffer only while bytes flow: it takes one from
    // the worker's pool when the socket turns readable and hands it back as
    // soon as the socket is drained, so idle connections hold none
    // (HAProxy's model) and a busy one never holds more than one per
    // direction.
    let clamp_to = p.blocked_window;
    let mut policy = ClampPolicy::new(!p.inbound && p.small_rcvbuf);
    let mut buf: Option<Vec<u8>> = None;
    loop {
        let b = match buf.as_mut() {
            Some(b) => b,
            None => {
                // poll_read_ready keeps one waker per direction, where
                // readable() queues a waiter under the socket's lock.
                let r = std::future::poll_fn(|cx| from.as_ref().poll_read_ready(cx)).await;
                if r.is_err() {
                    return End::Error;
                }
                buf.insert(pool::take(p.buf_size as usize))
            }
        };
        let mut n = match from.try_read(b) {
            Ok(0) => {
                pool::give(buf.take());
                // When the other direction has already ended, both sockets
                // are about to be closed, which sends the FIN anyway.
                if !p.peer_eof.load(Relaxed) {
                    let _ = to.shutdown().await;
                }
                p.my_eof.store(true, Relaxed);
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
        let mut drained = n < b.len();
        // How this direction ends once these bytes are written, when the
        // source's FIN is already known: then the last bytes go out with
        // `MSG_MORE` and the shutdown that follows carries them, so they
        // and the FIN leave in one segment (one ACK instead of two), as
        // HAProxy's do; otherwise the read of the EOF came after the write.
        let mut end = None;
        if drained && fin_seen(from.as_ref()) {
            // The FIN came in order after every byte, so this read returns
            // the EOF, or bytes the short read stopped before (urgent data)
            // and then the EOF on a later round.
            match from.try_read(&mut b[n..]) {
                Ok(0) => end = Some(End::Eof),
                Ok(k) => {
                    n += k;
                    drained = n < b.len();
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => end = Some(End::Error),
            }
        }
        if drained && end.is_none() {
            // A short read drained the socket (nginx assumes the same under
            // edge-triggered epoll): forget the readiness now, before any
            // await lets the driver record newer events, instead of paying
            // for a read that would only return EAGAIN. Bytes or a FIN that
            // arrive later raise a new event; a FIN already seen stays in
            // tokio's readiness, so the next wait returns at once.
            let _ = from.as_ref().try_io(Interest::READABLE, || {
                Err::<(), _>(io::ErrorKind::WouldBlock.into())
            });
        }
        let dir = if p.inbound { Dir::In } else { Dir::Out };
        p.shared.count(p.conn, dir, n, true);
        // Read again only after everything was written: at most one buffer
        // per direction lives in user space.
        let mut off = 0;
        let mut waited = false;
        while off < n {
            if let Some(late) = p.late.as_mut() {
                late.apply(to.as_ref(), n - off);
            }
            let sent = match end {
                Some(End::Eof) => to.as_ref().try_io(Interest::WRITABLE, || {
                    SockRef::from(to.as_ref())
                        .send_with_flags(&b[off..n], libc::MSG_MORE | libc::MSG_NOSIGNAL)
                }),
                _ => to.as_ref().try_write(&b[off..n]),
            };
            match sent {
                Ok(0) => {
                    pool::give(buf.take());
                    return End::Error;
                }
                Ok(k) => {
                    off += k;
                    if let Some(late) = p.late.as_mut() {
                        late.sent(k);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !waited {
                        waited = true;
                        if policy.on_wait() == ClampAction::Clamp
                            && clamp_to != 0
                            && let Some(old) = clamp_window(from.as_ref(), clamp_to)
                        {
                            policy.clamped(old);
                        }
                    }
                    let w = std::future::poll_fn(|cx| to.as_ref().poll_write_ready(cx)).await;
                    if w.is_err() {
                        pool::give(buf.take());
                        return End::Error;
                    }
                }
                Err(_) => {
                    pool::give(buf.take());
                    return End::Error;
                }
            }
        }
        if let Some(end) = end {
            pool::give(buf.take());
            if matches!(end, End::Eof) {
                // As on a read of the EOF above; when the other direction
                // has ended too, closing the socket sends the bytes held by
                // `MSG_MORE` with the FIN.
                if !p.peer_eof.load(Relaxed) {
                    let _ = to.shutdown().await;
                }
                p.my_eof.store(true, Relaxed);
            }
            return end;
        }
        if !waited {
            match policy.on_free_write() {
                ClampAction::Restore(old) => {
                    let _ = nix::sys::socket::setsockopt(from.as_ref(), WindowClamp, &old);
                }
                ClampAction::Open => {
                    let _ = SockRef::from(from.as_ref()).set_recv_buffer_size(OPEN_RCVBUF);
                }
                ClampAction::None | ClampAction::Clamp => {}
            }
        }
        if drained {
            pool::give(buf.take());
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
    conn: &Conn,
    owner: &Owner,
    mut client: TcpStream,
    mut backend: TcpStream,
    small_rcvbuf: bool,
) -> &'static str {
    // PROXY protocol header before any client byte. It is the backend
    // socket's first write and at most a few hundred bytes, so it goes out
    // whole at once with or without [`LateOpts`]' options.
    let mut header_len = 0;
    let pp = conn.backend.spec.read().proxy_protocol;
    if let Some(v) = pp {
        // The address the client dialled: the service's own, unless it
        // listens on a wildcard (then only the socket knows which of the
        // host's addresses).
        let local = match conn.service.listen {
            any if any.ip().is_unspecified() => client.local_addr().unwrap_or(any),
            listen => listen,
        };
        let hdr = crate::proxy_protocol::header(
            v,
            crate::proxy_protocol::Transport::Stream,
            conn.client,
            local,
        );
        if backend.write_all(&hdr).await.is_err() {
            reset(&client);
            return "backend_error";
        }
        header_len = hdr.len();
    }
    let TcpTuning {
        buffer_size: buf,
        blocked_window,
        notsent_lowat,
        ..
    } = shared.tuning.get();
    let mut late = LateOpts::new(notsent_lowat);
    late.sent(header_len);
    let reason = {
        let (mut cr, mut cw) = client.split();
        let (mut br, mut bw) = backend.split();
        let (c_eof, b_eof) = (AtomicBool::new(false), AtomicBool::new(false));
        let pipe = |inbound, late, my_eof, peer_eof| Pipe {
            shared,
            conn,
            buf_size: buf,
            blocked_window,
            small_rcvbuf,
            inbound,
            late,
            my_eof,
            peer_eof,
        };
        let (mut c2b_pipe, mut b2c_pipe) = (
            pipe(true, Some(late), &c_eof, &b_eof),
            pipe(false, None, &b_eof, &c_eof),
        );
        let c2b = pump(&mut cr, &mut bw, &mut c2b_pipe);
        let b2c = pump(&mut br, &mut cw, &mut b2c_pipe);
        // Made once: made in the loop, it took the owner slot's waiter
        // lock twice per round (register, and unregister when a pump won).
        let closed = owner.closed();
        tokio::pin!(c2b, b2c, closed);
        let (mut c2b_done, mut b2c_done) = (false, false);
        // No timer here: the entry's idle timeout (per state) is the
        // table's wheel's to enforce; it tells `owner`.
        loop {
            tokio::select! {
                // In order: a pump completes once, so no branch can
                // starve the others; a random start only costs a draw.
                biased;
                r = &mut c2b, if !c2b_done => {
                    c2b_done = true;
                    match r {
                        End::Error => break "client_reset",
                        End::Eof if b2c_done => break "closed",
                        End::Eof => conn.set_state(shared, ConnState::FinWait),
                    }
                }
                r = &mut b2c, if !b2c_done => {
                    b2c_done = true;
                    match r {
                        End::Error => break "backend_reset",
                        End::Eof if c2b_done => break "closed",
                        End::Eof => conn.set_state(shared, ConnState::FinWait),
                    }
                }
                why = &mut closed => break why.name(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of the future `f` returns, without calling it.
    fn future_size<A, B, C, D, E, G, F: std::future::Future>(
        _: impl FnOnce(A, B, C, D, E, G) -> F,
    ) -> usize {
        std::mem::size_of::<F>()
    }

    /// An idle connection's memory is mostly its task: tokio's task cell,
    /// this future plus a header of about 100 B, in 128-byte steps. Awaited
    /// inside a wrapping `async` block the future was stored twice (a
    /// 3,840-B cell), and with the connect phase's state beside `proxy`'s
    /// it was 1,968 B; idle in `proxy` it holds only what proxying needs.
    #[test]
    fn a_connection_task_holds_only_what_proxying_needs() {
        let size = future_size(handle);
        assert!(size <= 1_536, "connection task future {size} B");
    }

    #[test]
    fn fd_backoff_doubles_and_is_bounded() {
        let mut b = FdBackoff::default();
        let pauses: Vec<u64> = std::iter::from_fn(|| b.next())
            .map(|d| d.as_millis() as u64)
            .collect();
        assert_eq!(pauses, [10, 20, 40, 80, 160, 320, 640]);
        assert_eq!(b.next(), None);
        assert!(is_fd_exhaustion(&io::Error::from_raw_os_error(
            libc::EMFILE
        )));
        assert!(is_fd_exhaustion(&io::Error::from_raw_os_error(
            libc::ENFILE
        )));
        assert!(!is_fd_exhaustion(&io::Error::from_raw_os_error(
            libc::ECONNREFUSED
        )));
    }

    #[test]
    fn clamp_policy_clamps_on_waits_and_lifts_after_a_run_of_free_writes() {
        let mut p = ClampPolicy::new(false);
        for _ in 0..10 {
            assert_eq!(p.on_free_write(), ClampAction::None);
        }
        assert_eq!(p.on_wait(), ClampAction::Clamp);
        p.clamped(777);
        // Clamped: more waits do nothing; free writes short of the run
        // do not lift it, and a wait restarts the count.
        assert_eq!(p.on_wait(), ClampAction::None);
        for _ in 0..UNCLAMP_AFTER - 1 {
            assert_eq!(p.on_free_write(), ClampAction::None);
        }
        assert_eq!(p.on_wait(), ClampAction::None);
        for _ in 0..UNCLAMP_AFTER - 1 {
            assert_eq!(p.on_free_write(), ClampAction::None);
        }
        assert_eq!(p.on_free_write(), ClampAction::Restore(777));
        assert_eq!(p.on_free_write(), ClampAction::None);
        // And it clamps again; a clamp that failed (never `clamped`) is
        // tried again at the next wait.
        assert_eq!(p.on_wait(), ClampAction::Clamp);
        assert_eq!(p.on_wait(), ClampAction::Clamp);
    }

    #[test]
    fn a_small_starting_buffer_opens_after_a_run_of_free_writes_only() {
        let mut p = ClampPolicy::new(true);
        // While small, the buffer itself bounds the queue: no clamp.
        assert_eq!(p.on_wait(), ClampAction::None);
        for _ in 0..UNCLAMP_AFTER - 1 {
            assert_eq!(p.on_free_write(), ClampAction::None);
        }
        assert_eq!(p.on_wait(), ClampAction::None);
        for _ in 0..UNCLAMP_AFTER - 1 {
            assert_eq!(p.on_free_write(), ClampAction::None);
        }
        assert_eq!(p.on_free_write(), ClampAction::Open);
        // Open: the next wait clamps the window instead.
        assert_eq!(p.on_free_write(), ClampAction::None);
        assert_eq!(p.on_wait(), ClampAction::Clamp);
    }

    #[test]
    fn late_options_come_before_the_first_write_they_can_change() {
        let set = |nodelay, lowat| SetOpts { nodelay, lowat };
        let mut o = LateOpts::new(100);
        // A first write within the limit: nothing to set.
        assert_eq!(o.before_write(60), set(false, None));
        o.sent(60);
        // Any later one: TCP_NODELAY first; 100 bytes in all is within it.
        assert_eq!(o.before_write(40), set(true, None));
        o.sent(40);
        // Past the limit: set once, before that write.
        assert_eq!(o.before_write(1), set(false, Some(100)));
        o.sent(1);
        assert_eq!(o.before_write(1 << 20), set(false, None));

        // A first write larger than the limit: the limit first.
        let mut o = LateOpts::new(100);
        assert_eq!(o.before_write(101), set(false, Some(100)));
        // A write that would block sent nothing: the next is still a first.
        o.sent(0);
        assert_eq!(o.before_write(101), set(false, None));
        o.sent(101);
        assert_eq!(o.before_write(1), set(true, None));

        // `notsent_lowat = 0`: the kernel's default, never set.
        let mut o = LateOpts::new(0);
        assert_eq!(o.before_write(usize::MAX), set(false, None));
        o.sent(usize::MAX);
        assert_eq!(o.before_write(usize::MAX), set(true, None));
    }

    /// What [`LateOpts::apply`] sets lands on the socket.
    #[tokio::test]
    async fn late_options_are_set_on_the_socket() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (_a, _) = l.accept().await.unwrap();
        let opts = |s: &TcpStream| {
            let r = SockRef::from(s);
            (r.tcp_nodelay().unwrap(), r.tcp_notsent_lowat().unwrap())
        };
        assert_eq!(opts(&c), (false, 0));
        let mut o = LateOpts::new(16384);
        o.apply(&c, 2);
        assert_eq!(opts(&c), (false, 0));
        o.sent(2);
        o.apply(&c, 2);
        assert_eq!(opts(&c), (true, 0));
        o.sent(2);
        o.apply(&c, 16384);
        assert_eq!(opts(&c), (true, 16384));
    }

    #[tokio::test]
    async fn window_clamp_is_at_least_four_segments_and_restorable() {
        use nix::sys::socket::{getsockopt, setsockopt, sockopt::TcpMaxSeg};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        // Ethernet-sized segments: loopback's 64 KiB ones put four segments
        // above a fresh connection's window clamp.
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        setsockopt(&s, TcpMaxSeg, &1448).unwrap();
        let c = s.connect(l.local_addr().unwrap()).await.unwrap();
        let (_a, _) = l.accept().await.unwrap();
        let before = getsockopt(&c, WindowClamp).unwrap();
        let mss = getsockopt(&c, TcpMaxSeg).unwrap();
        let old = clamp_window(&c, 4096).expect("clamped");
        assert_eq!(old, before);
        let now = getsockopt(&c, WindowClamp).unwrap();
        assert_eq!(now, 4096.max(4 * mss));
        // A clamp at or above the current one is not applied.
        assert_eq!(clamp_window(&c, now), None);
        setsockopt(&c, WindowClamp, &old).unwrap();
        assert_eq!(getsockopt(&c, WindowClamp).unwrap(), before);
    }

    /// A listener on 127.0.0.1 as the daemon opens its own, registered
    /// with a runtime of its own that runs only when the test drives it
    /// (as a worker busy elsewhere): connections to its address wait in
    /// its accept queue until then. Returns the runtime, the listener and
    /// its address.
    fn idle_listener() -> (tokio::runtime::Runtime, TcpListener, SocketAddr) {
        let (socks, addr) =
            super::super::open_sockets(Protocol::Tcp, "127.0.0.1:0".parse().unwrap(), 1, 0)
                .unwrap();
        let super::super::ListenSocket::Tcp(l) = socks.into_iter().next().unwrap() else {
            panic!("not a TCP socket")
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let listener = {
            let _in = rt.enter();
            TcpListener::from_std(l).unwrap()
        };
        (rt, listener, addr)
    }

    /// A drain (SIGTERM) serves the connections the kernel had already
    /// completed on a listener, waiting in its accept queue: each gets its
    /// echo and a clean end. The listener's loop used to return as the
    /// drain began, and closing the listener reset every one of them (and
    /// the drain, seeing no connection, stopped at once).
    ///
    /// The queue is filled while no worker runs the listener's loop (as
    /// when its worker is busy elsewhere as SIGTERM comes): a listener of
    /// the service's made here, its loop spawned on a runtime of the test's
    /// that runs only once the clients are queued and the drain has begun.
    #[test]
    fn a_drain_serves_the_connections_queued_for_accept() {
        use std::io::{Read, Write};
        let baddr = crate::daemon::tests::echo_backend();
        let text = format!(
            "[daemon]\nworkers = 1\n[[service]]\nname = \"web\"\nprotocol = \"tcp\"\n\
             listen = \"127.0.0.1:0\"\nscheduler = \"rr\"\n[[service.backend]]\n\
             address = \"{baddr}\"\n"
        );
        let cfg = crate::config::parse(&text, "test.toml").unwrap();
        let d = crate::daemon::Daemon::start(cfg, None).unwrap();
        let shared = d.shared.clone();
        let svc = shared
            .model
            .load()
            .services
            .values()
            .next()
            .unwrap()
            .clone();
        let (rt, listener, addr) = idle_listener();
        let looping = rt.spawn(accept_loop(shared.clone(), svc, listener));
        // Connected: the kernel completed each handshake; none is accepted.
        const N: usize = 8;
        let clients: Vec<std::net::TcpStream> = (0..N)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        let drain = std::thread::spawn(move || d.drain(Duration::from_secs(20)));
        let served: Vec<_> = clients
            .into_iter()
            .enumerate()
            .map(|(i, mut c)| {
                std::thread::spawn(move || -> Result<(), String> {
                    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                    let msg = format!("client {i}");
                    c.write_all(msg.as_bytes())
                        .map_err(|e| format!("write: {e}"))?;
                    let mut got = vec![0u8; msg.len()];
                    c.read_exact(&mut got).map_err(|e| format!("echo: {e}"))?;
                    if got != msg.as_bytes() {
                        return Err(format!("echoed {got:?}"));
                    }
                    c.shutdown(std::net::Shutdown::Write).unwrap();
                    let mut rest = Vec::new();
                    c.read_to_end(&mut rest).map_err(|e| format!("end: {e}"))?;
                    Ok(())
                })
            })
            .collect();
        // The drain has begun (the listeners are told to stop accepting)
        // before the listener's loop first runs.
        let t0 = std::time::Instant::now();
        while !shared.admission.stop_accept.is_cancelled() {
            assert!(t0.elapsed() < Duration::from_secs(10), "no drain");
            std::thread::yield_now();
        }
        // The listener's worker: runs its loop and the connections' tasks
        // until the drain is over.
        let forced = rt.block_on(async {
            tokio::task::spawn_blocking(move || drain.join().unwrap())
                .await
                .unwrap()
        });
        let closed = looping.is_finished();
        // Whatever is left on it (a listener still open) goes now.
        drop(rt);
        let results: Vec<Result<(), String>> =
            served.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(
            results.iter().all(Result::is_ok),
            "queued clients not served: {results:?}"
        );
        assert_eq!(forced, 0, "the drain closed connections");
        assert!(closed, "the listener was still open after the drain");
        assert_eq!(shared.admission.active.load(Relaxed), 0);
    }

    /// A one-worker daemon with service `web`, whose listener's loop is
    /// spawned on a runtime of the test's that does not run yet (see
    /// [`idle_listener`]), with `n` clients queued on it: connected (the
    /// kernel completed each handshake), a request sent, none accepted.
    struct Queued {
        d: crate::daemon::DaemonHandle,
        shared: Arc<Shared>,
        svc: Arc<Service>,
        rt: tokio::runtime::Runtime,
        looping: tokio::task::JoinHandle<()>,
        clients: Vec<std::net::TcpStream>,
    }

    fn queued_on_web(n: usize) -> Queued {
        use std::io::Write;
        let mut cfg = crate::config::Config::default();
        cfg.daemon.workers = 1;
        let d = crate::daemon::Daemon::start(cfg, None).unwrap();
        let shared = d.shared.clone();
        let spec = crate::daemon::model::tests::test_spec(
            "default",
            "web",
            Protocol::Tcp,
            "127.0.0.1:0".parse().unwrap(),
        );
        shared.add_service(spec).unwrap();
        let svc = shared.model.load().services[&("default".into(), "web".into())].clone();
        let (rt, listener, addr) = idle_listener();
        let looping = rt.spawn(accept_loop(shared.clone(), svc.clone(), listener));
        let clients = (0..n)
            .map(|i| {
                let mut c = std::net::TcpStream::connect(addr).unwrap();
                c.write_all(format!("client {i}").as_bytes()).unwrap();
                c
            })
            .collect();
        Queued {
            d,
            shared,
            svc,
            rt,
            looping,
            clients,
        }
    }

    /// Clients the kernel had completed on a listener of `web` (its accept
    /// queue) when `stop` takes the service away get a clean end of stream
    /// (weir's FIN), not a reset. Each sent a request first, so that a close
    /// with it unread would reset too. As in
    /// [`a_drain_serves_the_connections_queued_for_accept`], the queue is
    /// filled while no worker runs the listener's loop: its runtime runs
    /// only once the clients are queued and the service is gone.
    fn queued_clients_end_cleanly_when(stop: impl FnOnce(&Arc<Shared>, &Arc<Service>)) {
        use std::io::Read;
        let Queued {
            d,
            shared,
            svc,
            rt,
            looping,
            clients,
        } = queued_on_web(8);
        stop(&shared, &svc);
        assert!(svc.cancel.is_cancelled());
        let ends: Vec<_> = clients
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || -> Result<usize, String> {
                    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                    let mut rest = Vec::new();
                    c.read_to_end(&mut rest).map_err(|e| format!("end: {e}"))
                })
            })
            .collect();
        // The listener's worker: runs its loop, and whatever it spawned,
        // until every client has read its end.
        let results = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), looping)
                .await
                .expect("the listener's loop did not end")
                .unwrap();
            tokio::task::spawn_blocking(move || {
                ends.into_iter()
                    .map(|t| t.join().unwrap())
                    .collect::<Vec<_>>()
            })
            .await
            .unwrap()
        });
        drop(rt);
        assert!(
            results.iter().all(|r| *r == Ok(0)),
            "queued clients not ended cleanly: {results:?}"
        );
        d.shutdown();
    }

    /// A deleted service's queued clients are closed, not reset: the
    /// listener's loop used to return on the deletion, and closing the
    /// listener reset every one of them.
    #[test]
    fn a_deleted_service_ends_its_queued_connections_cleanly() {
        queued_clients_end_cleanly_when(|shared, _| {
            let told = shared.remove_services(&[("default".into(), "web".into())]);
            assert_eq!(told, vec![Some(0)]);
        });
    }

    /// Likewise for a service moved to another address (replaced: its
    /// connections close, as a reload that moves it does).
    #[test]
    fn a_moved_service_ends_its_queued_connections_cleanly() {
        queued_clients_end_cleanly_when(|shared, svc| {
            let mut spec = svc.spec.read().clone();
            spec.listen = "127.0.0.1:0".parse().unwrap();
            shared.put_service(spec, true).unwrap();
        });
    }

    /// How many queued clients [`lingering_closes`] makes.
    const LINGERING: usize = 8;

    /// A daemon whose service `web` was deleted with [`LINGERING`] clients
    /// queued on its listener, each having sent a request and read weir's
    /// FIN but not sent its own: their closes linger ([`CLOSE_LINGER`]) on
    /// a runtime of the test's, run by `rt_thread` until `stop_rt` is
    /// dropped.
    struct Lingering {
        d: crate::daemon::DaemonHandle,
        shared: Arc<Shared>,
        clients: Vec<std::net::TcpStream>,
        rt_thread: std::thread::JoinHandle<()>,
        stop_rt: tokio::sync::oneshot::Sender<()>,
    }

    fn lingering_closes() -> Lingering {
        use std::io::Read;
        let Queued {
            d,
            shared,
            rt,
            looping,
            mut clients,
            ..
        } = queued_on_web(LINGERING);
        let told = shared.remove_services(&[("default".into(), "web".into())]);
        assert_eq!(told, vec![Some(0)]);
        let (stop_rt, stopped) = tokio::sync::oneshot::channel::<()>();
        let rt_thread = std::thread::spawn(move || {
            rt.block_on(async {
                looping.await.unwrap();
                let _ = stopped.await;
            });
        });
        // Each reads weir's FIN: its close lingers, waiting for the client's.
        for (i, c) in clients.iter_mut().enumerate() {
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut rest = Vec::new();
            c.read_to_end(&mut rest)
                .unwrap_or_else(|e| panic!("client {i}: no FIN from weir: {e}"));
        }
        Lingering {
            d,
            shared,
            clients,
            rt_thread,
            stop_rt,
        }
    }

    /// A drain that ends before a deleted service's lingering closes did
    /// counts them among the connections it closed forcibly. Before, they
    /// were counted nowhere: a drain with none left to wait for reported 0.
    #[test]
    fn a_drain_counts_the_lingering_closes_of_a_deleted_service() {
        let l = lingering_closes();
        let forced = l.d.drain(Duration::ZERO);
        drop(l.stop_rt);
        l.rt_thread.join().unwrap();
        drop(l.clients);
        assert_eq!(
            forced, LINGERING as u64,
            "the drain's count of forcibly closed connections"
        );
    }

    /// A drain waits for a deleted service's lingering closes: clients
    /// that send the rest of their request and their FIN once the drain has
    /// begun read a clean end. Before, the drain saw no connection, stopped
    /// at once, and the stop ended the lingering closes: what the clients
    /// sent then was answered with a reset.
    #[test]
    fn a_drain_waits_for_the_lingering_closes_of_a_deleted_service() {
        use std::io::Write;
        let l = lingering_closes();
        let shared = l.shared.clone();
        let d = l.d;
        let drain = std::thread::spawn(move || d.drain(Duration::from_secs(20)));
        let t0 = std::time::Instant::now();
        while !shared.admission.stop_accept.is_cancelled() {
            assert!(t0.elapsed() < Duration::from_secs(10), "no drain");
            std::thread::yield_now();
        }
        let sent: Vec<Result<(), String>> = l
            .clients
            .iter()
            .map(|mut c| {
                c.write_all(b" and the rest")
                    .map_err(|e| format!("write: {e}"))?;
                c.shutdown(std::net::Shutdown::Write)
                    .map_err(|e| format!("shutdown: {e}"))
            })
            .collect();
        let forced = drain.join().unwrap();
        drop(l.stop_rt);
        l.rt_thread.join().unwrap();
        // A reset is the socket's pending error (a read after weir's FIN
        // says only end of stream).
        let results: Vec<Result<(), String>> = sent
            .into_iter()
            .zip(&l.clients)
            .map(|(r, c)| match c.take_error() {
                Ok(None) => r,
                Ok(Some(e)) | Err(e) => Err(format!("after the end: {e}")),
            })
            .collect();
        assert!(
            results.iter().all(Result::is_ok),
            "lingering closes not ended cleanly under a drain: {results:?}"
        );
        assert_eq!(forced, 0, "the drain closed connections");
    }

    /// weir sets `TCP_NODELAY` and `TCP_NOTSENT_LOWAT` only on the listener
    /// and relies on accepted sockets inheriting them.
    #[test]
    fn accepted_sockets_inherit_listener_options() {
        let (socks, addr) =
            super::super::open_sockets(Protocol::Tcp, "127.0.0.1:0".parse().unwrap(), 1, 12345)
                .unwrap();
        let super::super::ListenSocket::Tcp(l) = socks.into_iter().next().unwrap() else {
            panic!("not a TCP socket")
        };
        l.set_nonblocking(false).unwrap();
        let _c = std::net::TcpStream::connect(addr).unwrap();
        let (a, _) = l.accept().unwrap();
        let a = SockRef::from(&a);
        assert!(a.tcp_nodelay().unwrap());
        assert_eq!(a.tcp_notsent_lowat().unwrap(), 12345);
    }
}

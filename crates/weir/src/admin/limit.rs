//! Admission of admin connections: who gets a place, and for how long.
//!
//! The admin API shares the process's file-descriptor budget with the data
//! path, so at most [`MAX_ADMIN_CONNECTIONS`] are open at once, and at most
//! [`MAX_PER_SOURCE`] from one source: an IPv4 address (an IPv4-mapped
//! IPv6 one counts as its IPv4 address), or an IPv6 /64, the least a host
//! is given (one that owns a /64 could otherwise take every place with
//! addresses of it, each a source of its own). Unauthenticated clients
//! must not be able to hold those places against the operator (issue 10,
//! defect 1):
//! * every request head must arrive whole within [`HEAD_TIMEOUT`] (hyper's
//!   header read timeout), however slowly its bytes trickle in;
//! * when the places are taken, a new connection evicts the oldest one that
//!   has not yet presented a valid token (of its own source first when the
//!   per-source cap is the one reached); connections whose request passed
//!   authentication with the full-access token are never evicted, and
//!   those of a tenant or the read-only token only when no unauthenticated
//!   one is left (a tenant's idle keep-alives must not shut the operator
//!   out), a tenant's before a read-only one's. The read-only token is
//!   fenced as a tenant of its own is (its share, and its part of the
//!   three quarters below): it is handed to dashboards and watchers, and
//!   its holder must not be able to hold every place against the
//!   full-access operator. A new connection is refused only when every
//!   place is the operator's. An operator's connection
//!   sends its head at once, so a flood would have to open more than
//!   [`MAX_ADMIN_CONNECTIONS`] connections in that moment to shut it out;
//! * a tenant's authenticated connections beyond its share
//!   ([`MAX_PER_SOURCE`] places, from any number of addresses) are evicted
//!   before anyone else's, the oldest of the tenant holding the most
//!   first: else a tenant that holds every place, and authenticates each
//!   new connection at once, would make every newcomer (the operator's
//!   too, before its request is read) the oldest unauthenticated
//!   connection, and evict it with its next one;
//! * tenants (the read-only token's holders counting as one) together keep
//!   at most three quarters of the places a cap counts ([`tenants_max`]:
//!   96 of the 128, 12 of a source's 16) against a newcomer: past that,
//!   the tenant holding the most loses its oldest first, before any
//!   unauthenticated connection. Else tenants each
//!   within its share (8 of them hold all 128 places; one holds the
//!   operator's address's 16 when both are on this host) would evict the
//!   operator's newcomer, the only connection not yet authenticated, with
//!   their next one. The quarter left is the operator's (and the other
//!   tenants' newcomers'): to evict one, a flood would have to open that
//!   many connections between its accept and its request;
//! * with TLS (`[admin] tls_cert`), the handshake runs after admission, on
//!   the connection's place: it must finish within [`HEAD_TIMEOUT`], and the
//!   connection stays evictable meanwhile, so stalled handshakes cannot hold
//!   places any more than stalled request heads. A client that speaks plain
//!   HTTP to the TLS port gets a plain-HTTP 400 saying to use `https://`;
//! * a connection on which nothing is read or written for [`IDLE_TIMEOUT`]
//!   is closed (a stalled body or reader);
//! * the operator gets in when the data path has taken every descriptor
//!   (issue 10, defect 23): [`Reserved`] holds [`SPARE_FDS`] descriptors
//!   (`/dev/null`) from start; an accept that fails with `EMFILE`/`ENFILE`
//!   closes one and accepts again at once, and spares are reopened whenever
//!   descriptors are free again. The data path's accept loops back off on
//!   the same error (10 ms doubling), so the freed descriptor goes to the
//!   admin connection that asked for it.

use std::collections::BTreeMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{
    AtomicU8,
    Ordering::{Acquire, Relaxed, Release},
};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::serve::Listener;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::{Instant, Sleep};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// Most admin connections open at once.
pub(crate) const MAX_ADMIN_CONNECTIONS: usize = 128;
/// Most admin connections open at once from one source ([`Source`]: an
/// IPv4 address or an IPv6 /64).
pub(crate) const MAX_PER_SOURCE: usize = 16;

/// Of `cap` places, how many tenant-authenticated connections keep theirs
/// against a newcomer: three quarters; the rest is held back for the
/// operator (see the module doc).
const fn tenants_max(cap: usize) -> usize {
    cap - cap / 4
}
/// A request head must arrive whole within this.
pub(crate) const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// An admin connection idle this long is closed.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Descriptors held back for admin connections at descriptor exhaustion.
pub(crate) const SPARE_FDS: usize = 4;

/// A listener that can fail: the plain accept of tokio's listeners.
pub(crate) trait TryAccept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    type Addr: Source + Send;
    fn try_accept(
        &mut self,
    ) -> impl std::future::Future<Output = io::Result<(Self::Io, Self::Addr)>> + Send;
    fn addr(&self) -> io::Result<Self::Addr>;
}

impl TryAccept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    type Addr = SocketAddr;
    async fn try_accept(&mut self) -> io::Result<(Self::Io, Self::Addr)> {
        tokio::net::TcpListener::accept(self).await
    }
    fn addr(&self) -> io::Result<Self::Addr> {
        tokio::net::TcpListener::local_addr(self)
    }
}

impl TryAccept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    type Addr = tokio::net::unix::SocketAddr;
    async fn try_accept(&mut self) -> io::Result<(Self::Io, Self::Addr)> {
        tokio::net::UnixListener::accept(self).await
    }
    fn addr(&self) -> io::Result<Self::Addr> {
        tokio::net::UnixListener::local_addr(self)
    }
}

/// A stream whose first byte can be seen without taking it, to tell a TLS
/// ClientHello (record type 22) from plain HTTP.
pub(crate) trait Peek {
    /// The first byte, `None` at EOF.
    fn peek_byte(&self) -> impl std::future::Future<Output = io::Result<Option<u8>>> + Send;
}

impl Peek for tokio::net::TcpStream {
    async fn peek_byte(&self) -> io::Result<Option<u8>> {
        let mut b = [0u8; 1];
        let n = self.peek(&mut b).await?;
        Ok((n == 1).then_some(b[0]))
    }
}

impl Peek for tokio::net::UnixStream {
    // TLS is never served on a unix socket (config validation and `bind`
    // refuse it), so this is never asked.
    async fn peek_byte(&self) -> io::Result<Option<u8>> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "TLS is not served on unix sockets",
        ))
    }
}

/// First byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 22;

/// What a client that sent plain HTTP to the TLS port reads.
fn plain_to_tls_answer() -> Vec<u8> {
    let body = r#"{"error":"invalid","message":"this admin port speaks TLS: use https:// (and --cacert FILE if its certificate is self-signed)"}"#;
    format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A listener with [`SPARE_FDS`] descriptors in reserve (see the module doc).
#[derive(Debug)]
pub(crate) struct Reserved<L> {
    inner: L,
    spares: Vec<std::fs::File>,
}

impl<L> Reserved<L> {
    pub(crate) fn new(inner: L) -> Self {
        let mut r = Self {
            inner,
            spares: Vec::with_capacity(SPARE_FDS),
        };
        r.refill();
        r
    }

    /// Reopen spares up to [`SPARE_FDS`] while descriptors are free.
    fn refill(&mut self) {
        while self.spares.len() < SPARE_FDS {
            match std::fs::File::open("/dev/null") {
                Ok(f) => self.spares.push(f),
                Err(_) => break,
            }
        }
    }
}

fn is_fd_exhaustion(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

impl<L: TryAccept> Listener for Reserved<L> {
    type Io = L::Io;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.try_accept().await {
                Ok(c) => {
                    self.refill();
                    return c;
                }
                Err(e) if is_fd_exhaustion(&e) => {
                    if self.spares.pop().is_some() {
                        // One descriptor freed: accept again at once.
                        continue;
                    }
                    tracing::debug!("admin accept: {e}; no spare descriptor left");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    self.refill();
                }
                // A client that went away before accept (ECONNABORTED...),
                // or anything else: try again, without spinning.
                Err(e) => {
                    tracing::debug!("admin accept: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.addr()
    }
}

/// Where a connection comes from, for the per-source cap (`None`: a unix
/// socket peer, only under the global cap).
pub(crate) trait Source {
    fn source(&self) -> Option<IpAddr>;
}

impl Source for SocketAddr {
    fn source(&self) -> Option<IpAddr> {
        Some(source_of(self.ip()))
    }
}

/// The source `ip` counts under: an IPv4 address as itself (an
/// IPv4-mapped IPv6 one as its IPv4 address); an IPv6 address as its /64
/// (the rest zeroed), since a host holds a whole /64 and could otherwise
/// open each connection from an address of its own.
fn source_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => IpAddr::V6((v6.to_bits() & !u128::from(u64::MAX)).into()),
    }
}

impl Source for tokio::net::unix::SocketAddr {
    fn source(&self) -> Option<IpAddr> {
        None
    }
}

/// Serve `app` on `listener` until `shutdown`, with the admission rules of
/// this module, over TLS when `tls` is given. On shutdown, stops accepting
/// and lets each open connection finish its request (at most
/// [`HEAD_TIMEOUT`]).
pub(crate) async fn serve<L>(
    mut listener: L,
    app: Router,
    tls: Option<TlsAcceptor>,
    shutdown: CancellationToken,
) where
    L: Listener,
    L::Addr: Source,
    L::Io: Peek,
{
    let places = Places::new(MAX_ADMIN_CONNECTIONS, MAX_PER_SOURCE);
    loop {
        let (io, addr) = tokio::select! {
            c = listener.accept() => c,
            () = shutdown.cancelled() => return,
        };
        let Some(place) = places.admit(addr.source()) else {
            tracing::debug!(
                "admin connection refused: every place is held by authenticated clients"
            );
            continue;
        };
        let authed = Authed(place.mark.clone());
        let svc = app
            .clone()
            .map_request(move |mut req: axum::http::Request<Incoming>| {
                req.extensions_mut().insert(authed.clone());
                req.map(Body::new)
            });
        let shutdown = shutdown.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let Some(tls) = tls else {
                let io = Idle::new(io, IDLE_TIMEOUT);
                return serve_connection(io, svc, place, shutdown).await;
            };
            // The handshake holds the place under the head deadline and
            // stays evictable: see the module doc.
            let handshake = async {
                match io.peek_byte().await {
                    Ok(Some(TLS_HANDSHAKE)) => {}
                    Ok(Some(_)) => {
                        let mut io = io;
                        let _ = io.write_all(&plain_to_tls_answer()).await;
                        let _ = io.shutdown().await;
                        // Read what the client sent (bounded) before closing:
                        // closing with unread bytes resets the connection,
                        // which can discard the answer before it is read.
                        let mut sink = [0u8; 4096];
                        let mut left = 64 * 1024usize;
                        while left > 0 {
                            match io.read(&mut sink).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => left = left.saturating_sub(n),
                            }
                        }
                        return Err("plain HTTP on the TLS port".to_owned());
                    }
                    Ok(None) => return Err("closed before a TLS handshake".to_owned()),
                    Err(e) => return Err(e.to_string()),
                }
                tls.accept(Idle::new(io, IDLE_TIMEOUT))
                    .await
                    .map_err(|e| format!("TLS handshake: {e}"))
            };
            let io = tokio::select! {
                r = tokio::time::timeout(HEAD_TIMEOUT, handshake) => match r {
                    Ok(Ok(io)) => io,
                    Ok(Err(e)) => {
                        tracing::debug!("admin connection closed: {e}");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!("admin connection closed: no TLS handshake within {HEAD_TIMEOUT:?}");
                        return;
                    }
                },
                () = place.evicted.cancelled() => return,
                () = shutdown.cancelled() => return,
            };
            serve_connection(io, svc, place, shutdown).await;
        });
    }
}

/// Serve HTTP/1.1 on one admitted connection until it ends, its place is
/// evicted, or shutdown (then finish the request in flight, at most
/// [`HEAD_TIMEOUT`]).
async fn serve_connection<I, S>(io: I, svc: S, place: Place, shutdown: CancellationToken)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: tower::Service<
            axum::http::Request<Incoming>,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let io = TokioIo::new(io);
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(TokioTimer::new()).header_read_timeout(HEAD_TIMEOUT);
    let conn = b.serve_connection(io, TowerToHyperService::new(svc));
    let mut conn = std::pin::pin!(conn);
    let graceful = tokio::select! {
        _ = conn.as_mut() => false,
        () = place.evicted.cancelled() => false,
        () = shutdown.cancelled() => true,
    };
    if graceful {
        conn.as_mut().graceful_shutdown();
        let _ = tokio::time::timeout(HEAD_TIMEOUT, conn.as_mut()).await;
    }
    drop(place);
}

/// A connection that has not presented a valid token.
const UNAUTHENTICATED: u8 = 0;
/// A connection whose request presented a tenant token.
const TENANT: u8 = 1;
/// A connection whose request presented the read-only token.
const READONLY: u8 = 2;
/// A connection whose request presented the full-access token.
const OPERATOR: u8 = 3;

/// Marks a connection's request as authenticated (a request extension the
/// auth middleware sets). An operator's connection (full-access token) is
/// never evicted; a tenant's or a read-only one's only when no
/// unauthenticated connection is left to evict, so tenants (who may not be
/// trusted with the operator's access) and read-only holders cannot hold
/// every place against the operator with idle keep-alive connections,
/// except past their share (see [`evict_oldest`]).
#[derive(Debug, Clone)]
pub(crate) struct Authed(Arc<Mark>);

impl Authed {
    /// The request presented tenant `tenant`'s token.
    pub(crate) fn mark_tenant(&self, tenant: &str) {
        self.0.set_tenant(tenant);
    }

    /// The request presented the read-only token.
    pub(crate) fn mark_readonly(&self) {
        self.0.level.fetch_max(READONLY, Release);
    }

    /// The request presented the full-access token.
    pub(crate) fn mark_operator(&self) {
        self.0.level.fetch_max(OPERATOR, Release);
    }
}

/// Who a connection's requests showed themselves to be: the highest level
/// yet, and the tenant of the first tenant token.
#[derive(Debug, Default)]
struct Mark {
    level: AtomicU8,
    tenant: OnceLock<Box<str>>,
}

impl Mark {
    fn set_tenant(&self, tenant: &str) {
        // The tenant before the level: whoever sees the level sees it.
        let _ = self.tenant.set(tenant.into());
        self.level.fetch_max(TENANT, Release);
    }

    fn level(&self) -> u8 {
        self.level.load(Acquire)
    }

    /// The fence a connection's places count against: its tenant's at
    /// level [`TENANT`], the read-only token's at [`READONLY`]; none for
    /// the unauthenticated and the operator.
    fn fence(&self) -> Option<Fence<'_>> {
        match self.level() {
            TENANT => self.tenant.get().map(|t| Fence::Tenant(t)),
            READONLY => Some(Fence::ReadOnly),
            _ => None,
        }
    }
}

/// Who a share of places is counted for: a tenant, or the read-only
/// token's holders together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fence<'a> {
    Tenant(&'a str),
    ReadOnly,
}

/// The open admin connections, oldest first.
#[derive(Debug)]
struct Places {
    inner: parking_lot::Mutex<BTreeMap<u64, Entry>>,
    next: std::sync::atomic::AtomicU64,
    max: usize,
    per_source: usize,
}

#[derive(Debug)]
struct Entry {
    source: Option<IpAddr>,
    mark: Arc<Mark>,
    evict: CancellationToken,
}

/// One admitted connection; gives its place back when dropped.
#[derive(Debug)]
struct Place {
    places: Arc<Places>,
    id: u64,
    mark: Arc<Mark>,
    evicted: CancellationToken,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.places.inner.lock().remove(&self.id);
    }
}

impl Places {
    fn new(max: usize, per_source: usize) -> Arc<Self> {
        Arc::new(Self {
            inner: parking_lot::Mutex::new(BTreeMap::new()),
            next: std::sync::atomic::AtomicU64::new(0),
            max,
            per_source,
        })
    }

    /// A place for a connection from `source`, evicting another (see
    /// [`evict_oldest`]) if the caps are reached; `None` if every place
    /// that counts is held by authenticated connections. Work is bounded by
    /// the cap (a few scans of at most `max` entries).
    fn admit(self: &Arc<Self>, source: Option<IpAddr>) -> Option<Place> {
        let mut m = self.inner.lock();
        // A tenant's share: as many places as one address may hold.
        let share = self.per_source;
        if let Some(ip) = source {
            let same = m.values().filter(|e| e.source == Some(ip)).count();
            if same >= self.per_source
                && !evict_oldest(&mut m, share, tenants_max(self.per_source), |e| {
                    e.source == Some(ip)
                })
            {
                return None;
            }
        }
        if m.len() >= self.max && !evict_oldest(&mut m, share, tenants_max(self.max), |_| true) {
            return None;
        }
        let id = self.next.fetch_add(1, Relaxed);
        let mark = Arc::new(Mark::default());
        let evicted = CancellationToken::new();
        m.insert(
            id,
            Entry {
                source,
                mark: mark.clone(),
                evict: evicted.clone(),
            },
        );
        Some(Place {
            places: self.clone(),
            id,
            mark,
            evicted,
        })
    }
}

/// Evicts, among the connections `pick` picks: the oldest of the tenant
/// (or of the read-only token, fenced as a tenant) holding the most
/// places, if that is more than `share` or they together hold more than
/// `tenants_max`; else the oldest unauthenticated connection; else the
/// oldest tenant-authenticated one; else the oldest read-only one; never
/// a full-access operator's.
///
/// Why tenants past their part go first: unauthenticated connections go
/// before tenants' so that a flood without a token cannot evict tenants'
/// keep-alives, but a tenant has a token. Tenants that hold every place
/// (one alone, or several each within its share) and authenticate each
/// new connection at once make any newcomer (the operator's, another
/// tenant's) the only unauthenticated connection, hence the next one
/// evicted, before its request can be read.
fn evict_oldest(
    m: &mut BTreeMap<u64, Entry>,
    share: usize,
    tenants_max: usize,
    pick: impl Fn(&Entry) -> bool,
) -> bool {
    let mut held: BTreeMap<Fence<'_>, usize> = BTreeMap::new();
    let mut tenants = 0;
    for e in m.values().filter(|e| pick(e)) {
        if let Some(f) = e.mark.fence() {
            *held.entry(f).or_default() += 1;
            tenants += 1;
        }
    }
    let greedy = held
        .into_iter()
        .filter(|&(_, n)| n > share || tenants > tenants_max)
        .max_by_key(|&(_, n)| n)
        .map(|(f, _)| f);
    let over = greedy.and_then(|f| {
        m.iter()
            .find(|(_, e)| pick(e) && e.mark.fence() == Some(f))
            .map(|(id, _)| *id)
    });
    let oldest = |level: u8| {
        m.iter()
            .find(|(_, e)| e.mark.level() == level && pick(e))
            .map(|(id, _)| *id)
    };
    let victim = over
        .or_else(|| oldest(UNAUTHENTICATED))
        .or_else(|| oldest(TENANT))
        .or_else(|| oldest(READONLY));
    match victim.and_then(|id| m.remove(&id)) {
        Some(e) => {
            e.evict.cancel();
            true
        }
        None => false,
    }
}

/// A connection closed once nothing moved on it for its idle time.
#[derive(Debug)]
struct Idle<T> {
    io: T,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl<T> Idle<T> {
    fn new(io: T, idle: Duration) -> Self {
        Self {
            io,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
        }
    }

    /// Progress was made: push the idle deadline out.
    fn touch(&mut self) {
        let at = Instant::now() + self.idle;
        self.deadline.as_mut().reset(at);
    }

    /// Called when the inner I/O is pending: error out once idle too long.
    fn check_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "admin connection idle too long",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Idle<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                self.touch();
                Poll::Ready(r)
            }
            Poll::Pending => self.check_idle(cx),
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Idle<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.io).poll_write(cx, buf) {
            Poll::Ready(r) => {
                self.touch();
                Poll::Ready(r)
            }
            Poll::Pending => match self.check_idle(cx) {
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                _ => Poll::Pending,
            },
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    // As `poll_write`: hyper writes vectored when the stream can (a TCP
    // stream can), and rustls always does, so this is the write path.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.io).poll_write_vectored(cx, bufs) {
            Poll::Ready(r) => {
                self.touch();
                Poll::Ready(r)
            }
            Poll::Pending => match self.check_idle(cx) {
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                _ => Poll::Pending,
            },
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_evict_the_oldest_unauthenticated_connection() {
        let p = Places::new(3, 2);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let a1 = p.admit(Some(a)).unwrap();
        Authed(a1.mark.clone()).mark_operator();
        let a2 = p.admit(Some(a)).unwrap();
        // Per-source cap: a's third evicts a2 (a1 is authenticated).
        let a3 = p.admit(Some(a)).unwrap();
        assert!(a2.evicted.is_cancelled() && !a1.evicted.is_cancelled());
        // Global cap: b's evicts the oldest unauthenticated, a3.
        let b1 = p.admit(Some(b)).unwrap();
        let _b2 = p.admit(Some(b)).unwrap();
        assert!(a3.evicted.is_cancelled());
        assert!(b1.evicted.is_cancelled() || p.inner.lock().len() <= 3);
        // All places authenticated: refused.
        for e in p.inner.lock().values() {
            e.mark.level.store(OPERATOR, Relaxed);
        }
        assert!(p.admit(None).is_none());
        drop(a1);
        assert!(p.admit(None).is_some());
    }

    #[test]
    fn tenant_connections_give_way_after_unauthenticated_ones() {
        let p = Places::new(3, 3);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let t1 = p.admit(Some(a)).unwrap();
        Authed(t1.mark.clone()).mark_tenant("t");
        let u1 = p.admit(Some(a)).unwrap();
        let o1 = p.admit(Some(a)).unwrap();
        Authed(o1.mark.clone()).mark_operator();
        // The unauthenticated one goes first, though younger.
        let n1 = p.admit(Some(a)).unwrap();
        assert!(u1.evicted.is_cancelled() && !t1.evicted.is_cancelled());
        Authed(n1.mark.clone()).mark_operator();
        // Then the tenant's; never an operator's.
        let _n2 = p.admit(Some(a)).unwrap();
        assert!(t1.evicted.is_cancelled() && !o1.evicted.is_cancelled());
    }

    /// Marks `p` as authenticated by tenant `t`'s token.
    fn as_tenant(p: &Place, t: &str) {
        Authed(p.mark.clone()).mark_tenant(t);
    }

    /// One tenant holding every place (from 8 addresses, 16 each, each
    /// connection authenticated at once) cannot keep evicting the
    /// operator's new connection before its request is read: past its
    /// share, the tenant's own connections go first. Before, each of the
    /// tenant's new connections evicted the oldest unauthenticated one,
    /// which was always the newcomer, so a tenant opening connections in
    /// a loop shut the operator and every other tenant out.
    #[test]
    fn a_tenant_holding_every_place_cannot_evict_a_newcomer() {
        let p = Places::new(MAX_ADMIN_CONNECTIONS, MAX_PER_SOURCE);
        let src = |i: usize| -> IpAddr {
            format!("192.0.2.{}", 1 + i / MAX_PER_SOURCE)
                .parse()
                .unwrap()
        };
        let mut held: Vec<Place> = (0..MAX_ADMIN_CONNECTIONS)
            .map(|i| {
                let c = p.admit(Some(src(i))).unwrap();
                as_tenant(&c, "a");
                c
            })
            .collect();
        let operator: IpAddr = "198.51.100.1".parse().unwrap();
        // The operator gets in: one of the tenant's places goes.
        let op = p.admit(Some(operator)).unwrap();
        assert!(!op.evicted.is_cancelled());
        assert_eq!(held.iter().filter(|c| c.evicted.is_cancelled()).count(), 1);
        held.retain(|c| !c.evicted.is_cancelled());
        // The tenant keeps opening connections, from each of its addresses
        // in turn, authenticating each at once: the operator's connection,
        // whose request is still on its way, stays.
        for i in 0..4 * MAX_ADMIN_CONNECTIONS {
            let c = p.admit(Some(src(i % MAX_ADMIN_CONNECTIONS))).unwrap();
            assert!(
                !op.evicted.is_cancelled(),
                "evicted by the tenant's connection {i}"
            );
            as_tenant(&c, "a");
            held.push(c);
            held.retain(|c| !c.evicted.is_cancelled());
        }
        assert!(p.inner.lock().len() <= MAX_ADMIN_CONNECTIONS);
    }

    /// Eight tenants, each within its share (16 places, each from its own
    /// address), hold every place: the operator's newcomer gets in and
    /// stays while they keep reconnecting and authenticating at once. So
    /// does a ninth tenant's. Before, with no tenant past its share, each
    /// tenant's reconnection evicted the oldest unauthenticated connection:
    /// the operator's.
    #[test]
    fn tenants_within_their_shares_cannot_evict_a_newcomer() {
        let p = Places::new(MAX_ADMIN_CONNECTIONS, MAX_PER_SOURCE);
        let tenants = MAX_ADMIN_CONNECTIONS / MAX_PER_SOURCE;
        let src = |t: usize| -> IpAddr { format!("192.0.2.{}", 1 + t).parse().unwrap() };
        let name = |t: usize| format!("t{t}");
        let mut held: Vec<(usize, Place)> = Vec::new();
        for t in 0..tenants {
            for _ in 0..MAX_PER_SOURCE {
                let c = p.admit(Some(src(t))).unwrap();
                as_tenant(&c, &name(t));
                held.push((t, c));
            }
        }
        let op = p.admit(Some("198.51.100.1".parse().unwrap())).unwrap();
        let other = p.admit(Some("198.51.100.2".parse().unwrap())).unwrap();
        for i in 0..4 * MAX_ADMIN_CONNECTIONS {
            // The tenant that lost a place takes one back.
            let t = (0..tenants)
                .find(|&t| held.iter().filter(|(u, _)| *u == t).count() < MAX_PER_SOURCE)
                .unwrap_or(i % tenants);
            let c = p.admit(Some(src(t))).unwrap();
            assert!(
                !op.evicted.is_cancelled() && !other.evicted.is_cancelled(),
                "a newcomer evicted by tenant connection {i}"
            );
            as_tenant(&c, &name(t));
            held.push((t, c));
            held.retain(|(_, c)| !c.evicted.is_cancelled());
        }
        assert!(p.inner.lock().len() <= MAX_ADMIN_CONNECTIONS);
    }

    /// IPv6 clients count per /64, IPv4 ones per address (an IPv4-mapped
    /// IPv6 address as its IPv4 one). Before, each IPv6 address was a
    /// source of its own: one host with a /64 had 2^64 sources, and the
    /// per-source cap never held it.
    #[test]
    fn ipv6_sources_count_per_64() {
        let src = |a: &str| a.parse::<SocketAddr>().unwrap().source();
        assert_eq!(src("[2001:db8::1]:1"), src("[2001:db8::ffff:1234:2]:2"));
        assert_eq!(
            src("[2001:db8:0:7:1:2:3:4]:1"),
            Some("2001:db8:0:7::".parse().unwrap())
        );
        assert_ne!(src("[2001:db8::1]:1"), src("[2001:db8:0:1::1]:1"));
        assert_eq!(
            src("[::ffff:192.0.2.7]:1"),
            Some("192.0.2.7".parse().unwrap())
        );
        assert_eq!(src("192.0.2.7:1"), Some("192.0.2.7".parse().unwrap()));
        assert_ne!(src("192.0.2.7:1"), src("192.0.2.8:1"));

        // One /64, each connection from another address of it: the 17th
        // evicts the first, as from one address.
        let p = Places::new(MAX_ADMIN_CONNECTIONS, MAX_PER_SOURCE);
        let held: Vec<Place> = (0..=MAX_PER_SOURCE)
            .map(|i| {
                let a: SocketAddr = format!("[2001:db8:0:9::{:x}]:4000", i + 1).parse().unwrap();
                p.admit(a.source()).unwrap()
            })
            .collect();
        assert!(
            held[0].evicted.is_cancelled(),
            "17 connections from one /64 all hold places"
        );
        assert_eq!(held.iter().filter(|c| c.evicted.is_cancelled()).count(), 1);
        // Another /64 is another source.
        let other: SocketAddr = "[2001:db8:0:a::1]:4000".parse().unwrap();
        let o = p.admit(other.source()).unwrap();
        assert_eq!(held.iter().filter(|c| c.evicted.is_cancelled()).count(), 1);
        assert!(!o.evicted.is_cancelled());
    }

    /// A write that stalls (a client that stopped reading) ends the
    /// connection after the idle time however it is written: hyper writes
    /// vectored to a TCP stream, and rustls always does. Before, a vectored
    /// write went straight to the stream, neither checking the idle time
    /// nor counting as progress: this write stayed pending for good.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_vectored_write_ends_after_the_idle_time() {
        use tokio::io::AsyncWriteExt;
        let (near, _far) = tokio::io::duplex(64);
        let mut io = Idle::new(near, IDLE_TIMEOUT);
        let chunk = [7u8; 1024];
        let stalled = async {
            loop {
                if let Err(e) = io.write_vectored(&[io::IoSlice::new(&chunk)]).await {
                    return e;
                }
            }
        };
        let err = tokio::time::timeout(2 * IDLE_TIMEOUT, stalled)
            .await
            .expect("the stalled write never ended");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    /// A vectored write that makes progress keeps the connection alive,
    /// however long it takes in all: each write counts as activity.
    #[tokio::test(start_paused = true)]
    async fn vectored_writes_making_progress_keep_the_connection() {
        use tokio::io::AsyncReadExt;
        use tokio::io::AsyncWriteExt;
        let (near, mut far) = tokio::io::duplex(64);
        let mut io = Idle::new(near, IDLE_TIMEOUT);
        let rounds = 10u32;
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            for _ in 0..rounds {
                tokio::time::sleep(IDLE_TIMEOUT / 2).await;
                far.read_exact(&mut buf).await.unwrap();
            }
        });
        let start = Instant::now();
        for i in 0..rounds {
            let n = io.write_vectored(&[io::IoSlice::new(&[1u8; 64])]).await;
            assert_eq!(n.unwrap_or_else(|e| panic!("write {i}: {e}")), 64);
        }
        reader.await.unwrap();
        assert!(start.elapsed() > 2 * IDLE_TIMEOUT);
    }
}

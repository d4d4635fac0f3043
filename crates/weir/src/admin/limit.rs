//! A cap on concurrent admin connections.
//!
//! The admin API shares the process's file-descriptor budget with the data
//! path; without a cap, a client opening admin connections in a loop could
//! take descriptors from proxied connections. Past the cap, `accept` waits
//! (the kernel backlog holds new connections) until one closes. A
//! connection on which nothing is read or written for [`IDLE_TIMEOUT`] is
//! closed, so idle or stalled clients cannot hold the permits forever.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::serve::Listener;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// Most admin connections open at once.
pub(crate) const MAX_ADMIN_CONNECTIONS: usize = 128;
/// An admin connection idle this long is closed.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// A listener that holds a semaphore permit for each open connection.
#[derive(Debug)]
pub(crate) struct Capped<L> {
    inner: L,
    permits: Arc<Semaphore>,
    idle: Duration,
}

impl<L> Capped<L> {
    pub(crate) fn new(inner: L, max: usize, idle: Duration) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(max)),
            idle,
        }
    }
}

impl<L: Listener> Listener for Capped<L> {
    type Io = Permitted<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        // The semaphore is never closed, so this only waits; `ok()` keeps the
        // impossible error from becoming a panic.
        let permit = self.permits.clone().acquire_owned().await.ok();
        let (io, addr) = self.inner.accept().await;
        let conn = Permitted {
            io,
            _permit: permit,
            idle: self.idle,
            deadline: Box::pin(tokio::time::sleep(self.idle)),
        };
        (conn, addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A connection that returns its permit when dropped.
#[derive(Debug)]
pub(crate) struct Permitted<T> {
    io: T,
    _permit: Option<OwnedSemaphorePermit>,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl<T> Permitted<T> {
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

impl<T: AsyncRead + Unpin> AsyncRead for Permitted<T> {
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

impl<T: AsyncWrite + Unpin> AsyncWrite for Permitted<T> {
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

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn third_connection_waits_for_a_permit() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let mut capped = Capped::new(l, 2, IDLE_TIMEOUT);
        let _c1 = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _c2 = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut c3 = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (a1, _) = capped.accept().await;
        let (a2, _) = capped.accept().await;
        assert_eq!(capped.permits.available_permits(), 0);
        // The third accept cannot complete while both permits are held.
        let mut third = Box::pin(capped.accept());
        assert!(futures_poll_once(third.as_mut()).await.is_none());
        drop(a1);
        let (mut a3, _) = third.await;
        c3.write_all(b"x").await.unwrap();
        let mut b = [0u8; 1];
        a3.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"x");
        drop(a2);
    }

    #[tokio::test]
    async fn idle_connections_are_closed_and_free_their_permit() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let mut capped = Capped::new(l, 1, Duration::from_millis(100));
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut conn, _) = capped.accept().await;
        assert_eq!(capped.permits.available_permits(), 0);
        let started = std::time::Instant::now();
        let mut b = [0u8; 1];
        // Bounded: the idle timeout must end this read well within 10 s.
        let r = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut b))
            .await
            .expect("idle timeout fired");
        assert_eq!(r.map_err(|e| e.kind()), Err(io::ErrorKind::TimedOut));
        assert!(started.elapsed() >= Duration::from_millis(100));
        drop(conn);
        assert_eq!(capped.permits.available_permits(), 1);
    }

    /// Poll a future once; `Some` if it completed.
    async fn futures_poll_once<F: std::future::Future + Unpin>(f: F) -> Option<F::Output> {
        let mut f = f;
        std::future::poll_fn(|cx| match Pin::new(&mut f).poll(cx) {
            Poll::Ready(v) => Poll::Ready(Some(v)),
            Poll::Pending => Poll::Ready(None),
        })
        .await
    }
}

//! A cap on concurrent admin connections.
//!
//! The admin API shares the process's file-descriptor budget with the data
//! path; without a cap, a client opening admin connections in a loop could
//! take descriptors from proxied connections. Past the cap, `accept` waits
//! (the kernel backlog holds new connections) until one closes.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::serve::Listener;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Most admin connections open at once.
pub(crate) const MAX_ADMIN_CONNECTIONS: usize = 128;

/// A listener that holds a semaphore permit for each open connection.
#[derive(Debug)]
pub(crate) struct Capped<L> {
    inner: L,
    permits: Arc<Semaphore>,
}

impl<L> Capped<L> {
    pub(crate) fn new(inner: L, max: usize) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(max)),
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
        (
            Permitted {
                io,
                _permit: permit,
            },
            addr,
        )
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
}

impl<T: AsyncRead + Unpin> AsyncRead for Permitted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Permitted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
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
        let mut capped = Capped::new(l, 2);
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

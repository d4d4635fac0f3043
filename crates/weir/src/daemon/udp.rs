//! The UDP proxy: sessions keyed by client address per service, one
//! connected backend-facing socket per session, replies sent from the
//! service's own listening socket (so they come from the virtual address),
//! idle expiry and an optional expected-responses count.
//!
//! A session is its flow-table entry plus a small task holding its socket.
//! Each datagram costs one table lookup: the entry's owner token names the
//! session's slot in this worker's session list (a plain index, no second
//! hash). Datagram buffers belong to the worker (one for the receive loop,
//! one thread-local one the sessions of the worker share, used only between
//! a readiness wakeup and the non-blocking read). When a session ends (the
//! wheel's idle timeout, a kill, backend removal) its task empties its slot,
//! so its socket closes with it.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

use tokio::net::UdpSocket;

use weir_flowtable::{Dir, Millis};

use super::owners::{Close, Owner};
use super::{Conn, ConnState, Refusal, Service, Shared};
use crate::config::Protocol;

/// A live UDP session.
#[derive(Debug)]
pub(crate) struct Session {
    conn: Conn,
    sock: Arc<UdpSocket>,
    /// Set when the session task ended (a datagram then starts a new session).
    done: AtomicBool,
}

const MAX_DATAGRAM: usize = 65_536;

thread_local! {
    /// This worker's sessions, by owner token - 1. SO_REUSEPORT hashes a
    /// client's 4-tuple to one socket, so a client's datagrams always reach
    /// the same worker, and a session's task runs there too: no lock.
    static SESSIONS: RefCell<Vec<Option<Arc<Session>>>> = const { RefCell::new(Vec::new()) };
}

fn session(token: u32) -> Option<Arc<Session>> {
    let i = token.checked_sub(1)? as usize;
    SESSIONS.with_borrow(|s| s.get(i).cloned().flatten())
}

fn set_session(token: u32, v: Option<Arc<Session>>) {
    let Some(i) = token.checked_sub(1).map(|i| i as usize) else {
        return;
    };
    SESSIONS.with_borrow_mut(|s| {
        if v.is_some() && s.len() <= i {
            s.resize(i + 1, None);
        }
        if let Some(slot) = s.get_mut(i) {
            *slot = v;
        }
        // Give memory back once the list is mostly empty at its end.
        while s.last().is_some_and(Option::is_none) {
            s.pop();
        }
        if s.capacity() > 64 && s.len() < s.capacity() / 4 {
            s.shrink_to(s.len() * 2);
        }
    });
}

pub(crate) async fn recv_loop(shared: Arc<Shared>, svc: Arc<Service>, listen: Arc<UdpSocket>) {
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut rng = weir_sched::SplitMix64::new(super::rng_seed());
    loop {
        let (n, peer) = tokio::select! {
            _ = svc.cancel.cancelled() => return,
            _ = shared.conns.kill_all.cancelled() => return,
            r = listen.recv_from(&mut buf) => match r {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!("udp recv: {e}");
                    continue;
                }
            },
        };
        // The hot lookup: every datagram finds its session's entry in the
        // flow table (which also counts it), and through the entry's owner
        // token the session itself.
        let key = super::flow_key(&svc, Protocol::Udp, peer);
        let hit = shared
            .conns
            .table
            .touch_hit(&key, Millis(shared.now_ms()), Dir::In, n as u64);
        let existing = hit.and_then(|h| {
            session(h.owner).filter(|s| s.conn.handle == h.handle && !s.done.load(Relaxed))
        });
        let (sess, touched) = match existing {
            Some(s) => (s, true),
            None => {
                if shared.admission.stop_accept.is_cancelled() {
                    continue;
                }
                match new_session(&shared, &svc, &listen, peer, &mut rng) {
                    Some(s) => (s, false),
                    None => continue,
                }
            }
        };
        shared.count(&sess.conn, Dir::In, n, !touched);
        if let Err(e) = sess.sock.send(&buf[..n]).await {
            tracing::debug!(backend = %sess.conn.backend.addr, "udp send: {e}");
        }
    }
}

fn new_session(
    shared: &Arc<Shared>,
    svc: &Arc<Service>,
    listen: &Arc<UdpSocket>,
    peer: SocketAddr,
    rng: &mut weir_sched::SplitMix64,
) -> Option<Arc<Session>> {
    let tenant = svc.tenant.clone();
    let params = svc.params.load_full();
    if params.udp_max_per_client != 0 {
        let n = svc
            .udp_per_client
            .lock()
            .get(&peer.ip())
            .copied()
            .unwrap_or(0);
        if n >= params.udp_max_per_client {
            shared.admission.refuse(Some(&tenant), Refusal::ClientLimit);
            return None;
        }
    }
    if let Err(why) = shared.admission.admit(&tenant, shared.now_ns()) {
        shared.admission.refuse(Some(&tenant), why);
        return None;
    }
    let refuse = |why| {
        shared.admission.refuse(Some(&tenant), why);
        shared.admission.release(&tenant);
        None
    };
    let backend = match svc.choose(shared, Protocol::Udp, peer, svc.listen.ip(), &[], rng) {
        Ok(b) => b,
        Err(why) => return refuse(why),
    };
    let bind: SocketAddr = if backend.addr.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = match std::net::UdpSocket::bind(bind)
        .and_then(|s| {
            s.set_nonblocking(true)?;
            s.connect(backend.addr)?;
            Ok(s)
        })
        .and_then(UdpSocket::from_std)
    {
        Ok(s) => s,
        Err(e) => {
            // At fd exhaustion every new client gets here: one line a
            // second with a count, not one per datagram.
            static GATE: super::ratelog::RateLimited = super::ratelog::RateLimited::new(1000);
            super::ratelog::warn(&GATE, format_args!("udp session socket: {e}"));
            shared.admission.release(&tenant);
            return None;
        }
    };
    let Some(owner) = shared.conns.owners.claim() else {
        return refuse(Refusal::TableFull);
    };
    let conn = match shared.open(
        svc,
        &backend,
        Protocol::Udp,
        peer,
        svc.listen,
        ConnState::Udp,
        &owner,
    ) {
        Ok(c) => c,
        Err(why) => return refuse(why),
    };
    let sess = Arc::new(Session {
        conn,
        sock: Arc::new(sock),
        done: AtomicBool::new(false),
    });
    set_session(owner.token(), Some(sess.clone()));
    *svc.udp_per_client.lock().entry(peer.ip()).or_default() += 1;
    tokio::spawn(session_task(
        shared.clone(),
        sess.clone(),
        owner,
        listen.clone(),
        peer,
        params.udp_responses,
    ));
    Some(sess)
}

async fn session_task(
    shared: Arc<Shared>,
    sess: Arc<Session>,
    owner: Owner,
    listen: Arc<UdpSocket>,
    peer: SocketAddr,
    expected: Option<u32>,
) {
    let conn = &sess.conn;
    let mut responses = 0u32;
    // No timer: the entry's idle timeout is the table's wheel's to enforce;
    // it tells `owner`.
    let reason = loop {
        tokio::select! {
            why = owner.closed() => break why.name(),
            r = sess.sock.readable() => match r.and_then(|()| {
                reply(&sess.sock, &listen, peer, |n| shared.count(conn, Dir::Out, n, true))
            }) {
                Ok(Some(queued)) => {
                    if let Some(datagram) = queued {
                        // The listening socket's send buffer was full: wait
                        // for it with this one datagram only.
                        let _ = listen.send_to(&datagram, peer).await;
                    }
                    responses += 1;
                    if expected.is_some_and(|e| responses >= e) {
                        break "responses";
                    }
                }
                Ok(None) => {}
                // ICMP unreachable from the backend etc.: keep the session
                // until it idles out (as IPVS does).
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
        }
    };
    sess.done.store(true, Relaxed);
    // Forget the session now: its socket closes once this task's reference
    // is gone too.
    set_session(owner.token(), None);
    let svc = &conn.service;
    {
        let mut pc = svc.udp_per_client.lock();
        if let Some(n) = pc.get_mut(&peer.ip()) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                pc.remove(&peer.ip());
            }
        }
    }
    shared.close(conn, reason);
    shared.admission.release(&svc.tenant);
    let _ = Close::Killed;
}

/// Reads one reply from the session socket into the worker's shared buffer,
/// counts it (`count`, before the client can see it) and passes it to the
/// client from the listening socket. `Ok(None)`: the readiness was spurious.
/// If the listening socket cannot take the datagram now, it is returned as
/// a copy for the caller to send when it can.
fn reply(
    sock: &UdpSocket,
    listen: &UdpSocket,
    peer: SocketAddr,
    count: impl FnOnce(usize),
) -> std::io::Result<Option<Option<Vec<u8>>>> {
    thread_local! {
        static BUF: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0u8; MAX_DATAGRAM]);
    }
    BUF.with_borrow_mut(|buf| {
        let n = match sock.try_recv(buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(e),
        };
        count(n);
        let queued = match listen.try_send_to(&buf[..n], peer) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Some(buf[..n].to_vec()),
            _ => None,
        };
        Ok(Some(queued))
    })
}

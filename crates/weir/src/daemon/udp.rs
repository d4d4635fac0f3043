//! The UDP proxy: sessions keyed by client address per service, one
//! connected backend-facing socket per session, replies sent from the
//! service's own listening socket (so they come from the virtual address),
//! idle expiry and an optional expected-responses count.
//!
//! A session costs its [`Session`] record, its small task and its socket:
//! datagram buffers belong to the worker (one for the receive loop, one
//! thread-local one the sessions of the worker share, used only between a
//! readiness wakeup and the non-blocking read). When a session ends its task
//! tells the worker's receive loop, which forgets it at once, so the socket
//! closes with the session (expiry, kill, backend removal), not later.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::net::UdpSocket;

use weir_flowtable::{Dir, Millis};

use super::{ConnEntry, ConnState, Refusal, Service, Shared};
use crate::config::Protocol;

/// A live UDP session.
#[derive(Debug)]
pub(crate) struct Session {
    entry: Arc<ConnEntry>,
    sock: Arc<UdpSocket>,
    /// Set when the session task ended (a datagram then starts a new session).
    done: std::sync::atomic::AtomicBool,
}

const MAX_DATAGRAM: usize = 65_536;

/// What a session's task tells its receive loop when it ends: the client
/// and the session's cookie (a newer session of the same client stays).
type Ended = (SocketAddr, u64);

pub(crate) async fn recv_loop(shared: Arc<Shared>, svc: Arc<Service>, listen: Arc<UdpSocket>) {
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut rng = weir_sched::SplitMix64::new(super::rng_seed());
    // This worker's sessions. SO_REUSEPORT hashes a client's 4-tuple to one
    // socket, so a client's datagrams always reach the same worker and the
    // map needs no lock. A session's task reports its end on `ended_rx` and
    // the session is forgotten then (its socket closes with it). The
    // channel holds at most one message per session.
    let mut sessions: HashMap<SocketAddr, Arc<Session>> = HashMap::new();
    let (ended_tx, mut ended_rx) = tokio::sync::mpsc::unbounded_channel::<Ended>();
    loop {
        let (n, peer) = tokio::select! {
            _ = svc.cancel.cancelled() => return,
            _ = shared.kill_all.cancelled() => return,
            Some((peer, cookie)) = ended_rx.recv() => {
                forget(&mut sessions, peer, cookie);
                continue;
            }
            r = listen.recv_from(&mut buf) => match r {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!("udp recv: {e}");
                    continue;
                }
            },
        };
        // The hot lookup: every datagram finds its session in the flow
        // table (which also counts it), then its socket by client address.
        let key = super::flow_key(&svc, Protocol::Udp, peer);
        let hit = shared
            .table
            .touch(&key, Millis(shared.now_ms()), Dir::In, n as u64);
        let existing = match hit {
            Some((cookie, _)) => sessions
                .get(&peer)
                .filter(|s| s.entry.cookie == cookie.0)
                .cloned(),
            None => None,
        };
        let (sess, touched) = match existing {
            Some(s) if !s.done.load(Relaxed) && !s.entry.cancel.is_cancelled() => (s, true),
            _ => {
                if shared.stop_accept.is_cancelled() {
                    continue;
                }
                match new_session(&shared, &svc, &listen, peer, &mut rng, &ended_tx).await {
                    Some(s) => {
                        sessions.insert(peer, s.clone());
                        (s, false)
                    }
                    None => continue,
                }
            }
        };
        shared.account_in(&sess.entry, n, !touched);
        if let Err(e) = sess.sock.send(&buf[..n]).await {
            tracing::debug!(backend = %sess.entry.backend.addr, "udp send: {e}");
        }
    }
}

/// Drops the ended session `cookie` of `peer` (if a newer one has not taken
/// its place), and gives memory back once the map is mostly empty.
fn forget(sessions: &mut HashMap<SocketAddr, Arc<Session>>, peer: SocketAddr, cookie: u64) {
    if sessions
        .get(&peer)
        .is_some_and(|s| s.entry.cookie == cookie)
    {
        sessions.remove(&peer);
    }
    if sessions.capacity() > 64 && sessions.len() < sessions.capacity() / 4 {
        sessions.shrink_to(sessions.len() * 2);
    }
}

async fn new_session(
    shared: &Arc<Shared>,
    svc: &Arc<Service>,
    listen: &Arc<UdpSocket>,
    peer: SocketAddr,
    rng: &mut weir_sched::SplitMix64,
    ended: &tokio::sync::mpsc::UnboundedSender<Ended>,
) -> Option<Arc<Session>> {
    let tenant = svc.tenant.clone();
    let params = svc.params.read().clone();
    if params.udp_max_per_client != 0 {
        let n = svc
            .udp_per_client
            .lock()
            .get(&peer.ip())
            .copied()
            .unwrap_or(0);
        if n >= params.udp_max_per_client {
            shared.refuse(Some(&tenant), Refusal::ClientLimit);
            return None;
        }
    }
    if let Err(why) = shared.admit(&tenant) {
        shared.refuse(Some(&tenant), why);
        return None;
    }
    let backend = match svc.choose(shared, Protocol::Udp, peer, svc.listen.ip(), &[], rng) {
        Ok(b) => b,
        Err(why) => {
            shared.refuse(Some(&tenant), why);
            shared.release(&tenant);
            return None;
        }
    };
    let bind: SocketAddr = if backend.addr.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = match UdpSocket::bind(bind).await {
        Ok(s) => s,
        Err(e) => {
            // At fd exhaustion every new client gets here: one line a
            // second with a count, not one per datagram.
            static GATE: super::ratelog::RateLimited = super::ratelog::RateLimited::new(1000);
            super::ratelog::warn(&GATE, format_args!("udp session socket: {e}"));
            shared.release(&tenant);
            return None;
        }
    };
    if let Err(e) = sock.connect(backend.addr).await {
        tracing::debug!(backend = %backend.addr, "udp connect: {e}");
        shared.release(&tenant);
        return None;
    }
    let entry = match shared.register(
        svc,
        &backend,
        Protocol::Udp,
        peer,
        ConnState::Udp,
        params
            .udp_timeout
            .unwrap_or_else(|| Duration::from_millis(svc.tenant.timeouts.read().udp.0)),
    ) {
        Ok(e) => e,
        Err(why) => {
            shared.refuse(Some(&tenant), why);
            shared.release(&tenant);
            return None;
        }
    };
    let sess = Arc::new(Session {
        entry,
        sock: Arc::new(sock),
        done: std::sync::atomic::AtomicBool::new(false),
    });
    *svc.udp_per_client.lock().entry(peer.ip()).or_default() += 1;
    tokio::spawn(session_task(
        shared.clone(),
        svc.clone(),
        sess.clone(),
        listen.clone(),
        peer,
        params.udp_responses,
        ended.clone(),
    ));
    Some(sess)
}

async fn session_task(
    shared: Arc<Shared>,
    svc: Arc<Service>,
    sess: Arc<Session>,
    listen: Arc<UdpSocket>,
    peer: SocketAddr,
    expected: Option<u32>,
    ended: tokio::sync::mpsc::UnboundedSender<Ended>,
) {
    let entry = &sess.entry;
    let mut responses = 0u32;
    let reason = loop {
        let left = (entry.last_active.load(Relaxed) + entry.timeout_ms.load(Relaxed))
            .saturating_sub(shared.now_ms());
        tokio::select! {
            _ = entry.cancel.cancelled() => break *entry.cancel_reason.lock(),
            r = sess.sock.readable() => match r.and_then(|()| {
                reply(&sess.sock, &listen, peer, |n| shared.count_out(entry, n))
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
            _ = tokio::time::sleep(Duration::from_millis(left)) => {
                if shared.now_ms() >= entry.last_active.load(Relaxed) + entry.timeout_ms.load(Relaxed) {
                    break "idle_timeout";
                }
            }
        }
    };
    sess.done.store(true, Relaxed);
    // The receive loop forgets the session (and closes its socket once
    // this task's reference is gone too). A closed channel means the loop
    // itself has ended and dropped its map.
    let _ = ended.send((peer, entry.cookie));
    {
        let mut pc = svc.udp_per_client.lock();
        if let Some(n) = pc.get_mut(&peer.ip()) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                pc.remove(&peer.ip());
            }
        }
    }
    shared.unregister(entry, reason);
    shared.release(&svc.tenant);
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

//! The UDP proxy: sessions keyed by client address per service, one
//! connected backend-facing socket per session, replies sent from the
//! service's own listening socket (so they come from the virtual address),
//! idle expiry and an optional expected-responses count.

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
    /// Set when the session task ended (the recv loop then forgets it).
    done: std::sync::atomic::AtomicBool,
}

const MAX_DATAGRAM: usize = 65_536;

pub(crate) async fn recv_loop(shared: Arc<Shared>, svc: Arc<Service>, listen: Arc<UdpSocket>) {
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut rng = weir_sched::SplitMix64::new(super::rng_seed());
    // This worker's sessions. SO_REUSEPORT hashes a client's 4-tuple to one
    // socket, so a client's datagrams always reach the same worker and the
    // map needs no lock; ended sessions are swept when the map has doubled
    // since the last sweep (amortised O(1) per datagram).
    let mut sessions: HashMap<SocketAddr, Arc<Session>> = HashMap::new();
    let mut sweep_at = 64usize;
    loop {
        let (n, peer) = tokio::select! {
            _ = svc.cancel.cancelled() => return,
            _ = shared.kill_all.cancelled() => return,
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
                match new_session(&shared, &svc, &listen, peer, &mut rng).await {
                    Some(s) => {
                        sessions.insert(peer, s.clone());
                        if sessions.len() >= sweep_at {
                            sessions.retain(|_, s| !s.done.load(Relaxed));
                            sweep_at = (sessions.len() * 2).max(64);
                        }
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

async fn new_session(
    shared: &Arc<Shared>,
    svc: &Arc<Service>,
    listen: &Arc<UdpSocket>,
    peer: SocketAddr,
    rng: &mut weir_sched::SplitMix64,
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
    let backend = match svc.choose(shared, Protocol::Udp, peer, &[], rng) {
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
            tracing::warn!("udp session socket: {e}");
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
) {
    let entry = &sess.entry;
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut responses = 0u32;
    let reason = loop {
        let left = (entry.last_active.load(Relaxed) + entry.timeout_ms.load(Relaxed))
            .saturating_sub(shared.now_ms());
        tokio::select! {
            _ = entry.cancel.cancelled() => break *entry.cancel_reason.lock(),
            r = sess.sock.recv(&mut buf) => match r {
                Ok(n) => {
                    shared.count_out(entry, n);
                    let _ = listen.send_to(&buf[..n], peer).await;
                    responses += 1;
                    if expected.is_some_and(|e| responses >= e) {
                        break "responses";
                    }
                }
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

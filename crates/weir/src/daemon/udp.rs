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
//! so its socket closes with it. A client's datagram is never waited on:
//! one its session's socket cannot take at once is dropped and counted
//! ([`UdpDrop`]).

use std::cell::RefCell;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::UdpSocket;

use weir_flowtable::{Dir, FlowKey, Millis};

use super::accounting::{UdpDrop, UdpDrops};
use super::conns::Pressing;
use super::owners::Owner;
use super::{Conn, ConnState, Refusal, Service, Shared};
use crate::config::Protocol;

/// A live UDP session.
#[derive(Debug)]
pub(crate) struct Session {
    conn: Conn,
    sock: Arc<UdpSocket>,
    /// On a wildcard listener, the local address the client sent to: the
    /// session's replies leave from it (`None`: the service's address).
    local: Option<IpAddr>,
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

/// Asks the kernel for each datagram's destination address (a wildcard
/// listener's replies must leave from the address the client sent to).
pub(super) fn want_pktinfo(listen: &impl std::os::fd::AsFd, v6: bool) -> std::io::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    if v6 {
        setsockopt(listen, sockopt::Ipv6RecvPacketInfo, &true)?;
    } else {
        setsockopt(listen, sockopt::Ipv4PacketInfo, &true)?;
    }
    Ok(())
}

/// One datagram from a socket [`want_pktinfo`] set up: its length, sender
/// and the local address it was sent to (non-blocking).
fn recv_pktinfo(
    listen: &UdpSocket,
    buf: &mut [u8],
    cmsg: &mut [u8],
) -> std::io::Result<(usize, SocketAddr, Option<IpAddr>)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrLike, SockaddrStorage, recvmsg};
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let msg =
        recvmsg::<SockaddrStorage>(listen.as_raw_fd(), &mut iov, Some(cmsg), MsgFlags::empty())?;
    let peer = msg.address.and_then(|a| match a.family() {
        Some(nix::sys::socket::AddressFamily::Inet) => {
            a.as_sockaddr_in().map(|a| SocketAddr::V4((*a).into()))
        }
        Some(nix::sys::socket::AddressFamily::Inet6) => {
            a.as_sockaddr_in6().map(|a| SocketAddr::V6((*a).into()))
        }
        _ => None,
    });
    let Some(peer) = peer else {
        return Err(std::io::Error::other("datagram without a sender address"));
    };
    let mut local = None;
    for c in msg.cmsgs()? {
        match c {
            // The address to answer from: the destination of a unicast
            // datagram; for a broadcast the receiving interface's own
            // (`ipi_spec_dst`). A multicast destination cannot be a
            // source: the kernel's choice then.
            ControlMessageOwned::Ipv4PacketInfo(pi) => {
                let a = std::net::Ipv4Addr::from(u32::from_be(pi.ipi_spec_dst.s_addr));
                local = (!a.is_unspecified() && !a.is_multicast()).then_some(IpAddr::V4(a));
            }
            ControlMessageOwned::Ipv6PacketInfo(pi) => {
                let a = std::net::Ipv6Addr::from(pi.ipi6_addr.s6_addr);
                local = (!a.is_multicast()).then_some(IpAddr::V6(a));
            }
            _ => {}
        }
    }
    Ok((msg.bytes, peer, local))
}

/// Sends `data` to `peer` from the listening socket, from `local` if set
/// (a wildcard listener's session), non-blocking.
fn send_from(
    listen: &UdpSocket,
    data: &[u8],
    peer: SocketAddr,
    local: Option<IpAddr>,
) -> std::io::Result<usize> {
    use nix::sys::socket::{ControlMessage, MsgFlags, SockaddrStorage, sendmsg};
    let Some(local) = local else {
        return listen.try_send_to(data, peer);
    };
    let iov = [std::io::IoSlice::new(data)];
    let to = SockaddrStorage::from(peer);
    match local {
        IpAddr::V4(a) => {
            let pi = libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.octets()),
                },
                ipi_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.octets()),
                },
            };
            listen.try_io(Interest::WRITABLE, || {
                Ok(sendmsg(
                    listen.as_raw_fd(),
                    &iov,
                    &[ControlMessage::Ipv4PacketInfo(&pi)],
                    MsgFlags::empty(),
                    Some(&to),
                )?)
            })
        }
        IpAddr::V6(a) => {
            let pi = libc::in6_pktinfo {
                ipi6_addr: libc::in6_addr {
                    s6_addr: a.octets(),
                },
                ipi6_ifindex: 0,
            };
            listen.try_io(Interest::WRITABLE, || {
                Ok(sendmsg(
                    listen.as_raw_fd(),
                    &iov,
                    &[ControlMessage::Ipv6PacketInfo(&pi)],
                    MsgFlags::empty(),
                    Some(&to),
                )?)
            })
        }
    }
}

pub(crate) async fn recv_loop(shared: Arc<Shared>, svc: Arc<Service>, listen: Arc<UdpSocket>) {
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut rng = weir_sched::SplitMix64::new(super::rng_seed());
    // A wildcard listener learns each datagram's destination: a session is
    // the client's with that address, and answers from it.
    let mut cmsg = nix::cmsg_space!(libc::in6_pktinfo);
    let wildcard = svc.listen.ip().is_unspecified()
        && match want_pktinfo(&listen, svc.listen.is_ipv6()) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(
                    "udp {}: IP_PKTINFO: {e}; replies leave from the kernel's choice of address",
                    svc.listen
                );
                false
            }
        };
    loop {
        let (n, peer, local) = tokio::select! {
            _ = svc.cancel.cancelled() => return,
            _ = shared.conns.kill_all.cancelled() => return,
            r = async {
                if wildcard {
                    listen
                        .async_io(Interest::READABLE, || recv_pktinfo(&listen, &mut buf, &mut cmsg))
                        .await
                } else {
                    listen.recv_from(&mut buf).await.map(|(n, p)| (n, p, None))
                }
            } => match r {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!("udp recv: {e}");
                    continue;
                }
            },
        };
        // Source port 0: no reply is expected (RFC 768) nor could be sent,
        // and its flow key would be its client group's persistence
        // template's, `(group, 0)`: a session would take the template over.
        if peer.port() == 0 {
            continue;
        }
        let virt = SocketAddr::new(local.unwrap_or(svc.listen.ip()), svc.listen.port());
        // The hot lookup: every datagram finds its session's entry in the
        // flow table (which also counts it), and through the entry's owner
        // token the session itself.
        let key = FlowKey {
            virt,
            ..super::flow_key(&svc, Protocol::Udp, peer)
        };
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
                match new_session(&shared, &svc, &listen, peer, local, &mut rng) {
                    Ok(s) => (s, false),
                    Err(NoSession::Refused) => continue,
                    Err(NoSession::FreeingFd) => {
                        // Let the ended session's task close its socket
                        // (when it is this worker's) before the next
                        // datagram, which then gets it. (Another worker's
                        // closes when that worker runs it: a datagram
                        // refused meanwhile ends no other,
                        // `free_a_descriptor`.)
                        tokio::task::yield_now().await;
                        continue;
                    }
                }
            }
        };
        shared.count(&sess.conn, Dir::In, n, !touched);
        forward(&shared, &sess, &buf[..n]);
    }
}

/// Passes a client's datagram to its session's backend without waiting: a
/// datagram the session's socket cannot take at once (its send buffer
/// full: the way to that backend is slower than its clients) is dropped
/// and counted, as a router drops what its queue cannot hold. Awaiting the
/// send stalled this receive loop, and with it every client of the
/// listener, behind one slow backend.
fn forward(shared: &Shared, sess: &Session, datagram: &[u8]) {
    // Straight to the kernel: tokio's `try_send` does not even try on a
    // socket it has not seen writable yet (a new session's).
    let Err(e) = socket2::SockRef::from(&*sess.sock).send(datagram) else {
        return;
    };
    let why = if e.kind() == std::io::ErrorKind::WouldBlock {
        UdpDrop::BackendBusy
    } else {
        tracing::debug!(backend = %sess.conn.backend.addr, "udp send: {e}");
        UdpDrop::SendFailed
    };
    shared.accounting.udp_dropped.add(why);
}

/// Why a client's datagram got no session: it is dropped, and counted
/// under the reason it was refused for.
enum NoSession {
    Refused,
    /// Refused for want of a descriptor, and one is on its way back: a
    /// session ended to free it ([`free_a_descriptor`]), for this datagram
    /// or an earlier one, whose socket closes when its task runs.
    FreeingFd,
}

fn new_session(
    shared: &Arc<Shared>,
    svc: &Arc<Service>,
    listen: &Arc<UdpSocket>,
    peer: SocketAddr,
    local: Option<IpAddr>,
    rng: &mut weir_sched::SplitMix64,
) -> Result<Arc<Session>, NoSession> {
    // The client's place, taken where it is checked (under the map's
    // lock): a client's ports reach every worker, and a check here with
    // the count taken once the session exists let each worker pass its
    // first datagram at once. Counted whatever the limit (the session
    // gives it back when it ends).
    let max = match svc.params.load().udp_max_per_client {
        0 => u64::MAX,
        n => n,
    };
    if !svc.take_client_place(Protocol::Udp, peer.ip(), max) {
        shared
            .admission
            .refuse(Some(&svc.tenant), Refusal::ClientLimit);
        return Err(NoSession::Refused);
    }
    let sess = open_session(shared, svc, listen, peer, local, rng);
    if sess.is_err() {
        svc.give_client_place(Protocol::Udp, peer.ip());
    }
    sess
}

/// [`new_session`] once the client has its place.
fn open_session(
    shared: &Arc<Shared>,
    svc: &Arc<Service>,
    listen: &Arc<UdpSocket>,
    peer: SocketAddr,
    local: Option<IpAddr>,
    rng: &mut weir_sched::SplitMix64,
) -> Result<Arc<Session>, NoSession> {
    let tenant = svc.tenant.clone();
    let params = svc.params.load_full();
    // At a limit, the place of a session that has carried a single
    // datagram (`take_a_place`). The ended session's task gives its slot
    // back when it runs (its worker may be another): this one has it
    // meanwhile, one over the limit until then, so the place does not go
    // to whichever datagram comes next (most likely the flood's).
    let now_ns = shared.now_ns();
    let mut admitted = shared.admission.admit(&tenant, now_ns);
    if admitted == Err(Refusal::GlobalLimit) {
        // The daemon's limit: from the tenant pressing hardest on it (a
        // flood against one tenant must not lock the others out), under
        // this tenant's own limits still, checked first so that a session
        // they refuse ends nobody's.
        admitted = shared.admission.admit_past_daemon_limit(&tenant, now_ns);
        if admitted.is_ok() && !take_a_place_pressed(shared, &tenant, rng) {
            shared.admission.release_unopened(&tenant);
            admitted = Err(Refusal::GlobalLimit);
        }
    }
    // The tenant's own limit (the daemon's too, maybe): from its own.
    if admitted == Err(Refusal::TenantLimit) && take_a_place(shared, &tenant, rng) {
        shared.admission.admit_over(&tenant);
        admitted = Ok(());
    }
    if let Err(why) = admitted {
        shared.admission.refuse(Some(&tenant), why);
        return Err(NoSession::Refused);
    }
    let refuse = |why| {
        shared.admission.refuse(Some(&tenant), why);
        shared.admission.release(&tenant);
        Err(NoSession::Refused)
    };
    // The destination the client sent to (`lblc`, `lblcr` and `dh` key on
    // it): on a wildcard listener the local address, as for TCP.
    let dest = local.unwrap_or(svc.listen.ip());
    let backend = match svc.choose(shared, Protocol::Udp, peer, dest, &[], rng) {
        Ok(b) => b,
        Err(why) => return refuse(why),
    };
    // Read before the socket is made: a session ended early that finishes
    // closing meanwhile, too late for this socket, leaves its descriptor
    // to the next datagram, and this one must not end another
    // (`free_a_descriptor`).
    let closing = shared.conns.owners.early_drops_closing();
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
            // second with a count, not one per datagram. Each is counted
            // as refused, as a TCP client is: its datagram is dropped.
            static GATE: super::ratelog::RateLimited = super::ratelog::RateLimited::new(1000);
            super::ratelog::warn(&GATE, format_args!("udp session socket: {e}"));
            if !super::tcp::is_fd_exhaustion(&e) {
                // The connect towards the backend failed (no route).
                return refuse(Refusal::BackendUnreachable);
            }
            // Out of descriptors, most likely to a spoofed flood's
            // sessions (each a socket for `udp_timeout`): one of them
            // ends, from the tenant pressing hardest on the daemon's
            // limits, and its socket closes when its task runs, within a
            // scheduler turn. It cannot be this datagram's (the socket is
            // not there yet): the client's retry finds it, as a
            // retransmitting client does.
            let freeing = closing > 0 || free_a_descriptor(shared, &tenant, rng);
            let _ = refuse(Refusal::FdExhausted);
            return Err(if freeing {
                NoSession::FreeingFd
            } else {
                NoSession::Refused
            });
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
        SocketAddr::new(local.unwrap_or(svc.listen.ip()), svc.listen.port()),
        ConnState::Udp,
        &owner,
    ) {
        Ok(c) => c,
        Err(why) => return refuse(why),
    };
    shared.count_conn(svc, &backend, true);
    let sess = Arc::new(Session {
        conn,
        sock: Arc::new(sock),
        local,
        done: AtomicBool::new(false),
    });
    set_session(owner.token(), Some(sess.clone()));
    tokio::spawn(session_task(
        shared.clone(),
        sess.clone(),
        owner,
        listen.clone(),
        peer,
        params.udp_responses,
    ));
    Ok(sess)
}

/// Spoofed datagram flood defence (packet mode's `Engine::early_drop`,
/// for sessions): ends one of `tenant`'s sessions that has carried a
/// single datagram from its client, one of those due soonest, so that a
/// new session refused at the tenant's or the daemon's connection limit,
/// or for want of a descriptor, can take its place. A spoofed datagram's
/// session otherwise holds its place (and a socket) for `udp_timeout`,
/// 300 s by default, whether or not its backend answers; a DNS-style
/// exchange that has had its answer loses nothing when it goes; a
/// session that has carried two datagrams or more from its client (a
/// stream: conntrack's rule for assuring UDP) is never taken. The look is
/// bounded and rests 10 ms after finding nothing, as packet mode's.
fn take_a_place(shared: &Shared, tenant: &super::Tenant, rng: &mut weir_sched::SplitMix64) -> bool {
    let now = Millis(shared.now_ms());
    let seed = weir_sched::RandomSource::next_u64(rng);
    let took = shared.take_place(tenant, now, seed, single_datagram_session) == Some(true);
    if took {
        shared.accounting.udp_early_drops.fetch_add(1, Relaxed);
    }
    took
}

/// [`take_a_place`] at a daemon-wide limit: the daemon's
/// `max_connections`, or the descriptors running out (no
/// `max_connections` set, a flood's sessions hold a socket each until
/// they do). From the tenant pressing hardest on those limits, or from
/// `own` if that one has no session to give ([`Pressing`]: packet mode's
/// choice at the daemon's limit, this worker's own).
fn take_a_place_pressed(
    shared: &Shared,
    own: &super::Tenant,
    rng: &mut weir_sched::SplitMix64,
) -> bool {
    thread_local! {
        static PRESSING: RefCell<Pressing> = RefCell::default();
    }
    let now = Millis(shared.now_ms());
    let model = shared.model.load();
    PRESSING.with_borrow_mut(|p| {
        p.take_place(own, model.tenants.values(), now, |t| {
            take_a_place(shared, t, rng)
        })
    })
}

/// [`free_a_descriptor`] without waiting for a session still closing:
/// ends one now, if one can be. For a caller that has waited
/// [`FREEING_TURNS`] turns for the one closing and still finds no
/// descriptor: the worker running that session may be stuck, and
/// waiting on it for ever would spin its caller's accept loop.
pub(super) fn end_a_session_now(
    shared: &Shared,
    own: &super::Tenant,
    rng: &mut weir_sched::SplitMix64,
) -> bool {
    take_a_place_pressed(shared, own, rng)
}

/// How many turns a TCP accept waits for a session ended early to close
/// before it ends another ([`end_a_session_now`]).
pub(super) const FREEING_TURNS: u32 = 64;

/// Out of descriptors anywhere in the proxy (a UDP session's socket, a
/// TCP accept, a backend connect): ends one UDP session that has carried
/// a single datagram, of the tenant pressing hardest on the daemon-wide
/// limits, so that a spoofed datagram flood holding every descriptor (a
/// socket per forged source for `udp_timeout`) does not lock new clients
/// and the TCP services of every tenant out. Its socket closes when its
/// task runs: the caller tries again after a turn. Whether a descriptor
/// is on its way back: one ended now, or one ended earlier and still
/// closing ([`Owners::early_drops_closing`](super::owners::Owners::early_drops_closing)),
/// which ends none.
///
/// A session's task runs on its own worker, maybe not the caller's, and
/// the caller may read on before it runs: ending one per refused datagram
/// meanwhile ended a session each for the one descriptor the next of them
/// needed (32 new clients against 16 sessions of the other worker ended
/// up to all 16 and got none in). So a session ends only when none is
/// closing, as with one worker, whose receive loop lets the ended session
/// close before it reads on: each descriptor freed goes to the next new
/// flow.
/// (Two workers refused at the same moment, each finding none closing,
/// may each end one: each has a client whose retry needs it.)
pub(super) fn free_a_descriptor(
    shared: &Shared,
    own: &super::Tenant,
    rng: &mut weir_sched::SplitMix64,
) -> bool {
    shared.conns.owners.early_drops_closing() > 0 || take_a_place_pressed(shared, own, rng)
}

/// A UDP proxy session that has carried a single datagram from its
/// client ([`take_a_place`]).
fn single_datagram_session(c: weir_flowtable::Candidate) -> bool {
    c.state == weir_flowtable::FlowState::Udp
        && c.owner != 0
        && !super::packet::is_packet_owner(c.owner)
        && c.packets_in <= 1
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
                reply(&sess.sock, &listen, peer, sess.local, &shared.accounting.udp_dropped, |n| {
                    shared.count(conn, Dir::Out, n, true)
                })
            }) {
                Ok(Some(queued)) => {
                    if let Some(datagram) = queued {
                        // The listening socket's send buffer was full: wait
                        // for it with this one datagram only, but not past
                        // a close (the session's descriptor must go back at
                        // once: at fd exhaustion the next datagram needs it).
                        let send = listen.async_io(Interest::WRITABLE, || {
                            send_from(&listen, &datagram, peer, sess.local)
                        });
                        tokio::select! {
                            why = owner.closed() => break why.name(),
                            sent = send => if let Err(e) = sent {
                                reply_failed(&shared.accounting.udp_dropped, peer, &e);
                            },
                        }
                    }
                    // Counted only against a limit, and never past it: a
                    // session without one may relay any number of replies.
                    if let Some(e) = expected {
                        responses += 1;
                        if responses >= e {
                            break "responses";
                        }
                    }
                }
                Ok(None) => {}
                // ICMP unreachable from the backend etc.: keep the session
                // until it idles out (as IPVS does), pausing the reads, but
                // not a close.
                Err(_) => tokio::select! {
                    why = owner.closed() => break why.name(),
                    () = tokio::time::sleep(Duration::from_millis(10)) => {}
                },
            },
        }
    };
    sess.done.store(true, Relaxed);
    // Forget the session now: its socket closes once this task's reference
    // is gone too.
    set_session(owner.token(), None);
    let svc = &conn.service;
    svc.give_client_place(Protocol::Udp, peer.ip());
    shared.close(conn, reason);
    shared.admission.release(&svc.tenant);
    // The socket closes (the receive loop holds the session only within a
    // datagram's turn on this thread) before the owner slot is let go: a
    // session ended early counts as closing until then, and its
    // descriptor is free once it no longer does.
    debug_assert_eq!(Arc::strong_count(&sess), 1, "the session's last holder");
    drop(sess);
    drop(owner);
}

/// A backend's reply to `peer` could not be sent (`e`, not a full buffer):
/// it is dropped, and counted as the forward path counts its failures.
fn reply_failed(dropped: &UdpDrops, peer: SocketAddr, e: &std::io::Error) {
    tracing::debug!(client = %peer, "udp reply send: {e}");
    dropped.add(UdpDrop::ReplyFailed);
}

/// Reads one reply from the session socket into the worker's shared buffer,
/// counts it (`count`, before the client can see it) and passes it to the
/// client from the listening socket. `Ok(None)`: the readiness was spurious.
/// If the listening socket cannot take the datagram now, it is returned as
/// a copy for the caller to send when it can; one it refuses otherwise is
/// dropped and counted in `dropped` ([`UdpDrop::ReplyFailed`]).
fn reply(
    sock: &UdpSocket,
    listen: &UdpSocket,
    peer: SocketAddr,
    local: Option<IpAddr>,
    dropped: &UdpDrops,
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
        let queued = match send_from(listen, &buf[..n], peer, local) {
            Ok(_) => None,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Some(buf[..n].to_vec()),
            Err(e) => {
                reply_failed(dropped, peer, &e);
                None
            }
        };
        Ok(Some(queued))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply the listening socket refuses with an error other than a
    /// full buffer (here: a client address of the other family) is
    /// counted as dropped (`reply_failed`), once; it used to vanish
    /// uncounted. The reply is still counted as read.
    #[tokio::test]
    async fn a_reply_that_cannot_be_sent_is_counted() {
        let backend = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        sock.connect(backend.local_addr().unwrap()).await.unwrap();
        let listen = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        backend
            .send_to(b"reply", sock.local_addr().unwrap())
            .await
            .unwrap();
        let dropped = UdpDrops::default();
        let peer: SocketAddr = "[::1]:9".parse().unwrap();
        let mut read = 0;
        // Bounded: the datagram is on loopback, readable at once.
        let r = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                sock.readable().await.unwrap();
                if let Some(q) = reply(&sock, &listen, peer, None, &dropped, |n| read += n).unwrap()
                {
                    break q;
                }
            }
        })
        .await
        .expect("the reply never became readable");
        assert_eq!(r, None, "nothing is queued for a send that failed");
        assert_eq!(read, 5);
        let want: std::collections::BTreeMap<String, u64> =
            [("reply_failed".to_owned(), 1)].into_iter().collect();
        assert_eq!(dropped.snapshot(), want);
    }
}

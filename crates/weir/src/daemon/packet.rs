//! Packet mode's data path (`forward = "nat" | "fnat" | "dr"`, issue 12).
//!
//! A packet flow is its flow-table entry and nothing else: service, backend,
//! TCP state, timers, packets and bytes each way, and (fnat) the NAT slot
//! naming weir's local address and port. No task, no socket, no owner slot.
//!
//! One [`Engine`] per packet worker thread turns one received frame into a
//! verdict, with no I/O of its own (the rings are `weir-packet-io`'s, the
//! next hops a [`NextHops`]):
//!
//! 1. parse ([`weir_packet::parse`]); what it cannot handle is counted by
//!    reason and dropped (fragments, IP options, extension headers, TTL ≤ 1…);
//! 2. classify: to a packet service's VIP:port (client → backend), or from
//!    a nat/fnat backend (its reply), from the worker's snapshot of the
//!    services ([`Vips`], rebuilt when [`Shared::services_gen`] moves);
//! 3. look the flow up: one flow-table lookup, by the forward key or by the
//!    reply key; a first packet goes through the proxy's admission
//!    ([`Shared::admit`]), scheduler and persistence ([`Service::choose`]),
//!    then one insert (fnat: after taking a local port);
//! 4. TCP state by IPVS's table ([`weir_packet::tcp_state`]), bytes and
//!    packets into the entry and the estimators;
//! 5. rewrite in place ([`weir_packet::rewrite`]) for the next hop the
//!    kernel's tables give, and transmit on the interface it came in on.
//!
//! The end of a flow (the wheel, `weir kill`, a backend down with
//! `expire_nodest_conn`, a deleted service or tenant) is [`Shared::ended`]
//! like a proxied connection's; [`Shared::settle_packet`] gives back its
//! admission slot, its fnat port and its persistence template.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;
use weir_flowtable::{
    BackendId, Dir, FlowInit, FlowKey, FlowSnapshot, FlowState, Handle, Millis, Proto, ReplyMode,
    ServiceId, TenantId,
};
use weir_packet::{
    CsumMode, Direction, FnatPorts, Method, NatMapping, NextHop, Packet, TcpDir, TcpState,
    Unhandled,
};

use super::{Backend, Refusal, Service, Shared};
use crate::config::Forward;

/// The owner token of packet flows: the packet path owns them, no task
/// does. [`super::owners::Owners`] never hands out this token.
pub(crate) const PACKET_OWNER: u32 = u32::MAX;

/// What the engine did with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Rewritten; send it out of the interface it came in on.
    Transmit,
    /// Counted under a [`Drop`] reason (or an [`Unhandled`] one); free it.
    Drop,
}

/// Why a parsed frame was dropped; one counter each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Drop {
    /// Neither to a packet service's VIP:port nor a nat/fnat backend's reply
    /// (the steering program let it through; e.g. a service just deleted).
    NotOurs,
    /// A TCP packet without SYN and without a flow (`sloppy_tcp` off), or
    /// a reply with no flow.
    NoFlow,
    /// Admission refused a new flow (also counted by the refusal's reason).
    Refused,
    /// The flow's backend left its service.
    BackendGone,
    /// fnat: no local port left for the backend (or no local address of its
    /// family).
    FnatPorts,
    /// The kernel has no route or no resolved neighbour for the next hop.
    NoNextHop,
    /// The next hop is out of another interface than the frame came in on.
    OtherInterface,
    /// TTL / hop limit would reach 0.
    TtlExpired,
    /// ICMP (errors are not translated yet) and other frames weir forwards
    /// nothing for.
    Icmp,
    /// A rewrite refused the frame (inconsistent lengths).
    Rewrite,
}

impl Drop {
    pub(crate) const ALL: [Drop; 10] = [
        Drop::NotOurs,
        Drop::NoFlow,
        Drop::Refused,
        Drop::BackendGone,
        Drop::FnatPorts,
        Drop::NoNextHop,
        Drop::OtherInterface,
        Drop::TtlExpired,
        Drop::Icmp,
        Drop::Rewrite,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Drop::NotOurs => "not_ours",
            Drop::NoFlow => "no_flow",
            Drop::Refused => "refused",
            Drop::BackendGone => "backend_gone",
            Drop::FnatPorts => "fnat_ports_exhausted",
            Drop::NoNextHop => "no_next_hop",
            Drop::OtherInterface => "other_interface",
            Drop::TtlExpired => "ttl_expired",
            Drop::Icmp => "icmp",
            Drop::Rewrite => "rewrite",
        }
    }
}

/// One worker's counters (only that worker writes them, so no two cores
/// share their lines); the daemon sums them for `weir stats`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) rx: AtomicU64,
    pub(crate) tx: AtomicU64,
    pub(crate) new_flows: AtomicU64,
    pub(crate) unhandled: [AtomicU64; Unhandled::COUNT],
    pub(crate) dropped: [AtomicU64; Drop::ALL.len()],
}

/// Sums of every worker's [`Counters`], by name.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct CounterSums {
    pub(crate) rx: u64,
    pub(crate) tx: u64,
    pub(crate) new_flows: u64,
    pub(crate) dropped: std::collections::BTreeMap<String, u64>,
}

/// Where packets of a rewritten flow go next: the kernel's route and
/// neighbour for `dst`, as the interface index to send from and the MACs.
pub(crate) trait NextHops: Send {
    /// The next hop towards `dst`, or `None` while the kernel has no route
    /// or no resolved neighbour (the frame is dropped and counted).
    fn next_hop(&mut self, dst: IpAddr) -> Option<(u32, NextHop)>;
}

/// The packet path's shared part: fnat ports, every worker's counters.
#[derive(Debug)]
pub(crate) struct PacketPath {
    /// `[packet] local_addresses`, in order: a flow's NAT slot names one by
    /// its index.
    locals: Vec<IpAddr>,
    fnat: Mutex<FnatPorts>,
    counters: Mutex<Vec<Arc<Counters>>>,
    /// "xdp" or "afpacket": what `io = auto` chose.
    pub(crate) io: &'static str,
}

impl PacketPath {
    pub(crate) fn new(
        locals: Vec<IpAddr>,
        ports: std::ops::RangeInclusive<u16>,
        seed: u64,
        io: &'static str,
    ) -> anyhow::Result<Self> {
        let fnat = FnatPorts::new(locals.clone(), ports, seed)
            .map_err(|e| anyhow::anyhow!("[packet] fnat_ports: {e}"))?;
        Ok(Self {
            locals,
            fnat: Mutex::new(fnat),
            counters: Mutex::new(Vec::new()),
            io,
        })
    }

    /// Counters for one more worker.
    pub(crate) fn worker_counters(&self) -> Arc<Counters> {
        let c = Arc::new(Counters::default());
        self.counters.lock().push(c.clone());
        c
    }

    pub(crate) fn sums(&self) -> CounterSums {
        let mut s = CounterSums::default();
        let mut unhandled = [0u64; Unhandled::COUNT];
        let mut dropped = [0u64; Drop::ALL.len()];
        for c in self.counters.lock().iter() {
            s.rx += c.rx.load(Relaxed);
            s.tx += c.tx.load(Relaxed);
            s.new_flows += c.new_flows.load(Relaxed);
            for (t, v) in unhandled.iter_mut().zip(&c.unhandled) {
                *t += v.load(Relaxed);
            }
            for (t, v) in dropped.iter_mut().zip(&c.dropped) {
                *t += v.load(Relaxed);
            }
        }
        for (i, n) in unhandled.into_iter().enumerate() {
            if n > 0 {
                s.dropped.insert(Unhandled::NAMES[i].to_owned(), n);
            }
        }
        for (d, n) in Drop::ALL.into_iter().zip(dropped) {
            if n > 0 {
                s.dropped.insert(d.name().to_owned(), n);
            }
        }
        s
    }

    /// The NAT slot of fnat local endpoint `local` (0 if it is not one of
    /// ours: slot 0 means "none").
    fn slot_of(&self, local: SocketAddr) -> u32 {
        self.locals
            .iter()
            .position(|&a| a == local.ip())
            .map_or(0, |i| ((i as u32 + 1) << 16) | u32::from(local.port()))
    }

    /// The local endpoint a NAT slot names.
    fn local_of(&self, slot: u32) -> Option<SocketAddr> {
        let i = (slot >> 16).checked_sub(1)? as usize;
        Some(SocketAddr::new(*self.locals.get(i)?, slot as u16))
    }

    /// A flow to `backend` ended: its fnat port is free again.
    pub(crate) fn release_port(&self, slot: u32, backend: SocketAddr) {
        if let Some(local) = self.local_of(slot)
            && let Err(e) = self.fnat.lock().release(local, backend)
        {
            tracing::warn!(%local, %backend, "fnat port release: {e}");
        }
    }
}

/// The forwarding method of a packet service.
pub(crate) fn method(forward: Forward) -> Option<Method> {
    match forward {
        Forward::Proxy => None,
        Forward::Nat => Some(Method::Nat),
        Forward::Fnat => Some(Method::Fnat),
        Forward::Dr => Some(Method::Dr),
    }
}

/// One packet service as a worker sees it.
#[derive(Debug, Clone)]
struct VipService {
    svc: Arc<Service>,
    method: Method,
    sloppy_tcp: bool,
}

/// (address, IP protocol, port): a VIP or a backend as packets carry it.
type Endpoint = (IpAddr, u8, u16);

/// A worker's snapshot of the packet services: by VIP:port, and the
/// nat/fnat backends by their address (their replies' source).
#[derive(Debug, Default)]
pub(crate) struct Vips {
    generation: u64,
    by_vip: HashMap<Endpoint, VipService>,
    by_backend: HashMap<Endpoint, Vec<(VipService, Arc<Backend>)>>,
}

impl Vips {
    fn build(shared: &Shared) -> Vips {
        // Read the generation first: a change after it is seen next time.
        let generation = shared
            .services_gen
            .load(std::sync::atomic::Ordering::Acquire);
        let mut v = Vips {
            generation,
            ..Vips::default()
        };
        let st = shared.state.read();
        for svc in st.services.values() {
            let spec = svc.spec.read();
            let Some(method) = method(spec.forward) else {
                continue;
            };
            let proto = ip_proto(spec.protocol);
            let vs = VipService {
                svc: svc.clone(),
                method,
                sloppy_tcp: spec.options.sloppy_tcp,
            };
            if method != Method::Dr {
                for b in svc.set.read().backends.iter() {
                    v.by_backend
                        .entry((b.addr.ip(), proto, b.addr.port()))
                        .or_default()
                        .push((vs.clone(), b.clone()));
                }
            }
            v.by_vip
                .insert((svc.listen.ip(), proto, svc.listen.port()), vs);
        }
        v
    }
}

fn ip_proto(p: crate::config::Protocol) -> u8 {
    match p {
        crate::config::Protocol::Tcp => 6,
        crate::config::Protocol::Udp => 17,
    }
}

fn table_proto(ip_proto: u8) -> Proto {
    if ip_proto == 6 {
        Proto::Tcp
    } else {
        Proto::Udp
    }
}

/// The flow-table state a new flow starts in, from its first packet.
fn first_state(pkt: &Packet, method: Method) -> FlowState {
    match pkt.tcp_flags() {
        None => FlowState::Udp,
        Some(flags) => weir_packet::tcp_state::next(
            TcpState::None,
            TcpDir::of(method, Direction::ToBackend),
            flags,
        )
        .to_flow_state()
        // An ACK-only first packet (sloppy_tcp) counts as established.
        .filter(|s| *s != FlowState::Close)
        .unwrap_or(FlowState::Established),
    }
}

/// One packet worker's data path.
pub(crate) struct Engine {
    shared: Arc<Shared>,
    path: Arc<PacketPath>,
    counters: Arc<Counters>,
    vips: Vips,
    hops: Box<dyn NextHops>,
    rng: weir_sched::SplitMix64,
    /// The interface frames arrive on (and leave by).
    ifindex: u32,
    csum: CsumMode,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("ifindex", &self.ifindex)
            .finish()
    }
}

/// A looked-up or new flow.
struct Flow {
    handle: Handle,
    backend: Arc<Backend>,
    /// fnat's local endpoint.
    local: Option<SocketAddr>,
    /// The client, for replies (the forward key's client side).
    client: SocketAddr,
}

impl Engine {
    pub(crate) fn new(
        shared: Arc<Shared>,
        path: Arc<PacketPath>,
        hops: Box<dyn NextHops>,
        ifindex: u32,
        seed: u64,
    ) -> Self {
        let counters = path.worker_counters();
        let vips = Vips::build(&shared);
        Self {
            shared,
            path,
            counters,
            vips,
            hops,
            rng: weir_sched::SplitMix64::new(seed),
            ifindex,
            csum: CsumMode::Full,
        }
    }

    /// Rebuild the service snapshot if services changed since.
    pub(crate) fn refresh(&mut self) {
        if self
            .shared
            .services_gen
            .load(std::sync::atomic::Ordering::Acquire)
            != self.vips.generation
        {
            self.vips = Vips::build(&self.shared);
        }
    }

    fn drop_(&self, why: Drop) -> Verdict {
        self.counters.dropped[why as usize].fetch_add(1, Relaxed);
        Verdict::Drop
    }

    /// One received frame: rewritten in place and [`Verdict::Transmit`], or
    /// counted and [`Verdict::Drop`].
    pub(crate) fn process(&mut self, frame: &mut [u8]) -> Verdict {
        self.counters.rx.fetch_add(1, Relaxed);
        let pkt = match weir_packet::parse(frame) {
            Ok(p) => p,
            Err(u) => {
                self.counters.unhandled[u.index()].fetch_add(1, Relaxed);
                return Verdict::Drop;
            }
        };
        let Some(t) = pkt.tuple() else {
            return self.drop_(Drop::Icmp);
        };
        let now = Millis(self.shared.now_ms());
        let len = (pkt.end - pkt.l3) as u64;
        let (vs, found, direction) =
            if let Some(vs) = self.vips.by_vip.get(&(t.dst.ip(), t.proto, t.dst.port())) {
                let vs = vs.clone();
                match self.forward_flow(&vs, &pkt, t.src, t.dst, now) {
                    Ok(f) => (vs, f, Direction::ToBackend),
                    Err(d) => return self.drop_(d),
                }
            } else if let Some(cands) =
                self.vips
                    .by_backend
                    .get(&(t.src.ip(), t.proto, t.src.port()))
            {
                match self.reply_flow(cands, t.proto, t.dst) {
                    Some((vs, f)) => (vs, f, Direction::ToClient),
                    None => return self.drop_(Drop::NoFlow),
                }
            } else {
                return self.drop_(Drop::NotOurs);
            };
        let dir = match direction {
            Direction::ToBackend => Dir::In,
            Direction::ToClient => Dir::Out,
        };
        self.shared.table.touch_handle(found.handle, now, dir, len);
        let stats = [
            &self.shared.stat,
            &vs.svc.tenant.stat,
            &vs.svc.stat,
            &found.backend.stat,
        ];
        for s in stats {
            match dir {
                Dir::In => s.add_in(len),
                Dir::Out => s.add_out(len),
            }
        }
        if let Some(flags) = pkt.tcp_flags() {
            self.advance(
                found.handle,
                &found.backend,
                vs.method,
                direction,
                flags,
                now,
            );
        }
        let mapping = NatMapping {
            client: found.client,
            vip: vs.svc.listen,
            backend: found.backend.addr,
            local: found.local,
        };
        let next = match direction {
            Direction::ToBackend => found.backend.addr.ip(),
            Direction::ToClient => found.client.ip(),
        };
        let Some((ifindex, hop)) = self.hops.next_hop(next) else {
            return self.drop_(Drop::NoNextHop);
        };
        if ifindex != self.ifindex {
            return self.drop_(Drop::OtherInterface);
        }
        match weir_packet::rewrite(frame, &pkt, vs.method, direction, &mapping, &hop, self.csum) {
            Ok(()) => {
                self.counters.tx.fetch_add(1, Relaxed);
                Verdict::Transmit
            }
            Err(weir_packet::RewriteError::TtlExpired) => self.drop_(Drop::TtlExpired),
            Err(_) => self.drop_(Drop::Rewrite),
        }
    }

    /// The flow of a client → VIP packet: found, or created for a first
    /// packet that may open one.
    fn forward_flow(
        &mut self,
        vs: &VipService,
        pkt: &Packet,
        client: SocketAddr,
        vip: SocketAddr,
        now: Millis,
    ) -> Result<Flow, Drop> {
        let svc = &vs.svc;
        let key = FlowKey {
            tenant: TenantId(svc.tenant.id),
            proto: table_proto(pkt.transport.proto()),
            client,
            virt: vip,
        };
        for _ in 0..2 {
            if let Some((handle, backend)) = self.shared.table.lookup(&key) {
                let b = svc.backend(backend.0).ok_or(Drop::BackendGone)?;
                let local = match vs.method {
                    Method::Fnat => {
                        let slot = self.shared.table.nat(handle).unwrap_or(0);
                        Some(self.path.local_of(slot).ok_or(Drop::NoFlow)?)
                    }
                    _ => None,
                };
                return Ok(Flow {
                    handle,
                    backend: b,
                    local,
                    client,
                });
            }
            match self.open(vs, pkt, key, now) {
                // Another worker inserted it first: look again.
                Err(None) => continue,
                Err(Some(d)) => return Err(d),
                Ok(f) => return Ok(f),
            }
        }
        Err(Drop::NoFlow)
    }

    /// A new flow. `Err(None)`: the key exists (a race with another worker).
    fn open(
        &mut self,
        vs: &VipService,
        pkt: &Packet,
        key: FlowKey,
        now: Millis,
    ) -> Result<Flow, Option<Drop>> {
        let svc = &vs.svc;
        if let Some(flags) = pkt.tcp_flags() {
            let syn =
                flags.has(weir_packet::TcpFlags::SYN) && !flags.has(weir_packet::TcpFlags::ACK);
            let rst = flags.has(weir_packet::TcpFlags::RST);
            if rst || (!syn && !vs.sloppy_tcp) {
                return Err(Some(Drop::NoFlow));
            }
        }
        let shared = &*self.shared;
        if let Err(why) = shared.admit(&svc.tenant) {
            shared.refuse(Some(&svc.tenant), why);
            return Err(Some(Drop::Refused));
        }
        let proto = match key.proto {
            Proto::Tcp => crate::config::Protocol::Tcp,
            Proto::Udp => crate::config::Protocol::Udp,
        };
        let backend = match svc.choose(shared, proto, key.client, key.virt.ip(), &[], &mut self.rng)
        {
            Ok(b) => b,
            Err(why) => {
                shared.release(&svc.tenant);
                shared.refuse(Some(&svc.tenant), why);
                return Err(Some(Drop::Refused));
            }
        };
        let local = if vs.method == Method::Fnat {
            match self.path.fnat.lock().allocate(backend.addr) {
                Ok(l) => Some(l),
                Err(_) => {
                    shared.release(&svc.tenant);
                    return Err(Some(Drop::FnatPorts));
                }
            }
        } else {
            None
        };
        let nat = local.map_or(0, |l| self.path.slot_of(l));
        let state = first_state(pkt, vs.method);
        let params = svc.params.read().clone();
        let init = FlowInit {
            service: ServiceId(svc.id),
            backend: BackendId(backend.id),
            state,
            owner: PACKET_OWNER,
            profile: params.profile,
        };
        let reply = match (vs.method, std::num::NonZeroU32::new(nat)) {
            (Method::Dr, _) => None,
            (Method::Nat, _) => Some(ReplyMode::Nat),
            (Method::Fnat, Some(slot)) => Some(ReplyMode::FullNat(slot)),
            // Cannot happen (`local` is one of ours), but never panic.
            (Method::Fnat, None) => {
                shared.release(&svc.tenant);
                return Err(Some(Drop::FnatPorts));
            }
        };
        let inserted = match reply {
            None => shared.table.insert_handle(key, init, now),
            Some(mode) => shared.table.insert_reply(key, init, mode, now),
        };
        let handle = match inserted {
            Ok(h) => h,
            Err(e) => {
                shared.release(&svc.tenant);
                if nat != 0 {
                    self.path.release_port(nat, backend.addr);
                }
                if matches!(e, weir_flowtable::InsertError::Exists(_)) {
                    return Err(None);
                }
                shared.refuse(Some(&svc.tenant), Refusal::TableFull);
                return Err(Some(Drop::Refused));
            }
        };
        if state == FlowState::Established {
            backend.active.fetch_add(1, Relaxed);
        } else {
            backend.inactive.fetch_add(1, Relaxed);
        }
        if !params.persistence.is_zero() {
            shared.hold_template(svc, &params, proto, key.client, backend.id);
        }
        self.counters.new_flows.fetch_add(1, Relaxed);
        shared.stat.conn();
        svc.tenant.stat.conn();
        svc.stat.conn();
        backend.stat.conn();
        Ok(Flow {
            handle,
            backend,
            local,
            client: key.client,
        })
    }

    /// The flow a backend's reply (to `dst`: the client for nat, weir's
    /// local endpoint for fnat) belongs to.
    fn reply_flow(
        &self,
        cands: &[(VipService, Arc<Backend>)],
        ip_proto: u8,
        dst: SocketAddr,
    ) -> Option<(VipService, Flow)> {
        for (vs, b) in cands {
            let reply_dst = match vs.method {
                Method::Nat => weir_flowtable::ReplyDst::Client(dst),
                Method::Fnat => {
                    let Some(slot) = std::num::NonZeroU32::new(self.path.slot_of(dst)) else {
                        continue;
                    };
                    weir_flowtable::ReplyDst::Nat(slot)
                }
                Method::Dr => continue,
            };
            let key = weir_flowtable::ReplyKey {
                tenant: TenantId(vs.svc.tenant.id),
                proto: table_proto(ip_proto),
                backend: BackendId(b.id),
                dst: reply_dst,
            };
            let Some(found) = self.shared.table.lookup_reply(&key) else {
                continue;
            };
            let handle = found.handle;
            let client = found.key.client;
            let local = (vs.method == Method::Fnat).then_some(dst);
            return Some((
                vs.clone(),
                Flow {
                    handle,
                    backend: b.clone(),
                    local,
                    client,
                },
            ));
        }
        None
    }

    /// Move a TCP flow along IPVS's state table, keeping its backend's
    /// active/inactive counts exact (the table's compare-and-swap decides
    /// which worker moves it).
    fn advance(
        &self,
        h: Handle,
        backend: &Backend,
        method: Method,
        direction: Direction,
        flags: weir_packet::TcpFlags,
        now: Millis,
    ) {
        let dir = TcpDir::of(method, direction);
        let moved = self.shared.table.transition_handle(h, now, |s| {
            let cur = TcpState::from_flow_state(s)?;
            let next = weir_packet::tcp_state::next(cur, dir, flags).to_flow_state()?;
            (next != s).then_some(next)
        });
        if let Some((from, to)) = moved {
            let was = from == FlowState::Established;
            let is = to == FlowState::Established;
            if was != is {
                if is {
                    backend.active.fetch_add(1, Relaxed);
                    backend.inactive.fetch_sub(1, Relaxed);
                } else {
                    backend.active.fetch_sub(1, Relaxed);
                    backend.inactive.fetch_add(1, Relaxed);
                }
            }
        }
    }
}

impl Shared {
    /// A packet flow's entry is gone (`snap`): give back its admission slot,
    /// its fnat port and its hold on the persistence template.
    pub(crate) fn settle_packet(
        &self,
        snap: &FlowSnapshot,
        svc: &Arc<Service>,
        b: Option<&Arc<Backend>>,
    ) {
        self.release(&svc.tenant);
        if let (Some(path), Some(b)) = (self.packet.get(), b)
            && snap.nat != 0
        {
            path.release_port(snap.nat, b.addr);
        }
        let params = svc.params.read().clone();
        if !params.persistence.is_zero() {
            let proto = match snap.key.proto {
                Proto::Tcp => crate::config::Protocol::Tcp,
                Proto::Udp => crate::config::Protocol::Udp,
            };
            let tpl = super::template_key(svc, &params, proto, snap.key.client);
            self.release_template(svc, tpl);
        }
    }
}

impl Shared {
    /// fnat's local endpoint of a packet flow, for listings.
    pub(crate) fn packet_local(&self, snap: &FlowSnapshot) -> Option<String> {
        if snap.owner != PACKET_OWNER || snap.nat == 0 {
            return None;
        }
        Some(self.packet.get()?.local_of(snap.nat)?.to_string())
    }
}

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
//!    services ([`Vips`], one for all workers, rebuilt once when
//!    [`Shared::services_gen`] moves);
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
    BackendId, Dir, FlowInit, FlowKey, FlowSnapshot, FlowState, Handle, Millis, Probe, Proto,
    ReplyMode, ServiceId, TenantId,
};
use weir_packet::{
    CsumMode, Direction, FnatPorts, Method, NatMapping, NextHop, Packet, TcpDir, TcpState,
    Unhandled,
};
use weir_packet_io::Batch;

use super::conns::Pressing;
use super::{Backend, Refusal, Service, Shared};
use crate::config::Forward;

/// The owner token of packet flows: the packet path owns them, no task
/// does. Every token with this bit set is one, with the flow's
/// [`PacketOwner`] below it; [`super::owners::Owners`] never hands such
/// a token out (its tokens stay below 2^24).
pub(crate) const PACKET_OWNER: u32 = 1 << 31;

/// What a packet flow took that its end gives back, kept in its owner
/// token (the entry is the flow: there is nowhere else to keep it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PacketOwner {
    /// Counted against its client's cap (`tcp_max_connections_per_client`
    /// / `udp_max_sessions_per_client` was set when it opened), so its end
    /// gives that place back — and a flow opened while the cap was 0 gives
    /// back nothing it did not take.
    pub(crate) counted: bool,
    /// Holds its persistence template ([`Shared::hold_template`]), so its
    /// end releases it — whatever the service's persistence is by then.
    pub(crate) held: bool,
    /// The held template's tag ([`super::model::HeldTemplate::tag`], 29 bits; 0
    /// if none is held): the end releases that template and no newer one
    /// stored under its key since.
    pub(crate) template: u32,
}

impl PacketOwner {
    pub(crate) fn token(self) -> u32 {
        debug_assert!(self.template < 1 << 29);
        PACKET_OWNER
            | (self.template & ((1 << 29) - 1)) << 2
            | u32::from(self.held) << 1
            | u32::from(self.counted)
    }

    /// The flags of a packet flow's owner token; `None` for a task's.
    pub(crate) fn of(owner: u32) -> Option<Self> {
        (owner & PACKET_OWNER != 0).then_some(Self {
            counted: owner & 1 != 0,
            held: owner & 2 != 0,
            template: (owner & !PACKET_OWNER) >> 2,
        })
    }
}

/// Whether an entry's owner is the packet path (no task to tell).
pub(crate) fn is_packet_owner(owner: u32) -> bool {
    PacketOwner::of(owner).is_some()
}

/// What the engine did with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Rewritten; send it out of the interface it came in on.
    Transmit,
    /// Rewritten; send it out of interface `.0` (another of this worker's).
    Egress(u32),
    /// Answered: the frame now holds an ICMP error to its sender, `.0`
    /// bytes long; send it back out of the interface it came in on.
    Answer(usize),
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
    /// fnat: the service's tenant holds its share of the backend's local
    /// ports (each tenant with fnat services on a backend may hold the
    /// range over their number; other tenants' shares are left to them).
    FnatShare,
    /// The kernel has no route or no resolved neighbour for the next hop.
    NoNextHop,
    /// The next hop is out of an interface this worker has no socket on
    /// (not one of `[packet] interfaces`, or AF_PACKET, which transmits
    /// only where it receives).
    OtherInterface,
    /// The other interface's socket had no room for the frame's copy.
    EgressFull,
    /// TTL / hop limit would reach 0.
    TtlExpired,
    /// ICMP messages other than errors about a flow (echo, redirects,
    /// neighbour discovery...): weir answers none of them.
    Icmp,
    /// An ICMP error whose quoted packet is truncated or malformed, or
    /// that is not addressed to the quoted packet's source.
    IcmpMalformed,
    /// A rewrite refused the frame (inconsistent lengths).
    Rewrite,
    /// Larger than the next hop's MTU: answered with ICMP "fragmentation
    /// needed" (IPv4 with DF) or "packet too big" (IPv6), as a router
    /// would; an IPv4 packet without DF is dropped (weir does not fragment).
    TooBig,
    /// A first packet while the daemon drains (no new flows; the live ones
    /// go on until they end or the drain timeout).
    Draining,
    /// Too big, and not answered: the worker's budget for the ICMP errors
    /// it sends ([`IcmpBudget`]) is spent for now.
    IcmpLimited,
    /// From (or, in an ICMP error, quoting a packet from) source port 0:
    /// no client's (TCP and UDP reserve it), and its flow key would be its
    /// client group's persistence template's, `(group, 0)`.
    ZeroPort,
    /// nat: a first packet to a backend address that already has a flow
    /// of another service (of any tenant) from the same client address and
    /// port. The backend would see both as one connection, and weir could
    /// not tell their replies apart: the second is refused.
    ReplyTaken,
    /// A first packet from one of weir's own addresses (a packet
    /// service's VIP, an fnat local address): no client sends from them,
    /// so it is forged, and the backend would answer weir's address.
    Martian,
    /// From a nat or fnat backend's address and port (a reply, or an ICMP
    /// error about a packet sent to a backend) on an interface that is not
    /// one of `[packet] backend_interfaces`: forged on the client side.
    ReplyInterface,
    /// Rewritten to be sent, and not sent: the socket's tx ring (AF_XDP)
    /// or the device's queue (AF_PACKET) was full, or the device refused
    /// the frame (larger than its MTU...).
    TxFull,
}

impl Drop {
    pub(crate) const ALL: [Drop; 21] = [
        Drop::NotOurs,
        Drop::NoFlow,
        Drop::Refused,
        Drop::BackendGone,
        Drop::FnatPorts,
        Drop::FnatShare,
        Drop::NoNextHop,
        Drop::OtherInterface,
        Drop::EgressFull,
        Drop::TtlExpired,
        Drop::Icmp,
        Drop::IcmpMalformed,
        Drop::Rewrite,
        Drop::TooBig,
        Drop::Draining,
        Drop::IcmpLimited,
        Drop::ZeroPort,
        Drop::ReplyTaken,
        Drop::Martian,
        Drop::ReplyInterface,
        Drop::TxFull,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Drop::NotOurs => "not_ours",
            Drop::NoFlow => "no_flow",
            Drop::Refused => "refused",
            Drop::BackendGone => "backend_gone",
            Drop::FnatPorts => "fnat_ports_exhausted",
            Drop::FnatShare => "fnat_ports_share",
            Drop::NoNextHop => "no_next_hop",
            Drop::OtherInterface => "other_interface",
            Drop::EgressFull => "egress_full",
            Drop::TtlExpired => "ttl_expired",
            Drop::Icmp => "icmp",
            Drop::IcmpMalformed => "icmp_malformed",
            Drop::Rewrite => "rewrite",
            Drop::TooBig => "too_big",
            Drop::Draining => "draining",
            Drop::IcmpLimited => "icmp_limited",
            Drop::ZeroPort => "zero_port",
            Drop::ReplyTaken => "reply_taken",
            Drop::Martian => "martian",
            Drop::ReplyInterface => "reply_interface",
            Drop::TxFull => "tx_full",
        }
    }
}

/// The ICMP errors a worker sends (`too_big` answers): a token bucket of
/// [`IcmpBudget::PER_SEC`] a second and bursts of [`IcmpBudget::BURST`],
/// Linux's defaults for the same job (`net.ipv4.icmp_msgs_per_sec`,
/// `icmp_msgs_burst`). Each answer is smaller than the packet it answers,
/// but a peer sending oversized packets on its flow at line rate would
/// otherwise have weir spend a rewrite and a transmit on every one.
#[derive(Debug)]
pub(crate) struct IcmpBudget {
    tokens: u64,
    /// When the tokens were last topped up (ms on the daemon's clock).
    at: u64,
}

impl IcmpBudget {
    pub(crate) const PER_SEC: u64 = 1_000;
    pub(crate) const BURST: u64 = 50;

    fn new() -> Self {
        Self {
            tokens: Self::BURST,
            at: 0,
        }
    }

    /// Takes a token if there is one at `now` (ms).
    fn take(&mut self, now: u64) -> bool {
        let earned = now.saturating_sub(self.at).saturating_mul(Self::PER_SEC) / 1_000;
        if earned > 0 {
            self.tokens = (self.tokens + earned).min(Self::BURST);
            self.at = now;
        }
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }
}

/// One worker's counters (only that worker writes them, so no two cores
/// share their lines); the daemon sums them for `weir stats`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// The worker's name (its thread's: `weir-pkt-q0` serves queue 0 of
    /// every AF_XDP interface, `weir-pkt-eth0-1` an AF_PACKET socket), so
    /// an operator can tell which queue drops.
    pub(crate) worker: String,
    pub(crate) rx: AtomicU64,
    pub(crate) tx: AtomicU64,
    pub(crate) new_flows: AtomicU64,
    /// ICMP errors translated and forwarded.
    pub(crate) icmp_errors: AtomicU64,
    /// RSTs that changed no state (see [`Engine::seq_allows`]).
    pub(crate) rst_ignored: AtomicU64,
    /// FINs that changed no state, for the same reason.
    pub(crate) fin_ignored: AtomicU64,
    /// Other segments that neither restarted their flow's idle timer nor
    /// moved its state, for the same reason.
    pub(crate) seq_ignored: AtomicU64,
    /// Embryonic flows (SYN_RECV) ended to make room for a new SYN
    /// ([`Engine::early_drop`]).
    pub(crate) early_drops: AtomicU64,
    pub(crate) unhandled: [AtomicU64; Unhandled::COUNT],
    pub(crate) dropped: [AtomicU64; Drop::ALL.len()],
    /// What the kernel dropped for this worker's sockets before weir saw
    /// the frames (cumulative, stored by the worker from the sockets'
    /// statistics; [`KERNEL_DROPS`] names them).
    pub(crate) kernel: [AtomicU64; KERNEL_DROPS.len()],
    /// Reply-key lookups made for frames from a backend's address, one at
    /// a time (what a spoofed reply costs the worker).
    #[cfg(test)]
    pub(crate) reply_lookups: AtomicU64,
    /// Looks [`Engine::early_drop`] made in the flow table.
    #[cfg(test)]
    pub(crate) early_drop_looks: AtomicU64,
}

/// The `dropped` names of [`Counters::kernel`], in its order: frames lost
/// in the kernel because the socket's receive ring was full (weir did not
/// keep up), for want of a free frame to receive into, descriptors the
/// kernel refused as invalid, and descriptors handed to weir that lie
/// outside its UMEM (dropped unread).
pub(crate) const KERNEL_DROPS: [&str; 4] = [
    "kernel_rx_ring_full",
    "kernel_rx_no_frame",
    "kernel_invalid_descs",
    "kernel_bad_descs",
];

impl Counters {
    /// This worker's figures; drop reasons with a count of 0 are left out.
    fn read(&self) -> crate::control::PacketWorkerStats {
        let mut dropped = std::collections::BTreeMap::new();
        let named = KERNEL_DROPS
            .into_iter()
            .zip(&self.kernel)
            .chain(Unhandled::NAMES.into_iter().zip(&self.unhandled))
            .chain(Drop::ALL.iter().map(|d| d.name()).zip(&self.dropped));
        for (name, n) in named {
            let n = n.load(Relaxed);
            if n > 0 {
                dropped.insert(name.to_owned(), n);
            }
        }
        crate::control::PacketWorkerStats {
            worker: self.worker.clone(),
            counts: crate::control::PacketCounters {
                rx: self.rx.load(Relaxed),
                tx: self.tx.load(Relaxed),
                new_flows: self.new_flows.load(Relaxed),
                icmp_errors: self.icmp_errors.load(Relaxed),
                rst_ignored: self.rst_ignored.load(Relaxed),
                fin_ignored: self.fin_ignored.load(Relaxed),
                seq_ignored: self.seq_ignored.load(Relaxed),
                early_drops: self.early_drops.load(Relaxed),
                dropped,
            },
        }
    }

    /// Publishes the worker's sockets' kernel drop counts (their sums).
    pub(crate) fn set_kernel_drops(&self, d: weir_packet_io::KernelDrops) {
        let v = [d.rx_ring_full, d.rx_no_frame, d.invalid_descs, d.bad_descs];
        for (c, v) in self.kernel.iter().zip(v) {
            c.store(v, Relaxed);
        }
    }
}

/// Where packets of a rewritten flow go next: the kernel's route and
/// neighbour for `dst`, as the interface index to send from and the MACs.
pub(crate) trait NextHops: Send {
    /// The next hop towards `dst`, or `None` while the kernel has no route
    /// or no resolved neighbour (the frame is dropped and counted).
    fn next_hop(&mut self, dst: IpAddr) -> Option<(u32, NextHop)>;

    /// The host's interfaces now (asked about once a second).
    fn links(&mut self) -> Vec<Link> {
        Vec::new()
    }
}

/// One of the host's interfaces, as the packet path needs it: a router's
/// MTU check and the address its ICMP errors come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Link {
    pub(crate) ifindex: u32,
    pub(crate) mtu: u32,
    pub(crate) v4: Option<std::net::Ipv4Addr>,
    pub(crate) v6: Option<std::net::Ipv6Addr>,
}

/// How often a worker asks [`NextHops::links`] again.
const LINKS_EVERY_MS: u64 = 1000;

/// fnat's ports, and the address of every backend with ports out (a flow
/// that outlives its backend in the service still gives its port back),
/// with its tenant (whose share of the pool the ports count in), the
/// backend's id held (no other backend gets it meanwhile) and its ports
/// out: it leaves with the last one, as its pool does once the backend is
/// gone (else both grew with every backend ever used).
#[derive(Debug)]
struct Fnat {
    ports: FnatPorts,
    backends: HashMap<u32, (SocketAddr, u32, Arc<super::model::IdLease>, u64)>,
}

/// The packet path's shared part: fnat ports, every worker's counters.
#[derive(Debug)]
pub(crate) struct PacketPath {
    /// `[packet] local_addresses`, in order: a flow's NAT slot names one by
    /// its index.
    locals: Vec<IpAddr>,
    fnat: Mutex<Fnat>,
    counters: Mutex<Vec<Arc<Counters>>>,
    /// "xdp", "afpacket" (or "xdp+afpacket" across interfaces): what
    /// `io` chose, once the interfaces are attached.
    pub(crate) io: std::sync::OnceLock<String>,
    /// The packet services' snapshot every worker reads ([`Vips`]): built
    /// once per change of the services, by whoever asks first
    /// ([`Self::vips`]; the control side right after a change, once the
    /// workers run), under `vips_build`.
    ///
    /// Why shared: each worker used to build its own after every change
    /// (of any service, proxy ones too), a walk of every service and
    /// backend on the packet path itself: ~10-20 ms per worker at 100,000
    /// services, long enough for a receive ring to overflow.
    vips: arc_swap::ArcSwap<Vips>,
    vips_build: Mutex<()>,
}

impl PacketPath {
    pub(crate) fn new(
        locals: Vec<IpAddr>,
        ports: std::ops::RangeInclusive<u16>,
        seed: u64,
    ) -> anyhow::Result<Self> {
        let fnat = FnatPorts::new(locals.clone(), ports, seed)
            .map_err(|e| anyhow::anyhow!("[packet] fnat_ports: {e}"))?;
        Ok(Self {
            locals,
            fnat: Mutex::new(Fnat {
                ports: fnat,
                backends: HashMap::new(),
            }),
            counters: Mutex::new(Vec::new()),
            io: std::sync::OnceLock::new(),
            vips: arc_swap::ArcSwap::from_pointee(Vips::default()),
            vips_build: Mutex::new(()),
        })
    }

    /// The services' snapshot of the current [`Shared::services_gen`]:
    /// the one built already, or built now (once, whoever asks).
    pub(crate) fn vips(&self, shared: &Shared) -> Arc<Vips> {
        let _one = self.vips_build.lock();
        // Read the generation first: a change after it is seen next time.
        let generation = shared
            .model
            .services_gen
            .load(std::sync::atomic::Ordering::Acquire);
        let cur = self.vips.load_full();
        if cur.generation == generation {
            return cur;
        }
        let v = Arc::new(Vips::build(shared, generation, &self.locals));
        self.vips.store(v.clone());
        // The fnat backends as of this change, with the number of tenants
        // sharing each one's pools: the pools of the others go with their
        // last port.
        let mut tenants: HashMap<SocketAddr, std::collections::HashSet<u32>> = HashMap::new();
        for vs in v.by_vip.values().filter(|vs| vs.method == Method::Fnat) {
            for (_, b) in vs.backends.0.iter() {
                tenants.entry(b.addr).or_default().insert(vs.svc.tenant.id);
            }
        }
        let fnat = tenants
            .into_iter()
            .map(|(b, t)| (b, t.len() as u32))
            .collect();
        self.fnat.lock().ports.retain_backends(fnat);
        v
    }

    /// Counters for one more worker, named `worker` (see [`Counters::worker`]).
    pub(crate) fn worker_counters(&self, worker: &str) -> Arc<Counters> {
        let c = Arc::new(Counters {
            worker: worker.to_owned(),
            ..Counters::default()
        });
        self.counters.lock().push(c.clone());
        c
    }

    /// Every worker's figures, and their sums.
    pub(crate) fn sums(&self) -> crate::control::PacketStats {
        let mut s = crate::control::PacketStats {
            io: self.io.get().cloned().unwrap_or_else(|| "none".into()),
            ..Default::default()
        };
        for c in self.counters.lock().iter() {
            let w = c.read();
            s.counts.add(&w.counts);
            s.workers.push(w);
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

    /// A local port for a new flow of `tenant` to `backend`.
    fn take_port(
        &self,
        backend: &Backend,
        tenant: u32,
    ) -> Result<SocketAddr, weir_packet::alloc::PortError> {
        let mut f = self.fnat.lock();
        let local = f.ports.allocate(backend.addr, tenant)?;
        f.backends
            .entry(backend.id)
            .or_insert_with(|| (backend.addr, tenant, backend.lease.clone(), 0))
            .3 += 1;
        Ok(local)
    }

    /// A flow to backend `id` ended: its fnat port is free again.
    pub(crate) fn release_port(&self, slot: u32, backend: u32) {
        let Some(local) = self.local_of(slot) else {
            return;
        };
        let mut f = self.fnat.lock();
        let Some(&(addr, tenant, _, _)) = f.backends.get(&backend) else {
            tracing::warn!(%local, backend, "fnat port release: unknown backend");
            return;
        };
        if let Err(e) = f.ports.release(local, addr, tenant) {
            tracing::warn!(%local, backend = %addr, "fnat port release: {e}");
            return;
        }
        if let std::collections::hash_map::Entry::Occupied(mut e) = f.backends.entry(backend) {
            e.get_mut().3 -= 1;
            if e.get().3 == 0 {
                e.remove();
            }
        }
    }

    /// fnat port pools, and backend ids with ports out.
    #[cfg(test)]
    fn fnat_sizes(&self) -> (usize, usize) {
        let f = self.fnat.lock();
        (f.ports.pools(), f.backends.len())
    }

    #[cfg(test)]
    fn port_is_live(&self, local: SocketAddr, backend: SocketAddr) -> bool {
        self.fnat.lock().ports.is_live(local, backend)
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
    /// The service's backends when the snapshot was taken (a change of the
    /// set moves [`Shared::services_gen`]): found by id without a lock.
    backends: BackendsById,
}

impl VipService {
    fn backend(&self, id: BackendId) -> Option<&Arc<Backend>> {
        self.backends.get(id.0)
    }
}

/// A service's backends by flow-table id, looked up for every client → VIP
/// packet: sorted by id, so a lookup is a binary search over the ids kept
/// beside the backends. The linear search it replaced cost O(backends) per
/// packet and touched each backend (~3 µs at 10,000); this is as fast as
/// that for a few backends, where a hash map is slower, and ~20 ns at
/// 10,000.
#[derive(Debug, Clone)]
struct BackendsById(Arc<[(u32, Arc<Backend>)]>);

impl BackendsById {
    fn new(backends: &[Arc<Backend>]) -> Self {
        let mut v: Vec<_> = backends.iter().map(|b| (b.id, b.clone())).collect();
        // Stable, and keeping the first of equal ids: what a linear search
        // would find (ids are unique, so this never drops one anyway).
        v.sort_by_key(|(id, _)| *id);
        v.dedup_by_key(|(id, _)| *id);
        Self(v.into())
    }

    fn get(&self, id: u32) -> Option<&Arc<Backend>> {
        let i = self.0.binary_search_by_key(&id, |(id, _)| *id).ok()?;
        Some(&self.0[i].1)
    }
}

/// (address, IP protocol, port): a VIP or a backend as packets carry it.
type Endpoint = (IpAddr, u8, u16);

/// The snapshot's maps, looked up per packet: keyed from the config (no
/// peer chooses their keys), so a fast hash rather than SipHash.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The nat/fnat services of one tenant with a backend at one address:
/// their backends there have one id ([`super::model::BackendIds`]), so a
/// reply from the address is one reply-key lookup for the tenant, however
/// many of its services share the backend.
#[derive(Debug)]
struct ReplyGroup {
    tenant: TenantId,
    backend: BackendId,
    /// Whether a nat service, an fnat service is among them (a reply to one
    /// of weir's local addresses is an fnat flow's, else a nat flow's:
    /// no nat flow's client is one of weir's addresses).
    nat: bool,
    fnat: bool,
    /// The services, by VIP:port (sorted), each with its backend at the
    /// address: a found flow's key names its VIP.
    services: Vec<(SocketAddr, VipService, Arc<Backend>)>,
}

impl ReplyGroup {
    /// The service (and its backend) of a flow this group's reply key
    /// found: one compare when the tenant has one service at the address,
    /// a binary search over them else.
    fn of(&self, found: &weir_flowtable::Found) -> Option<(&VipService, &Arc<Backend>)> {
        let i = self
            .services
            .binary_search_by_key(&found.key.virt, |(vip, _, _)| *vip)
            .ok()?;
        let (_, vs, b) = &self.services[i];
        Some((vs, b))
    }
}

/// A worker's snapshot of the packet services: by VIP:port, and the
/// nat/fnat backends by their address (their replies' source), one group
/// per tenant there.
#[derive(Debug, Default)]
pub(crate) struct Vips {
    generation: u64,
    by_vip: FastMap<Endpoint, VipService>,
    by_backend: FastMap<Endpoint, Vec<Arc<ReplyGroup>>>,
    /// weir's own addresses: the packet services' VIPs and the fnat local
    /// addresses. No client's first packet comes from one.
    own: std::collections::HashSet<IpAddr, foldhash::fast::RandomState>,
    /// The tenants with packet services, once each: where a flow refused
    /// at the daemon's limit may take a place from
    /// ([`Pressing`]).
    tenants: Vec<Arc<super::Tenant>>,
}

impl Vips {
    /// The snapshot of `shared`'s services, as of `generation` of
    /// [`Shared::services_gen`] or later (read the generation first);
    /// `locals` are the fnat local addresses.
    fn build(shared: &Shared, generation: u64, locals: &[IpAddr]) -> Vips {
        let mut v = Vips {
            generation,
            ..Vips::default()
        };
        let st = shared.model.load();
        let mut groups: FastMap<Endpoint, Vec<ReplyGroup>> = FastMap::default();
        for svc in st.services.values() {
            let spec = svc.spec.read();
            let Some(method) = method(spec.forward) else {
                continue;
            };
            let proto = ip_proto(spec.protocol);
            let set = svc.set.load();
            let backends = &set.backends;
            let vs = VipService {
                svc: svc.clone(),
                method,
                sloppy_tcp: spec.options.sloppy_tcp,
                backends: BackendsById::new(backends),
            };
            if method != Method::Dr {
                for b in backends.iter() {
                    let groups = groups
                        .entry((b.addr.ip(), proto, b.addr.port()))
                        .or_default();
                    // One group per tenant at the address (a tenant's
                    // backends there have one id): as many as tenants.
                    let i = match groups.iter().position(|g| g.backend.0 == b.id) {
                        Some(i) => i,
                        None => {
                            groups.push(ReplyGroup {
                                tenant: TenantId(svc.tenant.id),
                                backend: BackendId(b.id),
                                nat: false,
                                fnat: false,
                                services: Vec::new(),
                            });
                            groups.len() - 1
                        }
                    };
                    let g = &mut groups[i];
                    g.nat |= method == Method::Nat;
                    g.fnat |= method == Method::Fnat;
                    g.services.push((svc.listen, vs.clone(), b.clone()));
                }
            }
            v.by_vip
                .insert((svc.listen.ip(), proto, svc.listen.port()), vs);
            v.own.insert(svc.listen.ip());
            if !v.tenants.iter().any(|t| t.id == svc.tenant.id) {
                v.tenants.push(svc.tenant.clone());
            }
        }
        v.by_backend = groups
            .into_iter()
            .map(|(ep, gs)| {
                let gs = gs
                    .into_iter()
                    .map(|mut g| {
                        g.services.sort_unstable_by_key(|(vip, _, _)| *vip);
                        Arc::new(g)
                    })
                    .collect();
                (ep, gs)
            })
            .collect();
        v.own.extend(locals.iter().copied());
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

/// A packet flow that never got going, which a new flow at a limit may
/// take the place of ([`Engine::early_drop`]): TCP in SYN_RECV; or any
/// flow with a single packet from its client so far, or (nat and fnat,
/// indexed by their reply key, so weir sees their replies) with no packet
/// from its backend yet.
///
/// The single packet is conntrack's rule for what it may drop early (an
/// entry is assured only once it has seen both ways, and UDP only once it
/// is a stream). A spoofed UDP query holds its place for the UDP timeout
/// (300 s by default) whether or not its backend answered (a DNS server
/// answers anything), and a DNS-style exchange that has had its answer
/// loses nothing when its entry goes. A TCP flow past SYN_RECV with one
/// packet is a `sloppy_tcp` pick-up (its first packet was not a SYN): a
/// spoofed ACK would otherwise hold an ESTABLISHED place for 900 s. A
/// flow with two packets or more from its client, and that heard back
/// where weir can tell, is kept.
fn never_heard_back(c: weir_flowtable::Candidate) -> bool {
    is_packet_owner(c.owner)
        && match c.state {
            FlowState::Persist => false,
            FlowState::SynRecv => true,
            _ => c.packets_in <= 1 || (c.reply && c.packets_out == 0),
        }
}

/// One packet worker's data path.
pub(crate) struct Engine {
    shared: Arc<Shared>,
    path: Arc<PacketPath>,
    counters: Arc<Counters>,
    vips: Arc<Vips>,
    hops: Box<dyn NextHops>,
    rng: weir_sched::SplitMix64,
    /// The interface of the frame being processed.
    rx_ifindex: u32,
    /// `[packet] backend_interfaces`' indexes (empty: any interface).
    reply_ifindexes: Vec<u32>,
    /// Whether frames from backends are taken on `rx_ifindex`.
    rx_takes_replies: bool,
    /// The interfaces this worker can transmit on (it has a socket there).
    egress: Vec<u32>,
    /// The interfaces' MTUs and addresses, and when they were read (ms).
    links: Vec<Link>,
    links_at: Option<u64>,
    /// What is left of this worker's budget for the ICMP errors it sends.
    icmp_budget: IcmpBudget,
    /// Per-batch scratch, kept to allocate nothing per batch (the parsed
    /// frames borrow the batch's services snapshot: a vector per batch).
    probes: Vec<Probe>,
    found: Vec<Option<weir_flowtable::Found>>,
    /// Whose place a new flow at the daemon's limit takes
    /// ([`Engine::early_drop`]); in a cell, as the look takes the places
    /// through `&self`.
    pressing: std::cell::RefCell<Pressing>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("egress", &self.egress)
            .finish()
    }
}

/// The service a frame's probe matched: by its VIP:port, or as a reply
/// from one of its backends. Borrowed from the worker's services snapshot
/// ([`Vips`]), as every service and backend a packet's path names is: a
/// clone of their `Arc`s was a read-modify-write of a counter every worker
/// shares, per packet.
#[derive(Debug)]
enum Matched<'v> {
    Vip(&'v VipService),
    Reply(&'v ReplyGroup),
}

/// A looked-up or new flow.
struct Flow<'v> {
    handle: Handle,
    /// From the snapshot; owned only for a flow just opened (its backend
    /// as the scheduler chose it).
    backend: std::borrow::Cow<'v, Arc<Backend>>,
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
        egress: Vec<u32>,
        seed: u64,
        name: &str,
    ) -> Self {
        let counters = path.worker_counters(name);
        let vips = path.vips(&shared);
        Self {
            shared,
            path,
            counters,
            vips,
            hops,
            rng: weir_sched::SplitMix64::new(seed),
            rx_ifindex: egress.first().copied().unwrap_or(0),
            reply_ifindexes: Vec::new(),
            rx_takes_replies: true,
            egress,
            links: Vec::new(),
            links_at: None,
            icmp_budget: IcmpBudget::new(),
            probes: Vec::new(),
            found: Vec::new(),
            pressing: Default::default(),
        }
    }

    /// Takes backends' replies only from these interfaces
    /// (`[packet] backend_interfaces`; empty: from any).
    pub(crate) fn with_reply_interfaces(mut self, ifindexes: Vec<u32>) -> Self {
        self.reply_ifindexes = ifindexes;
        self.receive_on(self.rx_ifindex);
        self
    }

    /// The frames that follow arrived on `ifindex`.
    pub(crate) fn receive_on(&mut self, ifindex: u32) {
        self.rx_ifindex = ifindex;
        self.rx_takes_replies =
            self.reply_ifindexes.is_empty() || self.reply_ifindexes.contains(&ifindex);
    }

    /// This worker's counters.
    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Rebuild the service snapshot if services changed since.
    pub(crate) fn refresh(&mut self) {
        if self
            .shared
            .model
            .services_gen
            .load(std::sync::atomic::Ordering::Acquire)
            != self.vips.generation
        {
            self.vips = self.path.vips(&self.shared);
        }
    }

    /// Read the interfaces again if the last read is a second old.
    fn refresh_links(&mut self, now: Millis) {
        if self
            .links_at
            .is_none_or(|t| now.0.saturating_sub(t) >= LINKS_EVERY_MS)
        {
            self.links = self.hops.links();
            self.links_at = Some(now.0);
        }
    }

    /// `n` frames this worker counted as sent that its socket did not send
    /// (the I/O's `tx_full`): dropped after all. (A lost ICMP answer was
    /// never counted in `tx`: `tx` stays at 0 rather than wrapping.)
    pub(crate) fn unsent(&self, n: usize) {
        if n == 0 {
            return;
        }
        let n = n as u64;
        let _ = self
            .counters
            .tx
            .fetch_update(Relaxed, Relaxed, |tx| Some(tx.saturating_sub(n)));
        self.counters.dropped[Drop::TxFull as usize].fetch_add(n, Relaxed);
    }

    fn drop_(&self, why: Drop) -> Verdict {
        self.counters.dropped[why as usize].fetch_add(1, Relaxed);
        Verdict::Drop
    }

    /// One received frame: rewritten in place and [`Verdict::Transmit`], or
    /// counted and [`Verdict::Drop`].
    #[cfg(test)]
    pub(crate) fn process(&mut self, frame: &mut [u8]) -> Verdict {
        let now = Millis(self.shared.now_ms());
        self.process_at(frame, now)
    }

    /// [`Self::process`] at `now` on the daemon's clock.
    #[cfg(test)]
    pub(crate) fn process_at(&mut self, frame: &mut [u8], now: Millis) -> Verdict {
        self.counters.rx.fetch_add(1, Relaxed);
        let pkt = match weir_packet::parse(frame) {
            Ok(p) => p,
            Err(u) => {
                self.counters.unhandled[u.index()].fetch_add(1, Relaxed);
                return Verdict::Drop;
            }
        };
        self.refresh_links(now);
        let vips = Arc::clone(&self.vips);
        self.process_parsed(&vips, frame, &pkt, None, CsumMode::Full, now)
    }

    /// One ring poll's frames: parse them all, look every flow up in one
    /// batched lookup (hashes computed and lines prefetched before any is
    /// probed), then finish each frame in order. A frame the batch did not
    /// find (a first packet, or one whose flow an earlier frame of the same
    /// batch created) takes the one-at-a-time path.
    ///
    /// `rx_ifindex` is the interface the batch came from; a frame whose next
    /// hop is out of another interface of this worker is handed to `egress`
    /// (which copies it into that interface's socket, or says it cannot).
    pub(crate) fn process_batch(
        &mut self,
        batch: &mut Batch<'_>,
        rx_ifindex: u32,
        egress: &mut dyn FnMut(u32, &[u8]) -> bool,
    ) {
        self.receive_on(rx_ifindex);
        // The worker refreshed before it waited for this batch: services
        // may have changed meanwhile (one atomic load when they have not).
        self.refresh();
        let n = batch.len();
        let now = Millis(self.shared.now_ms());
        self.refresh_links(now);
        self.counters.rx.fetch_add(n as u64, Relaxed);
        // This batch's services: one clone of the snapshot's `Arc` per
        // batch, and every packet borrows from it.
        let vips = Arc::clone(&self.vips);
        let mut parsed = Vec::with_capacity(n);
        let mut probes = std::mem::take(&mut self.probes);
        let mut found = std::mem::take(&mut self.found);
        probes.clear();
        for i in 0..n {
            let p = weir_packet::parse(batch.frame(i));
            let probe = p.as_ref().ok().and_then(|p| self.probe(&vips, p));
            let matched = probe.map(|(pr, m)| {
                probes.push(pr);
                m
            });
            parsed.push((p, matched));
        }
        // One epoch pin for the whole batch, not only its lookup: the
        // touches, sequence checks and state moves below pin again inside
        // the table, and a pin nested in a live one is a counter bump where
        // an outermost one is a SeqCst read-modify-write (two or three per
        // TCP packet otherwise; measured on the AMD host: 4.8 ns against
        // 3.1 ns a pin, so a few ns a packet: small, but free to take).
        let shared = Arc::clone(&self.shared);
        let reader = shared.conns.table.reader();
        reader.lookup_probes(&probes, &mut found);
        let mut k = 0;
        for (i, (p, matched)) in parsed.iter_mut().enumerate() {
            let v = match p {
                Err(u) => {
                    self.counters.unhandled[u.index()].fetch_add(1, Relaxed);
                    Verdict::Drop
                }
                Ok(pkt) => {
                    let hint = matched.take().and_then(|m| {
                        k += 1;
                        Some((m, found.get(k - 1).copied().flatten()?))
                    });
                    let mode = if batch.csum_partial(i) {
                        CsumMode::Partial
                    } else {
                        CsumMode::Full
                    };
                    self.process_parsed(&vips, batch.frame_mut(i), pkt, hint, mode, now)
                }
            };
            let v = match v {
                Verdict::Transmit => weir_packet_io::Verdict::Transmit,
                Verdict::Answer(len) => {
                    batch.truncate(i, len);
                    weir_packet_io::Verdict::Transmit
                }
                Verdict::Drop => weir_packet_io::Verdict::Drop,
                Verdict::Egress(ix) => {
                    // Copied into the other interface's socket; this
                    // frame's own slot goes back to its ring.
                    if !egress(ix, batch.frame(i)) {
                        self.counters.tx.fetch_sub(1, Relaxed);
                        self.drop_(Drop::EgressFull);
                    }
                    weir_packet_io::Verdict::Drop
                }
            };
            batch.set_verdict(i, v);
        }
        drop(reader);
        self.probes = probes;
        self.found = found;
    }

    /// The batched lookup's key for a TCP/UDP packet of ours: the forward
    /// key to a VIP, or the reply key of the first tenant whose services
    /// the source backend serves (a reply of another tenant's flow misses
    /// and takes [`Self::find`], one lookup per tenant).
    fn probe<'v>(&self, vips: &'v Vips, pkt: &Packet) -> Option<(Probe, Matched<'v>)> {
        let t = pkt.tuple()?;
        if let Some(vs) = vips.by_vip.get(&(t.dst.ip(), t.proto, t.dst.port())) {
            let key = FlowKey {
                tenant: TenantId(vs.svc.tenant.id),
                proto: table_proto(t.proto),
                client: t.src,
                virt: t.dst,
            };
            return Some((Probe::Flow(key), Matched::Vip(vs)));
        }
        // Not on a backend interface: left to `find`, which counts it.
        if !self.rx_takes_replies {
            return None;
        }
        let g = vips
            .by_backend
            .get(&(t.src.ip(), t.proto, t.src.port()))?
            .first()?;
        let key = self.group_reply_key(g, t.proto, t.dst)?;
        Some((Probe::Reply(key), Matched::Reply(g)))
    }

    /// A parsed frame, with what the batched lookup found for it if it did.
    fn process_parsed(
        &mut self,
        vips: &Vips,
        frame: &mut [u8],
        pkt: &Packet,
        hint: Option<(Matched<'_>, weir_flowtable::Found)>,
        mode: CsumMode,
        now: Millis,
    ) -> Verdict {
        let Some(t) = pkt.tuple() else {
            return self.icmp(vips, frame, pkt, now);
        };
        let looked = match hint {
            Some((m, h)) => self.hinted(&t, m, h),
            None => self.find(vips, &t, Some(pkt), now),
        };
        let (vs, found, direction) = match looked {
            Ok(f) => f,
            Err(d) => return self.drop_(d),
        };
        let (mapping, hop, out) = match self.route(vs, &found, direction) {
            Ok(r) => r,
            Err(d) => return self.drop_(d),
        };
        if let Some(v) = self.too_big(frame, pkt, out, now) {
            return v;
        }
        let r = weir_packet::rewrite(frame, pkt, vs.method, direction, &mapping, &hop, mode);
        // Only a packet on its way is the flow's traffic: one dropped or
        // answered above neither counts, nor keeps the flow alive, nor
        // moves its state (the other end never sees it).
        if r.is_ok() {
            self.forwarded(pkt, vs, &found, direction, now);
        }
        self.sent(r, out)
    }

    /// A packet of `found` is rewritten to be sent: its bytes go into the
    /// entry and the estimators, and a TCP segment near its sender's place
    /// ([`Self::seq_allows`]) restarts the idle timer and moves the state;
    /// one far from it does neither.
    fn forwarded(
        &self,
        pkt: &Packet,
        vs: &VipService,
        found: &Flow<'_>,
        direction: Direction,
        now: Millis,
    ) {
        let len = (pkt.end - pkt.l3) as u64;
        let dir = match direction {
            Direction::ToBackend => Dir::In,
            Direction::ToClient => Dir::Out,
        };
        let tcp = match (pkt.tcp_flags(), pkt.tcp_seq()) {
            (Some(flags), Some(seq)) => Some((
                flags,
                self.seq_allows(found.handle, vs.method, dir, flags, seq),
            )),
            _ => None,
        };
        let table = &self.shared.conns.table;
        if tcp.is_none_or(|(_, allowed)| allowed) {
            table.touch_handle(found.handle, now, dir, len);
        } else {
            table.count_handle(found.handle, dir, len);
        }
        let stats = [
            &self.shared.accounting.stat,
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
        if let Some((flags, true)) = tcp {
            self.advance(
                found.handle,
                &found.backend,
                vs.method,
                direction,
                flags,
                now,
            );
        }
    }

    /// A router's MTU check: `None` if the packet fits the interface `out`
    /// sends it from; else the frame answered (or dropped) as too big.
    fn too_big(
        &mut self,
        frame: &mut [u8],
        pkt: &Packet,
        out: Verdict,
        now: Millis,
    ) -> Option<Verdict> {
        let ix = match out {
            Verdict::Egress(ix) => ix,
            _ => self.rx_ifindex,
        };
        let mtu = self.links.iter().find(|l| l.ifindex == ix)?.mtu;
        if (pkt.end - pkt.l3) as u64 <= u64::from(mtu) {
            return None;
        }
        // From weir's address on the way back, as a router's; the packet's
        // own destination (the VIP...) if that interface has none.
        let back = self.links.iter().find(|l| l.ifindex == self.rx_ifindex);
        let src = match pkt.dst {
            IpAddr::V4(d) => IpAddr::V4(back.and_then(|l| l.v4).unwrap_or(d)),
            IpAddr::V6(d) => IpAddr::V6(back.and_then(|l| l.v6).unwrap_or(d)),
        };
        Some(match weir_packet::icmp::too_big(frame, pkt, mtu, src) {
            // The answer is written over the frame; past the budget it is
            // not sent (the frame is dropped all the same).
            Ok(weir_packet::TooBig::Answer { .. }) if !self.icmp_budget.take(now.0) => {
                self.drop_(Drop::IcmpLimited)
            }
            Ok(weir_packet::TooBig::Answer { len }) => {
                self.drop_(Drop::TooBig);
                Verdict::Answer(len)
            }
            Ok(weir_packet::TooBig::NoDf) => self.drop_(Drop::TooBig),
            Err(_) => self.drop_(Drop::Rewrite),
        })
    }

    /// What a batched lookup's hit names, as [`Self::find`] would return
    /// it (the probe pass matched the service already).
    fn hinted<'v>(
        &self,
        t: &weir_packet::FlowTuple,
        m: Matched<'v>,
        h: weir_flowtable::Found,
    ) -> Result<(&'v VipService, Flow<'v>, Direction), Drop> {
        match m {
            Matched::Vip(vs) => {
                let f = self.forward_hit(vs, h.handle, h.backend, t.src)?;
                Ok((vs, f, Direction::ToBackend))
            }
            Matched::Reply(g) => {
                let (vs, backend) = g.of(&h).ok_or(Drop::NoFlow)?;
                let local = (vs.method == Method::Fnat).then_some(t.dst);
                Ok((
                    vs,
                    Flow {
                        handle: h.handle,
                        backend: std::borrow::Cow::Borrowed(backend),
                        local,
                        client: h.key.client,
                    },
                    Direction::ToClient,
                ))
            }
        }
    }

    /// The flow of a packet with tuple `t`: by the forward key if it goes to
    /// a VIP:port (created for a first packet when `first` is given), else
    /// by the reply key if it comes from a nat/fnat backend.
    fn find<'v>(
        &mut self,
        vips: &'v Vips,
        t: &weir_packet::FlowTuple,
        first: Option<&Packet>,
        now: Millis,
    ) -> Result<(&'v VipService, Flow<'v>, Direction), Drop> {
        if let Some(vs) = vips.by_vip.get(&(t.dst.ip(), t.proto, t.dst.port())) {
            let f = self.forward_flow(vips, vs, first, t, now)?;
            return Ok((vs, f, Direction::ToBackend));
        }
        let groups = vips
            .by_backend
            .get(&(t.src.ip(), t.proto, t.src.port()))
            .ok_or(Drop::NotOurs)?;
        // A backend's reply (or an ICMP error about a packet sent to one)
        // only where backends are: from elsewhere it is forged.
        if !self.rx_takes_replies {
            return Err(Drop::ReplyInterface);
        }
        let (vs, f) = self
            .reply_flow(groups, t.proto, t.dst)
            .ok_or(Drop::NoFlow)?;
        Ok((vs, f, Direction::ToClient))
    }

    /// The endpoints to rewrite a packet of `found` with and its next hop.
    fn route(
        &mut self,
        vs: &VipService,
        found: &Flow<'_>,
        direction: Direction,
    ) -> Result<(NatMapping, NextHop, Verdict), Drop> {
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
        let (ifindex, hop) = self.hops.next_hop(next).ok_or(Drop::NoNextHop)?;
        let out = if ifindex == self.rx_ifindex {
            Verdict::Transmit
        } else if self.egress.contains(&ifindex) {
            Verdict::Egress(ifindex)
        } else {
            return Err(Drop::OtherInterface);
        };
        Ok((mapping, hop, out))
    }

    fn sent(&self, r: Result<(), weir_packet::RewriteError>, out: Verdict) -> Verdict {
        match r {
            Ok(()) => {
                self.counters.tx.fetch_add(1, Relaxed);
                out
            }
            Err(weir_packet::RewriteError::TtlExpired) => self.drop_(Drop::TtlExpired),
            Err(_) => self.drop_(Drop::Rewrite),
        }
    }

    /// An ICMP or ICMPv6 message. An error about a flow (unreachable,
    /// fragmentation needed / packet too big, time exceeded) is translated
    /// like the flow's packets and sent on, so path-MTU discovery works
    /// through weir; it never creates a flow. Anything else is dropped.
    fn icmp(&mut self, vips: &Vips, frame: &mut [u8], pkt: &Packet, now: Millis) -> Verdict {
        let emb = match weir_packet::icmp::parse_error(frame, pkt) {
            Ok(Some(e)) => e,
            Ok(None) => return self.drop_(Drop::Icmp),
            Err(_) => return self.drop_(Drop::IcmpMalformed),
        };
        // An error goes to the source of the packet it quotes (RFC 792,
        // 4443). One addressed elsewhere is forged: translated, it would
        // leave from the VIP (nat, backend side) to any destination.
        if pkt.dst != emb.tuple.src.ip() {
            return self.drop_(Drop::IcmpMalformed);
        }
        if emb.tuple.src.port() == 0 {
            return self.drop_(Drop::ZeroPort);
        }
        let (vs, found, direction) = match self.find(vips, &emb.flow_key(), None, now) {
            Ok(f) => f,
            Err(d) => return self.drop_(d),
        };
        let (mapping, hop, out) = match self.route(vs, &found, direction) {
            Ok(r) => r,
            Err(d) => return self.drop_(d),
        };
        self.counters.icmp_errors.fetch_add(1, Relaxed);
        let r = weir_packet::icmp::rewrite_error(
            frame, pkt, &emb, vs.method, direction, &mapping, &hop,
        );
        self.sent(r, out)
    }

    /// The flow of a client → VIP packet: found, or created for a first
    /// packet that may open one.
    fn forward_flow<'v>(
        &mut self,
        vips: &Vips,
        vs: &'v VipService,
        first: Option<&Packet>,
        t: &weir_packet::FlowTuple,
        now: Millis,
    ) -> Result<Flow<'v>, Drop> {
        let svc = &vs.svc;
        let client = t.src;
        if client.port() == 0 {
            return Err(Drop::ZeroPort);
        }
        let key = FlowKey {
            tenant: TenantId(svc.tenant.id),
            proto: table_proto(t.proto),
            client,
            virt: t.dst,
        };
        for _ in 0..2 {
            if let Some((handle, backend)) = self.shared.conns.table.lookup(&key) {
                return self.forward_hit(vs, handle, backend, client);
            }
            let Some(pkt) = first else {
                return Err(Drop::NoFlow);
            };
            match self.open(vips, vs, pkt, key, now) {
                // Another worker inserted it first: look again.
                Err(None) => continue,
                Err(Some(d)) => return Err(d),
                Ok(f) => return Ok(f),
            }
        }
        Err(Drop::NoFlow)
    }

    /// The flow a forward lookup found.
    fn forward_hit<'v>(
        &self,
        vs: &'v VipService,
        handle: Handle,
        backend: BackendId,
        client: SocketAddr,
    ) -> Result<Flow<'v>, Drop> {
        let b = std::borrow::Cow::Borrowed(vs.backend(backend).ok_or(Drop::BackendGone)?);
        let local = match vs.method {
            Method::Fnat => {
                let slot = self.shared.conns.table.nat(handle).unwrap_or(0);
                Some(self.path.local_of(slot).ok_or(Drop::NoFlow)?)
            }
            _ => None,
        };
        Ok(Flow {
            handle,
            backend: b,
            local,
            client,
        })
    }

    /// A new flow. `Err(None)`: the key exists (a race with another worker).
    fn open<'v>(
        &mut self,
        vips: &Vips,
        vs: &VipService,
        pkt: &Packet,
        key: FlowKey,
        now: Millis,
    ) -> Result<Flow<'v>, Option<Drop>> {
        let svc = &vs.svc;
        // From weir's own address: forged. A flow from a VIP:port would
        // have the backend answer that VIP, where the answer is a first
        // packet of that service (of any tenant), delivered to its
        // backends from this backend's address; from an fnat local
        // endpoint, the backend would see an fnat flow's endpoint. An
        // IPv4-mapped IPv6 source (::ffff:a.b.c.d) is never a host's on
        // the wire (RFC 4291 2.5.5.2; Linux drops it on receipt), and
        // would name one of weir's IPv4 addresses in another form.
        let client = key.client.ip();
        let mapped = matches!(client, IpAddr::V6(a) if a.to_ipv4_mapped().is_some());
        if mapped || vips.own.contains(&client) {
            return Err(Some(Drop::Martian));
        }
        // A TCP SYN (no ACK) or a UDP flow's first datagram: at a limit,
        // it may take the place of a flow that never heard back
        // (`early_drop`).
        let mut may_take = key.proto == Proto::Udp;
        if let Some(flags) = pkt.tcp_flags() {
            let syn =
                flags.has(weir_packet::TcpFlags::SYN) && !flags.has(weir_packet::TcpFlags::ACK);
            may_take = syn;
            let rst = flags.has(weir_packet::TcpFlags::RST);
            if rst || (!syn && !vs.sloppy_tcp) {
                return Err(Some(Drop::NoFlow));
            }
        }
        let shared = &*self.shared;
        if shared.admission.stop_accept.is_cancelled() {
            return Err(Some(Drop::Draining));
        }
        // Deleted since this worker's snapshot was taken: its flows were
        // killed already, and one opened now could never be settled.
        if svc.cancel.is_cancelled() {
            return Err(Some(Drop::NotOurs));
        }
        let proto = match key.proto {
            Proto::Tcp => crate::config::Protocol::Tcp,
            Proto::Udp => crate::config::Protocol::Udp,
        };
        let params = svc.params.load_full();
        let cap = match proto {
            crate::config::Protocol::Tcp => params.tcp_max_per_client,
            crate::config::Protocol::Udp => params.udp_max_per_client,
        };
        // Taken before admission so a refused client takes no tenant slot.
        let counted = if cap == 0 {
            false
        } else if svc.take_client_place(proto, key.client.ip(), cap) {
            true
        } else {
            let why = match proto {
                crate::config::Protocol::Tcp => Refusal::TcpClientLimit,
                crate::config::Protocol::Udp => Refusal::ClientLimit,
            };
            shared.admission.refuse(Some(&svc.tenant), why);
            return Err(Some(Drop::Refused));
        };
        // Everything taken so far, given back if the flow does not open.
        // (`backend`: the chosen one, whose place is given back too.)
        let give_back = |nat: u32, backend: Option<&Backend>| {
            shared.admission.release(&svc.tenant);
            if counted {
                svc.give_client_place(proto, key.client.ip());
            }
            if let Some(b) = backend {
                b.give_place();
                if nat != 0 {
                    self.path.release_port(nat, b.id);
                }
            }
        };
        let mut admitted = shared.admission.admit(&svc.tenant, shared.now_ns());
        // At a limit, a place taken from a flow that never heard back
        // (`early_drop`): at the tenant's own limit from one of its own
        // flows; at the daemon's from the tenant pressing hardest on it
        // (a flood against one tenant must not lock the others out), or
        // from its own if that one has none to give. Twice at most: the
        // daemon's place found, the tenant's own limit may refuse next.
        for _ in 0..2 {
            if !may_take {
                break;
            }
            if !matches!(admitted, Err(Refusal::TenantLimit | Refusal::GlobalLimit)) {
                break;
            }
            let seed = weir_sched::RandomSource::next_u64(&mut self.rng);
            let freed = if admitted == Err(Refusal::TenantLimit) {
                self.early_drop(&svc.tenant, now, seed)
            } else {
                self.pressing
                    .borrow_mut()
                    .take_place(&svc.tenant, &vips.tenants, now, |t| {
                        self.early_drop(t, now, seed)
                    })
            };
            if !freed {
                break;
            }
            admitted = shared.admission.admit(&svc.tenant, shared.now_ns());
        }
        if let Err(why) = admitted {
            if counted {
                svc.give_client_place(proto, key.client.ip());
            }
            shared.admission.refuse(Some(&svc.tenant), why);
            return Err(Some(Drop::Refused));
        }
        let backend = match svc.choose(shared, proto, key.client, key.virt.ip(), &[], &mut self.rng)
        {
            Ok(b) => b,
            Err(why) => {
                give_back(0, None);
                shared.admission.refuse(Some(&svc.tenant), why);
                return Err(Some(Drop::Refused));
            }
        };
        // Its place under `max_connections`: another worker may have taken
        // the last one since `choose` looked.
        if !backend.take_place() {
            give_back(0, None);
            shared
                .admission
                .refuse(Some(&svc.tenant), Refusal::BackendLimit);
            return Err(Some(Drop::Refused));
        }
        // nat leaves the client's address and port as they are: a flow of
        // another service to the same backend address from the same client
        // endpoint is the same connection at the backend, and its replies
        // the same packets here (the reply candidates' first live flow
        // would take them all, whatever its tenant). The flow already
        // there keeps them.
        if vs.method == Method::Nat && self.reply_taken(vips, &backend, key.proto, key.client) {
            give_back(0, Some(&backend));
            return Err(Some(Drop::ReplyTaken));
        }
        let local = if vs.method == Method::Fnat {
            match self.path.take_port(&backend, svc.tenant.id) {
                Ok(l) => Some(l),
                Err(e) => {
                    give_back(0, Some(&backend));
                    return Err(Some(match e {
                        weir_packet::alloc::PortError::Share => Drop::FnatShare,
                        _ => Drop::FnatPorts,
                    }));
                }
            }
        } else {
            None
        };
        let nat = local.map_or(0, |l| self.path.slot_of(l));
        let state = first_state(pkt, vs.method);
        // Held before the flow is stored, so its entry says whether its end
        // releases a template; given back if the insert fails.
        let template = (!params.persistence.is_zero())
            .then(|| shared.hold_template(svc, &params, proto, key.client, backend.id))
            .flatten();
        let init = FlowInit {
            service: ServiceId(svc.id),
            backend: BackendId(backend.id),
            state,
            owner: PacketOwner {
                counted,
                held: template.is_some(),
                template: template.map_or(0, |t| t.tag()),
            }
            .token(),
            profile: params.profile.for_init(),
        };
        let reply = match (vs.method, std::num::NonZeroU32::new(nat)) {
            (Method::Dr, _) => None,
            (Method::Nat, _) => Some(ReplyMode::Nat),
            (Method::Fnat, Some(slot)) => Some(ReplyMode::FullNat(slot)),
            // Cannot happen (`local` is one of ours), but never panic.
            (Method::Fnat, None) => {
                give_back(0, Some(&backend));
                if let Some(tpl) = template {
                    shared.release_template(svc, tpl);
                }
                return Err(Some(Drop::FnatPorts));
            }
        };
        let insert = |init| match reply {
            None => shared.conns.table.insert_handle(key, init, now),
            Some(mode) => shared.conns.table.insert_reply(key, init, mode, now),
        };
        let mut inserted = insert(init);
        // The tenant's table at its cap: the flow takes the place of one
        // that never heard back, as it would at a connection limit. (A full
        // chain of one bucket gains nothing from this, but a chain that
        // long is unlikely under keyed hashing, and the refusal stands.)
        if may_take && matches!(inserted, Err(weir_flowtable::InsertError::ChainFull)) {
            let seed = weir_sched::RandomSource::next_u64(&mut self.rng);
            if self.early_drop(&svc.tenant, now, seed) {
                inserted = insert(init);
            }
        }
        let handle = match inserted {
            Ok(h) => h,
            Err(e) => {
                give_back(nat, Some(&backend));
                if let Some(tpl) = template {
                    shared.release_template(svc, tpl);
                }
                if matches!(e, weir_flowtable::InsertError::Exists(_)) {
                    return Err(None);
                }
                // nat: a flow of another of the tenant's services from the
                // same client endpoint to the same backend address (their
                // backends there have one id, so one reply key).
                if matches!(e, weir_flowtable::InsertError::ReplyExists(_)) {
                    return Err(Some(Drop::ReplyTaken));
                }
                shared
                    .admission
                    .refuse(Some(&svc.tenant), Refusal::TableFull);
                return Err(Some(Drop::Refused));
            }
        };
        if state == FlowState::Established {
            backend.active.fetch_add(1, Relaxed);
        } else {
            backend.inactive.fetch_add(1, Relaxed);
        }
        // The service was deleted while this flow opened: its deletion
        // cancels it before killing its flows, so either that kill sees
        // this entry, or this sees the cancel and ends the flow itself
        // (settled on the service it was opened for, no longer in the
        // model), as the kill would have. The fence pairs with the one
        // after the cancel (`Shared::take_services`): insert, then read.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if svc.cancel.is_cancelled() {
            if let Some(snap) = shared.conns.table.remove_handle(handle) {
                shared.ended_among(
                    std::slice::from_ref(&snap),
                    super::owners::Close::ServiceDeleted,
                    std::slice::from_ref(svc),
                );
            }
            return Err(Some(Drop::NotOurs));
        }
        self.counters.new_flows.fetch_add(1, Relaxed);
        shared.accounting.stat.conn();
        svc.tenant.stat.conn();
        svc.stat.conn();
        backend.stat.conn();
        Ok(Flow {
            handle,
            backend: std::borrow::Cow::Owned(backend),
            local,
            client: key.client,
        })
    }

    /// SYN (and spoofed UDP) flood defence: ends one of `tenant`'s packet
    /// flows that never heard back, one of those due soonest, so that a
    /// new flow can take its place at the tenant's or the daemon's
    /// connection limit, or in the tenant's full table. Never heard back
    /// (never got going, [`never_heard_back`]): a TCP flow in SYN_RECV
    /// (the client's SYN seen, its handshake not finished), a flow with a
    /// single packet from its client so far, or one of a nat or fnat
    /// service (weir sees its replies) with no reply yet. `false` if
    /// none was found among the
    /// [`EARLY_DROP_LOOK`](super::conns::EARLY_DROP_LOOK) next due (or an
    /// expiry pass held the tenant's
    /// wheel).
    ///
    /// Why: a spoofed SYN's flow never finishes its handshake, a spoofed
    /// datagram's flow never hears back, and each holds its place for its
    /// state's timeout; a flood that refills the places as they time out
    /// locks every real client out. A real client hears back within a
    /// round trip, so the place taken is almost always the flood's, and a
    /// real flow, taken no more often than any other, lives on average
    /// limit / flood rate before it is (4 ms for 40 places under 10,000
    /// SYN/s): enough for a handshake on any network the limit was sized
    /// for. Among the flows due in the same tick the pick is spread by
    /// `seed`, not first-filed first. (IPVS's `drop_entry` defence drops
    /// SYN_RECV connections at random, conntrack's `early_drop`
    /// unassured ones from the new key's bucket; the tenant's expiry wheel
    /// gives the oldest at the same bounded cost.) A tenant's flood ends
    /// only the tenant's flows, and at the daemon's limit another
    /// tenant's new flow takes its place from the tenant pressing hardest
    /// on that limit ([`Pressing`]): the flooded one, not a bystander. A
    /// proxied connection in the same table is never taken: its client
    /// finished its handshake with the kernel. A dr service's UDP flow is
    /// taken only while it has carried a single datagram: its replies
    /// bypass weir, so one that heard back cannot be told from one that
    /// did not.
    ///
    /// A look that found nothing is not made again for the tenant for
    /// [`EARLY_DROP_BACKOFF_MS`](super::conns::EARLY_DROP_BACKOFF_MS): a
    /// tenant full of flows that did hear back would otherwise make every
    /// refused SYN of a flood cost up to 64 node reads and a filing pass
    /// instead of a compare.
    fn early_drop(&self, tenant: &super::Tenant, now: Millis, seed: u64) -> bool {
        let Some(took) = self.shared.take_place(tenant, now, seed, never_heard_back) else {
            return false; // resting
        };
        #[cfg(test)]
        self.counters.early_drop_looks.fetch_add(1, Relaxed);
        if took {
            self.counters.early_drops.fetch_add(1, Relaxed);
        }
        took
    }

    /// The flow a backend's reply (to `dst`: the client for nat, weir's
    /// local endpoint for fnat) belongs to.
    /// One reply-key lookup per tenant with services on the backend.
    fn reply_flow<'v>(
        &self,
        groups: &'v [Arc<ReplyGroup>],
        ip_proto: u8,
        dst: SocketAddr,
    ) -> Option<(&'v VipService, Flow<'v>)> {
        for g in groups {
            let Some(key) = self.group_reply_key(g, ip_proto, dst) else {
                continue;
            };
            #[cfg(test)]
            self.counters.reply_lookups.fetch_add(1, Relaxed);
            let Some(found) = self.shared.conns.table.lookup_reply(&key) else {
                continue;
            };
            let (vs, backend) = g.of(&found)?;
            let local = (vs.method == Method::Fnat).then_some(dst);
            return Some((
                vs,
                Flow {
                    handle: found.handle,
                    backend: std::borrow::Cow::Borrowed(backend),
                    local,
                    client: found.key.client,
                },
            ));
        }
        None
    }

    /// Whether a flow of another backend at `backend`'s address (another
    /// service's, of any tenant) already has the replies a nat flow from
    /// `client` would get: one reply-key lookup per other tenant with
    /// services on the address, made only for a nat flow's first packet.
    /// (Another service of the flow's own tenant there has the same reply
    /// key: the insert finds it, [`InsertError::ReplyExists`].)
    ///
    /// [`InsertError::ReplyExists`]: weir_flowtable::InsertError::ReplyExists (A check, then
    /// an insert: two workers opening such flows at the same instant may
    /// both pass; a flow's packets each way normally reach one worker.)
    fn reply_taken(
        &self,
        vips: &Vips,
        backend: &Backend,
        proto: Proto,
        client: SocketAddr,
    ) -> bool {
        let ip_proto = match proto {
            Proto::Tcp => 6,
            Proto::Udp => 17,
        };
        let ep = (backend.addr.ip(), ip_proto, backend.addr.port());
        let Some(groups) = vips.by_backend.get(&ep) else {
            return false;
        };
        let table = &self.shared.conns.table;
        groups.iter().any(|g| {
            g.backend.0 != backend.id
                && g.nat
                && table
                    .lookup_reply(&weir_flowtable::ReplyKey {
                        tenant: g.tenant,
                        proto,
                        backend: g.backend,
                        dst: weir_flowtable::ReplyDst::Client(client),
                    })
                    .is_some()
        })
    }

    /// The reply key of a packet to `dst` from the backend of group `g`:
    /// to one of weir's local endpoints, an fnat flow's; else a nat flow's,
    /// to its client. `None` if the group has no service of that method.
    fn group_reply_key(
        &self,
        g: &ReplyGroup,
        ip_proto: u8,
        dst: SocketAddr,
    ) -> Option<weir_flowtable::ReplyKey> {
        let reply_dst = match std::num::NonZeroU32::new(self.path.slot_of(dst)) {
            Some(slot) => g.fnat.then_some(weir_flowtable::ReplyDst::Nat(slot))?,
            None => g.nat.then_some(weir_flowtable::ReplyDst::Client(dst))?,
        };
        Some(weir_flowtable::ReplyKey {
            tenant: g.tenant,
            proto: table_proto(ip_proto),
            backend: g.backend,
            dst: reply_dst,
        })
    }

    /// Notes a TCP segment's place in its direction's sequence space;
    /// `false` for a segment too far from where its sender is known to be
    /// (it noted nothing, and its sequence number lies more than
    /// [`weir_packet::tcp_state::SEQ_WINDOW`] from the place, either
    /// way), which then changes no state and does not restart the flow's
    /// idle timer (forwarded all the same: the endpoint checks it too).
    /// A FIN ends a flow as surely as a RST, only later: ESTABLISHED's
    /// 900 s become CLOSE_WAIT's 60 s (or FIN_WAIT's 120 s), after which
    /// an idle connection's next packet finds no flow. Any other segment
    /// keeps a flow alive: taken from anyone who knows the four-tuple (a
    /// blind ACK, data), it would keep a dead flow, its admission slot
    /// and its fnat port, for ever (conntrack's `tcp_in_window` does not
    /// refresh a connection's timeout on such a segment either). A
    /// retransmission lies behind the place, within the window.
    fn seq_allows(
        &self,
        h: Handle,
        method: Method,
        dir: Dir,
        flags: weir_packet::TcpFlags,
        (seq, end): (u32, u32),
    ) -> bool {
        use weir_packet::tcp_state;
        let table = &self.shared.conns.table;
        let (mut opens, mut noted) = (false, false);
        let seen = table.track_seq_handle(h, dir, |st, known| {
            let st = TcpState::from_flow_state(st)?;
            let note = tcp_state::seq_to_note(st, flags, end, known);
            opens = tcp_state::opens_connection(flags, note);
            noted = note.is_some();
            note
        });
        if opens && dir == Dir::In {
            // A new connection: the backend's place waits for its SYN-ACK
            // (see `AWAIT_SYN`).
            table.track_seq_handle(h, Dir::Out, |_, _| Some(tcp_state::AWAIT_SYN));
        }
        let (ignored, ends) = match tcp_state::FlagClass::of(flags) {
            Some(tcp_state::FlagClass::Rst) => (&self.counters.rst_ignored, true),
            Some(tcp_state::FlagClass::Fin) => (&self.counters.fin_ignored, true),
            _ => (&self.counters.seq_ignored, false),
        };
        // A segment that moved its sender's place forward (or started it
        // afresh: a SYN opening a connection) is the sender's; any other
        // must lie near the place, as a RST must.
        match seen {
            Some((_, known)) if !noted && !tcp_state::rst_acceptable(seq, known) => {
                // The client's answer to a challenge ACK (or its FIN),
                // before the backend's SYN-ACK (nat, fnat: dr sees no
                // replies). Only a RST or a FIN: a blind ACK there would
                // move the flow to ESTABLISHED by IPVS's table and keep
                // it, however long the backend stays silent.
                let handshake = ends
                    && dir == Dir::In
                    && method != Method::Dr
                    && table
                        .track_seq_handle(h, Dir::Out, |_, _| None)
                        .is_some_and(|(_, backend)| tcp_state::rst_in_handshake(backend));
                if !handshake {
                    ignored.fetch_add(1, Relaxed);
                }
                handshake
            }
            _ => true,
        }
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
        let moved = self.shared.conns.table.transition_handle(h, now, |s| {
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
    pub(crate) fn settle_packet(&self, snap: &FlowSnapshot, svc: &Arc<Service>) {
        self.admission.release(&svc.tenant);
        if let Some(path) = self.packet.get()
            && snap.nat != 0
        {
            path.release_port(snap.nat, snap.backend.0);
        }
        let proto = match snap.key.proto {
            Proto::Tcp => crate::config::Protocol::Tcp,
            Proto::Udp => crate::config::Protocol::Udp,
        };
        let flags = PacketOwner::of(snap.owner);
        if flags.is_some_and(|f| f.counted) {
            svc.give_client_place(proto, snap.key.client.ip());
        }
        if let Some(f) = flags.filter(|f| f.held) {
            // The key under the current parameters: an edit that changed
            // it dropped the service's templates, this one's included (see
            // `hold_template`), and the template found under the new key
            // is a newer one, whose tag is not this flow's: it keeps its
            // holds, as it does after persistence was turned off and on.
            let params = svc.params.load();
            self.release_template_tagged(
                svc,
                super::template_key(svc, &params, proto, snap.key.client),
                f.template,
            );
        }
    }
}

impl Shared {
    /// fnat's local endpoint of a packet flow, for listings.
    pub(crate) fn packet_local(&self, snap: &FlowSnapshot) -> Option<String> {
        if !is_packet_owner(snap.owner) || snap.nat == 0 {
            return None;
        }
        Some(self.packet.get()?.local_of(snap.nat)?.to_string())
    }
}

#[cfg(test)]
mod tests {
    //! The engine with frames of its own: a daemon started with packet
    //! services but no interfaces attached ([`super::super::Daemon::start_inner`]),
    //! and a fixed next hop.

    use super::*;
    use crate::config::Config;
    use crate::daemon::conns::EARLY_DROP_BACKOFF_MS;
    use weir_packet::checksum;
    use weir_sched::RandomSource as _;

    const VIP: &str = "10.0.0.100:80";
    const B1: &str = "10.0.1.2:8080";
    const B2: &str = "10.0.1.3:8080";
    const LOCAL: &str = "10.0.1.1";
    const HOP: NextHop = NextHop {
        src_mac: [2, 0, 0, 0, 0, 1],
        dst_mac: [2, 0, 0, 0, 0, 2],
    };
    const FIN: u8 = 0x01;
    const SYN: u8 = 0x02;
    const RST: u8 = 0x04;
    const ACK: u8 = 0x10;

    struct FixedHop;
    impl NextHops for FixedHop {
        fn next_hop(&mut self, _dst: IpAddr) -> Option<(u32, NextHop)> {
            Some((1, HOP))
        }
    }

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn daemon(forward: &str, extra: &str) -> super::super::DaemonHandle {
        daemon_with(forward, extra, "")
    }

    /// A packet-mode daemon on lo whose tenants a and b each have a nat UDP
    /// service "dns": a's on `vip_a` in front of B1, b's on `vip_b` in
    /// front of `backend_b`. `packet` is added to the [packet] table.
    fn two_tenants_dns(
        vip_a: SocketAddr,
        vip_b: SocketAddr,
        backend_b: &str,
        packet: &str,
    ) -> super::super::DaemonHandle {
        let toml = format!(
            "[daemon]\nworkers = 1\n[packet]\ninterfaces = [\"lo\"]\n{packet}\
             [[tenant]]\nname = \"a\"\n[[tenant]]\nname = \"b\"\n\
             [[service]]\ntenant = \"a\"\nname = \"dns\"\nprotocol = \"udp\"\n\
             listen = \"{vip_a}\"\nforward = \"nat\"\n[[service.backend]]\naddress = \"{B1}\"\n\
             [[service]]\ntenant = \"b\"\nname = \"dns\"\nprotocol = \"udp\"\n\
             listen = \"{vip_b}\"\nforward = \"nat\"\n[[service.backend]]\naddress = \"{backend_b}\"\n"
        );
        let cfg: Config = toml::from_str(&toml).unwrap();
        super::super::Daemon::start_inner(cfg, None, false).unwrap()
    }

    /// [`daemon`] with `svc_extra` in the service's table.
    fn daemon_with(forward: &str, extra: &str, svc_extra: &str) -> super::super::DaemonHandle {
        let port = if forward == "dr" { 80 } else { 8080 };
        let (b1, b2) = (
            B1.replace(":8080", &format!(":{port}")),
            B2.replace(":8080", &format!(":{port}")),
        );
        let toml = format!(
            "[daemon]\nworkers = 1\n[packet]\ninterfaces = [\"lo\"]\nlocal_addresses = [\"{LOCAL}\"]\n\
             [[tenant]]\nname = \"default\"\n{extra}\n\
             [[service]]\nname = \"web\"\nprotocol = \"tcp\"\nlisten = \"{VIP}\"\nforward = \"{forward}\"\n\
             scheduler = \"rr\"\n{svc_extra}\n[[service.backend]]\naddress = \"{b1}\"\n[[service.backend]]\naddress = \"{b2}\"\n"
        );
        let cfg: Config = toml::from_str(&toml).unwrap();
        super::super::Daemon::start_inner(cfg, None, false).unwrap()
    }

    /// The test daemon's one service.
    fn the_service(d: &super::super::DaemonHandle) -> Arc<Service> {
        d.shared
            .model
            .load()
            .services
            .values()
            .next()
            .unwrap()
            .clone()
    }

    fn engine(d: &super::super::DaemonHandle) -> Engine {
        engine_with(d, Box::new(FixedHop))
    }

    /// An engine of `d`'s packet path whose next hops are `hops`.
    fn engine_with(d: &super::super::DaemonHandle, hops: Box<dyn NextHops>) -> Engine {
        engine_on(d, hops, vec![1])
    }

    /// An engine of `d`'s packet path with sockets on `egress`.
    fn engine_on(
        d: &super::super::DaemonHandle,
        hops: Box<dyn NextHops>,
        egress: Vec<u32>,
    ) -> Engine {
        let shared = d.shared.clone();
        let path = shared.packet.get().unwrap().clone();
        Engine::new(shared, path, hops, egress, 7, "weir-pkt-test")
    }

    /// Ethernet + IPv4 (or IPv6) + TCP (flags) or UDP (flags = None),
    /// checksums full.
    fn frame(src: SocketAddr, dst: SocketAddr, tcp: Option<u8>, payload: &[u8]) -> Vec<u8> {
        frame_seq(src, dst, tcp, 1, payload)
    }

    /// [`frame`] with the TCP sequence number `seq`.
    fn frame_seq(
        src: SocketAddr,
        dst: SocketAddr,
        tcp: Option<u8>,
        seq: u32,
        payload: &[u8],
    ) -> Vec<u8> {
        let mut l4 = Vec::new();
        l4.extend_from_slice(&src.port().to_be_bytes());
        l4.extend_from_slice(&dst.port().to_be_bytes());
        let (proto, csum_at) = match tcp {
            Some(flags) => {
                l4.extend_from_slice(&seq.to_be_bytes());
                l4.extend_from_slice(&[0, 0, 0, 0, 0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
                (6u8, 16)
            }
            None => {
                l4.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
                l4.extend_from_slice(&[0, 0]);
                (17u8, 6)
            }
        };
        l4.extend_from_slice(payload);
        let (s, d) = match (src.ip(), dst.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => (s, d),
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let c = checksum::l4_checksum(&s.octets(), &d.octets(), proto, &l4, csum_at);
                l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
                let mut f = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 9, 0x86, 0xdd];
                f.extend_from_slice(&[0x60, 0, 0, 0]);
                f.extend_from_slice(&(l4.len() as u16).to_be_bytes());
                f.extend_from_slice(&[proto, 64]);
                f.extend_from_slice(&s.octets());
                f.extend_from_slice(&d.octets());
                f.extend_from_slice(&l4);
                return f;
            }
            _ => panic!("one family"),
        };
        let c = checksum::l4_checksum(&s.octets(), &d.octets(), proto, &l4, csum_at);
        l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
        let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, proto, 0, 0];
        ip[2..4].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
        ip.extend_from_slice(&s.octets());
        ip.extend_from_slice(&d.octets());
        let c = checksum::ipv4_header_checksum(&ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        let mut f = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 9, 0x08, 0x00];
        f.extend_from_slice(&ip);
        f.extend_from_slice(&l4);
        f
    }

    /// The frame's tuple, after checking every checksum from scratch.
    fn verified(f: &[u8]) -> weir_packet::FlowTuple {
        let p = weir_packet::parse(f).expect("still a valid packet");
        let ip = &f[p.l3..p.l4];
        assert_eq!(
            checksum::ipv4_header_checksum(ip).to_be_bytes(),
            [ip[10], ip[11]],
            "IPv4 header checksum"
        );
        let at = if p.transport.proto() == 6 { 16 } else { 6 };
        let l4 = &f[p.l4..p.end];
        let want = checksum::l4_checksum(&ip[12..16], &ip[16..20], p.transport.proto(), l4, at);
        assert_eq!(want.to_be_bytes(), [l4[at], l4[at + 1]], "L4 checksum");
        p.tuple().unwrap()
    }

    /// The table key of `client`'s TCP flow to the test service's VIP.
    fn tcp_key(e: &Engine, client: SocketAddr) -> FlowKey {
        FlowKey {
            tenant: TenantId(e.vips.by_vip.values().next().unwrap().svc.tenant.id),
            proto: Proto::Tcp,
            client,
            virt: sa(VIP),
        }
    }

    /// The key of TCP `client`'s persistence template at `svc`, under the
    /// service's parameters as they are now (its netmask groups clients).
    fn template_of(svc: &Service, client: &str) -> FlowKey {
        let params = svc.params.load();
        super::super::template_key(svc, &params, crate::config::Protocol::Tcp, sa(client))
    }

    fn counted(e: &Engine, why: Drop) -> u64 {
        e.counters.dropped[why as usize].load(Relaxed)
    }

    #[test]
    fn nat_rewrites_both_ways_and_tracks_tcp_states() {
        let d = daemon("nat", "");
        let mut e = engine(&d);
        let client = sa("192.0.2.7:40000");
        let mut syn = frame(client, sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut syn), Verdict::Transmit);
        let t = verified(&syn);
        assert_eq!((t.src, t.dst), (client, sa(B1)), "rr: the first backend");
        assert_eq!(
            &syn[..12],
            &[2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1],
            "next hop MACs"
        );
        // The backend's SYN-ACK comes back from VIP.
        let mut synack = frame(sa(B1), client, Some(SYN | ACK), b"");
        assert_eq!(e.process(&mut synack), Verdict::Transmit);
        let t = verified(&synack);
        assert_eq!((t.src, t.dst), (sa(VIP), client));
        let mut ack = frame(client, sa(VIP), Some(ACK), b"hello");
        assert_eq!(e.process(&mut ack), Verdict::Transmit);
        let key = tcp_key(&e, client);
        let snap = d.shared.conns.table.get(&key).unwrap();
        assert_eq!(snap.state, FlowState::Established);
        assert_eq!((snap.packets_in, snap.packets_out), (2, 1));
        let b1 = the_service(&d).backend(snap.backend.0).unwrap();
        assert_eq!((b1.active.load(Relaxed), b1.inactive.load(Relaxed)), (1, 0));
        // A second client goes to the other backend.
        let mut syn2 = frame(sa("192.0.2.8:1234"), sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut syn2), Verdict::Transmit);
        assert_eq!(verified(&syn2).dst, sa(B2));
        assert_eq!(e.counters.new_flows.load(Relaxed), 2);
    }

    /// A nat flow of `client` established at `now` by hand-built frames:
    /// the client's SYN at `c0`, the backend's SYN-ACK at `b0`, then five
    /// bytes from the client (its place is then `c0 + 6`, the backend's
    /// `b0 + 1`).
    fn established_at(
        e: &mut Engine,
        client: SocketAddr,
        (c0, b0): (u32, u32),
        now: Millis,
    ) -> FlowKey {
        for (src, dst, flags, seq, data) in [
            (client, sa(VIP), SYN, c0, &b""[..]),
            (sa(B1), client, SYN | ACK, b0, b""),
            (client, sa(VIP), ACK, c0 + 1, b"hello"),
        ] {
            let mut f = frame_seq(src, dst, Some(flags), seq, data);
            assert_eq!(e.process_at(&mut f, now), Verdict::Transmit);
        }
        tcp_key(e, client)
    }

    /// A segment far from its sender's place (a blind ACK or data from
    /// anyone who knows the four-tuple) is forwarded but does not restart
    /// the flow's idle timer, as conntrack does not for a segment out of
    /// its window: the attacker could otherwise keep a dead flow, its
    /// admission slot and its fnat port, alive for ever. A segment near
    /// its sender's place, a retransmission included, still does.
    #[test]
    fn a_blind_ack_does_not_keep_an_established_flow_alive() {
        let d = daemon("nat", "");
        let mut e = engine(&d);
        let client = sa("192.0.2.7:40000");
        let (c0, b0) = (1_000_000u32, 3_000_000_000u32);
        let t0 = d.shared.now_ms();
        let key = established_at(&mut e, client, (c0, b0), Millis(t0));
        let last = |d: &super::super::DaemonHandle| {
            let s = d.shared.conns.table.get(&key).unwrap();
            assert_eq!(s.state, FlowState::Established);
            s.last_active
        };
        assert_eq!(last(&d), Millis(t0));
        let w = weir_packet::tcp_state::SEQ_WINDOW;
        let mut t = t0;
        for (src, dst, seq, data) in [
            (client, sa(VIP), c0 + 6 + w + 1, &b""[..]),
            (client, sa(VIP), c0.wrapping_add(1 << 31), b"data"),
            (sa(B1), client, (b0 + 1).wrapping_sub(w + 1), b""),
            (sa(B1), client, (b0 + 1).wrapping_add(3 << 30), b"data"),
        ] {
            t += 60_000;
            let mut ack = frame_seq(src, dst, Some(ACK), seq, data);
            assert_eq!(e.process_at(&mut ack, Millis(t)), Verdict::Transmit);
            assert_eq!(last(&d), Millis(t0), "ACK at {seq}");
        }
        assert_eq!(e.counters.seq_ignored.load(Relaxed), 4);
        assert_eq!(e.counters.rst_ignored.load(Relaxed), 0);
        assert_eq!(e.counters.fin_ignored.load(Relaxed), 0);
        let s = d.shared.conns.table.get(&key).unwrap();
        assert_eq!((s.packets_in, s.packets_out), (4, 3), "still counted");
        // Segments near their sender's place, each way: a pure ACK, a
        // retransmission, new data.
        for (src, dst, seq, data) in [
            (client, sa(VIP), c0 + 6, &b""[..]),
            (client, sa(VIP), c0 + 1, b"hello"),
            (sa(B1), client, b0 + 1, b"welcome"),
        ] {
            t += 60_000;
            let mut ack = frame_seq(src, dst, Some(ACK), seq, data);
            assert_eq!(e.process_at(&mut ack, Millis(t)), Verdict::Transmit);
            assert_eq!(last(&d), Millis(t), "ACK at {seq}");
        }
        assert_eq!(e.counters.seq_ignored.load(Relaxed), 4);
        // The flow ends ESTABLISHED's timeout after its last real segment,
        // whatever an attacker sends meanwhile.
        let timeout = s.expires_at.0 - t0;
        let mut blind = frame_seq(client, sa(VIP), Some(ACK), c0 + 6 + 2 * w, b"");
        assert_eq!(
            e.process_at(&mut blind, Millis(t + timeout - 1)),
            Verdict::Transmit
        );
        let mut out = Vec::new();
        d.shared
            .conns
            .table
            .expire(Millis(t + timeout), 4096, &mut out);
        assert_eq!(out.len(), 1, "the flow expired");
        assert!(d.shared.conns.table.get(&key).is_none());
    }

    #[test]
    fn a_blind_rst_does_not_end_an_established_flow() {
        a_blind_end_does_not_move_an_established_flow(RST, FlowState::Close);
    }

    /// A FIN moves an established flow towards its end as a RST does
    /// (client side: CLOSE_WAIT, 60 s; backend side: FIN_WAIT, 120 s,
    /// instead of ESTABLISHED's 900 s), so it is held to the same window.
    /// Before, only RSTs were: one spoofed FIN with a guessed client
    /// address and port, at any sequence number, left an idle connection's
    /// entry to expire within a minute, and its next packet was dropped as
    /// `no_flow`.
    #[test]
    fn a_blind_fin_does_not_move_an_established_flow() {
        a_blind_end_does_not_move_an_established_flow(FIN, FlowState::CloseWait);
    }

    /// A spoofed RST or FIN (`end`) far from its sender's place is
    /// forwarded and counted as ignored (in its own counter, not the
    /// other's) and leaves the flow established, even after a segment far
    /// ahead that the attacker sent to move the client's place; the
    /// client's own, at its next sequence number, moves the flow to
    /// `ends_in` and the backend's connection from active to inactive.
    fn a_blind_end_does_not_move_an_established_flow(end: u8, ends_in: FlowState) {
        let name = if end == RST { "RST" } else { "FIN" };
        let d = daemon("nat", "");
        let mut e = engine(&d);
        let client = sa("192.0.2.7:40000");
        let (c0, b0) = (1_000_000u32, 3_000_000_000u32);
        let key = established_at(&mut e, client, (c0, b0), Millis(d.shared.now_ms()));
        let state = |d: &super::super::DaemonHandle| d.shared.conns.table.get(&key).unwrap().state;
        assert_eq!(state(&d), FlowState::Established);
        // (rst_ignored, fin_ignored) once `n` of `end` were ignored.
        let ignored = |n: u64| if end == RST { (n, 0) } else { (0, n) };
        let counted = |e: &Engine| {
            let c = &e.counters;
            (c.rst_ignored.load(Relaxed), c.fin_ignored.load(Relaxed))
        };
        let w = weir_packet::tcp_state::SEQ_WINDOW;
        // Spoofed far from either sender's place: forwarded (the endpoint
        // checks them too), the flow stays established.
        for (src, dst, seq) in [
            (client, sa(VIP), c0 + 6 + w + 1),
            (client, sa(VIP), c0.wrapping_add(1 << 31)),
            (sa(B1), client, (b0 + 1).wrapping_sub(w + 1)),
        ] {
            let mut blind = frame_seq(src, dst, Some(end | ACK), seq, b"");
            assert_eq!(e.process(&mut blind), Verdict::Transmit, "{name} at {seq}");
            assert_eq!(state(&d), FlowState::Established, "{name} at {seq}");
        }
        assert_eq!(counted(&e), ignored(3), "{name}s far from their places");
        // A spoofed segment far ahead does not move the client's place to
        // one the attacker knows.
        let far = c0 + 6 + 2 * w;
        let mut ack = frame_seq(client, sa(VIP), Some(ACK), far, b"x");
        assert_eq!(e.process(&mut ack), Verdict::Transmit);
        let mut blind = frame_seq(client, sa(VIP), Some(end), far + 1, b"");
        assert_eq!(e.process(&mut blind), Verdict::Transmit);
        assert_eq!(
            state(&d),
            FlowState::Established,
            "{name} after data far ahead"
        );
        assert_eq!(counted(&e), ignored(4), "{name} after data far ahead");
        let backend = d.shared.conns.table.get(&key).unwrap().backend;
        let b1 = the_service(&d).backend(backend.0).unwrap();
        let counts = || (b1.active.load(Relaxed), b1.inactive.load(Relaxed));
        assert_eq!(counts(), (1, 0), "before the client's own {name}");
        // The client's own, at its next sequence number, moves it.
        let mut own = frame_seq(client, sa(VIP), Some(end | ACK), c0 + 6, b"");
        assert_eq!(e.process(&mut own), Verdict::Transmit);
        assert_eq!(state(&d), ends_in, "the client's own {name}");
        assert_eq!(counted(&e), ignored(4), "the client's own {name}");
        assert_eq!(counts(), (0, 1), "after the client's own {name}");
    }

    /// A client port reused while its old connection's entry is closing
    /// (wrk does it all the time) starts a new connection with new initial
    /// sequence numbers: its segments must be checked against the new
    /// connection's places, not the old one's. The places restarted only
    /// from TIME_WAIT and CLOSE, but dr leaves a closed flow in FIN_WAIT
    /// (it sees only the client) and in nat the backend's SYN-ACK finds
    /// the flow in SYN_RECV: every later FIN and RST of the new connection
    /// was out of the window, ignored, and its entry stayed ESTABLISHED
    /// for 900 s (`weir-bench packet --only tcp` counted thousands of
    /// `fin_ignored` a run).
    #[test]
    fn a_reused_port_closes_its_new_connection() {
        for forward in ["dr", "nat"] {
            let d = daemon(forward, "");
            let mut e = engine(&d);
            let client = sa("192.0.2.7:40000");
            let key = tcp_key(&e, client);
            let state =
                |d: &super::super::DaemonHandle| d.shared.conns.table.get(&key).unwrap().state;
            // Two connections from one client port, far apart in sequence
            // space each way.
            for (c0, b0) in [
                (1_000_000u32, 3_000_000_000u32),
                (2_500_000_000, 700_000_000),
            ] {
                let mut seg =
                    |src: SocketAddr, dst: SocketAddr, flags: u8, seq: u32, data: &[u8]| {
                        let mut f = frame_seq(src, dst, Some(flags), seq, data);
                        assert_eq!(e.process(&mut f), Verdict::Transmit, "{forward}");
                    };
                seg(client, sa(VIP), SYN, c0, b"");
                if forward == "nat" {
                    seg(sa(B1), client, SYN | ACK, b0, b"");
                }
                seg(client, sa(VIP), ACK, c0 + 1, b"GET");
                assert_eq!(state(&d), FlowState::Established, "{forward}");
                if forward == "nat" {
                    // The backend closes first, as nginx does with
                    // `Connection: close`; then the client.
                    seg(sa(B1), client, FIN | ACK, b0 + 1, b"");
                    assert_eq!(state(&d), FlowState::FinWait, "{forward}: backend's FIN");
                    seg(client, sa(VIP), FIN | ACK, c0 + 4, b"");
                    assert_eq!(state(&d), FlowState::TimeWait, "{forward}: client's FIN");
                } else {
                    seg(client, sa(VIP), FIN | ACK, c0 + 4, b"");
                    assert_eq!(state(&d), FlowState::FinWait, "{forward}: client's FIN");
                }
            }
            assert_eq!(e.counters.fin_ignored.load(Relaxed), 0, "{forward}");
        }
    }

    /// The same in nat when the backend still holds the old connection in
    /// TIME_WAIT and answers the new SYN with a challenge ACK of it, on a
    /// reused port or on a flow new to weir (the old connection went
    /// another way, or before weir's entry). By IPVS's table that ACK
    /// moves the flow to ESTABLISHED. Before: noted as the backend's
    /// place, it left the place stale for the connection that followed
    /// (its RSTs from the backend ignored); and the client's answer, a RST
    /// at the ACK's acknowledgment number, was ignored as far from the
    /// client's place, leaving the flow ESTABLISHED for 900 s (nat,
    /// `weir-bench packet --only tcp`: ~600-1,000 per run, each on a flow
    /// of three packets). Now the RST ends the handshake, as in IPVS, and
    /// the backend's place waits for its SYN-ACK.
    #[test]
    fn a_syn_answered_by_a_challenge_ack_is_checked_at_its_new_places() {
        for reused in [true, false] {
            let d = daemon("nat", "");
            let mut e = engine(&d);
            let client = sa("192.0.2.7:40000");
            let key = tcp_key(&e, client);
            let state =
                |d: &super::super::DaemonHandle| d.shared.conns.table.get(&key).unwrap().state;
            let seg = |e: &mut Engine, src: SocketAddr, dst: SocketAddr, flags: u8, seq: u32| {
                let mut f = frame_seq(src, dst, Some(flags), seq, b"");
                assert_eq!(e.process(&mut f), Verdict::Transmit, "reused: {reused}");
            };
            let (c0, b0) = (1_000_000u32, 3_000_000_000u32);
            if reused {
                seg(&mut e, client, sa(VIP), SYN, c0);
                seg(&mut e, sa(B1), client, SYN | ACK, b0);
                seg(&mut e, client, sa(VIP), ACK, c0 + 1);
                seg(&mut e, sa(B1), client, FIN | ACK, b0 + 1);
                seg(&mut e, client, sa(VIP), FIN | ACK, c0 + 1);
                assert_eq!(state(&d), FlowState::TimeWait);
            }
            // The port (again), a new initial sequence number.
            let (c1, b1) = (2_500_000_000u32, 700_000_000u32);
            seg(&mut e, client, sa(VIP), SYN, c1);
            // The backend's TIME_WAIT socket: an ACK of the old connection.
            seg(&mut e, sa(B1), client, ACK, b0 + 2);
            assert_eq!(state(&d), FlowState::Established, "IPVS's table");
            // The client resets it (for the backend's old socket, at the
            // ACK's number): the handshake ends, as in IPVS.
            seg(&mut e, client, sa(VIP), RST, c0 + 2);
            assert_eq!(state(&d), FlowState::Close, "reused: {reused}");
            assert_eq!(e.counters.rst_ignored.load(Relaxed), 0);
            // It tries again; now the backend's SYN-ACK.
            seg(&mut e, client, sa(VIP), SYN, c1);
            seg(&mut e, sa(B1), client, SYN | ACK, b1);
            seg(&mut e, client, sa(VIP), ACK, c1 + 1);
            assert_eq!(state(&d), FlowState::Established);
            // Established, a RST far from the client's place counts for
            // nothing again.
            seg(&mut e, client, sa(VIP), RST, c0 + 2);
            assert_eq!(state(&d), FlowState::Established);
            assert_eq!(e.counters.rst_ignored.load(Relaxed), 1);
            // It closes, the backend first, each at its new place.
            seg(&mut e, sa(B1), client, FIN | ACK, b1 + 1);
            assert_eq!(state(&d), FlowState::FinWait, "the backend's FIN");
            seg(&mut e, client, sa(VIP), FIN | ACK, c1 + 1);
            assert_eq!(state(&d), FlowState::TimeWait, "the client's FIN");
            assert_eq!(e.counters.rst_ignored.load(Relaxed), 1);
            assert_eq!(e.counters.fin_ignored.load(Relaxed), 0);
        }
    }

    /// Before the backend's SYN-ACK only a client's RST or FIN is taken
    /// far from the client's place (its answer to a challenge ACK, above).
    /// Any segment was: a blind ACK with a guessed client address and port
    /// moved a flow whose backend does not answer (down, or dropping SYNs)
    /// to ESTABLISHED by IPVS's table and restarted its timer, 900 s
    /// instead of SYN_RECV's, and again with each such ACK: the flow, its
    /// admission slot and its client's place kept for ever.
    #[test]
    fn a_blind_ack_before_the_backends_answer_keeps_nothing() {
        let d = daemon("nat", "");
        let mut e = engine(&d);
        let client = sa("192.0.2.7:40000");
        let key = tcp_key(&e, client);
        let c0 = 1_000_000u32;
        let t0 = d.shared.now_ms();
        let mut syn = frame_seq(client, sa(VIP), Some(SYN), c0, b"");
        assert_eq!(e.process_at(&mut syn, Millis(t0)), Verdict::Transmit);
        let flow = |d: &super::super::DaemonHandle| {
            let s = d.shared.conns.table.get(&key).unwrap();
            (s.state, s.last_active)
        };
        let mut t = t0;
        for seq in [
            c0.wrapping_add(1 << 31),
            c0 + 2 * weir_packet::tcp_state::SEQ_WINDOW,
        ] {
            t += 20_000;
            let mut ack = frame_seq(client, sa(VIP), Some(ACK), seq, b"x");
            assert_eq!(e.process_at(&mut ack, Millis(t)), Verdict::Transmit);
            assert_eq!(flow(&d), (FlowState::SynRecv, Millis(t0)), "ACK at {seq}");
        }
        assert_eq!(e.counters.seq_ignored.load(Relaxed), 2);
        // The client's own ACK, at its place, moves it as IPVS's table says.
        t += 1_000;
        let mut ack = frame_seq(client, sa(VIP), Some(ACK), c0 + 1, b"");
        assert_eq!(e.process_at(&mut ack, Millis(t)), Verdict::Transmit);
        assert_eq!(flow(&d), (FlowState::Established, Millis(t)));
        assert_eq!(e.counters.seq_ignored.load(Relaxed), 2);
    }

    /// dr sees no replies, so it cannot tell a handshake from an open
    /// connection: a client RST far from the client's place is ignored
    /// there from the first SYN on.
    #[test]
    fn dr_checks_a_clients_rst_from_its_first_syn() {
        let d = daemon("dr", "");
        let mut e = engine(&d);
        let client = sa("192.0.2.7:40000");
        let key = tcp_key(&e, client);
        let c0 = 1_000_000u32;
        for (flags, seq) in [(SYN, c0), (RST, c0 + (1 << 24))] {
            let mut f = frame_seq(client, sa(VIP), Some(flags), seq, b"");
            assert_eq!(e.process(&mut f), Verdict::Transmit);
        }
        assert_eq!(e.counters.rst_ignored.load(Relaxed), 1);
        assert_eq!(
            d.shared.conns.table.get(&key).unwrap().state,
            FlowState::SynRecv
        );
    }

    #[test]
    fn no_flow_without_a_syn_unless_sloppy() {
        let d = daemon("nat", "");
        let mut e = engine(&d);
        let mut ack = frame(sa("192.0.2.7:40000"), sa(VIP), Some(ACK), b"x");
        assert_eq!(e.process(&mut ack), Verdict::Drop);
        // A reply nobody asked for.
        let mut stray = frame(sa(B1), sa("192.0.2.7:40000"), Some(ACK), b"");
        assert_eq!(e.process(&mut stray), Verdict::Drop);
        assert_eq!(counted(&e, Drop::NoFlow), 2);
        assert_eq!(e.counters.new_flows.load(Relaxed), 0);
        assert_eq!(
            d.shared.admission.active.load(Relaxed),
            0,
            "nothing admitted"
        );

        let d = daemon("nat", "");
        the_service(&d).spec.write().options.sloppy_tcp = true;
        d.shared.services_changed();
        let mut e = engine(&d);
        let mut ack = frame(sa("192.0.2.7:40000"), sa(VIP), Some(ACK), b"x");
        assert_eq!(e.process(&mut ack), Verdict::Transmit);
        assert_eq!(e.counters.new_flows.load(Relaxed), 1);
    }

    #[test]
    fn fnat_maps_a_local_port_and_gives_it_back_when_the_flow_is_killed() {
        let d = daemon("fnat", "");
        let mut e = engine(&d);
        let client = sa("192.0.2.7:40000");
        let mut syn = frame(client, sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut syn), Verdict::Transmit);
        let t = verified(&syn);
        assert_eq!(t.src.ip(), LOCAL.parse::<IpAddr>().unwrap());
        assert_eq!(t.dst, sa(B1));
        let local = t.src;
        let path = d.shared.packet.get().unwrap().clone();
        assert!(path.port_is_live(local, sa(B1)));
        // The backend answers the local endpoint; the client sees the VIP.
        let mut reply = frame(sa(B1), local, Some(SYN | ACK), b"");
        assert_eq!(e.process(&mut reply), Verdict::Transmit);
        let r = verified(&reply);
        assert_eq!((r.src, r.dst), (sa(VIP), client));
        // weir conns shows the second tuple.
        let snap = d.shared.conns.table.handle(&FlowKey {
            tenant: TenantId(e.vips.by_vip.values().next().unwrap().svc.tenant.id),
            proto: Proto::Tcp,
            client,
            virt: sa(VIP),
        });
        let snap = d.shared.conns.table.get_handle(snap.unwrap()).unwrap();
        assert_eq!(d.shared.packet_local(&snap), Some(local.to_string()));
        // Kill everything: the entry goes, its port and admission slot too.
        let killed = d.shared.kill_where(
            super::super::owners::Close::Killed,
            &weir_flowtable::DumpFilter::default(),
            |_| true,
        );
        assert_eq!(killed, 1);
        assert!(!path.port_is_live(local, sa(B1)));
        assert_eq!(d.shared.admission.active.load(Relaxed), 0);
        let mut late = frame(sa(B1), local, Some(ACK), b"");
        assert_eq!(e.process(&mut late), Verdict::Drop);
        assert_eq!(counted(&e, Drop::NoFlow), 1);
    }

    #[test]
    fn admission_limits_refuse_new_flows_only() {
        let d = daemon("dr", "max_connections = 1");
        let mut e = engine(&d);
        let mut a = frame(sa("192.0.2.7:1"), sa(VIP), Some(SYN), b"");
        let mut b = frame(sa("192.0.2.7:2"), sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut a), Verdict::Transmit);
        // dr: only the MAC changes.
        assert_eq!(verified(&a).dst, sa(VIP));
        assert_eq!(&a[..6], &HOP.dst_mac);
        // Its handshake finished, it is not an embryonic flow b's SYN
        // could take the place of (`Engine::early_drop`).
        let mut a1 = frame(sa("192.0.2.7:1"), sa(VIP), Some(ACK), b"");
        assert_eq!(e.process(&mut a1), Verdict::Transmit);
        assert_eq!(e.process(&mut b), Verdict::Drop);
        assert_eq!(counted(&e, Drop::Refused), 1);
        assert_eq!(
            d.shared.admission.refused.snapshot().get("tenant_limit"),
            Some(&1)
        );
        // The admitted flow keeps flowing.
        let mut a2 = frame(sa("192.0.2.7:1"), sa(VIP), Some(ACK), b"again");
        assert_eq!(e.process(&mut a2), Verdict::Transmit);
    }

    /// SYN flood defence ([`Engine::early_drop`]): a SYN refused at its
    /// tenant's connection limit takes the place of the tenant's embryonic
    /// flow due soonest. A finished handshake is never taken, nor a flow
    /// not yet filed in the expiry wheel; the ended flow gives back its
    /// admission slot and its backend's place, and its late packets find
    /// nothing. Before, a spoofed flood held the limit with flows that
    /// never finish, 60 s each, and every real client was refused.
    #[test]
    fn a_syn_at_the_limit_takes_the_oldest_embryonic_flows_place() {
        let d = daemon("nat", "max_connections = 3");
        let mut e = engine(&d);
        let table = &d.shared.conns.table;
        let now = Millis(d.shared.now_ms());
        let done = established_at(&mut e, sa("192.0.2.7:40000"), (1000, 5000), now);
        let flood = |i: u16| SocketAddr::new("198.51.100.1".parse().unwrap(), i);
        let syn = |e: &mut Engine, client: SocketAddr| {
            let mut f = frame(client, sa(VIP), Some(SYN), b"");
            e.process_at(&mut f, now)
        };
        assert_eq!(syn(&mut e, flood(1)), Verdict::Transmit);
        assert_eq!(syn(&mut e, flood(2)), Verdict::Transmit);
        // Filed in the tenant's wheel (the expiry thread's work, or the
        // early drop's when it finds nothing filed), then the maintenance
        // lock held, as a long expiry pass would: the early drop never
        // waits for it, and finds only what is filed.
        table.expire(now, 4096, &mut Vec::new());
        let hold = table.hold_maintenance();
        let live = |e: &Engine, i| table.get(&tcp_key(e, flood(i))).is_some();
        assert_eq!(syn(&mut e, flood(3)), Verdict::Transmit, "took a place");
        // 1 and 2 are due in the same tick: either may go first.
        assert_eq!(u8::from(live(&e, 1)) + u8::from(live(&e, 2)), 1);
        assert_eq!(syn(&mut e, flood(4)), Verdict::Transmit, "took the other");
        assert!(!live(&e, 1) && !live(&e, 2));
        // Left: the finished handshake, and 3 and 4, not filed (nor
        // fileable while the lock is held).
        let looks = |e: &Engine| e.counters.early_drop_looks.load(Relaxed);
        assert_eq!(looks(&e), 2);
        assert_eq!(syn(&mut e, flood(5)), Verdict::Drop);
        assert_eq!(counted(&e, Drop::Refused), 1);
        assert_eq!(e.counters.early_drops.load(Relaxed), 2);
        // The expiry pass holding the lock is filing them: the next SYN
        // looks again (before, the tenant's early drop rested 10 ms on
        // this, refusing every SYN meanwhile), and once the lock is free
        // it takes 3's or 4's place.
        assert_eq!(syn(&mut e, flood(6)), Verdict::Drop);
        assert_eq!(looks(&e), 4, "not resting");
        drop(hold);
        assert_eq!(syn(&mut e, flood(7)), Verdict::Transmit, "took a place");
        assert_eq!(u8::from(live(&e, 3)) + u8::from(live(&e, 4)), 1);
        assert_eq!(e.counters.early_drops.load(Relaxed), 3);
        // A look that found nothing is not made again for a while: a
        // flood against a tenant whose flows all heard back costs a
        // compare per SYN, not a look.
        // (The handshakes of those left finish: the backend's SYN-ACK, the
        // client's ACK.)
        for i in [3, 4, 7] {
            let Some(s) = table.get(&tcp_key(&e, flood(i))) else {
                continue;
            };
            let b = the_service(&d).backend(s.backend.0).unwrap().addr;
            for (src, dst, flags, seq) in [(b, flood(i), SYN | ACK, 1), (flood(i), sa(VIP), ACK, 2)]
            {
                let mut f = frame_seq(src, dst, Some(flags), seq, b"");
                assert_eq!(e.process_at(&mut f, now), Verdict::Transmit);
            }
            assert_eq!(table.get(&s.key).unwrap().state, FlowState::Established);
        }
        assert_eq!(syn(&mut e, flood(8)), Verdict::Drop);
        assert_eq!(looks(&e), 6);
        assert_eq!(syn(&mut e, flood(9)), Verdict::Drop);
        assert_eq!(looks(&e), 6, "resting");
        assert!(table.get(&done).is_some(), "the finished handshake stays");
        let svc = the_service(&d);
        assert_eq!(svc.tenant.active.load(Relaxed), 3);
        assert_eq!(d.shared.admission.active.load(Relaxed), 3);
        let places: u64 = svc
            .set
            .load()
            .backends
            .iter()
            .map(|b| b.active.load(Relaxed) + b.inactive.load(Relaxed))
            .sum();
        assert_eq!(places, 3, "the ended flows' backend places given back");
        // An ended flow's late ACK opens nothing.
        let mut ack = frame(flood(1), sa(VIP), Some(ACK), b"");
        assert_eq!(e.process_at(&mut ack, now), Verdict::Drop);
        assert_eq!(counted(&e, Drop::NoFlow), 1);
    }

    /// A UDP flow's first datagram at its tenant's limit takes the place
    /// of a flow that never got going: a nat flow that never heard back
    /// from its backend, or one that carried a single datagram from its
    /// client (answered or not), never of a stream (two datagrams or more
    /// each way it can see). A spoofed datagram's flow otherwise held its
    /// place for the UDP timeout (300 s by default); before, one whose
    /// backend answered (any DNS server answers a spoofed query) was kept.
    #[test]
    fn a_udp_flow_at_the_limit_takes_the_place_of_one_that_never_got_going() {
        let vip = sa("10.0.0.100:53");
        let toml = format!(
            "[daemon]\nworkers = 1\n[packet]\ninterfaces = [\"lo\"]\n\
             [[tenant]]\nname = \"a\"\nmax_connections = 3\n\
             [[service]]\ntenant = \"a\"\nname = \"dns\"\nprotocol = \"udp\"\n\
             listen = \"{vip}\"\nforward = \"nat\"\n[[service.backend]]\naddress = \"{B1}\"\n"
        );
        let d =
            super::super::Daemon::start_inner(toml::from_str(&toml).unwrap(), None, false).unwrap();
        let mut e = engine(&d);
        let table = &d.shared.conns.table;
        let now = Millis(d.shared.now_ms());
        let client = |i: u16| SocketAddr::new("198.51.100.1".parse().unwrap(), i);
        let key = |e: &Engine, i| FlowKey {
            tenant: TenantId(e.vips.by_vip.values().next().unwrap().svc.tenant.id),
            proto: Proto::Udp,
            client: client(i),
            virt: vip,
        };
        let query = |e: &mut Engine, i| {
            let mut f = frame(client(i), vip, None, b"query");
            e.process_at(&mut f, now)
        };
        let answer = |e: &mut Engine, i| {
            let mut f = frame(sa(B1), client(i), None, b"answer");
            e.process_at(&mut f, now)
        };
        // 1 is a stream; 2 asked twice and never heard back; 3 asked once
        // and was answered.
        assert_eq!(query(&mut e, 1), Verdict::Transmit);
        assert_eq!(answer(&mut e, 1), Verdict::Transmit);
        assert_eq!(query(&mut e, 1), Verdict::Transmit);
        assert_eq!(query(&mut e, 2), Verdict::Transmit);
        assert_eq!(query(&mut e, 2), Verdict::Transmit);
        assert_eq!(query(&mut e, 3), Verdict::Transmit);
        assert_eq!(answer(&mut e, 3), Verdict::Transmit);
        table.expire(now, 4096, &mut Vec::new());
        let _hold = table.hold_maintenance();
        assert_eq!(query(&mut e, 4), Verdict::Transmit, "took a place");
        assert_eq!(query(&mut e, 5), Verdict::Transmit, "took the other");
        assert_eq!(table.get(&key(&e, 2)), None);
        assert_eq!(table.get(&key(&e, 3)), None);
        assert!(table.get(&key(&e, 1)).is_some(), "1 is a stream: kept");
        // Left: 1, and 4 and 5 (not filed, nor fileable while the lock is
        // held).
        assert_eq!(query(&mut e, 6), Verdict::Drop);
        assert_eq!(counted(&e, Drop::Refused), 1);
        assert_eq!(e.counters.early_drops.load(Relaxed), 2);
        assert_eq!(d.shared.admission.active.load(Relaxed), 3);
    }

    /// A SYN at the limit takes the place of a `sloppy_tcp` pick-up that
    /// carried a single packet (a spoofed ACK opens an ESTABLISHED flow,
    /// 900 s, with sloppy_tcp on), never of one that went on both ways.
    #[test]
    fn a_syn_at_the_limit_takes_the_place_of_a_one_packet_sloppy_pickup() {
        let d = daemon("nat", "max_connections = 2");
        the_service(&d).spec.write().options.sloppy_tcp = true;
        d.shared.services_changed();
        let mut e = engine(&d);
        let table = &d.shared.conns.table;
        let now = Millis(d.shared.now_ms());
        let client = |i: u16| SocketAddr::new("198.51.100.1".parse().unwrap(), i);
        let send = |e: &mut Engine, src: SocketAddr, dst: SocketAddr, flags: u8| {
            let mut f = frame(src, dst, Some(flags), b"data");
            e.process_at(&mut f, now)
        };
        // 1 picked up mid-stream and going on both ways; 2 a lone ACK.
        assert_eq!(send(&mut e, client(1), sa(VIP), ACK), Verdict::Transmit);
        let b = table.get(&tcp_key(&e, client(1))).unwrap().backend;
        let b_addr = the_service(&d).backend(b.0).unwrap().addr;
        assert_eq!(send(&mut e, b_addr, client(1), ACK), Verdict::Transmit);
        assert_eq!(send(&mut e, client(1), sa(VIP), ACK), Verdict::Transmit);
        assert_eq!(send(&mut e, client(2), sa(VIP), ACK), Verdict::Transmit);
        for i in [1, 2] {
            let s = table.get(&tcp_key(&e, client(i))).unwrap().state;
            assert_eq!(s, FlowState::Established, "{i}");
        }
        table.expire(now, 4096, &mut Vec::new());
        assert_eq!(send(&mut e, client(3), sa(VIP), SYN), Verdict::Transmit);
        assert_eq!(table.get(&tcp_key(&e, client(2))), None, "2 gave its place");
        assert!(table.get(&tcp_key(&e, client(1))).is_some(), "1 kept");
        assert_eq!(e.counters.early_drops.load(Relaxed), 1);
        assert_eq!(d.shared.admission.active.load(Relaxed), 2);
    }

    /// Tenants a (on 10.0.0.100:80) and b (on 10.0.0.101:80), each with a
    /// dr TCP service, under the daemon's `max_connections = max`.
    fn two_tenants_dr(max: u64) -> (super::super::DaemonHandle, [SocketAddr; 2]) {
        let vips = [sa("10.0.0.100:80"), sa("10.0.0.101:80")];
        let toml = format!(
            "[daemon]\nworkers = 1\nmax_connections = {max}\n[packet]\ninterfaces = [\"lo\"]\n\
             [[tenant]]\nname = \"a\"\n[[tenant]]\nname = \"b\"\n\
             [[service]]\ntenant = \"a\"\nname = \"web\"\nprotocol = \"tcp\"\n\
             listen = \"{}\"\nforward = \"dr\"\n[[service.backend]]\naddress = \"10.0.1.2:80\"\n\
             [[service]]\ntenant = \"b\"\nname = \"web\"\nprotocol = \"tcp\"\n\
             listen = \"{}\"\nforward = \"dr\"\n[[service.backend]]\naddress = \"10.0.1.3:80\"\n",
            vips[0], vips[1]
        );
        let cfg: Config = toml::from_str(&toml).unwrap();
        let d = super::super::Daemon::start_inner(cfg, None, false).unwrap();
        (d, vips)
    }

    /// Client `i` of tenant b in the tests at the daemon's limit.
    fn b_client(i: u16) -> SocketAddr {
        SocketAddr::new("192.0.2.9".parse().unwrap(), i)
    }

    /// Source `i` of the flood against tenant a in those tests.
    fn flood_source(i: u16) -> SocketAddr {
        SocketAddr::new("198.51.100.1".parse().unwrap(), i)
    }

    /// A TCP segment with `flags` from `client` to `vip`, through `e` at
    /// `now`.
    fn segment(
        e: &mut Engine,
        now: Millis,
        client: SocketAddr,
        vip: SocketAddr,
        flags: u8,
    ) -> Verdict {
        let mut f = frame(client, vip, Some(flags), b"");
        e.process_at(&mut f, now)
    }

    /// [`two_tenants_dr`] at the daemon's limit `max` and an engine over
    /// it, where tenant b holds places: its clients 1 and 2 through their
    /// handshakes, then `b_half_open` more (3, 4, ...) mid-handshake; then
    /// the flood's first SYN against tenant a, and the table's wheel run,
    /// all at the time returned.
    fn b_held_then_a_flooded(
        max: u64,
        b_half_open: u16,
    ) -> (super::super::DaemonHandle, Engine, Millis, [SocketAddr; 2]) {
        let (d, [vip_a, vip_b]) = two_tenants_dr(max);
        let mut e = engine(&d);
        let now = Millis(d.shared.now_ms());
        for i in 1..=2 {
            let b = b_client(i);
            assert_eq!(segment(&mut e, now, b, vip_b, SYN), Verdict::Transmit);
            assert_eq!(segment(&mut e, now, b, vip_b, ACK), Verdict::Transmit);
        }
        for i in 3..3 + b_half_open {
            assert_eq!(
                segment(&mut e, now, b_client(i), vip_b, SYN),
                Verdict::Transmit
            );
        }
        let first = segment(&mut e, now, flood_source(1), vip_a, SYN);
        assert_eq!(first, Verdict::Transmit);
        d.shared.conns.table.expire(now, 4096, &mut Vec::new());
        (d, e, now, [vip_a, vip_b])
    }

    /// The key of a TCP flow to `vip` in the tenant whose service it is.
    fn key_at(e: &Engine, client: SocketAddr, vip: SocketAddr) -> FlowKey {
        FlowKey {
            tenant: TenantId(e.vips.by_vip[&(vip.ip(), 6, vip.port())].svc.tenant.id),
            proto: Proto::Tcp,
            client,
            virt: vip,
        }
    }

    /// A spoofed SYN flood against tenant a that fills the daemon's
    /// `max_connections`: a real client of tenant b takes the place of one
    /// of the flood's flows. Before, b's SYN looked only among b's own
    /// flows, found none, and was refused: a flood against one tenant
    /// locked every other tenant out.
    #[test]
    fn a_flood_at_the_daemons_limit_leaves_room_for_other_tenants() {
        let (d, [vip_a, vip_b]) = two_tenants_dr(3);
        let mut e = engine(&d);
        let table = &d.shared.conns.table;
        let now = Millis(d.shared.now_ms());
        let flood = |i: u16| SocketAddr::new("198.51.100.1".parse().unwrap(), i);
        let syn = |e: &mut Engine, client: SocketAddr, vip: SocketAddr| {
            let mut f = frame(client, vip, Some(SYN), b"");
            e.process_at(&mut f, now)
        };
        for i in 1..=3 {
            assert_eq!(syn(&mut e, flood(i), vip_a), Verdict::Transmit);
        }
        table.expire(now, 4096, &mut Vec::new());
        // The flood goes on at the limit: each SYN takes the place of one
        // of its own.
        assert_eq!(syn(&mut e, flood(4), vip_a), Verdict::Transmit);
        let real = sa("192.0.2.9:5000");
        assert_eq!(syn(&mut e, real, vip_b), Verdict::Transmit, "b let in");
        assert!(table.get(&key_at(&e, real, vip_b)).is_some());
        let a_live = (1..=4)
            .filter(|&i| table.get(&key_at(&e, flood(i), vip_a)).is_some())
            .count();
        assert_eq!(a_live, 2, "two of the flood's flows gave their places");
        assert_eq!(e.counters.early_drops.load(Relaxed), 2);
        assert_eq!(counted(&e, Drop::Refused), 0);
        assert_eq!(d.shared.admission.active.load(Relaxed), 3);
        let tenant_active = |vip: SocketAddr| {
            e.vips.by_vip[&(vip.ip(), 6, vip.port())]
                .svc
                .tenant
                .active
                .load(Relaxed)
        };
        assert_eq!((tenant_active(vip_a), tenant_active(vip_b)), (2, 1));
    }

    /// The place a flood's SYN takes at the daemon's limit is never a
    /// bystander's: tenant b holds most places (two finished handshakes)
    /// and has a client mid-handshake; a flood against tenant a ends only
    /// a's own flows, and b's handshake survives it.
    #[test]
    fn a_flood_at_the_daemons_limit_never_ends_a_bystanders_handshake() {
        let (d, mut e, now, [vip_a, vip_b]) = b_held_then_a_flooded(4, 1);
        let table = &d.shared.conns.table;
        for i in 2..=20 {
            let syn = segment(&mut e, now, flood_source(i), vip_a, SYN);
            assert_eq!(syn, Verdict::Transmit);
        }
        for i in 1..=3 {
            assert!(
                table.get(&key_at(&e, b_client(i), vip_b)).is_some(),
                "b's {i}"
            );
        }
        assert_eq!(e.counters.early_drops.load(Relaxed), 19);
        assert_eq!(d.shared.admission.active.load(Relaxed), 4);
    }

    /// The worker stalls in the middle of a flood against tenant a at the
    /// daemon's limit (the machine busy elsewhere), and the first SYN
    /// after the stall is a real client's of tenant b. b takes one of the
    /// flood's places. Before, `Pressing` counted only the flows that met
    /// the limit since its last look: a none, b one, so it picked b, whose
    /// look found nothing of its own to give, and b's SYNs were refused
    /// until the pick's period ended (the bench row `synflood-tenants`).
    #[test]
    fn a_real_clients_syn_after_a_stall_in_a_flood_still_takes_the_floods_place() {
        let (d, [vip_a, vip_b]) = two_tenants_dr(3);
        let mut e = engine(&d);
        let table = &d.shared.conns.table;
        let t0 = d.shared.now_ms();
        let flood = |i: u16| SocketAddr::new("198.51.100.1".parse().unwrap(), i);
        let syn = |e: &mut Engine, client: SocketAddr, vip: SocketAddr, at: u64| {
            let mut f = frame(client, vip, Some(SYN), b"");
            e.process_at(&mut f, Millis(at))
        };
        for i in 1..=3 {
            assert_eq!(syn(&mut e, flood(i), vip_a, t0), Verdict::Transmit);
        }
        table.expire(Millis(t0), 4096, &mut Vec::new());
        // The flood at the limit, each SYN taking the place of one of its
        // own, over two of `Pressing`'s periods; the last SYN is the
        // last look before the stall.
        let mut i = 4;
        for (at, n) in [(t0, 5), (t0 + 2, 22), (t0 + 15, 1)] {
            for _ in 0..n {
                assert_eq!(syn(&mut e, flood(i), vip_a, at), Verdict::Transmit);
                i += 1;
            }
        }
        table.expire(Millis(t0 + 15), 4096, &mut Vec::new());
        let real = sa("192.0.2.9:5000");
        assert_eq!(
            syn(&mut e, real, vip_b, t0 + 40),
            Verdict::Transmit,
            "b let in after the stall"
        );
        assert!(table.get(&key_at(&e, real, vip_b)).is_some());
        assert_eq!(counted(&e, Drop::Refused), 0);
        assert_eq!(d.shared.admission.active.load(Relaxed), 3);
    }

    /// A tenant that presses hardest on the daemon's limit but has no
    /// flow to give (its clients all finished their handshakes) is passed
    /// over for the next one pressing on it: b's clients met the limit
    /// more often than a's flood, b has nothing to take, a's flood does.
    #[test]
    fn a_pick_with_nothing_to_give_is_passed_over_for_the_next() {
        let (d, mut e, now, [vip_a, vip_b]) = b_held_then_a_flooded(3, 0);
        let table = &d.shared.conns.table;
        // b's clients meet the limit three times (refused: `Pressing` has
        // no evidence yet, and b has nothing of its own to take), a's
        // flood once (taking its own flow's place).
        let at_limit = |e: &Engine, vip: SocketAddr| {
            (e.vips.by_vip[&(vip.ip(), 6, vip.port())].svc.tenant)
                .at_daemon_limit
                .load(Relaxed)
        };
        for i in 10..13 {
            assert_eq!(segment(&mut e, now, b_client(i), vip_b, SYN), Verdict::Drop);
        }
        assert_eq!(
            segment(&mut e, now, flood_source(2), vip_a, SYN),
            Verdict::Transmit
        );
        assert_eq!((at_limit(&e, vip_a), at_limit(&e, vip_b)), (1, 3));
        assert_eq!(counted(&e, Drop::Refused), 3);
        // Once b's rest is over: b scores highest, finds nothing, rests;
        // a is next.
        let later = Millis(now.0 + EARLY_DROP_BACKOFF_MS + 1);
        let mut f = frame(b_client(20), vip_b, Some(SYN), b"");
        assert_eq!(e.process_at(&mut f, later), Verdict::Transmit, "b let in");
        assert!(table.get(&key_at(&e, b_client(20), vip_b)).is_some());
        assert_eq!(d.shared.admission.active.load(Relaxed), 3);
    }

    /// The same defence when the tenant's own table is at its cap
    /// (`max_table_entries`): the SYN's insert, refused, is made again in
    /// the embryonic flow's place.
    #[test]
    fn a_syn_into_a_full_table_takes_the_oldest_embryonic_flows_place() {
        let d = daemon("dr", "table_entries = 16\nmax_table_entries = 16");
        let mut e = engine(&d);
        let table = &d.shared.conns.table;
        let now = Millis(d.shared.now_ms());
        let client = |i: u16| SocketAddr::new("198.51.100.1".parse().unwrap(), i);
        let mut syn = |i: u16, at: Millis| {
            let mut f = frame(client(i), sa(VIP), Some(SYN), b"");
            e.process_at(&mut f, at)
        };
        // Filled with the maintenance lock held: nothing filed in the
        // wheel, nothing fileable, so the SYN that finds the table full is
        // refused.
        let hold = table.hold_maintenance();
        let mut filled = 0;
        while filled < 64 && syn(filled + 1, now) == Verdict::Transmit {
            filled += 1;
        }
        assert!((16..64).contains(&filled), "the cap holds: {filled}");
        drop(hold);
        table.expire(now, 4096, &mut Vec::new());
        let _hold = table.hold_maintenance();
        // Once the fruitless look's rest is over.
        let later = Millis(now.0 + EARLY_DROP_BACKOFF_MS);
        assert_eq!(
            syn(100, later),
            Verdict::Transmit,
            "took an embryonic flow's place"
        );
        let gone = (1..=filled)
            .filter(|&i| table.get(&tcp_key(&e, client(i))).is_none())
            .count();
        assert_eq!(gone, 1);
        assert!(table.get(&tcp_key(&e, client(100))).is_some());
        assert_eq!(e.counters.early_drops.load(Relaxed), 1);
        assert_eq!(
            d.shared.admission.refused.snapshot().get("table_full"),
            Some(&1),
            "only the SYN that found it full before anything was filed"
        );
        assert_eq!(d.shared.admission.active.load(Relaxed), filled as u64);
    }

    /// Next hops out of interface 1, whose MTU is 1280.
    struct SmallMtu;
    impl NextHops for SmallMtu {
        fn next_hop(&mut self, _dst: IpAddr) -> Option<(u32, NextHop)> {
            Some((1, HOP))
        }
        fn links(&mut self) -> Vec<Link> {
            vec![Link {
                ifindex: 1,
                mtu: 1280,
                v4: Some("10.0.0.1".parse().unwrap()),
                v6: None,
            }]
        }
    }

    /// A router's MTU check: a packet of a flow larger than the next hop's
    /// MTU is answered with "fragmentation needed" from weir's address,
    /// quoting the client's packet as it sent it; one that fits goes on.
    #[test]
    fn too_big_for_the_next_hop_is_answered_as_a_router_would() {
        let d = daemon("nat", "");
        let mut e = engine_with(&d, Box::new(SmallMtu));
        let client = sa("192.0.2.7:5555");
        let mut syn = frame(client, sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut syn), Verdict::Transmit);
        let big = frame(client, sa(VIP), Some(ACK), &[7; 1400]);
        let mut f = big.clone();
        let Verdict::Answer(len) = e.process(&mut f) else {
            panic!("expected an ICMP answer");
        };
        f.truncate(len);
        assert_eq!(counted(&e, Drop::TooBig), 1);
        let p = weir_packet::parse(&f).expect("an ICMP packet");
        assert_eq!(p.src, "10.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(p.dst, client.ip());
        let emb = weir_packet::icmp::parse_error(&f, &p).unwrap().unwrap();
        assert_eq!(emb.kind, weir_packet::ErrorKind::PacketTooBig { mtu: 1280 });
        assert_eq!((emb.tuple.src, emb.tuple.dst), (client, sa(VIP)));
        assert_eq!(&f[..6], &big[6..12], "back to the sender's MAC");
        // A packet that fits is forwarded.
        let mut small = frame(client, sa(VIP), Some(ACK), &[7; 1200]);
        assert_eq!(e.process(&mut small), Verdict::Transmit);
        assert_eq!(counted(&e, Drop::TooBig), 1);
    }

    /// A packet answered as too big (or dropped for it) never reached the
    /// backend: it is not the flow's traffic. Before, its bytes and packet
    /// went into the flow, the service, the tenant and the backend, it
    /// kept the flow alive, and its flags moved the TCP state (a too-big
    /// FIN to CLOSE_WAIT, though the backend never saw that FIN): a client
    /// could pad any tenant's traffic figures with packets weir dropped.
    #[test]
    fn a_packet_answered_as_too_big_is_not_counted_as_forwarded() {
        let d = daemon("nat", "");
        let mut e = engine_with(&d, Box::new(SmallMtu));
        let client = sa("192.0.2.7:5555");
        let mut syn = frame_seq(client, sa(VIP), Some(SYN), 100, b"");
        assert_eq!(e.process(&mut syn), Verdict::Transmit);
        let mut synack = frame_seq(sa(B1), client, Some(SYN | ACK), 900, b"");
        assert_eq!(e.process(&mut synack), Verdict::Transmit);
        let mut ack = frame_seq(client, sa(VIP), Some(ACK), 101, b"");
        assert_eq!(e.process(&mut ack), Verdict::Transmit);
        let key = tcp_key(&e, client);
        let before = d.shared.conns.table.get(&key).unwrap();
        assert_eq!(before.state, FlowState::Established);
        let svc = the_service(&d);
        let totals = |d: &super::super::DaemonHandle| {
            let t = the_service(d).stat.read().0;
            let b = the_service(d)
                .backend(before.backend.0)
                .unwrap()
                .stat
                .read()
                .0;
            let tn = the_service(d).tenant.stat.read().0;
            (
                t.inpkts, t.inbytes, b.inpkts, b.inbytes, tn.inpkts, tn.inbytes,
            )
        };
        let was = totals(&d);
        for i in 0..10 {
            let mut big = frame_seq(client, sa(VIP), Some(FIN | ACK), 101, &[7; 1400]);
            assert!(
                matches!(e.process(&mut big), Verdict::Answer(_)),
                "answered {i}"
            );
        }
        assert_eq!(counted(&e, Drop::TooBig), 10);
        let after = d.shared.conns.table.get(&key).unwrap();
        assert_eq!(after.state, FlowState::Established, "a FIN never forwarded");
        assert_eq!(
            (after.packets_in, after.bytes_in),
            (before.packets_in, before.bytes_in),
            "the flow's figures"
        );
        assert_eq!(totals(&d), was, "service, backend and tenant figures");
        let b = svc.backend(before.backend.0).unwrap();
        assert_eq!((b.active.load(Relaxed), b.inactive.load(Relaxed)), (1, 0));
        // What fits is counted as before.
        let mut small = frame_seq(client, sa(VIP), Some(ACK), 101, &[7; 1000]);
        assert_eq!(e.process(&mut small), Verdict::Transmit);
        let now = d.shared.conns.table.get(&key).unwrap();
        assert_eq!(now.packets_in, before.packets_in + 1);
    }

    /// `weir kill COOKIE` of a packet flow: the cookie names its entry (one
    /// node read, no search), which is removed and settled — admission
    /// slot and template hold given back. A second kill, another tenant's
    /// kill and a persistence template's cookie find nothing.
    #[test]
    fn a_packet_flow_is_killed_by_its_cookie() {
        let d = daemon_with("nat", "", "persistence = \"1s\"");
        let mut e = engine(&d);
        let mut syn = frame(sa("192.0.2.7:1"), sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut syn), Verdict::Transmit);
        let table = &d.shared.conns.table;
        let mut all = Vec::new();
        table.dump(None, &weir_flowtable::DumpFilter::default(), 100, &mut all);
        let (tpl, flow): (Vec<_>, Vec<_>) =
            all.into_iter().partition(|s| s.state == FlowState::Persist);
        let (tpl, flow) = (&tpl[0], &flow[0]);
        assert_eq!(tpl.held, 1);
        let c = d.control();
        let not_found = |r: crate::control::ControlResult<()>| matches!(r, Err(e) if e.kind == crate::control::ErrorKind::NotFound);
        assert!(
            not_found(c.kill(tpl.cookie.0, None)),
            "a template is no connection"
        );
        assert!(not_found(c.kill(flow.cookie.0, Some("nosuch"))));
        assert_eq!(d.shared.admission.active.load(Relaxed), 1);
        c.kill(flow.cookie.0, Some("default")).unwrap();
        assert_eq!(table.get_cookie(flow.cookie), None);
        assert_eq!(d.shared.admission.active.load(Relaxed), 0);
        assert_eq!(table.get(&tpl.key).map(|t| t.held), Some(0));
        assert!(not_found(c.kill(flow.cookie.0, None)));
    }

    /// The ICMP errors a worker sends are rate-limited as Linux limits its
    /// own: a burst of 50, then one per millisecond; an oversized packet
    /// past the budget is dropped unanswered and counted.
    #[test]
    fn too_big_answers_are_rate_limited() {
        let d = daemon("nat", "");
        let mut e = engine_with(&d, Box::new(SmallMtu));
        let client = sa("192.0.2.7:5555");
        let t0 = d.shared.now_ms();
        let at = |ms: u64| Millis(t0 + ms);
        let mut syn = frame(client, sa(VIP), Some(SYN), b"");
        assert_eq!(e.process_at(&mut syn, at(0)), Verdict::Transmit);
        let big = frame(client, sa(VIP), Some(ACK), &[7; 1400]);
        let answered = |e: &mut Engine, n: u64, now: Millis| {
            (0..n)
                .filter(|_| matches!(e.process_at(&mut big.clone(), now), Verdict::Answer(_)))
                .count() as u64
        };
        let burst = IcmpBudget::BURST;
        assert_eq!(answered(&mut e, burst + 20, at(0)), burst);
        assert_eq!(counted(&e, Drop::IcmpLimited), 20);
        // 5 ms later: 5 more tokens, no more.
        assert_eq!(answered(&mut e, 20, at(5)), 5);
        // A quiet second refills the burst, not more.
        assert_eq!(answered(&mut e, burst + 20, at(2_000)), burst);
        assert_eq!(counted(&e, Drop::IcmpLimited), 20 + 15 + 20);
        assert_eq!(counted(&e, Drop::TooBig), 2 * burst + 5);
        // Packets that fit are not held back by a spent budget.
        let mut small = frame(client, sa(VIP), Some(ACK), &[7; 1200]);
        assert_eq!(e.process_at(&mut small, at(2_000)), Verdict::Transmit);
    }

    /// While the daemon drains, first packets open no flow; live flows go on.
    #[test]
    fn draining_refuses_new_flows_only() {
        let d = daemon("nat", "");
        let mut e = engine(&d);
        let mut syn = frame(sa("192.0.2.7:1"), sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut syn), Verdict::Transmit);
        d.shared.admission.stop_accept.cancel();
        let mut other = frame(sa("192.0.2.7:2"), sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut other), Verdict::Drop);
        assert_eq!(counted(&e, Drop::Draining), 1);
        let mut more = frame(sa("192.0.2.7:1"), sa(VIP), Some(ACK), b"x");
        assert_eq!(e.process(&mut more), Verdict::Transmit);
    }

    /// `tcp_max_connections_per_client` counts a client's packet flows
    /// from their first packet to their end: the client at its cap has new
    /// flows refused (others do not), and a flow's end gives its place back.
    #[test]
    fn per_client_cap_counts_flows_until_they_end() {
        let d = daemon_with("nat", "", "tcp_max_connections_per_client = 2");
        let mut e = engine(&d);
        let syn = |c: &str| frame(sa(c), sa(VIP), Some(SYN), b"");
        for c in ["192.0.2.7:1", "192.0.2.7:2"] {
            assert_eq!(e.process(&mut syn(c)), Verdict::Transmit, "{c}");
        }
        assert_eq!(e.process(&mut syn("192.0.2.7:3")), Verdict::Drop);
        assert_eq!(counted(&e, Drop::Refused), 1);
        assert_eq!(
            d.shared
                .admission
                .refused
                .snapshot()
                .get("tcp_client_limit"),
            Some(&1)
        );
        // Another client is not held back; the capped one's flows still flow.
        assert_eq!(e.process(&mut syn("192.0.2.8:1")), Verdict::Transmit);
        let mut more = frame(sa("192.0.2.7:1"), sa(VIP), Some(ACK), b"x");
        assert_eq!(e.process(&mut more), Verdict::Transmit);
        // One of its flows ends: one new flow fits again, not two.
        let killed = d.shared.kill_where(
            super::super::owners::Close::Killed,
            &weir_flowtable::DumpFilter::default(),
            |s| s.key.client == sa("192.0.2.7:1"),
        );
        assert_eq!(killed, 1);
        assert_eq!(e.process(&mut syn("192.0.2.7:4")), Verdict::Transmit);
        assert_eq!(e.process(&mut syn("192.0.2.7:5")), Verdict::Drop);
        assert_eq!(counted(&e, Drop::Refused), 2);
        // All gone: nothing stays counted.
        d.shared.kill_where(
            super::super::owners::Close::Killed,
            &weir_flowtable::DumpFilter::default(),
            |_| true,
        );
        let svc = the_service(&d);
        assert!(svc.tcp_per_client.lock().is_empty());
        assert_eq!(d.shared.admission.active.load(Relaxed), 0);
    }

    /// Packet flows hold their client group's persistence template (the
    /// entry's owner token says so), so it cannot expire while they live;
    /// their end releases it whatever the service's persistence is by
    /// then, and turning persistence off drops the templates.
    #[test]
    fn packet_flows_hold_their_persistence_template() {
        let d = daemon_with("nat", "", "persistence = \"1s\"");
        let mut e = engine(&d);
        let syn = |c: &str| frame(sa(c), sa(VIP), Some(SYN), b"");
        for c in ["192.0.2.7:1", "192.0.2.7:2"] {
            assert_eq!(e.process(&mut syn(c)), Verdict::Transmit, "{c}");
        }
        let svc = the_service(&d);
        let tpl = template_of(&svc, "192.0.2.7:1");
        let table = &d.shared.conns.table;
        let t = table.get(&tpl).expect("the template");
        assert_eq!((t.state, t.held), (FlowState::Persist, 2));
        let mut flows = Vec::new();
        table.dump(
            None,
            &weir_flowtable::DumpFilter::default(),
            100,
            &mut flows,
        );
        flows.retain(|s| s.state != FlowState::Persist);
        assert_eq!(flows.len(), 2);
        for f in &flows {
            assert_eq!(f.backend, t.backend, "persistence placed {f:?}");
            let owner = PacketOwner::of(f.owner).expect("a packet flow");
            assert!(owner.held && !owner.counted, "{owner:?}");
        }
        // A longer persistence keeps the key: the templates stay, and the
        // flows' ends release them.
        let mut spec = svc.spec.read().clone();
        spec.persistence = "5s".parse().unwrap();
        d.control()
            .edit_service("default", "web", spec.clone())
            .unwrap();
        let kill = |port: u16| {
            d.shared.kill_where(
                super::super::owners::Close::Killed,
                &weir_flowtable::DumpFilter::default(),
                |s| s.key.client == sa(&format!("192.0.2.7:{port}")),
            )
        };
        assert_eq!(kill(1), 1);
        assert_eq!(table.get(&tpl).map(|t| t.held), Some(1));
        assert_eq!(kill(2), 1);
        assert_eq!(table.get(&tpl).map(|t| t.held), Some(0));
        // A third flow holds it again; persistence off drops it, and the
        // flow's end then releases nothing.
        assert_eq!(e.process(&mut syn("192.0.2.7:3")), Verdict::Transmit);
        assert_eq!(table.get(&tpl).map(|t| t.held), Some(1));
        spec.persistence = "0s".parse().unwrap();
        d.control().edit_service("default", "web", spec).unwrap();
        assert_eq!(table.get(&tpl), None);
        assert_eq!(kill(3), 1);
        assert_eq!(table.get(&tpl), None);
        assert_eq!(d.shared.admission.active.load(Relaxed), 0);
    }

    /// A packet flow's owner token reads back as it was written, whatever
    /// its template's tag, and no token of a task's (below 2^24) reads as
    /// a packet flow's. Two templates in one node, or with one use count,
    /// never share a tag.
    #[test]
    fn a_packet_owner_token_keeps_its_template_tag() {
        for template in [0, 1, 0x1234_5678 & ((1 << 29) - 1), (1 << 29) - 1] {
            for (counted, held) in [(false, false), (true, false), (false, true), (true, true)] {
                let o = PacketOwner {
                    counted,
                    held,
                    template,
                };
                assert_eq!(PacketOwner::of(o.token()), Some(o));
            }
        }
        for task in [0, 1, (1 << 24) - 1, 1 << 24] {
            assert_eq!(PacketOwner::of(task), None, "{task:#x}");
        }
        let tag = |idx: u64, uses: u64| {
            super::super::model::template_tag(weir_flowtable::Cookie(uses << 28 | idx))
        };
        let mut seen = std::collections::HashSet::new();
        for uses in 1..=50_000 {
            assert!(seen.insert(tag(77, uses)), "node 77, use {uses}");
        }
        seen.clear();
        for idx in 0..50_000 {
            assert!(seen.insert(tag(idx, 3)), "node {idx}, use 3");
        }
        assert_ne!(tag(77, 1), tag(77, (1 << 28) - 1));
    }

    /// A packet flow's end gives back the hold it took on the template it
    /// held, not one on a newer template stored under the same key after
    /// its own was dropped (persistence turned off and on again, or a mask
    /// edit that makes the key computed at its end the new template's).
    /// Releasing the newer template's hold left it unheld under the flow
    /// that did hold it: it expired after its persistence while that flow
    /// lived, and the client group was placed afresh.
    #[test]
    fn a_packet_flows_end_leaves_a_newer_template_held() {
        let d = daemon_with("nat", "", "persistence = \"30s\"");
        let mut e = engine(&d);
        let syn = |c: &str| frame(sa(c), sa(VIP), Some(SYN), b"");
        let svc = the_service(&d);
        let table = &d.shared.conns.table;
        let key_now = || template_of(&svc, "192.0.2.7:1");
        let edit = |persistence: &str, mask: Option<&str>| {
            let mut spec = svc.spec.read().clone();
            spec.persistence = persistence.parse().unwrap();
            if let Some(m) = mask {
                spec.persistence_netmask = Some(m.into());
            }
            d.control().edit_service("default", "web", spec).unwrap();
        };
        let kill = |port: u16| {
            d.shared.kill_where(
                super::super::owners::Close::Killed,
                &weir_flowtable::DumpFilter::default(),
                |s| s.key.client == sa(&format!("192.0.2.7:{port}")),
            )
        };
        // A mask edit: the old flow's end computes the new key.
        assert_eq!(e.process(&mut syn("192.0.2.7:1")), Verdict::Transmit);
        edit("30s", Some("255.255.255.0"));
        assert_eq!(e.process(&mut syn("192.0.2.7:2")), Verdict::Transmit);
        assert_eq!(table.get(&key_now()).map(|t| t.held), Some(1));
        assert_eq!(kill(1), 1);
        let after_mask_edit = table.get(&key_now()).map(|t| t.held);
        assert_eq!(kill(2), 1);
        assert_eq!(table.get(&key_now()).map(|t| t.held), Some(0));
        // Off and on again: the same key, a new template.
        assert_eq!(e.process(&mut syn("192.0.2.7:3")), Verdict::Transmit);
        let first = table.get(&key_now()).expect("the first template");
        assert_eq!(first.held, 1);
        edit("0s", None);
        edit("30s", None);
        assert_eq!(e.process(&mut syn("192.0.2.7:4")), Verdict::Transmit);
        let second = table.get(&key_now()).expect("the second template");
        assert_ne!(second.cookie, first.cookie);
        assert_eq!(second.held, 1);
        assert_eq!(kill(3), 1);
        let after_off_and_on = table.get(&key_now()).map(|t| t.held);
        assert_eq!(
            (after_mask_edit, after_off_and_on),
            (Some(1), Some(1)),
            "an old flow's end took the new template's hold (after a mask edit, \
             after persistence off and on)"
        );
        // Held, it outlives its persistence while the flow it placed
        // lives; that flow's end (its own expiry here, settled as the
        // expiry thread settles it) releases it.
        let mut out = Vec::new();
        table.expire(Millis(d.shared.now_ms() + 45_000), 1000, &mut out);
        assert!(
            out.iter().all(|s| s.state != FlowState::Persist),
            "the template expired under its flow: {out:?}"
        );
        assert_eq!(table.get(&key_now()).map(|t| t.held), Some(1));
        d.shared
            .ended(&out, super::super::owners::Close::IdleTimeout);
        kill(4);
        assert_eq!(table.get(&key_now()).map(|t| t.held), Some(0));
    }

    /// A packet from source port 0 has its client group's persistence
    /// template's key (`(group, 0)`, same VIP and protocol): found as if it
    /// were a flow, it was forwarded on the template's entry (and an RST
    /// could move the template out of its `Persist` state, losing its
    /// holds). Port 0 is no client's (TCP and UDP reserve it; no reply can
    /// reach it): such packets are dropped before any lookup, TCP and UDP,
    /// and the template is left as it was.
    #[test]
    fn a_packet_from_port_0_does_not_reach_the_persistence_template() {
        let d = daemon_with("nat", "", "persistence = \"30s\"");
        let mut e = engine(&d);
        let syn = |c: &str, flags: u8| frame(sa(c), sa(VIP), Some(flags), b"");
        assert_eq!(e.process(&mut syn("192.0.2.7:1", SYN)), Verdict::Transmit);
        let svc = the_service(&d);
        let tpl = template_of(&svc, "192.0.2.7:1");
        let table = &d.shared.conns.table;
        let before = table.get(&tpl).expect("the template");
        assert_eq!((before.state, before.held), (FlowState::Persist, 1));
        for flags in [SYN, ACK, RST, RST | ACK] {
            assert_eq!(
                e.process(&mut syn("192.0.2.7:0", flags)),
                Verdict::Drop,
                "flags {flags:#x}"
            );
        }
        let after = table.get(&tpl).expect("the template");
        assert_eq!(
            (after.state, after.held, after.packets_in),
            (FlowState::Persist, 1, before.packets_in)
        );
        assert_eq!(e.counters.dropped[Drop::ZeroPort as usize].load(Relaxed), 4);
    }

    /// Every worker reads one snapshot of the packet services, built once
    /// per change of them: each worker used to build its own, a walk of
    /// every service and backend on the packet path itself.
    #[test]
    fn workers_share_one_services_snapshot_built_once_per_change() {
        let d = daemon("nat", "");
        let (mut a, mut b) = (engine(&d), engine(&d));
        assert!(Arc::ptr_eq(&a.vips, &b.vips));
        a.refresh();
        assert!(Arc::ptr_eq(&a.vips, &b.vips), "no change, no new one");
        let before = a.vips.clone();
        let mut spec = the_service(&d).spec.read().clone();
        spec.name = "web2".into();
        spec.listen = sa("10.0.0.101:80");
        d.control().add_service(spec).unwrap();
        a.refresh();
        b.refresh();
        assert!(!Arc::ptr_eq(&a.vips, &before), "a new one after a change");
        assert!(Arc::ptr_eq(&a.vips, &b.vips), "one for both workers");
        let vip = sa("10.0.0.101:80");
        assert!(a.vips.by_vip.contains_key(&(vip.ip(), 6, vip.port())));
        assert_eq!(a.vips.by_vip.len(), 2);
    }

    /// Two tenants' nat services share a backend address: a client's flow
    /// through one and a flow from the same client address and port
    /// through the other are the same packets at the backend, and their
    /// replies the same packets at weir. Before, the second flow opened
    /// (an attacker who guessed a client's port needed one spoofed
    /// datagram to another tenant's VIP), and the backend's replies to the
    /// client went to whichever service came first among the reply
    /// candidates: they left from the attacker's VIP, and the victim's
    /// flow stopped hearing its backend. The second flow is refused.
    #[test]
    fn a_nat_reply_key_of_another_tenant_cannot_be_taken() {
        let (vip_a, vip_b) = (sa("10.0.0.100:53"), sa("10.0.0.101:53"));
        let d = two_tenants_dns(vip_a, vip_b, B1, "");
        let mut e = engine(&d);
        // The victim's service is the one the replies' candidates list
        // second (their order is a hash map's): the attacker's comes first.
        let cands = &e.vips.by_backend[&(sa(B1).ip(), 17, sa(B1).port())];
        let (attacker, victim) = (cands[0].services[0].0, cands[1].services[0].0);
        let victim_tenant = cands[1].tenant;
        let client = sa("192.0.2.7:40000");
        let mut q = frame(client, victim, None, b"query");
        assert_eq!(e.process(&mut q), Verdict::Transmit);
        assert_eq!(verified(&q).dst, sa(B1));
        // The attacker's spoofed datagram from the victim's endpoint.
        let mut spoof = frame(client, attacker, None, b"spoof");
        assert_eq!(e.process(&mut spoof), Verdict::Drop, "to {attacker}");
        assert_eq!(counted(&e, Drop::ReplyTaken), 1);
        assert_eq!(e.counters.new_flows.load(Relaxed), 1);
        // Everything the refused flow took was given back.
        assert_eq!(d.shared.admission.active.load(Relaxed), 1);
        // The backend's answer still reaches the victim from its VIP.
        let mut answer = frame(sa(B1), client, None, b"answer");
        assert_eq!(e.process(&mut answer), Verdict::Transmit);
        let t = verified(&answer);
        assert_eq!((t.src, t.dst), (victim, client), "the victim's VIP");
        // The victim's flow, once gone, leaves the endpoint to the other.
        let key = FlowKey {
            tenant: victim_tenant,
            proto: Proto::Udp,
            client,
            virt: victim,
        };
        let snap = d.shared.conns.table.remove(&key).unwrap();
        d.shared.ended(&[snap], super::super::owners::Close::Killed);
        let mut again = frame(client, attacker, None, b"now");
        assert_eq!(e.process(&mut again), Verdict::Transmit);
        assert_eq!(counted(&e, Drop::ReplyTaken), 1);
    }

    /// A tenant's token may create services (`max_services` 0: no cap) on
    /// any backend address, another tenant's too. A packet from that
    /// address was probed with one reply-key lookup per service there, so
    /// a spoofed reply cost the worker time in proportion to services an
    /// attacker made (85 µs at 1,000). A reply is now looked up once per
    /// tenant at the address: every backend of a tenant at one address has
    /// one id.
    #[test]
    fn a_reply_costs_one_lookup_per_tenant_however_many_services_share_its_backend() {
        const N: usize = 40;
        let mut toml = String::from(
            "[daemon]\nworkers = 1\n[packet]\ninterfaces = [\"lo\"]\n\
             [[tenant]]\nname = \"a\"\n[[tenant]]\nname = \"b\"\n",
        );
        let vip = |i: usize| sa(&format!("10.0.2.{}:53", i + 1));
        for i in 0..N {
            toml += &format!(
                "[[service]]\ntenant = \"a\"\nname = \"s{i}\"\nprotocol = \"udp\"\n\
                 listen = \"{}\"\nforward = \"nat\"\n[[service.backend]]\naddress = \"{B1}\"\n",
                vip(i)
            );
        }
        toml += &format!(
            "[[service]]\ntenant = \"b\"\nname = \"dns\"\nprotocol = \"udp\"\n\
             listen = \"{}\"\nforward = \"nat\"\n[[service.backend]]\naddress = \"{B1}\"\n",
            vip(N)
        );
        let cfg: Config = toml::from_str(&toml).unwrap();
        let d = super::super::Daemon::start_inner(cfg, None, false).unwrap();
        let mut e = engine(&d);
        let lookups = |e: &Engine| e.counters.reply_lookups.load(Relaxed);
        // A spoofed reply: no flow has it.
        let mut spoof = frame(sa(B1), sa("192.0.2.9:4000"), None, b"spoof");
        assert_eq!(e.process(&mut spoof), Verdict::Drop);
        assert_eq!(counted(&e, Drop::NoFlow), 1);
        assert!(
            lookups(&e) <= 2,
            "{} lookups for one spoofed reply: one per service",
            lookups(&e)
        );
        // Every service's flow still gets its replies, from its own VIP,
        // however the candidates are ordered.
        for i in [0, N / 2, N - 1, N] {
            let client = SocketAddr::new(sa("192.0.2.1:0").ip(), 10_000 + i as u16);
            let mut q = frame(client, vip(i), None, b"query");
            assert_eq!(e.process(&mut q), Verdict::Transmit, "service {i}");
            assert_eq!(verified(&q).dst, sa(B1));
            let before = lookups(&e);
            let mut answer = frame(sa(B1), client, None, b"answer");
            assert_eq!(e.process(&mut answer), Verdict::Transmit, "service {i}");
            let t = verified(&answer);
            assert_eq!((t.src, t.dst), (vip(i), client), "service {i}");
            assert!(lookups(&e) - before <= 2, "service {i}");
            // The batched probe's one lookup finds it too when the
            // service's tenant is the first at the address.
            let pkt = weir_packet::parse(&frame(sa(B1), client, None, b"more")).unwrap();
            let vips = Arc::clone(&e.vips);
            let (probe, _) = e.probe(&vips, &pkt).unwrap();
            let Probe::Reply(rk) = probe else {
                panic!("a reply's probe")
            };
            let first_tenant = rk.tenant;
            let flow_tenant = e.vips.by_vip[&(vip(i).ip(), 17, 53)].svc.tenant.id;
            if first_tenant.0 == flow_tenant {
                assert!(
                    d.shared.conns.table.lookup_reply(&rk).is_some(),
                    "service {i}: the batched probe missed its reply"
                );
            }
        }
    }

    /// fnat's ports of a (local address, backend) pool were shared by
    /// every tenant with services on the backend: spoofed SYNs at ~333/s
    /// on one tenant's service filled 20,000 ports within a minute, and
    /// another tenant's service to the same backend opened no flow. Each
    /// tenant now holds at most its share of the pool.
    #[test]
    fn a_tenant_filling_the_fnat_ports_leaves_another_tenant_its_share() {
        let (vip_a, vip_b) = (sa("10.0.0.100:80"), sa("10.0.0.101:80"));
        let toml = format!(
            "[daemon]\nworkers = 1\n[packet]\ninterfaces = [\"lo\"]\n\
             local_addresses = [\"{LOCAL}\"]\nfnat_ports = \"40000-40009\"\n\
             [[tenant]]\nname = \"a\"\n[[tenant]]\nname = \"b\"\n\
             [[service]]\ntenant = \"a\"\nname = \"web\"\nprotocol = \"tcp\"\n\
             listen = \"{vip_a}\"\nforward = \"fnat\"\n[[service.backend]]\naddress = \"{B1}\"\n\
             [[service]]\ntenant = \"b\"\nname = \"web\"\nprotocol = \"tcp\"\n\
             listen = \"{vip_b}\"\nforward = \"fnat\"\n[[service.backend]]\naddress = \"{B1}\"\n"
        );
        let cfg: Config = toml::from_str(&toml).unwrap();
        let d = super::super::Daemon::start_inner(cfg, None, false).unwrap();
        let mut e = engine(&d);
        // Tenant a's flood: as many SYNs as the pool has ports.
        let mut opened = 0;
        for i in 0..10u16 {
            let client = SocketAddr::new(sa("192.0.2.1:0").ip(), 1000 + i);
            let mut syn = frame(client, vip_a, Some(SYN), b"");
            if e.process(&mut syn) == Verdict::Transmit {
                opened += 1;
            }
        }
        assert_eq!(opened, 5, "tenant a's share: half of the 10 ports");
        assert_eq!(counted(&e, Drop::FnatShare), 5);
        assert_eq!(counted(&e, Drop::FnatPorts), 0);
        // Tenant b's clients still get ports, its whole share.
        for i in 0..5u16 {
            let client = SocketAddr::new(sa("192.0.2.2:0").ip(), 1000 + i);
            let mut syn = frame(client, vip_b, Some(SYN), b"");
            assert_eq!(
                e.process(&mut syn),
                Verdict::Transmit,
                "tenant b's flow {i}"
            );
            assert_eq!(verified(&syn).src.ip(), sa(&format!("{LOCAL}:0")).ip());
        }
        // The pool is full now: the next is refused as exhausted.
        let mut syn = frame(sa("192.0.2.2:2000"), vip_b, Some(SYN), b"");
        assert_eq!(e.process(&mut syn), Verdict::Drop);
        assert_eq!(counted(&e, Drop::FnatPorts), 1);
        // Refused flows took nothing: 10 flows, 10 ports, 10 admitted.
        assert_eq!(e.counters.new_flows.load(Relaxed), 10);
        assert_eq!(d.shared.admission.active.load(Relaxed), 10);
        let stats = d.shared.packet.get().unwrap().sums();
        assert_eq!(stats.counts.dropped.get("fnat_ports_share"), Some(&5));
    }

    /// An IPv4-mapped IPv6 source (here the mapped form of an IPv4 VIP of
    /// weir's) is no host's on the wire: dropped as a martian, as weir's
    /// own addresses are.
    #[test]
    fn a_first_packet_from_an_ipv4_mapped_address_opens_no_flow() {
        let (vip4, vip6) = (sa("10.0.0.100:53"), sa("[2001:db8::100]:53"));
        let toml = format!(
            "[daemon]\nworkers = 1\n[packet]\ninterfaces = [\"lo\"]\n\
             [[service]]\nname = \"dns4\"\nprotocol = \"udp\"\nlisten = \"{vip4}\"\n\
             forward = \"nat\"\n[[service.backend]]\naddress = \"{B1}\"\n\
             [[service]]\nname = \"dns6\"\nprotocol = \"udp\"\nlisten = \"{vip6}\"\n\
             forward = \"nat\"\n[[service.backend]]\naddress = \"[2001:db8:1::2]:53\"\n"
        );
        let d =
            super::super::Daemon::start_inner(toml::from_str(&toml).unwrap(), None, false).unwrap();
        let mut e = engine(&d);
        for src in ["[::ffff:10.0.0.100]:53", "[::ffff:192.0.2.7]:40000"] {
            let mut f = frame(sa(src), vip6, None, b"forged");
            assert_eq!(e.process(&mut f), Verdict::Drop, "from {src}");
        }
        assert_eq!(counted(&e, Drop::Martian), 2);
        let mut f = frame(sa("[2001:db8:2::7]:40000"), vip6, None, b"query");
        assert_eq!(e.process(&mut f), Verdict::Transmit, "a client's");
    }

    /// A first packet from one of weir's own addresses (a VIP, an fnat
    /// local address) was never sent by a client: it is forged, and it
    /// opened a flow whose replies the backend sends to weir's address.
    /// From another tenant's VIP:port, the backend's answer arrived at that
    /// VIP as a first packet and opened a flow there, so a forged datagram
    /// had one tenant's backend send its answer into another tenant's
    /// backends, from its own (internal) address. From an fnat local
    /// endpoint, the backend saw the endpoint of an fnat flow.
    #[test]
    fn a_first_packet_from_weirs_own_addresses_opens_no_flow() {
        let (vip_a, vip_b) = (sa("10.0.0.100:53"), sa("10.0.0.101:53"));
        let d = two_tenants_dns(
            vip_a,
            vip_b,
            B2,
            &format!("local_addresses = [\"{LOCAL}\"]\n"),
        );
        let mut e = engine(&d);
        let local = SocketAddr::new(LOCAL.parse().unwrap(), 40000);
        for src in [vip_b, vip_a, sa("10.0.0.101:9"), local] {
            let mut f = frame(src, vip_a, None, b"forged");
            assert_eq!(e.process(&mut f), Verdict::Drop, "from {src}");
        }
        assert_eq!(counted(&e, Drop::Martian), 4);
        assert_eq!(e.counters.new_flows.load(Relaxed), 0);
        assert_eq!(d.shared.admission.active.load(Relaxed), 0);
        // A client's datagram still opens a flow.
        let mut f = frame(sa("192.0.2.7:40000"), vip_a, None, b"query");
        assert_eq!(e.process(&mut f), Verdict::Transmit);
        assert_eq!(e.counters.new_flows.load(Relaxed), 1);
    }

    /// Path-MTU discovery through nat: a router on the backend side says
    /// "fragmentation needed" about a packet weir forwarded; the client
    /// gets it from the VIP, quoting its own packet to the VIP.
    #[test]
    fn frag_needed_from_the_backend_side_reaches_the_client_translated() {
        let d = daemon("nat", "");
        let mut e = engine(&d);
        let client = sa("192.0.2.7:40000");
        let mut syn = frame(client, sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut syn), Verdict::Transmit);
        // The router quotes the forwarded packet's IP header and 8 bytes.
        let quote = &syn[14..14 + 28];
        let router: IpAddr = "10.0.1.254".parse().unwrap();
        let mut icmp = vec![3, 4, 0, 0, 0, 0, 0x05, 0x78];
        icmp.extend_from_slice(quote);
        let c = checksum::finish(checksum::sum(&icmp, 0));
        icmp[2..4].copy_from_slice(&c.to_be_bytes());
        let (IpAddr::V4(r), IpAddr::V4(cl)) = (router, client.ip()) else {
            unreachable!()
        };
        let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0, 0, 64, 1, 0, 0];
        ip[2..4].copy_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
        ip.extend_from_slice(&r.octets());
        ip.extend_from_slice(&cl.octets());
        let c = checksum::ipv4_header_checksum(&ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        let mut f = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 9, 0x08, 0x00];
        f.extend_from_slice(&ip);
        f.extend_from_slice(&icmp);
        assert_eq!(e.process(&mut f), Verdict::Transmit);
        assert_eq!(e.counters.icmp_errors.load(Relaxed), 1);
        let p = weir_packet::parse(&f).unwrap();
        assert_eq!((p.src, p.dst), (sa(VIP).ip(), client.ip()), "outer header");
        let emb = weir_packet::icmp::parse_error(&f, &p).unwrap().unwrap();
        assert_eq!(
            (emb.tuple.src, emb.tuple.dst),
            (client, sa(VIP)),
            "the quote"
        );
        assert_eq!(
            checksum::finish(checksum::sum(&f[p.l4..p.end], 0)),
            0,
            "ICMP checksum"
        );
        let qip = &f[emb.l3..emb.l3 + 20];
        assert_eq!(
            checksum::ipv4_header_checksum(qip).to_be_bytes(),
            [qip[10], qip[11]]
        );
        // An error about no flow of ours is dropped and counted.
        let mut other = f.clone();
        other[p.l4 + 8 + 12..p.l4 + 8 + 16].copy_from_slice(&[192, 0, 2, 99]);
        // (Addressed to the quoted source, as an error is.)
        other[p.l3 + 16..p.l3 + 20].copy_from_slice(&[192, 0, 2, 99]);
        other[p.l3 + 10..p.l3 + 12].fill(0);
        let c = checksum::ipv4_header_checksum(&other[p.l3..p.l4]);
        other[p.l3 + 10..p.l3 + 12].copy_from_slice(&c.to_be_bytes());
        let before = counted(&e, Drop::NoFlow) + counted(&e, Drop::NotOurs);
        let _ = e.process(&mut other);
        assert_eq!(
            counted(&e, Drop::NoFlow) + counted(&e, Drop::NotOurs),
            before + 1
        );
    }

    /// An ICMP error goes to the source of the packet it quotes: one whose
    /// outer destination is another address is no error about a flow.
    /// Before, weir took any such frame whose quote named a live flow and
    /// sent it on from the VIP to whatever destination it carried (nat
    /// rewrites only the source of a backend-side error), routed by the
    /// client's next hop.
    #[test]
    fn an_icmp_error_not_addressed_to_the_quoted_source_is_dropped() {
        let d = daemon("nat", "");
        let mut e = engine(&d);
        let client = sa("192.0.2.7:40000");
        let mut syn = frame(client, sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut syn), Verdict::Transmit);
        let error_to = |to: IpAddr| icmp_error_to(&syn, to);
        let victim: IpAddr = "203.0.113.9".parse().unwrap();
        let mut f = error_to(victim);
        let v = e.process(&mut f);
        let p = weir_packet::parse(&f).unwrap();
        assert_eq!(v, Verdict::Drop, "sent on as {} -> {}", p.src, p.dst);
        assert_eq!(counted(&e, Drop::IcmpMalformed), 1);
        assert_eq!(e.counters.icmp_errors.load(Relaxed), 0);
        // The same error to the client is translated.
        let mut f = error_to(client.ip());
        assert_eq!(e.process(&mut f), Verdict::Transmit);
        assert_eq!(e.counters.icmp_errors.load(Relaxed), 1);
    }

    /// An ICMP "fragmentation needed" from a router on the backend side
    /// (10.0.1.254) to `to`, quoting the first 28 bytes of `sent`'s IPv4
    /// packet (a frame weir sent to a backend).
    fn icmp_error_to(sent: &[u8], to: IpAddr) -> Vec<u8> {
        let mut icmp = vec![3, 4, 0, 0, 0, 0, 0x05, 0x78];
        icmp.extend_from_slice(&sent[14..14 + 28]);
        let c = checksum::finish(checksum::sum(&icmp, 0));
        icmp[2..4].copy_from_slice(&c.to_be_bytes());
        let IpAddr::V4(to) = to else { unreachable!() };
        let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0, 0, 64, 1, 0, 0];
        ip[2..4].copy_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
        ip.extend_from_slice(&[10, 0, 1, 254]);
        ip.extend_from_slice(&to.octets());
        let c = checksum::ipv4_header_checksum(&ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        let mut f = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 9, 0x08, 0x00];
        f.extend_from_slice(&ip);
        f.extend_from_slice(&icmp);
        f
    }

    /// An ICMP "fragmentation needed" from `from` to `to` quoting all of
    /// `sent`'s IPv4 packet (a frame weir sent), checksums from scratch.
    fn frag_needed(sent: &[u8], from: IpAddr, to: IpAddr) -> Vec<u8> {
        let IpAddr::V4(from) = from else {
            unreachable!()
        };
        let mut f = icmp_error_to(sent, to);
        let p = weir_packet::parse(&f).unwrap();
        f[p.l3 + 12..p.l3 + 16].copy_from_slice(&from.octets());
        f.truncate(p.l4 + 8);
        f.extend_from_slice(&sent[14..]);
        f[p.l4 + 2..p.l4 + 4].fill(0);
        let c = checksum::finish(checksum::sum(&f[p.l4..], 0));
        f[p.l4 + 2..p.l4 + 4].copy_from_slice(&c.to_be_bytes());
        let len = (f.len() - p.l3) as u16;
        f[p.l3 + 2..p.l3 + 4].copy_from_slice(&len.to_be_bytes());
        f[p.l3 + 10..p.l3 + 12].fill(0);
        let c = checksum::ipv4_header_checksum(&f[p.l3..p.l4]);
        f[p.l3 + 10..p.l3 + 12].copy_from_slice(&c.to_be_bytes());
        f
    }

    /// fnat errors each way reach their side in its own view: the backend
    /// side's (about a packet from a local endpoint) reaches the client
    /// from the VIP quoting the client's packet to the VIP, the client
    /// side's (about the VIP's packet) reaches the backend from the local
    /// address quoting the backend's packet to it; every checksum, the
    /// quoted TCP one included, verifies from scratch.
    #[test]
    fn fnat_icmp_errors_reach_each_side_in_its_own_view() {
        let d = daemon("fnat", "");
        let mut e = engine(&d);
        let client = sa("192.0.2.7:40000");
        let mut syn = frame(client, sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut syn), Verdict::Transmit);
        let local = verified(&syn).src;
        assert_eq!(local.ip(), LOCAL.parse::<IpAddr>().unwrap());
        let mut synack = frame(sa(B1), local, Some(SYN | ACK), b"");
        assert_eq!(e.process(&mut synack), Verdict::Transmit);
        let router_b: IpAddr = "10.0.1.254".parse().unwrap();
        let router_c: IpAddr = "192.0.2.254".parse().unwrap();
        for (sent, from, to, outer, quote) in [
            (
                &syn,
                router_b,
                local.ip(),
                (sa(VIP).ip(), client.ip()),
                (client, sa(VIP)),
            ),
            (
                &synack,
                router_c,
                sa(VIP).ip(),
                (local.ip(), sa(B1).ip()),
                (sa(B1), local),
            ),
        ] {
            let mut f = frag_needed(sent, from, to);
            assert_eq!(e.process(&mut f), Verdict::Transmit, "to {to}");
            let p = weir_packet::parse(&f).unwrap();
            assert_eq!((p.src, p.dst), outer, "outer header");
            let emb = weir_packet::icmp::parse_error(&f, &p).unwrap().unwrap();
            assert_eq!((emb.tuple.src, emb.tuple.dst), quote, "the quote");
            assert_eq!(
                checksum::fold(checksum::sum(&f[p.l4..p.end], 0)),
                0xffff,
                "ICMP checksum"
            );
            let outer_ip = &f[p.l3..p.l4];
            assert_eq!(checksum::fold(checksum::sum(outer_ip, 0)), 0xffff);
            // The quote is a whole packet: its checksums verify as sent.
            let mut quoted = f[..14].to_vec();
            quoted.extend_from_slice(&f[emb.l3..p.end]);
            assert_eq!((verified(&quoted).src, verified(&quoted).dst), quote);
        }
        assert_eq!(e.counters.icmp_errors.load(Relaxed), 2);
    }

    /// The client side (interface 1) and the backend side (interface 2)
    /// of a two-armed weir: clients (192.0.2.0/24) are out of the first,
    /// everything else out of the second.
    const CLIENT_SIDE: u32 = 1;
    const BACKEND_SIDE: u32 = 2;

    struct TwoArms;
    impl NextHops for TwoArms {
        fn next_hop(&mut self, dst: IpAddr) -> Option<(u32, NextHop)> {
            let client = matches!(dst, IpAddr::V4(a) if a.octets()[..3] == [192, 0, 2]);
            Some((if client { CLIENT_SIDE } else { BACKEND_SIDE }, HOP))
        }
    }

    /// An engine of `d`'s packet path with a socket on both arms.
    fn two_armed(d: &super::super::DaemonHandle) -> Engine {
        engine_on(d, Box::new(TwoArms), vec![CLIENT_SIDE, BACKEND_SIDE])
    }

    /// `frames` as one batch received on `rx`: the copies sent on, with the
    /// interface each went out of (two arms: nothing goes back out of the
    /// interface it came in by).
    fn batch_on(e: &mut Engine, rx: u32, frames: &mut [Vec<u8>]) -> Vec<(u32, Vec<u8>)> {
        let mut slices: Vec<&mut [u8]> = frames.iter_mut().map(|f| f.as_mut_slice()).collect();
        let mut lens: Vec<usize> = slices.iter().map(|f| f.len()).collect();
        let partial = vec![false; slices.len()];
        let mut verdicts = vec![weir_packet_io::Verdict::Drop; slices.len()];
        let mut sent = Vec::new();
        let mut batch = Batch::ring(&mut slices, &partial, &mut lens, &mut verdicts);
        e.process_batch(&mut batch, rx, &mut |ix, f| {
            sent.push((ix, f.to_vec()));
            true
        });
        assert!(verdicts.iter().all(|v| *v == weir_packet_io::Verdict::Drop));
        sent
    }

    /// With `[packet] backend_interfaces`, a frame from a backend's address
    /// and port is a reply only where backends are. Before, a spoofer on
    /// the client side who knew a flow's client address and port could
    /// send "replies" from the backend's address, and weir sent them to
    /// the client from the VIP: injected into the connection. Both paths:
    /// one frame at a time and in a batch (whose probe would otherwise
    /// find the flow and forward the frame without `find`).
    #[test]
    fn replies_are_taken_only_on_backend_interfaces() {
        let d = daemon("nat", "");
        let mut e = two_armed(&d).with_reply_interfaces(vec![BACKEND_SIDE]);
        let client = sa("192.0.2.7:40000");
        let (c0, b0) = (1_000_000u32, 3_000_000_000u32);
        e.receive_on(CLIENT_SIDE);
        let mut syn = frame_seq(client, sa(VIP), Some(SYN), c0, b"");
        assert_eq!(e.process(&mut syn), Verdict::Egress(BACKEND_SIDE));
        let key = tcp_key(&e, client);
        let out =
            |d: &super::super::DaemonHandle| d.shared.conns.table.get(&key).unwrap().packets_out;
        // The backend's SYN-ACK, forged on the client side: dropped, one at
        // a time and in a batch.
        let synack = frame_seq(sa(B1), client, Some(SYN | ACK), b0, b"");
        let mut f = synack.clone();
        assert_eq!(e.process(&mut f), Verdict::Drop);
        assert_eq!(counted(&e, Drop::ReplyInterface), 1);
        let mut fs = vec![synack.clone(), synack.clone()];
        let sent = batch_on(&mut e, CLIENT_SIDE, &mut fs);
        assert!(sent.is_empty(), "sent on: {sent:?}");
        assert_eq!(counted(&e, Drop::ReplyInterface), 3);
        assert_eq!(fs[0], synack, "not rewritten");
        assert_eq!(out(&d), 0, "no reply reached the flow");
        // An ICMP error about the packet weir sent the backend, forged on
        // the client side: dropped too (it would reach the client as the
        // VIP's).
        e.receive_on(CLIENT_SIDE);
        let mut f = icmp_error_to(&syn, client.ip());
        assert_eq!(e.process(&mut f), Verdict::Drop);
        assert_eq!(counted(&e, Drop::ReplyInterface), 4);
        assert_eq!(e.counters.icmp_errors.load(Relaxed), 0);
        // From a backend's address but no backend's port: not a reply at
        // all, as before (no flow could be named).
        let mut f = frame_seq(sa("10.0.1.2:9"), client, Some(ACK), b0, b"");
        assert_eq!(e.process(&mut f), Verdict::Drop);
        assert_eq!(counted(&e, Drop::NotOurs), 1);
        assert_eq!(counted(&e, Drop::ReplyInterface), 4);
        // The same frames on the backend side are the backend's.
        let mut fs = vec![synack.clone()];
        let sent = batch_on(&mut e, BACKEND_SIDE, &mut fs);
        let [(CLIENT_SIDE, copy)] = &sent[..] else {
            panic!("not sent to the client: {sent:?}")
        };
        assert_eq!((verified(copy).src, verified(copy).dst), (sa(VIP), client));
        e.receive_on(BACKEND_SIDE);
        let mut f = synack.clone();
        assert_eq!(e.process(&mut f), Verdict::Egress(CLIENT_SIDE));
        let mut f = icmp_error_to(&syn, client.ip());
        assert_eq!(e.process(&mut f), Verdict::Egress(CLIENT_SIDE));
        assert_eq!(e.counters.icmp_errors.load(Relaxed), 1);
        assert_eq!(out(&d), 2);
        assert_eq!(counted(&e, Drop::ReplyInterface), 4);
        // Clients' packets are taken on either side.
        let mut ack = frame_seq(client, sa(VIP), Some(ACK), c0 + 1, b"hi");
        assert_eq!(e.process(&mut ack), Verdict::Transmit);
    }

    /// Without `backend_interfaces` (one interface for both sides, or a
    /// config that names none) replies are taken on any interface.
    #[test]
    fn without_backend_interfaces_replies_are_taken_anywhere() {
        let d = daemon("nat", "");
        let mut e = two_armed(&d);
        let client = sa("192.0.2.7:40000");
        e.receive_on(CLIENT_SIDE);
        let mut syn = frame(client, sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut syn), Verdict::Egress(BACKEND_SIDE));
        for rx in [CLIENT_SIDE, BACKEND_SIDE, 77] {
            e.receive_on(rx);
            let mut f = frame(sa(B1), client, Some(SYN | ACK), b"");
            assert_ne!(e.process(&mut f), Verdict::Drop, "on {rx}");
        }
        assert_eq!(counted(&e, Drop::ReplyInterface), 0);
    }

    /// Many flows in one tenant's own table: held, listed exactly page by
    /// page through the admin interface while new flows keep arriving, and
    /// all gone with their tenant (admission slots given back). The 10M
    /// figures are `weir-bench packet`'s; this keeps CI under a second.
    #[test]
    fn many_flows_are_listed_exactly_and_go_with_their_tenant() {
        let toml = format!(
            "[daemon]\nworkers = 1\n[packet]\ninterfaces = [\"lo\"]\n\
             [[tenant]]\nname = \"big\"\ntable_entries = 262144\n\
             [[service]]\ntenant = \"big\"\nname = \"web\"\nprotocol = \"udp\"\nlisten = \"{VIP}\"\n\
             forward = \"nat\"\n[[service.backend]]\naddress = \"{B1}\"\n"
        );
        let cfg: Config = toml::from_str(&toml).unwrap();
        let d = super::super::Daemon::start_inner(cfg, None, false).unwrap();
        let mut e = engine(&d);
        let client = |i: u32| {
            SocketAddr::new(
                IpAddr::V4(std::net::Ipv4Addr::from(0x0a40_0000 + (i >> 14))),
                1024 + (i & 0x3fff) as u16,
            )
        };
        let n = 200_000u32;
        for i in 0..n {
            let mut f = frame(client(i), sa(VIP), None, b"x");
            assert_eq!(e.process(&mut f), Verdict::Transmit, "flow {i}");
        }
        assert_eq!(e.counters.new_flows.load(Relaxed), u64::from(n));
        assert_eq!(d.shared.admission.active.load(Relaxed), u64::from(n));
        // Page through every flow while more arrive between pages: each
        // flow present for the whole listing is listed exactly once.
        let control = d.control();
        let filter = crate::control::ConnFilter::default();
        let mut seen = std::collections::HashMap::<String, u32>::new();
        let mut cursor: Option<String> = None;
        let mut extra = n;
        for _ in 0..1000 {
            let page = control
                .connections(&filter, cursor.as_deref(), 4096)
                .unwrap();
            for c in &page.connections {
                *seen.entry(c.client.clone()).or_default() += 1;
            }
            for _ in 0..100 {
                let mut f = frame(client(extra), sa(VIP), None, b"y");
                assert_eq!(e.process(&mut f), Verdict::Transmit);
                extra += 1;
            }
            match page.next {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        for i in 0..n {
            assert_eq!(seen.get(&client(i).to_string()), Some(&1), "flow {i}");
        }
        assert!(seen.values().all(|&c| c == 1), "a flow listed twice");
        let total = u64::from(extra);
        assert_eq!(d.shared.admission.active.load(Relaxed), total);
        // The tenant goes with all its flows, each settled once.
        let closed = control.delete_tenant("big").unwrap();
        assert_eq!(closed, total);
        assert_eq!(d.shared.admission.active.load(Relaxed), 0);
    }

    /// Turns on `expire_nodest_conn` in `d`'s service: the flows of a
    /// backend removed from it end.
    fn expire_nodest_conn(d: &super::super::DaemonHandle) {
        let svc = the_service(d);
        let mut p = (**svc.params.load()).clone();
        p.expire_nodest_conn = true;
        svc.params.store(Arc::new(p));
    }

    /// A backend removed with `expire_nodest_conn`: its fnat flows end and
    /// give their ports back, though the backend is no longer in the
    /// service to say its address.
    #[test]
    fn fnat_ports_come_back_when_the_backend_is_removed() {
        let d = daemon("fnat", "");
        expire_nodest_conn(&d);
        let mut e = engine(&d);
        let mut syn = frame(sa("192.0.2.7:40000"), sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut syn), Verdict::Transmit);
        let t = verified(&syn);
        assert_eq!(t.dst, sa(B1));
        let path = d.shared.packet.get().unwrap().clone();
        assert!(path.port_is_live(t.src, sa(B1)));
        d.control().delete_backend("default", "web", B1).unwrap();
        assert!(!path.port_is_live(t.src, sa(B1)), "port leaked");
        assert_eq!(d.shared.admission.active.load(Relaxed), 0);
    }

    /// Backends come and go, each taking fnat ports while it serves: the
    /// port pool of a removed one goes with its last port (and its entry
    /// in the id → address map with it), so churn does not grow them
    /// without bound. Both used to stay for the daemon's life.
    #[test]
    fn fnat_port_pools_of_removed_backends_are_freed() {
        let d = daemon("fnat", "");
        expire_nodest_conn(&d);
        let control = d.control();
        let mut e = engine(&d);
        let path = d.shared.packet.get().unwrap().clone();
        for b in [B1, B2] {
            control.delete_backend("default", "web", b).unwrap();
        }
        for i in 0..300u16 {
            let addr = SocketAddr::from(([10, 0, 3 + (i >> 8) as u8, i as u8], 8080));
            let spec = crate::config::BackendSpec {
                address: addr,
                weight: 1,
                proxy_protocol: None,
                max_connections: 0,
            };
            control.add_backend("default", "web", spec).unwrap();
            let client = sa(&format!("192.0.2.7:{}", 1024 + i));
            let mut syn = frame(client, sa(VIP), Some(SYN), b"");
            assert_eq!(e.process(&mut syn), Verdict::Transmit, "backend {i}");
            let t = verified(&syn);
            assert_eq!(t.dst, addr);
            assert!(path.port_is_live(t.src, addr));
            control
                .delete_backend("default", "web", &addr.to_string())
                .unwrap();
            assert!(
                !path.port_is_live(t.src, addr),
                "port of backend {i} leaked"
            );
            let (pools, ids) = path.fnat_sizes();
            assert!(
                pools <= 2 && ids <= 2,
                "after {} backends: {pools} pools, {ids} backend ids",
                i + 1
            );
        }
        assert_eq!(d.shared.admission.active.load(Relaxed), 0);
    }

    /// A worker still on the snapshot from before its service was deleted
    /// (a batch already in hand, or frames that arrive while it waits):
    /// the service's flows were killed and settled already, so a first
    /// packet must not open a flow that no end can settle (the service is
    /// gone from the model): it would keep its admission slot, its fnat
    /// port and its client place for good.
    #[test]
    fn a_first_packet_on_a_stale_snapshot_of_a_deleted_service_takes_nothing() {
        let d = daemon_with("fnat", "", "tcp_max_connections_per_client = 5");
        let mut e = engine(&d);
        let svc = the_service(&d);
        d.control().delete_service("default", "web").unwrap();
        // The engine has not refreshed its snapshot yet.
        let client = sa("192.0.2.7:40000");
        let mut syn = frame(client, sa(VIP), Some(SYN), b"");
        let v = e.process(&mut syn);
        let mut all = Vec::new();
        d.shared
            .conns
            .table
            .dump(None, &weir_flowtable::DumpFilter::default(), 100, &mut all);
        // Whatever the verdict, nothing may stay taken once the flows of
        // the deleted service are gone.
        d.shared.kill_where(
            super::super::owners::Close::Killed,
            &weir_flowtable::DumpFilter::default(),
            |_| true,
        );
        assert_eq!(
            d.shared.admission.active.load(Relaxed),
            0,
            "admission slot leaked ({v:?}, {} entries)",
            all.len()
        );
        assert!(svc.tcp_per_client.lock().is_empty(), "client place leaked");
        let path = d.shared.packet.get().unwrap().clone();
        for p in [40000u16..=59999].into_iter().flatten() {
            let l = SocketAddr::new(LOCAL.parse().unwrap(), p);
            assert!(!path.port_is_live(l, sa(B1)) && !path.port_is_live(l, sa(B2)));
        }
        assert_eq!(v, Verdict::Drop);
        assert!(all.is_empty(), "a flow of a deleted service: {all:?}");
    }

    /// The expiry thread removes a flow of a service while that service is
    /// being deleted: after the service left the model
    /// ([`Shared::take_services`]) and before its flows are killed
    /// ([`Shared::kill_service`]). The flow must still be settled (its
    /// admission slot, fnat port and client place given back): it is the
    /// kill that no longer sees it.
    #[test]
    fn a_flow_expiring_while_its_service_is_deleted_is_settled() {
        let d = daemon_with("fnat", "", "tcp_max_connections_per_client = 5");
        let mut e = engine(&d);
        let mut syn = frame(sa("192.0.2.7:40000"), sa(VIP), Some(SYN), b"");
        assert_eq!(e.process(&mut syn), Verdict::Transmit);
        let local = verified(&syn).src;
        let svc = the_service(&d);
        let path = d.shared.packet.get().unwrap().clone();
        assert_eq!(d.shared.admission.active.load(Relaxed), 1);
        // `remove_services`, step by step, with an expiry round between.
        let key = ("default".to_owned(), "web".to_owned());
        let taken = d.shared.take_services(std::slice::from_ref(&key));
        let mut out = Vec::new();
        let later = Millis(d.shared.now_ms() + 3_600_000);
        d.shared.conns.table.expire(later, 4096, &mut out);
        assert_eq!(out.len(), 1, "the flow expired");
        d.shared
            .ended(&out, super::super::owners::Close::IdleTimeout);
        for s in taken.into_iter().flatten() {
            d.shared
                .kill_service(&s, None, super::super::owners::Close::ServiceDeleted);
        }
        assert_eq!(d.shared.admission.active.load(Relaxed), 0, "slot leaked");
        assert!(!path.port_is_live(local, sa(B1)), "fnat port leaked");
        assert!(svc.tcp_per_client.lock().is_empty(), "client place leaked");
    }

    /// Ten thousand malformed frames (issue 12): none panics, each is
    /// counted under exactly one reason, none creates a flow.
    #[test]
    fn ten_thousand_malformed_frames_are_each_counted() {
        let d = daemon("nat", "");
        let mut e = engine(&d);
        let good = frame(sa("192.0.2.7:40000"), sa(VIP), Some(SYN), b"payload");
        let mut rng = weir_sched::SplitMix64::new(42);
        let n = 10_000;
        for i in 0..n {
            let mut f = good.clone();
            let r = rng.next_u64();
            match i % 8 {
                // Truncated anywhere.
                0 => f.truncate((r as usize) % good.len()),
                // A bad IPv4 total length.
                1 => f[16..18].copy_from_slice(&(r as u16 | 1).to_be_bytes()),
                // A bad checksum (header or TCP).
                2 => f[14 + 10 + (r as usize % 2) * 24] ^= 0x5a,
                // TTL 1 or 0.
                3 => f[22] = (r % 2) as u8,
                // IP options (IHL 6..15).
                4 => f[14] = 0x40 | (6 + (r % 10) as u8),
                // A fragment (MF or an offset).
                5 => f[20..22].copy_from_slice(&[0x20 | (r as u8 & 0x1f), r as u8]),
                // Random bytes of a random length.
                6 => {
                    f = (0..(r % 200) as usize)
                        .map(|_| rng.next_u64() as u8)
                        .collect();
                }
                // A TCP data offset below 5 or past the end.
                _ => f[14 + 20 + 12] = ((r % 5) as u8) << 4 | 0xf0 & ((r as u8) << 4),
            }
            // Header changes keep a valid header checksum, so they reach the
            // check they are meant for.
            if matches!(i % 8, 1 | 3 | 4 | 5) {
                let ihl = usize::from(f[14] & 0xf) * 4;
                if f.len() >= 14 + ihl && ihl >= 20 {
                    let c = checksum::ipv4_header_checksum(&f[14..14 + ihl]);
                    f[24..26].copy_from_slice(&c.to_be_bytes());
                }
            }
            let _ = e.process(&mut f);
        }
        let rx = e.counters.rx.load(Relaxed);
        let tx = e.counters.tx.load(Relaxed);
        let drops: u64 = e
            .counters
            .dropped
            .iter()
            .map(|c| c.load(Relaxed))
            .sum::<u64>()
            + e.counters
                .unhandled
                .iter()
                .map(|c| c.load(Relaxed))
                .sum::<u64>();
        assert_eq!(rx, n);
        assert_eq!(tx + drops, rx, "every frame counted once");
        // A flipped TCP checksum is not weir's to check (the backend's
        // kernel drops it); everything else must not have been forwarded.
        assert!(tx < n / 8 + 1, "forwarded {tx}");
        let sums = d.shared.packet.get().unwrap().sums();
        for reason in [
            "fragment",
            "ipv4_options",
            "ttl_expired",
            "bad_ipv4_checksum",
        ] {
            assert!(
                sums.counts.dropped.get(reason).is_some_and(|&c| c > 0),
                "{reason}: {sums:?}"
            );
        }
    }

    #[test]
    fn kernel_drops_are_summed_over_workers_and_named_in_the_stats() {
        use weir_packet_io::KernelDrops;
        let path = PacketPath::new(Vec::new(), 40000..=40099, 1).unwrap();
        let (a, b) = (path.worker_counters("w0"), path.worker_counters("w1"));
        a.set_kernel_drops(KernelDrops {
            rx_ring_full: 5,
            rx_no_frame: 2,
            ..KernelDrops::default()
        });
        b.set_kernel_drops(KernelDrops {
            rx_ring_full: 1,
            ..KernelDrops::default()
        });
        // A worker publishes its sockets' running totals: a newer figure
        // replaces the older one, it does not add to it.
        a.set_kernel_drops(KernelDrops {
            rx_ring_full: 7,
            rx_no_frame: 2,
            ..KernelDrops::default()
        });
        let d = path.sums().counts.dropped;
        assert_eq!(d.get("kernel_rx_ring_full"), Some(&8), "{d:?}");
        assert_eq!(d.get("kernel_rx_no_frame"), Some(&2), "{d:?}");
        assert_eq!(
            d.get("kernel_invalid_descs"),
            None,
            "zero counts are left out: {d:?}"
        );
    }

    /// Which queue drops: each worker's own figures come with the sums,
    /// under the worker's name, and add up to them.
    #[test]
    fn stats_break_the_counters_down_by_worker() {
        use weir_packet_io::KernelDrops;
        let path = PacketPath::new(Vec::new(), 40000..=40099, 1).unwrap();
        let (a, b) = (
            path.worker_counters("weir-pkt-q0"),
            path.worker_counters("weir-pkt-q1"),
        );
        a.rx.store(100, Relaxed);
        a.tx.store(90, Relaxed);
        a.new_flows.store(4, Relaxed);
        a.dropped[Drop::NoFlow as usize].store(10, Relaxed);
        b.rx.store(7, Relaxed);
        b.tx.store(7, Relaxed);
        b.icmp_errors.store(1, Relaxed);
        b.unhandled[0].store(3, Relaxed);
        b.set_kernel_drops(KernelDrops {
            rx_ring_full: 5,
            ..KernelDrops::default()
        });
        let s = path.sums();
        let names: Vec<&str> = s.workers.iter().map(|w| w.worker.as_str()).collect();
        assert_eq!(names, ["weir-pkt-q0", "weir-pkt-q1"]);
        let (w0, w1) = (&s.workers[0].counts, &s.workers[1].counts);
        assert_eq!(
            (w0.rx, w0.tx, w0.new_flows, w0.icmp_errors),
            (100, 90, 4, 0)
        );
        assert_eq!((w1.rx, w1.tx, w1.new_flows, w1.icmp_errors), (7, 7, 0, 1));
        let no_flow = Drop::NoFlow.name();
        let first_unhandled = weir_packet::Unhandled::NAMES[0];
        assert_eq!(
            w0.dropped,
            [(no_flow.to_owned(), 10)].into_iter().collect(),
            "only the first worker dropped for want of a flow"
        );
        assert_eq!(
            w1.dropped,
            [
                (first_unhandled.to_owned(), 3),
                ("kernel_rx_ring_full".to_owned(), 5)
            ]
            .into_iter()
            .collect(),
            "the second worker's kernel and parser drops are its own"
        );
        // The sums are the workers' figures added up.
        assert_eq!(
            (
                s.counts.rx,
                s.counts.tx,
                s.counts.new_flows,
                s.counts.icmp_errors
            ),
            (107, 97, 4, 1)
        );
        for (reason, n) in &s.counts.dropped {
            let per: u64 = (s.workers.iter())
                .filter_map(|w| w.counts.dropped.get(reason))
                .sum();
            assert_eq!(*n, per, "{reason}");
        }
        assert_eq!(s.counts.dropped.len(), 3, "{:?}", s.counts.dropped);
    }

    /// The per-packet backend index finds what the linear search it
    /// replaced found, for every id: present ones (in a set listed out of
    /// id order), ones between them (removed from the set) and ones past
    /// either end. The search was O(backends) per client → VIP packet.
    #[test]
    fn backends_by_id_finds_what_a_linear_search_finds() {
        let rates = super::super::stats::RateEngine::new(1).unwrap();
        let spec = |i: u32| crate::config::BackendSpec {
            address: SocketAddr::from(([10, 1, (i >> 8) as u8, i as u8], 8080)),
            weight: 1,
            proxy_protocol: None,
            max_connections: 0,
        };
        let ids = super::super::model::Ids::new();
        let all: Vec<Arc<Backend>> = (0..3000)
            .map(|i| Backend::new_in(spec(i), &rates, &ids))
            .collect();
        // Every third one left (the rest "removed"), in a scrambled order.
        let mut set: Vec<Arc<Backend>> = all.iter().step_by(3).cloned().collect();
        let n = set.len();
        for i in 0..n {
            set.swap(i, (i * 7919) % n);
        }
        let linear = |id: u32| set.iter().find(|b| b.id == id);
        let index = BackendsById::new(&set);
        let (lo, hi) = (all[0].id, all[all.len() - 1].id);
        let mut found = 0;
        // Ids come from a daemon-wide counter: other tests' backends may be
        // interleaved with these, and are absent from the set as well.
        for id in (lo.saturating_sub(10)..=hi + 10).chain([0, u32::MAX]) {
            let got = index.get(id);
            assert_eq!(got.map(Arc::as_ptr), linear(id).map(Arc::as_ptr), "id {id}");
            found += usize::from(got.is_some());
        }
        assert_eq!(found, n, "each backend of the set, and no other");
        assert!(index.get(all[1].id).is_none(), "a removed one is gone");
        assert!(BackendsById::new(&[]).get(lo).is_none());
        // A set listing a backend twice finds it all the same.
        let twice = BackendsById::new(&[all[5].clone(), all[5].clone()]);
        assert!(Arc::ptr_eq(twice.get(all[5].id).unwrap(), &all[5]));
    }

    /// Not a check: a loop for counting what an established flow's packet
    /// costs the engine (docs/BENCHMARKS.md, "Instructions per packet"):
    /// `valgrind --tool=callgrind --toggle-collect='*Engine*process_batch*'
    /// target/debug/deps/weir-HASH --ignored --exact
    /// daemon::packet::tests::instructions_per_packet_loop`, then the
    /// instructions over `PACKETS`. 256 nat TCP flows; batches of 64 frames,
    /// half each way, in window, as a bulk transfer's ACKs and data.
    #[test]
    #[ignore = "a profiling loop; run under callgrind"]
    fn instructions_per_packet_loop() {
        const FLOWS: u16 = 256;
        const BATCHES: usize = 2000;
        let d = daemon("nat", "");
        let mut e = engine(&d);
        let (c0, b0) = (1_000_000u32, 3_000_000_000u32);
        let mut templates = Vec::new();
        for i in 0..FLOWS {
            let client = SocketAddr::new("192.0.2.7".parse().unwrap(), 10_000 + i);
            let mut syn = frame_seq(client, sa(VIP), Some(SYN), c0, b"");
            assert_eq!(e.process(&mut syn), Verdict::Transmit);
            let backend = verified(&syn).dst;
            let mut synack = frame_seq(backend, client, Some(SYN | ACK), b0, b"");
            assert_eq!(e.process(&mut synack), Verdict::Transmit);
            templates.push(frame_seq(client, sa(VIP), Some(ACK), c0 + 1, &[7; 100]));
            templates.push(frame_seq(backend, client, Some(ACK), b0 + 1, &[9; 1000]));
        }
        let mut sent = 0u64;
        for b in 0..BATCHES {
            let at = (b * 64) % templates.len();
            let mut frames: Vec<Vec<u8>> = templates[at..at + 64].to_vec();
            let mut slices: Vec<&mut [u8]> = frames.iter_mut().map(|f| f.as_mut_slice()).collect();
            let mut lens: Vec<usize> = slices.iter().map(|f| f.len()).collect();
            let partial = vec![false; 64];
            let mut verdicts = vec![weir_packet_io::Verdict::Drop; 64];
            let mut batch = Batch::ring(&mut slices, &partial, &mut lens, &mut verdicts);
            e.process_batch(&mut batch, 1, &mut |_, _| false);
            sent += verdicts
                .iter()
                .filter(|v| **v == weir_packet_io::Verdict::Transmit)
                .count() as u64;
        }
        assert_eq!(sent, (BATCHES * 64) as u64, "every packet forwarded");
        eprintln!("PACKETS {sent}");
    }
}

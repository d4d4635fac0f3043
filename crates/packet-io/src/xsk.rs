//! AF_XDP sockets driven in batches (the `xdp` crate: pure Rust, MIT/Apache).
//!
//! An [`XskSocket`] is bound to one interface queue and owns its UMEM (frames
//! shared with the kernel) and its four rings. [`XskSocket::run_batch_all`] is
//! one turn of the data path: reclaim transmitted frames, refill the fill ring,
//! receive up to a batch, hand the whole [`Batch`] to a callback that may
//! rewrite frames in place and sets a [`Verdict`] per frame, then transmit the
//! frames to send and kick the kernel (copy mode, as on veth, transmits inside
//! that `sendto`). [`XskSocket::run_batch`] is the same with a callback per
//! frame.
//!
//! The socket only receives what the steering program redirects to it: register
//! it with [`crate::Steering::register_socket`] under the same queue.

use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use xdp::slab::{HeapSlab, Slab};
use xdp::socket::{PollTimeout, XdpSocket, XdpSocketBuilder};
use xdp::umem::UmemCfgBuilder;
use xdp::{Packet, RingConfigBuilder, Umem, WakableRings};

/// What to do with a received frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Send the (rewritten) frame out of the interface it came in on.
    Transmit,
    /// Return the frame to the UMEM.
    Drop,
}

/// Sizes of one socket's UMEM and rings.
#[derive(Debug, Clone, Copy)]
pub struct XskConfig {
    /// Frames in the UMEM (each 4 KiB). Half stock the fill ring, the rest
    /// are in flight on rx/tx.
    pub frames: u32,
    /// Entries in each ring; a power of two.
    pub ring_size: u32,
    /// Most frames handed to the callback per [`XskSocket::run_batch`].
    pub batch: usize,
}

impl Default for XskConfig {
    fn default() -> Self {
        Self {
            frames: 4096,
            ring_size: 2048,
            batch: 64,
        }
    }
}

/// Errors of [`XskSocket`]'s operations.
#[derive(Debug, thiserror::Error)]
pub enum XskError {
    /// The configuration was refused (sizes not powers of two, zero, too large).
    #[error("AF_XDP configuration: {0}")]
    Config(String),
    /// The interface does not exist (in this network namespace).
    #[error("no interface {0:?}")]
    NoInterface(String),
    /// Mapping the UMEM failed (memory limits).
    #[error("mapping the AF_XDP UMEM: {0}")]
    Umem(std::io::Error),
    /// Creating, setting up or binding the socket failed.
    #[error(
        "AF_XDP socket on {interface} queue {queue}: {source} (needs root or CAP_NET_RAW; the queue must exist)"
    )]
    Socket {
        /// The interface.
        interface: String,
        /// The queue.
        queue: u32,
        /// What the kernel said.
        source: xdp::socket::SocketError,
    },
    /// A ring operation's syscall (poll, wakeup) failed.
    #[error("AF_XDP ring I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// Frames the kernel dropped for one socket before weir saw them, or
/// refused as invalid, since the socket was bound (AF_XDP's
/// `XDP_STATISTICS`, AF_PACKET's `PACKET_STATISTICS`). weir's own counters
/// cannot see these: the frames never reach a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelDrops {
    /// The socket's receive ring was full: weir did not keep up.
    pub rx_ring_full: u64,
    /// No free frame to receive into (AF_XDP's fill ring was empty), or the
    /// frame was larger than a UMEM frame.
    pub rx_no_frame: u64,
    /// Descriptors the kernel refused as invalid, receive and transmit
    /// (weir handing the kernel a bad frame address or length: a bug).
    pub invalid_descs: u64,
    /// Descriptors handed to weir (received frames, and frames the kernel
    /// gave back after transmitting them) whose address and length lie
    /// outside the UMEM: dropped unread (a kernel bug, or another process
    /// writing to the rings).
    pub bad_descs: u64,
}

impl std::ops::AddAssign for KernelDrops {
    fn add_assign(&mut self, o: Self) {
        self.rx_ring_full += o.rx_ring_full;
        self.rx_no_frame += o.rx_no_frame;
        self.invalid_descs += o.invalid_descs;
        self.bad_descs += o.bad_descs;
    }
}

/// One received batch, lent to the callback of [`XskSocket::run_batch_all`]:
/// the frames' bytes and one [`Verdict`] per frame, by index. Indexing past
/// [`Batch::len`] panics, as slice indexing does.
///
/// Frames are reached only as byte slices, never as values, so none can be
/// kept past the callback or moved to another socket's batch.
pub struct Batch<'a> {
    frames: Frames<'a>,
    verdicts: &'a mut [Verdict],
}

/// Where a batch's frames are: AF_XDP's UMEM, or an AF_PACKET ring.
enum Frames<'a> {
    Xdp(&'a mut [Packet]),
    Ring {
        frames: &'a mut [&'a mut [u8]],
        partial: &'a [bool],
        /// Each frame's length to send (shrunk by [`Batch::truncate`]).
        lens: &'a mut [usize],
    },
}

impl<'a> Batch<'a> {
    /// A batch of frames in an AF_PACKET ring (or any frames the caller
    /// holds: tests build batches this way), with their partial-checksum
    /// flags and lengths to send (same length as `frames`) and verdicts.
    pub fn ring(
        frames: &'a mut [&'a mut [u8]],
        partial: &'a [bool],
        lens: &'a mut [usize],
        verdicts: &'a mut [Verdict],
    ) -> Self {
        debug_assert!(frames.len() == partial.len() && frames.len() == verdicts.len());
        debug_assert!(frames.len() == lens.len());
        Self {
            frames: Frames::Ring {
                frames,
                partial,
                lens,
            },
            verdicts,
        }
    }
}

impl Batch<'_> {
    /// Frames in the batch (1 to the configured batch size).
    pub fn len(&self) -> usize {
        match &self.frames {
            Frames::Xdp(f) => f.len(),
            Frames::Ring { frames, .. } => frames.len(),
        }
    }

    /// True if the batch holds no frame (never, when the callback runs).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Frame `i`'s bytes, from the Ethernet header on.
    pub fn frame(&self, i: usize) -> &[u8] {
        match &self.frames {
            Frames::Xdp(f) => &f[i],
            Frames::Ring { frames, .. } => frames[i],
        }
    }

    /// Frame `i`'s bytes, to rewrite in place.
    pub fn frame_mut(&mut self, i: usize) -> &mut [u8] {
        match &mut self.frames {
            Frames::Xdp(f) => &mut f[i],
            Frames::Ring { frames, .. } => frames[i],
        }
    }

    /// Shrinks frame `i` to its first `len` bytes (what is sent if its
    /// verdict is [`Verdict::Transmit`]); false, and unchanged, if `len` is
    /// not shorter than the frame.
    pub fn truncate(&mut self, i: usize, len: usize) -> bool {
        let cur = self.frame(i).len();
        if len >= cur {
            return false;
        }
        match &mut self.frames {
            Frames::Xdp(f) => {
                let by = i32::try_from(cur - len).unwrap_or(i32::MAX);
                f[i].adjust_tail(-by).is_ok()
            }
            Frames::Ring { frames, lens, .. } => {
                let whole = std::mem::take(&mut frames[i]);
                frames[i] = &mut whole[..len];
                lens[i] = len;
                true
            }
        }
    }

    /// True if the kernel says frame `i`'s L4 checksum is only partial
    /// (`CHECKSUM_PARTIAL`: AF_PACKET's `TP_STATUS_CSUMNOTREADY`; see
    /// `weir_packet::CsumMode`). Always false on AF_XDP, which does not say.
    pub fn csum_partial(&self, i: usize) -> bool {
        match &self.frames {
            Frames::Xdp(f) => {
                let _ = &f[i];
                false
            }
            Frames::Ring { partial, .. } => partial[i],
        }
    }

    /// Frame `i`'s verdict ([`Verdict::Drop`] until set).
    pub fn verdict(&self, i: usize) -> Verdict {
        self.verdicts[i]
    }

    /// Sets frame `i`'s verdict.
    pub fn set_verdict(&mut self, i: usize, verdict: Verdict) {
        self.verdicts[i] = verdict;
    }

    /// Every frame with its verdict, in order.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&mut [u8], &mut Verdict)> {
        // One of the two is empty; chaining them avoids a boxed iterator.
        let (xdp, ring): (&mut [Packet], &mut [&mut [u8]]) = match &mut self.frames {
            Frames::Xdp(f) => (&mut **f, &mut []),
            Frames::Ring { frames, .. } => (&mut [], &mut **frames),
        };
        xdp.iter_mut()
            .map(|p| &mut **p)
            .chain(ring.iter_mut().map(|f| &mut **f))
            .zip(self.verdicts.iter_mut())
    }
}

impl std::fmt::Debug for Batch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("len", &self.len())
            .field("verdicts", &self.verdicts)
            .finish()
    }
}

/// What one [`XskSocket::run_batch`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Frames received and handed to the callback.
    pub received: usize,
    /// Frames queued for transmission.
    pub transmitted: usize,
    /// Frames the callback dropped, and received frames whose descriptor
    /// lay outside the UMEM ([`KernelDrops::bad_descs`]).
    pub dropped: usize,
    /// Frames to transmit that found the tx ring full (dropped, counted apart).
    pub tx_full: usize,
}

/// One AF_XDP socket bound to an interface queue, with its own UMEM and rings.
pub struct XskSocket {
    // Field order is drop order: the rings' mappings and the socket go before
    // the UMEM their descriptors point into.
    rings: WakableRings,
    socket: XdpSocket,
    rx: HeapSlab,
    tx: HeapSlab,
    /// Frames on `tx` from [`XskSocket::queue_copy`] since the last
    /// transmission.
    queued_copies: usize,
    /// The batch handed to the callback, and its verdicts; empty between
    /// calls (capacity kept).
    frames: Vec<Packet>,
    verdicts: Vec<Verdict>,
    umem: Umem,
    /// What every descriptor of `umem` must fit in.
    bounds: UmemBounds,
    /// Descriptors that did not, dropped ([`KernelDrops::bad_descs`]).
    bad_descs: u64,
    batch: usize,
    ring_size: usize,
    zero_copy: bool,
    interface: String,
    queue: u32,
}

impl std::fmt::Debug for XskSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XskSocket")
            .field("interface", &self.interface)
            .field("queue", &self.queue)
            .field("zero_copy", &self.zero_copy)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl XskSocket {
    /// Creates a socket with its UMEM and rings and binds it to `queue` of
    /// `interface` (in the calling thread's network namespace). The kernel
    /// picks zero-copy where the driver supports it, copy mode otherwise
    /// ([`XskSocket::zero_copy`] says which).
    pub fn bind(interface: &str, queue: u32, config: XskConfig) -> Result<Self, XskError> {
        if config.batch == 0 || config.batch > config.ring_size as usize {
            return Err(XskError::Config(format!(
                "batch {} must be between 1 and the ring size {}",
                config.batch, config.ring_size
            )));
        }
        let name = std::ffi::CString::new(interface)
            .map_err(|_| XskError::NoInterface(interface.to_owned()))?;
        let nic = xdp::nic::NicIndex::lookup_by_name(&name)
            .ok()
            .flatten()
            .ok_or_else(|| XskError::NoInterface(interface.to_owned()))?;
        let ring_cfg = RingConfigBuilder {
            rx_count: config.ring_size,
            tx_count: config.ring_size,
            fill_count: config.ring_size,
            completion_count: config.ring_size,
        }
        .build()
        .map_err(|e| XskError::Config(e.to_string()))?;
        let umem_builder = UmemCfgBuilder {
            frame_count: config.frames,
            ..Default::default()
        };
        let bounds = UmemBounds {
            frames: u64::from(config.frames),
            frame_size: u64::from(
                u32::try_from(umem_builder.frame_size)
                    .map_err(|e| XskError::Config(e.to_string()))?,
            ),
            head_room: u64::from(umem_builder.head_room),
        };
        let umem_cfg = umem_builder
            .build()
            .map_err(|e| XskError::Config(e.to_string()))?;
        let umem = Umem::map(umem_cfg).map_err(XskError::Umem)?;
        let socket_err = |source| XskError::Socket {
            interface: interface.to_owned(),
            queue,
            source,
        };
        let mut builder = XdpSocketBuilder::new().map_err(socket_err)?;
        let (mut rings, flags) = builder
            .build_wakable_rings(&umem, ring_cfg)
            .map_err(socket_err)?;
        let mut umem = umem;
        // Stock the fill ring before binding so the first packets find frames.
        // SAFETY: the frames belong to `umem`, which `Self` drops after the
        // socket and rings (field order), so it outlives every descriptor the
        // kernel holds.
        unsafe {
            rings
                .fill_ring
                .enqueue(&mut umem, config.ring_size as usize, false)?;
        }
        let socket = builder.bind(nic, queue, flags).map_err(socket_err)?;
        let zero_copy = is_zero_copy(socket.as_raw_fd());
        Ok(Self {
            rings,
            socket,
            rx: HeapSlab::with_capacity(config.batch),
            // A batch of its own frames plus a batch of copies.
            tx: HeapSlab::with_capacity(2 * config.batch),
            queued_copies: 0,
            frames: Vec::with_capacity(config.batch),
            verdicts: Vec::with_capacity(config.batch),
            umem,
            bounds,
            bad_descs: 0,
            batch: config.batch,
            ring_size: config.ring_size as usize,
            zero_copy,
            interface: interface.to_owned(),
            queue,
        })
    }

    /// One socket per rx queue of `interface` ([`rx_queue_count`]), socket `i`
    /// bound to queue `i`: register each with
    /// [`crate::Steering::register_socket`] under its [`XskSocket::queue`].
    pub fn bind_all(interface: &str, config: XskConfig) -> Result<Vec<Self>, XskError> {
        (0..rx_queue_count(interface)?)
            .map(|queue| Self::bind(interface, queue, config))
            .collect()
    }

    /// True if the kernel bound the socket in zero-copy mode (false: copy mode,
    /// as on veth).
    pub fn zero_copy(&self) -> bool {
        self.zero_copy
    }

    /// What the kernel dropped for this socket so far (`XDP_STATISTICS`;
    /// cumulative, one `getsockopt`).
    pub fn kernel_drops(&self) -> Result<KernelDrops, XskError> {
        let s = self
            .socket
            .statistics()
            .map_err(|e| XskError::Io(std::io::Error::other(e.to_string())))?;
        Ok(KernelDrops {
            rx_ring_full: s.rx_ring_full,
            rx_no_frame: s.rx_dropped,
            invalid_descs: s.rx_invalid_descs + s.tx_invalid_descs,
            bad_descs: self.bad_descs,
        })
    }

    /// The queue the socket is bound to.
    pub fn queue(&self) -> u32 {
        self.queue
    }

    /// One turn of the data path: waits up to `timeout` for frames, hands each
    /// received frame (at most the configured batch) to `f`, which may rewrite
    /// it in place, then transmits those it answered [`Verdict::Transmit`] for.
    /// Returns at once with zero counts if nothing arrived in `timeout`.
    pub fn run_batch(
        &mut self,
        timeout: Duration,
        mut f: impl FnMut(&mut [u8]) -> Verdict,
    ) -> Result<BatchStats, XskError> {
        self.run_batch_all(timeout, |batch| {
            for (frame, verdict) in batch.iter_mut() {
                *verdict = f(frame);
            }
        })
    }

    /// As [`XskSocket::run_batch`], but `f` gets the whole [`Batch`] at once —
    /// the received frames, oldest first, and one verdict per frame, each
    /// [`Verdict::Drop`] until `f` sets it — so it can parse every frame, look
    /// the whole batch up in the flow table (hash, prefetch, probe) and then
    /// rewrite. Transmissions keep the batch's order. Nothing is allocated per
    /// batch: the frames and verdicts live in the socket. `f` is not called
    /// when nothing arrived within `timeout`.
    pub fn run_batch_all(
        &mut self,
        timeout: Duration,
        f: impl FnOnce(&mut Batch<'_>),
    ) -> Result<BatchStats, XskError> {
        let mut stats = BatchStats::default();
        self.reclaim()?;

        let mut n = self.recv();
        if n == 0 {
            let ms = timeout.min(Duration::from_secs(1));
            if !self.socket.poll_read(PollTimeout::new(Some(ms)))? {
                return Ok(stats);
            }
            n = self.recv();
        }
        stats.received = n;

        // Frames left by a callback that panicked (and was caught) go back
        // to the UMEM rather than being handed out twice.
        for packet in self.frames.drain(..) {
            self.umem.free_packet(packet);
        }
        // Oldest first: the slab's back is the first frame the ring held.
        // The crate made each packet from its descriptor unchecked: one
        // that lies outside the UMEM (a kernel bug; see `recv`) is dropped
        // before anything makes a slice of it (not freed either: its
        // address is not a frame of the UMEM, and freed it would be
        // handed out again).
        while let Some(mut packet) = self.rx.pop_back() {
            if self.bounds.fits_packet(&mut packet) {
                self.frames.push(packet);
            } else {
                self.bad_descs += 1;
                stats.dropped += 1;
            }
        }
        if self.frames.is_empty() {
            return Ok(stats);
        }
        self.verdicts.clear();
        self.verdicts.resize(self.frames.len(), Verdict::Drop);
        f(&mut Batch {
            frames: Frames::Xdp(&mut self.frames),
            verdicts: &mut self.verdicts,
        });

        for (packet, verdict) in self.frames.drain(..).zip(&self.verdicts) {
            match verdict {
                Verdict::Transmit => {
                    if let Some(back) = self.tx.push_front(packet) {
                        // Cannot happen: tx holds a batch plus a batch of
                        // copies.
                        self.umem.free_packet(back);
                        stats.tx_full += 1;
                    }
                }
                Verdict::Drop => {
                    self.umem.free_packet(packet);
                    stats.dropped += 1;
                }
            }
        }

        self.transmit_queued(&mut stats)?;
        Ok(stats)
    }

    /// Copies `frame` into a free frame of this socket's UMEM and queues it
    /// for transmission by the next [`XskSocket::flush`] or
    /// [`XskSocket::run_batch_all`]: for a frame received on another socket
    /// (another interface, another UMEM) that leaves by this one, e.g. a nat
    /// packet from the client side going to a backend. Returns false, and
    /// queues nothing, when the frame is larger than a UMEM frame, no UMEM
    /// frame is free, or a batch of copies is already queued (flush first).
    pub fn queue_copy(&mut self, frame: &[u8]) -> bool {
        if self.queued_copies >= self.batch {
            return false;
        }
        // SAFETY: the packet points into `self.umem` if its address, from
        // the UMEM's free list, does (checked below before anything is
        // written through it; one outside is dropped unused); it is queued
        // on the tx slab (transmitted or freed by the next flush or batch)
        // or freed here, so it never outlives the UMEM.
        let Some(mut packet) = (unsafe { self.umem.alloc() }) else {
            return false;
        };
        // The frame's address may have come back on the completion ring,
        // which the crate takes unchecked: one outside the UMEM is dropped
        // before anything is written through it.
        if !self.bounds.fits_packet(&mut packet) {
            self.bad_descs += 1;
            return false;
        }
        if packet.append(frame).is_err() {
            self.umem.free_packet(packet);
            return false;
        }
        match self.tx.push_front(packet) {
            None => {
                self.queued_copies += 1;
                true
            }
            Some(back) => {
                self.umem.free_packet(back);
                false
            }
        }
    }

    /// Transmits the frames [`XskSocket::queue_copy`] queued and kicks the
    /// kernel; also returns completed transmissions to the UMEM.
    pub fn flush(&mut self) -> Result<BatchStats, XskError> {
        let done = self.umem.outstanding();
        self.rings.completion_ring.dequeue(&mut self.umem, done);
        let mut stats = BatchStats::default();
        self.transmit_queued(&mut stats)?;
        Ok(stats)
    }

    /// Puts the tx slab on the tx ring and kicks the kernel; what does not
    /// fit is dropped and counted, so the slab is empty afterwards.
    fn transmit_queued(&mut self, stats: &mut BatchStats) -> Result<(), XskError> {
        self.queued_copies = 0;
        if self.tx.is_empty() {
            return Ok(());
        }
        let want = self.tx.len();
        let tx = self
            .rings
            .tx_ring
            .as_mut()
            .expect("built with a tx ring (tx_count > 0)");
        // SAFETY: the frames are in `self.umem`, which outlives the socket
        // (field order); the kernel returns them on the completion ring.
        // Without a wakeup the send makes no syscall and cannot fail.
        let sent = unsafe { tx.send(&mut self.tx, false) }.unwrap_or(0);
        stats.transmitted += sent;
        // Ring full: what did not fit is dropped rather than held, so no
        // frame stays in a slab between calls (see `Send` below).
        let mut dropped = 0;
        while let Some(packet) = self.tx.pop_back() {
            self.umem.free_packet(packet);
            dropped += 1;
        }
        stats.tx_full += dropped;
        if sent > 0 {
            kick_tx(self.socket.as_raw_fd(), sent)?;
        }
        debug_assert_eq!(sent + dropped, want);
        Ok(())
    }

    /// Moves up to a batch of received frames into `self.rx`.
    fn recv(&mut self) -> usize {
        let rx = self
            .rings
            .rx_ring
            .as_mut()
            .expect("built with an rx ring (rx_count > 0)");
        // SAFETY: the descriptors come from the kernel, which hands back
        // only the frame addresses weir put on the fill ring, inside
        // `self.umem`; that is the argument, as it is the crate's. The
        // crate makes each packet from its descriptor unchecked (its
        // pointer arithmetic, `byte_offset`, already assumes an address
        // inside the mapping), so what `run_batch_all` adds
        // (`UmemBounds::fits_packet`) is defence in depth against a
        // kernel bug or another process writing to the rings: a packet
        // outside the UMEM is dropped before any slice of it is made, so
        // nothing is read or written through it. `run_batch_all` returns
        // each packet to the UMEM (free_packet) or moves it into the tx
        // ring within the same call, so none outlives the UMEM.
        unsafe { rx.recv(&self.umem, &mut self.rx) }
    }

    /// Returns transmitted frames to the UMEM and hands free frames to the
    /// fill ring.
    fn reclaim(&mut self) -> Result<(), XskError> {
        let done = self.umem.outstanding();
        self.rings.completion_ring.dequeue(&mut self.umem, done);
        // The crate's enqueue is all-or-nothing (libxdp's `reserve`): asking
        // for more than the ring has room for queues nothing, so ask for what
        // is free, halving until it fits. Bounded: each turn halves the
        // request or queues at least one frame of a ring of `ring_size`.
        let mut want = self.umem.allocatable().min(self.ring_size);
        let mut queued = 0;
        for _ in 0..MAX_FILL_TURNS {
            if want == 0 {
                break;
            }
            // SAFETY: as in `bind`: the UMEM outlives the socket. Without a
            // wakeup the call makes no syscall and cannot fail.
            let n = unsafe { self.rings.fill_ring.enqueue(&mut self.umem, want, false) }?;
            if n == 0 {
                want /= 2;
            } else {
                queued += n;
                want = want.min(self.umem.allocatable());
            }
        }
        // Only zero-copy needs a wakeup for new fill-ring frames: in copy mode
        // the kernel takes them as packets arrive, and a wakeup `recvfrom`
        // returns without doing anything (net/xdp/xsk.c, `__xsk_recvmsg`
        // wakes `xs->zc` sockets only). The `xdp` crate does not expose the
        // ring's need-wakeup flag, so zero-copy wakes on every refill, with a
        // zero-timeout poll (which wakes the driver the same way).
        if queued > 0 && self.zero_copy {
            self.socket
                .poll_read(PollTimeout::new(Some(Duration::ZERO)))?;
        }
        Ok(())
    }
}

/// The UMEM as the `xdp` crate lays it out: `frames` frames of
/// `frame_size` bytes, each a packet buffer past the kernel's
/// `XDP_PACKET_HEADROOM`, its data `head_room` bytes into the buffer.
/// What a descriptor must fit in before its packet is made a slice.
#[derive(Debug, Clone, Copy)]
struct UmemBounds {
    frames: u64,
    frame_size: u64,
    head_room: u64,
}

/// The kernel's headroom before each frame's packet buffer.
const XDP_PACKET_HEADROOM: u64 = xdp::libc::xdp::XDP_PACKET_HEADROOM;

impl UmemBounds {
    /// Whether the packet of a descriptor (`addr`, `len`) lies in one
    /// frame of the UMEM as the crate turns it into a slice: the buffer it
    /// maps (from `addr - head_room`, a frame less the XDP headroom long)
    /// within a single frame, and the `len` bytes within that buffer. A
    /// kernel bug, or another process writing to the rings, could hand
    /// weir any address and length: a slice made of one outside is
    /// undefined behaviour (a read or write of whatever lies there), or a
    /// panic in the crate's indexing.
    fn fits(&self, addr: u64, len: u64) -> bool {
        let cap = self.frame_size.saturating_sub(XDP_PACKET_HEADROOM);
        let Some(start) = addr.checked_sub(self.head_room) else {
            return false;
        };
        start / self.frame_size < self.frames
            && start % self.frame_size + cap <= self.frame_size
            && self
                .head_room
                .checked_add(len)
                .is_some_and(|end| end <= cap)
    }

    /// [`Self::fits`] for `packet`'s descriptor, read without making a
    /// slice of the packet.
    fn fits_packet(&self, packet: &mut Packet) -> bool {
        // A copy of the packet's pointers, made back into its descriptor.
        let desc: xdp::libc::xdp::xdp_desc = packet.__inner_copy().into();
        self.fits(desc.addr, u64::from(desc.len))
    }
}

/// Bound on the enqueue attempts of one refill: a halving per bit of the
/// ring size, plus the successful ones.
const MAX_FILL_TURNS: usize = 64;

// SAFETY: every pointer an `XskSocket` holds points into mappings it owns (the
// UMEM, the rings) and nothing is tied to the creating thread. The only `!Send`
// parts are the `Packet`s of the `rx` and `tx` slabs and of `frames`: pointers
// into this socket's own UMEM, and no copy of them exists elsewhere (the
// callback of `run_batch_all` only ever sees byte slices borrowed for the
// call, never a `Packet`; `queue_copy` copies bytes into a frame of this
// socket's own UMEM). Between calls `rx` and `frames` are empty, except after
// a callback panicked (the next call frees what such a panic left), and `tx`
// holds only copies queued for the next flush. So
// moving the socket to another thread (a worker) moves sole ownership of
// everything it points to.
unsafe impl Send for XskSocket {}

impl AsRawFd for XskSocket {
    fn as_raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }
}

/// Waits up to `timeout` (at most 1 s) until at least one of `fds` (AF_XDP or
/// AF_PACKET sockets) has something to receive; `ready[i]` says whether
/// `fds[i]` has. For a worker that serves a queue of several interfaces:
/// one wait for all, then [`XskSocket::run_batch_all`] with a zero timeout
/// on the ready ones. An interrupted wait reports nothing ready.
pub fn poll_readable(
    fds: &[RawFd],
    timeout: Duration,
    ready: &mut Vec<bool>,
) -> std::io::Result<()> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.min(Duration::from_secs(1)).as_millis() as libc::c_int;
    // SAFETY: `pfds` is a live, exclusively borrowed array of `pfds.len()`
    // initialised `pollfd`s for the duration of the call; poll(2) writes
    // only their `revents`. A descriptor that is not open is reported as
    // POLLNVAL, not undefined behaviour.
    let rc = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
    ready.clear();
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            ready.resize(fds.len(), false);
            return Ok(());
        }
        return Err(e);
    }
    ready.extend(pfds.iter().map(|p| p.revents & libc::POLLIN != 0));
    Ok(())
}

/// The number of rx queues of `interface` (in the calling thread's network
/// namespace), as `ethtool -l` reports it: rx-only plus combined channels. A
/// driver without channel support (loopback, for one) has one queue.
pub fn rx_queue_count(interface: &str) -> Result<u32, XskError> {
    /// `struct ethtool_channels` (linux/ethtool.h).
    #[repr(C)]
    #[derive(Default)]
    struct EthtoolChannels {
        cmd: u32,
        max_rx: u32,
        max_tx: u32,
        max_other: u32,
        max_combined: u32,
        rx_count: u32,
        tx_count: u32,
        other_count: u32,
        combined_count: u32,
    }
    const ETHTOOL_GCHANNELS: u32 = 0x3c;

    let name = interface.as_bytes();
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(&0) {
        return Err(XskError::NoInterface(interface.to_owned()));
    }
    // SAFETY: plain socket(2); the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut channels = EthtoolChannels {
        cmd: ETHTOOL_GCHANNELS,
        ..Default::default()
    };
    // SAFETY: `ifreq` is plain old data; all zeroes is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, &src) in ifr.ifr_name.iter_mut().zip(name) {
        *dst = src as libc::c_char;
    }
    ifr.ifr_ifru.ifru_data = (&mut channels as *mut EthtoolChannels).cast();
    // SAFETY: SIOCETHTOOL reads the NUL-terminated name (checked shorter than
    // IFNAMSIZ, the rest zero) and writes at most one `ethtool_channels` into
    // `channels`, which is live and correctly laid out for the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCETHTOOL, &mut ifr) };
    if rc == 0 {
        return Ok((channels.rx_count + channels.combined_count).max(1));
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::ENODEV) => Err(XskError::NoInterface(interface.to_owned())),
        // No channel support in the driver: a single queue.
        Some(libc::EOPNOTSUPP) => Ok(1),
        _ => Err(err.into()),
    }
}

/// Kernel answers to a wakeup that mean "busy, call again", not failure.
fn is_retry(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAGAIN | libc::EBUSY | libc::ENOBUFS | libc::EINTR)
    )
}

/// Most frames the kernel transmits per `sendto` in copy mode
/// (`MAX_PER_SOCKET_BUDGET` in net/xdp/xsk.c); past it the call says EAGAIN.
const TX_BUDGET_PER_KICK: usize = 32;

/// Tells the kernel to transmit what is on the tx ring. In copy mode (veth)
/// the transmission happens inside this `sendto`, at most
/// [`TX_BUDGET_PER_KICK`] frames per call, so `queued` frames need a few calls;
/// bounded by that count, and whatever stays queued goes at the next batch.
fn kick_tx(fd: RawFd, queued: usize) -> Result<(), XskError> {
    for _ in 0..queued.div_ceil(TX_BUDGET_PER_KICK) + 1 {
        // SAFETY: a zero-length send with null buffers on a socket we own;
        // the kernel reads no memory from us.
        let rc = unsafe {
            libc::sendto(
                fd,
                std::ptr::null(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null(),
                0,
            )
        };
        if rc >= 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if !is_retry(&err) {
            return Err(err.into());
        }
    }
    Ok(())
}

/// Asks the kernel whether `fd` is bound in zero-copy mode (`XDP_OPTIONS`).
fn is_zero_copy(fd: RawFd) -> bool {
    let mut opts = libc::xdp_options { flags: 0 };
    let mut len = std::mem::size_of::<libc::xdp_options>() as libc::socklen_t;
    // SAFETY: `opts` and `len` are live locals of the sizes passed; the kernel
    // writes at most `len` bytes into `opts`.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_XDP,
            libc::XDP_OPTIONS,
            (&mut opts as *mut libc::xdp_options).cast(),
            &mut len,
        )
    };
    rc == 0 && opts.flags & libc::XDP_OPTIONS_ZEROCOPY != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring batch's frame shrinks to what `truncate` says (and the
    /// length to send follows); a length not shorter changes nothing.
    #[test]
    fn truncate_shrinks_a_ring_frame_and_its_length_to_send() {
        let (mut a, mut b) = ([1u8; 100], [2u8; 60]);
        let mut frames: [&mut [u8]; 2] = [&mut a, &mut b];
        let partial = [false, false];
        let mut lens = [100, 60];
        let mut verdicts = [Verdict::Drop; 2];
        let mut batch = Batch::ring(&mut frames, &partial, &mut lens, &mut verdicts);
        assert!(batch.truncate(0, 42));
        assert!(!batch.truncate(1, 60));
        assert!(!batch.truncate(1, 61));
        assert_eq!(batch.frame(0), &[1u8; 42][..]);
        assert_eq!(batch.frame(1).len(), 60);
        assert_eq!(lens, [42, 60]);
    }

    /// A descriptor fits when its packet lies in one frame of the UMEM as
    /// the crate maps it; one past the last frame, crossing a frame's end,
    /// longer than a frame, or before the first frame (an address below
    /// the headroom) does not, and is dropped rather than made a slice.
    #[test]
    fn descriptors_outside_the_umem_do_not_fit() {
        const FS: u64 = 4096;
        let cap = FS - XDP_PACKET_HEADROOM;
        let b = UmemBounds {
            frames: 4,
            frame_size: FS,
            head_room: 0,
        };
        // Where the kernel puts a frame's packet, in the first and the last
        // frame, from empty to a whole frame.
        for frame in [0, 3] {
            let addr = frame * FS + XDP_PACKET_HEADROOM;
            for len in [0, 60, 1500, cap] {
                assert!(b.fits(addr, len), "frame {frame}, len {len}");
            }
            assert!(!b.fits(addr, cap + 1), "frame {frame}: past its end");
        }
        // Past the UMEM: the next frame, far away, at the very end.
        assert!(!b.fits(4 * FS + XDP_PACKET_HEADROOM, 60));
        assert!(!b.fits(1 << 40, 60));
        assert!(!b.fits(u64::MAX, 0));
        assert!(!b.fits(u64::MAX - 10, 60));
        // A buffer that starts late in the last frame runs off the UMEM.
        assert!(!b.fits(3 * FS + 1000, 0));
        // Lengths no frame holds.
        assert!(!b.fits(XDP_PACKET_HEADROOM, u64::from(u32::MAX)));
        assert!(!b.fits(XDP_PACKET_HEADROOM, u64::MAX));
        // With a headroom, an address below it would wrap.
        let h = UmemBounds { head_room: 64, ..b };
        assert!(h.fits(XDP_PACKET_HEADROOM + 64, cap - 64));
        assert!(!h.fits(XDP_PACKET_HEADROOM + 64, cap - 63));
        assert!(!h.fits(10, 0));
    }

    #[test]
    fn a_socket_can_move_to_a_worker_thread() {
        fn send<T: Send>() {}
        send::<XskSocket>();
    }

    #[test]
    fn bad_configurations_are_refused_before_any_syscall() {
        let err = |cfg| XskSocket::bind("lo", 0, cfg).unwrap_err();
        let batch0 = XskConfig {
            batch: 0,
            ..XskConfig::default()
        };
        assert!(matches!(err(batch0), XskError::Config(m) if m.contains("batch 0")));
        let too_big = XskConfig {
            batch: 4096,
            ring_size: 2048,
            ..XskConfig::default()
        };
        assert!(matches!(err(too_big), XskError::Config(_)));
        let missing = XskSocket::bind("weir-nosuch0", 0, XskConfig::default()).unwrap_err();
        assert!(matches!(&missing, XskError::NoInterface(n) if n == "weir-nosuch0"));
        assert!(matches!(
            rx_queue_count("weir-nosuch0"),
            Err(XskError::NoInterface(_))
        ));
        assert!(matches!(
            rx_queue_count("a-name-longer-than-ifnamsiz"),
            Err(XskError::NoInterface(_))
        ));
        let nul = XskSocket::bind("a\0b", 0, XskConfig::default()).unwrap_err();
        assert!(matches!(nul, XskError::NoInterface(_)));
    }

    #[test]
    fn ring_sizes_that_are_not_powers_of_two_are_refused() {
        let cfg = XskConfig {
            ring_size: 1000,
            batch: 10,
            ..XskConfig::default()
        };
        let err = XskSocket::bind("lo", 0, cfg).unwrap_err();
        assert!(matches!(err, XskError::Config(_)), "{err:?}");
    }
}

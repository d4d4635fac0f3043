//! AF_PACKET fallback for interfaces where XDP cannot attach: a TPACKET_V3
//! receive ring, `sendmmsg` transmission, and `PACKET_FANOUT` (hash) to spread
//! flows over one socket per worker.
//!
//! [`PacketSocket::run_batch_all`] has the shape of
//! [`crate::XskSocket::run_batch_all`]: the callback gets a [`Batch`] of frames,
//! rewrites them in place in the receive ring, sets a [`Verdict`] per frame,
//! and the frames to send leave in one `sendmmsg` straight from the ring (the
//! kernel copies them; no copy in user space).
//!
//! Unlike AF_XDP, AF_PACKET receives a *copy*: the kernel still processes the
//! original packet. Whoever uses this must make the kernel drop the traffic
//! weir serves (an nftables `netdev` ingress rule or a tc ingress filter:
//! both run after the AF_PACKET tap), or not own the virtual addresses (the
//! kernel then drops or forwards them, depending on `ip_forward`). VLAN tags
//! the kernel strips on receive are not put back on transmit.
//!
//! Every `unsafe` block here has its `SAFETY:` argument; they are the socket
//! options, the ring mapping, and reading the ring the kernel hands over.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::xsk::{Batch, BatchStats, Verdict};

/// Sizes and options of one [`PacketSocket`].
#[derive(Debug, Clone, Copy)]
pub struct PacketConfig {
    /// Bytes per ring block: a multiple of the page size. Default 1 MiB.
    pub block_size: u32,
    /// Blocks in the ring. Default 16.
    pub block_count: u32,
    /// A block with packets is handed over after this long even if not full
    /// (TPACKET_V3's `tp_retire_blk_tov`): the added latency at low rates.
    /// Whole milliseconds, at least 1. Default 1 ms.
    pub block_timeout: Duration,
    /// Most frames handed to the callback at once (1 to [`MAX_BATCH`]).
    /// Default 64.
    pub batch: usize,
    /// Join this `PACKET_FANOUT` group (hash mode: a flow stays on one
    /// socket). Every socket of one interface's workers uses the same id; ids
    /// are per network namespace. `None`: receive everything.
    pub fanout: Option<u16>,
}

impl Default for PacketConfig {
    fn default() -> Self {
        Self {
            block_size: 1 << 20,
            block_count: 16,
            block_timeout: Duration::from_millis(1),
            batch: 64,
            fanout: None,
        }
    }
}

/// Largest [`PacketConfig::batch`]: the frame slices of a batch live on the
/// stack.
pub const MAX_BATCH: usize = 256;

/// Errors of [`PacketSocket`]'s operations.
#[derive(Debug, thiserror::Error)]
pub enum PacketError {
    /// The configuration was refused before any syscall.
    #[error("AF_PACKET configuration: {0}")]
    Config(String),
    /// The interface does not exist (in this network namespace).
    #[error("no interface {0:?}")]
    NoInterface(String),
    /// A setup step failed.
    #[error("AF_PACKET socket on {interface}: {op}: {source} (needs root or CAP_NET_RAW)")]
    Setup {
        /// The interface.
        interface: String,
        /// The step (`socket`, `PACKET_RX_RING`, `mmap`, `bind`, ...).
        op: &'static str,
        /// What the kernel said.
        source: std::io::Error,
    },
    /// Polling or sending failed.
    #[error("AF_PACKET I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// `TP_STATUS_CSUMNOTREADY` (linux/if_packet.h): the packet's L4 checksum is
/// `CHECKSUM_PARTIAL` (a local sender on a veth or an offloading device).
const TP_STATUS_CSUM_NOT_READY: u32 = 1 << 3;

/// `TPACKET_V3` of `enum tpacket_versions` (linux/if_packet.h).
const TPACKET_V3: libc::c_int = 2;

/// One AF_PACKET socket bound to an interface, with its TPACKET_V3 ring.
pub struct PacketSocket {
    fd: OwnedFd,
    ring: NonNull<u8>,
    ring_len: usize,
    block_size: usize,
    block_count: usize,
    /// The block being read, and where in it: `left` packets from byte
    /// `next`. `left == 0`: the block is not ours (yet).
    block: usize,
    next: usize,
    left: u32,
    batch: usize,
    interface: String,
    /// Per-batch scratch, reused: each frame's ring offset, length and
    /// partial-checksum flag; the verdicts; `sendmmsg`'s vectors.
    offsets: Vec<(usize, usize)>,
    partial: Vec<bool>,
    /// Each frame's length to send (a callback may shrink a frame).
    lens: Vec<usize>,
    verdicts: Vec<Verdict>,
    iovecs: Vec<libc::iovec>,
    msgs: Vec<libc::mmsghdr>,
    /// Frames the kernel dropped (ring full) so far: `PACKET_STATISTICS`
    /// resets its counters on every read, so they are summed here.
    ring_drops: u64,
}

impl std::fmt::Debug for PacketSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacketSocket")
            .field("interface", &self.interface)
            .field("block_size", &self.block_size)
            .field("block_count", &self.block_count)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl PacketSocket {
    /// Opens a socket on `interface` (in the calling thread's network
    /// namespace) with its receive ring, ignoring its own transmissions, in
    /// the fanout group `config.fanout` if given.
    pub fn bind(interface: &str, config: PacketConfig) -> Result<Self, PacketError> {
        let page = page_size();
        let timeout_ms = config.block_timeout.as_millis();
        if config.batch == 0 || config.batch > MAX_BATCH {
            return Err(PacketError::Config(format!(
                "batch {} must be between 1 and {MAX_BATCH}",
                config.batch
            )));
        }
        if config.block_size == 0 || !(config.block_size as usize).is_multiple_of(page) {
            return Err(PacketError::Config(format!(
                "block size {} must be a non-zero multiple of the page size {page}",
                config.block_size
            )));
        }
        if config.block_count == 0 {
            return Err(PacketError::Config("block count must not be 0".into()));
        }
        if !(1..=u128::from(u32::MAX)).contains(&timeout_ms) {
            return Err(PacketError::Config(format!(
                "block timeout {:?} must be at least 1 ms",
                config.block_timeout
            )));
        }
        let ring_len = config.block_size as usize * config.block_count as usize;
        let ifindex = ifindex(interface)?;
        let err = |op| {
            let source = std::io::Error::last_os_error();
            PacketError::Setup {
                interface: interface.to_owned(),
                op,
                source,
            }
        };

        // Protocol 0: nothing is received before the ring exists; `bind`
        // below starts reception.
        // SAFETY: plain socket(2); the result is checked before use.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(err("socket"));
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let raw = fd.as_raw_fd();

        setsockopt(raw, libc::PACKET_VERSION, &TPACKET_V3).map_err(|()| err("PACKET_VERSION"))?;
        let req = libc::tpacket_req3 {
            tp_block_size: config.block_size,
            tp_block_nr: config.block_count,
            // V3 packs packets of any size into blocks; the frame fields
            // only have to be consistent (a frame size dividing the block).
            tp_frame_size: 2048,
            tp_frame_nr: (ring_len / 2048) as u32,
            tp_retire_blk_tov: timeout_ms as u32,
            tp_sizeof_priv: 0,
            tp_feature_req_word: 0,
        };
        setsockopt(raw, libc::PACKET_RX_RING, &req).map_err(|()| err("PACKET_RX_RING"))?;
        // SAFETY: maps the ring the kernel just allocated for `raw`, of the
        // size it was asked for; the result is checked before use.
        let ring = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                ring_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                raw,
                0,
            )
        };
        if ring == libc::MAP_FAILED {
            return Err(err("mmap"));
        }
        let ring = NonNull::new(ring.cast::<u8>()).ok_or_else(|| err("mmap"))?;
        // From here on `sock` owns the mapping (unmapped on drop, also when a
        // later step fails).
        let sock = Self {
            fd,
            ring,
            ring_len,
            block_size: config.block_size as usize,
            block_count: config.block_count as usize,
            block: 0,
            next: 0,
            left: 0,
            batch: config.batch,
            interface: interface.to_owned(),
            offsets: Vec::with_capacity(config.batch),
            partial: Vec::with_capacity(config.batch),
            lens: Vec::with_capacity(config.batch),
            verdicts: Vec::with_capacity(config.batch),
            iovecs: Vec::with_capacity(config.batch),
            msgs: Vec::with_capacity(config.batch),
            ring_drops: 0,
        };

        // weir's own transmissions are not received back.
        setsockopt(raw, libc::PACKET_IGNORE_OUTGOING, &(1 as libc::c_int))
            .map_err(|()| err("PACKET_IGNORE_OUTGOING"))?;
        // SAFETY: `sockaddr_ll` is plain old data; all zeroes is valid.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
        addr.sll_ifindex = ifindex;
        // SAFETY: `addr` is a live `sockaddr_ll` of the length passed.
        let rc = unsafe {
            libc::bind(
                raw,
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(err("bind"));
        }
        if let Some(group) = config.fanout {
            let arg = libc::c_int::from(group) | ((libc::PACKET_FANOUT_HASH as libc::c_int) << 16);
            setsockopt(raw, libc::PACKET_FANOUT, &arg).map_err(|()| err("PACKET_FANOUT"))?;
        }
        Ok(sock)
    }

    /// What the kernel dropped for this socket so far: frames that found
    /// the receive ring full (`PACKET_STATISTICS`' `tp_drops`, summed over
    /// the reads, since each read resets it).
    pub fn kernel_drops(&mut self) -> Result<crate::KernelDrops, PacketError> {
        let mut st = libc::tpacket_stats_v3 {
            tp_packets: 0,
            tp_drops: 0,
            tp_freeze_q_cnt: 0,
        };
        let mut len = std::mem::size_of::<libc::tpacket_stats_v3>() as libc::socklen_t;
        // SAFETY: `st` is a live `tpacket_stats_v3` and `len` its size; the
        // kernel writes at most `len` bytes into it (a TPACKET_V3 socket's
        // statistics are exactly this struct) and stores the length written.
        let rc = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_STATISTICS,
                (&mut st as *mut libc::tpacket_stats_v3).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(PacketError::Io(std::io::Error::last_os_error()));
        }
        self.ring_drops += u64::from(st.tp_drops);
        Ok(crate::KernelDrops {
            rx_ring_full: self.ring_drops,
            ..crate::KernelDrops::default()
        })
    }

    /// One turn of the data path: waits up to `timeout` (capped at 1 s) for a
    /// block of packets, hands up to a batch of its frames to `f` at once —
    /// oldest first, every verdict [`Verdict::Drop`] until set — then sends
    /// those marked [`Verdict::Transmit`] out of the interface in one
    /// `sendmmsg`, and returns the block to the kernel once all its packets
    /// are done. A batch never spans two blocks. `f` is not called when
    /// nothing arrived.
    pub fn run_batch_all(
        &mut self,
        timeout: Duration,
        f: impl FnOnce(&mut Batch<'_>),
    ) -> Result<BatchStats, PacketError> {
        let mut stats = BatchStats::default();
        if self.left == 0 && !self.take_block() {
            let ms = timeout.min(Duration::from_secs(1)).as_millis() as libc::c_int;
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN | libc::POLLERR,
                revents: 0,
            };
            // SAFETY: one live `pollfd` for a descriptor we own.
            let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
            if rc < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e.into());
                }
            }
            if !self.take_block() {
                return Ok(stats);
            }
        }

        self.collect();
        let n = self.offsets.len();
        stats.received = n;
        if n > 0 {
            self.verdicts.clear();
            self.verdicts.resize(n, Verdict::Drop);
            let mut slots: [&mut [u8]; MAX_BATCH] = std::array::from_fn(|_| <&mut [u8]>::default());
            let base = self.ring.as_ptr();
            for (slot, &(offset, len)) in slots.iter_mut().zip(&self.offsets) {
                // SAFETY: `collect` checked that every frame lies inside the
                // current block, which the kernel handed to us (status
                // TP_STATUS_USER) and does not touch until `release_block`
                // gives it back; and that the frames of a block do not
                // overlap (each ends before the next packet's header). So
                // these are disjoint, live, exclusively ours for the call;
                // the mapping outlives them (it is unmapped on drop, and they
                // die at the end of this function).
                *slot = unsafe { std::slice::from_raw_parts_mut(base.add(offset), len) };
            }
            self.lens.clear();
            self.lens.extend(self.offsets.iter().map(|&(_, len)| len));
            f(&mut Batch::ring(
                &mut slots[..n],
                &self.partial,
                &mut self.lens,
                &mut self.verdicts,
            ));
            // Frames the callback shrank (`Batch::truncate`) are sent shorter.
            for (&cut, (_, len)) in self.lens.iter().zip(self.offsets.iter_mut()) {
                *len = (*len).min(cut);
            }
            self.transmit(&mut stats)?;
        }
        if self.left == 0 {
            self.release_block();
        }
        Ok(stats)
    }

    /// The status word of block `i`.
    fn status(&self, i: usize) -> &AtomicU32 {
        // SAFETY: block `i < block_count` starts at `i * block_size` inside
        // the mapping; its first bytes are a `tpacket_block_desc`, whose
        // `block_status` (offset 8, 4-aligned: blocks are page-aligned) is the
        // word the kernel and we hand the block over with. Shared memory
        // written by the kernel is only read through this atomic.
        unsafe {
            let desc = self.ring.as_ptr().add(i * self.block_size);
            AtomicU32::from_ptr(desc.add(8).cast::<u32>())
        }
    }

    /// If the current block is ours, starts reading it.
    fn take_block(&mut self) -> bool {
        let status = self.status(self.block).load(Ordering::Acquire);
        if status & libc::TP_STATUS_USER == 0 {
            return false;
        }
        // SAFETY: the block is ours (status read with Acquire above, so the
        // kernel's writes to it are visible); `tpacket_block_desc` is 8-byte
        // aligned at the page-aligned block start and lies inside it.
        let hdr = unsafe {
            let desc = self
                .ring
                .as_ptr()
                .add(self.block * self.block_size)
                .cast::<libc::tpacket_block_desc>();
            (*desc).hdr.bh1
        };
        self.left = hdr.num_pkts;
        self.next = hdr.offset_to_first_pkt as usize;
        if self.left == 0 {
            self.release_block();
            return false;
        }
        true
    }

    /// Reads up to a batch of the current block's packets into `offsets`
    /// (ring offset, length) and `partial`. A header that points outside the
    /// block ends the block.
    fn collect(&mut self) {
        self.offsets.clear();
        self.partial.clear();
        let block_start = self.block * self.block_size;
        let hdr_len = std::mem::size_of::<libc::tpacket3_hdr>();
        while self.left > 0 && self.offsets.len() < self.batch {
            let at = self.next;
            if at + hdr_len > self.block_size {
                self.left = 0;
                break;
            }
            // SAFETY: `at + hdr_len` is inside the block (checked), which is
            // ours until released; read unaligned so no alignment is assumed.
            let h: libc::tpacket3_hdr = unsafe {
                std::ptr::read_unaligned(
                    self.ring
                        .as_ptr()
                        .add(block_start + at)
                        .cast::<libc::tpacket3_hdr>(),
                )
            };
            let start = at + usize::from(h.tp_mac);
            let end = start + h.tp_snaplen as usize;
            let next = at + h.tp_next_offset as usize;
            // The frame must lie in the block and, unless it is the last,
            // end before the next packet's header (frames never overlap).
            // The next header's offset is the kernel's word too: it bounds
            // the frame only inside the block.
            let limit = if self.left > 1 {
                next.min(self.block_size)
            } else {
                self.block_size
            };
            if usize::from(h.tp_mac) < hdr_len
                || end > limit
                || (self.left > 1 && h.tp_next_offset == 0)
            {
                self.left = 0;
                break;
            }
            self.offsets.push((block_start + start, end - start));
            self.partial
                .push(h.tp_status & TP_STATUS_CSUM_NOT_READY != 0);
            self.left -= 1;
            self.next = next;
        }
    }

    /// Sends the frames marked `Transmit`, in order, with `sendmmsg`.
    fn transmit(&mut self, stats: &mut BatchStats) -> Result<(), PacketError> {
        self.iovecs.clear();
        self.msgs.clear();
        let base = self.ring.as_ptr();
        for (&(offset, len), verdict) in self.offsets.iter().zip(&self.verdicts) {
            match verdict {
                Verdict::Transmit => self.iovecs.push(libc::iovec {
                    // SAFETY: inside the mapping, as checked by `collect`.
                    iov_base: unsafe { base.add(offset) }.cast(),
                    iov_len: len,
                }),
                Verdict::Drop => stats.dropped += 1,
            }
        }
        for iov in &mut self.iovecs {
            // SAFETY: `msghdr` is plain old data; all zeroes is valid (no
            // address: the socket is bound to the interface).
            let mut msg: libc::mmsghdr = unsafe { std::mem::zeroed() };
            msg.msg_hdr.msg_iov = iov;
            msg.msg_hdr.msg_iovlen = 1;
            self.msgs.push(msg);
        }
        let mut sent = 0;
        let mut skipped = 0;
        // Bounded: every turn but an interrupted one sends or skips at least
        // one message, or stops.
        for _ in 0..2 * self.msgs.len() + 8 {
            let done = sent + skipped;
            if done >= self.msgs.len() {
                break;
            }
            // SAFETY: `msgs[done..]` are live `mmsghdr`s whose iovecs point at
            // live frames in the ring; the kernel copies them during the call
            // and keeps no pointer.
            let rc = unsafe {
                libc::sendmmsg(
                    self.fd.as_raw_fd(),
                    self.msgs.as_mut_ptr().add(done),
                    (self.msgs.len() - done) as libc::c_uint,
                    libc::MSG_DONTWAIT,
                )
            };
            if rc > 0 {
                sent += rc as usize;
                continue;
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => {}
                // The device queue is full: the rest is dropped, counted.
                Some(libc::EAGAIN | libc::ENOBUFS) => break,
                // This frame cannot go (larger than the MTU, malformed):
                // drop it, counted, and send the others.
                Some(libc::EMSGSIZE | libc::EINVAL) => skipped += 1,
                _ => {
                    stats.transmitted = sent;
                    stats.tx_full = self.msgs.len() - sent;
                    return Err(e.into());
                }
            }
        }
        stats.transmitted = sent;
        stats.tx_full = self.msgs.len() - sent;
        Ok(())
    }

    /// Returns the current block to the kernel and moves to the next.
    fn release_block(&mut self) {
        self.status(self.block)
            .store(libc::TP_STATUS_KERNEL, Ordering::Release);
        self.block = (self.block + 1) % self.block_count;
        self.left = 0;
        self.next = 0;
    }
}

impl Drop for PacketSocket {
    fn drop(&mut self) {
        // SAFETY: `ring` is the mapping of `ring_len` bytes made in `bind`;
        // nothing borrows it past a `run_batch_all` call, so nothing refers to
        // it any more. The descriptor closes after (field drop).
        unsafe {
            libc::munmap(self.ring.as_ptr().cast(), self.ring_len);
        }
    }
}

// SAFETY: the raw pointers a `PacketSocket` holds (the ring, and the iovec and
// mmsghdr scratch, rewritten before every use) point into the mapping it owns
// and frees on drop; nothing is tied to the creating thread. Moving the socket
// to a worker thread moves sole ownership of all of it.
unsafe impl Send for PacketSocket {}

impl AsRawFd for PacketSocket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).unwrap_or(4096).max(1)
}

fn ifindex(interface: &str) -> Result<i32, PacketError> {
    let name = std::ffi::CString::new(interface)
        .map_err(|_| PacketError::NoInterface(interface.to_owned()))?;
    // SAFETY: `name` is a NUL-terminated string that lives across the call.
    let i = unsafe { libc::if_nametoindex(name.as_ptr()) };
    i32::try_from(i)
        .ok()
        .filter(|&i| i > 0)
        .ok_or_else(|| PacketError::NoInterface(interface.to_owned()))
}

/// `setsockopt(fd, SOL_PACKET, opt, value)`; `Err(())` leaves errno set.
fn setsockopt<T>(fd: RawFd, opt: libc::c_int, value: &T) -> Result<(), ()> {
    // SAFETY: `value` is a live `T` of the size passed; the kernel reads at
    // most that many bytes.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_PACKET,
            opt,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc == 0 { Ok(()) } else { Err(()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket over an anonymous mapping of one 4 KiB block (no kernel
    /// ring), its block handed to user space with `num_pkts` packets from
    /// `first`, the packet headers written by `hdrs` (block offset, header).
    fn fake_socket(
        num_pkts: u32,
        first: u32,
        hdrs: &[(usize, libc::tpacket3_hdr)],
    ) -> PacketSocket {
        let block_size = 4096;
        // SAFETY: a fresh private anonymous mapping; checked below.
        let ring = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                block_size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ring, libc::MAP_FAILED);
        let ring = NonNull::new(ring.cast::<u8>()).unwrap();
        // SAFETY: the block descriptor and every header lie inside the
        // fresh mapping (the test's offsets are below 4096 - 48).
        unsafe {
            let desc = ring.as_ptr().cast::<libc::tpacket_block_desc>();
            (*desc).hdr.bh1.num_pkts = num_pkts;
            (*desc).hdr.bh1.offset_to_first_pkt = first;
            (*desc).hdr.bh1.block_status = libc::TP_STATUS_USER;
            for &(at, h) in hdrs {
                std::ptr::write_unaligned(ring.as_ptr().add(at).cast(), h);
            }
        }
        PacketSocket {
            fd: std::fs::File::open("/dev/null").unwrap().into(),
            ring,
            ring_len: block_size,
            block_size,
            block_count: 1,
            block: 0,
            next: 0,
            left: 0,
            batch: 64,
            interface: "fake".into(),
            offsets: Vec::new(),
            partial: Vec::new(),
            lens: Vec::new(),
            verdicts: Vec::new(),
            iovecs: Vec::new(),
            msgs: Vec::new(),
            ring_drops: 0,
        }
    }

    /// A packet that is not the block's last, whose next-packet offset
    /// points past the block, may not stretch its frame past the block
    /// (here past the whole mapping): `collect` used to bound such a frame
    /// by the next header's offset only, and `run_batch_all` then made a
    /// slice of unmapped memory.
    #[test]
    fn a_frame_never_reaches_past_its_block() {
        // SAFETY: `tpacket3_hdr` is plain old data; all zeroes is valid.
        let mut h: libc::tpacket3_hdr = unsafe { std::mem::zeroed() };
        let hdr_len = std::mem::size_of::<libc::tpacket3_hdr>();
        h.tp_mac = hdr_len as u16;
        h.tp_snaplen = 60_000;
        h.tp_next_offset = 65_000;
        let mut sock = fake_socket(2, 64, &[(64, h)]);
        assert!(sock.take_block());
        sock.collect();
        for &(offset, len) in &sock.offsets {
            assert!(
                offset + len <= sock.block_size,
                "frame at {offset} of {len} bytes leaves the {}-byte block",
                sock.block_size
            );
        }
        // A well-formed pair in the same block is still read.
        let mut a = h;
        a.tp_snaplen = 100;
        a.tp_next_offset = 256;
        let mut b = a;
        b.tp_next_offset = 0;
        let mut sock = fake_socket(2, 64, &[(64, a), (320, b)]);
        assert!(sock.take_block());
        sock.collect();
        assert_eq!(
            sock.offsets,
            vec![(64 + hdr_len, 100), (320 + hdr_len, 100)]
        );
    }

    #[test]
    fn a_socket_can_move_to_a_worker_thread() {
        fn send<T: Send>() {}
        send::<PacketSocket>();
    }

    #[test]
    fn bad_configurations_are_refused_before_any_syscall() {
        let bind = |cfg| PacketSocket::bind("lo", cfg).unwrap_err();
        let ok = PacketConfig::default();
        for (cfg, what) in [
            (PacketConfig { batch: 0, ..ok }, "batch 0"),
            (
                PacketConfig {
                    batch: MAX_BATCH + 1,
                    ..ok
                },
                "batch 257",
            ),
            (
                PacketConfig {
                    block_size: 1000,
                    ..ok
                },
                "block size 1000",
            ),
            (
                PacketConfig {
                    block_size: 0,
                    ..ok
                },
                "block size 0",
            ),
            (
                PacketConfig {
                    block_count: 0,
                    ..ok
                },
                "block count",
            ),
            (
                PacketConfig {
                    block_timeout: Duration::from_micros(10),
                    ..ok
                },
                "block timeout",
            ),
        ] {
            let err = bind(cfg);
            assert!(
                matches!(&err, PacketError::Config(m) if m.contains(what)),
                "{what}: {err:?}"
            );
        }
        let missing = PacketSocket::bind("weir-nosuch0", ok).unwrap_err();
        assert!(matches!(&missing, PacketError::NoInterface(n) if n == "weir-nosuch0"));
        let nul = PacketSocket::bind("a\0b", ok).unwrap_err();
        assert!(matches!(nul, PacketError::NoInterface(_)));
    }
}

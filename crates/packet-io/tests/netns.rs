//! The XDP steering program and AF_XDP sockets on a real veth pair, in network
//! namespaces this test creates and removes.
//!
//! Topology: namespace `client` (192.0.2.1, 2001:db8::1) — veth — namespace
//! `weir` (192.0.2.2, 2001:db8::2). The program is attached on the weir side,
//! UDP 9000 on both weir addresses is registered, and an AF_XDP loop echoes what
//! it receives (MACs, addresses and ports swapped: the checksums stay valid).
//! The client must get every datagram back; UDP 9001 in the weir namespace is
//! served by an ordinary kernel socket and must still answer (not steered).
//!
//! Threads, not helper binaries: each side runs on a dedicated thread that
//! `setns(2)`s into its namespace; sockets, interface lookups and the XDP attach
//! then happen in that namespace, and the test process itself is never moved.
//!
//! Needs root, `ip` (iproute2) and ethtool; without them it prints why and
//! returns.

use std::collections::BTreeSet;
use std::net::{SocketAddr, UdpSocket};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use weir_packet_io::{AttachMode, SteerKey, SteerStats, Steering, Verdict, XskConfig, XskSocket};

const DATAGRAMS: usize = 64;
/// Client sockets per address family in the AF_XDP test.
const FLOWS: usize = 16;
/// Queues of each veth.
const QUEUES: usize = 2;
const VIP_PORT: u16 = 9000;
const KERNEL_PORT: u16 = 9001;
const UDP: u8 = 17;
const TCP: u8 = 6;
/// Raw tagged frames the generic-mode test sends that match a key.
const TAGGED_MATCHES: u64 = 4;

/// Why this test cannot run here, if it cannot.
fn missing_prerequisite() -> Option<String> {
    if !weir_packet_io::PROGRAM_BUILT {
        return Some("built without the XDP program (no clang at build time)".into());
    }
    if !nix::unistd::geteuid().is_root() {
        return Some("needs root (network namespaces, XDP, AF_XDP)".into());
    }
    if Command::new("ethtool").arg("--version").output().is_err() {
        return Some("needs ethtool (Debian package ethtool)".into());
    }
    match Command::new("ip").args(["netns", "list"]).output() {
        Ok(out) if out.status.success() => None,
        Ok(out) => Some(format!(
            "`ip netns list` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Some(format!("needs `ip` from iproute2: {e}")),
    }
}

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two namespaces joined by a veth pair; removed on drop, also on failure.
struct Topology {
    client: String,
    weir: String,
    client_if: String,
    weir_if: String,
}

/// The tags [`Topology::new`] was given in this process. The names of the
/// namespaces and interfaces are the tag and the process id, so two tests of
/// one tag that ran at once made the same namespaces: the second's `ip netns
/// add` failed, and its drop deleted the first's.
static TAGS: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

impl Topology {
    /// `tag` must be this test's alone, and short: an interface's name, `xc`
    /// or `xw`, the tag and the process id, is at most 15 bytes.
    fn new(tag: &str) -> Result<Self, String> {
        let new_tag = TAGS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(tag.to_string());
        if !new_tag {
            return Err(format!("tag {tag:?} is another test's: give each its own"));
        }
        let id = std::process::id();
        let topo = Topology {
            client: format!("weirxdp-{tag}-c-{id}"),
            weir: format!("weirxdp-{tag}-w-{id}"),
            // Interface names are at most 15 bytes.
            client_if: format!("xc{tag}{id}"),
            weir_if: format!("xw{tag}{id}"),
        };
        // From here on, a failure drops `topo`, which deletes what exists.
        let (c, w, ci, wi) = (&topo.client, &topo.weir, &topo.client_if, &topo.weir_if);
        run(&["ip", "netns", "add", c])?;
        run(&["ip", "netns", "add", w])?;
        run(&[
            "ip",
            "link",
            "add",
            ci,
            "netns",
            c,
            "numtxqueues",
            "2",
            "numrxqueues",
            "2",
            "type",
            "veth",
            "peer",
            "name",
            wi,
            "netns",
            w,
            "numtxqueues",
            "2",
            "numrxqueues",
            "2",
        ])?;
        for (ns, dev, v4, v6) in [
            (c, ci, "192.0.2.1/24", "2001:db8::1/64"),
            (w, wi, "192.0.2.2/24", "2001:db8::2/64"),
        ] {
            run(&["ip", "-n", ns, "addr", "add", v4, "dev", dev])?;
            run(&["ip", "-n", ns, "addr", "add", v6, "dev", dev, "nodad"])?;
            run(&["ip", "-n", ns, "link", "set", dev, "up"])?;
            run(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        }
        // A local socket's datagram leaves a veth with a partial checksum
        // (only the pseudo-header sum); the echo does not finish it, so make
        // the client's kernel compute full checksums.
        run(&["ip", "netns", "exec", c, "ethtool", "-K", ci, "tx", "off"])?;
        Ok(topo)
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        // Deleting a namespace destroys the veth in it (and so its peer).
        for ns in [&self.client, &self.weir] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// Moves the calling thread into namespace `name`.
fn enter(name: &str) -> Result<(), String> {
    let file = std::fs::File::open(format!("/var/run/netns/{name}"))
        .map_err(|e| format!("open netns {name}: {e}"))?;
    nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET)
        .map_err(|e| format!("setns {name}: {e}"))
}

/// Tells the test's thread on `ready` how the weir thread's `setup` went (its
/// error, or `Ok(())`) and gives the weir thread what it made.
fn report_setup<T>(
    setup: Result<T, String>,
    ready: &mpsc::Sender<Result<(), String>>,
) -> Result<T, String> {
    let _ = ready.send(setup.as_ref().map(|_| ()).map_err(Clone::clone));
    setup
}

/// What the weir thread's setup sent on `ready` (30 s at most), and the thread
/// back; a setup that failed fails the test once the thread has ended.
#[track_caller]
fn weir_setup<T, R>(
    ready: &mpsc::Receiver<Result<T, String>>,
    weir: JoinHandle<R>,
) -> (T, JoinHandle<R>) {
    let setup = ready
        .recv_timeout(Duration::from_secs(30))
        .expect("the weir side reports within 30 s");
    match setup {
        Ok(made) => (made, weir),
        Err(e) => {
            let _ = weir.join();
            panic!("weir side setup: {e}");
        }
    }
}

/// In namespace `ns` (the calling thread moves there): the steering program
/// on `dev`, one AF_XDP socket per queue registered with it, and UDP to
/// 192.0.2.2:[`VIP_PORT`] steered to them.
fn steered_sockets(
    ns: &str,
    dev: &str,
    config: XskConfig,
) -> Result<(Steering, Vec<XskSocket>), String> {
    enter(ns)?;
    let mut steering = Steering::attach(dev).map_err(|e| e.to_string())?;
    let xsks = XskSocket::bind_all(dev, config).map_err(|e| e.to_string())?;
    for xsk in &xsks {
        steering
            .register_socket(xsk.queue(), xsk)
            .map_err(|e| e.to_string())?;
    }
    let vip = format!("192.0.2.2:{VIP_PORT}").parse().expect("literal");
    steering
        .add(SteerKey::udp(vip))
        .map_err(|e| e.to_string())?;
    Ok((steering, xsks))
}

/// Swaps source and destination of an Ethernet + IPv4/IPv6 + UDP frame in
/// place. Swapping keeps every checksum valid (the sums are commutative).
fn echo(frame: &mut [u8]) -> Verdict {
    let Ok(p) = weir_packet::parse(frame) else {
        return Verdict::Drop;
    };
    if !matches!(p.transport, weir_packet::Transport::Udp { .. }) {
        return Verdict::Drop;
    }
    let (dst_mac, src_mac) = frame.split_at_mut(6);
    dst_mac.swap_with_slice(&mut src_mac[..6]);
    let (src, len) = match p.version {
        weir_packet::IpVersion::V4 => (p.l3 + 12, 4),
        weir_packet::IpVersion::V6 => (p.l3 + 8, 16),
    };
    let (a, b) = frame[src..src + 2 * len].split_at_mut(len);
    a.swap_with_slice(b);
    let (sport, dport) = frame[p.l4..p.l4 + 4].split_at_mut(2);
    sport.swap_with_slice(dport);
    Verdict::Transmit
}

struct WeirSide {
    mode: String,
    zero_copy: bool,
    queues: usize,
}

struct WeirResult {
    /// Frames each queue's socket echoed.
    per_queue: Vec<usize>,
    program: SteerStats,
}

/// The weir side: attach, bind, register, then echo until `stop`.
fn weir_side(
    topo_ns: String,
    interface: String,
    ready: mpsc::Sender<Result<WeirSide, String>>,
    stop: Arc<AtomicBool>,
) -> Result<WeirResult, String> {
    let setup = || -> Result<(Steering, Vec<XskSocket>, UdpSocket), String> {
        enter(&topo_ns)?;
        let mut steering = Steering::attach(&interface).map_err(|e| e.to_string())?;
        let xsks =
            XskSocket::bind_all(&interface, XskConfig::default()).map_err(|e| e.to_string())?;
        for xsk in &xsks {
            steering
                .register_socket(xsk.queue(), xsk)
                .map_err(|e| e.to_string())?;
        }
        for vip in ["192.0.2.2", "[2001:db8::2]"] {
            let addr: SocketAddr = format!("{vip}:{VIP_PORT}").parse().expect("literal");
            steering
                .add(SteerKey::udp(addr))
                .map_err(|e| e.to_string())?;
        }
        // The kernel's own UDP service on the same interface, not registered.
        let kernel = UdpSocket::bind(("::", KERNEL_PORT)).map_err(|e| e.to_string())?;
        kernel
            .set_read_timeout(Some(Duration::from_millis(5)))
            .map_err(|e| e.to_string())?;
        Ok((steering, xsks, kernel))
    };
    let (steering, mut xsks, kernel) = match setup() {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e.clone()));
            return Err(e);
        }
    };
    let _ = ready.send(Ok(WeirSide {
        mode: steering.mode().to_string(),
        zero_copy: xsks.iter().any(XskSocket::zero_copy),
        queues: xsks.len(),
    }));

    let deadline = Instant::now() + Duration::from_secs(30);
    let mut per_queue = vec![0; xsks.len()];
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        for (xsk, echoed) in xsks.iter_mut().zip(&mut per_queue) {
            let stats = xsk
                .run_batch(Duration::from_millis(2), echo)
                .map_err(|e| e.to_string())?;
            *echoed += stats.transmitted;
        }
        // Serve the kernel socket from the same loop (non-blocking enough:
        // a 5 ms read timeout).
        if let Ok((n, peer)) = kernel.recv_from(&mut buf) {
            let _ = kernel.send_to(&buf[..n], peer);
        }
    }
    Ok(WeirResult {
        per_queue,
        program: steering.stats().map_err(|e| e.to_string())?,
    })
}

/// On a thread in the client's namespace: for each (local address, VIP) in
/// turn, `DATAGRAMS` datagrams from `FLOWS` sockets bound to the local address
/// to the VIP's [`VIP_PORT`] (each says `"{vip} #{i}"`); returns what came
/// back within 10 s of each VIP's sending.
fn echoes(pairs: [(&str, &str); 2]) -> Result<BTreeSet<String>, String> {
    let mut echoed = BTreeSet::new();
    for (local, vip) in pairs {
        // Many flows (source ports), so the client's veth spreads them over
        // its tx queues, which are the weir veth's rx queues.
        let socks = (0..FLOWS)
            .map(|_| {
                let sock = UdpSocket::bind(local)?;
                sock.set_read_timeout(Some(Duration::from_millis(5)))?;
                Ok(sock)
            })
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| e.to_string())?;
        let to: SocketAddr = format!("{vip}:{VIP_PORT}").parse().expect("literal");
        for i in 0..DATAGRAMS {
            socks[i % FLOWS]
                .send_to(format!("{vip} #{i}").as_bytes(), to)
                .map_err(|e| e.to_string())?;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let want = echoed.len() + DATAGRAMS;
        let mut buf = [0u8; 256];
        while echoed.len() < want && Instant::now() < deadline {
            for sock in &socks {
                if let Ok((n, from)) = sock.recv_from(&mut buf) {
                    assert_eq!(from, to, "the echo comes from the VIP:port");
                    echoed.insert(String::from_utf8_lossy(&buf[..n]).into_owned());
                }
            }
        }
    }
    Ok(echoed)
}

/// What [`echoes`] sends to `vips`: all of it should come back.
fn sent_to(vips: [&str; 2]) -> BTreeSet<String> {
    vips.iter()
        .flat_map(|vip| (0..DATAGRAMS).map(move |i| format!("{vip} #{i}")))
        .collect()
}

/// The client side: `DATAGRAMS` datagrams to each VIP, then one to the kernel's
/// port; returns what came back.
fn client_side(ns: String) -> Result<(BTreeSet<String>, usize), String> {
    enter(&ns)?;
    let echoed = echoes([
        ("192.0.2.1:0", "192.0.2.2"),
        ("[2001:db8::1]:0", "[2001:db8::2]"),
    ])?;

    // Not registered: the kernel's socket answers, up to 3 tries.
    let sock = UdpSocket::bind("192.0.2.1:0").map_err(|e| e.to_string())?;
    sock.set_read_timeout(Some(Duration::from_millis(500)))
        .map_err(|e| e.to_string())?;
    let mut kernel_replies = 0;
    let mut buf = [0u8; 64];
    for _ in 0..3 {
        sock.send_to(b"to the kernel", ("192.0.2.2", KERNEL_PORT))
            .map_err(|e| e.to_string())?;
        if let Ok((n, _)) = sock.recv_from(&mut buf) {
            assert_eq!(&buf[..n], b"to the kernel");
            kernel_replies += 1;
            break;
        }
    }
    Ok((echoed, kernel_replies))
}

#[test]
fn af_xdp_echoes_vip_traffic_and_the_kernel_keeps_the_rest() {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipping af_xdp_echoes_vip_traffic_and_the_kernel_keeps_the_rest: {why}");
        return;
    }
    let topo = Topology::new("e").expect("build the test topology");
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = mpsc::channel();
    let weir = {
        let (ns, dev, stop) = (topo.weir.clone(), topo.weir_if.clone(), stop.clone());
        std::thread::spawn(move || weir_side(ns, dev, ready_tx, stop))
    };
    let (side, weir) = weir_setup(&ready_rx, weir);
    eprintln!(
        "XDP attached in {} mode; {} AF_XDP sockets, {}",
        side.mode,
        side.queues,
        if side.zero_copy {
            "zero-copy"
        } else {
            "copy mode"
        }
    );
    assert_eq!(side.queues, QUEUES, "one socket per rx queue");

    let client = {
        let ns = topo.client.clone();
        std::thread::spawn(move || client_side(ns))
    };
    let client = client.join();
    stop.store(true, Ordering::Relaxed);
    let weir = weir.join().expect("weir thread").expect("weir side");
    let (echoed, kernel_replies) = client.expect("client thread").expect("client side");
    drop(topo);

    let want = sent_to(["192.0.2.2", "[2001:db8::2]"]);
    assert_eq!(
        echoed, want,
        "every datagram to a VIP came back from AF_XDP"
    );
    eprintln!("echoed per queue: {:?}", weir.per_queue);
    let echoed: usize = weir.per_queue.iter().sum();
    assert!(echoed >= 2 * DATAGRAMS, "echoed {:?}", weir.per_queue);
    // 32 flows over 2 queues: all on one queue has odds of 2^-31.
    assert!(
        weir.per_queue.iter().all(|&n| n > 0),
        "every queue's socket echoed some: {:?}",
        weir.per_queue
    );
    assert!(
        weir.program.steered >= 2 * DATAGRAMS as u64,
        "program counters {:?}",
        weir.program
    );
    assert_eq!(kernel_replies, 1, "the kernel's UDP socket answered");
    // ARP/ND and the kernel port's datagram at least.
    assert!(
        weir.program.passed >= 2,
        "program counters {:?}",
        weir.program
    );
    assert_eq!(weir.program.no_socket, 0);
}

/// Generic (skb) mode, no AF_XDP socket: a registered VIP:port with no socket
/// on the queue falls back to the kernel (counted as `no_socket`), also through
/// a VLAN tag; `clear` empties the map.
#[test]
fn generic_mode_without_a_socket_passes_vip_traffic_to_the_kernel() {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipping generic_mode_without_a_socket_passes_vip_traffic_to_the_kernel: {why}");
        return;
    }
    let topo = Topology::new("g").expect("build the test topology");
    // The main thread sends how many hits to expect once the client is done.
    let (expect_tx, expect_rx) = mpsc::channel::<u64>();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let weir = {
        let (ns, dev) = (topo.weir.clone(), topo.weir_if.clone());
        std::thread::spawn(move || -> Result<(SteerStats, usize, usize), String> {
            let setup = || -> Result<(Steering, UdpSocket), String> {
                enter(&ns)?;
                let mut steering = Steering::attach_with(&dev, Some(AttachMode::Generic))
                    .map_err(|e| e.to_string())?;
                assert_eq!(steering.mode(), AttachMode::Generic);
                for vip in [
                    "192.0.2.2:9000",
                    "198.51.100.2:9000",
                    "[2001:db8:10::2]:9000",
                ] {
                    let key = SteerKey::udp(vip.parse().expect("literal"));
                    steering.add(key).map_err(|e| e.to_string())?;
                }
                let tcp = SteerKey::tcp("198.51.100.2:9000".parse().expect("literal"));
                steering.add(tcp).map_err(|e| e.to_string())?;
                let kernel = UdpSocket::bind(("0.0.0.0", VIP_PORT)).map_err(|e| e.to_string())?;
                kernel
                    .set_read_timeout(Some(Duration::from_millis(50)))
                    .map_err(|e| e.to_string())?;
                Ok((steering, kernel))
            };
            let (mut steering, kernel) = report_setup(setup(), &ready_tx)?;
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut buf = [0u8; 256];
            let mut expect = None;
            while expect.is_none() && Instant::now() < deadline {
                if let Ok((n, peer)) = kernel.recv_from(&mut buf) {
                    let _ = kernel.send_to(&buf[..n], peer);
                }
                expect = expect_rx.try_recv().ok();
            }
            // The raw frames are processed in the receiver's softirq after
            // `sendto` returns: wait (bounded) until they are counted.
            let mut stats = steering.stats().map_err(|e| e.to_string())?;
            let deadline = Instant::now() + Duration::from_secs(5);
            while stats.no_socket < expect.unwrap_or(0) && Instant::now() < deadline {
                std::thread::yield_now();
                stats = steering.stats().map_err(|e| e.to_string())?;
            }
            let before = steering.keys().map_err(|e| e.to_string())?.len();
            steering.clear().map_err(|e| e.to_string())?;
            let after = steering.keys().map_err(|e| e.to_string())?.len();
            Ok((stats, before, after))
        })
    };
    let ((), weir) = weir_setup(&ready_rx, weir);

    let client = {
        let (ns, dev) = (topo.client.clone(), topo.client_if.clone());
        std::thread::spawn(move || -> Result<(bool, u64), String> {
            enter(&ns)?;
            let sock = UdpSocket::bind("192.0.2.1:0").map_err(|e| e.to_string())?;
            sock.set_read_timeout(Some(Duration::from_millis(500)))
                .map_err(|e| e.to_string())?;
            let mut buf = [0u8; 64];
            let (mut answered, mut sent) = (false, 0);
            while !answered && sent < 5 {
                sock.send_to(b"plain", ("192.0.2.2", VIP_PORT))
                    .map_err(|e| e.to_string())?;
                sent += 1;
                if let Ok((n, _)) = sock.recv_from(&mut buf) {
                    answered = &buf[..n] == b"plain";
                }
            }
            // Tagged frames, written raw: this kernel may lack 802.1Q
            // interfaces, and the program must parse the tag either way.
            for frame in [
                // Matches: UDP over 802.1Q, IPv4 and IPv6; TCP.
                tagged(0x8100, UDP, "198.51.100.2".parse().unwrap(), VIP_PORT),
                tagged(0x8100, UDP, "2001:db8:10::2".parse().unwrap(), VIP_PORT),
                tagged(0x8100, TCP, "198.51.100.2".parse().unwrap(), VIP_PORT),
                // No match: an 802.1ad tag (weir-packet refuses it: the
                // kernel keeps it); another port; TCP where only UDP is
                // registered.
                tagged(0x88a8, UDP, "198.51.100.2".parse().unwrap(), VIP_PORT),
                tagged(0x8100, UDP, "198.51.100.2".parse().unwrap(), KERNEL_PORT),
                tagged(0x8100, TCP, "2001:db8:10::2".parse().unwrap(), VIP_PORT),
                // Match: IPv4 options, the ports found past them by the IHL.
                with_ipv4_options(tagged(
                    0x8100,
                    UDP,
                    "198.51.100.2".parse().unwrap(),
                    VIP_PORT,
                )),
                // No match: a non-first fragment (whatever its bytes say).
                non_first_fragment(tagged(
                    0x8100,
                    UDP,
                    "198.51.100.2".parse().unwrap(),
                    VIP_PORT,
                )),
            ] {
                raw::send(&dev, &frame)?;
            }
            Ok((answered, sent))
        })
    };
    let (answered, sent) = client.join().expect("client thread").unwrap_or_else(|e| {
        let _ = expect_tx.send(0);
        panic!("client side: {e}")
    });
    let _ = expect_tx.send(sent + TAGGED_MATCHES);
    let (stats, before, after) = weir.join().expect("weir thread").expect("weir side");
    drop(topo);

    assert!(
        answered,
        "the kernel answered on the VIP: no socket, so XDP_PASS"
    );
    assert_eq!(stats.steered, 0, "{stats:?}");
    // Every plain datagram and the tagged frames to a registered key matched,
    // then fell back to the kernel; the four others did not match.
    assert_eq!(stats.no_socket, sent + TAGGED_MATCHES, "{stats:?}");
    assert_eq!((before, after), (4, 0), "keys before and after clear");
}

/// An Ethernet frame with one VLAN tag (TPID `tpid`, VLAN 10) carrying an IP
/// packet of protocol `proto` to `dst:port`, broadcast (the program does not
/// look at MACs). The transport header is UDP-shaped: for TCP only the ports
/// matter to the program (the kernel drops the runt segment).
fn tagged(tpid: u16, proto: u8, dst: std::net::IpAddr, port: u16) -> Vec<u8> {
    let payload = b"tagged";
    let udp_len = (8 + payload.len()) as u16;
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    f.extend_from_slice(&tpid.to_be_bytes());
    f.extend_from_slice(&10u16.to_be_bytes());
    match dst {
        std::net::IpAddr::V4(d) => {
            f.extend_from_slice(&0x0800u16.to_be_bytes());
            f.extend_from_slice(&[0x45, 0]);
            f.extend_from_slice(&(20 + udp_len).to_be_bytes());
            f.extend_from_slice(&[0, 0, 0x40, 0, 64, proto, 0, 0]);
            f.extend_from_slice(&[198, 51, 100, 1]);
            f.extend_from_slice(&d.octets());
        }
        std::net::IpAddr::V6(d) => {
            f.extend_from_slice(&0x86ddu16.to_be_bytes());
            f.extend_from_slice(&[0x60, 0, 0, 0]);
            f.extend_from_slice(&udp_len.to_be_bytes());
            f.extend_from_slice(&[proto, 64]);
            f.extend_from_slice(
                &"2001:db8:10::1"
                    .parse::<std::net::Ipv6Addr>()
                    .unwrap()
                    .octets(),
            );
            f.extend_from_slice(&d.octets());
        }
    }
    f.extend_from_slice(&40000u16.to_be_bytes());
    f.extend_from_slice(&port.to_be_bytes());
    f.extend_from_slice(&udp_len.to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(payload);
    f
}

/// Offset of the IPv4 header in a [`tagged`] frame.
const TAGGED_L3: usize = 18;

/// Adds 4 bytes of IPv4 options (NOP, NOP, NOP, EOL) to a [`tagged`] IPv4
/// frame: IHL 6.
fn with_ipv4_options(mut f: Vec<u8>) -> Vec<u8> {
    f[TAGGED_L3] = 0x46;
    let total = u16::from_be_bytes([f[TAGGED_L3 + 2], f[TAGGED_L3 + 3]]) + 4;
    f[TAGGED_L3 + 2..TAGGED_L3 + 4].copy_from_slice(&total.to_be_bytes());
    f.splice(TAGGED_L3 + 20..TAGGED_L3 + 20, [1, 1, 1, 0]);
    f
}

/// Marks a [`tagged`] IPv4 frame as a fragment at offset 8 bytes (no DF).
fn non_first_fragment(mut f: Vec<u8>) -> Vec<u8> {
    f[TAGGED_L3 + 6..TAGGED_L3 + 8].copy_from_slice(&1u16.to_be_bytes());
    f
}

/// Sending a hand-built frame through an AF_PACKET socket: the only way to
/// put an 802.1Q header on the wire on a kernel without VLAN interfaces.
#[allow(unsafe_code)]
mod raw {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    pub(super) fn send(interface: &str, frame: &[u8]) -> Result<(), String> {
        let name = std::ffi::CString::new(interface).map_err(|e| e.to_string())?;
        // SAFETY: `name` is a NUL-terminated string that lives across the call.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            return Err(format!("no interface {interface}"));
        }
        // SAFETY: plain socket(2); the result is checked before use.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(format!(
                "AF_PACKET socket: {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_ll is plain old data; all zeroes is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = ifindex as i32;
        addr.sll_halen = 6;
        addr.sll_addr[..6].copy_from_slice(&frame[..6]);
        // SAFETY: `frame` and `addr` are live for the call and their lengths
        // are the ones passed.
        let rc = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc != frame.len() as isize {
            return Err(format!(
                "AF_PACKET send: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(())
    }
}

#[test]
fn attaching_to_a_missing_interface_names_it() {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipping attaching_to_a_missing_interface_names_it: {why}");
        return;
    }
    let err = Steering::attach("weir-nosuch0").unwrap_err().to_string();
    assert!(err.contains("weir-nosuch0"), "{err}");
    assert!(
        err.contains("native mode") && err.contains("generic mode"),
        "{err}"
    );
}

/// Whether `dev` still has an XDP program 5 s after its last link was
/// dropped. The link detaches when its last descriptor closes, and a
/// process that another test of this binary forks at that moment holds a
/// copy until it execs (close-on-exec): on a busy machine `ip` saw the
/// program still there right after the drop.
fn attached_after_drop(ns: &str, dev: &str) -> Result<bool, String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let attached = xdp_attached(ns, dev)?;
        if !attached || Instant::now() >= deadline {
            return Ok(attached);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `ip link show` of `dev` in namespace `ns` mentions an XDP program.
fn xdp_attached(ns: &str, dev: &str) -> Result<bool, String> {
    let out = Command::new("ip")
        .args(["-n", ns, "link", "show", "dev", dev])
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout).contains("prog/xdp"))
}

#[test]
fn dropping_steering_detaches_the_program() {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipping dropping_steering_detaches_the_program: {why}");
        return;
    }
    let topo = Topology::new("d").expect("build the test topology");
    let (ns, dev) = (topo.weir.clone(), topo.weir_if.clone());
    let result = std::thread::spawn(move || -> Result<Vec<bool>, String> {
        enter(&ns)?;
        let mut seen = vec![xdp_attached(&ns, &dev)?];
        let first =
            Steering::attach_with(&dev, Some(AttachMode::Native)).map_err(|e| e.to_string())?;
        seen.push(xdp_attached(&ns, &dev)?);
        // A second program in the same mode is refused while the first holds it.
        seen.push(Steering::attach_with(&dev, Some(AttachMode::Native)).is_ok());
        drop(first);
        seen.push(attached_after_drop(&ns, &dev)?);
        // And once detached, the interface takes a new one.
        let again =
            Steering::attach_with(&dev, Some(AttachMode::Native)).map_err(|e| e.to_string())?;
        seen.push(xdp_attached(&ns, &dev)?);
        drop(again);
        Ok(seen)
    })
    .join()
    .expect("weir thread")
    .expect("weir side");
    drop(topo);
    // before, attached, second refused, after drop, attached again
    assert_eq!(result, [false, true, false, false, true]);
}

/// What the weir thread of the reply-steering test is told to do.
enum Cmd {
    /// Remove the backend and local keys, then acknowledge.
    Remove,
    /// Return the counters and end.
    Stop,
}

/// Who answered a probe: the AF_XDP echo (the datagram came back as sent) or
/// the kernel's socket (prefixed with `kernel:`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Xdp,
    Kernel,
    Nobody,
}

/// The UDP port of weir's namespace that nat-reply probes go to.
const REPLY_PORT: u16 = 5555;
/// A nat backend's source port, registered with `add_backend`.
const BACKEND_PORT: u16 = 7000;
/// weir's fnat port range on its local addresses (UDP and TCP).
const LOCAL_RANGE: std::ops::RangeInclusive<u16> = 50000..=59999;
/// The kernel's ephemeral ports in weir's namespace: outside `LOCAL_RANGE`.
const EPHEMERAL: &str = "40000 49999";
/// A kernel TCP service on weir's local address (SSH, the admin API).
const KERNEL_TCP_PORT: u16 = 2222;
/// The client namespace's TCP listener that weir's kernel connects to.
const CLIENT_TCP_PORT: u16 = 7100;

/// nat replies (matched on the backend's source) and fnat replies (matched on
/// a local address's port range) are steered; datagrams from another source
/// port or to ports outside the range, a TCP connection to the local address's
/// kernel service and the kernel's own TCP connection from it are not; after
/// `remove_backend`/`remove_local` the same datagrams reach the kernel.
#[test]
fn replies_from_nat_backends_and_to_fnat_local_ports_are_steered() {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipping replies_from_nat_backends_and_to_fnat_local_ports_are_steered: {why}");
        return;
    }
    let topo = Topology::new("r").expect("build the test topology");
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let (cmd_tx, cmd_rx) = mpsc::channel::<Cmd>();
    let (ack_tx, ack_rx) = mpsc::channel::<Result<(), String>>();
    let weir = {
        let (ns, dev) = (topo.weir.clone(), topo.weir_if.clone());
        std::thread::spawn(move || reply_weir_side(&ns, &dev, ready_tx, cmd_rx, ack_tx))
    };
    let ((), weir) = weir_setup(&ready_rx, weir);
    let client = {
        let (ns, weir_ns) = (topo.client.clone(), topo.weir.clone());
        let cmd_tx = cmd_tx.clone();
        std::thread::spawn(move || reply_client_side(&ns, &weir_ns, &cmd_tx, &ack_rx))
    };
    let probes = client.join().expect("client thread");
    let _ = cmd_tx.send(Cmd::Stop);
    let stats = weir.join().expect("weir thread");
    drop(topo);
    let (with_keys, without_keys, tcp) = probes.expect("client side");
    let stats = stats.expect("weir side");

    use Answer::{Kernel, Xdp};
    // Per family: from the backend's port; from another port; to the local
    // range; below it; above it.
    let want = [
        Xdp, Kernel, Xdp, Kernel, Kernel, Xdp, Kernel, Xdp, Kernel, Kernel,
    ];
    assert_eq!(with_keys, want, "with the keys");
    assert_eq!(without_keys, [Kernel; 10], "after removing the keys");
    assert_eq!(
        tcp,
        (true, true),
        "a TCP connection to the local address's kernel port, and the kernel's own \
         TCP connection from it"
    );
    assert!(stats.backend_matches >= 2, "{stats:?}");
    assert!(stats.local_matches >= 2, "{stats:?}");
    assert!(
        stats.steered >= stats.backend_matches + stats.local_matches,
        "{stats:?}"
    );
    assert_eq!(stats.no_socket, 0, "{stats:?}");
}

fn reply_weir_side(
    ns: &str,
    dev: &str,
    ready: mpsc::Sender<Result<(), String>>,
    cmds: mpsc::Receiver<Cmd>,
    ack: mpsc::Sender<Result<(), String>>,
) -> Result<SteerStats, String> {
    let v4: std::net::IpAddr = "192.0.2.2".parse().expect("literal");
    let v6: std::net::IpAddr = "2001:db8::2".parse().expect("literal");
    let backends: Vec<SteerKey> = ["192.0.2.1", "[2001:db8::1]"]
        .iter()
        .map(|ip| SteerKey::udp(format!("{ip}:{BACKEND_PORT}").parse().expect("literal")))
        .collect();
    let setup = || -> Result<_, String> {
        enter(ns)?;
        std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", EPHEMERAL)
            .map_err(|e| format!("setting the ephemeral port range: {e}"))?;
        let mut steering = Steering::attach(dev).map_err(|e| e.to_string())?;
        let xsks = XskSocket::bind_all(dev, XskConfig::default()).map_err(|e| e.to_string())?;
        for xsk in &xsks {
            steering
                .register_socket(xsk.queue(), xsk)
                .map_err(|e| e.to_string())?;
        }
        for key in &backends {
            steering.add_backend(*key).map_err(|e| e.to_string())?;
        }
        for ip in [v4, v6] {
            for proto in [UDP, TCP] {
                steering
                    .add_local(ip, proto, LOCAL_RANGE)
                    .map_err(|e| e.to_string())?;
            }
        }
        let mut kernel = Vec::new();
        for port in [
            REPLY_PORT,
            *LOCAL_RANGE.start() + 500,
            *LOCAL_RANGE.start() - 1,
            *LOCAL_RANGE.end() + 1,
        ] {
            let sock = UdpSocket::bind(("::", port)).map_err(|e| e.to_string())?;
            sock.set_nonblocking(true).map_err(|e| e.to_string())?;
            kernel.push(sock);
        }
        let listener =
            std::net::TcpListener::bind(("::", KERNEL_TCP_PORT)).map_err(|e| e.to_string())?;
        Ok((steering, xsks, kernel, listener))
    };
    let (mut steering, mut xsks, kernel, _listener) = report_setup(setup(), &ready)?;

    let deadline = Instant::now() + Duration::from_secs(60);
    let mut buf = [0u8; 512];
    while Instant::now() < deadline {
        for xsk in &mut xsks {
            xsk.run_batch(Duration::from_millis(1), echo)
                .map_err(|e| e.to_string())?;
        }
        for sock in &kernel {
            if let Ok((n, peer)) = sock.recv_from(&mut buf) {
                let mut reply = b"kernel:".to_vec();
                reply.extend_from_slice(&buf[..n]);
                let _ = sock.send_to(&reply, peer);
            }
        }
        match cmds.try_recv() {
            Ok(Cmd::Remove) => {
                let mut removed = || -> Result<(), String> {
                    for key in &backends {
                        steering.remove_backend(key).map_err(|e| e.to_string())?;
                    }
                    for ip in [v4, v6] {
                        for proto in [UDP, TCP] {
                            steering
                                .remove_local(ip, proto)
                                .map_err(|e| e.to_string())?;
                        }
                    }
                    let left = (
                        steering.backends().map_err(|e| e.to_string())?.len(),
                        steering.locals().map_err(|e| e.to_string())?.len(),
                    );
                    if left != (0, 0) {
                        return Err(format!("keys left after removal: {left:?}"));
                    }
                    Ok(())
                };
                let _ = ack.send(removed());
            }
            Ok(Cmd::Stop) | Err(mpsc::TryRecvError::Disconnected) => break,
            Err(mpsc::TryRecvError::Empty) => {}
        }
    }
    steering.stats().map_err(|e| e.to_string())
}

type ReplyProbes = (Vec<Answer>, Vec<Answer>, (bool, bool));

fn reply_client_side(
    ns: &str,
    weir_ns: &str,
    cmds: &mpsc::Sender<Cmd>,
    ack: &mpsc::Receiver<Result<(), String>>,
) -> Result<ReplyProbes, String> {
    enter(ns)?;
    let client_listener =
        std::net::TcpListener::bind(("192.0.2.1", CLIENT_TCP_PORT)).map_err(|e| e.to_string())?;
    let round = |tag: &str| -> Result<Vec<Answer>, String> {
        let mut answers = Vec::new();
        for (client, weir) in [("192.0.2.1", "192.0.2.2"), ("2001:db8::1", "2001:db8::2")] {
            let weir_ip: std::net::IpAddr = weir.parse().expect("literal");
            let client_ip: std::net::IpAddr = client.parse().expect("literal");
            for (from_port, to_port) in [
                (BACKEND_PORT, REPLY_PORT),
                (BACKEND_PORT + 1, REPLY_PORT),
                (0, *LOCAL_RANGE.start() + 500),
                (0, *LOCAL_RANGE.start() - 1),
                (0, *LOCAL_RANGE.end() + 1),
            ] {
                let sock = UdpSocket::bind(SocketAddr::new(client_ip, from_port))
                    .map_err(|e| format!("bind {client} {from_port}: {e}"))?;
                let to = SocketAddr::new(weir_ip, to_port);
                let msg = format!("{tag} {from_port}->{to}");
                answers.push(probe(&sock, to, msg.as_bytes())?);
            }
        }
        Ok(answers)
    };
    let with_keys = round("keys")?;

    // TCP: to the local address's kernel service (port outside the range),
    // and from it (the kernel's ephemeral port, outside the range).
    let to_kernel = std::net::TcpStream::connect_timeout(
        &SocketAddr::new("192.0.2.2".parse().expect("literal"), KERNEL_TCP_PORT),
        Duration::from_secs(3),
    )
    .is_ok();
    let from_kernel = {
        let weir_ns = weir_ns.to_owned();
        std::thread::spawn(move || -> Result<bool, String> {
            enter(&weir_ns)?;
            Ok(std::net::TcpStream::connect_timeout(
                &SocketAddr::new("192.0.2.1".parse().expect("literal"), CLIENT_TCP_PORT),
                Duration::from_secs(3),
            )
            .is_ok())
        })
        .join()
        .map_err(|_| "the weir-namespace connect thread panicked".to_owned())??
    };
    drop(client_listener);

    cmds.send(Cmd::Remove).map_err(|e| e.to_string())?;
    ack.recv_timeout(Duration::from_secs(10))
        .map_err(|e| format!("no answer to Remove: {e}"))??;
    let without_keys = round("nokeys")?;
    Ok((with_keys, without_keys, (to_kernel, from_kernel)))
}

/// Sends `msg` to `to` (up to 3 tries, 500 ms each) and says who answered.
fn probe(sock: &UdpSocket, to: SocketAddr, msg: &[u8]) -> Result<Answer, String> {
    sock.set_read_timeout(Some(Duration::from_millis(500)))
        .map_err(|e| e.to_string())?;
    let mut buf = [0u8; 512];
    for _ in 0..3 {
        sock.send_to(msg, to).map_err(|e| e.to_string())?;
        while let Ok((n, from)) = sock.recv_from(&mut buf) {
            if from != to {
                continue;
            }
            let got = &buf[..n];
            if got == msg {
                return Ok(Answer::Xdp);
            }
            if got.strip_prefix(b"kernel:") == Some(msg) {
                return Ok(Answer::Kernel);
            }
        }
    }
    Ok(Answer::Nobody)
}

/// MACs the next-hop test gives the two veth ends.
const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xc1, 0x01];
const WEIR_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xc1, 0x02];

fn mac_text(mac: [u8; 6]) -> String {
    mac.map(|b| format!("{b:02x}")).join(":")
}

/// The resolver in weir's namespace, against the kernel's tables there: a
/// directly connected neighbour (resolved through the resolver's own
/// solicitation, IPv4 and IPv6), a destination behind a gateway (the
/// gateway's MAC), an address nobody holds (unresolved, and the kernel made
/// an entry for it), unroutable destinations, and the cache answering until
/// its entry is invalidated.
#[test]
fn next_hops_come_from_the_kernels_route_and_neighbour_tables() {
    use weir_packet_io::{CacheConfig, NoRoute, Resolution, Resolver};
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipping next_hops_come_from_the_kernels_route_and_neighbour_tables: {why}");
        return;
    }
    let topo = Topology::new("n").expect("build the test topology");
    let (c, w, ci, wi) = (&topo.client, &topo.weir, &topo.client_if, &topo.weir_if);
    for (ns, dev, mac) in [(c, ci, CLIENT_MAC), (w, wi, WEIR_MAC)] {
        run(&[
            "ip",
            "-n",
            ns,
            "link",
            "set",
            "dev",
            dev,
            "address",
            &mac_text(mac),
        ])
        .expect("set the MAC");
    }
    for route in [
        ["203.0.113.0/24", "via", "192.0.2.1"],
        ["2001:db8:99::/64", "via", "2001:db8::1"],
    ] {
        run(&["ip", "-n", w, "route", "add", route[0], route[1], route[2]]).expect("route");
    }
    for prefix in ["198.18.1.0/24", "2001:db8:bad::/64"] {
        run(&["ip", "-n", w, "route", "add", "blackhole", prefix]).expect("blackhole");
    }

    let (ns, dev) = (w.clone(), wi.clone());
    let result = std::thread::spawn(move || -> Result<Vec<String>, String> {
        enter(&ns)?;
        let weir_ifindex = {
            let name = std::ffi::CString::new(dev.clone()).map_err(|e| e.to_string())?;
            nix::net::if_::if_nametoindex(name.as_c_str()).map_err(|e| e.to_string())?
        };
        let config = CacheConfig::default();
        let mut resolver = Resolver::new(config).map_err(|e| e.to_string())?;
        let mut now = Instant::now();
        let mut failures = Vec::new();
        let mut check = |what: &str, ok: bool, got: &dyn std::fmt::Debug| {
            if !ok {
                failures.push(format!("{what}: got {got:?}"));
            }
        };
        let ip = |s: &str| -> std::net::IpAddr { s.parse().expect("literal") };

        // Poll (fake clock advanced past the unresolved lifetime each time,
        // bounded in real time) until `dst` resolves.
        let mut resolve_within =
            |resolver: &mut Resolver, dst| -> Result<Vec<Resolution>, String> {
                let mut seen = Vec::new();
                let deadline = Instant::now() + Duration::from_secs(5);
                loop {
                    let r = resolver.resolve(dst, now).map_err(|e| e.to_string())?;
                    seen.push(r);
                    if matches!(r, Resolution::Resolved { .. }) || Instant::now() > deadline {
                        return Ok(seen);
                    }
                    now += config.unresolved_ttl;
                    std::thread::sleep(Duration::from_millis(10));
                }
            };

        for (dst, neighbour) in [
            ("192.0.2.1", "192.0.2.1"),
            ("2001:db8::1", "2001:db8::1"),
            ("203.0.113.5", "192.0.2.1"),
            ("2001:db8:99::5", "2001:db8::1"),
        ] {
            let seen = resolve_within(&mut resolver, ip(dst))?;
            let want = Resolution::Resolved {
                ifindex: weir_ifindex,
                neighbour: ip(neighbour),
                next_hop: weir_packet::NextHop {
                    src_mac: WEIR_MAC,
                    dst_mac: CLIENT_MAC,
                },
            };
            check(dst, seen.last() == Some(&want), &seen);
            // Nothing had talked to the client before: the first answer for
            // the directly connected neighbour is unresolved, and the
            // resolver's own solicitation resolved it.
            if dst == "192.0.2.1" || dst == "2001:db8::1" {
                check(
                    &format!("{dst} first unresolved"),
                    matches!(seen[0], Resolution::Unresolved { neighbour: n, .. } if n == ip(dst)),
                    &seen,
                );
            }
        }

        // Nobody holds 192.0.2.99 / 2001:db8::99: unresolved, and the kernel
        // is resolving it because the resolver asked.
        for dst in ["192.0.2.99", "2001:db8::99"] {
            let r = resolver.resolve(ip(dst), now).map_err(|e| e.to_string())?;
            check(
                dst,
                r == Resolution::Unresolved {
                    ifindex: weir_ifindex,
                    neighbour: ip(dst),
                },
                &r,
            );
            let out = Command::new("ip")
                .args(["neigh", "show", "to", dst, "dev", &dev])
                .output()
                .map_err(|e| e.to_string())?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            check(
                &format!("{dst} kernel entry"),
                text.contains("INCOMPLETE") || text.contains("FAILED"),
                &text,
            );
        }

        for (dst, want) in [
            ("198.18.0.1", NoRoute::Unreachable),
            ("198.18.1.1", NoRoute::Blackhole),
            ("192.0.2.2", NoRoute::Local),
            ("2001:db8:77::1", NoRoute::Unreachable),
            ("2001:db8:bad::1", NoRoute::Blackhole),
            ("2001:db8::2", NoRoute::Local),
        ] {
            let r = resolver.resolve(ip(dst), now).map_err(|e| e.to_string())?;
            check(dst, r == Resolution::NoRoute(want), &r);
        }

        // The cache answers until the entry expires or is invalidated, even
        // after the kernel forgot the neighbour.
        let client = ip("192.0.2.1");
        let cached = resolver.resolve(client, now).map_err(|e| e.to_string())?;
        run(&["ip", "neigh", "del", "192.0.2.1", "dev", &dev])?;
        let again = resolver.resolve(client, now).map_err(|e| e.to_string())?;
        check("cached", again == cached, &again);
        resolver.cache_mut().invalidate(client);
        let fresh = resolver.resolve(client, now).map_err(|e| e.to_string())?;
        check(
            "after invalidate",
            matches!(fresh, Resolution::Unresolved { .. }),
            &fresh,
        );
        Ok(failures)
    })
    .join()
    .expect("weir thread");
    drop(topo);
    let failures = result.expect("weir side");
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Datagrams of the whole-batch test echoed, and dropped by leaving the
/// verdict unset; sent interleaved from one socket (one flow, one queue).
const KEEP: usize = 96;
const DROP_EVERY: usize = 4;

/// `run_batch_all`: with the datagrams already queued before the first call,
/// the callback gets full batches (the configured size), oldest first, every
/// verdict `Drop` until set; frames it leaves at `Drop` are dropped and
/// counted, the others echoed in order.
#[test]
fn run_batch_all_hands_the_callback_whole_batches() {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipping run_batch_all_hands_the_callback_whole_batches: {why}");
        return;
    }
    let topo = Topology::new("b").expect("build the test topology");
    let config = XskConfig::default();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let (sent_tx, sent_rx) = mpsc::channel::<()>();
    let stop = Arc::new(AtomicBool::new(false));

    #[derive(Default, Debug)]
    struct Seen {
        sizes: Vec<usize>,
        /// Sequence numbers in the order the batches held them.
        order: Vec<usize>,
        /// Verdicts that were not `Drop` when the callback got them.
        preset: usize,
        dropped: usize,
        transmitted: usize,
    }

    let weir = {
        let (ns, dev, stop) = (topo.weir.clone(), topo.weir_if.clone(), stop.clone());
        std::thread::spawn(move || -> Result<Seen, String> {
            let setup = || steered_sockets(&ns, &dev, config);
            let (_steering, mut xsks) = report_setup(setup(), &ready_tx)?;
            // Let every datagram queue up before the first receive.
            sent_rx
                .recv_timeout(Duration::from_secs(30))
                .map_err(|e| format!("the client never finished sending: {e}"))?;
            let mut seen = Seen::default();
            let deadline = Instant::now() + Duration::from_secs(30);
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                for xsk in &mut xsks {
                    let stats = xsk
                        .run_batch_all(Duration::from_millis(2), |batch| {
                            seen.sizes.push(batch.len());
                            // Parse the whole batch first, as the data path does.
                            let mut keep = [false; 64];
                            for (i, keep) in keep.iter_mut().enumerate().take(batch.len()) {
                                seen.preset += usize::from(batch.verdict(i) != Verdict::Drop);
                                let frame = batch.frame(i);
                                let Ok(p) = weir_packet::parse(frame) else {
                                    continue;
                                };
                                let text = String::from_utf8_lossy(&frame[p.l4 + 8..p.end]);
                                if let Some(n) = text.split('#').nth(1) {
                                    seen.order.push(n.parse().unwrap_or(usize::MAX));
                                }
                                *keep = text.starts_with("keep");
                            }
                            for (i, keep) in keep.iter().enumerate().take(batch.len()) {
                                if *keep {
                                    let verdict = echo(batch.frame_mut(i));
                                    batch.set_verdict(i, verdict);
                                }
                            }
                        })
                        .map_err(|e| e.to_string())?;
                    seen.dropped += stats.dropped;
                    seen.transmitted += stats.transmitted;
                }
            }
            Ok(seen)
        })
    };
    let ((), weir) = weir_setup(&ready_rx, weir);

    let client = {
        let ns = topo.client.clone();
        std::thread::spawn(move || -> Result<Vec<usize>, String> {
            enter(&ns)?;
            let sock = UdpSocket::bind("192.0.2.1:0").map_err(|e| e.to_string())?;
            sock.set_read_timeout(Some(Duration::from_millis(100)))
                .map_err(|e| e.to_string())?;
            let to: SocketAddr = format!("192.0.2.2:{VIP_PORT}").parse().expect("literal");
            let total = KEEP + KEEP / (DROP_EVERY - 1);
            let mut kept = 0;
            for i in 0..total {
                let label = if i % DROP_EVERY == DROP_EVERY - 1 {
                    "drop"
                } else {
                    kept += 1;
                    "keep"
                };
                sock.send_to(format!("{label} #{i}").as_bytes(), to)
                    .map_err(|e| e.to_string())?;
            }
            assert_eq!(kept, KEEP);
            let _ = sent_tx.send(());
            let mut echoed = Vec::new();
            let mut buf = [0u8; 128];
            let deadline = Instant::now() + Duration::from_secs(10);
            while echoed.len() < KEEP && Instant::now() < deadline {
                if let Ok((n, _)) = sock.recv_from(&mut buf) {
                    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                    let seq = text.split('#').nth(1).and_then(|n| n.parse().ok());
                    echoed.push(if text.starts_with("keep") {
                        seq.unwrap_or(usize::MAX)
                    } else {
                        usize::MAX
                    });
                }
            }
            Ok(echoed)
        })
    };
    let echoed = client.join().expect("client thread");
    stop.store(true, Ordering::Relaxed);
    let seen = weir.join().expect("weir thread").expect("weir side");
    drop(topo);
    let echoed = echoed.expect("client side");

    let total = KEEP + KEEP / (DROP_EVERY - 1);
    let want: Vec<usize> = (0..total)
        .filter(|i| i % DROP_EVERY != DROP_EVERY - 1)
        .collect();
    assert_eq!(
        echoed, want,
        "every kept datagram echoed, in order, no dropped one"
    );
    let nonempty: Vec<usize> = seen.sizes.iter().copied().filter(|&n| n > 0).collect();
    assert_eq!(
        nonempty.first(),
        Some(&config.batch),
        "the first batch is full: {:?}",
        seen.sizes
    );
    assert_eq!(seen.order, (0..total).collect::<Vec<_>>(), "oldest first");
    assert_eq!(seen.preset, 0, "verdicts start as Drop");
    assert_eq!(seen.dropped, total - KEEP);
    assert_eq!(seen.transmitted, KEEP);
}

/// Datagrams the long-run test echoes: many times the small rings' size.
const LONG_RUN: usize = 1024;
/// Datagrams in flight at once in the long-run test.
const BURST: usize = 16;

/// A socket keeps receiving after many times its fill ring's worth of
/// frames: received and transmitted frames go back to the fill ring (a ring of
/// 64 entries and 256 frames, 1,024 datagrams in bursts of 16).
#[test]
fn af_xdp_keeps_receiving_past_the_ring_size() {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipping af_xdp_keeps_receiving_past_the_ring_size: {why}");
        return;
    }
    let topo = Topology::new("l").expect("build the test topology");
    let config = XskConfig {
        frames: 256,
        ring_size: 64,
        batch: 32,
    };
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let stop = Arc::new(AtomicBool::new(false));
    let weir = {
        let (ns, dev, stop) = (topo.weir.clone(), topo.weir_if.clone(), stop.clone());
        std::thread::spawn(move || -> Result<usize, String> {
            let setup = || steered_sockets(&ns, &dev, config);
            let (_steering, mut xsks) = report_setup(setup(), &ready_tx)?;
            let mut echoed = 0;
            let deadline = Instant::now() + Duration::from_secs(60);
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                for xsk in &mut xsks {
                    let stats = xsk
                        .run_batch(Duration::from_millis(1), echo)
                        .map_err(|e| e.to_string())?;
                    echoed += stats.transmitted;
                }
            }
            Ok(echoed)
        })
    };
    let ((), weir) = weir_setup(&ready_rx, weir);
    let client = {
        let ns = topo.client.clone();
        std::thread::spawn(move || -> Result<BTreeSet<usize>, String> {
            enter(&ns)?;
            let sock = UdpSocket::bind("192.0.2.1:0").map_err(|e| e.to_string())?;
            sock.set_read_timeout(Some(Duration::from_millis(200)))
                .map_err(|e| e.to_string())?;
            let to: SocketAddr = format!("192.0.2.2:{VIP_PORT}").parse().expect("literal");
            let mut echoed = BTreeSet::new();
            let mut buf = [0u8; 64];
            let deadline = Instant::now() + Duration::from_secs(30);
            for burst in (0..LONG_RUN).step_by(BURST) {
                for i in burst..burst + BURST {
                    sock.send_to(format!("#{i}").as_bytes(), to)
                        .map_err(|e| e.to_string())?;
                }
                // This burst's echoes (a lost one is waited for once, 200 ms).
                let want = burst + BURST;
                while echoed.len() < want && Instant::now() < deadline {
                    match sock.recv_from(&mut buf) {
                        Ok((n, _)) => {
                            let text = String::from_utf8_lossy(&buf[..n]);
                            if let Some(i) = text.strip_prefix('#').and_then(|i| i.parse().ok()) {
                                echoed.insert(i);
                            }
                        }
                        Err(_) => break,
                    }
                }
            }
            Ok(echoed)
        })
    };
    let echoed = client.join().expect("client thread");
    stop.store(true, Ordering::Relaxed);
    let transmitted = weir.join().expect("weir thread").expect("weir side");
    drop(topo);
    let echoed = echoed.expect("client side");
    assert_eq!(
        echoed.len(),
        LONG_RUN,
        "echoed {} of {LONG_RUN}; first missing: {:?}",
        echoed.len(),
        (0..LONG_RUN).find(|i| !echoed.contains(i))
    );
    assert_eq!(transmitted, LONG_RUN);
}

/// An Ethernet frame carrying an ICMP (IPv4) or ICMPv6 message of type
/// `kind` that quotes the start of a `proto` packet `src` -> `dst` (IP header
/// and the 8 bytes of the transport header the RFCs require). Checksums are
/// left zero: the program does not read them (the kernel drops the frame).
fn icmp_error_frame(kind: u8, proto: u8, src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    let mut quoted_l4 = Vec::new();
    quoted_l4.extend_from_slice(&src.port().to_be_bytes());
    quoted_l4.extend_from_slice(&dst.port().to_be_bytes());
    quoted_l4.extend_from_slice(&[0, 8, 0, 0]);
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    match (src.ip(), dst.ip()) {
        (std::net::IpAddr::V4(s), std::net::IpAddr::V4(d)) => {
            let quoted_len = 20 + quoted_l4.len() as u16;
            f.extend_from_slice(&0x0800u16.to_be_bytes());
            f.extend_from_slice(&[0x45, 0]);
            f.extend_from_slice(&(20 + 8 + quoted_len).to_be_bytes());
            f.extend_from_slice(&[0, 0, 0x40, 0, 64, 1, 0, 0]);
            f.extend_from_slice(&[192, 0, 2, 1, 192, 0, 2, 2]);
            f.extend_from_slice(&[kind, 0, 0, 0, 0, 0, 0, 0]);
            f.extend_from_slice(&[0x45, 0]);
            f.extend_from_slice(&(quoted_len + 100).to_be_bytes());
            f.extend_from_slice(&[0, 0, 0x40, 0, 64, proto, 0, 0]);
            f.extend_from_slice(&s.octets());
            f.extend_from_slice(&d.octets());
        }
        (std::net::IpAddr::V6(s), std::net::IpAddr::V6(d)) => {
            let quoted_len = 40 + quoted_l4.len() as u16;
            let router: std::net::Ipv6Addr = "2001:db8::1".parse().expect("literal");
            let weir: std::net::Ipv6Addr = "2001:db8::2".parse().expect("literal");
            f.extend_from_slice(&0x86ddu16.to_be_bytes());
            f.extend_from_slice(&[0x60, 0, 0, 0]);
            f.extend_from_slice(&(8 + quoted_len).to_be_bytes());
            f.extend_from_slice(&[58, 64]);
            f.extend_from_slice(&router.octets());
            f.extend_from_slice(&weir.octets());
            f.extend_from_slice(&[kind, 0, 0, 0, 0, 0, 0x05, 0x00]);
            f.extend_from_slice(&[0x60, 0, 0, 0]);
            f.extend_from_slice(&108u16.to_be_bytes());
            f.extend_from_slice(&[proto, 64]);
            f.extend_from_slice(&s.octets());
            f.extend_from_slice(&d.octets());
        }
        _ => panic!("one family per frame"),
    }
    f.extend_from_slice(&quoted_l4);
    f
}

/// ICMP and ICMPv6 errors quoting a packet weir sent — from a virtual address,
/// from a local address inside its range, to a nat backend — are steered
/// (counted as matches; generic mode with no socket, so they then reach the
/// kernel); informational messages, errors about other packets and errors
/// quoting a protocol that is not registered are not.
#[test]
fn icmp_errors_about_packets_weir_sent_are_steered() {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipping icmp_errors_about_packets_weir_sent_are_steered: {why}");
        return;
    }
    let topo = Topology::new("i").expect("build the test topology");
    let sa = |s: &str| -> SocketAddr { s.parse().expect("literal") };
    let frames: Vec<(bool, Vec<u8>)> = vec![
        // About a reply weir sent from the VIP to a client.
        (
            true,
            icmp_error_frame(3, UDP, sa("198.51.100.2:9000"), sa("203.0.113.9:4000")),
        ),
        (
            true,
            icmp_error_frame(11, UDP, sa("198.51.100.2:9000"), sa("203.0.113.9:4000")),
        ),
        (
            true,
            icmp_error_frame(
                2,
                UDP,
                sa("[2001:db8:10::2]:9000"),
                sa("[2001:db8:20::9]:4000"),
            ),
        ),
        // About an fnat packet from a local address inside the range.
        (
            true,
            icmp_error_frame(3, UDP, sa("192.0.2.2:50500"), sa("192.0.2.1:80")),
        ),
        // About a nat packet to a backend (the client's address kept).
        (
            true,
            icmp_error_frame(3, UDP, sa("203.0.113.9:4000"), sa("192.0.2.1:7000")),
        ),
        (
            true,
            icmp_error_frame(
                1,
                UDP,
                sa("[2001:db8:20::9]:4000"),
                sa("[2001:db8::1]:7000"),
            ),
        ),
        // Not an error: echo request, ICMPv6 echo request.
        (
            false,
            icmp_error_frame(8, UDP, sa("198.51.100.2:9000"), sa("203.0.113.9:4000")),
        ),
        (
            false,
            icmp_error_frame(
                128,
                UDP,
                sa("[2001:db8:10::2]:9000"),
                sa("[2001:db8:20::9]:4000"),
            ),
        ),
        // About the kernel's own packet from the local address (outside the range).
        (
            false,
            icmp_error_frame(3, UDP, sa("192.0.2.2:40000"), sa("192.0.2.1:80")),
        ),
        // TCP where only UDP is registered; another backend port.
        (
            false,
            icmp_error_frame(3, TCP, sa("198.51.100.2:9000"), sa("203.0.113.9:4000")),
        ),
        (
            false,
            icmp_error_frame(3, UDP, sa("203.0.113.9:4000"), sa("192.0.2.1:7001")),
        ),
    ];
    let matches = frames.iter().filter(|(m, _)| *m).count() as u64;

    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let (sent_tx, sent_rx) = mpsc::channel::<()>();
    let weir = {
        let (ns, dev) = (topo.weir.clone(), topo.weir_if.clone());
        std::thread::spawn(move || -> Result<SteerStats, String> {
            let setup = || -> Result<Steering, String> {
                enter(&ns)?;
                let mut steering = Steering::attach_with(&dev, Some(AttachMode::Generic))
                    .map_err(|e| e.to_string())?;
                for vip in ["198.51.100.2:9000", "[2001:db8:10::2]:9000"] {
                    steering
                        .add(SteerKey::udp(vip.parse().expect("literal")))
                        .map_err(|e| e.to_string())?;
                }
                for backend in ["192.0.2.1:7000", "[2001:db8::1]:7000"] {
                    steering
                        .add_backend(SteerKey::udp(backend.parse().expect("literal")))
                        .map_err(|e| e.to_string())?;
                }
                steering
                    .add_local("192.0.2.2".parse().expect("literal"), UDP, LOCAL_RANGE)
                    .map_err(|e| e.to_string())?;
                Ok(steering)
            };
            let steering = report_setup(setup(), &ready_tx)?;
            sent_rx
                .recv_timeout(Duration::from_secs(30))
                .map_err(|e| format!("the client never sent: {e}"))?;
            // The frames are counted in the receiver's softirq after `sendto`
            // returns, in order: wait (bounded) for the last one, a plain
            // datagram to the VIP (a `no_socket` match that is not ICMP).
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut stats = steering.stats().map_err(|e| e.to_string())?;
            while stats.no_socket < matches + 1 && Instant::now() < deadline {
                std::thread::yield_now();
                stats = steering.stats().map_err(|e| e.to_string())?;
            }
            Ok(stats)
        })
    };
    let ((), weir) = weir_setup(&ready_rx, weir);
    let client = {
        let (ns, dev) = (topo.client.clone(), topo.client_if.clone());
        let frames: Vec<Vec<u8>> = frames.iter().map(|(_, f)| f.clone()).collect();
        std::thread::spawn(move || -> Result<(), String> {
            enter(&ns)?;
            for frame in &frames {
                raw::send(&dev, frame)?;
            }
            let marker = tagged(0x8100, UDP, "198.51.100.2".parse().expect("literal"), 9000);
            raw::send(&dev, &marker)
        })
    };
    let sent = client.join().expect("client thread");
    let _ = sent_tx.send(());
    let stats = weir.join().expect("weir thread");
    drop(topo);
    sent.expect("client side");
    let stats = stats.expect("weir side");
    assert_eq!(stats.icmp_matches, matches, "{stats:?}");
    assert_eq!(stats.no_socket, matches + 1, "{stats:?}");
    assert_eq!(stats.steered, 0, "{stats:?}");
    assert_eq!(
        (stats.backend_matches, stats.local_matches),
        (0, 0),
        "{stats:?}"
    );
}

/// The AF_PACKET fallback: two sockets in one fanout group on weir's veth
/// echo UDP to a routed VIP (not a local address, so weir's kernel drops its
/// copy) through `run_batch_all`; every datagram of 32 flows, both families,
/// comes back, and both sockets served some (hash fanout).
#[test]
fn af_packet_echoes_vip_traffic_with_fanout() {
    use weir_packet_io::{PacketConfig, PacketSocket};
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipping af_packet_echoes_vip_traffic_with_fanout: {why}");
        return;
    }
    let topo = Topology::new("p").expect("build the test topology");
    for (prefix, via) in [
        ("198.51.100.0/24", "192.0.2.2"),
        ("2001:db8:10::/64", "2001:db8::2"),
    ] {
        run(&["ip", "-n", &topo.client, "route", "add", prefix, "via", via]).expect("route");
    }
    let vips: [std::net::IpAddr; 2] = [
        "198.51.100.2".parse().expect("literal"),
        "2001:db8:10::2".parse().expect("literal"),
    ];
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let stop = Arc::new(AtomicBool::new(false));
    let weir = {
        let (ns, dev, stop) = (topo.weir.clone(), topo.weir_if.clone(), stop.clone());
        std::thread::spawn(move || -> Result<(Vec<usize>, usize), String> {
            let setup = || -> Result<Vec<PacketSocket>, String> {
                enter(&ns)?;
                // Small batches: a block's packets take several calls.
                let config = PacketConfig {
                    fanout: Some((std::process::id() & 0xffff) as u16),
                    batch: 8,
                    ..PacketConfig::default()
                };
                (0..2)
                    .map(|_| PacketSocket::bind(&dev, config).map_err(|e| e.to_string()))
                    .collect()
            };
            let mut socks = report_setup(setup(), &ready_tx)?;
            let mut per_socket = vec![0; socks.len()];
            let mut partial = 0;
            let deadline = Instant::now() + Duration::from_secs(30);
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                for (sock, echoed) in socks.iter_mut().zip(&mut per_socket) {
                    let stats = sock
                        .run_batch_all(Duration::from_millis(2), |batch| {
                            for i in 0..batch.len() {
                                // AF_PACKET sees everything (ARP, ND): only
                                // the VIP's UDP is echoed.
                                let ours = weir_packet::parse(batch.frame(i)).is_ok_and(|p| {
                                    vips.contains(&p.dst)
                                        && p.tuple().is_some_and(|t| t.dst.port() == VIP_PORT)
                                });
                                if ours {
                                    partial += usize::from(batch.csum_partial(i));
                                    let verdict = echo(batch.frame_mut(i));
                                    batch.set_verdict(i, verdict);
                                }
                            }
                        })
                        .map_err(|e| e.to_string())?;
                    *echoed += stats.transmitted;
                }
            }
            Ok((per_socket, partial))
        })
    };
    let ((), weir) = weir_setup(&ready_rx, weir);
    let client = {
        let ns = topo.client.clone();
        std::thread::spawn(move || -> Result<BTreeSet<String>, String> {
            enter(&ns)?;
            echoes([
                ("192.0.2.1:0", "198.51.100.2"),
                ("[2001:db8::1]:0", "[2001:db8:10::2]"),
            ])
        })
    };
    let echoed = client.join().expect("client thread");
    stop.store(true, Ordering::Relaxed);
    let weir = weir.join().expect("weir thread");
    drop(topo);
    let echoed = echoed.expect("client side");
    let (per_socket, partial) = weir.expect("weir side");
    let want = sent_to(["198.51.100.2", "[2001:db8:10::2]"]);
    assert_eq!(
        echoed, want,
        "every datagram to a VIP came back over AF_PACKET"
    );
    eprintln!("echoed per socket: {per_socket:?}");
    assert_eq!(
        per_socket.iter().sum::<usize>(),
        2 * DATAGRAMS,
        "{per_socket:?}"
    );
    // 32 flows hashed over 2 sockets: all on one has odds of 2^-31.
    assert!(per_socket.iter().all(|&n| n > 0), "fanout: {per_socket:?}");
    assert_eq!(
        partial, 0,
        "the client sends full checksums (tx offload off)"
    );
}

/// `queue_copy` + `flush`: every frame one socket receives is echoed through
/// the *other* socket (another UMEM, as for a frame that leaves by another
/// interface); the receiving socket transmits nothing itself.
#[test]
fn queue_copy_transmits_frames_received_by_another_socket() {
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipping queue_copy_transmits_frames_received_by_another_socket: {why}");
        return;
    }
    let topo = Topology::new("q").expect("build the test topology");
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let stop = Arc::new(AtomicBool::new(false));
    let weir = {
        let (ns, dev, stop) = (topo.weir.clone(), topo.weir_if.clone(), stop.clone());
        std::thread::spawn(move || -> Result<(Vec<usize>, usize, usize), String> {
            let setup = || -> Result<(Steering, Vec<XskSocket>), String> {
                enter(&ns)?;
                let mut steering = Steering::attach(&dev).map_err(|e| e.to_string())?;
                let xsks =
                    XskSocket::bind_all(&dev, XskConfig::default()).map_err(|e| e.to_string())?;
                for xsk in &xsks {
                    steering
                        .register_socket(xsk.queue(), xsk)
                        .map_err(|e| e.to_string())?;
                }
                for vip in ["192.0.2.2", "[2001:db8::2]"] {
                    let addr = format!("{vip}:{VIP_PORT}").parse().expect("literal");
                    steering
                        .add(SteerKey::udp(addr))
                        .map_err(|e| e.to_string())?;
                }
                Ok((steering, xsks))
            };
            let (_steering, mut xsks) = report_setup(setup(), &ready_tx)?;
            if xsks.len() != 2 {
                return Err(format!("{} sockets, want 2", xsks.len()));
            }
            // Frames each socket sent for the other; frames the receiving
            // socket sent itself; copies refused.
            let mut flushed = vec![0; 2];
            let (mut direct, mut refused) = (0, 0);
            let deadline = Instant::now() + Duration::from_secs(30);
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                for rx in 0..2 {
                    let (a, b) = xsks.split_at_mut(1);
                    let (receiver, sender) = if rx == 0 {
                        (&mut a[0], &mut b[0])
                    } else {
                        (&mut b[0], &mut a[0])
                    };
                    let stats = receiver
                        .run_batch_all(Duration::from_millis(2), |batch| {
                            for i in 0..batch.len() {
                                if echo(batch.frame_mut(i)) == Verdict::Transmit
                                    && !sender.queue_copy(batch.frame(i))
                                {
                                    refused += 1;
                                }
                            }
                        })
                        .map_err(|e| e.to_string())?;
                    direct += stats.transmitted;
                    flushed[1 - rx] += sender.flush().map_err(|e| e.to_string())?.transmitted;
                }
            }
            Ok((flushed, direct, refused))
        })
    };
    let ((), weir) = weir_setup(&ready_rx, weir);
    let client = {
        let ns = topo.client.clone();
        std::thread::spawn(move || client_side(ns))
    };
    let client = client.join().expect("client thread");
    stop.store(true, Ordering::Relaxed);
    let weir = weir.join().expect("weir thread");
    drop(topo);
    let (echoed, _) = client.expect("client side");
    let (flushed, direct, refused) = weir.expect("weir side");
    let want = sent_to(["192.0.2.2", "[2001:db8::2]"]);
    assert_eq!(
        echoed, want,
        "every datagram came back through the other socket"
    );
    assert_eq!(direct, 0, "the receiving socket transmitted nothing itself");
    assert_eq!(refused, 0);
    assert_eq!(flushed.iter().sum::<usize>(), 2 * DATAGRAMS, "{flushed:?}");
    assert!(
        flushed.iter().all(|&n| n > 0),
        "both directions: {flushed:?}"
    );
}

/// Datagrams the kernel-drop tests send while their socket reads nothing.
const FLOOD: usize = 300;

/// The MAC address of `dev` in namespace `ns`.
fn mac_of(ns: &str, dev: &str) -> Result<String, String> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "cat"])
        .arg(format!("/sys/class/net/{dev}/address"))
        .output()
        .map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The client of the kernel-drop tests: a permanent neighbour entry for the
/// weir side (so no datagram waits for, or is lost to, address resolution),
/// then [`FLOOD`] datagrams to the VIP as fast as the socket takes them.
fn flood_vip(topo: &Topology) -> Result<(), String> {
    let mac = mac_of(&topo.weir, &topo.weir_if)?;
    run(&[
        "ip",
        "-n",
        &topo.client,
        "neigh",
        "replace",
        "192.0.2.2",
        "lladdr",
        &mac,
        "dev",
        &topo.client_if,
        "nud",
        "permanent",
    ])?;
    let ns = topo.client.clone();
    std::thread::spawn(move || -> Result<(), String> {
        enter(&ns)?;
        let sock = UdpSocket::bind("192.0.2.1:0").map_err(|e| e.to_string())?;
        let to: SocketAddr = format!("192.0.2.2:{VIP_PORT}").parse().expect("literal");
        for i in 0..FLOOD {
            sock.send_to(format!("#{i}").as_bytes(), to)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    })
    .join()
    .map_err(|_| "client thread panicked".to_owned())?
}

/// A socket that does not keep up loses frames in the kernel, where weir's
/// own counters never see them; `XskSocket::kernel_drops` reads them
/// (`XDP_STATISTICS`). Exact: every frame the program steered to a socket
/// was either received or counted as dropped.
#[test]
fn af_xdp_counts_the_frames_the_kernel_drops_for_a_full_socket() {
    use weir_packet_io::KernelDrops;
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipping af_xdp_counts_the_frames_the_kernel_drops_for_a_full_socket: {why}");
        return;
    }
    let topo = Topology::new("k").expect("build the test topology");
    // 32 frames stock the fill ring: the flood overruns it many times.
    let config = XskConfig {
        frames: 64,
        ring_size: 32,
        batch: 32,
    };
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let weir = {
        let (ns, dev) = (topo.weir.clone(), topo.weir_if.clone());
        std::thread::spawn(move || -> Result<(u64, u64, KernelDrops), String> {
            let setup = || steered_sockets(&ns, &dev, config);
            let (steering, mut xsks) = report_setup(setup(), &ready_tx)?;
            // Nothing is read until the client has sent everything.
            go_rx.recv().map_err(|e| e.to_string())?;
            let mut received = 0u64;
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let mut got = 0;
                for xsk in &mut xsks {
                    got += xsk
                        .run_batch(Duration::from_millis(10), |_| Verdict::Drop)
                        .map_err(|e| e.to_string())?
                        .received;
                }
                received += got as u64;
                let steered = steering.stats().map_err(|e| e.to_string())?.steered;
                let mut drops = KernelDrops::default();
                for xsk in &xsks {
                    drops += xsk.kernel_drops().map_err(|e| e.to_string())?;
                }
                // Frames still on their way through the veth land later;
                // stop once a pass brings nothing and every steered frame
                // is accounted for (or at the deadline, for the asserts).
                let accounted = received + drops.rx_ring_full + drops.rx_no_frame;
                if (got == 0 && accounted == steered) || Instant::now() > deadline {
                    return Ok((steered, received, drops));
                }
            }
        })
    };
    let ((), weir) = weir_setup(&ready_rx, weir);
    let sent = flood_vip(&topo);
    let _ = go_tx.send(());
    let result = weir.join().expect("weir thread");
    drop(topo);
    sent.expect("client side");
    let (steered, received, drops) = result.expect("weir side");
    assert!(
        steered > u64::from(config.frames) && steered <= FLOOD as u64,
        "the program steered {steered} of {FLOOD} datagrams (more than the socket's {} frames expected)",
        config.frames
    );
    assert!(
        drops.rx_ring_full + drops.rx_no_frame > 0,
        "no kernel drops counted: {drops:?}, received {received} of {steered}"
    );
    assert_eq!(
        received + drops.rx_ring_full + drops.rx_no_frame,
        steered,
        "steered frames not accounted for: received {received}, kernel drops {drops:?}"
    );
    assert_eq!(drops.invalid_descs, 0, "{drops:?}");
    // Every descriptor the kernel handed back lay in the UMEM.
    assert_eq!(drops.bad_descs, 0, "{drops:?}");
}

/// The same for AF_PACKET (`PACKET_STATISTICS`, which resets on every
/// read: `kernel_drops` keeps the running sum). Not exact like AF_XDP's:
/// the socket also sees (and may drop) the interface's other frames.
#[test]
fn af_packet_counts_the_frames_the_kernel_drops_for_a_full_ring() {
    use weir_packet_io::{PacketConfig, PacketSocket};
    if let Some(why) = missing_prerequisite() {
        eprintln!("skipping af_packet_counts_the_frames_the_kernel_drops_for_a_full_ring: {why}");
        return;
    }
    let topo = Topology::new("f").expect("build the test topology");
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let weir = {
        let (ns, dev) = (topo.weir.clone(), topo.weir_if.clone());
        std::thread::spawn(move || -> Result<(u64, u64, u64), String> {
            let setup = || -> Result<PacketSocket, String> {
                enter(&ns)?;
                // One page-sized block: a few dozen small frames.
                let config = PacketConfig {
                    block_size: 4096,
                    block_count: 1,
                    ..PacketConfig::default()
                };
                PacketSocket::bind(&dev, config).map_err(|e| e.to_string())
            };
            let mut sock = report_setup(setup(), &ready_tx)?;
            go_rx.recv().map_err(|e| e.to_string())?;
            let first = sock.kernel_drops().map_err(|e| e.to_string())?;
            // A second read must not lose what the first reported.
            let second = sock.kernel_drops().map_err(|e| e.to_string())?;
            if second.rx_ring_full < first.rx_ring_full {
                return Err(format!("drops went back: {first:?} then {second:?}"));
            }
            let mut vip_frames = 0u64;
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let mut n = 0;
                let st = sock
                    .run_batch_all(Duration::from_millis(20), |b| {
                        for i in 0..b.len() {
                            let f = b.frame(i);
                            if weir_packet::parse(f).is_ok_and(|p| {
                                p.transport.proto() == UDP
                                    && p.transport.ports().is_some_and(|(_, d)| d == VIP_PORT)
                            }) {
                                n += 1;
                            }
                        }
                    })
                    .map_err(|e| e.to_string())?;
                vip_frames += n;
                if st.received == 0 || Instant::now() > deadline {
                    break;
                }
            }
            let last = sock.kernel_drops().map_err(|e| e.to_string())?;
            Ok((first.rx_ring_full, vip_frames, last.rx_ring_full))
        })
    };
    let ((), weir) = weir_setup(&ready_rx, weir);
    let sent = flood_vip(&topo);
    let _ = go_tx.send(());
    let result = weir.join().expect("weir thread");
    drop(topo);
    sent.expect("client side");
    let (first, vip_frames, last) = result.expect("weir side");
    assert!(
        first > 0,
        "no kernel drops counted after a flood of {FLOOD}"
    );
    assert!(last >= first, "drops went back: {first} then {last}");
    assert!(
        vip_frames < FLOOD as u64,
        "the one-block ring took all {FLOOD} datagrams"
    );
    assert!(
        vip_frames + last >= FLOOD as u64,
        "{FLOOD} sent, {vip_frames} received and {last} dropped"
    );
}

//! Does splice(2) beat a user-space copy for weir's TCP relay?
//!
//! Three threads on loopback: a source writing `SIZE` bytes as fast as it
//! can, a relay (the thing measured) moving them from one socket to another,
//! and a sink reading and discarding. The relay is either `read`/`write`
//! through one buffer of weir's default size (16 KiB) or of 64 KiB, or
//! `splice` socket → pipe → socket (64 KiB per call, the default pipe size).
//! Runs alternate so that noise hits every variant alike; the table gives
//! the median of the runs and the ratio to the best variant of this run.
//!
//! `cargo run --release -p weir --example splice_vs_copy [MiB] [runs]`

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::fcntl::{SpliceFFlags, splice};

#[derive(Clone, Copy, Debug)]
enum Relay {
    Copy(usize),
    Splice,
}

fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
    let (s, _) = l.accept().expect("accept");
    (c, s)
}

fn run(relay: Relay, size: u64) -> Duration {
    let (mut src_w, relay_in) = pair();
    let (mut relay_out, mut sink) = pair();
    let source = std::thread::spawn(move || {
        let buf = vec![0x5au8; 64 * 1024];
        let mut left = size;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            src_w.write_all(&buf[..n]).expect("source write");
            left -= n as u64;
        }
    });
    let sink = std::thread::spawn(move || {
        let mut buf = vec![0u8; 256 * 1024];
        let mut got = 0u64;
        while got < size {
            let n = sink.read(&mut buf).expect("sink read");
            assert!(n > 0, "sink: early EOF");
            got += n as u64;
        }
    });
    let t0 = Instant::now();
    let mut moved = 0u64;
    match relay {
        Relay::Copy(bs) => {
            let mut relay_in = relay_in;
            let mut buf = vec![0u8; bs];
            while moved < size {
                let n = relay_in.read(&mut buf).expect("relay read");
                relay_out.write_all(&buf[..n]).expect("relay write");
                moved += n as u64;
            }
        }
        Relay::Splice => {
            let (pr, pw) = nix::unistd::pipe().expect("pipe");
            while moved < size {
                let n = splice(
                    relay_in.as_fd(),
                    None,
                    pw.as_fd(),
                    None,
                    64 * 1024,
                    SpliceFFlags::SPLICE_F_MOVE,
                )
                .expect("splice in");
                let mut left = n;
                while left > 0 {
                    left -= splice(
                        pr.as_fd(),
                        None,
                        relay_out.as_fd(),
                        None,
                        left,
                        SpliceFFlags::SPLICE_F_MOVE,
                    )
                    .expect("splice out");
                }
                moved += n as u64;
            }
        }
    }
    sink.join().expect("sink");
    let took = t0.elapsed();
    source.join().expect("source");
    took
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(512);
    let runs: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let size = mib << 20;
    let variants = [
        Relay::Copy(16 * 1024),
        Relay::Copy(64 * 1024),
        Relay::Splice,
    ];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); variants.len()];
    for _ in 0..runs {
        for (i, v) in variants.iter().enumerate() {
            times[i].push(run(*v, size));
        }
    }
    let gbps: Vec<f64> = times
        .iter_mut()
        .map(|t| {
            t.sort();
            let med = t[t.len() / 2];
            size as f64 * 8.0 / med.as_secs_f64() / 1e9
        })
        .collect();
    let best = gbps.iter().cloned().fold(0.0, f64::max);
    println!(
        "relay of {mib} MiB over loopback, median of {runs} runs (noisy shared 2-core machine)\n"
    );
    println!("| relay | Gbit/s | vs best |");
    println!("| --- | ---: | ---: |");
    for (v, g) in variants.iter().zip(&gbps) {
        let name = match v {
            Relay::Copy(bs) => format!("read/write, {} KiB buffer", bs / 1024),
            Relay::Splice => "splice via pipe, 64 KiB".to_owned(),
        };
        println!("| {name} | {g:.2} | {:.2} |", g / best);
    }
}

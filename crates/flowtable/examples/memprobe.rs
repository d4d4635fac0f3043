//! Memory per packet-mode flow in the library, the way `weir-bench packet
//! --only scale` fills the daemon's table: one tenant with its own table
//! (starting at 65,536 entries, cap 2^24), nat flows (a forward and a reply
//! index entry each), RSS measured around the fill.
//!
//! `cargo run --release -p weir-flowtable --example memprobe -- 1000000`
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use weir_flowtable::*;

fn rss() -> usize {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = s.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map_or(1_000_000, |a| a.parse().expect("a count"));
    let ft = FlowTable::new(TableConfig {
        seed: Some(7),
        memory_budget: 1 << 34,
        ..TableConfig::default()
    });
    let t = TenantId(1);
    ft.add_tenant(
        t,
        TenantConfig {
            own_buckets: 65_536,
            max_entries: 1 << 24,
            timeouts: Timeouts::default(),
        },
    )
    .unwrap();
    let before = rss();
    let virt = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 100)), 9000);
    for i in 0..n as u32 {
        let client = SocketAddr::new(
            IpAddr::V4(Ipv4Addr::from(0x0a00_0000 | (i >> 8 & 0xffff) << 8 | 2)),
            1024 + (i & 0xff) as u16 * 200 + (i >> 24) as u16,
        );
        let key = FlowKey {
            tenant: t,
            proto: Proto::Udp,
            client,
            virt,
        };
        let init = FlowInit {
            service: ServiceId(1),
            backend: BackendId(i % 3),
            state: FlowState::Udp,
            owner: 0,
            profile: ProfileRef::NONE,
        };
        ft.insert_reply(key, init, ReplyMode::Nat, Millis(1))
            .unwrap();
        if i % 4096 == 0 {
            ft.maintain();
        }
    }
    for _ in 0..100_000 {
        ft.maintain();
        if ft.resize_state(t).is_some_and(|(r, _)| !r) {
            break;
        }
    }
    let after = rss();
    let st = ft.tenant_stats(t).unwrap();
    println!(
        "flows {n}: RSS {:.1} B/flow, memory_bytes {:.1} B/flow, index head lines {:.1} B/flow (buckets {}, load {:.3}, entries {}, replies {})",
        (after - before) as f64 / n as f64,
        ft.memory_bytes() as f64 / n as f64,
        st.buckets as f64 * 64.0 / n as f64,
        st.buckets,
        st.load_factor,
        st.entries,
        st.reply_entries,
    );
}

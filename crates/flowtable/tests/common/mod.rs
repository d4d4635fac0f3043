//! Keys, entries and tables shared by the flow table's integration tests.
//! Each test binary uses only some of them.
#![allow(dead_code, unreachable_pub)]

use std::net::{Ipv4Addr, SocketAddr};

use weir_flowtable::*;

/// Client number `i` of `tenant` (10.0.x.y, port 1024 + the low byte) to
/// 192.0.2.1:80; every `udp_every`-th one UDP, the rest TCP.
pub fn spread_key(tenant: u32, i: u32, udp_every: u32) -> FlowKey {
    FlowKey {
        tenant: TenantId(tenant),
        proto: if i.is_multiple_of(udp_every) {
            Proto::Udp
        } else {
            Proto::Tcp
        },
        client: SocketAddr::new(
            Ipv4Addr::from(0x0a00_0000 | (i >> 8)).into(),
            (i & 0xff) as u16 + 1024,
        ),
        virt: "192.0.2.1:80".parse().unwrap(),
    }
}

/// An established entry number `i`: service `i % services`, backend
/// `i % backends`.
pub fn spread_init(i: u32, services: u32, backends: u32, owner: u32) -> FlowInit<'static> {
    FlowInit {
        owner,
        profile: ProfileRef::NONE,
        service: ServiceId(i % services),
        backend: BackendId(i % backends),
        state: FlowState::Established,
    }
}

/// TCP client number `i` (10.x.y.z:40000) of tenant 1 to 127.0.0.1:80.
pub fn tenant_one_key(i: u32) -> FlowKey {
    FlowKey {
        tenant: TenantId(1),
        proto: Proto::Tcp,
        client: SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 40000)),
        virt: "127.0.0.1:80".parse().unwrap(),
    }
}

/// A table of `shared_buckets` buckets, a 1 MiB budget and hash `seed`,
/// holding tenant 1 on the shared table.
pub fn tenant_one_table(shared_buckets: usize, seed: u64) -> FlowTable {
    let table = FlowTable::new(TableConfig {
        shared_buckets,
        memory_budget: 1 << 20,
        seed: Some(seed),
        ..TableConfig::default()
    });
    table
        .add_tenant(TenantId(1), TenantConfig::default())
        .unwrap();
    table
}

/// An entry of service 1 on backend 1 in `state`.
pub fn one_flow(state: FlowState) -> FlowInit<'static> {
    FlowInit {
        owner: 0,
        profile: ProfileRef::NONE,
        service: ServiceId(1),
        backend: BackendId(1),
        state,
    }
}

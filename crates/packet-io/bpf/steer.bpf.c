// SPDX-License-Identifier: GPL-2.0-only OR MIT
/*
 * weir's XDP steering program. A packet goes to the AF_XDP socket bound to
 * the receiving queue (the `xsks` map) when
 *   - its (destination address, protocol, destination port) is in `steer`
 *     (a service's virtual address), or
 *   - its (destination address, protocol) is in `local_ports` and its
 *     destination port lies in the range stored there (fnat replies to one of
 *     weir's local addresses; the kernel's own connections from that address
 *     use ports outside the range), or
 *   - its (source address, protocol, source port) is in `backends` (nat
 *     replies from a backend).
 * Everything else, and anything this program cannot parse, is XDP_PASS, so
 * SSH, the admin API and unrelated traffic reach the kernel unchanged.
 *
 * Dual licensed GPL-2.0-only OR MIT: the GPL makes the kernel's GPL-only
 * BPF helpers available; MIT matches the rest of weir.
 *
 * Built by crates/packet-io/build.rs with clang -target bpf -O2 -g (BTF kept
 * for the loader).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

/* Keep in sync with `SteerKey` in src/steer.rs. An IPv4 address is stored
 * IPv4-mapped (::ffff:a.b.c.d) so one map serves both families. */
struct steer_key {
	__u8 addr[16];
	__u8 proto; /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 pad;   /* always 0 */
	__be16 port; /* network byte order */
};

/* Keep in sync with `LocalKey` in src/steer.rs: a local address (IPv4-mapped
 * like steer_key) and protocol. */
struct local_key {
	__u8 addr[16];
	__u8 proto;
	__u8 pad[3]; /* always 0 */
};

/* Keep in sync with `PortRange` in src/steer.rs: inclusive, host byte order. */
struct port_range {
	__u16 first;
	__u16 last;
};

/* Indexes into `stats` (keep in sync with `SteerStats::read` in src/steer.rs). */
enum {
	STAT_PASSED = 0,        /* not ours: handed to the kernel */
	STAT_STEERED = 1,       /* redirected to an AF_XDP socket */
	STAT_NO_SOCKET = 2,     /* ours, but no socket on that queue: passed */
	STAT_MATCH_BACKEND = 3, /* matched `backends` (nat reply) */
	STAT_MATCH_LOCAL = 4,   /* matched `local_ports` (fnat reply) */
	STAT_MAX = 5,
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct steer_key);
	__type(value, __u32);
} steer SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct steer_key); /* source address and port */
	__type(value, __u32);
} backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct local_key);
	__type(value, struct port_range);
} local_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, 256);
	__type(key, __u32);
	__type(value, __u32);
} xsks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} stats SEC(".maps");

static __always_inline void bump(__u32 stat)
{
	__u64 *n = bpf_map_lookup_elem(&stats, &stat);
	if (n)
		*n += 1;
}

static __always_inline int count(__u32 stat, int action)
{
	bump(stat);
	return action;
}

/* Redirects to the socket of the receiving queue. XDP_PASS as the fallback
 * action: no socket on this queue means the kernel still gets the packet
 * rather than losing it. */
static __always_inline int steer_to_socket(struct xdp_md *ctx)
{
	int action = bpf_redirect_map(&xsks, ctx->rx_queue_index, XDP_PASS);
	return count(action == XDP_REDIRECT ? STAT_STEERED : STAT_NO_SOCKET, action);
}

struct vlan_hdr {
	__be16 tci;
	__be16 proto;
};

SEC("xdp")
int weir_steer(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct steer_key key = {};
	struct steer_key from = {};
	struct local_key local = {};
	struct port_range *range;
	struct ethhdr *eth = data;
	void *l3;
	void *l4;
	__u16 proto;

	if ((void *)(eth + 1) > end)
		return count(STAT_PASSED, XDP_PASS);
	proto = eth->h_proto;
	l3 = eth + 1;
	/* One VLAN tag (802.1Q or 802.1ad), no more. */
	if (proto == bpf_htons(ETH_P_8021Q) || proto == bpf_htons(ETH_P_8021AD)) {
		struct vlan_hdr *vlan = l3;
		if ((void *)(vlan + 1) > end)
			return count(STAT_PASSED, XDP_PASS);
		proto = vlan->proto;
		l3 = vlan + 1;
	}

	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = l3;
		if ((void *)(ip + 1) > end || ip->ihl < 5)
			return count(STAT_PASSED, XDP_PASS);
		/* A non-first fragment carries no ports: it cannot be matched. */
		if (ip->frag_off & bpf_htons(0x1fff))
			return count(STAT_PASSED, XDP_PASS);
		key.addr[10] = 0xff;
		key.addr[11] = 0xff;
		__builtin_memcpy(&key.addr[12], &ip->daddr, 4);
		from.addr[10] = 0xff;
		from.addr[11] = 0xff;
		__builtin_memcpy(&from.addr[12], &ip->saddr, 4);
		key.proto = ip->protocol;
		l4 = (__u8 *)ip + ip->ihl * 4;
	} else if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = l3;
		if ((void *)(ip6 + 1) > end)
			return count(STAT_PASSED, XDP_PASS);
		/* Extension headers are not followed (weir-packet refuses them). */
		__builtin_memcpy(key.addr, &ip6->daddr, 16);
		__builtin_memcpy(from.addr, &ip6->saddr, 16);
		key.proto = ip6->nexthdr;
		l4 = ip6 + 1;
	} else {
		return count(STAT_PASSED, XDP_PASS);
	}

	/* TCP and UDP both start with source port, destination port. */
	if (key.proto == IPPROTO_TCP || key.proto == IPPROTO_UDP) {
		struct udphdr *ports = l4;
		if ((void *)(ports + 1) > end)
			return count(STAT_PASSED, XDP_PASS);
		key.port = ports->dest;
		from.port = ports->source;
	} else {
		return count(STAT_PASSED, XDP_PASS);
	}

	/* To a virtual address: the common case first. */
	if (bpf_map_lookup_elem(&steer, &key))
		return steer_to_socket(ctx);

	/* To a local address, inside weir's port range. */
	__builtin_memcpy(local.addr, key.addr, 16);
	local.proto = key.proto;
	range = bpf_map_lookup_elem(&local_ports, &local);
	if (range) {
		__u16 port = bpf_ntohs(key.port);
		if (port >= range->first && port <= range->last) {
			bump(STAT_MATCH_LOCAL);
			return steer_to_socket(ctx);
		}
	}

	/* From a nat backend. */
	from.proto = key.proto;
	if (bpf_map_lookup_elem(&backends, &from)) {
		bump(STAT_MATCH_BACKEND);
		return steer_to_socket(ctx);
	}
	return count(STAT_PASSED, XDP_PASS);
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";

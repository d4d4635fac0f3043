// SPDX-License-Identifier: GPL-2.0-only OR MIT
/*
 * weir's XDP steering program: packets whose (destination address, protocol,
 * destination port) is in the `steer` map go to the AF_XDP socket bound to
 * the receiving queue (the `xsks` map); everything else, and anything this
 * program cannot parse, is XDP_PASS, so SSH, the admin API and unrelated
 * traffic reach the kernel unchanged.
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

/* Indexes into `stats` (keep in sync with `Stat` in src/steer.rs). */
enum {
	STAT_PASSED = 0,    /* not ours: handed to the kernel */
	STAT_STEERED = 1,   /* redirected to an AF_XDP socket */
	STAT_NO_SOCKET = 2, /* ours, but no socket on that queue: passed */
	STAT_MAX = 3,
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct steer_key);
	__type(value, __u32);
} steer SEC(".maps");

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

static __always_inline int count(__u32 stat, int action)
{
	__u64 *n = bpf_map_lookup_elem(&stats, &stat);
	if (n)
		*n += 1;
	return action;
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
		key.proto = ip->protocol;
		l4 = (__u8 *)ip + ip->ihl * 4;
	} else if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = l3;
		if ((void *)(ip6 + 1) > end)
			return count(STAT_PASSED, XDP_PASS);
		/* Extension headers are not followed (weir-packet refuses them). */
		__builtin_memcpy(key.addr, &ip6->daddr, 16);
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
	} else {
		return count(STAT_PASSED, XDP_PASS);
	}

	if (!bpf_map_lookup_elem(&steer, &key))
		return count(STAT_PASSED, XDP_PASS);
	/* XDP_PASS as the fallback action: no socket on this queue means the
	 * kernel still gets the packet rather than losing it. */
	int action = bpf_redirect_map(&xsks, ctx->rx_queue_index, XDP_PASS);
	return count(action == XDP_REDIRECT ? STAT_STEERED : STAT_NO_SOCKET, action);
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";

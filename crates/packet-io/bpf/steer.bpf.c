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
 *     replies from a backend) and its destination is not in `host` (an
 *     address of this host: the kernel's own connections to a backend, such
 *     as weir's health checks, get their answers), or
 *   - it is an ICMP or ICMPv6 error (destination unreachable, packet too
 *     big, time exceeded) quoting a packet weir sent: from a virtual address
 *     (`steer`, by the quoted source), from a local address inside its range
 *     (`local_ports`), or to a nat backend (`backends`, by the quoted
 *     destination, unless the quoted source is in `host`) — so weir can translate it and path-MTU discovery works
 *     through weir.
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
	STAT_MATCH_ICMP = 5,    /* an ICMP error about a packet weir sent */
	STAT_MAX = 6,
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
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct local_key); /* proto 0: any */
	__type(value, __u32);
} host SEC(".maps");

/* Whether `addr` (16 bytes, IPv4-mapped) is one of this host's addresses. */
static __always_inline int is_host(const __u8 *addr)
{
	struct local_key k = {};
	__builtin_memcpy(k.addr, addr, 16);
	return bpf_map_lookup_elem(&host, &k) != 0;
}

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

/* The first four bytes of TCP and UDP. */
struct ports {
	__be16 source;
	__be16 dest;
};

#define ICMP_DEST_UNREACH 3
#define ICMP_TIME_EXCEEDED 11
#define ICMPV6_DEST_UNREACH 1
#define ICMPV6_PKT_TOOBIG 2
#define ICMPV6_TIME_EXCEED 3
#define IPPROTO_ICMPV6_ 58

/* An ICMP (v6 = 0) or ICMPv6 (v6 = 1) message at `l4`: steered if it is an
 * error quoting a TCP/UDP packet that weir sent — from a virtual address or
 * from a local address inside its port range, or to a nat backend. */
static __always_inline int icmp_error(struct xdp_md *ctx, __u8 *icmp, void *end, int v6)
{
	struct steer_key src = {};
	struct steer_key dst = {};
	struct local_key local = {};
	struct port_range *range;
	struct ports *ports;
	__u8 proto;

	/* Type, code, checksum, 4 bytes, then the quoted packet. */
	if ((void *)(icmp + 8) > end)
		return count(STAT_PASSED, XDP_PASS);
	if (!v6) {
		struct iphdr *ip = (void *)(icmp + 8);
		if (icmp[0] != ICMP_DEST_UNREACH && icmp[0] != ICMP_TIME_EXCEEDED)
			return count(STAT_PASSED, XDP_PASS);
		if ((void *)(ip + 1) > end || ip->version != 4 || ip->ihl < 5)
			return count(STAT_PASSED, XDP_PASS);
		if (ip->frag_off & bpf_htons(0x1fff))
			return count(STAT_PASSED, XDP_PASS);
		src.addr[10] = 0xff;
		src.addr[11] = 0xff;
		__builtin_memcpy(&src.addr[12], &ip->saddr, 4);
		dst.addr[10] = 0xff;
		dst.addr[11] = 0xff;
		__builtin_memcpy(&dst.addr[12], &ip->daddr, 4);
		proto = ip->protocol;
		ports = (void *)((__u8 *)ip + ip->ihl * 4);
	} else {
		struct ipv6hdr *ip6 = (void *)(icmp + 8);
		if (icmp[0] != ICMPV6_DEST_UNREACH && icmp[0] != ICMPV6_PKT_TOOBIG &&
		    icmp[0] != ICMPV6_TIME_EXCEED)
			return count(STAT_PASSED, XDP_PASS);
		if ((void *)(ip6 + 1) > end || ip6->version != 6)
			return count(STAT_PASSED, XDP_PASS);
		__builtin_memcpy(src.addr, &ip6->saddr, 16);
		__builtin_memcpy(dst.addr, &ip6->daddr, 16);
		proto = ip6->nexthdr;
		ports = (void *)(ip6 + 1);
	}
	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return count(STAT_PASSED, XDP_PASS);
	if ((void *)(ports + 1) > end)
		return count(STAT_PASSED, XDP_PASS);
	src.proto = proto;
	src.port = ports->source;
	dst.proto = proto;
	dst.port = ports->dest;

	/* Weir sent it from a virtual address (to a client). */
	if (bpf_map_lookup_elem(&steer, &src))
		goto match;
	/* From a local address inside the range (fnat, to a backend). */
	__builtin_memcpy(local.addr, src.addr, 16);
	local.proto = proto;
	range = bpf_map_lookup_elem(&local_ports, &local);
	if (range) {
		__u16 port = bpf_ntohs(src.port);
		if (port >= range->first && port <= range->last)
			goto match;
	}
	/* To a nat backend, from a client (not from this host). */
	if (bpf_map_lookup_elem(&backends, &dst) && !is_host(src.addr))
		goto match;
	return count(STAT_PASSED, XDP_PASS);
match:
	bump(STAT_MATCH_ICMP);
	return steer_to_socket(ctx);
}

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
	/* One 802.1Q tag, no more: weir-packet refuses an 802.1ad tag and
	 * stacked tags (`stacked_vlan`), so those stay the kernel's. */
	if (proto == bpf_htons(ETH_P_8021Q)) {
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
	} else if (key.proto == IPPROTO_ICMP && proto == bpf_htons(ETH_P_IP)) {
		return icmp_error(ctx, l4, end, 0);
	} else if (key.proto == IPPROTO_ICMPV6_ && proto == bpf_htons(ETH_P_IPV6)) {
		return icmp_error(ctx, l4, end, 1);
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

	/* From a nat backend, to a client (not to this host). */
	from.proto = key.proto;
	if (bpf_map_lookup_elem(&backends, &from) && !is_host(key.addr)) {
		bump(STAT_MATCH_BACKEND);
		return steer_to_socket(ctx);
	}
	return count(STAT_PASSED, XDP_PASS);
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";

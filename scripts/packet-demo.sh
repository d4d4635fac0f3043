#!/usr/bin/env bash
# Packet mode in network namespaces: a client, weir, two nginx backends, one
# bridge. Builds the topology, runs weir in front (foreground; Ctrl-C stops
# it and removes everything).
#
#   sudo scripts/packet-demo.sh [nat|fnat|dr] [path/to/weir]
#
# Then, from another shell:
#   sudo ip netns exec wd-client curl http://10.99.1.100/     # b1, b2, b1, ...
#   sudo weir conns --config /tmp/weir-packet-demo/weir.toml  # the flows
#   sudo weir stats --config /tmp/weir-packet-demo/weir.toml  # frames, drops
#
#   client 10.98.0.10 ─┐                 ┌─ weir lb0 10.98.0.1 + 10.99.0.1
#                      ├── bridge br0 ───┤
#   b1 10.99.0.2 ──────┤                 └─ (VIP 10.99.1.100 routed to weir)
#   b2 10.99.0.3 ──────┘
#
# Needs root, iproute2, ethtool and nginx (apt-get install iproute2 ethtool
# nginx curl).
set -euo pipefail

METHOD=${1:-nat}
WEIR=${2:-$(command -v weir || echo target/release/weir)}
DIR=/tmp/weir-packet-demo
NS=(wd-sw wd-client wd-lb wd-b1 wd-b2)
VIP=10.99.1.100

case $METHOD in nat|fnat|dr) ;; *) echo "method: nat, fnat or dr" >&2; exit 2 ;; esac
[ "$(id -u)" = 0 ] || { echo "run as root (network namespaces, XDP)" >&2; exit 1; }
[ -x "$WEIR" ] || { echo "no weir binary at $WEIR (cargo build --release)" >&2; exit 1; }

cleanup() {
  [ -f "$DIR/pids" ] && xargs -r kill <"$DIR/pids" 2>/dev/null || true
  for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
}
trap cleanup EXIT
cleanup
rm -rf "$DIR" && mkdir -p "$DIR"

for ns in "${NS[@]}"; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
ip -n wd-sw link add br0 type bridge && ip -n wd-sw link set br0 up

# ns  dev  mac  addresses...
link() {
  local ns=$1 dev=$2 mac=$3 port=p-$1 q=1; shift 3
  [ "$dev" = lb0 ] && q=2
  ip link add "$port" netns wd-sw type veth peer name "$dev" netns "$ns" address "$mac" \
    numrxqueues $q numtxqueues $q
  ip -n wd-sw link set "$port" master br0 up
  for a in "$@"; do ip -n "$ns" addr add "$a" dev "$dev"; done
  ip -n "$ns" link set "$dev" up
  # Full checksums: an AF_XDP frame never reaches a checksum offload.
  ip netns exec "$ns" ethtool -K "$dev" tx off >/dev/null
}
link wd-client eth0 02:00:00:00:00:0a 10.98.0.10/24
link wd-lb lb0 02:00:00:00:00:01 10.98.0.1/24 10.99.0.1/24
link wd-b1 eth0 02:00:00:00:00:02 10.99.0.2/24
link wd-b2 eth0 02:00:00:00:00:03 10.99.0.3/24
ip -n wd-client route add $VIP/32 via 10.98.0.1

for b in 1 2; do
  ns=wd-b$b ip=10.99.0.$((b + 1)) d=$DIR/b$b
  mkdir -p "$d"
  case $METHOD in
    nat) ip -n $ns route add default via 10.99.0.1 ;;   # replies come back through weir
    dr)  ip -n $ns addr add $VIP/32 dev lo               # the backend holds the VIP
         ip -n $ns route add 10.98.0.0/24 dev eth0 ;;    # and answers the client directly
  esac
  cat >"$d/nginx.conf" <<EOF
daemon off; master_process off; worker_processes 1; pid $d/nginx.pid; error_log $d/error.log;
events { worker_connections 1024; }
http { access_log off; client_body_temp_path $d/body; proxy_temp_path $d/proxy;
  fastcgi_temp_path $d/fcgi; uwsgi_temp_path $d/uwsgi; scgi_temp_path $d/scgi;
  server { listen 80; location / { return 200 "b$b\n"; } } }
EOF
  ip netns exec $ns nginx -c "$d/nginx.conf" &
  echo $! >>"$DIR/pids"
done

LOCAL=""
[ "$METHOD" = fnat ] && LOCAL='local_addresses = ["10.99.0.1"]'
cat >"$DIR/weir.toml" <<EOF
[admin]
listen = "unix:$DIR/admin.sock"
token_file = "$DIR/admin.token"

[packet]
interfaces = ["lb0"]
$LOCAL

[[service]]
name = "web"
protocol = "tcp"
listen = "$VIP:80"
forward = "$METHOD"
scheduler = "rr"
  [[service.backend]]
  address = "10.99.0.2:80"
  [[service.backend]]
  address = "10.99.0.3:80"
EOF

# Warm weir's neighbour table (weir also asks the kernel to resolve a next
# hop it lacks, and drops that first packet while it does).
for ip in 10.98.0.10 10.99.0.2 10.99.0.3; do ip netns exec wd-lb ping -c1 -W1 $ip >/dev/null || true; done

echo "weir ($METHOD) in namespace wd-lb; config $DIR/weir.toml"
echo "try: sudo ip netns exec wd-client curl http://$VIP/"
ip netns exec wd-lb "$WEIR" run --config "$DIR/weir.toml"

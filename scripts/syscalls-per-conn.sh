#!/usr/bin/env bash
# System calls per proxied TCP connection, by kind (docs/BENCHMARKS.md,
# "Syscalls per connection"): the proxy (weir, nginx stream or HAProxy, with
# WORKERS workers) in front of one nginx HTTP backend, as the proxy suite's
# `cps` row sets them up; `perf stat` counts every `sys_enter` tracepoint
# of the proxy's worker threads while `wrk -t1 -c32 -d4s` makes a new
# connection per request, then the counts are divided by the connections
# wrk made. Counting tracepoints costs the proxy a few percent, so batching
# (epoll_wait, the accept that ends a batch) is close to an unobserved run;
# the counts of the other calls do not depend on timing. Needs root (for the
# tracepoints), perf, nginx, haproxy and wrk.
#   scripts/syscalls-per-conn.sh weir|nginx|haproxy [WORKERS] [path/to/weir]
set -euo pipefail
IMPL=${1:?weir, nginx or haproxy}
WORKERS=${2:-1}
BIN=$(realpath "${3:-target/release/weir}")
CONNS=${CONNS:-32}
SECS=${SECS:-4}
D=$(mktemp -d /tmp/weir-spc.XXXXXX)
# Ports from the suite's range, away from the kernel's ephemeral one.
BASE=$((20000 + RANDOM % 11000))
BE=$BASE FE=$((BASE + 1)) ADM=$((BASE + 2))
NG= PX=
cleanup() {
  [ -n "$PX" ] && kill "$PX" 2>/dev/null || true
  [ -n "$NG" ] && kill "$NG" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$D"
}
trap cleanup EXIT
USER_LINE=$( [ "$(id -u)" = 0 ] && echo "user root;" || true)
cat > "$D/backend.conf" <<NGINX
worker_processes 1;
daemon off;
master_process off;
$USER_LINE
pid $D/backend.pid;
error_log $D/backend.err warn;
events { worker_connections 16384; }
http {
  access_log off;
  server {
    listen 127.0.0.1:$BE backlog=4096;
    location / { default_type text/plain; return 200 "ok"; }
  }
}
NGINX
nginx -e "$D/backend.err" -p "$D/" -c "$D/backend.conf" & NG=$!
case $IMPL in
weir)
  cat > "$D/weir.toml" <<TOML
[daemon]
workers = $WORKERS
[admin]
listen = "127.0.0.1:$ADM"
token = "spc"
[[tenant]]
name = "default"
table_entries = 0
max_connections = 0
[[service]]
tenant = "default"
name = "http"
protocol = "tcp"
listen = "127.0.0.1:$FE"
scheduler = "wlc"
persistence = "0s"
  [[service.backend]]
  address = "127.0.0.1:$BE"
  weight = 1
TOML
  HOME=$D XDG_RUNTIME_DIR=$D "$BIN" run --config "$D/weir.toml" > "$D/proxy.log" 2>&1 & PX=$!
  ;;
nginx)
  cat > "$D/stream.conf" <<NGINX
load_module /usr/lib/nginx/modules/ngx_stream_module.so;
worker_processes $WORKERS;
daemon off;
master_process on;
$USER_LINE
pid $D/stream.pid;
error_log $D/stream.err warn;
events { worker_connections 19000; }
stream {
  server { listen 127.0.0.1:$FE backlog=4096; proxy_pass 127.0.0.1:$BE; }
}
NGINX
  nginx -e "$D/stream.err" -p "$D/" -c "$D/stream.conf" > "$D/proxy.log" 2>&1 & PX=$!
  ;;
haproxy)
  cat > "$D/haproxy.cfg" <<CFG
global
  nbthread $WORKERS
  maxconn 9000

defaults
  mode tcp
  timeout connect 5s
  timeout client 120s
  timeout server 120s

listen http
  bind 127.0.0.1:$FE
  server s1 127.0.0.1:$BE
CFG
  haproxy -f "$D/haproxy.cfg" -db > "$D/proxy.log" 2>&1 & PX=$!
  ;;
*) echo "unknown proxy $IMPL" >&2; exit 2 ;;
esac
for _ in $(seq 60); do curl -s -o /dev/null "http://127.0.0.1:$FE/" && break; sleep 0.5; done
curl -sf -o /dev/null "http://127.0.0.1:$FE/" || { echo "$IMPL did not come up" >&2; cat "$D/proxy.log" >&2; exit 1; }
# The processes doing the work: nginx's workers, not its master.
if [ "$IMPL" = nginx ]; then PIDS=$(pgrep -d, -P "$PX"); else PIDS=$PX; fi
# Warm up (pools, the table's first chunks), then count.
wrk -t1 -c"$CONNS" -d1s -H "Connection: close" "http://127.0.0.1:$FE/" > /dev/null
perf stat -x, -o "$D/perf.csv" -e 'raw_syscalls:sys_enter,syscalls:sys_enter_*' -p "$PIDS" -- \
  wrk -t1 -c"$CONNS" -d"${SECS}s" -H "Connection: close" "http://127.0.0.1:$FE/" > "$D/wrk.txt"
REQ=$(grep -oP '^\s*\K\d+(?= requests in)' "$D/wrk.txt")
ERR=$(grep -oP 'Socket errors: \K.*' "$D/wrk.txt" || true)
echo "$IMPL, $WORKERS worker(s): $REQ connections${ERR:+ (socket errors: $ERR)}"
awk -F, -v n="$REQ" '$1 ~ /^[0-9]+$/ && $1 > 0 {
  name = $3; sub(/^(raw_)?syscalls:sys_enter_?/, "", name); if (name == "") name = "all";
  printf "%-16s %8.3f\n", name, $1 / n }' "$D/perf.csv" | sort -k2 -nr

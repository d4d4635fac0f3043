#!/usr/bin/env bash
# User-space instructions per proxied TCP connection, counted by callgrind
# (docs/BENCHMARKS.md, "The allocator"): weir with one worker in front of
# one nginx HTTP backend, counters zeroed after start-up, `wrk -c8` for 8 s
# with a new connection per request, then the instructions over the
# connections wrk made. Needs valgrind, nginx and wrk.
#   scripts/instructions-per-conn.sh [path/to/weir]
set -euo pipefail
BIN=$(realpath "${1:-target/release/weir}")
D=$(mktemp -d /tmp/weir-ipc.XXXXXX)
NG= VG=
cleanup() {
  [ -n "$VG" ] && kill "$VG" 2>/dev/null || true
  [ -n "$NG" ] && kill "$NG" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$D"
}
trap cleanup EXIT
cat > "$D/backend.conf" <<NGINX
worker_processes 1;
daemon off;
master_process off;
$( [ "$(id -u)" = 0 ] && echo "user root;" )
pid $D/backend.pid;
error_log $D/backend.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  server {
    listen 127.0.0.1:28180 backlog=4096;
    location / { default_type text/plain; return 200 "ok"; }
  }
}
NGINX
cat > "$D/weir.toml" <<TOML
[daemon]
workers = 1
[admin]
listen = "127.0.0.1:28182"
token = "ipc"
[[tenant]]
name = "default"
[[service]]
tenant = "default"
name = "web"
protocol = "tcp"
listen = "127.0.0.1:28181"
  [[service.backend]]
  address = "127.0.0.1:28180"
TOML
nginx -e "$D/backend.err" -p "$D/" -c "$D/backend.conf" & NG=$!
valgrind --tool=callgrind --callgrind-out-file="$D/cg.out" "$BIN" run --config "$D/weir.toml" \
  > "$D/weir.log" 2>&1 & VG=$!
for _ in $(seq 120); do curl -s -o /dev/null http://127.0.0.1:28181/ && break; sleep 0.5; done
curl -sf -o /dev/null http://127.0.0.1:28181/ || { echo "weir did not come up" >&2; cat "$D/weir.log" >&2; exit 1; }
callgrind_control -z "$VG" >/dev/null 2>&1
wrk -t1 -c8 -d8s -H "Connection: close" http://127.0.0.1:28181/ > "$D/wrk.txt"
callgrind_control -d "$VG" >/dev/null 2>&1
REQ=$(grep -oP '^\s*\K\d+(?= requests in)' "$D/wrk.txt")
OUT=$(ls -t "$D"/cg.out.* | head -1)
IR=$(grep -E '^(summary|totals):' "$OUT" | head -1 | awk '{print $2}')
echo "$(basename "$BIN"): $REQ connections, $IR instructions, $((IR / REQ)) per connection"

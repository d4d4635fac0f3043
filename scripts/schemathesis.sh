#!/usr/bin/env bash
# Property-based tests of the admin API against its own OpenAPI document:
# starts `weir run` on loopback (one TCP and one UDP service, two tenants),
# points schemathesis at /v1/openapi.json with the full-access token and
# fails on any 5xx (not_a_server_error) or any response that breaks the
# documented schema (response_schema_conformance).
#
# Usage: scripts/schemathesis.sh [WEIR_BIN]
#   WEIR_BIN     weir binary (default: target/debug/weir, as `cargo test` builds it)
#   ST_VENV      venv for schemathesis (default: target/schemathesis-venv; created
#                and `pip install schemathesis` on first use)
#   ST_EXAMPLES  max examples per operation (default 50)
#   ST_MAX_TIME  time budget of the whole run in seconds (default 120)
#   ST_SEED      hypothesis seed (default 1, so a failure replays)
set -euo pipefail
cd "$(dirname "$0")/.."

bin=${1:-${WEIR_BIN:-target/debug/weir}}
venv=${ST_VENV:-target/schemathesis-venv}
examples=${ST_EXAMPLES:-50}
max_time=${ST_MAX_TIME:-120}
seed=${ST_SEED:-1}

[ -x "$bin" ] || { echo "schemathesis: no weir binary at $bin (cargo build -p weir)"; exit 1; }
if [ ! -x "$venv/bin/st" ]; then
    echo "schemathesis: installing into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check schemathesis
fi
venv=$(cd "$venv" && pwd)
"$venv/bin/st" --version

dir=$(mktemp -d -t weir-schemathesis.XXXXXX)
pid=""
cleanup() {
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        # Bounded wait for the drain (drain_timeout = 1s below), then force.
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    fi
    rm -rf "$dir"
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
admin=$(free_port)
token=schemathesis-token
cat > "$dir/weir.toml" <<EOF
[daemon]
workers = 1
shared_table_buckets = 1024
own_tables_budget = 16777216
drain_timeout = "1s"

[admin]
listen = "127.0.0.1:$admin"
token = "$token"
readonly_token = "schemathesis-readonly"

[[tenant]]
name = "default"

[[tenant]]
name = "acme"
table_entries = 1024
max_connections = 100
token = "acme-token"

[[service]]
tenant = "acme"
name = "web"
protocol = "tcp"
listen = "127.0.0.1:$(free_port)"
  [[service.backend]]
  address = "127.0.0.1:9"

[[service]]
name = "dns"
protocol = "udp"
listen = "127.0.0.1:$(free_port)"
  [[service.backend]]
  address = "127.0.0.1:9"
EOF

HOME="$dir" XDG_RUNTIME_DIR="$dir" "$bin" run --config "$dir/weir.toml" > "$dir/weir.log" 2>&1 &
pid=$!
url="http://127.0.0.1:$admin"
ok=""
for _ in $(seq 1 100); do
    if curl -fsS -o /dev/null -H "Authorization: Bearer $token" "$url/v1/openapi.json"; then
        ok=1
        break
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
done
[ -n "$ok" ] || { echo "schemathesis: weir did not serve $url"; cat "$dir/weir.log"; exit 1; }

status=0
# --mode all: valid and invalid inputs; --workers 1: the daemon's state is
# shared, so one request at a time keeps failures reproducible with the seed.
# From the temporary directory: schemathesis keeps its example database in
# ./.schemathesis, which must not land in the repository.
(cd "$dir" && "$venv/bin/st" run "$url/v1/openapi.json" \
    --header "Authorization: Bearer $token" \
    --checks not_a_server_error,response_schema_conformance \
    --phases examples,coverage,fuzzing \
    --max-examples "$examples" --max-time "$max_time" --seed "$seed" \
    --workers 1 --request-timeout 10 --no-shrink \
    --report junit --report-dir "$dir/report") || status=$?

if ! kill -0 "$pid" 2>/dev/null; then
    echo "schemathesis: weir exited during the run"
    status=1
fi
if grep -E "panicked|ERROR" "$dir/weir.log" >/dev/null; then
    echo "schemathesis: weir logged errors:"
    grep -E "panicked|ERROR" "$dir/weir.log" | head -20
    status=1
fi
exit "$status"

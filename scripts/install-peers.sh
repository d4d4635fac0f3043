#!/bin/sh
# Installs the peers and load tools `weir-bench proxy` races weir against:
# haproxy, nginx-light + libnginx-mod-stream, wrk, iperf3 (Debian packages).
# Idempotent: installs only what is missing, and runs `apt-get update` only
# when something is missing. Needs root (or sudo).
set -eu

missing=""
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing="$missing haproxy"
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$missing nginx-light"
[ -f /usr/lib/nginx/modules/ngx_stream_module.so ] || missing="$missing libnginx-mod-stream"
command -v wrk >/dev/null 2>&1 || missing="$missing wrk"
command -v iperf3 >/dev/null 2>&1 || missing="$missing iperf3"

if [ -z "$missing" ]; then
    echo "install-peers: haproxy, nginx (stream), wrk and iperf3 already installed"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
echo "install-peers: installing:$missing"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
# The bench starts and stops its own instances; the packaged services are not wanted.
# shellcheck disable=SC2086
$SUDO apt-get install -y --no-install-recommends $missing
# Debian enables and starts the packaged services; stop them if they run, so
# they hold no ports or CPU during a bench (ignore failures: no systemd here).
for svc in haproxy nginx iperf3; do
    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$svc" 2>/dev/null; then
        $SUDO systemctl stop "$svc" || true
    fi
done

#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for SECONDS each (default 60) and
# fails on the first crash, leak or timeout. Installs cargo-fuzz (and the
# nightly toolchain it needs) when missing. One build, in target/fuzz, is
# shared by all targets; each target's corpus grows in target/fuzz-corpus/
# from the committed seeds in fuzz/seeds/ (which the run never writes to).
#
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]
# A crash leaves its input in fuzz/artifacts/TARGET/; replay it with
#   cd fuzz && cargo +nightly fuzz run --target-dir ../target/fuzz TARGET artifacts/TARGET/crash-...
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true

rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked

cd fuzz
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
cargo +nightly fuzz build --target-dir ../target/fuzz
for t in "${targets[@]}"; do
    echo "--- fuzz $t for ${secs}s"
    corpus=../target/fuzz-corpus/$t
    mkdir -p "$corpus"
    dict=()
    [ -f "dicts/$t.dict" ] && dict=("-dict=dicts/$t.dict")
    # -timeout: one input taking 10 s is a bug (a hang); -rss_limit_mb bounds memory.
    cargo +nightly fuzz run --target-dir ../target/fuzz "$t" "$corpus" "seeds/$t" -- \
        -max_total_time="$secs" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 "${dict[@]}"
done

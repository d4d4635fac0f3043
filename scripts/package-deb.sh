#!/usr/bin/env bash
# Build weir's Debian package and check what is in it.
#
# 1. builds weir (unless --no-build),
# 2. runs that binary to write the man pages (`weir manpages DIR`) and the
#    shell completions (`weir completions bash|zsh|fish`) into
#    target/deb-assets/,
# 3. runs cargo-deb (metadata: crates/weir/Cargo.toml [package.metadata.deb]),
# 4. checks the .deb: binary, unit, conffile, man pages and completions are
#    in it (dpkg-deb -c / -I), and the packaged binary accepts the
#    packaged configuration.
#
# Usage: scripts/package-deb.sh [--profile release|dev] [--no-build]
#   --profile P  cargo profile of the packaged binary (default: release);
#                `dev` packages target/debug/weir (stripped), as CI does
#   --no-build   use the binary already built for that profile
# Needs cargo-deb (`cargo install cargo-deb --locked`) and dpkg-deb.
# Prints the path of the .deb last.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
build=1
while [ $# -gt 0 ]; do
  case $1 in
    --profile) profile=${2:?--profile needs a value}; shift 2 ;;
    --no-build) build=0; shift ;;
    *) echo "package-deb: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
case $profile in
  dev|test) dir=debug ;;
  *) dir=$profile ;;
esac

command -v cargo-deb >/dev/null || { echo "package-deb: cargo-deb missing: cargo install cargo-deb --locked" >&2; exit 1; }
command -v dpkg-deb >/dev/null || { echo "package-deb: dpkg-deb missing: apt-get install dpkg" >&2; exit 1; }

if [ "$build" = 1 ]; then
  cargo build -p weir --bin weir --profile "$profile"
fi
bin=target/$dir/weir
[ -x "$bin" ] || { echo "package-deb: $bin not built (drop --no-build, or build with --profile $profile)" >&2; exit 1; }

# Man pages and completions come from the binary itself (clap), so they
# always match its options.
assets=target/deb-assets
rm -rf "$assets"
mkdir -p "$assets/man" "$assets/completions"
for sub in manpages completions; do
  if ! "$bin" "$sub" --help >/dev/null 2>&1; then
    echo "package-deb: $bin has no \`weir $sub\` subcommand (issue 13 item 1, CLI" \
         "conventions, not merged into this tree yet): cannot make the package's man" \
         "pages and completions" >&2
    exit 1
  fi
done
"$bin" manpages "$assets/man"
"$bin" completions bash > "$assets/completions/weir.bash"
"$bin" completions zsh > "$assets/completions/_weir"
"$bin" completions fish > "$assets/completions/weir.fish"
[ -s "$assets/man/weir.1" ] || { echo "package-deb: weir manpages wrote no weir.1" >&2; exit 1; }
for f in "$assets"/completions/*; do
  [ -s "$f" ] || { echo "package-deb: $f is empty" >&2; exit 1; }
done

# cargo-deb warns that the target/deb-assets paths are not built by cargo:
# expected, they are written above.
deb=$(cargo deb -p weir --no-build --profile "$profile" --output target/debian/ | tail -n 1)
[ -f "$deb" ] || { echo "package-deb: cargo-deb made no package ($deb)" >&2; exit 1; }

# What the package must hold.
contents=$(dpkg-deb -c "$deb" | awk '{print $6}')
want=(
  ./usr/bin/weir
  ./usr/lib/systemd/system/weir.service
  ./etc/weir/weir.toml
  ./usr/share/man/man1/weir.1.gz
  ./usr/share/bash-completion/completions/weir
  ./usr/share/zsh/vendor-completions/_weir
  ./usr/share/fish/vendor_completions.d/weir.fish
)
fail=0
for p in "${want[@]}"; do
  grep -qxF "$p" <<<"$contents" || { echo "package-deb: $deb lacks $p" >&2; fail=1; }
done
# One man page per subcommand besides weir(1).
subpages=$(grep -c '^\./usr/share/man/man1/weir-.*\.1\.gz$' <<<"$contents" || true)
[ "$subpages" -gt 0 ] || { echo "package-deb: no subcommand man pages (weir-*.1.gz)" >&2; fail=1; }
dpkg-deb -f "$deb" Package | grep -qx weir || { echo "package-deb: Package is not weir" >&2; fail=1; }
dpkg-deb -I "$deb" conffiles | grep -qx /etc/weir/weir.toml \
  || { echo "package-deb: /etc/weir/weir.toml is not a conffile" >&2; fail=1; }
# The packaged binary runs and accepts the packaged configuration.
x=$(mktemp -d)
trap 'rm -rf "$x"' EXIT
dpkg-deb -x "$deb" "$x"
"$x/usr/bin/weir" --version >/dev/null || { echo "package-deb: the packaged weir does not run" >&2; fail=1; }
"$x/usr/bin/weir" check --config "$x/etc/weir/weir.toml" >/dev/null \
  || { echo "package-deb: the packaged weir.toml does not pass weir check" >&2; fail=1; }
[ "$fail" = 0 ] || exit 1
echo "package-deb: $(wc -l <<<"$contents") entries, $(du -h "$deb" | cut -f1), $subpages subcommand man page(s); contents checked" >&2
echo "$deb"

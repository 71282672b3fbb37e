#!/usr/bin/env bash
# `make reproducible`: builds what ships (the filter module, the state-api and edge release
# binaries) twice from the committed source (git archive HEAD), at the same path, from an empty
# target folder each time and some minutes apart, and compares their SHA-256. Prints one line
# per artifact and fails when any differs. Not in `make test` (two release builds with LTO take
# a quarter of an hour on 2 cores).
#
# The same path: `edge` embeds its workspace folder (env!("CARGO_MANIFEST_DIR"), to find the
# project's binaries in development), which --remap-path-prefix does not rewrite. Paths of the
# cargo registry and of the build folder in panic locations are remapped to /cargo and /build,
# so the binaries do not name the machine's folders.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=${REPRO_DIR:-${TMPDIR:-/tmp}/edge-idempotency-repro}
src=$work/src
cargo_home=${CARGO_HOME:-$HOME/.cargo}
rm -rf "$work"
mkdir -p "$work/out"

build() { # $1: round name
  rm -rf "$src"
  mkdir -p "$src"
  git -C "$root" archive HEAD | tar -x -C "$src"
  local flags="--remap-path-prefix=$src=/build --remap-path-prefix=$cargo_home=/cargo"
  local started=$(date +%s)
  (cd "$src" && CARGO_TARGET_DIR="$src/target" RUSTFLAGS="$flags" \
     cargo build --locked --release -q -p filter --target wasm32-wasip1 &&
   cd "$src" && CARGO_TARGET_DIR="$src/target" RUSTFLAGS="$flags" \
     cargo build --locked --release -q -p state-api -p edge)
  mkdir -p "$work/out/$1"
  cp "$src/target/wasm32-wasip1/release/filter.wasm" "$src/target/release/state-api" \
     "$src/target/release/edge" "$work/out/$1/"
  echo "reproducible: round $1 built in $(( $(date +%s) - started )) s"
}

build first
build second
status=0
for f in filter.wasm state-api edge; do
  a=$(sha256sum "$work/out/first/$f" | cut -d' ' -f1)
  b=$(sha256sum "$work/out/second/$f" | cut -d' ' -f1)
  if [ "$a" = "$b" ]; then
    echo "reproducible: $f $a ($(stat -c %s "$work/out/first/$f") bytes) the same twice"
  else
    echo "reproducible: $f DIFFERS: $a then $b"
    status=1
  fi
done
rm -rf "$src"
exit $status

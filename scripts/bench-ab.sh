#!/usr/bin/env bash
# make bench-ab BASE=<commit> [RUNS=2]: the bench guard on a base commit and on the working tree,
# alternately, in one window (change, base, change, base, ...), and each figure of the change
# against the base's (issue 47). A floor (`bench/floor.json`) is one machine's: machines of this
# kind differ by 2-4x, and which part limits a ratio moves with the machine. The base measured in
# the same window needs no floor. Fails when a figure's median over the change's rounds is more
# than 10 % worse than its median over the base's (BENCH_AB_TOLERANCE to choose another).
#
# The base is checked out in a worktree and built with a target directory of its own, seeded
# with a copy of this one's release build so that only the workspace's crates are built again.
# Each run writes its figures to the run folder (printed at the end); the guard's own verdict
# against the floor is printed and ignored.
set -euo pipefail

base=${BASE:?"BASE=<commit> is required, e.g. make bench-ab BASE=HEAD~3"}
runs=${RUNS:-2}
tolerance=${BENCH_AB_TOLERANCE:-0.10}
root=$(git rev-parse --show-toplevel)
cargo=${CARGO:-cargo}
base_rev=$(git -C "$root" rev-parse --short "$base^{commit}")
change_rev="$(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet HEAD -- || echo '+changes')"
out=$(mktemp -d "${TMPDIR:-/tmp}/bench-ab.XXXXXX")
tree="$out/base"
target="$out/base-target"

cleanup() {
    git -C "$root" worktree remove --force "$tree" >/dev/null 2>&1 || true
    rm -rf "$target"
}
trap cleanup EXIT

echo "bench-ab: base $base_rev, change $change_rev, $runs runs each; figures in $out"
git -C "$root" worktree add -q --detach "$tree" "$base_rev"
# The base uses this checkout's tools (Envoy in the virtualenv, wasm-bindgen): the same Envoy.
ln -s "$root/.venv" "$tree/.venv"
ln -s "$root/.tools" "$tree/.tools"
mkdir -p "$target"
for dir in release wasm32-wasip1; do
    if [ -d "$root/target/$dir" ]; then cp -a "$root/target/$dir" "$target/"; fi
done
(cd "$tree" && CARGO_TARGET_DIR="$target" make -s build-release)

# One guard run of `side` (its checkout and target directory), its figures kept as run-N.json.
guard() {
    local side=$1 dir=$2 tdir=$3 n=$4
    echo "bench-ab: run $n, $side"
    (cd "$dir" && CARGO_TARGET_DIR="$tdir" "$cargo" run --locked --release -q -p bench -- guard) \
        >"$out/$side-$n.log" 2>&1 || true
    if [ ! -s "$tdir/bench-guard.json" ]; then
        echo "bench-ab: the $side's guard wrote no figures: $out/$side-$n.log" >&2
        tail -20 "$out/$side-$n.log" >&2
        exit 1
    fi
    mv "$tdir/bench-guard.json" "$out/$side-$n.json"
}

change_target=${CARGO_TARGET_DIR:-$root/target}
for n in $(seq 1 "$runs"); do
    guard change "$root" "$change_target" "$n"
    guard base "$tree" "$target" "$n"
done

python3 - "$out" "$tolerance" "$base_rev" "$change_rev" <<'PY'
import glob, json, statistics, sys

out, tolerance, base_rev, change_rev = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]

def rounds(side):
    """Each figure's values over every round of every run of `side`, and which way is better."""
    values, better = {}, {}
    for path in sorted(glob.glob(f"{out}/{side}-*.json")):
        with open(path) as f:
            for fig in json.load(f)["figures"]:
                values.setdefault(fig["figure"], []).extend(fig["rounds"])
                better[fig["figure"]] = fig["better"]
    return values, better

change, better = rounds("change")
base, _ = rounds("base")
failed = []
print(f"| figure | base {base_rev} (median of {len(next(iter(base.values())))} rounds) "
      f"| change {change_rev} | change / base | verdict |")
print("|---|---:|---:|---:|---|")
for name, values in change.items():
    if name not in base:
        print(f"| {name} | - | {statistics.median(values):.3f} | - | not in the base |")
        continue
    b, c = statistics.median(base[name]), statistics.median(values)
    ratio = c / b if b else float("inf")
    worse = ratio < 1 - tolerance if better[name] == "higher" else ratio > 1 + tolerance
    if worse:
        failed.append(f"{name}: {c:.3f} against the base's {b:.3f} ({ratio:.3f})")
    print(f"| {name} ({better[name]} is better) | {b:.3f} | {c:.3f} | {ratio:.3f} | "
          f"{'WORSE' if worse else 'ok'} |")
if failed:
    print(f"bench-ab: more than {tolerance:.0%} worse than the base:\n  " + "\n  ".join(failed))
    sys.exit(1)
print(f"bench-ab: every figure within {tolerance:.0%} of the base's")
PY

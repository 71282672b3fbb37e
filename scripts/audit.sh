#!/usr/bin/env bash
# `make audit`: cargo-deny (advisories, licences, bans, sources) over the workspace and the fuzz
# workspace, against a copy of the RustSec advisory database that is never fetched from the
# network (cargo-deny --offline). ADVISORY_DB names the copy: a git clone, a plain copy of its
# files (as ../shared/advisory-db is) or a .tar.gz of one, from which a git repository is made
# here in target/audit, since cargo-deny reads the database as a repository. Its commit date is the copy's SNAPSHOT date
# when it has one, so that the audit says how old the database is.
set -euo pipefail
cd "$(dirname "$0")/.."

# The database: ADVISORY_DB when set; else this machine's dated copy beside the project
# (../shared/advisory-db); else the same snapshot kept in the repository
# (supply-chain/advisory-db.tar.gz), so that CI and a fresh machine audit against it offline.
vendored=supply-chain/advisory-db.tar.gz
db=${ADVISORY_DB:-}
if [ -z "$db" ]; then
  if [ -d ../shared/advisory-db/crates ]; then db=../shared/advisory-db; else db=$vendored; fi
fi
deny=${CARGO_DENY:-cargo-deny}
work=$PWD/target/audit
rm -rf "$work"
mkdir -p "$work"
if [ -f "$db" ]; then
  tar -xzf "$db" -C "$work"
  echo "audit: advisory database from $db"
  db=$work/advisory-db
fi
if [ ! -d "$db/crates" ]; then
  echo "audit: no advisory database at $db (a copy of github.com/RustSec/advisory-db with its crates/ folder);" >&2
  echo "       point ADVISORY_DB at one: git clone https://github.com/RustSec/advisory-db, then make audit ADVISORY_DB=<that folder>" >&2
  exit 2
fi

# cargo-deny keeps the database of `db-urls` in `<db-path>/advisory-db-<hash of the URL>` and,
# with --offline, reads that repository as it is (cargo-deny 0.20 takes no file:// URL).
dbs=$work/dbs
repo=$dbs/advisory-db-3157b0e258782691
mkdir -p "$dbs"
top=$(git -C "$db" rev-parse --show-toplevel 2>/dev/null || true)
if [ -n "$top" ] && [ "$top" = "$(cd "$db" && pwd -P)" ]; then
  git clone -q --no-hardlinks "$db" "$repo"
  when=$(git -C "$repo" log -1 --format=%cs)
  echo "audit: advisory database cloned from $db (last commit $when)"
else
  mkdir -p "$repo"
  cp -R "$db"/. "$repo"/
  when=$(awk 'NR == 1 { print $2 }' "$repo/SNAPSHOT" 2>/dev/null || true)
  stamp=${when:+${when}T00:00:00Z}
  git -C "$repo" init -q -b main
  git -C "$repo" add -A
  GIT_AUTHOR_DATE=${stamp:-now} GIT_COMMITTER_DATE=${stamp:-now} \
    git -C "$repo" -c user.name=audit -c user.email=audit@localhost commit -q -m "advisory database copy $(head -c 60 "$repo/SNAPSHOT" 2>/dev/null || echo '')"
  echo "audit: advisory database copied from $db (snapshot ${when:-of unknown date}) into a repository"
fi

# The committed deny.toml with the database folder in target/audit.
sed -e "s|^db-path = .*|db-path = \"$dbs\"|" deny.toml > "$work/deny.toml"

status=0
for manifest in Cargo.toml fuzz/Cargo.toml; do
  echo "audit: cargo deny check on $manifest"
  # cargo-deny reads the whole graph, every platform's crates included, and offline it takes
  # them from cargo's cache only: a fresh machine has not downloaded the ones no build of its
  # own needs (wasi, r-efi, android_system_properties...). The registry is reachable; the
  # advisory database is what stays offline.
  cargo fetch --locked --quiet --manifest-path "$manifest"
  "$deny" --offline --locked --manifest-path "$manifest" --config "$work/deny.toml" check --show-stats || status=$?
done
exit $status

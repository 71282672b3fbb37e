# Everything `docker compose up` runs, built from this source tree with nothing but Docker:
#   target `edge`:     edge run (Envoy with the filter, the state API, an embedded Postgres),
#   target `checkout`: the demo checkout;
#   target `state-api`: the state API alone (Kubernetes, `edge render --target istio|envoy-gateway`;
#   not built by `make test-compose`).
# The filter module is built here too (wasm32-wasip1), in the build stage.
# `make test-compose` builds and runs exactly this file (docs/getting-started/compose.md).
FROM rust:1.95-bookworm AS build
WORKDIR /src
RUN rustup target add wasm32-wasip1
COPY . .
RUN cargo build --locked --release -p filter --target wasm32-wasip1 \
 && cargo build --locked --release -p state-api -p edge -p checkout

# Envoy, as the project tests it (1.40.0).
FROM envoyproxy/envoy:v1.40.0 AS envoy

FROM debian:bookworm-slim AS edge
# run/ is where the compose file mounts the `edge-data` volume: made here, owned by `edge`, so
# that Docker creates the volume with that owner (a mount point the image lacks is root's).
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates postgresql-15 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/edge --create-home edge \
 && install -d -o edge -g edge -m 0700 /var/lib/edge/run
COPY --from=envoy /usr/local/bin/envoy /usr/local/bin/envoy
COPY --from=build /src/target/release/edge /src/target/release/state-api /usr/local/bin/
COPY --from=build /src/target/wasm32-wasip1/release/filter.wasm /usr/local/lib/edge/filter.wasm
ENV ENVOY_BIN=/usr/local/bin/envoy \
    STATE_API_BIN=/usr/local/bin/state-api \
    FILTER_WASM=/usr/local/lib/edge/filter.wasm \
    PG_BIN=/usr/lib/postgresql/15/bin
USER edge
WORKDIR /var/lib/edge
ENTRYPOINT ["/usr/local/bin/edge"]
CMD ["run", "--config", "/etc/edge/edge.toml", "--dir", "/var/lib/edge/run"]

FROM debian:bookworm-slim AS checkout
COPY --from=build /src/target/release/checkout /usr/local/bin/checkout
USER 65534:65534
ENTRYPOINT ["/usr/local/bin/checkout"]

# The state API alone, for Kubernetes (`edge render --target istio|envoy-gateway` runs it as
# user 10001 with a read-only root file system; it writes nothing but to Postgres):
#   docker build --target state-api -t REGISTRY/edge-state-api:TAG .
FROM debian:bookworm-slim AS state-api
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/state-api /usr/local/bin/state-api
USER 10001:10001
ENTRYPOINT ["/usr/local/bin/state-api"]

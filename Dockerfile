# One image per Rust service of the workspace: docker build --build-arg BIN=state-api (or checkout).
# The filter is not built here: docker-compose mounts target/wasm32-wasip1/release/filter.wasm
# (build it with `make build-filter`).
FROM rust:1.95-bookworm AS build
ARG BIN
WORKDIR /src
COPY . .
RUN cargo build --locked --release -p ${BIN} && cp target/release/${BIN} /usr/local/bin/service

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/service /usr/local/bin/service
USER 65534:65534
ENTRYPOINT ["/usr/local/bin/service"]

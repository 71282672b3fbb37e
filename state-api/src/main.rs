//! `state-api`: the idempotency state API as a server, the single source of truth for every
//! Idempotency-Key on Postgres: flags or environment ([`state_api::Config`]), the migrations
//! at start (`--migrate-only` runs them and exits), plain HTTP or HTTPS. The library has the rest.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use state_api::{AppState, Config};
use tracing_subscriber::EnvFilter;

fn init_tracing(json: bool) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    // No colour codes in log files.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(ansi);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn main() -> ExitCode {
    let config = Config::parse();
    init_tracing(config.log_json);
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    // 0: tokio's default (TOKIO_WORKER_THREADS, else one per CPU).
    if config.worker_threads > 0 {
        runtime.worker_threads(config.worker_threads);
    }
    let runtime = match runtime.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("state-api: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("state-api: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(config: Config) -> Result<(), state_api::StartError> {
    let listen = config.listen;
    let migrate_only = config.migrate_only;
    // Read before anything else: a bad certificate file stops the start at once.
    let tls = match config.tls.files()? {
        Some(files) => Some(state_api::tls::Reloadable::new(files)?),
        None => None,
    };
    let state = AppState::new(config)?;
    state_api::migrate(&state, Duration::from_secs(15)).await?;
    tracing::info!("migrations applied");
    if migrate_only {
        state.store().close().await;
        return Ok(());
    }
    let listener = bind(listen)?;
    let addr = listener.local_addr()?;
    match tls {
        None => {
            tracing::info!(%addr, "state API listening (plain HTTP)");
            state_api::serve(listener, state, state_api::shutdown_signal()).await?;
        }
        Some(tls) => {
            let _reloader = tls.reload_on_sighup()?;
            tracing::info!(
                %addr,
                cert = %tls.files().cert.display(),
                client_certificates = if tls.files().client_ca.is_some() { "required" } else { "not asked" },
                "state API listening (HTTPS)"
            );
            let listener = state_api::tls::TlsListener::new(listener, tls)?;
            state_api::serve_on(listener, state, state_api::shutdown_signal()).await?;
        }
    }
    tracing::info!("stopped");
    Ok(())
}

/// Pending connections the listener keeps (the kernel caps it at `net.core.somaxconn`). Each
/// waiting claim (`Prefer: wait`) holds a connection from Envoy of its own: a crowd of them
/// arriving at once overflowed tokio's default of 1,024 (`TcpExtListenOverflows`), and Envoy's
/// 500 ms connect timeout failed the callouts whose handshakes the kernel dropped (20-66 of
/// 1,000 waiters answered 503 in the waiting curve).
const LISTEN_BACKLOG: u32 = 8_192;

fn bind(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does: a restarted state API binds while old connections linger.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

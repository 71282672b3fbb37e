//! `checkout`: the demo upstream the idempotency layer protects (`make demo` runs it on :8082),
//! a payment service that records every charge it executes (`GET /charges`) and every attempt
//! it saw; the library has its rules.

use std::net::SocketAddr;
use std::sync::Arc;

use clap::Parser;

/// The demo checkout upstream: records every charge and refund it executes.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "CHECKOUT_LISTEN", default_value = "127.0.0.1:8082")]
    listen: SocketAddr,
    /// Charges and requests kept in memory (`GET /charges`, the record of attempts): older
    /// ones are forgotten, so a demo left running for days stays bounded.
    #[arg(long, env = "CHECKOUT_MAX_REQUESTS", default_value_t = checkout::attempts::DEFAULT_MAX_REQUESTS)]
    max_requests: usize,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(listen = %args.listen, "checkout ready");
    axum::serve(listener, checkout::app(Arc::new(checkout::Ledger::with_limit(args.max_requests))))
        .with_graceful_shutdown(async {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {},
            }
        })
        .await
}

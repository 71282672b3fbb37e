//! `idemctl`: see and resolve idempotency records without SQL, through the state API's admin
//! API (its own token, never the filter's). Every action needs a reason and is written to the
//! audit table with the record before and after.
//!
//! ```text
//! idemctl show    --key K --subject alice --endpoint 'POST /refunds'
//! idemctl list    --state unknown --older-than 10m
//! idemctl release --key K --subject alice --endpoint 'POST /refunds' --reason 'checked with PSP: never charged'
//! idemctl resolve --key K ... --status 201 --header 'content-type: application/json' --body '{"id":"ch_1"}' --reason '...'
//! idemctl purge   --key K ... --reason '...'
//! ```

mod client;
mod print;

use clap::{Args, Parser, Subcommand};
use client::{Action, Address, AdminError, Client, Listing};
use contract::admin::AdminAction;
use contract::wire::StoredResponse;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "idemctl",
    version,
    about = "Operator actions on idempotency records, audited"
)]
struct Cli {
    /// The state API.
    #[arg(
        long,
        env = "IDEMCTL_URL",
        default_value = "http://127.0.0.1:8081",
        global = true
    )]
    url: String,
    /// The admin token (the state API's STATE_API_ADMIN_TOKEN).
    #[arg(long, env = "IDEMCTL_TOKEN", hide_env_values = true, global = true)]
    token: Option<String>,
    /// Print the admin API's JSON answer instead of a summary.
    #[arg(long, global = true)]
    json: bool,
    /// How long to wait for the state API.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, global = true)]
    timeout: Duration,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// A record (never its body unless --body) and its audit trail.
    Show {
        #[command(flatten)]
        at: At,
        /// Include the stored body of a replayable completed record.
        #[arg(long)]
        body: bool,
    },
    /// Records by state and age, oldest first.
    List {
        /// in_progress, unknown or completed (all when absent).
        #[arg(long, value_parser = ["in_progress", "unknown", "completed"])]
        state: Option<String>,
        /// Only records created at least this long ago (`90s`, `10m`, `2h`).
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Option<Duration>,
        #[arg(long)]
        namespace: Option<String>,
        /// At most this many (the state API returns 1,000 at most).
        #[arg(long)]
        limit: Option<u32>,
    },
    /// The key may run again: the record is deleted (refused while its lease is live).
    Release(Act),
    /// The record is completed with the given outcome (or as not replayable).
    Resolve {
        #[command(flatten)]
        act: Act,
        /// The status retries are answered with.
        #[arg(long)]
        status: u16,
        /// A header of the stored response, `name: value` (repeatable).
        #[arg(long = "header", value_parser = parse_header)]
        headers: Vec<(String, String)>,
        /// The stored body.
        #[arg(long, conflicts_with_all = ["body_file", "not_replayable"])]
        body: Option<String>,
        /// The stored body, read from a file.
        #[arg(long, conflicts_with = "not_replayable")]
        body_file: Option<std::path::PathBuf>,
        /// Retries get 409 outcome-not-replayable with the status, no body.
        #[arg(long)]
        not_replayable: bool,
    },
    /// The record is deleted, whatever its state (refused while its lease is live).
    Purge(Act),
}

/// Which record.
#[derive(Args)]
struct At {
    #[arg(long)]
    key: String,
    #[arg(long)]
    subject: String,
    /// `METHOD /path`, as the filter names it (`POST /refunds`).
    #[arg(long)]
    endpoint: String,
    /// The deployment's namespace (the filter's `namespace`).
    #[arg(long, default_value = "")]
    namespace: String,
}

/// An action on a record.
#[derive(Args)]
struct Act {
    #[command(flatten)]
    at: At,
    /// Why (required; it is kept in the audit trail).
    #[arg(long)]
    reason: String,
    /// Who acts (the login name by default).
    #[arg(long, env = "IDEMCTL_ACTOR")]
    actor: Option<String>,
    /// Act although the owner's lease is live or the record is completed (audited as forced).
    #[arg(long)]
    force: bool,
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    let (name, value) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not `name: value`"))?;
    let name = name.trim().to_ascii_lowercase();
    if name.is_empty() {
        return Err(format!("{s:?} has no header name"));
    }
    Ok((name, value.trim().to_owned()))
}

/// The login name, for the audit trail.
fn login() -> String {
    ["USER", "LOGNAME", "USERNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|u| !u.is_empty()))
        .unwrap_or_else(|| "unknown".into())
}

impl Act {
    fn action(&self, response: Option<StoredResponse>) -> AdminAction {
        AdminAction {
            namespace: self.at.namespace.clone(),
            key: self.at.key.clone(),
            subject: self.at.subject.clone(),
            endpoint: self.at.endpoint.clone(),
            reason: self.reason.clone(),
            actor: self.actor.clone().unwrap_or_else(login),
            force: self.force,
            response,
        }
    }
}

impl At {
    fn address(&self) -> Address {
        Address {
            namespace: self.namespace.clone(),
            key: self.key.clone(),
            subject: self.subject.clone(),
            endpoint: self.endpoint.clone(),
        }
    }
}

/// What a command prints: the JSON as the admin API answered, and a summary of it.
struct Output {
    json: serde_json::Value,
    summary: String,
}

async fn run(cli: Cli) -> Result<Output, AdminError> {
    let token = cli.token.clone().unwrap_or_default();
    let client = Client::new(&cli.url, &token, cli.timeout)?;
    let out = match cli.command {
        Command::Show { at, body } => {
            let r = client.show(&at.address(), body).await?;
            Output {
                summary: print::record(&r),
                json: serde_json::to_value(&r).unwrap_or_default(),
            }
        }
        Command::List {
            state,
            older_than,
            namespace,
            limit,
        } => {
            let l = Listing {
                state,
                namespace,
                older_than_s: older_than.map_or(0, |d| d.as_secs()),
                limit,
            };
            let rows = client.list(&l).await?;
            Output {
                summary: print::listing(&rows),
                json: serde_json::to_value(&rows).unwrap_or_default(),
            }
        }
        Command::Release(act) => acted(&client, Action::Release, act.action(None)).await?,
        Command::Purge(act) => acted(&client, Action::Purge, act.action(None)).await?,
        Command::Resolve {
            act,
            status,
            headers,
            body,
            body_file,
            not_replayable,
        } => {
            let bytes = match (body, body_file) {
                (Some(b), _) => b.into_bytes(),
                (None, Some(f)) => std::fs::read(&f).map_err(|e| {
                    AdminError::Unreadable(format!("cannot read {}: {e}", f.display()))
                })?,
                (None, None) => Vec::new(),
            };
            let response = StoredResponse {
                status,
                headers,
                body: bytes,
                replayable: !not_replayable,
            };
            acted(&client, Action::Resolve, act.action(Some(response))).await?
        }
    };
    Ok(out)
}

async fn acted(client: &Client, action: Action, a: AdminAction) -> Result<Output, AdminError> {
    let r = client.act(action, &a).await?;
    Ok(Output {
        summary: print::action(&r),
        json: serde_json::to_value(&r).unwrap_or_default(),
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = cli.json;
    if cli.token.as_deref().is_none_or(str::is_empty) {
        eprintln!("idemctl: no admin token: pass --token or set IDEMCTL_TOKEN (the state API's STATE_API_ADMIN_TOKEN, not the filter's)");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("idemctl: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(out) if json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&out.json).unwrap_or_default()
            );
            ExitCode::SUCCESS
        }
        Ok(out) => {
            print!("{}", out.summary);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("idemctl: {e}");
            if let AdminError::Refused { status: 409, .. } = e {
                eprintln!(
                    "idemctl: pass --force to act anyway (the audit trail records it as forced)"
                );
            }
            ExitCode::from(e.exit_code())
        }
    }
}

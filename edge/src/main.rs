//! `edge`, the command that puts the idempotency layer in front of your own API: `edge
//! check|render|run --config FILE`, `edge clean --dir DIR`, and for the tools `edge schema`,
//! `edge docs` (the docs site's generated pages) and `edge with-postgres -- COMMAND`.

use contract::state_env;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use edge::config::{Config, ConfigError};
use edge::mesh::MeshError;

#[derive(Parser, Debug)]
#[command(version, about = "The idempotency layer in front of your own API")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run COMMAND with DATABASE_URL naming a fresh, empty database on a throwaway Postgres
    /// (removed afterwards); its exit status is this command's. For tools that need a live
    /// database, such as `cargo sqlx prepare --check` in `make lint`.
    WithPostgres {
        #[arg(required = true, trailing_var_arg = true)]
        command: Vec<String>,
    },
    /// Check the file and say what it protects.
    Check {
        #[arg(long, short, env = "CONFIG")]
        config: PathBuf,
    },
    /// Print the Envoy configuration (YAML) and the state API's environment for your own Envoy;
    /// or, with `--target istio|envoy-gateway`, the Kubernetes manifests for a mesh.
    Render {
        #[arg(long, short, env = "CONFIG")]
        config: PathBuf,
        #[arg(long, value_enum, default_value_t = RenderTarget::Envoy)]
        target: RenderTarget,
        /// Envoy: where your Envoy finds filter.wasm (default /etc/envoy/filter.wasm). A mesh:
        /// the module whose image the manifests pin by digest (default: FILTER_WASM, or the one
        /// `make build-filter` builds).
        #[arg(long)]
        wasm: Option<PathBuf>,
        /// The CA bundle for https:// upstreams.
        #[arg(long, default_value = edge::render::DEFAULT_CA_FILE)]
        ca_file: String,
    },
    /// Print the JSON Schema (draft 4) of the filter's plugin configuration, generated from the
    /// filter's own types: editors, CI and Kong (a filter's `config_schema`) validate with it.
    Schema,
    /// Write the docs site's generated Reference pages into DIR (the `docs/` folder): the
    /// configuration file and the plugin configuration (from their types' doc comments; a field
    /// without one fails), the problem types' index (every type must have its page) and the
    /// state API's OpenAPI document. For `make docs`.
    #[command(hide = true)]
    Docs {
        #[arg(long, default_value = "docs")]
        dir: PathBuf,
    },
    /// Remove a run folder (a stopped `edge run`'s) and the cluster data it links to outside
    /// the tree (as root, when the folder was closed to the `postgres` user).
    Clean {
        #[arg(long)]
        dir: PathBuf,
    },
    /// Start Postgres (embedded unless the file names one), the state API and Envoy; restart a
    /// part that dies; stop everything on Ctrl-C or SIGTERM.
    Run {
        #[arg(long, short, env = "CONFIG")]
        config: PathBuf,
        /// The run folder (default: .run/<the file's name>).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// The filter module (default: FILTER_WASM, or the one `make build-filter` builds).
        #[arg(long)]
        wasm: Option<PathBuf>,
        /// The embedded Postgres highly available: etcd, two nodes under Patroni with a
        /// synchronous standby, HAProxy on `postgres_port` (Debian's patroni, etcd-server and
        /// haproxy packages).
        #[arg(long, env = "HA")]
        ha: bool,
    },
    /// Exit 0 when what `edge run` started from this file answers: Envoy's admin `/ready` is
    /// LIVE (or its listener accepts connections without an admin port) and the state API's
    /// `/readyz` is 200 (its port accepts connections over TLS). For container health checks.
    Health {
        #[arg(long, short, env = "CONFIG")]
        config: PathBuf,
    },
}

/// Why a command failed: each is reported once, by `main`, with its exit status.
#[derive(Debug, thiserror::Error)]
enum EdgeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The filter module is not built (or `FILTER_WASM` names nothing).
    #[error("{0}")]
    Module(String),
    #[error("{}: {source}", .path.display())]
    ReadModule {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Mesh(#[from] MeshError),
    #[error("unhealthy: {0}")]
    Unhealthy(#[from] Unhealthy),
    /// `edge clean` could not remove the folder.
    #[error("{0}")]
    Clean(String),
    /// `edge with-postgres`: the throwaway Postgres did not start.
    #[error("{0}")]
    Postgres(String),
    #[error("{program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("cannot start: {0}")]
    Runtime(std::io::Error),
    #[error(transparent)]
    Start(#[from] edge::run::RunError),
    /// What ended `edge run` other than a signal.
    #[error("{0}")]
    Stopped(String),
    /// `edge docs`: a page could not be generated.
    #[error("edge docs: {0}")]
    Docs(#[from] edge::docs::DocsError),
}

impl EdgeError {
    /// 2: the file, the arguments or what they name; 1: a part that does not answer or did
    /// not start.
    fn exit_code(&self) -> ExitCode {
        match self {
            Self::Unhealthy(_) => ExitCode::from(1),
            Self::Start(edge::run::RunError::Config(_)) => ExitCode::from(2),
            Self::Start(_) => ExitCode::from(1),
            Self::Runtime(_) | Self::Stopped(_) => ExitCode::FAILURE,
            _ => ExitCode::from(2),
        }
    }
}

/// The first part `edge health` finds not answering.
#[derive(Debug, thiserror::Error)]
enum Unhealthy {
    #[error("Envoy's /ready says {0:?}")]
    NotLive(String),
    #[error("Envoy's admin {admin}: {why}")]
    Admin { admin: SocketAddr, why: String },
    #[error("Envoy's listener {listen}: {why}")]
    Listener { listen: SocketAddr, why: String },
    #[error("the state API {state}: {why}")]
    StateApi { state: SocketAddr, why: String },
    #[error("the state API's /readyz on {state}: {why}")]
    StateApiReady { state: SocketAddr, why: String },
}

fn main() -> ExitCode {
    let args = Args::parse();
    match execute(args.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{e}");
            e.exit_code()
        }
    }
}

fn execute(command: Command) -> Result<ExitCode, EdgeError> {
    match command {
        Command::WithPostgres { command } => with_postgres(&command),
        Command::Check { config } => {
            let cfg = Config::load(&config)?;
            println!(
                "{}: {} protected route(s), upstream {}, listen {}",
                config.display(),
                cfg.routes.len(),
                cfg.upstream.authority(),
                cfg.listen
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Render {
            config,
            target,
            wasm,
            ca_file,
        } => {
            let cfg = Config::load(&config)?;
            print!("{}", render(&cfg, target, wasm, ca_file)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Run {
            config,
            dir,
            wasm,
            ha,
        } => run(&config, dir, wasm, ha),
        Command::Schema => {
            println!("{}", edge::render::plugin_schema_text());
            Ok(ExitCode::SUCCESS)
        }
        Command::Docs { dir } => {
            for path in edge::docs::write_reference(&dir)? {
                println!("wrote {}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Clean { dir } => {
            for path in edge::data_home::remove_run_folder(&dir).map_err(EdgeError::Clean)? {
                println!("removed {}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Health { config } => {
            health(&Config::load(&config)?)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// What `edge health` checks (see its help); the first part that does not answer.
fn health(cfg: &Config) -> Result<(), Unhealthy> {
    use edge::net::{http_get_blocking, wait_for_port};
    use std::time::Duration;
    match cfg.admin {
        Some(admin) => match http_get_blocking(admin.port(), "/ready") {
            Ok(body) if body.trim() == "LIVE" => {}
            Ok(body) => return Err(Unhealthy::NotLive(body.trim().to_owned())),
            Err(why) => return Err(Unhealthy::Admin { admin, why }),
        },
        None => wait_for_port(cfg.listen.port(), Duration::from_secs(2)).map_err(|why| {
            Unhealthy::Listener {
                listen: cfg.listen,
                why,
            }
        })?,
    }
    let state = cfg.state.listen;
    if cfg.state.tls.is_some() {
        wait_for_port(state.port(), Duration::from_secs(2))
            .map_err(|why| Unhealthy::StateApi { state, why })
    } else {
        http_get_blocking(state.port(), "/readyz")
            .map(drop)
            .map_err(|why| Unhealthy::StateApiReady { state, why })
    }
}

/// Runs `command` on a throwaway Postgres; its exit status is the command's.
fn with_postgres(command: &[String]) -> Result<ExitCode, EdgeError> {
    let (cluster, url) = edge::postgres::TempCluster::start_private()
        .and_then(|cluster| cluster.fresh_database("tool").map(|url| (cluster, url)))
        .map_err(EdgeError::Postgres)?;
    let Some((program, args)) = command.split_first() else {
        return Ok(ExitCode::from(2));
    };
    let status = std::process::Command::new(program)
        .args(args)
        .env(state_env::DATABASE_URL, &url)
        .status();
    drop(cluster);
    match status {
        Ok(s) if s.success() => Ok(ExitCode::SUCCESS),
        Ok(s) => Ok(ExitCode::from(
            u8::try_from(s.code().unwrap_or(1)).unwrap_or(1),
        )),
        Err(source) => Err(EdgeError::Spawn {
            program: program.clone(),
            source,
        }),
    }
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum RenderTarget {
    /// Envoy's own configuration (YAML) and the state API's environment.
    Envoy,
    /// Istio: EnvoyFilter, RequestAuthentication, DestinationRule, and the state API's objects.
    Istio,
    /// Envoy Gateway: EnvoyExtensionPolicy, EnvoyPatchPolicy, EnvoyProxy, ClientTrafficPolicy,
    /// SecurityPolicy, and the state API's objects.
    EnvoyGateway,
}

fn render(
    cfg: &Config,
    target: RenderTarget,
    wasm: Option<PathBuf>,
    ca_file: String,
) -> Result<String, EdgeError> {
    let mesh = match target {
        RenderTarget::Envoy => {
            let wasm = wasm.unwrap_or_else(|| PathBuf::from("/etc/envoy/filter.wasm"));
            return Ok(render_envoy(cfg, wasm, ca_file));
        }
        RenderTarget::Istio => edge::mesh::Target::Istio,
        RenderTarget::EnvoyGateway => edge::mesh::Target::EnvoyGateway,
    };
    let wasm = wasm
        .map_or_else(edge::envoy::filter_wasm, Ok)
        .map_err(EdgeError::Module)?;
    let module = std::fs::read(&wasm).map_err(|source| EdgeError::ReadModule {
        path: wasm.clone(),
        source,
    })?;
    let pins = edge::mesh::Pins::of_module(&module)?;
    Ok(edge::mesh::manifests(cfg, mesh, &pins)?)
}

/// The Envoy YAML, then the state API's environment as comments.
fn render_envoy(cfg: &Config, wasm: PathBuf, ca_file: String) -> String {
    let secrets = edge::mesh::secrets(cfg);
    let inputs = edge::render::Inputs {
        wasm,
        state_token: secrets.token.clone(),
        ca_file,
    };
    let mut out = edge::render::envoy_yaml(cfg, &inputs);
    out.push_str("# The state API this Envoy talks to runs with this environment\n");
    out.push_str("# (`state-api --help` lists every setting):\n");
    let mut env = edge::render::state_api_env(
        cfg,
        &secrets.database_url,
        &secrets.token,
        &secrets.key_secret,
    );
    if cfg.state.storage_key.is_none() {
        env.push((state_env::STATE_API_STORAGE_KEY.into(), secrets.storage_key));
    }
    for (k, v) in env {
        out.push_str(&format!("#   {k}={v}\n"));
    }
    out
}

fn run(
    config: &std::path::Path,
    dir: Option<PathBuf>,
    wasm: Option<PathBuf>,
    ha: bool,
) -> Result<ExitCode, EdgeError> {
    let cfg = Config::load(config)?;
    let wasm = wasm
        .map_or_else(edge::envoy::filter_wasm, Ok)
        .map_err(EdgeError::Module)?;
    let dir = dir.unwrap_or_else(|| {
        let name = config
            .file_stem()
            .map_or("edge".into(), |s| s.to_string_lossy().into_owned());
        PathBuf::from(".run").join(name)
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(EdgeError::Runtime)?;
    let mut running = edge::run::Running::start(cfg, edge::run::Options { dir, wasm, ha })?;
    println!("{}", running.ready_line());
    let result = runtime.block_on(edge::run::until_signal(&mut running, Vec::new));
    eprintln!("stopping");
    running.stop();
    result.map_err(EdgeError::Stopped)?;
    Ok(ExitCode::SUCCESS)
}

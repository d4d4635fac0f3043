//! The `weir` binary: daemon (`run`, `check`, `demo`) and CLI client commands.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use weir::config::{self, Config};
use weir::daemon::{Daemon, DaemonHandle};

mod demo;

#[derive(Debug, Parser)]
#[command(
    name = "weir",
    version,
    about = "weir: a multi-tenant user-space L4 load balancer"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once at start: the size of a variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run the daemon in the foreground.
    Run {
        /// The configuration file (see examples/weir.toml).
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Validate a configuration file without starting; lists every error.
    Check {
        /// The configuration file.
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Start built-in echo backends and a TCP and a UDP service in front of
    /// them, drive a little traffic, and show live stats until Ctrl-C.
    Demo {
        /// Stop by itself after this long, e.g. "10s".
        #[arg(long)]
        duration: Option<String>,
    },
    #[command(flatten)]
    Client(weir::cli::Command),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Check { config } => check(&config),
        Cmd::Run { config } => {
            init_logs();
            run(config)
        }
        Cmd::Demo { duration } => {
            init_logs_quiet();
            let d = match duration.as_deref().map(config::parse_duration) {
                None => None,
                Some(Ok(d)) => Some(d),
                Some(Err(e)) => {
                    eprintln!("weir demo: --duration: {e}");
                    return ExitCode::from(2);
                }
            };
            demo::run(d)
        }
        Cmd::Client(cmd) => weir::cli::run(cmd),
    }
}

fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn init_logs_quiet() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn check(path: &std::path::Path) -> ExitCode {
    match config::load(path) {
        Ok(c) => {
            // What a file check can tell about the admin API's token and
            // TLS files; the address itself is only known to be free when
            // binding.
            let errors: Vec<anyhow::Error> = [
                weir::admin::auth::check_token_source(&c.admin).err(),
                weir::admin::tls::server_config(&c.admin).err(),
            ]
            .into_iter()
            .flatten()
            .collect();
            if !errors.is_empty() {
                for e in &errors {
                    eprintln!("{}: admin: {e:#}", path.display());
                }
                eprintln!("{}: {} error(s)", path.display(), errors.len());
                return ExitCode::from(1);
            }
            println!(
                "{}: OK ({} tenant(s), {} service(s), {} backend(s))",
                path.display(),
                c.tenants.len(),
                c.services.len(),
                c.services.iter().map(|s| s.backends.len()).sum::<usize>()
            );
            ExitCode::SUCCESS
        }
        Err(errors) => {
            for e in &errors {
                eprintln!("{e}");
            }
            eprintln!("{}: {} error(s)", path.display(), errors.len());
            ExitCode::from(1)
        }
    }
}

fn run(path: Option<PathBuf>) -> ExitCode {
    let Some(path) = path else {
        eprintln!(
            "weir run: no configuration given. Try `weir demo` for a self-contained demo, \
             or `weir run --config examples/weir.toml` (the example config in the repository)."
        );
        return ExitCode::from(2);
    };
    let cfg: Config = match config::load(&path) {
        Ok(c) => c,
        Err(errors) => {
            for e in &errors {
                eprintln!("{e}");
            }
            eprintln!(
                "{}: {} error(s); not starting",
                path.display(),
                errors.len()
            );
            return ExitCode::from(1);
        }
    };
    let handle = match Daemon::start(cfg.clone(), Some(path)) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("weir run: {e:#}");
            return ExitCode::from(1);
        }
    };
    let admin_stop = CancellationToken::new();
    // A daemon nobody can manage is worse than one that does not start:
    // the admin API binds (token read, address taken) before we go on.
    if let Err(e) = start_admin(&handle, &cfg.admin, admin_stop.clone()) {
        eprintln!("weir run: admin API: {e:#}; not starting");
        handle.shutdown();
        return ExitCode::from(1);
    }
    let control = handle.control();
    let rt = handle.runtime();
    enum Exit {
        /// SIGTERM, with the streams that may end its drain early.
        Term(tokio::signal::unix::Signal, tokio::signal::unix::Signal),
        Int,
    }
    let exit = rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::hangup()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return Exit::Int;
        };
        loop {
            tokio::select! {
                _ = term.recv() => return Exit::Term(term, int),
                _ = int.recv() => return Exit::Int,
                _ = hup.recv() => {
                    let c = control.clone();
                    let opts = weir::control::ReloadOptions::default();
                    match tokio::task::spawn_blocking(move || c.reload(opts)).await {
                        Ok(Ok(_)) => tracing::info!("SIGHUP: reloaded"),
                        Ok(Err(errs)) => {
                            for e in errs {
                                tracing::error!("SIGHUP: reload: {e}");
                            }
                        }
                        Err(e) => tracing::error!("SIGHUP: reload task: {e}"),
                    }
                }
            }
        }
    });
    admin_stop.cancel();
    drop(control);
    match exit {
        Exit::Term(mut term, mut int) => {
            let t = handle.drain_timeout();
            tracing::info!(drain_timeout = ?t, "SIGTERM: draining");
            // A second SIGTERM or a SIGINT ends the drain at once. The
            // streams were registered before the first SIGTERM, so a signal
            // sent right after it is not lost.
            let abort = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let flag = abort.clone();
            rt.spawn(async move {
                let which = tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = int.recv() => "SIGINT",
                };
                tracing::info!("{which} while draining: stopping now");
                flag.store(true, std::sync::atomic::Ordering::Relaxed);
            });
            let forced = handle.drain_until(t, &abort);
            tracing::info!(forced, "stopped");
        }
        Exit::Int => {
            tracing::info!("SIGINT: stopping");
            handle.shutdown();
        }
    }
    ExitCode::SUCCESS
}

/// Serve the admin API on the daemon's control runtime. Resolving the
/// token and binding happen before this returns, so their errors (address
/// taken, token file a directory or empty) reach the caller.
pub(crate) fn start_admin(
    handle: &DaemonHandle,
    admin: &config::AdminConfig,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let control: Arc<dyn weir::control::Control> = handle.control();
    let bound = handle
        .runtime()
        .block_on(weir::admin::bind(admin, control))?;
    handle.runtime().spawn(async move {
        if let Err(e) = bound.run(stop).await {
            tracing::error!("admin API: {e:#}");
        }
    });
    Ok(())
}

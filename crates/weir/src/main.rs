//! The `weir` binary: daemon (`run`, `check`, `demo`) and CLI client commands.
//!
//! `--admin`, `--token`, `--config` and `--json` are global: they may stand
//! before or after the command's name (`weir --admin URL list` is `weir
//! list --admin URL`). A command that has no use for one of them refuses it
//! when it is given on the command line (see [`unused_global`]); the same
//! setting from the environment (`WEIR_ADMIN`, `WEIR_TOKEN`) is for every
//! command and is ignored where it does not apply.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use weir::config::{self, Config};
use weir::daemon::{Daemon, DaemonHandle};

mod demo;

/// `weir --version`: the version, the commit and the build date (build.rs).
const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("WEIR_GIT_COMMIT"),
    ", built ",
    env!("WEIR_BUILD_DATE"),
    ")"
);

#[derive(Debug, Parser)]
#[command(
    name = "weir",
    version,
    long_version = LONG_VERSION,
    about = "weir: a multi-tenant user-space L4 load balancer"
)]
struct Cli {
    /// Options every command accepts before or after its name.
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    cmd: Cmd,
}

/// The global options. The client commands flatten the same
/// [`weir::cli::client::AdminArgs`] (also global), so the two share ids and
/// clap hands a value given on either side of the command name to both.
#[derive(Debug, Args)]
struct Global {
    #[command(flatten)]
    admin: weir::cli::client::AdminArgs,
    /// Print JSON (list, conns, stats, health, save, reload, tenant list).
    #[arg(long, global = true)]
    json: bool,
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
        /// The configuration file (required).
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Start built-in echo backends and a TCP and a UDP service in front of
    /// them, drive a little traffic, and show live stats until Ctrl-C.
    Demo {
        /// Stop by itself after this long, e.g. "10s".
        #[arg(long)]
        duration: Option<String>,
    },
    /// Print a shell completion script, e.g. `weir completions bash >
    /// /usr/share/bash-completion/completions/weir`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Write man pages for weir and every command (weir.1, weir-list.1,
    /// weir-tenant-add.1, ...) into DIR, created if missing; prints each
    /// file written.
    Manpages {
        /// Where to write them, e.g. /usr/share/man/man1.
        dir: PathBuf,
    },
    #[command(flatten)]
    Client(weir::cli::Command),
}

/// The command-line definition, with the top-level help of `--config`
/// covering the daemon commands too.
fn cli_command() -> clap::Command {
    Cli::command().mut_arg("config", |a| {
        a.help(
            "The daemon's config file: the file to run or check; for client \
             commands, where [admin] listen, token and token_file are read",
        )
    })
}

/// jemalloc rather than glibc's malloc: a proxied connection allocates and
/// frees a dozen small blocks (its task, its future, tokio's registrations,
/// the backend list it tried), ~18% of its user-space instructions under
/// glibc; jemalloc's thread caches take 12.6% off the whole per-connection
/// count at the same idle memory per connection (docs/BENCHMARKS.md, "The
/// allocator"). The library and its tests keep the system allocator.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let matches = cli_command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    if let Some(msg) = unused_global(&matches, &cli) {
        eprintln!("weir {}: {msg}", command_path(&matches));
        return ExitCode::from(2);
    }
    match cli.cmd {
        Cmd::Check { config: None } => {
            eprintln!("weir check: give the file to check: weir check --config FILE");
            ExitCode::from(2)
        }
        Cmd::Check {
            config: Some(config),
        } => check(&config),
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
        Cmd::Completions { shell } => {
            // Into a buffer: clap_complete panics when its writer fails
            // (e.g. `weir completions bash | head`).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cli_command(), "weir", &mut script);
            match std::io::Write::write_all(&mut std::io::stdout(), &script) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("weir completions: writing the script: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Cmd::Manpages { dir } => match write_manpages(&dir) {
            Ok(files) => {
                let list: String = files.iter().map(|f| format!("{}\n", f.display())).collect();
                // Not println!, which panics on a closed pipe.
                match std::io::Write::write_all(&mut std::io::stdout(), list.as_bytes()) {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("weir manpages: listing the files written: {e}");
                        ExitCode::from(2)
                    }
                }
            }
            Err(e) => {
                eprintln!("weir manpages: {}: {e}", dir.display());
                ExitCode::from(2)
            }
        },
        Cmd::Client(cmd) => weir::cli::run(cmd),
    }
}

/// "list", "tenant add": the command as typed, for messages.
fn command_path(m: &ArgMatches) -> String {
    let mut parts = Vec::new();
    let mut cur = m;
    // Bounded by the depth of the command tree (three levels).
    while let Some((name, sub)) = cur.subcommand() {
        parts.push(name);
        cur = sub;
    }
    parts.join(" ")
}

/// Why a global option given on the command line does not fit the command,
/// if it does not. Values from the environment are not checked: they are
/// set once for every command.
fn unused_global(m: &ArgMatches, cli: &Cli) -> Option<String> {
    let given = |id: &str| m.value_source(id) == Some(ValueSource::CommandLine);
    let (admin, config, json) = match &cli.cmd {
        Cmd::Run { .. } | Cmd::Check { .. } => (false, true, false),
        Cmd::Demo { .. } | Cmd::Completions { .. } | Cmd::Manpages { .. } => (false, false, false),
        Cmd::Client(c) => (true, true, c.takes_json()),
    };
    if !admin && (given("admin") || given("token")) {
        return Some(
            "--admin and --token are for the client commands (list, conns, ...); \
             the daemon's own admin API is set in [admin] of its config file"
                .into(),
        );
    }
    if !config && given("config") {
        return Some("--config is not used by this command".into());
    }
    if !json && given("json") {
        return Some(
            "--json is not supported here; it applies to list, conns, stats, health, \
             save, reload and tenant list"
                .into(),
        );
    }
    None
}

/// `weir manpages DIR`: one page for `weir` and one for every command at
/// every level, named as man(1) looks them up (`weir-tenant-add.1`).
fn write_manpages(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    fn walk(cmd: clap::Command, dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
        // Bounded by the command tree, which is finite and three deep.
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            walk(sub.clone(), dir, out)?;
        }
        let man = clap_mangen::Man::new(cmd)
            .date(env!("WEIR_BUILD_DATE"))
            .source(concat!("weir ", env!("CARGO_PKG_VERSION")))
            .manual("weir");
        out.push(man.generate_to(dir)?);
        Ok(())
    }
    std::fs::create_dir_all(dir)?;
    // Without the help subcommand: `weir help` is not worth a page.
    let mut cmd = cli_command().disable_help_subcommand(true);
    cmd.build();
    let mut files = Vec::new();
    walk(cmd, dir, &mut files)?;
    files.sort();
    Ok(files)
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
    // SIGTERM, SIGINT and SIGHUP held from before the listeners bind until
    // their handlers are in place: one sent as soon as a port answers (a
    // supervisor stopping or reloading weir right after its start) waits
    // instead of meeting the default action, which ended the process
    // without a drain. Every thread the daemon starts inherits the mask;
    // once the handlers are in, this thread takes the signals.
    let held = StopSignals::hold();
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
    // systemd (Type=notify): READY=1 below, once the signal handlers are
    // in place too (a `systemctl reload` right after it must not meet
    // SIGHUP's default action, which ends the process).
    weir::systemd::enable();
    let watchdog_stop = CancellationToken::new();
    // Fed while every proxy and packet worker thread runs and turns.
    let mut liveness = handle.liveness_check();
    weir::systemd::spawn_watchdog(&handle.runtime(), watchdog_stop.clone(), move |now| {
        liveness.check(now)
    });
    // Debug builds: the tests' hooks, if asked for (a worker that ends).
    #[cfg(debug_assertions)]
    handle.install_test_hooks();
    let ready_status = format!("serving {} service(s)", cfg.services.len());
    let control = handle.control();
    let rt = handle.runtime();
    enum Exit {
        /// SIGTERM, with the streams that may end its drain early.
        Term(tokio::signal::unix::Signal, tokio::signal::unix::Signal),
        Int,
    }
    let exit = rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        // Debug builds: a pause before the handlers go in, for the test
        // that a stop signal meanwhile waits for them.
        #[cfg(debug_assertions)]
        if let Some(ms) = std::env::var("WEIR_TEST_SIGNALS_LATE_MS")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        let handlers = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::hangup()),
        );
        // In place (or not, and then the default actions apply): a signal
        // held since the start is taken now.
        held.release();
        let (Ok(mut term), Ok(mut int), Ok(mut hup)) = handlers else {
            tracing::error!("cannot install signal handlers");
            return Exit::Int;
        };
        // Every listener and the admin API are bound, signals handled.
        weir::systemd::ready(&ready_status);
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
            weir::systemd::stopping(&format!(
                "draining (up to {})",
                humantime::format_duration(t)
            ));
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
            weir::systemd::stopping("stopping");
            handle.shutdown();
        }
    }
    watchdog_stop.cancel();
    ExitCode::SUCCESS
}

/// SIGTERM, SIGINT and SIGHUP blocked in the calling thread (and so in
/// every thread it starts) until [`StopSignals::release`]: a signal sent
/// meanwhile stays pending, then reaches the handlers.
struct StopSignals(nix::sys::signal::SigSet);

impl StopSignals {
    fn hold() -> Self {
        use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
        let mut set = SigSet::empty();
        for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
            set.add(s);
        }
        // Cannot fail: the set holds valid signals and `how` is valid.
        if let Err(e) = pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&set), None) {
            eprintln!("weir run: blocking stop signals: {e}");
        }
        Self(set)
    }

    fn release(self) {
        use nix::sys::signal::{SigmaskHow, pthread_sigmask};
        if let Err(e) = pthread_sigmask(SigmaskHow::SIG_UNBLOCK, Some(&self.0), None) {
            eprintln!("weir run: unblocking stop signals: {e}");
        }
    }
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

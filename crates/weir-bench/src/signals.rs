//! Stopping a run with SIGINT (Ctrl-C) or SIGTERM: what the run made outside
//! itself is removed as on a normal exit, and the bench exits with 128 + the
//! signal's number (130 or 143), as a shell expects.
//!
//! On a normal exit, an error or a panic, the guards' `Drop`s (`Server`,
//! `Topo`, the rows' setups) stop and remove what they hold. A signal's
//! default action ends the process without running them, and the main
//! thread may be blocked in a wait when it comes, so [`install`] handles both
//! signals on a thread of its own, which removes:
//! * every process the bench started: its live descendants, read from
//!   `/proc` rather than registered, so that a child of any of the suites'
//!   many `Command`s (weir, the peers, trafgen, wrk, iperf3, curl, `ip netns
//!   exec ...`) is found; one that leads its own process group (trafgen, whose
//!   senders are forked) is killed with its group. The bench is a child
//!   subreaper, so an orphan of the run (a daemon that double-forks, a
//!   shell's background job whose shell exited, a worker whose master went
//!   first) becomes its child instead of init's and is still a descendant;
//! * the network namespaces made through [`create_netns`] (their veths go
//!   with them);
//! * the directories named to [`remove_dir_on_signal`].
//!
//! A run that ends without a signal (done, an error, a panic) stops what is
//! still live of it the same way ([`StopLeftovers`]): an adopted orphan no
//! guard knew of would otherwise be handed to init at the bench's exit and
//! run on. An adopted orphan that exits stays a zombie until the bench
//! exits (nothing waits for it: `Child` waits for its own pid, and a wait
//! for any child could take the status of one the main thread waits on);
//! a run adopts a few (trafgen's sender, a peer's worker), each a pid and a
//! few KB of the kernel's memory, which the exit gives back.
//!
//! The registry stays locked from the signal to the exit, so the main thread
//! cannot add a namespace behind the teardown's back. The signal's handler
//! also stores its number, which the main thread reads through
//! [`exit_if_stopped`] after a suite and before it exits: a terminal's
//! Ctrl-C reaches the whole foreground process group, and a child that died
//! of it can make a suite fail before the signal thread has run; the bench
//! then neither goes on to its next step nor exits 1, but tears down (or
//! waits for the signal thread's teardown) and exits 130.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use crate::proxy::sys::{start_time, tree};

/// What the run has made that a signal's teardown must remove.
#[derive(Debug)]
struct Registry {
    namespaces: Vec<String>,
    dirs: Vec<PathBuf>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    namespaces: Vec::new(),
    dirs: Vec::new(),
});

/// The number of the stop signal that came (0: none yet), stored by its
/// handler.
static STOP: AtomicUsize = AtomicUsize::new(0);

fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts the thread that, on SIGINT or SIGTERM, removes what the run made
/// (see the module doc) and exits with 130 or 143. Call once, first thing,
/// so that no child is started before it.
pub(crate) fn install() -> Result<()> {
    // Orphans of the run reparent to the bench, where the walk of its
    // descendants finds them (see the module doc).
    nix::sys::prctl::set_child_subreaper(true).context("PR_SET_CHILD_SUBREAPER")?;
    // In the handler itself, not the thread: the kernel gives a signal
    // sent to the process to its main thread when that can take it, so the
    // number is stored before the main thread returns from the wait (or
    // read) that could tell it a child of its process group died of the
    // same Ctrl-C. Both handlers run (signal-hook-registry chains them).
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        signal_hook::flag::register_usize(sig as i32, &STOP, sig as usize)
            .with_context(|| format!("handling {sig}"))?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .context("signal runtime")?;
    // Register the handlers now, so a signal that comes before the thread
    // runs is not lost.
    let (mut int, mut term) = rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        Ok::<_, std::io::Error>((
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        ))
    })?;
    std::thread::Builder::new()
        .name("bench-signals".into())
        .spawn(move || {
            let sig = rt.block_on(async {
                tokio::select! {
                    _ = int.recv() => Signal::SIGINT,
                    _ = term.recv() => Signal::SIGTERM,
                }
            });
            teardown(sig)
        })?;
    Ok(())
}

/// Runs `add`, which creates network namespace `name`, and registers the
/// namespace for deletion on a signal if it succeeds. The registry is held
/// meanwhile, so a signal that comes during `add` finds the namespace.
pub(crate) fn create_netns<T>(name: &str, add: impl FnOnce() -> Result<T>) -> Result<T> {
    let mut reg = registry();
    let out = add()?;
    reg.namespaces.push(name.to_string());
    Ok(out)
}

/// Namespace `name` is deleted: a signal leaves it alone (the name may be
/// someone else's by then).
pub(crate) fn netns_deleted(name: &str) {
    registry().namespaces.retain(|n| n != name);
}

/// Removes `dir` too if the run is stopped by a signal.
pub(crate) fn remove_dir_on_signal(dir: &Path) {
    registry().dirs.push(dir.to_path_buf());
}

/// `dir` is removed (or kept on purpose): a signal leaves it alone.
pub(crate) fn forget_dir(dir: &Path) {
    registry().dirs.retain(|d| d != dir);
}

/// Held by `main`: when dropped, at the end of a run however it ends
/// (a panic too), stops every process of the run still live, and says
/// which, since one a guard left behind is a leak to fix; or, if a stop
/// signal came, tears down and exits as [`exit_if_stopped`] does.
#[derive(Debug)]
pub(crate) struct StopLeftovers;

impl Drop for StopLeftovers {
    fn drop(&mut self) {
        // A panic a stop signal caused (a killed child) ends as the signal.
        exit_if_stopped();
        let left = kill_descendants();
        if !left.is_empty() {
            eprintln!(
                "weir-bench: stopped what the run left behind: {}",
                left.join(", ")
            );
        }
    }
}

/// If a stop signal has come, tears down as the signal thread does (or,
/// if that thread has the registry, waits for its teardown's exit) and
/// exits with 130 or 143: the main thread, whose children the signal or
/// the teardown killed, neither starts the next step nor exits with its
/// own status. Call it without the registry held.
pub(crate) fn exit_if_stopped() {
    let sig = i32::try_from(STOP.load(Ordering::SeqCst)).map(Signal::try_from);
    if let Ok(Ok(sig)) = sig {
        teardown(sig)
    }
}

/// Whichever thread takes the registry first removes what the run made and
/// exits; the other waits on the registry until the exit.
fn teardown(sig: Signal) -> ! {
    let reg = registry();
    eprintln!(
        "weir-bench: {sig}; stopping every process the run started, removing {} namespaces",
        reg.namespaces.len()
    );
    let _ = kill_descendants();
    for ns in &reg.namespaces {
        let _ = Command::new("ip").args(["netns", "del", ns]).output();
    }
    for dir in &reg.dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
    // The main thread may have started something while the namespaces went.
    let _ = kill_descendants();
    std::process::exit(128 + sig as i32)
}

/// SIGKILLs every live descendant of this process, with the process group
/// of each that leads its own, until none is left, nor any live process in
/// those groups. A killed child stays a zombie until the main thread reaps
/// it, and a zombie is not live, so each round sees what the last one
/// missed (children started meanwhile) and what is still on its way out:
/// trafgen's forked sender, orphaned once its parent is reaped, can spend
/// a while in the kernel closing its packet socket. Returns what it
/// killed, as "command (pid)".
fn kill_descendants() -> Vec<String> {
    let me = std::process::id();
    let mut groups: Vec<u32> = Vec::new();
    let mut killed: Vec<(u32, String)> = Vec::new();
    // Bounded (about 5 s): the main thread could in principle start
    // children forever, and a process stuck in the kernel is not ours to wait
    // for without end.
    for _ in 0..500 {
        let mut live: Vec<u32> = tree(me)
            .into_iter()
            .filter(|&p| p != me && start_time(p).is_some())
            .collect();
        for &p in &live {
            if pgid(p) == Some(p) && !groups.contains(&p) {
                groups.push(p);
            }
        }
        live.extend(live_in_groups(&groups));
        if live.is_empty() {
            break;
        }
        for p in live {
            if !killed.iter().any(|&(k, _)| k == p) {
                let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
                killed.push((p, comm.trim_end().to_string()));
            }
            let Ok(raw) = i32::try_from(p) else {
                continue;
            };
            let pid = Pid::from_raw(raw);
            if groups.contains(&p) {
                let _ = killpg(pid, Signal::SIGKILL);
            }
            let _ = kill(pid, Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    killed
        .into_iter()
        .map(|(p, comm)| format!("{comm} ({p})"))
        .collect()
}

/// The process group of `pid` (`/proc/PID/stat` field 5).
fn pgid(pid: u32) -> Option<u32> {
    stat_fields(pid)?.get(2)?.parse().ok()
}

/// Live (not zombie) processes, anywhere, in one of `groups`. A group's id
/// is not reused while it has a member, so these are processes the run
/// started, orphaned or not.
fn live_in_groups(groups: &[u32]) -> Vec<u32> {
    if groups.is_empty() {
        return Vec::new();
    }
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| {
            stat_fields(p).is_some_and(|f| {
                !matches!(f.first().map(String::as_str), Some("Z" | "X"))
                    && f.get(2)
                        .and_then(|g| g.parse::<u32>().ok())
                        .is_some_and(|g| groups.contains(&g))
            })
        })
        .collect()
}

/// The fields of `/proc/PID/stat` after the command (state first).
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may contain spaces and parentheses: it ends at the last ')'.
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    Some(rest.split_whitespace().map(str::to_string).collect())
}

/// `weir-bench stop-test` (hidden): what a suite's peers can do to a stop,
/// without root or peers, for tests/stop_signal.rs.
#[derive(Debug, Args)]
pub(crate) struct StopTestArgs {
    /// Write the orphan's pid to this file once it (and the child) run.
    #[arg(long, value_name = "FILE")]
    ready: PathBuf,
    /// Return at once instead of waiting on a child: a run that ends
    /// normally.
    #[arg(long)]
    exit: bool,
    /// Wait on the child with the registry held, as the main thread does
    /// while `ip netns add` runs in [`create_netns`]: a signal's teardown
    /// waits for it.
    #[arg(long)]
    hold_registry: bool,
}

/// Leaves an orphan, `sleep` started in the background by a shell that
/// exits (as a daemon that double-forks does), and, unless `--exit`, starts
/// a `sleep` child and fails when it ends, as a suite does when a peer
/// dies (or `ip netns add`, with `--hold-registry`); writes the orphan's
/// pid to `--ready` once both run.
pub(crate) fn stop_test(args: &StopTestArgs) -> Result<()> {
    let out = Command::new("sh")
        .args(["-c", "sleep 600 >/dev/null 2>&1 & echo $!"])
        .output()
        .context("starting the orphan")?;
    let orphan: u32 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .with_context(|| format!("the orphan's pid from sh ({})", out.status))?;
    let child = if args.exit {
        None
    } else {
        Some(Command::new("sleep").arg("600").spawn().context("sleep")?)
    };
    // Whole or not at all, for the test that polls it.
    let tmp = args.ready.with_extension("tmp");
    std::fs::write(&tmp, orphan.to_string())?;
    std::fs::rename(&tmp, &args.ready)?;
    if let Some(mut child) = child {
        let _held = args.hold_registry.then(registry);
        let st = child.wait()?;
        bail!("sleep ended ({st})");
    }
    Ok(())
}

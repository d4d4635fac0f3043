//! The `weir` binary's command-line conventions (issue 13, item 1):
//! global options before or after the command, refusals where a global
//! option has no use, shell completions, man pages, `--version` with commit
//! and build date, and help that shows no empty environment values.
//!
//! Client commands talk to the real admin API on 127.0.0.1 serving the
//! in-memory Control of `admin_fake`.

mod admin_fake;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;

use serde_json::Value;

use admin_fake::{Fake, Served};
use weir::control::Control;

const TOKEN: &str = "conventions-token";

/// The admin API over TCP in front of a [`Fake`]; stopped on drop.
struct Server {
    fake: Arc<Fake>,
    url: String,
    dir: tempfile::TempDir,
    _served: Served,
}

fn server() -> Server {
    let served = admin_fake::serve(&[admin_fake::admin_config("127.0.0.1:0", TOKEN)]);
    Server {
        fake: served.fake.clone(),
        url: served.url(),
        dir: tempfile::tempdir().expect("tempdir"),
        _served: served,
    }
}

/// The binary with no WEIR_* from the caller and HOME in `home`, so no
/// real token file is read.
fn weir(home: &Path) -> Command {
    admin_fake::weir_command(home)
}

fn run(home: &Path, args: &[&str]) -> Output {
    weir(home).args(args).output().expect("run weir")
}

fn ok(o: Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}; stderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).expect("utf8 stdout")
}

/// Exit code 2 and stderr containing `want`.
fn refused(o: Output, want: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    assert!(err.contains(want), "wanted {want:?} in: {err}");
}

#[test]
fn global_options_work_before_and_after_the_command() {
    let s = server();
    let home = s.dir.path();
    let a = s.url.as_str();

    // The same answer wherever the options stand.
    let after = ok(run(home, &["list", "--admin", a, "--token", TOKEN]));
    assert!(after.contains("TCP") && after.contains("->"), "{after}");
    for args in [
        &["--admin", a, "--token", TOKEN, "list"][..],
        &["--admin", a, "list", "--token", TOKEN][..],
        &["--token", TOKEN, "list", "--admin", a][..],
    ] {
        assert_eq!(ok(run(home, args)), after, "weir {args:?}");
    }

    // --json before the command, for a top-level and a nested command.
    let json_after = ok(run(
        home,
        &["list", "--json", "--admin", a, "--token", TOKEN],
    ));
    let v: Value = serde_json::from_str(&json_after).expect("list --json is JSON");
    assert!(!v.as_array().expect("array").is_empty());
    let json_before = ok(run(
        home,
        &["--json", "--admin", a, "--token", TOKEN, "list"],
    ));
    assert_eq!(json_before, json_after);
    let tenants_after = ok(run(
        home,
        &["tenant", "list", "--json", "--admin", a, "--token", TOKEN],
    ));
    let v: Value = serde_json::from_str(&tenants_after).expect("tenant list --json is JSON");
    assert_eq!(v.as_array().expect("array").len(), s.fake.tenants().len());
    for args in [
        &["--json", "--admin", a, "--token", TOKEN, "tenant", "list"][..],
        &["tenant", "--admin", a, "--token", TOKEN, "list", "--json"][..],
    ] {
        assert_eq!(ok(run(home, args)), tenants_after, "weir {args:?}");
    }

    // A token before the command is the one sent: a wrong one is refused.
    let o = run(home, &["--admin", a, "--token", "wrong", "list"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("refused (401)"), "{err}");

    // Given on both sides, the one after the command wins.
    assert_eq!(
        ok(run(
            home,
            &["--token", "wrong", "list", "--admin", a, "--token", TOKEN]
        )),
        after
    );

    // A write command with the options first.
    ok(run(
        home,
        &["--admin", a, "--token", TOKEN, "tenant", "add", "newco"],
    ));
    let names: Vec<String> = s.fake.tenants().into_iter().map(|t| t.spec.name).collect();
    assert!(names.contains(&"newco".to_owned()), "{names:?}");

    // --config before the command names the daemon and its token.
    let cfg = s.dir.path().join("weir.toml");
    let listen = a.trim_start_matches("http://");
    std::fs::write(
        &cfg,
        format!("[admin]\nlisten = \"{listen}\"\ntoken = \"{TOKEN}\"\n"),
    )
    .expect("write config");
    let cfg = cfg.to_str().expect("utf8 path");
    let now = ok(run(home, &["list", "--admin", a, "--token", TOKEN]));
    assert_eq!(ok(run(home, &["--config", cfg, "list"])), now);
    assert_eq!(ok(run(home, &["list", "--config", cfg])), now);
}

#[test]
fn global_options_a_command_has_no_use_for_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let home = dir.path();
    let cfg = home.join("weir.toml");
    std::fs::write(&cfg, "").expect("write config");
    let cfg = cfg.to_str().expect("utf8 path");
    let nowhere = "http://127.0.0.1:1";

    // Refused before anything runs: the messages are not those of a daemon
    // without a config or of an unreachable admin API.
    refused(
        run(home, &["run", "--json"]),
        "weir run: --json is not supported",
    );
    refused(
        run(home, &["--json", "kill", "--all", "--admin", nowhere]),
        "weir kill: --json is not supported",
    );
    refused(
        run(home, &["--json", "tenant", "add", "x", "--admin", nowhere]),
        "weir tenant add: --json is not supported",
    );
    refused(
        run(home, &["demo", "--duration", "1s", "--admin", nowhere]),
        "weir demo: --admin and --token are for the client commands",
    );
    refused(
        run(home, &["--token", "t", "check", "--config", cfg]),
        "weir check: --admin and --token are for the client commands",
    );
    refused(
        run(home, &["completions", "bash", "--config", cfg]),
        "weir completions: --config is not used by this command",
    );
    refused(run(home, &["check"]), "weir check --config FILE");

    // --config before `check`, and the environment's admin settings, which
    // every command sees, are fine.
    let out = ok(weir(home)
        .args(["--config", cfg, "check"])
        .env("WEIR_ADMIN", nowhere)
        .env("WEIR_TOKEN", "t")
        .output()
        .expect("run weir"));
    assert!(out.contains(&format!("{cfg}: OK")), "{out}");
}

#[test]
fn completions_for_each_shell_name_the_commands() {
    let dir = tempfile::tempdir().expect("tempdir");
    for shell in ["bash", "zsh", "fish"] {
        let script = ok(run(dir.path(), &["completions", shell]));
        // fish spells options `-l admin`.
        for word in ["weir", "list", "conns", "tenant", "manpages", "admin"] {
            assert!(script.contains(word), "{shell} script lacks {word:?}");
        }
    }
    let o = run(dir.path(), &["completions", "tcsh"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("invalid value 'tcsh'"));
}

/// The commands `weir PATH... --help` lists, without `help`.
fn commands_in_help(home: &Path, path: &[&str]) -> Vec<String> {
    let mut args = path.to_vec();
    args.push("--help");
    let help = ok(run(home, &args));
    help.lines()
        .skip_while(|l| *l != "Commands:")
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

#[test]
fn manpages_cover_every_command_and_render() {
    let dir = tempfile::tempdir().expect("tempdir");
    let home = dir.path();

    // What to expect, from the help output (two levels: `tenant add`).
    let mut want = BTreeSet::from(["weir.1".to_owned()]);
    let top = commands_in_help(home, &[]);
    assert!(
        top.len() > 10 && top.contains(&"list".to_owned()),
        "{top:?}"
    );
    for c in &top {
        want.insert(format!("weir-{c}.1"));
        for sub in commands_in_help(home, &[c]) {
            want.insert(format!("weir-{c}-{sub}.1"));
        }
    }
    assert!(want.contains("weir-tenant-add.1"), "{want:?}");

    let out_dir = home.join("man/man1");
    let printed = ok(run(
        home,
        &["manpages", out_dir.to_str().expect("utf8 path")],
    ));
    let written: BTreeSet<String> = std::fs::read_dir(&out_dir)
        .expect("man dir created")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(written, want);
    assert_eq!(printed.lines().count(), want.len());
    for name in &written {
        let page = std::fs::read_to_string(out_dir.join(name)).expect("read page");
        // roff: the title macro comes first, after clap_mangen's
        // two-line string definition preamble (`.ie` / `.el`).
        let first = page
            .lines()
            .find(|l| !l.starts_with(".ie ") && !l.starts_with(".el "))
            .unwrap_or_default();
        assert!(
            first.starts_with(&format!(".TH {} 1 ", name.trim_end_matches(".1"))),
            "{name} starts with {first:?}"
        );
        assert!(page.contains(".SH NAME"), "{name} has no NAME section");
    }
    let list = std::fs::read_to_string(out_dir.join("weir-list.1")).expect("weir-list.1");
    assert!(
        list.contains("WEIR_ADMIN"),
        "weir-list.1 names no environment"
    );

    // A file where the directory should be.
    let file = home.join("not-a-dir");
    std::fs::write(&file, "").expect("write");
    refused(
        run(home, &["manpages", file.to_str().expect("utf8 path")]),
        "weir manpages: ",
    );

    if Command::new("man").arg("--version").output().is_err() {
        eprintln!("man is not installed: not rendering the pages");
        return;
    }
    for name in ["weir.1", "weir-list.1", "weir-tenant-add.1"] {
        let o = Command::new("man")
            .args(["-l", "-P", "cat"])
            .arg(out_dir.join(name))
            .env("MANWIDTH", "80")
            .output()
            .expect("run man");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success() && err.is_empty(), "man -l {name}: {err}");
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.contains("--admin"), "man -l {name}:\n{text}");
    }
}

#[test]
fn version_names_the_commit_and_the_build_date() {
    let dir = tempfile::tempdir().expect("tempdir");
    let short = ok(run(dir.path(), &["-V"]));
    assert_eq!(short, format!("weir {}\n", env!("CARGO_PKG_VERSION")));

    let long = ok(run(dir.path(), &["--version"]));
    let rest = long
        .strip_prefix(&format!("weir {} (commit ", env!("CARGO_PKG_VERSION")))
        .and_then(|r| r.strip_suffix(")\n"))
        .unwrap_or_else(|| panic!("{long:?}"));
    let (commit, date) = rest
        .split_once(", built ")
        .unwrap_or_else(|| panic!("{long:?}"));

    // The commit is git's for this checkout, or "unknown" outside one.
    let git = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    match git {
        Some(head) => assert_eq!(commit, head),
        None => assert_eq!(commit, "unknown"),
    }

    // YYYY-MM-DD, not after today.
    let parts: Vec<u32> = date
        .split('-')
        .map(|p| p.parse().unwrap_or_else(|_| panic!("date {date:?}")))
        .collect();
    assert!(
        date.len() == 10
            && parts.len() == 3
            && (1..=12).contains(&parts[1])
            && (1..=31).contains(&parts[2]),
        "date {date:?}"
    );
    if let Ok(o) = Command::new("date").args(["-u", "+%F"]).output() {
        let today = String::from_utf8_lossy(&o.stdout).trim().to_owned();
        assert!(date <= today.as_str(), "built {date}, today {today}");
    }
}

#[test]
fn help_shows_environment_names_without_values() {
    let dir = tempfile::tempdir().expect("tempdir");
    let unset = ok(run(dir.path(), &["list", "--help"]));
    assert!(unset.contains("[env: WEIR_ADMIN]"), "{unset}");
    assert!(unset.contains("[env: WEIR_TOKEN]"), "{unset}");
    assert!(!unset.contains("WEIR_ADMIN="), "{unset}");

    let set = ok(weir(dir.path())
        .args(["list", "--help"])
        .env("WEIR_ADMIN", "http://10.9.8.7:9900")
        .env("WEIR_TOKEN", "s3cret-token")
        .output()
        .expect("run weir"));
    assert!(
        !set.contains("10.9.8.7") && !set.contains("s3cret-token"),
        "{set}"
    );

    // The top-level help lists the global options.
    let top = ok(run(dir.path(), &["--help"]));
    for opt in [
        "--admin <URL>",
        "--token <TOKEN>",
        "--config <FILE>",
        "--json",
    ] {
        assert!(top.contains(opt), "weir --help lacks {opt}:\n{top}");
    }
}

/// `weir reload` that gets no answer within `--timeout` (here from an
/// admin address that takes the connection and never answers, as a daemon
/// applying a long reload) says the reload may still be applying and
/// exits 3, apart from a refusal (1) and a failure to ask (2). It used to
/// wait a fixed 60 s and exit 2 with "no answer within 60s", which reads
/// as a failed reload while the daemon may still apply it.
#[test]
fn a_reload_without_an_answer_may_still_be_applying() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (done, ended) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        // Reads nothing, answers nothing; lets go once the command ended.
        let held = listener.accept();
        let _ = ended.recv();
        drop(held);
    });
    let home = tempfile::tempdir().unwrap();
    let url = format!("http://{addr}");
    let t0 = std::time::Instant::now();
    let o = run(
        home.path(),
        &[
            "reload",
            "--admin",
            &url,
            "--token",
            TOKEN,
            "--timeout",
            "1s",
        ],
    );
    let took = t0.elapsed();
    let _ = done.send(());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "stderr: {err}");
    assert!(
        err.contains("POST /v1/reload")
            && err.contains("no answer within 1s")
            && err.contains("the reload may still be applying")
            && err.contains("--timeout"),
        "{err}"
    );
    assert!(!err.contains("refused"), "{err}");
    assert!(
        took >= std::time::Duration::from_secs(1) && took < std::time::Duration::from_secs(30),
        "{took:?}"
    );
    // A timeout of nothing is refused up front.
    refused(
        run(home.path(), &["reload", "--admin", &url, "--timeout", "0s"]),
        "must be more than 0",
    );
}

/// `weir conns` pages until the daemon says the dump is done, and stops
/// on a cursor that does not move; a daemon answering empty pages whose
/// cursors go round (A, B, A, ...: a daemon of another version, or a bug)
/// passed that check, and the command asked for pages forever. It stops,
/// saying so, at the first cursor it was given before. This server
/// answers at most 20 requests (then closes: the command fails anyway),
/// so the test ends either way.
#[test]
fn conns_stops_on_a_cursor_it_was_given_before() {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let mut asked = 0;
        for s in listener.incoming().take(20) {
            let Ok(s) = s else { break };
            let mut r = BufReader::new(&s);
            let mut line = String::new();
            if r.read_line(&mut line).unwrap() == 0 {
                break; // the test's own connect: the command has ended
            }
            // The rest of the head.
            let mut h = String::new();
            while r.read_line(&mut h).unwrap() > 2 {
                h.clear();
            }
            asked += 1;
            let next = if line.contains("cursor=c3.1.") {
                "c3.2.0.0.1"
            } else {
                "c3.1.0.0.1"
            };
            let body = format!(r#"{{"connections":[],"next":"{next}"}}"#);
            let _ = write!(
                &s,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
        asked
    });
    let home = tempfile::tempdir().unwrap();
    let url = format!("http://{addr}");
    let o = run(home.path(), &["conns", "--admin", &url, "--token", TOKEN]);
    // Ends the server if the command stopped early (a connection that
    // sends nothing).
    drop(std::net::TcpStream::connect(addr));
    let err = String::from_utf8_lossy(&o.stderr);
    let asked = server.join().unwrap();
    assert!(
        asked <= 3,
        "weir conns asked for {asked} pages of cursors going round (stderr: {err})"
    );
    refused(o, "cursor");
}

/// A server that answers every request `200 OK` with `body` (JSON), at
/// most `most` of them, until a connection that sends nothing; its thread
/// returns the request lines it was sent.
fn answering(
    body: &'static str,
    most: usize,
) -> (std::net::SocketAddr, std::thread::JoinHandle<Vec<String>>) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let mut asked = Vec::new();
        for s in listener.incoming().take(most) {
            let Ok(s) = s else { break };
            let mut r = BufReader::new(&s);
            let mut line = String::new();
            if r.read_line(&mut line).unwrap() == 0 {
                break;
            }
            let mut h = String::new();
            let mut len = 0;
            while r.read_line(&mut h).unwrap() > 2 {
                if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap();
                }
                h.clear();
            }
            let mut req_body = vec![0; len];
            std::io::Read::read_exact(&mut r, &mut req_body).unwrap();
            asked.push(line.trim().to_owned());
            let _ = write!(
                &s,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
        asked
    });
    (addr, server)
}

/// `weir kill` and `weir tenant del` print the count the daemon answers
/// with; an answer without one (another server on the address, or a
/// daemon of another version) printed "killed 0 connections" or "(0
/// connections closed)" and exited 0, whatever had been done. Such an
/// answer is an error (exit 2) saying the request may have been carried
/// out.
#[test]
fn kill_and_tenant_del_do_not_make_up_a_count() {
    for (args, path) in [
        (&["kill", "--all"][..], "POST /v1/connections/kill"),
        (
            &["kill", "--state", "ESTABLISHED"][..],
            "POST /v1/connections/kill",
        ),
        (&["tenant", "del", "acme"][..], "DELETE /v1/tenants/acme"),
    ] {
        let (addr, server) = answering(r#"{"ok":true}"#, 5);
        let home = tempfile::tempdir().unwrap();
        let url = format!("http://{addr}");
        let mut argv = args.to_vec();
        argv.extend_from_slice(&["--admin", &url, "--token", TOKEN]);
        let o = run(home.path(), &argv);
        drop(std::net::TcpStream::connect(addr));
        let asked = server.join().unwrap();
        assert!(
            asked.len() == 1 && asked[0].starts_with(path),
            "{args:?}: {asked:?}"
        );
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            !out.contains(" 0 connections"),
            "{args:?} made up a count: {out}"
        );
        refused(o, "may have been");
    }
}

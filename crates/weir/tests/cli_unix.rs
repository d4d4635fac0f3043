//! The `weir` binary against an admin API on a unix socket: `weir list
//! --json`, `weir conns` (several pages) and `weir save` over `--admin
//! unix:PATH` print exactly what they print over TCP from the same
//! in-memory Control; `WEIR_ADMIN=unix:PATH` and `--config FILE` with a unix
//! `[admin] listen` work too; a wrong token and a missing socket fail with
//! the documented exit codes and messages.

mod admin_fake;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use serde_json::Value;

use admin_fake::{Fake, Served};
use weir::cli::render::{self, ListMode};
use weir::control::Control;

const TOKEN: &str = "unix-cli-token";

/// One Fake served on a unix socket and on TCP; stopped on drop.
struct Server {
    fake: Arc<Fake>,
    dir: tempfile::TempDir,
    sock: PathBuf,
    tcp: String,
    _served: Served,
}

fn server() -> Server {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("admin.sock");
    let served = admin_fake::serve(&[
        admin_fake::admin_config(&format!("unix:{}", sock.display()), TOKEN),
        admin_fake::admin_config("127.0.0.1:0", TOKEN),
    ]);
    assert!(sock.exists(), "unix socket bound before bind returned");
    Server {
        fake: served.fake.clone(),
        dir,
        sock,
        tcp: served.url(),
        _served: served,
    }
}

impl Server {
    fn unix(&self) -> String {
        format!("unix:{}", self.sock.display())
    }

    /// The `weir` binary with a clean environment (no WEIR_*, HOME in the
    /// temp dir so no real token file is read).
    fn cmd(&self) -> Command {
        admin_fake::weir_command(self.dir.path())
    }

    /// `weir ARGS --admin ADMIN --token TOKEN`.
    fn weir(&self, admin: &str, args: &[&str]) -> Output {
        self.cmd()
            .args(args)
            .args(["--admin", admin, "--token", TOKEN])
            .output()
            .expect("run weir")
    }
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

#[test]
fn list_conns_and_save_over_a_unix_socket() {
    let s = server();
    let unix = s.unix();

    // weir list --json: the renderer's JSON for the Control's services.
    let out = ok(s.weir(&unix, &["list", "--json"]));
    let v: Value = serde_json::from_str(&out).expect("list --json is JSON");
    let want = render::list_json(&s.fake.services(), ListMode::Plain);
    assert_eq!(v, serde_json::to_value(&want).expect("json"));
    assert!(!v.as_array().expect("array").is_empty());
    assert_eq!(out, ok(s.weir(&s.tcp, &["list", "--json"])));

    // weir conns: 3 pages of up to 1000, a header line, every entry once.
    s.fake.add_conns(2_500);
    let out = ok(s.weir(&unix, &["conns"]));
    assert!(out.starts_with("pro expire state"), "{out}");
    assert_eq!(out.lines().count(), 1 + 2_503);
    assert_eq!(out, ok(s.weir(&s.tcp, &["conns"])));
    let json = ok(s.weir(&unix, &["conns", "--json", "--tenant", "acme"]));
    let mut cookies = std::collections::BTreeSet::new();
    for line in json.lines() {
        let c: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        assert_eq!(c["tenant"], "acme");
        assert!(cookies.insert(c["cookie"].as_u64().expect("cookie")));
    }
    assert_eq!(cookies.len(), 2_502);

    // weir save: a config file that the daemon's parser accepts.
    let saved = ok(s.weir(&unix, &["save"]));
    assert!(saved.starts_with("# weir save"), "{saved}");
    assert_eq!(saved, ok(s.weir(&s.tcp, &["save"])));
    let body = saved.lines().skip(1).collect::<Vec<_>>().join("\n");
    toml::from_str::<toml::Table>(&body).unwrap_or_else(|e| panic!("{e}\n{saved}"));
}

#[test]
fn env_and_config_file_name_the_socket() {
    let s = server();
    let want = ok(s.weir(&s.tcp, &["list"]));
    assert!(!want.is_empty());

    let o = s
        .cmd()
        .args(["list"])
        .env("WEIR_ADMIN", s.unix())
        .env("WEIR_TOKEN", TOKEN)
        .output()
        .expect("run weir");
    assert_eq!(ok(o), want);

    let token_file = s.dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("write token");
    let cfg = s.dir.path().join("weir.toml");
    std::fs::write(
        &cfg,
        format!(
            "[admin]\nlisten = \"unix:{}\"\ntoken_file = \"{}\"\n",
            s.sock.display(),
            token_file.display()
        ),
    )
    .expect("write config");
    let o = s
        .cmd()
        .args(["list", "--config"])
        .arg(&cfg)
        .output()
        .expect("run weir");
    assert_eq!(ok(o), want);
}

#[test]
fn refusals_and_missing_sockets_are_reported() {
    let s = server();
    let o = s
        .cmd()
        .args(["list", "--admin", &s.unix(), "--token", "wrong"])
        .output()
        .expect("run weir");
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("refused (401)"), "{err}");

    let missing: &Path = &s.dir.path().join("nope.sock");
    let o = s.weir(&format!("unix:{}", missing.display()), &["list"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("cannot reach the admin API at unix:") && err.contains("nope.sock"),
        "{err}"
    );
}

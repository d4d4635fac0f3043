//! The systemd unit in packaging/: systemd's own parser accepts it, and it
//! keeps the properties weir relies on (Type=notify, reload by SIGHUP,
//! hardening).

use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_weir");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn unit_text() -> String {
    std::fs::read_to_string(repo().join("packaging/weir.service")).unwrap()
}

/// `systemd-analyze verify` (apt package `systemd`) with the unit's
/// /usr/bin/weir pointed at the binary under test; it must exit 0 and
/// print nothing (unknown keys and bad values are only warnings there).
#[test]
fn the_unit_passes_systemd_analyze_verify() {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIPPED: systemd-analyze not found (apt-get install systemd)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let unit = dir.path().join("weir.service");
    std::fs::write(&unit, unit_text().replace("/usr/bin/weir", BIN)).unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&unit)
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let ours: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("weir.service"))
        .collect();
    assert!(
        out.status.success() && ours.is_empty(),
        "systemd-analyze verify: {}\n{stderr}",
        out.status
    );
}

/// The settings the docs promise, each as its own line of the unit.
#[test]
fn the_unit_is_notify_with_reload_and_hardening() {
    let text = unit_text();
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    for want in [
        "Type=notify",
        "ExecStart=/usr/bin/weir run --config /etc/weir/weir.toml",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "Restart=on-failure",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "RuntimeDirectory=weir",
        "CapabilityBoundingSet=CAP_NET_BIND_SERVICE",
        "AmbientCapabilities=CAP_NET_BIND_SERVICE",
    ] {
        assert!(lines.contains(&want), "packaging/weir.service lacks {want}");
    }
    // The capabilities packet mode will need are named for operators.
    for cap in ["CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_BPF", "CAP_SYS_ADMIN"] {
        assert!(
            lines.iter().any(|l| l.starts_with('#') && l.contains(cap)),
            "no comment names {cap}"
        );
    }
}

//! Build facts for `weir --version` and the man pages: the git commit
//! (`WEIR_GIT_COMMIT`) and the build date (`WEIR_BUILD_DATE`, UTC,
//! YYYY-MM-DD).
//!
//! * Commit: `git rev-parse --short HEAD` when this crate is built from its
//!   own git checkout; else `WEIR_GIT_COMMIT` from the environment (for a
//!   packager building from a tarball who knows it); else "unknown".
//! * Date: `SOURCE_DATE_EPOCH` when set (reproducible builds), else now.
//!
//! The script reruns when HEAD or the branch it points to moves, not on
//! every build, so the date is that of the build that last saw a new commit.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
    println!("cargo:rerun-if-env-changed=WEIR_GIT_COMMIT");
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());

    let commit = git_commit(&manifest)
        .or_else(|| {
            std::env::var("WEIR_GIT_COMMIT")
                .ok()
                .filter(|c| !c.is_empty())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=WEIR_GIT_COMMIT={commit}");

    let secs = match std::env::var("SOURCE_DATE_EPOCH") {
        // The reproducible-builds spec: a malformed value is an error, not
        // a silent fallback to the clock.
        Ok(v) => v.trim().parse::<i64>().unwrap_or_else(|_| {
            panic!("SOURCE_DATE_EPOCH={v:?} is not a number of seconds since 1970")
        }),
        Err(_) => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0),
    };
    // A leap day, so an edit that breaks the conversion fails the build.
    assert_eq!(utc_date(951_782_400), "2000-02-29");
    println!("cargo:rustc-env=WEIR_BUILD_DATE={}", utc_date(secs));
}

/// `git rev-parse --short HEAD` of the checkout this crate sits in, and the
/// files whose change means a new commit. None outside a git work tree.
fn git_commit(manifest: &Path) -> Option<String> {
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git")
            .args(args)
            .current_dir(manifest)
            .output()
            .ok()?;
        if !out.status.success() {
            return None;
        }
        let s = String::from_utf8(out.stdout).ok()?.trim().to_owned();
        (!s.is_empty()).then_some(s)
    };
    let commit = git(&["rev-parse", "--short", "HEAD"])?;
    // HEAD, the branch file it names and packed-refs (where a branch lives
    // after `git gc`). Only existing files: cargo reruns the script on every
    // build for a path that does not exist.
    let mut watch = vec![git(&["rev-parse", "--git-path", "HEAD"])];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch.push(git(&["rev-parse", "--git-path", &branch]));
    }
    watch.push(git(&["rev-parse", "--git-path", "packed-refs"]));
    for p in watch.into_iter().flatten() {
        let p = manifest.join(p);
        if p.exists() {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
    Some(commit)
}

/// Seconds since 1970 as a UTC date, YYYY-MM-DD (Howard Hinnant's
/// days-to-civil algorithm; no date crate needed for one line).
fn utc_date(secs: i64) -> String {
    let z = secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

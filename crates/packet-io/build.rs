//! Builds the XDP steering program (`bpf/steer.bpf.c`) into `$OUT_DIR/steer.bpf.o`,
//! which `src/steer.rs` embeds. Needs clang with the BPF target and the kernel and
//! libbpf headers: on Debian, `apt-get install clang llvm libbpf-dev`.
//! `WEIR_CLANG` names another compiler.
//!
//! Without them the crate still builds (so `cargo test --workspace` works on
//! a fresh machine): the program is left out, `Steering::attach` says why,
//! and the tests that need it skip with that reason. `WEIR_REQUIRE_BPF=1`
//! (set by `.ci/run`) makes a missing compiler or a failed compile an error.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "bpf/steer.bpf.c";
    println!("cargo::rerun-if-changed={src}");
    println!("cargo::rerun-if-env-changed=WEIR_CLANG");
    println!("cargo::rerun-if-env-changed=WEIR_REQUIRE_BPF");
    println!("cargo::rustc-check-cfg=cfg(weir_no_bpf)");
    let out =
        PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("steer.bpf.o");

    let candidates: Vec<String> = match std::env::var("WEIR_CLANG") {
        Ok(clang) => vec![clang],
        Err(_) => vec!["clang-14".into(), "clang".into()],
    };
    let Some(clang) = candidates
        .iter()
        .find(|c| spawn_retrying(|| Command::new(c).arg("--version").output().map(|_| ())).is_ok())
    else {
        fail(&format!(
            "no C compiler for the XDP program: tried {}. Install Debian's clang, llvm and \
             libbpf-dev (`apt-get install -y clang llvm libbpf-dev`) or set WEIR_CLANG",
            candidates.join(", ")
        ));
    };

    let mut cmd = Command::new(clang);
    cmd.args(["-target", "bpf", "-O2", "-g", "-Wall", "-Werror"]);
    // <linux/types.h> includes <asm/types.h>, which Debian keeps under the
    // multiarch directory; -target bpf does not search it by itself.
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let multiarch = format!("/usr/include/{arch}-linux-gnu");
    if std::path::Path::new(&multiarch).is_dir() {
        cmd.arg(format!("-I{multiarch}"));
    }
    cmd.arg("-c").arg(src).arg("-o").arg(&out);
    match spawn_retrying(|| cmd.status()) {
        Ok(status) if status.success() => {}
        Ok(status) => fail(&format!(
            "{clang} failed ({status}) compiling {src}; missing headers? \
             `apt-get install -y clang llvm libbpf-dev` provides <linux/bpf.h> and <bpf/bpf_helpers.h>"
        )),
        Err(e) => fail(&format!("cannot run {clang}: {e}")),
    }
}

/// Runs `f`, again after a pause when the process could not be started for
/// a reason other than a missing or forbidden program: under a loaded
/// machine (parallel builds and tests) a fork or exec can fail for a moment
/// (EAGAIN, ENOMEM, ETXTBSY), and a build that then went on without the
/// XDP program, or failed under `WEIR_REQUIRE_BPF`, was a flake.
fn spawn_retrying<T>(mut f: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    use std::io::ErrorKind::{NotFound, PermissionDenied};
    let mut tries = 0;
    loop {
        match f() {
            Err(e) if tries < 4 && !matches!(e.kind(), NotFound | PermissionDenied) => {
                tries += 1;
                println!("cargo::warning=weir-packet-io: starting the compiler: {e}; trying again");
                std::thread::sleep(std::time::Duration::from_millis(250 * tries));
            }
            r => return r,
        }
    }
}

/// A missing or failing compiler: an error under `WEIR_REQUIRE_BPF`, else a
/// warning and a build without the program (`cfg(weir_no_bpf)`).
fn fail(msg: &str) -> ! {
    let required = std::env::var_os("WEIR_REQUIRE_BPF").is_some_and(|v| v != "0" && !v.is_empty());
    if required {
        eprintln!("error: weir-packet-io: {msg}");
        println!("cargo::error={msg}");
        std::process::exit(1);
    }
    println!("cargo::warning=weir-packet-io: building without the XDP program: {msg}");
    println!("cargo::rustc-cfg=weir_no_bpf");
    let out =
        PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("steer.bpf.o");
    if let Err(e) = std::fs::write(&out, b"") {
        eprintln!("error: weir-packet-io: writing {}: {e}", out.display());
        std::process::exit(1);
    }
    std::process::exit(0);
}

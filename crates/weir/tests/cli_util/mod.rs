//! `weir` client commands run inside the test process: parsed as the
//! binary parses them, output captured.
#![allow(dead_code, unreachable_pub)]

use std::process::ExitCode;

use clap::Parser;

/// The client commands as the binary parses them.
#[derive(Parser)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: weir::cli::Command,
}

/// Run `weir ARGS --admin URL --token TOKEN`; (exit code, stdout, stderr).
pub fn run(url: &str, token: &str, args: &[&str]) -> (ExitCode, String, String) {
    let mut argv = vec!["weir"];
    argv.extend_from_slice(args);
    argv.extend_from_slice(&["--admin", url, "--token", token]);
    let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = weir::cli::run_with(cli.cmd, &mut out, &mut err);
    (
        code,
        String::from_utf8(out).unwrap(),
        String::from_utf8(err).unwrap(),
    )
}

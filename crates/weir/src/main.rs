//! The `weir` binary: daemon and CLI.

fn main() {
    println!("weir: not implemented yet");
    std::process::exit(1);
}

//! Config parsing and validation: any text gives a config or a list of
//! errors, never a panic, and an accepted config survives a round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weir::config;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // The value parsers a config, the API and the CLI share.
    let _ = config::parse_duration(text);
    let _ = config::parse_netmask(text);
    let _ = config::check_name(text);
    match config::parse(text, "fuzz.toml") {
        Ok(c) => {
            // parse() validated it; validate() agrees, and what the daemon
            // would write back (GET /v1/config) parses to the same config.
            assert!(
                config::validate(&c).is_empty(),
                "parse accepted an invalid config"
            );
            for s in &c.services {
                let _ = config::service_problems(s);
            }
            let written = toml::to_string(&c).expect("an accepted config serialises");
            let again = config::parse(&written, "rewritten.toml")
                .unwrap_or_else(|e| panic!("rewritten config refused: {e:?}\n{written}"));
            assert_eq!(again, c, "round trip changed the config");
        }
        Err(errors) => {
            assert!(!errors.is_empty(), "refused without an error");
            for e in &errors {
                let _ = e.to_string();
            }
        }
    }
});

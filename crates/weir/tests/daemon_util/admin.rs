//! A real daemon (`Daemon::start`) with its admin API bound on loopback,
//! and a client for that API.

use std::path::PathBuf;

use serde_json::Value;
use tokio_util::sync::CancellationToken;

use weir::cli::client::{CliError, Client};
use weir::config::{AdminConfig, Config};
use weir::daemon::{Daemon, DaemonHandle};

/// The admin token of every [`Running`] daemon.
pub const TOKEN: &str = "daemon-test-token";

/// A started daemon and its admin API; both stop when dropped.
pub struct Running {
    daemon: Option<DaemonHandle>,
    pub url: String,
    pub client: Client,
    stop: CancellationToken,
}

impl Running {
    /// Start `cfg` (read from `path`, if given, for reloads) with an admin
    /// API on 127.0.0.1 that takes [`TOKEN`].
    pub fn start(cfg: Config, path: Option<PathBuf>) -> Self {
        Self::start_admin_on(cfg, path, "127.0.0.1:0")
    }

    /// [`Self::start`] with the admin API on `listen`.
    pub fn start_admin_on(cfg: Config, path: Option<PathBuf>, listen: &str) -> Self {
        let daemon = Daemon::start(cfg, path).expect("daemon starts");
        let admin = AdminConfig {
            listen: listen.into(),
            token: Some(TOKEN.into()),
            ..AdminConfig::default()
        };
        let rt = daemon.runtime();
        let bound = rt
            .block_on(weir::admin::bind(&admin, daemon.control()))
            .expect("admin binds");
        let url = format!("http://{}", bound.local_addr().unwrap());
        let stop = CancellationToken::new();
        rt.spawn(bound.run(stop.clone()));
        Self {
            daemon: Some(daemon),
            client: Client::new(url.clone(), Some(TOKEN.into())),
            url,
            stop,
        }
    }

    pub fn d(&self) -> &DaemonHandle {
        self.daemon.as_ref().unwrap()
    }

    pub fn api(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, CliError> {
        self.client.send(method, path, body.as_ref())
    }

    pub fn ok(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.api(method, path, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// The HTTP status of a refused request (panics if it succeeded).
    pub fn status(&self, method: &str, path: &str, body: Option<Value>) -> (u16, String) {
        match self.api(method, path, body) {
            Err(CliError::Api {
                status, message, ..
            }) => (status, message),
            other => panic!("{method} {path}: expected a refusal, got {other:?}"),
        }
    }

    /// Stop the admin API, then the daemon.
    pub fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(d) = self.daemon.take() {
            d.shutdown();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(d) = self.daemon.take() {
            d.shutdown();
        }
    }
}

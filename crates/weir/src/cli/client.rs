//! The CLI's HTTP client and how it finds the admin API and its token.
//!
//! Order: `--admin URL` / `WEIR_ADMIN`, else `[admin] listen` of
//! `--config FILE`, else `127.0.0.1:9900`. Token: `--token` / `WEIR_TOKEN`,
//! else `[admin] token` or `token_file` of `--config FILE`, else the file the
//! daemon generates when no token is configured (see
//! [`crate::admin::auth::default_token_path`]).
//!
//! Transport: TCP addresses (`IP:PORT`, `http://HOST:PORT`) go through ureq;
//! `unix:/path` goes through the small HTTP/1.1 client in
//! [`super::unix_http`] (ureq has no unix-socket transport). Both sit behind
//! [`Client::call`], so the commands do not know which one they use.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;

use super::unix_http;

use crate::admin::auth::default_token_path;
use crate::config::AdminConfig;

/// Where the admin API is and which token to use.
#[derive(Debug, Clone, clap::Args)]
pub struct AdminArgs {
    /// Admin API address.
    #[arg(
        long = "admin",
        env = "WEIR_ADMIN",
        value_name = "URL",
        // clap prints `[env: WEIR_ADMIN=]` for an unset variable otherwise.
        hide_env_values = true,
        global = true,
        help = "Admin API address, e.g. http://127.0.0.1:9900 or unix:/run/weir/admin.sock (default: [admin] listen of --config, else 127.0.0.1:9900)"
    )]
    pub admin: Option<String>,
    /// Bearer token.
    #[arg(
        help = "Bearer token (default: [admin] token/token_file of --config, else the token file the daemon generated)",
        long = "token",
        env = "WEIR_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true,
        global = true
    )]
    pub token: Option<String>,
    /// Daemon config file to read the admin address and token from.
    #[arg(
        long = "config",
        value_name = "FILE",
        global = true,
        help = "Daemon config file to read [admin] listen, token and token_file from"
    )]
    pub config: Option<PathBuf>,
}

/// A failed CLI action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CliError {
    /// Could not talk to the daemon, or bad local input (exit code 2).
    Local(String),
    /// The daemon answered with an error (exit code 1).
    Api {
        /// HTTP status.
        status: u16,
        /// The daemon's message.
        message: String,
        /// Every error (reload).
        errors: Vec<String>,
    },
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Local(m) => write!(f, "weir: {m}"),
            CliError::Api {
                status,
                message,
                errors,
            } => {
                write!(f, "weir: the daemon refused ({status}): {message}")?;
                for e in errors {
                    write!(f, "\n  {e}")?;
                }
                match status {
                    401 => write!(
                        f,
                        "\nhint: pass --token TOKEN or set WEIR_TOKEN (see [admin] token or token_file), or --config FILE"
                    ),
                    403 => write!(
                        f,
                        "\nhint: this token may not do that (read-only or scoped to another tenant)"
                    ),
                    _ => Ok(()),
                }
            }
        }
    }
}

impl std::error::Error for CliError {}

/// Result of a CLI action.
pub type CliResult<T> = Result<T, CliError>;

/// Largest answer body accepted, in bytes.
const BODY_LIMIT: u64 = 1 << 30;
/// Per read/write timeout on the unix socket (ureq's global timeout on TCP).
const UNIX_IO_TIMEOUT: Duration = Duration::from_secs(60);

/// How requests reach the admin API.
#[derive(Debug)]
enum Transport {
    /// HTTP over TCP through ureq.
    Tcp(ureq::Agent),
    /// HTTP over the unix socket at this path, one connection per request.
    Unix(PathBuf),
}

/// A connection to the admin API.
#[derive(Debug)]
pub struct Client {
    transport: Transport,
    base: String,
    token: Option<String>,
}

impl Client {
    /// Resolve the address and token from flags, environment and config.
    pub fn from_args(args: &AdminArgs) -> CliResult<Self> {
        let file_cfg = match &args.config {
            Some(p) => Some(read_admin_config(p)?),
            None => None,
        };
        let listen = match (&args.admin, &file_cfg) {
            (Some(a), _) => a.clone(),
            (None, Some(c)) => c.listen.clone(),
            (None, None) => AdminConfig::default().listen,
        };
        let base = base_url(&listen)?;
        let token = match (&args.token, &file_cfg) {
            (Some(t), _) => Some(t.trim().to_owned()),
            (None, Some(c)) => Some(token_from_config(c)?),
            // Best effort: the token the daemon generated for this address.
            (None, None) => {
                let l = args.admin.as_deref().map_or(listen.as_str(), strip_scheme);
                std::fs::read_to_string(default_token_path(l))
                    .ok()
                    .map(|s| s.trim().to_owned())
            }
        };
        Ok(Self::new(base, token))
    }

    /// A client for `base` (e.g. "http://127.0.0.1:9900", or
    /// "unix:/run/weir/admin.sock" for a unix socket), as [`base_url`] returns.
    pub fn new(base: String, token: Option<String>) -> Self {
        if let Some(path) = base.strip_prefix("unix:") {
            let transport = Transport::Unix(PathBuf::from(path));
            return Self {
                transport,
                base,
                token,
            };
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(5)))
            .timeout_global(Some(Duration::from_secs(60)))
            // The admin API closes connections idle for 60 s; never reuse one
            // that old (`weir top --interval 120`).
            .max_idle_age(Duration::from_secs(30))
            .build()
            .into();
        Self {
            transport: Transport::Tcp(agent),
            base,
            token,
        }
    }

    /// The base URL in use.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Send a request; returns the body of a 2xx answer.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> CliResult<String> {
        let (status, text) = match &self.transport {
            Transport::Tcp(agent) => self.call_tcp(agent, method, path, body)?,
            Transport::Unix(sock) => self.call_unix(sock, method, path, body)?,
        };
        if (200..300).contains(&status) {
            return Ok(text);
        }
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let message = v
            .get("message")
            .and_then(|m| m.as_str())
            .map(str::to_owned)
            .unwrap_or_else(|| text.trim().to_owned());
        let errors = v
            .get("errors")
            .and_then(|e| e.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        Err(CliError::Api {
            status,
            message,
            errors,
        })
    }

    fn unreachable(&self, e: impl std::fmt::Display) -> CliError {
        CliError::Local(format!(
            "cannot reach the admin API at {}: {e}\nhint: is `weir run` running? pass --admin URL or set WEIR_ADMIN (or --config FILE)",
            self.base
        ))
    }

    /// One request over TCP (ureq): status and body.
    fn call_tcp(
        &self,
        agent: &ureq::Agent,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> CliResult<(u16, String)> {
        let url = format!("{}{}", self.base, path);
        let mut b = ureq::http::Request::builder().method(method).uri(&url);
        if let Some(t) = &self.token {
            b = b.header("Authorization", format!("Bearer {t}"));
        }
        let payload = match body {
            Some(v) => {
                b = b.header("Content-Type", "application/json");
                v.to_string()
            }
            None => String::new(),
        };
        let req = b
            .body(payload)
            .map_err(|e| CliError::Local(format!("cannot build a request to {url}: {e}")))?;
        let mut resp = agent.run(req).map_err(|e| self.unreachable(e))?;
        let status = resp.status().as_u16();
        let text = resp
            .body_mut()
            .with_config()
            .limit(BODY_LIMIT)
            .read_to_string()
            .map_err(|e| CliError::Local(format!("reading the answer from {url}: {e}")))?;
        Ok((status, text))
    }

    /// One request over the unix socket: status and body.
    fn call_unix(
        &self,
        sock: &Path,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> CliResult<(u16, String)> {
        let payload = body.map(|v| v.to_string());
        let req = unix_http::Request {
            method,
            target: path,
            token: self.token.as_deref(),
            json_body: payload.as_deref().map(str::as_bytes),
        };
        let resp = match unix_http::send(sock, &req, UNIX_IO_TIMEOUT, BODY_LIMIT) {
            Ok(r) => r,
            Err(e) if e.starts_with("connect:") => return Err(self.unreachable(e)),
            Err(e) => {
                return Err(CliError::Local(format!(
                    "{method} {path} over {}: {e}",
                    self.base
                )));
            }
        };
        let text = String::from_utf8(resp.body).map_err(|_| {
            CliError::Local(format!(
                "the answer to {method} {path} over {} is not UTF-8",
                self.base
            ))
        })?;
        Ok((resp.status, text))
    }

    /// GET and decode JSON.
    pub fn get<T: DeserializeOwned>(&self, path: &str) -> CliResult<T> {
        let text = self.call("GET", path, None)?;
        serde_json::from_str(&text).map_err(|e| {
            CliError::Local(format!(
                "unexpected answer to GET {path} (is the daemon the same weir version?): {e}"
            ))
        })
    }

    /// Send with a JSON body and decode the JSON answer.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> CliResult<serde_json::Value> {
        let text = self.call(method, path, body)?;
        Ok(serde_json::from_str(&text).unwrap_or(serde_json::Value::Null))
    }
}

fn strip_scheme(s: &str) -> &str {
    s.strip_prefix("http://").unwrap_or(s).trim_end_matches('/')
}

/// `IP:PORT` or `http://IP:PORT[/]` → `http://HOST:PORT`; wildcard listen
/// addresses are reached on loopback. `unix:/path` stays as it is.
pub fn base_url(listen: &str) -> CliResult<String> {
    let l = listen.trim();
    if let Some(path) = l.strip_prefix("unix:") {
        if path.is_empty() {
            return Err(CliError::Local(
                "admin address \"unix:\" names no socket; use unix:/path/to/admin.sock".into(),
            ));
        }
        return Ok(l.to_owned());
    }
    if l.starts_with("https://") {
        return Err(CliError::Local(
            "the admin API speaks plain HTTP; use http:// (tunnel it if it must cross a network)"
                .into(),
        ));
    }
    let hostport = strip_scheme(l);
    if hostport.is_empty() || hostport.contains('/') {
        return Err(CliError::Local(format!(
            "admin address {listen:?} is not IP:PORT or http://HOST:PORT"
        )));
    }
    let hostport = if let Some(port) = hostport.strip_prefix("0.0.0.0:") {
        format!("127.0.0.1:{port}")
    } else if let Some(port) = hostport.strip_prefix("[::]:") {
        format!("[::1]:{port}")
    } else {
        hostport.to_owned()
    };
    Ok(format!("http://{hostport}"))
}

/// `[admin]` of a config file (the rest of the file is not validated here).
pub fn read_admin_config(path: &Path) -> CliResult<AdminConfig> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::Local(format!("cannot read config {}: {e}", path.display())))?;
    let v: toml::Table = toml::from_str(&text)
        .map_err(|e| CliError::Local(format!("{} is not valid TOML: {e}", path.display())))?;
    match v.get("admin") {
        None => Ok(AdminConfig::default()),
        Some(a) => a
            .clone()
            .try_into()
            .map_err(|e| CliError::Local(format!("[admin] in {} is invalid: {e}", path.display()))),
    }
}

fn token_from_config(c: &AdminConfig) -> CliResult<String> {
    if let Some(t) = c.token.as_deref().filter(|t| !t.trim().is_empty()) {
        return Ok(t.trim().to_owned());
    }
    let path = c
        .token_file
        .clone()
        .unwrap_or_else(|| default_token_path(&c.listen));
    std::fs::read_to_string(&path)
        .map(|s| s.trim().to_owned())
        .map_err(|e| {
            CliError::Local(format!(
                "cannot read the admin token from {}: {e}\nhint: pass --token or set WEIR_TOKEN",
                path.display()
            ))
        })
}

/// Percent-encode one path segment (names, addresses such as `[::1]:80`).
pub fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b':') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls() {
        assert_eq!(
            base_url("127.0.0.1:9900").as_deref(),
            Ok("http://127.0.0.1:9900")
        );
        assert_eq!(base_url("http://h:1/").as_deref(), Ok("http://h:1"));
        assert_eq!(base_url("0.0.0.0:9").as_deref(), Ok("http://127.0.0.1:9"));
        assert_eq!(base_url("[::]:9").as_deref(), Ok("http://[::1]:9"));
        assert_eq!(base_url(" unix:/x/a.sock").as_deref(), Ok("unix:/x/a.sock"));
        assert!(base_url("unix:").is_err());
        assert!(base_url("https://x:1").is_err());
        assert!(base_url("http://x:1/v1").is_err());
    }

    #[test]
    fn segments_are_encoded() {
        assert_eq!(seg("[::1]:80"), "%5B::1%5D:80");
        assert_eq!(seg("a b/c"), "a%20b%2Fc");
    }
}

//! The CLI's HTTP client and how it finds the admin API and its token.
//!
//! Order: `--admin URL` / `WEIR_ADMIN`, else `[admin] listen` of
//! `--config FILE`, else `127.0.0.1:9900`. Token: `--token` / `WEIR_TOKEN`,
//! else `[admin] token` or `token_file` of `--config FILE`, else the file the
//! daemon generates when no token is configured (see
//! [`crate::admin::auth::default_token_path`]).
//!
//! Transport: one HTTP/1.1 client (hyper's) over a TCP stream
//! (`IP:PORT`, `http://HOST:PORT`), a TLS stream over TCP (`https://HOST:PORT`,
//! verified against `--cacert` / `WEIR_CACERT`, else `[admin] tls_cert` of
//! `--config`, else the system's CA bundle), or a unix stream
//! (`unix:/path`). One connection per request, on a small current-thread
//! runtime, so the commands stay synchronous and do not know which
//! transport they use.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncWrite};

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
    /// CA certificate(s) to verify an https:// admin API with.
    #[arg(
        long = "cacert",
        env = "WEIR_CACERT",
        value_name = "FILE",
        global = true,
        help = "PEM CA certificate(s) that signed the admin API's TLS certificate (for a self-signed one, the certificate itself) (default: [admin] tls_cert of --config, else the system's CA bundle)"
    )]
    pub cacert: Option<PathBuf>,
}

/// A failed CLI action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CliError {
    /// Could not talk to the daemon, or bad local input (exit code 2).
    Local(String),
    /// The request was sent and no answer came within the time allowed
    /// (exit code 3): what it asked may or may not be done, or still be
    /// under way.
    NoAnswer(String),
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
            CliError::Local(m) | CliError::NoAnswer(m) => write!(f, "weir: {m}"),
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
const BODY_LIMIT: usize = 1 << 30;
/// Bound on connecting (and the TLS handshake).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on a request once the connection is open, answer included (see
/// [`Client::with_timeout`]).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Where the system's CA bundle lives (Debian/Ubuntu, Fedora/RHEL, others).
const SYSTEM_CA_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

/// How requests reach the admin API.
#[derive(Debug, Clone)]
enum Transport {
    /// HTTP over TCP to `HOST:PORT`.
    Tcp(String),
    /// HTTPS to `HOST:PORT`, verified with these roots.
    Tls {
        hostport: String,
        name: ServerName<'static>,
        config: Arc<rustls::ClientConfig>,
    },
    /// HTTP over the unix socket at this path.
    Unix(PathBuf),
}

/// A connection to the admin API.
#[derive(Debug)]
pub struct Client {
    transport: Result<Transport, String>,
    base: String,
    token: Option<String>,
    /// Bound on a request once connected ([`REQUEST_TIMEOUT`] unless set).
    timeout: Duration,
}

/// Any stream the client speaks HTTP over.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

impl Client {
    /// Resolve the address, token and CA certificates from flags,
    /// environment and config.
    pub fn from_args(args: &AdminArgs) -> CliResult<Self> {
        let file_cfg = match &args.config {
            Some(p) => Some(read_admin_config(p)?),
            None => None,
        };
        let listen = match (&args.admin, &file_cfg) {
            (Some(a), _) => a.clone(),
            (None, Some(c)) if c.tls_cert.is_some() && !c.listen.starts_with("unix:") => {
                format!("https://{}", c.listen)
            }
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
        let cacert = args
            .cacert
            .clone()
            .or_else(|| file_cfg.as_ref().and_then(|c| c.tls_cert.clone()));
        Self::with_cacert(base, token, cacert.as_deref())
    }

    /// A client for `base` (e.g. "http://127.0.0.1:9900", or
    /// "unix:/run/weir/admin.sock" for a unix socket), as [`base_url`] returns.
    /// An https:// base is verified against the system's CA bundle; see
    /// [`Client::with_cacert`] for others. A base that cannot be used makes
    /// every call fail with the reason.
    pub fn new(base: String, token: Option<String>) -> Self {
        let transport = transport(&base, None);
        Self {
            transport,
            base,
            token,
            timeout: REQUEST_TIMEOUT,
        }
    }

    /// Like [`Client::new`], verifying an https:// base against the PEM
    /// certificates in `cacert` (if given) instead of the system's.
    pub fn with_cacert(
        base: String,
        token: Option<String>,
        cacert: Option<&Path>,
    ) -> CliResult<Self> {
        let transport = Ok(transport(&base, cacert).map_err(CliError::Local)?);
        Ok(Self {
            transport,
            base,
            token,
            timeout: REQUEST_TIMEOUT,
        })
    }

    /// This client, waiting up to `timeout` for each answer once the
    /// request is sent (connecting is bounded apart, by 5 s); past it a
    /// call fails with [`CliError::NoAnswer`].
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
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
        let transport = self
            .transport
            .as_ref()
            .map_err(|e| CliError::Local(e.clone()))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| CliError::Local(format!("cannot start the HTTP client: {e}")))?;
        let (status, text) = rt.block_on(self.exchange(transport, method, path, body))?;
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

    /// Open a stream to the admin API (TLS handshake included).
    async fn connect(&self, transport: &Transport) -> CliResult<Box<dyn Stream>> {
        let within = |what: &'static str| {
            move |_| self.unreachable(format!("{what} did not finish within {CONNECT_TIMEOUT:?}"))
        };
        match transport {
            Transport::Unix(path) => {
                let s =
                    tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::UnixStream::connect(path))
                        .await
                        .map_err(within("connecting"))?
                        .map_err(|e| self.unreachable(format!("connect: {e}")))?;
                Ok(Box::new(s))
            }
            Transport::Tcp(hostport) => {
                let s = tokio::time::timeout(CONNECT_TIMEOUT, tcp_connect(hostport))
                    .await
                    .map_err(within("connecting"))?
                    .map_err(|e| self.unreachable(e))?;
                Ok(Box::new(s))
            }
            Transport::Tls {
                hostport,
                name,
                config,
            } => {
                let s = tokio::time::timeout(CONNECT_TIMEOUT, tcp_connect(hostport))
                    .await
                    .map_err(within("connecting"))?
                    .map_err(|e| self.unreachable(e))?;
                let tls = tokio_rustls::TlsConnector::from(config.clone());
                let s = tokio::time::timeout(CONNECT_TIMEOUT, tls.connect(name.clone(), s))
                    .await
                    .map_err(within("the TLS handshake"))?
                    .map_err(|e| self.tls_failed(&e))?;
                Ok(Box::new(s))
            }
        }
    }

    /// A TLS handshake failure, with what to do about it.
    fn tls_failed(&self, e: &std::io::Error) -> CliError {
        let hint = match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
            Some(rustls::Error::InvalidCertificate(c)) => match c {
                rustls::CertificateError::UnknownIssuer
                | rustls::CertificateError::BadSignature => {
                    "the daemon's certificate is not signed by a CA this client trusts: pass --cacert FILE \
                     (or set WEIR_CACERT) with the CA certificate that signed it; for a self-signed \
                     certificate, the certificate itself ([admin] tls_cert)"
                }
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. } => {
                    "the daemon's certificate does not name the host in --admin: use a host or IP \
                     address its subjectAltName lists, or make a certificate that lists this one"
                }
                rustls::CertificateError::Expired
                | rustls::CertificateError::ExpiredContext { .. } => {
                    "the daemon's certificate has expired: renew [admin] tls_cert and restart the daemon"
                }
                rustls::CertificateError::Other(o)
                    if format!("{o:?}").contains("CaUsedAsEndEntity") =>
                {
                    "the daemon's certificate is marked as a CA (basicConstraints CA:TRUE), which \
                     is refused as a server certificate: make it with \
                     -addext \"basicConstraints=critical,CA:FALSE\" (see docs/admin.md)"
                }
                _ => "the daemon's certificate was refused",
            },
            Some(rustls::Error::InvalidMessage(_)) => {
                "the server did not answer in TLS: if the admin API speaks plain HTTP, use http://"
            }
            _ => "the TLS handshake failed",
        };
        CliError::Local(format!(
            "TLS with the admin API at {} failed: {e}\nhint: {hint}",
            self.base
        ))
    }

    /// One request on a new connection: status and body.
    async fn exchange(
        &self,
        transport: &Transport,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> CliResult<(u16, String)> {
        let what = || format!("{method} {path} to {}", self.base);
        let stream = self.connect(transport).await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| CliError::Local(format!("{}: {e}", what())))?;
        // Drives the connection; ends with it (or with the runtime).
        tokio::spawn(conn);
        let host = match transport {
            Transport::Tcp(h) | Transport::Tls { hostport: h, .. } => h.as_str(),
            Transport::Unix(_) => "localhost",
        };
        let mut b = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .header(axum::http::header::HOST, host);
        if let Some(t) = &self.token {
            b = b.header(axum::http::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let payload = match body {
            Some(v) => {
                b = b.header(axum::http::header::CONTENT_TYPE, "application/json");
                Body::from(v.to_string())
            }
            None => Body::empty(),
        };
        let req = b
            .body(payload)
            .map_err(|e| CliError::Local(format!("cannot build {}: {e}", what())))?;
        // From here the daemon may act on the request: a timeout is no
        // answer, not a failure.
        tokio::time::timeout(
            self.timeout,
            self.answer(&mut sender, transport, req, &what),
        )
        .await
        .unwrap_or_else(|_| {
            Err(CliError::NoAnswer(format!(
                "{}: no answer within {}",
                what(),
                humantime::format_duration(self.timeout)
            )))
        })
    }

    /// Sends `req` and reads the answer: status and body.
    async fn answer(
        &self,
        sender: &mut hyper::client::conn::http1::SendRequest<Body>,
        transport: &Transport,
        req: axum::http::Request<Body>,
        what: &dyn Fn() -> String,
    ) -> CliResult<(u16, String)> {
        let resp = sender.send_request(req).await.map_err(|e| {
            let hint = if matches!(transport, Transport::Tcp(_)) {
                "\nhint: if the daemon serves TLS ([admin] tls_cert), use https:// and --cacert FILE"
            } else {
                ""
            };
            CliError::Local(format!("{}: {e}{hint}", what()))
        })?;
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(Body::new(resp.into_body()), BODY_LIMIT)
            .await
            .map_err(|e| CliError::Local(format!("reading the answer to {}: {e}", what())))?;
        let text = String::from_utf8(bytes.to_vec())
            .map_err(|_| CliError::Local(format!("the answer to {} is not UTF-8", what())))?;
        Ok((status, text))
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
        // No body (204): nothing to report. A body that is not JSON is not
        // an answer from weir: reading it as "nothing" printed e.g.
        // "killed 0 connections" and exit 0 whatever had happened.
        if text.trim().is_empty() {
            return Ok(serde_json::Value::Null);
        }
        serde_json::from_str(&text).map_err(|e| {
            CliError::Local(format!(
                "unexpected answer to {method} {path} (is the daemon the same weir version?): {e}"
            ))
        })
    }
}

async fn tcp_connect(hostport: &str) -> std::io::Result<tokio::net::TcpStream> {
    let s = tokio::net::TcpStream::connect(hostport).await?;
    // Requests are small and answered at once.
    let _ = s.set_nodelay(true);
    Ok(s)
}

/// How to reach `base` (as [`base_url`] returns it).
fn transport(base: &str, cacert: Option<&Path>) -> Result<Transport, String> {
    if let Some(path) = base.strip_prefix("unix:") {
        return Ok(Transport::Unix(PathBuf::from(path)));
    }
    if let Some(hostport) = base.strip_prefix("http://") {
        return Ok(Transport::Tcp(hostport.to_owned()));
    }
    let Some(hostport) = base.strip_prefix("https://") else {
        return Err(format!(
            "admin address {base:?} is not http://, https:// or unix:"
        ));
    };
    let host = match hostport.rsplit_once(':') {
        Some((h, p)) if p.parse::<u16>().is_ok() => h,
        _ => hostport,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let name = ServerName::try_from(host.to_owned()).map_err(|e| {
        format!("admin address {base:?}: {host:?} is not a host name or IP address: {e}")
    })?;
    let mut roots = rustls::RootCertStore::empty();
    let certs = match cacert {
        Some(p) => crate::admin::tls::read_certs(p, "--cacert").map_err(|e| format!("{e:#}"))?,
        None => {
            // The system's bundle, for certificates from a public or
            // company CA; none at all leaves nothing trusted, and the
            // handshake error says to pass --cacert.
            SYSTEM_CA_BUNDLES
                .iter()
                .map(Path::new)
                .find(|p| p.exists())
                .and_then(|p| crate::admin::tls::read_certs(p, "CA bundle").ok())
                .unwrap_or_default()
        }
    };
    let (_, unusable) = roots.add_parsable_certificates(certs);
    if let Some(p) = cacert
        && roots.is_empty()
    {
        return Err(format!(
            "--cacert {}: none of its {unusable} certificate(s) can be used as a trust anchor",
            p.display()
        ));
    }
    let config = rustls::ClientConfig::builder_with_provider(crate::admin::tls::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS protocol versions: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Transport::Tls {
        hostport: hostport.to_owned(),
        name,
        config: Arc::new(config),
    })
}

fn strip_scheme(s: &str) -> &str {
    s.strip_prefix("http://")
        .or_else(|| s.strip_prefix("https://"))
        .unwrap_or(s)
        .trim_end_matches('/')
}

/// `IP:PORT` or `http[s]://IP:PORT[/]` → `http[s]://HOST:PORT`; wildcard
/// listen addresses are reached on loopback. `unix:/path` stays as it is.
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
    let scheme = if l.starts_with("https://") {
        "https"
    } else {
        "http"
    };
    let hostport = strip_scheme(l);
    if hostport.is_empty() || hostport.contains('/') {
        return Err(CliError::Local(format!(
            "admin address {listen:?} is not IP:PORT, http://HOST:PORT or https://HOST:PORT"
        )));
    }
    let hostport = if let Some(port) = hostport.strip_prefix("0.0.0.0:") {
        format!("127.0.0.1:{port}")
    } else if let Some(port) = hostport.strip_prefix("[::]:") {
        format!("[::1]:{port}")
    } else {
        hostport.to_owned()
    };
    Ok(format!("{scheme}://{hostport}"))
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
        assert_eq!(base_url("https://x:1/").as_deref(), Ok("https://x:1"));
        assert_eq!(
            base_url("https://0.0.0.0:9").as_deref(),
            Ok("https://127.0.0.1:9")
        );
        assert!(base_url("http://x:1/v1").is_err());
    }

    #[test]
    fn segments_are_encoded() {
        assert_eq!(seg("[::1]:80"), "%5B::1%5D:80");
        assert_eq!(seg("a b/c"), "a%20b%2Fc");
    }
}

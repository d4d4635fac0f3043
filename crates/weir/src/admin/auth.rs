//! Bearer tokens: where the full-access token comes from, who a request is,
//! and constant-time comparison.
//!
//! Three kinds of token, checked in this order:
//! 1. the full-access token (`[admin] token`, or the contents of
//!    `token_file`, or one generated on first start, see [`resolve_full_token`]);
//! 2. the read-only token (`[admin] readonly_token`): GET only;
//! 3. tenant tokens (`token` inside a `[[tenant]]`), read from the running
//!    configuration on each request so that tenants added at runtime or by a
//!    reload are honoured at once: they see and change only their tenant.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::config::AdminConfig;
use crate::control::Control;

/// Who a request is, once its token has been checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// The full-access token: everything.
    Full,
    /// The read-only token: every GET, nothing else.
    ReadOnly,
    /// A tenant token: only this tenant's resources, reads and writes.
    Tenant(String),
}

impl Access {
    /// True if this access may see or change `tenant`'s resources.
    pub fn may_touch(&self, tenant: &str) -> bool {
        match self {
            Access::Full | Access::ReadOnly => true,
            Access::Tenant(own) => own == tenant,
        }
    }

    /// The tenant a tenant-scoped token is bound to.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Access::Tenant(t) => Some(t),
            _ => None,
        }
    }
}

/// The static tokens of the admin API (tenant tokens are looked up live).
#[derive(Clone)]
pub struct Tokens {
    full: String,
    readonly: Option<String>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print secrets, not even in debug logs.
        f.debug_struct("Tokens")
            .field("full", &"<redacted>")
            .field("readonly", &self.readonly.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl Tokens {
    /// Tokens from explicit values (tests, embedding).
    pub fn new(full: impl Into<String>, readonly: Option<String>) -> Self {
        Self {
            full: full.into(),
            readonly: readonly.filter(|t| !t.is_empty()),
        }
    }

    /// Who presents `presented`, or `None` if it is no valid token.
    pub fn identify(&self, presented: &str, control: &dyn Control) -> Option<Access> {
        if presented.is_empty() {
            return None;
        }
        if ct_eq(presented.as_bytes(), self.full.as_bytes()) {
            return Some(Access::Full);
        }
        if let Some(ro) = &self.readonly
            && ct_eq(presented.as_bytes(), ro.as_bytes())
        {
            return Some(Access::ReadOnly);
        }
        // Tenant tokens live in the running config; compare against every
        // one so the time taken does not reveal which tenant matched.
        let mut found = None;
        for t in control.running_config().tenants {
            if let Some(tok) = &t.token
                && !tok.is_empty()
                && ct_eq(presented.as_bytes(), tok.as_bytes())
                && found.is_none()
            {
                found = Some(Access::Tenant(t.name.clone()));
            }
        }
        found
    }
}

/// Constant-time equality: the time taken depends only on the lengths.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    let n = a.len().max(b.len());
    for i in 0..n {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0xff);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// Extract the token of an `Authorization: Bearer <token>` header value.
pub fn bearer(value: &str) -> Option<&str> {
    let (scheme, rest) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| rest.trim())
        .filter(|t| !t.is_empty())
}

/// Where a generated token goes when `[admin]` names neither `token` nor
/// `token_file`. The CLI looks in the same place, so on one machine
/// `weir list` works with no flags after `weir run` generated a token.
///
/// `$XDG_RUNTIME_DIR/weir/`, else `$HOME/.weir/`, else `<tmp>/weir/`; the
/// file name carries the listen address so two daemons do not collide.
pub fn default_token_path(listen: &str) -> PathBuf {
    let dir = std::env::var_os("XDG_RUNTIME_DIR")
        .filter(|d| !d.is_empty())
        .map(|d| PathBuf::from(d).join("weir"))
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|d| !d.is_empty())
                .map(|h| PathBuf::from(h).join(".weir"))
        })
        .unwrap_or_else(|| std::env::temp_dir().join("weir"));
    let safe: String = listen
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    dir.join(format!("admin-{safe}.token"))
}

/// The full-access token, in order: `token`; the contents of `token_file`
/// (generated into it if the file does not exist); the contents of
/// [`default_token_path`] (generated if missing). Returns the token and,
/// when one was generated, the file it was written to (mode 0600).
pub fn resolve_full_token(cfg: &AdminConfig) -> anyhow::Result<(String, Option<PathBuf>)> {
    if let Some(t) = cfg.token.as_deref().filter(|t| !t.trim().is_empty()) {
        return Ok((t.trim().to_owned(), None));
    }
    let path = cfg
        .token_file
        .clone()
        .unwrap_or_else(|| default_token_path(&cfg.listen));
    match std::fs::read_to_string(&path) {
        Ok(s) => {
            let t = s.trim();
            anyhow::ensure!(
                !t.is_empty(),
                "admin token file {} is empty: put a token in it or delete it to have one generated",
                path.display()
            );
            Ok((t.to_owned(), None))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let t = generate_token();
            write_secret(&path, &t)?;
            Ok((t, Some(path)))
        }
        Err(e) => Err(e).with_context(|| format!("reading admin token file {}", path.display())),
    }
}

/// 256 random bits, hex.
pub fn generate_token() -> String {
    let bytes: [u8; 32] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn write_secret(path: &Path, token: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating directory {} for the admin token", dir.display()))?;
    }
    // create_new: never follow a planted file or symlink.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating admin token file {}", path.display()))?;
    writeln!(f, "{token}").with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ct_eq_matches_eq() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"abcd"));
        assert!(!ct_eq(b"", b"a"));
        assert!(ct_eq(b"", b""));
        // A prefix padded with the filler byte must not compare equal.
        assert!(!ct_eq(b"ab", b"ab\xff"));
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer   abc "), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer "), None);
        assert_eq!(bearer("Bearer"), None);
    }

    #[test]
    fn token_file_is_generated_once_with_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = AdminConfig {
            token_file: Some(dir.join("sub").join("tok")),
            ..AdminConfig::default()
        };
        let (t1, gen1) = resolve_full_token(&cfg).expect("generate");
        assert_eq!(t1.len(), 64);
        let path = gen1.expect("generated on first start");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let (t2, gen2) = resolve_full_token(&cfg).expect("reuse");
        assert_eq!(t1, t2);
        assert!(gen2.is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

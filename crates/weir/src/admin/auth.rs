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

    /// "the full-access token" or "the read-only token" if `token` is one
    /// of them (to refuse a tenant token that would shadow it).
    pub fn role_of(&self, token: &str) -> Option<&'static str> {
        if ct_eq(token.as_bytes(), self.full.as_bytes()) {
            Some("the full-access token")
        } else if self
            .readonly
            .as_ref()
            .is_some_and(|ro| ct_eq(token.as_bytes(), ro.as_bytes()))
        {
            Some("the read-only token")
        } else {
            None
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
        // Two tenants with one token (validation refuses that, so only a
        // race of two edits could make it) match nobody rather than the
        // first in some order.
        let mut found = None;
        let mut matches = 0u32;
        control.for_each_tenant_token(&mut |tenant, tok| {
            if !tok.is_empty() && ct_eq(presented.as_bytes(), tok.as_bytes()) {
                matches += 1;
                found = Some(Access::Tenant(tenant.to_string()));
            }
        });
        if matches > 1 {
            tracing::warn!(
                matches,
                "a token presented to the admin API belongs to several tenants: refused"
            );
            return None;
        }
        found
    }
}

/// Constant-time equality (`subtle`): the time taken depends only on the
/// lengths, never on where the first difference is.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    bool::from(a.ct_eq(b))
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
    match read_token_file(&path)? {
        Some(t) => Ok((t, None)),
        None => {
            let t = generate_token();
            write_secret(&path, &t)?;
            Ok((t, Some(path)))
        }
    }
}

/// What `weir check` can tell about the full-access token without starting:
/// the token file (configured, or the default path when no token is set)
/// must, if it exists, pass [`read_token_file`]'s rules.
pub fn check_token_source(cfg: &AdminConfig) -> anyhow::Result<()> {
    if cfg.token.as_deref().is_some_and(|t| !t.trim().is_empty()) {
        return Ok(());
    }
    let path = cfg
        .token_file
        .clone()
        .unwrap_or_else(|| default_token_path(&cfg.listen));
    read_token_file(&path).map(drop)
}

/// The token in `path`, `None` if the file does not exist (its directory,
/// if it exists, must still be safe to create it in).
///
/// The rules ssh applies to private keys, because a token file can come
/// from a shared directory such as `$TMPDIR/weir`: the file and its
/// directory must belong to this user or root; the directory must not be
/// writable by group or others unless sticky (like `/tmp`); the file must
/// be a regular file no one else can read or write, and not empty. Each
/// refusal says why and what to do.
pub fn read_token_file(path: &Path) -> anyhow::Result<Option<String>> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let me = rustix::process::geteuid().as_raw();
    let owned_ok = |uid: u32| uid == me || uid == 0;
    let shown = path.display();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        match std::fs::metadata(dir) {
            Ok(m) => {
                anyhow::ensure!(
                    m.is_dir(),
                    "admin token directory {} is not a directory",
                    dir.display()
                );
                anyhow::ensure!(
                    owned_ok(m.uid()),
                    "admin token directory {} belongs to uid {}, not to this user (uid {me}) or root: \
                     another user could have planted or can swap the token; remove it or set [admin] token_file elsewhere",
                    dir.display(),
                    m.uid()
                );
                let mode = m.permissions().mode();
                anyhow::ensure!(
                    mode & 0o022 == 0 || mode & 0o1000 != 0,
                    "admin token directory {} is writable by group or others (mode {:04o}): \
                     they could swap the token; chmod 700 it",
                    dir.display(),
                    mode & 0o7777
                );
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(e).with_context(|| format!("admin token directory {}", dir.display()));
            }
        }
    }
    let m = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("admin token file {shown}")),
    };
    anyhow::ensure!(
        m.is_file(),
        "admin token file {shown} is not a regular file (a directory?): put the token in a file, or delete it to have one generated"
    );
    anyhow::ensure!(
        owned_ok(m.uid()),
        "admin token file {shown} belongs to uid {}, not to this user (uid {me}) or root: \
         another user could have planted it; delete it to have a token generated",
        m.uid()
    );
    let mode = m.permissions().mode();
    anyhow::ensure!(
        mode & 0o077 == 0,
        "admin token file {shown} is open to group or others (mode {:04o}): \
         they could read or change the full-access token; chmod 600 it",
        mode & 0o7777
    );
    let s = std::fs::read_to_string(path)
        .with_context(|| format!("reading admin token file {shown}"))?;
    let t = s.trim();
    anyhow::ensure!(
        !t.is_empty(),
        "admin token file {shown} is empty: put a token in it or delete it to have one generated"
    );
    Ok(Some(t.to_owned()))
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

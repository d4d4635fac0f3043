//! The web dashboard under `/ui/`: three static files embedded in the binary.
//!
//! # Contracts
//! * The files hold no data, so they are served without a token; every
//!   figure the page shows comes from the `/v1/` API, called by the page
//!   with the token the user gave (the same scopes apply: a read-only token
//!   gets no write buttons, a tenant token sees only its tenant).
//! * Every `/ui/` answer carries a strict Content-Security-Policy: scripts,
//!   styles and fetches from this origin only, no inline script or style,
//!   no frames, no plugins, no form posts elsewhere; and `Referrer-Policy:
//!   no-referrer`, since `/ui/?token=T` puts a token in the address until
//!   the page removes it.
//! * Nothing is fetched from outside: no CDN, no fonts.

use axum::Router;
use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;

/// The policy every `/ui/` answer carries.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'self'; \
     frame-ancestors 'none'";

const INDEX: &str = include_str!("ui/index.html");
const APP_JS: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/style.css");

/// The dashboard's routes (unauthenticated; merged outside the API's
/// authentication layer).
pub(crate) fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route("/ui/", get(|| async { asset("index.html") }))
        .route(
            "/ui/{file}",
            get(|Path(file): Path<String>| async move { asset(&file) }),
        )
}

fn asset(name: &str) -> Response {
    let (ctype, body) = match name {
        "index.html" => ("text/html; charset=utf-8", INDEX),
        "app.js" => ("text/javascript; charset=utf-8", APP_JS),
        "style.css" => ("text/css; charset=utf-8", STYLE),
        _ => {
            return with_headers(
                (StatusCode::NOT_FOUND, "no such file in the dashboard\n").into_response(),
                "text/plain; charset=utf-8",
            );
        }
    };
    with_headers(body.into_response(), ctype)
}

fn with_headers(mut r: Response, ctype: &'static str) -> Response {
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // A new binary may ship new files: never serve a stale page.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assets_are_small_and_self_contained() {
        let total = INDEX.len() + APP_JS.len() + STYLE.len();
        assert!(total < 64 * 1024, "dashboard assets grew to {total} bytes");
        for (name, text) in [
            ("index.html", INDEX),
            ("app.js", APP_JS),
            ("style.css", STYLE),
        ] {
            // No third-party origin: the CSP would block it anyway. (The SVG
            // namespace is a name, not something fetched.)
            let text = text.replace("http://www.w3.org/2000/svg", "");
            assert!(!text.contains("http://"), "{name} names an http:// URL");
            assert!(!text.contains("https://"), "{name} names an https:// URL");
        }
        // The CSP forbids inline script and style: the page must not need them.
        assert!(!INDEX.contains("<script>"), "inline script in index.html");
        assert!(!INDEX.contains("style="), "inline style in index.html");
        assert!(!INDEX.contains("<style"), "inline style in index.html");
    }
}

//! A minimal HTTP/1.1 client over a unix stream socket, for an admin API
//! that listens on `unix:/path` (ureq speaks only TCP).
//!
//! One request per connection: the request carries `Connection: close`, so
//! the answer's body ends at its `Content-Length`, at the end of its chunked
//! encoding, or (neither given) at EOF. Everything the peer sends is
//! bounded: the status line and each header line ([`MAX_LINE`]), the number
//! of headers ([`MAX_HEADERS`]), and the body (the caller's limit). Every
//! read and write has a timeout. Anything malformed (no status line, a bad
//! status code, a non-numeric or conflicting `Content-Length`, a bad chunk
//! size, a body cut short) is an error naming what was wrong; the parser
//! never panics on input.
//!
//! The parser ([`read_response`]) works on any [`BufRead`] so it is tested
//! without sockets.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Longest status or header line accepted, in bytes (CRLF included).
pub const MAX_LINE: u64 = 16 * 1024;
/// Most header lines accepted in one answer (or trailer section).
pub const MAX_HEADERS: usize = 128;

/// An HTTP answer: status code and the whole body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code (100..=999).
    pub status: u16,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

/// What to send.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// Method, e.g. "GET".
    pub method: &'a str,
    /// Origin-form target, e.g. "/v1/services?tenant=acme".
    pub target: &'a str,
    /// `Authorization: Bearer` token, if any.
    pub token: Option<&'a str>,
    /// JSON body, if any (sent with `Content-Type: application/json`).
    pub json_body: Option<&'a [u8]>,
}

/// Connect to `socket`, send `req`, read the whole answer.
///
/// `timeout` bounds each read and write (not the whole exchange); `limit`
/// bounds the body.
pub fn send(
    socket: &Path,
    req: &Request<'_>,
    timeout: Duration,
    limit: u64,
) -> Result<Response, String> {
    let stream = UnixStream::connect(socket).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| format!("setting socket timeouts: {e}"))?;
    let head = encode_head(req)?;
    let mut w = &stream;
    w.write_all(&head)
        .and_then(|()| match req.json_body {
            Some(b) => w.write_all(b),
            None => Ok(()),
        })
        .and_then(|()| w.flush())
        .map_err(|e| format!("sending the request: {}", io_msg(&e)))?;
    read_response(BufReader::new(&stream), limit)
}

/// The request line and headers, ending with the blank line.
pub fn encode_head(req: &Request<'_>) -> Result<Vec<u8>, String> {
    let bad = |s: &str| s.bytes().any(|b| b.is_ascii_control() || b == b' ');
    if req.method.is_empty() || bad(req.method) {
        return Err(format!("invalid method {:?}", req.method));
    }
    if !req.target.starts_with('/') || bad(req.target) {
        return Err(format!("invalid request target {:?}", req.target));
    }
    let mut h = format!(
        "{} {} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nAccept: application/json\r\n",
        req.method, req.target
    );
    if let Some(t) = req.token {
        if t.bytes().any(|b| b.is_ascii_control()) {
            return Err("the token contains control characters".into());
        }
        h.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    match req.json_body {
        Some(b) => h.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        )),
        None if !matches!(req.method, "GET" | "HEAD") => h.push_str("Content-Length: 0\r\n"),
        None => {}
    }
    h.push_str("\r\n");
    Ok(h.into_bytes())
}

fn io_msg(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => "timed out".into(),
        _ => e.to_string(),
    }
}

/// One line without its line ending; `None` at EOF before any byte.
fn read_line<R: BufRead>(r: &mut R, what: &str) -> Result<Option<String>, String> {
    let mut buf = Vec::new();
    let n = r
        .by_ref()
        .take(MAX_LINE)
        .read_until(b'\n', &mut buf)
        .map_err(|e| format!("reading the {what}: {}", io_msg(&e)))?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') {
        return Err(if n as u64 >= MAX_LINE {
            format!("the {what} is longer than {MAX_LINE} bytes")
        } else {
            format!("the answer ended in the middle of the {what}")
        });
    }
    buf.pop();
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    String::from_utf8(buf)
        .map(Some)
        .map_err(|_| format!("the {what} is not valid UTF-8"))
}

/// `HTTP/1.x NNN reason` → NNN.
fn parse_status_line(line: &str) -> Result<u16, String> {
    let rest = line
        .strip_prefix("HTTP/1.1 ")
        .or_else(|| line.strip_prefix("HTTP/1.0 "))
        .ok_or_else(|| format!("not an HTTP/1.x status line: {:?}", truncate(line)))?;
    let code = rest.get(..3).unwrap_or(rest);
    let after = rest.get(3..).unwrap_or("");
    if code.len() != 3
        || !code.bytes().all(|b| b.is_ascii_digit())
        || !(after.is_empty() || after.starts_with(' '))
    {
        return Err(format!("bad status code in {:?}", truncate(line)));
    }
    let status: u16 = code
        .parse()
        .map_err(|_| format!("bad status code in {:?}", truncate(line)))?;
    if status < 100 {
        return Err(format!("bad status code in {:?}", truncate(line)));
    }
    Ok(status)
}

fn truncate(s: &str) -> &str {
    match s.char_indices().nth(80) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Header lines up to the blank line, as (lower-case name, trimmed value).
fn read_headers<R: BufRead>(r: &mut R, what: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    loop {
        let line = read_line(r, what)?.ok_or_else(|| format!("the answer ended in the {what}s"))?;
        if line.is_empty() {
            return Ok(out);
        }
        if out.len() >= MAX_HEADERS {
            return Err(format!("more than {MAX_HEADERS} {what}s"));
        }
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| format!("malformed {what} {:?}", truncate(&line)))?;
        if name.is_empty()
            || name
                .bytes()
                .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
        {
            return Err(format!("malformed {what} {:?}", truncate(&line)));
        }
        if value.bytes().any(|b| b.is_ascii_control() && b != b'\t') {
            return Err(format!("control character in {what} {name:?}"));
        }
        out.push((name.to_ascii_lowercase(), value.trim().to_owned()));
    }
}

/// Parse one answer from `r`: status line (skipping interim 1xx answers),
/// headers, and the body framed by chunked encoding, `Content-Length`, or
/// EOF. The body may be at most `limit` bytes.
pub fn read_response<R: BufRead>(mut r: R, limit: u64) -> Result<Response, String> {
    let (status, headers) = loop {
        let line = read_line(&mut r, "status line")?
            .ok_or_else(|| "the admin API closed the connection without answering".to_owned())?;
        let status = parse_status_line(&line)?;
        let headers = read_headers(&mut r, "header")?;
        // Interim answers (100 Continue, 103 Early Hints) precede the real one.
        if (100..200).contains(&status) && status != 101 {
            continue;
        }
        break (status, headers);
    };
    if status == 101 {
        return Err(
            "the admin API switched protocols (101), which this client does not speak".into(),
        );
    }
    let body = if status == 204 || status == 304 {
        Vec::new()
    } else if let Some(te) = last_value(&headers, "transfer-encoding") {
        let last = te.rsplit(',').next().unwrap_or("").trim();
        if !last.eq_ignore_ascii_case("chunked") {
            return Err(format!("unsupported Transfer-Encoding {te:?}"));
        }
        read_chunked(&mut r, limit)?
    } else if let Some(len) = content_length(&headers)? {
        if len > limit {
            return Err(format!(
                "the answer's body ({len} bytes) is larger than {limit} bytes"
            ));
        }
        read_exact_body(&mut r, len)?
    } else {
        let mut body = Vec::new();
        r.by_ref()
            .take(limit.saturating_add(1))
            .read_to_end(&mut body)
            .map_err(|e| format!("reading the answer's body: {}", io_msg(&e)))?;
        if body.len() as u64 > limit {
            return Err(format!("the answer's body is larger than {limit} bytes"));
        }
        body
    };
    Ok(Response { status, body })
}

fn last_value<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .rev()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// The `Content-Length`, if any; every occurrence (and every comma-separated
/// value) must be the same number.
fn content_length(headers: &[(String, String)]) -> Result<Option<u64>, String> {
    let mut len = None;
    for (_, v) in headers.iter().filter(|(n, _)| n == "content-length") {
        for part in v.split(',') {
            let p = part.trim();
            if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("bad Content-Length {v:?}"));
            }
            let n: u64 = p.parse().map_err(|_| format!("bad Content-Length {v:?}"))?;
            if len.is_some_and(|l| l != n) {
                return Err("conflicting Content-Length headers".into());
            }
            len = Some(n);
        }
    }
    Ok(len)
}

fn read_exact_body<R: BufRead>(r: &mut R, len: u64) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    let got = r
        .by_ref()
        .take(len)
        .read_to_end(&mut body)
        .map_err(|e| format!("reading the answer's body: {}", io_msg(&e)))?;
    if (got as u64) < len {
        return Err(format!(
            "the answer's body was cut short: {got} of {len} bytes"
        ));
    }
    Ok(body)
}

fn read_chunked<R: BufRead>(r: &mut R, limit: u64) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    loop {
        let line = read_line(r, "chunk size line")?
            .ok_or_else(|| "the answer ended before its last chunk".to_owned())?;
        let hex = line.split(';').next().unwrap_or("").trim();
        if hex.is_empty() || hex.len() > 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("bad chunk size {:?}", truncate(&line)));
        }
        let size = u64::from_str_radix(hex, 16).map_err(|_| format!("bad chunk size {hex:?}"))?;
        if size == 0 {
            // Trailer fields, then the blank line.
            read_headers(r, "trailer")?;
            return Ok(body);
        }
        if (body.len() as u64).saturating_add(size) > limit {
            return Err(format!("the answer's body is larger than {limit} bytes"));
        }
        body.extend(read_exact_body(r, size)?);
        match read_line(r, "chunk ending")? {
            Some(s) if s.is_empty() => {}
            Some(_) => return Err("a chunk is longer than its size says".into()),
            None => return Err("the answer ended after a chunk".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: u64 = 1 << 20;

    fn parse(s: &str) -> Result<Response, String> {
        read_response(s.as_bytes(), LIMIT)
    }

    fn ok(s: &str) -> (u16, String) {
        let r = parse(s).unwrap_or_else(|e| panic!("{s:?}: {e}"));
        (r.status, String::from_utf8(r.body).expect("utf8"))
    }

    #[test]
    fn content_length_body() {
        assert_eq!(
            ok("HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: text/plain\r\n\r\nhello"),
            (200, "hello".into())
        );
        // Bytes after the declared length are not part of the body.
        assert_eq!(
            ok("HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}extra"),
            (404, "{}".into())
        );
        // Repeated but equal lengths are fine; bare LF line endings too.
        assert_eq!(
            ok("HTTP/1.0 201 Created\nContent-Length: 3\nContent-Length: 3, 3\n\nabc"),
            (201, "abc".into())
        );
        assert_eq!(
            ok("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
            (200, String::new())
        );
    }

    #[test]
    fn chunked_body() {
        assert_eq!(
            ok("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                5\r\nhello\r\n7;ext=1\r\n, world\r\nA\r\n0123456789\r\n0\r\n\r\n"),
            (200, "hello, world0123456789".into())
        );
        // Trailers are read and ignored; chunked wins over Content-Length.
        assert_eq!(
            ok(
                "HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: gzip, Chunked\r\n\r\n\
                1\r\nx\r\n0\r\nX-Trailer: 1\r\n\r\n"
            ),
            (200, "x".into())
        );
    }

    #[test]
    fn body_until_eof_and_empty_statuses() {
        assert_eq!(
            ok("HTTP/1.1 200 OK\r\n\r\nall of it"),
            (200, "all of it".into())
        );
        assert_eq!(
            ok("HTTP/1.1 204 No Content\r\n\r\nignored"),
            (204, String::new())
        );
        assert_eq!(
            ok("HTTP/1.1 200\r\nContent-Length: 1\r\n\r\nz"),
            (200, "z".into())
        );
    }

    #[test]
    fn interim_answers_are_skipped() {
        assert_eq!(
            ok("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
            (200, "ok".into())
        );
    }

    #[test]
    fn malformed_answers_are_errors() {
        let bad = [
            "",
            "garbage\r\n\r\n",
            "HTTP/2 200 OK\r\n\r\n",
            "HTTP/1.1 2x0 OK\r\n\r\n",
            "HTTP/1.1 20 OK\r\n\r\n",
            "HTTP/1.1 2000 OK\r\n\r\n",
            "HTTP/1.1 099 Low\r\n\r\n",
            "HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
            "HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 1x\r\n\r\nab",
            "HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
            "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nxx",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabc",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFF\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFF\r\nx",
            "HTTP/1.1 101 Switching Protocols\r\n\r\n",
            "HTTP/1.1 200 OK\r\nX: \u{0}\r\n\r\n",
        ];
        for s in bad {
            let r = parse(s);
            assert!(r.is_err(), "{s:?} parsed as {r:?}");
        }
        // Invalid UTF-8 in a header line.
        let mut raw = b"HTTP/1.1 200 OK\r\nX: ".to_vec();
        raw.extend([0xff, 0xfe]);
        raw.extend(b"\r\n\r\n");
        assert!(read_response(&raw[..], LIMIT).is_err());
    }

    #[test]
    fn limits_are_enforced() {
        let long = format!(
            "HTTP/1.1 200 OK\r\nX: {}\r\n\r\n",
            "a".repeat(MAX_LINE as usize)
        );
        assert!(parse(&long).unwrap_err().contains("longer than"));
        let many = format!(
            "HTTP/1.1 200 OK\r\n{}\r\n",
            "X: 1\r\n".repeat(MAX_HEADERS + 1)
        );
        assert!(parse(&many).unwrap_err().contains("more than"));
        let big = "HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world";
        assert!(read_response(big.as_bytes(), 10).is_err());
        assert!(read_response(big.as_bytes(), 11).is_ok());
        let eof = "HTTP/1.1 200 OK\r\n\r\nhello world";
        assert!(read_response(eof.as_bytes(), 10).is_err());
        let chunked = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nhello \r\n5\r\nworld\r\n0\r\n\r\n";
        assert!(read_response(chunked.as_bytes(), 10).is_err());
        assert!(read_response(chunked.as_bytes(), 11).is_ok());
    }

    #[test]
    fn request_heads() {
        let h = encode_head(&Request {
            method: "POST",
            target: "/v1/tenants?x=1",
            token: Some("tok"),
            json_body: Some(b"{\"a\":1}"),
        })
        .unwrap();
        let h = String::from_utf8(h).unwrap();
        assert!(
            h.starts_with("POST /v1/tenants?x=1 HTTP/1.1\r\nHost: localhost\r\n"),
            "{h}"
        );
        assert!(h.contains("\r\nConnection: close\r\n"));
        assert!(h.contains("\r\nAuthorization: Bearer tok\r\n"));
        assert!(h.contains("\r\nContent-Type: application/json\r\nContent-Length: 7\r\n"));
        assert!(h.ends_with("\r\n\r\n"));
        let g = encode_head(&Request {
            method: "GET",
            target: "/v1/x",
            token: None,
            json_body: None,
        })
        .unwrap();
        let g = String::from_utf8(g).unwrap();
        assert!(
            !g.contains("Content-Length") && !g.contains("Authorization"),
            "{g}"
        );
        let p = encode_head(&Request {
            method: "POST",
            target: "/v1/reload",
            token: None,
            json_body: None,
        })
        .unwrap();
        assert!(
            String::from_utf8(p)
                .unwrap()
                .contains("Content-Length: 0\r\n")
        );
        for (m, t, tok) in [
            ("GET", "v1", None),
            ("G T", "/", None),
            ("GET", "/a b", None),
            ("GET", "/", Some("a\r\nX: y")),
        ] {
            assert!(
                encode_head(&Request {
                    method: m,
                    target: t,
                    token: tok,
                    json_body: None
                })
                .is_err()
            );
        }
    }

    /// A one-shot server: reads the request head, answers `answer` (or
    /// nothing, holding the connection open until the client gives up).
    fn one_shot(
        answer: Option<&'static str>,
    ) -> (
        tempfile::TempDir,
        std::path::PathBuf,
        std::thread::JoinHandle<String>,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.sock");
        let l = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().expect("accept");
            s.set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && s.read_exact(&mut byte).is_ok() {
                head.push(byte[0]);
            }
            match answer {
                Some(a) => s.write_all(a.as_bytes()).expect("answer"),
                // Wait for the client to close (its read timed out).
                None => while s.read(&mut byte).is_ok_and(|n| n > 0) {},
            }
            String::from_utf8_lossy(&head).into_owned()
        });
        (dir, path, h)
    }

    #[test]
    fn a_chunked_answer_over_a_real_socket() {
        let (_dir, path, h) = one_shot(Some(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n[1,\r\n2\r\n2]\r\n0\r\n\r\n",
        ));
        let req = Request {
            method: "GET",
            target: "/v1/x",
            token: Some("t"),
            json_body: None,
        };
        let r = send(&path, &req, Duration::from_secs(10), LIMIT).expect("send");
        assert_eq!((r.status, r.body.as_slice()), (200, &b"[1,2]"[..]));
        let head = h.join().expect("server");
        assert!(
            head.starts_with("GET /v1/x HTTP/1.1\r\n")
                && head.contains("Authorization: Bearer t\r\n"),
            "{head}"
        );
    }

    #[test]
    fn a_silent_server_times_out() {
        let (_dir, path, h) = one_shot(None);
        let req = Request {
            method: "GET",
            target: "/",
            token: None,
            json_body: None,
        };
        let e = send(&path, &req, Duration::from_millis(200), LIMIT).unwrap_err();
        assert!(e.contains("timed out"), "{e}");
        h.join().expect("server");
    }
}

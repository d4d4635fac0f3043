//! PROXY protocol headers (HAProxy's spec, versions 1 and 2) that weir sends
//! to backends configured with `proxy_protocol = "v1"` or `"v2"`, so they see
//! the real client address behind the proxy.
//!
//! Pure encoding: the daemon writes the returned bytes to the backend socket
//! before any payload.

use std::net::{IpAddr, SocketAddr};

/// Which PROXY protocol version a backend asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// Human-readable text line.
    V1,
    /// Binary header.
    V2,
}

impl std::str::FromStr for Version {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "v1" | "1" => Ok(Self::V1),
            "v2" | "2" => Ok(Self::V2),
            other => Err(format!(
                "unknown PROXY protocol version {other:?}: use \"v1\" or \"v2\""
            )),
        }
    }
}

impl Version {
    /// The name in the configuration and the admin API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V1 => "v1",
            Self::V2 => "v2",
        }
    }

    /// A backend's `proxy_protocol` value: exactly "v1" or "v2".
    pub fn from_config(text: &str) -> Result<Self, String> {
        match text {
            "v1" => Ok(Self::V1),
            "v2" => Ok(Self::V2),
            _ => Err(format!(
                "{text:?} is not a PROXY protocol version; use \"v1\" or \"v2\""
            )),
        }
    }
}

impl serde::Serialize for Version {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// From "v1" or "v2"; the error names the key, since a JSON body has no
/// lines to point at (the config file's shape pre-pass reports it first,
/// with its line and key path).
impl<'de> serde::Deserialize<'de> for Version {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Self::from_config(&text).map_err(serde::de::Error::custom)
    }
}

/// Transport the header describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// A TCP stream.
    Stream,
    /// UDP datagrams (v2 only; v1 has no UDP form).
    Datagram,
}

/// v2's fixed 12-byte signature.
pub const V2_SIGNATURE: [u8; 12] = [
    0x0D, 0x0A, 0x0D, 0x0A, 0x00, 0x0D, 0x0A, 0x51, 0x55, 0x49, 0x54, 0x0A,
];

/// The header announcing a connection from `client` to `local` (the virtual
/// address the client connected to). Mixed families are sent as IPv6 with the
/// IPv4 side mapped (`::ffff:a.b.c.d`), which both versions allow.
pub fn header(
    version: Version,
    transport: Transport,
    client: SocketAddr,
    local: SocketAddr,
) -> Vec<u8> {
    let (src, dst) = same_family(client, local);
    match version {
        Version::V1 => v1(src, dst),
        Version::V2 => v2(transport, src, dst),
    }
}

fn same_family(a: SocketAddr, b: SocketAddr) -> (SocketAddr, SocketAddr) {
    match (a.ip(), b.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_)) => (a, b),
        _ => (to_v6(a), to_v6(b)),
    }
}

fn to_v6(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V4(v4) => SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), a.port()),
        IpAddr::V6(_) => a,
    }
}

fn v1(src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    let fam = if src.is_ipv4() { "TCP4" } else { "TCP6" };
    format!(
        "PROXY {fam} {} {} {} {}\r\n",
        src.ip(),
        dst.ip(),
        src.port(),
        dst.port()
    )
    .into_bytes()
}

fn v2(transport: Transport, src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    let proto = match transport {
        Transport::Stream => 0x1,
        Transport::Datagram => 0x2,
    };
    let mut out = Vec::with_capacity(16 + 36);
    out.extend_from_slice(&V2_SIGNATURE);
    out.push(0x21); // version 2, command PROXY
    match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            out.push(0x10 | proto); // AF_INET
            out.extend_from_slice(&12u16.to_be_bytes());
            out.extend_from_slice(&s.octets());
            out.extend_from_slice(&d.octets());
        }
        (s, d) => {
            out.push(0x20 | proto); // AF_INET6
            out.extend_from_slice(&36u16.to_be_bytes());
            out.extend_from_slice(&v6_octets(s));
            out.extend_from_slice(&v6_octets(d));
        }
    }
    out.extend_from_slice(&src.port().to_be_bytes());
    out.extend_from_slice(&dst.port().to_be_bytes());
    out
}

fn v6_octets(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V6(v6) => v6.octets(),
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().expect("test address")
    }

    #[test]
    fn v1_ipv4_and_ipv6_lines() {
        let h = header(
            Version::V1,
            Transport::Stream,
            sa("192.0.2.7:51000"),
            sa("198.51.100.1:80"),
        );
        assert_eq!(h, b"PROXY TCP4 192.0.2.7 198.51.100.1 51000 80\r\n");
        let h = header(
            Version::V1,
            Transport::Stream,
            sa("[2001:db8::7]:51000"),
            sa("[2001:db8::1]:443"),
        );
        assert_eq!(h, b"PROXY TCP6 2001:db8::7 2001:db8::1 51000 443\r\n");
        // The spec caps a v1 line at 107 bytes; the longest IPv6 form fits.
        let long = header(
            Version::V1,
            Transport::Stream,
            sa("[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535"),
            sa("[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535"),
        );
        assert!(long.len() <= 107, "{}", long.len());
    }

    #[test]
    fn mixed_families_are_mapped_to_ipv6() {
        let h = header(
            Version::V1,
            Transport::Stream,
            sa("192.0.2.7:1"),
            sa("[2001:db8::1]:2"),
        );
        assert_eq!(h, b"PROXY TCP6 ::ffff:192.0.2.7 2001:db8::1 1 2\r\n");
    }

    #[test]
    fn v2_ipv4_layout() {
        let h = header(
            Version::V2,
            Transport::Stream,
            sa("10.0.0.1:4660"),
            sa("10.0.0.2:80"),
        );
        assert_eq!(&h[..12], &V2_SIGNATURE);
        assert_eq!(h[12], 0x21);
        assert_eq!(h[13], 0x11);
        assert_eq!(u16::from_be_bytes([h[14], h[15]]), 12);
        assert_eq!(&h[16..20], &[10, 0, 0, 1]);
        assert_eq!(&h[20..24], &[10, 0, 0, 2]);
        assert_eq!(u16::from_be_bytes([h[24], h[25]]), 4660);
        assert_eq!(u16::from_be_bytes([h[26], h[27]]), 80);
        assert_eq!(h.len(), 28);
    }

    #[test]
    fn v2_ipv6_udp_layout() {
        let h = header(
            Version::V2,
            Transport::Datagram,
            sa("[::1]:5353"),
            sa("[::2]:53"),
        );
        assert_eq!(h[13], 0x22);
        assert_eq!(u16::from_be_bytes([h[14], h[15]]), 36);
        assert_eq!(h.len(), 16 + 36);
        assert_eq!(h[16 + 15], 1);
        assert_eq!(h[32 + 15], 2);
        assert_eq!(u16::from_be_bytes([h[48], h[49]]), 5353);
        assert_eq!(u16::from_be_bytes([h[50], h[51]]), 53);
    }

    #[test]
    fn version_parse_errors_say_what_to_use() {
        assert_eq!("v2".parse::<Version>(), Ok(Version::V2));
        let e = "v3".parse::<Version>().unwrap_err();
        assert!(e.contains("\"v1\" or \"v2\""), "{e}");
    }
}

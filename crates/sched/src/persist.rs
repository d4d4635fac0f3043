//! Persistence helpers (`ipvsadm -p [timeout] -M netmask`).
//!
//! With persistence, every new connection from the same client *group* goes to
//! the same backend while an affinity template for that group lives. The
//! daemon keeps the templates in its flow table; this module only provides
//! the grouping (client address masked by an IPv4 netmask or an IPv6 prefix
//! length) and the rule deciding whether a template may still be followed.
//! `docs/sched.md` describes the whole flow.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use crate::BackendInfo;

/// How clients are grouped for persistence: an IPv4 prefix length (from a
/// contiguous netmask such as `255.255.255.0`, as `ipvsadm -M`) and an IPv6
/// prefix length (as `ipvsadm -M 64` on an IPv6 service).
///
/// The default, [`AffinityMask::HOST`], groups nothing: one client, one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AffinityMask {
    v4_prefix: u8,
    v6_prefix: u8,
}

/// An invalid persistence mask.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MaskError {
    /// An IPv4 netmask whose one bits are not contiguous from the top.
    #[error("IPv4 netmask {0} is not contiguous (expected e.g. 255.255.255.0)")]
    NonContiguousNetmask(Ipv4Addr),
    /// An IPv4 prefix length above 32.
    #[error("IPv4 prefix length {0} exceeds 32")]
    V4PrefixTooLong(u8),
    /// An IPv6 prefix length above 128.
    #[error("IPv6 prefix length {0} exceeds 128")]
    V6PrefixTooLong(u8),
    /// Text that is neither an IPv4 netmask nor a prefix length.
    #[error(
        "{0:?} is neither an IPv4 netmask (e.g. \"255.255.255.0\") nor an IPv6 prefix length (e.g. \"64\")"
    )]
    Syntax(String),
}

impl AffinityMask {
    /// Per-client affinity: /32 and /128.
    pub const HOST: Self = Self {
        v4_prefix: 32,
        v6_prefix: 128,
    };

    /// From prefix lengths (`0..=32`, `0..=128`).
    pub fn new(v4_prefix: u8, v6_prefix: u8) -> Result<Self, MaskError> {
        if v4_prefix > 32 {
            return Err(MaskError::V4PrefixTooLong(v4_prefix));
        }
        if v6_prefix > 128 {
            return Err(MaskError::V6PrefixTooLong(v6_prefix));
        }
        Ok(Self {
            v4_prefix,
            v6_prefix,
        })
    }

    /// From an ipvsadm-style IPv4 netmask (`255.255.255.0`) and an IPv6
    /// prefix length.
    pub fn from_v4_netmask(netmask: Ipv4Addr, v6_prefix: u8) -> Result<Self, MaskError> {
        let bits = u32::from(netmask);
        let len = bits.leading_ones();
        if bits.checked_shl(len).unwrap_or(0) != 0 {
            return Err(MaskError::NonContiguousNetmask(netmask));
        }
        // len <= 32 always fits in u8.
        Self::new(len as u8, v6_prefix)
    }

    /// IPv4 prefix length.
    pub fn v4_prefix(&self) -> u8 {
        self.v4_prefix
    }

    /// IPv6 prefix length.
    pub fn v6_prefix(&self) -> u8 {
        self.v6_prefix
    }

    /// The IPv4 netmask, e.g. `255.255.255.0` for /24.
    pub fn v4_netmask(&self) -> Ipv4Addr {
        Ipv4Addr::from(mask32(self.v4_prefix))
    }

    /// The group of `client`: its address with the host bits cleared. An
    /// IPv4-mapped IPv6 address (a v4 client on a dual-stack socket) is first
    /// turned into its IPv4 address, so it groups like the IPv4 client.
    pub fn group(&self, client: IpAddr) -> IpAddr {
        match client.to_canonical() {
            IpAddr::V4(a) => IpAddr::V4(Ipv4Addr::from(u32::from(a) & mask32(self.v4_prefix))),
            IpAddr::V6(a) => IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask128(self.v6_prefix))),
        }
    }
}

impl Default for AffinityMask {
    fn default() -> Self {
        Self::HOST
    }
}

/// ipvsadm's `-M` syntax: an IPv4 netmask (`"255.255.255.0"`, IPv6 clients
/// stay per host) or an IPv6 prefix length (`"64"`, IPv4 clients stay per
/// host).
impl FromStr for AffinityMask {
    type Err = MaskError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Ok(netmask) = s.parse::<Ipv4Addr>() {
            return Self::from_v4_netmask(netmask, 128);
        }
        match s.parse::<u8>() {
            Ok(len) => Self::new(32, len),
            Err(_) => Err(MaskError::Syntax(s.to_owned())),
        }
    }
}

fn mask32(len: u8) -> u32 {
    u32::MAX
        .checked_shl(32 - u32::from(len.min(32)))
        .unwrap_or(0)
}

fn mask128(len: u8) -> u128 {
    u128::MAX
        .checked_shl(128 - u32::from(len.min(128)))
        .unwrap_or(0)
}

/// Whether a live affinity template pointing at `backend` may direct a new
/// connection there.
///
/// A down backend never takes new connections. A quiesced one (weight 0)
/// still does by default, as in IPVS: persistence outranks quiescing, so a
/// client's session is not broken while the backend drains. With
/// `expire_quiescent` (IPVS's `expire_quiescent_template` sysctl) such a
/// template is dropped instead and the scheduler chooses again.
pub fn template_usable(backend: &BackendInfo, expire_quiescent: bool) -> bool {
    backend.up && (backend.weight > 0 || !expire_quiescent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::backend;

    fn v4(s: &str) -> IpAddr {
        IpAddr::V4(s.parse().expect("ipv4"))
    }

    fn v6(s: &str) -> IpAddr {
        IpAddr::V6(s.parse().expect("ipv6"))
    }

    #[test]
    fn ipv4_netmask_grouping() {
        let m = AffinityMask::from_v4_netmask(Ipv4Addr::new(255, 255, 255, 0), 64).expect("valid");
        assert_eq!(m.v4_prefix(), 24);
        assert_eq!(m.v4_netmask(), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(m.group(v4("192.0.2.77")), v4("192.0.2.0"));
        assert_eq!(m.group(v4("192.0.2.77")), m.group(v4("192.0.2.1")));
        assert_ne!(m.group(v4("192.0.2.77")), m.group(v4("192.0.3.77")));
        let m = AffinityMask::from_v4_netmask(Ipv4Addr::new(255, 255, 240, 0), 128).expect("valid");
        assert_eq!(m.group(v4("10.1.47.9")), v4("10.1.32.0"));
    }

    #[test]
    fn ipv6_prefix_grouping() {
        let m = AffinityMask::new(32, 64).expect("valid");
        assert_eq!(m.group(v6("2001:db8:1:2:aaaa::1")), v6("2001:db8:1:2::"));
        assert_eq!(
            m.group(v6("2001:db8:1:2:ffff::9")),
            m.group(v6("2001:db8:1:2::1"))
        );
        assert_ne!(
            m.group(v6("2001:db8:1:3::1")),
            m.group(v6("2001:db8:1:2::1"))
        );
        let m = AffinityMask::new(32, 56).expect("valid");
        assert_eq!(m.group(v6("2001:db8:1:2ff::1")), v6("2001:db8:1:200::"));
    }

    #[test]
    fn host_and_extreme_masks() {
        let host = AffinityMask::default();
        assert_eq!(host, AffinityMask::HOST);
        assert_eq!(host.group(v4("198.51.100.7")), v4("198.51.100.7"));
        assert_eq!(host.group(v6("2001:db8::7")), v6("2001:db8::7"));
        let all = AffinityMask::new(0, 0).expect("valid");
        assert_eq!(all.group(v4("198.51.100.7")), v4("0.0.0.0"));
        assert_eq!(all.group(v6("2001:db8::7")), v6("::"));
        assert_eq!(all.v4_netmask(), Ipv4Addr::UNSPECIFIED);
    }

    #[test]
    fn mapped_ipv4_groups_as_ipv4() {
        let m = AffinityMask::new(24, 128).expect("valid");
        assert_eq!(m.group(v6("::ffff:192.0.2.77")), v4("192.0.2.0"));
    }

    #[test]
    fn invalid_masks_are_rejected() {
        assert_eq!(
            AffinityMask::from_v4_netmask(Ipv4Addr::new(255, 0, 255, 0), 64),
            Err(MaskError::NonContiguousNetmask(Ipv4Addr::new(
                255, 0, 255, 0
            )))
        );
        assert_eq!(
            AffinityMask::new(33, 64),
            Err(MaskError::V4PrefixTooLong(33))
        );
        assert_eq!(
            AffinityMask::new(24, 129),
            Err(MaskError::V6PrefixTooLong(129))
        );
        assert!(AffinityMask::from_v4_netmask(Ipv4Addr::BROADCAST, 128).is_ok());
        assert!(AffinityMask::from_v4_netmask(Ipv4Addr::UNSPECIFIED, 0).is_ok());
    }

    #[test]
    fn parses_ipvsadm_syntax() {
        assert_eq!("255.255.0.0".parse(), AffinityMask::new(16, 128));
        assert_eq!(" 48 ".parse(), AffinityMask::new(32, 48));
        assert_eq!(
            "129".parse::<AffinityMask>(),
            Err(MaskError::V6PrefixTooLong(129))
        );
        assert!(matches!(
            "/24".parse::<AffinityMask>(),
            Err(MaskError::Syntax(_))
        ));
        assert!(matches!(
            "255.0.255.0".parse::<AffinityMask>(),
            Err(MaskError::NonContiguousNetmask(_))
        ));
    }

    #[test]
    fn template_rules() {
        let live = backend(1, 3);
        let quiesced = backend(2, 0);
        let mut down = backend(3, 3);
        down.up = false;
        assert!(template_usable(&live, true));
        assert!(template_usable(&quiesced, false));
        assert!(!template_usable(&quiesced, true));
        assert!(!template_usable(&down, false));
    }
}

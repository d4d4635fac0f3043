//! The opaque dump cursor.

use std::fmt;
use std::str::FromStr;

use crate::types::ParseError;

/// Where a dump stopped: (table, top 32 bits of the last entry's hash, its
/// cookie), and which dump it is. Opaque; `Display` gives a short URL-safe
/// string (`c3.<table>.<hash>.<cookie>.<dump>` in hex) and `FromStr` parses
/// it back, and the three-field `c2.` form of earlier versions (a dump of
/// unknown identity), rejecting anything else. A cursor stays meaningful
/// however the table changes: it names a position in hash order, which no
/// resize moves, and a vanished table just moves on.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct Cursor {
    pub(crate) order: u64,
    pub(crate) bucket: u64,
    pub(crate) cookie: u64,
    /// The dump this cursor belongs to: numbered per table from 1 when a
    /// dump starts (no cursor); 0 for a `c2.` cursor. A thread goes on from
    /// a bucket it read earlier only for the dump that read it (see
    /// `flow::Resume`).
    pub(crate) dump: u64,
}

impl Cursor {
    pub(crate) const START: Cursor = Cursor {
        order: 0,
        bucket: 0,
        cookie: 0,
        dump: 0,
    };
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "c3.{:x}.{:x}.{:x}.{:x}",
            self.order, self.bucket, self.cookie, self.dump
        )
    }
}

impl FromStr for Cursor {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |detail| ParseError {
            what: "cursor",
            detail,
        };
        if s.len() > 80 {
            return Err(err("too long"));
        }
        let (rest, fields, wrong) = if let Some(rest) = s.strip_prefix("c3.") {
            (rest, 4, "expected four fields")
        } else if let Some(rest) = s.strip_prefix("c2.") {
            (rest, 3, "expected three fields")
        } else {
            return Err(err("expected prefix c3."));
        };
        let mut parts = rest.split('.');
        let mut next = || -> Result<u64, ParseError> {
            let p = parts.next().ok_or(err(wrong))?;
            if p.is_empty() || p.len() > 16 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(err("fields must be 1 to 16 hex digits"));
            }
            u64::from_str_radix(p, 16).map_err(|_| err("fields must be 1 to 16 hex digits"))
        };
        let c = Cursor {
            order: next()?,
            bucket: next()?,
            cookie: next()?,
            dump: if fields == 4 { next()? } else { 0 },
        };
        if parts.next().is_some() {
            return Err(err(wrong));
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_garbage() {
        let c = Cursor {
            order: 5,
            bucket: 0xabc,
            cookie: u64::MAX,
            dump: u64::MAX,
        };
        assert_eq!(c.to_string().parse::<Cursor>(), Ok(c));
        // An earlier version's cursor: the same position, no dump identity.
        assert_eq!(
            "c2.5.abc.ffffffffffffffff".parse::<Cursor>(),
            Ok(Cursor { dump: 0, ..c })
        );
        for bad in [
            "",
            "c2",
            "c2.",
            "c2.1.2",
            "c2.1.2.3.4",
            "c3.1.2.3",
            "c3.1.2.3.4.5",
            "c3.1.2.3.",
            "c4.1.2.3.4",
            "c2.1.2.x",
            "c1.1.2.3",
            "c2.+1.2.3",
            "c2.11111111111111111.2.3",
            "c2.1..3",
            "💥",
        ] {
            assert!(bad.parse::<Cursor>().is_err(), "{bad:?}");
        }
    }
}

//! Internet checksums: the RFC 1071 full sum and RFC 1624 incremental updates.
//!
//! All values are 16-bit words in network order read as big-endian `u16`.
//! One's complement addition is commutative and associative, so a sum over
//! any set of 16-bit-aligned fields can be updated by removing the old words
//! and adding the new ones, in any order.
//!
//! ## The two modes of an L4 checksum field
//!
//! * [`CsumMode::Full`] — the field holds the finished checksum, `~sum`, over
//!   the pseudo header, the L4 header and the payload (what is on a wire).
//!   An update is RFC 1624 eqn. 3: `HC' = ~(~HC + ~m + m')`, for every
//!   changed word `m → m'` in the pseudo header *or* the L4 header.
//! * [`CsumMode::Partial`] — the packet is `CHECKSUM_PARTIAL` (Linux
//!   `skb->ip_summed`): it was built by a local socket on a veth or a
//!   device with TX checksum offload, and the field holds only the folded
//!   pseudo-header sum, *not* complemented; whoever transmits it last (the
//!   NIC, or the veth peer's receive path) sums the L4 header and payload on
//!   top. An update then folds in only changes of pseudo-header words
//!   (addresses, and the length): `S' = S + ~m + m'`. Port changes are
//!   *not* folded in — the final sum covers the new ports anyway.
//!
//! The caller knows which mode applies from the I/O path: an AF_XDP frame
//! received from a physical NIC is `Full`; AF_PACKET reports partial
//! packets with `TP_STATUS_CSUM_NOT_READY`, and AF_XDP copy mode on a veth
//! whose sender offloads checksums delivers partial ones (RESEARCH.md:
//! "veth gotchas") — then use `Partial`, or turn TX checksumming off on the
//! sender and use `Full`.

/// How the L4 checksum field of a packet is to be read and updated (see the
/// module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CsumMode {
    /// The field holds the finished checksum `~sum` over pseudo header,
    /// L4 header and payload.
    Full,
    /// `CHECKSUM_PARTIAL`: the field holds the folded, non-complemented
    /// pseudo-header sum; only pseudo-header changes are folded in.
    Partial,
}

/// One's complement addition of two 16-bit words (end-around carry).
#[inline]
pub fn add(a: u16, b: u16) -> u16 {
    let s = u32::from(a) + u32::from(b);
    ((s & 0xffff) + (s >> 16)) as u16
}

/// Folds a 32-bit accumulator of 16-bit words into 16 bits (end-around
/// carry), without complementing.
#[inline]
pub fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// RFC 1071 sum of `data` as big-endian 16-bit words (an odd last byte is
/// padded with zero), added to `initial`. Returns the unfolded accumulator;
/// [`fold`] it, or [`finish`] it into a checksum.
///
/// Accumulates in 64 bits and folds the carries back in, so any slice
/// length is fine; the result is congruent (mod 0xffff) to the true sum.
pub fn sum(data: &[u8], initial: u32) -> u32 {
    let mut acc = u64::from(initial);
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc += u64::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u64::from(u16::from_be_bytes([*last, 0]));
    }
    // Fold the u64 down to a value that fits u32 without losing carries.
    while acc >> 32 != 0 {
        acc = (acc & 0xffff_ffff) + (acc >> 32);
    }
    acc as u32
}

/// The finished checksum of an accumulator: `~fold(sum)`.
#[inline]
pub fn finish(sum: u32) -> u16 {
    !fold(sum)
}

/// Sum of the 16-bit words of an IPv4 or IPv6 address (4 or 16 bytes).
#[inline]
pub fn addr_sum(addr: &[u8]) -> u16 {
    fold(sum(addr, 0))
}

/// Updates a checksum field for one changed quantity whose old words sum to
/// `old` and new words to `new` (e.g. [`addr_sum`] of two addresses, or a
/// port). `Full`: RFC 1624 eqn. 3 `~(~HC + ~m + m')`. `Partial`: the
/// non-complemented `S + ~m + m'`.
///
/// In `Full` mode the result is in `0..=0xfffe` whenever the true sum is
/// non-zero, as a from-scratch [`finish`] is, so the two agree bit for bit.
#[inline]
pub fn update(field: u16, old: u16, new: u16, mode: CsumMode) -> u16 {
    match mode {
        CsumMode::Full => !add(add(!field, !old), new),
        CsumMode::Partial => add(add(field, !old), new),
    }
}

/// [`update`] for one changed 16-bit word (a port, TTL/protocol word).
#[inline]
pub fn update16(field: u16, old: u16, new: u16, mode: CsumMode) -> u16 {
    update(field, old, new, mode)
}

/// [`update`] for a changed IPv4 address.
#[inline]
pub fn update32(field: u16, old: [u8; 4], new: [u8; 4], mode: CsumMode) -> u16 {
    update(field, addr_sum(&old), addr_sum(&new), mode)
}

/// [`update`] for a changed IPv6 address.
#[inline]
pub fn update128(field: u16, old: [u8; 16], new: [u8; 16], mode: CsumMode) -> u16 {
    update(field, addr_sum(&old), addr_sum(&new), mode)
}

/// Accumulator of the TCP/UDP/ICMPv6 pseudo header: both addresses (4 or 16
/// bytes each), the protocol number and the L4 length.
pub fn pseudo_header_sum(src: &[u8], dst: &[u8], proto: u8, l4_len: u32) -> u32 {
    let s = sum(src, 0);
    let s = sum(dst, s);
    s + u32::from(proto) + (l4_len >> 16) + (l4_len & 0xffff)
}

/// The finished L4 checksum of `l4` (header with its checksum field zeroed
/// or not — pass the field's offset in `csum_at` to have it skipped) under
/// the pseudo header of `src`, `dst`, `proto`. UDP callers map a result of 0
/// to 0xffff themselves (RFC 768).
pub fn l4_checksum(src: &[u8], dst: &[u8], proto: u8, l4: &[u8], csum_at: usize) -> u16 {
    let len = u32::try_from(l4.len()).unwrap_or(u32::MAX);
    let mut acc = pseudo_header_sum(src, dst, proto, len);
    let skip = csum_at.min(l4.len());
    acc = u32::from(fold(sum(&l4[..skip], acc)));
    let rest = skip.saturating_add(2).min(l4.len());
    // The field sits at an even offset, so the words after it stay aligned.
    finish(sum(&l4[rest..], acc))
}

/// The finished IPv4 header checksum of `header` (its checksum field at
/// bytes 10..12 is skipped).
pub fn ipv4_header_checksum(header: &[u8]) -> u16 {
    let n = header.len();
    let a = sum(&header[..10.min(n)], 0);
    finish(sum(&header[12.min(n)..], a))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rfc1071_example() {
        // RFC 1071 section 3 example: words 0001 f203 f4f5 f6f7 sum to ddf2.
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(fold(sum(&data, 0)), 0xddf2);
        assert_eq!(finish(sum(&data, 0)), !0xddf2);
    }

    #[test]
    fn odd_length_pads_with_zero() {
        assert_eq!(fold(sum(&[0x12, 0x34, 0x56], 0)), 0x1234 + 0x5600);
    }

    #[test]
    fn known_ipv4_header() {
        // A textbook header (Wikipedia's IPv4 checksum example): b861.
        let h = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xb8, 0x61, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(ipv4_header_checksum(&h), 0xb861);
        // Verifying over the whole header, field included, gives all ones.
        assert_eq!(fold(sum(&h, 0)), 0xffff);
    }

    #[test]
    fn rfc1624_negative_zero_case() {
        // RFC 1624 section 3: HC = 0xdd2f, m = 0x5555 -> m' = 0x3285 must
        // give 0x0000, not 0xffff (eqn. 2 gets this wrong; eqn. 3 is right).
        assert_eq!(update16(0xdd2f, 0x5555, 0x3285, CsumMode::Full), 0x0000);
    }

    proptest! {
        /// An incremental update of one word equals the from-scratch sum,
        /// in both modes.
        #[test]
        fn incremental_equals_full(mut words in proptest::collection::vec(any::<u16>(), 1..64),
                                   idx in any::<prop::sample::Index>(), new in any::<u16>()) {
            // Make the sum non-zero (a real header has a non-zero word), as
            // every real packet's does: protocol and length are never 0.
            words.push(1);
            let bytes = |w: &[u16]| w.iter().flat_map(|x| x.to_be_bytes()).collect::<Vec<u8>>();
            let i = idx.index(words.len());
            let full = finish(sum(&bytes(&words), 0));
            let partial = fold(sum(&bytes(&words), 0));
            let old = words[i];
            words[i] = new;
            prop_assert_eq!(update16(full, old, new, CsumMode::Full), finish(sum(&bytes(&words), 0)));
            prop_assert_eq!(update16(partial, old, new, CsumMode::Partial), fold(sum(&bytes(&words), 0)));
        }

        #[test]
        fn l4_checksum_verifies(src in any::<[u8; 16]>(), dst in any::<[u8; 16]>(),
                                mut l4 in proptest::collection::vec(any::<u8>(), 8..200)) {
            l4[6] = 0;
            l4[7] = 0;
            let c = l4_checksum(&src, &dst, 17, &l4, 6);
            l4[6..8].copy_from_slice(&c.to_be_bytes());
            let len = l4.len() as u32;
            let acc = pseudo_header_sum(&src, &dst, 17, len);
            prop_assert_eq!(fold(sum(&l4, acc)), 0xffff);
        }
    }
}

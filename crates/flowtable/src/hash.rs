//! SipHash-1-3 over exactly six 64-bit words: the keyed hash of a flow key.
//!
//! Same function as `siphasher::sip::SipHasher13` fed the six words with
//! `write_u64` (checked by the test below), written out for a fixed-size
//! input so it compiles to straight-line code: 7 compression + 3
//! finalisation rounds, no buffering.

#[inline(always)]
fn round(v: &mut [u64; 4]) {
    v[0] = v[0].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(13) ^ v[0];
    v[0] = v[0].rotate_left(32);
    v[2] = v[2].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(16) ^ v[2];
    v[0] = v[0].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(21) ^ v[0];
    v[2] = v[2].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(17) ^ v[2];
    v[2] = v[2].rotate_left(32);
}

/// SipHash-1-3 with key `(k0, k1)` of the 48 bytes `w[0..6]` (little endian).
#[inline]
pub(crate) fn sip13_6(k0: u64, k1: u64, w: [u64; 6]) -> u64 {
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    for m in w {
        v[3] ^= m;
        round(&mut v);
        v[0] ^= m;
    }
    let b = 48u64 << 56;
    v[3] ^= b;
    round(&mut v);
    v[0] ^= b;
    v[2] ^= 0xff;
    round(&mut v);
    round(&mut v);
    round(&mut v);
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::Hasher;

    #[test]
    fn matches_siphasher() {
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..1000 {
            let (k0, k1) = (next(), next());
            let w = [next(), next(), next(), next(), next(), next()];
            let mut h = siphasher::sip::SipHasher13::new_with_keys(k0, k1);
            for m in w {
                h.write_u64(m);
            }
            assert_eq!(sip13_6(k0, k1, w), h.finish());
        }
    }
}

//! The keyed hash of a flow key: foldhash (the `quality` variant, the hash
//! behind hashbrown's default hasher) over the packed key, keyed per table.
//!
//! Why not SipHash-1-3 any more: over the six words of a key it was 10
//! SipRounds, about 170 instructions, 45% of the instructions of a `get`
//! miss (callgrind). Folded 64x64->128 multiplies over two 128-bit words and
//! one 64-bit word cost four multiplies, about 30 instructions.
//!
//! Flooding: the hash stays keyed. The 64-bit per-hasher seed and the four
//! 64-bit shared seeds all derive from the table's secret keys, so an
//! attacker who cannot observe bucket placement cannot aim at a chain;
//! foldhash is not a cryptographic PRF, so the chain cap
//! (`TableConfig::max_chain`, refusals counted) remains the bound on what a
//! collision-finding attacker could do: one capped chain, never a long walk.
//!
//! Input: the tenant enters through its salt (a bijective mix of the secret
//! seed and the tenant id, so distinct per tenant); within one tenant the
//! five words are an injective encoding of (proto/family bits, ports, client
//! address, virtual address), so distinct keys of one tenant are distinct
//! inputs.

use std::hash::Hasher;

use foldhash::SharedSeed;
use foldhash::quality::FoldHasher;

/// Per-table hash key.
#[derive(Clone, Debug)]
pub(crate) struct KeyedHash {
    per_hasher: u64,
    shared: SharedSeed,
}

impl KeyedHash {
    /// A hash keyed by `(k0, k1)` (both secret).
    pub(crate) fn new(k0: u64, k1: u64) -> KeyedHash {
        KeyedHash {
            per_hasher: k0,
            shared: SharedSeed::from_u64(k1),
        }
    }

    /// Hash of the five words `w`.
    #[inline]
    pub(crate) fn hash5(&self, w: [u64; 5]) -> u64 {
        let mut h = FoldHasher::with_seed(self.per_hasher, &self.shared);
        h.write_u128(u128::from(w[0]) | (u128::from(w[1]) << 64));
        h.write_u128(u128::from(w[2]) | (u128::from(w[3]) << 64));
        h.write_u64(w[4]);
        h.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xorshift(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    /// Flipping any single input bit changes the hash, and the low bits
    /// (the bucket index) and bits 32.. (the bloom tag) are spread evenly.
    #[test]
    fn every_input_bit_matters_and_buckets_are_even() {
        let mut x = 0x1234_5678_9abc_def0u64;
        let kh = KeyedHash::new(xorshift(&mut x), xorshift(&mut x));
        let mut buckets = [0u32; 64];
        let mut tags = [0u32; 6];
        for _ in 0..2000 {
            let w = [0u64; 5].map(|_| xorshift(&mut x));
            let h = kh.hash5(w);
            buckets[(h & 63) as usize] += 1;
            tags[((h >> 32) % 6) as usize] += 1;
            for i in 0..5 {
                for b in 0..64 {
                    let mut v = w;
                    v[i] ^= 1 << b;
                    assert_ne!(kh.hash5(v), h, "word {i} bit {b}");
                }
            }
        }
        // 2000 / 64 = 31.25 expected per bucket, 333 per tag.
        assert!(
            buckets.iter().all(|&c| (10..=60).contains(&c)),
            "{buckets:?}"
        );
        assert!(tags.iter().all(|&c| (250..=420).contains(&c)), "{tags:?}");
    }

    /// Different keys give unrelated hashes of the same input.
    #[test]
    fn keys_matter() {
        let w = [1, 2, 3, 4, 5];
        let a = KeyedHash::new(1, 2).hash5(w);
        assert_ne!(a, KeyedHash::new(1, 3).hash5(w));
        assert_ne!(a, KeyedHash::new(3, 2).hash5(w));
    }
}

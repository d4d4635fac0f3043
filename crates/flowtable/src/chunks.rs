//! Where a slot of a chunked slab sits: the one geometry the flow table's
//! node slab and the daemon's owner slab both use, so that the two cannot
//! drift apart.

/// How a slab of `u32`-indexed slots is cut into chunks, each allocated
/// when first needed: eight chunks that grow geometrically (`small`,
/// `small`, 2 `small`, 4 `small` ... 64 `small` slots), then chunks of
/// 128 `small` slots ([`big`](Self::big)) each. A small slab stays small,
/// and at most half of what is allocated is unused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkGeometry {
    small: u32,
    big_shift: u32,
}

/// The geometric chunks before the first of `big` slots.
const SMALL_CHUNKS: usize = 8;

impl ChunkGeometry {
    /// The geometry whose first chunk holds `small` slots, a power of two
    /// no larger than 2^24 (so that a big chunk's 128 `small` fit in a
    /// `u32` index); anything else does not compile where it is a
    /// constant, and panics elsewhere.
    pub const fn new(small: u32) -> ChunkGeometry {
        assert!(
            small.is_power_of_two() && small <= 1 << 24,
            "a chunk geometry's first chunk is a power of two up to 2^24"
        );
        ChunkGeometry {
            small,
            big_shift: small.trailing_zeros() + SMALL_CHUNKS as u32 - 1,
        }
    }

    /// Slots in each chunk past the geometric ones (128 `small`).
    pub const fn big(self) -> u32 {
        1 << self.big_shift
    }

    /// (chunk, offset in it, the chunk's length) of slot `i`.
    #[inline]
    pub const fn locate(self, i: u32) -> (usize, usize, usize) {
        let big = self.big();
        if i < big {
            let b = i / self.small;
            if b == 0 {
                (0, i as usize, self.small as usize)
            } else {
                let k = 32 - b.leading_zeros();
                let start = self.small << (k - 1);
                (k as usize, (i - start) as usize, start as usize)
            }
        } else {
            (
                SMALL_CHUNKS - 1 + (i >> self.big_shift) as usize,
                (i & (big - 1)) as usize,
                big as usize,
            )
        }
    }

    /// How many chunks hold slots `0..slots` (`slots` at least 1).
    pub const fn chunks(self, slots: u32) -> usize {
        assert!(slots > 0, "a slab holds at least one slot");
        self.locate(slots - 1).0 + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each slot follows the one before it, in its chunk or at the start of
    /// the next, and the chunks' lengths are the documented ones.
    #[test]
    fn slots_are_contiguous_and_chunks_grow_as_documented() {
        for small in [1u32, 2, 512, 1024] {
            let g = ChunkGeometry::new(small);
            assert_eq!(g.big(), small * 128);
            let mut lens = Vec::new();
            let mut expect = (0usize, 0usize);
            for i in 0..(3 * g.big()) {
                let (c, off, len) = g.locate(i);
                if off == 0 && i != 0 {
                    expect = (expect.0 + 1, 0);
                }
                assert_eq!((c, off), expect, "slot {i} of {g:?}");
                assert!(off < len, "slot {i} of {g:?}");
                if off == 0 {
                    lens.push(len as u32);
                    assert_eq!(g.chunks(i + 1), c + 1, "slot {i} of {g:?}");
                }
                expect.1 += 1;
            }
            let s = small;
            let want = [s, s, 2 * s, 4 * s, 8 * s, 16 * s, 32 * s, 64 * s];
            assert_eq!(lens[..8], want, "{g:?}");
            assert_eq!(lens[8..], [128 * s; 2], "{g:?}");
        }
    }

    /// The last slot an index can name lands in the last chunk `chunks`
    /// counts, with no overflow on the way.
    #[test]
    fn the_last_index_has_a_chunk() {
        let g = ChunkGeometry::new(1 << 24);
        let (c, off, len) = g.locate(u32::MAX);
        assert_eq!((c, off, len), (8, (1 << 31) - 1, 1 << 31));
        assert_eq!(g.chunks(u32::MAX), 9);
    }

    #[test]
    #[should_panic(expected = "power of two")]
    fn a_first_chunk_that_is_not_a_power_of_two_is_refused() {
        let _ = ChunkGeometry::new(1000);
    }
}

//! The IPVS estimator arithmetic, exactly as `net/netfilter/ipvs/ip_vs_est.c`
//! does it (unchanged from 2.6 to the 6.2 kthread rewrite).
//!
//! Every 2 s, for each of the five counters of an estimator:
//!
//! ```text
//! delta = total - last            (u64, wrapping)
//! last  = total
//! rate  = delta << 9              conns, inpkts, outpkts: x 2^10 / 2 s
//! rate  = delta << 4              inbytes, outbytes:      x 2^5  / 2 s
//! avg  += ((s64)rate - (s64)avg) >> 2        (arithmetic shift, wrapping)
//! ```
//!
//! and the values shown to users are rounded as `ip_vs_read_estimator` does:
//! `(avg + 0x1FF) >> 10` for per-second counts and `(avg + 0xF) >> 5` for bytes
//! per second. The weight 1/4 per 2 s gives a time constant of about 7 s: from
//! zero, a constant rate reaches 76 % after 10 s and 99 % after 16 periods (32 s).

/// Shift applied to a 2 s delta of connections or packets (x 2^10 / 2).
pub const COUNT_SHIFT: u32 = 9;
/// Shift applied to a 2 s delta of bytes (x 2^5 / 2).
pub const BYTE_SHIFT: u32 = 4;
/// Per-field shift, in field order conns, inpkts, outpkts, inbytes, outbytes.
pub const SHIFTS: [u32; 5] = [
    COUNT_SHIFT,
    COUNT_SHIFT,
    COUNT_SHIFT,
    BYTE_SHIFT,
    BYTE_SHIFT,
];

/// The scaled rate of one period: `delta << shift` (bits shifted out are lost,
/// as in the kernel's `u64` arithmetic).
#[inline]
#[must_use]
pub const fn scaled_rate(delta: u64, shift: u32) -> u64 {
    delta << shift
}

/// One EWMA step: `avg += ((s64)rate - (s64)avg) >> 2`.
#[inline]
#[must_use]
pub const fn step(avg: u64, rate: u64) -> u64 {
    let diff = (rate as i64).wrapping_sub(avg as i64) >> 2;
    avg.wrapping_add(diff as u64)
}

/// Read-out of a connection or packet average: `(avg + 0x1FF) >> 10`.
#[inline]
#[must_use]
pub const fn read_count(avg: u64) -> u64 {
    avg.wrapping_add(0x1FF) >> 10
}

/// Read-out of a byte average: `(avg + 0xF) >> 5`.
#[inline]
#[must_use]
pub const fn read_bytes(avg: u64) -> u64 {
    avg.wrapping_add(0xF) >> 5
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_rate_fixed_point() {
        // 1000 conns/s: delta 2000 per 2 s, rate 2000 << 9 = 1000 << 10.
        let rate = scaled_rate(2000, COUNT_SHIFT);
        assert_eq!(rate, 1000 << 10);
        let mut avg = 0;
        for _ in 0..200 {
            avg = step(avg, rate);
        }
        // Integer EWMA stalls 3 units below the target (diff >> 2 == 0 when diff < 4).
        assert!(rate - avg < 4, "avg {avg} rate {rate}");
        assert_eq!(read_count(avg), 1000);
    }

    #[test]
    fn decreasing_rate_uses_arithmetic_shift() {
        let avg = step(1 << 20, 0);
        assert_eq!(avg, (1 << 20) - (1 << 18));
        // Small negative differences still move by floor division (toward -inf).
        assert_eq!(step(1, 0), 0);
        assert_eq!(step(5, 0), 3);
    }

    #[test]
    fn byte_readout_rounds_like_ipvs() {
        assert_eq!(read_bytes(0), 0);
        assert_eq!(read_bytes(1), 0);
        assert_eq!(read_bytes(0x11), 1);
        assert_eq!(read_count(0x201), 1);
        assert_eq!(read_count(0x200), 0);
    }
}

//! `sh` (source hashing) and `mh` (Maglev hashing): lookup tables from a
//! hash of the client address to a backend.
//!
//! Both tables are built from weights only, never from health, so a backend
//! going down or up does not move anyone else's clients; availability is
//! checked at pick time. A client whose slot holds an unavailable backend gets
//! `None`, or with `fallback` the first available backend along a
//! deterministic probe sequence (IPVS `sh-fallback` / `mh-fallback`). An
//! overloaded backend ([`crate::Load::overloaded`]) counts as unavailable
//! there, as IPVS's `is_unavailable` counts an `OVERLOAD` destination; `dh`
//! gives `None` for one (IPVS `ip_vs_dh.c`: `is_overloaded`).
//!
//! Hashing: SipHash-1-3 keyed by the configured [`HashSeed`] over the client's
//! canonical IP octets (an IPv4-mapped IPv6 address hashes as the IPv4 one),
//! optionally the port, and a probe offset — where IPVS multiplies or
//! hsiphashes a folded 32-bit address with fixed keys. All integers are hashed
//! big-endian so that every machine sharing a seed maps clients identically.

use std::hash::Hasher;
use std::net::{IpAddr, SocketAddr};

use siphasher::sip::SipHasher13;

use crate::{
    BackendInfo, BuildError, ClientAddr, DestAddr, HashSeed, LoadView, MhTableSize, SchedConfig,
    can_take, gcd,
};

/// Table slot holding no backend (only when there are none with turns).
const EMPTY: u32 = u32::MAX;

fn hash_addr(key: HashSeed, addr: SocketAddr, with_port: bool, offset: u32) -> u64 {
    let mut h = SipHasher13::new_with_keys(key.k0, key.k1);
    match addr.ip().to_canonical() {
        IpAddr::V4(a) => h.write(&a.octets()),
        IpAddr::V6(a) => h.write(&a.octets()),
    }
    if with_port {
        h.write(&addr.port().to_be_bytes());
    }
    h.write(&offset.to_be_bytes());
    h.finish()
}

/// Second key for Maglev's skip hash, derived from the configured one.
fn skip_key(key: HashSeed) -> HashSeed {
    HashSeed::new(
        key.k0 ^ 0x6A09_E667_F3BC_C908,
        key.k1 ^ 0xBB67_AE85_84CA_A73B,
    )
}

fn client_hash(cfg: &SchedConfig, client: ClientAddr, offset: u32) -> u64 {
    hash_addr(cfg.hash_seed, client.0, cfg.hash_port, offset)
}

fn slot_backend<'a>(
    table: &[u32],
    backends: &'a [BackendInfo],
    slot: usize,
) -> Option<(usize, &'a BackendInfo)> {
    let idx = *table.get(slot)?;
    if idx == EMPTY {
        return None;
    }
    let i = idx as usize;
    backends.get(i).map(|b| (i, b))
}

/// Turns (slots per round) of each backend: weights divided by
/// their gcd and shifted right so that the largest fits in `bits` bits (IPVS
/// `rshift`); a non-zero weight keeps at least one turn, a zero weight gets
/// `zero_turns`. Deviation from IPVS: the shift grows further until one round
/// fits in the table (`budget` slots), otherwise backends late in the list
/// would get no slot at all.
fn turns(weights: &[u32], bits: u32, zero_turns: u32, budget: u64) -> Vec<u32> {
    let g = weights.iter().copied().fold(0, gcd).max(1);
    let max = weights.iter().copied().max().unwrap_or(0) / g;
    let fls = u32::BITS - max.leading_zeros();
    let scaled = |shift: u32| -> Vec<u32> {
        weights
            .iter()
            .map(|&w| {
                if w == 0 {
                    zero_turns
                } else {
                    ((w / g) >> shift).max(1)
                }
            })
            .collect()
    };
    let mut shift = fls.saturating_sub(bits);
    let mut t = scaled(shift);
    while t.iter().map(|&x| u64::from(x)).sum::<u64>() > budget && shift < fls {
        shift += 1;
        t = scaled(shift);
    }
    t
}

/// Deals `slots` table slots by turns, calling `claim(i)` once per slot for
/// backend `i`. A round is `max(turns)` passes; pass `p` gives one slot to
/// every backend with more than `p` turns. IPVS deals a backend's turns
/// consecutively instead; the counts of a full round are the same, and
/// interleaving keeps the last, partial round from favouring the backends
/// early in the list by up to their whole turns.
fn deal(turns: &[u32], slots: usize, mut claim: impl FnMut(usize)) {
    let max = turns.iter().copied().max().unwrap_or(0);
    if max == 0 {
        return;
    }
    let mut dealt = 0;
    loop {
        for p in 0..max {
            for (i, _) in turns.iter().enumerate().filter(|(_, t)| **t > p) {
                if dealt == slots {
                    return;
                }
                claim(i);
                dealt += 1;
            }
        }
    }
}

/// Whether some backend can take a connection: the fallback probes only
/// then, so a service whose every backend is overloaded refuses a client
/// after one look at each instead of `sh`'s 256 or `mh`'s table-size
/// hashes. (An available backend has weight > 0, so it has a slot in
/// either table, except in `sh` with more than 256 backends: the probe then
/// ends as IPVS's does, with `None` after 256 hashes.)
fn any_can_take<L: LoadView + ?Sized>(backends: &[BackendInfo], load: &L) -> bool {
    backends
        .iter()
        .enumerate()
        .any(|(i, b)| can_take(b, i, load))
}

/// Source hashing: 256 buckets dealt round-robin to the backends in list
/// order, each taking `weight` buckets per round (IPVS `ip_vs_sh_reassign`,
/// where a weight-0 backend still takes one bucket; see [`deal`]).
///
/// Deviation: weights are divided by their gcd and scaled down until one
/// round fits in 256 buckets (IPVS would let a first backend of weight >= 256
/// take every bucket).
#[derive(Debug)]
pub(crate) struct Sh {
    buckets: Box<[u32; SH_BUCKETS]>,
}

const SH_BUCKETS: usize = 256;

impl Sh {
    pub(crate) fn new(backends: &[BackendInfo]) -> Self {
        let mut buckets = Box::new([EMPTY; SH_BUCKETS]);
        let weights: Vec<u32> = backends.iter().map(|b| b.weight).collect();
        let turns = turns(&weights, 8, 1, SH_BUCKETS as u64);
        let mut next = 0;
        deal(&turns, SH_BUCKETS, |i| {
            buckets[next] = i as u32;
            next += 1;
        });
        Self { buckets }
    }

    pub(crate) fn pick<L: LoadView + ?Sized>(
        &self,
        backends: &[BackendInfo],
        load: &L,
        client: ClientAddr,
        cfg: &SchedConfig,
    ) -> Option<usize> {
        let ihash = (client_hash(cfg, client, 0) as usize) % SH_BUCKETS;
        let (i, b) = slot_backend(&self.buckets[..], backends, ihash)?;
        if can_take(b, i, load) {
            return Some(i);
        }
        if !cfg.fallback || !any_can_take(backends, load) {
            return None;
        }
        // IPVS probe (`ip_vs_sh_get_fallback`): rehash the client with
        // offsets ihash, ihash+1, ... so that the clients of an unavailable
        // backend spread over the others. (Walking the buckets from the
        // client's one sent them all to the backend dealt the next bucket.)
        (0..SH_BUCKETS)
            .filter_map(|k| {
                let roffset = ((ihash + k) % SH_BUCKETS) as u32;
                let slot = (client_hash(cfg, client, roffset) as usize) % SH_BUCKETS;
                slot_backend(&self.buckets[..], backends, slot)
            })
            .find(|&(i, b)| can_take(b, i, load))
            .map(|(i, _)| i)
    }

    #[cfg(test)]
    fn counts(&self, n: usize) -> Vec<usize> {
        (0..n)
            .map(|i| self.buckets.iter().filter(|&&b| b as usize == i).count())
            .collect()
    }
}

/// Destination hashing (IPVS `ip_vs_dh.c`): 256 buckets dealt round-robin
/// to the backends in list order, weights ignored (a weight-0 backend keeps
/// its buckets); the connection's destination IP picks the bucket. A bucket
/// whose backend is unavailable gives `None`: IPVS has no `dh` fallback.
#[derive(Debug)]
pub(crate) struct Dh {
    buckets: Box<[u32; SH_BUCKETS]>,
}

impl Dh {
    pub(crate) fn new(backends: &[BackendInfo]) -> Self {
        let mut buckets = Box::new([EMPTY; SH_BUCKETS]);
        if !backends.is_empty() {
            for (slot, b) in buckets.iter_mut().enumerate() {
                // `backends.len() <= MAX_BACKENDS < u32::MAX`, checked by the caller.
                *b = (slot % backends.len()) as u32;
            }
        }
        Self { buckets }
    }

    pub(crate) fn pick<L: LoadView + ?Sized>(
        &self,
        backends: &[BackendInfo],
        load: &L,
        dest: DestAddr,
        cfg: &SchedConfig,
    ) -> Option<usize> {
        let slot =
            (hash_addr(cfg.hash_seed, SocketAddr::new(dest.0, 0), false, 0) as usize) % SH_BUCKETS;
        let (i, b) = slot_backend(&self.buckets[..], backends, slot)?;
        can_take(b, i, load).then_some(i)
    }
}

/// Maglev hashing (IPVS `ip_vs_mh.c`): a prime-sized lookup table; backend
/// `i` has a permutation `offset_i + k * skip_i (mod M)` from two hashes of
/// its address, and backends take turns claiming their next free preferred
/// slot, `turns_i` slots per round, until the table is full.
///
/// Turns come from the *last non-zero* weight (IPVS `last_weight`), so
/// quiescing a backend with weight 0 leaves the table unchanged: its clients
/// get `None` (or fall back) and nobody else moves.
#[derive(Debug)]
pub(crate) struct Mh {
    table: Box<[u32]>,
    any_available: bool,
}

impl Mh {
    pub(crate) fn new(
        cfg: &SchedConfig,
        backends: &[BackendInfo],
        last_weights: &[u32],
    ) -> Result<Self, BuildError> {
        let m = cfg.mh_table_size.get() as usize;
        if backends.len() > m {
            return Err(BuildError::TooManyBackends {
                count: backends.len(),
                max: m,
            });
        }
        let mut table = vec![EMPTY; m].into_boxed_slice();
        let turns = turns(last_weights, mh_turn_bits(cfg.mh_table_size), 0, m as u64);
        let any_available = backends
            .iter()
            .zip(&turns)
            .any(|(b, &t)| t > 0 && b.available());
        if turns.iter().all(|&t| t == 0) {
            return Ok(Self {
                table,
                any_available,
            });
        }
        let skip_key = skip_key(cfg.hash_seed);
        let mut perm: Vec<(usize, usize)> = backends
            .iter()
            .map(|b| {
                let offset = (hash_addr(cfg.hash_seed, b.addr.0, true, 0) % m as u64) as usize;
                let skip = (hash_addr(skip_key, b.addr.0, true, 0) % (m as u64 - 1)) as usize + 1;
                (offset, skip)
            })
            .collect();
        // M is prime and 1 <= skip < M, so each permutation reaches every
        // slot, and the table has a free slot whenever `deal` claims one: the
        // search for the backend's next preferred free slot always ends.
        deal(&turns, m, |i| {
            let (pos, skip) = &mut perm[i];
            while table[*pos] != EMPTY {
                *pos += *skip;
                if *pos >= m {
                    *pos -= m;
                }
            }
            table[*pos] = i as u32;
        });
        Ok(Self {
            table,
            any_available,
        })
    }

    pub(crate) fn pick<L: LoadView + ?Sized>(
        &self,
        backends: &[BackendInfo],
        load: &L,
        client: ClientAddr,
        cfg: &SchedConfig,
    ) -> Option<usize> {
        let m = self.table.len();
        if m == 0 {
            return None;
        }
        let ihash = (client_hash(cfg, client, 0) % m as u64) as usize;
        let (i, b) = slot_backend(&self.table, backends, ihash)?;
        if can_take(b, i, load) {
            return Some(i);
        }
        if !cfg.fallback || !self.any_available || !any_can_take(backends, load) {
            return None;
        }
        // IPVS probe: rehash the client with offsets ihash, ihash+1, ...
        (0..m)
            .filter_map(|k| {
                let roffset = ((ihash + k) % m) as u32;
                let slot = (client_hash(cfg, client, roffset) % m as u64) as usize;
                slot_backend(&self.table, backends, slot)
            })
            .find(|&(i, b)| can_take(b, i, load))
            .map(|(i, _)| i)
    }

    #[cfg(test)]
    fn counts(&self, n: usize) -> Vec<usize> {
        (0..n)
            .map(|i| self.table.iter().filter(|&&b| b as usize == i).count())
            .collect()
    }
}

/// IPVS bounds turns by `CONFIG_IP_VS_MH_TAB_INDEX / 2` bits, the index being
/// 8 for 251 up to 17 for 131071 (6 bits for the default 4093).
fn mh_turn_bits(size: MhTableSize) -> u32 {
    let index = MhTableSize::PRIMES
        .iter()
        .position(|&p| p == size.get())
        .unwrap_or(4) as u32
        + 8;
    index / 2
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::*;
    use crate::{Load, Scheduler, SchedulerKind, SplitMix64};
    use std::net::Ipv6Addr;

    const CLIENTS: u32 = 40_000;

    fn picks(s: &Scheduler) -> Vec<Option<usize>> {
        let idle: &[Load] = &[];
        let mut rng = SplitMix64::new(0);
        (0..CLIENTS)
            .map(|i| s.pick(client(i), idle, &mut rng))
            .collect()
    }

    fn with_fallback(kind: SchedulerKind, set: &[BackendInfo], fallback: bool) -> Scheduler {
        let mut cfg = *sched(kind, &[]).config();
        cfg.fallback = fallback;
        Scheduler::new(cfg, set).expect("valid")
    }

    fn table_counts(s: &Scheduler) -> Vec<usize> {
        match &s.algo {
            crate::Algo::Sh(t) => t.counts(s.backends().len()),
            crate::Algo::Mh(t) => t.counts(s.backends().len()),
            _ => unreachable!("not a hashing scheduler"),
        }
    }

    fn assert_shares(h: &[u32], weights: &[u32], tol: f64) {
        let total: u32 = weights.iter().sum();
        let n: u32 = h.iter().sum();
        for (i, &w) in weights.iter().enumerate() {
            let share = f64::from(h[i]) / f64::from(n);
            let want = f64::from(w) / f64::from(total);
            assert!(
                (share - want).abs() < tol,
                "backend {i}: {share:.4} vs {want:.4} ({h:?})"
            );
        }
    }

    #[test]
    fn sh_buckets_follow_weights_exactly() {
        let s = sched(
            SchedulerKind::Sh,
            &[backend(1, 1), backend(2, 2), backend(3, 3)],
        );
        // 42 rounds of 6 buckets, then A, B, B, C.
        assert_eq!(table_counts(&s), [43, 86, 127]);
        // Weight 0 keeps one bucket per round (IPVS), heavy weights are scaled.
        let s = sched(SchedulerKind::Sh, &[backend(1, 0), backend(2, 1)]);
        assert_eq!(table_counts(&s), [128, 128]);
        let s = sched(SchedulerKind::Sh, &[backend(1, 1000), backend(2, 3000)]);
        assert_eq!(table_counts(&s), [64, 192]);
        // 1000:999 scales to 125:124 so a round fits; the partial last round
        // is interleaved (A B A B A B A).
        let s = sched(SchedulerKind::Sh, &[backend(1, 1000), backend(2, 999)]);
        assert_eq!(table_counts(&s), [129, 127]);
    }

    #[test]
    fn sh_client_distribution_and_consistency() {
        let s = sched(
            SchedulerKind::Sh,
            &[backend(1, 1), backend(2, 2), backend(3, 1)],
        );
        let h = histogram(&s, CLIENTS);
        assert_eq!(h[3], 0);
        assert_shares(&h[..3], &[1, 2, 1], 0.02);
        assert_eq!(picks(&s), picks(&s));
    }

    #[test]
    fn sh_down_backend_without_and_with_fallback() {
        let mut set = vec![backend(1, 1), backend(2, 1), backend(3, 1)];
        let before = picks(&sched(SchedulerKind::Sh, &set));
        set[1].up = false;
        for fallback in [false, true] {
            let after = picks(&with_fallback(SchedulerKind::Sh, &set, fallback));
            for (b, a) in before.iter().zip(&after) {
                if *b == Some(1) {
                    if fallback {
                        assert!(
                            matches!(a, Some(0 | 2)),
                            "fallback to an available backend: {a:?}"
                        );
                    } else {
                        assert_eq!(*a, None);
                    }
                } else {
                    assert_eq!(a, b, "a client of a healthy backend moved");
                }
            }
        }
    }

    /// With `sh-fallback` the clients of a down backend spread over the
    /// others (IPVS rehashes them). Walking the buckets sent every one of
    /// them to the backend dealt the bucket after theirs.
    #[test]
    fn sh_fallback_spreads_a_down_backends_clients() {
        let mut set: Vec<_> = (1..=4).map(|i| backend(i, 1)).collect();
        let before = picks(&sched(SchedulerKind::Sh, &set));
        set[1].up = false;
        let after = picks(&with_fallback(SchedulerKind::Sh, &set, true));
        let mut moved = [0u32; 4];
        for (b, a) in before.iter().zip(&after) {
            if *b == Some(1) {
                moved[a.expect("fallback")] += 1;
            }
        }
        assert_eq!(moved[1], 0);
        assert!(
            moved.iter().enumerate().all(|(i, &m)| (i == 1) == (m == 0)),
            "a down backend's clients all went to one backend: {moved:?}"
        );
    }

    #[test]
    fn mh_table_follows_weights() {
        let s = sched(
            SchedulerKind::Mh,
            &[backend(1, 1), backend(2, 2), backend(3, 3)],
        );
        let c = table_counts(&s);
        assert_eq!(c.iter().sum::<usize>(), 4093);
        for (got, w) in c.iter().zip([1, 2, 3]) {
            let want = 4093 * w / 6;
            assert!(got.abs_diff(want) <= 3, "{c:?}");
        }
        let h = histogram(&s, CLIENTS);
        assert_eq!(h[3], 0);
        assert_shares(&h[..3], &[1, 2, 3], 0.015);
    }

    #[test]
    fn mh_weights_are_scaled_to_turn_bits() {
        // 64000 / 1000 = 64 needs 7 bits > 6: shifted to turns 32 and 1 (approx 32:1).
        let s = sched(SchedulerKind::Mh, &[backend(1, 64_000), backend(2, 1000)]);
        let c = table_counts(&s);
        assert!(c[0] > 25 * c[1] && c[0] < 40 * c[1], "{c:?}");
    }

    #[test]
    fn mh_many_mixed_weights_all_get_slots() {
        // 100 backends of weight 62 or 63: IPVS's turns (62/63 each) would fill
        // the table before the 66th backend; scaled turns (31 each) and an
        // interleaved last round give everyone 40 or 41 slots.
        let set: Vec<_> = (0..100u32)
            .map(|i| BackendInfo::new(SocketAddr::from(([10, 2, 0, i as u8], 80)), 62 + i % 2))
            .collect();
        let c = table_counts(&sched(SchedulerKind::Mh, &set));
        let (lo, hi) = (c.iter().min().copied(), c.iter().max().copied());
        assert_eq!((lo, hi), (Some(40), Some(41)));
    }

    #[test]
    fn mh_is_consistent_across_instances_with_one_seed() {
        let set: Vec<_> = (1..=8).map(|i| backend(i, 1)).collect();
        let a = picks(&sched(SchedulerKind::Mh, &set));
        assert_eq!(a, picks(&sched(SchedulerKind::Mh, &set)));
        assert!(a.iter().all(Option::is_some));
        let mut cfg = *sched(SchedulerKind::Mh, &[]).config();
        cfg.hash_seed = HashSeed::new(77, 88);
        let other = picks(&Scheduler::new(cfg, &set).expect("valid"));
        let same = a.iter().zip(&other).filter(|(x, y)| x == y).count();
        assert!(
            same < CLIENTS as usize / 4,
            "a different seed should reshuffle: {same}"
        );
    }

    #[test]
    fn mh_removing_a_backend_moves_few_other_clients() {
        let set: Vec<_> = (1..=10).map(|i| backend(i, 1)).collect();
        let s = sched(SchedulerKind::Mh, &set);
        let before = picks(&s);
        let removed = 4;
        let mut smaller = set.clone();
        smaller.remove(removed);
        let after = picks(&s.rebuild(&smaller).expect("valid"));
        let (mut kept, mut others) = (0, 0);
        for (b, a) in before.iter().zip(&after) {
            let b = b.expect("all available");
            let a = smaller[a.expect("all available")].addr;
            if b != removed {
                others += 1;
                kept += usize::from(set[b].addr == a);
            }
        }
        let kept_share = kept as f64 / others as f64;
        assert!(
            kept_share > 0.95,
            "only {kept_share:.3} of unaffected clients kept their backend"
        );
    }

    #[test]
    fn mh_quiesce_keeps_table_and_fallback_spreads() {
        let set: Vec<_> = (1..=5).map(|i| backend(i, 2)).collect();
        let s = with_fallback(SchedulerKind::Mh, &set, false);
        let before = picks(&s);
        let mut quiesced = set.clone();
        quiesced[2].weight = 0;
        for fallback in [false, true] {
            let base = with_fallback(SchedulerKind::Mh, &set, fallback);
            let after = picks(&base.rebuild(&quiesced).expect("valid"));
            let mut moved = [0u32; 5];
            for (b, a) in before.iter().zip(&after) {
                if *b == Some(2) {
                    match a {
                        None => assert!(!fallback),
                        Some(i) => {
                            assert!(fallback && *i != 2, "{a:?}");
                            moved[*i] += 1;
                        }
                    }
                } else {
                    assert_eq!(a, b, "a client of an untouched backend moved");
                }
            }
            if fallback {
                // The quiesced backend's clients spread over all the others.
                assert!(
                    moved.iter().enumerate().all(|(i, &m)| (i == 2) == (m == 0)),
                    "{moved:?}"
                );
            }
        }
        // A scheduler built fresh with weight 0 has no last weight: the
        // backend gets no slots at all (IPVS on add with weight 0).
        let fresh = sched(SchedulerKind::Mh, &quiesced);
        assert_eq!(table_counts(&fresh)[2], 0);
        assert!(picks(&fresh).iter().all(|p| p.is_some() && *p != Some(2)));
    }

    #[test]
    fn mh_all_unavailable_with_fallback_is_none() {
        let mut set = vec![backend(1, 1), backend(2, 1)];
        set[0].up = false;
        set[1].up = false;
        let s = with_fallback(SchedulerKind::Mh, &set, true);
        assert!(picks(&s).iter().all(Option::is_none));
    }

    #[test]
    fn hash_port_option_spreads_one_client_ip() {
        let set: Vec<_> = (1..=4).map(|i| backend(i, 1)).collect();
        for kind in [SchedulerKind::Sh, SchedulerKind::Mh] {
            let mut cfg = *sched(kind, &[]).config();
            let ip = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1));
            let port_picks = |cfg| {
                let s = Scheduler::new(cfg, &set).expect("valid");
                let mut seen = [false; 4];
                for port in 1000..1100 {
                    let c = ClientAddr(SocketAddr::new(ip, port));
                    seen[s
                        .pick(c, &[] as &[Load], &mut SplitMix64::new(0))
                        .expect("available")] = true;
                }
                seen.iter().filter(|&&x| x).count()
            };
            assert_eq!(
                port_picks(cfg),
                1,
                "{kind}: without port hashing one IP maps to one backend"
            );
            cfg.hash_port = true;
            assert_eq!(port_picks(cfg), 4, "{kind}: with port hashing ports spread");
        }
    }

    #[test]
    fn ipv4_mapped_client_hashes_like_ipv4() {
        let set: Vec<_> = (1..=4).map(|i| backend(i, 1)).collect();
        let s = sched(SchedulerKind::Mh, &set);
        for n in 0..200 {
            let v4 = client(n);
            let IpAddr::V4(a) = v4.0.ip() else {
                unreachable!()
            };
            let mapped = ClientAddr(SocketAddr::new(IpAddr::V6(a.to_ipv6_mapped()), 1));
            let mut rng = SplitMix64::new(0);
            assert_eq!(
                s.pick(v4, &[] as &[Load], &mut rng),
                s.pick(mapped, &[] as &[Load], &mut rng)
            );
        }
    }

    #[test]
    fn turn_bits_follow_ipvs_table_index() {
        assert_eq!(mh_turn_bits(MhTableSize::DEFAULT), 6);
        assert_eq!(mh_turn_bits(MhTableSize::new(251).expect("prime")), 4);
        assert_eq!(mh_turn_bits(MhTableSize::new(131_071).expect("prime")), 8);
    }
}

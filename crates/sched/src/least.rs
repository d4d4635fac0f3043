//! Load-based schedulers: `lc`, `wlc`, `sed`, `nq`, `fo`, `ovf` (IPVS) and
//! `p2c`.
//!
//! Weighted comparisons follow IPVS and avoid division: backend `d` replaces
//! the current best `b` when `overhead(b) * weight(d) > overhead(d) * weight(b)`,
//! i.e. `overhead(d) / weight(d) < overhead(b) / weight(b)`. Ties keep the
//! earlier backend. Products are computed in `u128` so they cannot overflow.
//!
//! An overloaded backend ([`Load::overloaded`]) is skipped inside each loop,
//! as IPVS's loops skip an `OVERLOAD` destination: the rule then applies to
//! the others (`wlc` takes the least loaded of the rest, `fo` the highest
//! weight of the rest...).

use crate::{BackendInfo, Load, LoadView, RandomSource};

/// Backends that can take a connection (available, not overloaded) with
/// their index and load; each load is read once, and only for available
/// backends.
fn candidates<'a, L: LoadView + ?Sized>(
    backends: &'a [BackendInfo],
    load: &'a L,
) -> impl Iterator<Item = (usize, &'a BackendInfo, Load)> {
    backends
        .iter()
        .enumerate()
        .filter(|(_, b)| b.available())
        .map(|(i, b)| (i, b, load.load(i)))
        .filter(|(_, _, l)| !l.overloaded)
}

/// `true` when `(oh_d, w_d)` is strictly better than `(oh_b, w_b)`.
pub(crate) fn better(oh_d: u64, w_d: u32, oh_b: u64, w_b: u32) -> bool {
    u128::from(oh_b) * u128::from(w_d) > u128::from(oh_d) * u128::from(w_b)
}

/// Least weighted `overhead` over the backends that can take a connection
/// (IPVS `wlc` / `sed` loop).
fn least_weighted<L: LoadView + ?Sized>(
    backends: &[BackendInfo],
    load: &L,
    overhead: impl Fn(Load) -> u64,
) -> Option<usize> {
    let mut best: Option<(usize, u64, u32)> = None;
    for (i, b, l) in candidates(backends, load) {
        let oh = overhead(l);
        match best {
            Some((_, boh, bw)) if !better(oh, b.weight, boh, bw) => {}
            _ => best = Some((i, oh, b.weight)),
        }
    }
    best.map(|(i, _, _)| i)
}

/// `lc`: least `active * 256 + inactive`; weights only gate availability.
pub(crate) fn lc<L: LoadView + ?Sized>(backends: &[BackendInfo], load: &L) -> Option<usize> {
    let mut best: Option<(usize, u64)> = None;
    for (i, _, l) in candidates(backends, load) {
        let oh = l.conn_overhead();
        if best.is_none_or(|(_, boh)| oh < boh) {
            best = Some((i, oh));
        }
    }
    best.map(|(i, _)| i)
}

/// `wlc`: least `(active * 256 + inactive) / weight`.
pub(crate) fn wlc<L: LoadView + ?Sized>(backends: &[BackendInfo], load: &L) -> Option<usize> {
    least_weighted(backends, load, |l| l.conn_overhead())
}

/// `sed`: least `(active + 1) / weight`.
pub(crate) fn sed<L: LoadView + ?Sized>(backends: &[BackendInfo], load: &L) -> Option<usize> {
    least_weighted(backends, load, sed_overhead)
}

fn sed_overhead(l: Load) -> u64 {
    l.active.saturating_add(1)
}

/// `nq`: the first available backend with no active connection, else `sed`.
pub(crate) fn nq<L: LoadView + ?Sized>(backends: &[BackendInfo], load: &L) -> Option<usize> {
    let mut best: Option<(usize, u64, u32)> = None;
    for (i, b, l) in candidates(backends, load) {
        if l.active == 0 {
            return Some(i);
        }
        let oh = sed_overhead(l);
        match best {
            Some((_, boh, bw)) if !better(oh, b.weight, boh, bw) => {}
            _ => best = Some((i, oh, b.weight)),
        }
    }
    best.map(|(i, _, _)| i)
}

/// `fo` (IPVS `ip_vs_fo.c`, weighted fail-over): the available backend with
/// the highest weight, the first on a tie. Only `overloaded` is looked at,
/// not the counts.
pub(crate) fn fo<L: LoadView + ?Sized>(backends: &[BackendInfo], load: &L) -> Option<usize> {
    let mut best: Option<(usize, u32)> = None;
    for (i, b, _) in candidates(backends, load) {
        if best.is_none_or(|(_, w)| b.weight > w) {
            best = Some((i, b.weight));
        }
    }
    best.map(|(i, _)| i)
}

/// `ovf` (IPVS `ip_vs_ovf.c`, overflow connections): the highest weight
/// among available backends whose active connections do not exceed their
/// weight (IPVS skips `active > weight`, so a backend of weight `w` takes up
/// to `w + 1` active connections), the first on a tie; `None` when all are
/// full.
pub(crate) fn ovf<L: LoadView + ?Sized>(backends: &[BackendInfo], load: &L) -> Option<usize> {
    let mut best: Option<(usize, u32)> = None;
    for (i, b, l) in candidates(backends, load) {
        if l.active > u64::from(b.weight) {
            continue;
        }
        if best.is_none_or(|(_, w)| b.weight > w) {
            best = Some((i, b.weight));
        }
    }
    best.map(|(i, _)| i)
}

/// Power of two choices: two candidates drawn with probability proportional
/// to weight; the one with the lower `wlc` overhead per weight wins, the first
/// on a tie. Idle backends are therefore chosen in proportion to weight, and
/// a loaded backend loses against a less loaded one. An overloaded candidate
/// loses to one that is not; when both are overloaded the pick is `wlc`'s
/// over the backends that can take it, so an overloaded backend is never
/// returned while another can take the connection.
#[derive(Debug)]
pub(crate) struct P2c {
    /// Cumulative weights of the available backends.
    cumulative: Box<[u64]>,
    /// Backend index of each entry of `cumulative`.
    index: Box<[usize]>,
}

impl P2c {
    pub(crate) fn new(backends: &[BackendInfo]) -> Self {
        let mut sum = 0u64;
        let (cumulative, index): (Vec<u64>, Vec<usize>) = backends
            .iter()
            .enumerate()
            .filter(|(_, b)| b.available())
            .map(|(i, b)| {
                sum += u64::from(b.weight);
                (sum, i)
            })
            .unzip();
        Self {
            cumulative: cumulative.into(),
            index: index.into(),
        }
    }

    /// A weight-proportional random available backend.
    fn draw<R: RandomSource + ?Sized>(&self, rng: &mut R) -> Option<usize> {
        let total = *self.cumulative.last()?;
        // Multiply-shift maps 64 random bits onto [0, total) (bias < 2^-40
        // for weights up to 2^16 and up to 2^8 backends' worth of weight).
        let r = ((u128::from(rng.next_u64()) * u128::from(total)) >> 64) as u64;
        let slot = self.cumulative.partition_point(|&c| c <= r);
        self.index.get(slot).copied()
    }

    pub(crate) fn pick<L: LoadView + ?Sized, R: RandomSource + ?Sized>(
        &self,
        backends: &[BackendInfo],
        load: &L,
        rng: &mut R,
    ) -> Option<usize> {
        let a = self.draw(rng)?;
        let b = self.draw(rng)?;
        let (la, lb) = (load.load(a), load.load(b));
        match (la.overloaded, lb.overloaded) {
            (true, true) => return wlc(backends, load),
            (true, false) => return Some(b),
            (false, true) => return Some(a),
            (false, false) if a == b => return Some(a),
            (false, false) => {}
        }
        let (wa, wb) = (backends[a].weight, backends[b].weight);
        let (oa, ob) = (la.conn_overhead(), lb.conn_overhead());
        Some(if better(ob, wb, oa, wa) { b } else { a })
    }
}

#[cfg(test)]
mod tests {
    use crate::test_util::*;
    use crate::{Load, SchedulerKind, SplitMix64};

    fn pick(kind: SchedulerKind, weights: &[u32], loads: &[Load]) -> Option<usize> {
        let set: Vec<_> = weights
            .iter()
            .enumerate()
            .map(|(i, &w)| backend(i as u8 + 1, w))
            .collect();
        sched(kind, &set).pick(client(0), loads, &mut SplitMix64::new(1))
    }

    fn l(active: u64, inactive: u64) -> Load {
        Load::new(active, inactive)
    }

    #[test]
    fn lc_uses_active_times_256_plus_inactive() {
        // 1 active (256) beats 300 inactive; weights are ignored.
        assert_eq!(
            pick(SchedulerKind::Lc, &[1, 100], &[l(0, 300), l(1, 0)]),
            Some(1)
        );
        assert_eq!(
            pick(SchedulerKind::Lc, &[1, 100], &[l(0, 200), l(1, 0)]),
            Some(0)
        );
        // Ties keep the first; weight 0 is skipped even when idle.
        assert_eq!(
            pick(SchedulerKind::Lc, &[1, 1], &[l(2, 0), l(2, 0)]),
            Some(0)
        );
        assert_eq!(
            pick(SchedulerKind::Lc, &[0, 1], &[l(0, 0), l(9, 9)]),
            Some(1)
        );
    }

    #[test]
    fn wlc_compares_overhead_times_weight() {
        // 2*256/1 = 512 vs 5*256/3 ≈ 427: the heavier backend wins.
        assert_eq!(
            pick(SchedulerKind::Wlc, &[1, 3], &[l(2, 0), l(5, 0)]),
            Some(1)
        );
        // 2*256/1 = 512 vs 7*256/3 ≈ 597.
        assert_eq!(
            pick(SchedulerKind::Wlc, &[1, 3], &[l(2, 0), l(7, 0)]),
            Some(0)
        );
        // Exact tie (512 vs 1536/3): the earlier one stays.
        assert_eq!(
            pick(SchedulerKind::Wlc, &[1, 3], &[l(2, 0), l(6, 0)]),
            Some(0)
        );
        // Inactive connections count 1/256 of an active one.
        assert_eq!(
            pick(SchedulerKind::Wlc, &[1, 1], &[l(1, 10), l(1, 9)]),
            Some(1)
        );
    }

    #[test]
    fn sed_uses_active_plus_one_over_weight() {
        // Both idle: (0+1)/1 vs (0+1)/4: the heavier wins, unlike wlc's 0 vs 0 tie.
        assert_eq!(
            pick(SchedulerKind::Sed, &[1, 4], &[l(0, 0), l(0, 0)]),
            Some(1)
        );
        assert_eq!(
            pick(SchedulerKind::Wlc, &[1, 4], &[l(0, 0), l(0, 0)]),
            Some(0)
        );
        // 1/1 vs 5/4: the light idle one wins; inactive is ignored.
        assert_eq!(
            pick(SchedulerKind::Sed, &[1, 4], &[l(0, 1000), l(4, 0)]),
            Some(0)
        );
        assert_eq!(
            pick(SchedulerKind::Sed, &[1, 4], &[l(1, 0), l(4, 0)]),
            Some(1)
        );
    }

    #[test]
    fn nq_prefers_any_idle_backend() {
        // sed picks backend 1 ((0+1)/1 > (3+1)/100); nq takes the idle one.
        assert_eq!(
            pick(SchedulerKind::Sed, &[1, 100], &[l(0, 0), l(3, 0)]),
            Some(1)
        );
        assert_eq!(
            pick(SchedulerKind::Nq, &[1, 100], &[l(0, 0), l(3, 0)]),
            Some(0)
        );
        // First idle in list order, even if a later idle one is heavier.
        assert_eq!(
            pick(SchedulerKind::Nq, &[5, 1, 9], &[l(1, 0), l(0, 0), l(0, 0)]),
            Some(1)
        );
        // No idle backend: sed.
        assert_eq!(
            pick(SchedulerKind::Nq, &[1, 4], &[l(1, 0), l(4, 0)]),
            Some(1)
        );
        assert_eq!(
            pick(SchedulerKind::Nq, &[1, 4], &[l(1, 0), l(9, 0)]),
            Some(0)
        );
    }

    /// Simulates connections that never close: each pick adds one active
    /// connection. Weighted least-load schedulers then spread in proportion
    /// to weight, exactly (wlc, sed) or nearly (p2c).
    fn simulate(kind: SchedulerKind, weights: &[u32], picks: usize) -> Vec<u64> {
        let set: Vec<_> = weights
            .iter()
            .enumerate()
            .map(|(i, &w)| backend(i as u8 + 1, w))
            .collect();
        let s = sched(kind, &set);
        let mut loads = vec![Load::default(); set.len()];
        let mut rng = SplitMix64::new(0x5eed);
        for i in 0..picks {
            let b = s
                .pick(client(i as u32), loads.as_slice(), &mut rng)
                .expect("available");
            loads[b].active += 1;
        }
        loads.iter().map(|l| l.active).collect()
    }

    #[test]
    fn weighted_least_load_tracks_weights() {
        for kind in [SchedulerKind::Wlc, SchedulerKind::Sed, SchedulerKind::Nq] {
            assert_eq!(
                simulate(kind, &[1, 2, 3, 0], 600),
                [100, 200, 300, 0],
                "{kind}"
            );
        }
        // lc ignores weights.
        assert_eq!(
            simulate(SchedulerKind::Lc, &[1, 2, 3, 0], 600),
            [200, 200, 200, 0]
        );
    }

    #[test]
    fn p2c_idle_distribution_follows_weights() {
        let set = [backend(1, 1), backend(2, 3), backend(3, 0), backend(4, 4)];
        let s = sched(SchedulerKind::P2c, &set);
        let n = 80_000;
        let h = histogram(&s, n);
        assert_eq!(h[2], 0);
        assert_eq!(h[4], 0);
        for (i, w) in [(0, 1.0), (1, 3.0), (3, 4.0)] {
            let share = f64::from(h[i]) / f64::from(n);
            let want = w / 8.0;
            assert!(
                (share - want).abs() < 0.01,
                "backend {i}: {share} vs {want} ({h:?})"
            );
        }
    }

    #[test]
    fn p2c_under_load_balances_by_weight() {
        let got = simulate(SchedulerKind::P2c, &[1, 2, 1], 40_000);
        let want = [10_000.0, 20_000.0, 10_000.0];
        for (g, w) in got.iter().zip(want) {
            // Two choices keep each backend within a few connections of its share.
            assert!((*g as f64 - w).abs() < 0.01 * w, "{got:?}");
        }
    }

    #[test]
    fn p2c_prefers_the_less_loaded_candidate() {
        let set = [backend(1, 1), backend(2, 1)];
        let s = sched(SchedulerKind::P2c, &set);
        let loads = [l(100, 0), l(0, 0)];
        let mut rng = SplitMix64::new(3);
        let hits = (0..10_000)
            .filter(|&i| s.pick(client(i), loads.as_slice(), &mut rng) == Some(1))
            .count();
        // Backend 0 wins only when both draws are backend 0: about 1/4.
        assert!((7_200..=7_800).contains(&hits), "{hits}");
    }

    #[test]
    fn load_view_closure_is_accepted() {
        let set = [backend(1, 1), backend(2, 1)];
        let s = sched(SchedulerKind::Lc, &set);
        let view = |i: usize| if i == 0 { l(5, 0) } else { l(1, 0) };
        assert_eq!(s.pick(client(0), &view, &mut SplitMix64::new(0)), Some(1));
    }
}

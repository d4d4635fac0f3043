//! Property tests of the schedulers against small models: random backend
//! sets (weights including 0, some down, some overloaded), random loads,
//! destinations and times.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use proptest::prelude::*;
use weir_sched::*;

/// (weight, up, active connections, overloaded)
type Spec = (u32, bool, u64, bool);

fn backends() -> impl Strategy<Value = Vec<Spec>> {
    prop::collection::vec(
        (
            0u32..6,
            prop::bool::weighted(0.8),
            0u64..8,
            prop::bool::weighted(0.25),
        ),
        0..7,
    )
}

fn build(kind: SchedulerKind, spec: &[Spec]) -> (Scheduler, Vec<Load>) {
    build_with(SchedConfig::new(kind, HashSeed::new(3, 4)), spec)
}

fn build_with(cfg: SchedConfig, spec: &[Spec]) -> (Scheduler, Vec<Load>) {
    let set: Vec<BackendInfo> = spec
        .iter()
        .enumerate()
        .map(|(i, &(w, up, _, _))| {
            let mut b = BackendInfo::new(SocketAddr::from(([10, 0, 0, i as u8], 80)), w);
            b.up = up;
            b
        })
        .collect();
    let loads = spec
        .iter()
        .map(|&(_, _, a, o)| Load::new(a, 0).with_overload(o))
        .collect();
    let s = Scheduler::new(cfg, &set).expect("valid");
    (s, loads)
}

/// Whether backend `i` can take a connection: available, not overloaded.
fn can_take(s: &Scheduler, loads: &[Load], i: usize) -> bool {
    s.backends()[i].available() && !loads[i].overloaded
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn req(client: u32, dest: u8, secs: u64) -> Request {
    Request::new(
        SocketAddr::from((Ipv4Addr::from(client), 1000)),
        IpAddr::V4(Ipv4Addr::new(198, 51, 100, dest)),
        Duration::from_secs(secs),
    )
}

fn pick(s: &Scheduler, loads: &[Load], r: Request) -> Option<usize> {
    s.pick_for(r, loads, &mut SplitMix64::new(1))
}

proptest! {
    /// Every kind returns only available backends that are not
    /// overloaded, and `None` while one of those exists only where IPVS
    /// does (`pinned` kinds, `sh` / `mh` without fallback); with fallback,
    /// `sh` / `mh` give `None` only when their probe finds none.
    #[test]
    fn picks_can_take(spec in backends(), reqs in prop::collection::vec((any::<u32>(), 0u8..4, 0u64..200_000), 1..20)) {
        for kind in SchedulerKind::ALL {
            for fallback in [false, true] {
                let cfg = SchedConfig {
                    fallback,
                    ..SchedConfig::new(kind, HashSeed::new(3, 4))
                };
                let (s, loads) = build_with(cfg, &spec);
                let any = (0..spec.len()).any(|i| can_take(&s, &loads, i));
                for &(c, d, t) in &reqs {
                    match pick(&s, &loads, req(c, d, t)) {
                        Some(i) => prop_assert!(can_take(&s, &loads, i), "{kind}: {i} with {spec:?}"),
                        None => prop_assert!(
                            !any || cfg.pinned() || fallback && matches!(kind, SchedulerKind::Sh | SchedulerKind::Mh),
                            "{kind}: None with {spec:?}"
                        ),
                    }
                }
            }
        }
    }

    /// `rr` and `wrr` over a set with some backends overloaded: the picks
    /// of whole cycles are spread over the others exactly by weight (`rr`:
    /// evenly), as if the overloaded ones were not there.
    #[test]
    fn rr_and_wrr_proportions_over_the_rest_are_exact(spec in backends(), cycles in 1u64..4) {
        for kind in [SchedulerKind::Rr, SchedulerKind::Wrr] {
            let (s, loads) = build(kind, &spec);
            let share = |i: usize| match (can_take(&s, &loads, i), kind) {
                (false, _) => 0,
                (true, SchedulerKind::Rr) => 1,
                (true, _) => u64::from(s.backends()[i].weight),
            };
            let shares: Vec<u64> = (0..spec.len()).map(share).collect();
            let total: u64 = shares.iter().sum();
            // wrr's cycle: w / di picks of a backend of weight w, di the
            // gcd of the available weights (overloaded ones included).
            let di = s.backends().iter().filter(|b| b.available())
                .fold(0, |g, b| gcd(g, u64::from(b.weight)))
                .max(1);
            let per_cycle = if kind == SchedulerKind::Rr { total } else { total / di };
            let mut counts = vec![0u64; spec.len()];
            for n in 0..cycles * per_cycle {
                match pick(&s, &loads, req(n as u32, 0, 0)) {
                    Some(i) => counts[i] += 1,
                    None => prop_assert!(false, "{kind}: None with {spec:?}"),
                }
            }
            if total == 0 {
                prop_assert_eq!(pick(&s, &loads, req(0, 0, 0)), None);
            }
            for (i, &c) in counts.iter().enumerate() {
                prop_assert_eq!(c * total, cycles * per_cycle * shares[i], "{} {:?}: {:?}", kind, spec, counts);
            }
        }
    }

    /// `fo`: the first available backend of the highest weight.
    #[test]
    fn fo_is_the_first_highest_weight(spec in backends()) {
        let (s, loads) = build(SchedulerKind::Fo, &spec);
        let want = s.backends().iter().enumerate()
            .filter(|(i, _)| can_take(&s, &loads, *i))
            .fold(None::<(usize, u32)>, |best, (i, b)| match best {
                Some((_, w)) if w >= b.weight => best,
                _ => Some((i, b.weight)),
            })
            .map(|(i, _)| i);
        prop_assert_eq!(pick(&s, &loads, req(1, 1, 0)), want);
    }

    /// `ovf`: the first highest weight among available backends, not
    /// overloaded, with `active <= weight`; `None` when there is none.
    #[test]
    fn ovf_is_the_highest_weight_with_room(spec in backends()) {
        let (s, loads) = build(SchedulerKind::Ovf, &spec);
        let want = s.backends().iter().enumerate()
            .filter(|(i, b)| can_take(&s, &loads, *i) && loads[*i].active <= u64::from(b.weight))
            .fold(None::<(usize, u32)>, |best, (i, b)| match best {
                Some((_, w)) if w >= b.weight => best,
                _ => Some((i, b.weight)),
            })
            .map(|(i, _)| i);
        prop_assert_eq!(pick(&s, &loads, req(1, 1, 0)), want);
    }

    /// `lblc`: a destination asked again within the expiration, loads
    /// unchanged, gets the same backend unless that one is overloaded (by
    /// lblc's rule; one flagged overloaded is never picked at all).
    #[test]
    fn lblc_is_sticky_unless_overloaded(spec in backends(), d in 0u8..4, t in 0u64..100_000, dt in 0u64..86_400) {
        let (s, loads) = build(SchedulerKind::Lblc, &spec);
        let first = pick(&s, &loads, req(1, d, t));
        let second = pick(&s, &loads, req(2, d, t + dt));
        if let Some(i) = first {
            let b = &s.backends()[i];
            let overloaded = loads[i].active > u64::from(b.weight)
                && s.backends().iter().zip(&loads)
                    .any(|(x, l)| x.available() && !l.overloaded && l.active * 2 < u64::from(x.weight));
            prop_assert!(overloaded || second == first, "{first:?} then {second:?}");
        } else {
            prop_assert_eq!(second, None);
        }
    }

    /// `lblc`, `lblcr`, `dh`: schedulers fed the same requests agree
    /// (no hidden randomness or clock).
    #[test]
    fn destination_schedulers_replay(spec in backends(), reqs in prop::collection::vec((any::<u32>(), 0u8..6, 0u64..300_000), 1..30)) {
        for kind in [SchedulerKind::Lblc, SchedulerKind::Lblcr, SchedulerKind::Dh] {
            let (a, loads) = build(kind, &spec);
            let (b, _) = build(kind, &spec);
            let mut sorted = reqs.clone();
            sorted.sort_by_key(|r| r.2);
            for &(c, d, t) in &sorted {
                prop_assert_eq!(pick(&a, &loads, req(c, d, t)), pick(&b, &loads, req(c, d, t)));
            }
        }
    }
}

//! Property tests of the schedulers against small models: random backend
//! sets (weights including 0, some down), random loads, destinations and
//! times.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use proptest::prelude::*;
use weir_sched::*;

fn backends() -> impl Strategy<Value = Vec<(u32, bool, u64)>> {
    // (weight, up, active connections)
    prop::collection::vec((0u32..6, prop::bool::weighted(0.8), 0u64..8), 0..7)
}

fn build(kind: SchedulerKind, spec: &[(u32, bool, u64)]) -> (Scheduler, Vec<Load>) {
    let set: Vec<BackendInfo> = spec
        .iter()
        .enumerate()
        .map(|(i, &(w, up, _))| {
            let mut b = BackendInfo::new(SocketAddr::from(([10, 0, 0, i as u8], 80)), w);
            b.up = up;
            b
        })
        .collect();
    let loads = spec.iter().map(|&(_, _, a)| Load::new(a, 0)).collect();
    let s = Scheduler::new(SchedConfig::new(kind, HashSeed::new(3, 4)), &set).expect("valid");
    (s, loads)
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
    /// Every kind returns only available backends, and `None` with some
    /// backend available only where IPVS does (`pinned` kinds).
    #[test]
    fn picks_are_available(spec in backends(), reqs in prop::collection::vec((any::<u32>(), 0u8..4, 0u64..200_000), 1..20)) {
        for kind in SchedulerKind::ALL {
            let (s, loads) = build(kind, &spec);
            let any = s.backends().iter().any(BackendInfo::available);
            for &(c, d, t) in &reqs {
                match pick(&s, &loads, req(c, d, t)) {
                    Some(i) => prop_assert!(s.backends()[i].available(), "{kind}: {i}"),
                    None => prop_assert!(!any || s.config().pinned(), "{kind}: None with {spec:?}"),
                }
            }
        }
    }

    /// `fo`: the first available backend of the highest weight.
    #[test]
    fn fo_is_the_first_highest_weight(spec in backends()) {
        let (s, loads) = build(SchedulerKind::Fo, &spec);
        let want = s.backends().iter().enumerate()
            .filter(|(_, b)| b.available())
            .fold(None::<(usize, u32)>, |best, (i, b)| match best {
                Some((_, w)) if w >= b.weight => best,
                _ => Some((i, b.weight)),
            })
            .map(|(i, _)| i);
        prop_assert_eq!(pick(&s, &loads, req(1, 1, 0)), want);
    }

    /// `ovf`: the first highest weight among available backends with
    /// `active <= weight`; `None` when there is none.
    #[test]
    fn ovf_is_the_highest_weight_with_room(spec in backends()) {
        let (s, loads) = build(SchedulerKind::Ovf, &spec);
        let want = s.backends().iter().enumerate()
            .filter(|(i, b)| b.available() && loads[*i].active <= u64::from(b.weight))
            .fold(None::<(usize, u32)>, |best, (i, b)| match best {
                Some((_, w)) if w >= b.weight => best,
                _ => Some((i, b.weight)),
            })
            .map(|(i, _)| i);
        prop_assert_eq!(pick(&s, &loads, req(1, 1, 0)), want);
    }

    /// `lblc`: a destination asked again within the expiration, loads
    /// unchanged, gets the same backend unless that one is overloaded.
    #[test]
    fn lblc_is_sticky_unless_overloaded(spec in backends(), d in 0u8..4, t in 0u64..100_000, dt in 0u64..86_400) {
        let (s, loads) = build(SchedulerKind::Lblc, &spec);
        let first = pick(&s, &loads, req(1, d, t));
        let second = pick(&s, &loads, req(2, d, t + dt));
        if let Some(i) = first {
            let b = &s.backends()[i];
            let overloaded = loads[i].active > u64::from(b.weight)
                && s.backends().iter().zip(&loads)
                    .any(|(x, l)| x.available() && l.active * 2 < u64::from(x.weight));
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

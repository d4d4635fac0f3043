//! `lblc` and `lblcr` (IPVS `ip_vs_lblc.c`, `ip_vs_lblcr.c`): schedulers
//! that remember, per destination IP address, which backend (`lblc`) or which
//! set of backends (`lblcr`) served it, so that a destination keeps hitting
//! the same backends (IPVS's use: a cluster of caches in front of many origin
//! servers).
//!
//! * `lblc`: the remembered backend, unless it is unavailable or
//!   *overloaded* (more active connections than its weight while some other
//!   backend has fewer than half its weight, or [`crate::Load::overloaded`]);
//!   then `wlc` over all backends, and that becomes the remembered one.
//! * `lblcr`: the least loaded (`wlc` rule) available member of the set
//!   that is not [`crate::Load::overloaded`] (IPVS's `ip_vs_dest_set_min`
//!   skips an `OVERLOAD` member), unless there is none or it is overloaded;
//!   then `wlc` over all backends, added to the set. A set with several
//!   members that has not changed for `expiration` loses its most loaded
//!   member.
//!
//! `wlc` skips a backend that is [`crate::Load::overloaded`], as IPVS's
//! lblc/lblcr schedule loops skip an `OVERLOAD` destination.
//! * An entry unused for `expiration` (IPVS default 24 h) is forgotten.
//!
//! The table lives behind one short lock and is carried over by
//! [`crate::Scheduler::rebuild`]; entries name backends by address and are
//! checked against the current backend set at each pick. Work per pick is
//! bounded: a sweep of expired entries runs at most once per
//! [`SWEEP_EVERY`] of the caller's time over at most [`MAX_ENTRIES`] entries;
//! when the table is full of entries used in the last [`PRESSURE_IDLE`], a
//! new destination is scheduled but not remembered.
//!
//! Deviations: the "some other backend has spare capacity" test of the
//! overload rule looks only at available backends that are not
//! [`crate::Load::overloaded`] (a weir backend that is down keeps its
//! weight, and would otherwise always look idle; one at its connection
//! limit has no room whatever its weight); a remembered backend that is
//! `overloaded` is replaced (IPVS's lblc looks at its own rule only there,
//! and would send the destination to a destination at its threshold); IPVS's
//! timer-driven garbage collection (every 60 s, a full pass every 30 min) is
//! replaced by treating an expired entry as absent at lookup plus the sweep
//! above, so an entry lives exactly `expiration` after its last use.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};

use crate::least::{better, wlc};
use crate::{BackendAddr, BackendInfo, LoadView, Request};

/// Most destinations remembered (IPVS: 16 entries per bucket of a
/// 1024-bucket table before it collects harder).
pub(crate) const MAX_ENTRIES: usize = 16 * 1024;
/// How often (in the caller's time) expired entries are swept.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(60);
/// Entries idle this long are dropped when the table is full (IPVS
/// `ENTRY_TIMEOUT`).
pub(crate) const PRESSURE_IDLE: Duration = Duration::from_secs(6 * 60);

/// The destination table of one `lblc` or `lblcr` service.
#[derive(Debug, Default)]
pub(crate) struct Locality {
    table: Mutex<Table>,
}

#[derive(Debug, Default)]
struct Table {
    /// Keyed by canonical destination IP. A `BTreeMap`: no hash to key,
    /// and the keys (local addresses) are few.
    entries: BTreeMap<IpAddr, Entry>,
    next_sweep: Duration,
    next_pressure_sweep: Duration,
}

#[derive(Debug)]
struct Entry {
    /// `lblc`: exactly one backend. `lblcr`: the set, no duplicates.
    set: Vec<BackendAddr>,
    last_use: Duration,
    /// `lblcr`: when a member was last added or removed.
    last_mod: Duration,
}

impl Entry {
    fn new(addr: BackendAddr, now: Duration) -> Self {
        Self {
            set: vec![addr],
            last_use: now,
            last_mod: now,
        }
    }

    fn expired(&self, now: Duration, expiration: Duration) -> bool {
        now > self.last_use.saturating_add(expiration)
    }
}

impl Table {
    /// Drops expired entries, at most once per [`SWEEP_EVERY`].
    fn sweep(&mut self, now: Duration, expiration: Duration) {
        if now < self.next_sweep {
            return;
        }
        self.next_sweep = now.saturating_add(SWEEP_EVERY);
        self.entries.retain(|_, e| !e.expired(now, expiration));
    }

    /// The entry for `key` unless it has expired (an expired one is removed).
    fn live(&mut self, key: IpAddr, now: Duration, expiration: Duration) -> Option<&mut Entry> {
        if self
            .entries
            .get(&key)
            .is_some_and(|e| e.expired(now, expiration))
        {
            self.entries.remove(&key);
        }
        self.entries.get_mut(&key)
    }

    /// Remembers `entry` for `key`, if there is room.
    fn insert(&mut self, key: IpAddr, entry: Entry, now: Duration) {
        if self.entries.len() >= MAX_ENTRIES && !self.entries.contains_key(&key) {
            if now >= self.next_pressure_sweep {
                self.next_pressure_sweep = now.saturating_add(SWEEP_EVERY);
                self.entries
                    .retain(|_, e| e.last_use.saturating_add(PRESSURE_IDLE) > now);
            }
            if self.entries.len() >= MAX_ENTRIES {
                return;
            }
        }
        self.entries.insert(key, entry);
    }

    /// A destination with no usable entry: the `wlc` pick, remembered for
    /// `key` as the one member of a new entry.
    fn assign<L: LoadView + ?Sized>(
        &mut self,
        key: IpAddr,
        backends: &[BackendInfo],
        load: &L,
        now: Duration,
    ) -> Option<usize> {
        let i = wlc(backends, load)?;
        self.insert(key, Entry::new(backends[i].addr, now), now);
        Some(i)
    }
}

fn index_of(backends: &[BackendInfo], addr: BackendAddr) -> Option<usize> {
    backends.iter().position(|b| b.addr == addr)
}

/// IPVS `is_overloaded` of lblc/lblcr: more active connections than its
/// weight, while some available backend has fewer than half its weight;
/// or overloaded as [`crate::Load::overloaded`] says.
fn overloaded<L: LoadView + ?Sized>(i: usize, backends: &[BackendInfo], load: &L) -> bool {
    let Some(b) = backends.get(i) else {
        return true;
    };
    let l = load.load(i);
    l.overloaded
        || l.active > u64::from(b.weight)
            && backends
                .iter()
                .enumerate()
                .filter(|(_, d)| d.available())
                .any(|(j, d)| {
                    let l = load.load(j);
                    !l.overloaded && l.active.saturating_mul(2) < u64::from(d.weight)
                })
}

impl Locality {
    /// The table, locked and swept of expired entries, with the key `req`'s
    /// destination is filed under and the time of the request.
    fn swept(
        &self,
        req: Request,
        expiration: Duration,
    ) -> (MutexGuard<'_, Table>, IpAddr, Duration) {
        let (key, now) = (req.dest.0.to_canonical(), req.now);
        let mut t = self.table.lock();
        t.sweep(now, expiration);
        (t, key, now)
    }

    pub(crate) fn pick_lblc<L: LoadView + ?Sized>(
        &self,
        backends: &[BackendInfo],
        load: &L,
        req: Request,
        expiration: Duration,
    ) -> Option<usize> {
        let (mut t, key, now) = self.swept(req, expiration);
        if let Some(e) = t.live(key, now, expiration) {
            e.last_use = now;
            if let Some(i) = e.set.first().and_then(|&a| index_of(backends, a))
                && backends[i].available()
                && !overloaded(i, backends, load)
            {
                return Some(i);
            }
        }
        t.assign(key, backends, load, now)
    }

    pub(crate) fn pick_lblcr<L: LoadView + ?Sized>(
        &self,
        backends: &[BackendInfo],
        load: &L,
        req: Request,
        expiration: Duration,
    ) -> Option<usize> {
        let (mut t, key, now) = self.swept(req, expiration);
        let Some(e) = t.live(key, now, expiration) else {
            return t.assign(key, backends, load, now);
        };
        e.last_use = now;
        // Members removed from the service leave the set.
        e.set.retain(|&a| index_of(backends, a).is_some());
        let min = set_min(&e.set, backends, load);
        if e.set.len() > 1
            && now > e.last_mod.saturating_add(expiration)
            && let Some(most) = set_max(&e.set, backends, load)
        {
            e.set.retain(|&a| a != most);
            e.last_mod = now;
        }
        if let Some(i) = min
            && !overloaded(i, backends, load)
        {
            return Some(i);
        }
        let i = wlc(backends, load)?;
        let addr = backends[i].addr;
        if !e.set.contains(&addr) {
            e.set.push(addr);
            e.last_mod = now;
        }
        Some(i)
    }

    #[cfg(test)]
    fn members(&self, dest: IpAddr) -> Option<Vec<BackendAddr>> {
        let t = self.table.lock();
        t.entries.get(&dest.to_canonical()).map(|e| e.set.clone())
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.table.lock().entries.len()
    }
}

/// The least loaded member (`wlc` rule) that is available and not
/// overloaded, the first on a tie.
fn set_min<L: LoadView + ?Sized>(
    set: &[BackendAddr],
    backends: &[BackendInfo],
    load: &L,
) -> Option<usize> {
    let mut best: Option<(usize, u64, u32)> = None;
    for i in set.iter().filter_map(|&a| index_of(backends, a)) {
        let b = &backends[i];
        if !b.available() {
            continue;
        }
        let l = load.load(i);
        if l.overloaded {
            continue;
        }
        let oh = l.conn_overhead();
        match best {
            Some((_, boh, bw)) if !better(oh, b.weight, boh, bw) => {}
            _ => best = Some((i, oh, b.weight)),
        }
    }
    best.map(|(i, _, _)| i)
}

/// The most loaded member with a weight (IPVS `ip_vs_dest_set_max`), the
/// first on a tie.
fn set_max<L: LoadView + ?Sized>(
    set: &[BackendAddr],
    backends: &[BackendInfo],
    load: &L,
) -> Option<BackendAddr> {
    let mut most: Option<(usize, u64, u32)> = None;
    for i in set.iter().filter_map(|&a| index_of(backends, a)) {
        let b = &backends[i];
        if b.weight == 0 {
            continue;
        }
        let oh = load.load(i).conn_overhead();
        match most {
            // Replace only when the current most is strictly less loaded.
            Some((_, moh, mw)) if !better(moh, mw, oh, b.weight) => {}
            _ => most = Some((i, oh, b.weight)),
        }
    }
    most.map(|(i, _, _)| backends[i].addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::*;
    use crate::{Algo, Load, Scheduler, SchedulerKind, SplitMix64};
    use std::net::Ipv4Addr;

    const DAY: Duration = Duration::from_secs(24 * 60 * 60);

    fn dest(n: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(198, 51, 100, n))
    }

    fn at(s: &Scheduler, d: IpAddr, now: Duration, loads: &[Load]) -> Option<usize> {
        s.pick_for(
            Request::new(client(0).0, d, now),
            loads,
            &mut SplitMix64::new(0),
        )
    }

    fn table(s: &Scheduler) -> &Locality {
        match &s.algo {
            Algo::Lblc(t) | Algo::Lblcr(t) => t,
            _ => unreachable!("not a locality scheduler"),
        }
    }

    fn l(active: u64) -> Load {
        Load::new(active, 0)
    }

    #[test]
    fn lblc_sticks_to_the_destinations_backend() {
        let set = [backend(1, 1), backend(2, 1), backend(3, 1)];
        let s = sched(SchedulerKind::Lblc, &set);
        // A new destination goes to the wlc choice...
        let loads = [l(3), l(1), l(2)];
        assert_eq!(at(&s, dest(1), Duration::ZERO, &loads), Some(1));
        // ...and stays there while it is not overloaded, whatever wlc says.
        let loads = [l(0), l(1), l(0)];
        for t in 1..20 {
            assert_eq!(at(&s, dest(1), Duration::from_secs(t), &loads), Some(1));
        }
        // Another destination gets its own wlc choice.
        assert_eq!(at(&s, dest(2), Duration::ZERO, &loads), Some(0));
        assert_eq!(table(&s).len(), 2);
    }

    #[test]
    fn lblc_moves_only_when_overloaded_and_someone_has_room() {
        let set = [backend(1, 4), backend(2, 4)];
        let s = sched(SchedulerKind::Lblc, &set);
        let t0 = Duration::ZERO;
        assert_eq!(at(&s, dest(1), t0, &[l(0), l(0)]), Some(0));
        // 5 > 4 active, but backend 1 has 2 * 2 = 4, not < 4: no move.
        assert_eq!(at(&s, dest(1), t0, &[l(5), l(2)]), Some(0));
        // Backend 1 at 1 active (2 < 4): overloaded, move to wlc's choice,
        // which is then remembered.
        assert_eq!(at(&s, dest(1), t0, &[l(5), l(1)]), Some(1));
        assert_eq!(at(&s, dest(1), t0, &[l(0), l(3)]), Some(1));
        // Exactly at its weight is not overloaded.
        assert_eq!(at(&s, dest(1), t0, &[l(0), l(4)]), Some(1));
    }

    #[test]
    fn lblc_unavailable_backend_is_replaced_and_entries_expire() {
        let mut set = vec![backend(1, 1), backend(2, 1)];
        let s = sched(SchedulerKind::Lblc, &set);
        let idle = [l(0), l(0)];
        assert_eq!(at(&s, dest(1), Duration::ZERO, &idle), Some(0));
        set[0].up = false;
        let s = s.rebuild(&set).expect("valid");
        assert_eq!(at(&s, dest(1), Duration::ZERO, &idle), Some(1));
        // The table survived the rebuild and now names backend 1: it stays
        // there when backend 0 returns.
        set[0].up = true;
        let s = s.rebuild(&set).expect("valid");
        assert_eq!(at(&s, dest(1), DAY, &idle), Some(1));
        // Unused for a day and a second: forgotten, wlc picks afresh.
        let later = DAY + DAY + Duration::from_secs(1);
        assert_eq!(at(&s, dest(1), later, &idle), Some(0));
        // Used within the day: kept (last use refreshes).
        assert_eq!(at(&s, dest(1), later + DAY, &[l(1), l(0)]), Some(0));
    }

    #[test]
    fn lblc_sweep_forgets_expired_destinations() {
        let set = [backend(1, 1), backend(2, 1)];
        let s = sched(SchedulerKind::Lblc, &set);
        for n in 0..50 {
            at(&s, dest(n), Duration::ZERO, &[]);
        }
        assert_eq!(table(&s).len(), 50);
        at(
            &s,
            dest(200),
            DAY + SWEEP_EVERY + Duration::from_secs(1),
            &[],
        );
        assert_eq!(table(&s).len(), 1);
    }

    #[test]
    fn lblc_table_is_bounded() {
        let set = [backend(1, 1)];
        let s = sched(SchedulerKind::Lblc, &set);
        let many = MAX_ENTRIES as u32 + 10;
        for n in 0..many {
            let d = IpAddr::V4(Ipv4Addr::from(0x0A00_0000 + n));
            // Every destination is still served when the table is full.
            assert_eq!(at(&s, d, Duration::ZERO, &[]), Some(0));
        }
        assert_eq!(table(&s).len(), MAX_ENTRIES);
        // Once entries have idled past PRESSURE_IDLE a full table makes room.
        let d = IpAddr::V4(Ipv4Addr::from(0x0B00_0000));
        at(&s, d, PRESSURE_IDLE + Duration::from_secs(1), &[]);
        assert_eq!(table(&s).len(), 1);
    }

    #[test]
    fn lblcr_grows_under_overload_and_spreads_over_the_set() {
        let set = [backend(1, 2), backend(2, 2), backend(3, 2)];
        let s = sched(SchedulerKind::Lblcr, &set);
        let t0 = Duration::ZERO;
        assert_eq!(at(&s, dest(1), t0, &[l(0), l(0), l(0)]), Some(0));
        // Backend 0 overloaded (3 > 2) while backend 2 has room: wlc picks 2
        // (least per weight) and it joins the set.
        assert_eq!(at(&s, dest(1), t0, &[l(3), l(1), l(0)]), Some(2));
        let members = table(&s).members(dest(1)).expect("entry");
        assert_eq!(members, vec![set[0].addr, set[2].addr]);
        // From the set, the least loaded member serves; backend 1, not a
        // member, is not used even when idle.
        assert_eq!(at(&s, dest(1), t0, &[l(2), l(0), l(1)]), Some(2));
        assert_eq!(at(&s, dest(1), t0, &[l(1), l(0), l(2)]), Some(0));
    }

    #[test]
    fn lblcr_sheds_the_most_loaded_member_after_expiration() {
        let set = [backend(1, 2), backend(2, 2)];
        let s = sched(SchedulerKind::Lblcr, &set);
        let t0 = Duration::ZERO;
        at(&s, dest(1), t0, &[l(0), l(0)]);
        assert_eq!(at(&s, dest(1), t0, &[l(3), l(0)]), Some(1));
        assert_eq!(table(&s).members(dest(1)).map(|m| m.len()), Some(2));
        // Used often, but unchanged for more than a day: the most loaded
        // member (0) leaves; the pick is the set minimum taken before that.
        let mut now = t0;
        for _ in 0..5 {
            now += Duration::from_secs(6 * 60 * 60);
            assert_eq!(at(&s, dest(1), now, &[l(2), l(1)]), Some(1));
        }
        assert_eq!(
            table(&s).members(dest(1)),
            Some(vec![set[1].addr]),
            "most loaded member shed"
        );
    }

    /// A remembered backend that is `overloaded` (at its connection limit)
    /// is replaced by `wlc` over the others, whatever its load by lblc's
    /// own rule; in `lblcr` the set's other member serves instead.
    #[test]
    fn locality_moves_off_an_overloaded_backend() {
        let set = [backend(1, 4), backend(2, 4), backend(3, 4)];
        let t0 = Duration::ZERO;
        let lblc = sched(SchedulerKind::Lblc, &set);
        assert_eq!(at(&lblc, dest(1), t0, &[l(1), l(0), l(2)]), Some(1));
        let full = [l(1), l(0).with_overload(true), l(2)];
        assert_eq!(at(&lblc, dest(1), t0, &full), Some(0));
        // Remembered: it stays on 0 once 1 is free again.
        assert_eq!(at(&lblc, dest(1), t0, &[l(1), l(0), l(0)]), Some(0));

        let lblcr = sched(SchedulerKind::Lblcr, &set);
        assert_eq!(at(&lblcr, dest(1), t0, &[l(0), l(0), l(0)]), Some(0));
        assert_eq!(at(&lblcr, dest(1), t0, &[l(5), l(0), l(3)]), Some(1));
        // The set is {0, 1}; 1 is the less loaded but overloaded: 0 serves,
        // and the set does not grow.
        let full = [l(2), l(0).with_overload(true), l(0)];
        assert_eq!(at(&lblcr, dest(1), t0, &full), Some(0));
        assert_eq!(
            table(&lblcr).members(dest(1)),
            Some(vec![set[0].addr, set[1].addr])
        );
    }

    #[test]
    fn lblcr_forgets_removed_backends() {
        let set = vec![backend(1, 1), backend(2, 1)];
        let s = sched(SchedulerKind::Lblcr, &set);
        at(&s, dest(1), Duration::ZERO, &[]);
        let s = s.rebuild(&set[1..]).expect("valid");
        assert_eq!(at(&s, dest(1), Duration::ZERO, &[]), Some(0));
        assert_eq!(table(&s).members(dest(1)), Some(vec![set[1].addr]));
    }

    #[test]
    fn dh_maps_a_destination_to_one_backend_ignoring_weights() {
        let set = [backend(1, 1), backend(2, 100), backend(3, 0)];
        let s = sched(SchedulerKind::Dh, &set);
        let mut counts = [0u32; 4];
        for n in 0..=255u8 {
            let first = at(&s, dest(n), Duration::ZERO, &[]);
            // The same destination always maps the same way, whoever asks.
            let again = s.pick_for(
                Request::new(client(u32::from(n)).0, dest(n), DAY),
                &[] as &[Load],
                &mut SplitMix64::new(9),
            );
            assert_eq!(first, again);
            counts[first.unwrap_or(3)] += 1;
        }
        // Weights are ignored (1 vs 100), weight 0 keeps its buckets: its
        // destinations get None, as in IPVS.
        assert_eq!(counts[2], 0);
        assert!(counts[3] > 40, "{counts:?}");
        assert!(counts[0] > 50 && counts[1] > 50, "{counts:?}");
    }

    #[test]
    fn fo_and_ovf_follow_weights_and_load() {
        let mut down = backend(4, 9);
        down.up = false;
        let set = [backend(1, 2), backend(2, 5), backend(3, 5), down];
        let fo = sched(SchedulerKind::Fo, &set);
        // Highest available weight, the first of equals; loads ignored.
        assert_eq!(at(&fo, dest(1), Duration::ZERO, &[l(0), l(99)]), Some(1));
        let ovf = sched(SchedulerKind::Ovf, &set);
        assert_eq!(at(&ovf, dest(1), Duration::ZERO, &[l(0), l(5)]), Some(1));
        // Above its weight it overflows to the next highest...
        assert_eq!(
            at(&ovf, dest(1), Duration::ZERO, &[l(0), l(6), l(2)]),
            Some(2)
        );
        assert_eq!(
            at(&ovf, dest(1), Duration::ZERO, &[l(0), l(6), l(6)]),
            Some(0)
        );
        // ...and with every backend full there is none.
        assert_eq!(at(&ovf, dest(1), Duration::ZERO, &[l(3), l(6), l(6)]), None);
        assert!(ovf.config().pinned() && !fo.config().pinned());
    }
}

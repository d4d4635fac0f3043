//! Per-tenant expiry wheel with lazy rescheduling.
//!
//! `SLOTS` slots of `TICK_MS` each; a slot holds node indices. A node is
//! filed at the tick of its deadline (clamped to `[cur, cur + SLOTS - 1]`)
//! and its node records the slot number. `touch` never refiles: when a slot
//! comes due each node in it is re-checked against its *real* deadline and
//! either expired or refiled further on (at most once per timeout period per
//! entry, so the work stays O(expired + refiled)). References go stale when a
//! node is removed or refiled; a stale reference is recognised (node not
//! live, other tenant, or other slot recorded) and dropped when its slot is
//! processed. A refile always lands in a *different* slot (tick `> cur` and
//! `< cur + SLOTS`), so duplicate references die out.
//!
//! Tick `T` is processed once `now >= (T + 1) * TICK_MS`, so everything in
//! it has a deadline `< now`. Entries found already due when filed go to an
//! extra overdue slot processed at once. So an entry expires at most one tick
//! (plus the caller's period between `expire` calls) late, never early.
//!
//! # Retiming
//! Lazy rescheduling only ever files an entry *later*; a shortened timeout
//! would reach an entry filed under the old one only when that slot comes
//! due. So a shortening starts a retime pass ([`Wheel::start_retime`]): one
//! lap over the slots in tick order from the current tick (so refiled
//! entries land behind the cursor), from a cursor (slot, position), at most `budget`
//! references per step ([`Wheel::retime`]), refiling every entry whose real
//! deadline under the new timeouts falls in an earlier tick than its slot,
//! and dropping stale references on the way. An entry is only ever moved
//! earlier and still re-checked against its real deadline when its new slot
//! comes due, so retiming never expires anything early. Another shortening
//! during a pass extends it to a full lap from where it is, which covers
//! every slot again under the newest timeouts. Incremental compaction is
//! suspended meanwhile (its `retain` would shift references under the
//! cursor; the pass drops stale references itself).

/// Wheel granularity.
pub(crate) const TICK_MS: u64 = 1000;
/// Slots (horizon = 1024 s; longer deadlines are refiled at the horizon).
pub(crate) const SLOTS: u64 = 1024;
/// Slots per chunk: one word of the occupancy bitmap.
const CHUNK: usize = 64;
/// Chunks (and bitmap words) of the `SLOTS` regular slots.
const CHUNKS: usize = SLOTS as usize / CHUNK;
const _WHOLE_CHUNKS: () = assert!((SLOTS as usize).is_multiple_of(CHUNK));

type Chunk = [Vec<u32>; CHUNK];

#[derive(Debug)]
pub(crate) struct Wheel {
    /// The regular slots, 64 to a chunk, a chunk made when a slot of it is
    /// first filed and given back when all of its slots are empty. They
    /// were all made at once: 1,025 slot headers, ~25 KB for every tenant
    /// with any entry (2.5 GB at 100,000 tenants of one entry each).
    chunks: [Option<Box<Chunk>>; CHUNKS],
    /// Bit `s` is set while regular slot `s` holds references (set when
    /// filed, cleared when emptied; a set bit may also be an emptied slot
    /// not yet passed, which [`due_slot`](Self::due_slot) then clears). A
    /// chunk whose word is zero is all empty. The next slot to come due is
    /// a few word reads away: [`next_visit`](Self::next_visit).
    occupied: [u64; CHUNKS],
    /// Slot `SLOTS`: entries already due when filed.
    overdue: Vec<u32>,
    /// Next tick to process.
    cur: u64,
    started: bool,
    /// References held (live or stale).
    refs: usize,
    /// Next slot the incremental compaction looks at.
    compact_next: usize,
    /// The retime pass under way, if any.
    retime: Option<Retime>,
    /// References the last retime step examined (introspection).
    retime_last: usize,
    /// The tick under which the flow table's due index holds this wheel's
    /// tenant, if it does (kept by the flow table, under its maintenance
    /// lock).
    pub(crate) due_key: Option<u64>,
}

/// Cursor of a retime pass: the slot and position it continues from, and
/// how many slots (this one included) the lap still has to visit.
#[derive(Debug, Clone, Copy)]
struct Retime {
    slot: usize,
    pos: usize,
    left: usize,
}

impl Wheel {
    pub(crate) fn new() -> Wheel {
        Wheel {
            chunks: Default::default(),
            occupied: [0; CHUNKS],
            overdue: Vec::new(),
            cur: 0,
            started: false,
            refs: 0,
            compact_next: 0,
            retime: None,
            retime_last: 0,
            due_key: None,
        }
    }

    pub(crate) fn start(&mut self, now: u64) {
        if !self.started {
            self.cur = now / TICK_MS;
            self.started = true;
        }
    }

    /// Slot `s`'s references (none for a slot whose chunk is not made).
    fn slot(&self, s: usize) -> &[u32] {
        if s == SLOTS as usize {
            return &self.overdue;
        }
        match &self.chunks[s / CHUNK] {
            Some(c) => &c[s % CHUNK],
            None => &[],
        }
    }

    /// Slot `s`'s vector, its chunk made if need be.
    fn slot_mut(&mut self, s: usize) -> &mut Vec<u32> {
        if s == SLOTS as usize {
            return &mut self.overdue;
        }
        let c = self.chunks[s / CHUNK]
            .get_or_insert_with(|| Box::new(std::array::from_fn(|_| Vec::new())));
        &mut c[s % CHUNK]
    }

    /// Files a reference in slot `s` (marked as holding references).
    fn push(&mut self, s: usize, idx: u32) {
        self.slot_mut(s).push(idx);
        if s < SLOTS as usize {
            self.occupied[s / CHUNK] |= 1 << (s % CHUNK);
        }
        self.refs += 1;
    }

    /// Slot `s` is empty: its buffer goes, its bit is cleared, and its
    /// chunk goes with its last occupied slot. (A passed slot is filed into
    /// again a whole turn, `SLOTS` ticks, later at the earliest: keeping its
    /// buffer saves nothing. Kept buffers, all up to 256 references once,
    /// added up over one turn to 1 KiB a slot, 1 MiB a tenant: the slow RSS
    /// creep of the 30-minute soak in docs/BENCHMARKS.md.)
    fn emptied(&mut self, s: usize) {
        debug_assert!(self.slot(s).is_empty());
        if s == SLOTS as usize {
            self.overdue = Vec::new();
            return;
        }
        let w = s / CHUNK;
        self.occupied[w] &= !(1 << (s % CHUNK));
        if self.occupied[w] == 0 {
            self.chunks[w] = None;
        } else if let Some(c) = &mut self.chunks[w] {
            c[s % CHUNK] = Vec::new();
        }
    }

    /// Distance in ticks from tick `from` to the next marked regular slot
    /// (0 if `from`'s own slot is marked), within one turn.
    fn next_marked(&self, from: u64) -> Option<u64> {
        let start = (from % SLOTS) as usize;
        let (w0, b0) = (start / CHUNK, start % CHUNK);
        for k in 0..=CHUNKS {
            let w = (w0 + k) % CHUNKS;
            let bits = match k {
                0 => self.occupied[w] & (!0u64 << b0),
                // Wrapped round to the start word: the bits below `b0`.
                CHUNKS => self.occupied[w] & ((1u64 << b0) - 1),
                _ => self.occupied[w],
            };
            if bits != 0 {
                let s = w * CHUNK + bits.trailing_zeros() as usize;
                return Some(((s + SLOTS as usize - start) % SLOTS as usize) as u64);
            }
        }
        None
    }

    /// The tick from which an `expire` call at tick `now / TICK_MS >=` it
    /// has work here: 0 (at once) while a retime pass runs or entries are
    /// overdue, else one past the tick of the next slot that comes due;
    /// `None` when the wheel holds no references.
    pub(crate) fn next_visit(&self) -> Option<u64> {
        if self.retime.is_some() || !self.overdue.is_empty() {
            return Some(0);
        }
        if self.refs == 0 {
            return None;
        }
        self.next_marked(self.cur).map(|d| self.cur + d + 1)
    }

    /// The tick from which slot `s` (as just filed) is due: see
    /// [`next_visit`](Self::next_visit).
    pub(crate) fn visit_for(&self, s: u32) -> u64 {
        if u64::from(s) == SLOTS {
            return 0;
        }
        let d = (u64::from(s) + SLOTS - self.cur % SLOTS) % SLOTS;
        self.cur + d + 1
    }

    /// Files `idx` for `deadline`; returns the slot to record in the node.
    /// Entries already due at `now` go to the overdue list (slot `SLOTS`),
    /// which the same `expire` call processes first.
    pub(crate) fn file(&mut self, idx: u32, deadline: u64, now: u64) -> u32 {
        if self.refs == 0 && self.retime.is_none() {
            // Nothing filed: every tick before now has passed empty. (An
            // `expire` call visits only wheels with something due, so
            // this one's current tick may be far behind.)
            self.cur = self.cur.max(now / TICK_MS);
        }
        let s = if deadline <= now {
            SLOTS
        } else {
            (deadline / TICK_MS).clamp(self.cur, self.cur + SLOTS - 1) % SLOTS
        };
        self.push(s as usize, idx);
        s as u32
    }

    /// The next due, non-empty slot, advancing `cur` past empty due ticks.
    /// O(bitmap words + emptied slots passed).
    pub(crate) fn due_slot(&mut self, now: u64) -> Option<u32> {
        let now_t = now / TICK_MS;
        if !self.overdue.is_empty() {
            return Some(SLOTS as u32);
        }
        if self.refs == 0 {
            // Nothing filed: every tick before now has passed empty.
            self.cur = self.cur.max(now_t);
            if self.retime.is_none() {
                self.chunks = Default::default();
                self.occupied = [0; CHUNKS];
                self.compact_next = 0;
            }
            return None;
        }
        if now_t > self.cur + SLOTS {
            // Far behind: every slot is due; reinterpreting is harmless
            // because each node is re-checked against its real deadline.
            self.cur = now_t - SLOTS;
        }
        while self.cur < now_t {
            match self.next_marked(self.cur) {
                Some(d) if d < now_t - self.cur => self.cur += d,
                _ => {
                    self.cur = now_t;
                    break;
                }
            }
            let s = (self.cur % SLOTS) as usize;
            if !self.slot(s).is_empty() {
                return Some(s as u32);
            }
            self.emptied(s);
            self.cur += 1;
        }
        None
    }

    pub(crate) fn pop(&mut self, slot: u32) -> Option<u32> {
        let s = slot as usize;
        let v = self.slot_mut(s);
        let r = v.pop();
        if v.is_empty() {
            self.emptied(s);
        }
        self.refs -= usize::from(r.is_some());
        r
    }

    pub(crate) fn push_back(&mut self, slot: u32, idx: u32) {
        self.push(slot as usize, idx);
    }

    /// References held, live or stale.
    pub(crate) fn refs(&self) -> usize {
        self.refs
    }

    /// Calls `f(slot, idx)` for every reference held, live or stale (the
    /// caller tells them apart as `expire` does: a live node of this
    /// tenant that records `slot`). Reads only the occupied slots.
    pub(crate) fn for_each_ref(&self, mut f: impl FnMut(u32, u32)) {
        for (w, &bits) in self.occupied.iter().enumerate() {
            let mut bits = bits;
            while bits != 0 {
                let s = w * CHUNK + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                for &i in self.slot(s) {
                    f(s as u32, i);
                }
            }
        }
        for &i in &self.overdue {
            f(SLOTS as u32, i);
        }
    }

    /// A reference `pick(slot, idx)` accepts, from the first slot in
    /// deadline order that holds one (the overdue references, then the
    /// regular slots from the current tick on), looking at no more than
    /// `budget` references. Within a slot the look starts at a position
    /// drawn from `seed` and goes round, so that which of a slot's
    /// references is found is spread over them. Stale references are
    /// passed to `pick` like live ones (the caller tells them apart as
    /// `expire` does). Returns (slot, position, reference) for
    /// [`take_at`](Self::take_at). Reads only occupied slots.
    pub(crate) fn find_due_first(
        &self,
        budget: usize,
        seed: u64,
        mut pick: impl FnMut(u32, u32) -> bool,
    ) -> Option<(u32, usize, u32)> {
        let mut left = budget;
        let mut look = |s: usize| -> Option<Option<(u32, usize, u32)>> {
            let v = self.slot(s);
            if v.is_empty() {
                return None;
            }
            // Lemire's reduction of the seed to a start in 0..len.
            let from = ((u128::from(seed) * v.len() as u128) >> 64) as usize;
            for k in 0..v.len() {
                if left == 0 {
                    return Some(None);
                }
                left -= 1;
                let pos = (from + k) % v.len();
                if pick(s as u32, v[pos]) {
                    return Some(Some((s as u32, pos, v[pos])));
                }
            }
            None
        };
        if let Some(r) = look(SLOTS as usize) {
            return r;
        }
        let mut from = self.cur;
        while let Some(d) = self.next_marked(from) {
            let tick = from + d;
            if tick >= self.cur + SLOTS {
                break; // one turn: every regular slot looked at
            }
            if let Some(r) = look((tick % SLOTS) as usize) {
                return r;
            }
            from = tick + 1;
        }
        None
    }

    /// Takes out reference `idx` at `pos` of `slot` (as found by
    /// [`find_due_first`](Self::find_due_first) under the same lock): its
    /// place goes to the slot's last reference. While a retime pass runs
    /// the reference stays, stale (the pass's cursor counts positions).
    pub(crate) fn take_at(&mut self, slot: u32, pos: usize, idx: u32) {
        if self.retime.is_some() {
            return;
        }
        let s = slot as usize;
        let v = self.slot_mut(s);
        debug_assert_eq!(v.get(pos), Some(&idx));
        if v.get(pos) != Some(&idx) {
            return;
        }
        v.swap_remove(pos);
        let empty = v.is_empty();
        self.refs -= 1;
        if empty {
            self.emptied(s);
        }
    }

    /// Drops stale references (`keep(slot, idx)` false) from whole slots,
    /// starting where the last call stopped, until about `budget`
    /// references were examined. Removed entries leave a stale reference
    /// until their slot comes due, up to a timeout later; under heavy churn
    /// with long timeouts that is many, so `expire` calls this when stale
    /// references outnumber live entries. Returns the references examined.
    pub(crate) fn compact(&mut self, budget: usize, keep: impl Fn(u32, u32) -> bool) -> usize {
        let mut seen = 0;
        let all = SLOTS as usize + 1;
        for _ in 0..all {
            if seen >= budget {
                break;
            }
            let s = self.compact_next;
            self.compact_next = (s + 1) % all;
            if self.slot(s).is_empty() {
                continue;
            }
            let v = self.slot_mut(s);
            seen += v.len();
            let before = v.len();
            v.retain(|&i| keep(s as u32, i));
            let dropped = before - v.len();
            if v.capacity() > 2 * v.len() + 256 {
                v.shrink_to_fit();
            }
            let empty = v.is_empty();
            self.refs -= dropped;
            if empty {
                self.emptied(s);
            }
        }
        seen
    }

    /// Starts a retime pass (a timeout got shorter), or extends the one
    /// under way to a full lap from its cursor. Returns whether a pass
    /// started that was not under way.
    pub(crate) fn start_retime(&mut self) -> bool {
        if self.refs == 0 {
            return false; // nothing filed, nothing to move
        }
        let was = self.retime.is_some();
        let slot = match self.retime {
            Some(r) => r.slot,
            None => (self.cur % SLOTS) as usize,
        };
        let pos = self.retime.map_or(0, |r| r.pos);
        self.retime = Some(Retime {
            slot,
            pos,
            left: SLOTS as usize,
        });
        !was
    }

    /// Whether a retime pass is under way.
    pub(crate) fn retiming(&self) -> bool {
        self.retime.is_some()
    }

    /// References the last [`retime`](Self::retime) step examined.
    pub(crate) fn retime_last(&self) -> usize {
        self.retime_last
    }

    /// One step of the retime pass: examines at most `budget` references
    /// from the cursor on. `deadline(slot, idx)` is the entry's real
    /// deadline, or `None` for a stale reference (dropped); an entry due in
    /// an earlier tick than its slot's is refiled there and `moved(idx,
    /// new_slot)` records it in the node. Returns the references examined.
    /// Call after [`start`](Self::start); the overdue slot is not visited
    /// (it is processed at once anyway).
    pub(crate) fn retime(
        &mut self,
        budget: usize,
        now: u64,
        mut deadline: impl FnMut(u32, u32) -> Option<u64>,
        mut moved: impl FnMut(u32, u32),
    ) -> usize {
        let Some(mut r) = self.retime else {
            self.retime_last = 0;
            return 0;
        };
        let mut seen = 0;
        while r.left > 0 && seen < budget {
            // Tick the slot stands for: the one in [cur, cur + SLOTS).
            let tick = self.cur + (r.slot as u64 + SLOTS - self.cur % SLOTS) % SLOTS;
            while r.pos < self.slot(r.slot).len() && seen < budget {
                seen += 1;
                let idx = self.slot(r.slot)[r.pos];
                let keep_here = match deadline(r.slot as u32, idx) {
                    None => false,
                    Some(d) => {
                        let earlier = d <= now || (d / TICK_MS).max(self.cur) < tick;
                        if earlier {
                            let s = self.file(idx, d, now);
                            moved(idx, s);
                        }
                        !earlier
                    }
                };
                if keep_here {
                    r.pos += 1;
                } else {
                    // The last reference takes this place: look at it next.
                    self.slot_mut(r.slot).swap_remove(r.pos);
                    self.refs -= 1;
                }
            }
            if r.pos >= self.slot(r.slot).len() {
                if self.slot(r.slot).is_empty() {
                    self.emptied(r.slot);
                }
                r.slot = (r.slot + 1) % SLOTS as usize;
                r.pos = 0;
                r.left -= 1;
            }
        }
        self.retime = (r.left > 0).then_some(r);
        self.retime_last = seen;
        seen
    }

    /// Everything filed (for tenant removal).
    pub(crate) fn drain_all(&mut self) -> Vec<u32> {
        let mut v = Vec::with_capacity(self.refs);
        self.for_each_ref(|_, i| v.push(i));
        self.chunks = Default::default();
        self.occupied = [0; CHUNKS];
        self.overdue = Vec::new();
        self.refs = 0;
        self.retime = None;
        self.compact_next = 0;
        v
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        let chunk = std::mem::size_of::<Chunk>();
        let made = self.chunks.iter().flatten();
        made.map(|c| chunk + c.iter().map(|v| v.capacity() * 4).sum::<usize>())
            .sum::<usize>()
            + self.overdue.capacity() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wheel holds its slots only while it holds references: none when
    /// new, all once something is filed, none again once every reference
    /// is gone and the due slots are passed (and after a drain); filing
    /// after that works as on a new wheel.
    #[test]
    fn slots_exist_only_while_references_do() {
        let mut w = Wheel::new();
        w.start(0);
        assert_eq!(w.memory_bytes(), 0);
        assert_eq!(w.due_slot(5_000), None, "nothing filed, nothing due");
        w.start_retime();
        assert!(!w.retiming(), "nothing to retime");

        let s = w.file(7, 10_000, 5_000);
        // One chunk of slots, not all of them.
        let chunk = std::mem::size_of::<Chunk>();
        assert!(w.memory_bytes() >= chunk && w.memory_bytes() < 2 * chunk);
        assert_eq!(w.due_slot(9_000), None, "not due yet: the slots stay");
        assert!(w.memory_bytes() > 0);
        assert_eq!(w.due_slot(11_000), Some(s));
        assert_eq!(w.pop(s), Some(7));
        assert_eq!(w.pop(s), None);
        assert_eq!(w.due_slot(11_000), None);
        assert_eq!(w.refs(), 0);
        assert_eq!(w.memory_bytes(), 0, "given back once empty");

        // Filed again: the current tick was kept moving meanwhile, so an
        // entry due in 3 s is not found due before then.
        let s = w.file(8, 14_000, 11_000);
        assert_eq!(w.due_slot(13_500), None);
        assert_eq!(w.due_slot(15_000), Some(s));
        assert_eq!(w.drain_all(), vec![8]);
        assert_eq!(w.memory_bytes(), 0);
        // Overdue entries go straight to the overdue slot.
        assert_eq!(w.file(9, 1_000, 20_000), SLOTS as u32);
        assert_eq!(w.due_slot(20_000), Some(SLOTS as u32));
    }
    /// `find_due_first` looks at references in deadline order (overdue
    /// first, then from the current tick on, wrapping round the wheel),
    /// never past its budget, and returns the first one picked, wherever
    /// in its slot the look starts; `take_at` takes it out.
    #[test]
    fn find_due_first_goes_in_deadline_order_within_its_budget() {
        let mut w = Wheel::new();
        w.start(100_000);
        // Far ahead (wraps round the slot array), near, overdue, between.
        w.file(1, 1_100_000, 100_000);
        w.file(2, 103_500, 100_000);
        w.file(3, 50_000, 100_000);
        w.file(4, 103_700, 100_000);
        w.file(5, 400_000, 100_000);
        for seed in [0, u64::MAX / 2 + 1, u64::MAX] {
            let mut seen = Vec::new();
            let none = w.find_due_first(usize::MAX, seed, |_, i| {
                seen.push(i);
                false
            });
            assert_eq!(none, None);
            // Slot 103 holds 2 and 4; the look starts at either.
            let (a, b) = if seed == 0 { (2, 4) } else { (4, 2) };
            assert_eq!(seen, vec![3, a, b, 5, 1], "deadline order, seed {seed}");
            let found = w.find_due_first(usize::MAX, seed, |_, i| i == 4);
            assert_eq!(found.map(|(s, _, i)| (s, i)), Some((103, 4)));
            assert_eq!(
                w.find_due_first(usize::MAX, seed, |_, i| i % 2 == 1)
                    .map(|f| f.2),
                Some(3)
            );
            // Within the budget only: 5 is the fourth reference.
            assert_eq!(w.find_due_first(3, seed, |_, i| i == 5), None);
            assert_eq!(
                w.find_due_first(4, seed, |_, i| i == 5).map(|f| f.2),
                Some(5)
            );
            assert_eq!(w.find_due_first(0, seed, |_, _| true), None);
        }
        // Taken out: no longer found, the rest unchanged.
        let (s, pos, i) = w.find_due_first(usize::MAX, 0, |_, i| i == 2).unwrap();
        w.take_at(s, pos, i);
        assert_eq!(w.refs(), 4);
        let mut seen = Vec::new();
        w.find_due_first(usize::MAX, 0, |_, i| {
            seen.push(i);
            false
        });
        assert_eq!(seen, vec![3, 4, 5, 1]);
        let (s, pos, i) = w.find_due_first(usize::MAX, 0, |_, i| i == 3).unwrap();
        w.take_at(s, pos, i);
        assert_eq!(w.due_slot(100_000), None, "the overdue slot is empty");
        assert_eq!(w.refs(), 3);
    }
}

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

#[derive(Debug)]
pub(crate) struct Wheel {
    /// `SLOTS + 1` slots while the wheel holds references, none while it
    /// holds none: 1,025 empty vectors are ~25 KB, which every tenant
    /// paid whether it had entries or not (250 MB at 10,000 tenants).
    slots: Box<[Vec<u32>]>,
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
            slots: Box::new([]),
            cur: 0,
            started: false,
            refs: 0,
            compact_next: 0,
            retime: None,
            retime_last: 0,
        }
    }

    pub(crate) fn start(&mut self, now: u64) {
        if !self.started {
            self.cur = now / TICK_MS;
            self.started = true;
        }
    }

    /// The slots, made when the first reference comes.
    fn slots_mut(&mut self) -> &mut [Vec<u32>] {
        if self.slots.is_empty() {
            self.slots = (0..=SLOTS).map(|_| Vec::new()).collect();
        }
        &mut self.slots
    }

    /// Files `idx` for `deadline`; returns the slot to record in the node.
    /// Entries already due at `now` go to the overdue list (slot `SLOTS`),
    /// which the same `expire` call processes first.
    pub(crate) fn file(&mut self, idx: u32, deadline: u64, now: u64) -> u32 {
        let s = if deadline <= now {
            SLOTS
        } else {
            (deadline / TICK_MS).clamp(self.cur, self.cur + SLOTS - 1) % SLOTS
        };
        self.slots_mut()[s as usize].push(idx);
        self.refs += 1;
        s as u32
    }

    /// The next due, non-empty slot, advancing `cur` past empty due ticks.
    /// O(min(elapsed ticks, SLOTS)).
    pub(crate) fn due_slot(&mut self, now: u64) -> Option<u32> {
        let now_t = now / TICK_MS;
        if self.slots.is_empty() {
            // Nothing filed: every tick before now has passed empty.
            self.cur = self.cur.max(now_t);
            return None;
        }
        if !self.slots[SLOTS as usize].is_empty() {
            return Some(SLOTS as u32);
        }
        if now_t > self.cur + SLOTS {
            // Far behind: every slot is due; reinterpreting is harmless
            // because each node is re-checked against its real deadline.
            self.cur = now_t - SLOTS;
        }
        while self.cur < now_t {
            let s = (self.cur % SLOTS) as usize;
            if !self.slots[s].is_empty() {
                return Some(s as u32);
            }
            // A passed slot is filed into again a whole turn (SLOTS ticks)
            // later at the earliest: keeping its buffer saves nothing. Kept
            // buffers (all up to 256 references used to be) added up over
            // one turn to 1 KiB a slot, 1 MiB a tenant: the slow RSS creep
            // of the 30-minute soak (docs/BENCHMARKS.md).
            if self.slots[s].capacity() > 0 {
                self.slots[s] = Vec::new();
            }
            self.cur += 1;
        }
        if self.refs == 0 && self.retime.is_none() {
            // Every slot is empty: give them back until the next file.
            self.slots = Box::new([]);
            self.compact_next = 0;
        }
        None
    }

    pub(crate) fn pop(&mut self, slot: u32) -> Option<u32> {
        let r = self.slots[slot as usize].pop();
        self.refs -= usize::from(r.is_some());
        r
    }

    pub(crate) fn push_back(&mut self, slot: u32, idx: u32) {
        self.slots_mut()[slot as usize].push(idx);
        self.refs += 1;
    }

    /// References held, live or stale.
    pub(crate) fn refs(&self) -> usize {
        self.refs
    }

    /// Calls `f(slot, idx)` for every reference held, live or stale (the
    /// caller tells them apart as `expire` does: a live node of this
    /// tenant that records `slot`).
    pub(crate) fn for_each_ref(&self, mut f: impl FnMut(u32, u32)) {
        for (s, v) in self.slots.iter().enumerate() {
            for &i in v {
                f(s as u32, i);
            }
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
        for _ in 0..self.slots.len() {
            if seen >= budget {
                break;
            }
            let s = self.compact_next;
            self.compact_next = (s + 1) % self.slots.len();
            let v = &mut self.slots[s];
            seen += v.len();
            let before = v.len();
            v.retain(|&i| keep(s as u32, i));
            self.refs -= before - v.len();
            if v.capacity() > 2 * v.len() + 256 {
                v.shrink_to_fit();
            }
        }
        seen
    }

    /// Starts a retime pass (a timeout got shorter), or extends the one
    /// under way to a full lap from its cursor.
    pub(crate) fn start_retime(&mut self) {
        if self.slots.is_empty() {
            return; // nothing filed, nothing to move
        }
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
            while r.pos < self.slots[r.slot].len() && seen < budget {
                seen += 1;
                let idx = self.slots[r.slot][r.pos];
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
                    self.slots[r.slot].swap_remove(r.pos);
                    self.refs -= 1;
                }
            }
            if r.pos >= self.slots[r.slot].len() {
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
        let mut v = Vec::new();
        for s in self.slots.iter_mut() {
            v.append(s);
        }
        self.refs = 0;
        self.retime = None;
        self.slots = Box::new([]);
        self.compact_next = 0;
        v
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Vec<u32>>()
            + self.slots.iter().map(|s| s.capacity() * 4).sum::<usize>()
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
        assert!(w.memory_bytes() >= (SLOTS as usize + 1) * std::mem::size_of::<Vec<u32>>());
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
}

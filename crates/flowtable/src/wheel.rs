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

/// Wheel granularity.
pub(crate) const TICK_MS: u64 = 1000;
/// Slots (horizon = 1024 s; longer deadlines are refiled at the horizon).
pub(crate) const SLOTS: u64 = 1024;

#[derive(Debug)]
pub(crate) struct Wheel {
    slots: Box<[Vec<u32>]>,
    /// Next tick to process.
    cur: u64,
    started: bool,
    /// References held (live or stale).
    refs: usize,
    /// Next slot the incremental compaction looks at.
    compact_next: usize,
}

impl Wheel {
    pub(crate) fn new() -> Wheel {
        Wheel {
            slots: (0..=SLOTS).map(|_| Vec::new()).collect(),
            cur: 0,
            started: false,
            refs: 0,
            compact_next: 0,
        }
    }

    pub(crate) fn start(&mut self, now: u64) {
        if !self.started {
            self.cur = now / TICK_MS;
            self.started = true;
        }
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
        self.slots[s as usize].push(idx);
        self.refs += 1;
        s as u32
    }

    /// The next due, non-empty slot, advancing `cur` past empty due ticks.
    /// O(min(elapsed ticks, SLOTS)).
    pub(crate) fn due_slot(&mut self, now: u64) -> Option<u32> {
        if !self.slots[SLOTS as usize].is_empty() {
            return Some(SLOTS as u32);
        }
        let now_t = now / TICK_MS;
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
        None
    }

    pub(crate) fn pop(&mut self, slot: u32) -> Option<u32> {
        let r = self.slots[slot as usize].pop();
        self.refs -= usize::from(r.is_some());
        r
    }

    pub(crate) fn push_back(&mut self, slot: u32, idx: u32) {
        self.slots[slot as usize].push(idx);
        self.refs += 1;
    }

    /// References held, live or stale.
    pub(crate) fn refs(&self) -> usize {
        self.refs
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

    /// Everything filed (for tenant removal).
    pub(crate) fn drain_all(&mut self) -> Vec<u32> {
        let mut v = Vec::new();
        for s in self.slots.iter_mut() {
            v.append(s);
        }
        self.refs = 0;
        v
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Vec<u32>>()
            + self.slots.iter().map(|s| s.capacity() * 4).sum::<usize>()
    }
}

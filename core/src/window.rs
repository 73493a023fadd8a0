//! [`SlotMap`]: the bookkeeping of a sliding-window layer group (see
//! [`crate::config::SlidingLayers`] for the window rule).
//!
//! A cache's [`Bookkeeping`] places every token in a logical cell and decides who sees whom;
//! the fully attending layers store rows at those cells. The sliding layers store rows in
//! their own, smaller pools: a slot per logical cell still inside some holder's window. After
//! each committed step (and each verb) a slot is freed once no holder's last `window`
//! positions include it, so the group holds at most `window` cells per sequence plus the
//! step in flight. A step reads slots `[0, read_len)` under an explicit mask: the logical
//! plan's visibility, and the window.
//!
//! Dropped rows cannot come back: a step or verb that would leave a query needing one is
//! refused with `out_of_window` before anything changes.
//!
//! Prefix reuse: a prefix published to the seq cache's index outlives its sequence, but a
//! later sequence attaching it can resume only if the window's rows before its end are
//! still there. So [`SlotMap::pin_end`] keeps the last `window` rows of a published prefix
//! while the index holds its cells, for a bounded number of ends (the newest), so that the
//! group holds at most that many windows more than its live sequences need. A prefix is
//! resumable where pinned rows cover the window before it: at a pinned end.

use std::collections::VecDeque;

use crate::error::{CacheError, CacheResult};
use crate::kind::Bookkeeping;
use crate::seq::MAX_SEQS;

const FREE: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    /// The logical cell whose row this slot holds (`FREE`: none).
    cell: u32,
    pos: i32,
}

const EMPTY: Slot = Slot { cell: FREE, pos: 0 };

#[derive(Clone, Copy, Debug)]
struct Undo {
    slot: u32,
    was: Slot,
    cell: u32,
    cell_was: u32,
}

/// A published prefix end whose window rows are kept: `(cell, position)` of each.
#[derive(Clone, Debug)]
struct Pin {
    rows: Vec<(u32, i32)>,
}

/// Slots of one sliding-window group; see the module docs. Buffers are kept across steps,
/// so a decode step allocates nothing once warm.
#[derive(Clone, Debug)]
pub struct SlotMap {
    window: usize,
    slots: Vec<Slot>,
    /// Logical cell → slot (`FREE`: none).
    of_cell: Vec<u32>,
    /// One past the highest used slot.
    high: usize,
    used: usize,
    // The open step.
    write: Vec<u32>,
    mask: Vec<bool>,
    read_len: usize,
    undo: Vec<Undo>,
    undo_high: usize,
    undo_used: usize,
    last: [i32; MAX_SEQS],
    /// Pinned prefix ends, oldest first, and how many may be.
    pins: VecDeque<Pin>,
    max_pins: usize,
    /// Per logical cell: whether a pin keeps its row (rebuilt by each eviction).
    pinned: Vec<bool>,
}

impl SlotMap {
    /// An empty map for a window of `window` positions (`>= 1`) that pins no prefix end.
    pub fn new(window: usize) -> Self {
        SlotMap {
            window: window.max(1),
            slots: Vec::new(),
            of_cell: Vec::new(),
            high: 0,
            used: 0,
            write: Vec::new(),
            mask: Vec::new(),
            read_len: 0,
            undo: Vec::new(),
            undo_high: 0,
            undo_used: 0,
            last: [-1; MAX_SEQS],
            pins: VecDeque::new(),
            max_pins: 0,
            pinned: Vec::new(),
        }
    }

    /// This map keeping the windows of the `ends` newest published prefix ends (see
    /// [`SlotMap::pin_end`]).
    pub fn with_pinned_ends(mut self, ends: usize) -> Self {
        self.max_pins = ends;
        self
    }

    /// Keeps the window's rows before the end of sequence `seq`'s positions `0..len`, which
    /// `book` has just published to its prefix index, so that a sequence attaching that
    /// prefix can resume after it. The pin lasts while the index holds those cells and it is
    /// among the newest ends this map keeps.
    pub fn pin_end(&mut self, book: &Bookkeeping, seq: i32, len: usize) {
        let (Ok(bit), Some(last)) = (u32::try_from(seq), len.checked_sub(1)) else {
            return;
        };
        if self.max_pins == 0 {
            return;
        }
        let Some(bit) = 1u64.checked_shl(bit) else {
            return;
        };
        let rows: Vec<(u32, i32)> = (0..book.high_water())
            // Cells the index took (a prefix cached twice keeps the first copy's).
            .filter(|&c| book.cell_holders(c) & bit != 0 && book.is_indexed(c))
            .filter_map(|c| {
                let p = book.cell_position(c)?;
                let near = p as usize <= last && p as i64 > last as i64 - self.window as i64;
                (near && self.slot_of(c, p).is_some()).then_some((c as u32, p))
            })
            .collect();
        if rows.is_empty() {
            return;
        }
        let end = |rows: &[(u32, i32)]| rows.iter().max_by_key(|r| r.1).copied();
        let new_end = end(&rows);
        self.pins.retain(|p| end(&p.rows) != new_end);
        if self.pins.len() == self.max_pins {
            self.pins.pop_front();
        }
        self.pins.push_back(Pin { rows });
    }

    /// Prefix ends pinned now.
    pub fn pinned_ends(&self) -> usize {
        self.pins.len()
    }

    /// The window.
    pub fn window(&self) -> usize {
        self.window
    }

    /// One past the highest slot in use: the pools must hold this many cells.
    pub fn high_water(&self) -> usize {
        self.high
    }

    /// Slots in use.
    pub fn used(&self) -> usize {
        self.used
    }

    /// The open step's slot per token.
    pub fn write_slots(&self) -> &[u32] {
        &self.write
    }

    /// The open step's read window in slots.
    pub fn read_len(&self) -> usize {
        self.read_len
    }

    /// The open step's `[n_tok, read_len]` mask (`true` = attend).
    pub fn mask(&self) -> &[bool] {
        &self.mask
    }

    /// The slot holding logical `cell`'s row at `pos`; none once dropped.
    pub fn slot_of(&self, cell: usize, pos: i32) -> Option<usize> {
        let s = *self.of_cell.get(cell)?;
        (s != FREE && self.slots[s as usize].pos == pos).then_some(s as usize)
    }

    /// Gives the open step of `book` its slots and builds its mask. A query that would
    /// attend a dropped row is `out_of_window`, and the map is then unchanged.
    pub fn plan_step(&mut self, book: &Bookkeeping) -> CacheResult<()> {
        let plan = book.step_plan().expect("plan_step runs with a step open");
        self.undo.clear();
        self.undo_high = self.high;
        self.undo_used = self.used;
        self.write.clear();
        if self.of_cell.len() < book.high_water() {
            self.of_cell.resize(book.high_water(), FREE);
        }
        for i in 0..plan.n_tok {
            let cell = plan.cell_of(i);
            let slot = match self.of_cell[cell] {
                FREE => {
                    let s = self.slots.iter().position(|s| s.cell == FREE);
                    let s = s.unwrap_or_else(|| {
                        self.slots.push(EMPTY);
                        self.slots.len() - 1
                    });
                    self.used += 1;
                    s
                }
                s => s as usize,
            };
            self.undo.push(Undo {
                slot: slot as u32,
                was: self.slots[slot],
                cell: cell as u32,
                cell_was: self.of_cell[cell],
            });
            self.slots[slot] = Slot {
                cell: cell as u32,
                pos: plan.positions[i],
            };
            self.of_cell[cell] = slot as u32;
            self.high = self.high.max(slot + 1);
            self.write.push(slot as u32);
        }
        // Every row a query sees through the window must still have its slot.
        for i in 0..plan.n_tok {
            let p = plan.positions[i] as i64;
            for c in 0..plan.read_len {
                if let Some(q) = book.cell_position(c) {
                    let near = q as i64 > p - self.window as i64;
                    if near && plan.visible(i, c) && self.slot_of(c, q).is_none() {
                        self.rollback_step();
                        return Err(CacheError::out_of_window(format!(
                            "a query at position {p} attends position {q}, which the sliding-window layers (window {}) have already dropped",
                            self.window
                        )));
                    }
                }
            }
        }
        let n = self.high;
        self.read_len = n;
        self.mask.clear();
        self.mask.resize(plan.n_tok * n, false);
        for (s, slot) in self.slots[..n].iter().enumerate() {
            let c = slot.cell as usize;
            if slot.cell == FREE || c >= plan.read_len {
                continue;
            }
            for i in 0..plan.n_tok {
                let near = slot.pos as i64 > plan.positions[i] as i64 - self.window as i64;
                self.mask[i * n + s] = near && plan.visible(i, c);
            }
        }
        Ok(())
    }

    /// Undoes the open step's slot assignments; a no-op when there are none (call it
    /// whenever the bookkeeping's step was rolled back or abandoned).
    pub fn rollback_step(&mut self) {
        if self.undo.is_empty() {
            return;
        }
        for u in self.undo.drain(..).rev() {
            self.slots[u.slot as usize] = u.was;
            self.of_cell[u.cell as usize] = u.cell_was;
        }
        self.high = self.undo_high;
        self.used = self.undo_used;
    }

    /// After `book` committed a step: drops the rows no holder's window includes.
    pub fn commit_step(&mut self, book: &Bookkeeping) {
        self.undo.clear();
        self.evict(book);
    }

    /// A tree commit moved logical rows `rows[i]` to `base + i`: the slots follow (no row
    /// moves), and the slots of every other speculative cell are freed.
    pub fn move_cells(&mut self, base: usize, rows: &[u32]) {
        // The open step's buffer is free between steps.
        let mut moved = std::mem::take(&mut self.write);
        moved.clear();
        moved.extend(
            rows.iter()
                .map(|&r| self.of_cell.get(r as usize).copied().unwrap_or(FREE)),
        );
        for c in base..self.of_cell.len() {
            let s = self.of_cell[c];
            if s != FREE {
                self.of_cell[c] = FREE;
                if !moved.contains(&s) {
                    self.free(s as usize);
                }
            }
        }
        for (i, &s) in moved.iter().enumerate() {
            if s != FREE {
                self.slots[s as usize].cell = (base + i) as u32;
                self.of_cell[base + i] = s;
            }
        }
        self.write = moved;
        self.shrink_high();
    }

    /// After a verb changed `book` (from `before`, when it could shorten a sequence):
    /// `out_of_window` when a holder's next query would need a dropped row (the caller then
    /// restores the bookkeeping; this map is unchanged), else drops what no window includes
    /// any more.
    pub fn check_verb(
        &mut self,
        book: &Bookkeeping,
        before: Option<&Bookkeeping>,
    ) -> CacheResult<()> {
        book.last_positions(&mut self.last);
        // A holder whose last position is `l` next queries at `l + 1`: it needs `q > l + 1 - w`.
        let reach = self.window - 1;
        for c in 0..book.high_water() {
            let Some(q) = book.cell_position(c) else {
                continue;
            };
            if self.slot_of(c, q).is_none() && book.in_reach(c, q, reach, &self.last) {
                return Err(self.out_of_window(book, before.unwrap_or(book), c, q));
            }
        }
        self.evict(book);
        Ok(())
    }

    /// The error for `cell` at `pos`, which `book` needs; `before` says how far back the
    /// holder could have gone.
    fn out_of_window(
        &self,
        book: &Bookkeeping,
        before: &Bookkeeping,
        cell: usize,
        pos: i32,
    ) -> CacheError {
        let w = self.window as i64;
        let mut bits = book.cell_holders(cell);
        let mut holder = bits.trailing_zeros() as usize;
        while bits != 0 {
            let h = bits.trailing_zeros() as usize;
            if pos as i64 > self.last[h] as i64 + 1 - w {
                holder = h;
                break;
            }
            bits &= bits - 1;
        }
        // Rows of `holder` below `floor` are gone; resuming at `r` needs `r - w < q`.
        let floor = (0..before.high_water())
            .filter(|&c| before.cell_holders(c) & (1 << holder) != 0)
            .filter_map(|c| before.cell_position(c).map(|q| (c, q)))
            .filter(|&(c, q)| self.slot_of(c, q).is_none())
            .map(|(_, q)| q as i64 + 1)
            .max()
            .unwrap_or(0);
        CacheError::out_of_window(format!(
            "sequence {holder} would need position {pos}, which its sliding-window layers (window {w}) have already dropped: it can resume at position {} at the earliest (keep the positions below it), or be cleared and prefilled again",
            floor + w - 1
        ))
    }

    /// The index in `positions` (a sequence's history, ascending) of the first row this
    /// group keeps for a holder whose last position is the last of them.
    pub fn window_start(&self, positions: &[i32]) -> usize {
        let Some(&last) = positions.last() else {
            return 0;
        };
        positions.partition_point(|&p| p as i64 <= last as i64 - self.window as i64)
    }

    /// Frees every slot and pin (the bookkeeping was cleared).
    pub fn clear(&mut self) {
        self.pins.clear();
        self.slots.clear();
        self.of_cell.fill(FREE);
        self.high = 0;
        self.used = 0;
        self.undo.clear();
    }

    /// Drops the pins whose cells left the index (or hold other positions now) and marks the
    /// cells the others keep.
    fn refresh_pins(&mut self, book: &Bookkeeping) {
        let live = |r: &(u32, i32)| {
            book.is_indexed(r.0 as usize) && book.cell_position(r.0 as usize) == Some(r.1)
        };
        self.pins.retain(|p| p.rows.iter().all(live));
        self.pinned.clear();
        self.pinned.resize(book.high_water(), false);
        for p in &self.pins {
            for &(c, _) in &p.rows {
                self.pinned[c as usize] = true;
            }
        }
    }

    fn evict(&mut self, book: &Bookkeeping) {
        book.last_positions(&mut self.last);
        self.refresh_pins(book);
        for s in 0..self.high {
            let slot = self.slots[s];
            let c = slot.cell as usize;
            if slot.cell != FREE
                && !book.in_reach(c, slot.pos, self.window, &self.last)
                && !self.pinned.get(c).copied().unwrap_or(false)
            {
                if self.of_cell[slot.cell as usize] == s as u32 {
                    self.of_cell[slot.cell as usize] = FREE;
                }
                self.free(s);
            }
        }
        self.shrink_high();
    }

    fn free(&mut self, s: usize) {
        if self.slots[s].cell != FREE {
            self.slots[s] = EMPTY;
            self.used -= 1;
        }
    }

    fn shrink_high(&mut self) {
        while self.high > 0 && self.slots[self.high - 1].cell == FREE {
            self.high -= 1;
        }
    }
}

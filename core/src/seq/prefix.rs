//! Prefix reuse on the seq cache: the [`RadixIndex`](crate::radix::RadixIndex) maps token
//! prefixes to the cells holding their K/V, so a new sequence starting with cached tokens
//! takes those cells by membership (no K/V copy) and prefills only the rest.
//!
//! Rules:
//! - Cells enter the index by [`SeqBookkeeping::prefix_publish`] (tokens at positions
//!   `0..n` of a sequence) and stay after every sequence lets go of them: an indexed cell is
//!   occupied but visible to no query until a sequence attaches it.
//! - A sequence holding index cells (attached, published, or copied with `seq_cp`) locks their
//!   prefix up to the last of them, no further; its locks shorten as it lets go of cells and
//!   go when it holds none. Eviction
//!   ([`SeqBookkeeping::prefix_evict`], [`SeqBookkeeping::prefix_reserve`]) takes only
//!   unlocked prefixes, least recently used first, so it never frees a cell a live sequence
//!   holds.
//! - Hybrid models (sliding-window layer groups): reuse of `m` tokens is valid only when
//!   every layer group still holds the K/V of positions `0..m` that its attention reads. A
//!   full-attention cache always does; a sliding group keeps the window's rows at the ends
//!   of published prefixes ([`crate::window::SlotMap::pin_end`]), so there an attach that
//!   ends elsewhere is refused `out_of_window` (the caller attaches a shorter prefix).

use super::{seq_bit, SeqBits, SeqBookkeeping, MAX_SEQS};
use crate::error::{CacheError, CacheResult};
use crate::radix::{PrefixLock, RadixError};

/// Sizes of the prefix index, in cells.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Cached tokens.
    pub cached: usize,
    /// Cached tokens no live sequence holds (reclaimable).
    pub evictable: usize,
}

impl From<RadixError> for CacheError {
    fn from(e: RadixError) -> Self {
        match e {
            RadixError::NotEvictable { .. } => CacheError::capacity(e.to_string()),
            RadixError::LengthMismatch { .. } => CacheError::bad_shape(e.to_string()),
            RadixError::NotLocked | RadixError::StaleHandle => {
                unreachable!("the seq cache manages its own locks: {e}")
            }
        }
    }
}

impl SeqBookkeeping {
    /// How many leading `tokens` the index holds. Changes nothing.
    pub fn prefix_match(&self, tokens: &[u32]) -> usize {
        self.index.match_prefix(tokens).0.len()
    }

    /// The cells of the longest cached prefix of `tokens`, by position.
    pub fn prefix_cells(&self, tokens: &[u32]) -> Vec<u32> {
        self.index.match_prefix(tokens).1
    }

    /// Gives the empty sequence `seq` the cells of the longest cached prefix of `tokens`
    /// (positions `0..m`) and returns `m`; the caller prefills `tokens[m..]` at positions
    /// `m..`. To get logits for the last token, attach at most `tokens.len() - 1`.
    pub fn prefix_attach(&mut self, seq: i32, tokens: &[u32]) -> CacheResult<usize> {
        let b = seq_bit(seq)?;
        let held = self.seq_len(seq)?;
        if held > 0 {
            return Err(CacheError::bad_position(format!(
                "sequence {seq} already holds {held} cells: a prefix attaches only to an empty sequence"
            )));
        }
        let (handle, cells) = self.index.match_prefix(tokens);
        if handle.is_empty() {
            return Ok(0);
        }
        self.plan_valid = false;
        let lock = self.index.lock(&handle)?;
        self.locks[seq as usize].push(lock);
        for &c in &cells {
            self.seqs[c as usize] |= b;
        }
        self.reindex(b);
        Ok(cells.len())
    }

    /// Caches `seq`'s K/V of `tokens` (token `i` at position `i`; the sequence must hold
    /// exactly one cell at each position `0..tokens.len()`). Returns how many leading tokens
    /// were cached already (their cells stay the sequence's own). Every sequence holding
    /// one of the cells keeps the published prefix locked while it lives.
    pub fn prefix_publish(&mut self, seq: i32, tokens: &[u32]) -> CacheResult<usize> {
        let b = seq_bit(seq)?;
        let n = tokens.len();
        let mut cells = vec![u32::MAX; n];
        for c in 0..self.high_water {
            if self.seqs[c] & b == 0 {
                continue;
            }
            if let Some(slot) = usize::try_from(self.pos[c])
                .ok()
                .and_then(|p| cells.get_mut(p))
            {
                if *slot != u32::MAX {
                    return Err(CacheError::bad_position(format!(
                        "sequence {seq} holds two cells at position {}: only a single history can be cached",
                        self.pos[c]
                    )));
                }
                *slot = c as u32;
            }
        }
        if let Some(p) = cells.iter().position(|&c| c == u32::MAX) {
            return Err(CacheError::bad_position(format!(
                "sequence {seq} holds no cell at position {p}: publish only tokens whose K/V it holds"
            )));
        }
        if n == 0 {
            return Ok(0);
        }
        self.plan_valid = false;
        let cached = self.index.insert_prefix(tokens, &cells)?;
        for &c in &cells[cached..] {
            self.indexed[c as usize] = true;
        }
        // Every sequence holding cells of the prefix (forks, and requests that attached a part
        // of it, included) locks it up to the last of them: no further, or cells it does not
        // hold would stay unevictable while it lives.
        let (handle, path) = self.index.match_prefix(tokens);
        let holders = path.iter().fold(0, |acc, &c| acc | self.seqs[c as usize]);
        let whole = self.index.lock(&handle)?;
        for s in 0..MAX_SEQS {
            if holders & (1u64 << s) != 0 {
                if let Some(lock) = self.lock_held(s, &whole) {
                    self.locks[s].push(lock);
                }
            }
        }
        self.index.unlock(whole)?;
        Ok(cached)
    }

    /// How many leading tokens of `lock`'s prefix reach the last of its cells sequence `s`
    /// holds (0 when it holds none).
    fn held_len(&self, s: usize, lock: &PrefixLock) -> usize {
        let (b, seqs) = (1u64 << s, &self.seqs);
        self.index
            .held_len(lock, |c| seqs[c as usize] & b != 0)
            .expect("live lock")
    }

    /// A lock for sequence `s` on `lock`'s prefix up to the last of its cells `s` holds;
    /// `None` when it holds none of them.
    fn lock_held(&mut self, s: usize, lock: &PrefixLock) -> Option<PrefixLock> {
        let len = self.held_len(s, lock);
        (len > 0).then(|| self.index.relock_to(lock, len).expect("live lock"))
    }

    /// Frees at least `n` cells of cached prefixes no live sequence holds, least recently
    /// used first; returns the cells freed. `capacity` (nothing freed) when `n` exceeds
    /// what is evictable.
    pub fn prefix_evict(&mut self, n: usize) -> CacheResult<usize> {
        let cells = self.index.evict(n)?;
        self.plan_valid = false;
        let mut freed = 0;
        for &c in &cells {
            let c = c as usize;
            self.indexed[c] = false;
            if self.seqs[c] == 0 {
                self.release(c);
                freed += 1;
            }
        }
        self.settle_free();
        Ok(freed)
    }

    /// Makes `n` cells free for the next step, evicting cached prefixes if the free cells
    /// fall short; returns the cells evicted. `capacity` (nothing evicted) when even
    /// evicting every unheld prefix would not free enough.
    pub fn prefix_reserve(&mut self, n: usize) -> CacheResult<usize> {
        let short = n.saturating_sub(self.free_cells());
        if short > self.index.evictable_size() {
            return Err(CacheError::capacity(format!(
                "{n} cells needed: {} are free and {} more can be evicted (capacity {})",
                self.free_cells(),
                self.index.evictable_size(),
                self.capacity
            )));
        }
        self.prefix_evict(short)
    }

    /// Sizes of the prefix index.
    pub fn prefix_stats(&self) -> PrefixStats {
        PrefixStats {
            cached: self.index.total_size(),
            evictable: self.index.evictable_size(),
        }
    }

    /// `dst` now holds cells of `src`'s prefixes too: it locks each up to the last it holds.
    pub(super) fn share_locks(&mut self, src: i32, dst: i32) {
        let (src, dst) = (src as usize, dst as usize);
        for i in 0..self.locks[src].len() {
            let lock = self.locks[src][i].clone();
            if let Some(again) = self.lock_held(dst, &lock) {
                self.locks[dst].push(again);
            }
        }
    }

    /// The sequences in `which` let go of cells: those holding none release their locks,
    /// the others shorten theirs to the last cell they still hold (allocating nothing).
    pub(super) fn release_locks(&mut self, which: SeqBits) {
        for s in 0..MAX_SEQS {
            if which & (1u64 << s) == 0 {
                continue;
            }
            if self.live & (1u64 << s) == 0 {
                for lock in self.locks[s].drain(..) {
                    self.index.unlock(lock).expect("live lock");
                }
                continue;
            }
            let mut i = 0;
            while i < self.locks[s].len() {
                let lock = self.locks[s][i].clone();
                let len = self.held_len(s, &lock);
                if len == lock.len() {
                    i += 1;
                    continue;
                }
                if len > 0 {
                    self.locks[s][i] = self.index.relock_to(&lock, len).expect("live lock");
                    i += 1;
                } else {
                    self.locks[s].swap_remove(i);
                }
                self.index.unlock(lock).expect("live lock");
            }
        }
    }
}

#[cfg(test)]
mod tests;

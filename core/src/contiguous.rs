//! [`ContiguousBookkeeping`]: one sequence, a length counter.

use crate::error::{CacheError, CacheResult};
use crate::plan::StepPlan;

/// Bookkeeping of the contiguous cache: cells `[0, len)` hold positions `0..len`.
///
/// A step writes positions `p, p+1, .., p+T-1` with `p <= len`; writing at `p < len`
/// replaces the history from `p` on (the cache is truncated to `p + T`).
///
/// [`ContiguousBookkeeping::rollback_step`] undoes the step in progress. An appending step
/// rolls back exactly; a rewriting one (`p < len`) rolls back to `len = p`, because its rows
/// overwrote `[p, ..)` in place and the old rows are gone.
#[derive(Clone, Debug)]
pub struct ContiguousBookkeeping {
    capacity: usize,
    len: usize,
    plan: StepPlan,
    plan_valid: bool,
    /// `len` after a rollback of the step in progress.
    undo_len: usize,
    /// `len` before the step in progress.
    len_before: usize,
}

impl ContiguousBookkeeping {
    /// An empty cache of `capacity` cells.
    pub fn new(capacity: usize) -> Self {
        ContiguousBookkeeping {
            capacity,
            len: 0,
            plan: StepPlan::default(),
            plan_valid: false,
            undo_len: 0,
            len_before: 0,
        }
    }

    /// Whether `n` more tokens fit.
    pub fn can_extend(&self, n: usize) -> bool {
        n <= self.capacity - self.len
    }

    /// The logical ceiling in cells.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no token is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every token (no byte work: rows are overwritten on reuse).
    pub fn clear(&mut self) {
        self.len = 0;
        self.plan_valid = false;
    }

    /// Truncates to `new_len` tokens; growing is a `bad_position` error.
    pub fn rewind(&mut self, new_len: usize) -> CacheResult<()> {
        if new_len > self.len {
            return Err(CacheError::bad_position(format!(
                "rewind to {new_len} cannot grow the cache (it holds {})",
                self.len
            )));
        }
        self.len = new_len;
        self.plan_valid = false;
        Ok(())
    }

    /// Plans a step writing `positions` (which must be consecutive, starting at or before
    /// `len`). Validates before mutating.
    pub fn plan(&mut self, positions: &[i32]) -> CacheResult<&StepPlan> {
        let (start, end) = self.check_run(positions)?;
        self.undo_len = self.len.min(start);
        self.len_before = self.len;
        self.len = end;
        self.plan.set_run(start, positions, end);
        self.plan_valid = true;
        Ok(&self.plan)
    }

    /// The plan of the step in progress, until a verb invalidates it.
    pub fn current_plan(&self) -> Option<&StepPlan> {
        self.plan_valid.then_some(&self.plan)
    }

    /// Undoes the step in progress (see the type docs); a no-op when none is.
    pub fn rollback_step(&mut self) {
        if self.plan_valid {
            self.len = self.undo_len;
            self.plan_valid = false;
        }
    }

    /// Undoes the step in progress before any row was written: exact, a rewriting step
    /// included. A no-op when none is.
    pub fn cancel_step(&mut self) {
        if self.plan_valid {
            self.len = self.len_before;
            self.plan_valid = false;
        }
    }

    /// Validates a run of positions; returns `(start, end)`.
    pub(crate) fn check_run(&self, positions: &[i32]) -> CacheResult<(usize, usize)> {
        let Some(&first) = positions.first() else {
            return Err(CacheError::bad_shape("a step needs at least one token"));
        };
        if first < 0 {
            return Err(CacheError::bad_position(format!(
                "position {first} is negative"
            )));
        }
        if let Some(i) =
            (1..positions.len()).find(|&i| positions[i] as i64 != first as i64 + i as i64)
        {
            return Err(CacheError::bad_position(format!(
                "positions must be consecutive for a contiguous cache: token {i} has position {} after {}",
                positions[i],
                positions[i - 1]
            )));
        }
        let start = first as usize;
        if start > self.len {
            return Err(CacheError::bad_position(format!(
                "position {start} would leave a hole: the cache holds {} tokens",
                self.len
            )));
        }
        let end = start.saturating_add(positions.len());
        if end > self.capacity {
            return Err(CacheError::capacity(format!(
                "positions up to {} exceed capacity {}",
                end - 1,
                self.capacity
            )));
        }
        Ok((start, end))
    }

    /// Marks `[0, new_len)` as held without planning a step (tree commit).
    pub(crate) fn set_len(&mut self, new_len: usize) {
        debug_assert!(new_len <= self.capacity);
        self.len = new_len;
        self.plan_valid = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::plan::{MaskKind, PlanKind};

    #[test]
    fn prefill_then_decode() {
        let mut c = ContiguousBookkeeping::new(8);
        let p = c.plan(&[0, 1, 2]).unwrap().clone();
        assert_eq!(
            (p.write_start, p.read_len, p.mask),
            (Some(0), 3, MaskKind::Causal)
        );
        assert_eq!(p.kind(), PlanKind::SingleContiguous);
        let p = c.plan(&[3]).unwrap().clone();
        assert_eq!(
            (p.write_start, p.read_len, p.mask),
            (Some(3), 4, MaskKind::None)
        );
        assert_eq!(c.len(), 4);
        assert!(c.can_extend(4) && !c.can_extend(5));
        assert_eq!(c.current_plan(), Some(&p));
    }

    #[test]
    fn rewrite_truncates() {
        let mut c = ContiguousBookkeeping::new(8);
        c.plan(&[0, 1, 2, 3, 4]).unwrap();
        let p = c.plan(&[2, 3]).unwrap();
        assert_eq!((p.write_start, p.read_len), (Some(2), 4));
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn rewind_and_clear() {
        let mut c = ContiguousBookkeeping::new(8);
        c.plan(&[0, 1, 2, 3]).unwrap();
        c.rewind(2).unwrap();
        assert_eq!(c.len(), 2);
        assert!(c.current_plan().is_none());
        assert_eq!(c.rewind(3).unwrap_err().kind, ErrorKind::BadPosition);
        assert_eq!(c.len(), 2);
        c.clear();
        assert!(c.is_empty());
        assert_eq!(c.capacity(), 8);
    }

    #[test]
    fn errors_leave_state_unchanged() {
        let mut c = ContiguousBookkeeping::new(8);
        c.plan(&[0, 1, 2]).unwrap();
        let cases: [(&[i32], ErrorKind); 5] = [
            (&[], ErrorKind::BadShape),
            (&[-1], ErrorKind::BadPosition),
            (&[3, 5], ErrorKind::BadPosition),
            (&[4], ErrorKind::BadPosition),
            (&[3, 4, 5, 6, 7, 8], ErrorKind::Capacity),
        ];
        for (pos, kind) in cases {
            let before = c.clone();
            assert_eq!(c.plan(pos).unwrap_err().kind, kind, "{pos:?}");
            assert_eq!(c.len(), before.len());
            assert_eq!(c.current_plan(), before.current_plan());
        }
    }

    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Step { back: usize, n: usize, gap: usize },
        Rewind(usize),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..3usize, 0..5usize, prop_oneof![5 => Just(0usize), 1 => 1..3usize])
                .prop_map(|(back, n, gap)| Op::Step { back, n, gap }),
            2 => (0..20usize).prop_map(Op::Rewind),
            1 => Just(Op::Clear),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

        /// A length counter model: holes, growth past capacity and empty steps are refused
        /// without change; accepted steps write `[start, end)` and read `[0, end)` causally.
        #[test]
        fn steps_match_a_length_counter(ops in prop::collection::vec(op(), 1..24)) {
            const CAP: usize = 16;
            let mut c = ContiguousBookkeeping::new(CAP);
            let mut len = 0usize;
            for op in ops {
                match op {
                    Op::Step { back, n, gap } => {
                        let start = len.saturating_sub(back) + gap;
                        let pos: Vec<i32> = (start..start + n).map(|p| p as i32).collect();
                        let r = c.plan(&pos).cloned();
                        let want = if n == 0 { Err(ErrorKind::BadShape) }
                            else if start > len { Err(ErrorKind::BadPosition) }
                            else if start + n > CAP { Err(ErrorKind::Capacity) }
                            else { Ok(()) };
                        match (r, want) {
                            (Ok(p), Ok(())) => {
                                prop_assert_eq!((p.write_start, p.read_len), (Some(start), start + n));
                                for i in 0..n {
                                    for j in 0..start + n {
                                        prop_assert_eq!(p.visible(i, j), j <= start + i);
                                    }
                                }
                                len = start + n;
                            }
                            (Err(e), Err(k)) => prop_assert_eq!(e.kind, k),
                            (r, w) => return Err(TestCaseError::fail(format!("{r:?} vs {w:?}"))),
                        }
                    }
                    Op::Rewind(to) => {
                        prop_assert_eq!(c.rewind(to).is_ok(), to <= len);
                        len = len.min(to);
                    }
                    Op::Clear => {
                        c.clear();
                        len = 0;
                    }
                }
                prop_assert_eq!(c.len(), len);
                prop_assert_eq!(c.can_extend(CAP - len), true);
                prop_assert_eq!(c.can_extend(CAP - len + 1), false);
            }
        }
    }
}

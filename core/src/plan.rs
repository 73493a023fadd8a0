//! The integer-only hand-off from bookkeeping to a byte layer.

/// How a step's queries attend the read window `[0, read_len)`.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum MaskKind {
    /// Every query sees the whole window (a single decode token).
    #[default]
    None,
    /// Lower-right aligned causal: query `i` of `T` sees cells `j <= read_len - T + i`.
    /// Valid only because the queries occupy the tail of the window.
    Causal,
    /// The dense boolean mask in [`StepPlan::mask_bits`] (`true` = attend).
    Explicit,
}

/// The two read paths a byte layer implements.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum PlanKind {
    /// One sequence in contiguous cells with the queries at its tail: in-place run write,
    /// maskless (None/Causal) attention.
    #[default]
    SingleContiguous,
    /// Everything else: explicit mask (and scatter write unless the cells form a run).
    /// Always correct.
    Explicit,
}

impl PlanKind {
    /// `single_contiguous` / `explicit`.
    pub fn as_str(self) -> &'static str {
        match self {
            PlanKind::SingleContiguous => "single_contiguous",
            PlanKind::Explicit => "explicit",
        }
    }
}

/// Where a step writes and what it reads. Buffers are reused across steps so planning a
/// decode step allocates nothing once warm.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Tokens in the step (`T`).
    pub n_tok: usize,
    /// The step's positions, one per token.
    pub positions: Vec<i32>,
    /// Attention mask kind; [`PlanKind::SingleContiguous`] iff not `Explicit`.
    pub mask: MaskKind,
    /// `Some(start)` when token `i` goes to cell `start + i` (a contiguous run).
    pub write_start: Option<usize>,
    /// Scatter targets, one per token, when `write_start` is `None`.
    pub write_cells: Vec<u32>,
    /// The read window is cells `[0, read_len)`: the occupied extent, never capacity.
    pub read_len: usize,
    /// Row-major `[n_tok, read_len]` when `mask == Explicit`, else empty.
    pub mask_bits: Vec<bool>,
}

impl StepPlan {
    /// Which read path this plan takes.
    pub fn kind(&self) -> PlanKind {
        match self.mask {
            MaskKind::Explicit => PlanKind::Explicit,
            MaskKind::None | MaskKind::Causal => PlanKind::SingleContiguous,
        }
    }

    /// The cell token `i` is written to.
    pub fn cell_of(&self, i: usize) -> usize {
        match self.write_start {
            Some(start) => start + i,
            None => self.write_cells[i] as usize,
        }
    }

    /// Whether query `i` attends cell `j` under this plan (any mask kind).
    pub fn visible(&self, i: usize, j: usize) -> bool {
        j < self.read_len
            && match self.mask {
                MaskKind::None => true,
                MaskKind::Causal => j + self.n_tok <= self.read_len + i,
                MaskKind::Explicit => self.mask_bits[i * self.read_len + j],
            }
    }

    /// Sets up a contiguous run plan (`None` for one token, `Causal` otherwise).
    pub(crate) fn set_run(&mut self, start: usize, positions: &[i32], read_len: usize) {
        let n_tok = positions.len();
        self.set_positions(positions);
        self.write_start = Some(start);
        self.write_cells.clear();
        self.read_len = read_len;
        self.mask_bits.clear();
        self.mask = if n_tok == 1 {
            MaskKind::None
        } else {
            MaskKind::Causal
        };
    }

    pub(crate) fn set_positions(&mut self, positions: &[i32]) {
        self.n_tok = positions.len();
        self.positions.clear();
        self.positions.extend_from_slice(positions);
    }
}

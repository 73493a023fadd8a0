//! The recurrent layers' state in a [`KitCache`](crate::KitCache): **anchors**, the state of
//! every recurrent layer after the token of one cell (a gated delta-rule layer's matrices
//! and convolution tail, as Qwen3.5's linear attention keeps them; a Mamba2 layer's, as
//! Granite 4.0-H's; a short-convolution layer's tail, as LFM2's), and those layers run over
//! a step's tokens.
//!
//! A step resumes each token from the state after its sequence's previous position: the
//! previous token of the step when it is that position (a chain), another token of the step
//! (a tree node's parent), or the anchor of the cell holding it. A step anchors the last
//! token of each chain, every token of a tree step (any node may end the accepted chain)
//! and up to [`CHAIN_ANCHORS`] tokens of the step's chains whose outputs are read
//! (speculative chains, whose refused tails are cut); `commit` moves anchors with their
//! cells. Verbs that would leave a sequence ending at a cell without an anchor are refused
//! by [`Anchors::check_verb`], so a step always finds its state. States are f32 and live in host memory.

use kvplug_core::config::{
    CHAIN_ANCHORS, PINNED_ANCHORS, PROMPT_END_ANCHORS, SPARE_ANCHORS, SURPLUS_ANCHORS,
};
use kvplug_core::{
    Bookkeeping, CacheConfig, CacheError, CacheResult, ConvLayers, DeltaLayers, SsmLayers,
    StepPlan, MAX_SEQS,
};

use crate::delta_rule::{two, Outputs, Rows, Run, Scratch, States, Tokens, NO_STATE};
use crate::mamba2::{softplus, Scan};

/// A tap that reads no cell: a token at the start of its sequence (its state starts from
/// zeros).
pub(crate) const NO_CELL: u32 = u32::MAX;

const NONE: u32 = u32::MAX;

/// One anchor's storage.
struct Slot {
    /// Every recurrent layer's state, ascending by layer: a delta layer's
    /// `[value head][dv][dk]` (row `j` holds `S[·][j]`) then its convolution tail, a Mamba2
    /// layer's `[head][head_dim][state]` then its convolution tail, a convolution layer's
    /// tail (its last `width - 1` input rows, oldest first).
    data: Vec<f32>,
    /// The cell it anchors (`NONE`: free or held by the open step).
    cell: u32,
    /// When it was last anchored (larger is newer).
    stamp: u64,
    pin: Pin,
}

/// Why an anchor no sequence needs is kept: each kind keeps its newest few.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pin {
    /// A recent step's end ([`SPARE_ANCHORS`]).
    Spare,
    /// A published prefix's end ([`PINNED_ANCHORS`]).
    Prefix,
    /// A prompt's end ([`PROMPT_END_ANCHORS`]).
    Prompt,
    /// A token inside a speculative chain of the newest step ([`Anchors::keep_read`]): kept
    /// until the next step commits (the refused tails are cut before it), then a spare.
    Chain,
}

/// The anchors of a cache with recurrent layers, and the open step's working state.
pub struct Anchors {
    delta: Option<DeltaLayers>,
    conv: Option<ConvLayers>,
    ssm: Option<SsmLayers>,
    /// Where each layer of the model starts in an anchor's data (`NONE` for the others).
    offset: Vec<u32>,
    /// f32 values of one anchor.
    per_slot: usize,
    slot_of: Vec<u32>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    clock: u64,
    /// Per token of the open step: its cell, its predecessor's cell (`NO_CELL`: none),
    /// and the slot its state is kept in (`NONE`: not kept).
    step_cell: Vec<u32>,
    step_pred: Vec<u32>,
    step_slot: Vec<u32>,
    /// Per token of the open step: the slot its state is computed in, that of the last
    /// token of its run of continuing tokens (a chain advances in place there).
    step_home: Vec<u32>,
    /// Whether the open step is a tree frontier (every node keeps its state; none is a
    /// prompt).
    step_tree: bool,
    /// Per token of the open step: whether it keeps its state as a chain's
    /// ([`Anchors::keep_read`]).
    step_chain: Vec<bool>,
    /// The slots the newest step kept for its chains ([`Pin::Chain`]).
    chain: Vec<u32>,
    /// One token's convolution output (delta or convolution layer).
    mixed: Vec<f32>,
    /// Per token of the step, the rule's inputs (laid out as [`Tokens`] says): normalized
    /// q and k, SiLU'd v, per value head the log decay and step size.
    qk: Vec<f32>,
    v: Vec<f32>,
    lg: Vec<f32>,
    b: Vec<f32>,
    /// The step's runs of tokens advancing one state.
    runs: Vec<Run>,
    /// Per token of the step, a Mamba2 layer's convolved x, B and C, and the slot its scan
    /// resumes from.
    ssm_in: Vec<f32>,
    ssm_from: Vec<u32>,
    /// Each thread's buffers for the rule.
    scratch: [Scratch; 2],
    /// Threads a prefill splits the heads over (at most 2).
    threads: usize,
    /// Anchors the last check found needed (sequence ends, tree nodes).
    needed: usize,
    /// The check's buffers, kept (no allocation once warm).
    use_of: Vec<u8>,
    spare: Vec<(u64, Pin, u32)>,
    dead: Vec<u32>,
}

impl Anchors {
    /// Anchors for the recurrent (delta-rule, Mamba2 and short-convolution) layers of `cfg`;
    /// `None` without any.
    pub fn new(cfg: &CacheConfig) -> Option<Self> {
        let (delta, conv, ssm) = (cfg.delta, cfg.conv, cfg.ssm);
        if delta.is_none() && conv.is_none() && ssm.is_none() {
            return None;
        }
        let mut offset = vec![NONE; cfg.n_layers];
        let mut per_slot = 0;
        for (l, at) in offset.iter_mut().enumerate() {
            let len = if let Some(d) = delta.filter(|d| d.layers.contains(l)) {
                d.state_len() + d.tail_len()
            } else if let Some(m) = ssm.filter(|m| m.layers.contains(l)) {
                m.state_len() + m.tail_len()
            } else if let Some(c) = conv.filter(|c| c.layers.contains(l)) {
                c.tail_len()
            } else {
                continue;
            };
            *at = per_slot as u32;
            per_slot += len;
        }
        let mixed = delta
            .map_or(0, |d| d.conv_channels())
            .max(conv.map_or(0, |c| c.channels))
            .max(ssm.map_or(0, |m| m.conv_channels()));
        Some(Anchors {
            delta,
            conv,
            ssm,
            offset,
            per_slot,
            slot_of: Vec::new(),
            slots: Vec::new(),
            free: Vec::new(),
            clock: 0,
            step_cell: Vec::new(),
            step_pred: Vec::new(),
            step_slot: Vec::new(),
            step_home: Vec::new(),
            step_tree: false,
            step_chain: Vec::new(),
            chain: Vec::new(),
            mixed: vec![0.0; mixed],
            qk: Vec::new(),
            v: Vec::new(),
            lg: Vec::new(),
            b: Vec::new(),
            runs: Vec::new(),
            ssm_in: Vec::new(),
            ssm_from: Vec::new(),
            scratch: Default::default(),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get().min(2)),
            needed: 0,
            use_of: Vec::new(),
            spare: Vec::new(),
            dead: Vec::new(),
        })
    }

    /// Where `layer`'s state starts in an anchor, if it is a recurrent layer.
    fn offset(&self, layer: usize) -> Option<usize> {
        self.offset
            .get(layer)
            .filter(|&&at| at != NONE)
            .map(|&at| at as usize)
    }

    /// Makes room to anchor cells `0..cells` (as the pools grow: a step then finds it).
    pub fn reserve(&mut self, cells: usize) {
        if self.slot_of.len() < cells {
            self.slot_of.resize(cells, NONE);
        }
    }

    /// Bytes held by anchors (free slots included).
    pub fn bytes(&self) -> usize {
        self.slots.len() * 4 * self.per_slot()
    }

    /// Anchors in use.
    pub fn in_use(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    fn per_slot(&self) -> usize {
        self.per_slot
    }

    /// The state anchored at `cell` (every recurrent layer's, as [`SeqRows::state`] lays
    /// it out), if any.
    ///
    /// [`SeqRows::state`]: kvplug_plugin_api::SeqRows::state
    pub fn state_at(&self, cell: usize) -> Option<&[f32]> {
        self.anchor(cell).map(|s| &self.slots[s as usize].data[..])
    }

    /// Anchors `state` (laid out as [`Anchors::state_at`] gives it) at `cell`; false when
    /// its length is not this cache's.
    pub fn set_state(&mut self, cell: usize, state: &[f32]) -> bool {
        if state.len() != self.per_slot() {
            return false;
        }
        if let Some(old) = self.anchor(cell) {
            self.release(old);
        }
        let s = self.take_slot();
        self.slots[s as usize].data.copy_from_slice(state);
        if self.slot_of.len() <= cell {
            self.slot_of.resize(cell + 1, NONE);
        }
        self.slot_of[cell] = s;
        self.clock += 1;
        let slot = &mut self.slots[s as usize];
        slot.cell = cell as u32;
        slot.stamp = self.clock;
        true
    }

    /// Bytes of one anchor's state.
    pub fn state_bytes(&self) -> usize {
        4 * self.per_slot()
    }

    /// Whether `cell` holds an anchor.
    pub fn anchored(&self, cell: usize) -> bool {
        self.anchor(cell).is_some()
    }

    fn anchor(&self, cell: usize) -> Option<u32> {
        self.slot_of.get(cell).copied().filter(|&s| s != NONE)
    }

    fn take_slot(&mut self) -> u32 {
        if let Some(s) = self.free.pop() {
            return s;
        }
        self.slots.push(Slot {
            data: vec![0.0; self.per_slot()],
            cell: NONE,
            stamp: 0,
            pin: Pin::Spare,
        });
        (self.slots.len() - 1) as u32
    }

    fn release(&mut self, s: u32) {
        let slot = &mut self.slots[s as usize];
        if slot.cell != NONE {
            self.slot_of[slot.cell as usize] = NONE;
        }
        slot.cell = NONE;
        slot.pin = Pin::Spare;
        self.free.push(s);
    }

    /// Opens a step from its plan and taps (`[T, 2]`: per token the cell of its previous
    /// position, [`NO_CELL`] at its sequence's start, then its own): decides which tokens
    /// keep their state (the last of each chain; all of a tree step) and where each is
    /// computed.
    pub fn open_step(&mut self, plan: &StepPlan, taps: &[u32], tree: bool) {
        self.rollback_step();
        self.step_tree = tree;
        let t = plan.n_tok;
        self.step_chain.clear();
        self.step_chain.resize(t, false);
        self.step_cell.clear();
        self.step_pred.clear();
        for i in 0..t {
            self.step_cell.push(taps[2 * i + 1]);
            self.step_pred.push(taps[2 * i]);
        }
        for i in 0..t {
            let cell = self.step_cell[i];
            let continued = i + 1 < t && self.step_pred[i + 1] == cell;
            let read_later = (i + 2..t).any(|j| self.step_pred[j] == cell);
            let slot = if tree || !continued || read_later {
                self.take_slot()
            } else {
                NONE
            };
            self.step_slot.push(slot);
        }
        self.place();
    }

    /// Where each token of the open step is computed: its own slot if it keeps its state,
    /// else that of the next token of its chain that does (a chain advances in place).
    fn place(&mut self) {
        let t = self.step_cell.len();
        self.step_home.clear();
        self.step_home.resize(t, NONE);
        for i in (0..t).rev() {
            self.step_home[i] = match self.step_slot[i] {
                NONE => self.step_home[i + 1],
                s => s,
            };
        }
    }

    /// The open step's outputs that are read (`read`, per token; before any layer runs):
    /// in a run of a sequence whose outputs are all read from some token to its end — a
    /// speculative chain — each of those tokens keeps its state, the earliest first (a
    /// refused tail is cut where the accepted part ends, most often early), up to
    /// [`CHAIN_ANCHORS`] over the step; so a rewind or `seq_rm` of a refused tail there is
    /// exact. The states are kept until the next step commits ([`Pin::Chain`]). A tree step
    /// keeps every node already.
    pub fn keep_read(&mut self, read: &[bool]) {
        let t = self.step_cell.len();
        if self.step_tree || read.len() != t {
            return;
        }
        let (mut budget, mut end) = (CHAIN_ANCHORS, 0);
        while end < t && budget > 0 {
            let start = end;
            end += 1;
            while self.goes_on(end) {
                end += 1;
            }
            let mut from = end;
            while from > start && read[from - 1] {
                from -= 1;
            }
            if end - from < 2 {
                continue;
            }
            for i in from..end - 1 {
                if budget == 0 {
                    break;
                }
                if self.step_slot[i] == NONE {
                    self.step_slot[i] = self.take_slot();
                    self.step_chain[i] = true;
                    budget -= 1;
                }
            }
        }
        if budget < CHAIN_ANCHORS {
            self.place();
        }
    }

    /// Drops the open step's states (its anchors were never published).
    pub fn rollback_step(&mut self) {
        for &s in &self.step_slot {
            if s != NONE {
                self.free.push(s);
            }
        }
        self.step_slot.clear();
        self.step_cell.clear();
        self.step_pred.clear();
        self.step_home.clear();
    }

    /// Whether anchors beyond the budget have piled up (steps add anchors; a check every
    /// few steps drops the surplus, so a decode loop scans the cells rarely).
    pub fn over_budget(&self) -> bool {
        self.in_use() > self.needed + SURPLUS_ANCHORS
    }

    /// Publishes the open step's kept states as the anchors of their cells (replacing what
    /// those cells anchored before). Outside a tree step, the end of a run of two or more
    /// tokens whose last token's output is read (`read`, per token) and the one before it
    /// not is kept as a prompt end ([`PROMPT_END_ANCHORS`]): the last chunk of a prompt,
    /// not an earlier chunk (nothing read), a speculative chain (every token read) or a
    /// chain written again (nothing read).
    pub fn commit_step(&mut self, read: &[bool]) {
        self.clock += 1;
        for &s in &self.chain {
            let slot = &mut self.slots[s as usize];
            if slot.pin == Pin::Chain {
                slot.pin = Pin::Spare;
            }
        }
        self.chain.clear();
        for i in 0..self.step_cell.len() {
            let read_at = |j: usize| read.get(j).copied().unwrap_or(false);
            let prompt_end =
                self.goes_on(i) && !self.goes_on(i + 1) && read_at(i) && !read_at(i - 1);
            let cell = self.step_cell[i] as usize;
            if let Some(old) = self.anchor(cell) {
                self.release(old);
            }
            let s = self.step_slot[i];
            if s == NONE {
                continue;
            }
            if self.slot_of.len() <= cell {
                self.slot_of.resize(cell + 1, NONE);
            }
            self.slot_of[cell] = s;
            let slot = &mut self.slots[s as usize];
            slot.cell = cell as u32;
            slot.stamp = self.clock;
            slot.pin = if prompt_end {
                Pin::Prompt
            } else if self.step_chain.get(i) == Some(&true) {
                self.chain.push(s);
                Pin::Chain
            } else {
                Pin::Spare
            };
        }
        self.step_slot.clear();
        self.step_cell.clear();
        self.step_pred.clear();
        self.step_home.clear();
    }

    /// Whether token `i` of the open step (none past its last) goes on from token `i − 1`:
    /// one run of a sequence, outside a tree step.
    fn goes_on(&self, i: usize) -> bool {
        !self.step_tree
            && i > 0
            && i < self.step_cell.len()
            && self.step_pred[i] == self.step_cell[i - 1]
    }

    /// Runs delta layer `layer` over the open step: `x` `[T, channels]` is the q, k, v
    /// projection, `kernel` `[channels, width]` the depthwise convolution over it, `alpha`
    /// `[T, Hv]` the decay projection with its bias, `beta` `[T, Hv]` the step-size
    /// projection, `a` `[Hv]` the per-head decay rates (`−exp(A_log)`); writes `out`
    /// `[T, Hv·dv]`. Per token: the convolution over its sequence's last `width` rows
    /// (zeros before the start), SiLU; then per value head `h` (key head `h mod Hk`):
    /// `q, k ← L2-normalized (ε = eps), q ← q/√dk, g = a·softplus(alpha),
    /// b = sigmoid(beta)`, `S ← exp(g)·S; S ← S + k ⊗ b·(v − Sᵀk); out = Sᵀq`.
    #[allow(clippy::too_many_arguments)]
    pub fn run_layer(
        &mut self,
        layer: usize,
        x: &[f32],
        kernel: &[f32],
        alpha: &[f32],
        beta: &[f32],
        a: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> CacheResult<()> {
        let (Some(d), Some(at)) = (
            self.delta.filter(|d| d.layers.contains(layer)),
            self.offset(layer),
        ) else {
            return Err(CacheError::bad_shape(format!(
                "layer {layer} is no delta layer"
            )));
        };
        let (hk, hv, n, w) = (d.key_heads, d.value_heads, d.head_dim, d.width);
        let (sl, ch, pl) = (
            d.state_len(),
            d.conv_channels(),
            d.state_len() + d.tail_len(),
        );
        let t = self.step_cell.len();
        let qk_len = 2 * hk * n;
        self.qk.resize(t * qk_len, 0.0);
        self.v.resize(t * hv * n, 0.0);
        self.lg.resize(t * hv, 0.0);
        self.b.resize(t * hv, 0.0);
        self.runs.clear();
        // Each token in order: its convolution from its sequence's tail (which moves along
        // with it), activations and gates; the runs of tokens advancing one state.
        for i in 0..t {
            let row = &x[i * ch..(i + 1) * ch];
            let src = self.convolve(i, at + sl..at + pl, row, kernel, w)?;
            let home = self.step_home[i];
            if i > 0 && self.step_pred[i] == self.step_cell[i - 1] && home == self.step_home[i - 1]
            {
                self.runs.last_mut().expect("a run is open").end = i + 1;
            } else {
                self.runs.push(Run {
                    start: i,
                    end: i + 1,
                    from: src.unwrap_or(NO_STATE),
                    home,
                });
            }
            let mixed = &self.mixed[..ch];
            // SiLU, then L2-normalize q and k per key head; q also by 1/√dk.
            let qk = &mut self.qk[i * qk_len..(i + 1) * qk_len];
            for (h, qk) in qk.chunks_mut(n).enumerate() {
                let raw = &mixed[h * n..(h + 1) * n];
                let mut ss = 0f32;
                for (o, &v) in qk.iter_mut().zip(raw) {
                    *o = silu(v);
                    ss += *o * *o;
                }
                let mut r = 1.0 / (ss + eps).sqrt();
                if h < hk {
                    r /= (n as f32).sqrt();
                }
                qk.iter_mut().for_each(|v| *v *= r);
            }
            let v = &mut self.v[i * hv * n..(i + 1) * hv * n];
            for (v, &m) in v.iter_mut().zip(&mixed[qk_len..]) {
                *v = silu(m);
            }
            for h in 0..hv {
                self.lg[i * hv + h] = a[h] * softplus(alpha[i * hv + h]);
                self.b[i * hv + h] = sigmoid(beta[i * hv + h]);
            }
        }
        let tokens = Tokens {
            n,
            hk,
            hv,
            qk: &self.qk,
            v: &self.v,
            lg: &self.lg,
            b: &self.b,
        };
        let runs = &self.runs[..];
        let [sc_a, sc_b] = &mut self.scratch;
        let layer = LayerHeads {
            at: at..at + sl,
            heads: hv,
            state: n * n,
            width: n,
            split: t >= PARALLEL_TOKENS && self.threads > 1,
        };
        layer.advance(
            &mut self.slots,
            out,
            [sc_a, sc_b],
            |heads, states, rows, sc| tokens.advance(heads, runs, states, rows, sc),
        );
        Ok(())
    }

    /// Runs short-convolution layer `layer` over the open step: `x` `[T, channels]` are its
    /// input rows, `kernel` `[channels, width]`; writes `out` `[T, channels]`, per token the
    /// causal depthwise convolution over its sequence's last `width` rows, the token's own
    /// last (zeros before the sequence began), summed oldest first in f32.
    pub fn run_conv(
        &mut self,
        layer: usize,
        x: &[f32],
        kernel: &[f32],
        out: &mut [f32],
    ) -> CacheResult<()> {
        let (Some(c), Some(at)) = (
            self.conv.filter(|c| c.layers.contains(layer)),
            self.offset(layer),
        ) else {
            return Err(CacheError::bad_shape(format!(
                "layer {layer} is no convolution layer"
            )));
        };
        let ch = c.channels;
        for i in 0..self.step_cell.len() {
            let row = &x[i * ch..(i + 1) * ch];
            self.convolve(i, at..at + c.tail_len(), row, kernel, c.width)?;
            out[i * ch..(i + 1) * ch].copy_from_slice(&self.mixed[..ch]);
        }
        Ok(())
    }

    /// Runs Mamba2 layer `layer` over the open step: `x` `[T, channels]` is the x, B and C
    /// part of its input projection, `kernel` `[channels, width]` and `bias` `[channels]` the
    /// depthwise convolution over it, `dt` `[T, heads]` the step projection with its bias,
    /// `a` `[heads]` the decay rates (`−exp(A_log)`), `d` `[heads]` the skip weights; writes
    /// `out` `[T, heads · head_dim]`. Per token: the convolution over its sequence's last
    /// `width` rows (zeros before the start) plus `bias`, SiLU, then the scan of
    /// [`crate::mamba2::Scan::advance`] from its sequence's state.
    #[allow(clippy::too_many_arguments)]
    pub fn run_ssm(
        &mut self,
        layer: usize,
        x: &[f32],
        kernel: &[f32],
        bias: &[f32],
        dt: &[f32],
        a: &[f32],
        d: &[f32],
        out: &mut [f32],
    ) -> CacheResult<()> {
        let (Some(m), Some(at)) = (
            self.ssm.filter(|m| m.layers.contains(layer)),
            self.offset(layer),
        ) else {
            return Err(CacheError::bad_shape(format!(
                "layer {layer} is no Mamba2 layer"
            )));
        };
        let (ch, sl) = (m.conv_channels(), m.state_len());
        let t = self.step_cell.len();
        self.ssm_in.resize(t * ch, 0.0);
        self.ssm_from.clear();
        // Each token in order: its convolution from its sequence's tail (which moves along
        // with it), plus the bias, through SiLU; then the scan over every token, by heads.
        for i in 0..t {
            let row = &x[i * ch..(i + 1) * ch];
            let src = self.convolve(i, at + sl..at + sl + m.tail_len(), row, kernel, m.width)?;
            let acts = &mut self.ssm_in[i * ch..(i + 1) * ch];
            for ((v, &mixed), &b) in acts.iter_mut().zip(&self.mixed[..ch]).zip(bias) {
                *v = silu(mixed + b);
            }
            self.ssm_from.push(src.unwrap_or(NO_STATE));
        }
        let scan = Scan {
            xbc: &self.ssm_in,
            dt,
            a,
            d,
            heads: m.heads,
            head_dim: m.head_dim,
            groups: m.groups,
            state: m.state,
            from: &self.ssm_from,
            home: &self.step_home,
        };
        let layer = LayerHeads {
            at: at..at + sl,
            heads: m.heads,
            state: m.head_dim * m.state,
            width: m.head_dim,
            split: t >= PARALLEL_TOKENS && self.threads > 1,
        };
        layer.advance(
            &mut self.slots,
            out,
            [&mut (), &mut ()],
            |heads, states, rows, _| scan.advance(heads, states, rows),
        );
        Ok(())
    }

    /// Token `i`'s convolution in the layer whose tail lies at `tails` of an anchor's data:
    /// the tail's rows (oldest first), then `row` (the token's own), weighted by `kernel`
    /// (`[row.len(), w]`), into `mixed`; the tail moves along into the token's home slot,
    /// dropping its oldest row and ending with `row`. Returns the slot the token resumed
    /// from (`None`: zeros, at a sequence's start).
    fn convolve(
        &mut self,
        i: usize,
        tails: std::ops::Range<usize>,
        row: &[f32],
        kernel: &[f32],
        w: usize,
    ) -> CacheResult<Option<u32>> {
        let ch = row.len();
        let src = if i > 0 && self.step_pred[i] == self.step_cell[i - 1] {
            Some(self.step_home[i - 1])
        } else {
            self.source(i)?
        };
        let home = self.step_home[i] as usize;
        let (old, tail): (Option<&[f32]>, &mut [f32]) = match src {
            Some(s) if s as usize == home => (None, &mut self.slots[home].data[tails]),
            Some(s) => {
                let (src, dst) = two(&mut self.slots, s as usize, home);
                (Some(&src.data[tails.clone()]), &mut dst.data[tails])
            }
            None => {
                let dst = &mut self.slots[home].data[tails];
                dst.fill(0.0);
                (None, dst)
            }
        };
        let old_rows = old.unwrap_or(tail);
        for (c, m) in self.mixed[..ch].iter_mut().enumerate() {
            let k = &kernel[c * w..(c + 1) * w];
            let past: f32 = (0..w - 1).map(|j| k[j] * old_rows[j * ch + c]).sum();
            *m = past + k[w - 1] * row[c];
        }
        match old {
            Some(o) => tail[..(w - 2) * ch].copy_from_slice(&o[ch..]),
            None => tail.copy_within(ch.., 0),
        }
        tail[(w - 2) * ch..].copy_from_slice(row);
        Ok(src)
    }

    /// The slot holding the state token `i` resumes from (`None`: zeros, at a sequence's
    /// start): a step token's kept state, or the anchor of its predecessor's cell.
    fn source(&self, i: usize) -> CacheResult<Option<u32>> {
        let pred = self.step_pred[i];
        if pred == NO_CELL {
            return Ok(None);
        }
        let from_step = (0..i)
            .rev()
            .find(|&j| self.step_cell[j] == pred)
            .map(|j| self.step_slot[j]);
        match from_step {
            Some(s) if s != NONE => Ok(Some(s)),
            Some(_) => unreachable!("open_step keeps every state a later token reads"),
            None => self.anchor(pred as usize).map(Some).ok_or_else(|| {
                CacheError::bad_shape(format!(
                    "the recurrent state after cell {pred} is not kept (no anchor)"
                ))
            }),
        }
    }

    /// Moves anchors with rows (a tree commit: `rows[i]` → `base + i`).
    pub fn move_rows(&mut self, base: usize, rows: &[u32]) {
        let moved: Vec<u32> = rows.iter().map(|&r| self.take_anchor(r as usize)).collect();
        for (i, s) in moved.into_iter().enumerate() {
            let cell = base + i;
            if let Some(old) = self.anchor(cell) {
                self.release(old);
            }
            if s != NONE {
                self.slot_of[cell] = s;
                self.slots[s as usize].cell = cell as u32;
            }
        }
    }

    fn take_anchor(&mut self, cell: usize) -> u32 {
        match self.anchor(cell) {
            Some(s) => {
                self.slot_of[cell] = NONE;
                self.slots[s as usize].cell = NONE;
                s
            }
            None => NONE,
        }
    }

    /// Pins the state at the end of `seq`'s published `tokens` (a [`PINNED_ANCHORS`] pin).
    /// Where the prefix index keeps another sequence's cell for that end (it held those
    /// tokens already, from a request whose state was not kept there), that cell gets a
    /// copy of the state: the state after the same tokens is the same, and a later request
    /// attaching them resumes from the index's cells.
    pub fn pin_end(&mut self, book: &Bookkeeping, seq: i32, tokens: &[u32]) {
        let len = tokens.len();
        let Ok(history) = book.history(seq) else {
            return;
        };
        let Some(&(_, cell)) = history.iter().find(|&&(p, _)| p as usize + 1 == len) else {
            return;
        };
        let Some(own) = self.anchor(cell as usize) else {
            return;
        };
        let indexed = book
            .prefix_cells(tokens)
            .ok()
            .filter(|c| c.len() == len)
            .and_then(|c| c.last().copied())
            .filter(|&c| c != cell);
        let pinned = match indexed {
            Some(c) => match self.anchor(c as usize) {
                Some(s) => s,
                None => {
                    let s = self.take_slot();
                    let (from, to) = two(&mut self.slots, own as usize, s as usize);
                    to.data.copy_from_slice(&from.data);
                    if self.slot_of.len() <= c as usize {
                        self.slot_of.resize(c as usize + 1, NONE);
                    }
                    self.slot_of[c as usize] = s;
                    self.slots[s as usize].cell = c;
                    s
                }
            },
            None => own,
        };
        self.clock += 1;
        let slot = &mut self.slots[pinned as usize];
        slot.pin = Pin::Prefix;
        slot.stamp = self.clock;
    }

    /// Makes the anchor at `cell`, if any, the newest of its kind.
    pub fn touch(&mut self, cell: usize) {
        if let Some(s) = self.anchor(cell) {
            self.clock += 1;
            self.slots[s as usize].stamp = self.clock;
        }
    }

    /// After a verb: refuses the state `book` is in when a sequence would end at a cell
    /// without an anchor (`out_of_window`, as a sliding window's refusal: the state there is
    /// gone), or hold a hole (`bad_shape`) (a `seq_rm` inside its history: the state cannot
    /// forget the middle); else drops anchors beyond what is needed, the spares and pins.
    pub fn check_verb(&mut self, book: &Bookkeeping) -> CacheResult<()> {
        let mut last = [-1i32; MAX_SEQS];
        book.last_positions(&mut last);
        let mut held = [0usize; MAX_SEQS];
        // Per slot: 0 dead (its cell is no longer held), 1 a spare, 2 needed.
        let mut use_of = std::mem::take(&mut self.use_of);
        use_of.clear();
        use_of.resize(self.slots.len(), 0);
        for c in 0..book.high_water() {
            let Some(q) = book.cell_position(c) else {
                // A tree node: kept while the tree lives.
                if book.in_reach(c, 0, 1, &last) {
                    if let Some(s) = self.anchor(c) {
                        use_of[s as usize] = 2;
                    }
                }
                continue;
            };
            if let Some(s) = self.anchor(c) {
                use_of[s as usize] = 1;
            }
            let mut bits = book.cell_holders(c);
            while bits != 0 {
                held[bits.trailing_zeros() as usize] += 1;
                bits &= bits - 1;
            }
            if book.in_reach(c, q, 1, &last) {
                match self.anchor(c) {
                    Some(s) => use_of[s as usize] = 2,
                    None => {
                        self.use_of = use_of;
                        return Err(CacheError::out_of_window(format!(
                            "the recurrent state after position {q} is not kept: a hybrid \
                             cache with recurrent layers can return only to the end of one \
                             of the last {SPARE_ANCHORS} steps, of one of the last \
                             {PROMPT_END_ANCHORS} prompts, of a published prefix or to a \
                             token of the newest step's speculative chains"
                        )));
                    }
                }
            }
        }
        if let Some(h) = (0..MAX_SEQS).find(|&h| last[h] >= 0 && held[h] != last[h] as usize + 1) {
            return Err(CacheError::bad_shape(format!(
                "sequence {h} would hold {} of its positions 0..={}: a recurrent state \
                 cannot forget the middle of a sequence (remove a tail instead)",
                held[h], last[h]
            )));
        }
        self.needed = use_of.iter().filter(|&&u| u == 2).count();
        self.evict(&use_of);
        self.use_of = use_of;
        Ok(())
    }

    /// Frees anchors of cells no longer held, then all but the newest spares and pins.
    fn evict(&mut self, use_of: &[u8]) {
        let (mut spare, mut dead) = (
            std::mem::take(&mut self.spare),
            std::mem::take(&mut self.dead),
        );
        spare.clear();
        dead.clear();
        for (s, (slot, &u)) in self.slots.iter().zip(use_of).enumerate() {
            match (slot.cell != NONE, u) {
                (true, 0) => dead.push(s as u32),
                (true, 1) => spare.push((slot.stamp, slot.pin, s as u32)),
                _ => {}
            }
        }
        for &s in &dead {
            self.release(s);
        }
        spare.sort_unstable_by_key(|&(stamp, ..)| std::cmp::Reverse(stamp));
        let mut kept = [0; 4];
        for &(_, pin, s) in &spare {
            let budget = match pin {
                Pin::Spare => SPARE_ANCHORS,
                Pin::Prefix => PINNED_ANCHORS,
                Pin::Prompt => PROMPT_END_ANCHORS,
                Pin::Chain => CHAIN_ANCHORS,
            };
            kept[pin as usize] += 1;
            if kept[pin as usize] > budget {
                self.release(s);
            }
        }
        self.spare = spare;
        self.dead = dead;
    }
}

/// Steps of at least this many tokens split the rule's heads over threads.
const PARALLEL_TOKENS: usize = 8;

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// One recurrent layer's heads in the anchors' slots and a step's outputs: each slot's
/// states at `at` of its data (`state` values per head), `width` outputs per head and token.
struct LayerHeads {
    at: std::ops::Range<usize>,
    heads: usize,
    state: usize,
    width: usize,
    /// Whether to split the heads over two threads (a prefill; a decode step stays on one
    /// and allocates nothing).
    split: bool,
}

impl LayerHeads {
    /// Runs `advance` over every head into `out` (`[T, heads · width]`): on two threads, a
    /// half of the heads and one of `scratch` each, when split (and there are two heads).
    fn advance<X: Send>(
        &self,
        slots: &mut [Slot],
        out: &mut [f32],
        scratch: [&mut X; 2],
        advance: impl Fn(std::ops::Range<usize>, &mut dyn States, &mut dyn Outputs, &mut X) + Sync,
    ) {
        let [sc_a, sc_b] = scratch;
        let heads = self.heads;
        if !self.split || heads < 2 {
            let mut states = LayerStates {
                slots,
                at: self.at.clone(),
            };
            let mut rows = Rows {
                data: out,
                width: heads * self.width,
            };
            return advance(0..heads, &mut states, &mut rows, sc_a);
        }
        let half = heads / 2;
        let layer_states = slots.iter_mut().map(|s| &mut s.data[self.at.clone()]);
        let (mut states_a, mut states_b): (Vec<_>, Vec<_>) = layer_states
            .map(|s| s.split_at_mut(half * self.state))
            .unzip();
        let (mut out_a, mut out_b): (Vec<_>, Vec<_>) = out
            .chunks_exact_mut(heads * self.width)
            .map(|r| r.split_at_mut(half * self.width))
            .unzip();
        let advance = &advance;
        std::thread::scope(|scope| {
            scope.spawn(move || advance(half..heads, &mut states_b, &mut out_b, sc_b));
            advance(0..half, &mut states_a, &mut out_a, sc_a);
        });
    }
}

/// One recurrent layer's states in the anchors' slots: `at` of each slot's data.
struct LayerStates<'a> {
    slots: &'a mut [Slot],
    at: std::ops::Range<usize>,
}

impl States for LayerStates<'_> {
    fn pair(&mut self, from: u32, home: u32) -> (Option<&[f32]>, &mut [f32]) {
        let (home, at) = (home as usize, self.at.clone());
        if from == NO_STATE || from as usize == home {
            let to = &mut self.slots[home].data[at];
            if from == NO_STATE {
                to.fill(0.0);
            }
            return (None, to);
        }
        let (from, to) = two(self.slots, from as usize, home);
        (Some(&from.data[at.clone()]), &mut to.data[at])
    }
}

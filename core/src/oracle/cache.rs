//! [`RefCache`]: the reference cache of every kind — the oracle's own [`CellModel`] for
//! who sees whom, K/V per cell in f64 stored exactly as the KV dtype rounds or quantizes,
//! and naive attention with the error bound of the arithmetic set (f32 unless told).

use crate::arithmetic::Arithmetic;
use crate::config::CacheConfig;
use crate::dtype::KvDtype;
use crate::error::{CacheError, CacheResult};
use crate::kind::CacheKind;
use crate::plan::PlanKind;
use crate::quant::quant_round_trip;
use crate::rounding::{round_bf16, round_f16, round_f32};

use super::attention::{attend, Attention, AttnDims, RefMask};
use super::cells::{CellModel, RefPlan};

/// What a pool of `dtype` returns for `row` after storing it.
pub fn store_rounded(dtype: KvDtype, row: &[f64]) -> Vec<f64> {
    match dtype {
        KvDtype::F32 => row.iter().map(|&x| round_f32(x)).collect(),
        KvDtype::F16 => row.iter().map(|&x| round_f16(x)).collect(),
        KvDtype::Bf16 => row.iter().map(|&x| round_bf16(x)).collect(),
        KvDtype::Q8 { group } => quant_round_trip(row, 8, group),
        KvDtype::Q4 { group } => quant_round_trip(row, 4, group),
    }
}

/// One sequence's K/V history as the oracle holds it: what a backend's exported rows must
/// decode to, and what importing rows makes a cache hold (the canonical row form of
/// `SeqRows` in the plugin API, decoded to values).
#[derive(Clone, Debug, PartialEq)]
pub struct RefRows {
    /// Position of each row, ascending.
    pub positions: Vec<i32>,
    /// Per layer, K `[n_kv_heads, rows, head_dim]` over the rows the layer holds: every row,
    /// or for a sliding-window layer those from [`RefRows::window_from`] on.
    pub k: Vec<Vec<f64>>,
    /// Per layer, V likewise.
    pub v: Vec<Vec<f64>>,
    /// The first row the sliding-window layers hold: the first position above
    /// `last - window` (0 without sliding layers).
    pub window_from: usize,
}

impl RefRows {
    /// The row indices `layer` holds under `cfg`.
    pub fn layer_rows(&self, cfg: &CacheConfig, layer: usize) -> std::ops::Range<usize> {
        let n = self.positions.len();
        if cfg.slides(layer) {
            self.window_from.min(n)..n
        } else {
            0..n
        }
    }
}

/// Cell `c`'s K and V rows of one layer, emptied for writing (the layer's cells grown to
/// hold it).
fn emptied<'a>(
    k: &'a mut Vec<Vec<f64>>,
    v: &'a mut Vec<Vec<f64>>,
    c: usize,
) -> (&'a mut Vec<f64>, &'a mut Vec<f64>) {
    if k.len() <= c {
        k.resize(c + 1, Vec::new());
        v.resize(c + 1, Vec::new());
    }
    let (kr, vr) = (&mut k[c], &mut v[c]);
    kr.clear();
    vr.clear();
    (kr, vr)
}

/// The step in progress: the model as it was before it (rollback restores it whole).
#[derive(Clone, Debug)]
struct OpenStep {
    before: CellModel,
    gone_before: Vec<bool>,
    plan: RefPlan,
    positions: Vec<i32>,
    next_layer: usize,
}

/// A reference cache: a [`CellModel`] plus, per layer and cell, K and V rows
/// (`[n_kv_heads · head_dim]`, f64, as stored).
///
/// Steps follow the contract: [`RefCache::open_step`], one [`RefCache::attend_layer`] per
/// layer in order, then [`RefCache::commit_step`] or [`RefCache::rollback_step`]; any verb or
/// a new step rolls back a step left open. [`RefCache::update_and_attend`] is the ABI's
/// per-layer form of the same.
#[derive(Clone, Debug)]
pub struct RefCache {
    cfg: CacheConfig,
    model: CellModel,
    k: Vec<Vec<Vec<f64>>>,
    v: Vec<Vec<Vec<f64>>>,
    step: Option<OpenStep>,
    last_plan: Option<RefPlan>,
    /// Cells whose rows the sliding-window layers have dropped (or never held).
    gone: Vec<bool>,
    /// The mask the last attended layer used (window applied).
    last_mask: Vec<bool>,
    /// The arithmetic whose bound attention reports.
    arithmetic: Arithmetic,
}

impl RefCache {
    /// Builds an empty cache; `bad_config` when `cfg` is invalid.
    pub fn new(kind: CacheKind, cfg: CacheConfig) -> CacheResult<Self> {
        cfg.validate()?;
        Ok(RefCache {
            cfg,
            model: CellModel::new(kind, cfg.capacity),
            k: vec![Vec::new(); cfg.n_layers],
            v: vec![Vec::new(); cfg.n_layers],
            step: None,
            last_plan: None,
            gone: Vec::new(),
            last_mask: Vec::new(),
            arithmetic: Arithmetic::F32,
        })
    }

    /// Bounds later attention for a backend computing with `arithmetic` (f32 at first).
    pub fn set_arithmetic(&mut self, arithmetic: Arithmetic) {
        self.arithmetic = arithmetic;
    }

    /// The arithmetic whose bound attention reports.
    pub fn arithmetic(&self) -> Arithmetic {
        self.arithmetic
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// The kind.
    pub fn kind(&self) -> CacheKind {
        self.model.kind()
    }

    /// The plan of the step in progress.
    pub fn step_plan(&self) -> Option<&RefPlan> {
        self.step.as_ref().map(|s| &s.plan)
    }

    /// The plan of the last step opened (committed, rolled back or still open).
    pub fn last_plan(&self) -> Option<&RefPlan> {
        self.last_plan.as_ref()
    }

    /// One past the highest occupied cell.
    pub fn high_water(&self) -> usize {
        self.model.high_water()
    }

    /// Opens a step at `positions` (a step left open is rolled back first).
    pub fn open_step(&mut self, positions: &[i32]) -> CacheResult<&RefPlan> {
        self.rollback_step();
        let before = self.model.clone();
        let plan = self.model.step(positions)?;
        self.last_plan = Some(plan.clone());
        if let Some(w) = self.window() {
            // A query may not see, through the window, a row the sliding layers dropped.
            let l = plan.read_len;
            for (i, &p) in positions.iter().enumerate() {
                for j in (0..l).filter(|j| plan.mask[i * l + j] && !plan.cells.contains(j)) {
                    let pos = self.model.window_holders(j).map_or(i32::MIN, |h| h.0);
                    if self.is_gone(j) && pos as i64 > p as i64 - w {
                        self.model = before;
                        return Err(CacheError::out_of_window(format!(
                            "position {p} needs dropped position {pos}"
                        )));
                    }
                }
            }
        }
        let gone_before = self.gone.clone();
        for &c in &plan.cells {
            if self.gone.len() <= c {
                self.gone.resize(c + 1, true);
            }
            self.gone[c] = false;
        }
        let step = self.step.insert(OpenStep {
            gone_before,
            before,
            plan,
            positions: positions.to_vec(),
            next_layer: 0,
        });
        Ok(&step.plan)
    }

    /// Makes the open step permanent; the sliding layers drop what left every window.
    pub fn commit_step(&mut self) {
        if self.step.take().is_some() {
            self.drop_out_of_window();
        }
    }

    fn window(&self) -> Option<i64> {
        self.cfg.sliding.map(|s| s.window as i64)
    }

    fn is_gone(&self, cell: usize) -> bool {
        self.gone.get(cell).copied().unwrap_or(true)
    }

    /// The highest position of each holder (see [`CellModel::window_holders`]).
    fn last_positions(&self) -> std::collections::BTreeMap<i32, i32> {
        let mut last = std::collections::BTreeMap::new();
        for j in 0..self.model.high_water() {
            if let Some((pos, Some(holders))) = self.model.window_holders(j) {
                for h in holders {
                    let e = last.entry(h).or_insert(pos);
                    *e = (*e).max(pos);
                }
            }
        }
        last
    }

    /// Sliding layers keep, for each holder whose highest position is `l`, the rows at
    /// positions `> l - window`; every other row is dropped.
    fn drop_out_of_window(&mut self) {
        let Some(w) = self.window() else { return };
        let last = self.last_positions();
        let n = self.model.high_water();
        self.gone.resize(n.max(self.gone.len()), true);
        for j in 0..self.gone.len() {
            let keep = match self.model.window_holders(j) {
                None => false,
                Some((_, None)) => true,
                Some((pos, Some(hs))) => hs.iter().any(|h| pos as i64 > last[h] as i64 - w),
            };
            if !keep {
                self.gone[j] = true;
            }
        }
    }

    /// Applies a verb; with sliding layers, refuses it (undone) when a holder's next query,
    /// at `l + 1`, would need a dropped row: positions `> l + 1 - window`.
    fn windowed<T>(&mut self, verb: impl FnOnce(&mut Self) -> CacheResult<T>) -> CacheResult<T> {
        self.rollback_step();
        let (model, gone) = (self.model.clone(), self.gone.clone());
        let out = verb(self)?;
        if let Some(w) = self.window() {
            let last = self.last_positions();
            for j in 0..self.model.high_water() {
                if let Some((pos, Some(hs))) = self.model.window_holders(j) {
                    let needed = hs.iter().any(|h| pos as i64 > last[h] as i64 + 1 - w);
                    if needed && self.is_gone(j) {
                        (self.model, self.gone) = (model, gone);
                        return Err(CacheError::out_of_window(format!(
                            "position {pos} was dropped"
                        )));
                    }
                }
            }
        }
        self.drop_out_of_window();
        Ok(out)
    }

    /// Undoes the open step: the model is as before it, except that a contiguous step that
    /// rewrote history keeps only the tokens before its first position (its rows overwrote
    /// the rest in place).
    pub fn rollback_step(&mut self) {
        let Some(step) = self.step.take() else {
            return;
        };
        self.model = step.before;
        self.gone = step.gone_before;
        if step.plan.kind == PlanKind::SingleContiguous && self.kind() != CacheKind::Seq {
            self.model.truncate_prefix(step.positions[0] as usize);
        }
    }

    /// Writes this step's k/v for `layer` (the next layer of the open step) and attends. q is
    /// `[n_q_heads, T, D]` (the head count follows from its length), k and v
    /// `[n_kv_heads, T, D]`, row-major; the result is `[n_q_heads, T, D]`.
    pub fn attend_layer(
        &mut self,
        layer: usize,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        scale: f64,
    ) -> CacheResult<Attention> {
        let (hkv, d) = (self.cfg.n_kv_heads, self.cfg.head_dim);
        let slide = self.window().filter(|_| self.cfg.slides(layer));
        let Some(step) = &mut self.step else {
            return Err(CacheError::bad_shape(format!(
                "layer {layer}: no step is open"
            )));
        };
        if layer != step.next_layer {
            return Err(CacheError::bad_shape(format!(
                "layer {layer} out of order: the step expects layer {}",
                step.next_layer
            )));
        }
        step.next_layer += 1;
        let (plan, t) = (&step.plan, step.positions.len());
        let (kl, vl) = (&mut self.k[layer], &mut self.v[layer]);
        for (i, &c) in plan.cells.iter().enumerate() {
            let (kr, vr) = emptied(kl, vl, c);
            for h in 0..hkv {
                let src = (h * t + i) * d;
                kr.extend(store_rounded(self.cfg.kv_dtype, &k[src..src + d]));
                vr.extend(store_rounded(self.cfg.kv_dtype, &v[src..src + d]));
            }
        }
        let l = plan.read_len;
        // [hkv, L, D] windows; cells nobody sees may hold nothing and read as zeros.
        let window = |rows: &[Vec<f64>]| -> Vec<f64> {
            let mut w = vec![0.0; hkv * l * d];
            for (j, row) in rows.iter().enumerate().take(l) {
                for h in 0..hkv {
                    if !row.is_empty() {
                        w[(h * l + j) * d..][..d].copy_from_slice(&row[h * d..][..d]);
                    }
                }
            }
            w
        };
        let dims = AttnDims {
            n_q_heads: q.len() / (t * d),
            n_kv_heads: hkv,
            n_tok: t,
            read_len: l,
            head_dim: d,
        };
        let mut mask = plan.mask.clone();
        if let Some(w) = slide {
            // The window rule: query `i` at `p` sees cell `j` at `q` only if `p - w < q`.
            for (i, &p) in step.positions.iter().enumerate() {
                for j in 0..l {
                    let q = self.model.window_holders(j).map_or(i32::MIN, |h| h.0);
                    if q as i64 <= p as i64 - w {
                        mask[i * l + j] = false;
                    }
                }
            }
        }
        let out = attend(
            dims,
            q,
            &window(kl),
            &window(vl),
            scale,
            RefMask::Explicit(&mask),
            self.arithmetic,
        );
        self.last_mask = mask;
        Ok(out)
    }

    /// The `[T, read_len]` mask (`true` = query `i` sees cell `j`) of the last layer
    /// attended, sliding window applied: which keys each query should have seen.
    pub fn last_mask(&self) -> &[bool] {
        &self.last_mask
    }

    /// The ABI's per-layer op: layer 0 opens a step (rolling back one left open), each layer
    /// writes and attends, the last layer commits; any refusal inside a step rolls it back.
    /// Shapes are checked before the step (so a bad layer 0 changes nothing).
    pub fn update_and_attend(
        &mut self,
        layer: usize,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        positions: &[i32],
        scale: f64,
    ) -> CacheResult<Attention> {
        if layer == 0 {
            self.rollback_step();
        }
        let result = self.checked_layer(layer, q, k, v, positions, scale);
        match &result {
            Err(_) => self.rollback_step(),
            Ok(_) if layer + 1 == self.cfg.n_layers => self.commit_step(),
            Ok(_) => {}
        }
        result
    }

    fn checked_layer(
        &mut self,
        layer: usize,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        positions: &[i32],
        scale: f64,
    ) -> CacheResult<Attention> {
        let (hkv, d) = (self.cfg.n_kv_heads, self.cfg.head_dim);
        let t = positions.len();
        if layer >= self.cfg.n_layers {
            return Err(CacheError::bad_shape(format!(
                "layer {layer} is outside 0..{}",
                self.cfg.n_layers
            )));
        }
        let n_q_heads = if t == 0 { 0 } else { q.len() / (t * d) };
        if n_q_heads == 0
            || n_q_heads % hkv != 0
            || q.len() != n_q_heads * t * d
            || k.len() != hkv * t * d
            || v.len() != hkv * t * d
        {
            return Err(CacheError::bad_shape(format!(
                "q/k/v lengths {}/{}/{} do not fit {t} tokens of {hkv} KV heads × {d}",
                q.len(),
                k.len(),
                v.len()
            )));
        }
        if layer == 0 {
            self.open_step(positions)?;
        } else if self.step.as_ref().is_some_and(|s| s.positions != positions) {
            return Err(CacheError::bad_position(format!(
                "layer {layer} positions differ from those of layer 0"
            )));
        }
        self.attend_layer(layer, q, k, v, scale)
    }

    /// Whether `n` more tokens fit.
    pub fn can_extend(&self, n: usize) -> bool {
        self.model.can_extend(n)
    }

    /// The logical ceiling in cells.
    pub fn capacity(&self) -> usize {
        self.cfg.capacity
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        let _ = self.windowed(|c| {
            c.model.clear();
            Ok(())
        });
    }

    /// Contiguous: truncate to `len`.
    pub fn rewind(&mut self, len: usize) -> CacheResult<()> {
        self.windowed(|c| c.model.rewind(len))
    }

    /// Seq: the next step's per-token sequences.
    pub fn begin_step(&mut self, seqs: &[i32]) -> CacheResult<()> {
        self.rollback_step();
        self.model.begin_step(seqs)
    }

    /// Seq: share `src`'s cells with positions in `[p0, p1)` with `dst`.
    pub fn seq_cp(
        &mut self,
        src: i32,
        dst: i32,
        p0: Option<i32>,
        p1: Option<i32>,
    ) -> CacheResult<()> {
        self.windowed(|c| c.model.seq_cp(src, dst, p0, p1))
    }

    /// Seq: drop `seq` from its cells with positions in `[p0, p1)`.
    pub fn seq_rm(&mut self, seq: i32, p0: Option<i32>, p1: Option<i32>) -> CacheResult<()> {
        self.windowed(|c| c.model.seq_rm(seq, p0, p1))
    }

    /// Seq: keep `seq` alone.
    pub fn seq_keep(&mut self, seq: i32) -> CacheResult<()> {
        self.windowed(|c| c.model.seq_keep(seq))
    }

    /// Seq: cells held by `seq`.
    pub fn seq_len(&self, seq: i32) -> CacheResult<usize> {
        self.model.seq_len(seq)
    }

    /// The K/V history `seq` holds (contiguous and tree: sequence 0, the committed prefix).
    pub fn export_seq(&mut self, seq: i32) -> CacheResult<RefRows> {
        self.rollback_step();
        let history = self.model.history(seq)?;
        let positions: Vec<i32> = history.iter().map(|h| h.0).collect();
        let window_from = self
            .cfg
            .sliding
            .filter(|s| !s.layers.is_empty())
            .map_or(0, |s| super::rows::window_start(&positions, s.window));
        let mut rows = RefRows {
            positions,
            k: Vec::new(),
            v: Vec::new(),
            window_from,
        };
        let (hkv, d) = (self.cfg.n_kv_heads, self.cfg.head_dim);
        for layer in 0..self.cfg.n_layers {
            let held = &history[rows.layer_rows(&self.cfg, layer)];
            let gather = |pool: &[Vec<f64>]| -> Vec<f64> {
                let mut out = Vec::with_capacity(hkv * held.len() * d);
                for h in 0..hkv {
                    for &(_, c) in held {
                        out.extend_from_slice(&pool[c][h * d..][..d]);
                    }
                }
                out
            };
            rows.k.push(gather(&self.k[layer]));
            rows.v.push(gather(&self.v[layer]));
        }
        Ok(rows)
    }

    /// Appends `rows` (values as stored: no rounding) to the history of `seq` as one step:
    /// every layer sized for the rows it holds, positions ascending, the sliding layers'
    /// rows covering the window after the last of them, every position `seq` holds below the
    /// first row's (a contiguous cache must end right before it, a tree cache must be empty)
    /// and room for them. All or nothing.
    pub fn import_seq(&mut self, seq: i32, rows: &RefRows) -> CacheResult<()> {
        self.rollback_step();
        let (hkv, d, n) = (self.cfg.n_kv_heads, self.cfg.head_dim, rows.positions.len());
        let sized = |side: &Vec<Vec<f64>>| {
            side.len() == self.cfg.n_layers
                && side
                    .iter()
                    .enumerate()
                    .all(|(l, x)| x.len() == hkv * rows.layer_rows(&self.cfg, l).len() * d)
        };
        if rows.window_from > n || !sized(&rows.k) || !sized(&rows.v) {
            return Err(CacheError::bad_shape(format!(
                "rows of {n} positions do not fit {} layers of {hkv} KV heads × {d}",
                self.cfg.n_layers
            )));
        }
        if rows.positions.windows(2).any(|w| w[0] > w[1]) {
            return Err(CacheError::bad_position("row positions must ascend"));
        }
        if let Some(s) = self.cfg.sliding.filter(|s| !s.layers.is_empty()) {
            if rows.window_from > super::rows::window_start(&rows.positions, s.window) {
                return Err(CacheError::out_of_window(format!(
                    "the sliding layers' rows start at index {}, after the window's start",
                    rows.window_from
                )));
            }
        }
        let held = self.model.history(seq)?;
        let Some(&first) = rows.positions.first() else {
            return Ok(());
        };
        if let Some(&(last, _)) = held.last() {
            let appends = match self.kind() {
                CacheKind::Seq => last < first,
                CacheKind::Contiguous => last + 1 == first,
                CacheKind::Tree => false,
            };
            if !appends {
                return Err(CacheError::bad_position(format!(
                    "sequence {seq} holds up to position {last}; the rows start at {first}"
                )));
            }
        }
        if self.kind() == CacheKind::Tree && self.model.high_water() > 0 {
            return Err(CacheError::bad_position(
                "a tree cache imports only when empty",
            ));
        }
        if self.kind() == CacheKind::Seq {
            self.model.begin_step(&vec![seq; n])?;
        }
        self.open_step(&rows.positions)?;
        let cells = self
            .step
            .as_ref()
            .expect("a step was just opened")
            .plan
            .cells
            .clone();
        for layer in 0..self.cfg.n_layers {
            let span = rows.layer_rows(&self.cfg, layer);
            let (kl, vl) = (&mut self.k[layer], &mut self.v[layer]);
            for (i, &c) in cells.iter().enumerate() {
                let (kr, vr) = emptied(kl, vl, c);
                if !span.contains(&i) {
                    // A sliding layer does not hold rows before the window: they read as zeros
                    // and the window never shows them.
                    kr.resize(hkv * d, 0.0);
                    vr.resize(hkv * d, 0.0);
                    continue;
                }
                let at = i - span.start;
                for h in 0..hkv {
                    let src = (h * span.len() + at) * d;
                    kr.extend_from_slice(&rows.k[layer][src..src + d]);
                    vr.extend_from_slice(&rows.v[layer][src..src + d]);
                }
            }
        }
        self.commit_step();
        Ok(())
    }

    /// Tree: append a frontier.
    pub fn propose(&mut self, parents: &[i32]) -> CacheResult<()> {
        self.rollback_step();
        self.model.propose(parents)
    }

    /// Tree: accept a root-first chain; its rows move into the prefix.
    pub fn commit(&mut self, accepted: &[i32]) -> CacheResult<()> {
        self.windowed(|c| {
            let moves = c.model.commit(accepted)?;
            for rows in c.k.iter_mut().chain(c.v.iter_mut()) {
                for &(from, to) in &moves {
                    rows[to] = rows[from].clone();
                }
            }
            for &(from, to) in &moves {
                c.gone[to] = c.gone[from];
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CacheConfig;
    use crate::error::ErrorKind;

    fn cfg(kv_dtype: KvDtype) -> CacheConfig {
        CacheConfig {
            capacity: 16,
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 4,
            min_chunk: 4,
            kv_dtype,
            sliding: None,
            conv: None,
            delta: None,
            ssm: None,
        }
    }

    /// Deterministic rows that differ per token.
    fn rows(t: usize, salt: f64) -> Vec<f64> {
        (0..t * 4)
            .map(|i| ((i as f64 + salt) * 0.37).sin())
            .collect()
    }

    #[test]
    fn seq_fork_matches_running_each_branch_alone() {
        // Trunk of 3 tokens, two branches forked by seq_cp, decoded in one step.
        let mut fork = RefCache::new(CacheKind::Seq, cfg(KvDtype::F32)).unwrap();
        fork.update_and_attend(
            0,
            &rows(3, 0.0),
            &rows(3, 1.0),
            &rows(3, 2.0),
            &[0, 1, 2],
            0.5,
        )
        .unwrap();
        fork.seq_cp(0, 1, None, None).unwrap();
        fork.begin_step(&[0, 1]).unwrap();
        let q = rows(2, 7.0);
        let (k, v) = (rows(2, 8.0), rows(2, 9.0));
        let both = fork
            .update_and_attend(0, &q, &k, &v, &[3, 3], 0.5)
            .unwrap()
            .out;
        for b in 0..2 {
            let mut alone = RefCache::new(CacheKind::Contiguous, cfg(KvDtype::F32)).unwrap();
            alone
                .update_and_attend(
                    0,
                    &rows(3, 0.0),
                    &rows(3, 1.0),
                    &rows(3, 2.0),
                    &[0, 1, 2],
                    0.5,
                )
                .unwrap();
            let r = b * 4..b * 4 + 4;
            let out = alone
                .update_and_attend(0, &q[r.clone()], &k[r.clone()], &v[r.clone()], &[3], 0.5)
                .unwrap()
                .out;
            assert_eq!(out, both[r]);
        }
    }

    #[test]
    fn tree_commit_moves_accepted_rows() {
        let mut tree = RefCache::new(CacheKind::Tree, cfg(KvDtype::F32)).unwrap();
        tree.update_and_attend(0, &rows(2, 0.0), &rows(2, 1.0), &rows(2, 2.0), &[0, 1], 1.0)
            .unwrap();
        tree.propose(&[-1, -1, 1]).unwrap();
        let (k, v) = (rows(3, 3.0), rows(3, 4.0));
        tree.update_and_attend(0, &rows(3, 5.0), &k, &v, &[2, 2, 3], 1.0)
            .unwrap();
        tree.commit(&[1, 2]).unwrap();
        // After the commit, cells 2 and 3 hold nodes 1 and 2 (rounded as f32).
        let q = rows(1, 6.0);
        let out = tree
            .update_and_attend(0, &q, &rows(1, 7.0), &rows(1, 8.0), &[4], 1.0)
            .unwrap()
            .out;
        let mut seq = RefCache::new(CacheKind::Contiguous, cfg(KvDtype::F32)).unwrap();
        seq.update_and_attend(0, &rows(2, 0.0), &rows(2, 1.0), &rows(2, 2.0), &[0, 1], 1.0)
            .unwrap();
        seq.update_and_attend(0, &rows(2, 5.0), &k[4..], &v[4..], &[2, 3], 1.0)
            .unwrap();
        let expect = seq
            .update_and_attend(0, &q, &rows(1, 7.0), &rows(1, 8.0), &[4], 1.0)
            .unwrap()
            .out;
        assert_eq!(out, expect);
    }

    #[test]
    fn quantized_storage_is_what_is_attended() {
        let mut c = RefCache::new(CacheKind::Contiguous, cfg(KvDtype::Q4 { group: 4 })).unwrap();
        let v = vec![0.1, -0.7, 0.35, 0.9];
        let out = c
            .update_and_attend(0, &[0.0; 4], &[0.2; 4], &v, &[0], 1.0)
            .unwrap()
            .out;
        assert_eq!(out, quant_round_trip(&v, 4, 4));
        assert_ne!(out, v);
    }

    #[test]
    fn bad_inputs_are_refused_without_change() {
        let mut c = RefCache::new(CacheKind::Contiguous, cfg(KvDtype::F16)).unwrap();
        let e = c.update_and_attend(0, &[0.0; 4], &[0.0; 8], &[0.0; 4], &[0], 1.0);
        assert_eq!(e.unwrap_err().kind, ErrorKind::BadShape);
        let e = c.update_and_attend(1, &[0.0; 4], &[0.0; 4], &[0.0; 4], &[0], 1.0);
        assert_eq!(e.unwrap_err().kind, ErrorKind::BadShape);
        let e = c.update_and_attend(0, &[], &[0.0; 4], &[0.0; 4], &[0], 1.0);
        assert_eq!(e.unwrap_err().kind, ErrorKind::BadShape);
        assert_eq!(c.high_water(), 0);
        assert_eq!(c.seq_len(0).unwrap_err().kind, ErrorKind::NotSupported);
        assert_eq!(
            RefCache::new(CacheKind::Seq, cfg(KvDtype::Q8_DEFAULT))
                .unwrap_err()
                .kind,
            ErrorKind::BadConfig
        );
    }
}

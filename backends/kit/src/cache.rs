//! [`KitCache`]: the Pool policy and the three cache kinds, written once over [`Device`].

use std::sync::Arc;

use kvplug_core::limits::check_memory;
use kvplug_core::{
    Arithmetic, Bookkeeping, CacheConfig, CacheError, CacheKind, CacheResult, CacheVerbs, MaskKind,
    PlanKind, PosRange, PrefixStats, SlotMap,
};
use kvplug_plugin_api::abi_stable::std_types::RVec;
use kvplug_plugin_api::{AbiErrorKind, HostTensor, PluginError, SeqRows, TensorDtype};

use crate::anchors::{Anchors, NO_CELL};
use crate::device::{AttendMask, Device};

/// Rows [`KitCache::import_seq`] writes per step (bounds the step plan and the staging copy).
pub const IMPORT_CHUNK: usize = 512;

/// A refused call (cache error, input unchanged) or a device failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KitError {
    /// Bad input; the cache is unchanged.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The device or its runtime failed.
    #[error("device: {0}")]
    Device(String),
}

impl From<KitError> for PluginError {
    fn from(e: KitError) -> Self {
        match e {
            KitError::Cache(c) => c.into(),
            KitError::Device(m) => PluginError::new(AbiErrorKind::Backend, m),
        }
    }
}

/// Memory and last-step statistics of a [`KitCache`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KitStats {
    /// Bytes of every layer's K and V pools and of the recurrent layers' anchors.
    pub allocated_bytes: usize,
    /// Rows per head each full layer's pool has room for.
    pub pool_cells: usize,
    /// Rows per head each sliding layer's pool has room for (0 without sliding layers):
    /// at most window + one micro-batch per sequence, whatever the history length.
    pub window_cells: usize,
    /// Cells holding data.
    pub live_cells: usize,
    /// One past the highest cell holding data.
    pub high_water: usize,
    /// The read path of the last planned step.
    pub last_plan: Option<PlanKind>,
    /// The read window of the last planned step (`0` before the first).
    pub last_read_len: usize,
    /// Sizes of the seq cache's prefix index.
    pub prefix: PrefixStats,
}

/// A KV cache of any kind on device `D`: core's bookkeeping plus one K and one V pool per
/// fully attending layer. Pools start at `min_chunk` cells and double on demand up to
/// `capacity`; reads cover only the occupied window; writes are in place.
///
/// Sliding-window layers (a hybrid model, see [`kvplug_core::SlidingLayers`]) form one group
/// with its own pools, indexed by the group's [`SlotMap`]: bounded by the window whatever
/// the history, read under the window's mask.
///
/// Recurrent layers (short-convolution layers, LFM2's, see [`kvplug_core::ConvLayers`];
/// gated delta-rule layers, Qwen3.5's, see [`kvplug_core::DeltaLayers`]) hold no rows: their
/// per-sequence state is kept as [`Anchors`], the state after chosen cells, and a verb that
/// would leave a sequence ending where none is kept is refused.
pub struct KitCache<D: Device> {
    device: Arc<D>,
    cfg: CacheConfig,
    book: Bookkeeping,
    /// Where each layer's rows live: its index in `k`/`v` or in the sliding group's pools.
    place: Vec<Place>,
    k: Vec<D::Pool>,
    v: Vec<D::Pool>,
    pool_cells: usize,
    sliding: Option<SlidingGroup<D>>,
    /// The position each cell was last written at (kept only with recurrent layers): with
    /// the plan's visibility, where a token finds the cell of its previous position.
    cell_pos: Vec<i32>,
    /// The open step's taps (`[T, 2]` cells: each token's previous position's, then its
    /// own), made when it opens (with recurrent layers; else empty).
    taps: Vec<u32>,
    /// Per token of the open step, whether its output is read ([`Step::read_rows`]).
    reads: Vec<bool>,
    /// The recurrent layers' states (`None` without recurrent layers).
    anchors: Option<Anchors>,
    /// The recurrent layers' host buffers, kept between steps.
    host: RecurrentHost,
    /// Read path and read window of the last planned step.
    last_plan: Option<(PlanKind, usize)>,
    /// The layer the open step expects next.
    next_layer: usize,
    scratch: D::Scratch,
    /// The arithmetic attention computes with (one of [`KitCache::arithmetics`]).
    arithmetic: Arithmetic,
}

/// K and V pools of a set of layers.
type KvPools<D> = (Vec<<D as Device>::Pool>, Vec<<D as Device>::Pool>);

/// The recurrent layers' inputs and outputs on the host ([`Step::conv`], [`Step::delta`],
/// [`Step::ssm`]): downloaded, computed and uploaded through buffers that keep their size,
/// so a decode step allocates nothing.
struct RecurrentHost {
    /// The tensor each download and the upload go through.
    tensor: HostTensor,
    /// A layer's inputs, in the order its step passes them (at most three).
    inputs: [Vec<f32>; 3],
    y: Vec<f32>,
}

impl Default for RecurrentHost {
    fn default() -> Self {
        RecurrentHost {
            tensor: HostTensor::empty(),
            inputs: Default::default(),
            y: Vec::new(),
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Place {
    Full(usize),
    Sliding(usize),
    /// A recurrent (convolution or delta-rule) layer: its state is in the anchors.
    Recurrent,
}

/// Published prefix ends whose window rows a sliding group keeps, so that later sequences
/// can resume there (the newest ends; each costs at most a window of rows per sliding layer).
/// Enough for a few agents re-sending their conversations turn after turn.
pub const PINNED_ENDS: usize = 4;

/// The sliding-window layers' pools and slots.
struct SlidingGroup<D: Device> {
    map: SlotMap,
    k: Vec<D::Pool>,
    v: Vec<D::Pool>,
    cells: usize,
}

impl<D: Device> KitCache<D> {
    /// An empty cache; `bad_config` for an invalid config or a dtype the device lacks.
    pub fn new(device: Arc<D>, kind: CacheKind, cfg: CacheConfig) -> Result<Self, KitError> {
        cfg.validate()?;
        if !device
            .kv_dtypes()
            .iter()
            .any(|d| d.family() == cfg.kv_dtype.family())
        {
            return Err(CacheError::bad_config(format!(
                "this device has no {} pools",
                cfg.kv_dtype
            ))
            .into());
        }
        let cells = cfg.first_chunk();
        check_memory(
            &format!("the first K/V pools ({cells} cells)"),
            cfg.pools_bytes(cells),
        )?;
        // K then V pools of `n` layers.
        let new_pools = |n: usize| -> Result<KvPools<D>, KitError> {
            let mut pools = Vec::with_capacity(2 * n);
            for _ in 0..2 * n {
                pools.push(device.pool_new(cfg.kv_dtype, cfg.n_kv_heads, cfg.head_dim, cells)?);
            }
            let v = pools.split_off(n);
            Ok((pools, v))
        };
        let (pools, v) = new_pools(cfg.full_layers())?;
        let sliding = match cfg.sliding {
            Some(s) => {
                let (k, v) = new_pools(s.layers.len())?;
                Some(SlidingGroup {
                    map: SlotMap::new(s.window).with_pinned_ends(PINNED_ENDS),
                    k,
                    v,
                    cells,
                })
            }
            None => None,
        };
        let (mut full, mut slide) = (0, 0);
        let place = (0..cfg.n_layers)
            .map(|l| {
                if cfg.is_recurrent(l) {
                    return Place::Recurrent;
                }
                let (n, p): (&mut usize, fn(usize) -> Place) = if cfg.slides(l) {
                    (&mut slide, Place::Sliding)
                } else {
                    (&mut full, Place::Full)
                };
                *n += 1;
                p(*n - 1)
            })
            .collect();
        let mut book = Bookkeeping::new(kind, cfg.capacity);
        book.reserve(cells);
        tracing::debug!(kind = kind.as_str(), cells, dtype = %cfg.kv_dtype, "cache created");
        let arithmetic = device
            .arithmetics(cfg.kv_dtype)
            .first()
            .copied()
            .unwrap_or_default();
        let anchors = Anchors::new(&cfg);
        Ok(KitCache {
            device,
            cfg,
            book,
            place,
            k: pools,
            v,
            pool_cells: cells,
            sliding,
            cell_pos: match anchors {
                Some(_) => vec![-1; cells],
                None => Vec::new(),
            },
            taps: Vec::new(),
            reads: Vec::new(),
            anchors,
            host: RecurrentHost::default(),
            last_plan: None,
            next_layer: 0,
            scratch: D::Scratch::default(),
            arithmetic,
        })
    }

    /// The attention arithmetics this cache can compute with, the one a new cache uses
    /// first and f32 always among them.
    pub fn arithmetics(&self) -> Vec<Arithmetic> {
        let mut all = self.device.arithmetics(self.cfg.kv_dtype);
        if !all.contains(&Arithmetic::F32) {
            all.push(Arithmetic::F32);
        }
        all
    }

    /// The arithmetic attention computes with.
    pub fn arithmetic(&self) -> Arithmetic {
        self.arithmetic
    }

    /// Computes later attention with `arithmetic`, from the next layer attended on (a step
    /// may mix declared arithmetics; each output is within the bound of its own);
    /// `not_supported` (and no change) unless it is one of [`KitCache::arithmetics`].
    pub fn set_arithmetic(&mut self, arithmetic: Arithmetic) -> Result<(), CacheError> {
        let all = self.arithmetics();
        if !all.contains(&arithmetic) {
            let names: Vec<&str> = all.iter().map(|a| a.as_str()).collect();
            return Err(CacheError::not_supported(format!(
                "attention arithmetic '{arithmetic}' is not computed for {} pools here (it computes: {})",
                self.cfg.kv_dtype,
                names.join(", ")
            )));
        }
        self.arithmetic = arithmetic;
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// The device.
    pub fn device(&self) -> &Arc<D> {
        &self.device
    }

    /// Memory and last-step statistics.
    pub fn stats(&self) -> KitStats {
        KitStats {
            allocated_bytes: self
                .k
                .iter()
                .chain(&self.v)
                .chain(self.sliding.iter().flat_map(|g| g.k.iter().chain(&g.v)))
                .map(|p| self.device.pool_bytes(p))
                .sum::<usize>()
                + self.anchors.as_ref().map_or(0, Anchors::bytes),
            pool_cells: self.pool_cells,
            window_cells: self.sliding.as_ref().map_or(0, |g| g.cells),
            live_cells: self.book.live_cells(),
            high_water: self.book.high_water(),
            last_plan: self.last_plan.map(|p| p.0),
            last_read_len: self.last_plan.map_or(0, |p| p.1),
            prefix: self.book.prefix_stats(),
        }
    }

    /// Opens a step: declares its sequences (seq cache; `None` = all in sequence 0, or what
    /// `begin_step` declared), places its tokens and plans it. Write every layer through
    /// the returned [`Step`], in order, then [`Step::commit`]; dropping it uncommitted, or
    /// any failure, leaves the bookkeeping exactly as before (see [`Bookkeeping`]).
    pub fn step(
        &mut self,
        positions: &[i32],
        seq_ids: Option<&[i32]>,
    ) -> Result<Step<'_, D>, KitError> {
        if let Some(seqs) = seq_ids {
            self.book.begin_step(seqs)?;
        }
        self.open(positions)?;
        if !self.cell_pos.is_empty() {
            // Before anything is written, so that a refusal undoes the step exactly.
            if let Err(e) = self.make_taps() {
                self.cancel_open();
                return Err(e.into());
            }
        }
        Ok(Step {
            cache: self,
            next_layer: 0,
            committed: false,
        })
    }

    /// The ABI's per-layer form of a step: layer 0 opens it (rolling back one left open),
    /// layers `1..n` continue it with the same positions, the last layer commits it. Any
    /// refusal or device failure inside a step rolls the whole step back. Shapes are checked
    /// first, so a bad layer 0 leaves the cache as it was.
    #[allow(clippy::too_many_arguments)]
    pub fn update_and_attend(
        &mut self,
        layer: usize,
        q: &D::Tensor,
        k: &D::Tensor,
        v: &D::Tensor,
        positions: &[i32],
        scale: f32,
        out: &mut D::Tensor,
    ) -> Result<(), KitError> {
        if layer == 0 {
            self.book.rollback_step();
        }
        let result = self.checked_layer(layer, q, k, v, positions, scale, out);
        match result {
            Err(_) => self.rollback(),
            Ok(()) if layer + 1 == self.cfg.n_layers => self.commit_step(),
            Ok(()) => {}
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn checked_layer(
        &mut self,
        layer: usize,
        q: &D::Tensor,
        k: &D::Tensor,
        v: &D::Tensor,
        positions: &[i32],
        scale: f32,
        out: &mut D::Tensor,
    ) -> Result<(), KitError> {
        self.check_shapes(layer, q, k, v, positions.len(), out)?;
        if layer == 0 {
            self.open(positions)?;
            self.next_layer = 0;
        } else {
            let plan = self.book.step_plan().ok_or_else(|| {
                CacheError::bad_shape(format!(
                    "layer {layer} called with no step open: every step starts at layer 0"
                ))
            })?;
            if plan.positions != positions {
                return Err(CacheError::bad_position(format!(
                    "layer {layer} positions differ from those layer 0 of this step planned"
                ))
                .into());
            }
        }
        if layer != self.next_layer {
            return Err(CacheError::bad_shape(format!(
                "layer {layer} out of order: the step expects layer {}",
                self.next_layer
            ))
            .into());
        }
        self.write_and_attend(layer, q, k, v, scale, None, out)?;
        self.next_layer += 1;
        Ok(())
    }

    /// Plans a step (validating first) and grows the pools to its read window.
    fn open(&mut self, positions: &[i32]) -> Result<(), KitError> {
        if let Some(g) = &mut self.sliding {
            g.map.rollback_step();
        }
        self.taps.clear();
        if let Some(a) = &mut self.anchors {
            a.rollback_step();
        }
        self.reads.clear();
        self.reads.resize(positions.len(), false);
        let plan = self.book.open_step(positions)?;
        let (read_len, kind) = (plan.read_len, plan.kind());
        self.last_plan = Some((kind, read_len));
        if let Err(e) = self.grow_pools(read_len) {
            self.book.cancel_step();
            return Err(e);
        }
        if let Err(e) = self.open_sliding() {
            self.cancel_open();
            return Err(e);
        }
        Ok(())
    }

    /// Undoes a step just opened, before anything was written: exactly.
    fn cancel_open(&mut self) {
        self.book.cancel_step();
        if let Some(g) = &mut self.sliding {
            g.map.rollback_step();
        }
    }

    /// Grows the full layers' pools (by the doubling policy, memory checked first) so they
    /// hold at least `read_len` cells, keeping every row.
    fn grow_pools(&mut self, read_len: usize) -> Result<(), KitError> {
        if read_len <= self.pool_cells {
            return Ok(());
        }
        let cells = self.cfg.grown_cells(self.pool_cells, read_len);
        let more = self
            .cfg
            .pools_bytes(cells)
            .map(|b| b - self.cfg.pools_bytes(self.pool_cells).unwrap_or(0));
        check_memory(&format!("growing the pools to {cells} cells"), more)?;
        let _span = tracing::debug_span!("pool_grow", from = self.pool_cells, to = cells).entered();
        for pool in self.k.iter_mut().chain(self.v.iter_mut()) {
            self.device.pool_grow(pool, cells, self.pool_cells)?;
        }
        if !self.cell_pos.is_empty() {
            self.cell_pos.resize(cells, -1);
        }
        if let Some(a) = &mut self.anchors {
            a.reserve(cells);
        }
        tracing::debug!(from = self.pool_cells, to = cells, "pools grown");
        self.pool_cells = cells;
        self.book.reserve(cells);
        Ok(())
    }

    /// Gives the open step its slots in the sliding group and grows that group's pools.
    fn open_sliding(&mut self) -> Result<(), KitError> {
        let Some(g) = &mut self.sliding else {
            return Ok(());
        };
        g.map.plan_step(&self.book)?;
        let need = g.map.high_water();
        if need > g.cells {
            let cells = self.cfg.grown_cells(g.cells, need);
            check_memory(
                &format!("growing the sliding-window pools to {cells} cells"),
                self.cfg.layer_pools_bytes(g.k.len(), cells - g.cells),
            )?;
            for pool in g.k.iter_mut().chain(g.v.iter_mut()) {
                self.device.pool_grow(pool, cells, g.cells)?;
            }
            tracing::debug!(from = g.cells, to = cells, "sliding-window pools grown");
            g.cells = cells;
        }
        Ok(())
    }

    /// Makes the open step permanent; the sliding group drops what left its window.
    fn commit_step(&mut self) {
        self.book.commit_step();
        if let Some(g) = &mut self.sliding {
            g.map.commit_step(&self.book);
        }
        if let Some(a) = &mut self.anchors {
            a.commit_step(&self.reads);
            if a.over_budget() {
                // A step only appends: nothing is refused, spares beyond the budget go.
                let _ = a.check_verb(&self.book);
            }
        }
    }

    /// The K/V history `seq` holds, in canonical storage form (see [`SeqRows`]): every row
    /// of the fully attending layers, the window's rows of the sliding ones, and the
    /// recurrent layers' state at its end.
    pub fn export_seq(&self, seq: i32) -> Result<SeqRows, KitError> {
        let state = self.state_of(seq)?;
        let history = self.book.history(seq)?;
        let positions: Vec<i32> = history.iter().map(|h| h.0).collect();
        let cells: Vec<u32> = history.iter().map(|h| h.1).collect();
        let (mut window_from, mut slots, mut sliding_layers) = (0, Vec::new(), Vec::new());
        if let (Some(g), Some(s)) = (&self.sliding, &self.cfg.sliding) {
            window_from = g.map.window_start(&positions);
            slots = history[window_from..]
                .iter()
                .map(|&(p, c)| {
                    g.map
                        .slot_of(c as usize, p)
                        .map(|s| s as u32)
                        .ok_or_else(|| {
                            CacheError::out_of_window(format!(
                            "sequence {seq}'s sliding-window layers no longer hold position {p}"
                        ))
                        })
                })
                .collect::<Result<_, _>>()?;
            sliding_layers = s.layers.iter().map(|l| l as u32).collect();
        }
        let read = |side: usize| -> Result<RVec<RVec<u8>>, KitError> {
            (0..self.cfg.n_layers)
                .map(|l| {
                    let (pool, at) = match self.place[l] {
                        Place::Full(i) => (&[&self.k, &self.v][side][i], &cells),
                        Place::Sliding(i) => {
                            let g = self.sliding.as_ref().expect("sliding layers have a group");
                            (&[&g.k, &g.v][side][i], &slots)
                        }
                        Place::Recurrent => return Ok(RVec::new()),
                    };
                    self.device.read_rows(pool, at).map(RVec::from)
                })
                .collect()
        };
        Ok(SeqRows {
            kv_dtype: self.cfg.kv_dtype.to_string().into(),
            n_layers: self.cfg.n_layers as u32,
            n_kv_heads: self.cfg.n_kv_heads as u32,
            head_dim: self.cfg.head_dim as u32,
            positions: positions.into(),
            k: read(0)?,
            v: read(1)?,
            sliding_layers: sliding_layers.into(),
            window_from: window_from as u32,
            recurrent_layers: self.recurrent_layers().into(),
            state,
        })
    }

    /// The layers a [`SeqRows`] carries as state instead of rows (the recurrent layers),
    /// ascending.
    fn recurrent_layers(&self) -> Vec<u32> {
        (0..self.cfg.n_layers)
            .filter(|&l| self.is_recurrent(l))
            .map(|l| l as u32)
            .collect()
    }

    fn is_recurrent(&self, layer: usize) -> bool {
        matches!(self.place[layer], Place::Recurrent)
    }

    /// The recurrent layers' state at the end of `seq` (empty without them or for an empty
    /// sequence), as [`SeqRows::state`] lays it out: the anchor at its last cell.
    fn state_of(&self, seq: i32) -> Result<RVec<u8>, KitError> {
        let history = self.book.history(seq)?;
        let (Some(&(p, cell)), Some(a)) = (history.last(), &self.anchors) else {
            return Ok(RVec::new());
        };
        let state = a.state_at(cell as usize).ok_or_else(|| {
            CacheError::out_of_window(format!(
                "sequence {seq}'s recurrent state after position {p} is not kept"
            ))
        })?;
        Ok(state.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    /// Appends `rows` to the history of `seq`, in steps of at most [`IMPORT_CHUNK`] rows:
    /// every position `seq` holds must be below the first row's (a contiguous cache must
    /// end right before it; a tree cache must be empty), and the rows must cover this cache's
    /// window after the last of them. Validates first; all or nothing.
    pub fn import_seq(&mut self, seq: i32, rows: &SeqRows) -> Result<(), KitError> {
        self.rollback();
        self.check_rows(seq, rows)?;
        let Some(&first) = rows.positions.first() else {
            return Ok(());
        };
        let held_len = self.book.high_water();
        let n = rows.positions.len();
        // Room for every row at once (at most the high-water mark plus the rows), instead of
        // a doubling, and a copy of what the pools hold, per chunk.
        self.grow_pools((held_len + n).min(self.cfg.capacity))?;
        let mut chunk_rows = Vec::new();
        let mut result = Ok(());
        for start in (0..n).step_by(IMPORT_CHUNK) {
            let end = (start + IMPORT_CHUNK).min(n);
            result = self.import_chunk(seq, rows, start..end, &mut chunk_rows);
            if result.is_err() {
                break;
            }
        }
        if result.is_ok() {
            result = self.restore_state(seq, first, rows);
        }
        if result.is_err() {
            // Undo the chunks already written: everything from the first row on.
            match self.book.kind() {
                CacheKind::Seq => self.book.seq_rm(seq, PosRange::new(Some(first), None))?,
                CacheKind::Contiguous => self.book.rewind(held_len)?,
                CacheKind::Tree => self.book.clear(),
            }
            if let Some(g) = &mut self.sliding {
                g.map.check_verb(&self.book, None)?;
            }
        }
        result
    }

    /// Writes rows `range` of `rows` as one step. A sliding layer's rows from before the
    /// window it was saved with are not written: the step's commit drops their slots.
    fn import_chunk(
        &mut self,
        seq: i32,
        rows: &SeqRows,
        range: std::ops::Range<usize>,
        buf: &mut Vec<u8>,
    ) -> Result<(), KitError> {
        let t = range.len();
        let row = self.cfg.kv_dtype.row_bytes(self.cfg.head_dim);
        let heads = self.cfg.n_kv_heads;
        if self.book.kind() == CacheKind::Seq {
            self.book.begin_step(&vec![seq; t])?;
        }
        self.open(&rows.positions[range.clone()])?;
        let plan = self.book.step_plan().expect("a step was just opened");
        let cells: Vec<u32> = match plan.write_start {
            Some(s) => (s as u32..(s + t) as u32).collect(),
            None => plan.write_cells.clone(),
        };
        let mut failed = None;
        'layers: for l in 0..self.cfg.n_layers {
            let held = rows.layer_rows(l);
            let from = range.start.max(held.start).min(range.end);
            let (a, b) = (from - held.start, range.end - held.start);
            let (pools, at) = match self.place[l] {
                Place::Full(i) => ([&mut self.k[i], &mut self.v[i]], &cells[..]),
                Place::Sliding(i) => {
                    let g = self.sliding.as_mut().expect("sliding layers have a group");
                    let (k, v) = (&mut g.k[i], &mut g.v[i]);
                    ([k, v], g.map.write_slots())
                }
                Place::Recurrent => continue,
            };
            for (pool, src) in pools.into_iter().zip([&rows.k[l], &rows.v[l]]) {
                buf.clear();
                for h in 0..heads {
                    buf.extend_from_slice(
                        &src[(h * held.len() + a) * row..(h * held.len() + b) * row],
                    );
                }
                failed = self
                    .device
                    .write_rows(pool, &at[from - range.start..], buf)
                    .err();
                if failed.is_some() {
                    break 'layers;
                }
            }
        }
        if let Some(e) = failed {
            self.rollback();
            return Err(e);
        }
        self.commit_step();
        Ok(())
    }
    /// Checks that `rows` fit this cache and can follow what `seq` holds.
    fn check_rows(&self, seq: i32, rows: &SeqRows) -> Result<(), KitError> {
        let cfg = &self.cfg;
        if rows.kv_dtype.as_str() != cfg.kv_dtype.to_string() {
            return Err(CacheError::bad_config(format!(
                "the rows are stored as {}, this cache stores {}",
                rows.kv_dtype, cfg.kv_dtype
            ))
            .into());
        }
        let dims = (
            rows.n_layers as usize,
            rows.n_kv_heads as usize,
            rows.head_dim as usize,
        );
        if dims != (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim) {
            return Err(CacheError::bad_shape(format!(
                "the rows have {dims:?} (layers, KV heads, head_dim), this cache {:?}",
                (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
            ))
            .into());
        }
        let n = rows.positions.len();
        let sliding = &rows.sliding_layers;
        if rows.window_from as usize > n
            || sliding.windows(2).any(|w| w[0] >= w[1])
            || sliding.last().is_some_and(|&l| l as usize >= cfg.n_layers)
        {
            return Err(CacheError::bad_shape(format!(
                "sliding layers {sliding:?} from row {} of {n}: layers must ascend below {} and the row be at most {n}",
                rows.window_from, cfg.n_layers
            ))
            .into());
        }
        let row = cfg.kv_dtype.row_bytes(cfg.head_dim);
        let sized = |v: &RVec<RVec<u8>>| {
            v.len() == cfg.n_layers
                && v.iter()
                    .enumerate()
                    .all(|(l, b)| match self.is_recurrent(l) {
                        true => b.is_empty(),
                        false => b.len() == cfg.n_kv_heads * rows.layer_rows(l).len() * row,
                    })
        };
        self.check_state(rows)?;
        if !sized(&rows.k) || !sized(&rows.v) {
            return Err(CacheError::bad_shape(format!(
                "every layer's K and V must hold {} bytes per row it holds ({n} rows; sliding layers from row {})",
                cfg.n_kv_heads * row,
                rows.window_from
            ))
            .into());
        }
        if rows.positions.windows(2).any(|w| w[0] > w[1]) {
            return Err(CacheError::bad_position("row positions must ascend").into());
        }
        self.check_window(rows)?;
        let held = self.book.history(seq)?;
        if let (Some(&(last, _)), Some(&first)) = (held.last(), rows.positions.first()) {
            let appends = match self.book.kind() {
                CacheKind::Seq => last < first,
                CacheKind::Contiguous => last + 1 == first,
                CacheKind::Tree => false,
            };
            if !appends {
                return Err(CacheError::bad_position(format!(
                    "sequence {seq} already holds a history up to position {last}: rows from position {first} cannot follow it"
                ))
                .into());
            }
        }
        // A recurrent state follows every position from the sequence's start.
        let next = held.last().map_or(0, |h| h.0 + 1);
        if self.anchors.is_some() && rows.positions.iter().zip(next..).any(|(&p, q)| p != q) {
            return Err(CacheError::bad_position(format!(
                "a cache with recurrent layers imports consecutive positions from {next} on \
                 (sequence {seq}'s next position)"
            ))
            .into());
        }
        if self.book.kind() == CacheKind::Tree && self.book.high_water() > 0 {
            return Err(CacheError::bad_position("a tree cache imports only when empty").into());
        }
        if !self.book.can_extend(n) {
            return Err(CacheError::capacity(format!(
                "{n} rows do not fit: the cache has room for {} (capacity {})",
                self.book.capacity() - self.book.live_cells(),
                self.book.capacity()
            ))
            .into());
        }
        Ok(())
    }

    /// Restores the imported state (checked by [`KitCache::check_state`]) at the end of
    /// `seq`, whose rows from position `first` on were just imported, as the anchor of its
    /// last cell; records the positions of the imported cells.
    fn restore_state(&mut self, seq: i32, first: i32, rows: &SeqRows) -> Result<(), KitError> {
        let Some(a) = &mut self.anchors else {
            return Ok(());
        };
        let history = self.book.history(seq)?;
        let Some(&(_, last_cell)) = history.last() else {
            return Ok(());
        };
        // Where the next step finds its previous positions (as `make_taps` records them).
        for &(p, cell) in history.iter().filter(|h| h.0 >= first) {
            self.cell_pos[cell as usize] = p;
        }
        let state: Vec<f32> = rows
            .state
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if !a.set_state(last_cell as usize, &state) {
            return Err(CacheError::bad_shape("a recurrent state of another size").into());
        }
        Ok(())
    }

    /// `rows` must name this cache's recurrent layers as its own and carry their state at
    /// its end (`out_of_window` when it does not: a slice ending early, whose prompt is
    /// prefilled instead), of this cache's size.
    fn check_state(&self, rows: &SeqRows) -> Result<(), KitError> {
        let want = self.recurrent_layers();
        if rows.recurrent_layers.as_slice() != want.as_slice() {
            return Err(CacheError::bad_shape(format!(
                "the rows' recurrent layers are {:?}, this cache's {want:?}",
                rows.recurrent_layers
            ))
            .into());
        }
        let (Some(a), false) = (&self.anchors, rows.positions.is_empty()) else {
            return Ok(());
        };
        if rows.state.is_empty() {
            return Err(CacheError::out_of_window(
                "the rows carry no recurrent state at their end (a slice that ends early)",
            )
            .into());
        }
        if rows.state.len() != a.state_bytes() {
            return Err(CacheError::bad_shape(format!(
                "a recurrent state of {} bytes, this cache's is {}",
                rows.state.len(),
                a.state_bytes()
            ))
            .into());
        }
        Ok(())
    }

    /// Every layer must hold the rows this cache keeps after the last of `rows`: all of
    /// them in a fully attending layer, the window's in a sliding one.
    fn check_window(&self, rows: &SeqRows) -> Result<(), KitError> {
        if rows.sliding_layers.is_empty() {
            return Ok(());
        }
        let need = match &self.sliding {
            Some(g) => g.map.window_start(&rows.positions),
            None => 0,
        };
        let from = rows.window_from as usize;
        for &l in rows.sliding_layers.iter() {
            let l = l as usize;
            let keep = if self.cfg.slides(l) { need } else { 0 };
            if from > keep {
                let at = |i: usize| rows.positions.get(i).copied().unwrap_or(0);
                return Err(CacheError::out_of_window(format!(
                    "layer {l} of the rows holds positions from {} on; this cache needs them from {} on (it {}): import the sequence's whole saved history",
                    at(from),
                    at(keep),
                    match &self.sliding {
                        Some(g) if self.cfg.slides(l) => format!("keeps a window of {} there", g.map.window()),
                        _ => "attends fully there".to_string(),
                    }
                ))
                .into());
            }
        }
        Ok(())
    }

    fn rollback(&mut self) {
        if self.book.step_is_open() {
            tracing::debug!("step rolled back");
            self.book.rollback_step();
        }
        if let Some(g) = &mut self.sliding {
            g.map.rollback_step();
        }
        if let Some(a) = &mut self.anchors {
            a.rollback_step();
        }
    }

    /// Writes `k`/`v` (`[Hkv, T, D]`) for `layer` per the open step's plan, then attends `q`
    /// (`[Hq, T, D]`) into `out`, with `sinks` where given.
    #[allow(clippy::too_many_arguments)]
    fn write_and_attend(
        &mut self,
        layer: usize,
        q: &D::Tensor,
        k: &D::Tensor,
        v: &D::Tensor,
        scale: f32,
        sinks: Option<&D::Tensor>,
        out: &mut D::Tensor,
    ) -> Result<(), KitError> {
        let plan = self
            .book
            .step_plan()
            .expect("write_and_attend runs inside an open step");
        let (device, scratch, arithmetic) = (&self.device, &mut self.scratch, self.arithmetic);
        let attend = |kp: &D::Pool, vp: &D::Pool, l, mask, out: &mut D::Tensor, scratch| match sinks
        {
            None => device.attend(arithmetic, q, kp, vp, l, mask, scale, out, scratch),
            Some(s) => device.attend_sinks(arithmetic, q, kp, vp, l, mask, scale, s, out, scratch),
        };
        let i = match self.place[layer] {
            Place::Full(i) => i,
            Place::Recurrent => return Err(recurrent_layer_attended(layer).into()),
            Place::Sliding(i) => {
                let g = self
                    .sliding
                    .as_mut()
                    .expect("sliding layers have a sliding group");
                let (kp, vp) = (&mut g.k[i], &mut g.v[i]);
                device.scatter_kv_rows(kp, vp, g.map.write_slots(), k, v)?;
                let mask = AttendMask::Explicit(g.map.mask());
                let l = g.map.read_len();
                return attend(kp, vp, l, mask, out, scratch);
            }
        };
        let (kp, vp) = (&mut self.k[i], &mut self.v[i]);
        match plan.write_start {
            Some(start) => device.write_kv_run(kp, vp, start, k, v)?,
            None => device.scatter_kv_rows(kp, vp, &plan.write_cells, k, v)?,
        }
        let mask = match plan.mask {
            MaskKind::None => AttendMask::None,
            MaskKind::Causal => AttendMask::Causal,
            MaskKind::Explicit => AttendMask::Explicit(&plan.mask_bits),
        };
        attend(kp, vp, plan.read_len, mask, out, scratch)
    }

    /// Makes the open step's taps (`[T, 2]`) and opens the anchors' step: for each token, the
    /// cell holding its sequence's previous position among those its query sees (the plan's
    /// visibility; [`NO_CELL`] at the sequence's start), then its own. A position held twice
    /// (as attention allows) reads the cell right before the token's own if that is one of
    /// them, else the lowest. `bad_position` for a token whose sequence holds earlier
    /// positions but not the one before it: its state would start from zeros and leave a
    /// hole no verb could keep (cells the refused step named keep its positions in
    /// `cell_pos`: they are free, and a step writing them sets them again).
    fn make_taps(&mut self) -> Result<(), CacheError> {
        let plan = self
            .book
            .step_plan()
            .expect("taps are made inside an open step");
        for (i, &p) in plan.positions.iter().enumerate() {
            self.cell_pos[plan.cell_of(i)] = p;
        }
        let held = |i: usize, c: usize, p: i32| plan.visible(i, c) && self.cell_pos[c] == p;
        let mut taps = std::mem::take(&mut self.taps);
        taps.clear();
        for (i, &p) in plan.positions.iter().enumerate() {
            let own = plan.cell_of(i);
            // Consecutive positions usually sit in consecutive cells; else search the cells
            // the query sees.
            let tap = own
                .checked_sub(1)
                .filter(|&c| held(i, c, p - 1))
                .or_else(|| (0..plan.read_len).find(|&c| held(i, c, p - 1)))
                .map_or(NO_CELL, |c| c as u32);
            let earlier = |c: usize| plan.visible(i, c) && self.cell_pos[c] < p;
            if tap == NO_CELL && (0..plan.read_len).any(earlier) {
                return Err(CacheError::bad_position(format!(
                    "position {p} skips position {}: its sequence holds earlier positions but \
                     not that one, and a recurrent state cannot skip positions",
                    p - 1
                )));
            }
            taps.extend([tap, own as u32]);
        }
        if let Some(a) = &mut self.anchors {
            // A tree cache's prefix steps are plain ones; its frontiers are masked.
            let tree = self.book.kind() == CacheKind::Tree && plan.mask == MaskKind::Explicit;
            a.open_step(plan, &taps, tree);
        }
        self.taps = taps;
        Ok(())
    }

    fn check_shapes(
        &self,
        layer: usize,
        q: &D::Tensor,
        k: &D::Tensor,
        v: &D::Tensor,
        t: usize,
        out: &D::Tensor,
    ) -> Result<(), CacheError> {
        let (hkv, d) = (self.cfg.n_kv_heads, self.cfg.head_dim);
        if layer >= self.cfg.n_layers {
            return Err(CacheError::bad_shape(format!(
                "layer {layer} is outside 0..{}",
                self.cfg.n_layers
            )));
        }
        if let Place::Recurrent = self.place[layer] {
            return Err(recurrent_layer_attended(layer));
        }
        let dev = &self.device;
        let (qd, kd, vd, od) = (dev.dims(q), dev.dims(k), dev.dims(v), dev.dims(out));
        let kv_ok = kd == [hkv, t, d] && vd == kd;
        let q_ok = qd.len() == 3 && qd[0] > 0 && qd[0] % hkv == 0 && qd[1] == t && qd[2] == d;
        if !kv_ok || !q_ok || od != qd {
            return Err(CacheError::bad_shape(format!(
                "expected q [Hq, {t}, {d}] with Hq a multiple of {hkv}, k and v [{hkv}, {t}, {d}], out like q; got q {qd:?}, k {kd:?}, v {vd:?}, out {od:?}"
            )));
        }
        Ok(())
    }
}

impl<D: Device> CacheVerbs for KitCache<D> {
    fn bookkeeping(&self) -> &Bookkeeping {
        &self.book
    }
    fn bookkeeping_mut(&mut self) -> &mut Bookkeeping {
        &mut self.book
    }
    fn move_rows(&mut self, base: usize, rows: &[u32]) {
        for pool in self.k.iter_mut().chain(self.v.iter_mut()) {
            self.device.move_rows(pool, base, rows);
        }
        if !self.cell_pos.is_empty() {
            for (i, &r) in rows.iter().enumerate() {
                self.cell_pos[base + i] = self.cell_pos[r as usize];
            }
        }
        if let Some(g) = &mut self.sliding {
            g.map.move_cells(base, rows);
        }
        if let Some(a) = &mut self.anchors {
            a.move_rows(base, rows);
        }
    }
    fn checks_verbs(&self) -> bool {
        self.sliding.is_some() || self.anchors.is_some()
    }
    /// With recurrent layers, attaches the cached prefix only up to its longest part that
    /// ends at an anchor (a prefix whose end no anchor holds cannot be resumed: the rest is
    /// prefilled again); all or nothing as any verb.
    fn prefix_attach(&mut self, seq: i32, tokens: &[u32]) -> kvplug_core::CacheResult<usize> {
        let Some(anchors) = self.anchors.as_ref() else {
            return self.checked(|b| b.prefix_attach(seq, tokens));
        };
        let before = self.book.clone();
        let attach = |book: &mut Bookkeeping| -> kvplug_core::CacheResult<usize> {
            let n = book.prefix_attach(seq, tokens)?;
            // The cell of each attached position.
            let mut cell_of = vec![None; n];
            for &(p, cell) in &book.history(seq)? {
                if let Some(c) = cell_of.get_mut(p as usize) {
                    *c = Some(cell as usize);
                }
            }
            let resumable =
                |m: usize| m == 0 || cell_of[m - 1].is_some_and(|c| anchors.anchored(c));
            let keep = (0..=n).rev().find(|&m| resumable(m)).unwrap_or(0);
            if keep < n {
                book.seq_rm(seq, kvplug_core::PosRange::new(Some(keep as i32), None))?;
            }
            Ok(keep)
        };
        let out = attach(&mut self.book);
        let out = out.and_then(|n| self.after_verb(Some(&before)).map(|()| n));
        match (&out, &mut self.anchors) {
            (Err(_), _) => self.book = before,
            // The state it resumes from counts as recently published: a prefix many
            // requests share (a system prompt) keeps its pin among the newest.
            (Ok(n @ 1..), Some(a)) => {
                let end = self.book.history(seq).ok().and_then(|h| {
                    h.iter()
                        .find(|&&(p, _)| p as usize + 1 == *n)
                        .map(|&(_, c)| c)
                });
                if let Some(cell) = end {
                    a.touch(cell as usize);
                }
            }
            _ => {}
        }
        out
    }
    fn after_publish(&mut self, seq: i32, tokens: &[u32]) {
        if let Some(g) = &mut self.sliding {
            g.map.pin_end(&self.book, seq, tokens.len());
        }
        if let Some(a) = &mut self.anchors {
            a.pin_end(&self.book, seq, tokens);
        }
    }
    fn after_verb(&mut self, before: Option<&Bookkeeping>) -> kvplug_core::CacheResult<()> {
        if let Some(a) = &mut self.anchors {
            // A verb abandons an open step: so do its states.
            a.rollback_step();
            a.check_verb(&self.book)?;
        }
        if let Some(g) = &mut self.sliding {
            // A verb abandons an open step: so do the slots.
            g.map.rollback_step();
            g.map.check_verb(&self.book, before)?;
        }
        Ok(())
    }
}

/// The refusal of attention on a recurrent (convolution or delta-rule) layer.
fn recurrent_layer_attended(layer: usize) -> CacheError {
    CacheError::bad_shape(format!(
        "layer {layer} is a recurrent layer: it holds no K/V (the model's forward runs it)"
    ))
}

/// A step in progress on a [`KitCache`] (see [`KitCache::step`]). Dropped uncommitted, it
/// rolls back.
pub struct Step<'c, D: Device> {
    cache: &'c mut KitCache<D>,
    next_layer: usize,
    committed: bool,
}

impl<D: Device> Step<'_, D> {
    /// The step's plan.
    pub fn plan(&self) -> &kvplug_core::StepPlan {
        self.cache
            .book
            .step_plan()
            .expect("a Step holds an open step")
    }

    /// Writes `k`/`v` (`[Hkv, T, D]`) of the next layer, `layer`, and attends `q` (`[Hq, T, D]`)
    /// into `out`. Layers go in order `0..n_layers`, once each.
    pub fn attend(
        &mut self,
        layer: usize,
        q: &D::Tensor,
        k: &D::Tensor,
        v: &D::Tensor,
        scale: f32,
        out: &mut D::Tensor,
    ) -> Result<(), KitError> {
        self.attend_sinks(layer, q, k, v, scale, None, out)
    }

    /// [`Step::attend`] with a sink per query head where `sinks` is given
    /// ([`Device::attend_sinks`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attend_sinks(
        &mut self,
        layer: usize,
        q: &D::Tensor,
        k: &D::Tensor,
        v: &D::Tensor,
        scale: f32,
        sinks: Option<&D::Tensor>,
        out: &mut D::Tensor,
    ) -> Result<(), KitError> {
        self.expect_layer(layer)?;
        let t = self.plan().n_tok;
        self.cache.check_shapes(layer, q, k, v, t, out)?;
        let device = &self.cache.device;
        if let Some(s) = sinks.filter(|s| device.dims(s) != [device.dims(q)[0]]) {
            return Err(CacheError::bad_shape(format!(
                "sinks of shape {:?} for {} query heads",
                device.dims(s),
                device.dims(q)[0]
            ))
            .into());
        }
        self.cache
            .write_and_attend(layer, q, k, v, scale, sinks, out)?;
        self.next_layer += 1;
        Ok(())
    }

    /// Refuses `layer` unless it is the one the step expects next.
    fn expect_layer(&self, layer: usize) -> Result<(), CacheError> {
        if layer != self.next_layer {
            return Err(CacheError::bad_shape(format!(
                "layer {layer} out of order: the step expects layer {}",
                self.next_layer
            )));
        }
        Ok(())
    }

    /// A recurrent layer run on the host: downloads `inputs` (at most three) as f32, runs
    /// `run` over them and the anchors with an output of `width` values per token, uploads it
    /// into `out` (`[T, width]`) and moves on to the next layer.
    fn on_host(
        &mut self,
        inputs: &[&D::Tensor],
        width: usize,
        out: &mut D::Tensor,
        run: impl FnOnce(&mut Anchors, [&[f32]; 3], &mut [f32]) -> CacheResult<()>,
    ) -> Result<(), KitError> {
        let t = self.plan().n_tok;
        let dev = self.cache.device.clone();
        let c = &mut *self.cache;
        let h = &mut c.host;
        for (x, v) in inputs.iter().zip(h.inputs.iter_mut()) {
            dev.download_into(x, TensorDtype::F32, &mut h.tensor)?;
            if !h.tensor.read_f32_into(v) {
                return Err(KitError::Device(
                    "a recurrent layer's f32 download was not f32".into(),
                ));
            }
        }
        h.y.resize(t * width, 0.0);
        let anchors = c
            .anchors
            .as_mut()
            .expect("a cache with recurrent layers has anchors");
        let [a, b, cc] = &h.inputs;
        run(anchors, [a, b, cc], &mut h.y)?;
        h.tensor
            .encode_f32_into(&[t, width], &h.y, TensorDtype::F32);
        dev.upload_into(&h.tensor, out)?;
        self.next_layer += 1;
        Ok(())
    }

    /// Runs the next layer, `layer`, a short-convolution layer (see [`Anchors::run_conv`]):
    /// its input rows `x` (`[T, channels]`) through the causal depthwise convolution
    /// `kernel` (`[channels, width]`, host f32) from each sequence's state, into `out`
    /// (`[T, channels]`). It runs on the host over an f32 download.
    pub fn conv(
        &mut self,
        layer: usize,
        x: &D::Tensor,
        kernel: &[f32],
        out: &mut D::Tensor,
    ) -> Result<(), KitError> {
        self.expect_layer(layer)?;
        let Some(c) = self.cache.cfg.conv.filter(|c| c.layers.contains(layer)) else {
            return Err(CacheError::bad_shape(format!(
                "layer {layer} is not a convolution layer of this cache"
            ))
            .into());
        };
        let t = self.plan().n_tok;
        let dev = self.cache.device.clone();
        let xd = dev.dims(x);
        if xd != [t, c.channels] || kernel.len() != c.channels * c.width {
            return Err(CacheError::bad_shape(format!(
                "expected x [{t}, {ch}] and a kernel of {ch}x{w}; got x {xd:?}, {} values",
                kernel.len(),
                ch = c.channels,
                w = c.width
            ))
            .into());
        }
        self.on_host(&[x], c.channels, out, |anchors, [x, ..], y| {
            anchors.run_conv(layer, x, kernel, y)
        })
    }

    /// Runs the next layer, `layer`, a Mamba2 layer (see [`Anchors::run_ssm`]): the x, B
    /// and C part of its input projection `x` (`[T, channels]`) through the causal depthwise
    /// convolution `kernel` (`[channels, width]`) plus `bias` (`[channels]`, host f32) and
    /// SiLU, from each sequence's state, then the selective scan with the step projection
    /// `dt` (`[T, heads]`, bias added), the decay rates `a` and skip weights `d` (`[heads]`,
    /// host), into `out` (`[T, heads · head_dim]`). The scan runs on the host over f32
    /// downloads.
    #[allow(clippy::too_many_arguments)]
    pub fn ssm(
        &mut self,
        layer: usize,
        x: &D::Tensor,
        kernel: &[f32],
        bias: &[f32],
        dt: &D::Tensor,
        a: &[f32],
        d: &[f32],
        out: &mut D::Tensor,
    ) -> Result<(), KitError> {
        self.expect_layer(layer)?;
        let Some(m) = self.cache.cfg.ssm.filter(|m| m.layers.contains(layer)) else {
            return Err(CacheError::bad_shape(format!(
                "layer {layer} is not a Mamba2 layer of this cache"
            ))
            .into());
        };
        let t = self.plan().n_tok;
        let dev = self.cache.device.clone();
        let (xd, dd) = (dev.dims(x), dev.dims(dt));
        let ch = m.conv_channels();
        if xd != [t, ch]
            || dd != [t, m.heads]
            || a.len() != m.heads
            || d.len() != m.heads
            || bias.len() != ch
            || kernel.len() != ch * m.width
        {
            return Err(CacheError::bad_shape(format!(
                "expected x [{t}, {ch}], a kernel of {ch}x{w} and {ch} biases, dt [{t}, {h}] \
                 and {h} decay rates and skip weights; got {xd:?}, {} and {} values, {dd:?}, \
                 {} and {}",
                kernel.len(),
                bias.len(),
                a.len(),
                d.len(),
                w = m.width,
                h = m.heads
            ))
            .into());
        }
        let width = m.heads * m.head_dim;
        self.on_host(&[x, dt], width, out, |anchors, [x, dt, _], y| {
            anchors.run_ssm(layer, x, kernel, bias, dt, a, d, y)
        })
    }

    /// Runs the next layer, `layer`, a gated delta-rule layer (see
    /// [`Anchors::run_layer`]): its q, k, v projection `x` (`[T, channels]`) through the
    /// causal depthwise convolution `kernel` (`[channels, width]`, host f32) from each
    /// sequence's state, the decay projection `alpha` (bias added) and step-size projection
    /// `beta` (`[T, Hv]`), the heads' decay rates `a` and the L2 norm's `eps`, into `out`
    /// (`[T, Hv·dv]`). The rule runs on the host over f32 downloads.
    #[allow(clippy::too_many_arguments)]
    pub fn delta(
        &mut self,
        layer: usize,
        x: &D::Tensor,
        kernel: &[f32],
        alpha: &D::Tensor,
        beta: &D::Tensor,
        a: &[f32],
        eps: f32,
        out: &mut D::Tensor,
    ) -> Result<(), KitError> {
        self.expect_layer(layer)?;
        let Some(d) = self.cache.cfg.delta.filter(|d| d.layers.contains(layer)) else {
            return Err(CacheError::bad_shape(format!(
                "layer {layer} is not a delta-rule layer of this cache"
            ))
            .into());
        };
        let t = self.plan().n_tok;
        let dev = self.cache.device.clone();
        let (xd, ad, bd) = (dev.dims(x), dev.dims(alpha), dev.dims(beta));
        let ch = d.conv_channels();
        if xd != [t, ch]
            || ad != [t, d.value_heads]
            || bd != ad
            || a.len() != d.value_heads
            || kernel.len() != ch * d.width
        {
            return Err(CacheError::bad_shape(format!(
                "expected x [{t}, {ch}], a kernel of {ch}x{w}, alpha and beta [{t}, {hv}] and \
                 {hv} decay rates; got {xd:?}, {} values, {ad:?}, {bd:?}, {}",
                kernel.len(),
                a.len(),
                w = d.width,
                hv = d.value_heads
            ))
            .into());
        }
        let width = d.value_heads * d.head_dim;
        self.on_host(
            &[x, alpha, beta],
            width,
            out,
            |anchors, [x, alpha, beta], y| {
                anchors.run_layer(layer, x, kernel, alpha, beta, a, eps, y)
            },
        )
    }

    /// Says which of the step's tokens have their outputs read (the model's logit rows),
    /// before any layer runs: a recurrent cache keeps the end of a sequence's run as a
    /// prompt end when only its last token is read (see `Anchors::commit_step`), and the
    /// state of each token of a run whose outputs are all read, a speculative chain (see
    /// `Anchors::keep_read`). None are, unless said.
    pub fn read_rows(&mut self, rows: &[usize]) {
        for &r in rows {
            if let Some(x) = self.cache.reads.get_mut(r) {
                *x = true;
            }
        }
        if let (Some(a), 0) = (&mut self.cache.anchors, self.next_layer) {
            a.keep_read(&self.cache.reads);
        }
    }

    /// Makes the step permanent; every layer must have been written.
    pub fn commit(mut self) -> Result<(), KitError> {
        let n = self.cache.cfg.n_layers;
        if self.next_layer != n {
            return Err(CacheError::bad_shape(format!(
                "commit after {} of {n} layers: every layer must write its rows",
                self.next_layer
            ))
            .into());
        }
        self.cache.commit_step();
        self.committed = true;
        Ok(())
    }
}

impl<D: Device> Drop for Step<'_, D> {
    fn drop(&mut self) {
        if !self.committed {
            self.cache.rollback();
        }
    }
}

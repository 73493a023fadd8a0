//! The model graph's operations on wgpu: WGSL kernels over f32 storage buffers, so
//! activations stay on the device between layers (only logits are read back).

use kvplug_backend_kit::model::blocks::{BlockFormat, BLOCK_FORMATS};
use kvplug_backend_kit::model::config::Activation;
use kvplug_backend_kit::model::ops::check_hadamard;
use kvplug_backend_kit::model::{
    compose_norm_qkv_heads, ModelDevice, Projection, QkvHeads, StoredDtype, StoredTensor,
};
use kvplug_backend_kit::{Device, KitError};
use kvplug_core::RopePairs;
use wgpu::BufferUsages;

use crate::context::{Bind, Tuning};
use crate::{WgpuDevice, WgpuTensor};

/// A `[rows, cols]` weight in storage buffers, in its stored dtype (the shaders widen each
/// element, or dequantize each block, as they read it). A weight larger than one storage
/// binding may hold (`max_storage_buffer_binding_size`: 128 MiB on lavapipe) is split into
/// parts of whole rows, each its own buffer.
pub struct WgpuWeight {
    parts: Vec<WeightPart>,
    /// The shaders' dtype flag (see `weight_at` in weights.wgsl).
    dtype: u32,
    rows: usize,
    cols: usize,
}

impl WgpuWeight {
    /// How many storage bindings (parts of whole rows) hold it.
    pub fn bindings(&self) -> usize {
        self.parts.len()
    }
}

/// Rows `[row0, row0 + rows)` of a weight.
struct WeightPart {
    buf: crate::context::OwnedBuffer,
    row0: usize,
    rows: usize,
}

/// Dtype flags the shaders read (`dtype_flag`'s values).
pub(crate) const WEIGHT_DTYPES: usize = 3 + BLOCK_FORMATS.len();

/// The shaders' flag for a stored dtype (`weight_at` in weights.wgsl), or an error for one the
/// shaders do not read (a dtype a later kit added).
fn dtype_flag(d: StoredDtype) -> Result<u32, KitError> {
    Ok(match d {
        StoredDtype::F32 => 0,
        StoredDtype::F16 => 1,
        StoredDtype::BF16 => 2,
        StoredDtype::Block(f) if BLOCK_FORMATS.contains(&f) => {
            3 + BLOCK_FORMATS
                .iter()
                .position(|&g| g == f)
                .expect("checked above") as u32
        }
        other => {
            return Err(KitError::Device(format!(
                "the wgpu shaders do not read {} weights",
                other.name()
            )))
        }
    })
}

/// Where the shaders' layout of a block format differs from the file's: two zero bytes in
/// each block at this offset, so that its code words (and every field weights.wgsl reads
/// as a word) start on a word whatever the block's index: after the f16 scale of a Q4_0,
/// Q5_0 or Q8_0 block (18, 22 and 34 bytes to 20, 24 and 36), at the end of a Q6_K one (210
/// to 212). The other formats' blocks are whole words already.
fn block_pad(d: StoredDtype) -> Option<(BlockFormat, usize)> {
    match d {
        StoredDtype::Block(f @ (BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0)) => {
            Some((f, 2))
        }
        StoredDtype::Block(f @ BlockFormat::Q6K) => Some((f, f.block_bytes())),
        _ => None,
    }
}

/// `bytes` (whole blocks of `f`) in the shaders' layout: two zero bytes at `at` in each.
fn pad_blocks(bytes: &[u8], f: BlockFormat, at: usize) -> Vec<u8> {
    let block = f.block_bytes();
    let mut out = Vec::with_capacity(bytes.len() / block * (block + 2));
    for b in bytes.chunks_exact(block) {
        out.extend_from_slice(&b[..at]);
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&b[at..]);
    }
    out
}

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct OpParams {
    n: [u32; 4],
    flag: u32,
    total: u32,
    /// Where the op's index words start, and its second array of them (set by [`WgpuDevice::op`]).
    idx: [u32; 2],
    eps: f32,
    pad: [u32; 3],
}

/// project.wgsl's uniform (see its header).
#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct ProjParams {
    ends: [u32; 3],
    cols: u32,
    row0: u32,
    n_out: u32,
    fmts: u32,
    mode: u32,
    total: u32,
    lanes: u32,
    hd: u32,
    eps: f32,
    idx: [u32; 2],
    starts: [u32; 2],
}

/// project.wgsl's `mode` bits.
const BIAS: u32 = 1;
const ACCUMULATE: u32 = 8;
const NORMED: u32 = 16;
const GATED: u32 = 32;
const HEADS: u32 = 64;
const HEADS_OUT: u32 = 128;
const ROPE: u32 = 256;
const INTERLEAVED: u32 = 512;
const STAGED: u32 = 1024;

/// How a linear reads its input (project.wgsl's `xin`).
#[derive(Clone, Copy)]
enum Input<'a> {
    /// As it is.
    Plain,
    /// `rms_norm(x)·w`, eps.
    Normed(&'a WgpuTensor, f32),
    /// `silu(x)·up`.
    Gated(&'a WgpuTensor),
    /// `x` heads-major (`[H, T, D]`), read as its merge `[T, H·D]`.
    Heads,
}

/// One projection of a dispatch: rows of a weight (a part of it, or all of it), its bias and
/// its output.
struct Way<'a> {
    w: &'a wgpu::Buffer,
    dtype: u32,
    rows: u32,
    bias: Option<&'a wgpu::Buffer>,
    out: &'a wgpu::Buffer,
}

/// A projection whose weight is in one binding, as a [`Way`].
fn way<'a>(p: &'a Projection<'_, WgpuDevice>) -> Way<'a> {
    Way {
        w: &p.w.parts[0].buf,
        dtype: p.w.dtype,
        rows: p.w.rows as u32,
        bias: p.bias.map(|b| &*b.buf),
        out: &p.out.buf,
    }
}

/// Where a dispatch's outputs go beyond `t·n + o`: a weight part's first row and its
/// weight's rows; or heads-major `[H, T, hd]`, projections 0 and 1 rotated first.
#[derive(Clone, Copy)]
enum Store<'a> {
    Rows {
        row0: u32,
        n_out: u32,
    },
    Heads {
        hd: u32,
        rope: Option<(&'a [i32], &'a [f32], RopePairs)>,
    },
}

/// Output rows and tokens per workgroup of `linear_main`, the tiled product (its `TILE`),
/// and the inner dimension's values a step of it (its `KSTEP`, also the unit in which
/// `linear_wide_main` splits it).
const TILE: u32 = 64;
const KSTEP: u32 = 32;
/// Output rows and tokens per workgroup of `linear_wide_main` (its `WIDE`).
const WIDE_TILE: u32 = 128;

/// The fewest steps of the inner dimension a split of a tiled product takes.
const SPLIT_STEPS: u32 = 8;

/// Parts the inner dimension (`cols` values) of a tiled product of `tiles` workgroups is
/// split into: doubled while the workgroups number fewer than `target`, each part keeps at
/// least [`SPLIT_STEPS`] steps and the parts number at most `most`; then as few as cover
/// the steps with parts of that many (none empty).
fn tile_splits(tiles: u32, cols: u32, target: u32, most: u32) -> u32 {
    let steps = cols.div_ceil(KSTEP);
    let mut splits = 1;
    while tiles * splits < target && steps / (2 * splits) >= SPLIT_STEPS && 2 * splits <= most {
        splits *= 2;
    }
    steps.div_ceil(steps.div_ceil(splits))
}

/// The most workgroups in one dimension of a dispatch (WebGPU's default limit).
const MAX_GROUPS: u32 = 65535;

/// Lanes per row of `rows_main` for `rows` rows of `cols` values in dtype flag `dtype`:
/// about `tuning.lane_steps` steps of a lane per row (each step a value of a dense dtype, a
/// span of a block format; the quotient rounded up to a power of two), and more, up to a
/// lane a step, while a token's rows have fewer than `tuning.threads` invocations; a power
/// of two from `tuning.min_lanes` to `tuning.max_lanes`, at most half of the workgroup's
/// invocations when rows are rotated (a pair shares a workgroup).
fn row_lanes(rows: usize, cols: usize, dtype: u32, rotated: bool, tuning: &Tuning) -> u32 {
    let (group, max_lanes) = (tuning.group, tuning.max_lanes.min(tuning.group));
    let steps = if dtype < 3 { cols } else { cols / 32 } as u32;
    let by_steps = (steps / tuning.lane_steps).next_power_of_two();
    let by_threads = (tuning.threads / rows.max(1) as u32)
        .checked_ilog2()
        .map_or(0, |l| (1 << l).min(steps.next_power_of_two()));
    let lanes = by_steps
        .max(by_threads)
        .clamp(tuning.min_lanes.min(max_lanes), max_lanes);
    if rotated {
        lanes.min(group / 2)
    } else {
        lanes
    }
}

/// Parts a row's top-k is split into at most (one workgroup each), and the fewest values a
/// part holds: a 152k vocabulary is 64 parts of 2374.
const TOP_K_PARTS: usize = 64;
const TOP_K_PART: usize = 1024;

/// Indices into [`crate::context::MODEL_ENTRIES`].
#[derive(Clone, Copy)]
enum Op {
    Gather = 0,
    RmsNorm = 1,
    RopeHeads = 2,
    Rope = 3,
    Heads = 4,
    Silu = 5,
    Add = 6,
    Embed = 7,
    Gelu = 8,
    Scale = 9,
    Hadamard = 10,
    TopK = 11,
    Adjust = 12,
}

/// The read-only operands of one op: buffers `a` and `b` (absent ones are bound to a dummy)
/// and up to two arrays of index words (read at `idx0` and `idx1`).
#[derive(Clone, Copy, Default)]
struct Inputs<'a> {
    a: Option<&'a wgpu::Buffer>,
    b: Option<&'a wgpu::Buffer>,
    words: &'a [&'a [u32]],
}

fn inputs<'a>(
    a: Option<&'a wgpu::Buffer>,
    b: Option<&'a wgpu::Buffer>,
    words: &'a [&'a [u32]],
) -> Inputs<'a> {
    Inputs { a, b, words }
}

/// Workgroups for `total` invocations in 64-wide groups, spread over x and y.
pub(crate) fn flat_groups(total: usize) -> [u32; 3] {
    let groups = (total as u32).div_ceil(64).max(1);
    let x = groups.min(65535);
    [x, groups.div_ceil(x), 1]
}

/// rope_main's flag for a pair layout.
fn rope_flag(pairs: RopePairs) -> u32 {
    match pairs {
        RopePairs::Halves => 0,
        RopePairs::Interleaved => 1,
    }
}

impl WgpuDevice {
    /// `out = in·Wᵀ (+ bias)`, or `out += …` when `accumulate`, `in` being `x` read as
    /// `input` says: one dispatch per part of the weight, the input made as it is read and
    /// the bias and the residual added where each output is stored.
    fn project(
        &self,
        x: &WgpuTensor,
        input: Input<'_>,
        w: &WgpuWeight,
        bias: Option<&WgpuTensor>,
        out: &WgpuTensor,
        accumulate: bool,
    ) {
        for part in &w.parts {
            let way = Way {
                w: &part.buf,
                dtype: w.dtype,
                rows: part.rows as u32,
                bias: bias.map(|b| &*b.buf),
                out: &out.buf,
            };
            let store = Store::Rows {
                row0: part.row0 as u32,
                n_out: w.rows as u32,
            };
            self.project_ways(x, input, w.cols, &[way], store, accumulate);
        }
    }

    /// Whether `projections` can run as one dispatch: each weight in one binding, as many
    /// as the adapter's bindings allow.
    fn together(&self, projections: &[&Projection<'_, Self>]) -> bool {
        projections.len() <= self.context().tuning.ways
            && projections.iter().all(|p| p.w.parts.len() == 1)
    }

    /// The projections `ways` of one input (`x` read as `input` says, `cols` wide) in one
    /// dispatch, stored as `store` says: `rows_main` for few tokens, else (rows stored
    /// plainly) the tiled product.
    fn project_ways(
        &self,
        x: &WgpuTensor,
        input: Input<'_>,
        cols: usize,
        ways: &[Way<'_>],
        store: Store<'_>,
        accumulate: bool,
    ) {
        let t = match input {
            Input::Heads => x.dims[1],
            _ => x.dims[0],
        };
        let (mut mode, aux, eps, mut hd) = match input {
            Input::Plain => (0, None, 0.0, 0),
            Input::Normed(norm, eps) => (NORMED, Some(&*norm.buf), eps, 0),
            Input::Gated(up) => (GATED, Some(&*up.buf), 0.0, 0),
            Input::Heads => (HEADS, None, 0.0, x.dims[2] as u32),
        };
        if accumulate {
            mode |= ACCUMULATE;
        }
        let (mut row0, mut n_out, mut words): (u32, u32, [&[u32]; 2]) = (0, 0, [&[], &[]]);
        let mut rotated = false;
        match store {
            Store::Rows { row0: r, n_out: n } => (row0, n_out) = (r, n),
            Store::Heads { hd: h, rope } => {
                // Input::Heads and heads-major outputs never meet (an input projection's
                // outputs, an output projection's input).
                hd = h;
                mode |= HEADS_OUT;
                if let Some((positions, inv_freq, pairs)) = rope {
                    mode |= ROPE;
                    if pairs == RopePairs::Interleaved {
                        mode |= INTERLEAVED;
                    }
                    words = [
                        bytemuck::cast_slice(positions),
                        bytemuck::cast_slice(inv_freq),
                    ];
                    rotated = true;
                }
            }
        }
        // Heads-major stores are for few tokens only (the callers' checks).
        let tuning = self.context().tuning;
        let few = t <= tuning.rows_tokens;
        debug_assert!(
            few || mode & HEADS_OUT == 0,
            "a heads-major store of many tokens"
        );
        let group = tuning.group;
        let rows = ways.iter().map(|w| w.rows as usize).sum();
        let lanes = row_lanes(rows, cols, ways[0].dtype, rotated, &tuning);
        // Each projection starts on a workgroup's first row (project.wgsl's header): the
        // rows of a workgroup of rows_main, a tile of linear_main. The ways a dispatch does
        // not have start past every row.
        let tile = if tuning.wide { WIDE_TILE } else { TILE };
        let per = if few { group / lanes } else { tile };
        if tuning.stage && few && per >= 2 && mode & (NORMED | GATED | HEADS) != 0 {
            mode |= STAGED;
        }
        let (mut starts, mut ends) = ([0u32, u32::MAX, u32::MAX], [0u32; 3]);
        let mut fmts = 0;
        let mut at = 0;
        for (k, way) in ways.iter().enumerate() {
            starts[k] = at;
            ends[k] = at + way.rows;
            at = ends[k].next_multiple_of(per);
            fmts |= way.dtype << (8 * k);
            if way.bias.is_some() {
                mode |= BIAS << k;
            }
        }
        // rows_main; or linear_main, over `splits` parts of the inner dimension (workgroup
        // z), then (when split) splits_main adding their sums, one invocation an output. An
        // empty grid is no dispatch.
        let mut splits = 1;
        let passes = if few {
            let row_groups = at.div_ceil(per);
            let gx = row_groups.min(MAX_GROUPS);
            [(0, [gx, row_groups.div_ceil(gx), t as u32]), (2, [0; 3])]
        } else {
            let tiles = [at.div_ceil(tile), (t as u32).div_ceil(tile)];
            // The splits' sums (splits × T × the dispatch's rows) fit one binding.
            let limit = self.context().limits.max_storage_buffer_binding_size;
            let most = (limit / (4 * t as u64 * at as u64).max(1)).min(u32::MAX as u64) as u32;
            splits = tile_splits(tiles[0] * tiles[1], cols as u32, tuning.tiles, most);
            let add = match splits {
                1 => [0; 3],
                _ => flat_groups(at as usize * t),
            };
            [(1, [tiles[0], tiles[1], splits]), (2, add)]
        };
        let first = words[0].len() as u32;
        let params = |idx0: u32| ProjParams {
            ends,
            cols: cols as u32,
            row0,
            n_out,
            fmts,
            mode,
            total: t as u32,
            lanes: if few { lanes } else { splits },
            hd,
            eps,
            idx: [idx0, idx0 + first],
            starts: [starts[1], starts[2]],
        };
        // Slots a dispatch leaves unused hold `x` when read (the shared unused buffer is
        // the outputs', read-write: one buffer cannot be both in a dispatch).
        let ctx = self.context();
        let n = ctx.tuning.ways;
        fn read<'a>(b: Option<&'a wgpu::Buffer>, x: &'a wgpu::Buffer) -> Bind<'a> {
            Bind::Buffer(b.unwrap_or(x))
        }
        let mut slots = [Bind::Unused; 13];
        slots[0] = Bind::Buffer(&x.buf);
        slots[1] = read(aux, &x.buf);
        slots[2] = if first > 0 {
            Bind::Words
        } else {
            Bind::Buffer(&x.buf)
        };
        // The splits' sums: splits x T x the dispatch's rows.
        let partials = if splits > 1 {
            splits as u64 * t as u64 * at as u64 * 4
        } else {
            4
        };
        slots[3] = Bind::Partials(partials);
        // Writable slots must not alias: the second missing output takes the scratch.
        let spare = [Bind::Unused, Bind::Unused, Bind::Scratch(4)];
        for k in 0..n {
            let way = ways.get(k);
            slots[4 + k] = read(way.map(|w| w.w), &x.buf);
            slots[4 + n + k] = way.map_or(spare[k], |w| Bind::Buffer(w.out));
            slots[4 + 2 * n + k] = read(way.and_then(|w| w.bias), &x.buf);
        }
        let words: &[&[u32]] = if first > 0 { &words } else { &[] };
        let slots = &slots[..4 + 3 * n];
        let dtype = tuning.by_dtype && ways.iter().all(|w| w.dtype == ways[0].dtype);
        let kernels = ctx.project(dtype.then_some(ways[0].dtype));
        ctx.dispatch(kernels, params, words, slots, &passes);
    }

    fn op(
        &self,
        op: Op,
        params: OpParams,
        inputs: Inputs<'_>,
        out: &wgpu::Buffer,
        groups: [u32; 3],
    ) {
        let ctx = self.context();
        let Inputs { a, b, words } = inputs;
        fn buffer(x: Option<&wgpu::Buffer>) -> Bind<'_> {
            x.map_or(Bind::Unused, Bind::Buffer)
        }
        let idx = if words.is_empty() {
            Bind::Unused
        } else {
            Bind::Words
        };
        let first = words.first().map_or(0, |w| w.len() as u32);
        ctx.dispatch(
            ctx.model(),
            |idx0| OpParams {
                idx: [idx0, idx0 + first],
                ..params
            },
            words,
            &[buffer(a), buffer(b), idx, Bind::Buffer(out)],
            &[(op as usize, groups)],
        );
    }

    fn flat(
        &self,
        op: Op,
        n: [u32; 4],
        flag: u32,
        total: usize,
        inputs: Inputs<'_>,
        out: &wgpu::Buffer,
    ) {
        let params = OpParams {
            n,
            flag,
            total: total as u32,
            ..Default::default()
        };
        self.op(op, params, inputs, out, flat_groups(total));
    }

    /// Each row's first `k` of `x` (`[R, V]`) in rank order, in two dispatches (`topk_main`):
    /// each part of a row (at most [`TOP_K_PARTS`], of at least [`TOP_K_PART`] values) picks
    /// its first `k`, then one workgroup per row picks from theirs into the first `2k` words
    /// of the row's `scratch` (ids as u32 bits, then values). `scratch` is replaced by a
    /// tensor of `[R, 2k·(1 + parts)]` when its buffer is smaller. Returns R.
    fn pick_top(
        &self,
        x: &WgpuTensor,
        k: usize,
        scratch: &mut WgpuTensor,
    ) -> Result<usize, KitError> {
        let (rows, width) = match x.dims[..] {
            [r, w] if (1..=w).contains(&k) && r as u32 <= MAX_GROUPS => (r, w),
            _ => return Err(KitError::Device(format!("top {k} of {:?}", x.dims))),
        };
        let part = width.div_ceil(TOP_K_PARTS).max(TOP_K_PART);
        let parts = width.div_ceil(part);
        let need = [rows, 2 * k * (1 + parts)];
        if scratch.buf.size() < (need[0] * need[1] * 4) as u64 {
            *scratch = self.zeros(&need)?;
        }
        for (phase, groups) in [(0, parts as u32), (1, 1)] {
            let params = OpParams {
                n: [width as u32, k as u32, part as u32, 0],
                flag: phase,
                ..Default::default()
            };
            self.op(
                Op::TopK,
                params,
                inputs(Some(&x.buf), None, &[]),
                &scratch.buf,
                [groups, rows as u32, 1],
            );
        }
        Ok(rows)
    }
}

impl ModelDevice for WgpuDevice {
    type Weight = WgpuWeight;

    fn weight(&self, data: StoredTensor, rows: usize, cols: usize) -> Result<WgpuWeight, KitError> {
        if data.len() != rows * cols {
            return Err(KitError::Device(format!(
                "a {rows}x{cols} weight given {} elements",
                data.len()
            )));
        }
        let dtype = dtype_flag(data.dtype())?;
        let unit = data.dtype().unit_elems();
        if cols % unit != 0 {
            return Err(KitError::Device(format!(
                "a {rows}x{cols} {} weight: rows must hold whole blocks of {unit}",
                data.dtype().name()
            )));
        }
        let row_bytes = cols / unit * data.dtype().unit_bytes();
        let pad = block_pad(data.dtype());
        // A row's bytes on the device.
        let gpu_row = row_bytes + pad.map_or(0, |_| 2 * (cols / unit));
        let ctx = self.context();
        let limit = ctx
            .limits
            .max_storage_buffer_binding_size
            .min(ctx.limits.max_buffer_size) as usize;
        if gpu_row + 16 > limit {
            return Err(KitError::Device(format!(
                "one {cols}-wide row of a weight is {gpu_row} bytes, over this adapter's \
                 storage binding limit of {limit}"
            )));
        }
        // Whole rows per part, their bytes padded to whole 16-byte units (the projection
        // module reads weights as vec4<u32>).
        let per = (limit - 16) / gpu_row.max(1);
        let all = data.bytes();
        let mut parts = Vec::with_capacity(rows.div_ceil(per));
        for row0 in (0..rows).step_by(per) {
            let n = per.min(rows - row0);
            let bytes = &all[row0 * row_bytes..(row0 + n) * row_bytes];
            let laid;
            let bytes = match pad {
                Some((f, at)) => {
                    laid = pad_blocks(bytes, f, at);
                    &laid[..]
                }
                None => bytes,
            };
            let padded;
            let bytes = if bytes.len() % 16 == 0 {
                bytes
            } else {
                padded = [bytes, &[0u8; 15][..16 - bytes.len() % 16]].concat();
                &padded[..]
            };
            parts.push(WeightPart {
                buf: ctx.buffer_with("weight", bytes, BufferUsages::STORAGE),
                row0,
                rows: n,
            });
        }
        Ok(WgpuWeight {
            parts,
            dtype,
            rows,
            cols,
        })
    }

    fn tensor(&self, data: &[f32], dims: &[usize]) -> Result<WgpuTensor, KitError> {
        Ok(WgpuTensor {
            buf: self.context().buffer_with(
                "tensor",
                bytemuck::cast_slice(data),
                BufferUsages::STORAGE | BufferUsages::COPY_SRC,
            ),
            dims: dims.to_vec(),
        })
    }

    fn embed(&self, table: &WgpuWeight, ids: &[i32], out: &mut WgpuTensor) -> Result<(), KitError> {
        let w = table.cols;
        for part in &table.parts {
            self.flat(
                Op::Embed,
                [w as u32, part.row0 as u32, part.rows as u32, 0],
                table.dtype,
                ids.len() * w,
                inputs(None, Some(&part.buf), &[bytemuck::cast_slice(ids)]),
                &out.buf,
            );
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &WgpuTensor,
        w: &WgpuTensor,
        eps: f32,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        let width = w.dims[0];
        let rows = x.dims.iter().product::<usize>() / width;
        let params = OpParams {
            n: [width as u32, 0, 0, 0],
            eps,
            ..Default::default()
        };
        self.op(
            Op::RmsNorm,
            params,
            inputs(Some(&x.buf), Some(&w.buf), &[]),
            &out.buf,
            [rows as u32, 1, 1],
        );
        Ok(())
    }

    fn linear(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        bias: Option<&WgpuTensor>,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        self.project(x, Input::Plain, w, bias, out, false);
        Ok(())
    }

    fn norm_linears(
        &self,
        x: &WgpuTensor,
        norm: &WgpuTensor,
        eps: f32,
        _hn: &mut WgpuTensor,
        projections: &mut [Projection<'_, Self>],
    ) -> Result<(), KitError> {
        let input = Input::Normed(norm, eps);
        let store = Store::Rows { row0: 0, n_out: 0 };
        match &projections[..] {
            [a, b] if self.together(&[a, b]) => {
                self.project_ways(x, input, x.dims[1], &[way(a), way(b)], store, false)
            }
            [a, b, c] if self.together(&[a, b, c]) => {
                let ways = [way(a), way(b), way(c)];
                self.project_ways(x, input, x.dims[1], &ways, store, false)
            }
            _ => {
                for p in projections {
                    self.project(x, input, p.w, p.bias, p.out, false);
                }
            }
        }
        Ok(())
    }

    fn norm_qkv_heads(
        &self,
        x: &WgpuTensor,
        norm: &WgpuTensor,
        eps: f32,
        hn: &mut WgpuTensor,
        qkv: &mut [Projection<'_, Self>; 3],
        rope: QkvHeads<'_>,
        heads: [&mut WgpuTensor; 3],
    ) -> Result<(), KitError> {
        let [q, k, v] = &*qkv;
        let hd = 2 * rope.inv_freq.len();
        let whole_heads = q.w.rows == rope.heads_q * hd && k.w.rows == rope.heads_kv * hd;
        let few = x.dims[0] <= self.context().tuning.rows_tokens;
        if !(few && whole_heads && v.w.rows == k.w.rows && self.together(&[q, k, v])) {
            return compose_norm_qkv_heads(self, x, norm, eps, hn, qkv, rope, heads);
        }
        let [qh, kh, vh] = heads;
        let ways = [
            Way {
                out: &qh.buf,
                ..way(q)
            },
            Way {
                out: &kh.buf,
                ..way(k)
            },
            Way {
                out: &vh.buf,
                ..way(v)
            },
        ];
        let store = Store::Heads {
            hd: hd as u32,
            rope: Some((rope.positions, rope.inv_freq, rope.pairs)),
        };
        let input = Input::Normed(norm, eps);
        self.project_ways(x, input, x.dims[1], &ways, store, false);
        Ok(())
    }

    fn gated_linear_add(
        &self,
        act: Activation,
        gate: &WgpuTensor,
        up: &WgpuTensor,
        w: &WgpuWeight,
        mlp: &mut WgpuTensor,
        _scratch: &mut WgpuTensor,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        if act == Activation::Silu {
            self.project(gate, Input::Gated(up), w, None, out, true);
        } else {
            self.gated(act, gate, up, mlp)?;
            self.project(mlp, Input::Plain, w, None, out, true);
        }
        Ok(())
    }

    fn linear_add(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        bias: Option<&WgpuTensor>,
        _scratch: &mut WgpuTensor,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        self.project(x, Input::Plain, w, bias, out, true);
        Ok(())
    }

    fn heads_linear_add(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        bias: Option<&WgpuTensor>,
        _merged: &mut WgpuTensor,
        _scratch: &mut WgpuTensor,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        self.project(x, Input::Heads, w, bias, out, true);
        Ok(())
    }

    fn rope_heads(
        &self,
        x: &mut WgpuTensor,
        heads: usize,
        positions: &[i32],
        inv_freq: &[f32],
        pairs: RopePairs,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        let hd = 2 * inv_freq.len();
        let t = positions.len();
        if x.dims != [t, heads * hd] {
            // Rotary on part of each head: the pairs' kernel, then the split.
            self.rope(x, heads, positions, inv_freq, pairs)?;
            return self.split_heads(x, heads, out);
        }
        self.flat(
            Op::RopeHeads,
            [heads as u32, hd as u32, t as u32, 0],
            rope_flag(pairs),
            t * heads * hd / 2,
            inputs(
                Some(&x.buf),
                None,
                &[
                    bytemuck::cast_slice(positions),
                    bytemuck::cast_slice(inv_freq),
                ],
            ),
            &out.buf,
        );
        Ok(())
    }

    fn rope(
        &self,
        x: &mut WgpuTensor,
        heads: usize,
        positions: &[i32],
        inv_freq: &[f32],
        pairs: RopePairs,
    ) -> Result<(), KitError> {
        let hd = 2 * inv_freq.len();
        let total = positions.len() * heads * hd / 2;
        self.flat(
            Op::Rope,
            [heads as u32, hd as u32, 0, 0],
            rope_flag(pairs),
            total,
            inputs(
                None,
                None,
                &[
                    bytemuck::cast_slice(positions),
                    bytemuck::cast_slice(inv_freq),
                ],
            ),
            &x.buf,
        );
        Ok(())
    }

    fn hadamard(&self, x: &WgpuTensor, n: usize, out: &mut WgpuTensor) -> Result<(), KitError> {
        check_hadamard(&x.dims, n, &out.dims)?;
        let total: usize = x.dims.iter().product();
        let params = OpParams {
            n: [n as u32, 0, 0, 0],
            total: total as u32,
            eps: 1.0 / (n as f32).sqrt(),
            ..Default::default()
        };
        self.op(
            Op::Hadamard,
            params,
            inputs(Some(&x.buf), None, &[]),
            &out.buf,
            flat_groups(total),
        );
        Ok(())
    }

    fn split_heads(
        &self,
        x: &WgpuTensor,
        heads: usize,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        let (t, d) = (x.dims[0], x.dims[1] / heads);
        self.flat(
            Op::Heads,
            [heads as u32, t as u32, d as u32, 0],
            0,
            heads * t * d,
            inputs(Some(&x.buf), None, &[]),
            &out.buf,
        );
        Ok(())
    }

    fn merge_heads(&self, x: &WgpuTensor, out: &mut WgpuTensor) -> Result<(), KitError> {
        let (h, t, d) = (x.dims[0], x.dims[1], x.dims[2]);
        self.flat(
            Op::Heads,
            [h as u32, t as u32, d as u32, 0],
            1,
            h * t * d,
            inputs(Some(&x.buf), None, &[]),
            &out.buf,
        );
        Ok(())
    }

    fn silu_mul(
        &self,
        gate: &WgpuTensor,
        up: &WgpuTensor,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        let n = self.dims(gate).iter().product();
        self.flat(
            Op::Silu,
            [0; 4],
            0,
            n,
            inputs(Some(&gate.buf), Some(&up.buf), &[]),
            &out.buf,
        );
        Ok(())
    }

    fn gelu_tanh_mul(
        &self,
        gate: &WgpuTensor,
        up: &WgpuTensor,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        let n = self.dims(gate).iter().product();
        self.flat(
            Op::Gelu,
            [0; 4],
            0,
            n,
            inputs(Some(&gate.buf), Some(&up.buf), &[]),
            &out.buf,
        );
        Ok(())
    }

    fn scale(&self, x: &mut WgpuTensor, s: f32) -> Result<(), KitError> {
        let params = OpParams {
            total: x.dims.iter().product::<usize>() as u32,
            eps: s,
            ..Default::default()
        };
        let total = params.total as usize;
        self.op(
            Op::Scale,
            params,
            Inputs::default(),
            &x.buf,
            flat_groups(total),
        );
        Ok(())
    }

    fn add_assign(&self, x: &mut WgpuTensor, y: &WgpuTensor) -> Result<(), KitError> {
        let n = y.dims.iter().product();
        self.flat(
            Op::Add,
            [0; 4],
            0,
            n,
            inputs(Some(&y.buf), None, &[]),
            &x.buf,
        );
        Ok(())
    }

    /// Each row's first pick of [`Self::top_k_rows`]'s kernels at `k = 1` (the argmax is
    /// rank's first), its id alone read back. Their scratch is the device's own (`picks`),
    /// not `ids`, which is `[R]`.
    fn argmax_rows(
        &self,
        x: &WgpuTensor,
        ids: &mut WgpuTensor,
        out: &mut Vec<i32>,
    ) -> Result<(), KitError> {
        let _ = ids;
        let mut picks = self.picks.lock().unwrap_or_else(|p| p.into_inner());
        let scratch = match &mut *picks {
            Some(s) => s,
            none => none.insert(self.zeros(&[1, 2])?),
        };
        let rows = self.pick_top(x, 1, scratch)?;
        let regions: Vec<(u64, u64)> = (0..rows as u64).map(|r| (8 * r, 4)).collect();
        let bytes = self
            .context()
            .read_regions(&scratch.buf, &regions)
            .map_err(KitError::Device)?;
        out.clear();
        out.extend(
            bytes
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
        Ok(())
    }

    /// [`Self::pick_top`]'s picks, ids and values read back.
    fn top_k_rows(
        &self,
        x: &WgpuTensor,
        k: usize,
        scratch: &mut WgpuTensor,
        ids: &mut Vec<i32>,
        values: &mut Vec<f32>,
    ) -> Result<(), KitError> {
        let rows = self.pick_top(x, k, scratch)?;
        let bytes = self
            .context()
            .read(&scratch.buf, (rows * 2 * k * 4) as u64)
            .map_err(KitError::Device)?;
        ids.clear();
        values.clear();
        for row in bytes.chunks_exact(8 * k) {
            let word = |b: &[u8]| [b[0], b[1], b[2], b[3]];
            let (id_bytes, value_bytes) = row.split_at(4 * k);
            ids.extend(
                id_bytes
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes(word(b))),
            );
            values.extend(
                value_bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(word(b))),
            );
        }
        Ok(())
    }

    /// A copy of the rows (`gather_main`), then one invocation an adjustment.
    fn adjust_rows(
        &self,
        x: &WgpuTensor,
        at: &[[u32; 2]],
        by: &[kvplug_core::Adjust],
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        let (rows, width) = kvplug_backend_kit::model::check_adjust(&x.dims, at, by)?;
        if out.dims != x.dims {
            return Err(KitError::Device(format!(
                "adjusting {:?} into {:?}",
                x.dims, out.dims
            )));
        }
        let all: Vec<usize> = (0..rows).collect();
        self.gather_rows(x, &all, out)?;
        let words: Vec<u32> = at
            .iter()
            .zip(by)
            .flat_map(|(&[r, t], a)| {
                let [add, sub, pos, neg] = a.to_array().map(f32::to_bits);
                [r, t, add, sub, pos, neg]
            })
            .collect();
        self.flat(
            Op::Adjust,
            [width as u32, 0, 0, 0],
            0,
            at.len(),
            inputs(None, None, &[&words]),
            &out.buf,
        );
        Ok(())
    }

    fn gather_rows(
        &self,
        x: &WgpuTensor,
        rows: &[usize],
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        let w = x.dims[1];
        let rows: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        self.flat(
            Op::Gather,
            [w as u32, 0, 0, 0],
            0,
            rows.len() * w,
            inputs(Some(&x.buf), None, &[&rows]),
            &out.buf,
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{row_lanes, tile_splits};
    use crate::context::Tuning;

    const Q4K: u32 = 8;

    #[test]
    fn a_small_projection_takes_lanes_until_its_dispatch_has_the_invocations() {
        let gpu = Tuning::gpu(&wgpu::Limits::default());
        let steps_alone = Tuning { threads: 0, ..gpu };
        // 17,920 rows of 48 spans (the 1.5B shape's gate/up): at most 8 steps a lane
        // gives 8 lanes, 143,360 invocations, past the target.
        assert_eq!(row_lanes(17920, 1536, Q4K, false, &gpu), 8);
        // 2,048 rows of 48 spans (its q/k/v): 6 steps a lane would be 16,384 invocations;
        // 32 lanes make 65,536.
        assert_eq!(row_lanes(2048, 1536, Q4K, false, &steps_alone), 8);
        assert_eq!(row_lanes(2048, 1536, Q4K, false, &gpu), 32);
        // No more lanes than the row has spans (28, the 0.5B shape's), rounded up.
        assert_eq!(row_lanes(896, 896, Q4K, false, &gpu), 32);
        // The steps' lanes where they are more: 280 spans at 8 steps, 64 lanes.
        assert_eq!(row_lanes(1536, 8960, Q4K, false, &gpu), 64);
        // At most max_lanes, and half the workgroup when rows pair up for a rotation.
        let narrow = Tuning {
            max_lanes: 16,
            ..gpu
        };
        assert_eq!(row_lanes(64, 8960, Q4K, false, &narrow), 16);
        assert_eq!(row_lanes(64, 16384, Q4K, true, &gpu), 128);
        // A dense row's steps are values: 896 at 8 steps, 128 lanes.
        assert_eq!(row_lanes(4096, 896, 1, false, &gpu), 128);
        // At least min_lanes: 151,936 rows of 28 spans (the 0.5B shape's head) take 4 lanes
        // for 8 steps each where the floor allows, else the floor.
        let floor = |min_lanes| Tuning { min_lanes, ..gpu };
        assert_eq!(row_lanes(151936, 896, Q4K, false, &gpu), 8);
        assert_eq!(row_lanes(151936, 896, Q4K, false, &floor(1)), 4);
        assert_eq!(row_lanes(151936, 896, Q4K, false, &floor(16)), 16);
    }

    #[test]
    fn a_tiled_product_splits_its_steps_while_it_has_few_workgroups() {
        // 112 tiles of 152 steps (the 0.5B shape's down projection at pp512): doubled to 8
        // splits (896 workgroups past 512), 19 steps each.
        assert_eq!(tile_splits(112, 4864, 512, u32::MAX), 8);
        assert_eq!(tile_splits(112, 4864, 0, u32::MAX), 1);
        assert_eq!(tile_splits(1216, 896, 512, u32::MAX), 1);
        // 28 steps: two splits of 14; a third halving would leave 7, under 8 a split.
        assert_eq!(tile_splits(1, 896, u32::MAX, u32::MAX), 2);
        // 40 steps: 4 of 10 (8 would be 5); 24: 2 of 12 (4 would be 6).
        assert_eq!(tile_splits(1, 40 * 32, u32::MAX, u32::MAX), 4);
        assert_eq!(tile_splits(1, 24 * 32, u32::MAX, u32::MAX), 2);
        // 129 steps: 16 parts of 9 would leave the last empty; 15 of 9 cover them.
        assert_eq!(tile_splits(1, 129 * 32, u32::MAX, u32::MAX), 15);
        // At most `most` parts: 4 where 8 would fit the steps.
        assert_eq!(tile_splits(112, 4864, 512, 7), 4);
        assert_eq!(tile_splits(112, 4864, 512, 1), 1);
        // A partial last step counts as one.
        assert_eq!(tile_splits(1, 16 * 32 - 5, u32::MAX, u32::MAX), 2);
    }
}

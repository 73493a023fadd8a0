//! The model graph's operations on wgpu: WGSL kernels over f32 storage buffers, so
//! activations stay on the device between layers (only logits are read back).

use kvplug_backend_kit::model::blocks::BLOCK_FORMATS;
use kvplug_backend_kit::model::config::Activation;
use kvplug_backend_kit::model::ops::check_hadamard;
use kvplug_backend_kit::model::{ModelDevice, Projection, StoredDtype, StoredTensor};
use kvplug_backend_kit::{Device, KitError};
use kvplug_core::RopePairs;
use wgpu::BufferUsages;

use crate::context::Bind;
use crate::{WgpuDevice, WgpuTensor};

/// A `[rows, cols]` weight in storage buffers, in its stored dtype (the shaders widen each
/// element, or dequantize each block, as they read it). A weight larger than one storage
/// binding may hold (`max_storage_buffer_binding_size`: 128 MiB on lavapipe) is split into
/// parts of whole rows, each its own buffer.
pub struct WgpuWeight {
    parts: Vec<WeightPart>,
    /// The shaders' dtype flag (see `weight_at` in model.wgsl).
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

/// The shaders' flag for a stored dtype (`weight_at` in model.wgsl), or an error for one the
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

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct OpParams {
    n: [u32; 4],
    flag: u32,
    total: u32,
    /// Where the op's index words start, and its second array of them (set by [`WgpuDevice::op`]).
    idx: [u32; 2],
    eps: f32,
    /// A linear's `mode` bits (model.wgsl's `WITH_BIAS`, `ACCUMULATE`, …).
    mode: u32,
    /// A `HEADS` input's head width.
    hd: u32,
    pad2: f32,
}

/// model.wgsl's `mode` bits.
const WITH_BIAS: u32 = 1;
const ACCUMULATE: u32 = 2;
const NORMED: u32 = 4;
const GATED: u32 = 8;
const HEADS: u32 = 16;

/// How a linear reads its input (model.wgsl's `xin`).
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

/// The most tokens a linear computes with several invocations per output row
/// (`linear_rows_main`).
const ROWS_TOGETHER_MAX_T: usize = 16;

/// Output rows per workgroup of `linear_rows_main` (its `ROWS_PER_GROUP`).
const ROWS_PER_GROUP: u32 = 2;

/// Output rows and tokens per workgroup of `linear_main`, the tiled product (its `TILE`).
const TILE: u32 = 64;

/// The most workgroups in one dimension of a dispatch (WebGPU's default limit).
const MAX_GROUPS: u32 = 65535;

/// Indices into [`crate::context::MODEL_ENTRIES`].
#[derive(Clone, Copy)]
enum Op {
    Gather = 0,
    RmsNorm = 1,
    Linear = 2,
    RopeHeads = 3,
    Rope = 4,
    Heads = 5,
    Silu = 6,
    Add = 7,
    Embed = 8,
    Gelu = 9,
    Scale = 10,
    Hadamard = 11,
    LinearRows = 12,
    Argmax = 13,
}

/// The read-only operands of one op: buffers `a`, `b` and a linear's `bias` and `aux` (absent
/// ones are bound to a dummy) and up to two arrays of index words (read at `idx0` and
/// `idx1`).
#[derive(Clone, Copy, Default)]
struct Inputs<'a> {
    a: Option<&'a wgpu::Buffer>,
    b: Option<&'a wgpu::Buffer>,
    bias: Option<&'a wgpu::Buffer>,
    aux: Option<&'a wgpu::Buffer>,
    words: &'a [&'a [u32]],
}

fn inputs<'a>(
    a: Option<&'a wgpu::Buffer>,
    b: Option<&'a wgpu::Buffer>,
    words: &'a [&'a [u32]],
) -> Inputs<'a> {
    Inputs {
        a,
        b,
        bias: None,
        aux: None,
        words,
    }
}

/// Workgroups for `total` invocations in 64-wide groups, spread over x and y.
fn flat_groups(total: usize) -> [u32; 3] {
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
        let (t, hd) = match input {
            Input::Heads => (x.dims[1], x.dims[2]),
            _ => (x.dims[0], 0),
        };
        // Few tokens (decode, a small verify batch): 32 invocations per output row and token,
        // reading the row together (see linear_rows_main); else the tiled product.
        let rows_together = t <= ROWS_TOGETHER_MAX_T;
        let (input_mode, aux, eps) = match input {
            Input::Plain => (0, None, 0.0),
            Input::Normed(norm, eps) => (NORMED, Some(&*norm.buf), eps),
            Input::Gated(up) => (GATED, Some(&*up.buf), 0.0),
            Input::Heads => (HEADS, None, 0.0),
        };
        let mode = input_mode
            | if bias.is_some() { WITH_BIAS } else { 0 }
            | if accumulate { ACCUMULATE } else { 0 };
        for part in &w.parts {
            let rows = part.rows as u32;
            if rows == 0 {
                continue;
            }
            let params = OpParams {
                n: [rows, w.cols as u32, part.row0 as u32, w.rows as u32],
                flag: w.dtype,
                total: t as u32,
                mode,
                eps,
                hd: hd as u32,
                ..Default::default()
            };
            let (op, groups) = if rows_together {
                let row_groups = rows.div_ceil(ROWS_PER_GROUP);
                let x = row_groups.min(MAX_GROUPS);
                (Op::LinearRows, [x, row_groups.div_ceil(x), t as u32])
            } else {
                (
                    Op::Linear,
                    [rows.div_ceil(TILE), (t as u32).div_ceil(TILE), 1],
                )
            };
            let operands = Inputs {
                bias: bias.map(|b| &*b.buf),
                aux,
                ..inputs(Some(&x.buf), Some(&part.buf), &[])
            };
            self.op(op, params, operands, &out.buf, groups);
        }
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
        let Inputs {
            a,
            b,
            bias,
            aux,
            words,
        } = inputs;
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
            &[
                buffer(a),
                buffer(b),
                idx,
                Bind::Buffer(out),
                buffer(bias),
                buffer(aux),
            ],
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
        let ctx = self.context();
        let limit = ctx
            .limits
            .max_storage_buffer_binding_size
            .min(ctx.limits.max_buffer_size) as usize;
        if row_bytes + 4 > limit {
            return Err(KitError::Device(format!(
                "one {cols}-wide row of a weight is {row_bytes} bytes, over this adapter's \
                 storage binding limit of {limit}"
            )));
        }
        // Whole rows per part, their bytes padded to whole 32-bit words.
        let per = (limit - 4) / row_bytes.max(1);
        let all = data.bytes();
        let mut parts = Vec::with_capacity(rows.div_ceil(per));
        for row0 in (0..rows).step_by(per) {
            let n = per.min(rows - row0);
            let bytes = &all[row0 * row_bytes..(row0 + n) * row_bytes];
            let padded;
            let bytes = if bytes.len() % 4 == 0 {
                bytes
            } else {
                padded = [bytes, &[0u8; 3][..4 - bytes.len() % 4]].concat();
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
        for p in projections {
            self.project(x, Input::Normed(norm, eps), p.w, p.bias, p.out, false);
        }
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

    fn argmax_rows(
        &self,
        x: &WgpuTensor,
        ids: &mut WgpuTensor,
        out: &mut Vec<i32>,
    ) -> Result<(), KitError> {
        let (rows, width) = match x.dims[..] {
            [r, w] if ids.dims == [r] && r as u32 <= MAX_GROUPS => (r, w),
            _ => {
                return Err(KitError::Device(format!(
                    "argmax of {:?} into {:?}",
                    x.dims, ids.dims
                )))
            }
        };
        let params = OpParams {
            n: [width as u32, 0, 0, 0],
            ..Default::default()
        };
        self.op(
            Op::Argmax,
            params,
            inputs(Some(&x.buf), None, &[]),
            &ids.buf,
            [rows as u32, 1, 1],
        );
        let bytes = self
            .context()
            .read(&ids.buf, (rows * 4) as u64)
            .map_err(KitError::Device)?;
        out.clear();
        out.extend(
            bytes
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
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

//! The model graph's operations on the cpu: linears over the weights in their stored dtype,
//! read in place from the mapped package ([`crate::linear`]; block formats through
//! [`crate::qlinear`]), and plain loops for the element-wise ops (the activations' `e^x`
//! through [`kvplug_core::exp::fast_exp`], so that they vectorize).

use std::cell::RefCell;

use kvplug_backend_kit::model::blocks::BLOCK_FORMATS;
use kvplug_backend_kit::model::config::{Activation, Experts};
use kvplug_backend_kit::model::moe::{
    check as check_routes, combine, Expert, ExpertGroups, Routes,
};
use kvplug_backend_kit::model::ops::{check_hadamard, hadamard_in_place, swiglu_oai};
use kvplug_backend_kit::model::{
    BlockFormat, ModelDevice, Projection, StoredDtype, StoredTensor, StoredValues,
};
use kvplug_backend_kit::KitError;
use kvplug_core::RopePairs;

use crate::linear::linear;
use crate::qlinear::{linear_blocks, linear_blocks_many, BlockMatrix};
use crate::simd;
use crate::tensor::CpuTensor;
use crate::CpuDevice;

/// A `[rows, cols]` weight: the stored elements themselves (usually the mapped file). A
/// block-format weight's rows are whole blocks (`cols` a multiple of the block).
pub struct CpuWeight {
    rows: usize,
    cols: usize,
    data: StoredTensor,
}

/// Refuses a linear whose shapes break [`ModelDevice::linear`]'s contract (a bias, where
/// given, holds one value per output column).
fn check_linear(
    x: &CpuTensor,
    w: &CpuWeight,
    bias: Option<&CpuTensor>,
    out: &CpuTensor,
) -> Result<(), KitError> {
    let bias_fits = bias.is_none_or(|b| b.data.len() == w.rows);
    check(
        x.dims.len() == 2 && x.dims[1] == w.cols && out.dims == [x.dims[0], w.rows] && bias_fits,
        "linear",
    )
}

/// `out += bias` on each row (`[T, rows]`, `rows` values of bias).
fn add_bias(out: &mut [f32], bias: &CpuTensor) {
    for row in out.chunks_exact_mut(bias.data.len()) {
        row.iter_mut().zip(&bias.data).for_each(|(o, b)| *o += b);
    }
}

/// `out = act(gate, up)` element-wise on slices of one length.
fn gated(act: Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
    match act {
        Activation::Silu => simd::silu_mul(gate, up, out),
        Activation::GeluTanh => simd::gelu_tanh_mul(gate, up, out),
        Activation::SwigluOai { alpha, limit } => {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = swiglu_oai(g, u, alpha, limit);
            }
        }
    }
}

/// The projections of `x` (`[t, cols]`; shapes checked by the caller) as one
/// [`linear_blocks_many`] job, biases left out, when every weight is in a block format;
/// otherwise `false` and nothing done.
fn fused_blocks<const N: usize>(
    x: &[f32],
    t: usize,
    cols: usize,
    ps: [(&CpuWeight, &mut [f32]); N],
) -> bool {
    fn blocks(w: &CpuWeight) -> Option<(BlockFormat, &[u8])> {
        match w.data.values() {
            StoredValues::Blocks(f, b) => Some((f, b)),
            _ => None,
        }
    }
    if !ps.iter().all(|(w, _)| blocks(w).is_some()) {
        return false;
    }
    let matrices = ps.map(|(w, out)| {
        let (format, b) = blocks(w).expect("checked above");
        BlockMatrix {
            format,
            w: b,
            rows: w.rows,
            out,
        }
    });
    linear_blocks_many(x, t, cols, matrices);
    true
}

/// `out = x·Wᵀ` on slices: x `[t, w.cols]`, out `[t, w.rows]` (shapes checked by the
/// caller), in the weight's stored dtype.
fn project(x: &[f32], t: usize, w: &CpuWeight, out: &mut [f32]) -> Result<(), KitError> {
    match w.data.values() {
        StoredValues::F32(v) => linear(x, t, v, w.rows, w.cols, out),
        StoredValues::F16(v) => linear(x, t, v, w.rows, w.cols, out),
        StoredValues::BF16(v) => linear(x, t, v, w.rows, w.cols, out),
        StoredValues::Blocks(f, b) => linear_blocks(x, t, f, b, w.rows, w.cols, out),
        _ => return Err(unsupported(w.data.dtype())),
    }
    Ok(())
}

/// A stored dtype this backend has no kernel for (one a later kit added).
fn unsupported(dtype: StoredDtype) -> KitError {
    KitError::Device(format!(
        "the cpu backend has no kernel for {} weights",
        dtype.name()
    ))
}

/// A thread's buffers for [`ModelDevice::experts`]: the routed rows grouped by expert, their
/// gate, up and gated products, and the experts' outputs; grown to the largest step seen,
/// then reused (a decode loop allocates nothing once warm).
#[derive(Default)]
struct ExpertScratch {
    x: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
    y: Vec<f32>,
}

thread_local! {
    static EXPERT_SCRATCH: RefCell<ExpertScratch> = RefCell::default();
}

/// `v` holding `n` values (contents unspecified); allocates only to grow.
fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

fn check(cond: bool, what: &str) -> Result<(), KitError> {
    if cond {
        Ok(())
    } else {
        Err(KitError::Device(format!("shape mismatch in {what}")))
    }
}

impl ModelDevice for CpuDevice {
    type Weight = CpuWeight;

    fn reads_mxfp4(&self) -> bool {
        true
    }

    fn weight(&self, data: StoredTensor, rows: usize, cols: usize) -> Result<CpuWeight, KitError> {
        check(data.len() == rows * cols, "weight")?;
        match data.dtype() {
            StoredDtype::F32 | StoredDtype::F16 | StoredDtype::BF16 => {}
            StoredDtype::Block(f) if BLOCK_FORMATS.contains(&f) || f == BlockFormat::Mxfp4 => {
                if !cols.is_multiple_of(f.block_elems()) {
                    return Err(KitError::Device(format!(
                        "a {} weight's rows must be whole {}-value blocks; it has {cols} columns",
                        f.name(),
                        f.block_elems()
                    )));
                }
            }
            other => return Err(unsupported(other)),
        }
        Ok(CpuWeight { rows, cols, data })
    }

    fn tensor(&self, data: &[f32], dims: &[usize]) -> Result<CpuTensor, KitError> {
        check(dims.iter().product::<usize>() == data.len(), "tensor")?;
        Ok(CpuTensor::new(dims, data.to_vec()))
    }

    fn embed(&self, table: &CpuWeight, ids: &[i32], out: &mut CpuTensor) -> Result<(), KitError> {
        let h = table.cols;
        for (row, &id) in out.data.chunks_exact_mut(h).zip(ids) {
            let at = id as usize * h..(id as usize + 1) * h;
            match table.data.values() {
                StoredValues::F32(v) => row.copy_from_slice(&v[at]),
                StoredValues::F16(v) => simd::f16_to_f32(&v[at], row),
                StoredValues::BF16(v) => simd::bf16_to_f32(&v[at], row),
                _ => table.data.rows_f32(at.start, row),
            }
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CpuTensor,
        w: &CpuTensor,
        eps: f32,
        out: &mut CpuTensor,
    ) -> Result<(), KitError> {
        let h = w.data.len();
        for (o, r) in out.data.chunks_exact_mut(h).zip(x.data.chunks_exact(h)) {
            let ms = simd::dot_f32(r, r) / h as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for ((o, &v), &g) in o.iter_mut().zip(r).zip(&w.data) {
                *o = v * inv * g;
            }
        }
        Ok(())
    }

    fn linear(
        &self,
        x: &CpuTensor,
        w: &CpuWeight,
        bias: Option<&CpuTensor>,
        out: &mut CpuTensor,
    ) -> Result<(), KitError> {
        check_linear(x, w, bias, out)?;
        project(&x.data, x.dims[0], w, &mut out.data)?;
        if let Some(b) = bias {
            add_bias(&mut out.data, b);
        }
        Ok(())
    }

    fn linears(&self, x: &CpuTensor, ps: &mut [Projection<'_, Self>]) -> Result<(), KitError> {
        for p in ps.iter() {
            check_linear(x, p.w, p.bias, p.out)?;
        }
        let (t, cols) = (x.dims[0], x.dims[1]);
        let fused = match ps {
            [a, b] => fused_blocks(&x.data, t, cols, [a, b].map(|p| (p.w, &mut p.out.data[..]))),
            [a, b, c] => fused_blocks(
                &x.data,
                t,
                cols,
                [a, b, c].map(|p| (p.w, &mut p.out.data[..])),
            ),
            _ => false,
        };
        if !fused {
            return ps
                .iter_mut()
                .try_for_each(|p| self.linear(x, p.w, p.bias, p.out));
        }
        for p in ps.iter_mut() {
            if let Some(b) = p.bias {
                add_bias(&mut p.out.data, b);
            }
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CpuTensor,
        heads: usize,
        positions: &[i32],
        inv_freq: &[f32],
        pairs: RopePairs,
    ) -> Result<(), KitError> {
        let hd = 2 * inv_freq.len();
        let width = heads * hd;
        let rotate = |x1: &mut f32, x2: &mut f32, angle: f32| {
            let (sin, cos) = angle.sin_cos();
            let (u, v) = (*x1, *x2);
            *x1 = u * cos - v * sin;
            *x2 = v * cos + u * sin;
        };
        for (row, &p) in x.data.chunks_exact_mut(width).zip(positions) {
            for head in row.chunks_exact_mut(hd) {
                match pairs {
                    RopePairs::Halves => {
                        let (a, b) = head.split_at_mut(hd / 2);
                        for ((x1, x2), &f) in a.iter_mut().zip(b.iter_mut()).zip(inv_freq) {
                            rotate(x1, x2, p as f32 * f);
                        }
                    }
                    RopePairs::Interleaved => {
                        for (pair, &f) in head.chunks_exact_mut(2).zip(inv_freq) {
                            let (x1, x2) = pair.split_at_mut(1);
                            rotate(&mut x1[0], &mut x2[0], p as f32 * f);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn hadamard(&self, x: &CpuTensor, n: usize, out: &mut CpuTensor) -> Result<(), KitError> {
        check_hadamard(&x.dims, n, &out.dims)?;
        out.data.copy_from_slice(&x.data);
        hadamard_in_place(&mut out.data, n);
        Ok(())
    }

    fn split_heads(
        &self,
        x: &CpuTensor,
        heads: usize,
        out: &mut CpuTensor,
    ) -> Result<(), KitError> {
        let (t, d) = (x.dims[0], x.dims[1] / heads);
        for ti in 0..t {
            for h in 0..heads {
                out.data[(h * t + ti) * d..(h * t + ti + 1) * d]
                    .copy_from_slice(&x.data[(ti * heads + h) * d..(ti * heads + h + 1) * d]);
            }
        }
        Ok(())
    }

    fn merge_heads(&self, x: &CpuTensor, out: &mut CpuTensor) -> Result<(), KitError> {
        let (heads, t, d) = (x.dims[0], x.dims[1], x.dims[2]);
        for ti in 0..t {
            for h in 0..heads {
                out.data[(ti * heads + h) * d..(ti * heads + h + 1) * d]
                    .copy_from_slice(&x.data[(h * t + ti) * d..(h * t + ti + 1) * d]);
            }
        }
        Ok(())
    }

    fn mul(&self, a: &CpuTensor, b: &CpuTensor, out: &mut CpuTensor) -> Result<(), KitError> {
        for ((o, x), y) in out.data.iter_mut().zip(&a.data).zip(&b.data) {
            *o = x * y;
        }
        Ok(())
    }

    fn sigmoid_mul(
        &self,
        gate: &CpuTensor,
        x: &CpuTensor,
        out: &mut CpuTensor,
    ) -> Result<(), KitError> {
        simd::sigmoid_mul(&gate.data, &x.data, &mut out.data);
        Ok(())
    }

    fn silu_mul(
        &self,
        gate: &CpuTensor,
        up: &CpuTensor,
        out: &mut CpuTensor,
    ) -> Result<(), KitError> {
        simd::silu_mul(&gate.data, &up.data, &mut out.data);
        Ok(())
    }

    fn gelu_tanh_mul(
        &self,
        gate: &CpuTensor,
        up: &CpuTensor,
        out: &mut CpuTensor,
    ) -> Result<(), KitError> {
        simd::gelu_tanh_mul(&gate.data, &up.data, &mut out.data);
        Ok(())
    }

    fn swiglu_oai_mul(
        &self,
        gate: &CpuTensor,
        up: &CpuTensor,
        alpha: f32,
        limit: f32,
        out: &mut CpuTensor,
    ) -> Result<(), KitError> {
        let act = Activation::SwigluOai { alpha, limit };
        gated(act, &gate.data, &up.data, &mut out.data);
        Ok(())
    }

    fn scale(&self, x: &mut CpuTensor, s: f32) -> Result<(), KitError> {
        x.data.iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<(), KitError> {
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    /// Each used expert runs once on all of its tokens' rows (one fused gate/up job and one
    /// down job over its weights, read in place), then [`combine`] sums each token's slots.
    fn experts(
        &self,
        x: &CpuTensor,
        experts: &[Expert<Self>],
        spec: &Experts,
        routes: &Routes,
        groups: &ExpertGroups,
        out: &mut CpuTensor,
    ) -> Result<(), KitError> {
        let width = spec.width;
        let [t, h] = x.dims[..] else {
            return check(false, "experts");
        };
        check(out.dims == x.dims, "experts")?;
        check_routes(routes, groups, t, experts.len()).map_err(KitError::Device)?;
        for (e, _) in groups.used() {
            let ex = experts
                .get(e)
                .ok_or_else(|| KitError::Device(format!("experts: no expert {e}")))?;
            let fits = |w: &CpuWeight, rows, cols| w.rows == rows && w.cols == cols;
            let bias_fits = |b: &Option<CpuTensor>, n| b.as_ref().is_none_or(|b| b.data.len() == n);
            check(
                fits(&ex.gate, width, h)
                    && fits(&ex.up, width, h)
                    && fits(&ex.down, h, width)
                    && bias_fits(&ex.gate_bias, width)
                    && bias_fits(&ex.up_bias, width)
                    && bias_fits(&ex.down_bias, h),
                "experts",
            )?;
        }
        EXPERT_SCRATCH.with_borrow_mut(|s| {
            let n = groups.pairs.len();
            let xs = sized(&mut s.x, n * h);
            for (row, &pair) in xs.chunks_exact_mut(h).zip(&groups.pairs) {
                let tok = pair / routes.per_token;
                row.copy_from_slice(&x.data[tok * h..(tok + 1) * h]);
            }
            let (gate, up) = (sized(&mut s.gate, n * width), sized(&mut s.up, n * width));
            let (act, y) = (sized(&mut s.act, n * width), sized(&mut s.y, n * h));
            for (e, r) in groups.used() {
                let ex = &experts[e];
                let (xe, m) = (&xs[r.start * h..r.end * h], r.len());
                let wide = r.start * width..r.end * width;
                let (g, u) = (&mut gate[wide.clone()], &mut up[wide.clone()]);
                if !fused_blocks(xe, m, h, [(&ex.gate, &mut *g), (&ex.up, &mut *u)]) {
                    project(xe, m, &ex.gate, g)?;
                    project(xe, m, &ex.up, u)?;
                }
                for (out, bias) in [(&mut *g, &ex.gate_bias), (&mut *u, &ex.up_bias)] {
                    if let Some(b) = bias {
                        add_bias(out, b);
                    }
                }
                gated(spec.activation, g, u, &mut act[wide.clone()]);
                let ye = &mut y[r.start * h..r.end * h];
                project(&act[wide], m, &ex.down, ye)?;
                if let Some(b) = &ex.down_bias {
                    add_bias(ye, b);
                }
            }
            combine(routes, groups, y, h, &mut out.data);
            Ok(())
        })
    }

    /// In place over `out`'s buffer (nothing allocated once warm).
    fn adjust_rows(
        &self,
        x: &CpuTensor,
        at: &[[u32; 2]],
        by: &[kvplug_core::Adjust],
        out: &mut CpuTensor,
    ) -> Result<(), KitError> {
        let (_, width) = kvplug_backend_kit::model::check_adjust(&x.dims, at, by)?;
        let place = |&[r, c]: &[u32; 2]| r as usize * width + c as usize;
        out.dims.clone_from(&x.dims);
        out.data.clone_from(&x.data);
        for (p, a) in at.iter().zip(by) {
            let v = &mut out.data[place(p)];
            *v = a.apply(*v);
        }
        Ok(())
    }

    fn gather_rows(
        &self,
        x: &CpuTensor,
        rows: &[usize],
        out: &mut CpuTensor,
    ) -> Result<(), KitError> {
        let n = x.dims[1];
        for (o, &r) in out.data.chunks_exact_mut(n).zip(rows) {
            o.copy_from_slice(&x.data[r * n..(r + 1) * n]);
        }
        Ok(())
    }
}

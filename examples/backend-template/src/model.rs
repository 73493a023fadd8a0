//! The model graph's operations ([`ModelDevice`]), the simplest way that meets each contract:
//! weights widened to f32 once at load (every stored dtype, block formats included), each op
//! a loop on the calling thread. With them `export_backend!(…, models)` serves the kit's
//! `forward` method, so `kvplug run --backend template` runs a model.
//!
//! `tensor` and `hadamard` keep the kit's defaults (an upload; butterflies in host memory,
//! which is where this device's tensors live anyway).

use kvplug_backend_kit::model::{ModelDevice, StoredTensor};
use kvplug_backend_kit::KitError;
use kvplug_core::RopePairs;

use crate::{TemplateDevice, Tensor};

/// A `[rows, cols]` weight, widened to f32 at load.
pub struct Weight {
    cols: usize,
    data: Vec<f32>,
}

impl ModelDevice for TemplateDevice {
    type Weight = Weight;

    fn weight(&self, data: StoredTensor, rows: usize, cols: usize) -> Result<Weight, KitError> {
        if data.len() != rows * cols {
            return Err(KitError::Device(format!(
                "a {rows}x{cols} weight given {} elements",
                data.len()
            )));
        }
        Ok(Weight {
            cols,
            data: data.to_f32(),
        })
    }

    fn embed(&self, table: &Weight, ids: &[i32], out: &mut Tensor) -> Result<(), KitError> {
        let h = table.cols;
        for (row, &id) in out.data.chunks_exact_mut(h).zip(ids) {
            let from = table
                .data
                .get(id as usize * h..(id as usize + 1) * h)
                .ok_or_else(|| KitError::Device(format!("token id {id} is not in the table")))?;
            row.copy_from_slice(from);
        }
        Ok(())
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, out: &mut Tensor) -> Result<(), KitError> {
        let n = w.data.len();
        for (o, r) in out.data.chunks_exact_mut(n).zip(x.data.chunks_exact(n)) {
            let mean_square = r.iter().map(|v| v * v).sum::<f32>() / n as f32;
            let inv = 1.0 / (mean_square + eps).sqrt();
            for ((o, v), g) in o.iter_mut().zip(r).zip(&w.data) {
                *o = v * inv * g;
            }
        }
        Ok(())
    }

    fn linear(
        &self,
        x: &Tensor,
        w: &Weight,
        bias: Option<&Tensor>,
        out: &mut Tensor,
    ) -> Result<(), KitError> {
        let (cols, rows) = (w.cols, w.data.len() / w.cols);
        for (xr, or) in x
            .data
            .chunks_exact(cols)
            .zip(out.data.chunks_exact_mut(rows))
        {
            for (r, o) in or.iter_mut().enumerate() {
                let wr = &w.data[r * cols..(r + 1) * cols];
                *o = xr.iter().zip(wr).map(|(a, b)| a * b).sum::<f32>()
                    + bias.map_or(0.0, |b| b.data[r]);
            }
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Tensor,
        heads: usize,
        positions: &[i32],
        inv_freq: &[f32],
        pairs: RopePairs,
    ) -> Result<(), KitError> {
        let head_dim = 2 * inv_freq.len();
        for (row, &p) in x.data.chunks_exact_mut(heads * head_dim).zip(positions) {
            for head in row.chunks_exact_mut(head_dim) {
                for (i, f) in inv_freq.iter().enumerate() {
                    let (a, b) = match pairs {
                        RopePairs::Halves => (i, i + head_dim / 2),
                        RopePairs::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (sin, cos) = (p as f32 * f).sin_cos();
                    let (u, v) = (head[a], head[b]);
                    head[a] = u * cos - v * sin;
                    head[b] = v * cos + u * sin;
                }
            }
        }
        Ok(())
    }

    fn split_heads(&self, x: &Tensor, heads: usize, out: &mut Tensor) -> Result<(), KitError> {
        let (t, d) = (x.dims[0], x.dims[1] / heads);
        for ti in 0..t {
            for h in 0..heads {
                out.data[(h * t + ti) * d..][..d]
                    .copy_from_slice(&x.data[(ti * heads + h) * d..][..d]);
            }
        }
        Ok(())
    }

    fn merge_heads(&self, x: &Tensor, out: &mut Tensor) -> Result<(), KitError> {
        let (heads, t, d) = (x.dims[0], x.dims[1], x.dims[2]);
        for ti in 0..t {
            for h in 0..heads {
                out.data[(ti * heads + h) * d..][..d]
                    .copy_from_slice(&x.data[(h * t + ti) * d..][..d]);
            }
        }
        Ok(())
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<(), KitError> {
        for ((o, g), u) in out.data.iter_mut().zip(&gate.data).zip(&up.data) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
        Ok(())
    }

    fn gelu_tanh_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<(), KitError> {
        let c = (2.0 / std::f32::consts::PI).sqrt();
        for ((o, g), u) in out.data.iter_mut().zip(&gate.data).zip(&up.data) {
            *o = 0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u;
        }
        Ok(())
    }

    fn scale(&self, x: &mut Tensor, s: f32) -> Result<(), KitError> {
        x.data.iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    fn add_assign(&self, x: &mut Tensor, y: &Tensor) -> Result<(), KitError> {
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn gather_rows(&self, x: &Tensor, rows: &[usize], out: &mut Tensor) -> Result<(), KitError> {
        let n = x.dims[1];
        for (o, &r) in out.data.chunks_exact_mut(n).zip(rows) {
            o.copy_from_slice(&x.data[r * n..(r + 1) * n]);
        }
        Ok(())
    }
}

//! The model graph's operations on the cpu: linears through XNNPACK fully-connected
//! operators with weights packed once at load (Rust kernels split over the worker pool
//! without the feature), and plain loops for the element-wise ops.

use kvplug_backend_kit::model::ModelDevice;
use kvplug_backend_kit::KitError;

use crate::simd;
use crate::tensor::CpuTensor;
use crate::workers::{DisjointChunks, Workers};
use crate::CpuDevice;

/// A `[rows, cols]` linear weight.
pub struct CpuWeight {
    rows: usize,
    cols: usize,
    /// Row-major values, kept when no packed operator exists.
    data: Vec<f32>,
    #[cfg(feature = "xnnpack")]
    packed: Option<std::sync::Mutex<crate::xnnpack::FullyConnected>>,
}

/// Output rows per task of the Rust linear.
const ROWS_PER_TASK: usize = 64;

impl CpuWeight {
    fn rust_linear(&self, x: &[f32], t: usize, out: &mut [f32]) {
        // out is [t, rows]; tasks own column blocks of it through a transposed scratch-free
        // split: each task computes its rows for every token.
        let (rows, cols) = (self.rows, self.cols);
        let tasks = rows.div_ceil(ROWS_PER_TASK);
        let out_ptr = DisjointChunks::new(out, 1);
        let job = |task: usize| {
            let r0 = task * ROWS_PER_TASK;
            for r in r0..(r0 + ROWS_PER_TASK).min(rows) {
                let w = &self.data[r * cols..(r + 1) * cols];
                for ti in 0..t {
                    // SAFETY: element (ti, r) belongs to this task's rows only.
                    unsafe {
                        out_ptr.get(ti * rows + r)[0] =
                            simd::dot_f32(&x[ti * cols..(ti + 1) * cols], w)
                    };
                }
            }
        };
        Workers::global().run(tasks, &job);
    }
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

    fn weight(&self, data: &[f32], rows: usize, cols: usize) -> Result<CpuWeight, KitError> {
        check(data.len() == rows * cols, "weight")?;
        #[cfg(feature = "xnnpack")]
        if crate::xnnpack::available().is_ok() {
            match crate::xnnpack::FullyConnected::new(cols, rows, data, false) {
                Ok(fc) => {
                    return Ok(CpuWeight {
                        rows,
                        cols,
                        data: Vec::new(),
                        packed: Some(std::sync::Mutex::new(fc)),
                    })
                }
                Err(e) => tracing::debug!(
                    "xnnpack could not pack a {rows}x{cols} weight ({e}); using the Rust linear"
                ),
            }
        }
        Ok(CpuWeight {
            rows,
            cols,
            data: data.to_vec(),
            #[cfg(feature = "xnnpack")]
            packed: None,
        })
    }

    fn tensor(&self, data: &[f32], dims: &[usize]) -> Result<CpuTensor, KitError> {
        check(dims.iter().product::<usize>() == data.len(), "tensor")?;
        Ok(CpuTensor::new(dims, data.to_vec()))
    }

    fn embed(&self, table: &CpuTensor, ids: &[i32], out: &mut CpuTensor) -> Result<(), KitError> {
        let h = table.dims[1];
        for (row, &id) in out.data.chunks_exact_mut(h).zip(ids) {
            row.copy_from_slice(&table.data[id as usize * h..(id as usize + 1) * h]);
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
        let t = x.dims[0];
        check(x.dims[1] == w.cols && out.dims == [t, w.rows], "linear")?;
        #[cfg(feature = "xnnpack")]
        let done = match &w.packed {
            Some(fc) => {
                let fc = fc.lock().map_err(|_| {
                    KitError::Device("a linear operator was poisoned by a panic".into())
                })?;
                fc.run(t, &x.data, &mut out.data)
                    .map_err(KitError::Device)?;
                true
            }
            None => false,
        };
        #[cfg(not(feature = "xnnpack"))]
        let done = false;
        if !done {
            w.rust_linear(&x.data, t, &mut out.data);
        }
        if let Some(b) = bias {
            for row in out.data.chunks_exact_mut(w.rows) {
                row.iter_mut().zip(&b.data).for_each(|(o, b)| *o += b);
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
    ) -> Result<(), KitError> {
        let hd = 2 * inv_freq.len();
        let width = heads * hd;
        for (row, &p) in x.data.chunks_exact_mut(width).zip(positions) {
            for head in row.chunks_exact_mut(hd) {
                let (a, b) = head.split_at_mut(hd / 2);
                for ((x1, x2), &f) in a.iter_mut().zip(b.iter_mut()).zip(inv_freq) {
                    let (sin, cos) = (p as f32 * f).sin_cos();
                    let (u, v) = (*x1, *x2);
                    *x1 = u * cos - v * sin;
                    *x2 = v * cos + u * sin;
                }
            }
        }
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

    fn silu_mul(
        &self,
        gate: &CpuTensor,
        up: &CpuTensor,
        out: &mut CpuTensor,
    ) -> Result<(), KitError> {
        for ((o, &g), &u) in out.data.iter_mut().zip(&gate.data).zip(&up.data) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
        Ok(())
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<(), KitError> {
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
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

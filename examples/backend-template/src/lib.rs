//! # kvplug-backend-template
//!
//! A complete kvplug backend in plain safe Rust, written to be copied: every method of
//! [`Device`] and [`Backend`] the kit has no default for, the simplest way that meets its
//! contract, on one host thread. It builds every cache kind (`contiguous`, `seq`, `tree`)
//! with f32, f16 and bf16 KV, and serves models: [`model`] implements the kit's
//! `ModelDevice`, so `export_backend!(…, models)` gives it the `forward` method.
//!
//! Pools keep their rows in the canonical row form itself (`[heads, cells, row_bytes]`,
//! values little-endian), so [`Device::read_rows`] and [`Device::write_rows`] are copies
//! and the storage dtype's rounding is applied exactly once, when a row is written.
//! `write_run` and `zeros` keep the kit's defaults (a scatter to consecutive rows; an
//! upload of zeros).

use half::{bf16, f16};
use kvplug_backend_kit::model::blocks::{weights_features, BLOCK_FORMATS};
use kvplug_backend_kit::{AttendMask, Backend, Device, KitError};
use kvplug_core::{Arithmetic, KvDtype};
use kvplug_plugin_api::{HostTensor, TensorDtype};

pub mod model;

/// The device: nothing to hold, everything is computed on the calling thread.
pub struct TemplateDevice;

/// An activation tensor: f32 values, row-major.
pub struct Tensor {
    dims: Vec<usize>,
    data: Vec<f32>,
}

/// One layer's K or V rows, `[heads, cells, row_bytes]` in the canonical row form.
pub struct Pool {
    dtype: KvDtype,
    heads: usize,
    head_dim: usize,
    cells: usize,
    bytes: Vec<u8>,
}

impl Pool {
    fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.head_dim)
    }

    /// The bytes of `cell`'s row of head `h`.
    fn row(&self, h: usize, cell: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.bytes[(h * self.cells + cell) * n..][..n]
    }

    fn row_mut(&mut self, h: usize, cell: usize) -> &mut [u8] {
        let n = self.row_bytes();
        &mut self.bytes[(h * self.cells + cell) * n..][..n]
    }

    /// Stores `x` in `cell`'s row of head `h`, rounded to the pool's dtype.
    fn store(&mut self, h: usize, cell: usize, x: &[f32]) {
        let dtype = self.dtype;
        let row = self.row_mut(h, cell);
        match dtype {
            KvDtype::F32 => {
                for (b, v) in row.chunks_exact_mut(4).zip(x) {
                    b.copy_from_slice(&v.to_le_bytes());
                }
            }
            KvDtype::F16 => {
                for (b, v) in row.chunks_exact_mut(2).zip(x) {
                    b.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
                }
            }
            KvDtype::Bf16 => {
                for (b, v) in row.chunks_exact_mut(2).zip(x) {
                    b.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
                }
            }
            KvDtype::Q8 { .. } | KvDtype::Q4 { .. } => unreachable!("pool_new refuses {dtype}"),
        }
    }

    /// The values of `cell`'s row of head `h`, into `out`.
    fn load(&self, h: usize, cell: usize, out: &mut [f32]) {
        let row = self.row(h, cell);
        match self.dtype {
            KvDtype::F32 => {
                for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            KvDtype::F16 => {
                for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            KvDtype::Bf16 => {
                for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            KvDtype::Q8 { .. } | KvDtype::Q4 { .. } => unreachable!("pool_new refuses them"),
        }
    }
}

/// The KV dtypes this device stores.
const KV_DTYPES: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16];

impl Device for TemplateDevice {
    type Tensor = Tensor;
    type Pool = Pool;
    /// Attention scores of one query, reused across calls.
    type Scratch = Vec<f32>;

    fn kv_dtypes(&self) -> &[KvDtype] {
        &KV_DTYPES
    }

    fn dims<'t>(&self, t: &'t Tensor) -> &'t [usize] {
        &t.dims
    }

    fn pool_new(
        &self,
        dtype: KvDtype,
        heads: usize,
        head_dim: usize,
        cells: usize,
    ) -> Result<Pool, KitError> {
        // Matched by family, as the host matches `kv_dtypes` (a device listing q8 would get
        // every group size: q8g16, q8g32, ...).
        if !KV_DTYPES.iter().any(|d| d.family() == dtype.family()) {
            return Err(KitError::Device(format!("no {dtype} pools on this device")));
        }
        let bytes = heads
            .checked_mul(cells)
            .and_then(|n| n.checked_mul(dtype.row_bytes(head_dim)))
            .ok_or_else(|| KitError::Device("pool size overflows".into()))?;
        Ok(Pool {
            dtype,
            heads,
            head_dim,
            cells,
            bytes: vec![0; bytes],
        })
    }

    fn pool_grow(&self, pool: &mut Pool, cells: usize, keep: usize) -> Result<(), KitError> {
        let mut grown = self.pool_new(pool.dtype, pool.heads, pool.head_dim, cells)?;
        let kept = keep * pool.row_bytes();
        for h in 0..pool.heads {
            let from = h * pool.cells * pool.row_bytes();
            let to = h * cells * pool.row_bytes();
            grown.bytes[to..to + kept].copy_from_slice(&pool.bytes[from..from + kept]);
        }
        *pool = grown;
        Ok(())
    }

    fn pool_bytes(&self, pool: &Pool) -> usize {
        pool.bytes.len()
    }

    fn scatter_rows(&self, pool: &mut Pool, cells: &[u32], src: &Tensor) -> Result<(), KitError> {
        let (heads, t, d) = (src.dims[0], src.dims[1], src.dims[2]);
        for h in 0..heads {
            for (i, &c) in cells.iter().enumerate() {
                pool.store(h, c as usize, &src.data[(h * t + i) * d..][..d]);
            }
        }
        Ok(())
    }

    fn read_rows(&self, pool: &Pool, cells: &[u32]) -> Result<Vec<u8>, KitError> {
        let mut out = Vec::with_capacity(pool.heads * cells.len() * pool.row_bytes());
        for h in 0..pool.heads {
            for &c in cells {
                out.extend_from_slice(pool.row(h, c as usize));
            }
        }
        Ok(out)
    }

    fn write_rows(&self, pool: &mut Pool, cells: &[u32], rows: &[u8]) -> Result<(), KitError> {
        let n = pool.row_bytes();
        for h in 0..pool.heads {
            for (i, &c) in cells.iter().enumerate() {
                let at = (h * cells.len() + i) * n;
                pool.row_mut(h, c as usize)
                    .copy_from_slice(&rows[at..at + n]);
            }
        }
        Ok(())
    }

    fn move_rows(&self, pool: &mut Pool, base: usize, rows: &[u32]) {
        let n = pool.row_bytes();
        for h in 0..pool.heads {
            for (i, &r) in rows.iter().enumerate() {
                let from = (h * pool.cells + r as usize) * n;
                let to = (h * pool.cells + base + i) * n;
                pool.bytes.copy_within(from..from + n, to);
            }
        }
    }

    fn attend(
        &self,
        _arithmetic: Arithmetic,
        q: &Tensor,
        k: &Pool,
        v: &Pool,
        read_len: usize,
        mask: AttendMask<'_>,
        scale: f32,
        out: &mut Tensor,
        scores: &mut Vec<f32>,
    ) -> Result<(), KitError> {
        attend(q, k, v, read_len, mask, scale, None, out, scores)
    }

    fn attend_sinks(
        &self,
        _arithmetic: Arithmetic,
        q: &Tensor,
        k: &Pool,
        v: &Pool,
        read_len: usize,
        mask: AttendMask<'_>,
        scale: f32,
        sinks: &Tensor,
        out: &mut Tensor,
        scores: &mut Vec<f32>,
    ) -> Result<(), KitError> {
        if sinks.data.len() != q.dims[0] {
            return Err(KitError::Device(format!(
                "{} sinks for {} query heads",
                sinks.data.len(),
                q.dims[0]
            )));
        }
        attend(
            q,
            k,
            v,
            read_len,
            mask,
            scale,
            Some(&sinks.data),
            out,
            scores,
        )
    }

    fn upload(&self, t: &HostTensor) -> Result<Tensor, KitError> {
        let data = t.to_f32().ok_or_else(|| {
            KitError::Device(format!("cannot upload a {} tensor", t.dtype.as_str()))
        })?;
        Ok(Tensor {
            dims: t.dims(),
            data,
        })
    }

    fn download(&self, t: &Tensor, dtype: TensorDtype) -> Result<HostTensor, KitError> {
        HostTensor::encode_f32(&t.dims, &t.data, dtype)
            .ok_or_else(|| KitError::Device(format!("cannot download as {}", dtype.as_str())))
    }
}

impl Backend for TemplateDevice {
    const ID: &'static str = "template";
    const NAME: &'static str = "Template (plain Rust reference backend)";

    fn open() -> Result<Self, String> {
        Ok(TemplateDevice)
    }

    fn device_description(&self) -> String {
        "host CPU, one thread, plain Rust".into()
    }

    /// Every stored weight dtype, block formats widened at load.
    fn features(&self) -> Vec<String> {
        let mut f = weights_features(&BLOCK_FORMATS);
        f.push("attention-sinks".into());
        f
    }
}

kvplug_backend_kit::export_backend!(TemplateDevice, models);

/// `out = softmax(q·kᵀ·scale + mask)·v`, each row's softmax sum also counting
/// `e^{sinks[h]}` for its query head `h` where sinks are given; a query that sees no key
/// reads zeros.
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &Tensor,
    k: &Pool,
    v: &Pool,
    read_len: usize,
    mask: AttendMask<'_>,
    scale: f32,
    sinks: Option<&[f32]>,
    out: &mut Tensor,
    scores: &mut Vec<f32>,
) -> Result<(), KitError> {
    let (hq, t, d) = (q.dims[0], q.dims[1], q.dims[2]);
    let group = hq / k.heads;
    let (mut key, mut value) = (vec![0.0; d], vec![0.0; d]);
    for h in 0..hq {
        let kh = h / group;
        for i in 0..t {
            let query = &q.data[(h * t + i) * d..][..d];
            let o = &mut out.data[(h * t + i) * d..][..d];
            o.fill(0.0);
            // Scores of the keys query i sees (lower-right aligned for Causal).
            scores.clear();
            for j in 0..read_len {
                let sees = match mask {
                    AttendMask::None => true,
                    AttendMask::Causal => j + t <= read_len + i,
                    AttendMask::Explicit(m) => m[i * read_len + j],
                };
                if sees {
                    k.load(kh, j, &mut key);
                    let dot: f32 = query.iter().zip(&key).map(|(a, b)| a * b).sum();
                    scores.push(dot * scale);
                } else {
                    scores.push(f32::NEG_INFINITY);
                }
            }
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if max == f32::NEG_INFINITY {
                continue; // A query that sees no key reads zeros.
            }
            // A sink is one more weight, of a value that is zero.
            let mut total = sinks.map_or(0.0, |s| (s[h] - max).exp());
            for (j, s) in scores.iter().enumerate() {
                if *s == f32::NEG_INFINITY {
                    continue;
                }
                let w = (s - max).exp();
                total += w;
                v.load(kh, j, &mut value);
                for (o, x) in o.iter_mut().zip(&value) {
                    *o += w * x;
                }
            }
            for o in o.iter_mut() {
                *o /= total;
            }
        }
    }
    Ok(())
}

//! [`MlxDevice`]: the kit's [`Device`] over MLX arrays.
//!
//! - Pools are MLX arrays, SDPA-major `[heads, cells, row]`: f32 / f16 / bf16 rows as such;
//!   q8 / q4 as three arrays in core's affine format (codes packed little-endian into u32
//!   words, which is MLX's own packing, plus f16 scales and offsets per group).
//! - Writes are `slice_update` / `scatter` on the pool's only handle, so MLX donates the
//!   buffer and writes in place: no step copies history.
//! - Attention reads the window `[0, read_len)`: `fast::scaled_dot_product_attention` for
//!   float pools (causal mode, or an explicit boolean mask), and for quantized pools
//!   `quantized_matmul` over the codes (dequantization fused into both products) around a
//!   masked softmax; groups MLX's kernels lack (only 32, 64 and 128 exist) dequantize each
//!   head's window first.
//! - Evaluation is lazy: a step's writes, attention and model ops form one graph, evaluated
//!   when its result is downloaded (the step boundary). Operations that are not part of a step
//!   (growth, restore, tree commit) evaluate at once.

use std::sync::{Mutex, MutexGuard};

use cxx::UniquePtr;
use kvplug_backend_kit::{AttendMask, Backend, Device, KitError};
use kvplug_core::{Arithmetic, CacheError, KvDtype};
use kvplug_plugin_api::{HostTensor, TensorDtype};

use crate::ffi::{self, dtype, Array};

/// An f32 activation tensor (possibly an unevaluated graph node).
pub struct MlxTensor {
    pub(crate) a: UniquePtr<Array>,
    pub(crate) dims: Vec<usize>,
}

/// One layer's K or V pool: one array for float rows; codes, scales and offsets for
/// quantized rows. Every part is `[heads, cells, ...]`.
pub struct MlxPool {
    dtype: KvDtype,
    heads: usize,
    head_dim: usize,
    cells: usize,
    parts: Vec<UniquePtr<Array>>,
}

/// The MLX device (MLX's default: the GPU on Apple silicon, the CPU elsewhere).
pub struct MlxDevice {
    /// MLX's graph construction is not documented as thread-safe: one call at a time.
    lock: Mutex<()>,
    /// A failure of an infallible operation, reported by the next fallible one.
    deferred: Mutex<Option<String>>,
    description: String,
    /// Whether MLX runs on a GPU (Metal); else on the CPU, where MLX has no f16/bf16 GEMM.
    pub(crate) gpu: bool,
    /// Whether the affine block formats stay quantized (`quantized_matmul`) rather than being
    /// widened at load: by default on a GPU only (see [`crate::model`]).
    pub(crate) quantized_weights: bool,
}

impl MlxDevice {
    /// This device with the affine block formats kept quantized (`on`) or widened to f32 at
    /// load, whatever the device's default (see [`crate::model`]).
    pub fn with_quantized_weights(mut self, on: bool) -> Self {
        self.quantized_weights = on;
        self
    }
}

pub(crate) fn err(e: cxx::Exception) -> KitError {
    KitError::Device(format!("MLX: {}", e.what()))
}

pub(crate) fn shape(dims: &[usize]) -> Vec<i32> {
    dims.iter().map(|&d| d as i32).collect()
}

pub(crate) fn indices(v: impl IntoIterator<Item = usize>) -> Vec<i32> {
    v.into_iter().map(|i| i as i32).collect()
}

fn cells_i32(cells: &[u32]) -> Vec<i32> {
    cells.iter().map(|&c| c as i32).collect()
}

impl MlxDevice {
    /// Takes the MLX lock, first surfacing a deferred failure.
    pub(crate) fn enter(&self) -> Result<MutexGuard<'_, ()>, KitError> {
        let guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let deferred = self
            .deferred
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match deferred {
            Some(e) => Err(KitError::Device(e)),
            None => Ok(guard),
        }
    }

    /// Bytes MLX's live buffers hold now.
    pub fn active_memory(&self) -> usize {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        ffi::active_memory()
    }

    /// The most bytes MLX's buffers have held at once since the last
    /// [`MlxDevice::reset_peak_memory`] (or since start): what a workload really needs,
    /// transients included.
    pub fn peak_memory(&self) -> usize {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        ffi::peak_memory()
    }

    /// Starts a new [`MlxDevice::peak_memory`] window.
    pub fn reset_peak_memory(&self) {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        ffi::reset_peak_memory()
    }

    /// Row widths of a pool's parts and their element types.
    fn layout(dtype: KvDtype, d: usize) -> Vec<(usize, u8)> {
        match dtype {
            KvDtype::F32 => vec![(d, dtype::F32)],
            KvDtype::F16 => vec![(d, dtype::F16)],
            KvDtype::Bf16 => vec![(d, dtype::BF16)],
            KvDtype::Q8 { group } | KvDtype::Q4 { group } => {
                let bits = dtype.quant().expect("quantized").0 as usize;
                vec![
                    (d * bits / 32, dtype::U32),
                    (d / group, dtype::F16),
                    (d / group, dtype::F16),
                ]
            }
        }
    }

    fn write(&self, pool: &mut MlxPool, cells: &[i32], src: &MlxTensor) -> Result<(), KitError> {
        let _g = self.enter()?;
        match pool.dtype.quant() {
            None => ffi::put_rows(pool.parts[0].pin_mut(), cells, &src.a).map_err(err),
            Some((bits, group)) => {
                let q = ffi::quantize(&src.a, bits as i32, group as i32).map_err(err)?;
                for (part, rows) in pool.parts.iter_mut().zip([&q.codes, &q.scales, &q.los]) {
                    ffi::put_rows(part.pin_mut(), cells, rows).map_err(err)?;
                }
                Ok(())
            }
        }
    }
}

impl Device for MlxDevice {
    type Tensor = MlxTensor;
    type Pool = MlxPool;
    type Scratch = ();

    fn kv_dtypes(&self) -> &[KvDtype] {
        &KvDtype::ALL
    }

    fn dims<'t>(&self, t: &'t MlxTensor) -> &'t [usize] {
        &t.dims
    }

    fn pool_new(
        &self,
        dtype: KvDtype,
        heads: usize,
        head_dim: usize,
        cells: usize,
    ) -> Result<MlxPool, KitError> {
        if let Some((bits, _)) = dtype.quant() {
            if head_dim * bits as usize % 32 != 0 {
                return Err(CacheError::bad_config(format!(
                    "mlx {dtype} pools pack codes into u32 words: head_dim {head_dim} must be a multiple of {}",
                    32 / bits
                ))
                .into());
            }
        }
        let _g = self.enter()?;
        let parts = Self::layout(dtype, head_dim)
            .into_iter()
            .map(|(width, code)| ffi::pool_zeros(&shape(&[heads, cells, width]), code))
            .collect::<Result<_, _>>()
            .map_err(err)?;
        Ok(MlxPool {
            dtype,
            heads,
            head_dim,
            cells,
            parts,
        })
    }

    fn pool_grow(&self, pool: &mut MlxPool, cells: usize, keep: usize) -> Result<(), KitError> {
        let _g = self.enter()?;
        let grown = pool
            .parts
            .iter()
            .map(|p| ffi::regrown(p, cells as i32, keep as i32))
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        pool.parts = grown;
        pool.cells = cells;
        Ok(())
    }

    fn pool_bytes(&self, pool: &MlxPool) -> usize {
        pool.parts.iter().map(|p| ffi::nbytes(p)).sum()
    }

    fn write_run(&self, pool: &mut MlxPool, start: usize, src: &MlxTensor) -> Result<(), KitError> {
        self.write(pool, &indices(start..start + src.dims[1]), src)
    }

    fn scatter_rows(
        &self,
        pool: &mut MlxPool,
        cells: &[u32],
        src: &MlxTensor,
    ) -> Result<(), KitError> {
        self.write(pool, &cells_i32(cells), src)
    }

    fn read_rows(&self, pool: &MlxPool, cells: &[u32]) -> Result<Vec<u8>, KitError> {
        let _g = self.enter()?;
        let n = pool.heads * cells.len();
        let idx = cells_i32(cells);
        // Each part's rows, `[heads, cells, part bytes]`.
        let mut parts = Vec::with_capacity(pool.parts.len());
        for (p, (width, code)) in pool
            .parts
            .iter()
            .zip(Self::layout(pool.dtype, pool.head_dim))
        {
            let size = if code == dtype::F32 || code == dtype::U32 {
                4
            } else {
                2
            };
            let mut bytes = vec![0u8; n * width * size];
            let rows = ffi::take_rows(p, &idx).map_err(err)?;
            ffi::read_bytes(&rows, &mut bytes).map_err(err)?;
            parts.push((bytes, width * size));
        }
        if let [(rows, _)] = &mut parts[..] {
            return Ok(std::mem::take(rows));
        }
        // Canonical quantized row: codes, then an f16 (scale, lo) pair per group.
        let [(codes, cb), (scales, sb), (los, _)] = &parts[..] else {
            unreachable!("quantized pools have three parts")
        };
        let mut out = Vec::with_capacity(n * pool.dtype.row_bytes(pool.head_dim));
        for r in 0..n {
            out.extend_from_slice(&codes[r * cb..(r + 1) * cb]);
            let (s, l) = (&scales[r * sb..(r + 1) * sb], &los[r * sb..(r + 1) * sb]);
            for (s, l) in s.chunks_exact(2).zip(l.chunks_exact(2)) {
                out.extend_from_slice(s);
                out.extend_from_slice(l);
            }
        }
        Ok(out)
    }

    fn write_rows(&self, pool: &mut MlxPool, cells: &[u32], rows: &[u8]) -> Result<(), KitError> {
        let _g = self.enter()?;
        let (n, idx) = (cells.len(), cells_i32(cells));
        let layout = Self::layout(pool.dtype, pool.head_dim);
        let row = pool.dtype.row_bytes(pool.head_dim);
        let parts: Vec<Vec<u8>> = match pool.dtype.quant() {
            None => vec![rows.to_vec()],
            Some(_) => {
                let cb = layout[0].0 * 4;
                let (mut codes, mut scales, mut los) = (Vec::new(), Vec::new(), Vec::new());
                for r in rows.chunks_exact(row) {
                    codes.extend_from_slice(&r[..cb]);
                    for pair in r[cb..].chunks_exact(4) {
                        scales.extend_from_slice(&pair[..2]);
                        los.extend_from_slice(&pair[2..]);
                    }
                }
                vec![codes, scales, los]
            }
        };
        for ((part, bytes), (width, code)) in pool.parts.iter_mut().zip(&parts).zip(layout) {
            let src = ffi::from_bytes(bytes, &shape(&[pool.heads, n, width]), code).map_err(err)?;
            ffi::put_rows(part.pin_mut(), &idx, &src).map_err(err)?;
            ffi::eval(part).map_err(err)?;
        }
        Ok(())
    }

    fn move_rows(&self, pool: &mut MlxPool, base: usize, rows: &[u32]) {
        if rows.is_empty() {
            return;
        }
        let Ok(_g) = self.enter() else {
            return; // the deferred failure stays reported by the next call
        };
        let (src, dst) = (cells_i32(rows), indices(base..base + rows.len()));
        let moved = pool.parts.iter_mut().try_for_each(|part| {
            let picked = ffi::take_rows(part, &src)?;
            ffi::put_rows(part.pin_mut(), &dst, &picked)?;
            ffi::eval(part)
        });
        if let Err(e) = moved {
            *self.deferred.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(format!("MLX (moving rows): {}", e.what()));
        }
    }

    fn attend(
        &self,
        _arithmetic: Arithmetic,
        q: &MlxTensor,
        k: &MlxPool,
        v: &MlxPool,
        read_len: usize,
        mask: AttendMask<'_>,
        scale: f32,
        out: &mut MlxTensor,
        _scratch: &mut (),
    ) -> Result<(), KitError> {
        self.attention(q, k, v, (read_len, mask, scale, None), out)
    }

    fn attend_sinks(
        &self,
        _arithmetic: Arithmetic,
        q: &MlxTensor,
        k: &MlxPool,
        v: &MlxPool,
        read_len: usize,
        mask: AttendMask<'_>,
        scale: f32,
        sinks: &MlxTensor,
        out: &mut MlxTensor,
        _scratch: &mut (),
    ) -> Result<(), KitError> {
        if sinks.dims != [q.dims[0]] {
            return Err(CacheError::bad_shape(format!(
                "sinks of shape {:?} for {} query heads",
                sinks.dims, q.dims[0]
            ))
            .into());
        }
        self.attention(q, k, v, (read_len, mask, scale, Some(sinks)), out)
    }

    fn zeros(&self, dims: &[usize]) -> Result<MlxTensor, KitError> {
        let _g = self.enter()?;
        Ok(MlxTensor {
            a: ffi::zeros(&shape(dims), dtype::F32).map_err(err)?,
            dims: dims.to_vec(),
        })
    }

    fn upload(&self, t: &HostTensor) -> Result<MlxTensor, KitError> {
        let data = t.to_f32().ok_or_else(|| {
            CacheError::bad_shape(format!(
                "cannot upload a {} tensor as activations",
                t.dtype.as_str()
            ))
        })?;
        let dims = t.dims();
        let _g = self.enter()?;
        let a =
            ffi::from_bytes(bytemuck::cast_slice(&data), &shape(&dims), dtype::F32).map_err(err)?;
        Ok(MlxTensor { a, dims })
    }

    fn download(&self, t: &MlxTensor, dtype: TensorDtype) -> Result<HostTensor, KitError> {
        let mut data = vec![0f32; t.dims.iter().product()];
        {
            let _g = self.enter()?;
            let f = ffi::astype(&t.a, dtype::F32).map_err(err)?;
            ffi::read_bytes(&f, bytemuck::cast_slice_mut(&mut data)).map_err(err)?;
        }
        HostTensor::encode_f32(&t.dims, &data, dtype)
            .ok_or_else(|| CacheError::bad_shape("cannot download activations as i32").into())
    }
}

impl Backend for MlxDevice {
    const ID: &'static str = "mlx";
    const NAME: &'static str = "kvplug MLX backend";

    fn open() -> Result<Self, String> {
        let mut description = String::new();
        ffi::describe_device(&mut description).map_err(|e| e.what().to_string())?;
        let gpu = ffi::default_device_is_gpu();
        Ok(MlxDevice {
            lock: Mutex::new(()),
            deferred: Mutex::new(None),
            description,
            gpu,
            quantized_weights: gpu,
        })
    }

    fn device_description(&self) -> String {
        self.description.clone()
    }

    fn features(&self) -> Vec<String> {
        let mut f = kvplug_backend_kit::model::blocks::weights_features(crate::model::widened(
            self.quantized_weights,
        ));
        f.push("attention-sinks".into());
        f
    }
}

impl MlxDevice {
    /// [`Device::attend`], with the sinks of [`Device::attend_sinks`] where given: `call`
    /// is (read_len, mask, scale, sinks).
    #[allow(clippy::type_complexity)]
    fn attention(
        &self,
        q: &MlxTensor,
        k: &MlxPool,
        v: &MlxPool,
        call: (usize, AttendMask<'_>, f32, Option<&MlxTensor>),
        out: &mut MlxTensor,
    ) -> Result<(), KitError> {
        let (read_len, mask, scale, sinks) = call;
        let _g = self.enter()?;
        // Without sinks the bridge is handed q and told there are none.
        let (sink, has) = (sinks.map_or(&q.a, |s| &s.a), sinks.is_some());
        let (kind, bits): (u8, &[u8]) = match mask {
            AttendMask::None => (0, &[]),
            AttendMask::Causal => (1, &[]),
            // SAFETY: bool is one byte holding 0 or 1.
            AttendMask::Explicit(m) => (2, unsafe {
                std::slice::from_raw_parts(m.as_ptr().cast::<u8>(), m.len())
            }),
        };
        let l = read_len as i32;
        out.a = match k.dtype.quant() {
            None => ffi::attend(
                &q.a,
                &k.parts[0],
                &v.parts[0],
                l,
                kind,
                bits,
                scale,
                sink,
                has,
            ),
            Some((b, group)) => {
                let (kp, vp) = (&k.parts, &v.parts);
                ffi::attend_quant(
                    &q.a,
                    &kp[0],
                    &kp[1],
                    &kp[2],
                    &vp[0],
                    &vp[1],
                    &vp[2],
                    l,
                    kind,
                    bits,
                    scale,
                    b as i32,
                    group as i32,
                    sink,
                    has,
                )
            }
        }
        .map_err(err)?;
        Ok(())
    }
}

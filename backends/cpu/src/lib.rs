//! # kvplug-cpu
//!
//! The `cpu` backend: the kit's [`Device`] over host memory. Pools are SDPA-major
//! `[heads, cells, head_dim]` in f32 / f16 / bf16 / q8 / q4; attention runs a tiled
//! AVX-512 or AVX2/FMA/F16C kernel (XNNPACK and a scalar row kernel elsewhere) and splits
//! long windows over KV heads on both cores. Exported as a plugin with one line; also usable as an rlib.
//!
//! Off x86-64 only the portable kernels exist, and the helpers the vector kernels share are
//! left unused there.

// A backend's docs are read with its private items (`cargo doc --document-private-items`),
// which its public items' docs link to.
#![allow(rustdoc::private_intra_doc_links)]
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

pub mod attention;
pub mod linear;
pub mod model;
pub mod pool;
pub mod qlinear;
pub mod simd;
pub mod tensor;
pub mod tiled_attention;
pub mod workers;
#[cfg(all(feature = "xnnpack", target_os = "linux"))]
pub mod xnnpack;

use kvplug_backend_kit::{AttendMask, Backend, Device, KitError};
use kvplug_core::{Arithmetic, CacheError, KvDtype};
use kvplug_plugin_api::{HostTensor, TensorDtype};

use crate::attention::CpuScratch;
use crate::pool::CpuPool;
use crate::tensor::CpuTensor;

/// The CPU device. Stateless: host memory needs no context.
#[derive(Debug, Default)]
pub struct CpuDevice {
    features: simd::Features,
}

impl CpuDevice {
    /// The device with the features of this CPU.
    pub fn new() -> Self {
        CpuDevice::default()
    }
}

impl Device for CpuDevice {
    type Tensor = CpuTensor;
    type Pool = CpuPool;
    type Scratch = CpuScratch;

    fn kv_dtypes(&self) -> &[KvDtype] {
        &KvDtype::ALL
    }

    /// For q8/q4 pools in groups of a multiple of 32, where the tiled kernel runs (AVX2;
    /// its int8 scores are used for `head_dim` a multiple of 64, with VNNI where the CPU has
    /// AVX-512): int8-query scores first (the default: `kvplug bench -p 0 -n 32 -d 4096`
    /// measured it 1.08–1.18× f32's decode on SmolLM2 with q8 KV, and its next-token
    /// agreement with f16 KV is within a few positions of f32's, BENCH.md), then those
    /// scores with the value sum in i16 weight codes (for fork and tree steps, whose many
    /// query rows share each value row), then f32. Otherwise f32 alone.
    fn arithmetics(&self, dtype: KvDtype) -> Vec<Arithmetic> {
        let grouped = match dtype {
            KvDtype::Q8 { group } | KvDtype::Q4 { group } => {
                group.is_multiple_of(kvplug_core::arithmetic::QUERY_BLOCK)
            }
            _ => false,
        };
        if grouped && simd::vector_path() {
            vec![
                Arithmetic::Int8Query,
                Arithmetic::Int8QueryI16Values,
                Arithmetic::F32,
            ]
        } else {
            Vec::new()
        }
    }

    fn dims<'t>(&self, t: &'t CpuTensor) -> &'t [usize] {
        &t.dims
    }

    fn pool_new(
        &self,
        dtype: KvDtype,
        heads: usize,
        head_dim: usize,
        cells: usize,
    ) -> Result<CpuPool, KitError> {
        CpuPool::new(dtype, heads, head_dim, cells)
    }

    fn pool_grow(&self, pool: &mut CpuPool, cells: usize, keep: usize) -> Result<(), KitError> {
        pool.grow(cells, keep)
    }

    fn pool_bytes(&self, pool: &CpuPool) -> usize {
        pool.bytes()
    }

    fn write_run(&self, pool: &mut CpuPool, start: usize, src: &CpuTensor) -> Result<(), KitError> {
        let (h, t, d) = (src.dims[0], src.dims[1], src.dims[2]);
        for hi in 0..h {
            for i in 0..t {
                pool.write_row(
                    hi,
                    start + i,
                    &src.data[(hi * t + i) * d..(hi * t + i + 1) * d],
                );
            }
        }
        Ok(())
    }

    fn scatter_rows(
        &self,
        pool: &mut CpuPool,
        cells: &[u32],
        src: &CpuTensor,
    ) -> Result<(), KitError> {
        let (h, t, d) = (src.dims[0], src.dims[1], src.dims[2]);
        for hi in 0..h {
            for (i, &c) in cells.iter().enumerate().take(t) {
                pool.write_row(
                    hi,
                    c as usize,
                    &src.data[(hi * t + i) * d..(hi * t + i + 1) * d],
                );
            }
        }
        Ok(())
    }

    fn read_rows(&self, pool: &CpuPool, cells: &[u32]) -> Result<Vec<u8>, KitError> {
        let row = pool.storage_dtype().row_bytes(pool.head_dim);
        let mut out = Vec::with_capacity(pool.heads * cells.len() * row);
        for h in 0..pool.heads {
            for (c, n) in runs(cells) {
                pool.read_canonical(h, c, n, &mut out);
            }
        }
        Ok(out)
    }

    fn write_rows(&self, pool: &mut CpuPool, cells: &[u32], rows: &[u8]) -> Result<(), KitError> {
        let row = pool.storage_dtype().row_bytes(pool.head_dim);
        let mut at = 0;
        for h in 0..pool.heads {
            for (c, n) in runs(cells) {
                pool.write_canonical(h, c, n, &rows[at..at + n * row]);
                at += n * row;
            }
        }
        Ok(())
    }

    fn move_rows(&self, pool: &mut CpuPool, base: usize, rows: &[u32]) {
        for h in 0..pool.heads {
            for (i, &r) in rows.iter().enumerate() {
                pool.copy_row(h, r as usize, base + i);
            }
        }
    }

    fn attend(
        &self,
        arithmetic: Arithmetic,
        q: &CpuTensor,
        k: &CpuPool,
        v: &CpuPool,
        read_len: usize,
        mask: AttendMask<'_>,
        scale: f32,
        out: &mut CpuTensor,
        scratch: &mut CpuScratch,
    ) -> Result<(), KitError> {
        attention::attend(
            arithmetic, q, k, v, read_len, mask, scale, None, out, scratch,
        );
        Ok(())
    }

    fn attend_sinks(
        &self,
        arithmetic: Arithmetic,
        q: &CpuTensor,
        k: &CpuPool,
        v: &CpuPool,
        read_len: usize,
        mask: AttendMask<'_>,
        scale: f32,
        sinks: &CpuTensor,
        out: &mut CpuTensor,
        scratch: &mut CpuScratch,
    ) -> Result<(), KitError> {
        if sinks.data.len() != q.dims[0] {
            return Err(CacheError::bad_shape(format!(
                "{} attention sinks for {} query heads",
                sinks.data.len(),
                q.dims[0]
            ))
            .into());
        }
        let sinks = Some(&sinks.data[..]);
        attention::attend(
            arithmetic, q, k, v, read_len, mask, scale, sinks, out, scratch,
        );
        Ok(())
    }

    fn zeros(&self, dims: &[usize]) -> Result<CpuTensor, KitError> {
        Ok(CpuTensor::zeros(dims))
    }

    fn upload(&self, t: &HostTensor) -> Result<CpuTensor, KitError> {
        let data = t.to_f32().ok_or_else(|| {
            CacheError::bad_shape(format!(
                "cannot upload a {} tensor as activations",
                t.dtype.as_str()
            ))
        })?;
        Ok(CpuTensor::new(&t.dims(), data))
    }

    fn upload_into(&self, t: &HostTensor, out: &mut CpuTensor) -> Result<(), KitError> {
        t.check().map_err(CacheError::bad_shape)?;
        if !t.read_f32_into(&mut out.data) {
            return Err(CacheError::bad_shape(format!(
                "cannot upload a {} tensor as activations",
                t.dtype.as_str()
            ))
            .into());
        }
        out.dims.clear();
        out.dims.extend(t.shape.iter().map(|&d| d as usize));
        Ok(())
    }

    fn download(&self, t: &CpuTensor, dtype: TensorDtype) -> Result<HostTensor, KitError> {
        let mut out = HostTensor::empty();
        self.download_into(t, dtype, &mut out)?;
        Ok(out)
    }

    fn download_into(
        &self,
        t: &CpuTensor,
        dtype: TensorDtype,
        out: &mut HostTensor,
    ) -> Result<(), KitError> {
        if out.encode_f32_into(&t.dims, &t.data, dtype) {
            Ok(())
        } else {
            Err(CacheError::bad_shape("cannot download activations as i32").into())
        }
    }
}

impl Backend for CpuDevice {
    const ID: &'static str = "cpu";
    const NAME: &'static str = "kvplug CPU backend";

    fn open() -> Result<Self, String> {
        simd::isa_cap()?;
        Ok(CpuDevice::new())
    }

    fn device_description(&self) -> String {
        format!(
            "{} host threads, {}",
            workers::Workers::global().participants(),
            if self.features.avx512vnni {
                "AVX-512F+VNNI+AVX2+FMA+F16C kernels"
            } else if self.features.avx512f {
                "AVX-512F+AVX2+FMA+F16C kernels"
            } else if self.features.dot256 != simd::Dot256::Maddubs {
                "AVX2+FMA+F16C kernels, 256-bit VNNI"
            } else if self.features.avx2_fma_f16c {
                "AVX2+FMA+F16C kernels"
            } else {
                "scalar kernels"
            }
        )
    }

    fn features(&self) -> Vec<String> {
        let mut f = Vec::new();
        if self.features.avx2_fma_f16c {
            f.extend(["avx2", "fma", "f16c"].map(String::from));
        }
        if self.features.avx512f {
            f.push("avx512f".into());
        }
        if self.features.avx512vnni {
            f.push("avx512vnni".into());
        }
        match self.features.dot256 {
            simd::Dot256::Vex => f.push("avxvnni".into()),
            simd::Dot256::Evex => f.push("vnni-256".into()),
            simd::Dot256::Maddubs => {}
        }
        f.push("attention-sinks".into());
        #[cfg(all(feature = "xnnpack", target_os = "linux"))]
        if xnnpack::available().is_ok() {
            f.push("xnnpack".into());
        }
        f.extend(kvplug_backend_kit::model::blocks::weights_features_reading_mxfp4(&[]));
        f
    }
}

/// `cells` as runs of consecutive cells: (first cell, length), in order.
fn runs(cells: &[u32]) -> impl Iterator<Item = (usize, usize)> + '_ {
    cells
        .chunk_by(|a, b| b.checked_sub(*a) == Some(1))
        .map(|run| (run[0] as usize, run.len()))
}

kvplug_backend_kit::export_backend!(CpuDevice, models);

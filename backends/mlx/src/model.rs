//! The model graph's operations as MLX ops on f32 activations.
//!
//! Weights stay in their stored dtype (f32 / f16 / bf16) on a GPU. On the CPU device they are
//! widened to f32 once at load: MLX's CPU matmul has no f16/bf16 kernel and widens the whole
//! weight on every call (measured on SmolLM2-135M: 1.7 tok/s decode that way, 5.6 tok/s with
//! weights widened once), at twice the weight memory.
//!
//! On a GPU, GGUF block formats that are affine per 32 values (q4_0, q4_1, q5_0, q5_1, q8_0,
//! q4_K, q5_K: [`BlockFormat::affine_bits`]) are repacked once at load into MLX's own affine
//! form — the same codes little-endian in u32 words, an f32 scale and bias per 32 values,
//! which give exactly the values ggml's dequantization gives — and run through
//! `quantized_matmul` (dequantization fused into the product). q6_K, whose scales cover 16
//! values, no group size of MLX's takes: it is dequantized to f32 once at load. On the CPU
//! device every block format is dequantized to f32 once at load: MLX 0.32's CPU
//! `quantized_matmul` is far slower than its f32 GEMM (Qwen2.5-0.5B Q4_K_M, 2 threads:
//! decode 2.9 tok/s and prefill 4.8 tok/s quantized, 5.9 and 157 widened), at 2.3× the peak
//! RSS (3.1 GB against 1.35 GB). [`MlxDevice::with_quantized_weights`] overrides the choice;
//! `kvplug plugins` lists the widened formats as `weights-widened`.

use kvplug_backend_kit::model::blocks::{affine_row, BlockFormat, AFFINE_GROUP, BLOCK_FORMATS};
use kvplug_backend_kit::model::ops::check_hadamard;
use kvplug_backend_kit::model::{ModelDevice, StoredDtype, StoredTensor};
use kvplug_backend_kit::KitError;
use kvplug_core::RopePairs;

use crate::device::{err, indices, shape, MlxDevice, MlxTensor};
use crate::ffi::{self, dtype, Array};
use cxx::UniquePtr;

/// The block formats widened to f32 at load: q6_K, or every one unless the affine formats
/// are kept `quantized` (see the module docs).
pub fn widened(quantized: bool) -> &'static [BlockFormat] {
    if quantized {
        &[BlockFormat::Q6K]
    } else {
        &BLOCK_FORMATS
    }
}

/// A `[rows, cols]` weight, uploaded once (see the module docs for its form).
pub enum MlxWeight {
    /// Values in their stored float dtype (f32 on the CPU device).
    Dense(UniquePtr<Array>),
    /// MLX's affine form: `[rows, cols·bits/32]` u32 codes, `[rows, cols/32]` f32 scales
    /// and biases.
    Affine {
        codes: UniquePtr<Array>,
        scales: UniquePtr<Array>,
        biases: UniquePtr<Array>,
        bits: u32,
    },
}

/// Rows of affine-format blocks as MLX's affine arrays' bytes: codes packed little-endian
/// (`bits` each, value i of a row at bit `i·bits` of its words), scales, biases.
fn affine_arrays(
    format: BlockFormat,
    bits: u32,
    data: &[u8],
    rows: usize,
    cols: usize,
) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let bits = bits as usize;
    let words_per_row = cols * bits / 32;
    let groups = cols / AFFINE_GROUP;
    let (mut words, mut scales, mut biases) = (
        vec![0u32; rows * words_per_row],
        vec![0f32; rows * groups],
        vec![0f32; rows * groups],
    );
    let mut codes = vec![0u8; cols];
    let row_bytes = format.bytes_for(cols);
    for r in 0..rows {
        affine_row(
            format,
            &data[r * row_bytes..(r + 1) * row_bytes],
            &mut codes,
            &mut scales[r * groups..(r + 1) * groups],
            &mut biases[r * groups..(r + 1) * groups],
        );
        let row = &mut words[r * words_per_row..(r + 1) * words_per_row];
        for (i, &c) in codes.iter().enumerate() {
            let at = i * bits;
            // A code may straddle two words (5 bits).
            let wide = u64::from(c) << (at % 32);
            row[at / 32] |= wide as u32;
            if at % 32 + bits > 32 {
                row[at / 32 + 1] |= (wide >> 32) as u32;
            }
        }
    }
    (words, scales, biases)
}

impl ModelDevice for MlxDevice {
    type Weight = MlxWeight;

    fn weight(&self, data: StoredTensor, rows: usize, cols: usize) -> Result<MlxWeight, KitError> {
        if let StoredDtype::Block(format) = data.dtype() {
            if let Some(bits) = format.affine_bits().filter(|_| self.quantized_weights) {
                let (words, scales, biases) = affine_arrays(format, bits, data.bytes(), rows, cols);
                let _g = self.enter()?;
                let upload = |bytes: &[u8], width: usize, code: u8| {
                    let a = ffi::from_bytes(bytes, &shape(&[rows, width]), code).map_err(err)?;
                    ffi::eval(&a).map_err(err)?;
                    Ok::<_, KitError>(a)
                };
                let groups = cols / AFFINE_GROUP;
                return Ok(MlxWeight::Affine {
                    codes: upload(
                        bytemuck::cast_slice(&words),
                        cols * bits as usize / 32,
                        dtype::U32,
                    )?,
                    scales: upload(bytemuck::cast_slice(&scales), groups, dtype::F32)?,
                    biases: upload(bytemuck::cast_slice(&biases), groups, dtype::F32)?,
                    bits,
                });
            }
        }
        let widened;
        let (bytes, code) = match data.dtype() {
            StoredDtype::F32 => (data.bytes(), dtype::F32),
            StoredDtype::F16 => (data.bytes(), dtype::F16),
            StoredDtype::BF16 => (data.bytes(), dtype::BF16),
            // Dequantized once here (see the module docs), as is any format a later kit adds.
            _ => {
                widened = data.to_f32();
                (bytemuck::cast_slice(&widened[..]), dtype::F32)
            }
        };
        let _g = self.enter()?;
        let mut a = ffi::from_bytes(bytes, &shape(&[rows, cols]), code).map_err(err)?;
        if !self.gpu && code != dtype::F32 {
            a = ffi::astype(&a, dtype::F32).map_err(err)?;
        }
        ffi::eval(&a).map_err(err)?;
        Ok(MlxWeight::Dense(a))
    }

    fn tensor(&self, data: &[f32], dims: &[usize]) -> Result<MlxTensor, KitError> {
        let _g = self.enter()?;
        let a =
            ffi::from_bytes(bytemuck::cast_slice(data), &shape(dims), dtype::F32).map_err(err)?;
        Ok(MlxTensor {
            a,
            dims: dims.to_vec(),
        })
    }

    fn embed(&self, table: &MlxWeight, ids: &[i32], out: &mut MlxTensor) -> Result<(), KitError> {
        let _g = self.enter()?;
        out.a = match table {
            MlxWeight::Dense(a) => ffi::embed(a, ids),
            MlxWeight::Affine {
                codes,
                scales,
                biases,
                bits,
            } => ffi::embed_affine(codes, scales, biases, ids, *bits as i32),
        }
        .map_err(err)?;
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &MlxTensor,
        w: &MlxTensor,
        eps: f32,
        out: &mut MlxTensor,
    ) -> Result<(), KitError> {
        let _g = self.enter()?;
        out.a = ffi::rms_norm(&x.a, &w.a, eps).map_err(err)?;
        Ok(())
    }

    fn linear(
        &self,
        x: &MlxTensor,
        w: &MlxWeight,
        bias: Option<&MlxTensor>,
        out: &mut MlxTensor,
    ) -> Result<(), KitError> {
        let _g = self.enter()?;
        let y = match w {
            MlxWeight::Dense(a) => ffi::linear(&x.a, a),
            MlxWeight::Affine {
                codes,
                scales,
                biases,
                bits,
            } => ffi::linear_affine(&x.a, codes, scales, biases, *bits as i32),
        }
        .map_err(err)?;
        out.a = match bias {
            Some(b) => ffi::add(&y, &b.a).map_err(err)?,
            None => y,
        };
        Ok(())
    }

    fn rope(
        &self,
        x: &mut MlxTensor,
        heads: usize,
        positions: &[i32],
        inv_freq: &[f32],
        pairs: RopePairs,
    ) -> Result<(), KitError> {
        let _g = self.enter()?;
        let interleaved = pairs == RopePairs::Interleaved;
        x.a = ffi::rope(&x.a, heads as i32, positions, inv_freq, interleaved).map_err(err)?;
        Ok(())
    }

    fn split_heads(
        &self,
        x: &MlxTensor,
        heads: usize,
        out: &mut MlxTensor,
    ) -> Result<(), KitError> {
        let _g = self.enter()?;
        out.a = ffi::split_heads(&x.a, heads as i32).map_err(err)?;
        Ok(())
    }

    fn merge_heads(&self, x: &MlxTensor, out: &mut MlxTensor) -> Result<(), KitError> {
        let _g = self.enter()?;
        out.a = ffi::merge_heads(&x.a).map_err(err)?;
        Ok(())
    }

    fn silu_mul(
        &self,
        gate: &MlxTensor,
        up: &MlxTensor,
        out: &mut MlxTensor,
    ) -> Result<(), KitError> {
        let _g = self.enter()?;
        out.a = ffi::silu_mul(&gate.a, &up.a).map_err(err)?;
        Ok(())
    }

    fn gelu_tanh_mul(
        &self,
        gate: &MlxTensor,
        up: &MlxTensor,
        out: &mut MlxTensor,
    ) -> Result<(), KitError> {
        let _g = self.enter()?;
        out.a = ffi::gelu_tanh_mul(&gate.a, &up.a).map_err(err)?;
        Ok(())
    }

    fn hadamard(&self, x: &MlxTensor, n: usize, out: &mut MlxTensor) -> Result<(), KitError> {
        check_hadamard(&x.dims, n, &out.dims)?;
        let _g = self.enter()?;
        out.a = ffi::hadamard(&x.a, n as i32).map_err(err)?;
        Ok(())
    }

    fn scale(&self, x: &mut MlxTensor, s: f32) -> Result<(), KitError> {
        let _g = self.enter()?;
        x.a = ffi::scale(&x.a, s).map_err(err)?;
        Ok(())
    }

    fn add_assign(&self, x: &mut MlxTensor, y: &MlxTensor) -> Result<(), KitError> {
        let _g = self.enter()?;
        x.a = ffi::add(&x.a, &y.a).map_err(err)?;
        Ok(())
    }

    fn gather_rows(
        &self,
        x: &MlxTensor,
        rows: &[usize],
        out: &mut MlxTensor,
    ) -> Result<(), KitError> {
        let _g = self.enter()?;
        out.a = ffi::gather_rows(&x.a, &indices(rows.iter().copied())).map_err(err)?;
        Ok(())
    }
}

//! The model graph's operations as MLX ops on f32 activations.
//!
//! Weights stay in their stored dtype (f32 / f16 / bf16) on a GPU. On the CPU device they are
//! widened to f32 once at load: MLX's CPU matmul has no f16/bf16 kernel and widens the whole
//! weight on every call (measured on SmolLM2-135M: 1.7 tok/s decode that way, 5.6 tok/s with
//! weights widened once), at twice the weight memory. GGUF block formats (q4_K & co.) are
//! dequantized to f32 once at load on every device: MLX's affine `quantized_matmul` matches
//! none of ggml's formats bit for bit without re-quantizing (`kvplug plugins` lists them as
//! `weights-widened`).

use kvplug_backend_kit::model::{ModelDevice, StoredDtype, StoredTensor};
use kvplug_backend_kit::KitError;
use kvplug_core::RopePairs;

use crate::device::{err, indices, shape, MlxDevice, MlxTensor};
use crate::ffi::{self, dtype, Array};
use cxx::UniquePtr;

/// A `[rows, cols]` weight, uploaded once (see the module docs for its dtype).
pub struct MlxWeight {
    a: UniquePtr<Array>,
}

impl ModelDevice for MlxDevice {
    type Weight = MlxWeight;

    fn weight(&self, data: StoredTensor, rows: usize, cols: usize) -> Result<MlxWeight, KitError> {
        let widened;
        let (bytes, code) = match data.dtype() {
            StoredDtype::F32 => (data.bytes(), dtype::F32),
            StoredDtype::F16 => (data.bytes(), dtype::F16),
            StoredDtype::BF16 => (data.bytes(), dtype::BF16),
            // Dequantized once here (see the module docs).
            StoredDtype::Block(_) => {
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
        Ok(MlxWeight { a })
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
        out.a = ffi::embed(&table.a, ids).map_err(err)?;
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
        let y = ffi::linear(&x.a, &w.a).map_err(err)?;
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

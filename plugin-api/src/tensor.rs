//! [`HostTensor`]: a dense tensor in host memory (dtype + shape + little-endian bytes).

use abi_stable::std_types::RVec;
use abi_stable::StableAbi;

/// Element type of a [`HostTensor`].
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorDtype {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 32-bit signed integer (token ids, positions).
    I32,
}

impl TensorDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            TensorDtype::F32 | TensorDtype::I32 => 4,
            TensorDtype::F16 | TensorDtype::Bf16 => 2,
        }
    }

    /// `f32`, `f16`, `bf16`, `i32`.
    pub fn as_str(self) -> &'static str {
        match self {
            TensorDtype::F32 => "f32",
            TensorDtype::F16 => "f16",
            TensorDtype::Bf16 => "bf16",
            TensorDtype::I32 => "i32",
        }
    }

    /// Parses [`TensorDtype::as_str`] names.
    pub fn parse(s: &str) -> Option<Self> {
        [
            TensorDtype::F32,
            TensorDtype::F16,
            TensorDtype::Bf16,
            TensorDtype::I32,
        ]
        .into_iter()
        .find(|d| d.as_str() == s)
    }
}

/// A dense row-major tensor in host memory. `bytes.len()` is the product of `shape` times
/// the element size; constructors keep that true and [`HostTensor::check`] verifies it for
/// tensors that crossed the boundary.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Element type.
    pub dtype: TensorDtype,
    /// Dimensions, outermost first.
    pub shape: RVec<u64>,
    /// Little-endian element bytes.
    pub bytes: RVec<u8>,
}

impl HostTensor {
    /// Number of elements the shape describes.
    pub fn numel(&self) -> usize {
        self.shape.iter().map(|&d| d as usize).product()
    }

    /// Whether the byte length matches shape and dtype.
    pub fn check(&self) -> Result<(), String> {
        let want = self.numel() * self.dtype.size();
        if self.bytes.len() == want {
            Ok(())
        } else {
            Err(format!(
                "{} tensor of shape {:?} needs {want} bytes, has {}",
                self.dtype.as_str(),
                self.shape.as_slice(),
                self.bytes.len()
            ))
        }
    }

    /// An empty f32 tensor (shape `[0]`): a slot for the `_into` writers to fill.
    pub fn empty() -> Self {
        HostTensor {
            dtype: TensorDtype::F32,
            shape: RVec::from(vec![0]),
            bytes: RVec::new(),
        }
    }

    /// An f32 tensor.
    pub fn from_f32(shape: &[usize], data: &[f32]) -> Self {
        Self::encode_f32(shape, data, TensorDtype::F32).expect("f32 is an activation dtype")
    }

    /// `data` encoded as `dtype` (f32, f16 or bf16, round to nearest even); `None` for i32,
    /// which activations cannot become.
    pub fn encode_f32(shape: &[usize], data: &[f32], dtype: TensorDtype) -> Option<Self> {
        let mut t = HostTensor::empty();
        t.encode_f32_into(shape, data, dtype).then_some(t)
    }

    /// [`HostTensor::encode_f32`] into this tensor, reusing its buffers (they keep the
    /// largest size seen, so a repeating shape allocates nothing); `false`, leaving it
    /// untouched, for i32.
    pub fn encode_f32_into(&mut self, shape: &[usize], data: &[f32], dtype: TensorDtype) -> bool {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape/data mismatch"
        );
        if dtype == TensorDtype::I32 {
            return false;
        }
        self.set_shape(dtype, shape, data.len());
        match dtype {
            TensorDtype::F32 => self.fill(data, |x| x.to_le_bytes()),
            TensorDtype::F16 => self.fill(data, |&x| half::f16::from_f32(x).to_le_bytes()),
            TensorDtype::Bf16 => self.fill(data, |&x| half::bf16::from_f32(x).to_le_bytes()),
            TensorDtype::I32 => unreachable!("refused above"),
        }
        true
    }

    /// Makes the bytes `encode` of each element: sized once and written in
    /// place, which the compiler vectorizes (a byte-at-a-time `RVec::extend` checked its
    /// capacity per byte: 4% of a Qwen3.5 prefill).
    fn fill<T, const N: usize>(&mut self, data: &[T], encode: impl Fn(&T) -> [u8; N]) {
        self.bytes.resize(data.len() * N, 0);
        for (out, x) in self.bytes.chunks_exact_mut(N).zip(data) {
            out.copy_from_slice(&encode(x));
        }
    }

    /// An i32 tensor.
    pub fn from_i32(shape: &[usize], data: &[i32]) -> Self {
        let mut t = HostTensor::empty();
        t.set_i32(shape, data);
        t
    }

    /// This tensor made the i32 tensor `data` of `shape`, reusing its buffers as
    /// [`HostTensor::encode_f32_into`] does.
    pub fn set_i32(&mut self, shape: &[usize], data: &[i32]) {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape/data mismatch"
        );
        self.set_shape(TensorDtype::I32, shape, data.len());
        self.fill(data, |x| x.to_le_bytes());
    }

    /// Sets dtype and shape, and empties `bytes` with room for `n` elements.
    fn set_shape(&mut self, dtype: TensorDtype, shape: &[usize], n: usize) {
        self.dtype = dtype;
        self.shape.clear();
        self.shape.extend(shape.iter().map(|&d| d as u64));
        self.bytes.clear();
        self.bytes.reserve(n * dtype.size());
    }

    /// The shape as `usize`.
    pub fn dims(&self) -> Vec<usize> {
        self.shape.iter().map(|&d| d as usize).collect()
    }

    /// Elements as f32 (converting f16/bf16; `None` for i32).
    pub fn to_f32(&self) -> Option<Vec<f32>> {
        let mut out = Vec::new();
        self.read_f32_into(&mut out).then_some(out)
    }

    /// Replaces `out`'s contents with the elements as f32 (converting f16/bf16), reusing its
    /// buffer; false (and `out` empty) for i32.
    pub fn read_f32_into(&self, out: &mut Vec<f32>) -> bool {
        let b = self.bytes.as_slice();
        out.clear();
        match self.dtype {
            TensorDtype::F32 => out.extend(
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
            TensorDtype::F16 => out.extend(
                b.chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
            TensorDtype::Bf16 => out.extend(
                b.chunks_exact(2)
                    .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)),
            ),
            TensorDtype::I32 => return false,
        }
        true
    }

    /// Elements as i32 (`None` unless the dtype is i32).
    pub fn to_i32(&self) -> Option<Vec<i32>> {
        let mut v = Vec::new();
        self.read_i32_into(&mut v).then_some(v)
    }

    /// [`HostTensor::to_i32`] into `out` (cleared first; grown, never shrunk): `false`
    /// (and `out` empty) where the tensor is not i32.
    pub fn read_i32_into(&self, out: &mut Vec<i32>) -> bool {
        out.clear();
        if self.dtype != TensorDtype::I32 {
            return false;
        }
        out.extend(
            self.bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_checks() {
        let t = HostTensor::from_f32(&[2, 2], &[1.0, -2.5, 0.0, 3.25]);
        assert_eq!(t.check(), Ok(()));
        assert_eq!(t.to_f32().unwrap(), vec![1.0, -2.5, 0.0, 3.25]);
        assert_eq!(t.to_i32(), None);
        let mut bad = t.clone();
        bad.shape = RVec::from(vec![3, 2]);
        assert!(bad.check().unwrap_err().contains("needs 24 bytes, has 16"));
        let h = HostTensor {
            dtype: TensorDtype::F16,
            shape: RVec::from(vec![3]),
            bytes: RVec::from(vec![0x00, 0x3c, 0x00, 0xc0, 0x01, 0x00]),
        };
        assert_eq!(h.to_f32().unwrap(), vec![1.0, -2.0, 2f32.powi(-24)]);
        let h =
            HostTensor::encode_f32(&[3], &[1.0, -2.0, 2f32.powi(-24)], TensorDtype::F16).unwrap();
        assert_eq!(h.bytes.as_slice(), &[0x00, 0x3c, 0x00, 0xc0, 0x01, 0x00]);
        let b =
            HostTensor::encode_f32(&[1], &[1.0 + 3.0 * 2f32.powi(-8)], TensorDtype::Bf16).unwrap();
        assert_eq!(b.to_f32().unwrap(), vec![1.0 + 2f32.powi(-6)]);
        assert!(HostTensor::encode_f32(&[1], &[1.0], TensorDtype::I32).is_none());
        let i = HostTensor::from_i32(&[2], &[7, -1]);
        assert_eq!(i.to_i32().unwrap(), vec![7, -1]);
    }

    #[test]
    fn rewriting_a_tensor_reuses_its_buffers() {
        let mut t = HostTensor::empty();
        assert!(t.encode_f32_into(&[2, 3], &[1.0; 6], TensorDtype::F32));
        let (bytes, cap) = (t.bytes.as_ptr(), t.bytes.capacity());
        // A smaller tensor of another dtype in the same buffers, then back.
        t.set_i32(&[2], &[5, -6]);
        assert_eq!((t.check(), t.to_i32().unwrap()), (Ok(()), vec![5, -6]));
        assert!(t.encode_f32_into(&[3], &[0.5, -1.0, 2.0], TensorDtype::Bf16));
        assert_eq!(t.to_f32().unwrap(), vec![0.5, -1.0, 2.0]);
        assert_eq!((t.bytes.as_ptr(), t.bytes.capacity()), (bytes, cap));
        // i32 activations are refused and leave the tensor as it was.
        let before = t.clone();
        assert!(!t.encode_f32_into(&[1], &[1.0], TensorDtype::I32));
        assert_eq!(t, before);
        let mut out = vec![9];
        assert!(!t.read_i32_into(&mut out) && out.is_empty());
    }
}

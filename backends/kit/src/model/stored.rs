//! [`StoredTensor`]: a weight's elements exactly as the package stores them (f32, f16, bf16
//! or a ggml block format), usually borrowed from the memory-mapped file — no widening, no
//! copy.

use std::ops::Range;
use std::sync::Arc;

use half::{bf16, f16};

use super::blocks::{dequantize_row, e8m0_half, BlockFormat, MXFP4_VALUES};

#[cfg(target_endian = "big")]
compile_error!("stored tensors are read in place as little-endian values");

/// How a stored tensor's elements are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoredDtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
    /// Quantized blocks (a GGUF weight kept in its format).
    Block(BlockFormat),
}

impl StoredDtype {
    /// Bytes of the smallest whole unit: an element, or a block.
    pub fn unit_bytes(self) -> usize {
        match self {
            StoredDtype::F32 => 4,
            StoredDtype::F16 | StoredDtype::BF16 => 2,
            StoredDtype::Block(f) => f.block_bytes(),
        }
    }

    /// Elements per unit (1, or a block's values).
    pub fn unit_elems(self) -> usize {
        match self {
            StoredDtype::Block(f) => f.block_elems(),
            _ => 1,
        }
    }

    /// The alignment reads need: the element's, or 2 for blocks (their f16 fields).
    fn align(self) -> usize {
        match self {
            StoredDtype::Block(_) => 2,
            d => d.unit_bytes(),
        }
    }

    /// The name `kvplug plugins` and `plan` print (`f16`, `q4_K`, ...).
    pub fn name(self) -> &'static str {
        match self {
            StoredDtype::F32 => "f32",
            StoredDtype::F16 => "f16",
            StoredDtype::BF16 => "bf16",
            StoredDtype::Block(f) => f.name(),
        }
    }
}

/// The typed elements of a [`StoredTensor`].
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum StoredValues<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements.
    F16(&'a [f16]),
    /// bf16 elements.
    BF16(&'a [bf16]),
    /// Whole blocks of a format, as stored.
    Blocks(BlockFormat, &'a [u8]),
}

/// A tensor's little-endian elements in their stored dtype. The bytes are shared with their
/// owner (a memory-mapped shard, or a buffer), so clones and device weights that keep them
/// cost no copy. Contract: the bytes are aligned for the dtype and hold whole elements (whole
/// blocks for a block format; guaranteed at construction, copying into an aligned buffer
/// only when the file's offset is misaligned).
#[derive(Clone)]
pub struct StoredTensor {
    dtype: StoredDtype,
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: Range<usize>,
}

impl std::fmt::Debug for StoredTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredTensor")
            .field("dtype", &self.dtype)
            .field("len", &self.len())
            .finish()
    }
}

/// An aligned owned buffer of `len` bytes (8-byte words underneath).
struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl AsRef<[u8]> for Aligned {
    fn as_ref(&self) -> &[u8] {
        &word_bytes(&self.words)[..self.len]
    }
}

fn word_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding and any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), words.len() * 8) }
}

impl StoredTensor {
    /// `owner.as_ref()[range]` read as `dtype`. Returns `None` when the range is outside the
    /// owner or does not hold whole elements.
    pub fn new(
        dtype: StoredDtype,
        owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
        range: Range<usize>,
    ) -> Option<Self> {
        let bytes = (*owner).as_ref().get(range.clone())?;
        if bytes.len() % dtype.unit_bytes() != 0 {
            return None;
        }
        if (bytes.as_ptr() as usize) % dtype.align() == 0 {
            return Some(StoredTensor {
                dtype,
                owner,
                range,
            });
        }
        tracing::debug!("a {dtype:?} tensor is misaligned in its file: copied");
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: `words` spans at least bytes.len() bytes and does not overlap `bytes`.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), words.as_mut_ptr().cast(), bytes.len())
        };
        let len = bytes.len();
        Some(StoredTensor {
            dtype,
            owner: Arc::new(Aligned { words, len }),
            range: 0..len,
        })
    }

    /// f32 values in an owned buffer (tests and synthetic models).
    pub fn from_f32(values: &[f32]) -> Self {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(StoredDtype::F32, Arc::new(bytes), 0..values.len() * 4)
            .expect("whole f32 elements")
    }

    /// Rows `rows` of this tensor read as `[_, cols]` row-major, sharing its bytes (LFM2's
    /// fused input projection split into its three parts); `None` when a row is not whole
    /// units of the dtype or the rows run past the end.
    pub fn rows(&self, cols: usize, rows: Range<usize>) -> Option<Self> {
        if cols % self.dtype.unit_elems() != 0 || rows.start > rows.end {
            return None;
        }
        let row_bytes = cols / self.dtype.unit_elems() * self.dtype.unit_bytes();
        let start = self.range.start + rows.start.checked_mul(row_bytes)?;
        let end = self.range.start + rows.end.checked_mul(row_bytes)?;
        if end > self.range.end {
            return None;
        }
        Self::new(self.dtype, self.owner.clone(), start..end)
    }

    /// Rows `rows` (in that order) of this tensor read as `[_, cols]` row-major, copied into
    /// a tensor of their own (Qwen3.5's q projection: its query and gate rows interleave per
    /// head, and a partial rotary reorders a head's rows); `None` as for [`StoredTensor::rows`].
    pub fn gather(&self, cols: usize, rows: &[usize]) -> Option<Self> {
        let mut bytes = Vec::new();
        for &r in rows {
            bytes.extend_from_slice(self.rows(cols, r..r + 1)?.bytes());
        }
        let len = bytes.len();
        Self::new(self.dtype, Arc::new(bytes), 0..len)
    }

    /// This tensor in a dtype every backend computes: itself, but for MXFP4, which a device
    /// reads in place only where it says so ([`ModelDevice::reads_mxfp4`](super::ModelDevice::reads_mxfp4))
    /// and which is re-encoded once, exactly, as Q5_0 (a code
    /// `kvalue + 16`, the block's scale `2^(e − 128)` as its f16 `d`; 22 bytes a block for
    /// 17), or as f32 where a block with a nonzero code has a scale outside f16's range
    /// (`e` outside 104..=143).
    pub fn computable(self) -> Self {
        if self.dtype != StoredDtype::Block(BlockFormat::Mxfp4) {
            return self;
        }
        let blocks = self.bytes().chunks_exact(17);
        let fits = |b: &[u8]| (104..=143).contains(&b[0]) || b[1..].iter().all(|&q| q & 0x77 == 0);
        if !blocks.clone().all(fits) {
            tracing::debug!("an MXFP4 tensor's scales fall outside f16's range: widened to f32");
            return Self::from_f32(&self.to_f32());
        }
        let mut out = Vec::with_capacity(blocks.len() * 22);
        for b in blocks {
            let codes: [u8; 32] = std::array::from_fn(|j| {
                let q = if j < 16 {
                    b[1 + j] & 0x0f
                } else {
                    b[j - 15] >> 4
                };
                (MXFP4_VALUES[usize::from(q)] + 16) as u8
            });
            let d = if (104..=143).contains(&b[0]) {
                half::f16::from_f32(e8m0_half(b[0]))
            } else {
                half::f16::ZERO
            };
            out.extend(d.to_le_bytes());
            let qh = codes
                .iter()
                .enumerate()
                .fold(0u32, |h, (j, &c)| h | (u32::from(c >> 4) << j));
            out.extend(qh.to_le_bytes());
            out.extend((0..16).map(|j| (codes[j] & 0x0f) | ((codes[j + 16] & 0x0f) << 4)));
        }
        let len = out.len();
        Self::new(StoredDtype::Block(BlockFormat::Q5_0), Arc::new(out), 0..len)
            .expect("whole Q5_0 blocks")
    }

    /// The element encoding.
    pub fn dtype(&self) -> StoredDtype {
        self.dtype
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.range.len() / self.dtype.unit_bytes() * self.dtype.unit_elems()
    }

    /// Bytes stored.
    pub fn byte_len(&self) -> usize {
        self.range.len()
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// The raw little-endian bytes.
    pub fn bytes(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }

    /// The elements, typed, read in place.
    pub fn values(&self) -> StoredValues<'_> {
        let b = self.bytes();
        let n = self.len();
        let p = b.as_ptr();
        if let StoredDtype::Block(f) = self.dtype {
            return StoredValues::Blocks(f, b);
        }
        // SAFETY: construction checked alignment and whole elements; f32/f16/bf16 accept any
        // bit pattern; the bytes live as long as `self` (the owner is immutable).
        unsafe {
            match self.dtype {
                StoredDtype::F32 => StoredValues::F32(std::slice::from_raw_parts(p.cast(), n)),
                StoredDtype::F16 => StoredValues::F16(std::slice::from_raw_parts(p.cast(), n)),
                StoredDtype::BF16 => StoredValues::BF16(std::slice::from_raw_parts(p.cast(), n)),
                StoredDtype::Block(_) => unreachable!("returned above"),
            }
        }
    }

    /// The index of the first NaN or infinite element, if any.
    pub fn first_non_finite(&self) -> Option<usize> {
        // All-ones exponents, tested on the bits (vectorizes; no widening).
        match self.values() {
            StoredValues::F32(v) => v.iter().position(|x| !x.is_finite()),
            StoredValues::F16(v) => v.iter().position(|x| x.to_bits() & 0x7c00 == 0x7c00),
            StoredValues::BF16(v) => v.iter().position(|x| x.to_bits() & 0x7f80 == 0x7f80),
            // A block's values are finite exactly when its f16 scale fields are.
            StoredValues::Blocks(f, b) => b
                .chunks_exact(f.block_bytes())
                .position(|blk| f.half_fields().iter().any(|&at| blk[at + 1] & 0x7c == 0x7c))
                .map(|i| i * f.block_elems()),
        }
    }

    /// The elements widened to f32 (small tensors: norms, biases; references in tests).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.len()];
        self.rows_f32(0, &mut out);
        out
    }

    /// Elements `[start, start + out.len())` widened to f32 (an embedding row). For a block
    /// format both ends must fall on block boundaries.
    pub fn rows_f32(&self, start: usize, out: &mut [f32]) {
        let at = start..start + out.len();
        match self.values() {
            StoredValues::F32(v) => out.copy_from_slice(&v[at]),
            StoredValues::F16(v) => out
                .iter_mut()
                .zip(&v[at])
                .for_each(|(o, x)| *o = x.to_f32()),
            StoredValues::BF16(v) => out
                .iter_mut()
                .zip(&v[at])
                .for_each(|(o, x)| *o = x.to_f32()),
            StoredValues::Blocks(f, b) => {
                let (be, bb) = (f.block_elems(), f.block_bytes());
                assert!(
                    start % be == 0 && out.len() % be == 0,
                    "rows_f32: partial blocks"
                );
                dequantize_row(f, &b[start / be * bb..(start + out.len()) / be * bb], out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MXFP4 blocks (every code, scales across f16's range and a zero block with a tiny
    /// scale) re-encode as Q5_0 that dequantizes to the same numbers; a nonzero block with a
    /// scale below f16's range widens the tensor to f32, exactly.
    #[test]
    fn mxfp4_re_encodes_exactly() {
        let block = |e: u8, salt: u8| -> Vec<u8> {
            let mut b = vec![e];
            b.extend((0..16u8).map(|j| j.wrapping_mul(17).wrapping_add(salt)));
            b
        };
        let bytes: Vec<u8> = [block(104, 0), block(127, 3), block(143, 9), {
            let mut zero = vec![3u8];
            zero.extend([0x88u8; 16]); // codes 8: kvalue 0 (a negative zero)
            zero
        }]
        .concat();
        let t = |b: Vec<u8>| {
            let n = b.len();
            StoredTensor::new(StoredDtype::Block(BlockFormat::Mxfp4), Arc::new(b), 0..n).unwrap()
        };
        let mxfp4 = t(bytes);
        let want = mxfp4.to_f32();
        // Byte 2's low nibble (value 1) is code 1: kvalue 1 under 2^(104 − 128).
        assert_eq!(want[1], 2f32.powi(-24));
        assert_eq!(
            (e8m0_half(0), e8m0_half(255)),
            (2f32.powi(-128), 2f32.powi(127))
        );
        let q5 = mxfp4.clone().computable();
        assert_eq!(q5.dtype(), StoredDtype::Block(BlockFormat::Q5_0));
        assert_eq!(q5.byte_len(), 4 * 22);
        let got = q5.to_f32();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g == w, "value {i}: {g} after re-encoding, {w} before");
        }
        let tiny = t(block(100, 1));
        let wide = tiny.clone().computable();
        assert_eq!(wide.dtype(), StoredDtype::F32);
        assert_eq!(wide.to_f32(), tiny.to_f32());
    }

    #[test]
    fn misaligned_ranges_are_copied_and_read_the_same() {
        let vals = [1.5f32, -2.0, 3.25];
        let mut bytes = vec![0u8];
        bytes.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
        let t = StoredTensor::new(StoredDtype::F32, Arc::new(bytes), 1..13).unwrap();
        assert_eq!(t.to_f32(), vals);
        assert_eq!(t.len(), 3);
        let halves: Vec<u8> = [1.0f32, 0.5]
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect();
        let t = StoredTensor::new(StoredDtype::F16, Arc::new(halves), 0..4).unwrap();
        assert_eq!(t.to_f32(), [1.0, 0.5]);
        assert!(StoredTensor::new(StoredDtype::F16, Arc::new(vec![0u8; 3]), 0..3).is_none());
        // A finite prefix (f16::MAX twice; as f32 or bf16 bits that is one finite value and
        // two finite halves), then one non-finite element.
        for (dtype, bad, at) in [
            (StoredDtype::F16, f16::INFINITY.to_le_bytes().to_vec(), 2),
            (StoredDtype::F16, f16::NAN.to_le_bytes().to_vec(), 2),
            (
                StoredDtype::BF16,
                bf16::NEG_INFINITY.to_le_bytes().to_vec(),
                2,
            ),
            (StoredDtype::F32, f32::NAN.to_le_bytes().to_vec(), 1),
        ] {
            let mut all = f16::MAX.to_le_bytes().repeat(2);
            all.extend(bad);
            let n = all.len();
            let t = StoredTensor::new(dtype, Arc::new(all), 0..n).unwrap();
            assert_eq!(t.first_non_finite(), Some(at), "{dtype:?}");
        }
        assert_eq!(
            StoredTensor::from_f32(&[f32::MAX, -0.0]).first_non_finite(),
            None
        );
        assert!(StoredTensor::new(StoredDtype::F32, Arc::new(vec![0u8; 4]), 0..8).is_none());
    }
}

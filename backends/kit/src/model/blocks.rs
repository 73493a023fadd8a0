//! ggml's quantized block formats, as GGUF files store weights: the layout of each block and
//! the reference dequantization (the arithmetic of ggml's `dequantize_row_*`, in f32, in
//! the same order, so its results match ggml's and the `gguf` Python package's bit for bit).
//!
//! A row of a quantized `[rows, cols]` weight is `cols / block_elems` consecutive blocks.
//! Backends compute on the blocks directly (cpu) or dequantize them as they read them
//! (wgpu); [`dequantize_row`] is the reference they are checked against.

use half::f16;

/// A ggml block format a weight may be stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    /// 32 values: f16 scale `d`, 4-bit codes; `x = d·(q − 8)`.
    Q4_0,
    /// 32 values: f16 scale `d` and minimum `m`, 4-bit codes; `x = d·q + m`.
    Q4_1,
    /// 32 values: f16 `d`, a 5th bit per value in `qh`; `x = d·(q − 16)`.
    Q5_0,
    /// 32 values: f16 `d` and `m`, 5-bit codes; `x = d·q + m`.
    Q5_1,
    /// 32 values: f16 `d`, i8 codes; `x = d·q`.
    Q8_0,
    /// 256 values in 8 sub-blocks of 32, each with a 6-bit scale and minimum under f16
    /// super-block `d` and `dmin`; `x = d·sc·q − dmin·m`, 4-bit codes.
    Q4K,
    /// As [`BlockFormat::Q4K`] with 5-bit codes (the 5th bits in `qh`).
    Q5K,
    /// 256 values in 16 sub-blocks of 16 with i8 scales under an f16 `d`; 6-bit codes,
    /// `x = d·sc·(q − 32)`.
    Q6K,
    /// 32 values (OCP's MX FP4, GPT-OSS's experts): an E8M0 scale byte `e`, then 4-bit E2M1
    /// codes (low nibbles values 0..16, high ones 16..32); `x = kvalue[q]·2^(e − 128)`, the
    /// kvalues being E2M1 doubled ([`MXFP4_VALUES`]). Computed in place by a device whose
    /// [`ModelDevice::reads_mxfp4`](super::ModelDevice::reads_mxfp4) says so; for the others
    /// the kit re-encodes it once at load ([`StoredTensor::computable`](super::StoredTensor::computable)).
    Mxfp4,
}

/// MXFP4's code values, E2M1 numbers doubled (ggml's `kvalues_mxfp4`).
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// MXFP4's scale: `2^(e − 128)` (ggml's `GGML_E8M0_TO_FP32_HALF`: E8M0 halved, as the codes
/// are doubled), exact in f32 for every byte (subnormal for `e` < 2).
pub fn e8m0_half(e: u8) -> f32 {
    f32::from_bits(match e {
        0 | 1 => 0x0020_0000 << e,
        e => u32::from(e - 1) << 23,
    })
}

/// Every block format every backend computes on (MXFP4 aside: it is read in place only where
/// a device says so, and re-encoded at load elsewhere), in GGML type order.
pub const BLOCK_FORMATS: [BlockFormat; 8] = [
    BlockFormat::Q4_0,
    BlockFormat::Q4_1,
    BlockFormat::Q5_0,
    BlockFormat::Q5_1,
    BlockFormat::Q8_0,
    BlockFormat::Q4K,
    BlockFormat::Q5K,
    BlockFormat::Q6K,
];

impl BlockFormat {
    /// Values per block.
    #[inline]
    pub const fn block_elems(self) -> usize {
        match self {
            BlockFormat::Q4K | BlockFormat::Q5K | BlockFormat::Q6K => 256,
            _ => 32,
        }
    }

    /// Bytes per block.
    #[inline]
    pub const fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_0 => 18,
            BlockFormat::Q4_1 => 20,
            BlockFormat::Q5_0 => 22,
            BlockFormat::Q5_1 => 24,
            BlockFormat::Q8_0 => 34,
            BlockFormat::Q4K => 144,
            BlockFormat::Q5K => 176,
            BlockFormat::Q6K => 210,
            BlockFormat::Mxfp4 => 17,
        }
    }

    /// ggml's name (`q4_K`, ...), as llama.cpp prints it.
    pub const fn name(self) -> &'static str {
        match self {
            BlockFormat::Q4_0 => "q4_0",
            BlockFormat::Q4_1 => "q4_1",
            BlockFormat::Q5_0 => "q5_0",
            BlockFormat::Q5_1 => "q5_1",
            BlockFormat::Q8_0 => "q8_0",
            BlockFormat::Q4K => "q4_K",
            BlockFormat::Q5K => "q5_K",
            BlockFormat::Q6K => "q6_K",
            BlockFormat::Mxfp4 => "mxfp4",
        }
    }

    /// Byte offsets of a block's f16 fields (scales and minimums).
    pub const fn half_fields(self) -> &'static [usize] {
        match self {
            BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => &[0],
            BlockFormat::Q4_1 | BlockFormat::Q5_1 | BlockFormat::Q4K | BlockFormat::Q5K => &[0, 2],
            BlockFormat::Q6K => &[208],
            // E8M0 has no infinity or NaN in ggml's reading (byte 255 is 2^127).
            BlockFormat::Mxfp4 => &[],
        }
    }

    /// The format of ggml type id `id` (`ggml_type`), if it is one of these.
    pub const fn from_ggml_type(id: u32) -> Option<Self> {
        Some(match id {
            2 => BlockFormat::Q4_0,
            3 => BlockFormat::Q4_1,
            6 => BlockFormat::Q5_0,
            7 => BlockFormat::Q5_1,
            8 => BlockFormat::Q8_0,
            12 => BlockFormat::Q4K,
            13 => BlockFormat::Q5K,
            14 => BlockFormat::Q6K,
            39 => BlockFormat::Mxfp4,
            _ => return None,
        })
    }

    /// The format named `name` (as [`BlockFormat::name`], any case).
    pub fn from_name(name: &str) -> Option<Self> {
        BLOCK_FORMATS
            .into_iter()
            .chain([BlockFormat::Mxfp4])
            .find(|f| f.name().eq_ignore_ascii_case(name))
    }

    /// Bytes of `elems` values (`elems` a multiple of [`BlockFormat::block_elems`]).
    #[inline]
    pub const fn bytes_for(self, elems: usize) -> usize {
        elems / self.block_elems() * self.block_bytes()
    }
}

/// The `features` entries (for `kvplug plugins`) of a backend that computes f32/f16/bf16
/// weights in place and every block format in place but those it widens once at load
/// (`widened`): `weights=f32|f16|bf16|q4_0|…`, if any `weights-widened=q6_K|…`, and
/// `weights-reencoded=mxfp4` (the kit re-encodes MXFP4 once at load for a device that does
/// not read it, [`StoredTensor::computable`](super::StoredTensor::computable)). A backend
/// whose device reads MXFP4 in place lists it with the others:
/// [`weights_features_reading_mxfp4`].
pub fn weights_features(widened: &[BlockFormat]) -> Vec<String> {
    weights_features_with(widened, false)
}

/// [`weights_features`] of a backend whose device reads MXFP4 in place
/// ([`ModelDevice::reads_mxfp4`](super::ModelDevice::reads_mxfp4)): `mxfp4` among `weights=`.
pub fn weights_features_reading_mxfp4(widened: &[BlockFormat]) -> Vec<String> {
    weights_features_with(widened, true)
}

fn weights_features_with(widened: &[BlockFormat], mxfp4: bool) -> Vec<String> {
    let names = |native: bool| -> Vec<&str> {
        let formats = BLOCK_FORMATS
            .iter()
            .chain(mxfp4.then_some(&BlockFormat::Mxfp4))
            .filter(|f| widened.contains(f) != native);
        formats.map(|f| f.name()).collect()
    };
    let native = ["f32", "f16", "bf16"].into_iter().chain(names(true));
    let mut features = vec![format!("weights={}", native.collect::<Vec<_>>().join("|"))];
    if !widened.is_empty() {
        features.push(format!("weights-widened={}", names(false).join("|")));
    }
    if !mxfp4 {
        features.push(format!("weights-reencoded={}", BlockFormat::Mxfp4.name()));
    }
    features
}

/// The f16 at `b[at..at + 2]`, widened.
#[inline]
pub fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Sub-block `j`'s 6-bit scale and minimum from a Q4_K/Q5_K block's 12 packed bytes
/// (ggml's `get_scale_min_k4`).
#[inline]
pub fn k4_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Values per group of the affine form ([`affine_row`]).
pub const AFFINE_GROUP: usize = 32;

impl BlockFormat {
    /// Bits per code where the format is affine per [`AFFINE_GROUP`] values — `x = scale·c +
    /// bias` with an unsigned code `c` and an f32 scale and bias per group, MLX's affine
    /// quantization — and `None` for Q6_K (its scales cover 16 values).
    pub const fn affine_bits(self) -> Option<u32> {
        match self {
            BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q4K => Some(4),
            BlockFormat::Q5_0 | BlockFormat::Q5_1 | BlockFormat::Q5K => Some(5),
            BlockFormat::Q8_0 => Some(8),
            BlockFormat::Q6K | BlockFormat::Mxfp4 => None,
        }
    }
}

/// The affine form of whole blocks `bytes` of a format with [`BlockFormat::affine_bits`]:
/// value `i` is `codes[i] as f32 * scale[g] + bias[g]` for its group `g = i / 32`, the value
/// [`dequantize_row`] gives (every scale is an f16 times a small integer and every bias a
/// power-of-two multiple of one, or an f16; the products with codes are exact, so the one
/// rounding is the final add, where ggml's arithmetic has it too). Equal as numbers, and bit
/// for bit but for one case: where ggml writes `0·d = −0` (a zero code under a negative
/// scale in Q4_0/Q5_0/Q8_0), `d·c − d·c` is +0.
///
/// Panics when the format is Q6_K or the lengths disagree.
pub fn affine_row(
    format: BlockFormat,
    bytes: &[u8],
    codes: &mut [u8],
    scale: &mut [f32],
    bias: &mut [f32],
) {
    let (be, bb) = (format.block_elems(), format.block_bytes());
    let n = bytes.len() / bb * be;
    assert!(
        format.affine_bits().is_some()
            && bytes.len() % bb == 0
            && codes.len() == n
            && scale.len() == n / AFFINE_GROUP
            && bias.len() == n / AFFINE_GROUP,
        "affine_row: {} bytes of {} into {} codes, {} scales, {} biases",
        bytes.len(),
        format.name(),
        codes.len(),
        scale.len(),
        bias.len()
    );
    let per = be / AFFINE_GROUP;
    let blocks = bytes.chunks_exact(bb).zip(codes.chunks_exact_mut(be));
    for (i, (b, c)) in blocks.enumerate() {
        let (scale, bias) = (&mut scale[i * per..], &mut bias[i * per..]);
        // A 32-value block's codes: low nibbles are values 0..16, high nibbles 16..32; value
        // v's fifth bit (Q5_*) is bit v of `qh`.
        let nibbles = |c: &mut [u8], qs: &[u8], qh: u32| {
            for j in 0..16 {
                c[j] = (qs[j] & 0x0f) | (((qh >> j) & 1) << 4) as u8;
                c[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8;
            }
        };
        let qh_at = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        match format {
            BlockFormat::Q4_0 | BlockFormat::Q5_0 => {
                let d = half_at(b, 0);
                let (offset, qh, qs) = if format == BlockFormat::Q4_0 {
                    (8.0, 0, 2)
                } else {
                    (16.0, qh_at(2), 6)
                };
                nibbles(c, &b[qs..qs + 16], qh);
                (scale[0], bias[0]) = (d, -offset * d);
            }
            BlockFormat::Q4_1 | BlockFormat::Q5_1 => {
                let (qh, qs) = if format == BlockFormat::Q4_1 {
                    (0, 4)
                } else {
                    (qh_at(4), 8)
                };
                nibbles(c, &b[qs..qs + 16], qh);
                (scale[0], bias[0]) = (half_at(b, 0), half_at(b, 2));
            }
            BlockFormat::Q8_0 => {
                // i8 code q is the unsigned code q + 128 under the bias −128·d.
                for (c, &q) in c.iter_mut().zip(&b[2..34]) {
                    *c = q ^ 0x80;
                }
                let d = half_at(b, 0);
                (scale[0], bias[0]) = (d, -128.0 * d);
            }
            BlockFormat::Q4K | BlockFormat::Q5K => {
                let (d, dmin) = (half_at(b, 0), half_at(b, 2));
                let (qh, qs) = if format == BlockFormat::Q5K {
                    (Some(&b[16..48]), &b[48..176])
                } else {
                    (None, &b[16..144])
                };
                // Sub-blocks 2k and 2k+1 are the low and high nibbles of bytes 32k..32k+32;
                // sub-block j's fifth bits are bit j of each `qh` byte.
                for j in 0..8 {
                    let (sc, m) = k4_scale_min(j, &b[4..16]);
                    (scale[j], bias[j]) = (d * f32::from(sc), -(dmin * f32::from(m)));
                    let q = &qs[j / 2 * 32..j / 2 * 32 + 32];
                    for (l, c) in c[j * 32..j * 32 + 32].iter_mut().enumerate() {
                        *c = (q[l] >> (4 * (j % 2))) & 0x0f;
                        if let Some(qh) = qh {
                            *c |= ((qh[l] >> j) & 1) << 4;
                        }
                    }
                }
            }
            BlockFormat::Q6K | BlockFormat::Mxfp4 => unreachable!("asserted above"),
        }
    }
}

/// Dequantizes whole blocks `bytes` into `out` (`out.len()` values: `bytes.len() /
/// block_bytes · block_elems`): the affine formats through [`affine_row`], Q6_K and MXFP4 as
/// ggml writes them. Panics when the lengths disagree.
pub fn dequantize_row(format: BlockFormat, bytes: &[u8], out: &mut [f32]) {
    let (be, bb) = (format.block_elems(), format.block_bytes());
    assert!(
        bytes.len() % bb == 0 && bytes.len() / bb * be == out.len(),
        "dequantize_row: {} bytes of {} into {} values",
        bytes.len(),
        format.name(),
        out.len()
    );
    for (b, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        if format == BlockFormat::Mxfp4 {
            let d = e8m0_half(b[0]);
            for (j, &q) in b[1..17].iter().enumerate() {
                y[j] = f32::from(MXFP4_VALUES[usize::from(q & 0x0f)]) * d;
                y[j + 16] = f32::from(MXFP4_VALUES[usize::from(q >> 4)]) * d;
            }
            continue;
        }
        if format.affine_bits().is_some() {
            let (mut codes, mut scale, mut bias) = ([0u8; 256], [0f32; 8], [0f32; 8]);
            let groups = be / AFFINE_GROUP;
            affine_row(
                format,
                b,
                &mut codes[..be],
                &mut scale[..groups],
                &mut bias[..groups],
            );
            // ggml's `(q − offset)·d` for the formats with an integer offset (the same value,
            // with the sign of a zero product), `scale·c + bias` for the rest.
            let offset = match format {
                BlockFormat::Q4_0 => 8.0,
                BlockFormat::Q5_0 => 16.0,
                BlockFormat::Q8_0 => 128.0,
                _ => 0.0,
            };
            for (i, y) in y.iter_mut().enumerate() {
                let (c, g) = (f32::from(codes[i]), i / AFFINE_GROUP);
                *y = if offset == 0.0 {
                    c * scale[g] + bias[g]
                } else {
                    (c - offset) * scale[g]
                };
            }
            continue;
        }
        let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
        let d = half_at(b, 208);
        for n in 0..2 {
            let (ql, qh, sc) = (&ql[n * 64..], &qh[n * 32..], &sc[n * 8..]);
            let y = &mut y[n * 128..];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * (sc[is] as i8 as f32) * q1 as f32;
                y[l + 32] = d * (sc[is + 2] as i8 as f32) * q2 as f32;
                y[l + 64] = d * (sc[is + 4] as i8 as f32) * q3 as f32;
                y[l + 96] = d * (sc[is + 6] as i8 as f32) * q4 as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_names_round_trip() {
        for f in BLOCK_FORMATS {
            assert_eq!(BlockFormat::from_name(f.name()), Some(f));
            assert_eq!(f.bytes_for(f.block_elems() * 3), 3 * f.block_bytes());
        }
        assert_eq!(BlockFormat::from_ggml_type(12), Some(BlockFormat::Q4K));
        assert_eq!(BlockFormat::from_ggml_type(1), None);
    }

    #[test]
    fn hand_made_blocks_dequantize_as_the_formats_say() {
        // Q8_0: d = 0.5, codes -3 and 4.
        let mut b = f16::from_f32(0.5).to_le_bytes().to_vec();
        b.extend((0..32).map(|j| if j == 0 { (-3i8) as u8 } else { 4 }));
        let mut y = [0f32; 32];
        dequantize_row(BlockFormat::Q8_0, &b, &mut y);
        assert_eq!((y[0], y[31]), (-1.5, 2.0));
        // Q4_0: low nibble of byte 0 is value 0, high nibble value 16.
        let mut b = f16::from_f32(2.0).to_le_bytes().to_vec();
        b.extend([0x9f_u8; 16]);
        dequantize_row(BlockFormat::Q4_0, &b, &mut y);
        assert_eq!((y[0], y[16]), (14.0, 2.0));
        // Q4_K: sub-block 0 scale 3, min 1 (d = 1, dmin = 0.5); sub-block 4 takes its high
        // scale bits from byte 0.
        let mut b = vec![0u8; 144];
        b[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[4] = 3 | (1 << 6);
        b[8] = 1;
        b[12] = 0x02;
        b[16] = 0x05;
        let mut y = [0f32; 256];
        dequantize_row(BlockFormat::Q4K, &b, &mut y);
        assert_eq!(y[0], 3.0 * 5.0 - 0.5);
        assert_eq!(y[1], -0.5);
        // Sub-block 4 (values 128..160): scale (2 | 1<<4) = 18, code 0, min 0.
        assert_eq!(y[128], 0.0);
        assert_eq!(k4_scale_min(4, &b[4..16]), (18, 0));
    }
}

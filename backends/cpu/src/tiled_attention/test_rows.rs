//! Test inputs of the integer kernels ([`super::int8_query`], [`super::i16_values`]):
//! random quantized rows, the block that reads them, the kernels this CPU runs.

use half::f16;
use kvplug_backend_kit::AttendMask;

use super::{Block, QuantRows, Visibility, Width};
use crate::simd::Dot256;

/// A deterministic generator of values in `[0, 1)`.
pub fn stream(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// `nb` random rows of `d` codes of `bits` in groups of `group` values, each group with its
/// own f16 scale (0.001 to 0.3, three magnitudes) and offset (-3 to 1).
pub struct RandomRows {
    /// `[nb, d]`, one code a byte.
    pub codes: Vec<u8>,
    /// As a pool holds them (q4: two a byte, low nibble first).
    pub packed: Vec<u8>,
    /// `[nb, d / group]`.
    pub scales: Vec<f16>,
    pub los: Vec<f16>,
    scale_bits: Vec<u16>,
    lo_bits: Vec<u16>,
    bits: u32,
    group: usize,
    d: usize,
}

impl RandomRows {
    pub fn new(
        next: &mut impl FnMut() -> f32,
        bits: u32,
        group: usize,
        d: usize,
        nb: usize,
    ) -> Self {
        let levels = (1u32 << bits) - 1;
        let codes: Vec<u8> = (0..nb * d)
            .map(|_| (next() * (levels + 1) as f32) as u8)
            .collect();
        let packed: Vec<u8> = match bits {
            8 => codes.clone(),
            _ => codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect(),
        };
        let (scales, los): (Vec<f16>, Vec<f16>) = (0..nb * (d / group))
            .map(|i| {
                (
                    f16::from_f32(0.001 + next() * 0.1 * (1 + i % 3) as f32),
                    f16::from_f32(next() * 4.0 - 3.0),
                )
            })
            .unzip();
        let to_bits = |v: &[f16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
        RandomRows {
            scale_bits: to_bits(&scales),
            lo_bits: to_bits(&los),
            codes,
            packed,
            scales,
            los,
            bits,
            group,
            d,
        }
    }

    /// Sets group scale `i` (of `[nb, d / group]`) to `s`.
    pub fn set_scale(&mut self, i: usize, s: f16) {
        self.scales[i] = s;
        self.scale_bits[i] = s.to_bits();
    }

    /// The kernels' view of the rows.
    pub fn view(&self) -> QuantRows {
        QuantRows::new(
            &self.packed,
            &self.scale_bits,
            &self.lo_bits,
            self.bits,
            self.group,
            self.d,
        )
        .unwrap()
    }
}

/// The block of query rows from 0 over the tile's first `nb` rows (from 0), no mask.
pub fn block(nb: usize, d: usize, scale: f32) -> Block<'static> {
    Block {
        b0: 0,
        j0: 0,
        nb,
        d,
        scale,
        first: 0,
        vis: Visibility {
            mask: AttendMask::None,
            t: 1,
            l: nb,
        },
        int8: None,
        i16: None,
        kend: nb,
    }
}

/// An integer kernel: a width and, at 256 bits, how it multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel {
    pub width: Width,
    pub dot: Dot256,
}

/// The integer kernels this CPU runs (within `KVPLUG_CPU_ISA`): 256 bits by `maddubs` and by
/// each VNNI form it has, then 512 bits.
pub fn kernels() -> Vec<Kernel> {
    let mut kernels = Vec::new();
    let at256 = |dot| Kernel {
        width: Width::Avx2,
        dot,
    };
    if crate::simd::vector_path() {
        kernels.push(at256(Dot256::Maddubs));
    }
    let evex = is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl");
    match crate::simd::dot256() {
        Dot256::Maddubs => {}
        Dot256::Vex if evex => kernels.extend([at256(Dot256::Vex), at256(Dot256::Evex)]),
        dot => kernels.push(at256(dot)),
    }
    if crate::simd::vnni_path() {
        kernels.push(Kernel {
            width: Width::Avx512,
            dot: Dot256::Maddubs,
        });
    }
    kernels
}

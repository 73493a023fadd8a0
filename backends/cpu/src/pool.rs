//! [`CpuPool`]: one layer's K or V rows, SDPA-major `[heads, cells, head_dim]`, in any
//! [`KvDtype`].

use half::{bf16, f16};
use kvplug_backend_kit::KitError;
use kvplug_core::{CacheError, KvDtype};

/// Typed row storage.
#[derive(Clone, Debug)]
pub enum Storage {
    /// f32 rows.
    F32(Vec<f32>),
    /// f16 rows.
    F16(Vec<f16>),
    /// bf16 rows.
    Bf16(Vec<bf16>),
    /// Affine-quantized rows: codes (one byte per value for 8 bits, two values per byte for
    /// 4 bits) plus one f16 scale and offset per group.
    Quant {
        /// 8 or 4.
        bits: u32,
        /// Values per group.
        group: usize,
        /// Codes, `code_bytes` per row.
        codes: Vec<u8>,
        /// f16 scale bits, `groups` per row.
        scales: Vec<u16>,
        /// f16 offset bits, `groups` per row.
        los: Vec<u16>,
    },
}

/// One head's rows of a pool in its storage dtype, `head_dim` values per row (see
/// [`Storage`] for the quantized layout).
#[derive(Clone, Copy, Debug)]
pub enum HeadRows<'a> {
    /// f32 rows.
    F32(&'a [f32]),
    /// f16 rows.
    F16(&'a [f16]),
    /// bf16 rows.
    Bf16(&'a [bf16]),
    /// Quantized rows: codes, f16 scale bits and f16 offset bits.
    Quant {
        /// 8 or 4.
        bits: u32,
        /// Values per group.
        group: usize,
        /// Codes.
        codes: &'a [u8],
        /// Scales.
        scales: &'a [u16],
        /// Offsets.
        los: &'a [u16],
    },
}

/// One layer's K or V pool. Row `h * cells + c` holds head `h` of cell `c`.
#[derive(Clone, Debug)]
pub struct CpuPool {
    /// KV heads.
    pub heads: usize,
    /// Values per row.
    pub head_dim: usize,
    /// Rows per head.
    pub cells: usize,
    /// The rows.
    pub storage: Storage,
}

/// Asks the kernel to back `[p, p + len)` with transparent huge pages where it can (under
/// THP's `madvise` mode): writing a pool, as a session restore does, then faults once per
/// 2 MiB instead of once per 4 KiB, and attention's reads miss the TLB less. Only a hint.
fn huge_pages(p: *mut u8, len: usize) {
    const HUGE: usize = 2 << 20;
    #[cfg(target_os = "linux")]
    if len >= HUGE {
        let start = (p as usize).next_multiple_of(4096);
        let end = (p as usize + len) & !4095;
        // SAFETY: advice on pages inside an allocation this process owns; it changes no
        // contents (failure is ignored: the kernel may not support THP).
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (p, len, HUGE);
}

/// Plain number types whose all-zero bytes are the value zero.
trait Zeroable: Copy {}
impl Zeroable for f32 {}
impl Zeroable for f16 {}
impl Zeroable for bf16 {}
impl Zeroable for u8 {}
impl Zeroable for u16 {}

/// `n` zeros from the allocator's zeroed memory: a large pool comes from the kernel already
/// zero, so no page is touched until a row is written (a pool restored from a session is
/// written once, not cleared first). An allocation the system refuses is an error.
fn zeroed<T: Zeroable>(n: usize) -> Result<Vec<T>, KitError> {
    let refused = |why: String| {
        KitError::Cache(CacheError::capacity(format!(
            "cannot allocate a pool of {n} elements: {why}"
        )))
    };
    let layout = std::alloc::Layout::array::<T>(n).map_err(|e| refused(e.to_string()))?;
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the layout has a non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if p.is_null() {
        return Err(refused("out of memory".into()));
    }
    huge_pages(p.cast(), layout.size());
    // SAFETY: `p` comes from the global allocator with the layout of `n` `T`s (what
    // `from_raw_parts` requires of a capacity-`n` vector), and all `n` are initialised: zero
    // bytes are a valid `T` ([`Zeroable`]).
    Ok(unsafe { Vec::from_raw_parts(p, n, n) })
}

/// `v` (`old` rows per head, each `per_row` elements) resized to `new` rows per head,
/// keeping rows `[0, keep)` of every head.
fn regrown<T: Zeroable>(
    v: &[T],
    heads: usize,
    old: usize,
    new: usize,
    keep: usize,
    per_row: usize,
) -> Result<Vec<T>, KitError> {
    let mut grown = zeroed(heads * new * per_row)?;
    for h in 0..heads {
        let src = &v[h * old * per_row..(h * old + keep) * per_row];
        grown[h * new * per_row..(h * new + keep) * per_row].copy_from_slice(src);
    }
    Ok(grown)
}

impl CpuPool {
    /// A zeroed pool; an allocation the system refuses is an error.
    pub fn new(
        dtype: KvDtype,
        heads: usize,
        head_dim: usize,
        cells: usize,
    ) -> Result<Self, KitError> {
        let n = heads * cells * head_dim;
        let storage = match dtype {
            KvDtype::F32 => Storage::F32(zeroed(n)?),
            KvDtype::F16 => Storage::F16(zeroed(n)?),
            KvDtype::Bf16 => Storage::Bf16(zeroed(n)?),
            KvDtype::Q8 { group } | KvDtype::Q4 { group } => {
                let bits = if matches!(dtype, KvDtype::Q8 { .. }) {
                    8
                } else {
                    4
                };
                let groups = heads * cells * (head_dim / group);
                Storage::Quant {
                    bits,
                    group,
                    codes: zeroed(n * bits as usize / 8)?,
                    scales: zeroed(groups)?,
                    los: zeroed(groups)?,
                }
            }
        };
        Ok(CpuPool {
            heads,
            head_dim,
            cells,
            storage,
        })
    }

    /// The storage dtype.
    pub fn storage_dtype(&self) -> KvDtype {
        match &self.storage {
            Storage::F32(_) => KvDtype::F32,
            Storage::F16(_) => KvDtype::F16,
            Storage::Bf16(_) => KvDtype::Bf16,
            Storage::Quant { bits: 8, group, .. } => KvDtype::Q8 { group: *group },
            Storage::Quant { group, .. } => KvDtype::Q4 { group: *group },
        }
    }

    /// Rows `[0, len)` of head `h`, borrowed (`len` at most `cells`): the history a
    /// [`PoolView`](kvplug_backend_kit::kv_face::PoolView) of this pool covers.
    pub fn head_rows(&self, h: usize, len: usize) -> HeadRows<'_> {
        let (d, r) = (self.head_dim, h * self.cells);
        let rows = |per_row: usize| r * per_row..(r + len) * per_row;
        match &self.storage {
            Storage::F32(v) => HeadRows::F32(&v[rows(d)]),
            Storage::F16(v) => HeadRows::F16(&v[rows(d)]),
            Storage::Bf16(v) => HeadRows::Bf16(&v[rows(d)]),
            Storage::Quant {
                bits,
                group,
                codes,
                scales,
                los,
            } => HeadRows::Quant {
                bits: *bits,
                group: *group,
                codes: &codes[rows(d * *bits as usize / 8)],
                scales: &scales[rows(d / *group)],
                los: &los[rows(d / *group)],
            },
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(v) => 4 * v.len(),
            Storage::F16(v) => 2 * v.len(),
            Storage::Bf16(v) => 2 * v.len(),
            Storage::Quant {
                codes, scales, los, ..
            } => codes.len() + 2 * (scales.len() + los.len()),
        }
    }

    /// Grows to `cells` rows per head keeping rows `[0, keep)`; unchanged when an
    /// allocation fails.
    pub fn grow(&mut self, cells: usize, keep: usize) -> Result<(), KitError> {
        let (h, d, old) = (self.heads, self.head_dim, self.cells);
        match &mut self.storage {
            Storage::F32(v) => *v = regrown(v, h, old, cells, keep, d)?,
            Storage::F16(v) => *v = regrown(v, h, old, cells, keep, d)?,
            Storage::Bf16(v) => *v = regrown(v, h, old, cells, keep, d)?,
            Storage::Quant {
                bits,
                group,
                codes,
                scales,
                los,
            } => {
                let c = regrown(codes, h, old, cells, keep, d * *bits as usize / 8)?;
                let s = regrown(scales, h, old, cells, keep, d / *group)?;
                let l = regrown(los, h, old, cells, keep, d / *group)?;
                (*codes, *scales, *los) = (c, s, l);
            }
        }
        self.cells = cells;
        Ok(())
    }

    /// Stores `src` (`head_dim` values) as head `h` of cell `c`.
    pub fn write_row(&mut self, h: usize, c: usize, src: &[f32]) {
        let (d, r) = (self.head_dim, h * self.cells + c);
        match &mut self.storage {
            Storage::F32(v) => v[r * d..(r + 1) * d].copy_from_slice(src),
            Storage::F16(v) => {
                for (o, &x) in v[r * d..(r + 1) * d].iter_mut().zip(src) {
                    *o = f16::from_f32(x);
                }
            }
            Storage::Bf16(v) => {
                for (o, &x) in v[r * d..(r + 1) * d].iter_mut().zip(src) {
                    *o = bf16::from_f32(x);
                }
            }
            Storage::Quant {
                bits,
                group,
                codes,
                scales,
                los,
            } => {
                let (cb, g) = (d * *bits as usize / 8, d / *group);
                crate::simd::quantize_row(
                    src,
                    *bits,
                    *group,
                    &mut codes[r * cb..(r + 1) * cb],
                    &mut scales[r * g..(r + 1) * g],
                    &mut los[r * g..(r + 1) * g],
                );
            }
        }
    }

    /// Appends head `h`'s rows of cells `c..c + n` in the canonical storage form (values
    /// little-endian; quantized: per row its codes, then an f16 `(scale, lo)` pair per
    /// group). Float rows are one contiguous copy.
    pub fn read_canonical(&self, h: usize, c: usize, n: usize, out: &mut Vec<u8>) {
        let (d, r) = (self.head_dim, h * self.cells + c);
        /// Appends `values` as little-endian bytes (a loop LLVM turns into a copy).
        fn put<const W: usize>(values: impl ExactSizeIterator<Item = [u8; W]>, out: &mut Vec<u8>) {
            let at = out.len();
            out.resize(at + values.len() * W, 0);
            for (o, x) in out[at..].chunks_exact_mut(W).zip(values) {
                o.copy_from_slice(&x);
            }
        }
        let span = r * d..(r + n) * d;
        match &self.storage {
            Storage::F32(v) => put(v[span].iter().map(|x| x.to_le_bytes()), out),
            Storage::F16(v) => put(v[span].iter().map(|x| x.to_le_bytes()), out),
            Storage::Bf16(v) => put(v[span].iter().map(|x| x.to_le_bytes()), out),
            Storage::Quant {
                bits,
                group,
                codes,
                scales,
                los,
            } => {
                let (cb, g) = (d * *bits as usize / 8, d / *group);
                for r in r..r + n {
                    out.extend_from_slice(&codes[r * cb..(r + 1) * cb]);
                    for (s, l) in scales[r * g..(r + 1) * g]
                        .iter()
                        .zip(&los[r * g..(r + 1) * g])
                    {
                        out.extend_from_slice(&s.to_le_bytes());
                        out.extend_from_slice(&l.to_le_bytes());
                    }
                }
            }
        }
    }

    /// Stores canonical rows (as [`CpuPool::read_canonical`] writes them) as head `h` of
    /// cells `c..c + n`, bit for bit. `rows` has exactly `n` rows of the dtype's row bytes.
    pub fn write_canonical(&mut self, h: usize, c: usize, n: usize, rows: &[u8]) {
        let (d, r) = (self.head_dim, h * self.cells + c);
        let u16_at = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
        let span = r * d..(r + n) * d;
        match &mut self.storage {
            Storage::F32(v) => {
                for (o, b) in v[span].iter_mut().zip(rows.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Storage::F16(v) => {
                for (o, b) in v[span].iter_mut().zip(rows.chunks_exact(2)) {
                    *o = f16::from_bits(u16_at(b));
                }
            }
            Storage::Bf16(v) => {
                for (o, b) in v[span].iter_mut().zip(rows.chunks_exact(2)) {
                    *o = bf16::from_bits(u16_at(b));
                }
            }
            Storage::Quant {
                bits,
                group,
                codes,
                scales,
                los,
            } => {
                let (cb, g) = (d * *bits as usize / 8, d / *group);
                for (r, row) in (r..r + n).zip(rows.chunks_exact(cb + 4 * g)) {
                    codes[r * cb..(r + 1) * cb].copy_from_slice(&row[..cb]);
                    for (i, pair) in row[cb..].chunks_exact(4).enumerate() {
                        scales[r * g + i] = u16_at(&pair[..2]);
                        los[r * g + i] = u16_at(&pair[2..]);
                    }
                }
            }
        }
    }

    /// Copies head `h`'s row of cell `from` to cell `to`.
    pub fn copy_row(&mut self, h: usize, from: usize, to: usize) {
        let d = self.head_dim;
        let (rf, rt) = (h * self.cells + from, h * self.cells + to);
        let mv = |len: usize| (rf * len..(rf + 1) * len, rt * len);
        match &mut self.storage {
            Storage::F32(v) => {
                let (s, t) = mv(d);
                v.copy_within(s, t)
            }
            Storage::F16(v) => {
                let (s, t) = mv(d);
                v.copy_within(s, t)
            }
            Storage::Bf16(v) => {
                let (s, t) = mv(d);
                v.copy_within(s, t)
            }
            Storage::Quant {
                bits,
                group,
                codes,
                scales,
                los,
            } => {
                let (s, t) = mv(d * *bits as usize / 8);
                codes.copy_within(s, t);
                let (s, t) = mv(d / *group);
                scales.copy_within(s.clone(), t);
                los.copy_within(s, t);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvplug_backend_kit::quant::dequantize_row;

    impl CpuPool {
        fn read_row(&self, h: usize, c: usize) -> Vec<f32> {
            let (d, r) = (self.head_dim, h * self.cells + c);
            match &self.storage {
                Storage::F32(v) => v[r * d..(r + 1) * d].to_vec(),
                Storage::F16(v) => v[r * d..(r + 1) * d].iter().map(|x| x.to_f32()).collect(),
                Storage::Bf16(v) => v[r * d..(r + 1) * d].iter().map(|x| x.to_f32()).collect(),
                Storage::Quant {
                    bits,
                    group,
                    codes,
                    scales,
                    los,
                } => {
                    let (cb, g) = (d * *bits as usize / 8, d / *group);
                    let mut out = vec![0.0; d];
                    dequantize_row(
                        &codes[r * cb..(r + 1) * cb],
                        &scales[r * g..(r + 1) * g],
                        &los[r * g..(r + 1) * g],
                        *bits,
                        *group,
                        &mut out,
                    );
                    out
                }
            }
        }
    }

    #[test]
    fn growth_keeps_rows_and_footprint_matches_dtype() {
        for dtype in KvDtype::ALL {
            let mut p = CpuPool::new(dtype, 2, 64, 4).unwrap();
            assert_eq!(p.bytes(), 2 * 4 * dtype.row_bytes(64));
            let row: Vec<f32> = (0..64).map(|i| (i as f32 / 9.0).sin()).collect();
            p.write_row(1, 3, &row);
            let stored = p.read_row(1, 3);
            let err = stored
                .iter()
                .zip(&row)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, |m: f32, d| if d > m || d.is_nan() { d } else { m });
            assert!(err < 0.08, "{dtype}: {err}");
            p.grow(8, 4).unwrap();
            assert_eq!(p.bytes(), 2 * 8 * dtype.row_bytes(64));
            assert_eq!(p.read_row(1, 3), stored, "{dtype}: row survives growth");
            p.copy_row(1, 3, 6);
            assert_eq!(p.read_row(1, 6), stored, "{dtype}: row copied");
            assert!(p
                .read_row(0, 6)
                .iter()
                .all(|&x| x == 0.0 || dtype.is_quantized()));
        }
    }
}

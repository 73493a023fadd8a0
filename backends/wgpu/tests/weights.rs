//! The wgpu backend's weight kernels — `linear` (the shaders dequantize each block as they
//! read it) and `embed` — on every stored dtype, against an f64 reference over the kit's
//! dequantization with a bound derived from the shaders' f32 arithmetic, on a device whose
//! storage bindings are capped so that every weight is split into several parts of whole
//! rows (as Qwen's 151,936-row table is on lavapipe's 128 MiB limit).

use std::sync::Arc;

use half::{bf16, f16};
use kvplug_backend_kit::model::blocks::{dequantize_row, BlockFormat, BLOCK_FORMATS};
use kvplug_backend_kit::model::ops::Projection;
use kvplug_backend_kit::model::{ModelDevice, StoredDtype, StoredTensor};
use kvplug_backend_kit::testing::{additive_parts, random_blocks, Rng};
use kvplug_backend_kit::Device;
use kvplug_plugin_api::TensorDtype;
use kvplug_wgpu::context::Tuning;
use kvplug_wgpu::model::WgpuWeight;
use kvplug_wgpu::WgpuDevice;

const COLS: usize = 512;
/// The storage binding cap: the device's own index arena and scratch take 64 KiB bindings.
const CAP: usize = 1 << 16;

/// Bytes of one `COLS`-wide row of `dtype`.
fn row_bytes(dtype: StoredDtype) -> usize {
    COLS / dtype.unit_elems() * dtype.unit_bytes()
}

/// Bytes of one `COLS`-wide row of `dtype` on the device: Q4_0, Q5_0, Q8_0 and Q6_K blocks
/// are two bytes longer there (whole words, model.rs's `block_pad`).
fn device_row_bytes(dtype: StoredDtype) -> usize {
    let padded = [
        BlockFormat::Q4_0,
        BlockFormat::Q5_0,
        BlockFormat::Q8_0,
        BlockFormat::Q6K,
    ];
    match dtype {
        StoredDtype::Block(f) if padded.contains(&f) => {
            row_bytes(dtype) + 2 * (COLS / f.block_elems())
        }
        _ => row_bytes(dtype),
    }
}

/// Rows of a binding part of a weight of `dtype`.
fn part_rows(dtype: StoredDtype) -> usize {
    (CAP - 16) / device_row_bytes(dtype)
}

/// Rows of a weight of `dtype` spanning two whole binding parts and part of a third.
fn rows(dtype: StoredDtype) -> usize {
    let per = part_rows(dtype);
    2 * per + per / 2 + 1
}

/// Every dtype a weight may be stored in, as random valid bytes of `rows(dtype) × COLS`
/// values.
fn weights(rng: &mut Rng) -> Vec<(StoredDtype, Vec<u8>)> {
    let floats = |rng: &mut Rng, dtype| -> Vec<f32> {
        (0..rows(dtype) * COLS).map(|_| rng.signed()).collect()
    };
    let mut out = vec![
        (
            StoredDtype::F32,
            floats(rng, StoredDtype::F32)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        (
            StoredDtype::F16,
            floats(rng, StoredDtype::F16)
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
        ),
        (
            StoredDtype::BF16,
            floats(rng, StoredDtype::BF16)
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect(),
        ),
    ];
    for f in BLOCK_FORMATS {
        let n = rows(StoredDtype::Block(f)) * COLS / f.block_elems();
        let blocks = random_blocks(f, n, rng);
        out.push((StoredDtype::Block(f), blocks));
    }
    out
}

/// Row `r` of a `cols`-wide weight: its values as the kit dequantizes them, and each
/// value's additive part.
fn row_values(dtype: StoredDtype, bytes: &[u8], r: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let rb = cols / dtype.unit_elems() * dtype.unit_bytes();
    let row = &bytes[r * rb..(r + 1) * rb];
    let (mut w, mut m) = (vec![0f32; cols], vec![0f32; cols]);
    match dtype {
        StoredDtype::Block(f) => {
            dequantize_row(f, row, &mut w);
            additive_parts(f, row, &mut m);
        }
        _ => {
            let t = StoredTensor::new(dtype, Arc::new(row.to_vec()), 0..rb).unwrap();
            w = t.to_f32();
        }
    }
    (w, m)
}

/// Over a row's values `w` (additive parts `m`) and the input `x`, in f64: Σ w·x, Σ |w·x|
/// and Σ (|w − m| + |m|)·|x|·(1 + u), the terms of the bounds below.
fn reference_sums(w: &[f32], m: &[f32], x: impl Fn(usize) -> f64) -> (f64, f64, f64) {
    let u = 2f64.powi(-24);
    let (mut want, mut mag, mut parts) = (0f64, 0f64, 0f64);
    for c in 0..w.len() {
        let (w, m, x) = (f64::from(w[c]), f64::from(m[c]), x(c));
        want += w * x;
        mag += (w * x).abs();
        parts += ((w - m).abs() + m.abs()) * x.abs() * (1.0 + u);
    }
    (want, mag, parts)
}

/// Checks `linear` and `embed` for each stored dtype. Bound, with u = 2⁻²⁴ and γ_k =
/// k·u/(1 − k·u): each output is a sum over `COLS` values of products `w·x`, which a shader
/// may group (per block: Σ code·x and Σ x, scaled once; per K-quant sub-block likewise; the
/// tiled product's splits, added last) but in which every term passes through at most
/// one product, `COLS` additions and 3 scalings or subtractions, so the f32 result is
/// within `γ_(COLS+4) · Σ (|w − m| + |m|)·|x|` of the exact sum over the exact dequantized
/// values (`m` the additive part, the two summed apart). The kit's `dequantize_row` rounds
/// `code·d + m` once (`|Δw| ≤ u|w|`) and the f64 reference sum adds `γ⁽⁶⁴⁾_COLS · Σ|w·x|`.
/// An embedded row is one weight value each, rounded at most twice on either side
/// (`2u·(|w − m| + |m|)` per value).
#[test]
fn linear_and_embed_are_within_the_derived_bound_on_split_weights() {
    let mut rng = Rng(17);
    // 2 tokens take the decode kernel, `lanes` invocations a row (up to
    // `Tuning::CPU.rows_tokens`), 20 the tiled one, 140 two tiles of the wide one (the
    // second token half of each invocation's 8 × 8 in the first).
    let x: Vec<f32> = (0..140 * COLS)
        .map(|i| rng.signed() * if i / COLS == 1 { 100.0 } else { 1.0 })
        .collect();
    // The adapter's kernels; (as a GPU runs them) kernels built for each dtype with the
    // tiled product's inner dimension split (in two: `COLS` is 16 steps); the wide tiled
    // product (`Tuning::wide`), whole and split, on bindings as large as the adapter's (140
    // tokens' input exceeds the cap), so on weights of one part.
    let tried: [(bool, u32, bool, &[usize]); 4] = [
        (false, 0, false, &[2, 20]),
        (true, u32::MAX, false, &[2, 20]),
        (false, 0, true, &[20, 140]),
        (false, u32::MAX, true, &[140]),
    ];
    for (by_dtype, tiles, wide, tokens) in tried {
        let tuning = Tuning {
            by_dtype,
            tiles,
            wide,
            ..Tuning::CPU
        };
        let dev = match wide {
            false => WgpuDevice::open_with_binding_limit(CAP as u64, Some(tuning)),
            true => WgpuDevice::open_tuned(tuning),
        };
        let dev =
            dev.unwrap_or_else(|e| panic!("no wgpu adapter (install mesa-vulkan-drivers): {e}"));
        check_weights(&dev, &x, tokens, if wide { 1 } else { 3 }, &mut rng);
    }
}

/// The projections of the first `tokens[i]` tokens of `x` through each dtype's weight (held
/// in `parts` bindings), and its embedded rows, against the reference.
fn check_weights(dev: &WgpuDevice, x: &[f32], tokens: &[usize], parts: usize, rng: &mut Rng) {
    let u = 2f64.powi(-24);
    let gamma = |k: f64| k * u / (1.0 - k * u);
    let gamma64 = COLS as f64 * 2f64.powi(-53);
    for (dtype, bytes) in weights(rng) {
        let rows = rows(dtype);
        let n = bytes.len();
        let stored = StoredTensor::new(dtype, Arc::new(bytes.clone()), 0..n).unwrap();
        let w = dev.weight(stored, rows, COLS).unwrap();
        assert_eq!(w.bindings(), parts, "{}", dtype.name());
        // `linear` on x, then `heads_linear_add` (into zeros) on x laid out heads-major as
        // attention leaves it, heads 64 wide (block formats read them 4 values at a time,
        // `xin4`) and 2 wide (one by one, `xin`): the same sums.
        let inputs = [None, Some(64), Some(2)];
        let got: Vec<Vec<Vec<f32>>> = inputs
            .iter()
            .map(|&hd| {
                let run = |&n: &usize| project(dev, (&w, rows, COLS), &x[..n * COLS], hd);
                tokens.iter().map(run).collect()
            })
            .collect();
        // The first row of each part and the last row.
        let ids: Vec<i32> = (0..rows)
            .step_by(part_rows(dtype))
            .chain([rows - 1])
            .map(|r| r as i32)
            .collect();
        let mut rows_out = dev.zeros(&[ids.len(), COLS]).unwrap();
        dev.embed(&w, &ids, &mut rows_out).unwrap();
        let embedded = dev
            .download(&rows_out, TensorDtype::F32)
            .unwrap()
            .to_f32()
            .unwrap();
        for r in 0..rows {
            let (wv, m) = row_values(dtype, &bytes, r, COLS);
            let runs = got.iter().zip(inputs).flat_map(|(outs, hd)| {
                let outs = outs.iter().zip(tokens);
                outs.flat_map(move |(got, &n)| (0..n).map(move |t| (t, got, hd)))
            });
            for (t, got, hd) in runs {
                let xr = &x[t * COLS..(t + 1) * COLS];
                let (want, mag, parts) = reference_sums(&wv, &m, |c| f64::from(xr[c]));
                let bound = gamma(COLS as f64 + 4.0) * parts + (gamma(1.0) + gamma64) * mag;
                let g = f64::from(got[t * rows + r]);
                assert!(
                    (g - want).abs() <= bound,
                    "{} linear (heads {hd:?}): token {t} row {r}: got {g}, want {want}, |diff| {:e} > {bound:e}",
                    dtype.name(),
                    (g - want).abs()
                );
            }
            if let Some(i) = ids.iter().position(|&id| id as usize == r) {
                for c in 0..COLS {
                    let g = embedded[i * COLS + c];
                    let bound = 2.0 * u * (f64::from(wv[c] - m[c]).abs() + f64::from(m[c]).abs());
                    assert!(
                        (f64::from(g) - f64::from(wv[c])).abs() <= bound,
                        "{} embed: row {r} value {c}: got {g}, want {}",
                        dtype.name(),
                        wv[c]
                    );
                }
            }
        }
    }
}

/// `x` (`[T, cols]`) through `w` (`[rows, cols]`): `linear`, or with `hd` given, `heads_linear_add` into zeros
/// from `x` laid out heads-major (`[cols / hd, T, hd]`).
fn project(
    dev: &WgpuDevice,
    (w, rows, cols): (&WgpuWeight, usize, usize),
    x: &[f32],
    hd: Option<usize>,
) -> Vec<f32> {
    let tokens = x.len() / cols;
    let mut out = dev.zeros(&[tokens, rows]).unwrap();
    match hd {
        None => {
            let xt = dev.tensor(x, &[tokens, cols]).unwrap();
            dev.linear(&xt, w, None, &mut out).unwrap();
        }
        Some(hd) => {
            let heads: Vec<f32> = (0..cols / hd)
                .flat_map(|h| (0..tokens).flat_map(move |t| (0..hd).map(move |d| (h, t, d))))
                .map(|(h, t, d)| x[t * cols + h * hd + d])
                .collect();
            let xt = dev.tensor(&heads, &[cols / hd, tokens, hd]).unwrap();
            let mut merged = dev.zeros(&[tokens, cols]).unwrap();
            let mut scratch = dev.zeros(&[tokens, rows]).unwrap();
            dev.heads_linear_add(&xt, w, None, &mut merged, &mut scratch, &mut out)
                .unwrap();
        }
    }
    dev.download(&out, TensorDtype::F32)
        .unwrap()
        .to_f32()
        .unwrap()
}

/// `rows_main` staging a made input in workgroup memory (`Tuning::stage`; here the merge of
/// attention's heads) over a row of several staged chunks (4608 values: 2048, 2048 and 512)
/// gives the bits of reading the input directly: each lane takes the same values in the same
/// order either way. For a dense and a block format, with 16 lanes a row (4 rows a
/// 64-invocation workgroup) and with 128 (2 rows a 256-invocation one: the block row's
/// second chunk then starts at span 64, not a multiple of the lanes).
#[test]
fn a_staged_input_over_several_chunks_gives_the_direct_reads_bits() {
    const WIDE: usize = 4608;
    const ROWS: usize = 8;
    let mut rng = Rng(29);
    let x: Vec<f32> = (0..2 * WIDE).map(|_| rng.signed()).collect();
    let f = BlockFormat::Q4K;
    let weights = [
        (
            StoredDtype::F16,
            (0..ROWS * WIDE)
                .flat_map(|_| f16::from_f32(rng.signed()).to_le_bytes())
                .collect::<Vec<u8>>(),
        ),
        (
            StoredDtype::Block(f),
            random_blocks(f, ROWS * WIDE / f.block_elems(), &mut rng),
        ),
    ];
    let shapes = [(64, 16), (256, 128)];
    for ((dtype, bytes), (group, max_lanes)) in weights
        .iter()
        .flat_map(|w| shapes.iter().map(move |&s| (w, s)))
    {
        let dtype = *dtype;
        let run = |stage| {
            // Lanes up to max_lanes, one a step: at least 2 rows a workgroup, so the input
            // is staged.
            let tuning = Tuning {
                stage,
                group,
                max_lanes,
                lane_steps: 1,
                ..Tuning::CPU
            };
            let dev = WgpuDevice::open_tuned(tuning).expect("a wgpu adapter");
            let n = bytes.len();
            let stored = StoredTensor::new(dtype, Arc::new(bytes.clone()), 0..n).unwrap();
            let w = dev.weight(stored, ROWS, WIDE).unwrap();
            project(&dev, (&w, ROWS, WIDE), &x, Some(64))
        };
        let (staged, direct) = (run(true), run(false));
        assert!(direct.iter().any(|&v| v != 0.0));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&staged),
            bits(&direct),
            "{} at {max_lanes} lanes",
            dtype.name()
        );
    }
}

/// A normed input staged over several chunks (4608 values, `Tuning::stage`: x·norm staged
/// while its squares are summed, each lane's sum scaled by 1/rms once) and one read
/// directly (1/rms in each value) are both within the derived bound of the f64 normed
/// product. Bound, with u and γ_k as in [`check_weights`], x̂ = x·g (g the norm's weights)
/// and r = 1/rms: the dot over x̂ as there (`γ_(n+4)` of the parts, `γ_1 + γ⁽⁶⁴⁾_n` of the
/// magnitudes), times r; x̂'s roundings (at most 2u); r's, a sum of n positive squares
/// (`γ_n`, halved by the square root) then the mean, the ε, the root and the reciprocal
/// (4u); the product by r (u): `(γ_(n+4) + γ_n / 2 + 8u) · r · parts`.
#[test]
fn a_normed_input_staged_over_several_chunks_is_within_the_bound() {
    const WIDE: usize = 4608;
    const ROWS: usize = 8;
    const TOKENS: usize = 2;
    let (u, eps) = (2f64.powi(-24), 1e-6f32);
    let gamma = |k: f64| k * u / (1.0 - k * u);
    let gamma64 = WIDE as f64 * 2f64.powi(-53);
    let mut rng = Rng(31);
    let x: Vec<f32> = (0..TOKENS * WIDE).map(|_| rng.signed()).collect();
    let g: Vec<f32> = (0..WIDE).map(|_| 1.0 + 0.5 * rng.signed()).collect();
    let f = BlockFormat::Q4K;
    let bytes = random_blocks(f, ROWS * WIDE / f.block_elems(), &mut rng);
    for stage in [true, false] {
        // 16 lanes a row, 4 rows a workgroup: staged where `stage` says.
        let tuning = Tuning {
            stage,
            max_lanes: 16,
            lane_steps: 1,
            ..Tuning::CPU
        };
        let dev = WgpuDevice::open_tuned(tuning).expect("a wgpu adapter");
        let stored = StoredTensor::new(
            StoredDtype::Block(f),
            Arc::new(bytes.clone()),
            0..bytes.len(),
        );
        let w = dev.weight(stored.unwrap(), ROWS, WIDE).unwrap();
        let xt = dev.tensor(&x, &[TOKENS, WIDE]).unwrap();
        let gt = dev.tensor(&g, &[WIDE]).unwrap();
        let mut hn = dev.zeros(&[TOKENS, WIDE]).unwrap();
        let mut out = dev.zeros(&[TOKENS, ROWS]).unwrap();
        let projection = Projection {
            w: &w,
            bias: None,
            out: &mut out,
        };
        dev.norm_linears(&xt, &gt, eps, &mut hn, &mut [projection])
            .unwrap();
        let got = dev
            .download(&out, TensorDtype::F32)
            .unwrap()
            .to_f32()
            .unwrap();
        for t in 0..TOKENS {
            let xr = &x[t * WIDE..(t + 1) * WIDE];
            let squares: f64 = xr.iter().map(|&v| f64::from(v).powi(2)).sum();
            let r = 1.0 / (squares / WIDE as f64 + f64::from(eps)).sqrt();
            for o in 0..ROWS {
                let (wv, m) = row_values(StoredDtype::Block(f), &bytes, o, WIDE);
                let xh = |c: usize| f64::from(xr[c]) * f64::from(g[c]) * r;
                let (want, mag, parts) = reference_sums(&wv, &m, xh);
                let n = WIDE as f64;
                let bound = (gamma(n + 4.0) + gamma(n) / 2.0 + 8.0 * u) * parts
                    + (gamma(1.0) + gamma64) * mag;
                let got = f64::from(got[t * ROWS + o]);
                assert!(
                    (got - want).abs() <= bound,
                    "staged {stage}: token {t} row {o}: got {got}, want {want}, |diff| {:e} > {bound:e}",
                    (got - want).abs()
                );
            }
        }
    }
}

//! Reference recurrences of hybrid models' recurrent layers, in f64: LFM2's short
//! convolution, the gated delta rule of Qwen3.5 / Qwen3-Next linear attention and the
//! Mamba2 selective scan of Granite 4.0-H. Written
//! from the papers' and Hugging Face's definitions, step by step, with no shared code.

use super::attention::gamma;

/// One position of a causal depthwise convolution: `out[c] = Σ_j kernel[c][j] · x_j[c]`,
/// where `window` holds the input rows of the last `width` positions, oldest first, the
/// current one last, and `None` where the sequence had not started (zero, as the
/// convolution's left padding). `kernel` is `[channels, width]` row-major.
pub fn short_conv(window: &[Option<&[f64]>], kernel: &[f64], channels: usize) -> Vec<f64> {
    let width = window.len();
    assert_eq!(
        kernel.len(),
        channels * width,
        "kernel is [channels, width]"
    );
    (0..channels)
        .map(|c| {
            window
                .iter()
                .enumerate()
                .filter_map(|(j, row)| row.map(|r| kernel[c * width + j] * r[c]))
                .sum()
        })
        .collect()
}

/// The largest difference an f32 evaluation of [`short_conv`] may have from it on
/// channel `c`, when its inputs are exactly representable: `width` products summed in any
/// order, `γ(width) · Σ_j |kernel[c][j] · x_j[c]|` (Higham's bound for a dot product).
pub fn short_conv_bound(window: &[Option<&[f64]>], kernel: &[f64], c: usize) -> f64 {
    let width = window.len();
    let magnitude: f64 = window
        .iter()
        .enumerate()
        .filter_map(|(j, row)| row.map(|r| (kernel[c * width + j] * r[c]).abs()))
        .sum();
    gamma(width) * magnitude
}

/// One token of the gated delta rule on one head (Yang et al., "Gated Delta Networks"; the
/// recurrent form of Hugging Face's Qwen3-Next): with `q` and `k` L2-normalized and `q`
/// scaled by `1/√dk`, the state `S` (`[dk, dv]` row-major) decays by `exp(g)`, then moves
/// toward `v` along `k` by `beta`:
///
/// `S ← exp(g)·S;  S ← S + k ⊗ beta·(v − Sᵀk);  out = Sᵀq`.
///
/// `g` is the log decay (`<= 0`), `beta` in `[0, 1]`. Returns `out` (`[dv]`).
pub fn gated_delta_step(
    state: &mut [f64],
    q: &[f64],
    k: &[f64],
    v: &[f64],
    g: f64,
    beta: f64,
) -> Vec<f64> {
    let (dk, dv) = (k.len(), v.len());
    assert_eq!(state.len(), dk * dv, "state is [dk, dv]");
    assert_eq!(q.len(), dk, "q and k have dk values");
    let unit = |x: &[f64]| -> Vec<f64> {
        // Hugging Face's l2norm: x / sqrt(Σx² + 1e-6).
        let n = (x.iter().map(|a| a * a).sum::<f64>() + 1e-6).sqrt();
        x.iter().map(|a| a / n).collect()
    };
    let scale = 1.0 / (dk as f64).sqrt();
    let q: Vec<f64> = unit(q).into_iter().map(|a| a * scale).collect();
    let k = unit(k);
    let decay = g.exp();
    state.iter_mut().for_each(|s| *s *= decay);
    // What the state recalls for k, then the correction toward v.
    let recalled: Vec<f64> = (0..dv)
        .map(|j| (0..dk).map(|i| state[i * dv + j] * k[i]).sum())
        .collect();
    for i in 0..dk {
        for j in 0..dv {
            state[i * dv + j] += k[i] * beta * (v[j] - recalled[j]);
        }
    }
    (0..dv)
        .map(|j| (0..dk).map(|i| state[i * dv + j] * q[i]).sum())
        .collect()
}

/// One token of one Mamba2 head's selective scan (Dao and Gu, "Transformers are SSMs"; the
/// recurrent form of Hugging Face's `Mamba2Mixer`): with the step `dt = softplus(dt_raw)`
/// (`dt_raw` the projection plus its bias), the state `S` (`[head_dim, state]` row-major)
/// decays by `exp(dt·a)` (`a = −exp(A_log) < 0`) and takes in `dt · x ⊗ B`:
///
/// `S ← exp(dt·a)·S + dt·x ⊗ B;  y = S·C + d·x`.
///
/// Returns `y` (`[head_dim]`).
pub fn mamba2_step(
    state: &mut [f64],
    x: &[f64],
    b: &[f64],
    c: &[f64],
    dt_raw: f64,
    a: f64,
    d: f64,
) -> Vec<f64> {
    let n = b.len();
    assert_eq!(state.len(), x.len() * n, "state is [head_dim, state]");
    assert_eq!(c.len(), n, "B and C have the state's size");
    let dt = dt_raw.exp().ln_1p();
    let decay = (dt * a).exp();
    x.iter()
        .enumerate()
        .map(|(i, &xi)| {
            let row = &mut state[i * n..(i + 1) * n];
            for (s, &bj) in row.iter_mut().zip(b) {
                *s = decay * *s + dt * xi * bj;
            }
            row.iter().zip(c).map(|(s, cj)| s * cj).sum::<f64>() + d * xi
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_convolution_weighs_the_last_rows_oldest_first_and_pads_with_zeros() {
        // Two channels, three taps: channel 0 = [1, 2, 3], channel 1 = [10, 20, 30].
        let kernel = [1.0, 2.0, 3.0, 10.0, 20.0, 30.0];
        let (a, b, c) = ([1.0, -1.0], [0.5, 2.0], [4.0, 0.25]);
        let out = short_conv(&[Some(&a), Some(&b), Some(&c)], &kernel, 2);
        assert_eq!(out, [1.0 + 1.0 + 12.0, -10.0 + 40.0 + 7.5]);
        // At the start of a sequence the missing rows count as zeros.
        let out = short_conv(&[None, None, Some(&c)], &kernel, 2);
        assert_eq!(out, [12.0, 7.5]);
        assert_eq!(
            short_conv_bound(&[None, Some(&b), Some(&c)], &kernel, 1),
            gamma(3) * (40.0 + 7.5)
        );
    }

    #[test]
    fn a_mamba2_head_takes_in_x_along_b_reads_along_c_and_decays() {
        // head_dim 2, state 2; dt_raw = ln(e − 1) makes dt = 1 exactly (softplus).
        let dt_raw = (std::f64::consts::E - 1.0).ln();
        let mut s = vec![0.0; 4];
        let y = mamba2_step(
            &mut s,
            &[2.0, -1.0],
            &[1.0, 0.5],
            &[0.0, 1.0],
            dt_raw,
            -0.5,
            0.0,
        );
        assert!(s
            .iter()
            .zip([2.0, 1.0, -1.0, -0.5])
            .all(|(a, b)| (a - b).abs() < 1e-12));
        assert!(
            (y[0] - 1.0).abs() < 1e-12 && (y[1] + 0.5).abs() < 1e-12,
            "{y:?}"
        );
        // A zero input only decays, by exp(dt·a); d adds x directly.
        let y = mamba2_step(
            &mut s,
            &[0.0, 0.0],
            &[1.0, 1.0],
            &[1.0, 0.0],
            dt_raw,
            -0.5,
            3.0,
        );
        let decay = (-0.5f64).exp();
        assert!((s[0] - 2.0 * decay).abs() < 1e-12 && (s[3] + 0.5 * decay).abs() < 1e-12);
        assert!((y[0] - 2.0 * decay).abs() < 1e-12 && (y[1] + decay).abs() < 1e-12);
        let mut s = vec![0.0; 2];
        let y = mamba2_step(&mut s, &[4.0], &[0.0, 0.0], &[1.0, 1.0], dt_raw, -1.0, 0.25);
        assert_eq!(y, [1.0]);
    }

    #[test]
    fn the_delta_rule_stores_a_value_recalls_it_and_decays() {
        // dk = 2, dv = 1. From a zero state, k = q = e0 and beta = 1 store v exactly:
        // out = Sᵀq = v · (k̂·q̂) / √2.
        let mut s = vec![0.0; 2];
        let out = gated_delta_step(&mut s, &[1.0, 0.0], &[1.0, 0.0], &[3.0], 0.0, 1.0);
        let unit = 1.0 / (1.0f64 + 1e-6).sqrt();
        assert!((s[0] - 3.0 * unit).abs() < 1e-12 && s[1] == 0.0, "{s:?}");
        assert!((out[0] - 3.0 * unit * unit / 2f64.sqrt()).abs() < 1e-12);
        // Writing the same key again with beta = 1 replaces the value (the delta rule's
        // point: Sᵀk is corrected toward the new v, not added to), after the decay.
        let mut s2 = s.clone();
        gated_delta_step(
            &mut s2,
            &[1.0, 0.0],
            &[1.0, 0.0],
            &[-1.0],
            (0.5f64).ln(),
            1.0,
        );
        let recalled = s2[0] * unit;
        let expect = 0.5 * s[0] * unit + unit * unit * (-1.0 - 0.5 * s[0] * unit);
        assert!((recalled - expect).abs() < 1e-12, "{recalled} vs {expect}");
        // beta = 0 only decays; an orthogonal key leaves the first slot alone.
        let mut s3 = s.clone();
        gated_delta_step(
            &mut s3,
            &[0.0, 1.0],
            &[0.0, 1.0],
            &[5.0],
            (0.25f64).ln(),
            0.0,
        );
        assert!((s3[0] - 0.25 * s[0]).abs() < 1e-12 && s3[1] == 0.0);
        let mut s4 = s.clone();
        gated_delta_step(&mut s4, &[0.0, 1.0], &[0.0, 1.0], &[5.0], 0.0, 1.0);
        assert_eq!(s4[0], s[0]);
        assert!((s4[1] - 5.0 * unit).abs() < 1e-12);
    }
}

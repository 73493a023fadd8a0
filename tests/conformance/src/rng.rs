//! Deterministic inputs from (seed, op index, layer, tensor), via splitmix64, in two
//! distributions ([`Inputs`]).

/// Which tensor a value stream feeds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// Queries.
    Q = 1,
    /// Keys.
    K = 2,
    /// Values.
    V = 3,
}

/// How q/k/v values are drawn.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Inputs {
    /// Every value uniform in [-1, 1).
    #[default]
    Uniform,
    /// Like real activations: K and V rows are uniform in [-1, 1) except for two outlier
    /// channels per (layer, head) — fixed across tokens, as real keys have them — of
    /// magnitude 7.5–50; one row in eight (per head) is "quiet", a constant plus noise of
    /// 1e-4 (quantization groups with near-zero, even subnormal f16 scales), and one in
    /// sixteen exactly constant (scale 0). Queries stay uniform.
    Outliers,
}

impl Inputs {
    /// Both distributions.
    pub const ALL: [Inputs; 2] = [Inputs::Uniform, Inputs::Outliers];

    /// `uniform` / `outliers`.
    pub fn as_str(self) -> &'static str {
        match self {
            Inputs::Uniform => "uniform",
            Inputs::Outliers => "outliers",
        }
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A uniform value in [0, 1) from a hash.
fn unit(h: u64) -> f32 {
    (h >> 40) as f32 / (1u64 << 24) as f32
}

/// `n` values in [-1, 1) for (seed, op, layer, stream).
pub fn uniform(seed: u64, op: usize, layer: usize, stream: Stream, n: usize) -> Vec<f32> {
    let mut state =
        splitmix(seed ^ splitmix((op as u64) << 20 ^ (layer as u64) << 4 ^ stream as u64));
    (0..n)
        .map(|_| {
            state = splitmix(state);
            unit(state) * 2.0 - 1.0
        })
        .collect()
}

/// A `[heads, t, d]` tensor for (seed, op, layer, stream) drawn from `inputs`.
#[allow(clippy::too_many_arguments)]
pub fn activations(
    inputs: Inputs,
    seed: u64,
    op: usize,
    layer: usize,
    stream: Stream,
    heads: usize,
    t: usize,
    d: usize,
) -> Vec<f32> {
    let mut x = uniform(seed, op, layer, stream, heads * t * d);
    if inputs == Inputs::Uniform || stream == Stream::Q {
        return x;
    }
    let key = |h: usize, salt: u64| {
        splitmix(
            seed ^ splitmix((layer as u64) << 24 ^ (h as u64) << 8 ^ (stream as u64) << 4 ^ salt),
        )
    };
    for h in 0..heads {
        // Outlier channels and magnitudes depend on the layer and head only.
        let outliers: Vec<(usize, f32)> = (0..2u64)
            .map(|c| {
                let r = key(h, c);
                let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
                (
                    (r >> 8) as usize % d,
                    sign * (10.0 + 40.0 * unit(splitmix(r))),
                )
            })
            .collect();
        for i in 0..t {
            let row = &mut x[(h * t + i) * d..][..d];
            let r = splitmix(key(h, 99) ^ (op as u64) << 32 ^ i as u64);
            match r % 16 {
                0 => row.fill(row[0]),
                1 | 9 => {
                    let c = row[0];
                    for (k, v) in row.iter_mut().enumerate() {
                        *v = c + 1e-4 * unit(splitmix(r ^ k as u64));
                    }
                }
                _ => {
                    for &(ch, m) in &outliers {
                        row[ch] = m * (0.75 + 0.25 * row[ch].abs());
                    }
                }
            }
        }
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_in_range() {
        let a = uniform(1, 3, 0, Stream::K, 1000);
        assert_eq!(a, uniform(1, 3, 0, Stream::K, 1000));
        assert_ne!(a, uniform(1, 3, 0, Stream::V, 1000));
        assert_ne!(a, uniform(2, 3, 0, Stream::K, 1000));
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean: f32 = a.iter().sum::<f32>() / 1000.0;
        assert!(mean.abs() < 0.1, "{mean}");
    }

    #[test]
    fn outlier_inputs_have_wide_spans_and_quiet_rows() {
        let (heads, t, d) = (2, 64, 64);
        let k = activations(Inputs::Outliers, 5, 1, 0, Stream::K, heads, t, d);
        let rows: Vec<&[f32]> = k.chunks_exact(d).collect();
        let span = |r: &[f32]| {
            let (lo, hi) = r
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            hi - lo
        };
        let wide = rows.iter().filter(|r| span(r) >= 10.0).count();
        let quiet = rows
            .iter()
            .filter(|r| span(r) > 0.0 && span(r) <= 1e-4)
            .count();
        let constant = rows.iter().filter(|r| span(r) == 0.0).count();
        assert!(wide >= rows.len() / 2, "{wide} wide rows");
        assert!(
            quiet >= 2 && constant >= 1,
            "{quiet} quiet, {constant} constant"
        );
        // The outlier channels stay put from one op to the next.
        let k2 = activations(Inputs::Outliers, 5, 2, 0, Stream::K, heads, t, d);
        let big = |x: &[f32]| (0..d).filter(|&c| x[c].abs() >= 10.0).collect::<Vec<_>>();
        let channels = big(rows.iter().find(|r| span(r) >= 10.0).unwrap());
        let later = k2.chunks_exact(d).find(|r| span(r) >= 10.0).unwrap();
        assert_eq!(big(later), channels);
        assert_eq!(
            activations(Inputs::Outliers, 5, 1, 0, Stream::Q, heads, t, d),
            uniform(5, 1, 0, Stream::Q, heads * t * d)
        );
    }
}

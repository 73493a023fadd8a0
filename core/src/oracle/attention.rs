//! Naive scaled-dot-product attention in f64.

/// Shapes of one attention call. q and the output are `[n_q_heads, n_tok, head_dim]`;
/// k and v are `[n_kv_heads, read_len, head_dim]`. Query head `h` reads KV head
/// `h / (n_q_heads / n_kv_heads)` (GQA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    /// Query heads (a multiple of `n_kv_heads`).
    pub n_q_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Query tokens `T`.
    pub n_tok: usize,
    /// Read window `L`.
    pub read_len: usize,
    /// Values per head row.
    pub head_dim: usize,
}

/// Which keys each query attends.
#[derive(Clone, Copy, Debug)]
pub enum RefMask<'a> {
    /// All of them.
    None,
    /// Lower-right aligned: query `i` sees keys `j <= L - T + i`.
    Causal,
    /// Row-major `[T, L]`, `true` = attend.
    Explicit(&'a [bool]),
}

impl RefMask<'_> {
    fn visible(&self, i: usize, j: usize, t: usize, l: usize) -> bool {
        match self {
            RefMask::None => true,
            RefMask::Causal => j + t <= l + i,
            RefMask::Explicit(m) => m[i * l + j],
        }
    }
}

/// `softmax(q·kᵀ·scale + mask)·v`, with a query that sees no key giving zeros.
pub fn attend(
    dims: AttnDims,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    scale: f64,
    mask: RefMask,
) -> Vec<f64> {
    let AttnDims {
        n_q_heads,
        n_kv_heads,
        n_tok: t,
        read_len: l,
        head_dim: d,
    } = dims;
    assert_eq!(q.len(), n_q_heads * t * d, "q shape");
    assert_eq!(k.len(), n_kv_heads * l * d, "k shape");
    assert_eq!(v.len(), n_kv_heads * l * d, "v shape");
    assert_eq!(n_q_heads % n_kv_heads, 0, "GQA group");
    let group = n_q_heads / n_kv_heads;
    let mut out = vec![0.0; n_q_heads * t * d];
    for h in 0..n_q_heads {
        let kh = h / group;
        for i in 0..t {
            let qrow = &q[(h * t + i) * d..][..d];
            let scores: Vec<Option<f64>> = (0..l)
                .map(|j| {
                    mask.visible(i, j, t, l).then(|| {
                        let krow = &k[(kh * l + j) * d..][..d];
                        qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>() * scale
                    })
                })
                .collect();
            let Some(max) = scores.iter().flatten().copied().reduce(f64::max) else {
                continue;
            };
            let weights: Vec<f64> = scores
                .iter()
                .map(|s| s.map_or(0.0, |s| (s - max).exp()))
                .collect();
            let total: f64 = weights.iter().sum();
            let orow = &mut out[(h * t + i) * d..][..d];
            for (j, w) in weights.iter().enumerate() {
                let vrow = &v[(kh * l + j) * d..][..d];
                for (o, x) in orow.iter_mut().zip(vrow) {
                    *o += w / total * x;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_returns_its_value() {
        let dims = AttnDims {
            n_q_heads: 2,
            n_kv_heads: 1,
            n_tok: 1,
            read_len: 1,
            head_dim: 2,
        };
        let out = attend(
            dims,
            &[1.0, 2.0, -3.0, 0.5],
            &[0.3, 0.4],
            &[5.0, -6.0],
            0.7,
            RefMask::None,
        );
        assert_eq!(out, vec![5.0, -6.0, 5.0, -6.0]);
    }

    #[test]
    fn equal_scores_average_values_and_causal_is_tail_aligned() {
        let dims = AttnDims {
            n_q_heads: 1,
            n_kv_heads: 1,
            n_tok: 2,
            read_len: 3,
            head_dim: 1,
        };
        // q = 0 makes every score equal; outputs are means of the visible values.
        let v = [3.0, 6.0, 9.0];
        let out = attend(
            dims,
            &[0.0, 0.0],
            &[1.0, 2.0, 3.0],
            &v,
            1.0,
            RefMask::Causal,
        );
        assert_eq!(out, vec![4.5, 6.0]);
        let mask = [true, false, true, false, true, false];
        let out = attend(
            dims,
            &[0.0, 0.0],
            &[1.0, 2.0, 3.0],
            &v,
            1.0,
            RefMask::Explicit(&mask),
        );
        assert_eq!(out, vec![6.0, 6.0]);
        let none = [false; 6];
        let out = attend(
            dims,
            &[0.0, 0.0],
            &[1.0, 2.0, 3.0],
            &v,
            1.0,
            RefMask::Explicit(&none),
        );
        assert_eq!(out, vec![0.0, 0.0]);
    }

    #[test]
    fn softmax_weights_follow_scores() {
        let dims = AttnDims {
            n_q_heads: 1,
            n_kv_heads: 1,
            n_tok: 1,
            read_len: 2,
            head_dim: 1,
        };
        // scores 0 and ln 3 → weights 1/4, 3/4.
        let out = attend(
            dims,
            &[1.0],
            &[0.0, 3f64.ln()],
            &[4.0, 8.0],
            1.0,
            RefMask::None,
        );
        assert!((out[0] - 7.0).abs() < 1e-12);
    }
}

//! Mixture-of-experts feed-forward: the router's choice ([`route`]: which experts each token
//! runs and with what weight), the routes grouped by expert ([`ExpertGroups`]: a step reads
//! each chosen expert's weights once, for all of its tokens) and the experts' weights
//! ([`Expert`]), kept in place as rows of the file's 3-D expert tensors.

use super::config::{Experts, Gating};
use super::ops::ModelDevice;

/// One expert's gated MLP: `down(act(gate·x + b_g, up·x + b_u)) + b_d`, the biases where
/// the model has them (GPT-OSS).
pub struct Expert<D: ModelDevice> {
    pub gate: D::Weight,
    pub up: D::Weight,
    pub down: D::Weight,
    pub gate_bias: Option<D::Tensor>,
    pub up_bias: Option<D::Tensor>,
    pub down_bias: Option<D::Tensor>,
}

/// The router's choice for a step's tokens: token `t`'s slot `j` (`j < per_token`, best
/// first) runs expert `experts[t·per_token + j]` with weight `weights[t·per_token + j]`.
#[derive(Clone, Debug, Default)]
pub struct Routes {
    pub per_token: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Routes {
    /// Tokens routed.
    pub fn tokens(&self) -> usize {
        self.experts.len() / self.per_token.max(1)
    }
}

/// The smallest sum of chosen probabilities a renormalization divides by (llama.cpp's
/// clamp, the smallest normal f16): a sum below it is not amplified past `1/min`.
pub const MIN_WEIGHT_SUM: f32 = 6.103_515_6e-5;

/// Routes `logits` (`[T, experts.count]`, a row per token) into `routes`, reusing its
/// buffers: the `per_token` highest-scoring experts best first (ties to the lower index),
/// weighted as `experts.gating` says. [`Gating::Softmax`]: by their probabilities in a
/// softmax over every expert (max subtracted, f32), divided by their sum (at least
/// [`MIN_WEIGHT_SUM`]) when `experts.renormalize`. [`Gating::TopKSoftmax`]: by a softmax
/// over the chosen logits alone. Non-finite logits still give `per_token` distinct experts
/// per token (which ones is unspecified).
pub fn route(logits: &[f32], experts: &Experts, routes: &mut Routes) {
    let (n, k) = (experts.count, experts.per_token);
    routes.per_token = k;
    routes.experts.clear();
    routes.weights.clear();
    for row in logits.chunks_exact(n) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = match experts.gating {
            Gating::Softmax => row.iter().map(|&z| (z - max).exp()).sum(),
            Gating::TopKSoftmax => 0.0,
        };
        let at = routes.experts.len();
        // Insertion into the k best so far: strictly greater moves up, so among equals the
        // lower index (seen first) stays ahead.
        for (e, &z) in row.iter().enumerate() {
            // The score experts are chosen by; the softmax is monotone, so the choice is
            // the same either way.
            let p = match experts.gating {
                Gating::Softmax => (z - max).exp() / sum,
                Gating::TopKSoftmax => z,
            };
            let chosen = &routes.weights[at..];
            let slot = chosen.iter().position(|&q| p > q).unwrap_or(chosen.len());
            if slot == k {
                continue;
            }
            if chosen.len() == k {
                routes.experts.pop();
                routes.weights.pop();
            }
            routes.experts.insert(at + slot, e as u32);
            routes.weights.insert(at + slot, p);
        }
        if experts.gating == Gating::TopKSoftmax {
            let chosen = &mut routes.weights[at..];
            let top = chosen[0];
            chosen.iter_mut().for_each(|z| *z = (*z - top).exp());
            let total: f32 = chosen.iter().sum();
            chosen.iter_mut().for_each(|w| *w /= total);
        } else if experts.renormalize {
            let chosen = &mut routes.weights[at..];
            let total = chosen.iter().sum::<f32>().max(MIN_WEIGHT_SUM);
            chosen.iter_mut().for_each(|w| *w /= total);
        }
    }
}

/// [`Routes`] grouped by expert: `pairs[starts[e]..starts[e + 1]]` are the route indices
/// (`t·per_token + j`) that run expert `e`, in token order; `at[i]` is route `i`'s place in
/// `pairs`. Rebuilt in place by [`ExpertGroups::group`].
#[derive(Clone, Debug, Default)]
pub struct ExpertGroups {
    pub starts: Vec<usize>,
    pub pairs: Vec<usize>,
    pub at: Vec<usize>,
}

impl ExpertGroups {
    /// Groups `routes` over `count` experts (a counting sort; no allocation once the
    /// buffers have grown). Panics if a route names an expert `>= count`.
    pub fn group(&mut self, routes: &Routes, count: usize) {
        self.starts.clear();
        self.starts.resize(count + 1, 0);
        for &e in &routes.experts {
            self.starts[e as usize + 1] += 1;
        }
        for e in 0..count {
            self.starts[e + 1] += self.starts[e];
        }
        let n = routes.experts.len();
        self.pairs.clear();
        self.pairs.resize(n, 0);
        self.at.clear();
        self.at.resize(n, 0);
        // `at` counts up from each group's start while placing, then holds the places.
        for (i, &e) in routes.experts.iter().enumerate() {
            self.at[i] = self.starts[e as usize];
            self.starts[e as usize] += 1;
            self.pairs[self.at[i]] = i;
        }
        for e in (0..count).rev() {
            self.starts[e + 1] = self.starts[e];
        }
        self.starts[0] = 0;
    }

    /// The experts with at least one route, each with its range in `pairs`.
    pub fn used(&self) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
        self.starts
            .windows(2)
            .enumerate()
            .filter(|(_, w)| w[1] > w[0])
            .map(|(e, w)| (e, w[0]..w[1]))
    }
}

/// Refuses routes and groups that do not fit each other, `t` tokens and `count` experts
/// (what [`ModelDevice::experts`] implementations index by).
pub fn check(routes: &Routes, groups: &ExpertGroups, t: usize, count: usize) -> Result<(), String> {
    let n = routes.experts.len();
    let fits = routes.per_token > 0
        && n == t * routes.per_token
        && routes.weights.len() == n
        && groups.pairs.len() == n
        && groups.at.len() == n
        && groups.starts.len() == count + 1
        && groups.starts.last() == Some(&n)
        && groups.pairs.iter().all(|&p| p < n)
        && groups.at.iter().all(|&a| a < n)
        && routes.experts.iter().all(|&e| (e as usize) < count);
    if fits {
        Ok(())
    } else {
        Err(format!(
            "experts: {n} routes of {} per token for {t} tokens over {count} experts do not \
             fit their groups",
            routes.per_token
        ))
    }
}

/// `out[t] = Σ_j weights[t·k + j] · rows[at[t·k + j]]` summed in slot order `j` from zero:
/// the experts' outputs (`rows`, `[routes, n]` in grouped order) combined per token into
/// `out` (`[T, n]`). Every backend sums in this order, so a token's result does not depend
/// on the batch it ran in.
pub fn combine(routes: &Routes, groups: &ExpertGroups, rows: &[f32], n: usize, out: &mut [f32]) {
    let k = routes.per_token;
    for (t, o) in out.chunks_exact_mut(n).enumerate() {
        o.fill(0.0);
        for j in 0..k {
            let (w, at) = (routes.weights[t * k + j], groups.at[t * k + j]);
            o.iter_mut()
                .zip(&rows[at * n..(at + 1) * n])
                .for_each(|(o, y)| *o += w * y);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn experts(count: usize, per_token: usize, renormalize: bool) -> Experts {
        Experts {
            count,
            per_token,
            width: 1,
            renormalize,
            gating: Gating::Softmax,
            activation: super::super::config::Activation::Silu,
        }
    }

    /// The router's choice, against probabilities written out by hand (f64 softmax).
    #[test]
    fn routes_pick_the_most_probable_best_first_and_renormalize() {
        let logits = [0.5f32, 2.0, -1.0, 1.0, 2.0, 0.0];
        let z: Vec<f64> = logits.iter().map(|&x| f64::from(x).exp()).collect();
        let total: f64 = z.iter().sum();
        let p = |e: usize| z[e] / total;
        let mut r = Routes::default();
        route(&logits, &experts(6, 3, false), &mut r);
        // Experts 1 and 4 tie: the lower index first; then 3.
        assert_eq!(r.experts, [1, 4, 3]);
        for (w, e) in r.weights.iter().zip([1, 4, 3]) {
            assert!((f64::from(*w) - p(e)).abs() < 1e-6, "{w} vs {}", p(e));
        }
        route(&logits, &experts(6, 3, true), &mut r);
        let chosen = p(1) + p(4) + p(3);
        for (w, e) in r.weights.iter().zip([1, 4, 3]) {
            assert!((f64::from(*w) - p(e) / chosen).abs() < 1e-6);
        }
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        // Two tokens, one expert each; all equal logits choose expert 0.
        route(
            &[0.0, 0.0, 0.0, 3.0, -1.0, 5.0],
            &experts(3, 1, true),
            &mut r,
        );
        assert_eq!((r.experts.as_slice(), r.tokens()), (&[0, 2][..], 2));
        assert_eq!(r.weights, [1.0, 1.0]);
        // top-k = all experts: every one, in order of probability.
        route(&[1.0, 3.0, 2.0], &experts(3, 3, false), &mut r);
        assert_eq!(r.experts, [1, 2, 0]);
        // GPT-OSS's gating: the top-k logits, a softmax over them alone.
        let top_k = Experts {
            gating: Gating::TopKSoftmax,
            ..experts(6, 3, false)
        };
        route(&logits, &top_k, &mut r);
        assert_eq!(r.experts, [1, 4, 3]);
        let (a, b) = (1f64, (-1f64).exp());
        let want = [a / (2.0 * a + b), a / (2.0 * a + b), b / (2.0 * a + b)];
        for (w, want) in r.weights.iter().zip(want) {
            assert!((f64::from(*w) - want).abs() < 1e-6, "{w} vs {want}");
        }
        // Non-finite logits still route each token to distinct experts.
        route(
            &[f32::NAN, 0.0, f32::INFINITY],
            &experts(3, 2, false),
            &mut r,
        );
        assert!(r.experts.len() == 2 && r.experts[0] != r.experts[1]);
    }

    #[test]
    fn groups_list_each_experts_routes_in_token_order_and_combine_sums_by_slot() {
        let r = Routes {
            per_token: 2,
            experts: vec![2, 0, 0, 2, 1, 2],
            weights: vec![0.75, 0.25, 0.5, 0.5, 1.0, 2.0],
        };
        let mut g = ExpertGroups::default();
        g.group(&r, 4);
        assert_eq!(g.starts, [0, 2, 3, 6, 6]);
        assert_eq!(g.pairs, [1, 2, 4, 0, 3, 5]);
        for (i, &p) in g.pairs.iter().enumerate() {
            assert_eq!(g.at[p], i);
        }
        let used: Vec<_> = g.used().collect();
        assert_eq!(used, [(0, 0..2), (1, 2..3), (2, 3..6)]);
        // Expert e's output row for route i is [e, i] (grouped order).
        let rows: Vec<f32> = g
            .pairs
            .iter()
            .flat_map(|&i| [r.experts[i] as f32, i as f32])
            .collect();
        let mut out = [9.0f32; 6];
        combine(&r, &g, &rows, 2, &mut out);
        let want = |t: usize| {
            let (a, b) = (2 * t, 2 * t + 1);
            [
                r.weights[a] * r.experts[a] as f32 + r.weights[b] * r.experts[b] as f32,
                r.weights[a] * a as f32 + r.weights[b] * b as f32,
            ]
        };
        assert_eq!(out.to_vec(), [want(0), want(1), want(2)].concat());
    }
}

//! [`Sampler`]: how a token is picked from a row of logits (greedy, or temperature with
//! top-k and top-p, seeded), and the log-probability of a pick.

/// Greedy (temperature 0) or temperature + top-p sampling with a seed.
#[derive(Clone, Debug)]
pub struct Sampler {
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    state: u64,
}

impl Sampler {
    /// A sampler; greedy when `temperature <= 0`.
    pub fn new(temperature: f32, top_p: f32, seed: u64) -> Self {
        Sampler {
            temperature,
            top_p,
            top_k: 0,
            state: seed ^ 0x2545_F491_4F6C_DD1D,
        }
    }

    /// Always the argmax.
    pub fn greedy() -> Self {
        Sampler::new(0.0, 1.0, 0)
    }

    /// The same sampler restricted to the `k` most likely tokens (0 = no limit), applied
    /// before `top_p` as Hugging Face and llama.cpp do.
    pub fn with_top_k(mut self, k: usize) -> Self {
        self.top_k = k;
        self
    }

    fn uniform(&mut self) -> f32 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Whether this sampler always takes the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Picks a token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> i32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let dist = self.distribution(logits);
        self.draw(&dist)
    }

    /// The distribution [`Sampler::sample`] draws from: `(token, probability)` by descending
    /// probability after temperature, top-k and top-p (renormalized); the argmax alone when
    /// greedy.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(i32, f32)> {
        if self.is_greedy() {
            return vec![(argmax(logits), 1.0)];
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let max = logits[order[0]];
        let w: Vec<f32> = order
            .iter()
            .map(|&i| ((logits[i] - max) / self.temperature).exp())
            .collect();
        let candidates = if self.top_k == 0 {
            w.len()
        } else {
            self.top_k.min(w.len())
        };
        let total: f32 = w[..candidates].iter().sum();
        let (mut mass, mut keep) = (0.0, 0);
        while keep < candidates && (keep == 0 || mass < self.top_p * total) {
            mass += w[keep];
            keep += 1;
        }
        order[..keep]
            .iter()
            .zip(&w)
            .map(|(&i, &wk)| (i as i32, wk / mass))
            .collect()
    }

    /// Draws a token from `dist` (`(token, probability)` pairs; the probabilities need not
    /// sum to exactly 1).
    pub fn draw(&mut self, dist: &[(i32, f32)]) -> i32 {
        let total: f32 = dist.iter().map(|d| d.1).sum();
        let mut r = self.uniform() * total;
        for &(t, p) in dist {
            if r < p {
                return t;
            }
            r -= p;
        }
        dist.last().map_or(0, |d| d.0)
    }

    /// A sampler with the same settings and its own stream, derived from this one's and
    /// `salt` (one per branch of a fork).
    pub fn fork(&self, salt: u64) -> Sampler {
        Sampler::new(self.temperature, self.top_p, self.state ^ salt).with_top_k(self.top_k)
    }

    /// A uniform draw in `[0, 1)` from this sampler's stream.
    pub fn coin(&mut self) -> f32 {
        self.uniform()
    }
}

/// Index of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> i32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as i32
}

/// The log-probability of token `id` under `logits` (log-softmax, in f64).
pub fn log_prob(logits: &[f32], id: i32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    logits[id as usize] as f64 - max - z.ln()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn top_k_and_top_p_limit_the_candidates() {
        let logits = [0.0, 3.0, 2.9, 2.8, -1.0];
        let mut seen = BTreeSet::new();
        let mut s = Sampler::new(1.0, 1.0, 1).with_top_k(2);
        for _ in 0..500 {
            seen.insert(s.sample(&logits));
        }
        assert_eq!(seen, BTreeSet::from([1, 2]), "top-k 2 keeps the two best");
        let mut s = Sampler::new(1.0, 0.01, 1);
        assert!(
            (0..100).all(|_| s.sample(&logits) == 1),
            "a tiny top-p is greedy"
        );
        let mut all = BTreeSet::new();
        let mut s = Sampler::new(5.0, 1.0, 7);
        for _ in 0..2000 {
            all.insert(s.sample(&logits));
        }
        assert_eq!(
            all.len(),
            logits.len(),
            "no limit: every token can come out"
        );
    }
}

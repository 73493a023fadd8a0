//! [`Sampler`]: how a token is picked from a row of logits (greedy, or temperature with
//! top-k, top-p and min-p, seeded), [`Adjustments`] made to the logits first (logit bias,
//! repetition, frequency and presence penalties), and the log-probabilities of a pick.

/// Greedy (temperature 0) or temperature + top-k/top-p/min-p sampling with a seed.
#[derive(Clone, Debug)]
pub struct Sampler {
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep only tokens at least `min_p` times as likely as the most likely one (0 = all).
    pub min_p: f32,
    state: u64,
}

impl Sampler {
    /// A sampler; greedy when `temperature <= 0`.
    pub fn new(temperature: f32, top_p: f32, seed: u64) -> Self {
        Sampler {
            temperature,
            top_p,
            top_k: 0,
            min_p: 0.0,
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

    /// The same sampler keeping only tokens at least `p` times as likely as the most likely
    /// one (after temperature, as Hugging Face's `min_p`; 0 = no limit).
    pub fn with_min_p(mut self, p: f32) -> Self {
        self.min_p = p;
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
    /// probability after temperature, min-p, top-k and top-p (renormalized); the argmax alone
    /// when greedy. Tokens whose weight is 0 (a −∞ logit: masked or banned) never appear.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(i32, f32)> {
        if self.is_greedy() {
            return vec![(argmax(logits), 1.0)];
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Weights relative to the most likely token's (1), so min-p compares directly.
        let mut cand: Vec<(i32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as i32, ((l - max) / self.temperature).exp()))
            .filter(|&(_, w)| w > 0.0 && w >= self.min_p)
            .collect();
        // Descending weight, lower ids first on ties.
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        if self.top_k > 0 {
            cand.truncate(self.top_k);
        }
        let total: f32 = cand.iter().map(|c| c.1).sum();
        let (mut mass, mut keep) = (0.0, 0);
        while keep < cand.len() && (keep == 0 || mass < self.top_p * total) {
            mass += cand[keep].1;
            keep += 1;
        }
        cand.truncate(keep);
        cand.iter_mut().for_each(|c| c.1 /= mass);
        cand
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
        Sampler::new(self.temperature, self.top_p, self.state ^ salt)
            .with_top_k(self.top_k)
            .with_min_p(self.min_p)
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

/// What is done to a row of logits before it is sampled, from the request and the tokens
/// generated so far (OpenAI's and llama.cpp's meanings).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Adjustments {
    /// Added to the token's logit (−100 bans it, +100 all but forces it).
    pub logit_bias: Vec<(i32, f32)>,
    /// Divides a positive logit (multiplies a negative one) of every token among the last
    /// [`REPEAT_WINDOW`] of the prompt and the answer (1 or 0 = off).
    pub repetition_penalty: f32,
    /// Subtracted once per earlier occurrence in the answer.
    pub frequency_penalty: f32,
    /// Subtracted once from any token already in the answer.
    pub presence_penalty: f32,
}

/// Tokens the repetition penalty looks back over (llama.cpp's `repeat_last_n`).
pub const REPEAT_WINDOW: usize = 64;

impl Adjustments {
    /// Whether applying changes nothing.
    pub fn is_identity(&self) -> bool {
        self.logit_bias.is_empty()
            && (self.repetition_penalty == 1.0 || self.repetition_penalty == 0.0)
            && self.frequency_penalty == 0.0
            && self.presence_penalty == 0.0
    }

    /// Applies to `logits`, after `recent` (the last tokens of the prompt) and `answer`.
    pub fn apply(&self, logits: &mut [f32], recent: &[i32], answer: &[i32]) {
        for &(t, b) in &self.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        if self.frequency_penalty != 0.0 || self.presence_penalty != 0.0 {
            let mut counts: Vec<(i32, u32)> = Vec::new();
            for &t in answer {
                match counts.iter_mut().find(|c| c.0 == t) {
                    Some(c) => c.1 += 1,
                    None => counts.push((t, 1)),
                }
            }
            for (t, n) in counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= n as f32 * self.frequency_penalty + self.presence_penalty;
                }
            }
        }
        let p = self.repetition_penalty;
        if p != 1.0 && p > 0.0 {
            let all = recent.iter().chain(answer);
            let skip = (recent.len() + answer.len()).saturating_sub(REPEAT_WINDOW);
            let mut seen: Vec<i32> = Vec::new();
            for &t in all.skip(skip) {
                if seen.contains(&t) {
                    continue;
                }
                seen.push(t);
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / p } else { *l * p };
                }
            }
        }
    }
}

/// The log-probability of token `id` under `logits` (log-softmax, in f64).
pub fn log_prob(logits: &[f32], id: i32) -> f64 {
    logits[id as usize] as f64 - log_sum_exp(logits)
}

fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + z.ln()
}

/// A token's log-probability under the model and the `top` most likely alternatives'.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprobs {
    /// The token.
    pub token: i32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens and theirs, most likely first.
    pub top: Vec<(i32, f32)>,
}

impl TokenLogprobs {
    /// Of `token` under `logits`, with the `top` best (log-softmax in f64).
    pub fn of(logits: &[f32], token: i32, top: usize) -> Self {
        let lse = log_sum_exp(logits);
        let mut best: Vec<(i32, f32)> = Vec::with_capacity(top + 1);
        if top > 0 {
            let mut order: Vec<usize> = (0..logits.len()).collect();
            let k = top.min(order.len());
            order.select_nth_unstable_by(k - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
            order.truncate(k);
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            best.extend(
                order
                    .into_iter()
                    .map(|i| (i as i32, (logits[i] as f64 - lse) as f32)),
            );
        }
        TokenLogprobs {
            token,
            logprob: (logits[token as usize] as f64 - lse) as f32,
            top: best,
        }
    }
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

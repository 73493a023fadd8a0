//! [`Sampler`]: how a token is picked from a row of logits (greedy, or temperature with
//! top-k, top-p and min-p, seeded), and [`Adjustments`] made to the logits first (logit
//! bias, repetition, frequency and presence penalties).

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
    /// Candidates of the last draw, `(id, weight, logit)`, and of the last
    /// [`Sampler::sample_candidates`] in id order (kept: sampling allocates nothing once
    /// warm).
    scratch: Vec<(i32, f32, f32)>,
    by_id: Vec<(i32, f32)>,
}

/// Whether a [`Sampler`] takes temperature `t`: finite, 0 (greedy) or more.
pub fn check_temperature(t: f32) -> std::result::Result<(), String> {
    match t.is_finite() && t >= 0.0 {
        true => Ok(()),
        false => Err(format!("{t} is not a finite 0 (greedy) or more")),
    }
}

/// Whether a [`Sampler`] takes nucleus mass `p`: in (0, 1].
pub fn check_top_p(p: f32) -> std::result::Result<(), String> {
    match p > 0.0 && p <= 1.0 {
        true => Ok(()),
        false => Err(format!("{p} is outside (0, 1]")),
    }
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
            scratch: Vec::new(),
            by_id: Vec::new(),
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

    /// Picks a token from `logits`: the argmax when greedy, else a draw from the
    /// distribution after temperature, min-p, top-k and top-p (renormalized), without
    /// sorting more of the vocabulary than the draw reaches.
    pub fn sample(&mut self, logits: &[f32]) -> i32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        self.draw(logits.iter().enumerate().map(|(i, &l)| (i as i32, l)))
    }

    /// Whether [`Sampler::sample_candidates`] picks what [`Sampler::sample`] does from
    /// candidates holding a row's first `k` logits: greedy, or a top-k sampler with
    /// `top_k <= k`.
    pub fn needs_at_most(&self, k: usize) -> bool {
        self.is_greedy() || (1..=k).contains(&self.top_k)
    }

    /// Picks a token from a row's candidates: its first logits in [`kvplug_core::rank`]
    /// order with their `ids` (as `Context::decode_top_k` gives them). Where
    /// [`Sampler::needs_at_most`] their number, this is the pick [`Sampler::sample`] makes
    /// from the whole row, with the same stream.
    pub fn sample_candidates(&mut self, ids: &[i32], logits: &[f32]) -> i32 {
        if self.is_greedy() {
            return ids.first().copied().unwrap_or(0);
        }
        // In id order, as `sample` meets a row's tokens: its sums add in that order.
        let mut by_id = std::mem::take(&mut self.by_id);
        by_id.clear();
        by_id.extend(ids.iter().copied().zip(logits.iter().copied()));
        by_id.sort_unstable_by_key(|c| c.0);
        let t = self.draw(by_id.iter().copied());
        self.by_id = by_id;
        t
    }

    /// A draw from `row`'s `(id, logit)` pairs (see [`Sampler::sample`]).
    fn draw(&mut self, row: impl Iterator<Item = (i32, f32)> + Clone) -> i32 {
        let mut cand = std::mem::take(&mut self.scratch);
        let total = self.candidates(row.clone(), &mut cand);
        let (keep, mass) = self.truncate(&mut cand, total);
        let mut r = self.uniform() * mass;
        let (mut at, mut k, mut picked) = (0, FIRST_SORTED, None);
        while picked.is_none() && at < keep {
            let end = k.min(keep);
            sort_prefix(&mut cand[..keep], end);
            for &(t, w, _) in &cand[at..end] {
                if r < w {
                    picked = Some(t);
                    break;
                }
                r -= w;
            }
            (at, k) = (end, k * 4);
        }
        let first = || row.min_by(|a, b| rank(*a, *b)).map_or(0, |c| c.0);
        let t = picked.unwrap_or_else(|| cand[..keep].last().map_or_else(first, |c| c.0));
        self.scratch = cand;
        t
    }

    /// The tokens `row` allows after temperature and min-p, with their weights relative to
    /// the most likely token's (1), in `row`'s order; returns the weights' sum.
    fn candidates(
        &self,
        row: impl Iterator<Item = (i32, f32)> + Clone,
        cand: &mut Vec<(i32, f32, f32)>,
    ) -> f32 {
        let max = row.clone().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        cand.clear();
        cand.extend(
            row.map(|(i, l)| (i, ((l - max) / self.temperature).exp(), l))
                .filter(|&(_, w, _)| w > 0.0 && w >= self.min_p),
        );
        cand.iter().map(|c| c.1).sum()
    }

    /// Applies top-k then top-p to `cand` (weights summing to `total`): afterwards the kept
    /// tokens are `cand[..keep]`, the first ones in rank order (sorted as far as was
    /// needed); returns `keep` and their weights' sum.
    fn truncate(&self, cand: &mut [(i32, f32, f32)], total: f32) -> (usize, f32) {
        let (mut keep, mut total) = (cand.len(), total);
        if self.top_k > 0 && self.top_k < keep {
            keep = self.top_k;
            sort_prefix(cand, keep);
            total = cand[..keep].iter().map(|c| c.1).sum();
        }
        if self.top_p >= 1.0 {
            return (keep, total);
        }
        // The nucleus: the fewest most likely tokens holding `top_p` of the mass (at least
        // one), found in sorted prefixes growing fourfold.
        let (mut mass, mut n, mut k) = (0.0, 0, FIRST_SORTED);
        loop {
            let end = k.min(keep);
            sort_prefix(&mut cand[..keep], end);
            while n < end && (n == 0 || mass < self.top_p * total) {
                mass += cand[n].1;
                n += 1;
            }
            if n < end || end == keep {
                return (n, mass);
            }
            k *= 4;
        }
    }

    /// A sampler with the same settings and its own stream, derived from this one's and
    /// `salt` (one per branch of a fork).
    pub fn fork(&self, salt: u64) -> Sampler {
        Sampler::new(self.temperature, self.top_p, self.state ^ salt)
            .with_top_k(self.top_k)
            .with_min_p(self.min_p)
    }
}

/// How many candidates a draw sorts first (more, fourfold, only when it reaches past them).
const FIRST_SORTED: usize = 64;

/// Puts the `k` first candidates in [`kvplug_core::rank`] order of their logits first (so
/// by descending weight; a total order: the prefix is the same whatever the slice's order
/// was, and the same as a device's top-k).
fn sort_prefix(cand: &mut [(i32, f32, f32)], k: usize) {
    let order = |a: &(i32, f32, f32), b: &(i32, f32, f32)| rank((a.0, a.2), (b.0, b.2));
    let k = k.min(cand.len());
    if k < cand.len() {
        cand.select_nth_unstable_by(k, order);
    }
    cand[..k].sort_unstable_by(order);
}

/// Index of the largest logit (the first on ties; never a NaN): the same pick as a
/// backend's device argmax.
pub use kvplug_core::argmax;
use kvplug_core::{rank, Adjust};

/// What is done to a row of logits before it is sampled, from the request and the tokens
/// generated so far (OpenAI's and llama.cpp's meanings).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Adjustments {
    /// Added to the token's logit (−100 bans it, +100 all but forces it).
    pub logit_bias: Vec<(i32, f32)>,
    /// Divides a positive logit (times its inverse) and multiplies a negative one, for every
    /// token among the last `REPEAT_WINDOW` of the prompt and the answer (1 or 0 = off).
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

    /// Applies to `logits`, after `recent` (the last tokens of the prompt) and `answer`:
    /// [`Adjustments::entries`], each as [`Adjust::apply`] computes it (as a device does).
    pub fn apply(&self, logits: &mut [f32], recent: &[i32], answer: &[i32]) {
        let mut entries = Vec::new();
        self.entries(recent, answer, &mut entries);
        for (t, a) in entries {
            if let Some(l) = usize::try_from(t).ok().and_then(|t| logits.get_mut(t)) {
                *l = a.apply(*l);
            }
        }
    }

    /// What applying does to each token it changes, by token: the token's biases summed
    /// (in list order) and added; `n·frequency + presence` subtracted for a token `n` times
    /// in `answer`; a positive result divided by the repetition penalty `p` (times `1/p`)
    /// and another multiplied by it, for a token among the last `REPEAT_WINDOW` of
    /// `recent` and `answer`.
    pub fn entries(&self, recent: &[i32], answer: &[i32], out: &mut Vec<(i32, Adjust)>) {
        out.clear();
        if self.frequency_penalty != 0.0 || self.presence_penalty != 0.0 {
            out.extend(answer.iter().map(|&t| {
                (
                    t,
                    Adjust {
                        sub: 1.0,
                        ..Adjust::NONE
                    },
                )
            }));
        }
        let p = self.repetition_penalty;
        if p != 1.0 && p > 0.0 {
            let all = recent.iter().chain(answer);
            let skip = (recent.len() + answer.len()).saturating_sub(REPEAT_WINDOW);
            out.extend(all.skip(skip).map(|&t| {
                let scale = Adjust {
                    pos: 1.0 / p,
                    neg: p,
                    ..Adjust::NONE
                };
                (t, scale)
            }));
        }
        // One entry a token (an unstable sort allocates nothing): the occurrences in
        // `answer` counted in `sub`; then the biases added in list order.
        out.sort_unstable_by_key(|e| e.0);
        out.dedup_by(|e, kept| {
            if e.0 != kept.0 {
                return false;
            }
            kept.1.sub += e.1.sub;
            if e.1.neg != 1.0 {
                (kept.1.pos, kept.1.neg) = (e.1.pos, e.1.neg);
            }
            true
        });
        for &(t, b) in &self.logit_bias {
            match out.binary_search_by_key(&t, |e| e.0) {
                Ok(i) => out[i].1.add += b,
                Err(i) => out.insert(
                    i,
                    (
                        t,
                        Adjust {
                            add: b,
                            ..Adjust::NONE
                        },
                    ),
                ),
            }
        }
        for (_, a) in out.iter_mut() {
            a.sub = if a.sub > 0.0 {
                a.sub * self.frequency_penalty + self.presence_penalty
            } else {
                0.0
            };
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

    /// `sample` sorts only as much of the vocabulary as its draw reaches; it must pick what a
    /// draw walking the whole sorted distribution picks, for nuclei inside and far beyond
    /// the first sorted prefix. The reference sorts everything itself (by descending logit,
    /// lower ids first) and applies top-k, top-p and min-p as Hugging Face defines them.
    #[test]
    fn sample_draws_what_the_fully_sorted_distribution_gives() {
        let mut rng = Sampler::new(1.0, 1.0, 99);
        let settings = [
            (1.0, 0, 0.0),
            (0.9, 0, 0.0),
            (0.5, 0, 0.0),
            (0.99, 0, 0.0),
            (1.0, 5, 0.0),
            (0.9, 100, 0.0),
            (1.0, 0, 0.05),
            (0.95, 40, 0.01),
        ];
        for (case, &(top_p, top_k, min_p)) in settings.iter().enumerate() {
            for spread in [0.1f32, 1.0, 8.0] {
                // Random logits, many ties (rounded), some banned.
                let logits: Vec<f32> = (0..3000)
                    .map(|i| match i % 97 {
                        0 => f32::NEG_INFINITY,
                        _ => ((rng.uniform() * spread * 10.0).round()) / 10.0,
                    })
                    .collect();
                for seed in 0..40 {
                    let mut fast = Sampler::new(0.8, top_p, seed)
                        .with_top_k(top_k)
                        .with_min_p(min_p);
                    let mut slow = fast.clone();
                    let got = fast.sample(&logits);
                    // The reference.
                    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut cand: Vec<(i32, f32, f32)> = logits
                        .iter()
                        .enumerate()
                        .map(|(i, &l)| (i as i32, ((l - max) / 0.8).exp(), l))
                        .filter(|&(_, w, _)| w > 0.0 && w >= min_p)
                        .collect();
                    // Sums in the order the sampler adds (ids, then the sorted prefix after
                    // top-k): float addition is not associative.
                    let mut total: f32 = cand.iter().map(|c| c.1).sum();
                    cand.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(&b.0)));
                    if top_k > 0 && top_k < cand.len() {
                        cand.truncate(top_k);
                        total = cand.iter().map(|c| c.1).sum();
                    }
                    let (mut mass, mut keep) = (total, cand.len());
                    if top_p < 1.0 {
                        (mass, keep) = (0.0, 0);
                        while keep < cand.len() && (keep == 0 || mass < top_p * total) {
                            mass += cand[keep].1;
                            keep += 1;
                        }
                    }
                    let mut r = slow.uniform() * mass;
                    let want = cand[..keep]
                        .iter()
                        .find(|c| {
                            let hit = r < c.1;
                            r -= c.1;
                            hit
                        })
                        .map_or(cand[keep - 1].0, |c| c.0);
                    assert_eq!(got, want, "case {case}, spread {spread}, seed {seed}");
                }
            }
        }
    }

    /// A top-k sampler picks from a row's first `k` candidates (as a device's top-k gives
    /// them, in rank order) exactly what it picks from the whole row, seed by seed; so does
    /// a greedy one. Rows with ties, weights that tie where logits do not (far below the
    /// maximum), NaNs and banned tokens; `k` equal to the sampler's top-k and beyond it.
    #[test]
    fn candidates_give_the_whole_rows_pick() {
        let mut rng = Sampler::new(1.0, 1.0, 5);
        let settings = [
            (1.0, 1, 0.0, 1.0),
            (1.0, 40, 0.0, 0.7),
            (0.9, 40, 0.0, 1.3),
            (0.5, 64, 0.05, 0.8),
            (0.95, 7, 0.0, 60.0),
            (1.0, 50, 0.0, 0.01),
        ];
        let mut top = Vec::new();
        for (case, &(top_p, top_k, min_p, temperature)) in settings.iter().enumerate() {
            for spread in [0.1f32, 2.0, 200.0] {
                let logits: Vec<f32> = (0..5000)
                    .map(|i| match i % 89 {
                        0 => f32::NEG_INFINITY,
                        1 if spread > 100.0 => f32::NAN,
                        _ => ((rng.uniform() * spread * 10.0).round()) / 10.0,
                    })
                    .collect();
                for extra in [0, 9] {
                    kvplug_core::top_k(&logits, top_k + extra, &mut top);
                    let ids: Vec<i32> = top.iter().map(|c| c.0).collect();
                    let values: Vec<f32> = top.iter().map(|c| c.1).collect();
                    for seed in 0..30 {
                        let mut whole = Sampler::new(temperature, top_p, seed)
                            .with_top_k(top_k)
                            .with_min_p(min_p);
                        assert!(whole.needs_at_most(top_k + extra));
                        let mut part = whole.clone();
                        for draw in 0..3 {
                            assert_eq!(
                                whole.sample(&logits),
                                part.sample_candidates(&ids, &values),
                                "case {case}, spread {spread}, k {}, seed {seed}, draw {draw}",
                                top_k + extra
                            );
                        }
                    }
                    let mut greedy = Sampler::greedy();
                    assert_eq!(
                        greedy.sample(&logits),
                        greedy.sample_candidates(&ids, &values)
                    );
                }
            }
        }
        assert!(!Sampler::new(1.0, 0.9, 0).needs_at_most(64));
        assert!(!Sampler::new(1.0, 1.0, 0).with_top_k(65).needs_at_most(64));
    }

    /// What makes candidates exact beyond what random draws can show: under a top-k, the
    /// kept tokens follow the logits' rank order even where weights tie (both round to the
    /// least subnormal here, so a weight order would keep id 1); and candidates are summed
    /// in id order, as a whole row is (4096 weights of 2⁻²⁵ count beside a weight of 1
    /// only when added first: a draw past 1 then picks one of them).
    #[test]
    fn truncation_follows_the_rank_and_sums_alike_in_any_order() {
        let s = Sampler::new(1.0, 1.0, 0).with_top_k(2);
        let mut cand = Vec::new();
        let row = [(5, 0.0), (2, -103.0), (1, -103.00001)];
        let total = s.candidates(row.iter().copied(), &mut cand);
        assert_eq!(cand[1].1, cand[2].1, "the weights tie");
        let (keep, _) = s.truncate(&mut cand, total);
        let kept: Vec<i32> = cand[..keep].iter().map(|c| c.0).collect();
        assert_eq!(kept, [5, 2]);
        let tiny = -(25.0 * std::f32::consts::LN_2);
        let row: Vec<f32> = (0..4097)
            .map(|i| if i == 4096 { 0.0 } else { tiny })
            .collect();
        let mut top = Vec::new();
        kvplug_core::top_k(&row, row.len(), &mut top);
        let (ids, values): (Vec<i32>, Vec<f32>) = top.into_iter().unzip();
        let near_one = |seed: &u64| Sampler::new(1.0, 1.0, *seed).uniform() > 1.0 - 2f32.powi(-14);
        let seed = (0..).find(near_one).expect("a seed");
        let mut whole = Sampler::new(1.0, 1.0, seed).with_top_k(5000);
        let mut part = whole.clone();
        let got = whole.sample(&row);
        assert_ne!(got, 4096, "the draw reaches the small weights");
        assert_eq!(part.sample_candidates(&ids, &values), got);
    }

    /// One entry a token, by token: its biases summed in list order, its count in the
    /// answer times the frequency penalty plus the presence penalty, and the repetition
    /// penalty's factors where it is among the last tokens; others untouched.
    #[test]
    fn adjustments_come_one_entry_a_token() {
        let a = Adjustments {
            logit_bias: vec![(9, 1.0), (4, -2.0), (9, 0.5)],
            repetition_penalty: 2.0,
            frequency_penalty: 0.25,
            presence_penalty: 0.125,
        };
        let mut got = Vec::new();
        a.entries(&[7, 4], &[4, 6, 4], &mut got);
        let e = |add, sub, rep: bool| Adjust {
            add,
            sub,
            pos: if rep { 0.5 } else { 1.0 },
            neg: if rep { 2.0 } else { 1.0 },
        };
        let want = vec![
            (4, e(-2.0, 2.0 * 0.25 + 0.125, true)),
            (6, e(0.0, 0.25 + 0.125, true)),
            (7, e(0.0, 0.0, true)),
            (9, e(1.5, 0.0, false)),
        ];
        assert_eq!(got, want);
        let mut row = vec![1.0f32; 10];
        a.apply(&mut row, &[7, 4], &[4, 6, 4]);
        assert_eq!(row[4], (1.0 - 2.0 - 0.625) * 2.0);
        assert_eq!(row[7], 0.5);
        assert_eq!(row[9], 2.5);
        assert_eq!(row[0], 1.0);
    }
}

//! [`Generator`]: the one generation loop. Requests are sequences of one context; each
//! [`step`](Generator::step) runs one forward over all of them — a token for every decoding
//! request, then prompt chunks in arrival order, [`PREFILL_UBATCH`] tokens in all — and
//! samples where a request's logits are due, until each ends at a stop token, a stop string
//! or its token limit. A single request ([`generate`]) is a prompt prefilled in
//! micro-batches and then decoded token by token; many are continuous batching.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvplug_core::Adjust;
use kvplug_runtime::{Batch, Context, Logits};

use crate::error::{fail, Error, Result};
use crate::grammar::Constraint;
use crate::logprobs::TokenLogprobs;
use crate::sampler::{check_temperature, check_top_p, Adjustments, Sampler, REPEAT_WINDOW};
use crate::speculative::{SpecStats, Speculation, Speculator};
use crate::stop::StopMatcher;
use crate::text::{Streamer, Text};

/// Most tokens one forward runs (llama.cpp's default `n_ubatch`): attention scratch grows
/// with `ubatch × window`, never with a prompt squared.
pub const PREFILL_UBATCH: usize = 512;

/// The most prompt tokens requests with [`GenOptions::prompt_logprobs`] feed a step, all
/// of them together: each returns a whole row of logits (64 rows of a 256k vocabulary:
/// 64 MiB).
pub const SCORED_UBATCH: usize = 64;

/// The most alternatives [`GenOptions::logprobs`] and [`GenOptions::prompt_logprobs`] list a
/// token (OpenAI allows 20); a whole row is [`TokenEvent::logits`].
pub const MAX_LOGPROBS: usize = 64;

/// The most candidates a step asks the device for ([`Context::decode_top_k`]): a sampler
/// with a larger top-k, or none, reads whole rows of logits.
pub const DEVICE_TOP_K: usize = 64;

/// What a request asks for.
#[derive(Clone, Debug)]
pub struct GenOptions {
    /// Most tokens to generate; 0 prefills the prompt and samples nothing.
    pub max_tokens: usize,
    /// How tokens are picked.
    pub sampler: Sampler,
    /// Tokens that end generation (kept as the last generated id).
    pub stop_tokens: BTreeSet<i32>,
    /// Strings that end generation (the text stops right before the first one). Needs the
    /// generator's [`Text`].
    pub stop_strings: Vec<String>,
    /// Logit bias and penalties, applied before sampling.
    pub adjust: Adjustments,
    /// A grammar the answer must follow: each step only the tokens it allows can be
    /// sampled, and the answer ends when it is complete.
    pub constraint: Option<Constraint>,
    /// Constraints waiting for an opening (a tool call's tag): the first whose opening the
    /// answer's text reaches becomes the constraint, applied from the token that starts the
    /// opening; one whose grammar refuses what was generated is dropped and the answer goes
    /// on. Needs the generator's [`Text`].
    pub triggered: Vec<Triggered>,
    /// Report each token's log-probability and this many alternatives' (`None`: none).
    pub logprobs: Option<usize>,
    /// Score the prompt: the log-probability of each prompt token after the first under the
    /// logits of the one before it, with this many alternatives' (`None`: none) — OpenAI's
    /// `echo` with `logprobs`, lm-eval-harness's loglikelihood. Every prompt token then
    /// returns its row of logits, so the prompt goes in [`SCORED_UBATCH`] tokens a step.
    /// They come with the request's first [`TokenEvent`], or in [`Finished`] when it ends
    /// before sampling one.
    pub prompt_logprobs: Option<usize>,
    /// Set (from any thread, or a signal handler) to end the request before its next step:
    /// a long prompt stops being prefilled within one micro-batch, and the request finishes
    /// [`Finish::Cancelled`].
    pub cancel: Option<Arc<AtomicBool>>,
    /// Decode speculatively: draft tokens verified in the request's own steps (see
    /// the `speculative` module); the tokens are those plain decoding gives.
    pub speculate: Option<Speculation>,
    /// Pick where the logits are, in steps whose every request asked for it and picks
    /// plainly (no grammar, logprobs or speculation; logit bias and penalties are applied
    /// there too, as [`Adjustments::entries`] says): a greedy token's argmax
    /// ([`Context::decode_argmax`]: 4 bytes read back a token instead of a row of logits),
    /// and a top-k sampler's draw (top-k at most [`DEVICE_TOP_K`]) from the row's top-k
    /// candidates ([`Context::decode_top_k`]: `8·k` bytes). Its [`TokenEvent`]s then carry
    /// no logits (an empty slice). The tokens are the same either way.
    pub device_argmax: bool,
}

impl GenOptions {
    /// Up to `n` tokens, greedy, everything else as [`GenOptions::default`].
    pub fn max_tokens(n: usize) -> Self {
        GenOptions {
            max_tokens: n,
            ..GenOptions::default()
        }
    }

    /// Refuses what samples nothing meaningful: a temperature that is negative or not
    /// finite, `top_p` outside (0, 1], `min_p` outside [0, 1], a repetition penalty below 0,
    /// penalties or biases that are NaN (or a +∞ bias), negative token ids, and more than
    /// [`MAX_LOGPROBS`] alternatives a token. [`Generator::add`] checks every request.
    pub fn check(&self) -> Result<()> {
        for (name, k) in [
            ("logprobs", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ] {
            if let Some(k) = k.filter(|&k| k > MAX_LOGPROBS) {
                fail!(
                    Invalid,
                    "{name} {k}: at most {MAX_LOGPROBS} alternatives a token"
                );
            }
        }
        let s = &self.sampler;
        check_temperature(s.temperature).map_err(|e| Error::Invalid(format!("temperature {e}")))?;
        check_top_p(s.top_p).map_err(|e| Error::Invalid(format!("top_p {e}")))?;
        if !(0.0..=1.0).contains(&s.min_p) {
            fail!(Invalid, "min_p {} is outside [0, 1]", s.min_p);
        }
        let a = &self.adjust;
        if !(a.repetition_penalty >= 0.0 && a.repetition_penalty.is_finite()) {
            fail!(
                Invalid,
                "repetition_penalty {} is not a finite 0 or more",
                a.repetition_penalty
            );
        }
        for (name, v) in [
            ("frequency", a.frequency_penalty),
            ("presence", a.presence_penalty),
        ] {
            if !v.is_finite() {
                fail!(Invalid, "{name}_penalty {v} is not finite");
            }
        }
        if let Some(&(id, b)) = a
            .logit_bias
            .iter()
            .find(|&&(id, b)| id < 0 || b.is_nan() || b == f32::INFINITY)
        {
            fail!(
                Invalid,
                "logit_bias of token {id}: {b} (ids from 0; a bias below +∞, -∞ bans)"
            );
        }
        if let Some(id) = self.stop_tokens.iter().find(|&&id| id < 0) {
            fail!(Invalid, "stop token {id} is negative");
        }
        Ok(())
    }
}

impl Default for GenOptions {
    fn default() -> Self {
        GenOptions {
            max_tokens: 0,
            sampler: Sampler::greedy(),
            stop_tokens: BTreeSet::new(),
            stop_strings: Vec::new(),
            adjust: Adjustments::default(),
            constraint: None,
            triggered: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            cancel: None,
            speculate: None,
            device_argmax: false,
        }
    }
}

/// A constraint that applies once the answer reaches `opening`.
#[derive(Clone, Debug)]
pub struct Triggered {
    /// The text that starts it.
    pub opening: String,
    /// Only at the very start of the answer (leading whitespace aside).
    pub at_start: bool,
    /// The grammar from the opening on (it must accept the opening itself).
    pub constraint: Constraint,
}

/// A request's handle, unique within its generator.
pub type RequestId = u64;

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` generated.
    Length,
    /// A prefill-only request (`max_tokens` 0) wrote its prompt.
    Prefilled,
    /// [`Generator::cancel`]ed, or its [`GenOptions::cancel`] flag was set.
    Cancelled,
    /// Its own sampling failed (its grammar, its text): [`Finished::error`] says why. The
    /// other requests go on.
    Failed,
}

/// A token as it is sampled.
pub struct TokenEvent<'a> {
    /// The request.
    pub request: RequestId,
    /// Its sequence.
    pub seq: i32,
    /// The token.
    pub id: i32,
    /// Text released with it (empty while a piece of a character or a possible stop
    /// string is held back; empty without a [`Text`]).
    pub text: String,
    /// The logits it was sampled from (the model's, before adjustments and masks); empty
    /// when it was picked on the device ([`GenOptions::device_argmax`]).
    pub logits: &'a [f32],
    /// Its log-probability and the best alternatives', when the request asked.
    pub logprobs: Option<TokenLogprobs>,
    /// With the request's first token, its prompt's scores when it asked
    /// ([`GenOptions::prompt_logprobs`]): one a prompt token from the second on. Else empty.
    pub prompt_logprobs: Vec<TokenLogprobs>,
    /// How many of the request's latest tokens, this one included unless it is a stop token
    /// (which adds no text), have none of their text released yet: held back (see `text`),
    /// or in a stop string just reached (then never released). The text of every earlier
    /// token is out, so a client can give each token's log-probability with its text.
    pub held: usize,
    /// Whether it is one of the request's stop tokens: it ends the answer and is not in its
    /// text.
    pub stop_token: bool,
}

/// A request that ended.
#[derive(Clone, Debug)]
pub struct Finished {
    /// The request.
    pub request: RequestId,
    /// Its sequence.
    pub seq: i32,
    /// Why it ended.
    pub reason: Finish,
    /// Generated ids (the stop token included).
    pub generated: Vec<i32>,
    /// Prompt tokens written to the cache (all of them, unless cancelled mid-prefill).
    pub prompt_written: usize,
    /// Text held back at the end that was no stop string (release it after the tokens'),
    /// bytes that never completed a character as U+FFFD.
    pub text_tail: String,
    /// The request's sampler as it ended (its stream goes on from there).
    pub sampler: Sampler,
    /// Why it failed, when [`Finish::Failed`].
    pub error: Option<String>,
    /// What speculation did, when the request speculated.
    pub speculation: Option<SpecStats>,
    /// The stop string that ended it, when one did.
    pub stop_string: Option<String>,
    /// Its prompt's scores ([`GenOptions::prompt_logprobs`]) when no [`TokenEvent`] handed
    /// them out (it sampled nothing): those of the prompt tokens written, from the second on.
    pub prompt_logprobs: Vec<TokenLogprobs>,
}

impl Finished {
    /// Positions written from the request's `start`: the prompt's, then every generated id
    /// but the last (sampled, not yet run).
    pub fn written(&self) -> usize {
        self.prompt_written + self.generated.len().saturating_sub(1)
    }
}

struct Active {
    request: RequestId,
    seq: i32,
    prompt: Vec<i32>,
    /// The token after `prompt` when it is a prefix another request goes on from
    /// ([`Generator::add_prefix`]): its last row is scored against it.
    next: Option<i32>,
    /// Position of `prompt[0]`.
    start: usize,
    /// Prompt tokens written so far.
    written: usize,
    generated: Vec<i32>,
    opts: GenOptions,
    streamer: Streamer,
    stop: StopMatcher,
    /// Prompt tokens this step feeds.
    fed: usize,
    spec: Option<Speculator>,
    /// Whether this step's decode went through its speculator.
    drafted: bool,
    /// Its prompt's scores not handed out yet ([`GenOptions::prompt_logprobs`]).
    scores: Vec<TokenLogprobs>,
}

impl Active {
    /// The candidates a row of its needs when its tokens may be picked on the device (see
    /// [`GenOptions::device_argmax`]): 0 for the argmax, `k` for a top-k sampler's.
    fn device_picks(&self) -> Option<usize> {
        let o = &self.opts;
        let plain = o.device_argmax
            && o.constraint.is_none()
            && o.logprobs.is_none()
            && o.prompt_logprobs.is_none()
            && self.spec.is_none();
        match plain && o.sampler.needs_at_most(DEVICE_TOP_K) {
            true if o.sampler.is_greedy() => Some(0),
            true => Some(o.sampler.top_k),
            false => None,
        }
    }

    fn prefilling(&self) -> bool {
        self.written < self.prompt.len()
    }

    /// Cells it may still write: the prompt's rest and all but the last generated token.
    fn outstanding(&self) -> usize {
        let total = self.prompt.len() + self.opts.max_tokens.saturating_sub(1);
        total.saturating_sub(self.written + self.generated.len().saturating_sub(1))
    }

    fn finished(self, reason: Finish, text_tail: String, error: Option<String>) -> Finished {
        Finished {
            request: self.request,
            seq: self.seq,
            reason,
            generated: self.generated,
            prompt_written: self.written,
            text_tail,
            sampler: self.opts.sampler,
            error,
            speculation: self.spec.as_ref().map(Speculator::stats),
            stop_string: self.stop.matched().map(String::from),
            prompt_logprobs: self.scores,
        }
    }
}

/// The generation loop over one context's sequences (see the module docs).
#[derive(Default)]
pub struct Generator {
    text: Option<Arc<Text>>,
    active: Vec<Active>,
    next: RequestId,
    // The step's batch, the requests sampling from its logits rows (each request's rows in
    // a run: its index, first row and row count), the prompt rows it scores (index, first
    // row, row count, prompt index of the first token scored), and the rows written again
    // after verification (see `Speculator::settle`); reused across steps.
    batch: Batch,
    owners: Vec<(usize, usize, usize)>,
    scored: Vec<(usize, usize, usize, usize)>,
    refeed: Batch,
    /// A row of logits being adjusted or masked, reused.
    scratch: Vec<f32>,
    /// The logit adjustments of a step picking on the device (row, token, how), and one
    /// request's, reused.
    adjust: Vec<(usize, i32, Adjust)>,
    entries: Vec<(i32, Adjust)>,
    masks: u64,
    mask_time: Duration,
}

impl Generator {
    /// A generator handing out token ids only (no text, no stop strings).
    pub fn new() -> Self {
        Generator::default()
    }

    /// A generator that also streams each request's text and honours stop strings.
    pub fn with_text(text: Arc<Text>) -> Self {
        Generator {
            text: Some(text),
            ..Generator::default()
        }
    }

    /// Adds a request on sequence `seq`: `prompt` (at least one token) goes in at positions
    /// `start..` (the sequence already holds `0..start`), then up to `opts.max_tokens` are
    /// generated. It runs from the next [`step`](Self::step).
    pub fn add(
        &mut self,
        seq: i32,
        prompt: &[i32],
        start: usize,
        opts: GenOptions,
    ) -> Result<RequestId> {
        self.add_scored(seq, prompt, None, start, opts)
    }

    /// Adds the prefill of `prefix`, a prompt but its last token `next`, which requests
    /// forked from `seq` each feed themselves (`n` completions sharing one prompt): as
    /// [`add`](Self::add), generating nothing, and with [`GenOptions::prompt_logprobs`] its
    /// last row is scored against `next`, so that its scores cover the whole prompt's tokens
    /// from the second on.
    pub fn add_prefix(
        &mut self,
        seq: i32,
        prefix: &[i32],
        next: i32,
        start: usize,
        opts: GenOptions,
    ) -> Result<RequestId> {
        if opts.max_tokens > 0 {
            fail!(
                Invalid,
                "a shared prefill generates nothing: max_tokens must be 0"
            );
        }
        self.add_scored(seq, prefix, Some(next), start, opts)
    }

    /// [`add`](Self::add), `next` following `prompt` ([`add_prefix`](Self::add_prefix)).
    fn add_scored(
        &mut self,
        seq: i32,
        prompt: &[i32],
        next: Option<i32>,
        start: usize,
        opts: GenOptions,
    ) -> Result<RequestId> {
        if prompt.is_empty() {
            fail!(Invalid, "a request needs at least one prompt token");
        }
        opts.check()?;
        if (!opts.stop_strings.is_empty() || !opts.triggered.is_empty()) && self.text.is_none() {
            fail!(
                Invalid,
                "stop strings and triggers need the model's tokenizer"
            );
        }
        if opts.stop_strings.iter().any(String::is_empty) {
            fail!(Invalid, "a stop string must not be empty");
        }
        if self.active.iter().any(|a| a.seq == seq) {
            fail!(Invalid, "sequence {seq} already has a request in flight");
        }
        let spec = opts
            .speculate
            .as_ref()
            .map(|s| Speculator::new(s, prompt, start))
            .transpose()?;
        let request = self.next;
        self.next += 1;
        self.active.push(Active {
            request,
            seq,
            prompt: prompt.to_vec(),
            next,
            start,
            written: 0,
            generated: Vec::new(),
            stop: StopMatcher::new(opts.stop_strings.clone()),
            opts,
            streamer: Streamer::default(),
            fed: 0,
            spec,
            drafted: false,
            scores: Vec::new(),
        });
        Ok(request)
    }

    /// Whether no request is in flight.
    pub fn is_idle(&self) -> bool {
        self.active.is_empty()
    }

    /// Whether some request in flight still has prompt tokens to write.
    pub fn is_prefilling(&self) -> bool {
        self.active.iter().any(Active::prefilling)
    }

    /// Requests in flight.
    pub fn len(&self) -> usize {
        self.active.len()
    }

    /// Whether no request is in flight (same as [`is_idle`](Self::is_idle)).
    pub fn is_empty(&self) -> bool {
        self.active.is_empty()
    }

    /// Cells the requests in flight may still write (what a scheduler keeps free for them).
    pub fn outstanding(&self) -> usize {
        self.active.iter().map(Active::outstanding).sum()
    }

    /// Constraint masks computed so far by every request that ended, and their time.
    pub fn mask_stats(&self) -> (u64, Duration) {
        (self.masks, self.mask_time)
    }

    /// Tokens request `request` has generated so far.
    pub fn generated(&self, request: RequestId) -> Option<&[i32]> {
        let a = self.active.iter().find(|a| a.request == request)?;
        Some(&a.generated)
    }

    /// Ends `request` now (its K/V stays as written: [`Finished::written`] positions).
    pub fn cancel(&mut self, request: RequestId) -> Option<Finished> {
        let i = self.active.iter().position(|a| a.request == request)?;
        Some(
            self.active
                .remove(i)
                .finished(Finish::Cancelled, String::new(), None),
        )
    }

    /// Ends every request in flight (after a failed step: their K/V may be partial).
    pub fn cancel_all(&mut self) -> Vec<Finished> {
        let all = std::mem::take(&mut self.active);
        all.into_iter()
            .map(|a| a.finished(Finish::Cancelled, String::new(), None))
            .collect()
    }

    /// One forward over the requests in flight; `on_token` sees each sampled token. Returns
    /// the requests that ended. A failed forward leaves every request in flight (the caller
    /// decides: retry, or [`cancel_all`](Self::cancel_all)) unless the step drafted (its
    /// proposals are in the caches: then, as when drafting or settling fails, it ends them
    /// all); a failing `on_token` ends them all (their tokens of this step were sampled but
    /// not all handed out).
    pub fn step(
        &mut self,
        ctx: &mut Context,
        on_token: &mut dyn FnMut(&TokenEvent<'_>) -> Result<()>,
    ) -> Result<Vec<Finished>> {
        let t0 = Instant::now();
        let mut cancelled = Vec::new();
        while let Some(i) = self.active.iter().position(|a| {
            a.opts
                .cancel
                .as_ref()
                .is_some_and(|c| c.load(Ordering::Relaxed))
        }) {
            let a = self.active.remove(i);
            cancelled.push(a.finished(Finish::Cancelled, String::new(), None));
        }
        if self.active.is_empty() {
            return Ok(cancelled);
        }
        self.batch.clear();
        self.owners.clear();
        self.scored.clear();
        // Requests draft only in a step that prefills nothing (see `crate::speculative`).
        let mut undecided = self.active.iter().filter(|a| !a.prefilling()).count();
        let drafting = undecided == self.active.len();
        for (i, a) in self.active.iter_mut().enumerate() {
            if a.prefilling() {
                continue;
            }
            undecided -= 1;
            let pos = a.start + a.written + a.generated.len() - 1;
            a.drafted = drafting && a.spec.is_some();
            let Some(s) = a.spec.as_mut().filter(|_| drafting) else {
                let last = a.generated[a.generated.len() - 1];
                self.owners.push((i, self.batch.logit_rows().len(), 1));
                self.batch.push(last, pos as i32, a.seq, true);
                continue;
            };
            // The most draft nodes the cache has room for beside this step's other tokens.
            let cells = self.batch.len() + 1 + undecided;
            let room = (0..=s.max_nodes())
                .rev()
                .find(|&r| ctx.can_extend(cells + r))
                .unwrap_or(0);
            let remaining = a.opts.max_tokens - a.generated.len();
            let tree = match s.draft(ctx, &a.generated, pos, remaining, room) {
                Ok(tree) => tree,
                Err(e) => {
                    self.active.clear();
                    return Err(e);
                }
            };
            self.owners
                .push((i, self.batch.logit_rows().len(), tree.tokens.len()));
            for (&t, &d) in tree.tokens.iter().zip(&tree.depth) {
                self.batch.push(t, (pos + d) as i32, a.seq, true);
            }
        }
        let mut budget = PREFILL_UBATCH.saturating_sub(self.batch.len()).max(1);
        let mut scoring = SCORED_UBATCH;
        for (i, a) in self.active.iter_mut().enumerate() {
            let most = match a.opts.prompt_logprobs {
                Some(_) => budget.min(scoring),
                None => budget,
            };
            if !a.prefilling() || most == 0 {
                continue;
            }
            a.fed = (a.prompt.len() - a.written).min(most);
            if a.prompt.len() - (a.written + a.fed) == 1 {
                // Not a last chunk of one token: read, it looks like a decode step, and a
                // recurrent cache would not keep the prompt's end (see `Anchors`). With room
                // for one token only, the request waits a step, as it does with none.
                a.fed -= 1;
                if a.fed == 0 {
                    continue;
                }
            }
            budget -= a.fed;
            if a.opts.prompt_logprobs.is_some() {
                scoring -= a.fed;
            }
            let end = a.written + a.fed;
            let wants = end == a.prompt.len() && a.opts.max_tokens > 0;
            // A scored prompt's rows give the next token's log-probability: every fed token
            // but the prompt's last has one (a prefix's last too, against `next`).
            let scored = match a.opts.prompt_logprobs {
                Some(_) => end.min(a.prompt.len() - usize::from(a.next.is_none())) - a.written,
                None => 0,
            };
            if scored > 0 {
                let first = self.batch.logit_rows().len();
                self.scored.push((i, first, scored, a.written + 1));
            }
            let rows = self.batch.logit_rows().len() + scored;
            for (k, &t) in a.prompt[a.written..end].iter().enumerate() {
                let logits = k < scored || (wants && a.written + k + 1 == end);
                self.batch
                    .push(t, (a.start + a.written + k) as i32, a.seq, logits);
            }
            if wants {
                self.owners.push((i, rows, 1));
            }
        }
        // On the device: every request's argmax, or as many candidates as the most any wants,
        // each row's logit bias and penalties applied there first.
        let device = self
            .active
            .iter()
            .try_fold(0, |k, a| a.device_picks().map(|n| k.max(n)));
        self.adjust.clear();
        if device.is_some() {
            let vocab = ctx.vocab() as i32;
            for &(i, row, _) in &self.owners {
                let a = &self.active[i];
                if a.opts.adjust.is_identity() {
                    continue;
                }
                // One row a request: device picks exclude speculation.
                let recent = &a.prompt[a.prompt.len().saturating_sub(REPEAT_WINDOW)..];
                a.opts
                    .adjust
                    .entries(recent, &a.generated, &mut self.entries);
                let in_vocab = self.entries.iter().filter(|e| (0..vocab).contains(&e.0));
                self.adjust.extend(in_vocab.map(|&(t, how)| (row, t, how)));
            }
        }
        let adjust = &self.adjust[..];
        // The masks of constrained requests sampling this step are computed beside the
        // forward pass, on a second thread.
        let owners = &self.owners;
        let constraints: Vec<&mut Constraint> = self
            .active
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| owners.iter().any(|&(o, _, _)| o == *i))
            .filter_map(|(_, a)| a.opts.constraint.as_mut())
            .collect();
        // A mask that fails here fails again when its request samples, ending that request.
        let (decoded, masked) = std::thread::scope(|s| {
            let masks = (!constraints.is_empty()).then(|| {
                s.spawn(move || {
                    for c in constraints {
                        let _ = c.prepare();
                    }
                })
            });
            let decoded = match device {
                Some(0) => ctx.decode_argmax(&self.batch, adjust).map(Picks::Ids),
                Some(k) => {
                    let k = k.min(ctx.vocab());
                    let top = ctx.decode_top_k(&self.batch, k, adjust);
                    top.map(|(ids, logits)| Picks::Candidates { ids, logits, k })
                }
                None => ctx.decode(&self.batch).map(Picks::Logits),
            };
            let masked = masks.map_or(Ok(()), |h| {
                h.join()
                    .map_err(|_| crate::Error::Invalid("constrained decoding panicked".into()))
            });
            (decoded, masked)
        });
        let picks = match decoded {
            Ok(picks) => picks,
            // A step that drafted left proposals in the caches: its requests cannot retry.
            Err(e) if self.active.iter().any(|a| a.drafted) => {
                self.active.clear();
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        masked?;
        for a in &mut self.active {
            a.written += std::mem::take(&mut a.fed);
        }
        if let Picks::Logits(l) = &picks {
            for &(i, first, rows, from) in &self.scored {
                let a = &mut self.active[i];
                let top = a.opts.prompt_logprobs.unwrap_or(0);
                let next = a.prompt.iter().chain(&a.next).skip(from).take(rows);
                let scores = next
                    .enumerate()
                    .map(|(k, &t)| TokenLogprobs::of(l.row(first + k), t, top));
                a.scores.extend(scores);
            }
        }
        let mut ended = Vec::new();
        for &(i, first, _) in &self.owners {
            let a = &mut self.active[i];
            // A drafting request samples its rows along the drafted child holding each
            // sampled token.
            let mut node = Some(0);
            while let Some(n) = node {
                let sampled_before = a.generated.len();
                let (event, finish) =
                    match sample_one(a, picks.row(first + n), &mut self.scratch, &self.text) {
                        Ok(sampled) => sampled,
                        Err(e) => {
                            // A token sampled before the failure counts as generated: the
                            // cache keeps the row it was sampled from, as `written` says.
                            if let (true, Some(s)) = (a.drafted, a.spec.as_mut()) {
                                if a.generated.len() > sampled_before {
                                    s.follow(n, i32::MIN);
                                }
                            }
                            ended.push((i, Finish::Failed, Some(e.to_string())));
                            break;
                        }
                    };
                if let Err(e) = on_token(&event) {
                    self.active.clear();
                    return Err(e);
                }
                node = match (a.drafted, a.spec.as_mut()) {
                    (true, Some(s)) => s.follow(n, event.id),
                    _ => None,
                };
                if let Some(reason) = finish {
                    ended.push((i, reason, None));
                    break;
                }
            }
        }
        // The caches keep the accepted chains only; the step's cost teaches each policy.
        self.refeed.clear();
        let settled = self
            .active
            .iter_mut()
            .filter(|a| a.drafted)
            .try_for_each(|a| {
                let s = a.spec.as_mut().expect("a drafting request speculates");
                s.settle(ctx, a.seq, &mut self.refeed)
            })
            .and_then(|()| {
                if !self.refeed.is_empty() {
                    ctx.decode(&self.refeed)?;
                }
                Ok(())
            });
        if let Err(e) = settled {
            self.active.clear();
            return Err(e);
        }
        let seconds = t0.elapsed().as_secs_f64();
        for a in &mut self.active {
            if std::mem::take(&mut a.drafted) {
                a.spec.as_mut().expect("speculates").observe(seconds);
            }
        }
        for (i, a) in self.active.iter().enumerate() {
            if a.opts.max_tokens == 0 && !a.prefilling() {
                ended.push((i, Finish::Prefilled, None));
            }
        }
        ended.sort_unstable_by_key(|&(i, _, _)| std::cmp::Reverse(i));
        let mut done = Vec::with_capacity(ended.len());
        for (i, reason, error) in ended {
            let mut a = self.active.remove(i);
            if let Some(c) = &a.opts.constraint {
                let (n, t) = c.mask_stats();
                self.masks += u64::from(n);
                self.mask_time += t;
            }
            // After a stop string nothing is held; otherwise the held text was no stop, and
            // bytes that never completed a character end the text.
            let mut tail = a.stop.flush();
            if let (Some(t), None) = (&self.text, a.stop.matched()) {
                // The same ids decoded when they came in: an error here cannot arise, and
                // failing now would lose the requests this loop already took out.
                tail += &a.streamer.flush(t).unwrap_or_default();
            }
            done.push(a.finished(reason, tail, error));
        }
        done.reverse();
        cancelled.extend(done);
        Ok(cancelled)
    }

    /// Steps until every request in flight has ended; returns them in the order they ended.
    pub fn run(
        &mut self,
        ctx: &mut Context,
        on_token: &mut dyn FnMut(&TokenEvent<'_>) -> Result<()>,
    ) -> Result<Vec<Finished>> {
        let mut all = Vec::new();
        while !self.is_idle() {
            all.extend(self.step(ctx, on_token)?);
        }
        Ok(all)
    }
}

/// Samples `a`'s next token from its row of logits `l` (adjusted and masked in `scratch`
/// when the request asks), advances its grammar, text and stop checks; the event to hand out
/// and whether the request ends.
fn sample_one<'l>(
    a: &mut Active,
    pick: Pick<'l>,
    scratch: &mut Vec<f32>,
    text: &Option<Arc<Text>>,
) -> Result<(TokenEvent<'l>, Option<Finish>)> {
    let constrained = a.opts.constraint.is_some();
    let (id, l) = match pick {
        Pick::Id(id) => (id, &[][..]),
        Pick::Candidates(ids, logits) => (a.opts.sampler.sample_candidates(ids, logits), &[][..]),
        Pick::Row(l) if a.opts.adjust.is_identity() && !constrained => {
            (a.opts.sampler.sample(l), l)
        }
        Pick::Row(l) => {
            scratch.clear();
            scratch.extend_from_slice(l);
            let recent = &a.prompt[a.prompt.len().saturating_sub(REPEAT_WINDOW)..];
            a.opts.adjust.apply(scratch, recent, &a.generated);
            if let Some(c) = &mut a.opts.constraint {
                c.apply(scratch)?;
            }
            (a.opts.sampler.sample(scratch), l)
        }
    };
    a.generated.push(id);
    let mut complete = false;
    if let Some(c) = &mut a.opts.constraint {
        c.commit(id)?;
        complete = c.is_finished();
    } else if let (false, Some(t)) = (a.opts.triggered.is_empty(), text) {
        complete = trigger(a, t)?;
    }
    let mut released = String::new();
    let stop_token = a.opts.stop_tokens.contains(&id);
    let mut stopped = stop_token;
    if let (Some(t), false) = (text, stopped) {
        let piece = a.streamer.push(t, id)?;
        (released, stopped) = a.stop.push(&piece);
    }
    let finish = if stopped || complete {
        Some(Finish::Stop)
    } else {
        (a.generated.len() >= a.opts.max_tokens).then_some(Finish::Length)
    };
    let event = TokenEvent {
        request: a.request,
        seq: a.seq,
        id,
        text: released,
        logits: l,
        logprobs: a.opts.logprobs.map(|top| TokenLogprobs::of(l, id, top)),
        prompt_logprobs: std::mem::take(&mut a.scores),
        held: a.stop.held_pieces(),
        stop_token,
    };
    Ok((event, finish))
}

/// What a step's forward returned: logit rows, or (every request picking on the device)
/// each row's argmax or its first `k` candidates.
enum Picks<'a> {
    Logits(Logits<'a>),
    Ids(&'a [i32]),
    Candidates {
        ids: &'a [i32],
        logits: &'a [f32],
        k: usize,
    },
}

/// One row's share of [`Picks`].
enum Pick<'a> {
    Row(&'a [f32]),
    Id(i32),
    Candidates(&'a [i32], &'a [f32]),
}

impl<'a> Picks<'a> {
    fn row(&self, i: usize) -> Pick<'a> {
        match self {
            Picks::Logits(l) => Pick::Row(l.row(i)),
            Picks::Ids(ids) => Pick::Id(ids[i]),
            Picks::Candidates { ids, logits, k } => {
                Pick::Candidates(&ids[i * k..(i + 1) * k], &logits[i * k..(i + 1) * k])
            }
        }
    }
}

/// Installs the first of `a`'s waiting constraints whose opening its answer has reached
/// (dropping those that can no longer fire); whether the installed grammar is complete.
fn trigger(a: &mut Active, text: &Text) -> Result<bool> {
    let answer = text.detokenize(&a.generated)?;
    let start = answer.trim_start();
    // An opening only allowed at the start cannot come once the start departs from it.
    a.opts
        .triggered
        .retain(|w| !w.at_start || w.opening.starts_with(start) || start.starts_with(&w.opening));
    let Some(k) = a.opts.triggered.iter().position(|w| {
        if w.at_start {
            start.starts_with(&w.opening)
        } else {
            answer.contains(&w.opening)
        }
    }) else {
        return Ok(false);
    };
    let mut w = a.opts.triggered.remove(k);
    // The token whose text starts the opening.
    let mut from = 0;
    for f in (0..a.generated.len()).rev() {
        if text
            .detokenize(&a.generated[f..])?
            .trim_start()
            .starts_with(&w.opening)
        {
            from = f;
            break;
        }
    }
    if w.constraint.catch_up(&a.generated[from..]) {
        let done = w.constraint.is_finished();
        a.opts.constraint = Some(w.constraint);
        a.opts.triggered.clear();
        return Ok(done);
    }
    Ok(false)
}

/// What [`generate`] produced.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated ids (the stop token included).
    pub ids: Vec<i32>,
    /// Why it ended.
    pub reason: Finish,
    /// Prompt tokens per second, from the call to the first sampled token.
    pub prefill_tok_s: f64,
    /// Tokens per second after the first.
    pub decode_tok_s: f64,
    /// The sampler as it ended.
    pub sampler: Sampler,
    /// Text held back at the end that was no stop string (the tokens' text ends before it),
    /// bytes that never completed a character as U+FFFD.
    pub text_tail: String,
    /// What speculation did, when the request speculated.
    pub speculation: Option<SpecStats>,
}

/// One request on sequence `seq` of `ctx` (see [`Generator::add`]), run to its end by a
/// generator with `text` (or ids only); `on_token` sees each token. A request whose own
/// sampling fails ([`Finish::Failed`]: its grammar, its text) is an [`Error::Invalid`]
/// naming why.
///
/// [`Error::Invalid`]: crate::Error::Invalid
pub fn generate(
    ctx: &mut Context,
    text: Option<Arc<Text>>,
    seq: i32,
    prompt: &[i32],
    start: usize,
    opts: GenOptions,
    on_token: &mut dyn FnMut(&TokenEvent<'_>) -> Result<()>,
) -> Result<Generation> {
    let mut g = match text {
        Some(t) => Generator::with_text(t),
        None => Generator::new(),
    };
    g.add(seq, prompt, start, opts)?;
    let t0 = Instant::now();
    let mut first: Option<Instant> = None;
    let done = g.run(ctx, &mut |e| {
        first.get_or_insert_with(Instant::now);
        on_token(e)
    })?;
    let end = Instant::now();
    let f = done.into_iter().next().expect("the request ends");
    if f.reason == Finish::Failed {
        fail!(
            Invalid,
            "the answer failed: {}",
            f.error.as_deref().unwrap_or("no reason given")
        );
    }
    let prefill_end = first.unwrap_or(end);
    let rate = |n: usize, secs: f64| n as f64 / secs.max(1e-9);
    Ok(Generation {
        prefill_tok_s: rate(prompt.len(), (prefill_end - t0).as_secs_f64()),
        decode_tok_s: rate(
            f.generated.len().saturating_sub(1),
            (end - prefill_end).as_secs_f64(),
        ),
        reason: f.reason,
        ids: f.generated,
        sampler: f.sampler,
        text_tail: f.text_tail,
        speculation: f.speculation,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each option outside its domain is refused by name; the defaults and edges pass.
    #[test]
    fn options_outside_their_domain_are_refused() {
        let ok = GenOptions::max_tokens(4);
        ok.check().unwrap();
        let with = |f: &dyn Fn(&mut GenOptions)| {
            let mut o = ok.clone();
            f(&mut o);
            o.check()
        };
        with(&|o| (o.sampler.top_p, o.sampler.min_p) = (1.0, 1.0)).unwrap();
        with(&|o| o.adjust.logit_bias = vec![(3, f32::NEG_INFINITY)]).unwrap();
        let refused = [
            (
                with(&|o| o.sampler.temperature = f32::NAN),
                "temperature NaN",
            ),
            (with(&|o| o.sampler.temperature = -0.5), "temperature -0.5"),
            (with(&|o| o.sampler.top_p = 0.0), "top_p 0"),
            (with(&|o| o.sampler.top_p = f32::NAN), "top_p NaN"),
            (with(&|o| o.sampler.min_p = 2.0), "min_p 2"),
            (
                with(&|o| o.adjust.repetition_penalty = -1.0),
                "repetition_penalty -1",
            ),
            (
                with(&|o| o.adjust.frequency_penalty = f32::NAN),
                "frequency_penalty NaN",
            ),
            (
                with(&|o| o.adjust.logit_bias = vec![(-1, 1.0)]),
                "logit_bias of token -1",
            ),
            (
                with(&|o| o.adjust.logit_bias = vec![(5, f32::NAN)]),
                "logit_bias of token 5",
            ),
            (
                with(&|o| o.stop_tokens.insert(-5).then_some(()).unwrap()),
                "stop token -5",
            ),
            (with(&|o| o.logprobs = Some(usize::MAX)), "logprobs 1844"),
            (
                with(&|o| o.prompt_logprobs = Some(65)),
                "prompt_logprobs 65",
            ),
        ];
        with(&|o| o.logprobs = Some(MAX_LOGPROBS)).unwrap();
        for (got, says) in refused {
            match got {
                Err(Error::Invalid(m)) => assert!(m.starts_with(says), "{m}"),
                other => panic!("{says}: {other:?}"),
            }
        }
    }
}

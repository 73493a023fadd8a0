//! A multi-turn conversation on one contiguous cache: the cache carries the conversation, so
//! each turn prefills only the tokens the cache does not already hold.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Result};
use kvplug_core::{make_config, KvDtype};

use crate::host::Host;
use crate::model::cache_params;
use crate::run::{Forward, Sampler};
use crate::session::DecodeSession;
use crate::text::{Message, Streamer, Text};

/// What one turn did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TurnReport {
    /// The assistant's answer.
    pub text: String,
    /// Its token ids (ending at the end-of-turn token unless cut at `max_new`).
    pub ids: Vec<i32>,
    /// Prompt tokens already in the cache from earlier turns.
    pub reused_tokens: usize,
    /// Prompt tokens prefilled for this turn.
    pub prefilled_tokens: usize,
    /// Generated tokens per second.
    pub decode_tok_s: f64,
}

/// One conversation: its messages, and the tokens its cache holds.
pub struct Chat {
    text: Text,
    session: DecodeSession,
    fwd: Forward,
    messages: Vec<Message>,
    /// Tokens in the cache, in order (cell i holds `cached[i]`).
    cached: Vec<i32>,
    capacity: usize,
    max_new: usize,
    sampler: Sampler,
}

impl Chat {
    /// A conversation with the model in `model` on `backend`, optionally opened by a
    /// system message.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        host: &Host,
        backend: &str,
        model: &Path,
        system: Option<&str>,
        capacity: usize,
        kv_dtype: KvDtype,
        max_new: usize,
        sampler: Sampler,
    ) -> Result<Self> {
        let text = Text::load(model)?;
        if !text.has_template() {
            bail!(
                "{}: no chat template, so no chat (use kvplug run --raw)",
                model.display()
            );
        }
        let cfg = make_config(&cache_params(model)?, capacity, kv_dtype);
        cfg.validate()?;
        let (session, options) = host.make_decode_session(backend, &cfg)?;
        let fwd = Forward::load(host, backend, model, None, options)?;
        Ok(Chat {
            text,
            session,
            fwd,
            messages: system
                .map(|s| Message::new("system", s))
                .into_iter()
                .collect(),
            cached: Vec::new(),
            capacity,
            max_new,
            sampler,
        })
    }

    /// Answers `user`: renders the whole conversation, reuses the cached tokens it starts
    /// with, prefills the rest, and decodes to the end of the turn. `on_text` gets the answer
    /// as it is produced.
    pub fn turn(
        &mut self,
        user: &str,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<TurnReport> {
        let mut messages = self.messages.clone();
        messages.push(Message::new("user", user));
        let prompt = self.text.encode(&self.text.render(&messages)?)?;
        let reused = prompt
            .iter()
            .zip(&self.cached)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1);
        if prompt.len() + self.max_new > self.capacity {
            bail!(
                "the conversation ({} tokens) + max_new ({}) no longer fits the capacity {}",
                prompt.len(),
                self.max_new,
                self.capacity
            );
        }
        self.session.rewind(reused)?;
        self.cached.truncate(reused);
        let fresh = &prompt[reused..];
        let logits = self.fwd.prefill(fresh, reused, &mut |_| Ok(()))?;
        self.cached.extend_from_slice(fresh);
        let stop = self.text.stop_tokens().clone();
        let mut streamer = Streamer::default();
        let mut ids = vec![self.sampler.sample(&logits)];
        on_text(&streamer.push(&self.text, ids[0])?)?;
        let t = Instant::now();
        while ids.len() < self.max_new && !stop.contains(&ids[ids.len() - 1]) {
            let last = ids[ids.len() - 1];
            let pos = self.cached.len() as i32;
            let logits = self.fwd.call(&[last], &[pos], None)?;
            self.cached.push(last);
            ids.push(self.sampler.sample(&logits[0]));
            on_text(&streamer.push(&self.text, ids[ids.len() - 1])?)?;
        }
        // The last id was sampled but not run; the next turn's prompt decides whether the
        // cache keeps it (a template may render the end of turn differently).
        let answer = self.text.decode(&ids)?;
        messages.push(Message::new("assistant", answer.trim()));
        self.messages = messages;
        Ok(TurnReport {
            text: answer,
            decode_tok_s: (ids.len().saturating_sub(1)) as f64
                / t.elapsed().as_secs_f64().max(1e-9),
            ids,
            reused_tokens: reused,
            prefilled_tokens: fresh.len(),
        })
    }
}

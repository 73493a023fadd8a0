//! A multi-turn conversation on one contiguous cache: the cache carries the conversation, so
//! each turn prefills only the tokens the cache does not already hold. With a session file
//! the conversation survives the process: its K/V, tokens and messages are saved after every
//! turn and restored on start, without re-prefilling.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kvplug_core::{CacheKind, KvDtype};
use kvplug_plugin_api::AbiErrorKind;
use kvplug_runtime::{Context as RtContext, Model};

use crate::error::{fail, Context, Result};
use crate::fingerprint::model_fingerprint;
use crate::generator::{generate, GenOptions};
use crate::sampler::Sampler;
use crate::session_file::{self, Session};
use crate::text::{Message, Text};

/// The `app.*` entry of a chat's session file holding its messages (JSON).
const MESSAGES_KEY: &str = "chat.messages";

/// How a conversation runs.
pub struct ChatOptions {
    /// A system message opening a new conversation.
    pub system: Option<String>,
    /// Cache capacity in cells (the whole conversation).
    pub capacity: usize,
    /// KV storage dtype; `None` = the session file's, else f16.
    pub kv_dtype: Option<KvDtype>,
    /// Most tokens per answer.
    pub max_new: usize,
    /// How tokens are picked.
    pub sampler: Sampler,
    /// A session file: resumed when it exists, written after every turn.
    pub session: Option<PathBuf>,
}

/// A conversation restored from a session file.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Restored {
    /// Tokens whose K/V came from the file.
    pub tokens: usize,
    /// Messages so far.
    pub messages: usize,
    /// Reading, checking and importing the file, in seconds (the model's fingerprint, taken
    /// before, not included).
    pub seconds: f64,
}

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
    text: Arc<Text>,
    ctx: RtContext,
    messages: Vec<Message>,
    /// Tokens in the cache, in order (cell i holds `cached[i]`).
    cached: Vec<i32>,
    capacity: usize,
    max_new: usize,
    sampler: Sampler,
    /// The session file and the model's fingerprint.
    file: Option<(PathBuf, String)>,
    restored: Option<Restored>,
}

impl Chat {
    /// A conversation with `model`: resumed from `opts.session` when that file exists
    /// (refused if it belongs to another model, does not fit the capacity, or conflicts with
    /// `opts.kv_dtype` or `opts.system`), else new.
    pub fn new(model: &Model, opts: ChatOptions) -> Result<Self> {
        let dir = model.dir();
        let text = Arc::new(Text::load(dir)?);
        if !text.has_template() {
            fail!(
                Invalid,
                "{}: no chat template, so no chat (run a raw prompt instead)",
                dir.display()
            );
        }
        let file = opts
            .session
            .map(|p| Ok::<_, crate::Error>((p, model_fingerprint(dir)?)))
            .transpose()?;
        let t = Instant::now();
        let saved = match &file {
            Some((path, fp)) if path.exists() => {
                let s = session_file::read(path)?;
                s.check_fits(path, fp, opts.capacity)?;
                Some(s)
            }
            _ => None,
        };
        let saved_dtype = saved
            .as_ref()
            .map(|s| s.rows.kv_dtype.parse::<KvDtype>())
            .transpose()?;
        let kv_dtype = match (opts.kv_dtype, saved_dtype) {
            (Some(a), Some(b)) if a != b => {
                fail!(Invalid, "the session stores {b} KV, not {a}")
            }
            (a, b) => a.or(b).unwrap_or(KvDtype::F16),
        };
        let ctx = model.context(CacheKind::Contiguous, opts.capacity, kv_dtype)?;
        let mut messages: Vec<Message> = opts
            .system
            .as_deref()
            .map(|s| Message::new("system", s))
            .into_iter()
            .collect();
        let (mut cached, mut restored) = (Vec::new(), None);
        if let Some(s) = saved {
            let saved_messages: Vec<Message> =
                serde_json::from_str(s.app.get(MESSAGES_KEY).map_or("[]", String::as_str))
                    .context("the session's messages")?;
            if !messages.is_empty() && saved_messages.first() != messages.first() {
                fail!(
                    Invalid,
                    "the session has its own system message, not the one given"
                );
            }
            ctx.import_seq(0, &s.rows)?;
            restored = Some(Restored {
                tokens: s.tokens.len(),
                messages: saved_messages.len(),
                seconds: t.elapsed().as_secs_f64(),
            });
            (messages, cached) = (saved_messages, s.tokens);
        }
        Ok(Chat {
            text,
            ctx,
            messages,
            cached,
            capacity: opts.capacity,
            max_new: opts.max_new,
            sampler: opts.sampler,
            file,
            restored,
        })
    }

    /// What was restored from the session file, if anything.
    pub fn restored(&self) -> Option<&Restored> {
        self.restored.as_ref()
    }

    /// The conversation so far.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Writes the session file (atomically), if the chat has one; returns its bytes.
    pub fn save(&self) -> Result<Option<u64>> {
        let Some((path, fingerprint)) = &self.file else {
            return Ok(None);
        };
        let session = Session {
            rows: self.ctx.export_seq(0)?,
            tokens: self.cached.clone(),
            model: fingerprint.clone(),
            app: [(
                MESSAGES_KEY.to_string(),
                serde_json::to_string(&self.messages)?,
            )]
            .into(),
        };
        Ok(Some(session_file::write(path, &session)?))
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
            fail!(
                Invalid,
                "the conversation ({} tokens) + max_new ({}) no longer fits the capacity {}",
                prompt.len(),
                self.max_new,
                self.capacity
            );
        }
        let reused = match self.ctx.rewind(reused) {
            Ok(()) => reused,
            // The sliding layers of a hybrid cache no longer hold the rows the rewound
            // history would need: start the conversation's cache over.
            Err(e) if e.kind == AbiErrorKind::OutOfWindow => {
                self.ctx.rewind(0)?;
                0
            }
            Err(e) => return Err(e.into()),
        };
        self.cached.truncate(reused);
        let fresh = &prompt[reused..];
        let opts = GenOptions {
            max_tokens: self.max_new,
            sampler: self.sampler.clone(),
            stop_tokens: self.text.stop_tokens().clone(),
            ..GenOptions::default()
        };
        let text = Some(self.text.clone());
        let g = generate(&mut self.ctx, text, 0, fresh, reused, opts, &mut |e| {
            on_text(&e.text)
        })?;
        if !g.text_tail.is_empty() {
            on_text(&g.text_tail)?;
        }
        // The sampler's stream goes on from where this turn left it.
        self.sampler = g.sampler.clone();
        // Every generated id but the last was run; the next turn's prompt decides whether
        // the cache keeps them (a template may render the end of turn differently).
        self.cached.extend_from_slice(fresh);
        self.cached
            .extend_from_slice(&g.ids[..g.ids.len().saturating_sub(1)]);
        let answer = self.text.decode(&g.ids)?;
        messages.push(Message::new("assistant", answer.trim()));
        self.messages = messages;
        self.save()?;
        Ok(TurnReport {
            text: answer,
            decode_tok_s: g.decode_tok_s,
            ids: g.ids,
            reused_tokens: reused,
            prefilled_tokens: fresh.len(),
        })
    }
}

//! [`Llm`]: the handle a host application holds — a loaded model with its text (tokenizer,
//! chat template, stop tokens), opened by [`Llm::builder`]. [`Llm::chat`] and
//! [`Llm::complete`] answer on a fresh contiguous context through the one [`Generator`]
//! (`*_stream` pass each piece of text as it is released); [`Llm::context`] and
//! [`Llm::model`] give the low level (`Context::decode`, other cache kinds).
//!
//! [`Generator`]: crate::Generator

use std::path::PathBuf;
use std::sync::Arc;

use kvplug_runtime::{Arithmetic, CacheKind, Context, KvDtype, Model, PluginSearch, Runtime};

use crate::error::fail;
use crate::generator::{generate, Finish, GenOptions, TokenEvent};
use crate::harmony::ContentStream;
use crate::logprobs::TokenLogprobs;
use crate::text::{Message, Text};
use crate::Result;

/// A loaded model with its text, ready to answer. Cheap to share behind an `Arc`: each call
/// makes its own context, so calls on several threads run side by side.
pub struct Llm {
    model: Model,
    text: Arc<Text>,
    kv_dtype: KvDtype,
    capacity: usize,
}

/// One answer: its text, its ids, why it ended and what it cost.
#[derive(Clone, Debug)]
pub struct Answer {
    /// The generated text (a stop string excluded; the stop token's own text excluded). A
    /// harmony model's (GPT-OSS's, [`Text::harmony`]) answer to [`Llm::chat`] is its content
    /// (final channel, preambles), its reasoning apart; [`Llm::complete`] keeps the
    /// channels' markers ([`crate::harmony::parse`] splits them).
    pub text: String,
    /// A harmony model's reasoning (its analysis channel) in a chat answer; empty otherwise.
    pub reasoning: String,
    /// The generated ids (the stop token included).
    pub ids: Vec<i32>,
    /// Each generated id's log-probability and its best alternatives', when `opts.logprobs`
    /// asked (one entry per id).
    pub logprobs: Option<Vec<TokenLogprobs>>,
    /// Why it ended: [`Finish::Length`] also when the capacity is full.
    pub finish: Finish,
    /// Tokens of the prompt as rendered.
    pub prompt_tokens: usize,
    /// What speculation did, when `opts.speculate` asked for it.
    pub speculation: Option<crate::speculative::SpecStats>,
}

/// How an [`Llm`] is opened: [`Llm::builder`] gives the defaults (the `cpu` backend, f16 K/V,
/// 4,096 cells, weights mapped, quantized keys rotated, the cache's own attention arithmetic,
/// the standard plugin search).
#[must_use]
pub struct LlmBuilder {
    path: PathBuf,
    backend: String,
    kv_dtype: KvDtype,
    capacity: usize,
    mmap: bool,
    key_rotation: bool,
    attention: Option<Arithmetic>,
    plugins: Option<PluginSearch>,
    runtime: Option<Runtime>,
}

impl LlmBuilder {
    /// The backend by id (`cpu`, `wgpu`, `mlx`, or an out-of-tree plugin's).
    pub fn backend(mut self, id: &str) -> Self {
        self.backend = id.into();
        self
    }

    /// The K/V storage dtype of the contexts it makes.
    pub fn kv_dtype(mut self, dtype: KvDtype) -> Self {
        self.kv_dtype = dtype;
        self
    }

    /// Cells of the contexts it makes: the longest prompt plus answer.
    pub fn capacity(mut self, cells: usize) -> Self {
        self.capacity = cells;
        self
    }

    /// Map the weight files (the default) or read them into memory (llama.cpp's
    /// `--no-mmap`).
    pub fn mmap(mut self, on: bool) -> Self {
        self.mmap = on;
        self
    }

    /// Store q8/q4 keys Hadamard-rotated (the default) or as they are.
    pub fn key_rotation(mut self, on: bool) -> Self {
        self.key_rotation = on;
        self
    }

    /// The attention arithmetic of its contexts (`None`: each cache's default); refused
    /// when a context is made where the backend does not declare it for the K/V dtype.
    pub fn attention(mut self, arithmetic: Option<Arithmetic>) -> Self {
        self.attention = arithmetic;
        self
    }

    /// Where plugins are searched (default: [`PluginSearch::standard`] with no extra
    /// directory: `KVPLUG_PLUGIN_PATH`, then beside the executable).
    pub fn plugins(mut self, search: PluginSearch) -> Self {
        self.plugins = Some(search);
        self
    }

    /// Plugins already loaded (a host opening several models loads them once).
    pub fn runtime(mut self, runtime: &Runtime) -> Self {
        self.runtime = Some(runtime.clone());
        self
    }

    /// Loads the plugins (unless given), opens the model (a GGUF file or a model directory)
    /// on the backend and reads its text; a capacity or K/V dtype the model's caches cannot
    /// take is refused here, not at the first answer.
    pub fn build(self) -> Result<Llm> {
        let model = self.build_model()?;
        model.cache_config(self.capacity, self.kv_dtype)?;
        let text = Arc::new(Text::load(model.dir())?);
        Ok(Llm {
            model,
            text,
            kv_dtype: self.kv_dtype,
            capacity: self.capacity,
        })
    }
}

impl LlmBuilder {
    /// [`build`](Self::build) without the text: the model alone, opened and configured as
    /// the builder says (a model without a tokenizer, or a caller reading its text itself;
    /// the builder's capacity and K/V dtype are the caller's to apply then).
    pub fn build_model(&self) -> Result<Model> {
        let runtime = match (&self.runtime, &self.plugins) {
            (Some(r), _) => r.clone(),
            (None, Some(search)) => Runtime::load(search),
            (None, None) => Runtime::load(&PluginSearch::standard(&[], false)),
        };
        Ok(
            crate::formats::open_model(&runtime, &self.backend, &self.path)?
                .with_key_rotation(self.key_rotation)
                .with_mmap(self.mmap)
                .with_attention(self.attention),
        )
    }
}

impl Llm {
    /// Opens the model at `path` (a GGUF file or a model directory) as the builder says.
    pub fn builder(path: impl Into<PathBuf>) -> LlmBuilder {
        LlmBuilder {
            path: path.into(),
            backend: "cpu".into(),
            kv_dtype: KvDtype::F16,
            capacity: 4096,
            mmap: true,
            key_rotation: true,
            attention: None,
            plugins: None,
            runtime: None,
        }
    }

    /// The answer to `messages`, rendered by the model's chat template. The model's stop
    /// tokens are added to `opts`'s. `opts.max_tokens` must be at least 1; an answer that
    /// would pass the capacity ends there ([`Finish::Length`]), and a prompt that fills it
    /// is refused. A grammar that fails ([`Finish::Failed`]) is an error; an answer stopped
    /// through `opts.cancel` is one, with what it generated ([`Finish::Cancelled`]).
    pub fn chat(&self, messages: &[Message], opts: GenOptions) -> Result<Answer> {
        self.chat_stream(messages, opts, &mut |_| Ok(()))
    }

    /// [`Llm::chat`], passing each piece of text to `on_text` as it is released (a harmony
    /// model's content only).
    pub fn chat_stream(
        &self,
        messages: &[Message],
        opts: GenOptions,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Answer> {
        if messages.is_empty() {
            fail!(Invalid, "no messages to answer");
        }
        let prompt = self.text.encode(&self.text.render(messages)?)?;
        self.answer(&prompt, opts, self.text.harmony(), on_text)
    }

    /// The continuation of `prompt`, taken as raw text (no chat template), with the same
    /// rules as [`Llm::chat`].
    pub fn complete(&self, prompt: &str, opts: GenOptions) -> Result<Answer> {
        self.complete_stream(prompt, opts, &mut |_| Ok(()))
    }

    /// [`Llm::complete`], passing each piece of text to `on_text` as it is released.
    pub fn complete_stream(
        &self,
        prompt: &str,
        opts: GenOptions,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Answer> {
        let prompt = self.text.encode_raw(prompt)?;
        self.answer(&prompt, opts, false, on_text)
    }

    /// A fresh context of `kind` with the builder's capacity and K/V dtype (the low level:
    /// `Context::decode`, or a [`Generator`](crate::Generator) of your own).
    pub fn context(&self, kind: CacheKind) -> Result<Context> {
        Ok(self.model.context(kind, self.capacity, self.kv_dtype)?)
    }

    /// The model (layer views, other contexts, its config).
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Its tokenizer, chat template and stop tokens.
    pub fn text(&self) -> &Arc<Text> {
        &self.text
    }

    /// `prompt` answered on a fresh contiguous context; a `harmony` answer split into its
    /// content and reasoning.
    fn answer(
        &self,
        prompt: &[i32],
        mut opts: GenOptions,
        harmony: bool,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Answer> {
        if opts.max_tokens == 0 {
            fail!(
                Invalid,
                "max_tokens is 0: nothing to generate (GenOptions::max_tokens(n) sets it)"
            );
        }
        if prompt.len() >= self.capacity {
            fail!(
                Invalid,
                "the prompt ({} tokens) leaves no room to generate in a capacity of {} tokens",
                prompt.len(),
                self.capacity
            );
        }
        opts.max_tokens = opts.max_tokens.min(self.capacity - prompt.len());
        opts.stop_tokens.extend(self.text.stop_tokens());
        // Events' logits are never shown here: a greedy or top-k answer reads back its
        // tokens or candidates, not rows of logits.
        opts.device_argmax = true;
        let mut logprobs = opts.logprobs.map(|_| Vec::new());
        let mut ctx = self.context(CacheKind::Contiguous)?;
        let mut text = String::new();
        let mut content = ContentStream::new(harmony);
        let mut show = |t: &str| -> Result<()> {
            text.push_str(t);
            let shown = content.push(t);
            if shown.is_empty() {
                Ok(())
            } else {
                on_text(&shown)
            }
        };
        let mut on_token = |e: &TokenEvent<'_>| {
            if let (Some(all), Some(l)) = (&mut logprobs, &e.logprobs) {
                all.push(l.clone());
            }
            show(&e.text)
        };
        let done = generate(
            &mut ctx,
            Some(self.text.clone()),
            0,
            prompt,
            0,
            opts,
            &mut on_token,
        )?;
        show(&done.text_tail)?;
        let (text, reasoning) = if harmony {
            let p = crate::harmony::parse(&text, &[], done.reason == Finish::Stop);
            (p.content, p.reasoning)
        } else {
            (text, String::new())
        };
        Ok(Answer {
            text,
            reasoning,
            ids: done.ids,
            logprobs,
            finish: done.reason,
            prompt_tokens: prompt.len(),
            speculation: done.speculation,
        })
    }
}

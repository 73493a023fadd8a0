//! Text in and out of a model directory: the `tokenizers` tokenizer (`tokenizer.json`), the
//! chat template (`tokenizer_config.json`, rendered by [`crate::chat_template`]) and
//! the tokens that end generation.

use std::collections::BTreeSet;
use std::path::Path;

use crate::error::{fail, Context, Result};
use serde_json::Value;

use kvplug_core::files::{read_text, MAX_TEXT_BYTES};

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = read_text(path, MAX_TEXT_BYTES)?;
    serde_json::from_str(&text)
        .with_context(|| format!("{}: invalid JSON", path.display()))
        .map(Some)
}

/// A chat message, as chat templates read it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text (empty for an assistant turn that only calls tools).
    pub content: String,
    /// An assistant's calls: `{"id", "type": "function", "function": {"name", "arguments"}}`
    /// with the arguments as a JSON object (as Hugging Face templates expect them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<Value>,
    /// A tool result's call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result's tool name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A message of `role`.
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    /// A `system` message.
    pub fn system(content: &str) -> Self {
        Message::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: &str) -> Self {
        Message::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: &str) -> Self {
        Message::new("assistant", content)
    }
}

/// The tokenizer, chat template and stop tokens of one model directory.
pub struct Text {
    tokenizer: tokenizers::Tokenizer,
    template: Option<String>,
    bos: Option<String>,
    /// Whether a raw prompt starts with the BOS token (`add_bos_token`).
    add_bos: bool,
    eos: Option<String>,
    /// Whether a raw prompt ends with the EOS token (`add_eos_token`).
    add_eos: bool,
    stop: BTreeSet<i32>,
    /// The template writes OpenAI's harmony (GPT-OSS) and the vocabulary has its markers:
    /// answers keep their special tokens ([`crate::harmony`] parses them).
    harmony: bool,
}

/// Tokens that end generation wherever the vocabulary has them, as llama.cpp finds them by
/// their text: common chat templates' ends of turn, Llama 3's end of text and end of
/// message (a tool call's), Code Llama's end of infill, and Qwen2.5-Coder's
/// fill-in-the-middle pad, repository and file separators.
const END_OF_TURN: [&str; 11] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<end_of_turn>",
    "<|end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "<EOT>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
];

fn ids(v: &Value) -> Vec<i32> {
    match v {
        Value::Number(n) => n.as_i64().map(|i| i as i32).into_iter().collect(),
        Value::Array(a) => a.iter().flat_map(ids).collect(),
        _ => Vec::new(),
    }
}

fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

impl Text {
    /// Loads `tokenizer.json` (required), `tokenizer_config.json`, `config.json` and
    /// `generation_config.json` (optional) from `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            fail!(
                Text,
                "{}: no tokenizer.json, so text prompts are not possible (give token ids)",
                dir.display()
            );
        }
        let tokenizer = read_text(&path, MAX_TEXT_BYTES)?
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| crate::Error::Text(format!("{}: {e}", path.display())))?;
        let tc = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let mut stop = BTreeSet::new();
        for f in ["config.json", "generation_config.json"] {
            if let Some(v) = read_json(&dir.join(f))? {
                stop.extend(ids(&v["eos_token_id"]));
            }
        }
        let eos = token_text(&tc["eos_token"]);
        let template = tc["chat_template"].as_str().map(String::from);
        let harmony = template
            .as_deref()
            .is_some_and(crate::harmony::is_harmony_template)
            && tokenizer.token_to_id("<|message|>").is_some();
        // Harmony's `<|end|>` ends a message (the answer goes on); its turn ends are its own.
        let ends: &[&str] = if harmony {
            &crate::harmony::TURN_ENDS
        } else {
            &END_OF_TURN
        };
        for t in ends.iter().map(|s| s.to_string()).chain(eos.clone()) {
            if let Some(id) = tokenizer.token_to_id(&t) {
                stop.insert(id as i32);
            }
        }
        if harmony {
            // Whatever the configs name, a message's end is not the turn's.
            if let Some(end) = tokenizer.token_to_id("<|end|>") {
                stop.remove(&(end as i32));
            }
        }
        Ok(Text {
            tokenizer,
            template,
            harmony,
            bos: token_text(&tc["bos_token"]),
            add_bos: tc["add_bos_token"].as_bool().unwrap_or(false),
            eos,
            add_eos: tc["add_eos_token"].as_bool().unwrap_or(false),
            stop,
        })
    }

    /// Whether the model answers in OpenAI's harmony (GPT-OSS): its answers' text keeps the
    /// special tokens that mark their channels, for [`crate::harmony::parse`].
    pub fn harmony(&self) -> bool {
        self.harmony
    }

    /// Whether the model has a chat template.
    pub fn has_template(&self) -> bool {
        self.template.is_some()
    }

    /// Tokens that end generation.
    pub fn stop_tokens(&self) -> &BTreeSet<i32> {
        &self.stop
    }

    /// The chat template applied to `messages`, with the assistant's turn opened.
    pub fn render(&self, messages: &[Message]) -> Result<String> {
        self.render_with(messages, true)
    }

    /// The chat template's source, if the model has one.
    pub fn template(&self) -> Option<&str> {
        self.template.as_deref()
    }

    /// The chat template applied to `messages`; `open_turn` opens the assistant's turn
    /// (Hugging Face's `add_generation_prompt`).
    pub fn render_with(&self, messages: &[Message], open_turn: bool) -> Result<String> {
        self.render_tools(messages, &[], open_turn)
    }

    /// [`Text::render_with`] offering `tools` (OpenAI's `{"type": "function", …}` objects)
    /// the way Hugging Face's `apply_chat_template(tools=…)` passes them (`None` when empty).
    pub fn render_tools(
        &self,
        messages: &[Message],
        tools: &[Value],
        open_turn: bool,
    ) -> Result<String> {
        let Some(src) = &self.template else {
            fail!(Text, "this model has no chat template: send the prompt raw");
        };
        let ctx = serde_json::json!({
            "messages": messages,
            "tools": (!tools.is_empty()).then_some(tools),
            "add_generation_prompt": open_turn,
            "bos_token": self.bos.clone().unwrap_or_default(),
            "eos_token": self.eos.clone().unwrap_or_default(),
        });
        crate::chat_template::render(src, &ctx).map_err(crate::Error::Text)
    }

    /// The chat template applied to `messages` with the last one, an assistant's text, left
    /// open for the model to go on with (Hugging Face's `continue_final_message`, Anthropic's
    /// prefill): the rendering without a generation prompt, cut right after that text. The
    /// text is found by a marker rendered after it, not by a search that could stop in the
    /// template's own markup. A `Text` error unless the last message is an assistant's with
    /// text, shown verbatim by the template (its leading whitespace may be trimmed; some
    /// templates drop or rewrite parts of an assistant's turn).
    pub fn render_continuing(&self, messages: &[Message], tools: &[Value]) -> Result<String> {
        /// Private-use characters no template writes of its own.
        const MARK: &str = "\u{F8FF}kvplug-continue\u{F8FF}";
        let text = match messages.split_last() {
            Some((m, _)) if m.role == "assistant" && !m.content.trim().is_empty() => &m.content,
            _ => fail!(
                Text,
                "only an assistant's text as the last message can be continued"
            ),
        };
        let mut marked = messages.to_vec();
        if let Some(last) = marked.last_mut() {
            last.content.push_str(MARK);
        }
        let rendered = self.render_tools(&marked, tools, false)?;
        // Once: a template that writes the text twice would leave the marker in the prompt.
        match rendered
            .find(MARK)
            .filter(|&at| rendered.rfind(MARK) == Some(at))
        {
            Some(at) if rendered[..at].ends_with(text.trim_start()) => {
                Ok(rendered[..at].to_string())
            }
            _ => fail!(
                Text,
                "the chat template does not show the last assistant message as it was given, so \
                 it cannot be continued"
            ),
        }
    }

    /// Token ids of `text`; special tokens written in the text are recognised (a rendered
    /// template contains them).
    pub fn encode(&self, text: &str) -> Result<Vec<i32>> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| crate::Error::Text(format!("tokenizing: {e}")))?;
        Ok(enc.get_ids().iter().map(|&i| i as i32).collect())
    }

    /// One token's text, special tokens written out (as log-probabilities show them).
    pub fn piece(&self, id: i32) -> Result<String> {
        self.tokenizer
            .decode(&[id as u32], false)
            .map_err(|e| crate::Error::Text(format!("detokenizing: {e}")))
    }

    /// Token ids of a raw prompt (no chat template): [`Text::encode`], after the BOS token
    /// when the tokenizer config sets `add_bos_token` (as Hugging Face's tokenizer and
    /// llama.cpp do) and the text does not already start with it, and followed by the EOS
    /// token when it sets `add_eos_token` (as both do).
    pub fn encode_raw(&self, text: &str) -> Result<Vec<i32>> {
        let mut ids = self.encode(text)?;
        let id = |token: &Option<String>, add: bool| {
            token
                .as_deref()
                .filter(|_| add)
                .and_then(|t| self.tokenizer.token_to_id(t))
                .map(|t| t as i32)
        };
        if let Some(bos) = id(&self.bos, self.add_bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        ids.extend(id(&self.eos, self.add_eos));
        Ok(ids)
    }

    /// Text of `ids`: special tokens skipped, but written out for a [`Text::harmony`] model
    /// (they say which channel its text is in).
    pub fn detokenize(&self, ids: &[i32]) -> Result<String> {
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        self.tokenizer
            .decode(&ids, !self.harmony)
            .map_err(|e| crate::Error::Text(format!("detokenizing: {e}")))
    }
}

/// Turns a growing list of ids into text pieces as they become printable: a token that ends
/// inside a multi-byte character is held back until the character is complete. Each push
/// decodes a window, not the whole answer (the incremental detokenization of TGI and vLLM):
/// the tokens of the last piece, as context, and those after them; the new piece is what
/// the window's text adds to the context's own. The pieces add up to the whole answer's
/// text wherever a decoder's text for a run of tokens does not depend on tokens before the
/// run's context (true of byte-level BPE and SentencePiece decoders).
#[derive(Default)]
pub struct Streamer {
    /// The window: the last piece's tokens, then those not printed yet.
    ids: Vec<i32>,
    /// Where the tokens not printed yet start in `ids`.
    read: usize,
    /// Bytes of the context's text (the window's first `read` tokens, decoded alone).
    context: usize,
}

impl Streamer {
    /// Adds `id`; returns the new text that can be printed now.
    pub fn push(&mut self, text: &Text, id: i32) -> Result<String> {
        self.ids.push(id);
        let all = text.detokenize(&self.ids)?;
        if all.ends_with('\u{FFFD}')
            || all.len() <= self.context
            || !all.is_char_boundary(self.context)
        {
            return Ok(String::new());
        }
        let piece = all[self.context..].to_string();
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        self.context = text.detokenize(&self.ids)?.len();
        Ok(piece)
    }

    /// The text of the tokens not printed yet, at the end of generation: bytes that never
    /// completed a character come out as U+FFFD (as a whole detokenized answer writes them).
    pub fn flush(&mut self, text: &Text) -> Result<String> {
        let all = text.detokenize(&self.ids)?;
        let piece = all.get(self.context..).unwrap_or_default().to_string();
        *self = Streamer::default();
        Ok(piece)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::decoders::byte_fallback::ByteFallback;
    use tokenizers::decoders::fuse::Fuse;
    use tokenizers::decoders::sequence::Sequence;
    use tokenizers::decoders::strip::Strip;
    use tokenizers::models::bpe::BPE;
    use tokenizers::normalizers::Replace;

    /// A SentencePiece-style text (as the GGUF import builds for `add_space_prefix`): `▁`
    /// for spaces, byte tokens, and the first leading space stripped from a decoded run.
    fn spm() -> Text {
        let tokens = ["▁hello", "▁world", "▁caf", "<0xC3>", "<0xA9>", "!"];
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .byte_fallback(true)
            .build()
            .unwrap();
        let mut tokenizer = tokenizers::Tokenizer::new(bpe);
        tokenizer.with_decoder(Some(Sequence::new(vec![
            Replace::new("▁", " ").unwrap().into(),
            ByteFallback::new().into(),
            Fuse::new().into(),
            Strip::new(' ', 1, 0).into(),
        ])));
        Text {
            tokenizer,
            template: None,
            harmony: false,
            bos: None,
            add_bos: false,
            eos: None,
            add_eos: false,
            stop: BTreeSet::new(),
        }
    }

    #[test]
    fn streamed_pieces_keep_the_spaces_a_decoded_run_strips() {
        let text = spm();
        let ids = [0, 1, 2, 3, 4, 5, 0, 3];
        let mut streamer = Streamer::default();
        let pieces: Vec<String> = ids
            .iter()
            .map(|&id| streamer.push(&text, id).unwrap())
            .collect();
        // `é`'s first byte is held back until its second arrives; a lone first byte is
        // written as U+FFFD at the end, as the whole answer decodes it.
        assert_eq!(
            pieces,
            ["hello", " world", " caf", "", "é", "!", " hello", ""]
        );
        let tail = streamer.flush(&text).unwrap();
        assert_eq!(tail, "\u{FFFD}");
        assert_eq!(
            text.detokenize(&ids).unwrap(),
            pieces.concat() + &tail,
            "the pieces add up to the whole"
        );
        assert_eq!(
            streamer.flush(&text).unwrap(),
            "",
            "nothing is held after a flush"
        );
    }
}

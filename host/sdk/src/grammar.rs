//! Constrained decoding with `llguidance`: JSON schemas, Lark grammars (and llama.cpp's GBNF,
//! translated) compiled against the model's vocabulary into per-token masks.
//!
//! [`Grammars`] is built once per model from its `tokenizer.json` (llguidance's own reader
//! turns the vocabulary into token bytes; the tokenizer that splits forced text is the
//! model's). A [`Constraint`] is one request's parser state: [`Constraint::prepare`]
//! computes the mask of tokens allowed next (the generator runs it beside the forward
//! pass), [`Constraint::apply`] sets every other logit to −∞, [`Constraint::commit`]
//! advances past the sampled token.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use kvplug_core::files::{read_text, MAX_TEXT_BYTES};

use crate::error::{fail, Result};

/// What to constrain an answer to.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// A JSON schema (`{"type": "object"}` for any object).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark dialect (`%json {…}` embeds a schema).
    Lark(String),
    /// A grammar in llama.cpp's GBNF (`root ::= …`), translated to Lark.
    Gbnf(String),
}

/// `schema` laid out as Python's `json.dumps` writes JSON (`", "` and `": "`, no other
/// whitespace) unless it says otherwise in its own `x-guidance`. llguidance's default lets
/// whitespace run between any two tokens, and a small model sampled warm can spend its whole
/// budget on it; the compact layout is also the one models see most in training.
pub fn compact_json(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(o) = &mut schema {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
        });
    }
    schema
}

/// A Lark rule body matching one JSON value under `schema`, laid out by `compact_json`.
pub fn json_rule(schema: &Value) -> String {
    format!("%json {}", compact_json(schema))
}

/// The stack a grammar compiles on. llguidance compiles depth first: each reference to a
/// rule, terminal or schema definition not compiled yet, and each nested group or schema
/// level, takes a frame, so a long chain of them overflows an ordinary thread's 2 MiB (and a
/// stack overflow aborts the process). Untouched, the stack costs address space only.
const COMPILE_STACK: usize = 256 << 20;

/// The most stack a grammar may need by [`lark_stack`] / [`schema_stack`]: a quarter of
/// [`COMPILE_STACK`], since their costs were measured on one build.
const MAX_COMPILE_STACK: usize = COMPILE_STACK / 4;

/// Stack a compile takes per rule or terminal in a chain of references, per group nested
/// in one, per schema `$ref` in a chain, and per level of a schema's nesting: measured in
/// the dev profile (llguidance at opt-level 2, 2 MiB threads: 600 rules, 655 terminals, 33
/// rules nested 28 deep, 265 references, 23 references nested 20 deep) and rounded up.
const RULE_STACK: usize = 4 << 10;
const GROUP_STACK: usize = 5 << 9;
const REF_STACK: usize = 8 << 10;
const LEVEL_STACK: usize = 9 << 9;

/// An upper bound on the stack compiling Lark `src` takes: every definition (each `:`) may
/// be a link of one chain of references, every group (`(`, `[`) may nest in that chain, and
/// each `%json` schema adds its [`schema_stack`]. The text is split as llguidance's lexer
/// splits it (string literals, regular expressions, which may span lines, `<special>`
/// tokens, `#` and `//` comments, and the JSON after `%json`, `%regex` and `%llguidance` are
/// not grammar), so nothing it compiles goes uncounted.
fn lark_stack(src: &str) -> usize {
    let b = src.as_bytes();
    let line_end = |i: usize| {
        b[i..]
            .iter()
            .position(|&c| c == b'\n')
            .map_or(b.len(), |n| i + n)
    };
    let (mut need, mut i) = (0, 0);
    while i < b.len() {
        i = match b[i] {
            b'#' => line_end(i),
            b'/' if b.get(i + 1) == Some(&b'/') => line_end(i),
            b'"' => past_quoted(b, i + 1, b'"'),
            b'/' => past_quoted(b, i + 1, b'/'),
            b'<' => {
                let name = b[i + 1..]
                    .iter()
                    .position(|&c| c == b'<' || c == b'>' || c.is_ascii_whitespace());
                match name {
                    Some(n) if n > 0 && b[i + 1 + n] == b'>' => i + n + 2,
                    _ => i + 1,
                }
            }
            b':' => {
                need += RULE_STACK;
                i + 1
            }
            b'(' | b'[' => {
                need += GROUP_STACK;
                i + 1
            }
            b'%' => {
                let keyword = ["%json", "%regex", "%llguidance"]
                    .into_iter()
                    .find(|k| b[i..].starts_with(k.as_bytes()));
                let mut after = i + 1;
                if let Some(k) = keyword {
                    let rest = &src[i + k.len()..];
                    let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
                    if let Some(Ok(v)) = values.next() {
                        if k == "%json" {
                            need += schema_stack(&v);
                        }
                        after = i + k.len() + values.byte_offset();
                    }
                }
                after
            }
            _ => i + 1,
        };
    }
    need
}

/// The index past the `end` that closes a literal whose text starts at `i` (a backslash
/// escapes the byte after it), or the end of `b` when none does.
fn past_quoted(b: &[u8], mut i: usize, end: u8) -> usize {
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            c if c == end => return i + 1,
            _ => i += 1,
        }
    }
    b.len()
}

/// An upper bound on the stack compiling JSON schema `schema` takes: a chain through each
/// distinct `$ref` target, each as deep as the schema nests.
fn schema_stack(schema: &Value) -> usize {
    let mut targets = std::collections::HashSet::new();
    let mut deepest = 0;
    let mut todo = vec![(schema, 1)];
    while let Some((v, depth)) = todo.pop() {
        deepest = deepest.max(depth);
        match v {
            Value::Object(o) => {
                if let Some(target) = o.get("$ref").and_then(Value::as_str) {
                    targets.insert(target);
                }
                todo.extend(o.values().map(|x| (x, depth + 1)));
            }
            Value::Array(a) => todo.extend(a.iter().map(|x| (x, depth + 1))),
            _ => {}
        }
    }
    (targets.len() + 1) * (REF_STACK + LEVEL_STACK * deepest)
}

/// The model's vocabulary as llguidance sees it, and the parser factory over it.
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
}

/// The tokenizer llguidance uses to split text the grammar forces: the model's own.
struct ModelTokenizer {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for ModelTokenizer {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Forced text the tokenizer cannot take (a lone piece of a character) is left to the
        // grammar's byte-level path.
        let text = String::from_utf8_lossy(s);
        self.tokenizer
            .encode(text.as_ref(), false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    }
}

impl Grammars {
    /// The grammars of the model in `dir` (its `tokenizer.json`), whose logits have `n_vocab`
    /// entries (at least the tokenizer's vocabulary; padding ids are never allowed), ending
    /// at `eos`.
    pub fn new(dir: &Path, n_vocab: usize, eos: &[i32]) -> Result<Grammars> {
        let path = dir.join("tokenizer.json");
        let text = read_text(&path, MAX_TEXT_BYTES)?;
        let json: Value = serde_json::from_str(&text)?;
        // llguidance's reader asserts on some malformed vocabularies: a refusal, not a crash.
        let words = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| {
                crate::Error::Model(format!(
                    "{}: a vocabulary llguidance cannot read",
                    path.display()
                ))
            })?
            .map_err(|e| crate::Error::Model(format!("{}: {e}", path.display())))?;
        if words.len() > n_vocab {
            fail!(
                Model,
                "{}: {} tokens but the model has {n_vocab} logits",
                path.display(),
                words.len()
            );
        }
        let mut words = words;
        words.resize(n_vocab, Vec::new());
        let Some(&first_eos) = eos.first() else {
            fail!(Model, "the model has no end-of-sequence token");
        };
        let info = TokRxInfo::new(n_vocab as u32, first_eos as u32);
        let mut trie = TokTrie::from(&info, &words);
        // Every end-of-turn token ends a constrained answer (Qwen's <|im_end|> and
        // <|endoftext|>).
        trie = trie.with_eos_tokens(&eos.iter().map(|&t| t as u32).collect::<Vec<_>>());
        let tokenizer = text
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| crate::Error::Model(format!("{}: {e}", path.display())))?;
        let env: TokEnv = Arc::new(ModelTokenizer { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| crate::Error::Model(format!("llguidance: {e}")))?;
        factory.quiet();
        Ok(Grammars {
            factory: Arc::new(factory),
        })
    }

    /// Token `id`'s bytes as the vocabulary spells them (byte-level and byte-fallback
    /// tokens decoded, special tokens written out); empty for an id outside it.
    pub fn token_bytes(&self, id: i32) -> Vec<u8> {
        u32::try_from(id).map_or_else(
            |_| Vec::new(),
            |id| self.factory.tok_env().tok_trie().decode(&[id]),
        )
    }

    /// A fresh constraint for `spec`, its first mask computed. Refused with the reason: a
    /// grammar or schema llguidance cannot compile, one that allows no answer, and, before
    /// compiling, one whose rules, groups and schema references could nest its compile
    /// past 64 MiB of stack (it compiles on a thread of 256 MiB of its own). A failure to
    /// start that thread is an [`Io`](crate::Error::Io) error.
    pub fn constraint(&self, spec: &GrammarSpec) -> Result<Constraint> {
        let (grammar, stack) = match spec {
            GrammarSpec::JsonSchema(schema) => (
                TopLevelGrammar::from_json_schema(compact_json(schema)),
                schema_stack(schema),
            ),
            GrammarSpec::Lark(src) => (TopLevelGrammar::from_lark(src.clone()), lark_stack(src)),
            GrammarSpec::Gbnf(src) => {
                let lark = gbnf_to_lark(src)?;
                let stack = lark_stack(&lark);
                (TopLevelGrammar::from_lark(lark), stack)
            }
        };
        if stack > MAX_COMPILE_STACK {
            fail!(
                Invalid,
                "the grammar nests too deeply: compiling its rules, terminals and schema \
                 references, each as deeply nested as written, could take {} MiB of stack, \
                 past the {} MiB allowed",
                stack.div_ceil(1 << 20),
                MAX_COMPILE_STACK >> 20
            );
        }
        // Compiled, and its first mask computed: a grammar that allows no answer at all
        // (`{"$ref": "#"}`, `s: s`) is refused here, before any token is generated.
        let compile = move || {
            let parser = self
                .factory
                .create_parser(grammar)
                .map_err(|e| format!("the grammar does not compile: {}", reason(e)))?;
            let mut matcher = Matcher::new(Ok(parser));
            let mask = matcher
                .compute_mask()
                .map_err(|e| format!("the grammar allows no answer: {}", reason(e)))?;
            // Not counted in `mask_stats`: it was not computed beside a forward pass.
            Ok::<_, String>(Constraint {
                matcher,
                mask: Some(mask),
                mask_time: Duration::ZERO,
                masks: 0,
            })
        };
        let compiled = std::thread::scope(|s| {
            let thread = std::thread::Builder::new()
                .name("kvplug-grammar".into())
                .stack_size(COMPILE_STACK)
                .spawn_scoped(s, compile)?;
            thread.join().map_err(|_| {
                crate::Error::Invalid("the grammar compiler failed on this grammar".into())
            })
        })?;
        compiled.map_err(crate::Error::Invalid)
    }
}

/// llguidance's message for `e`, without the parser state it appends (tokens, rows, timings).
fn reason(e: impl std::fmt::Display) -> String {
    let e = e.to_string();
    match e.split_once("\n<state>") {
        Some((reason, _)) => reason.to_string(),
        None => e,
    }
}

/// One request's grammar state (cheap to clone before it has been stepped).
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    /// The tokens allowed next, once [`prepare`](Self::prepare)d.
    mask: Option<SimpleVob>,
    mask_time: Duration,
    masks: u32,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("finished", &self.is_finished())
            .field("masks", &self.masks)
            .finish()
    }
}

impl Constraint {
    /// Computes the mask of tokens allowed next (idempotent until the next commit).
    pub fn prepare(&mut self) -> Result<()> {
        if self.mask.is_some() {
            return Ok(());
        }
        let t = std::time::Instant::now();
        let mask = self
            .matcher
            .compute_mask()
            .map_err(|e| crate::Error::Invalid(format!("constrained decoding: {}", reason(e))))?;
        self.mask_time += t.elapsed();
        self.masks += 1;
        self.mask = Some(mask);
        Ok(())
    }

    /// Sets every logit the grammar does not allow next to −∞ (after
    /// [`prepare`](Self::prepare)).
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<()> {
        self.prepare()?;
        let mask = self.mask.as_ref().expect("prepared");
        for (i, l) in logits.iter_mut().enumerate() {
            if !mask.is_allowed(i as TokenId) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances past `token` (which the mask allowed).
    pub fn commit(&mut self, token: i32) -> Result<()> {
        self.mask = None;
        self.matcher
            .consume_token(token as TokenId)
            .map_err(|e| crate::Error::Invalid(format!("constrained decoding: {}", reason(e))))
    }

    /// Advances past `tokens` generated before the constraint applied; false (the state
    /// then unusable) when the grammar refuses them.
    pub fn catch_up(&mut self, tokens: &[i32]) -> bool {
        self.mask = None;
        let ids: Vec<TokenId> = tokens.iter().map(|&t| t as TokenId).collect();
        self.matcher.consume_tokens(&ids).is_ok() && !self.matcher.is_error()
    }

    /// Whether the grammar is complete and allows nothing more.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Masks computed beside forward passes so far (not the one computed when the
    /// constraint was built) and the time they took (for the metrics).
    pub fn mask_stats(&self) -> (u32, Duration) {
        (self.masks, self.mask_time)
    }
}

/// llama.cpp's GBNF (`name ::= alternatives`, `root` the start, `[...]` character classes,
/// `"..."` literals, `( )`, `* + ?`, `{m,n}`, `#` comments) as llguidance Lark.
pub fn gbnf_to_lark(src: &str) -> Result<String> {
    let mut out = String::new();
    let mut chars = src.chars().peekable();
    let mut saw_root = false;
    while let Some(&c) = chars.peek() {
        match c {
            '#' => {
                while chars.next().is_some_and(|c| c != '\n') {}
                out.push('\n');
            }
            '"' => {
                out.push(chars.next().expect("peeked"));
                let mut escaped = false;
                loop {
                    let Some(c) = chars.next() else {
                        fail!(Invalid, "grammar: an unterminated string");
                    };
                    out.push(c);
                    if escaped {
                        escaped = false;
                    } else if c == '\\' {
                        escaped = true;
                    } else if c == '"' {
                        break;
                    }
                }
            }
            '[' => {
                out.push('/');
                let mut escaped = false;
                for c in chars.by_ref() {
                    if c == '/' && !escaped {
                        out.push('\\');
                    }
                    out.push(c);
                    if escaped {
                        escaped = false;
                    } else if c == '\\' {
                        escaped = true;
                    } else if c == ']' {
                        break;
                    }
                }
                if !out.ends_with(']') {
                    fail!(Invalid, "grammar: an unterminated character class");
                }
                out.push('/');
            }
            '.' => {
                chars.next();
                out.push_str("/(?s:.)/");
            }
            ':' => {
                chars.next();
                if chars.next_if_eq(&':').is_some() && chars.next_if_eq(&'=').is_some() {
                    out.push(':');
                } else {
                    fail!(Invalid, "grammar: a ':' that is not '::='");
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' => {
                let mut name = String::new();
                while let Some(&c) = chars.peek() {
                    if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                        name.push(c);
                        chars.next();
                    } else {
                        break;
                    }
                }
                // Lark rule names are lower case; GBNF's may not be.
                let name = name.to_ascii_lowercase().replace('-', "_");
                if name == "root" {
                    saw_root = true;
                    out.push_str("start");
                } else {
                    out.push_str("g_");
                    out.push_str(&name);
                }
            }
            _ => out.push(chars.next().expect("peeked")),
        }
    }
    if !saw_root {
        fail!(Invalid, "grammar: GBNF needs a 'root' rule");
    }
    // A GBNF rule continues on indented lines; Lark's do too, but a newline inside
    // parentheses is not allowed there: join continuation lines.
    Ok(join_continuations(&out))
}

/// Lines that do not start a rule (`name:`) are appended to the rule above.
fn join_continuations(src: &str) -> String {
    let mut out = String::new();
    for line in src.lines() {
        let t = line.trim();
        if t.is_empty() {
            continue;
        }
        let starts_rule = t.split_once(':').is_some_and(|(name, _)| {
            let name = name.trim();
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
        if starts_rule && !out.is_empty() {
            out.push('\n');
        } else if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(t);
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn gbnf_translates_to_lark() {
        let g = "root ::= answer\n# a comment\nanswer ::= \"yes\" | \"no\" | [0-9]+ (\",\"\n   [a-z]{1,3})*\n";
        let lark = gbnf_to_lark(g).unwrap();
        assert_eq!(
            lark,
            "start : g_answer\ng_answer : \"yes\" | \"no\" | /[0-9]/+ (\",\" /[a-z]/{1,3})*\n"
        );
        assert!(gbnf_to_lark("answer ::= \"x\"").is_err(), "no root");
        assert!(gbnf_to_lark("root ::= \"x").is_err(), "unterminated");
    }

    #[test]
    fn a_grammars_stack_bound_counts_definitions_groups_and_schema_references() {
        // Three definitions and two groups; the brackets and colons inside a string, a
        // regular expression and comments count nothing.
        let lark = "start: a\na: ((\"x\") | b)\n  | \"((:\" /[(:]/ // ((:\nb: \"y\" # (:\n";
        assert_eq!(lark_stack(lark), 3 * RULE_STACK + 2 * GROUP_STACK);
        // What follows a regular expression spanning lines, or a special token holding a
        // `/`, is grammar again (llguidance lexes them so).
        for lark in ["a: /x\n/ ((\"y\"))\n", "a: </s> ((\"y\"))\n"] {
            assert_eq!(lark_stack(lark), RULE_STACK + 2 * GROUP_STACK, "{lark:?}");
        }
        // A schema: one chain link per distinct target, each as deep as the schema nests
        // (the object, `$defs`, `d`, its `items` and the reference in them: 5 levels).
        let schema = json!({"$defs": {"d": {"type": "array", "items": {"$ref": "#/$defs/d"}}},
                            "anyOf": [{"$ref": "#/$defs/d"}, {"$ref": "#"}]});
        assert_eq!(schema_stack(&schema), 3 * (REF_STACK + 5 * LEVEL_STACK));
        // An embedded schema adds its own; its braces and brackets are not groups.
        let embedded = format!("start: \"<\" /x\n/ %json {schema} \">\"\n");
        assert_eq!(lark_stack(&embedded), RULE_STACK + schema_stack(&schema));
    }
}

//! From checked parameters to what the engine runs: the prompt rendered (with the tools
//! offered the way the chat template expects) and tokenized, the token limit, the sampler,
//! and the grammar the answer must follow — a JSON schema, a grammar, or the tool-call form
//! of the model's template family with each call's arguments under its tool's schema.

use kvplug::tools::{call_grammar, teaches_doubled_braces, Tool, ToolFormat};
use kvplug::Triggered;
use kvplug::{json_rule, GrammarSpec};
use kvplug::{GenOptions, Grammars, Sampler, Text};
use serde_json::Value;

use crate::api::{Format, Params, Prompt, ToolChoice};
use crate::error::ApiError;

/// The tools a request's answer may call, and how its template writes the calls (`None`:
/// no tool, `tool_choice` none, or a continued assistant turn).
pub struct Calls {
    /// The tools offered.
    pub tools: Vec<Tool>,
    /// The template family.
    pub format: ToolFormat,
    /// Whether the rendered prompt shows calls in doubled braces (the call grammar then
    /// allows them).
    pub doubled_braces: bool,
}

/// A request ready for the engine.
pub struct Prepared {
    /// Prompt token ids.
    pub prompt: Vec<i32>,
    /// How each completion is generated.
    pub opts: GenOptions,
    /// The tools, when the answer may call them.
    pub calls: Option<Calls>,
}

/// What [`prepare`] needs of the server.
pub struct Model<'a> {
    /// Tokenizer and template.
    pub text: &'a Text,
    /// Token ids the model reads (a prompt of ids is checked against it).
    pub vocab: usize,
    /// The model's grammars, or why it has none.
    pub grammars: &'a Result<Grammars, String>,
    /// Cache capacity: the longest prompt + completion.
    pub capacity: usize,
    /// The server's `max_tokens` limit and default.
    pub max_tokens: usize,
}

/// `p`'s prompt rendered with the tools it offers and tokenized, and the calls its answer
/// may make (as [`Calls`] says). Under `tool_choice` none the model still sees the tools, as
/// OpenAI's, vLLM's and llama.cpp's do (an earlier turn's calls and results keep their
/// meaning) and its answer is text: the prompt is the one an `auto` turn renders, so an
/// agent that switches between the two keeps its cached prefix.
pub fn render(m: &Model, p: &Params) -> Result<(Vec<i32>, Option<Calls>), ApiError> {
    let mut calls = match &p.tools[..] {
        [] => None,
        tools => Some(Calls {
            tools: tools.to_vec(),
            format: match ToolFormat::of_template(m.text.template().unwrap_or_default()) {
                // Harmony's markers are not in this vocabulary: its calls come as text.
                ToolFormat::Harmony if !m.text.harmony() => ToolFormat::Json,
                f => f,
            },
            doubled_braces: false,
        }),
    };
    let continuing = matches!(p.prompt, Prompt::Prefilled(_));
    let prompt = match &p.prompt {
        Prompt::Ids(ids) => {
            in_vocabulary(m, "prompt", ids.iter().copied())?;
            ids.clone()
        }
        // A raw prompt starts with BOS where the tokenizer asks for it, as the CLI's `run
        // --raw` and llama.cpp's server begin it; a chat template writes its own.
        Prompt::Text(t) => encode(m, &mut calls, t, true)?,
        Prompt::Chat(messages) | Prompt::Prefilled(messages) => {
            if !m.text.has_template() {
                return Err(ApiError::invalid(
                    None,
                    "this model has no chat template: use /v1/completions",
                ));
            }
            let tools: Vec<Value> = calls
                .iter()
                .flat_map(|c| c.tools.iter().map(Tool::to_value))
                .collect();
            let rendered = match continuing {
                true => m.text.render_continuing(messages, &tools),
                false => m.text.render_tools(messages, &tools, true),
            }
            .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?;
            encode(m, &mut calls, &rendered, false)?
        }
    };
    if continuing || p.tool_choice == ToolChoice::None {
        // The answer is text (a continuation goes on with the assistant's): no call is
        // looked for in it, though the tools stay in the prompt.
        calls = None;
    }
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            Some("prompt"),
            "the prompt has no tokens",
        ));
    }
    Ok((prompt, calls))
}

/// The token ids of `rendered`, the prompt's text, behind the tokenizer's BOS where `raw`
/// and it asks for one; `calls` learn whether it shows them in doubled braces.
fn encode(
    m: &Model,
    calls: &mut Option<Calls>,
    rendered: &str,
    raw: bool,
) -> Result<Vec<i32>, ApiError> {
    if let Some(c) = calls {
        c.doubled_braces = teaches_doubled_braces(rendered);
    }
    match raw {
        true => m.text.encode_raw(rendered),
        false => m.text.encode(rendered),
    }
    .map_err(|e| ApiError::invalid(None, e.to_string()))
}

/// Refuses (400, naming `param`) a token id outside the model's vocabulary.
fn in_vocabulary(
    m: &Model,
    param: &str,
    mut ids: impl Iterator<Item = i32>,
) -> Result<(), ApiError> {
    match ids.find(|&id| id as usize >= m.vocab) {
        Some(bad) => Err(ApiError::invalid(
            Some(param),
            format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                m.vocab
            ),
        )),
        None => Ok(()),
    }
}

/// The grammar of a batch's prompts (one `format`, no tools), compiled by the first prompt
/// that needs it and cloned for the others ([`kvplug::Constraint`]s are cheap to clone
/// before they are stepped), or the first's refusal.
pub type BatchGrammar = std::sync::OnceLock<Result<Option<kvplug::Constraint>, ApiError>>;

/// Renders, tokenizes and checks `p`, and builds its options; `seed` when it gives none.
/// A prompt of a batch takes its grammar from `batch` where it offers no tools.
pub fn prepare(
    m: &Model,
    p: &Params,
    seed: u64,
    batch: Option<&BatchGrammar>,
) -> Result<Prepared, ApiError> {
    in_vocabulary(
        m,
        "logit_bias",
        p.adjust.logit_bias.iter().map(|&(id, _)| id),
    )?;
    let (prompt, calls) = render(m, p)?;
    let max_tokens = max_tokens(m, p, prompt.len())?;
    let (constraint, triggered) = match (batch, &calls) {
        (Some(once), None) => {
            let compiled = once.get_or_init(|| constraint(m, p, None).map(|(c, _)| c));
            (compiled.clone()?, Vec::new())
        }
        _ => constraint(m, p, calls.as_ref())?,
    };
    let sampler = Sampler::new(p.temperature, p.top_p, p.seed.unwrap_or(seed))
        .with_top_k(p.top_k)
        .with_min_p(p.min_p);
    let opts = GenOptions {
        max_tokens,
        sampler,
        stop_tokens: if p.ignore_eos {
            Default::default()
        } else {
            m.text.stop_tokens().clone()
        },
        stop_strings: p.stop.clone(),
        adjust: p.adjust.clone(),
        constraint,
        triggered,
        logprobs: p.logprobs,
        // `echo` with `logprobs` scores the prompt: every token's row comes back.
        prompt_logprobs: p.logprobs.filter(|_| p.echo),
        // The engine ends requests itself (a client gone, a deadline).
        cancel: None,
        // The engine sets it, with the sequence's earlier tokens.
        speculate: None,
        // Greedy and top-k requests without logprobs or a grammar read back a token or its
        // candidates, not a row of logits (bias and penalties applied on the device).
        device_argmax: true,
    };
    Ok(Prepared {
        prompt,
        opts,
        calls,
    })
}

/// The `max_tokens` to run: the request's, checked against (or, when it is only a bound,
/// lowered to) the server's limit and what the capacity leaves after the prompt (for each
/// of `n` completions), else the largest the server allows.
fn max_tokens(m: &Model, p: &Params, prompt: usize) -> Result<usize, ApiError> {
    let (asked, n, cap) = (p.max_tokens, p.n, m.capacity);
    // An echoed prompt alone (`max_tokens` 0) may fill the context.
    if prompt > cap || (prompt == cap && asked != Some(0)) {
        return Err(ApiError::too_long(
            p.prompt_field,
            // Anthropic's wording (agents such as Claude Code look for it to compact their
            // context), then OpenAI's (which LiteLLM looks for).
            format!(
                "prompt is too long: {prompt} tokens > {} maximum. This model's maximum context \
                 length is {cap} tokens. However, your prompt is {prompt} tokens, which leaves \
                 no room to generate.",
                cap.saturating_sub(1)
            ),
        ));
    }
    // The completions share the prompt's cells; each writes its own.
    let room = (cap - prompt) / n;
    match asked {
        Some(a) if p.max_tokens_is_bound && room > 0 => Ok(a.min(m.max_tokens).min(room)),
        Some(a) if a > m.max_tokens && !p.max_tokens_is_bound => Err(ApiError::invalid(
            Some("max_tokens"),
            format!(
                "max_tokens {a} is above this server's limit of {}",
                m.max_tokens
            ),
        )),
        Some(a) if a > room => Err(ApiError::too_long(
            p.prompt_field,
            format!(
                "This model's maximum context length is {cap} tokens. However, you requested {} \
             tokens ({prompt} in the prompt, {a} in each of {n} completion(s)).",
                prompt + a * n
            ),
        )),
        Some(a) => Ok(a),
        None if room == 0 => Err(ApiError::too_long(
            p.prompt_field,
            format!(
                "This model's maximum context length is {cap} tokens: {n} completions of a \
             {prompt}-token prompt do not fit."
            ),
        )),
        None => Ok(m.max_tokens.min(room)),
    }
}

/// The grammar the answer must follow from its start, and those that apply once it opens a
/// tool call (the model may also answer in text).
fn constraint(
    m: &Model,
    p: &Params,
    calls: Option<&Calls>,
) -> Result<(Option<kvplug::Constraint>, Vec<Triggered>), ApiError> {
    let schema = match &p.format {
        Format::Json(s) => Some(
            s.clone()
                .unwrap_or_else(|| serde_json::json!({"type": "object"})),
        ),
        _ => None,
    };
    let compile = |spec: GrammarSpec, param: &str| -> Result<kvplug::Constraint, ApiError> {
        let grammars = m.grammars.as_ref().map_err(|why| {
            ApiError::invalid(
                Some(param),
                format!("this model's tokenizer cannot be used for constrained decoding: {why}"),
            )
        })?;
        grammars.constraint(&spec).map_err(|e| match e {
            kvplug::Error::Io(e) => ApiError::internal(format!("compiling the grammar: {e}")),
            e => ApiError::invalid(Some(param), e.to_string()),
        })
    };
    if m.text.harmony() {
        // Its answer opens with a channel's markers, which a grammar from the answer's start
        // would forbid: its calls are parsed instead (tool_choice "auto").
        let param = match (&p.format, &p.tool_choice) {
            (Format::Json(_), _) => Some(p.format_field),
            (Format::Grammar(_), _) => Some("grammar"),
            (_, ToolChoice::Required | ToolChoice::Named(_)) if calls.is_some() => {
                Some("tool_choice")
            }
            _ => None,
        };
        return match param {
            Some(param) => Err(ApiError::invalid(
                Some(param),
                "this model answers in OpenAI's harmony format (GPT-OSS), whose answers \
                 cannot be constrained yet; with tool_choice \"auto\" its tool calls are \
                 parsed from its answer"
                    .to_string(),
            )),
            None => Ok((None, Vec::new())),
        };
    }
    let Some(c) = calls else {
        let spec = match (&p.format, schema) {
            (_, Some(s)) => (GrammarSpec::JsonSchema(s), p.format_field),
            (Format::Grammar(g), _) if g.contains("::=") => {
                (GrammarSpec::Gbnf(g.clone()), "grammar")
            }
            (Format::Grammar(g), _) => (GrammarSpec::Lark(g.clone()), "grammar"),
            _ => return Ok((None, Vec::new())),
        };
        return Ok((Some(compile(spec.0, spec.1)?), Vec::new()));
    };
    let tools: Vec<Tool> = match &p.tool_choice {
        ToolChoice::Named(n) => c.tools.iter().filter(|t| &t.name == n).cloned().collect(),
        _ => c.tools.clone(),
    };
    let parallel = p.parallel_tool_calls && !matches!(p.tool_choice, ToolChoice::Named(_));
    let grammar = |format, parallel| {
        call_grammar(&tools, format, parallel, c.doubled_braces)
            .map_err(|e| ApiError::invalid(Some("tools"), e.to_string()))
    };
    let calls = grammar(c.format, parallel)?;
    match (&p.tool_choice, schema) {
        // The answer is the calls.
        (ToolChoice::Required | ToolChoice::Named(_), _) => Ok((
            Some(compile(GrammarSpec::Lark(calls), "tools")?),
            Vec::new(),
        )),
        // Calls, or the structured final answer.
        (_, Some(s)) => {
            let calls = calls.replacen("start:", "calls:", 1);
            let spec = GrammarSpec::Lark(format!("start: calls | {}\n{calls}", json_rule(&s)));
            Ok((Some(compile(spec, p.format_field)?), Vec::new()))
        }
        // Free text, or calls once the model opens one: with its template's tag anywhere, or
        // (small models do) with a bare JSON object at the start of the answer.
        (_, None) => {
            let mut waiting = Vec::new();
            if let Some(opening) = c.format.opening() {
                waiting.push(Triggered {
                    opening: opening.to_string(),
                    at_start: false,
                    constraint: compile(GrammarSpec::Lark(calls), "tools")?,
                });
            }
            // One bare call: a small model that writes calls this way tends to repeat them.
            waiting.push(Triggered {
                opening: "{".into(),
                at_start: true,
                constraint: compile(GrammarSpec::Lark(grammar(bare(c.format), false)?), "tools")?,
            });
            Ok((None, waiting))
        }
    }
}

/// The bare-object form of a family's calls (Llama 3 names its arguments `parameters`).
fn bare(format: ToolFormat) -> ToolFormat {
    match format {
        ToolFormat::Llama3 => ToolFormat::Llama3,
        _ => ToolFormat::Json,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{parse, Endpoint};

    #[test]
    fn a_harmony_answer_is_not_constrained_and_says_why() {
        let text = crate::answer::tests::harmony_text();
        let grammars = Err("not needed".to_string());
        let m = Model {
            text: &text,
            vocab: 1000,
            grammars: &grammars,
            capacity: 4096,
            max_tokens: 256,
        };
        let tools = r#""tools": [{"type": "function", "function": {"name": "f",
            "parameters": {"type": "object"}}}]"#;
        let asked = |extra: &str| {
            let body = format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}]{extra}}}"#);
            let p = parse(Endpoint::Chat, body.as_bytes()).unwrap();
            let calls = (!p.tools.is_empty()).then(|| Calls {
                tools: p.tools.clone(),
                format: ToolFormat::Harmony,
                doubled_braces: false,
            });
            constraint(&m, &p, calls.as_ref()).map(|(c, w)| (c.is_none(), w.len()))
        };
        for (extra, param) in [
            (
                r#", "response_format": {"type": "json_object"}"#.to_string(),
                "response_format",
            ),
            (r#", "grammar": "start: \"a\"""#.to_string(), "grammar"),
            (
                format!(r#", {tools}, "tool_choice": "required""#),
                "tool_choice",
            ),
        ] {
            let e = asked(&extra).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{extra}");
            assert!(e.message.contains("harmony"), "{}", e.message);
        }
        // Free text, or calls parsed from the answer.
        assert_eq!(asked("").unwrap(), (true, 0));
        assert_eq!(asked(&format!(", {tools}")).unwrap(), (true, 0));
    }
}

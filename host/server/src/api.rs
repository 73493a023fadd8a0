//! The OpenAI request bodies `kvplug serve` accepts, checked field by field: a wrong type or
//! value is a 400 that names the field. Every field OpenAI's chat and completions APIs define
//! is either implemented, ignored because it cannot change the answer (`user`, `metadata`,
//! `store`, ...), or refused because it would change it in a way this server does not
//! implement (`echo`, `audio`, ...); a field nobody defines is refused too, never ignored.

use serde_json::{Map, Value};

use crate::error::ApiError;
use kvplug::tools::Tool;
use kvplug::Message;

/// Which endpoint a body is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`: `messages` through the chat template.
    Chat,
    /// `/v1/completions`: a raw `prompt`.
    Completion,
}

/// What to generate from.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Chat messages (rendered with the model's template, assistant turn opened).
    Chat(Vec<Message>),
    /// Chat messages whose last one, an assistant's text, the answer goes on with
    /// (Anthropic's prefill): rendered with that turn left open.
    Prefilled(Vec<Message>),
    /// Raw text.
    Text(String),
    /// Token ids, fed as they are (OpenAI's array of integers).
    Ids(Vec<i32>),
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// The model decides (the default with tools).
    #[default]
    Auto,
    /// No call.
    None,
    /// At least one call, of any tool.
    Required,
    /// A call of this tool.
    Named(String),
}

/// What the answer must follow, beside tool calls.
#[derive(Clone, Debug, PartialEq)]
pub enum Format {
    /// Free text.
    Text,
    /// A JSON object, of this schema when given.
    Json(Option<Value>),
    /// A grammar: Lark, or GBNF when it has `::=`.
    Grammar(String),
}

/// A checked request.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    /// What to generate from.
    pub prompt: Prompt,
    /// `/v1/completions`' batch form: the prompts after `prompt`, each answered with its own
    /// `n` choices (numbered prompt by prompt, as OpenAI numbers them).
    pub more_prompts: Vec<Prompt>,
    /// The request field it came in (`messages`, `prompt`, `input`): the `param` of a
    /// `context_length_exceeded` error.
    pub prompt_field: &'static str,
    /// The request field a JSON answer format came in (`response_format`, the Responses
    /// API's `text`, the Messages API's `output_config`): the `param` of its errors.
    pub format_field: &'static str,
    /// `max_completion_tokens` or `max_tokens` (0 only with `echo`: the prompt alone); the
    /// server's default when absent.
    pub max_tokens: Option<usize>,
    /// Whether `max_tokens` is only a bound (Anthropic's `max_tokens`, the Responses API's
    /// `max_output_tokens`: clients send their model's largest), lowered to the server's
    /// limit and the room the prompt leaves instead of refused above them.
    pub max_tokens_is_bound: bool,
    /// 0 = greedy (default 1, OpenAI's).
    pub temperature: f32,
    /// Nucleus mass (default 1).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep tokens at least `min_p` times as likely as the best (0 = all).
    pub min_p: f32,
    /// Penalties and logit bias.
    pub adjust: kvplug::Adjustments,
    /// Keep generating past end-of-turn tokens.
    pub ignore_eos: bool,
    /// Up to 4 non-empty stop strings.
    pub stop: Vec<String>,
    /// Sampling seed; a fresh one per request when absent.
    pub seed: Option<u64>,
    /// Completions of the prompt (sharing its K/V).
    pub n: usize,
    /// Log-probabilities: `None`, or `Some(k)` with the `k` best alternatives per token.
    pub logprobs: Option<usize>,
    /// `/v1/completions`' `echo`: each choice's text (and, with `logprobs`, its tokens'
    /// log-probabilities, the first token's null) starts with the prompt's.
    pub echo: bool,
    /// Functions the model may call.
    pub tools: Vec<Tool>,
    /// Whether and which tool to call.
    pub tool_choice: ToolChoice,
    /// Several calls in one answer (default true).
    pub parallel_tool_calls: bool,
    /// What the answer must follow.
    pub format: Format,
    /// Server-sent events instead of one JSON answer.
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with `usage`.
    pub include_usage: bool,
    /// Speculative decoding on or off (`None`: the server's default).
    pub speculative: Option<bool>,
}

/// Most stop strings per request (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// Most completions per request (a seq cache runs at most 64 sequences).
pub const MAX_N: u64 = 16;
/// Most alternatives per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// Fields that cannot change the answer.
const IGNORED: [&str; 10] = [
    "model",
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "reasoning_effort",
    "verbosity",
];

/// Fields that would change the answer in ways this server does not implement.
const REFUSED: [&str; 8] = [
    "suffix",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "functions",
    "function_call",
    "best_of",
];

/// Fields this server reads.
const IMPLEMENTED: [&str; 29] = [
    "messages",
    "continue_final_message",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repeat_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "ignore_eos",
    "stop",
    "seed",
    "n",
    "logprobs",
    "top_logprobs",
    "echo",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "grammar",
    "stream",
    "stream_options",
    "speculative",
];

/// A request body's JSON object.
pub fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::invalid(None, "the body must be a JSON object")),
        Err(e) => {
            // serde_json names a lone UTF-16 surrogate (`\ud800` unpaired) by the escape it
            // expected next; say what is wrong with the text.
            let hint = if e.to_string().contains("hex escape") {
                " (a \\uD800-\\uDFFF escape must be half of a surrogate pair)"
            } else {
                ""
            };
            Err(ApiError::invalid(
                None,
                format!("the body is not valid JSON: {e}{hint}"),
            ))
        }
    }
}

/// Refuses, by name, every set field of `f` that is neither `ignored` nor `implemented`.
pub fn refuse_others(f: &Fields, ignored: &[&str], implemented: &[&str]) -> Result<(), ApiError> {
    match f.0.iter().find(|(k, v)| {
        !v.is_null() && !ignored.contains(&k.as_str()) && !implemented.contains(&k.as_str())
    }) {
        Some((k, _)) => Err(ApiError::invalid(
            Some(k),
            format!("'{k}' is not supported"),
        )),
        None => Ok(()),
    }
}

/// `messages`, the last one continued where `continue_final_message` (transformers' and
/// vLLM's name) is true: an assistant's text the answer goes on with, not a fresh turn.
fn chat_prompt(f: &Fields) -> Result<Prompt, ApiError> {
    let messages = messages(f)?;
    if let Some((i, id)) = unanswered_call(&messages) {
        return Err(ApiError::invalid(
            Some("messages"),
            format!(
                "messages[{i}]: a message with role 'tool' must answer a tool call of a message \
                 before it (no tool_calls entry has id '{id}')"
            ),
        ));
    }
    if !f.bool("continue_final_message")?.unwrap_or(false) {
        return Ok(Prompt::Chat(messages));
    }
    match messages.last() {
        Some(m)
            if m.role == "assistant" && m.tool_calls.is_empty() && !m.content.trim().is_empty() =>
        {
            Ok(Prompt::Prefilled(messages))
        }
        _ => Err(ApiError::invalid(
            Some("continue_final_message"),
            "'continue_final_message' needs an assistant's text as the last message",
        )),
    }
}

/// A prefilled prompt's answer goes on with the assistant's text: it cannot also start as a
/// whole structured answer (`format`, the request's field `format_param`) or a forced call.
pub fn check_prefill(
    prompt: &Prompt,
    format: &Format,
    tool_choice: &ToolChoice,
    format_param: &str,
) -> Result<(), ApiError> {
    if !matches!(prompt, Prompt::Prefilled(_)) {
        return Ok(());
    }
    if *format != Format::Text {
        return Err(ApiError::invalid(
            Some(format_param),
            format!("'{format_param}' cannot be combined with a prefilled assistant turn"),
        ));
    }
    if matches!(tool_choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::invalid(
            Some("tool_choice"),
            "a 'tool_choice' that forces a call cannot be combined with a prefilled assistant turn",
        ));
    }
    Ok(())
}

/// Parses and checks a request body.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Params, ApiError> {
    let map = object(body)?;
    let f = Fields(&map);
    f.string("model")?;
    refuse_unsupported(&f)?;
    let (prompt, more_prompts) = match endpoint {
        Endpoint::Chat => (chat_prompt(&f)?, Vec::new()),
        Endpoint::Completion => {
            let mut prompts = completion_prompts(&f)?.into_iter();
            let first = prompts.next().expect("at least one prompt");
            (first, prompts.collect())
        }
    };
    let max_tokens = match f.count("max_completion_tokens")? {
        Some(n) => Some(n),
        None => f.count("max_tokens")?,
    };
    let echo = f.bool("echo")?.unwrap_or(false);
    if max_tokens == Some(0) && !(echo && endpoint == Endpoint::Completion) {
        let param = if f.get("max_completion_tokens").is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        return Err(ApiError::invalid(
            Some(param),
            format!("'{param}' must be at least 1 (0 only to echo a completion's prompt)"),
        ));
    }
    let temperature = f.number("temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32;
    let top_p = f.number("top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32;
    if top_p == 0.0 {
        return Err(ApiError::invalid(Some("top_p"), "'top_p' must be above 0"));
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        // OpenAI's rule: its options have no stream to apply to.
        Some(_) if !stream => {
            return Err(ApiError::invalid(
                Some("stream_options"),
                "'stream_options' is only allowed with 'stream': true",
            ))
        }
        Some(Value::Object(o)) => Fields(o).bool("include_usage")?.unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid(
                Some("stream_options"),
                "'stream_options' must be an object",
            ))
        }
    };
    let n = f.count("n")?.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::invalid(
            Some("n"),
            format!("'n' must be between 1 and {MAX_N}"),
        ));
    }
    let repetition = match f.number("repetition_penalty", 0.0, 10.0)? {
        Some(p) => Some(p),
        None => f.number("repeat_penalty", 0.0, 10.0)?,
    };
    let tools = tools(&f)?;
    let tool_choice = tool_choice(&f, &tools)?;
    let format = format(&f, endpoint)?;
    let format_param = match f.get("grammar") {
        Some(_) => "grammar",
        None => "response_format",
    };
    check_prefill(&prompt, &format, &tool_choice, format_param)?;
    for field in [
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "continue_final_message",
    ] {
        if endpoint == Endpoint::Completion && f.get(field).is_some() {
            return Err(ApiError::invalid(
                Some(field),
                format!("'{field}' is for /v1/chat/completions"),
            ));
        }
    }
    if echo && endpoint == Endpoint::Chat {
        return Err(ApiError::invalid(
            Some("echo"),
            "'echo' is for /v1/completions",
        ));
    }
    let logprobs = logprobs(&f, endpoint)?;
    if !tools.is_empty() && matches!(format, Format::Grammar(_)) && tool_choice != ToolChoice::None
    {
        return Err(ApiError::invalid(
            Some("grammar"),
            "give 'grammar' or 'tools', not both (tool calls follow their own grammar)",
        ));
    }
    Ok(Params {
        prompt,
        more_prompts,
        prompt_field: match endpoint {
            Endpoint::Chat => "messages",
            Endpoint::Completion => "prompt",
        },
        format_field: "response_format",
        max_tokens: max_tokens.map(|n| n.min(usize::MAX as u64) as usize),
        max_tokens_is_bound: false,
        temperature,
        top_p,
        top_k: f
            .count("top_k")?
            .map_or(0, |k| k.min(u32::MAX as u64) as usize),
        min_p: f.number("min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32,
        adjust: kvplug::Adjustments {
            logit_bias: logit_bias(&f)?,
            repetition_penalty: repetition.unwrap_or(1.0) as f32,
            frequency_penalty: f.number("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
            presence_penalty: f.number("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        },
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        stop: stop(&f)?,
        seed: f.seed("seed")?,
        n: n as usize,
        logprobs,
        echo,
        tool_choice,
        parallel_tool_calls: f.bool("parallel_tool_calls")?.unwrap_or(true),
        tools,
        format,
        stream,
        include_usage,
        speculative: f.bool("speculative")?,
    })
}

/// Refuses fields that would change the answer in a way this server does not implement,
/// and fields no OpenAI API defines.
fn refuse_unsupported(f: &Fields) -> Result<(), ApiError> {
    for (k, v) in f.0 {
        if v.is_null() || IGNORED.contains(&k.as_str()) || IMPLEMENTED.contains(&k.as_str()) {
            continue;
        }
        let unset = match (k.as_str(), v) {
            ("best_of", v) => v.as_u64() == Some(1),
            ("modalities", Value::Array(m)) => m.iter().all(|x| x == "text"),
            (_, Value::String(s)) => s.is_empty(),
            (_, Value::Array(a)) => a.is_empty(),
            (_, Value::Object(o)) => o.is_empty(),
            _ => false,
        };
        if unset {
            continue;
        }
        let why = if REFUSED.contains(&k.as_str()) {
            format!("'{k}' is not supported")
        } else {
            format!("unknown field '{k}'")
        };
        return Err(ApiError::invalid(Some(k), why));
    }
    Ok(())
}

/// Field `k`: a count of alternatives a token, at most [`MAX_TOP_LOGPROBS`].
pub fn top_logprobs(f: &Fields, k: &str) -> Result<Option<usize>, ApiError> {
    match f.count(k)? {
        Some(n) if n > MAX_TOP_LOGPROBS => Err(ApiError::invalid(
            Some(k),
            format!("'{k}' must be at most {MAX_TOP_LOGPROBS}"),
        )),
        n => Ok(n.map(|n| n as usize)),
    }
}

/// `logprobs` (chat: a bool with `top_logprobs`; completions: the alternatives' count).
fn logprobs(f: &Fields, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
    let top = |k: &str| top_logprobs(f, k);
    match endpoint {
        Endpoint::Chat => {
            let on = f.bool("logprobs")?.unwrap_or(false);
            let k = top("top_logprobs")?;
            if k.is_some_and(|k| k > 0) && !on {
                return Err(ApiError::invalid(
                    Some("top_logprobs"),
                    "'top_logprobs' needs 'logprobs': true",
                ));
            }
            Ok(on.then_some(k.unwrap_or(0)))
        }
        Endpoint::Completion => match f.get("logprobs") {
            Some(Value::Bool(false)) | None => Ok(None),
            _ => top("logprobs"),
        },
    }
}

/// `tools`: function tools with a name and a JSON-schema object of parameters.
fn tools(f: &Fields) -> Result<Vec<Tool>, ApiError> {
    tools_with(f, |declared, i, t| {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(format!("tools[{i}].type must be \"function\""));
        }
        let func = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| format!("tools[{i}].function must be an object"))?;
        let f = |k: &str| func.get(k).filter(|v| !v.is_null());
        let at = format!("tools[{i}].function");
        declare_tool(declared, &at, f("name"), f("description"), f("parameters"))
    })
}

/// `tools`, an array whose entry `i` becomes a [`Tool`] by `one(declared before it, i,
/// entry)`; its error names the entry.
pub fn tools_with(
    f: &Fields,
    one: impl Fn(&[Tool], usize, &Value) -> Result<Tool, String>,
) -> Result<Vec<Tool>, ApiError> {
    let list = match f.get("tools") {
        None => return Ok(Vec::new()),
        Some(Value::Array(l)) => l,
        Some(_) => return Err(ApiError::invalid(Some("tools"), "'tools' must be an array")),
    };
    let mut out: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let tool = one(&out, i, t).map_err(|m| ApiError::invalid(Some("tools"), m))?;
        out.push(tool);
    }
    Ok(out)
}

/// A declared tool: its `name` (1-64 of a-z A-Z 0-9 _ -, OpenAI's and Anthropic's rule,
/// not among `declared`), `description`, and `parameters` (a JSON schema object of type
/// `object`, as OpenAI and Anthropic require: a call's arguments are an object; absent,
/// none). `at` names the tool in the error.
pub fn declare_tool(
    declared: &[Tool],
    at: &str,
    name: Option<&Value>,
    description: Option<&Value>,
    parameters: Option<&Value>,
) -> Result<Tool, String> {
    let name = name
        .and_then(Value::as_str)
        .filter(|n| {
            (1..=64).contains(&n.len())
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        })
        .ok_or_else(|| format!("{at}.name must be 1-64 of a-z A-Z 0-9 _ -"))?;
    if declared.iter().any(|t| t.name == name) {
        return Err(format!("{at}: '{name}' is declared twice"));
    }
    let parameters = match parameters {
        None => serde_json::json!({"type": "object", "properties": {}}),
        Some(Value::Object(o)) if o.get("type").is_some_and(|t| t != "object") => {
            return Err(format!(
                "{at}: a call's arguments are an object, so its schema's type must be \"object\", \
                 not {}",
                o["type"]
            ))
        }
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err(format!("{at}.parameters must be a JSON schema object")),
    };
    Ok(Tool {
        name: name.to_string(),
        description: description.and_then(Value::as_str).map(String::from),
        parameters,
    })
}

/// `tool_choice`: `auto`, `none`, `required` or `{"type": "function", "function": {"name"}}`.
fn tool_choice(f: &Fields, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let bad = |m: &str| ApiError::invalid(Some("tool_choice"), m);
    let choice = match f.get("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            _ => {
                return Err(bad(
                    "'tool_choice' must be auto, none, required or a function",
                ))
            }
        },
        Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(n) => ToolChoice::Named(n.to_string()),
            None => return Err(bad("'tool_choice' names no function")),
        },
    };
    checked_choice(choice, tools)
}

/// `choice` where `tools` are declared: a required call needs a tool, a named one must be
/// declared.
pub fn checked_choice(choice: ToolChoice, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("tool_choice"), m);
    match &choice {
        ToolChoice::Required if tools.is_empty() => {
            Err(bad("a required call needs 'tools'".into()))
        }
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => Err(bad(format!(
            "'tool_choice' names '{n}', which 'tools' does not declare"
        ))),
        _ => Ok(choice),
    }
}

/// `response_format` (chat) and `grammar`.
fn format(f: &Fields, endpoint: Endpoint) -> Result<Format, ApiError> {
    let grammar = f.string("grammar")?.filter(|g| !g.trim().is_empty());
    let rf = f.get("response_format");
    if grammar.is_some()
        && rf.is_some_and(|r| r.get("type").and_then(Value::as_str) != Some("text"))
    {
        return Err(ApiError::invalid(
            Some("grammar"),
            "give 'grammar' or a JSON 'response_format', not both",
        ));
    }
    if let Some(g) = grammar {
        return Ok(Format::Grammar(g.to_string()));
    }
    let Some(rf) = rf else {
        return Ok(Format::Text);
    };
    let bad = |m: &str| ApiError::invalid(Some("response_format"), m);
    if endpoint != Endpoint::Chat {
        return Err(bad("'response_format' is for /v1/chat/completions"));
    }
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(Format::Text),
        Some("json_object") => Ok(Format::Json(None)),
        // OpenAI requires the `json_schema` object; its `schema` is optional (any JSON
        // object then).
        Some("json_schema") if !rf.get("json_schema").is_some_and(Value::is_object) => Err(bad(
            "'response_format.json_schema' must be an object (required with type json_schema)",
        )),
        Some("json_schema") => match rf.pointer("/json_schema/schema") {
            Some(s @ Value::Object(_)) => Ok(Format::Json(Some(s.clone()))),
            Some(Value::Bool(true)) | None => Ok(Format::Json(None)),
            _ => Err(bad(
                "'response_format.json_schema.schema' must be an object",
            )),
        },
        _ => Err(bad(
            "'response_format.type' must be text, json_object or json_schema",
        )),
    }
}

/// `logit_bias`: token id (as a string key) → bias in [−100, 100].
fn logit_bias(f: &Fields) -> Result<Vec<(i32, f32)>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("logit_bias"), m);
    match f.get("logit_bias") {
        None => Ok(Vec::new()),
        Some(Value::Object(o)) => o
            .iter()
            .map(|(k, v)| {
                let id: i32 = k
                    .parse()
                    .ok()
                    .filter(|&i: &i32| i >= 0)
                    .ok_or_else(|| bad(format!("'{k}' is not a token id")))?;
                let b = v
                    .as_f64()
                    .filter(|b| (-100.0..=100.0).contains(b))
                    .ok_or_else(|| {
                        bad(format!(
                            "the bias of token {k} must be a number in [-100, 100], not {v}"
                        ))
                    })?;
                Ok((id, b as f32))
            })
            .collect(),
        Some(_) => Err(bad("'logit_bias' must be an object".into())),
    }
}

/// `messages`: a non-empty array of `{role, content}`; content is a string or an array of
/// `{"type": "text", "text": ...}` parts. `developer` is the newer name of `system`. An
/// assistant message may carry `tool_calls` (its content then may be null); a `tool` message
/// answers one by `tool_call_id`.
fn messages(f: &Fields) -> Result<Vec<Message>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("messages"), m);
    let Some(list) = f.get("messages") else {
        return Err(bad("'messages' is required".into()));
    };
    let Value::Array(list) = list else {
        return Err(bad("'messages' must be an array".into()));
    };
    if list.is_empty() {
        return Err(bad("'messages' must not be empty".into()));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let Value::Object(m) = m else {
                return Err(bad(format!("messages[{i}] must be an object")));
            };
            let role = match m.get("role").and_then(Value::as_str) {
                Some("developer") => "system",
                Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
                Some(r) => return Err(bad(format!("messages[{i}].role '{r}' is not supported"))),
                None => return Err(bad(format!("messages[{i}].role must be a string"))),
            };
            let calls = match m.get("tool_calls") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(c)) if role == "assistant" => c
                    .iter()
                    .enumerate()
                    .map(|(j, c)| {
                        tool_call(c).map_err(|e| bad(format!("messages[{i}].tool_calls[{j}]: {e}")))
                    })
                    .collect::<Result<_, _>>()?,
                Some(_) => {
                    return Err(bad(format!(
                        "messages[{i}].tool_calls must be an array on an assistant message"
                    )))
                }
            };
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| match (p.get("type"), p.get("text")) {
                        (Some(t), Some(Value::String(s))) if t == "text" => Ok(s.as_str()),
                        _ => Err(bad(format!(
                            "messages[{i}].content: only {{\"type\": \"text\", \"text\": ...}} \
                             parts are supported"
                        ))),
                    })
                    .collect::<Result<String, _>>()?,
                None | Some(Value::Null) if !calls.is_empty() => String::new(),
                _ => {
                    return Err(bad(format!(
                        "messages[{i}].content must be a string or an array of text parts \
                         (null only on an assistant message with tool_calls)"
                    )))
                }
            };
            let mut msg = Message::new(role, &content);
            msg.tool_calls = calls;
            if role == "tool" {
                match m.get("tool_call_id").and_then(Value::as_str) {
                    Some(id) => msg.tool_call_id = Some(id.to_string()),
                    None => {
                        return Err(bad(format!("messages[{i}].tool_call_id must be a string")))
                    }
                }
                msg.name = m.get("name").and_then(Value::as_str).map(String::from);
            }
            Ok(msg)
        })
        .collect()
}

/// The first tool message (its index and `tool_call_id`) that answers no tool call of a
/// message before it: OpenAI's APIs refuse such a conversation.
pub fn unanswered_call(turns: &[Message]) -> Option<(usize, &str)> {
    let mut calls = std::collections::HashSet::new();
    for (i, m) in turns.iter().enumerate() {
        calls.extend(m.tool_calls.iter().filter_map(|c| c["id"].as_str()));
        if let Some(id) = m.tool_call_id.as_deref().filter(|_| m.role == "tool") {
            if !calls.contains(id) {
                return Some((i, id));
            }
        }
    }
    None
}

/// One of an assistant message's `tool_calls`, as chat templates read it: its arguments
/// (OpenAI sends JSON text) as the JSON value they hold.
fn tool_call(c: &Value) -> Result<Value, String> {
    let name = c
        .pointer("/function/name")
        .and_then(Value::as_str)
        .ok_or("function.name must be a string")?;
    let arguments = match c.pointer("/function/arguments") {
        Some(Value::String(s)) => serde_json::from_str::<Value>(s)
            .map_err(|e| format!("function.arguments is not JSON: {e}"))?,
        Some(v @ Value::Object(_)) => v.clone(),
        None | Some(Value::Null) => serde_json::json!({}),
        Some(_) => return Err("function.arguments must be a JSON string".into()),
    };
    Ok(serde_json::json!({
        "id": c.get("id").and_then(Value::as_str).unwrap_or_default(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }))
}

/// Most prompts in one `/v1/completions` request (its batch form).
pub const MAX_PROMPTS: usize = 64;

/// `prompt`: a string, an array of token ids, or OpenAI's batch form, an array of up to
/// [`MAX_PROMPTS`] of either (all strings or all id arrays). The ids are checked against the
/// vocabulary later.
fn completion_prompts(f: &Fields) -> Result<Vec<Prompt>, ApiError> {
    const SHAPE: &str = "'prompt' must be a string, an array of token ids, or an array of \
                         strings or of token-id arrays";
    let bad = |m: &str| ApiError::invalid(Some("prompt"), m);
    let ids = |a: &[Value]| -> Result<Prompt, ApiError> {
        a.iter()
            .map(|v| v.as_u64().and_then(|id| i32::try_from(id).ok()))
            .collect::<Option<Vec<i32>>>()
            .map(Prompt::Ids)
            .ok_or_else(|| bad("'prompt' token ids must be integers from 0 up"))
    };
    let prompts = match f.get("prompt") {
        Some(Value::String(s)) => vec![Prompt::Text(s.clone())],
        Some(Value::Array(a)) if a.is_empty() => return Err(bad(SHAPE)),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => a
            .iter()
            .map(|s| Prompt::Text(s.as_str().unwrap_or_default().to_string()))
            .collect(),
        Some(Value::Array(a)) if a.iter().all(Value::is_array) => a
            .iter()
            .map(|one| ids(one.as_array().map_or(&[], Vec::as_slice)))
            .collect::<Result<_, _>>()?,
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => vec![ids(a)?],
        Some(_) => return Err(bad(SHAPE)),
        None => return Err(bad("'prompt' is required")),
    };
    if prompts.len() > MAX_PROMPTS {
        return Err(bad(&format!(
            "'prompt' holds {} prompts: at most {MAX_PROMPTS} a request",
            prompts.len()
        )));
    }
    Ok(prompts)
}

/// `stop`: a string or an array of up to [`MAX_STOP`] non-empty strings.
fn stop(f: &Fields) -> Result<Vec<String>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("stop"), m);
    let list = match f.get("stop") {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(String::from))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("'stop' must be a string or an array of strings".into()))?,
        Some(_) => return Err(bad("'stop' must be a string or an array of strings".into())),
    };
    if list.len() > MAX_STOP {
        return Err(bad(format!("'stop' takes at most {MAX_STOP} strings")));
    }
    if list.iter().any(String::is_empty) {
        return Err(bad("stop strings must not be empty".into()));
    }
    Ok(list)
}

/// A body's fields; `null` counts as absent.
pub struct Fields<'a>(pub &'a Map<String, Value>);

impl Fields<'_> {
    pub fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    fn wrong(k: &str, what: &str, v: &Value) -> ApiError {
        ApiError::invalid(Some(k), format!("'{k}' must be {what}, got {v}"))
    }

    pub fn string(&self, k: &str) -> Result<Option<&str>, ApiError> {
        self.get(k)
            .map(|v| v.as_str().ok_or_else(|| Self::wrong(k, "a string", v)))
            .transpose()
    }

    pub fn bool(&self, k: &str) -> Result<Option<bool>, ApiError> {
        self.get(k)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| Self::wrong(k, "true or false", v))
            })
            .transpose()
    }

    /// A 64-bit seed: any integer from -2^63 to 2^64 - 1, as its 64 bits.
    fn seed(&self, k: &str) -> Result<Option<u64>, ApiError> {
        self.get(k)
            .map(|v| {
                v.as_u64()
                    .or_else(|| v.as_i64().map(|s| s as u64))
                    .ok_or_else(|| Self::wrong(k, "an integer from -2^63 to 2^64 - 1", v))
            })
            .transpose()
    }

    pub fn count(&self, k: &str) -> Result<Option<u64>, ApiError> {
        self.get(k)
            .map(|v| {
                v.as_u64().ok_or_else(|| {
                    // A whole number past u64 reaches here as a float (1e+30).
                    let past = v.as_f64().is_some_and(|x| x >= u64::MAX as f64);
                    let what = match past {
                        true => "a non-negative integer below 2^64",
                        false => "a non-negative integer",
                    };
                    Self::wrong(k, what, v)
                })
            })
            .transpose()
    }

    pub fn number(&self, k: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        let x = v.as_f64().ok_or_else(|| Self::wrong(k, "a number", v))?;
        if !(lo..=hi).contains(&x) {
            return Err(ApiError::invalid(
                Some(k),
                format!("'{k}' must be between {lo} and {hi}, got {x}"),
            ));
        }
        Ok(Some(x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<Params, ApiError> {
        parse(Endpoint::Chat, body.as_bytes())
    }

    fn refused(body: &str, param: &str, says: &str) {
        let e = chat(body).unwrap_err();
        assert_eq!(e.status, 400, "{body}");
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        assert!(e.message.contains(says), "{body}: {}", e.message);
    }

    const HI: &str = r#""messages": [{"role": "user", "content": "hi"}]"#;

    #[test]
    fn continue_final_message_continues_a_last_assistant_text() {
        let two = r#""messages": [{"role": "user", "content": "Count."},
            {"role": "assistant", "content": "1, 2,"}]"#;
        let p = chat(&format!("{{{two}, \"continue_final_message\": true}}")).unwrap();
        assert!(
            matches!(&p.prompt, Prompt::Prefilled(m) if m.len() == 2),
            "{:?}",
            p.prompt
        );
        // Without it, the last assistant message is a turn of the conversation.
        let p = chat(&format!("{{{two}, \"continue_final_message\": false}}")).unwrap();
        assert!(matches!(&p.prompt, Prompt::Chat(m) if m.len() == 2));
        refused(
            &format!("{{{HI}, \"continue_final_message\": true}}"),
            "continue_final_message",
            "needs an assistant's text as the last message",
        );
        refused(
            &format!(
                r#"{{{two}, "continue_final_message": true, "response_format": {{"type": "json_object"}}}}"#
            ),
            "response_format",
            "cannot be combined with a prefilled assistant turn",
        );
        let e = parse(
            Endpoint::Completion,
            br#"{"prompt": "x", "continue_final_message": true}"#,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("continue_final_message"));
    }

    #[test]
    fn a_chat_body_parses_with_openai_defaults() {
        let p = chat(&format!("{{{HI}, \"model\": \"x\", \"stop\": \"\\n\"}}")).unwrap();
        assert_eq!(p.prompt, Prompt::Chat(vec![Message::new("user", "hi")]));
        assert_eq!((p.temperature, p.top_p, p.stream), (1.0, 1.0, false));
        assert_eq!((p.max_tokens, p.seed), (None, None));
        assert_eq!(p.stop, vec!["\n".to_string()]);
        let p = chat(&format!(
            "{{{HI}, \"max_tokens\": 5, \"max_completion_tokens\": 7, \"temperature\": 0, \
             \"stream\": true, \"stream_options\": {{\"include_usage\": true}}, \"seed\": 3, \
             \"user\": \"u\", \"n\": 1, \"logprobs\": false, \"tools\": [], \"store\": false, \
             \"metadata\": {{\"a\": \"b\"}}, \"echo\": false}}"
        ))
        .unwrap();
        assert_eq!(
            (p.max_tokens, p.temperature, p.seed),
            (Some(7), 0.0, Some(3))
        );
        assert!(p.stream && p.include_usage);
        let parts = r#"{"messages": [{"role": "developer", "content":
            [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}"#;
        assert_eq!(
            chat(parts).unwrap().prompt,
            Prompt::Chat(vec![Message::new("system", "ab")])
        );
        let c = parse(Endpoint::Completion, br#"{"prompt": ["x"]}"#).unwrap();
        assert_eq!(c.prompt, Prompt::Text("x".into()));
        for ids in [r#"[3, 0, 7]"#, r#"[[3, 0, 7]]"#] {
            let body = format!(r#"{{"prompt": {ids}}}"#);
            let c = parse(Endpoint::Completion, body.as_bytes()).unwrap();
            assert_eq!(c.prompt, Prompt::Ids(vec![3, 0, 7]));
            assert!(c.more_prompts.is_empty());
        }
        // The batch form: the prompts after the first in order.
        let c = parse(Endpoint::Completion, br#"{"prompt": ["x", "y", "z"]}"#).unwrap();
        assert_eq!(c.prompt, Prompt::Text("x".into()));
        assert_eq!(
            c.more_prompts,
            [Prompt::Text("y".into()), Prompt::Text("z".into())]
        );
        let c = parse(Endpoint::Completion, br#"{"prompt": [[1], [2, 3]]}"#).unwrap();
        assert_eq!(c.more_prompts, [Prompt::Ids(vec![2, 3])]);
    }

    #[test]
    fn tools_tool_messages_and_sampling_fields_parse() {
        let p = chat(
            r#"{"messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                  "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
              "tools": [{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
              "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}},
              "logprobs": true, "top_logprobs": 2, "n": 3, "top_k": 40, "min_p": 0.05,
              "frequency_penalty": 0.5, "repetition_penalty": 1.1, "logit_bias": {"7": -100},
              "ignore_eos": true}"#,
        )
        .unwrap();
        let Prompt::Chat(m) = &p.prompt else { panic!() };
        assert_eq!(m[1].tool_calls[0]["function"]["arguments"]["city"], "Paris");
        assert_eq!(m[2].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(p.tools[0].name, "get_weather");
        assert_eq!(p.tool_choice, ToolChoice::Named("get_weather".into()));
        assert_eq!(
            p.format,
            Format::Json(Some(serde_json::json!({"type": "object"})))
        );
        assert_eq!((p.logprobs, p.n, p.top_k), (Some(2), 3, 40));
        assert_eq!(p.adjust.logit_bias, vec![(7, -100.0)]);
        assert!(p.ignore_eos);
    }

    #[test]
    fn wrong_types_and_values_name_their_field() {
        let e = chat("{\"messages\": [").unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{e:?}");
        assert!(chat("[1]").unwrap_err().message.contains("JSON object"));
        let e = chat(r#"{"messages": [{"role": "user", "content": "\ud800 hi"}]}"#).unwrap_err();
        assert!(e.message.contains("half of a surrogate pair"), "{e:?}");
        refused(
            r#"{"messages": [{"role": "user", "content": null}]}"#,
            "messages",
            "messages[0].content must be a string or an array of text parts",
        );
        refused("{}", "messages", "required");
        // A tool message answers a call made before it, as OpenAI's API requires.
        refused(
            r#"{"messages": [{"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "nope", "content": "x"}]}"#,
            "messages",
            "messages[1]: a message with role 'tool' must answer a tool call of a message before it (no tool_calls entry has id 'nope')",
        );
        refused(
            r#"{"messages": [{"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "c1", "content": "x"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                  "function": {"name": "f", "arguments": "{}"}}]}]}"#,
            "messages",
            "no tool_calls entry has id 'c1'",
        );
        refused(r#"{"messages": "hi"}"#, "messages", "array");
        refused(r#"{"messages": []}"#, "messages", "empty");
        refused(
            r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
            "messages",
            "robot",
        );
        refused(
            r#"{"messages": [{"role": "user", "content": 5}]}"#,
            "messages",
            "string",
        );
        let with = |extra: &str| format!("{{{HI}, {extra}}}");
        refused(&with(r#""temperature": "hot""#), "temperature", "a number");
        refused(
            &with(r#""temperature": 2.5"#),
            "temperature",
            "between 0 and 2",
        );
        refused(&with(r#""top_p": 0"#), "top_p", "above 0");
        refused(&with(r#""max_tokens": -1"#), "max_tokens", "non-negative");
        refused(&with(r#""max_tokens": 0"#), "max_tokens", "at least 1");
        refused(&with(r#""stream": "yes""#), "stream", "true or false");
        refused(&with(r#""stop": ["a", 1]"#), "stop", "array of strings");
        refused(
            &with(r#""stop": ["a", "b", "c", "d", "e"]"#),
            "stop",
            "at most 4",
        );
        refused(&with(r#""stop": [""]"#), "stop", "empty");
        refused(&with(r#""seed": 1.5"#), "seed", "integer");
        refused(&with(r#""seed": 1e30"#), "seed", "integer");
        let seed = |v: &str| chat(&with(&format!(r#""seed": {v}"#))).unwrap().seed;
        assert_eq!(seed("18446744073709551615"), Some(u64::MAX));
        assert_eq!(seed("-1"), Some(u64::MAX));
        refused(
            &with(r#""stream_options": {"include_usage": true}"#),
            "stream_options",
            "only allowed with 'stream': true",
        );
        refused(&with(r#""model": 7"#), "model", "a string");
        refused(&with(r#""n": 0"#), "n", "between 1 and 16");
        refused(&with(r#""n": 17"#), "n", "between 1 and 16");
        refused(
            &with(r#""top_logprobs": 3"#),
            "top_logprobs",
            "needs 'logprobs'",
        );
        refused(
            &with(r#""logprobs": true, "top_logprobs": 21"#),
            "top_logprobs",
            "at most 20",
        );
        refused(
            &with(r#""tools": [{"type": "function"}]"#),
            "tools",
            "must be an object",
        );
        let tool = r#""tools": [{"type": "function", "function": {"name": "f"}}]"#;
        refused(
            &with(&format!(r#"{tool}, "grammar": "start: \"x\"""#)),
            "grammar",
            "not both",
        );
        let e = parse(
            Endpoint::Completion,
            format!(r#"{{"prompt": "x", {tool}}}"#).as_bytes(),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools"), "{e:?}");
        refused(
            &with(r#""tools": [{"type": "function", "function": {"name": "a b"}}]"#),
            "tools",
            "1-64",
        );
        refused(
            &with(
                r#""tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]"#,
            ),
            "tools",
            "must be \"object\", not \"string\"",
        );
        refused(
            &with(r#""tool_choice": {"type": "function", "function": {"name": "f"}}"#),
            "tool_choice",
            "does not declare",
        );
        refused(
            &with(r#""tool_choice": "required""#),
            "tool_choice",
            "needs 'tools'",
        );
        refused(
            &with(r#""presence_penalty": 3"#),
            "presence_penalty",
            "between -2 and 2",
        );
        refused(&with(r#""logit_bias": {"x": 1}"#), "logit_bias", "token id");
        refused(
            &with(r#""logit_bias": {"5": 101}"#),
            "logit_bias",
            "[-100, 100]",
        );
        refused(
            &with(r#""response_format": {"type": "xml"}"#),
            "response_format",
            "json_schema",
        );
        refused(
            &with(r#""response_format": {"type": "json_schema"}"#),
            "response_format",
            "json_schema' must be an object",
        );
        refused(&with(r#""echo": true"#), "echo", "for /v1/completions");
        assert!(!chat(&with(r#""echo": false"#)).unwrap().echo);
        let completion = |extra: &str| {
            let body = format!(r#"{{"prompt": "x", {extra}}}"#);
            parse(Endpoint::Completion, body.as_bytes())
        };
        let p = completion(r#""echo": true, "logprobs": 2"#).unwrap();
        assert_eq!((p.echo, p.logprobs), (true, Some(2)));
        assert!(completion(r#""echo": true, "n": 3"#).unwrap().echo);
        let p = completion(r#""echo": true, "logprobs": 0, "n": 2"#).unwrap();
        assert_eq!((p.echo, p.logprobs, p.n), (true, Some(0), 2));
        assert_eq!(
            completion(r#""echo": true, "max_tokens": 0"#)
                .unwrap()
                .max_tokens,
            Some(0)
        );
        let e = completion(r#""max_tokens": 0"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"), "{e:?}");
        let e = completion(r#""echo": 1"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("echo"), "{e:?}");
        refused(&with(r#""frobnicate": 1"#), "frobnicate", "unknown field");
        // Mixed batches, negative or fractional ids, nothing, a number, too many prompts.
        let many = format!("[{}]", vec!["[1]"; MAX_PROMPTS + 1].join(", "));
        for prompt in [
            r#"["a", [2]]"#,
            r#"[[1], "b"]"#,
            r#"[[1], [-2]]"#,
            r#"[1, "a"]"#,
            r#"[null]"#,
            many.as_str(),
            r#"[-1]"#,
            r#"[1.5]"#,
            r#"[4294967296]"#,
            r#"[]"#,
            r#"5"#,
        ] {
            let body = format!(r#"{{"prompt": {prompt}}}"#);
            let e = parse(Endpoint::Completion, body.as_bytes()).unwrap_err();
            assert_eq!(e.status, 400, "{prompt}");
            assert_eq!(e.param.as_deref(), Some("prompt"), "{prompt}");
        }
    }
}

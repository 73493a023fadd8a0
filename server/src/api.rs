//! The OpenAI request bodies `kvplug serve` accepts, checked field by field: a wrong type or
//! value is a 400 that names the field. Fields the server does not implement are refused when
//! they would change the answer (`n` > 1, `logprobs`, `tools`, `echo`, ...), and ignored when
//! they would not (`frequency_penalty` 0, `user`, `metadata`, ...).

use serde_json::{Map, Value};

use crate::error::ApiError;
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
    /// Raw text.
    Text(String),
}

/// A checked request.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    /// What to generate from.
    pub prompt: Prompt,
    /// `max_completion_tokens` or `max_tokens`; the server's default when absent.
    pub max_tokens: Option<usize>,
    /// 0 = greedy (default 1, OpenAI's).
    pub temperature: f32,
    /// Nucleus mass (default 1).
    pub top_p: f32,
    /// Up to 4 non-empty stop strings.
    pub stop: Vec<String>,
    /// Sampling seed; a fresh one per request when absent.
    pub seed: Option<u64>,
    /// Server-sent events instead of one JSON answer.
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with `usage`.
    pub include_usage: bool,
}

/// Most stop strings per request (OpenAI's limit).
pub const MAX_STOP: usize = 4;

/// Parses and checks a request body.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Params, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(None, format!("the body is not valid JSON: {e}")))?;
    let Value::Object(map) = &value else {
        return Err(ApiError::invalid(None, "the body must be a JSON object"));
    };
    let f = Fields(map);
    f.string("model")?;
    refuse_unsupported(&f, endpoint)?;
    let prompt = match endpoint {
        Endpoint::Chat => Prompt::Chat(messages(&f)?),
        Endpoint::Completion => Prompt::Text(completion_prompt(&f)?),
    };
    let max_tokens = match f.count("max_completion_tokens")? {
        Some(n) => Some(n),
        None => f.count("max_tokens")?,
    };
    if max_tokens == Some(0) {
        let param = if f.get("max_completion_tokens").is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        return Err(ApiError::invalid(
            Some(param),
            format!("'{param}' must be at least 1"),
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
        Some(Value::Object(o)) => Fields(o).bool("include_usage")?.unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid(
                Some("stream_options"),
                "'stream_options' must be an object",
            ))
        }
    };
    Ok(Params {
        prompt,
        max_tokens: max_tokens.map(|n| n.min(usize::MAX as u64) as usize),
        temperature,
        top_p,
        stop: stop(&f)?,
        seed: f.integer("seed")?.map(|s| s as u64),
        stream,
        include_usage,
    })
}

/// Refuses fields that would change the answer in a way this server does not implement.
fn refuse_unsupported(f: &Fields, endpoint: Endpoint) -> Result<(), ApiError> {
    if let Some(n) = f.count("n")? {
        if n != 1 {
            return Err(ApiError::invalid(Some("n"), "only n = 1 is supported"));
        }
    }
    for p in ["logprobs", "echo"] {
        if f.bool_or_count(p)? {
            return Err(ApiError::invalid(
                Some(p),
                format!("'{p}' is not supported"),
            ));
        }
    }
    if let Some(n) = f.count("best_of")? {
        if n > 1 {
            return Err(ApiError::invalid(
                Some("best_of"),
                "only best_of = 1 is supported",
            ));
        }
    }
    for p in ["frequency_penalty", "presence_penalty"] {
        if f.number(p, -2.0, 2.0)?.is_some_and(|v| v != 0.0) {
            return Err(ApiError::invalid(
                Some(p),
                format!("'{p}' is not supported"),
            ));
        }
    }
    for p in ["tools", "functions", "logit_bias", "suffix"] {
        let empty = match f.get(p) {
            None => true,
            Some(Value::Array(a)) => a.is_empty(),
            Some(Value::Object(o)) => o.is_empty(),
            Some(Value::String(s)) => s.is_empty(),
            Some(_) => false,
        };
        if !empty {
            return Err(ApiError::invalid(
                Some(p),
                format!("'{p}' is not supported"),
            ));
        }
    }
    if endpoint == Endpoint::Chat {
        if let Some(rf) = f.get("response_format") {
            if rf.get("type").and_then(Value::as_str) != Some("text") {
                return Err(ApiError::invalid(
                    Some("response_format"),
                    "only response_format {\"type\": \"text\"} is supported",
                ));
            }
        }
    }
    Ok(())
}

/// `messages`: a non-empty array of `{role, content}`; content is a string or an array of
/// `{"type": "text", "text": ...}` parts. `developer` is the newer name of `system`.
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
                Some(r @ ("system" | "user" | "assistant")) => r,
                Some(r) => return Err(bad(format!("messages[{i}].role '{r}' is not supported"))),
                None => return Err(bad(format!("messages[{i}].role must be a string"))),
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
                _ => return Err(bad(format!("messages[{i}].content must be a string"))),
            };
            Ok(Message::new(role, &content))
        })
        .collect()
}

/// `prompt`: a string, or an array holding one string.
fn completion_prompt(f: &Fields) -> Result<String, ApiError> {
    let bad = |m: &str| ApiError::invalid(Some("prompt"), m);
    match f.get("prompt") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(a)) => match a.as_slice() {
            [Value::String(s)] => Ok(s.clone()),
            _ => Err(bad("'prompt' must be a string or an array of one string")),
        },
        Some(_) => Err(bad("'prompt' must be a string")),
        None => Err(bad("'prompt' is required")),
    }
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
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    fn wrong(k: &str, what: &str, v: &Value) -> ApiError {
        ApiError::invalid(Some(k), format!("'{k}' must be {what}, got {v}"))
    }

    fn string(&self, k: &str) -> Result<Option<&str>, ApiError> {
        self.get(k)
            .map(|v| v.as_str().ok_or_else(|| Self::wrong(k, "a string", v)))
            .transpose()
    }

    fn bool(&self, k: &str) -> Result<Option<bool>, ApiError> {
        self.get(k)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| Self::wrong(k, "true or false", v))
            })
            .transpose()
    }

    /// A flag that OpenAI also takes as a count (`logprobs`): true or above 0.
    fn bool_or_count(&self, k: &str) -> Result<bool, ApiError> {
        match self.get(k) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => v
                .as_u64()
                .map(|n| n > 0)
                .ok_or_else(|| Self::wrong(k, "true, false or a count", v)),
        }
    }

    fn integer(&self, k: &str) -> Result<Option<i64>, ApiError> {
        self.get(k)
            .map(|v| v.as_i64().ok_or_else(|| Self::wrong(k, "an integer", v)))
            .transpose()
    }

    fn count(&self, k: &str) -> Result<Option<u64>, ApiError> {
        self.get(k)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| Self::wrong(k, "a non-negative integer", v))
            })
            .transpose()
    }

    fn number(&self, k: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
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
    fn a_chat_body_parses_with_openai_defaults() {
        let p = chat(&format!("{{{HI}, \"model\": \"x\", \"stop\": \"\\n\"}}")).unwrap();
        assert_eq!(p.prompt, Prompt::Chat(vec![Message::new("user", "hi")]));
        assert_eq!((p.temperature, p.top_p, p.stream), (1.0, 1.0, false));
        assert_eq!((p.max_tokens, p.seed), (None, None));
        assert_eq!(p.stop, vec!["\n".to_string()]);
        let p = chat(&format!(
            "{{{HI}, \"max_tokens\": 5, \"max_completion_tokens\": 7, \"temperature\": 0, \
             \"stream\": true, \"stream_options\": {{\"include_usage\": true}}, \"seed\": 3, \
             \"user\": \"u\", \"n\": 1, \"logprobs\": false, \"tools\": []}}"
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
    }

    #[test]
    fn wrong_types_and_values_name_their_field() {
        let e = chat("{\"messages\": [").unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{e:?}");
        assert!(chat("[1]").unwrap_err().message.contains("JSON object"));
        refused("{}", "messages", "required");
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
        refused(&with(r#""model": 7"#), "model", "a string");
        refused(&with(r#""n": 2"#), "n", "n = 1");
        refused(&with(r#""logprobs": true"#), "logprobs", "not supported");
        refused(
            &with(r#""tools": [{"type": "function"}]"#),
            "tools",
            "not supported",
        );
        refused(
            &with(r#""presence_penalty": 0.5"#),
            "presence_penalty",
            "not supported",
        );
        let e = parse(Endpoint::Completion, br#"{"prompt": [1, 2]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
    }
}

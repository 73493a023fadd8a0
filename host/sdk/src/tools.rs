//! Tool calls: how a chat template's family writes them ([`ToolFormat`]), parsing an
//! answer into text and calls ([`parse`]), and the grammar that makes a call's arguments
//! follow its tool's schema ([`call_grammar`]).
//!
//! Families: Hermes `<tool_call>{"name": …, "arguments": …}</tool_call>` (Qwen2.5/Qwen3 and
//! many others), Llama 3.x JSON (`{"name": …, "parameters": …}`, optionally after
//! `<|python_tag|>`), Mistral `[TOOL_CALLS][{…}]`. Small models often answer with a bare or
//! fenced JSON object naming a declared tool instead of their template's tags: that is a
//! call too. An answer that parses as none of these is text.

use serde_json::{json, Map, Value};

use crate::error::{fail, Result};

/// A function the model may call (OpenAI's `{"type": "function", "function": {…}}`).
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    /// Its name.
    pub name: String,
    /// What it does.
    pub description: Option<String>,
    /// The JSON schema of its arguments.
    pub parameters: Value,
}

impl Tool {
    /// The tool as OpenAI's API and the chat templates write it: `name`, `description`
    /// (when it has one), `parameters`, in that order (a template's `tojson` keeps it).
    pub fn to_value(&self) -> Value {
        let mut f = json!({"name": self.name});
        if let Some(d) = &self.description {
            f["description"] = json!(d);
        }
        f["parameters"] = self.parameters.clone();
        json!({"type": "function", "function": f})
    }
}

/// A call in an answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// The tool's name.
    pub name: String,
    /// Its arguments, as JSON text.
    pub arguments: String,
}

/// How a template family writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`, one block per call.
    Hermes,
    /// A JSON object `{"name": …, "parameters": …}` (Llama 3.x), after `<|python_tag|>` or
    /// alone.
    Llama3,
    /// `[TOOL_CALLS]` and a JSON array of `{"name": …, "arguments": …}`.
    Mistral,
    /// A bare JSON object `{"name": …, "arguments": …}` (templates without a known form).
    Json,
    /// OpenAI's harmony (GPT-OSS): a `commentary` message `to=functions.NAME` whose body is
    /// the arguments ([`crate::harmony`]).
    Harmony,
}

impl ToolFormat {
    /// The family of chat template `src`.
    pub fn of_template(src: &str) -> ToolFormat {
        if crate::harmony::is_harmony_template(src) {
            ToolFormat::Harmony
        } else if src.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if src.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if src.contains("<|python_tag|>") || src.contains("ipython") {
            ToolFormat::Llama3
        } else {
            ToolFormat::Json
        }
    }

    /// The text that closes a call block, where the family has one (Hermes).
    fn closing(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes => Some("</tool_call>"),
            _ => None,
        }
    }

    /// The text that opens a call in this family's answers (`None`: a bare JSON object).
    pub fn opening(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes => Some("<tool_call>"),
            ToolFormat::Mistral => Some("[TOOL_CALLS]"),
            ToolFormat::Llama3 | ToolFormat::Json | ToolFormat::Harmony => None,
        }
    }
}

/// Whether a prompt rendered with tools shows calls in doubled braces (`{{"name": …}}`).
pub fn teaches_doubled_braces(rendered: &str) -> bool {
    rendered.contains("{{\"name\"")
}

/// An answer split into its text, its reasoning and its calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    /// The text outside the calls (trimmed).
    pub content: String,
    /// The model's reasoning, where its format sets it apart (harmony's `analysis`
    /// channel); empty otherwise.
    pub reasoning: String,
    /// The calls, in order.
    pub calls: Vec<ToolCall>,
}

/// The calls in `answer` for `tools` (the template's family first, then a bare or fenced JSON
/// object naming a declared tool); the whole answer as text when it holds none or any part
/// of it does not parse.
pub fn parse(answer: &str, format: ToolFormat, tools: &[Tool]) -> Parsed {
    if format == ToolFormat::Harmony {
        return crate::harmony::parse(answer, tools, true);
    }
    let text = || Parsed {
        content: answer.trim().to_string(),
        ..Parsed::default()
    };
    let named = |calls: Vec<ToolCall>| calls.iter().all(|c| tools.iter().any(|t| t.name == c.name));
    let found = match format {
        ToolFormat::Hermes => hermes(answer),
        ToolFormat::Mistral => answer
            .split_once("[TOOL_CALLS]")
            .and_then(|(before, rest)| Some((before.trim().to_string(), calls_of(rest.trim())?))),
        ToolFormat::Llama3 => {
            let body = answer.trim();
            let body = body.strip_prefix("<|python_tag|>").unwrap_or(body);
            calls_of(body.trim()).map(|c| (String::new(), c))
        }
        ToolFormat::Json | ToolFormat::Harmony => None,
    };
    match found {
        Some((content, calls)) if !calls.is_empty() && named(calls.clone()) => {
            return Parsed {
                content,
                calls,
                ..Parsed::default()
            };
        }
        Some(_) => return text(),
        None => {}
    }
    // A bare or fenced JSON object (or array of them) naming declared tools.
    let body = answer.trim();
    let body = body
        .strip_prefix("```json")
        .or_else(|| body.strip_prefix("```"))
        .and_then(|b| b.trim_end().strip_suffix("```"))
        .unwrap_or(body)
        .trim();
    match calls_of(body) {
        Some(calls) if !calls.is_empty() && named(calls.clone()) => Parsed {
            calls,
            ..Parsed::default()
        },
        _ => text(),
    }
}

/// [`parse`] for an answer cut short (at its token limit or a stop string): the call block of
/// a tagged family (Hermes, Mistral) that it ended inside — its last opening tag, not closed
/// after — is not text, so when no whole call parses, the content is the text before that
/// tag. (A Hermes answer cut after whole calls keeps them, as [`parse`] does; untagged
/// families' answers parse as [`parse`] parses them.)
pub fn parse_cut(answer: &str, format: ToolFormat, tools: &[Tool]) -> Parsed {
    let parsed = parse(answer, format, tools);
    let Some(at) = format.opening().and_then(|o| answer.rfind(o)) else {
        return parsed;
    };
    let closed = format.closing().is_some_and(|c| answer[at..].contains(c));
    match parsed.calls.is_empty() && !closed {
        true => Parsed {
            content: answer[..at].trim().to_string(),
            ..parsed
        },
        false => parsed,
    }
}

/// Hermes blocks: the text outside them and the calls inside; `None` when there is no
/// block, `Some` with no calls when a block does not parse. A last block the answer ended
/// inside (no closing tag) counts if its JSON is whole; after whole calls, one that is not
/// (the answer reached its token limit inside it) is left out.
fn hermes(answer: &str) -> Option<(String, Vec<ToolCall>)> {
    if !answer.contains("<tool_call>") {
        return None;
    }
    let (mut content, mut calls) = (String::new(), Vec::new());
    let mut rest = answer;
    while let Some(at) = rest.find("<tool_call>") {
        content.push_str(&rest[..at]);
        let after = &rest[at + "<tool_call>".len()..];
        let (body, next, closed) = match after.find("</tool_call>") {
            Some(end) => (&after[..end], &after[end + "</tool_call>".len()..], true),
            None => (after, "", false),
        };
        let json = call_json(body);
        if json.is_none() && !closed && !calls.is_empty() {
            rest = "";
            break;
        }
        match call_of(&json?) {
            Some(c) => calls.push(c),
            None => return Some((String::new(), Vec::new())),
        }
        rest = next;
    }
    content.push_str(rest);
    Some((content.trim().to_string(), calls))
}

/// A call's JSON: `text` itself, or the object inside its doubled braces (see
/// [`undoubled`]).
fn call_json(text: &str) -> Option<Value> {
    let t = text.trim();
    serde_json::from_str(t)
        .ok()
        .or_else(|| serde_json::from_str(undoubled(t)?).ok())
}

/// The object inside `{{…}}`: where a chat template's instructions show a call in doubled
/// braces (a Jinja escaping mistake, as in Qwen2.5-Coder's templates), small models copy
/// them.
fn undoubled(text: &str) -> Option<&str> {
    let inner = text.strip_prefix('{')?.strip_suffix('}')?;
    (inner.trim_start().starts_with('{') && inner.trim_end().ends_with('}')).then_some(inner)
}

/// `text` as call objects (one, an array, or several one after the other), or the one
/// object inside doubled braces.
fn calls_of(text: &str) -> Option<Vec<ToolCall>> {
    calls_in(text).or_else(|| calls_in(undoubled(text.trim())?))
}

fn calls_in(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for v in serde_json::Deserializer::from_str(text).into_iter::<Value>() {
        match v.ok()? {
            Value::Array(items) => {
                calls.extend(items.iter().map(call_of).collect::<Option<Vec<_>>>()?)
            }
            v @ Value::Object(_) => calls.push(call_of(&v)?),
            _ => return None,
        }
    }
    (!calls.is_empty()).then_some(calls)
}

/// `{"name": …, "arguments" | "parameters": {…} | "<json>"}`.
fn call_of(v: &Value) -> Option<ToolCall> {
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?.to_string();
    let args = o.get("arguments").or_else(|| o.get("parameters"));
    let arguments = match args {
        None => "{}".to_string(),
        Some(Value::String(s)) => {
            // Arguments sent as JSON text must be JSON.
            serde_json::from_str::<Value>(s).ok()?;
            s.clone()
        }
        Some(v @ Value::Object(_)) => v.to_string(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

/// The Lark grammar of an answer that is one call (or, with `parallel`, one or more) of
/// `tools`, written as `format` writes them, each call's arguments following its tool's
/// schema; with `doubled_braces` a Hermes call object may also stand in doubled braces, as a
/// template showing `{{"name": …}}` teaches (see [`teaches_doubled_braces`]).
pub fn call_grammar(
    tools: &[Tool],
    format: ToolFormat,
    parallel: bool,
    doubled_braces: bool,
) -> Result<String> {
    if tools.is_empty() {
        fail!(Invalid, "no tool to call");
    }
    if format == ToolFormat::Harmony {
        fail!(
            Invalid,
            "a harmony model's (GPT-OSS's) calls cannot be constrained yet: with tool_choice \
             \"auto\" its calls are parsed from its answer"
        );
    }
    let key = if format == ToolFormat::Llama3 {
        "parameters"
    } else {
        "arguments"
    };
    let variants: Vec<Value> = tools
        .iter()
        .map(|t| {
            let mut props = Map::new();
            props.insert("name".into(), json!({"const": t.name}));
            props.insert(key.into(), t.parameters.clone());
            json!({
                "type": "object",
                "properties": props,
                "required": ["name", key],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = json!({"anyOf": variants});
    let one = crate::grammar::json_rule(&schema);
    // Only a tagged family shows its calls in doubled braces; the parser reads one per block.
    let one = match doubled_braces && format == ToolFormat::Hermes {
        true => format!("(\"{{\" {one} \"}}\" | {one})"),
        false => one,
    };
    // Further calls, one per line (or comma-separated in Mistral's array).
    let (more, more_listed) = if parallel {
        (format!(" (\"\\n\" {one})*"), format!(" (\", \" {one})*"))
    } else {
        (String::new(), String::new())
    };
    Ok(match format {
        ToolFormat::Hermes => format!(
            "start: call{}\ncall: \"<tool_call>\\n\" {one} \"\\n</tool_call>\"\n",
            if parallel { " (\"\\n\" call)*" } else { "" }
        ),
        ToolFormat::Mistral => format!("start: \"[TOOL_CALLS][\" {one}{more_listed} \"]\"\n"),
        ToolFormat::Llama3 | ToolFormat::Json => format!("start: {one}{more}\n"),
        ToolFormat::Harmony => unreachable!("refused above"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_is_written_in_openai_order_with_its_schema_as_given() {
        let schema = r#"{"type":"object","properties":{"zone":{"type":"string"},"at":{"type":"number"}},"required":["zone"]}"#;
        let t = Tool {
            name: "clock".into(),
            description: Some("Time in a zone".into()),
            parameters: serde_json::from_str(schema).unwrap(),
        };
        assert_eq!(
            t.to_value().to_string(),
            format!(
                r#"{{"type":"function","function":{{"name":"clock","description":"Time in a zone","parameters":{schema}}}}}"#
            )
        );
    }

    fn tools() -> Vec<Tool> {
        ["get_weather", "add"]
            .map(|n| Tool {
                name: n.into(),
                description: None,
                parameters: json!({"type": "object"}),
            })
            .to_vec()
    }

    #[test]
    fn a_cut_answer_drops_only_the_call_block_it_ended_inside() {
        let t = tools();
        let call = r#"<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>"#;
        let cut = |a: &str, f| parse_cut(a, f, &t);
        // Inside the first call: the text before it.
        let p = cut(r#"Sure. <tool_call>{"name": "get_we"#, ToolFormat::Hermes);
        assert_eq!((p.content.as_str(), p.calls.len()), ("Sure.", 0));
        // After a whole call: the call, no text.
        let p = cut(&format!("{call}\n<tool_call>{{\"na"), ToolFormat::Hermes);
        assert_eq!((p.content.as_str(), p.calls.len()), ("", 1));
        // The tag named in prose before the cut block stays text.
        let p = cut(
            "Calls go in <tool_call> tags.\n<tool_call>{",
            ToolFormat::Hermes,
        );
        assert_eq!(p.content, "Calls go in <tool_call> tags.");
        // A closed block that is no call, then text cut short: all text, as uncut.
        let unknown = r#"<tool_call>{"name": "nope"}</tool_call> and then"#;
        assert_eq!(cut(unknown, ToolFormat::Hermes).content, unknown);
        let p = cut(
            r#"Let me see. [TOOL_CALLS][{"name": "add", "#,
            ToolFormat::Mistral,
        );
        assert_eq!((p.content.as_str(), p.calls.len()), ("Let me see.", 0));
        // Untagged families parse as uncut.
        let json = r#"{"name": "add", "argu"#;
        assert_eq!(
            cut(json, ToolFormat::Json),
            parse(json, ToolFormat::Json, &t)
        );
    }

    #[test]
    fn every_family_parses_and_others_stay_text() {
        let t = tools();
        let call = |n: &str, a: &str| ToolCall {
            name: n.into(),
            arguments: a.into(),
        };
        let p = parse(
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
            ToolFormat::Hermes,
            &t,
        );
        assert_eq!(p.content, "Let me check.");
        assert_eq!(
            p.calls,
            [
                call("get_weather", "{\"city\":\"Paris\"}"),
                call("add", "{\"a\": 1}")
            ]
        );
        let p = parse(
            "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": 2}}]",
            ToolFormat::Mistral,
            &t,
        );
        assert_eq!(p.calls, [call("add", "{\"a\":2}")]);
        let p = parse(
            "<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 3}}",
            ToolFormat::Llama3,
            &t,
        );
        assert_eq!(p.calls, [call("add", "{\"a\":3}")]);
        // A Hermes model answering with a fenced bare object.
        let p = parse(
            "```json\n{\"name\": \"get_weather\", \"arguments\": {}}\n```",
            ToolFormat::Hermes,
            &t,
        );
        assert_eq!(p.calls, [call("get_weather", "{}")]);
        // Calls one after the other.
        let p = parse(
            "{\"name\": \"add\", \"arguments\": {}}\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}",
            ToolFormat::Hermes,
            &t,
        );
        assert_eq!(p.calls, [call("add", "{}"), call("add", "{\"a\":1}")]);
        // An answer that reached its token limit inside a second block: the first call.
        let p = parse(
            "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"ad",
            ToolFormat::Hermes,
            &t,
        );
        assert_eq!(
            (p.content.as_str(), &p.calls[..]),
            ("", &[call("add", "{\"a\":1}")][..])
        );
        // Doubled braces, as a template's instructions may show them, in a block or bare.
        let p = parse(
            "<tool_call>\n{{\"name\": \"add\", \"arguments\": {\"a\": 1}}}\n</tool_call>",
            ToolFormat::Hermes,
            &t,
        );
        assert_eq!(p.calls, [call("add", "{\"a\":1}")]);
        let p = parse(
            "{{\"name\": \"get_weather\", \"arguments\": {}}}",
            ToolFormat::Json,
            &t,
        );
        assert_eq!(p.calls, [call("get_weather", "{}")]);
        // Undeclared tools, broken JSON and plain JSON answers are text.
        for s in [
            "{\"name\": \"rm_rf\", \"arguments\": {}}",
            "<tool_call>{\"name\": \"add\", \"arguments\": {</tool_call>",
            "{\"answer\": 42}",
            "{{\"answer\": 42}}",
            "{{\"name\": \"add\"}",
            "The weather is fine.",
        ] {
            let p = parse(s, ToolFormat::Hermes, &t);
            assert!(p.calls.is_empty(), "{s}");
            assert_eq!(p.content, s.trim(), "{s}");
        }
    }

    #[test]
    fn only_tagged_calls_may_stand_in_doubled_braces() {
        let t = tools();
        let grammar = |f, doubled| call_grammar(&t, f, true, doubled).unwrap();
        assert_ne!(
            grammar(ToolFormat::Hermes, true),
            grammar(ToolFormat::Hermes, false)
        );
        for f in [ToolFormat::Json, ToolFormat::Llama3, ToolFormat::Mistral] {
            assert_eq!(grammar(f, true), grammar(f, false), "{f:?}");
        }
    }

    #[test]
    fn families_come_from_templates() {
        assert_eq!(
            ToolFormat::of_template("{{ '<tool_call>' }}"),
            ToolFormat::Hermes
        );
        assert_eq!(ToolFormat::of_template("[TOOL_CALLS]"), ToolFormat::Mistral);
        assert_eq!(
            ToolFormat::of_template("<|python_tag|>"),
            ToolFormat::Llama3
        );
        assert_eq!(ToolFormat::of_template("{{ messages }}"), ToolFormat::Json);
    }
}

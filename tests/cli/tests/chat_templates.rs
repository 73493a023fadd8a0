//! kvplug renders each real model's chat template exactly as Hugging Face transformers'
//! `apply_chat_template` does (tests/cli/tests/hf_template.py: Jinja2 with transformers' settings,
//! through scripts/openai-client.sh's venv): plain turns, and on Qwen2.5-Coder the tools block,
//! an assistant's tool calls and the tool results — the text the model was trained on.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use kvplug::formats::gguf::resolve_model;
use kvplug::{Message, Text};
use serde_json::{json, Value};

/// What transformers renders for `messages` and `tools` with the template and special tokens
/// of `config` (a `tokenizer_config.json`).
fn transformers(config: &Value, messages: &[Message], tools: &[Value], open_turn: bool) -> String {
    let token = |k: &str| match &config[k] {
        Value::String(s) => s.clone(),
        v => v["content"].as_str().unwrap_or_default().to_string(),
    };
    let job = json!({"template": config["chat_template"], "messages": messages,
        "tools": (!tools.is_empty()).then_some(tools), "add_generation_prompt": open_turn,
        "bos_token": token("bos_token"), "eos_token": token("eos_token")});
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/openai-client.sh");
    let mut child = Command::new(script)
        .arg("hf_template.py")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(job.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "hf_template.py failed");
    String::from_utf8(out.stdout).unwrap()
}

/// The `tokenizer_config.json` of the model file `file` in models/, and its text.
fn model(file: &str) -> (Value, Text) {
    let gguf = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(file);
    assert!(
        gguf.exists(),
        "run scripts/fetch-models.sh (make test does)"
    );
    let dir = resolve_model(&gguf).unwrap();
    let config = std::fs::read(dir.join("tokenizer_config.json")).unwrap();
    (
        serde_json::from_slice(&config).unwrap(),
        Text::load(&dir).unwrap(),
    )
}

fn msg(role: &str, content: &str) -> Message {
    Message::new(role, content)
}

fn same(file: &str, messages: &[Message], tools: &[Value]) {
    let (config, text) = model(file);
    for open_turn in [true, false] {
        let ours = text.render_tools(messages, tools, open_turn).unwrap();
        let theirs = transformers(&config, messages, tools, open_turn);
        assert_eq!(ours, theirs, "{file}, add_generation_prompt={open_turn}");
    }
}

fn conversation() -> Vec<Message> {
    vec![
        msg("system", "You are terse.\n  Indented line & <tag>."),
        msg("user", "Hi — é?"),
        msg("assistant", "Hello."),
        msg("user", "Bye."),
    ]
}

#[test]
fn plain_conversations_render_as_transformers_renders_them() {
    for file in [
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gemma-3-270m-q4_k_m.gguf",
    ] {
        same(file, &conversation(), &[]);
    }
}

/// A last assistant message is continued (Anthropic's prefill, transformers'
/// `continue_final_message`): the prompt is the one that opens a fresh assistant turn after the
/// messages before it, then that message's text, verbatim, the turn left open.
#[test]
fn a_last_assistant_message_is_continued_where_a_fresh_turn_would_start() {
    for file in [
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gemma-3-270m-q4_k_m.gguf",
    ] {
        let (config, text) = model(file);
        let before = conversation();
        let fresh = transformers(&config, &before, &[], true);
        // Prefills the templates' own markup also holds (`<|im_end|>`, `<end_of_turn>`).
        for prefill in ["{\"name\": \"Al", ">", "<", "end", "turn", "|"] {
            let mut messages = before.clone();
            messages.push(msg("assistant", prefill));
            let ours = text.render_continuing(&messages, &[]).unwrap();
            assert_eq!(ours, format!("{fresh}{prefill}"), "{file}");
        }
        // Only an assistant's text can be continued.
        let e = text
            .render_continuing(&before, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("only an assistant's text"), "{file}: {e}");
    }
    // A template that rewrites an assistant's text, or writes it twice, cannot continue it.
    let qwen = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let tokenizer = resolve_model(&qwen).unwrap().join("tokenizer.json");
    for template in [
        "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}{% endfor %}",
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}|{{ m.content }}{% endfor %}",
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            json!({"chat_template": template}).to_string(),
        )
        .unwrap();
        std::fs::copy(&tokenizer, dir.path().join("tokenizer.json")).unwrap();
        let text = Text::load(dir.path()).unwrap();
        let e = text
            .render_continuing(&[msg("user", "hi"), msg("assistant", "Hello")], &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("does not show the last assistant message"),
            "{template}: {e}"
        );
    }
}

/// Block tags on lines of their own leave no blank lines or indentation behind
/// (transformers' `trim_blocks` and `lstrip_blocks`), in a template written without `-`.
#[test]
fn block_tags_are_trimmed_as_transformers_trims_them() {
    let template = "{% for m in messages %}\n  {% if m.role == 'user' %}\n    <{{ m.role }}>{{ m.content }}\n  {% else %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\n  <assistant>\n{% endif %}";
    let dir = tempfile::tempdir().unwrap();
    let config = json!({"chat_template": template});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let qwen = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let tokenizer = resolve_model(&qwen).unwrap().join("tokenizer.json");
    std::fs::copy(tokenizer, dir.path().join("tokenizer.json")).unwrap();
    let text = Text::load(dir.path()).unwrap();
    let ours = text.render(&conversation()).unwrap();
    assert_eq!(ours, transformers(&config, &conversation(), &[], true));
}

#[test]
fn tools_calls_and_results_render_as_transformers_renders_them() {
    let tools = [
        json!({"type": "function", "function": {"name": "get_weather",
        "description": "Weather of a city <b>now</b> & later, in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "é"},
            "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}}}),
    ];
    let mut call = msg("assistant", "");
    call.tool_calls = vec![
        json!({"id": "c1", "type": "function", "function": {"name": "get_weather",
        "arguments": {"city": "Zürich", "days": 2}}}),
    ];
    let mut result = msg("tool", "{\"sky\": \"clear\", \"t\": 21.5}");
    result.tool_call_id = Some("c1".into());
    let mut messages = conversation();
    messages.extend([call, result]);
    same("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", &messages, &tools);
    // The server hands its templates each tool as the SDK's `Tool` writes it: that same
    // object, keys in the same order.
    let f = &tools[0]["function"];
    let tool = kvplug::tools::Tool {
        name: f["name"].as_str().unwrap().into(),
        description: f["description"].as_str().map(String::from),
        parameters: f["parameters"].clone(),
    };
    assert_eq!(tool.to_value().to_string(), tools[0].to_string());
    // Without a system message, the template writes its own.
    same(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        &messages[1..],
        &tools,
    );
}

//! Constrained decoding on the real model (Qwen2.5-Coder-0.5B Q4_K_M, cpu): answers under
//! a JSON schema parse and validate whatever the sampler draws, a GBNF grammar's answer is
//! one of its strings, and a schema llguidance cannot compile is refused by name.

use std::sync::Arc;

use kvplug::{generate, CacheKind, GenOptions, GrammarSpec, Grammars, KvDtype, Message, Sampler};
use kvplug::{Model, Text};
use serde_json::{json, Value};

use crate::common;

fn qwen(rt: &kvplug::Runtime) -> Model {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        path.exists(),
        "run scripts/fetch-models.sh (make test does)"
    );
    kvplug::formats::open_model(rt, "cpu", &path).unwrap()
}

/// The model's grammars, ending at its end-of-turn tokens.
fn grammars(model: &Model) -> Grammars {
    let text = Text::load(model.dir()).unwrap();
    let eos: Vec<i32> = text.stop_tokens().iter().copied().collect();
    Grammars::new(model.dir(), model.vocab(), &eos).unwrap()
}

/// The answer to `question` under `spec`, sampled with `seed` at temperature 0.7.
fn ask(
    model: &Model,
    text: &Arc<Text>,
    grammars: &Grammars,
    question: &str,
    spec: &GrammarSpec,
    seed: u64,
) -> String {
    let mut ctx = model
        .context(CacheKind::Contiguous, 1024, KvDtype::F16)
        .unwrap();
    let prompt = text
        .encode(&text.render(&[Message::new("user", question)]).unwrap())
        .unwrap();
    let opts = GenOptions {
        max_tokens: 96,
        sampler: Sampler::new(0.7, 1.0, seed),
        stop_tokens: text.stop_tokens().clone(),
        constraint: Some(grammars.constraint(spec).unwrap()),
        ..GenOptions::default()
    };
    let g = generate(
        &mut ctx,
        Some(text.clone()),
        0,
        &prompt,
        0,
        opts,
        &mut |_| Ok(()),
    )
    .unwrap();
    text.detokenize(&g.ids).unwrap()
}

#[test]
fn constrained_answers_follow_their_schema_and_grammar() {
    let rt = common::runtime();
    let model = qwen(&rt);
    let text = Arc::new(Text::load(model.dir()).unwrap());
    let grammars = grammars(&model);
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "languages": {"type": "array", "items": {"enum": ["python", "rust", "c"]}, "maxItems": 3}
        },
        "required": ["name", "age", "languages"],
        "additionalProperties": false
    });
    for seed in 0..3 {
        let answer = ask(
            &model,
            &text,
            &grammars,
            "Describe a programmer as JSON.",
            &GrammarSpec::JsonSchema(schema.clone()),
            seed,
        );
        let v: Value = serde_json::from_str(&answer)
            .unwrap_or_else(|e| panic!("seed {seed}: {answer:?} does not parse: {e}"));
        assert!(
            v["name"].as_str().is_some_and(|n| n.chars().count() <= 20),
            "{v}"
        );
        assert!(v["age"].as_u64().is_some_and(|a| a <= 150), "{v}");
        let langs = v["languages"].as_array().unwrap();
        assert!(langs.len() <= 3, "{v}");
        assert!(
            langs
                .iter()
                .all(|l| ["python", "rust", "c"].contains(&l.as_str().unwrap())),
            "{v}"
        );
        assert_eq!(v.as_object().unwrap().len(), 3, "{v}");
    }
    let gbnf = GrammarSpec::Gbnf("root ::= answer\nanswer ::= \"yes\" | \"no\"\n".into());
    let answer = ask(
        &model,
        &text,
        &grammars,
        "Is Rust a programming language?",
        &gbnf,
        1,
    );
    assert!(answer == "yes" || answer == "no", "{answer:?}");
    let e = grammars
        .constraint(&GrammarSpec::JsonSchema(
            json!({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
        ))
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not compile"), "{e}");
}

/// A call in the doubled braces a template's instructions may show (`{{"name": …}}`, a Jinja
/// escaping mistake small models copy) follows the call grammar that allows them, its
/// arguments still under the tool's schema, and parses back as the call; the plain grammar
/// refuses it.
#[test]
fn tool_calls_in_a_templates_doubled_braces_follow_their_grammar() {
    use kvplug::tools::{call_grammar, parse, teaches_doubled_braces, Tool, ToolFormat};

    let rt = common::runtime();
    let model = qwen(&rt);
    let text = Text::load(model.dir()).unwrap();
    let grammars = grammars(&model);
    let tools = [Tool {
        name: "add".into(),
        description: None,
        parameters: json!({"type": "object", "properties": {"a": {"type": "integer"}},
            "required": ["a"], "additionalProperties": false}),
    }];
    let accepts = |doubled: bool, answer: &str| {
        let lark = call_grammar(&tools, ToolFormat::Hermes, false, doubled).unwrap();
        let mut c = grammars.constraint(&GrammarSpec::Lark(lark)).unwrap();
        c.catch_up(&text.encode_raw(answer).unwrap())
    };
    let call = |args: &str, open: &str, close: &str| {
        format!("<tool_call>\n{open}\"name\": \"add\", \"arguments\": {args}{close}\n</tool_call>")
    };
    let doubled = call("{\"a\": 1}", "{{", "}}");
    assert!(accepts(true, &doubled));
    assert!(accepts(true, &call("{\"a\": 1}", "{", "}")));
    assert!(
        !accepts(false, &doubled),
        "the plain grammar refuses doubled braces"
    );
    assert!(
        !accepts(true, &call("{\"a\": \"one\"}", "{{", "}}")),
        "the arguments stay under the schema"
    );
    let parsed = parse(&doubled, ToolFormat::Hermes, &tools);
    assert_eq!(
        (
            parsed.calls[0].name.as_str(),
            parsed.calls[0].arguments.as_str()
        ),
        ("add", "{\"a\":1}")
    );
    assert!(teaches_doubled_braces(
        "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
    ));
    assert!(!teaches_doubled_braces(
        "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    ));
}

/// Grammars whose compile recurses deeper than a thread's usual 2 MiB of stack (a chain of
/// rules, of terminals, of schema references, each link nested) compile on the grammar
/// thread's own stack; past its bound they are refused before compiling, and a grammar that
/// allows no answer is refused when it is built, not at its first token. The test's own
/// thread has 2 MiB: an overflow would abort it.
#[test]
fn deep_grammars_compile_or_are_refused_and_never_overflow_the_stack() {
    let rt = common::runtime();
    let model = qwen(&rt);
    let grammars = grammars(&model);
    let chain = |n: usize, nested: usize, name: &dyn Fn(usize) -> String| {
        let (open, close) = ("(".repeat(nested), ")".repeat(nested));
        let mut g = format!("start: {}\n", name(0));
        for i in 0..n {
            g += &format!("{}: {open}{} | \"x\"{close}\n", name(i), name(i + 1));
        }
        g + &format!("{}: \"y\"\n", name(n))
    };
    let refs = |n: usize| {
        let defs: serde_json::Map<String, Value> = (0..n)
            .map(|i| {
                let next = json!({"anyOf": [{"$ref": format!("#/$defs/d{}", i + 1)}, {"type": "integer"}]});
                (format!("d{i}"), json!({"type": "array", "items": next}))
            })
            .chain([(format!("d{n}"), json!({"type": "integer"}))])
            .collect();
        GrammarSpec::JsonSchema(json!({"$defs": defs, "$ref": "#/$defs/d0"}))
    };
    // Each past what 2 MiB held (measured: 600 rules, 655 terminals, 33 rules nested 28
    // deep, 265 references).
    let rule = |i: usize| format!("a{i}");
    let terminal = |i: usize| format!("T{i}");
    for spec in [
        GrammarSpec::Lark(chain(1_000, 0, &rule)),
        GrammarSpec::Lark(chain(1_000, 0, &terminal)),
        GrammarSpec::Lark(chain(100, 28, &rule)),
        refs(600),
    ] {
        // Built, then tokens committed and the next masks computed on this thread.
        let mut c = grammars.constraint(&spec).unwrap();
        for _ in 0..4 {
            let mut logits = vec![0.0; model.vocab()];
            c.apply(&mut logits).unwrap();
            let allowed = logits.iter().position(|l| l.is_finite()).unwrap();
            c.commit(allowed as i32).unwrap();
            if c.is_finished() {
                break;
            }
        }
    }
    for (spec, says) in [
        (
            GrammarSpec::Lark(chain(20_000, 0, &rule)),
            "nests too deeply",
        ),
        (refs(5_000), "nests too deeply"),
        (
            GrammarSpec::JsonSchema(json!({"$ref": "#"})),
            "allows no answer",
        ),
        (
            GrammarSpec::Lark("start: s\ns: s\n".into()),
            "allows no answer",
        ),
    ] {
        let e = grammars.constraint(&spec).unwrap_err().to_string();
        assert!(e.contains(says) && !e.contains("<state>"), "{e}");
    }
}

//! Chat templates rendered the way Hugging Face's `apply_chat_template` renders them: Jinja
//! with `trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`, Python's string methods, and `tojson` as Python's
//! `json.dumps` writes JSON (the tools block and tool-call arguments a model was trained on).
//! A template comes from a file, so its rendering is bounded (minijinja's fuel).

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;
use serde_json::ser::{Formatter, PrettyFormatter};

/// The most template instructions one rendering may run: far above what a long agent history
/// through a tool-calling template needs (tens of thousands), low enough that a hostile
/// template stops within seconds.
const FUEL: u64 = 50_000_000;

/// Renders template `src` with `ctx`; a template that does not parse, fails or runs out of
/// fuel is an error, never a hang.
pub fn render(src: &str, ctx: Value) -> Result<String, String> {
    let mut env = Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_fuel(Some(FUEL));
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_filter("tojson", tojson);
    env.add_template("chat", src)
        .map_err(|e| format!("the chat template does not parse: {e}"))?;
    env.get_template("chat")
        .and_then(|t| t.render(ctx))
        .map_err(|e| format!("rendering the chat template: {e}"))
}

/// Hugging Face's `tojson(x, ensure_ascii=False, indent=None, sort_keys=False)`, which is
/// `json.dumps`: `", "` and `": "` between items, or `","`, newlines and `indent` spaces;
/// keys in their given order unless sorted; non-ASCII written as is unless escaped. (minijinja's
/// own filter writes compact JSON and escapes `<`, `>`, `&` and `'` for HTML.)
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    if sort_keys == Some(true) {
        sort(&mut json);
    }
    let spaces = " ".repeat(indent.unwrap_or(0));
    let mut out = Vec::new();
    let written = match indent {
        Some(_) => json.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PrettyFormatter::with_indent(spaces.as_bytes()),
        )),
        None => json.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonFormatter,
        )),
    };
    written.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let text = String::from_utf8(out).expect("serde_json writes UTF-8");
    let text = if ensure_ascii == Some(true) {
        ascii_escaped(&text)
    } else {
        text
    };
    // Already JSON: the template must not escape it again.
    Ok(Value::from_safe_string(text))
}

/// Object keys sorted, at every depth.
fn sort(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(o) => {
            o.sort_keys();
            o.values_mut().for_each(sort);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(sort),
        _ => {}
    }
}

/// JSON text with its non-ASCII characters as `\uXXXX` escapes (UTF-16, as Python writes
/// them): still the same JSON (they can only stand inside strings), now pure ASCII.
pub fn ascii_escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            for unit in c.encode_utf16(&mut [0; 2]) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

/// `json.dumps`'s default layout: compact (the trait's defaults), with a space after `,` and `:`.
struct PythonFormatter;

impl Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::context;

    fn r(src: &str, x: serde_json::Value) -> String {
        render(src, context! { x => x }).unwrap()
    }

    /// Expected strings are what CPython 3.11's `json.dumps` writes for the same calls.
    #[test]
    fn tojson_writes_what_python_writes() {
        let x = serde_json::json!({"type": "function", "b": [1, 2.5, null, true],
                                   "s": "<a & 'b'> é \n \u{1F600}"});
        assert_eq!(
            r("{{ x | tojson }}", x.clone()),
            r#"{"type": "function", "b": [1, 2.5, null, true], "s": "<a & 'b'> é \n 😀"}"#
        );
        assert_eq!(
            r(
                "{{ x | tojson(indent=2) }}",
                serde_json::json!({"a": [1, {}], "c": []})
            ),
            "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"c\": []\n}"
        );
        assert_eq!(
            r("{{ x | tojson(ensure_ascii=True, sort_keys=True) }}", x),
            r#"{"b": [1, 2.5, null, true], "s": "<a & 'b'> \u00e9 \n \ud83d\ude00", "type": "function"}"#
        );
        assert!(render("{{ x | tojson(colour=1) }}", context! { x => 1 }).is_err());
    }

    #[test]
    fn a_runaway_template_stops() {
        let src =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let e = render(src, context! {}).unwrap_err();
        assert!(e.contains("fuel"), "{e}");
    }

    #[test]
    fn loop_controls_and_raise_exception() {
        let src =
            "{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}";
        assert_eq!(render(src, context! {}).unwrap(), "1");
        let e = render("{{ raise_exception('no tools here') }}", context! {}).unwrap_err();
        assert!(e.contains("no tools here"), "{e}");
    }
}

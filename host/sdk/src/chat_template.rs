//! Chat templates rendered the way Hugging Face's `apply_chat_template` renders them: Jinja
//! with `trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`, Python's string methods, and `tojson` as Python's
//! `json.dumps` writes JSON (the tools block and tool-call arguments a model was trained on).
//!
//! A template comes from a downloaded file, so rendering is bounded: in instructions
//! (minijinja's fuel) and in output ([`MAX_RENDERED`]) wherever it runs, and — once a
//! [`Sandbox`] is installed, as the `kvplug` binary does — in memory and time too, by running
//! in a child process under resource limits. (Within one process nothing can bound the memory
//! a template's values take: doubling a string 64 times in a loop costs a few instructions,
//! and a failed allocation aborts the process.)

use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;
use serde_json::ser::{Formatter, PrettyFormatter};

/// The most template instructions one rendering may run: far above what a long agent history
/// through a tool-calling template needs (tens of thousands), low enough that a hostile
/// template stops within seconds.
const FUEL: u64 = 50_000_000;

/// The longest text a rendering may produce: millions of tokens, far past any context window.
pub const MAX_RENDERED: usize = 16 << 20;

/// Renders template `src` with `ctx` (`messages`, `tools`, `add_generation_prompt`, …): in
/// the installed [`Sandbox`] if there is one, else in this process ([`render_here`]). A
/// template that does not parse, fails or passes a limit is an error, never a hang or a crash.
pub fn render(src: &str, ctx: &serde_json::Value) -> Result<String, String> {
    match SANDBOX.get() {
        Some(sandbox) => sandbox.render(src, ctx),
        None => render_here(src, ctx),
    }
}

/// Renders in this process, bounded by fuel and [`MAX_RENDERED`] but not in the memory its
/// values take: for templates one trusts.
pub fn render_here(src: &str, ctx: &serde_json::Value) -> Result<String, String> {
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
    env.add_function("strftime_now", strftime_now);
    env.add_template("chat", src)
        .map_err(|e| format!("the chat template does not parse: {e}"))?;
    let mut out = Capped(Vec::new());
    let rendered = env
        .get_template("chat")
        .and_then(|t| t.render_captured_to(ctx, &mut out).map(drop));
    match rendered {
        Ok(_) => {
            String::from_utf8(out.0).map_err(|_| "the chat template wrote invalid UTF-8".into())
        }
        Err(_) if out.0.len() > MAX_RENDERED => Err(format!(
            "the chat template's output passed {} MiB",
            MAX_RENDERED >> 20
        )),
        Err(e) => Err(format!("rendering the chat template: {e}")),
    }
}

/// `strftime_now(format)`: the local time now in a C `strftime` format, as Hugging Face's
/// and llama.cpp's template environments provide it (Llama 3.x and GPT-OSS print the
/// date); a format chrono cannot read is a template error.
fn strftime_now(format: String) -> Result<String, Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item<'_>> = StrftimeItems::new(&format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: '{format}' is not a strftime format"),
        ));
    }
    Ok(chrono::Local::now()
        .format_with_items(items.into_iter())
        .to_string())
}

/// Rendered text that refuses to grow past [`MAX_RENDERED`] (its length then says why).
struct Capped(Vec<u8>);

impl Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_RENDERED {
            self.0.resize(MAX_RENDERED + 1, 0);
            return Err(std::io::Error::other("output limit"));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

static SANDBOX: OnceLock<Sandbox> = OnceLock::new();

/// Renders each template in a child process — a program that answers through
/// [`serve_sandboxed`] — under an address-space and a CPU-time limit, and gives up on it
/// after a wall-clock limit: a template that exhausts either ends in an error naming the
/// limit, and the caller's process is untouched. One child per rendering (a few
/// milliseconds; a prompt costs far more).
#[derive(Clone, Debug)]
pub struct Sandbox {
    program: PathBuf,
    args: Vec<OsString>,
    /// The child's address space, in bytes.
    pub memory: u64,
    /// The child's CPU time; the wall-clock limit is twice this.
    pub seconds: u64,
}

impl Sandbox {
    /// Runs `program args…` per rendering with the default limits (512 MiB, 10 s).
    pub fn new(
        program: impl Into<PathBuf>,
        args: impl IntoIterator<Item = impl Into<OsString>>,
    ) -> Self {
        Sandbox {
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            memory: 512 << 20,
            seconds: 10,
        }
    }

    /// Makes this the process's sandbox for `render`; fails (returning it) when one is
    /// installed already.
    pub fn install(self) -> Result<(), Sandbox> {
        SANDBOX.set(self)
    }

    /// Renders `src` with `ctx` in a child process.
    pub fn render(&self, src: &str, ctx: &serde_json::Value) -> Result<String, String> {
        let job = serde_json::to_vec(&serde_json::json!({"template": src, "context": ctx}))
            .map_err(|e| format!("the chat template's context: {e}"))?;
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            let (memory, seconds) = (self.memory, self.seconds);
            // SAFETY: only setrlimit, which is async-signal-safe, runs between fork and exec.
            unsafe {
                cmd.pre_exec(move || limit(memory, seconds));
            }
        }
        let mut child = cmd.spawn().map_err(|e| {
            format!(
                "starting the template sandbox {}: {e}",
                self.program.display()
            )
        })?;
        let mut stdin = child.stdin.take().expect("piped");
        let (mut stdout, mut stderr) = (
            child.stdout.take().expect("piped"),
            child.stderr.take().expect("piped"),
        );
        // The child reads its whole job before writing, and may die early: a failed write
        // shows in its exit status.
        std::thread::spawn(move || stdin.write_all(&job));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let read = (&mut stdout)
                .take(8 * MAX_RENDERED as u64)
                .read_to_end(&mut out);
            let _ = (&mut stderr).take(1 << 16).read_to_end(&mut err);
            let _ = tx.send((read.map(|_| out), err));
        });
        let Ok((out, err)) = rx.recv_timeout(Duration::from_secs(2 * self.seconds)) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(self.too_long());
        };
        let status = child
            .wait()
            .map_err(|e| format!("the template sandbox: {e}"))?;
        if let Ok(reply) = out
            .map_err(|_| ())
            .and_then(|o| serde_json::from_slice::<Reply>(&o).map_err(|_| ()))
        {
            return match reply {
                Reply { text: Some(t), .. } => Ok(t),
                Reply { error, .. } => Err(error.unwrap_or_default()),
            };
        }
        let err = String::from_utf8_lossy(&err);
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            if status.signal() == Some(libc::SIGXCPU) || status.signal() == Some(libc::SIGKILL) {
                return Err(self.too_long());
            }
        }
        if err.contains("memory allocation")
            || err.contains("out of memory")
            || err.contains("overflow")
        {
            return Err(format!(
                "rendering the chat template needed more than {} MiB: refused",
                self.memory >> 20
            ));
        }
        Err(format!(
            "the template sandbox ended without an answer ({status}): {}",
            err.lines().next().unwrap_or_default()
        ))
    }

    fn too_long(&self) -> String {
        format!(
            "rendering the chat template ran past its {} s limit: refused",
            self.seconds
        )
    }
}

/// Caps the calling process's address space at `memory` bytes and its CPU time at `seconds`.
/// The resource constants keep each libc's own type (glibc's `__rlimit_resource_t`, a
/// `c_int` on macOS), so no platform's type is named here.
#[cfg(unix)]
fn limit(memory: u64, seconds: u64) -> std::io::Result<()> {
    for (resource, value) in [(libc::RLIMIT_AS, memory), (libc::RLIMIT_CPU, seconds)] {
        let l = libc::rlimit {
            rlim_cur: value as libc::rlim_t,
            rlim_max: value as libc::rlim_t,
        };
        // SAFETY: setrlimit reads the struct it is given.
        if unsafe { libc::setrlimit(resource, &l) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A sandboxed rendering's outcome, as the child writes it.
#[derive(Serialize, serde::Deserialize)]
struct Reply {
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// The child's side of a [`Sandbox`]: reads one job (`{"template", "context"}`) from stdin,
/// renders it here and writes the outcome to stdout. A program calls it first thing when it
/// is started as its own sandbox (the `kvplug` binary: `kvplug __render-template`).
pub fn serve_sandboxed() -> ExitCode {
    let mut job = Vec::new();
    if std::io::stdin().read_to_end(&mut job).is_err() {
        return ExitCode::FAILURE;
    }
    let reply = match serde_json::from_slice::<serde_json::Value>(&job) {
        Ok(job) => match render_here(
            job["template"].as_str().unwrap_or_default(),
            &job["context"],
        ) {
            Ok(text) => Reply {
                text: Some(text),
                error: None,
            },
            Err(e) => Reply {
                text: None,
                error: Some(e),
            },
        },
        Err(e) => Reply {
            text: None,
            error: Some(format!("the template sandbox's job: {e}")),
        },
    };
    let mut out = std::io::stdout().lock();
    match serde_json::to_writer(&mut out, &reply).map(|()| out.flush()) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
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

/// `", "` before every item but the first (of an array or an object).
fn separator<W: ?Sized + std::io::Write>(w: &mut W, first: bool) -> std::io::Result<()> {
    match first {
        true => Ok(()),
        false => w.write_all(b", "),
    }
}

/// `json.dumps`'s default layout: compact (the trait's defaults), with a space after `,` and `:`.
struct PythonFormatter;

impl Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        separator(w, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        separator(w, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn r(src: &str, x: serde_json::Value) -> String {
        render_here(src, &json!({ "x": x })).unwrap()
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
        assert!(render_here("{{ x | tojson(colour=1) }}", &json!({"x": 1})).is_err());
    }

    #[test]
    fn a_runaway_template_stops() {
        let src =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let e = render_here(src, &json!({})).unwrap_err();
        assert!(e.contains("fuel"), "{e}");
    }

    #[test]
    fn strftime_now_prints_the_date_and_refuses_bad_formats() {
        let today = chrono::Local::now().format("%Y-%m-%d").to_string();
        let got = r("{{ strftime_now('%Y-%m-%d') }}", serde_json::json!({}));
        // Around midnight the day may turn between the two readings.
        let after = chrono::Local::now().format("%Y-%m-%d").to_string();
        assert!(got == today || got == after, "{got}");
        let e = render_here("{{ strftime_now('%Q') }}", &serde_json::json!({})).unwrap_err();
        assert!(e.contains("not a strftime format"), "{e}");
    }

    #[test]
    fn loop_controls_and_raise_exception() {
        let src =
            "{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}";
        assert_eq!(render_here(src, &json!({})).unwrap(), "1");
        let e = render_here("{{ raise_exception('no tools here') }}", &json!({})).unwrap_err();
        assert!(e.contains("no tools here"), "{e}");
    }
}

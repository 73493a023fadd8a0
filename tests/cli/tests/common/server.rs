//! A server for the tests that talk HTTP to it (ureq): a `kvplug serve` process, or a
//! [`kvplug_server::Server`] in this process.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::Duration;

use kvplug_server::{ServerConfig, ServerError, Stopper};
use serde_json::Value;

/// Where a server runs.
enum Running {
    Process(Child),
    /// Served on its own thread until stopped.
    InProcess {
        stop: Stopper,
        serving: Option<JoinHandle<Result<(), ServerError>>>,
    },
}

/// A server, stopped on drop (a process by SIGTERM, one in this process by its stopper).
pub struct Server {
    running: Running,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    http: ureq::Agent,
    /// The `--api-key` it was started with, sent with every request.
    key: Option<String>,
    /// The `--session-dir`.
    pub sessions: tempfile::TempDir,
    _plugins: tempfile::TempDir,
}

impl Server {
    /// Starts `kvplug serve` on `model` with `args` (any port), the cpu plugin alone.
    pub fn start(model: &Path, args: &[&str]) -> Server {
        Server::start_in(model, args, tempfile::tempdir().unwrap())
    }

    /// [`Server::start`] with `sessions` as its session directory.
    pub fn start_in(model: &Path, args: &[&str], sessions: tempfile::TempDir) -> Server {
        let plugins = super::cpu_plugins();
        let mut child = Command::new(super::kvplug_bin())
            .arg("--plugins")
            .arg(plugins.path())
            .arg("--session-dir")
            .arg(sessions.path())
            .args(["serve", "--port", "0", "--model"])
            .arg(model)
            .args(args)
            .env_remove("KVPLUG_API_KEY")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("the server did not start: {line:?}"))
            .to_string();
        let key = args
            .iter()
            .position(|&a| a == "--api-key")
            .map(|i| args[i + 1].to_string());
        Server {
            running: Running::Process(child),
            url,
            http: http(),
            key,
            sessions,
            _plugins: plugins,
        }
    }

    /// A [`kvplug_server::Server`] in this process on `config` (its address and session
    /// directory set here: port 0, a fresh directory), the cpu plugin alone.
    pub fn in_process(mut config: ServerConfig) -> Server {
        let plugins = super::cpu_plugins();
        let sessions = tempfile::tempdir().unwrap();
        config.addr = "127.0.0.1:0".parse().unwrap();
        config.session_dir = sessions.path().to_path_buf();
        let key = config.api_key.clone();
        let runtime = kvplug::Runtime::load(&kvplug::PluginSearch::only(
            &[plugins.path().to_path_buf()],
            false,
        ));
        let server = kvplug_server::Server::bind(&runtime, config).unwrap();
        let (url, stop) = (format!("http://{}", server.local_addr()), server.stopper());
        let serving = std::thread::spawn(move || server.run(|| {}));
        Server {
            running: Running::InProcess {
                stop,
                serving: Some(serving),
            },
            url,
            http: http(),
            key,
            sessions,
            _plugins: plugins,
        }
    }

    /// GETs `path` with `key` as the bearer key.
    pub fn get_as(&self, path: &str, key: Option<&str>) -> (u16, Value) {
        self.get_authorized(path, key.map(|k| format!("Bearer {k}")).as_deref())
    }

    /// GETs `path` with `authorization` as its `Authorization` header, if given.
    pub fn get_authorized(&self, path: &str, authorization: Option<&str>) -> (u16, Value) {
        let mut req = self.http.get(format!("{}{path}", self.url));
        if let Some(a) = authorization {
            req = req.header("Authorization", a);
        }
        let mut r = req.call().unwrap();
        (r.status().as_u16(), r.body_mut().read_json().unwrap())
    }

    pub fn get(&self, path: &str) -> (u16, Value) {
        self.get_as(path, self.key.as_deref())
    }

    /// GETs `path` (with the key) and returns its body as text; asserts a 200.
    pub fn text(&self, path: &str) -> String {
        let mut req = self.http.get(format!("{}{path}", self.url));
        if let Some(k) = &self.key {
            req = req.header("Authorization", format!("Bearer {k}"));
        }
        let mut r = req.call().unwrap();
        assert_eq!(r.status().as_u16(), 200, "{path}");
        r.body_mut().read_to_string().unwrap()
    }

    pub fn post_request(&self, path: &str) -> ureq::RequestBuilder<ureq::typestate::WithBody> {
        let req = self.http.post(format!("{}{path}", self.url));
        match &self.key {
            Some(k) => req.header("Authorization", format!("Bearer {k}")),
            None => req,
        }
    }

    /// POSTs raw bytes with `headers`.
    pub fn send(
        &self,
        path: &str,
        body: &[u8],
        headers: &[(&str, &str)],
    ) -> ureq::http::Response<ureq::Body> {
        let mut req = self.post_request(path);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send(body).unwrap()
    }

    /// POSTs raw bytes with `headers`; returns the status and the JSON body.
    pub fn post_raw(&self, path: &str, body: &[u8], headers: &[(&str, &str)]) -> (u16, Value) {
        let mut r = self.send(path, body, headers);
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().unwrap();
        let v = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text:?}"));
        (status, v)
    }

    /// POSTs `body`; returns the status, the response headers (names lower-case) and the
    /// JSON body.
    pub fn post_with_headers(
        &self,
        path: &str,
        body: &Value,
    ) -> (u16, std::collections::HashMap<String, String>, Value) {
        let mut r = self.send(path, body.to_string().as_bytes(), &[]);
        let headers = r
            .headers()
            .iter()
            .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or("").to_string()))
            .collect();
        let status = r.status().as_u16();
        (status, headers, r.body_mut().read_json().unwrap())
    }

    pub fn post(&self, path: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
        self.post_raw(path, body.to_string().as_bytes(), headers)
    }

    /// A 200 answer to `body`.
    pub fn ok(&self, path: &str, body: &Value, headers: &[(&str, &str)]) -> Value {
        let (status, v) = self.post(path, body, headers);
        assert_eq!(status, 200, "{body}: {v}");
        v
    }

    /// Opens a streamed answer; returns its lines as they come.
    pub fn stream(&self, path: &str, body: &Value) -> impl Iterator<Item = String> {
        let r = self
            .post_request(path)
            .send(body.to_string().as_bytes())
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "{body}");
        let ct = r.headers()["content-type"].to_str().unwrap().to_string();
        assert!(ct.starts_with("text/event-stream"), "{ct}");
        BufReader::new(r.into_body().into_reader())
            .lines()
            .map(Result::unwrap)
            .filter(|l| !l.is_empty() && !l.starts_with(':'))
    }

    /// The `data:` payloads of a whole streamed answer, checking it ends with `[DONE]`.
    pub fn chunks(&self, path: &str, body: &Value) -> Vec<Value> {
        let lines: Vec<String> = self.stream(path, body).collect();
        assert_eq!(
            lines.last().map(String::as_str),
            Some("data: [DONE]"),
            "{lines:?}"
        );
        lines[..lines.len() - 1]
            .iter()
            .map(|l| serde_json::from_str(l.strip_prefix("data: ").unwrap()).unwrap())
            .collect()
    }

    pub fn engine(&self) -> Value {
        let (status, v) = self.get_as("/health", None);
        assert_eq!(status, 200);
        v["engine"].clone()
    }

    /// Stops it as SIGTERM does and waits for a clean end; returns the session directory.
    pub fn stop(mut self) -> tempfile::TempDir {
        match &mut self.running {
            Running::Process(child) => {
                // SAFETY: kill(2) on our own child's pid.
                unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
                let status = child.wait().unwrap();
                assert!(status.success(), "the server exited with {status}");
            }
            Running::InProcess { stop, serving } => {
                stop.stop();
                let served = serving.take().unwrap().join().expect("the server thread");
                served.expect("the server ended cleanly");
            }
        }
        std::mem::replace(&mut self.sessions, tempfile::tempdir().unwrap())
    }
}

/// The tests' HTTP client. The one limit on a request is a hang guard (half an hour), never
/// a speed bound: the heaviest request, a ~1,400-token agent turn, takes seconds in CI.
fn http() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(1800)))
        .build()
        .into()
}

/// The settings `kvplug serve` starts with by default, on `model`.
pub fn config(model: &Path) -> ServerConfig {
    ServerConfig {
        model: model.to_path_buf(),
        model_id: "test".into(),
        backend: "cpu".into(),
        addr: "127.0.0.1:0".parse().unwrap(),
        api_key: None,
        capacity: 8192,
        kv_dtype: kvplug::KvDtype::F16,
        key_rotation: true,
        mmap: true,
        attention: None,
        parallel: 16,
        max_queue: 64,
        max_tokens: 1024,
        max_body: 1 << 20,
        session_dir: PathBuf::new(),
        parked: kvplug::WarmLimits::default(),
        header_timeout: Duration::from_secs(30),
        body_timeout: Duration::from_secs(30),
        max_connections: 512,
        prefix_header: true,
        speculative: Some(kvplug::DraftKind::Ngram),
    }
}

/// The directory [`smollm2_f16`] imports into, and so the model id a server of it answers as.
pub const SMOLLM2_F16_ID: &str = "SmolLM2-135M-Instruct.f16";

/// SmolLM2-135M-Instruct's GGUF (fetched by scripts/fetch-models.sh, which `make test`
/// runs) imported to f16 once per test process: the server tests are about the server,
/// and its Q4_1 weights computed in place (int8 activations on the cpu) leave the first
/// answer token a near tie ("The" against "L'", 0.08 apart in the f64 reference).
pub fn smollm2_f16() -> PathBuf {
    static IMPORTED: std::sync::OnceLock<(tempfile::TempDir, PathBuf)> = std::sync::OnceLock::new();
    IMPORTED
        .get_or_init(|| {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
            assert!(
                path.exists(),
                "{} is missing: run scripts/fetch-models.sh (make test does)",
                path.display()
            );
            let dir = tempfile::tempdir().unwrap();
            // A dotted directory name, as downloaded model directories have: the served id.
            let out = dir.path().join(SMOLLM2_F16_ID);
            kvplug::formats::gguf::import(&path, &out, &mut |_, _, _| {}).unwrap();
            (dir, out)
        })
        .1
        .clone()
}

impl Drop for Server {
    fn drop(&mut self) {
        match &mut self.running {
            Running::Process(child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
            Running::InProcess { stop, serving } => {
                stop.stop();
                if let Some(s) = serving.take() {
                    let _ = s.join();
                }
            }
        }
    }
}

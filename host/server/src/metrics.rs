//! `/metrics` in Prometheus' text format: requests by status, prompt, generated and cached
//! tokens, time to first token and per-token latency histograms, queue depth, KV cells used
//! and evictable, agents hot and parked, constraint masks, draft tokens verified and
//! accepted.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use kvplug::CacheReport;

/// A histogram with fixed upper bounds (seconds).
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    count: u64,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            count: 0,
            sum: 0.0,
        }
    }

    /// `times` observations of `x`.
    fn observe(&mut self, x: f64, times: u64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if x <= *b {
                *c += times;
            }
        }
        self.count += times;
        self.sum += x * times as f64;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

/// The engine's gauges, as of its last report.
#[derive(Default)]
struct Gauges {
    queued: usize,
    active: usize,
    cells_used: u64,
    cells_evictable: u64,
    agents_hot: usize,
    agents_parked: usize,
    parked: kvplug::WarmUsage,
    masks: u64,
    mask_seconds: f64,
}

/// The server's figures.
pub struct Metrics {
    requests: Mutex<BTreeMap<u16, u64>>,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    draft_tokens: AtomicU64,
    accepted_tokens: AtomicU64,
    ttft: Mutex<Histogram>,
    per_token: Mutex<Histogram>,
    gauges: Mutex<Gauges>,
}

const TTFT: &[f64] = &[0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
const PER_TOKEN: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            prompt_tokens: AtomicU64::default(),
            cached_tokens: AtomicU64::default(),
            generated_tokens: AtomicU64::default(),
            draft_tokens: AtomicU64::default(),
            accepted_tokens: AtomicU64::default(),
            ttft: Mutex::new(Histogram::new(TTFT)),
            per_token: Mutex::new(Histogram::new(PER_TOKEN)),
            gauges: Mutex::default(),
        }
    }
}

impl Metrics {
    /// An answer left with HTTP status `status`.
    pub fn response(&self, status: u16) {
        *self
            .requests
            .lock()
            .expect("metrics lock")
            .entry(status)
            .or_default() += 1;
    }

    /// A request was admitted with a prompt of `prompt` tokens, `cached` of them reused.
    pub fn admitted(&self, prompt: usize, cached: usize) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
    }

    /// A request's first token came `after` its arrival.
    pub fn first_token(&self, after: Duration) {
        self.ttft
            .lock()
            .expect("metrics lock")
            .observe(after.as_secs_f64(), 1);
    }

    /// A step of `took` sampled `tokens` tokens (each waited the whole step).
    pub fn step(&self, took: Duration, tokens: usize) {
        if tokens > 0 {
            self.per_token
                .lock()
                .expect("metrics lock")
                .observe(took.as_secs_f64(), tokens as u64);
        }
    }

    /// A completion of `n` tokens ended, with what its speculation did.
    pub fn generated(&self, n: usize, speculation: Option<kvplug::SpecStats>) {
        self.generated_tokens.fetch_add(n as u64, Ordering::Relaxed);
        if let Some(s) = speculation {
            self.draft_tokens
                .fetch_add(s.drafted as u64, Ordering::Relaxed);
            self.accepted_tokens
                .fetch_add(s.accepted as u64, Ordering::Relaxed);
        }
    }

    /// The engine's state: queue, requests in flight, the cache, agents (hot, parked) and
    /// constraint masks (count, time).
    pub fn engine(
        &self,
        queued: usize,
        active: usize,
        cache: Option<&CacheReport>,
        (agents_hot, agents_parked): (usize, usize),
        parked: kvplug::WarmUsage,
        (masks, mask_time): (u64, Duration),
    ) {
        let mut g = self.gauges.lock().expect("metrics lock");
        *g = Gauges {
            queued,
            active,
            cells_used: cache.map_or(0, |c| c.live_cells),
            cells_evictable: cache.map_or(0, |c| c.prefix_evictable),
            agents_hot,
            agents_parked,
            parked,
            masks,
            mask_seconds: mask_time.as_secs_f64(),
        };
    }

    /// Everything, in Prometheus' text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let _ = writeln!(
            out,
            "# HELP kvplug_requests_total HTTP answers by status.\n# TYPE kvplug_requests_total counter"
        );
        for (status, n) in self.requests.lock().expect("metrics lock").iter() {
            let _ = writeln!(out, "kvplug_requests_total{{status=\"{status}\"}} {n}");
        }
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut out,
            "kvplug_prompt_tokens_total",
            "Prompt tokens of admitted requests.",
            load(&self.prompt_tokens),
        );
        counter(
            &mut out,
            "kvplug_cached_tokens_total",
            "Prompt tokens reused instead of prefilled.",
            load(&self.cached_tokens),
        );
        counter(
            &mut out,
            "kvplug_generated_tokens_total",
            "Tokens generated.",
            load(&self.generated_tokens),
        );
        counter(
            &mut out,
            "kvplug_draft_tokens_total",
            "Draft tokens verified by speculating requests.",
            load(&self.draft_tokens),
        );
        counter(
            &mut out,
            "kvplug_draft_accepted_tokens_total",
            "Of those, tokens accepted (each saved a forward).",
            load(&self.accepted_tokens),
        );
        self.ttft.lock().expect("metrics lock").render(
            &mut out,
            "kvplug_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
        );
        self.per_token.lock().expect("metrics lock").render(
            &mut out,
            "kvplug_time_per_output_token_seconds",
            "The step that produced each token.",
        );
        let g = self.gauges.lock().expect("metrics lock");
        gauge(
            &mut out,
            "kvplug_queue_depth",
            "Requests waiting.",
            g.queued as f64,
        );
        gauge(
            &mut out,
            "kvplug_requests_in_flight",
            "Requests holding sequences.",
            g.active as f64,
        );
        gauge(
            &mut out,
            "kvplug_kv_cells_used",
            "Cells of the cache holding data.",
            g.cells_used as f64,
        );
        gauge(
            &mut out,
            "kvplug_kv_cells_evictable",
            "Cached prefix cells no sequence holds.",
            g.cells_evictable as f64,
        );
        gauge(
            &mut out,
            "kvplug_agents_hot",
            "Agents whose history is in the cache.",
            g.agents_hot as f64,
        );
        gauge(
            &mut out,
            "kvplug_agents_parked",
            "Agents whose history is in their session file.",
            g.agents_parked as f64,
        );
        gauge(
            &mut out,
            "kvplug_agents_parked_bytes",
            "Bytes of parked agents' session files (every model's).",
            g.parked.bytes as f64,
        );
        counter(
            &mut out,
            "kvplug_agents_parked_removed_total",
            "Parked agents' files removed past the disk budget or the idle limit.",
            g.parked.removed,
        );
        counter(
            &mut out,
            "kvplug_constraint_masks_total",
            "Token masks computed for constrained requests.",
            g.masks,
        );
        gauge(
            &mut out,
            "kvplug_constraint_mask_seconds_total",
            "Time computing those masks (beside the forward pass).",
            g.mask_seconds,
        );
        out
    }
}

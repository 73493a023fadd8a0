//! Regenerates `backends/cpu/BENCH.md` from the criterion results of
//! `cargo bench -p kvplug-cpu` (target/criterion/*/new/estimates.json) plus exact memory
//! figures measured here. Run by `make bench`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvplug_backend_kit::KitCache;
use kvplug_core::{make_config, CacheKind, KvDtype, ModelCacheParams};
use kvplug_cpu::tensor::CpuTensor;
use kvplug_cpu::CpuDevice;

#[allow(dead_code)] // only the steps' shape is read here
#[path = "../benches/shared/mod.rs"]
mod shared;

use shared::steps::{D, HKV, HQ, STEP_CONTEXT};

/// One ISA level's results: `target/criterion` (the CPU's own level), or
/// `target/criterion-avx2`, where `make bench` runs the kernels again under
/// `KVPLUG_CPU_ISA=avx2` on an AVX-512 CPU (`CRITERION_HOME`).
struct Level {
    dir: PathBuf,
}

impl Level {
    fn new(name: &str) -> Self {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"));
        Level {
            dir: target.join(name),
        }
    }

    /// Mean time in seconds of benchmark `id` (e.g. `decode/f16/512`).
    fn mean(&self, id: &str) -> Option<f64> {
        let text = std::fs::read_to_string(self.dir.join(id).join("new/estimates.json")).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        Some(v["mean"]["point_estimate"].as_f64()? * 1e-9)
    }

    /// The throughput criterion recorded for benchmark `id` (bytes or elements per
    /// iteration).
    fn throughput(&self, id: &str) -> Option<f64> {
        let text = std::fs::read_to_string(self.dir.join(id).join("new/benchmark.json")).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        let t = v["throughput"].as_object()?;
        t.values().next()?.as_f64()
    }

    /// Time in seconds of the fastest sample of benchmark `id` (each sample is the mean of
    /// many iterations): the figure least disturbed by other tenants of a shared machine.
    fn fastest(&self, id: &str) -> f64 {
        let read = || -> Option<f64> {
            let text = std::fs::read_to_string(self.dir.join(id).join("new/sample.json")).ok()?;
            let v: serde_json::Value = serde_json::from_str(&text).ok()?;
            let (iters, times) = (v["iters"].as_array()?, v["times"].as_array()?);
            iters
                .iter()
                .zip(times)
                .map(|(i, t)| Some(t.as_f64()? / i.as_f64()? * 1e-9))
                .try_fold(f64::INFINITY, |m, x| Some(m.min(x?)))
        };
        read().unwrap_or_else(|| {
            panic!(
                "no criterion samples for {id} in {}: run `make bench` first",
                self.dir.display()
            )
        })
    }

    fn need(&self, id: &str) -> f64 {
        self.mean(id).unwrap_or_else(|| {
            panic!(
                "no criterion result for {id} in {}: run `make bench` first",
                self.dir.display()
            )
        })
    }

    /// Appends the output `make bench` wrote to `file` in this level's directory between
    /// `before` and `after`, or says it was not measured.
    fn measured_section(&self, md: &mut String, file: &str, before: &str, after: &str) {
        let path = self.dir.join(file);
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                md.push_str(before);
                md.push_str(&text);
                md.push_str(after);
            }
            Err(_) => {
                writeln!(md, "Not measured: `make bench` writes {}.", path.display()).unwrap()
            }
        }
    }

    /// Measured read bandwidth in bytes per second: the mean, and the fastest sample.
    fn bandwidth(&self) -> (f64, f64) {
        let bytes = (256u64 << 20) as f64;
        let id = "read_bandwidth/sum_256MiB";
        (bytes / self.need(id), bytes / self.fastest(id))
    }
}

/// Multiply-adds per second of the attention kernels' instructions on every thread
/// (criterion's `compute_peak`, its fastest sample), at the level's width: f32 `vfmadd`,
/// and the int8 dot (`vpdpbusd` where the CPU has VNNI; at 256 bits `vpmaddubsw` and
/// `vpmaddwd`).
struct Peaks {
    /// 512 or 256.
    bits: u32,
    f32: f64,
    int8: Option<f64>,
}

impl Peaks {
    fn measured(lv: &Level) -> Option<Self> {
        let rate = |id: &str| Some(lv.throughput(id)? / lv.fastest(id));
        if let Some(f32) = rate("compute_peak/f32_fma") {
            return Some(Peaks {
                bits: 512,
                f32,
                int8: rate("compute_peak/int8_dot"),
            });
        }
        Some(Peaks {
            bits: 256,
            f32: rate("compute_peak/f32_fma_256")?,
            int8: rate("compute_peak/int8_dot_256"),
        })
    }

    /// The sentence BENCH.md states them in.
    fn describe(&self) -> String {
        let int8 = match (self.int8, self.bits) {
            (Some(r), 512) => format!("int8 dot (`vpdpbusd`) **{:.0} GMAC/s**", r / 1e9),
            (Some(r), _) => format!(
                "int8 dot (`vpmaddubsw` + `vpmaddwd` + `vpaddd`) **{:.0} GMAC/s**",
                r / 1e9
            ),
            (None, _) => "int8 dot not measured (no AVX-512 VNNI)".into(),
        };
        format!(
            "Measured arithmetic peak ({}-bit instructions in independent chains on every thread): f32 multiply-add (`vfmadd`) **{:.0} GMAC/s**; {int8}. A step's *compute floor* is its multiply-adds at these rates (scores in its arithmetic, values in f32, their times added where both are f32 and the longer taken where the scores are int8; softmax and memory left out): no kernel on these instructions beats it.",
            self.bits,
            self.f32 / 1e9
        )
    }

    /// The least time `pairs` (query row, key row) pairs take at these peaks: `D`
    /// multiply-adds each for the score (int8 where `int8`) and as many for the values
    /// (f32 in every arithmetic). Scores and values in f32 share one instruction, so their
    /// times add; int8 scores may run beside the f32 values on other ports, so only the
    /// longer of the two counts. Softmax, staging and memory traffic are left out: no kernel
    /// on these instructions can be faster.
    fn floor(&self, pairs: usize, int8: bool) -> f64 {
        let f32_time = (pairs * D) as f64 / self.f32;
        match self.int8 {
            Some(rate) if int8 => f32_time.max((pairs * D) as f64 / rate),
            _ => 2.0 * f32_time,
        }
    }
}

/// [`Peaks::floor`] in µs for the table, "–" where the peaks were not measured.
fn floor_us(peaks: &Option<Peaks>, pairs: usize, int8: bool) -> String {
    peaks.as_ref().map_or("–".into(), |p| {
        format!("{:.1}", p.floor(pairs, int8) * 1e6)
    })
}

/// The floor of `pairs` in µs and its ratio to `base` (seconds), two table cells.
fn floor_and_ratio(peaks: &Option<Peaks>, pairs: usize, int8: bool, base: f64) -> String {
    peaks.as_ref().map_or("– | –".into(), |p| {
        let f = p.floor(pairs, int8);
        format!("{:.1} | {:.2}×", f * 1e6, f / base)
    })
}

/// The CPU's name with its family and model numbers (a VM may name only the vendor's line:
/// "AMD EPYC" covers Zen 4 and Zen 5, whose 512-bit arithmetic differs twofold).
fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split(':').nth(1))
            .map(|v| v.trim().to_string())
    };
    match (field("model name"), field("cpu family"), field("model")) {
        (Some(name), Some(family), Some(model)) => format!("{name}, family {family} model {model}"),
        (Some(name), ..) => name,
        _ => "unknown CPU".into(),
    }
}

/// The tables of the kernels whose speed depends on the ISA level, from `lv`'s results:
/// decode (one layer, then streamed), fork, tree, prefill and weights; `h` opens their
/// headings, `peaks` gives the compute floors (`None`: not measured at this level).
fn kernel_tables(md: &mut String, lv: &Level, peaks: &Option<Peaks>, h: &str) {
    let (bw, bw_best) = lv.bandwidth();
    writeln!(md, "{h} Decode step (T = 1)\n").unwrap();
    writeln!(md, "Scores in f32; `int8-query` rows (where the CPU has AVX2: `maddubs`, or `vpdpbusd` with AVX-512 VNNI) compute them from the query quantized to int8 (docs/conformance.md, declared arithmetics).\n").unwrap();
    writeln!(md, "| KV dtype | L | time (µs) | K+V bytes read | effective GB/s | bandwidth bound (µs) | time / bound | time vs f16 | fastest sample / its bound | compute floor (µs) |").unwrap();
    writeln!(md, "|---|---|---|---|---|---|---|---|---|---|").unwrap();
    let int8 = |dtype: KvDtype, l: usize| format!("decode/{dtype}+int8-query/{l}");
    let rows = [KvDtype::F16, KvDtype::Q8_DEFAULT, KvDtype::Q4_DEFAULT]
        .into_iter()
        .flat_map(|dtype| {
            [512usize, 4096, 16384].into_iter().flat_map(move |l| {
                let plain = (dtype.to_string(), format!("decode/{dtype}/{l}"), dtype, l);
                let reduced = (format!("{dtype} int8-query"), int8(dtype, l), dtype, l);
                std::iter::once(plain).chain(lv.mean(&reduced.1).map(|_| reduced))
            })
        });
    for (label, id, dtype, l) in rows {
        let t = lv.need(&id);
        let floor = floor_us(peaks, HQ * l, label.ends_with("int8-query"));
        let f16 = lv.need(&format!("decode/f16/{l}"));
        let bytes = 2 * HKV * l * dtype.row_bytes(D);
        let bound = bytes as f64 / bw;
        let best = lv.fastest(&id) / (bytes as f64 / bw_best);
        writeln!(
            md,
            "| {label} | {l} | {:.1} | {:.2} MB | {:.1} | {:.1} | {:.2}× | {:.2}× | {best:.2}× | {floor} |",
            t * 1e6,
            bytes as f64 / 1e6,
            bytes as f64 / t / 1e9,
            bound * 1e6,
            t / bound,
            t / f16
        )
        .unwrap();
    }

    writeln!(
        md,
        "\n{h} Decode step streamed from memory, Qwen2.5-0.5B's attention shape\n"
    )
    .unwrap();
    lv.measured_section(
        md,
        "decode_stream.txt",
        "`cargo run --release -p kvplug-cpu --example decode_attention -- 4096 f16,q8,q8+int8-query,q4,q4+int8-query 20`: 24 layers, Hq 14, Hkv 2, D 64, one cache per layer holding 4,096 tokens, one decode step through every layer (each layer's K/V come from memory, as in `kvplug bench -d 4096`; the one-layer table above mostly fits in the last-level cache). Fastest of 20 steps:\n\n```text\n",
        "```\n",
    );

    writeln!(
        md,
        "\n{h} Agent fork (seq cache, {STEP_CONTEXT}-token shared trunk)\n\nOne decode step for all branches; q8 in its default arithmetic (int8-query where the CPU has AVX2), and in int8-query-i16-values (the values summed against i16 weight codes, `vpdpwssd` or `vpmaddwd`; its floor is not measured). \"floor / 1 branch\" is the least 4 / 1 this machine's arithmetic allows against the 1-branch time as measured: the 4 branches' multiply-adds (trunk rows only) at the measured peak.\n"
    )
    .unwrap();
    writeln!(
        md,
        "| KV dtype | 1 branch (µs) | 4 branches (µs) | 4 / 1 | 4 branches' compute floor (µs) | floor / 1 branch |\n|---|---|---|---|---|---|"
    )
    .unwrap();
    // q8 runs in its default arithmetic: int8-query where the decode bench found it.
    let q8_int8 = lv.mean(&int8(KvDtype::Q8_DEFAULT, 512)).is_some();
    // (row, bench name, the floor's score arithmetic: None where no floor is measured).
    let mut steps = vec![("f16", "f16", Some(false)), ("q8", "q8", Some(q8_int8))];
    let i16 = "q8+int8-query-i16-values";
    if lv.mean(&format!("fork_step/{i16}_branches/1")).is_some() {
        steps.push(("q8 int8-query-i16-values", i16, None));
    }
    for &(row, dtype, int8) in &steps {
        let one = lv.need(&format!("fork_step/{dtype}_branches/1"));
        let four = lv.need(&format!("fork_step/{dtype}_branches/4"));
        // The trunk's rows only: a floor still.
        let floor = int8.map_or("– | –".into(), |int8| {
            floor_and_ratio(peaks, 4 * HQ * STEP_CONTEXT, int8, one)
        });
        writeln!(
            md,
            "| {row} | {:.1} | {:.1} | **{:.2}×** | {floor} |",
            one * 1e6,
            four * 1e6,
            four / one,
        )
        .unwrap();
    }

    writeln!(md, "\n{h} Tree verify (L = {STEP_CONTEXT})\n\n\"floor / decode\" is the least tree / decode this machine's arithmetic allows against the decode time as measured: the 16 nodes' multiply-adds (committed rows only) at the measured peak.\n").unwrap();
    writeln!(md, "| KV dtype | 16-node tree, one step (µs) | 1-token decode (µs) | tree / decode | tree's compute floor (µs) | floor / decode |\n|---|---|---|---|---|---|").unwrap();
    for &(row, dtype, int8) in &steps {
        let tree = lv.need(&format!("tree_verify/{dtype}_nodes_16"));
        let dec = lv.need(&format!("tree_verify/{dtype}_decode_1"));
        let floor = int8.map_or("– | –".into(), |int8| {
            floor_and_ratio(peaks, 16 * HQ * STEP_CONTEXT, int8, dec)
        });
        writeln!(
            md,
            "| {row} | {:.1} | {:.1} | **{:.2}×** | {floor} |",
            tree * 1e6,
            dec * 1e6,
            tree / dec,
        )
        .unwrap();
    }

    writeln!(
        md,
        "\n{h} Fork and tree steps on one thread, in its CPU time (L = {STEP_CONTEXT}, q8)\n"
    )
    .unwrap();
    lv.measured_section(
        md,
        "step_ratios.md",
        "`cargo run --release -p kvplug-cpu --example step_ratios`: the same steps as the two tables above, on one thread, each ratio's two steps alternating and each keeping its fastest run in the thread's CPU time, which the host's other tenants disturb less than the wall clock of steps timed a minute apart (issue 64's goals: 4 / 1 ≤ 2.0×, tree / decode ≤ 6×).\n\n",
        "",
    );

    writeln!(md, "\n{h} Prefill, T = 512 (f16, one layer)\n").unwrap();
    let tiled = lv.need("prefill_512/tiled");
    writeln!(
        md,
        "| attention kernel | time (ms) | vs tiled at 256 bits |\n|---|---|---|"
    )
    .unwrap();
    for (name, id) in [
        ("tiled, 512-bit (AVX-512F)", "prefill_512/tiledavx512"),
        ("tiled, 256-bit (AVX2/FMA/F16C)", "prefill_512/tiled"),
        ("XNNPACK GEMMs", "prefill_512/xnnpack"),
        ("row kernel", "prefill_512/rows"),
    ] {
        match lv.mean(id) {
            Some(t) => writeln!(md, "| {name} | {:.2} | {:.2}× |", t * 1e3, t / tiled).unwrap(),
            None => writeln!(md, "| {name} | not built in or not this CPU's | |").unwrap(),
        }
    }

    writeln!(
        md,
        "\n{h} Weights, one decode token (150 matrices of 1536 × 576, out of cache)\n"
    )
    .unwrap();
    writeln!(
        md,
        "| stored dtype | time (ms) | GB/s | vs read bandwidth | fastest sample vs fastest bandwidth sample |\n|---|---|---|---|---|"
    )
    .unwrap();
    for dtype in ["f16", "bf16"] {
        let t = lv.need(&format!("weights_decode/{dtype}"));
        let bytes = (150 * 1536 * 576 * 2) as f64;
        let best = lv.fastest(&format!("weights_decode/{dtype}"));
        writeln!(
            md,
            "| {dtype} | {:.2} | {:.1} | {:.2}× | {:.2}× |",
            t * 1e3,
            bytes / t / 1e9,
            bytes / t / bw,
            bytes / best / bw_best
        )
        .unwrap();
    }

    writeln!(
        md,
        "\n{h} Block-format weights, one decode token (256 MB weight sets, out of cache)\n"
    )
    .unwrap();
    lv.measured_section(
        md,
        "weights_bandwidth.md",
        "`qlinear::linear_blocks` on the blocks in place (activations quantized to 8 bits per 32 values), against f16 weights of the same shapes; Qwen2.5-0.5B's MLP shapes, `[rows, cols]` (the K formats need 256-value rows: down projection only). Each weight pass is paired with a read-bandwidth pass just before it, round-robin over every set (`cargo run --release -p kvplug-cpu --example weights_bandwidth`, whose doc comment says why): the ratios do not depend on which of this VM's two bandwidth speeds a separate benchmark caught. \"Fast pairs\" are those taken at the higher speed, where the kernels' arithmetic shows most. Criterion's `weights_decode_blocks` times the same passes alone.\n\n",
        "",
    );
    writeln!(
        md,
        "\n{h} Block-format weights, prefill (512 tokens through one 896 × 4864 weight)\n"
    )
    .unwrap();
    writeln!(md, "| format | time (ms) | GFLOP/s |\n|---|---|---|").unwrap();
    for fmt in ["q4_K", "q6_K", "q8_0", "q4_0", "f16"] {
        let id = format!("weights_prefill_blocks/{fmt}");
        let (Some(t), Some(flops)) = (lv.mean(&id), lv.throughput(&id)) else {
            continue;
        };
        writeln!(md, "| {fmt} | {:.2} | {:.1} |", t * 1e3, flops / t / 1e9).unwrap();
    }
}

fn main() {
    let mut md = String::new();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let native = Level::new("criterion");
    let (bw, bw_best) = native.bandwidth();
    writeln!(md, "# cpu backend benchmarks\n").unwrap();
    writeln!(md, "Generated by `make bench` (`cargo bench -p kvplug-cpu` then `cargo run --release -p kvplug-cpu --example bench_report`); do not edit by hand.\n").unwrap();
    writeln!(md, "Machine: {} ({cores} threads). Measured read bandwidth (sum over 256 MiB on every thread): **{:.1} GB/s** (mean), {:.1} GB/s (fastest sample).", cpu_model(), bw / 1e9, bw_best / 1e9).unwrap();
    let peaks = Peaks::measured(&native);
    if let Some(p) = &peaks {
        writeln!(md, "{}", p.describe()).unwrap();
    }
    writeln!(
        md,
        "Shapes: one layer, Hq 32, Hkv 8, D 128; times are criterion means. On a shared VM the \
         memory bandwidth left to us swings from run to run (and within one: samples cluster \
         near two speeds), so the decode and stored-dtype weights tables also put the \
         fastest sample against the fastest bandwidth sample; the block-format weights \
         table pairs each pass with a bandwidth pass instead.\n"
    )
    .unwrap();

    kernel_tables(&mut md, &native, &peaks, "##");
    let avx2 = Level::new("criterion-avx2");
    if avx2.dir.exists() {
        let (bw, _) = avx2.bandwidth();
        let peaks = Peaks::measured(&avx2);
        writeln!(md, "\n## At the AVX2 level\n").unwrap();
        writeln!(md, "The same kernels capped at AVX2 (`KVPLUG_CPU_ISA=avx2`, the paths of Zen 2/3 and Intel client cores), run by `make bench` on this CPU after the tables above; read bandwidth in that run: {:.1} GB/s.", bw / 1e9).unwrap();
        if let Some(p) = &peaks {
            writeln!(md, "{}", p.describe()).unwrap();
        }
        writeln!(md).unwrap();
        kernel_tables(&mut md, &avx2, &peaks, "###");
    }

    writeln!(
        md,
        "\n## Memory: 100-token session at capacity 32768 (2 layers)\n"
    )
    .unwrap();
    writeln!(md, "| KV dtype | pool cells | live tokens | allocated bytes | bytes vs f16 |\n|---|---|---|---|---|").unwrap();
    let mut f16_bytes = 0.0;
    for dtype in [KvDtype::F16, KvDtype::Q8_DEFAULT, KvDtype::Q4_DEFAULT] {
        let cfg = make_config(
            &ModelCacheParams {
                n_layers: 2,
                n_kv_heads: HKV,
                head_dim: D,
            },
            32768,
            dtype,
        );
        let mut c = KitCache::new(Arc::new(CpuDevice::new()), CacheKind::Seq, cfg).unwrap();
        let t = |h| CpuTensor::zeros(&[h, 100, D]);
        let mut out = t(32);
        let pos: Vec<i32> = (0..100).collect();
        for layer in 0..2 {
            c.update_and_attend(layer, &t(32), &t(HKV), &t(HKV), &pos, 1.0, &mut out)
                .unwrap();
        }
        let s = c.stats();
        if dtype == KvDtype::F16 {
            f16_bytes = s.allocated_bytes as f64;
        }
        writeln!(
            md,
            "| {dtype} | {} | {} | {} | {:.4}× |",
            s.pool_cells,
            s.live_cells,
            s.allocated_bytes,
            s.allocated_bytes as f64 / f16_bytes
        )
        .unwrap();
    }
    let growth = native.dir.join("kv_growth.md");
    let growth = std::fs::read_to_string(&growth).unwrap_or_else(|_| {
        panic!(
            "no {}: run `cargo run --release -p kvplug-cpu --example kv_growth > {0}` first",
            growth.display()
        )
    });
    writeln!(
        md,
        "\n## KV growth, one layer fed token by token (seed 004's caches)\n"
    )
    .unwrap();
    writeln!(md, "Hkv 8, head_dim 128, f16, 4,096 tokens; each cache returns the whole history after every append (`examples/kv_growth.rs` says how each is modelled).\n").unwrap();
    md.push_str(&growth);
    writeln!(
        md,
        "\n## Sessions: save and restore, SmolLM2-135M, 2,048 tokens\n"
    )
    .unwrap();
    native.measured_section(
        &mut md,
        "sessions.txt",
        "`cargo run --release -p kvplug --example prefix_reuse -- models/SmolLM2-135M-Instruct.Q4_1.gguf cpu 2048` (save: export, file written and fsynced; restore: file read and checked, rows imported):\n\n```text\n",
        "```\n",
    );
    writeln!(
        md,
        "\n## KV dtype quality: next-token choices against f16 K/V, Qwen2.5-Coder-0.5B\n"
    )
    .unwrap();
    native.measured_section(
        &mut md,
        "kv_quality.md",
        "`cargo run --release -p kvplug --example kv_quality -- models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf cpu 64` (its doc comment defines the three measures).\n\n",
        "",
    );
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = manifest.join("BENCH.md");
    let previous = Previous::read(&out);
    let peers = manifest.join("../../.peers");
    const PEERS: &str = "## Against llama.cpp (`make bench-peers`)";
    const PEERS_AVX2: &str = "### At the AVX2 level";
    const PEERS_AVX2VNNI: &str = "### At the 256-bit VNNI level";
    writeln!(md, "\n{PEERS}\n").unwrap();
    let old = section(&previous.text, PEERS, true);
    match previous.table(
        &peers.join("peers.md"),
        section(&previous.text, PEERS, false),
    ) {
        Some(table) => md.push_str(&table),
        None => writeln!(
            md,
            "Not measured on this machine yet: run `make bench-peers`, then `make bench`."
        )
        .unwrap(),
    }
    // The lower levels' runs, where the CPU has more (`ISA=avx2`, `ISA=avx2vnni`).
    for (title, file) in [
        (PEERS_AVX2, "peers-avx2.md"),
        (PEERS_AVX2VNNI, "peers-avx2vnni.md"),
    ] {
        let old_level = old.and_then(|o| section(o, title, true));
        if let Some(table) = previous.table(&peers.join(file), old_level) {
            write!(md, "\n{title}\n\n{table}").unwrap();
        }
    }
    hybrid_tables(&mut md, &peers, &previous);
    std::fs::write(&out, &md).unwrap();
    print!("{md}");
    eprintln!("wrote {}", out.display());
}

/// The BENCH.md a run replaces, for the tables of the peer benchmarks (`make bench-peers`,
/// `make bench-hybrid`) that `.peers/` no longer holds (a fresh machine, or one where only
/// some ran): those are carried over, marked with where they came from, rather than dropped.
struct Previous {
    text: String,
    /// Its machine line, less `Machine: `.
    machine: String,
}

impl Previous {
    fn read(path: &Path) -> Self {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let machine = text
            .lines()
            .find_map(|l| l.strip_prefix("Machine: "))
            .and_then(|l| l.split(". ").next())
            .unwrap_or("unknown")
            .to_string();
        Previous { text, machine }
    }

    /// The table a peer benchmark left in `fresh`, else `old` (its section in this BENCH.md)
    /// marked as carried over (once: a table carried before keeps its first mark).
    fn table(&self, fresh: &Path, old: Option<&str>) -> Option<String> {
        if let Ok(table) = std::fs::read_to_string(fresh) {
            return Some(table);
        }
        let old = old.filter(|o| !o.is_empty())?;
        Some(match old.starts_with(CARRIED) {
            true => format!("{old}\n"),
            false => format!(
                "{CARRIED} unchanged from the BENCH.md this run replaced (its machine: {}), as \
                 `.peers/` holds no {} here.*\n\n{old}\n",
                self.machine,
                fresh.file_name().unwrap_or_default().to_string_lossy()
            ),
        })
    }
}

/// How a carried-over table begins.
const CARRIED: &str = "*Carried over";

/// The body of the section of `text` headed by the line `heading`, up to the next heading of
/// its level or above (`nested`) or of any level (not `nested`: the text before its first
/// subsection); lines in fenced code blocks are never headings.
fn section<'a>(text: &'a str, heading: &str, nested: bool) -> Option<&'a str> {
    let level = |line: &str| {
        let hashes = line.len() - line.trim_start_matches('#').len();
        (hashes > 0 && line[hashes..].starts_with(' ')).then_some(hashes)
    };
    let own = level(heading)?;
    let (mut fenced, mut start) = (false, None);
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        let bare = line.trim_end_matches('\n');
        if bare.starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            match (start, level(bare)) {
                (None, _) if bare == heading => start = Some(at + line.len()),
                (Some(s), Some(l)) if !nested || l <= own => {
                    return Some(text[s..at].trim_matches('\n'));
                }
                _ => {}
            }
        }
        at += line.len();
    }
    start.map(|s| text[s..].trim_matches('\n'))
}

/// The `### ` headings of `text` outside fenced code blocks, less their hashes.
fn subsections(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|l| {
            fenced ^= l.starts_with("```");
            !fenced && !l.starts_with("```")
        })
        .filter_map(|l| l.strip_prefix("### "))
        .collect()
}

/// `make bench-hybrid`'s tables (`peers-hybrid-NAME[-avx2].md` in `peers`), a section per
/// file; the previous BENCH.md's sections for files `peers` lacks are carried over.
fn hybrid_tables(md: &mut String, peers: &Path, previous: &Previous) {
    const HYBRID: &str =
        "## Hybrid and mixture-of-experts models against llama.cpp (`make bench-hybrid`)";
    writeln!(md, "\n{HYBRID}\n").unwrap();
    md.push_str(
        "Random-weight files of the LFM2-350M and Qwen3.5-0.8B shapes, two Qwen3-MoE shapes \
         (the same active size, 32 or 64 experts) and a GPT-OSS shape \
         (`scripts/crosscheck/synth_gguf.py`), quantized by llama.cpp's `llama-quantize`; \
         `scripts/bench-hybrid.sh` says what it runs.\n",
    );
    let title = |file: &str| match file.strip_suffix("-avx2") {
        Some(f) => format!("{f}, at the AVX2 level"),
        None => file.to_string(),
    };
    let file = |title: &str| match title.strip_suffix(", at the AVX2 level") {
        Some(t) => format!("peers-hybrid-{t}-avx2.md"),
        None => format!("peers-hybrid-{title}.md"),
    };
    let mut tables: Vec<(String, String)> = std::fs::read_dir(peers)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| {
            let file = n.strip_prefix("peers-hybrid-")?.strip_suffix(".md")?;
            Some((title(file), std::fs::read_to_string(peers.join(&n)).ok()?))
        })
        .collect();
    let old = section(&previous.text, HYBRID, true).unwrap_or_default();
    for t in subsections(old) {
        if !tables.iter().any(|(have, _)| have == t) {
            let body = section(old, &format!("### {t}"), true);
            if let Some(body) = previous.table(&peers.join(file(t)), body) {
                tables.push((t.to_string(), body));
            }
        }
    }
    // Each file's native table, then its AVX2 one.
    tables.sort_by(|a, b| a.0.cmp(&b.0));
    if tables.is_empty() {
        writeln!(
            md,
            "\nNot measured on this machine yet: run `make bench-hybrid`, then `make bench`."
        )
        .unwrap();
    }
    for (title, body) in tables {
        writeln!(md, "\n### {title}\n").unwrap();
        md.push_str(&body);
    }
}

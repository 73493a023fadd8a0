//! Mutation fuzzing of the parsers users feed files to: scenario files, model packages
//! (config.json + safetensors + shard index, through to loading the weights on the cpu
//! device), GGUF import and session files (through to importing the rows into a cpu seq
//! cache). From valid seeds, deterministic byte-level and JSON-aware
//! mutations (bit flips, truncations, inserted bytes, extreme integers at random offsets;
//! numbers replaced by 0, -1, 2^32+2, u64::MAX, 1e308, strings by paths out of the
//! directory, keys removed). Every input must give a typed error or a valid result: no
//! panic (caught and reported with the input), no crash, and no allocation beyond a bound
//! (this binary's allocator refuses it, so an unbounded `Vec::with_capacity` aborts the run
//! with the input's number while `try_reserve` gets a clean error).
//!
//! Inputs are numbered from 0 (scenarios), 100,000 (packages), 200,000 (GGUF files) and
//! 300,000 (session files). `KVPLUG_FUZZ_INPUTS` scales the run (default 10,200 inputs:
//! 4,000 scenarios, 3,200 packages, 3,000 GGUF files; plus 10,000 session files, scaled
//! alike). `make fuzz-long` runs a hundred times as many.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::quantized::gguf_file::Value as GValue;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvplug::formats::synth::{synth, PRESETS};
use kvplug::session_file::{self, Session};
use kvplug_backend_kit::model::{DecoderModel, ModelPackage};
use kvplug_backend_kit::KitCache;
use kvplug_core::{CacheConfig, CacheKind, KeyBasis, KvDtype};
use kvplug_cpu::CpuDevice;
use kvplug_plugin_api::HostTensor;
use serde_json::{json, Value};

mod common;
use common::{gguf_name, hf_tensor_shapes, llama_gguf_meta, write_gguf};

/// The largest single allocation any parser may make.
const MAX_ALLOCATION: usize = 256 << 20;
/// The most bytes live at once.
const MAX_LIVE: usize = 1 << 30;

static LIVE: AtomicUsize = AtomicUsize::new(0);
/// The input being parsed (for the report when the allocator refuses).
static INPUT: AtomicU64 = AtomicU64::new(0);

/// The system allocator with a bound; a refused request names the input on stderr.
struct Bounded;

fn refuse(size: usize) {
    // No allocation here: digits into a stack buffer.
    let mut buf = *b"fuzz: input ##########, allocation of ##################### bytes refused\n";
    let mut put = |at: usize, width: usize, mut v: u64| {
        for i in (at..at + width).rev() {
            buf[i] = b'0' + (v % 10) as u8;
            v /= 10;
        }
    };
    put(12, 10, INPUT.load(Ordering::Relaxed));
    put(38, 21, size as u64);
    let _ = std::io::stderr().write_all(&buf);
}

// SAFETY: forwards to System, only refusing some requests (returning null, as allowed).
unsafe impl GlobalAlloc for Bounded {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
        if l.size() > MAX_ALLOCATION || live > MAX_LIVE {
            LIVE.fetch_sub(l.size(), Ordering::Relaxed);
            refuse(l.size());
            return std::ptr::null_mut();
        }
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let live = LIVE.fetch_add(new, Ordering::Relaxed) + new;
        if new > MAX_ALLOCATION || live > MAX_LIVE + l.size() {
            LIVE.fetch_sub(new, Ordering::Relaxed);
            refuse(new);
            return std::ptr::null_mut();
        }
        let q = System.realloc(p, l, new);
        LIVE.fetch_sub(if q.is_null() { new } else { l.size() }, Ordering::Relaxed);
        q
    }
}

#[global_allocator]
static ALLOCATOR: Bounded = Bounded;

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const INTERESTING: [u64; 8] = [
    0,
    1,
    0xff,
    0xffff_ffff,
    1 << 31,
    (1 << 32) + 2,
    1 << 63,
    u64::MAX,
];

/// One to four byte-level edits, mostly within the first `hot` bytes (where headers are).
fn mutate_bytes(rng: &mut Rng, data: &[u8], hot: usize) -> Vec<u8> {
    let mut d = data.to_vec();
    for _ in 0..1 + rng.below(4) {
        let span = if rng.below(4) == 0 {
            d.len()
        } else {
            hot.min(d.len())
        };
        let at = rng.below(span.max(1));
        let last = d.len().saturating_sub(1);
        match rng.below(6) {
            0 if !d.is_empty() => d[at.min(last)] ^= 1 << rng.below(8),
            1 if !d.is_empty() => d[at.min(last)] = rng.next() as u8,
            2 => d.truncate(at),
            3 => {
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                let at = at.min(d.len());
                d.splice(at..at, bytes);
            }
            4 if at + 8 <= d.len() => {
                let v = INTERESTING[rng.below(INTERESTING.len())];
                let width = [1, 2, 4, 8][rng.below(4)];
                d[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
            }
            _ => {
                let end = (at + 1 + rng.below(64)).min(d.len());
                d.drain(at.min(end)..end);
            }
        }
    }
    d
}

fn interesting_json(rng: &mut Rng) -> Value {
    match rng.below(14) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!((1u64 << 32) + 2),
        3 => json!(u64::MAX),
        4 => json!(i64::MIN),
        5 => json!(1e308),
        6 => json!(0.5),
        7 => json!(""),
        8 => json!("../../../etc/passwd"),
        9 => json!("/dev/zero"),
        10 => json!("x".repeat(1000)),
        11 => Value::Null,
        12 => json!([]),
        _ => json!({}),
    }
}

/// Replaces, removes or duplicates one node of `v`.
fn mutate_json(rng: &mut Rng, v: &mut Value) {
    fn count(v: &Value) -> usize {
        1 + match v {
            Value::Array(a) => a.iter().map(count).sum(),
            Value::Object(o) => o.values().map(count).sum(),
            _ => 0,
        }
    }
    fn visit(v: &mut Value, target: &mut usize, rng: &mut Rng) -> bool {
        if *target == 0 {
            *v = interesting_json(rng);
            return true;
        }
        *target -= 1;
        match v {
            Value::Array(a) => {
                if rng.below(8) == 0 && !a.is_empty() {
                    let i = rng.below(a.len());
                    if rng.below(2) == 0 {
                        a.remove(i);
                    } else {
                        let dup = a[i].clone();
                        a.insert(i, dup);
                    }
                    return true;
                }
                a.iter_mut().any(|x| visit(x, target, rng))
            }
            Value::Object(o) => {
                if rng.below(8) == 0 && !o.is_empty() {
                    let k = o.keys().nth(rng.below(o.len())).unwrap().clone();
                    o.remove(&k);
                    return true;
                }
                o.values_mut().any(|x| visit(x, target, rng))
            }
            _ => false,
        }
    }
    let mut target = rng.below(count(v));
    visit(v, &mut target, rng);
}

fn inputs(default: usize) -> usize {
    let total: usize = std::env::var("KVPLUG_FUZZ_INPUTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_200);
    default * total / 10_200
}

/// Runs `f` on input `n`; a panic fails the test naming the input and what it was.
fn check<T, E: std::fmt::Display>(n: u64, what: &str, f: impl FnOnce() -> Result<T, E>) -> bool {
    INPUT.store(n, Ordering::Relaxed);
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(_)) => true,
        Ok(Err(e)) => {
            assert!(!e.to_string().is_empty(), "input {n} ({what}): empty error");
            false
        }
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("input {n} ({what}) panicked: {msg}")
        }
    }
}

#[test]
fn scenario_files() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../conformance/scenarios");
    let mut seeds: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    seeds.sort();
    let mut rng = Rng(1);
    let (mut ok, n) = (0, inputs(4000));
    for i in 0..n {
        let seed = &seeds[rng.below(seeds.len())];
        let text = if rng.below(2) == 0 {
            let mut v: Value = serde_json::from_str(seed).unwrap();
            mutate_json(&mut rng, &mut v);
            v.to_string()
        } else {
            String::from_utf8_lossy(&mutate_bytes(&mut rng, seed.as_bytes(), seed.len())).into()
        };
        ok += check(i as u64, &text, || {
            kvplug_conformance::scenario::parse(Path::new("fuzz.json"), &text)
        }) as usize;
    }
    eprintln!("scenario files: {n} inputs, {ok} valid");
    assert!(ok < n, "no mutation was refused: the mutator is broken");
}

/// Loads a package the way a backend does: open, then every weight onto the cpu device.
fn load(dir: &Path) -> Result<(), String> {
    let pkg = ModelPackage::open(dir).map_err(|e| e.to_string())?;
    DecoderModel::load(Arc::new(CpuDevice::new()), &pkg)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The safetensors header (JSON) and the data after it.
fn split_safetensors(bytes: &[u8]) -> (Value, &[u8]) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (
        serde_json::from_slice(&bytes[8..8 + n]).unwrap(),
        &bytes[8 + n..],
    )
}

#[test]
fn model_packages() {
    let tmp = tempfile::tempdir().unwrap();
    let seed = tmp.path().join("seed");
    synth(&PRESETS[0], &seed, 3, "f16").unwrap();
    load(&seed).unwrap();
    let config = std::fs::read(seed.join("config.json")).unwrap();
    let weights = std::fs::read(seed.join("model.safetensors")).unwrap();
    let (header, data) = split_safetensors(&weights);
    let header_len = 8 + weights.len() - data.len();
    let dir = tmp.path().join("m");
    let mut rng = Rng(2);
    let (mut ok, n) = (0, inputs(3200));
    for i in 0..n {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let (mut cfg, mut st) = (config.clone(), weights.clone());
        let what = match rng.below(5) {
            0 => {
                let mut v: Value = serde_json::from_slice(&config).unwrap();
                mutate_json(&mut rng, &mut v);
                cfg = v.to_string().into_bytes();
                "config.json (json)"
            }
            1 => {
                cfg = mutate_bytes(&mut rng, &config, config.len());
                "config.json (bytes)"
            }
            2 => {
                let mut h = header.clone();
                mutate_json(&mut rng, &mut h);
                let h = h.to_string().into_bytes();
                st = (h.len() as u64).to_le_bytes().to_vec();
                st.extend_from_slice(&h);
                st.extend_from_slice(data);
                "safetensors header (json)"
            }
            3 => {
                st = mutate_bytes(&mut rng, &weights, header_len);
                "safetensors (bytes)"
            }
            _ => {
                let mut index =
                    json!({"weight_map": {"model.embed_tokens.weight": "model.safetensors"}});
                mutate_json(&mut rng, &mut index);
                std::fs::write(dir.join("model.safetensors.index.json"), index.to_string())
                    .unwrap();
                "shard index"
            }
        };
        std::fs::write(dir.join("config.json"), &cfg).unwrap();
        std::fs::write(dir.join("model.safetensors"), &st).unwrap();
        ok += check(100_000 + i as u64, what, || load(&dir)) as usize;
    }
    eprintln!("model packages: {n} inputs, {ok} valid");
    assert!(ok < n, "no mutation was refused: the mutator is broken");
}

/// A small Llama GGUF: the tiny preset's weights (f16 matrices, f32 norms), a byte-level
/// BPE vocabulary of single bytes, and a chat template.
fn seed_gguf(path: &Path, tmp: &Path) {
    let hf = tmp.join("gguf-src");
    let p = &PRESETS[0];
    synth(p, &hf, 5, "f32").unwrap();
    let pkg = ModelPackage::open(&hf).unwrap();
    let tensors: Vec<(String, QTensor)> = hf_tensor_shapes(p)
        .iter()
        .map(|(name, shape)| {
            let data = pkg.tensor_f32(name, shape).unwrap();
            let t = Tensor::from_vec(data, shape.as_slice(), &Device::Cpu).unwrap();
            let dtype = if shape.len() == 1 {
                GgmlDType::F32
            } else {
                GgmlDType::F16
            };
            (gguf_name(name), QTensor::quantize(&t, dtype).unwrap())
        })
        .collect();
    // Tokens: printable single characters, one merge of the first two, then specials.
    let mut tokens: Vec<String> = (0..p.vocab - 3)
        .map(|i| char::from_u32(0x100 + i as u32).unwrap().to_string())
        .collect();
    tokens.extend(["Āā", "<|im_start|>", "<|im_end|>"].map(String::from));
    let s = |x: &str| GValue::String(x.into());
    let u = |x: usize| GValue::U32(x as u32);
    let mut meta = llama_gguf_meta(p, 1e-5, 10000.0);
    meta.extend([
        ("tokenizer.ggml.model", s("gpt2")),
        (
            "tokenizer.ggml.tokens",
            GValue::Array(tokens.iter().map(|t| s(t)).collect()),
        ),
        ("tokenizer.ggml.merges", GValue::Array(vec![s("Ā ā")])),
        ("tokenizer.ggml.eos_token_id", u(p.vocab - 1)),
        (
            "tokenizer.chat_template",
            s("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"),
        ),
    ]);
    write_gguf(path, &meta, &tensors);
}

#[test]
fn gguf_files() {
    let tmp = tempfile::tempdir().unwrap();
    let seed = tmp.path().join("seed.gguf");
    seed_gguf(&seed, tmp.path());
    let bytes = std::fs::read(&seed).unwrap();
    kvplug::formats::gguf::import(&seed, &tmp.path().join("seed-out"), &mut |_, _, _| {}).unwrap();
    // Header and metadata: everything before the first tensor's data (a few KiB here).
    let hot = 8 * 1024;
    let (file, out) = (tmp.path().join("m.gguf"), tmp.path().join("out"));
    let mut rng = Rng(3);
    let (mut ok, n) = (0, inputs(3000));
    for i in 0..n {
        std::fs::write(&file, mutate_bytes(&mut rng, &bytes, hot)).unwrap();
        let _ = std::fs::remove_dir_all(&out);
        let import = || kvplug::formats::gguf::import(&file, &out, &mut |_, _, _| {});
        ok += check(200_000 + i as u64, "gguf", import) as usize;
    }
    eprintln!("gguf files: {n} inputs, {ok} valid");
    assert!(ok < n, "no mutation was refused: the mutator is broken");
}

/// The cache the session seeds come from and mutated sessions go to.
fn session_cache(kv_dtype: KvDtype) -> CacheConfig {
    CacheConfig {
        capacity: 64,
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 16,
        min_chunk: 4,
        kv_dtype,
        sliding: None,
        conv: None,
        delta: None,
        ssm: None,
    }
}

/// A seed session: `n` rows of a 2-layer cpu seq cache in `dtype`.
fn seed_session(dtype: KvDtype, n: usize) -> Session {
    let cfg = session_cache(dtype);
    let dev = Arc::new(CpuDevice::new());
    let mut cache = KitCache::new(dev.clone(), CacheKind::Seq, cfg).unwrap();
    if n > 0 {
        let positions: Vec<i32> = (0..n as i32).collect();
        let mut step = cache.step(&positions, Some(&vec![0; n])).unwrap();
        let values = |h: usize, salt: usize| -> Vec<f32> {
            (0..h * n * 16)
                .map(|i| ((i * 31 + salt) as f32 * 0.01).sin())
                .collect()
        };
        for layer in 0..2 {
            let up = |h: usize, salt: usize| {
                use kvplug_backend_kit::Device as _;
                dev.upload(&HostTensor::from_f32(&[h, n, 16], &values(h, salt)))
                    .unwrap()
            };
            let (q, k, v) = (up(4, layer), up(2, layer + 7), up(2, layer + 9));
            let mut out = {
                use kvplug_backend_kit::Device as _;
                dev.zeros(&[4, n, 16]).unwrap()
            };
            step.attend(layer, &q, &k, &v, 0.25, &mut out).unwrap();
        }
        step.commit().unwrap();
    }
    Session {
        rows: cache.export_seq(0).unwrap(),
        tokens: (0..n as i32).map(|t| t * 7 + 1).collect(),
        model: "0".repeat(64),
        key_basis: KeyBasis::Identity,
        model_name: String::new(),
        app: [("chat.messages".to_string(), "[]".to_string())].into(),
    }
}

/// Re-signs session bytes after an edit (the checksum over the file with its digits zeroed),
/// so the mutation reaches the parser behind the checksum. No-op without a checksum entry.
fn resign(bytes: &mut [u8]) {
    let key = b"\"kv_cache.checksum\":\"";
    let Some(at) = bytes.windows(key.len()).position(|w| w == key) else {
        return;
    };
    let at = at + key.len();
    if at + 64 > bytes.len() {
        return;
    }
    bytes[at..at + 64].fill(b'0');
    let sum = blake3::hash(bytes).to_hex();
    bytes[at..at + 64].copy_from_slice(sum.as_bytes());
}

/// Parses `bytes` as a session and imports it into a fresh cpu seq cache whose other
/// sequence must come through unchanged.
fn load_session(bytes: Vec<u8>) -> Result<(), String> {
    let s = session_file::from_bytes(Path::new("fuzz.kvsession.safetensors"), &bytes)
        .map_err(|e| e.to_string())?;
    let dtype: KvDtype = s.rows.kv_dtype.parse().map_err(|e| format!("{e}"))?;
    let cfg = session_cache(dtype);
    cfg.validate().map_err(|e| e.to_string())?;
    let mut cache = KitCache::new(Arc::new(CpuDevice::new()), CacheKind::Seq, cfg)
        .map_err(|e| e.to_string())?;
    let result = cache.import_seq(1, &s.rows).map_err(|e| e.to_string());
    if result.is_err() {
        assert_eq!(
            cache.stats().live_cells,
            0,
            "a refused import left rows behind"
        );
    }
    result
}

#[test]
fn session_files() {
    let seeds: Vec<Vec<u8>> = [
        (KvDtype::F16, 9),
        (KvDtype::Q4 { group: 8 }, 5),
        (KvDtype::F32, 0),
    ]
    .into_iter()
    .map(|(d, n)| session_file::to_bytes(&seed_session(d, n)).unwrap())
    .collect();
    for s in &seeds {
        load_session(s.clone()).unwrap();
    }
    let mut rng = Rng(4);
    let (mut ok, mut refused_raw, n) = (0, 0, inputs(10_000));
    for i in 0..n {
        let seed = &seeds[rng.below(seeds.len())];
        let (bytes, what) = match rng.below(3) {
            // Raw edits: the checksum must catch every one that changed a byte.
            0 => {
                let b = mutate_bytes(&mut rng, seed, seed.len());
                if b == *seed {
                    continue;
                }
                refused_raw += 1;
                assert!(
                    load_session(b.clone()).is_err(),
                    "input {}: a changed file was accepted",
                    300_000 + i
                );
                continue;
            }
            // Header edits (JSON-aware), re-signed.
            1 => {
                let (mut h, data) = split_safetensors(seed);
                mutate_json(&mut rng, &mut h);
                let h = h.to_string().into_bytes();
                let mut b = (h.len() as u64).to_le_bytes().to_vec();
                b.extend_from_slice(&h);
                b.extend_from_slice(data);
                resign(&mut b);
                (b, "session header (json), re-signed")
            }
            // Byte edits anywhere, re-signed.
            _ => {
                let mut b = mutate_bytes(&mut rng, seed, 2048);
                resign(&mut b);
                (b, "session bytes, re-signed")
            }
        };
        ok += check(300_000 + i as u64, what, || load_session(bytes)) as usize;
    }
    eprintln!("session files: {n} inputs ({refused_raw} unsigned edits all refused), {ok} re-signed ones valid");
    assert!(ok < n && refused_raw > 0, "the mutator is broken");
}

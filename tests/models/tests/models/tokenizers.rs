//! GGUF byte-level BPE tokenizers (`tokenizer.ggml.model = gpt2`) with the `qwen2`,
//! `llama-bpe`, `gpt-2` and `default` pre-tokenizers (and `dbrx`, Llama 3's split without
//! its `ignore_merges`, as Granite 4.0's files name it; and none, which llama.cpp reads as
//! `default`), against a plain reference written from llama.cpp's
//! algorithm: control tokens split out first, NFC (Qwen2's normalizer), the pre-tokenizer's
//! split regexes as llama.cpp's `llama-vocab.cpp` spells them (without inline flags; each
//! splitting the pieces of the one before into matches and the text between), GPT-2's
//! byte map, then, for `llama-bpe`, a pre-token found whole in the vocabulary taken as one
//! token (llama.cpp's `ignore_merges`), else repeatedly the adjacent pair of lowest merge
//! rank (leftmost on ties). Raw prompts start with BOS where llama.cpp's default says so.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use kvplug::Text;
use unicode_normalization::UnicodeNormalization;

use crate::common;
use common::{bpe_tokenizer_meta, byte_chars, gguf_tensors, llama_gguf_meta, write_gguf};

/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2` split.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_LLAMA3` split (`llama-bpe`): digits in runs of up to 3.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_GPT2` split (`gpt-2`).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_DEFAULT` splits (`default`, and a file naming none), in
/// the order they apply.
const DEFAULT: [&str; 4] = [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"];

/// Strings that tell pre-tokenizers apart: contractions in both cases, digit runs, letters
/// of many scripts, decomposed accents, code, runs of spaces, tabs and newlines.
const SAMPLES: [&str; 9] = [
    "Hello world! I'm sure you'LL see it's 12345 or 3.14159, not 1000000. IT'Sx WE'REN'T",
    "def reverse(s: str) -> str:\n    return s[::-1]\n\n\nprint(reverse(\"abc\"))  # cba\n",
    "naïve café, 東京タワー, emoji 🦜 and ⅞ of a ℌ; Ελληνικά и русский",
    "e\u{301}te\u{301} (decomposed) vs été",
    "  two  spaces\t\ttabs \n\n trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x=1;y=22;z=333;w=4444 // hello hello hello",
    "hello\nhello,hello",
    "",
];

/// What a `tokenizer.ggml.pre` name means in llama.cpp: its split regexes (each splitting
/// the pieces of the one before), whether text is NFC-normalized first (Qwen2's
/// normalizer), and whether a pre-token found whole in the vocabulary is one token
/// (`ignore_merges`, Llama 3's rule).
#[derive(Clone, Copy)]
struct Pre {
    split: &'static [&'static str],
    nfc: bool,
    ignore_merges: bool,
}

const QWEN2_PRE: Pre = Pre {
    split: &[QWEN2],
    nfc: true,
    ignore_merges: false,
};
const LLAMA3_PRE: Pre = Pre {
    split: &[LLAMA3],
    nfc: false,
    ignore_merges: true,
};
/// DBRX's (and Granite 4.0's): Llama 3's split, the merges applied to every pre-token.
const DBRX_PRE: Pre = Pre {
    ignore_merges: false,
    ..LLAMA3_PRE
};
const GPT2_PRE: Pre = Pre {
    split: &[GPT2],
    nfc: false,
    ignore_merges: false,
};
const DEFAULT_PRE: Pre = Pre {
    split: &DEFAULT,
    ..GPT2_PRE
};

/// The reference tokenizer over one vocabulary.
struct Reference {
    id: HashMap<String, i32>,
    rank: HashMap<(String, String), usize>,
    /// Control tokens, matched whole before anything else.
    control: Vec<String>,
    split: Vec<fancy_regex::Regex>,
    nfc: bool,
    /// A pre-token found whole in the vocabulary is one token (llama.cpp's Llama 3 rule).
    ignore_merges: bool,
}

impl Reference {
    fn new(tokens: &[String], merges: &[String], types: &[i32], pre: Pre) -> Self {
        let Pre {
            split,
            nfc,
            ignore_merges,
        } = pre;
        Reference {
            id: tokens
                .iter()
                .enumerate()
                .map(|(i, t)| (t.clone(), i as i32))
                .collect(),
            rank: merges
                .iter()
                .enumerate()
                .map(|(r, m)| {
                    let (a, b) = m.split_once(' ').unwrap();
                    ((a.to_string(), b.to_string()), r)
                })
                .collect(),
            control: (0..tokens.len())
                .filter(|&i| types[i] == 3)
                .map(|i| tokens[i].clone())
                .collect(),
            split: split
                .iter()
                .map(|r| fancy_regex::Regex::new(r).unwrap())
                .collect(),
            nfc,
            ignore_merges,
        }
    }

    fn encode(&self, text: &str) -> Vec<i32> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let next = self
                .control
                .iter()
                .filter_map(|c| rest.find(c.as_str()).map(|at| (at, c)))
                .min_by_key(|&(at, c)| (at, usize::MAX - c.len()));
            let (plain, control) = match next {
                Some((at, c)) => (&rest[..at], Some(c)),
                None => (rest, None),
            };
            self.encode_plain(plain, &mut out);
            match control {
                Some(c) => {
                    out.push(self.id[c]);
                    rest = &rest[plain.len() + c.len()..];
                }
                None => rest = "",
            }
        }
        out
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<i32>) {
        let text: String = if self.nfc {
            text.nfc().collect()
        } else {
            text.to_string()
        };
        // Each regex splits every piece into its matches and the text between them.
        let mut pieces = vec![text.as_str()];
        for regex in &self.split {
            let mut next = Vec::new();
            for piece in pieces {
                let mut at = 0;
                for m in regex.find_iter(piece) {
                    let m = m.unwrap();
                    next.extend([&piece[at..m.start()], m.as_str()]);
                    at = m.end();
                }
                next.push(&piece[at..]);
            }
            pieces = next.into_iter().filter(|p| !p.is_empty()).collect();
        }
        let bytes = byte_chars();
        for piece in pieces {
            let mut syms: Vec<String> = piece
                .bytes()
                .map(|b| bytes[b as usize].to_string())
                .collect();
            if let Some(&id) = self.id.get(&syms.concat()).filter(|_| self.ignore_merges) {
                out.push(id);
                continue;
            }
            loop {
                let best = (0..syms.len().saturating_sub(1))
                    .filter_map(|i| {
                        let pair = (syms[i].clone(), syms[i + 1].clone());
                        self.rank.get(&pair).map(|&r| (r, i))
                    })
                    .min();
                let Some((_, i)) = best else { break };
                let right = syms.remove(i + 1);
                syms[i].push_str(&right);
            }
            out.extend(syms.iter().map(|s| self.id[s]));
        }
    }
}

/// The GGUF's vocabulary, merges and token types.
fn vocabulary(gguf: &Path) -> (Vec<String>, Vec<String>, Vec<i32>) {
    let mut f = std::fs::File::open(gguf).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let list = |k: &str| content.metadata[k].to_vec().unwrap().clone();
    let strings = |k: &str| -> Vec<String> {
        list(k)
            .iter()
            .map(|v| v.to_string().unwrap().clone())
            .collect()
    };
    let types = list("tokenizer.ggml.token_type")
        .iter()
        .map(|v| v.to_i32().unwrap())
        .collect();
    (
        strings("tokenizer.ggml.tokens"),
        strings("tokenizer.ggml.merges"),
        types,
    )
}

/// Asserts that kvplug's tokenizer for `gguf` (indexed into `dir`) gives the reference's ids
/// on every sample.
fn check(gguf: &Path, dir: &Path, pre: Pre) {
    kvplug::formats::gguf::index(gguf, dir).unwrap();
    let text = Text::load(dir).unwrap();
    let (tokens, merges, types) = vocabulary(gguf);
    let reference = Reference::new(&tokens, &merges, &types, pre);
    for s in SAMPLES {
        assert_eq!(text.encode(s).unwrap(), reference.encode(s), "{s:?}");
    }
}

#[test]
fn qwen2_pre_tokenizer_on_the_real_vocabulary_matches_the_reference() {
    let gguf = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        gguf.exists(),
        "run scripts/fetch-models.sh (make test does)"
    );
    let dir = tempfile::tempdir().unwrap();
    check(&gguf, dir.path(), QWEN2_PRE);
}

/// A synthetic llama model's preset (300 tokens) and its f32 tensors as a GGUF holds them,
/// made under `dir`.
fn synthetic_weights(
    dir: &Path,
) -> (
    kvplug::formats::synth::Preset,
    Vec<(String, candle_core::quantized::QTensor)>,
) {
    let src = dir.join("hf");
    let preset = kvplug::formats::synth::Preset {
        name: "tokenizer",
        vocab: 300,
        ..kvplug::formats::synth::PRESETS[0]
    };
    kvplug::formats::synth::synth(&preset, &src, 1, "f32").unwrap();
    let pkg = kvplug_backend_kit::model::ModelPackage::open(&src).unwrap();
    let tensors = gguf_tensors(
        &pkg,
        &preset,
        &[candle_core::quantized::GgmlDType::F32],
        false,
    );
    (preset, tensors)
}

#[test]
fn llama_bpe_pre_tokenizer_matches_the_reference() {
    // Merges across the places where splits differ: "123" is one token only where digits go
    // in runs of up to 3, "'Sx" only where contractions are matched case-sensitively;
    // "hello" is in the vocabulary but the merges stop at "hell" "o", so it is one token only
    // where a whole pre-token found in the vocabulary is taken as is (llama-bpe).
    let merges = [
        "1 2", "12 3", "4 4", "44 4", "h e", "l l", "he ll", "Ġ he", "' L", "'L L", "o Ġ", "' S",
        "'S x", "l o", "l lo", "he llo",
    ];
    let dir = tempfile::tempdir().unwrap();
    let (preset, tensors) = synthetic_weights(dir.path());
    // "falcon3": one of the names llama.cpp gives Llama 3's pre-tokenizer in other models;
    // "deepseek-r1-qwen" one it gives Qwen2's, "mellum" one it gives GPT-2's.
    // "none": a file naming no pre-tokenizer, which llama.cpp reads as "default", as it
    // reads an empty name ("").
    let pres = [
        ("llama-bpe", LLAMA3_PRE),
        ("falcon3", LLAMA3_PRE),
        ("dbrx", DBRX_PRE),
        ("qwen2", QWEN2_PRE),
        ("deepseek-r1-qwen", QWEN2_PRE),
        ("gpt-2", GPT2_PRE),
        ("mellum", GPT2_PRE),
        ("default", DEFAULT_PRE),
        ("none", DEFAULT_PRE),
        ("", DEFAULT_PRE),
    ];
    for (pre, reference) in pres {
        let name = if pre.is_empty() { "empty" } else { pre };
        let mut meta = llama_gguf_meta(&preset, 1e-5, 10_000.0);
        let (tokenizer, _) = bpe_tokenizer_meta(pre, &merges, preset.vocab);
        meta.extend(
            tokenizer
                .into_iter()
                .filter(|(k, _)| pre != "none" || *k != "tokenizer.ggml.pre"),
        );
        let gguf = dir.path().join(format!("{name}.gguf"));
        write_gguf(&gguf, &meta, &tensors);
        check(&gguf, &dir.path().join(name), reference);
    }
    // The pre-tokenizers differ on these merges, so each check above can fail.
    let (tokens, merges, types) = vocabulary(&dir.path().join("llama-bpe.gguf"));
    let encode = |pre, s| Reference::new(&tokens, &merges, &types, pre).encode(s);
    for (a, b, sample) in [
        (LLAMA3_PRE, QWEN2_PRE, SAMPLES[0]),
        (DBRX_PRE, QWEN2_PRE, SAMPLES[0]),
        (LLAMA3_PRE, DBRX_PRE, "hello"),
        (DEFAULT_PRE, GPT2_PRE, SAMPLES[6]),
        (GPT2_PRE, QWEN2_PRE, SAMPLES[0]),
    ] {
        assert_ne!(encode(a, sample), encode(b, sample), "{sample:?}");
    }
    // Neither GGUF says `add_bos_token`: llama.cpp's default starts a Llama 3 raw prompt with
    // BOS and a Qwen2 one without.
    let id = |t: &str| tokens.iter().position(|x| x == t).unwrap() as i32;
    let raw = |pre: &str| {
        Text::load(&dir.path().join(pre))
            .unwrap()
            .encode_raw("hello")
    };
    assert_eq!(raw("llama-bpe").unwrap(), [id("<|im_start|>"), id("hello")]);
    assert_eq!(raw("falcon3").unwrap(), raw("llama-bpe").unwrap());
    assert_eq!(raw("qwen2").unwrap(), [id("hell"), id("o")]);
    // Nor DBRX's nor DeepSeek-R1-Qwen's.
    assert_eq!(raw("dbrx").unwrap(), raw("qwen2").unwrap());
    assert_eq!(raw("deepseek-r1-qwen").unwrap(), raw("qwen2").unwrap());
    // Nor a file naming no pre-tokenizer (llama.cpp's DEFAULT).
    assert_eq!(raw("none").unwrap(), raw("qwen2").unwrap());
}

/// A token whose text llama.cpp reads as ending generation (`<|im_end|>`) is a control token
/// whatever type the file gives it, as llama.cpp overrides it: matched whole in a prompt,
/// skipped when decoding.
#[test]
fn control_looking_tokens_are_control_whatever_their_type() {
    use candle_core::quantized::gguf_file::Value;
    let dir = tempfile::tempdir().unwrap();
    let (preset, tensors) = synthetic_weights(dir.path());
    let mut meta = llama_gguf_meta(&preset, 1e-5, 10_000.0);
    let (mut tokenizer, tokens) = bpe_tokenizer_meta("qwen2", &["h i"], preset.vocab);
    let end = tokens.iter().position(|t| t == "<|im_end|>").unwrap();
    for (k, v) in &mut tokenizer {
        if *k == "tokenizer.ggml.token_type" {
            let Value::Array(types) = v else { panic!() };
            // Normal, as some Mistral fine-tunes' files type it.
            types[end] = Value::I32(1);
        }
    }
    meta.extend(tokenizer);
    let gguf = dir.path().join("normal-im-end.gguf");
    write_gguf(&gguf, &meta, &tensors);
    let out = dir.path().join("indexed");
    kvplug::formats::gguf::index(&gguf, &out).unwrap();
    let text = Text::load(&out).unwrap();
    let hi = tokens.iter().position(|t| t == "hi").unwrap() as i32;
    let ids = text.encode("hi<|im_end|>hi").unwrap();
    assert_eq!(ids, [hi, end as i32, hi]);
    assert_eq!(text.detokenize(&ids).unwrap(), "hihi");
}

/// A raw prompt ends with EOS where the file says `tokenizer.ggml.add_eos_token` (llama.cpp
/// appends it to a prompt tokenized with its special tokens, Hugging Face's tokenizer
/// likewise), and not where the file does not say so.
#[test]
fn a_raw_prompt_ends_with_eos_where_the_file_says_add_eos_token() {
    use candle_core::quantized::gguf_file::Value;
    let dir = tempfile::tempdir().unwrap();
    let (preset, tensors) = synthetic_weights(dir.path());
    let (tokenizer, tokens) = bpe_tokenizer_meta("qwen2", &["h i"], preset.vocab);
    let id = |t: &str| tokens.iter().position(|x| x == t).unwrap() as i32;
    for (name, add_eos) in [
        ("unstated", None),
        ("true", Some(true)),
        ("false", Some(false)),
    ] {
        let mut meta = llama_gguf_meta(&preset, 1e-5, 10_000.0);
        meta.extend(tokenizer.clone());
        if let Some(b) = add_eos {
            meta.push(("tokenizer.ggml.add_eos_token", Value::Bool(b)));
        }
        let gguf = dir.path().join(format!("{name}.gguf"));
        write_gguf(&gguf, &meta, &tensors);
        let out = dir.path().join(name);
        kvplug::formats::gguf::index(&gguf, &out).unwrap();
        let raw = Text::load(&out).unwrap().encode_raw("hi").unwrap();
        let want = match add_eos {
            Some(true) => vec![id("hi"), id("<|im_end|>")],
            _ => vec![id("hi")],
        };
        assert_eq!(raw, want, "add_eos_token {name}");
    }
}

/// A SentencePiece vocabulary (`tokenizer.ggml.model = llama`) starts a text with a space
/// unless `tokenizer.ggml.add_space_prefix` says false, as llama.cpp does: Llama 2's and
/// Mistral's files do not state it.
#[test]
fn sentencepiece_texts_start_with_a_space_unless_the_file_says_not() {
    use candle_core::quantized::gguf_file::Value;
    let dir = tempfile::tempdir().unwrap();
    let (preset, tensors) = synthetic_weights(dir.path());
    // "Hello" is one piece with the space before it and one without.
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>", "▁", "H", "e", "l", "o"]
        .map(String::from)
        .to_vec();
    for w in ["He", "Hel", "Hell", "Hello"] {
        tokens.push(w.into());
        tokens.push(format!("▁{w}"));
    }
    tokens.push("▁H".into());
    while tokens.len() < preset.vocab {
        tokens.push(format!("<unused{}>", tokens.len()));
    }
    let id = |t: &str| tokens.iter().position(|x| x == t).unwrap() as i32;
    let types: Vec<Value> = (0..tokens.len())
        .map(|i| Value::I32(if (1..3).contains(&i) { 3 } else { 1 }))
        .collect();
    let scores: Vec<Value> = (0..tokens.len()).map(|i| Value::F32(-(i as f32))).collect();
    for (name, prefix) in [("unstated", None), ("false", Some(false))] {
        let mut meta = llama_gguf_meta(&preset, 1e-5, 10_000.0);
        meta.extend([
            ("tokenizer.ggml.model", Value::String("llama".into())),
            (
                "tokenizer.ggml.tokens",
                Value::Array(tokens.iter().map(|t| Value::String(t.clone())).collect()),
            ),
            ("tokenizer.ggml.scores", Value::Array(scores.clone())),
            ("tokenizer.ggml.token_type", Value::Array(types.clone())),
            ("tokenizer.ggml.bos_token_id", Value::U32(1)),
            ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        ]);
        if let Some(p) = prefix {
            meta.push(("tokenizer.ggml.add_space_prefix", Value::Bool(p)));
        }
        let gguf = dir.path().join(format!("{name}.gguf"));
        write_gguf(&gguf, &meta, &tensors);
        let model = dir.path().join(name);
        kvplug::formats::gguf::index(&gguf, &model).unwrap();
        let want = match prefix {
            None => id("▁Hello"),
            Some(_) => id("Hello"),
        };
        assert_eq!(
            Text::load(&model).unwrap().encode("Hello").unwrap(),
            [want],
            "{name}"
        );
    }
}

//! The scenario file format (JSON; unknown fields and ops are errors).
//!
//! ```text
//! {"name", "description", "kinds": [..], "dtypes": [..]?, "config": {..}, "seed",
//!  "expect_build_error": "bad_config"?, "ops": [..]}
//! ```
//! Ops: `step` (`pos` or `pos_range`, `seq` one id or one per token, optional `tamper` at
//! `tamper_layer`),
//! `seq_cp`, `seq_rm`, `seq_keep`, `propose`, `commit`, `rewind`, `clear`, `export` (`seq`),
//! `import` (`seq` and `pos_range` or `from_export`), `check` (`seq_len` / `can_extend` /
//! `plan`), `expect_error` (`error` kind + the op to `do`).
//! `p0`/`p1` are half-open, `null` = open-ended. `config.sliding` (`window`, `layers`) makes
//! a hybrid model: those layers attend through the window and drop older rows.

use std::path::{Path, PathBuf};

use kvplug_core::files::{read_text, FileError, MAX_TEXT_BYTES};
use kvplug_core::{CacheKind, ErrorKind, KvDtype, PlanKind};
use serde::Deserialize;

use crate::rng::Inputs;

/// Cache shape of a scenario (the KV dtype comes from the matrix).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ScenarioConfig {
    /// Cells.
    pub capacity: usize,
    /// Layers.
    pub n_layers: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Query heads (a multiple of `n_kv_heads`).
    pub n_q_heads: usize,
    /// Values per head row.
    pub head_dim: usize,
    /// First pool allocation.
    #[serde(default = "default_min_chunk")]
    pub min_chunk: usize,
    /// Sliding-window layers (a hybrid model); none by default.
    #[serde(default)]
    pub sliding: Option<ScenarioSliding>,
}

/// `{"window": W, "layers": [..]}`: these layers attend through a window of `W` positions.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ScenarioSliding {
    /// Positions a query sees, itself included.
    pub window: usize,
    /// Layer indices.
    pub layers: Vec<usize>,
}

fn default_min_chunk() -> usize {
    kvplug_core::DEFAULT_MIN_CHUNK
}

/// One sequence id for every token, or one per token.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum SeqSpec {
    /// Every token in this sequence.
    One(i32),
    /// One id per token.
    PerToken(Vec<i32>),
}

/// A deliberately malformed input for a step.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Tamper {
    /// k gets one token too many.
    KShape,
}

/// What a `check` op checks.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SeqLenCheck {
    /// Sequence.
    pub seq: i32,
    /// Expected cells.
    pub len: usize,
}

/// `can_extend(n) == value`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct CanExtendCheck {
    /// Tokens.
    pub n: usize,
    /// Expected answer.
    pub value: bool,
}

/// One scenario op.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Op {
    /// One forward over all layers.
    Step {
        /// Explicit positions.
        #[serde(default)]
        pos: Option<Vec<i32>>,
        /// `[start, end)` shorthand.
        #[serde(default)]
        pos_range: Option<[i32; 2]>,
        /// Sequence ids (default 0).
        #[serde(default)]
        seq: Option<SeqSpec>,
        /// Malformed input.
        #[serde(default)]
        tamper: Option<Tamper>,
        /// The layer `tamper` hits (default 0); a later layer fails mid-step, which must
        /// roll the whole step back.
        #[serde(default)]
        tamper_layer: usize,
    },
    /// Share cells.
    SeqCp {
        /// Source.
        src: i32,
        /// Destination.
        dst: i32,
        /// Lower bound.
        #[serde(default)]
        p0: Option<i32>,
        /// Upper bound (exclusive).
        #[serde(default)]
        p1: Option<i32>,
    },
    /// Drop cells.
    SeqRm {
        /// Sequence.
        seq: i32,
        /// Lower bound.
        #[serde(default)]
        p0: Option<i32>,
        /// Upper bound (exclusive).
        #[serde(default)]
        p1: Option<i32>,
    },
    /// Keep one sequence.
    SeqKeep {
        /// Sequence.
        seq: i32,
    },
    /// Append a frontier.
    Propose {
        /// Parents.
        parents: Vec<i32>,
    },
    /// Accept a chain.
    Commit {
        /// Root-first chain.
        accepted: Vec<i32>,
    },
    /// Truncate.
    Rewind {
        /// New length.
        len: usize,
    },
    /// Forget everything.
    Clear,
    /// `export_seq(seq)`: the backend's rows must decode, bit for bit, to the values the
    /// oracle holds for the sequence (positions, layers, heads and the sliding window's rows
    /// in the canonical `[heads, rows, row]` form). The rows are kept for `import`'s
    /// `from_export`.
    Export {
        /// Sequence (contiguous and tree: 0).
        seq: i32,
    },
    /// `import_seq(seq, rows)`, the oracle importing the same values: rows for positions
    /// `pos_range`, drawn like a step's K/V and encoded in the canonical form by the runner,
    /// or with `from_export` the last `export`'s rows (the backend's own bytes).
    Import {
        /// Sequence (contiguous and tree: 0).
        seq: i32,
        /// `[start, end)` of the generated rows.
        #[serde(default)]
        pos_range: Option<[i32; 2]>,
        /// Import the last export instead.
        #[serde(default)]
        from_export: bool,
    },
    /// Check a verb's answer.
    Check {
        /// `seq_len(seq) == len`.
        #[serde(default)]
        seq_len: Option<SeqLenCheck>,
        /// `can_extend(n) == value`.
        #[serde(default)]
        can_extend: Option<CanExtendCheck>,
        /// Read path of the last step.
        #[serde(default)]
        plan: Option<PlanKindName>,
    },
    /// The inner op must fail with `error` and leave the cache unchanged.
    ExpectError {
        /// Expected error kind.
        error: ErrorName,
        /// The op.
        #[serde(rename = "do")]
        op: Box<Op>,
    },
}

impl Op {
    /// The op's name in scenario files.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Step { .. } => "step",
            Op::SeqCp { .. } => "seq_cp",
            Op::SeqRm { .. } => "seq_rm",
            Op::SeqKeep { .. } => "seq_keep",
            Op::Propose { .. } => "propose",
            Op::Commit { .. } => "commit",
            Op::Rewind { .. } => "rewind",
            Op::Clear => "clear",
            Op::Export { .. } => "export",
            Op::Import { .. } => "import",
            Op::Check { .. } => "check",
            Op::ExpectError { .. } => "expect_error",
        }
    }
}

/// A plan kind by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanKindName(pub PlanKind);

impl<'de> Deserialize<'de> for PlanKindName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        [PlanKind::SingleContiguous, PlanKind::Explicit]
            .into_iter()
            .find(|k| k.as_str() == s)
            .map(PlanKindName)
            .ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "unknown plan kind '{s}' (expected single_contiguous or explicit)"
                ))
            })
    }
}

/// An error kind by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorName(pub ErrorKind);

impl<'de> Deserialize<'de> for ErrorName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ErrorKind::parse(&s).map(ErrorName).ok_or_else(|| {
            let all: Vec<&str> = ErrorKind::ALL.iter().map(|k| k.as_str()).collect();
            serde::de::Error::custom(format!(
                "unknown error kind '{s}' (expected one of {})",
                all.join(", ")
            ))
        })
    }
}

/// A scenario.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Unique name.
    pub name: String,
    /// What it exercises.
    pub description: String,
    /// Kinds to run it on.
    pub kinds: Vec<CacheKind>,
    /// KV dtypes (default: all the backend supports).
    #[serde(default)]
    pub dtypes: Option<Vec<KvDtype>>,
    /// Input distributions (default: all of [`Inputs::ALL`]).
    #[serde(default)]
    pub inputs: Option<Vec<Inputs>>,
    /// Cache shape.
    pub config: ScenarioConfig,
    /// Input seed.
    pub seed: u64,
    /// Building the cache must fail with this kind (the ops are then not run).
    #[serde(default)]
    pub expect_build_error: Option<ErrorName>,
    /// The ops.
    pub ops: Vec<Op>,
}

/// A scenario file that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// A directory or file that could not be read (the message names it).
    #[error(transparent)]
    File(#[from] FileError),
    /// Malformed JSON or an unknown op/field.
    #[error("{path}: {message}")]
    Parse {
        /// File.
        path: PathBuf,
        /// serde's message with line and column.
        message: String,
    },
    /// Valid JSON that breaks a rule of the format.
    #[error("{path}: {message}")]
    Invalid {
        /// File.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Scenario shapes are bounded so a hostile file cannot make the oracle or a backend
/// allocate without limit: at most this many cells ...
pub const MAX_CAPACITY: usize = 1 << 20;
/// ... layers ...
pub const MAX_LAYERS: usize = 256;
/// ... query heads ...
pub const MAX_HEADS: usize = 256;
/// ... values per head row ...
pub const MAX_HEAD_DIM: usize = 1024;
/// ... and K (or V) values a full cache holds, `capacity · n_layers · n_kv_heads · head_dim`
/// (the oracle keeps them as f64: 512 MiB for K and V together at this bound); one step's
/// query values, `tokens · n_q_heads · head_dim`, have the same bound.
pub const MAX_KV_VALUES: u64 = 1 << 25;

/// Parses one scenario; `path` names it in errors.
pub fn parse(path: &Path, text: &str) -> Result<Scenario, ScenarioError> {
    let s: Scenario = serde_json::from_str(text).map_err(|e| ScenarioError::Parse {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let invalid = |message: String| ScenarioError::Invalid {
        path: path.to_path_buf(),
        message,
    };
    if s.kinds.is_empty() {
        return Err(invalid("'kinds' is empty".into()));
    }
    let c = &s.config;
    for (name, value, max) in [
        ("capacity", c.capacity, MAX_CAPACITY),
        ("n_layers", c.n_layers, MAX_LAYERS),
        ("n_q_heads", c.n_q_heads, MAX_HEADS),
        ("n_kv_heads", c.n_kv_heads, MAX_HEADS),
        ("head_dim", c.head_dim, MAX_HEAD_DIM),
    ] {
        if value > max {
            return Err(invalid(format!(
                "config {name} = {value} is above this format's limit of {max}"
            )));
        }
    }
    let product = |v: &[usize]| v.iter().fold(1u64, |a, &v| a.saturating_mul(v as u64));
    for (what, values) in [
        (
            "K values at capacity (capacity · n_layers · n_kv_heads · head_dim)",
            product(&[c.capacity, c.n_layers, c.n_kv_heads, c.head_dim]),
        ),
        (
            "query values in a full step (capacity · n_q_heads · head_dim)",
            product(&[c.capacity, c.n_q_heads, c.head_dim]),
        ),
    ] {
        if values > MAX_KV_VALUES {
            return Err(invalid(format!(
                "config allows {values} {what}, above this format's limit of {MAX_KV_VALUES}"
            )));
        }
    }
    if c.n_kv_heads == 0 || c.n_q_heads % c.n_kv_heads != 0 {
        return Err(invalid(format!(
            "n_q_heads {} is not a multiple of n_kv_heads {}",
            c.n_q_heads, c.n_kv_heads
        )));
    }
    for (i, op) in s.ops.iter().enumerate() {
        check_op(op, c.n_layers, c.capacity).map_err(|m| invalid(format!("op {i}: {m}")))?;
    }
    Ok(s)
}

fn check_op(op: &Op, n_layers: usize, capacity: usize) -> Result<(), String> {
    match op {
        Op::Step {
            pos,
            pos_range,
            tamper_layer,
            ..
        } => match (pos, pos_range) {
            (Some(_), Some(_)) => Err("step has both 'pos' and 'pos_range'".into()),
            (None, None) => Err("step needs 'pos' or 'pos_range'".into()),
            (Some(p), None) if p.len() > capacity => Err(format!(
                "step has {} tokens, more than the capacity {capacity}",
                p.len()
            )),
            (None, Some([a, b])) if i64::from(*b) - i64::from(*a) > capacity as i64 => Err(
                format!("pos_range [{a}, {b}] has more tokens than the capacity {capacity}"),
            ),
            _ if *tamper_layer >= n_layers => Err(format!(
                "tamper_layer {tamper_layer} is outside the {n_layers} layers"
            )),
            _ => Ok(()),
        },
        Op::Check {
            seq_len,
            can_extend,
            plan,
        } => {
            let n = seq_len.is_some() as u8 + can_extend.is_some() as u8 + plan.is_some() as u8;
            if n == 1 {
                Ok(())
            } else {
                Err("check needs exactly one of 'seq_len', 'can_extend', 'plan'".into())
            }
        }
        Op::Import {
            pos_range,
            from_export,
            ..
        } => match (pos_range, from_export) {
            (Some(_), true) | (None, false) => {
                Err("import needs exactly one of 'pos_range' and 'from_export'".into())
            }
            (Some([a, b]), _) if i64::from(*b) - i64::from(*a) > capacity as i64 || a > b => {
                Err(format!(
                    "import pos_range [{a}, {b}] is reversed or holds more rows than the capacity {capacity}"
                ))
            }
            _ => Ok(()),
        },
        Op::ExpectError { op, .. } => match **op {
            Op::Check { .. } | Op::ExpectError { .. } => {
                Err("expect_error cannot wrap check or expect_error".into())
            }
            ref inner => check_op(inner, n_layers, capacity),
        },
        _ => Ok(()),
    }
}

/// Loads every `*.json` in `dir`, sorted by file name; a directory without any is an error.
/// Only regular files of at most [`MAX_TEXT_BYTES`] are read.
pub fn load_dir(dir: &Path) -> Result<Vec<Scenario>, ScenarioError> {
    let io = |e: std::io::Error| FileError {
        path: dir.to_path_buf(),
        reason: e.to_string(),
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(FileError {
            path: dir.to_path_buf(),
            reason: "no *.json scenario files here".into(),
        }
        .into());
    }
    files
        .iter()
        .map(|p| parse(p, &read_text(p, MAX_TEXT_BYTES)?))
        .collect()
}

/// The built-in scenarios (`tests/scenarios/*.json`, embedded at build time).
pub fn builtin_scenarios() -> Vec<Scenario> {
    BUILTIN
        .iter()
        .map(|(name, text)| {
            parse(Path::new(name), text)
                .unwrap_or_else(|e| panic!("built-in scenario is invalid: {e}"))
        })
        .collect()
}

include!(concat!(env!("OUT_DIR"), "/builtin_scenarios.rs"));

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        parse(Path::new("x.json"), text).unwrap_err().to_string()
    }

    const HEAD: &str = r#""name": "n", "description": "d", "kinds": ["seq"], "seed": 1,
        "config": {"capacity": 8, "n_layers": 1, "n_kv_heads": 1, "n_q_heads": 2, "head_dim": 64}"#;

    #[test]
    fn builtin_scenarios_parse_and_have_unique_names() {
        let all = builtin_scenarios();
        assert!(all.len() >= 16);
        let mut names: Vec<&str> = all.iter().map(|s| s.name.as_str()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
    }

    #[test]
    fn unknown_ops_fields_and_malformed_files_are_clear_errors() {
        let e = err(&format!(r#"{{{HEAD}, "ops": [{{"op": "fork"}}]}}"#));
        assert!(e.starts_with("x.json: unknown variant `fork`"), "{e}");
        let e = err(&format!(
            r#"{{{HEAD}, "ops": [{{"op": "seq_keep", "seq": 1, "sq": 2}}]}}"#
        ));
        assert!(e.contains("unknown field `sq`"), "{e}");
        let e = err(&format!(r#"{{{HEAD}, "extra": 1, "ops": []}}"#));
        assert!(e.contains("unknown field `extra`"), "{e}");
        let e = err(&format!(r#"{{{HEAD}, "ops": [{{"op": "step"}}]}}"#));
        assert_eq!(e, "x.json: op 0: step needs 'pos' or 'pos_range'");
        let e = err(&format!(
            r#"{{{HEAD}, "ops": [{{"op": "expect_error", "error": "oops", "do": {{"op": "clear"}}}}]}}"#
        ));
        assert!(e.contains("unknown error kind 'oops'"), "{e}");
        let e = err(&format!(r#"{{{HEAD}, "ops": [{{"op": "check"}}]}}"#));
        assert!(e.contains("exactly one of"), "{e}");
        let e = err(r#"{"name": "n", "ops": [}"#);
        assert!(e.starts_with("x.json: expected value at line 1"), "{e}");
        let e = err(&format!(r#"{{{HEAD}, "dtypes": ["int3"], "ops": []}}"#));
        assert!(e.contains("unknown KV dtype 'int3'"), "{e}");
        let big = HEAD.replace("\"n_layers\": 1", "\"n_layers\": 1000000000");
        let e = err(&format!(r#"{{{big}, "ops": []}}"#));
        assert!(e.contains("n_layers = 1000000000 is above"), "{e}");
        let e = err(&format!(
            r#"{{{HEAD}, "ops": [{{"op": "step", "pos": [0], "tamper": "k_shape", "tamper_layer": 1}}]}}"#
        ));
        assert!(e.contains("tamper_layer 1 is outside the 1 layers"), "{e}");
    }

    #[test]
    fn load_dir_names_the_file() {
        let dir = std::env::temp_dir().join(format!("kvplug-scenarios-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("bad.json"), "{").unwrap();
        let e = load_dir(&dir).unwrap_err().to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(e.contains("bad.json"), "{e}");
    }
}

//! Session files: one sequence's K/V history in one safetensors file, loadable into any
//! backend and any cache kind.
//!
//! Layout (schema version 1, or 2 for keys in a basis other than identity: a kvplug that
//! knows no key bases refuses those files by version instead of misreading their keys):
//!
//! - `positions` (I32 `[n]`) and `tokens` (I32 `[n]`): the position and token id of each row.
//! - Per layer group: `g0`, the fully attending layers, with a row per position; `g1`, only
//!   in files of hybrid models, the sliding-window layers, with the rows of the window they
//!   keep (the positions from index `window_from` on). A group's K and V rows are in their
//!   storage dtype, `[layers, n_kv_heads, rows, ...]`, layers ascending. A hybrid model's
//!   delta-rule and short-convolution layers (`recurrent_layers`) have no rows: their state
//!   after the last row is `state` (F32 `[values]`, laid out as [`SeqRows::state`]; for a
//!   convolution layer, its input rows of the last `width - 1` positions). f32/f16/bf16 rows
//!   are `g0.k` / `g0.v` (`[.., head_dim]` in that dtype); q8/q4 rows are `g0.k.codes` (U8
//!   `[.., code_bytes]`: one byte per value, or two 4-bit values per byte, low nibble first)
//!   with `g0.k.scales` and `g0.k.los` (F16 `[.., groups]`), so a q4 file is about 0.31x an
//!   f16 one.
//! - Metadata under `kv_cache.`: `format` (`kvplug-session`), `schema_version`,
//!   `model_fingerprint` (see the `fingerprint` module), `model_name` (for listings only),
//!   `kv_dtype`, `key_basis` (`identity` or `hadamard`, see [`KeyBasis`]; a file without
//!   it is `identity`, as every earlier writer's was), `n_layers`, `n_kv_heads`,
//!   `head_dim`, `layer_groups` (`full`, then `sliding` with `sliding_layers`, the
//!   comma-separated layer indices of `g1`, and `window_from`, then `recurrent` with
//!   `recurrent_layers`, comma-separated), `tokens`, `writer`, and
//!   `checksum`: the BLAKE3 of the whole file with the checksum's own 64 hex digits written
//!   as `0`s. Applications add `app.*` entries (a chat keeps its messages there).
//!
//! Files are written atomically (temporary file, fsync, rename, fsync of the directory).
//! A reader refuses, with a [`SessionFileError`] and before anything touches a cache: another
//! format or schema version, any changed byte (checksum), tensors that disagree with the
//! metadata, another model, keys in another basis, more rows than the cache's capacity.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvplug_core::files::{open_regular, write_atomic_with, FileError};
use kvplug_core::limits::check_memory;
use kvplug_core::{KeyBasis, KvDtype};
use kvplug_plugin_api::abi_stable::std_types::RVec;
use kvplug_plugin_api::SeqRows;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

/// The `kv_cache.format` of a session file.
pub const FORMAT: &str = "kvplug-session";
/// The newest schema version: this build reads 1 and 2, and writes 2 only for rotated
/// keys (identity files stay version 1, readable by earlier builds).
pub const SCHEMA_VERSION: u32 = 2;
/// The file extension (`NAME.kvsession.safetensors`).
pub const EXTENSION: &str = "kvsession.safetensors";

const CHECKSUM_KEY: &str = "kv_cache.checksum";
const ZERO_SUM: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// One saved sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct Session {
    /// The K/V rows and their positions.
    pub rows: SeqRows,
    /// The token id of each row.
    pub tokens: Vec<i32>,
    /// The model's fingerprint.
    pub model: String,
    /// The basis of the key rows ([`Context::key_basis`](kvplug_runtime::Context::key_basis)
    /// of the context they came from).
    pub key_basis: KeyBasis,
    /// A readable name of the model (`fingerprint::model_name`), for listings;
    /// empty when unknown (files of earlier writers). Never checked.
    pub model_name: String,
    /// Application entries (`app.*` keys without the prefix).
    pub app: BTreeMap<String, String>,
}

/// Why a session file was refused. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum SessionFileError {
    /// Not readable or writable.
    #[error(transparent)]
    File(#[from] FileError),
    /// Not a session file this reader understands.
    #[error("{}: not a valid kvplug session file: {why}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// Written with another schema version.
    #[error("{}: session schema version {found}; this kvplug reads versions 1 to {SCHEMA_VERSION}", path.display())]
    Schema {
        /// The file.
        path: PathBuf,
        /// The file's version.
        found: String,
    },
    /// A byte changed since the file was written.
    #[error("{}: checksum mismatch: the file was damaged or modified after it was written", path.display())]
    Checksum {
        /// The file.
        path: PathBuf,
    },
    /// Saved with another model.
    #[error("{}: saved with another model (fingerprint {}…, this model {}…)", path.display(), &file[..12.min(file.len())], &model[..12.min(model.len())])]
    OtherModel {
        /// The file.
        path: PathBuf,
        /// The file's model fingerprint.
        file: String,
        /// The loaded model's.
        model: String,
    },
    /// K/V stored in another dtype than the context's.
    #[error("{}: K/V saved as {file}; this context stores {context}", path.display())]
    OtherDtype {
        /// The file.
        path: PathBuf,
        /// The file's dtype.
        file: String,
        /// The context's.
        context: KvDtype,
    },
    /// Keys saved in another basis than the context keeps (say, unrotated q4 keys for a
    /// context that rotates them).
    #[error("{}: keys saved in the {file} basis; this context keeps its keys in the {context} basis (q8/q4 keys are rotated unless --no-key-rotation; files written before kvplug rotated them hold identity keys)", path.display())]
    OtherKeyBasis {
        /// The file.
        path: PathBuf,
        /// The file's basis.
        file: KeyBasis,
        /// The context's.
        context: KeyBasis,
    },
    /// More rows than the cache holds.
    #[error("{}: {tokens} tokens do not fit a cache of capacity {capacity}", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Rows in the file.
        tokens: usize,
        /// The cache's capacity.
        capacity: usize,
    },
}

fn malformed(path: &Path, why: impl Into<String>) -> SessionFileError {
    SessionFileError::Malformed {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

/// `(code bytes, groups)` per row of a quantized dtype.
fn quant_layout(dtype: KvDtype, head_dim: usize) -> Option<(usize, usize)> {
    dtype
        .quant()
        .map(|(bits, group)| (head_dim * bits as usize / 8, head_dim / group))
}

fn float_dtype(dtype: KvDtype) -> Option<Dtype> {
    match dtype {
        KvDtype::F32 => Some(Dtype::F32),
        KvDtype::F16 => Some(Dtype::F16),
        KvDtype::Bf16 => Some(Dtype::BF16),
        _ => None,
    }
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A tensor's bytes, in pieces borrowed where they can be.
type Pieces<'a> = Vec<Cow<'a, [u8]>>;

/// The tensors of one K or V side of a layer group: `(name suffix, dtype, last dimension,
/// bytes in pieces)`; float rows are the layers' own bytes, borrowed.
fn split_side<'a>(
    layers: impl Iterator<Item = &'a RVec<u8>> + Clone,
    dtype: KvDtype,
    head_dim: usize,
) -> Vec<(&'static str, Dtype, usize, Pieces<'a>)> {
    match (float_dtype(dtype), quant_layout(dtype, head_dim)) {
        (Some(f), _) => vec![(
            "",
            f,
            head_dim,
            layers.map(|l| Cow::Borrowed(l.as_slice())).collect(),
        )],
        (None, Some((cb, groups))) => {
            let row = dtype.row_bytes(head_dim);
            let (mut codes, mut scales, mut los) = (Vec::new(), Vec::new(), Vec::new());
            for layer in layers {
                for r in layer.chunks_exact(row) {
                    codes.extend_from_slice(&r[..cb]);
                    for pair in r[cb..].chunks_exact(4).take(groups) {
                        scales.extend_from_slice(&pair[..2]);
                        los.extend_from_slice(&pair[2..]);
                    }
                }
            }
            let one = |v: Vec<u8>| vec![Cow::Owned(v)];
            vec![
                (".codes", Dtype::U8, cb, one(codes)),
                (".scales", Dtype::F16, groups, one(scales)),
                (".los", Dtype::F16, groups, one(los)),
            ]
        }
        (None, None) => unreachable!("every KV dtype is float or quantized"),
    }
}

/// A session file ready to write: the 8-byte length and the safetensors header (with the
/// checksum's digits zeroed at `checksum_at`), then the tensor data in pieces, most of them
/// borrowed from the session's rows.
struct Encoded<'a> {
    head: Vec<u8>,
    data: Pieces<'a>,
    checksum_at: usize,
}

impl Encoded<'_> {
    /// The file's checksum: the BLAKE3 of every byte with the checksum's digits zeroed.
    fn checksum(&self) -> blake3::Hash {
        let mut h = blake3::Hasher::new();
        h.update(&self.head);
        for piece in &self.data {
            h.update(piece);
        }
        h.finalize()
    }
}

/// The schema version of a file holding keys in `keys`' basis.
fn schema_for(keys: KeyBasis) -> u32 {
    match keys {
        KeyBasis::Identity => 1,
        KeyBasis::Hadamard => 2,
    }
}

/// Lays `s` out as a session file (safetensors: tensors in this order, data contiguous).
fn encode(s: &Session) -> Result<Encoded<'_>, String> {
    let r = &s.rows;
    let dtype: KvDtype = r.kv_dtype.parse().map_err(|e| format!("{e}"))?;
    let (l, h, d, n) = (
        r.n_layers as usize,
        r.n_kv_heads as usize,
        r.head_dim as usize,
        r.positions.len(),
    );
    if s.tokens.len() != n {
        return Err(format!("{} tokens for {n} rows", s.tokens.len()));
    }
    let mut meta: BTreeMap<String, String> = s
        .app
        .iter()
        .map(|(k, v)| (format!("app.{k}"), v.clone()))
        .collect();
    let (sliding, recurrent) = (&r.sliding_layers, &r.recurrent_layers);
    let list = |l: &RVec<u32>| l.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let mut layer_groups = vec!["full"];
    if !sliding.is_empty() {
        meta.insert("kv_cache.sliding_layers".into(), list(sliding));
        meta.insert("kv_cache.window_from".into(), r.window_from.to_string());
        layer_groups.push("sliding");
    }
    if !recurrent.is_empty() {
        meta.insert("kv_cache.recurrent_layers".into(), list(recurrent));
        layer_groups.push("recurrent");
    }
    for (k, v) in [
        ("format", FORMAT.to_string()),
        ("schema_version", schema_for(s.key_basis).to_string()),
        ("model_fingerprint", s.model.clone()),
        ("model_name", s.model_name.clone()),
        ("kv_dtype", dtype.to_string()),
        ("key_basis", s.key_basis.to_string()),
        ("n_layers", l.to_string()),
        ("n_kv_heads", h.to_string()),
        ("head_dim", d.to_string()),
        ("layer_groups", layer_groups.join(",")),
        ("tokens", n.to_string()),
        (
            "writer",
            concat!("kvplug ", env!("CARGO_PKG_VERSION")).to_string(),
        ),
        ("checksum", ZERO_SUM.to_string()),
    ] {
        meta.insert(format!("kv_cache.{k}"), v);
    }
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Pieces<'_>)> = vec![
        (
            "positions".into(),
            Dtype::I32,
            vec![n],
            vec![Cow::Owned(i32_bytes(&r.positions))],
        ),
        (
            "tokens".into(),
            Dtype::I32,
            vec![n],
            vec![Cow::Owned(i32_bytes(&s.tokens))],
        ),
    ];
    if !r.state.is_empty() {
        tensors.push((
            "state".into(),
            Dtype::F32,
            vec![r.state.len() / 4],
            vec![Cow::Borrowed(&r.state[..])],
        ));
    }
    let groups = [(false, n), (true, n.saturating_sub(r.window_from as usize))];
    for (g, (slides, rows)) in groups.into_iter().enumerate() {
        let members = (0..l).filter(|&i| {
            sliding.contains(&(i as u32)) == slides && !recurrent.contains(&(i as u32))
        });
        if slides && sliding.is_empty() {
            continue;
        }
        for (side, layers) in [("k", &r.k), ("v", &r.v)] {
            let of_group = members.clone().filter_map(|i| layers.get(i));
            let count = of_group.clone().count();
            for (suffix, dt, last, parts) in split_side(of_group, dtype, d) {
                tensors.push((
                    format!("g{g}.{side}{suffix}"),
                    dt,
                    vec![count, h, rows, last],
                    parts,
                ));
            }
        }
    }
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::to_value(&meta).map_err(|e| e.to_string())?,
    );
    let mut offset = 0usize;
    let mut data = Vec::new();
    for (name, dt, shape, parts) in tensors {
        let bytes: usize = parts.iter().map(|p| p.len()).sum();
        let want = shape.iter().product::<usize>() * dt.bitsize() / 8;
        if bytes != want {
            return Err(format!(
                "{name}: {bytes} bytes for shape {shape:?} of {dt:?}"
            ));
        }
        header.insert(
            name,
            serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
        data.extend(parts);
    }
    let mut json = serde_json::to_vec(&header).map_err(|e| e.to_string())?;
    // Padded with spaces to a multiple of 8, as safetensors aligns its data.
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut head = (json.len() as u64).to_le_bytes().to_vec();
    head.extend(json);
    let checksum_at = checksum_at(&head)?;
    Ok(Encoded {
        head,
        data,
        checksum_at,
    })
}

/// Serializes `s` (checksum included).
pub fn to_bytes(s: &Session) -> Result<Vec<u8>, String> {
    let e = encode(s)?;
    let sum = e.checksum().to_hex();
    let mut bytes = e.head.clone();
    for piece in &e.data {
        bytes.extend_from_slice(piece);
    }
    bytes[e.checksum_at..e.checksum_at + 64].copy_from_slice(sum.as_bytes());
    Ok(bytes)
}

/// Writes `s` to `path` atomically, streamed from the session's rows (no copy of the file
/// in memory); returns the bytes written.
pub fn write(path: &Path, s: &Session) -> Result<u64, SessionFileError> {
    use std::io::{Seek, SeekFrom, Write};
    let e = encode(s).map_err(|why| malformed(path, why))?;
    let sum = e.checksum().to_hex();
    let len = e.head.len() + e.data.iter().map(|p| p.len()).sum::<usize>();
    write_atomic_with(path, |f| {
        f.write_all(&e.head)?;
        for piece in &e.data {
            f.write_all(piece)?;
        }
        f.seek(SeekFrom::Start(e.checksum_at as u64))?;
        f.write_all(sum.as_bytes())
    })?;
    Ok(len as u64)
}

/// The offset of the checksum's 64 hex digits in the header; else what is wrong with its
/// entry (none, several, or a value that is not 64 hex digits).
fn checksum_at(bytes: &[u8]) -> Result<usize, String> {
    let header = bytes
        .get(..8)
        .and_then(|len| usize::try_from(u64::from_le_bytes(len.try_into().ok()?)).ok())
        .and_then(|len| bytes.get(8..8usize.checked_add(len)?))
        .ok_or("the header is cut short")?;
    let key = format!("\"{CHECKSUM_KEY}\":\"");
    let key = key.as_bytes();
    let mut hits = header
        .windows(key.len())
        .enumerate()
        .filter(|(_, w)| *w == key);
    let Some((first, _)) = hits.next() else {
        return Err(format!("the header holds no {CHECKSUM_KEY} entry"));
    };
    if hits.next().is_some() {
        return Err(format!(
            "the header holds more than one {CHECKSUM_KEY} entry"
        ));
    }
    let at = 8 + first + key.len();
    match bytes.get(at..at + 65) {
        Some([digits @ .., b'"']) if digits.iter().all(u8::is_ascii_hexdigit) => Ok(at),
        _ => Err(format!("its {CHECKSUM_KEY} value is not 64 hex digits")),
    }
}

/// Reads and checks a session file (format, schema, checksum, tensors against metadata).
/// The file is mapped, not copied; the rows are copied out once.
pub fn read(path: &Path) -> Result<Session, SessionFileError> {
    let (file, len) = open_regular(path)?;
    // The rows are copied out of the map once.
    check_memory(&format!("reading {}", path.display()), Some(len))
        .map_err(|e| malformed(path, e.message))?;
    // SAFETY: a read-only map; a file changed underneath fails the checksum or the parse
    // (writers replace session files by rename, never in place).
    // Populated up front: one pass of the kernel instead of a page fault per 4 KiB.
    let map =
        unsafe { memmap2::MmapOptions::new().populate().map(&file) }.map_err(|e| FileError {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    from_bytes(path, &map)
}

/// Parses and checks session bytes (see [`read`]); `path` names them in errors. The checksum
/// is verified on a second thread while the rows are copied out (a file that fails it is
/// refused as such, whatever the parse found).
pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Session, SessionFileError> {
    let at = checksum_at(bytes).map_err(|why| match SafeTensors::read_metadata(bytes) {
        // What a file that is no session at all (text, a truncated file) fails first.
        Err(e) => malformed(path, format!("its safetensors header does not parse ({e})")),
        Ok(_) => malformed(path, why),
    })?;
    let (sum_ok, parsed) = std::thread::scope(|scope| {
        let hashing = scope.spawn(|| {
            let mut h = blake3::Hasher::new();
            h.update(&bytes[..at]);
            h.update(ZERO_SUM.as_bytes());
            h.update(&bytes[at + 64..]);
            h.finalize().to_hex().as_bytes() == &bytes[at..at + 64]
        });
        let parsed = parse(path, bytes);
        (hashing.join().unwrap_or(false), parsed)
    });
    if !sum_ok {
        return Err(SessionFileError::Checksum {
            path: path.to_path_buf(),
        });
    }
    parsed
}

/// The session in checksummed `bytes` (see [`from_bytes`]).
fn parse(path: &Path, bytes: &[u8]) -> Result<Session, SessionFileError> {
    let (_, header) =
        SafeTensors::read_metadata(bytes).map_err(|e| malformed(path, e.to_string()))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let get = |k: &str| -> Result<&str, SessionFileError> {
        meta.get(&format!("kv_cache.{k}"))
            .map(String::as_str)
            .ok_or_else(|| malformed(path, format!("metadata kv_cache.{k} is missing")))
    };
    if get("format")? != FORMAT {
        return Err(malformed(path, format!("format is '{}'", get("format")?)));
    }
    let schema = get("schema_version")?;
    if !matches!(schema, "1" | "2") {
        return Err(SessionFileError::Schema {
            path: path.to_path_buf(),
            found: schema.to_string(),
        });
    }
    let (hybrid, recurrent) = match get("layer_groups")? {
        "full" => (false, false),
        "full,sliding" => (true, false),
        "full,recurrent" => (false, true),
        "full,sliding,recurrent" => (true, true),
        other => {
            return Err(malformed(
                path,
                format!("layer groups '{other}' need a newer kvplug"),
            ))
        }
    };
    let dtype: KvDtype = get("kv_dtype")?
        .parse()
        .map_err(|e| malformed(path, format!("kv_dtype: {e}")))?;
    let key_basis: KeyBasis = match meta.get("kv_cache.key_basis") {
        Some(b) => b
            .parse()
            .map_err(|e| malformed(path, format!("key_basis: {e}")))?,
        None => KeyBasis::Identity,
    };
    if schema != schema_for(key_basis).to_string() {
        return Err(malformed(
            path,
            format!("schema version {schema} with {key_basis} keys"),
        ));
    }
    let num = |k: &str| -> Result<usize, SessionFileError> {
        get(k)?
            .parse::<u32>()
            .map(|v| v as usize)
            .map_err(|e| malformed(path, format!("kv_cache.{k}: {e}")))
    };
    let (l, h, d, n) = (
        num("n_layers")?,
        num("n_kv_heads")?,
        num("head_dim")?,
        num("tokens")?,
    );
    dtype
        .check_head_dim(d)
        .map_err(|e| malformed(path, e.message))?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| malformed(path, e.to_string()))?;
    let tensor = |name: &str, dt: Dtype, shape: &[usize]| -> Result<&[u8], SessionFileError> {
        let t = st
            .tensor(name)
            .map_err(|_| malformed(path, format!("tensor {name} is missing")))?;
        if t.dtype() != dt || t.shape() != shape {
            return Err(malformed(
                path,
                format!(
                    "tensor {name} is {:?} {:?}, expected {dt:?} {shape:?}",
                    t.dtype(),
                    t.shape()
                ),
            ));
        }
        Ok(t.data())
    };
    let i32s = |b: &[u8]| -> Vec<i32> {
        b.chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let positions = i32s(tensor("positions", Dtype::I32, &[n])?);
    let tokens = i32s(tensor("tokens", Dtype::I32, &[n])?);
    if positions.iter().any(|&p| p < 0) || positions.windows(2).any(|w| w[0] > w[1]) {
        return Err(malformed(
            path,
            "positions must be non-negative and ascending",
        ));
    }
    let (sliding_layers, window_from) = if hybrid {
        let layers = get("sliding_layers")?
            .split(',')
            .map(|x| x.parse::<u32>().ok().filter(|&i| (i as usize) < l))
            .collect::<Option<Vec<u32>>>()
            .filter(|v| v.windows(2).all(|w| w[0] < w[1]))
            .ok_or_else(|| {
                malformed(
                    path,
                    format!("sliding_layers: ascending layer indices below {l} expected"),
                )
            })?;
        let from = num("window_from")?;
        if from > n {
            return Err(malformed(path, format!("window_from {from} > {n} rows")));
        }
        (layers, from)
    } else {
        (Vec::new(), 0)
    };
    let recurrent_layers: Vec<u32> = if recurrent {
        get("recurrent_layers")?
            .split(',')
            .map(|x| x.parse::<u32>().ok().filter(|&i| (i as usize) < l))
            .collect::<Option<Vec<u32>>>()
            .filter(|v| v.windows(2).all(|w| w[0] < w[1]))
            .filter(|v| v.iter().all(|i| !sliding_layers.contains(i)))
            .ok_or_else(|| {
                malformed(
                    path,
                    format!(
                        "recurrent_layers: ascending layer indices below {l}, none sliding, expected"
                    ),
                )
            })?
    } else {
        Vec::new()
    };
    let state: RVec<u8> = match (recurrent && n > 0, st.tensor("state")) {
        (false, _) => RVec::new(),
        (true, Ok(t)) if t.dtype() == Dtype::F32 && t.shape().len() == 1 => {
            RVec::from_slice(t.data())
        }
        (true, _) => {
            return Err(malformed(
                path,
                "a file with recurrent layers needs an F32 tensor state",
            ))
        }
    };
    let row = dtype.row_bytes(d);
    // Group `g`'s tensors of side `s` (`l` layers of `n` rows), split per layer.
    // Sizes are computed only once a tensor of that shape is known to exist in the file.
    let group =
        |g: usize, s: &str, l: usize, n: usize| -> Result<Vec<RVec<u8>>, SessionFileError> {
            match (float_dtype(dtype), quant_layout(dtype, d)) {
                (Some(f), _) => {
                    let all = tensor(&format!("g{g}.{s}"), f, &[l, h, n, d])?;
                    let layer_bytes = (h * n * row).max(1);
                    Ok((0..l)
                        .map(|i| {
                            RVec::from_slice(
                                all.get(i * layer_bytes..(i + 1) * layer_bytes)
                                    .unwrap_or(&[]),
                            )
                        })
                        .collect())
                }
                (None, Some((cb, groups))) => {
                    let codes = tensor(&format!("g{g}.{s}.codes"), Dtype::U8, &[l, h, n, cb])?;
                    let scales =
                        tensor(&format!("g{g}.{s}.scales"), Dtype::F16, &[l, h, n, groups])?;
                    let los = tensor(&format!("g{g}.{s}.los"), Dtype::F16, &[l, h, n, groups])?;
                    let mut layers: Vec<Vec<u8>> =
                        (0..l).map(|_| Vec::with_capacity(h * n * row)).collect();
                    for r in 0..l * h * n {
                        let layer = &mut layers[r / (h * n)];
                        layer.extend_from_slice(&codes[r * cb..(r + 1) * cb]);
                        for g in 0..groups {
                            let at = 2 * (r * groups + g);
                            layer.extend_from_slice(&scales[at..at + 2]);
                            layer.extend_from_slice(&los[at..at + 2]);
                        }
                    }
                    Ok(layers.into_iter().map(RVec::from).collect())
                }
                (None, None) => unreachable!("every KV dtype is float or quantized"),
            }
        };
    // Every layer's rows, in layer order.
    let side = |s: &str| -> Result<RVec<RVec<u8>>, SessionFileError> {
        let slides = |i: usize| sliding_layers.contains(&(i as u32));
        let recurs = |i: usize| recurrent_layers.contains(&(i as u32));
        let full_layers = l - sliding_layers.len() - recurrent_layers.len();
        let mut full = group(0, s, full_layers, n)?.into_iter();
        let mut window = match hybrid {
            true => group(1, s, sliding_layers.len(), n - window_from)?,
            false => Vec::new(),
        }
        .into_iter();
        Ok((0..l)
            .map(|i| {
                if recurs(i) {
                    Some(RVec::new())
                } else if slides(i) {
                    window.next()
                } else {
                    full.next()
                }
            })
            .map(Option::unwrap_or_default)
            .collect())
    };
    // K and V copied out at once (the copies are page faults more than bytes).
    let (k, v) = std::thread::scope(|scope| {
        let v = scope.spawn(|| side("v"));
        let k = side("k");
        (k, v.join())
    });
    let v = v.map_err(|_| malformed(path, "copying the V rows failed"))?;
    let rows = SeqRows {
        kv_dtype: dtype.to_string().into(),
        n_layers: l as u32,
        n_kv_heads: h as u32,
        head_dim: d as u32,
        positions: positions.into(),
        k: k?,
        v: v?,
        window_from: window_from as u32,
        sliding_layers: sliding_layers.into(),
        recurrent_layers: recurrent_layers.into(),
        state,
    };
    Ok(Session {
        rows,
        tokens,
        model: get("model_fingerprint")?.to_string(),
        key_basis,
        model_name: meta.get("kv_cache.model_name").cloned().unwrap_or_default(),
        app: meta
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("app.")?.to_string(), v.clone())))
            .collect(),
    })
}

/// What a session file's header says (not checked against the checksum; [`read`] does that).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Summary {
    /// Rows (tokens) held.
    pub tokens: usize,
    /// Storage dtype.
    pub kv_dtype: String,
    /// The basis of the key rows (`identity` when the writer did not record one).
    pub key_basis: String,
    /// The model's fingerprint.
    pub model: String,
    /// The model's readable name (empty when the writer did not record one).
    pub model_name: String,
    /// File size.
    pub bytes: u64,
    /// The writing kvplug.
    pub writer: String,
}

/// Reads only the header of a session file.
pub fn summary(path: &Path) -> Result<Summary, SessionFileError> {
    use std::io::Read;
    let (mut file, bytes) = open_regular(path)?;
    let io = |e: std::io::Error| FileError {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(io)?;
    let len = u64::from_le_bytes(len);
    // safetensors' own bound on a header.
    if len > 100 << 20 || len + 8 > bytes {
        return Err(malformed(path, format!("a header of {len} bytes")));
    }
    let mut header = vec![0; len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let json: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| malformed(path, e.to_string()))?;
    // The tensors' bytes end where the header says, or the file was cut short (a header
    // alone would list it whole).
    let end = json
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(_, t)| t["data_offsets"][1].as_u64())
        .max()
        .unwrap_or(0);
    let data_end = (8 + len).saturating_add(end);
    if data_end > bytes {
        return Err(malformed(
            path,
            format!("truncated: its tensors end at byte {data_end}, the file has {bytes}"),
        ));
    }
    let meta = &json["__metadata__"];
    let get = |k: &str| {
        meta[format!("kv_cache.{k}")]
            .as_str()
            .unwrap_or("?")
            .to_string()
    };
    if get("format") != FORMAT {
        return Err(malformed(path, "no kvplug session metadata"));
    }
    Ok(Summary {
        tokens: get("tokens").parse().unwrap_or(0),
        kv_dtype: get("kv_dtype"),
        key_basis: meta["kv_cache.key_basis"]
            .as_str()
            .unwrap_or(KeyBasis::Identity.as_str())
            .to_string(),
        model: get("model_fingerprint"),
        model_name: meta["kv_cache.model_name"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        bytes,
        writer: get("writer"),
    })
}

impl Session {
    /// Refuses a session whose rows are not at positions `0, 1, 2, …`: what a chat saves,
    /// and all a contiguous context resumes.
    pub fn check_conversation(&self, path: &Path) -> Result<(), SessionFileError> {
        let positions = self.rows.positions.iter();
        match positions
            .enumerate()
            .find(|&(i, &p)| i64::from(p) != i as i64)
        {
            None => Ok(()),
            Some((i, p)) => Err(malformed(
                path,
                format!("row {i} is at position {p}: a conversation's rows are at 0, 1, 2, …"),
            )),
        }
    }

    /// Refuses the session for a model with fingerprint `model` and a context of `kv_dtype`
    /// keeping keys in `key_basis` with `capacity` cells. (A cache's own import checks the
    /// dtype too, but not the basis: its rows do not say it. Check here first.)
    pub fn check_fits(
        &self,
        path: &Path,
        model: &str,
        kv_dtype: KvDtype,
        key_basis: KeyBasis,
        capacity: usize,
    ) -> Result<(), SessionFileError> {
        if self.model != model {
            return Err(SessionFileError::OtherModel {
                path: path.to_path_buf(),
                file: self.model.clone(),
                model: model.to_string(),
            });
        }
        if self.rows.kv_dtype.as_str() != kv_dtype.to_string() {
            return Err(SessionFileError::OtherDtype {
                path: path.to_path_buf(),
                file: self.rows.kv_dtype.to_string(),
                context: kv_dtype,
            });
        }
        if self.key_basis != key_basis {
            return Err(SessionFileError::OtherKeyBasis {
                path: path.to_path_buf(),
                file: self.key_basis,
                context: key_basis,
            });
        }
        if self.tokens.len() > capacity {
            return Err(SessionFileError::TooLarge {
                path: path.to_path_buf(),
                tokens: self.tokens.len(),
                capacity,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_that_is_no_session_says_what_it_is_not() {
        let why = |bytes: &[u8]| from_bytes(Path::new("s"), bytes).unwrap_err().to_string();
        for bytes in [&b"hello, world"[..], &[1, 0, 0, 0], &[]] {
            let e = why(bytes);
            assert!(e.contains("safetensors header does not parse"), "{e}");
        }
        let file = |meta: &str| {
            let header = format!(r#"{{"__metadata__":{{{meta}}}}}"#);
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(header.as_bytes());
            why(&bytes)
        };
        let e = file(r#""kv_cache.format":"x""#);
        assert!(e.contains("holds no kv_cache.checksum entry"), "{e}");
        let digits = "0".repeat(64);
        let e = file(&format!(
            r#""kv_cache.checksum":"{digits}","kv_cache.checksum":"{digits}""#
        ));
        assert!(e.contains("more than one kv_cache.checksum entry"), "{e}");
        for value in ["abc", &"g".repeat(64), &"0".repeat(65)] {
            let e = file(&format!(r#""kv_cache.checksum":"{value}""#));
            assert!(
                e.contains("kv_cache.checksum value is not 64 hex digits"),
                "{value}: {e}"
            );
        }
    }
}

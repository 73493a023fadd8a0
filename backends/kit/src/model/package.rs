//! A Hugging Face–style model directory: `config.json` plus `model.safetensors` or shards
//! listed in `model.safetensors.index.json`, memory-mapped; or `config.json` plus
//! [`gguf.json`](kvplug_core::gguf_index), whose tensors lie in a GGUF file mapped once and
//! used in place, quantized blocks included.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvplug_core::files::{inside, open_regular, read_text, FileError, MAX_TEXT_BYTES};
use kvplug_core::gguf_index::{GgufIndex, RopePairs, GGUF_INDEX_FILE, GGUF_INDEX_VERSION};
use kvplug_core::limits::available_memory;
use kvplug_core::metadata::{has_cache_params, read_cache_params};
use kvplug_core::ModelCacheParams;
use safetensors::{Dtype, SafeTensors};

use super::blocks::BlockFormat;
use super::config::{ModelConfig, ModelError};
use super::stored::{StoredDtype, StoredTensor};

/// Where the tensors lie.
enum Source {
    /// safetensors shards; tensor name → shard index.
    Safetensors {
        shards: Vec<Arc<memmap2::Mmap>>,
        index: HashMap<String, usize>,
    },
    /// One GGUF file and its manifest.
    Gguf {
        map: Arc<memmap2::Mmap>,
        index: GgufIndex,
    },
}

/// An opened model package.
pub struct ModelPackage {
    /// The parsed configuration.
    pub config: ModelConfig,
    dir: PathBuf,
    source: Source,
    /// `kv_cache.*` facts from the first shard's header, when present.
    metadata_params: Option<ModelCacheParams>,
}

/// How a package's weight bytes are held in memory (llama.cpp's `--mmap` / `--no-mmap`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Residency {
    /// The files mapped: pages read on first touch, shared with the page cache and with
    /// other processes mapping the same file, dropped and re-read under memory pressure.
    #[default]
    Mapped,
    /// The files read once, at open, into anonymous memory advised for transparent huge
    /// pages (Linux, where THP is `always` or `madvise`): a read of the whole file up front
    /// and no sharing across processes, for fewer TLB misses while every decode step streams
    /// the weights (Qwen2.5-0.5B Q4_K_M on the cpu backend: 6–9% more tokens/s at 4096 tokens
    /// of context). A file larger than the memory available is refused before any is read.
    Loaded,
}

impl Residency {
    /// `true` for [`Residency::Mapped`], as the `mmap` option spells it.
    pub fn from_mmap(mmap: bool) -> Self {
        if mmap {
            Residency::Mapped
        } else {
            Residency::Loaded
        }
    }
}

fn map_file(path: &Path, residency: Residency) -> Result<memmap2::Mmap, ModelError> {
    hold_file(path, residency, available_memory())
}

/// [`map_file`] where `available` bytes of memory are free (`None`: unknown).
fn hold_file(
    path: &Path,
    residency: Residency,
    available: Option<u64>,
) -> Result<memmap2::Mmap, ModelError> {
    let (mut file, len) = open_regular(path)?;
    let fail = |what: &str, e: std::io::Error| -> ModelError {
        FileError {
            path: path.to_path_buf(),
            reason: format!("cannot {what}: {e}"),
        }
        .into()
    };
    match residency {
        // SAFETY: the mapping is read-only; a package modified while loaded is a user error
        // that at worst yields wrong weights, as with any reader.
        Residency::Mapped => unsafe { memmap2::Mmap::map(&file) }.map_err(|e| fail("map", e)),
        Residency::Loaded => {
            let refuse = |why: String| -> ModelError {
                FileError {
                    path: path.to_path_buf(),
                    reason: format!(
                        "cannot load {len} bytes into memory: {why} (map the file instead: \
                         drop --no-mmap)"
                    ),
                }
                .into()
            };
            if let Some(avail) = available.filter(|&a| len > a) {
                return Err(refuse(format!("{avail} are available")));
            }
            let len = usize::try_from(len)
                .map_err(|_| refuse("more than this machine addresses".into()))?;
            let mut buf = memmap2::MmapOptions::new()
                .len(len)
                .map_anon()
                .map_err(|e| fail("load", e))?;
            // Advice only: without THP the bytes are the same on 4 KiB pages.
            #[cfg(target_os = "linux")]
            if let Err(e) = buf.advise(memmap2::Advice::HugePage) {
                tracing::debug!(path = %path.display(), "no huge pages for the weights: {e}");
            }
            std::io::Read::read_exact(&mut file, &mut buf).map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => {
                    fail("load", std::io::Error::other("it shrank while it was read"))
                }
                _ => fail("load", e),
            })?;
            buf.make_read_only().map_err(|e| fail("load", e))
        }
    }
}

/// The stored dtype named `name` in a [`GgufIndex`].
fn dtype_named(name: &str) -> Option<StoredDtype> {
    match name {
        "f32" => Some(StoredDtype::F32),
        "f16" => Some(StoredDtype::F16),
        "bf16" => Some(StoredDtype::BF16),
        other => BlockFormat::from_name(other).map(StoredDtype::Block),
    }
}

fn json(path: &Path) -> Result<serde_json::Value, ModelError> {
    serde_json::from_str(&read_text(path, MAX_TEXT_BYTES)?)
        .map_err(|e| ModelError::Malformed(format!("{}: {e}", path.display())))
}

impl ModelPackage {
    /// Opens `dir`, parsing the config and every shard header (or the GGUF manifest), its
    /// files mapped.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        Self::open_with(dir, Residency::Mapped)
    }

    /// [`ModelPackage::open`] with the weight files held as `residency` says.
    pub fn open_with(dir: &Path, residency: Residency) -> Result<Self, ModelError> {
        let cfg_path = dir.join("config.json");
        let config = ModelConfig::parse(&read_text(&cfg_path, MAX_TEXT_BYTES)?)
            .map_err(|e| ModelError::Malformed(format!("{}: {e}", cfg_path.display())))?;
        let gguf = dir.join(GGUF_INDEX_FILE);
        let (source, metadata_params) = if gguf.exists() {
            (Self::open_gguf(&gguf, residency)?, None)
        } else {
            Self::open_safetensors(dir, residency)?
        };
        let pkg = ModelPackage {
            config,
            dir: dir.to_path_buf(),
            source,
            metadata_params,
        };
        let derived = pkg.config.cache_params();
        if let Some(m) = pkg.metadata_params {
            if m != derived {
                return Err(ModelError::Malformed(format!(
                    "kv_cache metadata {m:?} disagrees with config.json {derived:?}"
                )));
            }
        }
        Ok(pkg)
    }

    /// Reads the manifest at `path` and maps (or loads) its GGUF, checking every tensor lies
    /// inside.
    fn open_gguf(path: &Path, residency: Residency) -> Result<Source, ModelError> {
        let index: GgufIndex = serde_json::from_str(&read_text(path, MAX_TEXT_BYTES)?)
            .map_err(|e| ModelError::Malformed(format!("{}: {e}", path.display())))?;
        if index.version != GGUF_INDEX_VERSION {
            return Err(ModelError::Malformed(format!(
                "{}: version {} (this build reads {GGUF_INDEX_VERSION}); delete the directory \
                 to re-index the GGUF",
                path.display(),
                index.version
            )));
        }
        let map = map_file(&index.file, residency)?;
        if map.len() as u64 != index.file_bytes {
            return Err(ModelError::Malformed(format!(
                "{} is {} bytes but was indexed at {}: it changed since; delete {} to re-index",
                index.file.display(),
                map.len(),
                index.file_bytes,
                path.display()
            )));
        }
        for (name, t) in &index.tensors {
            let dtype = dtype_named(&t.dtype).ok_or_else(|| {
                ModelError::Malformed(format!(
                    "tensor '{name}' has type {}, which kvplug cannot compute (supported: f32, \
                     f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K, q6_K, mxfp4)",
                    t.dtype
                ))
            })?;
            let elems = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let want = elems.and_then(|n| {
                (n % dtype.unit_elems() == 0).then(|| n / dtype.unit_elems() * dtype.unit_bytes())
            });
            let end = t.offset.checked_add(t.bytes);
            if want != Some(t.bytes as usize) || end.is_none_or(|e| e > index.file_bytes) {
                return Err(ModelError::Malformed(format!(
                    "tensor '{name}' ({} {:?}, {} bytes at {}) does not fit its type or the file",
                    t.dtype, t.shape, t.bytes, t.offset
                )));
            }
        }
        Ok(Source::Gguf {
            map: Arc::new(map),
            index,
        })
    }

    fn open_safetensors(
        dir: &Path,
        residency: Residency,
    ) -> Result<(Source, Option<ModelCacheParams>), ModelError> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index_path.exists() {
            let v = json(&index_path)?;
            let map = v["weight_map"].as_object().ok_or_else(|| {
                ModelError::Malformed(format!("{}: no weight_map", index_path.display()))
            })?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(String::from))
                .collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec!["model.safetensors".to_string()]
        };
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        let mut metadata_params = None;
        for (i, f) in files.iter().enumerate() {
            let path = inside(dir, f)?;
            let map = map_file(&path, residency)?;
            let (_, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
                ModelError::Malformed(format!("{}: not a safetensors file: {e}", path.display()))
            })?;
            if i == 0 {
                if let Some(m) = meta.metadata() {
                    if has_cache_params(m) {
                        metadata_params = Some(read_cache_params(m).map_err(|e| {
                            ModelError::Malformed(format!("{}: {e}", path.display()))
                        })?);
                    }
                }
            }
            for name in SafeTensors::deserialize(&map)
                .map_err(|e| ModelError::Malformed(format!("{}: {e}", path.display())))?
                .names()
            {
                index.insert(name.to_string(), i);
            }
            shards.push(Arc::new(map));
        }
        Ok((Source::Safetensors { shards, index }, metadata_params))
    }

    /// How q/k rows pair their rotary halves (interleaved for Llama GGUFs).
    pub fn rope_pairs(&self) -> RopePairs {
        match &self.source {
            Source::Gguf { index, .. } => index.rope_pairs,
            Source::Safetensors { .. } => RopePairs::Halves,
        }
    }

    /// Whether stored RMSNorm weights already include Gemma's `+ 1`.
    pub fn norms_plus_one(&self) -> bool {
        matches!(&self.source, Source::Gguf { index, .. } if index.norms_plus_one)
    }

    /// The cache shape: from `kv_cache.*` metadata when present, else derived from the
    /// config (the two are checked to agree at open).
    pub fn cache_params(&self) -> ModelCacheParams {
        self.metadata_params
            .unwrap_or_else(|| self.config.cache_params())
    }

    /// Whether the package carried `kv_cache.*` metadata.
    pub fn has_cache_metadata(&self) -> bool {
        self.metadata_params.is_some()
    }

    /// Tensor `name` in its stored dtype (f32, f16, bf16 or a block format), sharing the
    /// mapped file (no copy), checked against `shape`.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<StoredTensor, ModelError> {
        let missing =
            || ModelError::Malformed(format!("{}: missing tensor '{name}'", self.dir.display()));
        let (dtype, owner, range, got): (_, Arc<dyn AsRef<[u8]> + Send + Sync>, _, Vec<usize>) =
            match &self.source {
                Source::Safetensors { shards, index } => {
                    let map = &shards[*index.get(name).ok_or_else(missing)?];
                    let st = SafeTensors::deserialize(map)
                        .map_err(|e| ModelError::Malformed(e.to_string()))?;
                    let view = st
                        .tensor(name)
                        .map_err(|e| ModelError::Malformed(format!("{name}: {e}")))?;
                    let dtype = match view.dtype() {
                        Dtype::F32 => StoredDtype::F32,
                        Dtype::F16 => StoredDtype::F16,
                        Dtype::BF16 => StoredDtype::BF16,
                        other => {
                            return Err(ModelError::Malformed(format!(
                                "tensor '{name}' is {other:?}; weights must be f32, f16 or bf16"
                            )))
                        }
                    };
                    let start = view.data().as_ptr() as usize - map.as_ptr() as usize;
                    let range = start..start + view.data().len();
                    (dtype, map.clone(), range, view.shape().to_vec())
                }
                Source::Gguf { map, index } => {
                    let t = index.tensors.get(name).ok_or_else(missing)?;
                    let dtype = dtype_named(&t.dtype).expect("checked at open");
                    let range = t.offset as usize..(t.offset + t.bytes) as usize;
                    (dtype, map.clone(), range, t.shape.clone())
                }
            };
        if got != shape {
            return Err(ModelError::Malformed(format!(
                "{} has shape {got:?}, expected {shape:?}",
                self.label(name)
            )));
        }
        let t = StoredTensor::new(dtype, owner, range).ok_or_else(|| {
            ModelError::Malformed(format!("{}: partial elements", self.label(name)))
        })?;
        if let Some(i) = t.first_non_finite() {
            return Err(ModelError::Malformed(format!(
                "{} has a NaN or infinite value at element {i}",
                self.label(name)
            )));
        }
        Ok(t)
    }

    /// Tensor `name` as errors give it: as the file holds it (a GGUF's own name and path).
    fn label(&self, name: &str) -> String {
        match &self.source {
            Source::Gguf { index, .. } => match index.tensors.get(name) {
                Some(t) if !t.gguf_name.is_empty() => {
                    format!("{}: tensor '{}'", index.file.display(), t.gguf_name)
                }
                _ => format!("tensor '{name}'"),
            },
            Source::Safetensors { .. } => format!("tensor '{name}'"),
        }
    }

    /// Whether the package holds tensor `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        match &self.source {
            Source::Safetensors { index, .. } => index.contains_key(name),
            Source::Gguf { index, .. } => index.tensors.contains_key(name),
        }
    }

    /// Tensor `name` widened to f32 (norms, biases, references), checked against `shape`.
    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        Ok(self.tensor(name, shape)?.to_f32())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    #[test]
    fn a_file_is_loaded_byte_for_byte_or_refused_when_memory_is_short() {
        let dir = std::env::temp_dir().join(format!("kvplug-hold-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.bin");
        let bytes: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        for residency in [Residency::Mapped, Residency::Loaded] {
            let held = hold_file(&path, residency, Some(1 << 20)).unwrap();
            assert_eq!(&held[..], &bytes[..], "{residency:?}");
        }
        let e = hold_file(&path, Residency::Loaded, Some(4999))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot load 5000 bytes into memory: 4999 are available")
                && e.contains("drop --no-mmap"),
            "{e}"
        );
        // Mapping reads nothing up front, so it is not refused.
        assert!(hold_file(&path, Residency::Mapped, Some(4999)).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    const CONFIG: &str = r#"{"model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
        "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": 4}"#;

    fn write(
        path: &Path,
        tensors: &[(&str, Vec<f32>, Vec<usize>)],
        meta: Option<HashMap<String, String>>,
    ) {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, d, _)| d.iter().flat_map(|v| v.to_le_bytes()).collect())
            .collect();
        let views: Vec<(&str, TensorView<'_>)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((n, _, s), b)| (*n, TensorView::new(Dtype::F32, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, meta, path).unwrap();
    }

    #[test]
    fn sharded_packages_and_metadata() {
        let dir = std::env::temp_dir().join(format!("kvplug-pkg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), CONFIG).unwrap();
        let mut meta = HashMap::new();
        kvplug_core::metadata::write_cache_params(
            &ModelCacheParams {
                n_layers: 1,
                n_kv_heads: 1,
                head_dim: 4,
            },
            &mut meta,
        );
        write(
            &dir.join("a.safetensors"),
            &[("x", vec![1.0, 2.0], vec![2])],
            Some(meta),
        );
        write(
            &dir.join("b.safetensors"),
            &[("y", vec![3.0; 6], vec![2, 3])],
            None,
        );
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            r#"{"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}"#,
        )
        .unwrap();
        let pkg = ModelPackage::open(&dir).unwrap();
        assert!(pkg.has_cache_metadata());
        assert_eq!(pkg.cache_params().head_dim, 4);
        assert_eq!(pkg.tensor_f32("x", &[2]).unwrap(), vec![1.0, 2.0]);
        assert_eq!(pkg.tensor_f32("y", &[2, 3]).unwrap(), vec![3.0; 6]);
        let e = pkg.tensor_f32("y", &[6]).unwrap_err().to_string();
        assert!(e.contains("has shape [2, 3], expected [6]"), "{e}");
        assert!(pkg
            .tensor_f32("z", &[1])
            .unwrap_err()
            .to_string()
            .contains("missing tensor 'z'"));

        // Metadata that disagrees with config.json, and a file that is not safetensors.
        let mut bad = HashMap::new();
        kvplug_core::metadata::write_cache_params(
            &ModelCacheParams {
                n_layers: 3,
                n_kv_heads: 1,
                head_dim: 4,
            },
            &mut bad,
        );
        write(
            &dir.join("a.safetensors"),
            &[("x", vec![1.0, 2.0], vec![2])],
            Some(bad),
        );
        let e = ModelPackage::open(&dir).err().unwrap().to_string();
        assert!(e.contains("disagrees with config.json"), "{e}");
        std::fs::write(dir.join("a.safetensors"), b"not a model").unwrap();
        let e = ModelPackage::open(&dir).err().unwrap().to_string();
        assert!(e.contains("not a safetensors file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

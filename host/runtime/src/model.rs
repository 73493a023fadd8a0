//! [`Model`]: a model directory read once for one backend.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvplug_core::files::{read_text, MAX_TEXT_BYTES};
use kvplug_core::key_basis::rotation_width;
use kvplug_core::{
    make_config, Arithmetic, CacheConfig, CacheKind, KeyBasis, KvDtype, ModelConfig, ModelError,
};

use crate::context::Context;
use crate::error::RuntimeError;
use crate::runtime::Runtime;

/// The option naming the model directory (as the kit reads it).
const OPTION_MODEL_DIR: &str = "model_dir";
/// The option limiting a model to its first N layers.
const OPTION_LAYERS: &str = "layers";
/// The option naming the basis the forward pass writes keys in.
const OPTION_KEY_BASIS: &str = "key_basis";
/// The option saying whether the backend maps the weight files (`true` when absent).
const OPTION_MMAP: &str = "mmap";

/// A model on a backend: its directory (a Hugging Face–style package, or a GGUF's index)
/// and its `config.json`, parsed once by core's parser, the one the kit builds the forward
/// pass with. Cheap to clone. The backend maps the weights (or reads them:
/// [`Model::with_mmap`]) once, when the first context binds them, and shares them with every
/// later context and every layer view.
#[derive(Clone)]
pub struct Model {
    runtime: Runtime,
    backend: String,
    dir: PathBuf,
    config: Arc<ModelConfig>,
    /// Layers this view runs (all, or the first N of a draft view).
    layers: usize,
    /// Whether contexts with quantized keys rotate them ([`KeyBasis::default_for`]).
    rotate_quantized_keys: bool,
    /// Whether the backend maps the weight files (else it reads them into memory).
    mmap: bool,
    /// The attention arithmetic its contexts compute with (none: each cache's default).
    attention: Option<Arithmetic>,
}

/// A `config.json` fault of the model in `dir`, naming the file it came from (the GGUF, for
/// a GGUF's metadata).
fn config_error(dir: &Path, reason: ModelError) -> RuntimeError {
    RuntimeError::Model {
        path: kvplug_core::gguf_index::config_source(dir),
        reason,
    }
}

impl Model {
    pub(crate) fn open(runtime: Runtime, backend: &str, dir: &Path) -> Result<Self, RuntimeError> {
        let text = read_text(&dir.join("config.json"), MAX_TEXT_BYTES)?;
        let config = ModelConfig::parse(&text).map_err(|reason| config_error(dir, reason))?;
        Ok(Model {
            runtime,
            backend: backend.to_string(),
            dir: dir.to_path_buf(),
            layers: config.num_hidden_layers,
            config: Arc::new(config),
            rotate_quantized_keys: true,
            mmap: true,
            attention: None,
        })
    }

    /// The runtime it came from (for another model on the same plugins).
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// The backend it runs on.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its parsed `config.json`.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Logits per row.
    pub fn vocab(&self) -> usize {
        self.config.vocab_size
    }

    /// Layers this view runs.
    pub fn n_layers(&self) -> usize {
        self.layers
    }

    /// What the model was opened from, to name in messages: the GGUF file for a GGUF's
    /// index directory ([`Model::dir`] is then in the cache), else the directory.
    pub fn source(&self) -> PathBuf {
        kvplug_core::gguf_index::model_source(&self.dir)
    }

    /// The view of its first `n` layers (a draft that shares the weights, no copy).
    pub fn layers(&self, n: usize) -> Result<Model, RuntimeError> {
        let all = self.config.num_hidden_layers;
        if n == 0 || n > all {
            return Err(RuntimeError::Model {
                path: self.source(),
                reason: ModelError::Malformed(format!(
                    "a view of {n} layers: the model has {all} (give 1..={all})"
                )),
            });
        }
        Ok(Model {
            layers: n,
            ..self.clone()
        })
    }

    /// The same model whose contexts keep quantized keys unrotated when `on` is false (the
    /// default rotates them: see [`KeyBasis`]). For measuring what the rotation buys.
    pub fn with_key_rotation(&self, on: bool) -> Model {
        Model {
            rotate_quantized_keys: on,
            ..self.clone()
        }
    }

    /// The same model whose weight files the backend reads into memory when `mmap` is false
    /// (llama.cpp's `--no-mmap`): on Linux into anonymous memory on transparent huge pages,
    /// which a cpu decode step streams with fewer TLB misses; the whole file is read when the
    /// first context binds it and the pages are not shared with other processes. The default
    /// maps the files. Contexts of either kind share one copy per kind.
    pub fn with_mmap(&self, mmap: bool) -> Model {
        Model {
            mmap,
            ..self.clone()
        }
    }

    /// The same model whose contexts compute attention in `arithmetic` (`None`: the cache's
    /// default, see [`crate::Cache::arithmetic`]). A context whose cache does not declare it
    /// for its KV dtype is refused (`not_supported`).
    pub fn with_attention(&self, arithmetic: Option<Arithmetic>) -> Model {
        Model {
            attention: arithmetic,
            ..self.clone()
        }
    }

    /// The attention arithmetic its contexts are set to (see [`Model::with_attention`]).
    pub fn attention(&self) -> Option<Arithmetic> {
        self.attention
    }

    /// Whether contexts with quantized keys rotate them (see [`Model::with_key_rotation`]).
    pub fn key_rotation(&self) -> bool {
        self.rotate_quantized_keys
    }

    /// Whether the backend maps the weight files (see [`Model::with_mmap`]).
    pub fn mmap(&self) -> bool {
        self.mmap
    }

    /// The basis this view's contexts write keys of `kv_dtype` in (identity where a head's
    /// width has no power-of-two factor to rotate).
    pub fn key_basis(&self, kv_dtype: KvDtype) -> KeyBasis {
        let rotatable = rotation_width(self.config.head_dim()) > 1;
        if self.rotate_quantized_keys && rotatable {
            KeyBasis::default_for(kv_dtype)
        } else {
            KeyBasis::Identity
        }
    }

    /// The cache configuration this view needs at `capacity` cells of `kv_dtype`: its
    /// layers' shape, sliding and convolution layers, validated.
    pub fn cache_config(
        &self,
        capacity: usize,
        kv_dtype: KvDtype,
    ) -> Result<CacheConfig, RuntimeError> {
        let mut params = self.config.cache_params();
        params.n_layers = self.layers;
        let mut cfg = make_config(&params, capacity, kv_dtype);
        cfg.sliding = self
            .config
            .sliding(self.layers)
            .map_err(|reason| config_error(&self.dir, reason))?;
        cfg.conv = self
            .config
            .conv(self.layers)
            .map_err(|reason| config_error(&self.dir, reason))?;
        cfg.delta = self
            .config
            .delta(self.layers)
            .map_err(|reason| config_error(&self.dir, reason))?;
        cfg.ssm = self
            .config
            .ssm(self.layers)
            .map_err(|reason| config_error(&self.dir, reason))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// A context: a new `kind` cache of `capacity` cells in `kv_dtype`, bound to this view's
    /// `forward` inside the backend, writing keys in [`Model::key_basis`] and attending in
    /// [`Model::attention`].
    pub fn context(
        &self,
        kind: CacheKind,
        capacity: usize,
        kv_dtype: KvDtype,
    ) -> Result<Context, RuntimeError> {
        self.context_with(kind, &self.cache_config(capacity, kv_dtype)?)
    }

    /// A context on a cache made from `cfg` as given (the plugin refuses a configuration
    /// this view cannot use: another shape, other sliding layers).
    pub fn context_with(
        &self,
        kind: CacheKind,
        cfg: &CacheConfig,
    ) -> Result<Context, RuntimeError> {
        let cache = self.runtime.cache(&self.backend, kind, cfg)?;
        if let Some(arithmetic) = self.attention {
            cache.set_arithmetic(arithmetic)?;
        }
        let keys = self.key_basis(cfg.kv_dtype);
        let mut options = vec![(OPTION_MODEL_DIR, self.dir.display().to_string())];
        if self.layers != self.config.num_hidden_layers {
            options.push((OPTION_LAYERS, self.layers.to_string()));
        }
        if keys != KeyBasis::Identity {
            options.push((OPTION_KEY_BASIS, keys.to_string()));
        }
        if !self.mmap {
            options.push((OPTION_MMAP, false.to_string()));
        }
        let method = self
            .runtime
            .load_method(&self.backend, "forward", &cache, &options)?;
        Ok(Context::new(
            cache,
            method,
            self.vocab(),
            cfg.kv_dtype,
            keys,
        ))
    }
}

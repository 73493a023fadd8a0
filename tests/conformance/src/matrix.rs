//! The conformance matrix over a runtime's loaded backends (`kvplug conform`), their caches
//! made through [`Runtime::cache`].

use std::any::Any;

use kvplug_core::{CacheConfig, CacheKind, KvDtype};
use kvplug_plugin_api::{CacheHandle, PluginError};
use kvplug_runtime::{LoadedPlugin, Runtime, RuntimeError};

use crate::{run_case, CacheFactory, Inputs, Matrix, Scenario};

/// The environment variable naming backends that must be loaded (comma-separated).
pub const REQUIRE_BACKENDS_ENV: &str = "KVPLUG_REQUIRE_BACKENDS";

/// Builds caches on one backend through [`Runtime::cache`].
pub struct RuntimeFactory<'a> {
    runtime: &'a Runtime,
    plugin: &'a LoadedPlugin,
}

impl<'a> RuntimeFactory<'a> {
    /// A factory for `plugin`'s backend.
    pub fn new(runtime: &'a Runtime, plugin: &'a LoadedPlugin) -> Self {
        RuntimeFactory { runtime, plugin }
    }

    /// KV dtypes the backend reports.
    pub fn dtypes(&self) -> Vec<KvDtype> {
        self.plugin
            .description()
            .kv_dtypes
            .iter()
            .filter_map(|d| d.parse().ok())
            .collect()
    }
}

impl CacheFactory for RuntimeFactory<'_> {
    fn backend(&self) -> &str {
        &self.plugin.backend_id
    }

    fn applicable(&self, kind: CacheKind, dtype: KvDtype) -> Result<(), String> {
        if !self.plugin.kinds.iter().any(|k| k == kind.as_str()) {
            return Err(format!(
                "backend has no '{kind}' cache (it has: {})",
                self.plugin.kinds.join(", ")
            ));
        }
        if !self.dtypes().iter().any(|d| d.family() == dtype.family()) {
            return Err(format!(
                "backend has no {dtype} pools (it has: {})",
                self.plugin.description().kv_dtypes.join(", ")
            ));
        }
        Ok(())
    }

    fn build(
        &self,
        kind: CacheKind,
        cfg: &CacheConfig,
    ) -> Result<(CacheHandle, Box<dyn Any>), PluginError> {
        match self.runtime.cache(&self.plugin.backend_id, kind, cfg) {
            Ok(cache) => Ok((cache.handle().clone(), Box::new(cache))),
            Err(RuntimeError::Plugin(e)) => Err(e),
            Err(e) => Err(PluginError::new(
                kvplug_plugin_api::AbiErrorKind::NotFound,
                e.to_string(),
            )),
        }
    }
}

/// What to run.
#[derive(Clone, Debug, Default)]
pub struct ConformOptions {
    /// Backends (empty = every loaded one).
    pub backends: Vec<String>,
    /// Kinds (empty = each scenario's).
    pub kinds: Vec<CacheKind>,
    /// KV dtypes (empty = each scenario's, else all the backend supports).
    pub dtypes: Vec<KvDtype>,
    /// Input distributions (empty = each scenario's, else both).
    pub inputs: Vec<Inputs>,
    /// Backends that must be loaded.
    pub required: Vec<String>,
}

/// Runs every scenario × selected backend × kind × dtype.
pub fn run_matrix(runtime: &Runtime, scenarios: &[Scenario], opts: &ConformOptions) -> Matrix {
    let mut matrix = Matrix::default();
    let loaded = runtime.backend_ids();
    let wanted: Vec<String> = if opts.backends.is_empty() {
        loaded.clone()
    } else {
        opts.backends.clone()
    };
    matrix.missing_backends = opts
        .required
        .iter()
        .chain(&opts.backends)
        .filter(|b| !loaded.contains(b))
        .cloned()
        .collect();
    matrix.missing_backends.dedup();
    for plugin in runtime
        .plugins()
        .iter()
        .filter(|p| wanted.contains(&p.backend_id))
    {
        let factory = RuntimeFactory::new(runtime, plugin);
        if factory.dtypes().is_empty() {
            matrix.unusable_backends.push((
                plugin.backend_id.clone(),
                plugin.description().device.clone(),
            ));
            continue;
        }
        for scenario in scenarios {
            let allowed = scenario.dtypes.clone().unwrap_or_else(|| factory.dtypes());
            // Asked-for dtypes run exactly as given (q8g16 is not q8), where the scenario
            // allows their family.
            let dtypes: Vec<KvDtype> = if opts.dtypes.is_empty() {
                allowed
            } else {
                opts.dtypes
                    .iter()
                    .copied()
                    .filter(|d| allowed.iter().any(|a| a.family() == d.family()))
                    .collect()
            };
            let inputs = scenario.inputs.clone().unwrap_or(Inputs::ALL.to_vec());
            for &kind in scenario
                .kinds
                .iter()
                .filter(|k| opts.kinds.is_empty() || opts.kinds.contains(k))
            {
                for &dtype in &dtypes {
                    for &input in inputs
                        .iter()
                        .filter(|i| opts.inputs.is_empty() || opts.inputs.contains(i))
                    {
                        matrix
                            .results
                            .extend(run_case(scenario, kind, dtype, input, &factory));
                    }
                }
            }
        }
    }
    matrix
}

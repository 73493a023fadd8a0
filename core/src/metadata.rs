//! The versioned `kv_cache.*` metadata schema, over a string map (the shape of a
//! safetensors `__metadata__` header).
//!
//! Only architecture facts are stored; capacity and KV dtype are runtime policy.

use std::collections::{BTreeMap, HashMap};

use crate::config::ModelCacheParams;

/// The schema version this crate writes and the only one it reads.
pub const SCHEMA_VERSION: u32 = 1;
/// Key of the schema version.
pub const KEY_SCHEMA_VERSION: &str = "kv_cache.schema_version";
/// Key of the layer count.
pub const KEY_N_LAYERS: &str = "kv_cache.n_layers";
/// Key of the KV head count.
pub const KEY_N_KV_HEADS: &str = "kv_cache.n_kv_heads";
/// Key of the head dimension.
pub const KEY_HEAD_DIM: &str = "kv_cache.head_dim";

/// Why a metadata map could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MetadataError {
    /// No `kv_cache.schema_version` key: the file was not written with kvplug's schema.
    #[error("metadata has no '{KEY_SCHEMA_VERSION}' key (not written with the kv_cache schema)")]
    MissingVersion,
    /// A version this reader does not understand.
    #[error(
        "unsupported kv_cache schema version '{found}' (this reader understands {SCHEMA_VERSION})"
    )]
    UnsupportedVersion {
        /// The value found.
        found: String,
    },
    /// A required key is absent.
    #[error("metadata is missing required key '{0}'")]
    Missing(&'static str),
    /// A value that is not a positive integer.
    #[error("metadata key '{key}' has malformed value '{value}' (expected a positive integer)")]
    Malformed {
        /// The key.
        key: &'static str,
        /// The raw value.
        value: String,
    },
}

/// Read-only access to a string map; implemented for the map types safetensors uses.
pub trait MetadataMap {
    /// The value under `key`.
    fn get_str(&self, key: &str) -> Option<&str>;
}

impl MetadataMap for HashMap<String, String> {
    fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

impl MetadataMap for BTreeMap<String, String> {
    fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

/// Writes `params` under the `kv_cache.*` namespace (schema version included), replacing
/// any earlier values; other keys are left alone.
pub fn write_cache_params<M: Extend<(String, String)>>(params: &ModelCacheParams, map: &mut M) {
    map.extend([
        (KEY_SCHEMA_VERSION.to_string(), SCHEMA_VERSION.to_string()),
        (KEY_N_LAYERS.to_string(), params.n_layers.to_string()),
        (KEY_N_KV_HEADS.to_string(), params.n_kv_heads.to_string()),
        (KEY_HEAD_DIM.to_string(), params.head_dim.to_string()),
    ]);
}

/// True when the map carries any `kv_cache.*` key (so a reader should use it rather than
/// derive the facts elsewhere).
pub fn has_cache_params(map: &impl MetadataMap) -> bool {
    [
        KEY_SCHEMA_VERSION,
        KEY_N_LAYERS,
        KEY_N_KV_HEADS,
        KEY_HEAD_DIM,
    ]
    .iter()
    .any(|k| map.get_str(k).is_some())
}

/// Reads `kv_cache.*`, rejecting a missing or other schema version and malformed values.
pub fn read_cache_params(map: &impl MetadataMap) -> Result<ModelCacheParams, MetadataError> {
    let version = map
        .get_str(KEY_SCHEMA_VERSION)
        .ok_or(MetadataError::MissingVersion)?;
    if version.trim() != SCHEMA_VERSION.to_string() {
        return Err(MetadataError::UnsupportedVersion {
            found: version.to_string(),
        });
    }
    let positive = |key: &'static str| -> Result<usize, MetadataError> {
        let raw = map.get_str(key).ok_or(MetadataError::Missing(key))?;
        match raw.trim().parse::<usize>() {
            Ok(v) if v > 0 => Ok(v),
            _ => Err(MetadataError::Malformed {
                key,
                value: raw.to_string(),
            }),
        }
    };
    Ok(ModelCacheParams {
        n_layers: positive(KEY_N_LAYERS)?,
        n_kv_heads: positive(KEY_N_KV_HEADS)?,
        head_dim: positive(KEY_HEAD_DIM)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: ModelCacheParams = ModelCacheParams {
        n_layers: 30,
        n_kv_heads: 3,
        head_dim: 64,
    };

    #[test]
    fn round_trip_keeps_other_keys() {
        let mut m: HashMap<String, String> = HashMap::new();
        m.insert("format".into(), "pt".into());
        write_cache_params(&P, &mut m);
        assert_eq!(m["kv_cache.schema_version"], "1");
        assert_eq!(m["format"], "pt");
        assert!(has_cache_params(&m));
        assert_eq!(read_cache_params(&m).unwrap(), P);
    }

    #[test]
    fn rejects_missing_or_other_version() {
        let mut m: BTreeMap<String, String> = BTreeMap::new();
        assert!(!has_cache_params(&m));
        assert_eq!(read_cache_params(&m), Err(MetadataError::MissingVersion));
        write_cache_params(&P, &mut m);
        m.insert(KEY_SCHEMA_VERSION.into(), "2".into());
        let e = read_cache_params(&m).unwrap_err();
        assert_eq!(e, MetadataError::UnsupportedVersion { found: "2".into() });
        assert!(e.to_string().contains("understands 1"));
    }

    #[test]
    fn rejects_malformed_and_missing_values() {
        for (key, value) in [
            (KEY_N_LAYERS, "thirty"),
            (KEY_N_KV_HEADS, "0"),
            (KEY_HEAD_DIM, "-64"),
        ] {
            let mut m: BTreeMap<String, String> = BTreeMap::new();
            write_cache_params(&P, &mut m);
            m.insert(key.into(), value.into());
            assert_eq!(
                read_cache_params(&m),
                Err(MetadataError::Malformed {
                    key,
                    value: value.into()
                })
            );
        }
        let mut m: BTreeMap<String, String> = BTreeMap::new();
        write_cache_params(&P, &mut m);
        m.remove(KEY_HEAD_DIM);
        assert_eq!(
            read_cache_params(&m),
            Err(MetadataError::Missing(KEY_HEAD_DIM))
        );
    }
}

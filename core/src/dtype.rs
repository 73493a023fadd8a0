//! KV storage dtypes and their byte footprint.

use std::fmt;
use std::str::FromStr;

use crate::error::CacheError;

/// Default quantization group for [`KvDtype::Q8`].
pub const Q8_DEFAULT_GROUP: usize = 64;
/// Default quantization group for [`KvDtype::Q4`].
pub const Q4_DEFAULT_GROUP: usize = 32;

/// How K/V rows are stored in a pool. Storage dtype is runtime policy; the attention output
/// dtype is chosen per op call and independent of it.
///
/// Quantized dtypes are affine per group along `head_dim` (see [`crate::quant`]): each group
/// of `group` values stores one f16 `scale` and one f16 `lo`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit affine, `group` values per (scale, lo) pair.
    Q8 {
        /// Values per group; must divide `head_dim`.
        group: usize,
    },
    /// 4-bit affine (two values per byte), `group` values per (scale, lo) pair.
    Q4 {
        /// Values per group; must divide `head_dim` and be even.
        group: usize,
    },
}

impl KvDtype {
    /// q8 with its default group of 64.
    pub const Q8_DEFAULT: KvDtype = KvDtype::Q8 {
        group: Q8_DEFAULT_GROUP,
    };
    /// q4 with its default group of 32.
    pub const Q4_DEFAULT: KvDtype = KvDtype::Q4 {
        group: Q4_DEFAULT_GROUP,
    };
    /// The five storage dtypes with default groups.
    pub const ALL: [KvDtype; 5] = [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Bf16,
        KvDtype::Q8_DEFAULT,
        KvDtype::Q4_DEFAULT,
    ];

    /// Quantized dtypes carry `(bits, group)`.
    pub fn quant(self) -> Option<(u32, usize)> {
        match self {
            KvDtype::Q8 { group } => Some((8, group)),
            KvDtype::Q4 { group } => Some((4, group)),
            _ => None,
        }
    }

    /// True for q8 / q4.
    pub fn is_quantized(self) -> bool {
        self.quant().is_some()
    }

    /// The short family name (`f32`, `f16`, `bf16`, `q8`, `q4`), without the group.
    pub fn family(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Q8 { .. } => "q8",
            KvDtype::Q4 { .. } => "q4",
        }
    }

    /// Bytes one row of `head_dim` values occupies, scales and offsets included.
    /// Assumes [`KvDtype::check_head_dim`] passed.
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            KvDtype::F32 => 4 * head_dim,
            KvDtype::F16 | KvDtype::Bf16 => 2 * head_dim,
            KvDtype::Q8 { group } => head_dim + 4 * (head_dim / group),
            KvDtype::Q4 { group } => head_dim / 2 + 4 * (head_dim / group),
        }
    }

    /// Checks that the group divides `head_dim` (and q4 groups are even); the error names
    /// the largest group below this one that fits (`q8g32` for a head of 96), if any.
    pub fn check_head_dim(self, head_dim: usize) -> Result<(), CacheError> {
        if let Some((bits, group)) = self.quant() {
            let fits = |g: usize| g > 0 && head_dim % g == 0 && (bits == 8 || g % 2 == 0);
            if !fits(group) {
                // Of the groups `q8g<N>` / `q4g<N>` name (powers of two up to 1024), those
                // every backend takes (wgpu's kernels need 4 or 8 values a group).
                let other = (3..=10)
                    .rev()
                    .map(|k| 1usize << k)
                    .find(|&g| g < group && fits(g));
                return Err(CacheError::bad_config(format!(
                    "{self}: group {group} must divide head_dim {head_dim}{}{}",
                    if bits == 4 { " and be even" } else { "" },
                    other.map_or(String::new(), |g| format!(" ({}g{g} fits)", self.family()))
                )));
            }
        }
        Ok(())
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            KvDtype::Q8 { group } if group != Q8_DEFAULT_GROUP => write!(f, "q8g{group}"),
            KvDtype::Q4 { group } if group != Q4_DEFAULT_GROUP => write!(f, "q4g{group}"),
            other => f.write_str(other.family()),
        }
    }
}

/// Error for an unrecognised dtype string.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown KV dtype '{0}' (expected f32, f16, bf16, q8, q4, or q8g<N> / q4g<N> with N a power \
     of two from 2 to 1024)"
)]
pub struct ParseDtypeError(pub String);

impl FromStr for KvDtype {
    type Err = ParseDtypeError;

    /// Accepts `f32 f16 bf16 q8 q4` and `q8g<N>` / `q4g<N>` for a non-default group, N a
    /// power of two from 2 to 1024 (it must also divide the cache's head_dim, checked by
    /// [`KvDtype::check_head_dim`]).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseDtypeError(s.to_string());
        let group = |rest: &str, default: usize| -> Result<usize, ParseDtypeError> {
            match rest {
                "" => Ok(default),
                _ => rest
                    .strip_prefix('g')
                    .and_then(|n| n.parse::<usize>().ok())
                    .filter(|&g| g.is_power_of_two() && (2..=1024).contains(&g))
                    .ok_or_else(err),
            }
        };
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            "bf16" => Ok(KvDtype::Bf16),
            _ if s.starts_with("q8") => Ok(KvDtype::Q8 {
                group: group(&s[2..], Q8_DEFAULT_GROUP)?,
            }),
            _ if s.starts_with("q4") => Ok(KvDtype::Q4 {
                group: group(&s[2..], Q4_DEFAULT_GROUP)?,
            }),
            _ => Err(err()),
        }
    }
}

impl serde::Serialize for KvDtype {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for KvDtype {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_round_trips() {
        for d in KvDtype::ALL {
            assert_eq!(d.to_string().parse::<KvDtype>().unwrap(), d);
        }
        assert_eq!(
            "q8g32".parse::<KvDtype>().unwrap(),
            KvDtype::Q8 { group: 32 }
        );
        assert_eq!(KvDtype::Q4 { group: 16 }.to_string(), "q4g16");
        for bad in ["q8g0", "q8g7", "q4g1", "q8g2048", "q8g", "q8x"] {
            assert!(bad.parse::<KvDtype>().is_err(), "{bad}");
        }
        assert!("q8x".parse::<KvDtype>().is_err());
        assert!("int8".parse::<KvDtype>().is_err());
    }

    #[test]
    fn quantized_footprint_matches_targets() {
        let f16 = KvDtype::F16.row_bytes(128) as f64;
        assert_eq!(KvDtype::Q8_DEFAULT.row_bytes(128) as f64 / f16, 0.53125);
        assert_eq!(KvDtype::Q4_DEFAULT.row_bytes(128) as f64 / f16, 0.3125);
    }

    #[test]
    fn group_must_divide_head_dim() {
        assert!(KvDtype::Q8_DEFAULT.check_head_dim(128).is_ok());
        let e = KvDtype::Q8_DEFAULT.check_head_dim(48).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::BadConfig);
        assert!(e.message.ends_with("head_dim 48 (q8g16 fits)"), "{e:?}");
        let e = KvDtype::Q8_DEFAULT.check_head_dim(96).unwrap_err();
        assert!(e.message.ends_with("(q8g32 fits)"), "{e:?}");
        let e = KvDtype::Q4 { group: 32 }.check_head_dim(80).unwrap_err();
        assert!(e.message.ends_with("and be even (q4g16 fits)"), "{e:?}");
        // No power-of-two group fits an odd head.
        let e = KvDtype::Q8_DEFAULT.check_head_dim(45).unwrap_err();
        assert!(e.message.ends_with("head_dim 45"), "{e:?}");
        assert!(KvDtype::Q8 { group: 0 }.check_head_dim(64).is_err());
        assert!(KvDtype::Q4 { group: 3 }.check_head_dim(9).is_err());
        assert!(KvDtype::F16.check_head_dim(7).is_ok());
    }
}

//! [`KeyBasis`]: the basis a model's forward pass writes keys (and reads queries) in.
//!
//! Quantizing a key row to 8 or 4 bits per value costs most where a few channels hold
//! outliers: one group's scale then spans them and rounds the rest coarsely. An orthonormal
//! Walsh–Hadamard rotation of q and k per head, after RoPE, spreads every outlier over the
//! whole piece and leaves each score `q·k = (Hq)·(Hk)` unchanged in exact arithmetic, so
//! only the quantization error moves. The values stay as they are, so the attention output
//! needs no inverse (llama.cpp also rotates quantized V, and the output back; measured on
//! three models, rotating V as well changed nothing: docs/concepts.md "Key rotation").
//!
//! The basis is part of what a cache's key rows mean: session files record it, and rows
//! saved in one basis are refused by a context that keeps the other.

use std::fmt;
use std::str::FromStr;

use crate::dtype::KvDtype;

/// How a forward pass stores key rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KeyBasis {
    /// Keys as the model computes them.
    #[default]
    Identity,
    /// Each head's q and k multiplied by `H_n / √n` after RoPE, piece by piece, with
    /// `n = `[`rotation_width`]`(head_dim)` and `H_n` Sylvester's Hadamard matrix
    /// (`H_1 = [1]`, `H_2m = [[H_m, H_m], [H_m, −H_m]]`).
    Hadamard,
}

impl KeyBasis {
    /// The basis a context uses by default for `dtype`: Hadamard for quantized keys (the
    /// rotation measurably lowers their error; see BENCH.md's KV quality table), identity for
    /// float keys (their rounding does not depend on outliers).
    pub fn default_for(dtype: KvDtype) -> Self {
        if dtype.is_quantized() {
            KeyBasis::Hadamard
        } else {
            KeyBasis::Identity
        }
    }

    /// Its name in options and session files.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyBasis::Identity => "identity",
            KeyBasis::Hadamard => "hadamard",
        }
    }
}

impl fmt::Display for KeyBasis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for KeyBasis {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "identity" => Ok(KeyBasis::Identity),
            "hadamard" => Ok(KeyBasis::Hadamard),
            other => Err(format!(
                "unknown key basis '{other}' (expected identity or hadamard)"
            )),
        }
    }
}

/// The width of the pieces a head of `head_dim` values is rotated in: the largest power of
/// two dividing it (the whole head for the usual 64, 128 and 256; 16 pieces of 16 for 80).
pub fn rotation_width(head_dim: usize) -> usize {
    if head_dim == 0 {
        return 1;
    }
    1 << head_dim.trailing_zeros()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widths_are_the_largest_power_of_two_dividing_the_head() {
        assert_eq!(rotation_width(64), 64);
        assert_eq!(rotation_width(256), 256);
        assert_eq!(rotation_width(80), 16);
        assert_eq!(rotation_width(96), 32);
        assert_eq!(rotation_width(7), 1);
    }

    #[test]
    fn names_round_trip_and_defaults_follow_the_dtype() {
        for b in [KeyBasis::Identity, KeyBasis::Hadamard] {
            assert_eq!(b.as_str().parse::<KeyBasis>(), Ok(b));
        }
        assert!("rotated".parse::<KeyBasis>().is_err());
        assert_eq!(KeyBasis::default_for(KvDtype::F16), KeyBasis::Identity);
        assert_eq!(
            KeyBasis::default_for(KvDtype::Q4_DEFAULT),
            KeyBasis::Hadamard
        );
        assert_eq!(
            KeyBasis::default_for(KvDtype::Q8_DEFAULT),
            KeyBasis::Hadamard
        );
    }
}

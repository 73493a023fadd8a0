//! The arithmetics an attention kernel may declare: what it computes the scores with, and so
//! which error bound the oracle holds it to ([`crate::oracle::attend`] derives each).

use std::fmt;
use std::str::FromStr;

/// Values per query block of [`Arithmetic::Int8Query`].
pub const QUERY_BLOCK: usize = 32;

/// How a kernel computes `q·kᵀ`; the softmax and the value sum are f32 in every one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Arithmetic {
    /// The reference: K widened to f32, f32 products and sums.
    #[default]
    F32,
    /// Each query row quantized per [`QUERY_BLOCK`] consecutive values (the last block may
    /// be shorter) to int8: `s = max|q| / 127` in f32 (a GPU's division may be 2.5 ulp
    /// off), codes `round(q / s)` half away from zero, clamped to ±127 (`s = 0` gives codes
    /// 0); integer dot products with the stored key codes, block results scaled and summed
    /// in f32. [`crate::oracle::int8_half_steps`] derives the query's error.
    Int8Query,
}

impl Arithmetic {
    /// Every arithmetic, the reference first.
    pub const ALL: [Arithmetic; 2] = [Arithmetic::F32, Arithmetic::Int8Query];

    /// The name hosts and plugins exchange.
    pub fn as_str(self) -> &'static str {
        match self {
            Arithmetic::F32 => "f32",
            Arithmetic::Int8Query => "int8-query",
        }
    }
}

impl fmt::Display for Arithmetic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An arithmetic name nobody defines.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown attention arithmetic '{0}' (known: {known})", known = Arithmetic::ALL.map(Arithmetic::as_str).join(", "))]
pub struct ParseArithmeticError(pub String);

impl FromStr for Arithmetic {
    type Err = ParseArithmeticError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Arithmetic::ALL
            .into_iter()
            .find(|a| a.as_str() == s)
            .ok_or_else(|| ParseArithmeticError(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for a in Arithmetic::ALL {
            assert_eq!(a.as_str().parse::<Arithmetic>(), Ok(a));
        }
        assert!("int8".parse::<Arithmetic>().is_err());
    }
}

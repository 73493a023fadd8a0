//! The arithmetics an attention kernel may declare: what it computes the scores with, and so
//! which error bound the oracle holds it to ([`crate::oracle::attend`] derives each).

use std::fmt;
use std::str::FromStr;

/// Values per query block of [`Arithmetic::Int8Query`].
pub const QUERY_BLOCK: usize = 32;

/// The most keys one integer value sum of [`Arithmetic::Int8QueryI16Values`] spans: 256
/// products of an i16 code (at most 32767) and an 8-bit value code (at most 255) add up
/// below 2³¹, exactly in i32.
pub const VALUE_RUN: usize = 256;

/// Codes of [`Arithmetic::Int8QueryI16Values`]'s weights: `0..=WEIGHT_CODES`.
pub const WEIGHT_CODES: u16 = 32767;

/// A run of [`Arithmetic::Int8QueryI16Values`] whose largest `p·σ` is below this (`2⁻¹⁰⁰`)
/// may be coded 0 whole: `WEIGHT_CODES / max` could overflow f32 and `r` be subnormal.
pub const TINY_RUN: f32 = f32::from_bits(27 << 23);

/// How a kernel computes `q·kᵀ` and `p·V`; the softmax is f32 in every one, and the value
/// sum too but in [`Arithmetic::Int8QueryI16Values`].
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
    /// [`Arithmetic::Int8Query`]'s scores and, over quantized values (`lo + σ·c` per group,
    /// see [`crate::quant`]), a value sum in integers, the step that fork and tree steps
    /// spend their time in: per query row, value group and run of at most [`VALUE_RUN`]
    /// consecutive keys (the kernel's choice), each key's weight `p ≤ 1` (its f32 `exp`
    /// against the row's running max) times its group's scale, `u = p·σ` in f32, is coded
    /// `e = round(u · (WEIGHT_CODES / max u))` (0 to [`WEIGHT_CODES`], the max over the run,
    /// in f32; a max below [`TINY_RUN`] may give codes 0); `Σ e·c` is summed exactly in i32, times
    /// `r = max u / WEIGHT_CODES` in f32, and `Σ p·lo` is added in f32. Values that are not
    /// quantized are summed in f32.
    /// [`crate::oracle::i16_value_error`] derives the error the codes add.
    Int8QueryI16Values,
}

impl Arithmetic {
    /// Every arithmetic, the reference first.
    pub const ALL: [Arithmetic; 3] = [
        Arithmetic::F32,
        Arithmetic::Int8Query,
        Arithmetic::Int8QueryI16Values,
    ];

    /// The name hosts and plugins exchange.
    pub fn as_str(self) -> &'static str {
        match self {
            Arithmetic::F32 => "f32",
            Arithmetic::Int8Query => "int8-query",
            Arithmetic::Int8QueryI16Values => "int8-query-i16-values",
        }
    }

    /// Whether the scores come from the query quantized to int8 ([`Arithmetic::Int8Query`]).
    pub fn int8_query(self) -> bool {
        matches!(self, Arithmetic::Int8Query | Arithmetic::Int8QueryI16Values)
    }

    /// Whether quantized values are summed against i16 weight codes
    /// ([`Arithmetic::Int8QueryI16Values`]).
    pub fn i16_values(self) -> bool {
        self == Arithmetic::Int8QueryI16Values
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

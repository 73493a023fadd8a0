//! The f64 reference oracle every backend is diffed against: naive attention with a derived
//! error bound per declared arithmetic (f32 the reference), and a reference cache per kind that decides visibility from its own
//! naive cell model (never core's bookkeeping) and stores K/V per cell in f64 exactly as the
//! storage dtype would round or quantize them; the recurrences of hybrid models' recurrent
//! layers. Plain and obviously right rather than fast.

mod attention;
mod cache;
mod cells;
mod recurrent;
mod rows;

pub use attention::{
    attend, attend_sinks, exp_rel_error, gamma, i16_value_error, int8_half_steps,
    int8_query_score_error, value_span, Attention, AttnDims, RefMask, F32_UNIT_ROUNDOFF,
};
pub use cache::{store_rounded, RefCache, RefRows};
pub use cells::{CellModel, RefPlan};
pub use recurrent::{gated_delta_step, mamba2_step, short_conv, short_conv_bound};
pub use rows::{decode_row, encode_row, window_start};

//! The f64 reference oracle every backend is diffed against: naive attention and a
//! reference cache per kind, storing K/V per cell in f64 exactly as the storage dtype would
//! round or quantize them. Plain and obviously right rather than fast.

mod attention;
mod cache;

pub use attention::{attend, AttnDims, RefMask};
pub use cache::{store_rounded, RefCache};

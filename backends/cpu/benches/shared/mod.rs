//! What the criterion benches and the examples that time kernels share: the read-bandwidth
//! pass and the decode weight sets (`weights_bandwidth`), and the attention steps
//! ([`steps`]: `step_ratios`, `bench_report`). Each example reads only some of it.

pub mod steps;

use std::hint::black_box;

use kvplug_backend_kit::model::BlockFormat;
use kvplug_backend_kit::testing::Rng;
use kvplug_cpu::workers::Workers;

/// Bytes of each weight set: far past the last-level cache, so every pass streams from
/// memory.
pub const BLOCK_SET_BYTES: usize = 256 << 20;

/// Qwen2.5-0.5B's MLP shapes `[rows, cols]`: the down projection (its 4864 columns are
/// whole 256-value super-blocks) and the gate/up projections (896 columns: 32-value formats
/// only, as in that model's GGUF files).
pub const BLOCK_SHAPES: [(usize, usize); 2] = [(896, 4864), (4864, 896)];

/// The block formats of the weights benches.
pub const BLOCK_FORMATS: [BlockFormat; 8] = [
    BlockFormat::Q4K,
    BlockFormat::Q5K,
    BlockFormat::Q6K,
    BlockFormat::Q8_0,
    BlockFormat::Q5_0,
    BlockFormat::Q5_1,
    BlockFormat::Q4_0,
    BlockFormat::Q4_1,
];

/// The buffer of a [`read_pass`]: 256 MiB of f32.
pub fn bandwidth_buffer() -> Vec<f32> {
    (0..64 << 20).map(|i| i as f32).collect()
}

/// Sums `buf` on every thread of the worker pool the kernels run on, one slice each: the
/// machine's read bandwidth is `buf`'s bytes over its time.
pub fn read_pass(buf: &[f32]) {
    let workers = Workers::global();
    let slice = buf.len().div_ceil(workers.participants());
    workers.run(workers.participants(), &|p| {
        let mut acc = [0f32; 16];
        for c in buf[(p * slice).min(buf.len())..((p + 1) * slice).min(buf.len())].chunks_exact(16)
        {
            for l in 0..16 {
                acc[l] += c[l];
            }
        }
        black_box(acc);
    });
}

/// `blocks` random blocks of `f` (the kit's test blocks), seeded by `seed`.
pub fn random_blocks(f: BlockFormat, blocks: usize, seed: u64) -> Vec<u8> {
    kvplug_backend_kit::testing::random_blocks(f, blocks, &mut Rng(seed | 1))
}

/// A decode token's pass through [`BLOCK_SET_BYTES`] of `[rows, cols]` weights, in a block
/// format or f16, one matrix after another (`out = x·Wᵀ` on the weights as stored).
pub enum WeightSet {
    Blocks(BlockFormat, Vec<Vec<u8>>),
    F16(Vec<Vec<half::f16>>),
}

impl WeightSet {
    /// The set of format `f` (f16 where `None`).
    pub fn new(f: Option<BlockFormat>, rows: usize, cols: usize) -> WeightSet {
        match f {
            Some(f) => {
                let bytes = rows * f.bytes_for(cols);
                WeightSet::Blocks(
                    f,
                    (0..BLOCK_SET_BYTES.div_ceil(bytes))
                        .map(|m| random_blocks(f, bytes / f.block_bytes(), m as u64 + 1))
                        .collect(),
                )
            }
            None => WeightSet::F16(
                (0..BLOCK_SET_BYTES.div_ceil(rows * cols * 2))
                    .map(|m| {
                        (0..rows * cols)
                            .map(|i| half::f16::from_f32(((i + m) % 97) as f32 * 0.01))
                            .collect()
                    })
                    .collect(),
            ),
        }
    }

    /// The weights' bytes.
    pub fn bytes(&self) -> usize {
        match self {
            WeightSet::Blocks(_, set) => set.iter().map(Vec::len).sum(),
            WeightSet::F16(set) => set.iter().map(|w| 2 * w.len()).sum(),
        }
    }

    /// One token `x` (`cols` values) through every matrix, into `out` (`rows` values).
    pub fn pass(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        let cols = x.len();
        match self {
            WeightSet::Blocks(f, set) => {
                for w in set {
                    kvplug_cpu::qlinear::linear_blocks(x, 1, *f, w, rows, cols, out);
                }
            }
            WeightSet::F16(set) => {
                for w in set {
                    kvplug_cpu::linear::linear(x, 1, w, rows, cols, out);
                }
            }
        }
    }
}

/// The decode token of the weights benches, `cols` values.
pub fn decode_token(cols: usize) -> Vec<f32> {
    (0..cols).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect()
}

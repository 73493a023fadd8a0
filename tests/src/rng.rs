//! Deterministic inputs: q/k/v values uniform in [-1, 1) from (seed, op index, layer,
//! tensor), via splitmix64.

/// Which tensor a value stream feeds.
#[derive(Clone, Copy, Debug)]
pub enum Stream {
    /// Queries.
    Q = 1,
    /// Keys.
    K = 2,
    /// Values.
    V = 3,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `n` values in [-1, 1) for (seed, op, layer, stream).
pub fn uniform(seed: u64, op: usize, layer: usize, stream: Stream, n: usize) -> Vec<f32> {
    let mut state =
        splitmix(seed ^ splitmix((op as u64) << 20 ^ (layer as u64) << 4 ^ stream as u64));
    (0..n)
        .map(|_| {
            state = splitmix(state);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_in_range() {
        let a = uniform(1, 3, 0, Stream::K, 1000);
        assert_eq!(a, uniform(1, 3, 0, Stream::K, 1000));
        assert_ne!(a, uniform(1, 3, 0, Stream::V, 1000));
        assert_ne!(a, uniform(2, 3, 0, Stream::K, 1000));
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean: f32 = a.iter().sum::<f32>() / 1000.0;
        assert!(mean.abs() < 0.1, "{mean}");
    }
}

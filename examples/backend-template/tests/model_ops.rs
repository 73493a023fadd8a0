//! The kit's default `ModelDevice::hadamard`, which this backend keeps (the forward calls it on
//! q and k when a cache stores quantized keys), against the matrix product with Sylvester's
//! `H_n / √n` in f64. The rest of the model operations are checked end to end by kvplug's
//! `make test` (logits against its f64 reference forward).

use kvplug_backend_kit::model::ModelDevice;
use kvplug_backend_kit::Device;
use kvplug_backend_template::TemplateDevice;
use kvplug_plugin_api::TensorDtype;

/// Entry `(i, j)` of Sylvester's `H_n`: `(−1)^popcount(i & j)`.
fn sylvester(i: usize, j: usize) -> f64 {
    if (i & j).count_ones().is_multiple_of(2) {
        1.0
    } else {
        -1.0
    }
}

#[test]
fn the_default_hadamard_is_the_normalized_sylvester_product() {
    let dev = TemplateDevice;
    for (rows, n, pieces) in [(3, 16, 2), (1, 64, 1), (2, 1, 5)] {
        let width = n * pieces;
        let x: Vec<f32> = (0..rows * width)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let xt = dev.tensor(&x, &[rows, width]).unwrap();
        let mut out = dev
            .tensor(&vec![0.0; rows * width], &[rows, width])
            .unwrap();
        dev.hadamard(&xt, n, &mut out).unwrap();
        let got = dev
            .download(&out, TensorDtype::F32)
            .unwrap()
            .to_f32()
            .unwrap();
        for (p, (g, xp)) in got.chunks_exact(n).zip(x.chunks_exact(n)).enumerate() {
            let scale: f64 = xp.iter().map(|v| f64::from(v.abs())).sum();
            for (i, &gi) in g.iter().enumerate() {
                let want: f64 = (0..n)
                    .map(|j| sylvester(i, j) * f64::from(xp[j]))
                    .sum::<f64>()
                    / (n as f64).sqrt();
                // log2(n) rounded additions and one rounded multiply, each at most half an
                // f32 ulp of a partial sum bounded by Σ|x|.
                let bound = (n.trailing_zeros() as f64 + 2.0) * f64::from(f32::EPSILON) * scale;
                assert!(
                    (f64::from(gi) - want).abs() <= bound,
                    "n {n}, piece {p}, element {i}: {gi} against {want} (bound {bound})"
                );
            }
        }
    }
    // Shapes outside the contract are refused.
    let x = dev.tensor(&[0.0; 12], &[2, 6]).unwrap();
    let mut out = dev.tensor(&[0.0; 12], &[2, 6]).unwrap();
    assert!(
        dev.hadamard(&x, 4, &mut out).is_err(),
        "4 does not divide 6"
    );
    assert!(
        dev.hadamard(&x, 3, &mut out).is_err(),
        "3 is not a power of two"
    );
}

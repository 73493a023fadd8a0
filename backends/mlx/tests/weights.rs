//! Block-format weights on MLX, kept quantized or widened: the affine formats, repacked into
//! MLX's affine form, give exactly the kit's dequantized values through `quantized_matmul`
//! and the embedding gather; the widened ones likewise. Model tests cover the products; this
//! pins the repacking and the `weights-widened` feature.

#[cfg(mlx)]
mod with_mlx {
    use std::sync::Arc;

    use kvplug_backend_kit::model::blocks::{dequantize_row, BlockFormat, BLOCK_FORMATS};
    use kvplug_backend_kit::model::{ModelDevice, StoredDtype, StoredTensor};
    use kvplug_backend_kit::{Backend, Device};
    use kvplug_mlx::MlxDevice;
    use kvplug_plugin_api::TensorDtype;

    /// `n` blocks of `f`: xorshift bytes with every f16 field set to a finite value from
    /// `scales` (varied so that biases, minimums and scales differ per block).
    fn blocks(f: BlockFormat, n: usize) -> Vec<u8> {
        let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ f.block_bytes() as u64;
        let mut b: Vec<u8> = (0..n * f.block_bytes())
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect();
        for (i, blk) in b.chunks_exact_mut(f.block_bytes()).enumerate() {
            for (k, &at) in f.half_fields().iter().enumerate() {
                let v = (i * 7 + k * 3) as f32 * 0.013 - 0.2;
                blk[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        b
    }

    #[test]
    fn every_block_format_gives_the_kits_values() {
        // Kept quantized is the GPU default, widened the CPU's: both are chosen here.
        for quantized in [true, false] {
            every_format_on(MlxDevice::open().unwrap().with_quantized_weights(quantized));
        }
    }

    fn every_format_on(dev: MlxDevice) {
        let (rows, cols) = (5, 512);
        for f in BLOCK_FORMATS {
            let data = blocks(f, rows * cols / f.block_elems());
            let mut want = vec![0f32; rows * cols];
            dequantize_row(f, &data, &mut want);
            let len = data.len();
            let stored = StoredTensor::new(StoredDtype::Block(f), Arc::new(data), 0..len);
            let w = dev.weight(stored.unwrap(), rows, cols).unwrap();
            // `kvplug plugins` says which formats are widened: exactly those not kept affine.
            let widened = dev.features().iter().any(|x| {
                x.strip_prefix("weights-widened=")
                    .is_some_and(|l| l.split('|').any(|n| n == f.name()))
            });
            assert_eq!(
                matches!(w, kvplug_mlx::model::MlxWeight::Affine { .. }),
                !widened,
                "{}: kept affine unless listed as widened",
                f.name()
            );

            // x = I: each output row is one input column's weights, w[r][c] · 1 plus exact
            // zeros, so the product shows the values MLX dequantizes to (equal as numbers:
            // adding the zeros may turn a −0 into +0).
            let eye: Vec<f32> = (0..cols * cols)
                .map(|i| if i / cols == i % cols { 1.0 } else { 0.0 })
                .collect();
            let x = dev.tensor(&eye, &[cols, cols]).unwrap();
            let mut y = dev.tensor(&vec![0.0; cols * rows], &[cols, rows]).unwrap();
            dev.linear(&x, &w, None, &mut y).unwrap();
            let got = dev
                .download(&y, TensorDtype::F32)
                .unwrap()
                .to_f32()
                .unwrap();
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(
                        got[c * rows + r],
                        want[r * cols + c],
                        "{} linear: row {r} column {c}",
                        f.name(),
                    );
                }
            }

            let ids = [3, 0, 3, 4];
            let mut e = dev
                .tensor(&vec![0.0; ids.len() * cols], &[ids.len(), cols])
                .unwrap();
            dev.embed(&w, &ids, &mut e).unwrap();
            let got = dev
                .download(&e, TensorDtype::F32)
                .unwrap()
                .to_f32()
                .unwrap();
            for (i, &id) in ids.iter().enumerate() {
                // Equal as numbers: MLX's `scale·code + bias` gives +0 where ggml's
                // `(code − offset)·d` gives −0 for a negative d.
                let row = &want[id as usize * cols..(id as usize + 1) * cols];
                assert!(
                    got[i * cols..(i + 1) * cols] == *row,
                    "{} embed: row {id}",
                    f.name()
                );
            }
        }
    }
}

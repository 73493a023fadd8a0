//! The MLX pools against the kit's host quantizer (core's affine format, bit for bit) and
//! the canonical row form. Conformance covers attention; this pins the storage bytes.

#[cfg(mlx)]
mod with_mlx {
    use kvplug_backend_kit::quant::quantize_row;
    use kvplug_backend_kit::{AttendMask, Backend, Device};
    use kvplug_core::{Arithmetic, KvDtype};
    use kvplug_mlx::MlxDevice;
    use kvplug_plugin_api::HostTensor;
    use kvplug_plugin_api::TensorDtype;

    const HEADS: usize = 2;
    const D: usize = 64;

    /// Rows whose groups (16, 32 or 64 values) span `[0, levels]`, so the scale is exactly 1
    /// and many values fall exactly halfway between two codes (rounding is checked); the
    /// first 16 values are constant (a zero scale for 16-value groups).
    fn rows(t: usize, levels: f32) -> Vec<f32> {
        (0..HEADS * t * D)
            .map(|i| match (i % D, i % 16) {
                (0..16, _) => 0.25,
                (_, 0) => 0.0,
                (_, 1) => levels,
                (_, 2..9) => (i * 37 % levels as usize) as f32 + 0.5,
                _ => (i * 53 % 1000) as f32 / 1000.0 * levels,
            })
            .collect()
    }

    /// The canonical form of `row`: codes, then an f16 (scale, lo) pair per group.
    fn canonical(row: &[f32], bits: u32, group: usize) -> Vec<u8> {
        let (mut codes, mut scales, mut los) = (
            vec![0u8; D * bits as usize / 8],
            vec![0u16; D / group],
            vec![0u16; D / group],
        );
        quantize_row(row, bits, group, &mut codes, &mut scales, &mut los);
        for (s, l) in scales.iter().zip(&los) {
            codes.extend_from_slice(&s.to_le_bytes());
            codes.extend_from_slice(&l.to_le_bytes());
        }
        codes
    }

    #[test]
    fn quantized_writes_match_the_host_quantizer_bit_for_bit() {
        let dev = MlxDevice::open().unwrap();
        for dtype in [
            KvDtype::Q8_DEFAULT,
            KvDtype::Q4_DEFAULT,
            KvDtype::Q4 { group: 16 },
        ] {
            let (bits, group) = dtype.quant().unwrap();
            let mut pool = dev.pool_new(dtype, HEADS, D, 8).unwrap();
            let t = 3;
            let x = rows(t, ((1 << bits) - 1) as f32);
            let src = dev
                .upload(&HostTensor::from_f32(&[HEADS, t, D], &x))
                .unwrap();
            dev.write_run(&mut pool, 2, &src).unwrap();
            // Cells 2..5 in the canonical form, `[heads, cells, row]`; cell 7 never written.
            let got = dev.read_rows(&pool, &[2, 3, 4, 7]).unwrap();
            let row = dtype.row_bytes(D);
            for h in 0..HEADS {
                for i in 0..t {
                    let want = canonical(&x[(h * t + i) * D..(h * t + i + 1) * D], bits, group);
                    let at = (h * 4 + i) * row;
                    assert_eq!(&got[at..at + row], &want[..], "{dtype} head {h} row {i}");
                }
                let at = (h * 4 + 3) * row;
                assert!(got[at..at + row].iter().all(|&b| b == 0), "{dtype}");
            }
            // The canonical rows written back elsewhere read back bit for bit.
            let mut other = dev.pool_new(dtype, HEADS, D, 8).unwrap();
            dev.write_rows(&mut other, &[5, 1, 6, 0], &got).unwrap();
            assert_eq!(
                dev.read_rows(&other, &[5, 1, 6, 0]).unwrap(),
                got,
                "{dtype}"
            );
        }
    }

    /// A decode step writes its row into the pool in place and reads the window where it
    /// lies: across steps, MLX never holds a second copy of the pools (their bytes would
    /// show in the peak).
    #[test]
    fn decode_steps_write_in_place_and_copy_no_history() {
        let dev = MlxDevice::open().unwrap();
        let (hq, hkv, d, cells, history) = (8, 4, 64, 4096, 3000);
        let mut k = dev.pool_new(KvDtype::F32, hkv, d, cells).unwrap();
        let mut v = dev.pool_new(KvDtype::F32, hkv, d, cells).unwrap();
        let pool_bytes = dev.pool_bytes(&k);
        let fill: Vec<f32> = (0..hkv * history * d)
            .map(|i| (i % 97) as f32 * 0.01)
            .collect();
        let fill = dev
            .upload(&HostTensor::from_f32(&[hkv, history, d], &fill))
            .unwrap();
        dev.write_run(&mut k, 0, &fill).unwrap();
        dev.write_run(&mut v, 0, &fill).unwrap();
        let row = |t: usize| {
            let x: Vec<f32> = (0..t * d).map(|i| (i % 13) as f32 * 0.1).collect();
            HostTensor::from_f32(&[t, 1, d], &x)
        };
        let (q, kv) = (
            dev.upload(&row(hq)).unwrap(),
            dev.upload(&row(hkv)).unwrap(),
        );
        let mut out = dev.zeros(&[hq, 1, d]).unwrap();
        let mut step = |i: usize| {
            dev.write_run(&mut k, history + i, &kv).unwrap();
            dev.write_run(&mut v, history + i, &kv).unwrap();
            let l = history + i + 1;
            dev.attend(
                Arithmetic::F32,
                &q,
                &k,
                &v,
                l,
                AttendMask::Causal,
                0.125,
                &mut out,
                &mut (),
            )
            .unwrap();
            dev.download(&out, TensorDtype::F32).unwrap()
        };
        step(0);
        dev.reset_peak_memory();
        let before = dev.active_memory();
        for i in 1..9 {
            step(i);
        }
        let grew = dev.peak_memory().saturating_sub(before);
        assert!(
            grew < pool_bytes / 4,
            "decode steps peaked {grew} bytes above the {before} held; one pool is {pool_bytes}"
        );
    }

    #[test]
    fn tree_commit_moves_rows_down_and_growth_keeps_them() {
        let dev = MlxDevice::open().unwrap();
        for dtype in [KvDtype::F16, KvDtype::Q4_DEFAULT] {
            let mut pool = dev.pool_new(dtype, HEADS, D, 4).unwrap();
            let src = dev
                .upload(&HostTensor::from_f32(&[HEADS, 4, D], &rows(4, 15.0)))
                .unwrap();
            dev.write_run(&mut pool, 0, &src).unwrap();
            let before = dev.read_rows(&pool, &[0, 1, 2, 3]).unwrap();
            dev.pool_grow(&mut pool, 16, 4).unwrap();
            assert_eq!(dev.pool_bytes(&pool), 16 * HEADS * dtype.row_bytes(D));
            assert_eq!(dev.read_rows(&pool, &[0, 1, 2, 3]).unwrap(), before);
            dev.move_rows(&mut pool, 1, &[2, 3]);
            let row = dtype.row_bytes(D);
            let moved = dev.read_rows(&pool, &[1, 2]).unwrap();
            let head =
                |b: &[u8], h: usize, c: usize| b[(h * 4 + c) * row..(h * 4 + c + 1) * row].to_vec();
            for h in 0..HEADS {
                assert_eq!(
                    moved[(h * 2) * row..(h * 2 + 2) * row],
                    [head(&before, h, 2), head(&before, h, 3)].concat()
                );
            }
        }
    }
}

/// On Linux the mlx backend is required: a build without MLX must not pass quietly.
#[cfg(all(not(mlx), target_os = "linux"))]
#[test]
fn mlx_was_found_at_build_time() {
    panic!("kvplug-mlx was built without MLX; run scripts/install-mlx.sh (make deps) and rebuild");
}

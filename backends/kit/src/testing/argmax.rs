//! [`check_argmax_rows`], [`check_top_k_rows`] and [`check_adjust_rows`]: a device's greedy
//! picks, sampling candidates and adjusted logits are the host's.

use crate::model::ModelDevice;

/// Logit rows built to tell picks apart: ties (the lowest index wins, `-0.0` ties `0.0`),
/// NaNs (never picked; a row of them gives 0), infinities, a maximum in the last place, all
/// wider than one workgroup's stride.
fn rows() -> Vec<Vec<f32>> {
    let width = 1000;
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let base = |i: usize| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5;
    let mut row = |f: &dyn Fn(&mut Vec<f32>)| {
        let mut r: Vec<f32> = (0..width).map(base).collect();
        f(&mut r);
        rows.push(r);
    };
    row(&|r| {
        r[700] = 3.0;
        r[300] = 3.0;
    });
    row(&|r| {
        r[0] = f32::NAN;
        r[999] = 9.0;
    });
    row(&|r| r.iter_mut().for_each(|v| *v = f32::NAN));
    row(&|r| {
        r.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
        r[640] = f32::NAN;
    });
    row(&|r| {
        r.iter_mut().for_each(|v| *v = -1.0);
        r[65] = 0.0;
        r[1] = -0.0;
    });
    row(&|r| {
        r[511] = f32::INFINITY;
        r[64] = f32::INFINITY;
        r[5] = f32::NAN;
    });
    rows
}

/// [`ModelDevice::argmax_rows`] on [`rows`] against [`kvplug_core::argmax`]; then calls
/// with fewer rows and with rows wider than a device's part of a row ([`wide_rows`]), on
/// the same device.
pub fn check_argmax_rows<D: ModelDevice>(dev: D) {
    let narrow = rows();
    let wide = wide_rows(5000);
    for rows in [&narrow[..], &narrow[..2], &wide[..]] {
        let (n, width) = (rows.len(), rows[0].len());
        let x = dev.tensor(&rows.concat(), &[n, width]).unwrap();
        let mut ids = dev.zeros(&[n]).unwrap();
        let mut got = Vec::new();
        dev.argmax_rows(&x, &mut ids, &mut got).unwrap();
        let want: Vec<i32> = rows.iter().map(|r| kvplug_core::argmax(r)).collect();
        assert_eq!(got, want, "argmax of {n} rows of {width}");
    }
}

/// Rows of `width` values for a top-k: distinct values; ties of the largest across
/// positions 1023/1024 and 2047/2048 (where a device may split a row into parts), a NaN
/// and `±0.0` among them; one value repeated everywhere but at two places.
fn wide_rows(width: usize) -> Vec<Vec<f32>> {
    let distinct: Vec<f32> = (0..width).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut ties = distinct.clone();
    for i in [1023, 1024, 2047, 2048, width - 1] {
        if let Some(v) = ties.get_mut(i) {
            *v = 7.0;
        }
    }
    ties[3 % width] = f32::NAN;
    ties[width / 2] = 0.0;
    ties[width / 3] = -0.0;
    let mut flat = vec![1.0; width];
    flat[width - 2] = 2.0;
    flat[5] = f32::NEG_INFINITY;
    vec![distinct, ties, flat]
}

/// [`ModelDevice::top_k_rows`] on [`rows`] and on [`wide_rows`] (one part, several parts, a
/// last part shorter than `k`) against [`kvplug_core::top_k`], for `k` from 1 to the
/// whole row: the same indices in the same order and the same values, bit for bit; for
/// all rows and then two; the scratch kept from call to call.
pub fn check_top_k_rows<D: ModelDevice>(dev: D) {
    let mut want = Vec::new();
    for rows in [rows(), wide_rows(1030), wide_rows(5000)] {
        let width = rows[0].len();
        let mut scratch = dev.zeros(&[1, 2]).unwrap();
        for k in [1, 2, 40, 64, width.min(1030)] {
            for n in [rows.len(), 2] {
                let flat: Vec<f32> = rows[..n].concat();
                let x = dev.tensor(&flat, &[n, width]).unwrap();
                let (mut ids, mut values) = (Vec::new(), Vec::new());
                dev.top_k_rows(&x, k, &mut scratch, &mut ids, &mut values)
                    .unwrap();
                assert_eq!(
                    (ids.len(), values.len()),
                    (n * k, n * k),
                    "top {k} of {n} rows"
                );
                for (r, row) in rows[..n].iter().enumerate() {
                    kvplug_core::top_k(row, k, &mut want);
                    let got = (r * k..(r + 1) * k).map(|i| (ids[i], values[i].to_bits()));
                    let want = want.iter().map(|c| (c.0, c.1.to_bits()));
                    assert!(got.eq(want), "top {k} of row {r} of {n}, {width} wide");
                }
            }
        }
    }
}

/// [`ModelDevice::adjust_rows`] on [`rows`] against [`kvplug_core::Adjust::apply`], bit for
/// bit: biases (a ban to `-inf` among them), penalties subtracted, repetition scales on
/// positive, negative, zero, NaN and infinite logits, and places left alone; for all rows
/// and then two.
pub fn check_adjust_rows<D: ModelDevice>(dev: D) {
    use kvplug_core::Adjust;
    let rows = rows();
    let width = rows[0].len();
    let by = [
        Adjust {
            add: 2.5,
            ..Adjust::NONE
        },
        Adjust {
            add: f32::NEG_INFINITY,
            ..Adjust::NONE
        },
        Adjust {
            sub: 0.75,
            ..Adjust::NONE
        },
        Adjust {
            pos: 1.0 / 1.3,
            neg: 1.3,
            ..Adjust::NONE
        },
        Adjust {
            add: -0.3,
            sub: 1.5,
            pos: 1.0 / 1.1,
            neg: 1.1,
        },
    ];
    for n in [rows.len(), 2] {
        let mut at = Vec::new();
        let mut adjust = Vec::new();
        for r in 0..n as u32 {
            // The rows' special places (ties, NaNs, infinities, ±0) and ordinary ones.
            for (j, c) in [0u32, 1, 5, 64, 65, 300, 511, 640, 700, 999]
                .into_iter()
                .enumerate()
            {
                at.push([r, c]);
                adjust.push(by[(j + r as usize) % by.len()]);
            }
        }
        let flat: Vec<f32> = rows[..n].concat();
        let x = dev.tensor(&flat, &[n, width]).unwrap();
        let mut out = dev.zeros(&[n, width]).unwrap();
        dev.adjust_rows(&x, &at, &adjust, &mut out).unwrap();
        let got = dev
            .download(&out, kvplug_plugin_api::TensorDtype::F32)
            .unwrap()
            .to_f32()
            .unwrap();
        let mut want = flat.clone();
        for (&[r, c], a) in at.iter().zip(&adjust) {
            let v = &mut want[r as usize * width + c as usize];
            *v = a.apply(*v);
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "row {} column {}: {g} against {w} ({n} rows)",
                i / width,
                i % width
            );
        }
    }
}

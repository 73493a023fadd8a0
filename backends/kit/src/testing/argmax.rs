//! [`check_argmax_rows`]: a device's argmax picks what the host's does.

use crate::model::ModelDevice;

/// [`ModelDevice::argmax_rows`] on rows built to tell picks apart: ties (the lowest index
/// wins, `-0.0` ties `0.0`), NaNs (never picked; a row of them gives 0), infinities, a
/// maximum in the last place and rows wider than one workgroup's stride, each against
/// [`kvplug_core::argmax`]; then a second call with fewer rows into the same scratch.
pub fn check_argmax_rows<D: ModelDevice>(dev: D) {
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
    for n in [rows.len(), 2] {
        let flat: Vec<f32> = rows[..n].concat();
        let x = dev.tensor(&flat, &[n, width]).unwrap();
        let mut ids = dev.zeros(&[n]).unwrap();
        let mut got = Vec::new();
        dev.argmax_rows(&x, &mut ids, &mut got).unwrap();
        let want: Vec<i32> = rows[..n].iter().map(|r| kvplug_core::argmax(r)).collect();
        assert_eq!(got, want, "argmax of {n} rows");
    }
}

//! The Mamba2 selective scan on the host: a step's tokens advanced one at a time, each from
//! the state its sequence resumes from (the anchors say which), over a range of heads (a
//! prefill splits the heads over two threads).

use std::ops::Range;

use crate::delta_rule::{madd, Outputs, States};

/// Partial sums a dot over the state keeps (two 8-lane vector registers of f32).
const LANES: usize = 16;

/// A step's convolved inputs and how its tokens chain.
pub struct Scan<'a> {
    /// Per token, its convolved and activated x (`[heads · head_dim]`), then B and C
    /// (`[groups · state]` each).
    pub xbc: &'a [f32],
    /// Per token, the heads' step projections with their bias (`[heads]`).
    pub dt: &'a [f32],
    /// The heads' decay rates (`−exp(A_log)`) and skip weights.
    pub a: &'a [f32],
    pub d: &'a [f32],
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub state: usize,
    /// Per token, the slot it resumes from (`NO_STATE`: zeros) and the slot it writes.
    pub from: &'a [u32],
    pub home: &'a [u32],
}

impl Scan<'_> {
    /// Advances heads `heads` over every token in order: `states` holds each slot's state
    /// of those heads (`[head][head_dim][state]`), `out` receives each token's outputs of
    /// those heads. Per head `h` (group `h / (heads / groups)`), with `Δ = softplus(dt[h])`:
    /// `S_h ← exp(Δ·a[h])·S_h + Δ·x_h ⊗ B`, `y_h = S_h·C + d[h]·x_h`.
    pub fn advance<S: States + ?Sized, O: Outputs + ?Sized>(
        &self,
        heads: Range<usize>,
        states: &mut S,
        out: &mut O,
    ) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has the features `advance_avx2` is compiled for.
            return unsafe { self.advance_avx2(heads, states, out) };
        }
        self.advance_any::<false, S, O>(heads, states, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn advance_avx2<S: States + ?Sized, O: Outputs + ?Sized>(
        &self,
        heads: Range<usize>,
        states: &mut S,
        out: &mut O,
    ) {
        self.advance_any::<true, S, O>(heads, states, out)
    }

    /// [`Scan::advance`], products fused (`FUSED`: one rounding each, where the CPU has
    /// FMA) or not.
    #[inline(always)]
    fn advance_any<const FUSED: bool, S: States + ?Sized, O: Outputs + ?Sized>(
        &self,
        heads: Range<usize>,
        states: &mut S,
        out: &mut O,
    ) {
        let (p, n) = (self.head_dim, self.state);
        let ch = self.heads * p + 2 * self.groups * n;
        let per_group = self.heads / self.groups;
        for t in 0..self.from.len() {
            let xbc = &self.xbc[t * ch..(t + 1) * ch];
            let (x, bc) = xbc.split_at(self.heads * p);
            let (b, c) = bc.split_at(self.groups * n);
            let dt = &self.dt[t * self.heads..(t + 1) * self.heads];
            let (old, new) = states.pair(self.from[t], self.home[t]);
            let y = out.row(t);
            for (k, h) in heads.clone().enumerate() {
                let step = softplus(dt[h]);
                let decay = (step * self.a[h]).exp();
                let g = h / per_group;
                let (bg, cg) = (&b[g * n..(g + 1) * n], &c[g * n..(g + 1) * n]);
                for i in 0..p {
                    let at = (k * p + i) * n;
                    let xi = x[h * p + i];
                    let xs = xi * step;
                    let row = &mut new[at..at + n];
                    let sum = match old {
                        Some(o) => {
                            update_dot::<FUSED>(row, Some(&o[at..at + n]), decay, xs, bg, cg)
                        }
                        None => update_dot::<FUSED>(row, None, decay, xs, bg, cg),
                    };
                    y[k * p + i] = madd::<FUSED>(self.d[h], xi, sum);
                }
            }
        }
    }
}

/// `row ← decay·old + xs·b` (`old`: `row` itself when `None`), returning `Σ row·c` in
/// [`LANES`] partial sums (whole groups of lanes as arrays, so that they vectorize).
#[inline(always)]
fn update_dot<const FUSED: bool>(
    row: &mut [f32],
    old: Option<&[f32]>,
    decay: f32,
    xs: f32,
    b: &[f32],
    c: &[f32],
) -> f32 {
    let n = row.len();
    let (b, c) = (&b[..n], &c[..n]);
    let mut acc = [0f32; LANES];
    let lanes = |r: &mut [f32; LANES],
                 o: &[f32; LANES],
                 b: &[f32; LANES],
                 c: &[f32; LANES],
                 acc: &mut [f32; LANES]| {
        for l in 0..LANES {
            let s = madd::<FUSED>(decay, o[l], xs * b[l]);
            r[l] = s;
            acc[l] = madd::<FUSED>(s, c[l], acc[l]);
        }
    };
    let whole = n / LANES * LANES;
    let (rows, bs, cs) = (
        row[..whole].chunks_exact_mut(LANES),
        b[..whole].chunks_exact(LANES),
        c[..whole].chunks_exact(LANES),
    );
    let arr = |x: &[f32]| -> [f32; LANES] { x.try_into().expect("whole lanes") };
    match old {
        Some(o) => {
            for ((r, o), (b, c)) in rows.zip(o[..whole].chunks_exact(LANES)).zip(bs.zip(cs)) {
                let r: &mut [f32; LANES] = r.try_into().expect("whole lanes");
                lanes(r, &arr(o), &arr(b), &arr(c), &mut acc);
            }
        }
        None => {
            for (r, (b, c)) in rows.zip(bs.zip(cs)) {
                let r: &mut [f32; LANES] = r.try_into().expect("whole lanes");
                let o = *r;
                lanes(r, &o, &arr(b), &arr(c), &mut acc);
            }
        }
    }
    let mut tail = 0f32;
    for j in whole..n {
        let o = old.map_or(row[j], |o| o[j]);
        let s = madd::<FUSED>(decay, o, xs * b[j]);
        row[j] = s;
        tail = madd::<FUSED>(s, c[j], tail);
    }
    acc.iter().sum::<f32>() + tail
}

/// `ln(1 + eˣ)`, as ggml computes it (linear above 20).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

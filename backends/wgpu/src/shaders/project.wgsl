// A linear's input through its weights: out = x·Wᵀ, for up to WAYS projections of one
// input in one dispatch (a layer's q/k/v, its gate/up). Two entry points:
//   rows_main  : few tokens (decode, a small verify batch): `lanes` invocations per output
//                row and token reading the row together, all projections in one dispatch;
//                their outputs optionally rotated (RoPE) and stored heads-major.
//   linear_main: many tokens (prefill): a tiled matrix product, all projections in one
//                dispatch, stored plainly (linear_wide_main: the same in larger tiles);
//                where its inner dimension is split (p.lanes parts), each part's sums go
//                to `parts` and
//   splits_main: adds them, one invocation an output.
// The Rust side generates this module's weight, output and bias bindings for WAYS (1, or 3
// where the adapter allows 13 storage bindings), puts weights.wgsl before it and one of
// reduce_subgroup.wgsl (where the adapter has subgroup operations) or reduce_workgroup.wgsl
// after it: `group_sum`, `lane_sums` and the rows_main entry point that calls `rows`.
//
// Projection s has rows [start_s, end_s) of the dispatch's rows (start_0 = 0; the host
// starts each on a workgroup's first row (rows_main) or tile's (linear_main), so a
// workgroup's rows are one projection's and the projection, chosen from the workgroup id,
// is uniform across it), its weight in w_s (dtype (fmts >> 8s) & 255, as weight_at's flag),
// out_s, bias_s. Output o (of n_s) of token t is stored at t·n_s + row0 + o, n_s being
// n_out when given (a part of a weight split over bindings, row0 its first row) else the
// projection's rows; or heads-major at ((o / hd)·T + t)·hd + o % hd (HEADS_OUT).

struct Params {
    end0: u32, end1: u32, end2: u32, cols: u32,
    row0: u32, n_out: u32, fmts: u32, mode: u32,
    total: u32, lanes: u32, hd: u32, eps: f32, // lanes: linear_main's splits
    idx0: u32, idx1: u32, start1: u32, start2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> aux: array<f32>;
@group(0) @binding(3) var<storage, read> idx: array<u32>;
// A split linear_main's sums: [split][token][dispatch row].
@group(0) @binding(4) var<storage, read_write> parts: array<f32>;
//@WAYS

// `mode` bits. The input is `a` (T x cols), or rms_norm(a)·aux (a block's normed input, the
// norm computed by the kernel's own workgroups), silu(a)·aux (an MLP's gated product, a the
// gate and aux the up projection), or `a` heads-major ([cols / hd, T, hd], attention's
// output) read as its merge. Projection s adds bias_s when bit BIAS << s is set; ACCUMULATE
// adds what the output holds (a residual). ROPE rotates projections 0 and 1 (q and k) pair
// by pair, rotate-half or INTERLEAVED, at the positions at idx0 with the inverse
// frequencies at idx1 (hd / 2 of them), before HEADS_OUT stores them. STAGED: rows_main
// makes the input once per workgroup, in workgroup memory.
const BIAS: u32 = 1u;
const ACCUMULATE: u32 = 8u;
const NORMED: u32 = 16u;
const GATED: u32 = 32u;
const HEADS: u32 = 64u;
const HEADS_OUT: u32 = 128u;
const ROPE: u32 = 256u;
const INTERLEAVED: u32 = 512u;
const STAGED: u32 = 1024u;

// The projection being computed (which binding `wb`, `out_get`, `out_set`, `bias_at` use).
var<private> sel: u32;

// 1/rms of the token whose values a NORMED linear's invocation reads, which xin applies (set
// by its entry point; 1 where rows_main stages the input and scales its sums instead).
var<private> norm_inv: f32;

// Where value c of token t is in a heads-major [c / hd, T, hd] array.
fn heads_at(t: u32, c: u32) -> u32 {
    return ((c / p.hd) * p.total + t) * p.hd + c % p.hd;
}

// Value c of token t's input, as p.mode says.
fn xin(t: u32, c: u32) -> f32 {
    let i = t * p.cols + c;
    if (p.mode & GATED) != 0u {
        let g = a[i];
        return g / (1.0 + exp(-g)) * aux[i];
    }
    if (p.mode & NORMED) != 0u {
        return a[i] * norm_inv * aux[c];
    }
    if (p.mode & HEADS) != 0u {
        return a[heads_at(t, c)];
    }
    return a[i];
}

// Values c .. c + 4 of token t's input (c a multiple of 4): a plain input, or heads-major
// with heads a multiple of 4 wide, read from one place (one head's), the others by xin.
fn xin4(t: u32, c: u32) -> vec4<f32> {
    var i = t * p.cols + c;
    let heads = (p.mode & HEADS) != 0u;
    if (p.mode & (GATED | NORMED)) != 0u || (heads && p.hd % 4u != 0u) {
        return vec4<f32>(xin(t, c), xin(t, c + 1u), xin(t, c + 2u), xin(t, c + 3u));
    }
    if heads { i = heads_at(t, c); }
    return vec4<f32>(a[i], a[i + 1u], a[i + 2u], a[i + 3u]);
}

fn start(s: u32) -> u32 {
    switch s {
        case 1u: { return p.start1; }
        case 2u: { return p.start2; }
        default: { return 0u; }
    }
}

fn end(s: u32) -> u32 {
    switch s {
        case 1u: { return p.end1; }
        case 2u: { return p.end2; }
        default: { return p.end0; }
    }
}

// Selects the projection whose rows start at or before dispatch row r (and its weight's
// dtype).
fn select_row(r: u32) {
    sel = select(select(0u, 1u, r >= p.start1), 2u, r >= p.start2);
    set_fmt((p.fmts >> (8u * sel)) & 255u);
}

// Output o of token t of projection `sel`, its bias added.
fn biased(o: u32, acc: f32) -> f32 {
    if (p.mode & (BIAS << sel)) != 0u { return acc + bias_at(p.row0 + o); }
    return acc;
}

// Stores v as output o of token t of projection `sel` (adding the residual when ACCUMULATE).
fn put(t: u32, o: u32, v: f32) {
    var i: u32;
    if (p.mode & HEADS_OUT) != 0u {
        i = heads_at(t, o);
    } else {
        let n = select(end(sel) - start(sel), p.n_out, p.n_out != 0u);
        i = t * n + p.row0 + o;
    }
    var w = v;
    if (p.mode & ACCUMULATE) != 0u { w += out_get(i); }
    out_set(i, w);
}

// Each row's total after `lane_sums`, at its first lane's invocation.
var<workgroup> red: array<f32, 256>;

// Invocations in a workgroup of rows_main (at most 256; the host sets it per adapter).
override GROUP: u32 = 256u;

// With STAGED (the host sets it where the input is made and a workgroup computes several
// rows), rows_main stages its token's input in workgroup memory XCHUNK values at a time,
// each made once per workgroup (x·norm, gated or merged as p.mode says; a normed input's
// 1/rms scales the lanes' sums) rather than by every row's lanes as they read it.
const XCHUNK: u32 = 2048u;
var<workgroup> xs: array<vec4<f32>, 512>; // XCHUNK / 4

// Input values c .. c + 4 of token t for xs, those at or past `end` 0.
fn stage4(t: u32, c: u32, end: u32) -> vec4<f32> {
    if c + 3u < end { return xin4(t, c); }
    var v = vec4<f32>(0.0);
    for (var k = 0u; k < 4u; k++) {
        if c + k < end { v[k] = xin(t, c + k); }
    }
    return v;
}

// Input value c of token t, from xs when staged (c0 the staged chunk's first value).
fn x1(t: u32, c: u32, c0: u32) -> f32 {
    if (p.mode & STAGED) != 0u { return xs[(c - c0) / 4u][(c - c0) % 4u]; }
    return xin(t, c);
}

// Input values c .. c + 4 of token t (c a multiple of 4), from xs when staged.
fn x4(t: u32, c: u32, c0: u32) -> vec4<f32> {
    if (p.mode & STAGED) != 0u { return xs[(c - c0) / 4u]; }
    return xin4(t, c);
}

// `acc` plus row o's products with input values c0 .. c0 + n of token t, the lane's
// share: values (dense dtypes) or spans (block formats) lane, lane + lanes, ... of them,
// added in turn, the same values in the same order however the row is chunked (chunks
// start on a multiple of XCHUNK: of the lanes for values, of 32 for spans).
fn row_dot(o: u32, t: u32, c0: u32, n: u32, lane: u32, lanes: u32, acc0: f32) -> f32 {
    var acc = acc0;
    if fmt < 3u {
        for (var i = c0 + lane; i < c0 + n; i += lanes) {
            acc += x1(t, i, c0) * weight_at(o * p.cols + i);
        }
    } else {
        // Lane-consecutive spans (`span`): neighbouring lanes read neighbouring code words,
        // each lane decoding its span's scales once. A lane's first span in the chunk is
        // the first that is its (lane mod lanes): a chunk's spans need not be a multiple
        // of the lanes. (Quads, 4 values a step, each decoding its slice's scales, ran at
        // 0.61-0.94x of spans on an H200, 2026-12-04.)
        let first = o * (p.cols / 32u);
        let s0 = c0 / 32u;
        for (var s = s0 + (lane + lanes - s0 % lanes) % lanes; s < (c0 + n) / 32u; s += lanes) {
            acc += span_dot(t, first + s, 32u * s, c0);
        }
    }
    return acc;
}

// Span sp of the weight (its first value at `at` in the row) times token t's input: per
// half, the codes' products with the input and the input's sum, each scaled once.
fn span_dot(t: u32, sp: u32, at: u32, c0: u32) -> f32 {
    let h = span(sp);
    let x0 = at - 32u * h.lead;
    var da = 0.0;
    var db = 0.0;
    var sa = vec4<f32>(0.0);
    var sb = vec4<f32>(0.0);
    for (var k = 0u; k < 4u; k++) {
        let c = span_codes(h, k);
        let xa = x4(t, x0 + h.xa + 4u * k, c0);
        let xb = x4(t, x0 + h.xb + 4u * k, c0);
        da += dot(c.a, xa);
        db += dot(c.b, xb);
        sa += xa;
        sb += xb;
    }
    let ones = vec4<f32>(1.0);
    return h.scale.x * da + h.offset.x * dot(sa, ones) + h.scale.y * db + h.offset.y * dot(sb, ones);
}

// The row of projection `sel` that its slot k computes: slots pair up the rows a rotation
// mixes ((i, i + hd/2), or (2i, 2i + 1) INTERLEAVED), as 2m and 2m + 1, when ROPE applies
// to the projection; else slot k is row k.
fn slot_row(k: u32) -> u32 {
    if (p.mode & ROPE) == 0u || sel > 1u { return k; }
    let half = p.hd / 2u;
    let m = k / 2u;
    let i = m % half;
    let base = (m / half) * p.hd;
    if (p.mode & INTERLEAVED) != 0u { return base + 2u * i + k % 2u; }
    return base + i + (k % 2u) * half;
}

// rows_main: each workgroup of GROUP invocations computes GROUP / lanes rows (slots) of one
// token (row group x + y · workgroups.x, token z), `lanes` invocations a row striding over
// its values (dense dtypes) or its spans (block formats), so that neighbouring lanes read
// neighbouring weight words and x values; `lid` numbers the workgroup's invocations so that
// a row's lanes are consecutive and, where subgroups are used, a subgroup's too. The lanes'
// sums are added by `lane_sums`. The workgroup's projection is its first row's
// (projections start on a workgroup's first row).
fn rows(wg: vec3<u32>, nw: vec3<u32>, lid: u32) {
    let lanes = p.lanes;
    let per = GROUP / lanes;
    let r = (wg.x + wg.y * nw.x) * per + lid / lanes;
    let lane = lid % lanes;
    let t = wg.z;
    let cols = p.cols;
    // A normed input read directly has 1/rms in each value (xin), from a pass of its own;
    // a staged one is staged unnormed, x·norm, its squares summed in the same pass, and
    // each lane's sum scaled by 1/rms.
    let normed = (p.mode & NORMED) != 0u;
    let staged = (p.mode & STAGED) != 0u;
    var squares = 0.0;
    norm_inv = 1.0;
    if normed && !staged {
        for (var i = lid; i < cols; i += GROUP) {
            let v = a[t * cols + i];
            squares += v * v;
        }
        norm_inv = 1.0 / sqrt(group_sum(squares, lid) / f32(cols) + p.eps);
    }
    select_row((wg.x + wg.y * nw.x) * per);
    let live = r < end(sel);
    var o = 0u;
    if live { o = slot_row(r - start(sel)); }
    var acc = 0.0;
    if staged {
        for (var c0 = 0u; c0 < cols; c0 += XCHUNK) {
            let n = min(XCHUNK, cols - c0);
            for (var i = lid; 4u * i < n; i += GROUP) {
                let c = c0 + 4u * i;
                if normed {
                    var v = vec4<f32>(0.0);
                    var g = vec4<f32>(0.0);
                    for (var k = 0u; k < 4u; k++) {
                        if c + k < c0 + n {
                            v[k] = a[t * cols + c + k];
                            g[k] = aux[c + k];
                        }
                    }
                    squares += dot(v, v);
                    xs[i] = v * g;
                } else {
                    xs[i] = stage4(t, c, c0 + n);
                }
            }
            workgroupBarrier();
            if live { acc = row_dot(o, t, c0, n, lane, lanes, acc); }
            workgroupBarrier();
        }
        if normed { acc *= 1.0 / sqrt(group_sum(squares, lid) / f32(cols) + p.eps); }
    } else if live {
        acc = row_dot(o, t, 0u, cols, lane, lanes, 0.0);
    }
    lane_sums(acc, lid, lanes);
    if lane != 0u || !live { return; }
    let v = biased(o, red[lid]);
    if (p.mode & ROPE) == 0u || sel > 1u {
        put(t, o, v);
        return;
    }
    // A rotated pair: the even slot's first lane stores both rows.
    if ((r - start(sel)) & 1u) == 1u { return; }
    let o2 = slot_row(r - start(sel) + 1u);
    let v2 = biased(o2, red[lid + lanes]);
    // The pair's index among the head's hd / 2 (o is its first row).
    let j = o % p.hd;
    let i = select(j, j / 2u, (p.mode & INTERLEAVED) != 0u);
    let ang = f32(bitcast<i32>(idx[p.idx0 + t])) * bitcast<f32>(idx[p.idx1 + i]);
    let c = cos(ang);
    let sn = sin(ang);
    put(t, o, v * c - v2 * sn);
    put(t, o2, v2 * c + v * sn);
}

// linear_main: many tokens' projections, rows [start_s, end_s) of the dispatch's rows (each
// projection starting on a tile's first row, so that a workgroup's rows are one
// projection's). A tiled matrix product: each workgroup computes a TILE x TILE block of
// outputs (dispatch rows r0 = wg.x · TILE, tokens t0 = wg.y · TILE), each invocation 4 rows
// x 4 tokens of it in four vec4 accumulators (explicit, not an indexed array: an array
// indexed in a loop may live in memory rather than registers). Per KSTEP-wide step of the
// inner dimension the workgroup stores the W tile (dequantized as it was loaded, `quad`,
// each slice's scales once) and the x tile in workgroup memory; every invocation then reads
// one vec4 of 4 rows and one of 4 tokens per 16 products from there, while its loads of
// the next step's tiles are in flight.
const TILE: u32 = 64u;
const KSTEP: u32 = 32u;
var<workgroup> wtile: array<vec4<f32>, 512>; // [KSTEP][TILE / 4] of W: 4 neighbouring rows
var<workgroup> xtile: array<vec4<f32>, 512>; // [KSTEP][TILE / 4] of x: 4 neighbouring tokens

// Values k0 + 4q .. k0 + 4q + 4 of row o (of `rows`) of projection `sel` (h: the 32-value
// slice holding them, for block formats); 0 past the rows.
fn tile_quad(o: u32, rows: u32, k0: u32, q: u32, h: Slice) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    if o < rows {
        if fmt < 3u {
            for (var i = 0u; i < 4u; i++) {
                let c = k0 + 4u * q + i;
                if c < p.cols { v[i] = weight_at(o * p.cols + c); }
            }
        } else {
            v = quad(h, (k0 % 32u) / 4u + q);
        }
    }
    return v;
}

// A step's loads from value k on: values 4q .. 4q + 8 of W row o (w0, w1) and xk .. xk + 8
// of token t (x0, x1), held in registers until the tiles are free.
struct Step {
    w0: vec4<f32>,
    w1: vec4<f32>,
    x0: vec4<f32>,
    x1: vec4<f32>,
}

fn load_step(o: u32, rows: u32, k: u32, q: u32, h: Slice, t: u32, xk: u32) -> Step {
    return Step(tile_quad(o, rows, k, q, h), tile_quad(o, rows, k, q + 1u, h),
                tile_x4(t, k + xk), tile_x4(t, k + xk + 4u));
}

// Row o's slice holding value k where k starts one (block formats), else h.
fn next_slice(o: u32, rows: u32, k: u32, h: Slice) -> Slice {
    if fmt >= 3u && o < rows && k % 32u == 0u { return slice(o * (p.cols / 32u) + k / 32u); }
    return h;
}

// Workgroup z's split of the inner dimension: values [x, y), whole KSTEP steps of it (the
// host makes none empty).
fn split_range(z: u32) -> vec2<u32> {
    let per = ((p.cols + KSTEP - 1u) / KSTEP + p.lanes - 1u) / p.lanes;
    let k_begin = z * per * KSTEP;
    return vec2<u32>(k_begin, min(k_begin + per * KSTEP, p.cols));
}

// Input values c .. c + 4 of token t, 0 past the tokens or the values.
fn tile_x4(t: u32, c: u32) -> vec4<f32> {
    if t < p.total { return stage4(t, c, p.cols); }
    return vec4<f32>(0.0);
}

// Sets norm_inv to 1/rms of token t (tile token xt, the invocation one of its `loaders`
// consecutive ones, which share its sum of squares through wtile). In uniform control flow.
fn tile_norm(lid: u32, t: u32, xt: u32, loaders: u32) {
    var s = 0.0;
    if t < p.total {
        for (var i = lid % loaders; i < p.cols; i += loaders) {
            let v = a[t * p.cols + i];
            s += v * v;
        }
    }
    wtile[lid].x = s;
    workgroupBarrier();
    var sum = 0.0;
    for (var j = 0u; j < loaders; j++) {
        sum += wtile[loaders * xt + j].x;
    }
    norm_inv = 1.0 / sqrt(sum / f32(p.cols) + p.eps);
    workgroupBarrier();
}

// Stores step s in the tiles, `n` vec4s a k-row (a tile's outputs / 4): W row lr's values
// 4q .. 4q + 8 as component lr % 4 of eight k-rows' vec4s, token xt's values xk .. xk + 8
// likewise.
fn store_step(n: u32, lr: u32, q: u32, xt: u32, xk: u32, s: Step) {
    let w = 4u * q * n + lr / 4u;
    let c = lr % 4u;
    wtile[w][c] = s.w0.x;
    wtile[w + n][c] = s.w0.y;
    wtile[w + 2u * n][c] = s.w0.z;
    wtile[w + 3u * n][c] = s.w0.w;
    wtile[w + 4u * n][c] = s.w1.x;
    wtile[w + 5u * n][c] = s.w1.y;
    wtile[w + 6u * n][c] = s.w1.z;
    wtile[w + 7u * n][c] = s.w1.w;
    let xi = xk * n + xt / 4u;
    let xc = xt % 4u;
    xtile[xi][xc] = s.x0.x;
    xtile[xi + n][xc] = s.x0.y;
    xtile[xi + 2u * n][xc] = s.x0.z;
    xtile[xi + 3u * n][xc] = s.x0.w;
    xtile[xi + 4u * n][xc] = s.x1.x;
    xtile[xi + 5u * n][xc] = s.x1.y;
    xtile[xi + 6u * n][xc] = s.x1.z;
    xtile[xi + 7u * n][xc] = s.x1.w;
}

// The outputs of local rows o .. o + 4 (dispatch rows r ..) for tokens t .. t + 4, one vec4
// a row: stored (put_tile), or to `parts` when the inner dimension is split.
fn put_quad(z: u32, r: u32, o: u32, rows: u32, t: u32, v0: vec4<f32>, v1: vec4<f32>,
            v2: vec4<f32>, v3: vec4<f32>) {
    if p.lanes > 1u {
        part_tile(z, r, o < rows, t, v0);
        part_tile(z, r + 1u, o + 1u < rows, t, v1);
        part_tile(z, r + 2u, o + 2u < rows, t, v2);
        part_tile(z, r + 3u, o + 3u < rows, t, v3);
        return;
    }
    put_tile(o, rows, t, v0);
    put_tile(o + 1u, rows, t, v1);
    put_tile(o + 2u, rows, t, v2);
    put_tile(o + 3u, rows, t, v3);
}

@compute @workgroup_size(256)
fn linear_main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r0 = wg.x * TILE;
    select_row(r0);
    let rows = end(sel) - start(sel);
    let o0 = r0 - start(sel);
    let t0 = wg.y * TILE;
    let ty = lid / 16u; // rows 4·ty..
    let tx = lid % 16u; // tokens 4·tx..
    // Row 4·ty + i's products with the 4 tokens.
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    // The W row and the two quads (of 8 per slice) this invocation loads.
    let lr = lid % TILE;
    let lq = (lid / TILE) * 2u;
    let o = o0 + lr;
    // The x token and the 8 values of a step this invocation loads.
    let xt = lid / 4u;
    let xk = (lid % 4u) * 8u;
    let t = t0 + xt;
    if (p.mode & NORMED) != 0u { tile_norm(lid, t, xt, 4u); }
    let range = split_range(wg.z);
    var h = next_slice(o, rows, range.x, Slice());
    var step = load_step(o, rows, range.x, lq, h, t, xk);
    for (var k0 = range.x; k0 < range.y; k0 += KSTEP) {
        store_step(TILE / 4u, lr, lq, xt, xk, step);
        workgroupBarrier();
        let k1 = k0 + KSTEP;
        if k1 < range.y {
            h = next_slice(o, rows, k1, h);
            step = load_step(o, rows, k1, lq, h, t, xk);
        }
        for (var kk = 0u; kk < KSTEP; kk++) {
            let wv = wtile[kk * (TILE / 4u) + ty];
            let xv = xtile[kk * (TILE / 4u) + tx];
            acc0 += wv.x * xv;
            acc1 += wv.y * xv;
            acc2 += wv.z * xv;
            acc3 += wv.w * xv;
        }
        workgroupBarrier();
    }
    put_quad(wg.z, r0 + 4u * ty, o0 + 4u * ty, rows, t0 + 4u * tx, acc0, acc1, acc2, acc3);
}

// linear_wide_main: linear_main in tiles of WIDE x WIDE outputs (dispatch rows r0 = wg.x ·
// WIDE, tokens t0 = wg.y · WIDE), each invocation 8 rows x 8 tokens of it (rows 4·ty and
// 64 + 4·ty on, tokens 4·tx and 64 + 4·tx on) in sixteen vec4 accumulators, over steps
// of WSTEP values: four vec4 reads of workgroup memory per 64 products where linear_main
// has two per 16, and each weight value loaded (and dequantized) serves twice the tokens.
// The same tiles of workgroup memory, the same split of the inner dimension (KSTEP units)
// and the same stores as linear_main; `Tuning::wide` picks it.
const WIDE: u32 = 128u;
const WSTEP: u32 = 16u;

@compute @workgroup_size(256)
fn linear_wide_main(@builtin(workgroup_id) wg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let r0 = wg.x * WIDE;
    select_row(r0);
    let rows = end(sel) - start(sel);
    let o0 = r0 - start(sel);
    let t0 = wg.y * WIDE;
    let ty = lid / 16u;
    let tx = lid % 16u;
    // aij / bij: row 4·ty + i / 64 + 4·ty + i, tokens 4·tx.. (j = 0) or 64 + 4·tx.. (j = 1).
    var a00 = vec4<f32>(0.0); var a01 = vec4<f32>(0.0);
    var a10 = vec4<f32>(0.0); var a11 = vec4<f32>(0.0);
    var a20 = vec4<f32>(0.0); var a21 = vec4<f32>(0.0);
    var a30 = vec4<f32>(0.0); var a31 = vec4<f32>(0.0);
    var b00 = vec4<f32>(0.0); var b01 = vec4<f32>(0.0);
    var b10 = vec4<f32>(0.0); var b11 = vec4<f32>(0.0);
    var b20 = vec4<f32>(0.0); var b21 = vec4<f32>(0.0);
    var b30 = vec4<f32>(0.0); var b31 = vec4<f32>(0.0);
    // The W row and the two quads (of a step's 4) this invocation loads.
    let lr = lid % WIDE;
    let lq = (lid / WIDE) * 2u;
    let o = o0 + lr;
    // The x token and the 8 values of a step this invocation loads.
    let xt = lid / 2u;
    let xk = (lid % 2u) * 8u;
    let t = t0 + xt;
    if (p.mode & NORMED) != 0u { tile_norm(lid, t, xt, 2u); }
    let range = split_range(wg.z);
    var h = next_slice(o, rows, range.x, Slice());
    var step = load_step(o, rows, range.x, lq, h, t, xk);
    for (var k0 = range.x; k0 < range.y; k0 += WSTEP) {
        store_step(WIDE / 4u, lr, lq, xt, xk, step);
        workgroupBarrier();
        let k1 = k0 + WSTEP;
        if k1 < range.y {
            h = next_slice(o, rows, k1, h);
            step = load_step(o, rows, k1, lq, h, t, xk);
        }
        for (var kk = 0u; kk < WSTEP; kk++) {
            let wa = wtile[kk * (WIDE / 4u) + ty];
            let wb = wtile[kk * (WIDE / 4u) + 16u + ty];
            let xa = xtile[kk * (WIDE / 4u) + tx];
            let xb = xtile[kk * (WIDE / 4u) + 16u + tx];
            a00 += wa.x * xa; a01 += wa.x * xb;
            a10 += wa.y * xa; a11 += wa.y * xb;
            a20 += wa.z * xa; a21 += wa.z * xb;
            a30 += wa.w * xa; a31 += wa.w * xb;
            b00 += wb.x * xa; b01 += wb.x * xb;
            b10 += wb.y * xa; b11 += wb.y * xb;
            b20 += wb.z * xa; b21 += wb.z * xb;
            b30 += wb.w * xa; b31 += wb.w * xb;
        }
        workgroupBarrier();
    }
    let ra = 4u * ty;
    let rb = 64u + 4u * ty;
    let ta = t0 + 4u * tx;
    let tb = t0 + 64u + 4u * tx;
    put_quad(wg.z, r0 + ra, o0 + ra, rows, ta, a00, a10, a20, a30);
    put_quad(wg.z, r0 + ra, o0 + ra, rows, tb, a01, a11, a21, a31);
    put_quad(wg.z, r0 + rb, o0 + rb, rows, ta, b00, b10, b20, b30);
    put_quad(wg.z, r0 + rb, o0 + rb, rows, tb, b01, b11, b21, b31);
}

// The dispatch's rows (the last projection's end; the ends of absent ones are 0).
fn dispatch_rows() -> u32 {
    return max(p.end0, max(p.end1, p.end2));
}

// Split z's sums of dispatch row r (a row of the projection when `live`) for tokens t .. t
// + 4 (those that exist) into `parts`.
fn part_tile(z: u32, r: u32, live: bool, t: u32, v: vec4<f32>) {
    if !live { return; }
    let rows = dispatch_rows();
    for (var j = 0u; j < 4u; j++) {
        if t + j < p.total { parts[(z * p.total + t + j) * rows + r] = v[j]; }
    }
}

// splits_main: output (token t, dispatch row r) of invocation t · rows + r, the splits'
// sums added in split order, then stored as linear_main stores an unsplit one.
@compute @workgroup_size(64)
fn splits_main(@builtin(global_invocation_id) g: vec3<u32>,
               @builtin(num_workgroups) nw: vec3<u32>) {
    let rows = dispatch_rows();
    let n = g.x + g.y * nw.x * 64u;
    if n >= rows * p.total { return; }
    let t = n / rows;
    let r = n % rows;
    select_row(r);
    if r >= end(sel) { return; }
    let o = r - start(sel);
    var acc = 0.0;
    for (var z = 0u; z < p.lanes; z++) {
        acc += parts[(z * p.total + t) * rows + r];
    }
    put(t, o, biased(o, acc));
}

// linear_main's outputs of row o (of `rows`) for tokens t .. t + 4 (those that exist).
fn put_tile(o: u32, rows: u32, t: u32, v: vec4<f32>) {
    if o >= rows { return; }
    for (var j = 0u; j < 4u; j++) {
        if t + j < p.total { put(t + j, o, biased(o, v[j])); }
    }
}

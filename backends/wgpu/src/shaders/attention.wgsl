// Attention over one layer's K/V pools, with kernels sharing one bind group. The f32
// arithmetic runs split over the keys (flash-decoding), in two passes:
//   flash_main   : for query row (hh, i) and a chunk of CHUNK keys: the chunk's largest
//                  score m, Σ e^{s−m} and Σ e^{s−m}·V, into `scores` (the partials)
//   combine_main : a row's chunks merged (rescaled to the row's largest score, with sinks
//                  e^{sink} of the query head counted in the sum): out[h, i, :]
// The int8-query arithmetic on q8/q4 keys, in four:
//   quantize_main: the query rows' int8 codes
//   scores_main  : s[hh, i, j] = scale · q[h, i] · K[kh, j]   (masked entries get NEG)
//   softmax_main : row-wise stable softmax of s in place        (masked entries become 0;
//                  with sinks, each row's sum also counts e^{sink} of its query head)
//   output_main  : out[h, i, dd] = Σ_j s[hh, i, j] · V[kh, j, dd]
// A query row that sees no key reads zeros. Pools are u32 words, row-major
// [heads, cells, row_words]; element decoding in decode().

struct Params {
    hq: u32, hkv: u32, t: u32, l: u32,
    d: u32, cells: u32, row_words: u32, dtype: u32,   // dtype: 0 f32, 1 f16, 2 bf16, 3 q8, 4 q4
    group: u32, mask_kind: u32, head0: u32, nheads: u32, // mask_kind: 0 none, 1 causal, 2 explicit
    scale: f32, rows_per_y: u32, int8: u32, sinks: u32, // int8: int8-query scores; sinks: 1 when bound
}

const NEG: f32 = -3.0e38;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> kp: array<u32>;
@group(0) @binding(3) var<storage, read> vp: array<u32>;
@group(0) @binding(4) var<storage, read> maskbits: array<u32>;
@group(0) @binding(5) var<storage, read_write> scores: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;
// int8-query only: per query row, QCODE_WORDS(d) words (see quantize_main).
@group(0) @binding(7) var<storage, read_write> qcodes: array<u32>;
// With p.sinks: a sink per query head (all Hq of them).
@group(0) @binding(8) var<storage, read> sinkv: array<f32>;

// A softmax's denominator: `total` (Σ e^{s−mx} over the visible keys) plus head h's sink
// e^{sink−mx} when the op has sinks and a key is visible (a row with none stays all zeros).
fn with_sink(total: f32, h: u32, mx: f32) -> f32 {
    if p.sinks != 0u && total > 0.0 { return total + exp(sinkv[h] - mx); }
    return total;
}

fn code_word(dd: u32) -> u32 {
    switch p.dtype {
        case 0u: { return dd; }
        case 1u, 2u: { return dd / 2u; }
        case 3u: { return dd / 4u; }
        default: { return dd / 8u; }
    }
}

fn meta_word(dd: u32) -> u32 {
    if p.dtype == 3u { return p.d / 4u + dd / p.group; }
    if p.dtype == 4u { return p.d / 8u + dd / p.group; }
    return 0u;
}

fn decode(cw: u32, mw: u32, dd: u32) -> f32 {
    switch p.dtype {
        case 0u: { return bitcast<f32>(cw); }
        case 1u: {
            let v = unpack2x16float(cw);
            return select(v.x, v.y, (dd & 1u) == 1u);
        }
        case 2u: { return bitcast<f32>(((cw >> (16u * (dd & 1u))) & 0xffffu) << 16u); }
        case 3u: {
            let m = unpack2x16float(mw);
            return m.y + f32((cw >> (8u * (dd & 3u))) & 0xffu) * m.x;
        }
        default: {
            let m = unpack2x16float(mw);
            return m.y + f32((cw >> (4u * (dd & 7u))) & 0xfu) * m.x;
        }
    }
}

fn row_base(h: u32, c: u32) -> u32 {
    return (h * p.cells + c) * p.row_words;
}

fn kelem(h: u32, c: u32, dd: u32) -> f32 {
    let b = row_base(h, c);
    return decode(kp[b + code_word(dd)], kp[b + meta_word(dd)], dd);
}

fn velem(h: u32, c: u32, dd: u32) -> f32 {
    let b = row_base(h, c);
    return decode(vp[b + code_word(dd)], vp[b + meta_word(dd)], dd);
}

fn visible(i: u32, j: u32) -> bool {
    if p.mask_kind == 0u { return true; }
    if p.mask_kind == 1u { return j + p.t <= p.l + i; }
    let bit = i * p.l + j;
    return ((maskbits[bit / 32u] >> (bit % 32u)) & 1u) == 1u;
}

// q·K[kh, j] in f32, K decoded per element; an f16 row (the default dtype) two words a
// step, its four products independent (a chain of d / 4 steps rather than d).
fn qk_f32(h: u32, i: u32, kh: u32, j: u32) -> f32 {
    let qb = (h * p.t + i) * p.d;
    if p.dtype == 1u {
        let b = row_base(kh, j);
        let words = p.d / 2u;
        var acc4 = vec4<f32>(0.0);
        var w = 0u;
        for (; w + 1u < words; w += 2u) {
            let k = vec4<f32>(unpack2x16float(kp[b + w]), unpack2x16float(kp[b + w + 1u]));
            let x = qb + 2u * w;
            acc4 += vec4<f32>(q[x], q[x + 1u], q[x + 2u], q[x + 3u]) * k;
        }
        if w < words {
            let k = unpack2x16float(kp[b + w]);
            acc4 += vec4<f32>(q[qb + 2u * w] * k.x, q[qb + 2u * w + 1u] * k.y, 0.0, 0.0);
        }
        return (acc4.x + acc4.y) + (acc4.z + acc4.w);
    }
    var acc = 0.0;
    for (var dd = 0u; dd < p.d; dd++) {
        acc += q[qb + dd] * kelem(kh, j, dd);
    }
    return acc;
}

@compute @workgroup_size(64)
fn scores_main(@builtin(global_invocation_id) g: vec3<u32>) {
    let j = g.x;
    let i = g.y;
    let hh = g.z;
    if j >= p.l || i >= p.t || hh >= p.nheads { return; }
    let h = p.head0 + hh;
    let kh = h / (p.hq / p.hkv);
    let idx = (hh * p.t + i) * p.l + j;
    if !visible(i, j) {
        scores[idx] = NEG;
        return;
    }
    scores[idx] = qk_int8(h, i, kh, j) * p.scale;
}

// The int8-query arithmetic (kvplug_core::Arithmetic::Int8Query): each query row quantized
// per 32-value block to int8 codes with an f32 block scale, integer dots against the stored
// q8/q4 key codes, block results scaled and summed in f32. Keys' groups are multiples of 32,
// so a block lies in one group: q·k over a block = s·(lo·Σc + scale·Σ c·code).
const QBLOCK: u32 = 32u;

// A query row's words in `qcodes`: d/4 words of codes (4 per word), then per block its f32
// scale, then per block Σ codes (i32).
fn qcode_words() -> u32 { return p.d / 4u + 2u * (p.d / QBLOCK); }

// The int8 code of `x` for block scale `s`: round(x / s) half away from zero, clamped to
// ±127 (s = 0 gives 0). The quotient only proposes the code (a GPU's division may be off by
// 2.5 ulp for a normal s); the products (m ± ½)·s, rounded once, decide it.
fn qcode(x: f32, s: f32) -> i32 {
    if s == 0.0 { return 0; }
    let a = abs(x);
    var m = trunc(a / s);
    if a >= (m + 0.5) * s {
        m += 1.0;
    } else if m > 0.0 && a < (m - 0.5) * s {
        m -= 1.0;
    }
    let c = i32(min(m, 127.0));
    return select(c, -c, x < 0.0);
}

// One invocation per (query row, block) over all Hq·T rows. q8 keys pack element e at byte
// e % 4 of word e / 4, so codes go in that order; q4 keys pack element e at nibble e % 8 of
// word e / 8, so each key word's even elements (its low nibbles) go to one code word and its
// odd ones (high nibbles) to the next.
@compute @workgroup_size(64)
fn quantize_main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let nb = p.d / QBLOCK;
    let n = (wg.x + wg.y * nwg.x) * 64u + lid;
    if n >= p.hq * p.t * nb { return; }
    let row = n / nb;
    let blk = n % nb;
    let src = row * p.d + blk * QBLOCK;
    var amax = 0.0;
    for (var e = 0u; e < QBLOCK; e++) { amax = max(amax, abs(q[src + e])); }
    // A scale below f32's normal range is taken as 0 (codes 0, an error of at most max|q|,
    // under 2^-119): devices may flush subnormals anywhere, and their division is unbounded.
    let s0 = amax / 127.0;
    let s = select(s0, 0.0, s0 < 1.17549435e-38);
    let dst = row * qcode_words();
    var sum = 0;
    for (var w = 0u; w < QBLOCK / 4u; w++) {
        var word = 0u;
        for (var b = 0u; b < 4u; b++) {
            var e = 4u * w + b;
            if p.dtype == 4u { e = 8u * (w / 2u) + 2u * b + (w & 1u); }
            let c = qcode(q[src + e], s);
            sum += c;
            word |= (bitcast<u32>(c) & 0xffu) << (8u * b);
        }
        qcodes[dst + blk * (QBLOCK / 4u) + w] = word;
    }
    qcodes[dst + p.d / 4u + blk] = bitcast<u32>(s);
    qcodes[dst + p.d / 4u + nb + blk] = bitcast<u32>(sum);
}

// q·K[kh, j] in the int8-query arithmetic, over the codes quantize_main wrote. q8 codes
// (0..255) enter the signed dot as code − 128 (the top bit flipped), added back as 128·Σc;
// q4 nibbles (0..15) enter it as they are.
fn qk_int8(h: u32, i: u32, kh: u32, j: u32) -> f32 {
    let nb = p.d / QBLOCK;
    let qb = (h * p.t + i) * qcode_words();
    let kb = row_base(kh, j);
    var acc = 0.0;
    for (var blk = 0u; blk < nb; blk++) {
        let sum = bitcast<i32>(qcodes[qb + p.d / 4u + nb + blk]);
        var dot = 0;
        var gm = 0u;
        if p.dtype == 3u {
            for (var w = 0u; w < 8u; w++) {
                let kw = kp[kb + blk * 8u + w] ^ 0x80808080u;
                dot += dot4I8Packed(qcodes[qb + blk * 8u + w], kw);
            }
            dot += 128 * sum;
            gm = kp[kb + p.d / 4u + blk * QBLOCK / p.group];
        } else {
            for (var w = 0u; w < 4u; w++) {
                let kw = kp[kb + blk * 4u + w];
                let qw = qb + blk * 8u + 2u * w;
                dot += dot4I8Packed(qcodes[qw], kw & 0x0f0f0f0fu);
                dot += dot4I8Packed(qcodes[qw + 1u], (kw >> 4u) & 0x0f0f0f0fu);
            }
            gm = kp[kb + p.d / 8u + blk * QBLOCK / p.group];
        }
        let m = unpack2x16float(gm);
        let s = bitcast<f32>(qcodes[qb + p.d / 4u + blk]);
        acc += s * (m.y * f32(sum) + m.x * f32(dot));
    }
    return acc;
}

var<workgroup> red: array<f32, 64>;

// The largest of red[0..64], by a tree; every invocation of the workgroup calls it (after
// writing its red[lid]) and gets the result.
fn reduce_max(lid: u32) -> f32 {
    workgroupBarrier();
    for (var k = 32u; k > 0u; k >>= 1u) {
        if lid < k { red[lid] = max(red[lid], red[lid + k]); }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// The sum of red[0..64], as reduce_max.
fn reduce_sum(lid: u32) -> f32 {
    workgroupBarrier();
    for (var k = 32u; k > 0u; k >>= 1u) {
        if lid < k { red[lid] = red[lid] + red[lid + k]; }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(64)
fn softmax_main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x + wg.y * p.rows_per_y;
    if r >= p.nheads * p.t { return; }
    let base = r * p.l;
    var m = NEG;
    for (var j = lid; j < p.l; j += 64u) { m = max(m, scores[base + j]); }
    red[lid] = m;
    let mx = reduce_max(lid);
    var sum = 0.0;
    for (var j = lid; j < p.l; j += 64u) {
        let v = scores[base + j];
        if v > NEG { sum += exp(v - mx); }
    }
    red[lid] = sum;
    let total = with_sink(reduce_sum(lid), p.head0 + r / p.t, mx);
    for (var j = lid; j < p.l; j += 64u) {
        let v = scores[base + j];
        var pr = 0.0;
        if v > NEG && total > 0.0 { pr = exp(v - mx) / total; }
        scores[base + j] = pr;
    }
}

// out[h, i, dd] for VALUES_PER_GROUP values dd of one query row (dd block x, query y, head z):
// KEY_LANES invocations per value split the keys between them, their sums added by a tree in
// workgroup memory, so a decode step's long key loop runs on many workgroups at once.
const KEY_LANES: u32 = 8u;
const VALUES_PER_GROUP: u32 = 64u / KEY_LANES;
@compute @workgroup_size(64)
fn output_main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    // Neighbouring invocations take neighbouring values of one V row.
    let dd = wg.x * VALUES_PER_GROUP + lid % VALUES_PER_GROUP;
    let lane = lid / VALUES_PER_GROUP;
    let i = wg.y;
    let hh = wg.z;
    let h = p.head0 + hh;
    let kh = h / (p.hq / p.hkv);
    let base = (hh * p.t + i) * p.l;
    var acc = 0.0;
    if dd < p.d {
        for (var j = lane; j < p.l; j += KEY_LANES) {
            let w = scores[base + j];
            if w != 0.0 { acc += w * velem(kh, j, dd); }
        }
    }
    red[lid] = acc;
    workgroupBarrier();
    for (var s = KEY_LANES / 2u; s > 0u; s >>= 1u) {
        if lane < s { red[lid] = red[lid] + red[lid + s * VALUES_PER_GROUP]; }
        workgroupBarrier();
    }
    if lane == 0u && dd < p.d { out[(h * p.t + i) * p.d + dd] = red[lid]; }
}

// Keys per chunk of flash_main (a workgroup's scores stay in workgroup memory).
const CHUNK: u32 = 256u;
var<workgroup> probs: array<f32, 256>;
// flash_main's per-lane value sums of a block: 64 / dl lanes of 4·dl values.
var<workgroup> vpart: array<f32, 256>;

// Values d0 .. d0 + 3 of V[h, c] (those past d are 0); d0 is a multiple of 4, so an f16
// row's four are two whole words.
fn vquad(h: u32, c: u32, d0: u32) -> vec4<f32> {
    if p.dtype == 1u && d0 + 3u < p.d {
        let b = row_base(h, c) + d0 / 2u;
        return vec4<f32>(unpack2x16float(vp[b]), unpack2x16float(vp[b + 1u]));
    }
    var v = vec4<f32>(0.0);
    for (var k = 0u; k < 4u; k++) {
        if d0 + k < p.d { v[k] = velem(h, c, d0 + k); }
    }
    return v;
}

fn chunks() -> u32 {
    return (p.l + CHUNK - 1u) / CHUNK;
}

// Where row r's partial of chunk c starts in `scores`: m, Σ e^{s−m}, then d sums.
fn partial(r: u32, c: u32) -> u32 {
    return (r * chunks() + c) * (p.d + 2u);
}

// Chunk x of the keys for query row y of head z (of this dispatch's heads). With one chunk
// (at most CHUNK keys, as a decode step's early positions) it writes the row's output as
// combine_main would, and the host dispatches no combine.
@compute @workgroup_size(64)
fn flash_main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = wg.x;
    let i = wg.y;
    let hh = wg.z;
    let h = p.head0 + hh;
    let kh = h / (p.hq / p.hkv);
    let j0 = c * CHUNK;
    let n = min(CHUNK, p.l - j0);
    var m = NEG;
    for (var jj = lid; jj < n; jj += 64u) {
        let j = j0 + jj;
        var s = NEG;
        if visible(i, j) { s = qk_f32(h, i, kh, j) * p.scale; }
        probs[jj] = s;
        m = max(m, s);
    }
    red[lid] = m;
    let mx = reduce_max(lid);
    var sum = 0.0;
    for (var jj = lid; jj < n; jj += 64u) {
        let s = probs[jj];
        var e = 0.0;
        if s > NEG { e = exp(s - mx); }
        probs[jj] = e;
        sum += e;
    }
    red[lid] = sum;
    let total = reduce_sum(lid);
    let at = partial(hh * p.t + i, c);
    let single = chunks() == 1u;
    let denom = with_sink(total, h, mx);
    // Σ e^{s−m}·V over the chunk, in blocks of 4·dl values (the whole row when d ≤ 256).
    // A lane of dl invocations covers a block, 4 neighbouring values each (a step of the
    // lane reads consecutive words of a row); the 64 / dl lanes split the chunk's keys, two
    // keys a step, so an invocation's chain of loads is about n·dl / 32 long rather than n.
    // The lanes' sums meet in `vpart`.
    let dl = min((p.d + 3u) / 4u, 64u);
    let lanes = 64u / dl;
    let g = lid / dl;
    for (var base = 0u; base < p.d; base += 4u * dl) {
        let d0 = base + 4u * (lid % dl);
        if g < lanes {
            var acc = vec4<f32>(0.0);
            var jj = g;
            for (; jj + lanes < n; jj += 2u * lanes) {
                let w0 = probs[jj];
                let w1 = probs[jj + lanes];
                if w0 != 0.0 { acc += w0 * vquad(kh, j0 + jj, d0); }
                if w1 != 0.0 { acc += w1 * vquad(kh, j0 + jj + lanes, d0); }
            }
            if jj < n && probs[jj] != 0.0 { acc += probs[jj] * vquad(kh, j0 + jj, d0); }
            for (var k = 0u; k < 4u; k++) { vpart[g * 4u * dl + d0 - base + k] = acc[k]; }
        }
        workgroupBarrier();
        for (var e = lid; e < 4u * dl && base + e < p.d; e += 64u) {
            var sum_v = 0.0;
            for (var gg = 0u; gg < lanes; gg++) { sum_v += vpart[gg * 4u * dl + e]; }
            if single {
                out[(h * p.t + i) * p.d + base + e] = select(0.0, sum_v / denom, total > 0.0);
            } else {
                scores[at + 2u + base + e] = sum_v;
            }
        }
        workgroupBarrier();
    }
    if lid == 0u && !single {
        scores[at] = mx;
        scores[at + 1u] = total;
    }
}

// Row x + y · rows_per_y of this dispatch's query rows: its chunks' partials merged.
@compute @workgroup_size(64)
fn combine_main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x + wg.y * p.rows_per_y;
    if r >= p.nheads * p.t { return; }
    let nc = chunks();
    var mx = NEG;
    for (var c = 0u; c < nc; c++) {
        let at = partial(r, c);
        if scores[at + 1u] > 0.0 { mx = max(mx, scores[at]); }
    }
    var total = 0.0;
    for (var c = 0u; c < nc; c++) {
        let at = partial(r, c);
        let l = scores[at + 1u];
        if l > 0.0 { total += l * exp(scores[at] - mx); }
    }
    let h = p.head0 + r / p.t;
    let i = r % p.t;
    let denom = with_sink(total, h, mx);
    for (var dd = lid; dd < p.d; dd += 64u) {
        var acc = 0.0;
        if total > 0.0 {
            for (var c = 0u; c < nc; c++) {
                let at = partial(r, c);
                let l = scores[at + 1u];
                if l > 0.0 { acc += scores[at + 2u + dd] * exp(scores[at] - mx); }
            }
            acc = acc / denom;
        }
        out[(h * p.t + i) * p.d + dd] = acc;
    }
}

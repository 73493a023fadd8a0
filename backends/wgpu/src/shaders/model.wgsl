// Model-graph operations on f32 activations (row-major). One bind group layout for all:
// params, a (f32, read), b (32-bit words, read: f32 values, or a weight in its stored
// dtype), idx (u32, read: the batch's index words; an op's start at idx0, a second array at
// idx1), out (f32, read_write), bias (f32, read: a linear's bias), aux (f32, read: the norm weight
// or the up projection a linear's input is made with). Flat invocation index:
// gid.x + gid.y · (workgroups.x · 64), so large element counts use a 2-D dispatch.

struct Params {
    n0: u32, n1: u32, n2: u32, n3: u32,
    flag: u32, total: u32, idx0: u32, idx1: u32,
    eps: f32, mode: u32, hd: u32, pad4: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<u32>;
@group(0) @binding(3) var<storage, read> idx: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> bias: array<f32>;
@group(0) @binding(6) var<storage, read> aux: array<f32>;

// A linear's `mode` bits: add `bias`; add to what `out` holds (a residual); its input is
// rms_norm(a)·aux (a block's normed input, the norm computed by the linear's own
// workgroups), silu(a)·aux (an MLP's gated product, a the gate and aux the up
// projection), or `a` heads-major ([n1 / hd, T, hd], attention's output) read as its merge.
const WITH_BIAS: u32 = 1u;
const ACCUMULATE: u32 = 2u;
const NORMED: u32 = 4u;
const GATED: u32 = 8u;
const HEADS: u32 = 16u;

// 1/rms of the token whose values a NORMED linear's invocation reads (set by its entry point).
var<private> norm_inv: f32;

// Value i (flat, [T, n1]) of a linear's input, as p.mode says.
fn xin(i: u32) -> f32 {
    if (p.mode & GATED) != 0u {
        let g = a[i];
        return g / (1.0 + exp(-g)) * aux[i];
    }
    if (p.mode & NORMED) != 0u {
        return a[i] * norm_inv * aux[i % p.n1];
    }
    if (p.mode & HEADS) != 0u {
        let c = i % p.n1;
        return a[((c / p.hd) * p.total + i / p.n1) * p.hd + c % p.hd];
    }
    return a[i];
}

// Stores output o (of n3) of token t of a linear, with its bias and residual as p.mode says.
fn store(t: u32, o: u32, acc: f32) {
    let i = t * p.n3 + o;
    var v = acc;
    if (p.mode & WITH_BIAS) != 0u { v += bias[o]; }
    if (p.mode & ACCUMULATE) != 0u { v += out[i]; }
    out[i] = v;
}

fn flat(g: vec3<u32>, nw: vec3<u32>) -> u32 {
    return g.x + g.y * nw.x * 64u;
}

// Byte o of `b` (little-endian words).
fn byte_at(o: u32) -> u32 {
    return (b[o >> 2u] >> ((o & 3u) * 8u)) & 0xffu;
}

// The f16 at even byte offset o of `b`, widened.
fn half_at(o: u32) -> f32 {
    return unpack2x16float(b[o >> 2u])[(o >> 1u) & 1u];
}

// Nibble j % 16 of the 16 code bytes at o: low nibbles hold values 0..16, high ones 16..32.
fn nibble(o: u32, j: u32) -> u32 {
    return (byte_at(o + (j & 15u)) >> (4u * (j >> 4u))) & 15u;
}

// The 5th bit of value j of a Q5_0/Q5_1 block, from its 32-bit qh at byte o.
fn bit5(o: u32, j: u32) -> u32 {
    return ((byte_at(o + (j >> 3u)) >> (j & 7u)) & 1u) << 4u;
}

// Sub-block j's 6-bit scale and minimum from the 12 packed bytes at o (Q4_K/Q5_K).
fn k4_scale_min(j: u32, o: u32) -> vec2<f32> {
    if j < 4u {
        return vec2<f32>(f32(byte_at(o + j) & 63u), f32(byte_at(o + j + 4u) & 63u));
    }
    let sc = (byte_at(o + j + 4u) & 15u) | ((byte_at(o + j - 4u) >> 6u) << 4u);
    let m = (byte_at(o + j + 4u) >> 4u) | ((byte_at(o + j) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}

// Element e of the weight in `b`, stored as p.flag says: 0 f32, 1 f16, 2 bf16 (two
// little-endian halves per word, the lower-addressed in the low bits), or a ggml block
// format dequantized as it is read (the arithmetic of the kit's blocks::dequantize_row):
// 3 q4_0, 4 q4_1, 5 q5_0, 6 q5_1, 7 q8_0, 8 q4_K, 9 q5_K, 10 q6_K.
fn weight_at(e: u32) -> f32 {
    switch p.flag {
        case 1u: {
            return unpack2x16float(b[e / 2u])[e % 2u];
        }
        case 2u: {
            let w = b[e / 2u];
            return bitcast<f32>(select(w << 16u, w & 0xffff0000u, e % 2u == 1u));
        }
        case 3u: {
            let o = (e / 32u) * 18u;
            return f32(i32(nibble(o + 2u, e % 32u)) - 8) * half_at(o);
        }
        case 4u: {
            let o = (e / 32u) * 20u;
            return f32(nibble(o + 4u, e % 32u)) * half_at(o) + half_at(o + 2u);
        }
        case 5u: {
            let o = (e / 32u) * 22u;
            let j = e % 32u;
            return f32(i32(nibble(o + 6u, j) | bit5(o + 2u, j)) - 16) * half_at(o);
        }
        case 6u: {
            let o = (e / 32u) * 24u;
            let j = e % 32u;
            return f32(nibble(o + 8u, j) | bit5(o + 4u, j)) * half_at(o) + half_at(o + 2u);
        }
        case 7u: {
            let o = (e / 32u) * 34u;
            let q = i32(byte_at(o + 2u + e % 32u) << 24u) >> 24u;
            return f32(q) * half_at(o);
        }
        case 8u, 9u: {
            let q5 = p.flag == 9u;
            let o = (e / 256u) * select(144u, 176u, q5);
            let j = e % 256u;
            let chunk = j / 64u;
            let hi = (j / 32u) % 2u;
            let l = j % 32u;
            let sub = 2u * chunk + hi;
            let sm = k4_scale_min(sub, o + 4u);
            let qs = o + select(16u, 48u, q5);
            var v = (byte_at(qs + chunk * 32u + l) >> (4u * hi)) & 15u;
            if q5 && ((byte_at(o + 16u + l) >> sub) & 1u) == 1u {
                v += 16u;
            }
            return half_at(o) * sm.x * f32(v) - half_at(o + 2u) * sm.y;
        }
        case 10u: {
            let o = (e / 256u) * 210u;
            let j = e % 256u;
            let n = j / 128u;
            let quarter = (j % 128u) / 32u;
            let l = j % 32u;
            let lo = (byte_at(o + n * 64u + l + 32u * (quarter & 1u)) >> (4u * (quarter >> 1u))) & 15u;
            let hb = (byte_at(o + 128u + n * 32u + l) >> (2u * quarter)) & 3u;
            let sc = i32(byte_at(o + 192u + n * 8u + l / 16u + 2u * quarter) << 24u) >> 24u;
            return half_at(o + 208u) * f32(sc) * f32(i32(lo | (hb << 4u)) - 32);
        }
        default: {
            return bitcast<f32>(b[e]);
        }
    }
}

// out[t, :] = weight row idx[idx0 + t] (an embedding lookup); n0 = width. The weight in `b`
// is the part holding rows [n1, n1 + n2) of the table: tokens outside it are left alone (the
// other parts' dispatches write them).
@compute @workgroup_size(64)
fn embed_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(g, nw);
    if i >= p.total { return; }
    let w = p.n0;
    let id = idx[p.idx0 + i / w];
    if id < p.n1 || id >= p.n1 + p.n2 { return; }
    out[i] = weight_at((id - p.n1) * w + i % w);
}

// out[t, :] = a[idx[idx0 + t], :]; n0 = width.
@compute @workgroup_size(64)
fn gather_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(g, nw);
    if i >= p.total { return; }
    let w = p.n0;
    out[i] = a[idx[p.idx0 + i / w] * w + i % w];
}

var<workgroup> red: array<f32, 64>;

// 1 / rms of the w values of `a` from `base` (eps = p.eps), summed by a workgroup of 64: a
// strided sum each, then a tree in `red`. Every invocation calls it and gets the result.
fn inv_rms(base: u32, w: u32, lid: u32) -> f32 {
    var s = 0.0;
    for (var i = lid; i < w; i += 64u) {
        let v = a[base + i];
        s += v * v;
    }
    red[lid] = s;
    workgroupBarrier();
    for (var k = 32u; k > 0u; k >>= 1u) {
        if lid < k { red[lid] = red[lid] + red[lid + k]; }
        workgroupBarrier();
    }
    let inv = 1.0 / sqrt(red[0] / f32(w) + p.eps);
    workgroupBarrier();
    return inv;
}

// out[r, :] = a[r, :] / rms(a[r, :]) · b; one workgroup per row of n0 = len(b) values.
@compute @workgroup_size(64)
fn rmsnorm_main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x;
    let w = p.n0;
    let inv = inv_rms(r * w, w, lid);
    for (var i = lid; i < w; i += 64u) {
        out[r * w + i] = a[r * w + i] * inv * bitcast<f32>(b[i]);
    }
}

// out[t, n2 + o] = Σ_i a[t, i] · W[o, i], W in `b` (dtype in flag); n0 = rows of W (this
// part's outputs), n1 = cols, n2 = the part's first output, n3 = outputs per token (a weight
// larger than one binding is split into parts of whole rows). T = total tokens. `store`
// adds the bias and the residual (p.mode).
//
// A tiled matrix product (prefill): each workgroup computes a TILE x TILE block of outputs
// (rows o0 = wg.x · TILE, tokens t0 = wg.y · TILE), each invocation 4 rows x 4 tokens of it.
// Per 32-wide step of the inner dimension the workgroup loads the W tile (dequantized as it
// is loaded, `quad`) and the x tile into workgroup memory, then every invocation reads 4 + 4
// values per 16 products from there.
const TILE: u32 = 64u;
const KSTEP: u32 = 32u;
var<workgroup> wtile: array<f32, 2048>; // [KSTEP][TILE] of W, inner index a row
var<workgroup> xtile: array<f32, 2048>; // [KSTEP][TILE] of x, inner index a token
@compute @workgroup_size(256)
fn linear_main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let cols = p.n1;
    let o0 = wg.x * TILE;
    let t0 = wg.y * TILE;
    let ty = lid / 16u; // rows 4·ty..
    let tx = lid % 16u; // tokens 4·tx..
    var acc: array<vec4<f32>, 4>;
    // The W row and the two quads (of 8 per slice) this invocation loads.
    let lr = lid % TILE;
    let lq = (lid / TILE) * 2u;
    // The x token and the 8 values of a step this invocation loads.
    let xt = lid / 4u;
    let xk = (lid % 4u) * 8u;
    if (p.mode & NORMED) != 0u {
        // Token xt's sum of squares by its 4 loaders, through wtile.
        var s = 0.0;
        if t0 + xt < p.total {
            for (var i = lid % 4u; i < cols; i += 4u) {
                let v = a[(t0 + xt) * cols + i];
                s += v * v;
            }
        }
        wtile[lid] = s;
        workgroupBarrier();
        let g = 4u * xt;
        let sum = (wtile[g] + wtile[g + 1u]) + (wtile[g + 2u] + wtile[g + 3u]);
        norm_inv = 1.0 / sqrt(sum / f32(cols) + p.eps);
        workgroupBarrier();
    }
    for (var k0 = 0u; k0 < cols; k0 += KSTEP) {
        let o = o0 + lr;
        for (var q = lq; q < lq + 2u; q++) {
            var v = vec4<f32>(0.0);
            if o < p.n0 {
                if p.flag < 3u {
                    for (var i = 0u; i < 4u; i++) {
                        let c = k0 + 4u * q + i;
                        if c < cols { v[i] = weight_at(o * cols + c); }
                    }
                } else {
                    v = quad(slice(o * (cols / 32u) + k0 / 32u), q);
                }
            }
            for (var i = 0u; i < 4u; i++) { wtile[(4u * q + i) * TILE + lr] = v[i]; }
        }
        let t = t0 + xt;
        for (var i = 0u; i < 8u; i++) {
            let c = k0 + xk + i;
            var x = 0.0;
            if t < p.total && c < cols { x = xin(t * cols + c); }
            xtile[(xk + i) * TILE + xt] = x;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < KSTEP; kk++) {
            let wv = vec4<f32>(wtile[kk * TILE + 4u * ty], wtile[kk * TILE + 4u * ty + 1u],
                               wtile[kk * TILE + 4u * ty + 2u], wtile[kk * TILE + 4u * ty + 3u]);
            let xv = vec4<f32>(xtile[kk * TILE + 4u * tx], xtile[kk * TILE + 4u * tx + 1u],
                               xtile[kk * TILE + 4u * tx + 2u], xtile[kk * TILE + 4u * tx + 3u]);
            for (var i = 0u; i < 4u; i++) { acc[i] += wv[i] * xv; }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let o = o0 + 4u * ty + i;
        for (var j = 0u; j < 4u; j++) {
            let t = t0 + 4u * tx + j;
            if o < p.n0 && t < p.total { store(t, p.n2 + o, acc[i][j]); }
        }
    }
}

// linear_main for few tokens (a matrix-vector product per token): each workgroup computes
// ROWS_PER_GROUP output rows of one token (row group o = x + y · workgroups.x, token t = z),
// LANES invocations per row striding over its values (dense dtypes) or its quads (block
// formats), so that neighbouring lanes read neighbouring weight words and x values: a
// GPU's loads of one step coalesce. (Lanes striding over whole slices read x 128 bytes
// apart, a cache line per lane; decode with that form streamed weights at about 60 GB/s on
// an H200, docs/benchmarks.md.) The lanes' sums are added by a tree in workgroup memory.
const LANES: u32 = 32u;
const ROWS_PER_GROUP: u32 = 64u / LANES;
@compute @workgroup_size(64)
fn linear_rows_main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let o = (wg.x + wg.y * nw.x) * ROWS_PER_GROUP + lid / LANES;
    let lane = lid % LANES;
    let t = wg.z;
    let cols = p.n1;
    if (p.mode & NORMED) != 0u {
        // The token's norm, summed as rmsnorm_main sums it.
        norm_inv = inv_rms(t * cols, cols, lid);
    }
    var acc = 0.0;
    if o < p.n0 {
        if p.flag < 3u {
            for (var i = lane; i < cols; i += LANES) {
                acc += xin(t * cols + i) * weight_at(o * cols + i);
            }
        } else {
            // Lane-consecutive quads (4 values of a slice): a step of the lanes reads
            // consecutive code words and consecutive x values, each lane decoding its
            // slice's scales (the lanes of one slice read the same bytes for them).
            let first = o * (cols / 32u);
            for (var q = lane; q < cols / 4u; q += LANES) {
                let i = t * cols + 4u * q;
                let x = vec4<f32>(xin(i), xin(i + 1u), xin(i + 2u), xin(i + 3u));
                acc += dot(quad(slice(first + q / 8u), q % 8u), x);
            }
        }
    }
    red[lid] = acc;
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if lane < s { red[lid] = red[lid] + red[lid + s]; }
        workgroupBarrier();
    }
    if lane == 0u && o < p.n0 { store(t, p.n2 + o, red[lid]); }
}

// Bytes o..o + 4 of `b` as one little-endian word, at any byte offset (blocks of 18, 22, 34
// or 210 bytes leave their fields unaligned).
fn word_at(o: u32) -> u32 {
    let s = (o & 3u) * 8u;
    let w = b[o >> 2u];
    if s == 0u { return w; }
    return (w >> s) | (b[(o >> 2u) + 1u] << (32u - s));
}

// Byte i of word w, as a signed value.
fn sbyte(w: u32, i: u32) -> f32 {
    return f32(i32(w << (24u - 8u * i)) >> 24u);
}

// A 32-value slice of a block-format weight: a whole block of the 32-value formats, or
// sub-block sl % 8 of super-block sl / 8 of the K-quants. Value j is
// scale[j / 16] · code_j + offset[j / 16], code_j read from the bytes at `codes` (and the
// high bits at `high`, or in the word `qh`) by `quad`.
struct Slice {
    scale: vec2<f32>,
    offset: vec2<f32>,
    codes: u32,
    high: u32,
    qh: u32,
    shift: u32,
}

// The scales, offsets and code positions of slice `sl` of the weight in `b`, the format in
// p.flag (as for weight_at; 3..=10).
fn slice(sl: u32) -> Slice {
    var h: Slice;
    switch p.flag {
        case 3u, 4u, 5u, 6u: {
            // q4_0, q4_1, q5_0, q5_1: [d, (m), (qh), 16 code bytes]; byte j holds value j in
            // its low nibble and value j + 16 in its high one, q5's fifth bits in qh.
            let o = sl * (18u + 2u * (p.flag - 3u));
            let has_m = p.flag == 4u || p.flag == 6u;
            let five = p.flag >= 5u;
            let d = half_at(o);
            let qh_at = o + select(2u, 4u, has_m);
            h.codes = qh_at + select(0u, 4u, five);
            if five { h.qh = word_at(qh_at); }
            var m = -select(8.0, 16.0, five) * d;
            if has_m { m = half_at(o + 2u); }
            h.scale = vec2<f32>(d);
            h.offset = vec2<f32>(m);
        }
        case 7u: {
            let o = sl * 34u;
            h.scale = vec2<f32>(half_at(o));
            h.codes = o + 2u;
        }
        case 8u, 9u: {
            // q4_K, q5_K: sub-block `sub` takes the low (even sub) or high nibbles of the
            // 32 code bytes of its pair, q5_K's fifth bit from bit `sub` of 32 qh bytes.
            let q5 = p.flag == 9u;
            let sub = sl % 8u;
            let o = (sl / 8u) * select(144u, 176u, q5);
            let sm = k4_scale_min(sub, o + 4u);
            h.scale = vec2<f32>(half_at(o) * sm.x);
            h.offset = vec2<f32>(-half_at(o + 2u) * sm.y);
            h.codes = o + select(16u, 48u, q5) + (sub / 2u) * 32u;
            h.shift = 4u * (sub % 2u);
            if q5 { h.high = o + 16u; }
            h.qh = sub;
        }
        default: {
            // q6_K: sub-block `sub` is quarter sub % 4 of half sub / 4: low bits from the
            // low (quarters 0, 1) or high nibbles of 32 ql bytes, high bits from 2-bit field
            // `quarter` of 32 qh bytes, an i8 scale per 16 values.
            let sub = sl % 8u;
            let o = (sl / 8u) * 210u;
            let n = sub / 4u;
            let quarter = sub % 4u;
            let sc = word_at(o + 192u + n * 8u + 2u * quarter);
            let d = half_at(o + 208u);
            h.scale = d * vec2<f32>(sbyte(sc, 0u), sbyte(sc, 1u));
            h.offset = -32.0 * h.scale;
            h.codes = o + n * 64u + 32u * (quarter & 1u);
            h.high = o + 128u + n * 32u;
            h.shift = 4u * (quarter >> 1u);
            h.qh = 2u * quarter;
        }
    }
    return h;
}

// Values 4k .. 4k + 3 (k < 8) of slice h, dequantized.
fn quad(h: Slice, k: u32) -> vec4<f32> {
    var c: vec4<f32>;
    switch p.flag {
        case 3u, 4u, 5u, 6u: {
            let lo = (unpack4xU8(word_at(h.codes + 4u * (k % 4u))) >> vec4<u32>(4u * (k / 4u))) & vec4<u32>(15u);
            let hi = (vec4<u32>(h.qh >> (4u * k)) >> vec4<u32>(0u, 1u, 2u, 3u)) & vec4<u32>(1u);
            c = vec4<f32>(lo | (hi << vec4<u32>(4u)));
        }
        case 7u: {
            c = vec4<f32>(unpack4xI8(word_at(h.codes + 4u * k)));
        }
        case 8u, 9u: {
            let lo = (unpack4xU8(b[(h.codes >> 2u) + k]) >> vec4<u32>(h.shift)) & vec4<u32>(15u);
            var hi = vec4<u32>(0u);
            if p.flag == 9u { hi = (unpack4xU8(b[(h.high >> 2u) + k]) >> vec4<u32>(h.qh)) & vec4<u32>(1u); }
            c = vec4<f32>(lo | (hi << vec4<u32>(4u)));
        }
        default: {
            let lo = (unpack4xU8(word_at(h.codes + 4u * k)) >> vec4<u32>(h.shift)) & vec4<u32>(15u);
            let hi = (unpack4xU8(word_at(h.high + 4u * k)) >> vec4<u32>(h.qh)) & vec4<u32>(3u);
            c = vec4<f32>(lo | (hi << vec4<u32>(4u)));
        }
    }
    return h.scale[k / 4u] * c + vec4<f32>(h.offset[k / 4u]);
}

// Pair n of a RoPE op (n0 = heads, n1 = hd; positions (i32 bits) at idx0, inverse
// frequencies (f32 bits) at idx1): its token, its head, its two offsets in the head, (i,
// i + hd/2) (flag 0, rotate-half) or (2i, 2i + 1) (flag 1, interleaved), and the cos and
// sin of its angle.
struct RopePair {
    t: u32,
    head: u32,
    j1: u32,
    j2: u32,
    c: f32,
    s: f32,
}

fn rope_pair(n: u32) -> RopePair {
    let half = p.n1 / 2u;
    let i = n % half;
    var r: RopePair;
    r.head = (n / half) % p.n0;
    r.t = n / (half * p.n0);
    let ang = f32(bitcast<i32>(idx[p.idx0 + r.t])) * bitcast<f32>(idx[p.idx1 + i]);
    r.c = cos(ang);
    r.s = sin(ang);
    r.j1 = i;
    r.j2 = i + half;
    if p.flag == 1u {
        r.j1 = 2u * i;
        r.j2 = r.j1 + 1u;
    }
    return r;
}

// RoPE in place on out [T, heads·hd] (parameters as rope_pair's). One invocation per
// (t, head, i < hd/2).
@compute @workgroup_size(64)
fn rope_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let n = flat(g, nw);
    if n >= p.total { return; }
    let r = rope_pair(n);
    let base = (r.t * p.n0 + r.head) * p.n1;
    let x1 = out[base + r.j1];
    let x2 = out[base + r.j2];
    out[base + r.j1] = x1 * r.c - x2 * r.s;
    out[base + r.j2] = x2 * r.c + x1 * r.s;
}

// rope_main reading a [T, heads·hd] and writing its pairs rotated to out [heads, T, hd]
// (RoPE and the split into heads in one pass); n2 = T.
@compute @workgroup_size(64)
fn rope_heads_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let n = flat(g, nw);
    if n >= p.total { return; }
    let r = rope_pair(n);
    let src = (r.t * p.n0 + r.head) * p.n1;
    let dst = (r.head * p.n2 + r.t) * p.n1;
    let x1 = a[src + r.j1];
    let x2 = a[src + r.j2];
    out[dst + r.j1] = x1 * r.c - x2 * r.s;
    out[dst + r.j2] = x2 * r.c + x1 * r.s;
}

// [T, H·D] -> [H, T, D] (flag 0) or [H, T, D] -> [T, H·D] (flag 1); n0 = H, n1 = T, n2 = D.
@compute @workgroup_size(64)
fn heads_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let n = flat(g, nw);
    if n >= p.total { return; }
    let d = n % p.n2;
    if p.flag == 0u {
        // n indexes out [H, T, D].
        let t = (n / p.n2) % p.n1;
        let h = n / (p.n2 * p.n1);
        out[n] = a[(t * p.n0 + h) * p.n2 + d];
    } else {
        // n indexes out [T, H, D].
        let h = (n / p.n2) % p.n0;
        let t = n / (p.n2 * p.n0);
        out[n] = a[(h * p.n1 + t) * p.n2 + d];
    }
}

// out = silu(a) · b.
@compute @workgroup_size(64)
fn silu_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(g, nw);
    if i >= p.total { return; }
    let x = a[i];
    out[i] = x / (1.0 + exp(-x)) * bitcast<f32>(b[i]);
}

// out += a.
@compute @workgroup_size(64)
fn add_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(g, nw);
    if i >= p.total { return; }
    out[i] = out[i] + a[i];
}

// out = gelu(a) · b, GELU's tanh approximation.
@compute @workgroup_size(64)
fn gelu_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(g, nw);
    if i >= p.total { return; }
    let x = a[i];
    let inner = 0.7978846 * (x + 0.044715 * x * x * x);
    out[i] = 0.5 * x * (1.0 + tanh(inner)) * bitcast<f32>(b[i]);
}

// out *= eps (the scale factor).
@compute @workgroup_size(64)
fn scale_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(g, nw);
    if i >= p.total { return; }
    out[i] = out[i] * p.eps;
}

// out = a with each n0-wide piece multiplied by H_n0 · eps (eps = 1/√n0), H Sylvester's
// Hadamard matrix: entry (i, j) is −1 where i & j has an odd number of bits. One invocation
// per output value, summing its piece (n0 is a head's width: at most a few hundred).
@compute @workgroup_size(64)
fn hadamard_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(g, nw);
    if i >= p.total { return; }
    let row = i % p.n0;
    let base = i - row;
    var acc = 0.0;
    for (var j = 0u; j < p.n0; j++) {
        let v = a[base + j];
        if (countOneBits(row & j) & 1u) == 0u {
            acc += v;
        } else {
            acc -= v;
        }
    }
    out[i] = acc * p.eps;
}

// out[r] = the bits of the index of the largest value of row r of a ([R, n0]), the lowest
// such index on ties, never a NaN (a row of NaNs: 0), as kvplug_core::argmax picks it. One
// workgroup per row: each invocation scans a stride of the row in order, then a tree keeps
// the larger value (the lower index on ties).
const NO_INDEX: u32 = 0xffffffffu;
var<workgroup> best: array<u32, 64>;
@compute @workgroup_size(64)
fn argmax_main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x;
    let n = p.n0;
    var bv = 0.0;
    var bi = NO_INDEX;
    for (var i = lid; i < n; i += 64u) {
        let v = a[r * n + i];
        // NaN by its bits (a shader compiler may assume comparisons never see one).
        let nan = (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
        if !nan && (bi == NO_INDEX || v > bv) {
            bv = v;
            bi = i;
        }
    }
    red[lid] = bv;
    best[lid] = bi;
    workgroupBarrier();
    for (var k = 32u; k > 0u; k >>= 1u) {
        if lid < k {
            let v = red[lid + k];
            let i = best[lid + k];
            let mine = best[lid];
            if i != NO_INDEX && (mine == NO_INDEX || v > red[lid] || (v == red[lid] && i < mine)) {
                red[lid] = v;
                best[lid] = i;
            }
        }
        workgroupBarrier();
    }
    if lid == 0u {
        out[r] = bitcast<f32>(select(best[0], 0u, best[0] == NO_INDEX));
    }
}

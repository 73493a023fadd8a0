// Model-graph operations on f32 activations (row-major). One bind group layout for all:
// params, a (f32, read), b (32-bit words, read: f32 values, or a weight in its stored
// dtype), idx (u32, read: the batch's index words; an op's start at idx0, a second array at
// idx1), out (f32, read_write). Flat invocation index:
// gid.x + gid.y · (workgroups.x · 64), so large element counts use a 2-D dispatch.

struct Params {
    n0: u32, n1: u32, n2: u32, n3: u32,
    flag: u32, total: u32, idx0: u32, idx1: u32,
    eps: f32, pad2: f32, pad3: f32, pad4: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<u32>;
@group(0) @binding(3) var<storage, read> idx: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

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

// out[r, :] = a[r, :] / rms(a[r, :]) · b; one workgroup per row of n0 = len(b) values.
var<workgroup> red: array<f32, 64>;
@compute @workgroup_size(64)
fn rmsnorm_main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x;
    let w = p.n0;
    var s = 0.0;
    for (var i = lid; i < w; i += 64u) {
        let v = a[r * w + i];
        s += v * v;
    }
    red[lid] = s;
    workgroupBarrier();
    for (var k = 32u; k > 0u; k >>= 1u) {
        if lid < k { red[lid] = red[lid] + red[lid + k]; }
        workgroupBarrier();
    }
    let inv = 1.0 / sqrt(red[0] / f32(w) + p.eps);
    for (var i = lid; i < w; i += 64u) {
        out[r * w + i] = a[r * w + i] * inv * bitcast<f32>(b[i]);
    }
}

// out[t, n2 + o] = Σ_i a[t, i] · W[o, i], W in `b` (dtype in flag); n0 = rows of W (this
// part's outputs), n1 = cols, n2 = the part's first output, n3 = outputs per token (a weight
// larger than one binding is split into parts of whole rows).
// One invocation per (o, t); biases are added by bias_main.
@compute @workgroup_size(64)
fn linear_main(@builtin(global_invocation_id) g: vec3<u32>) {
    let o = g.x;
    let t = g.y;
    if o >= p.n0 { return; }
    let cols = p.n1;
    var acc = 0.0;
    if p.flag < 3u {
        for (var i = 0u; i < cols; i++) {
            acc += a[t * cols + i] * weight_at(o * cols + i);
        }
    } else {
        // Block formats: each block's scales are read once and its codes a byte at a time.
        let be = select(32u, 256u, p.flag >= 8u);
        let first = o * cols / be;
        for (var k = 0u; k < cols / be; k++) {
            acc += block_dot(first + k, t * cols + k * be);
        }
    }
    out[t * p.n3 + p.n2 + o] = acc;
}

// linear_main for few tokens: each workgroup computes ROWS_PER_GROUP output rows of one token
// (row group o = x + y · workgroups.x, token t = z), LANES invocations per row striding over
// its blocks (or values) so neighbours read neighbouring bytes, their sums added by a tree
// in workgroup memory.
const LANES: u32 = 8u;
const ROWS_PER_GROUP: u32 = 64u / LANES;
@compute @workgroup_size(64)
fn linear_rows_main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let o = (wg.x + wg.y * nw.x) * ROWS_PER_GROUP + lid / LANES;
    let lane = lid % LANES;
    let t = wg.z;
    let cols = p.n1;
    var acc = 0.0;
    if o < p.n0 {
        if p.flag < 3u {
            for (var i = lane; i < cols; i += LANES) {
                acc += a[t * cols + i] * weight_at(o * cols + i);
            }
        } else {
            let be = select(32u, 256u, p.flag >= 8u);
            let first = o * cols / be;
            for (var k = lane; k < cols / be; k += LANES) {
                acc += block_dot(first + k, t * cols + k * be);
            }
        }
    }
    red[lid] = acc;
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if lane < s { red[lid] = red[lid] + red[lid + s]; }
        workgroupBarrier();
    }
    if lane == 0u && o < p.n0 { out[t * p.n3 + p.n2 + o] = red[lid]; }
}

// Σ_j a[ab + j] · (value j of quantized block `blk` of `b`), the format in p.flag (as for
// weight_at; 3..=10).
fn block_dot(blk: u32, ab: u32) -> f32 {
    switch p.flag {
        case 3u, 4u, 5u, 6u: {
            // q4_0, q4_1, q5_0, q5_1: [d, (m), (qh), 16 code bytes].
            let bytes = 18u + 2u * (p.flag - 3u);
            let o = blk * bytes;
            let has_m = p.flag == 4u || p.flag == 6u;
            let five = p.flag >= 5u;
            let qh_at = o + select(2u, 4u, has_m);
            let qs = qh_at + select(0u, 4u, five);
            var s = 0.0;
            var sa = 0.0;
            for (var j = 0u; j < 16u; j++) {
                let q = byte_at(qs + j);
                var lo = q & 15u;
                var hi = q >> 4u;
                if five {
                    lo |= bit5(qh_at, j);
                    hi |= bit5(qh_at, j + 16u);
                }
                let x0 = a[ab + j];
                let x1 = a[ab + j + 16u];
                s += f32(lo) * x0 + f32(hi) * x1;
                sa += x0 + x1;
            }
            if has_m {
                return half_at(o) * s + half_at(o + 2u) * sa;
            }
            // Codes are offset by 8 (q4_0) or 16 (q5_0).
            return half_at(o) * (s - select(8.0, 16.0, five) * sa);
        }
        case 7u: {
            let o = blk * 34u;
            var s = 0.0;
            for (var j = 0u; j < 32u; j++) {
                s += f32(i32(byte_at(o + 2u + j) << 24u) >> 24u) * a[ab + j];
            }
            return half_at(o) * s;
        }
        case 8u, 9u: {
            let q5 = p.flag == 9u;
            let o = blk * select(144u, 176u, q5);
            let qs = o + select(16u, 48u, q5);
            let d = half_at(o);
            let dmin = half_at(o + 2u);
            var acc = 0.0;
            for (var sub = 0u; sub < 8u; sub++) {
                let sm = k4_scale_min(sub, o + 4u);
                let chunk = sub / 2u;
                let shift = 4u * (sub % 2u);
                var s = 0.0;
                var sa = 0.0;
                for (var l = 0u; l < 32u; l++) {
                    var v = (byte_at(qs + chunk * 32u + l) >> shift) & 15u;
                    if q5 && ((byte_at(o + 16u + l) >> sub) & 1u) == 1u {
                        v += 16u;
                    }
                    let x = a[ab + sub * 32u + l];
                    s += f32(v) * x;
                    sa += x;
                }
                acc += d * sm.x * s - dmin * sm.y * sa;
            }
            return acc;
        }
        default: {
            // q6_K: 16 sub-blocks of 16 values, i8 scales.
            let o = blk * 210u;
            var acc = 0.0;
            for (var n = 0u; n < 2u; n++) {
                for (var quarter = 0u; quarter < 4u; quarter++) {
                    for (var part = 0u; part < 2u; part++) {
                        var s = 0.0;
                        for (var l = part * 16u; l < part * 16u + 16u; l++) {
                            let lo = (byte_at(o + n * 64u + l + 32u * (quarter & 1u)) >> (4u * (quarter >> 1u))) & 15u;
                            let hb = (byte_at(o + 128u + n * 32u + l) >> (2u * quarter)) & 3u;
                            s += f32(i32(lo | (hb << 4u)) - 32) * a[ab + n * 128u + quarter * 32u + l];
                        }
                        let sc = i32(byte_at(o + 192u + n * 8u + part + 2u * quarter) << 24u) >> 24u;
                        acc += f32(sc) * s;
                    }
                }
            }
            return half_at(o + 208u) * acc;
        }
    }
}

// out[t, o] += bias[o]: bias in `a`, n0 = width.
@compute @workgroup_size(64)
fn bias_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(g, nw);
    if i >= p.total { return; }
    out[i] = out[i] + a[i % p.n0];
}

// RoPE in place on out [T, heads·hd]: n0 = heads, n1 = hd; positions (i32 bits) at idx0,
// inverse frequencies (f32 bits) at idx1; pair i is (i, i + hd/2) (flag 0, rotate-half) or
// (2i, 2i + 1) (flag 1, interleaved). One invocation per (t, head, i < hd/2).
@compute @workgroup_size(64)
fn rope_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let n = flat(g, nw);
    if n >= p.total { return; }
    let half = p.n1 / 2u;
    let i = n % half;
    let head = (n / half) % p.n0;
    let t = n / (half * p.n0);
    let base = (t * p.n0 + head) * p.n1;
    let ang = f32(bitcast<i32>(idx[p.idx0 + t])) * bitcast<f32>(idx[p.idx1 + i]);
    let c = cos(ang);
    let s = sin(ang);
    var i1 = base + i;
    var i2 = base + i + half;
    if p.flag == 1u {
        i1 = base + 2u * i;
        i2 = i1 + 1u;
    }
    let x1 = out[i1];
    let x2 = out[i2];
    out[i1] = x1 * c - x2 * s;
    out[i2] = x2 * c + x1 * s;
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

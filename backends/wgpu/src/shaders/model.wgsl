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

// Element e of the weight in `b`, stored as p.flag says: 0 f32, 1 f16, 2 bf16 (two
// little-endian halves per word, the lower-addressed in the low bits).
fn weight_at(e: u32) -> f32 {
    switch p.flag {
        case 1u: {
            return unpack2x16float(b[e / 2u])[e % 2u];
        }
        case 2u: {
            let w = b[e / 2u];
            return bitcast<f32>(select(w << 16u, w & 0xffff0000u, e % 2u == 1u));
        }
        default: {
            return bitcast<f32>(b[e]);
        }
    }
}

// out[t, :] = weight row idx[idx0 + t] (an embedding lookup); n0 = width.
@compute @workgroup_size(64)
fn embed_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(g, nw);
    if i >= p.total { return; }
    let w = p.n0;
    out[i] = weight_at(idx[p.idx0 + i / w] * w + i % w);
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

// out[t, o] = Σ_i a[t, i] · W[o, i], W in `b` (dtype in flag); n0 = rows of W (outputs),
// n1 = cols.
// One invocation per (o, t); biases are added by bias_main.
@compute @workgroup_size(64)
fn linear_main(@builtin(global_invocation_id) g: vec3<u32>) {
    let o = g.x;
    let t = g.y;
    if o >= p.n0 { return; }
    let cols = p.n1;
    var acc = 0.0;
    for (var i = 0u; i < cols; i++) {
        acc += a[t * cols + i] * weight_at(o * cols + i);
    }
    out[t * p.n0 + o] = acc;
}

// out[t, o] += bias[o]: bias in `a`, n0 = width.
@compute @workgroup_size(64)
fn bias_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(g, nw);
    if i >= p.total { return; }
    out[i] = out[i] + a[i % p.n0];
}

// Rotate-half RoPE in place on out [T, heads·hd]: n0 = heads, n1 = hd; positions (i32 bits)
// at idx0, inverse frequencies (f32 bits) at idx1. One invocation per (t, head, i < hd/2).
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
    let x1 = out[base + i];
    let x2 = out[base + i + half];
    out[base + i] = x1 * c - x2 * s;
    out[base + i + half] = x2 * c + x1 * s;
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

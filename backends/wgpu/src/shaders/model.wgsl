// Model-graph operations on f32 activations (row-major), but for the linears
// (project.wgsl). One bind group layout for all: params, a (f32, read), b (32-bit words,
// read: f32 values, or a weight in its stored dtype), idx (u32, read: the batch's index
// words; an op's start at idx0, a second array at idx1), out (f32, read_write). Flat
// invocation index: gid.x + gid.y · (workgroups.x · 64), so large element counts use a 2-D
// dispatch.

struct Params {
    n0: u32, n1: u32, n2: u32, n3: u32,
    flag: u32, total: u32, idx0: u32, idx1: u32,
    eps: f32, pad0: u32, pad1: u32, pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<u32>;
@group(0) @binding(3) var<storage, read> idx: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

// The weight weights.wgsl reads: `b`, its dtype p.flag (set as `fmt` by the entry points
// that read it).
fn wb(i: u32) -> u32 {
    return b[i];
}

fn wq(i: u32) -> vec4<u32> {
    return vec4<u32>(b[4u * i], b[4u * i + 1u], b[4u * i + 2u], b[4u * i + 3u]);
}

fn flat(g: vec3<u32>, nw: vec3<u32>) -> u32 {
    return g.x + g.y * nw.x * 64u;
}

// out[t, :] = weight row idx[idx0 + t] (an embedding lookup); n0 = width. The weight in `b`
// is the part holding rows [n1, n1 + n2) of the table: tokens outside it are left alone (the
// other parts' dispatches write them).
@compute @workgroup_size(64)
fn embed_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(g, nw);
    if i >= p.total { return; }
    set_fmt(p.flag);
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

// Adjustment i of logit rows `out` ([R, n0]), six index words at idx0 + 6i: row, token,
// then add, sub, pos, neg (f32 bits): (l + add) - sub, then times pos above 0, else times
// neg (kvplug_core::Adjust; no place twice). total = adjustments.
@compute @workgroup_size(64)
fn adjust_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(g, nw);
    if i >= p.total { return; }
    let w = p.idx0 + 6u * i;
    let at = idx[w] * p.n0 + idx[w + 1u];
    let l = (out[at] + bitcast<f32>(idx[w + 2u])) - bitcast<f32>(idx[w + 3u]);
    out[at] = select(l * bitcast<f32>(idx[w + 5u]), l * bitcast<f32>(idx[w + 4u]), l > 0.0);
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

const NO_INDEX: u32 = 0xffffffffu;

// Row r's first k values of a ([R, n0]; k = n1) in rank order: larger first, the lower
// index on ties (-0.0 ties 0.0), NaNs after every number (kvplug_core::rank), in two
// dispatches. Phase 0 (flag 0; workgroups [S, R]): workgroup (s, r) picks the first k of
// the row's part s (n2 values a part, S = ceil(n0 / n2) parts) into the part's slot of out:
// ids (u32 bits), then values, NO_INDEX ids where the part runs out. Phase 1 (flag 1;
// workgroups [1, R]): one workgroup per row picks the first k of the parts' S·k picks into
// out[r, :k] (ids) and out[r, k:2k] (values); the parts' slots follow the R rows. Each
// picks in k rounds: the first entry ranked after the previous round's pick (each
// invocation over a stride, then a tree).
const TOP_GROUP: u32 = 256u;
var<workgroup> top_v: array<f32, 256>;
var<workgroup> top_i: array<u32, 256>;
var<workgroup> top_last: vec2<u32>;

// NaN by its bits (a shader compiler may assume comparisons never see one).
fn is_nan(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
}

// Whether (av, ai) ranks before (bv, bi).
fn ranks_before(av: f32, ai: u32, bv: f32, bi: u32) -> bool {
    let an = is_nan(av);
    let bn = is_nan(bv);
    if an != bn {
        return bn;
    }
    if !an && av != bv {
        return av > bv;
    }
    return ai < bi;
}

// Entry e of what workgroup (part, r) picks from: (value bits, id).
fn top_entry(r: u32, part: u32, e: u32, rows: u32) -> vec2<u32> {
    let k = p.n1;
    let parts = (p.n0 + p.n2 - 1u) / p.n2;
    if p.flag == 0u {
        let i = part * p.n2 + e;
        return vec2<u32>(bitcast<u32>(a[r * p.n0 + i]), i);
    }
    let slot = (rows + r * parts + e / k) * 2u * k;
    return vec2<u32>(bitcast<u32>(out[slot + k + e % k]), bitcast<u32>(out[slot + e % k]));
}

@compute @workgroup_size(256)
fn topk_main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nw: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let r = wg.y;
    let rows = nw.y;
    let k = p.n1;
    let parts = (p.n0 + p.n2 - 1u) / p.n2;
    var m = parts * k;
    var dst = r * 2u * k;
    if p.flag == 0u {
        m = min(p.n2, p.n0 - wg.x * p.n2);
        dst = (rows + r * parts + wg.x) * 2u * k;
    }
    for (var j = 0u; j < k; j++) {
        // The previous pick (none in the first round; none left once a round found none).
        let last = top_last;
        let lv = bitcast<f32>(last.x);
        let done = j > 0u && last.y == NO_INDEX;
        var bv = 0.0;
        var bi = NO_INDEX;
        for (var e = lid; e < m && !done; e += TOP_GROUP) {
            let t = top_entry(r, wg.x, e, rows);
            let v = bitcast<f32>(t.x);
            let i = t.y;
            let after = i != NO_INDEX && (j == 0u || ranks_before(lv, last.y, v, i));
            if after && (bi == NO_INDEX || ranks_before(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        }
        top_v[lid] = bv;
        top_i[lid] = bi;
        workgroupBarrier();
        for (var s = TOP_GROUP / 2u; s > 0u; s >>= 1u) {
            if lid < s {
                let v = top_v[lid + s];
                let i = top_i[lid + s];
                if i != NO_INDEX && (top_i[lid] == NO_INDEX || ranks_before(v, i, top_v[lid], top_i[lid])) {
                    top_v[lid] = v;
                    top_i[lid] = i;
                }
            }
            workgroupBarrier();
        }
        if lid == 0u {
            out[dst + j] = bitcast<f32>(top_i[0]);
            out[dst + k + j] = top_v[0];
            top_last = vec2<u32>(bitcast<u32>(top_v[0]), top_i[0]);
        }
        workgroupBarrier();
    }
}

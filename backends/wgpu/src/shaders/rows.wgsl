// Pool row writes (encoding f32 activations into the pool's dtype) and tree-commit row moves.
// Pools are u32 words, row-major [heads, cells, row_words]; see attention.wgsl for decoding.

// idx0: where this op's cells start in cellidx (the batch's index words). pairs: 2 when
// write_main also writes src2 into pool2 (a step's values beside its keys), else 1. run: 1
// when write_main writes rows base + i rather than cellidx[idx0 + i].
struct Params {
    heads: u32, t: u32, d: u32, cells: u32,
    row_words: u32, dtype: u32, group: u32, base: u32,
    idx0: u32, units: u32, pairs: u32, run: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> cellidx: array<u32>;
@group(0) @binding(3) var<storage, read_write> pool: array<u32>;
@group(0) @binding(4) var<storage, read_write> tmp: array<u32>;
@group(0) @binding(5) var<storage, read> src2: array<f32>;
@group(0) @binding(6) var<storage, read_write> pool2: array<u32>;

// Whether write_main's invocation writes the second pair (src2 into pool2).
var<private> second: bool;

fn src_at(i: u32) -> f32 {
    if second { return src2[i]; }
    return src[i];
}

fn pool_put(i: u32, w: u32) {
    if second {
        pool2[i] = w;
    } else {
        pool[i] = w;
    }
}

// f32 -> bf16 bits, round to nearest even (as the host's conversion).
fn bf16(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}

// Token i of head h (src [heads, t, d]) into row cellidx[idx0 + i] (base + i for a run),
// unit u of it by invocation (h · t + i) · units + u (workgroups [x, y]: 64 invocations
// each, x first): a unit is a word of an f32 row, a word (two values) of an f16 or bf16 row,
// a group (its scale word and code words) of a quantized row. With two pairs, the
// invocations past the first pair's write src2 into pool2 (laid out as pool) the same way.
@compute @workgroup_size(64)
fn write_main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let units = p.units;
    let per_pair = p.heads * p.t * units;
    var n = g.x + g.y * nw.x * 64u;
    if n >= p.pairs * per_pair { return; }
    second = n >= per_pair;
    if second { n -= per_pair; }
    let u = n % units;
    let h = n / units / p.t;
    let i = (n / units) % p.t;
    let sb = (h * p.t + i) * p.d;
    // A run reads no cell words (it uploads none).
    var cell = p.base + i;
    if p.run == 0u { cell = cellidx[p.idx0 + i]; }
    let rb = (h * p.cells + cell) * p.row_words;
    switch p.dtype {
        case 0u: {
            pool_put(rb + u, bitcast<u32>(src_at(sb + u)));
        }
        case 1u: {
            pool_put(rb + u, pack2x16float(vec2<f32>(src_at(sb + 2u * u), src_at(sb + 2u * u + 1u))));
        }
        case 2u: {
            pool_put(rb + u, bf16(src_at(sb + 2u * u)) | (bf16(src_at(sb + 2u * u + 1u)) << 16u));
        }
        default: {
            // Affine per group (kvplug_core::quant): lo = min, scale = (max - min) · f32(1 /
            // levels), both stored as f16 (scale low half, lo high half), and the codes
            // computed with the stored values by code(). No division decides a stored bit:
            // WGSL's is approximate.
            let bits = select(4u, 8u, p.dtype == 3u);
            let per_word = 32u / bits;
            let levels = (1u << bits) - 1u;
            let inv_levels = select(bitcast<f32>(0x3d888889u), bitcast<f32>(0x3b808081u), bits == 8u);
            let code_words = p.d / per_word;
            let g0 = sb + u * p.group;
            var lo = src_at(g0);
            var hi = src_at(g0);
            for (var k = 1u; k < p.group; k++) {
                lo = min(lo, src_at(g0 + k));
                hi = max(hi, src_at(g0 + k));
            }
            // The stored f16 values, rounded here rather than read back through
            // unpack2x16float(pack2x16float(..)): a driver may fold that pair into the
            // unrounded values (NVIDIA's does), which would give codes for another scale.
            let sl = vec2<f32>(f16_round((hi - lo) * inv_levels), f16_round(lo));
            // A zero lo is stored as +0 (min may have picked -0).
            let packed = pack2x16float(sl);
            pool_put(rb + code_words + u, select(packed, packed & 0xffffu, (packed >> 16u) == 0x8000u));
            for (var w = 0u; w < p.group / per_word; w++) {
                var word = 0u;
                for (var k = 0u; k < per_word; k++) {
                    let c = code(src_at(g0 + w * per_word + k) - sl.y, sl.x, levels);
                    word = word | (c << (k * bits));
                }
                pool_put(rb + (u * p.group) / per_word + w, word);
            }
        }
    }
}

// x rounded to the nearest f16 value (ties to even), as an f32; ±inf beyond f16's range,
// inf and NaN unchanged. Exact: powers of two scale the f16 quantum at x's exponent to 1 and
// back, and round() takes ties to even.
fn f16_round(x: f32) -> f32 {
    let e = i32((bitcast<u32>(x) >> 23u) & 0xffu) - 127;
    if e == 128 { return x; }
    let inf = bitcast<f32>(0x7f800000u);
    if e > 15 { return sign(x) * inf; }
    let q = max(e, -14) - 10;
    let down = bitcast<f32>(u32(127 - q) << 23u);
    let up = bitcast<f32>(u32(127 + q) << 23u);
    let r = round(x * down) * up;
    return select(r, sign(x) * inf, abs(r) >= 65536.0);
}

// ⌊d / scale + ½⌋ of the exact quotient, clamped to 0..=levels (0 when scale is 0), as
// kvplug_backend_kit::quant::code: the division estimates it, the comparisons against
// (c ± ½) · scale (exact in f32) decide.
fn code(d: f32, scale: f32, levels: u32) -> u32 {
    if scale == 0.0 { return 0u; }
    let top = f32(levels);
    var c = clamp(floor(d / scale + 0.5), 0.0, top);
    if c > 0.0 && d < (c - 0.5) * scale {
        c -= 1.0;
    } else if c < top && d >= (c + 0.5) * scale {
        c += 1.0;
    }
    return u32(c);
}

// Rows cellidx[idx0 + i] (i < t) of every head into tmp, then tmp into rows base + i: an in-place
// gather that is safe whatever the overlap.
@compute @workgroup_size(64)
fn gather_main(@builtin(global_invocation_id) g: vec3<u32>) {
    let n = g.x;
    if n >= p.heads * p.t * p.row_words { return; }
    let w = n % p.row_words;
    let i = (n / p.row_words) % p.t;
    let h = n / (p.row_words * p.t);
    tmp[n] = pool[(h * p.cells + cellidx[p.idx0 + i]) * p.row_words + w];
}

@compute @workgroup_size(64)
fn place_main(@builtin(global_invocation_id) g: vec3<u32>) {
    let n = g.x;
    if n >= p.heads * p.t * p.row_words { return; }
    let w = n % p.row_words;
    let i = (n / p.row_words) % p.t;
    let h = n / (p.row_words * p.t);
    pool[(h * p.cells + p.base + i) * p.row_words + w] = tmp[n];
}

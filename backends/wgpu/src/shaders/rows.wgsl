// Pool row writes (encoding f32 activations into the pool's dtype) and tree-commit row moves.
// Pools are u32 words, row-major [heads, cells, row_words]; see attention.wgsl for decoding.

// idx0: where this op's cells start in cellidx (the batch's index words).
struct Params {
    heads: u32, t: u32, d: u32, cells: u32,
    row_words: u32, dtype: u32, group: u32, base: u32,
    idx0: u32, pad0: u32, pad1: u32, pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> cellidx: array<u32>;
@group(0) @binding(3) var<storage, read_write> pool: array<u32>;
@group(0) @binding(4) var<storage, read_write> tmp: array<u32>;

// f32 -> bf16 bits, round to nearest even (as the host's conversion).
fn bf16(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}

// Token i of head h (src [heads, t, d]) into row cellidx[idx0 + i].
@compute @workgroup_size(64)
fn write_main(@builtin(global_invocation_id) g: vec3<u32>) {
    let n = g.x;
    if n >= p.heads * p.t { return; }
    let h = n / p.t;
    let i = n % p.t;
    let sb = (h * p.t + i) * p.d;
    let rb = (h * p.cells + cellidx[p.idx0 + i]) * p.row_words;
    switch p.dtype {
        case 0u: {
            for (var dd = 0u; dd < p.d; dd++) { pool[rb + dd] = bitcast<u32>(src[sb + dd]); }
        }
        case 1u: {
            for (var k = 0u; k < p.d / 2u; k++) {
                pool[rb + k] = pack2x16float(vec2<f32>(src[sb + 2u * k], src[sb + 2u * k + 1u]));
            }
        }
        case 2u: {
            for (var k = 0u; k < p.d / 2u; k++) {
                pool[rb + k] = bf16(src[sb + 2u * k]) | (bf16(src[sb + 2u * k + 1u]) << 16u);
            }
        }
        default: {
            // Affine per group: lo = min, scale = (max - min) / levels, both stored as f16
            // (scale low half, lo high half) and the codes computed with the stored values.
            let bits = select(4u, 8u, p.dtype == 3u);
            let per_word = 32u / bits;
            let levels = f32((1u << bits) - 1u);
            let code_words = p.d / per_word;
            for (var gi = 0u; gi < p.d / p.group; gi++) {
                let g0 = sb + gi * p.group;
                var lo = src[g0];
                var hi = src[g0];
                for (var k = 1u; k < p.group; k++) {
                    lo = min(lo, src[g0 + k]);
                    hi = max(hi, src[g0 + k]);
                }
                let packed = pack2x16float(vec2<f32>((hi - lo) / levels, lo));
                pool[rb + code_words + gi] = packed;
                let sl = unpack2x16float(packed);
                for (var w = 0u; w < p.group / per_word; w++) {
                    var word = 0u;
                    for (var k = 0u; k < per_word; k++) {
                        var code = 0u;
                        if sl.x != 0.0 {
                            code = u32(clamp(floor((src[g0 + w * per_word + k] - sl.y) / sl.x + 0.5), 0.0, levels));
                        }
                        word = word | (code << (k * bits));
                    }
                    pool[rb + (gi * p.group) / per_word + w] = word;
                }
            }
        }
    }
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

// Reading a weight in its stored dtype, shared by the modules that read weights (the
// Rust side puts this file before each). A module defines `fn wb(i: u32) -> u32` (word i
// of the weight being read) and `fn wq(i: u32) -> vec4<u32>` (words 4i .. 4i + 3) and sets
// `fmt` (its dtype flag, see weight_at) before calling these.

var<private> fmt: u32;

// The dtype flag a pipeline was built for (its weights all have it: a constant the driver's
// compiler folds into weight_at, slice, quad and span, leaving no branch on the dtype), else 255:
// the dtype is read at run time.
override FMT: u32 = 255u;

// Sets `fmt`: FMT where the pipeline was built for one dtype, else `flag`.
fn set_fmt(flag: u32) {
    fmt = select(flag, FMT, FMT != 255u);
}

// Byte o of the weight (little-endian words).
fn byte_at(o: u32) -> u32 {
    return (wb(o >> 2u) >> ((o & 3u) * 8u)) & 0xffu;
}

// The f16 at even byte offset o of the weight, widened.
fn half_at(o: u32) -> f32 {
    return unpack2x16float(wb(o >> 2u))[(o >> 1u) & 1u];
}

// Nibble j % 16 of the 16 code bytes at o: low nibbles hold values 0..16, high ones 16..32.
fn nibble(o: u32, j: u32) -> u32 {
    return (byte_at(o + (j & 15u)) >> (4u * (j >> 4u))) & 15u;
}

// The 5th bit of value j of a Q5_0/Q5_1 block, from its 32-bit qh at byte o.
fn bit5(o: u32, j: u32) -> u32 {
    return ((byte_at(o + (j >> 3u)) >> (j & 7u)) & 1u) << 4u;
}

// Sub-block j's 6-bit scale and minimum from the 12 packed bytes at o (Q4_K/Q5_K; o a
// multiple of 4).
fn k4_scale_min(j: u32, o: u32) -> vec2<f32> {
    let i = o >> 2u;
    return k4_scale_min_of(j, vec3<u32>(wb(i), wb(i + 1u), wb(i + 2u)));
}

// Element e of the weight, stored as fmt says: 0 f32, 1 f16, 2 bf16 (two
// little-endian halves per word, the lower-addressed in the low bits), or a ggml block
// format dequantized as it is read (the arithmetic of the kit's blocks::dequantize_row):
// 3 q4_0, 4 q4_1, 5 q5_0, 6 q5_1, 7 q8_0, 8 q4_K, 9 q5_K, 10 q6_K. Blocks are laid out
// as the host uploads them (model.rs's block_pad): whole words each, two zero bytes after
// the f16 scale of q4_0 (20 bytes), q5_0 (24) and q8_0 (36) and at the end of q6_K (212),
// so that every field read as a word is aligned.
fn weight_at(e: u32) -> f32 {
    switch fmt {
        case 1u: {
            return unpack2x16float(wb(e / 2u))[e % 2u];
        }
        case 2u: {
            let w = wb(e / 2u);
            return bitcast<f32>(select(w << 16u, w & 0xffff0000u, e % 2u == 1u));
        }
        case 3u: {
            let o = (e / 32u) * 20u;
            return f32(i32(nibble(o + 4u, e % 32u)) - 8) * half_at(o);
        }
        case 4u: {
            let o = (e / 32u) * 20u;
            return f32(nibble(o + 4u, e % 32u)) * half_at(o) + half_at(o + 2u);
        }
        case 5u: {
            let o = (e / 32u) * 24u;
            let j = e % 32u;
            return f32(i32(nibble(o + 8u, j) | bit5(o + 4u, j)) - 16) * half_at(o);
        }
        case 6u: {
            let o = (e / 32u) * 24u;
            let j = e % 32u;
            return f32(nibble(o + 8u, j) | bit5(o + 4u, j)) * half_at(o) + half_at(o + 2u);
        }
        case 7u: {
            let o = (e / 32u) * 36u;
            let q = i32(byte_at(o + 4u + e % 32u) << 24u) >> 24u;
            return f32(q) * half_at(o);
        }
        case 8u, 9u: {
            let q5 = fmt == 9u;
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
            let o = (e / 256u) * 212u;
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
            return bitcast<f32>(wb(e));
        }
    }
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

// The scales, offsets and code positions of slice `sl` of the weight, the format in
// fmt (as for weight_at; 3..=10).
fn slice(sl: u32) -> Slice {
    var h: Slice;
    switch fmt {
        case 3u, 4u, 5u, 6u: {
            // q4_0, q4_1, q5_0, q5_1: [d, m (or 2 zero bytes), (qh), 16 code bytes]; byte j
            // holds value j in its low nibble and value j + 16 in its high one, q5's fifth
            // bits in qh.
            let has_m = fmt == 4u || fmt == 6u;
            let five = fmt >= 5u;
            let o = sl * select(20u, 24u, five);
            let d = half_at(o);
            h.codes = o + select(4u, 8u, five);
            if five { h.qh = wb((o >> 2u) + 1u); }
            var m = -select(8.0, 16.0, five) * d;
            if has_m { m = half_at(o + 2u); }
            h.scale = vec2<f32>(d);
            h.offset = vec2<f32>(m);
        }
        case 7u: {
            let o = sl * 36u;
            h.scale = vec2<f32>(half_at(o));
            h.codes = o + 4u;
        }
        case 8u, 9u: {
            // q4_K, q5_K: sub-block `sub` takes the low (even sub) or high nibbles of the
            // 32 code bytes of its pair, q5_K's fifth bit from bit `sub` of 32 qh bytes.
            let q5 = fmt == 9u;
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
            let o = (sl / 8u) * 212u;
            let n = sub / 4u;
            let quarter = sub % 4u;
            // The sub-block's two i8 scales: half quarter % 2 of a word.
            let sc = wb((o + 192u + n * 8u) / 4u + quarter / 2u) >> (16u * (quarter % 2u));
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
    switch fmt {
        case 3u, 4u, 5u, 6u: {
            let lo = (unpack4xU8(wb((h.codes >> 2u) + k % 4u)) >> vec4<u32>(4u * (k / 4u))) & vec4<u32>(15u);
            let hi = (vec4<u32>(h.qh >> (4u * k)) >> vec4<u32>(0u, 1u, 2u, 3u)) & vec4<u32>(1u);
            c = vec4<f32>(lo | (hi << vec4<u32>(4u)));
        }
        case 7u: {
            c = vec4<f32>(unpack4xI8(wb((h.codes >> 2u) + k)));
        }
        case 8u, 9u: {
            let lo = (unpack4xU8(wb((h.codes >> 2u) + k)) >> vec4<u32>(h.shift)) & vec4<u32>(15u);
            var hi = vec4<u32>(0u);
            if fmt == 9u { hi = (unpack4xU8(wb((h.high >> 2u) + k)) >> vec4<u32>(h.qh)) & vec4<u32>(1u); }
            c = vec4<f32>(lo | (hi << vec4<u32>(4u)));
        }
        default: {
            let lo = (unpack4xU8(wb((h.codes >> 2u) + k)) >> vec4<u32>(h.shift)) & vec4<u32>(15u);
            let hi = (unpack4xU8(wb((h.high >> 2u) + k)) >> vec4<u32>(h.qh)) & vec4<u32>(3u);
            c = vec4<f32>(lo | (hi << vec4<u32>(4u)));
        }
    }
    return h.scale[k / 4u] * c + vec4<f32>(h.offset[k / 4u]);
}

// A span of a block-format row: 32 values in two halves of 16, a and b, each read from the
// bytes of 4 code words (and, for the 5- and 6-bit formats, high bits) with one scale and
// one offset a half: value i of a half is scale · code_i + offset. Spans follow the
// weight's bytes, so that neighbouring lanes reading neighbouring spans read neighbouring
// words: a span is a 32-value block, or one of the 8 spans of a K-quant super-block (16
// code bytes each, `lead` of them before it in the super-block). `span` loads the words.
struct Span {
    scale: vec2<f32>,
    offset: vec2<f32>,
    // a's code words; b's are their high nibbles, or q8_0's `codes_b`.
    codes: vec4<u32>,
    codes_b: vec4<u32>,
    // q5_K, q6_K: the words of the high bits (byte i for value i of a word's quarter);
    // q5_0, q5_1: the block's qh in x.
    high: vec4<u32>,
    // q5_K, q6_K: the halves' shifts of their high bits in those bytes.
    shifts: vec2<u32>,
    // The halves' first values, from the start of the block or super-block.
    xa: u32,
    xb: u32,
    lead: u32,
}

// Words i .. i + 3 of the weight, one by one (for any i; `wq` reads four at i a multiple
// of 4, where a format guarantees it).
fn words4(i: u32) -> vec4<u32> {
    return vec4<u32>(wb(i), wb(i + 1u), wb(i + 2u), wb(i + 3u));
}

// Byte b (< 12) of the 12 bytes in s.
fn byte12(s: vec3<u32>, b: u32) -> u32 {
    return (select(select(s.x, s.y, b >= 4u), s.z, b >= 8u) >> (8u * (b & 3u))) & 255u;
}

// Sub-block j's 6-bit scale and minimum from the 12 packed bytes in s (Q4_K/Q5_K).
fn k4_scale_min_of(j: u32, s: vec3<u32>) -> vec2<f32> {
    if j < 4u {
        return vec2<f32>(f32(byte12(s, j) & 63u), f32(byte12(s, j + 4u) & 63u));
    }
    let sc = (byte12(s, j + 4u) & 15u) | ((byte12(s, j - 4u) >> 6u) << 4u);
    let m = (byte12(s, j + 4u) >> 4u) | ((byte12(s, j) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}

// Span sp of the weight (counted from its first value, 32 values a span), the format in fmt
// (as for weight_at; 3..=10). Q4_K and Q5_K super-blocks (144 and 176 bytes) are whole
// 16-byte units, so their header and code words are read four at a time.
fn span(sp: u32) -> Span {
    var h: Span;
    switch fmt {
        case 3u, 4u, 5u, 6u: {
            // [d, m (or 2 zero bytes), (qh), 16 code bytes]: byte j holds value j in its
            // low nibble and value j + 16 in its high one, q5's fifth bit j in qh.
            let five = fmt >= 5u;
            let o = sp * select(20u, 24u, five);
            let d = half_at(o);
            var m = -select(8.0, 16.0, five) * d;
            if fmt == 4u || fmt == 6u { m = half_at(o + 2u); }
            h.scale = vec2<f32>(d);
            h.offset = vec2<f32>(m);
            h.codes = words4((o >> 2u) + select(1u, 2u, five));
            if five { h.high.x = wb((o >> 2u) + 1u); }
            h.xb = 16u;
        }
        case 7u: {
            let o = sp * 36u;
            h.scale = vec2<f32>(half_at(o));
            h.codes = words4((o >> 2u) + 1u);
            h.codes_b = words4((o >> 2u) + 5u);
            h.xb = 16u;
        }
        case 8u, 9u: {
            // Span j of 8: half j % 2 of the 32 code bytes of sub-blocks 2c (low nibbles)
            // and 2c + 1 (high), c = j / 2; q5_K's fifth bits are bits 2c and 2c + 1 of the
            // 32 qh bytes.
            let q5 = fmt == 9u;
            let j = sp % 8u;
            let c = j / 2u;
            let l0 = 16u * (j % 2u);
            let o = (sp / 8u) * select(144u, 176u, q5);
            let head = wq(o >> 4u);
            let dm = unpack2x16float(head.x);
            let a = k4_scale_min_of(2u * c, head.yzw);
            let b = k4_scale_min_of(2u * c + 1u, head.yzw);
            h.scale = dm.x * vec2<f32>(a.x, b.x);
            h.offset = -dm.y * vec2<f32>(a.y, b.y);
            h.codes = wq((o + select(16u, 48u, q5) + 32u * c + l0) >> 4u);
            if q5 { h.high = wq((o + 16u + l0) >> 4u); }
            h.shifts = vec2<u32>(2u * c, 2u * c + 1u);
            h.xa = 64u * c + l0;
            h.xb = h.xa + 32u;
            h.lead = j;
        }
        default: {
            // q6_K: span j of 8 is ql bytes 16m .. 16m + 16 of half n (m = j % 4, n = j / 4):
            // low nibbles of quarter m / 2, high ones of quarter m / 2 + 2, at l0 = 16 (m % 2)
            // within their quarters; high bits from 2-bit field `quarter` of the qh bytes
            // at l0; an i8 scale per 16 values.
            let j = sp % 8u;
            let n = j / 4u;
            let m = j % 4u;
            let l0 = 16u * (m % 2u);
            let qa = m / 2u;
            let o = (sp / 8u) * 212u;
            let sa = o + 192u + 8u * n + m % 2u + 2u * qa;
            h.scale = half_at(o + 208u) * vec2<f32>(sbyte_at(sa), sbyte_at(sa + 4u));
            h.offset = -32.0 * h.scale;
            h.codes = words4((o + 64u * n + 16u * m) >> 2u);
            h.high = words4((o + 128u + 32u * n + l0) >> 2u);
            h.shifts = vec2<u32>(2u * qa, 2u * qa + 4u);
            h.xa = 128u * n + 32u * qa + l0;
            h.xb = h.xa + 64u;
            h.lead = j;
        }
    }
    return h;
}

// Byte o of the weight, as a signed value.
fn sbyte_at(o: u32) -> f32 {
    return f32(i32(byte_at(o) << 24u) >> 24u);
}

// The codes of values 4k .. 4k + 3 (k < 4) of each half of span h.
struct SpanCodes {
    a: vec4<f32>,
    b: vec4<f32>,
}

fn span_codes(h: Span, k: u32) -> SpanCodes {
    let w = h.codes[k];
    if fmt == 7u {
        return SpanCodes(vec4<f32>(unpack4xI8(w)), vec4<f32>(unpack4xI8(h.codes_b[k])));
    }
    let bytes = unpack4xU8(w);
    var a = bytes & vec4<u32>(15u);
    var b = bytes >> vec4<u32>(4u);
    switch fmt {
        case 5u, 6u: {
            let bit = vec4<u32>(0u, 1u, 2u, 3u) + vec4<u32>(4u * k);
            a |= ((vec4<u32>(h.high.x) >> bit) & vec4<u32>(1u)) << vec4<u32>(4u);
            b |= ((vec4<u32>(h.high.x) >> (bit + vec4<u32>(16u))) & vec4<u32>(1u)) << vec4<u32>(4u);
        }
        case 9u, 10u: {
            let hb = unpack4xU8(h.high[k]);
            let mask = vec4<u32>(select(1u, 3u, fmt == 10u));
            a |= ((hb >> vec4<u32>(h.shifts.x)) & mask) << vec4<u32>(4u);
            b |= ((hb >> vec4<u32>(h.shifts.y)) & mask) << vec4<u32>(4u);
        }
        default: {}
    }
    return SpanCodes(vec4<f32>(a), vec4<f32>(b));
}

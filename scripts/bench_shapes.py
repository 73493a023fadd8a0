"""Random-weight Q4_K_M GGUFs in the shapes of SmolLM2-135M, Qwen2.5-0.5B and Qwen2.5-1.5B,
written on the spot for `make bench-gpu` (nothing large to carry to a GPU machine).

The blocks are random bytes with small f16 scales, so every weight is finite and a forward
reads exactly the bytes a downloaded file of that shape makes it read. The tensor types
follow llama-quantize's Q4_K_M rules: Q4_K everywhere, Q6_K for `attn_v` and `ffn_down` in
the layers `use_more_bits` picks and for the output (the tied embedding here), and the
fallbacks for rows that do not hold whole 256-wide super-blocks (Q4_K -> Q5_0,
Q6_K -> Q8_0), which is why Qwen2.5-0.5B's 896-wide matrices are Q5_0 in the real files.
The vocabulary is synthetic (byte tokens, then fillers), enough for `kvplug bench`, which
feeds drawn token ids.

Usage: bench_shapes.py OUT_DIR [NAME ...] (default: every shape)."""
import os
import sys

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
# name: (architecture, layers, hidden, heads, kv heads, MLP width, vocabulary, rope base,
# q/k/v biases)
SHAPES = {
    "smollm2-135m-shaped": ("llama", 30, 576, 9, 3, 1536, 49152, 1e5, False),
    "qwen2.5-0.5b-shaped": ("qwen2", 24, 896, 14, 2, 4864, 151936, 1e6, True),
    "qwen2.5-1.5b-shaped": ("qwen2", 28, 1536, 12, 2, 8960, 151936, 1e6, True),
}
# Bytes per block and the f16 scales' byte offsets and values (each weight then stays
# within about +-0.1).
BLOCKS = {
    Q.Q4_K: (144, [(0, 1e-4), (2, 1e-4)]),
    Q.Q6_K: (210, [(208, 1e-5)]),
    Q.Q5_0: (22, [(0, 2e-3)]),
    Q.Q8_0: (34, [(0, 2e-4)]),
}
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}


def use_more_bits(i, n):
    """llama-quantize's choice of the layers whose attn_v and ffn_down get more bits."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quantized(rng, kind, rows, cols):
    """A random `[rows, cols]` tensor of `kind` blocks (falling back when a row is not whole
    super-blocks)."""
    if cols % 256 != 0:
        kind = FALLBACK.get(kind, kind)
    size, scales = BLOCKS[kind]
    per_row = cols // gguf.GGML_QUANT_SIZES[kind][0]
    data = rng.integers(0, 256, size=(rows * per_row, size), dtype=np.uint8)
    for offset, value in scales:
        d = (value * rng.uniform(0.5, 1.5, size=rows * per_row)).astype(np.float16)
        data[:, offset:offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, per_row * size), kind


def write(out, name):
    arch, layers, hidden, heads, kv_heads, ffn, vocab, rope, biases = SHAPES[name]
    rng = np.random.default_rng(len(name))
    head_dim = hidden // heads
    w = gguf.GGUFWriter(os.path.join(out, name + ".gguf"), arch)
    w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(32768)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    byte_tokens = [chr(c) for c in range(0x21, 0x7F)]
    tokens = byte_tokens + ['!"'] + [f"<t{i}>" for i in range(vocab - len(byte_tokens) - 1)]
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_token_merges(['! "'])
    w.add_eos_token_id(vocab - 1)

    def tensor(tname, kind, rows, cols):
        data, kind = quantized(rng, kind, rows, cols)
        w.add_tensor(tname, data, raw_dtype=kind)

    def vector(tname, n, scale):
        w.add_tensor(tname, (scale * rng.standard_normal(n)).astype(np.float32))

    tensor("token_embd.weight", Q.Q6_K, vocab, hidden)
    for i in range(layers):
        b = f"blk.{i}."
        more = Q.Q6_K if use_more_bits(i, layers) else Q.Q4_K
        w.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        tensor(b + "attn_q.weight", Q.Q4_K, heads * head_dim, hidden)
        tensor(b + "attn_k.weight", Q.Q4_K, kv_heads * head_dim, hidden)
        tensor(b + "attn_v.weight", more, kv_heads * head_dim, hidden)
        if biases:
            vector(b + "attn_q.bias", heads * head_dim, 0.1)
            vector(b + "attn_k.bias", kv_heads * head_dim, 0.1)
            vector(b + "attn_v.bias", kv_heads * head_dim, 0.1)
        tensor(b + "attn_output.weight", Q.Q4_K, hidden, heads * head_dim)
        w.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
        tensor(b + "ffn_gate.weight", Q.Q4_K, ffn, hidden)
        tensor(b + "ffn_up.weight", Q.Q4_K, ffn, hidden)
        tensor(b + "ffn_down.weight", more, hidden, ffn)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    out = sys.argv[1]
    names = sys.argv[2:] or list(SHAPES)
    os.makedirs(out, exist_ok=True)
    for n in names:
        if n not in SHAPES:
            sys.exit(f"unknown shape {n} (known: {', '.join(SHAPES)})")
        write(out, n)
        print(f"wrote {os.path.join(out, n + '.gguf')}")

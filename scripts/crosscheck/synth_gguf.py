"""Random-weight f32 GGUFs of the architectures kvplug reads, written with the `gguf` package
(llama.cpp's gguf-py), each with a real vocabulary copied from another GGUF: the things a
real file of that family has and the demo model lacks. llama-quantize then makes quantized
copies of them.

- qwen3: per-head q/k RMSNorm, head_dim 128 with 8 heads on a 512-wide model (q is wider
  than the residual), tied embeddings.
- qwen2, tied: q/k/v biases, the output reading the embedding table.
- llama3: `rope_freqs` (Llama 3.1 rope scaling factors), tied embeddings, the `llama-bpe`
  pre-tokenizer without `add_bos_token` (both sides' default then starts a raw prompt with
  BOS), rope base 500000.
- llama, untied: a separate output matrix, 4 KV heads, rope base 10000, the `llama3`
  pre-tokenizer name.
- lfm2 (a hybrid): short-convolution layers (3 taps) between GQA attention layers with
  q/k norms, per-layer KV head counts (0 on convolution layers), tied embeddings, the
  final norm as `token_embd_norm`; and a second shape with 4 taps, an untied output and
  another layer pattern.
- qwen35 (a hybrid): gated delta-rule layers (a 4-tap convolution over q, k and v, L2-normed
  q/k, per-head decay and beta, a gated RMSNorm) with a full-attention layer every
  `full_attention_interval`; the attention layers' q projection carries an output gate,
  q/k norms, partial rotary (MRoPE sections on text positions); more value heads than key
  heads; and a second shape with one head kind per count and another interval.
- qwen3moe (a mixture of experts): Qwen3's attention with every MLP replaced by a router
  over 3-D expert tensors (`ffn_{gate,up,down}_exps`), 8 experts of which 2 run per token;
  and a second shape with 16 experts, 4 per token, an untied output.
- gpt-oss (a mixture of experts): sliding (here 8 tokens) and full attention layers
  alternating, biases on q/k/v/o, a learned sink per head, YaRN rotary (factor 32 over 4096
  positions), a biased router whose top-k logits are softmaxed, biased experts with the
  clamped SwiGLU (the expert matrices f32 here: llama-quantize's MXFP4 is for another
  check), separate output matrix; and a second shape with another window, expert count and
  head layout.
- granitehybrid (Granite 4.0-H, a hybrid): Mamba2 layers (one input projection for z, x, B, C
  and dt, a biased depthwise convolution over x, B and C, per-head A, D and step bias, a
  grouped gated RMSNorm) between GQA attention layers without positional encoding, per-layer
  KV head counts (0 on Mamba2 layers), Granite's embedding, residual, attention and logit
  multipliers, tied embeddings; and a second shape with attention first, rotary, 3 taps and
  an untied output.

Attention and MLP outputs are scaled up so that the layers, not the embedding, decide the
next token (else every model repeats its input). Usage: synth_gguf.py VOCAB_GGUF OUT_DIR
[bench|quoting [NAME...]]; with `bench`, only (or only the files NAMEd) an LFM2-350M-shaped
file (16 layers of 1024, attention at 2, 5, 8, 10, 12, 14, MLP 4608), a Qwen3.5-0.8B-shaped
one (24 layers of 1024, attention every 4th with 8 heads of 256, 2 KV heads, rotary on 64
dims; 16 key and 16 value heads of 128 in the delta rule, MLP 3584) and two qwen3moe files of the same active size (16 layers
of 1024, 4 experts of 512 per token) with 32 and 64 experts (about 1.0B and 1.8B in all,
0.3B active), a GPT-OSS-shaped one and a Granite-4.0-H-350M-shaped one (32 layers of 768,
attention at 10, 13, 17, 27, Mamba2 of 48 heads of 32 with a state of 128, MLP 2048) for
benchmarks, to quantize with llama-quantize. With `quoting`, the same shapes as models
that quote (NAME-quoting.f32.gguf, their block outputs scaled down and their output matrix
a `successor_readout`) and the copy-with-edits tasks they answer (`quoting_tasks`, in
NAME-quoting.tasks.json), of the hybrid shapes only: what speculative decoding by prompt
lookup is measured on (scripts/bench-speculation.sh)."""
import json
import os
import sys

import gguf
import numpy as np

src, out = sys.argv[1], sys.argv[2]
bench = sys.argv[3:4] in (["bench"], ["quoting"])
os.makedirs(out, exist_ok=True)
vocab_file = gguf.GGUFReader(src)
VOCAB = len(vocab_file.fields["tokenizer.ggml.tokens"].data)


def quoting_tasks(length=384, edits=(64, 16, 8, 4)):
    """Copy-with-edits tasks over the vocabulary's ordinary tokens, no token used twice
    anywhere: for each `k` in `edits`, a prompt (a document of `length` tokens and a
    separator) and the answer a quoting model gives, the document again with a fresh token
    inserted after every `k`-th (as a rename inserts `_sum` after every `total`). Prompt
    lookup drafts the copied runs and misses each insertion and the two tokens after it.
    Returns the tasks and the readout text: every task's separator and answer."""
    types = np.array(vocab_file.fields["tokenizer.ggml.token_type"].contents())
    normal = np.flatnonzero(types == gguf.TokenType.NORMAL)
    need = sum(length + 1 + length // k for k in edits)
    pool = iter(np.random.default_rng(7).choice(normal, need, replace=False).tolist())
    tasks, text = [], []
    for k in edits:
        doc = [next(pool) for _ in range(length)]
        sep = next(pool)
        answer = []
        for i, t in enumerate(doc, 1):
            answer.append(t)
            if i % k == 0:
                answer.append(next(pool))
        tasks.append({"insert_every": k, "prompt": doc + [sep], "answer": answer})
        text += [sep] + answer
    return tasks, text


# With `quoting`, the hybrid bench files are written as quoting models of the tasks'
# answers, each beside its tasks (NAME-quoting.tasks.json).
TASKS, QUOTING = quoting_tasks() if sys.argv[3:4] == ["quoting"] else (None, None)


def copy_tokenizer(w, pre, state_bos):
    """The source's tokenizer.* fields, with pre-tokenizer `pre`; `add_bos_token` only where
    `state_bos`."""
    for key, field in vocab_file.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if key == "tokenizer.ggml.add_bos_token" and not state_bos:
            continue
        kind = field.types[0]
        value = field.contents()
        if key == "tokenizer.ggml.pre":
            w.add_string(key, pre)
        elif kind == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(key, value)
        elif kind == gguf.GGUFValueType.UINT32:
            w.add_uint32(key, int(value))
        elif kind == gguf.GGUFValueType.BOOL:
            w.add_bool(key, bool(value))
        else:
            sys.exit(f"{key}: value type {kind} not copied")


def llama3_rope_factors(base, head_dim, factor=8.0, low=1.0, high=4.0, original=8192):
    """Llama 3.1's per-frequency divisors: 1 for short wavelengths, `factor` for long ones,
    interpolated between."""
    out = []
    for f in base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelength = 2 * np.pi / f
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            s = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


# A quoting file's block outputs are 1/256 of the usual, so that its residual stream stays
# close to the current token's embedding and the readout decides the next token.
BLOCK_OUTPUTS = ("attn_output.weight", "ffn_down.weight", "ssm_out.weight",
                 "shortconv.out_proj.weight")


def successor_readout(embed, text):
    """An output matrix under which the greedy next token after any token `t` of `text` is
    its most frequent successor in `text` (the earliest on a tie; the first token of `text`
    when `t` has none): row `s` sums the unit embeddings of the tokens whose successor is
    `s`, over the square root of the width. With the residual near `t`'s embedding, `s`'s
    logit is then about 20 and every other one a unit or so from 0 (random embeddings are
    nearly orthogonal)."""
    counts = {}
    for t, s in zip(text, text[1:]):
        counts.setdefault(t, {}).setdefault(s, 0)
        counts[t][s] += 1
    rows = np.zeros_like(embed)
    for t in set(text):
        follow = counts.get(t, {text[0]: 1})
        s = max(follow, key=follow.get)  # dicts keep insertion order: the earliest wins ties
        e = embed[t].astype(np.float64)
        rows[s] += (20.0 * e / (np.linalg.norm(e) * np.sqrt(e.size))).astype(np.float32)
    return rows


class Writer:
    """An f32 GGUF of `arch` under OUT_DIR with the shape facts every family shares, and
    random tensors drawn from one seeded generator."""

    def __init__(self, arch, name, hidden, layers, heads, ffn, seed, context=8192):
        self.rng = np.random.default_rng(seed)
        self.path = os.path.join(out, f"{name}{'-quoting' if QUOTING else ''}.f32.gguf")
        self.w = w = gguf.GGUFWriter(self.path, arch)
        w.add_name(name)
        w.add_context_length(context)
        w.add_embedding_length(hidden)
        w.add_block_count(layers)
        w.add_feed_forward_length(ffn)
        w.add_head_count(heads)

    def weight(self, n, rows, cols, gain=1.0):
        if QUOTING and n.endswith(BLOCK_OUTPUTS):
            gain /= 256
        self.w.add_tensor(n, (self.rng.standard_normal((rows, cols)) * gain / np.sqrt(cols))
                          .astype(np.float32))

    def norm(self, n, size):
        self.w.add_tensor(n, (1.0 + 0.1 * self.rng.standard_normal(size)).astype(np.float32))

    def mlp(self, b, hidden, ffn, down_gain):
        """Block `b`'s norm and SiLU MLP (its down projection scaled by `down_gain`)."""
        self.norm(b + "ffn_norm.weight", hidden)
        self.weight(b + "ffn_gate.weight", ffn, hidden)
        self.weight(b + "ffn_up.weight", ffn, hidden)
        self.weight(b + "ffn_down.weight", hidden, ffn, gain=down_gain)

    def stacked(self, n, experts, rows, cols, gain=1.0):
        """A 3-D expert tensor `[experts, rows, cols]` (llama.cpp's `*_exps`)."""
        self.w.add_tensor(n, (self.rng.standard_normal((experts, rows, cols)) * gain
                              / np.sqrt(cols)).astype(np.float32))

    def embedding(self, hidden):
        self.embed = self.rng.standard_normal((VOCAB, hidden)).astype(np.float32)
        self.w.add_tensor("token_embd.weight", self.embed)

    def output(self, hidden, tied):
        """The output matrix: none where `tied`, else random; in a quoting file always the
        successor readout (`successor_readout`)."""
        if QUOTING:
            self.w.add_tensor("output.weight", successor_readout(self.embed, QUOTING))
        elif not tied:
            self.weight("output.weight", VOCAB, hidden, gain=20.0)

    def finish(self):
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        if TASKS:
            with open(self.path.removesuffix(".f32.gguf") + ".tasks.json", "w") as f:
                json.dump(TASKS, f)
        print(self.path)


def model(arch, name, hidden, layers, heads, kv_heads, head_dim, ffn, *, qk_norm=False,
          biases=False, tied=True, rope_base=1e6, llama3_rope=False, pre="qwen2", state_bos=True,
          seed=0):
    f = Writer(arch, name, hidden, layers, heads, ffn, seed)
    w, rng, weight, norm = f.w, f.rng, f.weight, f.norm
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    copy_tokenizer(w, pre, state_bos)
    f.embedding(hidden)
    for i in range(layers):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", hidden)
        weight(b + "attn_q.weight", heads * head_dim, hidden)
        weight(b + "attn_k.weight", kv_heads * head_dim, hidden)
        weight(b + "attn_v.weight", kv_heads * head_dim, hidden)
        weight(b + "attn_output.weight", hidden, heads * head_dim, gain=8.0)
        if biases:
            for proj, rows in [("q", heads), ("k", kv_heads), ("v", kv_heads)]:
                w.add_tensor(f"{b}attn_{proj}.bias",
                             (0.5 * rng.standard_normal(rows * head_dim)).astype(np.float32))
        if qk_norm:
            norm(b + "attn_q_norm.weight", head_dim)
            norm(b + "attn_k_norm.weight", head_dim)
        f.mlp(b, hidden, ffn, 8.0)
    norm("output_norm.weight", hidden)
    f.output(hidden, tied)
    if llama3_rope:
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope_base, head_dim))
    f.finish()


def lfm2(name, hidden, layers, attention, heads, kv_heads, ffn, taps, *, tied=True, seed=0):
    """An LFM2 file: layers in `attention` attend, the others convolve."""
    head_dim = hidden // heads
    f = Writer("lfm2", name, hidden, layers, heads, ffn, seed)
    w, weight, norm = f.w, f.weight, f.norm
    w.add_head_count_kv([kv_heads if i in attention else 0 for i in range(layers)])
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_shortconv_l_cache(taps)
    w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    copy_tokenizer(w, "qwen2", True)
    f.embedding(hidden)
    for i in range(layers):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", hidden)
        if i in attention:
            weight(b + "attn_q.weight", heads * head_dim, hidden)
            weight(b + "attn_k.weight", kv_heads * head_dim, hidden)
            weight(b + "attn_v.weight", kv_heads * head_dim, hidden)
            weight(b + "attn_output.weight", hidden, heads * head_dim, gain=8.0)
            norm(b + "attn_q_norm.weight", head_dim)
            norm(b + "attn_k_norm.weight", head_dim)
        else:
            # The depthwise kernel, [hidden, taps]; B, C and x stacked in the projection.
            weight(b + "shortconv.conv.weight", hidden, taps, gain=2.0)
            weight(b + "shortconv.in_proj.weight", 3 * hidden, hidden, gain=2.0)
            weight(b + "shortconv.out_proj.weight", hidden, hidden, gain=8.0)
        f.mlp(b, hidden, ffn, 8.0)
    norm("token_embd_norm.weight", hidden)
    f.output(hidden, tied)
    f.finish()


def qwen35(name, hidden, layers, interval, heads, kv_heads, head_dim, rope_dim, sections,
           k_heads, v_heads, state, ffn, *, tied=True, seed=0):
    """A Qwen3.5 file: every `interval`-th layer attends, the others run the delta rule."""
    f = Writer("qwen35", name, hidden, layers, heads, ffn, seed)
    w, rng, weight, norm = f.w, f.rng, f.weight, f.norm
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(rope_dim)
    w.add_rope_dimension_sections(sections)
    w.add_rope_freq_base(1e7)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_full_attention_interval(interval)
    w.add_ssm_conv_kernel(4)
    w.add_ssm_inner_size(v_heads * state)
    w.add_ssm_state_size(state)
    w.add_ssm_time_step_rank(v_heads)
    w.add_ssm_group_count(k_heads)
    w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    copy_tokenizer(w, "qwen2", True)
    f.embedding(hidden)
    conv_dim = 2 * k_heads * state + v_heads * state
    for i in range(layers):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", hidden)
        if (i + 1) % interval == 0:
            # q and its output gate, interleaved per head.
            weight(b + "attn_q.weight", 2 * heads * head_dim, hidden)
            weight(b + "attn_k.weight", kv_heads * head_dim, hidden)
            weight(b + "attn_v.weight", kv_heads * head_dim, hidden)
            weight(b + "attn_output.weight", hidden, heads * head_dim, gain=8.0)
            norm(b + "attn_q_norm.weight", head_dim)
            norm(b + "attn_k_norm.weight", head_dim)
        else:
            weight(b + "attn_qkv.weight", conv_dim, hidden, gain=2.0)
            weight(b + "attn_gate.weight", v_heads * state, hidden, gain=2.0)
            weight(b + "ssm_conv1d.weight", conv_dim, 4, gain=2.0)
            w.add_tensor(b + "ssm_dt.bias", rng.standard_normal(v_heads).astype(np.float32))
            # -exp(A_log), as the converter stores it.
            w.add_tensor(b + "ssm_a", -np.exp(rng.uniform(-1.0, 1.0, v_heads)).astype(np.float32))
            weight(b + "ssm_beta.weight", v_heads, hidden, gain=2.0)
            weight(b + "ssm_alpha.weight", v_heads, hidden, gain=2.0)
            norm(b + "ssm_norm.weight", state)
            weight(b + "ssm_out.weight", hidden, v_heads * state, gain=8.0)
        norm(b + "post_attention_norm.weight", hidden)
        weight(b + "ffn_gate.weight", ffn, hidden)
        weight(b + "ffn_up.weight", ffn, hidden)
        weight(b + "ffn_down.weight", hidden, ffn, gain=8.0)
    norm("output_norm.weight", hidden)
    f.output(hidden, tied)
    f.finish()


def qwen3moe(name, hidden, layers, heads, kv_heads, head_dim, experts, used, width, *,
             tied=True, seed=0):
    """A Qwen3-MoE file: Qwen3 attention (q/k norms), a router and `experts` experts of
    `width` in every layer, `used` of them per token."""
    f = Writer("qwen3moe", name, hidden, layers, heads, width, seed)
    w, rng, weight, norm = f.w, f.rng, f.weight, f.norm
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(experts)
    w.add_expert_used_count(used)
    w.add_expert_feed_forward_length(width)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    copy_tokenizer(w, "qwen2", True)
    f.embedding(hidden)

    for i in range(layers):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", hidden)
        weight(b + "attn_q.weight", heads * head_dim, hidden)
        weight(b + "attn_k.weight", kv_heads * head_dim, hidden)
        weight(b + "attn_v.weight", kv_heads * head_dim, hidden)
        weight(b + "attn_output.weight", hidden, heads * head_dim, gain=8.0)
        norm(b + "attn_q_norm.weight", head_dim)
        norm(b + "attn_k_norm.weight", head_dim)
        norm(b + "ffn_norm.weight", hidden)
        # A router with a spread of a few units between experts, so that the choice is not
        # decided by rounding.
        weight(b + "ffn_gate_inp.weight", experts, hidden, gain=4.0)
        f.stacked(b + "ffn_gate_exps.weight", experts, width, hidden)
        f.stacked(b + "ffn_up_exps.weight", experts, width, hidden)
        f.stacked(b + "ffn_down_exps.weight", experts, hidden, width, gain=8.0)
    norm("output_norm.weight", hidden)
    f.output(hidden, tied)
    f.finish()


def gpt_oss(name, hidden, layers, heads, kv_heads, head_dim, experts, used, width, window, *,
            seed=0):
    """A GPT-OSS file, as llama.cpp's converter writes one (f32 here)."""
    f = Writer("gpt-oss", name, hidden, layers, heads, width, seed)
    w, rng, weight, norm = f.w, f.rng, f.weight, f.norm
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(150000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(experts)
    w.add_expert_used_count(used)
    w.add_expert_feed_forward_length(width)
    w.add_sliding_window(window)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    copy_tokenizer(w, "qwen2", True)
    f.embedding(hidden)

    def vector(n, size, gain):
        w.add_tensor(n, (gain * rng.standard_normal(size)).astype(np.float32))

    for i in range(layers):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", hidden)
        for proj, rows in [("q", heads), ("k", kv_heads), ("v", kv_heads)]:
            weight(f"{b}attn_{proj}.weight", rows * head_dim, hidden)
            vector(f"{b}attn_{proj}.bias", rows * head_dim, 0.5)
        weight(b + "attn_output.weight", hidden, heads * head_dim, gain=8.0)
        vector(b + "attn_output.bias", hidden, 0.5)
        vector(b + "attn_sinks.weight", heads, 1.0)
        norm(b + "post_attention_norm.weight", hidden)
        weight(b + "ffn_gate_inp.weight", experts, hidden, gain=4.0)
        vector(b + "ffn_gate_inp.bias", experts, 1.0)
        f.stacked(b + "ffn_gate_exps.weight", experts, width, hidden, gain=2.0)
        f.stacked(b + "ffn_up_exps.weight", experts, width, hidden, gain=2.0)
        f.stacked(b + "ffn_down_exps.weight", experts, hidden, width, gain=8.0)
        w.add_tensor(b + "ffn_gate_exps.bias",
                     (0.5 * rng.standard_normal((experts, width))).astype(np.float32))
        w.add_tensor(b + "ffn_up_exps.bias",
                     (0.5 * rng.standard_normal((experts, width))).astype(np.float32))
        w.add_tensor(b + "ffn_down_exps.bias",
                     (0.5 * rng.standard_normal((experts, hidden))).astype(np.float32))
    norm("output_norm.weight", hidden)
    f.output(hidden, False)
    f.finish()


def granitehybrid(name, hidden, layers, attention, heads, kv_heads, ffn, *, ssm_heads,
                  ssm_head_dim, groups=1, state, conv=4, rope=False, tied=True, conv_bias=True,
                  seed=0):
    """A Granite 4.0-H file (`granitehybrid`) with the keys and layouts llama.cpp's converter
    writes for a dense one (GraniteMoeHybridForCausalLM, no experts): layers in `attention`
    attend, the others are Mamba2 mixers of `ssm_heads` heads of `ssm_head_dim` over a state
    of `state` per group. Without `rope` no positional encoding at all (Granite 4.0-H); with
    it, rotary on whole heads (as a Bamba file). llama.cpp adds the convolution bias
    unconditionally, so a file without one (`conv_bias=False`) is for readers, not for it."""
    d_inner = ssm_heads * ssm_head_dim
    # llama.cpp's loader asserts an expansion of 2.
    assert d_inner == 2 * hidden and ssm_heads % groups == 0
    head_dim = hidden // heads
    channels = d_inner + 2 * groups * state  # x, B and C, what the convolution runs over
    # The converter writes a context of 2**20 for a model without positions.
    f = Writer("granitehybrid", name, hidden, layers, heads, ffn, seed,
               context=8192 if rope else 2**20)
    w, rng, weight, norm = f.w, f.rng, f.weight, f.norm
    w.add_head_count_kv([kv_heads if i in attention else 0 for i in range(layers)])
    w.add_rope_freq_base(1e4)
    w.add_layer_norm_rms_eps(1e-5)
    # A dense Granite 4.0-H's config states 0 experts and its MLP as the shared one, and the
    # converter writes all three.
    w.add_expert_count(0)
    w.add_expert_used_count(0)
    w.add_expert_shared_feed_forward_length(ffn)
    w.add_vocab_size(VOCAB)
    w.add_rope_dimension_count(head_dim)  # written with or without rotary
    # Granite's multipliers, each away from its neutral value and in Granite 4.0-H's direction
    # (its 350M: embedding 12, residual 0.246, attention 1/64 with 64-wide heads, logits /3):
    # attention scores scaled by 1/head_dim (q and k at gain 3 keep them a unit or so apart),
    # the embedding doubled, every layer's output times 1/4, logits divided by 4. The output
    # projections are at gain 64, 16 once scaled: twice the other writers', as the embedding
    # is doubled (at 8 the tied file repeats its last token about one step in ten).
    w.add_attention_scale(1.0 / head_dim)
    w.add_embedding_scale(2.0)
    w.add_residual_scale(0.25)
    w.add_logit_scale(4.0)
    w.add_ssm_conv_kernel(conv)
    w.add_ssm_state_size(state)
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_time_step_rank(ssm_heads)
    w.add_rope_scaling_finetuned(rope)  # Granite's switch for rotary
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    copy_tokenizer(w, "qwen2", True)
    f.embedding(hidden)
    for i in range(layers):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", hidden)
        if i in attention:
            weight(b + "attn_q.weight", heads * head_dim, hidden, gain=3.0)
            weight(b + "attn_k.weight", kv_heads * head_dim, hidden, gain=3.0)
            weight(b + "attn_v.weight", kv_heads * head_dim, hidden)
            weight(b + "attn_output.weight", hidden, heads * head_dim, gain=64.0)
        else:
            # z, then x, B and C, then dt, stacked; dt's rows at a small gain so that the
            # step stays near its bias.
            gains = np.repeat([2.0, 2.0, 0.5], [d_inner, channels, ssm_heads])
            w.add_tensor(b + "ssm_in.weight",
                         (rng.standard_normal((gains.size, hidden)) * gains[:, None]
                          / np.sqrt(hidden)).astype(np.float32))
            # The depthwise kernel, [channels, conv] (the converter squeezes [channels, 1, conv]).
            weight(b + "ssm_conv1d.weight", channels, conv)
            if conv_bias:
                w.add_tensor(b + "ssm_conv1d.bias",
                             (0.5 * rng.standard_normal(channels)).astype(np.float32))
            # Mamba2's initialization: softplus of the bias log-uniform, here in [0.01, 0.5].
            dt = np.exp(rng.uniform(np.log(0.01), np.log(0.5), ssm_heads))
            w.add_tensor(b + "ssm_dt.bias", (dt + np.log(-np.expm1(-dt))).astype(np.float32))
            # -exp(A_log), [heads, 1] as the converter stores it: A in [-8, -0.5].
            w.add_tensor(b + "ssm_a", -np.exp(rng.uniform(np.log(0.5), np.log(8.0),
                                                          (ssm_heads, 1))).astype(np.float32))
            w.add_tensor(b + "ssm_d", rng.uniform(0.5, 1.5, (ssm_heads, 1)).astype(np.float32))
            # The gated RMSNorm's weight per group, [groups, d_inner / groups].
            w.add_tensor(b + "ssm_norm.weight",
                         (1.0 + 0.1 * rng.standard_normal((groups, d_inner // groups)))
                         .astype(np.float32))
            weight(b + "ssm_out.weight", hidden, d_inner, gain=64.0)
        f.mlp(b, hidden, ffn, 64.0)
    norm("output_norm.weight", hidden)
    f.output(hidden, tied)
    f.finish()


BENCH = {
    "lfm2-350m-shaped": lambda: lfm2("lfm2-350m-shaped", 1024, 16, {2, 5, 8, 10, 12, 14}, 16,
                                     8, 4608, 3),
    "qwen35-0.8b-shaped": lambda: qwen35("qwen35-0.8b-shaped", 1024, 24, 4, 8, 2, 256, 64,
                                         [11, 11, 10, 0], 16, 16, 128, 3584),
    "qwen3moe-1b-a0.3b-shaped": lambda: qwen3moe("qwen3moe-1b-a0.3b-shaped", 1024, 16, 8, 2,
                                                 128, 32, 4, 512),
    "qwen3moe-2b-a0.3b-shaped": lambda: qwen3moe("qwen3moe-2b-a0.3b-shaped", 1024, 16, 8, 2,
                                                 128, 64, 4, 512, seed=1),
    # 1.1B parameters, 0.5B active: GPT-OSS's pattern (sliding window 128 on every other
    # layer, 4 of the experts per token) at a twentieth of GPT-OSS-20B.
    "gpt-oss-1b-a0.5b-shaped": lambda: gpt_oss("gpt-oss-1b-a0.5b-shaped", 1024, 16, 16, 4, 64,
                                               16, 4, 1024, 128, seed=2),
    # Granite-4.0-H-350M's shape (its config.json): 32 layers of 768, attention at 10, 13, 17
    # and 27 (12 heads of 64, 4 KV heads, no positions), Mamba2 elsewhere (48 heads of 32, a
    # state of 128 in one group, 4 taps), MLP 2048, tied embeddings.
    "granite-4.0-h-350m-shaped": lambda: granitehybrid(
        "granite-4.0-h-350m-shaped", 768, 32, {10, 13, 17, 27}, 12, 4, 2048, ssm_heads=48,
        ssm_head_dim=32, state=128, seed=5),
}
# The shapes a quoting model is written for (the MoE writers' expert outputs are not scaled
# down, and GPT-OSS's biases would move the residual away from the token's embedding).
QUOTABLE = ["lfm2-350m-shaped", "qwen35-0.8b-shaped", "granite-4.0-h-350m-shaped"]
if bench:
    known = QUOTABLE if QUOTING else list(BENCH)
    names = sys.argv[4:] or known
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"synth_gguf.py: no {'quoting' if QUOTING else 'bench'} file named "
                 f"{unknown} (there are {known})")
    for n in names:
        BENCH[n]()
    sys.exit(0)

model("qwen3", "qwen3-synthetic", 512, 4, 8, 2, 128, 1536, qk_norm=True)
model("qwen2", "qwen2-synthetic-tied", 512, 4, 8, 2, 64, 1536, biases=True)
model("llama", "llama3-synthetic", 512, 4, 8, 2, 64, 1536, rope_base=5e5, llama3_rope=True,
      pre="llama-bpe", state_bos=False)
model("llama", "llama-synthetic-untied", 512, 4, 8, 4, 64, 1536, rope_base=1e4, tied=False,
      pre="llama3")
# LFM2-350M's pattern scaled down (attention at 2, 5 of 8) and another one.
lfm2("lfm2-synthetic", 512, 8, {2, 5}, 8, 4, 1536, 3)
lfm2("lfm2-synthetic-untied", 256, 6, {0, 3, 4}, 4, 2, 768, 4, tied=False, seed=1)
# Qwen3.5-0.8B's pattern scaled down (attention every 4th layer, 2 value heads per key head,
# rotary on a quarter of each head; MRoPE sections that leave 4 of the 16 rotary pairs to the
# fourth section, still on text) and another one.
qwen35("qwen35-synthetic", 512, 8, 4, 8, 2, 128, 32, [2, 6, 6, 2], 4, 8, 64, 1536)
qwen35("qwen35-synthetic-untied", 256, 6, 3, 4, 1, 64, 64, [11, 11, 10, 0], 2, 2, 32, 768,
       tied=False, seed=2)
qwen3moe("qwen3moe-synthetic", 512, 4, 8, 2, 64, 8, 2, 256)
qwen3moe("qwen3moe-synthetic-untied", 256, 3, 4, 1, 64, 16, 4, 128, tied=False, seed=3)
gpt_oss("gpt-oss-synthetic", 512, 4, 8, 2, 64, 8, 2, 256, 8)
gpt_oss("gpt-oss-synthetic-b", 256, 3, 4, 4, 64, 16, 4, 128, 5, seed=4)
# Granite 4.0-H's pattern scaled down (Mamba2 mostly, 2 attention layers without positions)
# and another one: attention first, rotary, 3 taps, an untied output (one group of B/C: kvplug
# refuses the grouped output norm of more).
granitehybrid("granitehybrid-synthetic", 256, 6, {2, 5}, 4, 2, 768, ssm_heads=8,
              ssm_head_dim=64, state=32, conv=4)
granitehybrid("granitehybrid-synthetic-rope", 256, 6, {0, 3}, 4, 2, 768, ssm_heads=8,
              ssm_head_dim=64, state=32, conv=3, rope=True, tied=False, seed=6)

"""llama.cpp's own greedy agreement between its K/V types: how far its greedy text with
quantized (or differently computed) K/V follows its text with f16 K/V, on one GGUF.

The anchor for kvplug's `kv_quality` example (backends/cpu/BENCH.md, "KV dtype quality"):
the same six chat prompts (read from host/sdk/examples/kv_quality.rs, so the two cannot drift),
rendered with the GGUF's own chat template as kvplug renders it, N greedy tokens each with end-of-sequence ignored,
llama.cpp driven in process through llama-cpp-python's ctypes bindings on the libllama that
scripts/peers-llama-cpp.sh built. Reference: f16 K/V with flash attention on (llama.cpp needs
it for quantized V). Prints, per other configuration, where its ids first leave the
reference's per prompt (N = agreed throughout) and the reference's top-2 logit gap there: a
divergence at a small gap is a near tie that any change of arithmetic can flip.

Usage: kv_agreement.py GGUF N"""
import ast
import re
import sys
from pathlib import Path

import jinja2
import llama_cpp
import numpy as np

path, n = sys.argv[1], int(sys.argv[2])
source = (Path(__file__).parents[2] / "host/sdk/examples/kv_quality.rs").read_text()
block = re.search(r"const PROMPTS: \[&str; \d+\] = \[(.*?)\];", source, re.S).group(1)
# Rust string literals with only \n and \" escapes read the same as Python's.
prompts = [ast.literal_eval(lit) for lit in re.findall(r'"(?:[^"\\]|\\.)*"', block)]

T = llama_cpp
REFERENCE = "f16, flash attention"
CONFIGS = {
    REFERENCE: dict(type_k=T.GGML_TYPE_F16, type_v=T.GGML_TYPE_F16, flash_attn=True),
    "f16, no flash attention": dict(
        type_k=T.GGML_TYPE_F16, type_v=T.GGML_TYPE_F16, flash_attn=False),
    "q8_0": dict(type_k=T.GGML_TYPE_Q8_0, type_v=T.GGML_TYPE_Q8_0, flash_attn=True),
    "q4_0": dict(type_k=T.GGML_TYPE_Q4_0, type_v=T.GGML_TYPE_Q4_0, flash_attn=True),
}


def greedy(cfg, prompt_ids):
    """Per prompt: N greedy ids and the top-2 logit gap before each."""
    llm = llama_cpp.Llama(model_path=path, n_threads=2, n_ctx=1024, logits_all=True,
                          verbose=False, **cfg)
    runs = []
    for ids in prompt_ids:
        llm.reset()
        llm.eval(ids)
        toks, gaps = [], []
        for _ in range(n):
            logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            best, second = np.argsort(logits)[::-1][:2]
            toks.append(int(best))
            gaps.append(float(logits[best] - logits[second]))
            llm.eval([int(best)])
        runs.append((toks, gaps))
    return runs


vocab = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
if "tokenizer.chat_template" not in vocab.metadata:
    sys.exit(f"{path}: no chat template in the file (kv_quality would use kvplug's built-in "
             "fallback, which this script does not reproduce)")


def special(token):
    """The text of special token `token`."""
    return vocab.detokenize([token], special=True).decode()


# As kvplug renders a chat (host/sdk/src/text.rs, chat_template.rs): trimmed and
# left-stripped blocks, the vocabulary's BOS and EOS texts, then the rendered text tokenized
# with its special tokens recognised and no BOS added.
env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
template = env.from_string(vocab.metadata["tokenizer.chat_template"])
prompt_ids = [
    vocab.tokenize(
        template.render(messages=[{"role": "user", "content": p}], add_generation_prompt=True,
                        bos_token=special(vocab.token_bos()),
                        eos_token=special(vocab.token_eos())).encode(),
        add_bos=False, special=True)
    for p in prompts
]
reference = greedy(CONFIGS[REFERENCE], prompt_ids)
print(f"{Path(path).name}: llama.cpp, {len(prompts)} prompts x {n} greedy tokens, "
      f"against {REFERENCE}")
for name, cfg in CONFIGS.items():
    if name == REFERENCE:
        continue
    cells = []
    for (ref, gaps), (ids, _) in zip(reference, greedy(cfg, prompt_ids)):
        first = next((i for i, (a, b) in enumerate(zip(ref, ids)) if a != b), None)
        cells.append("N" if first is None else f"{first} (gap {gaps[first]:.3f})")
    print(f"  {name}: first divergence per prompt: {' / '.join(cells)}", flush=True)

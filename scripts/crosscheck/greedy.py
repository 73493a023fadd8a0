"""Greedy token ids of llama.cpp and of kvplug on one GGUF file and raw prompt, compared.

llama.cpp runs in process through llama-cpp-python's ctypes bindings (its sdist's `llama_cpp`
package) on the libllama that scripts/peers-llama-cpp.sh built; kvplug runs as
`kvplug run --raw --json`. Both tokenize the prompt themselves (the ids must agree) and
decode N tokens greedily with K/V in KV (f16 or f32 on both sides). Prints one line:
identical ids, or the first divergence with how far kvplug's pick was below llama.cpp's
best in llama.cpp's logits there (a divergence at a near tie is arithmetic, one at a wide
gap is a bug).

Usage: greedy.py KVPLUG PLUGINS GGUF N PROMPT BACKEND KV MAX_FLIP_GAP
Exit status 1 if the prompt ids differ, kvplug stops short, or the ids diverge where that
gap exceeds MAX_FLIP_GAP (a negative MAX_FLIP_GAP reports divergences without failing)."""
import json
import subprocess
import sys

import llama_cpp
import numpy as np

kvplug, plugins, path, n, prompt, backend, kv, max_gap = sys.argv[1:9]
n, max_gap = int(n), float(max_gap)
ggml_type = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}[kv]

llm = llama_cpp.Llama(model_path=path, n_threads=2, n_ctx=1024, logits_all=True,
                      verbose=False, type_k=ggml_type, type_v=ggml_type)
# llama.cpp's own raw-prompt rule: BOS where the vocabulary asks for it, specials parsed.
prompt_ids = llm.tokenize(prompt.encode(), add_bos=llm._model.add_bos_token(), special=True)
llm.eval(prompt_ids)
ids, gaps, rows = [], [], []
for _ in range(n):
    logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    best, second = np.argsort(logits)[::-1][:2]
    ids.append(int(best))
    gaps.append(float(logits[best] - logits[second]))
    rows.append(logits)
    llm.eval([int(best)])

cmd = [kvplug, "--plugins", plugins, "run", "--backend", backend, "--model", path, "--raw",
       "--prompt", prompt, "--max-tokens", str(n), "--ignore-eos", "--json", "--kv-dtype", kv]
res = subprocess.run(cmd, capture_output=True, text=True)
if res.returncode != 0:
    print(f"{path}: kvplug failed: {res.stderr[-2000:]}")
    sys.exit(1)
report = json.loads(res.stdout)
ours = report["ids"]
name = f"{path.rsplit('/', 1)[-1]} on {backend}, {kv} K/V"
if report["prompt_ids"] != prompt_ids:
    print(f"{name}: prompt ids differ: llama.cpp {prompt_ids}, kvplug {report['prompt_ids']}")
    sys.exit(1)
if len(ours) != n:
    print(f"{name}: kvplug returned {len(ours)} of {n} ids")
    sys.exit(1)
first = next((i for i, (a, b) in enumerate(zip(ids, ours)) if a != b), None)
if first is None:
    print(f"{name}: {n} identical ids after {len(prompt_ids)} prompt tokens "
          f"(llama.cpp's smallest top-2 gap on the way {min(gaps):.3f})")
    sys.exit(0)
# How far below llama.cpp's best kvplug's pick was, in llama.cpp's logits.
gap = float(rows[first][ids[first]] - rows[first][ours[first]])
print(f"{name}: ids diverge at {first} of {n}: llama.cpp {ids[first]}, kvplug {ours[first]}, "
      f"{gap:.4f} below it in llama.cpp's logits (median top-2 gap over the run "
      f"{np.median(gaps):.3f})")
sys.exit(1 if max_gap >= 0 and not gap <= max_gap else 0)

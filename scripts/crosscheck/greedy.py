"""Greedy token ids of llama.cpp and of kvplug on one GGUF file and raw prompt, compared.

llama.cpp runs in process through llama-cpp-python's ctypes bindings (its sdist's `llama_cpp`
package) on the libllama that scripts/peers-llama-cpp.sh built; kvplug runs as
`kvplug run --raw --json`. Both tokenize the prompt themselves (the token counts must agree)
and decode greedily with f16 K/V. Prints one line: identical ids, or the first divergence
with llama.cpp's gap between its two best logits there (a divergence at a near tie is
arithmetic, one at a wide gap is a bug).

Usage: greedy.py KVPLUG PLUGINS GGUF N PROMPT BACKEND MAX_FLIP_GAP
Exit status 1 if the token counts differ or the ids diverge where llama.cpp's top-2 gap
exceeds MAX_FLIP_GAP (a negative MAX_FLIP_GAP reports without failing)."""
import json
import subprocess
import sys

import llama_cpp
import numpy as np

kvplug, plugins, path, n, prompt, backend, max_gap = sys.argv[1:8]
n, max_gap = int(n), float(max_gap)

llm = llama_cpp.Llama(model_path=path, n_threads=2, n_ctx=1024, logits_all=True,
                      verbose=False)
# llama.cpp's own raw-prompt rule: BOS where the vocabulary asks for it, specials parsed.
prompt_ids = llm.tokenize(prompt.encode(), add_bos=llm._model.add_bos_token(), special=True)
llm.eval(prompt_ids)
ids, gaps = [], []
for _ in range(n):
    logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    best, second = np.argsort(logits)[::-1][:2]
    ids.append(int(best))
    gaps.append(float(logits[best] - logits[second]))
    llm.eval([int(best)])

cmd = [kvplug, "--plugins", plugins, "run", "--backend", backend, "--model", path, "--raw",
       "--prompt", prompt, "--max-new", str(n), "--ignore-eos", "--json"]
res = subprocess.run(cmd, capture_output=True, text=True)
if res.returncode != 0:
    print(f"{path}: kvplug failed: {res.stderr[-2000:]}")
    sys.exit(1)
report = json.loads(res.stdout)
ours = report["ids"]
name = f"{path.rsplit('/', 1)[-1]} on {backend}"
if report["prompt_tokens"] != len(prompt_ids):
    print(f"{name}: prompt tokens differ: llama.cpp {len(prompt_ids)}, "
          f"kvplug {report['prompt_tokens']}")
    sys.exit(1)
first = next((i for i, (a, b) in enumerate(zip(ids, ours)) if a != b), None)
if first is None:
    print(f"{name}: {len(ids)} identical ids after {len(prompt_ids)} prompt tokens "
          f"(llama.cpp's smallest top-2 gap on the way {min(gaps):.3f})")
    sys.exit(0)
print(f"{name}: ids diverge at {first} of {len(ids)}: llama.cpp {ids[first]}, kvplug "
      f"{ours[first]}; llama.cpp's top-2 gap there {gaps[first]:.4f} (median over the run "
      f"{np.median(gaps):.3f})")
sys.exit(1 if 0 <= max_gap < gaps[first] else 0)

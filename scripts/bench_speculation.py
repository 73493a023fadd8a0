"""Speculative decoding by prompt lookup against plain greedy decoding, on quoting models
(synth_gguf.py quoting): for each model file (NAME-quoting.QUANT.gguf) and each
copy-with-edits task beside it (NAME-quoting.tasks.json), `kvplug run --speculative ngram`
and plain `kvplug run` over the task's prompt ids, the two interleaved in ABBA order over
ROUNDS rounds, then a markdown table of
decode tok/s (mean of the rounds), their ratio, the share of drafted tokens accepted and
tokens per target forward. Fails when plain decoding does not give the task's answer (the
file does not quote as built) or speculation's output differs from it.

Usage: bench_speculation.py KVPLUG PLUGINS ROUNDS MODEL..."""
import json
import os
import statistics
import subprocess
import sys

kvplug, plugins, rounds, *models = sys.argv[1:]
rounds = int(rounds)


def run(model, task, speculate):
    args = [kvplug, "--plugins", plugins, "run", "--model", model, "--backend", "cpu",
            "--prompt-ids", ",".join(map(str, task["prompt"])),
            "--max-tokens", str(len(task["answer"])), "--ignore-eos", "--json"]
    if speculate:
        args += ["--speculative", "ngram"]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench-speculation: {' '.join(args[:8])} ... failed:\n{done.stderr}")
    return json.loads(done.stdout)


print("| model | insert every | plain tok/s | ngram tok/s | ngram / plain | drafts accepted "
      "| tokens per target forward |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for model in models:
    name = os.path.basename(model).removesuffix(".gguf")
    tasks = json.load(open(model.rsplit(".", 2)[0] + ".tasks.json"))
    for task in tasks:
        plain, spec = [], []
        for r in range(rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            for speculate in order + order[::-1]:
                v = run(model, task, speculate)
                if v["ids"] != task["answer"]:
                    sys.exit(f"bench-speculation: {name} does not quote (speculating: "
                             f"{speculate}): {v['ids'][:16]}... for {task['answer'][:16]}...")
                (spec if speculate else plain).append(v)
        p = statistics.mean(v["decode_tok_s"] for v in plain)
        s = statistics.mean(v["decode_tok_s"] for v in spec)
        accepted = statistics.mean(v["acceptance"] for v in spec)
        per_forward = statistics.mean(v["tokens_per_target_forward"] for v in spec)
        print(f"| {name} | {task['insert_every']} | {p:.1f} | {s:.1f} | {s / p:.2f}× "
              f"| {accepted:.0%} | {per_forward:.2f} |", flush=True)

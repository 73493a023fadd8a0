"""Speculative decoding by prompt lookup against plain greedy decoding, on quoting models
(synth_gguf.py quoting): for each model file (NAME-quoting.QUANT.gguf) and each
copy-with-edits task beside it (NAME-quoting.tasks.json), speculation by prompt lookup and
plain decoding over the task's prompt ids, the two interleaved in ABBA order over ROUNDS
rounds, then a markdown table of decode tok/s (mean of the rounds), their ratio, the share
of drafted tokens accepted and tokens per target forward.

Two ways (WAY): `run` runs `kvplug run --speculative ngram` and plain `kvplug run` (a tree
cache verifies the drafts), and fails when plain decoding does not give the task's answer
(the file does not quote as built) or speculation's output differs from it. `serve` starts
`kvplug serve` (a seq cache: drafts are verified as chains and their refused tails cut) and
sends each task to /v1/completions as token ids with `"speculative"` true or false, after
one request that puts the prompt in the prefix cache, so both sides resume it alike; the
time is the request's, the answers must agree and be the task's length (the server reports
no forward count: that column is empty).

Usage: bench_speculation.py KVPLUG PLUGINS ROUNDS WAY MODEL..."""
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

kvplug, plugins, rounds, way, *models = sys.argv[1:]
rounds = int(rounds)
if way not in ("run", "serve"):
    sys.exit(f"bench-speculation: WAY is run or serve, not {way!r}")


def run(model, task, speculate):
    """One `kvplug run`: its JSON report."""
    args = [kvplug, "--plugins", plugins, "run", "--model", model, "--backend", "cpu",
            "--prompt-ids", ",".join(map(str, task["prompt"])),
            "--max-tokens", str(len(task["answer"])), "--ignore-eos", "--json"]
    if speculate:
        args += ["--speculative", "ngram"]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench-speculation: {' '.join(args[:8])} ... failed:\n{done.stderr}")
    v = json.loads(done.stdout)
    if v["ids"] != task["answer"]:
        sys.exit(f"bench-speculation: {model} does not quote (speculating: {speculate}): "
                 f"{v['ids'][:16]}... for {task['answer'][:16]}...")
    per_forward = v["tokens_per_target_forward"] if speculate else None
    return v["decode_tok_s"], v.get("acceptance"), per_forward, None


class Server:
    """`kvplug serve` on a free loopback port, for one model."""

    def __init__(self, model):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [kvplug, "--plugins", plugins, "serve", "--model", model, "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(1200):
            if self.proc.poll() is not None:
                sys.exit(f"bench-speculation: kvplug serve failed:\n{self.proc.stderr.read()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            except OSError:
                time.sleep(0.25)
        sys.exit("bench-speculation: kvplug serve did not start in 5 minutes")

    def complete(self, task, speculate, max_tokens=None):
        body = {"prompt": task["prompt"], "max_tokens": max_tokens or len(task["answer"]),
                "temperature": 0, "ignore_eos": True, "speculative": speculate}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(req, timeout=3600) as r:
            v = json.load(r)
        return v, time.perf_counter() - start

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def served(server, task, speculate):
    """One request to `kvplug serve`."""
    v, seconds = server.complete(task, speculate)
    n = v["usage"]["completion_tokens"]
    if n != len(task["answer"]):
        sys.exit(f"bench-speculation: {n} tokens for a {len(task['answer'])}-token answer")
    d = v["usage"].get("completion_tokens_details") or {}
    drafted = d.get("accepted_prediction_tokens", 0) + d.get("rejected_prediction_tokens", 0)
    accepted = d.get("accepted_prediction_tokens", 0) / drafted if drafted else None
    return n / seconds, accepted, None, v["choices"][0]["text"]


print(f"`{way}`:\n")
print("| model | insert every | plain tok/s | ngram tok/s | ngram / plain | drafts accepted "
      "| tokens per target forward |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for model in models:
    name = os.path.basename(model).removesuffix(".gguf")
    tasks = json.load(open(model.rsplit(".", 2)[0] + ".tasks.json"))
    server = Server(model) if way == "serve" else None
    try:
        for task in tasks:
            if server:
                server.complete(task, False, max_tokens=1)
            plain, spec = [], []
            for r in range(rounds):
                order = [False, True] if r % 2 == 0 else [True, False]
                for speculate in order + order[::-1]:
                    v = served(server, task, speculate) if server else run(model, task, speculate)
                    (spec if speculate else plain).append(v)
            if server and {v[3] for v in plain + spec} != {plain[0][3]}:
                sys.exit(f"bench-speculation: {name}: speculation's answer differs from plain "
                         "decoding's")
            p = statistics.mean(v[0] for v in plain)
            s = statistics.mean(v[0] for v in spec)
            shares = [v[1] for v in spec if v[1] is not None]
            accepted = f"{statistics.mean(shares):.0%}" if shares else "no drafts"
            forwards = [v[2] for v in spec if v[2] is not None]
            per_forward = f"{statistics.mean(forwards):.2f}" if forwards else ""
            print(f"| {name} | {task['insert_every']} | {p:.1f} | {s:.1f} | {s / p:.2f}× "
                  f"| {accepted} | {per_forward} |", flush=True)
    finally:
        if server:
            server.stop()

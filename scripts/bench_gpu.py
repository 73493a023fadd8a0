"""`make bench-gpu`: kvplug's GPU backend on random-weight Q4_K_M files of the SmolLM2-135M,
Qwen2.5-0.5B and Qwen2.5-1.5B shapes (bench_shapes.py writes them here), reporting tg128,
pp512 and tg32 at depth 4096, the counters the backend keeps per decode token, and the
fraction of the device's memory bandwidth a decode token reaches.

The table also gives the backend's counters per token (dispatches, bytes read back), from
`kvplug bench --json`'s `per_token`.

`--llama-bench BIN` (a Vulkan build of llama.cpp's llama-bench, `scripts/peers-llama-cpp.sh`
with PEERS_BACKEND=vulkan) runs the same tests on the same file right after each kvplug
bench call (pp512 and tg128 together, then tg32 at depth 4096; interleaved, since the
device's clocks drift), all layers offloaded, and adds its t/s and kvplug's ratio to it.

Bandwidth: a decode token reads the weights a step touches (`kvplug plan`'s `step_bytes`)
and the K/V of every position before it; `tokens/s x bytes` over the device's bandwidth is
the fraction. The bandwidth is `--bandwidth GB/s`, else the datasheet figure of the GPU
`nvidia-smi` names (H100 SXM 3350, H200 4800), else unknown (no fraction printed).

`--tuning SPEC` (repeatable) compares kernel shapes instead (`KVPLUG_WGPU_TUNING`, e.g.
`--tuning '' --tuning wide=1 --tuning wide=1,tiles=512`; '' is the adapter's own): each test
runs under each SPEC in turn, `--rounds` rounds in alternating order, and the table gives each
SPEC's mean t/s and its ratio to the first's (OUT/ab.json).

Usage: bench_gpu.py [--kvplug BIN] [--plugins DIR] [--backend ID] [--out DIR]
       [--bandwidth GB/s] [--shapes NAME,...] [--repetitions N] [--llama-bench BIN]
       [--tuning SPEC ... [--rounds N]]
Writes OUT/results.json and prints a markdown table."""
import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_shapes  # noqa: E402

DATASHEET_GBS = {"H200": 4800, "H100 80GB HBM3": 3350, "H100 SXM": 3350, "H100 PCIe": 2000}


def gpu_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return None


def run_json(cmd, peer=False, env=None):
    """The JSON `cmd` prints (with `env` added to the environment). A failure ends the run,
    or for the peer (`peer`) is printed and gives None: its column stays empty and kvplug's
    figures are kept."""
    print("+", " ".join(f"{k}={v!r}" for k, v in (env or {}).items()), " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if out.returncode != 0:
        message = f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-4000:]}"
        if not peer:
            sys.exit(message)
        print(message, file=sys.stderr, flush=True)
        return None
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvplug", default="target/release/kvplug")
    ap.add_argument("--plugins", default="target/release")
    ap.add_argument("--backend", default="wgpu")
    ap.add_argument("--out", default="target/bench-gpu")
    ap.add_argument("--bandwidth", type=float, help="the device's memory bandwidth, GB/s")
    ap.add_argument("--shapes", default=",".join(bench_shapes.SHAPES))
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--llama-bench", help="a Vulkan llama-bench to run beside, same file")
    ap.add_argument("--tuning", action="append", metavar="SPEC",
                    help="compare these KVPLUG_WGPU_TUNING settings ('' the adapter's own)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of a --tuning comparison")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.tuning:
        compare(a)
        return
    name = gpu_name()
    bandwidth = a.bandwidth
    if bandwidth is None and name:
        bandwidth = next((v for k, v in DATASHEET_GBS.items() if k in name), None)
    host = [a.kvplug, "--plugins", a.plugins]
    rows = []
    for shape in a.shapes.split(","):
        path = os.path.join(a.out, shape + ".gguf")
        if not os.path.exists(path):
            bench_shapes.write(a.out, shape)
        plan = run_json(host + ["plan", "--model", path, "--budget", "64G", "--json"])
        kv_per_token = sum(g["bytes_per_token"] for g in plan["groups"])
        tests = []
        for flags in (["-p", "512", "-n", "128"], ["-p", "0", "-n", "32", "-d", "4096"]):
            ours = run_json(host + ["bench", "--backend", a.backend, "--model", path, *flags,
                                    "-r", str(a.repetitions), "--json"])
            if a.llama_bench:
                theirs = run_json([a.llama_bench, "-m", path, "-ngl", "99", *flags,
                                   "-r", str(a.repetitions), "-o", "json"], peer=True) or []
                for t in ours:
                    same = (t["n_prompt"], t["n_gen"], t["n_depth"])
                    peer = next((p for p in theirs
                                 if (p["n_prompt"], p["n_gen"], p.get("n_depth", 0)) == same), None)
                    if peer:
                        t["llama_cpp_ts"] = peer["avg_ts"]
                        t["llama_cpp_stddev_ts"] = peer["stddev_ts"]
            tests += ours
        for t in tests:
            t["shape"] = shape
            t["test"] = (f"pp{t['n_prompt']}" if t["n_prompt"] else f"tg{t['n_gen']}") + (
                f" @ d{t['n_depth']}" if t["n_depth"] else "")
            t["step_bytes"] = plan["step_bytes"]
            if t["n_gen"] > 0:
                # The mean context a timed decode token reads.
                context = t["n_depth"] + (t["n_gen"] + 1) / 2
                t["bytes_per_token"] = plan["step_bytes"] + kv_per_token * context
                if bandwidth:
                    t["bandwidth_fraction"] = t["avg_ts"] * t["bytes_per_token"] / (bandwidth * 1e9)
            rows.append(t)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": name,
        "bandwidth_gbs": bandwidth,
        "tests": rows,
    }
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['date']} on {name or 'an unnamed device'}"
          f" ({rows[0]['device'] if rows else '?'}), bandwidth "
          f"{f'{bandwidth:g} GB/s' if bandwidth else 'unknown'}\n")
    # The backend's counters per token (`kvplug bench --json`'s per_token), where it keeps them.
    extra = [k for k in ("dispatches", "submits", "read_back_bytes") if any(k in t.get("per_token", {}) for t in rows)]
    peer = a.llama_bench is not None
    print("| shape | test | t/s | of bandwidth |" + "".join(f" {k} per token |" for k in extra)
          + (" llama.cpp t/s | ratio |" if peer else ""))
    print("| --- | ---: | ---: | ---: |" + " ---: |" * (len(extra) + 2 * peer))
    for t in rows:
        frac = t.get("bandwidth_fraction")
        frac = f"{100 * frac:.1f}%" if frac is not None else ""
        cells = "".join(f" {t.get('per_token', {}).get(k, float('nan')):.0f} |" for k in extra)
        theirs = ""
        if peer:
            theirs = (f" {t['llama_cpp_ts']:.1f} ± {t['llama_cpp_stddev_ts']:.1f} "
                      f"| {t['avg_ts'] / t['llama_cpp_ts']:.2f}× |" if "llama_cpp_ts" in t
                      else " | |")
        print(f"| {t['shape']} | {t['test']} | {t['avg_ts']:.1f} ± {t['stddev_ts']:.1f} "
              f"| {frac} |{cells}{theirs}")


def compare(a):
    """`--tuning`: each test under each SPEC in turn, the order reversed every other round;
    each SPEC's mean t/s over the rounds and its ratio to the first SPEC's."""
    host = [a.kvplug, "--plugins", a.plugins]
    specs = a.tuning
    runs = {}  # (shape, test) -> spec -> [avg_ts per round]
    for shape in a.shapes.split(","):
        path = os.path.join(a.out, shape + ".gguf")
        if not os.path.exists(path):
            bench_shapes.write(a.out, shape)
        for flags in (["-p", "512", "-n", "128"], ["-p", "0", "-n", "32", "-d", "4096"]):
            for r in range(a.rounds):
                for spec in (specs if r % 2 == 0 else specs[::-1]):
                    env = {"KVPLUG_WGPU_TUNING": spec}
                    for t in run_json(host + ["bench", "--backend", a.backend, "--model", path,
                                              *flags, "-r", str(a.repetitions), "--json"],
                                      env=env):
                        test = (f"pp{t['n_prompt']}" if t["n_prompt"] else f"tg{t['n_gen']}") + (
                            f" @ d{t['n_depth']}" if t["n_depth"] else "")
                        runs.setdefault((shape, test), {}).setdefault(spec, []).append(t["avg_ts"])
    with open(os.path.join(a.out, "ab.json"), "w") as f:
        json.dump([{"shape": k[0], "test": k[1], "runs": v} for k, v in runs.items()], f, indent=1)
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"\n{when} on {gpu_name() or 'an unnamed device'}, {a.rounds} rounds of "
          f"{a.repetitions} runs, t/s (mean of the rounds) and ratio to {specs[0] or 'default'}\n")
    print("| shape | test |" + "".join(f" {s or 'default'} |" for s in specs))
    print("| --- | ---: |" + " ---: |" * len(specs))
    for (shape, test), by in runs.items():
        base = sum(by[specs[0]]) / len(by[specs[0]])
        cells = []
        for spec in specs:
            mean = sum(by[spec]) / len(by[spec])
            cells.append(f" {mean:.1f}" + ("" if spec == specs[0] else f" ({mean / base:.2f}×)"))
        print(f"| {shape} | {test} |" + " |".join(cells) + " |")


if __name__ == "__main__":
    main()

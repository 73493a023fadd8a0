#!/usr/bin/env bash
# make bench-peers: kvplug against llama.cpp on the same GGUF weights and threads, as ratios.
#
# llama.cpp is built from the source that the PyPI sdist of llama-cpp-python vendors
# (pinned below with its SHA-256), with cmake from Debian, in .peers/ (git-ignored). Both
# sides read one f16 GGUF: llama.cpp's llama-quantize writes it from MODEL (kvplug keeps
# imported weights in f16, so both run the same numbers). Then llama-bench and `kvplug bench`
# run the same tests (llama.cpp with flash attention on and off; the faster counts) and a
# table of their tokens per second and kvplug / llama.cpp follows
# (also in .peers/peers.md, which `make bench` puts in backends/cpu/BENCH.md). Last, each side's
# peak RSS holding RSS_CONTEXT tokens (a prefill of PP tokens after RSS_CONTEXT - PP of
# context, one run; llama.cpp with the flash-attention setting its default picks).
#
# Settings (environment): MODEL (a GGUF; default the demo model), THREADS (default: every
# core; kvplug's cpu backend uses every core), PP, TG, DEPTHS, REPS (llama-bench's -p -n -d -r),
# KV (KV dtype on both sides: f16, q8_0 or q4_0 in llama.cpp's names).
# RSS_CONTEXT (tokens held for the peak-RSS comparison, default 4096).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PEERS=.peers
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-$(nproc)}
PP=${PP:-512}
TG=${TG:-128}
DEPTHS=${DEPTHS:-0,4096}
REPS=${REPS:-3}
KV=${KV:-f16}
RSS_CONTEXT=${RSS_CONTEXT:-4096}

case "$KV" in
    f16) KVPLUG_KV=f16 ;;
    q8_0) KVPLUG_KV=q8 ;;
    q4_0) KVPLUG_KV=q4 ;;
    *) echo "bench-peers: KV must be f16, q8_0 or q4_0 (got $KV)" >&2; exit 2 ;;
esac
[ -f "$MODEL" ] || { echo "bench-peers: no model at $MODEL (make models fetches the demo model)" >&2; exit 2; }

if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
    echo "bench-peers: installing cmake and a C++ compiler (apt)"
    apt-get update -qq && apt-get install -y -qq cmake build-essential >/dev/null
fi

src="$PEERS/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
    mkdir -p "$PEERS"
    tarball="$PEERS/llama_cpp_python-$VERSION.tar.gz"
    echo "bench-peers: downloading the llama-cpp-python $VERSION sdist from PyPI"
    python3 - "$VERSION" "$tarball" <<'EOF'
import json, sys, urllib.parse, urllib.request
version, out = sys.argv[1:]
index = "https://pypi.org/pypi/llama-cpp-python/json"
files = json.load(urllib.request.urlopen(index, timeout=120))["releases"][version]
sdist = next(f for f in files if f["packagetype"] == "sdist")
urllib.request.urlretrieve(urllib.parse.urljoin(index, sdist["url"]), out)
EOF
    echo "$SHA256  $tarball" | sha256sum -c --quiet
    tar -xzf "$tarball" -C "$PEERS"
fi

build="$PEERS/build"
if [ ! -x "$build/bin/llama-bench" ] || [ ! -x "$build/bin/llama-quantize" ]; then
    echo "bench-peers: building llama-bench and llama-quantize (Release, native)"
    cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
    cmake --build "$build" -j "$(nproc)" --target llama-bench llama-quantize >/dev/null
fi

f16="$PEERS/$(basename "${MODEL%.gguf}").f16.gguf"
if [ ! -f "$f16" ]; then
    echo "bench-peers: writing $f16"
    "$build/bin/llama-quantize" --allow-requantize "$MODEL" "$f16.tmp" F16 >"$PEERS/quantize.log" 2>&1 ||
        { cat "$PEERS/quantize.log" >&2; exit 1; }
    mv "$f16.tmp" "$f16"
fi

cargo build --release --quiet
echo "bench-peers: llama.cpp ($THREADS threads, KV $KV)"
# Flash attention on and off: each test is compared with llama.cpp's faster setting.
"$build/bin/llama-bench" -m "$f16" -t "$THREADS" -p "$PP" -n "$TG" -d "$DEPTHS" -r "$REPS" \
    -ctk "$KV" -ctv "$KV" -fa on,off -o json >"$PEERS/llama.json"
echo "bench-peers: kvplug (cpu backend, KV $KVPLUG_KV)"
./target/release/kvplug --plugins target/release bench --model "$f16" --backend cpu \
    --kv-dtype "$KVPLUG_KV" -p "$PP" -n "$TG" -d "$DEPTHS" -r "$REPS" --json >"$PEERS/kvplug.json"

python3 - "$PEERS/llama.json" "$PEERS/kvplug.json" "$MODEL" "$THREADS" "$KV" <<'EOF' | tee "$PEERS/peers.md"
import json, sys
llama, kvplug = (json.load(open(p)) for p in sys.argv[1:3])
model, threads, kv = sys.argv[3:]
key = lambda r: (r["n_prompt"], r["n_gen"], r["n_depth"])
theirs = {}
for r in llama:
    if key(r) not in theirs or r["avg_ts"] > theirs[key(r)]["avg_ts"]:
        theirs[key(r)] = r
print(f"{model} as f16 on both sides, {threads} threads, KV {kv}.\n")
print("| test | llama.cpp t/s | llama.cpp -fa | kvplug t/s | kvplug / llama.cpp |")
print("| ---: | ---: | :---: | ---: | ---: |")
for r in kvplug:
    name = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
    if r["n_depth"]:
        name += f" @ d{r['n_depth']}"
    t = theirs.get(key(r))
    if t is None:
        print(f"| {name} | — | — | {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} | — |")
        continue
    ratio = r["avg_ts"] / t["avg_ts"]
    fa = "on" if t.get("flash_attn") in (1, True) else "off"
    print(f"| {name} | {t['avg_ts']:.2f} ± {t['stddev_ts']:.2f} | {fa} | "
          f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} | {ratio:.2f}x |")
EOF

# Peak resident memory of one child process, in MiB (getrusage in a fresh parent counts this
# child only).
peak_rss() {
    python3 -c 'import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.1f}")' "$@"
}
echo "bench-peers: peak RSS holding $RSS_CONTEXT tokens"
depth=$((RSS_CONTEXT - PP))
theirs=$(peak_rss "$build/bin/llama-bench" -m "$f16" -t "$THREADS" -p "$PP" -n 0 -d "$depth" \
    -r 1 -ctk "$KV" -ctv "$KV")
ours=$(peak_rss ./target/release/kvplug --plugins target/release bench --model "$f16" \
    --backend cpu --kv-dtype "$KVPLUG_KV" -p "$PP" -n 0 -d "$depth" -r 1)
python3 - "$theirs" "$ours" "$RSS_CONTEXT" "$PP" <<'EOF' | tee -a "$PEERS/peers.md"
import sys
theirs, ours = float(sys.argv[1]), float(sys.argv[2])
ctx, pp = sys.argv[3:]
print(f"\nPeak RSS holding {ctx} tokens (pp{pp} after the rest as context, one run): "
      f"llama.cpp {theirs:.1f} MiB, kvplug {ours:.1f} MiB, kvplug / llama.cpp "
      f"**{ours / theirs:.2f}x**.")
EOF

#!/usr/bin/env bash
# make bench-peers: kvplug against llama.cpp on the same GGUF weights and threads, as ratios.
#
# llama.cpp is built from the source that the PyPI sdist of llama-cpp-python vendors, in
# .peers/ (git-ignored), as scripts/peers-llama-cpp.sh says (GGML_NATIVE off, the CPU's x86
# features named one by one, AMX off). Both sides read MODEL itself, weights in their stored (quantized) types; with
# F16=1 both read an f16 copy that llama-quantize writes instead. Then llama-bench and
# `kvplug bench`
# run the same tests (llama.cpp with flash attention on and off; the faster counts), one test
# at a time with the two sides interleaved in ABBA order over ROUNDS rounds (a shared
# machine's bandwidth drifts over minutes: one side running all its tests first would be
# measured on a different machine than the other), and a table of their tokens per second
# (mean ± standard deviation of every sample) and kvplug / llama.cpp follows
# (also in .peers/peers.md, or peers-avx2.md / peers-avx2vnni.md, which `make bench` puts in
# backends/cpu/BENCH.md). Last, each side's
# peak RSS holding RSS_CONTEXT tokens (a prefill of PP tokens, 512 where PP=0, after the rest
# as context, one run; llama.cpp with the flash-attention setting its default picks; both at the
# first MMAP setting).
#
# Settings (environment): MODEL (a GGUF; default the demo model), SHAPE (instead of MODEL: a
# shape scripts/bench_shapes.py writes, e.g. qwen2.5-1.5b-shaped, its random-weight Q4_K_M
# file kept in .peers/shapes), F16 (1: both sides read an f16 copy of MODEL), THREADS (default: every
# core; kvplug's cpu backend uses every core), PP, TG, DEPTHS, REPS (llama-bench's -p -n -d -r,
# REPS per run), ROUNDS (default 2: llama.cpp, kvplug, kvplug, llama.cpp for each test),
# KV (KV dtype on both sides: f16, q8_0 or q4_0 in llama.cpp's names), MMAP (comma list: 1
# maps the weights on both sides, the default of both; 0 reads them into memory, llama-bench
# -lm none and kvplug --no-mmap; each test runs at each setting in turn, rows marked no-mmap).
# RSS_CONTEXT (tokens held for the peak-RSS comparison, default 4096). PEERS_TABLE (where the
# table goes, default .peers/peers.md). ISA (native, the
# default: every x86 feature this CPU has; avx2: llama.cpp built without AVX-512 and AVX-VNNI,
# kvplug under KVPLUG_CPU_ISA=avx2, as on an AVX2-only CPU; the table goes to
# .peers/peers-avx2.md; avx2vnni: llama.cpp built without AVX-512 but with AVX-VNNI, kvplug
# under KVPLUG_CPU_ISA=avx2vnni, as on an Intel client core; .peers/peers-avx2vnni.md).
set -euo pipefail
PEERS_WHO=bench-peers
cd "$(dirname "$0")/.."

MODEL=${MODEL:-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
PEERS_TABLE=${PEERS_TABLE:-.peers/peers.md}
F16=${F16:-0}
THREADS=${THREADS:-$(nproc)}
PP=${PP:-512}
TG=${TG:-128}
DEPTHS=${DEPTHS:-0,4096}
REPS=${REPS:-2}
ROUNDS=${ROUNDS:-2}
KV=${KV:-f16}
MMAP=${MMAP:-1}
RSS_CONTEXT=${RSS_CONTEXT:-4096}
ISA=${ISA:-native}
case "$ISA" in
    native) table="$PEERS_TABLE" ;;
    avx2) table="${PEERS_TABLE%.md}-avx2.md"; export KVPLUG_CPU_ISA=avx2 ;;
    avx2vnni) table="${PEERS_TABLE%.md}-avx2vnni.md"; export KVPLUG_CPU_ISA=avx2vnni ;;
    *) echo "bench-peers: ISA must be native, avx2 or avx2vnni (got $ISA)" >&2; exit 2 ;;
esac
export PEERS_ISA=$ISA

case "$KV" in
    f16) KVPLUG_KV=f16 ;;
    q8_0) KVPLUG_KV=q8 ;;
    q4_0) KVPLUG_KV=q4 ;;
    *) echo "bench-peers: KV must be f16, q8_0 or q4_0 (got $KV)" >&2; exit 2 ;;
esac
[[ "$MMAP" =~ ^[01](,[01])*$ ]] || { echo "bench-peers: MMAP must list 1 and/or 0 (got $MMAP)" >&2; exit 2; }
# The peak-RSS run prefills PP tokens (512 where PP=0) on top of the rest of RSS_CONTEXT.
[[ "$PP" =~ ^[0-9]+$ && "$RSS_CONTEXT" =~ ^[0-9]+$ ]] && ((RSS_CONTEXT >= (PP > 0 ? PP : 512))) || {
    echo "bench-peers: RSS_CONTEXT ($RSS_CONTEXT) must be a token count of at least the prefill" \
        "(PP, or 512 where PP=0; got PP=$PP)" >&2
    exit 2
}
SHAPE=${SHAPE:-}
[ -n "$SHAPE" ] || [ -f "$MODEL" ] ||
    { echo "bench-peers: no model at $MODEL (make models fetches the demo model)" >&2; exit 2; }

# llama.cpp from the pinned sdist, built in $PEERS/build ($build).
source scripts/peers-llama-cpp.sh

if [ -n "$SHAPE" ]; then
    MODEL="$PEERS/shapes/$SHAPE.gguf"
    if [ ! -f "$MODEL" ]; then
        # Written aside and moved into place: an interrupted write leaves no file to reuse.
        peers_python
        echo "bench-peers: writing $MODEL"
        rm -rf "$PEERS/shapes/.partial" && mkdir -p "$PEERS/shapes/.partial"
        "$venv/bin/python" scripts/bench_shapes.py "$PEERS/shapes/.partial" "$SHAPE" >/dev/null
        mv "$PEERS/shapes/.partial/$SHAPE.gguf" "$MODEL"
        rmdir "$PEERS/shapes/.partial"
    fi
fi

# The file both sides read.
weights="$MODEL"
if [ "$F16" = 1 ]; then
    weights="$PEERS/$(basename "${MODEL%.gguf}").f16.gguf"
    if [ ! -f "$weights" ]; then
        echo "bench-peers: writing $weights"
        "$build/bin/llama-quantize" --allow-requantize "$MODEL" "$weights.tmp" F16 \
            >"$PEERS/quantize.log" 2>&1 || { cat "$PEERS/quantize.log" >&2; exit 1; }
        mv "$weights.tmp" "$weights"
    fi
fi

cargo build --release --quiet
# Each side at mmap setting $1 (1 mapped, 0 read into memory), then llama-bench's test flags.
llama() {
    local mmap=$1
    shift
    [ "$mmap" = 0 ] && set -- -lm none "$@"
    "$build/bin/llama-bench" -m "$weights" -t "$THREADS" -r "$REPS" -ctk "$KV" -ctv "$KV" \
        -fa on,off -o json "$@"
}
kvplug() {
    local mmap=$1
    shift
    [ "$mmap" = 0 ] && set -- --no-mmap "$@"
    ./target/release/kvplug --plugins target/release bench --model "$weights" --backend cpu \
        --kv-dtype "$KVPLUG_KV" -r "$REPS" --json "$@"
}
runs="$PEERS/runs"
rm -rf "$runs" && mkdir -p "$runs"
echo "bench-peers: llama.cpp ($THREADS threads, KV $KV, flash attention on and off) and kvplug" \
    "(cpu backend, KV $KVPLUG_KV), mmap $MMAP: $ROUNDS rounds of $REPS runs, interleaved per test"
# A test of no tokens (PP=0 or TG=0) is left out.
tests=()
[ "$PP" -gt 0 ] && tests+=("-p $PP -n 0")
[ "$TG" -gt 0 ] && tests+=("-p 0 -n $TG")
for depth in ${DEPTHS//,/ }; do
    for test in "${tests[@]}"; do
        for ((round = 0; round < ROUNDS; round++)); do
            for mmap in ${MMAP//,/ }; do
                # ABBA: even rounds llama.cpp first, odd rounds kvplug first.
                order="llama kvplug"
                [ $((round % 2)) -eq 1 ] && order="kvplug llama"
                for side in $order; do
                    # shellcheck disable=SC2086
                    $side "$mmap" $test -d "$depth" \
                        >"$runs/$side-d$depth${test// /}-mmap$mmap-$round.json"
                done
            done
        done
    done
done

python3 - "$runs" "$weights" "$THREADS" "$KV" "$VERSION" "${features[*]}" "$ISA" <<'EOF' | tee "$table"
import glob, json, os, statistics, sys
runs, model, threads, kv, version, features, isa = sys.argv[1:]
# Weights mapped: kvplug's use_mmap, llama-bench's load_mode other than none.
key = lambda r: (r["n_prompt"], r["n_gen"], r["n_depth"],
                 r.get("use_mmap", True) and r.get("load_mode") != "none")
# Every sample of each side per test; llama.cpp's per flash-attention setting.
ours, theirs = {}, {}
for path in sorted(glob.glob(os.path.join(runs, "*.json"))):
    side = os.path.basename(path).split("-")[0]
    for r in json.load(open(path)):
        if side == "kvplug":
            ours.setdefault(key(r), []).extend(r["samples_ts"])
        else:
            fa = "on" if r.get("flash_attn") in (1, True) else "off"
            theirs.setdefault(key(r), {}).setdefault(fa, []).extend(r["samples_ts"])
def stats(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)
print(f"{model} on both sides, {threads} threads, KV {kv}; mean ± standard deviation "
      "of every sample of each side's runs, interleaved test by test.\n")
print(f"llama.cpp: the source llama-cpp-python {version} vendors, built Release with "
      f"GGML_NATIVE=OFF and this CPU's features named one by one ({features}): AMX is off "
      "because these sandboxes refuse AMX tile state (a native build dies with SIGILL on "
      "Q4_K).\n")
if isa == "avx2":
    print("Both sides at the AVX2 level, as on a CPU without AVX-512: llama.cpp built with "
          "the AVX-512 and AVX-VNNI options off (above), kvplug under KVPLUG_CPU_ISA=avx2.\n")
if isa == "avx2vnni":
    print("Both sides at the 256-bit VNNI level, as on an Intel client core (AVX-VNNI, no "
          "AVX-512): llama.cpp built with the AVX-512 options off and AVX-VNNI on (above), "
          "kvplug under KVPLUG_CPU_ISA=avx2vnni.\n")
print("| test | llama.cpp t/s | llama.cpp -fa | kvplug t/s | kvplug / llama.cpp |")
print("| ---: | ---: | :---: | ---: | ---: |")
for k in sorted(ours, key=lambda k: (k[2], k[1], k[0], not k[3])):
    name = f"pp{k[0]}" if k[0] else f"tg{k[1]}"
    if k[2]:
        name += f" @ d{k[2]}"
    if not k[3]:
        name += " (no-mmap)"
    m, sd = stats(ours[k])
    by_fa = theirs.get(k)
    if not by_fa:
        print(f"| {name} | — | — | {m:.2f} ± {sd:.2f} | — |")
        continue
    fa, xs = max(by_fa.items(), key=lambda f: statistics.mean(f[1]))
    tm, tsd = stats(xs)
    print(f"| {name} | {tm:.2f} ± {tsd:.2f} | {fa} | {m:.2f} ± {sd:.2f} | {m / tm:.2f}x |")
EOF

# Peak resident memory of one child process, in MiB (getrusage in a fresh parent counts this
# child only).
peak_rss() {
    python3 -c 'import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.1f}")' "$@"
}
echo "bench-peers: peak RSS holding $RSS_CONTEXT tokens"
# Measured on a prefill: PP tokens, or 512 where PP=0.
rss_pp=$((PP > 0 ? PP : 512))
depth=$((RSS_CONTEXT - rss_pp))
mmap=${MMAP%%,*}
no_mmap=()
[ "$mmap" = 0 ] && no_mmap=(--no-mmap)
no_mmap_llama=()
[ "$mmap" = 0 ] && no_mmap_llama=(-lm none)
theirs=$(peak_rss "$build/bin/llama-bench" -m "$weights" -t "$THREADS" -p "$rss_pp" -n 0 -d "$depth" \
    -r 1 -ctk "$KV" -ctv "$KV" "${no_mmap_llama[@]}")
ours=$(peak_rss ./target/release/kvplug --plugins target/release bench --model "$weights" \
    --backend cpu --kv-dtype "$KVPLUG_KV" -p "$rss_pp" -n 0 -d "$depth" -r 1 "${no_mmap[@]}")
python3 - "$theirs" "$ours" "$RSS_CONTEXT" "$rss_pp" "$mmap" <<'EOF' | tee -a "$table"
import sys
theirs, ours = float(sys.argv[1]), float(sys.argv[2])
ctx, pp, mmap = sys.argv[3:]
held = "mapped" if mmap == "1" else "read into memory"
print(f"\nPeak RSS holding {ctx} tokens (pp{pp} after the rest as context, one run, weights {held}): "
      f"llama.cpp {theirs:.1f} MiB, kvplug {ours:.1f} MiB, kvplug / llama.cpp "
      f"**{ours / theirs:.2f}x**.")
EOF

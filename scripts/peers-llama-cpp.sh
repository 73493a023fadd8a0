# Sourced by the peer scripts (bench-peers.sh, bench-hybrid.sh, bench-speculation.sh,
# crosscheck-peers.sh, kv-agreement-peers.sh) from the repository root:
# llama.cpp from the source that the PyPI sdist of llama-cpp-python vendors (pinned below with
# its SHA-256), unpacked and built Release in $PEERS (git-ignored) with cmake from Debian,
# GGML_NATIVE off and the x86 features /proc/cpuinfo lists turned on one by one, AMX off:
# Sapphire Rapids sandboxes refuse AMX tile state, and a native build dies with SIGILL on
# Q4_K there. Sets PEERS, VERSION, src (the llama.cpp source), features (the cmake feature
# options) and build (its build directory: bin/llama-bench, bin/llama-quantize,
# bin/libllama.so). `peers_python` then makes the Python side for scripts that drive that
# libllama in process through the sdist's ctypes bindings, and `synth_quantized` writes a
# random-weight file of synth_gguf.py quantized. PEERS_ISA=avx2 builds it without
# any AVX-512 or AVX-VNNI instruction instead (in $PEERS/build-avx2): the peer of kvplug
# under KVPLUG_CPU_ISA=avx2, as an AVX2-only CPU (Zen 2/3, Intel client cores) runs both;
# PEERS_ISA=avx2vnni without AVX-512 but with AVX-VNNI (in $PEERS/build-avx2vnni): the peer
# of KVPLUG_CPU_ISA=avx2vnni, as an Intel client core since Alder Lake runs both.
# PEERS_BACKEND=vulkan builds llama-bench alone with the Vulkan backend, statically linked (one
# file to carry to a GPU machine), in $PEERS/build-vulkan: the peer of `make bench-gpu`.
# This llama.cpp needs Vulkan headers newer than Debian 12's (1.3.239 lacks VK_EXT_layer_settings):
# Debian 13's libvulkan-dev and spirv-headers are downloaded (scripts/apt-unpack.sh, no install)
# and unpacked into $PEERS/vulkan-headers, headers only (the binary links Debian 12's
# loader). Debian 12's glslc (2023.2) lacks the cooperative-matrix and integer-dot-product
# extensions, so that build's shaders use neither (its configure log says so); a newer
# Vulkan SDK has them.

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PEERS=.peers
PEERS_WHO=${PEERS_WHO:-peers}

if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
    echo "$PEERS_WHO: installing cmake and a C++ compiler (apt)"
    apt-get update -qq && apt-get install -y -qq cmake build-essential >/dev/null
fi

src="$PEERS/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
    mkdir -p "$PEERS"
    tarball="$PEERS/llama_cpp_python-$VERSION.tar.gz"
    echo "$PEERS_WHO: downloading the llama-cpp-python $VERSION sdist from PyPI"
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
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
case "${PEERS_ISA:-native}" in
    native) ;;
    avx2)
        [[ " $flags " == *" avx2 "* ]] || { echo "$PEERS_WHO: PEERS_ISA=avx2 on a CPU without AVX2" >&2; exit 2; }
        build="$PEERS/build-avx2"
        flags=$(tr ' ' '\n' <<<"$flags" | grep -v -e '^avx512' -e '^avx_vnni$' | tr '\n' ' ')
        ;;
    avx2vnni)
        [[ " $flags " == *" avx_vnni "* ]] ||
            { echo "$PEERS_WHO: PEERS_ISA=avx2vnni on a CPU without AVX-VNNI" >&2; exit 2; }
        build="$PEERS/build-avx2vnni"
        flags=$(tr ' ' '\n' <<<"$flags" | grep -v -e '^avx512' | tr '\n' ' ')
        ;;
    *) echo "$PEERS_WHO: PEERS_ISA must be native, avx2 or avx2vnni (got $PEERS_ISA)" >&2; exit 2 ;;
esac
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
features=(-DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)"
    -DGGML_F16C="$(has f16c)" -DGGML_AVX512="$(has avx512f)"
    -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)"
    -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AVX_VNNI="$(has avx_vnni)"
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
if [ "${PEERS_BACKEND:-cpu}" = vulkan ]; then
    build="$PEERS/build-vulkan"
    if [ ! -x "$build/bin/llama-bench" ]; then
        if ! command -v glslc >/dev/null || [ ! -e /usr/lib/x86_64-linux-gnu/libvulkan.so ]; then
            echo "$PEERS_WHO: installing the Vulkan loader's development files and glslc (apt)"
            apt-get update -qq && apt-get install -y -qq libvulkan-dev glslc >/dev/null
        fi
        headers="$PWD/$PEERS/vulkan-headers"
        if [ ! -f "$headers/usr/include/vulkan/vulkan.hpp" ]; then
            echo "$PEERS_WHO: Vulkan and SPIR-V headers from Debian 13 (apt-get download)"
            ./scripts/apt-unpack.sh trixie "$PWD/$PEERS/apt-trixie" "$headers" \
                libvulkan-dev spirv-headers >/dev/null
        fi
        echo "$PEERS_WHO: building llama-bench with the Vulkan backend (Release, static)"
        cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
            -DVulkan_INCLUDE_DIR="$headers/usr/include" -DCMAKE_PREFIX_PATH="$headers/usr" \
            -DGGML_VULKAN=ON -DBUILD_SHARED_LIBS=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
            -DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
            -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_SERVER=OFF >/dev/null
        cmake --build "$build" -j "$(nproc)" --target llama-bench >/dev/null
    fi
elif [ ! -x "$build/bin/llama-bench" ] || [ ! -x "$build/bin/llama-quantize" ]; then
    echo "$PEERS_WHO: building llama-bench and llama-quantize (Release, ${features[*]})"
    cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF "${features[@]}" \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF >/dev/null
    cmake --build "$build" -j "$(nproc)" --target llama-bench llama-quantize >/dev/null
fi

# A Python venv in $PEERS/venv with numpy and the bindings' imports (PyPI), the sdist's
# `llama_cpp` package and llama.cpp's own gguf-py on PYTHONPATH, and LLAMA_CPP_LIB_PATH at
# the libllama built above. Sets venv.
peers_python() {
    venv="$PEERS/venv"
    if ! "$venv/bin/python" -c 'import numpy, yaml, diskcache, jinja2, typing_extensions' 2>/dev/null; then
        echo "$PEERS_WHO: a Python venv with numpy and the bindings' imports in $venv"
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q numpy pyyaml diskcache jinja2 typing_extensions
    fi
    local sdist="$PEERS/llama_cpp_python-$VERSION"
    export PYTHONPATH="$sdist:$sdist/vendor/llama.cpp/gguf-py"
    export LLAMA_CPP_LIB_PATH="$build/bin"
}

# `synth_quantized DIR NAME QUANT MODE`: DIR/STEM.QUANT.gguf, where STEM is NAME (MODE bench)
# or NAME-quoting (MODE quoting), written by synth_gguf.py MODE NAME with MODEL's vocabulary
# and made QUANT by the llama-quantize above; remade when MODEL, QUANT or the generator
# change or the file is missing. Needs peers_python's venv.
synth_quantized() {
    local dir=$1 name=$2 q=$3 mode=$4 stem=$2
    [ "$mode" = quoting ] && stem="$name-quoting"
    local made_from
    made_from="$MODEL $q $(sha256sum scripts/crosscheck/synth_gguf.py | cut -d' ' -f1)"
    [ "$(cat "$dir/$stem.made-from" 2>/dev/null)" = "$made_from" ] && [ -f "$dir/$stem.$q.gguf" ] &&
        return
    rm -f "$dir/$stem".*
    echo "$PEERS_WHO: writing $stem ($q) in $dir"
    "$venv/bin/python" scripts/crosscheck/synth_gguf.py "$MODEL" "$dir" "$mode" "$name" >/dev/null
    "$build/bin/llama-quantize" "$dir/$stem.f32.gguf" "$dir/$stem.tmp" "$q" \
        >"$dir/quantize.log" 2>&1 || { cat "$dir/quantize.log" >&2; exit 1; }
    mv "$dir/$stem.tmp" "$dir/$stem.$q.gguf"
    rm "$dir/$stem.f32.gguf"
    echo "$made_from" >"$dir/$stem.made-from"
}

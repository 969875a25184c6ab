#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from source, once, for the serving benchmark's anchor
# (bench/serving.py --anchor llama-server).
#
# Source: the llama.cpp tree vendored inside the pinned llama-cpp-python sdist (the same
# llama.cpp that bench/engine_llamacpp.py measures through the Python binding), so the
# anchor's kernels are the ones the engine benchmarks compare against. Debian 12 has no
# llama.cpp package.
#
# Flags (those of the llama-cpp-python build the engine benchmarks use, docs/BENCHMARKS.md):
#   -DGGML_NATIVE=OFF with AVX, AVX2, FMA, F16C, BMI2, AVX512 (F, VBMI, VNNI, BF16) on and
#   AMX (TILE, INT8, BF16) off. A `-march=native` build (GGML_NATIVE=ON) compiles ggml's AMX
#   path on the Intel Xeons here, which crashes with SIGILL at the first decode on these
#   VMs. On a CPU without AVX-512 (or to build for the machine as is) set
#   LLAMA_SERVER_NATIVE=1: then -DGGML_NATIVE=ON, with AMX still off (-mno-amx-*). Put
#   it in its own LLAMA_SERVER_DIR to keep both builds (bench/first_start.py --anchor-bin).
#   Release build, static libraries (one self-contained binary), no libcurl, no tests or
#   examples; only the `llama-server` target is built (about 8-10 min on 2 vCPUs).
#
# Output: $LLAMA_SERVER_DIR/bin/llama-server (default: <repo>/.llama-server, git-ignored),
# plus build-flags.txt next to it. A second run finds the binary and exits at once.
#
# Usage: bash bench/build_llama_server.sh        (prints the binary's path on its last line)
#        LLAMA_SERVER_DIR=/some/dir JOBS=2 bash bench/build_llama_server.sh
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.16}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${LLAMA_SERVER_DIR:-$REPO/.llama-server}"
JOBS="${JOBS:-2}"
PY="${PYTHON:-python3}"
BIN="$DIR/bin/llama-server"

if [[ -x "$BIN" ]]; then
    echo "llama-server already built: $BIN" >&2
    echo "$BIN"
    exit 0
fi

mkdir -p "$DIR/src" "$DIR/bin"
SDIST="$DIR/src/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$DIR/src" >&2
fi
TREE="$DIR/src/llama_cpp_python-$VERSION"
[[ -d "$TREE" ]] || tar xzf "$SDIST" -C "$DIR/src"
LLAMA="$TREE/vendor/llama.cpp"

if ! command -v cmake >/dev/null; then
    echo "cmake not found: apt-get update && apt-get install -y cmake" >&2
    exit 1
fi

if [[ "${LLAMA_SERVER_NATIVE:-0}" == "1" ]]; then
    # -march=native, minus the AMX instructions (see above): the compiler must not emit
    # them and ggml must not compile its AMX path, which keys on __AMX_INT8__.
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    ISA=(-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX")
else
    ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
         -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
         -DGGML_AVX512_BF16=ON)
fi
FLAGS=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON "${ISA[@]}"
       -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
       -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
       -DLLAMA_BUILD_EXAMPLES=OFF)

cmake -S "$LLAMA" -B "$LLAMA/build" "${FLAGS[@]}" >&2
cmake --build "$LLAMA/build" --target llama-server -j "$JOBS" >&2
cp "$LLAMA/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
{
    echo "llama-cpp-python sdist $VERSION (vendor/llama.cpp)"
    echo "cmake ${FLAGS[*]}"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(lscpu | sed -n 's/^Model name: *//p')"
} >"$DIR/bin/build-flags.txt"
echo "$BIN"

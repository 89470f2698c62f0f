#!/usr/bin/env bash
# Builds the llama.cpp peer (CPU, Release) from the llama-cpp-python 0.3.36 source package on PyPI, whose
# vendored llama.cpp has DeepSeek-V4 (src/models/deepseek4.cpp). Only the package index is needed.
#   bash benchmarks/peers/setup_llama_cpp.sh [DIR]      (default: benchmarks/peers/build/llama.cpp, git-ignored)
# Leaves DIR/bin/llama-server and DIR/bin/llama-tokenize, the vendored tree in DIR/src (its gguf-py is what
# llama_cpp_convert.py writes GGUF files with) and a venv DIR/venv for the converter (numpy, safetensors,
# the vendored gguf-py). Compiles under `nice -n 15` (set NICE=0 to not), JOBS in parallel (default nproc).
# `pip download --no-binary llama-cpp-python`, not `:all:`: the latter also builds pip's build-time
# dependencies (scikit-build-core, cmake, ...) from source just to read the package's metadata.
# The server's web UI is neither built nor downloaded (LLAMA_USE_PREBUILT_UI=OFF fetches nothing from the
# hub); the API endpoints do not need it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIR="${1:-$ROOT/benchmarks/peers/build/llama.cpp}"
PYTHON="${PYTHON:-python3}"
VERSION=0.3.36
JOBS="${JOBS:-$(nproc)}"
NICE="${NICE:-15}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"

if [ ! -f "$DIR/src/src/models/deepseek4.cpp" ]; then
    mkdir -p "$DIR/sdist"
    "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$DIR/sdist"
    rm -rf "$DIR/unpack" "$DIR/src"
    mkdir -p "$DIR/unpack"
    tar -xzf "$DIR/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$DIR/unpack"
    mv "$DIR/unpack/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR/src"
    rm -rf "$DIR/unpack"
fi

# llama-server links libmtmd (images/audio, 51 of the ~190 files compiled) but never runs it for a text
# model: it compiles at -O0 to save time on a shared 2-core machine. Everything else keeps -O3.
if ! grep -q "hybridserve: -O0" "$DIR/src/tools/mtmd/CMakeLists.txt"; then
    printf '\n# hybridserve: -O0 (never run for text models)\ntarget_compile_options(mtmd PRIVATE -O0)\n' \
        >> "$DIR/src/tools/mtmd/CMakeLists.txt"
fi

nice -n "$NICE" cmake -S "$DIR/src" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_LLGUIDANCE=OFF
nice -n "$NICE" cmake --build "$DIR/build" -j "$JOBS" --target llama-server llama-tokenize
mkdir -p "$DIR/bin"
cp --remove-destination "$DIR/build/bin/llama-server" "$DIR/build/bin/llama-tokenize" "$DIR/bin/"

if [ ! -x "$DIR/venv/bin/python" ]; then
    "$PYTHON" -m venv "$DIR/venv"
fi
"$DIR/venv/bin/pip" install -q numpy safetensors tokenizers "$DIR/src/gguf-py"
"$DIR/venv/bin/python" -c "import gguf; print('gguf', gguf.__file__)"
"$DIR/bin/llama-server" --version 2>&1 | tail -2
echo "llama.cpp ready: $DIR/bin"
echo "convert: $DIR/venv/bin/python $ROOT/benchmarks/peers/llama_cpp_convert.py SRC_CHECKPOINT SRC_CHECKPOINT.gguf"
echo "launch:  bash $ROOT/benchmarks/peers/llama_cpp_server.sh SRC_CHECKPOINT.gguf 8103"

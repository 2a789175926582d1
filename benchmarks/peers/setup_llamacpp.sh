#!/usr/bin/env bash
# Build llama.cpp's llama-server from the llama-cpp-python sdist (its vendored
# llama.cpp) into .bench/llamacpp/bin. The wheel ships no server binary, so we
# build the `llama-server` CMake target directly: native CPU flags, no web UI,
# no network features. Compiles for several minutes: run at low priority.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
SRC="$ROOT/.bench/llamacpp-src"
OUT="$ROOT/.bench/llamacpp"
mkdir -p "$SRC" "$OUT/bin"
TARBALL="$SRC/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$TARBALL" ]; then
  "$ROOT/.venv/bin/pip" download --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$SRC"
fi
[ -d "$SRC/llama_cpp_python-$VERSION" ] || tar -C "$SRC" -xzf "$TARBALL"
LLAMA="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"
nice -n 19 cmake -S "$LLAMA" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DBUILD_SHARED_LIBS=OFF
nice -n 19 cmake --build "$SRC/build" --target llama-server -j 2
cp "$SRC/build/bin/llama-server" "$OUT/bin/llama-server"
"$OUT/bin/llama-server" --version || true

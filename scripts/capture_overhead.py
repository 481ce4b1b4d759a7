"""Plain-decoding speed without hidden-state capture, with the Python eval callback and with
the compiled C callback, measured in one run (interleaved rounds, medians).

    python scripts/capture_overhead.py [--model M] [--tokens 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from srsd_local.config import SRSDConfig
from srsd_local.llama.backend import Backend
from srsd_local.llama.models import resolve_model


def decode_rate(be: Backend, prompt: list[int], n: int) -> float:
    be.clear()
    x = int(np.argmax(be.decode(prompt).logits[-1]))
    t0 = time.perf_counter()
    for _ in range(n):
        x = int(np.argmax(be.decode([x]).logits[-1]))
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    args = ap.parse_args()
    path = resolve_model(args.model)
    cfg = SRSDConfig(n_ctx=2048, n_gpu_layers=args.n_gpu_layers)
    variants = {}
    variants["no capture"] = Backend(path, cfg, capture_layer=None)
    os.environ["SRSD_CAPTURE"] = "python"
    variants["python callback"] = Backend(path, cfg, capture_layer=4)
    os.environ["SRSD_CAPTURE"] = "c"
    variants["C callback"] = Backend(path, cfg, capture_layer=4)
    assert variants["C callback"].capture.kind == "c", "no C compiler: C callback unavailable"
    prompt = variants["no capture"].tokenize("def fib(n):\n    if n < 2:\n        return n\n")
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, be in variants.items():
            rates[name].append(decode_rate(be, prompt, args.tokens))
    base = statistics.median(rates["no capture"])
    print("| capture | tokens/s (median) | vs no capture |\n|---|---|---|")
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"| {name} | {med:.1f} | {med / base:.3f}x |")


if __name__ == "__main__":
    main()

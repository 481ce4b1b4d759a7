"""Logits -> next token, and the lossless tree walk (DESIGN section 2). Pure numpy.

One `Sampler` serves plain decoding and tree verification alike, so a speculative run draws
exactly what a plain run would draw: each emitted token consumes one sample from the same
seeded generator, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .config import SamplingParams
from .tree import TokenTree

_HEAD = 512  # candidates sorted first when looking for the top-p nucleus


def distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The processed distribution: (token ids, probabilities), most probable first.

    Order of processing: top-k, temperature softmax, min-p, top-p (as llama.cpp's chain).
    Ties are broken by token id so the result is deterministic.
    """
    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    n_vocab = x.shape[0]
    if 0 < params.top_k < n_vocab:
        ids = np.argpartition(x, n_vocab - params.top_k)[n_vocab - params.top_k:]
    else:
        ids = np.arange(n_vocab)
    z = x[ids].astype(np.float64) / max(params.temperature, 1e-6)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if params.min_p > 0.0:
        keep = p >= params.min_p * p.max()
        ids, p = ids[keep], p[keep]
    if params.top_p < 1.0:
        head = np.arange(len(p))
        if len(p) > _HEAD:
            head = np.argpartition(-p, _HEAD)[:_HEAD]
            if p[head].sum() < params.top_p:  # nucleus is wider than the head: sort all
                head = np.arange(len(p))
        head = head[np.lexsort((ids[head], -p[head]))]
        n_keep = int(np.searchsorted(np.cumsum(p[head]), params.top_p)) + 1
        head = head[:n_keep]
        ids, p = ids[head], p[head]
    else:
        order = np.lexsort((ids, -p))
        ids, p = ids[order], p[order]
    return ids, p / p.sum()


class Sampler:
    """Greedy (temperature 0) or seeded random sampling from one logits row."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        ids, p = distribution(logits, self.params)
        u = self.rng.random()
        i = int(np.searchsorted(np.cumsum(p), u, side="right"))
        return int(ids[min(i, len(ids) - 1)])


def walk_tree(tree: TokenTree, row: Callable[[int], np.ndarray], sample: Sampler
              ) -> tuple[list[int], int]:
    """Verify a token tree: returns (accepted node indices from the root, next token).

    `row(node)` gives the model's logits after that node. At each node the model's token is
    drawn with `sample`; if a child carries it the walk descends, else that token is the
    next token and the walk ends. The root is always accepted.
    """
    node, path = 0, [0]
    while True:
        y = sample(row(node))
        child = tree.child(node, y)
        if child is None:
            return path, y
        path.append(child)
        node = child

"""The lossless tree walk: accept the longest path the model agrees with. Pure numpy.

Greedy: at each node the model's argmax decides; sampling: one draw from the model's
processed distribution per node, with the same sampler plain decoding uses, so the output
distribution is exactly the model's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .sampling import Sampler
from .tree import TokenTree


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

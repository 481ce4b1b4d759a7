"""Copy runs: where the output is copying a stretch of its context, keep copying it.

When the model accepted every drafted node down to a leaf, the draft ran out before the
model diverged from it: the output is most likely still copying what the draft was drawn
from. The next draft is then the context's continuation of that copy, found once by an
exact match of the last tokens and then followed position by position (O(1) per step), as
one chain longer than a merged tree's depth. No drafter runs, so such a step costs a
fraction of a merged draft's host time; the controller still decides how much of the chain
to verify, and a divergence (an edit) ends the run: the merged drafters, hidden-state
retrieval first, re-anchor the next draft. Pure numpy.
"""

from __future__ import annotations

import sys

import numpy as np

MATCH = 8  # context tokens before the root that must equal those before the copy's source


def find_copy(tokens: np.ndarray, root: int, match: int = MATCH) -> int | None:
    """The most recent position c < n - 1 of the context (n tokens) that holds `root` and
    follows the same `match` tokens as the context's end, or None. (c + 1 < n: the copy has
    at least one token to draft.) A search of the context's bytes for those tokens and the
    root (numpy's comparisons and reductions cost ~0.1 ms on the caches a forward pass has
    just flushed; a bytes search a few microseconds)."""
    n = int(tokens.shape[0])
    m = min(match, n - 2)
    if m < 1:
        return None
    ctx = tokens if tokens.dtype == np.int32 else tokens.astype(np.int32)
    hay = ctx[: n - 1].tobytes()  # candidates c <= n - 2
    needle = ctx[n - m:].tobytes() + int(root).to_bytes(4, sys.byteorder, signed=True)
    end = len(hay)
    while True:
        at = hay.rfind(needle, 0, end)
        if at < 0:
            return None
        if at % 4 == 0:  # (a match across token boundaries is not one)
            return at // 4 + m
        end = at + len(needle) - 1


def continues(tokens: np.ndarray, root: int, at: int) -> bool:
    """Whether the copy that expects `root` at context position `at` goes on."""
    return 0 <= at < int(tokens.shape[0]) - 1 and int(tokens[at]) == int(root)


def chain(tokens: np.ndarray, root: int, at: int, length: int) -> list[int]:
    """The copy's next `length` tokens after the root (context position n = len(tokens)),
    copied from position at + 1 on. A source that reaches the context's end goes on with
    what is being copied (the root, then the chain itself): a copy from p tokens back
    repeats with period p."""
    n = int(tokens.shape[0])
    out = tokens[at + 1: at + 1 + length].tolist()
    if len(out) < length:
        period = n - at  # the chain drafts position n + 1 + k from position at + 1 + k
        seq = out + [int(root)]  # what positions at + 1 .. n hold
        while len(out) < length:
            out.append(seq[len(out)] if len(out) < len(seq) else out[len(out) - period])
    return out

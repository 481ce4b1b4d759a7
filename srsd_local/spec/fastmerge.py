"""Drafts merged into a token tree in one compiled call (`srsd_merge` in _kernels.c):
`TokenTree.insert` for every draft, then `TokenTree.prune` when the trie is over the node,
depth or leaf budget, in the same order and arithmetic, so the tree is the same to the last
bit of every weight.

Merging runs on every drafting attempt, right after a forward pass: the sources' drafts make
a trie of 50-80 nodes that is pruned to a few dozen, and in Python each node's insertion,
heap push and copy ran on caches the pass had flushed (about 0.1 ms an attempt on a CPU).
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Iterable

from .kernels import library
from .tree import TokenTree

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32

# a draft: its tokens (already cut to the depth limit, not empty), weight, agreement, origin
Draft = tuple[list[int], float, int, int]


class CompiledMerger:
    """`TokenTree.insert` of each draft, then `prune`, in one compiled call."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = self._fn = lib.srsd_merge
        fn.restype = _I64
        fn.argtypes = [_I32, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P,
                       _P, _P]
        self._grow(256)

    def __reduce__(self):  # a copy (a replayed run's snapshot) gets buffers of its own
        return compiled_merger, ()

    def _grow(self, cap: int) -> None:
        self._cap = cap
        self._trie = (ctypes.c_int32 * (6 * cap))()
        self._tw = (ctypes.c_double * cap)()
        self._links = (ctypes.c_int32 * (2 * cap))()
        self._out = (ctypes.c_int32 * (6 * cap))()
        self._ow = (ctypes.c_double * cap)()
        self._heap = (ctypes.c_int32 * cap)()

    def merge(self, root: int, drafts: Iterable[Draft], max_nodes: int, max_depth: int,
              max_branches: int) -> TokenTree:
        """As: tree = TokenTree(root); tree.insert(*d) for d in drafts; then, when the tree
        has more than max_nodes drafted nodes, a node deeper than max_depth or more than
        max_branches leaves, tree.prune(max_nodes, max_depth, max_branches)."""
        toks, offs = array("i"), array("i", [0])
        ws, ags, origins = array("d"), array("i"), array("i")
        for path, weight, agree, origin in drafts:
            toks.extend(path)
            offs.append(len(toks))
            ws.append(weight)
            ags.append(agree)
            origins.append(origin)
        need = len(toks) + 1
        if need > self._cap:
            self._grow(2 * need)
        cap = self._cap
        n = self._fn(int(root), len(ws), toks.buffer_info()[0], offs.buffer_info()[0],
                     ws.buffer_info()[0], ags.buffer_info()[0], origins.buffer_info()[0], cap,
                     max_nodes, max_depth, max_branches, self._trie, self._tw, self._links,
                     self._out, self._ow, self._heap)
        ints, w = (self._trie, self._tw) if n < 0 else (self._out, self._ow)
        n = abs(n)
        return TokenTree.from_lists(ints[:n], ints[cap: cap + n], ints[2 * cap: 2 * cap + n],
                                    w[:n], ints[3 * cap: 3 * cap + n],
                                    ints[4 * cap: 4 * cap + n], ints[5 * cap: 5 * cap + n])


def compiled_merger() -> CompiledMerger | None:
    """The compiled merge, or None without a build of the kernels (then TokenTree's Python
    insert and prune serve)."""
    lib = library()
    return None if lib is None else CompiledMerger(lib)

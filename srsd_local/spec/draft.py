"""The drafter interface: `propose` gives weighted drafts, `draft` merges them into a pruned
token tree rooted at the known next token. Pure numpy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..config import SRSDConfig
from .fastmerge import CompiledMerger, compiled_merger
from .index import VectorIndex
from .tree import TokenTree

Proposal = tuple[Sequence[int], float, int]  # (tokens: a list or an int32 array, weight, agree)
# draft sources: their bits in TokenTree.origin, and the names the acceptance model keys by
ORIGINS = {1: "srsd", 2: "ngram", 4: "pld", 8: "grammar", 16: "text", 32: "analogy",
           64: "list", 128: "copy"}
RETRIEVAL = 1  # the bit of drafts hidden-state retrieval proposed
NGRAM_POOL = 2  # the bit of drafts the n-gram pool proposed (ngram_mod.py)
GRAMMAR = 8  # the bit of drafts a grammar forces (see DraftInput.forced)
ANALOGY = 32  # the bit of drafts made by analogy with an earlier example (analogy.py)
LIST = 64  # the bit of drafts that continue a list copied name by name (listcopy.py)
TEXT = 16  # the bit of drafts text lookup proposed (textlookup.py)
COPY = 128  # the bit of chains that continue a copy run (copyrun.py)


@lru_cache(maxsize=64)
def origin_name(bits: int) -> str:
    """"srsd", "ngram", "srsd+ngram", ... for a node's origin bitmask."""
    return "+".join(name for bit, name in ORIGINS.items() if bits & bit) or "none"


@lru_cache(maxsize=256)  # a node's bits: 8 sources
def acceptance_source(bits: int) -> str:
    """The source a node's acceptance is learned under: a node that hidden-state retrieval
    proposed counts as retrieval's (with "grammar" when a grammar forces it too) whatever
    other sources also proposed it; other nodes by all their sources ("ngram+text", ...).
    Keying retrieval's nodes by every combination split their evidence into thin keys with
    low seeds, and the controller cut their trees short: with one key, the default mode made
    as many tokens per step as retrieval alone on edits, and 5% more tokens/s overall.
    Analogy and list drafts likewise have one key each (the n-gram pool or text lookup often
    propose the same nodes once an item's values have been seen)."""
    for one in (RETRIEVAL, ANALOGY, LIST):
        if bits & one:
            return origin_name(bits & (one | GRAMMAR))
    return origin_name(bits)
_MAX_AGREE = 8
_UNSET = object()  # Drafter._merger before the first draft


@dataclass
class DraftInput:
    tokens: np.ndarray  # int32 context tokens in the KV cache, positions 0..n-1
    root: int  # the known next token (position n), not yet in the KV cache
    query: np.ndarray | None  # hidden row of position n-1
    index: VectorIndex | None
    # what an output constraint forces after the root (drafted as the heaviest path)
    forced: Sequence[int] = ()
    # an output constraint applied to a drafted tree within a node budget: the nodes it
    # cannot emit dropped, what it forces after a leaf added
    constrain: Callable[[TokenTree, int], TokenTree] | None = None
    # the context's text with the root's (bytes) and a tokenizer of such text, for drafters
    # that match text rather than tokens (left empty for modes without one)
    text: bytes = b""
    flat: bytes = b""  # the same text with every whitespace run collapsed to one space
    tokenize: Callable[[bytes], Sequence[int]] | None = None
    piece: Callable[[int], bytes] | None = None  # a token's text
    ends: Sequence[int] = ()  # per context position: where its piece ends in `text`
    skip: int = 0  # origin bits of sources not to run this time (see Speculator.sources_off)


class Drafter:
    """Base: `propose` gives weighted drafts, `draft` merges them into a pruned tree.

    `origin` is the source's bit in a tree's per-node bitmask (see ORIGINS), so the
    acceptance model can tell which sources proposed a node."""

    name = "none"
    origin = 0
    _merger: CompiledMerger | None | object = _UNSET  # made at the first draft

    def __init__(self, config: SRSDConfig) -> None:
        self.config = config

    def propose(self, inp: DraftInput) -> list[Proposal]:
        return []

    def tagged(self, inp: DraftInput) -> list[tuple[Proposal, int]]:
        """Proposals with the bit of the source that made each one."""
        return [(p, self.origin) for p in self.propose(inp)]

    def draft(self, inp: DraftInput, max_nodes: int | None = None) -> TokenTree:
        cfg = self.config
        depth = cfg.draft_depth
        budget = cfg.max_nodes if max_nodes is None else max_nodes
        drafts, total = [], 0.0  # (tokens cut to the depth, weight, agreement, origin)
        for (path, weight, agree), origin in self.tagged(inp):
            if len(path):
                part = path[:depth]
                drafts.append((part.tolist() if isinstance(part, np.ndarray) else part,
                               float(weight), int(agree), origin))
                total += weight
        if len(inp.forced):
            drafts.append((list(inp.forced)[:depth], 1.0 + total, _MAX_AGREE, GRAMMAR))
        merger = self._merger
        if merger is _UNSET:
            merger = self._merger = compiled_merger()
        if merger is not None:  # the same tree as below, in one compiled call
            tree = merger.merge(inp.root, drafts, budget, depth, cfg.max_branches)
        else:
            tree = TokenTree(inp.root)
            for draft in drafts:
                tree.insert(*draft)
            if tree.n_draft > budget or max(tree.depths) > depth or \
                    tree.n_leaves() > cfg.max_branches:
                tree = tree.prune(budget, depth, cfg.max_branches)
        if inp.constrain is not None and tree.n_draft:
            tree = inp.constrain(tree, budget)
        return tree

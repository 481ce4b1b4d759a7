"""Draft proposers. Pure numpy: each returns a TokenTree rooted at the known next token.

- `SemanticDrafter` (SRSD): the hidden state of the last processed position queries the
  index; a hit `j` counts only if `ctx[j+1]` is the known next token; `ctx[j+2 : j+2+D]` is
  its draft, weighted by similarity.
- `NgramDrafter` (prompt lookup decoding): longest suffix n-gram matches in the context;
  the tokens after each match are a draft, weighted by match length.
- `HybridDrafter`: both sources in one trie.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import SRSDConfig
from .index import VectorIndex
from .tree import TokenTree

# (draft tokens after the root, weight, context tokens matched up to and including the root)
Proposal = tuple[np.ndarray, float, int]
_MAX_AGREE = 8


@dataclass
class DraftInput:
    tokens: np.ndarray  # int32 context tokens in the KV cache, positions 0..n-1
    root: int  # the known next token (position n), not yet in the KV cache
    query: np.ndarray | None  # hidden row of position n-1
    index: VectorIndex | None


class Drafter:
    """Base: `propose` gives weighted drafts, `draft` merges them into a pruned tree."""

    name = "none"

    def __init__(self, config: SRSDConfig) -> None:
        self.config = config

    def propose(self, inp: DraftInput) -> list[Proposal]:
        return []

    def draft(self, inp: DraftInput, max_nodes: int | None = None) -> TokenTree:
        cfg = self.config
        tree = TokenTree(inp.root)
        for path, weight, agree in self.propose(inp):
            if len(path):
                tree.insert(path[: cfg.draft_depth], weight, agree)
        budget = cfg.max_nodes if max_nodes is None else max_nodes
        if tree.n_draft <= budget and max(tree.depths) <= cfg.draft_depth:
            leaves = sum(1 for i in range(len(tree)) if not tree.children(i))
            if leaves <= cfg.max_branches:
                return tree
        return tree.prune(budget, cfg.draft_depth, cfg.max_branches)


class SemanticDrafter(Drafter):
    name = "srsd"

    def propose(self, inp: DraftInput) -> list[Proposal]:
        cfg = self.config
        if inp.index is None or inp.query is None or len(inp.index) == 0:
            return []
        hits = inp.index.search(inp.query, cfg.top_k)
        ctx = inp.tokens
        n = len(ctx)
        out: list[Proposal] = []
        for j, score in zip(hits.positions.tolist(), hits.scores.tolist()):
            if score < cfg.min_similarity or j + 2 >= n or ctx[j + 1] != inp.root:
                continue
            agree = 1  # the root itself; then the tokens before it
            while agree < _MAX_AGREE and j - agree + 1 >= 0 and \
                    ctx[j - agree + 1] == ctx[n - agree]:
                agree += 1
            out.append((ctx[j + 2: j + 2 + cfg.draft_depth], float(score), agree))
        return out


class NgramDrafter(Drafter):
    name = "pld"

    def propose(self, inp: DraftInput) -> list[Proposal]:
        cfg = self.config
        seq = np.append(inp.tokens, np.int32(inp.root)).astype(np.int32)
        n = len(seq)
        if n < 2:
            return []
        # candidate i: seq[i] == last token, i < n-1; then extend the match backwards
        cand = np.flatnonzero(seq[:-1] == seq[-1])
        length = np.ones(len(cand), dtype=np.int64)
        alive = np.ones(len(cand), dtype=bool)
        for k in range(1, cfg.ngram_max):
            ok = alive & (cand - k >= 0)
            ok[ok] = seq[cand[ok] - k] == seq[n - 1 - k]
            length[ok] += 1
            alive = ok
            if not alive.any():
                break
        keep = length >= cfg.ngram_min
        cand, length = cand[keep], length[keep]
        if len(cand) == 0:
            return []
        # longest matches first, then most recent
        order = np.lexsort((-cand, -length))[: cfg.ngram_matches]
        out: list[Proposal] = []
        for i, m in zip(cand[order].tolist(), length[order].tolist()):
            cont = seq[i + 1: i + 1 + cfg.draft_depth]
            if len(cont):
                out.append((cont, m / cfg.ngram_max, m))
        return out


class HybridDrafter(Drafter):
    name = "hybrid"

    def __init__(self, config: SRSDConfig) -> None:
        super().__init__(config)
        self.parts = (SemanticDrafter(config), NgramDrafter(config))

    def propose(self, inp: DraftInput) -> list[Proposal]:
        return [p for part in self.parts for p in part.propose(inp)]


def make_drafter(mode: str, config: SRSDConfig) -> Drafter | None:
    """The drafter for a generation mode; None for plain decoding. Mode "pld" is classic
    prompt lookup: one linear draft of `pld_draft_len` tokens from the best match."""
    if mode == "ar":
        return None
    if mode == "pld":
        return NgramDrafter(config.with_(ngram_matches=1, max_branches=1, adaptive=False,
                                         draft_depth=config.pld_draft_len,
                                         max_nodes=config.pld_draft_len))
    table: dict[str, type[Drafter]] = {"srsd": SemanticDrafter, "hybrid": HybridDrafter}
    if mode not in table:
        raise ValueError(f"unknown mode {mode!r}: accepted are ar, pld, " + ", ".join(table))
    return table[mode](config)

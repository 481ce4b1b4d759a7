"""Prompt lookup: the longest suffix n-gram matches in the context; the tokens after each match
are a draft, weighted by match length."""

from __future__ import annotations

import numpy as np

from .draft import Drafter, DraftInput, Proposal


class NgramDrafter(Drafter):
    name = "pld"
    origin = 4

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

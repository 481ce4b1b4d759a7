"""Hidden-state retrieval (SRSD): the hidden state of the last processed position queries the
index; a hit `j` counts only if `ctx[j+1]` is the known next token; `ctx[j+2 : j+2+D]` is its
draft, weighted by similarity.

By default (`retrieval_search="next"`) the query is compared only with the positions that
can count, the top_k most similar of those kept; with "all" it is compared with every
position (the original SRSD search) and the top_k hits that do not count are dropped."""

from __future__ import annotations

from .draft import _MAX_AGREE, Drafter, DraftInput, Proposal


class SemanticDrafter(Drafter):
    name = "srsd"
    origin = 1

    def propose(self, inp: DraftInput) -> list[Proposal]:
        cfg = self.config
        if inp.index is None or inp.query is None or len(inp.index) == 0:
            return []
        ctx = inp.tokens
        depth = cfg.draft_depth
        if cfg.retrieval_search == "next":
            hits = inp.index.search_next(inp.query, ctx, inp.root, cfg.top_k,
                                         cfg.min_similarity, _MAX_AGREE, depth)
            return list(zip(hits.follow, hits.scores, hits.agree))
        n = len(ctx)
        if not (ctx[1: n - 1] == inp.root).any():  # no hit could count: skip the search
            return []
        found = inp.index.search(inp.query, cfg.top_k)
        out: list[Proposal] = []
        for j, score in zip(found.positions.tolist(), found.scores.tolist()):
            if score < cfg.min_similarity or j + 2 >= n or ctx[j + 1] != inp.root:
                continue
            agree = 1  # the root itself; then the tokens before it
            while agree < _MAX_AGREE and j - agree + 1 >= 0 and \
                    ctx[j - agree + 1] == ctx[n - agree]:
                agree += 1
            out.append((ctx[j + 2: j + 2 + depth], float(score), agree))
        return out

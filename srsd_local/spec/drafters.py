"""Drafters by mode: `make_drafter(mode, config)`.

| mode      | sources in the tree                                              |
|-----------|------------------------------------------------------------------|
| ar        | none: plain decoding                                             |
| pld       | classic prompt lookup: one linear draft, no controller           |
| ngram     | n-gram pool (precise, only when confident)                       |
| retrieval | hidden-state retrieval                                           |
| srsd      | hidden-state retrieval + n-gram pool + text lookup + analogy and |
|           | list drafts, one tree (the default)                              |
| hybrid    | hidden-state retrieval + prompt-lookup trie                      |
"""

from __future__ import annotations

from ..config import SRSDConfig
from .analogy import AnalogyDrafter
from .draft import Drafter, DraftInput, Proposal
from .listcopy import ListCopyDrafter
from .ngram import NgramDrafter
from .ngram_mod import NgramModDrafter
from .retrieval import SemanticDrafter
from .textlookup import TextLookupDrafter

__all__ = ["Drafter", "DraftInput", "MergedDrafter", "NgramDrafter", "NgramModDrafter",
           "Proposal", "SemanticDrafter", "TextLookupDrafter", "make_drafter"]


class MergedDrafter(Drafter):
    """Several sources in one trie; each node remembers which sources proposed it."""

    def __init__(self, config: SRSDConfig, parts: tuple[Drafter, ...], name: str) -> None:
        super().__init__(config)
        self.parts = parts
        self.name = name

    def tagged(self, inp: DraftInput) -> list[tuple[Proposal, int]]:
        skip = inp.skip  # (sources switched off for this request: see Speculator)
        return [t for part in self.parts if not part.origin & skip for t in part.tagged(inp)]

    def propose(self, inp: DraftInput) -> list[Proposal]:
        return [p for p, _ in self.tagged(inp)]


def make_drafter(mode: str, config: SRSDConfig, pool: NgramModDrafter | None = None
                 ) -> Drafter | None:
    """The drafter for a generation mode; None for plain decoding. `pool`: the n-gram pool
    to share between modes (one is made when not given)."""
    if mode == "ar":
        return None
    if mode == "pld":
        return NgramDrafter(config.with_(ngram_matches=1, max_branches=1, adaptive=False,
                                         draft_depth=config.pld_draft_len,
                                         max_nodes=config.pld_draft_len))
    if mode == "retrieval":
        return SemanticDrafter(config)
    ngram = pool if pool is not None else NgramModDrafter(config)
    if mode == "ngram":
        return ngram
    if mode == "srsd":
        return MergedDrafter(config, (SemanticDrafter(config), ngram,
                                      TextLookupDrafter(config), AnalogyDrafter(config),
                                      ListCopyDrafter(config)),
                             "srsd")
    if mode == "hybrid":
        return MergedDrafter(config, (SemanticDrafter(config), NgramDrafter(config)), "hybrid")
    raise ValueError(f"unknown mode {mode!r}: accepted are ar, pld, ngram, retrieval, srsd, "
                     "hybrid")

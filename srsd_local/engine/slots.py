"""Slots: the per-request context state of an engine that decodes several requests in one
llama.cpp context, and the unit of a shared batch.

Slot i owns sequence id `base = i * (max_branches + 1)` (its committed context) and the ids
base+1 .. base+max_branches (the branches of its trees), its context tokens, its hidden-state
index and the logits kept after its last prompt. A finished request leaves its context in the
slot, so the next request whose prompt starts the same way reuses it (`pick`).

A `Work` is what one request asks the next forward pass to decode (a prompt chunk, a plain
step or a token tree); the scheduler concatenates the Works of all active requests into one
batch and hands each its rows back.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..spec.index import VectorIndex
from ..spec.textlookup import ContextText


class Slot:
    def __init__(self, base: int, n_ctx: int, n_embd: int, index_backend: str) -> None:
        self.base = base  # main sequence id; branches are base+1..
        self.n_ctx = n_ctx  # context cells this slot may use
        self.n_past = 0  # committed tokens (positions 0..n_past-1 of sequence `base`)
        self.ctx = np.zeros(n_ctx + 1, dtype=np.int32)  # those tokens
        self.index = VectorIndex(n_embd, n_ctx, index_backend)
        self.text = ContextText()  # the text of ctx[:n_past], kept when a request drafts from it
        self.last_hidden: np.ndarray | None = None  # hidden row of position n_past-1
        # (position, logits, hidden row) after the last prefilled prompt
        self.prompt_end: tuple[int, np.ndarray, np.ndarray | None] | None = None
        self.busy = False
        self.last_used = 0  # scheduler tick of the last request (least recently used first)

    def common_prefix(self, prompt: np.ndarray) -> int:
        """Leading tokens of `prompt` this slot's context (and index) already hold."""
        limit = min(self.n_past, len(prompt), len(self.index))
        diff = np.flatnonzero(self.ctx[:limit] != prompt[:limit])
        return int(diff[0]) if len(diff) else limit

    def forget(self) -> None:
        """Drop the context state (the caller clears the KV cells)."""
        self.n_past = 0
        self.index.clear()
        self.text.cut(0)
        self.last_hidden = None
        self.prompt_end = None


def pick(slots: Sequence[Slot], prompt: np.ndarray) -> tuple[Slot, Slot | None, int]:
    """A free slot for a request with this prompt: the free one holding the longest prefix of
    it (else the least recently used), and the slot (busy or not) holding a longer prefix
    than that, to copy from, with its length (None, 0 when there is none)."""
    free = [s for s in slots if not s.busy]
    if not free:
        raise RuntimeError("no free slot")
    best = max(free, key=lambda s: (s.common_prefix(prompt), -s.last_used))
    if best.common_prefix(prompt) == 0:
        best = min(free, key=lambda s: s.last_used)
    own = best.common_prefix(prompt)
    donor, shared = None, own
    for s in slots:
        c = s.common_prefix(prompt)
        if s is not best and c > shared:
            donor, shared = s, c
    return best, donor, (shared if donor is not None else 0)


@dataclass
class Work:
    """One request's share of the next forward pass. The scheduler fills `logits` (rows of
    the flagged tokens, in order), `hidden` (rows of all tokens, when captured) and
    `decode_seconds` (the whole pass)."""

    tokens: Sequence[int]
    positions: Sequence[int]  # an int32 array, or a list for a plain step
    seq_ids: list[list[int]]
    flags: Sequence[int]  # per token: want its logits (int8 array or list)
    capture: bool  # the request needs hidden rows
    prefill: bool = False  # a prompt chunk (not a decoding step)
    logits: np.ndarray | None = None
    hidden: np.ndarray | None = None
    # per flagged token: llama.cpp's in-graph argmax, or -1 (an int32 array("i") or numpy)
    sampled: np.ndarray | array | None = None
    decode_seconds: float = 0.0
    # a plain step: where its captured row may be written (an address, the index's next
    # pending row; 0: nowhere), and whether it was (then `hidden` is None)
    stage: int = 0
    staged: int = 0
    # a plain step that may go on as a run of up to this many plain steps in one compiled
    # call, each decoding the token the last one took in the graph (`sampled` then holds
    # every step's token, `staged` how many of their rows went to `stage`, those of the
    # steps from `capture_from` on, and `hidden` the last one's row where it did not);
    # `draws`: for tokens drawn in the graph, each step's uniform draw (an array("d"))
    run: int = 1
    capture_from: int = 0
    draws: array | None = None
    # a run's check of each step's token (an output constraint's: see Backend.step_run),
    # and whether it rejected the last one (not taken; its row then in `logits`)
    check: tuple[int, int] | None = None
    rejected: bool = False

    def __len__(self) -> int:
        return len(self.tokens)

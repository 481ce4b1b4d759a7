"""A backend's llama_decode calls recorded, then served instead of running the model: the
engine's host work measured without the forward passes (see srsd_local/engine/replay.py)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np


class ReplayMismatch(RuntimeError):
    """The replayed generation asked for a forward pass the recording does not have."""


class PassReplay:
    """A backend's llama_decode calls, recorded (`serving` False) or served (True)."""

    def __init__(self) -> None:
        self.serving = False
        # per batch: (logits rows or None, hidden rows or None, seconds, llama.cpp's
        # in-graph sampling of it or None: see Backend._sampled)
        self.passes: dict[tuple, tuple[np.ndarray | None, np.ndarray | None, float,
                                       tuple[bool, np.ndarray] | None]] = {}
        self.logits: np.ndarray | None = None  # the rows of the call served last
        # the in-graph tokens of the call recorded or served last
        self._sampled: tuple[bool, np.ndarray] | None = None
        self._rows: np.ndarray | None = None  # where served rows are written (reused)
        self.hidden: np.ndarray | None = None
        self._seconds = 0.0  # recorded llama_decode seconds since the last take_seconds()

    @staticmethod
    def key(be: Any, m: int) -> tuple:
        seqs = be._p_seq
        ids = tuple(tuple(seqs[i][j] for j in range(int(be._b_nseq[i]))) for i in range(m))
        return (be._b_tok[:m].tobytes(), be._b_pos[:m].tobytes(),
                be._b_logits[:m].tobytes(), ids)

    def record(self, be: Any, m: int, seconds: float) -> None:
        """After a real llama_decode of the batch's first m rows (untimed work)."""
        n_out = int(np.count_nonzero(be._b_logits[:m]))
        # rows sampled in llama.cpp's graph: their tokens (and no logits, unless other rows
        # of the call needed them copied out)
        sampled = self._sampled = be.graph_outputs(m) if n_out and be.graph_seqs else None
        raw = sampled is None or sampled[0]
        logits = be._logits(n_out).copy() if n_out and raw else None
        hidden = be.capture.rows() if be.capture is not None else None
        self.passes[self.key(be, m)] = (logits, hidden, seconds, sampled)
        self._seconds += seconds

    def serve(self, be: Any, m: int) -> None:
        """Instead of llama_decode: the recorded rows of this batch become the last call's."""
        got = self.passes.get(self.key(be, m))
        if got is None:
            raise ReplayMismatch(f"the replay asked for a pass of {m} tokens that the "
                                 "recording does not have (its decisions diverged)")
        logits, self.hidden, seconds, self._sampled = got
        # the rows written where the engine reads them, as llama.cpp writes its rows at the
        # end of llama_decode: counted as llama_decode time, not host time
        t0 = time.perf_counter()
        if logits is None:
            self.logits = None
        else:
            n, width = logits.shape
            if self._rows is None or self._rows.shape[0] < n or self._rows.shape[1] != width:
                self._rows = np.empty((n, width), np.float32)
            self.logits = self._rows[:n]
            np.copyto(self.logits, logits)
        be.decode_seconds += time.perf_counter() - t0
        self._seconds += seconds

    def sampled_rows(self) -> tuple[bool, np.ndarray]:
        """The in-graph sampling of the call recorded or served last, as Backend._sampled
        reads it from llama.cpp (read once while recording)."""
        if self._sampled is None:
            raise ReplayMismatch("the replay asked for in-graph sampled tokens of a pass "
                                 "recorded without them")
        raw, got = self._sampled
        return raw, got.copy()

    def captured(self) -> np.ndarray | None:
        return None if self.hidden is None else self.hidden.copy()

    def take_seconds(self) -> float:
        """Recorded llama_decode seconds since the last call."""
        s, self._seconds = self._seconds, 0.0
        return s

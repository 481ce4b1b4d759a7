"""A fake llama.cpp backend for engine logic tests (no weights).

It keeps one token list per sequence id, like a unified KV cache, and computes each row's
logits from the tokens on that row's own path, so tree verification is exercised for real.
The "model" copies: after the last token it predicts what followed its most recent
earlier occurrence, else (last + 1) mod V. Hidden rows are a fixed random vector per pair of
last tokens, so semantic retrieval finds the positions that copying would use.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from srsd_local.llama.backend import Backend, ContextFullError, DecodeOutput

VOCAB = 64
EOS = 1
BOS = 2
N_EMBD = 16


class FakeBackend:
    name = "fake"

    def __init__(self, n_ctx: int = 512, noise: float = 0.5, margin: float = 4.0,
                 step_cost=None) -> None:
        self.n_ctx = n_ctx
        self.n_vocab = VOCAB
        self.n_embd = N_EMBD
        self.n_past = 0
        self.capture = SimpleNamespace(enabled=True)
        self.seqs: dict[int, list[int]] = {0: []}
        self.decode_calls: list[int] = []
        self.decode_seconds = 0.0
        self.replay = None  # as Backend's: no recording (engine/replay.py needs llama.cpp)
        self.step_cost = step_cost  # n tokens -> seconds a decode takes (slept), if given
        self.n_layer = 4
        self.can_speculate = True  # False: a recurrent model (no partial roll-back)
        self.noise, self.margin = noise, margin
        self._emb = np.random.default_rng(0).normal(size=(VOCAB * VOCAB, N_EMBD))

    # tokens: text is lowercase letters, token = 10 + letter index; ' ' = 36
    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        ids = [36 if c == " " else 10 + (ord(c) - 97) % 26 for c in text]
        return ([BOS] if add_bos else []) + ids

    def piece(self, token: int) -> bytes:
        if token == 36:
            return b" "
        if 10 <= token < 36:
            return bytes([97 + token - 10])
        if token >= 37:
            return f"<{token}>".encode()
        return b""

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def chat_template(self):
        return None

    def meta(self, key):
        return None

    def close(self) -> None:
        pass

    # the fake model
    def predict(self, history: list[int]) -> int:
        last = history[-1]
        for i in range(len(history) - 2, 0, -1):
            if history[i] == last and history[i + 1] != BOS:
                return history[i + 1]
        return (history[-1] + 1) % VOCAB if history[-1] + 1 < VOCAB else 10

    def _logits(self, history: list[int]) -> np.ndarray:
        rng = np.random.default_rng(hash(tuple(history[-3:])) % (2**32))
        row = rng.normal(scale=self.noise, size=VOCAB).astype(np.float32)
        row[self.predict(history)] += self.margin
        return row

    def _hidden(self, history: list[int]) -> np.ndarray:
        a = history[-2] if len(history) > 1 else 0
        return self._emb[a * VOCAB + history[-1]].astype(np.float32)

    def decode(self, tokens, positions=None, seq_ids=None, want_logits="last") -> DecodeOutput:
        n = len(tokens)
        pos = list(range(self.n_past, self.n_past + n)) if positions is None else \
            [int(p) for p in positions]
        ids = [[0]] * n if seq_ids is None else [list(s) for s in seq_ids]
        if max(pos) + 1 > self.n_ctx:
            raise ContextFullError(f"context is full: {max(pos) + 1} tokens, n_ctx={self.n_ctx}")
        if isinstance(want_logits, str) and want_logits == "all":
            flags = [True] * n
        elif isinstance(want_logits, str) and want_logits == "last":
            flags = [False] * (n - 1) + [True]
        else:
            flags = [bool(f) for f in want_logits]
        self.decode_calls.append(n)
        if self.step_cost is not None:
            time.sleep(self.step_cost(n))
        logits, hidden = [], []
        for tok, p, sids in zip(tokens, pos, ids):
            for s in sids:
                seq = self.seqs.setdefault(s, [])
                assert len(seq) == p, f"seq {s} has {len(seq)} tokens, got position {p}"
                seq.append(int(tok))
            hist = self.seqs[sids[0]][: p + 1]
            hidden.append(self._hidden(hist))
            if flags[len(hidden) - 1]:
                logits.append(self._logits(hist))
        if seq_ids is None:
            self.n_past = max(pos) + 1
        return DecodeOutput(np.array(logits, dtype=np.float32), np.array(hidden))

    def step(self, token: int) -> DecodeOutput:
        return self.decode([token])

    def step_at(self, token: int, pos: int, seq: int, capture: bool | None = None,
                stage: int = 0) -> DecodeOutput:
        return self.decode([token], positions=[pos], seq_ids=[[seq]])

    # sequence-explicit KV operations (the engine's slots)
    graph_seqs: frozenset = frozenset()  # no in-graph sampling here
    graph_sampling = False
    can_draw = False

    def sample_main(self, seq: int, on: bool, keep: bool = False,
                    draw: float | None = None) -> bool:
        return False

    def draw_state(self, seq: int):
        return None

    def keep_rows(self, seqs, on: bool) -> bool:
        return not on
    _branches = staticmethod(Backend._branch_ids)
    branch_seqs = staticmethod(Backend.branch_seqs)

    def seq_fork(self, base: int, n_branches: int, first: int | None = None,
                 with_base: bool = False) -> None:
        for s in self._branches(base, n_branches, first, with_base):
            self.seqs[s] = list(self.seqs.get(base, []))

    def seq_commit(self, base: int, winner: int, start: int, keep_until: int,
                   n_branches: int, first: int | None = None, with_base: bool = False
                   ) -> None:
        kept = self.seqs[winner][:keep_until]
        for s in self._branches(base, n_branches, first, with_base):
            self.seqs.pop(s, None)
        self.seqs[base] = kept

    def seq_abandon(self, base: int, n_branches: int, start: int,
                    first: int | None = None, with_base: bool = False) -> None:
        for s in self._branches(base, n_branches, first, with_base):
            self.seqs.pop(s, None)
        self.seqs[base] = self.seqs.get(base, [])[:start]

    def seq_trim(self, seq: int, start: int) -> None:
        self.seqs[seq] = self.seqs.get(seq, [])[:start]

    def continuable(self, seq: int, n: int) -> int:
        return n  # (no sliding-window cache here: nothing is ever taken from a sequence)

    def seq_copy(self, src: int, dst: int, end: int) -> None:
        self.seqs[dst] = list(self.seqs[src][:end])

    def fork(self, n_branches: int) -> None:
        self.seq_fork(0, n_branches)

    def abandon(self, n_branches: int) -> None:
        self.seq_abandon(0, n_branches, self.n_past)

    def commit(self, branch: int, n_keep: int, n_branches=None) -> None:
        self.seq_commit(0, branch, self.n_past, self.n_past + n_keep, 64)
        self.n_past += n_keep

    def trim(self, n: int) -> None:
        if n < self.n_past:
            self.seqs = {s: t[:n] for s, t in self.seqs.items()}
            self.n_past = n

    def clear(self) -> None:
        self.seqs = {0: []}
        self.n_past = 0

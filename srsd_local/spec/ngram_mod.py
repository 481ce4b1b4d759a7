"""ngram-mod: a precise n-gram draft source that needs no draft model, modelled on llama.cpp's
"ngram-mod" speculation (what `llama-server --spec-default` turns on).

The method
----------
A pool maps a rolling hash of `n_match` consecutive tokens to the token that followed them.
To draft, the last `n_match - 1` context tokens and the known next token (the root) are hashed
and the follower is looked up; the window then slides over that follower and the lookup
repeats, so a chain of lookups copies a continuation that was seen before. The key is long (24
tokens by default), so a hit means the recent text is a verbatim repeat of something already
seen (a file being edited, quoted text, structured output, an answer being regenerated), and
such repeats go on predictably: drafts of this kind are accepted almost always.

Drafting happens only when confident. The chain must reach `n_min` lookups (a look-ahead that
can be longer than the draft returned); when it stops earlier nothing is drafted. The chain
stops at the first unknown key and at a key whose follower changed historically (the copies
seen before diverged there) unless the newest follower was confirmed again since. So the
draft length varies with how far the copied text is known to continue, up to the tree depth.

The pool is shared: it is keyed by hash alone, so anything any request put in its context (the
prompt or generated text) can be copied by a later request. Entries from a truncated or
abandoned context are kept on purpose, as that cross-request memory: a stale entry that is
wrong costs one rejected draft, after which the contradicting text marks it as diverged.

State is incremental. Each context seen (a stream; a few are kept, most recently used first,
so interleaved requests each continue their own) remembers how many tokens it ingested, and
a call hashes only the new positions. A context that is no prefix of any stream starts a new
stream from the one it shares the longest prefix with, ingesting only past that prefix.

Every draft is later compared with the tokens that actually followed it (`stats`); a streak
of drafts that were mostly wrong clears the pool, as does the pool outgrowing `max_entries`;
the current context is then ingested again.

Unlike a fixed-size table indexed by hash modulo its size, keys here are full 64-bit hashes
(slot collisions cannot make up followers), entries count confirmations (the weight, and the
stop at historical divergence), and new context is ingested at every call, not in chunks.
Token ids must be non-negative and below 2**32. Pure Python and numpy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ..config import SRSDConfig
from .draft import NGRAM_POOL, Drafter, DraftInput, Proposal

# Knobs (module constants, not SRSDConfig fields; the constructor takes overrides):
N_MATCH = 24  # tokens hashed into a key (the n of the n-gram)
# lookups the chain must reach to draft at all (a look-ahead that may exceed the depth).
# llama.cpp uses 48 with drafts of up to 64 tokens; with this project's depth-16 trees, 16 drafts
# at the end of a copied stretch too (offline: 96-98% of drafted tokens accepted either way).
N_MIN = 16
N_MAX = 64  # longest draft; the tree depth (config.draft_depth) bounds it further
RECONFIRM = 2  # a diverged key is used again once its newest follower was seen this often
LOW_ACCEPT = 0.25  # a draft with less than this fraction confirmed counts as a miss...
LOW_STREAK = 5  # ...and this many misses in a row clear the pool
POOL_MAX = 1 << 19  # entries (about 100 bytes each) before the pool is cleared
MAX_STREAMS = 16  # contexts followed at once

_MASK = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15  # odd multiplier of the polynomial hash (mod 2**64)
_TOK = (1 << 32) - 1  # an entry packs follower | same << 32 | seen << 40
_CAP = 255  # counters saturate
_FRESH = (1 << 32) | (1 << 40)  # same = seen = 1
_BULK = 16  # more new positions than this are hashed with numpy


@dataclass
class NgramModStats:
    calls: int = 0
    drafts: int = 0  # calls that returned a draft
    drafted: int = 0  # tokens drafted
    checked: int = 0  # drafted tokens whose true continuation has been seen since
    matched: int = 0  # of those, tokens the continuation confirmed (up to the first miss)
    resets: int = 0  # pool clears (miss streak or size)

    @property
    def precision(self) -> float:
        return self.matched / self.checked if self.checked else 0.0


class _Stream:
    """One context: its tokens so far and its drafts that wait for their continuation."""

    __slots__ = ("buf", "n", "pending", "misses")

    def __init__(self, capacity: int = 256) -> None:
        self.buf = np.empty(max(capacity, 16), dtype=np.int32)  # (as the context)
        self.n = 0
        self.pending: deque[tuple[int, list[int]]] = deque()  # (position of draft[0], draft)
        self.misses = 0

    def append(self, toks: np.ndarray) -> None:
        end = self.n + len(toks)
        if end > len(self.buf):
            grown = np.empty(max(end, 2 * len(self.buf)), dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n: end] = toks
        self.n = end


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    k = min(len(a), len(b))
    diff = np.flatnonzero(a[:k] != b[:k])
    return int(diff[0]) if len(diff) else k


class NgramModDrafter(Drafter):
    """Hash-chain n-gram drafts from a pool shared across requests; [] unless confident."""

    name = "ngram"
    origin = NGRAM_POOL

    def __init__(self, config: SRSDConfig, *, n_match: int = N_MATCH, n_min: int = N_MIN,
                 n_max: int = N_MAX, max_entries: int = POOL_MAX) -> None:
        super().__init__(config)
        if n_match < 1 or n_min < 1 or n_max < 1 or max_entries < 1:
            raise ValueError(f"invalid ngram-mod sizes n_match={n_match} n_min={n_min} "
                             f"n_max={n_max} max_entries={max_entries}: accepted are >= 1")
        self.n_match = n_match
        self.n_min = n_min
        self.depth = min(n_max, config.draft_depth)
        self.max_entries = max_entries
        self._out = pow(_BASE, n_match - 1, 1 << 64)  # weight of the token leaving the window
        self._pool: dict[int, int] = {}
        self._streams: list[_Stream] = []  # most recently used first
        self.stats = NgramModStats()

    # ---- state

    def reset(self) -> None:
        """Forget everything: pool, streams and statistics."""
        self._pool.clear()
        self._streams.clear()
        self.stats = NgramModStats()

    @property
    def n_entries(self) -> int:
        return len(self._pool)

    def entry(self, key_tokens: np.ndarray) -> tuple[int, int, int] | None:
        """(follower, times seen with it in a row, times seen) for the key of the last
        `n_match` tokens of `key_tokens`, or None when unknown."""
        v = self._pool.get(self._hash(np.asarray(key_tokens)[-self.n_match:].tolist()))
        return None if v is None else (v & _TOK, (v >> 32) & _CAP, v >> 40)

    def observe(self, tokens: np.ndarray, n: int | None = None) -> None:
        """Bring the pool up to date with the context `tokens[:n]` (all of it when n is None):
        only positions not ingested before for this context are hashed."""
        ctx = np.asarray(tokens)
        self._sync(ctx if n is None else ctx[:n])

    def _sync(self, ctx: np.ndarray) -> _Stream:
        m = len(ctx)
        for i, s in enumerate(self._streams):
            k = s.n
            # (bytes compared: np.array_equal's ufunc and reduction cost ~0.1 ms on the
            # caches a forward pass has just flushed, a copy and memcmp a tenth of that)
            if k <= m and (k == 0 or ctx[:k].tobytes() == s.buf[:k].tobytes()):
                if i:
                    self._streams.insert(0, self._streams.pop(i))
                self._extend(s, ctx)
                return s
        # no stream is a prefix: start one from the stream sharing the longest prefix, whose
        # positions before the divergence are in the pool already
        best, best_k = None, 0
        for s in self._streams:
            k = _common_prefix(s.buf[: s.n], ctx)
            if k > best_k:
                best, best_k = s, k
        new = _Stream(m + 64)
        if best is not None:
            new.append(best.buf[:best_k])
        self._streams.insert(0, new)
        del self._streams[MAX_STREAMS:]
        self._extend(new, ctx)
        return new

    def _extend(self, s: _Stream, ctx: np.ndarray) -> None:
        old = s.n
        if len(ctx) > old:
            s.append(ctx[old:])
            self._ingest(s.buf, max(old, self.n_match), s.n)
        while s.pending and s.pending[0][0] + len(s.pending[0][1]) <= s.n:
            self._check(s, *s.pending.popleft())
        if len(self._pool) > max(self.max_entries, s.n):
            self._restart(s)

    def _check(self, s: _Stream, start: int, draft: list[int]) -> None:
        got = s.buf[start: start + len(draft)].tolist()
        ok = next((i for i, (a, b) in enumerate(zip(draft, got)) if a != b), len(draft))
        self.stats.checked += len(draft)
        self.stats.matched += ok
        if ok >= LOW_ACCEPT * len(draft):
            s.misses = 0
            return
        s.misses += 1
        if s.misses >= LOW_STREAK:
            self._restart(s)

    def _restart(self, s: _Stream) -> None:
        """Clear the pool; keep only stream `s`, ingested again."""
        self.stats.resets += 1
        self._pool.clear()
        self._streams = [s]
        s.pending.clear()
        s.misses = 0
        self._ingest(s.buf, self.n_match, s.n)

    def _hash(self, toks: list[int]) -> int:
        h = 0
        for t in toks:
            h = (h * _BASE + t) & _MASK
        return h

    def _keys(self, buf: np.ndarray, lo: int, hi: int) -> list[int]:
        """Hashes of the windows buf[j - n_match : j] for j in [lo, hi)."""
        n, count = self.n_match, hi - lo
        if count > _BULK:
            win = buf[lo - n: hi].astype(np.uint64)
            h = np.zeros(count, dtype=np.uint64)
            base = np.uint64(_BASE)
            for k in range(n):
                h *= base
                h += win[k: k + count]
            return h.tolist()
        toks = buf[lo - n: hi].tolist()
        h = self._hash(toks[:n])
        keys = [h]
        for j in range(count - 1):
            h = ((h - toks[j] * self._out) * _BASE + toks[j + n]) & _MASK
            keys.append(h)
        return keys

    def _ingest(self, buf: np.ndarray, lo: int, hi: int) -> None:
        """Record buf[j] as the follower of buf[j - n_match : j] for j in [lo, hi)."""
        if hi <= lo:
            return
        pool = self._pool
        for h, t in zip(self._keys(buf, lo, hi), buf[lo:hi].tolist()):
            v = pool.get(h)
            if v is None:
                pool[h] = t | _FRESH
                continue
            seen = min((v >> 40) + 1, _CAP)
            same = min(((v >> 32) & _CAP) + 1, _CAP) if v & _TOK == t else 1
            pool[h] = t | same << 32 | seen << 40

    # ---- drafting

    def propose(self, inp: DraftInput) -> list[Proposal]:
        """At most one proposal: the chain's draft (up to the tree depth) when it reached
        `n_min` lookups; weight = mean over its tokens of same / (seen + 1), about 1/2 for text
        seen once, nearer 1 the more often each step was confirmed, lower past a divergence
        confirmed again; agree = n_match (the context tokens the key matched, root included)."""
        tokens = inp.tokens
        s = self._sync(tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens))
        self.stats.calls += 1
        n, m = self.n_match, s.n
        if m < n - 1:
            return []
        seq = s.buf[m - n + 1: m].tolist()
        seq.append(int(inp.root))
        h = self._hash(seq)
        pool, out_w, depth = self._pool, self._out, self.depth
        draft: list[int] = []
        conf = 0.0
        for i in range(max(depth, self.n_min)):
            v = pool.get(h)
            if v is None:
                break
            same, seen = (v >> 32) & _CAP, v >> 40
            if same < seen and same < RECONFIRM:
                break  # the copies seen before diverged here
            t = v & _TOK
            if i < depth:
                conf += same / (seen + 1)
            draft.append(t)
            h = ((h - seq[i] * out_w) * _BASE + t) & _MASK
            seq.append(t)
        if len(draft) < self.n_min:
            return []
        path = draft[:depth]  # (a list: the merge takes lists)
        s.pending.append((m + 1, path))
        self.stats.drafts += 1
        self.stats.drafted += len(path)
        return [(path, conf / len(path), n)]

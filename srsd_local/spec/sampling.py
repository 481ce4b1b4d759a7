"""Logits -> next token. Pure numpy.

One `Sampler` serves plain decoding and tree verification alike, so a speculative run draws
exactly what a plain run would draw: each emitted token consumes one sample from the same
seeded generator, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..config import SamplingParams
from .kernels import temperature_kernel

_HEAD = 512  # candidates sorted first when looking for the top-p nucleus
CUTOFF = 30.0  # logits (x temperature) below the best (admitted) token that still count


def distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The processed distribution: (token ids, probabilities).

    Order of processing: top-k, temperature softmax, min-p, top-p (as llama.cpp's chain).
    Temperature alone: the softmax of the whole row (ids: every token, in id order). With a
    filter, tokens more than CUTOFF x temperature logits below the best one (e^-30 times less
    likely than it; together at most a 262k-entry vocabulary's e^-30, about 2e-8 of the mass)
    are left out before the softmax, and with min-p those below its bound (what its filter
    would drop anyway), which spares exponentiating the whole vocabulary. With top-p the
    candidates come most probable first (ties by token id); otherwise in token-id order,
    which saves sorting the vocabulary. Either order is deterministic, which is all sampling
    needs.
    """
    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    n_vocab = x.shape[0]
    temperature = max(params.temperature, 1e-6)
    if _temperature_only(params):
        p = _tempered(x, params.temperature)
        p /= p.sum(dtype=np.float64)
        return _all_ids(n_vocab), p
    if 0 < params.top_k < n_vocab:
        ids = _top(x, params.top_k)
    else:
        span = CUTOFF
        if params.min_p > 0.0:  # min-p keeps p >= min_p * p_max: logits within -ln(min_p) x T
            span = min(span, MIN_P_SLACK - float(np.log(params.min_p)))
        ids = np.flatnonzero(x >= x.max() - np.float32(span * temperature))
    z = x[ids]
    z = (z - z.max()) * np.float32(1.0 / temperature)
    p = np.exp(z)
    p /= p.sum(dtype=np.float64)
    if params.min_p > 0.0:
        keep = np.flatnonzero(p >= params.min_p * p.max())
        ids, p = ids[keep], p[keep]
    if params.top_p < 1.0:
        head = np.arange(len(p))
        for size in (_HEAD, 16 * _HEAD):  # the most probable few first; all only if need be
            if len(p) > size:
                part = _top(p, size)
                if p[part].sum() >= params.top_p:  # the nucleus lies within them
                    head = part
                    break
        head = head[np.lexsort((ids[head], -p[head]))]
        n_keep = int(np.searchsorted(np.cumsum(p[head]), params.top_p)) + 1
        head = head[:n_keep]
        ids, p = ids[head], p[head]
    return ids, p / p.sum()


def _top(v: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of v, in increasing order (ties at the k-th value:
    the lowest indices). The k-th largest of block maxima bounds the k-th largest value from
    below, so only the values above it are partitioned, not all of a 262k-entry row."""
    n = len(v)
    if k >= n:
        return np.arange(n)
    cand = np.arange(n)
    size = n // (4 * k)  # at least 4k blocks
    if size >= 8:
        n_full = n // size * size
        maxima = v[:n_full].reshape(-1, size).max(axis=1)
        cand = np.flatnonzero(v >= np.partition(maxima, len(maxima) - k)[len(maxima) - k])
    w = v[cand]
    if len(cand) > k:
        kth = np.partition(w, len(w) - k)[len(w) - k]
        above = cand[w > kth]
        cand = np.sort(np.concatenate([above, cand[w == kth][: k - len(above)]]))
    return cand


MIN_P_SLACK = 1e-3  # logits (x temperature) below min-p's bound still exponentiated: its
# filter, on the probabilities, has the last word


def _temperature_only(params: SamplingParams) -> bool:
    return params.top_k == 0 and params.top_p >= 1.0 and params.min_p == 0.0


def _tempered(x: np.ndarray, temperature: float, out: np.ndarray | None = None) -> np.ndarray:
    """exp((x - max x) / temperature) for a whole row (unnormalised: the best token weighs
    1), into `out` when given: three passes over the row, no gathers."""
    out = np.subtract(x, x.max(), out=out)
    out *= np.float32(1.0 / max(temperature, 1e-6))
    return np.exp(out, out=out)


_ALL_IDS: dict[int, np.ndarray] = {}


def _all_ids(n: int) -> np.ndarray:
    """0..n-1, read-only, one per vocabulary size."""
    ids = _ALL_IDS.get(n)
    if ids is None:
        ids = np.arange(n, dtype=np.intp)
        ids.flags.writeable = False
        _ALL_IDS[n] = ids
    return ids


_BLOCK = 512


def _pick(p: np.ndarray, u: float) -> int:
    """Index i with cumsum(p)[i-1] <= u * sum(p) < cumsum(p)[i] (p need not be normalised),
    in two levels (block sums, then one block) so a 262k-entry vocabulary needs no
    full-length cumulative sum."""
    n = len(p)
    if n <= 4 * _BLOCK:
        csum = np.cumsum(p, dtype=np.float64)
        return min(int(np.searchsorted(csum, u * csum[-1], "right")), n - 1)
    n_full = n // _BLOCK * _BLOCK
    sums = p[:n_full].reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64)
    if n_full < n:
        sums = np.append(sums, p[n_full:].sum(dtype=np.float64))
    csum = np.cumsum(sums)
    target = u * csum[-1]
    b = min(int(np.searchsorted(csum, target, "right")), len(sums) - 1)
    before = csum[b - 1] if b else 0.0
    block = p[b * _BLOCK: (b + 1) * _BLOCK]
    j = int(np.searchsorted(np.cumsum(block, dtype=np.float64), target - before, "right"))
    return min(b * _BLOCK + j, n - 1)


class Sampler:
    """Greedy (temperature 0) or seeded random sampling from one logits row."""

    def __init__(self, params: SamplingParams, threads: int = 1) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self._scratch: np.ndarray | None = None  # temperature alone: the row's weights
        # temperature alone: the compiled kernel where there is one (kernels.py), on up to
        # `threads` threads
        self._kernel = (temperature_kernel(params.temperature, threads)
                        if not params.greedy and _temperature_only(params) else None)

    @property
    def drawn_compiled(self) -> bool:
        """Whether draws are the compiled kernel's (sampling at a temperature alone): then a
        row's token is a function of the row and `uniform()` alone, which llama.cpp's graph
        can compute with the same kernel (see llama/graph_argmax.py)."""
        return self._kernel is not None

    def uniform(self) -> float:
        """The uniform draw the next row's draw takes (consumed: the draw is then made
        elsewhere, for that row)."""
        return self.rng.random()

    def __call__(self, logits: np.ndarray) -> int:
        if self.params.greedy:  # (the method: fewer Python layers than np.argmax)
            return int(logits.argmax())
        if self._kernel is not None:
            return self._kernel(np.asarray(logits).reshape(-1), self.rng.random())
        if _temperature_only(self.params):  # the distribution `distribution` gives, drawn
            # from unnormalised weights in a scratch row (no allocation, no normalising pass)
            x = np.asarray(logits, dtype=np.float32).reshape(-1)
            if self._scratch is None or self._scratch.shape != x.shape:
                self._scratch = np.empty_like(x)
            return _pick(_tempered(x, self.params.temperature, self._scratch),
                         self.rng.random())
        ids, p = distribution(logits, self.params)
        return int(ids[_pick(p, self.rng.random())])


class Constraint(Protocol):
    """A grammar position (see llama/grammar.py): which tokens may come next, and advancing
    along the chosen one."""

    def mask(self, ids: np.ndarray) -> np.ndarray: ...

    def accept(self, token: int) -> None: ...

    # optional: `possible() -> ids | None`, token ids that include every admitted one (a
    # superset much smaller than the vocabulary), or None when it cannot narrow them


class DeadEndError(ValueError):
    """The constraint admits no token of the vocabulary here."""


BAND = 8.0  # logits below the best token: where the best admitted token is looked for first
MAX_BAND = 4096  # candidates in that band checked at most (the best ones)


def _best_first(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids ordered by logit, highest first (ties: the lowest id)."""
    return ids[np.lexsort((ids, -x[ids]))]


def _first_allowed(ids: np.ndarray, allowed: Constraint) -> int | None:
    """The first of ids the constraint admits (None if none)."""
    if not len(ids):
        return None
    ok = allowed.mask(ids)
    return int(ids[int(np.argmax(ok))]) if ok.any() else None


def best_allowed(x: np.ndarray, allowed: Constraint, top: int | None = None,
                 top_rejected: bool = False) -> int:
    """The highest-logit token the constraint admits (ties: the lowest id). The candidates
    are checked best first in growing chunks: the top token alone (the usual case: one
    check), then the tokens within BAND logits of it (their 16 best, their 256 best); then,
    when the constraint can name a superset of what it admits (`possible`), that superset's
    256, 4096, 65536 best and the rest of it; else the rest of the band (at most its
    MAX_BAND best, ties included), then the rest of the vocabulary: its 4096 best, its 65536
    best, all of it (only the chunk at hand is sorted: a stable sort of a 262k vocabulary
    costs ~25 ms). `top`: x's argmax where it is known already (taken in llama.cpp's
    graph); `top_rejected`: the constraint is known to reject it."""
    if top is None:
        top = int(np.argmax(x))
    if not top_rejected and allowed.mask(np.asarray([top], dtype=np.int32))[0]:
        return top
    m = x[top]
    band = np.flatnonzero(x >= m - BAND).astype(np.int32)
    if len(band) > MAX_BAND:  # every token at least as high as the MAX_BAND-th, ties included
        kth = np.partition(x[band], len(band) - MAX_BAND)[len(band) - MAX_BAND]
        band = band[x[band] >= kth]
    band = _best_first(x, band)
    start = 1  # band[0] is the top token
    for end in (16, 256):
        found = _first_allowed(band[start:end], allowed)
        if found is not None:
            return found
        start = max(start, end)
    superset = _superset(allowed)
    if superset is not None:
        return _best_of(x, superset, band[:start], allowed)
    found = _first_allowed(band[start:], allowed)
    if found is not None:
        return found
    rest = np.ones(x.shape[0], dtype=bool)
    rest[band] = False
    rest = np.flatnonzero(rest).astype(np.int32)
    xr = x[rest]
    above = np.inf  # the chunks cover falling logit intervals [floor, above): best first
    for k in (4096, 65536):
        if k >= len(rest):
            break
        floor = np.partition(xr, len(rest) - k)[len(rest) - k]  # k-th highest, ties included
        sel = (xr >= floor) & (xr < above)
        found = _first_allowed(_best_first(x, rest[sel]), allowed)
        if found is not None:
            return found
        above = floor
    found = _first_allowed(_best_first(x, rest[xr < above]), allowed)
    if found is not None:
        return found
    raise DeadEndError("the grammar admits no token here (it cannot be completed)")


def _superset(allowed: Constraint) -> np.ndarray | None:
    """The constraint's superset of what it admits next, if it can name one."""
    possible = getattr(allowed, "possible", None)
    return possible() if possible is not None else None


def _best_of(x: np.ndarray, ids: np.ndarray, checked: np.ndarray, allowed: Constraint) -> int:
    """The best admitted token among `ids` (a superset of the admitted ones), `checked`
    already known to be rejected: best first, in chunks of the 256, 4096, 65536 best and
    the rest."""
    seen = np.zeros(x.shape[0], dtype=bool)  # (a gather: np.isin sorts both arrays)
    seen[checked] = True
    ids = ids[~seen[ids]]
    xs = x[ids]
    taken = np.zeros(len(ids), dtype=bool)
    for k in (256, 4096, 65536, len(ids)):
        chunk = _top(xs, min(k, len(ids)))
        chunk = chunk[~taken[chunk]]
        taken[chunk] = True
        found = _first_allowed(_best_first(x, ids[chunk]), allowed)
        if found is not None:
            return found
        if k >= len(ids):
            break
    raise DeadEndError("the grammar admits no token here (it cannot be completed)")


class ConstrainedSampler(Sampler):
    """A Sampler over the constraint-masked distribution; every token it picks is accepted
    into the constraint (each pick is emitted, so the grammar follows the output).

    Greedy: the best admitted token. Sampling: the processed distribution (top-k,
    temperature, min-p, top-p, in that order) of the admitted tokens, as if every other
    logit were -inf; admitted tokens more than CUTOFF x temperature logits below the best
    admitted one (e^-30 times less likely) are left out of the candidates."""

    def __init__(self, params: SamplingParams, constraint: Constraint, threads: int = 1
                 ) -> None:
        super().__init__(params, threads)
        self.constraint = constraint

    def __call__(self, logits: np.ndarray, top: int | None = None,
                 top_rejected: bool = False) -> int:
        """The token drawn from a logits row; `top`: the row's argmax where it is known
        already (greedy: often the answer, with one check of the grammar);
        `top_rejected`: the constraint is known to reject it (greedy: not checked again)."""
        x = np.asarray(logits, dtype=np.float32).reshape(-1)
        c = self.constraint
        take = getattr(c, "take_if_admitted", None)  # (a check that also advances)
        if self.params.greedy and take is not None:
            if top is None:
                top = int(np.argmax(x))
            if not top_rejected and take(top):  # the usual case: the argmax admitted,
                # taken in one call
                return top
            tok = best_allowed(x, c, top, top_rejected=True)
        elif self.params.greedy:
            tok = best_allowed(x, c, top, top_rejected)
        else:
            best = best_allowed(x, c, top)
            floor = x[best] - CUTOFF * max(self.params.temperature, 1e-6)
            cand = np.flatnonzero(x >= floor).astype(np.int32)
            superset = _superset(c) if len(cand) > MAX_BAND else None  # fewer to check
            if superset is not None:
                keep = np.zeros(x.shape[0], dtype=bool)
                keep[superset] = True
                cand = cand[keep[cand]]
            cand = cand[c.mask(cand)]
            ids, p = distribution(x[cand], self.params)
            tok = int(cand[ids[_pick(p, self.rng.random())]])
        c.accept(tok)
        return tok

    def take(self, token: int) -> int:
        """`token`, a greedy draw known to need no check: the row's argmax, which the
        constraint is known to admit here (it checked that token at this place before).
        The constraint advances along it, as when `__call__` draws it."""
        if not self.params.greedy:
            raise ValueError("take() is for greedy sampling: a sampled draw needs the row")
        self.constraint.accept(token)
        return token


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the model's raw distribution (softmax of the
    logits, before temperature and filters), and the `top` most likely tokens with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


MAX_TOP_LOGPROBS = 20


def token_logprob(logits: np.ndarray, token: int, n_top: int = 0) -> TokenLogprob:
    """log softmax(logits)[token], and the n_top best tokens (most likely first, ties by id)."""
    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m, dtype=np.float32).sum(dtype=np.float64)))
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:
        k = min(n_top, x.shape[0])
        ids = np.argpartition(-x, k - 1)[:k]
        ids = ids[np.lexsort((ids, -x[ids]))]
        top = tuple((int(i), float(x[i]) - lse) for i in ids)
    return TokenLogprob(int(token), float(x[token]) - lse, top)

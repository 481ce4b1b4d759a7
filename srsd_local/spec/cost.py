"""Step cost: t(n), seconds for one forward pass that decodes n tokens (n=1 is a plain step),
from a profile taken at load and corrected online from real steps. Pure numpy.

A profile measured while the machine was busy must not switch speculation off for good, so:

- every measured point is kept raw and read through sanity bounds: t(1) <= t(n) <= n * t(1)
  (one batch of n tokens never costs more than n plain steps), and an estimate never
  confirmed by a real step is at most what a confirmed bigger batch cost;
- t need not be monotone: on a CPU, llama.cpp's matrix kernels take output rows in tiles
  (of 4 on x86 with AVX2), so 7 rows of logits can cost more than 8. A step of n tokens runs
  at the profiled size m >= n that costs least (the engine pads the batch with m - n dummy
  rows): `table` gives that cost, `padded` that size. Between and past profiled sizes, the
  next profiled size is what a step is padded to;
- plain steps rescale the whole profile (the machine got faster or slower since it was
  measured); bigger steps correct the points around their size; a step faster than its
  estimate replaces it at once (load on the machine only ever adds time), slower ones
  move it slowly;
- sizes whose cost has not been confirmed by a real step of that size recently are `stale`
  (a step between two sizes corrects both, but only infers them): the controller
  occasionally plans with an optimistic guess for them (`table(..., explore=True)`), and for
  a few plans in a row after a surprise, so a wrong estimate gets tested instead of ruling
  those trees out forever.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Sequence

import numpy as np

STALE_STEPS = 2000  # a point not confirmed by a real step for this many steps is stale
OPTIMISTIC_SLOPE = 0.1  # exploration guess: each extra token costs 0.1 plain step
SURPRISE = 0.8  # a tree step this much faster than its estimate: look for more such errors


def _interp(n: int, sizes: list[int], sec: list[float]) -> float:
    """t at n from the points (sizes, sec): linear between them, the first point's
    value before them, the last slope past them (what `CostModel._base` computes)."""
    if n <= sizes[0]:
        return sec[0]
    if n >= sizes[-1]:
        if len(sizes) == 1:
            return sec[0]
        slope = (sec[-1] - sec[-2]) / (sizes[-1] - sizes[-2])
        return sec[-1] + slope * (n - sizes[-1])
    j = bisect_right(sizes, n) - 1  # sizes[j] <= n < sizes[j + 1]
    return (sec[j + 1] - sec[j]) / (sizes[j + 1] - sizes[j]) * (n - sizes[j]) + sec[j]


class CostModel:
    """Latency of a step: t(n, L) = base(n) + per_kv * n * (L - L0) for n decoded tokens with
    L tokens already in the context (attention grows with both); base(n) is profiled at a
    short context L0, per_kv from one more measurement at a long one."""

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float], per_kv: float = 0.0,
                 ctx0: int = 0, alpha: float = 0.1) -> None:
        if len(sizes) == 0 or len(sizes) != len(seconds) or sizes[0] != 1:
            raise ValueError("a cost profile needs sizes starting at 1 and one time per size")
        self.sizes = np.asarray(sizes, dtype=np.int64)
        if np.any(np.diff(self.sizes) <= 0):
            raise ValueError("cost profile sizes must increase")
        # as profiled, and the step of each point's last confirmation: numpy views of
        # array("d") buffers, which the per-step code indexes (an item of an array("d") is
        # a C call; numpy's indexing and its setitem cost tens of microseconds on the caches
        # a forward pass has just flushed)
        self._raw = array("d", np.maximum(np.asarray(seconds, dtype=np.float64), 1e-6).tolist())
        self.raw = np.frombuffer(self._raw, dtype=np.float64)
        self.scale = 1.0  # how much slower the machine is now than when profiled
        self.per_kv = max(float(per_kv), 0.0)
        self.ctx0 = int(ctx0)
        self.alpha = alpha
        self.steps = 0  # steps observed
        self._confirmed = array("d", [-np.inf]) * len(self.sizes)
        self.confirmed = np.frombuffer(self._confirmed, dtype=np.float64)
        self.surprises = 0  # steps far faster than their estimate (estimate replaced)
        self._sizes_for: dict[int, tuple[list[int], list[int], list[bool]]] = {}
        self._sizes_list: list[int] = self.sizes.tolist()
        self._plain_confirmed = False  # whether a plain step confirmed t(1) yet
        self._update()

    def __getstate__(self) -> dict:  # (copies and pickles: the numpy views made again)
        state = self.__dict__.copy()
        del state["raw"], state["confirmed"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.raw = np.frombuffer(self._raw, dtype=np.float64)
        self.confirmed = np.frombuffer(self._confirmed, dtype=np.float64)

    def _update(self, shape_changed: bool = True) -> None:
        """The estimates as read through the bounds: t(1) <= t(n) <= n t(1); an estimate
        never confirmed by a real step is at most what a confirmed bigger batch cost. Scaled
        by how fast the machine runs plain steps now."""
        if not shape_changed:
            self._seconds = None  # scaled again when next read
            return
        raw, sizes = self._raw.tolist(), self._sizes_list  # plain Python: a dozen points,
        t1 = raw[0]  # every tree step, on caches a forward pass just flushed
        t = [min(max(r, t1), t1 * s) for r, s in zip(raw, sizes)]
        cap = np.inf
        for k, conf in zip(range(len(t) - 1, -1, -1), reversed(self._confirmed)):
            if conf != -np.inf:
                cap = min(cap, t[k])
            elif t[k] > cap:
                t[k] = cap
        self._shape_list = t
        self._t1 = t1
        self._seconds = None

    @property
    def seconds(self) -> np.ndarray:
        """The current estimate of t(n) at the profile's sizes (shape x scale)."""
        if self._seconds is None:
            self._seconds = self.scale * np.array(self._shape_list)
        return self._seconds

    def _base(self, n: np.ndarray, seconds: np.ndarray | None = None) -> np.ndarray:
        sec = self.seconds if seconds is None else seconds
        out = np.interp(n, self.sizes, sec)
        if len(self.sizes) > 1:  # extrapolate past the last size with the last slope
            s0, s1 = self.sizes[-2], self.sizes[-1]
            slope = (sec[-1] - sec[-2]) / (s1 - s0)
            out = np.where(n > s1, sec[-1] + slope * (n - s1), out)
        return out

    def _per_token(self, ctx: int | None) -> float:
        """Seconds each decoded token adds at context length ctx over the profile's (its
        attention over the longer context)."""
        return self.per_kv * max(0, (ctx if ctx is not None else self.ctx0) - self.ctx0)

    def t(self, n: int, ctx: int | None = None) -> float:
        """What a step of n tokens costs, padded to the next profiled size (not beyond)."""
        return float(self.table(n, ctx)[n])

    def stale(self) -> np.ndarray:
        """Per profile point: not confirmed by a real step within STALE_STEPS steps."""
        return self.steps - self.confirmed > STALE_STEPS

    def plan_table(self, n_max: int, ctx: int | None = None, explore: bool = False
                   ) -> tuple[list[float], list[int]]:
        """(cost, size) for n = 0..n_max tokens at context length ctx (index 0 unused): a
        step of n tokens runs padded to the profiled size m, n <= m <= n_max where one is,
        that costs least (`size`), and costs what m does (`cost`, never decreasing in n).
        Past the last profiled size: extrapolated, not padded. With `explore`, stale points
        take an optimistic guess (never above their estimate). Plain Python lists: a few
        dozen sizes, on every plan, on caches a forward pass just flushed."""
        size, idx, exact = self._plan_sizes(n_max)
        scale, sizes = self.scale, self._sizes_list
        sec = [scale * v for v in self._shape_list]
        if explore:
            first, steps = sec[0], self.steps
            sec = [min(v, first * (1.0 + OPTIMISTIC_SLOPE * (m - 1)))
                   if steps - conf > STALE_STEPS else v
                   for v, m, conf in zip(sec, sizes, self._confirmed)]
        per_tok = self._per_token(ctx)
        # a profiled size costs its point; other sizes (none, or past the last point, or
        # with no room to pad) are interpolated
        cost = [(sec[i] if ex else _interp(m, sizes, sec)) + per_tok * m
                for m, i, ex in zip(size, idx, exact)]
        # the cheapest size from n on (ties: the smallest)
        best, at = cost[:], list(range(n_max + 1))
        for k in range(n_max - 1, -1, -1):
            if cost[k] > best[k + 1]:
                best[k], at[k] = best[k + 1], at[k + 1]
        at[0] = 0
        return best, [size[a] for a in at]

    def _plan_sizes(self, n_max: int) -> tuple[list[int], list[int], list[bool]]:
        """For n = 0..n_max: the profiled size m >= n a step of n tokens is padded to (n
        itself where there is none within n_max), that size's profile index, and whether
        it is a profiled size. Depends on n_max alone: cached."""
        got = self._sizes_for.get(n_max)
        if got is None:
            sizes = self._sizes_list
            size, idx, exact = [], [], []
            for n in range(n_max + 1):
                i = min(bisect_left(sizes, n), len(sizes) - 1)
                ex = n >= 1 and sizes[i] >= n and sizes[i] <= n_max
                size.append(sizes[i] if ex else n)
                idx.append(i)
                exact.append(ex)
            got = self._sizes_for[n_max] = (size, idx, exact)
        return got

    def table(self, n_max: int, ctx: int | None = None, explore: bool = False) -> list[float]:
        """The cost of n = 0..n_max tokens (see `plan_table`)."""
        return self.plan_table(n_max, ctx, explore)[0]

    def padded(self, n: int, n_max: int, ctx: int | None = None, explore: bool = False) -> int:
        """The size a step of n tokens runs at (see `plan_table`)."""
        return int(self.plan_table(n_max, ctx, explore)[1][n])

    def can_explore(self, n_max: int) -> bool:
        """Whether some size up to n_max is stale (worth an exploratory plan)."""
        k = bisect_right(self._sizes_list, max(n_max, 1))  # sizes <= n_max
        return self.steps - min(self._confirmed[:k]) > STALE_STEPS

    def observe(self, n: int, seconds: float, ctx: int | None = None) -> None:
        """Correct the profile with a measured step time: a plain step (n=1) rescales the
        whole profile (the machine got faster or slower; at once when far faster, else by
        `alpha`), a bigger one corrects the points around n: a step faster than its estimate
        replaces it at once (load on the machine only ever adds time), slower ones move it
        by `alpha`."""
        if n == 1:
            self.observe_plain(seconds, ctx)
            return
        self.steps += 1
        if ctx is not None and self.per_kv:
            seconds -= self.per_kv * n * max(0, ctx - self.ctx0)
        seconds = max(seconds, 1e-6)
        seconds /= self.scale  # in the profile's units (plain Python from here on)
        view, sizes = self._shape_list, self._sizes_list
        idx = bisect_left(sizes, n)
        if idx < len(sizes) and sizes[idx] == n:
            points, err = [idx], seconds - view[idx]
        else:
            lo, hi = max(idx - 1, 0), min(idx, len(sizes) - 1)
            points = sorted({lo, hi} - {0})
            err = seconds - _interp(n, sizes, view)
        raw = self._raw
        for j in points:
            if seconds < view[j]:  # faster than believed: believe it now
                r = min(float(raw[j]), view[j] + err)
                if seconds < SURPRISE * view[j]:
                    self.surprises += 1
            else:
                r = view[j] + self.alpha * err / len(points)
            raw[j] = max(r, 1e-6)
            if sizes[j] == n:  # a neighbour's estimate is only inferred: it stays
                # open to exploration (a poisoned t(4), corrected from a 5-token step to
                # what 5 tokens cost, would otherwise pass for measured and rule 4 out)
                self._confirmed[j] = self.steps
        self._update()

    def observe_plain(self, seconds: float, ctx: int | None = None, count: int = 1) -> None:
        """`observe` of a plain step: it rescales the whole profile. Plain Python: it runs
        after every plain step, the first thing after a forward pass. `count` steps (a run)
        that took `seconds` each count as that many observations."""
        self.steps += count
        if ctx is not None and self.per_kv and ctx > self.ctx0:
            seconds -= self.per_kv * (ctx - self.ctx0)
        if seconds < 1e-6:
            seconds = 1e-6
        t1 = self._t1  # (t(1) as profiled: no step changes raw[0])
        if seconds < 0.5 * self.scale * t1:
            self.scale = seconds / t1
            self.surprises += 1
        else:  # (count observations of the same time: the moving average moves count times)
            rate = self.alpha if count == 1 else 1.0 - (1.0 - self.alpha) ** count
            self.scale += rate * (seconds / t1 - self.scale)
        self._confirmed[0] = self.steps
        if self._plain_confirmed:
            self._seconds = None  # scaled again when next read
        else:
            self._plain_confirmed = True
            self._update()

    def to_dict(self) -> dict:
        return {"sizes": self.sizes.tolist(), "seconds": (self.raw * self.scale).tolist(),
                "per_kv": self.per_kv, "ctx0": self.ctx0}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(d["sizes"], d["seconds"], d.get("per_kv", 0.0), d.get("ctx0", 0))

    def largest_within(self, base: int, factor: float, lo: int, hi: int,
                       ctx: int | None = None) -> int:
        """The most tokens c (lo <= c <= hi) that can join a pass of `base` tokens while the
        pass costs at most `factor` times what it costs without them."""
        base = max(base, 1)
        n = np.arange(base + hi + 1)  # a prompt chunk is not padded: interpolated costs
        t = self._base(n) + self._per_token(ctx) * n
        limit = factor * t[base]
        fits = np.flatnonzero(t[base + lo: base + hi + 1] <= limit)
        return lo + int(fits[-1]) if len(fits) else lo

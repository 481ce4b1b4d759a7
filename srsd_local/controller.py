"""Adaptive speculation: how big a tree is worth verifying this step. Pure python/numpy.

- `CostModel`: t(n), seconds for one step that decodes n tokens (n=1 is a plain step),
  from a profile taken at load and refined online from real steps.
- `AcceptanceModel`: the probability that a drafted node is accepted given that its parent
  was, from its retrieval evidence (depth, share of drafts through it, their strength),
  calibrated online from verification outcomes (Beta counts with back-off to coarser keys).
- `choose()`: the sub-tree (possibly just the root, a plain step) that maximises expected
  emitted tokens per second, (1 + E[accepted]) / t(n).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .tree import TokenTree


class CostModel:
    """Latency of a step: t(n, L) = base(n) + per_kv * n * (L - L0) for n decoded tokens with
    L tokens already in the context (attention grows with both); base(n) is profiled at a
    short context L0, per_kv from one more measurement at a long one."""

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float], per_kv: float = 0.0,
                 ctx0: int = 0, alpha: float = 0.1) -> None:
        if len(sizes) == 0 or len(sizes) != len(seconds) or sizes[0] != 1:
            raise ValueError("a cost profile needs sizes starting at 1 and one time per size")
        self.sizes = np.asarray(sizes, dtype=np.int64)
        # a bigger batch never costs less: smooth out measurement noise
        self.seconds = np.maximum.accumulate(np.asarray(seconds, dtype=np.float64))
        self.per_kv = max(float(per_kv), 0.0)
        self.ctx0 = int(ctx0)
        self.alpha = alpha

    def _base(self, n: np.ndarray) -> np.ndarray:
        out = np.interp(n, self.sizes, self.seconds)
        if len(self.sizes) > 1:  # extrapolate past the last size with the last slope
            s0, s1 = self.sizes[-2], self.sizes[-1]
            slope = (self.seconds[-1] - self.seconds[-2]) / (s1 - s0)
            out = np.where(n > s1, self.seconds[-1] + slope * (n - s1), out)
        return out

    def t(self, n: int, ctx: int | None = None) -> float:
        return float(self.table(n, ctx)[n])

    def table(self, n_max: int, ctx: int | None = None) -> np.ndarray:
        """t(n) for n = 0..n_max at context length ctx (index 0 unused)."""
        n = np.arange(n_max + 1)
        extra = self.per_kv * n * max(0, (ctx if ctx is not None else self.ctx0) - self.ctx0)
        return self._base(n) + extra

    def observe(self, n: int, seconds: float, ctx: int | None = None) -> None:
        """Move the profile points around n towards a measured step time."""
        if ctx is not None:
            seconds -= self.per_kv * n * max(0, ctx - self.ctx0)
        idx = int(np.searchsorted(self.sizes, n))
        if idx < len(self.sizes) and self.sizes[idx] == n:
            self.seconds[idx] += self.alpha * (seconds - self.seconds[idx])
        else:
            lo, hi = max(idx - 1, 0), min(idx, len(self.sizes) - 1)
            err = seconds - float(self._base(np.array([n]))[0])
            for j in {lo, hi}:
                self.seconds[j] += self.alpha * err * 0.5
        self.seconds = np.maximum.accumulate(np.maximum(self.seconds, 1e-6))

    def to_dict(self) -> dict:
        return {"sizes": self.sizes.tolist(), "seconds": self.seconds.tolist(),
                "per_kv": self.per_kv, "ctx0": self.ctx0}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(d["sizes"], d["seconds"], d.get("per_kv", 0.0), d.get("ctx0", 0))


def _bucket(x: float, edges: Sequence[float]) -> int:
    for i, e in enumerate(edges):
        if x < e:
            return i
    return len(edges)


@dataclass
class NodeEvidence:
    depth: int
    share: float  # drafts through this node / drafts through the root
    strength: float  # mean weight of the drafts through this node
    n_drafts: int  # drafts through the root
    agree: int = 0  # longest context match (tokens up to the root) among those drafts
    recent: float = 0.5  # how often the last trees of this generation got a token accepted

    def keys(self, source: str, greedy: bool) -> tuple[tuple, tuple]:
        coarse = (source, greedy, min(self.depth, 12),
                  _bucket(self.recent, (0.25, 0.5, 0.75, 0.9)))
        fine = coarse + (_bucket(self.share, (0.34, 0.67, 0.999)),
                         _bucket(self.strength, (0.4, 0.6, 0.8, 0.9)),
                         _bucket(self.agree, (2, 3, 5)))
        return coarse, fine


@dataclass
class AcceptanceModel:
    """P(node accepted | parent accepted), calibrated online.

    `q()` is the posterior mean (what is reported as predicted acceptance); `q_explore()` adds
    an optimism bonus that shrinks with the evidence seen, so kinds of nodes that were never
    verified still get tried and calibrated instead of being ruled out by the prior.
    """

    prior: float = 0.4  # measured: weak srsd hits are accepted ~20%, strong ones ~80-100%
    strength: float = 4.0  # pseudo-counts of the prior at each back-off level
    bonus: float = 0.15
    counts: dict = field(default_factory=dict)  # key -> [accepted, tried]

    def _post(self, ev: NodeEvidence, source: str, greedy: bool) -> tuple[float, float]:
        coarse, fine = ev.keys(source, greedy)
        a, n_coarse = self.counts.get(coarse, (0, 0))
        qc = (a + self.strength * self.prior) / (n_coarse + self.strength)
        a, n = self.counts.get(fine, (0, 0))
        return (a + self.strength * qc) / (n + self.strength), n_coarse

    def q(self, ev: NodeEvidence, source: str, greedy: bool) -> float:
        return self._post(ev, source, greedy)[0]

    def q_explore(self, ev: NodeEvidence, source: str, greedy: bool) -> float:
        """Optimistic by how little this depth (and recent-acceptance level) was tried: the
        bonus follows the coarse key, which fills quickly, so it cannot compound down long
        chains of rarely seen fine keys."""
        mean, n = self._post(ev, source, greedy)
        return min(1.0, mean + self.bonus / (1.0 + n) ** 0.5)

    horizon: int = 2000  # older outcomes fade once a key has this many

    def update(self, ev: NodeEvidence, source: str, greedy: bool, accepted: bool) -> None:
        for key in ev.keys(source, greedy):
            c = self.counts.setdefault(key, [0, 0])
            c[0] += int(accepted)
            c[1] += 1
            if c[1] > self.horizon:
                c[0], c[1] = c[0] / 2, c[1] / 2

    def to_json(self) -> list:
        return [[list(k), v] for k, v in self.counts.items()]

    def load_json(self, data: list, cap: float | None = None) -> None:
        """Add stored counts; with `cap`, each key counts as at most that many outcomes."""
        for key, (a, n) in data:
            if cap is not None and n > cap:
                a, n = a * cap / n, cap
            self.counts[tuple(key)] = [a, n]


def evidence(tree: TokenTree, recent: float = 0.5) -> list[NodeEvidence | None]:
    """Per node (None for the root): the features the acceptance model is keyed by."""
    root_count = max(tree.counts[0], 1)
    out: list[NodeEvidence | None] = [None]
    for i in range(1, len(tree)):
        c = max(tree.counts[i], 1)
        out.append(NodeEvidence(tree.depths[i], tree.counts[i] / root_count,
                                tree.weights[i] / c, root_count, tree.agree[i], recent))
    return out


@dataclass
class Plan:
    tree: TokenTree  # the chosen sub-tree (root only: a plain step)
    probs: list[float]  # predicted P(accepted) of each node of `tree` (root: 1)
    evidence: list[NodeEvidence | None]  # per node of `tree`
    expected_accepted: float
    raw_probs: list[float] = field(default_factory=list)  # before the depth calibration


def _path_probs(tree: TokenTree, q: Sequence[float], depth_scale: Sequence[float] | None = None
                ) -> np.ndarray:
    """P(node accepted). Siblings exclude each other (the model picks one token), so their
    conditional probabilities are scaled down when they would sum past 1. `depth_scale[d]`
    corrects the probabilities of depth d (see DepthCalibration); a node never gets more
    likely than its parent."""
    q = np.asarray(q, dtype=np.float64).copy()
    for node in range(len(tree)):
        kids = tree.children(node)
        if len(kids) > 1:
            total = q[kids].sum()
            if total > 1.0:
                q[kids] /= total
    raw = np.ones(len(tree))
    p = np.ones(len(tree))
    for i in range(1, len(tree)):  # parents come before children
        raw[i] = raw[tree.parents[i]] * q[i]
        scale = 1.0
        if depth_scale is not None:
            scale = depth_scale[min(tree.depths[i], len(depth_scale) - 1)]
        p[i] = min(p[tree.parents[i]], raw[i] * scale, 1.0)
    return p


class DepthCalibration:
    """A second, per-depth calibration on top of the node model: the ratio of measured to
    predicted acceptance at each depth over recent trees (exponentially weighted). The node
    features cannot see everything (a long copy in progress makes deep nodes near-certain);
    this corrects what remains, so forecasts match outcomes depth by depth."""

    def __init__(self, depths: int = 17, decay: float = 0.98, lo: float = 0.2,
                 hi: float = 10.0) -> None:
        self.pred = np.ones(depths)
        self.act = np.ones(depths)
        self.decay, self.lo, self.hi = decay, lo, hi

    def scale(self) -> np.ndarray:
        return np.clip(self.act / np.maximum(self.pred, 1e-9), self.lo, self.hi)

    def update(self, raw_probs: Sequence[float], depths: Sequence[int], accepted_depth: int
               ) -> None:
        n = len(self.pred)
        pred = np.zeros(n)
        for p, d in zip(raw_probs, depths):
            pred[min(d, n - 1)] += p
        act = np.zeros(n)
        act[1: min(accepted_depth, n - 1) + 1] = 1.0
        touched = pred > 0
        self.pred[touched] = self.decay * self.pred[touched] + pred[touched]
        self.act[touched] = self.decay * self.act[touched] + act[touched]


def choose(tree: TokenTree, q: Sequence[float], cost: np.ndarray, max_branches: int,
           q_report: Sequence[float] | None = None,
           depth_scale: Sequence[float] | None = None,
           ev: Sequence[NodeEvidence | None] | None = None) -> Plan:
    """Best sub-tree by expected tokens per second.

    q[i] is node i's conditional acceptance; p[i] = p[parent] * q[i]. The best sub-tree of k
    nodes holds the k most probable nodes (p never grows down a path, so they are
    connected); k = 0 is a plain step. cost[n] is t(n) for n = 1..len(cost)-1. The plan
    reports probabilities from `q_report` (default: q), both with `depth_scale`, and the
    uncorrected ones (`raw_probs`) for the depth calibration; `ev` is the candidate tree's
    evidence (computed here when not given), carried over to the chosen nodes.
    """
    n_nodes = len(tree)
    p = _path_probs(tree, q, depth_scale)
    q_rep = q if q_report is None else q_report
    p_rep = _path_probs(tree, q_rep, depth_scale)
    p_raw = _path_probs(tree, q_rep)
    order = sorted(range(1, n_nodes), key=lambda i: (-p[i], tree.depths[i], i))
    order = order[: len(cost) - 2]
    best_k, best_rate, cum = 0, 1.0 / cost[1], 0.0
    for k, node in enumerate(order, 1):
        cum += p[node]
        rate = (1.0 + cum) / cost[k + 1]
        if rate > best_rate:
            best_k, best_rate = k, rate
    out = TokenTree(tree.tokens[0])
    out.weights[0], out.counts[0] = tree.weights[0], tree.counts[0]
    new_of = {0: 0}
    probs, raw, leaves = [1.0], [1.0], 1
    for node in order[:best_k]:  # parents come before their children in this order
        parent = tree.parents[node]
        if parent not in new_of:
            continue  # its parent was dropped for the branch limit
        opens_leaf = bool(out.children(new_of[parent]))
        if opens_leaf and leaves >= max_branches:
            continue
        leaves += opens_leaf
        new = out.add_node(new_of[parent], tree.tokens[node], tree.weights[node])
        out.counts[new] = tree.counts[node]
        out.agree[new] = tree.agree[node]
        new_of[node] = new
        probs.append(float(p_rep[node]))
        raw.append(float(p_raw[node]))
    ev_all = evidence(tree) if ev is None else ev
    old_of = {v: k for k, v in new_of.items()}
    return Plan(out, probs, [ev_all[old_of[i]] for i in range(len(out))],
                float(sum(probs) - 1.0), raw)


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None

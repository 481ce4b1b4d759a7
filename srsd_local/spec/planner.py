"""Which sub-tree pays: the sub-tree of a candidate tree (possibly just the root, a plain
step) that maximises expected emitted tokens per second, (1 + E[accepted]) / t(n). Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .acceptance import LazyEvidence, NodeEvidence, evidence
from .tree import TokenTree


@dataclass
class Plan:
    tree: TokenTree  # the chosen sub-tree (root only: a plain step)
    probs: list[float]  # predicted P(accepted) of each node of `tree` (root: 1)
    evidence: list[NodeEvidence | None]  # per node of `tree`
    expected_accepted: float
    raw_probs: list[float] = field(default_factory=list)  # before the depth calibration
    pad: int = 0  # dummy rows to decode with the tree: the step is cheaper padded (cost.py)
    source: list[int] = field(default_factory=list)  # per node: its index in the candidate
    # the evidence of every node of the tree the plan was chosen from (speculator.py)
    candidate_evidence: list[NodeEvidence | None] | None = None
    copy_from: int | None = None  # a copy run's chain: the context position of its root
    found_copy: bool = False  # ... from a copy found by matching the last tokens


def _sibling_normalised(tree: TokenTree, q: Sequence[float]) -> list[float]:
    """q with each group of siblings scaled down when it sums past 1 (the model picks one
    token, so siblings exclude each other)."""
    q = [float(v) for v in q]
    for kids in tree.sibling_groups():
        total = sum(q[k] for k in kids)
        if total > 1.0:
            for k in kids:
                q[k] /= total
    return q


def _path_probs(tree: TokenTree, q: Sequence[float], q_rep: Sequence[float],
                depth_scale: Sequence[float] | None) -> tuple[list[float], list[float],
                                                             list[float]]:
    """P(node accepted) = P(parent accepted) * q[node], with `q` as `_sibling_normalised`
    returns it, never more than its parent's: for q and for q_rep with `depth_scale[d]`
    correcting depth d (see DepthCalibration), and for q_rep without it, in one pass.
    Plain Python: trees have a few dozen nodes, and this runs on every plan."""
    parents, depths = tree.parents, tree.depths
    n = len(parents)
    raw, raw_rep = [1.0] * n, [1.0] * n
    p, p_rep, p_raw = [1.0] * n, [1.0] * n, [1.0] * n
    scale = [1.0] if depth_scale is None else [float(v) for v in depth_scale]
    last = len(scale) - 1
    for i in range(1, n):  # parents come before children
        par = parents[i]
        d = depths[i]
        s = scale[d if d < last else last]
        r = raw[par] * q[i]
        raw[i] = r
        r *= s
        p[i] = r if r < p[par] and r < 1.0 else min(p[par], 1.0)
        r = raw_rep[par] * q_rep[i]
        raw_rep[i] = r
        p_raw[i] = r if r < p_raw[par] and r < 1.0 else min(p_raw[par], 1.0)
        r *= s
        p_rep[i] = r if r < p_rep[par] and r < 1.0 else min(p_rep[par], 1.0)
    return p, p_rep, p_raw


def choose(tree: TokenTree, q: Sequence[float], cost: np.ndarray, max_branches: int,
           q_report: Sequence[float] | None = None,
           depth_scale: Sequence[float] | None = None,
           ev: Sequence[NodeEvidence | None] | None = None, gain: float = 0.0) -> Plan:
    """Best sub-tree by expected tokens per second.

    q[i] is node i's conditional acceptance; p[i] = p[parent] * q[i]. The best sub-tree of k
    nodes holds the k most probable nodes (p never grows down a path, so they are
    connected); k = 0 is a plain step. cost[n] is t(n) for n = 1..len(cost)-1. The plan
    reports probabilities from `q_report` (default: q), both with `depth_scale`, and the
    uncorrected ones (`raw_probs`) for the depth calibration; `ev` is the candidate tree's
    evidence (computed here when not given), carried over to the chosen nodes.
    """
    n_nodes = len(tree)
    chain = tree.depths[-1] == n_nodes - 1  # one path: no siblings to normalise
    qn = q if chain else _sibling_normalised(tree, q)
    qn_rep = qn if q_report is None else q_report if chain else \
        _sibling_normalised(tree, q_report)
    p, p_rep, p_raw = _path_probs(tree, qn, qn_rep, depth_scale)
    depths = tree.depths
    # a chain's p never grows along it, and ties go to the shallower node: its own order
    order = range(1, n_nodes) if chain else \
        sorted(range(1, n_nodes), key=lambda i: (-p[i], depths[i], i))
    # the nodes that fit, in that order: a node whose parent was left out, or that would open
    # a branch past max_branches, is skipped before any size is scored, so the plan verifies
    # exactly the nodes it was scored with
    cost = cost.tolist() if isinstance(cost, np.ndarray) else cost  # Python floats below
    kept: list[int] = list(range(1, min(n_nodes, len(cost) - 1))) if chain else []
    has_child: set[int] = set()
    taken, leaves = {0}, 1
    for node in () if chain else order:
        if len(kept) >= len(cost) - 2:
            break
        parent = tree.parents[node]
        if parent not in taken:
            continue
        opens_leaf = parent in has_child
        if opens_leaf and leaves >= max_branches:
            continue
        leaves += opens_leaf
        has_child.add(parent)
        taken.add(node)
        kept.append(node)
    best_k, best_rate, cum = 0, (gain + 1.0) / cost[1], gain
    for k, node in enumerate(kept, 1):
        cum += p[node]
        rate = (1.0 + cum) / cost[k + 1]
        if rate > best_rate * (1.0 + 1e-9):  # a tie is not worth the bigger batch
            best_k, best_rate = k, rate
    return build_plan(tree, kept[:best_k], p_rep, p_raw,
                      evidence(tree) if ev is None else ev)


def build_plan(tree: TokenTree, chosen: list[int], p_rep: Sequence[float],
               p_raw: Sequence[float], ev: Sequence[NodeEvidence | None]) -> Plan:
    """The plan verifying `chosen` (nodes of `tree` in the order they were taken, parents
    first), with their probabilities (`p_rep` reported, `p_raw` without the depth
    calibration, per node of `tree`) and evidence (`ev`, per node of `tree`)."""
    best_k = len(chosen)
    if not best_k or max(chosen) == best_k:  # the candidate's first nodes (a chain's prefix)
        out, source = tree.head(best_k), list(range(best_k + 1))
    else:
        out = TokenTree(tree.tokens[0])
        new_of = {0: 0}
        for node in chosen:  # parents come before their children in this order
            new_of[node] = out.graft(new_of[tree.parents[node]], tree, node)
        source = [0, *chosen]  # (grafted in that order)
    out.weights[0], out.counts[0], out.origin[0] = tree.weights[0], tree.counts[0], 0
    probs = [1.0] + [p_rep[i] for i in source[1:]]
    raw = [1.0] + [p_raw[i] for i in source[1:]]
    picked = ev.picked(source) if isinstance(ev, LazyEvidence) else [ev[i] for i in source]
    return Plan(out, probs, picked, float(sum(probs) - 1.0), raw, source=source)

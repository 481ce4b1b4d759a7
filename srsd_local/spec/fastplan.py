"""The controller's plan in one compiled call (`srsd_plan` in _kernels.c): the acceptance
model's q for every node of a candidate tree, read from its counts by integer key
(`AcceptanceModel.tables`), and `planner.choose` on them, in the same arithmetic and order,
so it picks the same nodes with the same probabilities as the Python.

Planning runs on every drafting attempt, right after a forward pass: in Python each node's
evidence, keys and lookups (a few dozen nodes) took 0.17-0.19 ms a plan on a CPU, every
call on caches the pass had flushed. Here the tree's lists go over in two arrays, and the
evidence of a node is made only where something is learned from it (`LazyEvidence`).
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence

from .acceptance import AcceptanceModel, LazyEvidence
from .kernels import library
from .planner import Plan, build_plan
from .tree import TokenTree

_P, _I64, _I32, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_double


class CompiledPlanner:
    """`choose` (planner.py) with the acceptance model's q, in one compiled call."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = self._fn = lib.srsd_plan
        fn.restype = _I64
        fn.argtypes = [_I64, _P, _P, _P, _P, _P, _P, _P, _I32, _I32, _D, _D, _D, _P, _I64,
                       _P, _I64, _I64, _D, _P, _P, _P, _P, _P, _P]
        fn = self._learn = lib.srsd_learn
        fn.restype = _I64
        fn.argtypes = [_I64, _P, _P, _P, _P, _P, _P, _D, _P]
        self._grow(64)

    def __reduce__(self):  # a copy (a replayed run's snapshot) gets buffers of its own
        return compiled_planner, ()

    def _grow(self, n: int) -> None:
        self._cap = n
        self._work = (ctypes.c_double * (6 * n))()
        self._iwork = (ctypes.c_int32 * (3 * n))()
        self._kept = (ctypes.c_int32 * n)()
        self._p_rep = (ctypes.c_double * n)()
        self._p_raw = (ctypes.c_double * n)()

    def choose(self, tree: TokenTree, model: AcceptanceModel, source: str, greedy: bool,
               ev: LazyEvidence, cost: Sequence[float], max_branches: int,
               depth_scale: Sequence[float], gain: float = 0.0) -> Plan:
        """As planner.choose(tree, q_explore, cost, max_branches, q_mean, depth_scale, ev,
        gain) with the model's (q_mean, q_explore) of every node for (source, greedy), `ev`
        being the tree's evidence (LazyEvidence(tree, recent))."""
        recent = ev.recent
        n = len(tree)
        if n > self._cap:
            self._grow(2 * n)
        ints = array("i", tree.parents + tree.depths + tree.counts + tree.agree + tree.origin)
        weights = array("d", tree.weights)
        scale = array("d", depth_scale)
        costs = array("d", cost)
        keys = array("i", bytes(8 * n))
        tables = model.tables
        src0 = tables.src(source)  # (first: a new source's tables move the arrays)
        coarse, fine_row, fine, prior, src_of_bits = tables.addresses
        best_k = self._fn(n, ints.buffer_info()[0], weights.buffer_info()[0], coarse,
                          fine_row, fine, prior, src_of_bits, src0, int(greedy), recent,
                          model.strength, model.bonus, scale.buffer_info()[0], len(scale),
                          costs.buffer_info()[0], len(costs), max_branches, gain,
                          ctypes.addressof(self._work), ctypes.addressof(self._iwork),
                          ctypes.addressof(self._kept), ctypes.addressof(self._p_rep),
                          ctypes.addressof(self._p_raw), keys.buffer_info()[0])
        ev.keys = keys
        return build_plan(tree, self._kept[:best_k], self._p_rep[:n], self._p_raw[:n],
                          ev)

    def learn(self, model: AcceptanceModel, ev: LazyEvidence, nodes: list[int],
              accepted: list[bool]) -> None:
        """One outcome per node, as model.update counts it, for nodes of a tree this
        planner planned (indices into `ev`, the evidence of the tree or of a plan's
        sub-tree), in one compiled call. The model's dict gets them when next read."""
        if not nodes:
            return
        m, t, keys = len(nodes), model.tables, ev.keys
        todo = array("i", ev.nodes_of(nodes))
        acc = array("i", accepted)
        touched = array("i", bytes(8 * m))
        kp, tp, ap, op = (keys.buffer_info()[0], todo.buffer_info()[0],
                          acc.buffer_info()[0], touched.buffer_info()[0])
        done = 0
        while True:
            coarse, fine_row, fine = t.addresses[:3]
            done += self._learn(m - done, kp, tp + 4 * done, ap + 4 * done, coarse, fine_row,
                                fine, float(model.horizon), op + 8 * done)
            if done == m:
                break
            t.row(keys[2 * todo[done]])  # its coarse key's first fine key: a row for them
        t.pending += touched


def compiled_planner() -> CompiledPlanner | None:
    """The compiled planner, or None without a build of the kernels (then the Python
    planner serves)."""
    lib = library()
    return None if lib is None else CompiledPlanner(lib)

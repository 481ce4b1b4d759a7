"""Sources run only where they pay (Speculator.sources_off): text lookup, analogy and list
drafts are switched off for a request after SOURCE_IDLE drafting attempts in which none of
their nodes was accepted, run again on every SOURCE_PROBE-th attempt, and stay on once
one of their nodes pays. On fakes for the logic; on the real model for the outcome."""

from __future__ import annotations

import numpy as np
import pytest

from srsd_local.config import SRSDConfig
from srsd_local.spec import speculator as sp
from srsd_local.spec.cost import CostModel
from srsd_local.spec.draft import ANALOGY, LIST, RETRIEVAL, TEXT, Drafter, DraftInput
from srsd_local.spec.drafters import MergedDrafter


class _Source(Drafter):
    """A fixed draft from a source of the given origin bit; counts its calls."""

    def __init__(self, config: SRSDConfig, origin: int, path: list[int]) -> None:
        super().__init__(config)
        self.origin, self.path, self.calls = origin, path, 0

    def propose(self, inp: DraftInput) -> list:
        self.calls += 1
        return [(np.asarray(self.path, dtype=np.int32), 1.0, 4)]


def test_merged_drafter_leaves_out_the_sources_a_request_switched_off() -> None:
    cfg = SRSDConfig()
    ret, text, ana = (_Source(cfg, RETRIEVAL, [5]), _Source(cfg, TEXT, [9]),
                      _Source(cfg, ANALOGY, [7]))
    merged = MergedDrafter(cfg, (ret, text, ana), "srsd")
    ctx = np.arange(10, 20, dtype=np.int32)
    tree = merged.draft(DraftInput(ctx, 4, None, None, skip=TEXT | ANALOGY))
    assert (ret.calls, text.calls, ana.calls) == (1, 0, 0)
    assert tree.tokens == [4, 5]
    tree = merged.draft(DraftInput(ctx, 4, None, None))
    assert (ret.calls, text.calls, ana.calls) == (2, 1, 1) and sorted(tree.tokens) == [4, 5, 7, 9]


def _speculator() -> tuple[sp.Speculator, _Source, _Source]:
    cost = CostModel([1, 2, 64], [0.010, 0.0101, 0.012])  # every tree pays
    for n, seconds in zip(cost.sizes[1:], cost.seconds[1:]):  # confirmed: no exploration
        cost.observe(int(n), float(seconds))
    cfg = SRSDConfig()
    spec = sp.Speculator(cfg, cost=cost)
    ret, text = _Source(cfg, RETRIEVAL, [5, 6]), _Source(cfg, TEXT, [9, 8])
    spec.drafters["srsd"] = MergedDrafter(cfg, (ret, text), "srsd")
    return spec, ret, text


def _attempt(spec, req, accept: int) -> bool:
    """One drafting attempt as the engine makes it; the model then accepts the root's child
    `accept`. Whether the text source ran."""
    text = spec.drafters["srsd"].parts[1]
    before = text.calls
    inp = DraftInput(np.arange(10, 30, dtype=np.int32), 4, None, None)
    inp.skip = spec.sources_off(req)
    plan = spec.propose(req, inp, room=8)
    assert plan is not None
    node = plan.tree.child(0, accept)
    spec.observe(req, plan, [0] if node is None else [0, node])
    return text.calls > before


def test_a_source_whose_nodes_never_pay_runs_only_on_probes_until_one_does() -> None:
    spec, ret, text = _speculator()
    req = spec.begin("srsd", greedy=True)
    ran = [_attempt(spec, req, 5) for _ in range(3 * sp.SOURCE_PROBE)]  # retrieval's pays
    idle, probe = sp.SOURCE_IDLE, sp.SOURCE_PROBE
    assert ran[:idle] == [True] * idle  # every source runs until it has had its chances
    assert all(ran[i] == (i % probe == probe - 1) for i in range(idle, len(ran)))
    assert ret.calls == len(ran)  # retrieval always runs
    # a probe whose text node is accepted switches the source back on
    while not _attempt(spec, req, 9):
        pass
    assert req.idle[TEXT] == 0 and req.idle[ANALOGY] > 0
    assert all(_attempt(spec, req, 9) for _ in range(2 * sp.SOURCE_IDLE))  # it keeps paying
    assert spec.sources_off(req) & TEXT == 0


def test_a_node_retrieval_also_proposed_is_credit_and_other_modes_never_gate() -> None:
    spec, _, text = _speculator()
    text.path = [5, 6]  # text agrees with retrieval: its agreement shapes the tree
    req = spec.begin("srsd", greedy=True)
    for _ in range(3 * sp.SOURCE_IDLE):
        _attempt(spec, req, 5)
    assert text.calls == 3 * sp.SOURCE_IDLE and req.idle[TEXT] == 0
    assert spec.sources_off(req) == ANALOGY | LIST  # the two that never proposed anything
    other = spec.begin("retrieval", greedy=True)
    other.idle = {b: 100 for b in sp.GATED_SOURCES}
    assert spec.sources_off(other) == 0


@pytest.mark.model
def test_on_the_real_model_gated_sources_keep_plain_decodings_tokens(engine,
                                                                      monkeypatch) -> None:
    """A code continuation in the default mode, where text lookup, analogy and lists add
    little: they get switched off on some attempts, and every token is still plain
    decoding's (within the rounding noise measured in the same call). The back-off leaves
    only 6-11 drafting attempts in 160 tokens here, about SOURCE_IDLE's worth, so the test
    switches sources off after 2 attempts that did not pay, for gating to happen for sure."""
    from srsd_local.bench.workloads import first_per_category, load_workload  # noqa: PLC0415

    offs = []
    real = engine.speculator.sources_off

    def recorded(req):
        got = real(req)
        offs.append(got)
        return got

    monkeypatch.setattr(engine.speculator, "sources_off", recorded)
    monkeypatch.setattr(sp, "SOURCE_IDLE", 2)
    engine.reset()
    engine.forget_outputs()
    prompt = first_per_category(load_workload("code_continue"), 1)[0].prompt
    out = engine.generate(prompt, max_tokens=160, mode="srsd")
    assert out.stats.drafts > 0 and out.stats.tokens == 160
    assert any(offs) and not all(offs)  # switched off on some attempts, not on all
    rep = engine.verify_output(prompt, out.token_ids)
    assert rep.ok, rep.summary()

"""Controller logic on fakes: cost model, acceptance calibration, sub-tree choice, caches."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
from fakes import FakeBackend

from srsd_local.config import SRSDConfig
from srsd_local.engine import Engine
from srsd_local.engine.calibrate import calibrate
from srsd_local.engine.profile import load_cost_model, machine_id
from srsd_local.spec.acceptance import AcceptanceModel, NodeEvidence, evidence
from srsd_local.spec.cost import CostModel
from srsd_local.spec.draft import Drafter, DraftInput
from srsd_local.spec.planner import choose
from srsd_local.spec.speculator import MAX_SKIP, Speculator
from srsd_local.spec.tree import TokenTree


def _chain_tree(n: int, weight: float = 1.0) -> TokenTree:
    t = TokenTree(0)
    t.insert(list(range(1, n + 1)), weight)
    return t


def _bushy_tree() -> TokenTree:
    t = TokenTree(0)
    for b in range(6):
        t.insert([10 + b] + [100 + 10 * b + i for i in range(8)], 0.5)
    return t


def test_expensive_nodes_and_weak_evidence_give_a_plain_step():
    tree = _bushy_tree()
    cost = CostModel([1, 2, 64], [0.010, 0.021, 0.19]).table(40)
    q = [1.0] + [0.15] * (len(tree) - 1)
    plan = choose(tree, q, cost, max_branches=8)
    assert plan.tree.n_draft == 0 and plan.expected_accepted == 0


def test_cheap_nodes_give_a_large_tree():
    tree = _bushy_tree()
    cost = CostModel([1, 64], [0.001, 0.0012]).table(60)
    q = [1.0] + [0.8] * (len(tree) - 1)
    plan = choose(tree, q, cost, max_branches=8)
    assert plan.tree.n_draft == len(tree) - 1  # verification is nearly free: take it all
    assert len(plan.tree.layout().leaf_branch) == 6


def test_strong_chain_on_a_cpu_like_cost_is_drafted_deep():
    tree = _chain_tree(16)
    cost = CostModel([1, 2, 8, 16, 17], [0.010, 0.021, 0.038, 0.051, 0.053]).table(17)
    plan = choose(tree, [1.0] + [0.95] * 16, cost, max_branches=4)
    assert plan.tree.n_draft >= 12
    weak = choose(tree, [1.0] + [0.3] * 16, cost, max_branches=4)
    assert weak.tree.n_draft == 0


def test_choice_is_deterministic_and_respects_branch_limit():
    tree = _bushy_tree()
    cost = CostModel([1, 64], [0.001, 0.0012]).table(60)
    q = [1.0] + list(np.linspace(0.9, 0.3, len(tree) - 1))
    a = choose(tree, q, cost, max_branches=2)
    b = choose(tree, q, cost, max_branches=2)
    assert a.tree.tokens == b.tree.tokens and a.tree.parents == b.tree.parents
    assert a.probs == b.probs
    assert len(a.tree.layout().leaf_branch) <= 2
    # probabilities never grow down a path
    for i in range(1, len(a.tree)):
        assert a.probs[i] <= a.probs[a.tree.parents[i]] + 1e-12


def test_acceptance_model_learns_and_backs_off():
    m = AcceptanceModel()
    strong = NodeEvidence(depth=1, share=1.0, strength=0.95, n_drafts=4)
    weak = NodeEvidence(depth=1, share=0.2, strength=0.3, n_drafts=4)
    assert m.q(strong, "srsd", True) == pytest.approx(m.prior)
    for _ in range(200):
        m.update(strong, "srsd", True, True)
        m.update(weak, "srsd", True, False)
    assert m.q(strong, "srsd", True) > 0.95
    assert m.q(weak, "srsd", True) < 0.1
    # unseen fine key at the same depth backs off to the depth's (mixed) rate
    mid = NodeEvidence(depth=1, share=0.5, strength=0.7, n_drafts=1)
    assert 0.3 < m.q(mid, "srsd", True) < 0.7
    # the exploration bonus shrinks as this depth gathers outcomes
    fresh = AcceptanceModel()
    fresh.update(strong, "srsd", True, True)
    bonus_few = fresh.q_explore(mid, "srsd", True) - fresh.q(mid, "srsd", True)
    bonus_many = m.q_explore(mid, "srsd", True) - m.q(mid, "srsd", True)
    assert bonus_few > 3 * bonus_many > 0
    copy = AcceptanceModel()
    copy.load_json(m.to_json())
    assert copy.q(strong, "srsd", True) == m.q(strong, "srsd", True)
    # learned counts stay; seeds only fill in kinds of nodes they never saw
    seeds = [[["srsd", True, 1, 2], [0, 10]], [["analogy", True, 1, 2], [9, 10]]]
    copy.load_json(seeds, cap=10, missing_only=True)
    assert copy.q(strong, "srsd", True) == m.q(strong, "srsd", True)
    assert copy.counts[("analogy", True, 1, 2)] == [9, 10]


def test_analogy_and_grammar_nodes_start_from_their_own_priors():
    m = AcceptanceModel()
    plain = NodeEvidence(depth=2, share=1.0, strength=1.0, n_drafts=1, origin="text")
    analogy = NodeEvidence(depth=2, share=1.0, strength=1.0, n_drafts=1, origin="analogy")
    forced = NodeEvidence(depth=2, share=1.0, strength=1.0, n_drafts=1, origin="grammar")
    assert m.q(plain, "srsd", True) == m.prior
    assert m.q(analogy, "srsd", True) == m.analogy_prior
    assert m.q(forced, "srsd", True) == m.forced_prior


def test_evidence_features():
    t = TokenTree(0)
    t.insert([1, 2], 0.9)
    t.insert([1, 3], 0.5)
    ev = evidence(t)
    n1 = t.child(0, 1)
    assert ev[n1].share == 1.0 and ev[n1].strength == pytest.approx(0.7)
    assert ev[t.child(n1, 2)].share == 0.5 and ev[t.child(n1, 2)].n_drafts == 2


def test_retrievals_nodes_are_judged_as_retrievals_whatever_else_proposed_them():
    t = TokenTree(0)
    t.insert([1, 2], 0.9, origin=1)  # retrieval
    t.insert([1, 2, 3], 0.5, origin=16)  # text lookup agrees on 1, 2 and goes on
    t.insert([1, 2, 3], 0.5, origin=2)  # so does the n-gram pool
    t.extend(t.child(t.child(t.child(0, 1), 2), 3), [4], 8)  # a grammar forces 4 after it
    t.insert([5], 0.3, origin=2 | 8)
    ev = evidence(t)
    n1 = t.child(0, 1)
    n2 = t.child(n1, 2)
    n3 = t.child(n2, 3)
    assert t.origin[n1] == 1 | 2 | 16 and ev[n1].origin == ev[n2].origin == "srsd"
    assert ev[n3].origin == "ngram+text" and ev[t.child(n3, 4)].origin == "grammar"
    assert ev[t.child(0, 5)].origin == "ngram+grammar"
    t.insert([1, 2], 0.9, origin=8)  # forced as well: retrieval's, under the grammar's prior
    assert evidence(t)[n1].origin == "srsd+grammar"
    assert AcceptanceModel().q(evidence(t)[n1], "srsd", True) > 0.9


def test_cost_grows_with_context_and_steps_run_at_the_cheapest_size_from_theirs():
    c = CostModel([1, 2, 4, 8], [0.010, 0.021, 0.019, 0.040], per_kv=2e-6, ctx0=100)
    # 2 tokens cost more than 4 (kernels that take rows in tiles): a 2-token step runs
    # padded to 4; 3 tokens (not profiled) run at the next profiled size, 4; 5..8 at 8
    cost, size = c.plan_table(8)
    assert list(size[1:]) == [1, 4, 4, 4, 8, 8, 8, 8]
    assert cost[2] == cost[3] == cost[4] == pytest.approx(0.019)
    assert list(cost[1:]) == sorted(cost[1:])  # what a step costs never falls with its size
    assert c.padded(2, 3) == 3 and c.t(2) == pytest.approx(0.020)  # no room for 4: as is
    short, long = c.table(17, ctx=100), c.table(17, ctx=1100)
    assert long[17] - short[17] == pytest.approx(2e-6 * 17 * 1000)
    assert long[1] - short[1] == pytest.approx(2e-6 * 1000)
    # at a long context each node costs more attention: the chosen tree shrinks
    tree = _chain_tree(16)
    q = [1.0] + [0.8] * 16
    sizes = list(range(1, 18))
    cm = CostModel(sizes, [0.010 + 0.0022 * (n - 1) for n in sizes], per_kv=3e-6, ctx0=100)
    near = choose(tree, q, cm.table(17, 100), 4).tree.n_draft
    far = choose(tree, q, cm.table(17, 2000), 4).tree.n_draft
    assert near > far > 0


def test_cost_profile_reads_through_sanity_bounds():
    # measured while the machine was busy: t(12) absurd; t(n) > n * t(1) is impossible
    c = CostModel([1, 2, 12, 16], [0.010, 0.018, 4.3, 0.050])
    # t(12) <= 12 t(1); a 12-token step with room for 16 runs padded to 16, which costs less
    assert c.t(12) == pytest.approx(0.120) and c.t(16) == pytest.approx(0.050)
    assert c.table(16)[12] == pytest.approx(0.050) and c.padded(12, 16) == 16
    assert c.t(2) == pytest.approx(0.018)
    c2 = CostModel([1, 2, 4], [0.010, 0.001, 0.030])  # faster than a plain step: impossible
    assert c2.t(2) == pytest.approx(0.010)


def test_a_step_far_faster_than_believed_corrects_at_once():
    c = CostModel([1, 2, 12, 16], [0.010, 0.018, 4.3, 0.050])
    c.observe(12, 0.045)
    assert c.t(12) == pytest.approx(0.045) and c.t(16) == pytest.approx(0.050)
    c.observe(12, 0.060)  # slower than believed: moves slowly
    assert 0.045 < c.t(12) < 0.05


def test_plain_steps_rescale_the_profile():
    c = CostModel([1, 2, 16], [0.030, 0.060, 0.150])  # profiled while busy: 3x too slow
    c.observe(1, 0.010)  # far faster: believed at once, for every size
    assert c.t(16) == pytest.approx(0.050, rel=0.01)
    for _ in range(60):  # the machine got 20% slower: the profile follows
        c.observe(1, 0.012)
    assert c.t(1) == pytest.approx(0.012, rel=0.02) and c.t(16) == pytest.approx(0.060, rel=0.02)
    # a profile where a batch costs as much as separate steps keeps that shape when rescaled
    dear = CostModel([1, 2, 64], [0.010, 0.020, 0.640])
    for _ in range(10):
        dear.observe(1, 0.024)
    assert dear.t(2) == pytest.approx(2 * dear.t(1)) and dear.t(1) > 0.015


def test_a_run_of_plain_steps_rescales_the_profile_as_its_steps_one_by_one_would():
    # a run of k plain steps decoded in one call is observed once, as k steps of its mean
    # time: the profile and the step count end where k observations of that time leave them
    for k, seconds in ((1, 0.012), (5, 0.012), (8, 0.0105), (16, 0.02), (3, 0.004)):
        one, run = CostModel([1, 2, 16], [0.010, 0.018, 0.05]), \
            CostModel([1, 2, 16], [0.010, 0.018, 0.05])
        for _ in range(k):
            one.observe_plain(seconds, 300)
        run.observe_plain(seconds, 300, k)
        assert run.steps == one.steps == k and run.surprises == one.surprises
        assert run.t(1) == pytest.approx(one.t(1), rel=1e-9)
        assert run.t(16) == pytest.approx(one.t(16), rel=1e-9)
        assert run.t(1) != pytest.approx(0.010, rel=1e-3)  # (it did move)


def test_a_run_of_plain_steps_leaves_the_request_as_its_steps_one_by_one_would():
    # the engine reports a run of k plain steps as one plain step whose path has k entries:
    # the controller's recent rate drifts k times, and the k - 1 steps after the first are
    # those it would have skipped (a back-off after k - 1 skips)
    spec = Speculator(SRSDConfig(mode="srsd"))
    for skip, k in ((0, 1), (7, 8), (7, 3), (15, 16)):
        one, run = spec.begin("srsd", True), spec.begin("srsd", True)
        for req in (one, run):
            req.recent, req.skip, req.copy_at = 0.9, skip, 5
        spec.observe(one, None, [0])
        for _ in range(k - 1):
            assert spec.skips(one)
            spec.observe(one, None, [0])
        spec.observe(run, None, list(range(k)))
        assert run.recent == pytest.approx(one.recent, rel=1e-12) and run.recent < 0.9
        assert run.skip == one.skip == skip - (k - 1) and run.copy_at is None


def test_stale_sizes_get_an_optimistic_guess_only_when_exploring():
    c = CostModel([1, 2, 16], [0.010, 0.018, 0.160])
    assert c.can_explore(16)
    assert c.table(16, explore=True)[16] < c.table(16)[16]
    for _ in range(5):
        c.observe(16, 0.150)
        c.observe(2, 0.018)
        c.observe(1, 0.010)
    assert not c.can_explore(16)  # every size confirmed by real steps
    assert c.table(16, explore=True)[16] == pytest.approx(c.table(16)[16])


def test_a_step_between_profile_sizes_corrects_its_neighbours_without_confirming_them():
    c = CostModel([1, 4, 6, 16], [0.012, 4.3, 4.3, 4.3])  # poisoned above one token
    for _ in range(3):
        c.observe(1, 0.012)
    c.observe(5, 0.045)  # a real 5-token step: its neighbours' estimates come down at once
    assert c.t(4) < 0.05 and c.t(6) < 0.1
    # ... but t(4) was inferred, not measured (4 tokens may cost far less than 5 took here):
    # size 4 stays open to exploration, with an optimistic guess below the inferred value
    assert c.can_explore(4)
    assert c.table(4, explore=True)[4] < c.table(4)[4]
    c.observe(4, 0.029)  # measured at its own size: now confirmed
    assert c.t(4) == pytest.approx(0.029) and not c.can_explore(4)


def test_speculation_recovers_from_a_poisoned_profile_on_the_fake():
    def run(profile):
        # decoding n tokens takes 6 ms + 0.6 ms per extra token (slept): a batch is cheap
        be = FakeBackend(n_ctx=2048, step_cost=lambda n: 0.006 + 0.0006 * (n - 1))
        eng = Engine(be, SRSDConfig(index_backend="numpy", n_ctx=2048),
                     CostModel([1, 2, 4, 8, 16, 33], profile))
        text = "the quick brown fox jumps over the lazy dog and " * 3
        return eng, eng.generate(text, max_tokens=300, mode="srsd").stats

    _, sane = run([0.006, 0.0066, 0.0078, 0.0102, 0.015, 0.0252])
    eng, poisoned = run([0.006, 5.0, 5.0, 5.0, 5.0, 5.0])
    # exploratory plans test the big trees; their real cost replaces the absurd estimates
    # and the controller drafts as if the profile had been right
    assert eng.speculator.cost.t(16) < 0.1
    # without recovery every step would be a plain one (1 token per step)
    assert sane.mean_accepted_length > 3 and poisoned.mean_accepted_length > 2.5


def test_cost_model_refines_online():
    c = CostModel([1, 2, 16], [0.010, 0.020, 0.050])
    for _ in range(100):
        c.observe(16, 0.080)
    assert c.t(16) == pytest.approx(0.080, rel=0.02)
    c.observe(9, 0.2)
    assert c.t(9) > 0.035
    assert c.t(40) > c.t(16)  # extrapolated


class _ProfiledFake(FakeBackend):
    def __init__(self, path):
        super().__init__()
        self.model_path = str(path)
        self.n_batch = 64
        self.profiles = 0  # full profiles measured
        self.checks = 0  # quick checks of a cached profile (no long-context part)

    def profile(self, sizes, reps=3, long_ctx=1024):
        if long_ctx:
            self.profiles += 1
        else:
            self.checks += 1
        return [0.01 + 0.002 * n for n in sizes], 1e-6, 100


def test_cost_profile_is_cached_and_invalidated_when_the_model_file_changes(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("SRSD_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 64)
    be = _ProfiledFake(model)
    cfg = SRSDConfig(index_backend="numpy")
    a, name, key = load_cost_model(be, cfg)
    b, name2, _ = load_cost_model(be, cfg)
    assert be.profiles == 1 and a.to_dict() == b.to_dict() and name == name2
    assert be.checks == 1  # the cached profile was checked against the machine, and agreed
    assert machine_id() in key  # keyed by the machine as well as the model file
    load_cost_model(be, cfg.with_(n_threads=cfg.threads + 1))  # other thread count
    assert be.profiles == 2
    model.write_bytes(b"GGUF" + b"\1" * 80)  # the model file changed
    os.utime(model, ns=(1, 1))
    load_cost_model(be, cfg)
    assert be.profiles == 3


def test_engine_reports_controller_decisions():
    eng = Engine(FakeBackend(), SRSDConfig(index_backend="numpy"),
                 CostModel([1, 2, 33], [0.01, 0.012, 0.02]))
    res = eng.generate("the quick brown fox jumps over the lazy dog and the quick brown cat",
                       max_tokens=60, mode="srsd")
    s = res.stats
    assert len(s.tree_sizes) == s.steps - 1 and max(s.tree_sizes) > 1
    assert len(s.predicted_per_depth) >= 1
    assert all(0 <= p for p in s.predicted_per_depth)


def test_calibration_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("SRSD_CACHE_DIR", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 64)
    prompts = [SimpleNamespace(prompt="the quick brown fox jumps over the lazy dog the quick",
                               max_tokens=40),
               SimpleNamespace(prompt="a b c a b c a b", max_tokens=40)]

    class _Load:
        def __call__(self, **kw):
            be = FakeBackend()
            be.n_layer = 18
            return Engine(be, SRSDConfig(index_backend="numpy").with_(**kw))

    r1 = calibrate(_Load(), str(model), prompts, layers=[2, 4, 8])
    r2 = calibrate(_Load(), str(model), prompts, layers=[2, 4, 8])
    assert (r1["layer"], r1["top_k"], r1["draft_depth"]) == \
        (r2["layer"], r2["top_k"], r2["draft_depth"])
    assert r1["layer"] in (2, 4, 8) and set(r1["scores"]["layer"]) == {"2", "4", "8"}
    from srsd_local.engine.calibrate import load_calibration
    assert load_calibration(model) == {k: r1[k] for k in ("layer", "top_k", "draft_depth")}


def test_depth_calibration_corrects_systematic_underprediction():
    from srsd_local.spec.acceptance import DepthCalibration

    dc = DepthCalibration(depths=5)
    tree = _chain_tree(4)
    q = [1.0] + [0.6] * 4  # the node model says 0.6, 0.36, 0.22, 0.13 ...
    for _ in range(300):  # ... but every tree is accepted to the end
        plan = choose(tree, q, CostModel([1, 64], [0.001, 0.0011]).table(10), 4,
                      depth_scale=dc.scale())
        dc.update(plan.raw_probs[1:], plan.tree.depths[1:], accepted_depth=4)
    plan = choose(tree, q, CostModel([1, 64], [0.001, 0.0011]).table(10), 4,
                  depth_scale=dc.scale())
    assert plan.probs[1] > 0.95 and plan.probs[4] > 0.9
    # never more likely than the parent
    assert all(plan.probs[i] <= plan.probs[plan.tree.parents[i]] for i in range(1, 5))
    # and the other way: a depth that keeps failing is scaled down
    for _ in range(300):
        plan = choose(tree, q, CostModel([1, 64], [0.001, 0.0011]).table(10), 4,
                      depth_scale=dc.scale())
        dc.update(plan.raw_probs[1:], plan.tree.depths[1:], accepted_depth=0)
    assert dc.scale()[1] < 0.5


def test_depth_calibration_of_trees_deeper_than_its_depths_counts_each_deep_node():
    """Its last entry gathers every depth from there on: chains of 12 nodes accepted to the
    end, forecast right, keep that entry's scale at 1 (it once counted one accepted node
    against the forecasts of all nine deep ones, and cut such chains at its depth)."""
    from srsd_local.spec.acceptance import DepthCalibration

    dc = DepthCalibration(depths=5)
    tree = _chain_tree(12)
    for _ in range(300):
        dc.update([0.999] * 12, tree.depths[1:], accepted_depth=12)
    assert dc.scale()[4] == pytest.approx(1.0, abs=0.01)
    for _ in range(300):  # accepted up to depth 6: 3 of the 9 deep nodes (depths 4-12)
        dc.update([0.999] * 12, tree.depths[1:], accepted_depth=6)
    assert dc.scale()[4] == pytest.approx(1 / 3, abs=0.02)


def test_shipped_calibration_applies_only_to_the_default_model_file(tmp_path, monkeypatch):
    import json
    from importlib import resources

    from srsd_local.engine.calibrate import load_calibration, load_calibration_file

    monkeypatch.setenv("SRSD_CACHE_DIR", str(tmp_path / "cache"))
    shipped = json.loads(resources.files("srsd_local").joinpath(
        "data", "default_calibration.json").read_text())
    assert shipped["layer"] == 4 and shipped["acceptance"]
    same = tmp_path / shipped["model"]
    with same.open("wb") as f:
        f.truncate(shipped["model_size"])  # sparse: same name and size as the default model
    assert load_calibration(same) == {k: shipped[k] for k in ("layer", "top_k", "draft_depth")}
    assert load_calibration_file(same)["acceptance"]
    other = tmp_path / "other.gguf"
    with other.open("wb") as f:
        f.truncate(shipped["model_size"])
    assert load_calibration(other) is None
    with same.open("r+b") as f:
        f.truncate(1000)
    assert load_calibration(same) is None


def test_the_plan_verifies_exactly_the_nodes_it_scored():
    # four branches of equal promise; with max_branches=2 the planner may keep two of them
    tree = TokenTree(0)
    for b in range(4):
        tree.insert([10 + b, 20 + b, 30 + b], 1.0)
    q = [1.0] + [0.9] * (len(tree) - 1)
    cost = np.array([0.0] + [0.01 * (1 + 0.01 * n) for n in range(1, len(tree) + 1)])
    plan = choose(tree, q, cost, max_branches=2)
    leaves = [i for i in range(len(plan.tree)) if not plan.tree.children(i)]
    assert len(leaves) <= 2 and plan.tree.n_draft == 6  # both branches whole, nothing lost
    assert len(plan.probs) == len(plan.tree)
    assert plan.expected_accepted == pytest.approx(sum(plan.probs) - 1.0)


def test_prompt_chunk_size_keeps_the_pass_within_a_factor_of_its_cost():
    from srsd_local.spec.cost import CostModel

    cpu = CostModel([1, 2, 16], [0.010, 0.012, 0.050])  # each extra token ~0.27 plain steps
    assert cpu.largest_within(1, 2.0, 1, 100) == 3  # t(4) <= 0.02 < t(5)
    assert cpu.largest_within(1, 2.0, 16, 100) == 16  # never below the minimum
    gpu = CostModel([1, 2, 64], [0.010, 0.0101, 0.011])  # a batch is nearly free
    assert gpu.largest_within(8, 2.0, 16, 512) == 512
    assert cpu.largest_within(8, 2.0, 1, 100) < gpu.largest_within(8, 2.0, 1, 100)


class _FixedDrafter(Drafter):
    """Drafts the same paths at every step."""

    def __init__(self, config: SRSDConfig, paths: list[list[int]]) -> None:
        super().__init__(config)
        self.paths = paths

    def propose(self, inp: DraftInput) -> list:
        return [(np.asarray(p, dtype=np.int32), 1.0, 2) for p in self.paths]


def _outcomes(model: AcceptanceModel) -> tuple[float, float]:
    """(accepted, tried) summed over the coarse keys."""
    got = [v for k, v in model.counts.items() if len(k) == 4]
    return sum(a for a, _ in got), sum(n for _, n in got)


# a context in which the roots the tests draft after it follow its last token somewhere
# before (19 4, 6 9 and 4 5): a backed-off request drafts at every step the test allows
_CTX = np.array([19, 4, 6, 9, 4, 5, 16, 17, 18, 19], dtype=np.int32)


def _fixed_speculator(cost: CostModel) -> tuple[Speculator, np.ndarray]:
    for n, seconds in zip(cost.sizes[1:], cost.seconds[1:]):  # confirmed: no exploration
        cost.observe(int(n), float(seconds))
    cfg = SRSDConfig()
    spec = Speculator(cfg, cost=cost)
    spec.drafters["srsd"] = _FixedDrafter(cfg, [[5, 6, 7], [8]])
    return spec, _CTX.copy()


def test_nodes_of_a_declined_tree_are_learned_once_the_emitted_tokens_tell_their_outcome():
    def dear() -> CostModel:  # no tree pays: every plan is declined
        return CostModel([1, 2, 64], [0.010, 0.5, 5.0])

    spec, ctx = _fixed_speculator(dear())
    req = spec.begin("srsd", greedy=True)
    assert spec.propose(req, DraftInput(ctx, 4, None, None), room=8) is None
    assert _outcomes(spec.acceptance) == (0, 0)
    # the model emitted 4 (the root), 5, 6 and then 9: 5 and 6 would have been accepted,
    # 7 and 8 rejected
    req.skip = 0
    emitted = np.concatenate([ctx, [4, 5, 6]]).astype(np.int32)
    spec.propose(req, DraftInput(emitted, 9, None, None), room=8)
    assert _outcomes(spec.acceptance) == (2, 4)
    # where no token after the last followed node is known, its children are left out
    spec, ctx = _fixed_speculator(dear())
    req = spec.begin("srsd", greedy=True)
    spec.propose(req, DraftInput(ctx, 4, None, None), room=8)
    req.skip = 0
    spec.propose(req, DraftInput(np.append(ctx, 4).astype(np.int32), 5, None, None), room=8)
    assert _outcomes(spec.acceptance) == (1, 2)  # 5 accepted, 8 rejected, 6 unknown
    # sampled decoding accepts by chance: nothing is learned that way
    spec, ctx = _fixed_speculator(dear())
    req = spec.begin("srsd", greedy=False)
    spec.propose(req, DraftInput(ctx, 4, None, None), room=8)
    req.skip = 0
    spec.propose(req, DraftInput(emitted, 9, None, None), room=8)
    assert _outcomes(spec.acceptance) == (0, 0)


def test_verified_nodes_are_learned_once_and_the_rest_of_the_candidate_after():
    cheap = CostModel([1, 2, 64], [0.010, 0.0102, 0.011])
    spec, ctx = _fixed_speculator(cheap)
    spec.config = spec.config.with_(max_branches=1)  # the plan keeps one branch: 5 6 7
    req = spec.begin("srsd", greedy=True)
    plan = spec.propose(req, DraftInput(ctx, 4, None, None), room=8)
    assert plan is not None and plan.tree.tokens == [4, 5, 6, 7]
    spec.observe(req, plan, [0, 1, 2])  # 5 and 6 accepted, 7 rejected (9 came)
    assert _outcomes(spec.acceptance) == (2, 3)
    emitted = np.concatenate([ctx, [4, 5, 6]]).astype(np.int32)
    spec.propose(req, DraftInput(emitted, 9, None, None), room=8)
    assert _outcomes(spec.acceptance) == (2, 4)  # only 8, left out of the plan, is added


def test_a_sampled_request_backed_off_leaves_its_plain_steps_out_of_the_index():
    spec = Speculator(SRSDConfig())
    greedy, sampled = spec.begin("srsd", greedy=True), spec.begin("srsd", greedy=False)
    for req in (greedy, sampled):
        spec._back_off(req, False)
        spec._back_off(req, False)  # two declined plans: the next 2 steps skip drafting
        assert req.skip == 2
    assert spec.indexes(greedy) and not spec.indexes(sampled)
    assert spec.skips(sampled) and not spec.indexes(sampled)  # one more skip follows
    assert spec.skips(sampled) and spec.indexes(sampled)  # the next step drafts: its query
    assert not spec.indexes(spec.begin("ar", greedy=True))  # (no index at all)


def test_back_off_doubles_up_to_its_cap_and_a_verified_tree_resets_it():
    spec = Speculator(SRSDConfig())
    req = spec.begin("srsd", greedy=True)
    waits = []
    for _ in range(8):
        spec._back_off(req, False)
        waits.append(req.skip)
    assert waits == [1, 2, 4, 8, 16, 16, 16, 16] and MAX_SKIP == 16
    assert sum(spec.skips(req) for _ in range(20)) == 16  # each skipped step counts down
    spec._back_off(req, True)
    assert req.declined == 0 and req.skip == 0


class _CountingDrafter(_FixedDrafter):
    def __init__(self, config: SRSDConfig, paths: list[list[int]]) -> None:
        super().__init__(config, paths)
        self.calls = 0

    def propose(self, inp: DraftInput) -> list:
        self.calls += 1
        return super().propose(inp)


def test_a_backed_off_request_drafts_only_where_the_root_follows_the_last_token_before():
    dear = CostModel([1, 2, 64], [0.010, 0.5, 5.0])  # every plan is declined
    spec, _ = _fixed_speculator(dear)
    drafter = spec.drafters["srsd"] = _CountingDrafter(spec.config, [[5, 6, 7]])
    req = spec.begin("srsd", greedy=True)
    fresh = np.array([10, 11, 12, 13], dtype=np.int32)  # nothing in it is followed by 4
    assert spec.propose(req, DraftInput(fresh, 4, None, None), room=8) is None
    assert drafter.calls == 1 and req.declined == 1  # not backed off yet: drafted
    req.skip = 0
    assert spec.propose(req, DraftInput(fresh, 4, None, None), room=8) is None
    assert drafter.calls == 1  # backed off and 13 4 never occurred: no drafting
    assert req.declined == 2 and req.skip == 2  # ... counted as a declined attempt
    assert req.unverified is not None  # the declined tree's outcome is left for later
    req.skip = 0
    seen = np.array([13, 4, 11, 12, 13], dtype=np.int32)  # 13 4 occurred before
    spec.propose(req, DraftInput(seen, 4, None, None), room=8)
    assert drafter.calls == 2 and req.declined == 3
    # what an output constraint forces is drafted whatever the back-off
    req.skip = 0
    spec.propose(req, DraftInput(fresh, 4, None, None, forced=[5]), room=8)
    assert drafter.calls == 3
    # the gate is the srsd mode's: the n-gram mode drafts when its back-off has run out
    ngram = spec.begin("ngram", greedy=True)
    ngram.declined = 1
    spec.drafters["ngram"] = counted = _CountingDrafter(spec.config, [[5, 6, 7]])
    spec.propose(ngram, DraftInput(fresh, 4, None, None), room=8)
    assert counted.calls == 1


def test_exploring_stale_costs_gets_rarer_where_the_estimates_hold_until_a_surprise():
    cfg = SRSDConfig()
    # never confirmed by a step of their size: stale
    cost = CostModel([1, 2, 4, 8, 16, 32], [0.010, 0.018, 0.030, 0.045, 0.070, 0.140])
    spec = Speculator(cfg, cost=cost)
    spec.drafters["srsd"] = _FixedDrafter(cfg, [[5, 6, 7]])
    explored: list[int] = []
    table = cost.plan_table

    def spy(n_max: int, ctx: int | None = None, explore: bool = False):
        if explore:
            explored.append(cost.steps)
        return table(n_max, ctx, explore)

    cost.plan_table = spy  # type: ignore[method-assign]
    req = spec.begin("srsd", greedy=True)
    ctx = _CTX

    def run(steps: int) -> None:
        for _ in range(steps):
            req.skip = 0
            spec.propose(req, DraftInput(ctx, 4, None, None), room=8)
            cost.observe(1, 0.010)  # plain steps as fast as believed: no size confirmed

    run(1600)
    # the first plan explores, then every 100, 200, 400, 800 steps: nothing surprised
    assert np.diff(explored).tolist() == [100, 200, 400, 800], explored
    # a step far faster than believed: the next plans explore, then 50, 100, ... steps apart
    last = len(explored)
    cost.observe(1, 0.001)
    run(200)
    assert explored[last: last + 4] == [1601, 1602, 1603, 1604]
    assert np.diff(explored[last + 3:]).tolist() == [50, 100], explored[last:]


def _reference_plan_table(c: CostModel, n_max: int, ctx: int, explore: bool):
    """plan_table as its docstring defines it, one size at a time."""
    sec = c.seconds
    if explore:
        guess = sec[0] * (1.0 + 0.1 * (c.sizes - 1))
        sec = np.where(c.stale(), np.minimum(sec, guess), sec)
    sizes = c.sizes.tolist()
    size = []
    for n in range(n_max + 1):
        m = next((s for s in sizes if s >= n), n) if n >= 1 else 0
        size.append(m if m <= n_max else n)
    size = np.array(size)
    cost = c._base(size, sec) + c.per_kv * max(0, ctx - c.ctx0) * size
    best, at = cost.copy(), list(range(n_max + 1))
    for k in range(n_max - 1, 0, -1):  # the cheapest from k on, ties: the smallest size
        if cost[k] > best[k + 1]:
            best[k], at[k] = best[k + 1], at[k + 1]
    return best, size[at]


def test_plan_table_equals_its_definition_on_random_profiles():
    rng = np.random.default_rng(3)
    for trial in range(200):
        sizes = sorted({1, *rng.integers(2, 60, size=rng.integers(1, 12)).tolist()})
        secs = (0.01 * (1 + rng.random(len(sizes)) * np.array(sizes) * 0.3)).tolist()
        c = CostModel(sizes, secs, per_kv=float(rng.choice([0.0, 1e-6])), ctx0=100)
        for _ in range(int(rng.integers(0, 5))):  # confirm a few sizes: shapes change
            c.observe(int(rng.choice(sizes)), float(rng.uniform(0.005, 0.05)), 500)
        c.steps += int(rng.choice([0, 5000]))  # stale points for exploring
        n_max, ctx = int(rng.integers(1, 80)), int(rng.integers(0, 4000))
        for explore in (False, True):
            best, size = c.plan_table(n_max, ctx, explore)
            ref_best, ref_size = _reference_plan_table(c, n_max, ctx, explore)
            assert np.array_equal(size[1:], ref_size[1:]), (trial, explore)
            assert np.allclose(best[1:], ref_best[1:], rtol=1e-12, atol=0), (trial, explore)
        stale = c.stale()
        for n in (1, 4, 16, 64):
            assert c.can_explore(n) == bool(np.any(stale & (c.sizes <= n)))


def _reference_observe(c: CostModel, n: int, seconds: float, ctx: int) -> None:
    """CostModel.observe for a step of n > 1 tokens, written with numpy's interpolation
    (`_base`) and the bounds applied as arrays: the definition the plain-Python one
    follows."""
    c.steps += 1
    seconds = max(seconds - c.per_kv * n * max(0, ctx - c.ctx0), 1e-6) / c.scale
    view = c.seconds / c.scale
    idx = int(np.searchsorted(c.sizes, n))
    if idx < len(c.sizes) and c.sizes[idx] == n:
        points, err = [idx], seconds - view[idx]
    else:
        points = sorted({max(idx - 1, 0), min(idx, len(c.sizes) - 1)} - {0})
        err = seconds - float(c._base(np.array([n]), view)[0])
    for j in points:
        if seconds < view[j]:
            c.raw[j] = min(c.raw[j], view[j] + err)
            c.surprises += seconds < 0.8 * view[j]
        else:
            c.raw[j] = view[j] + c.alpha * err / len(points)
        c.raw[j] = max(c.raw[j], 1e-6)
        if c.sizes[j] == n:
            c.confirmed[j] = c.steps
    t = np.clip(c.raw, c.raw[0], c.raw[0] * c.sizes)
    cap = np.inf
    for k in range(len(t) - 1, -1, -1):  # unconfirmed: at most a confirmed bigger one
        if np.isfinite(c.confirmed[k]):
            cap = min(cap, t[k])
        else:
            t[k] = min(t[k], cap)
    c._shape, c._shape_list, c._t1, c._seconds = t, t.tolist(), float(t[0]), None


def test_step_corrections_follow_their_array_definition():
    rng = np.random.default_rng(11)
    for trial in range(100):
        sizes = sorted({1, *rng.integers(2, 40, size=rng.integers(1, 10)).tolist()})
        secs = (0.01 * (1 + rng.random(len(sizes)) * np.array(sizes) * 0.3)).tolist()
        a, b = (CostModel(sizes, secs, per_kv=1e-7, ctx0=100) for _ in range(2))
        for _ in range(30):
            n = int(rng.choice([1, *sizes, int(rng.integers(2, 60))]))
            sec, ctx = float(rng.uniform(0.002, 0.06)), int(rng.integers(0, 3000))
            a.observe(n, sec, ctx)
            if n == 1:
                b.observe(n, sec, ctx)
            else:
                _reference_observe(b, n, sec, ctx)
            np.testing.assert_allclose(a.raw, b.raw, rtol=1e-12, err_msg=str(trial))
            np.testing.assert_allclose(a.seconds, b.seconds, rtol=1e-12)
            assert np.array_equal(a.confirmed, b.confirmed) and a.surprises == b.surprises
            assert a.scale == b.scale


def test_a_chain_is_planned_as_the_general_tree_path_would():
    """choose takes a chain's nodes in path order without sorting (p never grows down a
    path; ties go to the shallower node): the order the general path sorts them into."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(2, 40))
        tree = _chain_tree(n - 1)
        q = [1.0] + rng.choice([0.3, 0.9, 1.0, 1.2], size=n - 1).tolist()  # ties, q > 1
        cost = np.cumsum(rng.uniform(0.001, 0.01, size=int(rng.integers(3, n + 4))))
        scale = rng.uniform(0.5, 2.0, 17).tolist()
        plan = choose(tree, q, cost, 4, depth_scale=scale)
        # the reference: every path probability, then the best prefix by expected tokens
        # per second, scored one size at a time (a bigger one only when strictly better)
        p_all, raw = [1.0], 1.0
        for i in range(1, n):
            raw *= q[i]
            p_all.append(min(p_all[-1], raw * scale[min(i, 16)], 1.0))
        order = sorted(range(1, n), key=lambda i: (-p_all[i], i))
        assert order == list(range(1, n))
        best_k, best_rate = 0, 1.0 / cost[1]
        for k in range(1, min(n, len(cost) - 1)):
            rate = (1.0 + sum(p_all[1:k + 1])) / cost[k + 1]
            if rate > best_rate * (1.0 + 1e-9):
                best_k, best_rate = k, rate
        assert plan.tree.tokens == tree.tokens[:best_k + 1]
        assert plan.probs == pytest.approx(p_all[:best_k + 1], rel=1e-12)


def test_q_all_equals_each_nodes_own_lookup_over_every_kind_of_key():
    # q_all computes each coarse key's part once for the whole tree: the numbers must be
    # q_both's, node by node, bit for bit, for every prior (grammar, analogy, list, copy,
    # plain sources), counted and uncounted keys alike
    import random

    from srsd_local.spec.acceptance import AcceptanceModel, NodeEvidence

    rng = random.Random(3)
    kinds = ["", "ngram", "srsd+text", "grammar", "analogy+text", "list", "copy"]
    nodes = [None] + [NodeEvidence(rng.randrange(1, 16), rng.random(), rng.random(),
                                   rng.randrange(1, 9), rng.randrange(0, 8), rng.random(),
                                   rng.choice(kinds)) for _ in range(300)]
    model = AcceptanceModel()
    for ev in nodes[1:150]:  # half the keys counted, some many times
        for _ in range(rng.randrange(1, 30)):
            model.update(ev, "srsd", True, rng.random() < 0.6)
    for greedy in (True, False):  # (counted as greedy: the sampled keys are all priors)
        means, explores = model.q_all(nodes, "srsd", greedy)
        assert (means, explores) == ([model.q_both(ev, "srsd", greedy)[0] for ev in nodes[1:]],
                                     [model.q_both(ev, "srsd", greedy)[1] for ev in nodes[1:]])
        assert len(set(means)) > (20 if greedy else 3)  # not one number throughout

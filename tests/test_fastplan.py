"""The compiled planner (spec/fastplan.py) against the Python one: the same nodes, the same
probabilities to the last bit, on random trees, counts, costs and depth calibrations."""

from __future__ import annotations

import json
import random

import pytest

from srsd_local.spec.acceptance import AcceptanceModel, LazyEvidence, evidence
from srsd_local.spec.draft import ORIGINS
from srsd_local.spec.fastplan import compiled_planner
from srsd_local.spec.planner import choose
from srsd_local.spec.tree import TokenTree

planner = compiled_planner()
needs_build = pytest.mark.skipif(planner is None, reason="no C compiler for the kernels")
BITS = list(ORIGINS)


def random_tree(rng: random.Random, chain: bool) -> TokenTree:
    t = TokenTree(rng.randrange(50))
    for _ in range(1 if chain else rng.randint(1, 6)):
        path = [rng.randrange(6) for _ in range(rng.randint(1, 20))]
        origin = 0 if rng.random() < 0.05 else sum(rng.sample(BITS, rng.randint(1, 3)))
        t.insert(path, rng.choice([0.1, 0.35, 0.5, 0.62, 0.8, 0.95, 1.0, 3.0]),
                 rng.randint(0, 8), origin)
    return t


def trained_model(rng: random.Random, greedy: bool) -> AcceptanceModel:
    m = AcceptanceModel()
    for _ in range(rng.randint(0, 400)):
        t = random_tree(rng, rng.random() < 0.3)
        ev = evidence(t, rng.choice([0.1, 0.25, 0.5, 0.8, 0.95]))
        for e in ev[1:]:
            m.update(e, rng.choice(["srsd", "ngram"]), greedy if rng.random() < 0.8 else
                     not greedy, rng.random() < 0.6)
    return m


def python_plan(t, m, mode, greedy, recent, cost, branches, scale, gain):
    ev = evidence(t, recent)
    means, explores = m.q_all(ev, mode, greedy)
    return choose(t, [1.0, *explores], cost, branches, [1.0, *means], scale, ev, gain)


def same(a, b) -> None:
    assert a.tree.tokens == b.tree.tokens and a.tree.parents == b.tree.parents
    assert a.source == b.source
    assert a.probs == b.probs and a.raw_probs == b.raw_probs  # bit for bit
    assert a.expected_accepted == b.expected_accepted
    assert [None if e is None else (e.depth, e.share, e.strength, e.agree, e.origin)
            for e in a.evidence] == [None if e is None else (e.depth, e.share, e.strength,
                                                              e.agree, e.origin)
                                     for e in b.evidence]


@needs_build
@pytest.mark.parametrize("seed", range(40))
def test_compiled_plan_equals_the_python_plan(seed: int) -> None:
    rng = random.Random(seed)
    greedy = rng.random() < 0.7
    m = trained_model(rng, greedy)
    if seed % 5 == 0:  # counts as stored and read back (seeded, fractional)
        m2 = AcceptanceModel()
        m2.seed(json.loads(json.dumps(m.to_json())))
        m = m2
    chosen_sizes = set()
    for _ in range(30):
        t = random_tree(rng, rng.random() < 0.3)
        n_max = rng.randint(1, len(t) + 4)
        first = rng.uniform(0.5, 2.0)
        cost = [0.0] + [first * (1 + rng.uniform(0.0, 0.2) * k) for k in range(n_max + 1)]
        for k in range(2, len(cost)):
            cost[k] = max(cost[k], cost[k - 1])
        scale = [rng.choice([0.2, 0.8, 1.0, 1.3, 10.0]) for _ in range(rng.randint(1, 17))]
        mode = rng.choice(["srsd", "ngram", "retrieval"])
        recent = rng.choice([0.0, 0.25, 0.3, 0.5, 0.75, 0.9, 1.0])
        branches, gain = rng.randint(1, 8), rng.choice([0.0, 0.0, 1.5, 4.0])
        want = python_plan(t, m, mode, greedy, recent, cost, branches, scale, gain)
        got = planner.choose(t, m, mode, greedy, LazyEvidence(t, recent), cost, branches,
                             scale, gain)
        same(got, want)
        chosen_sizes.add(got.tree.n_draft)
    assert len(chosen_sizes) > 2  # plain steps and trees of several sizes were compared


@needs_build
def test_tables_follow_the_counts_through_halving_and_clearing() -> None:
    rng = random.Random(7)
    m = AcceptanceModel(horizon=5)
    t = random_tree(rng, False)
    for _ in range(20):  # past the horizon: counts halve
        for e in evidence(t, 0.5)[1:]:
            m.update(e, "srsd", True, rng.random() < 0.5)
    cost = [0.0, 1.0] + [1.0 + 0.01 * k for k in range(1, len(t) + 1)]
    same(planner.choose(t, m, "srsd", True, LazyEvidence(t, 0.5), cost, 4, [1.0]),
         python_plan(t, m, "srsd", True, 0.5, cost, 4, [1.0], 0.0))
    m.clear()
    assert not m.counts
    same(planner.choose(t, m, "srsd", True, LazyEvidence(t, 0.5), cost, 4, [1.0]),
         python_plan(t, m, "srsd", True, 0.5, cost, 4, [1.0], 0.0))


def test_lazy_evidence_equals_the_evidence_list() -> None:
    rng = random.Random(3)
    t = random_tree(rng, False)
    full, lazy = evidence(t, 0.8), LazyEvidence(t, 0.8)
    assert len(lazy) == len(full) and list(lazy) == full and lazy[-1] == full[-1]
    nodes = [0, 3, 1]
    assert list(lazy.picked(nodes)) == [full[i] for i in nodes]
    with pytest.raises(IndexError):
        lazy[len(t)]


def test_keys_of_another_shape_stay_in_the_counts_only() -> None:
    m = AcceptanceModel()
    m.load_json([[["srsd", True, 3], [1, 2]], [["srsd", True, 99, 0], [1, 2]],
                 [["srsd", True, 3, 2], [4, 5]]])
    assert len(m.counts) == 3
    at = m.tables._offset(("srsd", True, 3, 2))
    assert at is not None and m.tables.coarse[at: at + 2].tolist() == [4.0, 5.0]
    assert m.tables._offset(("srsd", True, 3)) is None
    assert m.tables._offset(("srsd", True, 99, 0)) is None


@needs_build
@pytest.mark.parametrize("seed", range(8))
def test_compiled_learning_counts_what_the_python_counts(seed: int) -> None:
    rng = random.Random(100 + seed)
    fast, slow = AcceptanceModel(horizon=rng.choice([6, 2000])), AcceptanceModel()
    slow.horizon = fast.horizon
    if seed % 2:  # both start from the same stored counts
        data = json.loads(json.dumps(trained_model(rng, True).to_json()))
        fast.load_json(data)
        slow.load_json(data)
    for step in range(60):
        t = random_tree(rng, rng.random() < 0.3)
        recent = rng.choice([0.1, 0.5, 0.8])
        cost = [0.0] + [1.0 + 0.02 * k for k in range(len(t) + 1)]
        lazy = LazyEvidence(t, recent)
        got = planner.choose(t, fast, "srsd", True, lazy, cost, 4, [1.0])
        want = python_plan(t, slow, "srsd", True, recent, cost, 4, [1.0], 0.0)
        same(got, want)
        # outcomes for some nodes of the candidate and of the plan's sub-tree
        nodes = sorted(rng.sample(range(1, len(t)), rng.randint(0, len(t) - 1)))
        acc = [rng.random() < 0.5 for _ in nodes]
        planner.learn(fast, lazy, nodes, acc)
        full = evidence(t, recent)
        for i, a in zip(nodes, acc):
            slow.update(full[i], "srsd", True, a)
        sub = list(range(1, len(got.tree)))
        planner.learn(fast, got.evidence, sub, [True] * len(sub))
        for j in sub:
            slow.update(want.evidence[j], "srsd", True, True)
        if step % 20 == 0:  # the dict read in the middle: what came before is written in
            assert fast.counts == slow.counts
    assert fast.counts == slow.counts and len(fast.counts) > 10


@needs_build
def test_a_copied_model_and_planner_plan_on_their_own_buffers() -> None:
    import copy
    rng = random.Random(11)
    m = trained_model(rng, True)
    twin, planner2 = copy.deepcopy(m), copy.deepcopy(planner)
    assert twin.tables.addresses != m.tables.addresses
    assert twin.tables.addresses[0] == twin.tables.coarse.buffer_info()[0]
    t = random_tree(rng, False)
    cost = [0.0] + [1.0 + 0.02 * k for k in range(len(t) + 1)]
    lazy = LazyEvidence(t, 0.5)
    same(planner2.choose(t, twin, "srsd", True, lazy, cost, 4, [1.0]),
         python_plan(t, m, "srsd", True, 0.5, cost, 4, [1.0], 0.0))
    planner2.learn(twin, lazy, list(range(1, len(t))), [True] * (len(t) - 1))
    assert twin.counts != m.counts  # the copy learned; the original did not
    assert m.counts == trained_model(random.Random(11), True).counts


@needs_build
@pytest.mark.model
def test_on_the_real_model_every_plan_equals_the_python_plan(engine, monkeypatch) -> None:
    """A real generation (an edit, the default mode): each candidate tree the compiled
    planner plans is planned by the Python planner too, on the same counts, with the same
    result; what the compiled learner counted is in the counts dict afterwards."""
    from text_data import edit_prompt  # noqa: PLC0415

    spec = engine.speculator
    fast = spec._compiled
    assert fast is not None
    compared = []
    inner = fast.choose

    def both(tree, model, source, greedy, ev, cost, branches, scale, gain=0.0):
        want = python_plan(tree, model, source, greedy, ev.recent, cost, branches, scale,
                           gain)
        got = inner(tree, model, source, greedy, ev, cost, branches, scale, gain)
        same(got, want)
        compared.append(got.tree.n_draft)
        return got

    monkeypatch.setattr(fast, "choose", both)
    engine.reset()
    before = {k: list(v) for k, v in spec.acceptance.counts.items()}
    out = engine.generate(edit_prompt(), max_tokens=96, mode="srsd")
    assert out.stats.tokens > 20 and len(compared) >= 3 and max(compared) > 0
    counts = spec.acceptance.counts
    assert counts != before  # the verified trees were learned from
    tables = spec.acceptance.tables
    for key, value in counts.items():
        at = tables._offset(key)
        if at is not None:
            table, i = (tables.coarse, at) if at >= 0 else (tables.fine, ~at)
            assert [table[i], table[i + 1]] == [float(v) for v in value], key

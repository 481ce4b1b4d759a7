"""Copy runs: a tree accepted to its leaf is followed by the context's continuation of the
copy, as one chain, without drafting; a divergence ends the run."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FakeBackend

from srsd_local.config import SRSDConfig
from srsd_local.engine import Engine
from srsd_local.spec import speculator as speculator_module
from srsd_local.spec.copyrun import chain, continues, find_copy
from srsd_local.spec.cost import CostModel
from srsd_local.spec.draft import COPY
from srsd_local.spec.speculator import SEARCH, Speculator
from srsd_local.spec.tree import TokenTree


def _ctx(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def test_the_most_recent_copy_after_the_same_tokens_is_found():
    # 1 2 3 4 | 9 | 1 2 3 4 | 7 8 | 1 2 3 4 ; root 7: the copy at position 9 (7 after 1 2 3 4)
    ctx = _ctx(1, 2, 3, 4, 9, 1, 2, 3, 4, 7, 8, 1, 2, 3, 4)
    assert find_copy(ctx, 7, match=4) == 9
    assert find_copy(ctx, 9, match=4) == 4
    assert find_copy(ctx, 5, match=4) is None  # the root never follows those tokens
    # the tokens before the root must match the context's end: 7 follows 3 4, not 2 3 4 0
    assert find_copy(_ctx(2, 3, 4, 7, 1, 0, 3, 4), 7, match=3) is None
    assert find_copy(_ctx(2, 3, 4, 7, 1, 0, 3, 4), 7, match=2) == 3
    assert find_copy(_ctx(5, 6, 5, 6, 5), 6, match=1) == 3
    # the last position holds nothing after it to draft: not a copy (6 after 6 only there)
    assert find_copy(_ctx(7, 5, 6, 6), 6, match=1) is None
    assert find_copy(_ctx(1), 1) is None


def test_a_chain_copies_the_context_and_a_source_that_reaches_the_end_repeats():
    ctx = _ctx(9, 8, 7, 6, 5, 1, 2, 3, 4, 9, 8, 7)
    assert chain(ctx, 6, 3, 4) == [5, 1, 2, 3]
    # period 9: positions 4..11, then the root (6), then the chain again
    assert chain(ctx, 6, 3, 10) == [5, 1, 2, 3, 4, 9, 8, 7, 6, 5]
    rep = _ctx(0, 1, 2, 1, 2, 1, 2)  # period 2: "1 2" repeated, root 1
    assert chain(rep, 1, 5, 5) == [2, 1, 2, 1, 2]
    assert continues(rep, 1, 5) and not continues(rep, 2, 5) and not continues(rep, 1, 6)


def _confirmed(costs: list[float]) -> CostModel:
    """A cost model whose every size was seen at its estimate (no exploratory plans)."""
    cost = CostModel([1, 2, 64], costs)
    for n, t in zip((1, 2, 64), costs):
        cost.observe(n, t)
    return cost


def _cheap() -> CostModel:
    return _confirmed([0.010, 0.0102, 0.011])


def _tree(root: int, tokens: list[int]) -> TokenTree:
    t = TokenTree(root)
    t.insert(tokens, 1.0)
    return t


def _plan_of(spec: Speculator, req, tree: TokenTree):
    return spec._decide(tree, req, 16, 100, 0, 0.0)


def test_a_tree_accepted_to_its_leaf_is_followed_by_the_copy_it_came_from(monkeypatch):
    spec = Speculator(SRSDConfig(), cost=_cheap())
    req = spec.begin("srsd", greedy=True)
    # the context: 10 11 12 13 14 15 16 17 18 19 | 20 21 | 10 .. 15 ; a tree 16 17 accepted
    # to its leaf, 18 came next: the output copies positions 6.. of the context
    body = list(range(10, 20))
    plan = _plan_of(spec, req, _tree(15, [16, 17]))
    assert plan is not None
    spec.observe(req, plan, [0, 1, 2])
    assert req.copy_at == SEARCH
    ctx = _ctx(*body, 20, 21, *range(10, 18))
    got = spec.follow(req, ctx, 18, room=16)
    assert got is not None and got.copy_from == 8
    assert got.tree.tokens[:3] == [18, 19, 20] and got.tree.origin[1] & COPY
    # accepted to its leaf again: the run goes on at the next position, no search
    monkeypatch.setattr(speculator_module, "find_copy",
                        lambda *a, **k: pytest.fail("a run in progress searched"))
    n_nodes = len(got.tree)
    spec.observe(req, got, list(range(n_nodes)))
    assert req.copy_at == 8 + n_nodes
    longer = np.concatenate([ctx, got.tree.tokens]).astype(np.int32)
    nxt = spec.follow(req, longer, int(longer[req.copy_at]), room=4)
    assert nxt is not None and nxt.copy_from == 8 + n_nodes
    # a divergence (the model took another token before the leaf) ends the run
    spec.observe(req, nxt, [0, 1])
    assert req.copy_at is None
    assert spec.follow(req, longer, 3, room=4) is None


def test_only_the_default_mode_follows_and_only_under_its_controller():
    ctx = _ctx(*range(10, 20), 20, *range(10, 18))  # root 18: copies position 8 on
    for mode, adaptive in (("ngram", True), ("retrieval", True), ("srsd", False)):
        spec = Speculator(SRSDConfig(adaptive=adaptive), cost=_cheap())
        req = spec.begin(mode, greedy=True)
        req.copy_at = SEARCH
        assert spec.follow(req, ctx, 18, room=8) is None, mode
    spec = Speculator(SRSDConfig(), cost=_cheap())
    req = spec.begin("srsd", greedy=True)
    assert spec.follow(req, ctx, 18, room=8) is None  # not in a run
    req.copy_at = SEARCH
    assert spec.follow(req, ctx, 18, room=0) is None  # no room
    req.copy_at = SEARCH
    assert spec.follow(req, ctx, 18, room=8) is not None  # (the same, in a run, with room)


def test_a_declined_chain_backs_off_and_copy_chains_are_calibrated_apart():
    dear = _confirmed([0.010, 0.5, 5.0])  # no tree pays
    spec = Speculator(SRSDConfig(), cost=dear)
    req = spec.begin("srsd", greedy=True)
    req.copy_at = SEARCH
    run = _ctx(*range(10, 20), 20, *range(10, 18))  # root 18: copies position 8 on
    assert spec.follow(req, run, 18, room=8) is None
    assert req.skip > 0 and req.copy_at is None
    spec = Speculator(SRSDConfig(), cost=_cheap())
    req = spec.begin("srsd", greedy=True)
    req.copy_at = SEARCH
    plan = spec.follow(req, run, 18, room=8)
    spec.observe(req, plan, list(range(len(plan.tree))))
    merged = _plan_of(spec, req, _tree(5, [6, 7]))
    spec.observe(req, merged, [0])
    copy_dc = spec.depth_calibration[("srsd", True, True)]
    merged_dc = spec.depth_calibration[("srsd", True, False)]
    assert copy_dc.act[1] > merged_dc.act[1]  # accepted in the chain, rejected in the tree


def test_copy_runs_on_the_fake_emit_what_plain_decoding_emits():
    """The fake model copies: greedy, its runs are followed chain after chain; greedy and
    seeded sampling, the output equals plain decoding's with and without copy runs."""
    prompt = "the quick brown fox jumps over the lazy dog and the quick brown cat " * 2

    def engine() -> Engine:
        return Engine(FakeBackend(), SRSDConfig(index_backend="numpy", n_ctx=512))

    for kw in (dict(), dict(temperature=1.0, seed=3)):
        plain = engine().generate(prompt, max_tokens=80, mode="ar", **kw)
        eng = engine()
        chains: list[int] = []
        follow = eng.speculator.follow

        def spy(*a, _follow=follow, _chains=chains, **k):
            plan = _follow(*a, **k)
            if plan is not None:
                _chains.append(len(plan.tree) - 1)
            return plan

        eng.speculator.follow = spy
        out = eng.generate(prompt, max_tokens=80, mode="srsd", **kw)
        assert out.token_ids == plain.token_ids, kw
        if not kw:  # (sampled, the fake's noise rarely lets a tree reach its leaf)
            assert sum(chains) >= 40 and max(chains) >= 8, chains
        off = engine()
        off.speculator.follow = lambda *a, **k: None
        ref = off.generate(prompt, max_tokens=80, mode="srsd", **kw)
        assert ref.token_ids == plain.token_ids


def _find_copy_reference(tokens: np.ndarray, root: int, match: int) -> int | None:
    """find_copy's definition, position by position."""
    n = len(tokens)
    m = min(match, n - 2)
    if m < 1:
        return None
    for c in range(n - 2, m - 1, -1):
        if tokens[c] == root and all(tokens[c - k] == tokens[n - k] for k in range(1, m + 1)):
            return c
    return None


def test_find_copy_equals_its_definition_on_random_contexts():
    """The bytes search finds what a position-by-position check finds (the most recent
    copy, never one whose bytes straddle token boundaries) on small alphabets, where
    matches are many, and on token ids whose bytes repeat across boundaries."""
    rng = np.random.default_rng(7)
    for trial in range(400):
        n = int(rng.integers(1, 60))
        vocab = [3, 5, 40][trial % 3]
        toks = rng.integers(0, vocab, n).astype(np.int32)
        if trial % 4 == 0:  # ids like 0x01010101 and 0x00000101: byte patterns that repeat
            toks = np.where(toks % 2 == 0, 0x01010101, 0x00000101).astype(np.int32)
        root = int(toks[int(rng.integers(0, n))]) if trial % 5 else int(rng.integers(0, vocab))
        for match in (1, 2, 4, 8):
            assert find_copy(toks, root, match) == _find_copy_reference(toks, root, match), \
                (toks.tolist(), root, match)


def test_a_found_copy_weighs_what_the_requests_found_copies_paid():
    # a chain from a copy found by matching the last tokens carries the request's record of
    # such chains (below a followed run's 1.0); the record follows their accepted shares, so
    # a request whose found copies keep failing drafts them weaker, then not at all for a
    # while (the step drafts as usual), and one whose copies hold, stronger; each on its own
    # (keys of the acceptance model apart from runs' chains)
    from srsd_local.spec.acceptance import LazyEvidence
    from srsd_local.spec.speculator import FOUND_COPY_MAX, FOUND_COPY_SKIP, FOUND_COPY_START

    run = _ctx(*range(10, 30), 40, *range(10, 18))  # root 18: copies position 8 on
    spec = Speculator(SRSDConfig(), cost=_cheap())
    failing, holding = spec.begin("srsd", greedy=True), spec.begin("srsd", greedy=True)
    weights = {id(failing): [], id(holding): []}
    for _ in range(4):
        for req in (failing, holding):
            req.copy_at = SEARCH
            plan = spec.follow(req, run, 18, room=8)
            if req is failing and req.found_copies < FOUND_COPY_SKIP:
                assert plan is None and req.copy_at is None  # passed up: drafting as usual
                continue
            assert plan is not None and plan.found_copy and plan.copy_from == 8
            w = plan.tree.weights[1]
            assert w == min(FOUND_COPY_MAX, req.found_copies) < 1.0
            assert all(x == w for x in plan.tree.weights[1:])
            weights[id(req)].append(w)
            k = 1 if req is failing else len(plan.tree)  # the root alone, or every node
            spec.observe(req, plan, list(range(k)))
    low, high = weights[id(failing)], weights[id(holding)]
    assert low[0] == high[0] == FOUND_COPY_START and len(low) >= 2
    assert all(b < a for a, b in zip(low, low[1:]))  # falls with each failed chain
    assert high[-1] == FOUND_COPY_MAX and all(b >= a for a, b in zip(high, high[1:]))
    # the strength features set the two requests' chains apart for the acceptance model
    ev_low = LazyEvidence(_chain_tree(18, low[-1]), 0.5)[1]
    ev_high = LazyEvidence(_chain_tree(18, high[-1]), 0.5)[1]
    assert ev_low.keys("srsd", True)[1] != ev_high.keys("srsd", True)[1]
    # each found copy passed up brings the record back: the request tries them again
    passed = 0
    while failing.found_copies < FOUND_COPY_SKIP:
        failing.copy_at = SEARCH
        assert spec.follow(failing, run, 18, room=8) is None
        passed += 1
        assert passed < 20
    failing.copy_at = SEARCH
    again = spec.follow(failing, run, 18, room=8)
    assert again is not None and again.found_copy and passed >= 1
    # a run being followed (its position known) is not a found copy: weight 1.0, no record
    req = spec.begin("srsd", greedy=True)
    req.copy_at = 9  # position 9 holds 19, the root
    plan = spec.follow(req, run, 19, room=8)
    assert plan is not None and not plan.found_copy and plan.tree.weights[1] == 1.0
    spec.observe(req, plan, [0])
    assert req.found_copies == FOUND_COPY_START


def _chain_tree(root: int, weight: float) -> TokenTree:
    t = TokenTree(root)
    t.insert([1, 2, 3], weight, 8, COPY)
    return t

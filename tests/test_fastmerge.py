"""The compiled merge (spec/fastmerge.py) against TokenTree's Python insert and prune: the
same nodes, numbering, statistics and weights to the last bit, on random drafts and budgets,
through Drafter.draft (grammar-forced drafts included) and on a real generation."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from srsd_local.config import SRSDConfig
from srsd_local.spec.draft import GRAMMAR, ORIGINS, Drafter, DraftInput
from srsd_local.spec.fastmerge import compiled_merger
from srsd_local.spec.tree import TokenTree

merger = compiled_merger()
needs_build = pytest.mark.skipif(merger is None, reason="no C compiler for the kernels")
BITS = list(ORIGINS)


def random_drafts(rng: random.Random, depth: int) -> list[tuple[list[int], float, int, int]]:
    alphabet = rng.randint(2, 8)  # few tokens: drafts share prefixes, siblings compete
    out = []
    for _ in range(rng.randint(0, 9)):
        path = [rng.randrange(alphabet) for _ in range(rng.randint(1, depth))]
        weight = rng.choice([0.1, 0.5, 0.5, 1.0, 1.0 / 3.0, rng.random(), 3.0])
        out.append((path, weight, rng.randint(0, 8), rng.choice(BITS)))
    return out


def python_tree(root, drafts, max_nodes, max_depth, max_branches) -> TokenTree:
    t = TokenTree(root)
    for path, weight, agree, origin in drafts:
        t.insert(path, weight, agree, origin)
    if t.n_draft > max_nodes or max(t.depths) > max_depth or t.n_leaves() > max_branches:
        t = t.prune(max_nodes, max_depth, max_branches)
    return t


def same(a: TokenTree, b: TokenTree) -> None:
    assert a.tokens == b.tokens and a.parents == b.parents and a.depths == b.depths
    assert a.weights == b.weights  # bit for bit: the same sums in the same order
    assert a.counts == b.counts and a.agree == b.agree and a.origin == b.origin
    assert [list(k.items()) for k in a._children] == [list(k.items()) for k in b._children]


@needs_build
@pytest.mark.parametrize("seed", range(60))
def test_compiled_merge_equals_insert_and_prune(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.choice([1, 3, 8, 16])
    drafts = random_drafts(rng, depth)
    nodes, branches = rng.choice([1, 4, 12, 32, 255]), rng.choice([1, 2, 3, 8, 255])
    cut = rng.choice([depth, max(1, depth - 2)])  # also deeper drafts than the limit
    want = python_tree(7, drafts, nodes, cut, branches)
    got = merger.merge(7, drafts, nodes, cut, branches)
    same(got, want)
    if len(got) > 1:  # the tree works as any other: layout, child lookup, pruning again
        assert got.layout().n_branches == want.layout().n_branches
        same(got.prune(2, cut, 1), want.prune(2, cut, 1))


@needs_build
def test_the_untouched_trie_and_a_pruned_one_both_come_back() -> None:
    drafts = [([1, 2, 3], 1.0, 2, 1), ([1, 2, 4], 0.5, 3, 2), ([5], 0.25, 0, 16)]
    whole = merger.merge(0, drafts, 8, 16, 8)
    same(whole, python_tree(0, drafts, 8, 16, 8))
    assert whole.origin[0] == 1 | 2 | 16 and whole.n_draft == 5  # as inserted
    pruned = merger.merge(0, drafts, 3, 16, 8)
    assert pruned.tokens == [0, 1, 2, 3] and pruned.origin[0] == 0  # as prune makes it
    assert merger.merge(0, [], 8, 16, 8).n_draft == 0
    big = [(list(range(i, i + 200)), 1.0, 0, 1) for i in range(3)]  # past the buffers
    same(merger.merge(0, big, 255, 255, 8), python_tree(0, big, 255, 255, 8))


class _Fixed(Drafter):
    """A source with fixed drafts (numpy and list paths, longer than the depth limit)."""

    origin = 4

    def __init__(self, config, drafts) -> None:
        super().__init__(config)
        self.drafts = drafts

    def propose(self, inp):
        return self.drafts


@needs_build
@pytest.mark.parametrize("seed", range(20))
def test_draft_is_the_same_tree_compiled_and_in_python(seed: int) -> None:
    rng = random.Random(100 + seed)
    cfg = SRSDConfig(draft_depth=rng.choice([4, 16]), max_nodes=rng.choice([6, 32]),
                     max_branches=rng.choice([2, 8]))
    drafts = [(np.asarray(p + p, dtype=np.int32) if rng.random() < 0.5 else p + p, w, a)
              for p, w, a, _ in random_drafts(rng, 12)]
    drafts.append(([], 1.0, 0))  # an empty draft is left out
    forced = [rng.randrange(4) for _ in range(rng.randint(0, 20))]
    inp = DraftInput(np.zeros(3, np.int32), 9, None, None, forced=forced)
    fast, slow = _Fixed(cfg, drafts), _Fixed(cfg, drafts)
    slow._merger = None  # the Python path
    got, want = fast.draft(inp, max_nodes=cfg.max_nodes - 1), slow.draft(
        inp, max_nodes=cfg.max_nodes - 1)
    same(got, want)
    assert fast._merger is not None
    if forced:
        assert any(o & GRAMMAR for o in got.origin)
    twin = copy.deepcopy(fast)  # a copy merges on buffers of its own
    assert twin._merger is not fast._merger and twin._merger._trie is not fast._merger._trie
    same(twin.draft(inp, max_nodes=cfg.max_nodes - 1), want)


@needs_build
@pytest.mark.model
def test_on_the_real_model_every_draft_merges_as_in_python(engine, monkeypatch) -> None:
    """A real generation (an edit, the default mode): each drafting attempt's drafts are
    merged by the Python insert and prune too, with the same tree."""
    from text_data import edit_prompt  # noqa: PLC0415

    drafter = engine.speculator.drafters["srsd"]
    compared = []
    real_draft = Drafter.draft

    def both(self, inp, max_nodes=None):
        got = real_draft(self, inp, max_nodes)
        kept, self._merger = self._merger, None
        try:
            want = real_draft(self, inp, max_nodes)
        finally:
            self._merger = kept
        same(got, want)
        compared.append(got.n_draft)
        return got

    # (the Python path runs the sources again: only the pure ones may be compared)
    monkeypatch.setattr(drafter, "tagged", _once(drafter.tagged))
    monkeypatch.setattr(Drafter, "draft", both)
    engine.reset()
    out = engine.generate(edit_prompt(), max_tokens=96, mode="srsd")
    assert out.stats.tokens > 20 and len(compared) >= 3 and max(compared) > 0
    assert drafter._merger is not None


def _once(tagged):
    """`tagged` whose second call with the same input returns the first call's drafts (the
    n-gram pool and text lookup keep state between calls)."""
    last: list = [None, None]

    def call(inp):
        if last[0] is not inp:
            last[0], last[1] = inp, tagged(inp)
        return last[1]
    return call

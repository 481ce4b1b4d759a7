"""Output constraints, the pure logic: constrained sampling over a mask, the tree filter, the
forced-draft path, whitespace style, schema checks and the workload field (no model)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from srsd_local.config import SamplingParams, SRSDConfig
from srsd_local.llama.grammar import ConstraintSpec, GrammarError, SpaceStyle
from srsd_local.prompts import parse_line
from srsd_local.spec.draft import GRAMMAR, Drafter, DraftInput
from srsd_local.spec.sampling import (
    CUTOFF,
    ConstrainedSampler,
    DeadEndError,
    best_allowed,
    distribution,
)
from srsd_local.spec.tree import TokenTree


class SetConstraint:
    """Admits a fixed set of token ids; records what it accepted and how many were checked."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed
        self.accepted: list[int] = []
        self.checked = 0

    def mask(self, ids: np.ndarray) -> np.ndarray:
        self.checked += len(ids)
        return np.asarray([int(i) in self.allowed for i in ids], dtype=bool)

    def accept(self, token: int) -> None:
        assert token in self.allowed, "a rejected token was accepted"
        self.accepted.append(token)


def test_best_allowed_is_the_masked_argmax_and_checks_few_when_the_top_is_allowed():
    rng = np.random.default_rng(0)
    x = rng.normal(size=5000).astype(np.float32)
    order = np.argsort(-x)
    c = SetConstraint({int(order[0])})
    assert best_allowed(x, c) == order[0]
    assert c.checked == 1
    for rank in (1, 7, 300, 4999):  # the best admitted token lies deeper and deeper
        allowed = {int(t) for t in order[rank:]}
        c = SetConstraint(allowed)
        assert best_allowed(x, c) == order[rank]
        masked = np.where(np.isin(np.arange(len(x)), list(allowed)), x, -np.inf)
        assert best_allowed(x, SetConstraint(allowed)) == int(np.argmax(masked))


@pytest.mark.parametrize("rank", [5000, 20000, 70000, 262000])
def test_best_allowed_far_down_a_full_vocabulary_with_ties(rank):
    # a 262k vocabulary whose logits tie in large groups; the only admitted tokens lie
    # beyond the band around the top, so the rest is searched in its best-first chunks
    rng = np.random.default_rng(rank)
    x = (np.round(rng.normal(size=262144) * 8) / 2).astype(np.float32)
    order = np.lexsort((np.arange(len(x)), -x))  # best first, ties by the lowest id
    allowed = {int(t) for t in rng.choice(order[rank:], size=50, replace=False)}
    allowed.add(int(order[rank]))
    c = SetConstraint(allowed)
    masked = np.full_like(x, -np.inf)
    masked[list(allowed)] = x[list(allowed)]
    assert best_allowed(x, c) == int(np.argmax(masked)) == int(order[rank])
    if rank < 20000:  # found within the 4096 best of the rest, which alone were checked
        assert c.checked < 4096 + 4096 + 1


class NarrowingConstraint(SetConstraint):
    """A SetConstraint that can also name a superset of what it admits (as a grammar does
    from its next characters)."""

    def __init__(self, allowed: set[int], superset: np.ndarray | None) -> None:
        super().__init__(allowed)
        self.superset = superset

    def possible(self) -> np.ndarray | None:
        return self.superset


@pytest.mark.parametrize("rank", [300, 20000, 262000])
def test_best_allowed_searches_only_the_superset_a_constraint_names(rank):
    """Past the band's best, only the named superset is checked, best first with ties by
    the lowest id; the answer is the brute-force masked argmax."""
    rng = np.random.default_rng(rank)
    x = (np.round(rng.normal(size=262144) * 8) / 2).astype(np.float32)
    order = np.lexsort((np.arange(len(x)), -x))
    allowed = {int(t) for t in rng.choice(order[rank:], size=30, replace=False)}
    allowed.add(int(order[rank]))
    superset = np.union1d(list(allowed), rng.choice(len(x), size=3000, replace=False))
    c = NarrowingConstraint(allowed, superset.astype(np.int32))
    assert best_allowed(x, c) == int(order[rank])
    assert c.checked <= 256 + len(superset)
    # a constraint that cannot narrow (None) gets the full search, same answer
    assert best_allowed(x, NarrowingConstraint(allowed, None)) == int(order[rank])
    # nothing admitted in the superset: a dead end, said as one
    with pytest.raises(DeadEndError):
        best_allowed(x, NarrowingConstraint(set(), superset.astype(np.int32)))


def test_best_allowed_ties_go_to_the_lowest_id_and_a_dead_end_says_so():
    x = np.zeros(10, dtype=np.float32)
    x[[3, 6, 8]] = 2.0
    assert best_allowed(x, SetConstraint({6, 8})) == 6
    with pytest.raises(DeadEndError, match="admits no token"):
        best_allowed(x, SetConstraint(set()))


def test_constrained_greedy_accepts_each_pick():
    x = np.array([5.0, 4.0, 3.0, 2.0], dtype=np.float32)
    c = SetConstraint({1, 3})
    s = ConstrainedSampler(SamplingParams(), c)
    assert s(x) == 1 and s(x) == 1
    assert c.accepted == [1, 1]


def _chi_p(draws: list[int], expected: dict[int, float]) -> float:
    """Chi-square p-value of draws against token -> probability (small cells pooled)."""
    n = len(draws)
    keys = sorted(expected)
    obs = np.asarray([draws.count(k) for k in keys], dtype=float)
    exp = np.asarray([expected[k] * n for k in keys])
    big = exp >= 5  # chi-square needs expected counts >= 5: pool the rest
    obs = np.append(obs[big], obs[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp *= obs.sum() / exp.sum()  # float rounding of p
    return float(chisquare(obs, exp).pvalue)


def _masked_case(params: SamplingParams) -> tuple[np.ndarray, set[int], dict[int, float]]:
    """A row, an admitted set, and the processed distribution of the masked row (every other
    logit -inf), computed independently with `distribution` on the admitted tokens."""
    rng = np.random.default_rng(7)
    x = rng.normal(scale=1.5, size=40).astype(np.float32)
    allowed = {int(t) for t in rng.choice(40, size=15, replace=False)}
    ids = np.asarray(sorted(allowed))
    sub_ids, p = distribution(x[ids], params)
    return x, allowed, dict(zip(ids[sub_ids].tolist(), p.tolist()))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_k=4, seed=2),
    SamplingParams(temperature=1.3, top_p=0.8, seed=3),
    SamplingParams(temperature=0.9, min_p=0.1, seed=4),
])
def test_constrained_sampling_draws_the_masked_distribution(params):
    x, allowed, expected = _masked_case(params)
    s = ConstrainedSampler(params, SetConstraint(allowed))
    draws = [s(x) for _ in range(6000)]
    assert set(draws) <= set(expected)  # never a rejected or filtered token
    assert _chi_p(draws, expected) > 1e-3


def test_the_chi_square_tells_mask_first_from_mask_after_truncation():
    """Masking after top-k (truncate the whole row, then drop rejected tokens) is another
    distribution; the check above must reject it."""
    params = SamplingParams(temperature=0.7, top_k=8, seed=2)
    x, allowed, expected = _masked_case(params)
    ids, p = distribution(x, params)
    keep = np.asarray([int(i) in allowed for i in ids])
    ids, p = ids[keep], p[keep] / p[keep].sum()
    rng = np.random.default_rng(11)
    draws = [int(t) for t in rng.choice(ids, size=6000, p=p)]
    assert _chi_p(draws, expected) < 1e-3


def test_cutoff_leaves_out_only_hopeless_tokens():
    x = np.array([0.0, -CUTOFF - 1.0, -5.0], dtype=np.float32)
    c = SetConstraint({0, 1, 2})
    s = ConstrainedSampler(SamplingParams(temperature=1.0, seed=0), c)
    draws = {s(x) for _ in range(300)}
    assert 1 not in draws and draws <= {0, 2}


def test_subtree_keeps_admitted_nodes_and_drops_orphans():
    t = TokenTree(1)
    t.insert([2, 3, 4], 1.0, 3, 1)
    t.insert([2, 5], 0.5, 2, 2)
    t.insert([6], 0.25, 1, 1)
    # nodes: 0 root, 1:'2', 2:'3', 3:'4', 4:'5', 5:'6'
    keep = [True, True, False, True, True, True]
    s = t.subtree(keep)
    assert [s.path_tokens(i) for i in range(1, len(s))] == [[2], [2, 5], [6]]
    assert s.weights[1] == t.weights[1] and s.origin[2] == t.origin[4]


def test_forced_draft_is_the_heaviest_path_and_admits_filters():
    cfg = SRSDConfig(draft_depth=4, max_nodes=6, max_branches=2)

    class Two(Drafter):
        origin = 1

        def propose(self, inp):
            return [(np.asarray([7, 8, 9]), 0.9, 3), (np.asarray([5, 6]), 0.8, 2)]

    inp = DraftInput(np.asarray([1, 2], np.int32), 3, None, None, forced=[5, 6, 10, 11, 12])
    tree = Two(cfg).draft(inp)
    assert tree.path_tokens(tree.child(0, 5)) == [5]
    deepest = max(range(len(tree)), key=lambda i: tree.depths[i])
    assert tree.path_tokens(deepest) == [5, 6, 10, 11]  # cut at draft_depth
    assert tree.origin[tree.child(0, 5)] & GRAMMAR and tree.origin[tree.child(0, 5)] & 1
    # a constraint that rejects token 8 drops 8 and everything under it, and forces 3, 4
    # after token 7
    def constrain(t, budget):
        where = {}
        out = t.subtree([i == 0 or t.tokens[i] != 8 for i in range(len(t))], where)
        seven = t.child(0, 7)
        out.extend(where[seven], [3, 4][: budget - out.n_draft], GRAMMAR)
        return out

    inp.constrain = constrain
    tree = Two(cfg).draft(inp)
    assert 8 not in tree.tokens and 9 not in tree.tokens and 7 in tree.tokens
    tail = tree.child(tree.child(0, 7), 3)
    assert tree.path_tokens(tail) == [7, 3] and tree.origin[tail] == GRAMMAR
    assert tree.n_draft <= cfg.max_nodes


def test_space_style_learns_from_the_output():
    s = SpaceStyle()
    assert s.space_after(":") and s.space_after(",") and not s.space_after("{")
    s.feed('{"a":1,')
    s.feed(' "b": [')
    assert not s.space_after(":") or s.after[":"] is True  # last seen wins
    assert s.after[","] is True and s.after["{"] is False and s.last == "["
    s.feed('"x"]')
    assert s.after["["] is False


def test_constraint_spec_errors_name_the_problem():
    with pytest.raises(GrammarError, match="one of grammar, json_schema"):
        ConstraintSpec.make(grammar="root ::= \"a\"", json_schema={"type": "object"})
    with pytest.raises(GrammarError, match="non-empty GBNF"):
        ConstraintSpec.make(grammar="  ")
    with pytest.raises(GrammarError, match="not valid JSON"):
        ConstraintSpec.make(json_schema="{nope")
    with pytest.raises(GrammarError, match=r"invalid json_schema at properties/a"):
        ConstraintSpec.make(json_schema={"type": "object", "properties": {"a": {"type": 3}}})
    with pytest.raises(GrammarError, match="must be a JSON object"):
        ConstraintSpec.make(json_schema=[1, 2])
    assert ConstraintSpec.make() is None


def test_constraint_spec_validate():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    spec = ConstraintSpec.make(json_schema=schema)
    assert spec is not None and "root" in spec.gbnf
    assert spec.validate('{"n": 3}') is None
    assert "required" in spec.validate('{"m": 3}')
    assert spec.validate('{"n": ').startswith("not JSON")


def test_workload_json_schema_field():
    p = parse_line('{"id": "a", "category": "json", "prompt": "x", "max_tokens": 4, '
                   '"json_schema": {"type": "object"}}', "w")
    assert p.json_schema == {"type": "object"} and p.constraint == {"json_schema": p.json_schema}
    assert parse_line('{"id": "a", "category": "c", "prompt": "x", "max_tokens": 4}',
                      "w").constraint == {}
    with pytest.raises(ValueError, match="'json_schema' must be an object"):
        parse_line('{"id": "a", "category": "c", "prompt": "x", "max_tokens": 4, '
                   '"json_schema": 3}', "w")


def _rows(n_vocab: int, tops: list[int]) -> np.ndarray:
    rows = np.full((len(tops), n_vocab), -100.0, dtype=np.float32)
    for i, t in enumerate(tops):
        rows[i, t] = 5.0
        rows[i, (t + 1) % n_vocab] = 4.0  # the runner-up, where the grammar rejects the top
    return rows


@pytest.mark.parametrize("graph", [True, False])
def test_a_tree_walk_takes_nodes_the_grammar_checked_before_the_pass_unchecked(graph):
    """Under a grammar, a greedy tree's walk asks the grammar only about tokens it did not
    check before the pass: an argmax that is a drafted child the grammar admitted (a node
    below `checked`) is taken as is; a child added after the check (forced text after a
    leaf) and the token after the path are checked. Path, next token and the grammar's
    accepted tokens are those of the walk that checks every row."""
    from srsd_local.engine.engine import _checked_draw
    from srsd_local.spec.planner import Plan
    from srsd_local.spec.verify import walk_tree

    tree = TokenTree(1)
    a = tree.add_node(0, 5)
    b = tree.add_node(a, 7)
    tree.add_node(0, 6)  # a sibling the model does not take
    c = tree.add_node(b, 9)  # added after the check (index 4: not below `checked`)
    plan = Plan(tree, [], [None] * len(tree), 0.0)
    rows = _rows(16, [5, 7, 9, 0, 11])  # the argmax after each node (node 3: unused)
    allowed = {5, 6, 7, 9, 11, 12}
    for rejected, want_path, want_y in ((None, [0, a, b, c], 11), (9, [0, a, b], 10)):
        ok = allowed - {rejected} | {10}
        ref = SetConstraint(ok)
        sampler = ConstrainedSampler(SamplingParams(temperature=0.0), ref)
        assert walk_tree(tree, rows.__getitem__, sampler) == (want_path, want_y)
        fast = SetConstraint(ok)
        sampler = ConstrainedSampler(SamplingParams(temperature=0.0), fast)
        tops = (lambda node: int(np.argmax(rows[node]))) if graph else None
        draw = _checked_draw(sampler, plan, 4, rows, tops)
        assert walk_tree(tree, lambda node: node, draw) == (want_path, want_y)
        assert fast.accepted == ref.accepted == [tree.tokens[i] for i in want_path[1:]] + \
            [want_y]
        # the grammar was asked about two ids only: the unchecked child's token (9, drawn
        # after b), then the token after the path (11), or where it rejects 9, the
        # runner-up (10)
        assert ref.checked > fast.checked
        assert fast.checked == 2
    # a plan chosen from a bigger candidate: its nodes' indices there decide (`source`)
    sub = Plan(tree, [], [None] * len(tree), 0.0, source=[0, 1, 7, 3, 4])  # b was 7
    fast = SetConstraint(allowed)
    sampler = ConstrainedSampler(SamplingParams(temperature=0.0), fast)
    assert walk_tree(tree, lambda node: node, _checked_draw(sampler, sub, 4, rows)) == \
        ([0, a, b, c], 11)
    assert fast.checked == 3  # 7 (b: candidate node 7, not checked), 9 and 11
    with pytest.raises(ValueError, match="greedy"):
        ConstrainedSampler(SamplingParams(temperature=0.7), fast).take(5)

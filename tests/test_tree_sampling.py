"""TokenTree and sampling: pure logic."""

from __future__ import annotations

import numpy as np
import pytest

from srsd_local.config import SamplingParams
from srsd_local.spec.sampling import Sampler, distribution
from srsd_local.spec.tree import TokenTree
from srsd_local.spec.verify import walk_tree


def test_insert_shares_prefixes_and_accumulates_weight():
    t = TokenTree(5)
    t.insert([1, 2, 3], 0.5)
    t.insert([1, 2, 4], 0.25)
    t.insert([7], 1.0)
    assert len(t) == 1 + 5  # root, 1, 2, 3, 4, 7
    n1 = t.child(0, 1)
    n2 = t.child(n1, 2)
    assert t.weights[n1] == pytest.approx(0.75) and t.weights[n2] == pytest.approx(0.75)
    assert t.depths[t.child(n2, 4)] == 3
    assert t.path_tokens(t.child(n2, 3)) == [1, 2, 3]
    assert t.child(0, 9) is None


def test_follow_walks_the_tokens_down_one_path_until_a_miss():
    t = TokenTree(5)
    t.insert([1, 2, 3], 0.5)
    t.insert([1, 4], 0.25)
    n1 = t.child(0, 1)
    assert t.follow([1, 2, 3]) == [n1, t.child(n1, 2), t.child(t.child(n1, 2), 3)]
    assert t.follow([1, 4, 9, 2]) == [n1, t.child(n1, 4)]  # stops at the first miss
    assert t.follow([2, 1]) == [] and t.follow([]) == []


def test_prune_keeps_heaviest_connected_subtree_within_budget():
    t = TokenTree(0)
    t.insert([1, 2, 3, 4], 0.9)
    t.insert([1, 2, 5], 0.5)
    t.insert([6, 7], 0.3)
    p = t.prune(max_nodes=4, max_depth=8, max_branches=8)
    assert p.n_draft == 4
    assert p.path_tokens(p.child(p.child(p.child(0, 1), 2), 3)) == [1, 2, 3]
    # best-first: 1 (1.4), 2 (1.4), 3 (0.9), 4 (0.9) beat 5 (0.5) and 6 (0.3)
    assert sorted(p.tokens[1:]) == [1, 2, 3, 4]
    q = t.prune(max_nodes=5, max_depth=8, max_branches=8)
    assert sorted(q.tokens[1:]) == [1, 2, 3, 4, 5]
    d = t.prune(max_nodes=10, max_depth=2, max_branches=8)
    assert max(d.depths) == 2
    b = t.prune(max_nodes=10, max_depth=8, max_branches=1)
    assert sum(1 for i in range(len(b)) if not b.children(i)) == 1
    assert b.path_tokens(len(b) - 1) == [1, 2, 3, 4]


def test_a_trees_first_nodes_are_a_tree_of_their_own():
    t = TokenTree(9)
    t.insert([1, 2, 3], 0.5, agree=3, origin=1)
    t.insert([1, 4], 0.25, agree=5, origin=2)
    t.insert([6, 7], 1.0, origin=16)
    for k in range(len(t)):
        head = t.head(k)
        ref = t.subtree([i <= k for i in range(len(t))])
        assert len(head) == k + 1
        for field in ("tokens", "parents", "depths", "weights", "counts", "agree", "origin"):
            assert getattr(head, field) == getattr(ref, field), (k, field)
        assert [sorted(head.children(i)) for i in range(len(head))] == \
            [sorted(ref.children(i)) for i in range(len(ref))]
    head = t.head(2)
    head.insert([1, 2, 8], 1.0)  # its own lists: the original is untouched
    assert len(t) == 7 and t.child(t.child(t.child(0, 1), 2), 8) is None


@pytest.mark.parametrize("tokens,weight,agree,origin", [
    ([5, 9, 5, 5, 2], 1.0, 8, 4), ([7], 0.7, 0, 1), ([], 0.5, 3, 2),
    ([3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3], 0.89, -2, 16)])
def test_a_chain_made_at_once_is_the_tree_an_insert_makes(tokens, weight, agree, origin):
    # a copy run's chain is made list by list: every field, the children and the layout
    # as inserting the same draft into a new tree gives them (repeated tokens included)
    inserted = TokenTree(11)
    inserted.insert(tokens, weight, agree, origin)
    made = TokenTree.chain(11, tokens, weight, agree, origin)
    for name in ("tokens", "parents", "depths", "weights", "counts", "agree", "origin"):
        assert getattr(made, name) == getattr(inserted, name), name
    assert made._children == inserted._children
    assert [made.child(i, t) for i, t in enumerate(tokens)] == list(range(1, len(tokens) + 1))
    a, b = made.layout(), inserted.layout()
    assert a.seq_ids == b.seq_ids and a.leaf_branch == b.leaf_branch
    assert list(a.tokens) == list(b.tokens) and list(a.depths) == list(b.depths)


def test_prune_is_deterministic():
    t = TokenTree(0)
    for k in range(6):
        t.insert([k, k + 1, k + 2], 1.0)
    a = t.prune(5, 3, 3)
    b = t.prune(5, 3, 3)
    assert a.tokens == b.tokens and a.parents == b.parents


def test_layout_one_seq_id_per_leaf():
    t = TokenTree(9)
    t.insert([1, 2], 1.0)
    t.insert([1, 3], 1.0)
    t.insert([4], 1.0)
    lay = t.layout()
    assert lay.n_branches == 3
    assert sorted(lay.seq_ids[0]) == [0, 1, 2]  # the root is on every path
    n1 = t.child(0, 1)
    assert len(lay.seq_ids[n1]) == 2
    for leaf, b in lay.leaf_branch.items():
        assert lay.seq_ids[leaf] == [b]
    assert list(lay.depths) == t.depths and list(lay.tokens) == t.tokens
    # every node's first id is a branch through it: walking up from its leaf reaches it
    for node in range(len(t)):
        b = lay.seq_ids[node][0]
        leaf = next(k for k, v in lay.leaf_branch.items() if v == b)
        up = leaf
        while up not in (node, -1):
            up = t.parents[up]
        assert up == node


def test_distribution_filters():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))
    ids, p = distribution(logits, SamplingParams(temperature=1.0))
    assert list(ids) == [0, 1, 2, 3, 4] and p.sum() == pytest.approx(1.0)
    ids, p = distribution(logits, SamplingParams(temperature=1.0, top_k=2))
    assert list(ids) == [0, 1] and p[0] == pytest.approx(0.5 / 0.7)
    ids, _ = distribution(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert list(ids) == [0, 1, 2]
    ids, _ = distribution(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert list(ids) == [0, 1]
    _, p_cold = distribution(logits, SamplingParams(temperature=0.1))
    assert p_cold[0] > 0.99


def test_temperature_alone_is_the_softmax_of_the_whole_row():
    rng = np.random.default_rng(1)
    row = rng.normal(scale=6.0, size=262_144).astype(np.float32)
    ids, p = distribution(row, SamplingParams(temperature=0.8))
    assert ids.tolist() == list(range(len(row)))  # every token, in id order
    ref = np.exp((row.astype(np.float64) - row.max()) / 0.8)
    ref /= ref.sum()
    assert np.abs(p - ref).max() < 1e-6 * ref.max() and abs(p.sum() - 1.0) < 1e-5


def test_with_a_filter_tokens_past_the_cutoff_are_left_out_and_the_rest_keeps_its_distribution():
    from srsd_local.spec.sampling import CUTOFF

    t = 0.5
    x = np.zeros(6, dtype=np.float32)
    x[1:] = [-1.0, -(CUTOFF - 1) * t, -(CUTOFF + 1) * t, -1e9, -3.0]
    tiny = SamplingParams(temperature=t, min_p=1e-20)  # a min-p far below the cutoff
    ids, p = distribution(x, tiny)
    assert ids.tolist() == [0, 1, 2, 5]  # token 3 lies past the cutoff, token 4 far past it
    full = np.exp((x - x.max()) / t)
    full /= full.sum()
    assert np.abs(p - full[ids] / full[ids].sum()).max() < 1e-9
    assert full[[3, 4]].sum() < 1e-12  # what was left out
    # a realistic row: the candidates are a small share of the vocabulary, the mass the same
    rng = np.random.default_rng(1)
    row = rng.normal(scale=6.0, size=262_144).astype(np.float32)
    ids, p = distribution(row, SamplingParams(temperature=0.8, min_p=1e-20))
    ref = np.exp((row.astype(np.float64) - row.max()) / 0.8)
    assert len(ids) < len(row) // 2 and ref[ids].sum() / ref.sum() > 1 - 1e-8


@pytest.mark.parametrize("min_p", [0.3, 0.05, 1e-4])
def test_min_p_keeps_exactly_the_tokens_its_filter_keeps(min_p):
    """min-p's bound cuts the candidates before the softmax; the kept tokens and their
    probabilities are those of filtering the softmax of every token within the cutoff."""
    from srsd_local.spec.sampling import CUTOFF

    rng = np.random.default_rng(3)
    row = rng.normal(scale=2.0, size=262_144).astype(np.float32)
    t = 0.7
    ids, p = distribution(row, SamplingParams(temperature=t, min_p=min_p))
    cand = np.flatnonzero(row >= row.max() - np.float32(CUTOFF * t))
    q = np.exp((row[cand].astype(np.float64) - row.max()) / t)
    q /= q.sum()
    keep = q >= min_p * q.max()
    assert ids.tolist() == cand[keep].tolist()
    assert np.abs(p - q[keep] / q[keep].sum()).max() < 1e-6


@pytest.mark.parametrize("n_vocab", [5, 262_144])
def test_temperature_only_sampler_draws_what_the_distribution_gives(n_vocab):
    """The sampler's fast path (unnormalised weights in a scratch row) picks, for the same
    uniform draw, the token `distribution` gives it."""
    from srsd_local.spec.sampling import _pick

    rng = np.random.default_rng(5)
    row = rng.normal(scale=3.0, size=n_vocab).astype(np.float32)
    params = SamplingParams(temperature=0.9, seed=17)
    s = Sampler(params)
    s._kernel = None  # numpy's path (the compiled kernel's: the test below)
    ids, p = distribution(row, params)
    u = np.random.default_rng(17)  # the sampler's generator, replayed
    draws = [s(row) for _ in range(500)]
    assert draws == [int(ids[_pick(p, u.random())]) for _ in range(500)]
    assert len(set(draws)) > (3 if n_vocab == 5 else 100)  # really random


@pytest.mark.parametrize("n_vocab", [3, 700, 262_144])
def test_the_compiled_temperature_kernel_draws_by_the_exact_distribution(n_vocab):
    """Each draw of the kernel is the token the exact (float64) inverse CDF gives at its
    uniform number, up to float32 rounding of the weights (1e-5 of the mass); tokens at -inf
    are never drawn; the sampler uses it for temperature alone where it could be built."""
    from srsd_local.spec import kernels

    kern = kernels.temperature_kernel(0.7)
    if kern is None:
        pytest.skip("no C compiler: the sampler uses numpy (tested above)")
    rng = np.random.default_rng(8)
    row = (rng.normal(scale=4.0, size=n_vocab)).astype(np.float32)
    row[::7] = -np.inf
    p = np.exp((row.astype(np.float64) - row.max()) / 0.7)
    cdf = np.cumsum(p / p.sum())
    for u in rng.random(3000):
        i = kern(row, float(u))
        assert np.isfinite(row[i])
        lo = cdf[i - 1] if i else 0.0
        assert lo - 1e-5 <= u < cdf[i] + 1e-5, (u, i)
    # two tokens: the draw flips where the first one's probability ends: the second one's
    # weight exp(-gap / 0.7) is right to 1e-6 relative, over the whole range of gaps, but
    # for what rounding gap / 0.7 to float32 costs (as in numpy's float32 path)
    for gap in np.linspace(0.01, 11.0, 400, dtype=np.float32):  # (weights down to 1.5e-7)
        w = np.exp(-np.float64(gap) / 0.7)
        edge = 1.0 / (1.0 + w)
        tol = edge * (1.0 - edge) * (1e-6 + 1.5e-7 * gap / 0.7)
        two = np.array([0.0, -gap], np.float32)
        assert kern(two, edge - tol) == 0 and kern(two, edge + tol) == 1, gap
    assert kern(np.array([5.0, 5.0, -np.inf, 5.0], np.float32), 0.999) == 3
    # whole blocks of -inf weigh nothing; a block far below the row's maximum next to none
    big = np.full(3 * kernels.BLOCK, -np.inf, np.float32)
    big[kernels.BLOCK + 3], big[kernels.BLOCK + 9] = 1.0, 1.0 - 0.7 * np.log(3.0)
    assert [kern(big, u) for u in (0.0, 0.74, 0.76, 0.999)] == [kernels.BLOCK + 3] * 2 + \
        [kernels.BLOCK + 9] * 2
    big[2 * kernels.BLOCK] = -500.0  # e^-716 of the maximum: never drawn
    assert kern(big, 1.0 - 1e-15) == kernels.BLOCK + 9
    assert kern(np.array([0.0, -70.0], np.float32), 1.0 - 1e-12) == 0  # e^-100: underflows
    assert Sampler(SamplingParams(temperature=0.7, seed=1))._kernel is not None
    assert Sampler(SamplingParams(temperature=0.7, top_k=5))._kernel is None


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_the_temperature_kernel_draws_the_same_tokens_on_any_number_of_threads(threads):
    """The blocks of a row shared out among threads give the same draw as one thread, for
    every uniform number (rows long enough to be shared out, blocks of -inf among them, a
    last short block); a Sampler hands its thread count to the kernel."""
    from srsd_local.spec import kernels

    one, many = kernels.temperature_kernel(0.8), kernels.temperature_kernel(0.8, threads)
    if one is None:
        pytest.skip("no C compiler: the sampler uses numpy (tested above)")
    rng = np.random.default_rng(threads)
    for n in (kernels.MIN_THREADED, 262_144, 100_003):
        row = rng.normal(scale=5.0, size=n).astype(np.float32)
        row[kernels.BLOCK: 5 * kernels.BLOCK] = -np.inf
        us = np.concatenate([rng.random(400), [0.0, 0.5, 1.0 - 1e-12]])
        assert [many(row, float(u)) for u in us] == [one(row, float(u)) for u in us]
    assert many.threads == threads
    s = Sampler(SamplingParams(temperature=0.8, seed=3), threads=threads)
    assert s._kernel is not None and s._kernel.threads == threads


@pytest.mark.parametrize("n_vocab,n_high", [(5000, 5000), (60_000, 3000), (60_000, 20_000)])
def test_top_p_on_a_large_flat_vocabulary_is_exact(n_vocab, n_high):
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=0.01, size=n_vocab).astype(np.float32)
    logits[n_high:] -= 8.0  # a nucleus of about 0.9 * n_high tokens
    ids, p = distribution(logits, SamplingParams(temperature=1.0, top_p=0.9))
    # the nucleus is wider than the sorted head: all of it must be found
    assert len(ids) > 512
    full = np.exp(logits - logits.max())
    full /= full.sum()
    order = np.argsort(-full, kind="stable")
    k = int(np.searchsorted(np.cumsum(full[order]), 0.9)) + 1
    assert set(ids.tolist()) == set(order[:k].tolist())


def test_sampler_greedy_and_seeded():
    logits = np.array([0.1, 3.0, 0.2, 2.9], dtype=np.float32)
    assert Sampler(SamplingParams())(logits) == 1
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(50, 100)).astype(np.float32)
    s1, s2 = Sampler(SamplingParams(temperature=1.0, seed=3)), Sampler(SamplingParams(
        temperature=1.0, seed=3))
    assert [s1(r) for r in rows] == [s2(r) for r in rows]
    s3 = Sampler(SamplingParams(temperature=1.0, seed=4))
    s1 = Sampler(SamplingParams(temperature=1.0, seed=3))
    # another seed draws differently (50 draws from 100 near-uniform choices: a coincidence
    # of all 50 has probability ~1e-80)
    assert [s3(r) for r in rows] != [s1(r) for r in rows]
    counts = np.bincount([Sampler(SamplingParams(temperature=1.0, seed=i))(
        np.log(np.array([0.7, 0.3], np.float32))) for i in range(400)], minlength=2)
    assert 0.6 < counts[0] / 400 < 0.8


def test_walk_tree_greedy():
    t = TokenTree(0)
    t.insert([1, 2, 3], 1.0)
    t.insert([1, 4], 1.0)
    # model says: after root -> 1, after 1 -> 4, after 4 -> 7
    want = {0: 1, t.child(0, 1): 4, t.child(t.child(0, 1), 4): 7}

    def row(i):
        r = np.zeros(10, np.float32)
        r[want.get(i, 0)] = 1.0
        return r

    path, y = walk_tree(t, row, Sampler(SamplingParams()))
    assert [t.tokens[i] for i in path] == [0, 1, 4] and y == 7


def test_walk_tree_rejects_at_root():
    t = TokenTree(0)
    t.insert([1, 2], 1.0)

    def row(i):
        r = np.zeros(10, np.float32)
        r[5] = 1.0
        return r

    path, y = walk_tree(t, row, Sampler(SamplingParams()))
    assert path == [0] and y == 5


# -- sampled verification draws plain sampling's distribution -----------------------------------
V_SMALL = 6
SHAPES = {  # drafts under the root (the known next token)
    "chain3": [[1, 2, 3]],
    "wide4": [[0], [1], [2], [3]],
    "tree": [[1, 2], [1, 3], [2, 0, 5], [4]],
}
PARAMS = {
    "temperature": dict(temperature=1.0),
    "top_k": dict(temperature=0.7, top_k=3),
    "top_p": dict(temperature=1.3, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "all": dict(temperature=0.9, top_k=4, top_p=0.9, min_p=0.05),
}


def _logits_after(tokens: tuple[int, ...]) -> np.ndarray:
    """The toy model: fixed logits for every continuation of the root."""
    seed = 1 + sum((t + 1) * 7 ** i for i, t in enumerate(tokens))
    return (np.random.default_rng(seed).normal(size=V_SMALL) * 1.5).astype(np.float32)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("pname", sorted(PARAMS))
def test_sampled_tree_walk_has_the_plain_distribution(shape, pname):
    """Chi-square: the first two tokens a tree step emits (continuing plainly when the walk
    stops at the root) are distributed as plain sampling's two draws, for trees of several
    widths and depths under each sampling filter. Seeds are fixed, so the verdict is too."""
    from scipy.stats import chisquare

    params = SamplingParams(seed=None, **PARAMS[pname])
    tree = TokenTree(0)
    for d in SHAPES[shape]:
        tree.insert(d, 1.0)
    paths = {0: ()}
    for i in range(1, len(tree)):
        paths[i] = paths[tree.parents[i]] + (tree.tokens[i],)

    def probs(prefix: tuple[int, ...]) -> np.ndarray:
        ids, p = distribution(_logits_after(prefix), params)
        full = np.zeros(V_SMALL)
        full[ids] = p
        return full

    n = 6000
    counts = np.zeros((V_SMALL, V_SMALL))
    for seed in range(n):
        sampler = Sampler(SamplingParams(seed=seed, **PARAMS[pname]))
        path, y = walk_tree(tree, lambda i: _logits_after(paths[i]), sampler)
        seq = [tree.tokens[i] for i in path[1:]] + [y]
        if len(seq) < 2:
            seq.append(sampler(_logits_after(tuple(seq))))
        counts[seq[0], seq[1]] += 1
    p1 = probs(())
    expected = np.array([[p1[a] * probs((a,))[b] for b in range(V_SMALL)]
                         for a in range(V_SMALL)]) * n
    assert counts[expected == 0].sum() == 0, "a filtered-out token was emitted"
    keep = expected > 0
    exp = expected[keep] * (n / expected[keep].sum())  # float rounding of the product sums
    res = chisquare(counts[keep], exp)
    assert res.pvalue > 1e-3, (shape, pname, res)


@pytest.mark.parametrize("n,k,levels", [(262_144, 40, 0), (262_144, 512, 0), (262_144, 40, 7),
                                        (1000, 40, 0), (70_000, 8192, 0), (5000, 4999, 3)])
def test_top_k_selection_matches_a_full_sort(n, k, levels):
    """`_top` (a block-maxima bound, then a partition of what is above it) finds the k
    largest, ties at the k-th value broken by the lowest index, as a stable sort would."""
    from srsd_local.spec.sampling import _top

    rng = np.random.default_rng(n + k)
    v = rng.normal(size=n).astype(np.float32)
    if levels:  # few distinct values: many ties at the k-th
        v = np.round(v * levels / 3).astype(np.float32)
    ref = np.sort(np.argsort(-v, kind="stable")[:k])
    assert _top(v, k).tolist() == ref.tolist()


def test_emitting_without_stop_strings_equals_token_by_token_emission():
    """With no stop string a step's text is decoded in one go: the same text, tokens,
    flags and finish as token by token (the path stop strings take), multi-byte
    characters split across tokens and invalid bytes included."""
    from srsd_local.engine.emit import Emitter

    rng = np.random.default_rng(11)
    alphabet = [b"a", b" b", "é".encode(), "日".encode()[:1], "日".encode()[1:], b"\xff",
                "😀".encode()[:2], "😀".encode()[2:], b"\n", b"xyz"]
    eog = len(alphabet)  # one more token: end of generation

    def piece(t: int) -> bytes:
        return b"" if t == eog else alphabet[t]

    for trial in range(300):
        max_tokens = int(rng.integers(1, 30))
        steps = [rng.integers(0, eog + (trial % 3 == 0), size=int(rng.integers(1, 7)))
                 .tolist() for _ in range(12)]
        runs = []
        for stops in ([], ["\x00never"]):
            em = Emitter(piece, lambda t: t == eog, max_tokens, stops)
            text, ids, flags, finish = "", [], [], None
            for k, step in enumerate(steps):
                out = em.push(step, [True] * (len(step) - 1) + [False],
                              out_of_room=(k == 11))
                text, ids, flags = text + out.text, ids + out.token_ids, flags + out.drafted
                if out.finish_reason is not None:
                    finish = out.finish_reason
                    break
            runs.append((text, ids, flags, finish, em.count))
        assert runs[0] == runs[1], trial


def test_graph_rows_check_the_rows_the_walk_reads() -> None:
    from srsd_local.engine.engine import _graph_rows
    from srsd_local.engine.slots import Work
    from srsd_local.llama.backend import DecodeError
    t = TokenTree(5)
    a = t.add_node(0, 7)
    t.add_node(0, 8)
    t.add_node(a, 9)
    w = Work([5, 7, 8, 9], [0, 1, 1, 2], [[0, 1], [0], [1], [0]], [1, 1, 1, 1], False)
    w.sampled = np.array([7, 4, -1, 3], dtype=np.int32)  # row 2 (token 8) was not sampled
    assert walk_tree(t, _graph_rows(w), int) == ([0, 1], 4)  # ... and is not read
    w.sampled = np.array([8, 4, -1, 3], dtype=np.int32)
    with pytest.raises(DecodeError, match="tree row 2"):
        walk_tree(t, _graph_rows(w), int)
    w.sampled = np.array([7, 4], dtype=np.int32)
    with pytest.raises(DecodeError, match="sampled tokens for a tree"):
        _graph_rows(w)

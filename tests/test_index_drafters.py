"""Vector index backends and the drafters."""

from __future__ import annotations

import numpy as np
import pytest

from srsd_local.config import SRSDConfig
from srsd_local.spec.drafters import (
    DraftInput,
    NgramDrafter,
    SemanticDrafter,
    make_drafter,
)
from srsd_local.spec.index import VectorIndex, choose_backend, gpu_available

BACKENDS = ["numpy", "faiss-cpu"] + (["faiss-gpu"] if gpu_available() else [])


def _data(n=300, dim=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, dim)).astype(np.float32)


def test_backends_return_the_same_hits():
    x = _data()
    q = _data(5, seed=1)
    results = {}
    for b in BACKENDS:
        idx = VectorIndex(32, 1000, b)
        idx.add(x[:200], np.arange(200))
        idx.add(x[200:], np.arange(200, 300))
        results[b] = [idx.search(qq, 8) for qq in q]
    ref = results["numpy"]
    for b in BACKENDS:
        for h, r in zip(results[b], ref):
            assert h.positions.tolist() == r.positions.tolist()
            np.testing.assert_allclose(h.scores, r.scores, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_search_finds_itself_and_truncate_forgets(backend):
    x = _data()
    idx = VectorIndex(32, 400, backend)
    idx.add(x, np.arange(300))
    h = idx.search(x[123], 3)
    assert h.positions[0] == 123 and h.scores[0] == pytest.approx(1.0, abs=2e-3)
    assert np.all(np.diff(h.scores) <= 1e-6)
    idx.truncate(100)
    assert len(idx) == 100
    h = idx.search(x[123], 5)
    assert h.positions.max() < 100
    idx.add(x[100:110], np.arange(100, 110))
    assert idx.search(x[105], 1).positions[0] == 105
    assert idx.search(x[0], 0).positions.size == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_added_one_at_a_time_are_stored_lazily_and_found_like_a_batch(backend):
    # decode steps add one row each; they are stored in batches when a search needs them
    x = _data(260) + 2.0
    batch = VectorIndex(32, 400, backend)
    batch.add(x[:100], 0)
    batch.add(x[100:], np.arange(100, 260))
    lazy = VectorIndex(32, 400, backend)
    lazy.add(x[:100], 0)  # a prompt: the centre comes from its rows
    for i in range(100, 260):
        lazy.add(x[i], i)
    assert len(lazy) == 260 and lazy._n - lazy._stored < 64  # never many rows unstored
    for q in (x[5], x[150], x[259], _data(1, seed=3)[0]):
        a, b = lazy.search(q, 6), batch.search(q, 6)
        assert a.positions.tolist() == b.positions.tolist()
        np.testing.assert_allclose(a.scores, b.scores, atol=1e-6)
    # rows still pending when the context is cut back or copied are handled like stored ones
    for i in range(260, 270):
        lazy.add(x[i % 260], i)
    copy = VectorIndex(32, 400, backend)
    copy.add(x[:3], 0)
    copy.add(x[3], 3)  # pending, then replaced
    copy.copy_from(lazy, 265)
    assert len(copy) == 265 and copy.search(x[5], 1).positions[0] == 5
    lazy.add(x[0], 270)
    lazy.truncate(262)
    assert len(lazy) == 262 and lazy.search(x[1], 3).positions.max() < 262
    lazy.add(x[7], 262)
    assert lazy.search(x[7], 2).positions.tolist() in ([7, 262], [262, 7])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_added_step_by_step_are_indexed_like_rows_added_at_once(backend):
    # the decode loop adds each step's few rows from an array it reuses: they are copied
    # (overwriting the caller's array afterwards changes nothing), stored in a batch at the
    # next search, and found exactly as a block added at once
    x = _data(200) + 1.0
    block, steps = VectorIndex(32, 400, backend), VectorIndex(32, 400, backend)
    block.add(x[:40], 0)
    steps.add(x[:40], 0)
    block.add(x[40:200], 40)
    reused = np.empty((8, 32), np.float32)
    for start in range(40, 200, 8):  # single rows and short paths, as steps add them
        reused[:] = x[start: start + 8]
        steps.add(reused[:1], start)
        steps.add(reused[1:], start + 1)
        reused[:] = -7.0  # the caller's array reused
        if start % 48 == 0:
            steps.search(x[start], 3)  # stores what is waiting
    assert len(steps) == len(block) == 200
    for q in (x[3], x[57], x[119], x[199], _data(1, seed=9)[0]):
        a, b = steps.search(q, 5), block.search(q, 5)
        assert a.positions.tolist() == b.positions.tolist()
        np.testing.assert_allclose(a.scores, b.scores, atol=1e-6)
    with pytest.raises(ValueError, match="full"):
        VectorIndex(32, 2, backend).add(x[:3].astype(np.float32), 0)
    with pytest.raises(ValueError, match="rows of 32"):
        steps.add(np.zeros((2, 31), np.float32), 200)


def _assert_same_rows(a: VectorIndex, b: VectorIndex, n: int) -> None:
    """Both indexes, their pending rows stored, hold the same n rows for the same positions."""
    a._flush()
    b._flush()
    assert len(a) == len(b) == n
    assert np.array_equal(a._buf[:n], b._buf[:n])
    assert np.array_equal(a._pos[:n], b._pos[:n])
    assert np.array_equal(a._row_of[:n], b._row_of[:n])


def test_rows_written_at_the_stage_address_are_indexed_like_rows_added():
    # a compiled plain step writes its captured row at `stage_address()` and the engine
    # then calls `add_staged`: the index holds what `add` of the same rows would (across
    # the pending rows filling up and being stored, searches in between, growth past the
    # first buffer), and each returned row is the row written
    import ctypes

    from srsd_local.spec.index import MAX_PENDING

    x = _data(1500, seed=3) + 0.5
    added, staged = VectorIndex(32, 1600, "numpy"), VectorIndex(32, 1600, "numpy")
    added.add(x[:20], 0)
    staged.add(x[:20], 0)
    for pos in range(20, 1500):
        added.add(x[pos: pos + 1], pos)
        at = staged.stage_address()
        ctypes.memmove(at, x[pos].ctypes.data, x[pos].nbytes)
        row = staged.add_staged(pos)
        assert np.array_equal(row, x[pos])
        assert staged._staged <= MAX_PENDING
        if pos % 97 == 0:  # a search stores what is waiting (both indexes)
            a, b = staged.search(x[pos - 5], 4), added.search(x[pos - 5], 4)
            assert a.positions.tolist() == b.positions.tolist()
    _assert_same_rows(staged, added, 1500)
    full = VectorIndex(32, 1, "numpy")
    full.add(x[:1], 0)
    with pytest.raises(ValueError, match="full"):
        full.add_staged(1)

def test_a_runs_rows_written_at_the_stage_address_are_indexed_like_rows_added():
    # a run of plain steps writes its captured rows one after the other from
    # `stage_address(k)` and the engine calls `add_staged(position, k)`: the index holds what
    # `add` of the same rows would (runs of every length up to the pending rows' room, the
    # pending rows stored when a run would not fit, growth past the first buffers, searches
    # in between); the returned row is the run's last; bad sizes raise
    import ctypes

    from srsd_local.spec.index import MAX_PENDING

    rng = np.random.default_rng(7)
    x = _data(1500, seed=5) + 0.5
    added, staged = VectorIndex(32, 1600, "numpy"), VectorIndex(32, 1600, "numpy")
    added.add(x[:1], 0)  # (both centred on one row)
    at = staged.stage_address(1)
    ctypes.memmove(at, x[0].ctypes.data, x[0].nbytes)
    staged.add_staged(0, 1)
    pos, sizes = 1, set()
    while pos < 1500:
        k = min(int(rng.choice([1, 2, 3, 8, 17, MAX_PENDING])), 1500 - pos)
        sizes.add(k)
        added.add(x[pos: pos + k], pos)
        at = staged.stage_address(k)
        ctypes.memmove(at, x[pos: pos + k].ctypes.data, x[pos: pos + k].nbytes)
        row = staged.add_staged(pos, k)
        assert np.array_equal(row, x[pos + k - 1])
        assert staged._staged <= MAX_PENDING
        pos += k
        if rng.random() < 0.05:
            a, b = staged.search(x[pos - 3], 4), added.search(x[pos - 3], 4)
            assert a.positions.tolist() == b.positions.tolist()
    assert {1, MAX_PENDING} <= sizes
    _assert_same_rows(staged, added, 1500)
    for bad in (0, MAX_PENDING + 1):
        with pytest.raises(ValueError, match="rows to stage: accepted are 1 to"):
            staged.stage_address(bad)
    small = VectorIndex(32, 4, "numpy")
    small.add(x[:2], 0)
    small.stage_address(3)
    with pytest.raises(ValueError, match="full"):
        small.add_staged(2, 3)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_paths_rows_are_indexed_like_the_same_rows_added(compiled):
    # a tree step indexes the rows of its accepted path (node indices into the pass's rows,
    # a chain's first nodes or a path through branches): the index holds what `add` of
    # those rows would, across the pending rows filling up and being stored, searches in
    # between and growth past the first buffers; each returned row is the path's last row
    from srsd_local.spec.index import MAX_PENDING

    rng = np.random.default_rng(11)
    x = _data(1400, seed=4) + 0.5
    added, paths = VectorIndex(32, 1500, "numpy"), VectorIndex(32, 1500, "numpy")
    if compiled:
        assert paths._stage_path is not None, "the kernels' build is missing"
    else:
        paths._stage_path = None
    added.add(x[:30], 0)
    paths.add(x[:30], 0)
    pos, steps = 30, 0
    while pos < 1400:
        k = min(int(rng.integers(1, 20)), 1400 - pos)
        rows = rng.normal(size=(k + 12, 32)).astype(np.float32)  # the pass's rows
        path = sorted(rng.choice(np.arange(1, k + 12), size=k - 1, replace=False).tolist())
        path = [0, *path] if steps % 2 else list(range(k))  # through branches / a chain
        rows[path] = x[pos: pos + k]
        added.add(x[pos: pos + k], pos)
        row = paths.add_path(rows, path, pos)
        rows[:] = -9.0  # the pass's buffer is overwritten by the next pass
        assert np.array_equal(row, x[pos + k - 1])
        assert paths._staged <= MAX_PENDING
        pos, steps = pos + k, steps + 1
        if steps % 9 == 0:  # a search stores what is waiting (both indexes)
            a, b = paths.search(x[pos - 3], 4), added.search(x[pos - 3], 4)
            assert a.positions.tolist() == b.positions.tolist()
    _assert_same_rows(paths, added, 1400)
    full = VectorIndex(32, 3, "numpy")
    full.add(x[:2], 0)
    with pytest.raises(ValueError, match="full"):
        full.add_path(np.zeros((4, 32), np.float32), [0, 2], 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_copied_index_has_buffers_of_its_own(backend):
    # a copy (copy.deepcopy, pickle) of an index with rows waiting and searches behind it
    # gets its own pending rows, addresses and search state: a row written at its
    # stage_address is its own, and it goes on exactly as an index fed the same rows from
    # the start, while the original keeps what it had
    import copy
    import ctypes
    import pickle

    x = _data(410, seed=5) + 0.25
    toks = np.arange(410, dtype=np.int32) % 7

    def feed(index, lo, hi):
        for pos in range(lo, hi):
            if pos % 3:  # as a compiled plain step does
                ctypes.memmove(index.stage_address(), x[pos].ctypes.data, x[pos].nbytes)
                assert np.array_equal(index.add_staged(pos), x[pos])
            else:
                index.add(x[pos: pos + 1], pos)

    def start():
        index = VectorIndex(32, 500, backend)
        index.add(x[:100], 0)
        index.search_next(x[99], toks[:100], 3, 4, -1.0, 8, 2)
        index.search(x[10], 3)
        feed(index, 100, 110)  # rows waiting to be stored
        return index

    idx = start()
    for twin in (copy.deepcopy(idx), pickle.loads(pickle.dumps(idx))):
        assert twin.stage_address() != idx.stage_address()
        ref = start()
        for lo in range(110, 410, 50):
            feed(twin, lo, lo + 50)
            feed(ref, lo, lo + 50)
            q = x[lo + 43]
            assert twin.search(q, 5).positions.tolist() == ref.search(q, 5).positions.tolist()
            got = twin.search_next(q, toks[: lo + 50], 3, 4, -1.0, 8, 2)
            want = ref.search_next(q, toks[: lo + 50], 3, 4, -1.0, 8, 2)
            assert got.positions == want.positions and got.follow == want.follow
        twin._flush()
        ref._flush()
        assert len(twin) == len(ref) == 410
        assert np.array_equal(twin._buf[:410], ref._buf[:410])
        assert len(idx) == 110  # the original holds what it had, its waiting rows intact
        assert np.array_equal(np.asarray(idx._stage[:idx._staged]), x[100:110])


def _compiled_normalise():
    from srsd_local.spec import kernels

    kern = kernels.normalise_kernel()
    if kern is None:
        pytest.skip("no C compiler here: the index normalises with numpy")
    return kern


def test_the_compiled_normalisation_rounds_through_float16_exactly():
    """Rows [1, v, 0, ...] have length 1 in float32, so the kernel's stored v is v rounded
    to float16: it must be numpy's rounding bit for bit, over float16's normal and
    subnormal ranges and at exact ties (which go to even)."""
    kern = _compiled_normalise()
    rng = np.random.default_rng(1)
    v = (rng.uniform(2.0 ** -16, 2.0 ** -12, 20000) * rng.choice([-1, 1], 20000))
    odd = 2 * rng.integers(1, 2 ** 11, 2000) + 1  # odd multiples of 2^-25: ties
    v = np.concatenate([v, odd * 2.0 ** -25, -odd * 2.0 ** -25]).astype(np.float32)
    rows = np.zeros((len(v), 8), np.float32)
    rows[:, 0], rows[:, 3] = 1.0, v
    out = np.empty_like(rows)
    kern([rows[:7], rows[7:8], rows[8:]], np.zeros(8, np.float32), out)  # parts in a row
    assert np.all(out[:, 0] == 1.0)
    np.testing.assert_array_equal(out[:, 3], v.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_and_numpy_normalisation_store_the_same_rows_and_find_the_same(backend):
    # the length's last bit may differ (another summation order): a stored value at most
    # one float16 step apart, rarely; the hits are the same
    _compiled_normalise()
    x = _data(300, 64) + 0.5
    fast, ref = VectorIndex(64, 400, backend), VectorIndex(64, 400, backend)
    ref._kernel = None
    for idx in (fast, ref):
        idx.add(x[:100], 0)  # a prompt: stored at once
        for i in range(100, 300, 3):  # steps: a few rows each, stored at the next search
            idx.add(np.ascontiguousarray(x[i: i + 3]), i)
            if i % 30 == 1:
                idx.search(x[i], 4)
    assert fast._kernel is not None
    a, b = fast._normalise_parts([x[7]]), ref._normalise(x[7])
    assert np.abs(a - b).max() <= 2.0 ** -11
    for q in (x[5], x[150], x[299], _data(1, 64, seed=4)[0]):
        h, r = fast.search(q, 6), ref.search(q, 6)
        assert h.positions.tolist() == r.positions.tolist()
        np.testing.assert_allclose(h.scores, r.scores, atol=2e-3)
    assert fast.search(x[123], 1).positions[0] == 123
    for idx in (fast, ref):  # a query that is not one row is refused, not misread
        with pytest.raises(ValueError):
            idx.search(x[:2].ravel(), 3)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_index_can_be_flushed_copied_and_truncated(backend, kernel):
    # (another request's empty index is a donor like any other)
    if kernel:
        _compiled_normalise()
    empty, idx = VectorIndex(16, 50, backend), VectorIndex(16, 50, backend)
    if not kernel:
        empty._kernel = idx._kernel = None
    empty._flush()
    empty.truncate(0)
    idx.copy_from(empty, 10)
    assert len(idx) == 0 and idx.search(_data(1, 16)[0], 3).positions.size == 0
    x = _data(20, 16)
    idx.add(x, 0)
    assert idx.search(x[4], 1).positions.tolist() == [4]


def _next_hits_by_hand(idx, rows, indexed, query, tokens, root, k, min_score, max_agree):
    """search_next's answer from its definition: every indexed position root follows,
    scored against the stored form of its row."""
    n = len(tokens)
    q = idx._normalise(query)[0]
    found = []
    for j in range(n - 2):
        if tokens[j + 1] == root and j in indexed:
            s = float(idx._normalise(rows[j])[0] @ q)
            if s >= min_score:
                found.append((-s, j))
    found.sort()
    hits = []
    for s, j in found[:k]:
        a = 1
        while a < max_agree and j - a + 1 >= 0 and tokens[j - a + 1] == tokens[n - a]:
            a += 1
        hits.append((j, -s, a))
    return hits


@pytest.mark.parametrize("kernel", [True, False])
def test_search_next_compares_only_the_positions_the_next_token_follows(kernel):
    # a context of few distinct tokens (many positions each follows), rows added as a
    # prompt block, then step by step (pending until the search, which stores them), a
    # position left out of the index, the context cut back and re-grown, a copy
    if kernel:
        _compiled_normalise()
    rng = np.random.default_rng(5)
    n, dim = 240, 24
    tokens = rng.integers(0, 6, n).astype(np.int32)
    rows = rng.normal(size=(n, dim)).astype(np.float32) + 0.3
    idx = VectorIndex(dim, 400, "numpy")
    if not kernel:
        idx._kernel = idx._retrieve = None
    idx.add(rows[:100], 0)
    indexed = set(range(100))
    for i in range(100, 200):
        if i != 150:  # (a step whose row was not captured)
            idx.add(rows[i], i)
            indexed.add(i)
    assert idx._staged > 0
    for _ in range(20):
        query = rows[rng.integers(0, 200)] + rng.normal(size=dim).astype(np.float32) * 0.5
        ctx, root = tokens[:200], int(tokens[rng.integers(0, 200)])
        k, min_score = int(rng.integers(1, 9)), float(rng.choice([-1.0, 0.0, 0.2]))
        depth = int(rng.choice([0, 1, 5, 16]))
        got = idx.search_next(query, ctx, root, k, min_score, 8, depth)
        want = _next_hits_by_hand(idx, rows, indexed, query, ctx, root, k, min_score, 8)
        assert got.positions == [j for j, _, _ in want]
        np.testing.assert_allclose(got.scores, [s for _, s, _ in want], atol=1e-5)
        assert got.agree == [a for _, _, a in want]
        assert all(ctx[j + 1] == root for j in got.positions)
        # with a depth, the tokens after each hit's root (fewer at the context's end)
        assert got.follow == ([ctx[j + 2: j + 2 + depth].tolist() for j in got.positions]
                              if depth else None)
    end = idx.search_next(rows[196], tokens[:199], int(tokens[197]), 8, -1.0, 8, 6)
    assert end.positions[0] == 196 and end.follow[0] == [int(tokens[198])]  # cut short
    assert end.follow == [tokens[j + 2: min(j + 8, 199)].tolist() for j in end.positions]
    assert idx._staged == 0 and idx._stored == len(idx) == 199
    # stored rows are those a block stores: the same float16 values
    ref = VectorIndex(dim, 400, "numpy")
    ref._kernel = idx._kernel
    ref.add(rows[:100], 0)
    ref.add(np.delete(rows[100:200], 50, axis=0), [i for i in range(100, 200) if i != 150])
    ref._flush()
    np.testing.assert_array_equal(idx._buf[:199], ref._buf[:199])
    idx.truncate(120)
    indexed = set(range(120))
    got = idx.search_next(rows[130], tokens[:200], int(tokens[131]), 50, -1.0, 8)
    assert got.positions and max(got.positions) < 120
    for i in range(120, 180):
        idx.add(rows[i], i)
        indexed.add(i)
    copy = VectorIndex(dim, 400, "numpy")
    copy.copy_from(idx, 170)
    for index, known in ((idx, indexed), (copy, set(range(170)))):
        for root in range(6):
            got = index.search_next(rows[160], tokens[:180], root, 6, -1.0, 8)
            want = _next_hits_by_hand(index, rows, known, rows[160], tokens[:180], root, 6,
                                      -1.0, 8)
            assert got.positions == [j for j, _, _ in want]
    assert idx.search_next(rows[0], tokens[:2], int(tokens[1]), 5, -1.0, 8).positions == []
    assert VectorIndex(dim, 10, "numpy").search_next(rows[0], tokens, 1, 5, -1.0, 8).positions \
        == []
    with pytest.raises(ValueError, match="one row of 24"):
        idx.search_next(rows[:2].ravel(), tokens, 1, 5, -1.0, 8)


@pytest.mark.parametrize("kernel", [True, False])
def test_search_next_finds_rows_stored_after_the_index_grew(kernel):
    # the buffer and the position map are replaced as the context grows past them (the
    # kernel is given their new addresses), as is the centre when the index is cleared
    if kernel:
        _compiled_normalise()
    x = _data(2600, 16)
    tokens = (np.arange(2600) % 5).astype(np.int32)
    idx = VectorIndex(16, 3000, "numpy")
    if not kernel:
        idx._kernel = idx._retrieve = None
    for _ in range(2):
        idx.add(x[:1000], 0)
        assert idx.search_next(x[500], tokens[:1000], 1, 1, -1.0, 8).positions == [500]
        for i in range(1000, 2600):
            idx.add(x[i], i)
        for j in (1200, 2500, 2590):
            got = idx.search_next(x[j], tokens, int(tokens[j + 1]), 2, -1.0, 8)
            assert got.positions[0] == j and got.scores[0] == pytest.approx(1.0, abs=2e-3)
        idx.clear()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_faiss_index_is_filled_from_the_stored_rows_when_searched(backend):
    # rows stored for search_next reach a full search later; a cut drops them from it
    x = _data(150)
    tokens = np.arange(150, dtype=np.int32) % 7
    idx = VectorIndex(32, 400, backend)
    idx.add(x[:60], 0)
    for i in range(60, 150):
        idx.add(x[i], i)
        if i % 20 == 0:
            idx.search_next(x[i], tokens[: i + 1], int(tokens[i]), 3, -1.0, 8)
    assert idx.search(x[140], 1).positions.tolist() == [140]
    idx.truncate(100)
    assert idx.search(x[140], 3).positions.max() < 100
    idx.add(x[100:110], 100)
    assert idx.search(x[105], 1).positions.tolist() == [105]


def test_centre_is_estimated_once_from_the_first_rows():
    x = _data() + 5.0  # a shared offset that would dominate cosine similarity
    idx = VectorIndex(32, 400, "numpy")
    idx.add(x[:100], np.arange(100))
    c = idx.center.copy()
    idx.add(x[100:], np.arange(100, 300))
    np.testing.assert_array_equal(idx.center, c)
    np.testing.assert_allclose(c, x[:100].mean(axis=0), rtol=1e-5)
    assert idx.search(x[250], 1).positions[0] == 250


def test_capacity_and_errors():
    idx = VectorIndex(4, 10, "numpy")
    with pytest.raises(ValueError, match="index is full"):
        idx.add(np.ones((11, 4)), np.arange(11))
    with pytest.raises(ValueError, match="rows"):
        idx.add(np.ones((3, 4)), np.arange(2))
    with pytest.raises(ValueError, match="accepted are"):
        choose_backend("annoy")
    if not gpu_available():
        with pytest.raises(ValueError, match="faiss-gpu"):
            choose_backend("faiss-gpu")
    assert choose_backend("auto") in ("faiss-gpu", "faiss-cpu", "numpy")


def test_index_memory_for_a_32k_context_of_a_4096_wide_model():
    idx = VectorIndex(4096, 32768, "numpy")
    assert idx.memory_bytes() < 300e6
    assert idx._buf.nbytes < 300e6  # nothing is allocated up front beyond the first block


def _cfg(**kw):
    return SRSDConfig(**{"draft_depth": 4, "max_nodes": 16, "max_branches": 4, **kw})


def test_ngram_drafter_continues_the_longest_match():
    ctx = np.array([5, 1, 2, 3, 4, 9, 9, 1, 2], dtype=np.int32)
    tree = NgramDrafter(_cfg()).draft(DraftInput(ctx, root=3, query=None, index=None))
    # suffix ... 1 2 3 matches at positions 1..3; continuation 4 9 9 1
    node, toks = 0, []
    while tree.children(node):
        node = max(tree.children(node), key=lambda c: tree.weights[c])
        toks.append(tree.tokens[node])
    assert toks == [4, 9, 9, 1]
    none = NgramDrafter(_cfg()).draft(DraftInput(ctx, root=77, query=None, index=None))
    assert none.n_draft == 0


def test_ngram_single_branch_is_linear_pld():
    ctx = np.array([1, 2, 3, 1, 2, 4, 1], dtype=np.int32)
    tree = NgramDrafter(_cfg(max_branches=1)).draft(DraftInput(ctx, 2, None, None))
    assert all(len(tree.children(i)) <= 1 for i in range(len(tree)))
    assert tree.n_draft > 0


def test_semantic_drafter_gates_on_the_next_token():
    dim = 8
    rng = np.random.default_rng(0)
    ctx = np.array([10, 11, 12, 13, 14, 15, 10, 11, 20, 21, 22], dtype=np.int32)
    rows = rng.normal(size=(len(ctx), dim)).astype(np.float32)
    idx = VectorIndex(dim, 64, "numpy")
    idx.add(rows, np.arange(len(ctx)))
    # query looks like position 0 (token 10), next token is 11 -> hit j=0 passes the gate
    q = rows[0] + 0.01
    tree = SemanticDrafter(_cfg(top_k=3, min_similarity=0.5)).draft(
        DraftInput(ctx, root=11, query=q, index=idx))
    assert tree.path_tokens(len(tree) - 1) == [12, 13, 14, 15]
    # same query but the known next token differs -> the hit is gated out
    gated = SemanticDrafter(_cfg(top_k=3, min_similarity=0.5)).draft(
        DraftInput(ctx, root=99, query=q, index=idx))
    assert gated.n_draft == 0
    # the original search over every position drafts the same here
    full = SemanticDrafter(_cfg(top_k=3, min_similarity=0.5, retrieval_search="all")).draft(
        DraftInput(ctx, root=11, query=q, index=idx))
    assert full.path_tokens(len(full) - 1) == [12, 13, 14, 15]
    # a root the context never held before its last position: no hit could pass the gate,
    # and the whole index is not even searched
    class Unsearched(VectorIndex):
        def search(self, query, k):
            raise AssertionError("searched")

    quiet = Unsearched(dim, 64, "numpy")
    quiet.add(rows, np.arange(len(ctx)))
    for search in ("next", "all"):
        for root in (99, 22):  # (22 is the last token: nothing after it to draft)
            assert SemanticDrafter(_cfg(top_k=3, min_similarity=0.5,
                                        retrieval_search=search)).propose(
                DraftInput(ctx, root=root, query=q, index=quiet)) == []
    # weak similarity drafts nothing
    weak = SemanticDrafter(_cfg(top_k=3, min_similarity=0.999)).draft(
        DraftInput(ctx, root=11, query=rng.normal(size=dim).astype(np.float32), index=idx))
    assert weak.n_draft == 0


def test_hybrid_merges_both_sources_and_respects_budget():
    ctx = np.array([1, 2, 3, 4, 5, 6, 1, 2], dtype=np.int32)
    rows = np.eye(8, dtype=np.float32)
    idx = VectorIndex(8, 16, "numpy")
    idx.add(rows, np.arange(8))
    cfg = _cfg(top_k=8, min_similarity=-1.0, max_nodes=3)
    tree = make_drafter("hybrid", cfg).draft(DraftInput(ctx, 3, rows[1], idx))
    assert 0 < tree.n_draft <= 3
    # every node remembers its sources: retrieval (bit 1) and prompt lookup (bit 4)
    assert all(o & (1 | 4) for o in tree.origin[1:])
    big = make_drafter("hybrid", cfg.with_(max_nodes=16)).draft(DraftInput(ctx, 3, rows[1], idx))
    assert {o for o in big.origin[1:]} - {1, 4, 5} == set() and 5 in big.origin[1:]
    assert make_drafter("ar", cfg) is None
    with pytest.raises(ValueError, match="accepted"):
        make_drafter("turbo", cfg)


def test_an_arrays_address_is_read_from_the_array_object_and_equals_numpys():
    """kernels.array_address: where the kernels are built, the compiled read of the data
    pointer (not numpy's `.ctypes`, a helper object made in Python code); its answer is
    `.ctypes.data` for arrays, slices, views, rows of 2-D arrays and strided views."""
    from srsd_local.spec import kernels

    address = kernels.array_address()
    if kernels.library() is not None:
        assert address is not kernels._ctypes_address
    base = np.arange(4097, dtype=np.int32)
    rows = np.random.default_rng(0).standard_normal((16, 640)).astype(np.float32)
    for a in (base, base[:100], base[37:], base[::3], rows, rows[5], rows[3:9], rows[:, 7],
              rows.T, np.zeros(0, np.float64), np.float32(1.5) * np.ones(3, np.float32)):
        assert address(a) == a.ctypes.data

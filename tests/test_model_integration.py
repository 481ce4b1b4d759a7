"""Integration tests on the real default model (Gemma 3 270M)."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from text_data import MAX_TIE_GAP, edit_prompt

from srsd_local.config import SRSDConfig
from srsd_local.engine import Engine
from srsd_local.engine.calibrate import load_calibration_file
from srsd_local.engine.emit import TextStream
from srsd_local.llama.backend import Backend, ContextFullError
from srsd_local.llama.capture import resolve_layer
from srsd_local.llama.models import ModelError
from srsd_local.spec.acceptance import AcceptanceModel
from srsd_local.spec.cost import CostModel
from srsd_local.spec.speculator import Speculator

pytestmark = pytest.mark.model



def test_tokenize_detokenize_round_trip(backend):
    for text in ["def fib(n):\n    return n", "Grüße, 世界! café ☕", "  leading spaces\ttabs"]:
        ids = backend.tokenize(text, add_bos=False)
        assert ids and backend.detokenize(ids) == text
    assert backend.tokenize("x")[0] != backend.tokenize("x", add_bos=False)[0]  # BOS


def test_drafting_tokenizer_gives_llama_cpps_tokens(engine, monkeypatch):
    """Drafting's short texts are tokenized by the Python SPM tokenizer (llama/spm.py) on
    this model: the tokens llama.cpp gives, on 4,000 pieces of the workloads' prompts (every
    length the fast path takes), and llama.cpp's own where it is turned off."""
    import random  # noqa: PLC0415

    from srsd_local.bench.workloads import load_workload  # noqa: PLC0415
    from srsd_local.llama import backend as backend_mod  # noqa: PLC0415

    be = engine.backend
    tokenize = be.text_tokenizer()
    assert tokenize is engine._text_tokens
    # the fast path is in use: it never calls llama.cpp for a short text
    calls = []
    real = be.tokenize
    monkeypatch.setattr(be, "tokenize", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert tokenize("    return x\n\n<b>") and not calls
    monkeypatch.setattr(be, "tokenize", real)
    rng = random.Random(7)
    texts = [p.prompt for spec in ("code_edit", "text_edit", "humaneval", "json", "open")
             for p in load_workload(spec)]
    pieces = [*backend_mod.SPM_CHECKS, "\t\tif x:\n\t\t\treturn", " " * 33 + "x", "\u00e9\u0301"]
    for _ in range(4000):
        t = rng.choice(texts)
        i = rng.randrange(len(t))
        pieces.append(t[i: i + rng.randint(1, backend_mod.SPM_MAX_CHARS + 8)])
    wrong = [p for p in pieces if tokenize(p) != be.tokenize(p, add_bos=False, special=False)]
    assert not wrong, wrong[:5]
    monkeypatch.setenv("SRSD_TOKENIZER", "llama")
    slow = be._make_text_tokenizer()
    calls.clear()
    monkeypatch.setattr(be, "tokenize", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert slow("def f():") == tokenize("def f():") and calls


def test_incremental_detokenizer_never_splits_utf8(backend):
    text = "emoji 🦙🦙 and 世界"
    ids = backend.tokenize(text, add_bos=False)
    stream = TextStream(backend.piece)
    chunks = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


def test_hidden_rows_shape_and_batch_split_invariance(backend):
    ids = backend.tokenize("import os\nimport sys\n\ndef main():\n    print(os.getcwd())\n")
    backend.clear()
    whole = backend.decode(ids, want_logits="last")
    rows_whole = whole.hidden.copy()
    logit_whole = whole.logits[-1].copy()
    assert rows_whole.shape == (len(ids), backend.n_embd)
    assert rows_whole.dtype == np.float32 and np.isfinite(rows_whole).all()
    backend.clear()
    half = len(ids) // 2
    a = backend.decode(ids[:half], want_logits="none").hidden.copy()
    b = backend.decode(ids[half:], want_logits="last")
    rows_split = np.concatenate([a, b.hidden])
    np.testing.assert_allclose(rows_split, rows_whole, rtol=0.05, atol=0.05 * np.abs(
        rows_whole).max())
    assert int(np.argmax(b.logits[-1])) == int(np.argmax(logit_whole))
    backend.clear()


def test_the_index_finds_the_same_hits_compiled_and_in_numpy_on_real_hidden_rows(backend):
    """The engine's index, fed the real model's hidden rows (a prompt at once, then rows
    one by one as decode steps add them), finds the same positions whether its rows were
    normalised by the compiled kernel or by numpy."""
    from srsd_local.spec import kernels
    from srsd_local.spec.index import VectorIndex

    if kernels.normalise_kernel() is None:
        pytest.skip("no C compiler here: the index normalises with numpy")
    ids = backend.tokenize("def mean(xs):\n    return sum(xs) / len(xs)\n\n"
                           "def total(xs):\n    return sum(xs)\n\ndef mean2(xs):\n")
    backend.clear()
    rows = backend.decode(ids, want_logits="none").hidden.copy()
    backend.clear()
    fast, ref = VectorIndex(backend.n_embd, 256), VectorIndex(backend.n_embd, 256)
    ref._kernel = None
    assert fast._kernel is not None
    for idx in (fast, ref):
        idx.add(rows[:20], 0)
        for i in range(20, len(rows)):
            idx.add(rows[i: i + 1], i)
    for q in (5, len(rows) // 2, len(rows) - 1):
        h, r = fast.search(rows[q], 5), ref.search(rows[q], 5)
        assert h.positions.tolist() == r.positions.tolist() and h.positions[0] == q
        np.testing.assert_allclose(h.scores, r.scores, atol=2e-3)
    # the search among the positions a token follows: the same compiled and in numpy, the
    # position itself first, and what the full search finds there, in its order
    ref._retrieve = None
    toks = np.asarray(ids, np.int32)
    for q in (3, 9, len(rows) // 2, len(rows) - 3):
        root = int(toks[q + 1])
        h = fast.search_next(rows[q], toks, root, 4, -1.0, 8)
        r = ref.search_next(rows[q], toks, root, 4, -1.0, 8)
        assert h.positions == r.positions and h.positions[0] == q and h.agree == r.agree
        np.testing.assert_allclose(h.scores, r.scores, atol=2e-3)
        full = fast.search(rows[q], len(rows)).positions.tolist()
        assert h.positions == [j for j in full if j + 2 < len(toks) and toks[j + 1] == root][:4]


def test_decode_splits_batches_larger_than_n_batch(backend):
    ids = backend.tokenize("word " * 400)  # > n_batch=256
    backend.clear()
    out = backend.decode(ids, want_logits="last")
    assert out.hidden.shape == (len(ids), backend.n_embd) and out.logits.shape[0] == 1
    assert backend.n_past == len(ids)
    # logits wanted in both llama_decode calls: the first call's rows survive the second
    backend.clear()
    flags = [0] * len(ids)
    flags[10] = flags[-1] = 1
    both = backend.decode(ids, want_logits=flags).logits
    backend.clear()
    alone = backend.decode(ids[:11], want_logits="last").logits[-1]
    assert int(np.argmax(both[0])) == int(np.argmax(alone))
    assert float(np.abs(both[0] - alone).max()) < 1.0
    backend.clear()


def test_a_decode_waits_for_its_forward_pass_inside_the_timed_call(backend, monkeypatch):
    """llama_decode returns once a pass is queued (on a GPU it is still running): each
    successful call is followed by llama_synchronize inside the time counted as decoding,
    so a slow device's wait is decode time, not host time; a failed call does not wait."""
    from srsd_local.llama import backend as backend_mod
    from srsd_local.llama.backend import DecodeError

    waits = []
    real = backend_mod._synchronize

    def slow(L, ctx):
        real(L, ctx)
        time.sleep(0.05)
        waits.append(ctx)
    monkeypatch.setattr(backend_mod, "_synchronize", slow)
    monkeypatch.setattr(backend, "_stepper", None)  # the plain step through ctypes (the
    # compiled one: the next test)
    backend.clear()
    before = backend.decode_seconds
    ids = backend.tokenize("one two three")
    backend.decode(ids, want_logits="last")
    backend.step(ids[0])
    assert waits == [backend.ctx, backend.ctx]
    assert backend.decode_seconds - before >= 2 * 0.05
    with pytest.raises(DecodeError, match="failed with code"):  # a sequence id out of range
        backend.step_at(ids[0], backend.n_past, 10_000)
    assert len(waits) == 2
    backend.clear()


def test_the_compiled_plain_step_waits_for_its_pass_and_equals_the_ctypes_step(backend):
    """A plain step is one compiled call (`srsd_step_one`): it writes the batch, switches and
    empties the capture, times llama_decode and llama_synchronize (a slow device's wait is
    decode time), reads the in-graph token and can put the captured row where it is told; a
    failed call does not wait. Its logits, hidden row and token equal the same step made
    through ctypes, with the capture on and off."""
    import ctypes

    from srsd_local.llama import backend as backend_mod
    from srsd_local.llama.backend import DecodeError

    assert backend._stepper is not None  # built with the system's C compiler
    st = backend._step_state
    real = backend_mod._ctx_fn(backend._L, "llama_synchronize", None)
    waits = []

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def slow(ctx):
        real(ctx)
        time.sleep(0.05)
        waits.append(ctx)

    ids = backend.tokenize("one two three four")
    compiled_sync = st.sync
    st.sync = ctypes.cast(slow, ctypes.c_void_p).value
    try:
        backend.clear()
        backend.decode(ids[:-1], want_logits="last")
        before = backend.decode_seconds
        backend.step(ids[-1])
        assert waits == [backend.ctx]
        assert backend.decode_seconds - before >= 0.05
        with pytest.raises(DecodeError, match="failed with code"):  # a sequence id out of range
            backend.step_at(ids[0], backend.n_past, 10_000)
        assert len(waits) == 1
    finally:
        st.sync = compiled_sync

    def one_step(compiled: bool, capture: bool):
        backend.clear()
        backend.decode(ids[:-1], want_logits="last")
        stepper = backend._stepper
        if not compiled:
            backend._stepper = None
        try:
            out = backend.step_at(ids[-1], len(ids) - 1, 0, capture)
        finally:
            backend._stepper = stepper
        return (out.logits.copy(), None if out.hidden is None else out.hidden.copy(),
                backend.capture.enabled)

    try:
        for capture in (True, False):
            got, want = one_step(True, capture), one_step(False, capture)
            assert np.array_equal(got[0], want[0]) and got[0].shape == (1, backend.n_vocab)
            assert got[2] is want[2] is capture
            if capture:
                assert got[1].shape == (1, backend.n_embd)
                assert np.array_equal(got[1], want[1])
            else:
                assert got[1] is None and want[1] is None
        # with an address to stage the row at (the index's next pending row): the row goes
        # there instead of coming back; not with the capture off
        stage = np.full(backend.n_embd, -1.0, np.float32)
        for capture in (False, True):
            backend.clear()
            backend.decode(ids[:-1], want_logits="last")
            out = backend.step_at(ids[-1], len(ids) - 1, 0, capture, stage.ctypes.data)
            assert out.staged == int(capture) and out.hidden is None
        assert np.array_equal(stage, one_step(False, True)[1][0])
        # sampled in the graph: the token is llama.cpp's argmax of the row
        backend.clear()
        backend.decode(ids[:-1], want_logits="last")  # (takes sequence 0's sampler off)
        assert backend.sample_main(0, True)
        out = backend.step_at(ids[-1], len(ids) - 1, 0, True)
        token = out.sampled[0]
        assert np.isnan(out.logits).all()
        assert token == int(np.argmax(one_step(False, True)[0][0]))
    finally:
        backend.sample_main(0, False)
        backend.capture.enabled = True
        backend.clear()

def _sequential_rows(backend, prefix, branch):
    backend.clear()
    out = backend.decode(prefix + branch, want_logits="all")
    rows = out.logits[len(prefix) - 1:].copy()
    backend.clear()
    return rows


def _same_argmax_up_to_ties(rows, ref_rows):
    for r, ref in zip(rows, ref_rows):
        top = np.sort(ref)
        if int(np.argmax(r)) != int(np.argmax(ref)):
            assert top[-1] - top[-2] < MAX_TIE_GAP, "argmax differs where the model was sure"


def _tree_pass(backend, prefix, root, b1, b2):
    backend.clear()
    backend.decode(prefix, want_logits="none")
    n = backend.n_past
    depths = [0, 1, 2, 3, 1, 2, 3]
    seq_ids = [[0, 1], [0], [0], [0], [1], [1], [1]]
    backend.fork(2)
    out = backend.decode([root] + b1 + b2, positions=[n + d for d in depths], seq_ids=seq_ids,
                         want_logits="all")
    return n, out.logits.copy()


def test_two_branch_tree_matches_sequential_decoding(backend):
    prefix = backend.tokenize("The capital of France is")
    root = backend.tokenize(" Paris", add_bos=False)[0]
    b1 = backend.tokenize(". It is a city", add_bos=False)[:3]
    b2 = backend.tokenize(", and the", add_bos=False)[:3]
    seq_a = _sequential_rows(backend, prefix, [root] + b1)
    seq_b = _sequential_rows(backend, prefix, [root] + b2)
    _, other = _tree_pass(backend, prefix, root, [1000, 2000, 3000], b2)
    n, tree = _tree_pass(backend, prefix, root, b1, b2)
    # the branches do not see each other: branch b is bit-identical whatever branch a holds
    np.testing.assert_array_equal(tree[4:], other[4:])
    # and every node predicts what sequential decoding predicts (up to near-ties: batched
    # kernels round differently)
    _same_argmax_up_to_ties(tree[:4], seq_a[1:])
    _same_argmax_up_to_ties(tree[[0, 4, 5, 6]], seq_b[1:])
    assert int(np.argmax(tree[0])) == int(np.argmax(seq_a[1]))
    # keep branch 1 (root + 2 nodes): the next-token argmax equals a fresh sequential run
    backend.commit(branch=1, n_keep=3, n_branches=2)
    assert backend.n_past == n + 3
    nxt = backend.decode([b2[2]], want_logits="last").logits[-1].copy()
    fresh = _sequential_rows(backend, prefix, [root] + b2)[-1]
    _same_argmax_up_to_ties([nxt], [fresh])
    np.testing.assert_allclose(nxt, fresh, atol=2.0)


def test_branch_ids_keep_the_context_between_trees_and_lose_what_is_cut(backend):
    """A commit drops only the tree's cells from the branch ids and the next fork copies
    only what the main sequence got since (not the whole context each time); a cut of the
    main sequence cuts the branch ids too, so a later tree sees the new context, not stale
    cells. Every tree's rows predict what sequential decoding of its context predicts."""
    L, mem = backend._L, backend.mem
    text = backend.tokenize("The quick brown fox jumps over the lazy dog. " * 6)
    alt = backend.tokenize("Once upon a time there was a small cottage in the woods. " * 2,
                           add_bos=False)
    depths = [0, 1, 2, 1, 2]
    seq_ids = [[0, 1, 2], [0], [0], [1, 2], [1]]
    trees = []  # (context in the KV cache, root, branch a, branch b, the tree's rows)

    def tree(kv, root, a, b):  # branch 0 goes on with `a`, branches 1 and 2 with `b`
        n = backend.n_past
        assert n == len(kv)
        backend.fork(3)
        rows = backend.decode([root, *a, *b], positions=[n + d for d in depths],
                              seq_ids=seq_ids, want_logits="all").logits.copy()
        trees.append((list(kv), root, a, b, rows))
        return n

    def pos_max(s):
        return L.llama_memory_seq_pos_max(mem, s)

    backend.clear()
    kv = text[:29]
    backend.decode(kv, want_logits="none")
    copies, starts = [], []
    seq_cp = L.llama_memory_seq_cp
    L.llama_memory_seq_cp = lambda m, a, b, p0, p1: copies.append((a, p0)) or seq_cp(
        m, a, b, p0, p1)
    try:
        for k in range(3):
            i = len(kv)
            starts.append(tree(kv, text[i], text[i + 1: i + 3], alt[k: k + 2]))
            backend.commit(branch=1, n_keep=2, n_branches=3)  # the root and b's first
            kv = kv + [text[i], alt[k]]
            assert pos_max(0) == len(kv) - 1 and pos_max(1) == pos_max(2) == starts[-1] - 1
            backend.decode([text[i + 1]], want_logits="none")  # a plain step
            kv.append(text[i + 1])
    finally:
        L.llama_memory_seq_cp = seq_cp
    # the first fork copied the whole context into each branch id, the later ones only the
    # cells the main sequence got since the branch ids' last tree (the commits' copies are
    # from branch 1 into the main sequence)
    assert [p0 for src, p0 in copies if src == 0] == [0, 0, starts[0], starts[0], starts[1],
                                                       starts[1]]
    # cut the context back into its first part: the branch ids lose the cut cells too
    backend.trim(10)
    assert pos_max(0) == pos_max(1) == pos_max(2) == 9
    kv = text[:10] + alt[:12]
    backend.decode(kv[10:], want_logits="none")
    n = tree(kv, alt[12], alt[13:15], text[5:7])
    backend.abandon(3)
    assert pos_max(0) == n - 1 and pos_max(1) == pos_max(2) == n - 1
    backend.clear()
    assert pos_max(0) == pos_max(1) == pos_max(2) == -1
    for kv, root, a, b, rows in trees:
        _same_argmax_up_to_ties(rows[[0, 1, 2]], _sequential_rows(backend, kv, [root, *a])[1:])
        ref = _sequential_rows(backend, kv, [root, *b])[1:]
        _same_argmax_up_to_ties(rows[[0, 3, 4]], ref)
        np.testing.assert_allclose(rows[[0, 3, 4]], ref, atol=2.0)


def test_bad_layer_and_bad_model_errors(model_path):
    assert resolve_layer(0.25, 18) == 4
    with pytest.raises(ValueError, match="accepted are 0..16"):
        resolve_layer(17, 18)
    with pytest.raises(ValueError, match="layer"):
        Backend(model_path, SRSDConfig(n_ctx=256), capture_layer=99)
    with pytest.raises(ModelError, match="not found"):
        Engine.load("/no/such/model.gguf")


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(engine):
    p = "def quicksort(arr):"
    a = engine.generate(p, max_tokens=24, mode="ar")
    b = engine.generate(p, max_tokens=24, mode="ar")
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24 and a.finish_reason == "length"
    kw = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=11, mode="ar")
    s1, s2 = engine.generate(p, **kw), engine.generate(p, **kw)
    assert s1.token_ids == s2.token_ids
    s3 = engine.generate(p, **{**kw, "seed": 12})
    assert s3.token_ids != s1.token_ids


def test_host_time_per_step_covers_emitting_the_steps_text(engine, monkeypatch):
    """The stats' host time is everything outside llama_decode from one step's end to the
    next's, emitting included: a planted 5 ms in every emit shows in every step's (a run of
    plain steps emits once: once in the run's)."""
    from srsd_local.engine import emit  # noqa: PLC0415

    push = emit.Emitter.push

    def slow(self, *a, **k):
        time.sleep(0.005)
        return push(self, *a, **k)

    monkeypatch.setattr(emit.Emitter, "push", slow)
    for mode in ("ar", "srsd"):
        events = list(engine.stream("def quicksort(arr):", max_tokens=12, mode=mode))
        s = events[-1].stats  # (each event but the last was emitted before a step)
        assert len(s.tree_sizes) >= 2 and len(events) >= 2
        assert s.host_plain + s.host_tree >= 0.005 * (len(events) - 1), mode


@pytest.fixture
def fixed_trees(engine):
    """The engine with the controller off: every drafted tree is verified."""
    engine.reconfigure(adaptive=False)
    yield engine
    engine.reconfigure(adaptive=True)


@pytest.mark.parametrize("mode", ["pld", "srsd", "hybrid"])
def test_speculative_greedy_equals_plain_at_every_position(fixed_trees, mode):
    engine = fixed_trees
    prompt = edit_prompt()
    plain = engine.generate(prompt, max_tokens=120, mode="ar")
    spec = engine.generate(prompt, max_tokens=120, mode=mode)
    assert spec.stats.mean_accepted_length > 1.5, "an edit prompt must accept drafts"
    assert spec.stats.steps < plain.stats.steps
    rep = engine.verify_output(prompt, spec.token_ids)
    assert rep.ok, rep.summary()
    assert rep.positions == len(spec.token_ids) == len(plain.token_ids)


@pytest.mark.parametrize("search", ["next", "all"])
def test_both_retrieval_searches_draft_an_edit_and_equal_plain(fixed_trees, search):
    engine = fixed_trees
    prompt = edit_prompt()
    plain = engine.generate(prompt, max_tokens=96, mode="ar")
    engine.reconfigure(retrieval_search=search)
    try:
        spec = engine.generate(prompt, max_tokens=96, mode="retrieval")
    finally:
        engine.reconfigure(retrieval_search="next")
    assert spec.stats.mean_accepted_length > 1.5, "an edit prompt must accept drafts"
    assert spec.token_ids == plain.token_ids or engine.verify_output(prompt, spec.token_ids).ok


def test_text_lookup_drafts_are_verified_and_accepted_on_the_real_model(fixed_trees,
                                                                         monkeypatch):
    from srsd_local.spec.speculator import Speculator
    from srsd_local.spec.textlookup import TextLookupDrafter

    engine = fixed_trees
    seen = [0, 0]  # text-lookup nodes accepted, verified (their parent was accepted)
    real_observe = Speculator.observe

    def spy(self, req, plan, path):
        if plan is not None:
            t, on = plan.tree, set(path)
            for node in range(1, len(t)):
                if t.origin[node] & TextLookupDrafter.origin and t.parents[node] in on:
                    seen[0] += node in on
                    seen[1] += 1
        real_observe(self, req, plan, path)

    monkeypatch.setattr(Speculator, "observe", spy)
    spec = engine.generate(edit_prompt(), max_tokens=80, mode="srsd")
    assert seen[1] > 0, "text lookup drafted nothing on an edit prompt"
    assert seen[0] >= 10, "text lookup's drafts were never accepted"
    rep = engine.verify_output(edit_prompt(), spec.token_ids)
    assert rep.ok, rep.summary()


def test_a_rewrapped_copy_is_drafted_from_the_collapsed_text_on_the_real_model(fixed_trees,
                                                                              monkeypatch):
    # a docstring wrapped over lines, which the model copies re-wrapped: where the exact text
    # lookup proposes the original line breaks, the collapsed text proposes what it writes
    from srsd_local.bench.workloads import load_workload
    from srsd_local.spec.textlookup import TextLookupDrafter

    engine = fixed_trees
    proposals: dict[int, dict[str, list]] = {}  # context length -> {"flat"/"exact": drafts}
    real_add = TextLookupDrafter._add

    def spy(self, out, seen, cache, text, start, size, inp):
        before = len(out)
        real_add(self, out, seen, cache, text, start, size, inp)
        if len(out) > before:
            kind = "flat" if cache is self._flat_cache else "exact"
            step = proposals.setdefault(len(inp.tokens), {"flat": [], "exact": []})
            step[kind].append(list(out[-1][0]))

    monkeypatch.setattr(TextLookupDrafter, "_add", spy)
    prompt = load_workload("json")[0].prompt  # textwrap.shorten's docstring, wrapped
    engine.forget_outputs()
    res = engine.generate(prompt, max_tokens=80, mode="srsd")
    out, p = res.token_ids, res.stats.prompt_tokens
    only_flat = 0  # steps where the collapsed text alone proposed the next 3 tokens right
    for ctx, step in proposals.items():
        nxt = out[ctx - p + 1: ctx - p + 4]
        if len(nxt) == 3 and any(d[:3] == nxt for d in step["flat"]) \
                and not any(d[:3] == nxt for d in step["exact"]):
            only_flat += 1
    assert only_flat >= 2, (only_flat, res.text)
    rep = engine.verify_output(prompt, res.token_ids)
    assert rep.ok, rep.summary()


def test_controller_on_the_real_model_follows_the_cost(engine):
    prompt = edit_prompt()
    plain = engine.generate(prompt, max_tokens=80, mode="ar")
    saved = engine.speculator.cost
    try:
        # verification nearly free (as on a big GPU): large trees, many tokens per step
        engine.speculator.cost = CostModel([1, 2, 64], [0.010, 0.0102, 0.011])
        cheap = engine.generate(prompt, max_tokens=80, mode="srsd")
        assert max(cheap.stats.tree_sizes) > 8 and cheap.stats.mean_accepted_length > 2
        assert len(cheap.stats.predicted_per_depth) >= 1
        # verification as dear as separate steps, and confirmed so (no exploration): every
        # step is a plain one, output is plain output
        dear_cost = CostModel([1, 2, 64], [0.010, 0.020, 0.640])
        dear_cost.confirmed[:] = 0
        engine.speculator.cost = dear_cost
        dear = engine.generate(prompt, max_tokens=80, mode="srsd")
        assert set(dear.stats.tree_sizes) == {1} and dear.stats.draft_tokens == 0
        assert dear.token_ids == plain.token_ids
    finally:
        engine.speculator.cost = saved


def test_speculation_recovers_from_an_absurd_cached_profile(model_path, monkeypatch, tmp_path):
    from srsd_local import store
    from srsd_local.engine import profile
    from srsd_local.engine.profile import load_cost_model

    monkeypatch.setenv("SRSD_CACHE_DIR", str(tmp_path))
    with Engine.load(model_path, n_ctx=2048) as eng:  # measures and caches a real profile
        sane = eng.speculator.cost.to_dict()
        _, name, key = load_cost_model(eng.backend, eng.config)
    # what a first load on a busy machine once cached: every tree seconds long
    store.write_json("profiles", name, {**sane, "key": key,
                                        "seconds": [sane["seconds"][0]] + [4.3] * (
                                            len(sane["seconds"]) - 1)})
    # the check at load would measure it again (next test): here the online correction alone
    monkeypatch.setattr(profile, "agrees", lambda *a: True)
    with Engine.load(model_path, n_ctx=2048) as eng:
        assert eng.speculator.cost.t(12) > 0.05  # the poisoned profile was loaded
        res = eng.generate(edit_prompt(), max_tokens=300, mode="srsd")
        cost = eng.speculator.cost
        # trees were verified again and the absurd estimates replaced by real step times
        assert res.stats.drafts >= 5 and res.stats.accepted_tokens > 20
        assert cost.t(12) < 1.0
    # the corrected profile was saved back: the next load starts from it
    assert CostModel.from_dict(store.read_json("profiles", name)).t(12) < 1.0


def test_a_cached_profile_that_disagrees_with_the_machine_is_measured_again_at_load(
        model_path, monkeypatch, tmp_path):
    from srsd_local import store
    from srsd_local.engine.profile import load_cost_model

    monkeypatch.setenv("SRSD_CACHE_DIR", str(tmp_path))
    with Engine.load(model_path, n_ctx=2048) as eng:
        sane = eng.speculator.cost.to_dict()
        _, name, key = load_cost_model(eng.backend, eng.config)
    t1 = sane["seconds"][0]
    bad = {"plain step 100x slow": [100 * t1 * s for s in sane["sizes"]],
           "every token a full step": [t1 * s for s in sane["sizes"]]}
    for why, seconds in bad.items():
        store.write_json("profiles", name, {**sane, "key": key, "seconds": seconds})
        with Engine.load(model_path, n_ctx=2048) as eng:
            cost = eng.speculator.cost
            assert cost.t(1) < 10 * t1 and cost.t(8) < 0.8 * 8 * cost.t(1), why
        assert store.read_json("profiles", name)["seconds"] != seconds, why  # re-cached


def _fixed_speculator(engine, model_path, monkeypatch, cost: CostModel) -> Speculator:
    """A speculator in a fixed state, not whatever earlier tests taught the shared engine:
    the model's calibration seeds, an empty n-gram pool and the given cost profile with its
    corrections frozen (step times are real, so learning them would make the plans depend on
    how busy the machine is)."""
    calibration = load_calibration_file(model_path)
    assert calibration and calibration.get("acceptance"), "the default model ships seeds"
    acceptance = AcceptanceModel()
    acceptance.seed(calibration["acceptance"])
    spec = Speculator(engine.config, cost, acceptance)
    monkeypatch.setattr(spec.cost, "observe", lambda *a, **k: None)
    return spec


def test_speculative_sampling_is_reproducible_and_draws_what_plain_draws(engine, model_path,
                                                                        monkeypatch):
    prompt = edit_prompt()
    kw = dict(max_tokens=60, temperature=0.8, seed=5)
    # from the same state (empty context, same speculator: acceptance, cost, depth
    # calibration, n-gram pool) the trees and batch shapes repeat, so the results repeat.
    # That state is fixed here, not whatever earlier tests taught the shared engine (their
    # outcomes and real step times can leave it drafting nothing on this prompt): the
    # model's calibration seeds, an empty pool and a CPU-like cost profile whose
    # corrections are frozen (step times are real)
    saved = engine.speculator

    def fresh():
        cost = CostModel([1, 2, 4, 8, 16, 32], [0.020, 0.021, 0.023, 0.026, 0.032, 0.045])
        return _fixed_speculator(engine, model_path, monkeypatch, cost)

    try:
        engine.reset()
        engine.speculator = fresh()
        a = engine.generate(prompt, mode="srsd", **kw)
        engine.reset()
        engine.speculator = fresh()
        b = engine.generate(prompt, mode="srsd", **kw)
    finally:
        engine.speculator = saved
    assert a.token_ids == b.token_ids and len(a.token_ids) == 60
    assert a.stats.accepted_tokens > 0, "the edit prompt must accept drafts"
    # one draw per emitted token from the same seeded generator, in the same order as plain
    # sampling: the first token comes from the same prompt logits and the same draw; later a
    # batched pass may flip a draw that sits on a rounding boundary (the distribution is
    # plain sampling's), so the rest is compared as a whole: the same length and finish
    plain = engine.generate(prompt, mode="ar", **kw)
    assert a.token_ids[0] == plain.token_ids[0]
    assert (len(a.token_ids), a.finish_reason) == (len(plain.token_ids), plain.finish_reason)


def test_stop_strings_and_context_reuse_on_the_real_model(engine):
    prompt = edit_prompt()
    plain = engine.generate(prompt, max_tokens=80, mode="ar")
    stop = "\n"
    cut = plain.text.index(stop)
    res = engine.generate(prompt, max_tokens=80, mode="srsd", stop=stop)
    assert res.finish_reason == "stop" and res.text == plain.text[:cut]
    follow = prompt + plain.text[:40]
    r2 = engine.generate(follow, max_tokens=10, mode="srsd")
    assert r2.stats.reused_prompt_tokens >= len(engine.tokenize(prompt)) - 1


def test_context_full_is_reported(model_path):
    with Engine.load(model_path, n_ctx=256) as eng:
        n_ctx = eng.backend.n_ctx
        assert n_ctx == 256
        long = " ".join(str(i) for i in range(200))
        assert len(eng.tokenize(long)) > n_ctx
        with pytest.raises(ContextFullError, match=f"n_ctx={n_ctx}"):
            eng.generate(long, max_tokens=4)
        prompt = " ".join(str(i) for i in range(60))
        n_prompt = len(eng.tokenize(prompt))
        assert n_prompt < 200
        res = eng.generate(prompt, max_tokens=400, mode="srsd")
        assert res.finish_reason == "length"
        assert n_prompt + len(res.token_ids) == n_ctx + 1  # every cell used, plus the last


def test_chat_uses_the_family_template(engine):
    text = engine.apply_chat_template([{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi"}])
    assert "<start_of_turn>user" in text and text.rstrip().endswith("<start_of_turn>model")
    res = engine.chat([{"role": "user", "content": "Say hello."}], max_tokens=16)
    assert res.stats.tokens > 0
    with pytest.raises(ValueError, match="role"):
        engine.chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="non-empty"):
        engine.chat([])


def test_cli_generate_prints_text_and_stats():
    proc = subprocess.run([sys.executable, "-m", "srsd_local.cli", "generate", "--prompt",
                           "def fib(n):", "--max-tokens", "32"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip()) > 10
    assert "tokens/s" in proc.stderr and "32 tokens" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "srsd_local.cli", "generate", "--prompt", "x",
                          "--model", "/nope.gguf"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "not found" in bad.stderr


def test_compiled_and_python_capture_agree_and_fallback_without_compiler(model_path,
                                                                         monkeypatch, tmp_path):
    import srsd_local.llama.capture as cap
    from srsd_local import store

    cfg = SRSDConfig(n_ctx=512, n_batch=128, n_ubatch=128)
    ids = None
    rows = {}
    for kind in ("c", "python"):
        monkeypatch.setenv("SRSD_CAPTURE", kind)
        with Backend(model_path, cfg, capture_layer=4) as be:
            assert be.capture.kind == kind
            ids = ids or be.tokenize("for i in range(10):\n    print(i * i)\n" * 16)
            assert len(ids) > 128
            rows[kind] = be.decode(ids, want_logits="last").hidden.copy()  # > n_batch: 2 calls
        n_embd = be.n_embd
    assert rows["c"].shape == (len(ids), n_embd)
    np.testing.assert_array_equal(rows["c"], rows["python"])
    # no compiler and nothing cached: the Python callback is used, and it works
    monkeypatch.setenv("SRSD_CAPTURE", "c")
    monkeypatch.setenv("SRSD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(store, "_compiler", lambda: None)
    assert cap.compiled_callback_library() is None
    with Backend(model_path, cfg, capture_layer=4) as be:
        assert be.capture.kind == "python"
        assert be.decode(ids[:20], want_logits="last").hidden.shape == (20, n_embd)


def _declining_cost() -> CostModel:
    """A cost profile (confirmed, so never explored) under which no tree pays: every token
    of a batch costs a plain step."""
    cost = CostModel([1, 2, 64], [0.013, 0.026, 0.832])
    for n, seconds in ((2, 0.026), (64, 0.832)):
        cost.observe(n, seconds)
    return cost


def test_drafts_the_controller_declines_are_learned_from_the_tokens_emitted(engine,
                                                                            monkeypatch):
    """No tree pays, so none is verified; the declined drafts' nodes are still learned from
    the tokens plain decoding emitted after them (an edit copies its input: many of them
    accepted), and the output is plain decoding's."""
    from srsd_local.spec.acceptance import AcceptanceModel

    monkeypatch.setattr(engine.speculator, "cost", _declining_cost())
    model = AcceptanceModel()
    monkeypatch.setattr(engine.speculator, "acceptance", model)
    prompt = edit_prompt()
    out = engine.generate(prompt, max_tokens=64, mode="srsd")
    assert out.stats.drafts == 0
    coarse = [v for k, v in model.counts.items() if len(k) == 4 and k[1] is True]
    accepted, tried = sum(a for a, _ in coarse), sum(n for _, n in coarse)
    assert tried >= 10 and accepted >= 3, (accepted, tried)
    assert out.token_ids == engine.generate(prompt, max_tokens=64, mode="ar").token_ids


def test_a_sampled_generation_backed_off_leaves_its_plain_steps_out_of_the_index(engine,
                                                                                monkeypatch):
    """Sampling with every plan declined: drafting backs off, and the plain steps in between
    capture no hidden row, so the index holds fewer rows than the context has positions; the
    draws are plain sampling's (no tree was verified)."""
    monkeypatch.setattr(engine.speculator, "cost", _declining_cost())
    prompt = edit_prompt()
    kw = dict(max_tokens=48, temperature=0.8, seed=5)
    engine.reset()
    out = engine.generate(prompt, mode="srsd", **kw)
    assert out.stats.drafts == 0
    positions = out.stats.prompt_tokens + len(out.token_ids) - 1  # the last one is pending
    assert len(engine.index) <= positions - 20, (len(engine.index), positions)
    assert out.token_ids == engine.generate(prompt, mode="ar", **kw).token_ids


def test_an_edit_is_copied_in_chains_without_drafting_and_equals_plain(engine, model_path,
                                                                      monkeypatch):
    """Once a tree is accepted to its leaf, the edit's copy of its input is followed chain
    after chain (no drafter runs for those steps); chains longer than a merged tree's depth
    are verified where the cost allows, and the output is plain decoding's. The speculator
    starts from a fixed state (what earlier tests taught the shared engine changes which
    trees are accepted to their leaf, and so when copying starts)."""
    cost = CostModel([1, 2, 16, 32, 64], [0.013, 0.015, 0.018, 0.022, 0.04])
    for n, seconds in ((2, 0.015), (16, 0.018), (32, 0.022), (64, 0.04)):
        cost.observe(n, seconds)
    spec = _fixed_speculator(engine, model_path, monkeypatch, cost)
    monkeypatch.setattr(engine, "speculator", spec)
    engine.reset()
    chains: list[tuple[int, int]] = []  # (drafted, accepted) per verified chain
    drafted_steps: list[int] = []
    observe, propose = spec.observe, spec.propose

    def observing(req, plan, path):
        if plan is not None and plan.copy_from is not None:
            chains.append((len(plan.tree) - 1, len(path) - 1))
        return observe(req, plan, path)

    def proposing(*a, **k):
        drafted_steps.append(1)
        return propose(*a, **k)

    monkeypatch.setattr(spec, "observe", observing)
    monkeypatch.setattr(spec, "propose", proposing)
    prompt = edit_prompt()
    out = engine.generate(prompt, max_tokens=200, mode="srsd")
    assert len(chains) >= 2, chains
    assert sum(a for _, a in chains) >= 40, chains
    assert max(d for d, _ in chains) > engine.config.draft_depth, chains
    # every verified chain's step drafted nothing
    assert len(drafted_steps) <= out.stats.steps - len(chains)
    # every position is plain decoding's argmax up to the rounding noise measured alongside
    rep = engine.verify_output(prompt, out.token_ids)
    assert rep.ok and rep.positions == len(out.token_ids) == 200, rep.summary()


def test_sampled_rows_are_drawn_on_the_decode_threads_with_one_threads_tokens(engine,
                                                                             monkeypatch):
    """A temperature-only request's draws run on the engine's thread count (the decode's
    threads, idle between passes) and give the tokens a one-thread draw gives."""
    from srsd_local.spec import kernels, sampling

    job = engine._job("Once upon a time", max_tokens=4, temperature=0.8, seed=2)
    if kernels.library() is None:
        pytest.skip("no C compiler: rows are drawn by numpy")
    # the decode's threads where its CPU backend runs on OpenMP (the pool the draw shares)
    assert engine.sample_threads == (engine.config.threads if engine.backend.cpu_openmp else 1)
    assert job.sampler._kernel.threads == engine.sample_threads
    kw = dict(max_tokens=40, temperature=0.8, seed=9, mode="ar")
    engine.reset()
    many = engine.generate("Write a short story about a lighthouse keeper.", **kw)
    monkeypatch.setattr(sampling, "temperature_kernel",
                        lambda t, threads=1: kernels.temperature_kernel(t, 1))
    engine.reset()
    one = engine.generate("Write a short story about a lighthouse keeper.", **kw)
    assert len(one.token_ids) == 40 and many.token_ids == one.token_ids


def test_a_trees_batch_is_filled_in_one_compiled_call_and_equals_plain(engine, monkeypatch):
    """Every verified tree's pass takes the backend's array path (the batch filled in one
    compiled call, no numpy on the way in) where there is a build, and the output is still
    plain decoding's at every position."""
    from srsd_local.llama import graph_argmax

    if graph_argmax.library() is None:
        pytest.skip("no C compiler: batches are filled through numpy")
    be = engine.backend
    calls = []
    rows = be._decode_rows

    def counting(tokens, positions, seq_ids, flags):
        calls.append(len(tokens))
        return rows(tokens, positions, seq_ids, flags)

    monkeypatch.setattr(be, "_decode_rows", counting)
    prompt = edit_prompt()
    engine.reset()
    out = engine.generate(prompt, max_tokens=64, mode="srsd")
    assert out.stats.drafts > 0 and len(calls) == out.stats.drafts, (calls, out.stats.drafts)
    rep = engine.verify_output(prompt, out.token_ids)
    assert rep.ok and rep.positions == len(out.token_ids), rep.summary()

"""Engine logic on the fake backend: every mode emits what plain decoding emits."""

from __future__ import annotations

import pytest
from fakes import EOS, FakeBackend

from srsd_local.config import SRSDConfig
from srsd_local.engine import Engine, collect

PROMPT = "the quick brown fox jumps over the lazy dog and the quick brown cat"
MODES = ["ar", "pld", "ngram", "retrieval", "srsd", "hybrid"]


def make_engine(**cfg) -> Engine:
    return Engine(FakeBackend(), SRSDConfig(index_backend="numpy", n_ctx=512, **cfg))


@pytest.mark.parametrize("mode", MODES)
def test_greedy_modes_equal_plain(mode):
    plain = make_engine().generate(PROMPT, max_tokens=60, mode="ar")
    eng = make_engine()
    spec = eng.generate(PROMPT, max_tokens=60, mode=mode)
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text
    assert spec.finish_reason == plain.finish_reason == "length"
    if mode != "ar":
        # copying workload: speculation must save forward passes
        assert spec.stats.steps < plain.stats.steps
        assert spec.stats.accepted_tokens > 0
        assert sum(eng.backend.decode_calls[1:]) > len(eng.backend.decode_calls) - 1


@pytest.mark.parametrize("mode", MODES)
def test_seeded_sampling_modes_equal_plain(mode):
    kw = dict(max_tokens=50, temperature=1.0, seed=7)
    plain = make_engine().generate(PROMPT, mode="ar", **kw)
    spec = make_engine().generate(PROMPT, mode=mode, **kw)
    assert spec.token_ids == plain.token_ids
    other = make_engine().generate(PROMPT, mode="ar", max_tokens=50, temperature=1.0, seed=8)
    assert other.token_ids != plain.token_ids


@pytest.mark.parametrize("mode", MODES)
def test_stop_string_cuts_where_plain_does(mode):
    plain = make_engine().generate(PROMPT, max_tokens=60, mode="ar")
    stop = plain.text[20:23]
    expected = plain.text[: plain.text.index(stop)]
    res = make_engine().generate(PROMPT, max_tokens=60, mode=mode, stop=[stop, "zzzz"])
    assert res.finish_reason == "stop"
    assert res.text == expected
    assert stop not in res.text


@pytest.mark.parametrize("mode", MODES)
def test_max_tokens_exact(mode):
    for n in (1, 2, 7, 33):
        res = make_engine().generate(PROMPT, max_tokens=n, mode=mode)
        assert len(res.token_ids) == n
        assert res.finish_reason == "length"


def test_max_tokens_zero():
    res = make_engine().generate(PROMPT, max_tokens=0)
    assert res.token_ids == [] and res.text == "" and res.finish_reason == "length"


@pytest.mark.parametrize("mode", MODES)
def test_eos_stops_generation(mode, monkeypatch):
    eng = make_engine()
    plain = make_engine().generate(PROMPT, max_tokens=40, mode="ar")
    eos_after = plain.token_ids[12]
    monkeypatch.setattr(eng.backend, "is_eog", lambda t: t in (EOS, eos_after))
    res = eng.generate(PROMPT, max_tokens=40, mode=mode)
    assert res.finish_reason == "stop"
    assert res.token_ids == plain.token_ids[: plain.token_ids.index(eos_after)]


def test_stream_events_concatenate_to_result():
    eng = make_engine()
    events = list(eng.stream(PROMPT, max_tokens=40, mode="srsd"))
    assert events[-1].finish_reason == "length" and events[-1].stats is not None
    assert all(e.finish_reason is None for e in events[:-1])
    ids = [t for e in events for t in e.token_ids]
    flags = [f for e in events for f in e.drafted]
    assert len(ids) == len(flags) == 40
    assert any(flags), "tokens from accepted drafts are flagged"
    res = make_engine().generate(PROMPT, max_tokens=40, mode="srsd")
    assert "".join(e.text for e in events) == res.text and ids == res.token_ids


def test_context_reuse_prefills_only_new_tokens():
    eng = make_engine()
    first = eng.generate(PROMPT, max_tokens=10, mode="srsd")
    follow = PROMPT + first.text + " and more"
    second = eng.generate(follow, max_tokens=10, mode="srsd")
    n_prompt = len(eng.backend.tokenize(follow))
    assert second.stats.reused_prompt_tokens >= len(eng.backend.tokenize(PROMPT))
    assert second.stats.reused_prompt_tokens < n_prompt
    fresh = make_engine().generate(follow, max_tokens=10, mode="srsd")
    assert second.token_ids == fresh.token_ids
    # a different prompt shares only BOS... and still gives the fresh result
    third = eng.generate("a b c d e f", max_tokens=10, mode="srsd")
    assert third.token_ids == make_engine().generate("a b c d e f", max_tokens=10).token_ids


def test_context_reuse_after_plain_mode_keeps_index_consistent():
    eng = make_engine()
    eng.generate(PROMPT, max_tokens=10, mode="ar")
    res = eng.generate(PROMPT + " the", max_tokens=30, mode="srsd")
    assert len(eng.index) == eng.slots[0].n_past == len(eng.backend.seqs[0])
    assert res.token_ids == make_engine().generate(PROMPT + " the", max_tokens=30).token_ids


def test_context_full_finishes_with_length():
    eng = Engine(FakeBackend(n_ctx=80), SRSDConfig(index_backend="numpy", n_ctx=80))
    res = eng.generate(PROMPT, max_tokens=500, mode="srsd")
    assert res.finish_reason == "length"
    assert len(eng.backend.tokenize(PROMPT)) + len(res.token_ids) <= 81


def test_prompt_too_long_is_a_clear_error():
    eng = Engine(FakeBackend(n_ctx=64), SRSDConfig(index_backend="numpy", n_ctx=64))
    with pytest.raises(ValueError, match="context is full"):
        eng.generate("a" * 100, max_tokens=5)


@pytest.mark.parametrize("bad", [dict(mode="fast"), dict(max_tokens=-1),
                                 dict(temperature=-0.5), dict(top_p=0.0), dict(stop=[1, 2])])
def test_bad_arguments(bad):
    with pytest.raises(ValueError):
        make_engine().generate(PROMPT, **{"max_tokens": 5, **bad})


def test_stats_are_consistent():
    res = make_engine().generate(PROMPT, max_tokens=60, mode="hybrid")
    s = res.stats
    assert s.tokens == 60
    assert sum(s.tokens_per_step) + 1 >= s.tokens  # +1: the prompt pass's token
    assert s.accepted_tokens == sum(s.accepted_per_depth)
    assert 0 < s.acceptance_rate <= 1
    assert s.mean_accepted_length > 1
    d = s.to_dict()
    assert d["tokens_per_second"] > 0 and d["mean_accepted_length"] == s.mean_accepted_length


def test_collect_needs_a_finish_event():
    with pytest.raises(RuntimeError):
        collect(iter([]))


def test_an_error_during_verification_leaves_no_tree_in_the_cache(monkeypatch):
    import srsd_local.engine.engine as engine_mod

    plain = make_engine().generate(PROMPT, max_tokens=40, mode="ar")
    eng = make_engine()
    real_walk, calls = engine_mod.walk_tree, []

    def failing_walk(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("planted failure")
        return real_walk(*args)

    monkeypatch.setattr(engine_mod, "walk_tree", failing_walk)
    with pytest.raises(RuntimeError, match="planted failure"):
        eng.generate(PROMPT, max_tokens=40, mode="srsd")
    be = eng.backend
    assert set(be.seqs) == {0} and len(be.seqs[0]) == eng.slots[0].n_past  # no tree left
    again = eng.generate(PROMPT, max_tokens=40, mode="srsd")  # reuses the prompt's cells
    assert again.token_ids == plain.token_ids and again.stats.accepted_tokens > 0


def test_a_model_that_cannot_roll_back_decodes_plainly(capsys):
    be = FakeBackend()
    be.can_speculate = False
    eng = Engine(be, SRSDConfig(index_backend="numpy", n_ctx=512))
    assert "decodes plainly" in capsys.readouterr().err
    plain = make_engine().generate(PROMPT, max_tokens=40, mode="ar")
    out = eng.generate(PROMPT, max_tokens=40, mode="srsd")
    assert out.token_ids == plain.token_ids and out.stats.drafts == 0
    assert set(out.stats.tree_sizes) == {1}
    eng.generate(PROMPT, max_tokens=8, mode="srsd")  # no prefix reuse: prefilled again
    assert be.decode_calls[-8] == len(be.tokenize(PROMPT))


@pytest.mark.parametrize("mode", ["ar", "srsd", "pld"])
def test_logprobs_come_with_every_token_and_equal_plain_ones(mode):
    import numpy as np

    plain = make_engine().generate(PROMPT, max_tokens=30, mode="ar", logprobs=3)
    eng = make_engine()
    out = eng.generate(PROMPT, max_tokens=30, mode=mode, logprobs=3, stop=["zzz"])
    assert out.token_ids == plain.token_ids and len(out.logprobs) == 30
    for lp, ref, tok in zip(out.logprobs, plain.logprobs, out.token_ids):
        assert lp.token == tok and lp.logprob == pytest.approx(ref.logprob, abs=1e-6)
        assert [t for t, _ in lp.top] == [t for t, _ in ref.top] and len(lp.top) == 3
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] and lp.logprob <= 0
        # greedy: the emitted token is the most likely one
        assert lp.top[0][0] == tok and lp.top[0][1] == pytest.approx(lp.logprob)
    # the fake model's probabilities are what its logits say
    be = FakeBackend()
    row = be._logits(be.tokenize(PROMPT))
    want = row[out.token_ids[0]] - np.log(np.exp(row - row.max()).sum()) - row.max()
    assert out.logprobs[0].logprob == pytest.approx(float(want), abs=1e-5)
    assert eng.generate(PROMPT, max_tokens=5, mode=mode).logprobs is None


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match="logprobs"):
        make_engine().generate(PROMPT, max_tokens=3, logprobs=bad)


def record_decodes(be, what) -> list:
    """Wrap the fake backend's decode: each call appends what(tokens, seq_ids) to the list."""
    seen, real = [], be.decode

    def spy(tokens, positions=None, seq_ids=None, want_logits="last"):
        seen.append(what(tokens, seq_ids))
        return real(tokens, positions, seq_ids, want_logits)

    be.decode = spy
    return seen


# -- several requests at once ------------------------------------------------------------------
MANY = [
    {"prompt": PROMPT, "mode": "srsd", "max_tokens": 40},
    {"prompt": "abc abd abe abc abd", "mode": "ar", "max_tokens": 25},
    {"prompt": "the lazy dog and the lazy cat and the", "mode": "pld", "max_tokens": 30,
     "stop": ["cat"]},
    {"prompt": PROMPT + " again", "mode": "ngram", "max_tokens": 35, "temperature": 1.0,
     "seed": 3},
    {"prompt": "xyz xyz xyz", "mode": "hybrid", "max_tokens": 20},
]


def test_generate_many_equals_each_request_alone_and_shares_passes():
    alone = [make_engine().generate(**r) for r in MANY]
    eng = make_engine(parallel=3)
    be = eng.backend
    calls = record_decodes(be, lambda tokens, seq_ids: {
        s[0] // (eng.config.max_branches + 1) for s in seq_ids or [[0]]})
    many = eng.generate_many(MANY)
    for a, m, r in zip(alone, many, MANY):
        assert m.token_ids == a.token_ids, r
        assert (m.text, m.finish_reason) == (a.text, a.finish_reason)
    assert max(len(c) for c in calls) == 3  # three slots' work in one forward pass
    assert not any(s.busy for s in eng.slots)
    # slots keep their contexts: a repeated prompt reuses one
    again = eng.generate(**MANY[1])
    assert again.token_ids == alone[1].token_ids and again.stats.reused_prompt_tokens > 0


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode():
    # decodes take time, so the first request is still decoding when the second arrives
    eng = Engine(FakeBackend(step_cost=lambda n: 0.003),
                 SRSDConfig(index_backend="numpy", n_ctx=512, parallel=2, prefill_chunk=16))
    be = eng.backend
    sizes = record_decodes(be, lambda tokens, seq_ids: len(tokens))
    long_prompt = "the quick brown fox " * 10  # 200 tokens
    try:
        first = eng.submit(prompt="abc abd", max_tokens=80, mode="ar")
        got = list(next(first).token_ids)  # decoding now
        late = eng.submit(prompt=long_prompt, max_tokens=5, mode="ar")
        late_ids = [t for ev in late for t in ev.token_ids]
        got += [t for ev in first for t in ev.token_ids]
    finally:
        eng.close()
    assert got == make_engine().generate("abc abd", max_tokens=80, mode="ar").token_ids
    assert late_ids == make_engine().generate(long_prompt, max_tokens=5, mode="ar").token_ids
    # the long prompt went in chunks of 16 tokens, each next to the other's plain step
    assert sizes.count(16 + 1) >= 10 and max(sizes[1:]) == 16 + 1


def test_submitted_requests_run_side_by_side_and_cancel_cleanly():
    import threading

    eng = make_engine(parallel=2)
    try:
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            ids = []
            for ev in eng.submit(**MANY[i]):
                ids += ev.token_ids
            results[i] = ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        # a request abandoned after its first event frees its slot
        it = eng.submit(prompt=PROMPT, max_tokens=200, mode="srsd")
        first = next(it)
        it.close()
        for t in threads:
            t.join(timeout=30)
        for i in range(3):
            assert results[i] == make_engine().generate(**MANY[i]).token_ids
        assert first.token_ids
        late = eng.submit(prompt="abc abd", max_tokens=10, mode="ar")
        assert sum(len(ev.token_ids) for ev in late) == 10
        deadline = __import__("time").time() + 5
        while any(s.busy for s in eng.slots) and __import__("time").time() < deadline:
            __import__("time").sleep(0.01)
        assert not any(s.busy for s in eng.slots)
        with pytest.raises(ValueError, match="max_tokens"):
            eng.submit(prompt="x", max_tokens=-1)
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["ar", "srsd"])
def test_a_stream_closed_early_leaves_the_context_usable(mode):
    want = make_engine().generate(PROMPT, max_tokens=20, mode=mode).token_ids
    eng = make_engine()
    for _ in range(2):
        g = eng.stream(PROMPT, max_tokens=30, mode=mode)
        next(g)
        next(g)
        g.close()
        assert len(eng.backend.seqs[0]) == eng.slots[0].n_past  # nothing left past it
        assert eng.generate(PROMPT, max_tokens=20, mode=mode).token_ids == want


def test_a_prompt_another_slot_holds_is_copied_not_prefilled():
    eng = Engine(FakeBackend(n_ctx=1024, step_cost=lambda n: 0.002),
                 SRSDConfig(index_backend="numpy", n_ctx=512, parallel=2))
    be = eng.backend
    sizes = record_decodes(be, lambda tokens, seq_ids: len(tokens))
    longer = PROMPT + " and the lazy cat"
    try:
        busy = eng.submit(prompt=PROMPT, max_tokens=150, mode="ar")  # slot A holds PROMPT
        first = next(busy)
        n_before = len(sizes)
        out = [t for ev in eng.submit(prompt=longer, max_tokens=20, mode="srsd")
               for t in ev.token_ids]
        rest = [t for ev in busy for t in ev.token_ids]
    finally:
        eng.close()
    alone = make_engine()
    assert out == alone.generate(longer, max_tokens=20, mode="srsd").token_ids
    assert first.token_ids + rest == alone.generate(PROMPT, max_tokens=150,
                                                    mode="ar").token_ids
    # only the new tail of the longer prompt went through the model (next to A's steps)
    extra = len(be.tokenize(longer)) - len(be.tokenize(PROMPT))
    assert max(sizes[n_before:]) <= extra + 1 + 32  # tail (+ A's token), never the prompt
    assert len(be.tokenize(PROMPT)) not in sizes[n_before:]
    assert eng.slots[1].n_past > len(be.tokenize(PROMPT))


def test_forget_outputs_empties_the_shared_ngram_pool_only():
    eng = make_engine()
    prompt = list(range(2, 60)) * 2
    first = eng.generate(prompt, max_tokens=40, mode="ngram")
    pool = eng.speculator.pool
    assert pool.n_entries > 0
    eng.forget_outputs()
    assert pool.n_entries == 0
    again = eng.generate(prompt, max_tokens=40, mode="ngram")  # the prompt's cells are reused
    assert again.token_ids == first.token_ids and again.stats.reused_prompt_tokens > 0


def test_trees_run_padded_to_the_cheapest_profiled_size_and_still_equal_plain():
    """Where 5-7 tokens cost more than 8 (matrix kernels that take rows in tiles), a tree of
    5 tokens (drafts of depth 4, one branch) is verified with dummy rows up to 8: no step
    decodes 5-7 tokens, some were padded, and the output and the context are what plain
    decoding gives."""
    from srsd_local.spec.cost import CostModel

    plain = make_engine().generate(PROMPT, max_tokens=80, mode="ar")
    costs = [0.010, 0.012, 0.013, 0.014, 0.030, 0.030, 0.030, 0.016]
    eng = Engine(FakeBackend(step_cost=lambda n: costs[min(n, 8) - 1]),
                 SRSDConfig(index_backend="numpy", n_ctx=512, max_nodes=7, draft_depth=4,
                            max_branches=1))
    sizes = list(range(1, 9))
    cost = eng.speculator.cost = CostModel(sizes, costs)
    for n, t in zip(sizes, costs):  # every size confirmed: no exploratory plans
        cost.observe(n, t)
    pads: list[int] = []
    decide = eng.speculator._decide  # every plan (a merged draft's, a copy run's)

    def recording(*a, **k):
        plan = decide(*a, **k)
        if plan is not None:
            pads.append(plan.pad)
        return plan

    eng.speculator._decide = recording
    # merged drafts only: a copy run's chain fills the whole room (7 nodes, 8 rows), unpadded
    eng.speculator.follow = lambda *a, **k: None
    calls = len(eng.backend.decode_calls)
    spec = eng.generate(PROMPT, max_tokens=80, mode="srsd")
    assert spec.token_ids == plain.token_ids
    steps = eng.backend.decode_calls[calls + 1:]  # after the prompt's pass
    assert not {5, 6, 7} & set(steps) and 8 in steps, steps
    assert any(p > 0 for p in pads), pads
    # the dummies left nothing behind: the context holds exactly prompt + output
    slot = eng.slots[0]
    assert eng.backend.seqs[slot.base] == list(slot.ctx[: slot.n_past])


def test_a_failure_after_the_pass_fails_the_request_not_the_worker(monkeypatch):
    """An exception raised in a scheduler step outside the forward pass itself (here: the
    cost model's update after it) reaches the submitted request as its error; the worker
    thread lives on and serves the next request."""
    from srsd_local.spec.speculator import Speculator

    eng = make_engine(parallel=2)
    try:
        calls = []

        def failing(real):
            def update(self, *a):
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("planted failure after the pass")
                return real(self, *a)
            return update

        for name in ("observe_cost", "observe_plain_cost"):  # (a plain step's own)
            monkeypatch.setattr(Speculator, name, failing(getattr(Speculator, name)))
        with pytest.raises(RuntimeError, match="planted failure after the pass"):
            collect(eng.submit(prompt=PROMPT, max_tokens=20, mode="ar"))
        monkeypatch.undo()
        again = collect(eng.submit(prompt=PROMPT, max_tokens=20, mode="ar"))
        assert again.token_ids == make_engine().generate(PROMPT, max_tokens=20,
                                                         mode="ar").token_ids
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["ar", "retrieval", "ngram", "srsd"])
def test_what_drafting_reads_of_the_prompt_is_made_in_prompt_time(mode):
    """Right after prefill (before the first token is emitted, within the prompt's time)
    the n-gram pool has taken in the prompt where the mode drafts from it, and the context's
    text is the prompt's where the mode reads text; nothing of the kind for the others."""
    eng = make_engine()
    prompt = eng.tokenize(PROMPT)
    out = eng.generate(prompt, max_tokens=0, mode=mode)
    assert out.token_ids == []
    slot = eng.slots[0]
    pooled = mode in ("ngram", "srsd")
    assert (eng.speculator.pool.n_entries > 0) is pooled
    if pooled:  # every position of the prompt in the pool's stream
        assert eng.speculator.pool._streams[0].n == len(prompt)
    assert len(slot.text) == (len(prompt) if mode == "srsd" else 0)
    # and the outputs are those of a run that made them at its first drafting step
    eng2 = make_engine()
    eng2.speculator.prepare = lambda req, tokens: None
    assert eng.generate(prompt, max_tokens=40, mode=mode).token_ids == \
        eng2.generate(prompt, max_tokens=40, mode=mode).token_ids

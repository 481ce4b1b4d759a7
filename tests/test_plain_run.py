"""Runs of plain steps in one compiled call (SRSDConfig.plain_run), on the real default model:
the backend's run decodes what its plain steps one by one decode (tokens, captured rows),
stops after an end-of-generation token; the engine's outputs, steps and context are those of
step-by-step decoding (steps drawn at a temperature in the graph too, with the same draws),
its events carry up to plain_run tokens, and requests that need something between steps
(stop strings, log-probabilities, top-p and the like) get one step per event as before. A
greedy request under a grammar runs too, the grammar checking each token in the run: the
same tokens as step by step, a rejected argmax's row searched after the run, and a drafting
request's run stopped where the grammar forces what comes next."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from srsd_local.bench.workloads import load_workload
from srsd_local.config import SRSDConfig

pytestmark = pytest.mark.model

EDIT = load_workload("code_edit")[0]


@pytest.fixture(scope="module")
def run_engine(model_path):
    from srsd_local.engine import Engine

    eng = Engine.load(model_path, n_ctx=4096, learned=False)
    yield eng
    eng.close()


def _prefilled(be, prompt: list[int]) -> int:
    """The prompt decoded into sequence 0 (nothing else in it), its argmax; sequence 0 then
    has its argmax taken in the graph."""
    be.seq_trim(0, 0)
    be.n_past = 0
    out = be.decode(prompt)
    be.sample_main(0, True)
    return int(np.argmax(out.logits[-1]))


def test_a_run_decodes_what_its_plain_steps_one_by_one_decode(run_engine):
    be = run_engine.backend
    prompt = be.tokenize(EDIT.prompt)[:300]
    n, k, dim = len(prompt), 12, be.n_embd
    one_rows = np.zeros((k, dim), np.float32)
    run_rows = np.zeros((k, dim), np.float32)
    try:
        first = _prefilled(be, prompt)
        assert be.can_run(0)
        tokens, tok = [], first
        for i in range(k):  # one by one, each row staged where the engine would put it
            out = be.step_at(tok, n + i, 0, True, one_rows[i].ctypes.data)
            assert out.staged == 1 and out.hidden is None
            tok = int(out.sampled[0])
            tokens.append(tok)
        assert _prefilled(be, prompt) == first
        out = be.step_run(first, n, 0, k, True, run_rows.ctypes.data)
        assert list(out.sampled) == tokens
        assert out.staged == k and out.hidden is None
        assert np.array_equal(run_rows, one_rows) and np.abs(run_rows).sum() > 0
        # the cache holds the run's tokens, as after the steps: the next step goes on
        after = be.step_at(tokens[-1], n + k, 0, True, 0)
        assert after.sampled[0] >= 0
        # without a stage: the last step's row comes back as `hidden`
        assert _prefilled(be, prompt) == first
        out = be.step_run(first, n, 0, 3, True, 0)
        assert list(out.sampled) == tokens[:3] and out.staged == 0
        assert np.array_equal(out.hidden[-1], one_rows[2])
        # rows captured from a later step on: those steps' rows alone, from the stage
        assert _prefilled(be, prompt) == first
        some = np.zeros((k, dim), np.float32)
        out = be.step_run(first, n, 0, 5, True, some.ctypes.data, 3)
        assert list(out.sampled) == tokens[:5] and out.staged == 2 and out.hidden is None
        assert np.array_equal(some[:2], one_rows[3:5]) and not some[2:].any()
        # a run stops after an end-of-generation token: here llama.cpp's check is replaced by
        # one that calls the run's fourth token the end
        assert _prefilled(be, prompt) == first
        is_end = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int32)(
            lambda vocab, token: token == tokens[3])
        stop_at = tokens.index(tokens[3])
        rc = be._run(first, n, 0, True, 0, k, None, be._run_addr,
                     ctypes.cast(is_end, ctypes.c_void_p).value, be.vocab, None, None, None, None)
        assert rc == 0 and be._step_state.token == stop_at + 1
        assert list(be._run_buf[: stop_at + 1]) == tokens[: stop_at + 1]
        # bad sizes and the end of the context are refused before anything is decoded
        for bad in (0, 65):
            with pytest.raises(ValueError, match="plain steps: accepted are 1 to 64"):
                be.step_run(first, n, 0, bad, True, 0)
        from srsd_local.llama.backend import ContextFullError

        with pytest.raises(ContextFullError, match="context is full"):
            be.step_run(first, be.n_ctx - 2, 0, 3, True, 0)
    finally:
        be.seq_trim(0, 0)
        be.n_past = 0
        run_engine.reset()


def _events(eng, prompt, **kw):
    return list(eng.stream(prompt, **kw))


@pytest.mark.parametrize("max_tokens", [45, 7])
def test_plain_decoding_in_runs_is_step_by_step_decoding(run_engine, max_tokens):
    # the same tokens and text, steps and finish; the events carry up to plain_run tokens
    eng = run_engine
    outs = {}
    try:
        for runs in (1, 8):
            eng.reconfigure(plain_run=runs)
            eng.reset()
            outs[runs] = evs = _events(eng, EDIT.prompt, max_tokens=max_tokens, mode="ar")
            sizes = [len(e.token_ids) for e in evs]
            assert max(sizes) <= runs and sum(sizes) == max_tokens
            assert evs[-1].finish_reason == "length"
    finally:
        eng.reconfigure(plain_run=SRSDConfig().plain_run)
    one, run = outs[1], outs[8]
    assert [t for e in run for t in e.token_ids] == [t for e in one for t in e.token_ids]
    assert "".join(e.text for e in run) == "".join(e.text for e in one)
    assert len(run) < len(one)
    s1, s8 = one[-1].stats, run[-1].stats
    assert s8.steps == s1.steps and s8.tokens == s1.tokens == max_tokens
    assert s8.tokens_per_step == s1.tokens_per_step


def test_a_run_ends_at_the_end_of_generation_as_plain_steps_do(run_engine, monkeypatch):
    # the default model rarely ends a text by itself: here a token of its output (the 11th)
    # is made an end of generation, for the emitter and for the compiled run alike
    eng = run_engine
    be = eng.backend
    eng.reset()
    ref = eng.generate(EDIT.prompt, max_tokens=40, mode="ar").token_ids
    end = ref[10]
    monkeypatch.setitem(be._eog, end, True)
    is_end = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int32)(
        lambda vocab, token: token == end)
    monkeypatch.setattr(be, "_run_eog", ctypes.cast(is_end, ctypes.c_void_p).value)
    got = {}
    try:
        for runs in (1, 8):
            eng.reconfigure(plain_run=runs)
            eng.reset()
            evs = _events(eng, EDIT.prompt, max_tokens=40, mode="ar")
            got[runs] = ([t for e in evs for t in e.token_ids], evs[-1].finish_reason,
                         eng.slots[0].n_past)
    finally:
        eng.reconfigure(plain_run=SRSDConfig().plain_run)
    assert got[8] == got[1]
    tokens, finish, n_past = got[8]
    assert finish == "stop" and tokens == ref[: ref.index(end)]
    # the end token was not decoded: the context is the prompt and the tokens before it
    assert n_past == len(eng.tokenize(EDIT.prompt)) + len(tokens)


def test_requests_that_look_between_steps_get_one_step_per_event(run_engine):
    eng = run_engine
    eng.reset()
    ref = _events(eng, EDIT.prompt, max_tokens=24, mode="ar")
    text = "".join(e.text for e in ref)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cases = [dict(stop=[stop]), dict(logprobs=1), dict(temperature=0.8, top_p=0.9, seed=3),
             dict(json_schema={"type": "object"}, temperature=0.8, seed=3)]
    for kw in cases:
        eng.reset()
        evs = _events(eng, EDIT.prompt, max_tokens=24, mode="ar", **kw)
        assert all(len(e.token_ids) <= 1 for e in evs), kw
    assert any(len(e.token_ids) > 1 for e in ref)


@pytest.mark.parametrize("mode", ["ar", "srsd"])
def test_steps_drawn_in_the_graph_go_as_runs_with_the_same_draws(run_engine, mode):
    # sampled at a temperature alone, a plain step's token is drawn in the graph with the
    # uniform draw the host would take: a run takes its steps' draws in order, so `ar` draws
    # the very tokens step-by-step decoding draws; `srsd` (its plain steps in runs after
    # declined drafting) stays a valid sampled generation of the same length
    eng = run_engine
    assert eng.backend.can_draw
    prompt = load_workload("open")[0].prompt
    got = {}
    try:
        for runs in (1, 8):
            eng.reconfigure(plain_run=runs)
            eng.reset()
            evs = _events(eng, prompt, max_tokens=40, mode=mode, temperature=0.8, seed=11)
            got[runs] = evs
            # a plain event holds one run's tokens (a verified tree's event holds its
            # accepted tokens and the next: `srsd` may get a sampled node accepted)
            assert max(len(e.token_ids) for e in evs if not any(e.drafted)) <= runs
            assert sum(len(e.token_ids) for e in evs) == 40
    finally:
        eng.reconfigure(plain_run=SRSDConfig().plain_run)
    assert any(len(e.token_ids) > 1 and not any(e.drafted) for e in got[8])
    if mode == "ar":
        assert [t for e in got[8] for t in e.token_ids] == \
            [t for e in got[1] for t in e.token_ids]


def test_speculative_decoding_runs_the_steps_it_skips_and_keeps_plain_decodings_tokens(
        run_engine):
    # srsd: the steps after a drafting attempt that led to no tree, which the controller
    # skips, go as runs (events of several tokens none of them drafted); every token is plain
    # decoding's, checked at every position
    eng = run_engine
    eng.reset()
    prompt = load_workload("humaneval")[0].prompt
    evs = _events(eng, prompt, max_tokens=128, mode="srsd")
    tokens = [t for e in evs for t in e.token_ids]
    assert any(len(e.token_ids) > 1 and not any(e.drafted) for e in evs)
    report = eng.verify_output(prompt, tokens)
    assert report.ok, report


JSON = load_workload("json")[0]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_a_runs_grammar_check_takes_rejects_and_stops_where_text_is_forced(run_engine):
    # the compiled check a run calls per token, on a JSON schema's grammar: a token the
    # grammar admits is taken (1), or taken and the run stops where the grammar forces what
    # comes next (2, with stop_forced); a rejected one (0) leaves the state as it was
    eng = run_engine
    tok = {t: eng.tokenize(t, add_bos=False) for t in ('{"', "name", "abc", "\n")}
    assert all(len(v) == 1 for v in tok.values()), tok
    check_t = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32)
    for stop in (True, False):
        state = eng.constraint(json_schema=SCHEMA)
        fn, data = state.run_check(stop)
        check = check_t(fn)
        # after '{"' the grammar forces 'name": "'
        assert check(data, tok['{"'][0]) == (2 if stop else 1)
        assert state.forced_text(16, lambda c: c == ":") == 'name": "'
        assert check(data, tok["abc"][0]) == 0  # not the forced key
        assert check(data, tok["name"][0]) == (2 if stop else 1)
        for t in eng.tokenize('": "', add_bos=False):  # into the string's value
            state.accept(t)
        assert not state.allows(tok["\n"][0])  # (a raw newline: not in a JSON string)
        assert check(data, tok["\n"][0]) == 0
        assert check(data, tok["abc"][0]) == 1  # free text: nothing forced after it
        assert state.forced_text(16, lambda c: True) == ""


def _grammar_runs(eng, monkeypatch, prompt, **kw) -> dict[int, tuple[list, list, int]]:
    """Per plain_run (1, 8): the events' tokens, their sizes and how many runs ended at a
    token the grammar rejected."""
    be = eng.backend
    step_run = be.step_run
    rejected = [0]

    def counting(*args, **kwargs):
        out = step_run(*args, **kwargs)
        rejected[0] += out.rejected
        return out

    monkeypatch.setattr(be, "step_run", counting)
    got = {}
    try:
        for runs in (1, 8):
            eng.reconfigure(plain_run=runs)
            eng.reset()
            rejected[0] = 0
            evs = _events(eng, prompt, **kw)
            got[runs] = ([t for e in evs for t in e.token_ids],
                         [len(e.token_ids) for e in evs if not any(e.drafted)], rejected[0])
    finally:
        eng.reconfigure(plain_run=SRSDConfig().plain_run)
    return got


def test_greedy_decoding_under_a_grammar_runs_with_step_by_step_decodings_tokens(
        run_engine, monkeypatch):
    # a JSON schema (the json workload's first prompt) and a grammar that rejects the
    # model's argmax at most steps (the code-edit prompt, written in lowercase letters and
    # spaces only): in runs, the tokens of step-by-step decoding, at every position; the
    # runs carry several tokens, and in the second a run ends at a rejected argmax, whose
    # row is searched for the best admitted token as a step's would be
    eng = run_engine
    lower = 'root ::= [a-z ]+ "."'
    for prompt, kw in ((JSON.prompt, JSON.constraint), (EDIT.prompt, dict(grammar=lower))):
        got = _grammar_runs(eng, monkeypatch, prompt, max_tokens=48, mode="ar", **kw)
        assert got[8][0] == got[1][0]
        assert max(got[8][1]) > 1 and max(got[8][1]) <= 8 and max(got[1][1]) == 1
        assert got[1][2] == 0  # (no runs)
    assert got[8][2] > 0
    assert set(eng.backend.detokenize(got[8][0])) <= set("abcdefghijklmnopqrstuvwxyz .")


def test_speculative_decoding_under_a_grammar_runs_its_skipped_steps(run_engine, monkeypatch):
    # srsd under a JSON schema: the steps it skips after declined drafting go as runs, which
    # stop where the grammar forces text (drafted: still accepted as forced tokens); every
    # token is plain constrained decoding's, checked at every position
    eng = run_engine
    got = _grammar_runs(eng, monkeypatch, JSON.prompt, max_tokens=JSON.max_tokens,
                        mode="srsd", **JSON.constraint)
    tokens, sizes, _ = got[8]
    assert max(sizes) > 1 and max(got[1][1]) == 1
    eng.reset()
    report = eng.verify_output(JSON.prompt, tokens, **JSON.constraint)
    assert report.ok, report
    eng.reset()
    out = eng.generate(JSON.prompt, max_tokens=JSON.max_tokens, mode="srsd", **JSON.constraint)
    assert out.stats.forced_tokens > 0

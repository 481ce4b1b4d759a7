"""Output constraints on the real default model: JSON schemas and GBNF grammars through the
engine and the server, speculative modes against plain constrained decoding at every
position, grammar-forced drafts, and the errors for bad constraints."""

from __future__ import annotations

import json

import numpy as np
import pytest

from srsd_local.bench.workloads import load_workload
from srsd_local.llama import grammar
from srsd_local.llama.grammar import ConstraintSpec, GrammarError

pytestmark = pytest.mark.model

JSON_PROMPTS = load_workload("json")[:2]
SCHEMA = JSON_PROMPTS[0].json_schema
# a grammar whose literal part is long: every token of it is forced
LITERAL = "The answer, in one word, is: "
GBNF = f'root ::= "{LITERAL}" ("yes" | "no" | "maybe") "."'


def _admitted_throughout(engine, tokens, **constraint) -> bool:
    """Every token of an output is admitted by the constraint after the ones before it."""
    state = engine.constraint(**constraint)
    for t in tokens:
        if not state.allows(t):
            return False
        state.accept(t)
    return True


@pytest.mark.parametrize("p", JSON_PROMPTS, ids=lambda p: p.id)
def test_schema_outputs_of_every_mode_are_valid_and_equal_plain_constrained_decoding(engine, p):
    spec = ConstraintSpec.make(json_schema=p.json_schema)
    for mode in ("ar", "srsd", "ngram", "retrieval"):
        out = engine.generate(p.prompt, max_tokens=p.max_tokens, mode=mode,
                              json_schema=p.json_schema)
        if out.finish_reason == "stop":
            assert spec.validate(out.text) is None, (mode, out.text)
        assert _admitted_throughout(engine, out.token_ids, json_schema=p.json_schema)
        rep = engine.verify_output(p.prompt, out.token_ids, json_schema=p.json_schema)
        assert rep.ok, (mode, rep.summary())
        if mode == "srsd":
            assert out.stats.forced_tokens > 0, "no grammar-forced draft was accepted"


@pytest.fixture
def seeded(engine):
    """The engine with what the controller learned so far set aside: acceptance from the
    model's calibration seeds only, no depth calibration, an empty n-gram pool (so a test's
    outcome cannot depend on which tests ran before it); restored afterwards."""
    from srsd_local.engine.calibrate import load_calibration_file
    from srsd_local.spec.acceptance import AcceptanceModel

    spec = engine.speculator
    saved = spec.acceptance, spec.depth_calibration
    fresh = AcceptanceModel()
    fresh.seed((load_calibration_file(engine.model_path) or {}).get("acceptance", []))
    spec.acceptance, spec.depth_calibration = fresh, {}
    engine.forget_outputs()
    try:
        yield engine
    finally:
        spec.acceptance, spec.depth_calibration = saved


def test_a_forced_literal_is_drafted_and_accepted(seeded):
    engine = seeded
    prompt = "Question: is water wet?\n"
    plain = engine.generate(prompt, max_tokens=40, mode="ar", grammar=GBNF)
    fast = engine.generate(prompt, max_tokens=40, mode="srsd", grammar=GBNF)
    for out in (plain, fast):
        assert out.text.startswith(LITERAL) and out.text.endswith(".")
        assert out.text[len(LITERAL):-1] in ("yes", "no", "maybe")
        assert out.finish_reason == "stop"  # the grammar ended: only end-of-text was left
    # most of the literal came from forced drafts (a token or two may be the one each
    # step emits, or a node other sources proposed too)
    assert fast.stats.forced_tokens >= len(engine.tokenize(LITERAL, add_bos=False)) // 2
    assert fast.stats.steps < plain.stats.steps
    rep = engine.verify_output(prompt, fast.token_ids, grammar=GBNF)
    assert rep.ok, rep.summary()


def test_grammar_forced_text_is_tokenized_once_per_distinct_text(seeded, monkeypatch):
    # forced text recurs (a schema's keys in every object; here the same literal twice):
    # each distinct text goes through the tokenizer once, and its tokens are the tokenizer's
    engine = seeded
    engine._forced_memo.clear()
    calls: list = []
    asked: list = []
    tokenize, forced = engine._tokenize_text, engine._forced_tokens
    monkeypatch.setattr(engine, "_tokenize_text", lambda t: calls.append(t) or tokenize(t))
    monkeypatch.setattr(engine, "_forced_tokens", lambda t: asked.append(t) or forced(t))
    outs = [engine.generate("Question: is water wet?\n", max_tokens=40, mode="srsd",
                            grammar=GBNF) for _ in range(2)]
    assert outs[0].text.startswith(LITERAL) and outs[1].text.startswith(LITERAL)
    assert engine._forced_memo and len(asked) > len(set(asked))
    for text, toks in engine._forced_memo.items():
        assert calls.count(text) == 1
        assert list(toks) == tokenize(text)


def _accepted_runs(engine, monkeypatch, bit: int) -> list[int]:
    """Per verified tree, how many accepted nodes the source with origin `bit` proposed
    (filled as the engine generates), under a cost model where verification is nearly free,
    whatever step costs earlier tests left in the shared engine's: the trees verified are
    the drafts themselves, not the planner's cut of them."""
    from srsd_local.spec.cost import CostModel

    monkeypatch.setattr(engine.speculator, "cost", CostModel([1, 2, 64], [0.010, 0.0102, 0.011]))
    runs: list[int] = []
    observe = engine.speculator.observe

    def counting(req, plan, path):
        if plan is not None:
            runs.append(sum(1 for i in path[1:] if plan.tree.origin[i] & bit))
        return observe(req, plan, path)

    monkeypatch.setattr(engine.speculator, "observe", counting)
    return runs


def test_values_an_example_copied_are_drafted_by_analogy_and_accepted(seeded, monkeypatch):
    """After two worked examples, the current function's name, signature and summary are
    drafted by analogy (and after the keys the grammar forces); long runs of them are
    accepted, and the output is still plain constrained decoding's."""
    from srsd_local.spec.draft import ANALOGY

    engine, p = seeded, load_workload("json")[1]  # shutil.copyfile
    runs = _accepted_runs(engine, monkeypatch, ANALOGY)
    out = engine.generate(p.prompt, max_tokens=p.max_tokens, mode="srsd",
                          json_schema=p.json_schema)
    assert json.loads(out.text)["name"] == "copyfile"
    assert max(runs) >= 8 and sum(runs) >= 20, runs
    rep = engine.verify_output(p.prompt, out.token_ids, json_schema=p.json_schema)
    assert rep.ok, rep.summary()


def test_a_parameter_list_is_drafted_name_by_name_and_accepted(seeded, monkeypatch):
    """The `parameters` list of shutil.rmtree re-punctuates its signature's names
    (`path, ignore_errors=False, ...` as `"path", "ignore_errors", ...`): where the list
    opens, as both examples' lists opened, the whole list is drafted from the signature,
    closing included, and accepted in one run; the output is still plain constrained
    decoding's."""
    from srsd_local.spec.draft import LIST

    engine, p = seeded, load_workload("json")[7]  # shutil.rmtree
    runs = _accepted_runs(engine, monkeypatch, LIST)
    out = engine.generate(p.prompt, max_tokens=p.max_tokens, mode="srsd",
                          json_schema=p.json_schema)
    params = json.loads(out.text)["parameters"]
    assert params[:3] == ["path", "ignore_errors", "onerror"], params
    # `path", "ignore_errors", "onerror", "dir_fd"]}` in one step: 14 tokens (12 where the
    # list is drafted only once its first name and separator are written)
    assert max(runs) >= 14, runs
    rep = engine.verify_output(p.prompt, out.token_ids, json_schema=p.json_schema)
    assert rep.ok, rep.summary()


def test_unconstrained_argmax_is_refused_where_the_grammar_forbids_it(engine):
    """Plain decoding of this prompt starts with a token the grammar does not admit: the
    constrained output differs from the unconstrained one, and verify_output without the
    grammar reports the mismatch that the grammar explains."""
    prompt = "def add(a, b):\n"
    free = engine.generate(prompt, max_tokens=8, mode="ar")
    bound = engine.generate(prompt, max_tokens=40, mode="ar", grammar=GBNF)
    assert not free.text.startswith(LITERAL[:3]) and bound.text.startswith(LITERAL)
    assert not engine.verify_output(prompt, bound.token_ids).ok
    assert engine.verify_output(prompt, bound.token_ids, grammar=GBNF).ok


def _states_along(engine, tokens, **constraint):
    """The grammar state before each token of an output."""
    state = engine.constraint(**constraint)
    for t in tokens:
        yield state.clone()
        state.accept(t)


NON_ASCII_GBNF = {
    "a non-ASCII literal": 'root ::= "na\u00efve" | "\u00fcber alles" | "plain"',
    "a negated class": 'root ::= "x" [^a-z]+ "."',
    "an escaped range": 'root ::= "(" [\\u00e0-\\u00ff]+ ")"',
}


def _superset_by_scan(state) -> np.ndarray | None:
    """`possible()` computed over every token of the vocabulary (its lead bytes), without
    the byte groups: the tokens whose first byte the probes admit, those that start with an
    admitted space by the byte after it, and the ends of generation."""
    owner = state.owner
    lead = owner.lead
    first = state._admitted_bytes()
    keep = first[lead[:, 0]]
    for i, byte in owner.spaces:
        if first[byte]:
            after = state.clone()
            after.accept(int(owner.probe_ids[i]))
            second = after._admitted_bytes()
            second[0] = True
            rows = np.flatnonzero(lead[:, 0] == byte)
            keep[rows] = second[lead[rows, 1]]
    keep[owner.eog_ids] = True
    ids = np.flatnonzero(keep)
    return ids if 2 * len(ids) <= len(keep) else None


def test_the_grammar_names_a_superset_of_what_it_admits(engine):
    """`possible()` (single-character probes, one non-ASCII probe under ASCII-only grammars)
    never leaves out a token the grammar admits, checked against masking the whole
    vocabulary; at a JSON schema's punctuation it narrows 262k tokens to a few hundred; it
    is the superset a scan of every token's lead bytes names (gathered from the tokens
    grouped by their first bytes instead); and the masked argmax found through it equals the
    brute-force one."""
    from srsd_local.spec.sampling import best_allowed

    vocab = np.arange(engine.backend.n_vocab, dtype=np.int32)
    rng = np.random.default_rng(0)
    p = JSON_PROMPTS[0]
    out = engine.generate(p.prompt, max_tokens=40, mode="ar", json_schema=p.json_schema)
    cases = [(s, "schema") for s in list(_states_along(engine, out.token_ids,
                                                         json_schema=p.json_schema))[:12]]
    for name, gbnf in NON_ASCII_GBNF.items():
        st = engine.constraint(grammar=gbnf)
        cases.append((st.clone(), name))
        first = int(np.flatnonzero(st.mask(vocab))[0])
        st.accept(first)  # one step in, where the literal or the class decides
        cases.append((st, name))
    narrowed = 0
    for state, name in cases:
        admitted = np.flatnonzero(state.mask(vocab))
        sup = state.possible()
        scanned = _superset_by_scan(state)
        assert (sup is None) == (scanned is None), name
        if sup is not None:
            assert np.array_equal(sup, scanned), name
            missing = np.setdiff1d(admitted, sup)
            assert not len(missing), (name, [engine.backend.piece(int(t)) for t in missing[:5]])
            narrowed += len(sup) < 1000
        # logits that rank every admitted token far down: the search has to go past the rest
        x = rng.normal(size=len(vocab)).astype(np.float32)
        x[admitted] -= 20.0
        best = admitted[np.lexsort((admitted, -x[admitted]))[0]]
        assert best_allowed(x, state) == best, name
    assert narrowed >= 3


def test_sampled_constrained_outputs_follow_the_constraint(engine):
    p = JSON_PROMPTS[0]
    for mode in ("ar", "srsd"):
        for seed in (1, 2):
            out = engine.generate(p.prompt, max_tokens=96, mode=mode, temperature=0.8,
                                  seed=seed, json_schema=p.json_schema)
            assert _admitted_throughout(engine, out.token_ids, json_schema=p.json_schema)
            again = engine.generate(p.prompt, max_tokens=96, mode=mode, temperature=0.8,
                                    seed=seed, json_schema=p.json_schema)
            assert again.token_ids[:8] == out.token_ids[:8]  # the seed reproduces the start


def test_json_strings_cannot_hold_raw_control_characters(engine):
    state = engine.constraint(json_schema={"type": "object", "properties": {
        "a": {"type": "string"}}, "required": ["a"]})
    for t in engine.tokenize('{"a": "x', add_bos=False):
        assert state.allows(t)
        state.accept(t)
    newline = engine.tokenize("\n", add_bos=False)
    assert len(newline) == 1 and not state.allows(newline[0])
    assert state.allows(engine.tokenize("y", add_bos=False)[0])


def test_bad_grammars_and_schemas_name_the_problem(engine):
    with pytest.raises(GrammarError, match="Undefined rule identifier 'value'"):
        engine.generate("x", max_tokens=2, grammar="root ::= value")
    with pytest.raises(GrammarError, match="invalid json_schema at properties/a"):
        engine.generate("x", max_tokens=2, json_schema={"properties": {"a": {"type": 1}}})
    out = engine.generate("x", max_tokens=4, mode="ar")  # the engine still works
    assert out.finish_reason in ("stop", "length")


def test_json_object_mode_emits_one_object(engine):
    out = engine.generate("A JSON object describing a cat:\n", max_tokens=120, mode="srsd",
                          json_schema={"type": "object"})
    assert _admitted_throughout(engine, out.token_ids, json_schema={"type": "object"})
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


# -- the server -------------------------------------------------------------------------------
def test_server_structured_outputs(api_server, engine):
    import httpx
    from conftest import API_KEY

    auth = {"Authorization": f"Bearer {API_KEY}"}
    base = api_server["base"]
    p = JSON_PROMPTS[1]
    body = {"prompt": p.prompt, "max_tokens": p.max_tokens, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "function", "schema": p.json_schema}}}
    r = httpx.post(base + "/v1/completions", json=body, headers=auth, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert ConstraintSpec.make(json_schema=p.json_schema).validate(choice["text"]) is None
    ids = engine.tokenize(choice["text"], add_bos=False)
    assert engine.verify_output(p.prompt, ids, json_schema=p.json_schema).ok

    chat = {"messages": [{"role": "user", "content": "Is water wet?"}], "max_tokens": 40,
            "temperature": 0, "grammar": GBNF}
    r = httpx.post(base + "/v1/chat/completions", json=chat, headers=auth, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith(LITERAL)

    bad = {**body, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}}
    r = httpx.post(base + "/v1/completions", json=bad, headers=auth, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "properties/a/type" in err["message"]
    r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                   "grammar": "root ::= ("},
                   headers=auth, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text
    r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   headers=auth, timeout=60)
    assert r.status_code == 200, r.text  # still serving


def test_token_lead_bytes_are_read_back_from_the_cache_once_scanned(engine, monkeypatch):
    """Each token's first bytes (what a grammar constraint checks drafts with) are scanned
    from llama.cpp once per model file and read back from the cache directory after that;
    a stored file of another shape is scanned again."""
    from srsd_local import store  # noqa: PLC0415

    be = engine.backend
    monkeypatch.delattr(be, "_grammar_lead_bytes", raising=False)
    target = store.path("grammar", f"{store.file_key(be.model_path)}.npz")
    target.unlink(missing_ok=True)
    lead, eog = grammar._lead_bytes(be)
    assert target.exists() and lead.shape == (be.n_vocab, 2) and len(eog)
    assert lead[be.tokenize("{", add_bos=False, special=False)[0], 0] == ord("{")

    def no_scan(backend):
        raise AssertionError("scanned again although the cache holds this model's bytes")

    monkeypatch.delattr(be, "_grammar_lead_bytes")
    monkeypatch.setattr(grammar, "_scan_lead_bytes", no_scan)
    lead2, eog2 = grammar._lead_bytes(be)
    assert np.array_equal(lead, lead2) and np.array_equal(eog, eog2)
    np.savez(target, lead=lead[:-1], eog=eog)  # another vocabulary's shape: not used
    monkeypatch.delattr(be, "_grammar_lead_bytes")
    with pytest.raises(AssertionError, match="scanned again"):
        grammar._lead_bytes(be)
    for junk in (b"", b"PK\x03\x04 truncated", b"\x93NUMPY not an archive"):
        target.write_bytes(junk)  # unreadable: scanned again, never an error
        monkeypatch.delattr(be, "_grammar_lead_bytes", raising=False)
        with pytest.raises(AssertionError, match="scanned again"):
            grammar._lead_bytes(be)
    monkeypatch.undo()
    monkeypatch.delattr(be, "_grammar_lead_bytes", raising=False)
    assert np.array_equal(grammar._lead_bytes(be)[0], lead)  # scanned and stored again
    assert np.load(target)["lead"].shape == (be.n_vocab, 2)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_pruning_a_drafted_tree_checks_every_path_and_leaves_the_state_alone(engine, compiled,
                                                                            monkeypatch):
    """GrammarState.prune (drafted nodes checked along their paths; a node's state handed on
    to its last admitted child instead of cloned) keeps exactly the nodes a fresh state
    accepts token by token along each path, returns each kept leaf's state as that walk
    leaves it, and does not advance the state it is called on: in one compiled call and
    from Python (where no C compiler is there) alike."""
    assert grammar._compiled() is not None  # (the test machine has a compiler)
    if not compiled:
        monkeypatch.setattr(grammar, "_compiled", lambda: None)
    p = JSON_PROMPTS[0]
    out = engine.generate(p.prompt, max_tokens=40, mode="ar", json_schema=p.json_schema)
    toks = out.token_ids
    state = engine.constraint(json_schema=p.json_schema)
    state.accept(toks[0])  # the root: accepted already
    # a chain along the output, a branch off it that the grammar rejects, a branch that
    # diverges later, and a second chain under the root
    bad = engine.tokenize("}}}", add_bos=False)[0]
    tokens = [toks[0], *toks[1:9]]  # nodes 0..8: a chain
    parents = [-1, *range(0, 8)]
    tokens += [bad, bad]
    parents += [2, 9]  # node 9 under node 2 (rejected), node 10 under it (rejected too)
    tokens += [toks[6]]
    parents += [4]  # node 11 under node 4: a token the chain has two steps later
    tokens += [toks[1]]
    parents += [0]  # node 12: a second child of the root (the chain's first token again)
    tokens += [toks[3], toks[4]]
    parents += [2, 13]  # nodes 13-14: node 3's token again under node 2, and the next one
    vocab = np.arange(engine.backend.n_vocab, dtype=np.int32)
    before = state.mask(vocab)
    keep, leaves = state.prune(tokens, parents)
    assert np.array_equal(state.mask(vocab), before)  # not advanced

    def path(node):
        out = []
        while node > 0:
            out.append(tokens[node])
            node = parents[node]
        return out[::-1]

    has_child = {q for q in parents if q >= 0}
    for node in range(1, len(tokens)):
        walk = engine.constraint(json_schema=p.json_schema)
        walk.accept(toks[0])
        ok = True
        for t in path(node):
            if not walk.allows(t):
                ok = False
                break
            walk.accept(t)
        assert keep[node] == ok, node
        if ok and node not in has_child:
            assert np.array_equal(leaves[node].mask(vocab), walk.mask(vocab)), node
        else:
            assert node not in leaves
    assert keep[1:9] == [True] * 8 and not keep[9] and not keep[10] and keep[12]
    assert keep[13] and keep[14] and 14 in leaves  # two admitted siblings, each its own state


def test_states_of_one_grammar_mask_through_one_buffer_per_thread(engine):
    """Masking goes through one candidate buffer per grammar and thread: each state's answer
    is its own whatever the order and length of the asks (checked against masking the whole
    vocabulary), an empty ask gets an empty answer, and another thread gets the same answers
    through a buffer of its own."""
    import threading

    p = JSON_PROMPTS[0]
    out = engine.generate(p.prompt, max_tokens=12, mode="ar", json_schema=p.json_schema)
    states = list(_states_along(engine, out.token_ids, json_schema=p.json_schema))[:6]
    vocab = np.arange(engine.backend.n_vocab, dtype=np.int32)
    full = [s.mask(vocab) for s in states]
    assert len({f.sum() for f in full}) > 1  # the positions admit different tokens
    rng = np.random.default_rng(1)
    for _ in range(30):
        i = int(rng.integers(len(states)))
        ids = rng.choice(vocab, size=int(rng.integers(1, 400))).astype(np.int32)
        ids[0] = int(np.flatnonzero(full[i])[0])  # at least one admitted token in the ask
        assert np.array_equal(states[i].mask(ids), full[i][ids])
    assert states[0].mask(np.zeros(0, np.int32)).shape == (0,)
    got: dict[int, np.ndarray] = {}

    def other_thread():
        for i in (3, 1):
            got[i] = states[i].mask(vocab)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert np.array_equal(got[3], full[3]) and np.array_equal(got[1], full[1])


def test_forced_text_is_the_same_compiled_and_from_python(engine):
    """What the grammar forces (its characters while it admits one, optional whitespace as
    the output writes it) is found in one compiled call from a SpaceStyle, and the same
    from Python with the style's function, at every position of outputs (a schema's keys,
    punctuation, free strings and numbers), after every kind of previous character, with a
    style that learned other spacing."""
    assert grammar._compiled() is not None
    forced = 0
    for p in JSON_PROMPTS[:2]:
        out = engine.generate(p.prompt, max_tokens=48, mode="ar", json_schema=p.json_schema)
        styles = [grammar.SpaceStyle(), grammar.SpaceStyle()]
        styles[1].feed('{"a":1,"b":[2,3] }')  # no space after ':' or ',', one after ']'
        assert not styles[1].space_after(":") and styles[1].space_after("]")
        for state in _states_along(engine, out.token_ids, json_schema=p.json_schema):
            for style in styles:
                for prev in ("", ":", ",", "{", "a", "\u00e9"):
                    for n in (1, 4, 24):
                        got = state.forced_text(n, style, prev)
                        assert got == state.forced_text(n, style.space_after, prev), (
                            got, prev, n)
                        forced += bool(got)
    assert forced > 0  # some positions force text


def test_loading_a_model_builds_the_grammar_checks_before_any_request(model_path, monkeypatch):
    """Engine.load builds and loads the compiled grammar checks (the first use on a machine
    compiles them, ~0.3 s): a first request under a grammar no longer pays for that in its
    steps' host time."""
    from srsd_local.engine import Engine

    calls = []
    real = grammar._compiled
    monkeypatch.setattr(grammar, "_compiled", lambda: calls.append(1) or real())
    with Engine.load(model_path, n_ctx=1024, learned=False, adaptive=False) as eng:
        assert calls, "the grammar checks were not built at load"
        built = len(calls)
        out = eng.generate(JSON_PROMPTS[0].prompt, max_tokens=24, mode="srsd",
                           json_schema=SCHEMA)
        assert out.token_ids
        assert len(calls) > built  # (the requests' checks ask the same loaded build)
    assert real() is not None  # this machine has a compiler: the build loaded


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_take_if_admitted_checks_and_advances_in_one_call(engine, compiled, monkeypatch):
    """GrammarState.take_if_admitted: along an output, each of its tokens is admitted and
    taken (the state then admits exactly what a state that accepted it admits), and a token
    the grammar rejects there is refused with the state left as it was; compiled and from
    Python alike. A greedy constrained sampler given that state draws the same tokens as
    one given a state without the method (best_allowed's check, then accept)."""
    assert grammar._compiled() is not None
    if not compiled:
        monkeypatch.setattr(grammar, "_compiled", lambda: None)
    p = JSON_PROMPTS[0]
    out = engine.generate(p.prompt, max_tokens=40, mode="ar", json_schema=p.json_schema)
    toks = out.token_ids
    bad = engine.tokenize("}}}", add_bos=False)[0]
    vocab = np.arange(engine.n_vocab, dtype=np.int32)
    state, ref = (engine.constraint(json_schema=p.json_schema) for _ in range(2))
    refused = 0
    for t in toks:
        if not ref.allows(bad):
            before = state.mask(vocab)
            assert not state.take_if_admitted(bad)
            assert np.array_equal(state.mask(vocab), before)  # left as it was
            refused += 1
        assert state.take_if_admitted(t)
        ref.accept(t)
        assert np.array_equal(state.mask(vocab), ref.mask(vocab))
    assert refused > 0

    from srsd_local.config import SamplingParams
    from srsd_local.spec.sampling import ConstrainedSampler

    class NoTake:  # the same grammar without the one-call check
        def __init__(self, st):
            self.st = st

        def mask(self, ids):
            return self.st.mask(ids)

        def accept(self, token):
            self.st.accept(token)

    rng = np.random.default_rng(5)
    greedy = SamplingParams(temperature=0.0)
    a = ConstrainedSampler(greedy, engine.constraint(json_schema=p.json_schema))
    b = ConstrainedSampler(greedy, NoTake(engine.constraint(json_schema=p.json_schema)))
    took_top = 0
    for i, t in enumerate(toks[:16]):  # rows whose argmax the grammar admits (the output's
        # token made the best) and random rows (their argmax mostly rejected)
        x = rng.normal(size=engine.n_vocab).astype(np.float32)
        if i % 2 == 0:
            x[t] = x.max() + 1.0
        top = int(np.argmax(x)) if i % 4 < 2 else None  # given, or found in the row
        got = a(x, top)
        assert got == b(x, top), i
        took_top += got == int(np.argmax(x))
    assert 0 < took_top < 16

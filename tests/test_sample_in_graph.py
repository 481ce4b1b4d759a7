"""sample_in_graph on the real default model: greedy trees verified with llama.cpp's in-graph
greedy sampler (only token ids come back) give plain decoding's tokens at every position;
greedy requests under a grammar get the argmax and the rows; requests that need the logits
(sampled, log-probabilities) still get them, alone and sharing a batch with in-graph trees;
by default on a CPU, only the trees whose walk is expected to read enough rows are sampled in
the graph."""

from __future__ import annotations

import numpy as np
import pytest

from srsd_local.bench.workloads import load_workload
from srsd_local.config import SRSDConfig
from srsd_local.llama.grammar import schema_problem

pytestmark = pytest.mark.model

EDIT = load_workload("code_edit")[0]
JSON = load_workload("json")[0]
GEN = load_workload("humaneval")[0]


@pytest.fixture(scope="module")
def graph_engine(model_path):
    from srsd_local.engine import Engine

    # no controller: a tree every step, whatever this machine's costs say about them
    eng = Engine.load(model_path, n_ctx=4096, learned=False, sample_in_graph=True,
                      parallel=2, adaptive=False, max_nodes=16, max_branches=4)
    yield eng
    eng.close()


def test_config_reserves_a_block_of_sampled_branch_ids_per_slot():
    cfg = SRSDConfig(parallel=2, max_branches=4, sample_in_graph=True)
    assert cfg.seq_max == 2 * 5 + 2 * 4
    assert [cfg.graph_branch_base(i) for i in range(2)] == [10, 14]
    assert SRSDConfig(parallel=2, max_branches=4, sample_in_graph=False).seq_max == 10
    with pytest.raises(ValueError, match="2 \\* max_branches \\+ 1"):
        SRSDConfig(parallel=4, max_branches=40, sample_in_graph=True)
    with pytest.raises(ValueError, match="sample_in_graph"):
        SRSDConfig(sample_in_graph="yes")
    # auto: on where the ids allow it, with GPU layers or without (which trees are sampled
    # in the graph then depends on where the logits are computed), else off (never an error)
    for gpu in (0, -1):
        assert SRSDConfig(n_gpu_layers=gpu, parallel=2, max_branches=4).seq_max == 18
        assert not SRSDConfig(n_gpu_layers=gpu, parallel=4, max_branches=40).graph_sampling
        assert SRSDConfig(n_gpu_layers=gpu, parallel=4, max_branches=40).seq_max == 4 * 41


def test_greedy_trees_sampled_in_graph_equal_plain_decoding(graph_engine, monkeypatch):
    """Trees of several branches included: branch 0 on the main sequence (sampled in the
    graph as well), the other branches on the sampled branch ids."""
    be = graph_engine.backend
    forks: list[tuple[int, int | None, bool]] = []
    seq_fork = be.seq_fork

    def recording_fork(base, n_branches, first=None, with_base=False):
        forks.append((n_branches, first, with_base))
        seq_fork(base, n_branches, first, with_base)

    monkeypatch.setattr(be, "seq_fork", recording_fork)
    branches = []
    for mode, prompt in (("srsd", EDIT), ("retrieval", EDIT), ("srsd", GEN)):
        rows0 = be.graph_rows
        forks.clear()
        out = graph_engine.generate(prompt.prompt, max_tokens=96, mode=mode)
        assert out.stats.drafts > 0 and out.stats.accepted_tokens > 0
        # every verified tree's rows came back as llama.cpp's argmax
        assert be.graph_rows - rows0 >= out.stats.drafts * 2
        rep = graph_engine.verify_output(prompt.prompt, out.token_ids)
        assert rep.ok, (mode, rep.summary())
        # (the first call: the prompt's cells shared with every branch id of the slot)
        slot = max(graph_engine.slots, key=lambda s: s.last_used)
        first = graph_engine.config.graph_branch_base(graph_engine.slots.index(slot))
        assert forks[0] == (graph_engine.config.max_branches + 1, first, True)
        trees = forks[1:]
        assert len(trees) == out.stats.drafts
        assert all(with_base and f == (first if b > 1 else slot.base)
                   for b, f, with_base in trees)
        branches += [b for b, _, _ in trees]
    assert max(branches) > 1


def test_tree_passes_and_their_paths_go_through_the_compiled_calls_and_change_nothing(
        graph_engine):
    # a tree's pass and the reading of its in-graph tokens are one compiled call, its
    # accepted path's rows go into the index in another: both are used on the real model,
    # and with both off (ctypes calls, numpy's add) the output and the index are the same
    be = graph_engine.backend
    assert be._rows_step is not None and graph_engine.slots[0].index._stage_path is not None
    real_step, real_stage = be._rows_step, graph_engine.slots[0].index._stage_path
    calls = {"pass": 0, "path": 0}

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    def run(compiled: bool):
        be._rows_step = counted("pass", real_step) if compiled else None
        stage = counted("path", real_stage) if compiled else None
        for slot in graph_engine.slots:
            slot.index._stage_path = stage
        graph_engine.reset()
        out = graph_engine.generate(EDIT.prompt, max_tokens=64, mode="srsd")
        slot = next(s for s in graph_engine.slots if len(s.index))
        slot.index._flush()
        n = len(slot.index)
        return out, n, slot.index._buf[:n].copy(), slot.index._pos[:n].copy()

    try:
        on, n_on, buf_on, pos_on = run(True)
        assert on.stats.drafts > 0 and calls["pass"] >= on.stats.drafts
        assert calls["path"] > 0
        off, n_off, buf_off, pos_off = run(False)
    finally:
        be._rows_step = real_step
        for slot in graph_engine.slots:
            slot.index._stage_path = real_stage
    assert on.token_ids == off.token_ids
    assert n_on == n_off and np.array_equal(pos_on, pos_off)
    assert np.array_equal(buf_on, buf_off)
    rep = graph_engine.verify_output(EDIT.prompt, on.token_ids)
    assert rep.ok, rep.summary()


def test_requests_that_need_logits_still_get_them(graph_engine):
    be = graph_engine.backend
    rows0 = be.graph_rows
    # log-probabilities come from the rows
    lp = graph_engine.generate(EDIT.prompt, max_tokens=24, mode="srsd", logprobs=2)
    assert len(lp.logprobs) == len(lp.token_ids)
    assert all(-50.0 < e.logprob <= 0.0 for e in lp.logprobs)
    # sampled trees draw from the rows: finite log-probabilities show they were real logits
    sampled = graph_engine.generate(EDIT.prompt, max_tokens=48, mode="srsd", temperature=0.3,
                                    seed=7, logprobs=0)
    assert sampled.stats.drafts > 0 and len(sampled.token_ids) == 48
    assert all(-50.0 < e.logprob <= 0.0 for e in sampled.logprobs)
    assert be.graph_rows == rows0
    assert not be.kept_seqs


def test_constrained_greedy_takes_the_graphs_argmax_and_reads_kept_rows(graph_engine,
                                                                        monkeypatch):
    """Greedy under a grammar: each row's argmax comes from the graph and the row is copied
    out too; the grammar checks the argmax, and where it rejects it the best admitted token
    is found in the kept row. Plain steps (ar) and trees (srsd) alike; in a tree, an argmax
    that is a drafted child the grammar admitted before the pass is taken unchecked; in a
    run of plain steps, the grammar checks and takes each argmax in the run, a rejected one
    is searched as a step's."""
    from srsd_local.spec import sampling

    be = graph_engine.backend
    seen = {"given": 0, "rejected": 0, "taken": 0, "run": 0}
    step_run = be.step_run

    def spy_run(*args, **kwargs):
        out = step_run(*args, **kwargs)
        if (args[8] if len(args) > 8 else kwargs.get("check")) is not None:
            seen["run"] += len(out.sampled) - out.rejected  # (checked and taken in the run)
        return out

    draw = sampling.ConstrainedSampler.__call__
    take = sampling.ConstrainedSampler.take

    def spy(self, x, top=None, **kwargs):
        tok = draw(self, x, top, **kwargs)
        if top is not None:
            seen["given"] += 1
            seen["rejected"] += tok != top
        return tok

    def spy_take(self, token):
        seen["taken"] += 1
        return take(self, token)

    monkeypatch.setattr(sampling.ConstrainedSampler, "__call__", spy)
    monkeypatch.setattr(sampling.ConstrainedSampler, "take", spy_take)
    monkeypatch.setattr(be, "step_run", spy_run)
    for mode in ("ar", "srsd"):
        rows0, given0, rejected0 = be.graph_rows, seen["given"], seen["rejected"]
        taken0, run0 = seen["taken"], seen["run"]
        out = graph_engine.generate(JSON.prompt, max_tokens=JSON.max_tokens, mode=mode,
                                    json_schema=JSON.json_schema)
        assert be.graph_rows - rows0 >= len(out.token_ids) - 1, mode
        taken = seen["taken"] - taken0
        assert seen["given"] - given0 + taken + seen["run"] - run0 >= len(out.token_ids) - 1, \
            mode
        if mode == "ar":  # (in runs, the default: plain_run > 1)
            assert seen["run"] > run0
        # plain steps check every argmax; a tree's accepted drafted nodes were checked
        # before its pass
        assert (taken > 0) == (mode == "srsd"), (mode, taken)
        assert taken <= out.stats.accepted_tokens, mode
        # the grammar rejected the graph's argmax somewhere: the kept row was read there
        assert seen["rejected"] > rejected0, mode
        assert be.kept_seqs, mode
        if mode == "srsd":
            assert out.stats.drafts > 0 and out.stats.accepted_tokens > 0
        assert schema_problem(JSON.json_schema, out.text) is None, (mode, out.text)
        rep = graph_engine.verify_output(JSON.prompt, out.token_ids,
                                         json_schema=JSON.json_schema)
        assert rep.ok, (mode, rep.summary())
    # sharing passes with a greedy request's argmax-only rows (every row sampled: the kept
    # rows found among rows copied out for this request alone), then with a sampled
    # request's rows (every row copied out)
    for other in ({}, {"temperature": 0.7, "seed": 3}):
        given0 = seen["given"]
        constrained, edit = graph_engine.generate_many([
            {"prompt": JSON.prompt, "max_tokens": JSON.max_tokens, "mode": "srsd",
             "json_schema": JSON.json_schema},
            {"prompt": EDIT.prompt, "max_tokens": 64, "mode": "srsd", **other},
        ])
        assert seen["given"] - given0 >= len(constrained.token_ids) - 1 - \
            constrained.stats.accepted_tokens, other
        assert schema_problem(JSON.json_schema, constrained.text) is None, other
        assert graph_engine.verify_output(JSON.prompt, constrained.token_ids,
                                          json_schema=JSON.json_schema).ok, other
        assert len(edit.token_ids) == 64
        if not other:
            assert graph_engine.verify_output(EDIT.prompt, edit.token_ids).ok


def test_in_graph_and_logits_trees_share_a_batch(graph_engine):
    be = graph_engine.backend
    rows0 = be.graph_rows
    greedy, sampled = graph_engine.generate_many([
        {"prompt": EDIT.prompt, "max_tokens": 64, "mode": "srsd"},
        {"prompt": EDIT.prompt, "max_tokens": 64, "mode": "srsd", "temperature": 0.7,
         "seed": 3},
    ])
    assert be.graph_rows > rows0
    assert greedy.stats.drafts > 0 and sampled.stats.drafts > 0
    assert len(sampled.token_ids) == 64
    assert graph_engine.verify_output(EDIT.prompt, greedy.token_ids).ok


def test_cli_flag_reaches_the_engine_config():
    from srsd_local.cli import _engine_config, build_parser

    for cmd in (["generate", "--prompt", "x"], ["serve"], ["ui"], ["bench"],
                ["verify", "--prompt", "x"]):
        on = _engine_config(build_parser().parse_args([*cmd, "--sample-in-graph"]))
        off = _engine_config(build_parser().parse_args([*cmd, "--no-sample-in-graph"]))
        auto = _engine_config(build_parser().parse_args(cmd))
        assert SRSDConfig(**on).sample_in_graph is True, cmd
        assert SRSDConfig(**off).sample_in_graph is False, cmd
        assert SRSDConfig(**auto).sample_in_graph is None, cmd
        gpu = _engine_config(build_parser().parse_args([*cmd, "--n-gpu-layers", "-1"]))
        assert SRSDConfig(**gpu).graph_sampling, cmd
        assert SRSDConfig(**auto).graph_sampling, cmd
        assert not SRSDConfig(**off).graph_sampling, cmd


def test_trees_sampled_in_graph_replay_from_their_recording(graph_engine, monkeypatch):
    """Host replay of in-graph sampling (the configuration meant for GPUs): the recording
    keeps the token llama.cpp's graph took for each tree row, the replay serves them (no
    llama_decode of its own, no logits rows for those rows), and its output is the recorded
    one (checked inside replayed_stats)."""
    from srsd_local.llama.replay import PassReplay, ReplayMismatch

    be = graph_engine.backend
    real = {"decode": 0, "sampled": 0}
    decode, sampled = be._L.llama_decode, be._L.llama_get_sampled_token_ith

    def counting_decode(ctx, batch):
        real["decode"] += 1
        return decode(ctx, batch)

    def counting_sampled(ctx, i):
        real["sampled"] += 1
        return sampled(ctx, i)

    read = be._read_sampled

    def counting_read(rows, out):  # a tree's rows: read in one compiled call where built
        some = read(rows, out)
        if be._reader is not None:  # (else through llama_get_sampled_token_ith, counted)
            real["sampled"] += some
        return some

    served = []
    serve = PassReplay.serve

    def counting_serve(self, backend, m):
        served.append(m)
        return serve(self, backend, m)

    monkeypatch.setattr(be._L, "llama_decode", counting_decode)
    monkeypatch.setattr(be._L, "llama_get_sampled_token_ith", counting_sampled)
    monkeypatch.setattr(be, "_read_sampled", counting_read)
    monkeypatch.setattr(PassReplay, "serve", counting_serve)
    rows0 = be.graph_rows
    stats = graph_engine.replayed_stats(EDIT.prompt, max_tokens=48, mode="srsd")
    assert stats.tokens == 48 and stats.drafts > 0 and stats.host_tree > 0
    assert real["decode"] == len(served) > 0  # the replay decoded nothing itself
    # rows sampled in the graph in both runs: as many served as recorded, each token read
    # from llama.cpp once, while recording; none while serving
    in_graph = be.graph_rows - rows0
    assert in_graph > 0 and in_graph % 2 == 0
    assert real["sampled"] == in_graph // 2

    # a pass recorded without its in-graph tokens cannot be served as if it had them
    rep = PassReplay()
    rep._sampled = None
    with pytest.raises(ReplayMismatch, match="in-graph sampled tokens"):
        rep.sampled_rows()


@pytest.mark.parametrize("kind", ["srsd-threads", "srsd-ggml", "llama"])
def test_in_graph_tokens_are_numpys_argmax_and_only_llamas_sampler_copies_rows(
        model_path, monkeypatch, kind):
    """The same batch decoded on a sampled sequence (tokens from the graph) and on an ordinary
    one (logits rows): every row's token is the rows' argmax, whichever sampler took it. The
    compiled samplers give nothing back but the token; llama.cpp's greedy sampler also has
    each row copied out as its sampled logits (what the compiled ones exist to spare)."""
    import numpy as np

    from srsd_local.llama import graph_argmax
    from srsd_local.llama.backend import Backend

    if kind == "llama":
        monkeypatch.setenv("SRSD_GRAPH_SAMPLER", "llama")
    if kind == "srsd-ggml":  # the flavour meant for a GPU, run by ggml's CPU backend here
        monkeypatch.setattr(Backend, "_output_on_cpu", lambda self: False)
    cfg = SRSDConfig(n_ctx=1024, sample_in_graph=True, max_branches=2, max_nodes=16)
    be = Backend(model_path, cfg)
    try:
        assert be.graph_sampler == kind
        L, g = be._L, min(be.graph_seqs)
        toks = be.tokenize(EDIT.prompt)[:17]  # the most outputs a sampled sequence may have
        pos = list(range(len(toks)))
        direct0 = graph_argmax.rows_sampled(direct=True)
        out = be.decode(toks, pos, seq_ids=[[g]] * len(toks), want_logits="all")
        assert out.sampled is not None and len(out.sampled) == len(toks)
        copied = [L.llama_get_sampled_logits_count_ith(be.ctx, i) for i in range(len(toks))]
        be.seq_trim(g, 0)
        ref = be.decode(toks, pos, seq_ids=[[0]] * len(toks), want_logits="all").logits
        assert out.sampled.tolist() == np.argmax(ref, axis=1).tolist()
        taken = graph_argmax.rows_sampled(direct=True) - direct0
        if kind == "llama":
            assert copied == [be.n_vocab] * len(toks) and taken == 0
        else:
            assert copied == [0] * len(toks)
            assert taken == (len(toks) if kind == "srsd-threads" else 0)
    finally:
        be.close()



def test_in_graph_tokens_of_a_batch_split_into_several_llama_decode_calls(model_path):
    """A decode longer than n_batch runs as several llama_decode calls: each call's sampled
    tokens are kept (the buffer they are read into is reused by the next call), so the
    whole batch's tokens are the rows' argmax, as one call gives them."""
    import numpy as np

    from srsd_local.llama.backend import Backend

    cfg = SRSDConfig(n_ctx=1024, sample_in_graph=True, max_branches=2, max_nodes=4,
                     n_batch=5, n_ubatch=5, pld_draft_len=3)  # (5: max_nodes + 1 rows)
    be = Backend(model_path, cfg)
    try:
        g = min(be.graph_seqs)
        toks = be.tokenize(EDIT.prompt)[:17]
        pos = list(range(len(toks)))
        out = be.decode(toks, pos, seq_ids=[[g]] * len(toks), want_logits="all")
        assert out.sampled is not None and len(out.sampled) == len(toks)
        be.seq_trim(g, 0)
        ref = be.decode(toks, pos, seq_ids=[[0]] * len(toks), want_logits="all").logits
        assert out.sampled.tolist() == np.argmax(ref, axis=1).tolist()
    finally:
        be.close()


def test_a_greedy_request_is_sampled_in_graph_on_its_main_sequence(model_path, monkeypatch):
    """By default (on a CPU too): a greedy request's main sequence carries a greedy sampler,
    so its plain steps (one by one or in runs) and its chains come back as token ids (no
    logits row copied out, no fork), its other trees with branch 0 there too and the other
    branches on the sampled branch ids; the prompt's last row still has its logits copied
    out (kept for a repeat of the prompt in any mode); a request that needs the logits takes
    the sampler off first. Outputs are plain decoding's."""
    import numpy as np

    from srsd_local.engine import Engine

    eng = Engine.load(model_path, n_ctx=4096, learned=False)
    try:
        be = eng.backend
        assert be.graph_sampling and eng.config.sample_in_graph is None
        L = be._L
        calls = {"plain": 0, "rows": 0}
        step_at = be.step_at

        def counting_step(token, pos, seq, *rest):
            out = step_at(token, pos, seq, *rest)
            calls["plain"] += 1
            calls["rows"] += out.sampled is not None
            assert out.sampled is None or np.isnan(out.logits).all()
            return out

        step_run = be.step_run

        def counting_run(token, pos, seq, n, *rest):  # (a run of plain steps: each a token)
            out = step_run(token, pos, seq, n, *rest)
            calls["plain"] += len(out.sampled)
            calls["rows"] += len(out.sampled)
            calls["runs"] += 1
            assert 1 <= len(out.sampled) <= n and min(out.sampled) >= 0
            return out

        monkeypatch.setattr(be, "step_at", counting_step)
        monkeypatch.setattr(be, "step_run", counting_run)
        calls["runs"] = 0
        forks: list[tuple[int, int, bool, int]] = []  # per tree: branches, first id, with
        # the main sequence as branch 0, copies
        seq_cp, seq_fork = L.llama_memory_seq_cp, be.seq_fork
        copies = []
        monkeypatch.setattr(L, "llama_memory_seq_cp",
                            lambda mem, a, b, p0, p1: copies.append(b) or
                            seq_cp(mem, a, b, p0, p1))

        def recording_fork(base, n_branches, first=None, with_base=False):
            n0 = len(copies)
            seq_fork(base, n_branches, first, with_base)
            forks.append((n_branches, first, with_base, len(copies) - n0))

        shares: list[tuple[int, int, bool]] = []  # per generation: its ids, the prompt's
        seq_share = be.seq_share  # cells shared with them once

        def recording_share(base, n_branches, first=None, with_base=False):
            n0 = len(forks)
            seq_share(base, n_branches, first, with_base)
            assert len(forks) == n0 + 1
            shares.append(forks.pop()[:3])

        monkeypatch.setattr(be, "seq_fork", recording_fork)
        monkeypatch.setattr(be, "seq_share", recording_share)
        rows0 = be.graph_rows
        outs = {}
        for p in (EDIT, GEN):
            outs[p.prompt] = out = eng.generate(p.prompt, max_tokens=96, mode="srsd")
            assert 0 in be.graph_seqs  # slot 0's main sequence (kept for the next request)
        stats = [o.stats for o in outs.values()]
        plain = sum(s.steps - s.drafts - 1 for s in stats)  # (the prompt's pass is a step)
        assert calls["plain"] == calls["rows"] == plain > 0  # every plain step: a token
        assert calls["runs"] > 0  # (the steps a back-off skips go as runs)
        assert be.graph_rows - rows0 >= plain + 2 * sum(s.drafts for s in stats)
        # chains (one branch) are verified on the main sequence itself, without a copy of
        # it; a tree of b branches has its branch 0 there too and the others on the sampled
        # branch ids (b - 1 copies, of the cells the main sequence got since the prompt's
        # were shared with all of those ids, once per generation)
        assert len(forks) == sum(s.drafts for s in stats)
        graph_first = eng.config.graph_branch_base(0)
        assert shares == [(eng.config.max_branches + 1, graph_first, True)] * len(outs)
        assert any(b == 1 for b, _, _, _ in forks)
        for b, first, with_base, n_copies in forks:
            assert with_base and n_copies == b - 1
            assert first == (0 if b == 1 else graph_first)
        for prompt, out in outs.items():
            assert eng.verify_output(prompt, out.token_ids).ok
        # verify_output decoded sequence 0 with its logits: the sampler was taken off
        assert 0 not in be.graph_seqs
        # a repeat of the prompt starts from the logits kept from its prefill, in any mode
        greedy = eng.generate(EDIT.prompt, max_tokens=8, mode="ar")
        assert 0 in be.graph_seqs
        lp = eng.generate(EDIT.prompt, max_tokens=8, mode="ar", logprobs=1)
        assert 0 not in be.graph_seqs and lp.stats.reused_prompt_tokens == len(
            be.tokenize(EDIT.prompt))
        assert lp.token_ids == greedy.token_ids
        assert all(-50.0 < e.logprob <= 0.0 for e in lp.logprobs)
    finally:
        eng.close()


def test_sampled_plain_steps_are_drawn_in_the_graph_as_the_host_draws(graph_engine,
                                                                      monkeypatch):
    """A request sampled at a temperature alone has its plain steps' tokens drawn in
    llama.cpp's graph, by the host's compiled draw with the uniform draw the host would
    take: the same tokens as drawing on the host, position by position; its trees are
    drawn on the host from rows kept on the sampled branch ids."""
    from srsd_local.spec.sampling import Sampler

    be = graph_engine.backend

    def drawn_rows():  # rows drawn in the graph by the slots' main sequences' samplers
        states = [be.draw_state(q) for q in range(graph_engine.config.seq_max)]
        return [st.rows for st in states if st is not None]

    prompt = load_workload("open")[0]
    kw = {"max_tokens": 48, "temperature": 0.8, "seed": 11}
    # both generations compared start from an empty cache: the same cells hold the same
    # positions (where they lie in the cache changes the logits' rounding, and a draw near
    # a boundary between two tokens with them: seen on an AVX-512 machine at position 4)
    graph_engine.reset()
    drawn = graph_engine.generate(prompt.prompt, mode="ar", **kw)
    assert max(drawn_rows()) >= len(drawn.token_ids) - 1
    tree = graph_engine.generate(EDIT.prompt, mode="srsd", **kw)
    assert tree.stats.drafts > 0 and len(tree.token_ids) == 48
    monkeypatch.setattr(Sampler, "drawn_compiled", property(lambda self: False))
    graph_engine.reset()
    host = graph_engine.generate(prompt.prompt, mode="ar", **kw)
    assert drawn.token_ids == host.token_ids
    assert len(set(drawn.token_ids)) > 10  # a sampled text, not one token repeated

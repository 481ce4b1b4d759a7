"""The minimal C decode loop (bench/cloop.py, the `c-loop` bench peer): its argmax is
numpy's, and on the real model it decodes exactly the engine's `ar` tokens, greedy and at a
temperature with the same seed."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from srsd_local.bench import cloop
from srsd_local.bench.peers import PEER_MODES, start_peers
from srsd_local.bench.peers import PeerSettings as Settings


def _lib():
    lib = cloop.library()
    if lib is None:
        pytest.skip("no C compiler: the c-loop peer is not available")
    return lib


@pytest.mark.parametrize("n", [1, 2, 15, 31, 32, 33, 1000, 262_144, 262_147])
def test_the_loops_argmax_is_numpys_first_largest(n):
    lib = _lib()
    rng = np.random.default_rng(n)
    rows = [rng.normal(size=n).astype(np.float32), np.zeros(n, np.float32),
            np.full(n, -np.inf, np.float32)]
    tied = rng.integers(0, 5, size=n).astype(np.float32)  # many ties at the maximum
    rows.append(tied)
    late = np.full(n, -np.inf, np.float32)
    late[-1] = 1.0  # the largest value last (the tail after the vector blocks)
    rows.append(late)
    for row in rows:
        assert lib.srsd_loop_argmax(row.ctypes.data, n) == int(np.argmax(row))


def test_c_loop_is_a_peer_mode_started_by_start_peers():
    made = []
    modes, peers = start_peers(["ar", "c-loop"], Settings("m.gguf", 512, 1, 0), None,
                               make_loop=lambda s: made.append(s) or "peer")
    assert "c-loop" in PEER_MODES and modes == ["ar", "c-loop"]
    assert peers == {"c-loop": "peer"} and made[0].n_ctx == 512


@pytest.mark.model
def test_the_c_loop_decodes_the_engines_ar_tokens_greedy_and_sampled(engine):
    from srsd_local.bench.peers import CLoopPeer, PeerSettings
    from srsd_local.bench.workloads import BenchPrompt

    _lib()
    peer = CLoopPeer(PeerSettings.of(engine))
    try:
        assert peer.backend.capture is None  # its own context, no eval callback
        text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
        for temperature, seed in ((0.0, None), (0.8, 4), (1.1, 9)):
            p = BenchPrompt("p", "code_edit", text, 40, temperature=temperature, seed=seed)
            got = peer.run(p)
            engine.reset()
            ar = engine.generate(text, max_tokens=40, temperature=temperature, seed=seed,
                                 mode="ar")
            assert got.token_ids == list(ar.token_ids) and got.tokens == len(ar.token_ids)
            assert got.seconds > 0 and got.prompt_tokens == ar.stats.prompt_tokens
        # an end-of-generation token stops it and is not written: the vocabulary's test
        # replaced by one that calls the greedy output's 6th token the end
        greedy = peer.run(BenchPrompt("p", "code_edit", text, 40)).token_ids
        end = greedy[5]

        @ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int32)
        def is_end(_vocab, token):
            return token == end
        peer.loop._fns[2] = ctypes.cast(is_end, ctypes.c_void_p).value
        got = peer.run(BenchPrompt("p", "code_edit", text, 40)).token_ids
        assert got == greedy[: greedy.index(end)]
        assert peer.run(BenchPrompt("z", "open", text, 0)).token_ids == []
    finally:
        peer.close()


@pytest.mark.model
def test_a_failing_decode_in_the_c_loop_is_an_error_that_says_so(model_path):
    from srsd_local.config import SRSDConfig
    from srsd_local.llama.backend import Backend

    _lib()
    be = Backend(model_path, SRSDConfig(n_ctx=64, n_batch=64, n_ubatch=64))
    try:
        loop = cloop.DecodeLoop(be)
        tokens = be.tokenize("one two three four five six seven eight")
        with pytest.raises(RuntimeError, match="llama_decode failed with code 1 in the C "
                                               "decode loop"):
            loop.generate(tokens, be.n_ctx + 10)  # more than the context holds
        ids, _, _ = loop.generate(tokens, 8)  # the context is cleared for the next one
        assert len(ids) == 8
    finally:
        be.close()


@pytest.mark.model
def test_the_bench_checks_the_c_loops_json_output_without_the_schema(engine):
    """c-loop decodes without a prompt's JSON schema; in the bench with the check on, its
    output is checked against unconstrained plain decoding at every position (no error,
    no mismatch), while the engine's run is checked under the schema."""
    from srsd_local.bench.peers import CLoopPeer, PeerSettings
    from srsd_local.bench.runner import run_bench
    from srsd_local.bench.workloads import BenchPrompt

    _lib()
    schema = {"type": "object", "properties": {"name": {"type": "string"}},
              "required": ["name"]}
    p = BenchPrompt("j", "json", "Write a JSON object with a name.\n", 24, json_schema=schema)
    peer = CLoopPeer(PeerSettings.of(engine))
    try:
        recs = run_bench(engine, [p], ["ar", "c-loop"], peers={"c-loop": peer},
                         progress=False, verify=engine.verify_output)
    finally:
        peer.close()
    by = {r.mode: r for r in recs}
    loop = by["c-loop"]
    assert not loop.follows_schema and loop.verify_error is None
    assert loop.verify["positions"] == len(loop.token_ids) > 0
    assert loop.verify["mismatches"] == []  # exactly plain decoding without the schema
    assert by["ar"].follows_schema and by["ar"].verify_error is None
    assert by["ar"].verify["positions"] == len(by["ar"].token_ids)
    assert by["ar"].valid is not None  # (the engine's run followed the schema)

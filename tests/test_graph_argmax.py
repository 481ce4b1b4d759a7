"""The compiled in-graph greedy samplers (llama/graph_argmax.py) on ggml graphs built here,
without a model: the sampler's graph ops applied to a row the way llama.cpp hands it over (a
view of the padded logits) and computed by ggml's CPU backend. The token is numpy's argmax
(first index of the maximum) for any thread count, row length and tie; the pad is not
computed; nothing but the token is given back."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from srsd_local import store
from srsd_local.llama import graph_argmax
from srsd_local.llama.capture import _ggml_lib

F32 = 0


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


def _ggml():
    g = _ggml_lib()
    g.ggml_init.argtypes, g.ggml_init.restype = [_InitParams], ctypes.c_void_p
    g.ggml_free.argtypes, g.ggml_free.restype = [ctypes.c_void_p], None
    g.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                     ctypes.c_int64]
    g.ggml_new_tensor_2d.restype = ctypes.c_void_p
    g.ggml_pad.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 4
    g.ggml_pad.restype = ctypes.c_void_p
    g.ggml_view_1d.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_size_t]
    g.ggml_view_1d.restype = ctypes.c_void_p
    g.ggml_get_data.argtypes, g.ggml_get_data.restype = [ctypes.c_void_p], ctypes.c_void_p
    g.ggml_new_graph.argtypes, g.ggml_new_graph.restype = [ctypes.c_void_p], ctypes.c_void_p
    g.ggml_build_forward_expand.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    g.ggml_build_forward_expand.restype = None
    g.ggml_graph_n_nodes.argtypes, g.ggml_graph_n_nodes.restype = [ctypes.c_void_p], ctypes.c_int
    cpu = ctypes.CDLL(str(Path(g._name).with_name("libggml-cpu.so")))
    cpu.ggml_graph_compute_with_ctx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    return g, cpu


def _sample(rows: np.ndarray, r: int, threads: bool, n_threads: int) -> tuple[int, bool, int]:
    """Row r of `rows` through the sampler's graph ops as llama.cpp applies them: (the token,
    whether the pad stayed uncomputed, graph nodes)."""
    from llama_cpp import llama_cpp as L

    g, cpu = _ggml()
    n_rows, n = rows.shape
    ctx = g.ggml_init(_InitParams(64 * n * (n_rows + 2) + (16 << 20), None, False))
    assert ctx
    try:
        logits = g.ggml_new_tensor_2d(ctx, F32, n, n_rows)
        np.ctypeslib.as_array(ctypes.cast(g.ggml_get_data(logits),
                                          ctypes.POINTER(ctypes.c_float)),
                              shape=(n_rows, n))[:] = rows
        padded = g.ggml_pad(ctx, logits, 0, 1, 0, 0)
        pad_data = np.ctypeslib.as_array(ctypes.cast(g.ggml_get_data(padded),
                                                     ctypes.POINTER(ctypes.c_float)),
                                         shape=((n_rows + 1) * n,))
        pad_data[:] = 7.0  # a pad computed would overwrite this
        row = g.ggml_view_1d(ctx, padded, n, r * n * 4)
        lib = graph_argmax.library()
        iface = ctypes.cast(lib.srsd_argmax_iface(int(threads)),
                            ctypes.POINTER(L.llama_sampler_i)).contents
        data = L.llama_sampler_data(row, None, None, None)
        iface.backend_apply(None, ctx, None, ctypes.byref(data))
        assert data.logits is None  # nothing but the token goes back
        gf = g.ggml_new_graph(ctx)
        g.ggml_build_forward_expand(gf, data.sampled)
        assert cpu.ggml_graph_compute_with_ctx(ctx, gf, n_threads) == 0
        tok = ctypes.cast(g.ggml_get_data(data.sampled), ctypes.POINTER(ctypes.c_int32))[0]
        return int(tok), bool((pad_data == 7.0).all()), g.ggml_graph_n_nodes(gf)
    finally:
        g.ggml_free(ctx)


def test_the_library_builds_wherever_there_is_a_compiler():
    assert store._compiler() is not None  # a machine that runs the tests has one
    assert graph_argmax.library() is not None


@pytest.mark.parametrize("n", [1, 17, 4096, 262_147])
@pytest.mark.parametrize("n_threads", [1, 2, 3, 8])
def test_thread_parts_give_numpys_argmax(n, n_threads):
    rng = np.random.default_rng(n * 31 + n_threads)
    rows = rng.standard_normal((3, n)).astype(np.float32)
    # ties across the threads' shares: the first index wins
    rows[1, n // 2] = rows[1, n - 1] = 9.0
    rows[1, 0] = 9.0 if n > 2 else rows[1, 0]
    rows[2, :] = -np.inf
    rows[2, n - 1] = -1e30
    before = graph_argmax.rows_sampled(direct=True)
    for r in range(3):
        tok, pad_left, _ = _sample(rows, r, threads=True, n_threads=n_threads)
        assert tok == int(np.argmax(rows[r])), (r, n, n_threads)
        assert pad_left
    assert graph_argmax.rows_sampled(direct=True) == before + 3


def test_equal_rows_take_the_first_token():
    rows = np.zeros((2, 1000), dtype=np.float32)
    assert _sample(rows, 1, threads=True, n_threads=4)[0] == 0


def test_ggmls_argmax_flavour_reads_the_unpadded_row_too():
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((4, 5000)).astype(np.float32)
    for r in range(4):
        tok, pad_left, nodes = _sample(rows, r, threads=False, n_threads=2)
        assert tok == int(np.argmax(rows[r]))
        assert pad_left and nodes == 2  # the view and ggml's argmax


def test_apply_outside_the_graph_selects_the_first_largest():
    from llama_cpp import llama_cpp as L

    smpl = graph_argmax.make_sampler(L, threads=True)
    assert smpl is not None
    try:
        logits = [0.5, 3.0, -1.0, 3.0]
        arr = (L.llama_token_data * 4)(*[L.llama_token_data(i, v, 0.0)
                                         for i, v in enumerate(logits)])
        cur = L.llama_token_data_array(arr, 4, -1, False)
        L.llama_sampler_apply(smpl, ctypes.byref(cur))
        assert cur.selected == 1
        assert L.llama_sampler_name(smpl) == b"srsd-argmax"
    finally:
        L.llama_sampler_free(smpl)


def test_the_compiled_batch_fill_writes_every_field_of_every_row():
    """batch_filler: tokens, positions, output flags and each row's sequence ids (any count
    per row) land in llama.cpp's own llama_batch, n_tokens is set and the output rows are
    counted; rows past m are left alone."""
    from array import array

    import llama_cpp

    if graph_argmax.library() is None:
        pytest.skip("no C compiler: batches are filled through numpy")
    batch = llama_cpp.llama_batch_init(8, 0, 4)
    try:
        fill = graph_argmax.batch_filler(batch)
        batch.token[5] = 777
        seqs = [[0], [1, 2], [3], [0, 1, 2, 3], [2]]
        n_out = fill(5, array("i", [11, 12, 13, 14, 15]), array("i", [40, 41, 41, 42, 43]),
                     array("b", [1, 0, 1, 1, 0]), array("i", map(len, seqs)),
                     array("i", [s for ids in seqs for s in ids]))
        assert n_out == 3 and batch.n_tokens == 5
        assert [batch.token[i] for i in range(6)] == [11, 12, 13, 14, 15, 777]
        assert [batch.pos[i] for i in range(5)] == [40, 41, 41, 42, 43]
        assert [batch.logits[i] for i in range(5)] == [1, 0, 1, 1, 0]
        assert [[batch.seq_id[i][j] for j in range(batch.n_seq_id[i])] for i in range(5)] \
            == seqs
    finally:
        llama_cpp.llama_batch_free(batch)

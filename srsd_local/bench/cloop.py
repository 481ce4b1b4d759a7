"""A minimal decode loop in C (`_cloop.c`): the baseline for the engine's per-token overhead.

`DecodeLoop` runs plain decoding on its own llama.cpp context (no eval callback, no tree
sequences in use, one token per llama_decode) with the whole generation in one C call: the
next token is the row's argmax (numpy's, the first largest) or, at a temperature, the
engine's compiled draw with the uniform numbers the engine's sampler would use for the same
seed, so its tokens are the engine's `ar` tokens. What `ar` takes longer than this loop is
what Python and the engine's bookkeeping cost per token. Built once with the system's C
compiler into the cache; None where it cannot be (no compiler, or llama-cpp-python's
llama_batch laid out otherwise than the loop expects).
"""

from __future__ import annotations

import ctypes
import time
from functools import lru_cache
from importlib import resources

import numpy as np

from .. import store
from ..spec import kernels

FLAGS = ("-O3",)
NATIVE = ("-march=native", "-mprefer-vector-width=512")


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled loop, or None (no compiler, or a llama_batch it does not mirror)."""
    from llama_cpp import llama_cpp as L  # noqa: PLC0415

    src = resources.files("srsd_local.bench").joinpath("_cloop.c").read_bytes()
    lib = store.load_compiled("cloop", src, ((FLAGS + NATIVE, True), (FLAGS, False)))
    if lib is None:
        return None
    layout = (ctypes.c_size_t * 7)()
    lib.srsd_loop_batch_layout(layout)
    b = L.llama_batch
    expected = [ctypes.sizeof(b)] + [getattr(b, f).offset for f in
                                     ("token", "embd", "pos", "n_seq_id", "seq_id", "logits")]
    if list(layout) != expected:
        return None
    lib.srsd_loop_argmax.restype = ctypes.c_int64
    lib.srsd_loop_argmax.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.srsd_loop.restype = ctypes.c_int32
    lib.srsd_loop.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int32] * 3 +
                              [ctypes.c_void_p, ctypes.c_float, ctypes.c_int32] +
                              [ctypes.c_void_p] * 3)
    return lib


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


class DecodeLoop:
    """Plain decoding with the whole generation in one C call, on `backend`'s context (a
    Backend made without hidden-state capture, so the context has no eval callback)."""

    def __init__(self, backend) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("the C decode loop could not be built (it needs a C compiler "
                               "and llama-cpp-python's llama_batch as llama.h defines it)")
        self.lib, self.backend = lib, backend
        L = backend._L
        self._fns = [_address(L._lib.llama_decode), _address(L._lib.llama_get_logits_ith),
                     _address(L._lib.llama_vocab_is_eog)]

    def generate(self, tokens: list[int], max_tokens: int, temperature: float = 0.0,
                 seed: int | None = None) -> tuple[list[int], float, float]:
        """(tokens, seconds after the prompt, prompt seconds) for a prompt: the prompt is
        decoded as the engine decodes it, its row gives the first token, the C loop the rest.
        Greedy at temperature 0; else the compiled draw at `temperature` with the uniform
        numbers numpy's generator seeded with `seed` gives (as the engine's sampler)."""
        be, lib = self.backend, self.lib
        t0 = time.perf_counter()
        be.clear()
        row = np.ascontiguousarray(be.decode(tokens, want_logits="last").logits[-1])
        u = kern = None
        if temperature > 0.0:  # the engine's draw, on the threads the engine draws on
            kern = kernels.temperature_kernel(temperature, be.sample_threads)
            if kern is None:
                raise RuntimeError("sampling in the C decode loop needs the compiled "
                                   "temperature kernel (a C compiler)")
            u = np.random.default_rng(seed).random(max(1, max_tokens))
            first = kern(row, float(u[0]))
        else:
            first = int(lib.srsd_loop_argmax(row.ctypes.data, row.size))
        prompt_seconds = time.perf_counter() - t0
        if max_tokens <= 0 or be.is_eog(first):
            return [], 0.0, prompt_seconds
        out = np.zeros(max_tokens, dtype=np.int32)
        rc = ctypes.c_int32(0)
        t1 = time.perf_counter()
        nv = be.n_vocab
        n = lib.srsd_loop(*self._fns, None if kern is None else _address(kern.fn), be.ctx,
                          be.vocab, first, nv, max_tokens, None if u is None else u.ctypes.data,
                          0.0 if kern is None else kern.inv_t,
                          1 if kern is None else kern.threads_for(nv),
                          None if kern is None else kern.scratch(nv).ctypes.data,
                          out.ctypes.data, ctypes.addressof(rc))
        seconds = time.perf_counter() - t1
        if rc.value != 0:
            raise RuntimeError(f"llama_decode failed with code {rc.value} in the C decode "
                               f"loop after {n} tokens")
        be.n_past = len(tokens) + n - 1
        return out[:n].tolist(), seconds, prompt_seconds

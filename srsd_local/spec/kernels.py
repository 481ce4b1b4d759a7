"""Compiled kernels (`_kernels.c`) for the sampler and the vector index, built once with the
system's C compiler into the cache; None where there is none (or SRSD_KERNELS=python), and
numpy does the work.

Drawing a token at a temperature takes numpy five passes over a 262k-entry logits row (its
maximum, the shift, the scaling, the exponential, the block sums), each writing a new row;
the kernel reads the row from memory once (per block of 512: its maximum, then its weights
relative to that maximum while the block is still in cache, brought to the row's maximum in
double) and writes nothing but the block sums; the blocks are shared out among the decode's
threads (OpenMP, where the compiler has it: 314 -> 211 us per draw on two cores, the same
tokens). Its exponential is its own (a polynomial): it draws from the same distribution as
numpy's, though not always the same token for the same seed, so one process uses one or
the other throughout.

The index's rows (centred, unit length, rounded through float16) take numpy ten calls; the
kernel one, with the same float16 rounding (the length may differ in its last bit: the sum
is taken in another order). Retrieval's search takes one more: the rows waiting to be
stored are stored (as float16), the query normalised, and only the rows of the positions
the known next token follows scored, their top k kept (srsd_retrieve).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import lru_cache
from importlib import resources

import numpy as np

from .. import store
from ..config import environment

BLOCK = 512  # as in _kernels.c
# vectorised (floating point never traps here) without contracting a * b + c into fused
# operations, so every build computes the same weights; for this machine's vector width
# first (built per machine), else for the architecture's baseline
FLAGS = ("-O3", "-fno-trapping-math", "-fno-math-errno", "-ffp-contract=off")
NATIVE = ("-march=native", "-mprefer-vector-width=512")  # (the lanes fix the results)
# a temperature draw's blocks on several threads: OpenMP's, as llama.cpp's CPU backend
# uses (the same pool where both link the same runtime; its threads are idle between
# forward passes, when a row is sampled); without it the pragma is ignored
OPENMP = ("-fopenmp",)
MIN_THREADED = 16 * BLOCK  # shorter rows are drawn on one thread (waking others costs more)


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no compiler, an unwritable cache, or disabled)."""
    if environment().kernels == "python":
        return None
    src = resources.files("srsd_local.spec").joinpath("_kernels.c").read_bytes()
    lib = store.load_compiled("kernels", src, ((FLAGS + NATIVE + OPENMP, True),
                                               (FLAGS + NATIVE, True), (FLAGS, False)))
    if lib is None:
        return None
    fn = lib.srsd_sample_temperature
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double,
                   ctypes.c_void_p, ctypes.c_int]
    fn = lib.srsd_normalise_rows
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p]
    fn = lib.srsd_retrieve
    fn.restype = ctypes.c_int64
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, p, i64, p, p, i64, p, p, i64, ctypes.c_int32, p, i64,
                   ctypes.c_float, i64, p, p, p, i64, p]
    lib.srsd_index_stage.argtypes = [p, p, i64, i64, p, i64, p, i64, p, i64]
    lib.srsd_index_stage.restype = None
    lib.srsd_longest_repeat.argtypes = [ctypes.c_char_p, i64, i64, i64]
    lib.srsd_longest_repeat.restype = i64
    lib.srsd_set_array_data_offset.argtypes = [ctypes.c_long]
    lib.srsd_set_array_data_offset.restype = None
    lib.srsd_array_data.argtypes = [ctypes.py_object]
    lib.srsd_array_data.restype = ctypes.c_void_p
    return lib


def _ctypes_address(a: np.ndarray) -> int:
    return a.ctypes.data


@lru_cache(maxsize=1)
def array_address() -> Callable[[np.ndarray], int]:
    """A function giving a numpy array's data address: read from the array object in one
    compiled call where the build has it and numpy's layout checks out (the pointer right
    after the object header, compared with `.ctypes.data` on arrays, views and slices),
    else `.ctypes.data` (a helper object made in Python code: tens of microseconds on the
    caches a forward pass has just flushed, against a few)."""
    lib = library()
    if lib is None:
        return _ctypes_address
    lib.srsd_set_array_data_offset(object.__basicsize__)
    fn = lib.srsd_array_data
    probes = [np.zeros(8, np.int32), np.zeros((3, 5), np.float32)[1:], np.arange(10)[2:7],
              np.zeros(640, np.float32)[None, :][0], np.zeros(4, np.int64)[::2]]
    if all(fn(a) == a.ctypes.data for a in probes):
        return fn
    lib.srsd_set_array_data_offset(-1)
    return _ctypes_address


class TemperatureKernel:
    """Draws from softmax(logits / temperature) in one compiled call per row."""

    def __init__(self, lib: ctypes.CDLL, temperature: float, threads: int = 1) -> None:
        self.fn = lib.srsd_sample_temperature
        self.inv_t = 1.0 / max(temperature, 1e-6)
        self._sums = np.zeros(0)
        self.threads = max(1, int(threads))

    def scratch(self, n: int) -> np.ndarray:
        """The draw's scratch for rows of n entries (kept between draws)."""
        if len(self._sums) < 2 * (n // BLOCK + 1):
            self._sums = np.zeros(2 * (n // BLOCK + 1))
        return self._sums

    def threads_for(self, n: int) -> int:
        """Threads a row of n entries is drawn on."""
        return self.threads if n >= MIN_THREADED else 1

    def __call__(self, logits: np.ndarray, u: float) -> int:
        x = logits if (logits.dtype == np.float32 and logits.flags.c_contiguous) else \
            np.ascontiguousarray(logits, dtype=np.float32)
        n, address = x.size, array_address()
        return int(self.fn(address(x), n, self.inv_t, u, address(self.scratch(n)),
                           self.threads_for(n)))


def draw_functions() -> tuple[int, int] | None:
    """The addresses of the compiled draw's two parts (`srsd_temperature_blocks`,
    `srsd_temperature_pick`), for a draw made in llama.cpp's graph with the very same code
    (see llama/graph_argmax.py), or None without a build."""
    lib = library()
    if lib is None:
        return None
    return (ctypes.cast(lib.srsd_temperature_blocks, ctypes.c_void_p).value,
            ctypes.cast(lib.srsd_temperature_pick, ctypes.c_void_p).value)


def temperature_kernel(temperature: float, threads: int = 1) -> TemperatureKernel | None:
    """The compiled draw at `temperature` on up to `threads` threads (the decode's thread
    count: those cores are idle while a row is sampled), or None without a build."""
    lib = library()
    return None if lib is None else TemperatureKernel(lib, temperature, threads)


class NormaliseKernel:
    """The vector index's stored form of hidden rows in one compiled call per block of rows:
    centred, unit length, rounded through float16 (numpy takes a call per operation, each
    one slow on the caches a forward pass has just flushed)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.srsd_normalise_rows

    def __call__(self, parts: list[np.ndarray], center: np.ndarray, out: np.ndarray) -> None:
        """parts: float32 blocks of rows ([k, dim] with contiguous rows, or [dim]); center:
        float32 [dim], contiguous; out: float32 [sum of k, dim], contiguous: the parts'
        rows one after the other, written."""
        dim, address = center.shape[0], array_address()
        fn, c, o = self._fn, address(center), address(out)
        for x in parts:
            if x.dtype != np.float32 or not x.flags.c_contiguous:
                x = np.ascontiguousarray(x, dtype=np.float32)
            k = x.size // dim
            fn(address(x), k, dim, c, o)
            o += 4 * k * dim


def normalise_kernel() -> NormaliseKernel | None:
    lib = library()
    return None if lib is None else NormaliseKernel(lib)


def retrieve_kernel():
    """The index's search among the positions a known next token follows, with the rows
    waiting to be stored stored first, in one compiled call (`srsd_retrieve` in
    _kernels.c; see VectorIndex.search_next), or None without a build."""
    lib = library()
    return None if lib is None else lib.srsd_retrieve


def stage_kernel():
    """The index's rows of an accepted path staged in one compiled call (`srsd_index_stage`
    in _kernels.c; see VectorIndex.add_path), or None without a build."""
    lib = library()
    return None if lib is None else lib.srsd_index_stage


def repeat_kernel():
    """Text lookup's longest repeated suffix of a bytes text in one compiled pass
    (`srsd_longest_repeat` in _kernels.c; see textlookup.longest_repeat), or None without
    a build."""
    lib = library()
    return None if lib is None else lib.srsd_longest_repeat

"""OpenMP thread pools: a thread that is done decoding lets its pool go.

llama.cpp's CPU backend, built with OpenMP (as llama-cpp-python builds it on Linux), runs each
forward pass as an OpenMP parallel region: the thread that calls llama_decode gets a pool of
worker threads of its own, which stays after the pass for the next one. GNU OpenMP (libgomp)
counts the threads of every pool, and once they outnumber the CPUs a waiting thread spins
only about a hundred times before it sleeps (GOMP_SPINCOUNT's throttled value). A forward
pass is a parallel region with a barrier after each of its operations, so from then on every
barrier waits for a sleeping thread to be woken. That happens as soon as a second thread
decodes while the first one's pool is still there: a model loaded (its cost profile
measured) or `generate` run on the main thread, then requests served from the engine's
scheduler thread (`submit`, concurrent clients; the server loads its model on a thread that
ends, which frees that thread's pool). Measured on a 2-core CPU with
the default model: plain steps from a second thread took 34 ms against 21 from the first;
with the first thread's pool let go, 21.

`release()` frees the calling thread's pool (OpenMP 5.0's `omp_pause_resource_all`, hard:
its worker threads end); the thread gets a new one when it decodes again, at the cost of
starting a thread. The engine calls it wherever a thread other than its scheduler thread is
done decoding, so the thread that decodes next is the only one with a pool. Where the
process has no libgomp (llama.cpp built without OpenMP, or with another runtime) it does
nothing.
"""

from __future__ import annotations

import ctypes
import os

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: the threads end, not only idle
_found: list = []  # libgomp's omp_pause_resource_all, once found


def _pause_all():
    """libgomp's omp_pause_resource_all where libgomp is loaded already (llama.cpp's CPU
    backend loads it), else None (asked again next time: a model may load it later)."""
    if _found:
        return _found[0]
    mode = getattr(os, "RTLD_NOLOAD", None)
    if mode is None:
        return None
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=mode)  # never loads it: only finds it
    except OSError:
        return None
    fn = getattr(lib, "omp_pause_resource_all", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    _found.append(fn)
    return fn


def release() -> bool:
    """Free the calling thread's OpenMP worker threads (see the module docstring); whether
    libgomp did (False: no libgomp in the process, or it refused: a thread inside a
    parallel region)."""
    fn = _pause_all()
    return fn is not None and fn(OMP_PAUSE_HARD) == 0

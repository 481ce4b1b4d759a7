"""Whether llama.cpp may lay weights out for the CPU's extra kernels ("extra buffer types"),
and what its CPU backend was built with (`cpu_features`: OpenMP, whose thread pool the
sampler's compiled draw shares).

ggml's CPU backend can repack weights for faster matrix kernels: `CPU_REPACK` (AVX2/AVX-512,
ARM) and, when built with `-march=native` on a CPU with AMX (Intel Sapphire Rapids and
later), `AMX`. The AMX kernels of the llama.cpp pinned here crash on Q4_K_M models such as
the default one (a segmentation fault in `ggml_backend_amx_mul_mat` at the first forward
pass, reported upstream as llama.cpp issue 20824), so where the loaded library registers an
AMX buffer type the engine loads models without extra buffer types (llama.cpp's
`use_extra_bufts = false`, llama-server's `--no-repack`), and says so once. `SRSD_EXTRA_BUFTS=1`
keeps them anyway (a llama.cpp with the bug fixed); rebuilding llama-cpp-python without AMX
(`CMAKE_ARGS="-DGGML_RPC=on -DCMAKE_C_FLAGS=-mno-amx-int8
-DCMAKE_CXX_FLAGS=-mno-amx-int8"`, x86 only) keeps repacking and avoids the crash.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path

from ..config import environment

log = logging.getLogger(__name__)

UNSAFE = ("AMX",)  # extra buffer types whose kernels crash on this llama.cpp


def _cpu_library(llama_lib: ctypes.CDLL) -> ctypes.CDLL | None:
    """ggml's CPU backend library, loaded beside llama.cpp's (None where it is not a
    separate library, e.g. a static build)."""
    folder = Path(getattr(llama_lib, "_name", "") or "").parent
    for name in ("libggml-cpu.so", "libggml-cpu.dylib", "ggml-cpu.dll"):
        path = folder / name
        if path.exists():
            try:
                return ctypes.CDLL(str(path))
            except OSError:
                return None
    return None


def _cpu_proc(llama_lib: ctypes.CDLL, name: bytes) -> tuple[ctypes.CDLL, int, int] | None:
    """(ggml's CPU backend library, its registry, the address of the registry's function
    `name`), or None where any of them cannot be had."""
    lib = _cpu_library(llama_lib)
    if lib is None:
        return None
    try:
        reg_fn = lib.ggml_backend_cpu_reg
        proc = lib.ggml_backend_reg_get_proc_address
    except AttributeError:
        return None
    reg_fn.restype = ctypes.c_void_p
    proc.restype, proc.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    reg = reg_fn()
    addr = proc(reg, name) if reg else None
    return (lib, reg, addr) if addr else None


class _Feature(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


@lru_cache(maxsize=4)
def cpu_features(llama_lib: ctypes.CDLL) -> dict[str, str]:
    """What ggml's CPU backend was built with (its "features": "AVX2": "1", "OPENMP": "1",
    ...); {} where they cannot be read."""
    got = _cpu_proc(llama_lib, b"ggml_backend_get_features")
    if got is None:
        return {}
    _, reg, addr = got
    feats = ctypes.CFUNCTYPE(ctypes.POINTER(_Feature), ctypes.c_void_p)(addr)(reg)
    out: dict[str, str] = {}
    i = 0
    while feats and feats[i].name:
        out[feats[i].name.decode(errors="replace")] = (feats[i].value or b"").decode(
            errors="replace")
        i += 1
    return out


def extra_buffer_types(llama_lib: ctypes.CDLL) -> list[str]:
    """The names of the extra buffer types ggml's CPU backend registers on this machine (what
    llama.cpp may repack weights into); [] where they cannot be listed."""
    got = _cpu_proc(llama_lib, b"ggml_backend_dev_get_extra_bufts")
    if got is None:
        return []
    lib, reg, addr = got
    try:
        dev_get = lib.ggml_backend_reg_dev_get
        name_fn = lib.ggml_backend_buft_name
    except AttributeError:
        return []
    dev_get.restype, dev_get.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t]
    name_fn.restype, name_fn.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    dev = dev_get(reg, 0)
    if not dev:
        return []
    get = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(addr)
    bufts = get(dev)
    names: list[str] = []
    i = 0
    while bufts and bufts[i]:
        names.append((name_fn(bufts[i]) or b"").decode(errors="replace"))
        i += 1
    return names


def keep_extra_buffer_types(names: list[str], override: str | None) -> bool:
    """Whether models are loaded with extra buffer types: not where one of them is known to
    crash, unless `override` (SRSD_EXTRA_BUFTS) says otherwise ("1"/"0")."""
    if override is not None and override.strip():
        return override.strip().lower() not in ("0", "false", "no", "off")
    return not any(n in UNSAFE for n in names)


@lru_cache(maxsize=1)
def use_extra_buffer_types(llama_lib: ctypes.CDLL) -> bool:
    """The decision for this process (logged once when extra buffer types are left out)."""
    names = extra_buffer_types(llama_lib)
    keep = keep_extra_buffer_types(names, environment().extra_bufts)
    if not keep:
        log.warning("llama.cpp's CPU backend offers %s weight layouts; its AMX kernels crash "
                    "on this llama.cpp (Q4_K_M models), so models load without repacked "
                    "weights (SRSD_EXTRA_BUFTS=1 keeps them)", ", ".join(names))
    return keep

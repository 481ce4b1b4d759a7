"""Extra buffer types (repacked weights): left out where llama.cpp's kernels for them crash."""

from __future__ import annotations

import pytest

from srsd_local.llama.cpubufs import extra_buffer_types, keep_extra_buffer_types


def test_amx_layouts_are_left_out_unless_asked_for():
    assert keep_extra_buffer_types(["CPU_REPACK"], None)
    assert keep_extra_buffer_types([], None)
    assert not keep_extra_buffer_types(["AMX", "CPU_REPACK"], None)
    assert not keep_extra_buffer_types(["AMX"], "")  # empty: no override
    for on in ("1", "yes", "true", " ON "):
        assert keep_extra_buffer_types(["AMX"], on)
    for off in ("0", "no", "false", "off"):
        assert not keep_extra_buffer_types(["CPU_REPACK"], off)


@pytest.mark.model
def test_the_loaded_model_follows_what_the_cpu_backend_offers(engine):
    """On the real library: the buffer types are listed by name, and the engine's backend
    loaded its model with them exactly when none is known to crash (a CPU with AMX under a
    llama.cpp built for it must not get them: its first forward pass would crash)."""
    from srsd_local.llama.backend import _llama

    names = extra_buffer_types(_llama()._lib)
    assert all(isinstance(n, str) and n for n in names)
    assert engine.backend.extra_bufts == ("AMX" not in names)
    assert engine.generate("def add(a, b):", max_tokens=4).text


@pytest.mark.model
def test_the_cpu_backends_features_are_read_and_name_openmp_when_it_decodes_on_it(engine):
    """What ggml's CPU backend was built with, from its registry: the instruction sets it
    uses (x86: SSE3 at least; ARM: NEON), and OPENMP exactly when libggml-cpu links an
    OpenMP runtime (the sampler's draws then share its pool)."""
    import platform

    from srsd_local.llama.backend import _llama
    from srsd_local.llama.cpubufs import _cpu_library, cpu_features

    L = _llama()
    feats = cpu_features(L._lib)
    assert feats and all(isinstance(k, str) and k for k in feats)
    if platform.machine() in ("x86_64", "AMD64"):
        assert feats.get("SSE3") == "1"
    lib = _cpu_library(L._lib)
    linked = open("/proc/self/maps").read() if platform.system() == "Linux" else ""
    if lib is not None and linked:
        uses_omp = any(name in linked for name in ("libgomp", "libomp"))
        assert ("OPENMP" in feats) <= uses_omp  # built with OpenMP: its runtime is loaded
    assert engine.backend.cpu_openmp == ("OPENMP" in feats)

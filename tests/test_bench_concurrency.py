"""The concurrency benchmark's logic (clients, levels, interference) on the fake backend."""

from __future__ import annotations

import time

import pytest
from fakes import FakeBackend

from srsd_local.bench.concurrency import Timing, concurrency_table, run_concurrency, run_level
from srsd_local.bench.runner import parse_levels
from srsd_local.bench.workloads import BenchPrompt
from srsd_local.config import SRSDConfig
from srsd_local.engine import Engine


def test_parse_levels():
    assert parse_levels("4,1,2,2") == [1, 2, 4]
    for bad in ("", "0,1", "a", "1,-2"):
        with pytest.raises(ValueError, match="client counts"):
            parse_levels(bad)


def test_run_level_sends_each_prompt_once_from_several_clients():
    prompts = [BenchPrompt(f"p{i}", "c", "x", 4) for i in range(7)]
    seen = []

    def client(p):
        seen.append(p.id)
        t0 = time.perf_counter()
        time.sleep(0.02)
        return Timing(p.id, 4, t0, t0 + 0.01, time.perf_counter())

    t0 = time.perf_counter()
    lv = run_level(client, prompts, 3, "m")
    assert sorted(seen) == sorted(p.id for p in prompts) and lv.tokens == 28
    assert time.perf_counter() - t0 < 7 * 0.02  # clients ran side by side
    s = lv.summary()
    assert s["requests"] == 7 and s["total_tps"] == pytest.approx(28 / lv.wall)
    assert s["per_request_tps"] > 0 and s["ttft_median"] == pytest.approx(0.01, abs=0.005)


def test_concurrency_run_on_the_fake_engine():
    eng = Engine(FakeBackend(n_ctx=1024, step_cost=lambda n: 0.001 + 0.0002 * n),
                 SRSDConfig(index_backend="numpy", n_ctx=512, parallel=2))
    prompts = [BenchPrompt(f"p{i}", "c", "the quick brown fox jumps over the lazy dog " * 2,
                           24) for i in range(4)]
    try:
        data = run_concurrency(eng, prompts, [1, 2], ["ar", "srsd"], {})
    finally:
        eng.close()
    rows = {(r["mode"], r["clients"]): r for r in data["levels"]}
    assert set(rows) == {("ar", 1), ("ar", 2), ("srsd", 1), ("srsd", 2)}
    assert all(r["tokens"] == 4 * 24 and r["requests"] == 4 for r in rows.values())
    assert rows[("ar", 1)]["vs_one_client"] == 1.0
    chunked, whole = data["interference"]
    assert chunked["chunk"] == "auto" and whole["chunk"] == 1 << 20
    assert chunked["median_gap"] > 0 and chunked["prefill_seconds"] > 0
    text = concurrency_table(data)
    assert "| srsd | 2 |" in text and "| automatic |" in text and "off (one piece)" in text

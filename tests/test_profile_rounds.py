"""Backend.profile's timing order, on a fake model whose passes take a known (fake) time:
repeats are rounds over all sizes, so a slow spell of the machine costs one round of every
size, not every timing of the sizes it overlaps."""

from __future__ import annotations

import numpy as np

from srsd_local.llama import backend as backend_mod
from srsd_local.llama.backend import Backend, DecodeOutput


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeModel:
    """What Backend.profile uses of a backend: a pass of n tokens takes `cost(n)` fake
    seconds, times `slow` for the passes in `spell` (indices of timed decodes)."""

    def __init__(self, clock: FakeClock, spell: range, slow: float = 3.0) -> None:
        self.clock, self.spell, self.slow = clock, spell, slow
        self.n_past, self.n_ctx = 0, 4096
        self.calls: list[int] = []  # sizes of the passes with logits, in order

    @staticmethod
    def cost(n: int) -> float:
        return 0.020 + 0.005 * (n - 1)

    def clear(self) -> None:
        self.n_past = 0

    def tokenize(self, text: str) -> list[int]:
        return list(range(1, len(text.split()) + 1))

    def trim(self, n: int) -> None:
        self.n_past = n

    def decode(self, tokens, want_logits="last") -> DecodeOutput:
        n = len(tokens)
        self.n_past += n
        if want_logits == "none":
            return DecodeOutput(np.zeros((0, 4), np.float32), None)
        k = len(self.calls)
        self.calls.append(n)
        self.clock.now += self.cost(n) * (self.slow if k in self.spell else 1.0)
        return DecodeOutput(np.zeros((n, 4), np.float32), None)


def test_profile_times_sizes_in_rounds_after_a_warm_up_round(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(backend_mod.time, "perf_counter", clock)
    fake = FakeModel(clock, spell=range(0))
    sizes = [1, 4, 8, 16]
    seconds, per_kv, ctx0 = Backend.profile(fake, sizes, reps=3, long_ctx=0)
    assert fake.calls == sizes * 4  # a warm-up round, then 3 rounds of every size
    assert np.allclose(seconds, [FakeModel.cost(n) for n in sizes])
    assert per_kv == 0.0 and ctx0 > 0


def test_a_slow_spell_across_several_timings_does_not_bend_the_profile(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(backend_mod.time, "perf_counter", clock)
    sizes = [1, 2, 4, 8, 16]
    # the machine runs 3x slower for 8 passes in a row: all timings of one size and more
    # when each size's repeats are taken one after the other
    fake = FakeModel(clock, spell=range(6, 14))
    seconds, _, _ = Backend.profile(fake, sizes, reps=5, long_ctx=0)
    assert np.allclose(seconds, [FakeModel.cost(n) for n in sizes])
    shape = np.asarray(seconds) / seconds[0]
    assert np.allclose(shape, [FakeModel.cost(n) / FakeModel.cost(1) for n in sizes])

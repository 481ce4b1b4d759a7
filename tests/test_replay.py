"""Host time replayed without the forward passes (engine/replay.py), on the real model."""

from __future__ import annotations

import time

import pytest
from text_data import edit_prompt

from srsd_local.engine.replay import ReplayMismatch
from srsd_local.llama.replay import PassReplay

pytestmark = pytest.mark.model


@pytest.fixture
def counted(engine, monkeypatch):
    """Counts of real llama_decode calls and of calls served from a recording."""
    n = {"real": 0, "served": 0}
    L = engine.backend._L
    real = L.llama_decode

    def decode(ctx, batch):
        n["real"] += 1
        return real(ctx, batch)

    serve = PassReplay.serve

    def served(self, be, m):
        n["served"] += 1
        return serve(self, be, m)

    monkeypatch.setattr(L, "llama_decode", decode)
    monkeypatch.setattr(PassReplay, "serve", served)
    return n


@pytest.mark.parametrize("mode", ["ar", "srsd"])
def test_replay_serves_every_pass_from_the_recording(engine, counted, mode):
    """The replayed generation runs no llama_decode of its own: every call it makes is served,
    as many as the recorded generation made; its tokens are the recording's (checked inside)
    and its host times are measured."""
    prompt = edit_prompt()
    before = engine.speculator
    learned = before.acceptance.to_json()
    stats = engine.replayed_stats(prompt, max_tokens=48, mode=mode)
    assert counted["served"] > 0 and counted["real"] == counted["served"]
    assert stats.tokens == 48
    steps = len(stats.tree_sizes)
    assert steps > 1 and stats.host_plain + stats.host_tree > 0
    if mode == "srsd":
        assert stats.drafts > 0, "an edit prompt must verify trees in the replay too"
    # the learned state is what it was: the same object, not updated by the two runs
    assert engine.speculator is before and before.acceptance.to_json() == learned
    assert engine.backend.replay is None


def test_replay_host_time_leaves_out_the_passes(engine, monkeypatch):
    """20 ms added to every llama_decode call (the recording's) do not show in the replay's
    host time per step; 5 ms planted in every emit do."""
    from srsd_local.engine import emit  # noqa: PLC0415

    L = engine.backend._L
    real, push = L.llama_decode, emit.Emitter.push

    def slow_decode(ctx, batch):
        time.sleep(0.02)
        return real(ctx, batch)

    def slow_push(self, *a, **k):
        time.sleep(0.005)
        return push(self, *a, **k)

    monkeypatch.setattr(L, "llama_decode", slow_decode)
    monkeypatch.setattr(emit.Emitter, "push", slow_push)
    stats = engine.replayed_stats("def quicksort(arr):", max_tokens=12, mode="ar")
    per_step = (stats.host_plain + stats.host_tree) / len(stats.tree_sizes)
    assert 0.005 <= per_step < 0.015


def test_a_diverging_replay_is_refused_and_leaves_the_engine_as_it_was(engine, monkeypatch):
    prompt = edit_prompt()
    engine.reset()  # plain decoding after a full prefill: what the engine gives afterwards
    expected = engine.generate(prompt, max_tokens=24, mode="ar").token_ids
    before = engine.speculator
    serve = PassReplay.serve

    def forgetful(self, be, m):  # the recording loses its passes: the replay diverges
        self.passes.clear()
        return serve(self, be, m)

    monkeypatch.setattr(PassReplay, "serve", forgetful)
    with pytest.raises(ReplayMismatch, match="recording does not have"):
        engine.replayed_stats(prompt, max_tokens=24, mode="srsd")
    monkeypatch.undo()
    assert engine.speculator is before and engine.backend.replay is None
    assert engine.generate(prompt, max_tokens=24, mode="ar").token_ids == expected


def test_replay_refuses_what_cannot_repeat(engine):
    with pytest.raises(ValueError, match="seed"):
        engine.replayed_stats("Once upon a time", max_tokens=4, temperature=0.8)


def test_a_seeded_sampled_generation_replays(engine, counted):
    stats = engine.replayed_stats("Once upon a time", max_tokens=16, temperature=0.8, seed=3,
                                  mode="srsd")
    assert stats.tokens == 16 and counted["real"] == counted["served"] > 0

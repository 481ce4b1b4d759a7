"""Host time without the forward pass's cache eviction: a generation recorded, then replayed.

On a CPU every forward pass streams the model's weights through the caches, so the engine's
own work between passes (drafting, planning, the walk, bookkeeping) starts on cold caches
and costs several times what the same code costs warm. On a GPU the weights stay on the
device and the host's caches are not flushed between steps. `replayed_stats` measures the
engine's host time per step the second way on any machine:

1. record: the generation runs as usual; each llama_decode call's logits rows, captured
   hidden rows and seconds are kept, keyed by the batch (tokens, positions, sequence ids,
   output flags);
2. replay: the same generation runs again from the same learned state (the speculator is
   copied before, the original put back after); every llama_decode call is served from the
   recording instead of running the model. Everything else is the engine's code as it
   runs: drafting, planning, the walk over the (recorded) logits rows, llama.cpp's KV-cell
   bookkeeping, emitting.

In both runs the cost model sees the recorded llama_decode seconds of each pass (not the
wall time, which includes the host time that differs between the runs), so the controller
makes the same decisions and the passes repeat; a pass that was not recorded raises
ReplayMismatch. A served pass's logits rows are first copied to where the engine reads them
(as llama.cpp writes its rows at the end of llama_decode; the copy counts as llama_decode
time), so the walk reads rows as fresh as in a real run. With llama.cpp's in-graph sampling
(`sample_in_graph`) the tokens it took for a call's rows are recorded and served the same
way: the host time of the configuration meant for GPUs, whose trees come back as token ids,
measured on any machine.
"""

from __future__ import annotations

import copy
from typing import Any

from ..llama.replay import PassReplay, ReplayMismatch
from .stats import GenerationStats

__all__ = ["ReplayMismatch", "replayed_stats"]


def replayed_stats(engine: Any, prompt: str | list[int], **kwargs: Any) -> GenerationStats:
    """The stats of `engine.generate(prompt, **kwargs)` replayed (see the module docstring):
    their host times are the engine's work between passes without the passes themselves.
    The engine's learned state is what it was before the call; its context is reset (the
    next generation prefills from scratch). Sampled generations need a `seed` to repeat."""
    be = engine.backend
    if kwargs.get("temperature", 0.0) and kwargs.get("seed") is None:
        raise ValueError("a sampled generation repeats only with a seed: pass seed=...")
    original = engine.speculator
    snapshot = copy.deepcopy(original)
    rep = PassReplay()
    outputs = []
    # both runs take the same slot (a free one is picked least recently used first), so
    # their passes carry the same sequence ids
    ticks = [s.last_used for s in engine.slots]
    try:
        for serving in (False, True):
            for slot, tick in zip(engine.slots, ticks):
                slot.last_used = tick
            rep.serving = serving
            engine.speculator = copy.deepcopy(snapshot)
            engine.forget_outputs()
            engine.reset()
            be.replay = rep
            outputs.append(engine.generate(prompt, **kwargs))
        if outputs[0].token_ids != outputs[1].token_ids:
            raise ReplayMismatch("the replayed generation's tokens differ from the recording")
        return outputs[1].stats
    finally:
        be.replay = None
        engine.speculator = original
        engine.reset()


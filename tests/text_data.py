"""Shared test helpers: real public text (a function from CPython's standard library) and the
"equal up to near-ties" check for greedy outputs of speculative runs."""

from __future__ import annotations

import inspect
import textwrap


def stdlib_function_source() -> str:
    return inspect.getsource(textwrap.TextWrapper._split)


def edit_prompt() -> str:
    src = stdlib_function_source()
    return ("Below is a Python method.\n```python\n" + src + "```\n"
            "The same method, with the argument `text` renamed to `txt`:\n```python\n")


# Batched kernels (quantised activations, other summation orders) move logits by up to ~1 on
# this model; where two runs pick different tokens the reference's top two must be this close.
MAX_TIE_GAP = 1.0


def top2_gap(engine, prompt_ids, prefix_ids) -> float:
    import numpy as np

    be = engine.backend
    engine.reset()
    out = be.decode(list(prompt_ids) + list(prefix_ids), want_logits="last")
    row = np.sort(out.logits[-1])
    engine.reset()
    return float(row[-1] - row[-2])


def assert_same_up_to_ties(engine, prompt_ids, plain_ids, plain_cmp, spec_cmp) -> None:
    """plain_cmp / spec_cmp: comparable token sequences of both runs. Where they first differ,
    the plain run's top-2 logit gap must be small (a near-tie), else the runs disagree."""
    k = next((i for i, (x, y) in enumerate(zip(plain_cmp, spec_cmp)) if x != y), None)
    if k is None:
        n = min(len(plain_cmp), len(spec_cmp))
        assert plain_cmp[:n] == spec_cmp[:n]
        return
    gap = top2_gap(engine, prompt_ids, plain_ids[:k])
    assert gap < MAX_TIE_GAP, f"outputs differ at token {k} where plain decoding was sure ({gap})"

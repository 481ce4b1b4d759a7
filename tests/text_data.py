"""Shared test helpers: real public text (a function from CPython's standard library) and the
near-tie bound of the argmax comparison in test_model_integration.py (greedy outputs are
otherwise checked with `Engine.verify_output`)."""

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

"""Real public text for integration tests: a function from CPython's standard library."""

from __future__ import annotations

import inspect
import textwrap


def stdlib_function_source() -> str:
    return inspect.getsource(textwrap.TextWrapper._split)


def edit_prompt() -> str:
    src = stdlib_function_source()
    return ("Below is a Python method.\n```python\n" + src + "```\n"
            "The same method, with the argument `text` renamed to `txt`:\n```python\n")

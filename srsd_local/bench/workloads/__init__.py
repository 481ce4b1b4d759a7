"""Benchmark workloads: JSONL files of {id, category, prompt, max_tokens[, temperature, seed]}.

The files next to this module are the built-in workloads (how they were built and from which
public sources: docs/workloads.md). `calibration` is a named workload for `srsd-local
calibrate`; it is never part of `all`, so no benchmark runs on the prompts the controller was
calibrated on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

# what `--workload all` runs, in this order
BUILTIN_WORKLOADS = ("code_edit", "text_edit", "humaneval", "code_continue", "open")
CALIBRATION_WORKLOAD = "calibration"
WORKLOAD_NAMES = BUILTIN_WORKLOADS + (CALIBRATION_WORKLOAD,)

_REQUIRED: dict[str, type] = {"id": str, "category": str, "prompt": str, "max_tokens": int}
_TYPE_NAMES = {str: "a string", int: "an integer"}


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None


def parse_line(line: str, where: str) -> BenchPrompt:
    """One JSONL line; errors name `where` (file and line) and what is accepted."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object with id, category, prompt, max_tokens")
    for key, typ in _REQUIRED.items():
        if key not in obj:
            raise ValueError(f"{where}: missing {key!r} (required: {', '.join(_REQUIRED)})")
        if not isinstance(obj[key], typ) or isinstance(obj[key], bool):
            raise ValueError(f"{where}: {key!r} must be {_TYPE_NAMES[typ]}")
    if obj["max_tokens"] < 1:
        raise ValueError(f"{where}: 'max_tokens' must be >= 1")
    temp = obj.get("temperature", 0.0)
    if isinstance(temp, bool) or not isinstance(temp, (int, float)) or temp < 0:
        raise ValueError(f"{where}: 'temperature' must be a number >= 0")
    seed = obj.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"{where}: 'seed' must be an integer >= 0")
    return BenchPrompt(obj["id"], obj["category"], obj["prompt"], obj["max_tokens"],
                       float(temp), seed)


def parse_workload(text: str, where: str) -> list[BenchPrompt]:
    """Every non-blank line of a JSONL text; an empty workload is an error."""
    prompts = [parse_line(line, f"{where} line {i}")
               for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not prompts:
        raise ValueError(f"{where}: no prompts")
    return prompts


def load_workload(spec: str) -> list[BenchPrompt]:
    """A built-in workload name (WORKLOAD_NAMES), 'all' (the benchmark workloads, not
    calibration), or a path to a JSONL file."""
    if spec == "all":
        return [p for name in BUILTIN_WORKLOADS for p in load_workload(name)]
    if spec in WORKLOAD_NAMES:
        text = resources.files(__name__).joinpath(f"{spec}.jsonl").read_text(encoding="utf-8")
        return parse_workload(text, f"workload {spec}")
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"unknown workload {spec!r}: accepted are "
                         f"{', '.join(WORKLOAD_NAMES)}, all, or a path to a .jsonl file")
    return parse_workload(path.read_text(encoding="utf-8"), str(path))


def first_per_category(prompts: Sequence[BenchPrompt], n: int | None) -> list[BenchPrompt]:
    """At most `n` prompts of each category (all when n is None or 0), in file order per
    category, categories in order of first appearance."""
    if not n:
        return list(prompts)
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    return [p for ps in by_cat.values() for p in ps[:n]]

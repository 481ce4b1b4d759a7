"""Benchmark workloads: JSONL files of {id, category, prompt, max_tokens[, temperature, seed,
json_schema]}.

The files next to this module are the built-in workloads (how they were built and from which
public sources: docs/workloads.md). `calibration` is a named workload for `srsd-local
calibrate`; it is never part of `all`, so no benchmark runs on the prompts the controller was
calibrated on.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from ...prompts import BenchPrompt, parse_line, parse_workload

# what `--workload all` runs, in this order
BUILTIN_WORKLOADS = ("code_edit", "text_edit", "humaneval", "code_continue", "open", "json")
CALIBRATION_WORKLOAD = "calibration"
WORKLOAD_NAMES = BUILTIN_WORKLOADS + (CALIBRATION_WORKLOAD,)
__all__ = ["BUILTIN_WORKLOADS", "CALIBRATION_WORKLOAD", "WORKLOAD_NAMES", "BenchPrompt",
           "first_per_category", "load_workload", "parse_line", "parse_workload"]

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

"""Prompt records of the JSONL workload format {id, category, prompt, max_tokens[,
temperature, seed, json_schema]}: the benchmark's workloads and the calibration set use them
(data only, below both the engine and the benchmark)."""

from __future__ import annotations

import json
from dataclasses import dataclass

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
    json_schema: dict | None = None  # the output must satisfy this JSON schema

    @property
    def constraint(self) -> dict:
        """The engine keyword for this prompt's output constraint (empty when none)."""
        return {} if self.json_schema is None else {"json_schema": self.json_schema}


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
    schema = obj.get("json_schema")
    if schema is not None and not isinstance(schema, dict):
        raise ValueError(f"{where}: 'json_schema' must be an object (a JSON schema)")
    return BenchPrompt(obj["id"], obj["category"], obj["prompt"], obj["max_tokens"],
                       float(temp), seed, schema)


def parse_workload(text: str, where: str) -> list[BenchPrompt]:
    """Every non-blank line of a JSONL text; an empty workload is an error."""
    prompts = [parse_line(line, f"{where} line {i}")
               for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not prompts:
        raise ValueError(f"{where}: no prompts")
    return prompts

"""Per-model settings: which hidden layer to retrieve with, and how many hits / how deep.

`srsd-local calibrate` runs the srsd drafter with a fixed tree (no controller, so every layer
gets the same verification budget) on a workload and measures accepted tokens per verified
tree for each candidate layer, then top-k and draft depth at the best layer. The winner is
stored per model file; `Engine.load` uses it unless those settings are given explicitly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from .. import store

CALIBRATED_FIELDS = ("layer", "top_k", "draft_depth")


_SHIPPED = "default_calibration.json"  # measured on the default model, shipped in the package


def load_calibration_file(model_path: str | Path) -> dict[str, Any] | None:
    """This model's stored calibration; for the default model, the shipped one if none."""
    stored = store.read_json("calibration", f"{store.file_key(model_path)}.json")
    if isinstance(stored, dict):
        return stored
    try:
        shipped = resources.files("srsd_local").joinpath("data", _SHIPPED).read_text("utf-8")
    except (OSError, FileNotFoundError):
        return None
    data = json.loads(shipped)
    p = Path(model_path)
    if p.name != data.get("model") or p.stat().st_size != data.get("model_size"):
        return None
    return data


def load_calibration(model_path: str | Path) -> dict[str, Any] | None:
    data = load_calibration_file(model_path)
    if not data:
        return None
    return {k: data[k] for k in CALIBRATED_FIELDS if k in data} or None


def candidate_layers(n_layer: int) -> list[int]:
    fractions = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75)
    return sorted({min(max(int(round(f * n_layer)), 1), n_layer - 2) for f in fractions})


def _score(engine, prompts, max_tokens: int) -> float:
    """Accepted drafted tokens per verified tree (higher is better), greedy."""
    accepted = drafts = 0
    for p in prompts:
        engine.reset()
        res = engine.generate(p.prompt, max_tokens=min(max_tokens, p.max_tokens),
                              mode="retrieval")
        accepted += res.stats.accepted_tokens
        drafts += res.stats.drafts
    return accepted / drafts if drafts else 0.0


def calibrate(load: Callable[..., Any], model_path: str, prompts: Sequence,
              layers: Sequence[int] | None = None, top_ks: Sequence[int] = (5, 10, 20),
              depths: Sequence[int] = (8, 16), max_tokens: int = 64,
              progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure, pick and return the best settings (ties: the earlier candidate wins)."""
    fixed = dict(adaptive=False, max_nodes=16, max_branches=4)
    scores: dict[str, dict[str, float]] = {"layer": {}, "top_k": {}, "draft_depth": {}}
    with load(layer=0.25, **fixed) as probe:
        n_layer = probe.n_layer
    layers = list(layers) if layers else candidate_layers(n_layer)
    for layer in layers:
        with load(layer=layer, top_k=10, draft_depth=16, **fixed) as eng:
            scores["layer"][str(layer)] = _score(eng, prompts, max_tokens)
        progress(f"layer {layer}: {scores['layer'][str(layer)]:.3f} accepted/tree")
    best_layer = int(max(scores["layer"], key=lambda k: (scores["layer"][k], -layers.index(
        int(k)))))
    with load(layer=best_layer, **fixed) as eng:
        for k in top_ks:
            eng.reconfigure(top_k=k, draft_depth=16)
            scores["top_k"][str(k)] = _score(eng, prompts, max_tokens)
            progress(f"top_k {k}: {scores['top_k'][str(k)]:.3f}")
        best_k = int(max(scores["top_k"], key=lambda k: (scores["top_k"][k], -int(k))))
        for d in depths:
            eng.reconfigure(top_k=best_k, draft_depth=d)
            scores["draft_depth"][str(d)] = _score(eng, prompts, max_tokens)
            progress(f"draft_depth {d}: {scores['draft_depth'][str(d)]:.3f}")
        best_d = int(max(scores["draft_depth"], key=lambda d: (scores["draft_depth"][d],
                                                                  int(d))))
        eng.reconfigure(top_k=best_k, draft_depth=best_d)
        acceptance = seed_acceptance(eng, prompts, max_tokens, progress)
    result = {"layer": best_layer, "top_k": best_k, "draft_depth": best_d,
              "n_layer": n_layer, "scores": scores, "model": Path(model_path).name,
              "model_size": Path(model_path).stat().st_size, "acceptance": acceptance}
    return _store(model_path, result)


SEED_MODES = ("ngram", "retrieval", "srsd", "hybrid")


def seed_acceptance(eng: Any, prompts: Sequence, max_tokens: int,
                    progress: Callable[[str], None] = lambda s: None) -> list:
    """Acceptance counts from fixed trees (every node verified, so every kind of evidence of
    every draft source gets measured outcomes; the controller keeps learning online)."""
    eng.speculator.acceptance.counts.clear()
    for mode in SEED_MODES:
        for p in prompts:
            eng.reset()
            eng.generate(p.prompt, max_tokens=min(max_tokens, p.max_tokens), mode=mode,
                         temperature=getattr(p, "temperature", 0.0),
                         seed=getattr(p, "seed", None))
    acceptance = eng.speculator.acceptance.to_json()
    progress(f"acceptance seeded from {sum(v[1] for _, v in acceptance)} outcomes")
    return acceptance


def reseed(load: Callable[..., Any], model_path: str, prompts: Sequence, max_tokens: int = 64,
           progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Keep this model's calibrated layer / top-k / depth, measure only the acceptance seeds
    (after the draft sources changed: much faster than a full calibration)."""
    base = load_calibration_file(model_path)
    if not base:
        raise ValueError(f"no calibration for {model_path} to reseed: run srsd-local "
                         "calibrate without --seeds-only first")
    with load(**{k: base[k] for k in CALIBRATED_FIELDS}, adaptive=False, max_nodes=16,
              max_branches=4) as eng:
        acceptance = seed_acceptance(eng, prompts, max_tokens, progress)
    return _store(model_path, {**base, "acceptance": acceptance})


def _store(model_path: str, result: dict[str, Any]) -> dict[str, Any]:
    path = store.write_json("calibration", f"{store.file_key(model_path)}.json", result)
    return {**result, "path": str(path)}

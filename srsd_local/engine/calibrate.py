"""Per-model settings: which hidden layer to retrieve with, and how many hits / how deep.

`srsd-local calibrate` runs the srsd drafter with a fixed tree (no controller, so every layer
gets the same verification budget) on a workload and measures accepted tokens per verified
tree for each candidate layer, then top-k and draft depth at the best layer. The winner is
stored per model file; `Engine.load` uses it unless those settings are given explicitly.

A model loaded for the first time (no stored calibration, and not the default model, which
ships one) gets a short calibration first (`calibrate_first_use`: two prompts of the built-in
`calibration` workload, 48 tokens, three candidate layers; about 30 s on 2 CPU cores for the
default model's size; progress on stderr); `srsd-local calibrate` measures more.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from .. import store
from ..llama.gguf import GGUFError, read_header
from ..prompts import BenchPrompt, parse_workload

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
                              mode="retrieval", **getattr(p, "constraint", {}))
        accepted += res.stats.accepted_tokens
        drafts += res.stats.drafts
    return accepted / drafts if drafts else 0.0


def calibrate(load: Callable[..., Any], model_path: str, prompts: Sequence,
              layers: Sequence[int] | None = None, top_ks: Sequence[int] = (5, 10, 20),
              depths: Sequence[int] = (8, 16), max_tokens: int = 64,
              progress: Callable[[str], None] = lambda s: None,
              n_layer: int | None = None, extra: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """Measure, pick and return the best settings (ties: the earlier candidate wins).
    `n_layer` (known already) saves a probe load; `extra` is stored with the result."""
    fixed = dict(adaptive=False, max_nodes=16, max_branches=4)
    scores: dict[str, dict[str, float]] = {"layer": {}, "top_k": {}, "draft_depth": {}}
    if n_layer is None:
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
              "model_size": Path(model_path).stat().st_size, "acceptance": acceptance,
              **(extra or {})}
    return _store(model_path, result)


SEED_MODES = ("ngram", "retrieval", "srsd", "hybrid")


def seed_acceptance(eng: Any, prompts: Sequence, max_tokens: int,
                    progress: Callable[[str], None] = lambda s: None) -> list:
    """Acceptance counts from fixed trees (every node verified, so every kind of evidence of
    every draft source gets measured outcomes; the controller keeps learning online)."""
    eng.speculator.acceptance.clear()
    for mode in SEED_MODES:
        for p in prompts:
            eng.reset()
            eng.generate(p.prompt, max_tokens=min(max_tokens, p.max_tokens), mode=mode,
                         temperature=getattr(p, "temperature", 0.0),
                         seed=getattr(p, "seed", None), **getattr(p, "constraint", {}))
    acceptance = eng.speculator.acceptance.to_json()
    progress(f"acceptance seeded from {sum(v[1] for _, v in acceptance)} outcomes")
    return acceptance


def reseed(load: Callable[..., Any], model_path: str, prompts: Sequence, max_tokens: int = 64,
           progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Keep this model's calibrated layer / top-k / depth, measure only the acceptance seeds
    (after the draft sources changed: much faster than a full calibration)."""
    base = load_calibration_file(model_path)
    if not base or not all(k in base for k in CALIBRATED_FIELDS):
        raise ValueError(f"no calibration for {model_path} to reseed: run srsd-local "
                         "calibrate without --seeds-only first")
    with load(**{k: base[k] for k in CALIBRATED_FIELDS}, adaptive=False, max_nodes=16,
              max_branches=4) as eng:
        acceptance = seed_acceptance(eng, prompts, max_tokens, progress)
    return _store(model_path, {**base, "acceptance": acceptance})


def _store(model_path: str, result: dict[str, Any]) -> dict[str, Any]:
    path = store.write_json("calibration", f"{store.file_key(model_path)}.json", result)
    return {**result, "path": str(path)}


# -- calibration on first use -------------------------------------------------------------
# A short run: about 30 s on 2 CPU cores for the default model's size (Gemma 3 270M); with
# these settings it picks the layer the full calibration picked for that model.
# The first greedy prompt of each of these categories of the calibration workload: one that
# copies a lot and one that copies little (on copy-heavy prompts alone every layer's drafts
# get accepted, which tells the layers apart poorly).
FIRST_USE_CATEGORIES = ("code_edit", "humaneval")
FIRST_USE_TOKENS = 48
FIRST_USE_LAYERS = (0.2, 0.3, 0.45)  # depth fractions
FIRST_USE_TOP_KS = (5, 10)
FIRST_USE_DEPTHS = (16,)
FIRST_USE_N_CTX = 2048  # the calibration prompts are < 1k tokens
# the built-in calibration workload (data of the benchmark package, read as a file: the
# engine layer does not import the benchmark)
_WORKLOAD = ("bench", "workloads", "calibration.jsonl")


def first_use_prompts(categories: Sequence[str] = FIRST_USE_CATEGORIES
                      ) -> list[BenchPrompt]:
    """The first greedy prompt of each of `categories` in the calibration workload."""
    text = resources.files("srsd_local").joinpath(*_WORKLOAD).read_text(encoding="utf-8")
    found: dict[str, BenchPrompt] = {}
    for p in parse_workload(text, "workload calibration"):
        if not p.temperature and p.category in categories:
            found.setdefault(p.category, p)
    return [found[c] for c in categories if c in found]


def quick_layers(n_layer: int) -> list[int]:
    """Candidate capture layers of a first-use calibration."""
    return sorted({max(0, min(max(int(round(f * n_layer)), 1), n_layer - 2))
                   for f in FIRST_USE_LAYERS})


def _say(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def calibrate_first_use(load: Callable[..., Any], model_path: str | Path, config: Any,
                        progress: Callable[[str], None] = _say) -> dict[str, Any] | None:
    """Calibrate a model that has no stored calibration, briefly, and store the result.

    `load(**settings)` loads an Engine of the model (no calibration, nothing learned);
    `config` is the SRSDConfig the caller asked for (its threads, GPU layers and index
    backend are used). A model whose header cannot be read is left to the real load (which
    says what is wrong); a model that cannot speculate (recurrent state) is stored as such.
    Returns the stored calibration, or None when it failed (a message says so; the
    defaults are used and the next load tries again)."""
    path = Path(model_path)
    try:
        read_header(path)
    except (GGUFError, OSError):
        return None
    base = {"n_threads": config.n_threads, "n_gpu_layers": config.n_gpu_layers,
            "index_backend": config.index_backend, "n_ctx": FIRST_USE_N_CTX}
    if hasattr(config, "parallel"):
        base["parallel"] = 1  # one request at a time: no KV cache for more
    fixed = dict(adaptive=False, max_nodes=16, max_branches=4)
    with load(**base, layer=0.25, **fixed) as probe:  # a load error is the load's error
        n_layer, plain = probe.n_layer, probe.plain_only
    if plain:
        return _store(str(path), {"model": path.name, "model_size": path.stat().st_size,
                                  "n_layer": n_layer, "plain_only": True})
    layers = quick_layers(n_layer)
    progress(f"srsd-local: first use of {path.name}: a short calibration of the retrieval "
             f"layer ({len(layers)} layers; under a minute on a CPU for a small model; "
             "--no-calibrate or Engine.load(..., calibrate=False) skips it)")
    t0 = time.perf_counter()
    try:
        res = calibrate(lambda **kw: load(**base, **kw), str(path),
                        first_use_prompts(FIRST_USE_CATEGORIES),
                        layers=layers, top_ks=FIRST_USE_TOP_KS, depths=FIRST_USE_DEPTHS,
                        max_tokens=FIRST_USE_TOKENS, progress=lambda s: progress("  " + s),
                        n_layer=n_layer, extra={"quick": True})
    except (ValueError, RuntimeError, OSError) as exc:
        progress(f"srsd-local: the calibration of {path.name} failed ({exc}); using the "
                 "default settings")
        return None
    progress(f"srsd-local: calibrated {path.name} in {time.perf_counter() - t0:.0f} s: layer "
             f"{res['layer']} of {n_layer}, top_k {res['top_k']}, draft_depth "
             f"{res['draft_depth']} (stored in {res['path']}; `srsd-local calibrate --model "
             "...` measures more)")
    return res

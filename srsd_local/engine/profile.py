"""The step-cost profile of a model on this machine: measured once, cached per model file,
machine (CPU model and flags, GPU) and settings, checked against a quick measurement at each
load (measured again when they disagree), corrected by real steps and saved back."""

from __future__ import annotations

import hashlib

from .. import store
from ..config import SRSDConfig
from ..llama.backend import Backend, device_names
from ..spec.cost import CostModel
from ..store import machine_id

# every size up to 16 (on a CPU, sizes that are not a multiple of the matrix kernels' tile
# cost more than the next one that is: steps are padded to the cheapest profiled size)
PROFILE_SIZES = (*range(1, 17), 20, 24, 28, 32, 48, 64, 96, 128)


def profile_name(backend: Backend, cfg: SRSDConfig) -> tuple[str, str, list[int]]:
    """(file name in the cache, full key, sizes to measure) for this model and machine."""
    n_max = min(cfg.max_nodes + 1, backend.n_batch)
    sizes = [n for n in PROFILE_SIZES if n < n_max] + [n_max]
    key = "|".join(str(v) for v in ("v4", store.file_key(backend.model_path), machine_id(),
                                    ",".join(device_names()), cfg.threads, cfg.n_gpu_layers,
                                    backend.n_batch, sizes))
    if cfg.rpc_servers:  # a split across RPC workers costs what their network and devices do
        key += f"|rpc={','.join(cfg.rpc_servers)}|split={cfg.tensor_split}"
    return hashlib.sha1(key.encode()).hexdigest() + ".json", key, sizes


def load_cost_model(backend: Backend, cfg: SRSDConfig) -> tuple[CostModel, str, str]:
    """(cost model, cache file name, key): the cached profile of this model on this machine
    and settings, else one measured now (a second or two on a CPU)."""
    name, key, sizes = profile_name(backend, cfg)
    cached = store.read_json("profiles", name)
    if isinstance(cached, dict) and cached.get("key") == key:
        try:
            model = CostModel.from_dict(cached)
        except (KeyError, TypeError, ValueError):
            model = None  # unreadable: measure again
        if model is not None and agrees(model, backend, sizes):
            return model, name, key
    seconds, per_kv, ctx0 = backend.profile(sizes)
    model = CostModel(sizes, seconds, per_kv, ctx0)
    save_cost_model(model, name, key)
    return model, name, key


CHECK_SIZE = 8  # the batch size checked against a cached profile at load
OFF_SPEED = 3.0  # a cached plain step this many times off the machine's speed now...
OFF_SHAPE = 1.5  # ...or a cached t(8) / t(1) this far off: the profile is measured again


def agrees(model: CostModel, backend: Backend, sizes: list[int]) -> bool:
    """Whether a cached profile agrees with a quick measurement of t(1) and t(8) now (about
    0.3 s on a CPU). A profile cached while the machine was busy, or by a run that went wrong,
    would otherwise steer the controller until real steps had corrected every size: the
    online corrections fix the scale at once but the shape only as trees of each size run."""
    k = min(CHECK_SIZE, sizes[-1])
    (t1, tk), _, ctx0 = backend.profile([1, k], reps=2, long_ctx=0)
    c1, ck = model.t(1, ctx0), model.t(k, ctx0)
    speed, shape = c1 / t1, (ck / c1) / (tk / t1)
    return 1 / OFF_SPEED < speed < OFF_SPEED and 1 / OFF_SHAPE < shape < OFF_SHAPE


def save_cost_model(model: CostModel, name: str, key: str) -> None:
    store.write_json("profiles", name, {"key": key, **model.to_dict()})

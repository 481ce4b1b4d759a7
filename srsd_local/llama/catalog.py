"""Model files and model names, the pure part: no network, no llama.cpp.

- What one GGUF is (`describe`: size, quantization, architecture, context length, chat
  template), read from its header only.
- Finding GGUFs in folders (`scan_folder`; a multi-part set ``name-00001-of-00003.gguf`` is one
  model) and in Ollama's store (`scan_ollama`: manifests pointing at GGUF blobs).
- Hugging Face specs ``REPO[:QUANT|FILE]`` (`parse_hub_spec`) and which files of a repo one
  names (`select_files`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .gguf import GGUFError, read_header


class ModelError(ValueError):
    """A model spec that cannot be used; the message says what is accepted."""


# llama.cpp's llama_ftype (general.file_type) -> the usual quantization name
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0", 41: "Q2_0",
}
# a quantization in a file name: Q4_K_M, q8_0, IQ4_XS, UD-Q4_K_XL, F16, BF16, MXFP4, ...
_QUANT_RE = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d+_[A-Z0-9]+(?:_[A-Z0-9]+)?|TQ\d_\d|BF16|F16|F32|"
    r"MXFP4(?:_MOE)?))(?![A-Za-z0-9])", re.IGNORECASE)
_SPLIT_RE = re.compile(r"^(?P<base>.+)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$",
                       re.IGNORECASE)
# a Hugging Face repo id (owner/name, as the hub spells them) and an optional :QUANT or :FILE
_REPO_RE = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96})(?::(?P<want>[^:]*))?$")
# the quantization picked when a spec names none (what llama.cpp's -hf and Ollama pick)
DEFAULT_QUANT = "Q4_K_M"
HUB_EXAMPLE = "ggml-org/gemma-3-270m-it-GGUF:Q8_0"


def quant_from_name(name: str) -> str | None:
    """The quantization a file name states (upper case), or None."""
    hits = _QUANT_RE.findall(Path(name).name)
    return hits[-1].upper() if hits else None


def split_part(name: str) -> tuple[str, int, int] | None:
    """(base name, part, total) of a multi-part GGUF name, else None."""
    m = _SPLIT_RE.match(Path(name).name)
    if not m or not 1 <= int(m["part"]) <= int(m["total"]):
        return None
    return m["base"], int(m["part"]), int(m["total"])


def is_projector(name: str) -> bool:
    """Vision projectors (mmproj) are GGUFs too, but not models to generate with."""
    return Path(name).name.lower().startswith("mmproj")


def model_stem(name: str) -> str:
    """A file name without .gguf and without a multi-part suffix."""
    sp = split_part(name)
    if sp:
        return sp[0]
    n = Path(name).name
    return n[:-5] if n.lower().endswith(".gguf") else n


@dataclass
class ModelEntry:
    """One usable model (or one that is not, with `problem` saying why)."""

    id: str  # what --model / Engine.load / resolve_model accept for it
    path: str  # the file to load (the first part of a multi-part set)
    source: str  # default, models, SRSD_MODELS_DIR, huggingface, lmstudio, ollama, ...
    size: int = 0  # bytes, all parts
    parts: int = 1
    quant: str | None = None
    arch: str | None = None
    context_length: int | None = None
    chat_template: bool | None = None
    name: str | None = None  # general.name
    problem: str | None = None  # why it cannot be used (None: usable)
    note: str | None = None  # e.g. "assembled on first use"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(entry: ModelEntry, header_file: str | Path | None = None) -> ModelEntry:
    """Fill quantization, architecture, context length and chat template from the GGUF
    header (of `header_file`, default `entry.path`); an unreadable header sets `problem`."""
    try:
        h = read_header(header_file or entry.path, what=entry.path)
    except GGUFError as exc:
        entry.problem = str(exc)
        return entry
    except OSError as exc:
        entry.problem = f"cannot read {entry.path}: {exc.strerror or exc}"
        return entry
    ftype = h.get("general.file_type")
    entry.quant = (FILE_TYPES.get(ftype) if isinstance(ftype, int) else None) \
        or quant_from_name(entry.path) or entry.quant
    arch = h.get("general.architecture")
    entry.arch = arch if isinstance(arch, str) else None
    ctx = h.get(f"{arch}.context_length") if entry.arch else None
    entry.context_length = int(ctx) if isinstance(ctx, int) else None
    entry.chat_template = isinstance(h.get("tokenizer.chat_template"), str)
    name = h.get("general.name")
    entry.name = name if isinstance(name, str) else None
    return entry


def group_parts(files: Iterable[Path]) -> list[tuple[Path, list[Path], str | None]]:
    """GGUF files -> (file to load, all parts, problem) with a multi-part set as one model;
    a set with missing parts has a problem."""
    singles: list[tuple[Path, list[Path], str | None]] = []
    sets: dict[tuple[Path, str, int], dict[int, Path]] = {}
    for f in files:
        sp = split_part(f.name)
        if sp is None:
            singles.append((f, [f], None))
        else:
            sets.setdefault((f.parent, sp[0], sp[2]), {})[sp[1]] = f
    for (_, base, total), parts in sets.items():
        have = [parts[i] for i in sorted(parts)]
        missing = [i for i in range(1, total + 1) if i not in parts]
        first = parts.get(1) or have[0]
        problem = None
        if missing:
            problem = (f"multi-part model {base} is incomplete: part(s) "
                       f"{', '.join(str(i) for i in missing)} of {total} are missing")
        singles.append((first, have, problem))
    return sorted(singles, key=lambda t: str(t[0]))


def _walk_ggufs(root: Path, max_depth: int) -> list[Path]:
    out: list[Path] = []
    base = len(root.parts)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        depth = len(Path(dirpath).parts) - base
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) \
            if depth < max_depth else []
        out += [Path(dirpath) / n for n in sorted(filenames)
                if n.lower().endswith(".gguf") and not n.startswith(".")
                and not is_projector(n)]
    return out


def scan_folder(root: str | Path, source: str, max_depth: int = 4,
                headers: bool = True) -> list[ModelEntry]:
    """The GGUF models in a folder (and sub-folders down to `max_depth`), one entry per
    model; the id is the file name without .gguf (and without -0000N-of-0000M)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for first, parts, problem in group_parts(_walk_ggufs(root, max_depth)):
        size = sum(p.stat().st_size for p in parts if p.exists())
        e = ModelEntry(id=model_stem(first.name), path=str(first), source=source, size=size,
                       parts=len(parts), quant=quant_from_name(first.name), problem=problem)
        out.append(describe(e) if headers and problem is None else e)
    return out


_OLLAMA_MODEL = "application/vnd.ollama.image.model"
_OLLAMA_REGISTRY = "registry.ollama.ai"


def scan_ollama(root: str | Path, headers: bool = True) -> list[ModelEntry]:
    """Ollama's models: manifests/<host>/<namespace>/<name>/<tag> name a model layer, a GGUF
    blob (blobs/sha256-<hex>, no extension). The id is ``ollama:<name>:<tag>`` (with the
    namespace and host when they are not Ollama's library)."""
    root = Path(root)
    manifests = root / "manifests"
    if not manifests.is_dir():
        return []
    out = []
    for m in sorted(p for p in manifests.rglob("*") if p.is_file()):
        rel = m.relative_to(manifests).parts
        if len(rel) != 4:
            continue
        host, namespace, name, tag = rel
        try:
            layers = json.loads(m.read_text(encoding="utf-8")).get("layers", [])
            digest = next(layer["digest"] for layer in layers
                          if layer.get("mediaType") == _OLLAMA_MODEL)
        except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
            continue  # not a model manifest (or not one we understand)
        full = f"{name}:{tag}"
        if host != _OLLAMA_REGISTRY:
            full = f"{host}/{namespace}/{full}"
        elif namespace != "library":
            full = f"{namespace}/{full}"
        blob = root / "blobs" / str(digest).replace(":", "-")
        e = ModelEntry(id=f"ollama:{full}", path=str(blob), source="ollama")
        if not blob.is_file():
            e.problem = f"ollama blob {blob} is missing"
        else:
            e.size = blob.stat().st_size
            if headers:
                describe(e)
        out.append(e)
    return out


def dedupe(entries: Iterable[ModelEntry]) -> list[ModelEntry]:
    """The first entry of every file (by resolved path)."""
    seen: set[str] = set()
    out = []
    for e in entries:
        try:
            key = str(Path(e.path).resolve())
        except OSError:
            key = e.path
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


# -- Hugging Face specs -------------------------------------------------------------------
def parse_hub_spec(spec: str) -> tuple[str, str | None] | None:
    """``owner/name`` or ``owner/name:QUANT`` or ``owner/name:FILE`` -> (repo, want); None
    when `spec` is not written like one (a path, a plain name)."""
    s = spec.strip()
    if s.startswith((".", "/", "~")) or "\\" in s:
        return None
    m = _REPO_RE.match(s)
    if not m:
        return None
    repo, want = m["repo"], m["want"]
    if want is None and repo.lower().endswith(".gguf"):
        return None  # dir/file.gguf is a path
    if "--" in repo or ".." in repo or repo.endswith((".", "-")):
        return None  # not a valid repo id
    return repo, (want.strip() or None) if want else None


def _candidates(files: Sequence[str]) -> dict[str, list[str]]:
    """GGUF files of a repo -> {name to show: the files to fetch (all parts, in order)}."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and not is_projector(f)]
    out: dict[str, list[str]] = {}
    sets: dict[tuple[str, str, int], dict[int, str]] = {}
    for f in ggufs:
        sp = split_part(f)
        if sp is None:
            out[f] = [f]
        else:
            sets.setdefault((str(Path(f).parent), sp[0], sp[2]), {})[sp[1]] = f
    for (_, _, total), parts in sets.items():
        if sorted(parts) == list(range(1, total + 1)):
            out[parts[1]] = [parts[i] for i in range(1, total + 1)]
    return out


def _accepted(repo: str, cands: dict[str, list[str]], files_first: bool = False) -> str:
    """What a spec of `repo` may name: its quantizations (those that name one model) and the
    files the others need."""
    quants: dict[str, list[str]] = {}
    for first in cands:
        quants.setdefault(quant_from_name(first) or "", []).append(first)
    unique = sorted(q for q, fs in quants.items() if q and len(fs) == 1)
    files = sorted(cands) if files_first else \
        sorted(f for q, fs in quants.items() if not q or len(fs) > 1 for f in fs)
    parts = []
    if unique:
        parts.append(f"the quantizations {', '.join(unique)} (as {repo}:QUANT)")
    if files:
        parts.append(f"the files {', '.join(files)} (as {repo}:FILE)")
    return " or ".join(reversed(parts) if files_first else parts)


def select_files(repo: str, files: Sequence[str], want: str | None) -> list[str]:
    """The files of `repo` (its file list) that a spec names: a file (or the first part of a
    multi-part set), a quantization (exact, else a unique prefix: Q4_K -> Q4_K_M when the repo
    has only that), or, with nothing, Q4_K_M when the repo has it, else its only GGUF.
    ModelError says what the repo has."""
    cands = _candidates(files)
    if not cands:
        shown = ", ".join(sorted(files)[:12]) + (" ..." if len(files) > 12 else "")
        raise ModelError(f"Hugging Face repo {repo!r} has no GGUF model file (its files: "
                         f"{shown or 'none'}); accepted are repos with .gguf files, e.g. "
                         f"{HUB_EXAMPLE.split(':')[0]}")
    example = f"{repo}:{quant_from_name(next(iter(cands))) or next(iter(cands))}"
    if want is not None and (want.lower().endswith(".gguf") or "/" in want):
        hits = [f for f in cands if f == want or Path(f).name == want]
        if not hits:  # a part of a set names the set
            hits = [first for first, parts in cands.items()
                    if any(p == want or Path(p).name == want for p in parts)]
        if len(hits) == 1:
            return cands[hits[0]]
        if not hits:
            raise ModelError(f"Hugging Face repo {repo!r} has no GGUF file {want!r}: accepted "
                             f"are {_accepted(repo, cands, files_first=True)}")
        raise ModelError(f"{want!r} names several files of {repo!r}: "
                         f"{', '.join(sorted(hits))}; give the path inside the repo")
    key = (want or DEFAULT_QUANT).upper()
    by_quant = {f: (quant_from_name(f) or "") for f in cands}
    hits = [f for f, q in by_quant.items() if q == key or q == f"UD-{key}"]
    if not hits and want is not None:
        hits = [f for f, q in by_quant.items() if q.startswith(key) or
                q.startswith(f"UD-{key}")]
    if want is None and not hits:
        if len(cands) == 1:
            return next(iter(cands.values()))
        raise ModelError(f"Hugging Face repo {repo!r} has several GGUF models and no "
                         f"{DEFAULT_QUANT}, so name one: accepted are {_accepted(repo, cands)} "
                         f"(e.g. {example})")
    if not hits:
        raise ModelError(f"Hugging Face repo {repo!r} has no {want} GGUF: accepted are "
                         f"{_accepted(repo, cands)}")
    if len(hits) > 1:
        quants = sorted({by_quant[f] for f in hits})
        alt = f" (or a full quantization: {', '.join(quants)})" if len(quants) == len(hits) \
            else ""
        raise ModelError(f"quantization {want or DEFAULT_QUANT!r} of {repo!r} is ambiguous: "
                         f"it matches {', '.join(sorted(hits))}; name one of them as "
                         f"{repo}:FILE{alt}")
    return cands[hits[0]]

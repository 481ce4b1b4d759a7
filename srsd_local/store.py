"""Everything srsd-local writes under the user's cache directory, written atomically.

Layout of the cache directory (``environment().cache_dir``):

- ``profiles/<key>.json``: measured step costs of a model on a machine (the cost model)
- ``acceptance/<model>.json``: acceptance counts learned by earlier runs
- ``calibration/<model>.json``: the calibrated retrieval layer and tree settings
- ``capture/<name>-<hash>.so``: compiled helpers (the eval callback, the sampling kernels)
- ``grammar/<model>.npz``: each token's first two bytes, read by grammar constraints
- ``models/``: the assembled default model when there is no source checkout
- ``llama-server/<version>/llama-server``: llama.cpp's server, built for the benchmark's
  peer modes by scripts/build_llama_server.sh

Every write goes to a temporary file in the same folder and is renamed into place, so a
crash never leaves a half-written file; a file that cannot be parsed reads as missing.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from .config import environment

KINDS = ("profiles", "acceptance", "calibration", "capture", "grammar", "models",
         "llama-server")


def cache_dir() -> Path:
    return environment().cache_dir


def path(kind: str, name: str) -> Path:
    """The file `name` of one kind of cached data (see KINDS)."""
    if kind not in KINDS:
        raise ValueError(f"unknown cache kind {kind!r}: accepted are {', '.join(KINDS)}")
    return cache_dir() / kind / name


def write_bytes(target: Path, data: bytes) -> Path:
    """Write `data` to `target` atomically (temp file in the same folder + rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def write_json(kind: str, name: str, data: Any) -> Path:
    return write_bytes(path(kind, name), json.dumps(data, indent=1).encode("utf-8"))


def read_json(kind: str, name: str) -> Any | None:
    """The stored value, or None when the file is missing or unreadable."""
    try:
        return json.loads(path(kind, name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def file_key(file: str | Path) -> str:
    """Identifies one file's content cheaply: its resolved path, size and mtime."""
    p = Path(file).resolve()
    st = p.stat()
    return hashlib.sha1(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()


@lru_cache(maxsize=1)
def machine_id() -> str:
    """CPU model and flags (a hash of them) and the machine type: what is measured or built
    for one machine is never used on another."""
    cpu, flags = platform.processor(), ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    cpu = value.strip()
                elif key.strip() in ("flags", "Features"):
                    flags = value.strip()
                    break
    except OSError:
        pass
    digest = hashlib.sha1(flags.encode()).hexdigest()[:12]
    return f"{platform.machine()}|{cpu}|{digest}"


def _compiler() -> str | None:
    for cand in (environment().cc, "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    return None


def compiled_library(name: str, source: bytes, flags: tuple[str, ...] = ("-O2",),
                     per_machine: bool = False) -> Path | None:
    """A shared library built from C `source` with the system's C compiler, once, into the
    cache (keyed by the source and flags, and by the machine with `per_machine`: a build
    for this CPU's instruction set); None when there is no compiler or it fails."""
    salt = " ".join(flags) + (machine_id() if per_machine else "")
    key = hashlib.sha1(source + salt.encode()).hexdigest()[:12]
    out = path("capture", f"{name}-{key}.so")
    if out.exists():
        return out
    cc = _compiler()
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        c_file = Path(tmp) / f"{name}.c"
        c_file.write_bytes(source)
        so = Path(tmp) / f"{name}.so"
        try:
            proc = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", str(so), str(c_file),
                                   "-lm"], capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
        if proc.returncode != 0 or not so.exists():
            return None
        write_bytes(out, so.read_bytes())
    return out


def load_compiled(name: str, source: bytes,
                  builds: tuple[tuple[tuple[str, ...], bool], ...]) -> ctypes.CDLL | None:
    """The first of `builds` ((flags, per_machine) each, see `compiled_library`) that
    compiles and loads, as a loaded library; None when none does (no compiler, an unwritable
    cache, a library that does not load)."""
    for flags, per_machine in builds:
        try:
            built = compiled_library(name, source, flags, per_machine)
            if built is not None:
                return ctypes.CDLL(str(built))
        except OSError:
            continue
    return None

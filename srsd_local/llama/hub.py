"""GGUF models from the Hugging Face hub, through `huggingface_hub` and its standard cache.

A spec is ``REPO``, ``REPO:QUANT`` or ``REPO:FILE`` (`catalog.parse_hub_spec`, chosen by
`catalog.select_files`). `resolve` uses a copy already in the cache without asking the hub,
else downloads; `pull` always asks the hub (and so picks up a newer upload). Downloads go
through `hf_hub_download`: a progress bar on stderr, interrupted transfers resumed, files in
the standard cache (``$HF_HUB_CACHE`` or ``$HF_HOME/hub``, shared with every other tool that
uses the hub); a file that was just downloaded is checked against the sha256 the hub lists
for it. HF_ENDPOINT, HF_HUB_CACHE, HF_HOME and HF_HUB_OFFLINE are read by
`config.environment()` at call time and passed explicitly; HF_TOKEN (or a stored login)
is used by huggingface_hub itself. Every failure is a `ModelError` that says what was wrong
and what is accepted.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..config import environment
from .catalog import (
    HUB_EXAMPLE,
    ModelEntry,
    ModelError,
    _candidates,
    describe,
    group_parts,
    quant_from_name,
    select_files,
)

_DISK_MARGIN = 64 << 20  # keep this much free beyond the download
_ATTEMPTS = 3  # a transfer cut off is resumed this many times (besides huggingface_hub's own)
# a connection that was cut mid-transfer (huggingface_hub 1.x+ uses httpx, 0.x requests)
_CUT_ERRORS = {"RemoteProtocolError", "ReadError", "ReadTimeout", "ChunkedEncodingError",
               "IncompleteRead", "ProtocolError"}
_NETWORK_ERRORS = {"ConnectError", "ConnectTimeout", "ConnectionError", "NewConnectionError",
                   "MaxRetryError", "NameResolutionError", "TimeoutException", "ProxyError",
                   "SSLError", "LocalEntryNotFoundError", "gaierror"} | _CUT_ERRORS


@dataclass(frozen=True)
class RemoteFile:
    name: str  # path inside the repo
    size: int | None
    sha256: str | None  # of an LFS file (every GGUF on the hub)


def _repo_folder(repo: str) -> Path:
    return environment().hf_cache / ("models--" + repo.replace("/", "--"))


def _snapshots(repo: str) -> list[Path]:
    """The repo's cached snapshots, the one `main` points at first, then newest first."""
    folder = _repo_folder(repo)
    snaps = folder / "snapshots"
    if not snaps.is_dir():
        return []
    order = sorted((p for p in snaps.iterdir() if p.is_dir()),
                   key=lambda p: p.stat().st_mtime, reverse=True)
    try:
        main = (folder / "refs" / "main").read_text(encoding="utf-8").strip()
    except OSError:
        main = ""
    return sorted(order, key=lambda p: p.name != main)


def cached_files(repo: str) -> dict[str, Path]:
    """GGUF files of `repo` in the local cache (path inside the repo -> local path)."""
    out: dict[str, Path] = {}
    for snap in _snapshots(repo):
        for f in snap.rglob("*.gguf"):
            rel = f.relative_to(snap).as_posix()
            if rel not in out and f.is_file():  # a pointer whose blob exists
                out[rel] = f
    return out


def find_cached(repo: str, want: str | None) -> Path | None:
    """The local file a spec names when it is complete in the cache (no network), else
    None."""
    files = cached_files(repo)
    if not files:
        return None
    try:
        chosen = select_files(repo, sorted(files), want)
    except ModelError:
        return None
    return files[chosen[0]] if all(c in files for c in chosen) else None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _is(exc: BaseException, *names: str) -> bool:
    from huggingface_hub import errors  # noqa: PLC0415

    kinds = tuple(k for k in (getattr(errors, n, None) for n in names) if isinstance(k, type))
    return bool(kinds) and isinstance(exc, kinds)


def _explain(exc: BaseException, repo: str, file: str | None = None) -> ModelError:
    """A huggingface_hub / network / disk failure as a ModelError that says what to do."""
    endpoint = environment().hf_endpoint
    where = f"{repo}/{file}" if file else repo
    if _is(exc, "GatedRepoError"):
        return ModelError(f"Hugging Face repo {repo!r} is gated: accept its terms on "
                          f"{endpoint}/{repo} and set HF_TOKEN (or `hf auth login`)")
    if _is(exc, "RepositoryNotFoundError"):
        return ModelError(f"Hugging Face repo {repo!r} was not found on {endpoint} (or it is "
                          f"private: set HF_TOKEN); accepted are public model repos as "
                          f"REPO[:QUANT|FILE], e.g. {HUB_EXAMPLE}")
    if _is(exc, "RevisionNotFoundError", "EntryNotFoundError", "RemoteEntryNotFoundError"):
        return ModelError(f"{where!r} was not found on {endpoint}; `srsd-local models pull "
                          f"{repo}` lists the GGUF files the repo has")
    if _is(exc, "OfflineModeIsEnabled"):
        return ModelError(f"{where!r} is not in the Hugging Face cache "
                          f"({environment().hf_cache}) and HF_HUB_OFFLINE is set: unset it to "
                          "download, or use a model listed by `srsd-local models`")
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return ModelError(f"no disk space left while downloading {where!r} into "
                              f"{environment().hf_cache}: free some space, or set HF_HUB_CACHE "
                              "(or HF_HOME) to a bigger disk")
    for e in _chain(exc):
        if type(e).__name__ in _NETWORK_ERRORS or isinstance(e, (ConnectionError, TimeoutError)):
            return ModelError(f"cannot reach (or lost the connection to) the Hugging Face hub at "
                              f"{endpoint} for {where!r} "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                              "); check the network connection (or HF_ENDPOINT); models already "
                              "downloaded work offline: `srsd-local models` lists them")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status in (401, 403):
        return ModelError(f"the Hugging Face hub refused access to {where!r} ({status}): set "
                          "HF_TOKEN to a token that may read it")
    if status == 404:
        return ModelError(f"{where!r} was not found on {endpoint} (404); accepted are public "
                          f"model repos as REPO[:QUANT|FILE], e.g. {HUB_EXAMPLE}")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ModelError(f"downloading {where!r} from {endpoint} failed: {first}")


def remote_files(repo: str) -> dict[str, RemoteFile]:
    """Every file of `repo` on the hub, with sizes and sha256 (one API call)."""
    from huggingface_hub import HfApi  # noqa: PLC0415

    env = environment()
    if env.hf_offline:
        raise ModelError(f"HF_HUB_OFFLINE is set, so {repo!r} cannot be looked up on the hub; "
                         "unset it to download, or use a model listed by `srsd-local models`")
    try:
        info = HfApi(endpoint=env.hf_endpoint).model_info(repo, files_metadata=True)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001  (every failure becomes a clear ModelError)
        raise _explain(exc, repo) from exc
    out = {}
    for s in info.siblings or []:
        lfs: Any = getattr(s, "lfs", None)
        sha = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
        out[s.rfilename] = RemoteFile(s.rfilename, getattr(s, "size", None), sha)
    return out


def _free_space(folder: Path) -> int | None:
    for p in (folder, *folder.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                    desc=f"checking {path.name}", leave=False) as bar:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def download(repo: str, want: str | None) -> Path:
    """Ask the hub which files the spec names and download them (each only when the cache
    lacks it); the local path of the file to load."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache  # noqa: PLC0415

    env = environment()
    files = remote_files(repo)
    chosen = select_files(repo, sorted(files), want)
    cache = env.hf_cache
    fresh = [f for f in chosen
             if not isinstance(try_to_load_from_cache(repo, f, cache_dir=cache), str)]
    need = sum(files[f].size or 0 for f in fresh)
    free = _free_space(cache)
    if need and free is not None and free < need + _DISK_MARGIN:
        raise ModelError(f"not enough disk space to download {repo}:{chosen[0]}: it needs "
                         f"{need / 1e9:.2f} GB, {cache} has {free / 1e9:.2f} GB free; free "
                         "some space, or set HF_HUB_CACHE (or HF_HOME) to a bigger disk")
    paths = []
    for f in chosen:
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                local = Path(hf_hub_download(repo, f, cache_dir=cache,
                                             endpoint=env.hf_endpoint))
                break
            except Exception as exc:  # noqa: BLE001  (every failure becomes a ModelError)
                cut = any(type(e).__name__ in _CUT_ERRORS for e in _chain(exc))
                if not cut or attempt == _ATTEMPTS:
                    raise _explain(exc, repo, f) from exc
                print(f"srsd-local: the connection was cut while downloading {repo}/{f}; "
                      f"resuming (attempt {attempt + 1} of {_ATTEMPTS})", file=sys.stderr)
        sha = files[f].sha256
        if f in fresh and sha and _sha256(local) != sha:
            blob = local.resolve()
            local.unlink(missing_ok=True)
            blob.unlink(missing_ok=True)
            raise ModelError(f"{repo}/{f} does not match the sha256 the hub lists for it "
                             f"({sha}); the download was removed, run it again")
        paths.append(local)
    return paths[0]


def resolve(repo: str, want: str | None) -> Path:
    """A cached copy when there is a complete one, else a download."""
    return find_cached(repo, want) or download(repo, want)


def pull(repo: str, want: str | None) -> Path:
    """Ask the hub (a newer upload is downloaded), then return the local file."""
    return download(repo, want)


def cache_entries(headers: bool = True) -> list[ModelEntry]:
    """The GGUF models in the Hugging Face cache (`huggingface_hub.scan_cache_dir`), with an
    id `REPO:QUANT` (or `REPO:FILE` when the quantization does not name one file)."""
    from huggingface_hub import scan_cache_dir  # noqa: PLC0415

    cache = environment().hf_cache
    if not cache.is_dir():
        return []
    try:
        info = scan_cache_dir(cache)
    except Exception:  # noqa: BLE001  (an unreadable cache lists nothing, it is not an error)
        return []
    out: list[ModelEntry] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        revs = sorted(repo.revisions, key=lambda r: (not r.refs, -r.last_modified))
        local: dict[str, Path] = {}
        for rev in revs:
            for f in rev.files:
                rel = f.file_path.relative_to(rev.snapshot_path).as_posix()
                if rel.lower().endswith(".gguf") and rel not in local:
                    local[rel] = f.file_path
        rels = sorted(local)
        complete = _candidates(rels)
        for first, parts, problem in group_parts(local[r] for r in rels):
            rel = next(r for r, p in local.items() if p == first)
            if rel not in complete and problem is None:
                continue  # a projector, or a part of a set listed under its first part
            spec = f"{repo.repo_id}:{rel}"
            q = quant_from_name(rel)
            if q and problem is None:
                try:
                    if select_files(repo.repo_id, rels, q) == complete[rel]:
                        spec = f"{repo.repo_id}:{q}"
                except ModelError:
                    pass
            e = ModelEntry(id=spec, path=str(first), source="huggingface",
                           size=sum(p.stat().st_size for p in parts), parts=len(parts),
                           quant=q, problem=problem)
            out.append(describe(e) if headers and problem is None else e)
    return out

"""Models: GGUF headers, finding models on disk, pulling from a (local, fake) Hugging Face hub,
names accepted anywhere a model is, and calibration on first use.

The hub is a small HTTP server in this process that speaks enough of the hub's protocol for
huggingface_hub (`GET /api/models/REPO`, `HEAD`/`GET /REPO/resolve/REV/FILE` with ranges);
HF_ENDPOINT points at it, so nothing here needs the internet.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from srsd_local.llama import gguf
from srsd_local.llama.catalog import (
    ModelError,
    parse_hub_spec,
    quant_from_name,
    select_files,
    split_part,
)
from srsd_local.llama.models import list_models, pull_model, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def tiny_gguf(arch: str = "llama", ftype: int = 7, ctx: int = 4096, chat: bool = True,
              name: str = "Tiny") -> bytes:
    meta = {"general.architecture": arch, "general.name": name, "general.file_type": ftype,
            f"{arch}.context_length": ctx,
            "tokenizer.ggml.tokens": [f"t{i}" for i in range(100)]}  # a long array
    if chat:
        meta["tokenizer.chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    return gguf.encode_header(meta, tensor_count=0)


# -- GGUF headers -----------------------------------------------------------------------------
def test_gguf_header_round_trip_and_errors(tmp_path):
    data = gguf.encode_header({"a.u8": (gguf.UINT8, 7), "a.i64": -5, "a.f": 0.5, "a.b": True,
                               "a.s": "héllo", "a.short": [1, 2, 3],
                               "a.long": list(range(1000)), "a.strs": ["x"] * 70},
                              tensor_count=3)
    p = tmp_path / "x.gguf"
    p.write_bytes(data + b"\0" * 100)
    h = gguf.read_header(p)
    assert (h.version, h.tensor_count, h.size) == (3, 3, len(data))
    assert h.metadata["a.u8"] == 7 and h.metadata["a.i64"] == -5 and h.metadata["a.b"] is True
    assert h.metadata["a.s"] == "héllo" and h.metadata["a.short"] == [1, 2, 3]
    assert h.metadata["a.f"] == pytest.approx(0.5)
    assert h.metadata["a.long"] == gguf.GGUFArray(gguf.UINT32, 1000)  # counted, not kept
    assert h.metadata["a.strs"] == gguf.GGUFArray(gguf.STRING, 70)
    for cut in (3, 10, 30, len(data) - 1):
        p.write_bytes(data[:cut])
        with pytest.raises(gguf.GGUFError, match="cut short|not a GGUF"):
            gguf.read_header(p)
    p.write_bytes(b"NOPE" + data[4:])
    with pytest.raises(gguf.GGUFError, match="not a GGUF"):
        gguf.read_header(p)
    p.write_bytes(struct.pack("<4sIQQ", b"GGUF", 99, 0, 0))
    with pytest.raises(gguf.GGUFError, match="version 99; accepted are versions 2, 3"):
        gguf.read_header(p)


def test_the_default_models_header_reads_in_a_fraction_of_the_file(model_path):
    h = gguf.read_header(model_path)
    assert h.metadata["general.architecture"] == "gemma3"
    assert h.metadata["gemma3.context_length"] == 32768
    assert h.metadata["general.file_type"] == 15  # Q4_K_M
    assert h.size < model_path.stat().st_size // 10


# -- names ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,quant", [
    ("gemma-3-270m-it-Q8_0.gguf", "Q8_0"), ("Qwen2.5-7B-Instruct-q4_k_m.gguf", "Q4_K_M"),
    ("model-IQ4_XS.gguf", "IQ4_XS"), ("x-UD-Q4_K_XL-00001-of-00002.gguf", "UD-Q4_K_XL"),
    ("phi-f16.gguf", "F16"), ("m.BF16.gguf", "BF16"), ("plain.gguf", None),
])
def test_quantization_from_file_names(name, quant):
    assert quant_from_name(name) == quant


def test_multi_part_names():
    assert split_part("a/m-Q8_0-00002-of-00003.gguf") == ("m-Q8_0", 2, 3)
    assert split_part("m-Q8_0.gguf") is None
    assert split_part("m-00004-of-00003.gguf") is None


@pytest.mark.parametrize("spec,parsed", [
    ("ggml-org/gemma-3-270m-it-GGUF:Q8_0", ("ggml-org/gemma-3-270m-it-GGUF", "Q8_0")),
    ("ggml-org/gemma-3-270m-it-GGUF", ("ggml-org/gemma-3-270m-it-GGUF", None)),
    ("o/r:sub/f-Q4_K_M.gguf", ("o/r", "sub/f-Q4_K_M.gguf")),
    ("models/x.gguf", None), ("/abs/o/r", None), ("./o/r", None), ("~/o/r", None),
    ("plain-name", None), ("ollama:llama3:8b", None), ("a--b/c", None), ("o/r:", ("o/r", None)),
])
def test_hub_specs_are_told_from_paths(spec, parsed):
    assert parse_hub_spec(spec) == parsed


def test_selecting_files_of_a_repo():
    files = ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-F16.gguf",
             "big/m-F16-00001-of-00002.gguf", "big/m-F16-00002-of-00002.gguf"]
    assert select_files("o/r", files, None) == ["m-Q4_K_M.gguf"]  # the default quant
    assert select_files("o/r", files, "q8_0") == ["m-Q8_0.gguf"]
    assert select_files("o/r", files, "F16") == ["big/m-F16-00001-of-00002.gguf",
                                                 "big/m-F16-00002-of-00002.gguf"]
    assert select_files("o/r", files, "m-Q8_0.gguf") == ["m-Q8_0.gguf"]
    assert select_files("o/r", files, "m-F16-00002-of-00002.gguf")[0].endswith(
        "00001-of-00002.gguf")
    assert select_files("o/r", ["only-Q6_K.gguf", "x.txt"], None) == ["only-Q6_K.gguf"]
    with pytest.raises(ModelError, match="no Q5_K_M GGUF: accepted are the quantizations "
                       "F16, Q4_K_M, Q8_0 \\(as o/r:QUANT\\)"):
        select_files("o/r", files, "Q5_K_M")
    with pytest.raises(ModelError, match="no GGUF model file .*README.md"):
        select_files("o/r", ["README.md", "mmproj-F16.gguf"], None)
    with pytest.raises(ModelError, match="ambiguous: it matches m-Q4_K_M.gguf, m-Q4_K_S.gguf"):
        select_files("o/r", ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf"], "Q4_K")
    with pytest.raises(ModelError, match="several GGUF models and no Q4_K_M, so name one: "
                       "accepted are the quantizations Q5_0, Q8_0"):
        select_files("o/r", ["m-Q8_0.gguf", "m-Q5_0.gguf"], None)
    with pytest.raises(ModelError, match="no GGUF file 'nope.gguf': accepted are the files "
                       "big/m-F16-00001-of-00002.gguf, m-Q4_K_M.gguf, m-Q8_0.gguf"):
        select_files("o/r", files, "nope.gguf")
    # an incomplete multi-part set is not a choice
    with pytest.raises(ModelError, match="no F16"):
        select_files("o/r", ["m-F16-00001-of-00002.gguf", "m-Q8_0.gguf"], "F16")


# -- finding models on disk -------------------------------------------------------------------
@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Every place models are looked for points into tmp_path (nothing of the user's)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("SRSD_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    (tmp_path / "models").mkdir()
    return tmp_path


def test_models_are_found_in_every_folder_with_their_metadata(isolated, model_path, capsys):
    models = isolated / "models"
    head = gguf.read_header(model_path).size
    with open(model_path, "rb") as f:  # the real header (and nothing else) of the default
        (models / "copy-of-gemma.gguf").write_bytes(f.read(head))
    (models / "tiny-llama-Q8_0.gguf").write_bytes(tiny_gguf())
    sub = models / "split"
    sub.mkdir()
    part1 = tiny_gguf(arch="qwen2", ftype=2, ctx=32768, chat=False)
    (sub / "big-Q4_0-00001-of-00002.gguf").write_bytes(part1)
    (sub / "big-Q4_0-00002-of-00002.gguf").write_bytes(b"GGUF" + b"\0" * 1000)
    (sub / "broken-00001-of-00003.gguf").write_bytes(tiny_gguf())
    (models / "cut.gguf").write_bytes(tiny_gguf()[:40])
    (models / "mmproj-tiny-F16.gguf").write_bytes(tiny_gguf())  # a projector: not a model
    (models / "notes.txt").write_text("not a model")
    lms = isolated / "home" / ".lmstudio" / "models" / "pub" / "repo"
    lms.mkdir(parents=True)
    (lms / "lms-model-Q6_K.gguf").write_bytes(tiny_gguf(arch="phi3", ftype=18))
    ollama = isolated / "ollama"
    blob_data = tiny_gguf(arch="mistral", ftype=15, ctx=8192)
    digest = "sha256:" + hashlib.sha256(blob_data).hexdigest()
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs" / digest.replace(":", "-")).write_bytes(blob_data)
    man = ollama / "manifests" / "registry.ollama.ai" / "library" / "tinystral" / "latest"
    man.parent.mkdir(parents=True)
    man.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00"},
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest}]}))

    entries = {e.id: e for e in list_models()}
    assert entries["default"].source == "default" and entries["default"].arch == "gemma3"
    copy = entries["copy-of-gemma"]
    assert (copy.quant, copy.arch, copy.context_length, copy.chat_template) == \
        ("Q4_K_M", "gemma3", 32768, False)
    tiny = entries["tiny-llama-Q8_0"]
    assert (tiny.quant, tiny.arch, tiny.context_length, tiny.chat_template, tiny.source) == \
        ("Q8_0", "llama", 4096, True, "SRSD_MODELS_DIR")
    big = entries["big-Q4_0"]
    assert big.parts == 2 and big.size == len(part1) + 1004
    assert big.path.endswith("00001-of-00002.gguf")
    assert (big.arch, big.quant, big.chat_template) == ("qwen2", "Q4_0", False)
    assert "part(s) 2, 3 of 3 are missing" in entries["broken"].problem
    assert "cut short" in entries["cut"].problem
    assert entries["lms-model-Q6_K"].source == "lmstudio"
    assert entries["lms-model-Q6_K"].quant == "Q6_K"
    oll = entries["ollama:tinystral:latest"]
    assert (oll.arch, oll.quant, oll.context_length) == ("mistral", "Q4_K_M", 8192)
    assert not any("mmproj" in e.path or e.path.endswith(".txt") for e in entries.values())
    # the default model's file is listed once, as the default
    assert sum(e.path == entries["default"].path for e in entries.values()) == 1

    # every id is accepted as a model spec
    assert resolve_model("tiny-llama-Q8_0") == models / "tiny-llama-Q8_0.gguf"
    assert resolve_model("big-Q4_0") == sub / "big-Q4_0-00001-of-00002.gguf"
    assert resolve_model("ollama:tinystral:latest").name == digest.replace(":", "-")
    assert resolve_model("lms-model-Q6_K.gguf") == lms / "lms-model-Q6_K.gguf"
    with pytest.raises(ModelError, match="cannot be used: multi-part model broken is incomplete"):
        resolve_model("broken")
    with pytest.raises(ModelError, match="unknown model 'nothing-like-it': accepted are .*"
                       "REPO\\[:QUANT\\|FILE\\]"):
        resolve_model("nothing-like-it")

    from srsd_local.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama-Q8_0" in out and "ollama:tinystral:latest" in out and "not usable:" in out
    assert "llama" in out and "4096" in out
    assert main(["models", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["id"] for r in rows} == set(entries)


def test_a_name_found_twice_is_listed_by_path_and_is_ambiguous(isolated):
    (isolated / "models" / "twin.gguf").write_bytes(tiny_gguf())
    other = isolated / "home" / ".cache" / "lm-studio" / "models" / "p" / "r"
    other.mkdir(parents=True)
    (other / "twin.gguf").write_bytes(tiny_gguf(arch="phi3"))
    ids = [e.id for e in list_models()]
    assert "twin" in ids and str(other / "twin.gguf") in ids
    assert resolve_model("twin") == isolated / "models" / "twin.gguf"  # the id wins
    with pytest.raises(ModelError, match="'twin.gguf' is ambiguous"):
        resolve_model("twin.gguf")


# -- a fake Hugging Face hub ------------------------------------------------------------------
class FakeHub:
    """repos: {repo: {path in repo: bytes or a local Path}}; `cut` holds files whose first
    download is cut off halfway; `log` records (method, path, Range header)."""

    def __init__(self, repos: dict[str, dict[str, bytes | Path]]) -> None:
        self.repos = repos
        self.cut: set[str] = set()
        self.log: list[tuple[str, str, str | None]] = []
        self._sha: dict[tuple[str, str], str] = {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                hub.handle(self, head=False)

            def do_HEAD(self) -> None:
                hub.handle(self, head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def sha(self, repo: str, name: str) -> str:
        key = (repo, name)
        if key not in self._sha:
            data = self.repos[repo][name]
            h = hashlib.sha256()
            if isinstance(data, Path):
                with data.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        h.update(block)
            else:
                h.update(data)
            self._sha[key] = h.hexdigest()
        return self._sha[key]

    @staticmethod
    def size(data: bytes | Path) -> int:
        return data.stat().st_size if isinstance(data, Path) else len(data)

    def _error(self, req: BaseHTTPRequestHandler, code: int, error_code: str) -> None:
        body = json.dumps({"error": error_code}).encode()
        req.send_response(code)
        req.send_header("X-Error-Code", error_code)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        if error_code == "EntryNotFound":
            req.send_header("X-Repo-Commit", COMMIT)
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(body)

    def handle(self, req: BaseHTTPRequestHandler, head: bool) -> None:
        path = req.path.split("?")[0]
        self.log.append((req.command, path, req.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            repo = "/".join(parts[2:4])
            if repo not in self.repos:
                return self._error(req, 404, "RepoNotFound")
            files = self.repos[repo]
            siblings = []
            for name, data in files.items():
                s = {"rfilename": name, "size": self.size(data)}
                if name.endswith(".gguf"):
                    s["lfs"] = {"sha256": self.sha(repo, name), "size": self.size(data),
                                "pointerSize": 134}
                siblings.append(s)
            body = json.dumps({"id": repo, "sha": COMMIT, "siblings": siblings}).encode()
            req.send_response(200)
            req.send_header("Content-Type", "application/json")
            req.send_header("Content-Length", str(len(body)))
            req.end_headers()
            req.wfile.write(body)
            return None
        # /{owner}/{name}/resolve/{revision}/{file...}
        repo, name = "/".join(parts[:2]), "/".join(parts[4:])
        if len(parts) < 5 or parts[2] != "resolve" or repo not in self.repos:
            return self._error(req, 404, "RepoNotFound")
        if name not in self.repos[repo]:
            return self._error(req, 404, "EntryNotFound")
        data = self.repos[repo][name]
        size = self.size(data)
        etag = self.sha(repo, name)
        start = 0
        rng = req.headers.get("Range")
        if rng and not head:
            start = int(rng.split("=")[1].split("-")[0])
        req.send_response(206 if start else 200)
        req.send_header("X-Repo-Commit", COMMIT)
        req.send_header("ETag", f'"{etag}"')
        req.send_header("X-Linked-Etag", f'"{etag}"')
        req.send_header("X-Linked-Size", str(size))
        req.send_header("Accept-Ranges", "bytes")
        req.send_header("Content-Length", str(size - start))
        if start:
            req.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        req.end_headers()
        if head:
            return None
        stop = size
        if (repo, name) in self.cut:  # the first download is cut off halfway
            self.cut.discard((repo, name))
            stop = size // 2
        self._send(req, data, start, stop)
        if stop < size:
            req.wfile.flush()
            req.connection.shutdown(socket.SHUT_RDWR)
            req.close_connection = True
        return None

    @staticmethod
    def _send(req: BaseHTTPRequestHandler, data: bytes | Path, start: int, stop: int) -> None:
        try:
            if isinstance(data, Path):
                with data.open("rb") as f:
                    f.seek(start)
                    left = stop - start
                    while left > 0:
                        block = f.read(min(left, 1 << 20))
                        req.wfile.write(block)
                        left -= len(block)
            else:
                req.wfile.write(data[start:stop])
        except (BrokenPipeError, ConnectionResetError):
            pass


REPO = "test-org/gemma-3-270m-GGUF"


@pytest.fixture
def hub(isolated, model_path, monkeypatch):
    repos: dict[str, dict[str, bytes | Path]] = {
        REPO: {"README.md": b"# test\n", "gemma-3-270m-Q4_K_M.gguf": model_path,
               "gemma-3-270m-Q8_0.gguf": tiny_gguf(arch="gemma3", ftype=7)},
        "test-org/tiny-GGUF": {"tiny-Q4_K_M.gguf": tiny_gguf(ftype=15),
                               "tiny-Q4_K_S.gguf": tiny_gguf(ftype=14),
                               "tiny-Q8_0.gguf": tiny_gguf(ftype=7),
                               "split/tiny-F16-00001-of-00002.gguf": tiny_gguf(ftype=1),
                               "split/tiny-F16-00002-of-00002.gguf": b"GGUF" + b"\1" * 99},
        "test-org/no-gguf": {"README.md": b"# nothing\n", "model.safetensors": b"\0" * 64},
    }
    fake = FakeHub(repos)
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    yield fake
    fake.close()


def _cache(isolated: Path, repo: str) -> Path:
    return isolated / "hf" / ("models--" + repo.replace("/", "--"))


def test_pull_downloads_into_the_hub_cache_and_is_then_used_offline(hub, isolated, model_path,
                                                                   capsys):
    from srsd_local.cli import main

    assert main(["models", "pull", f"{REPO}:Q4_K_M"]) == 0
    out = capsys.readouterr().out.strip()
    snap = _cache(isolated, REPO) / "snapshots" / COMMIT / "gemma-3-270m-Q4_K_M.gguf"
    assert out == str(snap)
    # the standard layout: refs/main -> commit, the snapshot links to a blob named by sha256
    assert (_cache(isolated, REPO) / "refs" / "main").read_text() == COMMIT
    assert snap.is_symlink() and snap.resolve().parent.name == "blobs"
    assert snap.resolve().name == hub.sha(REPO, "gemma-3-270m-Q4_K_M.gguf")
    assert snap.stat().st_size == model_path.stat().st_size
    assert hub.sha(REPO, "gemma-3-270m-Q4_K_M.gguf") == hashlib.sha256(
        snap.read_bytes()).hexdigest()
    # no stray files: README.md was not downloaded, nothing incomplete is left
    assert not list(_cache(isolated, REPO).rglob("README.md"))
    assert not list(_cache(isolated, REPO).rglob("*.incomplete"))

    with pytest.raises(ModelError, match="has not been downloaded: .*`srsd-local models pull "
                       f"{REPO}:Q8_0` downloads it"):
        resolve_model(f"{REPO}:Q8_0", download=False)
    # from now on the spec resolves from the cache without asking the hub
    before = len(hub.log)
    assert resolve_model(f"{REPO}:Q4_K_M", download=False) == snap
    assert resolve_model(f"{REPO}:Q4_K_M") == snap
    assert resolve_model(REPO) == snap  # no quantization: Q4_K_M
    assert resolve_model(f"{REPO}:gemma-3-270m-Q4_K_M.gguf") == snap
    assert len(hub.log) == before
    # and is listed, with its header's metadata, under the id REPO:QUANT
    e = {m.id: m for m in list_models()}[f"{REPO}:Q4_K_M"]
    assert (e.source, e.arch, e.quant, e.path) == ("huggingface", "gemma3", "Q4_K_M", str(snap))
    # another quantization of the same repo is downloaded on first use
    q8 = resolve_model(f"{REPO}:Q8_0")
    assert q8.name == "gemma-3-270m-Q8_0.gguf" and len(hub.log) > before
    # pulling again asks the hub but downloads nothing
    n_get = sum(m == "GET" and "/resolve/" in p for m, p, _ in hub.log)
    assert pull_model(f"{REPO}:Q4_K_M") == snap
    assert sum(m == "GET" and "/resolve/" in p for m, p, _ in hub.log) == n_get


def test_a_cut_download_is_resumed(hub, isolated, model_path):
    name = "gemma-3-270m-Q4_K_M.gguf"
    hub.cut.add((REPO, name))
    path = pull_model(f"{REPO}:{name}")
    gets = [(p, r) for m, p, r in hub.log if m == "GET" and p.endswith(name)]
    size = model_path.stat().st_size
    assert len(gets) == 2 and gets[0][1] is None
    # the second request resumes from what had arrived (whole chunks of the first response)
    resumed_at = int(gets[1][1].removeprefix("bytes=").rstrip("-"))
    assert size // 4 < resumed_at <= size // 2
    assert path.stat().st_size == size
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hub.sha(REPO, name)


def test_multi_part_pull(hub, isolated):
    path = pull_model("test-org/tiny-GGUF:F16")
    assert path.name == "tiny-F16-00001-of-00002.gguf"
    assert (path.parent / "tiny-F16-00002-of-00002.gguf").is_file()
    e = {m.id: m for m in list_models()}["test-org/tiny-GGUF:F16"]
    assert e.parts == 2 and e.size == 99 + 4 + len(tiny_gguf(ftype=1))


def test_hub_errors_say_what_was_wrong_and_what_is_accepted(hub, isolated, monkeypatch):
    with pytest.raises(ModelError, match="repo 'test-org/missing' was not found on http.*"
                       "accepted are public model repos"):
        pull_model("test-org/missing:Q4_K_M")
    with pytest.raises(ModelError, match="repo 'test-org/missing' was not found"):
        resolve_model("test-org/missing")  # anywhere a model is accepted
    with pytest.raises(ModelError, match="has no GGUF model file .*model.safetensors"):
        pull_model("test-org/no-gguf")
    with pytest.raises(ModelError, match="ambiguous: it matches tiny-Q4_K_M.gguf, "
                       "tiny-Q4_K_S.gguf"):
        pull_model("test-org/tiny-GGUF:Q4_K")
    with pytest.raises(ModelError, match="no Q2_K GGUF: accepted are the quantizations F16, "
                       "Q4_K_M, Q4_K_S, Q8_0 \\(as test-org/tiny-GGUF:QUANT\\)"):
        pull_model("test-org/tiny-GGUF:Q2_K")
    with pytest.raises(ModelError, match="not a Hugging Face model spec: accepted are REPO"):
        pull_model("just-a-name")
    import srsd_local.llama.hub as hubmod

    free_space = hubmod._free_space
    monkeypatch.setattr(hubmod, "_free_space", lambda folder: 1000)
    with pytest.raises(ModelError, match="not enough disk space .* it needs 0.00 GB, .* has "
                       "0.00 GB free; free some space, or set HF_HUB_CACHE"):
        pull_model("test-org/tiny-GGUF:Q8_0")
    monkeypatch.setattr(hubmod, "_free_space", free_space)
    # no network: nothing listens on the endpoint
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed}")
    with pytest.raises(ModelError, match="cannot reach .*hub at http://127.0.0.1.*check the "
                       "network"):
        resolve_model("test-org/tiny-GGUF:Q8_0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set"):
        resolve_model("test-org/tiny-GGUF:Q8_0")


def test_a_download_that_does_not_match_its_sha256_is_removed(hub, isolated):
    repo = "test-org/tiny-GGUF"
    hub.sha(repo, "tiny-Q8_0.gguf")  # the listed sha256 is of the original content
    hub.repos[repo]["tiny-Q8_0.gguf"] = tiny_gguf(ftype=7, name="Changed")
    with pytest.raises(ModelError, match="does not match the sha256 the hub lists"):
        pull_model(f"{repo}:Q8_0")
    assert not list((_cache(isolated, repo) / "snapshots").rglob("tiny-Q8_0.gguf"))


@pytest.mark.model
def test_engine_loads_a_hub_spec(hub, isolated, model_path):
    from srsd_local.engine import Engine

    with Engine.load(f"{REPO}:Q4_K_M", n_ctx=512, calibrate=False, adaptive=False) as eng:
        assert Path(eng.model_path).name == "gemma-3-270m-Q4_K_M.gguf"
        assert eng.generate("def add(a, b):", max_tokens=4, mode="ar").stats.tokens == 4


# -- calibration on first use ------------------------------------------------------------------
@pytest.fixture
def fake_engine_loads(monkeypatch, tmp_path):
    """Engine.load on the fake backend (tests/fakes.py), counting backends built."""
    from fakes import FakeBackend

    import srsd_local.engine.calibrate as cal
    import srsd_local.engine.engine as engmod

    built: list[tuple[object, dict]] = []
    plain = {"value": False}

    def backend(path, cfg, capture_layer=None):
        be = FakeBackend(n_ctx=cfg.n_ctx)
        be.n_layer = 12
        be.model_path = str(path)
        be.can_speculate = not plain["value"]
        built.append((capture_layer, {"n_ctx": cfg.n_ctx, "adaptive": cfg.adaptive}))
        return be

    monkeypatch.setattr(engmod, "Backend", backend)
    monkeypatch.setattr(cal, "first_use_prompts", lambda categories=(): [
        SimpleNamespace(prompt="the quick brown fox jumps over the lazy dog the quick brown",
                        max_tokens=24, temperature=0.0, seed=None)])
    monkeypatch.setattr(cal, "FIRST_USE_TOKENS", 16)
    monkeypatch.setenv("SRSD_CACHE_DIR", str(tmp_path / "cache"))
    return SimpleNamespace(built=built, plain=plain)


def _model_file(tmp_path: Path, name: str) -> Path:
    p = tmp_path / name
    p.write_bytes(tiny_gguf())
    return p


def test_a_new_model_is_calibrated_once_on_first_load(fake_engine_loads, tmp_path, capsys):
    from srsd_local.engine import Engine
    from srsd_local.engine.calibrate import load_calibration_file, quick_layers

    model = _model_file(tmp_path, "new-Q8_0.gguf")
    with Engine.load(model, index_backend="numpy", adaptive=False) as eng:
        layer = eng.config.layer
    err = capsys.readouterr().err
    assert "first use of new-Q8_0.gguf" in err and "--no-calibrate" in err
    assert "calibrated new-Q8_0.gguf in" in err and "layer" in err
    stored = load_calibration_file(model)
    assert stored["quick"] is True and stored["layer"] == layer
    assert stored["layer"] in quick_layers(12) and stored["acceptance"]
    n = len(fake_engine_loads.built)
    # probe + one engine per candidate layer + one for top-k/depth + the real load
    assert n == 1 + len(quick_layers(12)) + 1 + 1
    assert all(kw["n_ctx"] == 2048 and not kw["adaptive"] for _, kw in
               fake_engine_loads.built[:-1])
    with Engine.load(model, index_backend="numpy", adaptive=False) as eng:
        assert eng.config.layer == layer
    assert "first use" not in capsys.readouterr().err and len(fake_engine_loads.built) == n + 1


def test_calibration_is_skipped_when_asked_or_settings_are_given(fake_engine_loads, tmp_path,
                                                                 capsys):
    from srsd_local.engine import Engine
    from srsd_local.engine.calibrate import load_calibration_file

    a = _model_file(tmp_path, "a.gguf")
    Engine.load(a, index_backend="numpy", adaptive=False, calibrate=False).close()
    b = _model_file(tmp_path, "b.gguf")
    Engine.load(b, index_backend="numpy", adaptive=False, layer=3, top_k=5,
                draft_depth=8).close()
    assert len(fake_engine_loads.built) == 2
    assert load_calibration_file(a) is None and load_calibration_file(b) is None
    assert "first use" not in capsys.readouterr().err
    # a model that cannot speculate is remembered as such, without a calibration run
    fake_engine_loads.plain["value"] = True
    c = _model_file(tmp_path, "c.gguf")
    Engine.load(c, index_backend="numpy", adaptive=False).close()
    assert load_calibration_file(c)["plain_only"] is True
    assert len(fake_engine_loads.built) == 4  # the probe and the load
    Engine.load(c, index_backend="numpy", adaptive=False).close()
    assert len(fake_engine_loads.built) == 5


def test_the_default_model_uses_its_shipped_calibration(model_path, fake_engine_loads, capsys):
    from srsd_local.engine import Engine
    from srsd_local.engine.calibrate import load_calibration_file

    assert load_calibration_file(model_path)["model"] == model_path.name
    Engine.load(None, index_backend="numpy", adaptive=False).close()
    assert len(fake_engine_loads.built) == 1 and "first use" not in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "x"], ["bench"], ["verify", "--prompt", "x"], ["serve"], ["ui"]])
def test_cli_commands_that_load_models_take_no_calibrate(argv, monkeypatch):
    import srsd_local.cli as cli
    from srsd_local.engine import Engine

    seen = []

    def fake_load(model=None, **kw):
        seen.append(kw.get("calibrate"))
        raise ValueError("stop here")

    monkeypatch.setattr(Engine, "load", staticmethod(fake_load))
    import srsd_local.bench.runner as runner

    monkeypatch.setattr(runner, "main_bench", lambda args, load: load())
    for flag, expected in (([], True), (["--no-calibrate"], False)):
        args = cli.build_parser().parse_args(argv + flag)
        assert args.no_calibrate is (not expected)
        if argv[0] in ("serve", "ui"):
            with pytest.raises(ValueError, match="stop here"):
                cli._loader(args)()
        else:  # the command runs until it loads the model (bench: its loader is called)
            assert cli.main(argv + flag) == 1
        assert seen[-1] is expected
    assert not hasattr(cli.build_parser().parse_args(["calibrate"]), "no_calibrate")


def test_first_use_prompts_come_from_the_calibration_workload():
    from srsd_local.bench.workloads import load_workload
    from srsd_local.engine.calibrate import FIRST_USE_CATEGORIES, first_use_prompts, quick_layers

    prompts = first_use_prompts()
    assert [p.category for p in prompts] == list(FIRST_USE_CATEGORIES)
    calib = {p.id: p for p in load_workload("calibration")}
    for p in prompts:
        assert calib[p.id].prompt == p.prompt and calib[p.id].temperature == 0.0
    assert quick_layers(18) == [4, 5, 8] and quick_layers(2) == [0] and quick_layers(1) == [0]


@pytest.mark.model
def test_a_real_model_seen_first_is_calibrated_briefly(model_path, tmp_path, monkeypatch,
                                                       capsys):
    import srsd_local.engine.calibrate as cal
    from srsd_local.engine import Engine

    monkeypatch.setenv("SRSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cal, "FIRST_USE_CATEGORIES", ("humaneval",))
    monkeypatch.setattr(cal, "FIRST_USE_TOKENS", 8)
    monkeypatch.setattr(cal, "FIRST_USE_LAYERS", (0.25,))
    monkeypatch.setattr(cal, "FIRST_USE_TOP_KS", (5,))
    other = tmp_path / "another-name-Q4_K_M.gguf"  # not the default's name: no shipped one
    try:
        os.link(model_path, other)
    except OSError:
        shutil.copyfile(model_path, other)
    with Engine.load(other, n_ctx=1024) as eng:
        out = eng.generate("def add(a, b):", max_tokens=8)
    err = capsys.readouterr().err
    assert "first use of another-name-Q4_K_M.gguf" in err and "calibrated" in err
    assert "layer 4: " in err  # progress, one line per step
    stored = cal.load_calibration_file(other)
    assert stored["quick"] and stored["layer"] == round(0.25 * 18) and out.stats.tokens == 8

"""Shared fixtures: the real default model, loaded once per test session.

Tests never read or write the user's cache: SRSD_CACHE_DIR points at a temporary folder for
the whole session (servers started as subprocesses inherit it)."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

_CACHE = tempfile.mkdtemp(prefix="srsd-test-cache-")
os.environ["SRSD_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)

from srsd_local.config import SRSDConfig  # noqa: E402  (after SRSD_CACHE_DIR is set)


@pytest.fixture(scope="session")
def model_path():
    from srsd_local.llama.models import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def engine(model_path):
    from srsd_local.engine import Engine

    eng = Engine.load(model_path, n_ctx=4096)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def backend(model_path):
    from srsd_local.llama.backend import Backend

    be = Backend(model_path, SRSDConfig(n_ctx=1024, n_batch=256, n_ubatch=256),
                 capture_layer=4)
    yield be
    be.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cli_server(args: list[str], timeout: float = 240):
    """Start `srsd-local ARGS --port P` and wait until /health answers 200.
    Returns (process, base URL, whether a 503 was seen while loading). The server's output
    goes to a file (`proc.log`), not a pipe that nobody reads and that could fill up."""
    import httpx

    port = free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "srsd_local.cli", *args, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    base = f"http://127.0.0.1:{port}/"
    saw_503 = False
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError("server exited: " + log.read())
        try:
            code = httpx.get(base + "health", timeout=2).status_code
            saw_503 = saw_503 or code == 503
            if code == 200:
                return proc, base, saw_503
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy")


@pytest.fixture(scope="session")
def second_model_dir(model_path, tmp_path_factory):
    """A models folder (for SRSD_MODELS_DIR) holding a copy of the default GGUF under another
    file name: a second model to switch to (the same weights, so the same outputs). A copy,
    not a link: the model list counts a link to a listed file as that file."""
    folder = tmp_path_factory.mktemp("models")
    shutil.copyfile(model_path, folder / f"{SECOND_MODEL}.gguf")
    return folder


SECOND_MODEL = "second-copy"
API_KEY = "test-key"


@pytest.fixture(scope="session")
def api_server(tmp_path_factory):
    """`srsd-local serve` on the default model, shared by the server tests: key API_KEY,
    alias gemma-test, no UI, 2048 tokens of context, a queue of 8."""
    with pytest.MonkeyPatch.context() as mp:  # the server's caches: not the user's
        mp.setenv("SRSD_CACHE_DIR", str(tmp_path_factory.mktemp("srsd-cache")))
        proc, base, saw_503 = start_cli_server(
            ["serve", "--api-key", API_KEY, "--max-queue", "8", "--alias", "gemma-test",
             "--no-ui", "--n-ctx", "2048"])
    yield {"base": base.rstrip("/"), "saw_503": saw_503, "proc": proc, "key": API_KEY}
    proc.terminate()
    proc.wait(timeout=30)

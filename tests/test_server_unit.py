"""Server logic without weights: request validation, loading state, engine on a fake."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from pathlib import Path

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


def test_load_failure_is_reported_without_details_and_not_fatal_in_process():
    secret = "/srv/models/private.gguf"
    told = []

    def load():
        raise ValueError(f"{secret!r} is not a GGUF file (its first bytes are b'TOPS')")

    svc = Service(load, on_load_error=told.append)
    with TestClient(create_app(svc)) as client:
        svc.ready.wait(10)
        h = client.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "error"
        assert secret not in h.text and "TOPS" not in h.text
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                    "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
        assert secret not in r.text and "TOPS" not in r.text
    # the log (the callback: the server prints it and exits) has the path, not the bytes
    assert told and secret in told[0] and "TOPS" not in told[0]


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
              "config", "parallel", "token_text", "tokenize", "apply_chat_template", "submit",
              "tool_style", "placement",
              "stream", "generate", "chat", "reset", "close"}

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


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "application/jsonx"])
def test_generation_bodies_must_be_sent_as_json(api, path, ctype):
    # text/plain and forms are what a web page may post cross-site without a CORS preflight
    client, svc = api
    headers = {"Content-Type": ctype} if ctype else {}
    r = client.post(path, headers=headers, content=b'{"prompt": "ab", "max_tokens": 2}')
    err = _error(r, 415)
    assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    assert (repr(ctype) if ctype else "none") in err["message"]
    assert f'endpoint="{path}",status="415"' in svc.metrics.render().decode()


def test_json_with_charset_and_unknown_fields_and_null_logprobs_are_accepted(api):
    client, _ = api
    r = client.post("/v1/completions", headers={"Content-Type": "Application/JSON; charset=utf-8"},
                    content=b'{"prompt": "the cat the", "max_tokens": 4, "temperature": 0, '
                            b'"logprobs": null, "user": "me", "suffix": null, "echo": false}')
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert r.json()["choices"][0]["logprobs"] is None
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 2,
        "temperature": 0, "logprobs": True, "top_logprobs": 3})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"]) == 2


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
    assert "max_tokens is 1000" in err["message"] and "at most 254" in err["message"]


@pytest.mark.parametrize("max_tokens", [None, 5])
def test_a_prompt_longer_than_the_context_names_the_prompt_and_its_tokens(api, max_tokens):
    client, _ = api
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    err = _error(client.post("/v1/completions", json={"prompt": "ab " * 100, **extra}), 400,
                 "prompt")  # 301 tokens (BOS included), context 256
    assert err["code"] == "context_length_exceeded"
    assert "the prompt is 301 tokens" in err["message"] and "256" in err["message"]
    assert "max_tokens is 0" not in err["message"]
    err = _error(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "ab " * 100}], **extra}), 400, "messages")
    assert "the messages are" in err["message"] and "256 tokens" in err["message"]


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


def _slow_engine(step_s: float = 0.02):
    be = FakeBackend(n_ctx=4096, step_cost=lambda n: step_s)  # 1000 tokens: 20 s
    be.model_path = "/models/fake.gguf"
    return Engine(be, SRSDConfig(index_backend="numpy", mode="ar"))


@contextlib.contextmanager
def live_server(svc: Service, app=None):
    """`svc`'s app (or `app`) served by uvicorn on a free port in a thread: (base URL,
    the uvicorn.Server)."""
    import httpx
    import uvicorn
    from conftest import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app or create_app(svc), port=port,
                                           log_level="warning", timeout_graceful_shutdown=5))
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
        yield base, server
    finally:
        server.should_exit = True
        thread.join(10)


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


LONG = {"prompt": "the cat", "max_tokens": 1000, "temperature": 0}  # greedy: no EOS, 20 s


def test_a_dropped_client_stops_its_generation_through_the_body_middleware():
    import httpx

    svc = Service(_slow_engine, model_id="fake")
    with live_server(svc) as (base, _):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(base + "/v1/completions", json=LONG, timeout=1.0)
        t0 = time.time()
        r = httpx.post(base + "/v1/completions", json={"prompt": "ab", "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200 and time.time() - t0 < 5
        assert 'status="499"} 1.0' in svc.metrics.render().decode()


def test_queue_full_is_429_with_retry_after():
    import httpx

    svc = Service(_slow_engine, model_id="fake", max_queue=1)
    with live_server(svc) as (base, server):
        with cf.ThreadPoolExecutor(2) as ex:
            running = ex.submit(httpx.post, base + "/v1/completions", json=LONG, timeout=30)
            _until(lambda: svc.pool.busy)
            queued = ex.submit(httpx.post, base + "/v1/completions", json=LONG, timeout=30)
            _until(lambda: svc.pool.waiting == 1)
            r = httpx.post(base + "/v1/completions", json=LONG, timeout=30)
            err = _error(r, 429)
            assert err["code"] == "queue_full" and "--max-queue 1" in err["message"]
            assert r.headers["Retry-After"].isdigit() and 1 <= int(r.headers["Retry-After"]) <= 60
            svc.request_shutdown()  # the running and the queued one end now, with 503
            assert running.result().status_code == 503 and queued.result().status_code == 503


def test_shutdown_answers_queued_503_ends_the_running_stream_cleanly_and_exits_fast():
    import httpx

    svc = Service(_slow_engine, model_id="fake", max_queue=4)
    with live_server(svc) as (base, server):
        lines: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", base + "/v1/completions", json={**LONG, "stream": True},
                              timeout=30) as r:
                lines.extend(r.iter_lines())  # raises if the stream is cut

        with cf.ThreadPoolExecutor(3) as ex:
            streaming = ex.submit(stream)
            _until(lambda: len(lines) >= 3)
            queued = [ex.submit(httpx.post, base + "/v1/completions", json=LONG, timeout=30),
                      ex.submit(httpx.post, base + "/v1/chat/completions", timeout=30, json={
                          "messages": [{"role": "user", "content": "x"}], "stream": True})]
            _until(lambda: svc.pool.waiting == 2)
            t0 = time.time()
            svc.request_shutdown()  # what SIGTERM does (app/lifecycle.py), and uvicorn's stop
            server.should_exit = True
            streaming.result(timeout=10)
            for q in queued:
                err = _error(q.result(timeout=10), 503)
                assert err["code"] == "server_shutting_down"
        import json
        data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
        assert data[0]["choices"][0]["text"] and data[-1]["error"]["code"] == \
            "server_shutting_down"
        assert time.time() - t0 < 5


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


# -- bodies: nesting, size while reading, unsupported fields ------------------------------------
def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", '{{"prompt": "hi", "max_tokens": 2, "x": {}}}'),
    ("/v1/chat/completions", '{{"messages": [{{"role": "user", "content": "hi"}}], '
                             '"max_tokens": 2, "x": {}}}'),
])
def test_json_nested_too_deep_is_400_not_a_recursion_error(api, path, body):
    client, _ = api
    h = {"Content-Type": "application/json"}
    deep = body.format(_nested(1000))  # ~2 KB
    assert len(deep) < 2200
    err = _error(client.post(path, content=deep, headers=h), 400)
    assert err["code"] == "nesting_too_deep"
    assert "1001 levels" in err["message"] and "limit is 64" in err["message"]
    for ok in (body.format(_nested(60)), body.replace('"hi"', '"' + "[" * 200 + '"')
               .format("1")):  # deep enough but under the limit; brackets in a string
        assert client.post(path, content=ok, headers=h).status_code == 200
    assert client.get("/health").status_code == 200


def test_json_depth_ignores_strings_and_bounds_invalid_text():
    from srsd_local.app.guard import json_depth

    assert json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'{"a": "[[[{{{\\"]]", "b": "\\"[["}') == 1
    assert json_depth(b'"[[[') == 3  # an unterminated string: counted (a parser fails first)
    assert json_depth(b"[" * 9000) == 9000 and json_depth(b"[]" * 9000) == 1


def test_a_chunked_upload_is_refused_at_the_limit_not_read_to_the_end():
    """No Content-Length: the server counts while reading, answers 413 once past 8 MiB and
    closes the connection instead of reading (and dropping) the rest."""
    import select
    import socket

    svc = Service(_slow_engine, model_id="fake")
    with live_server(svc) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"a" * (1 << 20)
        frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
        sent, answer = 0, b""
        try:
            while sent < 256 << 20:
                if select.select([sock], [], [], 0)[0]:
                    break
                sock.sendall(frame)
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        with contextlib.suppress(ConnectionResetError):
            while part := sock.recv(65536):  # the answer, then the end of the connection
                answer += part
        sock.close()
        assert sent < 48 << 20, f"{sent >> 20} MiB were read before the answer"
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"request_too_large" in answer and b"connection: close" in answer.lower()
        r = httpx_post(base, {"prompt": "ab", "max_tokens": 2})
        assert r.status_code == 200


def httpx_post(base: str, body: dict, **kw):
    import httpx

    return httpx.post(base + "/v1/completions", json=body, timeout=30, **kw)


@pytest.mark.parametrize("field,value,path", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}],
     "/v1/completions"),  # tools need a chat template (tests/test_tools_unit.py: chat)
    ("tool_choice", "required", "/v1/completions"),
    ("functions", [{"name": "f"}], "/v1/completions"),
    ("functions", [{"name": "f"}], "/v1/chat/completions"),
    ("function_call", {"name": "f"}, "/v1/chat/completions"),
])
def test_unsupported_openai_fields_are_refused_not_ignored(api, field, value, path):
    client, _ = api
    body = {"prompt": "ab"} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "ab"}]}
    err = _error(client.post(path, json={**body, field: value, "max_tokens": 2}), 400, field)
    assert err["code"] == "unsupported_parameter" and "not supported yet" in err["message"]
    assert "accepted:" in err["message"]


@pytest.mark.parametrize("extra,param,words", [
    ({"response_format": {"type": "xml"}}, "response_format", "type 'xml' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "schema is required"),
    ({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}, "grammar",
     "give one of"),
    ({"grammar": 3}, "grammar", "GBNF"),
    # a valid constraint on a backend that cannot compile grammars (this fake has no vocab)
    ({"response_format": {"type": "json_object"}}, "response_format", "need a llama.cpp model"),
    ({"grammar": "root ::= \"a\""}, "grammar", "need a llama.cpp model"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_output_constraints_are_400_naming_the_field(api, extra, param, words, path):
    client, _ = api
    body = {"prompt": "ab"} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "ab"}]}
    err = _error(client.post(path, json={**body, **extra, "max_tokens": 2}), 400, param)
    assert words in err["message"]


@pytest.mark.parametrize("extra", [{"response_format": {"type": "text"}}, {"tools": []},
                                   {"tools": None, "tool_choice": "none"},
                                   {"tool_choice": "auto", "response_format": None}])
def test_harmless_values_of_unsupported_fields_are_accepted(api, extra):
    client, _ = api
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "ab"}], "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text


# -- who may call: API key, Host, CORS -----------------------------------------------------------
def _basic(user: str, password: str) -> dict[str, str]:
    import base64

    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_the_api_key_guards_every_path_but_a_minimal_health_the_ui_included():
    from srsd_local.app.main import build_app

    svc = Service(_public_engine, model_id="fake", api_key="k")
    with TestClient(build_app(svc, ui_path="/ui")) as client:
        assert svc.ready.wait(10)
        assert client.get("/health").json() == {"status": "ok", "model": "fake"}
        chat = {"data": ["the cat", [], "", "ar", 0.0, 4, ""]}
        for method, path, body in (("GET", "/metrics", None), ("GET", "/docs", None),
                                   ("GET", "/openapi.json", None), ("GET", "/v1/models", None),
                                   ("GET", "/ui/", None), ("GET", "/ui/config", None),
                                   ("POST", "/ui/gradio_api/call/chat", chat),
                                   ("POST", "/ui/gradio_api/queue/join", chat)):
            for headers in ({}, {"Authorization": "Bearer nope"}, _basic("me", "nope")):
                r = client.request(method, path, json=body, headers=headers)
                err = _error(r, 401)
                assert err["code"] == "invalid_api_key" and "Bearer KEY" in err["message"]
                # a browser asks for the key itself where it may navigate (/ui, /docs)
                scheme = "Bearer" if path.startswith("/v1/") else "Basic"
                assert r.headers["WWW-Authenticate"].startswith(scheme), path
        for auth in ({"Authorization": "Bearer k"}, _basic("anyone", "k")):
            assert client.get("/metrics", headers=auth).status_code == 200
            assert client.get("/openapi.json", headers=auth).json()["paths"]
            assert "swagger" in client.get("/docs", headers=auth).text.lower()
            assert "srsd-local" in client.get("/ui/", headers=auth).text
            assert _ui_chat(client, chat, auth)[0][-1]["role"] == "assistant"
        assert 'endpoint="other",status="401"' in svc.metrics.render().decode()


def _ui_chat(client, chat: dict, headers: dict) -> list:
    """The UI's chat through Gradio's queue (/call, as gradio_client does): its last output."""
    import json

    r = client.post("/ui/gradio_api/call/chat", json=chat, headers=headers)
    assert r.status_code == 200, r.text
    r = client.get(f"/ui/gradio_api/call/chat/{r.json()['event_id']}", headers=headers)
    events = r.text.split("event: ")
    assert events[-1].startswith("complete"), r.text[-500:]
    return json.loads(events[-1].split("data: ", 1)[1])


def test_the_ui_runs_every_event_through_the_queue_so_none_holds_the_engine():
    # a direct /run call used to return the chat's first output and leave its generator, and
    # the engine slot with it, suspended for good: every later request waited forever
    from srsd_local.app.main import build_app

    svc = Service(_public_engine, model_id="fake")
    with TestClient(build_app(svc, ui_path="/ui")) as client:
        assert svc.ready.wait(10)
        chat = {"data": ["the cat", [], "", "ar", 0.0, 4, ""]}
        for route in ("run", "api"):
            assert client.post(f"/ui/gradio_api/{route}/chat", json=chat).status_code == 404
        for _ in range(2):
            assert _ui_chat(client, chat, {})[0][-1]["role"] == "assistant"
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}
                           ).status_code == 200
        # a request's slot goes back once the engine has let go of it (the request's thread
        # closes its events after the last one is sent): soon after the response, not
        # necessarily before it arrives (a held slot would stay held)
        _until(lambda: not svc.pool.busy)


def test_key_matches_bearer_and_basic_password_only():
    from srsd_local.app.guard import key_matches

    assert key_matches("Bearer k", "k") and key_matches("bearer  k ", "k")
    assert key_matches(_basic("", "k")["Authorization"], "k")
    assert key_matches(_basic("u", "p:k")["Authorization"], "p:k")
    assert not key_matches(_basic("k", "")["Authorization"], "k")
    for bad in ("", "k", "Bearer", "Bearer kk", "Basic !!!", "Token k", "Basic " + "a" * 9):
        assert not key_matches(bad, "k"), bad
    assert key_matches("Bearer " + "ключ".encode().decode("latin-1"), "ключ")


def test_allowed_hosts_follow_the_bound_address():
    from srsd_local.app.guard import allowed_hosts, host_name

    local = {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts("127.0.0.1") == local
    assert allowed_hosts("::1", ["My.Box"]) == local | {"my.box"}
    assert allowed_hosts("192.168.1.5") == local | {"192.168.1.5"}
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("::") is None  # any Host
    assert allowed_hosts("0.0.0.0", ["box.lan"]) == local | {"box.lan", "0.0.0.0"}
    assert [host_name(h) for h in ("LocalHost:8000", "[::1]:80", "[::1]", "a.b.", "x")] == \
        ["localhost", "::1", "::1", "a.b", "x"]


def test_host_header_must_name_the_server_and_cors_only_for_given_origins():
    svc = Service(_public_engine, model_id="fake")
    app = create_app(svc, allowed_hosts=allowed_for_test(), cors_origins=["http://ok.test"])
    body = {"prompt": "the cat", "max_tokens": 2}
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        assert svc.ready.wait(10)
        for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "box.lan"):
            r = client.post("/v1/completions", json=body, headers={"Host": host})
            assert r.status_code == 200, (host, r.text)
        for host in ("evil.test", "evil.test:8000", "127.0.0.1.evil.test", "localhost.evil"):
            for path in ("/v1/completions", "/health"):
                r = client.post(path, json=body, headers={"Host": host}) if path != "/health" \
                    else client.get(path, headers={"Host": host})
                err = _error(r, 400)
                assert err["code"] == "host_not_allowed" and "--allowed-host" in err["message"]
        pre = {"Origin": "http://ok.test", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "content-type, authorization"}
        r = client.options("/v1/completions", headers=pre)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://ok.test"
        r = client.post("/v1/completions", json=body, headers={"Origin": "http://ok.test"})
        assert r.headers["access-control-allow-origin"] == "http://ok.test"
        r = client.options("/v1/completions", headers={**pre, "Origin": "http://evil.test"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = client.post("/v1/completions", json=body, headers={"Origin": "http://evil.test"})
        assert "access-control-allow-origin" not in r.headers


def allowed_for_test():
    from srsd_local.app.guard import allowed_hosts

    return allowed_hosts("127.0.0.1", ["box.lan"])


def test_cli_serve_and_ui_take_the_http_options():
    from srsd_local.cli import build_parser

    for cmd in ("serve", "ui"):
        a = build_parser().parse_args([cmd, "--allowed-host", "a.lan", "--allowed-host", "b",
                                       "--cors-origin", "http://x", "--api-key", "k"])
        assert (a.allowed_host, a.cors_origin, a.api_key) == (["a.lan", "b"], ["http://x"], "k")
        assert a.max_models == 1
        assert build_parser().parse_args([cmd, "--max-models", "3"]).max_models == 3


def test_max_models_below_1_stops_serve_with_a_message(capsys):
    from srsd_local.cli import main

    assert main(["serve", "--no-ui", "--max-models", "0", "--port", "1"]) == 1
    err = capsys.readouterr().err
    assert "--max-models 0" in err and "accepted is an integer >= 1" in err


# -- startup: a bad model file fails fast, never echoing the file ---------------------------------
SECRET = "TOP-SECRET-CONTENT"


@pytest.mark.parametrize("kind", ["text", "directory", "short header", "version"])
def test_a_bad_model_path_stops_serve_before_it_listens(tmp_path, capsys, kind):
    import struct

    from srsd_local.cli import main

    path = tmp_path / "model.gguf"
    if kind == "text":
        path.write_text(SECRET + "\n" * 100)
    elif kind == "directory":
        path.mkdir()
    elif kind == "short header":
        path.write_bytes(b"GGUF" + SECRET.encode()[:10])
    elif kind == "version":
        path.write_bytes(struct.pack("<4sIQQ", b"GGUF", 99, 1, 1) + SECRET.encode())
    t0 = time.time()
    assert main(["serve", "--model", str(path), "--port", "1"]) == 1  # port 1: never bound
    err = capsys.readouterr().err
    assert err.startswith("srsd-local: error: ") and str(path) in err, err
    assert SECRET[:4] not in err and time.time() - t0 < 5
    assert ("GGUF" in err) == (kind in ("text", "short header", "version"))
    assert main(["ui", "--model", str(path), "--port", "1"]) == 1


def test_a_missing_model_file_stops_the_server_with_status_1(tmp_path, capsys):
    from srsd_local.cli import main

    path = tmp_path / "nowhere.gguf"  # not a path yet: left to the loader, whose error stops
    t0 = time.time()
    assert main(["serve", "--no-ui", "--model", str(path), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "could not be loaded" in err and str(path) in err and "not found" in err, err
    assert time.time() - t0 < 30


def test_a_model_that_fails_to_load_stops_the_server_with_status_1(capsys):
    from srsd_local.app.main import serve
    from srsd_local.cli import build_parser

    args = build_parser().parse_args(["serve", "--no-ui", "--port", "0"])

    def load():
        time.sleep(0.3)  # after the server listens, as a real load fails
        raise ValueError(f"llama.cpp could not load the model; first bytes b'{SECRET}'")

    t0 = time.time()
    with pytest.raises(RuntimeError, match="could not be loaded: llama.cpp could not") as exc:
        serve(args, load)
    assert SECRET not in str(exc.value) and time.time() - t0 < 5


# -- an engine error is a 500 (a stream says it), and the engine starts clean after it ----------
class FailingOnce(PublicOnly):
    """The public engine, whose next generation fails at its second step (once)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.fail, self.resets = True, 0

    def submit(self, *args, **kwargs):
        events = self._engine.submit(*args, **kwargs)  # argument errors raised here

        def failing():
            with contextlib.closing(events):
                for i, ev in enumerate(events):
                    if i == 1 and self.fail:
                        self.fail = False
                        raise RuntimeError("llama_decode failed")
                    yield ev

        return failing()

    def reset(self) -> None:
        self._engine.reset()  # raises while a request is still leaving the engine
        self.resets += 1


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_error_is_a_500_and_the_engine_is_reset_for_the_next_request(stream):
    import json

    svc = Service(lambda: FailingOnce(_public_engine()._engine), model_id="fake")
    with TestClient(create_app(svc), raise_server_exceptions=False) as client:
        assert svc.ready.wait(10)
        body = {"prompt": "the cat the", "max_tokens": 8, "temperature": 0, "stream": stream}
        r = client.post("/v1/completions", json=body)
        if stream:  # the error is the stream's last event: a clean end, not a cut
            assert r.status_code == 200
            last = json.loads([ln for ln in r.text.splitlines() if ln.startswith("data: ")
                               ][-1][6:])
            assert last["error"]["code"] == "internal_error" and "[DONE]" not in r.text
        else:
            err = _error(r, 500)
            assert err["type"] == "server_error" and "RuntimeError" in err["message"]
        r = client.post("/v1/completions", json={**body, "stream": False})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert svc.engine.resets == 1


# -- parallel serving: up to engine.parallel requests at once, the rest queued -------------------
def _parallel_engine(parallel: int = 2, step_s: float = 0.02):
    be = ChatFakeBackend(n_ctx=512 * parallel, step_cost=lambda n: step_s)
    be.model_path = "/models/fake.gguf"
    return PublicOnly(Engine(be, SRSDConfig(index_backend="numpy", mode="ar",
                                            parallel=parallel)))


class SubmitOnly(PublicOnly):
    """The public engine, where generating other than through `submit` fails the test."""

    PUBLIC = PublicOnly.PUBLIC - {"stream", "generate", "chat"}


def test_three_requests_with_parallel_2_overlap_and_the_third_waits():
    import json

    import httpx

    svc = Service(lambda: SubmitOnly(_parallel_engine(2)._engine), model_id="fake")
    prompts = ["the cat sat", "a b c d", "xyz xyz"]
    times: dict[int, list[float]] = {}
    texts: dict[int, str] = {}

    def stream(i: int, base: str) -> None:
        body = {"prompt": prompts[i], "max_tokens": 30, "temperature": 0, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            parts = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.setdefault(i, []).append(time.monotonic())
                    parts.append(json.loads(line[6:])["choices"][0]["text"])
            texts[i] = "".join(parts)

    with live_server(svc) as (base, _):
        with cf.ThreadPoolExecutor(3) as ex:
            futs = [ex.submit(stream, 0, base)]
            _until(lambda: svc.pool.slots_busy == 1)
            futs.append(ex.submit(stream, 1, base))
            _until(lambda: svc.pool.slots_busy == 2)
            futs.append(ex.submit(stream, 2, base))
            _until(lambda: svc.pool.waiting == 1)
            m = _scrape(httpx.get(base + "/metrics").text)
            assert (m["srsd_slots_busy"], m["srsd_slots_total"], m["srsd_requests_waiting"]) \
                == (2, 2, 1)
            for f in futs:
                f.result(timeout=60)
        sequential = [httpx.post(base + "/v1/completions", timeout=60, json={
            "prompt": p, "max_tokens": 30, "temperature": 0}).json()["choices"][0]["text"]
            for p in prompts]
        m = _scrape(httpx.get(base + "/metrics").text)
        assert (m["srsd_slots_busy"], m["srsd_requests_waiting"]) == (0, 0)
    first_end = min(times[0][-1], times[1][-1])
    # the first two generate side by side; the third starts once one of them has finished
    assert times[0][0] < times[1][-1] and times[1][0] < times[0][-1]
    assert times[1][0] < first_end and times[2][0] >= first_end
    assert [texts[i] for i in range(3)] == sequential


def test_parallel_generations_are_cancelled_one_by_one_and_the_others_continue():
    import httpx

    svc = Service(lambda: _parallel_engine(2), model_id="fake")
    with live_server(svc) as (base, _):
        with cf.ThreadPoolExecutor(2) as ex:
            kept = ex.submit(httpx.post, base + "/v1/completions", timeout=60,
                             json={"prompt": "the cat", "max_tokens": 60, "temperature": 0})
            _until(lambda: svc.pool.slots_busy == 1)
            with pytest.raises(httpx.TimeoutException):  # dropped: its slot frees at once
                httpx.post(base + "/v1/completions", timeout=0.5, json={
                    "prompt": "a b", "max_tokens": 400, "temperature": 0})  # 8 s
            _until(lambda: svc.pool.slots_busy == 1, timeout=2)
            r = kept.result(timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 60
        assert 'status="499"} 1.0' in svc.metrics.render().decode()


def test_shutdown_with_parallel_2_ends_both_running_streams_and_answers_the_queued_503():
    import json

    import httpx

    svc = Service(lambda: _parallel_engine(2), model_id="fake", max_queue=4)
    with live_server(svc) as (base, server):
        lines: dict[int, list[str]] = {0: [], 1: []}

        def stream(i: int) -> None:
            with httpx.stream("POST", base + "/v1/completions", timeout=30, json={
                    "prompt": "the cat", "max_tokens": 400, "temperature": 0,
                    "stream": True}) as r:
                lines[i].extend(r.iter_lines())  # raises if the stream is cut

        with cf.ThreadPoolExecutor(3) as ex:
            streams = [ex.submit(stream, i) for i in range(2)]
            _until(lambda: all(len(v) >= 3 for v in lines.values()))
            queued = ex.submit(httpx.post, base + "/v1/completions", timeout=30,
                               json={"prompt": "ab", "max_tokens": 4})
            _until(lambda: svc.pool.waiting == 1)
            t0 = time.time()
            svc.request_shutdown()
            server.should_exit = True
            for f in streams:
                f.result(timeout=10)
            err = _error(queued.result(timeout=10), 503)
            assert err["code"] == "server_shutting_down"
        for v in lines.values():
            data = [json.loads(ln[6:]) for ln in v if ln.startswith("data: ")]
            assert data[0]["choices"][0]["text"] and \
                data[-1]["error"]["code"] == "server_shutting_down"
        assert time.time() - t0 < 5


def test_with_parallel_2_an_engine_error_resets_the_engine_once_its_requests_are_done():
    svc = Service(lambda: FailingOnce(_parallel_engine(2, step_s=0.0)._engine),
                  model_id="fake")
    with TestClient(create_app(svc), raise_server_exceptions=False) as client:
        assert svc.ready.wait(10)
        body = {"prompt": "the cat the", "max_tokens": 8, "temperature": 0}
        _error(client.post("/v1/completions", json=body), 500)
        _until(lambda: svc.engine.resets == 1 and not svc.pool.busy)
        with cf.ThreadPoolExecutor(2) as ex:
            rs = list(ex.map(lambda _: client.post("/v1/completions", json=body), range(2)))
        assert [r.status_code for r in rs] == [200, 200]
        assert rs[0].json()["choices"][0]["text"] == rs[1].json()["choices"][0]["text"]
        assert svc.engine.resets == 1


# -- logprobs ------------------------------------------------------------------------------------
def _sse(r) -> list[dict]:
    import json

    return [json.loads(ln[6:]) for ln in r.iter_lines()
            if ln.startswith("data: ") and ln != "data: [DONE]"]


def test_completion_logprobs_have_openai_legacy_shape(api):
    client, _ = api
    prompt = "the cat the"
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    n = r.json()["usage"]["completion_tokens"]
    assert n == 6 and all(len(lp[k]) == n for k in lp)
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == len(prompt)
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:],
                                                    lp["tokens"]))
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert val <= 0 and 1 <= len(top) <= 3 and top[tok] == val  # the sampled one is there
        assert max(top.values()) == val  # greedy: the most likely token
    # streamed: each chunk carries its tokens' logprobs, together the same
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = _sse(s)
    got = {k: [x for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for x in c["choices"][0]["logprobs"][k]] for k in lp}
    assert got == lp
    # off: null, as OpenAI
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.json()["choices"][0]["logprobs"] is None
    r = client.post("/v1/completions", json={**body, "logprobs": 0})
    assert all(len(t) == 1 for t in r.json()["choices"][0]["logprobs"]["top_logprobs"])


def test_chat_logprobs_have_openai_shape_streamed_too(api):
    client, _ = api
    body = {"messages": [{"role": "user", "content": "the cat the"}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 3}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"] == 6
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    for c in content:
        assert set(c) == {"token", "logprob", "bytes", "top_logprobs"}
        assert c["bytes"] == list(c["token"].encode()) and c["logprob"] <= 0
        assert len(c["top_logprobs"]) == 3
        assert all(set(t) == {"token", "logprob", "bytes"} for t in c["top_logprobs"])
        assert c["top_logprobs"][0]["token"] == c["token"]  # greedy
        assert c["top_logprobs"][0]["logprob"] == c["logprob"]
        lps = [t["logprob"] for t in c["top_logprobs"]]
        assert lps == sorted(lps, reverse=True)
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = _sse(s)
    streamed = [x for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
                for x in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    r = client.post("/v1/chat/completions", json={**body, "top_logprobs": None})
    assert all(c["top_logprobs"] == [] for c in r.json()["choices"][0]["logprobs"]["content"])
    r = client.post("/v1/chat/completions", json={**body, "logprobs": False,
                                                  "top_logprobs": None})
    assert r.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path,extra,param,words", [
    ("/v1/completions", {"logprobs": 21}, "logprobs", "0..20"),
    ("/v1/completions", {"logprobs": -1}, "logprobs", "0..20"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "0..20"),
    ("/v1/completions", {"logprobs": "5"}, "logprobs", "0..20"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs", "true or false"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0..20"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 1.5}, "top_logprobs",
     "0..20"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", '"logprobs": true'),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0}, "top_logprobs",
     '"logprobs": true'),
])
def test_bad_logprobs_are_400_naming_the_field(api, path, extra, param, words):
    client, _ = api
    body = {"prompt": "ab"} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "ab"}]}
    err = _error(client.post(path, json={**body, "max_tokens": 2, **extra}), 400, param)
    assert words in err["message"] and "accepted" in err["message"]


# -- models: listing and switching per request ---------------------------------------------------
class Entry:
    def __init__(self, id_: str, path: str, problem: str | None = None) -> None:
        self.id, self.path, self.problem = id_, path, problem


class Models:
    """A machine with models a, b, c (fake engines), one that fails to load and one whose
    files are incomplete; it counts loads and closes."""

    CATALOG = [Entry("a", "/models/a.gguf"), Entry("b", "/models/b.gguf"),
               Entry("c", "/models/c.gguf"), Entry("bad", "/models/bad.gguf"),
               Entry("broken", "/models/broken.gguf", problem="part 2 of 2 is missing")]

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.loads: list[tuple[str, float]] = []
        self.closed: list[str] = []

    def engine(self, path: str):
        if "bad" in str(path):
            raise ValueError(f"llama.cpp could not load {path}: b'SECRET'")
        be = ChatFakeBackend(n_ctx=256, step_cost=(lambda n: self.step_s)
                             if self.step_s else None)
        be.model_path = str(path)
        models = self

        class Tracked(PublicOnly):
            def close(self) -> None:
                models.closed.append(Path(self._engine.model_path).stem)
                self._engine.close()

        self.loads.append((Path(path).stem, time.monotonic()))
        return Tracked(Engine(be, SRSDConfig(index_backend="numpy", mode="ar")))

    def resolve(self, name: str):
        for e in self.CATALOG:
            if name in (e.id, Path(e.path).name):
                return Path(e.path)
        raise ValueError(f"unknown model {name!r}")

    def service(self, **kw) -> Service:
        return Service(lambda: self.engine("/models/a.gguf"), load_model=self.engine,
                       list_models=lambda: list(self.CATALOG), resolve=self.resolve, **kw)


def _models(client) -> list[tuple[str, bool]]:
    return [(m["id"], m["loaded"]) for m in client.get("/v1/models").json()["data"]]


def _ask(client, model: str | None, path: str = "/v1/completions"):
    body = {"prompt": "the cat the", "max_tokens": 4, "temperature": 0}
    if path != "/v1/completions":
        body = {"messages": [{"role": "user", "content": "the cat the"}], "max_tokens": 4}
    return client.post(path, json={**body, **({"model": model} if model is not None else {})})


def test_models_are_listed_and_a_request_naming_one_loads_it():
    m = Models()
    svc = m.service(model_id="alias-a")
    with TestClient(create_app(svc)) as client:
        assert svc.ready.wait(10)
        # the loaded model under its alias, then the others found; unusable ones left out
        assert _models(client) == [("alias-a", True), ("b", False), ("c", False),
                                   ("bad", False)]
        r = _ask(client, "b")
        assert r.status_code == 200 and r.json()["model"] == "b"
        assert _models(client) == [("b", True), ("alias-a", False), ("c", False),
                                   ("bad", False)]
        assert client.get("/health").json() == {"status": "ok", "model": "b"}
        assert m.closed == ["a"]  # one resident at a time (--max-models 1)
        r = _ask(client, None, "/v1/chat/completions")  # no model: the current one
        assert r.status_code == 200 and r.json()["model"] == "b"
        r = _ask(client, "alias-a")  # the alias still names the first model
        assert r.status_code == 200 and r.json()["model"] == "alias-a"
        r = _ask(client, "b.gguf")  # a file name works too
        assert r.status_code == 200 and r.json()["model"] == "b"
        assert [name for name, _ in m.loads] == ["a", "b", "a", "b"]


def test_a_model_that_fails_to_load_is_a_503_and_the_previous_one_keeps_serving(caplog):
    m = Models()
    svc = m.service(model_id="alias-a")
    with TestClient(create_app(svc)) as client:
        assert svc.ready.wait(10)
        err = _error(_ask(client, "bad"), 503, "model")
        assert err["code"] == "model_load_failed" and "'bad' could not be loaded" in \
            err["message"] and "'alias-a' keeps serving" in err["message"]
        assert "SECRET" not in err["message"] and "/models" not in err["message"]
        r = _ask(client, None)
        assert r.status_code == 200 and r.json()["model"] == "alias-a"
        assert m.closed == [] and client.get("/health").json()["model"] == "alias-a"
    assert "SECRET" not in caplog.text  # the log says why, without the file's bytes


@pytest.mark.parametrize("name", ["gpt-17", "broken", "/models/b.gguf", "~/b.gguf", "../b",
                                  "./b.gguf", ""])
def test_unknown_unusable_and_path_models_are_404(name):
    m = Models()
    svc = m.service()
    with TestClient(create_app(svc)) as client:
        assert svc.ready.wait(10)
        err = _error(_ask(client, name), 404, "model")
        assert err["code"] == "model_not_found" and "GET /v1/models" in err["message"]
        assert [n for n, _ in m.loads] == ["a"]


def test_max_models_keeps_several_resident_and_evicts_the_least_recently_used():
    m = Models()
    svc = m.service(max_models=2)
    with TestClient(create_app(svc)) as client:
        assert svc.ready.wait(10)
        assert _ask(client, "b").json()["model"] == "b"
        assert _ask(client, "a").json()["model"] == "a"  # still resident: no load
        assert [n for n, _ in m.loads] == ["a", "b"] and m.closed == []
        # the current model (loaded last: b) first; a request naming a resident model
        # does not change which one requests without a model go to
        assert [x for x in _models(client) if x[1]] == [("b", True), ("a", True)]
        assert _ask(client, None).json()["model"] == "b"
        assert _ask(client, "a").json()["model"] == "a"
        assert _ask(client, "c").json()["model"] == "c"  # b was used least recently
        assert m.closed == ["b"]
        assert sorted(x[0] for x in _models(client) if x[1]) == ["a", "c"]
        m_ = _scrape(svc.metrics.render().decode())
        assert m_["srsd_slots_total"] == 2 and m_["srsd_slots_busy"] == 0
    with pytest.raises(ValueError, match="--max-models 0"):
        m.service(max_models=0)


def test_a_model_load_waits_for_the_running_requests_like_a_generation():
    import httpx

    m = Models(step_s=0.02)
    svc = m.service(max_queue=4)
    with live_server(svc) as (base, _):
        with cf.ThreadPoolExecutor(3) as ex:
            running = ex.submit(httpx.post, base + "/v1/completions", timeout=60,
                                json={"prompt": "the cat", "max_tokens": 40, "temperature": 0})
            _until(lambda: svc.pool.slots_busy == 1)
            switch = ex.submit(httpx.post, base + "/v1/completions", timeout=60,
                               json={"prompt": "the cat", "max_tokens": 2, "model": "b"})
            _until(lambda: svc.pool.waiting == 1)
            after = ex.submit(httpx.post, base + "/v1/completions", timeout=60,
                              json={"prompt": "the cat", "max_tokens": 2})  # current: b then
            _until(lambda: svc.pool.waiting == 2)
            r = running.result(timeout=60)
            ended = time.monotonic()
            assert r.status_code == 200 and r.json()["model"] == "a"
            assert switch.result(timeout=60).json()["model"] == "b"
            assert after.result(timeout=60).json()["model"] == "b"
    assert [n for n, _ in m.loads] == ["a", "b"] and m.loads[1][1] <= ended + 0.5
    assert m.loads[1][1] > ended - 0.2, "b was loaded while a request on a was running"


def test_the_ui_picker_lists_and_switches_models():
    import json

    from srsd_local.app.main import build_app

    m = Models()
    svc = m.service()
    with TestClient(build_app(svc, ui_path="/ui")) as client:
        assert svc.ready.wait(10)

        def call(route: str, data: list) -> list:
            r = client.post(f"/ui/gradio_api/call/{route}", json={"data": data})
            assert r.status_code == 200, r.text
            r = client.get(f"/ui/gradio_api/call/{route}/{r.json()['event_id']}")
            events = r.text.split("event: ")
            assert events[-1].startswith("complete"), r.text[-500:]
            return json.loads(events[-1].split("data: ", 1)[1])

        picker = call("models", [])[0]
        choices = [c[0] if isinstance(c, list) else c for c in picker["choices"]]
        assert choices == ["a", "b", "c", "bad"] and picker["value"] == "a"
        status = call("switch_model", ["b"])[0]
        assert "Loaded b" in status and svc.model_id == "b"
        assert _ui_chat(client, {"data": ["the cat", [], "", "ar", 0.0, 4, ""]}, {}
                        )[0][-1]["role"] == "assistant"
        r = client.post("/ui/gradio_api/call/switch_model", json={"data": ["bad"]})
        r = client.get(f"/ui/gradio_api/call/switch_model/{r.json()['event_id']}")
        assert "could not be loaded" in r.text and svc.model_id == "b"

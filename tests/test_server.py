"""The OpenAI-compatible server, run for real on loopback with the default model and driven
with the official `openai` client (and raw HTTP for malformed requests)."""

from __future__ import annotations

import concurrent.futures as cf
import re
import time

import httpx
import pytest
from conftest import API_KEY, SECOND_MODEL, start_cli_server

pytestmark = pytest.mark.model

KEY = API_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}
AR = {"srsd": {"mode": "ar"}}  # plain decoding: batch shapes repeat, so outputs are exact
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"


@pytest.fixture(scope="module")
def server(api_server):
    return api_server  # conftest: one server for these tests and tests/test_server_fuzz.py


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server["base"] + "/metrics", headers=AUTH).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_health_and_models(server, client):
    assert httpx.get(server["base"] + "/health").json()["status"] == "ok"
    models = client.models.list().data
    ids = [m.id for m in models]
    # the loaded model under its alias, first; the same file is not listed again (as
    # "default"); any other model found on this machine follows, not loaded
    assert ids[0] == "gemma-test" and ids.count("gemma-test") == 1 and "default" not in ids
    assert models[0].model_extra["loaded"] is True
    assert not any(m.model_extra["loaded"] for m in models[1:])


def test_openapi_documents_the_request_bodies(server):
    assert httpx.get(server["base"] + "/openapi.json").status_code == 401  # behind the key
    spec = httpx.get(server["base"] + "/openapi.json", headers=AUTH).json()
    schemas = spec["components"]["schemas"]
    for path, field in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        schema = schemas[body["schema"]["$ref"].rsplit("/", 1)[1]]
        assert field in schema["required"]
        assert {"max_tokens", "temperature", "stop", "stream", "srsd"} <= set(schema["properties"])
    assert "/ui" not in spec["paths"]  # --no-ui
    assert httpx.get(server["base"] + "/ui/", headers=AUTH).status_code == 404


def test_completion_matches_engine_and_usage_matches_tokenizer(client, engine):
    res = client.completions.create(model="gemma-test", prompt=PROMPT, max_tokens=40,
                                    temperature=0, extra_body=AR)
    ref = engine.generate(PROMPT, max_tokens=40, mode="ar")
    assert res.choices[0].text == ref.text
    assert res.choices[0].finish_reason == ref.finish_reason
    assert res.usage.prompt_tokens == len(engine.tokenize(PROMPT))
    assert res.usage.completion_tokens == len(ref.token_ids)
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens
    t = res.model_extra["timings"]
    assert t["predicted_n"] == res.usage.completion_tokens and t["predicted_per_second"] > 0
    assert t["draft_n"] >= t["draft_n_accepted"] >= 0 and t["mean_accepted_length"] >= 1


def _verified(engine, prompt: str, text: str) -> None:
    """`text`, a greedy output of `prompt` from the server, is plain decoding's at every
    position up to the rounding noise measured in the same check (`verify_output`)."""
    ids = engine.tokenize(text, add_bos=False)  # the server answers text, not token ids
    rep = engine.verify_output(prompt, ids)
    assert rep.ok, rep.summary()


def test_speculative_completion_equals_plain_decoding_up_to_ties(client, engine):
    res = client.completions.create(model="gemma-test", prompt=PROMPT, max_tokens=40,
                                    temperature=0)
    assert res.model_extra["timings"]["mode"] == "srsd"
    _verified(engine, PROMPT, res.choices[0].text)


def test_greedy_chat_logprobs_name_the_chosen_token_first(client, engine):
    msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    res = client.chat.completions.create(model="gemma-test", messages=msgs, max_tokens=24,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens > 0
    assert "".join(c.token for c in content) == res.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token, (c.token, c.top_logprobs)
        assert abs(c.top_logprobs[0].logprob - c.logprob) < 1e-6
        assert c.bytes == list(c.token.encode())
    # the legacy completions shape, streamed
    chunks = list(client.completions.create(model="gemma-test", prompt=PROMPT, max_tokens=12,
                                            temperature=0, logprobs=2, stream=True))
    lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    tokens = [t for lp in lps for t in lp.tokens]
    assert len(tokens) == 12 and "".join(tokens) == "".join(c.choices[0].text for c in chunks)
    assert [o for lp in lps for o in lp.text_offset][0] == len(PROMPT)
    for lp in lps:
        for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert val <= 0 and top[tok] == val and max(top.values()) == val


def test_streamed_completion_equals_non_streamed(client):
    kw = dict(model="gemma-test", prompt=PROMPT, max_tokens=40, temperature=0, extra_body=AR)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_streamed_and_not(client, engine):
    msgs = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Write a function that adds two numbers."}]
    res = client.chat.completions.create(model="gemma-test", messages=msgs, max_tokens=30,
                                         temperature=0, stop=["\n\n\n"], extra_body=AR)
    ref = engine.chat(msgs, max_tokens=30, stop=["\n\n\n"], mode="ar")
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == ref.text
    assert res.usage.prompt_tokens == len(engine.tokenize(engine.apply_chat_template(msgs)))
    stream = client.chat.completions.create(model="gemma-test", messages=msgs, max_tokens=30,
                                            temperature=0, stop=["\n\n\n"], stream=True,
                                            extra_body=AR)
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == ref.text
    assert parts[-1].choices[0].finish_reason == ref.finish_reason


def test_mode_extension_and_plain_mode_agree(client):
    kw = dict(model="gemma-test", prompt=PROMPT, max_tokens=30, temperature=0)
    a = client.completions.create(extra_body={"srsd": {"mode": "ar"}}, **kw)
    assert a.model_extra["timings"]["mode"] == "ar"
    assert a.model_extra["timings"]["draft_n"] == 0
    b = client.completions.create(extra_body={"srsd": {"mode": "hybrid"}}, **kw)
    assert b.model_extra["timings"]["mode"] == "hybrid"
    assert b.usage.completion_tokens == a.usage.completion_tokens


BAD = [
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "srsd": {"mode": "warp"}}, 400, "srsd.mode"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ("/v1/completions", {"prompt": "x " * 3000, "max_tokens": 100}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x " * 3000}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 3000}]}, 400,
     "messages"),
    ("/v1/completions", {"prompt": "x " * 1000, "max_tokens": 1500}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_requests_get_openai_errors_and_server_keeps_serving(server, path, body, status,
                                                                 param):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server["base"] + path, json=body, headers=h, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if "x " * 1000 in str(body) or body.get("max_tokens") == 100000:
        assert err["code"] == "context_length_exceeded" and "2048" in err["message"]
        if param in ("prompt", "messages"):  # the prompt alone is too long: its count
            assert re.search(r"(is|are) \d{4} tokens", err["message"]), err["message"]
            assert "max_tokens is" not in err["message"]
    ok = httpx.post(server["base"] + "/v1/completions", headers=h, timeout=60,
                    json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200


def test_malformed_body_auth_and_size(server):
    base = server["base"]
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(base + "/v1/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", content=b"[1, 2]", headers=h)
    assert r.status_code == 400
    r = httpx.post(base + "/v1/completions", json={"prompt": "x"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(base + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401
    r = httpx.get(base + "/v1/models")
    assert r.status_code == 401
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    r = httpx.post(base + "/v1/completions", content=big, headers=h, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(base + "/health").status_code == 200


def test_cross_site_and_rebinding_requests_are_refused(server):
    """What a web page can make a browser send: text/plain or a form (no CORS preflight),
    or any body to a name that resolves to 127.0.0.1 (DNS rebinding)."""
    base = server["base"]
    body = b'{"prompt": "Hello", "max_tokens": 2}'
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        r = httpx.post(base + "/v1/completions", content=body,
                       headers={**AUTH, "Content-Type": ctype})
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", content=body, headers={
        **AUTH, "Content-Type": "application/json", "Host": "attacker.example:8000"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
    r = httpx.post(base + "/v1/completions", content=body, headers={
        **AUTH, "Content-Type": "application/json", "Host": "localhost"})
    assert r.status_code == 200


def test_deep_json_is_400_and_only_health_is_open(server):
    base = server["base"]
    deep = '{"prompt": "hi", "max_tokens": 2, "x": ' + "[" * 1000 + "]" * 1000 + "}"
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(base + path, content=deep,
                       headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "nesting_too_deep"
    for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
        assert httpx.get(base + path).status_code == 401, path
    assert httpx.get(base + "/health").json() == {"status": "ok", "model": "gemma-test"}
    devices = httpx.get(base + "/health", headers=AUTH).json()["devices"]  # with the key
    assert devices == [{"device": "CPU", "description": "this machine's CPU", "where": "local",
                        "layers": "all"}]


def test_dropped_stream_does_not_block_the_next_request(server, client):
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server["base"] + "/v1/completions", headers=h, timeout=60,
                      json={"prompt": "Once upon a time", "max_tokens": 1500, "stream": True,
                            "temperature": 0.9, "seed": 1}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(g.startswith("data: ") for g in got)
    t0 = time.time()
    res = client.completions.create(model="gemma-test", prompt="Hi", max_tokens=5,
                                    temperature=0)
    assert res.usage.completion_tokens == 5
    # the dropped generation (1500 tokens, ~15 s) was cancelled, not run to the end
    assert time.time() - t0 < 10


def test_dropped_non_streaming_client_is_cancelled(server, client):
    h = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server["base"] + "/v1/completions", headers=h, timeout=1.0,
                   json={"prompt": "Once upon a time", "max_tokens": 1500,
                         "temperature": 0.9, "seed": 2})
    t0 = time.time()
    res = client.completions.create(model="gemma-test", prompt="Hi", max_tokens=5,
                                    temperature=0)
    assert res.usage.completion_tokens == 5
    assert time.time() - t0 < 10


def test_concurrent_clients_get_sequential_results(client):
    prompts = [f"def f{i}(x):\n    return x * {i}\n\ndef g{i}(y):\n" for i in range(8)]

    def call(p):
        return client.completions.create(model="gemma-test", prompt=p, max_tokens=24,
                                         temperature=0, extra_body=AR).choices[0].text

    sequential = [call(p) for p in prompts]
    with cf.ThreadPoolExecutor(8) as ex:
        parallel = list(ex.map(call, prompts))
    assert parallel == sequential


def test_queue_full_gives_429(server):
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0}

    def call(_):
        r = httpx.post(server["base"] + "/v1/completions", json=body, headers=h, timeout=300)
        return r.status_code, r.headers.get("Retry-After")

    with cf.ThreadPoolExecutor(14) as ex:
        answers = list(ex.map(call, range(14)))
    codes = [c for c, _ in answers]
    assert 429 in codes and 200 in codes
    assert set(codes) <= {200, 429}
    assert all(retry is not None and 1 <= int(retry) <= 60 for c, retry in answers if c == 429)
    r = httpx.post(server["base"] + "/v1/completions", json=body, headers=h, timeout=300)
    assert r.status_code == 200


def test_metrics_move_by_the_right_amounts(server, client):
    before = _metrics(server)
    res = client.completions.create(model="gemma-test", prompt=PROMPT, max_tokens=20,
                                    temperature=0)
    bad = httpx.post(server["base"] + "/v1/completions", json={"prompt": 1},
                     headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400
    after = _metrics(server)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("srsd_generated_tokens_total") == res.usage.completion_tokens
    assert delta("srsd_prompt_tokens_total") == res.usage.prompt_tokens
    t = res.model_extra["timings"]
    assert delta("srsd_draft_tokens_total") == t["draft_n"]
    assert delta("srsd_accepted_tokens_total") == t["draft_n_accepted"]
    assert delta('srsd_requests_total{endpoint="/v1/completions",status="200"}') == 1
    assert delta('srsd_requests_total{endpoint="/v1/completions",status="400"}') == 1
    per_pos = sum(v for k, v in after.items() if k.startswith("srsd_accepted_per_position_total"))
    per_pos0 = sum(v for k, v in before.items()
                   if k.startswith("srsd_accepted_per_position_total"))
    assert per_pos - per_pos0 == t["draft_n_accepted"]
    assert "srsd_queue_length" in after and after["srsd_tokens_per_second"] > 0


def test_sigterm_answers_queued_503_ends_the_stream_and_exits_within_seconds():
    import json
    import signal
    import threading

    proc, base, _ = start_cli_server(["serve", "--no-ui", "--n-ctx", "2560"])
    base = base.rstrip("/")
    try:
        lines: list[str] = []
        started = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
                    "prompt": "Once upon a time", "max_tokens": 2000, "stream": True,
                    "temperature": 0.9, "seed": 3}) as r:
                for line in r.iter_lines():  # raises if the stream is cut
                    lines.append(line)
                    if len(lines) >= 6:
                        started.set()

        def queued_length() -> float:
            m = re.search(r"^srsd_queue_length ([0-9.]+)$",
                          httpx.get(base + "/metrics").text, re.M)
            return float(m.group(1)) if m else 0.0

        with cf.ThreadPoolExecutor(2) as ex:
            streaming = ex.submit(stream)
            assert started.wait(60), "the stream did not start"
            queued = ex.submit(httpx.post, base + "/v1/completions", timeout=60,
                               json={"prompt": "Hi", "max_tokens": 2000})
            deadline = time.time() + 30
            while queued_length() < 1:
                assert time.time() < deadline, "the second request was not queued"
                time.sleep(0.05)
            t0 = time.time()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=10)
            assert time.time() - t0 < 10
            r = queued.result(timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
            streaming.result(timeout=10)  # a clean end: no error reading the stream
        data = [ln[6:] for ln in lines if ln.startswith("data: ")]
        assert json.loads(data[0])["choices"][0]["text"] is not None
        assert json.loads(data[-1])["error"]["code"] == "server_shutting_down"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


SECRET = "TOP-SECRET-CONTENT"


@pytest.mark.parametrize("kind", ["text", "truncated gguf"])
def test_a_bad_model_file_fails_at_startup_without_echoing_it(tmp_path, model_path, kind):
    import subprocess
    import sys

    path = tmp_path / ("notes.txt" if kind == "text" else "cut.gguf")
    if kind == "text":
        path.write_text(SECRET + "\n")
    else:  # the header and part of the metadata of the real model
        with open(model_path, "rb") as f:
            path.write_bytes(f.read(1 << 20))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "srsd_local.cli", "serve", "--no-ui",
                           "--model", str(path), "--port", "0"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and time.time() - t0 < 60
    assert proc.stderr.startswith("srsd-local: error: ") or "srsd-local: error: " in \
        proc.stderr, proc.stderr
    assert str(path) in proc.stderr
    out = proc.stdout + proc.stderr
    for content in (SECRET, "general.architecture", "tokenizer", "gemma"):
        assert content not in out, content


# -- parallel serving and model switching (one server: --parallel 2, a second model on disk) ---
@pytest.fixture(scope="module")
def parallel_server(model_path, second_model_dir, tmp_path_factory):
    """`srsd-local serve --parallel 2 --no-calibrate` on the default model, with
    SRSD_MODELS_DIR holding a copy of it under another name (SECOND_MODEL); --no-calibrate:
    the copy has no stored calibration, and loading it must not calibrate (~30 s)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SRSD_CACHE_DIR", str(tmp_path_factory.mktemp("srsd-cache")))
        mp.setenv("SRSD_MODELS_DIR", str(second_model_dir))
        proc, base, _ = start_cli_server(["serve", "--no-ui", "--model", str(model_path),
                                          "--parallel", "2", "--n-ctx", "1024",
                                          "--no-calibrate"])
    yield base.rstrip("/")
    proc.terminate()
    proc.wait(timeout=30)


def _complete(base: str, prompt: str, **kw) -> httpx.Response:
    return httpx.post(base + "/v1/completions", timeout=300, json={
        "prompt": prompt, "max_tokens": 32, "temperature": 0, **kw})


def test_three_concurrent_requests_on_a_parallel_2_server(parallel_server, engine):
    base = parallel_server
    prompts = [PROMPT, "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n",
               "The three primary colors are"]
    metrics = _metrics({"base": base})
    assert metrics["srsd_slots_total"] == 2 and metrics["srsd_slots_busy"] == 0
    with cf.ThreadPoolExecutor(3) as ex:
        together = list(ex.map(_complete, [base] * 3, prompts))
    assert [r.status_code for r in together] == [200, 200, 200], [r.text for r in together]
    alone = [_complete(base, p) for p in prompts]
    for p, a, b in zip(prompts, together, alone):
        text, ref = a.json()["choices"][0]["text"], b.json()["choices"][0]["text"]
        assert a.json()["usage"]["completion_tokens"] == 32
        if text != ref:  # a near-tie that batching flipped: plain decoding agrees with both
            _verified(engine, p, text)
            _verified(engine, p, ref)
    after = _metrics({"base": base})
    assert after["srsd_generations_total"] == 6 and after["srsd_requests_waiting"] == 0


def test_a_request_naming_another_model_loads_it_and_the_first_still_works(parallel_server,
                                                                          model_path, engine):
    base = parallel_server
    first = model_path.stem

    def listed() -> list[tuple[str, bool]]:
        return [(m["id"], m["loaded"]) for m in httpx.get(base + "/v1/models").json()["data"]]

    models = listed()
    assert models[0] == (first, True) and (SECOND_MODEL, False) in models
    a = _complete(base, PROMPT, model=first)
    assert a.status_code == 200 and a.json()["model"] == first
    b = _complete(base, PROMPT, model=SECOND_MODEL)
    assert b.status_code == 200, b.text
    assert b.json()["model"] == SECOND_MODEL
    _verified(engine, PROMPT, b.json()["choices"][0]["text"])  # the same weights
    models = listed()
    assert models[0] == (SECOND_MODEL, True) and (first, False) in models  # one resident
    assert httpx.get(base + "/health").json()["model"] == SECOND_MODEL
    assert _complete(base, "Hello", max_tokens=3).json()["model"] == SECOND_MODEL  # current
    c = _complete(base, PROMPT, model=first)  # back to the first one
    assert c.status_code == 200 and c.json()["model"] == first
    _verified(engine, PROMPT, c.json()["choices"][0]["text"])
    err = _complete(base, PROMPT, model="no-such-model")
    assert err.status_code == 404 and err.json()["error"]["code"] == "model_not_found"
    assert listed()[0] == (first, True)

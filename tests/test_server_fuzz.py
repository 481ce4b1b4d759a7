"""The generation endpoints fuzzed with Hypothesis, and a soak test.

- Bodies: valid-ish ones (every OpenAI field, each either a valid value or any JSON), any
  JSON, and raw bytes under any Content-Type. In-process on the fake engine (many examples)
  and against the real default-model server (fewer, and short generations): never a 5xx, an
  error is OpenAI's shape, a 200 is a completion (or a well-formed event stream), and the
  server still answers after.
- Soak (slow): concurrent clients that drop their connections at random for about a minute;
  afterwards a fresh request is served promptly and the server's memory grew by a bound.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from fakes import FakeBackend
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from srsd_local.app.server import create_app
from srsd_local.app.service import Service
from srsd_local.config import MODES, SRSDConfig
from srsd_local.engine import Engine

PATHS = ("/v1/completions", "/v1/chat/completions")
JSON = {"Content-Type": "application/json"}

# -- strategies -----------------------------------------------------------------------------
leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
        | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
anything = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                        max_leaves=12)
words = st.text(alphabet="abcdefghij \n", min_size=1, max_size=30)
message = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "wizard"]),
    "content": words | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "text", "image_url"]), "text": words}),
        max_size=2)})


def mostly(valid: st.SearchStrategy, junk: st.SearchStrategy = anything
           ) -> st.SearchStrategy:
    """`valid` five times in six, else `junk`: most bodies get far enough to generate."""
    return st.integers(0, 5).flatmap(lambda i: junk if i == 0 else valid)


def _fields(short: bool) -> dict[str, st.SearchStrategy]:
    """Each field: a valid value, or a junk one. short: generations stay a few tokens."""
    if short:  # never absent-or-null max_tokens: that generates up to the context's end
        max_tok = mostly(st.integers(1, 4), st.sampled_from([0, -1, 1.5, "3", True, [],
                                                             10**9]))
    else:
        max_tok = mostly(st.integers(1, 8), st.sampled_from([None, 0, -1, 1.5, "3", True,
                                                             300, 10**9]))
    return {
        "max_tokens": max_tok,
        "temperature": mostly(st.floats(0, 2)),
        "top_p": mostly(st.floats(0.01, 1)),
        "top_k": mostly(st.integers(0, 50)),
        "min_p": mostly(st.floats(0, 1)),
        "seed": mostly(st.integers(0, 2**31)),
        "stop": mostly(st.none() | words | st.lists(words, max_size=17)),
        "n": mostly(st.just(1)),
        "stream": mostly(st.booleans()),
        "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "srsd": mostly(st.fixed_dictionaries({"mode": st.sampled_from(MODES)})),
        "model": mostly(st.sampled_from([None, "fake", "gemma-test"]),
                        st.sampled_from(["gpt-4o", ""]) | anything),
        "logprobs": st.none() | st.booleans(), "top_logprobs": st.none() | st.integers(0, 5),
        "tools": mostly(st.sampled_from([None, []])),
        "tool_choice": mostly(st.sampled_from([None, "none", "auto"]),
                              st.sampled_from(["required", {"type": "function"}])),
        "response_format": mostly(st.sampled_from([None, {"type": "text"}]),
                                  st.sampled_from([{"type": "json_object"}, "json"])),
        "user": st.text(max_size=8), "echo": st.booleans(), "suffix": st.none() | words,
        "x-extra": anything,
    }


def bodies(path: str, vocab: int, short: bool = False) -> st.SearchStrategy[Any]:
    fields = _fields(short)
    if path == "/v1/completions":
        main = {"prompt": mostly(words | st.lists(words, min_size=1, max_size=2)
                                 | st.lists(st.integers(0, vocab + 5), min_size=1,
                                            max_size=12))}
    else:
        main = {"messages": mostly(st.lists(message, min_size=1, max_size=3))}
    optional = dict(fields)
    if short:  # max_tokens always there; max_completion_tokens (which wins) only if short
        main["max_tokens"] = optional.pop("max_tokens")
        optional["max_completion_tokens"] = fields["max_tokens"]
    else:
        optional["max_completion_tokens"] = fields["max_tokens"]
        optional["prompt" if path != "/v1/completions" else "messages"] = anything
    return mostly(st.fixed_dictionaries(main, optional=optional))


raw_bodies = st.tuples(st.binary(max_size=64) | st.sampled_from(
    [b"", b"{", b'{"prompt": "a"', b"\xff\xfe{}", b'{"prompt": "\\ud800"}', b"[" * 70,
     b'{"prompt": "ab", "max_tokens": 1e400}', b'{"prompt": "ab", "max_tokens": 2, "a": NaN}']),
    st.sampled_from(["application/json", "application/json; charset=latin-1", "text/plain",
                     None]))


# -- checks ---------------------------------------------------------------------------------
def check(r: httpx.Response, path: str) -> None:
    """Never a 5xx; a 4xx is OpenAI's error; a 200 is a completion or an event stream."""
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]
        return
    assert r.status_code == 200
    if r.headers["content-type"].startswith("text/event-stream"):
        data = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert data and (data[-1] == "[DONE]" or "error" in json.loads(data[-1])), data[-3:]
        for d in data[:-1]:
            assert json.loads(d)["object"] in ("text_completion", "chat.completion.chunk")
        return
    body = r.json()
    assert body["object"] == ("chat.completion" if "chat" in path else "text_completion")
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] >= 0


class ChatFake(FakeBackend):
    eos_token = -1

    def chat_template(self):
        return "{% for m in messages %}{{ m.content }} {% endfor %}"


def _fake_engine():
    be = ChatFake(n_ctx=128)
    be.model_path = "/models/fake.gguf"
    return Engine(be, SRSDConfig(index_backend="numpy"))


@pytest.fixture(scope="module")
def fake_client():
    svc = Service(_fake_engine, model_id="fake", api_key="k")
    with TestClient(create_app(svc), headers={"Authorization": "Bearer k"}) as client:
        assert svc.ready.wait(10) and svc.engine is not None
        yield client


FAST = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.mark.parametrize("path", PATHS)
def test_fuzzed_bodies_on_the_fake_engine_never_get_a_5xx(fake_client, path):
    @FAST
    @given(body=bodies(path, vocab=64))
    def run(body: Any) -> None:
        content = json.dumps(body).encode()  # NaN and Infinity included, as Python writes
        check(fake_client.post(path, content=content, headers=JSON), path)

    run()
    r = fake_client.post(path.replace("chat/", ""), json={"prompt": "ab", "max_tokens": 2})
    assert r.status_code == 200


@pytest.mark.parametrize("path", PATHS)
def test_fuzzed_raw_bytes_on_the_fake_engine_never_get_a_5xx(fake_client, path):
    @settings(FAST, max_examples=150)
    @given(raw=raw_bodies)
    def run(raw: tuple[bytes, str | None]) -> None:
        content, ctype = raw
        headers = {"Content-Type": ctype} if ctype else {}
        r = fake_client.post(path, content=content, headers=headers)
        check(r, path)
        if ctype is None or not ctype.startswith("application/json"):
            assert r.status_code == 415

    run()
    assert fake_client.get("/health").json()["status"] == "ok"


@pytest.mark.model
@pytest.mark.parametrize("path", PATHS)
def test_fuzzed_bodies_on_the_real_server_never_get_a_5xx(api_server, path):
    base, auth = api_server["base"], {"Authorization": f"Bearer {api_server['key']}"}

    @settings(FAST, max_examples=30)
    @given(body=bodies(path, vocab=262144, short=True))
    def run(body: Any) -> None:
        r = httpx.post(base + path, content=json.dumps(body).encode(), timeout=120,
                       headers={**auth, **JSON})
        check(r, path)

    run()
    assert api_server["proc"].poll() is None
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                   headers=auth, timeout=60)
    assert r.status_code == 200


# -- soak ---------------------------------------------------------------------------------
def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _has_error_event(text: str) -> bool:
    """Whether a response body or event-stream text carries an error object: a top-level
    `error` key in its JSON or in one of its `data:` events. Generated text may contain the
    word "error" itself, so the JSON is parsed, not searched."""
    docs = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    for doc in docs or [text]:
        try:
            obj = json.loads(doc)
        except ValueError:
            continue
        if isinstance(obj, dict) and "error" in obj:
            return True
    return False


def test_error_events_are_told_from_generated_text() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "error"}}]}
    assert not _has_error_event("data: " + json.dumps(chunk))
    assert not _has_error_event(json.dumps({"choices": [{"text": '"error"'}]}))
    err = {"error": {"message": "x", "type": "server_error", "param": None, "code": None}}
    assert _has_error_event("data: " + json.dumps(err))
    assert _has_error_event(json.dumps(err))
    assert _has_error_event("data: " + json.dumps(chunk) + "\n\ndata: " + json.dumps(err))


class Clients:
    """Concurrent clients doing what real ones do, dropping connections at random; they
    record every status (or 'dropped') they see."""

    def __init__(self, base: str, key: str, n: int = 4) -> None:
        self.base, self.auth, self.n = base, {"Authorization": f"Bearer {key}"}, n
        self.statuses: list[int | str] = []
        self.errors: list[bytes | str] = []  # the bodies of 5xx answers, the cut streams
        self._lock = threading.Lock()

    def _note(self, status: int | str, r: httpx.Response | None = None) -> None:
        with self._lock:
            self.statuses.append(status)
            if isinstance(status, int) and status >= 500 and r is not None:
                self.errors.append(r.read()[:300])

    def _one(self, rng: random.Random) -> None:
        b, h = self.base, self.auth
        kind = rng.choice(["full", "full", "stream-drop", "stream-drop", "timeout-drop",
                           "invalid", "socket-drop"])
        prompt = rng.choice(["Once upon a time", "def add(a, b):\n", "The capital of"])
        try:
            if kind == "full":
                r = httpx.post(b + "/v1/completions", headers=h, timeout=120, json={
                    "prompt": prompt, "max_tokens": rng.randint(1, 24), "stream":
                    rng.random() < 0.5, "temperature": rng.choice([0, 0.8])})
                self._note(r.status_code, r)
                if r.status_code == 200 and _has_error_event(r.text):
                    self._note(500, r)
            elif kind == "stream-drop":
                with httpx.stream("POST", b + "/v1/chat/completions", headers=h, timeout=120,
                                  json={"messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": 400, "stream": True}) as r:
                    self._note(r.status_code, r if r.status_code >= 500 else None)
                    for i, line in enumerate(r.iter_lines()):
                        if _has_error_event(line):
                            self._note(500)
                            self.errors.append(line[:300])
                        if i >= rng.randint(1, 20):
                            break  # leaving the block closes the connection mid-stream
            elif kind == "timeout-drop":
                httpx.post(b + "/v1/completions", headers=h, timeout=rng.uniform(0.05, 1.0),
                           json={"prompt": prompt, "max_tokens": 400})
                self._note("finished")
            elif kind == "invalid":
                r = httpx.post(b + "/v1/completions", headers=h, timeout=60,
                               json={"prompt": prompt, "max_tokens": -rng.randint(0, 9)})
                self._note(r.status_code, r)
            else:  # a request cut in the middle of its body
                port = int(b.rsplit(":", 1)[1])
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              b"Content-Type: application/json\r\nContent-Length: 100\r\n"
                              b"Authorization: " + h["Authorization"].encode() + b"\r\n\r\n{")
                self._note("dropped")
        except httpx.TimeoutException:
            self._note("dropped")
        except httpx.TransportError as exc:  # the server cut a connection: a failure
            self._note("cut")
            self.errors.append(repr(exc))

    def run_for(self, seconds: float) -> None:
        deadline = time.time() + seconds

        def loop(seed: int) -> None:
            rng = random.Random(seed)
            while time.time() < deadline:
                self._one(rng)

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 180)


@pytest.mark.model
@pytest.mark.slow
def test_soak_with_random_disconnects_keeps_serving_and_memory_bounded(api_server):
    base, key, proc = api_server["base"], api_server["key"], api_server["proc"]
    clients = Clients(base, key)
    clients.run_for(12)  # warm-up: caches, allocator pools, the acceptance model
    warm = _rss_mb(proc.pid)
    clients.run_for(70)
    assert proc.poll() is None
    t0 = time.time()
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4},
                   headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200 and time.time() - t0 < 10
    grown = _rss_mb(proc.pid) - warm
    assert grown < 150, f"RSS grew by {grown:.0f} MB during the soak"
    assert clients.statuses.count(200) >= 20, clients.statuses[-20:]
    bad = [s for s in clients.statuses if s == "cut" or isinstance(s, int) and s >= 500]
    assert not bad, (bad, clients.errors[:5])

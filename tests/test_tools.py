"""Tool calling on the real default model: its chat template (it has none of its own) cannot
render tools, which the server says; with a tool-aware template patched in, a forced
tool_choice yields a call of that function whose arguments follow its schema, in plain and
speculative decoding."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import API_KEY
from fastapi.testclient import TestClient
from jsonschema import Draft202012Validator
from tool_template import TIME, TOOL_TEMPLATE, TOOLS, WEATHER

from srsd_local.app.server import create_app
from srsd_local.app.service import Service

pytestmark = pytest.mark.model

QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_the_default_model_refuses_tools_its_template_cannot_render(api_server):
    r = httpx.post(api_server["base"] + "/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"messages": QUESTION, "tools": TOOLS, "tool_choice": "auto",
                         "max_tokens": 8})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and err["code"] == "unsupported_parameter"
    assert "chat template does not render tools" in err["message"]
    # not offering them is fine
    r = httpx.post(api_server["base"] + "/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"messages": QUESTION, "tools": TOOLS, "tool_choice": "none",
                         "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.fixture
def tool_api(engine, monkeypatch):
    """The in-process API on the session's engine, its chat template a tool-aware one."""
    monkeypatch.setattr(engine.backend, "chat_template", lambda: TOOL_TEMPLATE)
    assert engine.tool_style() == "tagged"
    svc = Service(lambda: engine, model_id="gemma-tools")
    with TestClient(create_app(svc)) as client:
        assert svc.ready.wait(60)
        yield client


@pytest.mark.parametrize("mode", ["ar", "srsd"])
@pytest.mark.parametrize("tool", [WEATHER, TIME], ids=lambda t: t["function"]["name"])
def test_a_forced_tool_choice_yields_a_valid_call_of_that_function(tool_api, mode, tool):
    name = tool["function"]["name"]
    r = tool_api.post("/v1/chat/completions", json={
        "messages": QUESTION, "tools": TOOLS, "max_tokens": 96, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": name}},
        "srsd": {"mode": mode}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == name
    args = json.loads(call["function"]["arguments"])
    errors = list(Draft202012Validator(tool["function"]["parameters"]).iter_errors(args))
    assert not errors, (args, errors)


@pytest.mark.parametrize("mode", ["ar", "srsd"])
def test_required_streams_one_call_of_an_offered_function(tool_api, mode):
    with tool_api.stream("POST", "/v1/chat/completions", json={
            "messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "stream": True,
            "max_tokens": 96, "temperature": 0, "srsd": {"mode": mode}}) as s:
        data = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d)["choices"][0] for d in data[:-1]]
    assert chunks[-1]["finish_reason"] == "tool_calls"
    (delta,) = [c["delta"] for c in chunks if c["delta"].get("tool_calls")]
    (call,) = delta["tool_calls"]
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert call["index"] == 0 and call["function"]["name"] in by_name
    args = json.loads(call["function"]["arguments"])
    assert not list(Draft202012Validator(by_name[call["function"]["name"]]).iter_errors(args))


def test_a_tool_conversation_renders_and_answers(tool_api, engine):
    """The call and its result go back to the model (tool_calls with null content, a tool
    message); the answer is text, the tools still offered."""
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    prompt = engine.apply_chat_template(messages, tools=TOOLS)
    assert "<tool_response>18 degrees, sunny</tool_response>" in prompt
    r = tool_api.post("/v1/chat/completions", json={
        "messages": messages, "tools": TOOLS, "max_tokens": 24, "temperature": 0,
        "srsd": {"mode": "ar"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(engine.tokenize(prompt))
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")

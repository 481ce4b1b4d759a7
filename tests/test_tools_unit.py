"""Tool calling without weights: validation of tools / tool_choice, the parser, the grammar of a
forced call, which templates render tools, and the chat endpoint on fake engines."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fakes import FakeBackend
from fastapi.testclient import TestClient
from tool_template import TIME, TOOL_TEMPLATE, TOOLS, WEATHER

from srsd_local.app.server import create_app
from srsd_local.app.service import Service
from srsd_local.config import SRSDConfig
from srsd_local.engine import Engine, GenerationStats, StreamEvent
from srsd_local.llama.chat import render_chat
from srsd_local.llama.grammar import ConstraintSpec, GrammarError, _stderr_of, schema_to_gbnf
from srsd_local.llama.tools import (
    CALL_RULE,
    ToolsUnsupportedError,
    parse_tool_calls,
    tool_call_grammar,
    tool_call_schema,
    tool_style,
    validate_tool_choice,
    validate_tools,
)

NAMES = ["get_weather", "get_time"]
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'


# -- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tools,words", [
    ({"type": "function"}, "must be an array"),
    ([{"type": "retrieval"}], "tools[0] must be an object with type \"function\""),
    ([{"type": "function"}], "tools[0].function must be an object"),
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name 'a b'"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "1 to 64 characters"),
    ([WEATHER, WEATHER], "tools[1].function.name 'get_weather' is given twice"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "description"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}],
     "tools[0].function.parameters must be a JSON schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
     "not a valid JSON schema at type"),
])
def test_bad_tools_say_what_is_wrong_and_what_is_accepted(tools, words):
    with pytest.raises(ValueError) as exc:
        validate_tools(tools)
    assert words in str(exc.value)


def test_valid_tools_are_returned_as_given():
    assert validate_tools(TOOLS) is TOOLS
    assert validate_tools(None) == []
    assert validate_tools([{"type": "function", "function": {"name": "now"}}])[0][
        "function"] == {"name": "now"}


@pytest.mark.parametrize("choice,tools,words", [
    ("required", [], "needs a non-empty tools array"),
    ({"type": "function", "function": {"name": "nope"}}, TOOLS,
     "'nope', which is not among the tools (given: 'get_weather', 'get_time')"),
    ({"type": "function"}, TOOLS, "accepted: \"none\", \"auto\", \"required\""),
    ("always", TOOLS, "tool_choice \"always\" is invalid"),
])
def test_bad_tool_choice_is_refused(choice, tools, words):
    with pytest.raises(ValueError) as exc:
        validate_tool_choice(choice, tools)
    assert words in str(exc.value)


def test_valid_tool_choices_pass():
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in (None, "none", "auto", "required", named):
        assert validate_tool_choice(choice, TOOLS) == choice
    assert validate_tool_choice("auto", []) == "auto"


# -- parsing --------------------------------------------------------------------------------------
def _calls(text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text, NAMES)
    for c in calls:
        assert c.id.startswith("call_") and len(c.id) > 10
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_tagged_calls_become_calls_and_the_text_before_them_content():
    text = (f"Let me check.\n<tool_call>\n{PARIS}\n</tool_call>\n"
            '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    content, calls = _calls(text)
    assert content == "Let me check."
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                     ("get_time", {"zone": "CET"})]
    content, calls = _calls(f"<tool_call>{PARIS}</tool_call>")
    assert content is None and len(calls) == 1
    a, b = parse_tool_calls(f"<tool_call>{PARIS}</tool_call>" * 2, NAMES)[1]
    assert a.id != b.id


def test_a_block_cut_off_before_its_closing_tag_still_counts():
    assert _calls(f"<tool_call>\n{PARIS}\n") == (
        None, [("get_weather", {"city": "Paris", "unit": "celsius"})])


def test_a_bare_call_object_is_a_call_only_when_it_is_the_whole_output():
    assert _calls(PARIS)[1] == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    # Llama 3.1 style "parameters"; arguments as JSON text; in a ```json fence; a list
    assert _calls('{"name": "get_time", "parameters": {"zone": "UTC"}}')[1] == \
        [("get_time", {"zone": "UTC"})]
    assert _calls('{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}')[1] == \
        [("get_time", {"zone": "UTC"})]
    assert _calls(f"```json\n{PARIS}\n```")[1][0][0] == "get_weather"
    assert [n for n, _ in _calls(f'[{PARIS}, {{"name": "get_time", "arguments": {{}}}}]')[1]] \
        == ["get_weather", "get_time"]
    for text in (f"It is {PARIS}", '{"name": "get_time"}', '{"city": "Paris"}', "[]"):
        assert _calls(text) == (text, []), text


def test_malformed_json_and_unknown_functions_stay_content():
    for text in ('<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>',
                 '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call> ok',
                 '{"name": "launch", "arguments": {}}', "{not json"):
        assert _calls(text) == (text, []), text
    # a good block next to a bad one: the good one is a call, the bad one stays as written
    bad = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    content, calls = _calls(f"{bad}\n<tool_call>{PARIS}</tool_call>")
    assert content == bad and [n for n, _ in calls] == ["get_weather"]


# -- the grammar of a forced call -----------------------------------------------------------------
def _llama_cpp_parses(gbnf: str) -> tuple[bool, str]:
    """Whether llama.cpp's grammar parser accepts the GBNF (no vocabulary is needed to
    parse), and what it printed."""
    from llama_cpp import llama_cpp as L

    ptr, err = _stderr_of(lambda: L.llama_sampler_init_grammar(None, gbnf.encode(), b"root"))
    if ptr:
        L.llama_sampler_free(ptr)
    return bool(ptr), err


def test_a_forced_call_grammar_in_tags_embeds_the_schema_grammar():
    gbnf = tool_call_grammar(TOOLS, "required", tagged=True)
    lines = gbnf.splitlines()
    assert lines[0] == f'root ::= "<tool_call>" tool-ws {CALL_RULE} tool-ws "</tool_call>"'
    assert sum(ln.startswith("root ::=") for ln in lines) == 1
    assert f"{CALL_RULE} ::= alternative-0 | alternative-1" in lines
    body = "\n".join(lines[2:])
    plain = schema_to_gbnf(tool_call_schema(TOOLS, NAMES))
    assert body == plain.replace("root ::=", f"{CALL_RULE} ::=")
    for name in NAMES:  # each function's name goes with its own arguments
        assert f'"\\"{name}\\""' in gbnf
    assert '"\\"celsius\\"" | "\\"fahrenheit\\""' in gbnf
    ok, err = _llama_cpp_parses(gbnf)
    assert ok, err


def test_a_named_tool_choice_allows_that_function_only():
    choice = {"type": "function", "function": {"name": "get_time"}}
    gbnf = tool_call_grammar(TOOLS, choice, tagged=False)
    assert "root ::= alternative-0" in gbnf.splitlines()
    assert "get_time" in gbnf and "get_weather" not in gbnf and "<tool_call>" not in gbnf
    ok, err = _llama_cpp_parses(gbnf)
    assert ok, err
    spec = ConstraintSpec.make(json_schema=tool_call_schema(TOOLS, ["get_time"]))
    assert spec.validate('{"name": "get_time", "arguments": {"zone": "CET"}}') is None
    assert spec.validate(PARIS) is not None  # another function
    assert spec.validate('{"name": "get_time", "arguments": {}}') is not None  # zone missing


def test_the_call_schema_gives_each_function_its_arguments():
    spec = ConstraintSpec.make(json_schema=tool_call_schema(TOOLS, NAMES))
    assert spec.validate(PARIS) is None
    assert spec.validate('{"name": "get_weather", "arguments": {"zone": "CET"}}') is not None
    assert spec.validate('{"name": "get_time", "arguments": {"zone": "CET"}, "x": 1}') \
        is not None
    # what the grammar admits is what the parser reads
    assert _calls(f"<tool_call>{PARIS} </tool_call>")[1][0][0] == "get_weather"
    free = [{"type": "function", "function": {"name": "now"}}]
    spec = ConstraintSpec.make(json_schema=tool_call_schema(free, ["now"]))
    assert spec.validate('{"name": "now", "arguments": {"any": [1]}}') is None


def test_a_forced_call_grammar_needs_a_forcing_choice_and_usable_parameters():
    with pytest.raises(ValueError, match="does not force a call"):
        tool_call_grammar(TOOLS, "auto", tagged=True)
    recursive = [{"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"child": {"$ref": "#"}}}}}]
    with pytest.raises(GrammarError, match="cannot force a call"):
        tool_call_grammar(recursive, "required", tagged=True)


# -- templates ------------------------------------------------------------------------------------
def test_which_templates_render_tools():
    assert tool_style(TOOL_TEMPLATE) == "tagged"
    assert tool_style(None) is None and tool_style("") is None
    assert tool_style("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_style("{# tools are not supported #}{{ messages[0].content }}") is None
    assert tool_style("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}") == "json"
    assert tool_style("{% if tools %}{{ messages") is None  # broken: renders nothing


def _backend(template: str | None, arch: str | None = None):
    return SimpleNamespace(chat_template=lambda: template, eos_token=-1,
                           meta=lambda key: arch if key == "general.architecture" else None)


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def test_render_chat_passes_tools_and_tool_messages_to_the_template():
    text = render_chat(_backend(TOOL_TEMPLATE), CONVERSATION, tools=TOOLS)
    assert json.dumps(WEATHER["function"]) in text and json.dumps(TIME["function"]) in text
    assert f"<tool_call>{PARIS}</tool_call>" in text
    assert "<tool_response>18 C</tool_response>" in text
    assert "You may call" not in render_chat(_backend(TOOL_TEMPLATE), CONVERSATION[:1])
    # arguments printed as they are read as their JSON text
    printed = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments }}" \
              "{% endfor %}{% endfor %}"
    assert render_chat(_backend(printed), CONVERSATION) == \
        '{"city": "Paris", "unit": "celsius"}'


def test_templates_without_tool_support_refuse_tools_and_tool_messages():
    for backend in (_backend(None, "gemma3"), _backend("{{ messages[0].content }}")):
        with pytest.raises(ToolsUnsupportedError, match="does not render tools"):
            render_chat(backend, CONVERSATION[:1], tools=TOOLS)
    with pytest.raises(ToolsUnsupportedError, match="messages\\[1\\] has tool_calls"):
        render_chat(_backend(None, "gemma3"), CONVERSATION)
    with pytest.raises(ToolsUnsupportedError, match="messages\\[0\\] has role 'tool'"):
        render_chat(_backend(None, "gemma3"), CONVERSATION[2:])


@pytest.mark.parametrize("messages,words", [
    ([{"role": "assistant", "tool_calls": []}], "tool_calls must be a non-empty array"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0] must be"),
    ([{"role": "tool", "content": "x", "tool_call_id": 3}], "tool_call_id must be a string"),
    ([{"role": "tool"}], "messages[0].content must be a string"),
])
def test_bad_tool_messages_are_refused(messages, words):
    with pytest.raises(ValueError) as exc:
        render_chat(_backend(TOOL_TEMPLATE), messages)
    assert words in str(exc.value)


# -- the chat endpoint on fake engines ------------------------------------------------------------
class ToolFakeBackend(FakeBackend):
    eos_token = -1

    def chat_template(self):
        return TOOL_TEMPLATE


class PlainFakeBackend(FakeBackend):
    eos_token = -1

    def chat_template(self):
        return "{% for m in messages %}{{ m.content }} {% endfor %}"


class Scripted:
    """An engine (fake weights) whose output is a given text; remembers its submit calls."""

    def __init__(self, backend_cls=ToolFakeBackend, text: str = "") -> None:
        be = backend_cls(n_ctx=4096)
        be.model_path = "/models/fake.gguf"
        self._engine = Engine(be, SRSDConfig(index_backend="numpy"))
        self.text = text
        self.calls: list[tuple[list[int], dict]] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit(self, tokens, **kwargs):
        self.calls.append((list(tokens), kwargs))
        half = len(self.text) // 2
        stats = GenerationStats(mode="ar", prompt_tokens=len(tokens), tokens=2)
        yield StreamEvent(self.text[:half], [10], [False])
        yield StreamEvent(self.text[half:], [11], [False], finish_reason="stop", stats=stats)


def _client(engine) -> TestClient:
    svc = Service(lambda: engine, model_id="fake")
    client = TestClient(create_app(svc))
    client.__enter__()
    assert svc.ready.wait(10)
    return client


@pytest.fixture
def plain():
    client = _client(Scripted(PlainFakeBackend, "hello"))
    yield client
    client.__exit__(None, None, None)


def _chat(client, **body):
    return client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 8,
        **body})


def _err(r, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


def test_tools_on_a_template_without_tool_support_are_a_400(plain):
    err = _err(_chat(plain, tools=TOOLS, tool_choice="auto"), "tools")
    assert err["code"] == "unsupported_parameter"
    assert "chat template does not render tools" in err["message"]
    _err(_chat(plain, tools=TOOLS), "tools")  # auto is the default with tools
    r = _chat(plain, tools=TOOLS, tool_choice="none")  # not offered: fine
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello"


@pytest.mark.parametrize("body,param,words", [
    ({"tool_choice": "required"}, "tool_choice", "needs a non-empty tools array"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined with response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools",
     "tools[0].function.name"),
    ({"tools": {"type": "function"}}, "tools", "accepted:"),
    ({"tool_choice": 3}, "tool_choice", "accepted:"),
])
def test_bad_tool_fields_are_400_naming_the_field(plain, body, param, words):
    assert words in _err(_chat(plain, **body), param)["message"]


def test_completions_refuse_tools(plain):
    r = plain.post("/v1/completions", json={"prompt": "x", "tools": TOOLS})
    assert "/v1/chat/completions" in _err(r, "tools")["message"]


def test_a_forced_call_is_constrained_and_answered_as_tool_calls():
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    eng = Scripted(text=call)
    client = _client(eng)
    try:
        choice = {"type": "function", "function": {"name": "get_time"}}
        r = _chat(client, tools=TOOLS, tool_choice=choice)
        assert r.status_code == 200, r.text
        tokens, kwargs = eng.calls[-1]
        assert kwargs["grammar"] == tool_call_grammar(TOOLS, choice, tagged=True)
        question = [{"role": "user", "content": "Weather in Paris?"}]
        assert tokens == eng.tokenize(eng.apply_chat_template(question, tools=TOOLS))
        body = r.json()["choices"][0]
        assert body["finish_reason"] == "tool_calls"
        assert body["message"]["content"] is None
        (tc,) = body["message"]["tool_calls"]
        assert tc["type"] == "function" and tc["id"].startswith("call_")
        assert tc["function"] == {"name": "get_time", "arguments": '{"zone": "CET"}'}

        # auto: no grammar; the parsed call all the same
        r = _chat(client, tools=TOOLS, messages=CONVERSATION)
        assert r.status_code == 200, r.text
        assert "grammar" not in eng.calls[-1][1]
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"

        # streamed: the role, then the calls in one delta, then the finish
        with client.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                "tool_choice": "required", "stream": True, "max_tokens": 8}) as s:
            data = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d)["choices"][0] for d in data[:-1]]
        assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
        (delta,) = [c["delta"] for c in chunks if "tool_calls" in c["delta"]]
        (tc,) = delta["tool_calls"]
        assert tc["index"] == 0 and tc["id"].startswith("call_") and tc["type"] == "function"
        assert tc["function"] == {"name": "get_time", "arguments": '{"zone": "CET"}'}
        assert chunks[-1]["finish_reason"] == "tool_calls"
        assert not any(c["delta"].get("content") for c in chunks)

        # tool_choice none: the tools are not offered, the text is the answer
        r = _chat(client, tools=TOOLS, tool_choice="none")
        assert eng.calls[-1][0] == eng.tokenize(eng.apply_chat_template(question))
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": call,
                                                     "tool_calls": None}
    finally:
        client.__exit__(None, None, None)


def test_text_without_calls_is_streamed_as_content():
    eng = Scripted(text="It is sunny.")
    client = _client(eng)
    try:
        with client.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                "stream": True, "max_tokens": 8}) as s:
            data = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
        chunks = [json.loads(d)["choices"][0] for d in data[:-1]]
        assert "".join(c["delta"].get("content") or "" for c in chunks) == "It is sunny."
        assert chunks[-1]["finish_reason"] == "stop"
        assert not any("tool_calls" in c["delta"] for c in chunks)
        r = _chat(client, tools=TOOLS)
        assert r.json()["choices"][0]["message"]["content"] == "It is sunny."
        assert r.json()["choices"][0]["finish_reason"] == "stop"
    finally:
        client.__exit__(None, None, None)

"""Tool calling: OpenAI `tools` / `tool_choice`, which chat templates render tools, the
model's text -> tool calls, and the grammar that forces a call.

- `validate_tools`, `validate_tool_choice`: the request's fields, checked (ValueError saying
  what is wrong and what is accepted).
- `tool_style(template)`: "tagged" (a Jinja template that renders `tools` and writes calls in
  `<tool_call>` tags, as Hermes and Qwen do), "json" (renders `tools`, calls as a bare JSON
  object, as Llama 3.1 does) or None (no Jinja template, or one that ignores `tools`:
  llama.cpp's built-in templates never render tools).
- `parse_tool_calls(text, names)`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, or a whole output that is one such JSON object (or a list of them), become OpenAI
  tool calls; anything else (malformed JSON, an unknown function) stays content.
- `tool_call_grammar(tools, choice, tagged)`: GBNF for a forced call (tool_choice "required"
  or a named function): exactly one call whose arguments follow the function's `parameters`
  schema; its output is what `parse_tool_calls` reads.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .grammar import GrammarError, schema_error, schema_to_gbnf

TOOLS_ACCEPTED = ("an array of {type: \"function\", function: {name: letters, digits, _ or - "
                  "(at most 64), description?: a string, parameters?: a JSON schema object}}")
TOOL_CHOICE_ACCEPTED = ("\"none\", \"auto\", \"required\" or {type: \"function\", function: "
                        "{name: one of the tools' names}}")
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
CALL_RULE = "tool-call"  # the converter's root rule, renamed when it is wrapped in tags


class ToolsUnsupportedError(ValueError):
    """The model's chat template cannot render tools (or tool messages)."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# -- validation -----------------------------------------------------------------------------------
def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's `tools`, checked; returned as given (templates may read any field)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"tools must be an array; accepted: {TOOLS_ACCEPTED}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f"{where} must be an object with type \"function\"; accepted: "
                             + TOOLS_ACCEPTED)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object; accepted: {TOOLS_ACCEPTED}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError(f"{where}.function.name {name!r} is invalid; accepted: letters, "
                             "digits, _ and -, 1 to 64 characters")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is given twice; names must be "
                             "unique")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ValueError(f"{where}.function.description must be a string")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise ValueError(f"{where}.function.parameters must be a JSON schema object")
            problem = schema_error(params)
            if problem is not None:
                raise ValueError(f"{where}.function.parameters is not a valid JSON schema "
                                 f"{problem}")
    return tools


def validate_tool_choice(choice: Any, tools: Sequence[dict[str, Any]]) -> str | dict | None:
    """The request's `tool_choice`, checked against its tools (None: the default, which is
    "auto" with tools and "none" without)."""
    if choice is None or choice in ("none", "auto"):
        return choice
    if choice == "required":
        if not tools:
            raise ValueError("tool_choice \"required\" needs a non-empty tools array")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        names = tool_names(tools)
        if name not in names:
            listed = ", ".join(repr(n) for n in names) or "none: tools is empty"
            raise ValueError(f"tool_choice names function {name!r}, which is not among the "
                             f"tools (given: {listed})")
        return choice
    shown = json.dumps(choice, default=str)[:80]
    raise ValueError(f"tool_choice {shown} is invalid; accepted: {TOOL_CHOICE_ACCEPTED}")


def tool_names(tools: Sequence[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def tools_active(tools: Sequence[dict[str, Any]] | None, choice: Any) -> bool:
    """Whether the model is offered the tools (rendered) and its output parsed for calls."""
    return bool(tools) and choice != "none"


def forced_names(tools: Sequence[dict[str, Any]], choice: Any) -> list[str] | None:
    """The functions a forced tool_choice allows (None: the call is not forced)."""
    if choice == "required":
        return tool_names(tools)
    if isinstance(choice, dict):
        return [choice["function"]["name"]]
    return None


# -- templates ------------------------------------------------------------------------------------
def tool_style(template: str | None) -> str | None:
    """How a chat template offers tools: "tagged", "json", or None (it does not render them)."""
    if not template:
        return None
    from jinja2 import meta  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    try:
        ast = ImmutableSandboxedEnvironment().parse(template)
    except Exception:  # noqa: BLE001 - a broken template renders nothing, tools included
        return None
    if "tools" not in meta.find_undeclared_variables(ast):
        return None
    return "tagged" if OPEN_TAG in template else "json"


# -- parsing --------------------------------------------------------------------------------------
def _call_of(value: Any, names: Sequence[str]) -> ToolCall | None:
    """A tool call of a decoded JSON value ({"name", "arguments" | "parameters"}), or None."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    key = "arguments" if "arguments" in value else "parameters"
    if key not in value:
        return None
    args = value[key]
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), value["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


_FENCE = re.compile(r"^```(?:json)?\s*\n(.*)\n```$", re.DOTALL)


def _bare_calls(text: str, names: Sequence[str]) -> list[ToolCall] | None:
    """The calls of an output that is, as a whole, one call object or a list of them."""
    s = text.strip()
    if m := _FENCE.match(s):
        s = m.group(1).strip()
    if not s.startswith(("{", "[")):
        return None
    value = _loads(s)
    items = value if isinstance(value, list) and value else [value]
    calls = [_call_of(v, names) for v in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def parse_tool_calls(text: str, names: Sequence[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a model's output, given the names of the offered functions.

    `<tool_call>` blocks holding a valid call become calls and leave the content (an output
    cut off after a block's JSON, before the closing tag, counts too); a block that does not
    hold one (bad JSON, an unknown function) stays in the content as written. Without tags,
    an output that is one call object as a whole (or a list of them; optionally in a ```json
    fence) is a call. Content is None when nothing but calls and whitespace is left."""
    calls: list[ToolCall] = []
    if OPEN_TAG in text:
        kept: list[str] = []
        pos = 0
        while (start := text.find(OPEN_TAG, pos)) >= 0:
            end = text.find(CLOSE_TAG, start)
            body_end = len(text) if end < 0 else end
            after = len(text) if end < 0 else end + len(CLOSE_TAG)
            call = _call_of(_loads(text[start + len(OPEN_TAG):body_end].strip()), names)
            if call is None:
                kept.append(text[pos:after])
            else:
                kept.append(text[pos:start])
                calls.append(call)
            pos = after
        kept.append(text[pos:])
        content = "".join(kept)
    else:
        bare = _bare_calls(text, names)
        if bare:
            return None, bare
        content = text
    if calls:
        content = content.strip()
    return (content or None) if calls else content, calls


# -- forcing a call -------------------------------------------------------------------------------
def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object"}
    return {"type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_schema(tools: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """The JSON schema of one call of the functions `names`: each name with its own
    arguments schema."""
    by_name = {t["function"]["name"]: t for t in tools}
    return {"anyOf": [_call_schema(by_name[n]) for n in names]}


_ROOT_DEF = re.compile(r"^root ::=", re.MULTILINE)
# a reference to the rule `root` outside string literals and character classes
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z0-9_-]+|.', re.DOTALL)


def _rename_root(gbnf: str) -> str:
    """The converter's grammar with its root rule named CALL_RULE (to embed it)."""
    if len(_ROOT_DEF.findall(gbnf)) != 1:
        raise GrammarError("the tool call grammar has no single root rule")
    for line in gbnf.splitlines():
        _, _, body = line.partition("::=")
        if any(tok == "root" for tok in _TOKENS.findall(body)):
            raise GrammarError("a tool's parameters refer to the whole schema ($ref \"#\"), "
                               "which a forced tool call cannot use")
    if re.search(rf"^{CALL_RULE} ::=", gbnf, re.MULTILINE):
        raise GrammarError(f"the tool call grammar already has a rule named {CALL_RULE}")
    return _ROOT_DEF.sub(f"{CALL_RULE} ::=", gbnf)


def tool_call_grammar(tools: Sequence[dict[str, Any]], choice: Any, tagged: bool) -> str:
    """GBNF forcing one call allowed by a forced tool_choice; `tagged`: inside <tool_call>
    tags (the template's format). A parameters schema the converter cannot handle raises
    GrammarError."""
    names = forced_names(tools, choice)
    if not names:
        raise ValueError("tool_choice does not force a call (\"required\" or a named "
                         "function does)")
    try:
        gbnf = schema_to_gbnf(tool_call_schema(tools, names))
    except GrammarError as exc:
        raise GrammarError(f"the tools' parameters cannot force a call: {exc}") from None
    if not tagged:
        return gbnf
    wrapper = (f'root ::= "{OPEN_TAG}" tool-ws {CALL_RULE} tool-ws "{CLOSE_TAG}"\n'
               'tool-ws ::= [ \\n]?\n')
    return wrapper + _rename_root(gbnf)

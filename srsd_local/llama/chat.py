"""Chat messages -> prompt text.

The model's own chat template (Jinja, from the GGUF) when it has one; else llama.cpp's
built-in template for the model family (the default Gemma 3 base model has none); else a
clear error. BOS is left to the tokenizer, so templates get an empty `bos_token`.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from .tools import ToolsUnsupportedError, tool_style

ROLES = ("system", "user", "assistant", "tool")
# general.architecture -> llama.cpp built-in template name
FAMILY_TEMPLATES = {
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
    "qwen2": "chatml", "qwen3": "chatml", "qwen2moe": "chatml", "qwen3moe": "chatml",
    "llama": "llama3", "phi3": "phi3", "mistral3": "mistral-v7",
}


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text is supported
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ValueError(f"messages[{i}].content: only text parts "
                                 "({'type': 'text', 'text': ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts")


class _JSONArgs(dict):
    """A tool call's arguments as templates want them: an object for `tojson` and item
    access, its JSON text where a template prints it as is."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's OpenAI `tool_calls`, for the template (arguments decoded)."""
    shape = ("[{id, type: 'function', function: {name, arguments: JSON text}}]")
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"messages[{i}].tool_calls must be a non-empty array {shape}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or call.get("type", "function") != "function":
            raise ValueError(f"messages[{i}].tool_calls[{j}] must be {shape[1:-1]}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                decoded = json.loads(args)
            except json.JSONDecodeError:
                decoded = None
            args = _JSONArgs(decoded) if isinstance(decoded, dict) else args
        elif isinstance(args, dict):
            args = _JSONArgs(args)
        else:
            raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be "
                             "JSON text (or an object)")
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def normalise_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages checked and reduced to what templates read: role and content; an assistant
    message's `tool_calls` (its content may then be null); a tool message's `tool_call_id`
    and `name`."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={role!r}: accepted are "
                             + ", ".join(ROLES) + " (and 'developer')")
        msg: dict[str, Any] = {"role": role}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
            content = m.get("content")
            msg["content"] = "" if content is None else _content_text(content, i)
        else:
            msg["content"] = _content_text(m.get("content"), i)
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise ValueError(f"messages[{i}].{key} must be a string")
                    msg[key] = m[key]
        out.append(msg)
    return out


def _tojson(value: Any, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    """JSON as chat templates expect it (Jinja's own `tojson` escapes <, > and & for HTML)."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def _render_jinja(template: str, messages: list[dict[str, Any]], eos: str,
                  tools: list[dict[str, Any]] | None = None) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    def raise_exception(msg: str) -> None:
        raise ValueError(f"the model's chat template refused the messages: {msg}")

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    env.filters["tojson"] = _tojson
    extra = {"tools": tools} if tools else {}
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token="", eos_token=eos, **extra)


def _render_builtin(name: str, messages: list[dict[str, Any]]) -> str:
    for i, m in enumerate(messages):
        if m["role"] == "tool" or "tool_calls" in m:
            what = "role 'tool'" if m["role"] == "tool" else "tool_calls"
            raise ToolsUnsupportedError(
                f"messages[{i}] has {what}, and the model has no chat template of its own "
                f"(llama.cpp's built-in {name!r} template is used), which cannot render tool "
                "messages")
    from llama_cpp import llama_cpp as L  # noqa: PLC0415

    arr = (L.llama_chat_message * len(messages))()
    keep = []
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        arr[i].role, arr[i].content = role, content
    size = sum(len(k) for k in keep) * 2 + 256
    buf = ctypes.create_string_buffer(size)
    n = L.llama_chat_apply_template(name.encode(), arr, len(messages), True, buf, size)
    if n > size:
        buf = ctypes.create_string_buffer(n)
        n = L.llama_chat_apply_template(name.encode(), arr, len(messages), True, buf, n)
    if n < 0:
        raise ValueError(f"llama.cpp's built-in chat template {name!r} failed")
    return buf.raw[:n].decode("utf-8")


def render_chat(backend, messages: Sequence[Any],
                tools: Sequence[dict[str, Any]] | None = None) -> str:
    """The prompt of a conversation; `tools` (OpenAI's, already validated) are passed to
    the model's Jinja template, and a template that does not render them is an error
    (ToolsUnsupportedError)."""
    msgs = normalise_messages(messages)
    template = backend.chat_template()
    if tools and tool_style(template) is None:
        raise ToolsUnsupportedError(
            "the model's chat template does not render tools" + (
                "" if template else " (the model has no chat template of its own)")
            + ", so it cannot be offered functions to call; send no tools (or tool_choice "
            "\"none\"), or use a model whose chat template supports tools")
    if template:
        eos = backend.token_text(backend.eos_token) if backend.eos_token >= 0 else ""
        return _render_jinja(template, msgs, eos, list(tools) if tools else None)
    arch = backend.meta("general.architecture") or "?"
    name = FAMILY_TEMPLATES.get(arch)
    if name is None:
        raise ValueError(f"the model has no chat template and there is no built-in one for its "
                         f"family {arch!r} (known: {', '.join(sorted(FAMILY_TEMPLATES))}); "
                         "use plain completion with a prompt you format yourself")
    return _render_builtin(name, msgs)

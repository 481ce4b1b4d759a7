"""Chat messages -> prompt text.

The model's own chat template (Jinja, from the GGUF) when it has one; else llama.cpp's
built-in template for the model family (the default Gemma 3 base model has none); else a
clear error. BOS is left to the tokenizer, so templates get an empty `bos_token`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

ROLES = ("system", "user", "assistant")
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


def normalise_messages(messages: Sequence[Any]) -> list[dict[str, str]]:
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
        out.append({"role": role, "content": _content_text(m.get("content"), i)})
    return out


def _render_jinja(template: str, messages: list[dict[str, str]], eos: str) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    def raise_exception(msg: str) -> None:
        raise ValueError(f"the model's chat template refused the messages: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token="", eos_token=eos)


def _render_builtin(name: str, messages: list[dict[str, str]]) -> str:
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


def render_chat(backend, messages: Sequence[Any]) -> str:
    msgs = normalise_messages(messages)
    template = backend.chat_template()
    if template:
        eos = backend.token_text(backend.eos_token) if backend.eos_token >= 0 else ""
        return _render_jinja(template, msgs, eos)
    arch = backend.meta("general.architecture") or "?"
    name = FAMILY_TEMPLATES.get(arch)
    if name is None:
        raise ValueError(f"the model has no chat template and there is no built-in one for its "
                         f"family {arch!r} (known: {', '.join(sorted(FAMILY_TEMPLATES))}); "
                         "use plain completion with a prompt you format yourself")
    return _render_builtin(name, msgs)

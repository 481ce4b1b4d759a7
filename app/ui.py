"""Gradio chat and editor UI over the Service of app/service.py (the same queue and engine as
the HTTP API; app/main.py mounts it).

Above the tabs: the model's status and a model picker (the models of GET /v1/models;
choosing one loads it, queued like a generation, and makes it the current model for the UI
and for API requests that name no model). Tabs: Chat (streaming, history, system prompt,
drafted tokens highlighted), Editor (an instruction applied to code or text by a few-shot
prompt, streamed, then a diff; "compare" runs plain decoding and SRSD on the same input side
by side) and Stats (accepted per depth, tokens per step).
"""

from __future__ import annotations

import difflib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from ..config import MODES
from .errors import APIError
from .service import GenRequest, Served, Service, never_disconnected

DRAFT_LABEL = "from an accepted draft"
SCHEMA_LABEL = "JSON schema (optional): the output must satisfy it"
CSS = ".srsd-stats {font-family: monospace}"


def parse_schema(text: str | None) -> dict | None:
    """The optional JSON schema box: empty -> None; else a JSON object, or a clear error."""
    if not (text or "").strip():
        return None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"JSON schema: not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise ValueError("JSON schema: give a JSON object, e.g. {\"type\": \"object\"}")
    return schema


def _request(kind: str, *, prompt: str | None = None, messages: list | None = None,
             max_tokens: int, temperature: float, mode: str, stop: list[str] | None = None,
             schema: str | None = None) -> GenRequest:
    try:
        json_schema = parse_schema(schema)
    except ValueError as exc:
        import gradio as gr  # noqa: PLC0415

        raise gr.Error(str(exc)) from exc
    return GenRequest(kind=kind, prompt=prompt, messages=messages, max_tokens=int(max_tokens),
                      temperature=float(temperature), top_p=1.0, top_k=0, min_p=0.0,
                      seed=None if temperature == 0 else int(time.time()) % 100000,
                      stop=stop or [], stream=True, include_usage=False, mode=mode, model=None,
                      json_schema=json_schema,
                      constraint_param="JSON schema" if json_schema is not None else None)


def stats_line(stats) -> str:
    if stats is None:
        return ""
    return (f"{stats.tokens} tokens · {stats.tokens_per_second:.1f} tokens/s · "
            f"{stats.mean_accepted_length:.2f} tokens/step · acceptance "
            f"{stats.acceptance_rate:.0%} · mode {stats.mode}")


# Few-shot edits (original, instruction, edited): the default model is a small base model,
# not instruction-tuned; worked examples of the same shape make it apply simple edits such as
# renames instead of copying the original unchanged.
CODE_EXAMPLES = {
    "python": [
        ('def greet(name):\n    """Greeting for name."""\n    message = "Hello, " + name\n'
         '    return message', "rename message to text",
         'def greet(name):\n    """Greeting for name."""\n    text = "Hello, " + name\n'
         '    return text'),
        ('def scale(xs, factor):\n    """Each x times factor."""\n'
         '    out = [x * factor for x in xs]\n    return out', "rename factor to k",
         'def scale(xs, k):\n    """Each x times k."""\n    out = [x * k for x in xs]\n'
         '    return out'),
        ('def perimeter(a, b):\n    """Perimeter of a rectangle."""\n    total = 2 * (a + b)\n'
         '    return total', "rename total to p",
         'def perimeter(a, b):\n    """Perimeter of a rectangle."""\n    p = 2 * (a + b)\n'
         '    return p'),
    ],
    "javascript": [
        ('function greet(name) {\n  // Greeting for name.\n  const message = "Hello, " + name;\n'
         '  return message;\n}', "rename message to text",
         'function greet(name) {\n  // Greeting for name.\n  const text = "Hello, " + name;\n'
         '  return text;\n}'),
        ('function scale(xs, factor) {\n  // Each x times factor.\n'
         '  const out = xs.map((x) => x * factor);\n  return out;\n}', "rename factor to k",
         'function scale(xs, k) {\n  // Each x times k.\n  const out = xs.map((x) => x * k);\n'
         '  return out;\n}'),
        ('function perimeter(a, b) {\n  // Perimeter of a rectangle.\n'
         '  const total = 2 * (a + b);\n  return total;\n}', "rename total to p",
         'function perimeter(a, b) {\n  // Perimeter of a rectangle.\n  const p = 2 * (a + b);\n'
         '  return p;\n}'),
    ],
}
TEXT_EXAMPLES = [
    ("The wether was nice, so we went for a walck in the park.", "fix the typos",
     "The weather was nice, so we went for a walk in the park."),
    ("Alice met Bob at the station.\nBob was late.", "rename Bob to Carol",
     "Alice met Carol at the station.\nCarol was late."),
    ("We will meet on monday.\nPlease bring the report.", "capitalize the day",
     "We will meet on Monday.\nPlease bring the report."),
]
# the marker of the prompt's header lines: a comment in code; in prose one that markdown
# headings ("#") do not collide with
COMMENT = {"python": "#", "javascript": "//"}
PROSE_MARK = "=="


def _edit_parts(instruction: str, language: str) -> tuple[str, str, str]:
    """(comment marker, header line of the edited version, end marker)."""
    mark = COMMENT.get(language, PROSE_MARK)
    what = instruction.strip().rstrip(".")
    return mark, f"{mark} {what[:1].upper()}{what[1:]}:", f"{mark} End"


def edit_prompt(original: str, instruction: str, language: str) -> str:
    """A few-shot prompt: worked edits, then `original` and the instruction; the model
    continues with the edited version (cut it with `edit_stop`)."""
    mark = COMMENT.get(language, PROSE_MARK)
    examples = CODE_EXAMPLES.get(language, TEXT_EXAMPLES)  # text, markdown: prose examples

    def block(orig: str, instr: str) -> str:
        return f"{mark} Original\n{orig.rstrip()}\n\n{_edit_parts(instr, language)[1]}\n"

    shots = "".join(f"{block(o, i)}{e}\n{_edit_parts(i, language)[2]}\n\n"
                    for o, i, e in examples)
    return shots + block(original, instruction)


def edit_stop(instruction: str, language: str) -> list[str]:
    """Where the edited version ends: the end marker, or a new example starting."""
    mark, header, end = _edit_parts(instruction, language)
    return [f"\n{end}", f"\n{mark} Original", f"\n{header}"]


def edit_max_tokens(n_original_tokens: int) -> int:
    return min(4 * n_original_tokens + 64, 4096)


def edited_text(generated: str, original: str) -> str:
    """The edited version as shown: trailing blank lines dropped, and the final newline as in
    the original (the end marker's newline is not part of the text)."""
    text = generated.rstrip()
    return text + "\n" if text and original.endswith("\n") else text


def unified_diff(original: str, edited: str) -> str:
    return "".join(difflib.unified_diff(original.splitlines(keepends=True),
                                        edited.splitlines(keepends=True),
                                        "original", "edited")) or "(no changes)"


class UIState:
    def __init__(self, service: Service) -> None:
        self.service = service

    def status(self) -> str:
        s = self.service
        if s.load_error:  # why: in the server's log only
            return "**The model failed to load** (the server's log says why)"
        if s.engine is None:
            return "Loading model…"
        eng = s.engine
        line = (f"**Model:** {s.model_id} · {eng.n_ctx} tokens of context · "
                f"{eng.parallel} at a time · GPU layers {eng.config.n_gpu_layers} · "
                f"index {eng.index_backend}")
        placement = getattr(eng, "placement", None)
        if getattr(eng.config, "rpc_servers", ()) and isinstance(placement, list):
            line += " · **layers:** " + " · ".join(
                f"{p['device']} ({p['where']}) {p['layers']}" for p in placement)
        loading = s.loading_model
        return line + (f" · **loading {loading}…**" if loading else "")

    def piece(self, tok: int, engine: Any = None) -> str:
        return (engine or self.service.engine).token_text(tok)

    async def model_choices(self) -> tuple[list[str], str | None]:
        """The picker's choices (the models of GET /v1/models) and the current model."""
        if self.service.engine is None:
            return [], None
        return [m.id for m in await self.service.models()], self.service.model_id

    async def switch(self, name: str) -> AsyncIterator[str]:
        """Load (if needed) and select model `name`: status lines as it goes."""
        import gradio as gr  # noqa: PLC0415

        if not name:
            raise gr.Error("Pick a model first.")
        if name == self.service.model_id:
            yield self.status()
            return
        yield f"**Loading {name}…** (after the running generations; a first load may " \
              "calibrate the model first)"
        t0 = time.perf_counter()
        try:
            model_id = await self.service.use_model(name)
        except APIError as exc:
            raise gr.Error(exc.message) from exc
        yield f"**Loaded {model_id}** in {time.perf_counter() - t0:.1f} s · " + \
            self.status().split(" · ", 1)[1]

    async def run(self, req: GenRequest) -> AsyncIterator[tuple[str, list, Any]]:
        """(text so far, highlighted pieces, final stats or None) as the generation goes."""
        import gradio as gr  # noqa: PLC0415

        if self.service.engine is None:
            raise gr.Error(self.status().replace("**", ""))
        text, pieces = "", []
        served = Served()
        try:
            async for ev in self.service.events(req, never_disconnected, served):
                text += ev.text
                for tok, drafted in zip(ev.token_ids, ev.drafted):
                    pieces.append((self.piece(tok, served.engine),
                                   DRAFT_LABEL if drafted else None))
                yield text, pieces, ev.stats
        except APIError as exc:
            raise gr.Error(exc.message) from exc


def _plots(stats):
    import pandas as pd  # noqa: PLC0415

    if stats is None:
        return None, None
    # zero-padded labels: the bar chart orders categories as text (1, 10, 2 otherwise)
    depth = pd.DataFrame({"depth": [f"{i:02d}" for i in range(1,
                                                             len(stats.accepted_per_depth) + 1)],
                          "accepted": stats.accepted_per_depth})
    steps = pd.DataFrame({"step": list(range(1, len(stats.tokens_per_step) + 1)),
                          "tokens": stats.tokens_per_step})
    return depth, steps


def build_ui(service: Service):
    import gradio as gr  # noqa: PLC0415

    st = UIState(service)

    with gr.Blocks(title="srsd-local") as demo:
        gr.Markdown("# srsd-local\nFaster local generation with semantic retrieval "
                    "speculative decoding: same tokens, fewer forward passes.")
        with gr.Row():
            status = gr.Markdown(st.status(), elem_id="status")
            # custom values: the choices come with the page; the service checks the name
            model_pick = gr.Dropdown([], value=None, label="Model", elem_id="model-picker",
                                     info="choosing one loads it", interactive=True,
                                     allow_custom_value=True)
        timer = gr.Timer(1.0)
        timer.tick(st.status, None, status)

        async def refresh_models():
            choices, current = await st.model_choices()
            return gr.update(choices=choices, value=current)

        async def switch_model(name):
            async for line in st.switch(name):
                yield line

        demo.load(refresh_models, None, model_pick, api_name="models")
        # .input: only the user's choice loads a model, not the refresh setting the value
        model_pick.input(switch_model, model_pick, status, api_name="switch_model",
                         concurrency_limit=1).then(refresh_models, None, model_pick,
                                                   api_name=False)

        with gr.Tab("Chat", id="chat"):
            chatbot = gr.Chatbot(label="Chat", height=380, elem_id="chatbot")
            with gr.Row():
                msg = gr.Textbox(placeholder="Message", show_label=False, scale=5,
                                 elem_id="chat-input")
                send = gr.Button("Send", variant="primary", scale=1)
                stop_btn = gr.Button("Stop", scale=1)
            with gr.Accordion("Settings", open=False):
                system = gr.Textbox(label="System prompt", value="")
                with gr.Row():
                    mode = gr.Dropdown(list(MODES), value="srsd", label="Mode")
                    temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05,
                                            label="Temperature")
                    max_tokens = gr.Slider(1, 2048, value=256, step=1, label="Max tokens")
                chat_schema = gr.Code(label=SCHEMA_LABEL, language="json", lines=3,
                                      elem_id="chat-schema")
            chat_stats = gr.Markdown("", elem_classes="srsd-stats", elem_id="chat-stats")
            chat_tokens = gr.HighlightedText(label="Last reply: tokens from accepted drafts",
                                             color_map={DRAFT_LABEL: "green"},
                                             combine_adjacent=True, show_legend=True)

        with gr.Tab("Editor", id="editor"):
            with gr.Row():
                original = gr.Code(label="Original", language="python", lines=16,
                                   elem_id="original")
                edited = gr.Code(label="Edited", language="python", lines=16,
                                 interactive=False, elem_id="edited")
            with gr.Row():
                instruction = gr.Textbox(label="Instruction", scale=4,
                                         placeholder="rename x to y · fix the typos · add "
                                                     "type hints")
                language = gr.Dropdown(["python", "javascript", "markdown", "text"],
                                       value="python", label="Language", scale=1)
                edit_mode = gr.Dropdown(list(MODES), value="srsd", label="Mode", scale=1)
            with gr.Row():
                edit_btn = gr.Button("Edit", variant="primary")
                compare_btn = gr.Button("Compare plain vs SRSD")
                edit_stop_btn = gr.Button("Stop")
            with gr.Accordion("Output constraint", open=False):
                edit_schema = gr.Code(label=SCHEMA_LABEL, language="json", lines=3,
                                      elem_id="edit-schema")
            edit_stats = gr.Markdown("", elem_classes="srsd-stats", elem_id="edit-stats")
            diff = gr.Code(label="Diff", language="markdown", interactive=False, lines=10)
            compare_out = gr.Markdown("", elem_id="compare")

        with gr.Tab("Stats", id="stats"):
            gr.Markdown("Of the last generation: how deep drafts were accepted, and how many "
                        "tokens each forward pass produced.")
            depth_plot = gr.BarPlot(x="depth", y="accepted", title="Accepted per depth",
                                    height=260)
            steps_plot = gr.LinePlot(x="step", y="tokens", title="Tokens per step", height=260)

        # -- chat ------------------------------------------------------------------------
        async def chat(message, history, system_prompt, mode_v, temp, max_tok, schema=""):
            if not (message or "").strip():
                raise gr.Error("Type a message first.")
            msgs = ([{"role": "system", "content": system_prompt}] if system_prompt.strip()
                    else [])
            for turn in history or []:
                content = turn["content"]
                if isinstance(content, list):  # gradio 6 may give content parts
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                msgs.append({"role": turn["role"], "content": content})
            msgs.append({"role": "user", "content": message})
            req = _request("chat", messages=msgs, max_tokens=max_tok, temperature=temp,
                           mode=mode_v, schema=schema)
            base = list(history or []) + [{"role": "user", "content": message}]
            stats = None
            async for text, pieces, stats in st.run(req):
                yield (base + [{"role": "assistant", "content": text}], "", stats_line(stats),
                       pieces, *_plots(stats))
            if stats is None:
                return

        chat_inputs = [msg, chatbot, system, mode, temperature, max_tokens, chat_schema]
        chat_outputs = [chatbot, msg, chat_stats, chat_tokens, depth_plot, steps_plot]
        ev1 = send.click(chat, chat_inputs, chat_outputs, api_name="chat")
        ev2 = msg.submit(chat, chat_inputs, chat_outputs, api_name=False)
        stop_btn.click(None, None, None, cancels=[ev1, ev2])

        # -- editor ----------------------------------------------------------------------
        def _edit_req(orig, instr, lang, mode_v, schema=""):
            if not (orig or "").strip() or not (instr or "").strip():
                raise gr.Error("Give both the original and an instruction.")
            n = len(st.service.engine.tokenize(orig)) if st.service.engine else 256
            return _request("completion", prompt=edit_prompt(orig, instr, lang),
                            max_tokens=edit_max_tokens(n), temperature=0.0, mode=mode_v,
                            stop=edit_stop(instr, lang), schema=schema)

        async def edit(orig, instr, lang, mode_v, schema=""):
            req = _edit_req(orig, instr, lang, mode_v, schema)
            text, stats = "", None
            async for text, _pieces, stats in st.run(req):
                yield text, stats_line(stats), "", *_plots(stats)
            text = edited_text(text, orig)
            yield text, stats_line(stats), unified_diff(orig, text), *_plots(stats)

        async def compare(orig, instr, lang, schema=""):
            rows, texts = [], {}
            for m in ("ar", "srsd"):
                last = None
                async for text, _p, stats in st.run(_edit_req(orig, instr, lang, m, schema)):
                    texts[m], last = edited_text(text, orig), stats
                rows.append((m, last))
            (_, a), (_, s) = rows
            speedup = s.tokens_per_second / a.tokens_per_second if a.tokens_per_second else 0
            same = "yes" if texts["ar"] == texts["srsd"] else "no (near-tied logits)"
            md = ("| mode | tokens | tokens/s | tokens/step |\n|---|---|---|---|\n" +
                  "".join(f"| {m} | {x.tokens} | {x.tokens_per_second:.1f} | "
                          f"{x.mean_accepted_length:.2f} |\n" for m, x in rows) +
                  f"\n**Speed-up: {speedup:.2f}x** · same output: {same}")
            yield texts["srsd"], stats_line(s), unified_diff(orig, texts["srsd"]), md

        e1 = edit_btn.click(edit, [original, instruction, language, edit_mode, edit_schema],
                            [edited, edit_stats, diff, depth_plot, steps_plot], api_name="edit")
        e2 = compare_btn.click(compare, [original, instruction, language, edit_schema],
                               [edited, edit_stats, diff, compare_out], api_name="compare")
        edit_stop_btn.click(None, None, None, cancels=[e1, e2])

        def set_language(lang):
            lang = None if lang == "text" else lang
            return gr.update(language=lang), gr.update(language=lang)

        language.change(set_language, language, [original, edited], api_name=False)
    # every event through the queue: the direct routes (/run, /api) keep a streaming
    # generator suspended after its first output, and with it the engine, for good
    demo.queue(api_open=False)
    return demo


def mount_ui(app, service: Service, path: str = "/ui"):
    import gradio as gr  # noqa: PLC0415

    return gr.mount_gradio_app(app, build_ui(service), path=path, css=CSS)

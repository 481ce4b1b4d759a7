"""The Gradio app on the real default model, driven with gradio_client, and its screenshots
in headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import SECOND_MODEL, start_cli_server

from srsd_local.app.ui import (
    edit_max_tokens,
    edit_prompt,
    edit_stop,
    edited_text,
    unified_diff,
)

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parent.parent
CODE = 'def area(width, height):\n    """Area of a rectangle."""\n    result = width * height\n' \
       '    return result\n'


@pytest.fixture(scope="module")
def ui_url(tmp_path_factory, model_path, second_model_dir):
    with pytest.MonkeyPatch.context() as mp:  # the server's caches: not the user's
        mp.setenv("SRSD_CACHE_DIR", str(tmp_path_factory.mktemp("srsd-cache")))
        mp.setenv("SRSD_MODELS_DIR", str(second_model_dir))  # a second model for the picker
        # --model: the default model where it is (else it is assembled in SRSD_MODELS_DIR);
        # --no-calibrate: the second model has no stored calibration
        proc, base, _ = start_cli_server(["ui", "--model", str(model_path), "--no-calibrate"])
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def gclient(ui_url):
    from gradio_client import Client

    return Client(ui_url, verbose=False)


def test_page_serves(ui_url):
    r = httpx.get(ui_url, timeout=30)
    assert r.status_code == 200 and "srsd-local" in r.text


def test_chat_streams_reply_and_stats(gclient, engine):
    # plain decoding repeats exactly, so the UI's reply must equal the engine's
    out = gclient.predict("Write a Python function that adds two numbers.", [], "", "ar",
                          0.0, 40, "", api_name="/chat")
    history, cleared, stats, tokens = out[:4]
    assert cleared == ""
    assert history[0]["role"] == "user" and history[-1]["role"] == "assistant"
    reply = history[-1]["content"]
    reply = reply if isinstance(reply, str) else "".join(p.get("text", "") for p in reply)
    msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    engine.reset()  # prefill the whole prompt in one pass, as the UI's fresh server does
    ref = engine.chat(msgs, max_tokens=40, mode="ar")
    assert reply == ref.text
    assert "tokens/s" in stats and "mode ar" in stats
    pieces = tokens if isinstance(tokens, list) else tokens.get("value", tokens)
    assert "".join(p["token"] if isinstance(p, dict) else p[0] for p in pieces) == ref.text
    # with SRSD on a reply that repeats its input, some tokens come from accepted drafts
    prompt = "Repeat exactly: " + " ".join(["alpha beta gamma delta"] * 6)
    out = gclient.predict(prompt, [], "", "srsd", 0.0, 60, "", api_name="/chat")
    assert "mode srsd" in out[2]
    pieces = out[3] if isinstance(out[3], list) else out[3].get("value", out[3])
    labels = [p.get("class_or_confidence") if isinstance(p, dict) else p[1] for p in pieces]
    assert any(lab for lab in labels), "no token was marked as coming from a draft"


def test_edit_streams_result_and_diff(gclient, engine):
    instr = "rename result to value"
    edited, stats, diff = gclient.predict(CODE, instr, "python", "ar", "", api_name="/edit")[:3]
    ref = engine.generate(edit_prompt(CODE, instr, "python"), stop=edit_stop(instr, "python"),
                          max_tokens=edit_max_tokens(len(engine.tokenize(CODE))), mode="ar")
    assert edited.rstrip("\n") == ref.text.rstrip("\n") and edited.strip()
    assert diff.rstrip("\n") == unified_diff(CODE, edited_text(ref.text, CODE)).rstrip("\n")
    assert "tokens/s" in stats and "tokens/step" in stats


def test_editor_renames_on_the_default_base_model(gclient):
    # the few-shot prompt makes the base model really edit: "value" where "result" was
    edited, _stats, diff = gclient.predict(CODE, "rename result to value", "python", "srsd",
                                           "", api_name="/edit")[:3]
    assert edited.rstrip("\n") == CODE.replace("result", "value").rstrip("\n"), edited
    assert diff != "(no changes)" and "-    result = width * height" in diff
    assert "+    value = width * height" in diff and "+    return value" in diff


def test_edit_prompt_is_few_shot_and_ends_where_the_edit_starts():
    p = edit_prompt(CODE, "rename result to value", "python")
    assert p.count("# Original\n") == 4 and p.endswith("# Rename result to value:\n")
    assert "# Rename message to text:\n" in p and p.count("\n# End\n") == 3
    assert "\n# End" in edit_stop("rename result to value", "python")
    prose = edit_prompt("# Title\nSome text.", "fix the typos", "markdown")
    assert prose.endswith("== Fix the typos:\n") and "== Original\n# Title" in prose


def test_compare_shows_both_speeds(gclient):
    edited, stats, diff, md = gclient.predict(CODE, "rename width to w", "python",
                                              "", api_name="/compare")
    assert "| ar |" in md and "| srsd |" in md and "Speed-up" in md
    assert edited.strip() and "tokens/s" in stats


def test_chat_error_is_a_message_not_a_dead_page(gclient, ui_url):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="Type a message"):
        gclient.predict("   ", [], "", "srsd", 0.0, 10, "", api_name="/chat")
    out = gclient.predict("Hi", [], "", "ar", 0.0, 5, "", api_name="/chat")
    assert out[0][-1]["role"] == "assistant"
    assert httpx.get(ui_url, timeout=30).status_code == 200


def test_chat_and_editor_take_an_optional_json_schema(gclient):
    from gradio_client.exceptions import AppError

    schema = ('{"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, '
              '"required": ["answer"]}')
    out = gclient.predict("Is water wet? Answer in JSON.", [], "", "srsd", 0.0, 40, schema,
                          api_name="/chat")
    reply = out[0][-1]["content"]
    reply = reply if isinstance(reply, str) else "".join(p.get("text", "") for p in reply)
    assert json.loads(reply)["answer"] in ("yes", "no")
    with pytest.raises(AppError, match="JSON schema: not valid JSON"):
        gclient.predict("Hi", [], "", "ar", 0.0, 5, "{nope", api_name="/chat")
    with pytest.raises(AppError, match="invalid json_schema at properties/answer"):
        gclient.predict("Hi", [], "", "ar", 0.0, 5,
                        '{"properties": {"answer": {"type": 5}}}', api_name="/chat")
    title = ('{"type": "object", "properties": {"title": {"type": "string"}}, '
             '"required": ["title"], "additionalProperties": false}')
    edited = gclient.predict('{"name": "x"}', "rename the key name to title", "text", "srsd",
                             title, api_name="/edit")[0]
    assert "title" in json.loads(edited)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run "
                    "installs it)")
def test_screenshots_are_real(ui_url, tmp_path):
    import numpy as np
    from PIL import Image

    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "ui_screenshot.py"),
                           "--url", ui_url, "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for tab in ("chat", "editor", "stats"):
        img = Image.open(tmp_path / f"ui-{tab}.png").convert("RGB")
        assert img.size == (1280, 900)
        a = np.asarray(img).astype(np.int16)
        assert a.std() > 10, f"{tab} screenshot is blank"
        assert len(np.unique(a.reshape(-1, 3), axis=0)) > 50


def test_cancelling_a_chat_stops_the_generation(gclient):
    import time as _time

    job = gclient.submit("Tell me a very long story about a dragon.", [], "", "srsd", 0.9,
                         2048, "", api_name="/chat")
    deadline = _time.time() + 60
    while not job.outputs() and _time.time() < deadline:
        _time.sleep(0.1)
    assert job.outputs(), "the chat did not start streaming"
    job.cancel()
    t0 = _time.time()
    out = gclient.predict("Hi", [], "", "ar", 0.0, 5, "", api_name="/chat")
    assert out[0][-1]["role"] == "assistant"
    # 2048 tokens take ~20 s here: the cancelled generation did not run to the end
    assert _time.time() - t0 < 10


def _ui_call(ui_url: str, route: str, data: list) -> list:
    """A UI event through Gradio's queue API: its last output."""
    import json

    r = httpx.post(f"{ui_url}gradio_api/call/{route}", json={"data": data}, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.get(f"{ui_url}gradio_api/call/{route}/{r.json()['event_id']}", timeout=300)
    events = r.text.split("event: ")
    assert events[-1].startswith("complete"), r.text[-500:]
    return json.loads(events[-1].split("data: ", 1)[1])


def test_model_picker_lists_and_switches_models(ui_url, gclient, engine, model_path):
    first = model_path.stem
    picker = _ui_call(ui_url, "models", [])[0]
    choices = [c[0] if isinstance(c, list) else c for c in picker["choices"]]
    assert picker["value"] == first and choices[0] == first and SECOND_MODEL in choices
    status = gclient.predict(SECOND_MODEL, api_name="/switch_model")
    try:
        assert f"Loaded {SECOND_MODEL}" in status, status
        assert _ui_call(ui_url, "models", [])[0]["value"] == SECOND_MODEL
        msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
        out = gclient.predict(msgs[0]["content"], [], "", "ar", 0.0, 24, "", api_name="/chat")
        reply = out[0][-1]["content"]
        reply = reply if isinstance(reply, str) else "".join(p.get("text", "") for p in reply)
        # the same weights; the chat box drops the reply's trailing whitespace
        assert reply.rstrip() == engine.chat(msgs, max_tokens=24, mode="ar").text.rstrip()
    finally:  # the other tests of this module expect the first model
        status = gclient.predict(first, api_name="/switch_model")
    assert f"Loaded {first}" in status, status
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="not found"):
        gclient.predict("no-such-model", api_name="/switch_model")
    assert _ui_call(ui_url, "models", [])[0]["value"] == first

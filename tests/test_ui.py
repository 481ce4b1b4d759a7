"""The Gradio app on the real default model, driven with gradio_client, and its screenshots
in headless Chromium."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import start_cli_server

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
def ui_url(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the server's caches: not the user's
        mp.setenv("SRSD_CACHE_DIR", str(tmp_path_factory.mktemp("srsd-cache")))
        proc, base, _ = start_cli_server(["ui"])
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
                          0.0, 40, api_name="/chat")
    history, cleared, stats, tokens = out[:4]
    assert cleared == ""
    assert history[0]["role"] == "user" and history[-1]["role"] == "assistant"
    reply = history[-1]["content"]
    reply = reply if isinstance(reply, str) else "".join(p.get("text", "") for p in reply)
    msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    ref = engine.chat(msgs, max_tokens=40, mode="ar")
    assert reply == ref.text
    assert "tokens/s" in stats and "mode ar" in stats
    pieces = tokens if isinstance(tokens, list) else tokens.get("value", tokens)
    assert "".join(p["token"] if isinstance(p, dict) else p[0] for p in pieces) == ref.text
    # with SRSD on a reply that repeats its input, some tokens come from accepted drafts
    prompt = "Repeat exactly: " + " ".join(["alpha beta gamma delta"] * 6)
    out = gclient.predict(prompt, [], "", "srsd", 0.0, 60, api_name="/chat")
    assert "mode srsd" in out[2]
    pieces = out[3] if isinstance(out[3], list) else out[3].get("value", out[3])
    labels = [p.get("class_or_confidence") if isinstance(p, dict) else p[1] for p in pieces]
    assert any(lab for lab in labels), "no token was marked as coming from a draft"


def test_edit_streams_result_and_diff(gclient, engine):
    instr = "rename result to value"
    edited, stats, diff = gclient.predict(CODE, instr, "python", "ar", api_name="/edit")[:3]
    ref = engine.generate(edit_prompt(CODE, instr, "python"), stop=edit_stop(instr, "python"),
                          max_tokens=edit_max_tokens(len(engine.tokenize(CODE))), mode="ar")
    assert edited.rstrip("\n") == ref.text.rstrip("\n") and edited.strip()
    assert diff.rstrip("\n") == unified_diff(CODE, edited_text(ref.text, CODE)).rstrip("\n")
    assert "tokens/s" in stats and "tokens/step" in stats


def test_editor_renames_on_the_default_base_model(gclient):
    # the few-shot prompt makes the base model really edit: "value" where "result" was
    edited, _stats, diff = gclient.predict(CODE, "rename result to value", "python", "srsd",
                                           api_name="/edit")[:3]
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
                                              api_name="/compare")
    assert "| ar |" in md and "| srsd |" in md and "Speed-up" in md
    assert edited.strip() and "tokens/s" in stats


def test_chat_error_is_a_message_not_a_dead_page(gclient, ui_url):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="Type a message"):
        gclient.predict("   ", [], "", "srsd", 0.0, 10, api_name="/chat")
    out = gclient.predict("Hi", [], "", "ar", 0.0, 5, api_name="/chat")
    assert out[0][-1]["role"] == "assistant"
    assert httpx.get(ui_url, timeout=30).status_code == 200


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
                         2048, api_name="/chat")
    deadline = _time.time() + 60
    while not job.outputs() and _time.time() < deadline:
        _time.sleep(0.1)
    assert job.outputs(), "the chat did not start streaming"
    job.cancel()
    t0 = _time.time()
    out = gclient.predict("Hi", [], "", "ar", 0.0, 5, api_name="/chat")
    assert out[0][-1]["role"] == "assistant"
    # 2048 tokens take ~20 s here: the cancelled generation did not run to the end
    assert _time.time() - t0 < 10

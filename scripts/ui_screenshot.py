"""Open each tab of the srsd-local UI in headless Chromium and save one PNG per tab.

Usage:
    python scripts/ui_screenshot.py --out docs/img [--url http://127.0.0.1:7860/]
                                    [--chromium /usr/bin/chromium]

Without --url it starts `srsd-local ui` on a free port with the default model, waits until
the model is loaded, fills the chat and the editor with a short real example so the
screenshots show the UI at work, and stops the server afterwards. Needs the `playwright`
Python package (only its driver is used) and a Chromium (Debian's `chromium` package).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TABS = ("Chat", "Editor", "Stats")
EXAMPLE_CODE = '''def area(width, height):
    """Area of a rectangle."""
    result = width * height
    return result
'''


def find_chromium(given: str | None) -> str:
    for cand in (given, os.environ.get("CHROMIUM"), shutil.which("chromium"),
                 shutil.which("chromium-browser"), shutil.which("google-chrome")):
        if cand and Path(cand).exists():
            return cand
    raise SystemExit("no Chromium found: install Debian's `chromium` package or pass "
                     "--chromium PATH")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the UI server exited early")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(base + "health", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.3)
    raise SystemExit("the UI server did not load the model in time")


@contextlib.contextmanager
def ui_server(url: str | None):
    if url:
        yield url if url.endswith("/") else url + "/"
        return
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "srsd_local.cli", "ui", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/"
    try:
        _wait_healthy(base, proc)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def shoot(url: str, out: Path, chromium: str, width: int = 1280, height: int = 900) -> list[Path]:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"])
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(url, wait_until="networkidle", timeout=120_000)
        page.get_by_text("Model:", exact=False).first.wait_for(timeout=120_000)
        # a short real chat turn and a real edit, so the screenshots show results
        page.locator("#chat-input textarea").fill("Write a Python function that adds two "
                                                  "numbers.")
        page.get_by_role("button", name="Send").click()
        page.locator("#chat-stats").get_by_text("tokens/s").wait_for(timeout=120_000)
        for tab in TABS:
            page.get_by_role("tab", name=tab).click()
            if tab == "Editor":
                page.locator("#original .cm-content").fill(EXAMPLE_CODE)
                page.get_by_label("Instruction").fill("rename result to value")
                page.get_by_role("button", name="Edit", exact=True).click()
                page.locator("#edit-stats").get_by_text("tokens/s").wait_for(timeout=120_000)
            page.wait_for_timeout(800)
            path = out / f"ui-{tab.lower()}.png"
            page.screenshot(path=str(path), full_page=False)
            paths.append(path)
        browser.close()
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--url", default=None)
    ap.add_argument("--chromium", default=None)
    args = ap.parse_args(argv)
    chromium = find_chromium(args.chromium)
    with ui_server(args.url) as url:
        for p in shoot(url, Path(args.out), chromium):
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A non-editable install (`pip install .`) ships the applications: `srsd_local.app` comes from
the top-level app/ folder, and `srsd-local serve` / `srsd-local ui` import it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_non_editable_install_ships_app_and_data(tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
                           "--target", str(target), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pkg = target / "srsd_local"
    for rel in ("app/server.py", "app/ui.py", "app/main.py", "llama/_capture.c",
                "llama/_argmax.c", "llama/_grammar.c", "bench/_cloop.c", "spec/_kernels.c",
                "data/default_calibration.json", "bench/workloads/code_edit.jsonl",
                "bench/workloads/calibration.jsonl"):
        assert (pkg / rel).is_file(), rel
    assert not (target / "app").exists()  # no top-level package that could collide
    # run from outside the checkout, with the installed copy first on the path
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = ("import srsd_local.app.main as m, srsd_local.cli as c; "
            "print(m.__file__); c.build_parser().parse_args(['serve', '--no-ui']); "
            "c.build_parser().parse_args(['ui'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith(str(target))
    helped = subprocess.run([sys.executable, "-m", "srsd_local.cli", "serve", "--help"],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert helped.returncode == 0 and "--no-ui" in helped.stdout

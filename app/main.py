"""Composition: one Service, the HTTP API on it and, optionally, the UI mounted beside it.

- `srsd-local serve`: the API, and the UI under /ui unless --no-ui (`serve`).
- `srsd-local ui`: the UI at /, the API endpoints along with it (`run_ui`).

The API (app/server.py) and the UI (app/ui.py) know only the Service (app/service.py), not
each other.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .server import create_app
from .service import Service


def build_app(service: Service, ui_path: str | None = "/ui") -> Any:
    """The FastAPI app of `service`, with the UI mounted at `ui_path` (None: no UI)."""
    app = create_app(service)
    if ui_path is not None:
        from .ui import mount_ui  # noqa: PLC0415  (gradio is slow to import)

        mount_ui(app, service, path=ui_path)
    return app


def _run(app: Any, args: argparse.Namespace) -> int:
    import uvicorn  # noqa: PLC0415

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def serve(args: argparse.Namespace, load: Callable[[], Any]) -> int:
    """`srsd-local serve` (load: builds the Engine, in the background)."""
    service = Service(load, model_id=args.alias, api_key=args.api_key, mode=args.mode,
                      max_queue=args.max_queue)
    return _run(build_app(service, ui_path=None if args.no_ui else "/ui"), args)


def run_ui(args: argparse.Namespace, load: Callable[[], Any]) -> int:
    """`srsd-local ui`: the UI at / (the API endpoints come along)."""
    app = build_app(Service(load), ui_path="/")
    print(f"srsd-local UI on http://{args.host}:{args.port}/", flush=True)
    return _run(app, args)

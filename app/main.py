"""Composition: one Service, the HTTP API on it and, optionally, the UI mounted beside it.

- `srsd-local serve`: the API, and the UI under /ui unless --no-ui (`serve`).
- `srsd-local ui`: the UI at /, the API endpoints along with it (`run_ui`).

The API (app/server.py) and the UI (app/ui.py) know only the Service (app/service.py), not
each other. The guards of app/guard.py (Host, API key, body) wrap both.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection
from typing import Any

from .guard import allowed_hosts
from .lifecycle import check_model_file, run_server
from .server import create_app
from .service import Service


def build_app(service: Service, ui_path: str | None = "/ui",
              hosts: Collection[str] | None = None, cors_origins: Collection[str] = ()) -> Any:
    """The FastAPI app of `service`, with the UI mounted at `ui_path` (None: no UI); hosts:
    the Host names answered (None: any); cors_origins: origins allowed by CORS."""
    app = create_app(service, allowed_hosts=hosts, cors_origins=cors_origins)
    if ui_path is not None:
        from .ui import mount_ui  # noqa: PLC0415  (gradio is slow to import)

        mount_ui(app, service, path=ui_path)
    return app


def _run(service: Service, args: argparse.Namespace, ui_path: str | None,
         banner: str | None = None) -> int:
    check_model_file(getattr(args, "model", None))
    if banner:
        print(banner, flush=True)
    app = build_app(service, ui_path=ui_path,
                    hosts=allowed_hosts(args.host, getattr(args, "allowed_host", None) or ()),
                    cors_origins=getattr(args, "cors_origin", None) or ())
    host, port = args.host, args.port
    if getattr(args, "rpc_internal_port", None):  # behind the RPC supervisor (supervisor.py)
        host, port = "127.0.0.1", args.rpc_internal_port
    return run_server(app, service, host, port)


def serve(args: argparse.Namespace, load: Callable[[], Any],
          load_model: Callable[[Any], Any] | None = None) -> int:
    """`srsd-local serve` (load: builds the Engine, in the background; load_model(path):
    builds the Engine of another model a request names, None: no switching)."""
    service = Service(load, model_id=args.alias, api_key=args.api_key, mode=args.mode,
                      max_queue=args.max_queue, load_model=load_model,
                      max_models=getattr(args, "max_models", 1))
    return _run(service, args, None if args.no_ui else "/ui")


def run_ui(args: argparse.Namespace, load: Callable[[], Any],
           load_model: Callable[[Any], Any] | None = None) -> int:
    """`srsd-local ui`: the UI at / (the API endpoints come along)."""
    service = Service(load, api_key=getattr(args, "api_key", None), load_model=load_model,
                      max_models=getattr(args, "max_models", 1))
    return _run(service, args, "/", banner=f"srsd-local UI on http://{args.host}:{args.port}/")

"""Starting and stopping a server process: the model file checked before anything listens,
uvicorn run until SIGTERM/SIGINT or a failed model load, and a graceful shutdown.

- A model path that is not a readable GGUF (a text file, a directory, a header cut short)
  stops `serve`/`ui` before they listen, with a message that names the path and never shows
  the file's contents. A model that passes that check but fails to load (a truncated file)
  stops the server as soon as the load fails: the message on stderr, exit status 1.
- SIGTERM: the listening socket closes, queued requests get 503, the running generations
  stop at their next step (a stream ends with an error event), and the process exits within
  seconds (uvicorn's graceful timeout cuts anything left after GRACEFUL_S).
"""

from __future__ import annotations

import struct
from pathlib import Path
from types import FrameType
from typing import Any

from .service import Service

GRACEFUL_S = 5
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (1, 2, 3)
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count


def check_model_file(model: str | None) -> None:
    """ValueError when `model` is an existing path that is not a readable GGUF file. Other
    specs (default, a model's name, a Hugging Face repo, a path that does not exist) are the
    loader's: its errors name the spec, and a load failure stops the server too."""
    if model is None:
        return
    path = Path(model).expanduser()
    if not path.exists():
        return
    if not path.is_file():
        raise ValueError(f"model path {str(path)!r} is not a file; give a .gguf file")
    try:
        with path.open("rb") as f:
            head = f.read(_HEADER.size)
    except OSError as exc:
        raise ValueError(f"model file {str(path)!r} is not readable ({exc.strerror})") from None
    if head[:4] != GGUF_MAGIC:
        raise ValueError(f"model file {str(path)!r} is not a GGUF file (it does not start "
                         "with the GGUF magic number); give a .gguf file")
    if len(head) < _HEADER.size:
        raise ValueError(f"model file {str(path)!r} is truncated: {len(head)} bytes, shorter "
                         f"than a GGUF header ({_HEADER.size} bytes)")
    version = _HEADER.unpack(head)[1]
    if version not in GGUF_VERSIONS:
        raise ValueError(f"model file {str(path)!r} is GGUF version {version}; accepted are "
                         f"versions {', '.join(map(str, GGUF_VERSIONS))}")


def run_server(app: Any, service: Service, host: str, port: int) -> int:
    """Serve `app` until a signal (0) or a failed model load (RuntimeError, for the CLI's
    'error:' line and exit status 1)."""
    import uvicorn  # noqa: PLC0415

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)  # uvicorn (and sse-starlette's hook)
            service.request_shutdown()

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                   timeout_graceful_shutdown=GRACEFUL_S))
    failed: list[str] = []

    def load_failed(message: str) -> None:
        failed.append(message)
        server.should_exit = True  # read by uvicorn's main loop every 0.1 s

    service.on_load_error = load_failed
    server.run()
    if failed:
        raise RuntimeError(f"the model could not be loaded: {failed[0]}")
    return 0

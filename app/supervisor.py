"""Commands with --rpc run in a child process, because llama.cpp's RPC backend ends the whole
process (abort) when a worker it talks to stops answering.

- `run_command` (generate, bench, calibrate, verify): the child does the work with the
  terminal's stdin/stdout/stderr; if it is killed by that abort, the parent says which
  workers stopped answering instead of a crash report, and exits with status 1.
- `Supervisor` (serve, ui): the child is the real server on a loopback port; the parent
  listens where the user asked and passes every request through. When the child dies, a
  request in flight ends with 503 in OpenAI's error shape (a stream: an error event), new
  requests get 503 with Retry-After while the parent waits for the workers to answer again
  and starts a new child (which reloads the model), and then it serves as before. A child
  that fails at its first start (a worker down, a bad model) stops the parent with the
  child's error message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from srsd_local.llama.rpc import dead_workers

CHILD_FLAG = "--rpc-child"
PORT_FLAG = "--rpc-internal-port"
RETRY_AFTER_S = 5
PROBE_EVERY_S = 1.0
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailer", "transfer-encoding", "upgrade", "content-length"}


def _child_cmd(argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "srsd_local.cli", *argv, CHILD_FLAG]


def _child_env() -> dict[str, str]:
    # ggml would otherwise attach a debugger to print a backtrace before aborting
    return {**os.environ, "GGML_NO_BACKTRACE": "1"}


def _say(text: str) -> None:
    print(f"srsd-local: {text}", file=sys.stderr, flush=True)


def death_message(returncode: int, endpoints: Sequence[str]) -> str:
    """Why a child ended by a signal: the workers that no longer answer, if any."""
    try:
        sig = signal.Signals(-returncode).name
    except ValueError:
        sig = f"signal {-returncode}"
    dead = dead_workers(endpoints)
    if dead:
        return (f"RPC worker{'s' if len(dead) > 1 else ''} {', '.join(dead)} stopped answering "
                f"mid-run (llama.cpp's RPC backend then ends the process: {sig}); restart "
                f"{'them' if len(dead) > 1 else 'it'} (srsd-local rpc-worker) and run again")
    return (f"the run ended with {sig} (llama.cpp's RPC backend ends the process when a "
            f"worker connection fails; every worker answers now: {', '.join(endpoints)})")


def run_command(argv: Sequence[str], endpoints: Sequence[str]) -> int:
    """Run `srsd-local ARGV` in a child process; a crash caused by a worker is one clear
    error line and exit status 1."""
    proc = subprocess.Popen(_child_cmd(argv), env=_child_env())
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # the child got the same Ctrl-C
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        return 130
    if rc < 0 and -rc not in (signal.SIGINT, signal.SIGTERM):
        _say("error: " + death_message(rc, endpoints))
        return 1
    return rc


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unavailable_body() -> dict[str, Any]:
    return {"error": {"message": "an RPC worker holding part of the model stopped answering; "
                                 "the server reloads the model when every worker answers "
                                 "again: retry later",
                      "type": "server_error", "param": None, "code": "rpc_worker_unavailable"}}


class Supervisor:
    """`serve`/`ui` with --rpc: the real server in a child process, restarted when it dies."""

    def __init__(self, argv: Sequence[str], endpoints: Sequence[str], host: str,
                 port: int) -> None:
        self.argv = list(argv)
        self.endpoints = list(endpoints)
        self.host, self.port = host, port
        self.internal_port = free_port()
        self.child: asyncio.subprocess.Process | None = None
        self.ready = False  # the child answered /health with 200 since it started
        self.served = False  # some child was ready once
        self.stopping = False
        self.exit_code = 0
        self.restarts = 0
        self._server: Any = None
        self._client: Any = None

    # -- the child --------------------------------------------------------------------------
    async def _start_child(self) -> asyncio.subprocess.Process:
        cmd = _child_cmd([*self.argv, PORT_FLAG, str(self.internal_port)])
        return await asyncio.create_subprocess_exec(*cmd, env=_child_env(),
                                                    start_new_session=True)

    async def _watch_ready(self, child: asyncio.subprocess.Process) -> None:
        while child.returncode is None and not self.stopping:
            try:
                r = await self._client.get("/health", timeout=2.0)
                if r.status_code == 200:
                    if self.restarts:
                        _say(f"the model is loaded again; serving on {self.host}:{self.port}")
                    self.ready = self.served = True
                    return
            except Exception:  # not listening yet
                pass
            await asyncio.sleep(0.25)

    async def _wait_for_workers(self) -> None:
        while not self.stopping:
            dead = await asyncio.to_thread(dead_workers, self.endpoints)
            if not dead:
                return
            await asyncio.sleep(PROBE_EVERY_S)

    async def run_children(self) -> None:
        while not self.stopping:
            self.ready = False
            self.child = child = await self._start_child()
            watch = asyncio.create_task(self._watch_ready(child))
            rc = await child.wait()
            watch.cancel()
            self.ready = False
            if self.stopping:
                return
            if not self.served:  # the first start failed: its message is on stderr already
                self.exit_code = rc if rc > 0 else 1
                if rc < 0:
                    _say("error: " + death_message(rc, self.endpoints))
                self._server.should_exit = True
                return
            why = (death_message(rc, self.endpoints) if rc < 0
                   else f"the server process exited with status {rc}")
            _say(f"{why}; requests get 503 until the model is loaded again")
            await self._wait_for_workers()
            self.restarts += 1

    async def stop_child(self) -> None:
        self.stopping = True
        child = self.child
        if child is None or child.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(child.wait(), timeout=10)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await child.wait()

    # -- the proxy --------------------------------------------------------------------------
    def app(self) -> Any:
        import httpx  # noqa: PLC0415
        from starlette.applications import Starlette  # noqa: PLC0415
        from starlette.requests import Request  # noqa: PLC0415
        from starlette.responses import JSONResponse, Response, StreamingResponse  # noqa: PLC0415
        from starlette.routing import Route  # noqa: PLC0415

        sup = self

        @contextlib.asynccontextmanager
        async def lifespan(_app: Any) -> AsyncIterator[None]:
            sup._client = httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{sup.internal_port}",
                timeout=httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None))
            task = asyncio.create_task(sup.run_children())
            try:
                yield
            finally:
                await sup.stop_child()
                task.cancel()
                await sup._client.aclose()

        def unavailable(path: str) -> Response:
            if path == "/health":
                return JSONResponse({"status": "loading model"}, 503)
            return JSONResponse(unavailable_body(), 503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})

        async def proxy(request: Request) -> Response:
            path = request.url.path
            if not sup.ready:
                return unavailable(path)
            headers = [(k, v) for k, v in request.headers.raw
                       if k.decode("latin-1").lower() not in HOP_BY_HOP]
            query = request.url.query
            upstream = sup._client.build_request(
                request.method, path + (f"?{query}" if query else ""), headers=headers,
                content=await request.body())
            try:
                resp = await sup._client.send(upstream, stream=True)
            except httpx.TransportError:  # the child died before it answered
                return unavailable(path)
            sse = resp.headers.get("content-type", "").startswith("text/event-stream")

            async def body() -> AsyncIterator[bytes]:
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                except httpx.TransportError:  # the child died mid-stream
                    if sse:
                        yield ("data: " + json.dumps(unavailable_body()) + "\n\n").encode()
                finally:
                    await resp.aclose()

            out = [(k, v) for k, v in resp.headers.raw
                   if k.decode("latin-1").lower() not in HOP_BY_HOP]
            response = StreamingResponse(body(), status_code=resp.status_code)
            response.raw_headers = out  # the child's, as they were
            return response

        methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
        routes = [Route("/", proxy, methods=methods),
                  Route("/{path:path}", proxy, methods=methods)]
        return Starlette(routes=routes, lifespan=lifespan)

    def run(self) -> int:
        import uvicorn  # noqa: PLC0415

        self._server = uvicorn.Server(uvicorn.Config(self.app(), host=self.host, port=self.port,
                                                     log_level="warning"))
        self._server.run()
        return self.exit_code


def run_server(argv: Sequence[str], endpoints: Sequence[str], host: str, port: int) -> int:
    """`serve`/`ui` with --rpc, supervised (see the module's docstring)."""
    return Supervisor(argv, endpoints, host, port).run()

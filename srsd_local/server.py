"""OpenAI-compatible HTTP server over one Engine.

- One engine, one generation at a time: requests wait in a bounded FIFO queue (429 when
  full) and a request never interrupts another.
- Generation runs step by step on one worker thread; between steps the handler checks
  whether the client went away, so a dropped client stops its generation within one step.
- Every error is answered in OpenAI's shape {"error": {"message", "type", "param", "code"}};
  bad input is a 4xx, never a 500, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request

from .config import MODES

MAX_BODY_BYTES = 8 << 20


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# -- request parsing (plain dicts: every check gives OpenAI's 400 with the field name) ----------
def _opt(body: dict, key: str, types: tuple, default: Any, check: Callable[[Any], bool]
         = lambda v: True, accepted: str = "") -> Any:
    if key not in body or body[key] is None:
        return default
    v = body[key]
    if isinstance(v, bool) and bool not in types or not isinstance(v, types) or not check(v):
        raise APIError(400, f"invalid '{key}': {json.dumps(v)[:80]}; accepted: {accepted}",
                       param=key, code="invalid_value")
    return v


@dataclass
class GenRequest:
    kind: str  # "completion" | "chat"
    prompt: str | list[int] | None
    messages: list[dict] | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    mode: str | None
    model: str | None


def parse_request(body: Any, kind: str) -> GenRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = _opt(body, "model", (str,), None, accepted="a string")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty array of {role, content}",
                           param="messages", code="invalid_value")
        prompt = None
    else:
        messages = None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        ok = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt))
        if not ok:
            raise APIError(400, "'prompt' must be a string (or one token-id array); batches of "
                           "prompts are not supported", param="prompt", code="invalid_value")
    max_tokens = _opt(body, "max_completion_tokens", (int,), None, lambda v: v >= 1,
                      "an integer >= 1")
    if max_tokens is None:
        max_tokens = _opt(body, "max_tokens", (int,), None, lambda v: v >= 1, "an integer >= 1")
    _opt(body, "n", (int,), 1, lambda v: v == 1, "only 1 (one choice per request)")
    stop = body.get("stop")
    if stop is None:
        stop_list: list[str] = []
    elif isinstance(stop, str):
        stop_list = [stop]
    elif isinstance(stop, list) and len(stop) <= 16 and all(isinstance(s, str) for s in stop):
        stop_list = list(stop)
    else:
        raise APIError(400, "'stop' must be a string or an array of up to 16 strings",
                       param="stop", code="invalid_value")
    so = _opt(body, "stream_options", (dict,), {}, accepted="an object")
    ext = _opt(body, "srsd", (dict,), {}, accepted='an object such as {"mode": "srsd"}')
    mode = ext.get("mode")
    if mode is not None and mode not in MODES:
        raise APIError(400, f"invalid 'srsd.mode': {mode!r}; accepted: {', '.join(MODES)}",
                       param="srsd.mode", code="invalid_value")
    num = (int, float)
    return GenRequest(
        kind=kind, prompt=prompt, messages=messages, max_tokens=max_tokens,
        temperature=float(_opt(body, "temperature", num, 1.0, lambda v: 0 <= v <= 2,
                               "a number in [0, 2]")),
        top_p=float(_opt(body, "top_p", num, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        top_k=_opt(body, "top_k", (int,), 0, lambda v: v >= 0, "an integer >= 0"),
        min_p=float(_opt(body, "min_p", num, 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]")),
        seed=_opt(body, "seed", (int,), None, lambda v: v >= 0, "an integer >= 0"),
        stop=stop_list,
        stream=_opt(body, "stream", (bool,), False, accepted="true or false"),
        include_usage=bool(_opt(so, "include_usage", (bool,), False, accepted="true or false")),
        mode=mode, model=model)


# -- metrics --------------------------------------------------------------------------------------
class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge  # noqa: PLC0415

        self.registry = r = CollectorRegistry()
        self.requests = Counter("srsd_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("srsd_prompt_tokens", "Prompt tokens", registry=r)
        self.generated_tokens = Counter("srsd_generated_tokens", "Generated tokens", registry=r)
        self.tokens_per_second = Gauge("srsd_tokens_per_second",
                                       "Generation speed of the last request", registry=r)
        self.drafts = Counter("srsd_drafts", "Speculative trees verified", registry=r)
        self.draft_tokens = Counter("srsd_draft_tokens", "Drafted tokens verified", registry=r)
        self.accepted_tokens = Counter("srsd_accepted_tokens", "Drafted tokens accepted",
                                       registry=r)
        self.accepted_per_position = Counter("srsd_accepted_per_position",
                                             "Accepted drafted tokens by draft position",
                                             ["position"], registry=r)
        self.queue_length = Gauge("srsd_queue_length", "Requests waiting for the engine",
                                  registry=r)

    def record(self, stats) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated_tokens.inc(stats.tokens)
        self.tokens_per_second.set(stats.tokens_per_second)
        self.drafts.inc(stats.drafts)
        self.draft_tokens.inc(stats.draft_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        for d, n in enumerate(stats.accepted_per_depth, 1):
            if n:
                self.accepted_per_position.labels(str(d)).inc(n)

    def render(self) -> bytes:
        from prometheus_client import generate_latest  # noqa: PLC0415

        return generate_latest(self.registry)


# -- the engine slot: FIFO, bounded ----------------------------------------------------------------
class EngineSlot:
    def __init__(self, max_queue: int, metrics: Metrics) -> None:
        self.max_queue = max_queue
        self.metrics = metrics
        self._lock = asyncio.Lock()
        self.waiting = 0
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def acquire(self) -> None:
        if self.waiting >= self.max_queue and self._lock.locked():
            raise APIError(429, f"the server is busy: {self.waiting} requests are waiting "
                           f"(--max-queue {self.max_queue}); retry later",
                           type_="rate_limit_error", code="queue_full")
        self.waiting += 1
        self.metrics.queue_length.set(self.waiting)
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1
            self.metrics.queue_length.set(self.waiting)

    def release(self) -> None:
        self._lock.release()

    async def run(self, fn: Callable, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, fn, *args)


_END = object()


def _next(gen: Iterator) -> Any:
    return next(gen, _END)


class Service:
    """Holds the engine (loaded in the background) and serves requests."""

    def __init__(self, load: Callable[[], Any], model_id: str | None = None,
                 api_key: str | None = None, mode: str | None = None, max_queue: int = 16
                 ) -> None:
        self.engine = None
        self.load_error: str | None = None
        self.model_id = model_id
        self.api_key = api_key
        self.mode = mode
        self.metrics = Metrics()
        self.max_queue = max_queue
        self._load = load
        self.slot: EngineSlot | None = None
        self.ready = threading.Event()

    def start_loading(self) -> None:
        def work() -> None:
            try:
                eng = self._load()
                if self.model_id is None:
                    self.model_id = Path(eng.backend.model_path).stem
                self.engine = eng
            except Exception as exc:  # reported by /health and every request
                self.load_error = str(exc)
            finally:
                self.ready.set()

        threading.Thread(target=work, name="model-loader", daemon=True).start()

    def model_ids(self) -> set[str]:
        eng = self.engine
        ids = {self.model_id}
        if eng is not None:
            ids |= {Path(eng.backend.model_path).name, eng.model_name}
        return ids

    def check_ready(self) -> None:
        if self.load_error:
            raise APIError(503, f"the model failed to load: {self.load_error}",
                           type_="server_error", code="model_load_failed")
        if self.engine is None:
            raise APIError(503, "the model is still loading", type_="server_error",
                           code="model_loading")

    def check_key(self, headers) -> None:
        if not self.api_key:
            return
        auth = headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if token != self.api_key:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           type_="authentication_error", code="invalid_api_key")

    # -- generation ------------------------------------------------------------------------
    def _prepare(self, req: GenRequest) -> tuple[list[int], dict[str, Any]]:
        eng = self.engine
        if req.model is not None and req.model not in self.model_ids():
            raise APIError(404, f"model {req.model!r} not found; this server serves "
                           f"{self.model_id!r} (GET /v1/models)", param="model",
                           code="model_not_found")
        try:
            if req.kind == "chat":
                text = eng.apply_chat_template(req.messages)
                tokens = eng.tokenize(text)
            elif isinstance(req.prompt, str):
                tokens = eng.tokenize(req.prompt)
            else:
                bad = [t for t in req.prompt if t >= eng.backend.n_vocab]
                if bad:
                    raise ValueError(f"token id {bad[0]} is out of range (vocabulary of "
                                     f"{eng.backend.n_vocab})")
                tokens = list(req.prompt)
        except ValueError as exc:
            param = "messages" if req.kind == "chat" else "prompt"
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc
        n_ctx = eng.backend.n_ctx
        room = n_ctx - len(tokens)
        max_tokens = req.max_tokens if req.max_tokens is not None else max(room, 0)
        if len(tokens) + max_tokens > n_ctx or room <= 0:
            raise APIError(400, f"this model's context is {n_ctx} tokens; the prompt has "
                           f"{len(tokens)} and max_tokens is {max_tokens} (together "
                           f"{len(tokens) + max_tokens}); shorten the prompt or lower "
                           "max_tokens", param="max_tokens", code="context_length_exceeded")
        kwargs = dict(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                      top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop or None,
                      mode=req.mode or self.mode)
        return tokens, kwargs

    async def events(self, req: GenRequest, disconnected: Callable[[], Any]
                     ) -> AsyncIterator[Any]:
        """Engine events for one request, holding the engine slot throughout."""
        assert self.slot is not None
        await self.slot.acquire()
        gen = None
        try:
            tokens, kwargs = self._prepare(req)
            try:
                gen = self.engine.stream(tokens, **kwargs)
            except ValueError as exc:
                raise APIError(400, str(exc), code="invalid_value") from exc
            while True:
                try:
                    ev = await self.slot.run(_next, gen)
                except ValueError as exc:
                    raise APIError(400, str(exc), code="invalid_value") from exc
                if ev is _END:
                    return
                if ev.stats is not None:
                    self.metrics.record(ev.stats)
                yield ev
                if ev.finish_reason is not None:
                    return
                if await disconnected():
                    return
        finally:
            # close the generation on the engine thread (after a step in flight, FIFO) and
            # free the slot without awaiting anything: a cancelled task may not await again
            if gen is not None:
                asyncio.get_running_loop().run_in_executor(self.slot.executor, gen.close)
            self.slot.release()


def timings(stats) -> dict[str, Any]:
    return {
        "prompt_n": stats.prompt_tokens - stats.reused_prompt_tokens,
        "prompt_ms": stats.prompt_seconds * 1000.0,
        "cache_n": stats.reused_prompt_tokens,
        "predicted_n": stats.tokens,
        "predicted_ms": stats.seconds * 1000.0,
        "predicted_per_second": stats.tokens_per_second,
        "draft_n": stats.draft_tokens,
        "draft_n_accepted": stats.accepted_tokens,
        "mean_accepted_length": stats.mean_accepted_length,
        "mode": stats.mode,
    }


def usage(stats) -> dict[str, int]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.tokens,
            "total_tokens": stats.prompt_tokens + stats.tokens}


async def never_disconnected() -> bool:
    return False


def create_app(service: Service, ui: bool = False):
    from fastapi import FastAPI  # noqa: PLC0415
    from fastapi.responses import JSONResponse, Response  # noqa: PLC0415
    from sse_starlette.sse import EventSourceResponse  # noqa: PLC0415

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        service.slot = EngineSlot(service.max_queue, service.metrics)
        service.start_loading()
        yield

    app = FastAPI(title="srsd-local", version="0.1.0", lifespan=lifespan)

    def error(exc: APIError, endpoint: str) -> JSONResponse:
        service.metrics.requests.labels(endpoint, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health():
        if service.load_error:
            return JSONResponse({"status": "error", "error": service.load_error}, 503)
        if service.engine is None:
            return JSONResponse({"status": "loading model"}, 503)
        return {"status": "ok", "model": service.model_id}

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            service.check_key(request.headers)
            service.check_ready()
        except APIError as exc:
            return error(exc, "/v1/models")
        service.metrics.requests.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [{"id": service.model_id, "object": "model",
                                            "created": 0, "owned_by": "srsd-local"}]}

    async def read_body(request: Request) -> Any:
        # (checked here rather than in an HTTP middleware: Starlette's BaseHTTPMiddleware
        # hides client disconnects from the endpoint)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is {length} bytes; the limit is "
                           f"{MAX_BODY_BYTES}", code="request_too_large")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is {len(raw)} bytes; the limit is "
                           f"{MAX_BODY_BYTES}", code="request_too_large")
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from exc

    async def handle(request: Request, kind: str):
        endpoint = request.url.path
        try:
            service.check_key(request.headers)
            body = await read_body(request)
            req = parse_request(body, kind)
            service.check_ready()
        except APIError as exc:
            return error(exc, endpoint)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"
        model = service.model_id

        if not req.stream:
            text, finish, stats = [], None, None
            try:
                async for ev in service.events(req, request.is_disconnected):
                    text.append(ev.text)
                    finish, stats = ev.finish_reason, ev.stats or stats
            except APIError as exc:
                return error(exc, endpoint)
            if stats is None:  # the client went away
                service.metrics.requests.labels(endpoint, "499").inc()
                return Response(status_code=499)
            content = "".join(text)
            choice = ({"index": 0, "message": {"role": "assistant", "content": content},
                       "logprobs": None, "finish_reason": finish} if kind == "chat" else
                      {"index": 0, "text": content, "logprobs": None, "finish_reason": finish})
            service.metrics.requests.labels(endpoint, "200").inc()
            return {"id": rid, "object": obj, "created": created, "model": model,
                    "choices": [choice], "usage": usage(stats), "timings": timings(stats)}

        chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(delta_text: str | None, finish: str | None, first: bool = False) -> str:
            if kind == "chat":
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                choice = {"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None,
                          "finish_reason": finish}
            return json.dumps({"id": rid, "object": chunk_obj, "created": created,
                               "model": model, "choices": [choice]})

        # errors found before the first event are still plain JSON errors; once streaming,
        # a client that goes away cancels this task (sse-starlette watches the connection)
        agen = service.events(req, never_disconnected)
        try:
            first_ev = await agen.__anext__()
        except StopAsyncIteration:
            return Response(status_code=499)
        except APIError as exc:
            return error(exc, endpoint)

        async def sse() -> AsyncIterator[str]:
            ok = False
            try:
                if kind == "chat":
                    yield chunk("", None, first=True)
                ev = first_ev
                while True:
                    if ev.text or ev.finish_reason is None:
                        if ev.text:
                            yield chunk(ev.text, None)
                    if ev.finish_reason is not None:
                        yield chunk(None if kind == "chat" else "", ev.finish_reason)
                        if req.include_usage:
                            yield json.dumps({"id": rid, "object": chunk_obj,
                                              "created": created, "model": model,
                                              "choices": [], "usage": usage(ev.stats),
                                              "timings": timings(ev.stats)})
                        ok = True
                        break
                    try:
                        ev = await agen.__anext__()
                    except StopAsyncIteration:
                        break
                yield "[DONE]"
            except APIError as exc:
                yield json.dumps(exc.body())
            finally:
                await agen.aclose()
                service.metrics.requests.labels(endpoint, "200" if ok else "499").inc()

        return EventSourceResponse(sse(), sep="\n", ping=None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        return error(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                              type_="server_error"), request.url.path)

    if ui:
        from .ui import mount_ui  # noqa: PLC0415

        mount_ui(app, service)
    return app


def serve(args, load: Callable[[], Any]) -> int:
    """Run the server for `srsd-local serve` (load: builds the Engine, in the background)."""
    import uvicorn  # noqa: PLC0415

    if args.max_queue < 1:
        raise ValueError(f"--max-queue {args.max_queue}: accepted is an integer >= 1")
    service = Service(load, model_id=args.alias, api_key=args.api_key, mode=args.mode,
                      max_queue=args.max_queue)
    app = create_app(service, ui=not args.no_ui)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0

"""The OpenAI-compatible HTTP API over a Service (app/service.py).

- Request and response bodies are the Pydantic models of app/schemas.py: FastAPI validates
  them and documents them in /openapi.json (and /docs).
- Every error is answered in OpenAI's shape {"error": {"message", "type", "param", "code"}}:
  invalid fields 400 (with the field in `param`), bad API key 401, unknown model 404, body
  over 8 MiB 413, queue full 429, model loading or failed 503; bad input is never a 500, and
  the server keeps serving.
- A client that goes away stops its generation within one step (non-streaming: polled
  between steps; streaming: sse-starlette cancels the response task).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from .errors import APIError
from .schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    Timings,
    Usage,
    validation_error,
)
from .service import GenRequest, Service, never_disconnected

MAX_BODY_BYTES = 8 << 20
GENERATION_PATHS = {"/v1/completions": CompletionRequest,
                    "/v1/chat/completions": ChatCompletionRequest}
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what} for code, what in (
        (400, "invalid request (`param` names the field)"), (401, "missing or wrong API key"),
        (404, "unknown model"), (413, "request body over 8 MiB"),
        (429, "queue full: retry later"), (503, "model loading, or it failed to load"))}


class BodyLimit:
    """ASGI middleware for the generation endpoints: answers 413 for a body over the limit
    (before anything reads it) and reads the body as JSON whatever its Content-Type says
    (curl -d sends form encoding). A plain ASGI class, not BaseHTTPMiddleware, so that the
    endpoints still see the client disconnect."""

    def __init__(self, app: Any, service: Service, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.service, self.limit = app, service, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or scope.get("method") != "POST" or \
                path not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.limit:
            await self._reject(scope, receive, send, int(length))
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # the client went away while sending
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._reject(scope, receive, send, size)
                return
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        headers[b"content-type"] = b"application/json"
        scope = dict(scope, headers=list(headers.items()))
        await self.app(scope, replay, send)

    async def _reject(self, scope: dict, receive: Any, send: Any, size: int) -> None:
        from starlette.datastructures import Headers  # noqa: PLC0415

        try:
            self.service.check_key(Headers(scope=scope))
            exc = APIError(413, f"request body is {size} bytes; the limit is {self.limit}",
                           code="request_too_large")
        except APIError as auth:
            exc = auth
        self.service.metrics.requests.labels(scope["path"], str(exc.status)).inc()
        await JSONResponse(exc.body(), status_code=exc.status)(scope, receive, send)


def create_app(service: Service) -> FastAPI:
    """The API app; its lifespan starts the service (queue, model loading)."""
    from sse_starlette.sse import EventSourceResponse  # noqa: PLC0415

    from .. import __version__  # noqa: PLC0415

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        yield

    app = FastAPI(title="srsd-local", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of srsd-local: completions and chat "
                              "completions (streamed or not) with speculative decoding.")
    app.add_middleware(BodyLimit, service=service)
    count = service.metrics.requests

    def error(exc: APIError, endpoint: str) -> JSONResponse:
        count.labels(endpoint, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        endpoint = request.url.path
        try:  # a bad key is answered first, as for a valid body
            service.check_key(request.headers)
        except APIError as auth:
            return error(auth, endpoint)
        errors = [dict(e, loc=tuple(e.get("loc", ()))[1:]) if tuple(e.get("loc", ()))[:1]
                  == ("body",) else e for e in exc.errors()]
        return error(validation_error(errors, GENERATION_PATHS.get(endpoint, CompletionRequest)),
                     endpoint)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                              type_="server_error"), request.url.path)

    async def authorized(request: Request) -> None:
        service.check_key(request.headers)

    @app.get("/health", response_model=Health, response_model_exclude_none=True,
             responses={503: {"model": Health, "description": "loading, or failed to load"}})
    async def health() -> Any:
        if service.load_error:
            return JSONResponse({"status": "error", "error": service.load_error}, 503)
        if service.engine is None:
            return JSONResponse({"status": "loading model"}, 503)
        return Health(status="ok", model=service.model_id)

    @app.get("/metrics", response_class=Response, responses={200: {
        "content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=ModelList,
             responses={k: v for k, v in _ERRORS.items() if k in (401, 503)})
    async def models(_auth: None = Depends(authorized)) -> ModelList:
        service.check_ready()
        count.labels("/v1/models", "200").inc()
        return ModelList(data=[ModelCard(id=service.model_id)])

    async def handle(request: Request, req: GenRequest) -> Any:
        endpoint = request.url.path
        service.check_ready()
        chat = req.kind == "chat"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = service.model_id

        if not req.stream:
            text, finish, stats = [], None, None
            async for ev in service.events(req, request.is_disconnected):
                text.append(ev.text)
                finish, stats = ev.finish_reason, ev.stats or stats
            if stats is None:  # the client went away
                count.labels(endpoint, "499").inc()
                return Response(status_code=499)
            content = "".join(text)
            count.labels(endpoint, "200").inc()
            if chat:
                return ChatCompletion(
                    id=rid, created=created, model=model, usage=Usage.of(stats),
                    timings=Timings.of(stats), choices=[ChatChoice(
                        message=AssistantMessage(content=content), finish_reason=finish)])
            return Completion(id=rid, created=created, model=model, usage=Usage.of(stats),
                              timings=Timings.of(stats),
                              choices=[CompletionChoice(text=content, finish_reason=finish)])

        head = dict(id=rid, created=created, model=model)

        def chunk(delta_text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = ChatDelta(role="assistant") if first else ChatDelta()
                if delta_text is not None:
                    delta.content = delta_text
                c: Any = ChatCompletionChunk(object="chat.completion.chunk", **head, choices=[
                    ChatChunkChoice(index=0, delta=delta, logprobs=None, finish_reason=finish)])
            else:
                c = Completion(object="text_completion", **head, choices=[CompletionChoice(
                    index=0, text=delta_text or "", logprobs=None, finish_reason=finish)])
            return c.model_dump_json(exclude_unset=True)

        def usage_chunk(stats: Any) -> str:
            cls = ChatCompletionChunk if chat else Completion
            return cls(object=cls.model_fields["object"].default, **head, choices=[],
                       usage=Usage.of(stats), timings=Timings.of(stats)
                       ).model_dump_json(exclude_unset=True)

        # errors found before the first event are still plain JSON errors; once streaming,
        # a client that goes away cancels this task (sse-starlette watches the connection)
        agen = service.events(req, never_disconnected)
        try:
            first_ev = await agen.__anext__()
        except StopAsyncIteration:
            return Response(status_code=499)

        async def sse() -> AsyncIterator[str]:
            ok = False
            try:
                if chat:
                    yield chunk("", None, first=True)
                ev = first_ev
                while True:
                    if ev.text:
                        yield chunk(ev.text, None)
                    if ev.finish_reason is not None:
                        yield chunk(None if chat else "", ev.finish_reason)
                        if req.include_usage:
                            yield usage_chunk(ev.stats)
                        ok = True
                        break
                    try:
                        ev = await agen.__anext__()
                    except StopAsyncIteration:
                        break
                yield "[DONE]"
            except APIError as exc:
                yield ErrorResponse.model_validate(exc.body()).model_dump_json()
            finally:
                await agen.aclose()
                count.labels(endpoint, "200" if ok else "499").inc()

        return EventSourceResponse(sse(), sep="\n", ping=None)

    def responses(what: str, chunk: str) -> dict[int | str, dict[str, Any]]:
        """OpenAPI responses of a generation route: the errors, and the streamed form."""
        return {**_ERRORS, 200: {
            "description": f"{what}; with `stream`, server-sent events whose data are {chunk} "
                           "objects, then `[DONE]`",
            "content": {"text/event-stream": {"schema": {
                "$ref": f"#/components/schemas/{chunk}"}}}}}

    @app.post("/v1/completions", response_model=Completion,
              responses=responses("the completion", "Completion"))
    async def completions(body: CompletionRequest, request: Request,
                          _auth: None = Depends(authorized)) -> Any:
        return await handle(request, body.to_gen_request())

    @app.post("/v1/chat/completions", response_model=ChatCompletion,
              responses=responses("the chat completion", "ChatCompletionChunk"))
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               _auth: None = Depends(authorized)) -> Any:
        return await handle(request, body.to_gen_request())

    def openapi() -> dict[str, Any]:
        # the streamed chunk's schema is referenced above but used by no route's model
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            extra = ChatCompletionChunk.model_json_schema(
                ref_template="#/components/schemas/{model}", mode="serialization")
            for name, sub in extra.pop("$defs", {}).items():
                comps.setdefault(name, sub)
            comps.setdefault("ChatCompletionChunk", extra)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app

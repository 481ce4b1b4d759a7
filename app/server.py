"""The OpenAI-compatible HTTP API over a Service (app/service.py).

- Request and response bodies are the Pydantic models of app/schemas.py: FastAPI validates
  them and documents them in /openapi.json (and /docs).
- Every error is answered in OpenAI's shape {"error": {"message", "type", "param", "code"}}:
  invalid fields 400 (with the field in `param`), bad API key 401, unknown model 404, body
  over 8 MiB 413, not JSON 415, queue full 429 (with Retry-After), model loading or server
  shutting down 503; bad input is never a 500, and the server keeps serving.
- The middlewares of app/guard.py check the Host, the API key (every path but /health) and
  the body (type, size, nesting) before any route runs.
- A client that goes away stops its generation within one step (non-streaming: polled
  between steps; streaming: sse-starlette cancels the response task).
- An error after a stream started (shutdown, an engine error) is its last event, in
  OpenAI's error shape, and the stream ends cleanly.
- Log-probabilities come in OpenAI's shapes (`chat_logprobs`, `completion_logprobs`), from
  the engine's own (`logprobs=` of `Engine.submit`); a streamed chunk carries its tokens'.
- GET /v1/models lists the loaded models and the others found on the machine; `model` in a
  response is the model that served it (app/service.py loads a model a request names).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Collection
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..llama.tools import parse_tool_calls, tool_names
from .errors import APIError
from .guard import BodyGuard, HostGuard, KeyGuard, key_matches
from .schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    Timings,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolCallFunction,
    TopLogprob,
    Usage,
    validation_error,
)
from .service import LOAD_FAILED, GenRequest, Served, Service, never_disconnected

GENERATION_PATHS = {"/v1/completions": CompletionRequest,
                    "/v1/chat/completions": ChatCompletionRequest}
OPEN_PATHS = ("/health",)  # answered without the API key
ENDPOINTS = {*GENERATION_PATHS, *OPEN_PATHS, "/v1/models", "/metrics", "/docs", "/redoc",
             "/openapi.json"}  # the metrics' endpoint labels; any other path is "other"
STREAM_GRACE_S = 3  # on shutdown, a stream gets this long to end itself before it is cut
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what} for code, what in (
        (400, "invalid request (`param` names the field)"), (401, "missing or wrong API key"),
        (404, "unknown model"), (413, "request body over 8 MiB"),
        (415, "the body is not sent as application/json"),
        (429, "queue full: retry after the Retry-After header's seconds"),
        (503, "model loading, a model that failed to load, or the server shutting down"))}
LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token the model gives no chance at all


def _lp(x: float) -> float:
    return x if math.isfinite(x) and x >= LOGPROB_FLOOR else LOGPROB_FLOOR


def chat_logprobs(engine: Any, lps: list[Any] | None) -> ChatLogprobs | None:
    """OpenAI's chat `logprobs` of the engine's TokenLogprobs (None: not asked for)."""
    if lps is None:
        return None

    def top(tok: int, lp: float) -> TopLogprob:
        text = engine.token_text(tok)
        return TopLogprob(token=text, logprob=_lp(lp), bytes=list(text.encode("utf-8")))

    content = []
    for t in lps:
        head = top(t.token, t.logprob)
        content.append(TokenLogprob(**head.model_dump(),
                                    top_logprobs=[top(i, lp) for i, lp in t.top]))
    return ChatLogprobs(content=content)


def completion_logprobs(engine: Any, lps: list[Any] | None, offset: int
                        ) -> tuple[CompletionLogprobs | None, int]:
    """OpenAI's legacy completion `logprobs` of the engine's TokenLogprobs, the first token
    at character `offset`; and the offset after the last token."""
    if lps is None:
        return None, offset
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for t in lps:
        text = engine.token_text(t.token)
        out.tokens.append(text)
        out.token_logprobs.append(_lp(t.logprob))
        alts: dict[str, float] = {}
        for i, lp in t.top:  # most likely first: of two tokens with one text, the likelier
            alts.setdefault(engine.token_text(i), _lp(lp))
        alts.setdefault(text, _lp(t.logprob))  # the sampled token is always there (OpenAI)
        out.top_logprobs.append(alts)
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


def tool_answer(req: GenRequest, text: str, finish: str | None
                ) -> tuple[str | None, list[ToolCall] | None, str | None]:
    """(content, tool_calls, finish_reason) of a chat answer: with the tools active, the
    calls parsed out of the text (finish_reason "tool_calls"); else the text as it is."""
    if not req.tools_active:
        return text, None, finish
    content, calls = parse_tool_calls(text, tool_names(req.tools or []))
    if not calls:
        return text, None, finish
    return content, [ToolCall(id=c.id, function=ToolCallFunction(
        name=c.name, arguments=c.arguments)) for c in calls], "tool_calls"


def create_app(service: Service, allowed_hosts: Collection[str] | None = None,
               cors_origins: Collection[str] = ()) -> FastAPI:
    """The API app; its lifespan starts the service (queue, model loading). allowed_hosts:
    the Host names answered (None: any); cors_origins: browser origins allowed by CORS."""
    from sse_starlette.sse import EventSourceResponse  # noqa: PLC0415

    from .. import __version__  # noqa: PLC0415

    # on shutdown a stream ends itself at its next step (sse-starlette >= 3 waits for that)
    grace = {"shutdown_grace_period": STREAM_GRACE_S} if "shutdown_grace_period" in \
        inspect.signature(EventSourceResponse).parameters else {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        yield

    app = FastAPI(title="srsd-local", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of srsd-local: completions and chat "
                              "completions (streamed or not) with speculative decoding.")
    count = service.metrics.requests

    def count_path(path: str, status: int) -> None:
        count.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    # added innermost first: Host, then CORS, then the key, then the body
    app.add_middleware(BodyGuard, paths=GENERATION_PATHS, count=count_path)
    if service.api_key:
        app.add_middleware(KeyGuard, key=service.api_key, count=count_path,
                           open_paths=OPEN_PATHS)
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware  # noqa: PLC0415

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    if allowed_hosts is not None:
        app.add_middleware(HostGuard, allowed=allowed_hosts, count=count_path)

    def error(exc: APIError, endpoint: str, headers: Any = None) -> JSONResponse:
        count_path(endpoint, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers or exc.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        endpoint = request.url.path
        errors = [dict(e, loc=tuple(e.get("loc", ()))[1:]) if tuple(e.get("loc", ()))[:1]
                  == ("body",) else e for e in exc.errors()]
        return error(validation_error(errors, GENERATION_PATHS.get(endpoint, CompletionRequest)),
                     endpoint)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own errors (an unreadable body, an unknown path) in OpenAI's shape too
        path, status = request.url.path, exc.status_code
        message = {404: f"no such endpoint: {path} (see /docs)",
                   405: f"{request.method} is not allowed on {path} (see /docs)"}.get(
            status, str(exc.detail))
        if status == 400 and path in GENERATION_PATHS:
            message = "the request body could not be read as JSON (UTF-8 text expected)"
        return error(APIError(status, message, type_="invalid_request_error" if status < 500
                              else "server_error"), path, exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error(APIError(500, f"internal error: {type(exc).__name__}",
                              type_="server_error"), request.url.path)

    @app.get("/health", response_model=Health, response_model_exclude_none=True,
             responses={503: {"model": Health, "description": "loading, failed to load, or "
                                                               "shutting down"}})
    async def health(request: Request) -> Any:
        # open to all: the state only, never the model's path or why it failed to load; which
        # devices (and RPC workers) hold the layers only for those who hold the API key
        if service.closing:
            return JSONResponse({"status": "shutting down"}, 503)
        if service.load_error:
            return JSONResponse({"status": "error", "error": LOAD_FAILED}, 503)
        if service.engine is None:
            return JSONResponse({"status": "loading model"}, 503)
        placement = getattr(service.engine, "placement", None)  # the current model
        if service.api_key and not key_matches(request.headers.get("authorization", ""),
                                               service.api_key):
            placement = None
        return Health(status="ok", model=service.model_id,
                      devices=placement if isinstance(placement, list) else None)

    @app.get("/metrics", response_class=Response, responses={200: {
        "content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=ModelList,
             responses={k: v for k, v in _ERRORS.items() if k in (401, 503)})
    async def models() -> ModelList:
        service.check_ready()
        found = await service.models()
        count.labels("/v1/models", "200").inc()
        return ModelList(data=[ModelCard(id=m.id, loaded=m.loaded) for m in found])

    async def handle(request: Request, req: GenRequest) -> Any:
        endpoint = request.url.path
        service.check_ready()
        chat = req.kind == "chat"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        served = Served()  # the model that serves it, known before the first event
        want_lps = req.logprobs is not None

        def prompt_chars() -> int:
            """Where the completion's text_offset starts: after the prompt's text."""
            if isinstance(req.prompt, str):
                return len(req.prompt)
            return sum(len(served.engine.token_text(t)) for t in req.prompt or [])

        if not req.stream:
            text, finish, stats, lps = [], None, None, []
            async for ev in service.events(req, request.is_disconnected, served):
                text.append(ev.text)
                lps.extend(ev.logprobs or [])
                finish, stats = ev.finish_reason, ev.stats or stats
            if stats is None:  # the client went away
                count.labels(endpoint, "499").inc()
                return Response(status_code=499)
            content = "".join(text)
            count.labels(endpoint, "200").inc()
            model = served.model_id or ""
            if chat:
                answer, calls, finish = tool_answer(req, content, finish)
                return ChatCompletion(
                    id=rid, created=created, model=model, usage=Usage.of(stats),
                    timings=Timings.of(stats), choices=[ChatChoice(
                        message=AssistantMessage(content=answer, tool_calls=calls),
                        finish_reason=finish,
                        logprobs=chat_logprobs(served.engine, lps if want_lps else None))])
            clp, _ = completion_logprobs(served.engine, lps if want_lps else None,
                                         prompt_chars() if want_lps else 0)
            return Completion(id=rid, created=created, model=model, usage=Usage.of(stats),
                              timings=Timings.of(stats),
                              choices=[CompletionChoice(text=content, finish_reason=finish,
                                                        logprobs=clp)])

        offset = 0  # the next token's text_offset (completions with logprobs)

        def chunk(delta_text: str | None, finish: str | None, first: bool = False,
                  lps: list[Any] | None = None, calls: list[ToolCall] | None = None) -> str:
            nonlocal offset
            head = dict(id=rid, created=created, model=served.model_id or "")
            if chat:
                delta = ChatDelta(role="assistant") if first else ChatDelta()
                if delta_text is not None:
                    delta.content = delta_text
                if calls:
                    delta.tool_calls = [ToolCallDelta(index=i, **c.model_dump())
                                        for i, c in enumerate(calls)]
                c: Any = ChatCompletionChunk(object="chat.completion.chunk", **head, choices=[
                    ChatChunkChoice(index=0, delta=delta, finish_reason=finish,
                                    logprobs=chat_logprobs(served.engine, lps))])
            else:
                clp, offset = completion_logprobs(served.engine, lps, offset)
                c = Completion(object="text_completion", **head, choices=[CompletionChoice(
                    index=0, text=delta_text or "", logprobs=clp, finish_reason=finish)])
            return c.model_dump_json(exclude_unset=True)

        def usage_chunk(stats: Any) -> str:
            cls = ChatCompletionChunk if chat else Completion
            head = dict(id=rid, created=created, model=served.model_id or "")
            return cls(object=cls.model_fields["object"].default, **head, choices=[],
                       usage=Usage.of(stats), timings=Timings.of(stats)
                       ).model_dump_json(exclude_unset=True)

        # errors found before the first event are still plain JSON errors; once streaming,
        # a client that goes away cancels this task (sse-starlette watches the connection)
        agen = service.events(req, never_disconnected, served)
        try:
            first_ev = await agen.__anext__()
        except StopAsyncIteration:
            return Response(status_code=499)
        if want_lps and not chat:
            offset = prompt_chars()

        # with tools, the text is held until the end: the calls go in one chunk, the text
        # (when there are none, or before them) in another
        held: tuple[list[str], list[Any]] | None = ([], []) if chat and req.tools_active \
            else None

        def release_held(finish: str | None) -> tuple[list[str], str | None]:
            assert held is not None
            content, calls, finish = tool_answer(req, "".join(held[0]), finish)
            lps = held[1] if want_lps else None
            out = []
            if content:
                out.append(chunk(content, None, lps=lps))
                lps = None
            if calls:
                out.append(chunk(None, None, lps=lps, calls=calls))
            elif lps:
                out.append(chunk(None, None, lps=lps))
            return out, finish

        async def sse() -> AsyncIterator[str]:
            status = "499"  # unless it ends, or ends with an error
            try:
                if chat:
                    yield chunk("", None, first=True)
                ev = first_ev
                while True:
                    lps = ev.logprobs if want_lps else None
                    if held is not None:
                        held[0].append(ev.text)
                        held[1].extend(lps or [])
                    elif ev.text or lps:  # each chunk carries the logprobs of its tokens
                        yield chunk(ev.text, None, lps=lps)
                    if ev.finish_reason is not None:
                        finish = ev.finish_reason
                        if held is not None:
                            chunks, finish = release_held(finish)
                            for c in chunks:
                                yield c
                        yield chunk(None if chat else "", finish)
                        if req.include_usage:
                            yield usage_chunk(ev.stats)
                        status = "200"
                        break
                    try:
                        ev = await agen.__anext__()
                    except StopAsyncIteration:
                        break
                yield "[DONE]"
            except APIError as exc:  # a bad prompt, or shutdown: an error event ends it
                status = str(exc.status)
                yield ErrorResponse.model_validate(exc.body()).model_dump_json()
            except Exception as exc:  # an engine error: said in the stream, not a cut
                logging.getLogger("srsd_local.app").exception("error in a stream")
                status = "500"
                yield ErrorResponse.model_validate(APIError(
                    500, f"internal error: {type(exc).__name__}", type_="server_error",
                    code="internal_error").body()).model_dump_json()
            finally:
                await agen.aclose()
                count.labels(endpoint, status).inc()

        return EventSourceResponse(sse(), sep="\n", ping=None, **grace)

    def responses(what: str, chunk: str) -> dict[int | str, dict[str, Any]]:
        """OpenAPI responses of a generation route: the errors, and the streamed form."""
        return {**_ERRORS, 200: {
            "description": f"{what}; with `stream`, server-sent events whose data are {chunk} "
                           "objects, then `[DONE]`",
            "content": {"text/event-stream": {"schema": {
                "$ref": f"#/components/schemas/{chunk}"}}}}}

    @app.post("/v1/completions", response_model=Completion,
              responses=responses("the completion", "Completion"))
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await handle(request, body.to_gen_request())

    @app.post("/v1/chat/completions", response_model=ChatCompletion,
              responses=responses("the chat completion", "ChatCompletionChunk"))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
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

"""ASGI middlewares in front of every route (the UI's included), outermost first:

- `HostGuard`: the Host header must name this server (DNS rebinding: a web page whose name
  resolves to 127.0.0.1 must not reach a local server); 400 otherwise.
- CORS (Starlette's CORSMiddleware, only with --cors-origin): browsers of those origins.
- `KeyGuard`: with an API key, every path but /health needs `Authorization: Bearer KEY` or
  HTTP Basic with the key as the password (what a browser asks for: /ui, /docs); 401.
- `BodyGuard` (generation endpoints): Content-Type application/json (415; a cross-site form
  or text/plain post is refused), the body read with its running size checked against the
  limit (413 as soon as it is passed, and the connection closed so nothing more is read), and
  JSON nested at most `MAX_JSON_DEPTH` levels (400; deeper bodies would recurse).

Plain ASGI classes, not BaseHTTPMiddleware, so that the endpoints still see the client
disconnect. Their errors are OpenAI's shape, counted in the request metrics.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import re
from collections.abc import Callable, Collection
from typing import Any

from starlette.responses import JSONResponse

from .errors import APIError

MAX_BODY_BYTES = 8 << 20
MAX_JSON_DEPTH = 64
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})
Count = Callable[[str, int], None]  # (path, status) -> the request metric


def allowed_hosts(bind: str, extra: Collection[str] = ()) -> frozenset[str] | None:
    """The Host names a server bound to `bind` accepts (None: any). Bound to a wildcard
    address (0.0.0.0, ::) any name is accepted unless names were given (--allowed-host);
    bound to one address: that address, the localhost names and the given names."""
    names = {host_name(h) for h in extra if h.strip()}
    if bind.strip("[]") in WILDCARD_BINDS and not names:
        return None
    return frozenset(LOCAL_HOSTS | names | {host_name(bind)})


def host_name(host: str) -> str:
    """The name of a Host header value: no port, no IPv6 brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _header(scope: dict, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


async def reply(scope: dict, receive: Any, send: Any, exc: APIError, count: Count,
                close: bool = False) -> None:
    """Answer `exc` (close: and close the connection, so that an unread body is not read)."""
    count(scope.get("path", ""), exc.status)
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": exc.message[:120]})
        return
    headers = dict(exc.headers or {})
    if close:
        headers["Connection"] = "close"
    await JSONResponse(exc.body(), status_code=exc.status, headers=headers)(scope, receive,
                                                                               send)


def _has_body(scope: dict) -> bool:
    length = _header(scope, b"content-length")
    return (length is not None and length.strip() not in ("", "0")) or \
        _header(scope, b"transfer-encoding") is not None


class HostGuard:
    def __init__(self, app: Any, allowed: Collection[str], count: Count) -> None:
        self.app, self.allowed, self.count = app, frozenset(allowed), count

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            host = _header(scope, b"host")
            if host is not None and host_name(host) not in self.allowed:
                shown = ", ".join(sorted(self.allowed))
                await reply(scope, receive, send, APIError(
                    400, f"Host {host[:100]!r} is not allowed: this server answers to {shown} "
                    "(start it with --allowed-host NAME to add a name)",
                    code="host_not_allowed"), self.count, close=_has_body(scope))
                return
        await self.app(scope, receive, send)


def key_matches(authorization: str, key: str) -> bool:
    """`Authorization: Bearer KEY`, or Basic with KEY as the password (any user name)."""
    scheme, _, cred = authorization.strip().partition(" ")
    scheme, cred = scheme.lower(), cred.strip()
    if scheme == "bearer":
        given = cred.encode("latin-1", "replace")
    elif scheme == "basic":
        try:
            given = base64.b64decode(cred, validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return False
    else:
        return False
    return hmac.compare_digest(given, key.encode("utf-8"))


class KeyGuard:
    def __init__(self, app: Any, key: str, count: Count, open_paths: Collection[str]) -> None:
        self.app, self.key, self.count, self.open = app, key, count, frozenset(open_paths)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("path") not in self.open and \
                not key_matches(_header(scope, b"authorization") or "", self.key):
            api = scope.get("path", "").startswith("/v1/")
            # a browser asks for the Basic credentials itself (/ui, /docs)
            challenge = 'Bearer realm="srsd-local"' if api else \
                'Basic realm="srsd-local", charset="UTF-8"'
            await reply(scope, receive, send, APIError(
                401, "invalid or missing API key: send 'Authorization: Bearer KEY' (in a "
                "browser: any user name, and the key as the password)",
                type_="authentication_error", code="invalid_api_key",
                headers={"WWW-Authenticate": challenge}), self.count, close=_has_body(scope))
            return
        await self.app(scope, receive, send)


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes) -> int:
    """How deep arrays and objects nest in a JSON text (brackets inside strings do not
    count; for an invalid text, at least what a parser would reach before failing)."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if len(brackets) < 4096:
        depth = top = 0
        for b in brackets:
            depth += 1 if b in b"[{" else -1
            top = max(top, depth)
        return top
    import numpy as np  # noqa: PLC0415  (a long body: no Python loop over its brackets)

    a = np.frombuffer(brackets, dtype=np.uint8)
    step = np.where((a == ord("[")) | (a == ord("{")), 1, -1).astype(np.int32)
    return max(int(np.cumsum(step, dtype=np.int32).max()), 0)


def _media_type(value: str | None) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


class BodyGuard:
    def __init__(self, app: Any, paths: Collection[str], count: Count,
                 limit: int = MAX_BODY_BYTES, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app, self.paths, self.count = app, frozenset(paths), count
        self.limit, self.max_depth = limit, max_depth

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or \
                scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        ctype = _header(scope, b"content-type")
        if _media_type(ctype) != "application/json":
            got = f"{ctype[:60]!r}" if ctype else "none"
            await reply(scope, receive, send, APIError(
                415, f"the body must be JSON sent with 'Content-Type: application/json' (got "
                f"{got}); with curl: -H 'Content-Type: application/json'",
                code="unsupported_media_type"), self.count, close=_has_body(scope))
            return
        length = (_header(scope, b"content-length") or "").strip()
        if length.isdigit() and int(length) > self.limit:
            await self._too_large(scope, receive, send, f"{int(length)} bytes")
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # the client went away while sending
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:  # stop reading: chunked uploads have no Content-Length
                await self._too_large(scope, receive, send, f"over {self.limit} bytes")
                return
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        depth = json_depth(body)
        if depth > self.max_depth:
            await reply(scope, receive, send, APIError(
                400, f"the request body nests arrays and objects {depth} levels deep; the "
                f"limit is {self.max_depth}", code="nesting_too_deep"), self.count)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: dict, receive: Any, send: Any, size: str) -> None:
        await reply(scope, receive, send, APIError(
            413, f"the request body is {size}; the limit is {self.limit} bytes",
            code="request_too_large"), self.count, close=True)

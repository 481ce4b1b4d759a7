"""Errors the applications answer in OpenAI's shape {"error": {message, type, param, code}}."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An HTTP error with OpenAI's body; raised anywhere, answered by the server (with
    `headers`, e.g. Retry-After, when given)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def shutting_down() -> APIError:
    """503 for a request the server will not finish because it is stopping (SIGTERM)."""
    return APIError(503, "the server is shutting down; retry on another instance or later",
                    type_="server_error", code="server_shutting_down")

"""Errors the applications answer in OpenAI's shape {"error": {message, type, param, code}}."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An HTTP error with OpenAI's body; raised anywhere, answered by the server."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

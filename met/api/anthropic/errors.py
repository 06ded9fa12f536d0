"""Anthropic-shaped errors, ``{"type": "error", "error": {"type", "message"}}``, for the
/v1/messages routes only (the OpenAI routes keep OpenAI's shape). ``AnthropicRoute``
(``routing.py``) answers the routes' own errors so; the app's 404/405 handler and the
API-key middleware check ``ANTHROPIC_PATH_PREFIX``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

ANTHROPIC_PATH_PREFIX = "/v1/messages"

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The error as a response (same signature as ``met.api.errors.error_response``)."""
    return JSONResponse(error_body(status, message), status_code=status,
                        headers=dict(headers or {}))

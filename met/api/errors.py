"""OpenAI-shaped error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from met.api.anthropic.errors import ANTHROPIC_PATH_PREFIX
from met.api.anthropic.errors import error_response as anthropic_error_response
from met.serving.errors import InvalidRequest

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An HTTP error with an OpenAI-shaped body (raise it anywhere in a handler)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=dict(headers or {}))


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the server in OpenAI's shape: ours, FastAPI's and Starlette's."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, e: InvalidRequest) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # Under Anthropic's path, even an unknown route answers in Anthropic's shape.
        reply = (anthropic_error_response
                 if request.url.path.startswith(ANTHROPIC_PATH_PREFIX) else error_response)
        if e.status_code == 404:
            msg = f"{request.method} {request.url.path}: no such route"
            return reply(404, msg, None, "not_found")
        if e.status_code == 405:
            msg = f"{request.method} {request.url.path}: method not allowed"
            return reply(405, msg, None, "method_not_allowed", e.headers)
        return reply(e.status_code, str(e.detail), None, None, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in err["loc"] if p != "body") or None
        return error_response(400, f"{param}: {err['msg']}", param)

"""The route class of the Anthropic routes: their errors answer in Anthropic's shape."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from met.api.anthropic.errors import error_response
from met.api.errors import ApiError
from met.serving.errors import InvalidRequest

log = logging.getLogger("met.api")


class AnthropicRoute(APIRoute):
    """A route whose errors (ours, and anything unexpected) answer in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as e:
                return error_response(e.status, e.message, headers=e.headers)
            except InvalidRequest as e:
                return error_response(e.status, e.message)
            except Exception:
                log.exception("unhandled error in %s %s", request.method, request.url.path)
                return error_response(500, "internal server error")

        return handle

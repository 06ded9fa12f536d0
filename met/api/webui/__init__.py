"""The web chat: ``GET /`` and ``/webui/*``, static files shipped in this package.

Served in front of the API-key check so the page loads without a key: it holds no API data,
and every call it makes (``/v1/models``, ``/v1/chat/completions``) carries the key the person
typed and goes through the check like any client's.
"""

from __future__ import annotations

from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from met.api.errors import error_response

STATIC_DIR = Path(__file__).parent / "static"
PREFIX = "/webui/"

# The page talks to this server only: nothing is fetched from elsewhere, and markdown a model
# writes cannot pull in outside images or run script (DOMPurify sanitises it as well).
_HEADERS = [
    (b"content-security-policy",
     b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
     b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"cache-control", b"no-cache"),  # revalidate (ETag): an upgraded server serves its page
]


class WebChatMiddleware:
    """Answers GET/HEAD of ``/`` (index.html) and ``/webui/FILE``; passes the rest on."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.files = StaticFiles(directory=STATIC_DIR)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (scope["type"] != "http" or scope["method"] not in ("GET", "HEAD")
                or not (path == "/" or path.startswith(PREFIX))):
            await self.app(scope, receive, send)
            return
        file = "/index.html" if path == "/" else path[len(PREFIX) - 1:]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_HEADERS]}
            await send(message)

        try:
            await self.files({**scope, "path": file, "root_path": ""}, receive,
                             send_with_headers)
        except HTTPException as e:  # outside FastAPI's handlers: answer in OpenAI's shape
            await error_response(e.status_code, f"no such file: {path}", None,
                                 "not_found")(scope, receive, send)

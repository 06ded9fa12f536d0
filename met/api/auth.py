"""API keys: ``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key: KEY``) on every
route except the open ones."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from met.api.anthropic.errors import ANTHROPIC_PATH_PREFIX
from met.api.anthropic.errors import error_body as anthropic_error_body
from met.api.errors import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """Constant-time: every configured key is compared, whatever matched before."""
    given = presented.encode()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key.encode())
    return ok


def presented_keys(headers: dict[bytes, bytes]) -> list[str]:
    """The keys a request presents: ``Authorization: Bearer KEY`` and ``x-api-key: KEY``."""
    out = []
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        out.append(token.strip())
    key = headers.get(b"x-api-key", b"").decode("latin-1").strip()
    if key:
        out.append(key)
    return out


def valid_key(headers: dict[bytes, bytes], keys: tuple[str, ...]) -> str | None:
    """The presented key that is one of ``keys`` (either header may carry it), or None."""
    for key in presented_keys(headers):
        if key_matches(key, keys):
            return key
    return None


class ApiKeyMiddleware:
    """Rejects requests without a valid key with a 401 (pure ASGI: no buffering), in
    Anthropic's shape on its routes and OpenAI's elsewhere."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if valid_key(headers, self.keys) is not None:
            await self.app(scope, receive, send)
            return
        given = b"authorization" in headers or b"x-api-key" in headers
        message = ("incorrect API key provided" if given else
                   "missing API key: send 'Authorization: Bearer YOUR_KEY' or 'x-api-key: "
                   "YOUR_KEY'")
        if scope["path"].startswith(ANTHROPIC_PATH_PREFIX):
            body = json.dumps(anthropic_error_body(401, message)).encode()
        else:
            body = json.dumps(error_body(401, message, None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]})
        await send({"type": "http.response.body", "body": body})

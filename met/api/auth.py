"""API keys: ``Authorization: Bearer KEY`` on every route except the open ones."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from met.api.errors import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """Constant-time: every configured key is compared, whatever matched before."""
    given = presented.encode()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key.encode())
    return ok


class ApiKeyMiddleware:
    """Rejects requests without a valid key with OpenAI's 401 body (pure ASGI: no buffering)."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and key_matches(token.strip(), self.keys):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send 'Authorization: Bearer YOUR_KEY'" if not auth
                   else "incorrect API key provided")
        body = json.dumps(error_body(401, message, None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]})
        await send({"type": "http.response.body", "body": body})

"""A fake OpenAI-compatible streaming server with known delays, run in-process by uvicorn.

Streamed requests take, in arrival order, the time-to-first-token delays of ``ttfts`` (so a
rung of ``len(ttfts)`` requests sees each exactly once), then one token every ``tpot``
seconds. One prompt token per word plus ``OVERHEAD``. The model name picks a behaviour:
``fake`` (usage sent when asked), ``fake-no-usage`` (never sends usage), ``fake-fail``
(an error event after two tokens), ``fake-400`` (an HTTP 400 naming a field).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

OVERHEAD = 3


@dataclass
class FakeBehaviour:
    ttfts: list[float]
    tpot: float
    counter: int = 0
    bodies: list[dict] = field(default_factory=list)

    def next_ttft(self) -> float:
        delay = self.ttfts[self.counter % len(self.ttfts)]
        self.counter += 1
        return delay


def _prompt_tokens(body: dict) -> int:
    text = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
    return len(text.split()) + OVERHEAD


def build_app(behaviour: FakeBehaviour) -> Starlette:
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(request: Request):
        body = await request.json()
        behaviour.bodies.append(body)
        model = body.get("model")
        chat = request.url.path.endswith("/chat/completions")
        if model == "fake-400":
            return JSONResponse({"error": {"message": "temperature: must be in 0..2",
                                           "param": "temperature"}}, status_code=400)
        n_prompt, n_out = _prompt_tokens(body), int(body.get("max_tokens") or 16)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                 "total_tokens": n_prompt + n_out}
        if not body.get("stream"):
            choice = ({"message": {"role": "assistant", "content": "x" * n_out}} if chat
                      else {"text": "x" * n_out})
            return JSONResponse({"choices": [{**choice, "index": 0, "finish_reason": "length"}],
                                 "usage": usage})
        want_usage = (body.get("stream_options") or {}).get("include_usage") and \
            model != "fake-no-usage"
        ttft = behaviour.next_ttft()

        def chunk(text: str, finish: str | None = None) -> str:
            choice = ({"delta": {"content": text}} if chat else {"text": text})
            return "data: " + json.dumps({"choices": [{**choice, "index": 0,
                                                       "finish_reason": finish}]}) + "\n\n"

        async def events():
            await asyncio.sleep(ttft)
            for i in range(n_out):
                if i:
                    await asyncio.sleep(behaviour.tpot)
                if model == "fake-fail" and i == 2:
                    yield "data: " + json.dumps({"error": {"message": "engine fell over",
                                                           "code": 500}}) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
                yield chunk(f"t{i} ", "length" if i == n_out - 1 else None)
            if want_usage:
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
    ])


class FakeServer:
    """uvicorn in a thread on a free port; ``url`` is the root; ``stop()`` joins it."""

    def __init__(self, behaviour: FakeBehaviour):
        self.behaviour = behaviour
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(behaviour), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()

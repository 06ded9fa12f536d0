"""One streamed request against an OpenAI-compatible server, timed from the client's side.

Works with `/v1/completions` and `/v1/chat/completions` of met, vLLM and llama.cpp's
llama-server: the request asks for ``stream_options.include_usage`` so the output token
count comes from the server's ``usage``; a server that sends no usage is counted by its
content chunks (one token each on all three). ``ignore_eos`` goes in the body as an extra
field, which all three accept.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    url: str  # server root, e.g. http://127.0.0.1:8888 (a trailing /v1 is accepted)
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint: must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url: must start with http:// or https://, got {self.url!r}")

    @property
    def root(self) -> str:
        root = self.url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    @property
    def path(self) -> str:
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: str, max_tokens: int, stream: bool = True,
             **extra: Any) -> dict[str, Any]:
        """The JSON body for ``prompt``; ``extra`` fields (seed, temperature, …) override."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens,
                                "temperature": 0.0, "stream": stream}
        if self.endpoint == "completions":
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": prompt}]
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(extra)
        return body


@dataclass
class RequestResult:
    """What one request measured. Times are seconds from the moment it was sent."""

    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # to the first chunk carrying text
    e2e: float | None = None  # to the end of the stream
    output_tokens: int = 0  # from usage, else the number of content chunks
    prompt_tokens: int | None = None  # from usage, when the server sent it
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent
    usage_reported: bool = False
    text: str = ""
    finish_reason: str | None = None
    chunk_times: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e − ttft) / (tokens − 1)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def decode_tok_s(self) -> float | None:
        """Decode speed of this one stream (tokens after the first over the time they took)."""
        tpot = self.tpot
        return None if not tpot else 1.0 / tpot


def _chunk_text(chunk: dict[str, Any]) -> tuple[str, str | None, bool]:
    """(text, finish_reason, carried content) of a completions or chat chunk."""
    text, finish, carried = "", None, False
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        piece = (delta or {}).get("content") if delta is not None else choice.get("text")
        reasoning = (delta or {}).get("reasoning_content") if delta is not None else None
        if piece:
            text += piece
            carried = True
        if reasoning:
            carried = True
        finish = choice.get("finish_reason") or finish
    return text, finish, carried


def _error_message(payload: Any) -> str:
    if isinstance(payload, dict) and "error" in payload:
        err = payload["error"]
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    return str(payload)[:500]


async def stream_request(client: httpx.AsyncClient, target: Target, body: dict[str, Any],
                         timeout: float = 600.0) -> RequestResult:
    """POST ``body`` with streaming and time it. Never raises for server or network errors:
    they come back as ``ok=False`` with the message (an HTTP error status, an error event
    in the stream, a stream that ends without [DONE], a timeout)."""
    result = RequestResult()
    start = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", target.root + target.path, json=body,
                                 headers=target.headers(), timeout=timeout) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    msg = _error_message(json.loads(raw))
                except ValueError:
                    msg = raw.decode(errors="replace")[:500]
                result.error = f"HTTP {resp.status_code}: {msg}"
                return result
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                payload = json.loads(data)
                if not isinstance(payload, dict):
                    continue
                if "error" in payload:
                    result.error = f"error event: {_error_message(payload)}"
                    return result
                text, finish, carried = _chunk_text(payload)
                now = time.perf_counter() - start
                if carried:
                    chunks += 1
                    result.chunk_times.append(now)
                    if result.ttft is None:
                        result.ttft = now
                result.text += text
                result.finish_reason = finish or result.finish_reason
                usage = payload.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.usage_reported = True
                    result.output_tokens = int(usage["completion_tokens"])
                    result.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens")
            if not done:
                result.error = "stream ended without [DONE]"
                return result
    except (httpx.HTTPError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    if not result.usage_reported:
        result.output_tokens = chunks
    result.ok = True
    return result


async def complete(client: httpx.AsyncClient, target: Target, body: dict[str, Any],
                   timeout: float = 600.0) -> dict[str, Any]:
    """A non-streamed request; the decoded JSON response (raises on an error status)."""
    resp = await client.post(target.root + target.path, json={**body, "stream": False},
                             headers=target.headers(), timeout=timeout)
    if resp.status_code != 200:
        try:
            msg = _error_message(resp.json())
        except ValueError:
            msg = resp.text[:500]
        raise RuntimeError(f"HTTP {resp.status_code} from {target.path}: {msg}")
    return resp.json()


async def first_model(client: httpx.AsyncClient, url: str, api_key: str | None) -> str:
    """The first model id the server lists on /v1/models (for a sweep without --model)."""
    root = Target(url, "-").root
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = await client.get(root + "/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"--model: {root}/v1/models lists no model; pass --model")
    return str(data[0]["id"])

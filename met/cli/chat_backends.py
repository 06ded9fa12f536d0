"""Where `met chat` gets its replies: the engine in this process, or a server's OpenAI API.

Both stream text pieces for a list of OpenAI-style messages and fill in a `Reply` with the
token count and timings. Ctrl-C stops a reply: in-process it is turned into a flag the step
loop reads between steps (an exception inside a step would leave the engine half-updated),
remotely it closes the stream, which aborts the request on the server.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


class ChatError(Exception):
    """A reply could not be produced; the message says why and what to do."""


@dataclass
class Reply:
    text: str = ""
    tokens: int = 0
    first_token_s: float | None = None
    elapsed_s: float = 0.0
    finish_reason: str | None = None

    @property
    def tok_s(self) -> float:
        decode = self.elapsed_s - (self.first_token_s or 0.0)
        return (self.tokens - 1) / decode if self.tokens > 1 and decode > 0 else 0.0


@contextmanager
def _sigint_sets(flag: threading.Event):
    """While inside, Ctrl-C sets ``flag`` instead of raising (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class InProcess:
    """The engine of a `met.LLM`, stepped here one request at a time."""

    def __init__(self, llm: Any, name: str):
        self.llm = llm
        self.core = llm.engine
        self.model = name
        self.where = f"in-process, {self.core.config.device}, {str(self.core.dtype)[6:]}"
        self.template = self.core.loaded.chat_template
        if llm.tokenizer is None or not self.template:
            raise ChatError(f"{name} has no chat template; `met chat` needs one")

    def stream(self, messages: list[dict], params: Any, reply: Reply) -> Iterator[str]:
        from met.serving.detokenizer import IncrementalDetokenizer

        ids = list(self.llm.tokenizer.apply_chat_template(
            messages, chat_template=self.template, add_generation_prompt=True, tokenize=True,
            return_dict=False))
        room = self.core.max_model_len - len(ids)
        if room < 1:
            raise ChatError(f"the conversation ({len(ids)} tokens) no longer fits the model's "
                            f"context ({self.core.max_model_len}); /reset to start over")
        params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        rid = f"chat-{uuid.uuid4().hex[:8]}"
        detok = IncrementalDetokenizer(self.llm.tokenizer)
        stop = threading.Event()
        start = time.perf_counter()
        self.core.add_request(rid, ids, params)
        try:
            with _sigint_sets(stop):
                while self.core.has_unfinished() and not stop.is_set():
                    for u in self.core.step():
                        if u.request_id != rid:
                            continue
                        if u.error:
                            raise ChatError(u.error)
                        if reply.first_token_s is None:
                            reply.first_token_s = time.perf_counter() - start
                        reply.tokens += len(u.new_token_ids)
                        text = detok.push(u.new_token_ids) + (detok.flush() if u.finished
                                                               else "")
                        reply.elapsed_s = time.perf_counter() - start
                        if text:
                            reply.text += text
                            yield text
                        if u.finished:
                            reply.finish_reason = u.finish_reason
                            return
            reply.finish_reason = "abort"
        finally:
            self.core.abort_request(rid)  # a no-op once finished; else frees its KV now


class Remote:
    """A server's /v1/chat/completions, streamed (met's or any OpenAI-compatible one)."""

    def __init__(self, url: str, api_key: str | None, model: str | None,
                 timeout: float = 600.0):
        import httpx

        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=10))
        self.model = model or self._first_model()
        self.where = self.base

    def _request(self, method: str, path: str, **kw: Any):
        import httpx

        try:
            return self.http.request(method, self.base + path, **kw)
        except httpx.TransportError as e:
            raise ChatError(f"cannot reach {self.base} ({e}); is `met serve` running "
                            f"there?") from None

    def _first_model(self) -> str:
        r = self._request("GET", "/models")
        _raise_for(r.status_code, r.text)
        data = r.json().get("data") or []
        if not data:
            raise ChatError(f"{self.base}/models lists no model; pass one: met chat MODEL")
        return data[0]["id"]

    def stream(self, messages: list[dict], params: Any, reply: Reply) -> Iterator[str]:
        import httpx

        body = {"model": self.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **_sampling_body(params)}
        start = time.perf_counter()
        try:
            with self.http.stream("POST", self.base + "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    _raise_for(r.status_code, r.read().decode(errors="replace"))
                for text in _sse_texts(r.iter_lines(), reply):
                    if reply.first_token_s is None:
                        reply.first_token_s = time.perf_counter() - start
                    reply.elapsed_s = time.perf_counter() - start
                    reply.text += text
                    yield text
        except httpx.TransportError as e:
            raise ChatError(f"the connection to {self.base} broke ({e})") from None
        except KeyboardInterrupt:  # leaving the `with` closed the stream: the server aborts
            reply.finish_reason = "abort"
        reply.elapsed_s = time.perf_counter() - start


def _sse_texts(lines: Iterator[str], reply: Reply) -> Iterator[str]:
    """The content deltas of an OpenAI chat stream; usage and finish_reason go to ``reply``."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:  # met's mid-stream error frame
            raise ChatError(f"the server ended the reply with an error: "
                            f"{chunk['error'].get('message', chunk['error'])}")
        if chunk.get("usage"):
            reply.tokens = chunk["usage"].get("completion_tokens", reply.tokens)
        for choice in chunk.get("choices") or []:
            if choice.get("finish_reason"):
                reply.finish_reason = choice["finish_reason"]
            text = (choice.get("delta") or {}).get("content")
            if text:
                yield text


def _raise_for(status: int, body: str) -> None:
    if status == 200:
        return
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:500]
    if status == 401:
        raise ChatError(f"401: {message} — pass the server's key: --api-key KEY "
                        f"(or set $MET_API_KEY)")
    raise ChatError(f"{status}: {message}")


def _sampling_body(p: Any) -> dict:
    """The request fields for SamplingParams ``p``: OpenAI's always, the extensions (which
    met and vLLM read) only where they differ from off, so other servers are not confused."""
    body: dict[str, Any] = {"max_tokens": p.max_tokens, "temperature": p.temperature,
                            "top_p": p.top_p}
    if p.seed is not None:
        body["seed"] = p.seed
    for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("top_k", 0),
                      ("min_p", 0.0), ("top_n_sigma", 0.0), ("repetition_penalty", 1.0)):
        value = getattr(p, name)
        if value != off and not (name == "top_k" and value == -1):
            body[name] = value
    if p.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in dict(p.logit_bias).items()}
    if p.stop_token_ids:
        body["stop_token_ids"] = list(p.stop_token_ids)
    return body

"""`met chat [MODEL]`: a terminal chat that streams, keeps the history and has commands.

The engine runs in this process by default; `--url` talks to a running server's OpenAI API
instead. Input: Enter sends; a line ending in a backslash continues on the next line; a
line starting with \"\"\" opens a block that ends at the next line ending in \"\"\". Commands
are lines that start with `/` (see HELP).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from met.cli.args import (
    add_engine_args,
    add_sampling_args,
    build_llm,
    model_arg,
    sampling_params,
)
from met.cli.chat_backends import ChatError, InProcess, Remote, Reply

PROMPT, MORE = ">>> ", "... "
HELP = """commands:
  /reset            forget the conversation (the system prompt stays)
  /system TEXT      set the system prompt (/system alone clears it)
  /save FILE        write the conversation as JSON (OpenAI messages)
  /load FILE        read a conversation written by /save
  /history          print the conversation so far
  /help             this list
  /exit             quit (or Ctrl-D; Ctrl-C stops a reply)
input: end a line with \\ to go on on the next line, or wrap several lines in \"\"\" ... \"\"\""""

ReadLine = Callable[[str], str]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal (in this process, or "
                                    "a server's OpenAI API with --url)")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(max_tokens=1024, temperature=0.7, func=run)
    p.add_argument("--url", default=None,
                   help="a running server, e.g. http://127.0.0.1:8888: chat through its "
                        "OpenAI API (MODEL: the served name; default its first model)")
    p.add_argument("--api-key", default=None, help="the server's key (default $MET_API_KEY)")
    p.add_argument("--system", default=None, help="the system prompt to start with")
    p.add_argument("-v", "--verbose", action="store_true", help="show the engine's log")


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # a bad flag fails before anything loads
    interactive = sys.stdin.isatty()
    try:
        backend = _backend(args, interactive)
    except ChatError as e:
        print(f"met chat: {e}", file=sys.stderr)
        return 1
    session = ChatSession(backend, params, args.system, sys.stdout, sys.stderr)
    if interactive:
        import readline  # noqa: F401  (line editing and ↑ history for input())

        print(f"met chat — {backend.model} ({backend.where}). /help for commands, "
              f"Ctrl-D to quit.")
        return session.loop(input)
    return session.loop(_read_pipe)


def _backend(args: argparse.Namespace, interactive: bool) -> Any:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    if args.url:
        key = args.api_key or os.environ.get("MET_API_KEY")
        return Remote(args.url, key, model_arg(args))
    if not args.verbose:
        logging.getLogger().setLevel(logging.WARNING)
    from met.loader.resolve import resolve_model

    source = resolve_model(model_arg(args), args.cache_dir)
    name = model_arg(args) or source.path.stem.split(".")[0]
    if interactive and sys.stderr.isatty():
        from rich.console import Console

        with Console(stderr=True).status(f"loading {name}", spinner="dots"):
            return InProcess(build_llm(args), name)
    return InProcess(build_llm(args), name)


def _read_pipe(prompt: str) -> str:
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def read_message(read_line: ReadLine) -> str:
    """One message: a line, lines joined by trailing backslashes, or a \"\"\" block."""
    line = read_line(PROMPT)
    if line.lstrip().startswith('"""'):
        first = line.lstrip()[3:]
        if first.rstrip().endswith('"""'):
            return first.rstrip()[:-3]
        parts = [first] if first.strip() else []
        while True:
            try:
                line = read_line(MORE)
            except EOFError:
                break  # an unclosed block at the end of input: send what it holds
            if line.rstrip().endswith('"""'):
                parts.append(line.rstrip()[:-3])
                break
            parts.append(line)
        return "\n".join(parts).rstrip("\n")
    parts = []
    while line.endswith("\\"):
        parts.append(line[:-1])
        try:
            line = read_line(MORE)
        except EOFError:
            line = ""
            break
    parts.append(line)
    return "\n".join(parts)


class ChatSession:
    """The history, the commands, and one turn at a time against a backend."""

    def __init__(self, backend: Any, params: Any, system: str | None, out: TextIO,
                 err: TextIO):
        self.backend = backend
        self.params = params
        self.system = system
        self.history: list[dict[str, str]] = []
        self.out, self.err = out, err

    def conversation(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def loop(self, read_line: ReadLine) -> int:
        while True:
            try:
                text = read_message(read_line)
            except EOFError:
                self.out.write("\n" if read_line is input else "")
                return 0
            except KeyboardInterrupt:  # at the prompt: a fresh line, not an exit
                self.out.write("\n")
                continue
            if text.startswith("/") and "\n" not in text:
                if not self.command(text):
                    return 0
            elif text.strip():
                self.send(text)

    def send(self, text: str) -> Reply:
        self.history.append({"role": "user", "content": text})
        reply = Reply()
        stream = self.backend.stream(self.conversation(), self.params, reply)
        try:
            for piece in stream:
                self.out.write(piece)
                self.out.flush()
        except KeyboardInterrupt:  # between two pieces: stop the reply, keep the chat
            stream.close()
            reply.finish_reason = "abort"
        except ChatError as e:
            self.history.pop()  # the turn did not happen
            self.out.write("\n" if reply.text else "")
            self._note(f"met chat: {e}")
            return reply
        self.out.write("\n")
        self.out.flush()
        if reply.text:  # a stopped reply keeps what was said
            self.history.append({"role": "assistant", "content": reply.text})
        else:
            self.history.pop()
        stopped = " · stopped" if reply.finish_reason == "abort" else ""
        self._note(f"[{reply.tokens} tokens · {reply.tok_s:.1f} tok/s · first token "
                   f"{reply.first_token_s or 0:.2f} s · {reply.finish_reason}{stopped}]")
        return reply

    def _note(self, text: str) -> None:
        dim = self.err.isatty()
        self.err.write(f"\x1b[2m{text}\x1b[0m\n" if dim else text + "\n")
        self.err.flush()

    def command(self, line: str) -> bool:
        """Run a /command; False when the chat should end."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name in ("/reset", "/clear"):
            self.history.clear()
            self._note("conversation cleared" + (" (the system prompt stays)"
                                                 if self.system else ""))
        elif name == "/system":
            self.system = arg or None
            self._note(f"system prompt set ({len(arg)} chars)" if arg
                       else "system prompt cleared")
        elif name == "/save":
            self._save(arg)
        elif name == "/load":
            self._load(arg)
        elif name == "/history":
            for m in self.conversation():
                self.out.write(f"[{m['role']}] {m['content']}\n")
        elif name in ("/help", "/?"):
            self.out.write(HELP + "\n")
        else:
            self._note(f"unknown command {name}; /help lists them")
        return True

    def _save(self, arg: str) -> None:
        if not arg:
            self._note("/save needs a file name, e.g. /save chat.json")
            return
        doc = {"model": self.backend.model, "messages": self.conversation()}
        try:
            Path(arg).expanduser().write_text(json.dumps(doc, indent=2, ensure_ascii=False)
                                              + "\n")
        except OSError as e:
            self._note(f"cannot write {arg}: {e.strerror}")
            return
        self._note(f"saved {len(doc['messages'])} messages to {arg}")

    def _load(self, arg: str) -> None:
        try:
            doc = json.loads(Path(arg).expanduser().read_text())
            messages = doc["messages"] if isinstance(doc, dict) else doc
            if not all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                       for m in messages):
                raise ValueError("not a list of {role, content} messages")
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._note(f"cannot load {arg!r}: {e}")
            return
        systems = [m["content"] for m in messages if m["role"] == "system"]
        self.system = systems[0] if systems else None
        self.history = [{"role": m["role"], "content": m["content"]} for m in messages
                        if m["role"] != "system"]
        self._note(f"loaded {len(messages)} messages from {arg}")

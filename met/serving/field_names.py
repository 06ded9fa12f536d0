"""Errors raised against the internal chat request, renamed to the fields another API's
client sent (e.g. ``max_tokens`` → ``max_output_tokens``, ``tools.0.function.name`` →
``tools.0.name``), so every 400 still names the field the user wrote."""

from __future__ import annotations

import re
from collections.abc import Sequence

from pydantic import BaseModel

from met.serving.errors import InvalidRequest

# (pattern over the internal field path, replacement), first match wins.
Renames = Sequence[tuple[str, str]]


def rename_field(name: str | None, renames: Renames) -> str | None:
    """``name`` (a dotted field path) under the client's names."""
    if name is None:
        return None
    for pattern, repl in renames:
        new, n = re.subn(rf"^{pattern}(?=$|\.)", repl, name)
        if n:
            return new
    return name


def renamed(e: InvalidRequest, renames: Renames) -> InvalidRequest:
    """``e`` with its ``param`` (and the message's leading ``param:``) renamed."""
    param = rename_field(e.param, renames)
    if param == e.param:
        return e
    message = e.message
    if e.param is not None and message.startswith(e.param + ":"):
        message = param + message[len(e.param):]
    return InvalidRequest(message, param, e.code, e.status)


def model_field_names(*models: type[BaseModel]) -> frozenset[str]:
    """Every field name (and alias) of ``models``: what ``parse_body`` keeps of an error's
    location (union members' names, e.g. ``str``, are dropped)."""
    return frozenset(name for m in models
                     for name in (*m.model_fields,
                                  *(f.alias for f in m.model_fields.values() if f.alias)))

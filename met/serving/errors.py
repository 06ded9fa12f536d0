"""The error the serving layer raises for input it cannot serve; the API turns it into a 4xx."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """Bad client input. ``param`` names the offending field (OpenAI's ``error.param``)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


def from_value_error(e: ValueError, default_param: str | None = None) -> InvalidRequest:
    """Our ValueErrors read ``"field: what is wrong"``; lift the field into ``param``."""
    if isinstance(e, InvalidRequest):
        return e
    text = str(e)
    head, sep, _ = text.partition(":")
    param = head if sep and head.replace("_", "").replace(".", "").isalnum() else default_param
    return InvalidRequest(text, param)

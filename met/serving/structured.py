"""Request fields → ``StructuredOutputs``: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_*`` names. One spec per request; asking for two
is a 400 naming both fields."""

from __future__ import annotations

import json

from met.sampling.params import StructuredOutputs
from met.serving.errors import InvalidRequest
from met.serving.protocol import SamplingFields

_MAX_SPEC_BYTES = 256 << 10


def structured_outputs(req: SamplingFields) -> tuple[StructuredOutputs, str] | None:
    """The request's grammar spec and the field it came from, or None (free text)."""
    found: list[tuple[StructuredOutputs, str]] = []
    rf = req.response_format
    if rf is not None:
        if rf.type == "json_object":
            found.append((StructuredOutputs(json_object=True), "response_format"))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequest("response_format.json_schema.schema: required when type "
                                     "is 'json_schema'", "response_format.json_schema.schema")
            found.append((StructuredOutputs(json=rf.json_schema.schema_),
                          "response_format.json_schema.schema"))
        elif rf.type != "text":
            raise InvalidRequest(f"response_format.type: must be 'text', 'json_object' or "
                                 f"'json_schema', got {rf.type!r}", "response_format.type")
    so = req.structured_outputs
    if so is not None:
        given = {k: v for k, v in (("json", so.json_), ("regex", so.regex),
                                   ("choice", so.choice), ("grammar", so.grammar),
                                   ("structural_tag", so.structural_tag)) if v is not None}
        if so.json_object:
            given["json_object"] = True
        if len(given) != 1:
            raise InvalidRequest("structured_outputs: set exactly one of json, json_object, "
                                 f"regex, choice, grammar, structural_tag (got "
                                 f"{sorted(given) or 'none'})", "structured_outputs")
        (key, value), = given.items()
        found.append((_spec(key, value, f"structured_outputs.{key}"),
                      f"structured_outputs.{key}"))
    for key, value in (("json", req.guided_json), ("regex", req.guided_regex),
                       ("choice", req.guided_choice), ("grammar", req.guided_grammar)):
        if value is not None:
            found.append((_spec(key, value, f"guided_{key}"), f"guided_{key}"))
    if len(found) > 1:
        names = ", ".join(f for _, f in found)
        raise InvalidRequest(f"{found[1][1]}: only one structured-output constraint per "
                             f"request (got {names})", found[1][1])
    return found[0] if found else None


def _spec(key: str, value: object, field: str) -> StructuredOutputs:
    if isinstance(value, str) and len(value.encode()) > _MAX_SPEC_BYTES or (
            isinstance(value, dict) and len(json.dumps(value)) > _MAX_SPEC_BYTES):
        raise InvalidRequest(f"{field}: over the {_MAX_SPEC_BYTES}-byte limit", field)
    if key == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"{field}: not valid JSON ({e})", field) from None
    if key == "choice" and not value:
        raise InvalidRequest(f"{field}: must be a non-empty list of strings", field)
    if key in ("regex", "grammar") and not value:
        raise InvalidRequest(f"{field}: must be non-empty", field)
    try:
        return StructuredOutputs(**{key: value})
    except ValueError as e:
        raise InvalidRequest(f"{field}: {e}", field) from None

"""Request fields → a thinking budget for the engine.

OpenAI-style requests ask with ``thinking_token_budget`` (aliases ``max_thinking_tokens``,
``thinking_budget``) or ``reasoning_effort`` (low / medium / high = 1/4, 1/2, all of
``--max-thinking-budget``); Anthropic's ``thinking.budget_tokens`` maps onto the same. The
budget needs a reasoning parser (the model's thinking markers): asking for one on a model
without them is a 400, not a silently ignored field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from met.sampling.params import SamplingParams
from met.sampling.thinking import ThinkingBudget
from met.serving.errors import InvalidRequest
from met.serving.reasoning import ThinkParser

EFFORT_FRACTIONS = {"low": 0.25, "medium": 0.5, "high": 1.0}
DEFAULT_MAX_THINKING_BUDGET = 16384
_BUDGET_FIELDS = ("thinking_token_budget", "max_thinking_tokens", "thinking_budget")


def requested_budget(req: Any, max_budget: int | None) -> tuple[int, str] | None:
    """(budget, the field it came from) for an OpenAI-style request, or None. The operator's
    ``--max-thinking-budget`` caps explicit budgets too."""
    cap = DEFAULT_MAX_THINKING_BUDGET if max_budget is None else max_budget
    given = [(f, getattr(req, f, None)) for f in _BUDGET_FIELDS
             if getattr(req, f, None) is not None]
    if len(given) > 1:
        raise InvalidRequest(f"{given[1][0]}: send only one of {', '.join(_BUDGET_FIELDS)}",
                             given[1][0])
    if given:
        field, value = given[0]
        if value < 0:
            raise InvalidRequest(f"{field}: must be >= 0, got {value}", field)
        return min(value, cap), field
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:
        if effort not in EFFORT_FRACTIONS:
            raise InvalidRequest(f"reasoning_effort: must be one of "
                                 f"{', '.join(EFFORT_FRACTIONS)}, got {effort!r}",
                                 "reasoning_effort")
        return int(cap * EFFORT_FRACTIONS[effort]), "reasoning_effort"
    if max_budget is not None:
        return max_budget, "--max-thinking-budget"
    return None


def thinking_budget(tokenizer: Any, budget: int, parser: ThinkParser | None,
                    field: str) -> ThinkingBudget | None:
    """The engine-side budget for a model whose thinking ``parser`` splits; None when the
    prompt already closed the thinking (thinking switched off)."""
    if parser is None or tokenizer is None:
        raise InvalidRequest(f"{field}: this model has no thinking markers (start the server "
                             f"with --reasoning-parser think for a <think> model)", field)
    if parser.closed_in_prompt:
        return None

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

    return ThinkingBudget(budget, ids(parser.start), ids(parser.end),
                          starts_inside=parser.starts_inside,
                          fence_close_token_ids=ids("\n```\n"))


def with_thinking_budget(params: SamplingParams, req: Any, max_budget: int | None,
                         tokenizer: Any, parser: ThinkParser | None) -> SamplingParams:
    """``params`` with the request's thinking budget (unchanged when it asks for none)."""
    asked = requested_budget(req, max_budget)
    if asked is None:
        return params
    budget, field = asked
    if field == "--max-thinking-budget" and parser is None:
        return params  # the operator's cap applies only to models that think
    spec = thinking_budget(tokenizer, budget, parser, field)
    return params if spec is None else dataclasses.replace(params, thinking_budget=spec)

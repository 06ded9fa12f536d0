"""Attach a request's grammar spec to its sampling params, compiling it first (in a worker
thread, so a slow schema never stalls the event loop) so that a bad spec is a 400 that
carries the compiler's message."""

from __future__ import annotations

import asyncio
import dataclasses

from met.api.context import ServerContext
from met.sampling.grammar import GrammarError
from met.sampling.params import SamplingParams, StructuredOutputs
from met.serving.errors import InvalidRequest
from met.serving.protocol import SamplingFields
from met.serving.structured import structured_outputs


async def compile_spec(ctx: ServerContext, spec: StructuredOutputs, field: str) -> None:
    """Compile ``spec`` into the engine's grammar cache; 400 naming ``field`` if it fails."""
    core = ctx.engine.core
    if core is None:
        return  # not loaded: require_model() has already answered 503
    try:
        await asyncio.to_thread(core.grammars.compile, spec, field)
    except GrammarError as e:
        raise InvalidRequest(str(e), field, "invalid_grammar") from None
    except ValueError as e:  # e.g. a model without a tokenizer
        raise InvalidRequest(str(e), field) from None


async def with_structured_outputs(ctx: ServerContext, req: SamplingFields,
                                  params: list[SamplingParams]) -> list[SamplingParams]:
    """``params`` constrained by the request's response_format / structured_outputs."""
    found = structured_outputs(req)
    if found is None:
        return params
    spec, field = found
    await compile_spec(ctx, spec, field)
    return [dataclasses.replace(p, structured_outputs=spec) for p in params]

"""Structured output and quantized paths on the embedded SmolLM2: every constrained output
parses and validates (nested objects, arrays, enums, required fields, free strings), and the
int8 / int4 engines answer a fixed prompt as float32 does."""

from __future__ import annotations

import json

import jsonschema
import pytest

from met import LLM, SamplingParams, StructuredOutputs
from met.kernels import w4a8  # noqa: F401  (read by a string xfail condition below)

pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                      "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "weather": {"enum": ["sunny", "rainy", "cloudy"]},
        "temperature_c": {"type": "number"}},
     "required": ["city", "weather", "temperature_c"], "additionalProperties": False},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1,
                 "maxItems": 4}},
     "required": ["title", "tags"]},
    {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "first": {"type": "string", "maxLength": 30},
            "last": {"type": "string", "maxLength": 30}},
            "required": ["first", "last"]},
        "employed": {"type": "boolean"}},
     "required": ["person", "employed"]},
    {"type": "array", "items": {"type": "object", "properties": {
        "step": {"type": "integer"}, "action": {"type": "string", "maxLength": 60}},
        "required": ["step", "action"]}, "minItems": 2, "maxItems": 3},
]
ASKS = ["Describe a person as JSON.", "Report today's weather in Paris as JSON.",
        "Give a blog post title and tags as JSON.", "Describe an employee as JSON.",
        "List the steps to make tea as JSON."]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="bfloat16", quantization="none", max_model_len=1024)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_schema_output_validates(llm, temperature):
    prompts = [{"prompt_token_ids": llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": a}], add_generation_prompt=True, tokenize=True,
        return_dict=False)} for a in ASKS]
    params = [SamplingParams(max_tokens=200, temperature=temperature, seed=i,
                             structured_outputs=StructuredOutputs(json=s))
              for i, s in enumerate(SCHEMAS)]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]  # one batch
    for out, schema in zip(outs, SCHEMAS, strict=True):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_and_choice(llm):
    import re

    q = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    out = llm.chat([q], SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=
                                       StructuredOutputs(choice=["yes", "no"])))[0].outputs[0]
    assert out.text in ("yes", "no")
    q = [{"role": "user", "content": "Give me a date."}]
    out = llm.chat([q], SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=
                                       StructuredOutputs(regex=r"\d{4}-\d{2}-\d{2}")))[0]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", out.outputs[0].text)


INT4_NEAR_TIE = pytest.mark.xfail(
    reason="int4 (the Q4_1 integers, bfloat16 activations) starts this answer with 'L' "
           "(0.0015 nats ahead of 'The') and then rambles in French; float32, bfloat16, "
           "int8 and w8a8 answer Paris (docs/benchmarks.md, quality of the fast paths)",
    strict=False)
# w4a8 answers Paris where its prompt rows run on bfloat16 tiles (AMX-BF16); with int8
# prompt rows (CPUs without AMX-BF16) it starts with 'L' as int4 does. The condition is a
# string so that it is evaluated when the test runs (it builds the kernel), not at import.
W4A8_INT8_PROMPT_NEAR_TIE = pytest.mark.xfail(
    "not w4a8.prompt_rows_available()",
    reason="w4a8 with int8-activation prompt rows starts this answer with 'L', as int4",
    strict=False)


@pytest.mark.parametrize("quantization",
                         ["int8", pytest.param("int4", marks=INT4_NEAR_TIE), "w8a8",
                          pytest.param("w4a8", marks=W4A8_INT8_PROMPT_NEAR_TIE)])
def test_quantized_engines_answer_like_float32(quantization):
    q = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    llm = LLM(None, quantization=quantization, max_model_len=512)
    # (int8 may go on with ", France." where float32 stops: a near-tie after "Paris")
    assert llm.chat([q], greedy)[0].outputs[0].text.startswith("The capital of France is Paris")

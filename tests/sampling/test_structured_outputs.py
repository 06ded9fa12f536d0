"""Grammar-constrained output on tiny random models: whatever the (random) model prefers,
every output parses and matches its spec, constrained and free rows share a batch, and bad
specs / dead ends fail clearly."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from met import LLM, SamplingParams, StructuredOutputs
from met.sampling.grammar import GrammarError

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0,
                                              "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
                 "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                         "maximum": 99},
                                                   "y": {"type": "integer", "minimum": 0,
                                                         "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "color": {"enum": ["red", "green"]}},
     "required": ["point", "color"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama")), max_model_len=512)


def _token_id(llm, text: str) -> int:
    ids = llm.tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) == 1, (text, ids)
    return ids[0]


def _gen(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm, temperature):
    params = [SamplingParams(max_tokens=200, temperature=temperature, seed=i,
                             structured_outputs=StructuredOutputs(json=s))
              for i, s in enumerate(SCHEMAS)]
    outs = _gen(llm, ["The record:"] * len(SCHEMAS), params)
    for out, schema in zip(outs, SCHEMAS, strict=True):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)
    assert llm.kv_stats().num_blocks_in_use == 0


def test_json_object_regex_choice_and_grammar(llm):
    specs = [
        (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutputs(regex=r"[a-z]{2,5}-[0-9]{3}"),
         lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t) is not None),
        (StructuredOutputs(choice=["yes", "no", "maybe \"so\""]),
         lambda t: t in {"yes", "no", "maybe \"so\""}),
        (StructuredOutputs(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
         lambda t: re.fullmatch(r"\(\d+(\+\d+)*\)", t) is not None),
    ]
    # A random model has no reason to ever close a string or a repetition: a bias towards
    # the closing characters (which the grammars allow only where they are valid) ends them.
    closers = {_token_id(llm, c): 6.0 for c in ('"', "}", ")")}
    for temperature in (0.0, 1.0):
        params = [SamplingParams(max_tokens=120, temperature=temperature, seed=3,
                                 structured_outputs=s, logit_bias=closers) for s, _ in specs]
        outs = _gen(llm, ["Answer:"] * len(specs), params)
        for out, (_, check) in zip(outs, specs, strict=True):
            assert out.finish_reason == "stop", out
            assert check(out.text), out.text


def test_constrained_and_free_rows_share_a_batch(llm):
    """A free row's output is the same with or without constrained batch mates."""
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = _gen(llm, ["Hello there"], free)[0]
    constrained = SamplingParams(max_tokens=60, temperature=0.0,
                                 structured_outputs=StructuredOutputs(json=SCHEMAS[0]))
    mixed = _gen(llm, ["The record:", "Hello there", "The record:"],
                 [constrained, free, constrained])
    assert mixed[1].token_ids == alone.token_ids
    for out in (mixed[0], mixed[2]):
        jsonschema.validate(json.loads(out.text), SCHEMAS[0])


def test_unconstrained_output_would_not_parse(llm):
    """The guard that makes the tests above meaningful: the random model left alone does
    not write JSON."""
    out = _gen(llm, ["The record:"], SamplingParams(max_tokens=40, temperature=0.0))[0]
    with pytest.raises(ValueError):
        json.loads(out.text)


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputs(json='{"type": "object", "properties": {"a": {"type": "nope"}}}'),
     "json"),
    (StructuredOutputs(regex="a(b"), "regex"),
    (StructuredOutputs(grammar="root ::= undefined_rule"), "grammar"),
])
def test_invalid_specs_raise_naming_the_kind(llm, spec, field):
    with pytest.raises(GrammarError, match=f"structured_outputs: invalid {field}"):
        llm.generate(["x"], SamplingParams(structured_outputs=spec))
    assert llm.kv_stats().num_blocks_in_use == 0


def test_dead_end_fails_only_that_request(llm):
    """A grammar that needs a token allowed_token_ids forbids ends that request with an
    error; its batch mate finishes normally."""
    stuck = SamplingParams(max_tokens=10, temperature=0.0,
                           structured_outputs=StructuredOutputs(choice=["zzz"]),
                           allowed_token_ids=[_token_id(llm, "a")])
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = _gen(llm, ["Q:", "Q:"], [stuck, free])
    assert outs[0].finish_reason == "error"
    assert "dead end" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 8
    assert llm.kv_stats().num_blocks_in_use == 0


def test_specs_compare_and_reject_ambiguity():
    assert StructuredOutputs(json={"b": 1, "a": 2}) == StructuredOutputs(json={"a": 2, "b": 1})
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()

"""Thinking budgets over HTTP: a tiny model that never closes its thinking on its own gets
cut off by thinking_token_budget / reasoning_effort, and the answer follows as content."""

from __future__ import annotations

import httpx
import openai
import pytest

THINK_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

USER = [{"role": "user", "content": "Think about it."}]
GRACE = 32  # ThinkingBudget's default: extra tokens allowed to reach a sentence end


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("qwen3"))


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tmpl") / "think.jinja"
    path.write_text(THINK_TEMPLATE)
    return str(path)


def _start(start_server, ckpt, template_file, *extra):
    return start_server([ckpt, "--dtype", "float32", "--max-model-len", "512",
                         "--served-model-name", "tiny", "--chat-template", template_file,
                         *extra])


@pytest.fixture(scope="module")
def server(start_server, ckpt, template_file):
    return _start(start_server, ckpt, template_file)


@pytest.fixture(scope="module")
def capped(start_server, ckpt, template_file, server):
    """The same model with --max-thinking-budget 16."""
    s = _start(start_server, ckpt, template_file, "--max-thinking-budget", "16")
    return openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)


def _ask(client, **extra):
    return client.chat.completions.create(model="tiny", messages=USER, max_tokens=120,
                                          temperature=0, extra_body=extra)


def test_without_a_budget_the_model_thinks_until_max_tokens(client):
    """The guard: left alone the tiny model never answers."""
    r = _ask(client)
    assert r.choices[0].message.content == ""
    assert r.usage.completion_tokens_details.reasoning_tokens == 120


@pytest.mark.parametrize("capped_server, extra, budget", [
    (False, {"thinking_token_budget": 6}, 6),
    (False, {"max_thinking_tokens": 10}, 10),
    (False, {"thinking_budget": 0}, 0),
    (True, {"reasoning_effort": "low"}, 4),  # 1/4 of --max-thinking-budget 16
    (True, {"thinking_token_budget": 1000}, 16),  # the cap holds explicit budgets too
    (True, {}, 16),  # --max-thinking-budget applies to every request
])
def test_budget_ends_thinking_and_the_answer_follows(request, client, capped_server, extra,
                                                     budget):
    r = _ask(request.getfixturevalue("capped") if capped_server else client, **extra)
    msg = r.choices[0].message
    reasoning = r.usage.completion_tokens_details.reasoning_tokens
    assert budget <= reasoning <= budget + GRACE + 8  # + the end marker's tokens
    assert msg.content, "no answer after the forced end of thinking"
    assert r.usage.completion_tokens == 120


def test_streamed_budget_gives_the_same_split(client):
    whole = _ask(client, thinking_token_budget=6).choices[0].message
    chunks = list(client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=120, temperature=0, stream=True,
        extra_body={"thinking_token_budget": 6}))
    reasoning = "".join(getattr(c.delta, "reasoning_content", None) or ""
                        for ch in chunks for c in ch.choices)
    content = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    assert (reasoning, content) == (whole.reasoning_content, whole.content)


@pytest.mark.parametrize("extra, param", [
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"thinking_token_budget": 5, "thinking_budget": 5}, "thinking_budget"),
])
def test_bad_budget_fields_are_400s(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, **extra)
    assert e.value.body["param"] == param


def test_budget_on_a_model_without_thinking_is_a_400(start_server, tiny_checkpoint):
    plain = start_server([str(tiny_checkpoint("llama")), "--dtype", "float32",
                          "--max-model-len", "256", "--served-model-name", "tiny"])
    r = httpx.post(f"{plain.url}/v1/chat/completions", json={
        "model": "tiny", "messages": USER, "max_tokens": 4, "thinking_token_budget": 5},
        timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"

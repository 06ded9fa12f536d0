"""The web chat at ``/`` in a real browser: headless Chromium (Debian's ``chromium``) driven by
Playwright, against a real `met serve` with the embedded model. Screenshots go to
tests/artifacts/ (git-ignored). Without chromium or playwright the browser tests fail with
the install hint (CI installs both)."""

from __future__ import annotations

import http.client
import json
import re
from pathlib import Path

import httpx
import pytest
from serve_harness import REPO, wait_until

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "tests" / "artifacts"
MODEL = "SmolLM2-135M-Instruct"
# No sandbox (containers, root) and none of Chromium's own calls home: the page must work
# with this server alone.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright import sync_api
    except ImportError:
        pytest.fail("playwright is not installed (pip install -e '.[test]')")
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} not found: apt-get install -y chromium")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(["--max-model-len", "2048", "--max-num-seqs", "4"])


@pytest.fixture(scope="module")
def auth_server(start_server):
    """A key, and one request a minute per key."""
    return start_server(["--max-model-len", "1024", "--max-num-seqs", "2",
                         "--api-key", "sekrit", "--rate-limit-rpm", "1"])


@pytest.fixture
def open_page(browser):
    """``open_page(url, **context_options)`` → a page on a fresh profile (empty localStorage);
    a script error in the page fails the test."""
    contexts, errors = [], []

    def open_(url: str, **options):
        context = browser.new_context(**options)
        contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url + "/")
        return page

    yield open_
    for context in contexts:
        context.close()
    assert not errors, errors


def settings(page, **fields: str) -> None:
    """Fill the settings panel (opening it first): ``settings(page, temperature="0")``."""
    if page.locator("#settings").is_hidden():
        page.click("#toggle-settings")
    for name, value in fields.items():
        page.fill("#" + name.replace("_", "-"), value)
        page.dispatch_event("#" + name.replace("_", "-"), "change")


def until(page, expression: str, timeout: float = 30_000) -> None:
    """Poll a JS expression until true. As a function: Playwright eval()s a bare expression
    in the page, which the page's CSP forbids."""
    page.wait_for_function(f"() => {expression}", timeout=timeout)


def models_loaded(page) -> None:
    until(page, "document.querySelector('#model').options.length > 0")


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def last_reply(page):
    return page.locator(".message.assistant").last


def wait_done(page, timeout: float = 120_000) -> None:
    """Until the reply in flight has ended (its stats line or its error shows)."""
    last_reply(page).locator(".stats, .error").first.wait_for(timeout=timeout)
    page.locator("#send").wait_for(timeout=timeout)


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def test_page_loads_from_this_server_alone_and_lists_the_model(open_page, server):
    page = open_page(server.url)
    urls = []
    page.on("request", lambda request: urls.append(request.url))
    page.reload()  # now with every request the page makes logged
    models_loaded(page)
    assert page.locator("#model option").all_inner_texts() == [MODEL]
    assert page.inner_text("#token-count") == "0 / 2048 tokens"
    assert any(u.endswith("/v1/models") for u in urls)
    assert all(u.startswith(server.url + "/") for u in urls), urls


def test_the_page_needs_no_key_but_the_api_does(auth_server):
    url = auth_server.url
    page = httpx.get(url + "/")
    assert page.status_code == 200 and "met chat" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert httpx.get(url + "/webui/chat.js").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.post(url + "/", json={}).status_code == 401  # only GET / is the page
    # Nothing under /webui/ reaches the API, however the path is spelled.
    host, port = url.removeprefix("http://").split(":")
    for path in ("/webui/nope.js", "/webui/../v1/models", "/webui/%2e%2e/v1/models"):
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", path)  # sent as written: httpx would normalise the dots
        response = conn.getresponse()
        body = response.read()
        conn.close()
        assert response.status == 404, (path, body)
        assert json.loads(body)["error"]["message"].startswith("no such file"), path


def test_reply_streams_in_and_the_conversation_survives_reloads(open_page, server):
    page = open_page(server.url)
    models_loaded(page)
    settings(page, temperature="0", max_tokens="48")
    # Each text length the reply shows while it streams: a streamed reply shows several.
    page.evaluate("""() => {
        window.lengths = [];
        new MutationObserver(() => {
            const r = [...document.querySelectorAll('.message.assistant .markdown')].pop();
            if (r) window.lengths.push(r.textContent.length);
        }).observe(document.querySelector('#messages'), {childList: true, subtree: true});
    }""")
    page.fill("#input", "What is")
    page.press("#input", "Shift+Enter")  # a new line, not a send
    page.type("#input", "the capital of France?")
    assert page.input_value("#input") == "What is\nthe capital of France?"
    assert page.locator(".message").count() == 0
    page.press("#input", "Enter")
    wait_done(page)
    reply = last_reply(page).locator(".markdown").inner_text()
    assert "Paris" in reply
    assert len(set(page.evaluate("window.lengths"))) > 2  # it grew in steps: streamed
    stats = last_reply(page).locator(".stats").inner_text()
    assert re.search(r"^\d+ tokens · [\d.]+ tok/s · first token \d+ ms · prompt \d+ tokens",
                     stats), stats
    assert re.fullmatch(r"[1-9]\d* / 2048 tokens", page.inner_text("#token-count"))
    screenshot(page, "webchat-desktop.png")

    page.reload()
    titles = page.locator("#conversations .title")
    assert titles.all_inner_texts() == ["What is the capital of France?"]
    assert "Paris" in last_reply(page).inner_text()
    assert page.input_value("#temperature") == "0"  # settings are kept too

    page.once("dialog", lambda d: d.accept("Geography"))
    page.click("#conversations .rename")
    page.reload()
    assert titles.all_inner_texts() == ["Geography"]
    page.click("#new-chat")
    assert page.locator(".message").count() == 0
    page.click("#conversations li:has-text('Geography') .title")
    assert "Paris" in last_reply(page).inner_text()
    page.once("dialog", lambda d: d.accept())
    page.click("#conversations li:has-text('Geography') .delete")
    page.reload()
    assert titles.all_inner_texts() == ["New chat"]


def test_stop_and_esc_abort_the_stream_and_free_the_kv(open_page, server):
    page = open_page(server.url)
    models_loaded(page)
    settings(page, max_tokens="1800", seed="1")
    for how in ("button", "escape"):
        aborted = server.metric("met_requests_total", finish_reason="abort")
        send(page, "Write a very long story about a dragon, in ten chapters.")
        until(page, "[...document.querySelectorAll('.message.assistant .markdown')].pop()"
                    "?.textContent.length > 20")
        assert server.metric("met_kv_blocks_used") > 0  # the request holds KV while it runs
        if how == "button":
            page.click("#stop")
        else:
            page.keyboard.press("Escape")
        wait_done(page, timeout=10_000)
        assert wait_until(lambda: server.metric("met_kv_blocks_used") == 0, timeout=10), how
        assert server.metric("met_requests_total", finish_reason="abort") == aborted + 1
        stats = last_reply(page).locator(".stats").inner_text()
        assert "stopped" in stats and stats.startswith("≈"), stats
        assert last_reply(page).locator(".error").count() == 0


def test_reasoning_tool_calls_and_a_mid_stream_error_are_shown(open_page, server):
    """A canned stream (the embedded model neither reasons nor calls tools), in the shape
    met's server sends: reasoning_content deltas, content, a tool call, then an error event."""
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "The user wants "}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "code."}}]},
        {"choices": [{"index": 0, "delta": {"content": "Here:\n\n```python\nprint(1)\n```\n"}}]},
        {"choices": [{"index": 0, "delta": {
            "content": '<img src="x" onerror="window.pwned = 1"> **done**'}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{
            "index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}]},
        {"error": {"message": "engine failed: out of memory", "type": "server_error",
                   "param": None, "code": "engine_error"}},
    ]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page = open_page(server.url)
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=body))
    send(page, "Show me some code")
    wait_done(page)
    reply = last_reply(page)
    details = reply.locator("details.reasoning")
    assert details.get_attribute("open") is None  # folded
    assert details.inner_text() == "Reasoning"
    details.locator("summary").click()
    assert "The user wants code." in details.inner_text()
    assert reply.locator("pre code.hljs .hljs-built_in").inner_text() == "print"
    assert reply.locator(".markdown strong").inner_text() == "done"
    assert reply.locator("img").get_attribute("onerror") is None  # DOMPurify removed it
    assert page.evaluate("window.pwned") is None
    assert "Tool call: get_weather" in reply.locator(".tool-call").inner_text()
    assert '"city": "Paris"' in reply.locator(".tool-call").inner_text()
    assert reply.locator(".error").inner_text() == "Error: engine failed: out of memory"

    # A stream cut off without [DONE] (the server went away) says so.
    page.unroute("**/v1/chat/completions")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream"},
        body="".join(f"data: {json.dumps(c)}\n\n" for c in chunks[:4])))
    send(page, "Again")
    wait_done(page)
    error = last_reply(page).locator(".error").inner_text()
    assert error == "Error: the connection closed before the reply was complete.", error
    assert "print(1)" in last_reply(page).inner_text()  # what came is kept

    page.unroute("**/v1/chat/completions")  # a 400 from the real server names the field
    settings(page, temperature="-1")
    send(page, "Hello")
    wait_done(page)
    error = last_reply(page).locator(".error").inner_text()
    assert error.startswith("Error 400: ") and "temperature" in error, error


def test_phone_width_has_no_horizontal_overflow(open_page, server):
    page = open_page(server.url, viewport={"width": 390, "height": 844}, is_mobile=True,
                     has_touch=True)
    # A conversation with what tends to overflow: a long code line, a wide table, long words.
    code = "x = " + "1234567890 + " * 40
    content = (f"```python\n{code}\n```\n\n| a | b | c | d | e | f |\n|---|---|---|---|---|---|\n"
               + "| " + " | ".join(["a-long-cell-value-here"] * 6) + " |\n\n" + "word" * 60)
    conversation = {"id": "c1", "title": "Phone test", "created": 0, "messages": [
        {"role": "user", "content": "Show me " + "long" * 40},
        {"role": "assistant", "content": content, "reasoning": "", "tool_calls": [],
         "stats": {"tokens": 120, "exact": True, "tps": 50.0, "ttft_ms": 80}}]}
    page.evaluate("c => { localStorage.setItem('met.conversations', JSON.stringify([c]));"
                  "localStorage.setItem('met.current', JSON.stringify(c.id)); }", conversation)
    page.reload()
    models_loaded(page)

    def overflow() -> int:
        return page.evaluate("document.documentElement.scrollWidth - window.innerWidth")

    assert page.locator("pre code.hljs").count() == 1
    assert overflow() <= 0
    assert page.locator("#sidebar").bounding_box()["x"] < 0  # the drawer is closed
    screenshot(page, "webchat-phone.png")
    page.tap("#toggle-sidebar")
    until(page, "document.querySelector('#sidebar').getBoundingClientRect().x >= 0")
    assert overflow() <= 0
    page.tap("#conversations .title")  # picking a conversation closes the drawer
    until(page, "document.querySelector('#sidebar').getBoundingClientRect().right <= 0")
    page.tap("#toggle-settings")
    assert overflow() <= 0
    assert page.locator("#send").is_visible() and page.locator("#input").is_visible()


def test_api_key_wrong_then_right_and_rate_limit_are_shown(open_page, auth_server):
    page = open_page(auth_server.url)
    notice = page.locator("#notice")
    notice.wait_for()
    assert notice.inner_text().startswith("Error 401: missing API key")
    settings(page, api_key="wrong", temperature="0", max_tokens="16")
    until(page, "document.querySelector('#notice').textContent.includes('incorrect API key')")
    send(page, "Hi")
    wait_done(page)
    error = last_reply(page).locator(".error").inner_text()
    assert error.startswith("Error 401: incorrect API key provided"), error

    settings(page, api_key="sekrit")
    models_loaded(page)
    assert notice.is_hidden()
    send(page, "Hi")
    wait_done(page)
    assert last_reply(page).locator(".error").count() == 0
    assert last_reply(page).locator(".markdown").inner_text().strip()

    send(page, "Hi again")  # one request a minute: this one is refused
    wait_done(page)
    error = last_reply(page).locator(".error").inner_text()
    assert error.startswith("Error 429: ") and "retry in" in error, error

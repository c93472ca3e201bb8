"""The chat page `ggrun serve` shows at /, in a real headless Chromium (Debian's `chromium`, driven
by playwright, never playwright's own browser) against a real server on SmolLM2: a streamed answer
equal to the API's greedy text, Stop and Esc freeing the sequence, conversations kept across a
reload and through export and import, hostile content that never runs, the API key, errors shown
with the typed message kept, and screenshots at a laptop's and a phone's size. Every test ends with
no uncaught error and no console error but the failed requests it causes on purpose."""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

from runner.serve.page import CSP

from .test_serve import Server, _wait_for

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason="no chromium to drive (Debian's package: apt-get install chromium)")

N_CTX = 1024
KEY = "sesame"
WIDE, NARROW = {"width": 1280, "height": 800}, {"width": 390, "height": 844}
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage"]  # (a container's /dev/shm may be too small for the renderer)
WEBUI = Path(__file__).parent.parent / "runner" / "serve" / "webui"


@pytest.fixture(scope="module")
def server(smollm_path, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("webui"), smollm_path, "-c", N_CTX, "-np", 2)
    s.wait_ready()
    yield s
    assert s.stop() == 130 and "Traceback" not in s.log()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    """Where screenshots go: $GGRUN_ARTIFACTS (kept), else a temporary folder."""
    given = os.environ.get("GGRUN_ARTIFACTS")
    if not given:
        return tmp_path_factory.mktemp("artifacts")
    Path(given).mkdir(parents=True, exist_ok=True)
    return Path(given)


class Watched:
    """A page in a fresh browser context (its own storage), and its errors: uncaught exceptions and
    console errors, less the failed requests a test causes on purpose (status and path)."""

    def __init__(self, browser, url: str, **context):
        self.context = browser.new_context(**{"viewport": WIDE, "reduced_motion": "reduce", **context})
        self.page = self.context.new_page()
        self.url, self.errors, self.expected = url, [], []
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("console", self._console)

    def _console(self, message):
        failed = re.match(r"Failed to load resource: the server responded with a status of (\d+)", message.text)
        if message.type != "error" or (failed and (int(failed.group(1)), message.location["url"].removeprefix(
                self.url)) in self.expected):
            return
        self.errors.append(f"console: {message.text} ({message.location['url']})")

    def expect_failure(self, status: int, path: str) -> None:
        self.expected.append((status, path))

    def open(self, wait_model: bool = True):
        self.page.goto(self.url + "/")
        if wait_model:
            expect(self.page.locator("#model")).to_have_text(re.compile(r"SmolLM2"), timeout=30_000)
        return self.page


@pytest.fixture
def watched(browser, server):
    opened = []

    def make(url: str = server.url, **context) -> Watched:
        opened.append(Watched(browser, url, **context))
        return opened[-1]
    yield make
    for w in opened:
        w.context.close()
    assert not [e for w in opened for e in w.errors]


def setting(page, name: str, value) -> None:
    if page.locator("#settings").is_hidden():
        page.click("#open-settings")
    page.fill(f"#set-{name}", str(value))


def conversations(page) -> list[dict]:
    return json.loads(page.evaluate("localStorage.getItem('ggrun.conversations')") or "[]")


def reply_done(page, timeout: float = 60_000) -> None:
    expect(page.locator("#send")).to_be_visible(timeout=timeout)


def test_a_typed_question_streams_the_greedy_answer(server, watched, artifacts):
    question = "Explain what a hash table is, with a short Python example."
    page = watched().open()
    defaults = httpx.get(server.url + "/props").json()["default_generation_settings"]["params"]
    page.click("#open-settings")  # (the server's defaults, until a setting is given)
    for name in ("temperature", "top_k", "top_p", "min_p"):
        expect(page.locator(f"#set-{name}")).to_have_attribute("placeholder", format(defaults[name], "g"))
    page.fill("#input", "a first line")
    page.press("#input", "Shift+Enter")  # (a new line, nothing sent)
    page.keyboard.type("a second")
    assert page.input_value("#input") == "a first line\na second" and page.locator(".msg").count() == 0
    setting(page, "temperature", 0)
    setting(page, "max_tokens", 120)
    page.fill("#input", question)
    page.press("#input", "Enter")
    seen = []
    while page.locator("#stop").is_visible() or not seen:
        seen.append(len(page.locator(".msg.assistant .md").last.text_content() or ""))
        time.sleep(0.01)
    reply_done(page)
    growing = sorted({n for n in seen if n})
    assert len(growing) >= 3, seen  # (the answer grew over several observations)
    api = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 120}).json()
    [conversation] = conversations(page)
    user, reply = conversation["messages"]
    assert user == {"role": "user", "content": question}
    assert reply["content"] == api["choices"][0]["message"]["content"]
    assert reply["stats"]["tokens"] == api["usage"]["completion_tokens"]
    figures = page.locator(".msg.assistant .figures").inner_text()
    assert re.fullmatch(r"\d+ tokens · first token [\d.]+ s · prompt [\d.]+ tok/s · decode [\d.]+ tok/s", figures)
    used = api["usage"]["prompt_tokens"] + api["usage"]["completion_tokens"]
    expect(page.locator("#context-text")).to_have_text(f"{used} / {N_CTX}")
    page.screenshot(path=artifacts / "chat-1280x800.png")

    page.reload()  # the conversation and the settings are kept
    expect(page.locator(".msg.assistant .md")).to_have_count(1)
    assert page.locator(".msg.user .plain").inner_text() == question
    assert page.locator("#conversations .conv-title").all_inner_texts() == [conversation["title"]]
    assert page.input_value("#set-temperature") == "0" and page.input_value("#set-max_tokens") == "120"
    # regenerate gives the same greedy reply; an edited question is sent again from there
    page.click(".msg.assistant [data-action=regenerate]")
    reply_done(page)
    assert conversations(page)[0]["messages"][1]["content"] == reply["content"]
    page.click(".msg.user [data-action=edit]")
    page.fill(".editor textarea", "What is 2 + 2?")
    page.click("[data-action=edit-send]")
    reply_done(page)
    messages = conversations(page)[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "What is 2 + 2?"


def _settled(server, before: dict) -> dict:
    deadline = time.monotonic() + 5
    while (m := server.metrics())["requests_processing"] or m["requests_cancelled_total"] == \
            before["requests_cancelled_total"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.02)
    return m


def test_stop_and_esc_free_the_sequence(server, watched):
    page = watched().open()
    setting(page, "temperature", 0)  # (its greedy story runs to the end of the context: ~1000 tokens)
    for stop in (lambda: page.click("#stop"), lambda: page.keyboard.press("Escape")):
        before = server.metrics()
        page.fill("#input", "Tell me a long story about a dragon and a knight.")
        page.press("#input", "Enter")
        expect(page.locator(".msg.assistant .md").last).to_have_text(re.compile(r"\w{3}.*\w{3}"))
        stop()
        after = _settled(server, before)
        assert after["requests_processing"] == 0
        assert after["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
        reply_done(page, 5_000)
        expect(page.locator(".msg.assistant .figures").last).to_have_text("stopped")
        assert conversations(page)[0]["messages"][-1]["stopped"] is True


def test_export_import_rename_search_delete(watched, tmp_path):
    page = watched().open()
    setting(page, "max_tokens", 8)
    for question in ("Name a colour.", "Name a fruit."):
        page.click("#new-chat")
        page.fill("#input", question)
        page.press("#input", "Enter")
        reply_done(page)
    expect(page.locator("#conversations li")).to_have_count(2)
    page.click("#conversations li:nth-child(1) [data-action=rename]")
    page.fill("#conversations .rename", "Fruit talk")
    page.press("#conversations .rename", "Enter")
    page.fill("#search", "colour")
    expect(page.locator("#conversations .conv-title")).to_have_text(["Name a colour."])
    page.fill("#search", "")
    with page.expect_download() as download:
        page.click("#export")
    exported = json.loads(Path(download.value.path()).read_text())
    assert exported["format"] == "ggrun-conversations" and len(exported["conversations"]) == 2
    assert exported["conversations"][0]["title"] == "Fruit talk"
    for _ in range(2):  # (a second click confirms)
        page.click("#conversations li:nth-child(1) [data-action=delete]")
        page.click("#conversations li:nth-child(1) [data-action=delete]")
    expect(page.locator("#conversations li")).to_have_count(0)
    saved = tmp_path / "export.json"
    saved.write_text(json.dumps(exported))
    page.set_input_files("#import-file", saved)
    expect(page.locator("#conversations li")).to_have_count(2)
    assert conversations(page) == exported["conversations"]
    page.reload()
    with page.expect_download() as again:
        page.click("#export")
    assert json.loads(Path(again.value.path()).read_text()) == exported


HOSTILE = ("Hi <img src=x onerror=\"window.canary='img'\"> and <script>window.canary='script'</script>\n\n"
           "[click me](javascript:window.canary='link') [tab](java\tscript:window.canary='tab') "
           "<a href=\"javascript:window.canary='a'\">raw</a> ![pic](javascript:window.canary='image')\n\n"
           "A [safe link](https://example.com/a) and **bold** `<b>code</b>`\n\n"
           "```html\n</code></pre><script>window.canary='fence'</script>\n```\n\n"
           "| a | b |\n|---|:-:|\n| <svg onload=\"window.canary='svg'\"> | 2 |")


def test_hostile_content_never_runs(watched, tmp_path):
    conversation = {"id": "hostile", "title": "<img src=x onerror=\"window.canary='title'\">",
                    "messages": [{"role": "user", "content": "<script>window.canary='user'</script>",
                                  "files": [{"name": "<b onmouseover=alert(1)>.txt", "text": "x"}]},
                                 {"role": "assistant", "content": HOSTILE, "reasoning": HOSTILE,
                                  "stats": {"tokens": "<script>", "ttft": 0.1}},
                                 {"role": "system", "content": "<script>window.canary='system'</script>"}]}
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps({"format": "ggrun-conversations", "version": 1, "conversations": [conversation]}))
    w = watched()
    page = w.open()
    page.set_input_files("#import-file", path)
    expect(page.locator(".msg.assistant")).to_have_count(1)
    page.click("details.reasoning summary")
    messages = page.locator("#messages")
    assert messages.locator("script, img, svg, iframe, [onerror], [onload], [onmouseover]").count() == 0
    hrefs = messages.locator("a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
    assert hrefs == ["https://example.com/a"] * 2  # (the answer's and the reasoning's)
    for fake in messages.locator(".link-text").all():
        fake.click()
    assert "<script>window.canary='script'</script>" in messages.locator(".msg.assistant .md").last.inner_text()
    assert messages.locator(".tok-kw, .tok-str").count() == 0 and messages.locator("table td").count() == 4
    assert page.evaluate("typeof window.canary") == "undefined"
    assert page.locator("#title").inner_text() == conversation["title"]
    assert [m["role"] for m in conversations(page)[0]["messages"]] == ["user", "assistant"]


def test_a_reasoning_reply_is_folded_apart(watched):
    """Thinking streamed as reasoning_content goes in a closed <details> apart from the answer; with
    no `timings` in the stream the figures come from the page's clock and the usage. (The stream
    is played to the page, as the server sends one for a reasoning model: tests/test_serve.py.)"""
    chunks = [{"delta": {"role": "assistant", "content": ""}}, {"delta": {"reasoning_content": "Let me <b>think</b>."}},
              {"delta": {"reasoning_content": " 2 + 2 = 4."}}, {"delta": {"content": "The answer is **4**."}},
              {"delta": {}, "finish_reason": "stop"}]
    events = [{"object": "chat.completion.chunk", "choices": [{"index": 0, **c}]} for c in chunks]
    events.append({"object": "chat.completion.chunk", "choices": [],
                   "usage": {"prompt_tokens": 20, "completion_tokens": 12, "total_tokens": 32}})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    page = watched().open()
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    page.fill("#input", "What is 2 + 2?")
    page.press("#input", "Enter")
    reply_done(page)
    thinking = page.locator(".msg.assistant details.reasoning")
    assert thinking.get_attribute("open") is None and thinking.locator("summary").inner_text() == "Thinking"
    assert thinking.locator(".md").text_content() == "Let me <b>think</b>. 2 + 2 = 4."
    assert page.locator(".msg.assistant .bubble > .md").inner_text() == "The answer is 4."
    assert page.locator(".msg.assistant .bubble > .md strong").inner_text() == "4"
    assert page.locator(".msg.assistant .figures").inner_text().startswith("12 tokens · first token ")
    expect(page.locator("#context-text")).to_have_text(f"32 / {N_CTX}")
    [_, reply] = conversations(page)[0]["messages"]
    assert reply["reasoning"] == "Let me <b>think</b>. 2 + 2 = 4." and reply["content"] == "The answer is **4**."


def test_an_over_long_prompt_is_a_400_in_the_conversation_and_the_message_is_kept(watched, tmp_path, artifacts):
    """Typed, or from an attached file (whose text goes into the message): the server's 400 shows in
    the conversation, and what was typed and attached comes back into the composer."""
    w = watched()
    page = w.open()
    w.expect_failure(400, "/v1/chat/completions")
    typed = "word " * 1100
    page.fill("#input", typed)
    page.press("#input", "Enter")
    expect(page.locator(".notice")).to_contain_text(re.compile(rf"prompt has \d+ tokens.*{N_CTX}"))
    assert page.input_value("#input") == typed
    assert page.locator(".msg, #conversations li").count() == 0
    page.reload()  # (the draft is kept too)
    assert page.input_value("#input") == typed

    long_file = tmp_path / "words.txt"
    long_file.write_text(typed)
    page.fill("#input", "Count the words.")
    page.set_input_files("#attach-file", long_file)
    expect(page.locator("#attachments .file-chip")).to_have_text("words.txt✕")
    page.click("#send")
    expect(page.locator(".notice")).to_contain_text("prompt has")
    page.screenshot(path=artifacts / "error-400-1280x800.png")
    assert page.input_value("#input") == "Count the words."
    expect(page.locator("#attachments .file-chip")).to_have_count(1)
    page.click("#attachments .file-chip button")
    short_file = tmp_path / "short.txt"
    short_file.write_text("apple banana cherry")
    page.set_input_files("#attach-file", short_file)
    setting(page, "max_tokens", 4)
    page.click("#send")
    reply_done(page)
    [user, _] = conversations(page)[0]["messages"]
    assert user["files"] == [{"name": "short.txt", "text": "apple banana cherry"}]
    assert page.locator(".msg.user .file-chip").inner_text() == "short.txt"


def test_the_key_is_asked_for_once_and_a_busy_server_says_so(smollm_path, tmp_path, watched):
    s = Server(tmp_path, smollm_path, "-c", N_CTX, "--api-key", KEY, "-np", 1, "--max-queue", 1)
    try:
        s.wait_ready()
        assert httpx.get(s.url + "/v1/models").status_code == 401  # (the API stays protected)
        assert httpx.get(s.url + "/webui/app.js").status_code == 200
        w = watched(s.url)
        w.expect_failure(401, "/props")
        page = w.open(wait_model=False)
        expect(page.locator("#key-dialog")).to_be_visible()
        page.fill("#key-input", "wrong")
        page.press("#key-input", "Enter")
        expect(page.locator("#key-error")).to_contain_text("invalid API key")
        page.fill("#key-input", KEY)
        page.click("#key-ok")
        expect(page.locator("#model")).to_have_text(re.compile("SmolLM2"))
        assert page.evaluate("sessionStorage.getItem('ggrun.key')") == KEY
        setting(page, "max_tokens", 4)
        page.fill("#input", "Hi")
        page.press("#input", "Enter")
        reply_done(page)
        assert conversations(page)[0]["messages"][1]["stats"]["tokens"] <= 4
        page.reload()
        expect(page.locator("#model")).to_have_text(re.compile("SmolLM2"))
        assert page.locator("#key-dialog").is_hidden()

        w.expect_failure(503, "/v1/chat/completions")  # one request runs, one waits: the page's finds the queue full
        count = {"prompt": "1, 2, 3,", "max_tokens": 900, "stream": True, "ignore_eos": True}
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(timeout=60, headers=auth) as running, httpx.Client(timeout=60, headers=auth) as waiting:
            with running.stream("POST", s.url + "/v1/completions", json=count) as first:
                lines = first.iter_lines()  # (kept: a dropped iterator closes the response)
                next(lines)
                with waiting.stream("POST", s.url + "/v1/completions", json=count):
                    _wait_for(lambda: s.metrics(auth)["requests_deferred"])
                    page.fill("#input", "Are you there?")
                    page.press("#input", "Enter")
                    expect(page.locator(".notice")).to_contain_text("The server is busy")
        assert page.input_value("#input") == "Are you there?"
    finally:
        assert s.stop() == 130


def test_headers_size_and_no_webui(server, smollm_path, tmp_path):
    html = {"Accept": "text/html"}
    page = httpx.get(server.url + "/", headers=html)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CSP
    assert httpx.get(server.url + "/", headers={**html, "If-None-Match": page.headers["etag"]}).status_code == 304
    assert httpx.get(server.url + "/").text == "ggrun is running"  # (what other clients get)
    names = re.findall(r'(?:src|href)="/webui/([\w.]+)"', page.text)
    modules = {m for f in WEBUI.glob("*.js") for m in re.findall(r'from "\./([\w.]+)"', f.read_text())}
    shipped = {f.name for f in WEBUI.iterdir()}
    assert set(names) | modules | {"index.html", "app.js"} == shipped
    assets = [httpx.get(server.url + "/webui/" + name) for name in shipped - {"index.html"}]
    assert all(r.status_code == 200 and r.headers["cache-control"] and r.headers["etag"] for r in assets)
    assert len(page.content) + sum(len(r.content) for r in assets) < 300_000
    missing = httpx.get(server.url + "/webui/nothing.js")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404

    off = Server(tmp_path, smollm_path, "--no-webui")  # (answers / at once, while the model loads)
    try:
        assert httpx.get(off.url + "/", headers=html).text == "ggrun is running"
        assert httpx.get(off.url + "/webui/app.js").status_code == 404
    finally:
        off.stop()


def test_screenshots_and_a_phone_width(watched, artifacts, tmp_path):
    conversation = {"id": "looks", "title": "How the page looks", "messages": [
        {"role": "user", "content": "Show me a table, a list and some code.",
         "files": [{"name": "notes.txt", "text": "some notes"}]},
        {"role": "assistant", "reasoning": "The user wants *examples*.", "content": (
            "## Examples\n\n1. **First** item\n2. Second with `inline code`\n   - nested\n\n"
            "> A quote\n\n| Name | Size |\n|---|--:|\n| a | 1 |\n| b | 22 |\n\n"
            "```python\ndef add(a, b):\n    # the sum\n    return a + b  # 'done'\n```\n\n"
            "See [the docs](https://example.com)."),
         "stats": {"tokens": 88, "ttft": 0.12, "promptRate": 512.3, "decodeRate": 48.7, "context": 300}}]}
    path = tmp_path / "looks.json"
    path.write_text(json.dumps([conversation]))
    for scheme in ("light", "dark"):
        for size in (WIDE, NARROW):
            page = watched(viewport=size, color_scheme=scheme).open()
            page.set_input_files("#import-file", path)
            expect(page.locator(".code-block .tok-kw").first).to_have_text("def")
            page.screenshot(path=artifacts / f"page-{scheme}-{size['width']}x{size['height']}.png")
            assert page.evaluate("document.documentElement.scrollWidth") <= size["width"]
            sidebar = page.locator("#sidebar")
            if size is NARROW:
                assert sidebar.bounding_box()["x"] + sidebar.bounding_box()["width"] <= 0  # (folded away)
                page.click("#open-sidebar")
                expect(page.locator("#conversations .conv-title")).to_be_in_viewport()
                page.screenshot(path=artifacts / f"page-{scheme}-{size['width']}x{size['height']}-list.png")
            else:
                assert sidebar.bounding_box()["x"] == 0
    page.click("#close-sidebar")
    page.click(".code-block .copy")
    expect(page.locator(".code-block .copy")).to_have_text("Copied")

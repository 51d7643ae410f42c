"""The chat page of ``quickdraft serve`` and the per-token provenance it shows.

- Routes (an in-process app over a tiny random model; nothing is generated): / and /webui/*
  serve the page's files (public under --api-key), the API, /health, /metrics, /openapi.json
  and the 404 listing are as before, ``create_app(webui=False)`` serves no page.
- Provenance (a real server of SmolLM2-135M drafting with n-gram lookup, started with
  --no-webui): the opt-in ``"quickdraft": {"provenance": true}`` adds to every streamed chunk how
  many of its tokens were accepted drafts, the counts add up to the usage block, and without it
  the chunks are OpenAI's, the greedy text the same.
- The page in a real browser (Debian's chromium driven by selenium) on Qwen2.5-Coder-0.5B with
  an API key: a streamed answer with a highlighted code block, its speed line and draft marks; a
  400 shown next to its setting; a long answer stopped and its sequence freed; conversations
  renamed, switched, deleted and found again after a reload. Screenshot: ``webui.png`` in the
  test's tmp_path.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from live_server import KEY, NAME, Server, running, start_server
from tiny import make_tiny_hf_model

from quickdraft.server import create_app
from quickdraft.server.app import WEBUI_FILES

# ------------------------------------------------------------------------------------- routes


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from quickdraft.api import LLM

    before = torch.get_num_threads()
    folder = make_tiny_hf_model(tmp_path_factory.mktemp("webui"), "llama", seed=5, name="webui-tiny")
    yield LLM(str(folder), draft="none", dtype="float32", max_context=64, threads=1)
    torch.set_num_threads(before)


def _client(llm: Any, **kw: Any) -> TestClient:
    """The app's routes without its lifespan: no engine thread, nothing generated."""
    return TestClient(create_app(llm, "tiny", **kw))


def test_the_page_and_its_files_are_served(tiny_llm: Any) -> None:
    client = _client(tiny_llm)
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for path in ("/webui/style.css", "/webui/app.js", "/webui/markdown.js"):
        assert path in page.text  # every file the page loads is one the server serves
    for path, (_name, media_type) in WEBUI_FILES.items():
        got = client.get(path)
        assert got.status_code == 200 and got.headers["content-type"] == media_type, path
        assert got.content and got.headers["cache-control"] == "no-cache"
    assert "/v1/chat/completions" in client.get("/webui/app.js").text  # the page talks to our API
    assert "http://" not in page.text and "https://" not in page.text  # no CDN: works offline


def test_the_page_does_not_shadow_the_api(tiny_llm: Any) -> None:
    with_page, without = _client(tiny_llm), _client(tiny_llm, webui=False)
    for client in (with_page, without):
        assert client.get("/health").json() == {"status": "ok"}
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert "quickdraft_requests_running" in client.get("/metrics").text
        missing = client.get("/v1/nope")
        assert missing.status_code == 404 and "POST /v1/chat/completions" in missing.json()["error"]["message"]
        assert client.get("/docs").status_code == 404  # as before: the server has no docs page
        assert client.post("/", json={}).status_code in (404, 405)
    # The page's routes are not API: the OpenAPI document (and so the fuzz tests) is unchanged.
    assert with_page.get("/openapi.json").json() == without.get("/openapi.json").json()
    listing = with_page.get("/nope").json()["error"]["message"]
    assert "GET /webui/app.js" in listing and "GET /health" in listing
    off = without.get("/")
    assert off.status_code == 404, off.text
    message = off.json()["error"]["message"]
    assert message.startswith("no route GET /;") and "POST /v1/chat/completions" in message
    assert "/webui/" not in message and without.get("/webui/app.js").status_code == 404


def test_the_page_is_public_under_an_api_key(tiny_llm: Any) -> None:
    client = _client(tiny_llm, api_key="secret")
    for path in WEBUI_FILES:
        assert client.get(path).status_code == 200, path  # the page asks for the key itself
    assert client.get("/v1/models").status_code == 401
    assert client.get("/metrics").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200
    assert client.get("/webui/other.js").status_code == 401  # only the page's own files are public
    assert _client(tiny_llm, api_key="secret", webui=False).get("/").status_code == 401


# ----------------------------------------------------------------------------------- provenance

REPEAT = [{"role": "user", "content": "Repeat this line five times:\nThe quick brown fox jumps over the lazy dog."}]


@pytest.fixture(scope="module")
def smol(smollm2_gguf: Path) -> Iterator[Server]:
    server = start_server(smollm2_gguf, "--draft", "ngram", "--num-draft", "4", "--no-webui")
    with running(server):
        yield server


def _raw_stream(server: Server, **kw: Any) -> list[str]:
    """The data lines of a streamed chat completion, [DONE] last."""
    body = {"model": NAME, "messages": REPEAT, "max_tokens": 32, "temperature": 0, "stream": True, **kw}
    with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: {") for line in lines[:-1])
    return lines


def _chunks(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def _content(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def _check_provenance(chunks: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """Every chunk carries provenance that adds up; returns (accepted drafts output, usage)."""
    text = _content(chunks)
    tokens = accepted = 0
    marked = ""
    for c in chunks:
        q = c["quickdraft"]
        assert set(q) == {"tokens", "accepted", "accepted_text"}
        assert 0 <= q["accepted"] <= q["tokens"]
        tokens += q["tokens"]
        accepted += q["accepted"]
        for start, end in q["accepted_text"]:
            assert 0 <= start < end <= len(text)
            marked += text[start:end]
    usage = chunks[-1]["usage"]
    assert tokens == usage["completion_tokens"]
    assert (accepted > 0) == bool(marked)
    return accepted, usage


@pytest.mark.slow  # a real model
def test_provenance_adds_up_to_the_usage(smol: Server) -> None:
    # Ends by length (ignore_eos): every accepted draft is output, the sums are exact.
    chunks = _chunks(_raw_stream(smol, ignore_eos=True, quickdraft={"provenance": True}))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    accepted, usage = _check_provenance(chunks)
    assert usage["completion_tokens"] == 32
    assert accepted == usage["quickdraft"]["accepted"] > 0  # n-gram lookup drafts the repeats
    # Ends by a stop token: drafts accepted past it are counted in usage but never output.
    stopped = _chunks(_raw_stream(smol, max_tokens=80, quickdraft={"provenance": True}))
    accepted, usage = _check_provenance(stopped)
    assert accepted <= usage["quickdraft"]["accepted"]
    # n = 2: each choice's chunks add up to its own usage.
    both = _chunks(_raw_stream(smol, n=2, ignore_eos=True, quickdraft={"provenance": True}))
    for index in (0, 1):
        mine = [c for c in both if c["choices"] and c["choices"][0]["index"] == index]
        accepted, usage = _check_provenance(mine)
        assert accepted == usage["quickdraft"]["accepted"]


def _normalized(line: str) -> str:
    """A data line without what differs between two runs (ids, clock, speeds)."""
    line = re.sub(r'"id":"chatcmpl-[0-9a-f]+","object":"chat.completion.chunk","created":\d+', "ID", line)
    return re.sub(r'"(tokens_per_second|ttft_s|cached_tokens)":[0-9.e+-]+', r'"\1":0', line)


@pytest.mark.slow  # a real model
def test_provenance_is_absent_unless_asked(smol: Server) -> None:
    plain = _raw_stream(smol, stream_options={"include_usage": True})
    off = _raw_stream(smol, stream_options={"include_usage": True}, quickdraft={"provenance": False})
    on = _raw_stream(smol, stream_options={"include_usage": True}, quickdraft={"provenance": True})
    assert [_normalized(x) for x in plain] == [_normalized(x) for x in off]
    openai_keys = {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    for chunk in _chunks(plain):
        assert set(chunk) <= openai_keys
    # With it: the same chunks and greedy text, each with one key more (the usage-only one without).
    with_key = _chunks(on)
    assert _content(with_key) == _content(_chunks(plain)) and "quickdraft" not in with_key[-1]
    stripped = [
        json.dumps({k: v for k, v in c.items() if k != "quickdraft"}, separators=(",", ":"), ensure_ascii=False)
        for c in with_key
    ]
    assert [_normalized(s) for s in stripped] == [_normalized(x.removeprefix("data: ")) for x in plain[:-1]]


@pytest.mark.slow  # a real model
def test_provenance_bad_input_is_a_400(smol: Server) -> None:
    url = f"{smol.url}/chat/completions"
    base = {"model": NAME, "messages": REPEAT, "max_tokens": 4}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"quickdraft": {"provenance": True}}, "quickdraft.provenance", "send stream: true"),
        ({"stream": True, "quickdraft": {"provenanse": True}}, "quickdraft.provenanse", "Extra inputs"),
        ({"stream": True, "quickdraft": {"provenance": "often"}}, "quickdraft.provenance", "boolean"),
        ({"stream": True, "quickdraft": True}, "quickdraft", "valid dictionary"),
    ]
    for extra, param, words in cases:
        resp = httpx.post(url, json={**base, **extra}, timeout=60)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and words in error["message"], error
    assert smol.proc.poll() is None


@pytest.mark.slow  # a real model
def test_no_webui_flag(smol: Server) -> None:
    resp = httpx.get(f"{smol.root}/", timeout=10)
    assert resp.status_code == 404 and "no route GET /;" in resp.json()["error"]["message"]
    started = next(line for line in smol.log if "serving" in line)
    assert "chat page" not in started


# -------------------------------------------------------------------------------- the browser

CODE_PROMPT = [
    "Repeat this Python function exactly, in a python code block, and say nothing else:",
    "```python",
    "def add(a, b):",
    "    return a + b",
    "```",
]
LONG_PROMPT = "Write a long essay about the history of computing, with many sections."
PAGE_NAME = "qwen-page"


def _browser() -> Any:
    """Headless chromium under selenium, or a skip saying what is missing."""
    pytest.importorskip("selenium", reason="selenium is not installed (scripts/setup.sh --test installs it)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed (scripts/setup.sh --test "
            "installs them where apt-get runs as root)"
        )
    options = Options()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


@pytest.fixture(scope="module")
def qwen_page(qwen05_gguf: Path) -> Iterator[Server]:
    server = start_server(
        qwen05_gguf, "--dtype", "auto", "--draft", "ngram", "--api-key", KEY, name=PAGE_NAME, context=1024
    )
    with running(server):
        yield server


@pytest.mark.slow  # a real model, a real browser
def test_chat_page_in_a_browser(qwen_page: Server, tmp_path: Path) -> None:
    driver = _browser()
    try:
        _chat_in_the_page(driver, qwen_page)
    finally:
        driver.save_screenshot(str(tmp_path / "webui.png"))
        driver.quit()
    assert (tmp_path / "webui.png").stat().st_size > 10_000


def _chat_in_the_page(driver: Any, server: Server) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    page = next(line for line in server.log if "serving" in line)
    assert f"chat page at {server.root}/" in page
    wait = WebDriverWait(driver, 180)
    driver.get(f"{server.root}/")
    # The key is asked for once, kept, and sent.
    wait.until(lambda d: d.find_element(By.ID, "key-dialog").get_attribute("open") is not None)
    driver.find_element(By.ID, "api-key").send_keys(KEY)
    driver.find_element(By.CSS_SELECTOR, "#key-form button[value=ok]").click()
    wait.until(lambda d: d.find_element(By.ID, "model-name").text == PAGE_NAME)
    _refused_setting(driver, wait)
    _streamed_answer(driver, wait)
    _stopped_answer(driver, wait, server)
    _edited_question(driver, wait)
    _dropped_connection(driver, wait)
    _conversations(driver, wait)
    _markdown_cases(driver)


def _setting(driver: Any, name: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    field = driver.find_element(By.ID, f"set-{name}")
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.DELETE)
    if value:
        field.send_keys(value)


def _type_prompt(driver: Any, lines: list[str]) -> None:
    """The lines with Shift+Enter between them, then Enter (sends)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(By.ID, "prompt")
    box.click()
    for i, line in enumerate(lines):
        if i:
            ActionChains(driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
        box.send_keys(line)
    assert box.get_attribute("value") == "\n".join(lines)  # Shift+Enter: a new line, not sent
    box.send_keys(Keys.ENTER)


def _text(driver: Any, css: str) -> str:
    """The text of the first element matching ``css`` ("" if none), read in one go (the page
    replaces a streaming answer's elements at every frame)."""
    return str(driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", css))


def _done(driver: Any) -> bool:
    from selenium.webdriver.common.by import By

    return not driver.find_elements(By.CSS_SELECTOR, ".msg.streaming") and driver.find_element(By.ID, "send").is_displayed()


def _refused_setting(driver: Any, wait: Any) -> None:
    """Temperature 5: the server's 400 next to the field, the conversation kept."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "settings-toggle").click()
    _setting(driver, "temperature", "5")
    _type_prompt(driver, CODE_PROMPT)
    slot = '.field-error[data-for="temperature"]'
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, slot).text)
    assert "temperature" in driver.find_element(By.CSS_SELECTOR, slot).text
    assert "400" in driver.find_element(By.CSS_SELECTOR, ".msg.assistant .error").text
    assert driver.find_element(By.CSS_SELECTOR, ".msg.user .body").text.startswith("Repeat this")


def _streamed_answer(driver: Any, wait: Any) -> None:
    """Greedy again: the answer streams, a highlighted code block, the speed line, the marks."""
    from selenium.webdriver.common.by import By

    _setting(driver, "temperature", "0")
    _setting(driver, "max_tokens", "80")
    driver.find_element(By.CSS_SELECTOR, ".msg.assistant .regenerate").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.streaming"))
    wait.until(_done)
    answer = driver.find_element(By.CSS_SELECTOR, ".msg.assistant")
    assert not answer.find_elements(By.CSS_SELECTOR, ".error")
    code = answer.find_element(By.CSS_SELECTOR, ".code pre code")
    assert "def add(a, b):" in code.text and "return a + b" in code.text
    assert code.find_elements(By.CSS_SELECTOR, ".hl-kw") and answer.find_elements(By.CSS_SELECTOR, ".code .copy")
    stats = answer.find_element(By.CSS_SELECTOR, ".stats").text
    assert re.search(r"\d+ tokens · [\d.]+ tok/s · first token [\d.]+ s · τ [\d.]+ · \d+% of \d+ drafted accepted", stats), stats
    marks = answer.find_elements(By.CSS_SELECTOR, ".dr")
    assert marks and "from drafts" in stats  # n-gram lookup drafted the repeated function
    toggle = driver.find_element(By.ID, "show-drafts")
    toggle.click()
    assert "hide-drafts" in driver.find_element(By.TAG_NAME, "body").get_attribute("class")
    toggle.click()


def _stopped_answer(driver: Any, wait: Any, server: Server) -> None:
    """Stop a long answer mid-stream: the server frees its sequence."""
    from selenium.webdriver.common.by import By

    _setting(driver, "max_tokens", "")
    cancelled = server.metric("quickdraft_requests_cancelled_total")
    _type_prompt(driver, [LONG_PROMPT])
    live = ".msg.assistant.streaming .stats"
    wait.until(lambda d: re.match(r"([2-9]\d|\d{3,}) tokens", _text(d, live)))
    assert server.metric("quickdraft_requests_running") == 1
    driver.find_element(By.ID, "stop").click()
    wait.until(_done)
    deadline = time.time() + 20
    while server.metric("quickdraft_requests_running") != 0 or server.metric("quickdraft_requests_cancelled_total") == cancelled:
        assert time.time() < deadline, "the server kept generating after the page stopped"
        time.sleep(0.1)
    last = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    assert last.find_element(By.CSS_SELECTOR, ".stats").text.startswith("stopped · ")
    assert len(last.find_element(By.CSS_SELECTOR, ".body").text) > 20  # what came is kept


def _edited_question(driver: Any, wait: Any) -> None:
    """Edit the last question: the conversation goes on from it (the stopped answer replaced)."""
    from selenium.webdriver.common.by import By

    _setting(driver, "max_tokens", "12")
    driver.find_elements(By.CSS_SELECTOR, ".msg.user .edit")[-1].click()
    box = driver.find_element(By.CSS_SELECTOR, ".msg.user .editing textarea")
    box.clear()
    box.send_keys("Say hello in three words.")
    driver.find_element(By.CSS_SELECTOR, ".msg.user .editing .save").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.streaming"))
    wait.until(_done)
    users = driver.find_elements(By.CSS_SELECTOR, ".msg.user .body")
    assert len(users) == 2 and users[1].text == "Say hello in three words."
    assert not _text(driver, ".msg.assistant:last-child .stats").startswith("stopped")


def _dropped_connection(driver: Any, wait: Any) -> None:
    """The network gone: a message in the page, the conversation kept; Regenerate once it is back."""
    from selenium.webdriver.common.by import By

    driver.set_network_conditions(offline=True, latency=0, download_throughput=-1, upload_throughput=-1)
    _type_prompt(driver, ["Are you there?"])
    wait.until(lambda d: _text(d, ".msg.assistant:last-child .error"))
    assert "connection to the server failed" in _text(driver, ".msg.assistant:last-child .error")
    assert len(driver.find_elements(By.CSS_SELECTOR, ".msg")) == 6
    driver.delete_network_conditions()
    driver.find_element(By.CSS_SELECTOR, ".msg.assistant:last-child .regenerate").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.streaming"))
    wait.until(_done)
    assert not driver.find_elements(By.CSS_SELECTOR, ".msg .error")


def _conversations(driver: Any, wait: Any) -> None:
    """Rename, new, switch, delete; after a reload the conversation is there."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    items = "#conversations li"
    driver.find_element(By.CSS_SELECTOR, f"{items}.current .rename").click()
    field = driver.find_element(By.CSS_SELECTOR, f"{items} input")
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys("Adder", Keys.ENTER)
    wait.until(lambda d: d.find_element(By.ID, "title").text == "Adder")
    driver.find_element(By.ID, "new-chat").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, items)) == 2)
    assert driver.find_element(By.ID, "title").text == "New chat" and not driver.find_elements(By.CSS_SELECTOR, ".msg")
    driver.find_element(By.CSS_SELECTOR, f"{items}.current .delete").click()
    driver.switch_to.alert.accept()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, items)) == 1)
    driver.find_element(By.CSS_SELECTOR, f"{items} .conv-title").click()
    driver.refresh()
    wait.until(lambda d: d.find_element(By.ID, "model-name").text == PAGE_NAME)  # no key asked again
    assert driver.find_element(By.CSS_SELECTOR, f"{items}.current .conv-title").text == "Adder"
    answers = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")
    assert len(answers) == 3 and "def add(a, b):" in answers[0].find_element(By.CSS_SELECTOR, ".code").text
    assert answers[0].find_elements(By.CSS_SELECTOR, ".dr") and "tok/s" in answers[0].text
    assert all("tok/s" in a.find_element(By.CSS_SELECTOR, ".stats").text for a in answers)


MARKDOWN_CASES = [
    ("**bold** *em* `x<y` ~~no~~", "<p><strong>bold</strong> <em>em</em> <code>x&lt;y</code> <del>no</del></p>"),
    ("snake_case_name and 2 * 3 * 4", "<p>snake_case_name and 2 * 3 * 4</p>"),
    ("- a\n- b\n  1. c", "<ul><li>a</li><li>b<ol><li>c</li></ol></li></ul>"),
    ("[ok](https://x.org) [no](javascript:alert(1)) <b>", '<p><a href="https://x.org" target="_blank" '
     'rel="noopener noreferrer">ok</a> [no](javascript:alert(1)) &lt;b&gt;</p>'),
    ("| a | b |\n|---|--:|\n| 1 | 2 |", '<div class="table"><table><thead><tr><th>a</th><th style="text-align:right">b</th>'
     '</tr></thead><tbody><tr><td>1</td><td style="text-align:right">2</td></tr></tbody></table></div>'),
    ("# T\n\n> q", "<h1>T</h1><blockquote><p>q</p></blockquote>"),
]


def _markdown_cases(driver: Any) -> None:
    """The page's renderer on inputs of its own, marks included (offsets of the source)."""
    script = """
        const done = arguments[arguments.length - 1];
        import('/webui/markdown.js').then((md) => done(arguments[0].map(([src, marks]) => md.render(src, marks))));
    """
    got = driver.execute_async_script(script, [[src, []] for src, _ in MARKDOWN_CASES])
    assert got == [html for _, html in MARKDOWN_CASES]
    marked = driver.execute_async_script(script, [["ab **cd** ef", [[1, 6]]], ["```py\nif x:\n```", [[6, 8]]]])
    assert marked[0] == '<p>a<span class="dr">b </span><strong><span class="dr">c</span>d</strong> ef</p>'
    assert '<span class="hl-kw dr">if</span>' in marked[1]

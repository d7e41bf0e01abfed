"""The web chat page at `/` in a real headless chromium (driven by selenium) against a real server (SmolLM2 on
MLX, with --api-key): the key asked for, a streamed answer, the history, a stop mid-answer that the server sees,
errors shown, and the reasoning and tool-call deltas rendered."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request

import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from tests.serving import ServerProcess

KEY = "webui-test-key"
BROWSER = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")
INSTALL = ("install Debian's browser and its driver: `apt-get install chromium chromium-driver` (`make test` does so "
           "when run as root)")


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "4", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    if not (BROWSER and DRIVER):
        # CI (.ci/run) sets it: there a browser test that could not run is a failure, not a skip
        missing = pytest.fail if os.environ.get("LLM_ENGINE_REQUIRE_BROWSER") else pytest.skip
        missing(f"no chromium or chromedriver on PATH: {INSTALL}")
    options = Options()
    options.binary_location = BROWSER
    # --no-sandbox: chromium's sandbox refuses to start as root, which CI containers are
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    except WebDriverException as e:
        pytest.fail(f"chromium did not start ({e.msg}); {INSTALL}")
    # the screenshot's size is the page's, whatever the window's frame takes
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1200, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    yield driver
    driver.quit()


def by_id(driver, name: str):
    return driver.find_element(By.ID, name)


def wait(driver, what, timeout: float = 60):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: what())


def set_field(driver, name: str, value: str) -> None:
    """Types `value` into a settings box and leaves it, as a person would (its change event fires)."""
    field = by_id(driver, name)
    field.clear()
    field.send_keys(value)
    by_id(driver, "prompt").click()


RESET = """
const [fields, done] = [arguments[0], arguments[arguments.length - 1]];
for (const [id, value] of Object.entries(fields)) {
  const box = document.getElementById(id);
  box.value = value;
  box.dispatchEvent(new Event("change"));
}
done();
"""


def fresh(driver, **fields: str) -> None:
    """A new chat, an empty message box, and the settings given (by id, - for _), the others empty."""
    by_id(driver, "new-chat").click()
    values = {"system": "", "temperature": "", "top-p": "", "max-tokens": "", "tools": "", "prompt": ""}
    driver.execute_async_script(RESET, {**values, **{k.replace("_", "-"): v for k, v in fields.items()}})


def turns(driver) -> list[tuple[str, str]]:
    return [(a.get_attribute("aria-label"), a.find_element(By.CSS_SELECTOR, ".content").text)
            for a in driver.find_elements(By.CSS_SELECTOR, "#log .msg")]


def running(server) -> float:
    return server.metrics()["llm_engine:num_requests_running"]


def aborted(server) -> float:
    with urllib.request.urlopen(server.base + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("llm_engine:request_success_total") and 'finished_reason="abort"' in line)


def ask(driver, text: str) -> None:
    by_id(driver, "prompt").send_keys(text, Keys.ENTER)  # Enter sends


def wait_answered(driver, timeout: float = 60) -> None:
    wait(driver, lambda: not driver.find_elements(By.CSS_SELECTOR, "#log .msg.streaming"), timeout)


@pytest.fixture(scope="module")
def page(browser, server):
    """The page loaded, its key given once the first listing of the models failed without it."""
    browser.get(server.base + "/")
    error = wait(browser, lambda: by_id(browser, "error-text").text)
    assert "401" in error and "a valid API key is required" in error, error
    assert by_id(browser, "error").is_displayed()
    set_field(browser, "api-key", KEY)
    wait(browser, lambda: by_id(browser, "model").get_attribute("value") == "SmolLM2-135M-Instruct")
    assert not by_id(browser, "error").is_displayed()
    return browser


def test_the_page_is_open_but_the_api_is_not(server):
    with urllib.request.urlopen(server.base + "/") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
        assert b'id="composer"' in r.read()
    for path in ("/static/app.js", "/static/vendor/marked.umd.js", "/static/vendor/purify.min.js"):
        with urllib.request.urlopen(server.base + path) as r:
            assert "javascript" in r.headers["Content-Type"], path  # module scripts need a JS type
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server.base + "/v1/models")
    assert e.value.code == 401


def test_streamed_answer_history_and_stop(server, page):
    fresh(page)
    set_field(page, "system", "You are a geography teacher. Answer in one sentence.")
    set_field(page, "temperature", "0")
    set_field(page, "max-tokens", "24")
    prompt = by_id(page, "prompt")
    prompt.send_keys("What is the capital", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "of France?")
    assert prompt.get_attribute("value") == "What is the capital\nof France?"  # Shift+Enter: a new line
    assert not page.find_elements(By.CSS_SELECTOR, "#log .msg")
    prompt.send_keys(Keys.ENTER)
    wait(page, lambda: by_id(page, "stop").is_enabled())
    wait_answered(page)
    history = turns(page)
    assert [role for role, _ in history] == ["You", "Assistant"]
    assert history[0][1] == "What is the capital\nof France?"
    assert "Paris" in history[1][1]
    assert "tok/s" in page.find_element(By.CSS_SELECTOR, "#log .msg.assistant .meta").text
    assert by_id(page, "send").is_enabled() and not by_id(page, "stop").is_enabled()

    # a long answer, stopped once some of it has arrived
    aborts = aborted(server)
    set_field(page, "max-tokens", "4000")
    ask(page, "Now write a long essay about the history of Paris.")
    wait(page, lambda: len(turns(page)) == 4 and len(turns(page)[3][1]) > 40)
    by_id(page, "stop").click()
    wait_answered(page, timeout=5)
    partial = turns(page)[3][1]
    assert not by_id(page, "stop").is_enabled() and by_id(page, "send").is_enabled()
    assert page.find_elements(By.CSS_SELECTOR, "#log .msg.assistant .meta")[-1].text.startswith("stopped")
    wait(page, lambda: running(server) == 0 and aborted(server) == aborts + 1, timeout=10)
    time.sleep(0.3)
    assert turns(page)[3][1] == partial and len(partial) > 40  # kept, and no longer growing
    assert [role for role, _ in turns(page)] == ["You", "Assistant"] * 2


def test_an_error_is_shown_readably(page):
    fresh(page)
    set_field(page, "max-tokens", "100000")
    ask(page, "Hello")
    error = wait(page, lambda: by_id(page, "error").is_displayed() and by_id(page, "error-text").text)
    assert error.startswith("400") and "100000" in error, error  # the OpenAI error body's message
    assert "Traceback" not in error
    failed = page.find_elements(By.CSS_SELECTOR, "#log .msg.failed")
    assert [a.get_attribute("aria-label") for a in failed] == ["You", "Assistant"]
    assert by_id(page, "prompt").get_attribute("value") == "Hello"  # back in the box, to try again
    by_id(page, "new-chat").click()
    assert turns(page) == [] and not by_id(page, "error").is_displayed()


def sse_bytes(deltas: list[dict], finish: str, error: dict | None = None) -> bytes:
    """A chat completion stream in OpenAI's documented shape (the deltas, a finish, usage, [DONE]; or the deltas
    and the server's error event), with the \\r\\n line ends a proxy may give on every other event."""
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    events = [{**chunk, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    events += [{"error": error}] if error else [
        {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
        {**chunk, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(deltas),
                                           "total_tokens": 5 + len(deltas)}}]
    text = "".join(f"data: {json.dumps(e, ensure_ascii=False)}" + ("\r\n\r\n" if i % 2 else "\n\n")
                   for i, e in enumerate(events))
    return (text + "data: [DONE]\n\n").encode()


# The next chat request is answered with these bytes, in pieces of 7 (UTF-8 characters and lines cut across
# reads), instead of the server's: its answer has no reasoning or tool calls until the chat path's parsers land.
SCRIPTED_FETCH = """
const [bytes, done] = [new Uint8Array(arguments[0]), arguments[arguments.length - 1]];
const real = window.fetch;
window.fetch = async (url, init) => {
  if (!String(url).endsWith("chat/completions")) return real(url, init);
  window.fetch = real;
  window.sentBody = JSON.parse(init.body);
  const body = new ReadableStream({ start(c) {
    for (let i = 0; i < bytes.length; i += 7) c.enqueue(bytes.slice(i, i + 7));
    c.close();
  } });
  return new Response(body, { headers: { "Content-Type": "text/event-stream" } });
};
done();
"""


def test_reasoning_folded_and_tool_calls_shown(page):
    reasoning = ["The user wants ", "the weather in Zürich ☀", "; I should call the tool."]
    args = {"city": "Zürich", "units": "celsius"}
    args_text = json.dumps(args)
    deltas = [{"role": "assistant", "content": ""}] + [{"reasoning_content": r} for r in reasoning]
    deltas += [{"content": "Checking **both**:\n\n<img src=x onerror=\"window.pwned=1\">\n\n```json\n{\"a\": 1}\n```"}]
    deltas += [{"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                "function": {"name": "get_weather", "arguments": ""}}]}]
    deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": args_text[i:i + 5]}}]}
               for i in range(0, len(args_text), 5)]
    deltas += [{"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                "function": {"name": "get_time", "arguments": "{}"}}]}]
    fresh(page)
    page.execute_async_script(SCRIPTED_FETCH, list(sse_bytes(deltas, "tool_calls")))
    page.find_element(By.CSS_SELECTOR, "aside details summary").click()  # the Tools box is folded
    set_field(page, "tools", '[{"type": "function", "function": {"name": "get_weather"}}]')
    ask(page, "Weather in Zürich?")
    wait_answered(page, timeout=10)
    sent = page.execute_script("return window.sentBody")
    assert sent["stream"] is True and sent["tools"] == [{"type": "function", "function": {"name": "get_weather"}}]
    assert sent["messages"][-1] == {"role": "user", "content": "Weather in Zürich?"}

    reply = page.find_element(By.CSS_SELECTOR, "#log .msg.assistant")
    folded = reply.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert folded.is_displayed() and folded.get_attribute("open") is None  # shown, but closed
    assert folded.find_element(By.TAG_NAME, "summary").text == "Reasoning"
    assert folded.find_element(By.CSS_SELECTOR, ".reasoning-text").get_attribute("textContent") == "".join(reasoning)
    body = reply.find_element(By.CSS_SELECTOR, ".content")
    assert body.find_element(By.TAG_NAME, "strong").text == "both"
    assert json.loads(body.find_element(By.CSS_SELECTOR, "pre code").get_attribute("textContent")) == {"a": 1}
    assert body.find_element(By.TAG_NAME, "img").get_attribute("onerror") is None  # sanitized
    assert page.execute_script("return window.pwned") is None
    calls = reply.find_elements(By.CSS_SELECTOR, ".tool-call")
    assert [c.find_element(By.CSS_SELECTOR, ".tool-name").text for c in calls] == ["tool call: get_weather",
                                                                                   "tool call: get_time"]
    shown = [c.find_element(By.CSS_SELECTOR, "code").get_attribute("textContent") for c in calls]
    assert shown == [json.dumps(args, indent=2, ensure_ascii=False), "{}"]
    assert reply.find_element(By.CSS_SELECTOR, ".meta").text.startswith("finish: tool_calls")


def test_an_error_event_mid_stream_is_shown(page):
    fresh(page)
    message = "the engine is not running: its process ended"  # what the server streams when the engine dies
    error = {"message": message, "type": "ServiceUnavailableError", "param": None, "code": 503}
    page.execute_async_script(SCRIPTED_FETCH, list(sse_bytes([{"content": "The capital"}], "", error)))
    ask(page, "Hi")
    assert wait(page, lambda: by_id(page, "error").is_displayed() and by_id(page, "error-text").text) == message
    assert turns(page) == [("You", "Hi"), ("Assistant", "The capital")]  # what came before it stays, dimmed
    assert len(page.find_elements(By.CSS_SELECTOR, "#log .msg.failed")) == 2


@pytest.mark.skipif(not os.environ.get("WEBUI_SCREENSHOT"), reason="WEBUI_SCREENSHOT=docs/webui.png writes the "
                    "README's screenshot of the page")
def test_screenshot(page):
    fresh(page, system="You are a helpful programming assistant.", temperature="0", max_tokens="110")
    ask(page, "Write a Python function that checks whether a number is prime.")
    wait_answered(page)
    page.execute_script("document.querySelector('aside details').open = false; "
                        "document.getElementById('log').scrollTop = 0")
    page.save_screenshot(os.environ["WEBUI_SCREENSHOT"])

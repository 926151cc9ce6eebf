"""The chat page at /ui, in a real headless Chromium (Debian's chromium and chromedriver, driven by selenium).

Chromium is required: without /usr/bin/chromium and /usr/bin/chromedriver these tests fail (CI installs them,
see .ci/run), unless MILI_SKIP_BROWSER_TESTS=1 says to skip them.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from support.server import Server, metric, wait_for

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
KEY = "sekret"

if os.environ.get("MILI_SKIP_BROWSER_TESTS") == "1":
    pytest.skip("MILI_SKIP_BROWSER_TESTS=1", allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    assert not missing, (f"{missing} not found: install Debian's chromium and chromium-driver (.ci/run does), or set "
                         "MILI_SKIP_BROWSER_TESTS=1 to skip the browser tests")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})  # every request the page makes
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


def el(driver, css: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, css)


def until(driver, predicate, timeout: float = 60.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: predicate())


def open_page(driver, url: str) -> None:
    driver.get(url + "/ui")
    until(driver, lambda: el(driver, "#model").text != "…")
    driver.get_log("performance")  # start each test's request log empty


def set_field(driver, css: str, value: str) -> None:
    field = el(driver, css)
    field.clear()
    field.send_keys(value)


def record_requests(driver) -> None:
    """Keep the JSON body of every request the page sends (window.sent)."""
    driver.execute_script("""
        window.sent = [];
        const fetch0 = window.fetch;
        window.fetch = (url, init) => {
            if (init && init.body) window.sent.push(JSON.parse(init.body));
            return fetch0(url, init);
        };""")


def record_reply_growth(driver) -> None:
    """Snapshot [reasoning length, answer length] of the last reply at every change of the page (window.growth)."""
    driver.execute_script("""
        window.growth = [];
        new MutationObserver(() => {
            const replies = document.querySelectorAll('.msg.assistant');
            if (!replies.length) return;
            const last = replies[replies.length - 1];
            window.growth.push([last.querySelector('.reasoning-text').textContent.length,
                                last.querySelector('.text').textContent.length]);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});""")


def send(driver, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    el(driver, "#prompt").send_keys(text, Keys.ENTER)


def last_reply(driver):
    replies = driver.find_elements("css selector", ".msg.assistant")
    return replies[-1] if replies else None


def finished_reply(driver, timeout: float = 60.0):
    until(driver, lambda: last_reply(driver) is not None and el(last_reply(driver), ".stats").text, timeout)
    return last_reply(driver)


def requested_urls(driver) -> list[str]:
    events = [json.loads(entry["message"])["message"] for entry in driver.get_log("performance")]
    return [e["params"]["request"]["url"] for e in events if e["method"] == "Network.requestWillBeSent"]


def test_page_loads_with_nothing_from_outside(scripted_server, browser):
    browser.get(scripted_server.url + "/ui")
    until(browser, lambda: el(browser, "#model").text == "test")  # the name from /v1/models
    urls = requested_urls(browser) + browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)")
    assert scripted_server.url + "/ui" in urls and scripted_server.url + "/v1/models" in urls, urls
    outside = [u for u in urls if urlparse(u).scheme != "data" and urlparse(u).hostname != "127.0.0.1"]
    assert not outside, outside
    assert el(browser, "#error").text == ""


def test_streamed_multi_turn_chat_with_folded_thinking(scripted_server, browser):
    """The scripted model answers "<think>Let me think</think>\\n\\nHello!" (thinking on), "Hello!" (off)."""
    open_page(browser, scripted_server.url)
    record_requests(browser)
    record_reply_growth(browser)
    set_field(browser, "#temperature", "0")
    send(browser, "Hi")
    reply = finished_reply(browser)
    assert el(reply, ".text").text == "Hello!", el(browser, "#error").text
    details = el(reply, "details.reasoning")
    assert details.is_displayed() and details.get_attribute("open") is None  # folded
    assert el(reply, ".reasoning-text").get_attribute("textContent") == "Let me think"
    stats = el(reply, ".stats").text
    assert "9 tokens" in stats and "tokens/s" in stats and "stop" in stats, stats
    growth = browser.execute_script("return window.growth")
    # streamed: the thinking was on the page (and grew) before any of the answer was
    assert any(r > 0 and c == 0 for r, c in growth) and growth[-1] == [len("Let me think"), len("Hello!")], growth
    assert len({tuple(g) for g in growth}) >= 3, growth
    details.click()  # unfolds
    assert details.get_attribute("open") is not None
    first = browser.execute_script("return window.sent")[0]
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert first["chat_template_kwargs"] == {"enable_thinking": True} and first["temperature"] == 0
    assert first["top_p"] == 0.95 and "max_tokens" not in first and first["model"] == "test"  # (up to the context)

    el(browser, "#thinking").click()  # off
    send(browser, "Hi again")
    until(browser, lambda: len(browser.find_elements("css selector", ".msg.assistant")) == 2
          and el(last_reply(browser), ".stats").text)
    reply = last_reply(browser)
    assert el(reply, ".text").text == "Hello!" and not el(reply, "details.reasoning").is_displayed()
    second = browser.execute_script("return window.sent")[1]
    assert second["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                  {"role": "user", "content": "Hi again"}]
    assert second["chat_template_kwargs"] == {"enable_thinking": False}

    set_field(browser, "#max-tokens", "0")  # the server's 400, shown on the page
    send(browser, "Hi")
    until(browser, lambda: el(browser, "#error").text)
    assert "max_tokens" in el(browser, "#error").text and "400" in el(browser, "#error").text
    assert el(last_reply(browser), ".stats").text == "error"


def test_shift_enter_is_a_new_line(scripted_server, browser):
    from selenium.webdriver.common.keys import Keys

    open_page(browser, scripted_server.url)
    el(browser, "#prompt").send_keys("one", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "two")
    assert el(browser, "#prompt").get_attribute("value") == "one\ntwo"
    assert not browser.find_elements("css selector", ".msg")  # nothing sent
    el(browser, "#send").click()
    assert el(finished_reply(browser), ".text").text == "Hello!"
    assert el(browser, ".msg.user .text").text == "one\ntwo"


def test_stop_aborts_the_streaming_reply_and_frees_the_server(server, browser):
    open_page(browser, server.url)
    set_field(browser, "#max-tokens", "1000")
    set_field(browser, "#temperature", "0")
    el(browser, "#thinking").click()
    generated = metric(server.url, "mili:generation_tokens_total")
    send(browser, "Tell me a long story")
    until(browser, lambda: last_reply(browser) is not None and len(el(last_reply(browser), ".text").text) > 10)
    assert metric(server.url, "mili:num_requests_running") == 1  # still generating
    el(browser, "#stop").click()
    until(browser, lambda: el(last_reply(browser), ".stats").text == "stopped", 10)
    assert wait_for(lambda: metric(server.url, "mili:num_requests_running") == 0, 10)
    health = httpx.get(server.url + "/health").json()  # every KV page free or cached: none held by a request
    assert health["kv_cache_pages_free"] + health["kv_cache_pages_cached"] == health["kv_cache_pages"], health
    shown, total = el(last_reply(browser), ".text").text, metric(server.url, "mili:generation_tokens_total")
    time.sleep(0.5)
    assert metric(server.url, "mili:generation_tokens_total") == total < generated + 1000  # cut short, and over
    assert el(last_reply(browser), ".text").text == shown and shown  # no more text after the stop
    assert el(browser, "#send").is_enabled() and not el(browser, "#stop").is_enabled()


def test_api_key_typed_into_the_page(scripted_model, browser):
    s = Server(scripted_model, "--api-key", KEY)
    try:
        assert httpx.get(s.url + "/ui").status_code == 200  # the page itself needs no key
        browser.get(s.url + "/ui")
        until(browser, lambda: el(browser, "#error").text)  # /v1/models refused: said on the page
        assert "401" in el(browser, "#error").text and "API key" in el(browser, "#error").text
        assert el(browser, "#model").text == "?"
        el(browser, "#api-key").send_keys(KEY, "\t")  # a change of the key loads the model again
        until(browser, lambda: el(browser, "#model").text == "test")
        assert el(browser, "#error").text == ""
        set_field(browser, "#temperature", "0")
        send(browser, "Hi")
        assert el(finished_reply(browser), ".text").text == "Hello!"
    finally:
        assert s.stop() == 0, s.output()


def test_the_trained_demo_replies_and_ends_by_itself(browser, tmp_path):
    """`mili serve` with no model (the trained `demo`): the page's reply to "Hello" is English from its corpus
    and ends with the model's own end of turn (finish reason stop), thinking on (the page's default) and off."""
    words = set((Path(__file__).resolve().parents[1] / "data" / "demo" / "words.txt").read_text().split())
    s = Server("demo", log_dir=tmp_path)
    try:
        open_page(browser, s.url)
        set_field(browser, "#temperature", "0")
        for turn, text in enumerate(["Hello", "Who are you?"]):
            if turn:
                el(browser, "#thinking").click()  # off
            send(browser, text)
            until(browser, lambda: len(browser.find_elements("css selector", ".msg.assistant")) == turn + 1
                  and el(last_reply(browser), ".stats").text)
            reply = last_reply(browser)
            stats, said = el(reply, ".stats").text, el(reply, ".text").text
            assert "stop" in stats and el(browser, "#error").text == "", (stats, said)
            found = re.findall(r"[a-z]+", said.lower())
            assert found and sum(w in words for w in found) >= 0.9 * len(found), said
    finally:
        assert s.stop() == 0, s.output()


def test_images_attached_shown_and_sent(vision_chat_model, test_images, browser):
    """A tiny Qwen3-VL (tests/support/vision.py): an image chosen with the file input is shown above the message box
    and in the conversation, sent as a data: URL image part before the text, and the streamed reply arrives; a
    dropped and a pasted image are attached too, and removed with their ×."""
    import base64

    s = Server(vision_chat_model)
    try:
        open_page(browser, s.url)
        record_requests(browser)
        set_field(browser, "#temperature", "0")
        set_field(browser, "#max-tokens", "8")
        el(browser, "#thinking").click()  # off
        png = test_images[0].read_bytes()
        for event in ("drop", "paste"):  # a file dropped on the page, one pasted into the message box
            browser.execute_script("""
                const [event, b64] = arguments;
                const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
                const data = new DataTransfer();
                data.items.add(new File([bytes], "x.png", {type: "image/png"}));
                const target = event === "drop" ? document : document.getElementById("prompt");
                target.dispatchEvent(event === "drop" ? new DragEvent("drop", {dataTransfer: data, bubbles: true})
                                                      : new ClipboardEvent("paste", {clipboardData: data, bubbles: true}));
                """, event, base64.b64encode(png).decode())
        until(browser, lambda: len(browser.find_elements("css selector", "#attachments img")) == 2)
        for button in browser.find_elements("css selector", "#attachments button"):
            button.click()
        assert not browser.find_elements("css selector", "#attachments figure")

        el(browser, "#image-file").send_keys(str(test_images[0]))  # (a hidden file input takes a path all the same)
        until(browser, lambda: len(browser.find_elements("css selector", "#attachments img")) == 1)
        send(browser, "What is in this picture?")
        reply = finished_reply(browser)
        stats = el(reply, ".stats").text
        assert "8 tokens" in stats and "length" in stats and el(browser, "#error").text == "", stats
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        shown = browser.find_elements("css selector", ".msg.user .thumbs img")
        assert [img.get_attribute("src") for img in shown] == [url]
        assert browser.execute_script("return arguments[0].naturalWidth", shown[0]) == 96  # the image itself
        assert not browser.find_elements("css selector", "#attachments img")  # sent: no longer attached
        sent = browser.execute_script("return window.sent")[0]
        assert sent["messages"] == [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is in this picture?"}]}]
        whole = {**{k: v for k, v in sent.items() if k != "stream_options"}, "stream": False}
        api = httpx.post(s.url + "/v1/chat/completions", json=whole, timeout=60).json()
        assert el(reply, ".text").text.split() == api["choices"][0]["message"]["content"].split()  # that reply
    finally:
        assert s.stop() == 0, s.output()

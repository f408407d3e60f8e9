"""The chat UI in a real browser: headless Chromium (Playwright) against `pagedserve ui`, which
talks to a real SmolLM2 server, or to a port where nothing listens, or to a fake server that
streams reasoning. The checks read the page's DOM; screenshots are kept in tests/artifacts/
for a person to look at."""

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from server_helpers import MODEL, free_port
from ui_helpers import (
    ANSWER,
    ANSWERS,
    REASONING,
    SECOND_ANSWER,
    UIProcess,
    answer_lengths,
    chromium_page,
    diagnostics,
    fake_reasoning_server,
    record_answer_lengths,
    screenshot,
    send_message,
    set_setting,
    wait_answer,
)

QUESTION = "What is the capital of France?"
EMBEDDED_DEFAULTS = "temperature 0."  # models/embedded/generation_config.json (greedy)
STATUS = "#pagedserve-status"  # the header's name, logo and server status (public/pagedserve.js)


@pytest.fixture(scope="module")
def uis(server):
    """Three UIs, started together: on the session's SmolLM2 server and on a fake server that
    streams reasoning, both with no --temperature (the server's defaults for its model apply,
    as after `make run`), and on a dead port."""
    with fake_reasoning_server() as fake:
        procs = [UIProcess(server.url, temperature=None), UIProcess(f"http://127.0.0.1:{free_port()}"),
                 UIProcess(fake.url, temperature=None)]
        try:
            yield [p.wait_ready() for p in procs] + [fake]
        finally:
            for p in procs:
                p.stop()


def body_text(page) -> str:
    return page.inner_text("body")


def header_status(page, text: str):
    """Wait until the header's status says `text`; return its element."""
    status = page.locator(STATUS)
    status.get_by_text(text).wait_for(timeout=30_000)
    return status


def test_chat_streams_an_answer_in_the_browser(uis):
    live = uis[0]
    # pagedserve's own look: favicon (the assistant's avatar too) and logo, not Chainlit's.
    for path in ("/favicon", "/logo?theme=light", "/logo?theme=dark", "/avatars/pagedserve"):
        r = httpx.get(live.url + path, timeout=10)
        assert r.status_code == 200 and "<title>pagedserve</title>" in r.text, path
    with chromium_page(live.url) as page:
        page.goto(live.url)
        # The welcome screen: server status with the model name, and the starter prompts; the
        # header: pagedserve's name and logo, and the model.
        page.get_by_text("Connected to").wait_for(timeout=30_000)
        assert MODEL in body_text(page)
        assert page.locator("#starter-capital-of-france").is_visible()
        status = header_status(page, f"connected · {MODEL}")
        assert page.title() == "pagedserve" and "pagedserve" in status.inner_text()
        assert status.locator("img").get_attribute("src") == "/favicon"
        # The panel starts at the server's sampling defaults for the embedded model.
        page.get_by_text(f"Model defaults: {EMBEDDED_DEFAULTS}").wait_for(timeout=30_000)
        index = record_answer_lengths(page)
        send_message(page, QUESTION)  # the README's question, answered at those defaults
        try:
            answer = wait_answer(page, index)
        except PlaywrightTimeout:
            pytest.fail("no finished answer\n" + diagnostics(page, live))
        finally:
            screenshot(page, "ui_chat_paris.png")
        text = answer.inner_text()
        assert "Paris" in text, text
        # It arrived token by token: the page showed it at several growing lengths.
        lengths = [n for n, _ in answer_lengths(page)]
        assert len(lengths) >= 3 and lengths == sorted(lengths), lengths
        assert lengths[-1] == len(text) and lengths[0] < len(text), (lengths, text)
        # The welcome screen is gone; the header still names the model and the server's state.
        assert page.locator("#welcome-screen").count() == 0
        status = header_status(page, f"connected · {MODEL}")
        assert status.get_attribute("data-ok") == "true"
        assert f"model {MODEL}" in status.get_attribute("title")
        page_text = body_text(page)
        assert QUESTION in page_text and "error" not in page_text.lower(), page_text
        assert answer.locator("xpath=../..").locator("img").first.get_attribute("src") == "/favicon"


def test_settings_panel_max_tokens_is_a_checked_number_that_takes_effect(uis):
    live = uis[0]
    with chromium_page(live.url) as page:
        page.goto(live.url)
        page.locator("#chat-settings-open-modal").wait_for(timeout=30_000)
        page.click("#chat-settings-open-modal")
        field = page.locator("#chat-settings input#max_tokens")
        assert field.get_attribute("type") == "number" and field.input_value() == "512"
        assert "from 1 to 2048" in page.inner_text("#chat-settings")
        page.keyboard.press("Escape")
        # An invalid value is refused with one clear line.
        set_setting(page, "max_tokens", "0")
        page.get_by_text("Max tokens must be a whole number from 1 to 2048").wait_for(timeout=10_000)
        # Three tokens: a question that asks for a long answer gets three words at most.
        set_setting(page, "max_tokens", "3")
        index = page.locator(ANSWERS).count()
        send_message(page, "Tell me a long story about a dragon and a knight.")
        try:
            answer = wait_answer(page, index)
        except PlaywrightTimeout:
            pytest.fail("no finished answer\n" + diagnostics(page, live))
        finally:
            screenshot(page, "ui_max_tokens_3.png")
        words = answer.inner_text().split()
        assert 1 <= len(words) <= 3, words


def test_unreachable_server_is_a_clear_message_in_the_browser(uis):
    dead = uis[1]
    with chromium_page(dead.url) as page:
        page.goto(dead.url)
        page.get_by_text("Cannot reach the model server").first.wait_for(timeout=30_000)
        status = header_status(page, "server unreachable")
        assert status.get_attribute("data-ok") == "false"
        send_message(page, "Hello?")
        try:
            page.wait_for_function(
                "() => document.body.innerText.split('Cannot reach the model server').length > 2",
                timeout=30_000)
        except PlaywrightTimeout:
            pytest.fail("no error message answered the turn\n" + diagnostics(page, dead))
        finally:
            screenshot(page, "ui_server_down.png")
        text = body_text(page)
        assert "Hello?" in text and "Traceback" not in text, text
        assert "server unreachable" in status.inner_text()


def test_reasoning_step_model_defaults_and_regenerate(uis):
    ui, fake = uis[2], uis[3]
    with chromium_page(ui.url) as page:
        page.goto(ui.url)
        # No --temperature: the model's defaults are shown and are the panel's initial values.
        page.get_by_text("Model defaults: temperature 0.6, top_p 0.9, top_k 20").wait_for(
            timeout=30_000)
        send_message(page, QUESTION)
        answer = page.get_by_text(ANSWER, exact=True)
        answer.wait_for(timeout=30_000)
        reasoning = page.get_by_text(REASONING, exact=True)
        assert reasoning.is_visible() and answer.is_visible()
        assert (fake.bodies[0]["temperature"], fake.bodies[0]["top_p"]) == (0.6, 0.9)
        screenshot(page, "ui_reasoning_open.png")
        page.get_by_text("Thinking").first.click()  # collapse the step: the answer stays
        reasoning.wait_for(state="hidden", timeout=5_000)
        assert answer.is_visible()

        # Regenerate: the question is sent again and the new answer (and its reasoning) takes
        # the old one's place.
        wait_answer(page, 0).locator("xpath=..").get_by_role("button", name="Regenerate").click()
        page.get_by_text(SECOND_ANSWER, exact=True).wait_for(timeout=30_000)
        answer.wait_for(state="detached", timeout=10_000)
        wait_answer(page, 0)
        assert page.locator(ANSWERS).count() == 1
        assert page.get_by_text(REASONING, exact=True).count() == 1
        assert fake.bodies[1]["messages"] == fake.bodies[0]["messages"] == [
            {"role": "user", "content": QUESTION}]
        screenshot(page, "ui_regenerated.png")

"""The chat UI in a real browser: headless Chromium (Playwright) against `pagedserve ui`, which
talks to a real SmolLM2 server, or to a port where nothing listens."""

from __future__ import annotations

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from server_helpers import MODEL, free_port
from ui_helpers import (
    ANSWER,
    REASONING,
    UIProcess,
    chromium_page,
    diagnostics,
    fake_reasoning_server,
    screenshot,
    send_message,
)

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def uis(server):
    """Three UIs, started together: on the session's SmolLM2 server, on a dead port, and on a
    fake server that streams reasoning."""
    with fake_reasoning_server() as fake_url:
        procs = [UIProcess(server.url), UIProcess(f"http://127.0.0.1:{free_port()}"),
                 UIProcess(fake_url)]
        try:
            yield [p.wait_ready() for p in procs]
        finally:
            for p in procs:
                p.stop()


def body_text(page) -> str:
    return page.inner_text("body")


def test_chat_streams_an_answer_in_the_browser(uis):
    live = uis[0]
    with chromium_page(live.url) as page:
        page.goto(live.url)
        # The welcome screen: server status with the model name, and the starter prompts.
        page.get_by_text("Connected to").wait_for(timeout=30_000)
        assert MODEL in body_text(page)
        assert page.locator("#starter-capital-of-france").is_visible()
        send_message(page, QUESTION)
        try:
            page.wait_for_function("() => document.body.innerText.includes('Paris')", timeout=60_000)
            page.wait_for_timeout(500)
        except PlaywrightTimeout:
            pytest.fail("no answer with 'Paris'\n" + diagnostics(page, live))
        finally:
            shot = screenshot(page, "ui_chat_paris.png")
        text = body_text(page)
        assert QUESTION in text and "Paris" in text, text
        assert "error" not in text.lower(), text
        assert shot.stat().st_size > 10_000


def test_unreachable_server_is_a_clear_message_in_the_browser(uis):
    dead = uis[1]
    with chromium_page(dead.url) as page:
        page.goto(dead.url)
        page.get_by_text("Cannot reach the model server").first.wait_for(timeout=30_000)
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


def test_reasoning_shows_in_a_collapsible_step_apart_from_the_answer(uis):
    ui = uis[2]
    with chromium_page(ui.url) as page:
        page.goto(ui.url)
        send_message(page, "What is the capital of France?")
        answer = page.get_by_text(ANSWER, exact=True)
        answer.wait_for(timeout=30_000)
        reasoning = page.get_by_text(REASONING, exact=True)
        assert reasoning.is_visible() and answer.is_visible()
        screenshot(page, "ui_reasoning_open.png")
        page.get_by_text("Thinking").first.click()  # collapse the step: the answer stays
        reasoning.wait_for(state="hidden", timeout=5_000)
        assert answer.is_visible()

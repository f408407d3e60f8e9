"""The chat UI in a real browser: headless Chromium (Playwright) against `pagedserve ui`, which
talks to a real SmolLM2 server, or to a port where nothing listens."""

from __future__ import annotations

import pytest
from server_helpers import MODEL, free_port
from ui_helpers import UIProcess, chromium_page, screenshot, send_message

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def uis(server):
    """Two UIs, started together: one on the session's SmolLM2 server, one on a dead port."""
    live = UIProcess(server.url)
    dead = UIProcess(f"http://127.0.0.1:{free_port()}")
    try:
        yield live.wait_ready(), dead.wait_ready()
    finally:
        live.stop()
        dead.stop()


def body_text(page) -> str:
    return page.inner_text("body")


def test_chat_streams_an_answer_in_the_browser(uis):
    live, _ = uis
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
        finally:
            shot = screenshot(page, "ui_chat_paris.png")
        text = body_text(page)
        assert QUESTION in text and "Paris" in text, text
        assert "error" not in text.lower(), text
        assert shot.stat().st_size > 10_000


def test_unreachable_server_is_a_clear_message_in_the_browser(uis):
    _, dead = uis
    with chromium_page(dead.url) as page:
        page.goto(dead.url)
        page.get_by_text("Cannot reach the model server").first.wait_for(timeout=30_000)
        send_message(page, "Hello?")
        try:
            page.wait_for_function(
                "() => document.body.innerText.split('Cannot reach the model server').length > 2",
                timeout=30_000)
        finally:
            screenshot(page, "ui_server_down.png")
        text = body_text(page)
        assert "Hello?" in text and "Traceback" not in text, text

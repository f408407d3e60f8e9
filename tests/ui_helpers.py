"""Start `pagedserve ui` processes and drive them with headless Chromium (Debian's package)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from server_helpers import SubprocessUnderTest, free_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).parent / "artifacts"


class UIProcess(SubprocessUnderTest):
    """One `pagedserve ui` (Chainlit) on a free port of 127.0.0.1, temperature 0 by default."""

    WHAT, READY_PATH = "UI", ""

    def __init__(self, base_url: str, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._spawn([sys.executable, "-m", "pagedserve.cli", "ui", "--base-url", base_url,
                     "--host", "127.0.0.1", "--port", str(self.port), "--temperature", "0", *args])

    def wait_ready(self, timeout: float = 90.0) -> UIProcess:
        return super().wait_ready(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@contextlib.contextmanager
def chromium_page(origin: str):
    """A headless Chromium page (fresh profile) that may load only `origin`: requests anywhere
    else (the web fonts and CSS Chainlit's page links to) are aborted, never sent."""
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), (f"{CHROMIUM} is missing: `apt-get install -y chromium` "
                                      "(scripts/install.sh test does it)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            # Only foreign URLs are intercepted. The pattern is a regular expression, which the
            # browser side matches, so the page's own requests (socket.io's polling among them)
            # never wait on this thread (a Python predicate would intercept every request).
            foreign = re.compile(f"^(?!{re.escape(origin)}(?:[/?#]|$))")
            page.route(foreign, lambda route: route.abort())
            yield page
        finally:
            browser.close()


def send_message(page, text: str, timeout: float = 30.0) -> None:
    """Type `text` and send it, once the chat has started: the composer takes text before the
    page's socket session is up but drops the send. The settings button appears when the app's
    on_chat_start has sent the settings panel."""
    page.locator("#chat-settings-open-modal").wait_for(timeout=timeout * 1000)
    sent = page.locator('[data-step-type="user_message"]', has_text=text)
    before = sent.count()
    page.fill("#chat-input", text)
    deadline = time.monotonic() + timeout
    while page.input_value("#chat-input") == text:
        assert time.monotonic() < deadline, "the chat UI never took the message"
        page.focus("#chat-input")
        page.keyboard.press("Enter")
        page.wait_for_timeout(500)
    # The composer empties only when it sends; the message then shows in the thread.
    sent.nth(before).wait_for(timeout=timeout * 1000)


def diagnostics(page, ui: UIProcess) -> str:
    """What the page shows and what the UI logged: for the message of a failed wait."""
    return (f"--- page text ---\n{page.inner_text('body')[-3000:]}\n"
            f"--- UI log ---\n{ui.log_tail(3000)}")


def screenshot(page, name: str) -> Path:
    """Save a screenshot under tests/artifacts/ and say where."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path))
    print(f"screenshot: {path}")
    return path


REASONING = "The user asks about France, whose capital is Paris."
ANSWER = "The capital of France is Paris."


@contextlib.contextmanager
def fake_reasoning_server():
    """An OpenAI-style server in a thread of this process whose chat replies stream
    `reasoning_content` (REASONING) and then `content` (ANSWER), word by word. Yields its URL."""
    import asyncio
    import json
    import threading

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-thinker", "object": "model", "created": 0,
                                            "owned_by": "test"}]}

    @app.post("/v1/chat/completions")
    async def chat():
        def sse(delta: dict, finish: str | None = None) -> str:
            return "data: " + json.dumps({
                "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "fake-thinker",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

        async def stream():
            yield sse({"role": "assistant", "content": ""})
            for key, text in (("reasoning_content", REASONING), ("content", ANSWER)):
                for i, word in enumerate(text.split(" ")):
                    yield sse({key: (" " if i else "") + word})
                    await asyncio.sleep(0.02)
            yield sse({}, "stop")
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)

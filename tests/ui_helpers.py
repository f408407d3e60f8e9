"""Start `pagedserve ui` processes and drive them with headless Chromium (Debian's package)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from server_helpers import SubprocessUnderTest, free_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).parent / "artifacts"


class UIProcess(SubprocessUnderTest):
    """One `pagedserve ui` (Chainlit) on a free port of 127.0.0.1, `--temperature 0` unless
    `temperature` is None (then the panel starts at the model's defaults)."""

    WHAT, READY_PATH = "UI", ""

    def __init__(self, base_url: str, *args: str, temperature: str | None = "0") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flags = ["--temperature", temperature] if temperature is not None else []
        self._spawn([sys.executable, "-m", "pagedserve.cli", "ui", "--base-url", base_url,
                     "--host", "127.0.0.1", "--port", str(self.port), *flags, *args])

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


ANSWERS = '[data-step-type="assistant_message"] .message-content'

# Records, in the page, each new length of the text of answer number `index` (0-based), with
# the time it was seen: a MutationObserver sees every change React makes to the page.
_LENGTH_RECORDER = """([index, selector]) => {
  window.__answerLengths = [];
  const record = () => {
    const answers = document.querySelectorAll(selector);
    if (answers.length <= index) return;
    const n = answers[index].innerText.length, seen = window.__answerLengths;
    if (!seen.length || seen[seen.length - 1][0] !== n) seen.push([n, performance.now()]);
  };
  new MutationObserver(record).observe(
      document.body, {childList: true, subtree: true, characterData: true});
}"""


def record_answer_lengths(page) -> int:
    """Start recording the text length of the next answer; returns that answer's index."""
    index = page.locator(ANSWERS).count()
    page.evaluate(_LENGTH_RECORDER, [index, ANSWERS])
    return index


def answer_lengths(page) -> list[tuple[int, float]]:
    """What record_answer_lengths saw: (length, milliseconds) for each change."""
    return [tuple(x) for x in page.evaluate("window.__answerLengths")]


def wait_answer(page, index: int, timeout: float = 60.0):
    """Wait until answer `index` has finished (its Regenerate button shows); return it."""
    answer = page.locator(ANSWERS).nth(index)
    regenerate = answer.locator("xpath=..").get_by_role("button", name="Regenerate")
    regenerate.wait_for(timeout=timeout * 1000)
    return answer


def set_setting(page, field: str, value: str) -> None:
    """Open the settings panel (the gear by the message box), type `value` into `field`, and
    confirm."""
    page.click("#chat-settings-open-modal")
    panel = page.locator("#chat-settings")
    panel.wait_for(timeout=10_000)
    page.fill(f"#chat-settings #{field}", value)
    page.click("#chat-settings #confirm")
    panel.wait_for(state="hidden", timeout=10_000)


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
SECOND_ANSWER = "Paris is the capital of France."  # every later reply (a regenerated one)
FAKE_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}  # its model's sampling_defaults


@dataclass
class FakeServer:
    url: str
    bodies: list[dict] = field(default_factory=list)  # the chat requests it got, in order


@contextlib.contextmanager
def fake_reasoning_server():
    """An OpenAI-style server in a thread of this process whose chat replies stream
    `reasoning_content` (REASONING) and then `content` (ANSWER, then SECOND_ANSWER), word by
    word; its model lists FAKE_DEFAULTS as `sampling_defaults`. Yields a FakeServer."""
    import asyncio
    import json
    import threading

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    fake = FakeServer("")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-thinker", "object": "model", "created": 0,
                                            "owned_by": "test", "max_model_len": 4096,
                                            "sampling_defaults": FAKE_DEFAULTS}]}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):  # the JSON body (annotations are strings here: no Request)
        fake.bodies.append(body)
        answer = ANSWER if len(fake.bodies) == 1 else SECOND_ANSWER

        def sse(delta: dict, finish: str | None = None) -> str:
            return "data: " + json.dumps({
                "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "fake-thinker",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

        async def stream():
            yield sse({"role": "assistant", "content": ""})
            for key, text in (("reasoning_content", REASONING), ("content", answer)):
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
    fake.url = f"http://127.0.0.1:{port}"
    try:
        yield fake
    finally:
        server.should_exit = True
        thread.join(10)

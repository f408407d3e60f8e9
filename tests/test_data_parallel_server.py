"""`pagedserve serve --data-parallel-size 2` on the CPU (issue 57 item 7): two engine-core
processes behind one server. Both take requests (the `engine` label of /metrics tells which);
a conversation's later turns go to the core that served its first, even while that core is
the busier one; `prompt_cache_key` names the conversation instead of its messages; SIGKILL
one core under a stream: that stream ends with an error, the other core's stream finishes,
every new request is served by the live core while the dead one restarts, and the restarted
one serves again.

Which core a request goes to is made certain by load: a long stream keeps one core busy, so
a new conversation goes to the other (the least loaded) and only a kept conversation goes to
the busy one."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from server_helpers import ServerProcess, SseStream, alive, stream_completion, wait_idle

from pagedserve.monitor.promtext import Scrape

LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def dp_server(smollm2_dir):
    server = ServerProcess("--data-parallel-size", "2", "--max-num-seqs", "8").wait_ready()
    yield server
    leftovers = server.stop()
    assert not leftovers, f"child processes outlived the server: {leftovers}\n{server.log_tail()}"


def _scrape(url: str) -> Scrape:
    return Scrape.parse(httpx.get(url + "/metrics", timeout=10).text, time.monotonic())


def _served(url: str) -> list[float]:
    """Requests finished per engine core (`vllm:request_success_total` by `engine`)."""
    s = _scrape(url)
    return [s.value("vllm:request_success_total", engine=e) or 0.0 for e in ("0", "1")]


def _running(url: str) -> list[float]:
    s = _scrape(url)
    return [s.value("vllm:num_requests_running", engine=e) or 0.0 for e in ("0", "1")]


def _chat(*turns: str, key: str | None = None, **extra) -> dict:
    messages = [{"role": "system", "content": "You are brief."}]
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": f"Answer {i}."})
    body = {"messages": messages, "max_tokens": 2, "temperature": 0, **extra}
    if key is not None:
        body["prompt_cache_key"] = key
    return body


def _where(url: str, body: dict, path: str = "/v1/chat/completions") -> int:
    """Send `body` (not streamed); the index of the engine core that finished it."""
    before = _served(url)
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while (after := _served(url)) == before:  # (counted as the answer goes out)
        assert time.monotonic() < deadline, "no engine counted the request"
        time.sleep(0.05)
    moved = [i for i in (0, 1) if after[i] > before[i]]
    assert len(moved) == 1 and sum(after) - sum(before) == 1, (before, after)
    return moved[0]


async def _busy(url: str, body: dict, path: str = "/v1/chat/completions") -> tuple[asyncio.Task, int]:
    """Start a long stream of `body`; (its task, the core running it) once it runs."""
    before = _running(url)
    client = httpx.AsyncClient(timeout=300)
    task = asyncio.create_task(stream_completion(client, url, {**body, **LONG}, path=path))
    task.add_done_callback(lambda _: asyncio.ensure_future(client.aclose()))
    deadline = time.monotonic() + 30
    while True:
        now = _running(url)
        grew = [i for i in (0, 1) if now[i] > before[i]]
        if grew:
            return task, grew[0]
        assert time.monotonic() < deadline and not task.done(), "the stream never ran"
        await asyncio.sleep(0.05)


def test_both_cores_serve_and_a_conversation_stays_on_its_core(dp_server):
    url = dp_server.url
    assert len(dp_server.engine_core_pids()) == 2

    async def run():
        stream, home = await _busy(url, _chat("Tell me a long story about the sea."))
        other = 1 - home
        # the conversation's later turns stay home although that core is the busier one
        assert _where(url, _chat("Tell me a long story about the sea.", "Shorter.")) == home
        assert _where(url, _chat("Tell me a long story about the sea.", "Shorter.", "Why?")) == home
        # a new conversation goes to the least loaded core, and its turns stay there
        assert _where(url, _chat("Name a colour.")) == other
        assert _where(url, _chat("Name a colour.", "Another.")) == other
        # a completion prompt keys on its beginning the same way
        assert _where(url, {"prompt": "Once upon a time", "max_tokens": 2}, "/v1/completions") == other
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)

    asyncio.run(run())
    wait_idle(url)


def test_prompt_cache_key_routes_a_conversation(dp_server):
    """Two requests with one prompt_cache_key and different first messages land on one core;
    without the key the second goes elsewhere (the least loaded core)."""
    url = dp_server.url

    async def run():
        stream, home = await _busy(url, _chat("Count to a thousand.", key="user-42"))
        assert _where(url, _chat("What is 2 + 2?", key="user-42")) == home
        assert _where(url, _chat("What is 2 + 2?")) == 1 - home
        assert _where(url, {"prompt": "Hello", "max_tokens": 2, "prompt_cache_key": "user-42"},
                      "/v1/completions") == home
        # the Responses API takes the field too (it refused it before)
        assert _where(url, {"input": "Hi there", "max_output_tokens": 2, "prompt_cache_key": "user-42"},
                      "/v1/responses") == home
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)

    asyncio.run(run())
    wait_idle(url)


def test_a_killed_core_fails_its_stream_and_the_other_serves_while_it_restarts(dp_server):
    url = dp_server.url
    pids = dp_server.engine_core_pids()  # (which core a pid serves shows when it is killed)
    restarts0 = _scrape(url).value("pagedserve_engine_restarts_total") or 0.0

    async def scenario():  # (the survivor's stream would run on: it is cancelled at the end)
        s0, c0 = await _busy(url, _chat("Describe the mountains at length."))
        s1, c1 = await _busy(url, _chat("Describe the rivers at length."))
        assert {c0, c1} == {0, 1}
        os.kill(pids[0], signal.SIGKILL)
        killed_at = time.monotonic()
        done, _ = await asyncio.wait([s0, s1], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "no stream, or both, ended when one core was killed"
        dead = done.pop()
        live = s1 if dead is s0 else s0
        killed_core = c0 if dead is s0 else c1
        conversation = "mountains" if dead is s0 else "rivers"
        result: SseStream = dead.result()
        assert result.error and "engine core process died" in result.error["message"], vars(result)
        assert result.ended_at - killed_at < 5
        # the server stays healthy, and every new request goes to the live core (unless the
        # killed one is back already: restarting takes a second's back-off and a model load)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        served = [_where(url, _chat(f"Question {i}?")) for i in range(4)]
        served.append(_where(url, _chat(f"Describe the {conversation} at length.", "More.")))  # (its home died)
        restarted = (_scrape(url).value("pagedserve_engine_restarts_total") or 0.0) > restarts0
        assert served == [1 - killed_core] * 5 or restarted, served
        assert not live.done()  # (the live core's stream went on)
        live.cancel()
        await asyncio.gather(live, return_exceptions=True)

    asyncio.run(scenario())
    assert not alive(pids[0])
    deadline = time.monotonic() + 90
    while (_scrape(url).value("pagedserve_engine_restarts_total") or 0.0) <= restarts0:
        assert time.monotonic() < deadline, "the killed core was not restarted\n" + dp_server.log_tail()
        time.sleep(0.2)
    new = dp_server.engine_core_pids()
    assert len(new) == 2 and pids[1] in new and pids[0] not in new

    async def after():  # the restarted core serves: with one core busy, a new conversation goes to the other
        stream, home = await _busy(url, _chat("List every prime below a million."))
        assert _where(url, _chat("A fresh question?")) == 1 - home
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)

    asyncio.run(after())
    wait_idle(url)


def test_data_parallel_composes_with_tensor_parallel(tiny_with_tokenizer):
    """--data-parallel-size 2 --tensor-parallel-size 2 (two cores of two gloo ranks each)
    answers with the greedy tokens of one unsplit engine, on both cores."""
    from pagedserve import LLM, SamplingParams

    prompts = [[1, 300 + i, 700 + i, 5 * i + 2] for i in range(4)]
    llm = LLM(str(tiny_with_tokenizer), dtype="float32", device="cpu", max_model_len=256,
              kv_cache_memory=16 << 20)
    try:
        want = [o.outputs[0].text for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)]
    finally:
        llm.close()
    assert all(want)  # (text to compare)
    server = ServerProcess(str(tiny_with_tokenizer), "--data-parallel-size", "2",
                           "--tensor-parallel-size", "2", "--max-num-seqs", "4").wait_ready()
    try:
        assert len(server.engine_core_pids()) == 2

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(c.post(server.url + "/v1/completions", json={
                    "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
                    for p in prompts))

        answers = asyncio.run(run())
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        assert [r.json()["choices"][0]["text"] for r in answers] == want
        assert all(r.json()["usage"]["completion_tokens"] == 12 for r in answers)
        assert all(n > 0 for n in _served(server.url))  # (both cores answered some)
    finally:
        leftovers = server.stop()
    assert not leftovers, leftovers

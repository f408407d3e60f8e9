"""The naive Transformers baselines (`serve --engine hf` / `--engine hf-batched`) end to end:
real server subprocesses of the embedded SmolLM2 on the CPU in float32, checked against the
offline pagedserve engine (greedy text must be identical)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
from server_helpers import MODEL, ServerProcess

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
# Different lengths, so the static batch really left-pads.
CHATS = [
    [{"role": "user", "content": "Name a fruit."}],
    [{"role": "user", "content": "Write one sentence about the sea and the wind at night."}],
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Give me a short tip for learning to play the guitar well, please."}],
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def servers():
    """Both baseline servers, started together (start-up is mostly idle waiting)."""
    hf = ServerProcess("--engine", "hf", "--max-model-len", "1024")
    batched = ServerProcess("--engine", "hf-batched", "--max-model-len", "1024", "--max-num-seqs", "4")
    try:
        yield {"hf": hf.wait_ready(), "hf-batched": batched.wait_ready()}
    finally:
        hf.stop()
        batched.stop()


@pytest.fixture(scope="module")
def offline():
    from pagedserve import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory=64 << 20)
    finally:
        torch.set_num_threads(threads)


def offline_chat(llm, messages, max_tokens):
    from pagedserve import SamplingParams

    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ---- --engine hf ---------------------------------------------------------------------------


def test_hf_greedy_chat_matches_offline(servers, offline):
    r = client(servers["hf"]).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                                      temperature=0)
    want = offline_chat(offline, CHAT, 24)
    assert r.choices[0].message.content == want.outputs[0].text
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == want.outputs[0].finish_reason
    assert r.usage.prompt_tokens == want.num_prompt_tokens
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_hf_streaming_equals_non_streamed(servers):
    c = client(servers["hf"])
    full = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    deltas, usage, finish = [], None, None
    for chunk in c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                deltas.append(ch.delta.content)
            finish = ch.finish_reason or finish
    assert len(deltas) > 3  # token by token, not one blob at the end
    assert "".join(deltas) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_hf_concurrent_requests_all_complete(servers, offline):
    async def one(http, messages):
        r = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    async def main():
        async with httpx.AsyncClient(base_url=servers["hf"].url, timeout=120) as http:
            return await asyncio.gather(*[one(http, m) for m in CHATS[:3]])

    got = asyncio.run(main())
    assert got == [offline_chat(offline, m, MAX_TOKENS).outputs[0].text for m in CHATS[:3]]
    m = httpx.get(servers["hf"].url + "/metrics", timeout=10).text
    assert "vllm:num_requests_running" in m


def test_hf_rejects_unsupported_fields(servers):
    r = httpx.post(servers["hf"].url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": CHAT, "max_tokens": 4, "logprobs": True})
    assert r.status_code == 400, r.text
    assert "logprobs" in r.json()["error"]["message"]


# ---- --engine hf-batched -------------------------------------------------------------------


async def _stream_chat(http, messages, max_tokens):
    """(text, time of first content, time of finish) of one streamed greedy chat."""
    text, first = "", None
    async with http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                if ch["delta"].get("content"):
                    first = first or time.monotonic()
                    text += ch["delta"]["content"]
    return text, first, time.monotonic()


def test_hf_batched_matches_single_requests(servers, offline):
    url = servers["hf-batched"].url
    max_tokens = [MAX_TOKENS, MAX_TOKENS + 4, MAX_TOKENS - 6, MAX_TOKENS + 2]  # rows end at different steps

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await asyncio.gather(*[_stream_chat(http, m, n) for m, n in zip(CHATS, max_tokens)])

    results = asyncio.run(main())
    singles = [client(servers["hf-batched"]).chat.completions.create(
        model=MODEL, messages=m, max_tokens=n, temperature=0).choices[0].message.content
        for m, n in zip(CHATS, max_tokens)]
    want = [offline_chat(offline, m, n).outputs[0].text for m, n in zip(CHATS, max_tokens)]
    assert [t for t, _, _ in results] == singles
    assert singles == want


def test_hf_batched_runs_a_batch_together(servers):
    """One request with 4 prompts fans out at once: all 4 share one static batch, so every
    choice has its first token before any choice has finished."""
    prompts = ["The sky is", "My favourite food is", "Once upon a time", "The best way to learn is"]

    async def main():
        async with httpx.AsyncClient(base_url=servers["hf-batched"].url, timeout=120) as http:
            firsts, lasts = {}, {}
            async with http.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": prompts, "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for ch in json.loads(line[6:])["choices"]:
                        firsts.setdefault(ch["index"], time.monotonic())
                        if ch.get("finish_reason"):
                            lasts[ch["index"]] = time.monotonic()
            return firsts, lasts

    firsts, lasts = asyncio.run(main())
    assert sorted(lasts) == [0, 1, 2, 3]
    assert max(firsts.values()) < min(lasts.values())


@pytest.mark.parametrize("engine", ["hf", "hf-batched"])
def test_bench_serve_measures_the_baselines(servers, engine):
    """`pagedserve bench serve` end to end against each Transformers baseline."""
    from test_bench_serve import _args

    from pagedserve.bench.serve_run import run_serve

    result = run_serve(_args(base_url=servers[engine].url, label=engine, dataset="short",
                             endpoint="chat", output_len=4, num_prompts=3, warmup=1,
                             concurrency_sweep="1,3"))
    assert result["label"] == engine and result["model"] == MODEL
    for run in result["runs"]:
        assert run["completed"] == 3 and run["failed"] == 0
        assert run["output_tokens"] == 12  # usage from the baseline server; ignore_eos
        assert run["ttft_ms"]["median"] > 0 and run["e2el_ms"]["median"] >= run["ttft_ms"]["median"]

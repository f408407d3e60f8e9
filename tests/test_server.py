"""The OpenAI-compatible server, end to end: a real `pagedserve serve` of SmolLM2 on the CPU,
driven by the official `openai` client and plain HTTP.

The server fixture (`server`, in conftest.py) is shared with test_server_errors.py. Outputs are
kept short: SmolLM2 in float32 on two CPU cores makes a few dozen tokens a second.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch
from server_helpers import MODEL, wait_idle

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    """The offline engine on the same model, for parity with the server.

    One torch thread, like the server's engine in these tests (OMP_NUM_THREADS=1).
    """
    from pagedserve import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(dtype="float32", device="cpu", max_model_len=2048, kv_cache_memory=64 << 20)
    finally:
        torch.set_num_threads(threads)


# ---- parity with the offline engine ------------------------------------------------------


def test_greedy_chat_matches_offline_llm(client, offline):
    from pagedserve import SamplingParams

    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    want = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want.outputs[0].text
    assert "Paris" in choice.message.content
    assert choice.finish_reason == want.outputs[0].finish_reason
    assert r.usage.prompt_tokens == want.num_prompt_tokens
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == MODEL and r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_greedy_completion_matches_offline_llm(client, offline):
    from pagedserve import SamplingParams

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert r.choices[0].text == want.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == want.num_prompt_tokens
    assert r.usage.completion_tokens == 16


def test_seeded_sampling_matches_offline_llm(client, offline):
    """A seeded sample has its own generator: same tokens in the server and offline."""
    from pagedserve import SamplingParams

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                  seed=1234)
    want = offline.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=12, seed=1234),
                            use_tqdm=False)[0]
    assert r.choices[0].text == want.outputs[0].text


# ---- sampling features -------------------------------------------------------------------


def test_seed_reproducibility(client):
    story = [{"role": "user", "content": "Invent a name for a pet dragon and describe it."}]

    def sample(seed):
        r = client.chat.completions.create(model=MODEL, messages=story, max_tokens=16,
                                           temperature=1.0, seed=seed)
        return r.choices[0].message.content

    a, b = sample(7), sample(7)
    assert a == b
    assert len({a, sample(8), sample(9)}) > 1, "different seeds all gave the same sample"


def test_logit_bias_bans_and_forces_tokens_as_offline(client, offline):
    """-100 on the greedy continuation's first token makes the server pick another, +100 on a
    token makes it repeat that token; both exactly as the offline engine does."""
    from pagedserve import SamplingParams

    def offline_ids(bias):
        params = SamplingParams(temperature=0, max_tokens=6, logit_bias=bias)
        return offline.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]

    first = offline_ids(None).token_ids[0]
    banned = offline_ids({first: -100})
    assert first not in banned.token_ids
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                  logit_bias={str(first): -100})
    assert r.choices[0].text == banned.text
    forced = offline_ids({1920: 100})
    assert forced.token_ids == [1920] * 6
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                       logit_bias={"1920": 100})
    assert r.choices[0].message.content == forced.text


def test_n_greater_than_one(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                  n=3, seed=11, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1, "n=3 seeded samples are all identical"
    assert r.usage.completion_tokens == 24  # 3 x 8 (EOS ignored)
    assert r.usage.prompt_tokens > 0
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                      n=3, seed=11, extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2,
                                          temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy


def test_stop_string(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].text
    words = text.split()
    assert len(words) >= 4, text
    stop = words[2]
    cut = text.index(stop)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                  stop=[stop, "@@never@@"])
    assert r.choices[0].text == text[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16

    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                     stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:cut + len(stop)]

    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                         stop=[stop], stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_echo_and_logprobs(client):
    """echo with logprobs scores the prompt too, as OpenAI's legacy completions do: the
    prompt's tokens (the first without a logprob), then the completion's, text offsets
    running through both; streamed, the echo chunk carries the prompt's scores."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                  echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text.startswith(PROMPT) and len(c.text) > len(PROMPT)
    lp = c.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 5
    assert "".join(lp.tokens[:n_prompt]) == PROMPT and "".join(lp.tokens[n_prompt:]) == c.text[len(PROMPT):]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len(PROMPT)
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert logprob <= 0 and token in top and len(top) in (2, 3)
    for logprob, top in zip(lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert logprob == pytest.approx(max(top.values()))  # greedy takes the most likely
    # the prompt's scores are the model's: the offline engine gives the same
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[n_prompt:], abs=1e-4)
    stream = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                            echo=True, logprobs=2, stream=True))
    first = stream[0].choices[0]
    assert first.text == PROMPT and first.logprobs.token_logprobs == pytest.approx(
        lp.token_logprobs[:n_prompt], abs=1e-4)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == c.text


def test_vllm_prompt_logprobs(client, server):
    """vLLM's prompt_logprobs field: per prompt token (None for the first), its own logprob and
    rank and the top k's, with their decoded text; the same scores as echo with logprobs,
    whose top k is its own; on chat, one list for the request; refused when streamed."""
    body = {"prompt_logprobs": 2}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, extra_body=body)
    scores, n_prompt = r.choices[0].model_extra["prompt_logprobs"], r.usage.prompt_tokens
    assert len(scores) == n_prompt and scores[0] is None
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                     logprobs=5, extra_body={"prompt_logprobs": 1})
    lp = echo.choices[0].logprobs
    assert "prompt_logprobs" in echo.choices[0].model_extra  # (its own top 1, below)
    for t, e in scores[1].items():  # each id's text as /detokenize gives it
        text = httpx.post(f"{server.url}/detokenize", json={"tokens": [int(t)]}).json()["prompt"]
        assert e["decoded_token"] == text
    for j in range(1, n_prompt):
        entry = list(scores[j].values())
        assert len(entry) in (2, 3) and [e["rank"] for e in entry[:2]] == [1, 2]
        assert entry[0]["logprob"] >= entry[1]["logprob"]
        mine = next(e for e in entry if e["decoded_token"] == lp.tokens[j])  # the prompt token
        assert mine["logprob"] == pytest.approx(lp.token_logprobs[j], abs=1e-4)
        # its rank: where it stands among echo's top 5 (legacy top_logprobs: the top 5 and it)
        top5 = sorted(lp.top_logprobs[j].values(), reverse=True)[:5]
        if mine["rank"] <= 5:
            assert top5[mine["rank"] - 1] == pytest.approx(mine["logprob"], abs=1e-4)
        else:
            assert len(lp.top_logprobs[j]) == 6 and mine["logprob"] < top5[-1]
        assert len(echo.choices[0].model_extra["prompt_logprobs"][j]) in (1, 2)
    assert any(list(s.values())[-1]["rank"] > 2 for s in scores[1:])  # (some token outside the top 2)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0, n=2,
                                          extra_body={"prompt_logprobs": 0})
    scores = chat.model_extra["prompt_logprobs"]
    assert len(scores) == chat.usage.prompt_tokens and scores[0] is None
    assert all(len(s) == 1 and list(s.values())[0]["rank"] >= 1 for s in scores[1:])
    for bad in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=bad)
        assert e.value.body["param"] == "prompt_logprobs"
    got = httpx.post(f"{server.url}/generate", json={"prompt": PROMPT, "prompt_logprobs": 1})
    assert got.status_code == 400 and "prompt_logprobs" in got.text


def test_truncate_prompt_tokens(client, server):
    """vLLM's truncate_prompt_tokens keeps a prompt's last k tokens: a prompt longer than the
    context (2,048) is served from its end, the echo is the kept text, usage counts k; on chat
    the rendered prompt is cut; 0 and more than max_model_len are 400s."""
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    long_ids = [42] * 3000 + ids
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=long_ids, max_tokens=4)
    r = client.completions.create(model=MODEL, prompt=long_ids, max_tokens=4, temperature=0, echo=True,
                                  extra_body={"truncate_prompt_tokens": len(ids)})
    want = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].text == PROMPT + want.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    for bad in (0, 2049, -2):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                      extra_body={"truncate_prompt_tokens": bad})
        assert e.value.body["param"] == "truncate_prompt_tokens"


def test_allowed_token_ids(client, server):
    """vLLM's allowed_token_ids: every sampled token is one of them (sampling at temperature 1
    too); an empty list or an id outside the vocabulary is a 400 naming the field."""
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": " red green blue"}).json()["tokens"]
    for temperature in (0, 1.0):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=temperature,
                                      logprobs=0, extra_body={"allowed_token_ids": ids, "ignore_eos": True})
        tokens = r.choices[0].logprobs.tokens
        assert len(tokens) == 12 and set(tokens) <= {" red", " green", " blue"}, tokens
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                          extra_body={"allowed_token_ids": ids[:1], "ignore_eos": True})
    assert chat.choices[0].message.content == " red" * 6
    for bad in ([], [49152], [-1]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                      extra_body={"allowed_token_ids": bad})
        assert e.value.body["param"].startswith("allowed_token_ids"), e.value.body


def test_bad_words(client, server):
    """vLLM's bad_words, on completions and chat: the greedy output's first word banned, the
    output never holds its tokens (as written or after a space) and differs; an empty word is
    a 400 naming the field."""
    def ids_of(text):
        return httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]

    extra = {"ignore_eos": True, "return_token_ids": True}
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=extra)
    word = base.choices[0].text.split()[0]
    banned = [ids_of(word), ids_of(" " + word)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={**extra, "bad_words": [word]})
    got = r.choices[0].model_extra["token_ids"]
    assert r.choices[0].text != base.choices[0].text
    assert not any(got[i:i + len(b)] == b for b in banned for i in range(len(got))), (got, banned)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    first = chat.choices[0].message.content.split()[0]
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                           extra_body={"bad_words": [first]})
    assert again.choices[0].message.content.split()[:1] != [first]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"bad_words": [""]})
    assert e.value.body["param"] == "bad_words", e.value.body


def test_return_token_ids(client, server):
    """vLLM's return_token_ids: the prompt's ids and each choice's output ids, which decode to
    the prompt and the text; streamed, each chunk carries its new ids (they add up to the
    whole) and the prompt's come once."""
    def text_of(ids):
        return httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]

    extra = {"return_token_ids": True, "ignore_eos": True}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, n=2, extra_body=extra)
    c = r.choices[0].model_extra
    assert text_of(c["prompt_token_ids"]) == PROMPT and len(c["prompt_token_ids"]) == r.usage.prompt_tokens
    assert text_of(c["token_ids"]) == r.choices[0].text and len(c["token_ids"]) == 6
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, n=2,
                                            stream=True, extra_body=extra))
    for index in (0, 1):
        parts = [ch.choices[0].model_extra for ch in chunks if ch.choices and ch.choices[0].index == index]
        assert sum((p["token_ids"] for p in parts), []) == c["token_ids"]
        assert [p["prompt_token_ids"] for p in parts if "prompt_token_ids" in p] == [c["prompt_token_ids"]]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, extra_body=extra)
    ids = chat.choices[0].model_extra["token_ids"]
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert text_of(ids) == chat.choices[0].message.content and len(ids) == 6
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                                 stream=True, extra_body=extra))
    assert sum((ch.choices[0].model_extra["token_ids"] for ch in chunks if ch.choices), []) == ids
    firsts = [ch.model_extra["prompt_token_ids"] for ch in chunks if "prompt_token_ids" in ch.model_extra]
    assert firsts == [chat.model_extra["prompt_token_ids"]]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_extra


def test_continuous_usage_stats(client):
    """stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far,
    the last the whole; it needs include_usage."""
    for create, kwargs in ((client.completions.create, {"prompt": PROMPT}),
                           (client.chat.completions.create, {"messages": CHAT})):
        chunks = list(create(model=MODEL, max_tokens=6, temperature=0, stream=True, **kwargs,
                             stream_options={"include_usage": True, "continuous_usage_stats": True}))
        used = [c.usage for c in chunks]
        assert all(u is not None for u in used) and len({u.prompt_tokens for u in used}) == 1
        counts = [u.completion_tokens for u in used]
        assert counts == sorted(counts) and counts[-1] == 6 and counts[0] < 6
        assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in used)
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, max_tokens=2, stream=True, **kwargs,
                   stream_options={"continuous_usage_stats": True})
        assert e.value.body["param"] == "stream_options.continuous_usage_stats"


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True) and t.logprob == pytest.approx(values[0])
        assert bytes(t.bytes).decode() == t.token


# ---- streaming ---------------------------------------------------------------------------


def test_streaming_chat_matches_non_streaming(client):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    # usage only in the final chunk, which has no choices
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_the_role_chunk_comes_with_the_first_token(client):
    """A streamed chat's role chunk goes out with its first token, as vLLM sends it: a client
    that times the first chunk (vLLM's does) times the first token, not the request's arrival.
    A prompt of ~400 tokens takes the CPU engine (one thread) a second or more to prefill."""
    messages = [{"role": "user", "content": "Count: " + " ".join(str(i) for i in range(100))}]
    t0 = time.perf_counter()
    arrivals = []
    for c in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                            stream=True):
        if c.choices:
            arrivals.append((time.perf_counter() - t0, c.choices[0].delta))
    (t_role, role), (t_next, _) = arrivals[0], arrivals[1]
    assert role.role == "assistant"
    assert t_next > 0.2 and t_role > 0.5 * t_next, arrivals  # not sent before the prefill


def test_streaming_completion_n2_with_usage(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=5, n=2,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw)
    stream = client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    texts, finish = {0: "", 1: ""}, {}
    chunks = list(stream)
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert texts == {c.index: c.text for c in plain.choices}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_streaming_without_usage_has_no_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                            temperature=0, stream=True))
    assert chunks and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_concurrent_streams_with_early_disconnects(server):
    """64 streaming chats at once; 16 close their stream after a few chunks. The closed ones
    ask for 1000 tokens ignoring EOS, so unless the server aborts them they keep running (and
    hold KV blocks) long after the others are done."""

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                    max_retries=0, timeout=300)

        async def one(i: int):
            early = i % 4 == 0
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
                max_tokens=1000 if early else 12, temperature=0, stream=True,
                extra_body={"ignore_eos": early})
            text, finish, n = "", None, 0
            async for chunk in stream:
                n += 1
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
                if early and n >= 3:
                    await stream.close()
                    return "closed", text, finish
            return "done", text, finish

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), 240)
        finally:
            await client.close()

    results = asyncio.run(run())
    closed = [r for r in results if r[0] == "closed"]
    done = [r for r in results if r[0] == "done"]
    assert len(closed) == 16 and len(done) == 48
    assert all(r[2] is None for r in closed)
    for _, text, finish in done:
        assert finish in ("stop", "length") and text
    m = wait_idle(server.url)
    assert m["vllm:num_requests_running"] == 0, m
    assert m["vllm:num_requests_waiting"] == 0, m
    assert m["vllm:kv_cache_usage_perc"] == 0, m
    assert m["vllm:generation_tokens_total"] > 48 * 5


def test_non_streaming_disconnect_aborts(server):
    """A non-streaming client that gives up must not leave its request running."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=2,
                   json={"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True})
    m = wait_idle(server.url, timeout=10)
    assert m["vllm:num_requests_running"] == 0, m
    assert m["vllm:kv_cache_usage_perc"] == 0, m


# ---- the other endpoints -----------------------------------------------------------------


def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    raw = httpx.get(server.url + "/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == 2048
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:request_success_total"):
        assert name in text


def test_generate_endpoint(server, client):
    r = httpx.post(server.url + "/generate", timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    want = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    assert body["text"] == want.choices[0].text
    assert body["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": want.usage.prompt_tokens, "completion_tokens": 10,
                             "total_tokens": want.usage.prompt_tokens + 10}


def test_tokenize_detokenize(server, client):
    url = server.url
    tok = httpx.post(url + "/tokenize", json={"prompt": "Hello world, héllo 🌍"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 2048
    back = httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back["prompt"] == "Hello world, héllo 🌍"
    # an escaped surrogate pair is one character
    pair = httpx.post(url + "/tokenize", content=b'{"prompt": "\\ud83c\\udf0d"}',
                      headers={"content-type": "application/json"}).json()
    assert pair["tokens"] == httpx.post(url + "/tokenize", json={"prompt": "🌍"}).json()["tokens"]
    # the chat template's token count is what a chat completion reports as prompt_tokens
    chat_tok = httpx.post(url + "/tokenize", json={"messages": CHAT}).json()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert chat_tok["count"] == r.usage.prompt_tokens
    special = httpx.post(url + "/detokenize", json={"tokens": chat_tok["tokens"]}).json()["prompt"]
    assert special.startswith("<|im_start|>") and CHAT[0]["content"] in special
    # a completion of token ids equals the completion of the text they encode
    by_ids = client.completions.create(model=MODEL, prompt=tok["tokens"], max_tokens=4, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt="Hello world, héllo 🌍", max_tokens=4,
                                        temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_message_fields_and_request_templates_reach_the_template(server, client):
    """A message's name, tool_calls, tool_call_id and reasoning_content reach the chat template
    (this server trusts request templates); a chat completion renders the same prompt."""
    template = ("{% for m in messages %}[{{ m.role }}|{{ m.name }}|{{ m.tool_call_id }}|"
                "{{ m.reasoning_content }}|{{ m.tool_calls[0].id if m.tool_calls else '' }}]"
                "{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }};{% endfor %}"
                "{{ m.content }}{% endfor %}")
    messages = [{"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": "yo", "reasoning_content": "think",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "f", "arguments": '{"city": "Paris"}'}},
                                {"id": "call_2", "type": "function",
                                 "function": {"name": "f", "arguments": "not json"}}]},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    tok = httpx.post(server.url + "/tokenize", json={"messages": messages, "chat_template": template}).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    # arguments reach the template as an object (as Hugging Face templates take them), so
    # `tojson` writes them once; text that is not a JSON object stays text
    assert text == ('[user|ann|||]hi[assistant|||think|call_1]{"city": "Paris"};"not json";yo'
                    '[tool||call_1||]42')
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                       extra_body={"chat_template": template})
    assert r.usage.prompt_tokens == tok["count"]


def test_the_http_process_never_loads_torch(server, client):
    """The HTTP process (tokenizer, templates, streaming) imports no torch: only the engine
    core holds the model stack. Checked on the running server, after it has served."""
    from pathlib import Path

    from server_helpers import cmdline

    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert "pagedserve.cli serve" in cmdline(server.proc.pid)
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "triton" not in maps
    core_maps = Path(f"/proc/{server.engine_core_pid()}/maps").read_text()
    assert "libtorch" in core_maps  # (the check can see torch where it is loaded)

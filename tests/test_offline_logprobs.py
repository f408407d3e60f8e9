"""The offline API's logprobs in vLLM's shape: per token {token id: Logprob(logprob, rank,
decoded_token)}, the same numbers the server's /v1/completions gives for the same request,
and each sampled token's rank what the prompt-scoring path gives that token fed back."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import MODEL

from pagedserve import LLM, Logprob, SamplingParams

PROMPT = "The lighthouse keeper opened the door and"
REQUEST = {"temperature": 1.0, "seed": 11, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def offline():
    llm = LLM(dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory=64 << 20)
    out = llm.generate(PROMPT, SamplingParams(**REQUEST, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    yield llm, out
    llm.check_no_leaks()


def test_logprobs_are_logprob_objects_keyed_by_token_id(offline):
    llm, out = offline
    o = out.outputs[0]
    decode = lambda t: llm.get_tokenizer().decode([t], skip_special_tokens=False)  # noqa: E731
    assert len(o.logprobs) == len(o.token_ids) == 8
    for token, entry in zip(o.token_ids, o.logprobs):
        assert token in entry and len(entry) in (3, 4)  # the top 3, and the sampled if not among them
        assert all(isinstance(x, Logprob) and x.decoded_token == decode(t) for t, x in entry.items())
        top = [(t, x) for t, x in entry.items()][:3]
        assert [x.logprob for _, x in top] == sorted((x.logprob for _, x in top), reverse=True)
        own = entry[token]
        likelier = sum(x.logprob > own.logprob for _, x in top)
        if likelier < 3:  # inside the top 3: its rank counts the likelier ones there
            assert own.rank == likelier + 1
        else:
            assert own.rank > 3 and len(entry) == 4
        assert all(x.rank == place for place, (t, x) in enumerate(top, 1) if t != token)
    assert any(e[t].rank > 1 for t, e in zip(o.token_ids, o.logprobs))  # (sampled, not greedy)
    assert o.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs)))
    pl = out.prompt_logprobs
    assert pl[0] is None and len(pl) == len(out.prompt_token_ids)
    for token, entry in zip(out.prompt_token_ids[1:], pl[1:]):
        assert token in entry and entry[token].decoded_token == decode(token)
        assert entry[token].rank >= 1 and all(isinstance(x, Logprob) for x in entry.values())


def test_offline_logprobs_equal_the_servers(offline, server):
    _, out = offline
    o = out.outputs[0]
    r = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, **REQUEST, "logprobs": 3, "prompt_logprobs": 2},
        timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == o.text  # (the same seeded draws)
    assert lp["tokens"] == [e[t].decoded_token for t, e in zip(o.token_ids, o.logprobs)]
    assert lp["token_logprobs"] == pytest.approx([e[t].logprob for t, e in zip(o.token_ids, o.logprobs)],
                                                 abs=1e-4)
    for entry, theirs in zip(o.logprobs, lp["top_logprobs"]):
        top = list(entry.values())[:3]
        assert list(theirs)[:3] == [x.decoded_token for x in top]
        assert list(theirs.values())[:3] == pytest.approx([x.logprob for x in top], abs=1e-4)
    # vLLM's prompt_logprobs: the same ids, ranks and texts
    theirs = choice["prompt_logprobs"]
    assert theirs[0] is None and out.prompt_logprobs[0] is None
    for mine, their in zip(out.prompt_logprobs[1:], theirs[1:], strict=True):
        assert [int(t) for t in their] == list(mine)
        for t, x in mine.items():
            assert their[str(t)]["rank"] == x.rank and their[str(t)]["decoded_token"] == x.decoded_token
            assert their[str(t)]["logprob"] == pytest.approx(x.logprob, abs=1e-4)
    # each sampled token's rank: what scoring it as a prompt token gives (another path)
    r = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": out.prompt_token_ids + o.token_ids, "max_tokens": 1,
        "prompt_logprobs": 0}, timeout=120)
    scored = r.json()["choices"][0]["prompt_logprobs"][len(out.prompt_token_ids):]
    assert [s[str(t)]["rank"] for s, t in zip(scored, o.token_ids)] == [
        e[t].rank for t, e in zip(o.token_ids, o.logprobs)]

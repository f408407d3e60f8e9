"""The pooling endpoints (issue 62) on real servers: /v1/embeddings with the `openai` client
(floats, base64, dimensions, token ids), /rerank and /score with httpx, auth and metrics as
elsewhere, and 400s naming the field or the runner for what does not fit."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from pooling_helpers import smollm2_embedder, tiny_reranker
from server_helpers import ServerProcess, metrics

KEY = "pooling-key"
TEXTS = ["The capital of France is Paris.", "Blocks of sixteen tokens hold the cache."]
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel tower is in Paris.",
        "Berlin is the capital of Germany."]


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory, smollm2_dir):
    folder = smollm2_embedder(smollm2_dir, tmp_path_factory.mktemp("st") / "smollm2-st")
    proc = ServerProcess(str(folder), api_key=KEY).wait_ready()
    yield proc
    assert not proc.stop(), proc.log_tail()


@pytest.fixture(scope="module")
def rerank_server(tmp_path_factory, smollm2_dir):
    folder = tmp_path_factory.mktemp("rr") / "tiny-qwen3-reranker"
    hf = tiny_reranker(smollm2_dir, folder)
    proc = ServerProcess(str(folder)).wait_ready()
    yield proc, hf
    assert not proc.stop(), proc.log_tail()


def _reference(smollm2_dir, texts):
    """Transformers' mean of SmolLM2's final-norm hidden states, normalised (what the
    sentence-transformers folder computes)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers.AutoModel.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    out = []
    for t in texts:
        with torch.no_grad():
            out.append(F.normalize(model(**tok(t, return_tensors="pt")).last_hidden_state[0].mean(0), dim=-1))
    return torch.stack(out), [tok(t).input_ids for t in texts]


def test_openai_embeddings(embed_server, smollm2_dir):
    client = openai.OpenAI(base_url=embed_server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    ref, ids = _reference(smollm2_dir, TEXTS)
    floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    got = torch.tensor([d.embedding for d in floats.data])
    assert [d.index for d in floats.data] == [0, 1]
    assert (F.cosine_similarity(got, ref, dim=1) > 1 - 1e-5).all()
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    # the client's default asks for base64 and decodes it: the same floats
    default = client.embeddings.create(model=model, input=TEXTS)
    assert torch.equal(torch.tensor([d.embedding for d in default.data]), got)
    raw = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="base64").data[0].embedding
    packed = base64.b64decode(raw)
    assert torch.equal(torch.tensor(struct.unpack(f"<{len(packed) // 4}f", packed)), got[0])
    short = client.embeddings.create(model=model, input=TEXTS[0], dimensions=32, encoding_format="float",
                                     user="u-1").data[0].embedding
    assert len(short) == 32
    assert torch.allclose(torch.tensor(short), F.normalize(got[0, :32], dim=0), atol=1e-6)
    by_ids = client.embeddings.create(model=model, input=ids, encoding_format="float")  # token-id lists
    assert torch.allclose(torch.tensor([d.embedding for d in by_ids.data]), got, atol=1e-6)
    one_ids = client.embeddings.create(model=model, input=ids[1], encoding_format="float")
    assert torch.allclose(torch.tensor(one_ids.data[0].embedding), got[1], atol=1e-6)
    m = metrics(embed_server.url)
    assert sum(v for k, v in m.items() if k.startswith("vllm:request_success_total")) >= 6


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 100000}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "model": "nope"}, "model"),
])
def test_bad_embedding_requests_name_the_field(embed_server, body, param):
    r = httpx.post(embed_server.url + "/v1/embeddings", json=body, headers=embed_server.headers, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_pooling_server_refuses_generation_and_checks_the_key(embed_server):
    h = embed_server.headers
    r = httpx.post(embed_server.url + "/v1/chat/completions", headers=h, timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "pooling model" in r.json()["error"]["message"], r.text
    r = httpx.post(embed_server.url + "/rerank", headers=h, timeout=60, json={"query": "q", "documents": ["d"]})
    assert r.status_code == 400 and "'embed'" in r.json()["error"]["message"], r.text
    r = httpx.post(embed_server.url + "/v1/embeddings", json={"input": "x"}, timeout=60)  # no key
    assert r.status_code == 401


def test_rerank_and_score(rerank_server):
    proc, hf = rerank_server
    r = httpx.post(proc.url + "/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3}, timeout=120)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    scores = [x["relevance_score"] for x in results]
    assert len(results) == 3 and scores == sorted(scores, reverse=True)
    assert all(x["document"]["text"] == DOCS[x["index"]] for x in results)
    full = httpx.post(proc.url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=120).json()
    by_index = [d["score"] for d in full["data"]]
    assert [x["index"] for x in results] == sorted(range(4), key=lambda i: -by_index[i])[:3]
    assert full["usage"]["prompt_tokens"] > 0
    # Transformers orders the documents the same way (the rerank prompt, p(yes) at its end)
    from pagedserve.pooling_prompts import rerank_prompt, score_token_ids
    from pagedserve.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(proc_folder(proc))
    no, yes = score_token_ids(tok.encode)
    ref = []
    for d in DOCS:
        with torch.no_grad():
            logits = hf(torch.tensor([tok.encode(rerank_prompt(QUERY, d))])).logits[0, -1]
        ref.append(torch.softmax(logits[[no, yes]], dim=0)[1].item())
    assert sorted(range(4), key=lambda i: -ref[i]) == sorted(range(4), key=lambda i: -by_index[i])
    assert max(abs(a - b) for a, b in zip(ref, by_index)) < 1e-5
    pairwise = httpx.post(proc.url + "/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}, timeout=120)
    assert [d["score"] for d in pairwise.json()["data"]] == pytest.approx(by_index[:2], abs=1e-6)


def proc_folder(proc) -> str:
    return next(a for a in proc.proc.args if "reranker" in str(a))


@pytest.mark.parametrize("path, body, param", [
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"documents": ["d"]}, "query"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/embeddings", {"input": "x"}, "model"),
])
def test_bad_score_requests_name_the_field(rerank_server, path, body, param):
    proc, _ = rerank_server
    r = httpx.post(proc.url + path, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_generation_server_refuses_embeddings(server):
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert r.status_code == 400, r.text
    assert "--runner pooling" in r.json()["error"]["message"]

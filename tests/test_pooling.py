"""Pooling models in the engine and offline (issue 62): embeddings against Transformers and
sentence-transformers in fp32, a chunked mean, last-token pooling, embeddings sharing steps
with generation, and Qwen3-Reranker-style scores against Transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pooling_helpers import smollm2_embedder, tiny_reranker

from conftest import make_hf_checkpoint
from pagedserve import LLM
from pagedserve.engine.messages import EngineRequest
from pagedserve.pooling_params import PoolerConfig, PoolingParams
from pagedserve.pooling_prompts import rerank_prompt, score_token_ids
from pagedserve.sampling_params import SamplingParams

TEXTS = ["The capital of France is Paris.",
         "Paged attention keeps the KV cache in fixed-size blocks, so that sequences of any "
         "length share one pool of memory without fragmentation."]
KW = dict(dtype="float32", device="cpu", kv_cache_memory=32 << 20)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, smollm2_dir):
    folder = smollm2_embedder(smollm2_dir, tmp_path_factory.mktemp("st") / "smollm2-st")
    # a step of 16 tokens: the long text's mean is summed over several chunks
    return folder, LLM(str(folder), max_num_batched_tokens=16, **KW)


def test_sentence_transformers_folder_is_detected(embedder):
    _, llm = embedder
    assert llm.pooler == PoolerConfig("embed", "mean", True)


def test_mean_embeddings_match_sentence_transformers(embedder):
    from sentence_transformers import SentenceTransformer

    folder, llm = embedder
    outs = llm.embed(TEXTS)
    assert len(outs[1].prompt_token_ids) > 16  # (chunked: two steps or more)
    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True).float()
    got = torch.tensor([o.outputs.embedding for o in outs])
    cos = F.cosine_similarity(got, ref, dim=1)
    assert (cos > 1 - 1e-5).all(), cos
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    short = llm.embed(TEXTS[0], dimensions=64)[0].outputs.embedding  # Matryoshka: renormalised
    assert len(short) == 64 and abs(sum(x * x for x in short) - 1) < 1e-5
    assert F.cosine_similarity(torch.tensor(short), got[0, :64], dim=0) > 1 - 1e-6
    llm.check_no_leaks()


def test_a_pooling_model_refuses_generate_and_score(embedder):
    _, llm = embedder
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("hi")
    with pytest.raises(ValueError, match="score"):
        llm.score("q", ["d"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    hf = make_hf_checkpoint("qwen3", folder)
    return hf, LLM(str(folder), max_num_batched_tokens=32, **KW)


def test_last_token_pooling_and_mixed_steps_with_generation(tiny):
    """Embedding requests (last-token, mean, cls; one unnormalised) in the same steps as a
    generation request: each vector equals Transformers' pooling of its final-norm hidden
    states, and the generated tokens are those of the request run alone."""
    hf, llm = tiny
    engine = llm.engine
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 45, 70, 20)]
    alone = llm.generate([prompts[2]], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    kinds = [("last", True), ("mean", True), ("cls", False), ("last", False)]
    steps, held = [], {}  # each step's requests; each request's most KV tokens
    execute, allocate = engine.executor.execute, engine.kv.allocate
    engine.executor.execute = lambda out: (steps.append({c.request_id for c in out.chunks}), execute(out))[1]

    def counting_allocate(rid, num_tokens, *args):
        held[rid] = max(held.get(rid, 0), num_tokens)
        return allocate(rid, num_tokens, *args)

    engine.kv.allocate = counting_allocate
    try:
        for i, (p, (kind, norm)) in enumerate(zip(prompts, kinds)):
            pp = PoolingParams("embed", kind, norm)
            engine.add_request(EngineRequest(f"e{i}", p, SamplingParams.for_pooling(pp)))
            if i == 0:
                engine.add_request(EngineRequest("g", prompts[2], SamplingParams(max_tokens=6, temperature=0)))
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
    finally:
        engine.executor.execute, engine.kv.allocate = execute, allocate
    assert any("g" in s and len(s) > 1 for s in steps)  # generation shared steps with pooling
    assert [t for o in outs["g"] for t in o.new_token_ids] == alone[0].outputs[0].token_ids
    for i, (p, (kind, norm)) in enumerate(zip(prompts, kinds)):
        (o,) = outs[f"e{i}"]
        assert o.finished and o.new_token_ids == [] and o.num_prompt_tokens == len(p)
        assert held[f"e{i}"] == len(p)  # KV for its prompt only: nothing for a decode
        with torch.no_grad():
            h = hf.model(torch.tensor([p])).last_hidden_state[0]  # [T, hidden]
        ref = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[kind]
        ref = F.normalize(ref, dim=-1) if norm else ref
        assert torch.allclose(torch.tensor(o.pooled), ref, atol=1e-5, rtol=1e-5), (kind, norm)
    llm.check_no_leaks()


def test_last_token_embeddings_reuse_the_prefix_cache(tiny):
    """A last-token request may start from cached blocks (its last token is always computed);
    its vector is unchanged."""
    hf, llm = tiny
    engine = llm.engine
    prompt = list(range(3, 3 + 40))
    pp = PoolingParams("embed", "last", False)
    vectors = []
    for rid in ("a", "b"):
        engine.add_request(EngineRequest(rid, prompt, SamplingParams.for_pooling(pp)))
        while engine.has_unfinished_requests():
            vectors += [o for o in engine.step() if o.pooled is not None]
    assert vectors[0].num_cached_tokens == 0 and vectors[1].num_cached_tokens == 32
    assert torch.allclose(torch.tensor(vectors[0].pooled), torch.tensor(vectors[1].pooled), atol=1e-5)
    # a mean reads every prompt row: the same prompt takes no cached blocks
    engine.add_request(EngineRequest("m", prompt, SamplingParams.for_pooling(PoolingParams("embed", "mean"))))
    while engine.has_unfinished_requests():
        vectors += [o for o in engine.step() if o.pooled is not None]
    assert vectors[2].num_cached_tokens == 0
    with torch.no_grad():
        ref = F.normalize(hf.model(torch.tensor([prompt])).last_hidden_state[0].mean(0), dim=-1)
    assert torch.allclose(torch.tensor(vectors[2].pooled), ref, atol=1e-5)


def test_reranker_scores_match_transformers(tmp_path_factory, smollm2_dir):
    folder = tmp_path_factory.mktemp("rr") / "tiny-qwen3-reranker"
    hf = tiny_reranker(smollm2_dir, folder)
    llm = LLM(str(folder), **KW)
    assert llm.pooler == PoolerConfig("score", "last", False)
    query = "What is the capital of France?"
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel tower is in Paris.",
            "Berlin is the capital of Germany."]
    outs = llm.score(query, docs)
    no, yes = score_token_ids(llm.tokenizer.encode)
    ref = []
    for d, o in zip(docs, outs):
        ids = llm.tokenizer.encode(rerank_prompt(query, d))
        assert o.prompt_token_ids == ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        ref.append(torch.softmax(logits[[no, yes]], dim=0)[1].item())
    got = [o.outputs.score for o in outs]
    assert sorted(range(4), key=lambda i: got[i]) == sorted(range(4), key=lambda i: ref[i])
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-5
    with pytest.raises(ValueError, match="embed"):
        llm.embed("x")
    llm.check_no_leaks()


def test_score_token_ids_outside_the_vocabulary_are_refused(tiny):
    _, llm = tiny
    params = SamplingParams.for_pooling(PoolingParams("score", "last", False, (1, 10**6)))
    with pytest.raises(ValueError, match="score_token_ids"):
        llm.engine.add_request(EngineRequest("bad", [1, 2, 3], params))


def test_the_runner_from_flags_presets_and_checkpoints():
    from pagedserve.models.pooling import resolve_pooler
    from pagedserve.models.presets import load_preset
    from pagedserve.models.source import ModelSource

    def detect(name, cfg=None):
        from pagedserve.models.pooling import detect_pooler

        return detect_pooler(ModelSource(name, cfg or {"architectures": ["Qwen3ForCausalLM"]}))

    embed = detect("qwen3-embedding-4b", load_preset("qwen3-embedding-4b"))
    assert embed == PoolerConfig("embed", "last", True)
    assert detect("qwen3-reranker-0.6b", load_preset("qwen3-reranker-0.6b")) == PoolerConfig("score", "last", False)
    assert detect("Qwen/Qwen3-Reranker-4B") == PoolerConfig("score", "last", False)  # (by its name)
    assert detect("qwen3-0.6b", load_preset("qwen3-0.6b")) is None
    assert resolve_pooler("auto", "auto", None, embed) == embed
    assert resolve_pooler("generate", "auto", None, embed) is None  # (an embedder run as a decoder)
    assert resolve_pooler("auto", "auto", None, None) is None
    assert resolve_pooler("pooling", "auto", None, None) == PoolerConfig("embed", "last", True)
    assert resolve_pooler("pooling", "score", None, None) == PoolerConfig("score", "last", False)
    assert resolve_pooler("auto", "auto", '{"pooling_type": "MEAN", "normalize": false}', embed) == \
        PoolerConfig("embed", "mean", False)
    for bad, says in [(("pooling", "auto", '{"pooling_type": "max"}', None), "pooling_type"),
                      (("auto", "auto", {"normalize": 1}, embed), "normalize"),
                      (("auto", "auto", {"pooling_type": "MEAN"}, None), "--runner pooling"),
                      (("embed", "auto", None, None), "runner")]:
        with pytest.raises(ValueError, match=says):
            resolve_pooler(*bad)

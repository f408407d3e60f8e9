"""Speculative decoding for requests with a grammar (issues 24 and 27), on the embedded SmolLM2
(CPU, fp32): n-gram drafts are verified under each position's grammar mask, so constrained
greedy outputs are token for token those without speculation (JSON schemas, choices, regexes,
a grammar after the end of reasoning), drafts are kept, and sampled constrained outputs
still follow their grammar; the drafts' walk through a grammar (masks, where it stops, the
matcher rolled back) checked against the matcher itself."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.cached_request import CachedRequest
from pagedserve.spec_decode.draft_grammar import draft_masks
from pagedserve.structured.params import StructuredOutputsParams as Constraint

# (never paused: these tests follow the drafts of every step)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "min_accepted_per_step": 0}
ITEMS = {"type": "array", "minItems": 4, "maxItems": 6,
         "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                    "kind": {"type": "string", "enum": ["fruit", "nut"]}},
                   "required": ["name", "kind"], "additionalProperties": False}}


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def engines():
    kw = dict(dtype="float32", device="cpu", max_model_len=512, max_num_seqs=8, kv_cache_memory=64 << 20)
    return LLM(**kw), LLM(speculative_config=NGRAM, **kw)


def _outs(llm: LLM, messages, params):
    outs = [o.outputs[0] for o in llm.chat(messages, params, use_tqdm=False)]
    llm.engine.kv.check_integrity(expect_all_free=True)
    return outs


def test_constrained_greedy_outputs_are_unchanged_and_drafts_are_kept(engines):
    base, spec = engines
    messages = [chat("List four fruits and nuts as JSON."), chat("Pick a colour."), chat("Phone number?"),
                chat("Say hello.")]
    params = [SamplingParams(temperature=0, max_tokens=160, structured_outputs=Constraint(json=ITEMS)),
              SamplingParams(temperature=0, max_tokens=20,
                             structured_outputs=Constraint(choice=["dark red", "dark blue", "green"])),
              SamplingParams(temperature=0, max_tokens=20,
                             structured_outputs=Constraint(regex=r"\d{3}-\d{3}-\d{3}")),
              SamplingParams(temperature=0, max_tokens=30)]  # (a free request beside them)
    want = _outs(base, messages, params)
    s = spec.engine.speculator
    s.reset_stats()
    got = _outs(spec, messages, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got[0].text), ITEMS)
    assert s.num_drafts > 0 and s.num_accepted_tokens > 0
    # the JSON alone: its repeated keys are drafted and kept
    s.reset_stats()
    (alone,) = _outs(spec, messages[:1], params[:1])
    assert alone.token_ids == want[0].token_ids and s.num_accepted_tokens >= 10, s.num_accepted_tokens


def test_sampled_constrained_outputs_follow_their_grammar(engines):
    _, spec = engines
    s = spec.engine.speculator
    s.reset_stats()
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=160, n=3,
                            structured_outputs=Constraint(json=ITEMS))
    (out,) = spec.chat(chat("List four fruits and nuts as JSON."), params, use_tqdm=False)
    for o in out.outputs:
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), ITEMS)
    assert s.num_drafts > 0
    spec.engine.kv.check_integrity(expect_all_free=True)


def test_the_grammar_starts_after_its_after_tokens_with_drafts(engines):
    """A grammar after the end of reasoning (`after_tokens`): the free text before it takes
    drafts too (copied from the prompt, up to and past the marker), the output is the same as
    without speculation, and the grammar governs after the marker."""
    base, spec = engines
    marker = tuple(base.get_tokenizer().encode(" Answer:", add_special_tokens=False))
    prompt = ("Q: colours? Reasoning: red, green, blue, yellow. Answer: red\n"
              "Q: colours? Reasoning: red, green, blue, yellow. Answer: blue\n"
              "Q: colours? Reasoning: red, green, blue, yellow. Answer: red\n"
              "Q: colours? Reasoning:")
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=Constraint(
        choice=[" green", " dark blue"], after_tokens=marker))
    want = base.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    s = spec.engine.speculator
    s.reset_stats()
    got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"
    reasoning, answer = got.text.split(" Answer:")
    assert reasoning.startswith(" red, green") and answer in (" green", " dark blue")
    assert s.num_accepted_tokens > 0
    spec.engine.kv.check_integrity(expect_all_free=True)


# ---- the walk itself, against the matcher ------------------------------------------------

@pytest.fixture(scope="module")
def compiled(engines):
    base, _ = engines
    return base.engine._grammar_compiler(), base.get_tokenizer(), base.engine.model_config.vocab_size


def _request(compiled, constraint: Constraint, after=()) -> CachedRequest:
    grammars, _, _ = compiled
    grammar = grammars.submit(constraint).result(timeout=60)
    return CachedRequest("r", [1, 2, 3], SamplingParams(), [1, 2, 3], matcher=grammar.matcher(),
                         grammar_after=tuple(after))


def _mask_of(req: CachedRequest, words: int) -> torch.Tensor:
    row = torch.zeros((1, words), dtype=torch.int32)
    req.matcher.fill_bitmask(row, 0)
    return row[0]


def test_the_walk_fills_each_positions_mask_and_stops_where_the_grammar_does(compiled):
    _, tok, vocab = compiled
    words = -(-vocab // 32)
    ids = tok.encode('{"a": 1}', add_special_tokens=False)
    eos = tok.eos_token_id
    req = _request(compiled, Constraint(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                              "required": ["a"], "additionalProperties": False}))
    start = _mask_of(req, words)
    usable, mask = draft_masks([req], [ids], words, failed := {})
    assert usable == [len(ids)] and not failed
    assert torch.equal(mask[0], start)  # position 0: the grammar's start, and the matcher is back there
    assert torch.equal(_mask_of(req, words), start)
    for p, t in enumerate(ids):  # position p + 1: the state after ids[:p + 1]
        assert req.matcher.accept_token(t)
        assert torch.equal(mask[p + 1], _mask_of(req, words)), p
    req.matcher.rollback(len(ids))
    # a draft the grammar refuses stops the walk there; so does the one that would complete it
    bad = tok.encode("x", add_special_tokens=False)
    assert draft_masks([req], [ids[:2] + bad + ids[2:]], words, {})[0] == [2]
    assert draft_masks([req], [[*ids, eos, eos]], words, {})[0] == [len(ids)]
    assert torch.equal(_mask_of(req, words), start)


def test_the_walk_is_free_before_the_after_tokens_and_governed_after(compiled):
    _, tok, vocab = compiled
    words = -(-vocab // 32)
    marker = tok.encode(" Answer:", add_special_tokens=False)
    red = tok.encode("red", add_special_tokens=False)
    req = _request(compiled, Constraint(choice=["red", "blue"]), after=marker)
    start = _mask_of(req, words)
    free = tok.encode(" maybe", add_special_tokens=False)
    drafts = [*free, *marker, *red, tok.eos_token_id]
    usable, mask = draft_masks([req], [drafts], words, {})
    reasoning = len(free) + len(marker)
    assert (mask[:reasoning] == -1).all()  # free positions, including the marker's own
    assert torch.equal(mask[reasoning], start)  # the first after the marker: the grammar's start
    assert usable == [len(drafts) - 1]  # (the stop token would complete the grammar)
    assert torch.equal(_mask_of(req, words), start)
    for t in red:
        assert req.matcher.accept_token(t)
    assert torch.equal(mask[reasoning + len(red)], _mask_of(req, words))  # after "red": only the stop token

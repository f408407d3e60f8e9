"""Structured output under tensor parallelism (issue 56): SmolLM2 over 3 CPU ranks (its 9
heads and 3 KV heads) gives the one-process engine's tokens for JSON-schema, regex, choice and
EBNF constraints mixed with an unconstrained request, greedy and seeded; every rank walks its
own matchers from the grammar text the executor sends (`engine/tp_grammars.py`)."""

from __future__ import annotations

import json
import re

import jsonschema

from pagedserve import LLM, SamplingParams
from pagedserve.engine.scheduler import NewRequestData, SchedulerOutput
from pagedserve.engine.tp_grammars import GrammarReceiver, GrammarSender, WireGrammar
from pagedserve.structured.params import StructuredOutputsParams as Constraint

PAIR = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}
PROMPTS = ["Two numbers as a JSON array:", "A phone number:", "Pick a colour:", "Laugh:",
           "The capital of France is"]


def _params(**kw) -> list[SamplingParams]:
    constraints = [Constraint(json=PAIR), Constraint(regex=r"\d{3}-\d{4}"),
                   Constraint(choice=["red", "green", "dark blue"]), Constraint(grammar='root ::= "ha" ("ha")* "!"'),
                   None]
    return [SamplingParams(max_tokens=24, structured_outputs=c, **kw) for c in constraints]


def test_constrained_requests_over_three_ranks_give_the_one_process_tokens():
    kw = dict(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory=16 << 20)
    one = LLM(**kw)
    split = LLM(tensor_parallel_size=3, **kw)
    try:
        for sampling in (dict(temperature=0), dict(temperature=1.0, seed=11)):
            want = one.generate(PROMPTS, _params(**sampling), use_tqdm=False)
            got = split.generate(PROMPTS, _params(**sampling), use_tqdm=False)
            assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
            texts = [o.outputs[0].text for o in got]
            assert all(o.outputs[0].finish_reason == "stop" for o in got[:4]), got
            jsonschema.validate(json.loads(texts[0]), PAIR)
            assert re.fullmatch(r"\d{3}-\d{4}", texts[1])
            assert texts[2] in ("red", "green", "dark blue")
            assert re.fullmatch(r"ha(ha)*!", texts[3])
        split.engine.kv.check_integrity(expect_all_free=True)
    finally:
        split.close()


def test_a_grammar_crosses_as_text_and_the_vocabulary_once():
    """The sender leaves the core's own step alone, sends the vocabulary with the first
    grammar only, and the receiver's grammar walks like the original."""
    from pagedserve.models.source import load_tokenizer
    from pagedserve.structured.xgrammar_backend import XGrammarBackend

    llm = LLM(dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20)
    tok = load_tokenizer(llm.engine.source, llm.engine.model_config, None)
    backend = XGrammarBackend(tok.hf, llm.engine.model_config.vocab_size, llm.engine.model_config.eos_token_ids)
    grammar = backend.compile(Constraint(regex=r"ab+"))
    outs = [SchedulerOutput(new_requests=[NewRequestData(f"r{i}", [1], None, grammar),
                                          NewRequestData(f"u{i}", [1], None)]) for i in range(2)]
    sender, receiver = GrammarSender(), GrammarReceiver()
    sent = [sender.outbound(o) for o in outs]
    assert [n.grammar for o in outs for n in o.new_requests] == [grammar, None, grammar, None]
    wires = [o.new_requests[0].grammar for o in sent]
    assert all(isinstance(w, WireGrammar) for w in wires)
    assert wires[0].vocabulary is not None and wires[1].vocabulary is None
    for o in sent:
        loaded = receiver.inbound(o).new_requests[0].grammar
        m, ref = loaded.matcher(), grammar.matcher()
        ids = tok.hf.encode("abb", add_special_tokens=False)
        assert [m.accept_token(t) for t in ids] == [ref.accept_token(t) for t in ids] == [True] * len(ids)
    none = SchedulerOutput(new_requests=[NewRequestData("x", [1], None)])
    assert sender.outbound(none) is none

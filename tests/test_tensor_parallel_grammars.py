"""Structured output under tensor parallelism (issue 56): SmolLM2 over 3 CPU ranks (its 9
heads and 3 KV heads) gives the one-process engine's tokens for JSON-schema, regex, choice and
EBNF constraints mixed with an unconstrained request, greedy and seeded; every rank walks its
own matchers, compiled from the constraint each new request carries (`structured/compiler.py`)."""

from __future__ import annotations

import json
import pickle
import re

import jsonschema

from pagedserve import LLM, SamplingParams
from pagedserve.engine.scheduler import NewRequestData, SchedulerOutput
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


def test_a_constraint_crosses_as_plain_data_and_each_worker_has_its_grammar():
    """A step carries a new request's constraint, not a compiled grammar: it pickles as it is
    (what a rank receives). A rank compiles its own grammar from it (`GrammarCompiler.for_model`),
    which walks like the core's; the in-process worker takes the core's compiler, no second one."""
    from pagedserve.models.source import load_tokenizer
    from pagedserve.structured.compiler import GrammarCompiler

    llm = LLM(dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20)
    engine = llm.engine
    regex = Constraint(regex=r"ab+")
    params = SamplingParams(max_tokens=4, structured_outputs=regex)
    llm.generate(["x"], params, use_tqdm=False)
    assert engine.executor.worker.grammar_compiler is engine._grammars  # shared in process
    out = SchedulerOutput(new_requests=[NewRequestData("r", [1, 2], params, [0, 1])])
    sent = pickle.loads(pickle.dumps(out))
    assert sent.new_requests[0].sampling_params.structured_outputs == regex
    assert sent.new_requests[0].block_ids == [0, 1]
    rank = GrammarCompiler.for_model(engine.source, engine.model_config)  # (a rank's own)
    mine, core = rank.get(regex).matcher(), engine._grammars.get(regex).matcher()
    tok = load_tokenizer(engine.source, engine.model_config, None)
    ids = tok.hf.encode("abbc", add_special_tokens=False)
    walked = [mine.accept_token(t) for t in ids]
    assert walked == [core.accept_token(t) for t in ids] and walked[0] and not all(walked)  # ("c" refused)
    assert rank.get(regex) is rank.get(regex)  # (compiled once)
    rank.shutdown()

"""Structured output on the real SmolLM2 engine (CPU): JSON schemas, JSON objects, regexes,
choices and EBNF grammars through xgrammar; a constrained request leaves the others' tokens
unchanged; a bad constraint fails its own request with a message naming the problem; grammar
state survives preemption and recompute."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.structured.params import StructuredOutputsParams as Constraint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
PAIR = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", max_model_len=512, max_num_seqs=8, kv_cache_memory=64 << 20)


def constrained(c: Constraint, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 80, **kw}, structured_outputs=c)


def test_json_schema_outputs_validate(llm):
    """Nested objects, enums, bounded arrays and required fields; greedy, and n=2 seeded samples."""
    outs = llm.chat([chat("Describe a user of a web site as JSON."), chat("Two numbers as a JSON array.")],
                    [constrained(Constraint(json=PERSON), max_tokens=120), constrained(Constraint(json=PAIR))],
                    use_tqdm=False)
    for out, schema in zip(outs, (PERSON, PAIR)):
        o = out.outputs[0]
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), schema)
    sampled = llm.chat(chat("Describe a user as JSON."),
                       constrained(Constraint(json=json.dumps(PERSON)), temperature=1.0, seed=7, n=2,
                                   max_tokens=120), use_tqdm=False)[0]
    assert len(sampled.outputs) == 2
    for o in sampled.outputs:
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), PERSON)


def test_choice_regex_grammar_and_any_json_object(llm):
    outs = llm.chat(
        [chat("Pick a colour."), chat("A phone number?"), chat("Laugh."), chat("Any JSON, please.")],
        [constrained(Constraint(choice=["red", "green", "dark blue"])),
         constrained(Constraint(regex=r"\d{3}-\d{4}")),
         constrained(Constraint(grammar='root ::= "ha" ("ha")* "!"')),
         constrained(Constraint(json_object=True), max_tokens=60)],
        use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in ("red", "green", "dark blue")
    assert re.fullmatch(r"\d{3}-\d{4}", texts[1])
    assert re.fullmatch(r"ha(ha)*!", texts[2])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:3])
    if outs[3].outputs[0].finish_reason == "stop":  # (a long object may reach max_tokens)
        assert isinstance(json.loads(texts[3]), dict)
    else:
        assert texts[3].startswith("{")


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(llm):
    out = llm.generate("Colour:", constrained(Constraint(choice=["red", "blue"]), ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("red", "blue") and out.finish_reason == "stop"
    assert len(out.token_ids) < 80


def test_the_grammar_starts_after_its_after_tokens(llm):
    """The end of reasoning (`after_tokens`) opens the grammar: before it the output is free.
    logit_bias forces a token that no choice holds as the first one; the grammar then takes
    over (it never allows that token), so the output is that token, then a choice."""
    tok = llm.get_tokenizer()
    marker = tok.encode(" Note", add_special_tokens=False)
    assert len(marker) == 1
    bias = {marker[0]: 100.0}
    choice = Constraint(choice=["red", "blue"], after_tokens=tuple(marker))
    out = llm.generate("Colour:", constrained(choice, logit_bias=bias), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == marker[0] and out.text in (" Notered", " Noteblue"), out
    assert out.finish_reason == "stop"
    # without after_tokens the grammar applies from the first token: the bias cannot win
    plain = llm.generate("Colour:", constrained(Constraint(choice=["red", "blue"]), logit_bias=bias),
                         use_tqdm=False)[0].outputs[0]
    assert plain.text in ("red", "blue")


def test_a_constrained_request_leaves_the_others_token_for_token(llm):
    free = SamplingParams(temperature=0, max_tokens=24)
    question = chat("What is the capital of France?")
    alone = llm.chat(question, free, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.chat([chat("Pick a colour."), question, chat("A JSON pair.")],
                     [constrained(Constraint(choice=["red", "green"])), free, constrained(Constraint(json=PAIR))],
                     use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    assert mixed[0].outputs[0].text in ("red", "green")


@pytest.mark.parametrize("constraint, message", [
    (Constraint(regex="(ab"), "the regex cannot be compiled: Regex parsing error"),
    (Constraint(grammar="root ::= "), "the grammar cannot be compiled: EBNF parser error"),
    (Constraint(json={"type": "nonsense"}), "the JSON schema cannot be compiled: Unsupported type"),
])
def test_a_bad_constraint_fails_only_its_own_request(llm, constraint, message, caplog):
    free = SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate(["The sky is", "Hello"], [constrained(constraint), free], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and not outs[0].outputs[0].token_ids
    assert message in caplog.text
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 8
    llm.engine.kv.check_integrity(expect_all_free=True)


@pytest.mark.parametrize("fault, message", [
    ("fill", "its grammar failed: RuntimeError: a broken grammar"),
    ("accept", "its grammar refused the sampled token(s)"),
])
def test_a_grammar_that_breaks_mid_output_fails_only_its_own_request(llm, monkeypatch, caplog, fault, message):
    """A grammar whose mask fill raises, or that refuses a token its own mask allowed, from
    its fourth step on: that request ends with an error naming it, the free request beside it
    gives its solo tokens, and no block stays held."""
    from pagedserve.structured import xgrammar_backend as xb

    broken = "7[0-9]{30}"  # (this test's own regex: only its matchers break)
    compile_, matcher_ = xb.XGrammarBackend.compile, xb.XGrammar.matcher
    fill_, accept_ = xb.XGrammarMatcher.fill_bitmask, xb.XGrammarMatcher.accept_tokens.__func__

    def compile(self, spec):
        grammar = compile_(self, spec)
        grammar.breaks = spec.kind == "regex" and spec.regex == broken
        return grammar

    def matcher(self):
        m = matcher_(self)
        m.breaks, m.calls = getattr(self, "breaks", False), 0
        return m

    def fill_bitmask(self, bitmask, row):
        self.calls += 1
        if fault == "fill" and self.breaks and self.calls > 3:
            raise RuntimeError("a broken grammar")
        fill_(self, bitmask, row)

    def accept_tokens(cls, matchers, token_ids):
        oks = accept_(cls, matchers, token_ids)
        return [ok and not (fault == "accept" and m.breaks and m.calls > 3) for m, ok in zip(matchers, oks)]

    monkeypatch.setattr(xb.XGrammarBackend, "compile", compile)
    monkeypatch.setattr(xb.XGrammar, "matcher", matcher)
    monkeypatch.setattr(xb.XGrammarMatcher, "fill_bitmask", fill_bitmask)
    monkeypatch.setattr(xb.XGrammarMatcher, "fill_bitmasks",
                        classmethod(lambda cls, ms, mask, rows: [m.fill_bitmask(mask, r) for m, r in zip(ms, rows)]))
    monkeypatch.setattr(xb.XGrammarMatcher, "accept_tokens", classmethod(accept_tokens))
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate("The sky is", free, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(["A long number:", "The sky is"], [constrained(Constraint(regex=broken)), free],
                        use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and len(outs[0].outputs[0].token_ids) < 8
    assert message in caplog.text
    assert outs[1].outputs[0].token_ids == alone
    llm.engine.kv.check_integrity(expect_all_free=True)
    # the same constraint, unbroken, runs its whole length
    monkeypatch.undo()
    whole = llm.generate("A long number:", constrained(Constraint(regex=broken)), use_tqdm=False)[0].outputs[0]
    assert whole.finish_reason == "stop" and re.fullmatch(broken, whole.text)


def test_grammar_state_survives_preemption_and_recompute():
    """A KV cache of 12 blocks of 16 tokens holds three 60-token prompts: as they grow past 64
    tokens, mid-way through their JSON, the newest are preempted and recomputed (their grammar
    state stays with the worker), and every output is exactly the solo one."""
    block_bytes = 16 * 30 * 2 * 3 * 64 * 4  # SmolLM2 in fp32: 30 layers, K and V, 3 heads x 64
    small = LLM(dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4,
                kv_cache_memory=12 * block_bytes, enable_prefix_caching=False)
    assert small.engine.kv.num_blocks == 12
    tok = small.get_tokenizer()
    prompts = [tok.encode(f"List {i}: here are two numbers as a JSON array. " * 8)[:60] for i in range(4)]
    params = constrained(Constraint(json=PAIR), max_tokens=20)
    solo = [small.generate(p, params, use_tqdm=False)[0].outputs[0].text for p in prompts]
    assert small.engine.scheduler.num_preemptions == 0
    together = [o.outputs[0].text for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.engine.scheduler.num_preemptions > 0
    assert together == solo
    for text in together:
        jsonschema.validate(json.loads(text), PAIR)


def test_constraints_validate_and_share_compiled_grammars():
    from pagedserve.structured.compiler import GrammarCompiler

    with pytest.raises(ValueError, match="exactly one"):
        Constraint(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        Constraint(json="{")
    with pytest.raises(ValueError, match="choice"):
        Constraint(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    built = []

    class Backend:
        def compile(self, spec):
            return spec.key()

    compiler = GrammarCompiler(lambda: built.append(1) or Backend())
    a = compiler.submit(Constraint(json={"b": 1, "a": 2}))
    assert compiler.submit(Constraint(json='{"a": 2, "b": 1}')) is a  # same schema, one compile
    assert a.result() == ("json", '{"a": 2, "b": 1}') and built == [1]
    compiler.shutdown()

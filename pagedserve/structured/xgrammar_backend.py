"""The xgrammar backend: compiles constraints for one tokenizer into xgrammar grammars; each
request walks its grammar with an xgrammar matcher (token bitmasks computed in C++)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import xgrammar as xgr

from pagedserve.structured.backend import Grammar, GrammarError, GrammarMatcher, StructuredBackend
from pagedserve.structured.params import StructuredOutputsParams

_WHAT = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex",
         "choice": "choice", "grammar": "grammar"}


class XGrammarMatcher(GrammarMatcher):
    # Every xgrammar call releases the GIL, and taking it back can wait for another thread's
    # turn: a step's rows go through one call each way (one thread; more lost on the H200 host).
    _batch: xgr.BatchGrammarMatcher | None = None

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._m = xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    @classmethod
    def fill_bitmasks(cls, matchers: list[GrammarMatcher], bitmask: Any, rows: list[int]) -> None:
        if cls._batch is None:
            cls._batch = xgr.BatchGrammarMatcher(max_threads=1)
        cls._batch.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask, rows)

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    @classmethod
    def accept_tokens(cls, matchers: list[GrammarMatcher], token_ids: list[int]) -> list[bool]:
        return xgr.BatchGrammarMatcher.batch_accept_token([m._m for m in matchers], token_ids)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class XGrammar(Grammar):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def matcher(self) -> GrammarMatcher:
        return XGrammarMatcher(self.compiled)


class XGrammarBackend(StructuredBackend):
    """`hf_tokenizer`: the model's Hugging Face tokenizer; `vocab_size`: the width of the
    model's logits (may exceed the tokenizer's vocabulary); `stop_token_ids`: the model's EOS
    ids, which end a complete grammar."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        c = self._compiler
        try:
            if spec.kind == "json":
                # Compact JSON: with free whitespace a small model can loop on spaces forever.
                compiled = c.compile_json_schema(json.dumps(spec.json), any_whitespace=False)
            elif spec.kind == "json_object":
                compiled = c.compile_builtin_json_grammar()
            elif spec.kind == "regex":
                compiled = c.compile_regex(spec.regex)
            elif spec.kind == "choice":
                alternatives = " | ".join(json.dumps(choice) for choice in spec.choice)
                compiled = c.compile_grammar(f"root ::= {alternatives}")
            else:
                compiled = c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors for bad input
            # xgrammar's messages start "[hh:mm:ss] /path/file.cc:line: "
            message = re.sub(r"^\[[\d:]+\] \S+: ", "", str(e).strip())
            raise GrammarError(f"the {_WHAT[spec.kind]} cannot be compiled: {message}") from None
        return XGrammar(compiled)

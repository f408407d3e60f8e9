"""Structured-output grammars on their way to tensor-parallel ranks.

Every rank keeps its own grammar matchers: the ranks sample the same tokens from the same
gathered logits, so their matchers walk in step and each fills the same bitmask. A compiled
grammar does not pickle, so the executor sends each new request's grammar as text
(`Grammar.to_wire`), with the tokenizer's vocabulary once, and each rank loads it back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedserve.engine.scheduler import SchedulerOutput
from pagedserve.structured.backend import Grammar


@dataclass(frozen=True)
class WireGrammar:
    """A compiled grammar as text; the first one sent also carries the vocabulary."""

    text: str
    vocabulary: str | None = None


class GrammarSender:
    """The executor's side: grammars out of a step's new requests, into text."""

    def __init__(self) -> None:
        self._vocabulary_sent = False

    def outbound(self, out: SchedulerOutput) -> SchedulerOutput:
        """`out` with each new request's Grammar replaced by its WireGrammar (`out` itself
        when no new request has one). Every rank receives what this returns."""
        if all(n.grammar is None for n in out.new_requests):
            return out
        return replace(out, new_requests=[
            n if n.grammar is None else replace(n, grammar=self._wire(n.grammar))
            for n in out.new_requests])

    def _wire(self, grammar: Grammar) -> WireGrammar:
        vocabulary = None if self._vocabulary_sent else grammar.vocabulary_to_wire()
        self._vocabulary_sent = True
        return WireGrammar(grammar.to_wire(), vocabulary)


class GrammarReceiver:
    """A rank's side: WireGrammars back into Grammars."""

    def __init__(self) -> None:
        self._loader = None  # XGrammarLoader, from the first grammar's vocabulary

    def inbound(self, out: SchedulerOutput) -> SchedulerOutput:
        """`out` with each WireGrammar loaded back (in place: the rank owns its copy)."""
        for n in out.new_requests:
            if isinstance(n.grammar, WireGrammar):
                n.grammar = self._load(n.grammar)
        return out

    def _load(self, wire: WireGrammar) -> Grammar:
        if wire.vocabulary is not None:
            from pagedserve.structured.xgrammar_backend import XGrammarLoader

            self._loader = XGrammarLoader(wire.vocabulary)
        if self._loader is None:
            raise RuntimeError("a grammar arrived before the vocabulary it needs")
        return self._loader.load(wire.text)

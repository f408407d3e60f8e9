"""What the worker keeps about each request between its steps (torch only for its seeded
generator)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.backend import GrammarMatcher


@dataclass
class CachedRequest:
    """What the worker keeps about a request between its steps: its prompt and parameters
    (from `NewRequestData`), its known tokens (prompt, then every sampled token once
    collected) and its seeded generator."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    token_ids: list[int]
    generator: torch.Generator | None = None
    matcher: GrammarMatcher | None = None  # its place in its structured-output grammar
    # token ids the output must reach before the grammar applies (the end of reasoning)
    grammar_after: tuple[int, ...] = ()
    grammar_done: bool = False  # its grammar is complete (it accepted its stop token)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def constrained(self) -> bool:
        """Its grammar decides its next token (it has one, and any reasoning before it ended)."""
        return self.matcher is not None and not self.grammar_after

    def append(self, new: list[int]) -> list[int]:
        """Append sampled tokens; returns those its grammar governs, in order, for the grammar
        to accept (`GrammarSteps`). A governed stop token completes the grammar: its mask
        allows a stop token only where the grammar can end."""
        governed = []
        for t in new:
            if self.constrained:
                governed.append(t)
            self.token_ids.append(t)
            after = self.grammar_after
            if after and tuple(self.token_ids[-len(after):]) == after \
                    and len(self.token_ids) - len(self.prompt_token_ids) >= len(after):
                self.grammar_after = ()  # the reasoning ended: the grammar applies from here
        if governed and self.matcher.is_stop_token(governed[-1]):
            self.grammar_done = True
        return governed

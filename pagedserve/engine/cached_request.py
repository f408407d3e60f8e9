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

    def accept(self, new: list[int], grammar_took_first: bool = False) -> bool:
        """Append sampled tokens, advancing the grammar past those it governs; False if the
        grammar refuses one (the request then fails: the tokens after it are dropped).
        `grammar_took_first`: the grammar has already accepted new[0] (in a batch call)."""
        for i, t in enumerate(new):
            if self.constrained and not (i == 0 and grammar_took_first) \
                    and not self.matcher.accept_token(t):
                return False
            self.token_ids.append(t)
            after = self.grammar_after
            if after and tuple(self.token_ids[-len(after):]) == after \
                    and len(self.token_ids) - len(self.prompt_token_ids) >= len(after):
                self.grammar_after = ()  # the reasoning ended: the grammar applies from here
        self.grammar_done = self.constrained and self.matcher.is_terminated()
        return True

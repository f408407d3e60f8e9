"""Fault injection for chaos tests (torch-free).

`pagedserve serve --inject-faults SPEC` (a hidden flag) makes chosen requests fail at a chosen
place, so tests can show that the failure stays with that request (or that step) against a
real server. A request is chosen by a token id in its prompt: a test sends a token-id prompt
holding the trigger id, every other request runs normally. SPEC is a comma-separated list of
PLACE=TOKEN_ID with PLACE one of:

- `output`: the HTTP process raises while it handles this request's output (detokenizer side);
- `request`: the engine core raises while it turns this request's sampled token into an output
  (the per-request part of a step: stop checks, logprobs);
- `step`: the engine core raises inside a whole step that holds this request.

The plan is parsed once at start-up and passed down; nothing reads it from the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACES = ("output", "request", "step")


class InjectedFault(RuntimeError):
    """The exception an injected fault raises."""


@dataclass(frozen=True)
class FaultPlan:
    """Which prompt token id triggers a fault at each place (None: no fault there)."""

    output: int | None = None
    request: int | None = None
    step: int | None = None

    @classmethod
    def parse(cls, spec: str | None) -> FaultPlan:
        """`"output=7,step=9"` -> FaultPlan(output=7, step=9); ValueError names a bad part."""
        if not spec:
            return cls()
        found: dict[str, int] = {}
        for part in spec.split(","):
            place, sep, value = part.strip().partition("=")
            if not sep or place not in PLACES or not value.strip().isdigit():
                raise ValueError(f"--inject-faults: {part!r} is not PLACE=TOKEN_ID with PLACE one "
                                 f"of {', '.join(PLACES)}")
            found[place] = int(value)
        return cls(**found)

    @property
    def active(self) -> bool:
        return any(getattr(self, p) is not None for p in PLACES)

    def places_for(self, prompt_ids: list[int]) -> frozenset[str]:
        """The places where a request with these prompt ids fails (empty for almost all)."""
        if not self.active:
            return frozenset()
        ids = set(prompt_ids)
        return frozenset(p for p in PLACES if getattr(self, p) in ids)


def fail(place: str, request_id: str) -> None:
    """Raise the injected fault of `place` for `request_id`."""
    raise InjectedFault(f"injected fault at {place!r} for request {request_id}")

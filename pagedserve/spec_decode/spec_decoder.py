"""Speculative decoding as the model runner sees it: one object the worker builds and hands to
the runner, with a part in each of the step's stages.

- before the forward pass, `plan`: the step's verification inputs (its requests that carry
  drafts, copied to the device in one transfer), or None for a step without drafts;
- after the forward pass is launched, `mirror`: the draft model (if any) runs the same step,
  for its own KV cache;
- after the logits, `verify`: the drafted rows verified apart, the other rows left to the
  sampler;
- when the step is read back, `read_results`: each verified request's emitted tokens.

Built without a speculative config it plans nothing, so a step without drafts never reaches
the other three."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.cached_request import CachedRequest
from pagedserve.engine.input_batch import StepArrays
from pagedserve.engine.scheduler import ScheduledChunk
from pagedserve.engine.step_handle import StepHandle
from pagedserve.layers.sampler import Sampler
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.draft_grammar import draft_masks
from pagedserve.spec_decode.draft_model import DraftRunner
from pagedserve.spec_decode.verify import VerifyBatch, verify_drafts


def token_logprobs(lp: list[float], ids: list[int], k: int, rank: int
                   ) -> tuple[float, int, list[tuple[int, float]]]:
    """(the token's logprob, its rank, [(id, logprob) of the top k]) from one row of
    `Sampler.token_logprobs`."""
    return lp[0], rank, list(zip(ids[1 : 1 + k], lp[1 : 1 + k]))


@dataclass
class VerifyPlan:
    """A step's verification, prepared before its forward pass."""

    batch: VerifyBatch  # the device inputs
    spec_rows: list[int]  # chunk rows of the requests with drafts, in verify order
    plain_rows: list[int]  # chunk rows of the other requests that sample


class SpecDecoder:
    """The step's speculative parts (see the module's docstring). `drafter`: the draft model,
    which runs every step too (its KV); None for n-gram drafts or no speculation."""

    def __init__(self, config: SpeculativeConfig | None = None, drafter: DraftRunner | None = None) -> None:
        self.drafter = drafter
        self.force_accept = bool(config and config.force_accept)
        # tokens a sequence verifies in a step with all its drafts (0: no speculation)
        self.verify_len = config.num_speculative_tokens + 1 if config else 0

    def plan(self, a: StepArrays, chunks: list[ScheduledChunk], states: list[CachedRequest],
             eos_token_ids: tuple[int, ...] | list[int], vocab_size: int, device: torch.device,
             failed: dict[str, str]) -> VerifyPlan | None:
        """The verification inputs of a step with drafts (None without); a request whose
        grammar raises while walking its drafts goes into `failed` (request id -> why)."""
        if a.num_drafts is None:
            return None
        spec = [a.sample_rows[i] for i, d in enumerate(a.num_drafts) if d]
        plain = [a.sample_rows[i] for i, d in enumerate(a.num_drafts) if not d]
        drafts = [chunks[i].draft_token_ids for i in spec]
        usable = mask = None
        if any(states[i].matcher is not None for i in spec):  # masks from the drafts' grammar walks
            usable, mask = draft_masks([states[i] for i in spec], drafts, -(-vocab_size // 32), failed)
        vb = VerifyBatch.build(
            [states[i].sampling_params for i in spec], drafts,
            [chunks[i].start + 1 - len(states[i].prompt_token_ids) for i in spec], a.num_drafts,
            vocab_size, eos_token_ids, device,
            [(states[i].prompt_token_ids, states[i].output_token_ids) for i in spec], usable, mask,
            [states[i].generator for i in spec])
        return VerifyPlan(vb, spec, plain)

    def mirror(self, a: StepArrays, prev_tokens: torch.Tensor | None) -> None:
        """The draft model runs the step just launched (no-op without one)."""
        if self.drafter is not None:
            self.drafter.mirror(a, prev_tokens)

    def verify(self, sampler: Sampler, logits: torch.Tensor, plan: VerifyPlan, handle: StepHandle,
               states: list[CachedRequest]) -> tuple[torch.Tensor, list[int]]:
        """Verify the drafted rows of `logits` [R, vocab] into `handle`; returns the logits
        of the other sampling rows [R1, vocab] and their chunk rows."""
        vb = plan.batch
        handle.spec_reqs, handle.spec_counts = [states[i] for i in plan.spec_rows], vb.counts
        handle.spec_host = verify_drafts(sampler, logits.index_select(0, vb.rows), vb, self.force_accept)
        return logits.index_select(0, vb.plain_rows), plan.plain_rows

    @staticmethod
    def read_results(handle: StepHandle, token_ids: dict, logprobs: dict, non_finite: list) -> None:
        """The verified requests' new tokens (and logprobs, one per token) into the dicts."""
        tokens_t, lp_t, ids_t, ranks_t = handle.spec_host
        lp, lp_ids, ranks = ((lp_t.tolist(), ids_t.tolist(), ranks_t.tolist()) if lp_t is not None
                             else (None, None, None))
        at = 0  # the request's first row
        for r, row, count in zip(handle.spec_reqs, tokens_t.tolist(), handle.spec_counts):
            if row[0] < 0:
                non_finite.append(r.request_id)
            else:
                new = token_ids[r.request_id] = [t for t in row if t >= 0]
                k = r.sampling_params.logprobs
                if k is not None:
                    logprobs[r.request_id] = [token_logprobs(lp[at + j], lp_ids[at + j], k, ranks[at + j])
                                              for j in range(len(new))]
            at += count

"""Drafts of requests with a grammar (structured output): the allowed-token mask of every
verified position, and how many of the drafts can be verified.

A verified position's token is drawn (or, greedy, taken) under the mask of the grammar's
state after the drafts before it, so a kept draft always follows the grammar and the
target's own token too. The worker walks each request's drafts through its matcher before
the step's forward pass, filling one mask row per position, then rolls the matcher back: the
tokens the step emits are accepted afterwards, as any step's are. The walk stops at the
first draft the grammar refuses (it could never be kept) and before a draft that would
complete the grammar (the grammar's last token is then drawn as the target's own token at
that position, so nothing follows it). Before the end of reasoning (`grammar_after`) a
position is free and its mask row is all ones; the grammar governs from the position after
the draft that ends the reasoning.
"""

from __future__ import annotations

import torch

from pagedserve.engine.cached_request import CachedRequest


def draft_masks(reqs: list[CachedRequest], drafts: list[list[int]], words: int,
                failed: dict[str, str]) -> tuple[list[int], torch.Tensor]:
    """For requests with drafts (in verify order, each with len(drafts) + 1 rows): how many
    drafts of each can be verified, and the mask [R, words] int32 (host; bit t of a row set
    = token t allowed; all ones where no grammar applies). A request whose grammar raises is
    put in `failed` (request id -> why) with no drafts and free rows."""
    mask = torch.full((sum(len(d) + 1 for d in drafts), words), -1, dtype=torch.int32)
    usable, row = [], 0
    for req, d in zip(reqs, drafts, strict=True):
        n = len(d)
        if req.matcher is not None:
            try:
                n = _walk(req, d, mask, row)
            except Exception as e:  # this request fails alone (`ModelRunner._results`)
                mask[row : row + len(d) + 1] = -1
                failed[req.request_id] = f"its grammar failed: {type(e).__name__}: {e}"[:500]
                n = 0
        usable.append(n)
        row += len(d) + 1
    return usable, mask


def _walk(req: CachedRequest, drafts: list[int], mask: torch.Tensor, row: int) -> int:
    """Fill rows row.. of `mask` for `req`'s positions; the number of drafts to verify."""
    matcher, after = req.matcher, req.grammar_after
    recent = req.token_ids[-len(after):] if after else []  # (the known tokens' tail)
    num_outputs = len(req.token_ids) - len(req.prompt_token_ids)
    accepted = 0
    try:
        for p in range(len(drafts) + 1):
            if not after:  # the grammar governs this position
                matcher.fill_bitmask(mask, row + p)
            if p == len(drafts):
                break
            token = drafts[p]
            if after:  # (the reasoning ends with the token sequence `after`: see CachedRequest.accept)
                recent = [*recent, token][-len(after):]
                if tuple(recent) == after and num_outputs + p + 1 >= len(after):
                    after = ()
            elif not matcher.accept_token(token):
                return p
            else:
                accepted += 1
                if matcher.is_terminated():
                    return p
        return len(drafts)
    finally:
        if accepted:
            matcher.rollback(accepted)

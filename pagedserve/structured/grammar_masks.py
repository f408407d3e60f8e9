"""A step's allowed-token bitmask from its rows' grammars, and the grammars that failed.

The mask is filled on the host, in a buffer kept from step to step (pinned on CUDA), and
copied to the device behind the step's forward pass; a grammar that raises fails its own
request alone (its row is left all ones, and the request is named in `failed`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pagedserve.structured.backend import fill_bitmasks


class ConstrainedRow(Protocol):
    """What the mask reads of a row's request (`engine/cached_request.py`)."""

    request_id: str
    matcher: object

    @property
    def constrained(self) -> bool: ...

    @property
    def grammar_done(self) -> bool: ...


class GrammarMasks:
    """Fills each step's bitmask; `failed` (request id -> why) collects the requests whose
    grammar raised, until the step's results are read back (`take_failure`)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.words = -(-vocab_size // 32)
        self.device = device
        self.failed: dict[str, str] = {}
        self._host: torch.Tensor | None = None  # [rows, words] int32
        self._copied: torch.cuda.Event | None = None  # its last copy to the device is done

    def take_failure(self, request_id: str) -> str | None:
        """Why the request's grammar failed (and forget it), or None."""
        return self.failed.pop(request_id, None)

    def fill(self, reqs: Sequence[ConstrainedRow]) -> torch.Tensor:
        """[N, words] int32 allowed-token bitmask on the device: each constrained row as its
        grammar allows next (its previous token already accepted), every other row all ones."""
        buf = self._host
        if buf is None or buf.shape[0] < len(reqs):
            buf = torch.empty((max(len(reqs), 64), self.words), dtype=torch.int32,
                              pin_memory=self.device.type == "cuda")
            self._host = buf
        elif self._copied is not None:
            self._copied.synchronize()  # the last step's copy out of it has finished
        mask = buf[: len(reqs)]
        # (a grammar complete with the previous token: that token ended its request, so its
        # row's token here will be dropped)
        rows = [i for i, r in enumerate(reqs) if r.constrained and not r.grammar_done]
        if len(rows) < len(reqs):  # (a grammar's fill writes its whole row)
            mask.fill_(-1)
        matchers = [reqs[i].matcher for i in rows]
        try:
            if matchers:
                fill_bitmasks(matchers, mask, rows)
        except Exception:  # find the rows that fail: each fails its own request alone
            for row, m in zip(rows, matchers):
                try:
                    m.fill_bitmask(mask, row)
                except Exception as e:
                    mask[row] = -1
                    self.failed[reqs[row].request_id] = f"its grammar failed: {type(e).__name__}: {e}"[:500]
        if self.device.type != "cuda":
            return mask.clone()
        device_mask = mask.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return device_mask

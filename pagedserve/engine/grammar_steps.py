"""Structured output's host work beside the model runner, on one worker thread: each grammar
accepts its request's sampled tokens, then fills its row of the next step's allowed-token
bitmask, while the engine loop goes on.

With async scheduling a step's mask needs the token of the step before it, which is known
only once that step ends on the GPU. The runner therefore, for a step k+1 with constrained
rows: launches its forward pass, reads step k's tokens back (waiting for the GPU), submits
[accept step k's tokens; fill step k+1's masks] here, and returns with step k+1's sampling
not yet launched. The engine core applies step k and schedules step k+2 meanwhile; the next
launch (or the read-back of step k+1) joins the thread, copies the mask to the device and
launches the sampling, ahead of step k+2's forward pass, which reads its tokens.

Every xgrammar call releases the GIL, and a job makes two (one batch accept, one batch fill),
so the thread runs beside the loop's Python. A request's grammar-done state is known on the
loop at once (a governed stop token completes its grammar); a token its grammar refuses
(possible only if the grammar disagrees with its own mask) fails the request at its next
step's read-back. Only the loop touches CUDA; the thread touches host tensors only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagedserve.engine.cached_request import CachedRequest


class GrammarSteps:
    """The grammars' pending work and the step mask buffer. `held`: the runner's requests by
    id (failures of requests it no longer holds are dropped)."""

    def __init__(self, vocab_size: int, device: torch.device, held: Mapping[str, CachedRequest]) -> None:
        self.words = -(-vocab_size // 32)
        self.device = device
        self._held = held
        self.failed: dict[str, str] = {}  # request id -> why its grammar failed (read back with its step)
        # cumulative seconds: the loop waiting for the previous step's tokens, the loop waiting
        # for the thread, and the thread's own work
        self.seconds = [0.0, 0.0, 0.0]
        self._pending: list[tuple[CachedRequest, list[int]]] = []  # tokens not yet accepted
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future | None = None  # -> (mask rows on the host | None, failures)
        self._host: torch.Tensor | None = None  # [rows, words] int32 (pinned on CUDA)
        self._copied: torch.cuda.Event | None = None  # its last copy to the device is done

    def to_accept(self, req: CachedRequest, tokens: list[int]) -> None:
        """`tokens` (sampled, governed by `req`'s grammar, in order) are for its grammar to
        accept with the next job."""
        if tokens:
            self._pending.append((req, tokens))

    def submit(self, reqs: list[CachedRequest]) -> None:
        """Start a job: the pending tokens, then the masks of a step whose sampling rows are
        `reqs` (`mask()` returns them)."""
        self._join()
        if self._copied is not None:  # the last mask's copy out of the buffer has finished
            self._copied.synchronize()
        n = len(reqs)
        if self._host is None or self._host.shape[0] < n:
            self._host = torch.empty((max(n, 64), self.words), dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
        # (a grammar complete with the previous token: that token ended its request, so its
        # row's token here will be dropped)
        rows = [i for i, r in enumerate(reqs) if r.constrained and not r.grammar_done]
        pending, self._pending = self._pending, []
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._job = self._pool.submit(self._work, pending, self._host[:n], rows,
                                      [reqs[i] for i in rows])

    def mask(self) -> torch.Tensor:
        """The last submitted step's mask [N, words] int32 on the device (waits for the job)."""
        host = self._join()
        assert host is not None, "no mask was submitted"
        if self.device.type != "cuda":
            return host.clone()
        device_mask = host.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return device_mask

    def flush(self) -> None:
        """Every grammar up to date here (before the loop walks matchers itself)."""
        self._join()
        pending, self._pending = self._pending, []
        self._merge(self._accept(pending))

    def _join(self) -> torch.Tensor | None:
        job, self._job = self._job, None
        if job is None:
            return None
        t0 = time.perf_counter()
        host, failures = job.result()
        self.seconds[1] += time.perf_counter() - t0
        self._merge(failures)
        return host

    def _merge(self, failures: dict[str, str]) -> None:
        self.failed.update((rid, why) for rid, why in failures.items() if rid in self._held)

    @torch.inference_mode()  # (the buffer is the runner's inference tensor)
    def _work(self, pending: list[tuple[CachedRequest, list[int]]], mask: torch.Tensor, rows: list[int],
              row_reqs: list[CachedRequest]) -> tuple[torch.Tensor, dict[str, str]]:
        """(On the thread.) Accept the pending tokens, then fill `mask`: each constrained row as
        its grammar allows next, every other row all ones."""
        t0 = time.perf_counter()
        failures = self._accept(pending)
        if len(rows) < mask.shape[0]:  # (a grammar's fill writes its whole row)
            mask.fill_(-1)
        matchers = [r.matcher for r in row_reqs]
        try:
            if matchers:
                type(matchers[0]).fill_bitmasks(matchers, mask, rows)
        except Exception:  # find the rows that fail: each fails its own request alone
            for row, req in zip(rows, row_reqs):
                try:
                    req.matcher.fill_bitmask(mask, row)
                except Exception as e:
                    mask[row] = -1
                    failures[req.request_id] = f"its grammar failed: {type(e).__name__}: {e}"[:500]
        self.seconds[2] += time.perf_counter() - t0
        return mask, failures

    @staticmethod
    def _accept(pending: list[tuple[CachedRequest, list[int]]]) -> dict[str, str]:
        """Each grammar accepts its request's tokens (the first of each in one call); the
        requests whose grammar refused one, with why."""
        failures: dict[str, str] = {}
        if not pending:
            return failures
        oks = type(pending[0][0].matcher).accept_tokens([r.matcher for r, _ in pending],
                                                        [tokens[0] for _, tokens in pending])
        for (req, tokens), ok in zip(pending, oks, strict=True):
            if not ok or not all(req.matcher.accept_token(t) for t in tokens[1:]):
                failures[req.request_id] = f"its grammar refused the sampled token(s) {tokens}"
        return failures

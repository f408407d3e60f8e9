"""Weight prefetch into L2 beside a batch-1 decode graph, paced by the matmuls' progress.

At batch 1 a decode step streams every weight once, but the device memory idles while the
small kernels between two matmuls run (norms, RoPE, attention: about a fifth of the step).
A `WeightPrefetcher` launches one small program on a side stream at the start of a captured
forward. It walks the skinny matmuls' weights in the order the forward multiplies by them,
and asks the L2 cache for the first `cap` bytes of weight j (`cp.async.bulk.prefetch.L2`)
once matmul j - `lead` has signalled: the skinny kernel's program `signal_at` bumps a
progress counter when it starts (`kernels/skinny_gemm.py`). So the next weight's first rows
come in while the small kernels run, and that matmul starts from L2.

The prefetch changes no result: it only moves bytes into the cache. The program spins on the
counter with volatile loads; it only waits for matmuls launched on the main stream, which do
not wait for it, so it cannot deadlock the step. After the last signal it re-arms the counter
to zero for the next replay.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton
import triton.language as tl

NCHUNK = 32  # prefetch requests per weight: one per thread of the program's single warp


@triton.jit
def _prefetch_kernel(
    ADDR, NBYTES,  # int64 [capacity]: weight j's address and the bytes to prefetch from it
    COUNT,  # int32 [1]: how many weights are listed
    PROGRESS,  # int32 [2]: signals so far (the skinny matmuls bump it), programs finished
    LEAD,  # prefetch weight j once matmul j - LEAD has signalled
    NCHUNK: tl.constexpr,
):
    """Program p of P asks for slice p of each weight's first NBYTES[j] bytes, in NCHUNK
    requests; the last program to finish re-arms both counters for the next replay."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n = tl.load(COUNT)
    chunk_ids = (pid * NCHUNK + tl.arange(0, NCHUNK)).to(tl.int64)  # [NCHUNK]
    for j in range(0, n):
        need = j - LEAD + 1  # signals that must have come in
        seen = tl.load(PROGRESS, volatile=True)
        while seen < need:
            seen = tl.load(PROGRESS, volatile=True)
        base = tl.load(ADDR + j)
        size = tl.load(NBYTES + j)
        per = NCHUNK * nprog * 16
        chunk = ((size + per - 1) // per) * 16  # bytes per request, a 16-byte multiple
        start = chunk_ids * chunk  # [NCHUNK]
        nbytes = tl.minimum(size - start, chunk)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base + start, nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    seen = tl.load(PROGRESS, volatile=True)
    while seen < n:
        seen = tl.load(PROGRESS, volatile=True)
    if tl.atomic_add(PROGRESS + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.store(PROGRESS, 0)
        tl.store(PROGRESS + 1, 0)


class PrefetchConfig(NamedTuple):
    """How far ahead and how much: prefetch the first `cap_mb` MB of weight j when matmul
    j - `lead` signals; `signal_at` in (0, 1] picks the signalling program as a fraction of
    the launch's programs (1.0: the last one to start); `programs` share the requests."""

    cap_mb: float = 16.0
    lead: int = 1
    signal_at: float = 1.0  # negative: -f signals as program f of the launch ends
    programs: int = 1  # programs sharing each weight's requests (each on its own multiprocessor)
    only: int = -1  # >= 0: prefetch only weights whose index in the forward is this modulo `period`
    period: int = 4
    max_batch: int = 1  # decode graphs of up to this many rows get the prefetch


_ACTIVE: WeightPrefetcher | None = None


def active() -> WeightPrefetcher | None:
    """The prefetcher recording the forward now running, if any (see `WeightPrefetcher.run`)."""
    return _ACTIVE


class WeightPrefetcher:
    """One per captured graph: its weight list, progress counter and side stream."""

    def __init__(self, device: torch.device, cfg: PrefetchConfig, capacity: int = 1024) -> None:
        self.cfg = cfg
        self.capacity = capacity
        self.addr = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.nbytes = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)
        self.progress = torch.zeros(2, dtype=torch.int32, device=device)
        self.stream = torch.cuda.Stream(device)
        self.weights: list[torch.Tensor] = []  # in the order the last forward used them
        self._recording: list[torch.Tensor] = []

    def signal(self, weight: torch.Tensor, num_programs: int) -> tuple[torch.Tensor, int]:
        """Called by the matmul about to launch on `weight` with `num_programs` programs:
        records it and returns (progress counter, index of the program that signals)."""
        if len(self._recording) >= self.capacity:
            raise RuntimeError(f"more than {self.capacity} weights in one forward")
        self._recording.append(weight)
        at = min(num_programs - 1, max(0, int(abs(self.cfg.signal_at) * num_programs) - 1))
        return self.progress[:1], (at if self.cfg.signal_at > 0 else -2 - at)

    @contextlib.contextmanager
    def run(self):
        """Around a forward: launch the prefetch program on the side stream, record the
        matmuls the forward launches, and join the side stream at the end. Eagerly (outside
        capture) the weight table is then filled from what was recorded; a capture must list
        the same weights as the eager run before it."""
        global _ACTIVE
        capturing = torch.cuda.is_current_stream_capturing()
        main = torch.cuda.current_stream()
        if not capturing:
            self.progress.zero_()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            _prefetch_kernel[(self.cfg.programs,)](self.addr, self.nbytes, self.count, self.progress, self.cfg.lead,
                                   NCHUNK=NCHUNK, num_warps=1)
        self._recording = []
        _ACTIVE = self
        try:
            yield
        finally:
            _ACTIVE = None
        main.wait_stream(self.stream)
        recorded, self._recording = self._recording, []
        if capturing:
            if [w.data_ptr() for w in recorded] != [w.data_ptr() for w in self.weights]:
                raise RuntimeError("the captured forward multiplies by other weights than the eager one")
        else:
            self._fill(recorded)

    def _fill(self, weights: list[torch.Tensor]) -> None:
        cap = int(self.cfg.cap_mb * 2**20)
        self.weights = weights
        n = len(weights)
        self.addr[:n].copy_(torch.tensor([w.data_ptr() for w in weights], dtype=torch.int64))
        sizes = [min(cap, w.numel() * w.element_size()) // 16 * 16
                 if self.cfg.only < 0 or i % self.cfg.period == self.cfg.only else 0
                 for i, w in enumerate(weights)]
        self.nbytes[:n].copy_(torch.tensor(sizes, dtype=torch.int64))
        self.count.fill_(n)


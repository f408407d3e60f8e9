"""Weight prefetch into L2 beside small-batch decode graphs, paced by the matmuls' progress.

At batch 1 a decode step streams every weight once, but the device memory idles while the
small kernels between two matmuls run (norms, RoPE, attention: about a fifth of the step),
and each matmul then starts from an empty pipeline. A `WeightPrefetcher` launches a few
one-warp programs on a side stream at the start of a captured forward. They walk the skinny
matmuls' weights in the order the forward multiplies by them and ask the L2 cache for the
first `cap_mb` MB of weight j (`cp.async.bulk.prefetch.L2`, one request per thread) as soon
as matmul j - 1 signals that it is nearly done: its program at fraction `signal_at` of the
launch bumps a progress counter as it ends (`kernels/skinny_gemm.py`). The next weight's first
rows then come in while the small kernels run, and that matmul starts from L2.

Measured on the H200 (`gpu_check.py --sections weight_prefetch`): 8 MB per weight, the
program at 90% signalling, 16 programs issuing; fewer programs issue too slowly, a later or
earlier signal or more bytes compete with the matmul still running.

The prefetch changes no result: it only moves bytes into the cache. The programs spin on the
counter with volatile loads and only wait for matmuls of the same forward, launched on the
main stream, which never wait for them: the step cannot deadlock. The last program to finish
re-arms the counters for the next replay.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton
import triton.language as tl

NCHUNK = 32  # prefetch requests per program and weight: one per thread of its single warp


@triton.jit
def _prefetch_kernel(
    ADDR, NBYTES,  # int64 [capacity]: weight j's address and the bytes to prefetch from it
    COUNT,  # int32 [1]: how many weights are listed
    PROGRESS,  # int32 [2]: signals so far (the skinny matmuls bump it), programs finished
    NCHUNK: tl.constexpr,
):
    """Program p of P asks for slice p of each weight's first NBYTES[j] bytes, once matmul
    j - 1 has signalled; the last program to finish re-arms both counters."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n = tl.load(COUNT)
    chunk_ids = (pid * NCHUNK + tl.arange(0, NCHUNK)).to(tl.int64)  # [NCHUNK]
    for j in range(0, n):
        seen = tl.load(PROGRESS, volatile=True)
        while seen < j:  # matmuls 0 .. j-1 have signalled
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
    """Prefetch the first `cap_mb` MB of weight j when the program at fraction `signal_at`
    of matmul j - 1's launch ends; `programs` share the requests; decode graphs of up to
    `max_batch` rows get the prefetch."""

    cap_mb: float = 8.0
    signal_at: float = 0.9
    programs: int = 16
    max_batch: int = 16


_ACTIVE: WeightPrefetcher | None = None


def active() -> WeightPrefetcher | None:
    """The prefetcher recording the forward now running, if any (see `WeightPrefetcher.run`)."""
    return _ACTIVE


class WeightPrefetcher:
    """One per captured graph: its weight list, progress counters and side stream."""

    def __init__(self, device: torch.device, cfg: PrefetchConfig, capacity: int = 4096) -> None:
        self.cfg = cfg
        self.capacity = capacity
        self.addr = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.nbytes = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)
        self.progress = torch.zeros(2, dtype=torch.int32, device=device)
        self.stream = torch.cuda.Stream(device)
        self.weights: list[torch.Tensor] = []  # in the order the last eager forward used them
        self._recording: list[torch.Tensor] = []

    def signal(self, weight: torch.Tensor, num_programs: int) -> tuple[torch.Tensor, int]:
        """Called by the matmul about to launch on `weight` with `num_programs` programs:
        records it and returns (progress counter, the program that signals as it ends)."""
        if len(self._recording) >= self.capacity:
            raise RuntimeError(f"more than {self.capacity} weights in one forward")
        self._recording.append(weight)
        at = min(num_programs - 1, max(0, round(self.cfg.signal_at * num_programs) - 1))
        return self.progress[:1], at

    @contextlib.contextmanager
    def run(self):
        """Around a forward: launch the prefetch programs on the side stream, record the
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
            _prefetch_kernel[(self.cfg.programs,)](self.addr, self.nbytes, self.count, self.progress,
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
            self.fill(recorded)

    def fill(self, weights: list[torch.Tensor]) -> None:
        """List `weights` (in forward order) as the ones to prefetch, `cap_mb` of each."""
        cap = int(self.cfg.cap_mb * 2**20)
        self.weights = weights
        n = len(weights)
        self.addr[:n].copy_(torch.tensor([w.data_ptr() for w in weights], dtype=torch.int64))
        sizes = [min(cap, w.numel() * w.element_size()) // 16 * 16 for w in weights]
        self.nbytes[:n].copy_(torch.tensor(sizes, dtype=torch.int64))
        self.count.fill_(n)

"""What every section of the GPU check shares: the results being gathered, the table printed
last, the `section` wrapper that keeps one failure from hiding the other results, and small
measuring helpers."""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch

# `python3 benchmarks/gpu_check.py` without PYTHONPATH=.: the working tree's pagedserve, which
# every module here imports after this one
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(1, _ROOT)

RESULTS: dict = {"sections": {}}
TABLE: list[tuple[str, str, str]] = []  # (check, value, verdict)
DEV = "cuda"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def record(name: str, value, ok: bool | None = None, fmt: str = "{:.3g}") -> None:
    shown = fmt.format(value) if isinstance(value, float) else str(value)
    TABLE.append((name, shown, "" if ok is None else ("ok" if ok else "FAIL")))
    print(f"{name}: {shown} {TABLE[-1][2]}", flush=True)  # progress, in case the run is cut short
    RESULTS.setdefault("checks", {})[name] = {"value": value, "ok": ok}


def section(fn):
    def run(*a, **k):
        t0 = time.perf_counter()
        try:
            fn(*a, **k)
            RESULTS["sections"][fn.__name__] = {"ok": True, "seconds": round(time.perf_counter() - t0, 1)}
        except Exception:
            tb = traceback.format_exc()
            print(tb, flush=True)
            RESULTS["sections"][fn.__name__] = {"ok": False, "error": tb[-2000:]}
            TABLE.append((fn.__name__, "exception", "FAIL"))
    return run


def graph_ms(fn) -> float:
    """Median time of one replay of a CUDA graph that runs fn once."""
    import triton.testing

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, return_mode="median")


def runner_of(engine):
    """An EngineCore's ModelRunner, in its in-process executor's worker (the one place the
    benchmarks look for it)."""
    return engine.executor.worker.runner


def decode_graph(runner, batch: int):
    """(key, captured graph) of the smallest decode graph for `batch` rows, with the step
    buffers holding an idle step of that key (every sequence empty, no K/V written): the
    buffers are shared by all keys, so whatever the last real step left there is not a
    valid input for another key."""
    key = next(k for k in runner.graphs.decode_keys if k.num_tokens >= batch)
    rows = runner.buffers.token_rows(key.num_tokens)  # [4, n]: ids, positions, slots, sources
    rows.zero_()
    rows[2:].fill_(-1)
    runner.buffers.seq.zero_()
    return key, runner.graphs.graphs[key]


def paged_step(q_lens, seq_lens, block_size, num_blocks, gen):
    from pagedserve.attention.testing import random_paged_step

    return random_paged_step(q_lens, seq_lens, block_size, num_blocks, gen, DEV)

"""The step trace's make-up counts and the summary of a trace (benchmarks/step_trace_summary.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from pagedserve.engine.scheduler import ScheduledChunk
from pagedserve.engine.step_trace import step_makeup

_spec = importlib.util.spec_from_file_location(
    "step_trace_summary", Path(__file__).parents[1] / "benchmarks" / "step_trace_summary.py")
summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary)


def test_step_makeup_counts_decodes_chunks_and_attention_pairs() -> None:
    chunks = [
        ScheduledChunk("a", start=12, num_tokens=1, samples=True, is_decode=True),  # decode, ctx 13
        ScheduledChunk("b", start=5, num_tokens=1, samples=True, is_decode=True),  # decode, ctx 6
        ScheduledChunk("c", start=0, num_tokens=4),  # first chunk: 1+2+3+4 pairs
        ScheduledChunk("c", start=4, num_tokens=4, samples=True),  # 4 x 4 earlier + 10
        ScheduledChunk("d", start=2, num_tokens=1, samples=True),  # a prompt's last token
    ]
    assert step_makeup(chunks) == {"decodes": 2, "decode_ctx": 19, "prefill_chunks": 3,
                                   "prefill_tokens": 9, "prefill_attn": 10 + 26 + 3}


def _step(t0: float, ms: float, decodes: int, prefill: int, ctx: int = 0) -> dict:
    return {"decodes": decodes, "decode_ctx": ctx, "prefill_chunks": int(prefill > 0),
            "prefill_tokens": prefill, "prefill_attn": prefill * prefill // 2, "graph": prefill == 0,
            "launch_ms": 0.5, "gpu_start": t0, "gpu_end": t0 + ms}


def test_summary_splits_at_long_gaps_and_sums_busy_idle_and_kinds() -> None:
    steps = [_step(0, 10, 0, 1024), _step(12, 5, 4, 0, ctx=4000), _step(17, 20, 4, 2048, ctx=4100),
             _step(5000, 3, 1, 0, ctx=100)]
    segments = summary.split(steps, gap_ms=1000)
    assert [len(s) for s in segments] == [3, 1]
    first = summary.summarize(segments[0])
    assert first["wall_ms"] == 37 and first["busy_ms"] == 35 and first["idle_ms"] == 2
    assert first["decode_tokens"] == 8 and first["prefill_tokens"] == 3072
    kinds = first["by_kind"]
    assert set(kinds) == {"prefill", "decode", "mixed"}
    assert kinds["mixed"]["ms_per_step"] == 20 and kinds["decode"]["graph_steps"] == 1
    assert first["fit"] is None  # three steps cannot fit five terms
    assert "segment 1: 1 steps" in summary.render([first, summary.summarize(segments[1])])


def test_fit_recovers_known_step_costs() -> None:
    rng = np.random.default_rng(0)
    steps, t = [], 0.0
    for _ in range(200):
        decodes, prefill = int(rng.integers(0, 256)), int(rng.integers(0, 8192))
        ctx = decodes * int(rng.integers(100, 2000))
        s = _step(t, 0.0, decodes, prefill, ctx)
        s["prefill_attn"] = int(rng.integers(0, 10**7))
        ms = 2.0 + 0.011 * prefill + 0.004 * decodes + 2e-5 * ctx + 3e-7 * s["prefill_attn"]
        s["gpu_end"] = t + ms
        steps.append(s)
        t += ms
    f = summary.summarize(steps)["fit"]
    assert f["rms_error_ms"] < 1e-6
    expected = {"steps": 2.0, "prefill_tokens": 0.011, "decodes": 0.004, "decode_ctx": 2e-5,
                "prefill_attn": 3e-7}
    for term, value in expected.items():
        assert f["coef"][term] == pytest.approx(value, rel=1e-6)

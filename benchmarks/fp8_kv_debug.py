"""Where the FP8 KV cache's graph and eager engines part (issue 26's open failure): the same
greedy run (Qwen3-4B preset, dummy weights) eager, with CUDA graphs, with decode graphs only,
without PDL and without the weight prefetch; prints each variant's first differing token
per prompt against eager, and whether any run produced non-finite logits (failed requests).

    python benchmarks/fp8_kv_debug.py [kv_cache_dtype]   (on a GPU)
    python benchmarks/fp8_kv_debug.py f16dot   (FP8 cache: the attention kernels' F16_DOT
        setting on and off, graphs against eager, and each against a float32 model's tokens)
"""

from __future__ import annotations

import gc
import os
import sys

import torch

from pagedserve import LLM, SamplingParams

PROMPTS = [[100 + i, 200 + i, 300 + i, 400 + i] * (1 + 40 * i) for i in range(6)] + [[100, 200, 300, 400]]


def run(kv: str, eager: bool, env: dict[str, str] | None = None, dtype: str = "auto") -> list[tuple[list[int], list]]:
    """Greedy tokens and their top-2 logprobs of PROMPTS; `env`: kernel switches
    ($PAGEDSERVE_*) set while the engine is built."""
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        llm = LLM("qwen3-4b-instruct-2507", load_format="dummy", kv_cache_memory=1 << 30, enforce_eager=eager,
                  max_model_len=4096, tokenizer=os.environ.get("PS_TOKENIZER"), kv_cache_dtype=kv, dtype=dtype)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = [(o.outputs[0].token_ids, [{t: x.logprob for t, x in d.items()} for d in o.outputs[0].logprobs])
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def agreement(ref, outs) -> tuple[list, float]:
    """(first differing token per prompt, the largest logprob difference of agreed tokens)."""
    diffs = [first_diff(a, b) for (a, _), (b, _) in zip(ref, outs)]
    worst = 0.0
    for (a, la), (b, lb), d in zip(ref, outs, diffs):
        for j in range(len(a) if d is None else d):
            worst = max(worst, abs(la[j][a[j]] - lb[j][b[j]]))
    return diffs, worst


def f16dot() -> None:
    from pagedserve.kernels import paged_attention as pa

    truth = run("fp8", True, dtype="float32")
    for on in (True, False):
        pa.DECODE_FP8_CONFIG["F16_DOT"] = pa.EXTEND_FP8_CONFIG["F16_DOT"] = on
        eager, graphs = run("fp8", True), run("fp8", False)
        for name, a, b in (("graphs vs eager", eager, graphs), ("eager vs fp32", truth, eager),
                           ("graphs vs fp32", truth, graphs)):
            diffs, worst = agreement(a, b)
            print(f"F16_DOT {on!s:>5} {name}: first difference per prompt {diffs}, largest logprob "
                  f"difference before it {worst:.3f}", flush=True)


def main() -> None:
    kv = sys.argv[1] if len(sys.argv) > 1 else "fp8"
    if kv == "f16dot":
        return f16dot()
    ref = run(kv, True)
    variants = {"graphs": {}, "decode graphs only": {"PAGEDSERVE_MIXED_GRAPH_TOKENS": "0"},
                "no PDL": {"PAGEDSERVE_PDL": "0"}, "no prefetch": {"PAGEDSERVE_WEIGHT_PREFETCH": "0"},
                "no skinny": {"PAGEDSERVE_SKINNY_MATMUL": "0"}, "no compile-ahead": {"PAGEDSERVE_COMPILE_AHEAD": "0"}}
    for name, env in variants.items():
        outs = run(kv, False, env)
        diffs = [first_diff(a, b) for (a, _), (b, _) in zip(ref, outs)]
        # at each first difference: the eager run's top-2 logprobs there, and this run's (a
        # gap of a few hundredths between the two best tokens is a near-tie, not a bug)
        where = [(i, d, sorted(ref[i][1][d].values())[-2:], sorted(outs[i][1][d].values())[-2:])
                 for i, d in enumerate(diffs) if d is not None and d < min(len(ref[i][1]), len(outs[i][1]))]
        print(f"kv {kv} {name:>20}: first difference per prompt {diffs}", flush=True)
        for i, d, e, g in where:
            print(f"kv {kv} {name:>20}:   prompt {i} token {d}: eager top-2 {e}, this run {g}", flush=True)


if __name__ == "__main__":
    main()

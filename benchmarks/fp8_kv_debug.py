"""Where the FP8 KV cache's graph and eager engines part (issue 26's open failure): the same
greedy run (Qwen3-4B preset, dummy weights) eager, with CUDA graphs, with decode graphs only,
without PDL and without the weight prefetch; prints each variant's first differing token
per prompt against eager, and whether any run produced non-finite logits (failed requests).

    python benchmarks/fp8_kv_debug.py [kv_cache_dtype]   (on a GPU)
"""

from __future__ import annotations

import gc
import os
import sys

import torch

from pagedserve import LLM, SamplingParams

PROMPTS = [[100 + i, 200 + i, 300 + i, 400 + i] * (1 + 40 * i) for i in range(6)] + [[100, 200, 300, 400]]


def run(kv: str, eager: bool, env: dict[str, str] | None = None) -> list[tuple[list[int], list]]:
    """Greedy tokens and their top-2 logprobs of PROMPTS; `env`: kernel switches
    ($PAGEDSERVE_*) set while the engine is built."""
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        llm = LLM("qwen3-4b-instruct-2507", load_format="dummy", kv_cache_memory=1 << 30, enforce_eager=eager,
                  max_model_len=4096, tokenizer=os.environ.get("PS_TOKENIZER"), kv_cache_dtype=kv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    kv = sys.argv[1] if len(sys.argv) > 1 else "fp8"
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

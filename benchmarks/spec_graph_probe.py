"""GPU time of the speculative step's CUDA graphs alone (issue 27), to split a step's time
between the GPU and the host: Qwen3-4B's preset with Qwen3-0.6B's drafting k = 4 (dummy
weights, forced acceptance), each graph replayed at batch 1 after a short generation,
timed by Triton's do_bench. The graphs replay whatever their buffers last held
(the finished request's rows), so this run's engine is not used afterwards.

    PYTHONPATH=. PS_TOKENIZER=.devtok python3 benchmarks/spec_graph_probe.py [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from triton.testing import do_bench

from pagedserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    spec = {"method": "draft_model", "model": "qwen3-0.6b", "num_speculative_tokens": 4,
            "force_accept": True, "disable_by_batch_size": 256}
    llm = LLM("qwen3-4b-instruct-2507", load_format="dummy", tokenizer=os.environ.get("PS_TOKENIZER"),
              max_model_len=1024, speculative_config=spec)
    llm.generate([[100, 200, 300] * 170], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                 use_tqdm=False)
    runner = llm.engine.executor.worker.runner
    target, draft = runner.graphs, runner.drafter.graphs
    graphs = {
        "target decode graph": target.graphs[target.decode_keys[0]].replay,
        "target verify graph (5 tokens)": target.graphs[target.verify_keys[0]].replay,
        "draft decode graph": draft.graphs[draft.decode_keys[0]].replay,
        "draft verify graph (the mirror, 5 tokens)": draft.graphs[draft.verify_keys[0]].replay,
        "draft proposal graph (4 steps)": runner.drafter.proposers[1],
    }
    rows = {name: do_bench(replay, warmup=5, rep=50) for name, replay in graphs.items()}  # ms
    for name, ms in rows.items():
        print(f"{name:<44} {ms:7.3f} ms")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "speculative graphs alone, batch 1", "gpu": torch.cuda.get_device_name(),
                       "ms": rows}, f, indent=1)


if __name__ == "__main__":
    main()

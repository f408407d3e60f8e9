"""Where an eager step's host time goes: cProfile of ModelRunner.execute + collect on the
Qwen3-4B preset (dummy weights) for a step of 224 decodes of 1,130-token contexts, eager and
from a CUDA graph (the `mixed` section's shapes, benchmarks/gpu_steps.py). Runs against the
tree on PYTHONPATH and its own benchmarks/ helpers:

    PS_TOKENIZER=... PYTHONPATH=<tree> python3 <tree>/benchmarks/eager_host_profile.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import time

import torch
from gpu_steps import _serving_engine, _step_chunks

from gpu_common import runner_of


def main() -> None:
    engine = _serving_engine()
    runner = runner_of(engine)
    graphs = runner.graphs
    for name, eager in (("decode 224 eager", True), ("decode 224 (graph)", False)):
        runner.graphs = None if eager else graphs
        _, out = _step_chunks(engine, 224, 1130, (), name[:3] + name[-3:], rng=random.Random(0))
        for _ in range(3):
            runner.collect(runner.execute(out))
        torch.cuda.synchronize()
        launch = []
        prof = cProfile.Profile()
        for i in range(10):
            t0 = time.perf_counter()
            if i >= 5:
                prof.enable()
            handle = runner.execute(out)
            if i >= 5:
                prof.disable()
            launch.append((time.perf_counter() - t0) * 1e3)
            runner.collect(handle)
            torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
        print(f"==== {name}: host launch ms {sorted(launch)[5]:.2f}")
        print("\n".join(line[:160] for line in s.getvalue().splitlines()[6:34]), flush=True)
    runner.graphs = graphs


if __name__ == "__main__":
    main()

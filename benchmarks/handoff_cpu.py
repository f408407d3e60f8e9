"""Host cost of the scheduler -> worker hand-off per decode step, on the CPU (no model).

256 running requests with 2,048-token contexts (128 blocks of 16 each), every step a decode
of each: times `Scheduler.schedule` plus the worker's host work on the step's block tables
(`pack_step`, and where the tree has them, the persistent tables' diff and gather), the
step's sampling parameters as the sampler's batch (`SamplingBatch.build` on the CPU with
Qwen3's defaults, from the worker's persistent rows where the tree has them), and the
pickled size and time of the `SchedulerOutput` (what a tensor-parallel rank receives).
Runs against whichever tree is on PYTHONPATH (the one before the persistent batch too), so
the same script measures both:

    PYTHONPATH=/path/to/tree python benchmarks/handoff_cpu.py [--batch 256 --context 2048]

Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

from pagedserve.config import SchedulerConfig
from pagedserve.engine.input_batch import pack_step
from pagedserve.engine.kv_cache_manager import KVCacheManager
from pagedserve.engine.request import Request
from pagedserve.engine.scheduler import ScheduledChunk, Scheduler
from pagedserve.layers.sampling_batch import SamplingBatch
from pagedserve.sampling_params import SamplingParams

BS = 16
VOCAB = 151936  # Qwen3's
PERSISTENT = hasattr(ScheduledChunk, "__dataclass_fields__") and "new_block_ids" in ScheduledChunk.__dataclass_fields__


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    B, ctx = args.batch, args.context
    extra = args.steps + 200  # (outputs during the prompts' prefill, then the timed steps)
    per_req = -(-(ctx + extra + 8) // BS)
    kv = KVCacheManager(B * per_req + 8, BS, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=B, max_num_batched_tokens=8192,
                                      max_model_len=ctx + extra + 64), kv)
    params = SamplingParams(max_tokens=extra, ignore_eos=True, temperature=0.7, top_p=0.8, top_k=20)
    for i in range(B):
        prompt = [(i * 7 + j) % 30000 + 1 for j in range(ctx)]
        sched.add_request(Request(f"r{i}", prompt, params, max_tokens=extra))
    tables = None
    if PERSISTENT:
        from pagedserve.engine.block_tables import BlockTables

        tables = BlockTables(-(-sched.config.max_model_len // BS), B)
    rows = None
    try:
        from pagedserve.layers.sampling_rows import SamplingRows

        rows = SamplingRows(VOCAB, B)
        for i in range(B):
            rows.add(f"r{i}", params)
    except ImportError:  # (a tree before the persistent sampling rows)
        pass

    def sampling(out):
        """The step's sampling batch (the worker's persistent rows where the tree has them)."""
        ids = [c.request_id for c in out.chunks]
        kw = {} if rows is None else {"facts": rows.gather(ids)}
        return SamplingBatch.build([params] * len(ids), [None] * len(ids), [[]] * len(ids), None,
                                   VOCAB, "cpu", num_outputs=[1] * len(ids), **kw)

    def worker(out):
        """The worker's host work on the step: its tables, then the packed arrays."""
        toks = [sched_reqs[c.request_id].token_ids for c in out.chunks]
        if tables is None:
            return pack_step(out.chunks, toks, {}, BS)
        tables.apply(out)
        return pack_step(out.chunks, toks, {}, BS, tables.gather([c.request_id for c in out.chunks]))

    sched_reqs = {r.request_id: r for r in sched.waiting}
    while True:  # the prompts' prefill
        out = sched.schedule()
        worker(out)
        sched.apply_results(out, {c.request_id: [5] for c in out.chunks if c.samples})
        if out.chunks and all(c.is_decode for c in out.chunks) and len(out.chunks) == B:
            break
    t_sched, t_pack, t_sample, t_pickle, sizes = [], [], [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        worker(out)
        t2 = time.perf_counter()
        sampling(out)
        t_sample.append((time.perf_counter() - t2) * 1e3)
        t2 = time.perf_counter()
        blob = pickle.dumps(out)
        pickle.loads(blob)
        t3 = time.perf_counter()
        assert len(out.chunks) == B
        sched.apply_results(out, {c.request_id: [5] for c in out.chunks})
        t_sched.append((t1 - t0) * 1e3)
        t_pack.append((t2 - t1) * 1e3)
        t_pickle.append((t3 - t2) * 1e3)
        sizes.append(len(blob))
    med = statistics.median

    def q(xs):  # (p10, p50, p90)
        qs = statistics.quantiles(xs, n=10)
        return [round(qs[0], 3), round(med(xs), 3), round(qs[-1], 3)]

    result = {"persistent_batch": PERSISTENT, "persistent_sampling_rows": rows is not None, "batch": B, "context": ctx, "steps": args.steps,
              "schedule_ms_p10_p50_p90": q(t_sched), "worker_tables_and_pack_ms_p10_p50_p90": q(t_pack),
              "schedule_plus_pack_ms_p10_p50_p90": q([a + b for a, b in zip(t_sched, t_pack)]),
              "sampling_batch_ms_p10_p50_p90": q(t_sample),
              "pickle_roundtrip_ms_p10_p50_p90": q(t_pickle), "pickled_bytes": int(med(sizes))}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

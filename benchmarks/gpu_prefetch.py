"""The L2 weight prefetch beside the decode graphs (`pagedserve/kernels/weight_prefetch.py`),
for the GPU check (`benchmarks/gpu_check.py --sections weight_prefetch,prefetch_batches`): graph
time with each setting and without, how fast the prefetch programs issue their requests,
whether a prefetched weight's matmul then reads it from L2, and bigger decode graphs with the
prefetch and without."""

from __future__ import annotations

import gc
import os

import torch

from gpu_common import DEV, RESULTS, record, runner_of, section


@torch.inference_mode()
def _prefetch_issue_ms(pf, programs: int) -> float:
    """GPU ms for the prefetch program alone to issue its whole table (no waiting: the
    progress counter starts past every signal)."""
    from pagedserve.kernels.weight_prefetch import NCHUNK, _prefetch_kernel

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    pf.progress.copy_(torch.tensor([1 << 30, 0], dtype=torch.int32))
    start.record()
    _prefetch_kernel[(programs,)](pf.addr, pf.nbytes, pf.count, pf.progress, NCHUNK=NCHUNK, num_warps=1)
    end.record()
    end.synchronize()
    assert int(pf.progress[0]) == 0, "the prefetch program did not re-arm its counter"
    return start.elapsed_time(end)


@torch.inference_mode()
def _prefetch_hit_probe(weight: torch.Tensor, cfg) -> dict:
    """One weight's skinny matmul (its one-row setting) after the L2 was flushed, against
    the same after the prefetch program asked for its first 8 / 32 / all MB, with a pause
    between (so the prefetch is done): does a prefetched weight come from L2?"""
    from pagedserve.kernels.skinny_gemm import skinny_matmul
    from pagedserve.kernels.weight_prefetch import PrefetchConfig, WeightPrefetcher

    x = torch.randn(1, weight.shape[1], device=DEV, dtype=weight.dtype)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=DEV)
    mb = weight.numel() * weight.element_size() / 2**20
    found = {}
    for cap in (0, 8, 32, mb):
        pf = WeightPrefetcher(torch.device(DEV), PrefetchConfig(cap or 1, 1.0, 1))
        pf.fill([weight])
        times = []
        for _ in range(20):
            flush.zero_()
            if cap:
                _prefetch_issue_ms(pf, 1)
            torch.cuda._sleep(200_000)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            skinny_matmul(x, weight, cfg)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        found[f"{cap:g} MB"] = round(sorted(times)[len(times) // 2] * 1e3, 2)  # us
    return {"weight_mb": round(mb, 1), "matmul_us_after_prefetch": found}


def _replay_ms(graph, reps: int = 200) -> float:
    """GPU ms per replay of a captured graph, after 20 warm replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(20):
        graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _same_hidden(graphs, bs: int, name: str, want: dict, res: dict) -> None:
    """Note in res["mismatch"] a graph whose hidden states differ from the first capture's."""
    got = graphs.outputs[bs][:bs].clone()
    if bs not in want:
        want[bs] = got
    elif not torch.equal(got, want[bs]):
        res.setdefault("mismatch", []).append(f"b{bs} {name}")


class _DecodeGraphs:
    """Decode graphs of the engine's step buffers, recaptured per bucket with a prefetch
    setting of the probe's choosing (the engine captures with the default one)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.graphs, self.outputs, self.prefetchers = {}, {}, {}
        self.stream = torch.cuda.Stream(runner.device)

    @torch.inference_mode()
    def capture_bucket(self, bs: int, cfg) -> None:
        from pagedserve.attention.backend import GraphKey
        from pagedserve.engine.graphs import capture_graph
        from pagedserve.kernels.weight_prefetch import WeightPrefetcher

        key, graphs = GraphKey(bs, 1), self.runner.graphs
        prefetcher = self.prefetchers[bs] = None if cfg is None else WeightPrefetcher(graphs.device, cfg)

        def fn():
            if prefetcher is None:
                return graphs.forward(key)
            with prefetcher.run():
                return graphs.forward(key)
        self.graphs[bs], self.outputs[bs] = capture_graph(fn, None, self.stream)


def _engine(model: str, max_batch: int, ctx: int):
    """A dummy-weight engine whose decode-graph rows 0 .. max_batch - 1 each hold a context of
    `ctx` tokens with random K/V (as in `bench latency`'s batch-size sweep)."""
    from pagedserve import LLM
    from pagedserve.attention.backend import GraphKey
    from pagedserve.engine.block_tables import table_rows
    from pagedserve.engine.input_batch import pack_step
    from pagedserve.engine.scheduler import ScheduledChunk

    llm = LLM(model, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=max_batch,
              kv_cache_memory=8 << 30, tokenizer=os.environ.get("PS_TOKENIZER"))
    runner = runner_of(llm.engine)
    nb = ctx // 16  # blocks per row: row r owns blocks r * nb ... (r + 1) * nb - 1
    chunks = [ScheduledChunk(f"r{r}", ctx - 1, 1, samples=True, is_decode=True) for r in range(max_batch)]
    tables = table_rows([list(range(r * nb, (r + 1) * nb)) for r in range(max_batch)])
    a = pack_step(chunks, [[1234 + r] * ctx for r in range(max_batch)], {}, 16, tables)
    runner.buffers.load(a, max_batch, GraphKey(max_batch, 1), None)
    for cache in runner.kv_caches:  # the contexts' K/V: random, not leftover memory
        cache[:, : max_batch * nb].normal_()
    return llm, _DecodeGraphs(runner)


@section
def weight_prefetch(quick: bool) -> None:
    """The batch-1 decode graph with and without the L2 weight prefetch beside it
    (`kernels/weight_prefetch.py`), recaptured per setting in one engine: GPU ms per replay
    (median over interleaved rounds), and the hidden states bit for bit against the plain
    graph, with a 512-token context. Also how fast the prefetch programs issue their requests
    alone, and whether a prefetched weight's matmul then runs from L2."""
    import statistics

    from pagedserve.kernels.weight_prefetch import PrefetchConfig

    default = PrefetchConfig()
    settings = [None, default, default._replace(signal_at=1.0), default._replace(signal_at=0.8),
                default._replace(cap_mb=6), default._replace(cap_mb=12), default._replace(programs=24)]
    models = ("qwen3-4b-instruct-2507",) if quick else ("qwen3-4b-instruct-2507", "nanbeige4.1-3b")
    found = RESULTS.setdefault("weight_prefetch", {})
    for model in models:
        llm, graphs = _engine(model, 8, 512)
        res = found.setdefault(model, {"graph_ms": {}, "issue_ms": {}})
        want: dict[int, torch.Tensor] = {}
        for _ in range(3):
            for cfg in settings:
                name = "off" if cfg is None else ",".join(f"{v:g}" for v in cfg)
                graphs.capture_bucket(1, cfg)
                res["graph_ms"].setdefault(name, []).append(round(_replay_ms(graphs.graphs[1]), 4))
                _same_hidden(graphs, 1, name, want, res)
                if cfg is not None:
                    res["issue_ms"].setdefault(name, []).append(
                        round(_prefetch_issue_ms(graphs.prefetchers[1], cfg.programs), 4))
        res["best"] = min(res["graph_ms"], key=lambda k: statistics.median(res["graph_ms"][k]))
        short = model.split("-")[0]
        for k, v in res["graph_ms"].items():
            record(f"b1 graph {short} prefetch {k} ms", statistics.median(v), None, "{:.4f}")
        for k, v in res["issue_ms"].items():
            record(f"  issue alone {k} ms", statistics.median(v), None, "{:.4f}")
        record(f"{short} prefetch: identical hidden states", not res.get("mismatch"), not res.get("mismatch"))
        if model.startswith("qwen3"):
            mlp = runner_of(llm.engine).model.layers[0].mlp
            for lin in (mlp.gate_up_proj, mlp.down_proj):
                if not lin.skinny_plan or lin.skinny_plan.get(1) is None:
                    continue
                res.setdefault("hit_probe", []).append(_prefetch_hit_probe(lin.weight, lin.skinny_plan[1]))
                record(f"  matmul us after prefetch ({res['hit_probe'][-1]['weight_mb']} MB)",
                       str(res["hit_probe"][-1]["matmul_us_after_prefetch"]))
        del llm, graphs
        gc.collect()
        torch.cuda.empty_cache()


@section
def prefetch_batches(quick: bool) -> None:
    """Decode graphs of 4-64 rows with the default prefetch and without, Qwen3 only: whether
    `PrefetchConfig.max_batch` (16) should grow. Every row has a 512-token context; three
    interleaved rounds (two with --quick); hidden states compared bit for bit."""
    import statistics

    from pagedserve.kernels.weight_prefetch import PrefetchConfig

    buckets = (16, 32, 64) if quick else (4, 16, 32, 64)
    llm, graphs = _engine("qwen3-4b-instruct-2507", max(buckets), 512)
    res = RESULTS.setdefault("prefetch_batches", {"graph_ms": {}})
    want: dict[int, torch.Tensor] = {}
    for _ in range(2 if quick else 3):
        for bs in buckets:
            for cfg in (None, PrefetchConfig()):
                name = "off" if cfg is None else "on"
                print(f"prefetch_batches: capturing b{bs} {name}", flush=True)
                graphs.capture_bucket(bs, cfg)
                res["graph_ms"].setdefault(f"b{bs} {name}", []).append(round(_replay_ms(graphs.graphs[bs]), 4))
                _same_hidden(graphs, bs, name, want, res)  # labels a mismatch "b{bs} {name}"
    for k, v in res["graph_ms"].items():
        record(f"qwen3 graph {k} ms", statistics.median(v), None, "{:.4f}")
    record("qwen3 prefetch by batch: identical hidden states", not res.get("mismatch"), not res.get("mismatch"))
    del llm, graphs
    gc.collect()
    torch.cuda.empty_cache()

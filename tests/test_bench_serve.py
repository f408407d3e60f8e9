"""`pagedserve bench serve`: metrics on hand-made timelines, arrivals, datasets, a real run."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from pagedserve.bench.datasets import file_dataset, prefix_dataset, random_dataset
from pagedserve.bench.serve import arrival_gaps
from pagedserve.bench.serve_metrics import RequestRecord, compute_metrics, parse_goodput, summarize


def _rec(start, first, chunks, end, out_tokens, prompt_tokens=10):
    return RequestRecord(start=start, prompt_tokens=prompt_tokens, output_tokens=out_tokens,
                         first_token=first, chunk_times=chunks, end=end)


def test_metrics_on_a_hand_computed_timeline():
    a = _rec(0.0, 0.1, [0.1, 0.3, 0.4], 0.4, 3)  # ttft 100, tpot (0.4-0.1)/2 = 150, itl 200, 100
    b = _rec(1.0, 1.5, [1.5, 1.6], 1.6, 2)  # ttft 500, tpot 100, itl 100
    c = RequestRecord(start=0.5, error="HTTP 503: busy")
    m = compute_metrics([a, b, c], duration_s=2.0, goodput={"ttft": 200, "tpot": 200})
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["output_tokens"] == 5 and m["input_tokens"] == 20
    assert m["output_throughput"] == pytest.approx(2.5) and m["request_throughput"] == pytest.approx(1.0)
    assert m["total_token_throughput"] == pytest.approx(12.5)
    assert m["ttft_ms"]["mean"] == pytest.approx(300) and m["ttft_ms"]["median"] == pytest.approx(300)
    assert m["tpot_ms"]["mean"] == pytest.approx(125)
    assert m["itl_ms"]["median"] == pytest.approx(100) and m["itl_ms"]["mean"] == pytest.approx(400 / 3)
    assert m["e2el_ms"]["mean"] == pytest.approx(500)
    assert m["goodput_rps"] == pytest.approx(0.5)  # only a meets ttft <= 200 ms
    assert m["errors"] == ["HTTP 503: busy"]


def test_percentiles_interpolate_like_numpy():
    s = summarize([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s["median"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)
    assert s["p90"] == pytest.approx(90.1) and s["mean"] == pytest.approx(50.5)
    assert summarize([])["median"] is None


def test_single_token_outputs_have_no_tpot():
    m = compute_metrics([_rec(0.0, 0.2, [0.2], 0.2, 1)], 1.0)
    assert m["tpot_ms"]["mean"] is None and m["ttft_ms"]["mean"] == pytest.approx(200)


def test_goodput_parsing():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["ttft"], ["speed:3"], ["tpot:fast"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_arrivals_match_the_requested_rate_and_burstiness():
    assert arrival_gaps(5, float("inf"), 1.0, 0) == [0.0] * 5
    poisson = arrival_gaps(20000, 10.0, 1.0, 0)
    assert statistics.mean(poisson) == pytest.approx(0.1, rel=0.03)
    assert statistics.pstdev(poisson) / statistics.mean(poisson) == pytest.approx(1.0, rel=0.05)
    bursty = arrival_gaps(20000, 10.0, 0.25, 0)  # gamma shape 0.25: coefficient of variation 2
    assert statistics.mean(bursty) == pytest.approx(0.1, rel=0.06)
    assert statistics.pstdev(bursty) / statistics.mean(bursty) == pytest.approx(2.0, rel=0.08)
    assert arrival_gaps(10, 5.0, 1.0, 7) == arrival_gaps(10, 5.0, 1.0, 7)
    with pytest.raises(ValueError):
        arrival_gaps(3, -1.0, 1.0, 0)


def test_datasets_are_reproducible_by_seed(tmp_path):
    a = random_dataset(20, 100, 10, 0.5, seed=3)
    assert a == random_dataset(20, 100, 10, 0.5, seed=3) and a != random_dataset(20, 100, 10, 0.5, seed=4)
    assert all(50 <= len(r.prompt) <= 150 and r.input_len == len(r.prompt) for r in a)
    texts = random_dataset(5, 30, 10, 0.0, seed=0, text=True)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 30 for r in texts)
    p = prefix_dataset(6, 32, 40, 8, num_prefixes=2, seed=0)
    assert p[0].prompt[:32] == p[2].prompt[:32] != p[1].prompt[:32]
    assert all(len(r.prompt) == 40 for r in p)
    convs = [{"conversations": [{"from": "human", "value": "hi there"},
                                {"from": "gpt", "value": "hello you two"}]}, {"prompt": "plain"}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in convs))
    got = file_dataset(str(path), 4, 16, seed=0)
    assert sorted({(r.prompt, r.output_len) for r in got}) == [("hi there", 3), ("plain", 16)]
    with pytest.raises(ValueError, match="no usable prompts"):
        bad = tmp_path / "e.json"
        bad.write_text("[1, 2]")
        file_dataset(str(bad), 2, 4, 0)


def _args(**kw):
    """`bench serve`'s settings as the parser and `resolve_serve_args` give them: small defaults
    for the tests, then `kw` (flag destinations; `ignore_eos` on unless given)."""
    from pagedserve.bench.serve_args import resolve_serve_args
    from pagedserve.cli.main import build_parser

    args = build_parser().parse_args(["bench", "serve"])
    small = dict(label="ours", input_len=24, output_len=6, num_prompts=6, concurrency_sweep="1,3",
                 warmup=1, ignore_eos=True, timeout=120.0, no_progress=True, launch_timeout=60.0)
    for key, value in {**small, **kw}.items():
        assert hasattr(args, key), f"bench serve has no setting {key!r}"
        setattr(args, key, value)
    return resolve_serve_args(args)


def test_end_to_end_against_a_real_server(server, tmp_path):
    from pagedserve.bench.serve_run import run_serve

    out = tmp_path / "r.json"
    result = run_serve(_args(base_url=server.url, save_result=str(out)))
    assert json.loads(out.read_text()) == result
    assert result["model"] == "smollm2-135m-instruct"
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 3]
    for run in result["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["output_tokens"] == 6 * 6  # from the server's usage; ignore_eos
        assert run["input_tokens"] == 6 * 24  # token-id prompts of exact length
        assert run["ttft_ms"]["median"] > 0 and run["tpot_ms"]["median"] > 0
    chat = run_serve(_args(base_url=server.url, endpoint="chat", concurrency_sweep=None,
                           max_concurrency=2, num_prompts=3))
    assert chat["runs"][0]["completed"] == 3 and chat["runs"][0]["output_tokens"] == 18


def test_json_schema_requests(server, monkeypatch):
    """--json-schema: every request carries the schema (its minItems keeps outputs at their
    full length); --unique-schemas gives each a title of its own."""
    from pagedserve.bench import serve as bench_serve
    from pagedserve.bench.serve_run import run_serve

    sent = []
    real = bench_serve._body
    monkeypatch.setattr(bench_serve, "_body", lambda *a: sent.append(real(*a)) or sent[-1])
    schema = str(Path(__file__).parents[1] / "benchmarks" / "schemas" / "catalogue.json")
    result = run_serve(_args(base_url=server.url, endpoint="chat", concurrency_sweep=None,
                             max_concurrency=2, num_prompts=3, output_len=24,
                             json_schema=schema, unique_schemas=True))
    run = result["runs"][0]
    assert run["completed"] == 3 and run["failed"] == 0 and run["output_tokens"] == 3 * 24
    formats = [body["response_format"] for _, body in sent]
    assert len(formats) == 4  # a warm-up and three measured
    assert {f["json_schema"]["schema"]["required"][1] for f in formats} == {"items"}
    assert len({f["json_schema"]["schema"]["title"] for f in formats}) == 4


def test_failures_are_counted_not_raised(server):
    from pagedserve.bench.serve_run import run_serve

    # 3000-token prompts exceed the server's 2048-token context: every request gets a 400.
    result = run_serve(_args(base_url=server.url, input_len=3000, concurrency_sweep=None,
                             num_prompts=2, warmup=0))
    run = result["runs"][0]
    assert run["completed"] == 0 and run["failed"] == 2 and "HTTP 400" in run["errors"][0]


def test_short_dataset_is_the_fifteen_prompts_in_order():
    from pagedserve.bench.datasets import SHORT_PROMPTS, short_dataset

    reqs = short_dataset(17, 100)
    assert len(SHORT_PROMPTS) == 15 and len(set(SHORT_PROMPTS)) == 15
    assert [r.prompt for r in reqs[:15]] == SHORT_PROMPTS
    assert reqs[15].prompt == SHORT_PROMPTS[0] and {r.output_len for r in reqs} == {100}
    assert any("首都" in p for p in SHORT_PROMPTS) and any("France" in p for p in SHORT_PROMPTS)


class _FakeNvml:
    """pynvml stand-in: two GPUs whose used memory climbs by 1 GiB per reading to +5 GiB, then drops."""

    def __init__(self):
        self.readings = 0

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=40 + 20 * handle)  # 40% and 60%: a mean of 50

    def nvmlDeviceGetMemoryInfo(self, handle):
        self.readings += handle == 0  # one reading = both GPUs
        step = min(self.readings - 1, 5) if self.readings < 20 else 0
        return SimpleNamespace(used=(handle + 1 + step) << 30)


def test_gpu_memory_sampler_keeps_the_peak_above_the_baseline(monkeypatch):
    import sys
    import time

    from pagedserve.bench.launcher import GpuMemorySampler

    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml())
    sampler = GpuMemorySampler(interval_s=0.005)
    sampler.start()
    assert sampler.baseline == 3 << 30  # 1 + 2 GiB at the first reading
    time.sleep(0.5)  # the fake climbs to +5 GiB per GPU, then falls back to the baseline
    sampler.stop()
    assert sampler.peak_above_baseline() == 10 << 30
    assert sampler.util_count > 0 and sampler.util_sum == 50.0 * sampler.util_count


def test_cpu_used_reports_processes_and_gpu_utilisation_between_snapshots():
    from pagedserve.bench.serve import cpu_used

    before = {"main": 1.0, "children": {10: 2.0, 11: 0.5}, "gpu_util": (100.0, 2)}
    after = {"main": 1.5, "children": {10: 5.0, 11: 0.501, 12: 0.25}, "gpu_util": (400.0, 5)}
    # main 0.5 s; children 3.0 s (pid 10), 0.25 s (new pid 12); pid 11's 1 ms is dropped
    assert cpu_used(before, after) == {"server_main_s": 0.5, "server_children_s": [3.0, 0.25],
                                       "gpu_util_mean": 100.0}


def test_gpu_memory_sampler_without_nvml_reports_none(monkeypatch):
    import sys

    from pagedserve.bench.launcher import GpuMemorySampler

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    sampler = GpuMemorySampler()
    sampler.start()
    sampler.stop()
    assert sampler.peak_above_baseline() is None


def test_launch_measures_startup_and_stops_the_server(tmp_path):
    import sys

    from server_helpers import KV_CACHE_BYTES, free_port

    from pagedserve.bench.serve_run import run_serve

    port = free_port()
    cmd = (f"{sys.executable} -m pagedserve.cli serve --host 127.0.0.1 --port {port} --device cpu "
           f"--dtype float32 --max-model-len 1024 --kv-cache-memory {KV_CACHE_BYTES} --log-level INFO "
           "--kv-cache-dtype fp8")
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    result = run_serve(_args(base_url=url, launch=cmd, launch_timeout=300.0, launch_log=str(log), dataset="short",
                             endpoint="chat", output_len=4, num_prompts=3, warmup=0,
                             concurrency_sweep=None, max_concurrency=3))
    launch = result["launch"]
    assert launch["command"] == cmd and 0 < launch["startup_s"] < 300
    assert launch["peak_gpu_memory_bytes"] is None  # no GPU on the test machine
    assert (result["quantization"], result["kv_cache_dtype"]) == (None, "fp8")  # as the server reports
    assert result["runs"][0]["completed"] == 3 and result["runs"][0]["output_tokens"] == 12
    cpu = result["runs"][0]["cpu"]  # the client's and each server process's CPU while measuring
    assert cpu["client_s"] > 0 and cpu["server_main_s"] > 0
    assert cpu["server_children_s"] and cpu["server_children_s"][0] > 0  # the engine core stepped
    side = result["runs"][0]["server_side_ms"]  # from /metrics, over the measured requests only
    assert side["queue_mean"] >= 0 and side["prefill_mean"] > 0
    # one monotonic clock: the HTTP process sees the first token after the engine made it
    assert side["queue_mean"] + side["prefill_mean"] <= side["ttft_mean"] + 0.02
    with pytest.raises(httpx.HTTPError):  # the launched server and its engine are gone
        httpx.get(f"{url}/health", timeout=2)
    assert "engine ready" in log.read_text()  # --launch-log keeps the server's output
    assert "float8_e4m3fn, 1 byte/element" in log.read_text()  # the FP8 cache it served from


def test_launch_reports_a_server_that_dies_with_its_log():
    import sys

    from server_helpers import free_port

    from pagedserve.bench.launcher import LaunchedServer, LaunchError

    cmd = f"{sys.executable} -c \"print('model file is missing'); raise SystemExit(3)\""
    with pytest.raises(LaunchError, match=r"(?s)exited with code 3.*model file is missing"), \
            LaunchedServer(cmd, f"http://127.0.0.1:{free_port()}", timeout_s=60):
        pass


def test_launch_refuses_a_port_already_serving(server):
    from pagedserve.bench.launcher import LaunchedServer, LaunchError

    with pytest.raises(LaunchError, match="already answers"), LaunchedServer("true", server.url):
        pass


def test_a_terminated_benchmark_stops_the_server_it_launched(tmp_path):
    """SIGTERM to `bench serve --launch` (e.g. from `timeout`) must not leave the server running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from server_helpers import alive, child_pids, free_port

    (tmp_path / "health").write_text("ok")
    port = free_port()
    server_cmd = f"{sys.executable} -m http.server {port} --bind 127.0.0.1 --directory {tmp_path}"
    script = ("import time\nfrom pagedserve.bench.launcher import LaunchedServer\n"
              f"with LaunchedServer({server_cmd!r}, 'http://127.0.0.1:{port}'):\n"
              "    print('healthy', flush=True)\n    time.sleep(120)\n")
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout.readline().strip() == "healthy"
        servers = [p for p in child_pids(bench.pid) if alive(p)]
        assert servers, "the launched server is not a child of the benchmark"
        os.kill(bench.pid, signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while any(alive(p) for p in servers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in servers), "the launched server outlived the benchmark"
    finally:
        bench.kill()
        bench.wait()


def test_latency_means_cover_only_the_requests_between_two_scrapes():
    from pagedserve.bench.serve import latency_means

    before = {"ttft": (2.0, 4.0), "queue": (0.4, 4.0)}
    after = {"ttft": (5.0, 10.0), "queue": (1.0, 10.0), "prefill": (0.6, 6.0)}
    # 6 new requests: ttft (5 - 2) / 6 s, queue 0.6 / 6 s; prefill appeared after the first scrape
    assert latency_means(before, after) == {"ttft_mean": 500.0, "queue_mean": 100.0, "prefill_mean": 100.0}
    assert latency_means(after, after) == {}  # nothing finished in between


def test_sse_lines_longer_than_aiohttp_buffers_are_parsed():
    """One SSE event of 200 kB (e.g. an echoed long prompt) arrives in pieces and is still one event."""
    import asyncio
    import json as _json

    from pagedserve.bench.serve import _sse

    big = {"choices": [{"index": 0, "text": "x" * 200_000}]}
    body = (f"data: {_json.dumps(big)}\n\n" + 'data: {"usage": {"completion_tokens": 1}}\n\n'
            + "data: [DONE]\n\ndata: {\"after\": 1}\n\n").encode()

    class Content:
        async def iter_any(self):
            for i in range(0, len(body), 7_000):  # arbitrary cuts, mid-line included
                yield body[i : i + 7_000]

    class Resp:
        content = Content()

    async def collect():
        return [e async for e in _sse(Resp())]

    events = asyncio.run(collect())
    assert events == [big, {"usage": {"completion_tokens": 1}}]  # nothing after [DONE]


@pytest.mark.parametrize("first", [{"index": 0, "text": ""}, {"index": 0, "delta": {"role": "assistant", "content": ""}}])
def test_a_chunk_with_choices_is_output_even_without_text(first):
    """The first token is the first chunk with choices, as vLLM's client times it: a token
    that decodes to no text yet, or a chat's role chunk (sent with the first token); the usage
    chunk is not output. Every chunk with choices is an inter-token gap."""
    import asyncio
    import json as _json
    from types import SimpleNamespace

    from pagedserve.bench.datasets import BenchRequest
    from pagedserve.bench.serve import send_one

    events = [(0.05, {"choices": [first]}), (0.25, {"choices": [{"index": 0, "text": "a"}]}),
              (0.3, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})]

    class Content:
        async def iter_any(self):
            t = 0.0
            for at, event in events:
                await asyncio.sleep(at - t)
                t = at
                yield f"data: {_json.dumps(event)}\n\n".encode()
            yield b"data: [DONE]\n\n"

    class Resp:
        status, content = 200, Content()

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

    class Session:
        def post(self, url, json):
            return Resp()

    args = SimpleNamespace(temperature=0.0, top_p=None, top_k=None, ignore_eos=True, endpoint="completions")
    rec = asyncio.run(send_one(Session(), "http://x", BenchRequest([1, 2, 3], 2), args, "m"))
    assert rec.ok and rec.output_tokens == 2
    assert 0.04 < rec.ttft < 0.2, rec.ttft  # the first chunk, not the first text (0.25 s)
    assert len(rec.chunk_times) == 2 and rec.itls[0] > 0.15


def test_sampling_fields_are_sent_only_when_given():
    """As vLLM's client: without --temperature / --top-p / --top-k the request carries none,
    so the server's defaults (the model's generation_config) apply."""
    import argparse

    from pagedserve.bench.serve import BenchRequest, _body
    from pagedserve.bench.serve_args import add_serve_bench_args

    parser = argparse.ArgumentParser()
    add_serve_bench_args(parser)
    req = BenchRequest([1, 2, 3], 4)
    _, plain = _body(req, parser.parse_args([]), "m")
    assert not {"temperature", "top_p", "top_k"} & plain.keys()
    _, given = _body(req, parser.parse_args(["--temperature", "0", "--top-p", "0.9", "--top-k", "5"]), "m")
    assert (given["temperature"], given["top_p"], given["top_k"]) == (0.0, 0.9, 5)

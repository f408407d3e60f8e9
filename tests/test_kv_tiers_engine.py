"""The KV-cache hierarchy on the whole engine (a tiny random Llama with SmolLM2's tokenizer,
fp32, CPU: fast steps, and its greedy tokens and logprobs follow every KV entry): a small KV cache forces
evictions; returning conversations hit the host tier, a restarted engine hits the disk tier,
a corrupt block file is skipped, an unwritable directory turns the disk tier off; all with the
same tokens as an engine without tiers, through chunked prefill and preemption."""

from __future__ import annotations

import io
import logging
import random

import pytest

from pagedserve import LLM, SamplingParams

BYTES_PER_BLOCK = 16 * 3 * 2 * 2 * 16 * 4  # the tiny Llama (conftest.TINY_LLAMA), fp32: 16 tokens of KV
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
# a KV cache of 16 blocks, 4 requests at a time, 32-token chunks: returning turns find their
# history evicted, and long prompts are chunked and preempted
SMALL = dict(dtype="float32", device="cpu", max_model_len=512, kv_cache_memory=16 * BYTES_PER_BLOCK,
             max_num_seqs=4, max_num_batched_tokens=32)
HOST_GIB = 64 * BYTES_PER_BLOCK / 2**30


@pytest.fixture(scope="module")
def conversations():
    rng = random.Random(0)
    system = [rng.randrange(100, 40000) for _ in range(48)]
    return [system + [rng.randrange(100, 40000) for _ in range(56)] for _ in range(6)]


def _two_turns(llm: LLM, conversations: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Every conversation's first turn, then each returns with the answer and 10 new tokens:
    each turn's tokens and their logprobs."""
    first = llm.generate(conversations, GREEDY, use_tqdm=False)
    second = [c + list(o.outputs[0].token_ids) + list(range(200, 210)) for c, o in zip(conversations, first)]
    outs = first + llm.generate(second, GREEDY, use_tqdm=False)
    llm.check_no_leaks()
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def _same(got, want) -> bool:
    """The same tokens, and logprobs equal but for the rounding of differently chunked steps."""
    return [t for t, _ in got] == [t for t, _ in want] and all(
        lp == pytest.approx(ref, abs=1e-4) for (_, lp), (_, ref) in zip(got, want))


@pytest.fixture(scope="module")
def reference(conversations, tmp_path_factory, caplog_module, tiny_with_tokenizer):
    """No tiers: its --kv-cache-dir cannot be created (its parent is a file), so the disk tier
    turns itself off with a warning and the engine runs without tiers."""
    blocker = tmp_path_factory.mktemp("ro") / "a-file"
    blocker.write_text("")
    llm = LLM(str(tiny_with_tokenizer), **SMALL, kv_cache_dir=str(blocker / "kv"))
    assert llm.engine.kv.tiers is None
    return _two_turns(llm, conversations)


@pytest.fixture(scope="module")
def caplog_module():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("pagedserve")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def host_run(conversations, disk_dir, tiny_with_tokenizer):
    llm = LLM(str(tiny_with_tokenizer), **SMALL, kv_offload_size=HOST_GIB, kv_cache_dir=str(disk_dir))
    tokens = _two_turns(llm, conversations)
    llm.close()  # (the disk tier's writes finish)
    return llm, tokens


def test_unwritable_directory_warns_once_and_runs_without_tiers(reference, caplog_module):
    warnings = [r for r in caplog_module if "cannot be written" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert len(reference) == 12 and all(len(t) == 4 for t, _ in reference)


def test_returning_conversations_hit_the_host_tier_with_the_same_tokens(host_run, reference):
    llm, tokens = host_run
    assert _same(tokens, reference)
    stats = llm.engine.kv.tiers.stats
    assert stats.offloads > 0 and stats.host_hits > 0
    assert llm.engine.scheduler.num_preemptions > 0  # (preemption and chunks ran with tiers on)
    moves = llm.engine.kv.tiers.moves
    assert moves.host_bytes >= (stats.offloads + stats.host_hits) * BYTES_PER_BLOCK
    assert stats.disk_writes > 0 and moves.disk_bytes > 0


def test_a_restarted_engine_hits_the_disk_tier_and_skips_a_corrupt_file(host_run, reference, conversations,
                                                                         disk_dir, tiny_with_tokenizer):
    files = sorted(disk_dir.glob("*.kvblock"))
    assert len(files) == host_run[0].engine.kv.tiers.stats.disk_writes
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of the payload
    files[0].write_bytes(bytes(data))
    llm = LLM(str(tiny_with_tokenizer), **SMALL, kv_cache_dir=str(disk_dir))
    store = llm.engine.executor.worker.kv_tiers.disk
    assert store.stats.corrupt_files == 1
    assert llm.engine.kv.tiers.num_disk_files == len(files) - 1
    assert _same(_two_turns(llm, conversations), reference)
    assert llm.engine.kv.tiers.stats.disk_hits > 0
    # a file that goes bad while the engine runs: the step that reads it fails (its request), the
    # disk tier forgets its files, and the same request then recomputes the right tokens
    kv = llm.engine.kv
    i, digest = next((i, h.digest) for i, c in enumerate(conversations) for h in kv.find_prefix(c).tier_hits
                     if h.gpu_block is None and kv.tiers.where(h.digest) == "disk")
    path = store.path(digest)
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    bad = llm.generate([conversations[i]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert bad.finish_reason == "error" and kv.tiers.num_disk_files == 0
    assert store.stats.corrupt_files == 2 and not path.exists()
    assert _same(_two_turns(llm, conversations[i : i + 1]), [reference[i], reference[6 + i]])
    llm.close()


def test_metrics_show_the_tiers_hits_and_bytes(host_run):
    from pagedserve.engine.core_process import core_stats
    from pagedserve.monitor.promtext import Scrape
    from pagedserve.monitor.top import render, summarize
    from pagedserve.server.metrics import Metrics

    llm, _ = host_run
    stats = core_stats(llm.engine)
    tiers = llm.engine.kv.tiers
    assert (stats.kv_host_hits, stats.kv_disk_hits, stats.kv_tier_misses, stats.kv_offloads) == (
        tiers.stats.host_hits, tiers.stats.disk_hits, tiers.stats.misses, tiers.stats.offloads)
    metrics = Metrics("tiny")
    scrape = Scrape.parse(metrics.render(stats).decode(), 0.0)
    host = {"model_name": "tiny", "tier": "host"}
    assert scrape.value("pagedserve_kv_offload_hits_total", **host) == stats.kv_host_hits > 0
    assert scrape.value("pagedserve_kv_offload_bytes_total", **host) == stats.kv_host_bytes > 0
    assert scrape.value("pagedserve_kv_offload_seconds_total", **host) > 0
    assert scrape.value("pagedserve_kv_offload_bytes_total", model_name="tiny", tier="disk") == stats.kv_disk_bytes
    assert scrape.value("pagedserve_kv_offload_misses_total", model_name="tiny") == stats.kv_tier_misses
    frame = summarize(None, scrape, "http://x")  # `pagedserve top`
    assert frame.kv_tier_hits == {"host": stats.kv_host_hits, "disk": stats.kv_disk_hits}
    assert "KV tier hits" in _text(render(frame))


def _text(renderable) -> str:
    from rich.console import Console

    console = Console(width=120, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


@pytest.mark.parametrize(("settings", "message"), [
    (dict(tensor_parallel_size=2, kv_cache_dir="/tmp/kv"), "--kv-cache-dir does not work with tensor parallelism"),
    (dict(kv_offload_size=1, speculative_config="draft"), "do not move a draft model's KV cache"),
    (dict(kv_offload_size=1, enable_prefix_caching=False), "drop --no-enable-prefix-caching"),
    (dict(kv_offload_size=1, model="sliding"), "whose every layer slides"),
])
def test_settings_the_tiers_cannot_serve_are_refused(tiny_with_tokenizer, tmp_path, settings, message):
    from pagedserve.engine_args import EngineArgs

    model = str(tiny_with_tokenizer)
    if settings.get("speculative_config") == "draft":
        settings["speculative_config"] = {"method": "draft_model", "model": model, "num_speculative_tokens": 2}
    if settings.pop("model", None) == "sliding":  # (a config is all it reads)
        import transformers

        from conftest import TINY_LLAMA

        transformers.MistralConfig(**{**TINY_LLAMA, "sliding_window": 8}, architectures=["MistralForCausalLM"]
                                   ).save_pretrained(tmp_path)
        (tmp_path / "model.safetensors").write_bytes(b"")
        model = str(tmp_path)
    with pytest.raises(ValueError, match=message):
        EngineArgs(model, device="cpu", **settings).create_engine_config()

"""Pre-quantized checkpoints under tensor parallelism (issue 56): AWQ and GPTQ INT4 (with act
order), FP8 per tensor (static input scales), FP8 in blocks, and compressed-tensors FP8 per
channel and in blocks, each a tiny checkpoint written by the builders of tests/test_int4.py and
tests/test_fp8_checkpoints.py.

Cheap, in one process: both ranks' models, each built through `build_model` with its share of
every parameter, run in two threads whose all-reduces and gathers meet in memory (`ThreadRank`);
their logits equal the one-process model's. Through the engine: `LLM(tensor_parallel_size=2)`
(two gloo processes) gives the one-process greedy tokens. Splits a format cannot make are
refused before anything loads, naming the projection and the numbers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_fp8_checkpoints import FORMATS as FP8_FORMATS
from test_fp8_checkpoints import TINY_128, quantize_state
from test_fp8_checkpoints import write_checkpoint as write_fp8
from test_int4 import TINY
from test_int4 import write_checkpoint as write_int4

from helpers import run_prefill
from pagedserve.distributed.split import SplitUnits, check_quantized_split
from pagedserve.distributed.tensor_parallel import TensorParallel
from pagedserve.models.loader import build_model
from pagedserve.models.source import resolve_model
from pagedserve.quantization import resolve_quantization, split_units

SEQS = [[1, 17, 200, 31, 99, 5, 64, 128, 7, 250, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 42, 77]]
# name -> (builder, keywords): each a checkpoint of a tiny Llama (4 heads, 2 KV heads)
CHECKPOINTS = {
    "awq-g64": ("int4", dict(fmt="awq", group=64)),
    "gptq-v1-asym-g128": ("int4", dict(fmt="gptq", group=128)),
    # (act order: a row-parallel rank's input rows take part of many groups)
    "gptq-v2-sym-actorder-g32": ("int4", dict(fmt="gptq", group=32, act_order=True, sym=True, v1=False)),
    "fp8-tensor-static": ("fp8", {}),
    "fp8-block64": ("fp8", {}),
    "ct-channel": ("fp8", {}),
    "ct-block": ("fp8", {}),
}


class _Meeting:
    """Where the threads of `ThreadRank`s exchange tensors: each puts its own, all wait, each
    reads the combination, all wait again (so a slot is not overwritten while read)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[Any] = [None] * size

    def combine(self, rank: int, x: torch.Tensor, how) -> torch.Tensor:
        self.slots[rank] = x.clone()
        self.barrier.wait()
        out = how(self.slots)
        self.barrier.wait()
        return out


@dataclass(frozen=True)
class ThreadRank(TensorParallel):
    """A rank in a thread of this process: the collectives of `TensorParallel`, done in memory."""

    meeting: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(self.meeting.combine(self.rank, x, lambda xs: torch.stack(xs).sum(0)))

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(self.meeting.combine(self.rank, x, lambda xs: torch.stack(xs).amin(0)))

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(self.meeting.combine(self.rank, x, lambda xs: torch.stack(xs).amax(0)))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.meeting.combine(self.rank, x, lambda xs: torch.cat(xs, dim=-1))


def thread_ranks(size: int) -> list[ThreadRank]:
    """`size` ranks that meet in memory."""
    meeting = _Meeting(size)
    return [ThreadRank(rank, size, meeting=meeting) for rank in range(size)]


def in_threads(ranks: list[ThreadRank], work) -> list:
    """work(tp) in a thread per rank; their results in rank order."""
    results, errors = [None] * len(ranks), []

    def run(tp: ThreadRank) -> None:
        try:
            results[tp.rank] = work(tp)
        except BaseException as e:  # (reported by the test thread; the others fail at the barrier)
            errors.append(e)
            tp.meeting.barrier.abort()

    threads = [threading.Thread(target=run, args=(tp,)) for tp in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="module")
def states():
    """fp32 state dicts of the two tiny Llamas (HF names): TINY for int4, TINY_128 for FP8."""
    import transformers

    out = {}
    for name, cfg in (("int4", TINY), ("fp8", TINY_128)):
        torch.manual_seed(0)
        kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).float()
        out[name] = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return out


@pytest.fixture(scope="module")
def checkpoints(states, tmp_path_factory):
    """name -> folder of each checkpoint in CHECKPOINTS."""
    folders = {}
    for name, (builder, kw) in CHECKPOINTS.items():
        folder = tmp_path_factory.mktemp(name)
        if builder == "int4":
            write_int4(folder, TINY, states["int4"], **kw)
        else:
            qc, how = FP8_FORMATS[name]
            stored, _ = quantize_state(states["fp8"], qc, how)
            write_fp8(folder, TINY_128, stored, qc)
        folders[name] = folder
    return folders


def _build(folder, tp: TensorParallel | None = None):
    source = resolve_model(str(folder))
    kw = {} if tp is None else {"tp": tp}
    return build_model(source, dtype="float32", quantization=resolve_quantization(None, source.hf_config), **kw)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_two_ranks_in_threads_give_the_one_process_logits(name, checkpoints):
    """Each rank loads its share of every quantized tensor from the full checkpoint; the
    ranks' partial products summed and their logits gathered equal one process's."""
    folder = checkpoints[name]
    whole = _build(folder)
    want = run_prefill(whole, SEQS)
    ranks = thread_ranks(2)
    # (built one after the other: loading needs no collective, and building sets the
    # process's default dtype for a while)
    models = [_build(folder, tp) for tp in ranks]
    got = in_threads(ranks, lambda tp: run_prefill(models[tp.rank], SEQS))
    for rank in got:
        for a, b in zip(rank, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    one, half = whole.layers[0], models[1].layers[0]
    act_order = name.endswith("actorder-g32")
    for a, b in ((one.self_attn.qkv_proj, half.self_attn.qkv_proj), (one.mlp.down_proj, half.mlp.down_proj)):
        mine, all_of_it = (sum(p.numel() for p in m.parameters()) for m in (b, a))
        if act_order and b is half.mlp.down_proj:
            # a rank's rows fill each group of 32 partly: runs padded to 32, so the rank holds
            # as many rows as the whole layer, never more (int4.group_layout)
            assert b.w4_perm is not None and b.w4_qweight.shape[0] * 8 == 512 and mine <= all_of_it
        else:
            assert mine < 0.6 * all_of_it  # (a rank holds about half)


@pytest.mark.parametrize("name", ["gptq-v2-sym-actorder-g32", "fp8-block64"])
def test_the_engine_over_two_ranks_gives_the_one_process_tokens(name, checkpoints):
    """LLM(tensor_parallel_size=2) on a pre-quantized checkpoint: two gloo worker processes,
    the one-process greedy tokens. (Two formats, to keep the suite's time: int4 with act
    order and block FP8; every format's loaders and products run over ranks in the thread
    test above, and the engine adds nothing format-specific.)"""
    from pagedserve import LLM, SamplingParams

    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 6 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_seqs=4, kv_cache_memory=1 << 20)
    one = LLM(str(checkpoints[name]), **kw)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    split = LLM(str(checkpoints[name]), tensor_parallel_size=2, **kw)
    try:
        assert [o.outputs[0].token_ids for o in split.generate(prompts, params, use_tqdm=False)] == want
    finally:
        split.close()


def test_splits_a_format_cannot_make_are_refused_before_loading(tmp_path, states):
    """FP8 blocks of 128 rows over 2 ranks: the KV heads' 128 rows leave each rank 64, half a
    block (refused from the config, before any process starts). int4 shares must be whole
    words of 8. Per-channel and per-tensor formats split anywhere."""
    from pagedserve import LLM

    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    stored, _ = quantize_state(states["fp8"], qc, "block")
    folder = write_fp8(tmp_path / "block128", TINY_128, stored, qc)
    with pytest.raises(ValueError, match=r"k_proj and v_proj: 128 outputs, 64 a rank, not a multiple "
                                         r"of 128;.*blocks of 128 x 128 have one scale a block"):
        LLM(str(folder), device="cpu", tensor_parallel_size=2)
    assert _build(folder) is not None  # (one rank reads it)

    model = SimpleNamespace(q_size=256, kv_size=128, intermediate_size=200)
    with pytest.raises(ValueError, match=r"gate_proj and up_proj: 200 outputs, 100 a rank, not a multiple "
                                         r"of 8; down_proj: 200 inputs, 100 a rank.*packed 8 to an int32"):
        check_quantized_split(model, 2, split_units("awq", {"quant_method": "awq"}))
    check_quantized_split(SimpleNamespace(q_size=256, kv_size=128, intermediate_size=208), 2,
                          split_units("gptq", {"quant_method": "gptq"}))  # (104 a rank: 13 words)
    check_quantized_split(model, 4, split_units("fp8", {"quant_method": "fp8"}))  # per tensor: anywhere
    assert split_units("compressed-tensors", FP8_FORMATS["ct-block"][0]) [:2] == (64, 64)
    assert split_units("compressed-tensors", FP8_FORMATS["ct-channel"][0]) == SplitUnits()
    assert split_units("fp8", None) == SplitUnits()  # --quantization fp8: quantized after loading

    from pagedserve.layers.linear import Linear, MergedLinear
    from pagedserve.quantization.fp8_block import Fp8BlockLinearMethod

    with pytest.raises(ValueError, match=r"FP8 blocks of 64 columns .* share of the input is 96 columns"):
        Linear(192, 64, linear_method=Fp8BlockLinearMethod((64, 64)), tp=TensorParallel(0, 2), parallel="row")
    with pytest.raises(ValueError, match=r"FP8 blocks of 64 rows .* share of each output is \[64, 32, 32\]"):
        MergedLinear(64, [128, 64, 64], ("q", "k", "v"), linear_method=Fp8BlockLinearMethod((64, 64)),
                     tp=TensorParallel(1, 2), parallel="column")

"""The batched LoRA kernels (kernels/lora.py) under Triton's interpreter against the torch path
(lora/layer.py): rows of three slots and of the base model mixed, fused projections of three
and two shards of unequal sizes and a plain one, ranks below the slots' width, fp32 and fp16."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see test_kernels_small.py)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from test_kernels_small import _rebuild_for_interpreter  # noqa: E402

_rebuild_for_interpreter()

from pagedserve.kernels.lora import lora_add  # noqa: E402
from pagedserve.lora.layer import LoRABatch, LoRALayer  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shards", [[40, 24, 24], [48, 48], [72]])
def test_lora_kernels_match_the_torch_path(dtype, shards):
    L, R, K, T = 3, 8, 80, 37
    batch = LoRABatch(L, torch.float32)
    starts = [sum(shards[:i]) for i in range(len(shards))]
    layer = LoRALayer(batch, L, R, K, list(zip(starts, shards)), dtype, torch.device("cpu"))
    for slot in range(L):
        for i, n in enumerate(shards):
            r = (slot + i) % R + 1  # (ranks 1..R: the rest of the block stays zero)
            layer.fill(slot, i, torch.randn(r, K).to(dtype) / K**0.5, torch.randn(n, r).to(dtype))
    slots = torch.randint(-1, L, (T + 5,), dtype=torch.int32)
    slots[T:] = 2  # (past the step's rows: never read)
    batch.bind(slots)
    batch.set_step(slots[:T].numpy(), torch.device("cpu"))
    x = torch.randn(T, K).to(dtype)
    y = torch.randn(T, sum(shards)).to(dtype)
    A, B = layer.A, layer.B
    layer.A, layer.B = A.float(), B.float()  # (the torch path in fp32 over the same inputs)
    want = layer(x.float(), y.float().clone())
    got = lora_add(x, y.clone(), A, B, slots, starts)
    torch.testing.assert_close(got.float(), want.float(), **({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32
                                                            else {"rtol": 2e-3, "atol": 2e-3}))
    base = slots[:T] < 0  # (base-model rows untouched, bit for bit)
    assert torch.equal(got[base], y[base])

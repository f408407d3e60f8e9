"""SiLU-and-multiply for the gated MLP as a Triton kernel.

out = silu(gate) * up, with gate = gate_up[:, :I] and up = gate_up[:, I:], computed entirely
in float32 and rounded to the dtype once. Hugging Face computes silu(gate) in the activation
dtype (one rounding) and multiplies in that dtype (a second rounding), so in bf16/fp16 ours is
slightly more accurate and may differ from HF by one unit in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels._utils import check_dtype

_BLOCK = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(
    in_ptr, in_stride,  # [T, 2I], row stride in_stride, columns contiguous
    out_ptr, out_stride,  # [T, I]
    inter,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    src = in_ptr + row * in_stride
    g = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u  # exp overflow for very negative g gives -0, as it should
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension.

    gate_up: [T, 2I] float32/float16/bfloat16; rows may be strided, columns contiguous.
    Returns a new contiguous [T, I] tensor of the same dtype, or writes into `out` ([T, I],
    columns contiguous) and returns it.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"expected gate_up of shape [T, 2I], got {tuple(gate_up.shape)}")
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (T, inter):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(T, inter)}")
    check_dtype(gate_up, out)
    if T == 0 or inter == 0:
        return out
    grid = (T, triton.cdiv(inter, _BLOCK))
    _silu_and_mul_kernel[grid](
        gate_up, gate_up.stride(0), out, out.stride(0), inter, BLOCK=_BLOCK, num_warps=4,
        **pdl.launch_options(out),
    )
    return out


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference with the kernel's semantics (float32, one rounding)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)

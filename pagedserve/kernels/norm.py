"""RMSNorm and fused residual-add + RMSNorm as Triton kernels (one program per row).

Semantics follow Hugging Face's LlamaRMSNorm exactly: the normalised value
x * rsqrt(mean(x^2) + eps) is computed in float32 and rounded to x's dtype, then multiplied
by the weight and rounded again (the product of two fp16/bf16 numbers is exact in float32, so
one float32 multiply and a rounding equals HF's multiply in the activation dtype).
The output always has x's dtype (HF would promote to the weight's dtype if it were wider).
With `round_once` the semantics are Gemma 3's (Transformers' Gemma3RMSNorm): the float32
normalised value times the weight in float32 (pass the weight in float32: Gemma's 1 + w),
rounded to x's dtype once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels._utils import check_dtype, next_pow2, num_warps_for


@triton.jit
def _rms_norm_kernel(
    x_ptr, x_stride,  # [T, H], row stride x_stride, columns contiguous
    res_ptr, res_stride,  # [T, H] residual (read and overwritten) if HAS_RESIDUAL
    w_ptr,  # [H]
    out_ptr, out_stride,  # [T, H]
    H, eps,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_ONCE: tl.constexpr,  # Gemma: no rounding between the normalisation and the weight
    BLOCK: tl.constexpr,  # next power of two >= H
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the sum, rounded once
        tl.store(res_ptr + row * res_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xf * rstd
    if not ROUND_ONCE:
        y = y.to(x.dtype).to(tl.float32)  # HF Llama: hidden.to(input_dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, out, round_once) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"expected x of shape [T, H], got {tuple(x.shape)}")
    T, H = x.shape
    if weight.shape != (H,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{H}] tensor, got {tuple(weight.shape)}")
    if out is None:
        out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    elif out.shape != x.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(x.shape)}")
    tensors = (x, out) if residual is None else (x, out, residual)
    check_dtype(*tensors)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, expected {tuple(x.shape)}")
    if T == 0:
        return out
    block = next_pow2(H)
    res = x if residual is None else residual  # unused pointer when HAS_RESIDUAL is False
    _rms_norm_kernel[(T,)](
        x, x.stride(0), res, res.stride(0), weight, out, out.stride(0), H, float(eps),
        HAS_RESIDUAL=residual is not None, ROUND_ONCE=bool(round_once), BLOCK=block, num_warps=num_warps_for(block),
        **pdl.launch_options(x),
    )
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
    *, round_once: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dimension, HF LlamaRMSNorm semantics (`round_once`: Gemma 3's).

    x: [T, H] float32/float16/bfloat16; rows may be strided (a slice), columns contiguous.
    weight: [H], contiguous, any float dtype. Returns a new contiguous [T, H] tensor of x's
    dtype, or writes into `out` ([T, H], columns contiguous; may be x itself) and returns it.
    x is not modified unless it is `out`.
    """
    return _launch(x, None, weight, eps, out, round_once)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    *, round_once: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (float32 sum, rounded to the dtype); returns (rms_norm(s), s).

    The new residual s is written IN PLACE into `residual`, which is returned as the second
    element; x is not modified unless it is `out`. The normalised output is a new [T, H] tensor
    (or `out`).
    x, residual: [T, H] of one dtype, rows may be strided, columns contiguous.
    `out` may be x itself (each row is read before it is written), never the residual.
    """
    return _launch(x, residual, weight, eps, out, round_once), residual


# ----- torch references (for tests and CPU fallbacks) ---------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, round_once: bool = False) -> torch.Tensor:
    """HF LlamaRMSNorm in torch (`round_once`: Gemma3RMSNorm, with weight = 1 + w); the
    result has x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if not round_once:
        y = y.to(x.dtype).float()
    return (weight.float() * y).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, round_once: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in torch; does not modify its inputs."""
    s = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(s, weight, eps, round_once), s

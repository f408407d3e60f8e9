"""Small-batch weight matmuls on the skinny Triton kernel, and the timing that plans them.

For a decode batch of a few rows the weight matmuls are bound by reading the weights, and
cuBLAS leaves bandwidth unused on some shapes (measured on the H200: 2.0 TB/s for Qwen3-4B's
o_proj at one row). `plan_skinny_matmuls` times, on the real weights, cuBLAS against a few
settings of `kernels.skinny_gemm` for each weight shape and row bucket, and records the
fastest; `matmul` then follows such a plan. Without a plan (CPU, float32, or turned off)
everything is plain `F.linear`. `layers/linear.py` plans a whole model with these.

FP8 weights (`quantization/fp8.py`) are planned the same way: the skinny kernel reads the e4m3
weight (half the bytes) and widens it in registers, leaving x in bf16 (weight-only FP8, as
exact as the weight's rounding allows) for one row, and quantizes x per token for the FP8
tensor cores from two; an FP8 weight's plan goes on to 1,024 rows, where the Triton FP8 GEMM
(`kernels/fp8_gemm.py`) is timed too. The fallback they are timed against quantizes x per
token and multiplies on the FP8 tensor cores with cuBLAS (`torch._scaled_mm`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pagedserve.kernels.fp8_gemm import Fp8GemmConfig
    from pagedserve.kernels.skinny_gemm import SkinnyConfig

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a plan's row counts; 3 rows follow the plan for 4, ...
# an e4m3 weight's: cuBLAS's FP8 product (torch._scaled_mm) is slow up to about 1,024 rows
FP8_ROW_BUCKETS = (*ROW_BUCKETS, 128, 256, 512, 1024)

# Plan for one weight: row bucket -> setting, or None where the fallback (cuBLAS) was faster.
SkinnyPlan = dict[int, "SkinnyConfig | Fp8GemmConfig | None"]

Timer = Callable[[Callable[[], None]], float]  # timer(fn) -> ms


def row_bucket(rows: int, buckets: tuple[int, ...] = ROW_BUCKETS) -> int:
    """The smallest `buckets` entry >= rows (rows <= buckets[-1])."""
    return next(b for b in buckets if b >= rows)


def buckets_for(weight: torch.Tensor) -> tuple[int, ...]:
    """The row buckets a plan for `weight` covers."""
    return FP8_ROW_BUCKETS if weight.dtype == torch.float8_e4m3fn else ROW_BUCKETS


def matmul(x: torch.Tensor, weight: torch.Tensor, plan: SkinnyPlan | None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T -> [T, N], on the skinny kernel where `plan` says so, else
    `fallback_matmul`. An e4m3 weight comes with `scale` (float32 [1, N], see `fallback_matmul`)."""
    rows = x.shape[0]
    buckets = ROW_BUCKETS if scale is None else FP8_ROW_BUCKETS
    if plan and x.dim() == 2 and 0 < rows <= buckets[-1]:
        cfg = plan.get(row_bucket(rows, buckets))
        if cfg is not None and x.stride(-1) == 1:
            return skinny(x, weight, cfg, scale)
    return fallback_matmul(x, weight, scale)


def skinny(x: torch.Tensor, weight: torch.Tensor, cfg: SkinnyConfig | Fp8GemmConfig,
           scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T on the skinny kernel with setting `cfg`. An e4m3 weight (its
    `scale` float32 [1, N]): one row is multiplied in x's dtype (weight-only FP8); for a
    tensor-core setting x is quantized per token first and both go to the FP8 tensor cores
    (an `Fp8GemmConfig`: on the FP8 GEMM of `kernels/fp8_gemm.py`)."""
    from pagedserve.kernels.skinny_gemm import skinny_matmul

    if scale is None:
        return skinny_matmul(x, weight, cfg, out)
    if not cfg.use_dot:
        return skinny_matmul(x, weight, cfg, out, scale.view(-1))
    from pagedserve.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm
    from pagedserve.kernels.fp8_quant import quantize_rows_fp8

    xq, xs = quantize_rows_fp8(x)  # [T, K] e4m3, [T, 1]
    if isinstance(cfg, Fp8GemmConfig):
        return fp8_gemm(xq, xs.view(-1), weight, scale.view(-1), cfg, out, x.dtype)
    return skinny_matmul(xq, weight, cfg, out, scale.view(-1), xs)


def fallback_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """What runs where no skinny setting does: cuBLAS (`F.linear`) for a plain weight; for an
    e4m3 weight with its float32 scale per row `scale` [1, N], x quantized per token and the
    two FP8 operands multiplied on the tensor cores (`fp8_scaled_mm`)."""
    if scale is None:
        return F.linear(x, weight)
    return fp8_scaled_mm(x, weight, scale)


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] (bf16, CUDA) @ (weight e4m3 [N, K] * scale float32 [1, N])^T -> [T, N] in x's
    dtype: x quantized per token (`kernels/fp8_quant.py`), both FP8 operands multiplied on the
    tensor cores with row-wise scales."""
    from pagedserve.kernels.fp8_quant import quantize_rows_fp8

    xq, xs = quantize_rows_fp8(x)  # [T, K] e4m3, [T, 1]
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale, out_dtype=x.dtype)


def _candidates(rows: int, fp8: bool = False) -> list:
    """Settings worth timing for a row bucket (from `gpu_check.py --sections skinny` and
    `skinny_tma` on the H200: one-row FMA programs over a few output columns for one row;
    tensor-core programs for more, pointer loads for qkv_proj, TMA loads with split-K and a
    deep pipeline for the narrow o_proj and down_proj, TMA without split-K for gate_up)."""
    from pagedserve.kernels.fp8_gemm import Fp8GemmConfig
    from pagedserve.kernels.skinny_gemm import SkinnyConfig

    if fp8 and rows > ROW_BUCKETS[-1]:  # the FP8 GEMM's tiles that won start-up plans on the
        # H200 at 128-512 rows (narrow ones give the 2,560-wide o_proj and down_proj enough
        # programs); `benchmarks/fp8_gemm_tune.py` explores more
        return [Fp8GemmConfig(64, 32, 128, 4, 6), Fp8GemmConfig(64, 64, 128, 4, 4, tma=True),
                Fp8GemmConfig(64, 128, 256, 4, 4, tma=True)]
    if fp8:  # e4m3 weights (H200 plans: the one-row FMA settings of bf16 or a 2,048-wide one,
        # the tensor-core ones with twice bf16's BLOCK_K for the same bytes)
        if rows == 1:
            return [SkinnyConfig(8, 512, 4, 1, False, 1), SkinnyConfig(2, 1024, 4, 1, False, 1),
                    SkinnyConfig(4, 2048, 4, 1, False, 1)]
        return [SkinnyConfig(64, 256, 4, 4, True, 1), SkinnyConfig(64, 128, 4, 6, True, 4, True),
                SkinnyConfig(64, 128, 4, 4, True, 1, True)]
    dot = [SkinnyConfig(64, 64, 4, 6, True, 4, True), SkinnyConfig(64, 128, 4, 4, True, 1),
           SkinnyConfig(64, 64, 4, 4, True, 1, True)]
    if rows == 1:
        return [SkinnyConfig(2, 1024, 4, 1, False, 1), SkinnyConfig(8, 512, 4, 1, False, 1),
                SkinnyConfig(2, 512, 2, 1, False, 1), *dot]
    return dot


def _gpu_ms(fn: Callable[[], None], reps: int = 2) -> float:
    """GPU time of fn (ms, best of `reps`), measured behind a sleep kernel so the host's launch
    cost stays out of the figure."""
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(8_000_000)  # ~4 ms: time for the host to queue fn's launches
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


@torch.inference_mode()
def plan_skinny_matmuls(groups: dict[str, list[torch.Tensor]],
                        timer: Timer = _gpu_ms,
                        scales: dict[str, list[torch.Tensor]] | None = None) -> dict[str, SkinnyPlan]:
    """For each group of same-shaped weights (e.g. every layer's o_proj), the fastest way to
    multiply 1..64 rows (1..1,024 for e4m3 weights) by them, timed (`timer(fn)` -> ms) over
    the whole group as a decode step reads it: `fallback_matmul` first (cuBLAS), then each
    candidate setting that agrees with it. An e4m3 group has its weights' scales in
    `scales[name]` (float32 [1, N] each).

    Returns group name -> plan (row bucket -> SkinnyConfig or Fp8GemmConfig, or None for the
    fallback).
    """

    plans: dict[str, SkinnyPlan] = {}
    for name, weights in groups.items():
        group_scales = (scales or {}).get(name) or [None] * len(weights)
        n, k = weights[0].shape
        dtype = torch.bfloat16 if weights[0].dtype == torch.float8_e4m3fn else weights[0].dtype
        plan: SkinnyPlan = {}
        if weights[0].numel() >= 2**31:  # past the kernel's 32-bit offsets: cuBLAS
            plans[name] = plan
            continue
        summary = []
        for rows in buckets_for(weights[0]):
            x = torch.randn(rows, k, device=weights[0].device, dtype=dtype)  # [rows, K]
            out = torch.empty(rows, n, device=x.device, dtype=x.dtype)  # [rows, N]

            def blas(x=x, weights=weights, group_scales=group_scales):
                for w, sc in zip(weights, group_scales):
                    fallback_matmul(x, w, sc)
            best_ms, best = timer(blas), None
            w0, s0 = weights[0], group_scales[0]
            exact = F.linear(x, w0).float() if s0 is None else blas_ref(x, w0, s0)
            # an FP8 tensor-core setting quantizes x as the fallback does: compared with it
            quantized = exact if s0 is None else fallback_matmul(x, w0, s0).float()
            for cfg in _candidates(rows, fp8=s0 is not None):
                ref = quantized if cfg.use_dot else exact
                try:
                    got = skinny(x, w0, cfg, s0, out).float()  # compiles; checked once
                except Exception as e:  # (a setting this GPU or Triton cannot build: not a candidate)
                    logger.warning("skinny matmul %s fails on %s (%s); not used", cfg, name, e)
                    continue
                if (got - ref).norm() > 1e-2 * ref.norm():
                    logger.warning("skinny matmul %s disagrees with cuBLAS on %s; not used", cfg, name)
                    continue

                def run(x=x, cfg=cfg, out=out, weights=weights, group_scales=group_scales):
                    for w, sc in zip(weights, group_scales):
                        skinny(x, w, cfg, sc, out)
                ms = timer(run)
                if ms < best_ms:
                    best_ms, best = ms, cfg
            plan[rows] = best
            summary.append(f"{rows}: {'cuBLAS' if best is None else tuple(best)} {best_ms:.3f} ms")
        plans[name] = plan
        logger.info("matmul plan for %s [%d x %d] x%d: %s", name, n, k, len(weights), "; ".join(summary))
    return plans


@torch.inference_mode()
def blas_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 x [T, K] @ (e4m3 weight [N, K] * scale [1, N])^T: weight-only FP8's exact value."""
    return x.float() @ (weight.float() * scale.view(-1, 1)).t()


def compile_skinny_candidates(weights: list[torch.Tensor]) -> None:
    """Launch every setting `plan_skinny_matmuls` would time, once per weight and row bucket,
    on uninitialised inputs (one weight per shape and dtype is enough: kernels compile per
    shape)."""

    for weight in weights:
        n, k = weight.shape
        if weight.numel() >= 2**31:
            continue
        fp8 = weight.dtype == torch.float8_e4m3fn
        dtype = torch.bfloat16 if fp8 else weight.dtype
        scale = torch.ones(1, n, device=weight.device) if fp8 else None  # float32 [1, N]
        for rows in buckets_for(weight):
            x = torch.zeros(rows, k, device=weight.device, dtype=dtype)  # [rows, K]
            out = torch.empty(rows, n, device=x.device, dtype=x.dtype)  # [rows, N]
            for cfg in _candidates(rows, fp8):
                try:
                    skinny(x, weight, cfg, scale, out)
                except Exception as e:  # the plan skips it too
                    logger.warning("skinny matmul %s fails to build (%s)", cfg, e)

"""Linear layers whose small-batch products may run on the skinny Triton kernel.

For a decode batch of a few rows the weight matmuls are bound by reading the weights, and
cuBLAS leaves bandwidth unused on some shapes (measured on the H200: 2.0 TB/s for Qwen3-4B's
o_proj at one row). `plan_skinny_matmuls` times, on the real weights, cuBLAS against a few
settings of `kernels.skinny_gemm` for each weight shape and row bucket, and records the
fastest; a `Linear` then follows its plan. Without a plan (CPU, float32, or turned off)
everything is plain `F.linear`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagedserve.kernels.skinny_gemm import SkinnyConfig

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a plan's row counts; 3 rows follow the plan for 4, ...

# Plan for one weight: row bucket -> SkinnyConfig, or None where cuBLAS was faster.
SkinnyPlan = dict[int, "SkinnyConfig | None"]


def row_bucket(rows: int) -> int:
    """The smallest ROW_BUCKETS entry >= rows (rows <= ROW_BUCKETS[-1])."""
    return next(b for b in ROW_BUCKETS if b >= rows)


def matmul(x: torch.Tensor, weight: torch.Tensor, plan: SkinnyPlan | None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T -> [T, N], on the skinny kernel where `plan` says so."""
    rows = x.shape[0]
    if plan and x.dim() == 2 and 0 < rows <= ROW_BUCKETS[-1]:
        cfg = plan.get(row_bucket(rows))
        if cfg is not None and x.stride(-1) == 1:
            from pagedserve.kernels.skinny_gemm import skinny_matmul

            return skinny_matmul(x, weight, cfg)
    return F.linear(x, weight)


class Linear(nn.Linear):
    """nn.Linear (no bias on the skinny path) that follows `skinny_plan` for small batches."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.skinny_plan: SkinnyPlan | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return matmul(x, self.weight, self.skinny_plan)
        return F.linear(x, self.weight, self.bias)


def _candidates(rows: int) -> list:
    """Settings worth timing for a row bucket (from `gpu_check.py --sections skinny` and
    `skinny_tma` on the H200: one-row FMA programs over a few output columns for one row;
    tensor-core programs for more, pointer loads for qkv_proj, TMA loads with split-K and a
    deep pipeline for the narrow o_proj and down_proj, TMA without split-K for gate_up)."""
    from pagedserve.kernels.skinny_gemm import SkinnyConfig

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
                        timer: Callable[[Callable[[], None]], float] = _gpu_ms) -> dict[str, SkinnyPlan]:
    """For each group of same-shaped weights (e.g. every layer's o_proj), the fastest way to
    multiply 1..64 rows by them, timed (`timer(fn)` -> ms) over the whole group as a decode
    step reads it: cuBLAS first, then each candidate setting that agrees with cuBLAS.

    Returns group name -> plan (row bucket -> SkinnyConfig, or None for cuBLAS).
    """
    from pagedserve.kernels.skinny_gemm import skinny_matmul

    plans: dict[str, SkinnyPlan] = {}
    for name, weights in groups.items():
        n, k = weights[0].shape
        plan: SkinnyPlan = {}
        if weights[0].numel() >= 2**31:  # past the kernel's 32-bit offsets: cuBLAS
            plans[name] = plan
            continue
        summary = []
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, k, device=weights[0].device, dtype=weights[0].dtype)
            out = torch.empty(rows, n, device=x.device, dtype=x.dtype)

            def blas(x=x, weights=weights):
                for w in weights:
                    F.linear(x, w)
            best_ms, best = timer(blas), None
            ref = F.linear(x, weights[0]).float()
            for cfg in _candidates(rows):
                got = skinny_matmul(x, weights[0], cfg, out).float()  # compiles; checked once
                if (got - ref).norm() > 1e-2 * ref.norm():
                    logger.warning("skinny matmul %s disagrees with cuBLAS on %s; not used", cfg, name)
                    continue

                def skinny(x=x, cfg=cfg, out=out, weights=weights):
                    for w in weights:
                        skinny_matmul(x, w, cfg, out)
                ms = timer(skinny)
                if ms < best_ms:
                    best_ms, best = ms, cfg
            plan[rows] = best
            summary.append(f"{rows}: {'cuBLAS' if best is None else tuple(best)} {best_ms:.3f} ms")
        plans[name] = plan
        logger.info("matmul plan for %s [%d x %d] x%d: %s", name, n, k, len(weights), "; ".join(summary))
    return plans


def _model_groups(model: nn.Module) -> dict[str, list[Linear]]:
    """Every bias-free `Linear` of `model`, grouped by role (the attribute name, e.g. every
    layer's `o_proj`) and shape."""
    groups: dict[str, list[Linear]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.bias is None:
            key = f"{name.rsplit('.', 1)[-1]} {tuple(mod.weight.shape)}"
            groups.setdefault(key, []).append(mod)
    return groups


def plan_model_matmuls(model: nn.Module, logits_weight: torch.Tensor,
                       timer: Callable[[Callable[[], None]], float] = _gpu_ms) -> dict[str, SkinnyPlan]:
    """Plan every bias-free `Linear` of `model`, grouped by role and shape, plus the logits
    matmul (`logits_weight`, returned under "logits"); sets each Linear's `skinny_plan`."""
    groups = _model_groups(model)
    weights = {key: [m.weight for m in mods] for key, mods in groups.items()}
    weights["logits"] = [logits_weight]
    plans = plan_skinny_matmuls(weights, timer)
    for key, mods in groups.items():
        for m in mods:
            m.skinny_plan = plans[key]
    return plans


@torch.inference_mode()
def compile_plan_candidates(model: nn.Module, logits_weight: torch.Tensor) -> None:
    """Launch every setting `plan_model_matmuls` will time, once per weight shape and row
    bucket, on uninitialised inputs: the plan's rehearsal for `kernels/compile_ahead.py`."""
    from pagedserve.kernels.skinny_gemm import skinny_matmul

    shapes = {tuple(mods[0].weight.shape): mods[0].weight for mods in _model_groups(model).values()}
    shapes[tuple(logits_weight.shape)] = logits_weight
    for (n, k), weight in shapes.items():
        if weight.numel() >= 2**31:
            continue
        for rows in ROW_BUCKETS:
            x = torch.empty(rows, k, device=weight.device, dtype=weight.dtype)
            out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
            for cfg in _candidates(rows):
                skinny_matmul(x, weight, cfg, out)

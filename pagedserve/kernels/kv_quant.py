"""FP8 (e4m3) KV-cache elements inside the Triton kernels: quantize on write, widen on read.

The stored element of x is e4m3(clamp(x / scale, -448, 448)), rounded to nearest even; the
value read back is stored * scale (`kernels/kv_quant_torch.py` is the same math in torch). The
rounding to the e4m3 grid is done here in float32, so the final conversion is exact: the
same bits on the GPU, under Triton's CPU interpreter (whose own fp8 rounding is not
round-to-nearest-even) and in torch. Widening e4m3 to float32, bfloat16 or float16 is exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX = 448.0


@triton.jit
def quantize_e4m3(x, scale):
    """float32 x [any shape] / scale -> float8e4nv, clamped to +-448, round to nearest even."""
    # (div_rn: IEEE division, as torch's; `/` would be the approximate div.full.f32 on the GPU)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    bits = y.to(tl.int32, bitcast=True)
    # normal e4m3 (|y| >= 2**-6): keep 3 mantissa bits, ties to even, in the integer bits
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # subnormal e4m3 (|y| < 2**-6): multiples of 2**-9; adding 1.5 * 2**14 (whose float32 ulp
    # is 2**-9) rounds to them, ties to even; the sign is put back (-0.0 stays -0.0)
    small = (tl.abs(y) + 24576.0) - 24576.0
    small = (small.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(y) < 0.015625, small, normal).to(tl.float8e4nv)


@triton.jit
def store_kv(ptr, x, mask, scale_ptr, FP8: tl.constexpr):
    """Store x [any shape] at ptr: quantized with the scale at scale_ptr if FP8, else cast
    to the cache's dtype (scale_ptr is then not read)."""
    if FP8:
        tl.store(ptr, quantize_e4m3(x.to(tl.float32), tl.load(scale_ptr)), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_kv(KC, VC, off, d, nmask, like):
    """K and V rows [BLOCK_N, D] at cache offsets off [BLOCK_N] (d: arange(D)), masked rows
    0, in like's dtype (an FP8 cache's elements widened exactly, unscaled: see kv_scales)."""
    k = tl.load(KC + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0).to(like.dtype)
    v = tl.load(VC + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0).to(like.dtype)
    return k, v


@triton.jit
def kv_scales(KVScale, scale_log2, FP8: tl.constexpr):
    """(score scale, output scale) of attention over widened cache elements: the K scale of
    an FP8 cache (KVScale: [2] float32, K then V) times the softmax's scale_log2, and its V
    scale, by which the attention output is multiplied; (scale_log2, 1.0) for other caches."""
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(KVScale)
        v_scale = tl.load(KVScale + 1)
    return scale_log2 * k_scale, v_scale

"""Split fused qkv, optional per-head q/k RMSNorm (Qwen3), and rotary embedding: one kernel.

One program per token handles all of its q and k heads as [heads, head_dim / 2] blocks (the
low and high halves of each head, which is what "rotate half" pairs up).

Rotary embedding follows HF Llama's "rotate half" layout: freqs = position * inv_freq in
float32, emb = cat(freqs, freqs), out = x * cos(emb) + rotate_half(x) * sin(emb) with
rotate_half(x) = cat(-x2, x1). HF rounds cos/sin to the activation dtype and multiplies in
that dtype; we keep cos/sin and the arithmetic in float32 and round the result once (more
accurate; in bf16/fp16 it may differ from HF by a unit in the last place). The q/k norm has
HF LlamaRMSNorm semantics (see `norm.py`): normalised value rounded to the dtype, times the
weight, rounded again; or with `norm_round_once` Gemma 3's: the float32 normalised value times
the weight in float32, rounded once (the rounding before RoPE is kept in both: Transformers
applies RoPE to the rounded norm's output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels._utils import check_dtype, check_kv_cache_dtype, next_pow2, num_warps_for
from pagedserve.kernels.kv_quant import store_kv


@triton.jit
def _norm_rope_heads(
    src, dst, dst2, heads2, w_ptr, cos, sin, eps,  # src: one token's H heads [H, 2*HALF]; dst likewise
    scale2_ptr,  # dst2's float32 scale (if FP8)
    H: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
    ROUND_ONCE: tl.constexpr,  # the norm's weight multiplies before its one rounding (Gemma)
    STORE2: tl.constexpr,  # also write the first heads2 heads (0 or H) to dst2 (a KV-cache slot)
    FP8: tl.constexpr,  # dst2 is an FP8 cache: the value rounded to dst's dtype, then quantized
):
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = (h < H) & (d < HALF)  # [H_PAD, HALF]
    offs = h * (2 * HALF) + d
    lo = tl.load(src + offs, mask=mask, other=0.0)
    hi = tl.load(src + offs + HALF, mask=mask, other=0.0)
    lo_f = lo.to(tl.float32)
    hi_f = hi.to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(lo_f * lo_f, axis=1) + tl.sum(hi_f * hi_f, axis=1)) / (2 * HALF)
        rstd = (1.0 / tl.sqrt(var + eps))[:, None]  # [H_PAD, 1]
        w_lo = tl.load(w_ptr + d).to(tl.float32)  # [1, HALF]
        w_hi = tl.load(w_ptr + HALF + d).to(tl.float32)
        lo_f = lo_f * rstd
        hi_f = hi_f * rstd
        if not ROUND_ONCE:  # Llama: the normalised value rounded before the weight
            lo_f = lo_f.to(lo.dtype).to(tl.float32)
            hi_f = hi_f.to(lo.dtype).to(tl.float32)
        lo_f = (w_lo * lo_f).to(lo.dtype).to(tl.float32)
        hi_f = (w_hi * hi_f).to(lo.dtype).to(tl.float32)
    out_lo = lo_f * cos - hi_f * sin
    out_hi = hi_f * cos + lo_f * sin
    tl.store(dst + offs, out_lo.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + offs + HALF, out_hi.to(dst.dtype.element_ty), mask=mask)
    if STORE2:
        mask2 = (h < heads2) & (d < HALF)
        store_kv(dst2 + offs, out_lo.to(dst.dtype.element_ty), mask2, scale2_ptr, FP8)
        store_kv(dst2 + offs + HALF, out_hi.to(dst.dtype.element_ty), mask2, scale2_ptr, FP8)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, qkv_stride,  # [T, (HQ + 2*HKV) * D], row stride qkv_stride
    pos_ptr,  # [T] int64 / int32
    inv_freq_ptr,  # [HALF] float32
    qw_ptr, kw_ptr,  # [D] norm weights (ignored unless HAS_NORM)
    q_ptr, k_ptr,  # [T, HQ, D], [T, HKV, D], contiguous
    kc_ptr, vc_ptr, slot_ptr,  # KV cache [num_blocks, BLOCK_SIZE, HKV, D] x2, slots [T] (if STORE)
    cache_block_stride, cache_slot_stride,
    scale_ptr,  # [2] float32 (k_scale, v_scale) of an FP8 cache (if FP8)
    eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr, ROUND_ONCE: tl.constexpr, STORE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    d = tl.arange(0, HALF)
    freqs = pos * tl.load(inv_freq_ptr + d)  # float32 product, as in the torch reference
    # Reduce the angle to about [-pi, pi] ourselves (Cody-Waite, 2*pi = C1 + C2 + C3; k*C1 and
    # k*C2 are exact for k < 2**16, i.e. angles < 4e5): accurate whether tl.cos/tl.sin lower to
    # precise libdevice calls or to fast approximations that are only good near zero.
    k = tl.floor(freqs * 0.15915493667125702 + 0.5)
    r = ((freqs - k * 6.28125) - k * 0.0019378662109375) + k * 2.5590313510230747e-06
    cos = tl.cos(r)[None, :]
    sin = tl.sin(r)[None, :]
    row = qkv_ptr + t * qkv_stride
    q_dst = q_ptr + t * (HQ * 2 * HALF)
    _norm_rope_heads(row, q_dst, q_dst, 0, qw_ptr, cos, sin, eps, scale_ptr, HQ, HQ_PAD, HALF, HAS_NORM,
                     ROUND_ONCE, False, False)
    k_dst = k_ptr + t * (HKV * 2 * HALF)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        heads = tl.where(slot >= 0, HKV, 0)  # a negative slot is padding: nothing to cache
        at = (slot // BLOCK_SIZE) * cache_block_stride + (slot % BLOCK_SIZE) * cache_slot_stride
        at = tl.where(slot >= 0, at, 0)
        _norm_rope_heads(row + HQ * 2 * HALF, k_dst, kc_ptr + at, heads, kw_ptr, cos, sin, eps,
                         scale_ptr, HKV, HKV_PAD, HALF, HAS_NORM, ROUND_ONCE, True, FP8)
        vh = tl.arange(0, HKV_PAD)[:, None]  # v is copied as it is
        vd = tl.arange(0, 2 * HALF)[None, :]
        v_offs = vh * (2 * HALF) + vd
        v_mask = (vh < heads) & (vd < 2 * HALF)
        v = tl.load(row + (HQ + HKV) * 2 * HALF + v_offs, mask=v_mask)
        store_kv(vc_ptr + at + v_offs, v, v_mask, scale_ptr + 1, FP8)
    else:
        _norm_rope_heads(row + HQ * 2 * HALF, k_dst, k_dst, 0, kw_ptr, cos, sin, eps,
                         scale_ptr, HKV, HKV_PAD, HALF, HAS_NORM, ROUND_ONCE, False, False)


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    out_q: torch.Tensor | None = None,
    out_k: torch.Tensor | None = None,
    kv_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    norm_round_once: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split qkv into (q, k, v), RMSNorm q and k per head (if weights given), apply RoPE;
    optionally also write each token's k (after RoPE) and v into the paged KV cache.

    qkv: [T, (Hq + 2*Hkv) * D], rows [q heads | k heads | v heads]; rows may be strided,
    columns contiguous. positions: [T] int64/int32. inv_freq: [D/2] float32.
    q_norm_weight, k_norm_weight: [D] (both or neither), any float dtype; `norm_round_once`:
    Gemma 3's norm (`RMSNorm(round_once=True)`, weights in float32). head_dim: a power of two.
    Returns q [T, Hq, D] and k [T, Hkv, D], new contiguous tensors (or `out_q`/`out_k`,
    which must be contiguous), and v [T, Hkv, D]: a VIEW into qkv (not contiguous in the
    token dimension; `store_kv_cache` accepts it as is). qkv is not modified.
    kv_cache ([2, num_blocks, block_size, Hkv, D], each slot's [Hkv, D] contiguous) with
    slot_mapping ([T], negative = skip): the same write as `store_kv_cache(k, v, kv_cache,
    slot_mapping, kv_scale)`, done here to save a kernel and a second read of k and v (an
    FP8 cache, with its [2] float32 kv_scale, gets them quantized just as that call would).
    """
    T = qkv.shape[0]
    D, half = head_dim, head_dim // 2
    q_size, kv_size = num_heads * D, num_kv_heads * D
    if qkv.dim() != 2 or qkv.shape[1] != q_size + 2 * kv_size:
        raise ValueError(f"qkv has shape {tuple(qkv.shape)}, expected [T, {q_size + 2 * kv_size}]")
    if D < 2 or next_pow2(D) != D:
        raise ValueError(f"head_dim must be a power of two, got {D}")
    if positions.shape != (T,) or inv_freq.shape != (half,) or inv_freq.dtype != torch.float32:
        raise ValueError("positions must be [T]; inv_freq must be float32 [head_dim / 2]")
    has_norm = q_norm_weight is not None
    if has_norm != (k_norm_weight is not None):
        raise ValueError("pass both q_norm_weight and k_norm_weight, or neither")
    if has_norm and (q_norm_weight.shape != (D,) or k_norm_weight.shape != (D,)):
        raise ValueError(f"q/k norm weights must be [{D}]")
    if out_q is None:
        out_q = torch.empty((T, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    if out_k is None:
        out_k = torch.empty((T, num_kv_heads, D), dtype=qkv.dtype, device=qkv.device)
    if out_q.shape != (T, num_heads, D) or out_k.shape != (T, num_kv_heads, D):
        raise ValueError("out_q / out_k have the wrong shape")
    if not (out_q.is_contiguous() and out_k.is_contiguous()):
        raise ValueError("out_q and out_k must be contiguous")
    check_dtype(qkv, out_q, out_k)
    v = qkv[:, q_size + kv_size :].view(T, num_kv_heads, D)
    if T == 0:
        return out_q, out_k, v
    qw = q_norm_weight.contiguous() if has_norm else inv_freq  # dummy pointer when unused
    kw = k_norm_weight.contiguous() if has_norm else inv_freq
    hq_pad, hkv_pad = next_pow2(num_heads), next_pow2(num_kv_heads)
    store, fp8 = kv_cache is not None, False
    if store:
        if (kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, D)
                or kv_cache.stride(3) != D or kv_cache.stride(4) != 1):
            raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)} / strides {kv_cache.stride()}, "
                             f"expected [2, N, B, {num_kv_heads}, {D}] with each slot contiguous")
        if slot_mapping is None or slot_mapping.shape != (T,):
            raise ValueError(f"slot_mapping must be [{T}] when kv_cache is given")
        fp8 = check_kv_cache_dtype(kv_cache, qkv, kv_scale)
    kc, vc = (kv_cache[0], kv_cache[1]) if store else (out_k, out_k)  # dummy pointers when unused
    _qk_norm_rope_kernel[(T,)](
        qkv, qkv.stride(0), positions, inv_freq.contiguous(), qw, kw, out_q, out_k,
        kc, vc, slot_mapping if store else positions,
        kc.stride(0) if store else 0, kc.stride(1) if store else 0,
        kv_scale if fp8 else inv_freq, float(eps),
        HQ=num_heads, HKV=num_kv_heads, HQ_PAD=hq_pad, HKV_PAD=hkv_pad, HALF=half,
        HAS_NORM=has_norm, ROUND_ONCE=bool(norm_round_once and has_norm), STORE=store, BLOCK_SIZE=kv_cache.shape[2] if store else 1,
        FP8=fp8,
        num_warps=num_warps_for(hq_pad * D), **pdl.launch_options(qkv),
    )
    return out_q, out_k, v


def qk_norm_rope_ref(
    qkv, positions, inv_freq, num_heads, num_kv_heads, head_dim,
    q_norm_weight=None, k_norm_weight=None, eps=1e-6, norm_round_once=False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference with the kernel's semantics (float32 RoPE, one rounding)."""
    from pagedserve.kernels.norm import rms_norm_ref

    T, D = qkv.shape[0], head_dim
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q, k, v = q.reshape(T, num_heads, D), k.reshape(T, num_kv_heads, D), v.view(T, -1, D)
    if q_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps, norm_round_once)
        k = rms_norm_ref(k, k_norm_weight, eps, norm_round_once)
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    cos, sin = emb.cos(), emb.sin()

    def rope(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rot = torch.cat((-xf[..., D // 2 :], xf[..., : D // 2]), dim=-1)
        return (xf * cos + rot * sin).to(x.dtype)

    return rope(q), rope(k), v

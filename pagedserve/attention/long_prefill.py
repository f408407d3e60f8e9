"""Prefill chunks over a long context, on torch's fused attention kernels (issue 30).

The Triton extend kernel (`kernels/paged_extend.py`) reads the paged cache a 16-token page
at a time and reaches about 300 TFLOP/s; FlashAttention and cuDNN reach far more on long
contexts but want contiguous K/V. A chunk of at least `MIN_QUERIES` new tokens over at
least `MIN_KEYS` keys therefore takes this path instead:

- its own keys (a causal square) come straight from the step's new K/V;
- the earlier context is read in pieces of `PIECE_KEYS` keys, each gathered out of the
  paged cache into a fixed workspace (allocated once, before the memory profile, so the KV
  cache is sized around it) and attended without a mask;
- the partial results merge by their log-sum-exp, in float32.

At C new tokens the gather reads and writes 4 KiB a key and layer (Qwen3: 8 KV heads x 128
x 2 sides x 2 bytes) against 4 x C x 32 x 128 FLOPs of attention a key: at 4.25 TB/s and
600 TFLOP/s, about 70 / C of the attention time (3.5% at C = 2,048, 0.9% at 8,192).

Kernels (`KernelConfig.long_prefill`): "flash" (torch's FlashAttention 2), "cudnn"
(cuDNN's fused attention) or "math" (plain torch, any device: the reference the tests use).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.config import LONG_PREFILL_KERNELS

MIN_KEYS = 16384  # a chunk's context (its own tokens included) from which it may take this path
MIN_QUERIES = 1024  # ... and its new tokens
PIECE_KEYS = 32768  # keys of the earlier context gathered and attended at once


def long_chunks(query_start_loc: np.ndarray, seq_lens: np.ndarray, min_keys: int = MIN_KEYS,
                min_queries: int = MIN_QUERIES) -> np.ndarray:
    """Indices of the sequences of a step (query starts [S + 1], context lengths [S]) whose
    chunk takes the long-context path."""
    q_lens = np.diff(np.asarray(query_start_loc))
    return np.flatnonzero((q_lens >= min_queries) & (np.asarray(seq_lens) >= min_keys))


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: q [H, C, D], k/v [H, S, D] (heads matched) -> (out [H, C, D], lse [H, C])."""
    s = torch.einsum("hcd,hsd->hcs", q.float(), k.float()) * scale
    if causal:  # square: query i sees keys 0..i
        c = q.shape[1]
        s = s.masked_fill(torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("hcs,hsd->hcd", torch.exp(s - lse[..., None]), v.float()), lse


class LongPrefill:
    """The long-context path of one attention backend: its kernel and gather workspace."""

    def __init__(self, kernel: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype, device: torch.device | str, piece_keys: int = PIECE_KEYS,
                 min_keys: int = MIN_KEYS, min_queries: int = MIN_QUERIES, expand_kv: bool = False) -> None:
        if kernel not in LONG_PREFILL_KERNELS[1:]:
            raise ValueError(f"long_prefill must be one of {LONG_PREFILL_KERNELS}, got {kernel!r}")
        self.kernel = kernel
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.min_keys, self.min_queries = min_keys, min_queries
        self.piece_keys = piece_keys
        self.expand_kv = expand_kv  # repeat each KV head for its query heads (kernels without GQA)
        # [2, piece_keys, Hkv, D]: one piece of earlier context (keys, values), contiguous
        self.workspace = torch.empty((2, piece_keys, num_kv_heads, head_dim), dtype=dtype, device=device)

    def runs(self) -> bool:
        """Whether this torch's kernel takes these heads (a tiny causal call on the device)."""
        dev, dt = self.workspace.device, self.workspace.dtype
        q = torch.randn(64, self.num_heads, self.head_dim, device=dev).to(dt)
        kv = torch.randn(64, self.num_kv_heads, self.head_dim, device=dev).to(dt)
        try:
            out, lse = self._attend(q, kv, kv, causal=True)
        except (RuntimeError, NotImplementedError, AttributeError):  # (an op this torch lacks)
            return False
        return out.shape == (self.num_heads, 64, self.head_dim) and bool(torch.isfinite(lse).all())

    def chunks(self, query_start_loc: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        """`long_chunks` with this path's thresholds."""
        return long_chunks(query_start_loc, seq_lens, self.min_keys, self.min_queries)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """q [C, Hq, D], k/v [S, Hkv, D] (S = C when causal) -> (out [Hq, C, D], lse [Hq, C]
        float32), by this path's kernel."""
        hq, c = self.num_heads, q.shape[0]
        qh, kh, vh = (x.transpose(0, 1) for x in (q, k, v))  # [H, L, D] views
        if self.kernel == "math" or self.expand_kv:
            g = hq // self.num_kv_heads
            kh, vh = kh.repeat_interleave(g, 0), vh.repeat_interleave(g, 0)
        if self.kernel == "math":
            return _math(qh, kh, vh, self.scale, causal)
        if self.kernel == "flash":
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                qh[None], kh[None], vh[None], 0.0, is_causal=causal, scale=self.scale)
        else:
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qh[None], kh[None], vh[None], None, True, 0.0, causal, False, scale=self.scale)
        return res[0][0], res[1].reshape(hq, -1)[:, :c]  # (a kernel may pad or add a unit dim)

    def attend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               cache: torch.Tensor, block_row: torch.Tensor, seq_len: int, out: torch.Tensor) -> None:
        """One chunk: q, k_new, v_new [C, H*, D] (its new tokens' rows), the cache
        [2, num_blocks, block_size, Hkv, D] holding its first seq_len - C keys, its
        block-table row [max_blocks] int32; writes out [C, Hq, D]."""
        c = q.shape[0]
        before = seq_len - c
        acc, lse = self._attend(q, k_new, v_new, causal=True)  # [Hq, C, D], [Hq, C]
        if before == 0:  # a whole prompt: nothing to merge
            out.copy_(acc.transpose(0, 1))
            return
        acc = acc.float()
        page = cache.shape[2]
        assert self.piece_keys % page == 0, "pieces must start on a page"
        for start in range(0, before, self.piece_keys):
            n = min(self.piece_keys, before - start)
            first, last = start // page, -(-(start + n) // page)
            blocks = block_row[first:last].long()
            ws = self.workspace[:, : (last - first) * page].view(2, last - first, page, *cache.shape[3:])
            torch.index_select(cache[0], 0, blocks, out=ws[0])
            torch.index_select(cache[1], 0, blocks, out=ws[1])
            k = self.workspace[0, :n]
            v = self.workspace[1, :n]
            o_p, lse_p = self._attend(q, k, v, causal=False)
            m = torch.maximum(lse, lse_p)
            w, w_p = torch.exp(lse - m), torch.exp(lse_p - m)
            total = w + w_p
            acc.mul_((w / total)[..., None]).addcmul_(o_p, (w_p / total)[..., None])  # (in place)
            lse = m + torch.log(total)
        out.copy_(acc.transpose(0, 1))

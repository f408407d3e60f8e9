"""The second half of a decoder layer for one decode row, in one persistent launch.

o_proj, the residual add + RMSNorm, gate_up, SiLU-and-mul and down_proj, which are five
kernels otherwise. At batch 1 a decode step is bound by reading the weights, and every kernel
boundary leaves the memory idle: the next kernel only starts loading once the last program of
the previous one has finished, and then ramps up from an empty pipeline. Here a fixed grid of
programs, all resident at once, walks three phases separated by grid-wide barriers (a counter
every program bumps, then spins on). Weights do not depend on the activations, so a program
loads the first weight tile of its next phase *before* it waits at a barrier (and of its
first phase before it waits for the previous kernel): the memory keeps streaming while the
slowest program finishes.

- Phase 1: o = attn @ Wo^T, rows of Wo split among the programs; s = residual + o, written
  back into the residual.
- Phase 2: each program computes 1/rms(s) from the whole row (from L2), then its share of the
  intermediates: act[i] = silu(gate[i]) * up[i], gate and up from interleaved rows of Wgu
  times the normalised row.
- Phase 3: out = act @ Wd^T, rows of Wd split among the programs.

Roundings follow the unfused path exactly (matmul outputs, the residual sum, the normalised
row and the activation are rounded to the dtype where the separate kernels store them); only
the order of the float32 sums differs. The grid must fit on the GPU at once, or the barriers
would wait forever: `fused_mlp` sizes it from the compiled kernel's registers and shared
memory, with room for the weight prefetch's one-warp programs beside it. Under the interpreter (CPU tests) the phases may
run as separate launches, where no barrier is needed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl, weight_prefetch
from pagedserve.kernels._utils import check_dtype, interpreting, next_pow2
from pagedserve.kernels.skinny_gemm import _signal


@triton.jit
def _tile(W, stride_w, rows, row_ok, k0, K, BLOCK_K: tl.constexpr):
    """Raw weight tile W[rows, k0 : k0 + BLOCK_K] (zeros outside); [R, BLOCK_K]."""
    rk = k0 + tl.arange(0, BLOCK_K)
    mask = row_ok[:, None] & (rk < K)[None, :]
    return tl.load(W + rows[:, None] * stride_w + rk[None, :], mask=mask, other=0.0)


@triton.jit
def _rows(chunk, r0, r1, inter, ROWS: tl.constexpr, DUAL: tl.constexpr):
    """Weight rows of a program's row chunk: [ROWS] indices and validity. DUAL (gate_up):
    chunk c covers intermediates r0 + c * ROWS / 2 + j, row 2j their gate, row 2j + 1 their up."""
    j = tl.arange(0, ROWS)
    if DUAL:
        i = r0 + chunk * (ROWS // 2) + j // 2
        return i + (j % 2) * inter, i < r1
    i = r0 + chunk * ROWS + j
    return i, i < r1


@triton.jit
def _sync(BAR, target, ASM: tl.constexpr):
    """Grid barrier: every program has bumped BAR (its writes released) once BAR >= target.
    One thread per program polls (with a short sleep between reads), the others wait for it at
    the block barrier; polling by every thread would crowd the counter's L2 slice while the
    slowest programs still stream weights. Without ASM (the interpreter): a plain spin."""
    tl.debug_barrier()
    tl.atomic_add(BAR, 1, sem="release", scope="gpu")
    if ASM:
        tl.inline_asm_elementwise(
            """{
            .reg .pred p;
            .reg .b32 t, v;
            mov.u32 t, %tid.x;
            setp.ne.u32 p, t, 0;
            @p bra DONE;
            WAIT:
            ld.acquire.gpu.global.b32 v, [$1];
            setp.ge.s32 p, v, $2;
            @p bra DONE;
            nanosleep.u32 32;
            bra WAIT;
            DONE:
            mov.u32 $0, 0;
            }""", "=r,l,r", [BAR.to(tl.int64, bitcast=True), target], dtype=tl.int32, is_pure=False, pack=1)
    else:
        seen = tl.load(BAR, volatile=True)
        while seen < target:
            seen = tl.load(BAR, volatile=True)
        tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _phase(W, stride_w, N, K, inter, X, RES, G, rstd, w,
           OUT, pid, nprog,
           MODE: tl.constexpr,  # 1: o_proj + residual, 2: gate_up + SiLU, 3: down_proj
           ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
           STAGES: tl.constexpr):  # > 0: Triton pipelines the tile loads (w unused), else by hand
    """This program's rows of one phase; `w` is its first tile, already loaded. Each iteration
    loads the next tile before it multiplies the current one by its x slice; the products
    stay in a tile and are summed across threads once per row chunk (a sum per iteration
    would synchronise the warps each time)."""
    DUAL: tl.constexpr = MODE == 2
    kt = tl.cdiv(K, BLOCK_K)
    rk = tl.arange(0, BLOCK_K)
    if DUAL:
        r0 = pid * inter // nprog
        r1 = (pid + 1) * inter // nprog
        total = tl.cdiv(r1 - r0, ROWS // 2) * kt
    else:
        r0 = pid * N // nprog
        r1 = (pid + 1) * N // nprog
        total = tl.cdiv(r1 - r0, ROWS) * kt
    acc2 = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)  # products, summed over the row once per chunk
    for t in tl.range(0, total, num_stages=max(STAGES, 1)):
        chunk = t // kt
        kc = t - chunk * kt
        if STAGES > 0:
            c_rows, c_ok = _rows(chunk, r0, r1, inter, ROWS, DUAL)
            wt = _tile(W, stride_w, c_rows, c_ok, kc * BLOCK_K, K, BLOCK_K)
        else:
            wt = w
            nxt = t + 1
            n_chunk = nxt // kt
            n_rows, n_ok = _rows(n_chunk, r0, r1, inter, ROWS, DUAL)
            w = _tile(W, stride_w, n_rows, n_ok & ((n_rows * 0 + nxt) < total),
                      (nxt - n_chunk * kt) * BLOCK_K, K, BLOCK_K)
        k_ok = kc * BLOCK_K + rk < K
        xa = tl.load(X + kc * BLOCK_K + rk, mask=k_ok, other=0.0, cache_modifier=".cg")  # [BLOCK_K]
        if DUAL:
            # the normalised row as the norm kernel rounds it: x * rstd, then times the weight
            xb = tl.load(G + kc * BLOCK_K + rk, mask=k_ok, other=0.0)
            x = (xb.to(tl.float32) * (xa.to(tl.float32) * rstd).to(xa.dtype).to(tl.float32))
            x = x.to(xa.dtype).to(tl.float32)
        else:
            x = xa.to(tl.float32)
        acc2 += wt.to(tl.float32) * x[None, :]
        if kc == kt - 1:  # the chunk's rows are complete
            acc = tl.sum(acc2, axis=1)  # [ROWS]
            rows, ok = _rows(chunk, r0, r1, inter, ROWS, DUAL)
            if MODE == 1:
                o = acc.to(OUT.dtype.element_ty).to(tl.float32)
                r = tl.load(RES + rows, mask=ok, other=0.0).to(tl.float32)
                tl.store(RES + rows, (o + r).to(OUT.dtype.element_ty), mask=ok)
            elif MODE == 2:
                g, u = tl.split(tl.reshape(acc.to(OUT.dtype.element_ty).to(tl.float32), [ROWS // 2, 2]))
                i = r0 + chunk * (ROWS // 2) + tl.arange(0, ROWS // 2)
                tl.store(OUT + i, (g / (1.0 + tl.exp(-g)) * u).to(OUT.dtype.element_ty), mask=i < r1)
            else:
                tl.store(OUT + rows, acc.to(OUT.dtype.element_ty), mask=ok)
            acc2 = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)


@triton.jit
def _prefetch_l2(W, stride_w, N, K, inter, pid, nprog, MODE: tl.constexpr, ROWS: tl.constexpr,
                 NBYTES: tl.constexpr):
    """Ask L2 for the first NBYTES of each row of this program's first chunk in phase MODE
    (`cp.async.bulk.prefetch.L2`, fire and forget), ahead of a wait."""
    if MODE == 2:
        r0 = pid * inter // nprog
        r1 = (pid + 1) * inter // nprog
    else:
        r0 = pid * N // nprog
        r1 = (pid + 1) * N // nprog
    rows, ok = _rows(0, r0, r1, inter, ROWS, MODE == 2)
    nbytes = tl.minimum(K * 2, NBYTES) // 16 * 16  # 2-byte weights (the kernel's dtypes on the GPU)
    addr = W.to(tl.int64, bitcast=True) + rows.to(tl.int64) * stride_w * 2
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, ok.to(tl.int32), (rows * 0 + nbytes).to(tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1)


@triton.jit
def _first_tile(W, stride_w, N, K, inter, pid, nprog, MODE: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """The first weight tile of this program in phase MODE (loaded ahead of a wait)."""
    if MODE == 2:
        r0 = pid * inter // nprog
        r1 = (pid + 1) * inter // nprog
    else:
        r0 = pid * N // nprog
        r1 = (pid + 1) * N // nprog
    rows, ok = _rows(0, r0, r1, inter, ROWS, MODE == 2)
    return _tile(W, stride_w, rows, ok, 0, K, BLOCK_K)


@triton.jit(do_not_specialize=["SIGNAL_AT"])
def _fused_mlp_kernel(
    A,  # [K_O] attention output (one row)
    RES,  # [H] residual: read, then overwritten with residual + o_proj(A)
    WO, WGU, WD,  # [H, K_O], [2I, H] (rows [gate | up]), [H, I]; rows contiguous
    G,  # [H] post-attention RMSNorm weight
    ACT,  # [I] scratch: silu(gate) * up
    OUT,  # [H] down_proj's output
    BAR,  # int32 [2]: barrier arrivals, programs finished (zero between launches)
    PROGRESS, SIGNAL_AT,  # program SIGNAL_AT (-1: none) bumps PROGRESS as it ends (kernels/weight_prefetch.py)
    H, K_O, INTER, eps,
    ROWS: tl.constexpr, ROWS_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr,  # the phases this launch runs (1..3)
    ASM: tl.constexpr,  # poll the barrier from one thread (inline PTX; not in the interpreter)
    STAGES: tl.constexpr,  # > 0: pipelined tile loads and L2 prefetches before waits (needs ASM)
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    PF: tl.constexpr = STAGES * BLOCK_K * 2  # bytes per row the pipelined variant asks L2 for
    w = tl.zeros([ROWS, BLOCK_K], dtype=WO.dtype.element_ty)  # unused when STAGES > 0
    if FIRST == 1:
        if STAGES > 0:
            _prefetch_l2(WO, K_O, H, K_O, INTER, pid, nprog, 1, ROWS, PF)
        else:
            w = _first_tile(WO, K_O, H, K_O, INTER, pid, nprog, 1, ROWS, BLOCK_K)  # weights: no wait needed
        pdl.wait_and_release(PDL)
        _phase(WO, K_O, H, K_O, INTER, A, RES, G, 0.0, w, RES, pid, nprog, 1, ROWS, BLOCK_K, STAGES)
    else:
        pdl.wait_and_release(PDL)
    if FIRST <= 2 and LAST >= 2:
        wi = tl.zeros([ROWS_I, BLOCK_K], dtype=WO.dtype.element_ty)
        if STAGES > 0:
            _prefetch_l2(WGU, H, 2 * INTER, H, INTER, pid, nprog, 2, ROWS_I, PF)
        else:
            wi = _first_tile(WGU, H, 2 * INTER, H, INTER, pid, nprog, 2, ROWS_I, BLOCK_K)
        if FIRST == 1:
            _sync(BAR, nprog, ASM)
        cols = tl.arange(0, BLOCK_H)
        s = tl.load(RES + cols, mask=cols < H, other=0.0, cache_modifier=".cg").to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
        _phase(WGU, H, 2 * INTER, H, INTER, RES, RES, G, rstd, wi, ACT, pid, nprog, 2, ROWS_I, BLOCK_K, STAGES)
    if LAST == 3:
        if STAGES > 0:
            _prefetch_l2(WD, INTER, H, INTER, INTER, pid, nprog, 3, ROWS, PF)
        else:
            w = _first_tile(WD, INTER, H, INTER, INTER, pid, nprog, 3, ROWS, BLOCK_K)
        if FIRST <= 2:
            _sync(BAR, (2 - FIRST) * nprog + nprog, ASM)
        _phase(WD, INTER, H, INTER, INTER, ACT, RES, G, 0.0, w, OUT, pid, nprog, 3, ROWS, BLOCK_K, STAGES)
    if FIRST < LAST:  # noqa: SIM102 (compile-time, then run-time): the last program out re-arms the barrier
        if tl.atomic_add(BAR + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
            tl.store(BAR, 0)
            tl.store(BAR + 1, 0)
    _signal(PROGRESS, SIGNAL_AT, pid, 0)


class FusedMLPConfig(NamedTuple):
    """Launch setting: weight rows per tile in o_proj and down_proj (`rows`) and in gate_up
    (`rows_i`, half of them gate rows), columns per tile, warps, and programs per SM."""

    rows: int = 8
    rows_i: int = 8
    block_k: int = 512
    num_warps: int = 4
    per_sm: int = 4
    stages: int = 0  # > 0: Triton pipelines the loads this deep (GPU only), else one tile ahead by hand


_BARRIERS: dict[torch.device, torch.Tensor] = {}
_RESIDENT: dict[tuple, int] = {}  # (device, dtype, config) -> programs that fit on one SM


def _barrier(device: torch.device) -> torch.Tensor:
    bar = _BARRIERS.get(device)
    if bar is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused_mlp: run it once eagerly before capturing a CUDA graph")
        bar = _BARRIERS[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return bar


def resident_per_sm(n_regs: int, shared: int, num_warps: int, device: torch.device,
                    reserve_warps: int = 1) -> int:
    """Programs of a compiled kernel that fit on one SM at once (registers, threads, shared
    memory, the block limit), with room left for `reserve_warps` warps of another kernel of
    up to 64 registers per thread (the weight prefetch's one-warp programs spin beside a
    forward)."""
    props = torch.cuda.get_device_properties(device)
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = ((props.regs_per_multiprocessor - reserve_warps * 64 * 32) // regs_per_warp) // num_warps
    by_threads = (props.max_threads_per_multi_processor - 32 * reserve_warps) // (32 * num_warps)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    by_smem = (smem - 4096) // (shared + 1024)
    return max(0, min(by_regs, by_threads, by_smem, 31))


def fused_mlp(attn: torch.Tensor, residual: torch.Tensor, o_weight: torch.Tensor,
              norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
              down_weight: torch.Tensor, cfg: FusedMLPConfig,
              num_programs: int | None = None, split_phases: bool = False) -> torch.Tensor:
    """down(silu_and_mul(gate_up(rms_norm(residual + o_proj(attn))))) for ONE row.

    attn [1, K_O]; residual [1, H], overwritten with residual + o_proj(attn) (as
    `fused_add_rms_norm` does); weights as nn.Linear stores them ([out, in], rows contiguous),
    gate_up's rows [gate | up]. Returns the [1, H] output. `num_programs` overrides the grid
    (under the interpreter); `split_phases` runs the three phases as three launches (no
    barrier; the CPU tests' way, since the interpreter runs programs one after another).
    """
    h, k_o = o_weight.shape
    inter = down_weight.shape[1]
    if attn.shape != (1, k_o) or residual.shape != (1, h):
        raise ValueError(f"fused_mlp takes one row: attn {tuple(attn.shape)}, residual {tuple(residual.shape)}")
    if gate_up_weight.shape != (2 * inter, h) or down_weight.shape != (h, inter) or norm_weight.shape != (h,):
        raise ValueError("fused_mlp: weight shapes do not match")
    check_dtype(attn, residual, o_weight, gate_up_weight, down_weight)
    for t in (attn, residual, o_weight, gate_up_weight, down_weight, norm_weight):
        if not t.is_contiguous():
            raise ValueError("fused_mlp: every tensor must be contiguous")
    dev = attn.device
    act = torch.empty(inter, dtype=attn.dtype, device=dev)
    out = torch.empty((1, h), dtype=attn.dtype, device=dev)
    bar = _barrier(dev)
    args = [attn, residual, o_weight, gate_up_weight, down_weight, norm_weight, act, out, bar, bar, -1,
            h, k_o, inter, float(eps)]
    meta = dict(ROWS=cfg.rows, ROWS_I=cfg.rows_i, BLOCK_K=cfg.block_k, BLOCK_H=next_pow2(h),
                ASM=not interpreting(), STAGES=cfg.stages if not interpreting() else 0,
                num_warps=cfg.num_warps)
    if split_phases:
        for phase in (1, 2, 3):
            _fused_mlp_kernel[(num_programs or 1,)](*args, **meta, FIRST=phase, LAST=phase, PDL=False)
        return out
    grid = num_programs or _grid(args, meta, cfg, dev)
    prefetcher = weight_prefetch.active()  # a decode graph with the L2 weight prefetch is being made
    if prefetcher is not None:  # it takes this launch as o_proj's: the prefetch of the next weight
        args[9:11] = prefetcher.signal(o_weight, grid)  # starts as the launch ends
    _fused_mlp_kernel[(grid,)](*args, **meta, FIRST=1, LAST=3, **pdl.launch_options(attn))
    return out


def _grid(args, meta, cfg: FusedMLPConfig, dev: torch.device) -> int:
    """SMs x per_sm programs, as many per SM as fit beside a one-warp kernel if fewer."""
    if interpreting() or dev.type != "cuda":
        return 1
    key = (dev, args[0].dtype, cfg)
    fit = _RESIDENT.get(key)
    if fit is None:
        opts = pdl.launch_options(args[0])
        kernel = _fused_mlp_kernel.warmup(*args, **meta, FIRST=1, LAST=3, **opts, grid=(1,))
        kernel._init_handles()  # loads the binary: its register count is known from then on
        fit = _RESIDENT[key] = resident_per_sm(kernel.n_regs, kernel.metadata.shared, cfg.num_warps, dev)
    if fit < 1:
        raise RuntimeError(f"fused_mlp: no program of {cfg} fits on an SM beside another kernel")
    return torch.cuda.get_device_properties(dev).multi_processor_count * min(cfg.per_sm, fit)


def fused_mlp_ref(attn, residual, o_weight, norm_weight, eps, gate_up_weight, down_weight):
    """The unfused path in torch with the kernels' roundings; returns (out, new residual)."""
    from pagedserve.kernels.activation import silu_and_mul_ref
    from pagedserve.kernels.norm import fused_add_rms_norm_ref

    o = (attn.float() @ o_weight.float().T).to(attn.dtype)
    x, s = fused_add_rms_norm_ref(o, residual, norm_weight, eps)
    gu = (x.float() @ gate_up_weight.float().T).to(attn.dtype)
    act = silu_and_mul_ref(gu)
    return (act.float() @ down_weight.float().T).to(attn.dtype), s

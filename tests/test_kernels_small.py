"""Triton kernels for the decoder's small ops, run on the CPU by Triton's interpreter.

fp32 and fp16 only: bf16 arithmetic is unreliable in the interpreter (bf16 is tested on a GPU).
Outputs are poisoned with NaN first, so an element the kernel forgets to write fails the test.
"""

import os

# Before triton or a kernel module is imported: `triton.jit` picks GPU or interpreter when it
# decorates a function (see _rebuild_for_interpreter for modules imported before this one).
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedserve.kernels import _utils, activation, kv_cache, norm, rope  # noqa: E402


def _rebuild_for_interpreter() -> None:
    """Re-decorate jit functions built for the GPU before TRITON_INTERPRET was set.

    If another test module imported triton (`tl.sum` is a jit function too) or a kernel module
    first, calls fail with "Cannot call @triton.jit'd outside of the scope of a kernel". reload
    refills the same module namespace, so wrappers bound elsewhere see the new kernels.
    """
    import triton
    import triton.language as tl
    import triton.language.random as tl_random

    def built_for_gpu(mod) -> bool:
        return any(isinstance(v, triton.runtime.JITFunction) for v in vars(mod).values())

    stale = [m for m in (tl.standard, tl_random) if built_for_gpu(m)]  # tl.sum, tl.rand4x, ...
    for mod in stale:
        importlib.reload(mod)
    if stale:
        importlib.reload(tl)
    for name, mod in list(sys.modules.items()):
        if name.startswith("pagedserve.kernels.") and built_for_gpu(mod):
            importlib.reload(mod)


_rebuild_for_interpreter()
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3)}
HEADS = [(9, 3, 64), (32, 8, 128), (20, 4, 128)]  # (Hq, Hkv, D): SmolLM2, Qwen3, Nanbeige


def _close(actual, expected, dtype, atol=None):
    assert not torch.isnan(actual).any(), "some elements were not written"
    tol = dict(TOL[dtype], **({} if atol is None else {"atol": atol}))
    torch.testing.assert_close(actual, expected, **tol)
    if dtype == torch.float16:  # same roundings as the reference: almost all bit-exact
        assert (actual == expected).float().mean() > 0.99


def _strided(T, H, dtype, pad=48, scale=1.0):  # [T, H] view with row stride H + pad
    return (torch.randn(T, H + pad) * scale).to(dtype)[:, :H]


def test_interpreter_is_on():
    assert _utils.kernels_usable(torch.empty(1)) and "Interpreted" in type(rope._qk_norm_rope_kernel).__name__


def test_the_faster_interpreter_wraps_what_triton_wraps():
    """tests/triton_interpreter.py is in effect, and its `_patch_builtin` wraps the same
    attributes as Triton's own in the state earlier kernels left, and none a second time."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    from triton_interpreter import speed_up_interpreter

    assert speed_up_interpreter() and interp._patch_builtin.remembers_names
    original = interp._patch_builtin.original
    for fn in (original, interp._patch_builtin, interp._patch_builtin):  # (the 2nd: names known)
        wrapped, again = [], []
        for pkg in (tl, tl.core, tl.tensor, tl.math):
            first, second = interp._LangPatchScope(), interp._LangPatchScope()
            fn(pkg, interp.interpreter_builder, first)
            fn(pkg, interp.interpreter_builder, second)  # (all wrapped already: nothing to do)
            wrapped.append(sorted(name for _, name, _ in first._changes))
            again.append(len(second._changes))
            second.restore()
            first.restore()
        if fn is original:
            want = wrapped
        assert wrapped == want and len(wrapped[0]) > 50 and again == [0, 0, 0, 0]


NORM_SHAPES = [(1, 576), (7, 576), (33, 576), (7, 2560), (5, 100)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", NORM_SHAPES)
def test_rms_norm(T, H, dtype):
    x = _strided(T, H, dtype, scale=3.0)
    w = (torch.rand(H) + 0.5).to(dtype)
    x_before, out = x.clone(), torch.full((T, H), float("nan"), dtype=dtype)
    assert norm.rms_norm(x, w, 1e-5, out=out) is out
    _close(out, norm.rms_norm_ref(x, w, 1e-5), dtype)
    assert torch.equal(x, x_before)
    _close(norm.rms_norm(x.contiguous(), w, 1e-6), norm.rms_norm_ref(x, w, 1e-6), dtype)
    x_inplace = x.clone()  # out may be x itself
    _close(norm.rms_norm(x_inplace, w, 1e-5, out=x_inplace), norm.rms_norm_ref(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", NORM_SHAPES)
def test_fused_add_rms_norm(T, H, dtype):
    x = _strided(T, H, dtype)
    res = _strided(T, H, dtype, pad=16, scale=4.0)
    w = (torch.rand(H) + 0.5).to(dtype)
    y_ref, s_ref = norm.fused_add_rms_norm_ref(x, res, w, 1e-6)
    x_before, out = x.clone(), torch.full((T, H), float("nan"), dtype=dtype)
    y, new_res = norm.fused_add_rms_norm(x, res, w, 1e-6, out=out)
    assert y is out and new_res is res  # the residual is updated in place
    assert torch.equal(res, s_ref)  # one rounding of an exact-in-fp32 sum: bit-exact
    _close(y, y_ref, dtype)
    assert torch.equal(x, x_before)


def test_rms_norm_ref_matches_hf():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    layer = LlamaRMSNorm(576, eps=1e-5).to(torch.float16)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        x = torch.randn(7, 576).to(torch.float16)
        assert torch.equal(norm.rms_norm_ref(x, layer.weight, 1e-5), layer(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(7, 576), (5, 100)])
def test_rms_norm_round_once(T, H, dtype):
    """Gemma 3's rounding (ROUND_ONCE): float32 weights (1 + w) multiply the float32 normalised
    value before the one rounding; with and without the residual add."""
    x = _strided(T, H, dtype, scale=3.0)
    res = _strided(T, H, dtype, pad=16)
    w = torch.rand(H) + 0.5  # float32, as RMSNorm(round_once=True) keeps it
    out = torch.full((T, H), float("nan"), dtype=dtype)
    assert norm.rms_norm(x, w, 1e-6, out=out, round_once=True) is out
    _close(out, norm.rms_norm_ref(x, w, 1e-6, round_once=True), dtype)
    y_ref, s_ref = norm.fused_add_rms_norm_ref(x, res, w, 1e-6, round_once=True)
    y, s = norm.fused_add_rms_norm(x, res.clone(), w, 1e-6, round_once=True)
    assert torch.equal(s, s_ref)
    _close(y, y_ref, dtype)
    if dtype == torch.float16:  # the flag reaches the kernel: Llama's rounding gives other bits
        assert not torch.equal(norm.rms_norm(x, w, 1e-6), out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,D", [HEADS[0], HEADS[2]])
def test_qk_norm_rope_round_once(hq, hkv, D, dtype):
    """The fused q/k norm with Gemma 3's rounding (float32 weights), also when it writes the
    KV cache."""
    T = 7
    qkv = _strided(T, (hq + 2 * hkv) * D, dtype, pad=64, scale=2.0)
    positions = torch.randint(0, 200_000, (T,), dtype=torch.int64)
    inv_freq = _inv_freq(D, 1e6)
    qw, kw = torch.rand(D) + 0.5, torch.rand(D) + 0.5  # float32
    args = (qkv, positions, inv_freq, hq, hkv, D, qw, kw, 1e-6)
    q, k, v = rope.qk_norm_rope(*args, norm_round_once=True)
    q_ref, k_ref, v_ref = rope.qk_norm_rope_ref(*args, norm_round_once=True)
    atol = 6e-3 if dtype == torch.float16 else None  # (see test_qk_norm_rope)
    _close(q, q_ref, dtype, atol)
    _close(k, k_ref, dtype, atol)
    assert torch.equal(v, v_ref)
    cache = torch.full((2, 1, 8, hkv, D), float("nan"), dtype=dtype)
    q2, k2, _ = rope.qk_norm_rope(*args, kv_cache=cache, slot_mapping=torch.arange(T), norm_round_once=True)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(cache[0, 0, :T], k)
    if dtype == torch.float16:  # the flag reaches the kernel: Llama's rounding gives other bits
        assert not torch.equal(rope.qk_norm_rope(*args)[0], q)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,inter", [(1, 1536), (7, 1536), (33, 100), (3, 2600)])
def test_silu_and_mul(T, inter, dtype):
    gate_up = _strided(T, 2 * inter, dtype, pad=32, scale=4.0)
    gate_up[0, :4] = torch.tensor([-200.0, -30.0, 30.0, 0.0], dtype=dtype)  # extremes
    out = torch.full((T, inter), float("nan"), dtype=dtype)
    assert activation.silu_and_mul(gate_up, out=out) is out
    _close(out, activation.silu_and_mul_ref(gate_up), dtype)
    _close(activation.silu_and_mul(gate_up.contiguous()), activation.silu_and_mul_ref(gate_up), dtype)


def _inv_freq(D, theta):
    return 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hq,hkv,D", HEADS)
@pytest.mark.parametrize("T", [1, 7, 33])
def test_qk_norm_rope(T, hq, hkv, D, qk_norm, dtype):
    width = (hq + 2 * hkv) * D
    qkv = _strided(T, width, dtype, pad=64, scale=2.0)
    positions = torch.randint(0, 200_000, (T,), dtype=torch.int64)
    positions[-1] = 199_999
    inv_freq = _inv_freq(D, 5e6)
    qw, kw = [(torch.rand(D) + 0.5).to(dtype) if qk_norm else None for _ in "qk"]
    out_q, out_k = (torch.full((T, h, D), float("nan"), dtype=dtype) for h in (hq, hkv))
    qkv_before = qkv.clone()
    q, k, v = rope.qk_norm_rope(qkv, positions, inv_freq, hq, hkv, D, qw, kw, 1e-6,
                                out_q=out_q, out_k=out_k)
    assert q is out_q and k is out_k
    q_ref, k_ref, v_ref = rope.qk_norm_rope_ref(qkv, positions, inv_freq, hq, hkv, D, qw, kw, 1e-6)
    # With the q/k norm, a one-ulp flip of a normalised fp16 value (rstd's last bit depends on
    # the summation order) moves the output by that ulp times cos/sin: atol follows the inputs.
    atol = 6e-3 if qk_norm and dtype == torch.float16 else None
    _close(q, q_ref, dtype, atol)
    _close(k, k_ref, dtype, atol)
    assert torch.equal(v, v_ref) and v.data_ptr() == qkv.data_ptr() + (hq + hkv) * D * qkv.element_size()
    assert torch.equal(qkv, qkv_before)
    if T == 7:  # outputs allocated by the wrapper
        q2, k2, _ = rope.qk_norm_rope(qkv, positions, inv_freq, hq, hkv, D, qw, kw, 1e-6)
        assert q2.is_contiguous() and k2.is_contiguous()
        assert torch.equal(q2, q) and torch.equal(k2, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,D", HEADS)
def test_qk_norm_rope_writes_kv_cache(hq, hkv, D, dtype):
    """With a cache and slots, the kernel also stores k (after RoPE) and v, exactly as
    store_kv_cache would, skipping negative slots."""
    T, num_blocks, block_size = 9, 4, 8
    qkv = _strided(T, (hq + 2 * hkv) * D, dtype, pad=64, scale=2.0)
    positions = torch.randint(0, 5000, (T,), dtype=torch.int64)
    qw, kw = (torch.rand(D) + 0.5).to(dtype), (torch.rand(D) + 0.5).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:T]
    slots[[1, 5]] = -1
    cache = torch.full((2, num_blocks, block_size, hkv, D), float("nan"), dtype=dtype)
    q, k, v = rope.qk_norm_rope(qkv, positions, _inv_freq(D, 1e6), hq, hkv, D, qw, kw, 1e-6,
                                kv_cache=cache, slot_mapping=slots)
    q2, k2, _ = rope.qk_norm_rope(qkv, positions, _inv_freq(D, 1e6), hq, hkv, D, qw, kw, 1e-6)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    expected = torch.full_like(cache, float("nan"))
    kv_cache.store_kv_cache_ref(k, v, expected, slots)
    assert torch.equal(cache.isnan(), expected.isnan())  # written exactly where expected
    assert torch.equal(cache.nan_to_num(0.0), expected.nan_to_num(0.0))


def test_rope_ref_matches_hf():  # float32: HF's casts of cos/sin are no-ops
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inv_freq, qkv, positions = _inv_freq(64, 1e5), torch.randn(5, 15 * 64), torch.tensor([0, 1, 17, 4000, 8191])
    emb = torch.cat([positions.float()[:, None] * inv_freq[None, :]] * 2, dim=-1)  # [T, D]
    q, k, v = rope.qk_norm_rope_ref(qkv, positions, inv_freq, 9, 3, 64)
    q_hf, k_hf = apply_rotary_pos_emb(qkv[:, :576].view(5, 9, 64), qkv[:, 576:768].view(5, 3, 64),
                                      emb.cos(), emb.sin(), unsqueeze_dim=1)
    torch.testing.assert_close((q, k), (q_hf, k_hf), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,D", HEADS)
@pytest.mark.parametrize("T", [1, 7, 33])
def test_store_kv_cache(T, hq, hkv, D, dtype):
    num_blocks, block_size = 6, 16
    qkv = torch.randn(T, (hq + 2 * hkv) * D).to(dtype)
    k = qkv[:, hq * D : (hq + hkv) * D].reshape(T, hkv, D).contiguous()
    v = qkv[:, (hq + hkv) * D :].view(T, hkv, D)  # strided in the token dimension
    slots = torch.randperm(num_blocks * block_size)[:T]
    slots[torch.rand(T) < 0.3] = -1  # padding
    slots[-1] = -1 if T > 1 else slots[-1]
    cache = torch.full((2, num_blocks, block_size, hkv, D), float("nan"), dtype=dtype)
    expected = cache.clone()  # NaN where nothing may be written
    kv_cache.store_kv_cache_ref(k, v, expected, slots)
    kv_cache.store_kv_cache(k, v, cache, slots)
    assert torch.equal(cache.isnan(), expected.isnan())  # written exactly where expected
    assert torch.equal(cache.nan_to_num(0.0), expected.nan_to_num(0.0))  # a copy: bit-exact


def test_empty_batches():
    assert norm.rms_norm(torch.randn(0, 64), torch.ones(64), 1e-6).shape == (0, 64)
    assert activation.silu_and_mul(torch.randn(0, 64)).shape == (0, 32)
    q, k, v = rope.qk_norm_rope(torch.randn(0, 5 * 64), torch.zeros(0, dtype=torch.int64),
                                _inv_freq(64, 1e4), 3, 1, 64)
    assert q.shape == (0, 3, 64) and k.shape == (0, 1, 64) and v.shape == (0, 1, 64)
    kv_cache.store_kv_cache(k, v, torch.zeros(2, 1, 4, 1, 64), torch.zeros(0, dtype=torch.int64))


# ---- skinny matmul (small-batch weight products) --------------------------------------

SKINNY_SHAPES = [(1, 48, 64), (1, 40, 72), (3, 48, 64), (16, 40, 72), (5, 64, 200), (1, 33, 200), (33, 40, 72),
                 (64, 24, 64), (100, 24, 64)]


def _skinny_configs(rows):
    from pagedserve.kernels.skinny_gemm import SkinnyConfig

    dot = [SkinnyConfig(16, 32, 4, 1, True), SkinnyConfig(16, 64, 4, 2, True, 3),
           SkinnyConfig(32, 16, 4, 2, True, 8), SkinnyConfig(16, 32, 4, 2, True, 1, True),
           SkinnyConfig(32, 16, 4, 3, True, 3, True)]
    if rows > 1:
        return dot
    return dot + [SkinnyConfig(8, 32, 4, 1, False), SkinnyConfig(4, 64, 2, 1, False, 2),
                  SkinnyConfig(2, 16, 2, 1, False, 5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", SKINNY_SHAPES)
def test_skinny_matmul(M, N, K, dtype):
    """Every setting (FMA and tensor-core programs, split-K with uneven and empty slices,
    ragged N and K) against a float64 product, written into a NaN-poisoned output."""
    from pagedserve.kernels.skinny_gemm import skinny_matmul

    x, w = torch.randn(M, K).to(dtype), torch.randn(N, K).to(dtype)
    expected = (x.double() @ w.double().t()).to(dtype)
    for cfg in _skinny_configs(M):
        out = torch.full((M, N), float("nan"), dtype=dtype)
        got = skinny_matmul(x, w, cfg, out)
        assert got is out
        assert not torch.isnan(got).any(), f"{cfg}: some elements were not written"
        torch.testing.assert_close(got.double(), expected.double(),
                                   rtol=1e-2 if dtype == torch.float16 else 1e-5,
                                   atol=2e-2 if dtype == torch.float16 else 1e-4, msg=str(cfg))


def test_skinny_tma_falls_back_for_unaligned_rows(monkeypatch):
    """TMA needs 16-byte aligned rows: x starting one element into a buffer takes the pointer
    kernel (same result), an aligned x the TMA kernel."""
    from pagedserve.kernels import skinny_gemm
    from pagedserve.kernels.skinny_gemm import SkinnyConfig, skinny_matmul

    cfg = SkinnyConfig(16, 32, 4, 2, True, 1, True)
    w = torch.randn(24, 64)
    buf = torch.randn(3 * 64 + 1)
    launched = []
    for name in ("_skinny_kernel", "_skinny_tma_kernel"):
        kernel = getattr(skinny_gemm, name)
        monkeypatch.setattr(skinny_gemm, name, _Spy(kernel, name, launched))
    for x in (buf[1:].view(3, 64), buf[:-1].view(3, 64)):
        torch.testing.assert_close(skinny_matmul(x, w, cfg), x @ w.t(), rtol=1e-5, atol=1e-4)
    assert launched == ["_skinny_kernel", "_skinny_tma_kernel"]


@pytest.mark.parametrize("signal_at", [0.9, 1.0, 0.01])
def test_skinny_matmul_signals_the_weight_prefetch_once(monkeypatch, signal_at):
    """While a weight prefetch records a forward (`kernels/weight_prefetch.py`), each launch,
    whatever its setting, bumps the progress counter exactly once (the program it names, as
    that program ends) and is recorded in order; the product is unchanged. Outside a
    recording nothing is bumped."""
    from pagedserve.kernels import weight_prefetch
    from pagedserve.kernels.skinny_gemm import skinny_matmul

    recorder = weight_prefetch.WeightPrefetcher.__new__(weight_prefetch.WeightPrefetcher)
    recorder.cfg = weight_prefetch.PrefetchConfig(signal_at=signal_at)
    recorder.capacity, recorder._recording = 64, []
    recorder.progress = torch.zeros(2, dtype=torch.int32)
    x1, x3, w = torch.randn(1, 72), torch.randn(3, 72), torch.randn(40, 72)
    skinny_matmul(x1, w, _skinny_configs(1)[0])
    assert recorder.progress.tolist() == [0, 0]
    monkeypatch.setattr(weight_prefetch, "_ACTIVE", recorder)
    launches = [(x, cfg) for x in (x1, x3) for cfg in _skinny_configs(x.shape[0])]
    for i, (x, cfg) in enumerate(launches):
        torch.testing.assert_close(skinny_matmul(x, w, cfg), x @ w.t(), rtol=1e-5, atol=1e-4)
        assert recorder.progress.tolist() == [i + 1, 0], str(cfg)
    assert len(recorder._recording) == len(launches)
    assert all(r is w for r in recorder._recording)


class _Spy:
    """Stands in for a jit kernel: notes its name at each launch, then launches it."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


def test_skinny_matmul_rejects_what_it_cannot_do():
    from pagedserve.kernels.skinny_gemm import SkinnyConfig, skinny_matmul

    fma, dot = SkinnyConfig(8, 32, 4, 1, False), SkinnyConfig(16, 32, 4, 1, True)
    with pytest.raises(ValueError, match="cannot take 2 rows"):
        skinny_matmul(torch.randn(2, 64), torch.randn(8, 64), fma)
    with pytest.raises(ValueError, match="cannot take 257 rows"):
        skinny_matmul(torch.randn(257, 64), torch.randn(8, 64), dot)
    with pytest.raises(ValueError, match="64 columns"):
        skinny_matmul(torch.randn(1, 64), torch.randn(8, 32), dot)
    with pytest.raises(ValueError, match="tensor-core path"):
        skinny_matmul(torch.randn(1, 64), torch.randn(8, 64), SkinnyConfig(8, 32, 4, 1, False, 1, True))


def test_linear_follows_its_plan(monkeypatch):
    """A planned Linear gives the same product on the kernel for a planned row bucket, on
    F.linear where the plan says cuBLAS and for more rows than any bucket."""
    from pagedserve.kernels import skinny_gemm
    from pagedserve.kernels.skinny_gemm import SkinnyConfig
    from pagedserve.layers.linear import Linear
    from pagedserve.layers.skinny import row_bucket

    assert [row_bucket(r) for r in (1, 2, 3, 5, 9, 16, 17, 64)] == [1, 2, 4, 8, 16, 16, 32, 64]
    lin = Linear(72, 40)
    calls = []
    real = skinny_gemm.skinny_matmul

    def spy(x, w, cfg, out=None, scale=None):
        calls.append((x.shape[0], cfg))
        return real(x, w, cfg, out, scale)

    lin.skinny_plan = {1: SkinnyConfig(8, 32, 4, 1, False), 2: None, 4: SkinnyConfig(16, 32, 4, 1, True, 2),
                       8: None, 16: None, 32: SkinnyConfig(16, 32, 4, 1, True), 64: None}
    monkeypatch.setattr(skinny_gemm, "skinny_matmul", spy)
    for rows in (1, 2, 3, 20, 50, 70):
        x = torch.randn(rows, 72)
        torch.testing.assert_close(lin(x), x @ lin.weight.t(), rtol=1e-5, atol=1e-5)
    assert calls == [(1, lin.skinny_plan[1]), (3, lin.skinny_plan[4]), (20, lin.skinny_plan[32])]


def test_plan_picks_the_fastest_that_agrees(monkeypatch):
    """The planner keeps cuBLAS unless a candidate is faster, and never picks a candidate
    whose product disagrees with cuBLAS's, however fast (timings injected: no GPU here)."""
    from pagedserve.kernels import skinny_gemm
    from pagedserve.layers import skinny

    weights = [torch.randn(24, 40) for _ in range(3)]
    cands = {rows: skinny._candidates(rows) for rows in skinny.ROW_BUCKETS}
    broken = cands[1][0]  # its products come out wrong: must be skipped, not timed
    real = skinny_gemm.skinny_matmul

    def maybe_wrong(x, w, cfg, out=None, scale=None):
        y = real(x, w, cfg, out, scale)
        return y * 1.5 if cfg == broken else y

    monkeypatch.setattr(skinny_gemm, "skinny_matmul", maybe_wrong)
    # per bucket: cuBLAS, then each candidate that agrees. Bucket 1: the third candidate is
    # fastest (the second is slower than cuBLAS); every other bucket: cuBLAS is fastest.
    times = []
    for rows in skinny.ROW_BUCKETS:
        if rows == 1:
            times += [1.0, 2.0, 0.5] + [0.7] * (len(cands[1]) - 3)
        else:
            times += [1.0] + [1.5] * len(cands[rows])
    it = iter(times)

    def fake_timer(fn):
        fn()  # the timed code must run
        return next(it)

    plans = skinny.plan_skinny_matmuls({"w": weights}, timer=fake_timer)
    assert plans["w"][1] == cands[1][2]
    assert all(plans["w"][rows] is None for rows in skinny.ROW_BUCKETS[1:])
    assert next(it, None) is None  # cuBLAS and every agreeing candidate timed once per bucket


def test_planned_model_matches_unplanned(tmp_path, monkeypatch):
    """A tiny Qwen3 (tied embeddings) with every matmul planned onto the kernel gives the
    same logits at 1-3 rows as with none planned, and every matmul did run on the kernel."""
    from conftest import make_hf_checkpoint
    from helpers import run_prefill
    from pagedserve.kernels import skinny_gemm
    from pagedserve.layers import skinny
    from pagedserve.layers.linear import Linear, plan_model_matmuls
    from pagedserve.models.loader import build_model
    from pagedserve.models.source import resolve_model

    make_hf_checkpoint("qwen3", tmp_path)
    model = build_model(resolve_model(str(tmp_path)), dtype="float32")
    seqs = [[5, 9, 200], [7], [3, 3]]
    before = run_prefill(model, seqs)
    # (equal times, and the timed code not run again: each candidate already ran on these
    # shapes in the planner's agreement check, and test_plan_picks_the_fastest_that_agrees
    # runs the timed code)
    plans = plan_model_matmuls(model, timer=lambda fn: 1.0)
    assert set(plans) == {"qkv_proj (256, 64)", "o_proj (64, 128)", "gate_up_proj (256, 64)",
                          "down_proj (64, 128)", "logits"}
    for key, plan in plans.items():  # equal times: cuBLAS kept everywhere
        assert all(cfg is None for cfg in plan.values()), key
    first = {rows: skinny._candidates(rows)[0] for rows in skinny.ROW_BUCKETS}
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 3
    for mod in linears:
        mod.skinny_plan = dict(first)
    model.logits_plan = dict(first)
    calls = []
    real = skinny_gemm.skinny_matmul
    monkeypatch.setattr(skinny_gemm, "skinny_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    after = [run_prefill(model, [s])[0] for s in seqs]  # one sequence at a time: 1-3 rows
    assert len(calls) == len(seqs) * (len(linears) + 1)  # each Linear and the logits, per sequence
    for a, b in zip(after, before):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_pdl_is_off_without_a_gpu():
    """Programmatic dependent launch only for CUDA tensors outside the interpreter: here every
    kernel gets PDL=False and no launch_pdl option."""
    from pagedserve.kernels import pdl

    assert pdl.launch_options(torch.empty(3)) == {"PDL": False}


# ---- fused temperature sampling ---------------------------------------------------------

def test_fused_sampling_matches_softmax_of_scaled_logits():
    """Tokens drawn by the kernel follow softmax(logits / T) (chi-square, as test_sampler's
    torch path), over two seeds; a vocabulary spanning several blocks, with the mass on tokens
    in different blocks, too."""
    from test_sampler import LOGITS, assert_matches

    from pagedserve.kernels.sampling import sample_with_temperature

    for temperature, logits_row in ((0.6, LOGITS), (1.3, LOGITS)):
        n = 2000
        logits = logits_row.expand(n // 2, -1).contiguous()
        temp = torch.full((n // 2,), temperature)
        tokens = torch.cat([sample_with_temperature(logits, temp, seed) for seed in (11, 12)])
        freq = torch.bincount(tokens, minlength=logits.shape[1]).double() / n
        assert_matches(freq, (logits_row / temperature).softmax(-1), n)
    # the other tokens at -inf: a chi-square over thousands of near-zero cells could not fail
    wide = torch.full((5000,), float("-inf"))
    wide[[3, 2100, 4999]] = torch.tensor([1.0, 0.5, 0.8])  # one token in each of three blocks
    n = 600
    tokens = sample_with_temperature(wide.expand(n, -1).contiguous(), torch.full((n,), 0.9), 7)
    freq = torch.bincount(tokens, minlength=5000).double() / n
    assert_matches(freq, (wide / 0.9).softmax(-1), n)
    # A block's four quarters draw on the four outputs of one random call: a token in each
    # quarter, the same lane (5 + i * 512), and one in another lane, each at its own odds.
    quarters = torch.full((2048,), float("-inf"))
    quarters[[5, 517, 1029, 1541, 1800]] = torch.tensor([0.2, 0.9, 0.5, 0.0, 0.7])
    n = 1500
    tokens = sample_with_temperature(quarters.expand(n, -1).contiguous(), torch.full((n,), 1.0), 5)
    freq = torch.bincount(tokens, minlength=2048).double() / n
    assert_matches(freq, quarters.softmax(-1), n)


def test_fused_sampling_greedy_rows_seeds_and_dtypes():
    """T = 0 rows take the argmax (lowest id on ties, across blocks), random rows beside them
    stay random; a seed gives the same tokens again, another seed others, however many
    programs share a row; fp16 logits work."""
    from pagedserve.kernels.sampling import sample_with_temperature

    logits = torch.randn(8, 4500)
    logits[0, [100, 3000]] = 50.0  # tie across blocks: the lower id
    logits[1] = 0.0  # all tied: token 0
    temp = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    first = sample_with_temperature(logits, temp, 3)
    greedy = temp == 0
    assert torch.equal(first[greedy], logits.argmax(-1)[greedy])
    assert first[0].item() == 100 and first[1].item() == 0
    assert torch.equal(sample_with_temperature(logits, temp, 3), first)
    draws = torch.stack([sample_with_temperature(logits, temp, s) for s in range(4, 8)])  # [4, 8]
    assert (draws[:, ~greedy] != first[~greedy]).any()  # flat-ish rows: other seeds, other tokens
    assert (draws[:, greedy] == first[greedy]).all()
    shifted = logits - 80.0  # every score negative: the split rows' packed maxima must still order
    for split in (1, 2, 3):
        assert torch.equal(sample_with_temperature(shifted, temp, 9, programs_per_row=split),
                           sample_with_temperature(logits, temp, 9, programs_per_row=1)), split
    half = sample_with_temperature(logits.half(), temp, 3)
    assert torch.equal(half[greedy], logits.half().float().argmax(-1)[greedy])
    with pytest.raises(ValueError, match="temperature must be"):
        sample_with_temperature(logits, temp.double(), 3)
    with pytest.raises(ValueError, match="expected logits"):
        sample_with_temperature(logits[0], temp, 3)


def test_fused_sampling_flags_rows_with_nan_or_inf():
    """`checked` holds the tokens with -1 in rows whose logits hold a NaN, +Inf or -Inf; the
    returned tokens stay valid ids. The same however many programs share a row, and the flags
    are re-armed for the next call."""
    from pagedserve.kernels.sampling import sample_with_temperature

    logits = torch.randn(6, 4500)
    logits[1, 4499] = float("nan")  # the very last token (the last program's tail)
    logits[2, 0] = float("inf")
    logits[3, 2100] = float("-inf")
    logits[4, 3000] = float("nan")
    temp = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 0.7])
    bad = torch.tensor([False, True, True, True, True, False])
    for split in (1, 2, 3):
        checked = torch.empty(6, dtype=torch.int64)
        tokens = sample_with_temperature(logits, temp, 5, programs_per_row=split, checked=checked)
        assert ((tokens >= 0) & (tokens < 4500)).all()
        assert torch.equal(checked == -1, bad), (split, checked)
        assert torch.equal(checked[~bad], tokens[~bad])
        assert tokens[0].item() == logits[0].argmax().item()  # a greedy row
    clean = torch.randn(6, 4500)
    checked = torch.empty(6, dtype=torch.int64)
    tokens = sample_with_temperature(clean, torch.zeros(6), 1, programs_per_row=3, checked=checked)
    assert torch.equal(checked, tokens) and torch.equal(tokens, clean.argmax(-1))


@pytest.mark.parametrize("M", [1, 5])
def test_skinny_matmul_with_an_fp8_weight(M):
    """An e4m3 weight with its scale per row (`--quantization fp8`'s small batches): every
    setting widens it in registers and scales each output column, against a float64 product
    of the dequantized weight."""
    from pagedserve.kernels.skinny_gemm import skinny_matmul

    N, K = 40, 72
    x = torch.randn(M, K).to(torch.float16)
    w = (torch.randn(N, K) * 4).to(torch.float8_e4m3fn)  # [N, K] e4m3
    scale = torch.rand(N) + 0.5  # float32 [N]
    expected = x.double() @ (w.double() * scale.double()[:, None]).t()
    for cfg in _skinny_configs(M):
        got = skinny_matmul(x, w, cfg, scale=scale)
        torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=3e-2, msg=str(cfg))
    with pytest.raises(ValueError, match="float32 scale"):
        skinny_matmul(x, w, _skinny_configs(M)[0])

"""The skinny GEMV kernel (interpreter, CPU) against torch."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedserve.kernels.gemv import gemv  # noqa: E402


@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("n,k", [(37, 300), (64, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_matches_torch(m, n, k, dtype):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    y = gemv(x, w)
    ref = x.float() @ w.float().t()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * k**0.5)
    assert y.shape == (m, n) and y.dtype == dtype

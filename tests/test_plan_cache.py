"""(CPU) The matmul plan cache: plans survive a round trip through their file, a changed
condition (GPU, software, kernel source, weight shapes, PDL) names another file, and a broken
file means timing again rather than a failed start-up."""

from __future__ import annotations

import json

import pytest

from pagedserve.kernels import fp8_gemm, skinny_gemm
from pagedserve.layers import plan_cache
from pagedserve.layers.plan_cache import PlanCache, decode_plans, encode_plans, plan_key

DEVICE = {"name": "NVIDIA H200", "sms": 132, "memory": 150_000_000_000, "capability": [9, 0],
          "torch": "2.11.0", "triton": "3.6.0"}
GROUPS = {"o_proj (2560, 4096)": [[2560, 4096], "torch.bfloat16", 36],
          "logits": [[151936, 2560], "torch.bfloat16", 1]}


def plans() -> dict:
    """Two groups' plans, built from the kernel modules' classes as they are now:
    test_kernels_small.py reloads the kernel modules for Triton's interpreter, which makes new
    config classes, so classes bound when this file was collected could be stale."""
    skinny, fp8 = skinny_gemm.SkinnyConfig, fp8_gemm.Fp8GemmConfig
    return {
        "o_proj (2560, 4096)": {1: skinny(2, 1024, 4, 1, False, 1), 2: None,
                                64: skinny(64, 64, 4, 6, True, 4, True)},
        "qkv_proj (6144, 2560) fp8": {1: skinny(8, 512, 4, 1, False), 256: fp8(64, 64, 128, 4, 4, tma=True),
                                      1024: None},
    }


def test_plans_round_trip_through_json():
    data = json.loads(json.dumps(encode_plans(plans())))
    back = decode_plans(data)
    assert back == plans()
    assert type(back["qkv_proj (6144, 2560) fp8"][256]) is fp8_gemm.Fp8GemmConfig
    assert type(back["o_proj (2560, 4096)"][64]) is skinny_gemm.SkinnyConfig


def test_cache_stores_and_loads(tmp_path):
    cache = PlanCache(tmp_path / "plans")
    key = plan_key(DEVICE, GROUPS, pdl=True)
    assert cache.load(key) is None  # nothing kept yet
    cache.store(key, plans(), {"device": DEVICE})
    assert cache.load(key) == plans()
    assert json.loads(cache.path(key).read_text())["about"] == {"device": DEVICE}
    assert [p.name for p in (tmp_path / "plans").iterdir()] == [f"{key}.json"]  # no temporary left


@pytest.mark.parametrize("change", ["gpu", "triton", "shape", "count", "pdl", "source"])
def test_any_changed_condition_names_another_plan(change, monkeypatch):
    base = plan_key(DEVICE, GROUPS, pdl=True)
    assert plan_key(dict(DEVICE), json.loads(json.dumps(GROUPS)), True) == base  # (equal facts: one file)
    device, groups, pdl = dict(DEVICE), json.loads(json.dumps(GROUPS)), True
    if change == "gpu":
        device["name"] = "NVIDIA H100 80GB HBM3"
    elif change == "triton":
        device["triton"] = "3.7.0"
    elif change == "shape":
        groups["o_proj (2560, 4096)"][0] = [2048, 4096]
    elif change == "count":
        groups["o_proj (2560, 4096)"][2] = 28
    elif change == "pdl":
        pdl = False
    else:  # an edit to a kernel's source
        monkeypatch.setattr(plan_cache, "sources_digest", lambda: "edited")
    assert plan_key(device, groups, pdl) != base


def test_unreadable_plan_is_timed_again(tmp_path, caplog):
    cache = PlanCache(tmp_path)
    key = plan_key(DEVICE, GROUPS, pdl=True)
    cache.path(key).write_text('{"plans": {"o_proj": {"1": ["nonsense", 1]}}}')
    assert cache.load(key) is None
    cache.path(key).write_text("{not json")
    assert cache.load(key) is None
    assert "unreadable matmul plan" in caplog.text


def test_store_failure_is_not_fatal(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the folder should be
    PlanCache(blocker / "plans").store("k", plans(), {})
    assert "could not keep the matmul plan" in caplog.text

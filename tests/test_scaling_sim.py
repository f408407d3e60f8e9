"""The scaling simulation (benchmarks/scaling_sim.py): replicas for a load, and routers' prefix
hits (benchmarks/routing_sim.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up (and scaling_sim imports it)
    spec.loader.exec_module(module)
    return module


routing_sim = _load("routing_sim")
sim = _load("scaling_sim")


def test_embedded_curves_are_the_result_files() -> None:
    embedded, stored = sim.Curves.measured(), sim.Curves.from_result(ROOT / sim.CURVES_FILE)
    assert embedded.concurrency == stored.concurrency == (1, 16, 64, 256)
    for a, b in [(embedded.output_tok_s, stored.output_tok_s), (embedded.ttft_ms, stored.ttft_ms),
                 (embedded.tpot_ms, stored.tpot_ms)]:
        assert a == pytest.approx(b, rel=1e-3)


def test_curves_agree_with_littles_law() -> None:
    # a request at concurrency c takes TTFT + 127 TPOT: the replica model's premise
    for row in sim.check_curves(sim.Curves.measured()):
        assert row["ratio"] == pytest.approx(1.0, abs=0.05), row


def test_interpolation_between_measured_concurrencies() -> None:
    ttft, tpot = sim.Curves.measured().per_n(300)
    assert ttft[0] == ttft[1] == pytest.approx(0.01702)
    assert tpot[40] == pytest.approx((4.167 + (9.246 - 4.167) * 24 / 48) / 1e3)
    assert tpot[300] == tpot[256] == pytest.approx(0.03622)


def test_tiny_load_on_one_replica_sees_the_concurrency_1_latencies() -> None:
    r = sim.simulate_replicas(0.05, 1, requests=2_000)
    assert r["ttft_p50_s"] == pytest.approx(0.01702, rel=0.02)
    assert r["tpot_p50_s"] == pytest.approx(0.002766, rel=0.02)


def test_overloaded_replica_carries_the_measured_peak() -> None:
    r = sim.simulate_replicas(80.0, 1, requests=6_000)
    assert r["completed_rps"] * sim.OUT_LEN == pytest.approx(6196.0, rel=0.05)
    assert r["ttft_p99_s"] > 10  # its queue grows without bound
    assert not sim.Slo().met(r)


def test_more_load_needs_at_least_as_many_replicas() -> None:
    slo = sim.Slo()
    rows = [sim.replicas_needed(load, slo, requests=4_000) for load in (5, 40, 90, 150)]
    counts = [r["replicas"] for r in rows]
    assert all(r["met"] for r in rows)
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] >= 3


def test_a_tighter_slo_needs_more_replicas() -> None:
    loose = sim.replicas_needed(150, sim.Slo(2.0, 0.05), requests=4_000)
    tight = sim.replicas_needed(150, sim.Slo(0.3, 0.010), requests=4_000)
    assert tight["met"] and tight["replicas"] > loose["replicas"]
    assert tight["ttft_p99_s"] <= 0.3 and tight["tpot_p50_s"] <= 0.010
    # the search found the smallest: one replica fewer (still enough to carry 150 req/s) misses
    fewer = tight["replicas"] - 1
    assert fewer * sim.Curves.measured().max_request_rate() > 150
    assert not sim.Slo(0.3, 0.010).met(sim.simulate_replicas(150, fewer, requests=4_000))


def test_lru_keeps_the_most_recent_within_capacity() -> None:
    lru = routing_sim._Lru(100)
    lru.put("a", 40)
    lru.put("b", 40)
    lru.put("a", 50)  # a grows and becomes the most recent
    lru.put("c", 30)  # 120 > 100: b goes
    assert list(lru.entries) == ["a", "c"] and lru.used == 80


@pytest.fixture(scope="module")
def routing() -> dict:
    cfg = routing_sim.TraceConfig(conversations=2_000, conv_rate=10.0, think_s=10.0)
    trace = routing_sim.make_trace(cfg)
    curves = sim.Curves.measured()
    return {name: routing_sim.simulate_routing(trace, name, 4, cfg, kv_tokens=400_000, curves=curves,
                                               warmup_s=60)
            for name in routing_sim.ROUTERS}


def test_affinity_router_finds_more_of_the_prefix_than_random(routing: dict) -> None:
    rand, least, aff = routing["random"], routing["least-loaded"], routing["affinity"]
    assert min(aff["requests_measured"], rand["requests_measured"]) > 5_000
    assert aff["prefix_hit_rate"] >= rand["prefix_hit_rate"] + 0.2
    assert aff["prefix_hit_rate"] >= least["prefix_hit_rate"] + 0.2
    assert rand["system_only_hit_rate"] < rand["prefix_hit_rate"]
    assert aff["prefix_hit_rate"] <= aff["ideal_hit_rate"]
    assert aff["kept"] > 5 * aff["moved"]


def test_affinity_router_keeps_the_load_spread_bounded(routing: dict) -> None:
    rand, least, aff = routing["random"], routing["least-loaded"], routing["affinity"]
    assert least["load_spread"] < 1.1
    assert aff["load_spread"] < min(1.25, rand["load_spread"])


def test_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "scaling.json"
    sim.main(["--loads", "5,60", "--requests", "2000", "--conversations", "500",
              "--json", str(out)])
    data = json.loads(out.read_text())
    assert [r["load_rps"] for r in data["replicas"]["rows"]] == [5.0, 60.0]
    assert data["replicas"]["rows"][1]["replicas"] >= 2
    assert [r["router"] for r in data["routing"]["rows"]] == list(sim.ROUTERS)
    assert "(a) replicas needed" in capsys.readouterr().out

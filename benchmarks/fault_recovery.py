"""Fault recovery of a real server on the GPU machine (issue 22): how fast clients learn of a
dead engine core, how long until the server serves again, and how fast a killed server's
GPU memory comes back.

    PYTHONPATH=.:/tmp/pydeps python3 benchmarks/fault_recovery.py --out $OUT/fault_recovery.json

Starts `pagedserve serve MODEL --load-format dummy` (the Qwen3-4B preset by default), streams
16 requests, SIGKILLs the engine core, and times: each client's error event after the kill,
/health back to 200, and the first completion afterwards. Then SIGKILLs the server and times
until none of its processes is left and the GPU's used memory is back to what it was before
the server started. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def gpu_used_bytes() -> int:
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    kids: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        kids.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            found.append(k)
            todo.append(k)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_health(url: str, timeout: float, proc: subprocess.Popen) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"not healthy after {timeout} s")


async def stream(client: httpx.AsyncClient, url: str, i: int) -> dict:
    seen = {"error": None, "done": False, "ended": None}
    async with client.stream("POST", url + "/v1/completions", json={
            "prompt": [1, 100 + i, 200 + i], "max_tokens": 4000, "ignore_eos": True,
            "stream": True}) as r:
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                seen["done"] = True
            elif line.startswith("data: ") and '"error"' in line:
                seen["error"] = json.loads(line[6:])["error"]["code"]
    seen["ended"] = time.monotonic()
    return seen


async def kill_core_under_load(url: str, core_pid: int) -> dict:
    async with httpx.AsyncClient(timeout=300) as c:
        tasks = [asyncio.create_task(stream(c, url, i)) for i in range(16)]
        await asyncio.sleep(3.0)
        os.kill(core_pid, signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.gather(*tasks)
    learned = [r["ended"] - killed for r in results]
    return {"clients": len(results), "all_got_error_and_done": all(r["done"] and r["error"] for r in results),
            "error_codes": sorted({r["error"] for r in results}),
            "client_learned_s_max": round(max(learned), 3), "killed_at": killed}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-4b-instruct-2507")
    ap.add_argument("--tokenizer", default=".devtok")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--out", default="fault_recovery.json")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    base_mem = gpu_used_bytes()
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", args.model, "--load-format", "dummy",
           "--tokenizer", args.tokenizer, "--port", str(args.port), "--log-level", "INFO"]
    t0 = time.monotonic()
    with open(Path(args.out).with_suffix(".server.log"), "wb") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    result: dict = {"model": args.model, "command": " ".join(cmd)}
    try:
        result["startup_s"] = round(wait_health(url, 600, server), 2)
        result["gpu_used_serving_gib"] = round((gpu_used_bytes() - base_mem) / 2**30, 2)
        cores = [p for p in descendants(server.pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        kill = asyncio.run(kill_core_under_load(url, cores[0]))
        wait_health(url, 600, server)
        killed_at = kill.pop("killed_at")
        result["engine_core_kill"] = {**kill, "healthy_again_s": round(time.monotonic() - killed_at, 2)}
        t1 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8}, timeout=120)
        result["engine_core_kill"]["first_completion_after_s"] = round(time.monotonic() - killed_at, 2)
        result["engine_core_kill"]["first_completion_status"] = r.status_code
        result["engine_core_kill"]["first_completion_ms"] = round((time.monotonic() - t1) * 1e3, 1)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        result["restarts_total"] = sum(float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines()
                                       if x.startswith("pagedserve_engine_restarts_total"))
        # SIGKILL the server: its engine core must go, and its GPU memory with it.
        kids = descendants(server.pid)
        used_before_kill = gpu_used_bytes()
        os.kill(server.pid, signal.SIGKILL)
        killed = time.monotonic()
        gone_s = mem_s = None
        while time.monotonic() - killed < 30 and (gone_s is None or mem_s is None):
            if gone_s is None and not any(alive(p) for p in kids):
                gone_s = time.monotonic() - killed
            if mem_s is None and gpu_used_bytes() <= base_mem + (64 << 20):
                mem_s = time.monotonic() - killed
            time.sleep(0.02)
        result["server_kill"] = {"children": len(kids), "children_gone_s": gone_s and round(gone_s, 3),
                                 "gpu_memory_released_s": mem_s and round(mem_s, 3),
                                 "gpu_used_before_kill_gib": round((used_before_kill - base_mem) / 2**30, 2)}
    finally:
        if server.poll() is None:
            server.kill()
        for p in descendants(server.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    result["total_s"] = round(time.monotonic() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

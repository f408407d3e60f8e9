"""The small-batch matmul plans of earlier start-ups, kept on disk so a later start-up on the
same GPU, software and model shapes reads them instead of timing every candidate again.

A plan is only as good as the conditions it was timed under, so its file is named by a hash
of everything that decides the timing or the result: the GPU (name, SM count, memory size),
torch's and Triton's versions, the source of the kernels and of the candidate lists, whether
programmatic dependent launch was on, and each weight group's shape, dtype and count. Any
change there gives another name, and the plan is timed again. Deleting the folder forces it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from pagedserve.layers.skinny import SkinnyPlan

logger = logging.getLogger(__name__)

# the modules whose source decides what a plan picks (kernels, their settings, the timing)
_PLAN_SOURCES = ("kernels/skinny_gemm.py", "kernels/fp8_gemm.py", "kernels/fp8_quant.py",
                 "layers/skinny.py", "quantization/fp8.py")


def sources_digest() -> str:
    """sha256 of the source files that decide a plan."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for rel in _PLAN_SOURCES:
        path = root / rel
        h.update(rel.encode())
        h.update(path.read_bytes() if path.exists() else b"-")
    return h.hexdigest()


def plan_key(device: dict, groups: dict[str, list], pdl: bool) -> str:
    """The file name (a hex digest) for plans of `groups` (name -> [shape, dtype, count]) on
    `device` (name, SM count, memory, torch and Triton versions: see `device_facts`)."""
    facts = {"device": device, "groups": groups, "pdl": pdl, "sources": sources_digest()}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def device_facts(device) -> dict:
    """What about a CUDA device and the software on it decides a plan's timings."""
    import torch
    import triton

    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "sms": props.multi_processor_count, "memory": props.total_memory,
            "capability": list(torch.cuda.get_device_capability(device)),
            "torch": torch.__version__, "triton": triton.__version__}


def encode_plans(plans: dict[str, SkinnyPlan]) -> dict:
    """Plans as JSON-able data: group -> {rows: null (cuBLAS) or [kind, *setting]}."""
    from pagedserve.kernels.fp8_gemm import Fp8GemmConfig

    def one(cfg) -> list | None:
        if cfg is None:
            return None
        return ["fp8_gemm" if isinstance(cfg, Fp8GemmConfig) else "skinny", *cfg]

    return {name: {str(rows): one(cfg) for rows, cfg in plan.items()} for name, plan in plans.items()}


def decode_plans(data: dict) -> dict[str, SkinnyPlan]:
    """The inverse of `encode_plans`."""
    from pagedserve.kernels.fp8_gemm import Fp8GemmConfig
    from pagedserve.kernels.skinny_gemm import SkinnyConfig

    kinds = {"skinny": SkinnyConfig, "fp8_gemm": Fp8GemmConfig}

    def one(entry):
        if entry is None:
            return None
        kind, *fields = entry
        return kinds[kind](*fields)

    return {name: {int(rows): one(e) for rows, e in plan.items()} for name, plan in data.items()}


class PlanCache:
    """Plans by key in a folder, one JSON file each."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def load(self, key: str) -> dict[str, SkinnyPlan] | None:
        """The plans stored under `key`, or None (none stored, or the file is unreadable)."""
        path = self.path(key)
        try:
            return decode_plans(json.loads(path.read_text())["plans"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring the unreadable matmul plan %s (%s); timing again", path, e)
            return None

    def store(self, key: str, plans: dict[str, SkinnyPlan], about: dict) -> None:
        """Write `plans` under `key` (atomically: a concurrent reader sees all or nothing);
        `about` is kept beside them for people reading the file. A failure to write is logged,
        never raised: the cache only saves time."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"about": about, "plans": encode_plans(plans)}, f, indent=1)
            os.replace(tmp, self.path(key))
        except OSError as e:
            logger.warning("could not keep the matmul plan in %s (%s)", self.directory, e)

"""The adapters a server serves by name (`--lora-modules`, the load/unload endpoints), torch-free:
an adapter's folder is checked here (`lora/peft_checkpoint.py`) before any request names it."""

from __future__ import annotations

import itertools
import json

from pagedserve.config import ModelConfig
from pagedserve.lora.config import LoRAConfig
from pagedserve.lora.peft_checkpoint import AdapterError, read_adapter
from pagedserve.lora.request import LoRARequest
from pagedserve.server.errors import APIError


def parse_lora_module(spec: str) -> LoRARequest:
    """One `--lora-modules` entry: `name=path` or vLLM's JSON `{"name": .., "path": ..,
    "base_model_name": ..}` (its id is given when registered). ValueError names the problem."""
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            d = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"--lora-modules {spec!r} is not valid JSON: {e}") from None
        unknown = sorted(set(d) - {"name", "path", "base_model_name"})
        if unknown or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
            raise ValueError(f"--lora-modules {spec!r}: the JSON form takes \"name\" and \"path\" "
                             f"(strings) and optionally \"base_model_name\"" + (f", not {unknown}" if unknown else ""))
        return LoRARequest(d["name"], 1, d["path"], d.get("base_model_name"))
    name, eq, path = spec.partition("=")
    if not eq or not name or not path:
        raise ValueError(f"--lora-modules {spec!r}: give name=path or the JSON form "
                         "'{\"name\": \"...\", \"path\": \"...\"}'")
    return LoRARequest(name, 1, path)


class LoRARegistry:
    """Adapter name -> LoRARequest (ids given in order, never reused: a name loaded again with
    new weights gets a new id, so the engine's caches never mix them)."""

    def __init__(self, config: LoRAConfig | None, model: ModelConfig | None, base_names: list[str]) -> None:
        self.config, self.model, self.base_names = config, model, base_names
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name is not None else None

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check and register an adapter; APIError 400 names what is wrong."""
        if self.config is None or self.model is None:
            raise APIError(400, "LoRA adapters are off on this server: start it with --enable-lora",
                           param="lora_name", code="lora_disabled")
        if not isinstance(name, str) or not name.strip():
            raise APIError(400, "lora_name must be a non-empty string", param="lora_name")
        if not isinstance(path, str) or not path.strip():
            raise APIError(400, "lora_path must name the adapter's folder", param="lora_path")
        if name in self._by_name or name in self.base_names:
            raise APIError(400, f"the name {name!r} is already served; unload it first or choose another",
                           param="lora_name", code="lora_name_taken")
        try:
            read_adapter(path, self.model, self.config.max_lora_rank)
        except AdapterError as e:
            raise APIError(400, str(e), param="lora_path", code="invalid_lora_adapter") from None
        lora = LoRARequest(name, next(self._ids), path, base_model_name or self.base_names[0])
        self._by_name[name] = lora
        return lora

    def remove(self, name: str) -> None:
        """Forget an adapter (requests running under it finish under it); 404 if unknown."""
        if self._by_name.pop(name, None) is None:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                           code="lora_not_found")

"""`LoRARequest`: which adapter a request runs under (vLLM's fields and meaning)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder (`lora_path`: adapter_config.json + adapter_model.safetensors)
    known to the engine by `lora_int_id` (> 0, unique per adapter: the engine caches its
    weights and its prefix-cache blocks under it) and to users by `lora_name`."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # (the server's /v1/models parent; informational)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be a whole number >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("LoRARequest.lora_path must name the adapter's folder")

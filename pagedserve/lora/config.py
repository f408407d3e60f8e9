"""`LoRAConfig`: the engine's adapter limits (vLLM's --max-loras, --max-lora-rank,
--max-cpu-loras), built once by `EngineArgs.create_engine_config`."""

from __future__ import annotations

from dataclasses import dataclass

# the ranks the device slots may be built for (vLLM's choices)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # adapters resident in device slots at once (and distinct ones per step)
    max_lora_rank: int = 16  # the largest rank an adapter may have (the slots' width)
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: max_loras)

    def __post_init__(self) -> None:
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be a whole number >= 1, got {self.max_loras!r}")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {LORA_RANKS}, got {self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                               or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras!r}) must be a whole number >= "
                             f"max_loras ({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

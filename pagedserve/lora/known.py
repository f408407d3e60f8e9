"""The engine core's check of the adapters requests name (torch-free)."""

from __future__ import annotations

from collections import OrderedDict

from pagedserve.config import ModelConfig
from pagedserve.lora.config import LoRAConfig
from pagedserve.lora.peft_checkpoint import read_adapter
from pagedserve.lora.request import LoRARequest


class KnownAdapters:
    """Adapter id -> the folder checked for it (`read_adapter`, once per id while remembered:
    the last `REMEMBERED` ids, so a server that loads adapters for ever holds a bounded map)."""

    REMEMBERED = 1024

    def __init__(self, config: LoRAConfig | None, model: ModelConfig) -> None:
        self.config, self.model = config, model
        self._paths: OrderedDict[int, str] = OrderedDict()

    def check(self, lora: LoRARequest) -> None:
        """ValueError (AdapterError) unless LoRA is on and the adapter suits the model."""
        if self.config is None:
            raise ValueError("this request names a LoRA adapter but LoRA is off: start the engine "
                             "with enable_lora=True (--enable-lora)")
        known = self._paths.get(lora.lora_int_id)
        if known is None:
            read_adapter(lora.lora_path, self.model, self.config.max_lora_rank)
            self._paths[lora.lora_int_id] = lora.lora_path
            if len(self._paths) > self.REMEMBERED:
                self._paths.popitem(last=False)
        elif known != lora.lora_path:
            raise ValueError(f"lora_int_id {lora.lora_int_id} already names the adapter at {known!r}, "
                             f"not {lora.lora_path!r}: give each adapter an id of its own")

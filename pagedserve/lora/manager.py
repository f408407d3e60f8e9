"""The worker's adapters: slot tensors on every adaptable projection, host copies (an LRU of
`max_cpu_loras`), device slots (an LRU of `max_loras`), and each step's row -> slot map."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.lora.config import LoRAConfig
from pagedserve.lora.layer import LoRABatch, LoRALayer
from pagedserve.lora.peft_checkpoint import TARGETS, read_adapter
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.slots import SlotTable
from pagedserve.lora.weights import AdapterWeights, load_adapter

# our projections an adapter can reach, inside a decoder layer
MODULES = sorted({path for path, _ in TARGETS.values()})


class LoRAManager:
    """Attaches a `LoRALayer` to each adaptable projection of `model` (its `lora`), and
    before each step loads the step's adapters into slots and tells the layers which rows
    run under which slot (`prepare`)."""

    def __init__(self, model: nn.Module, config: LoRAConfig, model_config: ModelConfig,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.config, self.model_config, self.dtype = config, model_config, dtype
        self.batch = LoRABatch(config.max_loras, dtype)
        self.device = device
        self.layers: dict[tuple[int, str], LoRALayer] = {}
        self.shard_index: dict[str, dict[str | None, int]] = {}
        for i, decoder_layer in enumerate(model.layers):
            for path in MODULES:
                try:
                    linear = decoder_layer.get_submodule(path)
                except AttributeError:  # (e.g. a mixture-of-experts MLP: not adaptable)
                    continue
                shards = [linear.shard_offsets[s] for s in linear.shard_names] or [(0, linear.out_features)]
                self.shard_index[path] = ({s: k for k, s in enumerate(linear.shard_names)}
                                          if linear.shard_names else {None: 0})
                linear.lora = self.layers[(i, path)] = LoRALayer(
                    self.batch, config.max_loras, config.max_lora_rank, linear.in_features, shards, dtype, device)
        self.slots = SlotTable(config.max_loras)
        self.host: OrderedDict[int, AdapterWeights] = OrderedDict()  # adapter id -> weights, LRU first
        self.requests: dict[str, LoRARequest] = {}  # request id -> its adapter (base-model requests absent)

    def add_request(self, request_id: str, lora: LoRARequest | None) -> None:
        if lora is not None:
            self.requests[request_id] = lora

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def _weights(self, lora: LoRARequest) -> AdapterWeights:
        """The adapter's host copy, read from its folder when not kept (LRU of max_cpu_loras)."""
        adapter_id = lora.lora_int_id
        w = self.host.get(adapter_id)
        if w is None:
            manifest = read_adapter(lora.lora_path, self.model_config, self.config.max_lora_rank)
            w = load_adapter(adapter_id, manifest, self.shard_index, self.dtype)
            self.host[adapter_id] = w
            while len(self.host) > self.config.cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(adapter_id)
        return w

    def _load_slot(self, lora: LoRARequest, slot: int) -> None:
        w = self._weights(lora)
        for layer in self.layers.values():
            layer.clear(slot)
        for (i, path, shard), (a, b) in w.parts.items():
            self.layers[(i, path)].fill(slot, shard, a, b)

    def bind(self, slots: torch.Tensor) -> None:
        """The step buffers' per-token slot row ([max_tokens] int32) every layer reads."""
        self.batch.bind(slots)

    def prepare(self, request_ids: list[str], query_lens: np.ndarray, failed: dict[str, str]) -> np.ndarray:
        """Before a step of these requests' chunks (`query_lens` [S] tokens each): load their
        adapters into slots. Returns each token's slot [T] int32 (-1: the base model), for
        the step buffers' slot row. An adapter that cannot be loaded (its folder changed since
        it was checked) fails its requests alone: `failed[request id]` says why (the runner
        reports it with the request's next result), and their rows run without it meanwhile."""
        loras = {lora.lora_int_id: lora for rid in request_ids if (lora := self.requests.get(rid)) is not None}
        ids = [lora.lora_int_id if (lora := self.requests.get(rid)) is not None else 0 for rid in request_ids]
        slot_of, load = self.slots.assign(sorted(loras))
        for adapter_id, slot in load:
            try:
                self._load_slot(loras[adapter_id], slot)
            except Exception as e:
                self.slots.drop(adapter_id)
                del slot_of[adapter_id]
                why = f"its LoRA adapter {loras[adapter_id].lora_name!r} could not be loaded: {e}"[:500]
                failed.update({rid: why for rid, a in zip(request_ids, ids) if a == adapter_id})
        per_seq = np.array([slot_of.get(a, -1) for a in ids], dtype=np.int32)
        token_slots = np.repeat(per_seq, query_lens)  # [T]
        self.batch.set_step(token_slots, self.device)
        return token_slots

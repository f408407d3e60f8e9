"""The model list (`/v1/models`: the base model's names, then each LoRA adapter with its
`parent`) and vLLM's endpoints that add and remove adapters while serving (behind the API key,
as every path but the open ones)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from pagedserve.server.errors import APIError
from pagedserve.server.lora_registry import LoRARegistry


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # (vLLM's; the name decides)


def add_model_routes(app: FastAPI, served_names: list[str], loras: LoRARegistry,
                     model_card: Callable[[str], dict]) -> None:
    """`model_card(name)`: the base model's card under `name`."""

    def lora_card(name: str) -> dict:
        lora = loras.get(name)
        return {**model_card(name), "root": lora.lora_path, "parent": lora.base_model_name}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(n) for n in served_names] + [lora_card(n) for n in loras.names]}

    @app.get("/v1/models/{model_id:path}")  # (Hub ids hold a slash: Qwen/Qwen3-4B)
    async def retrieve_model(model_id: str):
        if loras.get(model_id) is not None:
            return lora_card(model_id)
        if model_id not in served_names:
            served = ", ".join(f"`{n}`" for n in served_names + loras.names)
            raise APIError(404, f"The model `{model_id}` does not exist. This server serves "
                                f"{served}.", param="model", code="model_not_found")
        return model_card(model_id)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest):
        loras.add(body.lora_name, body.lora_path)
        return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "loaded"}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest):
        loras.remove(body.lora_name)
        return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded"}

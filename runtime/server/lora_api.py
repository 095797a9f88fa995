"""LoRA adapters over HTTP: SGLang's /load_lora_adapter and /unload_lora_adapter, and which adapter an
OpenAI request's `model` names (SGLang's "base:adapter", or vLLM's bare adapter name)."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from .errors import APIError
from .server_context import ServerContext, get_context

router = APIRouter()


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> dict[str, Any]:
    ctx = get_context(request)
    try:
        loaded = await asyncio.to_thread(ctx.engine.load_lora_adapter, body.lora_name, body.lora_path)
    except ValueError as e:
        raise APIError(400, f"cannot load LoRA adapter {body.lora_name!r}: {e}", param="lora_path") from None
    return {"success": True, "message": f"LoRA adapter {body.lora_name!r} loaded", **loaded}


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> dict[str, Any]:
    ctx = get_context(request)
    try:
        await asyncio.to_thread(ctx.engine.unload_lora_adapter, body.lora_name)
    except ValueError as e:
        status = 404 if "unknown LoRA adapter" in str(e) else 400
        raise APIError(status, f"cannot unload LoRA adapter {body.lora_name!r}: {e}", param="lora_name") from None
    return {"success": True, "message": f"LoRA adapter {body.lora_name!r} unloaded"}


def adapter_of_model(model: Optional[str], ctx: ServerContext) -> Optional[str]:
    """The LoRA adapter an OpenAI request's `model` names: None for the served model (or no name); a 404
    naming it for a model that is neither the served one nor a loaded adapter."""
    if not model or model in ctx.accepted_model_names:
        return None
    names = loaded_adapters(ctx)
    base, sep, adapter = model.rpartition(":")
    if sep and base in ctx.accepted_model_names and adapter in names:
        return adapter  # SGLang's "base:adapter"
    if model in names:
        return model  # vLLM's: the adapter's own name
    loaded = f"; LoRA adapters: {', '.join(sorted(names))}" if names else ""
    raise APIError(404, f"model '{model}' does not exist; this server serves '{ctx.model_name}'{loaded}", param="model")


def loaded_adapters(ctx: ServerContext) -> dict[str, str]:
    """The LoRA adapters loaded now, name -> folder (the tokenizer manager's; an engine stand-in in tests
    may have none)."""
    return getattr(getattr(ctx.engine, "tokenizer_manager", None), "lora_adapters", {})


def adapter_cards(ctx: ServerContext, created: int) -> list[dict[str, Any]]:
    """/v1/models' entries of the loaded adapters, as vLLM lists them: the adapter's name as its id, its
    folder as `root`, the served model as `parent`."""
    return [
        {"id": name, "object": "model", "created": created, "owned_by": "plait", "root": path, "parent": ctx.model_name}
        for name, path in sorted(loaded_adapters(ctx).items())
    ]

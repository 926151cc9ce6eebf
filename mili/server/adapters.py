"""vLLM's routes for LoRA adapters at run time: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
Only on a server started with ``--enable-lora`` and ``--allow-runtime-lora-updating`` (vLLM: the environment variable
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); adapters named at start-up come from ``--lora-modules``.

A loaded adapter is checked against the base model before it is served (a missing, corrupt or mismatched one is a
400 naming why). Unloading takes the name away at once: new requests naming it get a 404, and requests already
running with it finish with it (the engine core keeps an adapter loaded while any request uses it)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mili.server.errors import APIError, error_responses
from mili.server.protocol import LoadLoRARequest, UnloadLoRARequest
from mili.server.state import ServerState, state_of

router = APIRouter()
_DONE = {200: {"description": "vLLM's plain-text answer", "content": {"text/plain": {}}}}


def _check_allowed(st: ServerState) -> None:
    if not st.runtime_lora_updating:
        raise APIError(400, "loading and unloading LoRA adapters at run time is off: start the server with "
                            "--enable-lora --allow-runtime-lora-updating", param="lora_name")
    if st.api_servers is not None:
        raise APIError(400, "with --api-server-count > 1, adapters come from --lora-modules only (each API process "
                            "keeps its own list)", param="lora_name")


@router.post("/v1/load_lora_adapter", responses={**_DONE, **error_responses(400)})
async def load_lora_adapter(body: LoadLoRARequest, http: Request):
    st = state_of(http)
    _check_allowed(st)
    st.add_lora(body.lora_name, body.lora_path)
    http.app.openapi_schema = None  # (its model names change)
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")


@router.post("/v1/unload_lora_adapter", responses={**_DONE, **error_responses(400, 404)})
async def unload_lora_adapter(body: UnloadLoRARequest, http: Request):
    st = state_of(http)
    _check_allowed(st)
    if body.lora_name not in st.loras:
        raise APIError(404, f"The LoRA adapter `{body.lora_name}` is not loaded.", "not_found_error", "lora_name",
                       "model_not_found")
    del st.loras[body.lora_name]
    http.app.openapi_schema = None
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

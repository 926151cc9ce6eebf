"""`mili serve` of an AWQ int4 checkpoint in bf16 (the CPU's int4 kernel): it serves, and /health,
/v1/models and the start-up log say what was loaded."""

from __future__ import annotations

import httpx
import pytest
from safetensors.torch import load_file

from support.checkpoints import build_checkpoint
from support.quantized import awq_layout, write_quantized_checkpoint
from support.server import Server
from mili.kernels import cpu


@pytest.mark.skipif(not cpu.int8_available(), reason="MILI's int kernels need AVX-512 VNNI or AMX")
def test_awq_server_reports_its_format(tmp_path):
    dense = build_checkpoint(tmp_path / "dense", "gqa4_realvocab", hidden_size=128, intermediate_size=256)
    tensors, _ = awq_layout(load_file(dense / "model.safetensors"), 128)
    path = write_quantized_checkpoint(dense, tmp_path / "awq", tensors, {
        "quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True})
    server = Server(path, "--dtype", "bfloat16")
    try:
        health = httpx.get(f"{server.url}/health").json()
        head = ", lm_head int8" + (" (W8A8 kernel)" if cpu.int8_available() else "")  # (--lm-head-dtype auto)
        assert health["quantization"] == "awq int4 (group 128, zero points) on the int4 kernel (W4A8)" + head
        assert health["kv_cache_dtype"] == "bfloat16" and health["dtype"] == "bfloat16"
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]
        assert model["quantization"] == health["quantization"]
        out = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
        assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["text"]
        assert "weights: awq int4 (group 128, zero points) on the int4 kernel" in server.output()
    finally:
        assert server.stop() == 0, server.output()

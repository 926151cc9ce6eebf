"""The weight formats as objects (mili/model/formats): one registry of every format, each with its name, its words and
its bytes a weight; the plan holds them (not strings) and reaches every one; a new format is one module of the
package; each puts a model's layers on its kernels at about the bytes it says."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest
import torch
from torch import nn
from transformers import Qwen3Config

from mili.config import EngineConfig, ModelConfig
from mili.kernels.cpu import ops as cpu_ops
from mili.model import formats
from mili.model.cpu_linear import Fp8Linear, Int8Linear, KernelLinear, PackedLinear
from mili.model.formats import FORMATS, LinearFormat, format_named
from mili.runtime.plan import DeviceInfo, plan

KIB = 1024
H100 = DeviceInfo("cuda", "H100", 0, (9, 0), 227 * KIB, 132, triton=True, fla=True)
ZEN3 = DeviceInfo("cpu", "x86_64 CPU", cpu_kernels="avx2", int8_kernels_why="",
                  onednn_bf16="no AVX-512 (oneDNN's bf16 kernels need it)")
NO_KERNELS = DeviceInfo("cpu", "x86_64 CPU", cpu_kernels_why="no C compiler (cc) on PATH", onednn_bf16="")
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}
BF16 = torch.bfloat16


def qwen3(quantization=None) -> ModelConfig:
    hf = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                     dtype="bfloat16")
    hf.architectures = ["Qwen3ForCausalLM"]
    if quantization:
        hf.quantization_config = quantization
    return ModelConfig.from_hf(hf)


def test_each_format_is_registered_by_its_name():
    assert set(FORMATS) == {"plain", "packed", "kernel", "int8", "triton-int8", "fp8", "triton"}
    for name, cls in FORMATS.items():
        fmt = format_named(name)
        assert isinstance(fmt, LinearFormat) and type(fmt) is cls and fmt.name == name and cls.summary
        assert cls.__module__.startswith("mili.model.formats.")
        assert 0 < fmt.bytes_per_weight(BF16) <= 2 and isinstance(fmt.fused_decode, bool)
        assert fmt == format_named(name) and dataclasses.is_dataclass(fmt)  # (equal where the plan's choices are)
    assert format_named("int8", kernels=True) != format_named("int8")
    with pytest.raises(ValueError, match="no weight format named 'int3'"):
        format_named("int3")


def test_the_plan_holds_format_objects_and_reaches_every_one():
    """Over a few devices and checkpoints, the plan's body and lm_head formats take every registered format."""
    def p(device, model=None, **kw):
        return plan(EngineConfig("tiny", **kw), model or qwen3(), device)

    plans = [p(H100), p(NO_KERNELS), p(ZEN3), p(ZEN3, quantization="int8"), p(H100, quantization="int8"),
             p(H100, quantization="fp8"), p(H100, qwen3(AWQ)), p(ZEN3, qwen3(AWQ)), p(ZEN3, lm_head_dtype="bf16"),
             p(NO_KERNELS, lm_head_dtype="bf16")]
    assert all(isinstance(q.linears, LinearFormat) for q in plans)
    reached = {type(q.linears) for q in plans} | {type(q.lm_head) for q in plans if q.lm_head is not None}
    assert reached == set(FORMATS.values())
    awq = plans[7]  # an int4 body on the CPU's kernel: its head int8 on the W8A8 kernel, in the plan's words
    assert awq.lm_head == format_named("int8", kernels=True) and awq.weight_format.endswith("lm_head int8 (W8A8 kernel)")
    assert plans[8].lm_head == format_named("kernel") and plans[9].lm_head == format_named("packed")
    assert plans[2].linears.fused_decode and not plans[1].linears.fused_decode


def test_a_new_format_is_one_module(tmp_path, monkeypatch):
    """A module dropped into the package registers its format as the package loads its modules."""
    (tmp_path / "quarter.py").write_text('''
from dataclasses import dataclass

from mili.model.formats.base import LinearFormat


@dataclass(frozen=True)
class Quarter(LinearFormat):
    name = "test-quarter"
    summary = "a test's format"

    def bytes_per_weight(self, dtype):
        return 0.25

    def apply(self, model, quantized, skip_head):
        pass
''')
    monkeypatch.setattr(formats, "__path__", [*formats.__path__, str(tmp_path)])
    try:
        formats.load_modules()
        assert format_named("test-quarter").bytes_per_weight(BF16) == 0.25
    finally:
        FORMATS.pop("test-quarter", None)
        sys.modules.pop("mili.model.formats.quarter", None)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(64, 256, dtype=BF16)
        self.model.layers = nn.ModuleList([nn.Linear(256, 512, bias=False, dtype=BF16) for _ in range(2)])
        self.lm_head = nn.Linear(256, 64, bias=False, dtype=BF16)


def _step_bytes(module: nn.Module) -> int:  # (as tools/bench.py's weight_bytes_per_step counts)
    return sum(t.numel() * t.element_size() for m in module.modules()
               for t in (getattr(m, a, None) for a in ("weight", "qweight", "packed", "scales", "offsets", "zeros",
                                                       "weight_scale"))
               if isinstance(t, torch.Tensor) and t.dim() >= 2)


CPU_FORMATS = [("plain", {}, nn.Linear), ("packed", {}, PackedLinear),
               ("int8", {}, Int8Linear), ("int8", {"kernels": True}, Int8Linear), ("kernel", {}, KernelLinear),
               ("fp8", {}, Fp8Linear), ("triton-int8", {}, None)]


@pytest.mark.parametrize("name,choices,layer", CPU_FORMATS)
def test_each_format_puts_the_layers_on_its_kernels_at_its_bytes(name, choices, layer):
    if name == "packed" and DeviceInfo.probe(torch.device("cpu")).onednn_bf16:
        pytest.skip("oneDNN's bf16 packing does not run here (the plan never picks it here)")
    if name == "kernel" and not cpu_ops.linear_supported(torch.empty(512, 256, dtype=BF16)):
        pytest.skip("MILI's CPU kernels do not load here")
    if name == "int8" and choices and not DeviceInfo.probe(torch.device("cpu")).int8_kernels:
        pytest.skip("MILI's int8 kernels do not run here")
    if name == "triton-int8":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("no triton")
        from mili.model.gpu_linear import TritonInt8Linear

        layer = TritonInt8Linear
    fmt = format_named(name, **choices)
    model = _Tiny()
    fmt.apply(model, {}, skip_head=False)
    assert all(type(m) is layer for m in model.model.layers)
    weights = sum(m.in_features * m.out_features for m in model.model.layers)
    assert _step_bytes(model.model.layers) / weights == pytest.approx(fmt.bytes_per_weight(BF16), rel=0.05)

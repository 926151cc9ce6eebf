"""The CPU linear swaps: prepacked bf16 (where oneDNN's bf16 runs) and int8 weight-only, alone and inside the
engine; where oneDNN's bf16 does not run (a CPU without AVX-512, or MILI_CPU_ISA below it), the layers stay
aten's, with the same tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mili import LLM, InvalidRequest, SamplingParams
from mili.kernels import cpu
from mili.model.cpu_linear import Int8Linear, PackedLinear

ONEDNN = not cpu.onednn_bf16()


@pytest.mark.skipif(not ONEDNN, reason="oneDNN's bf16 packing does not run here (the engine test covers its absence)")
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_packed_equals_linear(rows):
    torch.manual_seed(0)
    w, b = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(2, rows, 64).bfloat16()
    packed = PackedLinear(w, b)
    ref = F.linear(x, w, b)
    assert packed(x).shape == ref.shape
    torch.testing.assert_close(packed(x).float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 3, 40])  # 40 rows take the dequantized path
def test_int8_close_to_bf16(rows):
    torch.manual_seed(0)
    w = torch.randn(128, 64).bfloat16()
    x = torch.randn(rows, 64).bfloat16()
    q = Int8Linear(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() <= 127
    dequant = q.qweight.float() * q.scales.float()[:, None]
    assert (dequant - w.float()).abs().max() <= q.scales.float().max() / 2 + 1e-2  # round to nearest
    rel = (q(x).float() - F.linear(x, w).float()).norm() / F.linear(x, w).float().norm()
    assert rel < 0.02


def test_engine_with_swaps(tiny_checkpoint):
    prompt = {"prompt_token_ids": list(range(5, 60))}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    plain = LLM(str(tiny_checkpoint), dtype="bfloat16", cpu_kernels=False, cpu_weight_prepack=False)
    packed = LLM(str(tiny_checkpoint), dtype="bfloat16", cpu_kernels=False)
    int8 = LLM(str(tiny_checkpoint), dtype="bfloat16", quantization="int8", cpu_kernels=False)
    qkv = packed.apply_model(lambda m: m.model.layers[0].self_attn.qkv_proj)
    assert isinstance(qkv, PackedLinear) == ONEDNN  # (else aten's linear: no crash for want of an instruction)
    assert isinstance(int8.apply_model(lambda m: m.lm_head), Int8Linear)
    assert qkv.shard_sizes == [128, 64, 64]
    a, b, c = (llm.generate(prompt, params, use_tqdm=False)[0].outputs[0] for llm in (plain, packed, int8))
    assert a.token_ids == b.token_ids  # the same arithmetic in another memory layout
    assert c.token_ids[:3] == a.token_ids[:3]  # int8 stays close (random weights part later)
    with pytest.raises(InvalidRequest, match="quantization"):
        LLM(str(tiny_checkpoint), quantization="int4")

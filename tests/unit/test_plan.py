"""The execution plan (mili/runtime/plan.py) over a table of devices no test machine has all of: every choice is a
pure function of (engine config, model config, device description), and every refusal is made there, by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen3Config, Qwen3MoeConfig

from mili.config import EngineConfig, ModelConfig
from mili.errors import InvalidRequest
from mili.model.formats.fp8 import Fp8
from mili.model.formats.int8 import Int8, TritonInt8
from mili.model.formats.kernel import Kernel
from mili.model.formats.plain import Packed, Plain
from mili.model.formats.triton import Triton
from mili.runtime.plan import (AttentionBackend, DeviceInfo, DrawKind, LoRAKernel, PrefixCacheKind, SpeculativeMethod,
                               StepKind, plan)

KIB = 1024
H100 = DeviceInfo("cuda", "H100", 0, (9, 0), 227 * KIB, 132, triton=True, fla=True)
L4 = DeviceInfo("cuda", "L4", 0, (8, 9), 99 * KIB, 58, triton=True, fla=True)
A100 = DeviceInfo("cuda", "A100", 0, (8, 0), 163 * KIB, 108, triton=True, fla=True)
V100 = DeviceInfo("cuda", "V100", 0, (7, 0), 96 * KIB, 80, triton=True)
ZEN3 = DeviceInfo("cpu", "x86_64 CPU", cpu_kernels="avx2", int8_kernels_why="",  # an AVX2 laptop: no oneDNN bf16
                  onednn_bf16="no AVX-512 (oneDNN's bf16 kernels need it)")
SAPPHIRE_RAPIDS = DeviceInfo("cpu", "x86_64 CPU", cpu_kernels="amx", int8_kernels_why="", onednn_bf16="")
SKYLAKE_X = DeviceInfo("cpu", "x86_64 CPU", cpu_kernels="avx512", int8_kernels_why="no VNNI", onednn_bf16="")
GRAVITON = DeviceInfo("cpu", "aarch64 CPU", cpu_kernels="neon-dot", int8_kernels_why="", onednn_bf16="no bf16")
NO_KERNELS = DeviceInfo("cpu", "x86_64 CPU", cpu_kernels_why="no C compiler (cc) on PATH", onednn_bf16="")
INTERPRETER = DeviceInfo("cpu", "x86_64 CPU", cpu_kernels="avx512", int8_kernels_why="", onednn_bf16="",
                         triton=True, triton_interpret=True)

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def qwen3(dtype="bfloat16", quantization=None, moe=False, head_dim=32) -> ModelConfig:
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512, dtype=dtype)
    hf = Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **shape) if moe \
        else Qwen3Config(**shape)
    hf.architectures = ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
    if quantization:
        hf.quantization_config = quantization
    return ModelConfig.from_hf(hf)


def engine(**kw) -> EngineConfig:
    return EngineConfig("tiny", **kw)


@pytest.mark.parametrize("device,attention,linears,step", [
    (H100, AttentionBackend.TRITON, Plain(), StepKind.CUDA_GRAPHS),
    (A100, AttentionBackend.TRITON, Plain(), StepKind.CUDA_GRAPHS),
    (ZEN3, AttentionBackend.CPU, Kernel(), StepKind.CPU_DECODE),
    # (a layer the kernel can't take goes to oneDNN's packing where that runs)
    (SAPPHIRE_RAPIDS, AttentionBackend.CPU, Kernel(prepack=True), StepKind.CPU_DECODE),
    (GRAVITON, AttentionBackend.CPU, Kernel(), StepKind.CPU_DECODE),
    # oneDNN's bf16 packing where MILI's kernels don't load
    (NO_KERNELS, AttentionBackend.TORCH, Packed(), StepKind.EAGER),
])
def test_a_bf16_model_on_each_device(device, attention, linears, step):
    p = plan(engine(), qwen3(), device)
    assert (p.attention, p.linears, p.step, p.dtype, p.kv_dtype) == (attention, linears, step, torch.bfloat16,
                                                                     torch.bfloat16)
    assert p.cpu_kernels == (attention is AttentionBackend.CPU) and p.weight_format == "unquantized"
    assert set(p.describe()) >= {"device", "dtype", "attention", "weights", "kv cache", "step", "speculative"}
    if device.type == "cpu":  # each family's path is named, from the description alone
        paths = p.cpu_paths
        assert paths["bf16 linears"] == (f"MILI kernel ({device.cpu_kernels})" + " on AMX tiles" * (
            device.cpu_kernels == "amx") if device.cpu_kernels else "aten on oneDNN-packed weights")


def test_the_cpu_without_kernels_or_in_float32_runs_aten():
    zen3_no_kernels = dataclasses.replace(ZEN3, cpu_kernels="", cpu_kernels_why="MILI_CPU_ISA=none")
    p = plan(engine(), qwen3(), zen3_no_kernels)
    # no oneDNN bf16 on AVX2 either
    assert (p.attention, p.linears, p.step) == (AttentionBackend.TORCH, Plain(), StepKind.EAGER)
    assert "MILI_CPU_ISA=none" in p.cpu_paths["norms, RoPE, SwiGLU"]
    f32 = plan(engine(dtype="float32"), qwen3(), SAPPHIRE_RAPIDS)
    assert (f32.attention, f32.linears, f32.dtype) == (AttentionBackend.TORCH, Plain(), torch.float32)
    assert f32.cpu_paths["bf16 linears"] == "aten (float32)"
    half = plan(engine(), qwen3("float16"), ZEN3)  # float16 checkpoints run bf16 on the CPU
    assert half.dtype == torch.bfloat16 and plan(engine(), qwen3("float16"), H100).dtype == torch.float16
    assert plan(engine(cpu_kernels=False), qwen3(), SAPPHIRE_RAPIDS).attention is AttentionBackend.TORCH
    assert plan(engine(dtype="bf16"), qwen3("float32"), ZEN3).dtype == torch.bfloat16  # (the names LLM() accepts)
    assert plan(engine(dtype="half"), qwen3(), H100).dtype == torch.float16


def test_int8_and_awq_follow_the_int8_kernels():
    assert plan(engine(quantization="int8"), qwen3(), ZEN3).weight_format == "int8 per channel (W8A8 kernel)"
    skx = plan(engine(quantization="int8"), qwen3(), SKYLAKE_X)  # AVX-512 without VNNI: aten's weight-only int8
    assert (skx.linears, skx.int8_kernels, skx.weight_format) == (Int8(False), False, "int8 per channel (weight-only)")
    awq = plan(engine(), qwen3(quantization=AWQ), GRAVITON)
    assert awq.keep_quantized and awq.lm_head == Int8(True) and "on the int4 kernel (W4A8)" in awq.weight_format
    dequantized = plan(engine(), qwen3(quantization=AWQ), SKYLAKE_X)
    assert not dequantized.keep_quantized and dequantized.lm_head is None
    assert dequantized.weight_format.endswith("dequantized to bfloat16")
    gpu = plan(engine(), qwen3(quantization=AWQ), H100)
    assert (type(gpu.linears), gpu.linears.group_size, gpu.keep_quantized) == (Triton, 32, True)
    assert "Triton int4 GEMM" in gpu.weight_format
    assert set(gpu.gemm_tiles) == {"fp8 decode", "fp8 prefill", "int4 decode", "int4 prefill"}


@pytest.mark.parametrize("device,linears,weights,step", [
    (H100, TritonInt8(), "int8 per channel (Triton, weight-only)", StepKind.CUDA_GRAPHS),
    (A100, TritonInt8(), "int8 per channel (Triton, weight-only)", StepKind.CUDA_GRAPHS),
    (L4, TritonInt8(), "int8 per channel (Triton, weight-only)", StepKind.CUDA_GRAPHS),
    # the CPU's paths stay as they were
    (INTERPRETER, Int8(True), "int8 per channel (W8A8 kernel)", StepKind.CPU_DECODE),
    (ZEN3, Int8(True), "int8 per channel (W8A8 kernel)", StepKind.CPU_DECODE),
    (SKYLAKE_X, Int8(False), "int8 per channel (weight-only)", StepKind.EAGER),
])
def test_int8_on_cuda_runs_the_triton_gemm(device, linears, weights, step):
    p = plan(engine(quantization="int8"), qwen3(), device)
    assert (p.linears, p.weight_format, p.step, p.int8_kernels) == (linears, weights, step, device.type == "cpu"
                                                                     and not device.int8_kernels_why)
    assert set(p.gemm_tiles) == ({"int8 decode", "int8 prefill"} if device.type == "cuda" else set())
    assert p.lm_head is None and not p.keep_quantized  # (the swap quantizes the head as the body)


def test_int8_off_the_triton_gemm_where_it_cannot_run():
    """The Triton backend under TRITON_INTERPRET runs the GEMM (the tests' path); CUDA without triton, or before SM
    8.0 (V100, the torch backend), keeps aten's weight-only int8; tensor parallelism and hybrids are refused."""
    interpreted = plan(engine(quantization="int8", attention_backend="triton"), qwen3(), INTERPRETER)
    assert (interpreted.linears, interpreted.weight_format) == (TritonInt8(), "int8 per channel (Triton, weight-only)")
    for device, kw in ((dataclasses.replace(H100, triton=False), {}), (V100, {"attention_backend": "torch"})):
        p = plan(engine(quantization="int8", **kw), qwen3(), device)
        assert (p.linears, p.weight_format, p.gemm_tiles) == (Int8(False), "int8 per channel (weight-only)", {})
    f32 = plan(engine(quantization="int8", dtype="float32"), qwen3(), H100)  # float32 models: IEEE dots, small tiles
    assert f32.linears == TritonInt8() and f32.gemm_tiles["int8 prefill"].block_m == 16
    with pytest.raises(InvalidRequest, match="quantization with tensor parallelism"):
        plan(engine(quantization="int8", tensor_parallel_size=2), qwen3(), H100)
    hybrid = dataclasses.replace(qwen3(), layer_types=["linear_attention", "full_attention"])
    with pytest.raises(InvalidRequest, match="--quantization int8 is not supported for hybrid models"):
        plan(engine(quantization="int8"), hybrid, H100)


def test_the_gemm_tiles_fit_each_device():
    """A float32 model's AWQ prefill on an L4 (99 KiB a block) takes a tile that fits, not an H100's."""
    from mili.kernels.triton.launch import gemm_smem_bound

    for device in (H100, L4, A100):
        p = plan(engine(dtype="float32"), qwen3(quantization=AWQ), device)
        for kind, tile in p.gemm_tiles.items():
            w_bytes = 1 if kind.startswith("fp8") else 0.5
            assert gemm_smem_bound(tile.block_m, tile.block_n, 128, 4, w_bytes, tile.num_stages) <= device.smem_per_block
    h100, l4 = (plan(engine(), qwen3(quantization=AWQ), d).gemm_tiles["int4 prefill"] for d in (H100, L4))
    assert (l4.block_m, l4.num_stages) < (h100.block_m, h100.num_stages)


def test_fp8_and_the_kv_cache():
    assert plan(engine(quantization="fp8"), qwen3(), H100).linears == Fp8()
    a100 = plan(engine(quantization="fp8"), qwen3(), A100)  # no FP8 GEMM before SM 8.9: int8 from FP8 values
    assert a100.linears == TritonInt8() and a100.fp8_round_trip
    assert a100.weight_format == "int8 per channel (Triton, weight-only), requantized from fp8 values"
    assert plan(engine(kv_cache_dtype="fp8"), qwen3(), H100).kv_dtype == torch.float8_e4m3fn
    with pytest.raises(InvalidRequest, match="FP8 \\(compute capability 8.9"):
        plan(engine(kv_cache_dtype="fp8"), qwen3(), A100)
    with pytest.raises(InvalidRequest, match="needs the Triton attention backend"):
        plan(engine(kv_cache_dtype="fp8"), qwen3(), ZEN3)
    assert plan(engine(kv_cache_dtype="fp8", attention_backend="triton"), qwen3(), INTERPRETER).kv_dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("device,kw,match", [
    (V100, {}, "SM 8.0 or later"),
    (dataclasses.replace(ZEN3, triton=True), {"attention_backend": "triton"}, "TRITON_INTERPRET=1"),
    (dataclasses.replace(H100, triton=False), {"attention_backend": "triton"}, "needs the triton package"),
    (INTERPRETER, {"attention_backend": "triton", "page_size": 8}, "page_size a power of two"),
    (H100, {"lm_head_dtype": "int8"}, "--lm-head-dtype int8 runs on the CPU"),
    (ZEN3, {"max_model_len": 4096}, "exceeds the model's max_position_embeddings 512"),
    (ZEN3, {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}, "method mtp runs the hybrid"),
    (ZEN3, {"tensor_parallel_size": 2, "quantization": "int8"}, "quantization with tensor parallelism"),
])
def test_what_cannot_run_is_refused_by_name(device, kw, match):
    with pytest.raises(InvalidRequest, match=match):
        plan(engine(**kw), qwen3(), device)


def test_an_already_quantized_checkpoint_is_not_quantized_again():
    with pytest.raises(InvalidRequest, match="already quantized"):
        plan(engine(quantization="int8"), qwen3(quantization=FP8), ZEN3)


def test_tensor_parallelism_moe_and_eager():
    tp = plan(engine(tensor_parallel_size=2), qwen3(), SAPPHIRE_RAPIDS)
    assert (tp.attention, tp.step, tp.tensor_parallel_size) == (AttentionBackend.TORCH, StepKind.EAGER, 2)
    assert tp.cpu_paths["norms, RoPE, SwiGLU"] == "torch (MILI kernels off: tensor parallelism)"
    tp_gpu = plan(engine(tensor_parallel_size=2), qwen3(), H100)
    assert tp_gpu.step is StepKind.EAGER and "tensor-parallel" in tp_gpu.step_why
    moe = plan(engine(), qwen3(moe=True), H100)
    assert moe.step is StepKind.EAGER and "MoE" in moe.step_why
    cpu_moe = plan(engine(), qwen3(moe=True), ZEN3)
    assert cpu_moe.step is StepKind.EAGER and "mixture-of-experts" in cpu_moe.step_why
    assert "multiples of 32" in plan(engine(), qwen3(head_dim=16), ZEN3).step_why  # the fused layer's bound
    assert plan(engine(enforce_eager=True), qwen3(), H100).step is StepKind.EAGER
    assert plan(engine(enforce_eager=True), qwen3(), ZEN3).step is StepKind.EAGER


def test_the_fused_cpu_decode_takes_only_layers_it_runs_whole():
    """A layer the fused C decode layer cannot take is known from the shapes and formats, before a weight loads."""
    odd = qwen3()
    odd.intermediate_size = 100  # gate_up's 200 outputs: not a multiple of 16
    assert plan(engine(), odd, ZEN3).step is StepKind.EAGER and "multiple of 16" in plan(engine(), odd, ZEN3).step_why
    assert plan(engine(quantization="int8"), qwen3(), ZEN3).step is StepKind.CPU_DECODE  # the W8A8 kernel's layers
    assert plan(engine(quantization="int8"), qwen3(), SKYLAKE_X).step is StepKind.EAGER  # aten's weight-only int8


def test_sampling_draws_without_a_host_sync_on_gpus():
    assert plan(engine(), qwen3(), ZEN3).draw is DrawKind.INVERSE_CDF
    assert plan(engine(), qwen3(), H100).draw is DrawKind.EXPONENTIAL_RACE


def test_the_prefix_cache_and_the_lora_kernel_are_chosen_here():
    """The engine core keeps the prefix cache of the plan's kind, and the runner puts the LoRA adapters' products
    on the plan's kernel: neither decides after the plan."""
    hybrid = dataclasses.replace(qwen3(), layer_types=["linear_attention", "full_attention"])
    assert plan(engine(), qwen3(), ZEN3).prefix_cache is PrefixCacheKind.RADIX
    assert plan(engine(), hybrid, ZEN3).prefix_cache is PrefixCacheKind.HYBRID_RADIX
    assert plan(engine(num_state_snapshots=3), hybrid, H100).prefix_cache is PrefixCacheKind.HYBRID_RADIX
    off = plan(engine(num_state_snapshots=0), hybrid, ZEN3)  # a hybrid resumes only from a snapshot
    assert off.prefix_cache is PrefixCacheKind.NONE and "num_state_snapshots is 0" in off.prefix_cache_why
    assert "num_state_snapshots is 0" in off.describe()["prefix cache"]
    asked_off = plan(engine(enable_prefix_caching=False), qwen3(), H100)
    assert (asked_off.prefix_cache, asked_off.prefix_cache_why) == (PrefixCacheKind.NONE, "")
    assert asked_off.describe()["prefix cache"] == "off"
    assert plan(engine(), qwen3(), ZEN3).lora is None and "lora" not in plan(engine(), qwen3(), ZEN3).describe()
    for device, kw, kernel in ((H100, {}, LoRAKernel.TRITON), (ZEN3, {}, LoRAKernel.CPU),
                               (ZEN3, {"cpu_kernels": False}, LoRAKernel.TORCH), (NO_KERNELS, {}, LoRAKernel.TORCH),
                               (INTERPRETER, {"attention_backend": "triton"}, LoRAKernel.TRITON)):
        p = plan(engine(enable_lora=True, **kw), qwen3(), device)
        assert p.lora is kernel and p.describe()["lora"] == kernel.value


def test_the_memory_split():
    p = plan(engine(kv_cache_memory=2**26, num_kv_pages=10), qwen3(), ZEN3)
    assert (p.memory.budget, p.memory.num_kv_pages) == (2**26, 10)
    assert plan(engine(), qwen3(), H100).memory.budget is None  # measured once the weights are in
    assert plan(engine(), qwen3(), ZEN3).memory.budget > 0  # the CPU's default
    rows = dataclasses.replace(plan(engine(), qwen3(), ZEN3).memory, max_num_seqs=8, max_spare_rows=4)
    assert rows.states(budget=4 * 100 * 16, per_slot=100) == (8, 16, 4)  # 8 slots, 2 to 4 snapshots a slot
    assert dataclasses.replace(rows, prefix_caching=False).states(1 << 20, 100)[1] == 0


def test_the_plan_is_frozen():
    p = plan(engine(), qwen3(), ZEN3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.attention = "torch"


def test_the_plan_choices_are_enums_described_by_their_values():
    """attention, step, speculative and draw are enums; ``describe()`` shows their values (the words it always did)."""
    gpu = plan(engine(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), qwen3(), H100)
    assert (gpu.attention, gpu.speculative, gpu.draw) == (AttentionBackend.TRITON, SpeculativeMethod.NGRAM,
                                                          DrawKind.EXPONENTIAL_RACE)
    rows = gpu.describe()
    assert (rows["attention"], rows["speculative"]) == ("triton", "ngram") and rows["step"].startswith("cuda-graphs")
    cpu = plan(engine(), qwen3(), ZEN3).describe()
    assert (cpu["attention"], cpu["step"], cpu["speculative"]) == ("cpu", "cpu-decode", "off")

"""Quantized checkpoints on the Triton GEMMs (the CUDA path), on the CPU under TRITON_INTERPRET=1: the kernels
against their torch references, the linear layers against the dequantized weights, which layer each
device gets, and the engine on its Triton path (device cpu, attention_backend triton) against HF
transformers running the dequantized weights. Speed is not measured here (no GPU)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

triton = pytest.importorskip("triton")

from support.devices import TRITON_DEVICE as DEVICE  # noqa: E402
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from support.engine_state import model_runner  # noqa: E402
from support.parity import greedy_matches, prompt_logprobs  # noqa: E402
from support.quantized import QUANT_LINEARS, awq_layout, write_quantized_checkpoint  # noqa: E402
from mili import LLM, SamplingParams  # noqa: E402
from mili.kernels import reference as ref  # noqa: E402
from mili.model.quant import quantize_fp8_blocks  # noqa: E402
from mili.kernels.triton import quant_gemm as qg  # noqa: E402
from mili.model import gpu_linear, quant  # noqa: E402
from mili.model.cpu_linear import Fp8Linear  # noqa: E402

# float32: the kernels sum in another order than torch; bf16/fp16: and round the output once (the
# interpreter's float32 -> bf16 cast truncates: one ulp)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _fp8_weight(n: int, k: int, block: tuple[int, int], seed: int = 0):
    """Random FP8 weights and float32 scales, one per block (partial blocks at the edges)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.01 + 1e-3
    return q.to(DEVICE), scale.to(DEVICE)


# -- kernels ----------------------------------------------------------------------------------------------
def test_per_token_group_quant_fp8():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g) * torch.logspace(-3, 3, 6)[:, None]  # groups of 128, the last of 44
    x[2, 128:256] = 0  # an all-zero group
    q, scales = qg.per_token_group_quant_fp8(x.to(DEVICE))
    want_q, want_scales = ref.per_token_group_quant_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (6, 3)
    torch.testing.assert_close(scales.cpu(), want_scales, atol=0, rtol=0)
    torch.testing.assert_close(q.float().cpu(), want_q.float(), atol=0, rtol=0)
    assert q.float().abs().amax() == 448 and scales[2, 1] < 1e-11 and (q.float()[2, 128:256] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_activations", [True, False])
@pytest.mark.parametrize("rows,split_k", [(1, None), (5, 3), (40, None)])  # decode splits K; 5 x 3 ragged parts
def test_fp8_gemm(dtype, fp8_activations, rows, split_k):
    n, k, block = 200, 640, (128, 128)  # partial blocks along N; K in 5 steps
    q, scale = _fp8_weight(n, k, block)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    if rows == 1:
        assert qg.split_k_for(1, n, 5, 16, 64) > 1  # the decode path really splits
    got = qg.fp8_linear(x, q, scale, block, fp8_activations, split_k=split_k)
    want = ref.fp8_linear(x, q, scale, block, fp8_activations)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = dict(TOL[dtype])
    if fp8_activations and DEVICE == "cuda":  # Hopper's FP8 MMA sums each 128-wide K step in reduced precision
        # (as vLLM's and SGLang's block-FP8 GEMMs, same design): on an H200, up to ~2e-4 of the outputs' scale
        tol["atol"] = max(tol["atol"], 1e-3 * want.float().abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), **tol)
    if fp8_activations:  # and the activations really were quantized
        assert (want.float() - ref.fp8_linear(x, q, scale, block, False).float()).abs().max() > 1e-2


def test_fp8_gemm_per_channel():
    torch.manual_seed(0)
    n, k = 96, 64
    q, scale = _fp8_weight(n, k, (1, k), seed=2)
    x = torch.randn(3, k).to(DEVICE)
    for fp8_activations in (True, False):
        got = qg.fp8_linear(x, q, scale, (1, k), fp8_activations)
        torch.testing.assert_close(got, ref.fp8_linear(x, q, scale, (1, k), fp8_activations), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("rows,split_k", [(1, None), (3, 5), (40, None)])
def test_int4_gemm(dtype, group, rows, split_k):
    n, k = 72, 512
    g = torch.Generator().manual_seed(group)
    values = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.05).half()
    x = torch.randn(rows, k, generator=g).to(dtype)
    packed = qg.pack_int4(values)
    assert packed.shape == (n, k // 8) and ((packed[3, 0] >> 4) & 0xF) == values[3, 1]  # low nibble first
    got = qg.int4_linear(x.to(DEVICE), packed.to(DEVICE), zeros.to(DEVICE), scales.to(DEVICE), split_k=split_k)
    torch.testing.assert_close(got.float().cpu(), ref.int4_linear(x, values, zeros, scales).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,split_k", [(1, None), (3, None), (8, None), (5, 3), (200, None)])
def test_int8_gemm(dtype, rows, split_k):
    """Weight-only int8, a float32 scale per output channel: decode rows (1 to 8, K split), a prefill's (one
    part), N and K not multiples of the tiles (K's last step masked)."""
    n, k = 136, 700  # N: 2 tiles of 64 and 8 columns; K: 5 steps of 128 and 60
    g = torch.Generator().manual_seed(rows)
    values = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    x = torch.randn(rows, k, generator=g).to(dtype)
    if rows <= qg.SPLIT_K_MAX_ROWS and split_k is None:
        assert qg.split_k_for(rows, n, 6, 16, 64) > 1  # decode really splits K
    got = qg.int8_linear(x.to(DEVICE), values.to(DEVICE), scale.to(DEVICE), split_k=split_k)
    want = ref.int8_linear(x, values, scale)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.float().cpu(), want.float(), **TOL[dtype])


# -- the layers, and which one a device gets ---------------------------------------------------------------------
def test_layers_compute_the_dequantized_weights():
    """A fused layer from three shards (q|k|v, k and v not whole 128-row blocks: their scales become per row),
    weight-only in float32, equals F.linear with the dequantized weights; W8A8 and AWQ agree with theirs."""
    torch.manual_seed(1)
    shards = [_fp8_weight(rows, 192, (128, 128), seed=rows) for rows in (128, 64, 64)]
    parts = quant.concat_parts([quant.Fp8Parts(q, s, (128, 128)) for q, s in shards])
    assert parts.block == (1, 128) and parts.scale.shape == (256, 2)
    dequantized = torch.cat([quant.dequantize_fp8(q.cpu(), s.cpu(), (128, 128)) for q, s in shards]).to(DEVICE)
    x = torch.randn(2, 7, 192).to(DEVICE)
    layer = gpu_linear.quantized_layer(parts, None, [128, 64, 64], fp8_activations=False)
    assert isinstance(layer, gpu_linear.BlockFp8Linear) and layer.shard_sizes == [128, 64, 64]
    torch.testing.assert_close(layer(x), F.linear(x, dequantized), **TOL[torch.float32])
    w8a8 = gpu_linear.quantized_layer(parts, None, None, fp8_activations=True)
    assert isinstance(w8a8, gpu_linear.BlockFp8Linear) and w8a8.fp8_activations
    want = ref.fp8_linear(x.view(14, 192), parts.q, parts.scale, (1, 128), True).view(2, 7, 256)
    torch.testing.assert_close(w8a8(x), want, **TOL[torch.float32])
    # AWQ: the loader's parts (AutoAWQ's packing undone), repacked for the kernel
    int4 = quant.Int4Parts(torch.randint(0, 16, (48, 192), dtype=torch.uint8),
                           torch.randint(0, 16, (48, 3), dtype=torch.uint8), (torch.rand(48, 3) * 0.1).half())
    awq = gpu_linear.quantized_layer(quant.Int4Parts(*(t.to(DEVICE) for t in int4)))
    assert isinstance(awq, gpu_linear.AwqLinear)
    torch.testing.assert_close(awq(x), F.linear(x, quant.dequantize_int4(*int4).to(DEVICE)), **TOL[torch.float32])


def test_which_layer_each_device_gets():
    bf16, f32 = torch.bfloat16, torch.float32
    assert qg.fp8_activations("cuda", (9, 0), bf16) and qg.fp8_activations("cuda", (8, 9), bf16)
    assert not qg.fp8_activations("cuda", (8, 0), bf16)  # A100: no FP8, weight-only
    assert not qg.fp8_activations("cuda", (9, 0), f32)  # float32 models: weight-only
    assert qg.fp8_activations("cpu", None, bf16)  # TRITON_INTERPRET runs an H100's path
    k = 256
    block = quant.Fp8Parts(*_fp8_weight(128, k, (128, 128)), (128, 128))
    channel = quant.fp8_parts(*_fp8_weight(128, k, (1, k)), None)
    tensor = quant.fp8_parts(block.q, torch.tensor([0.02]), None)
    assert channel.block == (1, k) and tensor.scale.shape == (128, 1) and (tensor.scale == 0.02).all()
    for fp8_act in (True, False):
        layer = gpu_linear.quantized_layer(block, fp8_activations=fp8_act)
        assert isinstance(layer, gpu_linear.BlockFp8Linear) and layer.fp8_activations == fp8_act
    assert isinstance(gpu_linear.quantized_layer(channel, fp8_activations=True), Fp8Linear)  # torch._scaled_mm
    weight_only = gpu_linear.quantized_layer(tensor, fp8_activations=False)
    assert isinstance(weight_only, gpu_linear.BlockFp8Linear) and not weight_only.fp8_activations
    odd = quant.Int4Parts(torch.zeros(16, 96, dtype=torch.uint8), torch.zeros(16, 2, dtype=torch.uint8),
                          torch.ones(16, 2, dtype=torch.float16))  # groups of 48: the kernel's K steps can't
    assert gpu_linear.quantized_layer(odd) is None  # (the layer keeps its dequantized weights)


# -- the engine on its Triton path ---------------------------------------------------------------------------
PROMPTS = [{"prompt_token_ids": list(range(5, 6))}, {"prompt_token_ids": list(range(40, 60))}]
ENGINE = dict(attention_backend="triton", max_model_len=64)  # short: fewer decode splits to interpret


def _block_fp8(weights: dict) -> tuple[dict, dict]:
    """(Qwen's block FP8 layout with partial blocks, the dequantized weights)."""
    out, dequantized = {}, {}
    for name, w in weights.items():
        if not name.endswith(tuple(f"{p}.weight" for p in QUANT_LINEARS)):
            out[name] = dequantized[name] = w
            continue
        rows, cols = w.shape
        q, scale = quantize_fp8_blocks(w)
        out[name], out[name + "_scale_inv"] = q, scale
        dequantized[name] = q.float() * scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return out, dequantized


def _int8_channels(weights: dict) -> dict:
    """The weights ``--quantization int8`` computes with: every linear's (the untied lm_head's too) through int8
    per output channel and back, in float32 (a fused layer's rows are its shards' rows: the same scales)."""
    out = {}
    for name, w in weights.items():
        if name.endswith(tuple(f"{p}.weight" for p in QUANT_LINEARS)) or name == "lm_head.weight":
            q, scales = quant.quantize_int8_per_channel(w.float())
            w = q.float() * scales[:, None]
        out[name] = w
    return out


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_checkpoint):
    """The tiny dense model (q|k|v shards of 128, 64, 64 rows: partial 128 x 128 blocks), its block FP8 and AWQ
    (groups of 64) versions, and each one's dequantized weights as a plain checkpoint (the reference); int8: the
    dense model itself (quantized as it loads) and its int8 weights dequantized."""
    root, dense = tmp_path_factory.mktemp("triton_quant"), tiny_checkpoint
    weights = load_file(dense / "model.safetensors")
    made = {}
    for name, (tensors, dequantized), qconfig in (
            ("fp8", _block_fp8(weights), {"quant_method": "fp8", "weight_block_size": [128, 128]}),
            ("awq", awq_layout(weights, 64), {"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm",
                                              "zero_point": True})):
        path = write_quantized_checkpoint(dense, root / name, tensors, qconfig)
        plain = root / f"{name}_dequantized"
        shutil.copytree(dense, plain)
        save_file({k: v.contiguous() for k, v in dequantized.items()}, plain / "model.safetensors")
        made[name] = (path, plain)
    plain = root / "int8_dequantized"
    shutil.copytree(dense, plain)
    save_file({k: v.contiguous() for k, v in _int8_channels(weights).items()}, plain / "model.safetensors")
    made["int8"] = (dense, plain)
    return made


@pytest.mark.parametrize("fmt,layer", [("fp8", gpu_linear.BlockFp8Linear), ("awq", gpu_linear.AwqLinear),
                                       ("int8", gpu_linear.TritonInt8Linear)])
def test_engine_float32_matches_the_dequantized_model(quantized, fmt, layer):
    """float32: FP8 weight-only, AWQ and --quantization int8 compute with the stored (int8: the quantized) weights
    exactly as the dequantized model does (up to summation order): HF's greedy tokens on those weights."""
    from transformers import Qwen3ForCausalLM

    path, plain = quantized[fmt]
    llm = LLM(str(path), dtype="float32", quantization="int8" if fmt == "int8" else None, **ENGINE)
    runner = model_runner(llm)
    attn, mlp = runner.parts.model.model.layers[0].self_attn, runner.parts.model.model.layers[1].mlp
    assert isinstance(attn.qkv_proj, layer) and isinstance(mlp.down_proj, layer)
    head = gpu_linear.TritonInt8Linear if fmt == "int8" else torch.nn.Linear  # (int8: the head too, as on the CPU)
    assert attn.qkv_proj.shard_sizes == [128, 64, 64] and type(runner.parts.model.lm_head) is head
    weights = runner.parts.plan.weight_format
    assert "Triton" in weights and ("weight-only" in weights or fmt == "awq")
    reference = Qwen3ForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    greedy_matches(llm, reference, PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))


def test_int8_gives_a_tied_head_its_own_int8_copy(qwen3_checkpoint):
    """A tied model under --quantization int8 on the Triton path: the embedding keeps its table for the lookup,
    the head computes with the table's int8 copy on the int8 GEMM (the CPU's int8 head does the same)."""
    torch.manual_seed(2)
    llm = LLM(str(qwen3_checkpoint("mha_tied")), dtype="float32", quantization="int8", **ENGINE)
    model = llm.apply_model(lambda m: m)
    head, table = model.lm_head, model.model.embed_tokens.weight
    assert isinstance(head, gpu_linear.TritonInt8Linear) and table.dtype == torch.float32
    q, scales = quant.quantize_int8_per_channel(table)
    assert torch.equal(head.qweight, q) and torch.equal(head.scales, scales)
    hidden = torch.randn(3, table.shape[1]).to(table.device)
    torch.testing.assert_close(head(hidden), hidden @ (q.float() * scales[:, None]).T, **TOL[torch.float32])


def test_engine_bf16_fp8_is_w8a8_within_its_rounding_budget(quantized):
    """bf16 on an H100's path: FP8 weights times FP8 activations. Against the float32 dequantized model, the
    next-token distributions' mean KL divergence after every position of a prompt is bounded as for the
    weights (test_quantized_checkpoints): rounding an activation to e4m3 changes it by a relative error of RMS
    2^-4 / sqrt(3) ~ 3.6% at most, so the reference with every quantized layer's input times (1 + N(0, 3.6%^2))
    is the budget. W8A8 must cost less, and more than a fifth of it: bf16 alone costs about a twentieth, so
    activations left unquantized fail."""
    from transformers import Qwen3ForCausalLM

    path, plain = quantized["fp8"]
    llm = LLM(str(path), dtype="bfloat16", **ENGINE)
    runner = model_runner(llm)
    layer = runner.parts.model.model.layers[0]
    down = layer.mlp.down_proj
    assert isinstance(down, gpu_linear.BlockFp8Linear) and down.fp8_activations
    assert "W8A8" in runner.parts.plan.weight_format
    # q|k|v over one K block (hidden 64), its scales per row since k and v are partial blocks: per channel, so
    # torch._scaled_mm
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    prompt = list(range(40, 72))
    w8a8 = prompt_logprobs(llm, prompt)
    reference = Qwen3ForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
        hooks = [m.register_forward_pre_hook(
            lambda m, args: (args[0] * (1 + torch.randn(args[0].shape, generator=generator) * 2 ** -4 / 3 ** 0.5),))
            for name, m in reference.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
        budget = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
        for hook in hooks:
            hook.remove()

    def kl(q):
        return (ref.exp() * (ref - q)).sum(-1).mean().item()

    assert 0.2 * kl(budget) < kl(w8a8) < kl(budget), (kl(w8a8), kl(budget))

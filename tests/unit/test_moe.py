"""Qwen3 MoE: greedy parity with HF transformers' Qwen3MoeForCausalLM in float32 on tiny random shapes
(expert counts, top-k, norm_topk_prob, dense and sparse layers mixed, chunked prefill), loading from the
hub layout, and the CPU kernels (bf16, int8) running the experts."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeForCausalLM as HFMoe

from support.checkpoints import MOE_SHAPES, build_moe_checkpoint
from mili import LLM, ModelLoadError, SamplingParams
from mili.kernels import cpu
from mili.model.cpu_linear import KernelLinear
from mili.runtime.plan import StepKind

PROMPT_LENS = [1, 7, 40, 150]  # 150 is prefilled in chunks (budget 64 tokens)
MAX_TOKENS = 16
NEAR_TIE = 1e-3


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_greedy_matches_hf(moe_checkpoint, shape):
    path = moe_checkpoint(shape)
    prompts = _prompts()
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=64, page_size=16)
    assert llm.engine.model_config.is_moe
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    hf = HFMoe.from_pretrained(path, dtype=torch.float32).eval()
    exact = 0
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0)
        ref_tokens, scores = ref.sequences[0, len(ids):].tolist(), torch.stack(ref.scores)[:, 0]
        got = out.outputs[0].token_ids
        parted = next((j for j, (a, b) in enumerate(zip(got, ref_tokens)) if a != b), None)
        if parted is None:
            exact += 1
        else:
            top2 = scores[parted].topk(2).values
            assert top2[0] - top2[1] < NEAR_TIE, f"diverged at step {parted} without an HF near-tie"
        ref_lp = torch.log_softmax(scores, -1)
        for j in range(parted if parted is not None else MAX_TOKENS):
            assert out.outputs[0].logprobs[j][got[j]].logprob == pytest.approx(ref_lp[j, got[j]].item(),
                                                                               rel=1e-4, abs=1e-5)
    assert exact >= len(prompts) - 1
    llm.engine.check_integrity()


def test_layer_kinds_follow_the_config(moe_checkpoint):
    llm = LLM(str(moe_checkpoint("e8_k3_norm_step2")), dtype="float32")
    cfg = llm.engine.model_config
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 3 and cfg.norm_topk_prob  # num_experts spelling
    assert cfg.sparse_layers == (False, True, False, True)  # decoder_sparse_step 2
    kinds = [type(layer.mlp).__name__ for layer in llm.apply_model(lambda m: m.model.layers)]
    assert kinds == ["Qwen3MLP", "Qwen3MoeBlock", "Qwen3MLP", "Qwen3MoeBlock"]
    llm = LLM(str(moe_checkpoint("e4_k2_sparse_dense")), dtype="float32")
    assert llm.engine.model_config.sparse_layers == (True, False, True)  # mlp_only_layers [1]


def test_a_missing_expert_is_refused(moe_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    src = moe_checkpoint("e4_k2_sparse_dense")
    dst = tmp_path / "broken"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ModelLoadError, match="experts.w13"):
        LLM(str(dst), dtype="float32")


@pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.load()[1]}")
def test_cpu_kernels_run_the_experts(tmp_path):
    """bf16 with MILI's kernels (each expert's slices packed, the router left alone) against the torch path in
    float32 on the same requests; int8 runs its kernel on the experts too. (Not against torch's own bf16 path: on a
    Sapphire Rapids its bf16 ops part from float32 on 2 of these 4 prompts, where the kernels, accumulating in
    float32, part on none.)"""
    path = build_moe_checkpoint(tmp_path / "moe_kernels", seed=5, hidden_size=128, moe_intermediate_size=64,
                                intermediate_size=128, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0])
    prompts = [{"prompt_token_ids": p} for p in _prompts(2)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    kernel = LLM(str(path), dtype="bfloat16")
    block = kernel.apply_model(lambda m: m.model.layers[1].mlp)
    assert isinstance(block.experts.linears[0], KernelLinear) and block.experts.w13 is None
    assert type(block.gate).__name__ == "RouterLinear"
    assert kernel.engine.plan.step is StepKind.EAGER  # the fused decode step is dense-only
    torch_path = LLM(str(path), dtype="float32", cpu_kernels=False, cpu_weight_prepack=False)
    a = kernel.generate(prompts, params, use_tqdm=False)
    b = torch_path.generate(prompts, params, use_tqdm=False)
    same = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(a, b))
    assert same >= len(prompts) - 1
    first = [(x.outputs[0].logprobs[0][x.outputs[0].token_ids[0]].logprob,
              y.outputs[0].logprobs[0][y.outputs[0].token_ids[0]].logprob) for x, y in zip(a, b)]
    assert all(abs(p - q) < 0.1 for p, q in first), first
    int8 = LLM(str(path), dtype="bfloat16", quantization="int8")
    assert type(int8.apply_model(lambda m: m.model.layers[1].mlp.experts.linears[0])).__name__ == "Int8Linear"
    outs = int8.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


@pytest.mark.parametrize("tokens, experts, top_k, dtype", [(13, 5, 2, torch.float32), (1, 4, 1, torch.float32),
                                                           (40, 8, 3, torch.float32), (9, 6, 2, torch.bfloat16)])
def test_fused_experts_kernel_matches_the_expert_loop(tokens, experts, top_k, dtype):
    """The Triton fused-experts kernel (under TRITON_INTERPRET on the CPU) against FusedExperts' loop
    over experts; routing leaves an expert without tokens, and rows pad each expert's block."""
    from mili.kernels.triton.fused_moe import align, fused_experts
    from mili.model.fused import FusedExperts

    torch.manual_seed(tokens)
    hidden, inter = 64, 48
    block = FusedExperts(experts, hidden, inter, dtype)
    with torch.no_grad():
        block.w13.copy_(torch.randn(experts, 2 * inter, hidden) * 0.2)
        block.w2.copy_(torch.randn(experts, hidden, inter) * 0.2)
    x = torch.randn(tokens, hidden).to(dtype)
    probs = torch.randn(tokens, experts).softmax(-1)
    probs[:, experts - 1] = 0  # the last expert gets no token
    weights, ids = probs.topk(top_k, dim=-1)
    with torch.no_grad():
        ref = block(x, weights.to(dtype), ids)
        got = fused_experts(x, block.w13, block.w2, weights.to(dtype), ids)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol), (got - ref).abs().max()
    pairs, block_expert = align(ids, experts)
    real = pairs[pairs < tokens * top_k]
    assert sorted(real.tolist()) == list(range(tokens * top_k))  # every pair once
    for b, e in enumerate(block_expert.tolist()):  # each block holds one expert's pairs
        chunk = pairs[b * 16:(b + 1) * 16]
        chunk = chunk[chunk < tokens * top_k]
        assert (ids.flatten()[chunk] == e).all() if e >= 0 else chunk.numel() == 0


def test_moe_engine_on_the_triton_path_matches_the_torch_path(moe_checkpoint):
    """The whole engine with the Triton ops (fused experts, attention; interpreted on the CPU)."""
    path = str(moe_checkpoint("e4_k2_sparse_dense"))
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (1, 12, 30)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    triton_llm = LLM(path, dtype="float32", attention_backend="triton", max_num_batched_tokens=24)
    assert getattr(triton_llm.apply_model(lambda m: m.model.layers[0].mlp.experts.ops), "fused_experts", None)
    torch_llm = LLM(path, dtype="float32", max_num_batched_tokens=24)
    a = triton_llm.generate(prompts, params, use_tqdm=False)
    b = torch_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_moe_preemption_gives_identical_outputs(moe_checkpoint):
    """A KV pool far too small for the batch: sequences are preempted and recomputed, outputs unchanged."""
    path = str(moe_checkpoint("e4_k2_sparse_dense"))
    g = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(0, 512, (n,), generator=g).tolist()} for n in (30, 45, 60, 20, 50)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ample = LLM(path, dtype="float32").generate(prompts, params, use_tqdm=False)
    tight = LLM(path, dtype="float32", num_kv_pages=8, max_num_batched_tokens=64)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ample]
    tight.engine.check_integrity()

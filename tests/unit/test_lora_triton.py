"""LoRA adapters on the Triton kernel (``mili/kernels/triton/lora.py``, under TRITON_INTERPRET=1 here): each row gets
its own slot's product B_s (A_s x) and rows of the base model (slot -1) keep y as it was, against a per-row loop in
float64; decode-sized and prefill-sized steps, fused layers of three shards, ranks below the slots' max_rank, bf16,
fp16 and float32; LoRALinear on the kernel equals it on torch; an adapter on a whole fused layer is stored as the
kernels read it; and the whole engine on the Triton path with adapters equals PEFT (tokens and logprobs): a dense
model with two adapters and the base model in one batch, and the hybrids (Qwen3.5, Qwen3-Next)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mili import LLM, LoRARequest, SamplingParams  # noqa: E402
from mili.kernels.triton.lora import lora_add, segments  # noqa: E402
from mili.lora import LoRALinear, LoRAStep  # noqa: E402
from mili.runtime.plan import AttentionBackend  # noqa: E402
from support.devices import TRITON_DEVICE as DEVICE  # noqa: E402
from support.engine_state import runner_parts
from support.lora import build_adapter, check_outputs  # noqa: E402
from support.parity import hf_greedy  # noqa: E402



def _weights(slots: int, shard_sizes: list[int], in_features: int, max_rank: int, ranks: list[int],
             dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """lora_a [columns, in], lora_b [out, columns] laid out as LoRALinear holds them (columns padded to 32, B
    block-diagonal, slot s of rank ranks[s]: its A rows and B columns past the rank zero); and W."""
    g = torch.Generator().manual_seed(seed)
    width = len(shard_sizes) * max_rank
    columns = -(-slots * width // 32) * 32
    a = torch.zeros(columns, in_features)
    b = torch.zeros(sum(shard_sizes), columns)
    for s in range(slots):
        offset = 0
        for j, size in enumerate(shard_sizes):
            col, r = s * width + j * max_rank, ranks[s]
            a[col:col + r] = torch.randn(r, in_features, generator=g) / in_features ** 0.5
            b[offset:offset + size, col:col + r] = torch.randn(size, r, generator=g) / r ** 0.5
            offset += size
    return a.to(dtype), b.to(dtype), width


def _reference(y, x, a, b, slots, width) -> torch.Tensor:
    """Each row alone, in float64: y + B_s (A_s x) for slot s >= 0."""
    out = y.double().clone()
    for i, s in enumerate(slots):
        if s >= 0:
            cols = slice(s * width, (s + 1) * width)
            out[i] += b[:, cols].double() @ (a[cols].double() @ x[i].double())
    return out


CASES = {  # rows, slots of the layer, shard sizes, max_rank, each slot's rank, split K (None: the runner's)
    "decode-1": (1, 2, [48], 8, [8, 8], None),
    "decode-mixed": (5, 3, [48], 8, [8, 4, 8], None),
    "decode-8-fused-qkv": (8, 3, [64, 32, 32], 8, [8, 8, 8], None),
    "fused-qkv-uneven-rank-below-max": (7, 2, [40, 24, 24], 16, [4, 16], None),
    "split-k": (6, 2, [48, 48], 8, [8, 2], 3),
    "prefill-unsorted": (100, 4, [80, 16, 16], 8, [8, 8, 3, 8], None),
    "prefill-split-k": (100, 2, [96], 16, [16, 8], 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_a_per_row_loop(case, dtype):
    t, num_slots, shard_sizes, max_rank, ranks, split = CASES[case]
    in_features = 160  # (not a multiple of the shrink's 64-wide K steps: the last one masked)
    a, b, width = _weights(num_slots, shard_sizes, in_features, max_rank, ranks, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, in_features, generator=g).to(dtype)
    y = torch.randn(t, sum(shard_sizes), generator=g).to(dtype)
    slots = torch.randint(-1, num_slots, (t,), generator=g).tolist()  # unsorted, base rows (-1) among them
    slots[0] = num_slots - 1  # (at least one adapter row)
    expected = _reference(y, x, a, b, slots, width)
    got = lora_add(y.clone().to(DEVICE), x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), slots, width, max_rank,
                   shard_sizes, split_k=split).cpu()
    base = torch.tensor(slots) < 0
    assert torch.equal(got[base], y[base])  # the base model's rows untouched
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got.double(), expected, **tol)


def test_segments_group_rows_by_slot_and_no_adapter_is_a_no_op():
    torch.manual_seed(0)
    seg = segments([2, -1, 0, 2, -1, 0, 0], "cpu")
    assert seg.rows.tolist() == [2, 5, 6, 0, 3] and seg.slot.tolist() == [0, 2]
    assert seg.start.tolist() == [0, 3] and seg.length.tolist() == [3, 2] and seg.max_rows == 3
    assert segments([-1, -1], "cpu") is None
    a, b, width = _weights(1, [32], 64, 8, [8], torch.float32)
    y = torch.randn(2, 32)
    assert torch.equal(lora_add(y.clone(), torch.randn(2, 64), a, b, [-1, -1], width, 8), y)


@pytest.mark.parametrize("t", [3, 70])
def test_lora_linear_on_the_kernel_equals_it_on_torch(t):
    """LoRALinear(triton=True) (the rows grouped once a step by LoRAStep) against its torch path: a fused layer,
    three slots of which one adapter does not target the layer (zeros)."""
    torch.manual_seed(0)
    shard_sizes, max_rank, in_features = [64, 32, 32], 8, 64
    layers = {}
    for triton in (False, True):
        step = LoRAStep(3, triton=triton)
        base = torch.nn.Linear(in_features, sum(shard_sizes), bias=False)
        torch.manual_seed(1)
        base.weight.data.normal_(0, 0.1)
        layer = LoRALinear(base.to(DEVICE), in_features, shard_sizes, 3, max_rank, step, torch.float32,
                           torch.device(DEVICE), triton=triton)
        a, b, _ = _weights(2, shard_sizes, in_features, max_rank, [8, 5], torch.float32)
        layer.load_slot(0, (a[:24], b[:, :24]))
        layer.load_slot(1, None)
        layer.load_slot(2, (a[24:48], b[:, 24:48]))
        layers[triton] = layer
    x = torch.randn(t, in_features).to(DEVICE)
    slots = [(-1, 0, 1, 2)[i % 4] for i in range(t)]
    for triton, layer in layers.items():
        layer.step.set(slots, torch.device(DEVICE))
    assert layers[True].step.segments is not None and layers[False].step.segments is None
    with torch.no_grad():
        torch.testing.assert_close(layers[True](x), layers[False](x), atol=1e-5, rtol=1e-5)


def test_a_whole_layer_adapter_is_stored_block_diagonal(tmp_path):
    """An adapter on a whole fused layer (Qwen3-Next's in_proj_qkvz / ba as one tensor each): its A in every shard's
    rows and each shard's rows of its B in that shard's columns, so the kernels, which read only a shard's own
    columns (the Triton expand; kernels.c's B per shard), give every row of the layer B (A x)."""
    from mili.kernels import cpu
    import json

    from safetensors.torch import save_file

    from mili.lora import Adapter, LoRARequest

    shard_sizes, in_features, max_rank, r, alpha = [64, 32], 64, 8, 4, 8
    g = torch.Generator().manual_seed(0)
    la, lb = torch.randn(r, in_features, generator=g), torch.randn(sum(shard_sizes), r, generator=g) / 4
    key, name = "base_model.model.model.layers.0.linear_attn.in_proj_qkvz", "model.layers.0.linear_attn.in_proj_qkvz"
    save_file({f"{key}.lora_A.weight": la, f"{key}.lora_B.weight": lb}, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha}))
    adapter = Adapter.load(LoRARequest("whole", 1, str(tmp_path)), {name: (in_features, shard_sizes)}, max_rank)
    a, b = adapter.weights[name]
    assert not b[:64, 8:].any() and not b[64:, :8].any()  # block-diagonal
    x = torch.randn(5, in_features, generator=g)
    expected = x.double() @ la.double().T @ lb.double().T * (alpha / r)
    got = lora_add(torch.zeros(5, 96, device=DEVICE), x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), [0] * 5,
                   2 * max_rank, max_rank, shard_sizes).cpu()
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    if cpu.available():  # MILI's CPU kernels (bf16) read the same storage
        for kernels in (False, True):
            step = LoRAStep(1)
            layer = LoRALinear(torch.nn.Linear(in_features, 96, bias=False, dtype=torch.bfloat16), in_features,
                               shard_sizes, 1, max_rank, step, torch.bfloat16, torch.device("cpu"), kernels=kernels)
            layer.base.weight.data.zero_()
            layer.load_slot(0, (a, b))
            step.set([0] * 5, torch.device("cpu"))
            assert (layer.desc is not None) == kernels
            with torch.no_grad():
                torch.testing.assert_close(layer(x.bfloat16()).double(), expected, atol=0.1, rtol=0.03)


def test_the_engine_on_the_triton_path_with_adapters_matches_peft(tmp_path, qwen3_checkpoint, monkeypatch):
    """Float32, the Triton back-end (attention and the adapters' kernel), two adapters and the base model in one
    batch: greedy tokens equal PEFT's and logprobs within 1e-4 (support.lora.check_outputs)."""
    from transformers import AutoModelForCausalLM

    from mili.kernels.triton import lora as triton_lora

    calls = []
    kernel = triton_lora.lora_add
    monkeypatch.setattr(triton_lora, "lora_add", lambda *args, **kw: calls.append(1) or kernel(*args, **kw))

    base = qwen3_checkpoint("gqa_untied")
    refs = {"a": build_adapter(base, tmp_path / "a", 1),
            "b": build_adapter(base, tmp_path / "b", 2, rank=8, targets=("q_proj", "v_proj", "down_proj"), rslora=True)}
    requests = {name: LoRARequest(name, i, str(tmp_path / name)) for i, name in enumerate(refs, 1)}
    prompts = [[5, 17, 99, 3, 250, 40, 11], [400, 2, 3], list(range(30, 50))]
    tokens = 6
    llm = LLM(str(base), dtype="float32", attention_backend="triton", enable_lora=True, max_loras=2,
              max_lora_rank=8)
    assert llm.engine.plan.attention is AttentionBackend.TRITON
    loras = runner_parts(llm).loras
    assert loras.step.triton and all(layer.triton for layer in loras.layers.values())
    names = ["a", None, "b"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False,
                        lora_request=[requests[n] if n else None for n in names])
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    expected = [hf_greedy(refs[n] if n else plain, [p], tokens)[0] for n, p in zip(names, prompts)]
    check_outputs(outs, expected)
    assert calls  # (the adapters' products ran on the kernel)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_the_hybrids_on_the_triton_path_with_an_adapter_match_peft(tmp_path, hybrid_checkpoint, kind):
    """Qwen3.5's and Qwen3-Next's adapted layers on the kernel (gated attention, the Gated DeltaNet's fused
    projections, Qwen3-Next's as whole layers: test_a_whole_layer_adapter_is_stored_block_diagonal) beside a base
    row: PEFT's tokens and logprobs."""
    from transformers import AutoModelForCausalLM

    from test_lora_hybrid import PROMPTS, TARGETS

    base = hybrid_checkpoint(kind)
    reference = build_adapter(base, tmp_path / "a", 1, targets=TARGETS[kind], std=0.1)
    llm = LLM(str(base), dtype="float32", enable_lora=True, attention_backend="triton")
    assert runner_parts(llm).loras.step.triton
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False,
                        lora_request=[LoRARequest("a", 1, str(tmp_path / "a")), None])
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    # on a GPU the Gated DeltaNet runs flash-linear-attention's chunk kernels, whose float32 dots are TF32 (Triton's
    # default: they name no precision): logprobs 7e-4 and 1.1e-3 from HF's on an H200, tokens equal; 1e-4 here
    check_outputs(outs, [hf_greedy(reference, PROMPTS[:1], 5)[0], hf_greedy(plain, PROMPTS[1:2], 5)[0]],
                  atol=3e-3 if DEVICE == "cuda" else 1e-4)

"""Random PEFT LoRA adapters for the tiny checkpoints, made by ``peft`` itself (``get_peft_model``,
``save_pretrained``), with non-zero B (PEFT starts B at zero: such an adapter would change nothing)."""

from __future__ import annotations

from pathlib import Path

import torch

from support.engine_state import runner_parts

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(base: Path, path: Path, seed: int, rank: int = 4, targets=ALL_TARGETS, rslora: bool = False,
                  alpha: float | None = None, std: float = 0.3, model_class=None, **config):
    """Save a random adapter of ``base`` at ``path``; returns PEFT's model with it (float32, eval), the reference.
    ``model_class``: transformers' class to load the base with (AutoModelForCausalLM by default)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mili.tools.selftest.parity import hf_torch_paths

    hf_torch_paths()  # (the reference runs on the CPU: not flash-linear-attention's GPU kernels, where installed)
    torch.manual_seed(seed)
    model = (model_class or AutoModelForCausalLM).from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets if isinstance(targets, str) else list(targets),
                                                  init_lora_weights=False, use_rslora=rslora, **config))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    peft_model.save_pretrained(path)
    return peft_model.eval()


def check_outputs(outs, expected, atol: float = 1e-4) -> None:
    """Greedy tokens equal to the reference's, and each one's logprob within ``atol`` of it (``expected``:
    support.parity.hf_greedy's (tokens, raw logits [steps, V]) per prompt; the requests asked for logprobs=0)."""
    for out, (tokens, scores) in zip(outs, expected, strict=True):
        o = out.outputs[0]
        assert o.token_ids == tokens
        got = torch.tensor([o.logprobs[i][t].logprob for i, t in enumerate(tokens)])
        ref = scores.log_softmax(-1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(got, ref, atol=atol, rtol=0)


def assert_kernel_products_match(llm, requests) -> None:
    """On MILI's CPU kernels (bf16): with two adapters loaded and rows [a, base, b, a, b], every LoRALinear's output
    equals base(x) + the row's own slot's (x A^T) B^T computed by torch in float32 (within bf16's rounding of u and
    of the sum: a wrong slot or shard is off by several units), and the base row is base(x) exactly."""
    from mili.lora import LoRALinear

    loras = runner_parts(llm).loras
    for request in requests:
        loras.acquire(request)
    loras.prepare([requests[0].lora_int_id, None, requests[1].lora_int_id, requests[0].lora_int_id,
                   requests[1].lora_int_id], torch.device("cpu"))
    layers = llm.apply_model(lambda m: [x for x in m.modules() if isinstance(x, LoRALinear)])
    assert layers and all(layer.desc is not None for layer in layers)
    torch.manual_seed(0)
    for layer in layers:
        x = torch.randn(5, layer.in_features, dtype=torch.bfloat16)
        with torch.inference_mode():
            got, plain = layer(x).float(), layer.base(x).float()
        mask = layer.step.mask(layer.width, torch.float32, layer.columns)
        want = plain + ((x.float() @ layer.lora_a.float().T) * mask) @ layer.lora_b.float().T
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.02)
        assert torch.equal(got[1], plain[1])
    for request in requests:
        loras.release(request)


def cached_runs(llm, prompt: dict, params, lora, other):
    """The prefix cache keys prompts by adapter: ``prompt`` run under ``lora`` twice, then under ``other`` and under
    the base model; the second run reuses the first's cache, the other two nothing. Returns the second and the
    ``other`` outputs (to check against their references)."""
    first, again, elsewhere, plain = (llm.generate([prompt], params, use_tqdm=False, lora_request=r)[0]
                                      for r in (lora, lora, other, None))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert elsewhere.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    return again, elsewhere

"""``--kv-cache-dtype fp8``: e4m3 KV pages on the Triton backend (kernels under TRITON_INTERPRET=1 on the CPU):
twice the pages in the same memory, what /health reports, the refusal elsewhere, and the cost in the
next-token distribution on real text, bounded by the rounding's own budget."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from support.checkpoints import build_checkpoint  # noqa: E402
from support.engine_state import model_runner, runner_parts
from support.parity import prompt_logprobs  # noqa: E402
from mili import LLM, InvalidRequest, SamplingParams  # noqa: E402
from mili.config import EngineConfig  # noqa: E402

TRITON = dict(attention_backend="triton", max_model_len=64)


def test_fp8_pages_twice_as_many_and_reported(tiny_checkpoint):
    torch.manual_seed(0)
    memory = 48 * 1024  # bf16: 2 layers x K,V x 16 tokens x 2 heads x 32 x 2 bytes = 8 KiB a page: 6 pages
    bf16 = LLM(str(tiny_checkpoint), dtype="bfloat16", kv_cache_memory=memory, **TRITON)
    fp8 = LLM(str(tiny_checkpoint), dtype="bfloat16", kv_cache_memory=memory, kv_cache_dtype="fp8", **TRITON)
    plain, runner = model_runner(bf16), model_runner(fp8)
    assert bf16.engine.stats().num_pages == 6 and fp8.engine.stats().num_pages == 12
    assert runner.parts.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert plain.parts.kv_caches[0][0].dtype == torch.bfloat16
    # what /health and /v1/models report (the core's Ready message)
    assert fp8.engine.info.kv_cache_dtype == "fp8_e4m3"
    assert bf16.engine.info.kv_cache_dtype == "bfloat16"
    # it serves: prefill and decode read the pages it wrote, every page back in the pool after
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 20)]
    outs = fp8.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    fp8.engine.check_integrity()
    # copy-on-write copies FP8 pages byte for byte
    k_cache = runner.parts.kv_caches[1][0]
    k_cache[3] = torch.randn(k_cache.shape[1:]).to(torch.float8_e4m3fn)
    runner.copy_pages([(3, 7)])
    assert torch.equal(k_cache[7].view(torch.uint8), k_cache[3].view(torch.uint8))


def test_fp8_pages_need_the_triton_backend(tiny_checkpoint):
    with pytest.raises(InvalidRequest, match="--kv-cache-dtype fp8 needs the Triton attention backend") as e:
        LLM(str(tiny_checkpoint), dtype="bfloat16", kv_cache_dtype="fp8")  # the CPU's C-kernel / torch attention
    assert e.value.param == "kv_cache_dtype"
    with pytest.raises(InvalidRequest, match="kv_cache_dtype must be auto, fp8 or int8"):
        EngineConfig(model=str(tiny_checkpoint), kv_cache_dtype="fp8_e5m2")


def test_flag_and_config_file_key(tmp_path):
    from mili.cli import build_parser, engine_kwargs
    from mili.config_file import ConfigFileError, read_config_file

    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["serve", "--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    assert engine_kwargs(parser.parse_args(["serve"]))["kv_cache_dtype"] == "auto"
    (tmp_path / "a.yaml").write_text("kv_cache:\n  dtype: fp8\n  num_pages: 64\n")
    assert read_config_file(str(tmp_path / "a.yaml"), parser.serve_parser)[0] == {"kv_cache_dtype": "fp8",
                                                                                  "num_kv_pages": 64}
    (tmp_path / "b.yaml").write_text("kv_cache:\n  dtype: int4\n")
    with pytest.raises(ConfigFileError, match="kv_cache.dtype must be one of auto, fp8"):
        read_config_file(str(tmp_path / "b.yaml"), parser.serve_parser)


def test_fp8_kv_cache_kl_within_its_rounding_budget(tmp_path, qwen3_tokenizer):
    """Real text through the real tokenizer: the mean KL divergence of the next-token distribution after every
    position from the model with bf16 pages (float32 model, so only the pages' rounding differs).

    The bound, as for FP8 weights: e4m3 keeps 3 mantissa bits, so storing a K or V entry changes it by a
    relative error uniform in +-2^-4 of its binade's top, an RMS of 2^-4 / sqrt(3) ~ 3.6% at most. The same
    model with every stored K and V entry times (1 + N(0, 3.6%^2)) is the budget: the FP8 pages must cost less
    (a scale misapplied, K read as V, or a stale page costs far more) and more than a tenth of it (the pages
    really are e4m3)."""
    # the real vocabulary; few heads and layers: the interpreter runs one program per token and head
    dense = build_checkpoint(tmp_path / "real", "gqa4_realvocab", with_tokenizer=False, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1)
    text = ("The quick brown fox jumps over the lazy dog. Tokenizers split text into pieces; a language model "
            "predicts the next piece from the ones before it, one distribution at a time.")
    prompt = qwen3_tokenizer(text)["input_ids"]
    common = dict(dtype="float32", enable_prefix_caching=False, **TRITON)
    ref = prompt_logprobs(LLM(str(dense), **common), prompt)
    fp8 = prompt_logprobs(LLM(str(dense), kv_cache_dtype="fp8", **common), prompt)
    noisy = LLM(str(dense), **common)
    backend = runner_parts(noisy).attention
    backend.qk_norm_rope_store = None  # (no fused norm + store: the layers store K/V through forward, noised here)
    store_and_attend = backend.forward
    generator = torch.Generator().manual_seed(0)

    def perturbed(q, k, v, *args):
        k, v = (x * (1 + torch.randn(x.shape, generator=generator) * (2 ** -4 / 3 ** 0.5)) for x in (k, v))
        return store_and_attend(q, k, v, *args)

    backend.forward = perturbed
    budget = prompt_logprobs(noisy, prompt)

    def kl(q):
        return (ref.exp() * (ref - q)).sum(-1).mean().item()

    assert 0.1 * kl(budget) < kl(fp8) < kl(budget), (kl(fp8), kl(budget))

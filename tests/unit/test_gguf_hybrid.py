"""GGUF files of the hybrids (llama.cpp's archs qwen35, qwen35moe and qwen3next), written as llama.cpp's
convert_hf_to_gguf.py writes them (support/gguf_files.py: its metadata and its changes to the tensors: -exp(A_log),
1 + w norms, the squeezed conv, Qwen3-Next's split in_proj_qkvz, Qwen3.5's value heads tiled; the MTP head as
nextn). MILI undoes those changes as it loads: the float32 file runs as HF's model of the original checkpoint, the
block types as HF's model of their dequantized values."""

from __future__ import annotations

import shutil

import pytest
import torch

from mili import LLM, SamplingParams
from support.engine_state import assert_drained
from support.gguf_files import HYBRID_Q4_K_M, build_hybrid_gguf_model, dequantized_state_dict, write_gguf
from support.parity import assert_greedy_matches_hf, hf_greedy

KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def hybrid_gguf(tmp_path_factory):
    """``hybrid_gguf(kind, types)``: (the GGUF file, the HF checkpoint it was made from), built once."""
    root = tmp_path_factory.mktemp("gguf-hybrid")
    built = {}

    def get(kind, types="F32"):
        key = (kind, str(types))
        if key not in built:
            built[key] = build_hybrid_gguf_model(root / f"{kind}-{len(built)}", kind, types)
        return built[key]

    return get


def _prompts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4000, (int(k),), generator=g).tolist() for k in torch.randint(3, 40, (n,), generator=g)]


def _hf(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    # (float64: its experts one by one, as torch's grouped_mm has no float64 on the CPU)
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra).eval()


@pytest.mark.parametrize("kind", KINDS)
def test_float32_file_runs_as_hf_on_the_original_checkpoint(hybrid_gguf, kind):
    """The converter's changes undone: the float32 file's greedy tokens and logprobs are HF's on the checkpoint the
    file was made from (its -exp(A_log) and 1 + w read back up to float rounding)."""
    path, checkpoint = hybrid_gguf(kind)
    prompts = _prompts()
    llm = LLM(str(path), dtype="float32")
    assert llm.engine.plan.weight_format.startswith("gguf F32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(outs, hf_greedy(_hf(checkpoint), prompts, MAX_TOKENS), MAX_TOKENS)
    assert_drained(llm)


@pytest.mark.parametrize("kind", KINDS)
def test_block_types_run_as_hf_on_their_dequantized_values(hybrid_gguf, kind, tmp_path):
    """Q4_K, Q6_K and Q8_0 in the linear attention (rows of Qwen3.5's value heads moved by llama.cpp), the gated
    attention, the experts and the MTP head: float32 greedy equals HF's model of gguf-py's dequantized values, each
    logprob within 1e-4 of HF's float32 plus how far that lies from HF's float64 (on a Sapphire Rapids HF's float32
    parts from its float64 by up to 7e-5 in a logprob on the MoE kind, MILI's float32 by 1.5e-5)."""
    from safetensors.torch import save_file

    path, checkpoint = hybrid_gguf(kind, HYBRID_Q4_K_M)
    prompts = _prompts(seed=1)
    llm = LLM(str(path), dtype="float32")
    assert "Q4_K" in llm.engine.plan.weight_format and "Q6_K" in llm.engine.plan.weight_format
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    folder = tmp_path / "dequantized"
    folder.mkdir()
    shutil.copy(checkpoint / "config.json", folder / "config.json")
    save_file({k: v.contiguous() for k, v in dequantized_state_dict([path], checkpoint).items()},
              folder / "model.safetensors")
    assert_greedy_matches_hf(outs, hf_greedy(_hf(folder), prompts, MAX_TOKENS), MAX_TOKENS,
                             float64=hf_greedy(_hf(folder, torch.float64), prompts, MAX_TOKENS))


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_bf16_runs_the_hybrids_blocks_on_the_kernels(hybrid_gguf, kind):
    """In bf16 the hybrids' block-typed layers run on the int4 / int8g kernels as stored; each layer's weights
    (the fused in_proj_qkvz with Qwen3.5's value rows put back, Qwen3-Next's b and a out of their interleave) are
    the float32 model's, exactly."""
    from mili.model.cpu_linear import Int4Linear, Int8GroupLinear

    path, _ = hybrid_gguf(kind, HYBRID_Q4_K_M)
    llm = LLM(str(path), dtype="bfloat16")
    if not llm.engine.plan.int8_kernels:  # (AVX-512 without VNNI: the blocks dequantized)
        assert "dequantized" in llm.engine.plan.weight_format, llm.engine.plan.weight_format
        return
    assert "on the int4 and int8 kernels" in llm.engine.plan.weight_format

    def layers(m):
        attn = m.model.layers[0].linear_attn
        return {"in_proj_qkvz": attn.in_proj_qkvz, "in_proj_ba": attn.in_proj_ba,
                "o_proj": m.model.layers[3].self_attn.o_proj}

    kernel_layers = llm.apply_model(layers)
    float32 = LLM(str(path), dtype="float32").apply_model(lambda m: {k: v.weight.detach().clone()
                                                                     for k, v in layers(m).items()})
    for name, layer in kernel_layers.items():
        assert isinstance(layer, (Int4Linear, Int8GroupLinear)), (name, type(layer))
        assert torch.equal(layer.dequantize()[:float32[name].shape[0]], float32[name]), name
    out = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in out)
    assert_drained(llm)


def test_the_mtp_head_loads_from_nextn(hybrid_gguf):
    """The file's nextn block is the MTP head: its weights are the checkpoint's mtp.*, and MTP speculative
    decoding gives the greedy tokens plain decoding gives."""
    from safetensors.torch import load_file

    path, checkpoint = hybrid_gguf("qwen3_5")
    spec = LLM(str(path), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    want = load_file(checkpoint / "model.safetensors")
    got = spec.apply_model(lambda m: {"mtp.fc.weight": m.mtp.fc.weight.detach().clone(),
                                      "mtp.norm.weight": m.mtp.norm.weight.detach().clone()})
    assert torch.equal(got["mtp.fc.weight"], want["mtp.fc.weight"])
    assert torch.allclose(got["mtp.norm.weight"], want["mtp.norm.weight"], atol=1e-6)  # (1 + w read back)
    prompts = [{"prompt_token_ids": p} for p in _prompts(seed=2)]
    plain = LLM(str(path), dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
    for a, b in zip(spec.generate(prompts, GREEDY, use_tqdm=False), plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_drained(spec)


def test_qwen35_pre_tokenizer_keeps_marks_in_words(tmp_path):
    """llama.cpp's "qwen35" pre-tokenizer (Qwen3.5's split keeps combining marks in words, Qwen2's does not): the
    real Qwen3 vocabulary in a file that names it encodes as the HF tokenizer with Qwen3.5's split, not Qwen2's."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import AutoTokenizer

    from mili.model.checkpoint import resolve_model_path
    from mili.model.gguf import QWEN35_SPLIT
    from support.checkpoints import QWEN3_TOKENIZER, build_checkpoint

    checkpoint = build_checkpoint(tmp_path / "hf", "gqa4_realvocab")
    path = write_gguf(checkpoint, tmp_path / "qwen35-pre.gguf", "F16", tokenizer_dir=QWEN3_TOKENIZER, pre="qwen35")
    ours = AutoTokenizer.from_pretrained(resolve_model_path(str(path)))
    qwen2, qwen35 = (AutoTokenizer.from_pretrained(QWEN3_TOKENIZER) for _ in range(2))
    qwen35.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    text = "नमस्ते दुनिया, สวัสดีครับ — naïve café, 你好 🌍"
    assert qwen35.encode(text) != qwen2.encode(text)  # (the text tells the two splits apart)
    assert ours.encode(text) == qwen35.encode(text)
    assert ours.decode(ours.encode(text)) == text

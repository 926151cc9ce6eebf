"""Greedy parity with HF transformers in float32, on three tiny random Qwen3 shapes and the trained demo."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM as HFQwen3

from support.engine_state import assert_drained
from support.parity import assert_greedy_matches_hf, hf_greedy
from mili import LLM, SamplingParams
from mili.config import ModelConfig
from mili.model.checkpoint import load_hf_config
from mili.model.loader import load_weights
from mili.model.qwen3 import Qwen3ForCausalLM
from mili.model.batch import ForwardBatch
from mili.runtime.attention.torch_backend import TorchAttentionBackend

PROMPT_LENS = [1, 5, 17, 64, 150, 311]  # 150 and 311 are prefilled in chunks (budget 96 tokens)
MAX_TOKENS = 20


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 30000), (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_greedy(path, prompts):
    return hf_greedy(HFQwen3.from_pretrained(path, dtype=torch.float32).eval(), prompts, MAX_TOKENS)


@pytest.mark.parametrize("shape", ["gqa_untied", "mha_tied", "gqa4_realvocab"])
def test_greedy_matches_hf_generate(qwen3_checkpoint, shape):
    path = qwen3_checkpoint(shape)
    prompts = _prompts(load_hf_config(str(path)).vocab_size)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=96, page_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    reference = _hf_greedy(path, prompts)
    assert_greedy_matches_hf(ours, reference, MAX_TOKENS)
    assert_drained(llm)


def test_trained_demo_greedy_matches_hf_generate():
    """The shipped `demo` (trained weights, its own BPE tokenizer), on chat prompts and on random ids."""
    from transformers import AutoTokenizer

    from mili.model.demo import demo_checkpoint

    path = demo_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    chats = [tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True,
                                     enable_thinking=thinking)
             for text, thinking in [("Hello", True), ("Hello", False), ("Tell me about wisdom.", False)]]
    prompts = [tok(c, add_special_tokens=False)["input_ids"] for c in chats]
    prompts += [tok("And God said, Let there be light", add_special_tokens=False)["input_ids"]]
    prompts += _prompts(tok.vocab_size)[2:5]
    llm = LLM(path, dtype="float32", max_num_batched_tokens=96, page_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_greedy_matches_hf(ours, _hf_greedy(path, prompts), MAX_TOKENS)


@pytest.mark.parametrize("shape", ["gqa_untied", "mha_tied"])
def test_chunked_paged_logits_match_hf(qwen3_checkpoint, shape):
    """Prefill in three chunks over scattered pages, then decodes: every position's logits agree to 1e-4."""
    path = str(qwen3_checkpoint(shape))
    hf_config = load_hf_config(path)
    cfg = ModelConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg, TorchAttentionBackend(), torch.float32)
    model = model.to_empty(device="cpu")
    load_weights(model, path)
    model.init_rotary(1024, torch.device("cpu"))
    page_size, length = 8, 53
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(3))
    pages = torch.tensor([[9, 2, 7, 0, 4, 11, 5]])  # deliberately out of order
    shape_kv = (12, page_size, cfg.num_key_value_heads, cfg.head_dim)
    kv = [(torch.zeros(shape_kv), torch.zeros(shape_kv)) for _ in range(cfg.num_hidden_layers)]
    chunks = [(0, 20), (20, 37), (37, 51), (51, 52), (52, 53)]
    logits = []
    for start, end in chunks:
        pos = torch.arange(start, end)
        batch = ForwardBatch(ids[start:end], pos, pages[0][pos // page_size] * page_size + pos % page_size,
                             pages, [end - start], [end], int(end - start == 1), torch.arange(end - start))
        with torch.no_grad():
            logits.append(model.compute_logits(model(batch, kv)))
    ours = torch.cat(logits)
    with torch.no_grad():
        ref = HFQwen3.from_pretrained(path, dtype=torch.float32)(ids[None]).logits[0]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4

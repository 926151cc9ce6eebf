"""The whole engine on its Triton path (kernels under TRITON_INTERPRET=1 on the CPU) vs HF greedy."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mili import LLM, InvalidRequest, SamplingParams  # noqa: E402
from mili.runtime.cuda_graph import padded_batch_size  # noqa: E402
from mili.runtime.plan import AttentionBackend, graph_batch_sizes  # noqa: E402


def test_engine_on_triton_matches_hf(tiny_checkpoint):
    from transformers import Qwen3ForCausalLM

    prompts = [list(range(3, 3 + n)) for n in (1, 9, 40)]  # 40 > budget 24: a cached prefix + chunk
    llm = LLM(str(tiny_checkpoint), dtype="float32", attention_backend="triton", max_num_batched_tokens=24)
    assert llm.engine.plan.attention is AttentionBackend.TRITON
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    hf = Qwen3ForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref
    llm.engine.check_integrity()


def test_backend_choice(tiny_checkpoint, monkeypatch):
    auto = LLM(str(tiny_checkpoint), dtype="float32").engine.plan.attention
    assert auto is (AttentionBackend.TRITON if torch.cuda.is_available() else AttentionBackend.TORCH)
    with pytest.raises(InvalidRequest, match="power of two >= 16"):
        LLM(str(tiny_checkpoint), attention_backend="triton", page_size=8)
    with pytest.raises(InvalidRequest, match="<= 64"):  # larger pages outgrow sm_89 (the compile check)
        LLM(str(tiny_checkpoint), attention_backend="triton", page_size=128)
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(InvalidRequest, match="TRITON_INTERPRET"):
            LLM(str(tiny_checkpoint), attention_backend="triton")
    with pytest.raises(InvalidRequest, match="attention_backend"):
        LLM(str(tiny_checkpoint), attention_backend="flash")


def test_cuda_graph_ladder():
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256 and list(sizes) == sorted(set(sizes))
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 8, 9, 17, 256)] == [1, 4, 8, 16, 32, 256]
    assert padded_batch_size(257, sizes) is None
    # vLLM's cap: no graph above 512 sequences (a larger decode batch runs eagerly)
    assert graph_batch_sizes(1024) == graph_batch_sizes(512) and graph_batch_sizes(1024)[-1] == 512
    assert padded_batch_size(513, graph_batch_sizes(1024)) is None

"""`mili serve` on a Qwen3 MoE checkpoint: the same API, streamed and not, with the official client."""

from __future__ import annotations

import pytest
from openai import OpenAI

from support.checkpoints import build_moe_checkpoint

EXTRA = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def moe_server(serve, tmp_path_factory):
    path = build_moe_checkpoint(tmp_path_factory.mktemp("moe") / "moe", vocab_size=151936, num_experts=8,
                                num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
    return serve(path)


def test_moe_checkpoint_serves(moe_server):
    client = OpenAI(base_url=f"{moe_server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hello, " * 20}]  # past a 16-token page: cacheable
    whole = client.chat.completions.create(model="test", messages=messages, max_tokens=12, temperature=0,
                                           extra_body=EXTRA)
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    streamed = client.chat.completions.create(model="test", messages=messages, max_tokens=12, temperature=0,
                                              stream=True, extra_body=EXTRA)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same tokens
    again = client.chat.completions.create(model="test", messages=messages, max_tokens=12, temperature=0,
                                           extra_body=EXTRA)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache works for MoE too
    assert again.choices[0].message == whole.choices[0].message

"""`mili serve` with n-gram speculative decoding, set in the config file: a scripted checkpoint answers the
openai client with the text it writes without speculation, the drafts copied from the prompt are accepted,
and /metrics counts them under vLLM's names."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from support.scripted import build_scripted_checkpoint, script_text
from support.server import Server, metric, wait_for

START, ANSWER = 198, " the quick brown fox jumps over the lazy dog and runs far away"


@pytest.fixture(scope="module")
def served(serve, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    chain = script_text(START, ANSWER)
    path = build_scripted_checkpoint(root / "scripted", chain, hidden=len(chain))
    config = root / "mili.yaml"
    config.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 3\n")
    return serve(path, "--config", str(config)), chain


def test_the_answer_is_the_plain_one_and_the_counters_count(served):
    server, chain = served
    ids = [START]
    while ids[-1] in chain:
        ids.append(chain[ids[-1]])
    answer_ids = ids[1:-1]  # what the model writes after START, before its end token
    prompt = [START, *answer_ids, 13, START]  # the answer once: the n-gram drafts it from here
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model="test", prompt=prompt, max_tokens=40, temperature=0)
    assert out.choices[0].text == ANSWER and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(answer_ids) + 1  # (the end token counts; it is not text)
    assert wait_for(lambda: metric(server.url, "mili:spec_decode_num_drafts_total") > 0)
    drafted = metric(server.url, "mili:spec_decode_num_draft_tokens_total")
    accepted = metric(server.url, "mili:spec_decode_num_accepted_tokens_total")
    drafts = metric(server.url, "mili:spec_decode_num_drafts_total")
    assert accepted >= 0.8 * drafted > 0 and drafts <= len(answer_ids) / 3 + 1, (drafts, drafted, accepted)
    assert metric(server.url, 'mili:spec_decode_num_accepted_tokens_per_pos_total{position="0"}') == drafts


def test_mtp_from_the_command_line(tmp_path):
    """`--speculative-config` with method mtp on a hybrid whose MTP head is scripted to draft right: the plain
    greedy text, the head's drafts accepted and counted."""
    from transformers import AutoTokenizer

    from support.hybrid import build_scripted_hybrid_checkpoint

    cycle = {1000: 2000, 2000: 3000, 3000: 4000, 4000: 1000}
    path = build_scripted_hybrid_checkpoint(tmp_path / "scripted", cycle, mtp=True)
    server = Server(path, "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 3}))
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="test", prompt=[1000, 2000], max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        want = [2000]
        for _ in range(24):
            want.append(cycle[want[-1]])
        assert out.choices[0].text == AutoTokenizer.from_pretrained(path).decode(want[1:])
        assert out.usage.completion_tokens == 24
        drafted = metric(server.url, "mili:spec_decode_num_draft_tokens_total")
        accepted = metric(server.url, "mili:spec_decode_num_accepted_tokens_total")
        assert accepted >= 0.8 * drafted > 0, (drafted, accepted)
    finally:
        assert server.stop() == 0, server.output()

"""Hybrids snapshot their recurrent state where a prompt's chat turns end (issue 60): the API side finds the turn
ends (after each ``<|im_end|>`` and its newline: tokenizer.turn_ends), the engine snapshots their page boundaries
while it prefills, so the first request sharing a system prompt or an earlier conversation with a cached one
resumes there, with the tokens of a cache-off run (float32); the engine's counters and /metrics count those hits;
the page, slot and snapshot invariants hold after every step under pressure (hypothesis)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mili import LLM, SamplingParams
from mili.engine.messages import Stats
from mili.server.metrics import Metrics
from mili.tokenizer.tokenizer import encode_chat, load_tokenizer, turn_end_tokens, turn_ends

from support.checkpoints import QWEN3_TOKENIZER, add_tokenizer
from support.engine_state import assert_drained
from support.hybrid import build_hybrid_checkpoint

PAGE = 16
IM_START, IM_END, NEWLINE = 151644, 151645, 198  # the Qwen3 tokenizer's
TEMPLATE = (Path(__file__).resolve().parents[1] / "data" / "qwen3.5" / "qwen3.5_chat_template.jinja").read_text()
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SYSTEM = ("You are the keeper of a lighthouse on a rocky island. You answer the questions of sailors about the "
          "weather, the tides, the stars and the old wrecks below the cliffs, briefly and in plain words, and you "
          "never invent a ship that did not sink there. ") * 3
QUESTIONS = ("When is the next high tide, and how high will the water rise on the rocks where we keep the boats?",
             "Which ship sank below the cliffs in the winter of 1871, and what cargo did she carry when she went down?",
             "Will it storm tonight, and should the fishing boats stay in the harbour until the wind turns?")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Qwen3.5 (3 Gated DeltaNet layers + 1 attention) with the Qwen3 vocabulary's size, so prompts may hold
    ``<|im_end|>``, and Qwen3.5's chat template."""
    path = build_hybrid_checkpoint(tmp_path_factory.mktemp("chat") / "qwen3_5", "qwen3_5",
                                   shape={"vocab_size": 151936})
    add_tokenizer(path, chat_template=TEMPLATE)
    return path


@pytest.fixture(scope="module")
def pair(checkpoint):
    options = {"dtype": "float32", "max_num_batched_tokens": 128, "page_size": PAGE}
    return LLM(str(checkpoint), **options), LLM(str(checkpoint), enable_prefix_caching=False, **options)


def _chat(llm, conversations):
    """Each conversation's reply, one request after the other: (tokens, cached prompt tokens) of each."""
    outs = [llm.chat(c, GREEDY, use_tqdm=False)[0] for c in conversations]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _ends(tokenizer, conversation) -> list[int]:
    """Where the conversation's turns end in its prompt (after each <|im_end|>\\n)."""
    ids = encode_chat(tokenizer, conversation)[1]
    return [i + 2 for i, t in enumerate(ids) if t == IM_END]


def test_turn_ends_follow_each_im_end_and_its_newline():
    tokenizer = load_tokenizer(str(QWEN3_TOKENIZER))
    tokens = turn_end_tokens(tokenizer)
    assert tokens == (IM_END, NEWLINE)
    prompt = [IM_START, 9, 10, IM_END, NEWLINE, IM_START, 11, IM_END, 12, IM_START, 13, IM_END, NEWLINE, IM_START]
    assert turn_ends(prompt, tokens) == [5, 8, 13]  # (one not followed by a newline ends right after it)
    assert turn_ends(prompt[:-1], tokens) == [5, 8]  # never at the prompt's end: nothing to resume past
    assert turn_ends([7, 8, 9], tokens) == []
    many = [t for i in range(9) for t in (i, IM_END, NEWLINE)] + [1]
    assert turn_ends(many, tokens) == [3, 18, 21, 24, 27]  # the first (a system prompt's) and the last 4
    assert turn_ends(many, tokens, limit=2) == [3, 27]
    assert turn_end_tokens(load_tokenizer(str(Path(__file__).resolve().parents[2] / "mili" / "demo"
                                              / "checkpoint-hybrid"))) == (4091, NEWLINE)


def test_the_first_conversation_sharing_a_system_prompt_resumes_at_its_end(pair, checkpoint):
    on, off = pair
    conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
                     for question in QUESTIONS]
    system_end = _ends(load_tokenizer(str(checkpoint)), conversations[0])[0]
    assert system_end > 3 * PAGE
    before = on.engine.stats()
    got, cached = _chat(on, conversations)
    want, _ = _chat(off, conversations)
    assert got == want
    # the first computes everything and snapshots the system prompt's last page boundary; the second, the first
    # sharing it, resumes there (before: it missed, and only left a snapshot where it parted for the third)
    assert cached[:2] == [0, system_end // PAGE * PAGE] and cached[2] >= cached[1]
    after = on.engine.stats()
    assert after.num_snapshot_hits - before.num_snapshot_hits == 2
    assert after.num_turn_end_hits - before.num_turn_end_hits >= 1
    assert_drained(on)


def test_an_edited_last_message_resumes_at_the_turn_before_it(pair, checkpoint):
    """An earlier conversation's turns are snapshotted too: the same conversation with its last user message
    rewritten (a retry, an edit, a second agent forking it) resumes at the end of the reply before that message."""
    on, off = pair
    history = [{"role": "system", "content": "You answer in one word."},
               {"role": "user", "content": "Name a colour of the sea at dawn, and say why it looks so."},
               {"role": "assistant", "content": "Grey, because the light is low and the sky is overcast still."}]
    first = history + [{"role": "user", "content": "And at noon?"}]
    edited = history + [{"role": "user", "content": "What about the sea at dusk, after the sun has set?"}]
    reply_end = _ends(load_tokenizer(str(checkpoint)), first)[2]
    got, cached = _chat(on, [first, edited])
    want, _ = _chat(off, [first, edited])
    assert got == want
    assert cached == [0, reply_end // PAGE * PAGE] and cached[1] > 0
    assert_drained(on)


def test_metrics_count_snapshot_and_turn_end_hits():
    metrics = Metrics("m")
    for hits, turn_end in ((0, 0), (3, 1), (5, 4)):
        metrics.update_gauges(Stats(0, 0, 10, 10, 0, 0, num_snapshot_hits=hits, num_turn_end_hits=turn_end))
    text = metrics.render().decode()
    assert "mili:prefix_cache_snapshot_hits_total 5.0" in text
    assert "mili:prefix_cache_turn_end_hits_total 4.0" in text


# -- under pressure: many turn ends, few pages, slots and snapshots ---------------------------------------------------

def _segment(i: int) -> list[int]:
    """Turn ``i``'s tokens: a header, some text, <|im_end|> and its newline."""
    n = 5 + 7 * i % 29
    text = torch.randint(0, 151643, (n,), generator=torch.Generator().manual_seed(i)).tolist()
    return [IM_START, *text, IM_END, NEWLINE]


# a prompt: a few of 4 shared turns (so prompts share system prompts and whole conversations), its own last turn
conversation = st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=5), st.integers(100, 10**6))


@pytest.fixture(scope="module")
def tight(checkpoint):
    return LLM(str(checkpoint), dtype="float32", max_num_batched_tokens=48, page_size=PAGE, num_kv_pages=24,
               num_state_slots=3, num_state_snapshots=4, max_num_seqs=3)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(batch=st.lists(conversation, min_size=1, max_size=5))
def test_turn_end_snapshots_keep_every_invariant_and_the_tokens(pair, tight, batch):
    """Every step's pools and tree are whole; the tokens are a cache-off run's; every page and slot comes back. The
    batch runs twice, in turn then at once: the second pass finds the first's snapshots (those LRU eviction left)."""
    _, off = pair
    prompts = [[t for i in turns for t in _segment(i)] + _segment(own)[:-2] for turns, own in batch]
    want = [o.outputs[0].token_ids for o in off.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                         use_tqdm=False)]
    engine = tight.engine
    for together in (False, True):
        requests = []
        for prompt in prompts:
            requests.append(engine.add_request(prompt, GREEDY))
            while engine.has_unfinished_requests() and not together:
                engine.step()
                engine.check_integrity()
        while engine.has_unfinished_requests():
            engine.step()
            engine.check_integrity()
        assert [r.seqs[0].output_token_ids for r in requests] == want
        assert_drained(tight)

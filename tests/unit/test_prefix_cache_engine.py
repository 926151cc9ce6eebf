"""The prefix cache inside the engine: outputs identical with it on and off, hits reported, pool whole."""

from __future__ import annotations

import pytest
import torch

from mili import LLM, SamplingParams
from mili.engine.request import Sequence

from support.engine_state import assert_drained, engine_core

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=50, max_tokens=12, ignore_eos=True, seed=7)
PER_PAGE = 2 * 2 * 16 * 2 * 32 * 4  # bytes of one page of the tiny checkpoint in float32


def _ids(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    on = LLM(str(tiny_checkpoint), dtype="float32", max_num_batched_tokens=64)
    off = LLM(str(tiny_checkpoint), dtype="float32", max_num_batched_tokens=64, enable_prefix_caching=False)
    return on, off


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _whole(llm):
    assert_drained(llm)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_multi_turn_chat_hits_the_whole_history(pair, params):
    on, off = pair
    history_on, history_off = _ids(40, 1), _ids(40, 1)
    for turn in range(4):
        (out_on,), (cached_on,) = _run(on, [history_on], params)
        (out_off,), (cached_off,) = _run(off, [history_off], params)
        assert out_on == out_off
        assert cached_off == 0
        if turn:  # everything but the last partial page of the previous turn's history is cached
            assert cached_on >= (len(history_on) - len(user) - 1) // 16 * 16 - 16 and cached_on > 0
        user = _ids(10 + turn, 100 + turn)
        history_on = history_on + out_on + user
        history_off = history_off + out_off + user
    _whole(on)


def test_shared_system_prompt_identical_and_diverging_prompts(pair):
    on, off = pair
    system = _ids(70, 2)  # 4 full pages + 6 tokens
    prompts = [system + _ids(5 + i, 10 + i) for i in range(5)]
    prompts += [prompts[0], prompts[0]]  # identical prompts
    prompts += [system[:40] + [7, 7, 7]]  # diverges inside the third page
    first, _ = _run(on, prompts[:1], GREEDY)
    got, cached = _run(on, prompts, GREEDY)
    want, _ = _run(off, prompts, GREEDY)
    assert got == want and got[0] == first[0]
    assert all(c >= 64 for c in cached[:7]) and cached[7] == 32
    _whole(on)


def test_n_greater_than_one_and_repeats_share_pages(pair):
    on, off = pair
    prompt = _ids(50, 3)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    a = on.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    b = off.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    again = on.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 48 and [o.token_ids for o in again.outputs] == [o.token_ids for o in a.outputs]
    _whole(on)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_memory_pressure_with_eviction_and_preemption(tiny_checkpoint, pair, policy):
    _, off = pair
    system = _ids(48, 4)
    prompts = [system + _ids(20 + 7 * i, 20 + i) for i in range(10)] + [_ids(90, 40 + i) for i in range(4)]
    want, _ = _run(off, prompts, GREEDY)
    tight = LLM(str(tiny_checkpoint), dtype="float32", max_num_batched_tokens=64,
                kv_cache_memory=24 * PER_PAGE, schedule_policy=policy)
    got, cached = _run(tight, prompts, GREEDY)
    got2, _ = _run(tight, prompts[::-1], GREEDY)  # again, over a cache full of the first run
    assert got == want and got2 == want[::-1]
    assert tight.engine.stats().num_preemptions > 0
    assert sum(cached) > 0
    _whole(tight)


def test_lpm_admits_the_longest_cached_prefix_first_but_not_forever(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), dtype="float32", max_num_seqs=1, schedule_policy="lpm")
    engine, sched = llm.engine, engine_core(llm).scheduler
    sched.starvation_steps = 3
    cached = _ids(64, 5)
    _run(llm, [cached + [1]], SamplingParams(temperature=0, max_tokens=1))
    cold = engine.add_request(_ids(30, 6), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    warm = [engine.add_request(cached + [i + 2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            for i in range(4)]
    order = []
    while engine.has_unfinished_requests():
        engine.step()
        running = [s.request.request_id for s in sched.running if isinstance(s, Sequence)]
        order += [r for r in running if r not in order]
    ids = [r.request_id for r in warm]
    assert order[0] == ids[0], "a cached prompt overtakes the cold one that arrived first"
    assert order.index(cold.request_id) < len(order) - 1, "the starvation guard lets the cold one in"
    _whole(llm)

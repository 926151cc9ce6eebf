"""Prefix caching for the hybrid models: a hit resumes from a snapshot of the recurrent state at a page-aligned
position, with the same greedy tokens as HF and as a cache-off run (float32); the snapshot positions the
design promises (the prompt's last page boundary, the end of a finished request); eviction of pages and
snapshots under pressure; the page, slot and snapshot invariants after every scenario."""

from __future__ import annotations

import pytest
import torch

from support.engine_state import assert_drained, engine_core, runner_parts
from support.hybrid import hf_reference
from mili import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
NEAR_TIE = 1e-3


def _ids(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def pair(hybrid_checkpoint):
    made = {}

    def get(kind):
        if kind not in made:
            path = str(hybrid_checkpoint(kind))
            made[kind] = (LLM(path, dtype="float32", max_num_batched_tokens=96, page_size=16),
                          LLM(path, dtype="float32", max_num_batched_tokens=96, page_size=16,
                              enable_prefix_caching=False))
        return made[kind]

    return get


def _run(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _whole(llm):
    """Nothing runs; every slot is free; every page is free or the cache's; every snapshot is a cache node's."""
    assert_drained(llm)  # (check_integrity: each snapshot used is a live cache node's)


def _hf_greedy(path, kind, prompt, max_tokens=12):
    model = hf_reference(path, kind)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.scores)[:, 0]


def _assert_hf(got, ref):
    tokens, scores = ref
    parted = next((j for j, (a, b) in enumerate(zip(got, tokens)) if a != b), None)
    if parted is not None:
        top2 = scores[parted].topk(2).values
        assert top2[0] - top2[1] < NEAR_TIE, f"parted from HF at step {parted} without a near-tie"


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_320_of_a_325_token_prompt_resumes_at_320_with_hf_tokens(hybrid_checkpoint, pair, kind):
    on, off = pair(kind)
    first = _ids(325, 1)
    second = first[:320] + _ids(7, 2)  # shares 320 tokens: the first prompt's last page boundary
    (out1,), (cached1,) = _run(on, [first])
    (out2,), (cached2,) = _run(on, [second])
    (again,), (cached3,) = _run(on, [first])  # the same prompt again: resumes at 320 too
    assert (cached1, cached2, cached3) == (0, 320, 320)
    want, _ = _run(off, [first, second])
    assert [out1, out2, again] == [want[0], want[1], want[0]]
    _assert_hf(out2, _hf_greedy(hybrid_checkpoint(kind), kind, second))
    _whole(on)


def test_multi_turn_resumes_where_the_reply_ended(hybrid_checkpoint, pair):
    """Each turn resumes at the last page boundary of (previous prompt + reply minus its last token, which is
    never computed): the state at the end of a finished request, or at its latest page boundary."""
    on, off = pair("qwen3_5")
    history = _ids(45, 3)
    for turn in range(4):
        params = SamplingParams(temperature=0, max_tokens=9 + 5 * turn, ignore_eos=True)
        (out,), (cached,) = _run(on, [history], params)
        (want,), _ = _run(off, [history], params)
        assert out == want
        if turn:
            assert cached == (reply_end - 1) // 16 * 16 and cached > previous_prompt_len - 16
        previous_prompt_len, reply_end = len(history), len(history) + len(out)
        history = history + out + _ids(10 + turn, 100 + turn)
    _assert_hf(out, _hf_greedy(hybrid_checkpoint("qwen3_5"), "qwen3_5", history[:previous_prompt_len],
                                max_tokens=len(out)))
    _whole(on)


def test_shared_system_prompt_hits_from_the_second_request_on(pair):
    """The first request's snapshot is at its own prompt's last page boundary, past the shared part; the second
    parts from it at page 9 (144 tokens), computes everything and leaves a snapshot there; the rest hit it."""
    on, off = pair("qwen3_next")
    system = _ids(150, 4)
    prompts = [system + _ids(30 + 5 * i, 10 + i) for i in range(6)]
    got, cached = [], []
    for p in prompts[:2]:  # one after the other
        (out,), (c,) = _run(on, [p])
        got, cached = got + [out], cached + [c]
    rest, rest_cached = _run(on, prompts[2:] + prompts[:1])  # a batch: the later ones, and the first again
    want, _ = _run(off, prompts + prompts[:1])
    assert got + rest == want
    assert cached == [0, 0] and rest_cached == [144] * 4 + [176]
    _whole(on)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_eviction_under_pressure_keeps_the_tokens(hybrid_checkpoint, pair, policy):
    """Few pages and two snapshots: pages and snapshots are evicted (LRU), sequences preempted, tokens unchanged;
    the invariants hold after every step."""
    _, off = pair("qwen3_5")
    system = _ids(48, 5)
    prompts = [system + _ids(20 + 7 * i, 20 + i) for i in range(8)] + [_ids(90, 40 + i) for i in range(3)]
    want, _ = _run(off, prompts)
    tight = LLM(str(hybrid_checkpoint("qwen3_5")), dtype="float32", max_num_batched_tokens=64, page_size=16,
                num_kv_pages=24, num_state_slots=4, num_state_snapshots=3, schedule_policy=policy)
    engine = tight.engine
    for order in (prompts, prompts[::-1]):
        requests = [engine.add_request(p, GREEDY) for p in order]
        while engine.has_unfinished_requests():
            engine.step()
            engine.check_integrity()
        got = [r.seqs[0].output_token_ids for r in requests]
        assert got == (want if order is prompts else want[::-1])
        _whole(tight)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_snapshots_taken > stats.num_snapshots == 3  # more taken than the pool holds: some were evicted
    assert sum(r.num_cached_tokens for r in requests) > 0


def test_aborts_and_preemption_return_slots_and_snapshots(hybrid_checkpoint):
    llm = LLM(str(hybrid_checkpoint("qwen3_5")), dtype="float32", max_num_batched_tokens=64, page_size=16,
              num_state_slots=3, num_state_snapshots=4)
    engine, core = llm.engine, engine_core(llm)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    requests = [engine.add_request(_ids(30 + 20 * i, 50 + i), params) for i in range(5)]
    held = 0
    for _ in range(30):  # prefills, decodes past page boundaries (snapshots held by running sequences)
        core.step()
        engine.check_integrity()
        held = max(held, sum(s.snapshot is not None for s in core.scheduler.running))
    assert held > 0
    victim = core.scheduler.running[-1]
    core.scheduler.preempt(victim)  # as the scheduler does when out of pages: its snapshot goes to the tree
    assert victim.snapshot is None and victim.state_slot is None
    engine.check_integrity()
    core.abort_requests([r.request_id for r in requests])
    _whole(llm)


def test_ready_counts_snapshots_and_zero_snapshots_turn_the_cache_off(hybrid_checkpoint, pair, caplog):
    on, _ = pair("qwen3_5")
    ready, layout = on.engine.info, runner_parts(on).layout
    assert ready.prefix_caching and ready.state_snapshots == on.engine.stats().num_snapshots > 0
    assert ready.state_bytes == (ready.state_slots + ready.state_snapshots) * layout.bytes_per_state_slot
    with caplog.at_level("INFO", logger="mili"):
        none = LLM(str(hybrid_checkpoint("qwen3_5")), dtype="float32", page_size=16, num_state_snapshots=0)
    assert "prefix caching off: num_state_snapshots is 0" in caplog.text
    assert "0 prefix-cache snapshots" in caplog.text and not none.engine.info.prefix_caching
    prompt = _ids(40, 9)
    assert _run(none, [prompt, prompt])[1] == [0, 0]

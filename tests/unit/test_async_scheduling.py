"""Scheduling ahead of the device (``async_scheduling``): the engine core launches step N + 1 before it reads step
N's tokens, which the next step takes on the device. On the CPU nothing overlaps (the step has run when it
returns), but the loop is the same code: these tests force it on and check that it gives exactly the token
streams, logprobs and finish reasons of the synchronous loop, through stop tokens, stop strings, lengths, aborts,
preemption, n > 1, prefix-cache hits, LoRA, a hybrid model's recurrent states, and requests (penalties) that
turn the overlap off while others run."""

from __future__ import annotations

import pytest
import torch

from mili import LLM, SamplingParams

from support.engine_state import assert_drained, engine_core, model_runner


def _prompts(n: int, seed: int, vocab: int = 512, shared: int = 0) -> list[dict]:
    """``n`` random prompts of 1-80 tokens; ``shared``: that many tokens in front of each (prefix-cache hits)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, vocab, (shared,), generator=g).tolist()
    lens = torch.randint(1, 80, (n,), generator=g).tolist()
    return [{"prompt_token_ids": head + torch.randint(0, vocab, (k,), generator=g).tolist()} for k in lens]


def _params(n: int, seed: int, stops: list[int]) -> list[SamplingParams]:
    """A mix: greedy and seeded random rows, lengths that end mid-batch, stop tokens the model does write, logprobs,
    prompt logprobs, min_tokens and n > 1."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        max_tokens = int(torch.randint(1, 30, (1,), generator=g))
        kind = i % 6
        if kind == 0:
            out.append(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        elif kind == 1:
            out.append(SamplingParams(temperature=0, max_tokens=40, stop_token_ids=stops, logprobs=2))
        elif kind == 2:
            out.append(SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=max_tokens, logprobs=1,
                                      ignore_eos=True))
        elif kind == 3:
            out.append(SamplingParams(temperature=0.8, seed=200 + i, n=3, max_tokens=max_tokens, ignore_eos=True))
        elif kind == 4:
            out.append(SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=1, min_tokens=3,
                                      stop_token_ids=stops))
        else:
            out.append(SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2))
    return out


class _Logprob(float):
    """A logprob as compared here: equal within 1e-5 (float32 sums over another batch's shapes differ in their last
    bits: the overlap changes which rows share a step, not what any row computes)."""

    def __eq__(self, other):
        return abs(float(self) - float(other)) <= 1e-5

    __hash__ = float.__hash__


def _streams(outs) -> list:
    """Everything a client sees of each output: tokens, logprobs, finish and stop reasons, prompt logprobs."""
    def lps(entries):
        return None if entries is None else [None if e is None else {t: (_Logprob(p.logprob), p.rank)
                                                                    for t, p in e.items()} for e in entries]

    return [([(c.index, list(c.token_ids), lps(c.logprobs), c.finish_reason, c.stop_reason, c.text)
                            for c in o.outputs], lps(o.prompt_logprobs)) for o in outs]


def _overlapped(llm: LLM) -> list[bool]:
    """Records, for each step the runner executes, whether its draw was left on the device."""
    runner = model_runner(llm)
    execute, flags = runner.execute, []

    def recording(sched, grammar=None, feed=None, defer=False):
        flags.append(defer)
        return execute(sched, grammar, feed, defer)

    runner.execute = recording
    return flags


def _pair(path, **options) -> tuple[LLM, LLM]:
    return (LLM(str(path), dtype="float32", async_scheduling="off", **options),
            LLM(str(path), dtype="float32", async_scheduling="on", **options))


def _stop_tokens(llm: LLM, prompts) -> list[int]:
    """Tokens the model writes early in its greedy answers: stop tokens that do end some requests."""
    outs = llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return sorted({o.outputs[0].token_ids[3] for o in outs})


def test_plan_turns_the_overlap_on_where_asked(tiny_checkpoint):
    sync, ahead = _pair(tiny_checkpoint)
    assert not sync.engine.plan.overlap and ahead.engine.plan.overlap
    assert ahead.engine.plan.describe()["scheduling"] == "ahead of the device"


def test_async_equals_sync_mixed_batch(tiny_checkpoint):
    sync, ahead = _pair(tiny_checkpoint, max_num_batched_tokens=64)
    prompts = _prompts(18, seed=1, shared=20)
    params = _params(18, seed=2, stops=_stop_tokens(sync, prompts))
    flags = _overlapped(ahead)
    expected = _streams(sync.generate(prompts, params, use_tqdm=False))
    got = _streams(ahead.generate(prompts, params, use_tqdm=False))
    assert got == expected
    assert sum(flags) > len(flags) // 2  # most steps did run ahead
    assert {c[3] for cs, _ in expected for c in cs} >= {"stop", "length"}  # (both kinds of ending were met)
    for llm in (sync, ahead):
        assert_drained(llm, evict=True)


def test_async_equals_sync_stop_strings_and_second_round_cache_hits(tiny_checkpoint):
    sync, ahead = _pair(tiny_checkpoint, max_num_batched_tokens=48)
    prompts = _prompts(8, seed=3, shared=40)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    texts = [o.outputs[0].text for o in sync.generate(prompts, greedy, use_tqdm=False)]
    stops = [t[len(t) // 2:len(t) // 2 + 3] for t in texts if len(t) > 8][:3]
    assert stops
    params = SamplingParams(temperature=0, max_tokens=20, stop=stops, ignore_eos=True)
    for _ in range(2):  # the second round hits the prefix cache the first left
        expected = _streams(sync.generate(prompts, params, use_tqdm=False))
        got = _streams(ahead.generate(prompts, params, use_tqdm=False))
        assert got == expected
    assert any(c[4] in stops for cs, _ in expected for c in cs)
    assert engine_core(ahead).prefix_cache.num_evictable() > 0
    for llm in (sync, ahead):
        assert_drained(llm, evict=True)


def test_async_equals_sync_under_preemption(tiny_checkpoint):
    per_page = 2 * 2 * 16 * 2 * 32 * 4  # K+V, layers, page, kv heads, head_dim, float32 (as test_engine's)
    sync, ahead = _pair(tiny_checkpoint, max_num_batched_tokens=64, kv_cache_memory=20 * per_page)
    prompts = _prompts(12, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, max_tokens=24, ignore_eos=True, logprobs=1)] * 6
    expected = _streams(sync.generate(prompts, params, use_tqdm=False))
    got = _streams(ahead.generate(prompts, params, use_tqdm=False))
    assert got == expected
    assert ahead.engine.stats().num_preemptions > 0
    for llm in (sync, ahead):
        assert_drained(llm, evict=True)


def _run_with_abort(llm: LLM, prompts, params, victim: str, after: int) -> dict:
    """Step an engine by hand; abort request ``victim`` once it has ``after`` tokens. Each request's tokens."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p["prompt_token_ids"], params, request_id=str(i))
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
            if out.request_id == victim and len(out.outputs[0].token_ids) >= after and not out.finished:
                engine.abort_request(victim)
    return tokens


def test_async_equals_sync_through_an_abort(tiny_checkpoint):
    sync, ahead = _pair(tiny_checkpoint)
    prompts = _prompts(5, seed=5)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = _run_with_abort(sync, prompts, params, victim="2", after=5)
    got = _run_with_abort(ahead, prompts, params, victim="2", after=5)
    assert got == expected and len(got["2"][0]) == 5
    for llm in (sync, ahead):
        assert_drained(llm, evict=True)


def test_penalties_turn_the_overlap_off_while_they_run(tiny_checkpoint):
    sync, ahead = _pair(tiny_checkpoint, max_num_batched_tokens=64)
    prompts = _prompts(6, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3, presence_penalty=0.5,
                             ignore_eos=True)] * 3
    flags = _overlapped(ahead)
    assert _streams(ahead.generate(prompts, params, use_tqdm=False)) == \
        _streams(sync.generate(prompts, params, use_tqdm=False))
    assert not all(flags) and any(flags)  # in step while the penalised requests ran, ahead once they ended
    assert engine_core(ahead).num_sync_requests == 0
    assert_drained(ahead, evict=True)


def test_async_equals_sync_with_lora(tiny_checkpoint, tmp_path):
    from mili.lora import LoRARequest
    from support.lora import build_adapter

    build_adapter(tiny_checkpoint, tmp_path / "a", seed=1)
    sync, ahead = _pair(tiny_checkpoint, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompts = _prompts(6, seed=7, shared=16)
    loras = [LoRARequest("a", 1, str(tmp_path / "a")), None] * 3
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    expected = _streams(sync.generate(prompts, params, use_tqdm=False, lora_request=loras))
    got = _streams(ahead.generate(prompts, params, use_tqdm=False, lora_request=loras))
    assert got == expected
    base = _streams(sync.generate(prompts[:2], params, use_tqdm=False))
    assert base[1] == expected[1] and base[0] != expected[0]  # (the adapter does change the tokens)


@pytest.mark.parametrize("kind", ["qwen3_5"])
def test_async_equals_sync_on_a_hybrid(hybrid_checkpoint, kind):
    """Recurrent states: a sequence that ended one step late has stepped its state once more, and the prefix cache's
    snapshots must be taken at the positions they name."""
    sync, ahead = _pair(hybrid_checkpoint(kind), max_num_batched_tokens=64, page_size=16)
    prompts = _prompts(8, seed=8, vocab=256, shared=40)
    params = [SamplingParams(temperature=0, max_tokens=int(k), ignore_eos=True) for k in (3, 17, 30, 1, 24, 9, 33, 5)]
    params[5] = SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=12, ignore_eos=True)
    for _ in range(2):  # the second round resumes from the snapshots the first left
        expected = _streams(sync.generate(prompts, params, use_tqdm=False))
        got = _streams(ahead.generate(prompts, params, use_tqdm=False))
        assert got == expected
    for llm in (sync, ahead):
        assert_drained(llm, evict=True)


@pytest.mark.parametrize("bad", ["raise", -1, 10**9])
def test_a_failing_row_fails_its_request_alone_when_ahead(tiny_checkpoint, bad):
    """A row whose draw fails (the sampler raises; no token, NO_TOKEN = -1; an id outside the vocabulary) while steps
    run ahead: the next step was launched with it already (fed a valid id in its place), its request ends with the
    error when the draw is read, the other requests get their in-turn tokens, and every page comes back."""
    from mili.runtime.sampler import Sampler

    sync, ahead = _pair(tiny_checkpoint, max_num_batched_tokens=64)
    prompts = _prompts(3, seed=9)
    mark = 0.77
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=mark, seed=1, n=2, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    expected = _streams(sync.generate(prompts, params, use_tqdm=False))
    real, calls = Sampler.__call__, []

    def faulty(self, logits, meta, defer=False):
        marked = meta.temperature is not None and bool((meta.temperature == mark).any())
        calls.append(marked)
        if marked and len(calls) > 3 and bad == "raise":
            raise RuntimeError("injected sampling fault")
        out = real(self, logits, meta, defer)
        if marked and len(calls) > 3:
            (out.ids if defer else torch.tensor(out.token_ids))[meta.random_rows] = bad  # (in place on the CPU)
        return out

    Sampler.__call__ = faulty
    try:
        outs = ahead.generate(prompts, params, use_tqdm=False)
    finally:
        Sampler.__call__ = real
    assert outs[1].error is not None and all(c.finish_reason == "error" for c in outs[1].outputs)
    assert _streams([outs[0], outs[2]]) == [expected[0], expected[2]]
    assert_drained(ahead, evict=True)
    assert _streams(ahead.generate(prompts, params, use_tqdm=False)) == expected  # (the engine goes on)

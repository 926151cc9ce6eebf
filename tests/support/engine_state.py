"""What an engine holds once its requests have ended, read through its public surface (``LLMEngine.stats()``,
``check_integrity()``, ``reset_prefix_cache()``): nothing running or waiting, no KV page, state slot or snapshot
held by anything but the prefix cache, and the pools' invariants true. And the one way in to the engine's internals
(``engine_core``, ``model_runner``), for what nothing public shows."""

from __future__ import annotations

import torch


def assert_drained(engine, evict: bool = False) -> None:
    """``engine``: an ``LLMEngine`` (or an ``LLM``). ``evict``: also empty the prefix cache, and check that frees
    every page."""
    engine = getattr(engine, "engine", engine)
    engine.check_integrity()
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and stats.num_running == stats.num_waiting == 0
    assert stats.num_pages_held == 0, f"KV pages leaked: {stats}"
    assert stats.num_state_slots_free == stats.num_state_slots, f"state slots leaked: {stats}"
    if evict:
        engine.reset_prefix_cache()
        stats = engine.stats()
        assert stats.num_pages_free == stats.num_pages and stats.num_snapshots_used == 0, stats
        engine.check_integrity()


# -- the engine's internals, for what nothing public shows -------------------------------------------------------
# The two reach-ins of the suite into the engine (tests/unit/test_reach_ins.py counts them): every test that needs
# the core's scheduler, pools or drafter, or the runner's parts, gets them here.


def engine_core(engine):
    """The engine core behind an ``LLM``, an ``LLMEngine`` or an in-thread ``AsyncLLM``: its scheduler, page pool,
    prefix cache, drafter and grammars."""
    engine = getattr(engine, "engine", engine)
    # reach-in: the pages' reference counts, the scheduler's queues and limits, a fault injected into a step
    return engine.core


def model_runner(engine):
    """The model runner (``runner.parts``: ``RunnerParts``, what it runs on: the model, the KV caches, the sampler,
    the LoRA slots, the encoder cache, the recurrent states, the C decode layer, the CUDA graphs)."""
    # reach-in: raw logits, the recurrent-state tensors, the encoder cache's occupancy, faults and spies in its parts
    return engine_core(engine).runner


def runner_parts(engine):
    """``model_runner(engine).parts``."""
    return model_runner(engine).parts


def forward_logits(engine):
    """The scheduler's next step run by hand: its sampling rows' raw logits ([S, V], the runner's own kernels and KV
    cache), no token sampled; the scheduler then moves on as after a step."""
    core = engine_core(engine)
    sched = core.scheduler.schedule()
    logits, *_ = model_runner(engine).forward_logits(sched.scheduled)
    core.scheduler.after_step(sched.scheduled)
    return logits


def prefill_outputs(llm, prompt: list[int], head: bool = True) -> torch.Tensor:
    """The model's output after every position of ``prompt``, from one prefill run by hand through the engine's own
    runner (its kernels, its KV cache): the logits ([len, vocab]), or with ``head=False`` the final hidden states."""
    from mili import SamplingParams

    core, parts = engine_core(llm), runner_parts(llm)
    request = llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    sched = core.scheduler.schedule()
    assert [s.num_new_tokens for s in sched.scheduled] == [len(prompt)]  # the whole prompt in one step
    batch, _ = parts.batches.prepare(sched.scheduled)
    batch.logits_indices = torch.arange(len(prompt), device=batch.input_ids.device)
    with torch.inference_mode():
        out = parts.model(batch, parts.kv_caches)
        out = parts.model.compute_logits(out) if head else out
    core.scheduler.after_step(sched.scheduled)
    llm.engine.abort_request(request.request_id)
    return out

"""The engine end to end on a tiny checkpoint: continuous batching, preemption, n > 1, bad input."""

from __future__ import annotations

import pytest
import torch

from mili import LLM, ContextLengthExceeded, InvalidRequest, ModelLoadError, SamplingParams
from mili.engine.request import SeqStatus

from support.engine_state import assert_drained, engine_core

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(n=10, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 120, (n,), generator=g).tolist()
    return [{"prompt_token_ids": torch.randint(0, vocab, (k,), generator=g).tolist()} for k in lens]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), dtype="float32", max_num_batched_tokens=64)


def _assert_clean(llm):
    """Nothing runs, and every page is free or idle in the prefix cache (evicting those frees all)."""
    assert_drained(llm, evict=True)


def test_preemption_gives_identical_outputs(tiny_checkpoint, llm):
    prompts = _prompts(12)
    ample = llm.generate(prompts, GREEDY, use_tqdm=False)
    # 20 pages of 16 tokens: enough for the longest request alone, far too few for the batch.
    per_page = 2 * 2 * 16 * 2 * 32 * 4  # K+V, layers, page, kv heads, head_dim, float32
    tight = LLM(str(tiny_checkpoint), dtype="float32", max_num_batched_tokens=64,
                kv_cache_memory=20 * per_page)
    assert tight.engine.stats().num_pages == 20
    outs = tight.generate(prompts, GREEDY, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ample]
    _assert_clean(tight)
    _assert_clean(llm)


def test_continuous_batching_joins_mid_run(llm, monkeypatch):
    """A request added while others decode joins the running batch (its prefill chunks run in the same
    forward passes as their decodes) and gets the same tokens as when it runs alone."""
    engine = llm.engine
    prompts = _prompts(4, seed=5)
    alone = llm.generate(prompts, GREEDY, use_tqdm=False)
    steps = []
    schedule = engine_core(engine).scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append([(s.seq.request.request_id, s.num_new_tokens) for s in out.scheduled])
        return out

    monkeypatch.setattr(engine_core(engine).scheduler, "schedule", recording_schedule)
    r0 = engine.add_request(prompts[0]["prompt_token_ids"], GREEDY)
    r1 = engine.add_request(prompts[1]["prompt_token_ids"], GREEDY)
    for _ in range(6):
        engine.step()
    r2 = engine.add_request(prompts[2]["prompt_token_ids"], GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    joined = [s for s in steps if any(rid == r2.request_id for rid, _ in s)][0]
    assert {r0.request_id, r1.request_id} <= {rid for rid, _ in joined}, "r2 joined a running batch"
    for req, ref in zip((r0, r1, r2), alone):
        assert finished[req.request_id].outputs[0].token_ids == ref.outputs[0].token_ids
    _assert_clean(llm)


def test_n_shares_prompt_pages(llm):
    engine = llm.engine
    prompt = list(range(40))  # 2.5 pages: the partial page is copied on write
    req = engine.add_request(prompt, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))
    while any(s.status == SeqStatus.UNBORN for s in req.seqs):
        engine.step()
    tables = [s.page_table for s in req.seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2], "full prompt pages are shared"
    pool = engine_core(engine).pages  # (the pages' reference counts: nothing public shows them)
    cached = {p for pages in engine_core(engine).prefix_cache.holders() for p in pages}  # the cache holds one ref too
    assert all(pool.ref_counts[p] == 3 + (p in cached) for p in tables[0][:2])
    while engine.has_unfinished_requests():
        engine.step()
    outs = [s.output_token_ids for s in req.seqs]
    assert outs[0] == outs[1] == outs[2]  # greedy: the copies see the same KV
    single = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8,
                                                                    ignore_eos=True), use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0]
    _assert_clean(llm)


def test_max_num_seqs_counts_the_siblings_n_will_fork(tiny_checkpoint):
    """n > 1: a first sequence's unborn siblings hold their seats from its admission, so no step runs more than
    max_num_seqs sequences once they fork (a request admitted beside them would overrun the page-table rows)."""
    small = LLM(str(tiny_checkpoint), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)
    engine = small.engine
    widest = []
    schedule = engine_core(engine).scheduler.schedule

    def recording_schedule():
        out = schedule()
        widest.append(len(engine_core(engine).scheduler.running))
        return out

    engine_core(engine).scheduler.schedule = recording_schedule
    params = [SamplingParams(n=n, temperature=0, max_tokens=3, ignore_eos=True) for n in (3, 1, 3, 2)]
    outs = small.generate([{"prompt_token_ids": [i]} for i in range(4)], params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 1, 3, 2]
    assert max(widest) == 4  # (3 + 1 fit; the second n = 3 waits for them, then 2 wait for it)
    _assert_clean(small)


def test_seeded_sampling_is_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    prompt = _prompts(1, seed=9)[0]
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    others = _prompts(6, seed=10)
    mixed = llm.generate(others[:3] + [prompt] + others[3:],
                         [SamplingParams(temperature=1.0, max_tokens=16)] * 3 + [params]
                         + [SamplingParams(temperature=0.7, seed=5, max_tokens=16)] * 3, use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone
    n2 = llm.generate(prompt, SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=16, seed=1234,
                                             ignore_eos=True), use_tqdm=False)[0]
    assert n2.outputs[0].token_ids == alone and n2.outputs[1].token_ids != alone
    _assert_clean(llm)


def test_stop_token_ids_max_tokens_and_min_tokens(llm):
    prompt = _prompts(1, seed=2)[0]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == free.token_ids[:first + 1]
    late = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok],
                                               min_tokens=first + 2), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= first + 2 and stop_tok not in late.token_ids[:first + 2]


def test_prompt_strings_and_output_order(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint("gqa4_realvocab")), dtype="float32")
    texts = ["Hello there", "你好，世界", "a b c d e f g"]
    outs = llm.generate(texts, GREEDY, use_tqdm=False)
    tok = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in outs] == [tok.encode(p) for p in texts]
    assert [o.prompt for o in outs] == texts
    for o in outs:
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    chat = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template_kwargs={"enable_thinking": False},
                    use_tqdm=False)[0]
    expected = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=False)
    assert chat.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    assert expected.endswith("<think>\n\n</think>\n\n")
    # a string that encodes to ids past a small model's vocabulary is a clear error, not a crash
    small = LLM(str(qwen3_checkpoint("gqa_untied")), dtype="float32")
    with pytest.raises(InvalidRequest, match="prompt token ids"):
        small.generate("你好", GREEDY, use_tqdm=False)
    _assert_clean(small)


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(n=0), "n"), (dict(logprobs=99), "logprobs"), (dict(min_p=2.0), "min_p"),
])
def test_bad_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_bad_requests(llm):
    limit = llm.engine.max_model_len
    with pytest.raises(ContextLengthExceeded, match=f"maximum context length is {limit}") as e:
        llm.generate({"prompt_token_ids": [1] * (limit + 1)}, GREEDY, use_tqdm=False)
    assert e.value.param == "prompt" and isinstance(e.value, ValueError)
    with pytest.raises(ContextLengthExceeded) as e:
        llm.generate({"prompt_token_ids": [1] * (limit - 5)}, SamplingParams(max_tokens=10), use_tqdm=False)
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequest, match="prompt"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequest, match="prompt"):
        llm.generate({"prompt_token_ids": [10**7]}, GREEDY, use_tqdm=False)
    _assert_clean(llm)  # the failed calls left nothing behind
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_bad_model_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist") as e:
        LLM(str(tmp_path / "nope"))
    assert isinstance(e.value, ValueError) and e.value.param == "model"
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture_and_missing_weights(tmp_path, tiny_checkpoint):
    import json
    import shutil

    bad = tmp_path / "llama"
    shutil.copytree(tiny_checkpoint, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLM(str(bad))
    missing = tmp_path / "missing"
    shutil.copytree(tiny_checkpoint, missing)
    from safetensors.torch import load_file, save_file

    weights = load_file(missing / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lacks 1 weights"):
        LLM(str(missing))
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="shape"):
        LLM(str(missing))


def test_hub_id_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="could not fetch 'Qwen/Qwen3-0.6B'"):
        LLM("Qwen/Qwen3-0.6B")
